//! Adversarial review of the guard design of docs/fence-proxy-postgres.md: raw-wire attacks against
//! the real Postgres at 127.0.0.1:5432. Each test demonstrates a way for a stale (or, under
//! `--require-fence`, unfenced) session to commit a write through the proxy; the oracle is the table
//! itself: no row written by the attacker committed.
//!
//! Setup per test (the `Attack` helper): resource `r` with token 42 recorded by an honest holder; the
//! attacker's rows carry token 41.

use std::time::Duration;

use bytes::{BufMut, BytesMut};
use lockd_tests::pg::{self, Attack, wire};

/// A simple Query message with arbitrary (not necessarily UTF-8) text bytes.
fn raw_query(text: &[u8]) -> BytesMut {
    let mut out = BytesMut::new();
    out.put_u8(b'Q');
    out.put_i32((4 + text.len() + 1) as i32);
    out.put_slice(text);
    out.put_u8(0);
    out
}

/// Goal: the proxy must read query text as the server does whatever `client_encoding` says.
/// Method: a session with startup options `-c client_encoding=SJIS` (and `-c lockd.fence=r:41`,
/// or unfenced under --require-fence) sends one Query whose bytes are
/// `SET application_name = E'<0x83>\'; COMMIT; INSERT ... (41); SELECT ' -- '`.
/// The proxy decodes the text as (lossy) UTF-8: it sees U+FFFD, then `\'` (an escaped quote), so
/// the whole rest is one string literal: a single SET (guard-free), wrapped in its block. The
/// server converts from SJIS first: 0x83 0x5C is one character (ソ), there is no backslash, and
/// the text is four statements: SET; COMMIT (ends the proxy's block); INSERT (in an implicit
/// transaction of its own, no guard, commits); SELECT. (`SET client_encoding` as a query works as
/// well for an unfenced session; for a stale one the proxy's guard rolls the SET back, hence the
/// startup option.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review13_sjis_client_encoding_hides_commit_inside_a_string() {
    lockd_tests::skip_without_postgres!();
    let mut broken = Vec::new();
    for require_fence in [false, true] {
        let a = Attack::new(require_fence, "review").await;
        let options = if require_fence {
            "-c client_encoding=SJIS".to_owned()
        } else {
            format!("-c client_encoding=SJIS -c lockd.fence={}:41", a.resource)
        };
        let mut c = a.session_with(&options).await;
        let mut text = b"SET application_name = E'\x83\\'; COMMIT; ".to_vec();
        text.extend_from_slice(a.insert(41).as_bytes());
        text.extend_from_slice(b"; SELECT ' -- '");
        c.send(&raw_query(&text)).await;
        let r = c.read_until_ready().await;
        eprintln!("require_fence={require_fence}: SJIS query -> {r:?}");
        a.check(
            &format!("require_fence={require_fence}: COMMIT hidden by an SJIS character"),
            &mut broken,
        )
        .await;
    }
    assert!(broken.is_empty(), "{broken:#?}");
}

