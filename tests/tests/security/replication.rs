//! The trust boundary of the replication port: with TLS on, only a node of this
//! cluster, with a certificate from the peer CA that names the node it claims to be, can move a
//! replica's Raft state; without TLS the cluster id still keeps two clusters apart and lockd
//! stays on loopback.

use std::time::Duration;

use lockd_api::v1::{AcquireRequest, DescribeRequest};
use lockd_server::raft::TypeConfig;
use lockd_server::service::raft::pb::forward_client::ForwardClient;
use lockd_server::service::raft::pb::raft_client::RaftClient;
use lockd_server::service::raft::pb::{
    ForwardBatch, ForwardedCall, RaftMessage, forward_reply, forwarded_call,
};
use lockd_tests::cluster::{Cluster, ClusterOptions};
use lockd_tests::tls::{Issued, TestCa};
use openraft::raft::{AppendEntriesRequest, InstallSnapshotRequest, VoteRequest};
use openraft::{CommittedLeaderId, LogId, SnapshotMeta, StoredMembership, Vote};
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

/// The forged messages of a network attacker: term 1000, from "leader" (or candidate) 2.
fn forged() -> Vec<(&'static str, Vec<u8>)> {
    let append = AppendEntriesRequest::<TypeConfig> {
        vote: Vote::new_committed(1000, 2),
        prev_log_id: None,
        entries: Vec::new(),
        leader_commit: None,
    };
    let vote = VoteRequest::<u64>::new(
        Vote::new(1000, 2),
        Some(LogId::new(CommittedLeaderId::new(999, 2), 1_000_000)),
    );
    let snapshot = InstallSnapshotRequest::<TypeConfig> {
        vote: Vote::new_committed(1000, 2),
        meta: SnapshotMeta {
            last_log_id: Some(LogId::new(CommittedLeaderId::new(999, 2), 1_000_000)),
            last_membership: StoredMembership::default(),
            snapshot_id: "forged".into(),
        },
        offset: 0,
        data: Vec::new(),
        done: true,
    };
    vec![
        ("AppendEntries", postcard::to_allocvec(&append).unwrap()),
        ("Vote", postcard::to_allocvec(&vote).unwrap()),
        ("InstallSnapshot", postcard::to_allocvec(&snapshot).unwrap()),
    ]
}

/// A TLS channel to node `id` trusting the peer CA, presenting `identity` if given.
fn channel(cluster: &Cluster, id: u64, identity: Option<&Issued>) -> Channel {
    let tls = cluster.tls.as_ref().unwrap();
    let mut config = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(
        std::fs::read(&tls.peer_ca.cert_path).unwrap(),
    ));
    if let Some(i) = identity {
        config = config.identity(Identity::from_pem(
            std::fs::read(&i.cert).unwrap(),
            std::fs::read(&i.key).unwrap(),
        ));
    }
    Channel::from_shared(format!("https://{}", cluster.addr(id)))
        .unwrap()
        .tls_config(config)
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .connect_lazy()
}

/// Sends one raw Raft message without a cluster incarnation id; the gRPC outcome.
async fn send(
    ch: Channel,
    method: &str,
    data: Vec<u8>,
    cluster_id: &str,
) -> Result<Vec<u8>, tonic::Status> {
    send_as(ch, method, data, cluster_id, None).await
}

/// Sends one raw Raft message with `incarnation` in the `lockd-restore-id` header (the cluster
/// incarnation id, see lockd/server/src/raft/restore_id.rs); the gRPC outcome.
async fn send_as(
    ch: Channel,
    method: &str,
    data: Vec<u8>,
    cluster_id: &str,
    incarnation: Option<&str>,
) -> Result<Vec<u8>, tonic::Status> {
    let mut client = RaftClient::new(ch);
    let mut req = tonic::Request::new(RaftMessage { data });
    if !cluster_id.is_empty() {
        req.metadata_mut()
            .insert("lockd-cluster-id", cluster_id.parse().unwrap());
    }
    if let Some(id) = incarnation {
        req.metadata_mut()
            .insert("lockd-restore-id", id.parse().unwrap());
    }
    req.set_timeout(Duration::from_secs(3));
    let reply = match method {
        "AppendEntries" => client.append_entries(req).await,
        "Vote" => client.vote(req).await,
        "InstallSnapshot" => client.install_snapshot(req).await,
        other => panic!("unknown method {other}"),
    };
    reply.map(|r| r.into_inner().data)
}

