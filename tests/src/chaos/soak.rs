//! Many seeded chaos runs ("hundreds of histories", `chaos --runs N --jobs J`): run `i` has seed
//! `base + i`; at most `jobs` go on at once, each on a thread with a Tokio runtime of its own
//! (made for the run and shut down after it, so nothing of one run outlives it), each bounded in
//! time. Every finished run appends one JSON line to the summary file, which accumulates across
//! invocations; [`Totals`] adds them up. The artifacts of a run that violated an invariant or hit
//! a harness error are kept; those of a passing run are deleted.
//!
//! It does not choose seeds cleverly or rerun failures: a failing seed's line has the command
//! that reruns it.
//!
//! Runs going on at once do not collide: each cluster reserves its own `127.A.B` network in this
//! process (every listening address of a run is on it, `cluster.rs`), has its own artifacts
//! folder (node data dirs, audit logs, the HTTP proxy's epoch store), its own Postgres table and
//! resource names (random), and its Postgres proxy listens on its own network too.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::run::{RunConfig, RunReport, artifacts_dir, run_in};

/// Time a run may take beyond its fault duration before it is abandoned as a harness error:
/// start-up (up to 30 s for a leader), workers stopping (20 s), the liveness probe (19.5 s),
/// convergence (20 s), collection and checking, with room for a loaded machine.
pub const RUN_OVERHEAD_MAX: Duration = Duration::from_secs(300);
/// How long a finished run's runtime may take to shut down its leftover tasks.
const RUNTIME_SHUTDOWN_WAIT: Duration = Duration::from_secs(10);
/// Worker threads of each run's runtime (the runs share a 2-core machine with their nodes).
const RUNTIME_THREADS: usize = 2;

/// What `chaos --runs` was asked for.
#[derive(Clone, Debug)]
pub struct SoakConfig {
    /// The configuration of every run; its seed is the base seed.
    pub run: RunConfig,
    pub runs: u64,
    pub jobs: usize,
    /// Every `k`-th run (the 2nd, 4th, ... for 2) uses TLS; `None`: as `run.tls` says.
    pub tls_every: Option<u64>,
    /// The summary file lines are appended to.
    pub summary: Option<PathBuf>,
    /// Where runs make their artifacts folders (the system's temporary folder when `None`).
    pub artifacts: Option<PathBuf>,
    /// Free text stored in every line (a commit, a machine, a build profile).
    pub label: Option<String>,
}

impl SoakConfig {
    /// The configuration of run `i` (0-based).
    pub fn config_for(&self, i: u64) -> RunConfig {
        let mut c = self.run.clone();
        c.seed = self.run.seed.wrapping_add(i);
        if let Some(k) = self.tls_every {
            c.tls = self.run.tls || (i + 1).is_multiple_of(k);
        }
        c
    }
}

/// One line of the summary file: one run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RunRecord {
    pub seed: u64,
    pub duration_s: u64,
    pub tls: bool,
    pub postgres: bool,
    pub workers: usize,
    pub resources: usize,
    /// `correct`, or the `--broken` mode (`bypass-fence`, `stale-describe`, ...).
    pub mode: String,
    /// `--clock` or `--clock-rate` when the run had clock faults.
    pub clock: Option<String>,
    /// The nodes ran in network namespaces (`--netns`).
    pub netns: bool,
    /// Faults injected, per kind (`ClockOffset`: runtime wall-clock offset changes; `ClockRate`:
    /// node starts with a drawn clock rate).
    pub faults: BTreeMap<String, u64>,
    /// Windows in which no quorum could exist, and their total length.
    pub no_quorum_windows: u64,
    pub no_quorum_ms: u64,
    /// The longest stretch without a definite answer while a quorum could exist.
    pub longest_gap_ms: u64,
    pub ops: u64,
    pub grants: u64,
    pub describes: u64,
    pub writes_acknowledged: u64,
    /// Fenced writes the proxies refused (stale or missing tokens).
    pub stale_writes_rejected: u64,
    pub unknown_outcomes: u64,
    pub violations: u64,
    /// Violations per check.
    pub violation_checks: BTreeMap<String, u64>,
    /// Operations the linearizability check ordered, resources it could not decide within its
    /// budget, and how long it took.
    pub lin_ops: u64,
    pub lin_inconclusive: u64,
    pub lin_check_ms: u64,
    /// `pass`, `fail` (violations) or `error` (the harness failed; not a verdict on lockd).
    pub verdict: String,
    pub error: Option<String>,
    pub elapsed_s: f64,
    pub finished_unix_s: u64,
    pub rerun: String,
    /// Kept for failing and erroring runs.
    pub artifacts: Option<String>,
    pub label: Option<String>,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn base_record(c: &RunConfig, label: &Option<String>) -> RunRecord {
    RunRecord {
        seed: c.seed,
        duration_s: c.duration.as_secs(),
        tls: c.tls,
        postgres: c.postgres,
        workers: c.workers,
        resources: c.resources,
        mode: c.mode.broken_name().unwrap_or("correct").into(),
        clock: c.clock.map(|m| m.flag().to_owned()),
        netns: c.netns,
        rerun: c.rerun_command(),
        label: label.clone(),
        finished_unix_s: unix_now(),
        ..RunRecord::default()
    }
}

