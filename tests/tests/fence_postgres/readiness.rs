//! `/readyz` of `fence-proxy postgres`: it follows the upstream, by logging in and looking for
//! the guard function, not by an open port alone.

use std::time::Duration;

use lockd_tests::pg;

/// Goal: `/readyz` of `fence-proxy postgres` follows its upstream: 200 `ready` while the upstream
/// accepts a login, 503 naming the upstream while its port is closed, 200 again once it is back.
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

    // Phase 1: the upstream answers (the proxy checked its guard through the relay at start).
    assert_eq!(readyz_becomes(metrics, 200, "ready").await, "ready\n");

    // Phase 2: the upstream's port closes; the reason names it and its address.
    relay.take();
    let body = readyz_becomes(metrics, 503, "upstream").await;
    assert!(
        body.starts_with("not ready: upstream: ") && body.contains(&front.to_string()),
        "{body}"
    );

    // Phase 3: back.
    relay = Some(Relay::start(front, pg_addr).await.unwrap());
    readyz_becomes(metrics, 200, "ready").await;
    drop(relay);
}

/// Starts `fence-proxy postgres` on the shared Postgres with `fence_table` and `--metrics-listen`;
/// returns the process and the metrics address.
fn start_proxy(
    fence_table: &str,
    upstream_db: &str,
) -> (lockd_tests::process::ChildGuard, std::net::SocketAddr) {
    use lockd_tests::process::{ChildGuard, command};
    let free =
        || -> std::net::SocketAddr { format!("127.0.0.1:{}", pg::free_port()).parse().unwrap() };
    let (listen, metrics) = (free(), free());
    let mut cmd = command("fence-proxy");
    cmd.args(["postgres", "--listen", &listen.to_string()])
        .args(["--metrics-listen", &metrics.to_string()])
        .args(["--fence-table", fence_table])
        .arg("--upstream")
        .arg(format!(
            "postgres://{}@{}:{}/{upstream_db}",
            pg::PG_USER,
            pg::PG_HOST,
            pg::PG_PORT
        ))
        .env("RUST_LOG", "warn");
    (
        ChildGuard::spawn("fence-proxy postgres", cmd).unwrap(),
        metrics,
    )
}

/// Polls `/readyz` on `metrics` until it answers `status` with a body containing `text`.
async fn readyz_becomes(metrics: std::net::SocketAddr, status: u16, text: &str) -> String {
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
}

/// Goal: an upstream whose port is open but where a new session could not write is not ready:
/// the guard function dropped (every fenced write would be refused) gives 503 naming it, and
/// `init` run again gives 200. (A TCP connect alone, the check before, stayed 200.)
/// Method: a fence table in a schema of its own on the shared Postgres; the test drops its guard
/// function while the proxy runs, then runs `fence-proxy postgres init` again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_503_while_the_guard_function_is_gone() {
    lockd_tests::skip_without_postgres!();
    let schema = pg::unique_name("lockd_readyz");
    let table = format!("{schema}.lockd_fence");
    pg::init_guard(&pg::direct_url(), &table);
    let (_proxy, metrics) = start_proxy(&table, pg::PG_DATABASE);
    assert_eq!(readyz_becomes(metrics, 200, "ready").await, "ready\n");

    // The guard lives in the proxy's own schema, named after the fence table.
    let guard = format!("lockd_fence_proxy.{schema}__lockd_fence_guard");
    let drop_guard = format!("DROP FUNCTION {guard}(boolean, text[], boolean)");
    let direct = pg::connect(&pg::direct_url().parse().unwrap()).await;
    direct.batch_execute(&drop_guard).await.unwrap();
    let body = readyz_becomes(metrics, 503, "guard function").await;
    assert!(
        body.starts_with("not ready: upstream: ")
            && body.contains(&guard)
            && body.contains("is gone"),
        "{body}"
    );

    pg::init_guard(&pg::direct_url(), &table);
    readyz_becomes(metrics, 200, "ready").await;
    direct
        .batch_execute(&format!("{drop_guard}; DROP SCHEMA {schema} CASCADE"))
        .await
        .unwrap();
}

/// Goal: an upstream that accepts TCP but refuses the login (here: its database was dropped
/// while the proxy ran) is not ready, and the reason carries the server's words.
/// Method: a database of its own for the fence table; the test drops it (WITH (FORCE)) while
/// the proxy runs, then creates it again and runs `init` there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_503_while_the_upstream_refuses_the_login() {
    lockd_tests::skip_without_postgres!();
    let db = pg::unique_name("lockd_readyz_db");
    let direct = pg::connect(&pg::direct_url().parse().unwrap()).await;
    direct
        .batch_execute(&format!("CREATE DATABASE {db}"))
        .await
        .unwrap();
    let db_url = format!(
        "postgres://{}@{}:{}/{db}",
        pg::PG_USER,
        pg::PG_HOST,
        pg::PG_PORT
    );
    let table = "lockd_readyz.lockd_fence";
    pg::init_guard(&db_url, table);
    let (_proxy, metrics) = start_proxy(table, &db);
    assert_eq!(readyz_becomes(metrics, 200, "ready").await, "ready\n");

    direct
        .batch_execute(&format!("DROP DATABASE {db} WITH (FORCE)"))
        .await
        .unwrap();
    let body = readyz_becomes(metrics, 503, "does not exist").await;
    assert!(body.contains(&db), "{body}");

    direct
        .batch_execute(&format!("CREATE DATABASE {db}"))
        .await
        .unwrap();
    pg::init_guard(&db_url, table);
    readyz_becomes(metrics, 200, "ready").await;
    direct
        .batch_execute(&format!("DROP DATABASE {db} WITH (FORCE)"))
        .await
        .unwrap();
}

/// Goal: a bound too large for the proxy's session semaphore is refused at startup with an
/// error naming the flag and the value; `--max-sessions 18446744073709551615` panicked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_bounds_too_large_are_refused_by_name() {
    let huge = u64::MAX.to_string();
    for flag in ["--max-sessions", "--max-startups-per-client"] {
        let mut cmd = lockd_tests::process::command("fence-proxy");
        cmd.args(["postgres", "--listen", "127.0.0.1:0"])
            .args(["--upstream", "postgres://postgres@127.0.0.1:1/test"])
            .args([flag, huge.as_str()]);
        let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
            .await
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag} {huge} accepted: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(
            stderr.contains(&format!("{flag} {huge} must be between 1 and")),
            "{stderr}"
        );
    }
}
