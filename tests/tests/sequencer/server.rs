//! Signed sequencers from real three-node clusters (server
//! side): every Acquire carries a sequencer signed by the cluster's replicated Ed25519 key, which
//! verifies offline with the public keys `lockctl keys export` writes.
//!
//! Needs the `lockd` and `lockctl` binaries next to this test executable:
//! `cargo build -p lockd-server -p lockctl && cargo test -p lockd-tests --test sequencer`.

use std::path::Path;
use std::time::{Duration, Instant};

use lockd_api::v1::{AcquireRequest, AcquireResponse, SigningKeyInfo, SigningKeysRequest};
use lockd_fence::FencingToken;
use lockd_fence::sequencer::{KeyId, Sequencer, VerifyKeys, inspect_unverified};
use lockd_tests::cluster::{Cluster, ClusterOptions};
use lockd_tests::poll;
use lockd_tests::process::bin_path;
use tonic::Code;

fn req(resource: &str, request_id: &str, wait_ms: u64) -> AcquireRequest {
    AcquireRequest {
        resource: resource.into(),
        request_id: request_id.into(),
        lease_ttl_ms: 5_000,
        wait_timeout_ms: wait_ms,
        holder: "sequencer-test".into(),
    }
}

/// Acquire through `nodes` in turn, retrying UNAVAILABLE with the same request_id as a client
/// must (no leader yet, outcome unknown).
async fn acquire(cluster: &Cluster, nodes: &[u64], r: AcquireRequest) -> AcquireResponse {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut i = 0;
    loop {
        let node = nodes[i % nodes.len()];
        i += 1;
        let mut c = cluster.lock_client(node).await.unwrap();
        match c.acquire(r.clone()).await {
            Ok(reply) => return reply.into_inner(),
            Err(s) if s.code() == Code::Unavailable && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(s) => panic!("acquire {} on node {node}: {s:?}", r.resource),
        }
    }
}

/// The keys as the SigningKeys RPC lists them, retrying while no leader is known.
async fn signing_keys(cluster: &Cluster, node: u64) -> Vec<SigningKeyInfo> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut c = cluster.cluster_client(node).await.unwrap();
        match c.signing_keys(SigningKeysRequest {}).await {
            Ok(r) => return r.into_inner().keys,
            Err(s) if s.code() == Code::Unavailable && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(s) => panic!("signing keys on node {node}: {s:?}"),
        }
    }
}

