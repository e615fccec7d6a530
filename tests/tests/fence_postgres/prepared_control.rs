//! Review of 2026-12-05, second round (two HIGH findings): transaction control that the upstream
//! holds as a prepared statement, run where the proxy does not see it, and client frames the proxy
//! and Postgres read differently.
//!
//! 1. A Parse frame with bytes after its parameter types fails in Postgres before the unnamed
//!    statement is replaced, but the proxy read only the name and the text and took the old
//!    unnamed statement for gone: a prepared COMMIT survived, ran at status `E` (which Postgres
//!    accepts) and ended the block, and the rest of the group ran in an implicit transaction.
//! 2. SQL `EXECUTE` of a protocol-prepared COMMIT or ROLLBACK TO was an ordinary statement to the
//!    proxy: it ended the guarded block (a zombie holder's rows committed after the new holder's
//!    raise) or undid the guard's read-only setting (an unfenced write under --require-fence).
//!
//! Setup per test: the `Attack` world (resource with token 42 recorded, rows carry the writer's
//! token); the attacker is fenced with the stale 41, or unfenced under `--require-fence`. The
//! oracle is the table: no row of 41 committed.

use bytes::BytesMut;
use lockd_tests::pg::{Attack, RawConn, wire};
use postgres_protocol::message::frontend;

/// The attacker's session: fenced with the stale 41, or unfenced under `--require-fence`.
async fn attacker(a: &Attack, require_fence: bool) -> RawConn {
    a.attacker((!require_fence).then_some(41)).await
}

/// A Parse of `sql` as statement `name`, no parameter types, with `extra` bytes after the
/// parameter count (which Postgres refuses: "invalid message format").
fn parse_with_trailing(name: &str, sql: &str, extra: &[u8]) -> BytesMut {
    let mut body = Vec::new();
    body.extend_from_slice(name.as_bytes());
    body.push(0);
    body.extend_from_slice(sql.as_bytes());
    body.push(0);
    body.extend_from_slice(&0i16.to_be_bytes());
    body.extend_from_slice(extra);
    wire::frame(b'P', &body)
}

/// Goal (finding 1): a Parse frame the proxy does not fully understand never reaches the
/// upstream, and a prepared COMMIT cannot outlive the proxy's belief that it is gone.
/// Method: `BEGIN`; in one group Parse `""` = `COMMIT`, then Parse `""` = `SELECT 1` with one
/// extra NUL after the parameter count, Sync (Postgres: ParseComplete, 08P01, status `E`); then
/// Bind `pc` of `""`, Execute `pc`, Parse/Bind/Execute of `INSERT ... (41)`, Sync. Before the fix
/// the COMMIT ran at `E` (a ROLLBACK), and the INSERT ran in an implicit transaction that the
/// Sync committed. Expected: the malformed frame ends the session with a FATAL 08P01 naming the
/// proxy, and no row of 41 is committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_malformed_parse_keeps_a_prepared_commit() {
    lockd_tests::skip_without_postgres!();
    let mut broken = Vec::new();
    for require_fence in [false, true] {
        let a = Attack::new(require_fence, "review").await;
        let mut c = attacker(&a, require_fence).await;
        let r = c.query("BEGIN").await;
        assert!(r.errors.is_empty(), "BEGIN: {r:?}");
        let mut out = BytesMut::new();
        wire::parse("", "COMMIT", &mut out);
        out.extend_from_slice(&parse_with_trailing("", "SELECT 1", b"\0"));
        wire::sync(&mut out);
        let r = c.exchange(&out).await;
        eprintln!("require_fence={require_fence}: Parse COMMIT, malformed Parse, Sync -> {r:?}");
        if r.status == b'X' {
            // The session is gone: nothing more can be sent on it.
            assert_eq!(r.first_error(), "08P01", "{r:?}");
            assert!(
                r.errors[0].1.starts_with("fence-proxy: "),
                "a proxy-made error: {r:?}"
            );
        } else {
            let mut out = BytesMut::new();
            wire::bind("pc", "", &mut out);
            wire::execute("pc", &mut out);
            wire::parse("w", &a.insert(41), &mut out);
            wire::bind("pw", "w", &mut out);
            wire::execute("pw", &mut out);
            wire::sync(&mut out);
            let r = c.exchange(&out).await;
            eprintln!("require_fence={require_fence}: Bind/Execute pc, INSERT, Sync -> {r:?}");
            broken.push(format!(
                "require_fence={require_fence}: the proxy forwarded a malformed Parse and kept the session"
            ));
        }
        a.check(
            &format!("require_fence={require_fence}: prepared COMMIT kept by a malformed Parse"),
            &mut broken,
        )
        .await;
    }
    assert!(broken.is_empty(), "{broken:#?}");
}