impl RunRecord {
    pub fn from_report(r: &RunReport, label: &Option<String>) -> RunRecord {
        let mut rec = base_record(&r.config, label);
        for f in &r.faults {
            *rec.faults.entry(format!("{f:?}")).or_insert(0) += 1;
        }
        for (kind, n) in [("ClockOffset", r.clock_steps), ("ClockRate", r.clock_rates)] {
            if n > 0 {
                rec.faults.insert(kind.to_owned(), n);
            }
        }
        rec.no_quorum_windows = r.no_quorum.len() as u64;
        rec.no_quorum_ms = r.no_quorum.iter().map(|(s, e)| e - s).sum();
        rec.longest_gap_ms = r.longest_gap.len_ms;
        for v in &r.violations {
            *rec.violation_checks.entry(v.check.to_owned()).or_insert(0) += 1;
        }
        rec.ops = r.ops as u64;
        rec.grants = r.grants as u64;
        rec.describes = r.describes as u64;
        rec.writes_acknowledged = r.writes_ok as u64;
        rec.stale_writes_rejected = r.writes_refused as u64;
        rec.unknown_outcomes = r.unknown as u64;
        rec.violations = r.violations.len() as u64;
        rec.lin_ops = r.lin.operations() as u64;
        rec.lin_inconclusive = r.lin.inconclusive() as u64;
        rec.lin_check_ms = r.lin.elapsed.as_millis() as u64;
        rec.verdict = if r.violations.is_empty() {
            "pass"
        } else {
            "fail"
        }
        .into();
        rec.elapsed_s = r.elapsed.as_secs_f64();
        rec.artifacts = Some(r.artifacts.display().to_string());
        rec
    }
}

/// Totals over summary lines.
#[derive(Clone, Debug, Default)]
pub struct Totals {
    pub runs: u64,
    pub passed: u64,
    pub failed: u64,
    pub errors: u64,
    pub tls_runs: u64,
    pub fault_seconds: u64,
    pub faults: BTreeMap<String, u64>,
    pub ops: u64,
    pub grants: u64,
    pub describes: u64,
    pub writes_acknowledged: u64,
    pub stale_writes_rejected: u64,
    pub unknown_outcomes: u64,
    pub violations: u64,
    pub violation_checks: BTreeMap<String, u64>,
    pub lin_ops: u64,
    pub lin_inconclusive: u64,
    pub lin_check_ms: u64,
    /// The longest linearizability check of one run, in ms.
    pub lin_check_ms_max: u64,
    /// Runs with clock faults; no-quorum windows and their time; the longest silence with a
    /// quorum possible in any run.
    pub clock_runs: u64,
    /// Runs with the nodes in network namespaces.
    pub netns_runs: u64,
    pub no_quorum_windows: u64,
    pub no_quorum_ms: u64,
    pub longest_gap_ms_max: u64,
    /// Failing and erroring runs: (seed, verdict, rerun command, artifacts).
    pub not_passed: Vec<(u64, String, String, Option<String>)>,
    /// Summary lines that did not parse.
    pub bad_lines: u64,
    /// SIGINT or SIGTERM stopped the invocation before every run was made.
    pub interrupted: bool,
}

