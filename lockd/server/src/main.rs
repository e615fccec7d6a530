//! `lockd`: the Raft lock daemon. Parses flags, sets up logging, runs a node (or `lockd dev`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};
use lockd_server::config::{NodeConfig, Peer, Tuning};
use lockd_service_kit::cli_docs::DocsCommand;
use lockd_service_kit::config_file::{self, ParseError};
use lockd_service_kit::flag_errors::{FlagErrors, USAGE_EXIT};
use lockd_service_kit::log::init_tracing;
use tokio_util::sync::CancellationToken;

/// lockd: a replicated lock service with fencing tokens.
///
/// Three nodes started with the same --peer list form one cluster. Clients may call any node.
#[derive(Parser, Debug)]
#[command(
    name = "lockd",
    version,
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Cmd>,
    /// TOML file of flag values: each key a flag's name (`heartbeat = "250ms"`, `peer = [...]`),
    /// the `dev` command's in a `[dev]` table. Flags and environment variables override it.
    // Read by `config_file::parse` before clap parses; declared for --help and the parse.
    #[arg(
        long = "config",
        env = "LOCKD_CONFIG",
        global = true,
        value_name = "FILE"
    )]
    _config: Option<PathBuf>,
    /// This node's id, as in the --peer list.
    #[arg(long, env = "LOCKD_ID", required = true)]
    id: Option<u64>,
    /// Address of this node's gRPC port (clients and replication).
    #[arg(long, env = "LOCKD_LISTEN", required = true)]
    listen: Option<SocketAddr>,
    /// A member as ID=HOST:PORT; repeat for every member, this node included.
    #[arg(long = "peer", env = "LOCKD_PEERS", value_delimiter = ',')]
    peers: Vec<Peer>,
    /// Where this node keeps its Raft log, vote and snapshots.
    #[arg(long, env = "LOCKD_DATA_DIR", required = true)]
    data_dir: Option<PathBuf>,
    /// Serve /metrics, /healthz and /readyz here.
    #[arg(long, env = "LOCKD_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
    /// Names the cluster: sent on every replication message (two clusters never mix) and part
    /// of the node certificates' names, `node-<id>.<cluster-id>.lockd`.
    #[arg(long, env = "LOCKD_CLUSTER_ID", default_value = lockd_server::tls::DEFAULT_CLUSTER_ID)]
    cluster_id: String,
    /// This node's certificate (PEM): served to clients and peers, presented to peers. Must name
    /// `node-<id>.<cluster-id>.lockd` and the address clients dial. Turns TLS on, with
    /// --tls-key and --peer-ca.
    #[arg(long = "tls-cert", env = "LOCKD_TLS_CERT")]
    cert: Option<PathBuf>,
    /// This node's private key (PEM).
    #[arg(long = "tls-key", env = "LOCKD_TLS_KEY")]
    key: Option<PathBuf>,
    /// The CA (PEM) that issues node certificates: replication is accepted only from callers
    /// with a certificate from it that names the node they claim to be.
    #[arg(long, env = "LOCKD_PEER_CA")]
    peer_ca: Option<PathBuf>,
    /// A CA (PEM) whose client certificates the port also accepts (identities for clients).
    #[arg(long = "tls-client-ca", env = "LOCKD_TLS_CLIENT_CA")]
    client_ca: Option<PathBuf>,
    /// Run without TLS on a non-loopback --listen: anyone who reaches the port can then send
    /// replication messages. Only for a network you trust. On a loopback --listen it lets every
    /// local process (not only this user's) call the internal services.
    #[arg(long, env = "LOCKD_INSECURE_PLAINTEXT")]
    insecure_plaintext: bool,
    /// Authorization policy (TOML): which identities may do which operations on which resource
    /// prefixes. Needs TLS. Without it every caller may do everything.
    #[arg(long, env = "LOCKD_AUTH_POLICY")]
    auth_policy: Option<PathBuf>,
    /// Bearer tokens: one `NAME SHA256-HEX-OF-SECRET` per line (`#` comments); a caller sending
    /// `authorization: Bearer <secret>` is `token:NAME`. Needs --auth-policy.
    #[arg(long, env = "LOCKD_AUTH_TOKENS")]
    auth_tokens: Option<PathBuf>,
    /// Without --auth-policy, answer `lockctl snapshot save` at all. A backup holds the private
    /// sequencer signing keys and every lease id: with this flag ANYONE who reaches the port (or
    /// any sidecar, TLS terminator, tunnel or port-forward in front of it) can download them and
    /// forge sequencers. Without it, and without a policy, backups are refused. With a policy, its
    /// `admin` operation decides and this flag changes nothing.
    #[arg(long, env = "LOCKD_ALLOW_BACKUP_WITHOUT_POLICY")]
    allow_backup_without_policy: bool,
    /// Without --auth-policy, answer `lockctl member add/promote/remove` and `lockctl leader
    /// transfer` at all: with this flag ANYONE who reaches the port can remove voters down to one
    /// or move leadership in a loop. Without it, and without a policy, they are refused
    /// (`member list` still answers). With a policy, its `admin` operation decides and this flag
    /// changes nothing.
    #[arg(long, env = "LOCKD_ALLOW_MEMBERSHIP_WITHOUT_POLICY")]
    allow_membership_without_policy: bool,
    /// Join a running cluster instead of forming one: start with an empty --data-dir, list this
    /// node and the current members in --peer, then run `lockctl member add ID=HOST:PORT`. The
    /// node never proposes a membership of its own.
    #[arg(long, env = "LOCKD_JOIN")]
    join: bool,
    #[command(flatten)]
    tuning: Tuning,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Prepare an empty data dir to found a new cluster of the --peer nodes on its next start,
    /// without asking them: needed once for a single-node cluster (a --peer list of this node
    /// alone), then start `lockd` as usual. Refused on a data dir that holds state. The founding
    /// lives in the data dir, never in the flags of the running node, so a node that later
    /// loses its disk waits for its cluster instead of founding a second one whose tokens start
    /// again from 1.
    Init {
        /// This node's id, as in the --peer list.
        #[arg(long, env = "LOCKD_ID")]
        id: u64,
        /// The data dir to prepare (the node's --data-dir).
        #[arg(long, env = "LOCKD_DATA_DIR")]
        data_dir: PathBuf,
        /// A founding member as ID=HOST:PORT; repeat for every one, this node included.
        #[arg(
            long = "peer",
            env = "LOCKD_PEERS",
            value_delimiter = ',',
            required = true
        )]
        peers: Vec<Peer>,
    },
    /// Three replicas in one process on 127.0.0.1:7001-7003 (metrics on 9101-9103).
    Dev {
        /// Folder for the three nodes' data.
        #[arg(long, default_value = "lockd-dev-data")]
        data_dir: PathBuf,
        /// Loopback address to bind (any 127.x.y.z), so several dev clusters can run side by side.
        /// Anything else is refused: a dev cluster answers membership changes without a policy.
        #[arg(long, default_value = "127.0.0.1", value_parser = loopback_host)]
        host: std::net::Ipv4Addr,
        /// TLS with a throwaway CA and node certificates made in DATA_DIR/tls (ca.pem is what
        /// lockctl needs as --cacert).
        #[arg(long)]
        tls: bool,
        /// Answer `lockctl snapshot save` (dev clusters run without a policy). Off by default as
        /// for `lockd`: a backup holds the signing keys, and anyone who reaches the ports can
        /// take one while this is on.
        #[arg(long)]
        allow_backup_without_policy: bool,
        #[command(flatten)]
        tuning: Tuning,
    },
    /// Seed one member's data dir from a backup (`lockctl snapshot save FILE`). Run it for EVERY
    /// member, with the same FILE, --token-floor and --peer list; then start the members as
    /// usual. The token counter starts above the backup's last token and --token-floor.
    Restore {
        /// The backup file.
        file: PathBuf,
        /// The data dir to seed: must be missing or empty.
        #[arg(long, value_name = "DIR")]
        data_dir: PathBuf,
        /// Required decision: the backup's last fencing token plus a margin for the grants
        /// made after the backup (grant rate x the backup's age), and no less than the highest
        /// token any fence store has accepted (see `fence-proxy epochs max`) plus that margin.
        /// Below the backup's last token is refused; equal to it is warned about. At most 2^62.
        /// Every token of the restored cluster is above it.
        #[arg(long, value_name = "N")]
        token_floor: Option<u64>,
        /// The members of the restored cluster as ID=HOST:PORT, repeated (default: the backup's
        /// members and addresses). Give the same list on every member.
        #[arg(long = "peer", value_delimiter = ',')]
        peers: Vec<Peer>,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    #[command(flatten)]
    Docs(DocsCommand),
}

