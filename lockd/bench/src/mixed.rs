//! `mixed`: an open-loop generator at a fixed rate, a third each acquire, renew and release.
//!
//! Call `i` has the intended send time `start + i / rate`, fixed before the run, and its latency
//! is measured from that instant, not from when the call actually left. A stalled cluster (or a
//! starved generator) therefore shows up as latency instead of silently lowering the offered load
//! (no coordinated omission).
//!
//! The resource table mirrors what the bench believes about each resource. Acquires go to free
//! resources only, so every acquire is uncontended; renews take the idle lease that was renewed
//! (or acquired) longest ago, so with `held = renew rate x renew period` every lease is renewed
//! once per period; releases take a uniformly random idle lease. A resource whose last call had an
//! unknown outcome is not used again until its lease would have expired.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use lockd_api::v1::{AcquireRequest, ReleaseRequest, RenewRequest};
use rand::RngExt;
use serde_json::json;
use tokio::sync::Semaphore;

use crate::call::call;
use crate::cli::{Cli, MixedArgs};
use crate::interval::{self, INTERVAL_MIN, Intervals};
use crate::pool::Pool;
use crate::progress::Progress;
use crate::stats::{NOT_RELEASED, Recorder, fmt_us};
use crate::status_load::{STATUS_CALLERS_MAX, STATUS_OP, StatusLoad};

const OPS: [&str; 3] = ["acquire", "renew", "release"];
/// Calls outstanding at once. An open loop must not wait for replies, but a dead cluster must
/// not make the bench eat all memory either; past this the dispatcher waits, and since latency
/// counts from the intended time the wait still shows in the figures.
const MAX_IN_FLIGHT: usize = 100_000;
/// Random probes for a free resource before an acquire is skipped.
const PICK_TRIES: usize = 64;
/// Concurrency of the unmeasured release of all held leases at the end.
const CLEANUP_CONCURRENCY: usize = 256;
/// Upper bound of the rate: below 1 ns between intended send times the schedule means nothing.
const RATE_MAX: u64 = 1_000_000;
/// Default number of held leases at and above the default rate: the requirement's 20,000. Below
/// it the default shrinks so that every lease is still renewed once per `--renew-every`; above
/// it leases are simply renewed more often.
const HELD_DEFAULT_MAX: u32 = 20_000;

/// What the bench believes about one resource.
enum Slot {
    Free,
    /// A call on it is outstanding.
    Busy,
    /// An idle lease of ours. `ticket` tells a current renew-queue entry from a stale one; `pos`
    /// is the index in `Table::held`.
    Held {
        lease_id: Arc<str>,
        ticket: u64,
        pos: usize,
    },
    /// The last call's outcome is unknown: a lease of ours may exist until this instant.
    Quarantined(Instant),
}

/// The resource table and the two orders of idle leases.
struct Table {
    slots: Vec<Slot>,
    /// Resources with an idle lease, for uniform random release (swap_remove keeps it O(1)).
    held: Vec<u32>,
    /// (resource, ticket) in order of last acquire or renew; entries whose ticket no longer
    /// matches the slot are stale and skipped when they reach the front.
    renew_queue: VecDeque<(u32, u64)>,
    next_ticket: u64,
    /// Acquires in flight, so that the warmup does not overshoot `--held`.
    acquiring: u32,
}

impl Table {
    fn new(resources: u32) -> Self {
        Table {
            slots: (0..resources).map(|_| Slot::Free).collect(),
            held: Vec::new(),
            renew_queue: VecDeque::new(),
            next_ticket: 0,
            acquiring: 0,
        }
    }

    fn pick_acquire(&mut self, now: Instant) -> Option<u32> {
        let mut rng = rand::rng();
        for _ in 0..PICK_TRIES {
            let r = rng.random_range(0..self.slots.len() as u32);
            let usable = match &self.slots[r as usize] {
                Slot::Free => true,
                Slot::Quarantined(until) => *until <= now,
                Slot::Busy | Slot::Held { .. } => false,
            };
            if usable {
                self.slots[r as usize] = Slot::Busy;
                self.acquiring += 1;
                return Some(r);
            }
        }
        None
    }

