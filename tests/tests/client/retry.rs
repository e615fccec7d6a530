//! What the client concludes from a repeated request id and from answers after a retry: a grant
//! learnt by repeating a request id is confirmed before it is handed out, a refusal that speaks
//! for one attempt only does not say "not granted" after an earlier attempt may have been, and a
//! release retried after a lost reply does not claim that nothing was released.

use std::time::Duration;

use lockd_api::v1::AcquireRequest;
use lockd_client::{AcquireOptions, Client, ClientConfig, Error, RequestId};
use lockd_tests::chaos::relay::Relay;
use lockd_tests::cluster::{Cluster, ClusterOptions};
use tokio::time::{Instant, sleep};

use crate::{TTL, client, describe, endpoints, run_lockctl, serial};

/// A relay on a free loopback port in front of node `id` of `cluster`, passing everything until
/// told to drop replies.
async fn relay_to(cluster: &Cluster, id: u64) -> Relay {
    let port = lockd_tests::pg::free_port();
    Relay::start(
        format!("127.0.0.1:{port}").parse().unwrap(),
        cluster.addr(id).parse().unwrap(),
    )
    .await
    .unwrap()
}

/// Goal (review "clients" finding 1): a lease learnt by repeating the request id of an earlier
/// call is not handed out on a deadline counted from the repeat: the grant may be most of a ttl
/// old. Method: acquire with request id X and a 2 s ttl, "lose" the result, repeat `lock()` with
/// X at 85 % of the ttl; then let B try to take the resource for 2.5 s. B must never be granted
/// while A's guard still says it holds the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_clients_finding1_a_repeated_request_id_never_hands_out_an_expiring_grant() {
    let _serial = serial().await;
    let cluster = Cluster::start_default().await.unwrap();
    let a = client(&cluster);
    let id = RequestId::random();
    let opts = || AcquireOptions::default().ttl(TTL).request_id(id.clone());
    let first = a.acquire("repeat/1", opts()).await.unwrap();
    let token = first.fencing_token;
    drop(first);
    sleep(TTL * 17 / 20).await;

    let guard = a.lock("repeat/1", opts()).await.unwrap();
    assert_eq!(
        guard.fencing_token(),
        token,
        "the repeat returns the same grant"
    );
    let lost = guard.lost();

    let b = client(&cluster);
    let until = Instant::now() + TTL + TTL / 4;
    while Instant::now() < until {
        match b
            .acquire("repeat/1", AcquireOptions::default().ttl(TTL))
            .await
        {
            Ok(lease) => {
                assert!(
                    lost.is_lost(),
                    "B was granted token {} while A's guard of token {token} still claims the \
                     lease (A's guard deadline counted from the repeat, not from the grant)",
                    lease.fencing_token
                );
                break;
            }
            Err(Error::Held { .. }) => sleep(Duration::from_millis(50)).await,
            Err(e) => panic!("B acquire: {e}"),
        }
    }
    assert!(!lost.is_lost(), "{:?}", lost.reason());
    assert!(guard.release().await.unwrap());
}

/// Goal (review "clients" finding 1): a request id repeated after its grant expired does not
/// return that grant as a live lease, but says that nothing is held. Method: acquire with request
/// id X and a 2 s ttl, wait past the ttl, `acquire` and `lock` again with X: both fail with
/// `NotFound`, whose message names the token and tells to use a new request id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_clients_finding1_a_repeat_after_expiry_says_nothing_is_held() {
    let _serial = serial().await;
    let cluster = Cluster::start_default().await.unwrap();
    let a = client(&cluster);
    let id = RequestId::random();
    let opts = || AcquireOptions::default().ttl(TTL).request_id(id.clone());
    let first = a.acquire("repeat/2", opts()).await.unwrap();
    sleep(TTL + TTL / 2).await;
    assert!(!describe(&a, "repeat/2").await.held, "the lease expired");

    for how in ["acquire", "lock"] {
        let err = if how == "acquire" {
            a.acquire("repeat/2", opts()).await.map(|_| ()).unwrap_err()
        } else {
            a.lock("repeat/2", opts()).await.map(|_| ()).unwrap_err()
        };
        assert!(matches!(err, Error::NotFound { .. }), "{how}: {err:?}");
        let text = err.to_string();
        assert!(
            text.contains(&first.fencing_token.0.to_string()) && text.contains("new request id"),
            "{how}: {text}"
        );
        assert!(err.is_definitely_not_granted(), "{how}: nothing is held");
    }
}

