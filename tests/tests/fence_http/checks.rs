//! The fence checks with the redb and the Postgres store, and the order of tokens across two
//! proxies that share the Postgres store.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::{PgTable, assert_refused, put, redb_store};
use lockd_tests::fence_proxy::FenceProxy;
use lockd_tests::http_upstream::{DELAY_HEADER, HttpUpstream};
use lockd_tests::pg;

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
    lockd_tests::skip_without_postgres!();
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
    lockd_tests::skip_without_postgres!();
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

/// Attack (review, HIGH when the database's wall clock steps forward): after a write's outcome
/// was unknown (upstream timeout), the other replicas were held back only by `busy_until`, a
/// time on the database's wall clock. An NTP step forward (or a forged NTP answer) ends that
/// wait at once, while the upstream may still apply the old write. Method: two proxies on one
/// table; 41 through `a` takes the upstream 3 s, `a` gives up at 1 s (quarantine 4 s); then the
/// database's clock "jumps" (`busy_until` set an hour back) and 42 goes through `b`. Goal: `b`
/// still waits out `a`'s quarantine, timed on `a`'s own clock, so 41 lands before 42.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quarantine_outlasts_a_step_of_the_database_clock() {
    lockd_tests::skip_without_postgres!();
    let table = PgTable::new("fence_http_clock");
    let upstream = HttpUpstream::start().await.unwrap();
    let extra = [
        "--store-table",
        table.name.as_str(),
        "--lock-wait",
        "20s",
        "--upstream-timeout",
        "1s",
        "--quarantine",
        "4s",
    ];
    let a = FenceProxy::start(&upstream.url(), &table.store(), &extra)
        .await
        .unwrap();
    let b = FenceProxy::start(&upstream.url(), &table.store(), &extra)
        .await
        .unwrap();
    let resource = pg::unique_name("clock");
    let r41 = a
        .write(
            "PUT",
            "/obj",
            (Some(&resource), Some("41")),
            &[(DELAY_HEADER, "3000")],
            "41",
        )
        .await
        .unwrap();
    assert_refused(&r41, 504, "upstream-timeout");
    table.run(&format!(
        "UPDATE {} SET busy_until = now() - interval '1 hour' WHERE resource = '{resource}'",
        table.name
    ));
    let r42 = b
        .write("PUT", "/obj", (Some(&resource), Some("42")), &[], "42")
        .await
        .unwrap();
    assert_eq!(r42.status, 200, "{r42:?}");
    // Whatever came first, 41 has landed by now.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let tokens: Vec<u64> = upstream
        .writes()
        .iter()
        .filter(|w| w.resource() == Some(resource.as_str()))
        .map(|w| w.token().unwrap())
        .collect();
    assert_eq!(tokens, [41, 42], "the upstream applied 41 after 42");
}

/// Goal: the fence headers reach the upstream with every write the proxy forwards, as the docs
/// promise (an upstream that checks `Fencing-Token` itself is the remedy for writes it applies
/// late). Attack (found by review): a write that names them in `Connection` passed the check,
/// and the proxy then stripped them as hop-by-hop headers, so the upstream got an unfenced
/// write. Method: writes naming each fence header in `Connection`, alone and among others, in
/// any case; then a header of the client's own named there, which still goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_that_name_a_fence_header_in_connection_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = HttpUpstream::start().await.unwrap();
    let proxy = FenceProxy::start(&upstream.url(), &redb_store(&dir), &[])
        .await
        .unwrap();
    for connection in [
        "Fencing-Token",
        "keep-alive, lock-resource",
        "LOCK-SEQUENCER , x-other",
        "x-other,fencing-token",
    ] {
        let reply = proxy
            .write(
                "PUT",
                "/orders/7",
                (Some("orders/7"), Some("3")),
                &[("Connection", connection), ("X-Other", "1")],
                "w",
            )
            .await
            .unwrap();
        assert_refused(&reply, 400, "bad-fence");
        assert!(
            reply.json()["detail"]
                .as_str()
                .is_some_and(|d| d.contains("Connection")),
            "{connection}: {reply:?}"
        );
        assert!(
            upstream.writes().is_empty(),
            "Connection: {connection}: a write reached the upstream: {:?}",
            upstream.writes()
        );
    }
    let reply = proxy
        .write(
            "PUT",
            "/orders/7",
            (Some("orders/7"), Some("3")),
            &[("Connection", "x-private"), ("X-Private", "1")],
            "w",
        )
        .await
        .unwrap();
    assert_eq!(reply.status, 200, "{reply:?}");
    let w = upstream.writes();
    assert_eq!(w.len(), 1);
    assert_eq!((w[0].resource(), w[0].token()), (Some("orders/7"), Some(3)));
    assert_eq!(
        w[0].header("x-private"),
        None,
        "a hop-by-hop header went on"
    );
}

