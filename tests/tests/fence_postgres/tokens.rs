//! Fencing tokens through the proxy: a stale token is refused while newer rows stay, and holders
//! that take turns never overlap.

use std::time::Duration;

use crate::{STALE, code, message};
use lockd_tests::pg::{self, PgProxy};

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
    lockd_tests::skip_without_postgres!();
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
    lockd_tests::skip_without_postgres!();
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
    // A fixed wait: what is checked is that the write does not finish in it.
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
    // A fixed wait: what is checked is that the write does not finish in it.
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
    // The writers get going before B records 42: they race B's commit, which is the point.
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
