//! fence-proxy's HTTP front end: fence checks, token order across two proxy processes
//! sharing the Postgres store, faults, restart with the redb store, and end to end with lockd.
//!
//! Every test starts a real HTTP upstream that logs the requests it applied, in order, and real
//! `fence-proxy` processes. Postgres tests use a table of their own, so tests run in parallel.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use lockd_tests::fence_proxy::{FenceProxy, Reply};
use lockd_tests::http_upstream::{BodyEvent, DELAY_HEADER, EarlyAnswerUpstream, HttpUpstream};
use lockd_tests::pg;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A table of the shared Postgres that is dropped when the test ends.
struct PgTable {
    name: String,
}

impl PgTable {
    fn new(prefix: &str) -> PgTable {
        pg::require_postgres();
        PgTable {
            name: pg::unique_name(prefix),
        }
    }

    fn store(&self) -> String {
        pg::direct_url()
    }
}

impl Drop for PgTable {
    fn drop(&mut self) {
        let sql = format!("DROP TABLE IF EXISTS {}", self.name);
        let _ = std::process::Command::new("psql")
            .args([
                "-q",
                "-X",
                "-h",
                pg::PG_HOST,
                "-U",
                pg::PG_USER,
                "-d",
                pg::PG_DATABASE,
            ])
            .args(["-c", &sql])
            .output();
    }
}

fn redb_store(dir: &tempfile::TempDir) -> String {
    format!("redb:{}", dir.path().join("epochs.redb").display())
}

async fn put(proxy: &FenceProxy, resource: &str, token: &str, body: &str) -> Reply {
    proxy
        .write("PUT", "/obj", (Some(resource), Some(token)), &[], body)
        .await
        .unwrap()
}

/// A refusal as RFC 9457 describes a problem: `application/problem+json` with `type`, `title`,
/// `status` and `detail`, plus the reason in the header and in `error`.
fn assert_refused(reply: &Reply, status: u16, reason: &str) {
    assert_eq!(reply.status, status, "{reply:?}");
    assert_eq!(reply.proxy_error(), Some(reason), "{reply:?}");
    assert_eq!(
        reply
            .headers
            .get(hyper::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok()),
        Some("application/problem+json"),
        "{reply:?}"
    );
    let body = reply.json();
    assert_eq!(body["error"], reason, "{reply:?}");
    assert_eq!(
        body["type"],
        format!("urn:lockd:problem:{reason}"),
        "{reply:?}"
    );
    assert_eq!(body["status"], status, "{reply:?}");
    assert!(
        body["title"].as_str().is_some_and(|t| !t.is_empty()),
        "{reply:?}"
    );
    assert_eq!(body["detail"], body["message"], "{reply:?}");
}

