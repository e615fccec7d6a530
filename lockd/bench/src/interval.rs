//! `mixed --interval`: the measured window cut into intervals by each call's intended send time,
//! with the acquire latency of each, so that a stalled minute shows its own latency instead of
//! disappearing into the run's percentiles.
//!
//! An interval is complete once the dispatcher has passed its end and every call it sent in it
//! has finished. Only then is its histogram read into a [`Row`] and dropped, so that a long run
//! holds histograms only for the few intervals whose calls are still outstanding.

use std::cmp::Reverse;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde_json::{Value, json};

use crate::stats::{latency_histogram, ms, record_latency};

/// Shortest `--interval`: a shorter one holds too few acquires for a p99 at the rates the bench
/// runs, and every interval with calls outstanding holds a histogram of about 170 KB.
pub const INTERVAL_MIN: Duration = Duration::from_secs(1);
/// How often complete intervals are looked for: a row is printed at most this long after its
/// last call ended.
pub const POLL: Duration = Duration::from_millis(200);

/// Start and end of each interval of a measured window of `duration`, since its start. The last
/// one is shorter when `interval` does not divide `duration`.
pub fn bounds(duration: Duration, interval: Duration) -> Vec<(Duration, Duration)> {
    assert!(
        !interval.is_zero(),
        "interval length checked with the flags"
    );
    let mut out = Vec::new();
    let mut start = Duration::ZERO;
    while start < duration {
        let end = (start + interval).min(duration);
        out.push((start, end));
        start = end;
    }
    out
}

/// Index of the interval that holds `offset` (time since the start of the measured window).
pub fn index_of(offset: Duration, interval: Duration) -> usize {
    (offset.as_nanos() / interval.as_nanos()) as usize
}

/// Acquire latency of one interval's successful acquires, µs.
#[derive(Clone, Debug, PartialEq)]
pub struct Latency {
    pub p50_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
}

/// The figures of one complete interval.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// Since the start of the measured window.
    pub start: Duration,
    pub end: Duration,
    /// Calls of all three ops, by intended send time, that succeeded.
    pub ok: u64,
    /// Calls that failed; a minute of timeouts would otherwise only show as a low `ok`.
    pub errors: u64,
    /// `None` when no acquire of the interval succeeded.
    pub acquire: Option<Latency>,
}

impl Row {
    /// The stderr line of interval `index` (from 0) of `count`.
    pub fn line(&self, index: usize, count: usize) -> String {
        let acquire = match &self.acquire {
            Some(l) => format!(
                "acquire p50 {} p99 {} max {}",
                fmt_ms(l.p50_us),
                fmt_ms(l.p99_us),
                fmt_ms(l.max_us)
            ),
            None => "no acquire succeeded".to_owned(),
        };
        format!(
            "interval {}/{count} {}: ok {} errors {}, {acquire}",
            index + 1,
            fmt_range(self.start, self.end),
            self.ok,
            self.errors
        )
    }

    pub fn json(&self) -> Value {
        let acquire = |f: fn(&Latency) -> u64| self.acquire.as_ref().map(|l| ms(f(l)));
        json!({
            "start_s": self.start.as_secs_f64(),
            "end_s": self.end.as_secs_f64(),
            "ok": self.ok,
            "errors": self.errors,
            "acquire_p50_ms": acquire(|l| l.p50_us),
            "acquire_p99_ms": acquire(|l| l.p99_us),
            "acquire_max_ms": acquire(|l| l.max_us),
        })
    }
}

/// The interval with the highest acquire p99, against the run's.
#[derive(Debug, PartialEq)]
pub struct Worst {
    /// Index into the rows, from 0.
    pub index: usize,
    pub p99_us: u64,
    pub run_p99_us: u64,
    /// `p99_us / run_p99_us`.
    pub ratio: f64,
}

