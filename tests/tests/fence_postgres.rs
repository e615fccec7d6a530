//! The Postgres front end of fence-proxy against the real Postgres at 127.0.0.1:5432.
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
        write(&a, explicit, &tbl, "a")
            .await
            .expect("A (41) writes first");
        // The SET's own transaction runs the guard, so it records 42 right away.
        b.batch_execute(&format!("SET lockd.fence = '{resource}:42'"))
            .await
            .unwrap();
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
                &format!(
                    "SELECT token FROM {} WHERE resource = $1",
                    pg::fence_table()
                ),
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

/// Goal: RESET clears the fence; malformed values are refused with 22023 naming them (by the
/// guard, before the SET could commit) and leave the session usable; SET LOCAL fences one
/// transaction; a SET in the same query as a write fences that write; a malformed startup fence
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
        assert!(message(&err).contains(bad), "{}", message(&err));
        // Extended protocol.
        let err = client
            .execute(&format!("SET lockd.fence = '{bad}'"), &[])
            .await
            .unwrap_err();
        assert_eq!(code(&err), "22023", "{bad:?}: {err:?}");
        // The refused value did not stick.
        let shown: String = client
            .query_one("SHOW lockd.fence", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(shown, "", "{bad:?}");
    }
    // SET LOCAL fences its own transaction only.
    client
        .batch_execute(&format!(
            "BEGIN; SET LOCAL lockd.fence = '{resource}:1'; INSERT INTO {tbl} VALUES (1); COMMIT"
        ))
        .await
        .unwrap();
    let recorded: i64 = direct
        .query_one(
            &format!(
                "SELECT token FROM {} WHERE resource = $1",
                pg::fence_table()
            ),
            &[&resource],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(recorded, 1);
    let shown: String = client
        .query_one("SHOW lockd.fence", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(shown, "", "SET LOCAL outlived its transaction");

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

/// Goal: under `--require-fence` the opening guard runs in every transaction, also after the
/// session's last commit passed its guard: a session whose fence
/// was cleared by a statement the proxy does not read is read-only from the first statement of
/// its next transaction, so even a non-transactional `nextval` is refused.
/// Method: a fenced session commits two writes; a SELECT of `set_config` clears the fence; the
/// next `nextval` must fail with 25006 and leave the sequence unused (a `nextval` that ran before
/// the guard before COMMIT refused the transaction would have moved it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_fence_keeps_the_opening_guard_after_a_commit() {
    pg::require_postgres();
    let proxy = PgProxy::start(true);
    let direct = pg::connect(&pg::direct_url().parse().unwrap()).await;
    let tbl = pg::unique_name("reqopen");
    let seq = format!("{tbl}_seq");
    direct
        .batch_execute(&format!(
            "CREATE TABLE {tbl} (v int); CREATE SEQUENCE {seq}"
        ))
        .await
        .unwrap();
    let resource = pg::unique_name("reqopen");
    let client = pg::connect(&proxy.config(Some(&format!("{resource}:1")))).await;
    for v in [1, 2] {
        client
            .execute(&format!("INSERT INTO {tbl} VALUES ({v})"), &[])
            .await
            .expect("the fenced session writes");
    }
    client
        .query_one(
            "SELECT pg_catalog.set_config('lockd.fence', '', false)",
            &[],
        )
        .await
        .unwrap();
    let err = client
        .query_one(&format!("SELECT nextval('{seq}')"), &[])
        .await
        .unwrap_err();
    assert_eq!(code(&err), "25006", "{err:?}");
    let used: bool = direct
        .query_one(&format!("SELECT is_called FROM {seq}"), &[])
        .await
        .unwrap()
        .get(0);
    assert!(!used, "nextval ran before the session was made read-only");
    direct
        .batch_execute(&format!("DROP TABLE {tbl}; DROP SEQUENCE {seq}"))
        .await
        .unwrap();
}

/// Goal: a fenced session that went stale after a commit is refused at its next transaction's
/// first statement, before the statement runs, so even effects that no COMMIT guard can undo
/// (a sequence, an advisory lock, a dblink write to the same database) do not happen. A review
/// found them happening when the opening guard was skipped after a passed commit (reverted).
/// Method: session A commits with token 1; session B records token 2; A's `nextval` must fail
/// with 55P03 and leave the sequence unused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_gone_stale_after_a_commit_is_refused_before_its_next_statement_runs() {
    pg::require_postgres();
    let proxy = PgProxy::start(false);
    let direct = pg::connect(&pg::direct_url().parse().unwrap()).await;
    let tbl = pg::unique_name("stalenext");
    let seq = format!("{tbl}_seq");
    direct
        .batch_execute(&format!(
            "CREATE TABLE {tbl} (v int); CREATE SEQUENCE {seq}"
        ))
        .await
        .unwrap();
    let resource = pg::unique_name("stalenext");
    let a = pg::connect(&proxy.config(Some(&format!("{resource}:1")))).await;
    a.execute(&format!("INSERT INTO {tbl} VALUES (1)"), &[])
        .await
        .expect("token 1 writes");
    let b = pg::connect(&proxy.config(Some(&format!("{resource}:2")))).await;
    b.execute(&format!("INSERT INTO {tbl} VALUES (2)"), &[])
        .await
        .expect("token 2 writes");
    let err = a
        .query_one(&format!("SELECT nextval('{seq}')"), &[])
        .await
        .unwrap_err();
    assert_eq!(code(&err), "55P03", "{err:?}");
    let used: bool = direct
        .query_one(&format!("SELECT is_called FROM {seq}"), &[])
        .await
        .unwrap()
        .get(0);
    assert!(
        !used,
        "the stale session's statement ran before it was refused"
    );
    direct
        .batch_execute(&format!("DROP TABLE {tbl}; DROP SEQUENCE {seq}"))
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

// ---------------------------------------------------------------------------------------------
// Attacks on the guard (docs/fence-proxy-postgres.md, "Design"). Setup for each: a resource whose
// token 42 is recorded through the proxy, a table `(id bigserial, token bigint)` where every write
// carries the writer's token, and an attacking session fenced with 41 (or unfenced under
// --require-fence). The oracle is always the table itself: no row written by the attacker
// committed.
// ---------------------------------------------------------------------------------------------

use lockd_tests::pg::{Attack, RawConn, wire};

/// Goal: a failed transaction must not let a statement after ROLLBACK or
/// ROLLBACK TO SAVEPOINT in the same query run without the fence.
/// Method: BEGIN; SELECT 1/0; then `ROLLBACK; INSERT` in one query; and `ROLLBACK TO SAVEPOINT s;
/// INSERT` then COMMIT; with fence 41 (42 recorded) and unfenced under --require-fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_bypass1_failed_transaction_skips_the_guard() {
    for require_fence in [false, true] {
        let a = Attack::new(require_fence, "attack").await;
        let token = (!require_fence).then_some(41);
        let mut c = a.attacker(token).await;
        c.query("BEGIN").await;
        c.query("SELECT 1/0").await;
        let r = c.query(&format!("ROLLBACK; {}", a.insert(41))).await;
        eprintln!("ROLLBACK; INSERT -> {:?}", r.errors);
        c.query("ROLLBACK").await;
        a.assert_nothing_committed("ROLLBACK; INSERT").await;

        c.query("BEGIN").await;
        c.query("SAVEPOINT s").await;
        c.query("SELECT 1/0").await;
        let r = c
            .query(&format!("ROLLBACK TO SAVEPOINT s; {}", a.insert(41)))
            .await;
        eprintln!("ROLLBACK TO; INSERT -> {:?}", r.errors);
        let r = c.query("COMMIT").await;
        eprintln!("COMMIT -> {:?}", r.errors);
        a.assert_nothing_committed("ROLLBACK TO SAVEPOINT s; INSERT; COMMIT")
            .await;
    }
}

