//! Review of 2026-12-05, second round (follow-up): the proxy's own prepared statement and portal
//! names, and names the proxy and Postgres read differently.
//!
//! 1. (HIGH) The proxy runs its own statements as Close S, Parse `__lockd_fence_proxy_s`, Bind
//!    `__lockd_fence_proxy_p`, Execute, Close P, Close S. When its Bind or Execute failed, the
//!    upstream skipped the Closes up to Sync and kept `__lockd_fence_proxy_s` holding the
//!    proxy's text (a real `COMMIT`) while client code ran; SQL `EXECUTE` of it (from the
//!    client's text, or from dynamic SQL the proxy cannot see) ended the guarded block
//!    unguarded. Ways to make the internal group fail: a client portal or cursor named
//!    `__lockd_fence_proxy_p` (the proxy's Bind fails 42P03), a deferred constraint violated
//!    at the proxy's COMMIT.
//! 2. (HIGH) Statement and portal names were keyed by their raw bytes, but Postgres converts
//!    them from `client_encoding`: `"\xe9"` under LATIN1 and `"\xc3\xa9"` under UTF8 are one
//!    server statement and two proxy entries, so a name the proxy took for SHOW could hold an
//!    INSERT, which then ran without its opening guard.
//! 3. (LOW) A client name colliding with the proxy's made every internal statement fail.
//!
//! The oracle is the table (no row of the stale token 41 committed) and, for 2, that a stale
//! session's data statement never runs before its guard.

use bytes::BytesMut;
use lockd_tests::pg::{Attack, RawConn, RawReply, wire};

const S: &str = "__lockd_fence_proxy_s";
const P: &str = "__lockd_fence_proxy_p";

/// A Parse of `sql` under the raw statement name `name`.
fn raw_parse(name: &[u8], sql: &str) -> BytesMut {
    let mut body = Vec::new();
    body.extend_from_slice(name);
    body.push(0);
    body.extend_from_slice(sql.as_bytes());
    body.push(0);
    body.extend_from_slice(&0i16.to_be_bytes());
    wire::frame(b'P', &body)
}

/// A Bind of the unnamed portal to the raw statement name `statement`, no parameters.
fn raw_bind(statement: &[u8]) -> BytesMut {
    let mut body = vec![0u8];
    body.extend_from_slice(statement);
    body.push(0);
    body.extend_from_slice(&0i16.to_be_bytes());
    body.extend_from_slice(&0i16.to_be_bytes());
    body.extend_from_slice(&0i16.to_be_bytes());
    wire::frame(b'B', &body)
}

/// A Close of the raw statement name `name`.
fn raw_close_statement(name: &[u8]) -> BytesMut {
    let mut body = vec![b'S'];
    body.extend_from_slice(name);
    body.push(0);
    wire::frame(b'C', &body)
}

/// The session's prepared statements as `name=statement`, read through the session itself.
async fn prepared(c: &mut RawConn) -> RawReply {
    c.query("SELECT name, statement FROM pg_prepared_statements")
        .await
}

/// Whether the session's upstream holds the proxy's statement (asked through the session itself;
/// `None` when the query fails).
async fn holds_internal_statement(c: &mut RawConn) -> Option<bool> {
    let r = c
        .query(&format!(
            "SELECT 1 FROM pg_prepared_statements WHERE name = '{S}'"
        ))
        .await;
    if !r.errors.is_empty() {
        return None;
    }
    Some(r.tags.contains(&b'D'))
}

/// Leaves the upstream's `__lockd_fence_proxy_s` holding a COMMIT through a failed internal Bind,
/// the portal name taken by `take_portal` (a protocol Bind, or a cursor opened by dynamic SQL).
/// Steps: `BEGIN`; the portal is taken; a failed Parse puts the block at `E`; Parse `c` =
/// `COMMIT`, Bind/Execute of it (the proxy runs its own COMMIT, whose Bind fails 42P03);
/// `ROLLBACK`.
async fn leave_internal_commit(c: &mut RawConn, dynamic: bool) -> Vec<String> {
    let mut log = Vec::new();
    let r = c.query("BEGIN").await;
    log.push(format!("BEGIN -> {r:?}"));
    if dynamic {
        let r = c
            .query(&format!(
                "DO $$DECLARE k refcursor := '{P}'; BEGIN OPEN k FOR SELECT 1; END$$"
            ))
            .await;
        log.push(format!("DO: open cursor {P} -> {r:?}"));
    } else {
        let mut out = BytesMut::new();
        wire::parse("x", "SELECT 1", &mut out);
        wire::bind(P, "x", &mut out);
        wire::sync(&mut out);
        let r = c.exchange(&out).await;
        log.push(format!("Parse x, Bind {P} from x, Sync -> {r:?}"));
    }
    let mut out = BytesMut::new();
    wire::parse("", "SELEC", &mut out);
    wire::sync(&mut out);
    let r = c.exchange(&out).await;
    log.push(format!("Parse \"\" = SELEC, Sync -> {r:?}"));
    let mut out = BytesMut::new();
    wire::parse("c", "COMMIT", &mut out);
    wire::bind("", "c", &mut out);
    wire::execute("", &mut out);
    wire::sync(&mut out);
    let r = c.exchange(&out).await;
    log.push(format!("Parse c = COMMIT, Bind, Execute, Sync -> {r:?}"));
    let r = c.query("ROLLBACK").await;
    log.push(format!("ROLLBACK -> {r:?}"));
    let r = prepared(c).await;
    log.push(format!("pg_prepared_statements -> {r:?}"));
    log
}

