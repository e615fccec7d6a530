//! Membership with real processes, members named by DNS names (resolved by a hosts file of the
//! run, see `lockd_tests::fleet`): a dead node replaced by a new one, growing 3 -> 5 -> 3 and
//! leader transfer, all while clients lock; founding only when it is safe (a wiped founder, stale
//! flags, joiners); removals that count only live voters; a joint change left behind completed.
//! A node of another cluster incarnation is refused in `security/replication.rs`.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a failed unwrap is a failed test, with its message"
)]

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use lockd_client::{AcquireOptions, Client, Error};
use lockd_tests::fleet::Fleet;
use lockd_tests::process::command;

/// Quick elections, and snapshots often enough that a joining node catches up by snapshot.
const ARGS: &[&str] = &[
    "--heartbeat",
    "100ms",
    "--election-timeout",
    "600ms",
    "--snapshot-every",
    "300",
    "--logs-kept-after-snapshot",
    "50",
];

/// What the lock load saw.
#[derive(Default)]
struct LoadReport {
    /// Every token granted, with when, per worker in order.
    grants: Vec<Vec<(Instant, u64)>>,
    /// Calls that ended UNAVAILABLE (nothing done, or outcome unknown) after the client's
    /// retries: allowed while nodes die and leadership moves.
    unavailable: usize,
    /// Anything else: a failure.
    errors: Vec<String>,
}

impl LoadReport {
    /// No error beyond UNAVAILABLE, and no token granted twice or out of order.
    fn check(&self) {
        assert!(
            self.errors.is_empty(),
            "errors under load: {:?}",
            self.errors
        );
        let mut all = BTreeSet::new();
        for worker in &self.grants {
            for pair in worker.windows(2) {
                assert!(
                    pair[1].1 > pair[0].1,
                    "token {} after {} from one sequential worker",
                    pair[1].1,
                    pair[0].1
                );
            }
            for (_, t) in worker {
                assert!(all.insert(*t), "token {t} granted twice");
            }
        }
        assert!(all.len() > 20, "the load made only {} grants", all.len());
    }

    fn grants_after(&self, t: Instant) -> usize {
        self.grants
            .iter()
            .flatten()
            .filter(|(at, _)| *at > t)
            .count()
    }
}

/// What one load worker saw: its grants in order, UNAVAILABLE endings, other errors.
type WorkerResult = (Vec<(Instant, u64)>, usize, Vec<String>);

/// Workers that acquire and release fresh resources in a loop through `endpoints`.
struct Load {
    stop: Arc<AtomicBool>,
    workers: Vec<tokio::task::JoinHandle<WorkerResult>>,
}

impl Load {
    fn start(endpoints: Vec<String>, workers: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let workers = (0..workers)
            .map(|w| {
                let (stop, endpoints) = (stop.clone(), endpoints.clone());
                tokio::spawn(async move {
                    let client = Client::new(endpoints).expect("client");
                    let (mut grants, mut unavailable, mut errors) = (Vec::new(), 0, Vec::new());
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        n += 1;
                        let resource = format!("load/{w}/{n}");
                        let opts = AcquireOptions::default().ttl(Duration::from_secs(5));
                        match client.acquire(&resource, opts).await {
                            Ok(lease) => {
                                grants.push((Instant::now(), lease.fencing_token.0));
                                match client.release(&resource, &lease.lease_id).await {
                                    Ok(_) => {}
                                    Err(
                                        Error::Unavailable { .. } | Error::OutcomeUnknown { .. },
                                    ) => unavailable += 1,
                                    Err(e) => errors.push(format!("release {resource}: {e}")),
                                }
                            }
                            Err(Error::Unavailable { .. } | Error::OutcomeUnknown { .. }) => {
                                unavailable += 1
                            }
                            Err(e) => errors.push(format!("acquire {resource}: {e}")),
                        }
                    }
                    (grants, unavailable, errors)
                })
            })
            .collect();
        Load { stop, workers }
    }

    async fn stop(self) -> LoadReport {
        self.stop.store(true, Ordering::Relaxed);
        let mut report = LoadReport::default();
        for w in self.workers {
            let (grants, unavailable, errors) = w.await.expect("load worker");
            report.grants.push(grants);
            report.unavailable += unavailable;
            report.errors.extend(errors);
        }
        report
    }
}

