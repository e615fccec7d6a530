//! SIGHUP reloads of the Postgres front end: its certificate, the upstream root, and a proxy with no
//! TLS at all.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Output;
use std::time::Duration;

use super::{LoggedProxy, copy_pair, poll_until};
use crate::{LOOPBACK, assert_fails_with, assert_ok, psql, server_binaries, via};
use lockd_tests::http_upstream::HttpUpstream;
use lockd_tests::pg::{
    self, PG_DATABASE, PG_USER, PRIVATE_PASSWORD, PrivateCluster, direct_url, unique_name,
};
use lockd_tests::tls::TestCa;

/// The proxy's Postgres session through `fence-proxy postgres` at `addr`, over TLS with
/// sslmode=verify-ca against `ca` (the proxy's own upstream connection code, as a libpq
/// stand-in that keeps a session open).
async fn pg_tls_session(addr: SocketAddr, ca: &Path) -> anyhow::Result<sqlx::PgConnection> {
    let url = format!(
        "postgres://{PG_USER}@{}:{}/{PG_DATABASE}?sslmode=verify-ca&sslrootcert={}",
        addr.ip(),
        addr.port(),
        ca.display()
    );
    let parsed = fence_proxy_postgres::upstream::parse(&url, "test client")?;
    parsed.connect(Duration::from_secs(10)).await
}

/// One text value from `sql` on `conn`.
async fn text(conn: &mut sqlx::PgConnection, sql: &'static str) -> String {
    sqlx::query_scalar(sql).fetch_one(conn).await.unwrap()
}

/// psql with sslmode=verify-ca trusting `ca`, off the async workers.
fn psql_verify_ca(addr: SocketAddr, ca: &Path, sql: &str) -> Output {
    let conninfo = via(
        addr,
        &format!("sslmode=verify-ca sslrootcert={}", ca.display()),
    );
    tokio::task::block_in_place(|| psql(&conninfo, sql, &[]))
}

/// Issue 15 (certificate rotation, Postgres front end): SIGHUP makes `fence-proxy postgres`
/// read `--tls-cert`/`--tls-key` again. Method: cert A (CA1), one TLS session kept open; the
/// files are replaced with cert B (CA2) and the process gets SIGHUP. Then psql with
/// sslmode=verify-ca trusting CA2 connects, psql trusting CA1 fails the certificate check, and
/// the session opened before still runs queries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_certificates_reload_on_sighup() {
    lockd_tests::skip_without_postgres!();
    let dir = tempfile::tempdir().unwrap();
    let ca1 = TestCa::new(dir.path(), "ca1").unwrap();
    let ca2 = TestCa::new(dir.path(), "ca2").unwrap();
    let a = ca1
        .issue("a", &["localhost".to_owned()], &[LOOPBACK])
        .unwrap();
    let b = ca2
        .issue("b", &["localhost".to_owned()], &[LOOPBACK])
        .unwrap();
    let (cert, key) = (
        dir.path().join("proxy.pem"),
        dir.path().join("proxy-key.pem"),
    );
    copy_pair(&a, &cert, &key);
    let mut proxy = LoggedProxy::start(
        dir.path(),
        "postgres",
        &[
            "--upstream".to_owned(),
            direct_url(),
            "--fence-table".to_owned(),
            pg::fence_table(),
            "--tls-cert".to_owned(),
            cert.display().to_string(),
            "--tls-key".to_owned(),
            key.display().to_string(),
        ],
    )
    .await;

    // Phase 1: A serves; a client of CA2 is refused (so the checks below can fail).
    let mut kept = pg_tls_session(proxy.addr, &ca1.cert_path).await.unwrap();
    assert_eq!(text(&mut kept, "SELECT 'before'::text").await, "before");
    let o = psql_verify_ca(proxy.addr, &ca2.cert_path, "SELECT 1");
    assert_fails_with(
        &o,
        "certificate verify failed",
        "psql trusting CA2 before the reload",
    );

    // Phase 2: B replaces A; SIGHUP.
    copy_pair(&b, &cert, &key);
    proxy.hup();
    poll_until("psql trusting CA2 connects", || {
        let ok = psql_verify_ca(proxy.addr, &ca2.cert_path, "SELECT 1")
            .status
            .success();
        async move { ok }
    })
    .await;
    let o = psql_verify_ca(proxy.addr, &ca1.cert_path, "SELECT 1");
    assert_fails_with(
        &o,
        "certificate verify failed",
        "psql trusting CA1 after the reload",
    );
    let log = proxy.wait_for_log("certificates reloaded", 1).await;
    assert!(log.contains("generation=1"), "{log}");
    assert_eq!(
        proxy
            .metric(
                "fence_proxy_tls_reloads_total",
                &["frontend=\"postgres\"", "result=\"ok\""]
            )
            .await,
        Some(1.0)
    );

    // Phase 3: the session opened under A still works.
    assert_eq!(text(&mut kept, "SELECT 'after'::text").await, "after");
    proxy.assert_running("after the reload");
}