/// A forwarded Acquire (no wait) of `resource`, numbered `id`, acting for `identity`.
pub(super) fn forwarded_acquire(
    id: u64,
    identity: Option<&str>,
    resource: &str,
    request_id: &str,
) -> ForwardedCall {
    ForwardedCall {
        id,
        timeout_ms: 3_000,
        identity: identity.map(str::to_owned),
        call: Some(forwarded_call::Call::Acquire(AcquireRequest {
            resource: resource.into(),
            request_id: request_id.into(),
            lease_ttl_ms: 30_000,
            wait_timeout_ms: 0,
            holder: "forwarding-test".into(),
        })),
    }
}

/// Opens a forward stream (the calls a follower forwards to the leader) with `incarnation` in
/// `lockd-restore-id`, as a follower sends it, and sends one Acquire of `resource` on it,
/// claiming to act for `cert:bob`; the leader's answer, or the refusal.
async fn forward_acquire(
    ch: Channel,
    cluster_id: &str,
    incarnation: Option<&str>,
    resource: &str,
) -> Result<forward_reply::Result, tonic::Status> {
    let call = forwarded_acquire(7, Some("cert:bob"), resource, &format!("forged-{resource}"));
    let mut req = tonic::Request::new(futures::stream::iter([ForwardBatch { calls: vec![call] }]));
    if !cluster_id.is_empty() {
        req.metadata_mut()
            .insert("lockd-cluster-id", cluster_id.parse().unwrap());
    }
    if let Some(id) = incarnation {
        req.metadata_mut()
            .insert("lockd-restore-id", id.parse().unwrap());
    }
    req.set_timeout(Duration::from_secs(3));
    let mut replies = ForwardClient::new(ch).calls(req).await?.into_inner();
    let batch = replies
        .message()
        .await?
        .expect("a forward stream that was accepted answers its call");
    assert_eq!(batch.replies.len(), 1, "{batch:?}");
    assert_eq!(batch.replies[0].id, 7, "{batch:?}");
    Ok(batch.replies[0].result.clone().unwrap())
}

