//! `handoff`: a few contended resources, each with several clients that queue for it
//! (`wait_timeout_ms` > 0), take it, hold it for `--hold` and release it, over and over.
//!
//! The figure is the handoff latency: from the instant the holder sends `Release` to the instant
//! the next waiter receives its `Acquire` reply. Both instants are read on this process's
//! monotonic clock. A grant counts as a handoff only when that waiter's `Acquire` was sent before
//! the `Release`, i.e. it really was queued; the first grant of each resource does not count.
//! The `acquire` row is the whole wait in the queue, which grows with the number of waiters.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lockd_api::v1::{AcquireRequest, ReleaseRequest};
use rand::RngExt;
use serde_json::json;

use crate::call::call;
use crate::cli::{Cli, HandoffArgs};
use crate::pool::Pool;
use crate::progress::Progress;
use crate::stats::{NOT_RELEASED, Recorder};

const OPS: [&str; 3] = ["handoff", "acquire", "release"];
/// Pause of a client after a failed call, so that a down cluster is not hammered in a hot loop.
const ERROR_BACKOFF: Duration = Duration::from_millis(20);

pub async fn run(cli: &Cli, args: &HandoffArgs) -> anyhow::Result<()> {
    let smoke = cli.smoke;
    let resources = args.resources.unwrap_or(if smoke { 4 } else { 32 });
    let waiters = args.waiters.unwrap_or(if smoke { 3 } else { 4 });
    let duration = args
        .duration
        .unwrap_or(Duration::from_secs(if smoke { 2 } else { 30 }));
    let warmup = args
        .warmup
        .unwrap_or(Duration::from_secs(if smoke { 1 } else { 3 }));
    if resources == 0 {
        anyhow::bail!("--resources 0 must be at least 1");
    }
    if waiters < 2 {
        anyhow::bail!("--waiters {waiters} must be at least 2: one holder and one waiter");
    }
    if args.wait.is_zero() {
        anyhow::bail!(
            "--wait {:?} must be positive: handoff needs waiters",
            args.wait
        );
    }
    if duration.is_zero() {
        anyhow::bail!("--duration {duration:?} must be positive");
    }
    let pool = Pool::connect(&cli.endpoints, cli.connections, cli.target, cli.tls()?).await?;
    let leader = pool.leader_endpoint().unwrap_or("unknown").to_owned();
    eprintln!(
        "lockd-bench handoff: {resources} resources x {waiters} clients, hold {:?}, wait {:?}, \
         {duration:?} after {warmup:?} warmup, leader {leader}",
        args.hold, args.wait
    );

    let start = Instant::now();
    let measure_start = start + warmup;
    let end = measure_start + duration;
    let measured = Arc::new(Recorder::new(&OPS));
    let grants = Arc::new(AtomicU64::new(0));
    let run_id: u64 = rand::rng().random();
    // Per resource: when its current holder sent its Release, taken by the next grant.
    let release_sent: Arc<Vec<Mutex<Option<Instant>>>> =
        Arc::new((0..resources).map(|_| Mutex::new(None)).collect());

    let progress = {
        let measured = measured.clone();
        let grants = grants.clone();
        Progress::start(warmup + duration, cli.no_progress, move || {
            let (ok, err) = measured.totals();
            format!(
                "grants {} measured ok {ok} err {err}",
                grants.load(Ordering::Relaxed)
            )
        })
    };

    let mut tasks = tokio::task::JoinSet::new();
    for r in 0..resources {
        for c in 0..waiters {
            let pool = pool.clone();
            let measured = measured.clone();
            let grants = grants.clone();
            let release_sent = release_sent.clone();
            let resource = format!("{}/{r}", args.prefix);
            let (hold, wait) = (args.hold, args.wait);
            let timeout = cli.request_timeout + wait;
            tasks.spawn(async move {
                let mut k = 0u64;
                while Instant::now() < end {
                    k += 1;
                    let sent = Instant::now();
                    let req = AcquireRequest {
                        resource: resource.clone(),
                        request_id: format!("handoff-{run_id:016x}-{r}-{c}-{k}"),
                        lease_ttl_ms: 30_000,
                        wait_timeout_ms: wait.as_millis() as u64,
                        holder: format!("lockd-bench/{c}"),
                    };
                    let reply = call(
                        Instant::now() + timeout,
                        timeout,
                        pool.lock_client().acquire(req),
                    )
                    .await;
                    let granted = Instant::now();
                    let lease = match reply {
                        Ok(reply) => reply.lease_id,
                        Err(e) => {
                            if sent >= measure_start {
                                measured.error("acquire", e.code, &e.message);
                            }
                            tokio::time::sleep(ERROR_BACKOFF).await;
                            continue;
                        }
                    };
                    grants.fetch_add(1, Ordering::Relaxed);
                    let released_at = release_sent[r as usize].lock().expect("lock").take();
                    if sent >= measure_start {
                        measured.ok("acquire", granted - sent);
                    }
                    if let Some(t) = released_at
                        && t >= sent
                        && t >= measure_start
                    {
                        measured.ok("handoff", granted - t);
                    }
                    if !hold.is_zero() {
                        tokio::time::sleep(hold).await;
                    }
                    let sent = Instant::now();
                    *release_sent[r as usize].lock().expect("lock") = Some(sent);
                    let req = ReleaseRequest {
                        resource: resource.clone(),
                        lease_id: lease,
                    };
                    let reply = call(
                        Instant::now() + timeout,
                        timeout,
                        pool.lock_client().release(req),
                    )
                    .await;
                    if sent < measure_start {
                        continue;
                    }
                    match reply {
                        Ok(reply) if reply.released => measured.ok("release", sent.elapsed()),
                        Ok(_) => measured.error(
                            "release",
                            NOT_RELEASED,
                            &format!("released=false for {resource:?}"),
                        ),
                        Err(e) => measured.error("release", e.code, &e.message),
                    }
                }
            });
        }
    }
    while tasks.join_next().await.is_some() {}
    progress.finish();

    let report = measured.report(duration);
    let handoffs = report
        .ops
        .iter()
        .find(|(name, _)| *name == "handoff")
        .map_or(0, |(_, o)| o.ok);
    let per_s = handoffs as f64 / duration.as_secs_f64();
    eprintln!("handoff: {handoffs} handoffs measured ({per_s:.0}/s)");
    eprint!("{}", report.table());
    let line = json!({
        "bench": "handoff",
        "resources": resources,
        "waiters": waiters,
        "hold_ms": args.hold.as_millis() as u64,
        "duration_s": duration.as_secs_f64(),
        "warmup_s": warmup.as_secs_f64(),
        "connections": cli.connections,
        "leader": leader,
        "handoffs": handoffs,
        "handoffs_per_s": (per_s * 10.0).round() / 10.0,
        "errors": report.error_total(),
        "ops": report.ops_json(),
    });
    println!("{line}");
    Ok(())
}
