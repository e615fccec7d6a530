//! A plaintext loopback port (no TLS, no `--insecure-plaintext`) serves the cluster's internal
//! services only to processes of the node's own user, by the kernel's word on who owns the
//! connecting socket (as Postgres' `peer` authentication): the Raft service (`CurrentVote`
//! included), the forward stream, and the forwarding headers on the Lock and Cluster services.
//! Ordinary client calls stay open to every local user, as before.
//!
//! The other user is this test binary itself, run again as uid 65534 with [`PROBE_ENV`] set:
//! it runs [`foreign_user_probe`], which makes the calls and prints one line per call.

use std::time::Duration;

use lockd_api::v1::cluster_client::ClusterClient;
use lockd_api::v1::lock_client::LockClient;
use lockd_api::v1::{
    AcquireRequest, AddMemberRequest, DescribeRequest, StatusRequest, TransferLeaderRequest,
};
use lockd_server::raft::TypeConfig;
use lockd_server::service::raft::ElectRequest;
use lockd_server::service::raft::pb::forward_client::ForwardClient;
use lockd_server::service::raft::pb::raft_client::RaftClient;
use lockd_server::service::raft::pb::{ForwardBatch, RaftMessage, forward_reply};
use lockd_tests::cluster::Cluster;
use openraft::raft::{AppendEntriesRequest, InstallSnapshotRequest, VoteRequest};
use openraft::{CommittedLeaderId, LogId, SnapshotMeta, StoredMembership, Vote};
use tonic::transport::Channel;

/// Set in the environment of the probe process: what it should call (see [`Spec`]).
const PROBE_ENV: &str = "LOCKD_TEST_LOOPBACK_PROBE";
/// The user the probe runs as: `nobody` on most systems, never the nodes' user here.
pub(crate) const FOREIGN_UID: u32 = 65534;
/// The probe's full test name, as `--exact` takes it.
const PROBE_TEST: &str = "loopback::foreign_user_probe";
/// The cluster id of a default test cluster (no TLS).
const CLUSTER_ID: &str = "lockd";
/// Calls the probe makes that only members may make; each must be refused after the fix.
const INTERNAL: &[&str] = &[
    "current_vote",
    "forward_stream",
    "lock_forwarded_by",
    "lock_forwarded_identity",
    "cluster_forwarded_by",
    "vote",
    "elect",
    "install_snapshot",
    "append_entries",
    "transfer_leader",
    "add_member",
];
/// Calls any local user may make; each must keep working.
const CLIENT: &[&str] = &["client_acquire", "client_status"];

/// What the probe process is told: the leader (id and address), a follower's address, and all
/// client endpoints, separated by spaces.
struct Spec {
    leader_id: u64,
    leader: String,
    follower: String,
    endpoints: Vec<String>,
}

impl Spec {
    fn encode(&self) -> String {
        format!(
            "{} {} {} {}",
            self.leader_id,
            self.leader,
            self.follower,
            self.endpoints.join(",")
        )
    }

    fn decode(s: &str) -> Spec {
        let parts: Vec<&str> = s.split(' ').collect();
        Spec {
            leader_id: parts[0].parse().unwrap(),
            leader: parts[1].to_owned(),
            follower: parts[2].to_owned(),
            endpoints: parts[3].split(',').map(str::to_owned).collect(),
        }
    }
}

fn channel(addr: &str) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .connect_lazy()
}

/// A request with the headers a member's Raft message carries: the cluster id and, when known,
/// the cluster incarnation id (read from `CurrentVote`, as an attacker would).
fn member_request<T>(msg: T, incarnation: Option<&str>) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    req.metadata_mut()
        .insert("lockd-cluster-id", CLUSTER_ID.parse().unwrap());
    if let Some(id) = incarnation {
        req.metadata_mut()
            .insert("lockd-restore-id", id.parse().unwrap());
    }
    req.set_timeout(Duration::from_secs(3));
    req
}

/// One line the parent reads: `PROBE <name> <code> <message>`.
pub(crate) fn report<T>(
    name: &str,
    outcome: Result<T, tonic::Status>,
    ok: impl FnOnce(T) -> String,
) {
    let (code, message) = match outcome {
        Ok(v) => ("Ok".to_owned(), ok(v)),
        Err(s) => (format!("{:?}", s.code()), s.message().to_owned()),
    };
    println!("PROBE {name} {code} {}", message.replace('\n', " "));
}