/// The fence checks (stale, missing and malformed fences, pass-through reads, metrics),
/// against either store.
async fn fence_checks(store: &str, extra: &[&str]) {
    let upstream = HttpUpstream::start().await.unwrap();
    let proxy = FenceProxy::start(&upstream.url(), store, extra)
        .await
        .unwrap();
    let r = "orders/42";

    // Phase 1: accepted and recorded; every header, conditional ones included, and the body
    // reach the upstream.
    let reply = proxy
        .write(
            "PUT",
            "/orders/42?v=1",
            (Some(r), Some("5")),
            &[
                ("If-Match", "\"v1\""),
                ("If-Unmodified-Since", "Sat, 01 Jan 2000 00:00:00 GMT"),
                ("X-Custom", "c"),
            ],
            "five",
        )
        .await
        .unwrap();
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.proxy_error(), None);
    let w = upstream.writes();
    assert_eq!(w.len(), 1);
    assert_eq!(
        (w[0].method.as_str(), w[0].path.as_str()),
        ("PUT", "/orders/42?v=1")
    );
    assert_eq!(w[0].header("if-match"), Some("\"v1\""));
    assert_eq!(
        w[0].header("if-unmodified-since"),
        Some("Sat, 01 Jan 2000 00:00:00 GMT")
    );
    assert_eq!(w[0].header("x-custom"), Some("c"));
    assert_eq!((w[0].resource(), w[0].token()), (Some(r), Some(5)));
    assert_eq!(&w[0].body[..], b"five");

    // Phase 2: the same token again is accepted (the holder writes twice).
    assert_eq!(put(&proxy, r, "5", "five again").await.status, 200);
    assert_eq!(upstream.writes().len(), 2);

    // Phase 3: a lower token: 412 naming the values, not forwarded.
    let reply = put(&proxy, r, "4", "four").await;
    assert_refused(&reply, 412, "stale-fencing-token");
    let j = reply.json();
    assert_eq!(
        (
            j["resource"].as_str(),
            j["token"].as_u64(),
            j["highest"].as_u64()
        ),
        (Some(r), Some(4), Some(5))
    );
    assert_eq!(
        upstream.writes().len(),
        2,
        "a stale write reached the upstream"
    );

    // Phase 4: writes without the headers: 428, for every write method.
    for method in ["POST", "PUT", "PATCH", "DELETE"] {
        let reply = proxy
            .write(method, "/obj", (None, None), &[], "x")
            .await
            .unwrap();
        assert_refused(&reply, 428, "fence-required");
    }
    let reply = proxy
        .write("DELETE", "/obj", (Some(r), None), &[], "")
        .await
        .unwrap();
    assert_refused(&reply, 428, "fence-required");
    assert_eq!(reply.json()["resource"], r);

    // Phase 5: malformed fences: 400.
    for token in ["abc", "-1", "1.5", "18446744073709551616", ""] {
        let reply = put(&proxy, r, token, "x").await;
        assert_refused(&reply, 400, "bad-fence");
    }
    let long = "r".repeat(257);
    assert_refused(&put(&proxy, &long, "9", "x").await, 400, "bad-fence");
    assert_eq!(
        upstream.writes().len(),
        2,
        "a refused write reached the upstream"
    );

    // Phase 6: reads pass unchecked, with or without headers.
    let reply = lockd_tests::fence_proxy::get(&proxy.url("/orders/42"))
        .await
        .unwrap();
    assert_eq!(reply.status, 200, "{reply:?}");
    let reply = proxy
        .write("GET", "/x", (Some(r), Some("1")), &[], "")
        .await
        .unwrap();
    assert_eq!(
        reply.status, 200,
        "a read with a stale token is still a read: {reply:?}"
    );
    assert_eq!(upstream.applied().len(), 4);

    // Phase 7: a higher token is accepted; the metrics counted all of it.
    assert_eq!(
        proxy
            .write("PATCH", "/obj", (Some(r), Some("6")), &[], "")
            .await
            .unwrap()
            .status,
        200
    );
    let m = proxy.metrics().await.unwrap();
    for line in [
        r#"fence_proxy_requests_total{frontend="http",result="forwarded"} 3"#,
        r#"fence_proxy_requests_total{frontend="http",result="passthrough"} 2"#,
        r#"fence_proxy_requests_total{frontend="http",result="stale-fencing-token"} 1"#,
        r#"fence_proxy_requests_total{frontend="http",result="fence-required"} 5"#,
        r#"fence_proxy_requests_total{frontend="http",result="bad-fence"} 6"#,
        r#"fence_proxy_stale_rejections_total{frontend="http"} 1"#,
        r#"fence_proxy_forward_duration_seconds_count{frontend="http"} 5"#,
    ] {
        assert!(m.contains(line), "missing {line:?} in:\n{m}");
    }
}

/// Goal: the fence checks with the embedded store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_checks_with_redb_store() {
    let dir = tempfile::tempdir().unwrap();
    fence_checks(&redb_store(&dir), &[]).await;
}

/// Goal: the fence checks with the shared Postgres store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_checks_with_postgres_store() {
    let table = PgTable::new("fence_http_checks");
    fence_checks(&table.store(), &["--store-table", &table.name]).await;
}

/// Number of rounds of the ordering test; each round is one fresh resource.
const ORDER_ROUNDS: usize = 40;