/// `lockd dev --host`: an IPv4 loopback address (127.x.y.z). A dev cluster runs without a policy
/// and answers membership changes and leader transfers, so it must not be reachable from the
/// network (`0.0.0.0` or a host address would serve it to everyone who reaches the machine).
fn loopback_host(s: &str) -> Result<std::net::Ipv4Addr, String> {
    let host: std::net::Ipv4Addr = s
        .parse()
        .map_err(|e| format!("{s:?} is not an IPv4 address ({e})"))?;
    if !host.is_loopback() {
        return Err(format!(
            "{host} is not a loopback address: `lockd dev` binds only 127.x.y.z, since it \
             answers membership changes and leader transfers without a policy; run `lockd` \
             with --auth-policy to serve other hosts"
        ));
    }
    Ok(host)
}

/// Bad flags: one line like every other lockd error; the usage is what `lockd --help` shows.
const FLAG_ERRORS: FlagErrors = FlagErrors {
    prefix: "lockd: ",
    suffix: "",
    missing_command: "a command or --id, --listen and --data-dir are required; see lockd --help",
};

/// Environment variables that were renamed when durations took one form (`250ms`): a setting
/// that silently stopped working would mislead, so each is refused with its new name.
const RENAMED_ENV: &[(&str, &str)] = &[
    ("LOCKD_HEARTBEAT_MS", "LOCKD_HEARTBEAT"),
    ("LOCKD_ELECTION_TIMEOUT_MS", "LOCKD_ELECTION_TIMEOUT"),
];