/// Not a test by itself: what a process of another user tries against a plaintext loopback
/// cluster, started by [`review_loopback_another_local_user_reaches_no_internal_service`] with
/// [`PROBE_ENV`] set. Without the variable (an ordinary run) it returns at once.
#[tokio::test(flavor = "current_thread")]
async fn foreign_user_probe() {
    let Ok(spec) = std::env::var(PROBE_ENV) else {
        return;
    };
    let spec = Spec::decode(&spec);
    let leader = spec.leader_id;

    // The cluster's incarnation id, vote and last log id: read-only, and all an attacker needs
    // to make its forged messages pass the incarnation check.
    let vote = RaftClient::new(channel(&spec.leader))
        .current_vote(member_request(RaftMessage { data: Vec::new() }, None))
        .await
        .map(|r| r.into_inner());
    let incarnation = vote.as_ref().ok().and_then(|r| r.restore_id.clone());
    report("current_vote", vote, |r| {
        format!("answered: restore_id {:?}", r.restore_id)
    });

    // Ordinary client calls, through the client library and plain stubs.
    let client = lockd_client::Client::new(spec.endpoints.clone()).unwrap();
    let acquired = client
        .acquire(
            "foreign/client",
            lockd_client::AcquireOptions::default().ttl(Duration::from_secs(30)),
        )
        .await
        .map_err(|e| tonic::Status::unknown(e.to_string()));
    report("client_acquire", acquired, |l| {
        format!("token {}", l.fencing_token.0)
    });
    let status = ClusterClient::new(channel(&spec.follower))
        .status(StatusRequest {})
        .await;
    report("client_status", status, |r| {
        format!("leader {}", r.into_inner().leader_id)
    });

    // Admin calls: they hand the cluster to whoever makes them (`lockd dev` allows membership
    // changes without a policy), so another user's process may make none.
    let transfer = ClusterClient::new(channel(&spec.follower))
        .transfer_leader(TransferLeaderRequest { id: 0 })
        .await;
    report("transfer_leader", transfer, |r| {
        format!("leader {}", r.into_inner().leader_id)
    });
    let add = ClusterClient::new(channel(&spec.leader))
        .add_member(AddMemberRequest {
            id: 9,
            address: "127.0.0.1:1".into(),
        })
        .await;
    report("add_member", add, |_| "added".to_owned());

    // The forward stream: an Acquire as a follower forwards it.
    let call = super::replication::forwarded_acquire(7, None, "foreign/forward", "foreign-fwd");
    let mut req = member_request(
        futures::stream::iter([ForwardBatch { calls: vec![call] }]),
        incarnation.as_deref(),
    );
    req.metadata_mut()
        .insert("lockd-peer-protocol", "3".parse().unwrap());
    let forwarded = async {
        let mut replies = ForwardClient::new(channel(&spec.leader))
            .calls(req)
            .await?
            .into_inner();
        let batch = replies.message().await?;
        Ok(format!("{batch:?}"))
    }
    .await;
    report("forward_stream", forwarded, |b| {
        format!("answered: {}", b.chars().take(200).collect::<String>())
    });

    // The forwarding headers on the client services.
    let mut req = tonic::Request::new(AcquireRequest {
        resource: "foreign/forwarded-by".into(),
        request_id: "foreign-forwarded-by".into(),
        lease_ttl_ms: 30_000,
        wait_timeout_ms: 0,
        holder: "foreign".into(),
    });
    let other = (1..=3).find(|i| *i != leader).unwrap();
    req.metadata_mut()
        .insert("lockd-forwarded-by", other.to_string().parse().unwrap());
    let r = LockClient::new(channel(&spec.leader)).acquire(req).await;
    report("lock_forwarded_by", r, |r| {
        format!("token {}", r.into_inner().fencing_token)
    });
    let mut req = tonic::Request::new(DescribeRequest {
        resource: "foreign/client".into(),
    });
    req.metadata_mut().insert_bin(
        "lockd-forwarded-identity-bin",
        tonic::metadata::MetadataValue::from_bytes(b"cert:admin"),
    );
    let r = LockClient::new(channel(&spec.leader)).describe(req).await;
    report("lock_forwarded_identity", r, |r| {
        format!("held {}", r.into_inner().held)
    });
    let mut req = tonic::Request::new(StatusRequest {});
    req.metadata_mut()
        .insert("lockd-forwarded-by", other.to_string().parse().unwrap());
    let r = ClusterClient::new(channel(&spec.leader)).status(req).await;
    report("cluster_forwarded_by", r, |r| {
        format!("leader {}", r.into_inner().leader_id)
    });

    // Raft messages to a follower, as the leader in term 1000 (the last one, AppendEntries,
    // moves the follower's term if it is accepted).
    let raft = |method: &'static str, data: Vec<u8>| {
        let mut client = RaftClient::new(channel(&spec.follower));
        let req = member_request(RaftMessage { data }, incarnation.as_deref());
        async move {
            let r = match method {
                "vote" => client.vote(req).await,
                "elect" => client.elect(req).await,
                "install_snapshot" => client.install_snapshot(req).await,
                _ => client.append_entries(req).await,
            };
            report(method, r, |r| {
                format!("answered ({} bytes)", r.into_inner().data.len())
            });
        }
    };
    let vote = VoteRequest::<u64>::new(
        Vote::new(1000, leader),
        Some(LogId::new(CommittedLeaderId::new(999, leader), 1_000_000)),
    );
    raft("vote", postcard::to_allocvec(&vote).unwrap()).await;
    let elect = ElectRequest { leader, term: 1000 };
    raft("elect", postcard::to_allocvec(&elect).unwrap()).await;
    let snapshot = InstallSnapshotRequest::<TypeConfig> {
        vote: Vote::new_committed(1000, leader),
        meta: SnapshotMeta {
            last_log_id: Some(LogId::new(CommittedLeaderId::new(999, leader), 1_000_000)),
            last_membership: StoredMembership::default(),
            snapshot_id: "forged".into(),
        },
        offset: 0,
        // Not a snapshot at all: sent only to see whether it is read.
        data: b"forged".to_vec(),
        done: false,
    };
    raft(
        "install_snapshot",
        postcard::to_allocvec(&snapshot).unwrap(),
    )
    .await;
    let append = AppendEntriesRequest::<TypeConfig> {
        vote: Vote::new_committed(1000, leader),
        prev_log_id: None,
        entries: Vec::new(),
        leader_commit: None,
    };
    raft("append_entries", postcard::to_allocvec(&append).unwrap()).await;
}