/// Goal: the kind of a statement name comes from what the upstream holds.
/// Method: (a) Parse s1 = SHOW, SQL DEALLOCATE s1, SQL PREPARE s1 AS INSERT, Bind/Execute s1.
/// (b) Parse s2 = INSERT, Sync; Parse s2 = SHOW (the upstream answers 42P05); Bind/Execute s2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_bypass2_statement_kinds_go_stale() {
    let a = Attack::new(false, "attack").await;
    let mut c = a.attacker(Some(41)).await;
    let mut out = bytes::BytesMut::new();
    wire::parse("s1", "SHOW work_mem", &mut out);
    wire::sync(&mut out);
    c.send(&out).await;
    c.read_until_ready().await;
    c.query("DEALLOCATE s1").await;
    c.query(&format!("PREPARE s1 AS {}", a.insert(41))).await;
    let mut out = bytes::BytesMut::new();
    wire::bind("", "s1", &mut out);
    wire::execute("", &mut out);
    wire::sync(&mut out);
    c.send(&out).await;
    let r = c.read_until_ready().await;
    eprintln!("(a) -> {:?}", r.errors);
    a.assert_nothing_committed("(a) SQL PREPARE over a SHOW name")
        .await;

    let mut out = bytes::BytesMut::new();
    wire::parse("s2", &a.insert(41), &mut out);
    wire::sync(&mut out);
    wire::parse("s2", "SHOW work_mem", &mut out);
    wire::sync(&mut out);
    c.send(&out).await;
    c.read_until_ready().await;
    let r = c.read_until_ready().await;
    assert_eq!(r.first_error(), "42P05", "{r:?}");
    let mut out = bytes::BytesMut::new();
    wire::bind("", "s2", &mut out);
    wire::execute("", &mut out);
    wire::sync(&mut out);
    c.send(&out).await;
    let r = c.read_until_ready().await;
    eprintln!("(b) -> {:?}", r.errors);
    a.assert_nothing_committed("(b) failed re-Parse of s2")
        .await;
}

