//! The Rust client (`lockd-client`) and `lockctl` against real three-node
//! clusters.
//!
//! Needs the `lockd` and `lockctl` binaries next to this test executable:
//! `cargo build -p lockd-server -p lockctl && cargo test -p lockd-tests --test client`.
//!
//! The tests measure lease timing on the monotonic clock with ttls of two seconds, so they run one
//! at a time (see [`serial`]): two of them at once on two cores could starve a renewal task long
//! enough to turn a timing check into a scheduling check.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockd_client::{AcquireOptions, Client, Error, LossReason, RequestId};
use lockd_tests::cluster::Cluster;
use lockd_tests::process::bin_path;
use nix::sys::signal::{Signal, kill};
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

/// Test 1. Goal: a guard keeps its lease across more than three ttls by renewing on its own.
/// Method: lock with a 2 s ttl, idle 3.5 ttls, then check the guard is not lost, it renewed, the
/// cluster still shows its token, and another client is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guard_keeps_its_lease_across_three_ttls() {
    let _serial = serial().await;
    let cluster = Cluster::start_default().await.unwrap();
    let a = client(&cluster);
    let guard = a
        .lock("keep/1", AcquireOptions::default().ttl(TTL))
        .await
        .unwrap();
    assert_eq!(guard.resource(), "keep/1");
    assert_eq!(guard.ttl(), TTL);
    let lost = guard.lost();

    sleep(TTL * 3 + TTL / 2).await;

    assert!(!lost.is_lost(), "lost: {:?}", lost.reason());
    // Due every ttl/3 (minus jitter): about ten in 3.5 ttls; six leaves room for a slow machine.
    assert!(guard.renewals() >= 6, "only {} renewals", guard.renewals());
    let d = describe(&a, "keep/1").await;
    assert!(d.held);
    assert_eq!(d.fencing_token, guard.fencing_token().0);
    let b = client(&cluster);
    let err = b
        .acquire("keep/1", AcquireOptions::default().ttl(TTL))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Held { .. }), "{err:?}");

    assert!(guard.release().await.unwrap());
    assert_eq!(lost.reason(), Some(LossReason::Released));
    assert!(!describe(&a, "keep/1").await.held);
}