/// Issue 15 (rotation of the upstream's CA, Postgres front end): `--upstream`'s `sslrootcert`
/// is read again on SIGHUP, for every new upstream connection. Method: a private TLS-only
/// Postgres; the proxy starts with its CA in the file. The file is replaced with another CA and
/// the proxy gets SIGHUP: new sessions fail the certificate check, while the session opened
/// before keeps working. The right CA back and another SIGHUP: new sessions work again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_upstream_root_reloads_on_sighup() {
    lockd_tests::skip_without_postgres!();
    if server_binaries().is_none() {
        lockd_tests::skip::report(
            "no initdb/postgres under /usr/lib/postgresql/*/bin (install postgresql)",
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "upstream").unwrap();
    let other = TestCa::new(dir.path(), "other").unwrap();
    let server = ca
        .issue("pg-server", &["localhost".to_owned()], &[])
        .unwrap();
    let cluster = PrivateCluster::start_ssl(&server.cert, &server.key).unwrap();
    let root = dir.path().join("upstream-root.pem");
    std::fs::copy(&ca.cert_path, &root).unwrap();
    let upstream = format!(
        "postgres://postgres:{PRIVATE_PASSWORD}@localhost:{}/postgres?sslmode=verify-full&sslrootcert={}",
        cluster.port,
        root.display()
    );
    let table = format!("{}.lockd_fence", unique_name("reload"));
    if let Err(e) = pg::try_init_guard(&upstream, &table) {
        panic!("fence-proxy postgres init: {e:#}");
    }
    let mut proxy = LoggedProxy::start(
        dir.path(),
        "postgres",
        &[
            "--upstream".to_owned(),
            upstream,
            "--fence-table".to_owned(),
            table,
        ],
    )
    .await;
    let client_url = format!(
        "postgres://postgres:{PRIVATE_PASSWORD}@127.0.0.1:{}/postgres?sslmode=disable",
        proxy.addr.port()
    );
    let session = || async {
        let (client, connection) = client_url
            .parse::<tokio_postgres::Config>()
            .unwrap()
            .connect(tokio_postgres::NoTls)
            .await?;
        tokio::spawn(connection);
        Ok::<_, tokio_postgres::Error>(client)
    };
    let encrypted = "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()";
    let kept = session().await.unwrap();
    assert!(
        kept.query_one(encrypted, &[])
            .await
            .unwrap()
            .get::<_, bool>(0)
    );

    std::fs::copy(&other.cert_path, &root).unwrap();
    proxy.hup();
    proxy.wait_for_log("certificates reloaded", 1).await;
    let Err(e) = session().await else {
        panic!("a new session with an upstream root that did not issue its certificate connected");
    };
    assert!(format!("{e:?}").contains("UnknownIssuer"), "{e:?}");
    assert!(
        kept.query_one(encrypted, &[])
            .await
            .unwrap()
            .get::<_, bool>(0)
    );

    std::fs::copy(&ca.cert_path, &root).unwrap();
    proxy.hup();
    proxy.wait_for_log("certificates reloaded", 2).await;
    let fresh = session().await.unwrap();
    assert!(
        fresh
            .query_one(encrypted, &[])
            .await
            .unwrap()
            .get::<_, bool>(0)
    );
}

/// Issue 15: SIGHUP's default action terminates a process; fence-proxy must never die of it.
/// Method: both front ends started without any TLS file get SIGHUP; each logs that there is
/// nothing to reload, keeps running and still serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_without_tls_leaves_the_proxy_running() {
    lockd_tests::skip_without_postgres!();
    let dir = tempfile::tempdir().unwrap();
    let service = HttpUpstream::start().await.unwrap();
    let mut http = LoggedProxy::start(
        dir.path(),
        "http",
        &[
            "--upstream".to_owned(),
            service.url(),
            "--store".to_owned(),
            format!("redb:{}", dir.path().join("e.redb").display()),
        ],
    )
    .await;
    let mut postgres = LoggedProxy::start(
        dir.path(),
        "postgres",
        &[
            "--upstream".to_owned(),
            direct_url(),
            "--fence-table".to_owned(),
            pg::fence_table(),
        ],
    )
    .await;
    for proxy in [&mut http, &mut postgres] {
        proxy.hup();
        proxy.wait_for_log("nothing to reload", 1).await;
        proxy.hup();
        proxy.wait_for_log("nothing to reload", 2).await;
    }
    let reply = lockd_tests::fence_proxy::get(&format!("http://{}/x", http.addr))
        .await
        .unwrap();
    assert_eq!(reply.status, 200);
    let o = tokio::task::block_in_place(|| {
        psql(
            &via(postgres.addr, "sslmode=disable"),
            "SELECT 'alive'",
            &[],
        )
    });
    assert_eq!(assert_ok(&o, "psql after SIGHUP"), "alive");
    http.assert_running("after SIGHUP");
    postgres.assert_running("after SIGHUP");
}
