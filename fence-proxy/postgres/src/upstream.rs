//! The connection to the upstream Postgres: `--upstream` read as libpq reads a postgres:// URL
//! (host, port, the proxy's own user and database, `sslmode` and `sslrootcert`), the SSLRequest
//! exchange for every upstream connection, and the proxy's own connections (start-up check,
//! `init`).
//!
//! | `sslmode` | TLS | certificate check |
//! |---|---|---|
//! | `disable` | never | - |
//! | `prefer` (default, as libpq) | if the server agrees | none, or the chain with `sslrootcert` |
//! | `require` | always; a server that refuses fails the connection | none, or the chain with `sslrootcert` (as libpq) |
//! | `verify-ca` | always | chain to `sslrootcert` |
//! | `verify-full` | always | chain to `sslrootcert` and the URL's host named in the certificate |
//!
//! The proxy's own connections speak the protocol with sqlx, but over a stream the proxy opened
//! and encrypted itself ([`UpstreamTls::negotiate`], as for client sessions), so that the table
//! above holds for them too. sqlx 0.9's own rustls TLS cannot be configured to: its root store
//! always holds the bundled Mozilla roots (webpki-roots) besides `sslrootcert`, so under
//! `verify-ca` (chain only, no name) any publicly issued certificate for any name would pass,
//! and under `verify-full` any public certificate for the host; under `prefer` and `require` it
//! checks no chain even with `sslrootcert`. The proof key of `--verify-key` travels on these
//! connections, so that would let a man in the middle with a free public certificate forge
//! proofs. sqlx cannot be handed a stream either, so it reaches this one through a Unix socket in
//! a fresh directory only the proxy's user can enter (a process of that user can read the
//! `--upstream` URL from the proxy's command line or environment anyway, and so log in itself),
//! relayed byte for byte; the socket file goes as soon as sqlx is connected.

use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use fence_proxy_net::tls::server_name;
use fence_proxy_net::{ReloadableClientConfig, ServerCheckFiles, TlsReloader};
use rustls_pki_types::ServerName;
use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgSslMode};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// libpq's `sslmode` values the proxy implements (`allow` is not: it never protects anything).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SslMode {
    /// No TLS.
    Disable,
    /// TLS if the server offers it, plain text if it refuses; the chain is checked as under
    /// `require`.
    Prefer,
    /// TLS; the chain is checked only when `sslrootcert` is given (as libpq does).
    Require,
    /// TLS, a chain to the `sslrootcert` CA.
    VerifyCa,
    /// TLS, a chain to the `sslrootcert` CA naming the URL's host.
    VerifyFull,
}

impl SslMode {
    fn parse(s: &str) -> Result<SslMode, String> {
        Ok(match s {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(format!(
                    "sslmode {other:?} is not supported: use disable, prefer, require, verify-ca or verify-full"
                ));
            }
        })
    }

    /// The mode as libpq spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

/// How the proxy reaches the upstream, from `--upstream`.
#[derive(Clone)]
pub struct UpstreamTls {
    /// The URL's `sslmode`.
    pub mode: SslMode,
    /// Client configuration for every mode but `disable`; its `sslrootcert` is reloadable, so
    /// each new connection takes the configuration current then.
    config: Option<Arc<ReloadableClientConfig>>,
    /// The URL's host, as the certificate must name it under `verify-full`.
    name: ServerName<'static>,
}

impl std::fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamTls")
            .field("mode", &self.mode)
            .field("name", &self.name)
            .finish()
    }
}

/// `--upstream`, read as libpq reads a postgres:// URL.
pub struct ParsedUpstream {
    /// The host every upstream connection dials: the URL's first (or the `host` parameter's).
    host: String,
    /// Its port; 5432 when the URL names none.
    port: u16,
    /// Role, password and database of the proxy's own connections; client sessions bring
    /// their own. Unset ones default as in libpq (the `PG*` environment variables, then the
    /// operating-system user).
    user: Option<String>,
    password: Option<String>,
    dbname: Option<String>,
    /// Startup parameters of the proxy's own connections: `application_name`, and `options`
    /// as given and as the settings it makes.
    application_name: Option<String>,
    options: Option<String>,
    settings: Vec<(String, String)>,
    /// libpq's `connect_timeout`: a further bound on opening the proxy's own connections.
    connect_timeout: Option<Duration>,
    /// How connections to the upstream are encrypted.
    pub tls: UpstreamTls,
}