/// The zombie: holder of `<resource>_z:41`, current at first (its first query records 41).
async fn zombie(a: &Attack) -> (RawConn, String) {
    let resource = format!("{}_z", a.resource);
    let mut c = a.session(Some(&format!("{resource}:41"))).await;
    let r = c.query("SELECT 1").await;
    assert!(r.errors.is_empty(), "first query records 41: {r:?}");
    (c, resource)
}

/// `BEGIN`; INSERT of 41 while current (its opening guard passes and takes no lock); the new
/// holder records 42 and writes; then `run` (the way to the lingering COMMIT); `COMMIT`.
async fn zombie_commits(a: &Attack, c: &mut RawConn, resource: &str, run: &str) -> Vec<String> {
    let mut log = Vec::new();
    for sql in ["BEGIN".to_owned(), a.insert(41)] {
        let r = c.query(&sql).await;
        log.push(format!("{sql} -> {r:?}"));
    }
    let holder = lockd_tests::pg::connect(&a.proxy.config(Some(&format!("{resource}:42")))).await;
    holder
        .execute(&a.insert(42), &[])
        .await
        .expect("the new holder of 42 writes");
    let r = c.query(run).await;
    log.push(format!("{run} -> {r:?}"));
    let r = c.query("COMMIT").await;
    log.push(format!("COMMIT -> {r:?}"));
    log
}

/// Goal (finding 1, the reviewer's exploit): the proxy's own statement never survives a failed
/// internal Bind, and SQL `EXECUTE` of its name cannot commit a zombie's rows.
/// Method: `leave_internal_commit` with a protocol Bind of the client portal
/// `__lockd_fence_proxy_p`; then the zombie sequence with `EXECUTE __lockd_fence_proxy_s`.
/// Before the fix `pg_prepared_statements` listed `__lockd_fence_proxy_s | COMMIT` and the row
/// of 41 committed after 42. Expected: no row of 41.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_failed_internal_bind_leaves_a_commit_for_sql_execute() {
    lockd_tests::skip_without_postgres!();
    let a = Attack::new(false, "review").await;
    let (mut c, resource) = zombie(&a).await;
    for line in leave_internal_commit(&mut c, false).await {
        eprintln!("{line}");
    }
    let lingering = holds_internal_statement(&mut c).await;
    eprintln!("upstream holds {S}: {lingering:?}");
    for line in zombie_commits(&a, &mut c, &resource, &format!("EXECUTE {S}")).await {
        eprintln!("{line}");
    }
    assert_eq!(
        a.rows_with_token(41).await,
        0,
        "a row of the zombie's token 41 committed after 42 was recorded"
    );
    assert_ne!(
        lingering,
        Some(true),
        "the proxy's statement outlived its group"
    );
}

/// Goal (finding 1, dynamic SQL): the same through a cursor and an `EXECUTE` the proxy cannot
/// see (both inside a DO block), so reserving the names cannot be the whole fix.
/// Method: the portal `__lockd_fence_proxy_p` is a cursor opened by PL/pgSQL; the zombie runs
/// `DO $$BEGIN EXECUTE 'EXECUTE __lockd_fence_proxy_s'; END$$`. Expected: no row of 41, and the
/// upstream never holds the proxy's statement after the failed group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_failed_internal_bind_dynamic_sql() {
    lockd_tests::skip_without_postgres!();
    let a = Attack::new(false, "review").await;
    let (mut c, resource) = zombie(&a).await;
    for line in leave_internal_commit(&mut c, true).await {
        eprintln!("{line}");
    }
    let lingering = holds_internal_statement(&mut c).await;
    eprintln!("upstream holds {S}: {lingering:?}");
    let run = format!("DO $$BEGIN EXECUTE 'EXECUTE {S}'; END$$");
    for line in zombie_commits(&a, &mut c, &resource, &run).await {
        eprintln!("{line}");
    }
    assert_eq!(
        a.rows_with_token(41).await,
        0,
        "a row of the zombie's token 41 committed after 42 was recorded"
    );
    assert_ne!(
        lingering,
        Some(true),
        "the proxy's statement outlived its group"
    );
}

