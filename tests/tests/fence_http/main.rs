//! fence-proxy's HTTP front end: fence checks, token order across two proxy processes
//! sharing the Postgres store, faults, restart with the redb store, and end to end with lockd.
//!
//! Every test starts a real HTTP upstream that logs the requests it applied, in order, and real
//! `fence-proxy` processes. Postgres tests use a table of their own, so tests run in parallel.
//!
//! # Layout
//! - `checks`: the fence checks with either store, and two proxies sharing the Postgres store.
//! - `faults`: an unreachable store, an upstream that is down or too slow, a restart with the redb
//!   store, and a stale lockd holder fenced end to end.
//! - `slow_clients`: trickling bodies, stalled and disconnected writers, slow headers and the
//!   connection cap.
//! - `readiness`: `/readyz` follows the epoch store and the upstream.
//! - `framing`: nothing inside a body reaches the upstream as a request of its own (methods that
//!   keep the connection, `Expect`), and an HTTP/2 upload its client reset is never complete.
//! - `reads`: reads reuse the upstream connections of their thread, and a connection that was
//!   closed or left half-read is never used again.
//! - `shared`: writes of one token share their resource; a higher token waits for them.
//! - `epochs`: `fence-proxy epochs max` over a redb store (also a killed proxy's), a Postgres
//!   store and a fence table.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a failed unwrap is a failed test, with its message"
)]

mod checks;
mod epochs;
mod faults;
mod framing;
mod readiness;
mod reads;
mod shared;
mod slow_clients;

use lockd_tests::fence_proxy::{FenceProxy, Reply};
use lockd_tests::pg;

/// A table of the shared Postgres that is dropped when the test ends.
struct PgTable {
    name: String,
}

impl PgTable {
    fn new(prefix: &str) -> PgTable {
        pg::require_postgres();
        PgTable {
            name: pg::unique_name(prefix),
        }
    }

    fn store(&self) -> String {
        pg::direct_url()
    }
}

impl PgTable {
    /// Runs `sql` on the shared Postgres with psql; panics naming the statement if it fails.
    fn run(&self, sql: &str) {
        let out = psql(sql).expect("psql runs");
        assert!(
            out.status.success(),
            "{sql}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for PgTable {
    fn drop(&mut self) {
        let _ = psql(&format!("DROP TABLE IF EXISTS {}", self.name));
    }
}

/// `sql` run by psql on the shared Postgres, stopping at the first error.
fn psql(sql: &str) -> std::io::Result<std::process::Output> {
    std::process::Command::new("psql")
        .args([
            "-q",
            "-X",
            "-v",
            "ON_ERROR_STOP=1",
            "-h",
            pg::PG_HOST,
            "-U",
            pg::PG_USER,
            "-d",
            pg::PG_DATABASE,
        ])
        .args(["-c", sql])
        .output()
}

fn redb_store(dir: &tempfile::TempDir) -> String {
    format!("redb:{}", dir.path().join("epochs.redb").display())
}

async fn put(proxy: &FenceProxy, resource: &str, token: &str, body: &str) -> Reply {
    proxy
        .write("PUT", "/obj", (Some(resource), Some(token)), &[], body)
        .await
        .unwrap()
}

/// A write the upstream takes `delay_ms` over, longer than the proxy's `--upstream-timeout`:
/// the proxy answers 504 and quarantines `resource` (the upstream still applies the write).
async fn time_out(proxy: &FenceProxy, resource: &str, token: &str, delay_ms: u64) {
    let delay = delay_ms.to_string();
    let reply = proxy
        .write(
            "PUT",
            "/obj",
            (Some(resource), Some(token)),
            &[(lockd_tests::http_upstream::DELAY_HEADER, delay.as_str())],
            "late",
        )
        .await
        .unwrap();
    assert_refused(&reply, 504, "upstream-timeout");
}

/// A refusal as RFC 9457 describes a problem: `application/problem+json` with `type`, `title`,
/// `status` and `detail`, plus the reason in the header and in `error`.
fn assert_refused(reply: &Reply, status: u16, reason: &str) {
    assert_eq!(reply.status, status, "{reply:?}");
    assert_eq!(reply.proxy_error(), Some(reason), "{reply:?}");
    assert_eq!(
        reply
            .headers
            .get(hyper::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok()),
        Some("application/problem+json"),
        "{reply:?}"
    );
    let body = reply.json();
    assert_eq!(body["error"], reason, "{reply:?}");
    assert_eq!(
        body["type"],
        format!("urn:lockd:problem:{reason}"),
        "{reply:?}"
    );
    assert_eq!(body["status"], status, "{reply:?}");
    assert!(
        body["title"].as_str().is_some_and(|t| !t.is_empty()),
        "{reply:?}"
    );
    assert_eq!(body["detail"], body["message"], "{reply:?}");
}
