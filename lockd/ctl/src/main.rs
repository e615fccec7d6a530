//! `lockctl`: the command-line client of lockd (acquire, renew, release, describe, status, keys, hold, snapshot).
//!
//! It holds no lock logic of its own: every command is a thin layer over `lockd-client`, plus, for
//! `hold`, supervision of a child process.
//!
//! # Layout
//! - [`cli`]: flags and commands (clap), duration parsing.
//! - [`exit`]: the exit-code table and the one-line error type.
//! - [`commands`]: acquire, renew, release, describe, status and their text/JSON output.
//! - [`hold`]: `hold -- COMMAND`: run a command under a lease, stop it when the lease is lost.
//! - [`keys`]: `keys list | export DIR | rotate`, the sequencer signing keys (admin).
//! - [`snapshot`]: `snapshot save FILE`, a verified backup written atomically (admin).
//! - [`members`]: `member list | add | promote | remove`, `leader transfer` (admin).

mod cli;
mod commands;
mod exit;
mod hold;
mod keys;
mod members;
mod snapshot;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = match cli::Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return cli::report_parse_error(e),
    };
    // Completions and manual pages need no cluster, no runtime and no TLS files.
    if let cli::Command::Docs(docs) = &cli.command {
        return match docs.run(<cli::Cli as clap::CommandFactory>::command()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                ExitCode::from(exit::Failure::new(exit::INTERNAL, "internal", e).report(cli.json()))
            }
        };
    }
    // Logs go to stderr and are off unless RUST_LOG asks, so that every error stays one line.
    lockd_service_kit::log::init_tracing(lockd_service_kit::log::LogFormat::Text, "off");
    // One thread: `hold` forks its child from this thread, and the child's parent-death signal is
    // tied to the forking thread, so it must live as long as the process.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("lockctl: cannot start the async runtime: {e}");
            return ExitCode::from(exit::INTERNAL);
        }
    };
    let json = cli.json();
    let code = match runtime.block_on(commands::run(cli)) {
        Ok(code) => code,
        Err(failure) => failure.report(json),
    };
    ExitCode::from(code)
}
