//! The time a leader stamps on batches.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Wall-clock Unix ms read once at start, then advanced by the monotonic clock: a wall-clock
/// step (NTP, an operator) during the process's life cannot shorten a lease. The lock table
/// additionally never lets its own clock go back, and extends leases at each new term.
#[derive(Clone)]
pub struct Clock {
    base_unix_ms: i64,
    base: Instant,
    /// Test-only shift (fault injection of a clock jump); 0 in production.
    offset_ms: Arc<AtomicI64>,
}

impl Clock {
    /// `LOCKD_TEST_CLOCK_OFFSET_MS` (test-only, for fault injection) shifts this node's stamps, as
    /// if its wall clock were that far off when the process started.
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
            offset_ms: Arc::new(AtomicI64::new(offset)),
        }
    }

    pub fn now_ms(&self) -> i64 {
        self.base_unix_ms
            + self.base.elapsed().as_millis() as i64
            + self.offset_ms.load(Ordering::Relaxed)
    }

    pub fn set_offset_ms(&self, offset: i64) {
        self.offset_ms.store(offset, Ordering::Relaxed);
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}