/// Test 2 (guard). Goal: when a holder's renewals stall, its lost signal fires before the lease can
/// be granted to anyone else; the next holder gets a larger token; the old holder, its network
/// back, does not continue. Method: the holder talks through freezable forwarders; freeze them,
/// record when the signal fires, poll Acquire from a second client until granted, and compare
/// the signal's instant with the send time of the granting Acquire on the same monotonic clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_holder_is_told_before_the_lease_can_move() {
    let _serial = serial().await;
    let cluster = Cluster::start_default().await.unwrap();
    let (stalls, stalled_endpoints) = stalls(&cluster).await;
    let a = Client::new(stalled_endpoints).unwrap();
    let guard = a
        .lock("stall/1", AcquireOptions::default().ttl(TTL))
        .await
        .unwrap();
    let token_a = guard.fencing_token();
    let lost = guard.lost();
    let fired_at: Arc<Mutex<Option<Instant>>> = Arc::default();
    {
        let lost = lost.clone();
        let fired_at = fired_at.clone();
        tokio::spawn(async move {
            lost.fired().await;
            *fired_at.lock().unwrap() = Some(Instant::now());
        });
    }
    // Let at least one renewal happen through the forwarders first.
    eventually("a first renewal", PROMPTLY, || async {
        guard.renewals() >= 1
    })
    .await;

    // Phase 1: stall A, then poll from B until the lease is free.
    for s in &stalls {
        s.freeze(true);
    }
    let frozen_at = Instant::now();
    let b = client(&cluster);
    let lease_b = loop {
        match b
            .acquire(
                "stall/1",
                AcquireOptions::default().ttl(Duration::from_secs(10)),
            )
            .await
        {
            Ok(lease) => break lease,
            Err(Error::Held { .. }) => {
                assert!(frozen_at.elapsed() < PROMPTLY, "lease never became free");
                sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("B acquire: {e}"),
        }
    };
    let fired = fired_at
        .lock()
        .unwrap()
        .expect("A's lost signal had not fired when B was granted the lease");
    assert!(
        fired < lease_b.sent_at,
        "A's signal fired {:?} after B's granting Acquire was sent",
        fired - lease_b.sent_at
    );
    assert!(
        fired - frozen_at <= TTL,
        "signal took {:?} after the stall",
        fired - frozen_at
    );
    assert!(
        matches!(lost.reason(), Some(LossReason::DeadlinePassed { .. })),
        "{:?}",
        lost.reason()
    );
    assert!(
        lease_b.fencing_token > token_a,
        "{:?} !> {:?}",
        lease_b.fencing_token,
        token_a
    );

    // Phase 2: A's network comes back; A stays lost and never renews or re-acquires.
    let renewals_at_loss = guard.renewals();
    for s in &stalls {
        s.freeze(false);
    }
    sleep(TTL).await;
    assert!(guard.is_lost());
    assert_eq!(guard.renewals(), renewals_at_loss, "a lost guard renewed");
    let err = a
        .renew("stall/1", guard.lease_id(), None)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NotFound { .. }), "{err:?}");
    let d = describe(&b, "stall/1").await;
    assert!(d.held);
    assert_eq!(d.fencing_token, lease_b.fencing_token.0);
    // Releasing the old lease does not touch B's.
    assert!(!guard.release().await.unwrap());
    assert_eq!(
        describe(&b, "stall/1").await.fencing_token,
        lease_b.fencing_token.0
    );
    assert!(b.release("stall/1", &lease_b.lease_id).await.unwrap());
}

/// Test 2 (lockctl). Goal: a `lockctl hold` paused past its ttl (SIGSTOP) loses the lease to B, and
/// once resumed stops its command instead of continuing as holder. Method: SIGSTOP lockctl, let B
/// acquire with waiting, SIGCONT, expect exit code 10, the command gone, B still the holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_lockctl_hold_does_not_continue_after_resume() {
    let _serial = serial().await;
    let cluster = Cluster::start_default().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = temp_file(&dir, "held");
    let script = format!(
        "echo \"$$ $LOCKD_FENCING_TOKEN\" > {0}.tmp && mv {0}.tmp {0}; exec sleep 600",
        out.display()
    );
    let mut holder = lockctl(
        &cluster.endpoints(),
        &["hold", "pause/1", "--ttl", "2s", "--", "sh", "-c", &script],
    )
    .spawn()
    .unwrap();
    let written = read_when_written(&out).await;
    let (pid, token_a) = written.split_once(' ').unwrap();
    let (pid, token_a): (i32, u64) = (pid.parse().unwrap(), token_a.parse().unwrap());
    let b = client(&cluster);
    assert_eq!(describe(&b, "pause/1").await.fencing_token, token_a);

    let lockctl_pid = Pid::from_raw(holder.id().unwrap() as i32);
    kill(lockctl_pid, Signal::SIGSTOP).unwrap();
    let lease_b = b
        .acquire(
            "pause/1",
            AcquireOptions::default()
                .ttl(Duration::from_secs(10))
                .wait(Duration::from_secs(10)),
        )
        .await;
    kill(lockctl_pid, Signal::SIGCONT).unwrap();
    let lease_b = lease_b.unwrap();
    assert!(lease_b.fencing_token.0 > token_a);

    let status = tokio::time::timeout(PROMPTLY, holder.wait())
        .await
        .expect("lockctl hold kept running after resume")
        .unwrap();
    let mut stderr = String::new();
    holder
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .await
        .unwrap();
    assert_eq!(status.code(), Some(10), "stderr: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr:?}");
    assert!(
        stderr.contains("lost") && stderr.contains("pause/1"),
        "{stderr}"
    );
    assert!(
        !process_exists(pid),
        "command {pid} still running after lease loss"
    );
    let d = describe(&b, "pause/1").await;
    assert_eq!(
        d.fencing_token, lease_b.fencing_token.0,
        "the resumed holder disturbed B"
    );
}