/// Goal (finding 2a): a zombie holder cannot end its block with SQL `EXECUTE` of a prepared
/// COMMIT, so the guard before every commit point holds.
/// Method: a proxy without --require-fence; the attacker holds `r:41` of a resource of its own
/// and is current at first (a first query records 41); Parse `c` = `COMMIT`, Sync; `BEGIN`;
/// `INSERT ... (41)` (the opening guard passes and takes no lock); a new holder records 42 and
/// commits; `EXECUTE c`; `COMMIT`. Before the fix `EXECUTE c` committed the row of 41 after 42.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_sql_execute_of_prepared_commit_by_a_zombie() {
    lockd_tests::skip_without_postgres!();
    let a = Attack::new(false, "review").await;
    let resource = format!("{}_z", a.resource);
    let mut c = a.session(Some(&format!("{resource}:41"))).await;
    let r = c.query("SELECT 1").await;
    assert!(r.errors.is_empty(), "first query records 41: {r:?}");
    let mut out = BytesMut::new();
    wire::parse("c", "COMMIT", &mut out);
    wire::sync(&mut out);
    let r = c.exchange(&out).await;
    assert!(r.errors.is_empty(), "Parse c = COMMIT: {r:?}");
    for sql in ["BEGIN".to_owned(), a.insert(41)] {
        let r = c.query(&sql).await;
        assert!(r.errors.is_empty(), "{sql} while current: {r:?}");
    }
    let holder = lockd_tests::pg::connect(&a.proxy.config(Some(&format!("{resource}:42")))).await;
    holder
        .execute(&a.insert(42), &[])
        .await
        .expect("the new holder of 42 writes");
    let r = c.query("EXECUTE c").await;
    eprintln!("EXECUTE c -> {r:?}");
    let r = c.query("COMMIT").await;
    eprintln!("COMMIT -> {r:?}");
    assert_eq!(
        a.rows_with_token(41).await,
        0,
        "a row of the zombie's token 41 committed after 42 was recorded"
    );
}

/// Goal (finding 2b): under --require-fence an unfenced session cannot undo the guard's
/// read-only setting with SQL `EXECUTE` of a prepared ROLLBACK TO, nor commit with a prepared
/// COMMIT.
/// Method: Parse `rt` = `ROLLBACK TO SAVEPOINT sp` and `c` = `COMMIT`, Sync; `BEGIN`;
/// `SAVEPOINT sp`; `SELECT 1` (the guard makes the transaction read-only inside `sp`);
/// `EXECUTE rt`; `INSERT ... (41)`; `EXECUTE c`. Before the fix the row committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_sql_execute_of_prepared_rollback_to_undoes_read_only() {
    lockd_tests::skip_without_postgres!();
    let a = Attack::new(true, "review").await;
    let mut c = a.attacker(None).await;
    let mut out = BytesMut::new();
    wire::parse("rt", "ROLLBACK TO SAVEPOINT sp", &mut out);
    wire::parse("c", "COMMIT", &mut out);
    wire::sync(&mut out);
    let r = c.exchange(&out).await;
    assert!(r.errors.is_empty(), "Parse rt, c: {r:?}");
    for sql in [
        "BEGIN".to_owned(),
        "SAVEPOINT sp".to_owned(),
        "SELECT 1".to_owned(),
        "EXECUTE rt".to_owned(),
        a.insert(41),
        "EXECUTE c".to_owned(),
    ] {
        let r = c.query(&sql).await;
        eprintln!("{sql} -> {r:?}");
    }
    let r = c.query("ROLLBACK").await;
    eprintln!("ROLLBACK -> {r:?}");
    a.assert_nothing_committed("EXECUTE of prepared ROLLBACK TO and COMMIT under --require-fence")
        .await;
}