/// Goal: RESET ALL after a write in the same query, and DISCARD ALL refused
/// inside a block, must not unfence the write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_bypass3_reset_all_and_discard_all() {
    let a = Attack::new(false, "attack").await;
    let mut c = a.attacker(Some(41)).await;
    let r = c.query(&format!("{}; RESET ALL", a.insert(41))).await;
    eprintln!("INSERT; RESET ALL -> {:?}", r.errors);
    a.assert_nothing_committed("INSERT; RESET ALL").await;

    let mut c = a.attacker(Some(41)).await;
    c.query("BEGIN").await;
    let r = c.query("DISCARD ALL").await;
    // Refused by Postgres inside a block (25001), or by the guard first (55P03).
    assert!(!r.errors.is_empty(), "DISCARD ALL inside a block: {r:?}");
    c.query("ROLLBACK").await;
    let shown = c.query("SHOW lockd.fence").await;
    eprintln!("SHOW after refused DISCARD ALL -> {shown:?}");
    let r = c.query(&a.insert(41)).await;
    eprintln!("INSERT after refused DISCARD ALL -> {:?}", r.errors);
    a.assert_nothing_committed("INSERT after a refused DISCARD ALL")
        .await;
}

/// Goal: a DO block (or procedure) cannot COMMIT its way out of the guard.
/// Method: the attacker holds 41 (current) and runs, over the extended protocol, a DO block that
/// inserts, COMMITs, sleeps while the holder of 42 records and writes, then inserts again. No row
/// of 41 may land after 42's. Under --require-fence, an unfenced DO that COMMITs then inserts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_bypass4_commit_inside_do_block() {
    pg::require_postgres();
    let proxy = PgProxy::start(false);
    let direct = pg::connect(&pg::direct_url().parse().unwrap()).await;
    let resource = pg::unique_name("do_commit");
    let tbl = pg::unique_name("do_commit");
    direct
        .batch_execute(&format!(
            "CREATE TABLE {tbl} (id bigserial PRIMARY KEY, token bigint NOT NULL)"
        ))
        .await
        .unwrap();
    let mut c = RawConn::connect(
        proxy.addr,
        pg::PG_USER,
        Some(&format!("-c lockd.fence={resource}:41")),
    )
    .await;
    let mut out = bytes::BytesMut::new();
    wire::run(
        &format!(
            "DO $$ BEGIN INSERT INTO {tbl} (token) VALUES (41); COMMIT; PERFORM pg_sleep(2); \
             INSERT INTO {tbl} (token) VALUES (41); END $$"
        ),
        &mut out,
    );
    wire::sync(&mut out);
    c.send(&out).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    let holder = pg::connect(&proxy.config(Some(&format!("{resource}:42")))).await;
    let newer = tokio::time::timeout(
        Duration::from_secs(10),
        holder.execute(&format!("INSERT INTO {tbl} (token) VALUES (42)"), &[]),
    )
    .await
    .expect("42's write finishes");
    let r = c.read_until_ready().await;
    eprintln!("DO with COMMIT -> {:?}; 42's write -> {newer:?}", r.errors);
    let late: i64 = direct
        .query_one(
            &format!(
                "SELECT count(*) FROM {tbl} WHERE token = 41 AND id > \
                 coalesce((SELECT min(id) FROM {tbl} WHERE token = 42), 0)"
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(late, 0, "a row of 41 committed after 42's");

    let a = Attack::new(true, "attack").await;
    let mut c = a.attacker(None).await;
    let mut out = bytes::BytesMut::new();
    wire::run(
        &format!("DO $$ BEGIN COMMIT; {}; END $$", a.insert(41)),
        &mut out,
    );
    wire::sync(&mut out);
    c.send(&out).await;
    let r = c.read_until_ready().await;
    eprintln!("require-fence DO COMMIT; INSERT -> {:?}", r.errors);
    let r = c
        .query(&format!("CALL pg_catalog.pg_sleep(0); {}", a.insert(41)))
        .await;
    eprintln!("require-fence CALL; INSERT -> {:?}", r.errors);
    a.assert_nothing_committed("unfenced DO that COMMITs").await;
}

/// Goal: the proxy reads statement boundaries exactly as Postgres does.
/// Method: under --require-fence, unfenced: a dollar tag made of bytes >= 0x80 hiding
/// `COMMIT; INSERT`; and `standard_conforming_strings = off` with `'\''` doing the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_bypass5_splitter_disagrees_with_postgres() {
    let a = Attack::new(true, "attack").await;
    let mut c = a.attacker(None).await;
    let r = c
        .query(&format!(
            "SELECT $€$ $$ $€$; COMMIT; {}; SELECT $€$ $$ $€$",
            a.insert(41)
        ))
        .await;
    eprintln!("dollar tag -> {:?}", r.errors);
    c.query("ROLLBACK").await;
    a.assert_nothing_committed("dollar tag with non-letter bytes")
        .await;

    let mut c = a.attacker(None).await;
    c.query("SET standard_conforming_strings = off").await;
    let r = c
        .query(&format!(
            "SELECT '\\'' ; COMMIT; {}; SELECT ' '",
            a.insert(41)
        ))
        .await;
    eprintln!("standard_conforming_strings off -> {:?}", r.errors);
    c.query("ROLLBACK").await;
    a.assert_nothing_committed("standard_conforming_strings = off")
        .await;
}

