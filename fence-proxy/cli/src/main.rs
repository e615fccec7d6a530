//! `fence-proxy`: parses flags, sets up logging and the metrics endpoint, and runs a front end
//! until SIGINT or SIGTERM. SIGHUP reloads the certificates (`reload`).
//!
//! # Layout
//! - `main.rs`: flags, the metrics and health listener (`/metrics`, `/healthz`, `/readyz`).
//! - `reload`: SIGHUP, certificate reloads and their metrics.
//! - `epochs`: `fence-proxy epochs max`, the highest token a store has accepted.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::{CommandFactory, Parser, Subcommand};
use lockd_service_kit::checks::Readiness;
use lockd_service_kit::cli_docs::DocsCommand;
use lockd_service_kit::config_file::{self, ParseError};
use lockd_service_kit::endpoints::{self, Endpoints};
use lockd_service_kit::flag_errors::{self, FlagErrors};
use lockd_service_kit::log::{LogFormat, init_tracing};
use lockd_service_kit::recorder;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio_util::sync::CancellationToken;

/// mimalloc rather than the system allocator, as lockd: a proxied request allocates and frees
/// on every connection thread, and glibc's malloc took a tenth of the proxy's CPU under fenced
/// writes, part of it waiting on its arena locks (docs/benchmarks.md). Without transparent huge
/// pages (`no_thp`), so an idle proxy stays small.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod epochs;
mod reload;

/// Bad flags: one line, like the proxy's other errors.
const FLAG_ERRORS: FlagErrors = FlagErrors {
    prefix: "fence-proxy: error: ",
    suffix: "",
    missing_command: "a command is required: fence-proxy http|postgres|epochs ... (see --help)",
};

/// The fencing write proxy: rejects writes whose fencing token is lower than the highest the
/// proxy accepted for their resource, before they reach storage that cannot check tokens.
#[derive(Parser, Debug)]
#[command(name = "fence-proxy", version)]
struct Cli {
    /// Log line format on stderr; the level comes from RUST_LOG (default `info`).
    #[arg(long, global = true, env = "FENCE_PROXY_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,

    /// TOML file of flag values: global keys at the top (`log-format`), each front end's in an
    /// `[http]` or `[postgres]` table (`listen = "127.0.0.1:6432"`). Flags and environment
    /// variables override it.
    // Read by `config_file::parse` before clap parses; declared for --help and the parse.
    #[arg(
        long = "config",
        global = true,
        env = "FENCE_PROXY_CONFIG",
        value_name = "FILE"
    )]
    _config: Option<std::path::PathBuf>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    // Boxed: the front ends' flags are large, and a command is parsed once.
    #[command(flatten)]
    FrontEnd(Box<FrontEnd>),
    /// The tokens a store has accepted: `epochs max` prints the highest over all resources, the
    /// floor for `lockd restore --token-floor`.
    Epochs {
        #[command(subcommand)]
        command: EpochsCommand,
    },
    #[command(flatten)]
    Docs(DocsCommand),
}

/// `fence-proxy epochs ...`.
#[derive(Subcommand, Debug)]
enum EpochsCommand {
    /// Print the highest token accepted for any resource: of an epoch store (`--store`, the
    /// HTTP front end's) or of a fence table (`--upstream`, the Postgres front end's). Reads
    /// only.
    Max(epochs::MaxArgs),
}

/// The two front ends, each a proxy of its own.
#[derive(Subcommand, Debug)]
enum FrontEnd {
    /// HTTP front end: reverse proxy that checks Lock-Resource and Fencing-Token on writes.
    Http {
        #[command(flatten)]
        common: Common,
        /// Boxed, as the Postgres front end's: the two sets of flags differ in size by more
        /// than clippy's `large_enum_variant` allows, and either grows with new flags.
        #[command(flatten)]
        args: Box<fence_proxy_http::Args>,
    },
    /// Postgres front end: wire-protocol proxy that guards every transaction. Install the guard
    /// first with `fence-proxy postgres init --upstream URL [--fence-table T] [--grant-to ROLE]`.
    Postgres {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        args: Box<fence_proxy_postgres::Args>,
    },
}

/// Flags every front end shares.
#[derive(clap::Args, Debug)]
struct Common {
    /// Serve Prometheus `/metrics`, `/healthz` and `/readyz` (epoch store and upstream
    /// reachable) on this address.
    #[arg(long, env = "FENCE_PROXY_METRICS_LISTEN", value_name = "ADDR")]
    metrics_listen: Option<SocketAddr>,
}

/// `fence-proxy postgres init`: installs the fence table and the guard function.
#[derive(Parser, Debug)]
#[command(name = "fence-proxy postgres init")]
struct InitCli {
    #[command(flatten)]
    args: fence_proxy_postgres::InitArgs,
}