/// Attack (review, HIGH): the resource was only the request's label. A client holding
/// `orders/42` wrote `/orders/43` (or `/orders/42/../43`, `/orders/42/%2e%2e/43`,
/// `/orders/42;x` that some servers read as `/orders/42`...) fenced by its own lock, and the
/// proxy forwarded it. Goal: under `--bind-resource path` the resource must be the path, every
/// path an upstream could read as another is refused (400 bad-fence naming it, nothing
/// forwarded), and the upstream gets its own Host, not the client's; `path-prefix` also covers
/// the paths below the resource, at a `/` only. Reads are not affected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_bound_to_their_path_cannot_name_another_resource() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = HttpUpstream::start().await.unwrap();
    let proxy = FenceProxy::start(
        &upstream.url(),
        &redb_store(&dir),
        &["--bind-resource", "path"],
    )
    .await
    .unwrap();
    let fence = (Some("orders/42"), Some("5"));
    for path in [
        "/orders/43",
        "/orders/42/../43",
        "/orders/42/%2e%2e/43",
        "/orders%2F42",
        "/orders/42;x",
        "/orders//42",
        "/orders/42/",
        "/orders/42/items",
        "/orders/42.",
        "/orders/42|43",
    ] {
        let reply = proxy.write("PUT", path, fence, &[], "x").await.unwrap();
        assert_refused(&reply, 400, "bad-fence");
        let detail = reply.json()["detail"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(
            detail.contains(&format!("{path:?}")) && detail.contains("--bind-resource path"),
            "{path}: {detail}"
        );
    }
    assert!(upstream.writes().is_empty(), "{:?}", upstream.writes());

    // Headers that frameworks behind a trusted proxy take as the original host or URL.
    let routing = [
        ("Host", "other.example"),
        ("X-Forwarded-Host", "other.example"),
        ("Forwarded", "host=other.example"),
        ("X-Original-URL", "/orders/43"),
        ("X-Rewrite-URL", "/orders/43"),
        ("X-Forwarded-Prefix", "/other"),
        ("X-Forwarded-Uri", "/orders/43"),
        ("X-Script-Name", "/other"),
        ("X_Forwarded_Host", "other.example"),
        ("X-Original_URL", "/orders/43"),
    ];
    let reply = proxy
        .write("PUT", "/orders/42", fence, &routing, "x")
        .await
        .unwrap();
    assert_eq!(reply.status, 200, "{reply:?}");
    let writes = upstream.writes();
    assert_eq!(writes.len(), 1);
    assert_eq!(writes[0].path, "/orders/42");
    let upstream_authority = upstream.url().trim_start_matches("http://").to_owned();
    assert_eq!(writes[0].header("host"), Some(upstream_authority.as_str()));
    for (name, _) in &routing[1..] {
        assert_eq!(writes[0].header(name), None, "{name} reached the upstream");
    }
    // Reads pass whatever their path.
    let reply = lockd_tests::fence_proxy::get(&proxy.url("/orders/42/../43"))
        .await
        .unwrap();
    assert_eq!(reply.status, 200, "{reply:?}");

    let prefix = FenceProxy::start(
        &upstream.url(),
        &redb_store(&tempfile::tempdir().unwrap()),
        &["--bind-resource", "path-prefix"],
    )
    .await
    .unwrap();
    let reply = prefix
        .write("PUT", "/orders/42/items/7", fence, &[], "x")
        .await
        .unwrap();
    assert_eq!(reply.status, 200, "{reply:?}");
    for path in ["/orders/421", "/orders", "/orders/42/items/../../43"] {
        let reply = prefix.write("PUT", path, fence, &[], "x").await.unwrap();
        assert_refused(&reply, 400, "bad-fence");
    }
    assert_eq!(upstream.writes().len(), 2);
}

