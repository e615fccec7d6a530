//! `lockd-fill`: fills a lockd cluster with held resources, each acquired once with its own
//! request id (so the table also holds as many request-id records), for the backup, restore and
//! node replacement figures of docs/operations.md. With `--request-ids N` above the number of
//! resources, the acquires past the first round go to held resources again with fresh ids and
//! are refused (`LOCK_HELD`), each leaving a request-id record too: a full 10-minute window at
//! 2,000 acquires/s is `--request-ids 1200000`. Calls go to the leader (found with
//! `Cluster.Status`), many at once. Prints one JSON line: resources, request ids, refused,
//! seconds, acquires/s, last fencing token.
//!
//! ```sh
//! lockd-fill --endpoints 127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003 --resources 100000
//! ```
//!
//! Flags: `--endpoints LIST`, `--resources N` (100000), `--prefix P` (`fill`; names are
//! `P/N`), `--request-ids N` (as many as resources), `--ttl-ms MS` (300000, the longest
//! lease), `--concurrency C` (128).
//! Exits 0 when every resource is held, 1 otherwise, 2 on bad flags.

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lockd_api::v1::cluster_client::ClusterClient;
use lockd_api::v1::lock_client::LockClient;
use lockd_api::v1::{AcquireRequest, StatusRequest};
use tonic::transport::Channel;

struct Args {
    endpoints: Vec<String>,
    resources: u64,
    request_ids: Option<u64>,
    prefix: String,
    ttl_ms: u64,
    concurrency: u64,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        endpoints: vec!["127.0.0.1:7001".into()],
        resources: 100_000,
        request_ids: None,
        prefix: "fill".into(),
        ttl_ms: 300_000,
        concurrency: 128,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        let number = |v: String, f: &str| v.parse::<u64>().map_err(|e| format!("{f} {v:?}: {e}"));
        match flag.as_str() {
            "--endpoints" => a.endpoints = value()?.split(',').map(str::to_owned).collect(),
            "--resources" => a.resources = number(value()?, "--resources")?,
            "--request-ids" => a.request_ids = Some(number(value()?, "--request-ids")?),
            "--prefix" => a.prefix = value()?,
            "--ttl-ms" => a.ttl_ms = number(value()?, "--ttl-ms")?,
            "--concurrency" => a.concurrency = number(value()?, "--concurrency")?.max(1),
            other => {
                return Err(format!(
                    "unknown flag {other:?} (see the source's doc comment)"
                ));
            }
        }
    }
    if a.resources == 0 {
        return Err("--resources must be at least 1".into());
    }
    if let Some(ids) = a.request_ids
        && ids < a.resources
    {
        return Err(format!(
            "--request-ids {ids} is below --resources {}: every resource takes one",
            a.resources
        ));
    }
    Ok(a)
}

fn channel(addr: &str) -> Result<Channel, String> {
    Ok(Channel::from_shared(format!("http://{addr}"))
        .map_err(|e| format!("endpoint {addr:?}: {e}"))?
        .connect_timeout(Duration::from_secs(2))
        .connect_lazy())
}

/// The leader's address, as the first endpoint that answers sees it.
async fn leader(endpoints: &[String]) -> Result<String, String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        for e in endpoints {
            let mut c = ClusterClient::new(channel(e)?);
            if let Ok(s) = c.status(StatusRequest {}).await {
                let s = s.into_inner();
                if let Some(m) = s.members.iter().find(|m| m.id == s.leader_id) {
                    return Ok(m.address.clone());
                }
            }
        }
        if Instant::now() > deadline {
            return Err(format!("no leader known to {endpoints:?} within 30 s"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn fill(a: Args) -> Result<bool, String> {
    let leader = leader(&a.endpoints).await?;
    let client = LockClient::new(channel(&leader)?);
    let next = Arc::new(AtomicU64::new(0));
    let last_token = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let refused = Arc::new(AtomicU64::new(0));
    let total = a.request_ids.unwrap_or(a.resources);
    let started = Instant::now();
    let workers: Vec<_> = (0..a.concurrency)
        .map(|_| {
            let (mut client, next, last_token, failed, refused) = (
                client.clone(),
                next.clone(),
                last_token.clone(),
                failed.clone(),
                refused.clone(),
            );
            let (n, resources, prefix, ttl_ms) = (total, a.resources, a.prefix.clone(), a.ttl_ms);
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        return;
                    }
                    let request = AcquireRequest {
                        resource: format!("{prefix}/{}", i % resources),
                        request_id: format!("{prefix}-{i}"),
                        lease_ttl_ms: ttl_ms,
                        wait_timeout_ms: 0,
                        holder: "lockd-fill".into(),
                    };
                    // UNAVAILABLE is retried with the same request id; anything else counts.
                    let mut tries = 0;
                    loop {
                        tries += 1;
                        match client.acquire(request.clone()).await {
                            Ok(r) => {
                                last_token
                                    .fetch_max(r.into_inner().fencing_token, Ordering::Relaxed);
                                break;
                            }
                            // Past the first round every resource is held: the refusal is
                            // what was asked for (it keeps a request-id record).
                            Err(s) if i >= resources && s.code() == tonic::Code::Aborted => {
                                refused.fetch_add(1, Ordering::Relaxed);
                                break;
                            }
                            Err(s) if s.code() == tonic::Code::Unavailable && tries < 20 => {
                                tokio::time::sleep(Duration::from_millis(100)).await;
                            }
                            Err(s) => {
                                eprintln!("lockd-fill: {}: {}", request.resource, s.message());
                                failed.fetch_add(1, Ordering::Relaxed);
                                break;
                            }
                        }
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.await.map_err(|e| e.to_string())?;
    }
    let secs = started.elapsed().as_secs_f64();
    let failed = failed.load(Ordering::Relaxed);
    println!(
        "{{\"resources\":{},\"request_ids\":{total},\"refused\":{},\"failed\":{failed},\"seconds\":{secs:.1},\"acquires_per_s\":{:.0},\"last_fencing_token\":{}}}",
        a.resources,
        refused.load(Ordering::Relaxed),
        total as f64 / secs,
        last_token.load(Ordering::Relaxed)
    );
    Ok(failed == 0)
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("lockd-fill: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("lockd-fill: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(fill(args)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("lockd-fill: {e}");
            ExitCode::from(1)
        }
    }
}
