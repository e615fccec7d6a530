//! Settings shared by every session, derived once from the command-line flags.

use std::time::Duration;

use tokio_rustls::TlsAcceptor;

use crate::fence_sql::FenceTable;
use crate::upstream::UpstreamTls;

/// What a session needs to know about the proxy's configuration.
#[derive(Clone)]
pub struct Config {
    /// `host:port` of the upstream Postgres, from `--upstream`.
    pub upstream_addr: String,
    /// Where fences are recorded; a validated identifier because it is spliced into SQL.
    pub fence_table: FenceTable,
    /// Whether sessions without a fence are held to read-only transactions.
    pub require_fence: bool,
    /// Bound on one protocol message body, both directions.
    pub max_message_bytes: usize,
    /// Bound on opening the upstream TCP connection.
    pub connect_timeout: Duration,
    /// Bound on a client's startup and authentication.
    pub startup_timeout: Duration,
    /// How upstream connections are encrypted and checked (`--upstream`'s sslmode).
    pub upstream_tls: UpstreamTls,
    /// TLS towards clients (`--tls-cert`); `None` answers SSLRequest with `N`.
    pub client_tls: Option<TlsAcceptor>,
    /// Whether a client must have started TLS before its startup message (`--require-tls`).
    pub require_tls: bool,
    /// With `--verify-key`: the keys, `--allow-unsigned` and the proof key shared with the
    /// guard. `None`: plain tokens, not authenticated.
    pub verification: Option<crate::verify::Verification>,
}
