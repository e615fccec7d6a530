//! Backup and restore with real processes: `lockctl snapshot save` under load, every data dir
//! lost, every member restored with `lockd restore` from the same file and floor; the refusals of
//! `lockd restore`; a member of the old cluster and members restored with another floor are
//! refused by the restored members and change nothing there; an empty member catches up.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use lockd_api::v1::{
    AcquireResponse, DescribeRequest, ReleaseRequest, SigningKeysRequest, lock_client::LockClient,
};
use lockd_fence::sequencer::{SequencerError, VerifyKeys, inspect_unverified};
use lockd_tests::cluster::{Cluster, ClusterOptions};
use lockd_tests::process::bin_path;
use tonic::Code;
use tonic::transport::Channel;

use super::{acquire_retrying, req};

/// A finished run of one of the workspace's binaries.
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Run {
    fn ok(&self) -> &Self {
        assert_eq!(
            self.code,
            Some(0),
            "stdout: {}\nstderr: {}",
            self.stdout,
            self.stderr
        );
        self
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_str(self.stdout.trim())
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {:?}", self.stdout))
    }
}

async fn run(bin: &str, args: &[&str]) -> Run {
    let out = tokio::process::Command::new(bin_path(bin))
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .output()
        .await
        .unwrap_or_else(|e| panic!("running {bin}: {e}"));
    Run {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// `lockd restore FILE --data-dir DIR --token-floor FLOOR --json`, which must succeed.
async fn restore(file: &Path, data_dir: &Path, floor: u64) -> serde_json::Value {
    run(
        "lockd",
        &[
            "restore",
            file.to_str().unwrap(),
            "--data-dir",
            data_dir.to_str().unwrap(),
            "--token-floor",
            &floor.to_string(),
            "--json",
        ],
    )
    .await
    .ok()
    .json()
}

/// `lockctl snapshot save FILE` through node `via`, which must succeed; its JSON summary.
async fn save(cluster: &Cluster, via: u64, file: &Path) -> serde_json::Value {
    run(
        "lockctl",
        &[
            "--endpoints",
            &cluster.addr(via),
            "--json",
            "snapshot",
            "save",
            file.to_str().unwrap(),
        ],
    )
    .await
    .ok()
    .json()
}

/// Acquires and releases resources until `stop`, recording every token it was granted.
async fn load(mut c: LockClient<Channel>, stop: Arc<AtomicBool>, node: u64) -> Vec<u64> {
    let mut tokens = Vec::new();
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        i += 1;
        let resource = format!("load/{node}/{}", i % 20);
        match c
            .acquire(req(&resource, &format!("load-{node}-{i}"), 5_000))
            .await
        {
            Ok(r) => {
                let r = r.into_inner();
                tokens.push(r.fencing_token);
                let _ = c
                    .release(ReleaseRequest {
                        resource,
                        lease_id: r.lease_id,
                    })
                    .await;
            }
            Err(s) if matches!(s.code(), Code::Unavailable | Code::Aborted) => {}
            Err(s) => panic!("load acquire: {s:?}"),
        }
    }
    tokens
}

async fn key_ids(cluster: &Cluster, node: u64) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut c = cluster.cluster_client(node).await.unwrap();
        match c.signing_keys(SigningKeysRequest {}).await {
            Ok(r) => return r.into_inner().keys.into_iter().map(|k| k.key_id).collect(),
            Err(s) if s.code() == Code::Unavailable && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(s) => panic!("signing keys: {s:?}"),
        }
    }
}

