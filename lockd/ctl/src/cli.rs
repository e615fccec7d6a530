//! Flags and commands, as docs/api.md ("Flags and environment", lockctl) lists them.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use lockd_service_kit::flag_errors::FlagErrors;

/// The `lockd dev` cluster, so that `lockctl status` works out of the box on a developer machine.
pub const DEFAULT_ENDPOINTS: &str = "127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003";

/// Command-line client of lockd. Exit codes: 0 ok, 1 internal, 2 usage, 3 held, 4 wait timed out,
/// 5 lease not current, 6 waiter limit, 7 invalid argument, 8 outcome unknown, 9 unavailable,
/// 10 hold: lease lost, 11 permission denied, 12 not authenticated; hold otherwise exits with
/// COMMAND's status.
#[derive(Parser, Debug)]
#[command(name = "lockctl", version, about, long_about = None)]
pub struct Cli {
    /// lockd nodes, comma-separated host:port; any node forwards to the leader.
    #[arg(long, global = true, env = "LOCKD_ENDPOINTS", value_delimiter = ',', default_value = DEFAULT_ENDPOINTS)]
    pub endpoints: Vec<String>,

    /// CA certificate (PEM) that issued the nodes' certificates: turns TLS on (https).
    #[arg(long, global = true, env = "LOCKCTL_CACERT")]
    pub cacert: Option<std::path::PathBuf>,

    /// Client certificate (PEM), for clusters that identify clients by certificate.
    #[arg(long, global = true, env = "LOCKCTL_CERT", requires = "cacert")]
    pub cert: Option<std::path::PathBuf>,

    /// Private key (PEM) of --cert.
    #[arg(long, global = true, env = "LOCKCTL_KEY", requires = "cert")]
    pub key: Option<std::path::PathBuf>,

    /// File holding a bearer token, sent as `authorization: Bearer <token>` on every call, for
    /// clusters that identify clients by token (lockd --auth-tokens).
    #[arg(long, global = true, env = "LOCKCTL_AUTH_TOKEN_FILE")]
    pub auth_token_file: Option<std::path::PathBuf>,

    /// Print one JSON object instead of text.
    #[arg(long, global = true)]
    pub json: bool,

    /// Output format, for every command: `text` (the default) or `json` (the same as --json).
    #[arg(
        long,
        global = true,
        value_enum,
        value_name = "FORMAT",
        conflicts_with = "json"
    )]
    pub output: Option<OutputFormat>,

    /// Total time for one call including retries across nodes (acquire: on top of --wait).
    #[arg(long, global = true, value_parser = parse_duration, default_value = "15s")]
    pub timeout: Duration,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Take a lease; prints lease_id, fencing_token, ttl and the signed sequencer (base64).
    Acquire {
        resource: String,
        #[command(flatten)]
        lease: LeaseArgs,
        /// Idempotency key: repeat it to learn the outcome of an attempt that ended "unknown".
        #[arg(long)]
        request_id: Option<String>,
    },
    /// Extend a lease by its ttl.
    Renew {
        resource: String,
        lease_id: String,
        /// New ttl (default: keep the lease's ttl).
        #[arg(long, value_parser = parse_duration)]
        ttl: Option<Duration>,
    },
    /// Give a lease up.
    Release { resource: String, lease_id: String },
    /// Show who holds a resource (never the lease id).
    Describe { resource: String },
    /// Show the state of the node that answers.
    Status,
    /// Sequencer signing keys (admin): list, export the public keys, rotate.
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
    },
    /// Run COMMAND while holding the lease; stop it if the lease is lost.
    Hold {
        resource: String,
        #[command(flatten)]
        lease: LeaseArgs,
        /// The command and its arguments, after `--`.
        #[arg(required = true, last = true, value_name = "COMMAND")]
        command: Vec<String>,
    },
    /// Backups (admin): `snapshot save FILE`.
    Snapshot {
        #[command(subcommand)]
        command: SnapshotCommand,
    },
    /// Cluster membership (admin): list, add, promote, remove.
    Member {
        #[command(subcommand)]
        command: MemberCommand,
    },
    /// Leadership (admin): transfer.
    Leader {
        #[command(subcommand)]
        command: LeaderCommand,
    },
    #[command(flatten)]
    Docs(lockd_service_kit::cli_docs::DocsCommand),
}

