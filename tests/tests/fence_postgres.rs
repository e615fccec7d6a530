//! The Postgres front end of fence-proxy against the real Postgres at 127.0.0.1:5432 (issue 6).
//!
//! Every test uses its own table and fence resource names, so the tests run in parallel.

use std::time::Duration;

use lockd_tests::pg::{self, PgProxy};
use tokio_postgres::error::SqlState;

/// Fence-proxy's stale-token SQLSTATE.
const STALE: &str = "55P03";

fn code(e: &tokio_postgres::Error) -> String {
    e.code()
        .map(|c| c.code().to_owned())
        .unwrap_or_else(|| format!("no SQLSTATE in {e:?}"))
}

fn message(e: &tokio_postgres::Error) -> String {
    e.as_db_error()
        .map(|d| d.message().to_owned())
        .unwrap_or_else(|| e.to_string())
}

/// Goal: psql through the proxy prints exactly what it prints against Postgres directly, for
/// DDL, DML, COPY, transactions, queries and an error, unfenced and fenced.
/// Method: one script, run three times with different table names (direct, proxy, proxy with a
/// startup fence); the outputs, table names replaced, must be equal.
#[test]
fn psql_through_the_proxy_matches_direct() {
    pg::require_postgres();
    let proxy = PgProxy::start(false);
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("script.sql");
    std::fs::write(
        &script,
        r#"
\pset footer on
CREATE TABLE :"tbl" (id int PRIMARY KEY, name text, amount numeric(10,2), at date);
INSERT INTO :"tbl" VALUES (1, 'one', 1.50, '2024-01-02'), (2, 'two', NULL, '2024-02-03');
COPY :"tbl" FROM STDIN;
3	three	3.25	2024-03-04
4	four	\N	2024-04-05
\.
BEGIN;
UPDATE :"tbl" SET amount = amount * 2 WHERE id = 1;
SAVEPOINT s;
DELETE FROM :"tbl" WHERE id = 2;
ROLLBACK TO SAVEPOINT s;
COMMIT;
BEGIN;
DELETE FROM :"tbl";
ROLLBACK;
INSERT INTO :"tbl" VALUES (1, 'duplicate', 0, NULL);
SELECT * FROM :"tbl" ORDER BY id;
SELECT count(*), sum(amount) FROM :"tbl";
COPY (SELECT id, name FROM :"tbl" ORDER BY id) TO STDOUT WITH CSV HEADER;
SELECT 'a;b' AS "semi;colon", $$dollar ' quoted$$ AS d;
\d :"tbl"
DROP TABLE :"tbl";
"#,
    )
    .unwrap();

    let run = |url: &str, env: &[(&str, &str)]| {
        let tbl = pg::unique_name("psql");
        let out = pg::psql(url, &script, &[("tbl", &tbl)], env);
        let text = format!(
            "{}\n--- stderr ---\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        text.replace(&tbl, "TBL")
    };
    let direct = run(&pg::direct_url(), &[]);
    assert!(
        direct.contains("duplicate key value"),
        "script did not run as expected:\n{direct}"
    );
    assert!(direct.contains("3.00"), "{direct}");
    let proxied = run(&proxy.url(), &[]);
    assert_eq!(
        proxied, direct,
        "unfenced session through the proxy differs from direct"
    );
    let resource = pg::unique_name("psql_res");
    let fenced = run(
        &proxy.url(),
        &[("PGOPTIONS", &format!("-c lockd.fence={resource}:7"))],
    );
    assert_eq!(
        fenced, direct,
        "fenced session through the proxy differs from direct"
    );
}

/// Goal: the extended protocol works through the proxy as directly: prepared statements,
/// parameters of several types, NULLs, transactions, an error inside a transaction followed by
/// ROLLBACK, pipelined queries, and cancel requests.
/// Method: the same checks with an unfenced and a fenced session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extended_protocol_through_the_proxy() {
    pg::require_postgres();
    let proxy = PgProxy::start(false);
    let resource = pg::unique_name("ext_res");
    for fence in [None, Some(format!("{resource}:5"))] {
        let mut client = pg::connect(&proxy.config(fence.as_deref())).await;
        let tbl = pg::unique_name("ext");
        client
            .batch_execute(&format!(
                "CREATE TABLE {tbl} (id int PRIMARY KEY, big bigint, name text, ok bool, ratio float8, data bytea)"
            ))
            .await
            .unwrap();
        let insert = client
            .prepare(&format!(
                "INSERT INTO {tbl} VALUES ($1, $2, $3, $4, $5, $6)"
            ))
            .await
            .unwrap();
        for i in 0..5i32 {
            let name = (i != 3).then(|| format!("row {i} ' \" ;"));
            let n = client
                .execute(
                    &insert,
                    &[
                        &i,
                        &(i64::from(i) << 40),
                        &name,
                        &(i % 2 == 0),
                        &(f64::from(i) / 4.0),
                        &vec![i as u8; 3],
                    ],
                )
                .await
                .unwrap();
            assert_eq!(n, 1);
        }
        let rows = client
            .query(
                &format!(
                    "SELECT id, big, name, ok, ratio, data FROM {tbl} WHERE id >= $1 ORDER BY id"
                ),
                &[&2i32],
            )
            .await
            .unwrap();
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0].get::<_, i64>(1), 2i64 << 40);
        assert_eq!(rows[1].get::<_, Option<String>>(2), None);
        assert_eq!(
            rows[2].get::<_, Option<String>>(2).as_deref(),
            Some("row 4 ' \" ;")
        );
        assert!(rows[2].get::<_, bool>(3));
        assert_eq!(rows[2].get::<_, f64>(4), 1.0);
        assert_eq!(rows[2].get::<_, Vec<u8>>(5), vec![4u8; 3]);

        // A committed transaction.
        let tx = client.transaction().await.unwrap();
        tx.execute(
            &format!("UPDATE {tbl} SET name = $1 WHERE id = $2"),
            &[&"changed", &1i32],
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
        // An error inside a transaction, then ROLLBACK: nothing of it stays.
        let tx = client.transaction().await.unwrap();
        tx.execute(&format!("DELETE FROM {tbl} WHERE id = 0"), &[])
            .await
            .unwrap();
        let dup = tx
            .execute(
                &insert,
                &[&1i32, &0i64, &"dup", &true, &0.0f64, &Vec::<u8>::new()],
            )
            .await
            .unwrap_err();
        assert_eq!(dup.code(), Some(&SqlState::UNIQUE_VIOLATION), "{dup:?}");
        let aborted = tx.query_one("SELECT 1", &[]).await.unwrap_err();
        assert_eq!(
            aborted.code(),
            Some(&SqlState::IN_FAILED_SQL_TRANSACTION),
            "{aborted:?}"
        );
        tx.rollback().await.unwrap();
        let count: i64 = client
            .query_one(&format!("SELECT count(*) FROM {tbl}"), &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(count, 5, "the rolled-back DELETE must not have applied");
        let name: String = client
            .query_one(&format!("SELECT name FROM {tbl} WHERE id = 1"), &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(name, "changed");

        // Pipelined queries on one connection come back in order.
        let futures: Vec<_> = (0..20i32)
            .map(|i| {
                let client = &client;
                async move {
                    client
                        .query_one("SELECT $1::int + 1", &[&i])
                        .await
                        .map(|r| r.get::<_, i32>(0))
                }
            })
            .collect();
        let results = futures::future::join_all(futures).await;
        for (i, r) in results.into_iter().enumerate() {
            assert_eq!(r.unwrap(), i as i32 + 1);
        }

        // A cancel request reaches the upstream with the upstream's own backend key.
        let cancel = client.cancel_token();
        let canceller = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            cancel.cancel_query(tokio_postgres::NoTls).await
        });
        let started = std::time::Instant::now();
        let err = client
            .batch_execute("SELECT pg_sleep(20)")
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some(&SqlState::QUERY_CANCELED), "{err:?}");
        assert!(started.elapsed() < Duration::from_secs(10));
        canceller.await.unwrap().unwrap();
        client
            .batch_execute(&format!("DROP TABLE {tbl}"))
            .await
            .unwrap();
    }
}

