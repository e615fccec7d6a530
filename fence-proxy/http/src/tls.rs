//! TLS of the HTTP front end: the listener's certificate and client check, the allow-list of
//! client networks, and the connector that reaches an `https://` upstream through rustls. Both
//! TLS configurations are reloadable ([`fence_proxy_net::reload`]): each new connection takes the
//! one current when it starts.

use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use fence_proxy_net::{
    AllowList, ReloadableClientConfig, ReloadableServerConfig, ServerCheck, ServerCheckFiles,
    ServerTlsFiles, TlsReloader,
};
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use ipnet::IpNet;
use rustls::ClientConfig;
use tokio::net::TcpStream;

use crate::exchange::BoxError;

/// Flags of `fence-proxy http` about TLS and client access.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TlsArgs {
    /// PEM certificate chain to serve HTTPS with (HTTP/1.1 and HTTP/2 by ALPN); with
    /// --tls-key. Without it the listener speaks plain HTTP.
    #[arg(
        long,
        value_name = "FILE",
        env = "FENCE_PROXY_TLS_CERT",
        requires = "tls_key"
    )]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(
        long,
        value_name = "FILE",
        env = "FENCE_PROXY_TLS_KEY",
        requires = "tls_cert"
    )]
    pub tls_key: Option<PathBuf>,
    /// Require of every client a certificate issued by this PEM CA (mutual TLS).
    #[arg(
        long,
        value_name = "FILE",
        env = "FENCE_PROXY_TLS_CLIENT_CA",
        requires = "tls_cert"
    )]
    pub tls_client_ca: Option<PathBuf>,
    /// PEM CA certificate(s) an https:// upstream's certificate must chain to; its name must
    /// match the upstream URL's host. Required for https:// upstreams: no platform or bundled
    /// root store is read.
    #[arg(long, value_name = "FILE", env = "FENCE_PROXY_UPSTREAM_CA")]
    pub upstream_ca: Option<PathBuf>,
    /// Serve only clients from this network (CIDR such as 10.0.0.0/8, or one address);
    /// repeatable. Others' connections are closed at once, before any request is read.
    /// Default: every address.
    #[arg(long = "allow-client", value_name = "CIDR", env = "FENCE_PROXY_ALLOW_CLIENT",
          value_delimiter = ',', value_parser = fence_proxy_net::allow::parse_cidr)]
    pub allow_client: Vec<IpNet>,
}

/// Who may connect to the listener, and how: built from [`TlsArgs`] or by an embedding program.
#[derive(Clone, Default)]
pub struct Access {
    /// TLS on accepted connections, read when each handshake starts (so a reload reaches the
    /// next connection); `None` serves plain HTTP.
    pub tls: Option<Arc<ReloadableServerConfig>>,
    /// Client networks served; connections from elsewhere are closed at once.
    pub allow: AllowList,
}

impl TlsArgs {
    /// The listener's access settings.
    pub fn access(&self) -> anyhow::Result<Access> {
        let tls = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some(ReloadableServerConfig::load(ServerTlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: self.tls_client_ca.clone(),
                alpn: vec![b"h2".to_vec(), b"http/1.1".to_vec()],
            })?),
            _ => None,
        };
        Ok(Access {
            tls,
            allow: AllowList::new(self.allow_client.clone()),
        })
    }

    /// The client configuration for an https:// upstream: its certificate must chain to
    /// `--upstream-ca` and name the upstream's host (as libpq's verify-full).
    pub fn upstream_tls(
        &self,
        upstream: &crate::Upstream,
    ) -> anyhow::Result<Option<Arc<ReloadableClientConfig>>> {
        if upstream.scheme != http::uri::Scheme::HTTPS {
            anyhow::ensure!(
                self.upstream_ca.is_none(),
                "--upstream-ca is given but --upstream {upstream} is not https://"
            );
            return Ok(None);
        }
        let Some(ca) = &self.upstream_ca else {
            anyhow::bail!(
                "--upstream {upstream} is https:// and needs --upstream-ca FILE (fence-proxy trusts no platform root store)"
            );
        };
        Ok(Some(ReloadableClientConfig::load(
            ServerCheckFiles::Full(ca.clone()),
            &[b"http/1.1"],
            "--upstream-ca",
        )?))
    }
}

