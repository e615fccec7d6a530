//! `chaos`: one long seeded fault-injection run, for soak testing beyond the short run in
//! `cargo test`. Build the binaries it starts first:
//!
//! ```sh
//! cargo build -p lockd-server -p fence-proxy
//! cargo run -p lockd-tests --bin chaos -- --duration 10m --seed 42
//! ```
//!
//! Flags: `--seed N` (default: random, printed), `--duration 90s|10m` (default 10m),
//! `--workers N` (6), `--resources N` (3), `--no-postgres`, `--broken bypass-fence` (stalled
//! clients write around the fence: the run must then report violations), `--first-fault NAME`,
//! `--faults KillLeader,PauseClient,...` (default: all kinds).
//! Exits 0 when no invariant was violated, 1 when one was, 2 on bad flags or a harness error.

use std::process::ExitCode;
use std::time::Duration;

use lockd_tests::chaos::nemesis::Fault;
use lockd_tests::chaos::run::{RunConfig, run};
use lockd_tests::chaos::workload::Mode;

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
        .find(|f| format!("{f:?}").eq_ignore_ascii_case(s))
        .ok_or_else(|| format!("unknown fault {s:?}"))
}

fn parse() -> Result<RunConfig, String> {
    let mut c = RunConfig::short(rand::random());
    c.duration = Duration::from_secs(600);
    let mut args = std::env::args().skip(1);
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
                other => return Err(format!("unknown --broken mode {other:?}")),
            },
            "--first-fault" => c.first_fault = Some(parse_fault(&value()?)?),
            "--faults" => {
                c.faults = value()?
                    .split(',')
                    .map(parse_fault)
                    .collect::<Result<_, _>>()?
            }
            "--help" | "-h" => {
                return Err("usage: chaos [--seed N] [--duration 10m] [--workers N] [--resources N] [--no-postgres] [--tls] [--broken bypass-fence] [--first-fault NAME] [--faults NAME,NAME]".into());
            }
            other => return Err(format!("unknown flag {other:?}")),
        }
    }
    if c.workers == 0 || c.resources == 0 {
        return Err("--workers and --resources must be at least 1".into());
    }
    Ok(c)
}

fn main() -> ExitCode {
    let config = match parse() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("chaos: {e}");
            return ExitCode::from(2);
        }
    };
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