/// Goal (finding 1, commit-time failure): the proxy's own COMMIT failing after its guard passed
/// (a deferrable unique constraint checked at COMMIT) leaves nothing behind either.
/// Method: the zombie, current, writes two equal values into a table with a deferred unique
/// constraint in an extended-protocol group; the proxy's COMMIT at Sync fails 23505 (its Close
/// messages are skipped). Then the zombie sequence through dynamic SQL. Expected: no row of 41.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_failed_internal_commit_at_deferred_constraint() {
    lockd_tests::skip_without_postgres!();
    let a = Attack::new(false, "review").await;
    let (mut c, resource) = zombie(&a).await;
    let d = lockd_tests::pg::unique_name("review_deferred");
    a.direct
        .batch_execute(&format!(
            "CREATE TABLE {d} (x int UNIQUE DEFERRABLE INITIALLY DEFERRED)"
        ))
        .await
        .unwrap();
    let mut out = BytesMut::new();
    wire::run(&format!("INSERT INTO {d} VALUES (1), (1)"), &mut out);
    wire::sync(&mut out);
    let r = c.exchange(&out).await;
    eprintln!("INSERT of two equal deferred-unique values, Sync -> {r:?}");
    assert_eq!(r.first_error(), "23505", "the COMMIT fails: {r:?}");
    let r = prepared(&mut c).await;
    eprintln!("pg_prepared_statements -> {r:?}");
    let lingering = holds_internal_statement(&mut c).await;
    eprintln!("upstream holds {S}: {lingering:?}");
    let run = format!("DO $$BEGIN EXECUTE 'EXECUTE {S}'; END$$");
    for line in zombie_commits(&a, &mut c, &resource, &run).await {
        eprintln!("{line}");
    }
    assert_eq!(
        a.rows_with_token(41).await,
        0,
        "a row of the zombie's token 41 committed after 42 was recorded"
    );
    assert_ne!(
        lingering,
        Some(true),
        "the proxy's statement outlived its failed COMMIT"
    );
}

/// Goal (finding 2): a statement name the proxy reads differently from Postgres (another
/// client_encoding) cannot make the proxy take an INSERT for SHOW and run it before the opening
/// guard of a stale session.
/// Method: the stale attacker (41, 42 recorded); under UTF8 Parse `"\xc3\xa9"` = `SHOW work_mem`;
/// `BEGIN`; `SET client_encoding = LATIN1`; Close and Parse `"\xe9"` (the same server name `é`) = INSERT
/// of 41; `SET client_encoding = UTF8`; Bind/Execute `"\xc3\xa9"`, Sync; `COMMIT`. Before the fix the
/// INSERT ran (its CommandComplete came back, the id sequence moved) with no guard before it.
/// Expected: the INSERT never completes and no row of 41 commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_statement_name_read_in_two_encodings() {
    lockd_tests::skip_without_postgres!();
    let a = Attack::new(false, "review").await;
    let mut c = a.attacker(Some(41)).await;
    let mut log = Vec::new();
    let utf8 = "\u{e9}".as_bytes();
    let latin1 = b"\xe9";
    let mut out = raw_parse(utf8, "SHOW work_mem");
    wire::sync(&mut out);
    let r = c.exchange(&out).await;
    log.push(format!("Parse é(UTF8) = SHOW, Sync -> {r:?}"));
    // Inside the client's block a SET is guard-free; outside, the proxy's block around it would
    // end through the (failing) commit guard and roll the SET back.
    let r = c.query("BEGIN").await;
    log.push(format!("BEGIN -> {r:?}"));
    let r = c.query("SET client_encoding = 'LATIN1'").await;
    log.push(format!("SET client_encoding LATIN1 -> {r:?}"));
    let mut out = raw_close_statement(latin1);
    out.extend_from_slice(&raw_parse(latin1, &a.insert(41)));
    wire::sync(&mut out);
    let r = c.exchange(&out).await;
    log.push(format!("Close, Parse é(LATIN1) = INSERT 41, Sync -> {r:?}"));
    let r = c.query("SET client_encoding = 'UTF8'").await;
    log.push(format!("SET client_encoding UTF8 -> {r:?}"));
    let mut out = raw_bind(utf8);
    wire::execute("", &mut out);
    wire::sync(&mut out);
    let r = c.exchange(&out).await;
    let ran = r.completions.iter().any(|t| t.starts_with("INSERT"));
    log.push(format!("Bind/Execute é(UTF8), Sync -> {r:?}"));
    let r = c.query("COMMIT").await;
    log.push(format!("COMMIT -> {r:?}"));
    for line in &log {
        eprintln!("{line}");
    }
    assert!(
        !ran,
        "the stale session's INSERT ran before any guard (the proxy took it for SHOW)"
    );
    a.assert_nothing_committed("a statement name read in two encodings")
        .await;
}

