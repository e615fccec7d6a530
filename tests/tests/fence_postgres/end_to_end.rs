//! The proxy between real clients, a password-protected Postgres and a real lockd cluster.

use std::time::Duration;

use crate::{STALE, code, message};
use lockd_tests::pg::{self, PgProxy};

/// Goal: password authentication (scram-sha-256 and md5) passes through the proxy untouched;
/// a wrong password is refused by the upstream with its own error.
/// Method: a private throwaway cluster with password-only pg_hba (the shared server uses trust).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn password_authentication_passes_through() {
    lockd_tests::skip_without_postgres!();
    let cluster = match pg::PrivateCluster::start() {
        Ok(c) => c,
        Err(reason) => {
            panic!("cannot start a private Postgres cluster for the auth test: {reason}")
        }
    };
    let admin = cluster.admin().await;
    admin
        .batch_execute(&format!(
            "SET password_encryption = 'scram-sha-256'; CREATE ROLE scram_user LOGIN PASSWORD '{p}';
             SET password_encryption = 'md5'; CREATE ROLE md5_user LOGIN PASSWORD '{p}';",
            p = pg::PRIVATE_PASSWORD
        ))
        .await
        .unwrap();
    let proxy = PgProxy::start_with(cluster.url("postgres"), false);
    // As `init --grant-to` would: the roles may execute the guard (and nothing on its table).
    admin
        .batch_execute(&format!(
            "{}{}",
            pg::grant_guard_sql("scram_user"),
            pg::grant_guard_sql("md5_user")
        ))
        .await
        .unwrap();
    for user in ["scram_user", "md5_user", "postgres"] {
        let mut config: tokio_postgres::Config = proxy.url_as(user, "postgres").parse().unwrap();
        config.password(pg::PRIVATE_PASSWORD);
        let client = pg::connect(&config).await;
        let who: String = client
            .query_one("SELECT current_user::text", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(who, user);
        config.password("wrong");
        let err = config
            .connect(tokio_postgres::NoTls)
            .await
            .err()
            .expect("wrong password accepted");
        assert_eq!(code(&err), "28P01", "{err:?}");
    }
}

/// Goal: end to end with lockd's tokens, the zombie scenario: A holds the lock, pauses past its
/// lease, B takes over with a higher token and writes; A wakes up and its late transaction is
/// rejected with 55P03, leaving B's rows.
/// Method: a real three-node lockd cluster; A acquires with a 1.5 s lease and writes through the
/// proxy; A then stops renewing (the pause) while B waits in lockd's queue and is granted the lock
/// on expiry; B writes; A's late writes (autocommit and explicit) fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zombie_holder_is_fenced_with_lockd_tokens() {
    lockd_tests::skip_without_postgres!();
    use lockd_api::v1::AcquireRequest;
    use lockd_tests::cluster::Cluster;

    let cluster = Cluster::start_default().await.unwrap();
    let proxy = PgProxy::start(false);
    let direct = pg::connect(&pg::direct_url().parse().unwrap()).await;
    let resource = pg::unique_name("zombie/orders");
    let tbl = pg::unique_name("zombie");
    direct
        .batch_execute(&format!(
            "CREATE TABLE {tbl} (k text PRIMARY KEY, holder text, token bigint)"
        ))
        .await
        .unwrap();
    let acquire = |request_id: &str, wait_timeout_ms: u64| AcquireRequest {
        resource: resource.clone(),
        request_id: request_id.to_owned(),
        lease_ttl_ms: 1_500,
        wait_timeout_ms,
        holder: request_id.to_owned(),
    };

    // Phase 1: A holds the lock and writes with its token.
    let mut lock_a = cluster.lock_client(1).await.unwrap();
    let lease_a = lock_a
        .acquire(acquire("zombie-a", 0))
        .await
        .unwrap()
        .into_inner();
    let a =
        pg::connect(&proxy.config(Some(&format!("{resource}:{}", lease_a.fencing_token)))).await;
    a.execute(
        &format!("INSERT INTO {tbl} VALUES ('row', 'a', $1)"),
        &[&(lease_a.fencing_token as i64)],
    )
    .await
    .unwrap();

    // Phase 2: A pauses (no renewals); B queues in lockd and gets the lock when A's lease
    // expires, with a higher token, and writes.
    let mut lock_b = cluster.lock_client(2).await.unwrap();
    let lease_b = lock_b
        .acquire(acquire("zombie-b", 10_000))
        .await
        .unwrap()
        .into_inner();
    assert!(lease_b.fencing_token > lease_a.fencing_token);
    let mut b = pg::connect(&proxy.config(None)).await;
    b.batch_execute(&format!(
        "SET lockd.fence = '{resource}:{}'",
        lease_b.fencing_token
    ))
    .await
    .unwrap();
    let tx = b.transaction().await.unwrap();
    tx.execute(
        &format!("UPDATE {tbl} SET holder = 'b', token = $1"),
        &[&(lease_b.fencing_token as i64)],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();

    // Phase 3: A wakes up and carries on as if it still held the lock.
    let err = a
        .execute(&format!("UPDATE {tbl} SET holder = 'a-late'"), &[])
        .await
        .unwrap_err();
    assert_eq!(code(&err), STALE, "{err:?}");
    let msg = message(&err);
    assert!(
        msg.contains(&lease_a.fencing_token.to_string())
            && msg.contains(&lease_b.fencing_token.to_string()),
        "{msg}"
    );
    let err = a
        .batch_execute(&format!(
            "BEGIN; DELETE FROM {tbl}; INSERT INTO {tbl} VALUES ('row', 'a-late', 0); COMMIT"
        ))
        .await
        .unwrap_err();
    assert_eq!(code(&err), STALE, "{err:?}");
    let row = direct
        .query_one(&format!("SELECT holder, token FROM {tbl}"), &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "b");
    assert_eq!(row.get::<_, i64>(1), lease_b.fencing_token as i64);
    direct
        .batch_execute(&format!("DROP TABLE {tbl}"))
        .await
        .unwrap();
}