/// One holder's write: with `explicit`, an INSERT and an UPDATE in one BEGIN..COMMIT script over
/// the simple protocol; otherwise two autocommit statements over the extended protocol.
async fn write(
    client: &tokio_postgres::Client,
    explicit: bool,
    tbl: &str,
    holder: &str,
) -> Result<(), tokio_postgres::Error> {
    if explicit {
        client
            .batch_execute(&format!(
                "BEGIN; INSERT INTO {tbl} VALUES ('{holder}', 'x') ON CONFLICT (k) DO UPDATE SET v = 'again'; \
                 UPDATE {tbl} SET v = '{holder}'; COMMIT"
            ))
            .await
    } else {
        client
            .execute(&format!("INSERT INTO {tbl} VALUES ('{holder}', 'x')"), &[])
            .await?;
        client
            .execute(&format!("UPDATE {tbl} SET v = '{holder}'"), &[])
            .await
            .map(|_| ())
    }
}

/// Goal: a stale holder's transaction fails with 55P03 naming resource, token and highest, nothing
/// of it applies, and the table keeps the newer holder's rows; the session stays usable.
/// Method: A (41) writes, B (42) writes, A (41) writes again: once with autocommit statements
/// (extended protocol), once with explicit BEGIN/COMMIT (simple protocol).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_token_is_rejected_and_newer_rows_stay() {
    pg::require_postgres();
    let proxy = PgProxy::start(false);
    let direct = pg::connect(&pg::direct_url().parse().unwrap()).await;
    for explicit in [false, true] {
        let resource = pg::unique_name("orders");
        let tbl = pg::unique_name("fenced");
        direct
            .batch_execute(&format!("CREATE TABLE {tbl} (k text PRIMARY KEY, v text)"))
            .await
            .unwrap();
        let a = pg::connect(&proxy.config(Some(&format!("{resource}:41")))).await;
        let b = pg::connect(&proxy.config(None)).await;
        b.batch_execute(&format!("SET lockd.fence = '{resource}:42'"))
            .await
            .unwrap();
        write(&a, explicit, &tbl, "a")
            .await
            .expect("A (41) writes first");
        write(&b, explicit, &tbl, "b")
            .await
            .expect("B (42) writes after A");
        let err = match write(&a, explicit, &tbl, "a2").await {
            Ok(()) => panic!("A (41) wrote after B (42) (explicit={explicit})"),
            Err(e) => e,
        };
        assert_eq!(code(&err), STALE, "{err:?}");
        let msg = message(&err);
        assert!(msg.starts_with("fence-proxy: "), "{msg}");
        assert!(
            msg.contains(&resource) && msg.contains("41") && msg.contains("42"),
            "{msg}"
        );
        if explicit {
            // The explicit script failed at its first data statement; the client ends the block.
            a.batch_execute("ROLLBACK").await.unwrap();
        }
        let rows: Vec<(String, String)> = direct
            .query(&format!("SELECT k, v FROM {tbl} ORDER BY k"), &[])
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        assert_eq!(
            rows,
            vec![("a".into(), "b".into()), ("b".into(), "b".into())],
            "explicit={explicit}"
        );
        let highest: i64 = direct
            .query_one(
                "SELECT token FROM lockd_fence WHERE resource = $1",
                &[&resource],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(highest, 42);

        // The session stays usable: reads fail while the fence is stale (every transaction is
        // fenced), and with a newer token it writes again.
        let err = a.query_one("SELECT 1", &[]).await.unwrap_err();
        assert_eq!(code(&err), STALE);
        a.batch_execute(&format!("SET lockd.fence = '{resource}:43'"))
            .await
            .unwrap();
        a.execute(&format!("UPDATE {tbl} SET v = 'a43'"), &[])
            .await
            .unwrap();
        direct
            .batch_execute(&format!("DROP TABLE {tbl}"))
            .await
            .unwrap();
    }
}

