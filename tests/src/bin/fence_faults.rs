//! `fence-faults`: fence-proxy under faults (see `lockd_tests::fencefaults`): proxies killed
//! mid-forward, two proxies sharing a Postgres epoch store or fence table, the Postgres behind
//! the proxy crashing during fenced transactions, HTTP upstreams that are slow, answer early or
//! close mid-body. Build the proxy first:
//!
//! ```sh
//! cargo build -p fence-proxy
//! cargo run -p lockd-tests --bin fence-faults -- --seed 7 --rounds 30
//! ```
//!
//! Flags: `--seed N` (default random, printed), `--rounds N` (12), `--kinds A,B` (scenario kinds,
//! default all: HttpKill, PgKill, HttpShared, PgShared, PgRestart, HttpUpstream), `--round N`
//! (replay one round of the seed), `--bypass` (writers skip the proxies: an oracle self-test that
//! must report violations), `--verbose` (every write and what storage holds).
//! Exits 0 without violations, 1 with, 2 on bad flags or a harness error.

use std::process::ExitCode;

use lockd_tests::fencefaults::{Config, Kind, run};

fn parse() -> Result<Config, String> {
    let mut c = Config::new(rand::random::<u32>() as u64, 12);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--seed" => c.seed = value()?.parse().map_err(|e| format!("--seed: {e}"))?,
            "--rounds" => c.rounds = value()?.parse().map_err(|e| format!("--rounds: {e}"))?,
            "--round" => {
                c.only_round = Some(value()?.parse().map_err(|e| format!("--round: {e}"))?)
            }
            "--kinds" => {
                for k in value()?.split(',') {
                    c.kinds
                        .push(Kind::parse(k.trim()).ok_or_else(|| format!("unknown kind {k:?}"))?);
                }
            }
            "--bypass" => c.bypass = true,
            "--verbose" => c.verbose = true,
            other => {
                return Err(format!(
                    "unknown flag {other:?} (see the source's doc comment)"
                ));
            }
        }
    }
    if let Some(r) = c.only_round {
        c.rounds = c.rounds.max(r + 1);
    }
    Ok(c)
}

#[tokio::main]
async fn main() -> ExitCode {
    let cfg = match parse() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("fence-faults: {e}");
            return ExitCode::from(2);
        }
    };
    let seed = cfg.seed;
    let kinds_flag = if cfg.kinds.is_empty() {
        String::new()
    } else {
        let names: Vec<String> = cfg.kinds.iter().map(|k| format!("{k:?}")).collect();
        format!(" --kinds {}", names.join(","))
    };
    eprintln!(
        "fence-faults: seed {seed}, {} rounds, kinds {:?}{}",
        cfg.rounds,
        if cfg.kinds.is_empty() {
            Kind::ALL.to_vec()
        } else {
            cfg.kinds.clone()
        },
        if cfg.bypass {
            ", bypass (self-test)"
        } else {
            ""
        }
    );
    let started = std::time::Instant::now();
    match run(cfg).await {
        Ok(summary) => {
            for v in &summary.violations {
                println!(
                    "VIOLATION seed {seed} round {} ({:?}): {}\n  replay: cargo run -p lockd-tests --bin fence-faults -- --seed {seed}{kinds_flag} --round {} --verbose",
                    v.round, v.kind, v.what, v.round
                );
            }
            println!(
                "fence-faults: seed {seed}: {summary} in {:.1} s",
                started.elapsed().as_secs_f64()
            );
            if summary.violations.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("fence-faults: {e:#}");
            ExitCode::from(2)
        }
    }
}
