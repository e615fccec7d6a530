//! Flags of `fence-proxy http`. Each has a `FENCE_PROXY_*` environment variable.

use std::net::SocketAddr;
use std::str::FromStr;
use std::time::Duration;

use fence_epoch_store::postgres_store::DEFAULT_TABLE;
use fence_epoch_store::spec::{DEFAULT_MAX_RESOURCES, DEFAULT_POSTGRES_CONNECTIONS};
use fence_epoch_store::{StoreOptions, StoreSpec, Timing};

/// Default bound on requests handled at once; beyond it new requests wait for a free slot, so a
/// flood queues in the kernel's accept backlog instead of exhausting memory or store connections.
pub const DEFAULT_MAX_IN_FLIGHT: u64 = 1024;

/// Default bound on client connections open at once; past it the proxy stops accepting until one
/// closes, so that idle or slow connections cannot exhaust file descriptors and memory.
pub const DEFAULT_MAX_CONNECTIONS: u64 = 4096;
/// Connections one client address may hold at once, as lockd's gRPC port allows one source.
pub const DEFAULT_MAX_CONNECTIONS_PER_CLIENT: u64 = 256;
/// Largest value of the `--max-*` bounds on requests and connections: far above what one
/// process serves, and below what a semaphore holds (a larger value panicked at startup).
pub const PLACES_MAX: u64 = 1_000_000;

/// Default time a client has to send a complete request head (and, on a new connection, its
/// first one); past it the connection is closed. Bounds how long a slowloris client holds a
/// connection slot.
pub const DEFAULT_HEADER_READ_TIMEOUT: &str = "10s";

/// Default time a connection may go without starting a request before it is closed (once its
/// requests in flight end). HTTP/1.1 connections are closed sooner, by the header read timeout;
/// this bounds HTTP/2 connections, which hyper never closes for idleness.
pub const DEFAULT_IDLE_TIMEOUT: &str = "60s";

/// Default time a client may leave a response unread (the proxy cannot write a byte to it)
/// before it is disconnected, as nginx's `send_timeout`: a client that stops reading must not
/// hold its connection, its response and the upstream connection behind it for good.
pub const DEFAULT_SEND_TIMEOUT: &str = "60s";