    fn pick_renew(&mut self) -> Option<(u32, Arc<str>)> {
        while let Some((r, ticket)) = self.renew_queue.pop_front() {
            if matches!(&self.slots[r as usize], Slot::Held { ticket: t, .. } if *t == ticket) {
                return Some((r, self.take(r)));
            }
        }
        None
    }

    fn pick_release(&mut self) -> Option<(u32, Arc<str>)> {
        if self.held.is_empty() {
            return None;
        }
        let r = self.held[rand::rng().random_range(0..self.held.len())];
        Some((r, self.take(r)))
    }

    /// Marks an idle lease busy and returns its id.
    fn take(&mut self, r: u32) -> Arc<str> {
        let Slot::Held { lease_id, pos, .. } =
            std::mem::replace(&mut self.slots[r as usize], Slot::Busy)
        else {
            unreachable!("take is only called on held slots");
        };
        self.held.swap_remove(pos);
        if let Some(&moved) = self.held.get(pos)
            && let Slot::Held { pos: p, .. } = &mut self.slots[moved as usize]
        {
            *p = pos;
        }
        lease_id
    }

    /// Records an idle lease (after an acquire or renew), at the back of the renew order.
    fn hold(&mut self, r: u32, lease_id: Arc<str>) {
        self.next_ticket += 1;
        let ticket = self.next_ticket;
        self.slots[r as usize] = Slot::Held {
            lease_id,
            ticket,
            pos: self.held.len(),
        };
        self.held.push(r);
        self.renew_queue.push_back((r, ticket));
    }

    fn set(&mut self, r: u32, slot: Slot) {
        self.slots[r as usize] = slot;
    }
}

/// One planned call.
enum Planned {
    Acquire(u32),
    Renew(u32, Arc<str>),
    Release(u32, Arc<str>),
}

/// Fixed parameters of the run, shared by all call tasks.
struct Ctx {
    pool: Arc<Pool>,
    table: Mutex<Table>,
    prefix: String,
    ttl: Duration,
    request_timeout: Duration,
    run_id: u64,
    seq: AtomicU64,
    /// Intended time of the first measured call.
    measure_start: Instant,
    /// Worst latency (µs) of the calls intended in each second of the measured phase.
    worst_by_second: Vec<AtomicU64>,
    /// Calls and acquire latency per `--interval` of the measured phase (none when off).
    intervals: Intervals,
    measured: Recorder,
    warmup: Recorder,
    sent: AtomicU64,
    in_flight: AtomicUsize,
}

impl Ctx {
    fn name(&self, r: u32) -> String {
        format!("{}/{r}", self.prefix)
    }

    fn recorder(&self, intended: Instant) -> &Recorder {
        if intended >= self.measure_start {
            &self.measured
        } else {
            &self.warmup
        }
    }

    /// A successful call: the measured phase's figures by intended time (the recorder is apart).
    fn note_ok(&self, op: &'static str, intended: Instant, latency: Duration) {
        if let Some(sec) = intended.checked_duration_since(self.measure_start)
            && let Some(slot) = self.worst_by_second.get(sec.as_secs() as usize)
        {
            slot.fetch_max(latency.as_micros() as u64, Ordering::Relaxed);
        }
        self.intervals
            .ok(intended, (op == "acquire").then_some(latency));
    }

    fn quarantine(&self, r: u32) {
        let until = Instant::now() + self.ttl + Duration::from_secs(1);
        self.table
            .lock()
            .expect("table lock")
            .set(r, Slot::Quarantined(until));
    }

