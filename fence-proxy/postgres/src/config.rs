//! Settings shared by every session, derived once from the command-line flags.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use fence_proxy_net::ReloadableServerConfig;

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
    /// How upstream connections are encrypted and checked (`--upstream`'s sslmode); its roots
    /// are reloadable, read at each new upstream connection.
    pub upstream_tls: UpstreamTls,
    /// TLS towards clients (`--tls-cert`), reloadable, read at each SSLRequest; `None` answers
    /// SSLRequest with `N`.
    pub client_tls: Option<Arc<ReloadableServerConfig>>,
    /// Whether a client must have started TLS before its startup message (`--require-tls`).
    pub require_tls: bool,
    /// The databases sessions may connect to: the `--upstream` URL's and each
    /// `--allow-database`, every one checked at start as the URL's is. Each maps to its
    /// verification under `--verify-key` (the keys, `--allow-unsigned`, and the proof key of
    /// that database's fence table: every database has its own), `None` without. A session
    /// naming another database is refused before anything reaches the upstream.
    pub databases: BTreeMap<String, Option<Arc<crate::verify::Verification>>>,
    /// The `--upstream` URL's database, as the server named it; named in refusals.
    pub url_database: String,
}