/// Goal: the proxy may rely on SQL `PREPARE` never preparing transaction control (only a
/// protocol Parse can, and the proxy sees every Parse). Method: `PREPARE x AS <each kind>`
/// directly against Postgres: each is a syntax error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_prepare_refuses_transaction_control() {
    lockd_tests::skip_without_postgres!();
    let direct = lockd_tests::pg::connect(&lockd_tests::pg::direct_url().parse().unwrap()).await;
    for control in [
        "BEGIN",
        "START TRANSACTION",
        "COMMIT",
        "END",
        "ROLLBACK",
        "ABORT",
        "SAVEPOINT s",
        "RELEASE SAVEPOINT s",
        "ROLLBACK TO SAVEPOINT s",
        "PREPARE TRANSACTION 'g'",
        "COMMIT PREPARED 'g'",
        "ROLLBACK PREPARED 'g'",
        "EXECUTE y",
    ] {
        let e = direct
            .batch_execute(&format!("PREPARE lockd_review_x AS {control}"))
            .await
            .expect_err(control);
        assert_eq!(super::code(&e), "42601", "PREPARE x AS {control}: {e:?}");
    }
}

/// Goal: prepared transaction control still works through the proxy as it does directly, now
/// that the proxy runs it in the client's place: named and unnamed, Describe answering NoData,
/// command tags as Postgres gives them, ROLLBACK in a failed block (pgjdbc's way), savepoints,
/// and SQL `EXECUTE` of such a name refused with a clear error.
/// Method: a fenced, current session of a resource of its own, through the proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_transaction_control_works_in_the_clients_place() {
    lockd_tests::skip_without_postgres!();
    let a = Attack::new(false, "control").await;
    let resource = format!("{}_own", a.resource);
    let mut c = a.session(Some(&format!("{resource}:7"))).await;
    let mut out = BytesMut::new();
    for (name, sql) in [
        ("b", "BEGIN"),
        ("s", "SAVEPOINT sp"),
        ("rt", "ROLLBACK TO SAVEPOINT sp"),
        ("rel", "RELEASE SAVEPOINT sp"),
        ("c", "COMMIT"),
        ("r", "ROLLBACK"),
    ] {
        wire::parse(name, sql, &mut out);
        frontend::describe(b'S', name, &mut out).unwrap();
    }
    wire::sync(&mut out);
    let r = c.exchange(&out).await;
    assert!(r.errors.is_empty(), "{r:?}");
    // ParseComplete, ParameterDescription, NoData, six times.
    assert_eq!(r.tags, b"1tn".repeat(6), "{r:?}");
    let run = |names: &[&str], out: &mut BytesMut| {
        for name in names {
            wire::bind("", name, out);
            wire::execute("", out);
        }
    };
    // A transaction with a savepoint rolled back to: the row of the first INSERT stays.
    let mut out = BytesMut::new();
    run(&["b"], &mut out);
    wire::run(&a.insert(7), &mut out);
    run(&["s"], &mut out);
    wire::run(&a.insert(7), &mut out);
    run(&["rt", "rel", "c"], &mut out);
    wire::sync(&mut out);
    let r = c.exchange(&out).await;
    assert!(r.errors.is_empty(), "{r:?}");
    assert_eq!(
        r.completions,
        [
            "BEGIN",
            "INSERT 0 1",
            "SAVEPOINT",
            "INSERT 0 1",
            "ROLLBACK",
            "RELEASE",
            "COMMIT"
        ],
        "{r:?}"
    );
    assert_eq!(r.status, b'I');
    assert_eq!(a.rows_with_token(7).await, 1);
    // A failed block ended with a prepared ROLLBACK, and the unnamed statement at `E`.
    let r = c.query("BEGIN").await;
    assert!(r.errors.is_empty(), "{r:?}");
    let r = c.query("SELECT 1/0").await;
    assert_eq!(r.first_error(), "22012", "{r:?}");
    assert_eq!(r.status, b'E');
    let mut out = BytesMut::new();
    wire::run("ROLLBACK", &mut out);
    wire::sync(&mut out);
    let r = c.exchange(&out).await;
    assert!(r.errors.is_empty(), "{r:?}");
    assert_eq!(r.completions, ["ROLLBACK"], "{r:?}");
    assert_eq!(r.status, b'I');
    // A prepared COMMIT of a failed block rolls back, as directly.
    for sql in ["BEGIN", "SELECT 1/0"] {
        let _ = c.query(sql).await;
    }
    let mut out = BytesMut::new();
    run(&["c"], &mut out);
    wire::sync(&mut out);
    let r = c.exchange(&out).await;
    assert!(r.errors.is_empty(), "{r:?}");
    assert_eq!(r.completions, ["ROLLBACK"], "{r:?}");
    assert_eq!(r.status, b'I');
    // SQL EXECUTE of a protocol-prepared transaction statement: refused, clearly.
    let r = c.query("BEGIN").await;
    assert!(r.errors.is_empty(), "{r:?}");
    let r = c.query("EXECUTE c").await;
    assert_eq!(r.first_error(), "0A000", "{r:?}");
    assert!(r.errors[0].1.starts_with("fence-proxy: "), "{r:?}");
    let r = c.query("ROLLBACK").await;
    assert!(r.errors.is_empty(), "{r:?}");
    assert_eq!(r.status, b'I');
    // The proxy's placeholder savepoint name is the proxy's own.
    let r = c.query("BEGIN; SAVEPOINT __lockd_fence_proxy_x").await;
    assert_eq!(r.first_error(), "42939", "{r:?}");
    let _ = c.query("ROLLBACK").await;
}