/// Whether `resource` is held, as node `id` (the leader) reports it.
async fn held(cluster: &Cluster, id: u64, resource: &str) -> bool {
    cluster
        .lock_client(id)
        .await
        .unwrap()
        .describe(DescribeRequest {
            resource: resource.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .held
}

/// The cluster incarnation id node `target` reports in its `CurrentVote` answer (read-only,
/// answered to any member).
async fn incarnation(ch: Channel, cluster_id: &str) -> Option<String> {
    let mut req = tonic::Request::new(RaftMessage { data: Vec::new() });
    req.metadata_mut()
        .insert("lockd-cluster-id", cluster_id.parse().unwrap());
    RaftClient::new(ch)
        .current_vote(req)
        .await
        .unwrap()
        .into_inner()
        .restore_id
}

/// (term, leader) as every node reports it.
async fn terms(cluster: &Cluster) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for id in 1..=3 {
        let s = cluster.status(id).await.unwrap();
        out.push((s.term, s.leader_id));
    }
    out
}

/// Goal: the forged AppendEntries, Vote and InstallSnapshot of a network attacker
/// (term 1000, "leader 2") are refused with UNAUTHENTICATED and change nothing, whoever sends
/// them without being node 2: no certificate, a client certificate of the client CA, node 3's
/// own certificate, a certificate of another CA naming node 2, or node 2's certificate with
/// another cluster's id. Method: a TLS cluster; every (sender, message) pair against every node;
/// terms and leaders before and after. Control: node 2's own certificate does move a node to
/// term 1000, so the refusals come from the check and not from a malformed message. The same
/// senders cannot open the leader's forward stream (calls forwarded in the name of another
/// identity); a member can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue15_forged_raft_messages_are_refused_and_change_nothing() {
    let extra = tempfile::tempdir().unwrap();
    let client_ca = TestCa::new(extra.path(), "client").unwrap();
    let client = client_ca
        .issue("alice", &["alice.clients.example".to_owned()], &[])
        .unwrap();
    let mut cluster = Cluster::start(ClusterOptions {
        tls: true,
        extra_args: vec![
            "--tls-client-ca".into(),
            client_ca.cert_path.display().to_string(),
        ],
        ..Default::default()
    })
    .await
    .unwrap();
    let leader = cluster.leader().await.unwrap();
    let other_ca = TestCa::new(extra.path(), "other").unwrap();
    let foreign = other_ca.issue_node("test", 2, cluster.ip.into()).unwrap();
    let node3 = cluster.tls.as_ref().unwrap().nodes[2].clone();
    let node2 = cluster.tls.as_ref().unwrap().nodes[1].clone();
    // A client certificate that names node 2: only the check against the peer CA alone (not
    // every CA the port trusts for clients) refuses it.
    let client_as_node2 = client_ca
        .issue("mallory", &["node-2.test.lockd".to_owned()], &[])
        .unwrap();
    let peer_ca = &cluster.tls.as_ref().unwrap().peer_ca;
    let non_member = peer_ca.issue_node("test", 4, cluster.ip.into()).unwrap();
    let wildcard = peer_ca
        .issue(
            "wildcard",
            &["*.test.lockd".to_owned()],
            &[cluster.ip.into()],
        )
        .unwrap();

    let before = terms(&cluster).await;
    let senders: Vec<(&str, Option<&Issued>, &str)> = vec![
        ("no certificate", None, "test"),
        ("a client certificate", Some(&client), "test"),
        ("node 3 claiming to be node 2", Some(&node3), "test"),
        ("another CA's node-2 certificate", Some(&foreign), "test"),
        ("node 2 with another cluster id", Some(&node2), "other"),
        ("node 2 without a cluster id", Some(&node2), ""),
        (
            "a client certificate naming node 2",
            Some(&client_as_node2),
            "test",
        ),
        (
            "the peer CA's certificate for non-member node 4",
            Some(&non_member),
            "test",
        ),
        (
            "a wildcard certificate of the peer CA",
            Some(&wildcard),
            "test",
        ),
    ];
    for (who, identity, cluster_id) in &senders {
        for target in [1, 3] {
            let mut messages = forged();
            // Refused before decoding: garbage gets the same answer as a valid message (except
            // from node 3, a member, whose garbage is decoded and refused as such).
            if !who.starts_with("node 3") {
                messages.push(("AppendEntries", b"not postcard".to_vec()));
            }
            for (method, data) in messages {
                let r = send(
                    channel(&cluster, target, *identity),
                    method,
                    data,
                    cluster_id,
                )
                .await;
                let status = r.expect_err(&format!(
                    "{method} from {who} to node {target} was accepted"
                ));
                // Another CA's certificate fails the TLS handshake before any gRPC.
                if *who != "another CA's node-2 certificate" {
                    assert_eq!(
                        status.code(),
                        Code::Unauthenticated,
                        "{method} from {who} to node {target}: {status:?}"
                    );
                    assert!(status.message().starts_with("lockd: "), "{status:?}");
                    // The reason is logged by the node; the caller learns nothing of the cluster.
                    assert!(!status.message().contains("test"), "{status:?}");
                }
            }
        }
    }
    // The forward stream (calls a follower forwards, each naming the identity it acts for) has
    // the same boundary: none of these senders gets a call through it (node 3 is a member:
    // it may, and is the control below when it is not the leader).
    for (who, identity, cluster_id) in senders.iter().filter(|s| !s.0.starts_with("node 3")) {
        let r = forward_acquire(
            channel(&cluster, leader, *identity),
            cluster_id,
            None,
            "forged/forward",
        )
        .await;
        let status = r.expect_err(&format!("a forward stream from {who} was accepted"));
        if *who != "another CA's node-2 certificate" {
            assert_eq!(status.code(), Code::Unauthenticated, "{who}: {status:?}");
            assert!(!status.message().contains("test"), "{status:?}");
        }
    }
    assert!(!held(&cluster, leader, "forged/forward").await);
    // Control: a member may forward on it (without a policy, for anyone).
    let member = (1..=3).find(|i| *i != leader).unwrap();
    let member_cert = cluster.tls.as_ref().unwrap().nodes[member as usize - 1].clone();
    let own = incarnation(channel(&cluster, leader, Some(&member_cert)), "test").await;
    let granted = forward_acquire(
        channel(&cluster, leader, Some(&member_cert)),
        "test",
        own.as_deref(),
        "member/forward",
    )
    .await
    .expect("a member's forward stream is accepted");
    assert!(
        matches!(&granted, forward_reply::Result::Acquire(a) if a.fencing_token > 0),
        "{granted:?}"
    );
    assert!(held(&cluster, leader, "member/forward").await);

    // Nothing to wait for: the forged messages must move nothing, so give them time to do harm.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = terms(&cluster).await;
    assert_eq!(before, after, "terms or leaders moved");
    assert!(
        after.iter().all(|(t, l)| *t < 1000 && *l == leader),
        "{after:?}"
    );

    // Control: the real node 2 (with the cluster's incarnation id, as node 2 sends it) may send
    // what it likes; node 1 follows "leader 2" in term 1000.
    let id = incarnation(channel(&cluster, 1, Some(&node2)), "test").await;
    assert!(
        id.is_some(),
        "a cluster founded by its peers has an incarnation id"
    );
    let (method, data) = forged().swap_remove(0);
    send_as(
        channel(&cluster, 1, Some(&node2)),
        method,
        data,
        "test",
        id.as_deref(),
    )
    .await
    .expect("node 2's own certificate is accepted");
    let s = cluster.status(1).await.unwrap();
    assert_eq!(s.term, 1000, "{s:?}");
}