/// The error for a renamed environment variable that is set.
fn renamed_env() -> Option<String> {
    RENAMED_ENV.iter().find_map(|(old, new)| {
        std::env::var_os(old).map(|_| {
            format!("{old} was renamed {new}: give it as a duration like 250ms (a bare number is milliseconds)")
        })
    })
}

/// mimalloc rather than the system allocator: at thousands of calls per second allocation is a
/// tenth of the CPU, and glibc's per-thread arenas fragment under the snapshot's large buffers.
/// Built without transparent huge pages (the `no_thp` feature): with them every 2 MiB region the
/// heap touched was resident in full, 16 MB more per idle replica.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    if let Some(e) = renamed_env() {
        eprintln!("lockd: {e}");
        return ExitCode::from(USAGE_EXIT);
    }
    let cli: Cli = match config_file::parse(std::env::args_os().collect(), "LOCKD_CONFIG") {
        Ok(cli) => cli,
        Err(ParseError::Flags(e)) => return FLAG_ERRORS.report(e),
        Err(ParseError::Config(e)) => {
            eprintln!("lockd: {e}");
            return ExitCode::from(USAGE_EXIT);
        }
    };
    // A restore is offline: no runtime, no node.
    if let Some(Cmd::Restore {
        file,
        data_dir,
        token_floor,
        peers,
        json,
    }) = &cli.command
    {
        return restore(
            lockd_server::backup::restore::RestoreOptions {
                file: file.clone(),
                data_dir: data_dir.clone(),
                token_floor: *token_floor,
                peers: peers.clone(),
            },
            *json,
        );
    }
    // Completions and manual pages need no runtime.
    if let Some(Cmd::Docs(docs)) = &cli.command {
        return match docs.run(Cli::command()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("lockd: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("lockd: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lockd: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    let on_signal = shutdown.clone();
    tokio::spawn(async move {
        lockd_server::shutdown_signal().await;
        on_signal.cancel();
    });
    match cli.command {
        Some(Cmd::Init {
            id,
            data_dir,
            peers,
        }) => {
            let mut members = std::collections::BTreeMap::new();
            for p in peers {
                if members.insert(p.id, p.addr).is_some() {
                    anyhow::bail!("lockd init: --peer names node {} twice", p.id);
                }
            }
            lockd_server::node::init(&data_dir, id, &members).await?;
            println!(
                "lockd: {} will found a cluster of nodes {:?} on its next start",
                data_dir.display(),
                members.keys().collect::<Vec<_>>()
            );
            Ok(())
        }
        Some(Cmd::Dev {
            data_dir,
            host,
            tls,
            allow_backup_without_policy,
            tuning,
        }) => {
            tuning.validate().map_err(|e| anyhow::anyhow!(e))?;
            // In one process the nodes start one after another, and openraft logs every refused
            // connection of that moment as an error: quiet it unless RUST_LOG asks.
            init_tracing(tuning.log_format, "info,openraft=off");
            lockd_server::dev::run(
                data_dir,
                host,
                tuning,
                tls,
                allow_backup_without_policy,
                shutdown,
            )
            .await
        }
        Some(Cmd::Docs(docs)) => docs.run(Cli::command()).map_err(anyhow::Error::msg),
        Some(Cmd::Restore { .. }) => Err(anyhow::anyhow!("restore runs before the runtime starts")),
        None => {
            let missing = |flag: &str| {
                anyhow::anyhow!("{flag} is required (or run `lockd dev`); see lockd --help")
            };
            let id = cli.id.ok_or_else(|| missing("--id"))?;
            let listen = cli.listen.ok_or_else(|| missing("--listen"))?;
            let data_dir = cli.data_dir.ok_or_else(|| missing("--data-dir"))?;
            let config = NodeConfig::new(
                id,
                listen,
                cli.peers,
                data_dir,
                cli.metrics_listen,
                cli.tuning,
            )
            .and_then(|c| {
                c.with_security(
                    cli.cluster_id,
                    cli.cert,
                    cli.key,
                    cli.peer_ca,
                    cli.client_ca,
                    cli.insecure_plaintext,
                )
            })
            .and_then(|c| c.with_auth(cli.auth_policy, cli.auth_tokens))
            .map(|c| c.allow_backup_without_policy(cli.allow_backup_without_policy))
            .map(|c| c.allow_membership_without_policy(cli.allow_membership_without_policy))
            .and_then(|c| c.with_join(cli.join))
            .map_err(|e| anyhow::anyhow!(e))?;
            init_tracing(config.tuning.log_format, "info,openraft=warn");
            let node = lockd_server::node::start(config, shutdown).await?;
            node.done.await?
        }
    }
}

/// `lockd restore`: offline, no runtime needed. Prints what it did and what to do next.
fn restore(opts: lockd_server::backup::restore::RestoreOptions, json: bool) -> ExitCode {
    use lockd_server::backup::file::hex;
    let started = std::time::Instant::now();
    let r = match lockd_server::backup::restore::restore(&opts) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("lockd: restore: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    // On stderr in both forms, so that a script reading the JSON still shows it to a person.
    if let Some(w) = &r.warning {
        eprintln!("lockd: restore: warning: {w}");
    }
    let members: Vec<String> = r
        .members
        .iter()
        .map(|(id, a)| format!("{id}={a}"))
        .collect();
    let elapsed_ms = started.elapsed().as_millis() as u64;
    if json {
        println!(
            "{}",
            serde_json::json!({
                "file": opts.file.display().to_string(),
                "data_dir": opts.data_dir.display().to_string(),
                "size_bytes": r.size,
                "sha256": hex(&r.digest),
                "restore_id": r.restore_id,
                "last_applied_index": r.last_log_id.index,
                "last_applied_term": r.last_log_id.leader_id.term,
                "made_by_node": r.header.node_id,
                "created_unix_ms": r.header.created_unix_ms,
                "backup_last_fencing_token": r.report.backup_last_token,
                "token_floor": r.report.token_floor,
                "first_fencing_token": r.report.last_token.saturating_add(1),
                "warning": r.warning,
                "leases": r.report.leases,
                "leases_extended": r.report.leases_extended,
                "waiters": r.report.waiters,
                "dedup_records": r.report.dedup_records,
                "retired_key_id": r.report.retired_key.map(|k| k.to_string()),
                "forgotten_key_id": r.report.forgotten_key.map(|k| k.to_string()),
                "members": members,
                "elapsed_ms": elapsed_ms,
            })
        );
    } else {
        println!(
            "restored             {} into {}",
            opts.file.display(),
            opts.data_dir.display()
        );
        println!(
            "backup               {} bytes, sha256 {}",
            r.size,
            hex(&r.digest)
        );
        println!(
            "covers               log index {} (term {}), made by node {}",
            r.last_log_id.index, r.last_log_id.leader_id.term, r.header.node_id
        );
        println!(
            "fencing tokens       backup's last {}, floor {}: the first grant gets {}",
            r.report.backup_last_token,
            r.report.token_floor,
            r.report.last_token.saturating_add(1)
        );
        println!(
            "kept                 {} leases ({} now last a full ttl from the restart), {} waiters, {} request ids",
            r.report.leases, r.report.leases_extended, r.report.waiters, r.report.dedup_records
        );
        // The operator must hand the new key to the restored cluster's stores, and only to them.
        match (r.report.retired_key, r.report.forgotten_key) {
            (Some(retired), forgotten) => println!(
                "signing keys         the backup's key {retired} is retired (still listed: \
                 sequencers it signed verify){}; the restored cluster's first leader makes a new \
                 key: export it (`lockctl keys export`) to the fence stores of the restored \
                 cluster, never to those of another cluster",
                forgotten.map_or_else(String::new, |f| format!(
                    ", retired key {f} forgotten to make room"
                ))
            ),
            (None, _) => println!(
                "signing keys         none in the backup; the restored cluster's first leader \
                 makes one"
            ),
        }
        println!("members              {}", members.join(" "));
        println!("restore id           {}", r.restore_id);
        println!("took                 {elapsed_ms} ms");
        println!(
            "next                 restore every other member the same way (same file, floor and \
             --peer list: same restore id), then start all members as usual"
        );
    }
    ExitCode::SUCCESS
}
