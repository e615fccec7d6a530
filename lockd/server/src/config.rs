//! Node configuration: the `lockd` flags and tuning knobs, each with its `LOCKD_*` environment
//! variable (the table is in docs/api.md, "Flags and environment").

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use lockd_core::Policy;
use lockd_core::limits::{
    ACTIVE_RESOURCES_PER_TENANT_DEFAULT, DEDUP_RECORDS_PER_TENANT_DEFAULT,
    DEDUP_RETENTION_DEFAULT_MS, WAITERS_PER_RESOURCE_DEFAULT, WAITERS_PER_TENANT_DEFAULT,
};
use lockd_service_kit::durations::parse_duration_or_ms;

/// One peer: `ID=HOST:PORT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    /// The peer's `--id`.
    pub id: u64,
    /// Where the peer serves, `HOST:PORT`.
    pub addr: String,
}

impl std::str::FromStr for Peer {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (id, addr) = s
            .split_once('=')
            .ok_or_else(|| format!("peer {s:?} must look like ID=HOST:PORT"))?;
        let id: u64 = id
            .parse()
            .map_err(|_| format!("peer {s:?}: id {id:?} is not a positive integer"))?;
        if id == 0 {
            return Err(format!("peer {s:?}: id must be at least 1"));
        }
        check_host_port(addr).map_err(|why| format!("peer {s:?}: address {addr:?} {why}"))?;
        Ok(Peer {
            id,
            addr: addr.to_owned(),
        })
    }
}

/// Checks a peer address: `HOST:PORT`, HOST an IPv4 address, an IPv6 address in brackets or a DNS
/// name. A name is kept as written (in the Raft membership too) and resolved again on every
/// connect, so a member that comes back on another IP under the same name (a replaced VM, a
/// rescheduled StatefulSet pod) needs no change anywhere. The error says what is wrong; the caller
/// names the value.
pub(crate) fn check_host_port(addr: &str) -> Result<(), String> {
    if addr.parse::<SocketAddr>().is_ok() {
        return Ok(());
    }
    let (host, port) = addr
        .rsplit_once(':')
        .ok_or_else(|| "is not HOST:PORT (no port)".to_owned())?;
    match port.parse::<u16>() {
        Ok(p) if p > 0 => {}
        _ => {
            return Err(format!(
                "is not HOST:PORT (port {port:?} is not 1 to 65535)"
            ));
        }
    }
    if host.starts_with('[') || host.contains(':') {
        return Err(format!(
            "is not HOST:PORT ({host:?} is not an IPv6 address in brackets)"
        ));
    }
    let name = host.strip_suffix('.').unwrap_or(host);
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= DNS_LABEL_MAX_BYTES
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    };
    if name.is_empty() || name.len() > DNS_NAME_MAX_BYTES || !name.split('.').all(label_ok) {
        return Err(format!(
            "is not HOST:PORT ({host:?} is neither an IP address nor a DNS name of letters, \
             digits and '-' in dot-separated labels of at most {DNS_LABEL_MAX_BYTES} bytes)"
        ));
    }
    // Labels all digits are a mistyped IPv4 address (10.0.0.256), never meant as a name.
    if name
        .split('.')
        .all(|l| l.bytes().all(|b| b.is_ascii_digit()))
    {
        return Err(format!(
            "is not HOST:PORT ({host:?} is not a valid IPv4 address)"
        ));
    }
    Ok(())
}

/// Longest DNS name and label (RFC 1035).
const DNS_NAME_MAX_BYTES: usize = 253;
const DNS_LABEL_MAX_BYTES: usize = 63;

/// `--log-format`: the same two formats as fence-proxy's.
pub use lockd_service_kit::log::LogFormat;