/// `fence-proxy http`: reject writes with stale fencing tokens before they reach the upstream.
#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Address to accept HTTP/1.1 and HTTP/2 (h2c) requests on.
    #[arg(long, env = "FENCE_PROXY_LISTEN", value_name = "ADDR")]
    pub listen: SocketAddr,

    /// Base URL of the protected HTTP service (http:// or https://, the latter with
    /// --upstream-ca); the request path is appended.
    #[arg(long, env = "FENCE_PROXY_UPSTREAM", value_name = "URL")]
    pub upstream: Upstream,

    /// Epoch store: `redb:PATH` (embedded, one proxy) or a `postgres://` URL (shared by replicas).
    #[arg(
        long,
        env = "FENCE_PROXY_STORE",
        value_name = "STORE",
        default_value = "redb:fence-proxy-epochs.redb"
    )]
    pub store: StoreSpec,

    /// Table of the Postgres store.
    #[arg(long, env = "FENCE_PROXY_STORE_TABLE", value_name = "NAME", default_value = DEFAULT_TABLE)]
    pub store_table: String,

    /// Connections of the Postgres store's pool; each write being forwarded holds one.
    #[arg(long, env = "FENCE_PROXY_STORE_MAX_CONNECTIONS", value_name = "N",
          default_value_t = DEFAULT_POSTGRES_CONNECTIONS)]
    pub store_max_connections: u32,

    /// Resources the epoch store records at most. Records are never deleted (a forgotten
    /// token would let an older holder write again), so past this a write of a resource the
    /// store has no record of is refused (507 resource-limit); writes of recorded resources go
    /// on. With the Postgres store, a write of a new resource near the bound counts the table's
    /// records.
    #[arg(long, env = "FENCE_PROXY_MAX_RESOURCES", value_name = "N",
          default_value_t = DEFAULT_MAX_RESOURCES, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_resources: u64,

    /// Bound on one epoch-store operation (connecting, one statement); past it: 503.
    #[arg(long, env = "FENCE_PROXY_STORE_TIMEOUT", value_name = "DURATION",
          default_value = "5s", value_parser = lockd_service_kit::durations::parse_timing)]
    pub store_timeout: Duration,

    /// How long the upstream may take to answer a forwarded request; past it: 504.
    #[arg(long, env = "FENCE_PROXY_UPSTREAM_TIMEOUT", value_name = "DURATION",
          default_value = "30s", value_parser = lockd_service_kit::durations::parse_timing)]
    pub upstream_timeout: Duration,

    /// How long a write waits for the forwards of writes of the same resource with another token
    /// (with the Postgres store: of any other write of it); past it: 503 resource-busy.
    #[arg(long, env = "FENCE_PROXY_LOCK_WAIT", value_name = "DURATION",
          default_value = "10s", value_parser = lockd_service_kit::durations::parse_timing)]
    pub lock_wait: Duration,

    /// How long a resource stays closed after a forward whose outcome is unknown (timeout or
    /// connection lost), in case the upstream still applies it.
    #[arg(long, env = "FENCE_PROXY_QUARANTINE", value_name = "DURATION",
          default_value = "10s", value_parser = lockd_service_kit::durations::parse_timing)]
    pub quarantine: Duration,

    /// Whether a write's Lock-Resource must name its request path: `off`; `path` (the path
    /// without its leading '/' is the resource); `path-prefix` (the path is the resource or below
    /// it). Under `path` and `path-prefix`, paths an upstream could read as another are refused
    /// (only ASCII letters, digits, '/' and -._~!$&'()*+,=:@ pass, and no segment may be empty or
    /// end in '.'), and writes go upstream with the upstream's own Host and without the client's
    /// Forwarded, X-Forwarded-Host, X-Original-URL and similar routing headers.
    #[arg(long, env = "FENCE_PROXY_BIND_RESOURCE", value_name = "MODE", value_enum,
          default_value_t = crate::binding::ResourceBinding::Off)]
    pub bind_resource: crate::binding::ResourceBinding,

    /// Keep the upstream connection after a POST, PUT or PATCH with a body, for upstreams that
    /// read (or discard) the body of every request they answer, as HTTP/1.1 requires. Off by
    /// default: an upstream that answers early without reading a body (a router's 404, an
    /// authentication check's 401, its own fencing check's 412) and keeps the connection would
    /// take the rest of the body for the next request, one that no fence checked; so every
    /// request with a body goes upstream with `Connection: close`, which costs a new upstream
    /// connection per such request. A body on any other method closes its connection always.
    #[arg(long, env = "FENCE_PROXY_UPSTREAM_REUSE_AFTER_BODY")]
    pub upstream_reuse_after_body: bool,

    /// Requests handled at once; more wait for a free slot. Also bounds the writes being
    /// admitted or forwarded, counting those whose client has gone away.
    #[arg(long, env = "FENCE_PROXY_MAX_IN_FLIGHT", value_name = "N",
          default_value_t = DEFAULT_MAX_IN_FLIGHT, value_parser = clap::value_parser!(u64).range(1..=PLACES_MAX))]
    pub max_in_flight: u64,

    /// Requests of one client address handled at once; more of its requests wait for its own
    /// to end, so one client cannot take every place of --max-in-flight (an HTTP/2 connection
    /// carries 128 at once). Default: a quarter of --max-in-flight. Raise it for many clients
    /// behind one address.
    #[arg(long, env = "FENCE_PROXY_MAX_IN_FLIGHT_PER_CLIENT", value_name = "N",
          value_parser = clap::value_parser!(u64).range(1..=PLACES_MAX))]
    pub max_in_flight_per_client: Option<u64>,

    /// Client connections open at once; more wait in the kernel's accept backlog.
    #[arg(long, env = "FENCE_PROXY_MAX_CONNECTIONS", value_name = "N",
          default_value_t = DEFAULT_MAX_CONNECTIONS, value_parser = clap::value_parser!(u64).range(1..=PLACES_MAX))]
    pub max_connections: u64,

    /// Client connections one source address may hold at once; past it its new connections are
    /// closed at once, so one client cannot take every connection. Raise it for many clients
    /// behind one address (a NAT, a load balancer that does not keep client addresses).
    #[arg(long, env = "FENCE_PROXY_MAX_CONNECTIONS_PER_CLIENT", value_name = "N",
          default_value_t = DEFAULT_MAX_CONNECTIONS_PER_CLIENT, value_parser = clap::value_parser!(u64).range(1..=PLACES_MAX))]
    pub max_connections_per_client: u64,

    /// Time a client has to send a complete request head, also while a kept-alive connection
    /// idles between requests; past it the connection is closed.
    #[arg(long, env = "FENCE_PROXY_HEADER_READ_TIMEOUT", value_name = "DURATION",
          default_value = DEFAULT_HEADER_READ_TIMEOUT, value_parser = parse_positive_duration)]
    pub header_read_timeout: Duration,

    /// Time a connection may go without starting a request; past it the connection is closed
    /// once its requests in flight have ended (HTTP/2 gets a GOAWAY).
    #[arg(long, env = "FENCE_PROXY_IDLE_TIMEOUT", value_name = "DURATION",
          default_value = DEFAULT_IDLE_TIMEOUT, value_parser = parse_positive_duration)]
    pub idle_timeout: Duration,

    /// Time a client may accept no byte of a response the proxy is sending it; past it the
    /// connection is closed (as nginx's send_timeout).
    #[arg(long, env = "FENCE_PROXY_SEND_TIMEOUT", value_name = "DURATION",
          default_value = DEFAULT_SEND_TIMEOUT, value_parser = parse_positive_duration)]
    pub send_timeout: Duration,

    /// Threads that serve client connections, each with an event loop of its own; a connection
    /// stays on one thread for its lifetime (no hand-offs between threads per request). 0: one
    /// per CPU.
    #[arg(
        long,
        env = "FENCE_PROXY_THREADS",
        value_name = "N",
        default_value_t = 0
    )]
    pub threads: usize,

    #[command(flatten)]
    /// The TLS and client-access flags.
    pub tls: crate::tls::TlsArgs,

    /// Public key (PEM, as `lockctl keys export` writes it) that verifies `Lock-Sequencer`;
    /// repeatable (key rotation). With one, every write needs a sequencer that verifies.
    #[arg(
        long = "verify-key",
        env = "FENCE_PROXY_VERIFY_KEY",
        value_name = "FILE",
        value_delimiter = ','
    )]
    pub verify_key: Vec<std::path::PathBuf>,

    /// With --verify-key: still accept writes with a plain Fencing-Token and no sequencer
    /// (migration). Without --verify-key it changes nothing.
    #[arg(long, env = "FENCE_PROXY_ALLOW_UNSIGNED")]
    pub allow_unsigned: bool,
}

