//! `chaos`: seeded fault-injection runs beyond the short run in `cargo test`: one long run, or many
//! (`--runs`), with a summary that accumulates. Build the binaries it starts first:
//!
//! ```sh
//! cargo build -p lockd-server -p fence-proxy
//! cargo run -p lockd-tests --bin chaos -- --duration 10m --seed 42
//! cargo run -p lockd-tests --bin chaos -- --runs 300 --jobs 2 --duration 60s --tls-every 2 \
//!     --summary chaos-summary.jsonl
//! cargo run -p lockd-tests --bin chaos -- summary chaos-summary.jsonl
//! ```
//!
//! Flags of a run: `--seed N` (default: random, printed), `--duration 90s|10m` (default 10m),
//! `--workers N` (6), `--resources N` (3), `--no-postgres`, `--tls`, `--broken bypass-fence`
//! (stalled clients write around the fence: the run must then report violations), `--broken
//! stale-describe` (workers report their previous `Describe` answer: the linearizability check
//! must fail), `--first-fault NAME`, `--faults KillLeader,PauseClient,...` (default: the nine
//! single kinds), `--composed` (adds the composed faults: two nodes down, a partition during a
//! restart, the leader paused during a snapshot install, a wiped node rejoining while another is
//! partitioned), `--clock` (wall-clock offsets of a minute to hours changed on running nodes, with
//! libfaketime), `--clock-rate` (clock rates of 95-105 % per node start). More broken modes:
//! `--broken clock-monotonic` (with `--clock`: the offsets move the monotonic clock too),
//! `--broken fast-clock` (with `--clock-rate`: rates of 130-160 %), `--broken hidden-outage`
//! (two-nodes-down outages of 15-20 s the availability check is not told about). `--netns` (as
//! root): each node in a network namespace of its own; partitions made in the kernel, plus
//! one-way cuts, bridge partitions, the harness cut from a node, and packet loss, delay with
//! jitter and reordering on a node's link (not with `--clock` or `--clock-rate`).
//! Many runs: `--runs N` (seeds N..N+runs-1 from `--seed`), `--jobs J` (1), `--tls-every K` (every
//! K-th run with TLS), `--summary FILE` (one JSON line per run, appended), `--artifacts DIR`
//! (where runs keep their folders; those of passing runs are deleted), `--label TEXT` (stored in
//! each line). `chaos summary FILE` prints the totals of a summary file.
//! Exits 0 when no invariant was violated, 1 when one was, 2 on bad flags or a harness error.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use lockd_tests::chaos::clock::ClockMode;
use lockd_tests::chaos::nemesis::{COMPOSED, Fault, NETNS};
use lockd_tests::chaos::run::{RunConfig, run};
use lockd_tests::chaos::soak::{SoakConfig, read_totals, run_many};
use lockd_tests::chaos::workload::Mode;

const USAGE: &str = "usage: chaos [--seed N] [--duration 10m] [--workers N] [--resources N] [--no-postgres] [--tls] [--broken bypass-fence|stale-describe|clock-monotonic|fast-clock|hidden-outage] [--first-fault NAME] [--faults NAME,NAME] [--composed] [--netns] [--clock | --clock-rate] [--runs N [--jobs J] [--tls-every K] [--summary FILE] [--artifacts DIR] [--label TEXT]]\n       chaos summary FILE";

fn parse_duration(s: &str) -> Result<Duration, String> {
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = num.parse().map_err(|_| format!("bad duration {s:?}"))?;
    match unit {
        "s" | "" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n * 60)),
        "h" => Ok(Duration::from_secs(n * 3600)),
        _ => Err(format!("bad duration unit in {s:?} (use s, m or h)")),
    }
}

fn parse_fault(s: &str) -> Result<Fault, String> {
    lockd_tests::chaos::nemesis::ALL
        .into_iter()
        .chain(COMPOSED)
        .chain(NETNS)
        .find(|f| format!("{f:?}").eq_ignore_ascii_case(s))
        .ok_or_else(|| format!("unknown fault {s:?}"))
}

enum Cmd {
    One(RunConfig),
    Many(SoakConfig),
    Summary(PathBuf),
}