/// Tuning shared by `lockd` and `lockd dev`.
#[derive(Clone, Debug, clap::Args)]
pub struct Tuning {
    /// Raft heartbeat interval, like 250ms. openraft 0.9 also uses it as the timeout of each
    /// AppendEntries call, so it must cover a follower's fsync of a full batch with room to
    /// spare. The old name --heartbeat-ms (a number of milliseconds) still works.
    #[arg(long, env = "LOCKD_HEARTBEAT", alias = "heartbeat-ms", value_name = "DURATION",
          default_value = "250ms", value_parser = parse_duration_or_ms)]
    pub heartbeat: Duration,
    /// Lower bound of the randomised election timeout, like 1s. Upper bound is twice this. The
    /// old name --election-timeout-ms (a number of milliseconds) still works.
    #[arg(long, env = "LOCKD_ELECTION_TIMEOUT", alias = "election-timeout-ms", value_name = "DURATION",
          default_value = "1s", value_parser = parse_duration_or_ms)]
    pub election_timeout: Duration,
    /// Build a snapshot (and purge the log before it) after this many log entries. A snapshot
    /// costs O(table) and a restart replays up to this many entries (of up to 512 commands each);
    /// how the default was chosen is in docs/benchmarks.md. Node N waits (N-1 mod 8)/8 of this
    /// longer, so replicas do not snapshot together.
    #[arg(long, env = "LOCKD_SNAPSHOT_EVERY", default_value_t = 20_000)]
    pub snapshot_every: u64,
    /// Log entries kept behind the snapshot so briefly lagging followers catch up without one.
    #[arg(long, env = "LOCKD_LOGS_KEPT_AFTER_SNAPSHOT", default_value_t = 1_000)]
    pub logs_kept_after_snapshot: u64,
    /// Waiters allowed on one resource.
    #[arg(long, env = "LOCKD_WAITERS_PER_RESOURCE_MAX", default_value_t = WAITERS_PER_RESOURCE_DEFAULT)]
    pub waiters_per_resource_max: u32,
    /// Waiters allowed on all resources of one tenant (the name before its first `/`).
    #[arg(long, env = "LOCKD_WAITERS_PER_TENANT_MAX", default_value_t = WAITERS_PER_TENANT_DEFAULT)]
    pub waiters_per_tenant_max: u32,
    /// Acquires one tenant may have within the 10-minute request_id retention window (each
    /// keeps a dedup record); past it the tenant's new acquires get RESOURCE_EXHAUSTED.
    #[arg(long, env = "LOCKD_DEDUP_RECORDS_PER_TENANT_MAX", default_value_t = DEDUP_RECORDS_PER_TENANT_DEFAULT)]
    pub dedup_records_per_tenant_max: u32,
    /// Resources one tenant may have held or with waiters at once.
    #[arg(long, env = "LOCKD_ACTIVE_RESOURCES_PER_TENANT_MAX", default_value_t = ACTIVE_RESOURCES_PER_TENANT_DEFAULT)]
    pub active_resources_per_tenant_max: u32,
    /// Waiting Acquires (wait_timeout_ms > 0) one source address may have parked on this node
    /// at once, whatever tenants they name; past it a new one gets RESOURCE_EXHAUSTED at once.
    #[arg(long, env = "LOCKD_WAITS_PER_SOURCE_MAX", default_value_t = crate::parked::WAITS_PER_SOURCE_DEFAULT)]
    pub waits_per_source_max: usize,
    /// Waiting Acquires this node keeps parked at once for its clients (calls a member forwarded
    /// to it are counted by that member). Also sizes a follower's connections to the leader.
    #[arg(long, env = "LOCKD_WAITS_MAX", default_value_t = crate::parked::WAITS_DEFAULT)]
    pub waits_max: usize,
    /// Audit log: a file path, or `-` for stdout. One JSON line per state change.
    #[arg(long, env = "LOCKD_AUDIT_LOG")]
    pub audit_log: Option<PathBuf>,
    /// Rotate the audit log file when it would grow past this many bytes.
    #[arg(long, env = "LOCKD_AUDIT_LOG_MAX_BYTES", default_value_t = 100 * 1024 * 1024)]
    pub audit_log_max_bytes: u64,
    /// Key (hex, at least 16 bytes) of the request digests in the audit log, the same on every
    /// node so that digests match across replicas. Default: a random key per node, kept in
    /// `audit.key` in the data dir.
    #[arg(long, env = "LOCKD_AUDIT_KEY_FILE")]
    pub audit_key_file: Option<PathBuf>,
    /// Log format on stderr.
    #[arg(long, env = "LOCKD_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