/// Goal: a wrong entry in the proxy's statement map may only cost compatibility (module doc of
/// session.rs). It does not: a statement name the proxy believes to be COMMIT (or ROLLBACK,
/// BEGIN, ROLLBACK TO) is executed at status `I` with no BEGIN and no guard, so if the server's
/// statement of that name is really an INSERT, the INSERT runs in the extended protocol's
/// implicit transaction and commits at Sync.
/// Method: Parse `s1` = `COMMIT` (recorded as Commit on ParseComplete), Sync; SQL `DEALLOCATE
/// s1`; SQL `PREPARE s1 AS INSERT ...` (the proxy does not track SQL-level PREPARE/DEALLOCATE);
/// Bind `s1` + Flush (so the BindComplete records the portal's kind before the Execute), then
/// Execute + Sync. Under --require-fence the attacker is unfenced (its guard only makes the
/// DEALLOCATE/PREPARE block read-only, which both statements survive). Without it the attacker
/// connects unfenced and its prepared INSERT sets `lockd.fence` to the stale `r:41` with
/// set_config in the same (unguarded) transaction, which then commits with fence r:41.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review13_sql_deallocate_leaves_a_commit_kind_for_an_insert() {
    lockd_tests::skip_without_postgres!();
    let mut broken = Vec::new();
    for require_fence in [true, false] {
        for control in ["COMMIT", "ROLLBACK", "BEGIN", "ROLLBACK TO SAVEPOINT x"] {
            let a = Attack::new(require_fence, "review").await;
            let mut c = a.session(None).await;
            let mut out = BytesMut::new();
            wire::parse("s1", control, &mut out);
            wire::sync(&mut out);
            c.send(&out).await;
            let r = c.read_until_ready().await;
            assert!(r.errors.is_empty(), "Parse s1 = {control}: {r:?}");
            let r = c.query("DEALLOCATE s1").await;
            assert!(r.errors.is_empty(), "DEALLOCATE: {r:?}");
            let prepared = if require_fence {
                format!("PREPARE s1 AS {}", a.insert(41))
            } else {
                format!(
                    "PREPARE s1 AS INSERT INTO {} (token) SELECT 41 FROM \
                     (SELECT pg_catalog.set_config('lockd.fence', '{}:41', false)) AS stale",
                    a.tbl, a.resource
                )
            };
            let r = c.query(&prepared).await;
            assert!(r.errors.is_empty(), "PREPARE: {r:?}");
            let mut out = BytesMut::new();
            wire::bind("", "s1", &mut out);
            postgres_protocol::message::frontend::flush(&mut out);
            c.send(&out).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
            let mut out = BytesMut::new();
            wire::execute("", &mut out);
            wire::sync(&mut out);
            c.send(&out).await;
            let r = c.read_until_ready().await;
            eprintln!("require_fence={require_fence} s1={control}: Execute -> {r:?}");
            let shown = c.query("SHOW lockd.fence").await;
            eprintln!("SHOW lockd.fence afterwards -> {shown:?}");
            a.check(
                &format!(
                    "require_fence={require_fence}: statement map says {control:?}, server runs INSERT"
                ),
                &mut broken,
            )
            .await;
        }
    }
    assert!(broken.is_empty(), "{broken:#?}");
}

/// Goal: the guard runs right before every COMMIT. It does not when the COMMIT is a prepared
/// statement bound and executed in one pipelined group: the portal's kind is recorded only on
/// BindComplete, which has not arrived when the proxy plans the Execute, so the proxy takes the
/// COMMIT for an ordinary statement and (the block being guarded already) adds nothing.
/// Method: the attacker holds a fence on a fresh resource of its own; Parse `c` = `COMMIT`, Sync;
/// `BEGIN`; `SELECT 1` (the guard runs and records the own fence); `SET lockd.fence = 'r:41'`
/// (or `RESET lockd.fence` under --require-fence); `INSERT ... (41)`; then Bind `p` `c`, Execute
/// `p`, Sync in one write. The transaction commits with the stale (or no) fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review13_pipelined_bind_execute_of_prepared_commit_skips_the_guard() {
    lockd_tests::skip_without_postgres!();
    let mut broken = Vec::new();
    for require_fence in [false, true] {
        let a = Attack::new(require_fence, "review").await;
        let own = format!("{}_own:1", a.resource);
        let mut c = a.session(Some(&own)).await;
        let mut out = BytesMut::new();
        wire::parse("c", "COMMIT", &mut out);
        wire::sync(&mut out);
        c.send(&out).await;
        let r = c.read_until_ready().await;
        assert!(r.errors.is_empty(), "Parse c = COMMIT: {r:?}");
        for sql in ["BEGIN", "SELECT 1"] {
            let r = c.query(sql).await;
            assert!(r.errors.is_empty(), "{sql}: {r:?}");
        }
        // `RESET lockd.fence` would restore the startup value (the attacker's own valid
        // fence), so the unfenced variant empties the setting instead.
        let change = if require_fence {
            "SET lockd.fence = ''".to_owned()
        } else {
            format!("SET lockd.fence = '{}:41'", a.resource)
        };
        let r = c.query(&change).await;
        assert!(r.errors.is_empty(), "{change}: {r:?}");
        let r = c.query(&a.insert(41)).await;
        eprintln!("require_fence={require_fence}: INSERT -> {r:?}");
        let mut out = BytesMut::new();
        wire::bind("p", "c", &mut out);
        wire::execute("p", &mut out);
        wire::sync(&mut out);
        c.send(&out).await;
        let r = c.read_until_ready().await;
        eprintln!("require_fence={require_fence}: Bind/Execute COMMIT -> {r:?}");
        a.check(
            &format!("require_fence={require_fence}: prepared COMMIT without the guard"),
            &mut broken,
        )
        .await;
    }
    assert!(broken.is_empty(), "{broken:#?}");
}

