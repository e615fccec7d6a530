//! `/readyz` of the proxy's metrics listener: it follows the epoch store and the upstream.

use std::time::Duration;

use crate::PgTable;
use lockd_tests::fence_proxy::FenceProxy;
use lockd_tests::http_upstream::HttpUpstream;
use lockd_tests::pg;

/// `/readyz` of a proxy's metrics listener, as (status, body).
async fn readyz(proxy: &FenceProxy) -> (u16, String) {
    match lockd_tests::fence_proxy::get(&format!("http://{}/readyz", proxy.metrics_addr)).await {
        Ok(r) => (r.status, r.body),
        Err(e) => (0, format!("no answer: {e}")),
    }
}

/// Waits until `/readyz` answers `status` with a body containing `text`.
async fn readyz_becomes(proxy: &FenceProxy, status: u16, text: &str) -> String {
    lockd_tests::poll::until_async(
        &format!("/readyz {status} with {text:?}"),
        Duration::from_secs(20),
        || async {
            let (got, body) = readyz(proxy).await;
            if got == status && body.contains(text) {
                Ok(body)
            } else {
                Err(format!("{got} {body:?}"))
            }
        },
    )
    .await
}

/// Goal: `/readyz` reflects the epoch store and the upstream: 200 `ready` while both answer,
/// 503 naming the upstream while its port is closed, 503 naming the Postgres store while its
/// database cannot be reached, and 200 again once each is back.
/// Method: the upstream and the store's Postgres each sit behind a TCP relay the test stops
/// (closing the port and the connections through it) and starts again on the same address; the
/// proxy checks them in the background every 2 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_the_epoch_store_and_the_upstream() {
    use lockd_tests::chaos::relay::Relay;
    use std::net::SocketAddr;

    lockd_tests::skip_without_postgres!();
    let table = PgTable::new("readyz");
    let upstream = HttpUpstream::start().await.unwrap();
    let pg_addr: SocketAddr = format!("{}:{}", pg::PG_HOST, pg::PG_PORT).parse().unwrap();
    let free = || -> SocketAddr { format!("127.0.0.1:{}", pg::free_port()).parse().unwrap() };
    let (upstream_front, store_front) = (free(), free());
    let mut upstream_relay = Some(Relay::start(upstream_front, upstream.addr).await.unwrap());
    let mut store_relay = Some(Relay::start(store_front, pg_addr).await.unwrap());
    let store = format!(
        "postgres://{}@{store_front}/{}",
        pg::PG_USER,
        pg::PG_DATABASE
    );
    let proxy = FenceProxy::start(
        &format!("http://{upstream_front}"),
        &store,
        &["--store-table", &table.name, "--store-timeout", "1s"],
    )
    .await
    .unwrap();

    // Phase 1: both answer.
    let body = readyz_becomes(&proxy, 200, "ready").await;
    assert_eq!(body, "ready\n");

    // Phase 2: the upstream's port closes; the reason names it and its address.
    upstream_relay.take();
    let body = readyz_becomes(&proxy, 503, "upstream").await;
    assert!(
        body.starts_with("not ready: upstream: ") && body.contains(&upstream_front.to_string()),
        "{body}"
    );
    assert!(!body.contains("epoch store"), "{body}");
    upstream_relay = Some(Relay::start(upstream_front, upstream.addr).await.unwrap());
    readyz_becomes(&proxy, 200, "ready").await;

    // Phase 3: the store's database cannot be reached; the reason names the store.
    store_relay.take();
    let body = readyz_becomes(&proxy, 503, "epoch store").await;
    assert!(
        body.starts_with("not ready: epoch store: ") && body.contains(&store_front.to_string()),
        "{body}"
    );
    assert!(!body.contains("upstream"), "{body}");
    store_relay = Some(Relay::start(store_front, pg_addr).await.unwrap());
    readyz_becomes(&proxy, 200, "ready").await;

    // The proxy still forwards a fenced write end to end.
    let r = proxy
        .write("PUT", "/x", (Some("readyz/x"), Some("1")), &[], "v")
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    drop((upstream_relay, store_relay));
}