/// Goal: a client's lone `BEGIN` through the proxy does not make Postgres log a warning. The
/// proxy used to open every block with a BEGIN of its own, so the client's BEGIN right after it
/// warned "there is already a transaction in progress" (25001): the proxy hid the notice from the
/// client, but Postgres wrote it to its server log, one line per transaction of every
/// psql, psycopg or node-postgres application (71 MB in one afternoon of benchmarks here).
/// The same for a BEGIN over the extended protocol (a prepared statement, as pgbench
/// `-M prepared`, pgjdbc and tokio-postgres send it), which the proxy runs in the client's place.
/// Method: a private cluster that logs to a file; through the proxy, three transactions sent
/// as BEGIN (three spellings), `INSERT`, `COMMIT` in separate simple queries, and three more as
/// prepared statements, unfenced and fenced; then a marker warning raised directly, and once the
/// marker is in the log, no 25001 warning may be.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_begin_leaves_no_warning_in_the_server_log() {
    lockd_tests::skip_without_postgres!();
    let cluster = pg::PrivateCluster::start_logging()
        .unwrap_or_else(|reason| panic!("cannot start a private Postgres cluster: {reason}"));
    let admin = cluster.admin().await;
    admin
        .batch_execute("CREATE TABLE lone_begin (token bigint NOT NULL)")
        .await
        .unwrap();
    let proxy = PgProxy::start_with(cluster.url("postgres"), false);
    for fence in [None, Some("lone-begin:1")] {
        let mut config: tokio_postgres::Config =
            proxy.url_as("postgres", "postgres").parse().unwrap();
        config.password(pg::PRIVATE_PASSWORD);
        if let Some(f) = fence {
            config.options(format!("-c lockd.fence={f}"));
        }
        let client = pg::connect(&config).await;
        // Spellings of a lone BEGIN the proxy must read as Postgres does.
        for begin in [
            "BEGIN",
            "start transaction",
            "/* a comment */ begin isolation level serializable;",
        ] {
            for sql in [begin, "INSERT INTO lone_begin VALUES (1)", "COMMIT"] {
                client
                    .batch_execute(sql)
                    .await
                    .unwrap_or_else(|e| panic!("{sql} (fence {fence:?}): {e:?}"));
            }
            // The extended protocol: Parse, then Bind/Execute/Sync of a named statement.
            let begin = begin.trim_end_matches(';');
            for sql in [begin, "INSERT INTO lone_begin VALUES (1)", "COMMIT"] {
                client
                    .execute(sql, &[])
                    .await
                    .unwrap_or_else(|e| panic!("prepared {sql} (fence {fence:?}): {e:?}"));
            }
        }
    }
    let marker = pg::unique_name("lone_begin_marker");
    admin
        .batch_execute(&format!("DO $$ BEGIN RAISE WARNING '{marker}'; END $$"))
        .await
        .unwrap();
    let log = lockd_tests::poll::until(
        "the marker warning reaches the server log",
        Duration::from_secs(10),
        || {
            let log = cluster.server_log();
            if log.contains(&marker) {
                Ok(log)
            } else {
                Err(format!("{} bytes logged, no marker", log.len()))
            }
        },
    )
    .await;
    let rows: i64 = admin
        .query_one("SELECT count(*) FROM lone_begin", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 12);
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("there is already a transaction in progress"))
        .collect();
    assert!(warnings.is_empty(), "{warnings:#?}");
}
