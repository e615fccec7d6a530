//! The time a leader stamps on batches.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use lockd_core::Stamp;
use rand::RngExt;

/// This process's clocks as the lock table uses them. The table's clock advances by differences
/// of `mono_ms` within one `session` (see `lockd_core::LockTable::apply`), so the wall clock
/// matters only for the first time of an empty table: a node whose wall clock is off by hours
/// neither expires leases early nor freezes expiry.
#[derive(Clone)]
pub struct Clock {
    base_unix_ms: i64,
    base: Instant,
    /// Random per process start: two stamps of one session come from the same `base`.
    session: u64,
    /// Random per process start, secret (see `Stamp::key_seed`).
    key_seed: u128,
    /// Test-only shift of the wall clock (fault injection of a wrong clock); 0 in production.
    offset_ms: i64,
}

impl Clock {
    /// `LOCKD_TEST_CLOCK_OFFSET_MS` (test-only, for fault injection) shifts this node's wall
    /// clock, as if it were that far off when the process started.
    pub fn new() -> Self {
        let offset = std::env::var("LOCKD_TEST_CLOCK_OFFSET_MS")
            .ok()
            .and_then(|v| v.parse::<i64>().ok())
            .unwrap_or(0);
        let unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0);
        Clock {
            base_unix_ms: unix,
            base: Instant::now(),
            session: rand::rng().random::<u64>(),
            key_seed: rand::rng().random::<u128>(),
            offset_ms: offset,
        }
    }

    /// Milliseconds of the monotonic clock since this process started.
    pub fn mono_ms(&self) -> u64 {
        self.base.elapsed().as_millis() as u64
    }

    pub fn session(&self) -> u64 {
        self.session
    }

    /// The stamp of a batch proposed now by the leader of `term`, with the wall clock.
    pub fn stamp(&self, term: u64) -> (i64, Stamp) {
        let mono_ms = self.mono_ms();
        let wall = self.base_unix_ms + mono_ms as i64 + self.offset_ms;
        (
            wall,
            Stamp {
                term,
                session: self.session,
                mono_ms,
                key_seed: self.key_seed,
            },
        )
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}