/// Attack (review, LOW): `Fencing-Token: 0042` is token 42 to the proxy, which ordered the write
/// by 42, but it went upstream as `0042`, which an upstream comparing text orders below `5`.
/// Goal: the upstream gets the admitted token in its one spelling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_forwarded_token_is_spelled_as_admitted() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = HttpUpstream::start().await.unwrap();
    let proxy = FenceProxy::start(&upstream.url(), &redb_store(&dir), &[])
        .await
        .unwrap();
    assert_eq!(put(&proxy, "orders/7", "0042", "x").await.status, 200);
    let reply = put(&proxy, "orders/7", "5", "x").await;
    assert_refused(&reply, 412, "stale-fencing-token");
    let writes = upstream.writes();
    assert_eq!(writes.len(), 1);
    assert_eq!(writes[0].header("fencing-token"), Some("42"));
}

/// Attack (third review): CGI, WSGI and Rack servers read `Fencing_Token` as `Fencing-Token`
/// (one variable, `HTTP_FENCING_TOKEN`). A write fenced by `Fencing-Token: 42` that also carried
/// `Fencing_Token: 999` (or `Lock_Resource: other`) went upstream with both, and such an upstream
/// may read the one the proxy never checked. Goal: refused, 400 bad-fence naming the header,
/// nothing forwarded; a header of the client's own with '_' still goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_headers_spelled_with_underscores_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = HttpUpstream::start().await.unwrap();
    let proxy = FenceProxy::start(&upstream.url(), &redb_store(&dir), &[])
        .await
        .unwrap();
    let fence = (Some("orders/9"), Some("42"));
    for (name, value) in [
        ("Fencing_Token", "999"),
        ("LOCK_RESOURCE", "orders/10"),
        ("lock_sequencer", "AAAA"),
    ] {
        let reply = proxy
            .write("PUT", "/obj", fence, &[(name, value)], "x")
            .await
            .unwrap();
        assert_refused(&reply, 400, "bad-fence");
        let detail = reply.json()["detail"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(detail.contains(&name.to_ascii_lowercase()), "{detail}");
    }
    assert!(upstream.writes().is_empty(), "{:?}", upstream.writes());
    let reply = proxy
        .write("PUT", "/obj", fence, &[("X_Request_Id", "7")], "x")
        .await
        .unwrap();
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(upstream.writes()[0].header("x_request_id"), Some("7"));
}

/// Goal: a bad `--bind-resource` value is refused at startup, naming the value and the choices.
#[test]
fn a_bad_bind_resource_value_is_refused() {
    let out = lockd_tests::process::command("fence-proxy")
        .args([
            "http",
            "--listen",
            "127.0.0.1:1",
            "--upstream",
            "http://127.0.0.1:2",
            "--bind-resource",
            "host",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("'host'") && stderr.contains("path-prefix"),
        "{stderr}"
    );
}

/// Attack (review, HIGH where the upstream checks `Lock-Resource`): HTTP/2 keeps a header value's
/// spaces, HTTP/1.1 parsers drop them. `Lock-Resource: "orders/42 "` was a resource of its own to
/// the proxy, fenced apart from `orders/42`, and went upstream as `orders/42`: token 41 applied
/// after 42. Goal: refused, 400 bad-fence naming the whitespace, nothing forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resource_with_whitespace_at_an_end_is_refused() {
    use http_body_util::BodyExt;
    let dir = tempfile::tempdir().unwrap();
    let upstream = HttpUpstream::start().await.unwrap();
    let proxy = FenceProxy::start(&upstream.url(), &redb_store(&dir), &[])
        .await
        .unwrap();
    assert_eq!(put(&proxy, "orders/42", "42", "new").await.status, 200);
    let tcp = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    let connection = tokio::spawn(connection);
    for resource in ["orders/42 ", " orders/42", "orders/42\u{a0}"] {
        let request = hyper::Request::put(format!("http://{}/orders/42", proxy.addr))
            .header("lock-resource", resource)
            .header("fencing-token", "41")
            .body(http_body_util::Full::new(bytes::Bytes::from_static(
                b"stale",
            )))
            .unwrap();
        let reply = sender.send_request(request).await.unwrap();
        let status = reply.status().as_u16();
        let body = reply.into_body().collect().await.unwrap().to_bytes();
        let body = String::from_utf8_lossy(&body);
        assert_eq!(status, 400, "{resource:?}: {body}");
        assert!(
            body.contains("bad-fence") && body.contains("whitespace"),
            "{resource:?}: {body}"
        );
    }
    connection.abort();
    let writes = upstream.writes();
    assert_eq!(writes.len(), 1, "{writes:?}");
    assert_eq!(writes[0].header("fencing-token"), Some("42"));
}