    async fn execute(&self, planned: Planned, intended: Instant) {
        let mut client = self.pool.lock_client();
        // Counted from the intended send time, like the latency: a call that starts late gets
        // less time, so no reply ever counts as a success after more than --request-timeout.
        let deadline = intended + self.request_timeout;
        let limit = self.request_timeout;
        let rec = self.recorder(intended);
        match planned {
            Planned::Acquire(r) => {
                let seq = self.seq.fetch_add(1, Ordering::Relaxed);
                let req = AcquireRequest {
                    resource: self.name(r),
                    request_id: format!("bench-{:016x}-{seq}", self.run_id),
                    lease_ttl_ms: self.ttl.as_millis() as u64,
                    wait_timeout_ms: 0,
                    holder: "lockd-bench".into(),
                };
                let res = call(deadline, limit, client.acquire(req)).await;
                let latency = intended.elapsed();
                self.table.lock().expect("table lock").acquiring -= 1;
                match res {
                    Ok(reply) => {
                        rec.ok("acquire", latency);
                        self.note_ok("acquire", intended, latency);
                        self.table
                            .lock()
                            .expect("table lock")
                            .hold(r, reply.lease_id.into());
                    }
                    Err(e) => {
                        rec.error("acquire", e.code, &e.message);
                        // Even ABORTED: someone holds it, so it is not free for a while.
                        self.quarantine(r);
                    }
                }
            }
            Planned::Renew(r, lease_id) => {
                let req = RenewRequest {
                    resource: self.name(r),
                    lease_id: lease_id.to_string(),
                    lease_ttl_ms: 0,
                };
                let res = call(deadline, limit, client.renew(req)).await;
                let latency = intended.elapsed();
                match res {
                    Ok(_) => {
                        rec.ok("renew", latency);
                        self.note_ok("renew", intended, latency);
                        self.table.lock().expect("table lock").hold(r, lease_id);
                    }
                    Err(e) => {
                        rec.error("renew", e.code, &e.message);
                        if e.code == "NOT_FOUND" {
                            // The lease is gone (expired): nobody of ours holds the resource.
                            self.table.lock().expect("table lock").set(r, Slot::Free);
                        } else {
                            self.quarantine(r);
                        }
                    }
                }
            }
            Planned::Release(r, lease_id) => {
                let req = ReleaseRequest {
                    resource: self.name(r),
                    lease_id: lease_id.to_string(),
                };
                let res = call(deadline, limit, client.release(req)).await;
                let latency = intended.elapsed();
                match res {
                    Ok(reply) if reply.released => {
                        rec.ok("release", latency);
                        self.note_ok("release", intended, latency);
                        self.table.lock().expect("table lock").set(r, Slot::Free);
                    }
                    Ok(_) => {
                        rec.error(
                            "release",
                            NOT_RELEASED,
                            &format!(
                                "released=false for {:?}: the bench's lease was no longer current",
                                self.name(r)
                            ),
                        );
                        self.table.lock().expect("table lock").set(r, Slot::Free);
                    }
                    Err(e) => {
                        rec.error("release", e.code, &e.message);
                        self.quarantine(r);
                    }
                }
            }
        }
    }
}