/// The first interval with the highest acquire p99 and that p99 over the run's; `None` when no
/// interval has a successful acquire or the run has no acquire p99 to divide by.
pub fn worst(rows: &[Row], run_p99_us: Option<u64>) -> Option<Worst> {
    let run_p99_us = run_p99_us.filter(|us| *us > 0)?;
    let (index, p99_us) = rows
        .iter()
        .enumerate()
        .filter_map(|(i, r)| Some((i, r.acquire.as_ref()?.p99_us)))
        .max_by_key(|(i, p99)| (*p99, Reverse(*i)))?;
    Some(Worst {
        index,
        p99_us,
        run_p99_us,
        ratio: p99_us as f64 / run_p99_us as f64,
    })
}

impl Worst {
    /// The closing line, `rows` being what `index` points into.
    pub fn line(&self, rows: &[Row]) -> String {
        let row = &rows[self.index];
        format!(
            "worst interval acquire p99: {} (interval {}/{}, {}) = {:.2} x the run's acquire p99 {}",
            fmt_ms(self.p99_us),
            self.index + 1,
            rows.len(),
            fmt_range(row.start, row.end),
            self.ratio,
            fmt_ms(self.run_p99_us)
        )
    }
}

/// What one interval has recorded so far.
struct Slot {
    /// Calls sent with an intended time in the interval.
    sent: u64,
    /// Of those, calls not finished yet.
    pending: u64,
    ok: u64,
    /// Acquire latency of successes (µs), made at the first one, taken when the row is made.
    acquire: Option<Histogram<u64>>,
    /// The interval's figures once it is complete; later calls no longer count.
    row: Option<Row>,
}

impl Slot {
    fn freeze(&mut self, (start, end): (Duration, Duration)) -> Row {
        let acquire = self.acquire.take().map(|h| Latency {
            p50_us: h.value_at_quantile(0.50),
            p99_us: h.value_at_quantile(0.99),
            max_us: h.max(),
        });
        let row = Row {
            start,
            end,
            ok: self.ok,
            // Calls still pending (only after the final drain) are neither.
            errors: self.sent - self.pending - self.ok,
            acquire,
        };
        self.row = Some(row.clone());
        row
    }
}

/// The intervals of one run; with `--interval` off it has none and records nothing.
pub struct Intervals {
    /// Intended time of the first measured call.
    measure_start: Instant,
    /// `--interval`, if given.
    interval: Option<Duration>,
    /// From [`bounds`]; one per slot.
    bounds: Vec<(Duration, Duration)>,
    slots: Vec<Mutex<Slot>>,
    /// Nanoseconds since `measure_start` before which the dispatcher has dealt with every
    /// intended time (sent or skipped the call); `u64::MAX` once it has stopped.
    dispatched_ns: AtomicU64,
    /// The first interval whose row has not been handed out yet.
    next: Mutex<usize>,
}

impl Intervals {
    pub fn new(measure_start: Instant, duration: Duration, interval: Option<Duration>) -> Self {
        let bounds = interval.map_or_else(Vec::new, |i| bounds(duration, i));
        Intervals {
            measure_start,
            interval,
            slots: bounds
                .iter()
                .map(|_| {
                    Mutex::new(Slot {
                        sent: 0,
                        pending: 0,
                        ok: 0,
                        acquire: None,
                        row: None,
                    })
                })
                .collect(),
            bounds,
            dispatched_ns: AtomicU64::new(0),
            next: Mutex::new(0),
        }
    }

    /// Number of intervals (0 when off).
    pub fn count(&self) -> usize {
        self.slots.len()
    }