/// `lockctl snapshot ...`: backups of the replicated state (admin).
#[derive(Subcommand, Debug)]
pub enum SnapshotCommand {
    /// Stream a consistent backup from the leader into FILE (written whole or not at all, mode
    /// 0600: it holds lease ids and the signing keys), verify its SHA-256, and print its size,
    /// last applied index and highest fencing token. `lockd restore FILE` seeds a new cluster.
    Save { file: std::path::PathBuf },
}

/// `lockctl member ...`: admin operations on the cluster membership.
#[derive(Subcommand, Debug)]
pub enum MemberCommand {
    /// Every member: id, address, voter or learner, matched log index and lag behind the leader.
    List,
    /// Add a node (started with `lockd --join`) as a learner and wait until it has caught up
    /// (by snapshot when far behind). It does not vote until `member promote`.
    Add {
        /// The new member, as its peers dial it: ID=HOST:PORT (HOST may be a DNS name).
        member: MemberSpec,
        /// Return once the learner is added, without waiting for it to catch up.
        #[arg(long)]
        no_wait: bool,
        /// How long to wait for the learner to catch up.
        #[arg(long, value_parser = parse_duration, default_value = "10m")]
        catch_up_timeout: Duration,
    },
    /// Make a caught-up learner a voter (joint consensus). Refused while it lags.
    Promote { id: u64 },
    /// Remove a member. Refused for the last voter and when the voters left would have no
    /// up-to-date majority; removing the leader hands leadership over first.
    Remove { id: u64 },
}

/// `lockctl leader ...`.
#[derive(Subcommand, Debug)]
pub enum LeaderCommand {
    /// Move leadership to voter ID (default: the most up-to-date other voter).
    Transfer { id: Option<u64> },
}

/// `ID=HOST:PORT` of `member add`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberSpec {
    pub id: u64,
    pub address: String,
}

impl std::str::FromStr for MemberSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (id, address) = s
            .split_once('=')
            .ok_or_else(|| format!("member {s:?} must look like ID=HOST:PORT"))?;
        let id: u64 = id
            .parse()
            .ok()
            .filter(|id| *id > 0)
            .ok_or_else(|| format!("member {s:?}: id {id:?} is not a positive integer"))?;
        let port_ok = address.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0)
        });
        if !port_ok {
            return Err(format!(
                "member {s:?}: address {address:?} is not HOST:PORT"
            ));
        }
        Ok(MemberSpec {
            id,
            address: address.to_owned(),
        })
    }
}

/// `lockctl keys ...`: admin operations on the sequencer signing keys.
#[derive(Subcommand, Debug)]
pub enum KeysCommand {
    /// List the keys: id, active or retired, when created and retired.
    List,
    /// Write one `<keyid>.pub.pem` per listed key into DIR (created if missing), the files
    /// fence-proxy takes with `--verify-key FILE`.
    Export { dir: std::path::PathBuf },
    /// Make the leader commit a new signing key; the previous one is retired but stays listed.
    Rotate,
}

/// Flags shared by `acquire` and `hold`.
#[derive(Args, Debug)]
pub struct LeaseArgs {
    /// Lease ttl, e.g. 30s (default: the server's, 30s).
    #[arg(long, value_parser = parse_duration)]
    pub ttl: Option<Duration>,
    /// Queue for a held resource this long, e.g. 10s (default: do not wait).
    #[arg(long, value_parser = parse_duration)]
    pub wait: Option<Duration>,
    /// Free text shown by describe (default: acquire HOSTNAME/lockctl, hold HOSTNAME/pid-PID).
    #[arg(long)]
    pub holder: Option<String>,
}

/// `30s`, `1m30s`, `500ms`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration like 30s or 500ms ({e})"))
}