/// Goal: the proxy's expectations of the response stream must follow the server's. A Sync sent
/// while the server is in COPY FROM STDIN is ignored by the server ("Ignore Flush/Sync for the
/// convenience of client libraries"), but the proxy opens a group for it and waits for one more
/// ReadyForQuery than will ever come. From then on every ReadyForQuery is matched to the
/// previous request: the client gets the ReadyForQuery of the proxy's own `BEGIN; guard` as the
/// answer to its query and may send the next one while the proxy's block is still running; the
/// proxy plans that next query from the projected status (`T`, guarded) and forwards it raw, and
/// the server runs it after the proxy's COMMIT, in an implicit transaction with no guard.
/// Method: the attacker holds a fence on a fresh resource of its own (so its COPY passes the
/// guard); COPY FROM STDIN into a scratch table; Sync, CopyData, CopyDone; then `SELECT
/// pg_sleep(1)` (its early ReadyForQuery arrives at once); then, during the sleep, one Query
/// `SET lockd.fence = 'r:41'; INSERT ... (41)` (without --require-fence) or `RESET lockd.fence;
/// INSERT ... (41)` (with it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review13_sync_during_copy_in_desynchronises_the_response_stream() {
    lockd_tests::skip_without_postgres!();
    let mut broken = Vec::new();
    for require_fence in [false, true] {
        let a = Attack::new(require_fence, "review").await;
        let scratch = format!("{}_scratch", a.tbl);
        a.direct
            .batch_execute(&format!("CREATE TABLE {scratch} (v bigint)"))
            .await
            .unwrap();
        let own = format!("{}_own:1", a.resource);
        let mut c = a.session(Some(&own)).await;
        let mut out = BytesMut::new();
        postgres_protocol::message::frontend::query(
            &format!("COPY {scratch} (v) FROM STDIN"),
            &mut out,
        )
        .unwrap();
        c.send(&out).await;
        // Let the CopyInResponse reach the proxy, which then reads the client during COPY.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut out = BytesMut::new();
        wire::sync(&mut out);
        out.put_u8(b'd');
        out.put_i32(4 + 2);
        out.put_slice(b"1\n");
        out.put_u8(b'c');
        out.put_i32(4);
        c.send(&out).await;
        let r = c.read_until_ready().await;
        eprintln!("require_fence={require_fence}: COPY with a Sync inside -> {r:?}");
        tokio::time::sleep(Duration::from_millis(300)).await;

        let mut out = BytesMut::new();
        postgres_protocol::message::frontend::query("SELECT pg_sleep(1)", &mut out).unwrap();
        c.send(&out).await;
        let r = c.read_until_ready().await;
        eprintln!("SELECT pg_sleep(1) -> {r:?}");
        // `RESET lockd.fence` would restore the startup value (the attacker's own valid fence),
        // so the unfenced variant empties the setting instead.
        let attack = if require_fence {
            format!("SET lockd.fence = ''; {}", a.insert(41))
        } else {
            format!("SET lockd.fence = '{}:41'; {}", a.resource, a.insert(41))
        };
        let mut out = BytesMut::new();
        postgres_protocol::message::frontend::query(&attack, &mut out).unwrap();
        c.send(&out).await;
        // Let the sleep end and the server run what the proxy forwarded.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        a.check(
            &format!("require_fence={require_fence}: query forwarded raw after a Sync inside COPY"),
            &mut broken,
        )
        .await;
    }
    assert!(broken.is_empty(), "{broken:#?}");
}