impl std::fmt::Debug for ParsedUpstream {
    /// Everything but the password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParsedUpstream")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("user", &self.user)
            .field("dbname", &self.dbname)
            .field("tls", &self.tls)
            .finish_non_exhaustive()
    }
}

/// Why a piece of the URL is wrong, before the URL is named in front of it.
type Bad = String;

/// Reads a postgres:// URL as libpq would, TLS parameters included. `what` names the flag in
/// errors.
pub fn parse(url: &str, what: &str) -> anyhow::Result<ParsedUpstream> {
    // Errors name the URL without its password: they reach logs and the journal.
    let shown = redact(url);
    let rest = url
        .strip_prefix("postgres://")
        .or_else(|| url.strip_prefix("postgresql://"))
        .ok_or_else(|| {
            anyhow::anyhow!(
                "{what} {shown:?} is not a postgres:// URL (postgres://user@host:port/database?parameters)"
            )
        })?;
    let value_error = |e: Bad| anyhow::anyhow!("{what} {shown:?}: {e}");
    let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
    // As libpq: the authority ends at the first '/', and user information at its first '@'.
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let (credentials, hosts) = match authority.split_once('@') {
        Some((c, h)) => (Some(c), h),
        None => (None, authority),
    };
    let mut user = None;
    let mut password = None;
    if let Some(c) = credentials {
        let (u, p) = match c.split_once(':') {
            Some((u, p)) => (u, Some(p)),
            None => (c, None),
        };
        user = Some(percent_decode(u)).filter(|u| !u.is_empty());
        password = p.map(percent_decode);
    }
    let (mut host, mut port) = first_host(hosts).map_err(value_error)?;
    let mut dbname = path
        .strip_prefix('/')
        .map(percent_decode)
        .filter(|d| !d.is_empty());
    let mut mode = SslMode::Prefer;
    let mut root_cert: Option<PathBuf> = None;
    let mut application_name = None;
    let mut options = None;
    let mut settings = Vec::new();
    let mut connect_timeout = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let (key, value) = (percent_decode(key), percent_decode(value));
        match key.as_str() {
            "sslmode" => {
                mode = SslMode::parse(&value).map_err(|e| anyhow::anyhow!("{what}: {e}"))?
            }
            // libpq 16 reads `system` as the operating system's trusted roots; the proxy trusts
            // only the CA named, so say that instead of looking for a file called `system`.
            "sslrootcert" if value == "system" => anyhow::bail!(
                "{what}: sslrootcert=system is not supported: name the file of the CA that issued the server's certificate"
            ),
            "sslrootcert" => root_cert = Some(PathBuf::from(value)),
            // A client certificate towards the upstream is not implemented: refuse rather than
            // connect without the identity the operator asked for.
            "sslcert" | "sslkey" | "sslpassword" | "sslcrl" | "sslcrldir" => anyhow::bail!(
                "{what}: {key} is not supported (the proxy does not present a client certificate upstream)"
            ),
            // As libpq: parameters override what the authority says; of a list, the first.
            "host" => {
                host = first_of(&value)
                    .map(str::to_owned)
                    .filter(|h| !h.is_empty())
            }
            "port" => port = port_number(first_of(&value).unwrap_or("")).map_err(value_error)?,
            "user" => user = Some(value),
            "password" => password = Some(value),
            "dbname" => dbname = Some(value),
            "application_name" => application_name = Some(value),
            "options" => {
                settings = self::settings(&value).map_err(value_error)?;
                options = Some(value);
            }
            "connect_timeout" => {
                let seconds: i64 = number(&key, &value).map_err(value_error)?;
                connect_timeout = u64::try_from(seconds)
                    .ok()
                    .filter(|s| *s > 0)
                    .map(Duration::from_secs);
            }
            // Socket settings of libpq's: the proxy's own connections last a moment, and client
            // sessions are bounded by --connect-timeout; accepted for the URL to be usable
            // with psql as well.
            "keepalives" => {
                number::<u64>(&key, &value).map_err(value_error)?;
            }
            "keepalives_retries" => {
                number::<u32>(&key, &value).map_err(value_error)?;
            }
            "keepalives_idle" | "keepalives_interval" | "tcp_user_timeout" => {
                number::<i64>(&key, &value).map_err(value_error)?;
            }
            // With one host dialled, any server will do (a stricter choice would be accepted
            // and not enforced); channel binding is never used by the proxy's own connections
            // (`prefer` finds nothing to bind to).
            "target_session_attrs" => one_of(&key, &value, &["any"]).map_err(value_error)?,
            "load_balance_hosts" => {
                one_of(&key, &value, &["disable", "random"]).map_err(value_error)?
            }
            "channel_binding" => one_of(&key, &value, &["disable", "prefer"]).map_err(|_| {
                anyhow::anyhow!(
                    "{what}: channel_binding={value:?} is not supported: the proxy's own connections do not bind to the TLS channel (use disable or prefer)"
                )
            })?,
            "sslnegotiation" => one_of(&key, &value, &["postgres"]).map_err(|_| {
                anyhow::anyhow!(
                    "{what}: sslnegotiation={value:?} is not supported: the proxy starts TLS with an SSLRequest (sslnegotiation=postgres)"
                )
            })?,
            "hostaddr" => anyhow::bail!(
                "{what} {shown:?}: hostaddr is not supported: give the address as the host"
            ),
            _ => anyhow::bail!(
                "{what} {shown:?}: unknown parameter {key:?} (known: sslmode, sslrootcert, host, port, user, password, dbname, application_name, options, connect_timeout and libpq's keepalive settings)"
            ),
        }
    }
    let Some(host) = host else {
        anyhow::bail!("{what} {shown:?} names no host");
    };
    if host.starts_with('/') {
        anyhow::bail!("{what} {shown:?}: only TCP hosts are supported, not Unix sockets");
    }
    let check = match (mode, root_cert) {
        (SslMode::Disable, _) => None,
        (SslMode::VerifyCa | SslMode::VerifyFull, None) => anyhow::bail!(
            "{what}: sslmode={} needs sslrootcert=FILE (the CA that issued the server's certificate)",
            mode.as_str()
        ),
        (SslMode::VerifyFull, Some(r)) => Some(ServerCheckFiles::Full(r)),
        // As libpq: with a root certificate, require (and prefer) check the chain.
        (_, Some(r)) => Some(ServerCheckFiles::Chain(r)),
        (_, None) => Some(ServerCheckFiles::EncryptOnly),
    };
    let config_tls = match check {
        Some(c) => Some(ReloadableClientConfig::load(
            c,
            &[],
            &format!("{what} sslrootcert"),
        )?),
        None => None,
    };
    let name = server_name(&host).map_err(|e| anyhow::anyhow!("{what}: {e:#}"))?;
    Ok(ParsedUpstream {
        host,
        port,
        user,
        password,
        dbname,
        application_name,
        options,
        settings,
        connect_timeout,
        tls: UpstreamTls {
            mode,
            config: config_tls,
            name,
        },
    })
}

