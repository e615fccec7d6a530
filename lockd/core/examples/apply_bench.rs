//! Applies the design load to a bare `LockTable`, one replica's apply path without Raft or RPC,
//! and prints how long batches took (the slowest batch shows stalls such as an index rehash) and
//! how much memory the table took (the process's RSS before and after, with lockd's allocator).
//!
//!   cargo run --release -p lockd-core --example apply_bench [ACQUIRES]
//!
//! Each batch is 26 commands (the batch size lockd-bench's mixed load produces at 6,000 ops/s):
//! acquires of fresh resources with fresh request_ids, and releases of the leases granted one
//! batch earlier, so the table stays small and the request_id window grows to ACQUIRES records
//! (default 1,200,000: ten minutes at 2,000 acquires/s).

use std::time::{Duration, Instant};

use lockd_core::{Batch, Command, LeaseId, LockTable, Outcome, Policy, ResourceName, Stamp};

/// lockd's allocator and settings (see lockd-server's `main.rs`), so the memory figures are a
/// replica's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The process's resident set, in MB (Linux; 0 elsewhere).
fn rss_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|kb| kb.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

fn main() {
    let acquires: u64 = std::env::args()
        .nth(1)
        .map(|a| a.parse().expect("ACQUIRES must be a number"))
        .unwrap_or(1_200_000);
    let per_batch = 13u64;
    let rss_before = rss_mb();
    let mut table = LockTable::new();
    let mut now_ms = 1_700_000_000_000i64;
    let mut to_release: Vec<(ResourceName, LeaseId)> = Vec::new();
    let mut times: Vec<Duration> = Vec::new();
    let mut slowest = (Duration::ZERO, 0u64);
    let mut events = Vec::new();
    let started = Instant::now();
    let mut n = 0u64;
    while n < acquires {
        let mut commands: Vec<Command> = to_release
            .drain(..)
            .map(|(resource, lease_id)| Command::Release { resource, lease_id })
            .collect();
        for _ in 0..per_batch {
            n += 1;
            commands.push(Command::AcquireV2 {
                resource: ResourceName::new_unchecked(format!("jobs/{}", n % 100_000)),
                request_id: format!("req-{n}"),
                lease_ttl_ms: 30_000,
                wait_timeout_ms: 0,
                holder: "bench".into(),
                lease_id: LeaseId(u128::from(n) << 64 | 0xabc),
            });
        }
        // 2,000 acquires/s: 13 acquires every 6.5 ms.
        now_ms += 6;
        let batch = Batch {
            now_ms,
            // One leader for the whole run: its monotonic clock drives the table.
            stamp: Some(Stamp {
                term: 1,
                session: 1,
                mono_ms: now_ms as u64,
                key_seed: 0x5eed,
            }),
            policy: Policy::default(),
            commands,
        };
        events.clear();
        let t = Instant::now();
        let outcomes = table.apply(1, &batch, &mut events);
        let took = t.elapsed();
        times.push(took);
        if took > slowest.0 {
            slowest = (took, n);
        }
        for (cmd, outcome) in batch.commands.iter().zip(outcomes) {
            if let (Command::AcquireV2 { resource, .. }, Outcome::Granted(g)) = (cmd, outcome) {
                to_release.push((resource.clone(), g.lease_id));
            }
        }
    }
    let total = started.elapsed();
    times.sort();
    let at = |q: f64| times[((times.len() as f64 * q) as usize).min(times.len() - 1)];
    let stats = table.stats();
    println!(
        "{} batches of {} commands, {acquires} acquires in {:.2} s ({:.0} commands/s)",
        times.len(),
        2 * per_batch,
        total.as_secs_f64(),
        (2 * acquires) as f64 / total.as_secs_f64()
    );
    println!(
        "batch apply: p50 {:?}  p99 {:?}  p999 {:?}  max {:?} (after acquire {})",
        at(0.5),
        at(0.99),
        at(0.999),
        slowest.0,
        slowest.1
    );
    println!(
        "dedup records {}, active resources {}",
        stats.dedup_records, stats.resources
    );
    let rss_after = rss_mb();
    println!(
        "RSS {rss_before:.1} MB before, {rss_after:.1} MB with the table: {:.1} MB, {:.1} bytes a dedup record",
        rss_after - rss_before,
        (rss_after - rss_before) * 1024.0 * 1024.0 / stats.dedup_records.max(1) as f64
    );
    let copy = Instant::now();
    let snapshot = table.snapshot_copy();
    let copied = copy.elapsed();
    let encode = Instant::now();
    let bytes = snapshot.encode();
    println!(
        "snapshot: copy {:?}, encode {:?}, {} bytes ({:.1} per dedup record)",
        copied,
        encode.elapsed(),
        bytes.len(),
        bytes.len() as f64 / stats.dedup_records.max(1) as f64
    );
    let decode = Instant::now();
    let loaded = LockTable::decode_snapshot(&bytes).expect("own snapshot decodes");
    println!(
        "snapshot: decode and rebuild the index {:?}",
        decode.elapsed()
    );
    assert_eq!(loaded.stats(), stats);
}
