//! The in-process lock table: one async mutex per resource with a write in flight or in
//! quarantine, so that writes of one resource are forwarded one at a time by this process.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::OwnedMutexGuard;
use tokio::time::Instant;

use crate::StoreError;

/// Size of the table above which a release sweeps out idle entries whose quarantine ended.
/// Entries of resources in use are removed as soon as their last user leaves, so only resources
/// whose quarantine expired while nobody used them linger; sweeping past this size bounds them
/// without paying a scan on every release.
const SWEEP_ABOVE_ENTRIES: usize = 1024;

/// What the table remembers about a resource between two writes.
#[derive(Debug, Default)]
struct SlotState {
    /// End of the quarantine after a forward with an unknown outcome; `None` when open.
    /// `Instant` because it is a local, monotonic deadline that never leaves the process.
    quarantined_until: Option<Instant>,
}

type Slot = Arc<tokio::sync::Mutex<SlotState>>;

/// Per-resource async mutexes with quarantine. Cheap to clone; clones share the table.
#[derive(Clone, Debug, Default)]
pub struct Slots {
    /// Resource name to its mutex. A std mutex: it is held only to look up or prune entries.
    table: Arc<Mutex<HashMap<String, Slot>>>,
}

/// Exclusive use of one resource in this process. Dropping it opens the resource again, unless
/// [`SlotGuard::quarantine`] was called.
#[derive(Debug)]
pub struct SlotGuard {
    resource: String,
    state: Option<OwnedMutexGuard<SlotState>>,
    table: Arc<Mutex<HashMap<String, Slot>>>,
}

impl Slots {
    /// An empty table: every resource free.
    pub fn new() -> Self {
        Self::default()
    }

    /// Waits until `resource` is free and out of quarantine, or refuses with
    /// [`StoreError::Busy`] once `wait_max` has passed (at once if a quarantine outlasts it).
    pub async fn lock(
        &self,
        resource: &str,
        wait_max: std::time::Duration,
    ) -> Result<SlotGuard, StoreError> {
        let started = Instant::now();
        let deadline = started + wait_max;
        let slot = {
            let mut table = self.table.lock().expect("slot table poisoned");
            table.entry(resource.to_owned()).or_default().clone()
        };
        let mut state = match tokio::time::timeout_at(deadline, slot.lock_owned()).await {
            Ok(state) => state,
            Err(_) => {
                return Err(StoreError::busy(
                    resource,
                    "another write of it is being forwarded",
                    started.elapsed(),
                    wait_max,
                ));
            }
        };
        if let Some(until) = state.quarantined_until {
            if until > deadline {
                return Err(StoreError::busy(
                    resource,
                    "quarantined after a forward with an unknown outcome",
                    started.elapsed(),
                    wait_max,
                ));
            }
            tokio::time::sleep_until(until).await;
            state.quarantined_until = None;
        }
        Ok(SlotGuard {
            resource: resource.to_owned(),
            state: Some(state),
            table: self.table.clone(),
        })
    }

    /// Number of resources in the table (in use, waited for, or quarantined).
    pub fn len(&self) -> usize {
        self.table.lock().expect("slot table poisoned").len()
    }

    /// Whether no resource is in use, waited for or quarantined.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl SlotGuard {
    /// The resource this guard holds.
    pub fn resource(&self) -> &str {
        &self.resource
    }

    /// Keeps the resource closed for `period` after this guard is dropped.
    pub fn quarantine(&mut self, period: std::time::Duration) {
        if let Some(state) = self.state.as_mut() {
            state.quarantined_until = Some(Instant::now() + period);
        }
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        drop(self.state.take());
        let mut table = self.table.lock().expect("slot table poisoned");
        // Remove the entry when nobody else holds or waits for it (they clone the Arc under this
        // same lock, so the count cannot grow behind our back) and it carries no quarantine.
        let idle = |slot: &Slot| {
            Arc::strong_count(slot) == 1
                && slot
                    .try_lock()
                    .map(|s| s.quarantined_until.is_none_or(|t| t <= Instant::now()))
                    .unwrap_or(false)
        };
        if table.get(&self.resource).is_some_and(idle) {
            table.remove(&self.resource);
        }
        if table.len() > SWEEP_ABOVE_ENTRIES {
            table.retain(|_, slot| !idle(slot));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn second_writer_waits_for_the_first() {
        let slots = Slots::new();
        let first = slots.lock("r", Duration::from_secs(1)).await.unwrap();
        let err = slots
            .lock("r", Duration::from_millis(100))
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::Busy { .. }), "{err}");
        assert!(err.to_string().contains("\"r\""), "{err}");
        let other = slots.lock("s", Duration::from_millis(100)).await.unwrap();
        drop(first);
        let again = slots.lock("r", Duration::from_millis(100)).await.unwrap();
        drop((again, other));
        assert!(slots.is_empty(), "idle entries must be removed");
    }

    #[tokio::test(start_paused = true)]
    async fn quarantine_keeps_the_resource_closed() {
        let slots = Slots::new();
        let mut g = slots.lock("r", Duration::from_secs(1)).await.unwrap();
        g.quarantine(Duration::from_secs(5));
        drop(g);
        assert_eq!(slots.len(), 1, "a quarantined entry must stay");
        // A quarantine longer than the wait bound is refused at once.
        let t0 = Instant::now();
        let err = slots.lock("r", Duration::from_secs(2)).await.unwrap_err();
        assert!(err.to_string().contains("quarantined"), "{err}");
        assert!(t0.elapsed() < Duration::from_millis(10));
        // A waiter whose bound covers it waits it out.
        let g = slots.lock("r", Duration::from_secs(10)).await.unwrap();
        assert!(t0.elapsed() >= Duration::from_secs(5));
        drop(g);
        assert!(slots.is_empty());
    }
}
