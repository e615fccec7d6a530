//! Interrupts of the proxy's own statements. A simple Query is its own unit of failure: when the
//! proxy's `BEGIN` travels in a Query of its own ahead of the client's, a CancelRequest or a
//! `statement_timeout` that fails it before the BEGIN runs (Postgres checks for interrupts
//! before each statement of a query) leaves the upstream at status `I`, and the client's
//! pipelined Query then runs, and commits, in an implicit transaction of its own with no guard.
//! Found in the review of 2026-12-03 (issue 13); the class is closed by sending the proxy's
//! BEGIN and guard in the same Query as the client's statements, so that anything failing before
//! them skips the client's statements too, and by holding a FunctionCall (a message of its own)
//! until the upstream reports the proxy's block open.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use lockd_tests::pg::{self, Attack, RawConn, RawReply};
use postgres_protocol::message::frontend;

/// Cancel connections still open at once (the proxy allows 64 sessions in the tests).
const MAX_CANCELS_IN_FLIGHT: usize = 16;

/// Busy-waits `micros` (the tokio timer's resolution is a millisecond).
fn spin(micros: u64) {
    let until = Instant::now() + Duration::from_micros(micros);
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}

/// Sends requests with a CancelRequest for the session's own backend around each, offset by
/// -800 to +400 µs in 25 µs steps from round to round. A cancel may land in a later round's
/// request too; a few are left in flight at a time, as cancel connections count against the
/// proxy's --max-sessions.
struct Canceller {
    addr: std::net::SocketAddr,
    key: (i32, i32),
    in_flight: VecDeque<tokio::task::JoinHandle<()>>,
}

impl Canceller {
    fn new(addr: std::net::SocketAddr, conn: &RawConn) -> Canceller {
        Canceller {
            addr,
            key: conn
                .backend_key
                .expect("the proxy passes BackendKeyData on"),
            in_flight: VecDeque::new(),
        }
    }

    /// Sends `request` on `conn` with a cancel around it, and reads its answer.
    async fn round(&mut self, round: i64, conn: &mut RawConn, request: &[u8]) -> RawReply {
        let offset = (round % 49) * 25 - 800;
        let cancel = if offset < 0 {
            let cancel = tokio::spawn(pg::cancel(self.addr, self.key));
            spin(offset.unsigned_abs());
            conn.send(request).await;
            cancel
        } else {
            conn.send(request).await;
            spin(offset.unsigned_abs());
            tokio::spawn(pg::cancel(self.addr, self.key))
        };
        let reply = conn.read_until_ready().await;
        self.in_flight.push_back(cancel);
        if self.in_flight.len() > MAX_CANCELS_IN_FLIGHT {
            self.in_flight.pop_front().unwrap().await.unwrap();
        }
        assert_ne!(reply.status, b'X', "the session ended: {reply:?}");
        reply
    }

    /// Waits for every cancel sent.
    async fn finish(self) {
        for cancel in self.in_flight {
            cancel.await.unwrap();
        }
    }
}

/// Attack: a stale session (token 41 against a recorded 42) sends an INSERT as a simple Query and
/// a CancelRequest for its own backend around it, the two offset by -800 to +400 µs so that some
/// cancels land while the upstream processes the proxy's opening statements; then the same with
/// `statement_timeout = 1ms` (which expires on its own while the machine is busy). Oracle: no row
/// of token 41 ever commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_begin_never_lets_the_clients_statement_commit_unguarded() {
    lockd_tests::skip_without_postgres!();
    let attack = Attack::new(false, "interrupted_begin").await;
    let addr = attack.proxy.addr;
    let rounds: i64 = std::env::var("INTERRUPT_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(600);
    let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
    let insert = attack.insert(41);
    let mut query = BytesMut::new();
    frontend::query(&insert, &mut query).unwrap();

    let mut conn = attack.attacker(Some(41)).await;
    let mut canceller = Canceller::new(addr, &conn);
    for round in 0..rounds {
        let reply = canceller.round(round, &mut conn, &query).await;
        *outcomes
            .entry(format!("cancel {}", reply.first_error()))
            .or_default() += 1;
        if attack.attacker_rows().await > 0 {
            break;
        }
    }

    canceller.finish().await;
    // Set at startup: a SET would run in a guarded block that the timeout may fail.
    let mut timed = attack
        .session_with(&format!(
            "-c lockd.fence={}:41 -c statement_timeout=1",
            attack.resource
        ))
        .await;
    for _ in 0..rounds {
        if attack.attacker_rows().await > 0 {
            break;
        }
        timed.send(&query).await;
        let reply = timed.read_until_ready().await;
        assert_ne!(reply.status, b'X', "the session ended: {reply:?}");
        *outcomes
            .entry(format!("timeout {}", reply.first_error()))
            .or_default() += 1;
    }
    eprintln!("outcomes (SQLSTATE of the first error, \"\" for none): {outcomes:?}");
    attack
        .assert_nothing_committed(&format!("a stale INSERT around interrupts ({outcomes:?})"))
        .await;
}