impl Totals {
    pub fn add(&mut self, r: &RunRecord) {
        self.runs += 1;
        match r.verdict.as_str() {
            "pass" => self.passed += 1,
            "fail" => self.failed += 1,
            _ => self.errors += 1,
        }
        if r.verdict != "pass" {
            self.not_passed.push((
                r.seed,
                r.verdict.clone(),
                r.rerun.clone(),
                r.artifacts.clone(),
            ));
        }
        if r.verdict == "error" {
            // A run that did not finish has no counts worth adding.
            return;
        }
        self.tls_runs += r.tls as u64;
        self.fault_seconds += r.duration_s;
        for (k, n) in &r.faults {
            *self.faults.entry(k.clone()).or_insert(0) += n;
        }
        for (k, n) in &r.violation_checks {
            *self.violation_checks.entry(k.clone()).or_insert(0) += n;
        }
        self.ops += r.ops;
        self.grants += r.grants;
        self.describes += r.describes;
        self.writes_acknowledged += r.writes_acknowledged;
        self.stale_writes_rejected += r.stale_writes_rejected;
        self.unknown_outcomes += r.unknown_outcomes;
        self.violations += r.violations;
        self.lin_ops += r.lin_ops;
        self.lin_inconclusive += r.lin_inconclusive;
        self.lin_check_ms += r.lin_check_ms;
        self.lin_check_ms_max = self.lin_check_ms_max.max(r.lin_check_ms);
        self.clock_runs += r.clock.is_some() as u64;
        self.netns_runs += r.netns as u64;
        self.no_quorum_windows += r.no_quorum_windows;
        self.no_quorum_ms += r.no_quorum_ms;
        self.longest_gap_ms_max = self.longest_gap_ms_max.max(r.longest_gap_ms);
    }

    pub fn render(&self) -> String {
        let finished = self.passed + self.failed;
        let mut s = format!(
            "{} runs: {} passed, {} with violations, {} harness errors ({} with TLS); {} s of faults\n",
            self.runs, self.passed, self.failed, self.errors, self.tls_runs, self.fault_seconds
        );
        s.push_str(&format!("faults injected: {:?}\n", self.faults));
        s.push_str(&format!(
            "{} operations, {} grants, {} describes, {} fenced writes acknowledged, {} stale writes rejected, {} unknown outcomes\n",
            self.ops,
            self.grants,
            self.describes,
            self.writes_acknowledged,
            self.stale_writes_rejected,
            self.unknown_outcomes
        ));
        s.push_str(&format!(
            "linearizability: {} operations checked, {} resources inconclusive, {} ms checking in all ({} ms mean, {} ms max per run)\n",
            self.lin_ops,
            self.lin_inconclusive,
            self.lin_check_ms,
            self.lin_check_ms.checked_div(finished).unwrap_or(0),
            self.lin_check_ms_max
        ));
        s.push_str(&format!(
            "{} runs with clock faults, {} in network namespaces; {} no-quorum windows ({} ms in all); longest silence with a quorum possible {} ms\n",
            self.clock_runs, self.netns_runs, self.no_quorum_windows, self.no_quorum_ms, self.longest_gap_ms_max
        ));
        s.push_str(&format!(
            "{} violations {:?}\n",
            self.violations, self.violation_checks
        ));
        for (seed, verdict, rerun, artifacts) in &self.not_passed {
            s.push_str(&format!(
                "  seed {seed}: {verdict}; artifacts {}; rerun: {rerun}\n",
                artifacts.as_deref().unwrap_or("-")
            ));
        }
        if self.bad_lines > 0 {
            s.push_str(&format!("{} summary lines did not parse\n", self.bad_lines));
        }
        s
    }
}

/// The totals of every line of a summary file.
pub fn read_totals(path: &Path) -> anyhow::Result<Totals> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("reading summary {}: {e}", path.display()))?;
    let mut t = Totals::default();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        match serde_json::from_str::<RunRecord>(line) {
            Ok(r) => t.add(&r),
            Err(_) => t.bad_lines += 1,
        }
    }
    Ok(t)
}

fn append(path: &Path, r: &RunRecord) -> anyhow::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| anyhow::anyhow!("opening summary {}: {e}", path.display()))?;
    // One write per line: lines of concurrent writers never interleave.
    f.write_all(format!("{}\n", serde_json::to_string(r)?).as_bytes())?;
    Ok(())
}