/// Flags of the Postgres front end that no longer exist: (flag, its environment variable, why
/// and what to do). Named in a one-line error instead of clap's bare "unexpected argument",
/// the environment variable as well, since a setting that silently stopped working would
/// mislead.
const REMOVED_POSTGRES_FLAGS: &[(&str, &str, &str)] = &[(
    "--pool-size",
    "FENCE_PROXY_PG_POOL_SIZE",
    "the proxy keeps no connection pool of its own any more (its start-up check opens one connection, client sessions never shared it): remove the setting",
)];

/// Environment variables of the Postgres front end renamed when durations took one form
/// (`5s`); their flags' old names still work. (old, new, an example value).
const RENAMED_POSTGRES_ENV: &[(&str, &str, &str)] = &[
    (
        "FENCE_PROXY_PG_CONNECT_TIMEOUT_MS",
        "FENCE_PROXY_PG_CONNECT_TIMEOUT",
        "5s",
    ),
    (
        "FENCE_PROXY_PG_STARTUP_TIMEOUT_MS",
        "FENCE_PROXY_PG_STARTUP_TIMEOUT",
        "30s",
    ),
];

/// The subcommand `argv` names: its first word that is neither a flag nor the value of a
/// global flag that takes a separate value (`--log-format`, `--config`).
fn subcommand(argv: &[std::ffi::OsString]) -> Option<&str> {
    let mut words = argv.iter().skip(1).map(|a| a.to_str());
    while let Some(word) = words.next() {
        let word = word?;
        if word == "--log-format" || word == "--config" {
            words.next();
        } else if !word.starts_with('-') {
            return Some(word);
        }
    }
    None
}

/// The error for a removed flag of `fence-proxy postgres` in `argv` or the environment, or for
/// a renamed environment variable.
fn removed_flag(argv: &[std::ffi::OsString]) -> Option<String> {
    if subcommand(argv) != Some("postgres") {
        return None;
    }
    REMOVED_POSTGRES_FLAGS.iter().find_map(|(flag, env, why)| {
        let given = argv.iter().skip(1).any(|a| {
            a.to_str().is_some_and(|a| {
                a == *flag || a.strip_prefix(flag).is_some_and(|v| v.starts_with('='))
            })
        });
        if given {
            Some(format!("error: {flag} was removed: {why}"))
        } else if std::env::var_os(env).is_some() {
            Some(format!(
                "error: {env} (--{}) was removed: {why}",
                &flag[2..]
            ))
        } else {
            None
        }
    })
    .or_else(|| {
        RENAMED_POSTGRES_ENV.iter().find_map(|(old, new, example)| {
            std::env::var_os(old).map(|_| {
                format!("error: {old} was renamed {new}: give it as a duration like {example} (a bare number is milliseconds)")
            })
        })
    })
}

fn main() -> ExitCode {
    // `postgres init` is recognised before the main parser: `fence-proxy postgres` itself takes
    // the proxy's flags (with --upstream required), which a clap subcommand would have to relax.
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if let Some(i) = argv
        .windows(2)
        .position(|w| w[0] == "postgres" && w[1] == "init")
    {
        return run_init(argv[i + 2..].to_vec());
    }
    if let Some(e) = removed_flag(&argv) {
        eprintln!("fence-proxy: {e}");
        return ExitCode::from(2);
    }
    let cli: Cli = match config_file::parse(argv, "FENCE_PROXY_CONFIG") {
        Ok(cli) => cli,
        Err(ParseError::Flags(e)) => return FLAG_ERRORS.report(e),
        Err(ParseError::Config(e)) => {
            eprintln!("fence-proxy: error: {e}");
            return ExitCode::from(2);
        }
    };
    let front_end = match cli.command {
        Command::FrontEnd(front_end) => front_end,
        Command::Epochs {
            command: EpochsCommand::Max(args),
        } => {
            init_tracing(cli.log_format, "warn");
            return epochs::run_max(&args);
        }
        Command::Docs(docs) => {
            return match docs.run(Cli::command()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("fence-proxy: error: {e}");
                    ExitCode::FAILURE
                }
            };
        }
    };
    init_tracing(cli.log_format, "info");
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("fence-proxy: error: starting the Tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(*front_end)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!(
                "fence-proxy: error: {}",
                flag_errors::one_line(&format!("{e:#}"))
            );
            ExitCode::FAILURE
        }
    }
}