/// The first `host[:port]` of the authority's comma-separated list, each checked; no host when
/// the list is empty.
fn first_host(list: &str) -> Result<(Option<String>, u16), Bad> {
    if list.is_empty() {
        return Ok((None, DEFAULT_PORT));
    }
    let mut first = None;
    for chunk in list.split(',') {
        let (host, port) = match chunk.strip_prefix('[') {
            Some(bracketed) => {
                let (host, after) = bracketed
                    .split_once(']')
                    .ok_or_else(|| format!("host {chunk:?} has no closing ']'"))?;
                match after {
                    "" => (host, None),
                    _ => match after.strip_prefix(':') {
                        Some(port) => (host, Some(port)),
                        None => return Err(format!("host {chunk:?}: text after ']'")),
                    },
                }
            }
            None => match chunk.split_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (chunk, None),
            },
        };
        let port = port_number(&percent_decode(port.unwrap_or("")))?;
        first.get_or_insert((percent_decode(host), port));
    }
    let (host, port) = first.unwrap_or_default();
    Ok((Some(host).filter(|h| !h.is_empty()), port))
}

/// Postgres's port when none is given.
const DEFAULT_PORT: u16 = 5432;

/// A port number; empty means [`DEFAULT_PORT`], as in libpq.
fn port_number(s: &str) -> Result<u16, Bad> {
    if s.is_empty() {
        return Ok(DEFAULT_PORT);
    }
    s.parse()
        .map_err(|_| format!("port {s:?} is not a number from 0 to 65535"))
}

/// The first item of a comma-separated list (libpq's multi-host form).
fn first_of(list: &str) -> Option<&str> {
    list.split(',').next()
}

fn number<T: FromStr>(key: &str, value: &str) -> Result<T, Bad> {
    value
        .parse()
        .map_err(|_| format!("{key}={value:?} is not a valid number"))
}

