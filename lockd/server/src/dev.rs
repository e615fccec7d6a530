//! `lockd dev`: a three-node cluster in one process, for trying lockd and for local development.
//! Same code paths as a real deployment (three Raft nodes talking gRPC over loopback, each with
//! its own redb file); only the process boundary is missing.

use std::path::PathBuf;

use tokio_util::sync::CancellationToken;

use crate::config::{NodeConfig, Tuning};
use crate::node;

pub(crate) const DEV_LOCK_PORTS: [u16; 3] = [7001, 7002, 7003];
pub(crate) const DEV_METRICS_PORTS: [u16; 3] = [9101, 9102, 9103];

/// Runs `lockd dev`: three nodes on `host` (ports 7001-7003, metrics 9101-9103) with their data
/// under `data_dir` (and, with `tls`, certificates made for them there), answering backups when
/// `allow_backup_without_policy` and membership changes (a dev cluster has no policy) to
/// processes of this user only, with TLS as without, until `shutdown` is cancelled or a node
/// fails. `host` must be a loopback address.
pub async fn run(
    data_dir: PathBuf,
    host: std::net::Ipv4Addr,
    tuning: Tuning,
    tls: bool,
    allow_backup_without_policy: bool,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    // A dev cluster answers admin calls without a policy: never to the network.
    if !host.is_loopback() {
        anyhow::bail!("--host {host} is not a loopback address: `lockd dev` binds only 127.x.y.z");
    }
    // Everything the nodes read from it (keys, certificates, the log) must be this user's alone.
    crate::storage::private_dir(&data_dir)?;
    let certs = if tls {
        Some(crate::tls::dev::make(&data_dir.join("tls"), host, 3)?)
    } else {
        None
    };
    let peers: Vec<crate::config::Peer> = DEV_LOCK_PORTS
        .iter()
        .enumerate()
        .map(|(i, port)| crate::config::Peer {
            id: i as u64 + 1,
            addr: format!("{host}:{port}"),
        })
        .collect();
    let mut nodes = Vec::new();
    for (i, peer) in peers.iter().enumerate() {
        let config = NodeConfig::new(
            peer.id,
            peer.addr.parse()?,
            peers.clone(),
            data_dir.join(peer.id.to_string()),
            Some(format!("{host}:{}", DEV_METRICS_PORTS[i]).parse()?),
            per_node(&tuning, peer.id),
        )
        .and_then(|c| match &certs {
            Some(certs) => {
                let (cert, key) = certs.node(peer.id);
                c.with_security(
                    crate::tls::DEFAULT_CLUSTER_ID.to_owned(),
                    Some(cert),
                    Some(key),
                    Some(certs.ca.clone()),
                    None,
                    false,
                )
            }
            None => Ok(c),
        })
        .map(|c| c.allow_backup_without_policy(allow_backup_without_policy))
        // A dev cluster on loopback is the place to try `lockctl member` and `leader transfer`:
        // for this user's processes only, with TLS too (`local_peer::LocalPeers::AdminSameUser`),
        // since the other local users reach the port as well.
        .map(|c| c.allow_membership_without_policy(true))
        .map(|c| c.admin_calls_from_own_user_only(true))
        .map_err(|e| anyhow::anyhow!(e))?;
        nodes.push(node::start(config, shutdown.clone()).await?);
    }
    let endpoints = peers
        .iter()
        .map(|p| p.addr.as_str())
        .collect::<Vec<_>>()
        .join(",");
    // One write, and a closed stdout (a supervisor that stopped reading) is not a reason to
    // stop serving: the banner is a courtesy, the replicas are the product.
    let banner = format!(
        "lockd dev: 3 replicas running, data in {dir}\n  \
         gRPC endpoints:  {endpoints}\n  \
         metrics:         http://{host}:9101/metrics (9102, 9103)\n  \
         try:             lockctl --endpoints {endpoints}{cacert} acquire demo/job --ttl 30s\n  \
         stop with Ctrl-C\n",
        dir = data_dir.display(),
        cacert = certs
            .as_ref()
            .map(|c| format!(" --cacert {}", c.ca.display()))
            .unwrap_or_default(),
    );
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(banner.as_bytes()).and_then(|()| out.flush());
    }
    for n in nodes {
        n.done.await??;
    }
    Ok(())
}

/// The nodes of one process share the tuning, but each writes its own audit file
/// (`PATH.1`, `PATH.2`, `PATH.3`); stdout is shared, and each line names its node.
fn per_node(tuning: &Tuning, id: u64) -> Tuning {
    let mut t = tuning.clone();
    if let Some(path) = &tuning.audit_log
        && path.as_os_str() != "-"
    {
        t.audit_log = Some(PathBuf::from(format!("{}.{id}", path.display())));
    }
    t
}