/// A duration greater than zero (a zero header timeout would close every connection at once).
fn parse_positive_duration(s: &str) -> Result<Duration, String> {
    let d = lockd_service_kit::durations::parse_timing(s)?;
    if d.is_zero() {
        return Err(format!("{s:?}: must be greater than zero"));
    }
    Ok(d)
}

/// A quarter of `max_in_flight`, at least one: four clients fill the proxy, one cannot.
pub fn default_per_client(max_in_flight: u64) -> usize {
    (max_in_flight / 4).max(1) as usize
}

impl Args {
    /// The server's limits derived from these flags.
    pub fn limits(&self) -> crate::server::Limits {
        crate::server::Limits {
            max_in_flight: self.max_in_flight as usize,
            max_in_flight_per_client: self
                .max_in_flight_per_client
                .map_or_else(|| default_per_client(self.max_in_flight), |n| n as usize),
            max_connections: self.max_connections as usize,
            max_connections_per_client: self.max_connections_per_client as usize,
            header_read_timeout: self.header_read_timeout,
            idle_timeout: self.idle_timeout,
            send_timeout: self.send_timeout,
            threads: self.threads,
        }
    }

    /// The store's options derived from these flags.
    pub fn store_options(&self) -> StoreOptions {
        StoreOptions {
            timing: Timing {
                lock_wait: self.lock_wait,
                forward_timeout: self.upstream_timeout,
                quarantine: self.quarantine,
                store_timeout: self.store_timeout,
            },
            postgres_table: self.store_table.clone(),
            postgres_max_connections: self.store_max_connections,
            max_resources: self.max_resources,
        }
    }
}