/// Test 3a. Goal: `lockctl hold` gives COMMAND its resource and token, keeps the lease while it
/// runs (longer than the ttl), releases when it exits and exits with its status. Method: a shell
/// that writes its environment, sleeps past the ttl and exits 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hold_passes_the_token_and_exits_with_the_command_status() {
    let _serial = serial().await;
    let cluster = Cluster::start_default().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = temp_file(&dir, "env");
    let script = format!(
        "echo \"$LOCKD_RESOURCE $LOCKD_FENCING_TOKEN\" > {0}.tmp && mv {0}.tmp {0}; sleep 3; exit 3",
        out.display()
    );
    let holder = lockctl(
        &cluster.endpoints(),
        &[
            "--json", "hold", "hold/1", "--ttl", "2s", "--", "sh", "-c", &script,
        ],
    )
    .spawn()
    .unwrap();
    let written = read_when_written(&out).await;
    let c = client(&cluster);
    let d = describe(&c, "hold/1").await;
    assert!(d.held);
    assert_eq!(written, format!("hold/1 {}", d.fencing_token));

    let output = tokio::time::timeout(PROMPTLY, holder.wait_with_output())
        .await
        .expect("lockctl hold did not exit")
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(3), "stderr: {stderr}");
    let run = Run {
        code: Some(3),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: stderr.into_owned(),
    };
    let v = run.json();
    assert_eq!(v["exit_code"], 3);
    assert_eq!(v["fencing_token"], d.fencing_token);
    assert_eq!(v["lease_lost"], false);
    assert_eq!(v["released"], true);
    assert!(
        !describe(&c, "hold/1").await.held,
        "not released after COMMAND exited"
    );
}

/// Test 3b. Goal: `lockctl hold` kills COMMAND when the lease is lost, escalating to SIGKILL when
/// COMMAND ignores SIGTERM. Method: lockctl talks through freezable forwarders; COMMAND ignores
/// SIGTERM; freeze and expect exit code 10 within ttl + margin + slack, COMMAND gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hold_kills_the_command_when_the_lease_is_lost() {
    let _serial = serial().await;
    let cluster = Cluster::start_default().await.unwrap();
    let (stalls, stalled) = stalls(&cluster).await;
    let dir = tempfile::tempdir().unwrap();
    let out = temp_file(&dir, "pid");
    let script = format!(
        "trap '' TERM; echo $$ > {0}.tmp && mv {0}.tmp {0}; while :; do sleep 0.1; done",
        out.display()
    );
    let mut holder = lockctl(
        &stalled.join(","),
        &["hold", "kill/1", "--ttl", "2s", "--", "sh", "-c", &script],
    )
    .spawn()
    .unwrap();
    let pid: i32 = read_when_written(&out).await.parse().unwrap();
    assert!(process_exists(pid));

    for s in &stalls {
        s.freeze(true);
    }
    let frozen_at = Instant::now();
    let status = tokio::time::timeout(PROMPTLY, holder.wait())
        .await
        .expect("lockctl hold did not stop after its lease was lost")
        .unwrap();
    let stopped_after = frozen_at.elapsed();
    let mut stderr = String::new();
    holder
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .await
        .unwrap();
    assert_eq!(status.code(), Some(10), "stderr: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr:?}");
    assert!(
        stderr.contains("SIGKILL") && stderr.contains("kill/1"),
        "{stderr}"
    );
    assert!(!process_exists(pid), "command {pid} survived");
    // Loss at most one ttl after the stall, plus the margin as SIGTERM grace, plus slack.
    assert!(
        stopped_after < TTL + Duration::from_secs(2),
        "{stopped_after:?}"
    );
}