impl Tuning {
    pub(crate) fn policy(&self) -> Policy {
        Policy {
            waiters_per_resource_max: self.waiters_per_resource_max,
            waiters_per_tenant_max: self.waiters_per_tenant_max,
            dedup_retention_ms: DEDUP_RETENTION_DEFAULT_MS,
            dedup_records_per_tenant_max: self.dedup_records_per_tenant_max,
            active_resources_per_tenant_max: self.active_resources_per_tenant_max,
        }
    }

    /// Refuses flag values that cannot work: an election timeout under three heartbeats, an
    /// audit log cap under 4 KiB, snapshots more often than every 10 entries, a bound on parked
    /// waits outside 1..=[`crate::parked::WAITS_FLAG_MAX`]. The error names the flag.
    pub fn validate(&self) -> Result<(), String> {
        if self.heartbeat.is_zero() || self.election_timeout < 3 * self.heartbeat {
            return Err(format!(
                "--election-timeout {:?} must be at least 3 x --heartbeat {:?} (and heartbeat > 0)",
                self.election_timeout, self.heartbeat
            ));
        }
        if self.audit_log_max_bytes < 4096 {
            return Err(format!(
                "--audit-log-max-bytes {} must be at least 4096",
                self.audit_log_max_bytes
            ));
        }
        for (flag, value) in [
            ("--waits-per-source-max", self.waits_per_source_max),
            ("--waits-max", self.waits_max),
        ] {
            if !(1..=crate::parked::WAITS_FLAG_MAX).contains(&value) {
                return Err(format!(
                    "{flag} {value} must be 1 to {}",
                    crate::parked::WAITS_FLAG_MAX
                ));
            }
        }
        if self.snapshot_every < 10 {
            return Err(format!(
                "--snapshot-every {} must be at least 10",
                self.snapshot_every
            ));
        }
        Ok(())
    }
}

/// Everything one node needs to run.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub(crate) id: u64,
    pub(crate) listen: SocketAddr,
    pub(crate) peers: BTreeMap<u64, String>,
    pub(crate) data_dir: PathBuf,
    pub(crate) metrics_listen: Option<SocketAddr>,
    pub(crate) audit: Option<crate::observe::audit::AuditTarget>,
    /// Limits, timing and logging of the node.
    pub tuning: Tuning,
    /// Names this cluster on every Raft message and in node certificate names.
    pub(crate) cluster_id: String,
    /// Certificates; `None` runs without TLS (replication unauthenticated).
    pub(crate) tls: Option<crate::tls::TlsFiles>,
    /// `--insecure-plaintext`: without TLS, every caller that reaches the port may call the
    /// internal services; without it (on loopback) only processes of this node's user may
    /// (`crate::local_peer`).
    pub(crate) insecure_plaintext: bool,
    /// `--auth-policy` and `--auth-tokens`; `None` runs open (see `crate::auth`).
    pub(crate) auth: Option<crate::auth::AuthFiles>,
    /// `--allow-backup-without-policy`: without a policy, backups for anyone who reaches the port.
    pub(crate) allow_backup_without_policy: bool,
    /// `--allow-membership-without-policy`: without a policy, membership changes and leader
    /// transfers for anyone who reaches the port.
    pub(crate) allow_membership_without_policy: bool,
    /// `lockd dev`: the admin calls (membership, leader transfer, key rotation, backup) only from
    /// processes of this node's user, with TLS as without (`crate::local_peer`): a dev cluster
    /// answers them without a policy, on a port every local user reaches.
    pub(crate) admin_own_user_only: bool,
    /// `--join`: this node is being added to a running cluster (`lockctl member add`). It never
    /// proposes an initial membership, whatever its peers answer; it waits for the leader.
    pub(crate) join: bool,
}

