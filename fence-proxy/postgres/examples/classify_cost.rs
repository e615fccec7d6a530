//! What classifying one simple Query costs the proxy: `classify` (the parser on a thread of its
//! own per call) against `pg_query::parse` on the calling thread, for the statements of
//! pgbench's TPC-B-like script. Prints the median per call of several rounds.
//!
//! `cargo run --release -p fence-proxy-postgres --example classify_cost [ROUNDS] [CALLS]`

use std::time::Instant;

const STATEMENTS: [&str; 5] = [
    "UPDATE pgbench_accounts SET abalance = abalance + -4077 WHERE aid = 53211;",
    "SELECT abalance FROM pgbench_accounts WHERE aid = 53211;",
    "UPDATE pgbench_tellers SET tbalance = tbalance + -4077 WHERE tid = 7;",
    "UPDATE pgbench_branches SET bbalance = bbalance + -4077 WHERE bid = 1;",
    "INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (7, 1, 53211, -4077, CURRENT_TIMESTAMP);",
];

fn main() {
    let mut args = std::env::args().skip(1);
    let rounds: usize = args
        .next()
        .map_or(5, |a| a.parse().expect("ROUNDS: a number"));
    let calls: usize = args
        .next()
        .map_or(20_000, |a| a.parse().expect("CALLS: a number"));
    let mut timings: Vec<(&str, Vec<f64>)> =
        vec![("classify", vec![]), ("pg_query::parse", vec![])];
    for _ in 0..rounds {
        for (name, samples) in &mut timings {
            let started = Instant::now();
            for i in 0..calls {
                let sql = STATEMENTS[i % STATEMENTS.len()];
                if *name == "classify" {
                    fence_proxy_postgres::classify::classify(sql).expect("classifies");
                } else {
                    pg_query::parse(sql).expect("parses");
                }
            }
            samples.push(started.elapsed().as_secs_f64() * 1e6 / calls as f64);
        }
    }
    let rss = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS"))
                .map(str::to_owned)
        })
        .unwrap_or_default();
    println!("after {} calls: {rss}", rounds * calls * 2);
    for (name, mut samples) in timings {
        samples.sort_by(f64::total_cmp);
        let rounds: Vec<String> = samples.iter().map(|s| format!("{s:.1}")).collect();
        println!(
            "{name:<16} median {:.1} µs per call (rounds: {})",
            samples[samples.len() / 2],
            rounds.join(" ")
        );
    }
}