/// Goal: without TLS the cluster id still keeps two clusters apart, and lockd refuses
/// to run plaintext on a non-loopback address unless told to. Method: a plaintext cluster gets
/// a message with another cluster's id and one with none; `lockd --listen` on a non-loopback
/// address without TLS fails at start with one line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue15_plaintext_checks_the_cluster_id_and_stays_on_loopback() {
    let cluster = Cluster::start_default().await.unwrap();
    let before = terms(&cluster).await;
    for cluster_id in ["other", ""] {
        let ch = Channel::from_shared(format!("http://{}", cluster.addr(1)))
            .unwrap()
            .connect_lazy();
        let (method, data) = forged().swap_remove(0);
        let status = send(ch.clone(), method, data, cluster_id)
            .await
            .unwrap_err();
        assert_eq!(
            status.code(),
            Code::Unauthenticated,
            "{cluster_id:?}: {status:?}"
        );
        let status = forward_acquire(ch, cluster_id, None, "plain/forward")
            .await
            .unwrap_err();
        assert_eq!(
            status.code(),
            Code::Unauthenticated,
            "forward stream, {cluster_id:?}: {status:?}"
        );
    }
    assert_eq!(before, terms(&cluster).await);
    let leader = before[0].1;
    assert!(!held(&cluster, leader, "plain/forward").await);

    let out = lockd_tests::process::command("lockd")
        .args([
            "--id",
            "1",
            "--listen",
            "192.0.2.1:7001",
            "--data-dir",
            "/nonexistent",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(
        err.contains("192.0.2.1:7001") && err.contains("--insecure-plaintext"),
        "{err}"
    );
}

/// Goal: a node of another cluster incarnation (same node ids, same addresses: for example a
/// second cluster founded on these addresses, or a node added to the wrong cluster) is refused
/// and cannot move the term or the log, without TLS, where nothing but the incarnation id tells
/// the two apart (issue 16, review finding). Method: a plaintext cluster founded by its peers;
/// node 2's AppendEntries (term 1000, with an entry that would overwrite index 1), Vote and
/// InstallSnapshot to node 1, with another incarnation's id and with none (a cluster founded by
/// an older lockd), are refused with FAILED_PRECONDITION naming both ids; terms, leaders and
/// the commit index stay, and a grant made after carries the next token. Control: the same
/// AppendEntries with the cluster's own id moves node 1 to term 1000.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue16_a_node_of_another_incarnation_moves_neither_term_nor_log() {
    let mut cluster = Cluster::start_default().await.unwrap();
    let leader = cluster.leader().await.unwrap();
    let ch = || {
        Channel::from_shared(format!("http://{}", cluster.addr(1)))
            .unwrap()
            .connect_lazy()
    };
    let own = incarnation(ch(), "lockd").await.expect("incarnation id");
    assert_eq!(own.len(), 32, "{own}");
    for id in 2..=3 {
        let ch = Channel::from_shared(format!("http://{}", cluster.addr(id)))
            .unwrap()
            .connect_lazy();
        assert_eq!(
            incarnation(ch, "lockd").await.as_deref(),
            Some(own.as_str())
        );
    }
    let before = terms(&cluster).await;
    let commit_before = cluster.status(1).await.unwrap().commit_index;

    let other = "0123456789abcdef0123456789abcdef";
    let mut messages = forged();
    // An entry at index 1 of term 1000: accepted, it would replace this cluster's entry 1.
    let overwrite = AppendEntriesRequest::<TypeConfig> {
        vote: Vote::new_committed(1000, 2),
        prev_log_id: Some(LogId::new(CommittedLeaderId::new(0, 0), 0)),
        entries: vec![openraft::Entry {
            log_id: LogId::new(CommittedLeaderId::new(1000, 2), 1),
            payload: openraft::EntryPayload::Blank,
        }],
        leader_commit: Some(LogId::new(CommittedLeaderId::new(1000, 2), 1)),
    };
    messages.push(("AppendEntries", postcard::to_allocvec(&overwrite).unwrap()));
    for incarnation_sent in [Some(other), None] {
        for (method, data) in messages.clone() {
            let status = send_as(ch(), method, data, "lockd", incarnation_sent)
                .await
                .expect_err(&format!("{method} with {incarnation_sent:?} was accepted"));
            assert_eq!(
                status.code(),
                Code::FailedPrecondition,
                "{method} with {incarnation_sent:?}: {status:?}"
            );
            assert!(
                status.message().contains(&own) && status.message().contains("different clusters"),
                "{status:?}"
            );
            if let Some(other) = incarnation_sent {
                assert!(status.message().contains(other), "{status:?}");
            }
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = terms(&cluster).await;
    assert_eq!(before, after, "terms or leaders moved");
    assert!(
        after.iter().all(|(t, l)| *t < 1000 && *l == leader),
        "{after:?}"
    );
    let s = cluster.status(1).await.unwrap();
    assert!(s.commit_index >= commit_before, "{s:?}");
    // The forward stream too (review of the loopback mode, LOW: it checked only the member and
    // the peer protocol): another incarnation's, or none, forwards nothing.
    for incarnation_sent in [Some(other), None] {
        let status = forward_acquire(
            channel_to(&cluster, leader),
            "lockd",
            incarnation_sent,
            "incarnation/forward",
        )
        .await
        .expect_err(&format!(
            "a forward stream with {incarnation_sent:?} was accepted"
        ));
        assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
        assert!(status.message().contains(&own), "{status:?}");
    }
    assert!(!held(&cluster, leader, "incarnation/forward").await);
    let granted = forward_acquire(
        channel_to(&cluster, leader),
        "lockd",
        Some(&own),
        "incarnation/own-forward",
    )
    .await
    .expect("a forward stream with the cluster's own incarnation id is accepted");
    assert!(
        matches!(&granted, forward_reply::Result::Acquire(a) if a.fencing_token > 0),
        "{granted:?}"
    );
    let token_before = acquire_token(&cluster, "incarnation/a").await;
    let token_after = acquire_token(&cluster, "incarnation/b").await;
    assert!(
        token_after > token_before,
        "{token_before} then {token_after}"
    );

    // Control: with the cluster's own id the same message reaches Raft.
    let (method, data) = forged().swap_remove(0);
    send_as(ch(), method, data, "lockd", Some(&own))
        .await
        .expect("a message with the cluster's own incarnation id is accepted");
    // The term reaches the node's status a moment after the reply (metrics), and may pass 1000
    // if the node then campaigns against the silent "leader 2": poll for at least 1000.
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    loop {
        let term = cluster.status(1).await.unwrap().term;
        if term >= 1000 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "node 1 stays in term {term}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A plaintext channel to node `id`.
fn channel_to(cluster: &Cluster, id: u64) -> Channel {
    Channel::from_shared(format!("http://{}", cluster.addr(id)))
        .unwrap()
        .connect_lazy()
}

/// Acquires `resource` through any node (retrying UNAVAILABLE with the same request id); its
/// fencing token.
async fn acquire_token(cluster: &Cluster, resource: &str) -> u64 {
    let client =
        lockd_client::Client::new((1..=3).map(|id| cluster.addr(id)).collect::<Vec<_>>()).unwrap();
    let lease = client
        .acquire(
            resource,
            lockd_client::AcquireOptions::default().ttl(Duration::from_secs(5)),
        )
        .await
        .unwrap();
    lease.fencing_token.0
}

/// Goal: a forward stream is checked on every message, not only when it opens: a member removed
/// while its stream is open forwards nothing more on it, in anyone's name (review of the forward
/// stream, HIGH-1: the stream was authenticated once, at open).
/// Method: a TLS cluster that allows membership calls without a policy; with a follower's node
/// certificate, open a forward stream to the leader and send one Acquire: granted (control).
/// Remove that follower with RemoveMember; send a second Acquire on the same stream: answered
/// UNAUTHENTICATED, the stream ends, and the resource is not held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forward_stream_of_a_removed_member_is_refused_mid_stream() {
    use lockd_api::v1::RemoveMemberRequest;
    let mut cluster = Cluster::start(ClusterOptions {
        tls: true,
        extra_args: vec!["--allow-membership-without-policy".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let leader = cluster.leader().await.unwrap();
    let removed = (1..=3).find(|i| *i != leader).unwrap();
    let cert = cluster.tls.as_ref().unwrap().nodes[removed as usize - 1].clone();
    let own = incarnation(channel(&cluster, leader, Some(&cert)), "test")
        .await
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel::<ForwardBatch>(4);
    let mut req = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    req.metadata_mut()
        .insert("lockd-cluster-id", "test".parse().unwrap());
    req.metadata_mut()
        .insert("lockd-restore-id", own.parse().unwrap());
    let call = |id: u64, resource: &str| ForwardBatch {
        calls: vec![forwarded_acquire(
            id,
            None,
            resource,
            &format!("removed-{id}"),
        )],
    };
    tx.send(call(1, "removed/before")).await.unwrap();
    let mut replies = ForwardClient::new(channel(&cluster, leader, Some(&cert)))
        .calls(req)
        .await
        .expect("a member opens a forward stream")
        .into_inner();
    let first = replies.message().await.unwrap().unwrap();
    assert!(
        matches!(
            &first.replies[0].result,
            Some(forward_reply::Result::Acquire(_))
        ),
        "{first:?}"
    );

    cluster
        .cluster_client(leader)
        .await
        .unwrap()
        .remove_member(RemoveMemberRequest { id: removed })
        .await
        .unwrap();
    tx.send(call(2, "removed/after")).await.unwrap();
    let second = tokio::time::timeout(Duration::from_secs(10), replies.message())
        .await
        .expect("the leader answers or ends the stream");
    // The stream may also end at once; either way nothing of the call is served.
    if let Ok(Some(batch)) = second {
        assert_eq!(batch.replies.len(), 1, "{batch:?}");
        match &batch.replies[0].result {
            Some(forward_reply::Result::Status(s)) => {
                assert_eq!(s.code, Code::Unauthenticated as i32, "{s:?}");
            }
            other => panic!("a removed member's call was served: {other:?}"),
        }
        let end = tokio::time::timeout(Duration::from_secs(10), replies.message())
            .await
            .expect("the stream ends");
        assert!(matches!(end, Ok(None) | Err(_)), "{end:?}");
    }
    assert!(held(&cluster, leader, "removed/before").await);
    assert!(!held(&cluster, leader, "removed/after").await);
}

/// Goal: a call marked as forwarded by a member but carrying no cluster incarnation id is
/// refused by a leader that has one, once that member announced a peer protocol that sends the
/// id on every forwarded call (review of the restore, L2: such calls were taken, for followers
/// of releases that did not send it, so a member of the old cluster, which has no id, forwarded
/// client and admin calls to a restored leader, SaveSnapshot with the signing keys included:
/// open mode hands a backup to a call a member forwards). Method: a TLS cluster without a
/// policy (founded by this release: it has an incarnation id); with a follower's node
/// certificate, a unary Acquire and a SaveSnapshot to the leader marked as forwarded by that
/// follower, without the id: FAILED_PRECONDITION naming the id and the follower, nothing
/// granted, no backup byte. Control: the same Acquire with the cluster's id is granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_restore_l2_a_forwarded_call_without_the_incarnation_id_is_refused() {
    use lockd_api::v1::SaveSnapshotRequest;
    use lockd_api::v1::cluster_client::ClusterClient;
    use lockd_api::v1::lock_client::LockClient;

    let mut cluster = Cluster::start(ClusterOptions {
        tls: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let leader = cluster.leader().await.unwrap();
    let member = (1..=3).find(|i| *i != leader).unwrap();
    let cert = cluster.tls.as_ref().unwrap().nodes[member as usize - 1].clone();
    let own = incarnation(channel(&cluster, leader, Some(&cert)), "test")
        .await
        .unwrap();
    // The leader has heard the member's peer protocol on its replies by now (heartbeats).
    tokio::time::sleep(Duration::from_millis(500)).await;
    fn forwarded<T>(member: u64, incarnation: Option<&str>, msg: T) -> tonic::Request<T> {
        let mut req = tonic::Request::new(msg);
        let md = req.metadata_mut();
        md.insert("lockd-forwarded-by", member.to_string().parse().unwrap());
        if let Some(id) = incarnation {
            md.insert("lockd-restore-id", id.parse().unwrap());
        }
        req.set_timeout(Duration::from_secs(5));
        req
    }
    let acquire = |resource: &str| AcquireRequest {
        resource: resource.into(),
        request_id: format!("req-{resource}"),
        lease_ttl_ms: 30_000,
        wait_timeout_ms: 0,
        holder: "old-cluster".into(),
    };
    let refused = |status: &tonic::Status| {
        assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
        assert!(
            status.message().contains(&own)
                && status.message().contains(&format!("node {member}"))
                && status.message().contains("no restore id"),
            "{status:?}"
        );
    };

    let mut lock = LockClient::new(channel(&cluster, leader, Some(&cert)));
    let status = lock
        .acquire(forwarded(member, None, acquire("legacy/forward")))
        .await
        .map(|r| r.into_inner())
        .expect_err("a forwarded Acquire without the incarnation id was granted");
    refused(&status);
    assert!(!held(&cluster, leader, "legacy/forward").await);

    let mut admin = ClusterClient::new(channel(&cluster, leader, Some(&cert)));
    let backup = match admin
        .save_snapshot(forwarded(member, None, SaveSnapshotRequest {}))
        .await
    {
        Ok(stream) => stream.into_inner().message().await.map(|m| m.is_some()),
        Err(status) => Err(status),
    };
    refused(&backup.expect_err("a forwarded SaveSnapshot without the incarnation id streamed"));

    let granted = lock
        .acquire(forwarded(member, Some(&own), acquire("legacy/own")))
        .await
        .expect("a forwarded Acquire with the cluster's incarnation id is granted")
        .into_inner();
    assert!(granted.fencing_token > 0);
}
