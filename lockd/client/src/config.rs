//! Client settings and the timing constants behind their defaults, kept together.

use std::time::Duration;

/// How long establishing a TCP + HTTP/2 connection to one endpoint may take before the client moves
/// on to the next one. Loopback and LAN connections take well under a millisecond; a node that does
/// not answer within a second is down or partitioned, and another node can forward for us.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// Longest a single non-waiting RPC attempt may take. docs/api.md bounds a node without quorum
/// to answer `UNAVAILABLE` within 5 s; one more second covers the network and scheduling.
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(6);

/// Default total time for one logical call, all retries included, on top of any `wait_timeout`.
/// A leader election takes a few hundred milliseconds (openraft's election timeout is 150-300 ms);
/// fifteen seconds rides out several elections and a node restart without hanging a caller forever.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(15);

/// Smallest safety margin subtracted from a lease's deadline. It covers the rate difference between
/// the client's and the leader's monotonic clocks, scheduling delays between the deadline passing
/// and the application reacting, and timer granularity (tokio timers fire at 1 ms resolution).
pub const SAFETY_MARGIN_MIN: Duration = Duration::from_millis(250);

/// The safety margin as a fraction of the ttl (1/`SAFETY_MARGIN_TTL_DIVISOR`): clock-rate errors
/// grow with the interval they are measured over, so a longer ttl gets a longer margin.
pub const SAFETY_MARGIN_TTL_DIVISOR: u32 = 10;

/// Renewals are due every ttl / `RENEWALS_PER_TTL`: three chances to renew before the lease could
/// expire, so one lost or slow renewal does not lose the lease.
pub const RENEWALS_PER_TTL: u32 = 3;

/// Each renewal interval is shortened by a random fraction of up to 1/`RENEW_JITTER_DIVISOR`, so
/// that many clients that acquired together do not renew in lockstep.
pub const RENEW_JITTER_DIVISOR: u32 = 4;

/// Settings of a [`crate::Client`]. `ClientConfig::new(endpoints)` gives the defaults above.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// `host:port` or `http://host:port` of every node; any node forwards to the leader, the list
    /// only needs to contain at least one live node.
    pub endpoints: Vec<String>,
    /// Limit on connecting to one endpoint; see [`CONNECT_TIMEOUT`].
    pub connect_timeout: Duration,
    /// Limit on one non-waiting RPC attempt; see [`ATTEMPT_TIMEOUT`].
    pub attempt_timeout: Duration,
    /// Default limit on a whole call with its retries; see [`CALL_TIMEOUT`].
    pub call_timeout: Duration,
    /// Margin subtracted from every lease deadline; `None` = [`crate::default_safety_margin`].
    pub safety_margin: Option<Duration>,
    /// Free text sent as `holder` with every `Acquire` that does not set its own, shown by
    /// `Describe` so that operators can tell who holds a lock.
    pub holder: String,
    /// TLS towards the nodes; `None` speaks plaintext gRPC.
    pub tls: Option<ClientTls>,
    /// Sent as `authorization: Bearer <secret>` on every call, for clusters with an
    /// authorization policy that identify this client by token (lockd `--auth-tokens`).
    pub bearer_token: Option<BearerToken>,
}

/// A bearer token's secret. Never printed.
#[derive(Clone)]
pub struct BearerToken(String);

impl std::fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BearerToken(<secret>)")
    }
}

impl BearerToken {
    /// A token from its secret; it must be visible ASCII without spaces (it travels in a header).
    pub fn new(secret: impl Into<String>) -> Result<Self, crate::Error> {
        let secret = secret.into();
        if secret.is_empty() || !secret.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(crate::Error::BadToken {
                reason: "a bearer token must be printable ASCII without spaces".to_owned(),
            });
        }
        Ok(BearerToken(secret))
    }

    /// The token in `path` (surrounding white space, such as a final newline, is ignored).
    pub fn from_file(path: &std::path::Path) -> Result<Self, crate::Error> {
        let text = std::fs::read_to_string(path).map_err(|e| crate::Error::BadToken {
            reason: format!("{}: {e}", path.display()),
        })?;
        Self::new(text.trim()).map_err(|e| crate::Error::BadToken {
            reason: format!("{}: {e}", path.display()),
        })
    }

    /// The `authorization` header value.
    pub(crate) fn header(&self) -> tonic::metadata::MetadataValue<tonic::metadata::Ascii> {
        format!("Bearer {}", self.0)
            .parse()
            .expect("checked to be visible ASCII")
    }
}

/// TLS towards lockd: the CA that issued the nodes' certificates and, for a client-certificate
/// identity, this client's certificate and key (all PEM), as etcdctl's `--cacert`, `--cert`,
/// `--key`.
#[derive(Clone)]
pub struct ClientTls {
    /// The CA certificate(s) that issued the nodes' certificates.
    pub ca_pem: Vec<u8>,
    /// Certificate and key.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

/// Never prints the private key (a `?config` in a log line must not leak it).
impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("ca_pem_bytes", &self.ca_pem.len())
            .field(
                "identity",
                &self.identity.as_ref().map(|_| "<certificate and key>"),
            )
            .finish()
    }
}

impl ClientTls {
    /// Reads the files; a missing or unreadable one is named in the error.
    pub fn from_files(
        ca: &std::path::Path,
        cert: Option<&std::path::Path>,
        key: Option<&std::path::Path>,
    ) -> Result<Self, crate::Error> {
        let read = |flag: &str, path: &std::path::Path| {
            std::fs::read(path).map_err(|e| crate::Error::BadTls {
                reason: format!("{flag} {}: {e}", path.display()),
            })
        };
        let identity = match (cert, key) {
            (Some(c), Some(k)) => Some((read("--cert", c)?, read("--key", k)?)),
            (None, None) => None,
            _ => {
                return Err(crate::Error::BadTls {
                    reason: "--cert and --key go together".to_owned(),
                });
            }
        };
        Ok(ClientTls {
            ca_pem: read("--cacert", ca)?,
            identity,
        })
    }
}

impl ClientConfig {
    /// Default settings for the cluster at `endpoints` (forms as [`crate::endpoints::Endpoints::parse`] takes).
    pub fn new<I, S>(endpoints: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        ClientConfig {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            connect_timeout: CONNECT_TIMEOUT,
            attempt_timeout: ATTEMPT_TIMEOUT,
            call_timeout: CALL_TIMEOUT,
            safety_margin: None,
            holder: default_holder(),
            tls: None,
            bearer_token: None,
        }
    }
}

/// `<hostname>/pid-<pid>`: enough for an operator to find the holding process.
fn default_holder() -> String {
    format!("{}/pid-{}", hostname(), std::process::id())
}

/// This machine's host name, for holder texts; `unknown-host` when it cannot be read.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown-host".to_owned())
}