async fn lockctl(cluster: &Cluster, args: &[&str]) -> serde_json::Value {
    let out = tokio::process::Command::new(bin_path("lockctl"))
        .arg("--endpoints")
        .arg(cluster.endpoints())
        .arg("--json")
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .expect("run lockctl");
    assert!(
        out.status.success(),
        "lockctl {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("lockctl --json prints one JSON object")
}

/// `lockctl keys export DIR`, then the verify keys fence-proxy would load from those files.
async fn exported_keys(cluster: &Cluster, dir: &Path) -> VerifyKeys {
    let out = lockctl(cluster, &["keys", "export", dir.to_str().unwrap()]).await;
    let files: Vec<String> = out["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap().to_owned())
        .collect();
    assert!(!files.is_empty(), "{out}");
    for f in &files {
        assert!(f.ends_with(".pub.pem"), "{f}");
    }
    VerifyKeys::from_pem_files(&files).unwrap()
}

fn active_key(keys: &[SigningKeyInfo]) -> String {
    let active: Vec<_> = keys.iter().filter(|k| k.active).collect();
    assert_eq!(active.len(), 1, "{keys:?}");
    active[0].key_id.clone()
}

fn key_of(reply: &AcquireResponse) -> String {
    inspect_unverified(&reply.sequencer)
        .unwrap()
        .key_id
        .to_string()
}

fn check_names_grant(seq: &Sequencer, resource: &str, reply: &AcquireResponse) {
    assert_eq!(seq.resource, resource);
    assert_eq!(seq.token, FencingToken(reply.fencing_token));
    assert_eq!(seq.expires_at_unix_ms, reply.expires_at_unix_ms);
}

/// Goal: an Acquire's sequencer verifies with the exported public keys and names the grant; a
/// retry returns identical bytes; a forwarded call relays it intact; a waiter granted later gets
/// one too; lockctl prints it. Method: a fresh cluster (the key is installed right after the
/// first leader's clock anchor), acquires through a follower and the leader, a waiter woken by a
/// release, `lockctl acquire --json`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequencers_verify_with_the_exported_keys() {
    let mut cluster = Cluster::start_default().await.unwrap();
    let leader = cluster.leader().await.unwrap();
    let follower = (1..=3).find(|i| *i != leader).unwrap();
    let dir = tempfile::tempdir().unwrap();

    // Phase 1: a grant through a follower (forwarded to the leader).
    let first = acquire(&cluster, &[follower], req("seq/a", "seq-a-1", 0)).await;
    assert!(!first.sequencer.is_empty(), "a grant without a sequencer");
    let keys = exported_keys(&cluster, dir.path()).await;
    let seq = keys
        .verify_for(
            &first.sequencer,
            "seq/a",
            Some(FencingToken(first.fencing_token)),
        )
        .unwrap();
    check_names_grant(&seq, "seq/a", &first);
    let listed = signing_keys(&cluster, follower).await;
    assert_eq!(seq.key_id.to_string(), active_key(&listed));
    assert!(
        listed[0]
            .public_key_pem
            .starts_with("-----BEGIN PUBLIC KEY-----")
    );

    // Phase 2: the same request_id, through the leader: the same bytes.
    let retry = acquire(&cluster, &[leader], req("seq/a", "seq-a-1", 0)).await;
    assert_eq!(retry.lease_id, first.lease_id);
    assert_eq!(retry.sequencer, first.sequencer);

    // Phase 3: a waiter granted by a release gets its own sequencer.
    let mut c = cluster.lock_client(leader).await.unwrap();
    let wait_req = req("seq/a", "seq-a-2", 10_000);
    let waiter = tokio::spawn({
        let mut c = c.clone();
        async move { c.acquire(wait_req).await.map(|r| r.into_inner()) }
    });
    poll::until_async("the waiter is queued", Duration::from_secs(10), || {
        let mut c = c.clone();
        async move {
            let d = c
                .describe(lockd_api::v1::DescribeRequest {
                    resource: "seq/a".into(),
                })
                .await
                .map_err(|e| format!("{e:?}"))?
                .into_inner();
            if d.waiters == 1 {
                Ok(())
            } else {
                Err(format!("{d:?}"))
            }
        }
    })
    .await;
    c.release(lockd_api::v1::ReleaseRequest {
        resource: "seq/a".into(),
        lease_id: first.lease_id.clone(),
    })
    .await
    .unwrap();
    let granted = waiter.await.unwrap().unwrap();
    assert!(granted.fencing_token > first.fencing_token);
    let seq = keys.verify_for(&granted.sequencer, "seq/a", None).unwrap();
    check_names_grant(&seq, "seq/a", &granted);

    // Phase 4: lockctl acquire prints it (base64) and it verifies as text.
    let out = lockctl(&cluster, &["acquire", "seq/b", "--ttl", "5s"]).await;
    let text = out["sequencer"].as_str().unwrap();
    let seq = keys.verify_text(text).unwrap();
    assert_eq!(seq.resource, "seq/b");
    assert_eq!(seq.token.0, out["fencing_token"].as_u64().unwrap());

    // Phase 5: an altered sequencer does not verify (the keys are not a rubber stamp).
    let mut altered = first.sequencer.clone();
    altered[13] ^= 1;
    assert!(keys.verify(&altered).is_err());
}

/// Goal: every leader signs with the same replicated key: after a leader kill, after a restart
/// of all nodes, and on a node that caught up by snapshot. Method: a small --snapshot-every;
/// grants, kill -9 the leader, grants through the new one; wipe a node and let it catch up;
/// restart everything; the key id never changes and old sequencers keep verifying.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_survives_failover_snapshots_and_restarts() {
    let options = ClusterOptions {
        snapshot_every: 20,
        logs_kept_after_snapshot: 5,
        ..ClusterOptions::default()
    };
    let mut cluster = Cluster::start(options).await.unwrap();
    let all = [1, 2, 3];
    let first = acquire(&cluster, &all, req("fail/a", "fail-1", 0)).await;
    let key = key_of(&first);
    // Enough entries that every node snapshots (with the key) and compacts its log.
    for i in 0..60 {
        acquire(
            &cluster,
            &all,
            req(&format!("fail/n{i}"), &format!("fill-{i}"), 0),
        )
        .await;
    }

    // Phase 1: leader kill.
    let old_leader = cluster.leader().await.unwrap();
    cluster.kill(old_leader);
    let survivors: Vec<u64> = all.iter().copied().filter(|i| *i != old_leader).collect();
    let after_kill = acquire(&cluster, &survivors, req("fail/b", "fail-2", 0)).await;
    let new_leader = cluster.leader().await.unwrap();
    assert_ne!(new_leader, old_leader);
    assert_eq!(
        key_of(&after_kill),
        key,
        "the new leader signs with another key"
    );

    // Phase 2: the killed node comes back wiped and catches up by snapshot (its log was
    // compacted on the others), then serves as leader.
    cluster.wipe(old_leader).unwrap();
    cluster.start_node(old_leader).unwrap();
    for i in 0..30 {
        acquire(
            &cluster,
            &survivors,
            req(&format!("fail/m{i}"), &format!("more-{i}"), 0),
        )
        .await;
    }
    let index = cluster.status(new_leader).await.unwrap().applied_index;
    cluster
        .wait_applied(index, Duration::from_secs(30))
        .await
        .unwrap();
    // Make the caught-up node the leader: stop the leader, wait until the two others have
    // elected one of them, restart it; again until the caught-up node wins (each round it is one
    // of two candidates). A leader restarted before the others elected would lead again at
    // once, in its term (openraft resumes a committed vote of its own), so waiting matters.
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut leader = cluster.leader().await.unwrap();
    while leader != old_leader {
        assert!(Instant::now() < deadline, "node {old_leader} never led");
        cluster.kill(leader);
        let next = cluster.leader().await.unwrap();
        cluster.start_node(leader).unwrap();
        leader = next;
    }
    let from_caught_up = acquire(&cluster, &[old_leader], req("fail/c", "fail-3", 0)).await;
    assert_eq!(key_of(&from_caught_up), key, "a snapshot lost the key");

    // Phase 3: restart every node.
    for id in all {
        cluster.kill(id);
    }
    for id in all {
        cluster.start_node(id).unwrap();
    }
    cluster.leader().await.unwrap();
    let after_restart = acquire(&cluster, &all, req("fail/d", "fail-4", 0)).await;
    assert_eq!(key_of(&after_restart), key, "a restart changed the key");
    let listed = signing_keys(&cluster, 1).await;
    assert_eq!(listed.len(), 1, "{listed:?}");
    let dir = tempfile::tempdir().unwrap();
    let keys = exported_keys(&cluster, dir.path()).await;
    for (resource, reply) in [
        ("fail/a", &first),
        ("fail/b", &after_kill),
        ("fail/c", &from_caught_up),
        ("fail/d", &after_restart),
    ] {
        let seq = keys.verify_for(&reply.sequencer, resource, None).unwrap();
        check_names_grant(&seq, resource, reply);
    }
}

