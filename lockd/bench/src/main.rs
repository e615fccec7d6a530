//! `lockd-bench`: load generator and latency report for lockd, talking `lockd.v1` gRPC directly.
//!
//! It measures; it does not judge. It prints figures (a table on stderr, one JSON line on stdout)
//! and exits 0 whatever they are; it exits non-zero only when it cannot run (bad flags: 2, no
//! cluster: 1).
//!
//! # Layout
//! - [`cli`]: flags, subcommands, one-line usage errors.
//! - [`pool`]: connections, leader discovery, choice of node per call.
//! - [`call`]: one call with the bench's deadline, failures as (code, message).
//! - [`stats`]: HDR histograms and error counts per op; the table and the JSON.
//! - [`progress`]: the progress bar on stderr.
//! - [`mixed`]: open loop at a target rate, latency from the intended send time.
//! - [`interval`]: `mixed --interval`, the measured window's figures per interval.
//! - [`status_load`]: `Cluster.Status` loops running beside `mixed` (`--status-callers`).
//! - [`max`]: closed loop, throughput.
//! - [`handoff`]: release-to-next-grant latency on contended resources.

mod call;
mod cli;
mod handoff;
mod interval;
mod max;
mod mixed;
mod pool;
mod progress;
mod stats;
mod status_load;

use std::process::ExitCode;

use clap::Parser;

/// Worker threads of the runtime: the machine this was written for has 2 cores, shared with the
/// replicas, and one call costs the bench far less than the cluster.
const WORKER_THREADS: usize = 2;

/// The bench shares the machine with the cluster it measures, so it spends as little CPU as it can.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = match cli::Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return cli::report_parse_error(e),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKER_THREADS)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("lockd-bench: cannot start the async runtime: {e}");
            return ExitCode::from(cli::EXIT_FAILURE);
        }
    };
    let result = runtime.block_on(async {
        match &cli.command {
            cli::Command::Mixed(args) => mixed::run(&cli, args).await,
            cli::Command::Max(args) => max::run(&cli, args).await,
            cli::Command::Handoff(args) => handoff::run(&cli, args).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // `{:#}` joins the context chain on one line.
            eprintln!("lockd-bench: {e:#}");
            ExitCode::from(cli::EXIT_FAILURE)
        }
    }
}