    fn slot(&self, intended: Instant) -> Option<std::sync::MutexGuard<'_, Slot>> {
        let interval = self.interval?;
        let offset = intended.checked_duration_since(self.measure_start)?;
        let slot = self.slots.get(index_of(offset, interval))?;
        Some(slot.lock().expect("interval lock"))
    }

    /// A call intended at `intended` was sent.
    pub fn sent(&self, intended: Instant) {
        if let Some(mut s) = self.slot(intended) {
            s.sent += 1;
            s.pending += 1;
        }
    }

    /// A call intended at `intended` succeeded; `acquire_latency` is its latency if an acquire.
    pub fn ok(&self, intended: Instant, acquire_latency: Option<Duration>) {
        if let Some(mut s) = self.slot(intended)
            && s.row.is_none()
        {
            s.ok += 1;
            if let Some(latency) = acquire_latency {
                record_latency(s.acquire.get_or_insert_with(latency_histogram), latency);
            }
        }
    }

    /// A call intended at `intended` has finished, whatever its outcome.
    pub fn finished(&self, intended: Instant) {
        if let Some(mut s) = self.slot(intended) {
            s.pending = s.pending.saturating_sub(1);
        }
    }

    /// The dispatcher is about to deal with the call intended at `next`: every earlier one is
    /// sent or skipped.
    pub fn dispatched_until(&self, next: Instant) {
        if let Some(offset) = next.checked_duration_since(self.measure_start) {
            let ns = u64::try_from(offset.as_nanos()).unwrap_or(u64::MAX);
            // Release: the `sent` of every earlier call is seen by whoever reads this.
            self.dispatched_ns.store(ns, Ordering::Release);
        }
    }

    /// The dispatcher has stopped.
    pub fn dispatched_all(&self) {
        self.dispatched_ns.store(u64::MAX, Ordering::Release);
    }

    /// Rows of the intervals completed since the last call, in order, with their indexes.
    pub fn take_complete(&self) -> Vec<(usize, Row)> {
        let dispatched_ns = self.dispatched_ns.load(Ordering::Acquire);
        let mut next = self.next.lock().expect("interval cursor lock");
        let mut out = Vec::new();
        while let Some(&bounds) = self.bounds.get(*next) {
            if bounds.1.as_nanos() > u128::from(dispatched_ns) {
                break;
            }
            let mut slot = self.slots[*next].lock().expect("interval lock");
            if slot.pending > 0 {
                break;
            }
            out.push((*next, slot.freeze(bounds)));
            *next += 1;
        }
        out
    }

    /// Rows of every interval not handed out yet, complete or not: the run is over.
    pub fn take_rest(&self) -> Vec<(usize, Row)> {
        let mut next = self.next.lock().expect("interval cursor lock");
        let out = (*next..self.slots.len())
            .map(|i| {
                let mut slot = self.slots[i].lock().expect("interval lock");
                (i, slot.freeze(self.bounds[i]))
            })
            .collect();
        *next = self.slots.len();
        out
    }

    /// Every row made so far, in order (all of them after [`Intervals::take_rest`]).
    pub fn rows(&self) -> Vec<Row> {
        self.slots
            .iter()
            .filter_map(|s| s.lock().expect("interval lock").row.clone())
            .collect()
    }
}

/// `8.1 ms`: one unit for every latency of these lines, so that a long run's lines compare by eye
/// and by script.
fn fmt_ms(us: u64) -> String {
    format!("{:.1} ms", us as f64 / 1000.0)
}

