//! The nodes a client talks to: parsed once, connected lazily, rotated on failure.
//!
//! Any node forwards client calls to the leader, so the client needs no leader discovery: it keeps
//! using one endpoint until it fails (transport error, `UNAVAILABLE`, no answer), then moves to the
//! next. A connection that failed is dropped and re-established explicitly on next use, which is how
//! the retry loop knows whether a request left the client at all.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::config::ClientTls;

use crate::error::Error;

/// Upper bound on the endpoint list: a lockd cluster has a handful of voters, and a long list
/// mostly means a mistaken argument.
pub const ENDPOINTS_MAX: usize = 64;

/// One node: its address and, once connected, its channel.
struct Slot {
    /// As given by the user, for messages.
    name: String,
    endpoint: Endpoint,
    /// `None` until first use and after a transport failure. A std mutex: held only to clone or
    /// replace the channel, never across an await.
    channel: Mutex<Option<Channel>>,
}

/// The endpoint list and the index of the one in use.
pub struct Endpoints {
    slots: Vec<Slot>,
    /// Index of the endpoint the next attempt uses; advanced when it fails.
    current: AtomicUsize,
}

impl Endpoints {
    /// Parses `host:port`, `http://host:port` or (with `tls`) `https://host:port` entries;
    /// nothing is connected yet.
    pub fn parse<I, S>(
        endpoints: I,
        connect_timeout: Duration,
        tls: Option<&ClientTls>,
    ) -> Result<Self, Error>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut slots = Vec::new();
        for raw in endpoints {
            let raw = raw.as_ref().trim();
            let uri = normalize(raw, tls.is_some())?;
            let mut endpoint = Endpoint::from_shared(uri)
                .map_err(|e| bad(raw, &e.to_string()))?
                .connect_timeout(connect_timeout)
                .tcp_nodelay(true);
            if let Some(tls) = tls {
                let mut config =
                    ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&tls.ca_pem));
                if let Some((cert, key)) = &tls.identity {
                    config = config.identity(Identity::from_pem(cert, key));
                }
                endpoint = endpoint.tls_config(config).map_err(|e| Error::BadTls {
                    reason: format!("endpoint {raw:?}: {e}"),
                })?;
            }
            slots.push(Slot {
                name: raw.to_owned(),
                endpoint,
                channel: Mutex::new(None),
            });
        }
        if slots.is_empty() {
            return Err(bad("", "the endpoint list is empty"));
        }
        if slots.len() > ENDPOINTS_MAX {
            return Err(bad(
                &slots[ENDPOINTS_MAX].name,
                &format!("more than {ENDPOINTS_MAX} endpoints"),
            ));
        }
        Ok(Endpoints {
            slots,
            current: AtomicUsize::new(0),
        })
    }

    /// How many endpoints there are.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The endpoint the next attempt should use.
    pub fn current(&self) -> usize {
        self.current.load(Ordering::Relaxed) % self.slots.len()
    }

    /// The endpoint at `index`, as given.
    pub fn name(&self, index: usize) -> &str {
        &self.slots[index].name
    }

    /// Moves on from `failed` to the next endpoint, unless another call already did.
    pub fn rotate_from(&self, failed: usize) {
        let next = (failed + 1) % self.slots.len();
        let _ = self
            .current
            .compare_exchange(failed, next, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// The channel of endpoint `index`, connecting first when there is none. A connect error means
    /// the request was never sent.
    pub async fn channel(&self, index: usize) -> Result<Channel, tonic::transport::Error> {
        let slot = &self.slots[index];
        if let Some(ch) = slot.channel.lock().expect("channel mutex").clone() {
            return Ok(ch);
        }
        let ch = slot.endpoint.connect().await?;
        *slot.channel.lock().expect("channel mutex") = Some(ch.clone());
        Ok(ch)
    }

    /// Forgets the channel of `index` after a transport failure, so the next use reconnects.
    pub fn invalidate(&self, index: usize) {
        *self.slots[index].channel.lock().expect("channel mutex") = None;
    }
}

/// Turns `host:port` into `http://host:port` (`https://` with TLS), rejecting anything that is
/// not a plain address or whose scheme does not match the TLS setting.
fn normalize(raw: &str, tls: bool) -> Result<String, Error> {
    if raw.is_empty() {
        return Err(bad(raw, "empty endpoint"));
    }
    let scheme = if tls { "https" } else { "http" };
    let uri = if raw.contains("://") {
        raw.to_owned()
    } else {
        format!("{scheme}://{raw}")
    };
    let parsed: tonic::codegen::http::Uri = uri
        .parse()
        .map_err(|e: tonic::codegen::http::uri::InvalidUri| bad(raw, &e.to_string()))?;
    match (parsed.scheme_str(), tls) {
        (Some("http"), false) | (Some("https"), true) => {}
        (Some("https"), false) => {
            return Err(bad(raw, "https:// needs TLS settings (--cacert)"));
        }
        (Some("http"), true) => {
            return Err(bad(
                raw,
                "http:// is plaintext, but TLS is configured: use https://",
            ));
        }
        _ => return Err(bad(raw, "only http:// and https:// are supported")),
    }
    if parsed.host().is_none_or(str::is_empty) {
        return Err(bad(raw, "missing host"));
    }
    if parsed.port_u16().is_none() {
        return Err(bad(raw, "missing port (expected host:port)"));
    }
    if parsed.path_and_query().is_some_and(|p| p.as_str() != "/") {
        return Err(bad(raw, "an endpoint has no path"));
    }
    Ok(uri)
}

fn bad(endpoint: &str, reason: &str) -> Error {
    Error::BadEndpoint {
        endpoint: endpoint.to_owned(),
        reason: reason.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(1);

    #[test]
    fn accepts_host_port_and_http_urls() {
        let e = Endpoints::parse(
            ["127.0.0.1:7001", "http://localhost:7002", " [::1]:7003 "],
            T,
            None,
        )
        .unwrap();
        assert_eq!(e.len(), 3);
        assert_eq!(e.name(2), "[::1]:7003");
    }

    #[test]
    fn the_scheme_must_match_the_tls_setting() {
        let tls = ClientTls {
            ca_pem: Vec::new(),
            identity: None,
        };
        assert!(Endpoints::parse(["a:1", "https://b:2"], T, Some(&tls)).is_ok());
        let err = Endpoints::parse(["http://a:1"], T, Some(&tls))
            .err()
            .unwrap();
        assert!(err.to_string().contains("use https://"), "{err}");
        let err = Endpoints::parse(["https://a:1"], T, None).err().unwrap();
        assert!(err.to_string().contains("--cacert"), "{err}");
    }

    #[test]
    fn rejects_bad_endpoints_naming_them() {
        for bad in [
            "",
            "127.0.0.1",
            "nonsense",
            "https://a:1",
            "a:b",
            "http://a:1/x",
            ":7001",
        ] {
            let err = Endpoints::parse([bad], T, None)
                .err()
                .unwrap_or_else(|| panic!("{bad:?} accepted"));
            assert!(
                matches!(err, Error::BadEndpoint { ref endpoint, .. } if endpoint == bad),
                "{bad:?}: {err}"
            );
        }
        assert!(Endpoints::parse(Vec::<String>::new(), T, None).is_err());
    }

    #[test]
    fn rotation_moves_once_per_failure() {
        let e = Endpoints::parse(["a:1", "b:2", "c:3"], T, None).unwrap();
        assert_eq!(e.current(), 0);
        e.rotate_from(0);
        // A second caller that also failed on endpoint 0 does not skip endpoint 1.
        e.rotate_from(0);
        assert_eq!(e.current(), 1);
        e.rotate_from(1);
        e.rotate_from(2);
        assert_eq!(e.current(), 0);
    }
}
