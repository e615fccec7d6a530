//! `max`: a closed loop. Each worker has one call in flight and runs acquire/release cycles on
//! its own share of the resources, so no acquire is contended; the figure is how many calls per
//! second the cluster completes. Latency here is from send to reply (a closed loop cannot
//! measure more), so read it only together with the worker count.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lockd_api::v1::{AcquireRequest, ReleaseRequest};
use rand::RngExt;
use serde_json::json;

use crate::call::call;
use crate::cli::{Cli, MaxArgs};
use crate::pool::Pool;
use crate::progress::Progress;
use crate::stats::{NOT_RELEASED, Recorder};

const OPS: [&str; 2] = ["acquire", "release"];
/// Pause of a worker after a failed call, so that a down cluster is not hammered in a hot loop.
const ERROR_BACKOFF: Duration = Duration::from_millis(20);

pub async fn run(cli: &Cli, args: &MaxArgs) -> anyhow::Result<()> {
    let smoke = cli.smoke;
    let workers = args.workers.unwrap_or(if smoke { 8 } else { 64 });
    let duration = args
        .duration
        .unwrap_or(Duration::from_secs(if smoke { 2 } else { 30 }));
    let warmup = args
        .warmup
        .unwrap_or(Duration::from_secs(if smoke { 1 } else { 3 }));
    let resources = args
        .resources
        .unwrap_or(if smoke { 1_000 } else { 100_000 });
    if workers == 0 {
        anyhow::bail!("--workers 0 must be at least 1");
    }
    if (resources as usize) < workers {
        anyhow::bail!("--resources {resources} must be at least --workers {workers}");
    }
    if duration.is_zero() {
        anyhow::bail!("--duration {duration:?} must be positive");
    }
    let pool = Pool::connect(&cli.endpoints, cli.connections, cli.target, cli.tls()?).await?;
    let leader = pool.leader_endpoint().unwrap_or("unknown").to_owned();
    eprintln!(
        "lockd-bench max: {workers} workers for {duration:?} after {warmup:?} warmup, \
         {resources} resources, leader {leader}"
    );

    let start = Instant::now();
    let measure_start = start + warmup;
    let end = measure_start + duration;
    let measured = Arc::new(Recorder::new(&OPS));
    let cycles = Arc::new(AtomicU64::new(0));
    let run_id: u64 = rand::rng().random();
    let per_worker = resources as usize / workers;

    let progress = {
        let measured = measured.clone();
        let cycles = cycles.clone();
        Progress::start(warmup + duration, cli.no_progress, move || {
            let (ok, err) = measured.totals();
            format!(
                "cycles {} measured ok {ok} err {err}",
                cycles.load(Ordering::Relaxed)
            )
        })
    };

    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..workers {
        let pool = pool.clone();
        let measured = measured.clone();
        let cycles = cycles.clone();
        let prefix = args.prefix.clone();
        let timeout = cli.request_timeout;
        tasks.spawn(async move {
            let mut k = 0usize;
            while Instant::now() < end {
                let resource = format!("{prefix}/{}", w + workers * (k % per_worker));
                k += 1;
                let sent = Instant::now();
                let in_window = sent >= measure_start;
                let req = AcquireRequest {
                    resource: resource.clone(),
                    request_id: format!("max-{run_id:016x}-{w}-{k}"),
                    lease_ttl_ms: 30_000,
                    wait_timeout_ms: 0,
                    holder: "lockd-bench".into(),
                };
                let lease = match call(
                    Instant::now() + timeout,
                    timeout,
                    pool.lock_client().acquire(req),
                )
                .await
                {
                    Ok(reply) => {
                        if in_window {
                            measured.ok("acquire", sent.elapsed());
                        }
                        reply.lease_id
                    }
                    Err(e) => {
                        if in_window {
                            measured.error("acquire", e.code, &e.message);
                        }
                        tokio::time::sleep(ERROR_BACKOFF).await;
                        continue;
                    }
                };
                let sent = Instant::now();
                let in_window = sent >= measure_start;
                let req = ReleaseRequest {
                    resource: resource.clone(),
                    lease_id: lease,
                };
                match call(
                    Instant::now() + timeout,
                    timeout,
                    pool.lock_client().release(req),
                )
                .await
                {
                    Ok(reply) if reply.released => {
                        if in_window {
                            measured.ok("release", sent.elapsed());
                        }
                        cycles.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => {
                        if in_window {
                            measured.error(
                                "release",
                                NOT_RELEASED,
                                &format!("released=false for {resource:?}"),
                            );
                        }
                    }
                    Err(e) => {
                        if in_window {
                            measured.error("release", e.code, &e.message);
                        }
                        tokio::time::sleep(ERROR_BACKOFF).await;
                    }
                }
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    progress.finish();

    // Calls that started in the window may end after it; the window is what the rate divides by.
    let report = measured.report(duration);
    let rate = report.ok_rate();
    eprintln!(
        "max: {rate:.0} ok calls/s ({:.0} acquire/release cycles/s) with {workers} workers",
        rate / 2.0
    );
    eprint!("{}", report.table());
    let line = json!({
        "bench": "max",
        "workers": workers,
        "duration_s": duration.as_secs_f64(),
        "warmup_s": warmup.as_secs_f64(),
        "resources": resources,
        "connections": cli.connections,
        "leader": leader,
        "ok": report.ok_total(),
        "errors": report.error_total(),
        "ops_per_s": (rate * 10.0).round() / 10.0,
        "cycles_per_s": (rate / 2.0 * 10.0).round() / 10.0,
        "ops": report.ops_json(),
    });
    println!("{line}");
    Ok(())
}