fn one_of(key: &str, value: &str, allowed: &[&str]) -> Result<(), Bad> {
    if allowed.contains(&value) {
        Ok(())
    } else {
        Err(format!(
            "{key}={value:?}: use one of {}",
            allowed.join(", ")
        ))
    }
}

impl ParsedUpstream {
    /// The host every upstream connection dials.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The host's port (5432 when the URL names none).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `host:port` to dial, an IPv6 address in brackets.
    pub fn addr(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// The role of the proxy's own connections, if the URL names one.
    pub fn user(&self) -> Option<&str> {
        self.user.as_deref()
    }

    /// Its password, if the URL gives one.
    pub fn password(&self) -> Option<&str> {
        self.password.as_deref()
    }

    /// The database of the proxy's own connections, if the URL names one.
    pub fn dbname(&self) -> Option<&str> {
        self.dbname.as_deref()
    }

    /// The same upstream, role and settings, for the proxy's own connections to database
    /// `dbname` (the start-up check of each `--allow-database`).
    pub fn with_database(&self, dbname: &str) -> ParsedUpstream {
        ParsedUpstream {
            host: self.host.clone(),
            port: self.port,
            user: self.user.clone(),
            password: self.password.clone(),
            dbname: Some(dbname.to_owned()),
            application_name: self.application_name.clone(),
            options: self.options.clone(),
            settings: self.settings.clone(),
            connect_timeout: self.connect_timeout,
            tls: self.tls.clone(),
        }
    }

    /// The URL's `application_name`, if any.
    pub fn application_name(&self) -> Option<&str> {
        self.application_name.as_deref()
    }

    /// The URL's `options`, as given.
    pub fn options(&self) -> Option<&str> {
        self.options.as_deref()
    }

    /// Opens one connection of the proxy's own as the URL's user, encrypted and checked as
    /// `sslmode` says, within `timeout` (or the URL's shorter `connect_timeout`): TCP, TLS and
    /// authentication.
    pub async fn connect(&self, timeout: Duration) -> anyhow::Result<PgConnection> {
        let timeout = self.connect_timeout.map_or(timeout, |t| t.min(timeout));
        match tokio::time::timeout(timeout, self.connect_now()).await {
            Ok(result) => result,
            Err(_) => anyhow::bail!(
                "connecting to upstream {} timed out after {} ms",
                self.addr(),
                timeout.as_millis()
            ),
        }
    }

    async fn connect_now(&self) -> anyhow::Result<PgConnection> {
        let addr = self.addr();
        let tcp = tokio::net::TcpStream::connect(&addr)
            .await
            .map_err(|e| anyhow::anyhow!("cannot connect to upstream {addr}: {e}"))?;
        let _ = tcp.set_nodelay(true);
        let (mut upstream, _encrypted) = self
            .tls
            .negotiate(tcp)
            .await
            .map_err(|e| anyhow::anyhow!("upstream {addr}: {e}"))?;
        // The relay's socket lives in a fresh directory that only this user may enter, so no
        // other local process can take the connection in sqlx's place.
        let dir = tempfile::Builder::new()
            .prefix("fence-proxy-")
            .permissions(std::fs::Permissions::from_mode(0o700))
            .tempdir()
            .map_err(|e| {
                anyhow::anyhow!("creating a private directory for the relay socket: {e}")
            })?;
        let listener =
            tokio::net::UnixListener::bind(dir.path().join(format!(".s.PGSQL.{}", self.port)))
                .map_err(|e| anyhow::anyhow!("binding the relay socket: {e}"))?;
        // Stopped if this future is dropped (timeout) or fails before sqlx is connected.
        let mut relay = AbortOnDrop(Some(tokio::spawn(async move {
            let Ok((mut local, _)) = listener.accept().await else {
                return;
            };
            // Ends when either side closes: sqlx's Terminate ends the upstream's side.
            let _ = tokio::io::copy_bidirectional(&mut local, &mut upstream).await;
        })));
        let conn = PgConnection::connect_with(&self.sqlx_options(dir.path()))
            .await
            .map_err(|e| anyhow::anyhow!("upstream {addr}: {}", sqlx_message(&e)))?;
        // Connected: the relay now lives as long as the connection, and the socket file goes.
        relay.0 = None;
        drop(dir);
        Ok(conn)
    }

    /// sqlx's settings for a connection over the relay socket in `dir`: plain text (the relay
    /// carries the TLS), the URL's user, database and startup parameters. What the URL leaves
    /// unset sqlx takes from the `PG*` environment variables, as libpq does (not `.pgpass`).
    fn sqlx_options(&self, dir: &Path) -> PgConnectOptions {
        let mut options = PgConnectOptions::new_without_pgpass()
            .socket(dir)
            .port(self.port)
            .ssl_mode(PgSslMode::Disable)
            .options(self.settings.iter().map(|(k, v)| (k, v)));
        if let Some(user) = &self.user {
            options = options.username(user);
        }
        if let Some(password) = &self.password {
            options = options.password(password);
        }
        if let Some(dbname) = &self.dbname {
            options = options.database(dbname);
        }
        if let Some(name) = &self.application_name {
            options = options.application_name(name);
        }
        options
    }
}

/// The settings of libpq's `options` parameter: `-c name=value`, `-cname=value` or
/// `--name=value`, separated by spaces (a backslash keeps the next character, space included),
/// the forms in which a session can be given server settings.
fn settings(options: &str) -> Result<Vec<(String, String)>, Bad> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut chars = options.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => word.extend(chars.next()),
            c if c.is_whitespace() => {
                if !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
            }
            c => word.push(c),
        }
    }
    if !word.is_empty() {
        words.push(word);
    }
    let mut out = Vec::new();
    let mut words = words.into_iter();
    while let Some(w) = words.next() {
        let setting = if w == "-c" {
            words.next().unwrap_or_default()
        } else if let Some(rest) = w.strip_prefix("--").or_else(|| w.strip_prefix("-c")) {
            rest.to_owned()
        } else {
            return Err(format!(
                "options: {w:?} is not a setting (-c name=value or --name=value)"
            ));
        };
        match setting.split_once('=') {
            Some((name, value)) if !name.is_empty() => {
                out.push((name.to_owned(), value.to_owned()))
            }
            _ => return Err(format!("options: {setting:?} is not name=value")),
        }
    }
    Ok(out)
}