/// Goal: with two proxy processes sharing the Postgres store, a slow upstream and concurrent
/// writers with tokens 41 and 42 on one resource, the upstream never applies 41 after 42.
/// Method: per round a fresh resource; the writer of 41 asks the upstream to take 40 ms to apply
/// (so without serialisation 42, fast, would overtake it), the writer of 42 none; each goes
/// through a different proxy (chosen at random) after a random 0-15 ms pause. Then check the
/// upstream's log per resource, and that both interleavings (41 forwarded first, or 41 refused
/// because 42 came first) happened, so the check had something to check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_proxies_on_postgres_never_apply_41_after_42() {
    use rand::RngExt;
    let table = PgTable::new("fence_http_order");
    let upstream = HttpUpstream::start().await.unwrap();
    let extra = ["--store-table", table.name.as_str(), "--lock-wait", "10s"];
    let a = FenceProxy::start(&upstream.url(), &table.store(), &extra)
        .await
        .unwrap();
    let b = FenceProxy::start(&upstream.url(), &table.store(), &extra)
        .await
        .unwrap();
    let prefix = pg::unique_name("order");

    let mut replies = Vec::new();
    for round in 0..ORDER_ROUNDS {
        let resource = format!("{prefix}/{round}");
        let (p41, p42) = if rand::rng().random_bool(0.5) {
            (&a, &b)
        } else {
            (&b, &a)
        };
        let (d41, d42) = (
            rand::rng().random_range(0..15u64),
            rand::rng().random_range(0..15u64),
        );
        let w41 = async {
            tokio::time::sleep(Duration::from_millis(d41)).await;
            p41.write(
                "PUT",
                "/obj",
                (Some(&resource), Some("41")),
                &[(DELAY_HEADER, "40")],
                "41",
            )
            .await
            .unwrap()
        };
        let w42 = async {
            tokio::time::sleep(Duration::from_millis(d42)).await;
            p42.write("PUT", "/obj", (Some(&resource), Some("42")), &[], "42")
                .await
                .unwrap()
        };
        let (r41, r42) = tokio::join!(w41, w42);
        assert_eq!(
            r42.status, 200,
            "round {round}: 42 must be accepted: {r42:?}"
        );
        assert!(
            r41.status == 200 || r41.status == 412,
            "round {round}: {r41:?}"
        );
        replies.push((resource, r41.status));
    }

    let mut per_resource: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for w in upstream.writes() {
        per_resource
            .entry(w.resource().unwrap().to_owned())
            .or_default()
            .push(w.token().unwrap());
    }
    let mut both_forwarded = 0;
    let mut stale_refused = 0;
    for (resource, status41) in &replies {
        let tokens = &per_resource[resource];
        let first_42 = tokens
            .iter()
            .position(|t| *t == 42)
            .expect("42 was applied");
        assert!(
            !tokens[first_42..].contains(&41),
            "{resource}: upstream applied 41 after 42: {tokens:?}"
        );
        match status41 {
            200 => {
                assert_eq!(tokens, &[41, 42], "{resource}");
                both_forwarded += 1;
            }
            _ => {
                assert_eq!(
                    tokens,
                    &[42],
                    "{resource}: a refused 41 reached the upstream"
                );
                stale_refused += 1;
            }
        }
    }
    eprintln!(
        "{ORDER_ROUNDS} rounds: 41 then 42 forwarded {both_forwarded}, 41 refused as stale {stale_refused}"
    );
    assert!(
        both_forwarded > 0 && stale_refused > 0,
        "only one interleaving happened (41 first: {both_forwarded}, 42 first: {stale_refused})"
    );
}

/// Goal: an unreachable epoch store fails closed: 503 store-unavailable and nothing forwarded;
/// reads, which need no store, still pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_unreachable_is_503_and_nothing_is_forwarded() {
    let upstream = HttpUpstream::start().await.unwrap();
    let dead = format!("postgres://postgres@127.0.0.1:{}/test", pg::free_port());
    let proxy = FenceProxy::start(&upstream.url(), &dead, &["--store-timeout", "500ms"])
        .await
        .unwrap();
    let started = Instant::now();
    let reply = put(&proxy, "orders/1", "3", "x").await;
    assert_refused(&reply, 503, "store-unavailable");
    let j = reply.json();
    assert_eq!(
        (j["resource"].as_str(), j["token"].as_u64()),
        (Some("orders/1"), Some(3))
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
    assert!(
        upstream.writes().is_empty(),
        "forwarded while the store was down"
    );
    let reply = lockd_tests::fence_proxy::get(&proxy.url("/orders/1"))
        .await
        .unwrap();
    assert_eq!(reply.status, 200, "{reply:?}");
}