impl Access {
    /// Has `reloader` read this listener's certificate files again on every reload.
    pub fn register(&self, reloader: &TlsReloader) {
        if let Some(tls) = &self.tls {
            reloader.add_server(tls);
        }
    }
}

/// Where an upstream connection's TLS configuration comes from.
#[derive(Clone)]
enum UpstreamTlsSource {
    /// `--upstream-ca`, current at each connect.
    Reloadable(Arc<ReloadableClientConfig>),
    /// An https:// upstream configured without roots: an empty root store, so that every
    /// handshake fails rather than going unverified.
    Refusing(Arc<ClientConfig>),
}

impl UpstreamTlsSource {
    fn current(&self) -> Arc<ClientConfig> {
        match self {
            UpstreamTlsSource::Reloadable(c) => c.current(),
            UpstreamTlsSource::Refusing(c) => c.clone(),
        }
    }
}

/// Connects to the upstream: TCP, then TLS when the upstream is https://.
#[derive(Clone)]
pub struct UpstreamConnector {
    http: HttpConnector,
    /// TLS client configuration for an https:// upstream (`None` for http://), taken at each
    /// connect: pooled connections keep the one they were made with.
    tls: Option<UpstreamTlsSource>,
}

impl UpstreamConnector {
    /// A connector to `upstream`, with TLS for an https:// one.
    pub fn new(upstream: &crate::Upstream) -> UpstreamConnector {
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        // The scheme is checked here, not by HttpConnector, which refuses https:// URIs.
        http.enforce_http(false);
        let tls = (upstream.scheme == http::uri::Scheme::HTTPS).then(|| match &upstream.tls {
            Some(config) => UpstreamTlsSource::Reloadable(config.clone()),
            None => UpstreamTlsSource::Refusing(
                fence_proxy_net::tls::client_config(
                    &ServerCheck::Full(Arc::new(rustls::RootCertStore::empty())),
                    &[],
                )
                .expect("a client configuration with the default versions"),
            ),
        });
        UpstreamConnector { http, tls }
    }
}

impl tower::Service<http::Uri> for UpstreamConnector {
    type Response = UpstreamConnection;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<UpstreamConnection, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        tower::Service::poll_ready(&mut self.http, cx).map_err(Into::into)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let mut http = self.http.clone();
        let tls = self.tls.clone();
        Box::pin(async move {
            let host = uri.host().unwrap_or_default().to_owned();
            let tcp = tower::Service::call(&mut http, uri).await?;
            let Some(source) = tls else {
                return Ok(UpstreamConnection::Plain(tcp));
            };
            let config = source.current();
            let name = fence_proxy_net::tls::server_name(&host)?;
            let stream = tokio_rustls::TlsConnector::from(config)
                .connect(name, tcp.into_inner())
                .await
                .map_err(|e| format!("TLS handshake with the upstream {host}: {e}"))?;
            Ok(UpstreamConnection::Tls(Box::new(TokioIo::new(stream))))
        })
    }
}

/// One connection to the upstream, plain or TLS.
pub enum UpstreamConnection {
    /// An http:// upstream.
    Plain(TokioIo<TcpStream>),
    /// An https:// upstream.
    Tls(Box<TokioIo<tokio_rustls::client::TlsStream<TcpStream>>>),
}

impl Connection for UpstreamConnection {
    fn connected(&self) -> Connected {
        match self {
            UpstreamConnection::Plain(s) => s.connected(),
            UpstreamConnection::Tls(s) => s.inner().get_ref().0.connected(),
        }
    }
}

impl hyper::rt::Read for UpstreamConnection {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpstreamConnection::Plain(s) => Pin::new(s).poll_read(cx, buf),
            UpstreamConnection::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl hyper::rt::Write for UpstreamConnection {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            UpstreamConnection::Plain(s) => Pin::new(s).poll_write(cx, buf),
            UpstreamConnection::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpstreamConnection::Plain(s) => Pin::new(s).poll_flush(cx),
            UpstreamConnection::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpstreamConnection::Plain(s) => Pin::new(s).poll_shutdown(cx),
            UpstreamConnection::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}