/// Bad flags: one line naming the problem (clap's tip included) and where the usage is.
pub const FLAG_ERRORS: FlagErrors = FlagErrors {
    prefix: "lockctl: ",
    suffix: " (see lockctl --help)",
    missing_command: "a command is required: acquire, renew, release, describe, status, keys, hold, snapshot, member or leader",
};

/// Prints help/version as clap does; every real parse error as one line, exit code
/// [`crate::exit::USAGE`].
pub fn report_parse_error(e: clap::Error) -> ExitCode {
    FLAG_ERRORS.report(e)
}

/// What `--output` takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    Text,
    Json,
}

impl Cli {
    /// Whether to print JSON: `--json` or `--output json`.
    pub fn json(&self) -> bool {
        self.json || self.output == Some(OutputFormat::Json)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn output_json_is_json_on_every_command_and_names_bad_formats() {
        for args in [
            &["lockctl", "--output", "json", "status"][..],
            &["lockctl", "describe", "r", "--output", "json"],
            &["lockctl", "--json", "keys", "list"],
        ] {
            assert!(Cli::try_parse_from(args).unwrap().json(), "{args:?}");
        }
        let text = Cli::try_parse_from(["lockctl", "--output", "text", "status"]).unwrap();
        assert!(!text.json());
        let err = Cli::try_parse_from(["lockctl", "--output", "yaml", "status"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("yaml"), "{err}");
        assert!(
            Cli::try_parse_from(["lockctl", "--json", "--output", "text", "status"]).is_err(),
            "--json and --output text contradict each other"
        );
    }

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn durations_parse_and_name_bad_values() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        let err = parse_duration("3x").unwrap_err();
        assert!(err.contains("\"3x\""), "{err}");
    }

    #[test]
    fn hold_takes_the_command_after_the_separator() {
        let cli = Cli::try_parse_from([
            "lockctl",
            "--endpoints",
            "a:1,b:2",
            "hold",
            "r",
            "--ttl",
            "5s",
            "--",
            "sh",
            "-c",
            "echo $LOCKD_FENCING_TOKEN",
        ])
        .unwrap();
        assert_eq!(cli.endpoints, ["a:1", "b:2"]);
        match cli.command {
            Command::Hold {
                resource,
                lease,
                command,
            } => {
                assert_eq!(resource, "r");
                assert_eq!(lease.ttl, Some(Duration::from_secs(5)));
                assert_eq!(command, ["sh", "-c", "echo $LOCKD_FENCING_TOKEN"]);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn member_specs_parse_and_name_bad_values() {
        let cli =
            Cli::try_parse_from(["lockctl", "member", "add", "4=lockd-4.example:7004"]).unwrap();
        match cli.command {
            Command::Member {
                command:
                    MemberCommand::Add {
                        member, no_wait, ..
                    },
            } => {
                assert_eq!(
                    member,
                    MemberSpec {
                        id: 4,
                        address: "lockd-4.example:7004".into()
                    }
                );
                assert!(!no_wait);
            }
            other => panic!("{other:?}"),
        }
        for bad in ["4", "x=h:1", "0=h:1", "4=h", "4=h:0", "4=:7"] {
            let e = bad.parse::<MemberSpec>().unwrap_err();
            assert!(e.contains(&format!("{bad:?}")), "{bad}: {e}");
        }
        let cli = Cli::try_parse_from(["lockctl", "leader", "transfer"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Leader {
                command: LeaderCommand::Transfer { id: None }
            }
        ));
    }

    #[test]
    fn parse_errors_are_one_line() {
        let e = Cli::try_parse_from(["lockctl", "acquire", "r", "--ttl", "soon"]).unwrap_err();
        let line = FLAG_ERRORS.line(&e);
        assert!(line.contains("soon"), "{line}");
        assert!(!line.contains('\n'));
        let e = Cli::try_parse_from(["lockctl"]).unwrap_err();
        assert!(FLAG_ERRORS.line(&e).contains("command is required"));
        let e = Cli::try_parse_from(["lockctl", "hold", "r"]).unwrap_err();
        let line = FLAG_ERRORS.line(&e);
        assert!(line.contains("<COMMAND>"), "{line}");
    }
}
