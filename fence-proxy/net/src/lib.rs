//! TLS settings (rustls with ring, no OpenSSL), the client allow-list and the connection threads
//! that fence-proxy's HTTP and Postgres front ends share, so both read certificates, verify
//! servers, refuse clients and spread connections over threads the same way.
//!
//! It does not speak any protocol: each front end decides when to start TLS (HTTP at once,
//! Postgres after an SSLRequest) and what to answer a refused client.
//!
//! # Layout
//! - [`tls`]: PEM loading, the listener's [`rustls::ServerConfig`] (optionally requiring client
//!   certificates), and the client side's [`tls::ServerCheck`] (libpq's `require`, `verify-ca`,
//!   `verify-full`).
//! - [`reload`]: the same configurations behind a lock, read again from their files on SIGHUP
//!   ([`TlsReloader`]); new handshakes use the new files, established connections keep theirs.
//! - [`allow`]: [`AllowList`], the `--allow-client CIDR` networks.
//! - [`threads`]: [`ConnectionThreads`], single-threaded runtimes a connection stays on.

pub mod allow;
pub mod reload;
pub mod threads;
pub mod tls;

pub use allow::AllowList;
pub use reload::{
    ReloadOutcome, ReloadableClientConfig, ReloadableServerConfig, ServerCheckFiles,
    ServerTlsFiles, TlsReloader,
};
pub use threads::{ConnectionThreads, ThreadSetup};
pub use tls::ServerCheck;
