//! The connection to the upstream Postgres: `--upstream`'s `sslmode` and `sslrootcert` read as
//! libpq reads them, the SSLRequest exchange for client sessions, and a rustls connector for the
//! proxy's own tokio-postgres connections (start-up check, `init`).
//!
//! | `sslmode` | TLS | certificate check |
//! |---|---|---|
//! | `disable` | never | - |
//! | `prefer` (default, as libpq) | if the server agrees | none, or the chain with `sslrootcert` |
//! | `require` | always; a server that refuses fails the connection | none, or the chain with `sslrootcert` (as libpq) |
//! | `verify-ca` | always | chain to `sslrootcert` |
//! | `verify-full` | always | chain to `sslrootcert` and the URL's host named in the certificate |

use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use fence_proxy_net::tls::server_name;
use fence_proxy_net::{ReloadableClientConfig, ServerCheckFiles, TlsReloader};
use rustls::ClientConfig;
use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};

/// libpq's `sslmode` values the proxy implements (`allow` is not: it never protects anything).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
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

/// `--upstream` split into what tokio-postgres understands and the TLS settings it does not
/// (it knows no `verify-ca`, `verify-full` or `sslrootcert`).
pub struct ParsedUpstream {
    /// tokio-postgres's configuration: the URL without the TLS parameters, with `sslmode`
    /// `disable`, `prefer` or `require` so that it sends an SSLRequest when it should.
    pub config: tokio_postgres::Config,
    pub tls: UpstreamTls,
}

/// Reads a postgres:// URL as libpq would, TLS parameters included. `what` names the flag in
/// errors.
pub fn parse(url: &str, what: &str) -> anyhow::Result<ParsedUpstream> {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, q),
        None => (url, ""),
    };
    let mut mode = SslMode::Prefer;
    let mut root_cert: Option<PathBuf> = None;
    let mut rest = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let decoded = percent_decode(value);
        match key {
            "sslmode" => {
                mode = SslMode::parse(&decoded).map_err(|e| anyhow::anyhow!("{what}: {e}"))?
            }
            "sslrootcert" => root_cert = Some(PathBuf::from(decoded)),
            // A client certificate towards the upstream is not implemented: refuse rather than
            // connect without the identity the operator asked for.
            "sslcert" | "sslkey" | "sslpassword" | "sslcrl" | "sslcrldir" => anyhow::bail!(
                "{what}: {key} is not supported (the proxy does not present a client certificate upstream)"
            ),
            _ => rest.push(pair),
        }
    }
    let pg_mode = match mode {
        SslMode::Disable => "disable",
        SslMode::Prefer => "prefer",
        _ => "require",
    };
    let pg_mode = format!("sslmode={pg_mode}");
    rest.push(&pg_mode);
    let stripped = format!("{base}?{}", rest.join("&"));
    let config: tokio_postgres::Config = stripped
        .parse()
        .map_err(|e| anyhow::anyhow!("{what} {url:?} is not a postgres:// URL: {e}"))?;
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        Some(_) => anyhow::bail!("{what} {url:?}: only TCP hosts are supported, not Unix sockets"),
        None => anyhow::bail!("{what} {url:?} names no host"),
    };
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
        config,
        tls: UpstreamTls {
            mode,
            config: config_tls,
            name,
        },
    })
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
pub type BoxIo = Box<dyn Io>;

/// Why a TLS negotiation with the upstream failed.
#[derive(Debug, thiserror::Error)]
pub enum NegotiateError {
    #[error("the upstream refused TLS, but --upstream asks for sslmode={0}")]
    Refused(&'static str),
    #[error("the upstream answered the SSLRequest with {0:?}, not S or N")]
    BadAnswer(char),
    #[error("TLS handshake (sslmode={mode}): {error}")]
    Handshake {
        mode: &'static str,
        error: io::Error,
    },
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

    /// Has `reloader` read `sslrootcert` again on every reload (nothing to do without one).
    pub fn register(&self, reloader: &TlsReloader) {
        if let Some(config) = &self.config {
            reloader.add_client(config);
        }
    }

    /// A connector for tokio-postgres with this configuration (plain when `disable`).
    pub fn connector(&self) -> MakeRustls {
        MakeRustls {
            config: self.config.clone(),
            name: self.name.clone(),
        }
    }
}

/// tokio-postgres's TLS hook backed by rustls.
#[derive(Clone)]
pub struct MakeRustls {
    config: Option<Arc<ReloadableClientConfig>>,
    name: ServerName<'static>,
}

impl<S> MakeTlsConnect<S> for MakeRustls
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type TlsConnect = RustlsConnect;
    type Error = io::Error;

    /// Called for every connection, `disable` included (tokio-postgres then never starts TLS).
    fn make_tls_connect(&mut self, _domain: &str) -> Result<RustlsConnect, io::Error> {
        Ok(RustlsConnect {
            config: self.config.as_ref().map(|c| c.current()),
            name: self.name.clone(),
        })
    }
}

pub struct RustlsConnect {
    /// `None` under `disable`, where tokio-postgres never calls `connect`.
    config: Option<Arc<ClientConfig>>,
    name: ServerName<'static>,
}

impl<S> TlsConnect<S> for RustlsConnect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<RustlsStream<S>>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        Box::pin(async move {
            let config = self.config.ok_or_else(|| {
                io::Error::other("TLS started under sslmode=disable (a bug in fence-proxy)")
            })?;
            let s = tokio_rustls::TlsConnector::from(config)
                .connect(self.name, stream)
                .await?;
            Ok(RustlsStream(s))
        })
    }
}

/// A rustls stream as tokio-postgres wants it.
pub struct RustlsStream<S>(tokio_rustls::client::TlsStream<S>);

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for RustlsStream<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for RustlsStream<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> tokio_postgres::tls::TlsStream for RustlsStream<S> {
    /// No channel binding: SCRAM runs without `-PLUS`, as with libpq's `channel_binding=prefer`
    /// against a server that does not offer it.
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_and_errors() {
        let p = parse("postgres://u@db.internal:5433/app", "--upstream").unwrap();
        assert_eq!(p.tls.mode, SslMode::Prefer);
        let p = parse(
            "postgres://u@h/app?sslmode=disable&application_name=x",
            "--upstream",
        )
        .unwrap();
        assert_eq!(p.tls.mode, SslMode::Disable);
        assert_eq!(p.config.get_application_name(), Some("x"));
        let e = parse("postgres://u@h/app?sslmode=verify-full", "--upstream")
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("sslrootcert"), "{e}");
        let e = parse("postgres://u@h/app?sslmode=allow", "--upstream")
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("\"allow\""), "{e}");
        let e = parse(
            "postgres://u@h/app?sslmode=require&sslcert=/c.pem",
            "--upstream",
        )
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("sslcert"), "{e}");
        let e = parse(
            "postgres://u@h/app?sslmode=verify-ca&sslrootcert=/nonexistent/ca.pem",
            "--upstream",
        )
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("/nonexistent/ca.pem"), "{e}");
    }

    #[test]
    fn percent_escapes() {
        assert_eq!(percent_decode("%2Fetc%2Fca.pem"), "/etc/ca.pem");
        assert_eq!(percent_decode("a%2"), "a%2");
    }
}