/// One run, bounded; its artifacts deleted if it passed.
async fn one(
    config: RunConfig,
    parent: Option<PathBuf>,
    label: Option<String>,
    interrupted: CancellationToken,
) -> Option<(RunRecord, String)> {
    let started = Instant::now();
    let error = |dir: Option<&Path>, e: String| {
        let mut rec = base_record(&config, &label);
        rec.verdict = "error".into();
        rec.error = Some(e.clone());
        rec.elapsed_s = started.elapsed().as_secs_f64();
        rec.artifacts = dir.map(|d| d.display().to_string());
        let text = format!(
            "chaos seed {}: harness error: {e}; artifacts {}\n",
            config.seed,
            rec.artifacts.as_deref().unwrap_or("-")
        );
        Some((rec, text))
    };
    let dir = match artifacts_dir(config.seed, parent.as_deref()) {
        Ok(d) => d,
        Err(e) => return error(None, format!("{e:#}")),
    };
    let limit = config.duration + RUN_OVERHEAD_MAX;
    let result = tokio::select! {
        r = tokio::time::timeout(limit, run_in(config.clone(), dir.clone())) => r,
        _ = interrupted.cancelled() => return None,
    };
    match result {
        Ok(Ok(report)) => {
            let mut rec = RunRecord::from_report(&report, &label);
            let mut text = report.summary();
            if report.violations.is_empty() {
                if let Err(e) = std::fs::remove_dir_all(&dir) {
                    eprintln!("chaos: could not delete {}: {e}", dir.display());
                }
                rec.artifacts = None;
                text.push_str("(passed: artifacts deleted)\n");
            }
            Some((rec, text))
        }
        Ok(Err(e)) => error(Some(&dir), format!("{e:#}")),
        Err(_) => error(
            Some(&dir),
            format!("the run did not finish within {limit:?}"),
        ),
    }
}

/// Runs everything `cfg` asks for; returns the totals of these runs. SIGINT or SIGTERM stops it:
/// runs in progress are abandoned (their processes killed, nothing written for them).
pub fn run_many(cfg: &SoakConfig) -> anyhow::Result<Totals> {
    anyhow::ensure!(cfg.jobs >= 1, "--jobs must be at least 1");
    if let Some(k) = cfg.tls_every {
        anyhow::ensure!(k >= 1, "--tls-every must be at least 1");
    }
    let interrupted = CancellationToken::new();
    let finished = CancellationToken::new();
    let signals = {
        let (interrupted, finished) = (interrupted.clone(), finished.clone());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        std::thread::spawn(move || {
            rt.block_on(async {
                use tokio::signal::unix::{SignalKind, signal};
                let (Ok(mut int), Ok(mut term)) = (
                    signal(SignalKind::interrupt()),
                    signal(SignalKind::terminate()),
                ) else {
                    return;
                };
                tokio::select! {
                    _ = int.recv() => interrupted.cancel(),
                    _ = term.recv() => interrupted.cancel(),
                    _ = finished.cancelled() => {}
                }
            })
        })
    };
    let next = AtomicU64::new(0);
    let mut totals = Totals::default();
    let mut write_error = None;
    let (tx, rx) = std::sync::mpsc::channel::<(u64, RunRecord, String)>();
    std::thread::scope(|scope| {
        for _ in 0..(cfg.jobs as u64).min(cfg.runs) {
            let (tx, next, interrupted) = (tx.clone(), &next, interrupted.clone());
            scope.spawn(move || {
                loop {
                    if interrupted.is_cancelled() {
                        return;
                    }
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= cfg.runs {
                        return;
                    }
                    let config = cfg.config_for(i);
                    eprintln!(
                        "chaos: run {}/{} starts: seed {}{}",
                        i + 1,
                        cfg.runs,
                        config.seed,
                        if config.tls { " (tls)" } else { "" }
                    );
                    let rt = match tokio::runtime::Builder::new_multi_thread()
                        .worker_threads(RUNTIME_THREADS)
                        .enable_all()
                        .build()
                    {
                        Ok(rt) => rt,
                        Err(e) => {
                            eprintln!("chaos: cannot build a runtime: {e}");
                            return;
                        }
                    };
                    let done = rt.block_on(one(
                        config,
                        cfg.artifacts.clone(),
                        cfg.label.clone(),
                        interrupted.clone(),
                    ));
                    rt.shutdown_timeout(RUNTIME_SHUTDOWN_WAIT);
                    match done {
                        Some((rec, text)) => {
                            if tx.send((i, rec, text)).is_err() {
                                return;
                            }
                        }
                        None => return,
                    }
                }
            });
        }
        drop(tx);
        for (i, rec, text) in rx {
            print!("--- run {}/{}: {}", i + 1, cfg.runs, text);
            println!(
                "--- run {}/{} seed {}: {}",
                i + 1,
                cfg.runs,
                rec.seed,
                rec.verdict
            );
            if let Some(path) = &cfg.summary
                && let Err(e) = append(path, &rec)
            {
                eprintln!("chaos: {e:#}");
                if write_error.is_none() {
                    write_error = Some(e);
                }
            }
            totals.add(&rec);
        }
    });
    finished.cancel();
    let _ = signals.join();
    if interrupted.is_cancelled() {
        eprintln!("chaos: interrupted; runs in progress were abandoned and not recorded");
        totals.interrupted = true;
    }
    if let Some(e) = write_error {
        return Err(e);
    }
    Ok(totals)
}