fn parse() -> Result<Cmd, String> {
    let mut c = RunConfig::short(rand::random());
    c.duration = Duration::from_secs(600);
    let mut runs: Option<u64> = None;
    let mut jobs = 1usize;
    let mut tls_every = None;
    let mut summary = None;
    let mut artifacts = None;
    let mut label = None;
    let mut composed = false;
    let mut explicit_faults: Option<Vec<Fault>> = None;
    let mut args = std::env::args().skip(1).peekable();
    if args.peek().map(String::as_str) == Some("summary") {
        args.next();
        let file = args.next().ok_or("summary needs a FILE")?;
        if let Some(extra) = args.next() {
            return Err(format!(
                "unexpected argument {extra:?} after the summary file"
            ));
        }
        return Ok(Cmd::Summary(file.into()));
    }
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--seed" => c.seed = value()?.parse().map_err(|e| format!("--seed: {e}"))?,
            "--duration" => c.duration = parse_duration(&value()?)?,
            "--workers" => c.workers = value()?.parse().map_err(|e| format!("--workers: {e}"))?,
            "--resources" => {
                c.resources = value()?.parse().map_err(|e| format!("--resources: {e}"))?
            }
            "--no-postgres" => c.postgres = false,
            "--tls" => c.tls = true,
            "--broken" => match value()?.as_str() {
                "bypass-fence" => c.mode = Mode::PausedClientsBypassFence,
                "stale-describe" => c.mode = Mode::StaleDescribes,
                "clock-monotonic" => c.mode = Mode::ClockMonotonic,
                "fast-clock" => c.mode = Mode::FastClock,
                "hidden-outage" => c.mode = Mode::HiddenOutage,
                other => return Err(format!("unknown --broken mode {other:?}")),
            },
            "--first-fault" => c.first_fault = Some(parse_fault(&value()?)?),
            "--faults" => {
                explicit_faults = Some(
                    value()?
                        .split(',')
                        .map(parse_fault)
                        .collect::<Result<_, _>>()?,
                )
            }
            "--composed" => composed = true,
            "--netns" => c.netns = true,
            "--clock" | "--clock-rate" => {
                let mode = if a == "--clock" {
                    ClockMode::Offsets
                } else {
                    ClockMode::Rates
                };
                if c.clock.is_some_and(|m| m != mode) {
                    return Err("--clock and --clock-rate do not go together".into());
                }
                c.clock = Some(mode);
            }
            "--runs" => runs = Some(value()?.parse().map_err(|e| format!("--runs: {e}"))?),
            "--jobs" => jobs = value()?.parse().map_err(|e| format!("--jobs: {e}"))?,
            "--tls-every" => {
                tls_every = Some(value()?.parse().map_err(|e| format!("--tls-every: {e}"))?)
            }
            "--summary" => summary = Some(PathBuf::from(value()?)),
            "--artifacts" => artifacts = Some(PathBuf::from(value()?)),
            "--label" => label = Some(value()?),
            "--help" | "-h" => return Err(USAGE.into()),
            other => return Err(format!("unknown flag {other:?}\n{USAGE}")),
        }
    }
    c.faults = match explicit_faults {
        Some(f) if composed => {
            return Err(format!(
                "--faults and --composed do not go together (got --faults {f:?})"
            ));
        }
        Some(f) => f,
        None => RunConfig::default_faults(composed, c.netns),
    };
    if !c.netns && c.faults.iter().any(|f| NETNS.contains(f)) {
        return Err("the faults of network namespaces need --netns".into());
    }
    if c.netns && c.clock.is_some() {
        return Err("--netns does not go with --clock or --clock-rate".into());
    }
    if c.workers == 0 || c.resources == 0 {
        return Err("--workers and --resources must be at least 1".into());
    }
    match c.mode {
        Mode::ClockMonotonic if c.clock != Some(ClockMode::Offsets) => {
            return Err("--broken clock-monotonic goes with --clock".into());
        }
        Mode::FastClock if c.clock != Some(ClockMode::Rates) => {
            return Err("--broken fast-clock goes with --clock-rate".into());
        }
        Mode::HiddenOutage if !c.faults.contains(&Fault::TwoNodesDown) => {
            return Err(
                "--broken hidden-outage needs the TwoNodesDown fault (--composed or --faults TwoNodesDown)"
                    .into(),
            );
        }
        _ => {}
    }
    let Some(runs) = runs else {
        if tls_every.is_some() || summary.is_some() || artifacts.is_some() || jobs != 1 {
            return Err("--jobs, --tls-every, --summary and --artifacts go with --runs N".into());
        }
        return Ok(Cmd::One(c));
    };
    if runs == 0 || jobs == 0 || tls_every == Some(0) {
        return Err("--runs, --jobs and --tls-every must be at least 1".into());
    }
    Ok(Cmd::Many(SoakConfig {
        run: c,
        runs,
        jobs,
        tls_every,
        summary,
        artifacts,
        label,
    }))
}

fn one(config: RunConfig) -> ExitCode {
    eprintln!(
        "chaos: seed {} for {:?}; rerun: {}",
        config.seed,
        config.duration,
        config.rerun_command()
    );
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    match rt.block_on(run(config)) {
        Ok(report) => {
            print!("{}", report.summary());
            if report.violations.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("chaos: harness error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn many(cfg: SoakConfig) -> ExitCode {
    eprintln!(
        "chaos: {} runs of {:?}, {} at once, seeds {}..={}{}",
        cfg.runs,
        cfg.run.duration,
        cfg.jobs,
        cfg.run.seed,
        cfg.run.seed.wrapping_add(cfg.runs - 1),
        cfg.tls_every
            .map(|k| format!(", every {k}-th run with TLS"))
            .unwrap_or_default()
    );
    let totals = match run_many(&cfg) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("chaos: {e:#}");
            return ExitCode::from(2);
        }
    };
    println!("=== totals of this invocation\n{}", totals.render());
    if let Some(path) = &cfg.summary {
        match read_totals(path) {
            Ok(all) => println!("=== totals of {}\n{}", path.display(), all.render()),
            Err(e) => eprintln!("chaos: {e:#}"),
        }
    }
    if totals.failed > 0 {
        ExitCode::from(1)
    } else if totals.errors > 0 || totals.interrupted {
        ExitCode::from(2)
    } else {
        ExitCode::SUCCESS
    }
}

fn main() -> ExitCode {
    match parse() {
        Ok(Cmd::One(c)) => one(c),
        Ok(Cmd::Many(s)) => many(s),
        Ok(Cmd::Summary(path)) => match read_totals(&path) {
            Ok(t) => {
                print!("{}", t.render());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("chaos: {e:#}");
                ExitCode::from(2)
            }
        },
        Err(e) => {
            eprintln!("chaos: {e}");
            ExitCode::from(2)
        }
    }
}
