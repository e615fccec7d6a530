//! Interrupts of the proxy's own statements. A simple Query is its own unit of failure: when the
//! proxy's `BEGIN` travels in a Query of its own ahead of the client's, a CancelRequest or a
//! `statement_timeout` that fails it before the BEGIN runs (Postgres checks for interrupts
//! before each statement of a query) leaves the upstream at status `I`, and the client's
//! pipelined Query then runs, and commits, in an implicit transaction of its own with no guard.
//! Found in the review of 2026-12-03 (issue 13); the class is closed by sending the proxy's
//! BEGIN and guard in the same Query as the client's statements, so that anything failing before
//! them skips the client's statements too, and by holding a FunctionCall (a message of its own)
//! until the upstream reports the proxy's block open.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use lockd_tests::pg::{self, Attack};
use postgres_protocol::message::frontend;

/// Busy-waits `micros` (the tokio timer's resolution is a millisecond).
fn spin(micros: u64) {
    let until = Instant::now() + Duration::from_micros(micros);
    while Instant::now() < until {
        std::hint::spin_loop();
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
    let key = conn
        .backend_key
        .expect("the proxy passes BackendKeyData on");
    for round in 0..rounds {
        let offset = (round % 49) * 25 - 800;
        if offset < 0 {
            tokio::spawn(pg::cancel(addr, key));
            spin(offset.unsigned_abs());
            conn.send(&query).await;
        } else {
            conn.send(&query).await;
            spin(offset.unsigned_abs());
            tokio::spawn(pg::cancel(addr, key));
        }
        let reply = conn.read_until_ready().await;
        assert_ne!(reply.status, b'X', "the session ended: {reply:?}");
        *outcomes
            .entry(format!("cancel {}", reply.first_error()))
            .or_default() += 1;
        if attack.attacker_rows().await > 0 {
            break;
        }
    }

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