/// Goal: whatever the interleaving, the older holder's write never lands after the newer
/// holder's commit.
/// Method: (1) A (41) opens a transaction and writes; B (42) tries an autocommit write, which must
/// wait for A; A commits; B commits; A's next write fails. (2) The reverse: B holds an open
/// transaction; A's write waits and fails once B commits. (3) Three A sessions write in a loop
/// while B starts midway; every row gets a serial id at insert time, and all committed A rows
/// must have smaller ids than every B row, and no A transaction begun after B's commit succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interleaved_holders_never_overlap() {
    pg::require_postgres();
    let proxy = PgProxy::start(false);
    let direct = pg::connect(&pg::direct_url().parse().unwrap()).await;

    // Phase 1: A first.
    let resource = pg::unique_name("inter");
    let tbl = pg::unique_name("inter");
    direct
        .batch_execute(&format!(
            "CREATE TABLE {tbl} (id bigserial PRIMARY KEY, token int)"
        ))
        .await
        .unwrap();
    let mut a = pg::connect(&proxy.config(Some(&format!("{resource}:41")))).await;
    let b = pg::connect(&proxy.config(Some(&format!("{resource}:42")))).await;
    let tx = a.transaction().await.unwrap();
    tx.execute(&format!("INSERT INTO {tbl} (token) VALUES (41)"), &[])
        .await
        .unwrap();
    let b_write = {
        let sql = format!("INSERT INTO {tbl} (token) VALUES (42)");
        tokio::spawn(async move {
            let r = b.execute(&sql, &[]).await;
            (b, r)
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !b_write.is_finished(),
        "B's write must wait for A's open transaction"
    );
    tx.commit().await.unwrap();
    let (_b, r) = b_write.await.unwrap();
    r.expect("B writes once A committed");
    let err = a
        .execute(&format!("INSERT INTO {tbl} (token) VALUES (41)"), &[])
        .await
        .unwrap_err();
    assert_eq!(code(&err), STALE);
    let tokens: Vec<i32> = direct
        .query(&format!("SELECT token FROM {tbl} ORDER BY id"), &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(tokens, vec![41, 42]);

    // Phase 2: B first holds the record; A waits, then fails.
    let resource = pg::unique_name("inter");
    let a = pg::connect(&proxy.config(Some(&format!("{resource}:41")))).await;
    let mut b = pg::connect(&proxy.config(Some(&format!("{resource}:42")))).await;
    let tx = b.transaction().await.unwrap();
    tx.execute(&format!("INSERT INTO {tbl} (token) VALUES (142)"), &[])
        .await
        .unwrap();
    let a_write = {
        let sql = format!("INSERT INTO {tbl} (token) VALUES (141)");
        tokio::spawn(async move { a.execute(&sql, &[]).await.map_err(|e| code(&e)) })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !a_write.is_finished(),
        "A's write must wait for B's open transaction"
    );
    tx.commit().await.unwrap();
    assert_eq!(a_write.await.unwrap(), Err(STALE.to_owned()));
    let n: i64 = direct
        .query_one(
            &format!("SELECT count(*) FROM {tbl} WHERE token = 141"),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 0);

    // Phase 3: concurrent writers.
    let resource = pg::unique_name("inter");
    let tbl = pg::unique_name("inter_loop");
    direct
        .batch_execute(&format!(
            "CREATE TABLE {tbl} (id bigserial PRIMARY KEY, token int)"
        ))
        .await
        .unwrap();
    let b_committed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..3 {
        let config = proxy.config(Some(&format!("{resource}:41")));
        let tbl = tbl.clone();
        let b_committed = b_committed.clone();
        writers.push(tokio::spawn(async move {
            let mut client = pg::connect(&config).await;
            let mut late_successes = 0;
            let mut stale = 0;
            // Keep writing until well after B's commit, however fast or slow the machine is, so
            // the run always interleaves (bounded, in case B never commits).
            let mut after_b = 0;
            for i in 0..5_000 {
                let began_after_b = b_committed.load(std::sync::atomic::Ordering::SeqCst);
                if began_after_b {
                    after_b += 1;
                    if after_b > 20 {
                        break;
                    }
                }
                let result = if (i + w) % 2 == 0 {
                    client
                        .execute(&format!("INSERT INTO {tbl} (token) VALUES (41)"), &[])
                        .await
                        .map(|_| ())
                } else {
                    match client.transaction().await {
                        Ok(tx) => match tx
                            .execute(&format!("INSERT INTO {tbl} (token) VALUES (41)"), &[])
                            .await
                        {
                            Ok(_) => tx.commit().await,
                            Err(e) => Err(e),
                        },
                        Err(e) => Err(e),
                    }
                };
                match result {
                    Ok(()) if began_after_b => late_successes += 1,
                    Ok(()) => {}
                    Err(e) => {
                        assert_eq!(code(&e), STALE, "{e:?}");
                        stale += 1;
                    }
                }
            }
            (late_successes, stale)
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let b = pg::connect(&proxy.config(Some(&format!("{resource}:42")))).await;
    b.execute(&format!("INSERT INTO {tbl} (token) VALUES (42)"), &[])
        .await
        .unwrap();
    b_committed.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut stale_total = 0;
    for w in writers {
        let (late, stale) = w.await.unwrap();
        assert_eq!(late, 0, "an A transaction begun after B's commit succeeded");
        stale_total += stale;
    }
    let row = direct
        .query_one(
            &format!(
                "SELECT max(id) FILTER (WHERE token = 41), min(id) FILTER (WHERE token = 42), count(*) FILTER (WHERE token = 41) FROM {tbl}"
            ),
            &[],
        )
        .await
        .unwrap();
    let (max_a, min_b, count_a): (Option<i64>, Option<i64>, i64) =
        (row.get(0), row.get(1), row.get(2));
    assert!(
        count_a > 0 && stale_total > 0,
        "the run did not interleave: {count_a} A rows, {stale_total} stale"
    );
    assert!(
        max_a.unwrap() < min_b.unwrap(),
        "an A row (id {max_a:?}) landed after B's first row (id {min_b:?})"
    );
    eprintln!(
        "interleaved: {count_a} A rows committed before B, {stale_total} A transactions rejected after"
    );
}

/// Goal: RESET clears the fence; malformed values are refused with 22023 naming them and leave
/// the session usable; SET LOCAL and mixed statements are refused; a malformed startup fence
/// refuses the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_settings_reset_and_malformed_values() {
    pg::require_postgres();
    let proxy = PgProxy::start(false);
    let direct = pg::connect(&pg::direct_url().parse().unwrap()).await;
    let resource = pg::unique_name("settings");
    let tbl = pg::unique_name("settings");
    direct
        .batch_execute(&format!("CREATE TABLE {tbl} (v int)"))
        .await
        .unwrap();
    let client = pg::connect(&proxy.config(None)).await;

    for bad in [
        "orders",
        "orders:abc",
        ":5",
        "x:-1",
        "x:9223372036854775808",
        "",
    ] {
        // Simple protocol.
        let err = client
            .batch_execute(&format!("SET lockd.fence = '{bad}'"))
            .await
            .unwrap_err();
        assert_eq!(code(&err), "22023", "{bad:?}: {err:?}");
        assert!(
            message(&err).starts_with("fence-proxy: "),
            "{}",
            message(&err)
        );
        if !bad.is_empty() {
            assert!(message(&err).contains(bad), "{}", message(&err));
        }
        // Extended protocol.
        let err = client
            .execute(&format!("SET lockd.fence = '{bad}'"), &[])
            .await
            .unwrap_err();
        assert_eq!(code(&err), "22023", "{bad:?}: {err:?}");
    }
    let err = client
        .batch_execute(&format!("SET LOCAL lockd.fence = '{resource}:1'"))
        .await
        .unwrap_err();
    assert_eq!(code(&err), "0A000");
    let err = client
        .batch_execute(&format!(
            "SET lockd.fence = '{resource}:1'; INSERT INTO {tbl} VALUES (1)"
        ))
        .await
        .unwrap_err();
    assert_eq!(code(&err), "0A000");
    // Still usable and still unfenced.
    client
        .execute(&format!("INSERT INTO {tbl} VALUES (1)"), &[])
        .await
        .unwrap();

    // Fence set over the extended protocol, then a stale write, then RESET: unfenced again.
    client
        .execute(&format!("SET lockd.fence = '{resource}:10'"), &[])
        .await
        .unwrap();
    let shown: String = client
        .query_one("SHOW lockd.fence", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(shown, format!("{resource}:10"));
    client
        .execute(&format!("INSERT INTO {tbl} VALUES (2)"), &[])
        .await
        .unwrap();
    let newer = pg::connect(&proxy.config(Some(&format!("{resource}:11")))).await;
    newer
        .execute(&format!("INSERT INTO {tbl} VALUES (3)"), &[])
        .await
        .unwrap();
    let err = client
        .execute(&format!("INSERT INTO {tbl} VALUES (4)"), &[])
        .await
        .unwrap_err();
    assert_eq!(code(&err), STALE);
    client.batch_execute("RESET lockd.fence").await.unwrap();
    client
        .execute(&format!("INSERT INTO {tbl} VALUES (5)"), &[])
        .await
        .unwrap();
    let values: Vec<i32> = direct
        .query(&format!("SELECT v FROM {tbl} ORDER BY v"), &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(values, vec![1, 2, 3, 5]);

    // A malformed startup fence refuses the connection, naming the value.
    let err = proxy
        .config(Some("no-token-here"))
        .connect(tokio_postgres::NoTls)
        .await
        .err()
        .expect("a malformed startup fence must refuse the session");
    assert_eq!(code(&err), "22023", "{err:?}");
    assert!(message(&err).contains("no-token-here"), "{}", message(&err));
    direct
        .batch_execute(&format!("DROP TABLE {tbl}"))
        .await
        .unwrap();
}

/// Goal: with --require-fence, unfenced sessions read but cannot write by any route
/// (autocommit, BEGIN READ WRITE, turning default_transaction_read_only off), and a fence
/// unlocks writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_fence_blocks_unfenced_writes() {
    pg::require_postgres();
    let proxy = PgProxy::start(true);
    let direct = pg::connect(&pg::direct_url().parse().unwrap()).await;
    let tbl = pg::unique_name("require");
    direct
        .batch_execute(&format!(
            "CREATE TABLE {tbl} (v int); INSERT INTO {tbl} VALUES (1)"
        ))
        .await
        .unwrap();
    let client = pg::connect(&proxy.config(None)).await;

    let n: i64 = client
        .query_one(&format!("SELECT count(*) FROM {tbl}"), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 1, "reads work without a fence");
    // 25006: the write ran in a read-only transaction. 25001: `BEGIN READ WRITE` inside the
    // proxy's read-only transaction was refused before the write could run.
    let read_only = |e: tokio_postgres::Error| {
        let c = code(&e);
        assert!(
            c == "25006" || c == "25001",
            "expected a read-only refusal, got {e:?}"
        );
    };
    read_only(
        client
            .execute(&format!("INSERT INTO {tbl} VALUES (2)"), &[])
            .await
            .unwrap_err(),
    );
    read_only(
        client
            .batch_execute(&format!("INSERT INTO {tbl} VALUES (2)"))
            .await
            .unwrap_err(),
    );
    read_only(
        client
            .batch_execute(&format!(
                "BEGIN READ WRITE; INSERT INTO {tbl} VALUES (2); COMMIT"
            ))
            .await
            .unwrap_err(),
    );
    client.batch_execute("ROLLBACK").await.unwrap();
    client.batch_execute("BEGIN READ WRITE").await.unwrap();
    read_only(
        client
            .batch_execute(&format!("INSERT INTO {tbl} VALUES (2)"))
            .await
            .unwrap_err(),
    );
    client.batch_execute("ROLLBACK").await.unwrap();
    client
        .batch_execute("SET default_transaction_read_only = off")
        .await
        .unwrap();
    read_only(
        client
            .execute(&format!("UPDATE {tbl} SET v = 3"), &[])
            .await
            .unwrap_err(),
    );
    read_only(
        client
            .batch_execute(&format!("DROP TABLE {tbl}"))
            .await
            .unwrap_err(),
    );

    let resource = pg::unique_name("require");
    client
        .batch_execute(&format!("SET lockd.fence = '{resource}:1'"))
        .await
        .unwrap();
    client
        .execute(&format!("INSERT INTO {tbl} VALUES (2)"), &[])
        .await
        .unwrap();
    client.batch_execute("RESET lockd.fence").await.unwrap();
    read_only(
        client
            .execute(&format!("INSERT INTO {tbl} VALUES (3)"), &[])
            .await
            .unwrap_err(),
    );
    let n: i64 = direct
        .query_one(&format!("SELECT count(*) FROM {tbl}"), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 2);
    direct
        .batch_execute(&format!("DROP TABLE {tbl}"))
        .await
        .unwrap();
}

/// Goal: password authentication (scram-sha-256 and md5) passes through the proxy untouched;
/// a wrong password is refused by the upstream with its own error.
/// Method: a private throwaway cluster with password-only pg_hba (the shared server uses trust).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn password_authentication_passes_through() {
    let cluster = match pg::PrivateCluster::start() {
        Ok(c) => c,
        Err(reason) => {
            panic!("cannot start a private Postgres cluster for the auth test: {reason}")
        }
    };
    // The server accepts TCP connections slightly before it accepts sessions.
    let admin_config: tokio_postgres::Config = cluster.url("postgres").parse().unwrap();
    let mut attempts = 0;
    let admin = loop {
        match admin_config.connect(tokio_postgres::NoTls).await {
            Ok((client, connection)) => {
                tokio::spawn(connection);
                break client;
            }
            Err(e) if attempts < 50 => {
                attempts += 1;
                eprintln!("private cluster not ready yet: {e:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("private cluster never accepted a session: {e:?}"),
        }
    };
    admin
        .batch_execute(&format!(
            "SET password_encryption = 'scram-sha-256'; CREATE ROLE scram_user LOGIN PASSWORD '{p}';
             SET password_encryption = 'md5'; CREATE ROLE md5_user LOGIN PASSWORD '{p}';",
            p = pg::PRIVATE_PASSWORD
        ))
        .await
        .unwrap();
    let proxy = PgProxy::start_with(cluster.url("postgres"), false);
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
    use lockd_api::v1::AcquireRequest;
    use lockd_tests::cluster::Cluster;

    pg::require_postgres();
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