/// Runs `mixed` and prints its report.
pub async fn run(cli: &Cli, args: &MixedArgs) -> anyhow::Result<()> {
    let smoke = cli.smoke;
    let rate = args.rate.unwrap_or(if smoke { 300 } else { 6_000 });
    let duration = args
        .duration
        .unwrap_or(Duration::from_secs(if smoke { 3 } else { 60 }));
    let warmup = args
        .warmup
        .unwrap_or(Duration::from_secs(if smoke { 2 } else { 10 }));
    let resources = args
        .resources
        .unwrap_or(if smoke { 2_000 } else { 100_000 });
    if rate == 0 || rate > RATE_MAX {
        anyhow::bail!("--rate {rate} must be between 1 and {RATE_MAX} ops/s");
    }
    if duration.is_zero() {
        anyhow::bail!("--duration {duration:?} must be positive");
    }
    if resources < 2 {
        anyhow::bail!("--resources {resources} must be at least 2");
    }
    if let Some(interval) = args.interval {
        if interval < INTERVAL_MIN {
            anyhow::bail!(
                "--interval {interval:?} must be at least {INTERVAL_MIN:?}: shorter intervals hold \
                 too few acquires for a p99"
            );
        }
        if interval > duration {
            anyhow::bail!(
                "--interval {interval:?} must not be longer than --duration {duration:?}"
            );
        }
    }
    let renew_rate = rate as f64 / 3.0;
    let held_target = match args.held {
        Some(h) => h,
        None => ((renew_rate * args.renew_every.as_secs_f64()).round() as u32)
            .clamp(1, HELD_DEFAULT_MAX),
    };
    if held_target > resources / 2 {
        anyhow::bail!(
            "--held {held_target} needs at most half of --resources {resources} so that acquires \
             find free resources (the default --held is rate/3 x --renew-every {:?}; pass \
             --held or --resources)",
            args.renew_every
        );
    }
    if args.status_callers > STATUS_CALLERS_MAX {
        anyhow::bail!(
            "--status-callers {} must be at most {STATUS_CALLERS_MAX}",
            args.status_callers
        );
    }
    let ttl_ms = args.ttl.as_millis();
    if !(1_000..=300_000).contains(&ttl_ms) {
        anyhow::bail!("--ttl {:?} must be between 1s and 300s", args.ttl);
    }
    let renew_period = held_target as f64 / renew_rate;
    if renew_period >= args.ttl.as_secs_f64() * 0.9 {
        anyhow::bail!(
            "with --held {held_target} and {renew_rate:.0} renews/s each lease is renewed every \
             {renew_period:.1}s, too close to --ttl {:?}: leases would expire",
            args.ttl
        );
    }

    // The warmup must at least fill the table at the target rate, with a second to spare.
    let fill = Duration::from_secs_f64(held_target as f64 / rate as f64 + 1.0);
    let warmup = warmup.max(fill);

    let pool = Pool::connect(&cli.endpoints, cli.connections, cli.target, cli.tls()?).await?;
    let leader = pool.leader_endpoint().unwrap_or("unknown").to_owned();
    eprintln!(
        "lockd-bench mixed: {rate} ops/s for {duration:?} after {warmup:?} warmup, {resources} \
         resources, {held_target} held (renewed every {renew_period:.1}s), ttl {:?}, leader {leader}",
        args.ttl
    );

    let start = Instant::now() + Duration::from_millis(50);
    let measure_start = start + warmup;
    let end = measure_start + duration;
    let status_load = StatusLoad::start(
        &pool,
        args.status_callers,
        measure_start,
        end,
        cli.request_timeout,
    )?;
    let ctx = Arc::new(Ctx {
        pool,
        table: Mutex::new(Table::new(resources)),
        prefix: args.prefix.clone(),
        ttl: args.ttl,
        request_timeout: cli.request_timeout,
        run_id: rand::rng().random(),
        seq: AtomicU64::new(0),
        measure_start,
        worst_by_second: (0..duration.as_secs().max(1) + 1)
            .map(|_| AtomicU64::new(0))
            .collect(),
        intervals: Intervals::new(measure_start, duration, args.interval),
        measured: Recorder::new(&OPS),
        warmup: Recorder::new(&OPS),
        sent: AtomicU64::new(0),
        in_flight: AtomicUsize::new(0),
    });

    let progress = {
        let ctx = ctx.clone();
        Progress::start(warmup + duration, cli.no_progress, move || {
            let phase = if Instant::now() < ctx.measure_start {
                "warmup"
            } else {
                "measure"
            };
            let (ok, err) = ctx.measured.totals();
            let held = ctx.table.lock().expect("table lock").held.len();
            format!(
                "{phase} sent {} ok {ok} err {err} in-flight {} held {held}",
                ctx.sent.load(Ordering::Relaxed),
                ctx.in_flight.load(Ordering::Relaxed)
            )
        })
    };

    // Each interval's line as soon as its last call has finished, so that a long run shows a bad
    // minute while it runs.
    let interval_lines = args.interval.map(|_| {
        let ctx = ctx.clone();
        let lines = progress.lines();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(interval::POLL).await;
                for (i, row) in ctx.intervals.take_complete() {
                    lines.print(&row.line(i, ctx.intervals.count()));
                }
            }
        })
    });

    // The dispatcher: one intended time per call, fixed by the schedule alone.
    let slots = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let period_ns = 1e9 / rate as f64;
    let mut dispatch_lag =
        Histogram::<u64>::new_with_bounds(1, 600_000_000, 3).expect("static histogram bounds");
    let mut measured_sent = 0u64;
    let mut i: u64 = 0;
    loop {
        let intended = start + Duration::from_nanos((i as f64 * period_ns) as u64);
        ctx.intervals.dispatched_until(intended);
        if intended >= end {
            break;
        }
        if intended > Instant::now() {
            tokio::time::sleep_until(intended.into()).await;
        }
        let permit = slots
            .clone()
            .acquire_owned()
            .await
            .expect("semaphore never closed");
        let now = Instant::now();
        dispatch_lag
            .record(
                (now.saturating_duration_since(intended).as_micros() as u64).clamp(1, 600_000_000),
            )
            .expect("value clamped into range");
        let measured = intended >= measure_start;
        let rec = ctx.recorder(intended);
        let planned = {
            let mut table = ctx.table.lock().expect("table lock");
            let filling = !measured && (table.held.len() as u32 + table.acquiring) < held_target;
            let op = if filling { 0 } else { i % 3 };
            match op {
                0 => table.pick_acquire(now).map(Planned::Acquire),
                1 => table.pick_renew().map(|(r, l)| Planned::Renew(r, l)),
                _ => table.pick_release().map(|(r, l)| Planned::Release(r, l)),
            }
            .ok_or(OPS[op as usize])
        };
        i += 1;
        match planned {
            Ok(planned) => {
                ctx.sent.fetch_add(1, Ordering::Relaxed);
                measured_sent += u64::from(measured);
                ctx.in_flight.fetch_add(1, Ordering::Relaxed);
                ctx.intervals.sent(intended);
                let ctx = ctx.clone();
                tokio::spawn(async move {
                    ctx.execute(planned, intended).await;
                    ctx.intervals.finished(intended);
                    ctx.in_flight.fetch_sub(1, Ordering::Relaxed);
                    drop(permit);
                });
            }
            Err(op) => rec.skipped(op),
        }
    }
    ctx.intervals.dispatched_all();
    // Let the last calls finish; they each give up after --request-timeout.
    let _ = tokio::time::timeout(
        cli.request_timeout + Duration::from_secs(2),
        slots.acquire_many(MAX_IN_FLIGHT as u32),
    )
    .await;
    if let Some(task) = interval_lines {
        task.abort();
        // Stopped before the rest is printed, so that no line comes twice or out of order.
        let _ = task.await;
    }
    progress.finish();
    // Intervals whose calls outlived the drain: what they have, the unfinished calls apart.
    for (i, row) in ctx.intervals.take_rest() {
        eprintln!("{}", row.line(i, ctx.intervals.count()));
    }

    let report = ctx.measured.report(duration);
    let warm = ctx.warmup.report(warmup);
    // Calls sent in the measured window that neither answered nor failed by the end of the drain.
    let unfinished = measured_sent.saturating_sub(report.ok_total() + report.error_total());
    let held_at_end = ctx.table.lock().expect("table lock").held.len();
    let achieved = report.ok_rate();
    eprintln!(
        "warmup: {} ok, {} errors; measured: sent {measured_sent} in {duration:?}, \
         achieved {achieved:.0} ok/s of {rate} target ({:.1}%), unfinished {unfinished}, \
         held at end {held_at_end}, dispatch lag p99 {} max {}",
        warm.ok_total(),
        warm.error_total(),
        100.0 * achieved / rate as f64,
        fmt_us(dispatch_lag.value_at_quantile(0.99)),
        fmt_us(dispatch_lag.max()),
    );
    eprint!("{}", report.table());
    let rows = ctx.intervals.rows();
    let worst = interval::worst(&rows, report.p99_us("acquire"));
    if args.interval.is_some() {
        match &worst {
            Some(w) => eprintln!("{}", w.line(&rows)),
            None => eprintln!("worst interval acquire p99: none (no acquire succeeded)"),
        }
    }
    let status_callers = status_load.callers();
    let status = status_load.finish(duration).await;
    let status_rate = status.ok_rate();
    if status_callers > 0 {
        eprintln!(
            "status callers: {status_callers}, {} calls ({status_rate:.0}/s), {} errors",
            status.ok_total(),
            status.error_total()
        );
        eprint!("{}", status.table());
    }
    let worst_by_second: Vec<f64> = ctx
        .worst_by_second
        .iter()
        .take(duration.as_secs() as usize)
        .map(|w| w.load(Ordering::Relaxed) as f64 / 1000.0)
        .collect();
    let mut line = json!({
        "bench": "mixed",
        "target_rate": rate,
        "duration_s": duration.as_secs_f64(),
        "warmup_s": warmup.as_secs_f64(),
        "resources": resources,
        "held_target": held_target,
        "held_at_end": held_at_end,
        "ttl_ms": ttl_ms as u64,
        "connections": cli.connections,
        "leader": leader,
        "sent": measured_sent,
        "ok": report.ok_total(),
        "errors": report.error_total(),
        "unfinished": unfinished,
        "achieved_rate": (achieved * 10.0).round() / 10.0,
        "achieved_ratio": (achieved / rate as f64 * 10_000.0).round() / 10_000.0,
        "dispatch_lag_p99_ms": dispatch_lag.value_at_quantile(0.99) as f64 / 1000.0,
        "dispatch_lag_max_ms": dispatch_lag.max() as f64 / 1000.0,
        "warmup_errors": warm.error_total(),
        "ops": report.ops_json(),
        "worst_ms_by_second": worst_by_second,
        "interval_s": args.interval.map(|d| d.as_secs_f64()),
        "intervals": rows.iter().map(interval::Row::json).collect::<Vec<_>>(),
        "worst_interval_p99_ratio": worst.map(|w| (w.ratio * 1000.0).round() / 1000.0),
        "status_callers": status_callers,
        "status_calls_per_s": (status_rate * 10.0).round() / 10.0,
        "status": status.ops_json()[STATUS_OP],
    });

    // Every call of the run, warmup and cleanup included, for per-operation costs measured on
    // the nodes over the whole run (lockd/bench/scripts/callgrind-per-op.sh).
    let cleanup_calls = if args.keep_held {
        0
    } else {
        cleanup(&ctx).await
    };
    line["warmup_ok"] = json!(warm.ok_total());
    line["cleanup_calls"] = json!(cleanup_calls);
    line["calls_total"] = json!(
        warm.ok_total()
            + warm.error_total()
            + report.ok_total()
            + report.error_total()
            + unfinished
            + cleanup_calls
    );
    println!("{line}");
    Ok(())
}