impl NodeConfig {
    /// Checks the parts clap cannot: the peer list must be consistent and contain this node.
    pub fn new(
        id: u64,
        listen: SocketAddr,
        peers: Vec<Peer>,
        data_dir: PathBuf,
        metrics_listen: Option<SocketAddr>,
        tuning: Tuning,
    ) -> Result<Self, String> {
        tuning.validate()?;
        let mut map = BTreeMap::new();
        for p in peers {
            if let Some(prev) = map.insert(p.id, p.addr.clone()) {
                return Err(format!(
                    "--peer id {} given twice ({prev} and {})",
                    p.id, p.addr
                ));
            }
        }
        if map.is_empty() {
            map.insert(id, listen.to_string());
        }
        if !map.contains_key(&id) {
            return Err(format!(
                "--id {id} is not in the --peer list ({:?})",
                map.keys().collect::<Vec<_>>()
            ));
        }
        let audit = match tuning.audit_log.as_deref() {
            None => None,
            Some(p) if p == std::path::Path::new("-") => {
                Some(crate::observe::audit::AuditTarget::Stdout)
            }
            Some(p) => Some(crate::observe::audit::AuditTarget::File {
                path: p.to_path_buf(),
                max_bytes: tuning.audit_log_max_bytes,
            }),
        };
        Ok(NodeConfig {
            id,
            listen,
            peers: map,
            data_dir,
            metrics_listen,
            audit,
            tuning,
            cluster_id: crate::tls::DEFAULT_CLUSTER_ID.to_owned(),
            tls: None,
            insecure_plaintext: false,
            auth: None,
            allow_backup_without_policy: false,
            allow_membership_without_policy: false,
            admin_own_user_only: false,
            join: false,
        })
    }

    /// Sets `--join`: the node waits to be added by the leader and never forms a cluster of its
    /// own. It needs another member in `--peer` to learn the cluster from.
    pub fn with_join(mut self, join: bool) -> Result<Self, String> {
        if join && self.peers.keys().all(|p| *p == self.id) {
            return Err(format!(
                "--join needs at least one existing member in --peer besides this node ({}); \
                 list the members `lockctl member list` shows",
                self.id
            ));
        }
        self.join = join;
        Ok(self)
    }

    /// Sets the cluster id and the certificates (`--cluster-id`, `--tls-cert`, `--tls-key`,
    /// `--peer-ca`, `--tls-client-ca`); checks that they go together.
    pub fn with_security(
        mut self,
        cluster_id: String,
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        peer_ca: Option<PathBuf>,
        client_ca: Option<PathBuf>,
        insecure_plaintext: bool,
    ) -> Result<Self, String> {
        crate::tls::validate_cluster_id(&cluster_id)?;
        self.cluster_id = cluster_id;
        self.insecure_plaintext = insecure_plaintext;
        self.tls = match (cert, key, peer_ca) {
            (Some(cert), Some(key), Some(peer_ca)) => Some(crate::tls::TlsFiles {
                cert,
                key,
                peer_ca,
                client_ca,
            }),
            (None, None, None) if client_ca.is_none() => {
                // Fail closed: without TLS anyone who reaches the port can forge replication,
                // acceptable on loopback (tests, `lockd dev`), where only processes of this
                // user may call the internal services (`crate::local_peer`), and otherwise only
                // when asked for.
                if !self.listen.ip().is_loopback() && !insecure_plaintext {
                    return Err(format!(
                        "--listen {} is not a loopback address and TLS is off: anyone who \
                         reaches it could forge replication messages; give --tls-cert, --tls-key and \
                         --peer-ca, or --insecure-plaintext on a network you trust",
                        self.listen
                    ));
                }
                None
            }
            (None, None, None) => {
                return Err("--tls-client-ca needs --tls-cert, --tls-key and --peer-ca".to_owned());
            }
            (c, k, p) => {
                let missing: Vec<&str> = [
                    ("--tls-cert", c.is_none()),
                    ("--tls-key", k.is_none()),
                    ("--peer-ca", p.is_none()),
                ]
                .into_iter()
                .filter_map(|(f, m)| m.then_some(f))
                .collect();
                return Err(format!(
                    "TLS needs --tls-cert, --tls-key and --peer-ca together; missing {}",
                    missing.join(", ")
                ));
            }
        };
        Ok(self)
    }