/// Test 4. Goal: an Acquire in flight when the leader is killed is retried with the same request
/// id and returns one lease, the same one a later retry of that id returns. Method: A holds the
/// resource; B waits for it through the leader; kill -9 the leader; A releases through the
/// survivors; B's call returns; repeat B's request id; Describe shows that single lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_retried_after_leader_kill_returns_the_same_lease() {
    let _serial = serial().await;
    let mut cluster = Cluster::start_default().await.unwrap();
    let leader = cluster.leader().await.unwrap();
    let others: Vec<u64> = (1..=3).filter(|i| *i != leader).collect();
    let a = client(&cluster);
    let guard_a = a
        .lock(
            "failover/1",
            AcquireOptions::default().ttl(Duration::from_secs(8)),
        )
        .await
        .unwrap();

    // B talks to the leader first, so its waiting call sits on the node about to die.
    let b_endpoints = std::iter::once(leader)
        .chain(others.iter().copied())
        .map(|i| cluster.addr(i));
    let b = Client::new(b_endpoints).unwrap();
    let id = RequestId::random();
    let opts = AcquireOptions::default()
        .ttl(Duration::from_secs(10))
        .wait(Duration::from_secs(30))
        .request_id(id.clone());
    let waiting = {
        let b = b.clone();
        let opts = opts.clone();
        tokio::spawn(async move { b.acquire("failover/1", opts).await })
    };
    let follower = Client::new([cluster.addr(others[0])]).unwrap();
    eventually("B queued", PROMPTLY, || async {
        follower
            .describe("failover/1")
            .await
            .is_ok_and(|d| d.waiters == 1)
    })
    .await;

    cluster.kill(leader);
    let new_leader = cluster
        .wait_for_leader(Duration::from_secs(20))
        .await
        .unwrap();
    assert_ne!(new_leader, leader);
    eventually("B queued again at the new leader", PROMPTLY, || async {
        follower
            .describe("failover/1")
            .await
            .is_ok_and(|d| d.waiters == 1)
    })
    .await;
    assert!(!waiting.is_finished(), "B returned before A released");
    assert!(
        guard_a.release().await.unwrap(),
        "A's release failed after failover"
    );

    let lease_b = tokio::time::timeout(PROMPTLY, waiting)
        .await
        .expect("B's acquire did not return after A released")
        .unwrap()
        .unwrap();
    assert_eq!(lease_b.request_id, id);
    let again = b.acquire("failover/1", opts).await.unwrap();
    assert_eq!(
        again.lease_id, lease_b.lease_id,
        "a retry of the same id got another lease"
    );
    assert_eq!(again.fencing_token, lease_b.fencing_token);
    let d = describe(&follower, "failover/1").await;
    assert!(d.held);
    assert_eq!(d.fencing_token, lease_b.fencing_token.0);
    assert_eq!(d.waiters, 0, "B is queued twice");
    assert!(b.release("failover/1", &lease_b.lease_id).await.unwrap());
}

/// Test 4b. Goal: a client whose first endpoint is a dead leader still acquires, and the retried
/// request id maps to one lease. Method: kill -9 the leader, acquire at once through a list that
/// starts with it (transport errors, then UNAVAILABLE during the election), repeat the id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_rides_out_an_election_through_a_dead_endpoint() {
    let _serial = serial().await;
    let mut cluster = Cluster::start_default().await.unwrap();
    let leader = cluster.leader().await.unwrap();
    let list: Vec<String> = std::iter::once(leader)
        .chain((1..=3).filter(|i| *i != leader))
        .map(|i| cluster.addr(i))
        .collect();
    let c = Client::new(list).unwrap();
    cluster.kill(leader);
    let id = RequestId::random();
    let opts = AcquireOptions::default()
        .ttl(Duration::from_secs(10))
        .request_id(id);
    let lease = c.acquire("election/1", opts.clone()).await.unwrap();
    let again = c.acquire("election/1", opts).await.unwrap();
    assert_eq!(again.lease_id, lease.lease_id);
    assert_eq!(again.fencing_token, lease.fencing_token);
    let d = describe(&c, "election/1").await;
    assert_eq!(d.fencing_token, lease.fencing_token.0);
}