/// Goal: rotation. New grants use the new key; sequencers of the old key still verify with the
/// old exported file; the old key stays listed as retired; a retried rotation does not rotate
/// twice. Method: grant, `lockctl keys rotate`, grant, export, verify both; rotate over a
/// stale key id through the RPC.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_keeps_old_sequencers_verifiable() {
    let cluster = Cluster::start_default().await.unwrap();
    let all = [1, 2, 3];
    let dir = tempfile::tempdir().unwrap();
    let before = acquire(&cluster, &all, req("rot/a", "rot-1", 0)).await;
    let old_key = key_of(&before);
    let old_keys = exported_keys(&cluster, dir.path()).await;

    let rotated = lockctl(&cluster, &["keys", "rotate"]).await;
    let new_key = rotated["key_id"].as_str().unwrap().to_owned();
    assert_eq!(rotated["retired_key_id"].as_str().unwrap(), old_key);
    assert_ne!(new_key, old_key);

    let after = acquire(&cluster, &all, req("rot/b", "rot-2", 0)).await;
    assert_eq!(key_of(&after), new_key);
    // The old file alone does not verify the new key's sequencers...
    assert!(matches!(
        old_keys.verify(&after.sequencer),
        Err(lockd_fence::sequencer::SequencerError::UnknownKey(_))
    ));
    // ...but the old sequencer still verifies with it, and with a fresh export of both keys.
    old_keys
        .verify_for(&before.sequencer, "rot/a", None)
        .unwrap();
    let both = exported_keys(&cluster, dir.path()).await;
    both.verify_for(&before.sequencer, "rot/a", None).unwrap();
    let seq = both.verify_for(&after.sequencer, "rot/b", None).unwrap();
    check_names_grant(&seq, "rot/b", &after);
    let mut ids: Vec<KeyId> = both.key_ids().collect();
    ids.sort();
    assert_eq!(ids.len(), 2);
    for id in [&old_key, &new_key] {
        assert!(dir.path().join(format!("{id}.pub.pem")).exists());
    }

    let listed = lockctl(&cluster, &["keys", "list"]).await;
    let listed = listed["keys"].as_array().unwrap();
    assert_eq!(listed.len(), 2);
    assert_eq!(listed[0]["key_id"], old_key.as_str());
    assert_eq!(listed[0]["active"], false);
    assert!(listed[0]["retired_unix_ms"].as_i64().unwrap() > 0);
    assert_eq!(listed[1]["key_id"], new_key.as_str());
    assert_eq!(listed[1]["active"], true);

    // A retry of the rotation (it names the key it replaced) does not rotate again.
    let mut c = cluster.cluster_client(1).await.unwrap();
    let again = c
        .rotate_signing_key(lockd_api::v1::RotateSigningKeyRequest {
            replaces_key_id: old_key.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.key_id, new_key);
    assert_eq!(signing_keys(&cluster, 2).await.len(), 2);
    // An id that was never a key of this cluster is refused, naming it.
    let err = c
        .rotate_signing_key(lockd_api::v1::RotateSigningKeyRequest {
            replaces_key_id: "00112233445566ff".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("00112233445566ff"), "{err:?}");
    // The retry of an acquire granted before the rotation is signed with the new key now, and
    // still names the same grant.
    let retried = acquire(&cluster, &all, req("rot/a", "rot-1", 0)).await;
    assert_eq!(retried.lease_id, before.lease_id);
    let seq = both.verify_for(&retried.sequencer, "rot/a", None).unwrap();
    assert_eq!(seq.key_id.to_string(), new_key);
    assert_eq!(seq.token, FencingToken(before.fencing_token));
}

/// Goal: `lockctl hold` gives COMMAND the sequencer beside the token. Method: COMMAND prints
/// its environment; the printed sequencer verifies and names the printed token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hold_exports_the_sequencer() {
    let cluster = Cluster::start_default().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = tokio::process::Command::new(bin_path("lockctl"))
        .arg("--endpoints")
        .arg(cluster.endpoints())
        .args([
            "hold",
            "hold/a",
            "--ttl",
            "5s",
            "--",
            "sh",
            "-c",
            "echo \"$LOCKD_FENCING_TOKEN $LOCKD_SEQUENCER\"",
        ])
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let (token, sequencer) = stdout.trim().split_once(' ').unwrap();
    let keys = exported_keys(&cluster, dir.path()).await;
    let seq = keys.verify_text(sequencer).unwrap();
    assert_eq!(seq.resource, "hold/a");
    assert_eq!(seq.token.0.to_string(), token);
}