    /// Sets `--allow-backup-without-policy`: without `--auth-policy`, `Cluster.SaveSnapshot`
    /// answers any caller (see `service::snapshot::may_save`); without it, it answers none.
    pub fn allow_backup_without_policy(mut self, allow: bool) -> Self {
        self.allow_backup_without_policy = allow;
        self
    }

    /// Sets `--allow-membership-without-policy`: without `--auth-policy`, `AddMember`,
    /// `PromoteMember`, `RemoveMember` and `TransferLeader` answer any caller (see
    /// `service::membership::may_change`); without it, they answer none.
    pub fn allow_membership_without_policy(mut self, allow: bool) -> Self {
        self.allow_membership_without_policy = allow;
        self
    }

    /// Keeps the admin calls (membership, leader transfer, key rotation, backup) to processes of
    /// this node's user, with TLS as without (`lockd dev`; see `crate::local_peer`). Without TLS
    /// on loopback they are kept so anyway.
    pub fn admin_calls_from_own_user_only(mut self, only: bool) -> Self {
        self.admin_own_user_only = only;
        self
    }

    /// Sets `--auth-policy` and `--auth-tokens` (after [`NodeConfig::with_security`]). A policy
    /// needs TLS: identities forwarded between nodes are trusted only from authenticated nodes,
    /// and tokens must not cross the network in clear.
    pub fn with_auth(
        mut self,
        policy: Option<PathBuf>,
        tokens: Option<PathBuf>,
    ) -> Result<Self, String> {
        self.auth = match (policy, tokens) {
            (None, None) => None,
            (None, Some(t)) => {
                return Err(format!(
                    "--auth-tokens {} needs --auth-policy: without a policy nobody is identified",
                    t.display()
                ));
            }
            (Some(p), _) if self.tls.is_none() => {
                return Err(format!(
                    "--auth-policy {} needs TLS (--tls-cert, --tls-key and --peer-ca): \
                     identities forwarded between nodes are trusted only from authenticated nodes",
                    p.display()
                ));
            }
            (Some(policy), tokens) => Some(crate::auth::AuthFiles { policy, tokens }),
        };
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_parsing_names_the_bad_value() {
        assert_eq!(
            "2=127.0.0.1:7002".parse::<Peer>(),
            Ok(Peer {
                id: 2,
                addr: "127.0.0.1:7002".into()
            })
        );
        assert!(
            "x=127.0.0.1:1"
                .parse::<Peer>()
                .unwrap_err()
                .contains("\"x\"")
        );
        assert!("1=nohost".parse::<Peer>().unwrap_err().contains("nohost"));
        // DNS names are kept as written; IPv6 only in brackets.
        for ok in [
            "3=lockd-2.lockd.default.svc.cluster.local:7001",
            "3=node3:7001",
            "3=node3.example.:7001",
            "3=[::1]:7001",
        ] {
            let peer = ok.parse::<Peer>().unwrap_or_else(|e| panic!("{ok}: {e}"));
            assert_eq!(peer.addr, ok[2..]);
        }
        for (bad, says) in [
            ("3=node3", "no port"),
            ("3=node3:0", "port \"0\""),
            ("3=node3:70000", "port \"70000\""),
            ("3=node_3:7001", "neither an IP address nor a DNS name"),
            ("3=-node:7001", "neither an IP address nor a DNS name"),
            ("3=a..b:7001", "neither an IP address nor a DNS name"),
            ("3=:7001", "neither an IP address nor a DNS name"),
            ("3=10.0.0.256:7001", "not a valid IPv4 address"),
            ("3=::1:7001", "IPv6 address in brackets"),
        ] {
            let err = bad.parse::<Peer>().unwrap_err();
            assert!(
                err.contains(says) && err.contains(&bad[2..]),
                "{bad}: {err}"
            );
        }
        let long = format!("3={}.example:7001", "a".repeat(64));
        assert!(
            long.parse::<Peer>()
                .unwrap_err()
                .contains("at most 63 bytes")
        );
        assert!("0=127.0.0.1:1".parse::<Peer>().is_err());
        assert!("127.0.0.1:1".parse::<Peer>().is_err());
    }
}