/// Goal (findings 1b and 3): every client-supplied name with the proxy's prefix is refused with
/// 42939, in protocol frames and in SQL, and the DoS of a cursor named like the proxy's portal
/// (every extended-protocol group failing 42P03) is closed; non-ASCII protocol names are refused
/// with 42602.
/// Method: a plain unfenced session; each refused form is tried and its SQLSTATE recorded; then
/// `DECLARE __lockd_fence_proxy_p CURSOR WITH HOLD` and an ordinary extended-protocol SELECT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_reserved_and_non_ascii_names() {
    lockd_tests::skip_without_postgres!();
    let a = Attack::new(false, "review").await;
    let mut c = a.attacker(None).await;
    let mut broken = Vec::new();
    let mut expect = |what: String, r: &RawReply, code: &str| {
        eprintln!("{what} -> {r:?}");
        let msg_ok = r
            .errors
            .first()
            .is_some_and(|e| e.1.starts_with("fence-proxy: "));
        if r.first_error() != code || !msg_ok {
            broken.push(format!("{what}: expected a proxy {code}, got {r:?}"));
        }
    };
    for (what, group) in [
        ("Parse", {
            let mut o = BytesMut::new();
            wire::parse(S, "SELECT 1", &mut o);
            o
        }),
        ("Bind portal", {
            let mut o = BytesMut::new();
            wire::parse("", "SELECT 1", &mut o);
            wire::bind(P, "", &mut o);
            o
        }),
        ("Bind statement", {
            let mut o = BytesMut::new();
            wire::bind("", S, &mut o);
            o
        }),
        ("Execute", {
            let mut o = BytesMut::new();
            wire::execute(P, &mut o);
            o
        }),
        ("Close", { raw_close_statement(S.as_bytes()) }),
        ("Parse upper case", {
            let mut o = BytesMut::new();
            wire::parse(&S.to_uppercase(), "SELECT 1", &mut o);
            o
        }),
    ] {
        let mut out = group;
        wire::sync(&mut out);
        let r = c.exchange(&out).await;
        expect(format!("{what} {S}/{P}"), &r, "42939");
    }
    for sql in [
        format!("PREPARE {S} AS SELECT 1"),
        format!("EXECUTE {S}"),
        format!("DEALLOCATE {S}"),
        format!("EXPLAIN EXECUTE {S}"),
        format!("CREATE TEMP TABLE t_x AS EXECUTE {S}"),
        format!("DECLARE {P} CURSOR WITH HOLD FOR SELECT 1"),
        format!("FETCH {P}"),
        format!("MOVE {P}"),
        format!("CLOSE {P}"),
    ] {
        let r = c.query(&sql).await;
        expect(sql, &r, "42939");
    }
    for (what, name) in [("UTF8 é", "\u{e9}".as_bytes()), ("LATIN1 é", &b"\xe9"[..])] {
        let mut out = raw_parse(name, "SELECT 1");
        wire::sync(&mut out);
        let r = c.exchange(&out).await;
        expect(format!("Parse of non-ASCII name {what}"), &r, "42602");
    }
    // The DoS: an extended-protocol statement still works.
    let mut out = BytesMut::new();
    wire::run("SELECT 1", &mut out);
    wire::sync(&mut out);
    let r = c.exchange(&out).await;
    eprintln!("extended SELECT 1 after the attempts -> {r:?}");
    if !r.errors.is_empty() {
        broken.push(format!("an ordinary extended-protocol SELECT fails: {r:?}"));
    }
    assert!(broken.is_empty(), "{broken:#?}");
}
