//! `diskfault`: seeded runs of lockd on a fault-injecting FUSE layer (power loss that drops every
//! unsynced write, torn writes, fsync EIO, ENOSPC). Build the binaries it starts first:
//!
//! ```sh
//! cargo build -p lockd-server -p lockd-tests --bin diskfault
//! target/debug/diskfault --seed 1 --runs 10                    # the five scenarios, twice
//! target/debug/diskfault --seed 7 --scenario two-nodes-power-loss --broken no-fsync
//! ```
//!
//! Flags: `--seed N` (default: random, printed), `--runs N` (1; run i has seed N+i), `--scenario
//! NAME|all` (all: run i takes scenario i mod 5), `--cycles N` (faults per run, 2), `--tear P`
//! (chance that a power loss tears a file's last unsynced write, 0.5), `--broken no-fsync`
//! (the disk acknowledges fsyncs without persisting: the runs must report violations),
//! `--artifacts DIR` (where runs keep their folders; those of passing runs are deleted),
//! `--summary FILE` (one JSON line per run, appended). Each run is bounded by `RUN_BOUND`.
//! Needs root (or a FUSE mount permission) and /dev/fuse.
//! Exits 0 when no run violated the property, 1 when one did, 2 on bad flags or a harness error.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use lockd_tests::diskfault::{Options, Scenario, probe, run};

const USAGE: &str = "usage: diskfault [--seed N] [--runs N] [--scenario NAME|all] [--cycles N] [--tear P] [--broken no-fsync] [--artifacts DIR] [--summary FILE]";

/// A run that takes longer than this is abandoned as a harness error (its processes and mounts
/// are dropped with it).
const RUN_BOUND: Duration = Duration::from_secs(240);

struct Args {
    seed: u64,
    runs: u64,
    scenario: Option<Scenario>,
    cycles: u32,
    tear: f64,
    broken: bool,
    artifacts: Option<PathBuf>,
    summary: Option<PathBuf>,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        seed: rand::random::<u32>() as u64,
        runs: 1,
        scenario: None,
        cycles: 2,
        tear: 0.5,
        broken: false,
        artifacts: None,
        summary: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        let num = |v: String| -> Result<u64, String> {
            v.parse()
                .map_err(|_| format!("{flag}: {v:?} is not a whole number"))
        };
        match flag.as_str() {
            "--seed" => a.seed = num(value()?)?,
            "--runs" => a.runs = num(value()?)?.max(1),
            "--cycles" => a.cycles = num(value()?)?.clamp(1, 20) as u32,
            "--scenario" => {
                let v = value()?;
                a.scenario = match v.as_str() {
                    "all" => None,
                    name => Some(Scenario::parse(name).map_err(|e| e.to_string())?),
                }
            }
            "--tear" => {
                let v = value()?;
                a.tear = v
                    .parse::<f64>()
                    .ok()
                    .filter(|p| (0.0..=1.0).contains(p))
                    .ok_or_else(|| format!("--tear: {v:?} is not a probability in [0, 1]"))?;
            }
            "--broken" => match value()?.as_str() {
                "no-fsync" => a.broken = true,
                other => return Err(format!("--broken: unknown mode {other:?} (no-fsync)")),
            },
            "--artifacts" => a.artifacts = Some(value()?.into()),
            "--summary" => a.summary = Some(value()?.into()),
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown flag {other:?}")),
        }
    }
    Ok(a)
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("diskfault: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    if let Err(why) = probe() {
        eprintln!("diskfault: cannot mount a FUSE filesystem here: {why}");
        return ExitCode::from(2);
    }
    println!("diskfault: seed {} runs {}", args.seed, args.runs);
    let rt = tokio::runtime::Runtime::new().expect("a tokio runtime");
    let (mut failed, mut errors) = (0u64, 0u64);
    for i in 0..args.runs {
        let seed = args.seed + i;
        let scenario = args
            .scenario
            .unwrap_or(Scenario::ALL[(i % Scenario::ALL.len() as u64) as usize]);
        let dir = match &args.artifacts {
            Some(d) => d.join(format!("diskfault-{seed}-{}", scenario.name())),
            None => lockd_tests::diskfault::run::default_dir(seed, scenario),
        };
        let mut o = Options::new(seed, scenario, dir.clone());
        o.cycles = args.cycles;
        o.tear = args.tear;
        o.broken_no_fsync = args.broken;
        let rerun = format!(
            "diskfault --seed {seed} --scenario {} --cycles {} --tear {}{}",
            scenario.name(),
            o.cycles,
            o.tear,
            if o.broken_no_fsync {
                " --broken no-fsync"
            } else {
                ""
            }
        );
        let result = rt.block_on(async { tokio::time::timeout(RUN_BOUND, run(&o)).await });
        let (verdict, line) = match result {
            Ok(Ok(report)) => {
                let verdict = if report.violations.is_empty() {
                    "pass"
                } else {
                    "fail"
                };
                println!(
                    "seed {seed} {}: {verdict}; {} grants acknowledged, {} unknown, {} power losses, {} refused, {:.1} s",
                    scenario.name(),
                    report.grants_acked,
                    report.acquires_unknown,
                    report.power_losses.len(),
                    report.refused.len(),
                    report.elapsed_ms as f64 / 1000.0
                );
                for n in &report.notes {
                    println!("  note: {n}");
                }
                for v in &report.violations {
                    println!("  VIOLATION {v}");
                }
                let mut json = serde_json::to_value(&report).expect("a report serializes");
                json["verdict"] = verdict.into();
                json["rerun"] = rerun.clone().into();
                (verdict, json)
            }
            Ok(Err(e)) => {
                println!("seed {seed} {}: harness error: {e:#}", scenario.name());
                (
                    "error",
                    serde_json::json!({"seed": seed, "scenario": scenario.name(), "verdict": "error", "error": format!("{e:#}"), "rerun": rerun}),
                )
            }
            Err(_) => {
                println!(
                    "seed {seed} {}: abandoned after {RUN_BOUND:?}",
                    scenario.name()
                );
                (
                    "error",
                    serde_json::json!({"seed": seed, "scenario": scenario.name(), "verdict": "error", "error": "run bound exceeded", "rerun": rerun}),
                )
            }
        };
        match verdict {
            "pass" => lockd_tests::diskfault::run::remove_dir(&dir),
            "fail" => {
                failed += 1;
                println!(
                    "  seed {seed}; rerun with: {rerun}; artifacts: {}",
                    dir.display()
                );
            }
            _ => {
                errors += 1;
                println!("  artifacts: {}", dir.display());
            }
        }
        if let Some(path) = &args.summary {
            let appended = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .and_then(|mut f| writeln!(f, "{line}"));
            if let Err(e) = appended {
                eprintln!("diskfault: appending to {}: {e}", path.display());
            }
        }
    }
    println!(
        "diskfault: {} runs, {} failed, {} harness errors",
        args.runs, failed, errors
    );
    if failed > 0 {
        ExitCode::from(1)
    } else if errors > 0 {
        ExitCode::from(2)
    } else {
        ExitCode::SUCCESS
    }
}