/// The outcomes the probe reported, by call name: (code, message).
pub(crate) type Outcomes = std::collections::HashMap<String, (String, String)>;

/// Runs [`foreign_user_probe`] as uid [`FOREIGN_UID`] against `spec`; `Err` with the reason
/// when this machine cannot run a process as another user.
async fn probe_as_another_user(spec: &Spec) -> Result<Outcomes, String> {
    run_probe_as_another_user(
        PROBE_TEST,
        PROBE_ENV,
        &spec.encode(),
        INTERNAL.len() + CLIENT.len(),
    )
    .await
}

/// Whether this process may start one as uid [`FOREIGN_UID`] (it runs as root). If not, the
/// test is reported skipped, or fails under CI, where it must run.
pub(crate) fn can_run_as_another_user() -> bool {
    let own_uid = nix::unistd::geteuid().as_raw();
    if own_uid == 0 {
        return true;
    }
    skip_outside_ci(&format!(
        "runs a process as uid {FOREIGN_UID}, which needs root (running as uid {own_uid})"
    ));
    false
}

/// Reports the test skipped for `why`, or fails it under CI, where it must run.
pub(crate) fn skip_outside_ci(why: &str) {
    assert!(
        std::env::var_os("CI").is_none(),
        "{why}; CI is set, so this test fails instead of skipping"
    );
    lockd_tests::skip::report(why);
}