/// Goal (review "clients" finding 2): a refusal that a node decides before it looks the request id
/// up (here the bound on parked waits per source address) does not end a call as "not granted"
/// when an earlier attempt of it may have been granted. Method: three nodes with
/// `--waits-per-source-max 2`; P holds "r"; two waits from this address park on node 1; X acquires
/// "r" (wait 3 s) through [a relay to node 2 that drops replies, node 1]; P releases, so X's first
/// attempt is granted but its reply lost; the retry on node 1 is refused `RESOURCE_EXHAUSTED`.
/// Describe shows X's grant; the client must say `OutcomeUnknown` with X's request id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_clients_finding2_a_refusal_after_a_lost_grant_is_outcome_unknown() {
    let _serial = serial().await;
    let options = ClusterOptions {
        extra_args: vec!["--waits-per-source-max".into(), "2".into()],
        ..ClusterOptions::default()
    };
    let cluster = Cluster::start(options).await.unwrap();
    let admin = client(&cluster);
    let p = admin
        .acquire(
            "refuse/r",
            AcquireOptions::default().ttl(Duration::from_secs(30)),
        )
        .await
        .unwrap();
    admin
        .acquire(
            "refuse/f",
            AcquireOptions::default().ttl(Duration::from_secs(30)),
        )
        .await
        .unwrap();
    // Two waits parked on node 1 from this address: its per-source bound is full.
    let mut fillers = Vec::new();
    for i in 0..2 {
        let mut c = cluster.lock_client(1).await.unwrap();
        fillers.push(tokio::spawn(async move {
            c.acquire(AcquireRequest {
                resource: "refuse/f".into(),
                request_id: format!("filler-{i}"),
                lease_ttl_ms: 30_000,
                wait_timeout_ms: 60_000,
                holder: "filler".into(),
            })
            .await
        }));
    }
    crate::eventually("two fillers queued", crate::PROMPTLY, || async {
        describe(&admin, "refuse/f").await.waiters == 2
    })
    .await;

    let relay = relay_to(&cluster, 2).await;
    let mut config = ClientConfig::new([relay.listen.to_string(), cluster.addr(1)]);
    config.attempt_timeout = Duration::from_secs(1);
    let x = Client::with_config(config).unwrap();
    // Connect through the relay while it still passes replies.
    x.status().await.unwrap();
    relay.set_drop_replies(true);
    let id = RequestId::random();
    let acquiring = {
        let x = x.clone();
        let id = id.clone();
        tokio::spawn(async move {
            x.acquire(
                "refuse/r",
                AcquireOptions::default()
                    .ttl(Duration::from_secs(30))
                    .wait(Duration::from_secs(3))
                    .request_id(id),
            )
            .await
        })
    };
    crate::eventually("X queued behind P", crate::PROMPTLY, || async {
        describe(&admin, "refuse/r").await.waiters == 1
    })
    .await;
    assert!(admin.release("refuse/r", &p.lease_id).await.unwrap());
    let result = acquiring.await.unwrap();

    let d = describe(&admin, "refuse/r").await;
    assert!(
        d.held && d.fencing_token > p.fencing_token.0,
        "X's first attempt was granted: {d:?}"
    );
    match result {
        Err(Error::OutcomeUnknown { request_id, .. }) => {
            assert_eq!(
                request_id.as_ref().map(RequestId::as_str),
                Some(id.as_str())
            );
        }
        other => panic!(
            "X was granted token {} but the client said {other:?}",
            d.fencing_token
        ),
    }
    for f in fillers {
        f.abort();
    }
}

/// Goal (review "clients" finding 5): `lockctl release` retried after a lost reply does not claim
/// that nothing was released: the first attempt released the lease. Method: hold a lease, run
/// `lockctl release` through [a relay to node 2 that drops replies, node 1]; the first attempt
/// releases, its reply is lost, the retry answers `released=false`. lockctl must exit with the
/// outcome-unknown code (8) and say that an earlier attempt may have released it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_clients_finding5_release_after_a_lost_reply_is_not_nothing_released() {
    let _serial = serial().await;
    let cluster = Cluster::start_default().await.unwrap();
    let a = client(&cluster);
    let lease = a
        .acquire(
            "release/1",
            AcquireOptions::default().ttl(Duration::from_secs(60)),
        )
        .await
        .unwrap();
    let relay = relay_to(&cluster, 2).await;
    relay.set_drop_replies(true);
    let eps = format!("{},{}", relay.listen, endpoints(&cluster)[0]);
    let run = run_lockctl(&eps, &["release", "release/1", lease.lease_id.as_str()]).await;
    assert!(
        !describe(&a, "release/1").await.held,
        "the first attempt released"
    );
    run.fails(8, &["release/1", "may have released"]);
    assert!(
        !run.stderr.contains(lease.lease_id.as_str()),
        "full lease id printed: {}",
        run.stderr
    );
}