/// Goal: every spelling of the fence setting is the fence: what Postgres
/// holds is what is checked.
/// Method: an unfenced session sets `<resource>:41` inside its transaction with quoted
/// identifiers, U&"", set_config, then writes and commits: in one query, and as separate queries
/// of one block. A role whose ALTER ROLE ... SET gives the fence writes in autocommit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_bypass6_spellings_of_the_setting() {
    let a = Attack::new(false, "attack").await;
    let r = &a.resource;
    for set in [
        format!("SET \"lockd\".\"fence\" = '{r}:41'"),
        format!("SET lockd.\"fence\" TO '{r}:41'"),
        format!("SET U&\"lockd\".U&\"fenc\\0065\" = '{r}:41'"),
        format!("SELECT set_config('lockd.fence', '{r}:41', false)"),
        format!("SET LOCAL lockd.fence = '{r}:41'"),
    ] {
        let mut c = a.attacker(None).await;
        let w = c
            .query(&format!("BEGIN; {set}; {}; COMMIT", a.insert(41)))
            .await;
        eprintln!("BEGIN; {set}; INSERT; COMMIT -> {:?}", w.errors);
        c.query("ROLLBACK").await;
        a.assert_nothing_committed(&set).await;
        c.query("BEGIN").await;
        c.query(&set).await;
        c.query(&a.insert(41)).await;
        let w = c.query("COMMIT").await;
        eprintln!("separate queries, {set} -> {:?}", w.errors);
        a.assert_nothing_committed(&set).await;
    }
    let role = pg::unique_name("attacker_role");
    a.direct
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN; ALTER ROLE {role} SET lockd.fence = '{r}:41'; \
             GRANT ALL ON {t} TO {role}; GRANT ALL ON SEQUENCE {t}_id_seq TO {role}; {grant}",
            t = a.tbl,
            grant = pg::grant_guard_sql(&role),
        ))
        .await
        .unwrap();
    let mut c = RawConn::connect(a.proxy.addr, &role, None).await;
    let w = c.query(&a.insert(41)).await;
    eprintln!("ALTER ROLE SET -> {:?}", w.errors);
    a.direct
        .batch_execute(&format!("DROP OWNED BY {role}; DROP ROLE {role}"))
        .await
        .ok();
    a.assert_nothing_committed("ALTER ROLE ... SET lockd.fence")
        .await;
}

/// Goal: the fence table cannot be shadowed by a temporary table or a
/// search_path without public.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_bypass7_fence_table_shadowed() {
    let a = Attack::new(false, "attack").await;
    let mut c = a.attacker(Some(41)).await;
    let r = c
        .query(
            "CREATE TEMP TABLE lockd_fence (resource text PRIMARY KEY, token bigint NOT NULL, \
             updated_at timestamptz NOT NULL)",
        )
        .await;
    eprintln!("CREATE TEMP TABLE -> {:?}", r.errors);
    let r = c.query(&a.insert(41)).await;
    eprintln!("INSERT with temp table -> {:?}", r.errors);
    a.assert_nothing_committed("temporary lockd_fence").await;

    let schema = pg::unique_name("attacker_schema");
    a.direct
        .batch_execute(&format!("CREATE SCHEMA {schema}"))
        .await
        .unwrap();
    let mut c = a.attacker(Some(41)).await;
    c.query(&format!("SET search_path = {schema}")).await;
    let r = c
        .query(&format!("INSERT INTO public.{} (token) VALUES (41)", a.tbl))
        .await;
    eprintln!("INSERT with search_path = {schema} -> {:?}", r.errors);
    a.direct
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .await
        .unwrap();
    a.assert_nothing_committed("search_path without public")
        .await;
}