/// `120-180s`, `1.5-3s`.
fn fmt_range(start: Duration, end: Duration) -> String {
    format!("{}-{}s", start.as_secs_f64(), end.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    fn row(p99_ms: Option<u64>) -> Row {
        Row {
            start: Duration::ZERO,
            end: secs(1.0),
            ok: 1,
            errors: 0,
            acquire: p99_ms.map(|ms| Latency {
                p50_us: 1_000,
                p99_us: ms * 1_000,
                max_us: ms * 1_000,
            }),
        }
    }

    #[test]
    fn bounds_end_with_a_partial_interval() {
        assert_eq!(
            bounds(secs(12.0), secs(5.0)),
            [
                (secs(0.0), secs(5.0)),
                (secs(5.0), secs(10.0)),
                (secs(10.0), secs(12.0))
            ]
        );
        assert_eq!(
            bounds(secs(10.0), secs(5.0)).len(),
            2,
            "no empty last interval"
        );
        assert_eq!(bounds(secs(60.0), secs(60.0)), [(secs(0.0), secs(60.0))]);
    }

    #[test]
    fn a_call_counts_in_the_interval_of_its_intended_time() {
        let i = secs(5.0);
        assert_eq!(index_of(Duration::ZERO, i), 0);
        assert_eq!(index_of(secs(4.999_999), i), 0);
        assert_eq!(
            index_of(secs(5.0), i),
            1,
            "an end belongs to the next interval"
        );
        assert_eq!(index_of(secs(11.9), i), 2, "the partial last interval");
    }

    #[test]
    fn worst_is_the_first_highest_p99_over_the_run_p99() {
        let rows = [row(Some(10)), row(None), row(Some(40)), row(Some(40))];
        let w = worst(&rows, Some(20_000)).expect("intervals with acquires");
        assert_eq!((w.index, w.p99_us), (2, 40_000));
        assert!((w.ratio - 2.0).abs() < 1e-9, "{}", w.ratio);
        assert!(
            w.line(&rows)
                .ends_with("40.0 ms (interval 3/4, 0-1s) = 2.00 x the run's acquire p99 20.0 ms"),
            "{}",
            w.line(&rows)
        );
        assert_eq!(worst(&[], Some(20_000)), None, "no intervals");
        assert_eq!(worst(&[row(None)], Some(20_000)), None, "no acquire");
        assert_eq!(worst(&rows, None), None, "nothing to divide by");
    }

    /// Goal: an interval is reported only when the dispatcher has passed it and its calls have
    /// finished, and its latency is that of the calls intended in it. Method: calls at chosen
    /// intended times, no cluster.
    #[test]
    fn an_interval_completes_when_passed_and_its_calls_finished() {
        let t0 = Instant::now();
        let at = |s: f64| t0 + secs(s);
        let iv = Intervals::new(t0, secs(12.0), Some(secs(5.0)));
        assert_eq!(iv.count(), 3);

        // Phase 1: a call in interval 0, answered late, and one in interval 1.
        iv.sent(at(1.0));
        iv.sent(at(6.0));
        iv.ok(at(6.0), Some(secs(0.004)));
        iv.finished(at(6.0));
        iv.dispatched_until(at(7.0));
        assert!(
            iv.take_complete().is_empty(),
            "interval 0 still has a call out"
        );

        // Phase 2: the late call ends: interval 0 completes, interval 1 is not passed yet.
        iv.ok(at(1.0), Some(secs(2.0)));
        iv.finished(at(1.0));
        let done = iv.take_complete();
        assert_eq!(done.len(), 1);
        let (index, r) = &done[0];
        assert_eq!(*index, 0);
        assert_eq!((r.ok, r.errors), (1, 0));
        let l = r.acquire.as_ref().expect("one acquire");
        assert!((1_999_000..=2_001_000).contains(&l.p99_us), "{l:?}");

        // Phase 3: a failed call in interval 2; the dispatcher stops; the rest completes.
        iv.sent(at(11.0));
        iv.finished(at(11.0));
        iv.dispatched_all();
        let done = iv.take_complete();
        assert_eq!(done.iter().map(|(i, _)| *i).collect::<Vec<_>>(), [1, 2]);
        assert_eq!((done[1].1.ok, done[1].1.errors), (0, 1));
        assert_eq!(done[1].1.acquire, None);
        assert_eq!(iv.rows().len(), 3);
        assert!(iv.take_rest().is_empty());
    }

    #[test]
    fn off_records_nothing() {
        let t0 = Instant::now();
        let iv = Intervals::new(t0, secs(12.0), None);
        iv.sent(t0);
        iv.dispatched_all();
        assert_eq!(iv.count(), 0);
        assert!(iv.take_rest().is_empty());
    }
}