fn dir_is_empty_or_missing(dir: &Path) -> bool {
    std::fs::read_dir(dir).map_or(true, |mut d| d.next().is_none())
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// The leader that `nodes` agree on (when another running node follows no one, or another
/// restore, `Cluster::leader` would wait for it).
async fn leader_of(cluster: &Cluster, nodes: &[u64]) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut seen = Vec::new();
        for n in nodes {
            if let Ok(s) = cluster.status(*n).await {
                seen.push(s.leader_id);
            }
        }
        if seen.len() == nodes.len() && seen[0] != 0 && seen.iter().all(|l| *l == seen[0]) {
            return seen[0];
        }
        assert!(
            Instant::now() < deadline,
            "nodes {nodes:?} agree on no leader: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn term(cluster: &Cluster, node: u64) -> u64 {
    cluster.status(node).await.unwrap().term
}

/// Waits until `text()` contains every one of `needles`, or panics naming them.
async fn wait_logged(what: &str, text: impl Fn() -> String, needles: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let t = text();
        if needles.iter().all(|n| t.contains(n)) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what} did not log {needles:?} within 20 s; it logged:\n{t}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Goal: a backup taken under load restores, on every member, into a cluster whose first grant
/// is above the floor and above every token issued before, and which keeps the backup's leases,
/// request-id records and signing keys (the active one retired: the restored cluster signs with
/// its own). A member started on its old data dir (the old cluster's)
/// is refused and moves no restored member's term; started empty instead, it catches up.
/// Method: 120 grants (40 released), then acquire/release load on every node while `lockctl
/// snapshot save` runs through a follower; every token is recorded. All three nodes are killed,
/// node 3's data dir is kept aside, all are wiped. The refusals of `lockd restore` first; then
/// each member is restored from the file with a floor above every token ever issued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backup_under_load_then_restore_every_member_with_a_floor() {
    let mut cluster = Cluster::start(ClusterOptions {
        stderr_files: true,
        // Open mode: backups are refused to everyone without this flag.
        extra_args: vec!["--allow-backup-without-policy".into()],
        ..ClusterOptions::default()
    })
    .await
    .unwrap();
    let leader = cluster.leader().await.unwrap();
    let follower = (1..=3).find(|n| *n != leader).unwrap();

    // Phase 1: state before the backup.
    let mut before = BTreeMap::new();
    for i in 0..120u64 {
        let resource = format!("held/{i}");
        let g = acquire_retrying(
            &cluster,
            &[1, 2, 3],
            &resource,
            &format!("held-{i}"),
            300_000,
        )
        .await;
        before.insert(i, (resource, g));
    }
    let mut c = cluster.lock_client(leader).await.unwrap();
    for i in 0..40 {
        let (resource, g) = &before[&i];
        c.release(ReleaseRequest {
            resource: resource.clone(),
            lease_id: g.lease_id.clone(),
        })
        .await
        .unwrap();
    }
    let keys_before = key_ids(&cluster, leader).await;
    let max_before_backup = before.values().map(|(_, g)| g.fencing_token).max().unwrap();

    // Phase 2: the backup under load, through a follower (forwarded to the leader).
    let stop = Arc::new(AtomicBool::new(false));
    let loads: Vec<_> = (1..=3)
        .map(|n| {
            let (stop, addr) = (stop.clone(), cluster.addr(n));
            tokio::spawn(async move {
                let channel = Channel::from_shared(format!("http://{addr}"))
                    .unwrap()
                    .connect_lazy();
                load(LockClient::new(channel), stop, n).await
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("backup.lockd");
    let summary = save(&cluster, follower, &file).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let mut all_tokens: Vec<u64> = before.values().map(|(_, g)| g.fencing_token).collect();
    for l in loads {
        all_tokens.extend(l.await.unwrap());
    }
    let size = summary["size_bytes"].as_u64().unwrap();
    let backup_last_token = summary["last_fencing_token"].as_u64().unwrap();
    assert_eq!(std::fs::metadata(&file).unwrap().len(), size);
    assert!(
        backup_last_token >= max_before_backup,
        "backup's last token {backup_last_token} < {max_before_backup} granted before it"
    );
    assert!(summary["active_locks"].as_u64().unwrap() >= 80, "{summary}");
    let max_ever = *all_tokens.iter().max().unwrap();
    assert!(
        max_ever > backup_last_token,
        "the load should have granted after the backup (max {max_ever}, backup {backup_last_token})"
    );
    // Nothing but the backup beside it (no temporary file left).
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);

    // Phase 3: disaster. A follower's data dir of the old cluster is kept for phase 7 (a
    // follower: restarted, it campaigns; an old leader would restart as leader of its term).
    let old_leader = cluster.leader().await.unwrap();
    let old = (1..=3).find(|n| *n != old_leader).unwrap();
    for n in 1..=3 {
        cluster.kill(n);
    }
    let old_dir = dir.path().join("old-node");
    copy_dir(&cluster.data_dir(old), &old_dir);
    for n in 1..=3 {
        cluster.wipe(n).unwrap();
    }

    // Phase 4: refusals, each leaving the data dir untouched.
    let node1 = cluster.data_dir(1);
    let node1_s = node1.to_str().unwrap();
    let file_s = file.to_str().unwrap();
    let r = run("lockd", &["restore", file_s, "--data-dir", node1_s]).await;
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert!(
        r.stderr.contains("--token-floor is required")
            && r.stderr.contains("fence-proxy epochs max")
            && r.stderr.contains("last fencing token plus a margin"),
        "{}",
        r.stderr
    );
    // A floor below the backup's last token is refused naming both (a fresh dir, untouched).
    let below = (backup_last_token - 1).to_string();
    let r = run(
        "lockd",
        &[
            "restore",
            file_s,
            "--data-dir",
            node1_s,
            "--token-floor",
            &below,
        ],
    )
    .await;
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert!(
        r.stderr
            .contains(&format!("--token-floor {below} is below"))
            && r.stderr.contains(&backup_last_token.to_string()),
        "{}",
        r.stderr
    );
    assert!(dir_is_empty_or_missing(&node1));
    // Equal to it: restored, with a warning on stderr (JSON on stdout carries it too).
    let scratch = dir.path().join("equal-floor");
    let equal = backup_last_token.to_string();
    let r = run(
        "lockd",
        &[
            "restore",
            file_s,
            "--data-dir",
            scratch.to_str().unwrap(),
            "--token-floor",
            &equal,
            "--json",
        ],
    )
    .await;
    r.ok();
    assert!(
        r.stderr.contains("warning")
            && r.stderr.contains("granted nothing after the backup")
            && r.json()["warning"].is_string(),
        "{}",
        r.stderr
    );
    std::fs::remove_dir_all(&scratch).unwrap();
    let too_high = ((1u64 << 62) + 1).to_string();
    let r = run(
        "lockd",
        &[
            "restore",
            file_s,
            "--data-dir",
            node1_s,
            "--token-floor",
            &too_high,
        ],
    )
    .await;
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert!(
        r.stderr.contains(&too_high) && r.stderr.contains("2^62"),
        "{}",
        r.stderr
    );
    assert!(dir_is_empty_or_missing(&node1));

    let bytes = std::fs::read(&file).unwrap();
    let damaged = dir.path().join("damaged.lockd");
    let mut flipped = bytes.clone();
    flipped[bytes.len() / 2] ^= 0x01;
    std::fs::write(&damaged, &flipped).unwrap();
    let cut = dir.path().join("cut.lockd");
    std::fs::write(&cut, &bytes[..bytes.len() * 2 / 3]).unwrap();
    let good_floor = (max_ever + 1_000).to_string();
    for (bad, why) in [(&damaged, "checksum mismatch"), (&cut, "truncated")] {
        let bad_s = bad.to_str().unwrap();
        let r = run(
            "lockd",
            &[
                "restore",
                bad_s,
                "--data-dir",
                node1_s,
                "--token-floor",
                &good_floor,
            ],
        )
        .await;
        assert_eq!(r.code, Some(1), "{}", r.stderr);
        assert!(
            r.stderr.contains(why) && r.stderr.contains(bad_s),
            "{}",
            r.stderr
        );
    }
    assert!(dir_is_empty_or_missing(&node1));
    let used = dir.path().join("used");
    std::fs::create_dir(&used).unwrap();
    std::fs::write(used.join("lockd.redb"), b"something").unwrap();
    let r = run(
        "lockd",
        &[
            "restore",
            file_s,
            "--data-dir",
            used.to_str().unwrap(),
            "--token-floor",
            &good_floor,
        ],
    )
    .await;
    assert_eq!(r.code, Some(1), "{}", r.stderr);
    assert!(
        r.stderr.contains("not empty") && r.stderr.contains("lockd.redb"),
        "{}",
        r.stderr
    );
    assert_eq!(
        std::fs::read(used.join("lockd.redb")).unwrap(),
        b"something"
    );

    // Phase 5: every member restored from the same file with the same floor (above every token
    // ever issued, as a fence store that saw the lost grants would report): the same restore id
    // and byte for byte the same state machine on each.
    let floor = max_ever + 1_000;
    let mut restore_ids = Vec::new();
    for n in 1..=3 {
        let r = restore(&file, &cluster.data_dir(n), floor).await;
        assert_eq!(r["first_fencing_token"].as_u64(), Some(floor + 1), "{r}");
        assert_eq!(
            r["backup_last_fencing_token"].as_u64(),
            Some(backup_last_token)
        );
        restore_ids.push(r["restore_id"].as_str().unwrap().to_owned());
    }
    assert!(restore_ids.iter().all(|id| *id == restore_ids[0]));
    let snapshots: Vec<Vec<u8>> = (1..=3)
        .map(|n| std::fs::read(cluster.data_dir(n).join("snapshot.bin")).unwrap())
        .collect();
    assert!(snapshots.iter().all(|s| *s == snapshots[0]));
    let started = Instant::now();
    for n in 1..=3 {
        cluster.start_node(n).unwrap();
    }
    cluster
        .wait_for_leader(Duration::from_secs(30))
        .await
        .unwrap();

    // Phase 6: the first grant is above the floor and above every token of before; the
    // backup's state is served.
    let first = acquire_retrying(&cluster, &[1, 2, 3], "after/first", "after-first", 10_000).await;
    eprintln!(
        "restored cluster: first grant {} ms after start",
        started.elapsed().as_millis()
    );
    assert!(
        first.fencing_token > floor && first.fencing_token > max_ever,
        "first token {} after restore; floor {floor}, highest ever {max_ever}",
        first.fencing_token
    );
    // Every lease and request-id record of before the backup, one by one.
    for i in 0..120u64 {
        let (resource, g) = &before[&i];
        let d = cluster
            .lock_client(2)
            .await
            .unwrap()
            .describe(DescribeRequest {
                resource: resource.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(d.held, i >= 40, "{resource}: {d:?}");
        if i >= 40 {
            assert_eq!(d.fencing_token, g.fencing_token);
        }
        // A retry of an acquire from before the backup answers the original grant (a released
        // one too: its record outlives the lease).
        let retry: AcquireResponse =
            acquire_retrying(&cluster, &[3], resource, &format!("held-{i}"), 300_000).await;
        assert_eq!(
            (retry.lease_id.as_str(), retry.fencing_token),
            (g.lease_id.as_str(), g.fencing_token),
            "retry of held-{i}"
        );
    }
    // The backup's keys are still listed (sequencers they signed verify), and the restored
    // cluster signs with a key of its own, listed after them.
    let keys_after = key_ids(&cluster, 3).await;
    assert_eq!(keys_after[..keys_before.len()], keys_before[..]);
    assert_eq!(keys_after.len(), keys_before.len() + 1, "{keys_after:?}");
    // Every member holds the same table at the same applied index (compared at one index:
    // leases of the load, 5 s, expire meanwhile).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut seen = Vec::new();
        for n in 1..=3 {
            let st = cluster.status(n).await.unwrap();
            seen.push((st.applied_index, st.active_locks));
        }
        if seen.iter().all(|x| *x == seen[0]) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "(applied index, active locks) per node: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Phase 7: node `old` comes back on its data dir of the old cluster. The restored members
    // refuse its messages (the old cluster's incarnation id, drawn when its peers founded it,
    // is not the restore id) and it refuses theirs: their terms do not move while its own
    // climbs past them with every election it starts.
    let restored: Vec<u64> = (1..=3).filter(|n| *n != old).collect();
    cluster.kill(old);
    leader_of(&cluster, &restored).await;
    std::fs::remove_dir_all(cluster.data_dir(old)).unwrap();
    copy_dir(&old_dir, &cluster.data_dir(old));
    let terms = (
        term(&cluster, restored[0]).await,
        term(&cluster, restored[1]).await,
    );
    cluster.start_node(old).unwrap();
    let restore_id = restore_ids[0].as_str();
    wait_logged(
        "the old cluster's node",
        || cluster.stderr(old),
        &["restore id mismatch", restore_id, "different clusters"],
    )
    .await;
    let old_name = format!("node {old}");
    wait_logged(
        "a restored member",
        || restored.iter().map(|n| cluster.stderr(*n)).collect(),
        &[
            "restore id mismatch",
            &old_name,
            restore_id,
            "different clusters",
        ],
    )
    .await;
    // Its term climbs with every election it starts; a restored member that took one of its
    // messages would have adopted that term. The restored members may hold an election of their
    // own on a loaded machine (a term or two), so the test lets the old node get well ahead and
    // then checks that they stayed below it, rather than that they did not move at all.
    let deadline = Instant::now() + Duration::from_secs(30);
    let old_term = loop {
        let t = term(&cluster, old).await;
        if t > terms.0.max(terms.1) + 3 {
            break t;
        }
        assert!(
            Instant::now() < deadline,
            "node {old} of the old cluster should campaign past the restored term (it is at \
             {t}, they at {terms:?})"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let now = (
        term(&cluster, restored[0]).await,
        term(&cluster, restored[1]).await,
    );
    assert!(
        now.0 < old_term && now.1 < old_term,
        "a restored member took a term of node {old}, of the old cluster: restored members at \
         {now:?} (were {terms:?}), node {old} at {old_term}"
    );
    // Still a leader among the restored members (the same one unless they held an election).
    let leader = leader_of(&cluster, &restored).await;
    let during = acquire_retrying(&cluster, &restored, "after/old-node", "after-old", 10_000).await;
    assert!(during.fencing_token > first.fencing_token);

    // Phase 8: node `old` started empty is a wiped node: it learns the restore id from the
    // restored members and catches up; then it counts toward a quorum (one of them down).
    cluster.wipe(old).unwrap();
    cluster.start_node(old).unwrap();
    let s = cluster.status(leader).await.unwrap();
    cluster
        .wait_applied(s.applied_index, Duration::from_secs(30))
        .await
        .unwrap();
    // Same table as the leader's at the same applied index (leases of 10 s expire meanwhile,
    // so the counts are compared at one index).
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (a, b) = (
            cluster.status(leader).await.unwrap(),
            cluster.status(old).await.unwrap(),
        );
        if (a.applied_index, a.active_locks) == (b.applied_index, b.active_locks) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "node {old} does not match the leader: {b:?} vs {a:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let down = restored[0];
    let keep = restored[1];
    cluster.kill(down);
    let last = acquire_retrying(&cluster, &[keep, old], "after/wiped", "after-wiped", 10_000).await;
    assert!(last.fencing_token > during.fencing_token);
}

/// Goal: members restored from the same backup with different floors refuse each other, each
/// side naming the peer and both restore ids, and the odd one never joins; the two restored
/// alike form the cluster and grant above their floor.
/// Method: a small backup; nodes 1 and 2 restored with floor 1000, node 3 with floor 2000.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_restored_with_different_floors_refuse_each_other() {
    let mut cluster = Cluster::start(ClusterOptions {
        stderr_files: true,
        // Open mode: backups are refused to everyone without this flag.
        extra_args: vec!["--allow-backup-without-policy".into()],
        ..ClusterOptions::default()
    })
    .await
    .unwrap();
    for i in 0..5 {
        acquire_retrying(
            &cluster,
            &[1, 2, 3],
            &format!("r/{i}"),
            &format!("r-{i}"),
            60_000,
        )
        .await;
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("backup.lockd");
    save(&cluster, 1, &file).await;
    for n in 1..=3 {
        cluster.wipe(n).unwrap();
    }
    let a = restore(&file, &cluster.data_dir(1), 1_000).await;
    restore(&file, &cluster.data_dir(2), 1_000).await;
    let b = restore(&file, &cluster.data_dir(3), 2_000).await;
    let (id_a, id_b) = (
        a["restore_id"].as_str().unwrap().to_owned(),
        b["restore_id"].as_str().unwrap().to_owned(),
    );
    assert_ne!(id_a, id_b);
    for n in 1..=3 {
        cluster.start_node(n).unwrap();
    }
    let first = acquire_retrying(&cluster, &[1, 2], "after", "after", 10_000).await;
    assert_eq!(first.fencing_token, 1_001);
    wait_logged(
        "node 3 (floor 2000)",
        || cluster.stderr(3),
        &["restore id mismatch", &id_a, &id_b],
    )
    .await;
    wait_logged(
        "nodes 1 and 2 (floor 1000)",
        || cluster.stderr(1) + &cluster.stderr(2),
        &["restore id mismatch", "node 3", &id_a, &id_b],
    )
    .await;
    let leader = leader_of(&cluster, &[1, 2]).await;
    assert!(leader == 1 || leader == 2, "leader {leader}");
    let s3 = cluster.status(3).await.unwrap();
    assert_ne!(
        s3.leader_id, leader,
        "node 3 follows the other restore: {s3:?}"
    );
    assert!(
        s3.applied_index < cluster.status(leader).await.unwrap().applied_index,
        "node 3 applied the other restore's entries: {s3:?}"
    );
}

/// `lockctl keys export DIR` through node `via`, which must succeed; the trusted keys of the
/// files it wrote, as `fence-proxy --verify-key DIR/*.pub.pem` loads them.
async fn export_keys(cluster: &Cluster, via: u64, dir: &Path) -> VerifyKeys {
    std::fs::create_dir_all(dir).unwrap();
    run(
        "lockctl",
        &[
            "--endpoints",
            &cluster.addr(via),
            "keys",
            "export",
            dir.to_str().unwrap(),
        ],
    )
    .await
    .ok();
    let files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    VerifyKeys::from_pem_files(&files).unwrap()
}

/// Goal: a restored cluster signs with a key of its own, so the fence stores of the backed-up
/// cluster do not accept its sequencers (review of the restore, H2: a drill or staging copy
/// restored from a production backup signed with production's key, and both granted the same
/// (resource, token) from overlapping token ranges: production's fence-proxy accepted both).
/// Sequencers of the backup's leases still verify with the restored cluster's exported keys
/// (the old key stays listed, retired). Method: a grant and an export of the keys; a backup;
/// every member wiped and restored; a grant of the restored cluster checked against the old
/// export (refused: unknown key) and against a new export (accepted, the old grant too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_cluster_signs_with_a_key_of_its_own() {
    let mut cluster = Cluster::start(ClusterOptions {
        // Open mode: backups are refused to everyone without this flag.
        extra_args: vec!["--allow-backup-without-policy".into()],
        ..ClusterOptions::default()
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();

    // Phase 1: the backed-up cluster grants, its keys go to the fence stores, a backup.
    let before =
        acquire_retrying(&cluster, &[1, 2, 3], "keys/before", "keys-before", 300_000).await;
    let backup_key = inspect_unverified(&before.sequencer).unwrap().key_id;
    let stores_of_a = export_keys(&cluster, 1, &dir.path().join("keys-a")).await;
    assert_eq!(stores_of_a.key_ids().collect::<Vec<_>>(), vec![backup_key]);
    let file = dir.path().join("backup.lockd");
    let summary = save(&cluster, 1, &file).await;
    let floor = summary["last_fencing_token"].as_u64().unwrap() + 1_000;

    // Phase 2: every member restored from the file (a drill copy or a disaster recovery alike).
    for n in 1..=3 {
        cluster.kill(n);
        cluster.wipe(n).unwrap();
        restore(&file, &cluster.data_dir(n), floor).await;
    }
    for n in 1..=3 {
        cluster.start_node(n).unwrap();
    }
    cluster
        .wait_for_leader(Duration::from_secs(30))
        .await
        .unwrap();

    // Phase 3: the restored cluster's grant is signed by another key, which the backed-up
    // cluster's stores do not know.
    let after = acquire_retrying(&cluster, &[1, 2, 3], "keys/after", "keys-after", 10_000).await;
    let signed_by = inspect_unverified(&after.sequencer).unwrap().key_id;
    assert_ne!(
        signed_by, backup_key,
        "the restored cluster signs with the backed-up cluster's key {backup_key}"
    );
    assert_eq!(
        stores_of_a.verify(&after.sequencer),
        Err(SequencerError::UnknownKey(signed_by))
    );

    // Phase 4: exported again, both verify; every member lists the same keys, the old one
    // retired.
    let restored = export_keys(&cluster, 2, &dir.path().join("keys-b")).await;
    assert_eq!(
        restored.verify(&after.sequencer).unwrap().token.0,
        after.fencing_token
    );
    assert_eq!(
        restored.verify(&before.sequencer).unwrap().token.0,
        before.fencing_token
    );
    let listed = key_ids(&cluster, 3).await;
    assert_eq!(listed, vec![backup_key.to_string(), signed_by.to_string()]);
    let keys = cluster
        .cluster_client(1)
        .await
        .unwrap()
        .signing_keys(SigningKeysRequest {})
        .await
        .unwrap()
        .into_inner()
        .keys;
    let active: Vec<_> = keys
        .iter()
        .filter(|k| k.active)
        .map(|k| &k.key_id)
        .collect();
    assert_eq!(active, vec![&signed_by.to_string()], "{keys:?}");
}
