//! psql and the extended query protocol through the proxy: the same output as Postgres gives
//! directly, unfenced and fenced.

use std::time::Duration;

use lockd_tests::pg::{self, PgProxy};
use tokio_postgres::error::SqlState;

/// Goal: psql through the proxy prints exactly what it prints against Postgres directly, for
/// DDL, DML, COPY, transactions, queries and an error, unfenced and fenced.
/// Method: one script, run three times with different table names (direct, proxy, proxy with a
/// startup fence); the outputs, table names replaced, must be equal.
#[test]
fn psql_through_the_proxy_matches_direct() {
    lockd_tests::skip_without_postgres!();
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
    lockd_tests::skip_without_postgres!();
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
