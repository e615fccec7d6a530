//! Flags and subcommands. Every knob that has a "smoke" value is an `Option` here, so that an
//! explicit flag always wins over both the normal default and the `--smoke` default.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use lockd_service_kit::flag_errors::FlagErrors;

/// The `lockd dev` cluster, so that `lockd-bench mixed` works out of the box next to `lockd dev`.
pub const DEFAULT_ENDPOINTS: &str = "127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003";

/// Exit code of a run that could not start or finish (no cluster, no leader).
pub const EXIT_FAILURE: u8 = 1;

/// Load generator for lockd: prints a latency table on stderr and one JSON line on stdout.
#[derive(Parser, Debug)]
#[command(name = "lockd-bench", version, about, long_about = None)]
pub struct Cli {
    /// lockd nodes, comma-separated host:port.
    #[arg(long, global = true, env = "LOCKD_ENDPOINTS", value_delimiter = ',', default_value = DEFAULT_ENDPOINTS)]
    pub endpoints: Vec<String>,

    /// TLS towards the nodes, trusting this CA (PEM), as lockctl's --cacert.
    #[arg(long, global = true, env = "LOCKD_BENCH_CACERT")]
    pub cacert: Option<std::path::PathBuf>,

    /// HTTP/2 connections opened to each endpoint; calls are spread over them round-robin.
    #[arg(long, global = true, default_value_t = 4)]
    pub connections: usize,

    /// Where calls go: every endpoint in turn, so that followers forward their share to the
    /// leader as they do for clients spread over the cluster; or only the current leader (found
    /// with Cluster.Status, re-checked every second), which leaves the forwarding hop out.
    /// Figures taken before issue 17's round 3 used `leader`, then the default.
    #[arg(long, global = true, value_enum, default_value_t = Target::Any)]
    pub target: Target,

    /// Short run with small defaults (a few seconds, a few hundred ops/s), for CI.
    #[arg(long, global = true)]
    pub smoke: bool,

    /// No progress bar (also off when stderr is not a terminal; then a status line every 10 s).
    #[arg(long, global = true)]
    pub no_progress: bool,