/// Runs this test binary's test `probe_test` as uid [`FOREIGN_UID`] with `env=value` in its
/// environment, and collects the `PROBE` lines it prints ([`report`]); it must print `expected`
/// of them. `Err` with the reason when this machine cannot run a process as another user.
pub(crate) async fn run_probe_as_another_user(
    probe_test: &str,
    env: &str,
    value: &str,
    expected: usize,
) -> Result<Outcomes, String> {
    use std::os::unix::fs::PermissionsExt;
    let own = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    // A copy the other user can reach: the checkout (and so this binary) may sit in a home
    // directory other users cannot enter.
    let dir = tempfile::tempdir().map_err(|e| format!("temporary directory: {e}"))?;
    let exe = dir.path().join("probe");
    std::fs::copy(&own, &exe).map_err(|e| format!("copying {}: {e}", own.display()))?;
    for (path, mode) in [(dir.path(), 0o755), (exe.as_path(), 0o755)] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .map_err(|e| format!("chmod {}: {e}", path.display()))?;
    }
    let mut cmd = tokio::process::Command::new(&exe);
    cmd.args([probe_test, "--exact", "--nocapture", "--test-threads", "1"])
        .current_dir(dir.path())
        .env(env, value)
        .env("RUST_LOG", "off")
        .uid(FOREIGN_UID)
        .gid(FOREIGN_UID)
        .kill_on_drop(true);
    let out = match tokio::time::timeout(Duration::from_secs(120), cmd.output()).await {
        Err(_) => panic!("the probe as uid {FOREIGN_UID} did not end within 120 s"),
        Ok(Err(e)) => {
            return Err(format!(
                "cannot run {} as uid {FOREIGN_UID}: {e}",
                exe.display()
            ));
        }
        Ok(Ok(out)) => out,
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let outcomes: Outcomes = stdout
        .lines()
        // libtest prints the first line after "test <name> ... ".
        .filter_map(|l| l.find("PROBE ").map(|at| &l[at + "PROBE ".len()..]))
        .filter_map(|l| {
            let mut parts = l.splitn(3, ' ');
            Some((
                parts.next()?.to_owned(),
                (
                    parts.next()?.to_owned(),
                    parts.next().unwrap_or("").to_owned(),
                ),
            ))
        })
        .collect();
    assert!(
        out.status.success() && outcomes.len() == expected,
        "the probe as uid {FOREIGN_UID} failed ({}): stdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(outcomes)
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

/// Goal: on a plaintext loopback cluster (no TLS, no `--insecure-plaintext`; the contract's
/// `lockd --listen 127.0.0.1:7001 --peer ...` and `lockd dev`), another local user (or a remote
/// client behind a TLS terminator, sidecar or tunnel on the host) can call none of the
/// internal services: it learns no incarnation id, vote or log id from `CurrentVote`, sends no
/// AppendEntries, Vote, InstallSnapshot or Elect, forwards nothing on the forward stream, and
/// marks no client call as forwarded; its ordinary client calls still work (adversarial review
/// of the loopback mode: before, all of these were answered, and an AppendEntries with the
/// incarnation id read from `CurrentVote` moved a follower to the attacker's term).
/// Method: a default test cluster (root here); this binary run again as uid 65534 makes every
/// call once ([`foreign_user_probe`]); each internal call must be refused with UNAUTHENTICATED
/// naming both uids, terms and leaders must not move, nothing forwarded may be held; the client
/// calls must succeed. Control: the same `CurrentVote` from this process (the nodes' own user)
/// is answered. Skipped when not root (fails instead under CI).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_loopback_another_local_user_reaches_no_internal_service() {
    if !can_run_as_another_user() {
        return;
    }
    let own_uid = nix::unistd::geteuid().as_raw();
    let mut cluster = Cluster::start_default().await.unwrap();
    let leader = cluster.leader().await.unwrap();
    let follower = (1..=3).find(|i| *i != leader).unwrap();
    let before = terms(&cluster).await;
    let spec = Spec {
        leader_id: leader,
        leader: cluster.addr(leader),
        follower: cluster.addr(follower),
        endpoints: (1..=3).map(|i| cluster.addr(i)).collect(),
    };
    let outcomes = match probe_as_another_user(&spec).await {
        Ok(o) => o,
        Err(why) => {
            skip_outside_ci(&why);
            return;
        }
    };
    let mut answered = Vec::new();
    for name in INTERNAL {
        let (code, message) = &outcomes[*name];
        if code == "Ok" || !matches!(code.as_str(), "Unauthenticated" | "PermissionDenied") {
            answered.push(format!("{name}: {code} {message}"));
            continue;
        }
        assert!(
            message.contains(&format!("uid {own_uid}"))
                && message.contains(&format!("uid {FOREIGN_UID}")),
            "{name}: the refusal names both users: {message}"
        );
    }
    assert!(
        answered.is_empty(),
        "a process of uid {FOREIGN_UID} reached the internal services of a plaintext loopback \
         node of uid {own_uid}:\n  {}",
        answered.join("\n  ")
    );
    for name in CLIENT {
        let (code, message) = &outcomes[*name];
        assert_eq!(code, "Ok", "{name} from uid {FOREIGN_UID}: {message}");
    }

    // Nothing moved: give the refused messages time to do harm had they been taken.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(before, terms(&cluster).await, "terms or leaders moved");
    let held = |resource: &'static str| {
        let cluster = &cluster;
        async move {
            cluster
                .lock_client(leader)
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
    };
    assert!(!held("foreign/forward").await);
    assert!(!held("foreign/forwarded-by").await);
    assert!(held("foreign/client").await);

    // Control: the nodes' own user gets CurrentVote, and a member's forward stream, as before.
    let own = RaftClient::new(channel(&cluster.addr(follower)))
        .current_vote(member_request(RaftMessage { data: Vec::new() }, None))
        .await
        .expect("CurrentVote from the nodes' own user is answered")
        .into_inner();
    let call = super::replication::forwarded_acquire(8, None, "own/forward", "own-fwd");
    let mut req = member_request(
        futures::stream::iter([ForwardBatch { calls: vec![call] }]),
        own.restore_id.as_deref(),
    );
    req.metadata_mut()
        .insert("lockd-peer-protocol", "3".parse().unwrap());
    let mut replies = ForwardClient::new(channel(&cluster.addr(leader)))
        .calls(req)
        .await
        .expect("the nodes' own user opens a forward stream")
        .into_inner();
    let batch = replies.message().await.unwrap().unwrap();
    assert!(
        matches!(
            &batch.replies[0].result,
            Some(forward_reply::Result::Acquire(a)) if a.fencing_token > 0
        ),
        "{batch:?}"
    );
    assert!(held("own/forward").await);
}