/// Goal: an upstream that refuses connections gives 502 upstream-error, for writes and reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_down_is_502() {
    let dir = tempfile::tempdir().unwrap();
    let dead = format!("http://127.0.0.1:{}", pg::free_port());
    let proxy = FenceProxy::start(&dead, &redb_store(&dir), &[])
        .await
        .unwrap();
    let reply = put(&proxy, "orders/1", "3", "x").await;
    assert_refused(&reply, 502, "upstream-error");
    assert_eq!(reply.json()["token"], 3);
    let reply = lockd_tests::fence_proxy::get(&proxy.url("/x"))
        .await
        .unwrap();
    assert_refused(&reply, 502, "upstream-error");
    // The write was never delivered, so no quarantine: the next one goes straight to the store.
    let started = Instant::now();
    assert_refused(
        &put(&proxy, "orders/1", "4", "x").await,
        502,
        "upstream-error",
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "took {:?}",
        started.elapsed()
    );
}

/// Goal: an upstream slower than --upstream-timeout gives 504 upstream-timeout, and because the
/// upstream still applies that write later, the next write of the resource is held back by the
/// quarantine until after it: the upstream's log keeps token order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_too_slow_is_504_and_quarantine_keeps_order() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = HttpUpstream::start().await.unwrap();
    let proxy = FenceProxy::start(
        &upstream.url(),
        &redb_store(&dir),
        &[
            "--upstream-timeout",
            "300ms",
            "--quarantine",
            "2s",
            "--lock-wait",
            "5s",
        ],
    )
    .await
    .unwrap();
    let started = Instant::now();
    let reply = proxy
        .write(
            "PUT",
            "/obj",
            (Some("orders/1"), Some("1")),
            &[(DELAY_HEADER, "1000")],
            "late",
        )
        .await
        .unwrap();
    assert_refused(&reply, 504, "upstream-timeout");
    let timed_out = started.elapsed();
    assert!(
        timed_out < Duration::from_millis(900),
        "504 after {timed_out:?}"
    );

    let reply = put(&proxy, "orders/1", "2", "next").await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert!(
        started.elapsed() >= Duration::from_millis(2200),
        "quarantine skipped: {:?}",
        started.elapsed()
    );
    let tokens: Vec<_> = upstream
        .writes()
        .iter()
        .map(|w| w.token().unwrap())
        .collect();
    assert_eq!(
        tokens,
        [1, 2],
        "the late write must be applied before the next one"
    );

    // Another resource is not affected by the quarantine.
    let t = Instant::now();
    let reply = proxy
        .write(
            "PUT",
            "/obj",
            (Some("orders/2"), Some("1")),
            &[(DELAY_HEADER, "1000")],
            "late",
        )
        .await
        .unwrap();
    assert_refused(&reply, 504, "upstream-timeout");
    assert_eq!(put(&proxy, "orders/3", "1", "x").await.status, 200);
    assert!(
        t.elapsed() < Duration::from_millis(1500),
        "{:?}",
        t.elapsed()
    );
}

/// Goal: the redb store keeps the highest tokens across a kill -9 and restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redb_highest_tokens_survive_restart() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = HttpUpstream::start().await.unwrap();
    let mut proxy = FenceProxy::start(&upstream.url(), &redb_store(&dir), &[])
        .await
        .unwrap();
    assert_eq!(put(&proxy, "a", "7", "x").await.status, 200);
    assert_eq!(put(&proxy, "b", "9", "x").await.status, 200);

    proxy.kill();
    proxy.restart().await.unwrap();

    let reply = put(&proxy, "a", "6", "x").await;
    assert_refused(&reply, 412, "stale-fencing-token");
    assert_eq!(reply.json()["highest"], 7);
    assert_refused(
        &put(&proxy, "b", "8", "x").await,
        412,
        "stale-fencing-token",
    );
    assert_eq!(put(&proxy, "b", "9", "x").await.status, 200);
    assert_eq!(put(&proxy, "c", "1", "x").await.status, 200);
    assert_eq!(upstream.writes().len(), 4);
}