/// Aborts its task when dropped, unless emptied first.
struct AbortOnDrop(Option<tokio::task::JoinHandle<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(task) = &self.0 {
            task.abort();
        }
    }
}

/// `url` with its passwords replaced by `***`, for errors and logs.
pub fn redact(url: &str) -> String {
    lockd_service_kit::redact::connection_string(url)
}

/// A database's own message (what the operator needs), or sqlx's description of the failure.
pub(crate) fn sqlx_message(e: &sqlx::Error) -> String {
    match e {
        sqlx::Error::Database(d) => d.message().to_owned(),
        other => other.to_string(),
    }
}

/// Decodes `%XX` escapes (paths in `sslrootcert` may carry them); anything malformed is kept.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = (bytes[i] == b'%')
            .then(|| bytes.get(i + 1..i + 3))
            .flatten()
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match escaped {
            Some(b) => {
                out.push(b);
                i += 3;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A byte stream the proxy relays: plain TCP or TLS, towards a client or the upstream.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}
/// An [`Io`] of either kind, boxed.
pub type BoxIo = Box<dyn Io>;

/// Why a TLS negotiation with the upstream failed.
#[derive(Debug, thiserror::Error)]
pub enum NegotiateError {
    /// The upstream answered `N` under a mode that needs TLS.
    #[error("the upstream refused TLS, but --upstream asks for sslmode={0}")]
    Refused(&'static str),
    /// The upstream answered neither `S` nor `N`.
    #[error("the upstream answered the SSLRequest with {0:?}, not S or N")]
    BadAnswer(char),
    /// The TLS handshake failed.
    #[error("TLS handshake (sslmode={mode}): {error}")]
    Handshake {
        /// The sslmode in force.
        mode: &'static str,
        /// The handshake's error.
        error: io::Error,
    },
    /// Reading or writing the connection failed.
    #[error("{0}")]
    Io(#[from] io::Error),
}

impl UpstreamTls {
    /// Negotiates encryption on a fresh upstream connection as `sslmode` says: an SSLRequest,
    /// then TLS on `S`; on `N` plain text only under `prefer`. Returns the stream and whether
    /// it is encrypted.
    pub async fn negotiate(
        &self,
        mut tcp: tokio::net::TcpStream,
    ) -> Result<(BoxIo, bool), NegotiateError> {
        let Some(config) = &self.config else {
            return Ok((Box::new(tcp), false));
        };
        let mut request = [0u8; 8];
        request[..4].copy_from_slice(&8i32.to_be_bytes());
        request[4..].copy_from_slice(&80_877_103i32.to_be_bytes());
        tcp.write_all(&request).await?;
        // Exactly one byte: anything the server sent after it belongs to the TLS stream, so a
        // man in the middle cannot slip plain-text messages in ahead of the handshake.
        match tcp.read_u8().await? {
            b'S' => {
                let stream = tokio_rustls::TlsConnector::from(config.current())
                    .connect(self.name.clone(), tcp)
                    .await
                    .map_err(|error| NegotiateError::Handshake {
                        mode: self.mode.as_str(),
                        error,
                    })?;
                Ok((Box::new(stream), true))
            }
            b'N' if self.mode == SslMode::Prefer => Ok((Box::new(tcp), false)),
            b'N' => Err(NegotiateError::Refused(self.mode.as_str())),
            other => Err(NegotiateError::BadAnswer(other as char)),
        }
    }

    /// How the upstream's certificate is checked; `None` under `disable`.
    pub fn check(&self) -> Option<&ServerCheckFiles> {
        self.config.as_ref().map(|c| c.check())
    }

    /// Has `reloader` read `sslrootcert` again on every reload (nothing to do without one).
    pub fn register(&self, reloader: &TlsReloader) {
        if let Some(config) = &self.config {
            reloader.add_client(config);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A self-signed CA certificate in a file of a fresh directory (kept alive by the guard).
    fn ca_file() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let ca = rcgen::generate_simple_self_signed(vec!["db.internal".to_owned()]).unwrap();
        let path = dir.path().join("ca.pem");
        std::fs::write(&path, ca.cert.pem()).unwrap();
        (dir, path)
    }

    fn ok(url: &str) -> ParsedUpstream {
        parse(url, "--upstream").unwrap_or_else(|e| panic!("{url}: {e:#}"))
    }

    fn err(url: &str) -> String {
        match parse(url, "--upstream") {
            Ok(_) => panic!("{url} was accepted"),
            Err(e) => format!("{e:#}"),
        }
    }

    #[test]
    fn host_port_user_and_database() {
        let p = ok("postgres://u@db.internal:5433/app");
        assert_eq!(
            (p.host(), p.port(), p.user(), p.dbname()),
            ("db.internal", 5433, Some("u"), Some("app"))
        );
        assert_eq!(p.password(), None);
        assert_eq!(p.tls.mode, SslMode::Prefer);
        assert!(matches!(p.tls.check(), Some(ServerCheckFiles::EncryptOnly)));
        // postgresql:// as well; no port means 5432; no user or database leaves them unset.
        let p = ok("postgresql://10.0.0.7");
        assert_eq!((p.host(), p.port()), ("10.0.0.7", 5432));
        assert_eq!((p.user(), p.dbname()), (None, None));
        let p = ok("postgres://u:secret@h/d");
        assert_eq!(p.password(), Some("secret"));
        // Only the first ':' separates user and password.
        let p = ok("postgres://u:a:b@h/d");
        assert_eq!((p.user(), p.password()), (Some("u"), Some("a:b")));
    }

    #[test]
    fn ipv6_hosts_in_brackets() {
        let p = ok("postgres://u@[::1]:6000/app");
        assert_eq!((p.host(), p.port()), ("::1", 6000));
        let p = ok("postgres://u@[fd00::7]/app");
        assert_eq!((p.host(), p.port()), ("fd00::7", 5432));
        let e = err("postgres://u@[::1/app");
        assert!(e.contains("[::1"), "{e}");
    }

    #[test]
    fn percent_escapes_in_user_password_database_and_parameters() {
        let p = ok("postgres://us%40er:p%3Ass%2Fw@h/my%20db?application_name=a%26b");
        assert_eq!(p.user(), Some("us@er"));
        assert_eq!(p.password(), Some("p:ss/w"));
        assert_eq!(p.dbname(), Some("my db"));
        assert_eq!(p.application_name(), Some("a&b"));
        assert_eq!(percent_decode("%2Fetc%2Fca.pem"), "/etc/ca.pem");
        assert_eq!(percent_decode("a%2"), "a%2");
    }

    #[test]
    fn parameters_for_the_proxys_own_connection() {
        let p = ok(
            "postgres://h/d?application_name=fp&options=-c%20statement_timeout%3D5s&connect_timeout=3",
        );
        assert_eq!(p.application_name(), Some("fp"));
        assert_eq!(p.options(), Some("-c statement_timeout=5s"));
        let p = ok("postgres://h?user=q&password=pw&dbname=other");
        assert_eq!(
            (p.user(), p.password(), p.dbname()),
            (Some("q"), Some("pw"), Some("other"))
        );
        // libpq's connection parameters that change nothing the proxy does are accepted,
        // with their values checked.
        ok(
            "postgres://h/d?keepalives=1&keepalives_idle=30&keepalives_interval=5&keepalives_retries=3&tcp_user_timeout=0&target_session_attrs=any&load_balance_hosts=disable&channel_binding=prefer&sslnegotiation=postgres",
        );
        for bad in [
            "connect_timeout=soon",
            "keepalives=yes",
            "target_session_attrs=primary",
            "load_balance_hosts=always",
            "channel_binding=maybe",
        ] {
            let key = bad.split('=').next().unwrap();
            let e = err(&format!("postgres://h/d?{bad}"));
            assert!(e.contains(key), "{bad}: {e}");
        }
        // Empty pieces between '&' are skipped.
        assert_eq!(
            ok("postgres://h/d?&sslmode=disable&").tls.mode,
            SslMode::Disable
        );
    }

    #[test]
    fn options_become_settings() {
        let p = ok("postgres://h/d?options=-c%20a%3D1%20-cb%3D2%20--c-d%3Dx%5C%20y");
        assert_eq!(
            p.settings,
            [
                ("a".to_owned(), "1".to_owned()),
                ("b".to_owned(), "2".to_owned()),
                ("c-d".to_owned(), "x y".to_owned())
            ]
        );
        for bad in ["-x", "-c", "-c%20noequals", "--=1"] {
            let e = err(&format!("postgres://h/d?options={bad}"));
            assert!(e.contains("options"), "{bad}: {e}");
        }
    }

    #[test]
    fn the_first_host_is_dialled() {
        let p = ok("postgres://u@h1,h2:7000/db");
        assert_eq!((p.host(), p.port()), ("h1", 5432));
        let p = ok("postgres://u@h1:6000,h2:7000/db");
        assert_eq!((p.host(), p.port()), ("h1", 6000));
    }

    #[test]
    fn host_and_port_parameters() {
        let p = ok("postgres:///db?host=h2&port=6000");
        assert_eq!((p.host(), p.port()), ("h2", 6000));
        let e = err("postgres://u@h/db?port=nope");
        assert!(e.contains("port"), "{e}");
        let e = err("postgres://u@h:nope/db");
        assert!(e.contains("port") && e.contains("h:nope"), "{e}");
        let e = err("postgres://u@h:70000/db");
        assert!(e.contains("port"), "{e}");
    }

    /// libpq reads `host` and `port` parameters as overriding what the URL's authority says;
    /// the parser before this change appended them, so the authority's value won.
    #[test]
    fn host_and_port_parameters_override_the_authority() {
        let p = ok("postgres://u@h1:5433/db?port=6000");
        assert_eq!((p.host(), p.port()), ("h1", 6000));
        let p = ok("postgres://u@h1/db?host=h2");
        assert_eq!((p.host(), p.port()), ("h2", 5432));
        let e = err("postgres://u@h/db?host=/tmp");
        assert!(e.contains("Unix sockets"), "{e}");
    }

    /// libpq's `key=value` form was half read before (the `?` the proxy appended ended up in
    /// the last value); it is refused now, as the flag's help always said.
    #[test]
    fn key_value_strings_are_not_urls() {
        let e = err("host=h user=u");
        assert!(e.contains("is not a postgres:// URL"), "{e}");
    }

    #[test]
    fn hosts_that_are_not_tcp_or_missing() {
        let e = err("postgres://u@%2Fvar%2Frun%2Fpostgresql/db");
        assert!(e.contains("Unix sockets"), "{e}");
        let e = err("postgres:///db");
        assert!(
            e.contains("names no host") && e.contains("postgres:///db"),
            "{e}"
        );
        let e = err("postgres://u@/db");
        assert!(e.contains("names no host"), "{e}");
    }

    /// Goal: no error about the URL shows its password, in the authority or as `password=`.
    #[test]
    fn errors_never_show_the_password() {
        for url in [
            "postgres://app:s3cret@h/d?sslmod=verify-full",
            "postgres://app@h/d?password=s3cret&frobnicate=1",
            "postgres://app@h/d?pass%77ord=s3cret&hostaddr=10.0.0.1",
            "postgres://app:s3cret@/d",
        ] {
            let e = err(url);
            assert!(!e.contains("s3cret"), "{url}: {e}");
            assert!(e.contains("***"), "{url}: {e}");
        }
        assert_eq!(
            redact("postgres://app:pw@h:5/d?sslmode=require&password=pw"),
            "postgres://app:***@h:5/d?sslmode=require&password=***"
        );
        assert_eq!(redact("postgres://app@h/d"), "postgres://app@h/d");
    }

    /// Goal: `sslrootcert=system` (libpq 16: the system's roots) is named as unsupported rather
    /// than read as a file, and a session attribute the proxy would not enforce is refused.
    #[test]
    fn system_roots_and_session_attributes_are_refused_by_name() {
        let e = err("postgres://h/d?sslmode=verify-full&sslrootcert=system");
        assert!(e.contains("sslrootcert=system is not supported"), "{e}");
        for attrs in ["read-write", "read-only", "primary"] {
            let e = err(&format!("postgres://h/d?target_session_attrs={attrs}"));
            assert!(e.contains("target_session_attrs"), "{attrs}: {e}");
        }
        ok("postgres://h/d?target_session_attrs=any");
    }

    #[test]
    fn not_a_postgres_url() {
        for url in ["localhost:5432", "mysql://u@h/d", ""] {
            let e = err(url);
            assert!(
                e.contains("is not a postgres:// URL") && e.contains(&format!("{url:?}")),
                "{url}: {e}"
            );
        }
        let e = err("postgres://h/d?frobnicate=1");
        assert!(e.contains("frobnicate"), "{e}");
        let e = err("postgres://h/d?sslmode");
        assert!(e.contains("sslmode"), "{e}");
    }

    #[test]
    fn sslmodes() {
        let p = ok("postgres://u@h/app?sslmode=disable&application_name=x");
        assert_eq!(p.tls.mode, SslMode::Disable);
        assert!(p.tls.check().is_none());
        assert_eq!(p.application_name(), Some("x"));
        assert_eq!(ok("postgres://h?sslmode=prefer").tls.mode, SslMode::Prefer);
        let p = ok("postgres://h?sslmode=require");
        assert_eq!(p.tls.mode, SslMode::Require);
        assert!(matches!(p.tls.check(), Some(ServerCheckFiles::EncryptOnly)));
        for bad in ["allow", "bogus", ""] {
            let e = err(&format!("postgres://u@h/app?sslmode={bad}"));
            assert!(
                e.contains(&format!("{bad:?}")) && e.contains("verify-full"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn sslrootcert_decides_the_certificate_check() {
        let (_dir, ca) = ca_file();
        let root = format!("sslrootcert={}", ca.display());
        let check = |mode: &str| {
            let p = ok(&format!(
                "postgres://u@db.internal/app?sslmode={mode}&{root}"
            ));
            assert_eq!(p.tls.mode.as_str(), mode);
            p.tls.check().cloned()
        };
        assert!(matches!(check("verify-full"), Some(ServerCheckFiles::Full(p)) if p == ca));
        assert!(matches!(check("verify-ca"), Some(ServerCheckFiles::Chain(p)) if p == ca));
        // As libpq: with a root certificate, require and prefer check the chain.
        assert!(matches!(check("require"), Some(ServerCheckFiles::Chain(p)) if p == ca));
        assert!(matches!(check("prefer"), Some(ServerCheckFiles::Chain(p)) if p == ca));
        assert!(check("disable").is_none());
        // The path may be percent-encoded.
        let encoded = ca.display().to_string().replace('/', "%2F");
        let p = ok(&format!(
            "postgres://h/d?sslmode=verify-ca&sslrootcert={encoded}"
        ));
        assert!(matches!(p.tls.check(), Some(ServerCheckFiles::Chain(p)) if *p == ca));
    }

    #[test]
    fn tls_errors_name_the_value() {
        for mode in ["verify-ca", "verify-full"] {
            let e = err(&format!("postgres://u@h/app?sslmode={mode}"));
            assert!(e.contains("sslrootcert") && e.contains(mode), "{e}");
        }
        let e = err("postgres://u@h/app?sslmode=verify-ca&sslrootcert=/nonexistent/ca.pem");
        assert!(e.contains("/nonexistent/ca.pem"), "{e}");
        for key in ["sslcert", "sslkey", "sslpassword", "sslcrl", "sslcrldir"] {
            let e = err(&format!("postgres://u@h/app?sslmode=require&{key}=/c.pem"));
            assert!(e.contains(key) && e.contains("not supported"), "{e}");
        }
        let e = err("postgres://u@bad%20host/app");
        assert!(e.contains("bad host"), "{e}");
    }
}