/// `--max-resources 3` against either store: three resources are recorded, a fourth is refused
/// (507 `resource-limit`, naming the limit, nothing forwarded, counted), writes of the recorded
/// ones go on, and the fourth stays refused.
async fn resource_bound(store: &str, extra: &[&str]) {
    let upstream = HttpUpstream::start().await.unwrap();
    let mut args = vec!["--max-resources", "3"];
    args.extend_from_slice(extra);
    let proxy = FenceProxy::start(&upstream.url(), store, &args)
        .await
        .unwrap();

    // Phase 1: three resources are recorded.
    for r in ["limit/a", "limit/b", "limit/c"] {
        assert_eq!(put(&proxy, r, "1", "first").await.status, 200, "{r}");
    }
    // Phase 2: a fourth is refused, twice; the recorded ones take higher and equal tokens.
    for _ in 0..2 {
        let reply = put(&proxy, "limit/d", "1", "new").await;
        assert_refused(&reply, 507, "resource-limit");
        let message = reply.json()["message"].as_str().unwrap().to_owned();
        assert!(
            message.contains("--max-resources")
                && message.contains(" 3 ")
                && message.contains("limit/d"),
            "{message}"
        );
    }
    for (r, token) in [("limit/a", "2"), ("limit/c", "1"), ("limit/b", "7")] {
        assert_eq!(
            put(&proxy, r, token, "again").await.status,
            200,
            "{r}:{token}"
        );
    }
    let stale = put(&proxy, "limit/b", "6", "stale").await;
    assert_refused(&stale, 412, "stale-fencing-token");

    // Phase 3: nothing of the refused resource reached the upstream; the refusals are counted.
    let writes = upstream.writes();
    assert_eq!(writes.len(), 6, "{writes:?}");
    assert!(
        writes.iter().all(|w| w.resource() != Some("limit/d")),
        "{writes:?}"
    );
    let metrics = proxy.metrics().await.unwrap();
    assert!(
        metrics
            .contains(r#"fence_proxy_requests_total{frontend="http",result="resource-limit"} 2"#),
        "{metrics}"
    );
}

/// Attack (review of 2026-12-05, third round, MEDIUM, resource bound): the epoch store grew by
/// one record per resource name forever, and with plain tokens any client can name fresh
/// resources (3,000 MOVE writes with fresh 250-byte names grew the redb file by about 2.1 MB).
/// Records cannot be deleted safely. Goal: `--max-resources` bounds them; past it a write of a
/// new resource is refused (fail closed) while recorded resources are written as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_of_new_resources_beyond_max_resources_are_refused_redb() {
    let dir = tempfile::tempdir().unwrap();
    resource_bound(&redb_store(&dir), &[]).await;
}

/// The same with the Postgres store, which counts its shared table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_of_new_resources_beyond_max_resources_are_refused_postgres() {
    let table = PgTable::new("fence_limit");
    resource_bound(&table.store(), &["--store-table", &table.name]).await;
}