/// Goal: the ordinary driver pattern of the extended protocol (Parse, Bind, Execute, ..., Sync
/// in one write, as pgjdbc sends its COMMIT and ROLLBACK) must be planned like the simple
/// protocol. It is not: statement kinds are recorded on ParseComplete and portal kinds on
/// BindComplete, neither of which has arrived when the proxy plans the Execute, so a pipelined
/// `COMMIT` or `ROLLBACK` is taken for an ordinary statement.
/// Method, inside the attacker's own block whose guard already ran (`BEGIN; SELECT 1`):
/// (a) one write of Parse/Bind/Execute `ROLLBACK`, Parse/Bind/Execute `INSERT ... (41)`, Sync:
///     the server ends the block at the ROLLBACK and runs the INSERT in the group's implicit
///     transaction, which commits at Sync with no guard (under --require-fence the session is
///     unfenced and the new transaction is not read-only; without it the session switched its
///     fence to the stale `r:41` with SET before the group);
/// (b) `SET lockd.fence = 'r:41'` (or `RESET lockd.fence`), `INSERT ... (41)`, then one write of
///     Parse/Bind/Execute `COMMIT`, Sync: no guard before the COMMIT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review13_pipelined_unnamed_commit_or_rollback_is_taken_for_ordinary() {
    lockd_tests::skip_without_postgres!();
    let mut broken = Vec::new();
    for require_fence in [false, true] {
        for variant in ["rollback-then-insert", "commit"] {
            if variant == "rollback-then-insert" && !require_fence {
                // The ROLLBACK also undoes the in-block `SET lockd.fence = 'r:41'`, so the
                // INSERT after it runs (guarded) with the attacker's own valid startup fence:
                // no attack remains to observe. The unfenced variant (--require-fence) checks
                // that the INSERT after the ROLLBACK is guarded (read-only).
                continue;
            }
            let a = Attack::new(require_fence, "review").await;
            // Under --require-fence the session is unfenced from the start; without it, it
            // holds a fence on a fresh resource of its own so its first guard passes.
            let own = format!("{}_own:1", a.resource);
            let mut c = if require_fence {
                a.session(None).await
            } else {
                a.session(Some(&own)).await
            };
            for sql in ["BEGIN", "SELECT 1"] {
                let r = c.query(sql).await;
                assert!(r.errors.is_empty(), "{sql}: {r:?}");
            }
            if !require_fence {
                let r = c
                    .query(&format!("SET lockd.fence = '{}:41'", a.resource))
                    .await;
                assert!(r.errors.is_empty(), "SET: {r:?}");
            }
            let mut out = BytesMut::new();
            if variant == "commit" {
                if require_fence {
                    // The guard made this block read-only; a fresh fence of its own lets the
                    // attacker write, then it drops the fence before committing.
                    c.query("ROLLBACK").await;
                    c.query(&format!("SET lockd.fence = '{own}'")).await;
                    c.query("BEGIN").await;
                    c.query("SELECT 1").await;
                    c.query("RESET lockd.fence").await;
                }
                let r = c.query(&a.insert(41)).await;
                eprintln!("{variant} require_fence={require_fence}: INSERT -> {r:?}");
                wire::run("COMMIT", &mut out);
            } else {
                wire::run("ROLLBACK", &mut out);
                wire::run(&a.insert(41), &mut out);
            }
            wire::sync(&mut out);
            c.send(&out).await;
            let r = c.read_until_ready().await;
            eprintln!("{variant} require_fence={require_fence}: group -> {r:?}");
            a.check(
                &format!("{variant} require_fence={require_fence}: pipelined transaction control"),
                &mut broken,
            )
            .await;
        }
    }
    assert!(broken.is_empty(), "{broken:#?}");
}