/// Goal (robustness): a second guard in one block works (the proxy's portal is closed
/// after use), as pgjdbc's autosave needs: a savepoint rolled back, then more writes, then COMMIT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_robustness_second_guard_in_one_block() {
    let a = Attack::new(false, "attack").await;
    let mut client = pg::connect(&a.proxy.config(Some(&format!("{}:42", a.resource)))).await;
    let mut tx = client.transaction().await.unwrap();
    tx.execute(&a.insert(42), &[]).await.unwrap();
    {
        let sp = tx.savepoint("sp").await.unwrap();
        sp.execute(&a.insert(42), &[]).await.unwrap();
        sp.rollback().await.unwrap();
    }
    tx.execute(&a.insert(42), &[])
        .await
        .expect("write after ROLLBACK TO");
    tx.execute(&a.insert(42), &[]).await.unwrap();
    tx.commit().await.unwrap();
    let n: i64 = a
        .direct
        .query_one(&format!("SELECT count(*) FROM {}", a.tbl), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 4);
}

/// Goal (robustness): with the documented setup (the table owned by the init role, the
/// client an application role granted by `init`), fenced writes work and the application role
/// can neither lower nor delete fence rows, directly or through the proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_robustness_app_role_grants() {
    let a = Attack::new(false, "attack").await;
    let role = pg::unique_name("app_role");
    a.direct
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN; GRANT ALL ON {t} TO {role}; \
             GRANT ALL ON SEQUENCE {t}_id_seq TO {role}; {grant}",
            t = a.tbl,
            grant = pg::grant_guard_sql(&role),
        ))
        .await
        .unwrap();
    let mut app = RawConn::connect(
        a.proxy.addr,
        &role,
        Some(&format!("-c lockd.fence={}:43", a.resource)),
    )
    .await;
    let w = app.query(&a.insert(42)).await;
    let table = pg::fence_table();
    let lower = app.query(&format!("UPDATE {table} SET token = 0")).await;
    let delete = app.query(&format!("DELETE FROM {table}")).await;
    let mut plain = RawConn::connect(a.proxy.addr, &role, None).await;
    let lower2 = plain.query(&format!("UPDATE {table} SET token = 0")).await;
    a.direct
        .batch_execute(&format!("DROP OWNED BY {role}; DROP ROLE {role}"))
        .await
        .ok();
    assert!(w.errors.is_empty(), "fenced write of the app role: {w:?}");
    for (what, r) in [
        ("UPDATE", lower),
        ("DELETE", delete),
        ("UPDATE unfenced", lower2),
    ] {
        assert_eq!(
            r.first_error(),
            "42501",
            "{what} of the fence table by the app role: {r:?}"
        );
    }
}

/// Goal (robustness): the number and total size of statement names the proxy tracks
/// per session are bounded.
/// Method: Parse transaction-control statements under 64 KiB names until the proxy refuses with
/// 54000 (program_limit_exceeded), well before 8 MiB of names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_robustness_unbounded_statement_names() {
    pg::require_postgres();
    let proxy = PgProxy::start(false);
    let mut c = RawConn::connect(proxy.addr, pg::PG_USER, None).await;
    let mut refused = None;
    for i in 0..128 {
        let name = format!("{i:04}{}", "n".repeat(64 * 1024));
        let mut out = bytes::BytesMut::new();
        wire::parse(&name, "COMMIT", &mut out);
        wire::sync(&mut out);
        c.send(&out).await;
        let r = c.read_until_ready().await;
        if !r.errors.is_empty() || r.status == b'X' {
            refused = Some((i, r));
            break;
        }
    }
    let (i, r) = refused.expect("128 names of 64 KiB were all tracked");
    assert_eq!(r.first_error(), "54000", "{r:?}");
    eprintln!("refused at name {i}: {:?}", r.errors);
}

