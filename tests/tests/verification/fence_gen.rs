//! The adversarial generator for fence-proxy's Postgres front end, as a short seeded
//! run. `cargo run -p lockd-tests --bin fence-gen -- --sessions 100000` is the long form (see
//! docs/verification.md).

use lockd_tests::fencegen::{Config, report, run};

use crate::SERIAL;

/// Seed of the short run in the suite: fixed, so that a failure replays with
/// `fence-gen --seed 13013 --case N`.
const SEED: u64 = 13013;

/// Goal: the oracle is not blind. Method: the attackers' sessions go straight to Postgres,
/// bypassing the proxy, so their writes commit; most cases must be reported as violations (a
/// session whose blocks happen to write nothing, or only rows of uncertain fence, is not).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_gen_oracle_flags_writes_that_bypass_the_proxy() {
    lockd_tests::skip_without_postgres!();
    // Both tests run `fence-proxy postgres init` on the shared database first; two inits at
    // once race on creating the same schema, so the tests take turns (with the other runs).
    let _serial = SERIAL.lock().await;
    let mut cfg = Config::new(SEED, 40);
    cfg.attack_directly = true;
    let summary = run(cfg).await.unwrap();
    eprintln!("{summary}");
    assert_eq!(summary.setup_failures, 0, "{summary}");
    assert!(
        summary.violations.len() >= 25,
        "the oracle flagged only {} of 40 direct sessions: {summary}",
        summary.violations.len()
    );
}

/// Goal: no generated session commits a stale write, or an unfenced one under
/// `--require-fence`, through the proxy. Method: 300 seeded sessions, half against each kind of
/// proxy, four at a time; on failure the seed, case and exact messages are printed.
///
/// Before the redesigned front end this run found dozens of violations (see
/// `tests/fencegen-corpus/`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_gen_short_seeded_run_finds_no_violation() {
    lockd_tests::skip_without_postgres!();
    // Both tests run `fence-proxy postgres init` on the shared database first; two inits at
    // once race on creating the same schema, so the tests take turns (with the other runs).
    let _serial = SERIAL.lock().await;
    let summary = run(Config::new(SEED, 300)).await.unwrap();
    let reports: Vec<String> = summary
        .violations
        .iter()
        .take(5)
        .map(|v| report(SEED, v))
        .collect();
    assert!(
        summary.violations.is_empty() && summary.setup_failures == 0,
        "{summary}\n{}",
        reports.join("\n")
    );
}