/// Releases every idle lease (unmeasured), so that the next run starts from free resources.
/// Returns the number of release calls made.
async fn cleanup(ctx: &Arc<Ctx>) -> u64 {
    let leases: Vec<(u32, Arc<str>)> = {
        let mut table = ctx.table.lock().expect("table lock");
        let held = table.held.clone();
        held.into_iter().map(|r| (r, table.take(r))).collect()
    };
    let total = leases.len();
    let gate = Arc::new(Semaphore::new(CLEANUP_CONCURRENCY));
    let failed = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for (r, lease_id) in leases {
        let permit = gate.clone().acquire_owned().await.expect("never closed");
        let ctx = ctx.clone();
        let failed = failed.clone();
        tasks.spawn(async move {
            let req = ReleaseRequest {
                resource: ctx.name(r),
                lease_id: lease_id.to_string(),
            };
            let mut client = ctx.pool.lock_client();
            let deadline = Instant::now() + ctx.request_timeout;
            if call(deadline, ctx.request_timeout, client.release(req))
                .await
                .is_err()
            {
                failed.fetch_add(1, Ordering::Relaxed);
            }
            drop(permit);
        });
    }
    while tasks.join_next().await.is_some() {}
    let failed = failed.load(Ordering::Relaxed);
    eprintln!(
        "cleanup: released {} of {total} held leases{}",
        total as u64 - failed,
        if failed > 0 {
            " (the rest expire after their ttl)"
        } else {
            ""
        }
    );
    total as u64
}