fn run_init(rest: Vec<std::ffi::OsString>) -> ExitCode {
    let cli = match InitCli::try_parse_from(
        std::iter::once(std::ffi::OsString::from("fence-proxy postgres init")).chain(rest),
    ) {
        Ok(cli) => cli,
        Err(e) => return FLAG_ERRORS.report(e),
    };
    let runtime = match crate::one_shot_runtime() {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    match runtime.block_on(fence_proxy_postgres::init(&cli.args)) {
        Ok(report) => {
            print!("{report}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!(
                "fence-proxy: error: {}",
                flag_errors::one_line(&format!("{e:#}"))
            );
            ExitCode::FAILURE
        }
    }
}

async fn run(command: FrontEnd) -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    tokio::spawn(cancel_on_signal(shutdown.clone()));
    // Before anything else: until SIGHUP is watched its default action ends the process.
    let hup = reload::watch_sighup();
    // The front end registers the TLS files it reads; SIGHUP reads them all again.
    let reloader = fence_proxy_net::TlsReloader::new();
    let (common, frontend) = match &command {
        FrontEnd::Http { common, .. } => (common, "http"),
        FrontEnd::Postgres { common, .. } => (common, "postgres"),
    };
    let readiness = start_metrics(common, frontend, shutdown.clone()).await?;
    if let Some(hup) = hup {
        tokio::spawn(reload::reload_on_sighup(
            hup,
            reloader.clone(),
            frontend,
            shutdown.clone(),
        ));
    }
    match command {
        FrontEnd::Http { args, .. } => {
            fence_proxy_http::run_with_reload(*args, shutdown, &reloader, readiness.as_ref()).await
        }
        FrontEnd::Postgres { args, .. } => {
            fence_proxy_postgres::run_with_reload(*args, shutdown, &reloader, readiness.as_ref())
                .await
        }
    }
}

/// What the metrics listener answers: the process-wide recorder's text, and the readiness the
/// front end's checks keep.
struct ProxyEndpoints {
    handle: PrometheusHandle,
    readiness: Readiness,
}

impl Endpoints for ProxyEndpoints {
    fn metrics(&self) -> String {
        self.handle.render()
    }

    fn readiness(&self) -> Result<String, String> {
        self.readiness.status()
    }
}

/// With `--metrics-listen`: installs the Prometheus recorder and serves the listener. Returns
/// the readiness for the front end to keep; without the flag nobody could ask, so no checks run.
async fn start_metrics(
    common: &Common,
    frontend: &'static str,
    shutdown: CancellationToken,
) -> anyhow::Result<Option<Readiness>> {
    let Some(addr) = common.metrics_listen else {
        return Ok(None);
    };
    let handle = recorder::latency_builder()
        .install_recorder()
        .context("installing the metrics recorder")?;
    tokio::spawn(recorder::upkeep(handle.clone(), shutdown.clone()));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding --metrics-listen {addr}"))?;
    tracing::info!(%addr, frontend, "metrics on /metrics, health on /healthz and /readyz");
    let readiness = Readiness::new();
    let served = Arc::new(ProxyEndpoints {
        handle,
        readiness: readiness.clone(),
    });
    tokio::spawn(endpoints::serve_tcp(listener, served, shutdown));
    Ok(Some(readiness))
}

async fn cancel_on_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch SIGTERM; only SIGINT stops the proxy");
            let _ = tokio::signal::ctrl_c().await;
            shutdown.cancel();
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("signal received, shutting down");
    shutdown.cancel();
}

/// The single-threaded runtime of a one-shot command (`postgres init`, `epochs max`); on failure
/// the error is printed and the exit code returned.
fn one_shot_runtime() -> Result<tokio::runtime::Runtime, ExitCode> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| {
            eprintln!("fence-proxy: error: starting the Tokio runtime: {e}");
            ExitCode::FAILURE
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_a_removed_flag() {
        let argv = |words: &[&str]| -> Vec<std::ffi::OsString> {
            words.iter().map(|w| (*w).into()).collect()
        };
        for given in [
            &["fence-proxy", "postgres", "--pool-size", "2"][..],
            &["fence-proxy", "postgres", "--pool-size=2"][..],
        ] {
            let e = removed_flag(&argv(given)).expect("a removed flag");
            assert!(e.contains("--pool-size was removed"), "{e}");
        }
        assert_eq!(
            removed_flag(&argv(&["fence-proxy", "postgres", "--pool-sizes"])),
            None
        );
        assert_eq!(
            removed_flag(&argv(&["fence-proxy", "http", "--listen", "x"])),
            None
        );
        // `postgres` as a value of another front end's flag is not the Postgres front end.
        assert_eq!(
            removed_flag(&argv(&[
                "fence-proxy",
                "http",
                "--store-table",
                "postgres",
                "--pool-size",
                "2"
            ])),
            None
        );
        let e = removed_flag(&argv(&[
            "fence-proxy",
            "--log-format",
            "json",
            "postgres",
            "--pool-size",
            "2",
        ]))
        .expect("a removed flag after a global flag");
        assert!(e.contains("--pool-size was removed"), "{e}");
    }
}
