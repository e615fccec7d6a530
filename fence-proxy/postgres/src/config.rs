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
    /// `--allow-database`, every one checked at start as the URL's is, by name. A session
    /// naming another database is refused before anything reaches the upstream.
    pub databases: BTreeMap<String, Served>,
    /// The `--upstream` URL's database, as the server named it; named in refusals.
    pub url_database: String,
}

/// A database sessions may connect to, as the start-up check found it.
#[derive(Clone)]
pub struct Served {
    /// Its `pg_database.oid` when the check ran. The name is what a client asks for, but the
    /// check holds only for that database: another one renamed into the name later (a clone
    /// made with `TEMPLATE` or a restore, with the same guard, fence table and proof key, and
    /// the tokens of the moment it was copied) would take tokens its original already refused.
    /// Each session's first query compares the oid of the database it is in with this one.
    pub oid: u32,
    /// Its verification under `--verify-key` (the keys, `--allow-unsigned`, and the proof key
    /// of this database's fence table: every database has its own), `None` without.
    pub verification: Option<Arc<crate::verify::Verification>>,
}
