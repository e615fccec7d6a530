//! Certificate reload on SIGHUP: a proxy whose log the tests read, and HTTPS and Postgres sessions
//! opened before and after a reload.

mod http;
mod postgres;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::loopback;
use lockd_tests::pg::{free_port, unique_name};
use lockd_tests::process::{ChildGuard, command};
use lockd_tests::tls::Issued;
use nix::sys::signal::Signal;

/// How long a reload may take to show (log line, new certificate served) after SIGHUP.
const RELOAD_WAIT: Duration = Duration::from_secs(15);

/// A `fence-proxy` process of either front end with its log (RUST_LOG=info) in a file, so the
/// SIGHUP tests can signal it by PID and read what it said. Killed when dropped.
struct LoggedProxy {
    addr: SocketAddr,
    metrics_addr: SocketAddr,
    log: PathBuf,
    child: ChildGuard,
}

impl LoggedProxy {
    /// Starts `fence-proxy FRONTEND --listen A --metrics-listen M ARGS...` and waits until it
    /// accepts on both addresses.
    async fn start(dir: &Path, frontend: &str, args: &[String]) -> LoggedProxy {
        let addr = loopback(free_port());
        let metrics_addr = loopback(free_port());
        let log = dir.join(format!("{}.log", unique_name(frontend)));
        let file = std::fs::File::create(&log).unwrap();
        let mut cmd = command("fence-proxy");
        cmd.arg(frontend)
            .arg("--listen")
            .arg(addr.to_string())
            .arg("--metrics-listen")
            .arg(metrics_addr.to_string())
            .args(args)
            .env("RUST_LOG", "info")
            .env_remove("FENCE_PROXY_LOG_FORMAT")
            .stdout(Stdio::null())
            .stderr(file);
        let child = ChildGuard::spawn(format!("fence-proxy {frontend} {addr}"), cmd).unwrap();
        let mut proxy = LoggedProxy {
            addr,
            metrics_addr,
            log,
            child,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            proxy.assert_running("starting");
            let listening = tokio::net::TcpStream::connect(addr).await.is_ok();
            let metrics = tokio::net::TcpStream::connect(metrics_addr).await.is_ok();
            if listening && metrics {
                return proxy;
            }
            assert!(
                Instant::now() < deadline,
                "fence-proxy {frontend} did not accept within 30 s; log:\n{}",
                proxy.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn assert_running(&mut self, when: &str) {
        if let Some(status) = self.child.try_wait() {
            panic!("fence-proxy exited {when}: {status}; log:\n{}", self.log());
        }
    }

    /// `kill -HUP <pid>`.
    fn hup(&self) {
        self.child.signal(Signal::SIGHUP);
    }

    /// Waits until the log holds `needle` at least `times` times; fails at once if the process
    /// exits meanwhile (SIGHUP's default action would end it).
    async fn wait_for_log(&mut self, needle: &str, times: usize) -> String {
        let deadline = Instant::now() + RELOAD_WAIT;
        loop {
            self.assert_running(&format!("while waiting for {needle:?} in its log"));
            let log = self.log();
            if log.matches(needle).count() >= times {
                return log;
            }
            assert!(
                Instant::now() < deadline,
                "{needle:?} not logged {times} time(s) within {RELOAD_WAIT:?}; log:\n{log}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The value of the series of `name` whose labels include every one of `labels`
    /// (`key="value"`).
    async fn metric(&self, name: &str, labels: &[&str]) -> Option<f64> {
        let text = lockd_tests::fence_proxy::get(&format!("http://{}/metrics", self.metrics_addr))
            .await
            .unwrap()
            .body;
        text.lines()
            .filter(|l| l.starts_with(&format!("{name}{{")))
            .filter(|l| labels.iter().all(|label| l.contains(label)))
            .find_map(|l| l.rsplit(' ').next()?.parse().ok())
    }
}

/// Polls `check` every 50 ms until it holds, for at most [`RELOAD_WAIT`].
async fn poll_until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + RELOAD_WAIT;
    while !check().await {
        assert!(
            Instant::now() < deadline,
            "{what}: not within {RELOAD_WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One HTTP/1.1 connection over TLS, kept open across requests.
type KeptHttps = hyper::client::conn::http1::SendRequest<http_body_util::Full<bytes::Bytes>>;

/// Connects to `addr` over TLS trusting only the CA in `ca`, checking the name `localhost`.
/// Fails when the server's certificate does not chain to it.
async fn https_connect(addr: SocketAddr, ca: &Path) -> anyhow::Result<KeptHttps> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::CertificateDer::pem_file_iter(ca)? {
        roots.add(c?)?;
    }
    let mut config = rustls::ClientConfig::builder_with_provider(
        rustls::crypto::ring::default_provider().into(),
    )
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(rustls::pki_types::ServerName::try_from("localhost")?, tcp)
        .await?;
    let (sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls)).await?;
    tokio::spawn(connection);
    Ok(sender)
}

/// A fenced PUT on `conn`; returns the status.
async fn https_put(conn: &mut KeptHttps, resource: &str, token: u64) -> anyhow::Result<u16> {
    conn.ready().await?;
    let request = hyper::Request::builder()
        .method("PUT")
        .uri("/things/1")
        .header("host", "localhost")
        .header("Lock-Resource", resource)
        .header("Fencing-Token", token.to_string())
        .body(http_body_util::Full::new(bytes::Bytes::from_static(b"v")))?;
    let response = conn.send_request(request).await?;
    let status = response.status().as_u16();
    http_body_util::BodyExt::collect(response.into_body()).await?;
    Ok(status)
}

/// Whether a new connection trusting only `ca` gets a fenced write through (200).
async fn new_connection_writes(addr: SocketAddr, ca: &Path, resource: &str, token: u64) -> bool {
    match https_connect(addr, ca).await {
        Ok(mut conn) => https_put(&mut conn, resource, token).await.ok() == Some(200),
        Err(_) => false,
    }
}

fn copy_pair(from: &Issued, cert: &Path, key: &Path) {
    std::fs::copy(&from.cert, cert).unwrap();
    std::fs::copy(&from.key, key).unwrap();
}