/// Goal (design): a fence lowered inside a transaction is checked before COMMIT, over
/// the extended protocol too, and the failed COMMIT leaves the session idle as any failed COMMIT
/// does.
/// Method: the holder of 42 begins, writes, sets its fence to 41 inside the block, then sends
/// COMMIT as Parse/Bind/Execute/Sync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_fence_lowered_inside_the_transaction_fails_the_commit() {
    let a = Attack::new(false, "attack").await;
    let mut c = a.attacker(Some(42)).await;
    assert!(c.query("BEGIN").await.errors.is_empty());
    let w = c.query(&a.insert(41)).await;
    assert!(w.errors.is_empty(), "{w:?}");
    let s = c
        .query(&format!("SET lockd.fence = '{}:41'", a.resource))
        .await;
    assert!(s.errors.is_empty(), "{s:?}");
    let mut out = bytes::BytesMut::new();
    wire::run("COMMIT", &mut out);
    wire::sync(&mut out);
    c.send(&out).await;
    let r = c.read_until_ready().await;
    assert_eq!(r.first_error(), STALE, "{r:?}");
    assert_eq!(r.status, b'I', "{r:?}");
    a.assert_nothing_committed("COMMIT after lowering the fence")
        .await;
    // The session goes on: back to 42, a write commits.
    c.query(&format!("SET lockd.fence = '{}:42'", a.resource))
        .await;
    let w = c.query(&a.insert(42)).await;
    assert!(w.errors.is_empty(), "{w:?}");
}

/// Goal: a transaction whose only effect is a NOTIFY is fenced like one that wrote a row.
/// Postgres delivers a NOTIFY at commit and assigns the transaction no id before then, so a guard
/// that took no lock for "nothing written" let a stale session's notification reach listeners
/// after a newer holder's raise.
/// Method: the stale session opens a REPEATABLE READ block (its snapshot predates the raise),
/// token 2 raises the record and commits, then the stale session sends NOTIFY and COMMIT; a
/// direct listener must hear nothing, and the COMMIT must fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_notify_only_transaction_is_refused_at_commit() {
    pg::require_postgres();
    let proxy = PgProxy::start(false);
    let direct_config: tokio_postgres::Config = pg::direct_url().parse().unwrap();
    let (listener, mut connection) = direct_config
        .connect(tokio_postgres::NoTls)
        .await
        .expect("direct listener");
    let (note_tx, mut note_rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(m) = std::future::poll_fn(|cx| connection.poll_message(cx)).await {
            if let Ok(tokio_postgres::AsyncMessage::Notification(n)) = m {
                let _ = note_tx.send(n.payload().to_owned());
            }
        }
    });
    let channel = pg::unique_name("stalenotify");
    listener
        .batch_execute(&format!("LISTEN {channel}"))
        .await
        .unwrap();
    let tbl = pg::unique_name("stalenotify");
    listener
        .batch_execute(&format!("CREATE TABLE {tbl} (v int)"))
        .await
        .unwrap();
    let resource = pg::unique_name("stalenotify");
    let a = pg::connect(&proxy.config(Some(&format!("{resource}:1")))).await;
    a.execute(&format!("INSERT INTO {tbl} VALUES (1)"), &[])
        .await
        .expect("token 1 writes");
    a.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1")
        .await
        .expect("token 1 opens a block while it is current");
    let b = pg::connect(&proxy.config(Some(&format!("{resource}:2")))).await;
    b.execute(&format!("INSERT INTO {tbl} VALUES (2)"), &[])
        .await
        .expect("token 2 writes");
    a.batch_execute(&format!("NOTIFY {channel}, 'stale'"))
        .await
        .expect("NOTIFY only queues the notification");
    let committed = a.batch_execute("COMMIT").await;
    // Give a delivered notification time to arrive; a direct NOTIFY afterwards marks the end.
    listener
        .batch_execute(&format!("NOTIFY {channel}, 'end'"))
        .await
        .unwrap();
    let mut heard = Vec::new();
    while let Ok(Some(p)) = tokio::time::timeout(Duration::from_secs(5), note_rx.recv()).await {
        let end = p == "end";
        heard.push(p);
        if end {
            break;
        }
    }
    assert_eq!(
        heard,
        vec!["end".to_owned()],
        "the stale session's notification reached a listener (its COMMIT: {committed:?})"
    );
    let err = committed.expect_err("the stale COMMIT must fail");
    assert!(["55P03", "40001"].contains(&code(&err).as_str()), "{err:?}");
    listener
        .batch_execute(&format!("DROP TABLE {tbl}"))
        .await
        .unwrap();
}

/// Goal: the proxy's own errors name it once: `fence-proxy: ...`, as every other one does.
/// Method: switch the session to LATIN1 and send non-ASCII text, which the proxy refuses itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_encoding_names_the_proxy_once() {
    pg::require_postgres();
    let proxy = PgProxy::start(false);
    let c = pg::connect(&proxy.config(None)).await;
    c.batch_execute("SET client_encoding = 'LATIN1'")
        .await
        .expect("the encoding switch itself is plain SQL");
    let err = c.simple_query("SELECT 'é'").await.unwrap_err();
    assert_eq!(code(&err), "22021", "{err:?}");
    let msg = message(&err);
    assert!(
        msg.starts_with("fence-proxy: client_encoding is LATIN1"),
        "{msg}"
    );
    assert!(!msg.contains("fence-proxy: fence-proxy:"), "{msg}");
}

