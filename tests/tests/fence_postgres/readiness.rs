//! `/readyz` of `fence-proxy postgres`: it follows the upstream.

use std::time::Duration;

use lockd_tests::pg;

/// Goal: `/readyz` of `fence-proxy postgres` follows its upstream: 200 `ready` while the upstream
/// accepts TCP connections, 503 naming the upstream while its port is closed, 200 again once it
/// is back.
/// Method: the `fence-proxy` binary with `--metrics-listen`, its upstream the shared Postgres
/// behind a TCP relay that the test stops and starts again on the same address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_the_upstream() {
    use lockd_tests::chaos::relay::Relay;
    use lockd_tests::process::{ChildGuard, command};
    use std::net::SocketAddr;

    lockd_tests::skip_without_postgres!();
    let fence_table = pg::fence_table();
    let pg_addr: SocketAddr = format!("{}:{}", pg::PG_HOST, pg::PG_PORT).parse().unwrap();
    let free = || -> SocketAddr { format!("127.0.0.1:{}", pg::free_port()).parse().unwrap() };
    let (front, listen, metrics) = (free(), free(), free());
    let mut relay = Some(Relay::start(front, pg_addr).await.unwrap());
    let mut cmd = command("fence-proxy");
    cmd.args(["postgres", "--listen", &listen.to_string()])
        .args(["--metrics-listen", &metrics.to_string()])
        .args(["--fence-table", &fence_table])
        .arg("--upstream")
        .arg(format!(
            "postgres://{}@{front}/{}",
            pg::PG_USER,
            pg::PG_DATABASE
        ))
        .env("RUST_LOG", "warn");
    let _proxy = ChildGuard::spawn("fence-proxy postgres", cmd).unwrap();
    let readyz_becomes = |status: u16, text: &'static str| async move {
        lockd_tests::poll::until_async(
            &format!("/readyz {status} with {text:?}"),
            Duration::from_secs(20),
            || async {
                match lockd_tests::fence_proxy::get(&format!("http://{metrics}/readyz")).await {
                    Ok(r) if r.status == status && r.body.contains(text) => Ok(r.body),
                    Ok(r) => Err(format!("{} {:?}", r.status, r.body)),
                    Err(e) => Err(format!("no answer: {e}")),
                }
            },
        )
        .await
    };

    // Phase 1: the upstream answers (the proxy checked its guard through the relay at start).
    assert_eq!(readyz_becomes(200, "ready").await, "ready\n");

    // Phase 2: the upstream's port closes; the reason names it and its address.
    relay.take();
    let body = readyz_becomes(503, "upstream").await;
    assert!(
        body.starts_with("not ready: upstream: ") && body.contains(&front.to_string()),
        "{body}"
    );

    // Phase 3: back.
    relay = Some(Relay::start(front, pg_addr).await.unwrap());
    readyz_becomes(200, "ready").await;
    drop(relay);
}
