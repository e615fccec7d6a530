//! The opening guard runs again before the next data statement after anything that may have
//! undone it or changed what it checked, also inside one simple Query: a ROLLBACK TO (which
//! undoes the guard's row lock and read-only setting) and a SET of `lockd.fence`. Found in the
//! reviews of 2026-12-03 (issue 13): the proxy guarded only once per Query, before its first
//! data statement, so `ROLLBACK TO s; SELECT nextval(...)` after a failed guard, or `SET
//! lockd.fence = '<stale>'; SELECT nextval(...)`, ran the statement (only the guard before
//! COMMIT refused the transaction; a sequence does not roll back), and under `--require-fence`
//! `SET lockd.fence = '<current>'; INSERT ...` failed as read-only.

use bytes::BytesMut;
use lockd_tests::pg::{self, Attack, wire};

/// The current value of the attack's sequence (`last_value`).
async fn sequence_value(attack: &Attack) -> i64 {
    attack
        .direct
        .query_one(&format!("SELECT last_value FROM {}_seq", attack.tbl), &[])
        .await
        .unwrap()
        .get(0)
}

/// Attack: a stale session (41 against 42) advances a sequence, which no rollback undoes, after
/// its guard failed (ROLLBACK TO in the same Query), or after setting its stale fence in the
/// same Query, over the simple and the extended protocol. Oracle: the sequence never moves and
/// the statement fails with the stale-token error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_session_is_refused_before_its_statement_after_rollback_to_or_set() {
    lockd_tests::skip_without_postgres!();
    let attack = Attack::new(false, "reguard").await;
    attack
        .direct
        .batch_execute(&format!("CREATE SEQUENCE {}_seq", attack.tbl))
        .await
        .unwrap();
    let before = sequence_value(&attack).await;
    let nextval = format!("SELECT nextval('{}_seq')", attack.tbl);
    let fence = |token: u64| format!("SET lockd.fence = '{}:{token}'", attack.resource);

    // ROLLBACK TO in the same Query as the statement, after the guard failed.
    let mut stale = attack.attacker(Some(41)).await;
    assert_eq!(stale.query("BEGIN; SAVEPOINT s").await.status, b'T');
    let failed = stale.query("SELECT 1").await;
    assert_eq!(failed.first_error(), "55P03", "{failed:?}");
    let reply = stale.query(&format!("ROLLBACK TO s; {nextval}")).await;
    assert_eq!(
        reply.first_error(),
        "55P03",
        "ROLLBACK TO then nextval: {reply:?}"
    );
    assert_eq!(stale.query("ROLLBACK").await.status, b'I');

    // A stale fence set in the same Query as the statement, by a session that had none.
    let mut unfenced = attack.attacker(None).await;
    let reply = unfenced.query(&format!("{}; {nextval}", fence(41))).await;
    assert_eq!(reply.first_error(), "55P03", "SET then nextval: {reply:?}");

    // The same over the extended protocol, inside a block the current fence guarded first.
    let mut holder = attack.attacker(Some(42)).await;
    let mut out = BytesMut::new();
    wire::run("BEGIN", &mut out);
    wire::run("SELECT 1", &mut out);
    wire::run(&fence(41), &mut out);
    wire::run(&nextval, &mut out);
    wire::sync(&mut out);
    holder.send(&out).await;
    let reply = holder.read_until_ready().await;
    assert_eq!(
        reply.first_error(),
        "55P03",
        "extended SET then nextval: {reply:?}"
    );

    assert_eq!(
        sequence_value(&attack).await,
        before,
        "a stale session advanced the sequence"
    );
}

/// Goal: under `--require-fence`, a session that sets its (current) fence and writes in one
/// simple Query writes: the guard runs after the SET, not before it (where it found no fence and
/// made the transaction read-only). Method: `SET lockd.fence = '<resource>:42'; INSERT ...` by
/// a session that connected without a fence; the row commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_set_in_the_same_query_as_the_write_guards_it() {
    lockd_tests::skip_without_postgres!();
    let attack = Attack::new(true, "reguard_require").await;
    let mut session = attack.attacker(None).await;
    let reply = session
        .query(&format!(
            "SET lockd.fence = '{}:42'; {}",
            attack.resource,
            attack.insert(42)
        ))
        .await;
    assert!(reply.errors.is_empty(), "{reply:?}");
    assert_eq!(reply.status, b'I', "{reply:?}");
    let rows = attack.rows_with_token(42).await;
    assert_eq!(rows, 2, "the holder's first row and this one");
}

/// Goal: the guards the proxy splices into one Query are bounded (`MAX_GUARDS_PER_QUERY`, 64): a
/// Query of short `SET lockd.fence = ''; SELECT 1;` pairs, each needing a guard of its own, is
/// refused with 54000 before anything of it runs, and the session goes on; 64 pairs run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_guards_spliced_into_one_query_are_bounded() {
    lockd_tests::skip_without_postgres!();
    let attack = Attack::new(false, "reguard_bound").await;
    let mut session = attack.attacker(None).await;
    let pairs = |n: usize| "SET lockd.fence = ''; SELECT 1; ".repeat(n);
    let refused = session.query(&pairs(65)).await;
    assert_eq!(refused.first_error(), "54000", "{refused:?}");
    assert!(refused.completions.is_empty(), "nothing ran: {refused:?}");
    assert_eq!(refused.status, b'I');
    let ran = session.query(&pairs(64)).await;
    assert!(ran.errors.is_empty(), "{ran:?}");
    assert_eq!(ran.completions.len(), 128, "{ran:?}");
    assert_eq!(ran.status, b'I');
}

/// Goal: an error's cursor points where it would directly, although the proxy put its own BEGIN
/// and guards into the client's Query text (and dropped a leading client BEGIN). Method: the
/// same failing simple Queries (an unknown column after statements of every kind the proxy
/// splices around, one with non-ASCII text before it) directly and through the proxy, each on a
/// fresh session; the SQLSTATE and `P` of the errors must be equal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_cursors_point_into_the_clients_text() {
    lockd_tests::skip_without_postgres!();
    let attack = Attack::new(false, "reguard_cursor").await;
    let queries = [
        "SELECT nosuchcol FROM pg_class".to_owned(),
        "SELECT 1; SELECT nosuchcol FROM pg_class".to_owned(),
        "BEGIN; SELECT 1; SELECT nosuchcol FROM pg_class".to_owned(),
        "START TRANSACTION ISOLATION LEVEL REPEATABLE READ; SELECT nosuchcol FROM pg_class"
            .to_owned(),
        "/* ünïcode */ BEGIN; SAVEPOINT x; SELECT 1; ROLLBACK TO x; SELECT nosuchcol FROM pg_class"
            .to_owned(),
        format!(
            "SET lockd.fence = '{}:42'; SELECT nosuchcol FROM pg_class",
            attack.resource
        ),
        "SELECT 1; SELECT nosuchcol FROM pg_class; COMMIT".to_owned(),
    ];
    let direct_config: tokio_postgres::Config = pg::direct_url().parse().unwrap();
    let proxy_config = attack.proxy.config(None);
    for sql in &queries {
        let mut seen = Vec::new();
        for config in [&direct_config, &proxy_config] {
            let client = pg::connect(config).await;
            let e = client
                .batch_execute(sql)
                .await
                .expect_err("an unknown column");
            let db = e.as_db_error().expect("a server error");
            seen.push((db.code().code().to_owned(), format!("{:?}", db.position())));
        }
        assert_eq!(seen[1], seen[0], "{sql}: through the proxy / directly");
        assert_eq!(seen[0].0, "42703", "{sql}");
    }
}
