//! The Postgres front end of fence-proxy against the real Postgres at 127.0.0.1:5432.
//!
//! Every test uses its own table and fence resource names, so the tests run in parallel.
//!
//! # Layout
//! - `protocol`: psql and the extended protocol through the proxy, unfenced and fenced.
//! - `tokens`: a stale token is refused and newer rows stay; interleaved holders never overlap.
//! - `settings`: resetting and malformed fence settings, `--require-fence`, a session that went
//!   stale after a commit.
//! - `end_to_end`: password authentication through the proxy, and a zombie holder fenced with
//!   tokens from a real lockd cluster.
//! - `bypass`: attacks on the guard that try to run a statement without the fence.
//! - `implicit`: Parse, Bind and Describe at status `I` run client code; never in an implicit
//!   transaction that commits unguarded.
//! - `commit`: what the proxy checks at commit time.
//! - `discard`: a lone DISCARD ALL (Npgsql's pool, PgBouncer's reset) works and resets.
//! - `overhead`: what the proxy adds to each transaction (its BEGIN in place of a prepared one,
//!   the opening guard only where it can refuse), and that no check goes with it.
//! - `preauth`: what a client can hold before it has authenticated (startup places, the size of
//!   its answers to the password challenge).
//! - `prepared_control`: transaction control prepared through the extended protocol never stays
//!   in the upstream (SQL `EXECUTE` of it cannot end or undo the guarded block), and client frames
//!   are read completely (review of 2026-12-05, second round).
//! - `internal_names`: the proxy's own statement and portal names never outlive a failed
//!   internal group, client names with its prefix are refused, and protocol names are ASCII
//!   (review of 2026-12-05, second round, follow-up).
//! - `readiness`: `/readyz` follows the upstream.
//! - `review_wire`, `review_roles_and_memory`: the adversarial review's raw-wire attacks, and its
//!   attacks through database ownership and memory.
//! - `review_startup`: the database a client names, the startup fence read as Postgres reads
//!   it, and a shutdown that a client which stops reading cannot hold up.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a failed unwrap is a failed test, with its message"
)]

mod bypass;
mod commit;
mod discard;
mod end_to_end;
mod held_cursors;
mod implicit;
mod internal_names;
mod interrupted;
mod lost_table;
mod overhead;
mod preauth;
mod prepared_control;
mod protocol;
mod readiness;
mod reguard;
mod relexed;
mod review_roles_and_memory;
mod review_startup;
mod review_wire;
mod settings;
mod tokens;

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