    /// Give up on one call after this long and count it as CLIENT_TIMEOUT (outcome unknown).
    #[arg(long, global = true, value_parser = parse_duration, default_value = "10s")]
    pub request_timeout: Duration,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Target {
    /// Every call to the leader, as a leader-following client sends them.
    Leader,
    /// Calls spread over every endpoint in turn; followers forward to the leader.
    Any,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Open loop at a fixed rate: a third each acquire, renew and release over a pool of
    /// resources, latency measured from each call's intended send time.
    Mixed(MixedArgs),
    /// Closed loop: N workers each doing acquire/release cycles as fast as the cluster answers.
    Max(MaxArgs),
    /// Contended resources with queued waiters: latency from a Release being sent to the next
    /// waiter's Acquire reply.
    Handoff(HandoffArgs),
}

#[derive(Args, Debug)]
pub struct MixedArgs {
    /// Target ops/s over all three ops [default: 6000; smoke: 300].
    #[arg(long)]
    pub rate: Option<u64>,
    /// Measured time after the warmup, e.g. 60s [default: 60s; smoke: 3s].
    #[arg(long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// Time at the target rate before measuring; acquires only until --held leases are held,
    /// then the normal mix; never shorter than the time to fill the table plus 1s
    /// [default: 10s; smoke: 2s].
    #[arg(long, value_parser = parse_duration)]
    pub warmup: Option<Duration>,
    /// Size of the resource pool [default: 100000; smoke: 2000].
    #[arg(long)]
    pub resources: Option<u32>,
    /// Leases to hold [default: renew rate (rate/3) x --renew-every, at most 20000: 20000 at
    /// 6000 ops/s and above, fewer below so that each lease is still renewed in time].
    #[arg(long)]
    pub held: Option<u32>,
    /// Lease ttl asked for.
    #[arg(long, value_parser = parse_duration, default_value = "30s")]
    pub ttl: Duration,
    /// Intended renew period of each held lease; used to size --held by default.
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    pub renew_every: Duration,
    /// Resource names are PREFIX/N.
    #[arg(long, default_value = "bench-mixed")]
    pub prefix: String,
    /// Tasks in the bench that each call `Cluster.Status` back to back, on connections of their
    /// own, against the endpoints in turn, for the whole run; their calls are reported apart.
    #[arg(long, default_value_t = 0)]
    pub status_callers: usize,
    /// Leave the held leases at the end (they expire after --ttl) instead of releasing them,
    /// e.g. to read the replicas' memory with the table full.
    #[arg(long)]
    pub keep_held: bool,
    /// Also cut the measured window into intervals this long (at least 1s, at most --duration),
    /// by each call's intended send time, e.g. 60s: a line on stderr per interval as it
    /// completes (ok and failed calls, acquire p50/p99/max), the worst interval's acquire p99 against the
    /// run's at the end, and `intervals` in the JSON [default: off].
    #[arg(long, value_parser = parse_duration)]
    pub interval: Option<Duration>,
}

#[derive(Args, Debug)]
pub struct MaxArgs {
    /// Concurrent workers, each with one call in flight [default: 64; smoke: 8].
    #[arg(long)]
    pub workers: Option<usize>,
    /// Measured time, e.g. 30s [default: 30s; smoke: 2s].
    #[arg(long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// Unmeasured time before, at full speed [default: 3s; smoke: 1s].
    #[arg(long, value_parser = parse_duration)]
    pub warmup: Option<Duration>,
    /// Resources, split evenly between workers so that no acquire is contended
    /// [default: 100000; smoke: 1000].
    #[arg(long)]
    pub resources: Option<u32>,
    /// Resource names are PREFIX/N.
    #[arg(long, default_value = "bench-max")]
    pub prefix: String,
}

#[derive(Args, Debug)]
pub struct HandoffArgs {
    /// Contended resources [default: 32; smoke: 4].
    #[arg(long)]
    pub resources: Option<u32>,
    /// Clients per resource: one holds, the others wait in the queue [default: 4; smoke: 3].
    #[arg(long)]
    pub waiters: Option<u32>,
    /// How long a holder keeps the lock before releasing it.
    #[arg(long, value_parser = parse_duration, default_value = "0ms")]
    pub hold: Duration,
    /// wait_timeout_ms of each waiting Acquire.
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    pub wait: Duration,
    /// Measured time [default: 30s; smoke: 2s].
    #[arg(long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// Unmeasured time before, so that every queue is full [default: 3s; smoke: 1s].
    #[arg(long, value_parser = parse_duration)]
    pub warmup: Option<Duration>,
    /// Resource names are PREFIX/N.
    #[arg(long, default_value = "bench-handoff")]
    pub prefix: String,
}

impl Cli {
    /// The TLS settings of `--cacert`, if given.
    pub fn tls(&self) -> anyhow::Result<Option<tonic::transport::ClientTlsConfig>> {
        self.cacert
            .as_deref()
            .map(crate::pool::client_tls)
            .transpose()
    }
}

/// `30s`, `1m30s`, `500ms`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration like 30s or 500ms ({e})"))
}

/// Bad flags: one line naming the problem (clap's tip included) and where the usage is.
const FLAG_ERRORS: FlagErrors = FlagErrors {
    prefix: "lockd-bench: ",
    suffix: " (see lockd-bench --help)",
    missing_command: "a command is required: mixed, max or handoff",
};

/// Prints help/version as clap does; every real parse error as one line, exit code
/// [`USAGE_EXIT`](lockd_service_kit::flag_errors::USAGE_EXIT).
pub fn report_parse_error(e: clap::Error) -> ExitCode {
    FLAG_ERRORS.report(e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn bad_duration_names_the_value() {
        let err = parse_duration("soon").unwrap_err();
        assert!(err.contains("\"soon\""), "{err}");
    }
}