/// Test 5. Goal: lockctl's commands against a live cluster: `--json` output parses, errors are one
/// line with their documented codes (held 3, wait timed out 4, unknown lease 5, unreachable 9,
/// bad endpoint 2), a dead endpoint in the list is skipped. Method: run each case.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockctl_commands_errors_and_json() {
    let _serial = serial().await;
    let cluster = Cluster::start_default().await.unwrap();
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    // A dead first endpoint is skipped.
    let eps = format!("{dead},{}", cluster.endpoints());

    let acquired = run_lockctl(&eps, &["--json", "acquire", "cli/1", "--ttl", "30s"]).await;
    let v = acquired.ok().json();
    let lease_id = v["lease_id"].as_str().unwrap().to_owned();
    let token = v["fencing_token"].as_u64().unwrap();
    assert!(lease_id.len() >= 16, "{v}");
    assert_eq!(v["lease_ttl_ms"], 30_000);
    assert_eq!(v["resource"], "cli/1");

    run_lockctl(&eps, &["acquire", "cli/1"])
        .await
        .fails(3, &["\"cli/1\"", "held"]);
    run_lockctl(&eps, &["acquire", "cli/1", "--wait", "1s"])
        .await
        .fails(4, &["\"cli/1\"", "1s"]);
    let renewed = run_lockctl(&eps, &["--json", "renew", "cli/1", &lease_id]).await;
    assert_eq!(renewed.ok().json()["lease_ttl_ms"], 30_000);
    // Well-formed (32 hex digits, as lockd issues them) but not the current lease.
    let unknown = "0123456789abcdef0123456789abcdef";
    run_lockctl(&eps, &["renew", "cli/1", unknown])
        .await
        .fails(5, &["\"cli/1\"", "not current"]);
    run_lockctl(&eps, &["release", "cli/1", unknown])
        .await
        .fails(5, &["\"cli/1\"", "not current"]);
    run_lockctl(&eps, &["renew", "cli/1", "no-such-lease"])
        .await
        .fails(7, &["no-such-lease"]);

    let d = run_lockctl(&eps, &["--json", "describe", "cli/1"]).await;
    let dv = d.ok().json();
    assert_eq!(dv["held"], true);
    assert_eq!(dv["fencing_token"], token);
    assert!(
        !d.stdout.contains(&lease_id),
        "describe leaked the lease id"
    );
    let text = run_lockctl(&eps, &["describe", "cli/1"]).await;
    assert!(
        text.ok()
            .stdout
            .contains(&format!("fencing_token  {token}")),
        "{}",
        text.stdout
    );

    let s = run_lockctl(&cluster.endpoints(), &["--json", "status"]).await;
    let sv = s.ok().json();
    assert!(sv["leader_id"].as_u64().unwrap() > 0, "{sv}");
    assert_eq!(sv["members"].as_array().unwrap().len(), 3, "{sv}");
    assert!(sv["active_locks"].as_u64().unwrap() >= 1, "{sv}");
    let st = run_lockctl(&cluster.endpoints(), &["status"]).await;
    for key in [
        "node",
        "role",
        "leader",
        "term",
        "commit_index",
        "applied_index",
        "members",
        "active_locks",
        "waiters",
    ] {
        assert!(
            st.ok().stdout.lines().any(|l| l.starts_with(key)),
            "{key} missing: {}",
            st.stdout
        );
    }

    let released = run_lockctl(&eps, &["--json", "release", "cli/1", &lease_id]).await;
    assert_eq!(released.ok().json()["released"], true);

    // The same --request-id twice is one lease.
    let first = run_lockctl(
        &eps,
        &["--json", "acquire", "cli/2", "--request-id", "cli-2-once"],
    )
    .await;
    let second = run_lockctl(
        &eps,
        &["--json", "acquire", "cli/2", "--request-id", "cli-2-once"],
    )
    .await;
    assert_eq!(
        first.ok().json()["lease_id"],
        second.ok().json()["lease_id"]
    );

    run_lockctl("nonsense", &["describe", "cli/1"])
        .await
        .fails(2, &["\"nonsense\""]);
    run_lockctl(&dead, &["--timeout", "1s", "describe", "cli/1"])
        .await
        .fails(9, &[&dead]);
    let json_err = run_lockctl(&eps, &["--json", "acquire", "cli/2"]).await;
    json_err.fails(3, &["\"cli/2\""]);
    assert_eq!(json_err.json()["error"]["kind"], "held");
}