/// Goal: under READ COMMITTED, a holder's commit that wrote nothing (a lone NOTIFY) is still
/// ordered before a newer holder's raise: between the guard before COMMIT and the COMMIT (which
/// the proxy sends back to back) the raise must wait, as it waits for a commit that wrote.
/// Method: the proxy's calls made by hand on direct connections, to hold the window open: `a`
/// (token 1) queues a NOTIFY and passes the guard before COMMIT; `b` (token 2) runs its opening
/// guard, which raises the record; it must still be waiting after a second, and finish once `a`
/// commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raise_waits_for_an_older_commit_that_wrote_nothing() {
    pg::require_postgres();
    let table = fence_proxy_postgres::fence_sql::FenceTable::parse(&pg::fence_table()).unwrap();
    let resource = pg::unique_name("raisewaits");
    let direct: tokio_postgres::Config = pg::direct_url().parse().unwrap();
    let a = pg::connect(&direct).await;
    let b = pg::connect(&direct).await;
    let channel = pg::unique_name("raisewaits");
    a.batch_execute(&format!(
        "SET lockd.fence = '{resource}:1'; BEGIN; {}; COMMIT",
        table.guard_call(false, None, false)
    ))
    .await
    .expect("token 1 is recorded");
    a.batch_execute(&format!(
        "BEGIN; {}; NOTIFY {channel}, 'one'; {}",
        table.guard_call(false, None, false),
        table.guard_call(false, None, true)
    ))
    .await
    .expect("token 1 passes its guards");
    b.batch_execute(&format!("SET lockd.fence = '{resource}:2'"))
        .await
        .unwrap();
    let raise = format!("BEGIN; {}; COMMIT", table.guard_call(false, None, false));
    let raising = tokio::spawn(async move {
        let r = b.batch_execute(&raise).await;
        (b, r)
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        !raising.is_finished(),
        "token 2 raised the record while token 1's guarded commit was still to come"
    );
    a.batch_execute("COMMIT").await.expect("token 1 commits");
    let (_b, r) = tokio::time::timeout(Duration::from_secs(10), raising)
        .await
        .expect("the raise finishes once token 1 committed")
        .unwrap();
    r.expect("token 2 is recorded");
}