/// A validated upstream base URL: `http(s)://host[:port][/prefix]`.
#[derive(Clone, Debug)]
pub struct Upstream {
    /// `http` or `https`.
    pub scheme: http::uri::Scheme,
    /// Host and port.
    pub authority: http::uri::Authority,
    /// Path prefix without a trailing `/` (empty for none), put in front of every request path.
    pub path_prefix: String,
    /// For `https`: how the upstream's certificate is checked (`--upstream-ca`, set by
    /// [`Upstream::with_tls`]; reloadable, read at each new connection). An https upstream
    /// without it fails every connection.
    pub tls: Option<std::sync::Arc<fence_proxy_net::ReloadableClientConfig>>,
}

impl Upstream {
    /// This upstream with its TLS client configuration.
    pub fn with_tls(
        mut self,
        tls: Option<std::sync::Arc<fence_proxy_net::ReloadableClientConfig>>,
    ) -> Upstream {
        self.tls = tls;
        self
    }
}

impl FromStr for Upstream {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let uri: http::Uri = s
            .parse()
            .map_err(|e| format!("upstream {s:?} is not a URL: {e}"))?;
        let scheme = match uri.scheme_str() {
            Some("http") => http::uri::Scheme::HTTP,
            Some("https") => http::uri::Scheme::HTTPS,
            Some(other) => {
                return Err(format!(
                    "upstream {s:?}: scheme {other:?} is not supported, only http:// and https://"
                ));
            }
            None => {
                return Err(format!(
                    "upstream {s:?} needs http:// or https:// and a host"
                ));
            }
        };
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| format!("upstream {s:?} has no host"))?;
        if uri.query().is_some() {
            return Err(format!("upstream {s:?} must not have a query string"));
        }
        Ok(Upstream {
            scheme,
            authority,
            path_prefix: uri.path().trim_end_matches('/').to_owned(),
            tls: None,
        })
    }
}

impl std::fmt::Display for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}://{}{}",
            self.scheme, self.authority, self.path_prefix
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    /// Goal: a bound too large for the proxy's semaphores is refused with an error naming the
    /// flag and the value (it panicked at startup: `--max-in-flight 18446744073709551615`).
    #[test]
    fn bounds_too_large_are_refused_by_name() {
        for flag in [
            "--max-in-flight",
            "--max-in-flight-per-client",
            "--max-connections",
            "--max-connections-per-client",
        ] {
            let huge = u64::MAX.to_string();
            let base = [
                "fence-proxy",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://h",
            ];
            let argv = [&base[..], &[flag, huge.as_str()]].concat();
            let err = Cli::try_parse_from(argv).err().expect("accepted");
            let text = err.to_string();
            assert!(text.contains(flag) && text.contains(&huge), "{text}");
            let ok = [&base[..], &[flag, "1000000"]].concat();
            if let Err(e) = Cli::try_parse_from(ok) {
                panic!("{flag} 1000000 refused: {e}");
            }
        }
    }

    #[test]
    fn upstream_urls() {
        let u: Upstream = "http://127.0.0.1:9000/base/".parse().unwrap();
        assert_eq!(u.to_string(), "http://127.0.0.1:9000/base");
        let u: Upstream = "http://h".parse().unwrap();
        assert_eq!(u.path_prefix, "");
        let u: Upstream = "https://h:8443".parse().unwrap();
        assert_eq!(u.to_string(), "https://h:8443");
        for bad in ["ftp://h", "h:80", "/x", "http://h/?q=1"] {
            let err = bad.parse::<Upstream>().unwrap_err();
            assert!(err.contains(&format!("{bad:?}")), "{err}");
        }
    }
}