/// The members `lockctl member list` shows: (id, role, address).
fn members(fleet: &Fleet, endpoints: &[u64]) -> Vec<(u64, String, String)> {
    let list = fleet.members(endpoints).expect("member list");
    list["members"]
        .as_array()
        .expect("members")
        .iter()
        .map(|m| {
            (
                m["id"].as_u64().unwrap(),
                m["role"].as_str().unwrap().to_owned(),
                m["address"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn voters(fleet: &Fleet, endpoints: &[u64]) -> Vec<u64> {
    members(fleet, endpoints)
        .into_iter()
        .filter(|(_, role, _)| role == "voter")
        .map(|(id, _, _)| id)
        .collect()
}

/// The cluster incarnation id node `id` reports in its `CurrentVote` answer
/// (`lockd.raft.v1.Raft`, read-only).
async fn incarnation(f: &Fleet, id: u64) -> Option<String> {
    use lockd_server::service::raft::pb::{RaftMessage, raft_client::RaftClient};
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", f.ip_addr(id)))
        .unwrap()
        .connect_lazy();
    let mut req = tonic::Request::new(RaftMessage { data: Vec::new() });
    req.metadata_mut()
        .insert("lockd-cluster-id", "lockd".parse().unwrap());
    RaftClient::new(channel)
        .current_vote(req)
        .await
        .unwrap()
        .into_inner()
        .restore_id
}

/// Every node of `ids` has one and the same cluster incarnation id (joiners take the id of the
/// cluster that adds them).
async fn assert_one_incarnation(f: &Fleet, ids: &[u64]) {
    let mut seen = Vec::new();
    for id in ids {
        seen.push((*id, incarnation(f, *id).await));
    }
    let first = seen[0].1.clone();
    assert!(
        first.as_ref().is_some_and(|x| x.len() == 32) && seen.iter().all(|(_, x)| *x == first),
        "incarnation ids: {seen:?}"
    );
}

/// Goal: a killed node is replaced by a new one with an empty data dir and another address
/// (issue test 1), the cluster grows from three voters to five and shrinks back to three,
/// removing the leader on the way, and `leader transfer` moves leadership in under 2 s (issue
/// test 2), all while clients lock: no error but UNAVAILABLE, no token twice. One cluster for
/// all: each step starts from the membership the previous one left, as an operator's would.
/// (A member's address change under its name is `failover/names.rs`.)
/// Method: load through the members; kill node 3; node 4 joins (`--join`), `member add` waits
/// for its snapshot catch-up, `member promote 4`, `member remove 3` (twice: the retry of a lost
/// reply succeeds). Nodes 5 and 6 join and are promoted (five voters); leadership moves to 6;
/// 6 (the leader: it hands over first) and 5 are removed. Leadership then moves between the
/// three voters twice, each under 2 s. Last, node 1 is killed: nodes 2 and 4 are the quorum.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_is_replaced_the_cluster_grows_and_shrinks_and_leadership_moves_under_load() {
    let mut f = Fleet::start(3, ARGS).await.unwrap();
    let load = Load::start(f.endpoints(&[1, 2]), 2);
    tokio::time::sleep(Duration::from_secs(1)).await;

    // Phase 1: node 3 dies; its replacement joins as a learner, catches up, is promoted.
    f.kill(3);
    f.start_joining(4, &[1, 2]).unwrap();
    let add = format!("4={}", f.member_addr(4));
    let out = f
        .lockctl(
            &[1, 2],
            &["member", "add", &add, "--catch-up-timeout", "60s"],
        )
        .unwrap();
    eprintln!("{out}");
    let listed = members(&f, &[1, 2]);
    assert!(
        listed
            .iter()
            .any(|(id, role, _)| *id == 4 && role == "learner"),
        "added as learner, not promoted: {listed:?}"
    );
    f.lockctl(&[1, 2], &["member", "promote", "4"]).unwrap();
    f.lockctl(&[1, 2], &["member", "remove", "3"]).unwrap();
    // The retry of a call whose reply was lost.
    f.lockctl(&[1, 2, 4], &["member", "remove", "3"]).unwrap();
    let listed = members(&f, &[1, 2, 4]);
    let ids: Vec<u64> = listed.iter().map(|(id, _, _)| *id).collect();
    assert_eq!(ids, [1, 2, 4], "{listed:?}");
    assert_eq!(voters(&f, &[1, 2, 4]), [1, 2, 4]);

    // Phase 2: grow to five.
    for id in [5, 6] {
        f.start_joining(id, &[1, 2, 4]).unwrap();
        let add = format!("{id}={}", f.member_addr(id));
        f.lockctl(
            &[1, 2, 4],
            &["member", "add", &add, "--catch-up-timeout", "60s"],
        )
        .unwrap();
        f.lockctl(&[1, 2, 4], &["member", "promote", &id.to_string()])
            .unwrap();
    }
    assert_eq!(voters(&f, &[1, 2, 4]), [1, 2, 4, 5, 6]);
    assert_one_incarnation(&f, &[1, 2, 4, 5, 6]).await;

    // Phase 3: leadership to node 6 (five voters: the followers' leases add to the time).
    let started = Instant::now();
    let out = f
        .lockctl(&[1, 2, 4], &["--json", "leader", "transfer", "6"])
        .unwrap();
    let moved: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(moved["leader_id"], 6, "{out}");
    eprintln!(
        "transfer to node 6 among five voters: {:?} ({out})",
        started.elapsed()
    );
    assert_eq!(f.wait_for_leader(Duration::from_secs(10)).await.unwrap(), 6);

    // Phase 4: shrink to three, the leader first.
    f.lockctl(&[1, 2, 4], &["member", "remove", "6"]).unwrap();
    f.kill(6);
    f.lockctl(&[1, 2, 4], &["member", "remove", "5"]).unwrap();
    f.kill(5);
    assert_eq!(voters(&f, &[1, 2, 4]), [1, 2, 4]);
    let ids: Vec<u64> = members(&f, &[1, 2, 4]).iter().map(|m| m.0).collect();
    assert_eq!(ids, [1, 2, 4]);

    // Phase 5: leadership moves between the three voters, each time in under 2 s (lockctl
    // started to lockctl done, process start included). A leader grants no vote before its
    // lease (election_timeout_max) has run since its election: let it run first, so the
    // measurement is the transfer itself.
    let mut times = Vec::new();
    for round in 0..2 {
        tokio::time::sleep(Duration::from_millis(1_300)).await;
        let leader = f.wait_for_leader(Duration::from_secs(10)).await.unwrap();
        let target = [1u64, 2, 4]
            .into_iter()
            .filter(|i| *i != leader)
            .nth(round % 2)
            .unwrap();
        let started = Instant::now();
        let out = f
            .lockctl(
                &[1, 2, 4],
                &["--json", "leader", "transfer", &target.to_string()],
            )
            .unwrap();
        let took = started.elapsed();
        let moved: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(moved["leader_id"], target, "{out}");
        assert_eq!(f.status(target).await.unwrap().role, "leader");
        eprintln!("transfer {leader} -> {target}: {took:?} ({out})");
        assert!(
            took < Duration::from_secs(2),
            "transfer took {took:?}; what the nodes said about it:\n{}",
            transfer_lines(&f, &[1, 2, 4])
        );
        times.push(took);
    }
    eprintln!("leader transfer times among three voters: {times:?}");

    // Phase 6: node 4 is a voter that counts: without node 1, nodes 2 and 4 are the quorum.
    f.kill(1);
    let killed_1 = Instant::now();
    f.wait_for_leader(Duration::from_secs(20)).await.unwrap();
    f.acquire_fresh(&[2, 4], "probe", Duration::from_secs(20))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;

    let report = load.stop().await;
    eprintln!(
        "grants {}, unavailable {}",
        report.grants.iter().map(Vec::len).sum::<usize>(),
        report.unavailable
    );
    report.check();
    assert!(
        report.grants_after(killed_1) > 0,
        "the load made no grant with nodes 2 and 4 alone"
    );
}

/// Goal: a malformed `--peer` is refused naming the value; a name that does not resolve yet is a
/// warning, not a crash; a `--join` node never forms a cluster of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_names_are_checked_and_a_joining_node_waits() {
    let dir = tempfile::tempdir().unwrap();
    let out = command("lockd")
        .args(["--id", "1", "--listen", "127.0.0.1:1", "--data-dir"])
        .arg(dir.path().join("x"))
        .args(["--peer", "1=node_1.example:7001"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("\"node_1.example:7001\""), "{err}");

    let out = command("lockd")
        .args([
            "--id",
            "1",
            "--listen",
            "127.0.0.1:1",
            "--join",
            "--data-dir",
        ])
        .arg(dir.path().join("y"))
        .args(["--peer", "1=127.0.0.1:1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--join"), "{err}");

    // A joining node whose only other peer is a name that does not resolve: it runs and warns.
    let ip = lockd_tests::process::random_loopback_ip();
    let listen = format!("{ip}:7009");
    let mut cmd = command("lockd");
    cmd.args(["--id", "9", "--listen", &listen, "--join", "--data-dir"])
        .arg(dir.path().join("z"))
        .args([
            "--peer",
            &format!("9={listen}"),
            "--peer",
            "1=lockd-1.does-not-exist.invalid:7001",
        ])
        .args(ARGS)
        .stderr(std::process::Stdio::piped());
    let mut node = lockd_tests::process::ChildGuard::spawn("lockd-9", cmd).unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        node.is_running(),
        "lockd exited on an unresolvable peer name"
    );
    node.kill();

    // A joining node and a new node started with the same --peer list of the two: without
    // --join they would found a cluster once both are quiet for 4 election timeouts (2.4 s with
    // ARGS); with it neither ever leads. Watched for three times that long, then the control:
    // the joiner restarted empty without --join, the two found a cluster.
    let (ip8, ip9) = (
        lockd_tests::process::random_loopback_ip(),
        lockd_tests::process::random_loopback_ip(),
    );
    let (listen8, listen9) = (format!("{ip8}:7008"), format!("{ip9}:7009"));
    let peers = [
        "--peer".to_owned(),
        format!("8={listen8}"),
        "--peer".to_owned(),
        format!("9={listen9}"),
    ];
    let spawn = |id: u64, listen: &str, join: bool| {
        let mut cmd = command("lockd");
        cmd.args(["--id", &id.to_string(), "--listen", listen, "--data-dir"])
            .arg(dir.path().join(format!("pair{id}")))
            .args(&peers)
            .args(ARGS)
            .stderr(std::process::Stdio::null());
        if join {
            cmd.arg("--join");
        }
        lockd_tests::process::ChildGuard::spawn(format!("lockd-{id}"), cmd).unwrap()
    };
    let status = |listen: &str| {
        let channel = tonic::transport::Channel::from_shared(format!("http://{listen}"))
            .unwrap()
            .connect_lazy();
        async move {
            lockd_api::v1::cluster_client::ClusterClient::new(channel)
                .status(lockd_api::v1::StatusRequest {})
                .await
                .map(|s| s.into_inner())
        }
    };
    let mut n8 = spawn(8, &listen8, false);
    let mut n9 = spawn(9, &listen9, true);
    let deadline = Instant::now() + Duration::from_millis(3 * 2_400);
    while Instant::now() < deadline {
        for l in [&listen8, &listen9] {
            if let Ok(s) = status(l).await {
                assert_eq!(
                    s.leader_id, 0,
                    "a --join node helped found a cluster: {s:?}"
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(n8.is_running() && n9.is_running());
    n9.kill();
    std::fs::remove_dir_all(dir.path().join("pair9")).unwrap();
    let mut n9 = spawn(9, &listen9, false);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(s) = status(&listen8).await
            && s.leader_id != 0
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "control: two new nodes without --join did not found a cluster"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    n8.kill();
    n9.kill();
}

/// Watches for `watch` that none of `suspects` leads a cluster and that no grant through them
/// carries a token at or below `floor` (the highest token the real cluster issued): a second
/// cluster would start its tokens again from 1.
async fn assert_no_second_cluster(f: &mut Fleet, suspects: &[u64], floor: u64, watch: Duration) {
    let client = Client::new(f.endpoints(suspects)).unwrap();
    let deadline = Instant::now() + watch;
    let mut n = 0;
    while Instant::now() < deadline {
        for id in suspects {
            if let Ok(s) = f.status(*id).await {
                assert_ne!(
                    s.role, "leader",
                    "node {id} leads a cluster of its own (a second cluster): {s:?}"
                );
            }
        }
        n += 1;
        let opts = AcquireOptions::default().ttl(Duration::from_secs(5));
        let resource = format!("second-cluster-probe/{n}");
        let acquire = client.acquire(&resource, opts);
        if let Ok(Ok(lease)) = tokio::time::timeout(Duration::from_secs(2), acquire).await {
            assert!(
                lease.fencing_token.0 > floor,
                "a grant through nodes {suspects:?} carries token {}, not above {floor} which \
                 the cluster had issued: a second cluster hands out tokens again",
                lease.fencing_token.0
            );
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// The lines of the nodes' logs about leader transfers and elections, to tell where a slow
/// transfer spent its time.
fn transfer_lines(f: &Fleet, ids: &[u64]) -> String {
    ids.iter()
        .flat_map(|id| {
            f.log(*id)
                .lines()
                .filter(|l| {
                    l.contains("stepped down") || l.contains("transferred") || l.contains("elect")
                })
                .map(|l| format!("node {id}: {l}"))
                .collect::<Vec<_>>()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Waits up to 10 s for node `id` to exit; its exit status.
async fn wait_exit(f: &mut Fleet, id: u64) -> Option<std::process::ExitStatus> {
    for _ in 0..100 {
        if let Some(status) = f.exited(id) {
            return Some(status);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

/// Goal: the node that founded a cluster alone and grew it never founds a second cluster after
/// losing its disk, when restarted with its first flags (itself alone: the very command line of
/// its first start, review H1); `lockd init` is refused on a data dir that holds state (review
/// of the membership patch, HIGH).
/// Method: node 1 founds alone (`lockd init`), nodes 2 and 3 join and are promoted; grants
/// are made. Node 1 is wiped and restarted with `--peer` naming itself alone: it must not lead,
/// and nothing granted through it may carry a token at or below the cluster's. Then the
/// runbook: restarted with the current members in `--peer` it rejoins and counts for the
/// quorum (node 2 is killed, grants go on through nodes 1 and 3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_membership_a_wiped_lone_first_voter_never_founds_a_second_cluster() {
    let mut f = Fleet::start(1, ARGS).await.unwrap();
    for id in [2, 3] {
        f.start_joining(id, &[1]).unwrap();
        let add = format!("{id}={}", f.member_addr(id));
        f.lockctl(&[1], &["member", "add", &add, "--catch-up-timeout", "60s"])
            .unwrap();
        f.lockctl(&[1], &["member", "promote", &id.to_string()])
            .unwrap();
    }
    assert_eq!(voters(&f, &[1, 2, 3]), [1, 2, 3]);
    // `lockd init` drew the cluster's incarnation id; the joiners took it.
    assert_one_incarnation(&f, &[1, 2, 3]).await;
    let mut before = 0;
    for _ in 0..5 {
        before = f
            .acquire_fresh(&[1, 2, 3], "probe", Duration::from_secs(10))
            .await
            .unwrap();
    }

    // Phase 1: node 1 loses its disk and is restarted with its first flags.
    f.kill(1);
    f.wipe(1).unwrap();
    f.restart(1).unwrap();
    assert_no_second_cluster(&mut f, &[1], before, Duration::from_secs(8)).await;
    let status = wait_exit(&mut f, 1).await;
    assert!(
        status.is_some_and(|s| !s.success()),
        "node 1 still runs: {status:?}"
    );
    let log = f.log(1);
    assert!(
        log.contains("lockd init"),
        "node 1 says why it stops: {log}"
    );
    // The cluster of nodes 2 and 3 goes on.
    let during = f
        .acquire_fresh(&[2, 3], "probe", Duration::from_secs(20))
        .await
        .unwrap();
    assert!(during > before);

    // Phase 2: the runbook: restart it with the current members in --peer.
    f.set_flags(1, &[2, 3], false);
    f.restart(1).unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    f.kill(2);
    let after = f
        .acquire_fresh(&[1, 3], "probe", Duration::from_secs(30))
        .await
        .unwrap();
    assert!(after > during, "token {after} after {during}");
    let s = f.status(1).await.unwrap();
    assert!([1, 3].contains(&s.leader_id), "node 1 rejoined: {s:?}");
    // Wiped, it took the incarnation id again from the members that vouched for it.
    assert_one_incarnation(&f, &[1, 3]).await;

    // Phase 3: `lockd init` on a data dir that holds state is refused.
    f.kill(1);
    let out = f.init(1).unwrap();
    assert!(!out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("already holds"), "{err}");
}

/// Goal: a node that loses its disk and is restarted with `--peer` flags older than the
/// membership never founds a second cluster on the word of joiners (review of the membership
/// patch, HIGH).
/// Method: nodes 1-3 form the cluster; 4 and 5 join and are promoted; 2 and 3 are removed and
/// stopped: the membership is {1, 4, 5}. Then nodes 4 and 5 become unreachable (stopped), node
/// 1 loses its disk, and new machines at nodes 2 and 3 wait to join (`--join`, empty) with the
/// old `--peer` list 1-3; node 1 restarts with that list. For 10 s none of 1-3 may lead and no
/// grant through them may carry a token at or below the cluster's. Node 1 must say why it
/// does not found. Then the runbook: 4 and 5 return, node 1 restarts with the current members
/// in `--peer`, rejoins, and counts for the quorum (node 5 is killed, grants go on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_membership_a_wiped_node_with_stale_flags_never_founds_a_second_cluster() {
    let mut f = Fleet::start(3, ARGS).await.unwrap();
    for id in [4, 5] {
        f.start_joining(id, &[1, 2, 3]).unwrap();
        let add = format!("{id}={}", f.member_addr(id));
        f.lockctl(
            &[1, 2, 3],
            &["member", "add", &add, "--catch-up-timeout", "60s"],
        )
        .unwrap();
        f.lockctl(&[1, 2, 3], &["member", "promote", &id.to_string()])
            .unwrap();
    }
    for id in [2, 3] {
        f.lockctl(&[1, 4, 5], &["member", "remove", &id.to_string()])
            .unwrap();
        f.kill(id);
    }
    assert_eq!(voters(&f, &[1, 4, 5]), [1, 4, 5]);
    let mut before = 0;
    for _ in 0..5 {
        before = f
            .acquire_fresh(&[1, 4, 5], "probe", Duration::from_secs(20))
            .await
            .unwrap();
    }

    // Phase 1: 4 and 5 out of reach, node 1 wiped, joiners at 2 and 3, all with the old list.
    for id in [4, 5, 1] {
        f.kill(id);
    }
    for id in [1, 2, 3] {
        f.wipe(id).unwrap();
    }
    for id in [2, 3] {
        f.set_flags(id, &[1, 2, 3], true);
        f.restart(id).unwrap();
    }
    f.restart(1).unwrap();
    assert_no_second_cluster(&mut f, &[1, 2, 3], before, Duration::from_secs(10)).await;
    let log = f.log(1);
    assert!(
        log.contains("not founding") && log.contains("--join"),
        "node 1 says why it does not found: {log}"
    );

    // Phase 2: the runbook: the members return, node 1 restarts with them in --peer.
    f.restart(4).unwrap();
    f.restart(5).unwrap();
    f.kill(1);
    f.set_flags(1, &[4, 5], false);
    f.restart(1).unwrap();
    let after = f
        .acquire_fresh(&[1, 4, 5], "probe", Duration::from_secs(30))
        .await
        .unwrap();
    assert!(after > before, "token {after} after {before}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    f.kill(5);
    let last = f
        .acquire_fresh(&[1, 4], "probe", Duration::from_secs(30))
        .await
        .unwrap();
    assert!(last > after, "token {last} after {after}");
}

/// Goal: a removal counts a voter toward the majority left only if it answered the leader
/// within an election timeout, not because its matched log equals the leader's: on an idle
/// cluster a dead voter's log matches too (review of the membership branch, M2).
/// Method: three nodes, a grant; one follower is killed and the cluster left idle for two
/// maximum election timeouts; removing the other follower must be refused (the voters left
/// would be the leader and the dead node), grants go on, and the voters are unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_m2_a_dead_voter_is_not_counted_up_to_date_by_a_removal() {
    let mut f = Fleet::start(3, ARGS).await.unwrap();
    let leader = f.wait_for_leader(Duration::from_secs(20)).await.unwrap();
    let before = f
        .acquire_fresh(&[1, 2, 3], "probe", Duration::from_secs(10))
        .await
        .unwrap();
    let followers: Vec<u64> = [1, 2, 3].into_iter().filter(|i| *i != leader).collect();
    let (dead, other) = (followers[0], followers[1]);
    f.kill(dead);
    tokio::time::sleep(Duration::from_millis(2 * 1_200 + 500)).await;
    let e = f
        .lockctl(&[leader], &["member", "remove", &other.to_string()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("up to date"), "{e}");
    assert_eq!(voters(&f, &[leader, other]), [1, 2, 3]);
    let after = f
        .acquire_fresh(&[leader, other], "probe", Duration::from_secs(10))
        .await
        .unwrap();
    assert!(after > before, "token {after} after {before}");
}

/// Goal: a membership change whose caller gives up between its two steps is still completed,
/// so the cluster does not stay in joint consensus refusing every later change (review of the
/// membership branch, M1).
/// Method: three nodes and learner 4; a follower and node 4 are stopped (SIGSTOP) and node 4 is
/// promoted at once (still caught up: it answered within the election timeout). The joint
/// configuration cannot commit without one of them, so the leader's wait for the change
/// (5 s) runs out. They are resumed: within 10 s the membership must be uniform with voters
/// 1-4, and a later change (removing node 4) must go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_m1_a_change_whose_caller_gave_up_is_completed() {
    use nix::sys::signal::Signal;
    let mut f = Fleet::start(3, ARGS).await.unwrap();
    f.start_joining(4, &[1, 2, 3]).unwrap();
    let add = format!("4={}", f.member_addr(4));
    f.lockctl(
        &[1, 2, 3],
        &["member", "add", &add, "--catch-up-timeout", "60s"],
    )
    .unwrap();
    let leader = f.wait_for_leader(Duration::from_secs(20)).await.unwrap();
    let follower = [1, 2, 3].into_iter().find(|i| *i != leader).unwrap();
    let live: Vec<u64> = [1, 2, 3].into_iter().filter(|i| *i != follower).collect();
    f.signal(follower, Signal::SIGSTOP);
    f.signal(4, Signal::SIGSTOP);
    let endpoints = f.endpoints(&live);
    let promote = std::thread::spawn(move || {
        command("lockctl")
            .arg("--endpoints")
            .arg(endpoints.join(","))
            .args(["member", "promote", "4"])
            .output()
            .unwrap()
    });
    tokio::time::sleep(Duration::from_secs(7)).await;
    f.signal(follower, Signal::SIGCONT);
    f.signal(4, Signal::SIGCONT);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let list = f.members(&live).unwrap();
        if list["joint"] == serde_json::Value::Bool(false) && voters(&f, &live) == [1, 2, 3, 4] {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the membership stays joint or incomplete: {list}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let _ = promote.join();
    f.lockctl(&live, &["member", "remove", "4"]).unwrap();
    assert_eq!(voters(&f, &live), [1, 2, 3]);
}

/// Goal: without `--auth-policy`, a node refuses every caller the calls that change the
/// membership or move leadership, unless it runs with `--allow-membership-without-policy`
/// (review of the membership branch, M-C: repeated `member remove` shrank {1,2,3} to {1}, a
/// `leader transfer` loop kept the cluster leaderless). `member list` still answers.
/// Method: three nodes without the flag; `member remove`, `member promote`, `member add` and
/// `leader transfer` through every node must fail naming the flag, the voters and the leader
/// stay. (Every other test of this file runs with the flag: the control.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_m_c_open_mode_refuses_membership_changes_without_the_flag() {
    let mut f = Fleet::start_with(3, ARGS, false).await.unwrap();
    let leader = f.wait_for_leader(Duration::from_secs(20)).await.unwrap();
    let other = [1u64, 2, 3].into_iter().find(|i| *i != leader).unwrap();
    let add = format!("4={}", f.member_addr(3).replace(":7003", ":7004"));
    for node in [1, 2, 3] {
        for args in [
            vec!["member", "remove", "3"],
            vec!["member", "remove", &leader.to_string()],
            vec!["member", "promote", "3"],
            vec!["member", "add", &add],
            vec!["leader", "transfer", &other.to_string()],
            vec!["leader", "transfer"],
        ] {
            let e = f.lockctl(&[node], &args).unwrap_err().to_string();
            assert!(
                e.contains("--allow-membership-without-policy") && e.contains("--auth-policy"),
                "node {node}, {args:?}: {e}"
            );
        }
    }
    assert_eq!(voters(&f, &[1, 2, 3]), [1, 2, 3]);
    let ids: Vec<u64> = members(&f, &[1, 2, 3]).iter().map(|m| m.0).collect();
    assert_eq!(ids, [1, 2, 3]);
    assert_eq!(
        f.wait_for_leader(Duration::from_secs(5)).await.unwrap(),
        leader
    );
}

/// Goal: a leader transfer whose caller gives up after the leader stepped down leaves the old
/// leader's elections on (review of the membership branch, M-B: the hand-over turned them off
/// and back on only if the call completed, so after `lockctl --timeout 1s leader transfer` or a
/// Ctrl-C the old leader never campaigned again until restarted).
/// Method: three nodes, idle; the target is stopped (SIGSTOP: its log still matches the
/// leader's), then `TransferLeader` to it is sent straight to the leader with a 1 s deadline:
/// the leader steps down and waits for the target, which never answers, and the call is dropped.
/// After 1.5 s the third node is stopped too: the old leader must then lead again (it won an
/// election meanwhile) or, alone, campaign, so its term must rise within a few election
/// timeouts. Last, every node is resumed and a leader is elected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_m_b_a_transfer_whose_caller_gave_up_leaves_elections_on() {
    use lockd_api::v1::TransferLeaderRequest;
    use lockd_api::v1::cluster_client::ClusterClient;
    use nix::sys::signal::Signal;
    let mut f = Fleet::start(3, ARGS).await.unwrap();
    let old = f.wait_for_leader(Duration::from_secs(20)).await.unwrap();
    let others: Vec<u64> = [1, 2, 3].into_iter().filter(|i| *i != old).collect();
    let (target, third) = (others[0], others[1]);
    // The leader grants no vote (so does not step down) within its lease since its election.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    f.signal(target, Signal::SIGSTOP);
    let term_before = f.status(old).await.unwrap().term;
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", f.ip_addr(old)))
        .unwrap()
        .connect_lazy();
    let mut req = tonic::Request::new(TransferLeaderRequest { id: target });
    req.set_timeout(Duration::from_secs(1));
    let answer = tokio::time::timeout(
        Duration::from_secs(1),
        ClusterClient::new(channel).transfer_leader(req),
    )
    .await;
    assert!(
        !matches!(answer, Ok(Ok(_))),
        "the transfer to a stopped node succeeded: {answer:?}"
    );
    let s = f.status(old).await.unwrap();
    assert!(
        s.role != "leader" && s.term > term_before,
        "node {old} did not step down for node {target}: {s:?}"
    );
    // The third node or the old leader takes over meanwhile; then the third stops too.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    f.signal(third, Signal::SIGSTOP);
    let alone = f.status(old).await.unwrap().term;
    let deadline = Instant::now() + Duration::from_secs(6);
    loop {
        // Leading again (it won an election since stepping down) or campaigning alone: either
        // way its elections are on.
        let s = f.status(old).await.unwrap();
        if s.role == "leader" || s.term > alone + 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "node {old}, alone, has not campaigned in 6 s (term {} then {}): its elections \
             stayed off after the dropped transfer; its log:\n{}",
            alone,
            s.term,
            f.log(old)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    f.signal(target, Signal::SIGCONT);
    f.signal(third, Signal::SIGCONT);
    f.wait_for_leader(Duration::from_secs(20)).await.unwrap();
    f.acquire_fresh(&[1, 2, 3], "probe", Duration::from_secs(20))
        .await
        .unwrap();
}

/// Goal: two membership calls sent to the leader at the same moment run one after the other,
/// each checked against the membership the other left (review of the membership branch, L-2:
/// check and change ran without a lock, so both could pass checks meant for one, and the second
/// change met the first one's joint configuration).
/// Method: three nodes and a caught-up learner 4; `PromoteMember 4` and `RemoveMember` of a
/// follower go to the leader concurrently. Both must succeed and leave a uniform membership
/// whose voters are the three others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_l_2_concurrent_membership_calls_run_one_after_the_other() {
    use lockd_api::v1::cluster_client::ClusterClient;
    use lockd_api::v1::{PromoteMemberRequest, RemoveMemberRequest};
    let mut f = Fleet::start(3, ARGS).await.unwrap();
    f.start_joining(4, &[1, 2, 3]).unwrap();
    let add = format!("4={}", f.member_addr(4));
    f.lockctl(
        &[1, 2, 3],
        &["member", "add", &add, "--catch-up-timeout", "60s"],
    )
    .unwrap();
    let leader = f.wait_for_leader(Duration::from_secs(20)).await.unwrap();
    let removed = [1, 2, 3].into_iter().find(|i| *i != leader).unwrap();
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", f.ip_addr(leader)))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let (mut a, mut b) = (
        ClusterClient::new(channel.clone()),
        ClusterClient::new(channel),
    );
    let (promoted, removal) = tokio::join!(
        a.promote_member(PromoteMemberRequest { id: 4 }),
        b.remove_member(RemoveMemberRequest { id: removed }),
    );
    promoted.expect("promote 4");
    removal.unwrap_or_else(|e| panic!("remove {removed}: {e:?}"));
    let list = f.members(&[leader]).unwrap();
    assert_eq!(list["joint"], serde_json::Value::Bool(false), "{list}");
    let expected: Vec<u64> = [1, 2, 3, 4].into_iter().filter(|i| *i != removed).collect();
    assert_eq!(voters(&f, &[leader]), expected);
}

/// Goal: under mTLS, a node that replays the log from its start accepts a leader that was added
/// at runtime (review of the membership branch, M-A: after the first batch of entries the node
/// took the founding membership {1, 2, 3} as its list of allowed senders and refused leader 4
/// with UNAUTHENTICATED for good).
/// Method: three nodes with TLS (node certificates of one peer CA, no snapshots in the run, so
/// a joiner gets the whole log from index 1); 400 grants put the founding membership 25
/// batches of 16 entries before node 4's addition. Node 4 joins and is promoted, node 3 removed and stopped, leadership
/// moves to node 4. Then node 5 joins: `member add` must see it caught up within 30 s, and it
/// must be promoted and follow leader 4.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_m_a_under_tls_a_joiner_replaying_the_log_accepts_a_leader_added_later() {
    let args = &["--heartbeat", "100ms", "--election-timeout", "600ms"];
    let mut f = Fleet::start_tls(3, args).await.unwrap();
    let leader = f.wait_for_leader(Duration::from_secs(10)).await.unwrap();
    let mut locks = lockd_api::v1::lock_client::LockClient::new(f.channel(leader).unwrap());
    for n in 0..400 {
        locks
            .acquire(lockd_api::v1::AcquireRequest {
                resource: format!("m-a/{n}"),
                request_id: format!("m-a-{n}"),
                lease_ttl_ms: 30_000,
                wait_timeout_ms: 0,
                holder: "m-a".into(),
            })
            .await
            .unwrap();
    }
    f.start_joining(4, &[1, 2, 3]).unwrap();
    let add = format!("4={}", f.member_addr(4));
    f.lockctl(
        &[1, 2, 3],
        &["member", "add", &add, "--catch-up-timeout", "60s"],
    )
    .unwrap();
    f.lockctl(&[1, 2, 3], &["member", "promote", "4"]).unwrap();
    f.lockctl(&[1, 2, 4], &["member", "remove", "3"]).unwrap();
    f.kill(3);
    // A leader grants no vote within its lease since its election.
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    f.lockctl(&[1, 2, 4], &["leader", "transfer", "4"]).unwrap();
    assert_eq!(f.wait_for_leader(Duration::from_secs(10)).await.unwrap(), 4);

    f.start_joining(5, &[1, 2, 4]).unwrap();
    let add = format!("5={}", f.member_addr(5));
    f.lockctl(
        &[1, 2, 4],
        &["member", "add", &add, "--catch-up-timeout", "30s"],
    )
    .unwrap_or_else(|e| panic!("node 5 did not catch up from leader 4: {e}\n{}", f.log(5)));
    f.lockctl(&[1, 2, 4], &["member", "promote", "5"]).unwrap();
    assert_eq!(voters(&f, &[1, 2, 4]), [1, 2, 4, 5]);
    assert_eq!(f.status(5).await.unwrap().leader_id, 4);
}

/// Goal: `member add` refuses an address another member already uses, naming that member
/// (review of the membership branch, LOW: two members at one address).
/// Method: three nodes; adding node 4 at node 2's address must fail naming node 2, and the
/// membership stays 1-3; adding node 4 at its own address then succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_low_member_add_refuses_an_address_in_use() {
    let mut f = Fleet::start(3, ARGS).await.unwrap();
    let taken = format!("4={}", f.member_addr(2));
    let e = f
        .lockctl(&[1, 2, 3], &["member", "add", &taken, "--no-wait"])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("node 2 already uses address") && e.contains(&f.member_addr(2)),
        "{e}"
    );
    let ids: Vec<u64> = members(&f, &[1, 2, 3]).iter().map(|m| m.0).collect();
    assert_eq!(ids, [1, 2, 3]);
    f.start_joining(4, &[1, 2, 3]).unwrap();
    let own = format!("4={}", f.member_addr(4));
    f.lockctl(&[1, 2, 3], &["member", "add", &own, "--no-wait"])
        .unwrap();
    let ids: Vec<u64> = members(&f, &[1, 2, 3]).iter().map(|m| m.0).collect();
    assert_eq!(ids, [1, 2, 3, 4]);
}
