//! Hot resources for Status: the most acquired resources (a decaying space-saving sketch) and the
//! longest queues, kept by a thread of their own.
//!
//! Apply only hands each relevant event to that thread through a bounded channel (a send that
//! never blocks; when the channel is full the event is dropped, these are statistics). Status
//! reads the lists under their own mutex, which apply never takes, in O(k). Before these lists,
//! Status cloned and sorted up to 100,000 names under a mutex apply took for every
//! grant, and scanned the whole table under the state machine's read lock.

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Counters of the acquires sketch. A resource with more than 1/k of the (decayed) acquires is
/// always among them; 64 keeps a top-10 list meaningful at a cost of 64 short names.
pub const HOT_ACQUIRES_TRACKED: usize = 64;
/// Queues tracked: the longest seen, replaced when a longer one shows up.
pub const HOT_QUEUES_TRACKED: usize = 64;
/// Acquire counts halve this often, so the list follows what is hot now rather than since start.
const HOT_DECAY_PERIOD: Duration = Duration::from_secs(60);
/// Events buffered between apply and the tracker thread.
const HOT_QUEUE_MAX: usize = 65_536;

/// What apply reports about one resource.
pub enum HotEvent {
    /// A grant to a caller or a newly queued waiter.
    Acquire(String),
    /// The resource's queue length after an entry that changed it.
    Queue(String, u32),
    /// A snapshot replaced the table: these are now the longest queues.
    ResetQueues(Vec<(String, u32)>),
    /// Answered once every event before it is counted.
    #[cfg_attr(
        not(test),
        allow(dead_code, reason = "sent only by `flush`, which the unit tests use")
    )]
    Flush(std::sync::mpsc::Sender<()>),
}

/// The apply side and the Status side of the hot lists.
pub struct HotTracker {
    tx: SyncSender<HotEvent>,
    lists: Arc<Mutex<HotLists>>,
}

impl HotTracker {
    /// Starts the tracker thread; it stops when the tracker is dropped.
    pub fn start() -> Self {
        let (tx, rx) = sync_channel(HOT_QUEUE_MAX);
        let lists = Arc::new(Mutex::new(HotLists::default()));
        let l = lists.clone();
        std::thread::Builder::new()
            .name("hot-resources".into())
            .spawn(move || track(rx, l))
            .expect("spawning the hot-resources thread");
        HotTracker { tx, lists }
    }

    /// Never blocks: a full channel drops the event.
    pub fn report(&self, event: HotEvent) {
        if let Err(TrySendError::Disconnected(_)) = self.tx.try_send(event) {
            tracing::debug!("hot-resources thread has stopped");
        }
    }

    /// The `n` most acquired resources (decayed counts, each with its tracked queue length).
    pub fn top_by_acquires(&self, n: usize) -> Vec<(String, u64, u32)> {
        let l = self.lists.lock().expect("hot lists lock");
        l.acquires
            .top(n)
            .into_iter()
            .map(|(r, c)| {
                let q = l.queues.get(&r);
                (r, c, q)
            })
            .collect()
    }

    /// The `n` longest queues tracked.
    pub fn top_by_waiters(&self, n: usize) -> Vec<(String, u32)> {
        self.lists.lock().expect("hot lists lock").queues.top(n)
    }

    /// Waits until every event reported so far is counted.
    #[cfg(test)]
    pub fn flush(&self) {
        let (tx, rx) = std::sync::mpsc::channel();
        if self.tx.send(HotEvent::Flush(tx)).is_ok() {
            let _ = rx.recv();
        }
    }
}

#[derive(Default)]
struct HotLists {
    acquires: SpaceSaving,
    queues: LongestQueues,
}