/// A FunctionCall (fast path, as libpq's large-object functions use) of `oid` with one text
/// argument, text result.
fn function_call(oid: u32, arg: &str) -> BytesMut {
    let mut body = Vec::new();
    body.extend_from_slice(&oid.to_be_bytes());
    body.extend_from_slice(&0i16.to_be_bytes()); // argument formats: all text
    body.extend_from_slice(&1i16.to_be_bytes());
    body.extend_from_slice(&(arg.len() as i32).to_be_bytes());
    body.extend_from_slice(arg.as_bytes());
    body.extend_from_slice(&0i16.to_be_bytes()); // result format: text
    let mut out = BytesMut::new();
    out.extend_from_slice(b"F");
    out.extend_from_slice(&((body.len() + 4) as i32).to_be_bytes());
    out.extend_from_slice(&body);
    out
}

/// Goal: a FunctionCall at status `I` runs inside the proxy's guarded block, which must be open
/// before the call reaches the upstream: a current holder's call commits, a stale one's is
/// refused and commits nothing, also with cancels landing around it.
/// Method: a SQL function that inserts a row with the token it is given, called over the fast
/// path by a holder of 42 and by a stale session (41), the latter 300 times with a CancelRequest
/// offset as in the test above.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_call_runs_only_inside_the_guarded_block() {
    lockd_tests::skip_without_postgres!();
    let attack = Attack::new(false, "fastpath").await;
    let addr = attack.proxy.addr;
    let function = pg::unique_name("fastpath_write");
    attack
        .direct
        .batch_execute(&format!(
            "CREATE FUNCTION {function}(t bigint) RETURNS bigint LANGUAGE sql AS \
             $$ INSERT INTO {} (token) VALUES (t) RETURNING token $$",
            attack.tbl
        ))
        .await
        .unwrap();
    let oid: u32 = attack
        .direct
        .query_one(
            &format!("SELECT '{function}(bigint)'::regprocedure::oid"),
            &[],
        )
        .await
        .unwrap()
        .get(0);

    let mut holder = attack.attacker(Some(42)).await;
    holder.send(&function_call(oid, "42")).await;
    let reply = holder.read_until_ready().await;
    assert!(reply.errors.is_empty(), "the holder's call: {reply:?}");
    assert!(
        reply.tags.contains(&b'V'),
        "no FunctionCallResponse: {reply:?}"
    );
    assert_eq!(reply.status, b'I', "the proxy ends its block: {reply:?}");
    let holder_rows = attack.rows_with_token(42).await;
    assert_eq!(holder_rows, 2, "the holder's call committed its row");

    let mut stale = attack.attacker(Some(41)).await;
    stale.send(&function_call(oid, "41")).await;
    let reply = stale.read_until_ready().await;
    assert_eq!(reply.first_error(), "55P03", "the stale call: {reply:?}");
    assert_eq!(reply.status, b'I', "{reply:?}");
    let mut canceller = Canceller::new(addr, &stale);
    let call = function_call(oid, "41");
    let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
    for round in 0..300i64 {
        let reply = canceller.round(round, &mut stale, &call).await;
        *outcomes.entry(reply.first_error().to_owned()).or_default() += 1;
    }
    canceller.finish().await;
    eprintln!("fast-path outcomes: {outcomes:?}");
    attack
        .assert_nothing_committed(&format!("a stale FunctionCall ({outcomes:?})"))
        .await;
    attack
        .direct
        .batch_execute(&format!("DROP FUNCTION {function}(bigint)"))
        .await
        .unwrap();
}
