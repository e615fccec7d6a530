//! The Rust client (`lockd-client`) and `lockctl` against real three-node
//! clusters.
//!
//! Needs the `lockd` and `lockctl` binaries next to this test executable:
//! `cargo build -p lockd-server -p lockctl && cargo test -p lockd-tests --test client`.
//!
//! The tests measure lease timing on the monotonic clock with ttls of two seconds, so they run one
//! at a time (see [`serial`]): two of them at once on two cores could starve a renewal task long
//! enough to turn a timing check into a scheduling check.
//!
//! # Layout
//! - `guard`: the library's guards and acquires: renewals, a stalled holder, retries across a
//!   leader kill, dead endpoints, long waits, a lease that is gone.
//! - `lockctl`: `lockctl hold` and the other commands, their errors and JSON output.
//! - `retry`: what the client concludes from a repeated request id and from answers after a
//!   retry (review "clients" findings 1, 2 and 5).

#![allow(
    clippy::unwrap_used,
    reason = "test code: a failed unwrap is a failed test, with its message"
)]

mod guard;
mod lockctl;
mod retry;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use lockd_client::Client;
use lockd_tests::cluster::Cluster;
use lockd_tests::process::bin_path;
use nix::sys::signal::kill;
use nix::unistd::Pid;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::{Instant, sleep};

/// Short enough that waiting out a few ttls keeps the suite quick, long enough (policy minimum is
/// 1 s) that a renewal every ttl/3 is not at the mercy of scheduling.
const TTL: Duration = Duration::from_secs(2);

/// Upper bound for anything that should happen "promptly" (a lockctl exit after loss, a waiter
/// showing up): generous for a loaded two-core machine.
const PROMPTLY: Duration = Duration::from_secs(10);

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Runs timing-sensitive tests one at a time (an async mutex: a failed test releases it).
async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    SERIAL.lock().await
}

fn endpoints(cluster: &Cluster) -> Vec<String> {
    cluster.endpoints().split(',').map(str::to_owned).collect()
}

fn client(cluster: &Cluster) -> Client {
    Client::new(endpoints(cluster)).unwrap()
}

async fn describe(client: &Client, resource: &str) -> lockd_api::v1::DescribeResponse {
    client
        .describe(resource)
        .await
        .unwrap_or_else(|e| panic!("describe {resource:?}: {e}"))
}

/// Polls `check` every 50 ms until it holds or `within` passes.
async fn eventually<F, Fut>(what: &str, within: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while !check().await {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        sleep(Duration::from_millis(50)).await;
    }
}

fn process_exists(pid: i32) -> bool {
    kill(Pid::from_raw(pid), None).is_ok()
}

/// A TCP forwarder in front of one node whose traffic can be *held*: while frozen, bytes already
/// accepted are not forwarded and new connections are not connected. To a client this looks like a
/// long pause or a partition: requests get no answer, nothing is refused.
struct Stall {
    addr: String,
    frozen: watch::Sender<bool>,
    accept: tokio::task::JoinHandle<()>,
}

impl Stall {
    async fn start(target: String) -> Stall {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (frozen, rx) = watch::channel(false);
        let accept = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let mut rx = rx.clone();
                let target = target.clone();
                tokio::spawn(async move {
                    if rx.wait_for(|f| !*f).await.is_err() {
                        return;
                    }
                    let Ok(outbound) = TcpStream::connect(&target).await else {
                        return;
                    };
                    let (ri, wi) = inbound.into_split();
                    let (ro, wo) = outbound.into_split();
                    tokio::join!(pump(ri, wo, rx.clone()), pump(ro, wi, rx));
                });
            }
        });
        Stall {
            addr,
            frozen,
            accept,
        }
    }

    fn freeze(&self, on: bool) {
        self.frozen.send_replace(on);
    }
}

impl Drop for Stall {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, mut frozen: watch::Receiver<bool>) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => {
                let _ = to.shutdown().await;
                return;
            }
            Ok(n) => n,
        };
        if frozen.wait_for(|f| !*f).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// One stall per node, and their addresses as an endpoint list.
async fn stalls(cluster: &Cluster) -> (Vec<Stall>, Vec<String>) {
    let mut stalls = Vec::new();
    for e in endpoints(cluster) {
        stalls.push(Stall::start(e).await);
    }
    let addrs = stalls.iter().map(|s| s.addr.clone()).collect();
    (stalls, addrs)
}

/// `lockctl` with stdout/stderr captured, stdin closed, killed when dropped.
fn lockctl(endpoints: &str, args: &[&str]) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(bin_path("lockctl"));
    cmd.arg("--endpoints")
        .arg(endpoints)
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd
}

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

async fn run_lockctl(endpoints: &str, args: &[&str]) -> Run {
    let out = lockctl(endpoints, args)
        .output()
        .await
        .expect("run lockctl");
    Run {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

impl Run {
    fn json(&self) -> serde_json::Value {
        assert_eq!(
            self.stdout.trim().lines().count(),
            1,
            "one JSON line expected: {:?}",
            self.stdout
        );
        serde_json::from_str(self.stdout.trim())
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {:?}", self.stdout))
    }

    fn ok(&self) -> &Self {
        assert_eq!(self.code, Some(0), "stderr: {}", self.stderr);
        self
    }

    /// A failure with `code` and exactly one stderr line naming every string in `names`.
    fn fails(&self, code: i32, names: &[&str]) {
        assert_eq!(
            self.code,
            Some(code),
            "stdout: {} stderr: {}",
            self.stdout,
            self.stderr
        );
        let lines: Vec<&str> = self.stderr.lines().collect();
        assert_eq!(
            lines.len(),
            1,
            "one stderr line expected: {:?}",
            self.stderr
        );
        assert!(lines[0].starts_with("lockctl: "), "{}", lines[0]);
        for n in names {
            assert!(lines[0].contains(n), "{n:?} missing from {:?}", lines[0]);
        }
    }
}

/// Waits for a file written by a held command (`pid token` or `resource token`).
async fn read_when_written(path: &Path) -> String {
    let deadline = Instant::now() + PROMPTLY;
    loop {
        if let Ok(s) = std::fs::read_to_string(path)
            && s.ends_with('\n')
        {
            return s.trim().to_owned();
        }
        assert!(
            Instant::now() < deadline,
            "{} not written within {PROMPTLY:?}",
            path.display()
        );
        sleep(Duration::from_millis(50)).await;
    }
}

fn temp_file(dir: &tempfile::TempDir, name: &str) -> PathBuf {
    dir.path().join(name)
}
