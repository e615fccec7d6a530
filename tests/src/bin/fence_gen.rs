//! `fence-gen`: the adversarial session generator for fence-proxy's Postgres front end (see
//! `lockd_tests::fencegen`). Build the proxy first:
//!
//! ```sh
//! cargo build -p fence-proxy
//! cargo run -p lockd-tests --bin fence-gen -- --seed 7 --sessions 10000 --jobs 4
//! ```
//!
//! Flags: `--seed N` (default random, printed), `--sessions N` (1000), `--jobs J` (4),
//! `--require-fence` / `--no-require-fence` (default: half the cases each), `--fence-table NAME`
//! (`public.lockd_fence`), `--no-init` (skip `fence-proxy postgres init`, which runs first by
//! default), `--case N` (replay one
//! case), `--direct` (attackers bypass the proxy: an oracle self-test), `--verbose`.
//! Exits 0 without violations, 1 with, 2 on bad flags or a harness error.

use std::process::ExitCode;

use lockd_tests::fencegen::{Config, FenceMode, report, run};

fn parse() -> Result<Config, String> {
    let mut c = Config::new(rand::random(), 1000);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--seed" => c.seed = value()?.parse().map_err(|e| format!("--seed: {e}"))?,
            "--sessions" => {
                c.sessions = value()?.parse().map_err(|e| format!("--sessions: {e}"))?
            }
            "--jobs" => c.jobs = value()?.parse().map_err(|e| format!("--jobs: {e}"))?,
            "--require-fence" => c.mode = FenceMode::RequireFence,
            "--no-require-fence" => c.mode = FenceMode::Plain,
            "--fence-table" => c.fence_table = value()?,
            "--init" => c.init = true,
            "--no-init" => c.init = false,
            "--case" => c.only_case = Some(value()?.parse().map_err(|e| format!("--case: {e}"))?),
            "--direct" => c.attack_directly = true,
            "--verbose" => c.verbose = true,
            other => {
                return Err(format!(
                    "unknown flag {other:?} (see the source's doc comment)"
                ));
            }
        }
    }
    if c.jobs == 0 {
        return Err("--jobs must be at least 1".into());
    }
    Ok(c)
}

#[tokio::main]
async fn main() -> ExitCode {
    let cfg = match parse() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("fence-gen: {e}");
            return ExitCode::from(2);
        }
    };
    let seed = cfg.seed;
    eprintln!(
        "fence-gen: seed {seed}, {} sessions, {} jobs, {:?}, fence table {}",
        cfg.sessions, cfg.jobs, cfg.mode, cfg.fence_table
    );
    let started = std::time::Instant::now();
    match run(cfg).await {
        Ok(summary) => {
            for v in &summary.violations {
                println!("{}", report(seed, v));
            }
            println!(
                "fence-gen: seed {seed}: {summary} in {:.1} s",
                started.elapsed().as_secs_f64()
            );
            if summary.violations.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("fence-gen: seed {seed}: {e:#}");
            ExitCode::from(2)
        }
    }
}