/// Goal: after a failed Parse of the unnamed statement the proxy does not know whether the old
/// one is still there, so a Bind of it is refused until a Parse succeeds (fail closed).
/// Method: Parse `""` = `SELECT 1`, Sync; Parse `""` with a syntax error, Sync; Bind/Execute
/// `""`, Sync (refused by the proxy, session usable); Parse/Bind/Execute again (works).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bind_after_a_failed_unnamed_parse_is_refused() {
    lockd_tests::skip_without_postgres!();
    let a = Attack::new(false, "control").await;
    let mut c = a.attacker(None).await;
    let mut out = BytesMut::new();
    wire::parse("", "SELECT 1", &mut out);
    wire::sync(&mut out);
    let r = c.exchange(&out).await;
    assert!(r.errors.is_empty(), "{r:?}");
    let mut out = BytesMut::new();
    wire::parse("", "SELEC 1", &mut out);
    wire::sync(&mut out);
    let r = c.exchange(&out).await;
    assert_eq!(r.first_error(), "42601", "{r:?}");
    let mut out = BytesMut::new();
    wire::bind("", "", &mut out);
    wire::execute("", &mut out);
    wire::sync(&mut out);
    let r = c.exchange(&out).await;
    assert_eq!(r.first_error(), "26000", "{r:?}");
    assert!(r.errors[0].1.starts_with("fence-proxy: "), "{r:?}");
    assert_eq!(r.status, b'I');
    let mut out = BytesMut::new();
    wire::run("SELECT 2", &mut out);
    wire::sync(&mut out);
    let r = c.exchange(&out).await;
    assert!(r.errors.is_empty(), "{r:?}");
    assert_eq!(r.completions, ["SELECT 1"], "{r:?}");
}