/// Goal: a zombie holder's write, end to end with lockd. A acquires (token t); A's lease expires;
/// B acquires (t' > t) and writes; A's delayed write gets 412; the upstream holds B's only.
/// Method: a real three-node lockd cluster, a 1 s lease for A that is never renewed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockd_end_to_end_stale_holder_is_fenced() {
    use lockd_api::v1::AcquireRequest;
    use lockd_tests::cluster::Cluster;

    let cluster = Cluster::start_default().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let upstream = HttpUpstream::start().await.unwrap();
    let proxy = FenceProxy::start(&upstream.url(), &redb_store(&dir), &[])
        .await
        .unwrap();
    let resource = pg::unique_name("e2e/orders");
    let acquire = |id: &str, wait_timeout_ms: u64| AcquireRequest {
        resource: resource.clone(),
        request_id: id.to_owned(),
        lease_ttl_ms: 1_000,
        wait_timeout_ms,
        holder: id.to_owned(),
    };

    // Phase 1: A acquires and prepares a write, then stalls past its lease.
    let mut lock_a = cluster.lock_client(1).await.unwrap();
    let a = lock_a.acquire(acquire("a", 0)).await.unwrap().into_inner();

    // Phase 2: B waits in lockd's queue, gets the lock when A's lease expires, and writes.
    let mut lock_b = cluster.lock_client(2).await.unwrap();
    let b = lock_b
        .acquire(acquire("b", 10_000))
        .await
        .unwrap()
        .into_inner();
    assert!(
        b.fencing_token > a.fencing_token,
        "{} !> {}",
        b.fencing_token,
        a.fencing_token
    );
    let reply = put(&proxy, &resource, &b.fencing_token.to_string(), "B").await;
    assert_eq!(reply.status, 200, "{reply:?}");

    // Phase 3: A wakes up and sends its delayed write: refused, naming B's token.
    let reply = put(&proxy, &resource, &a.fencing_token.to_string(), "A").await;
    assert_refused(&reply, 412, "stale-fencing-token");
    assert_eq!(reply.json()["highest"], b.fencing_token);

    let writes = upstream.writes();
    assert_eq!(writes.len(), 1, "{writes:?}");
    assert_eq!(&writes[0].body[..], b"B");
    assert_eq!(writes[0].token(), Some(b.fencing_token));
}

/// Opens a raw HTTP/1.1 write through the proxy whose body has `body_len` bytes, and sends only
/// `first` of them, so that the test decides when (and whether) the rest follows.
async fn open_trickling_write(
    proxy: &FenceProxy,
    resource: &str,
    token: u64,
    body_len: usize,
    first: &[u8],
) -> TcpStream {
    let mut s = TcpStream::connect(proxy.addr).await.unwrap();
    let head = format!(
        "PUT /obj HTTP/1.1\r\nHost: upstream\r\nLock-Resource: {resource}\r\n\
         Fencing-Token: {token}\r\nContent-Length: {body_len}\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(first).await.unwrap();
    s
}

/// Reads a response head from a raw connection and returns it.
async fn read_response_head(s: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut byte))
            .await
            .expect("no response head within 10 s")
            .unwrap();
        assert!(n > 0, "connection closed before a response head: {buf:?}");
        buf.push(byte[0]);
    }
    String::from_utf8_lossy(&buf).into_owned()
}

