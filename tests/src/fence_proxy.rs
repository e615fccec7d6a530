//! `fence-proxy http` as a child process on a random loopback address, and a small HTTP client
//! to talk to it.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::process::{ChildGuard, command, random_loopback_ip};

/// Port of the proxy on its random loopback address; metrics on the next one.
pub const PROXY_PORT: u16 = 18080;

/// How long a started proxy may take to answer `/healthz`.
const STARTUP_WAIT: Duration = Duration::from_secs(20);

/// A running `fence-proxy http`, killed when dropped.
pub struct FenceProxy {
    pub addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    /// The arguments it was started with, to restart it identically.
    args: Vec<String>,
    /// Environment added to the next starts ([`FenceProxy::set_env`]).
    env: Vec<(String, String)>,
    child: Option<ChildGuard>,
}

impl FenceProxy {
    /// Starts `fence-proxy http --upstream UPSTREAM --store STORE EXTRA...` and waits until it
    /// serves.
    pub async fn start(upstream: &str, store: &str, extra: &[&str]) -> anyhow::Result<FenceProxy> {
        let ip = random_loopback_ip();
        let addr = SocketAddr::new(ip.into(), PROXY_PORT);
        let metrics_addr = SocketAddr::new(ip.into(), PROXY_PORT + 1);
        Self::start_at(addr, metrics_addr, upstream, store, extra).await
    }

    /// [`FenceProxy::start`] on addresses chosen by the caller (for a certificate naming them).
    pub async fn start_at(
        addr: SocketAddr,
        metrics_addr: SocketAddr,
        upstream: &str,
        store: &str,
        extra: &[&str],
    ) -> anyhow::Result<FenceProxy> {
        let mut args: Vec<String> = vec![
            "http".into(),
            "--listen".into(),
            addr.to_string(),
            "--metrics-listen".into(),
            metrics_addr.to_string(),
            "--upstream".into(),
            upstream.into(),
            "--store".into(),
            store.into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut proxy = FenceProxy {
            addr,
            metrics_addr,
            args,
            env: Vec::new(),
            child: None,
        };
        proxy.restart().await?;
        Ok(proxy)
    }

    /// Starts the process again with the same arguments (after [`FenceProxy::kill`]).
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        let mut cmd = command("fence-proxy");
        cmd.args(&self.args).env("RUST_LOG", "warn");
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        let mut child = ChildGuard::spawn(format!("fence-proxy {}", self.addr), cmd)?;
        let deadline = Instant::now() + STARTUP_WAIT;
        loop {
            if let Some(status) = child.try_wait() {
                anyhow::bail!("fence-proxy {:?} exited at startup: {status}", self.args);
            }
            // Metrics come up first; the proxy's listener binds after the store is open.
            let health = get(&format!("http://{}/healthz", self.metrics_addr)).await;
            let listening = tokio::net::TcpStream::connect(self.addr).await.is_ok();
            if health.is_ok_and(|r| r.status == 200) && listening {
                break;
            }
            if Instant::now() > deadline {
                anyhow::bail!(
                    "fence-proxy {:?} did not serve within {STARTUP_WAIT:?}",
                    self.args
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.child = Some(child);
        Ok(())
    }

    /// Environment variables for every later [`FenceProxy::restart`] (a preloaded library that
    /// fakes the clock, say); the running process keeps its own.
    pub fn set_env(&mut self, env: &[(&str, &str)]) {
        self.env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
    }

    /// SIGTERM, as a service manager stops it, and waits up to `within` for it to exit; the
    /// status it exited with. Fails if it is still running then (it is killed by the drop).
    pub async fn stop(&mut self, within: Duration) -> anyhow::Result<std::process::ExitStatus> {
        let child = self
            .child
            .as_mut()
            .ok_or_else(|| anyhow::anyhow!("fence-proxy {} is not running", self.addr))?;
        child.signal(nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = child.try_wait() {
                self.child = None;
                return Ok(status);
            }
            if Instant::now() > deadline {
                anyhow::bail!(
                    "fence-proxy {} still runs {within:?} after SIGTERM",
                    self.addr
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// kill -9.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill();
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// The Prometheus text of `/metrics`.
    pub async fn metrics(&self) -> anyhow::Result<String> {
        Ok(get(&format!("http://{}/metrics", self.metrics_addr))
            .await?
            .body)
    }

    /// A write through the proxy with the given fence (either may be absent) and extra headers.
    pub async fn write(
        &self,
        method: &str,
        path: &str,
        fence: (Option<&str>, Option<&str>),
        headers: &[(&str, &str)],
        body: &str,
    ) -> anyhow::Result<Reply> {
        let mut all: Vec<(&str, &str)> = Vec::new();
        if let Some(r) = fence.0 {
            all.push(("Lock-Resource", r));
        }
        if let Some(t) = fence.1 {
            all.push(("Fencing-Token", t));
        }
        all.extend_from_slice(headers);
        send(method, &self.url(path), &all, body).await
    }
}

impl Drop for FenceProxy {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A response, read whole.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: hyper::HeaderMap,
    pub body: String,
}

impl Reply {
    /// The `Fence-Proxy-Error` reason, if the proxy made this response.
    pub fn proxy_error(&self) -> Option<&str> {
        self.headers.get("fence-proxy-error")?.to_str().ok()
    }

    /// The body as JSON (the proxy's error body).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {:?}", self.body))
    }
}

fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

pub async fn get(url: &str) -> anyhow::Result<Reply> {
    send("GET", url, &[], "").await
}

pub async fn send(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> anyhow::Result<Reply> {
    let mut req = hyper::Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(Bytes::from(body.to_owned())))?;
    let resp = client().request(req).await?;
    let (parts, body) = resp.into_parts();
    let body = body.collect().await?.to_bytes();
    Ok(Reply {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}
