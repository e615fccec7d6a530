//! Plumbing that the lockd and fence-proxy binaries share: logging setup, metric names and
//! histogram buckets, the HTTP listener for `/metrics`, `/healthz` and `/readyz`, readiness from
//! background checks, one-line errors for bad flags, and shell completions and manual pages.
//!
//! It holds no lock or fencing logic and no metric values of its own: each service records its
//! figures and decides what "ready" means; this crate only carries them out. The lockd client
//! library does not depend on it, so programs that use the client never compile it.
//!
//! # Layout
//! - [`log`]: [`log::LogFormat`] and [`log::init_tracing`], logs on stderr with a `RUST_LOG` filter.
//! - [`names`]: metric names used by more than one crate.
//! - [`recorder`]: the histogram buckets, a Prometheus builder with them, the upkeep loop.
//! - [`endpoints`]: the listener: [`endpoints::Endpoints`] and [`endpoints::serve`].
//! - [`checks`]: [`checks::Readiness`], the `/readyz` answer kept up to date by background
//!   probes, so that a request never waits for one.
//! - [`flag_errors`]: clap's errors folded into one line, the tip included.
//! - [`config_file`]: `--config FILE`, flag values from a TOML file, as defaults under flags and env.
//! - [`durations`]: the one way binaries read durations (`30s`, `250ms`).
//! - [`redact`]: connection strings with their passwords hidden, for errors and logs.
//! - [`cli_docs`]: `completions SHELL` and `man` for every binary, generated from its clap flags.
//! - [`admission`]: places for connections in a phase an untrusted peer can hold open, in all and
//!   per source address.
//! - [`flow_watch`]: the HTTP/2 send windows a client grants, followed from the frames, so that
//!   answers HTTP/2 flow control holds do not keep a connection for good.

pub mod admission;
pub mod checks;
pub mod cli_docs;
pub mod config_file;
pub mod durations;
pub mod endpoints;
pub mod flag_errors;
pub mod flow_watch;
pub mod log;
pub mod names;
pub mod recorder;
pub mod redact;