/// Waits (at most 10 s) until the upstream has seen the head of `token`'s write of `resource`.
async fn wait_started(upstream: &EarlyAnswerUpstream, resource: &str, token: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !upstream
        .events(resource)
        .iter()
        .any(|e| matches!(e, BodyEvent::Started { token: t, .. } if *t == token))
    {
        assert!(
            Instant::now() < deadline,
            "{resource}: token {token} never reached the upstream: {:?}",
            upstream.events(resource)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The oracle of the early-answer tests: once the head of a write with `newer` arrived at the
/// upstream, no body of a write with `older` may still be read to its end, or cut off, after it.
fn assert_older_body_ended_before_newer_started(
    events: &[BodyEvent],
    resource: &str,
    older: u64,
    newer: u64,
) {
    let started_newer = events
        .iter()
        .position(|e| matches!(e, BodyEvent::Started { token, .. } if *token == newer))
        .unwrap_or_else(|| panic!("{resource}: {newer} never started: {events:?}"));
    let late: Vec<_> = events[started_newer..]
        .iter()
        .filter(|e| {
            matches!(e, BodyEvent::Completed { token, .. } | BodyEvent::Truncated { token, .. }
                if *token == older)
        })
        .collect();
    assert!(
        late.is_empty(),
        "{resource}: the upstream was still reading {older}'s body after {newer}'s write started: \
         {events:?}"
    );
}

/// Goal: an upstream that answers 200 as soon as a request head arrives and
/// only then reads the body must never finish reading token 41's body after token 42's write
/// started: the permit of 41 is held until its body has been forwarded completely.
/// Method: 41 sends its head and a third of its body and then trickles the rest, 100 ms apart;
/// once the upstream has answered 41, 42 writes at full speed. The upstream logs, per request,
/// when the head arrived and when the body was read to its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_bypass8_trickling_body_of_41_is_not_overtaken_by_42() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = EarlyAnswerUpstream::start().await.unwrap();
    let proxy = FenceProxy::start(&upstream.url(), &redb_store(&dir), &[])
        .await
        .unwrap();
    let r = pg::unique_name("bypass8");
    let pieces: [&[u8]; 3] = [b"41:part-1;", b"41:part-2;", b"41:part-3;"];
    let body_len = pieces.iter().map(|p| p.len()).sum();

    // Phase 1: 41 is admitted and forwarded; the upstream answers it before reading its body.
    let mut s41 = open_trickling_write(&proxy, &r, 41, body_len, pieces[0]).await;
    wait_started(&upstream, &r, 41).await;

    // Phase 2: 42 writes while 41's body is still on its way.
    let url = proxy.url("/obj");
    let r42 = r.clone();
    let w42 = tokio::spawn(async move {
        lockd_tests::fence_proxy::send(
            "PUT",
            &url,
            &[("Lock-Resource", &r42), ("Fencing-Token", "42")],
            "42:whole",
        )
        .await
        .unwrap()
    });
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Phase 3: the rest of 41's body trickles in; 41 got the upstream's 200.
    for piece in &pieces[1..] {
        s41.write_all(piece).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let head = read_response_head(&mut s41).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let reply = w42.await.unwrap();
    assert_eq!(reply.status, 200, "{reply:?}");

    // Oracle: 41's body was read whole, and before 42's head arrived.
    let events = upstream.events(&r);
    assert!(
        events.contains(&BodyEvent::Completed {
            resource: r.clone(),
            token: 41,
            body: pieces.concat(),
        }),
        "{events:?}"
    );
    assert_older_body_ended_before_newer_started(&events, &r, 41, 42);
}

/// Goal: the other ways a write's exchange ends (see the test above): the permit is released then,
/// never earlier, and the resource is quarantined because the upstream holds a partial request.
/// Method: an early-answering upstream, `--upstream-timeout 1s --quarantine 1s`. Phase 1: 41's
/// client disconnects half-way through its body. Phase 2: 41's client stalls half-way past the
/// upstream timeout. Each time 42 writes meanwhile and must get 200 only after the upstream saw
/// 41's body end (cut off), and not before the quarantine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_bypass8_disconnect_or_stall_mid_body_holds_then_quarantines() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = EarlyAnswerUpstream::start().await.unwrap();
    let proxy = FenceProxy::start(
        &upstream.url(),
        &redb_store(&dir),
        &[
            "--upstream-timeout",
            "1s",
            "--quarantine",
            "1s",
            "--lock-wait",
            "8s",
        ],
    )
    .await
    .unwrap();

    for (phase, disconnect) in [("disconnect", true), ("stall", false)] {
        let r = pg::unique_name(&format!("bypass8-{phase}"));
        let s41 = open_trickling_write(&proxy, &r, 41, 20, b"41:half...").await;
        wait_started(&upstream, &r, 41).await;
        let cut = Instant::now();
        let s41 = if disconnect {
            drop(s41);
            None
        } else {
            Some(s41)
        };
        let reply = put(&proxy, &r, "42", "42:whole").await;
        let waited = cut.elapsed();
        assert_eq!(reply.status, 200, "{phase}: {reply:?}");
        // Disconnect: the quarantine (1 s). Stall: the exchange deadline (1 s) and the quarantine.
        let floor = if disconnect {
            Duration::from_millis(900)
        } else {
            Duration::from_millis(1800)
        };
        assert!(waited >= floor, "{phase}: 42 admitted after {waited:?}");
        let events = upstream.events(&r);
        assert!(
            events.iter().any(
                |e| matches!(e, BodyEvent::Truncated { token: 41, received, .. } if *received == 10)
            ),
            "{phase}: the upstream must see 41's body cut off: {events:?}"
        );
        assert_older_body_ended_before_newer_started(&events, &r, 41, 42);
        drop(s41);
    }
}

/// Waits (at most `within`) for the proxy to close `s`, and returns how long that took.
async fn closed_within(s: &mut TcpStream, within: Duration) -> Duration {
    let started = Instant::now();
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout(within.saturating_sub(started.elapsed()), s.read(&mut buf)).await
        {
            Err(_) => panic!("the proxy kept the connection open for {within:?}"),
            Ok(Ok(0)) | Ok(Err(_)) => return started.elapsed(),
            // A 408 or similar before the close is fine; keep reading until the close.
            Ok(Ok(_)) => {}
        }
    }
}

/// Goal (slowloris): a client that sends nothing, or trickles a request head, is
/// disconnected after `--header-read-timeout`, and the proxy keeps serving others.
/// Method: `--header-read-timeout 500ms`; one silent connection, one that sends half a head and
/// then one header byte every 100 ms; both must be closed between 0.4 s and 3 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_slowloris_header_read_timeout_closes_connections() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = HttpUpstream::start().await.unwrap();
    let proxy = FenceProxy::start(
        &upstream.url(),
        &redb_store(&dir),
        &["--header-read-timeout", "500ms"],
    )
    .await
    .unwrap();

    // Phase 1: a connection that never sends a byte.
    let mut silent = TcpStream::connect(proxy.addr).await.unwrap();
    // Phase 2: a connection that trickles its head.
    let mut trickle = TcpStream::connect(proxy.addr).await.unwrap();
    trickle
        .write_all(b"PUT /obj HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let trickler = tokio::spawn(async move {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(3) {
            if trickle.write_all(b"X").await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        closed_within(&mut trickle, Duration::from_secs(3)).await;
        started.elapsed()
    });
    let silent_for = closed_within(&mut silent, Duration::from_secs(3)).await;
    assert!(
        silent_for >= Duration::from_millis(400),
        "closed too early: {silent_for:?}"
    );
    let trickled_for = trickler.await.unwrap();
    assert!(
        trickled_for < Duration::from_secs(3),
        "a trickled head kept its connection for {trickled_for:?}"
    );

    // Phase 3: the proxy still serves complete requests.
    assert_eq!(put(&proxy, "slow/1", "1", "x").await.status, 200);
}

