//! Under `--require-fence`, what a COMMIT runs after the guard: a WITH HOLD cursor's query.

use lockd_tests::pg::{self, Attack};

/// Goal: under `--require-fence` an unfenced session commits no write, including through the
/// client code a COMMIT itself runs, after the proxy's guard. The guard makes such a transaction
/// READ ONLY, but Postgres 15 lets a READ ONLY transaction create and write large objects, and a
/// WITH HOLD cursor's query runs (is materialized) during COMMIT.
/// Method: a proxy with `--require-fence`; unfenced sessions declare `CURSOR WITH HOLD FOR
/// SELECT lo_from_bytea(0, <marker>)` as one Query, in an explicit block, through a SQL
/// function and through a DO block's EXECUTE; then count large objects holding the marker,
/// directly. A fenced session (the current holder) keeps its WITH HOLD cursors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_a_with_hold_cursor_writes_nothing_at_commit_without_a_fence() {
    lockd_tests::skip_without_postgres!();
    let a = Attack::new(true, "held").await;
    let marker = pg::unique_name("unfenced_lo");
    let lo = format!("pg_catalog.lo_from_bytea(0, '{marker}'::bytea)");
    // Made directly: a CREATE FUNCTION through the proxy is itself an unfenced write.
    let function = pg::unique_name("held_fn");
    a.direct
        .batch_execute(&format!(
            "CREATE FUNCTION public.{function}() RETURNS void LANGUAGE sql \
             AS $f$ DECLARE c3 CURSOR WITH HOLD FOR SELECT {lo} $f$"
        ))
        .await
        .unwrap();
    let variants = [
        (
            "one Query",
            vec![format!("DECLARE c1 CURSOR WITH HOLD FOR SELECT {lo}")],
        ),
        (
            "an explicit block",
            vec![
                "BEGIN".to_owned(),
                format!("DECLARE c2 CURSOR WITH HOLD FOR SELECT {lo}"),
                "COMMIT".to_owned(),
            ],
        ),
        (
            "a SQL function",
            vec![format!("SELECT public.{function}()")],
        ),
        (
            "a DO block",
            vec![format!(
                "DO $d$ BEGIN EXECUTE 'DECLARE c4 CURSOR WITH HOLD FOR SELECT {}'; END $d$",
                lo.replace('\'', "''")
            )],
        ),
    ];
    let count = || async {
        let n: i64 = a
            .direct
            .query_one(
                "SELECT count(DISTINCT loid) FROM pg_catalog.pg_largeobject \
                 WHERE data = $1::text::bytea",
                &[&marker],
            )
            .await
            .unwrap()
            .get(0);
        n
    };
    let mut broken = Vec::new();
    for (what, queries) in variants {
        let before = count().await;
        let mut c = a.attacker(None).await;
        let mut last = Default::default();
        for q in &queries {
            last = c.query(q).await;
        }
        let objects = count().await - before;
        eprintln!("{what}: {last:?}, large objects committed: {objects}");
        if objects != 0 {
            broken.push(format!("{what}: {objects} large object(s) committed"));
        }
    }
    a.direct
        .batch_execute(&format!(
            "SELECT pg_catalog.lo_unlink(l.loid) FROM (SELECT DISTINCT loid \
             FROM pg_catalog.pg_largeobject WHERE data = '{marker}'::bytea) AS l; \
             DROP FUNCTION public.{function}()"
        ))
        .await
        .unwrap();
    assert!(broken.is_empty(), "unfenced writes committed: {broken:?}");

    // The current holder may keep a WITH HOLD cursor past its commit and read it later.
    let mut holder = a.attacker(Some(42)).await;
    let declared = holder
        .query("DECLARE h CURSOR WITH HOLD FOR SELECT 1")
        .await;
    assert_eq!(declared.first_error(), "", "{declared:?}");
    let fetched = holder.query("FETCH ALL h").await;
    assert_eq!(fetched.first_error(), "", "{fetched:?}");
}

/// Goal: a holder superseded during a REPEATABLE READ, READ ONLY transaction commits no write.
/// Its guard before COMMIT reads the fence row from the transaction's snapshot, which predates
/// the newer holder's raise; that is safe only while the transaction writes nothing, and a WITH
/// HOLD cursor's query runs (and may write a large object) during COMMIT, after the guard.
/// Method: the holder of 42 opens `BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY` and reads
/// (the opening guard takes the snapshot); the holder of 43 writes (raises); the first declares
/// `CURSOR WITH HOLD FOR SELECT lo_from_bytea(0, <marker>)` and commits. No large object may
/// hold the marker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_a_superseded_repeatable_read_transaction_writes_nothing_at_commit() {
    lockd_tests::skip_without_postgres!();
    let a = Attack::new(false, "held_rr").await;
    let marker = pg::unique_name("stale_lo");
    let mut old = a.attacker(Some(42)).await;
    for q in [
        "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY",
        &format!("SELECT count(*) FROM {}", a.tbl),
    ] {
        let r = old.query(q).await;
        assert_eq!(r.first_error(), "", "{q}: {r:?}");
    }
    let mut newer = a.attacker(Some(43)).await;
    let raised = newer.query(&a.insert(43)).await;
    assert_eq!(
        raised.first_error(),
        "",
        "the holder of 43 writes: {raised:?}"
    );
    let declared = old
        .query(&format!(
            "DECLARE c CURSOR WITH HOLD FOR SELECT pg_catalog.lo_from_bytea(0, '{marker}'::bytea)"
        ))
        .await;
    let committed = old.query("COMMIT").await;
    let objects: i64 = a
        .direct
        .query_one(
            "SELECT count(DISTINCT loid) FROM pg_catalog.pg_largeobject WHERE data = $1::text::bytea",
            &[&marker],
        )
        .await
        .unwrap()
        .get(0);
    eprintln!("declare: {declared:?}; commit: {committed:?}; large objects: {objects}");
    a.direct
        .batch_execute(&format!(
            "SELECT pg_catalog.lo_unlink(l.loid) FROM (SELECT DISTINCT loid \
             FROM pg_catalog.pg_largeobject WHERE data = '{marker}'::bytea) AS l"
        ))
        .await
        .unwrap();
    assert_eq!(
        objects, 0,
        "the superseded holder of 42 committed a large object after 43"
    );
}