/// Goal: every client frame is read completely, as Postgres reads it, and a frame the proxy
/// does not fully understand ends the session with a proxy-made FATAL 08P01 instead of going
/// upstream. Method: one fresh session per malformed frame (bytes after the last field, short
/// fields, counts that do not match, an unknown Describe variant, an unknown message type),
/// each sent after `BEGIN` and an INSERT of 41 in that block (so anything forwarded after it
/// could commit it); the reply, then the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_end_the_session() {
    lockd_tests::skip_without_postgres!();
    let mut bind_formats = Vec::new();
    bind_formats.extend_from_slice(b"\0\0");
    bind_formats.extend_from_slice(&2i16.to_be_bytes());
    bind_formats.extend_from_slice(&[0, 0, 0, 0]);
    bind_formats.extend_from_slice(&0i16.to_be_bytes());
    bind_formats.extend_from_slice(&0i16.to_be_bytes());
    let frames: Vec<(&str, BytesMut)> = vec![
        (
            "Parse with a byte after its types",
            parse_with_trailing("", "SELECT 1", b"\0"),
        ),
        (
            "Parse declaring a type it does not carry",
            wire::frame(b'P', b"\0SELECT 1\0\0\x01"),
        ),
        (
            "Parse without its count",
            wire::frame(b'P', b"\0SELECT 1\0"),
        ),
        (
            "Bind with two formats for no parameter",
            wire::frame(b'B', &bind_formats),
        ),
        (
            "Bind with a byte at the end",
            wire::frame(b'B', b"\0\0\0\0\0\0\0\0\0"),
        ),
        (
            "Execute with a byte at the end",
            wire::frame(b'E', b"\0\0\0\0\0\0"),
        ),
        ("Execute without its row count", wire::frame(b'E', b"\0")),
        ("Describe of an unknown variant", wire::frame(b'D', b"X\0")),
        ("Close with a byte at the end", wire::frame(b'C', b"S\0\0")),
        ("Sync with a body", wire::frame(b'S', b"\0")),
        ("Flush with a body", wire::frame(b'H', b"x")),
        (
            "Query with a byte after its NUL",
            wire::frame(b'Q', b"COMMIT\0\0"),
        ),
        ("Query without its NUL", wire::frame(b'Q', b"COMMIT")),
        (
            "FunctionCall with a byte at the end",
            wire::frame(b'F', b"\0\0\0\x01\0\0\0\0\0\0\0"),
        ),
        ("an unknown message type", wire::frame(b'y', b"")),
    ];
    let mut broken = Vec::new();
    for require_fence in [false, true] {
        let a = Attack::new(require_fence, "frames").await;
        for (what, bytes) in &frames {
            let mut c = attacker(&a, require_fence).await;
            let r = c.query("BEGIN").await;
            assert!(r.errors.is_empty(), "{r:?}");
            let _ = c.query(&a.insert(41)).await;
            let mut out = bytes.clone();
            wire::sync(&mut out);
            wire::run("COMMIT", &mut out);
            wire::sync(&mut out);
            let r = c.exchange(&out).await;
            eprintln!("require_fence={require_fence}: {what} -> {r:?}");
            let fatal = r.status == b'X'
                && r.first_error() == "08P01"
                && r.errors[0].1.starts_with("fence-proxy: ");
            if !fatal {
                broken.push(format!(
                    "require_fence={require_fence}: {what}: not refused by the proxy: {r:?}"
                ));
            }
        }
        a.check(
            &format!("require_fence={require_fence}: malformed frames"),
            &mut broken,
        )
        .await;
    }
    assert!(broken.is_empty(), "{broken:#?}");
}