fn track(rx: Receiver<HotEvent>, lists: Arc<Mutex<HotLists>>) {
    let mut next_decay = Instant::now() + HOT_DECAY_PERIOD;
    loop {
        let first = match rx.recv_timeout(HOT_DECAY_PERIOD) {
            Ok(e) => Some(e),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        let batch: Vec<HotEvent> = first.into_iter().chain(rx.try_iter()).collect();
        let mut l = lists.lock().expect("hot lists lock");
        let mut acks = Vec::new();
        for e in batch {
            match e {
                HotEvent::Acquire(r) => l.acquires.add(r),
                HotEvent::Queue(r, n) => l.queues.set(r, n),
                HotEvent::Flush(ack) => acks.push(ack),
                HotEvent::ResetQueues(all) => {
                    l.queues = LongestQueues::default();
                    for (r, n) in all {
                        l.queues.set(r, n);
                    }
                }
            }
        }
        if Instant::now() >= next_decay {
            l.acquires.halve();
            next_decay = Instant::now() + HOT_DECAY_PERIOD;
        }
        drop(l);
        for ack in acks {
            let _ = ack.send(());
        }
    }
}

/// Metwally et al.'s space-saving sketch: k counters; an unseen item takes over the smallest
/// counter (inheriting its count), so every item counted more than total/k times is present.
/// O(k) per new item with k fixed (a scan of 64 counters), O(1) for a tracked one.
#[derive(Default)]
struct SpaceSaving {
    counts: HashMap<String, u64>,
}

impl SpaceSaving {
    fn add(&mut self, item: String) {
        if let Some(c) = self.counts.get_mut(&item) {
            *c += 1;
            return;
        }
        if self.counts.len() < HOT_ACQUIRES_TRACKED {
            self.counts.insert(item, 1);
            return;
        }
        let (min_item, min) = self
            .counts
            .iter()
            .min_by(|a, b| a.1.cmp(b.1).then_with(|| b.0.cmp(a.0)))
            .map(|(k, v)| (k.clone(), *v))
            .expect("the sketch is full");
        self.counts.remove(&min_item);
        self.counts.insert(item, min + 1);
    }

    /// Decay: halves every count and drops counters that reach zero.
    fn halve(&mut self) {
        self.counts.retain(|_, c| {
            *c /= 2;
            *c > 0
        });
    }

    fn top(&self, n: usize) -> Vec<(String, u64)> {
        let mut all: Vec<(String, u64)> =
            self.counts.iter().map(|(k, v)| (k.clone(), *v)).collect();
        all.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        all.truncate(n);
        all
    }
}

/// The longest queues seen, with their current lengths. Every change of a queue reports its new
/// length, so a tracked queue is exact; an untracked one enters once it outgrows the shortest
/// tracked queue, at its next change.
#[derive(Default)]
struct LongestQueues {
    lens: HashMap<String, u32>,
}

impl LongestQueues {
    fn set(&mut self, resource: String, len: u32) {
        if len == 0 {
            self.lens.remove(&resource);
            return;
        }
        if self.lens.len() < HOT_QUEUES_TRACKED || self.lens.contains_key(&resource) {
            self.lens.insert(resource, len);
            return;
        }
        let (min_r, min) = self
            .lens
            .iter()
            .min_by(|a, b| a.1.cmp(b.1).then_with(|| b.0.cmp(a.0)))
            .map(|(k, v)| (k.clone(), *v))
            .expect("full");
        if len > min {
            self.lens.remove(&min_r);
            self.lens.insert(resource, len);
        }
    }

    fn get(&self, resource: &str) -> u32 {
        self.lens.get(resource).copied().unwrap_or(0)
    }

    fn top(&self, n: usize) -> Vec<(String, u32)> {
        let mut all: Vec<(String, u32)> = self.lens.iter().map(|(k, v)| (k.clone(), *v)).collect();
        all.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        all.truncate(n);
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: the sketch finds the heavy resources among many more names
    /// than it has counters, and forgets old heat. Method: 10 heavy names among 10,000 one-off
    /// names; then halve until only fresh traffic counts.
    #[test]
    fn issue14_finding6_sketch_keeps_heavy_resources_among_many() {
        let mut s = SpaceSaving::default();
        for round in 0..1_000 {
            for h in 0..10 {
                s.add(format!("heavy/{h}"));
            }
            for c in 0..10 {
                s.add(format!("cold/{}", round * 10 + c));
            }
        }
        assert!(s.counts.len() <= HOT_ACQUIRES_TRACKED);
        let top: Vec<String> = s.top(10).into_iter().map(|(r, _)| r).collect();
        let mut want: Vec<String> = (0..10).map(|h| format!("heavy/{h}")).collect();
        want.sort();
        let mut got = top.clone();
        got.sort();
        assert_eq!(got, want, "{top:?}");
        for (_, c) in s.top(10) {
            assert!(c >= 1_000, "a heavy count is at least its true count: {c}");
        }
        for _ in 0..20 {
            s.halve();
        }
        s.add("fresh".into());
        assert_eq!(s.top(1), vec![("fresh".to_owned(), 1)]);
    }

    #[test]
    fn longest_queues_follow_lengths_and_admit_longer_ones() {
        let mut q = LongestQueues::default();
        for i in 0..HOT_QUEUES_TRACKED as u32 {
            q.set(format!("q/{i}"), 1 + i % 3);
        }
        q.set("long".into(), 50);
        q.set("short".into(), 1);
        assert_eq!(q.top(1), vec![("long".to_owned(), 50)]);
        assert_eq!(q.get("short"), 0, "not longer than the shortest tracked");
        q.set("long".into(), 0);
        assert_eq!(q.get("long"), 0);
        assert!(q.lens.len() <= HOT_QUEUES_TRACKED);
    }

    /// Goal: a Status read while the tracker is busy does not wait for apply, and apply never
    /// waits for a Status read. Method: hold the lists' lock (a Status read in progress) while
    /// reporting more events than the channel holds; report must return at once.
    #[test]
    fn issue14_finding6_reporting_never_blocks_on_a_reader() {
        let t = HotTracker::start();
        let guard = t.lists.lock().unwrap();
        let started = Instant::now();
        for i in 0..(HOT_QUEUE_MAX + 10_000) {
            t.report(HotEvent::Acquire(format!("r/{}", i % 7)));
        }
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        drop(guard);
        t.flush();
        assert_eq!(t.top_by_acquires(7).len(), 7);
        t.report(HotEvent::Queue("q".into(), 3));
        t.flush();
        assert_eq!(t.top_by_waiters(1), vec![("q".to_owned(), 3)]);
    }
}