/// Goal: a `lock()` that waited most of a ttl in the queue does not hand out a guard whose
/// deadline (counted from the Acquire's send time) is about to pass: it renews first, and the guard
/// then keeps the lease. Method: A holds with a 2 s ttl and releases after 1.6 s; B locks with a
/// 2 s ttl while waiting; B's guard must be valid for at least half a ttl and survive two ttls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_after_a_long_wait_renews_before_handing_out() {
    let _serial = serial().await;
    let cluster = Cluster::start_default().await.unwrap();
    let a = client(&cluster);
    let guard_a = a
        .lock("wait/1", AcquireOptions::default().ttl(TTL))
        .await
        .unwrap();
    let b = client(&cluster);
    let waiting = {
        let b = b.clone();
        tokio::spawn(async move {
            let sent = Instant::now();
            let guard = b
                .lock(
                    "wait/1",
                    AcquireOptions::default()
                        .ttl(TTL)
                        .wait(Duration::from_secs(10)),
                )
                .await;
            (sent, guard)
        })
    };
    sleep(Duration::from_millis(1600)).await;
    assert!(guard_a.release().await.unwrap());
    let (sent, guard_b) = waiting.await.unwrap();
    let guard_b = guard_b.unwrap();
    let handed_out = Instant::now();
    assert!(
        handed_out - sent >= Duration::from_millis(1500),
        "{:?}",
        handed_out - sent
    );
    // Counted from the Acquire's send time, the deadline would be at most ~0.15 s away now.
    assert!(
        guard_b.deadline() >= handed_out + TTL / 2,
        "guard handed out with only {:?} left",
        guard_b.deadline() - handed_out
    );
    let lost = guard_b.lost();
    sleep(TTL * 2).await;
    assert!(!lost.is_lost(), "{:?}", lost.reason());
    assert_eq!(
        describe(&b, "wait/1").await.fencing_token,
        guard_b.fencing_token().0
    );
    assert!(guard_b.release().await.unwrap());
}

/// Goal: a guard whose lease stops being current (here: released by someone who knew the lease id)
/// learns it from `NOT_FOUND` at its next renewal, fires its lost signal with that reason, and
/// stops renewing. Method: release the guard's lease behind its back and wait one renewal interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guard_reports_not_current_when_its_lease_is_gone() {
    let _serial = serial().await;
    let cluster = Cluster::start_default().await.unwrap();
    let a = client(&cluster);
    let guard = a
        .lock("gone/1", AcquireOptions::default().ttl(TTL))
        .await
        .unwrap();
    let lost = guard.lost();
    assert!(a.release("gone/1", guard.lease_id()).await.unwrap());
    tokio::time::timeout(TTL, lost.fired())
        .await
        .expect("lost signal did not fire within one ttl");
    assert!(
        matches!(lost.reason(), Some(LossReason::NotCurrent { .. })),
        "{:?}",
        lost.reason()
    );
    assert!(guard.check().is_err());
    let renewals = guard.renewals();
    sleep(TTL).await;
    assert_eq!(guard.renewals(), renewals, "a lost guard kept renewing");
    assert!(!describe(&a, "gone/1").await.held, "the guard re-acquired");
}