/// Goal: `--max-connections` bounds the client connections open at once; past it a new
/// connection is not served until one closes.
/// Method: `--max-connections 2`; two idle connections; a third client's write must not be
/// answered while they stay open, and must be answered once one of them closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_max_connections_caps_open_connections() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = HttpUpstream::start().await.unwrap();
    let proxy = FenceProxy::start(
        &upstream.url(),
        &redb_store(&dir),
        &["--max-connections", "2", "--header-read-timeout", "30s"],
    )
    .await
    .unwrap();
    // The start-up probe's connection may still be closing; let its slot come back.
    tokio::time::sleep(Duration::from_millis(200)).await;

    let idle_a = TcpStream::connect(proxy.addr).await.unwrap();
    let idle_b = TcpStream::connect(proxy.addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let url = proxy.url("/obj");
    let third = tokio::spawn(async move {
        lockd_tests::fence_proxy::send(
            "PUT",
            &url,
            &[("Lock-Resource", "cap/1"), ("Fencing-Token", "1")],
            "x",
        )
        .await
        .unwrap()
    });
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert!(
        !third.is_finished(),
        "a third connection was served past --max-connections 2"
    );
    assert!(upstream.writes().is_empty());

    drop(idle_a);
    let reply = tokio::time::timeout(Duration::from_secs(5), third)
        .await
        .expect("the third connection was not served after a slot freed up")
        .unwrap();
    assert_eq!(reply.status, 200, "{reply:?}");
    drop(idle_b);
}