/// Goal: no client input may crash the proxy. The proxy hands every query text to pg_query on a
/// tokio worker thread (2 MiB stack). The server's grammar builds a left-deep tree for
/// `1+1+1+...` (bison's own stack stays flat), and pg_query turns the tree into protobuf
/// recursively in C with no stack-depth check, so a deep enough tree overflows the worker's stack
/// and the whole process aborts (SIGABRT), taking every session down. (At depth 1,000 the
/// query is only refused, with 42601, because prost's decoder stops at 100 levels: a
/// compatibility cost for long expression chains.)
/// Method: the attack runs in a child process (this test binary re-run with
/// `REVIEW13_CRASH_CHILD=1`), because the abort kills the process the in-process proxy lives in;
/// the child sends `SELECT 1+1+...+1` with 1,000, 10,000 and 100,000 terms, each followed by a
/// fresh session's `SELECT 1`. The test fails if the child dies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review13_deeply_nested_expression_crashes_the_proxy() {
    lockd_tests::skip_without_postgres!();
    const CHILD: &str = "REVIEW13_CRASH_CHILD";
    if std::env::var_os(CHILD).is_some() {
        let a = Attack::new(false, "review").await;
        for depth in [1_000usize, 10_000, 100_000] {
            let mut c = a.session(None).await;
            let sql = format!("SELECT 1{}", "+1".repeat(depth));
            let mut out = BytesMut::new();
            postgres_protocol::message::frontend::query(&sql, &mut out).unwrap();
            c.send(&out).await;
            let r = c.read_until_ready().await;
            eprintln!(
                "depth {depth}: first error {:?} status {}",
                r.first_error(),
                r.status as char
            );
            let mut fresh = a.session(None).await;
            let r = fresh.query("SELECT 1").await;
            assert!(
                r.errors.is_empty() && r.status == b'I',
                "after depth {depth}: {r:?}"
            );
        }
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(exe)
            .args([
                "review13_deeply_nested_expression_crashes_the_proxy",
                "--exact",
                "--nocapture",
            ])
            .env(CHILD, "1")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let tail: Vec<&str> = stderr.lines().rev().take(6).collect();
    assert!(
        out.status.success(),
        "the proxy's process died ({}): {:#?}",
        out.status,
        tail
    );
}

/// Goal (compatibility, not safety): COPY FROM STDIN over the extended protocol, as
/// tokio-postgres's `copy_in` sends it (Bind, Execute, Sync in one write, then CopyData and
/// CopyDone), works through the proxy. The proxy puts its own guard and COMMIT messages before
/// the client's Sync, i.e. behind the Execute that starts the COPY; the server, now reading
/// CopyData, meets the proxy's Close and fails the COPY ("unexpected message type 0x43 during
/// COPY from stdin").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review13_extended_protocol_copy_in_fails_through_the_proxy() {
    lockd_tests::skip_without_postgres!();
    use futures::SinkExt;
    let a = Attack::new(false, "review").await;
    let scratch = format!("{}_copy", a.tbl);
    a.direct
        .batch_execute(&format!("CREATE TABLE {scratch} (v bigint)"))
        .await
        .unwrap();
    let client = pg::connect(&a.proxy.config(None)).await;
    let result = async {
        let sink = client
            .copy_in::<_, bytes::Bytes>(&format!("COPY {scratch} (v) FROM STDIN"))
            .await?;
        futures::pin_mut!(sink);
        sink.send(bytes::Bytes::from_static(b"1\n2\n")).await?;
        sink.finish().await
    }
    .await;
    assert_eq!(
        result.as_ref().map_err(|e| format!("{e:?}")),
        Ok(&2),
        "copy_in through the proxy"
    );
}

/// Goal (transaction semantics, not fencing): a client's own BEGIN sent over the extended
/// protocol in one write with its first statement (Parse/Bind/Execute `BEGIN`, Parse/Bind/Execute
/// `INSERT`, Sync, as pgjdbc sends a transaction's start) opens a block the client ends. Through
/// the proxy the pipelined BEGIN's kind is not known yet (recorded on ParseComplete), so the proxy
/// opens and owns a block of its own around it and COMMITs it at the Sync: the client's later
/// ROLLBACK finds nothing to roll back and the INSERT stays.
/// Method: a fenced session (a fresh resource of its own) sends that group, then `ROLLBACK`; the
/// row must not exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review13_pipelined_client_begin_is_committed_by_the_proxy_at_sync() {
    lockd_tests::skip_without_postgres!();
    let a = Attack::new(false, "review").await;
    let own = format!("{}_own:1", a.resource);
    let mut c = a.session(Some(&own)).await;
    let mut out = BytesMut::new();
    wire::run("BEGIN", &mut out);
    wire::run(&a.insert(7), &mut out);
    wire::sync(&mut out);
    c.send(&out).await;
    let r = c.read_until_ready().await;
    eprintln!("BEGIN; INSERT pipelined -> {r:?}");
    let status_after_group = r.status;
    let r = c.query("ROLLBACK").await;
    eprintln!("ROLLBACK -> {r:?}");
    let rows = a.attacker_rows().await;
    assert!(
        status_after_group == b'T' && rows == 0,
        "status after the group {:?} (Postgres: 'T'); {rows} row(s) survived the client's ROLLBACK",
        status_after_group as char
    );
}