/// Goal: every guard the proxy sends right before a commit point says so (`at_commit`), and no
/// other guard does, on every path a transaction can end by: an implicit transaction in the
/// simple and the extended protocol, a lone COMMIT, a COMMIT at the end of a query, COMMIT AND
/// CHAIN, an extended-protocol COMMIT, and simple and extended COPY FROM STDIN. The guard treats
/// a commit that wrote nothing differently there (a NOTIFY must still be ordered), so a flag
/// left false is a hole no end-to-end race test could pin.
/// Method: a fence table of its own whose guard is replaced by a recorder that logs each call's
/// flag under the calling transaction's id; each committed transaction's calls must be some
/// opening guards (false) followed by exactly one guard before COMMIT (true).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_guard_before_a_commit_is_flagged_as_such() {
    use bytes::BytesMut;
    use futures::SinkExt;
    use postgres_protocol::message::frontend;
    pg::require_postgres();
    let schema = pg::unique_name("guardflags");
    let table_name = format!("{schema}.lockd_fence");
    pg::init_guard(&pg::direct_url(), &table_name);
    let table = fence_proxy_postgres::fence_sql::FenceTable::parse(&table_name).unwrap();
    let direct = pg::connect(&pg::direct_url().parse().unwrap()).await;
    let data = pg::unique_name("guardflags_data");
    direct
        .batch_execute(&format!(
            "CREATE TABLE {schema}.calls (seq bigserial, xid text, at_commit boolean);
             CREATE TABLE {data} (v int);
             CREATE OR REPLACE FUNCTION {guard}(require_fence boolean, proofs text[], at_commit boolean)
             RETURNS void LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $r$
             BEGIN
               INSERT INTO {schema}.calls (xid, at_commit) VALUES (pg_current_xact_id()::text, at_commit);
             END $r$;",
            guard = table.guard_function()
        ))
        .await
        .unwrap();
    let proxy = PgProxy::start_args(pg::proxy_args(pg::direct_url(), table_name, false));
    let fence = pg::unique_name("guardflags");
    let options = format!("-c lockd.fence={fence}:1");

    let mut raw = pg::RawConn::connect(proxy.addr, "postgres", Some(&options)).await;
    let insert = |v: i32| format!("INSERT INTO {data} VALUES ({v})");
    for (what, queries) in [
        ("implicit, simple", vec![insert(1)]),
        (
            "lone COMMIT",
            vec![format!("BEGIN; {}", insert(2)), "COMMIT".to_owned()],
        ),
        (
            "COMMIT ending a query",
            vec![format!("BEGIN; {}; COMMIT", insert(3))],
        ),
        (
            "COMMIT AND CHAIN",
            vec![
                format!("BEGIN; {}", insert(4)),
                "COMMIT AND CHAIN".to_owned(),
                insert(5),
                "COMMIT".to_owned(),
            ],
        ),
        ("NOTIFY only", vec![format!("NOTIFY {fence}")]),
    ] {
        for q in queries {
            let r = raw.query(&q).await;
            assert!(r.errors.is_empty(), "{what}: {q}: {:?}", r.errors);
        }
    }
    // Simple COPY FROM STDIN at `I`: the proxy's block ends after the copy.
    let mut out = BytesMut::new();
    frontend::query(&format!("COPY {data} FROM STDIN"), &mut out).unwrap();
    raw.send(&out).await;
    let mut out = BytesMut::new();
    frontend::CopyData::new(&b"6\n"[..])
        .unwrap()
        .write(&mut out);
    frontend::copy_done(&mut out);
    raw.send(&out).await;
    let r = raw.read_until_ready().await;
    assert!(r.errors.is_empty(), "simple COPY: {:?}", r.errors);

    // Extended protocol through a driver: an implicit transaction (commit at Sync), an
    // extended COMMIT, and COPY FROM STDIN.
    let c = pg::connect(&proxy.config(Some(&format!("{fence}:1")))).await;
    c.execute(&insert(7), &[])
        .await
        .expect("extended, implicit");
    c.execute("BEGIN", &[]).await.unwrap();
    c.execute(&insert(8), &[]).await.unwrap();
    c.execute("COMMIT", &[]).await.expect("extended COMMIT");
    let sink = c
        .copy_in(&format!("COPY {data} FROM STDIN"))
        .await
        .expect("extended COPY");
    futures::pin_mut!(sink);
    sink.send(bytes::Bytes::from_static(b"9\n")).await.unwrap();
    sink.finish().await.expect("extended COPY commits");

    let rows = direct
        .query(
            &format!("SELECT xid, at_commit FROM {schema}.calls ORDER BY seq"),
            &[],
        )
        .await
        .unwrap();
    let mut per_xid: Vec<(String, Vec<bool>)> = Vec::new();
    for row in rows {
        let (xid, at_commit): (String, bool) = (row.get(0), row.get(1));
        match per_xid.iter_mut().find(|(x, _)| *x == xid) {
            Some((_, flags)) => flags.push(at_commit),
            None => per_xid.push((xid, vec![at_commit])),
        }
    }
    let written: i64 = direct
        .query_one(&format!("SELECT count(*) FROM {data}"), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(written, 9, "every write above committed");
    // Ten transactions committed (the chain makes two of one block): nine that wrote a row
    // (two by COPY) and the NOTIFY.
    assert_eq!(per_xid.len(), 10, "{per_xid:?}");
    for (xid, flags) in &per_xid {
        let (last, opening) = flags.split_last().unwrap();
        assert!(
            *last && opening.iter().all(|f| !f),
            "transaction {xid}: guard flags {flags:?}, expected openings (false) then one true"
        );
    }
    direct
        .batch_execute(&format!("DROP TABLE {data}; DROP SCHEMA {schema} CASCADE"))
        .await
        .unwrap();
}

/// Goal: a fenced READ ONLY transaction commits at every isolation level; the guard before its
/// COMMIT orders it without a row lock, which Postgres refuses in a read-only transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_read_only_transactions_commit_at_every_isolation_level() {
    pg::require_postgres();
    let proxy = PgProxy::start(false);
    let resource = pg::unique_name("readonly");
    let c = pg::connect(&proxy.config(Some(&format!("{resource}:1")))).await;
    c.batch_execute("SELECT 1")
        .await
        .expect("token 1 is recorded");
    for begin in [
        "BEGIN ISOLATION LEVEL READ UNCOMMITTED READ ONLY",
        "BEGIN ISOLATION LEVEL READ COMMITTED READ ONLY",
        "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY",
        "BEGIN ISOLATION LEVEL SERIALIZABLE READ ONLY",
    ] {
        c.batch_execute(&format!("{begin}; SELECT 1"))
            .await
            .unwrap_or_else(|e| panic!("{begin}: {e:?}"));
        c.batch_execute("COMMIT")
            .await
            .unwrap_or_else(|e| panic!("COMMIT after {begin}: {e:?}"));
    }
}
