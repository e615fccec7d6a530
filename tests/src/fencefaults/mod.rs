//! `fence-faults`: fence-proxy under faults, with the oracle "no stale write applied, no
//! acknowledged write lost".
//!
//! Each round draws one scenario kind from the seed and runs it against real processes on
//! loopback: `fence-proxy http` and `fence-proxy postgres` child processes, an in-process HTTP
//! upstream that misbehaves on request ([`upstream`]), the shared Postgres (only as a store and
//! as an upstream that is never restarted) and, for restarts of Postgres, a private cluster
//! ([`crate::pg::PrivateCluster`]). The kinds ([`Kind`]):
//!
//! - `HttpKill`: `fence-proxy http` is killed (SIGKILL) while a fenced PUT's body is being
//!   forwarded (mid-body, or after the body while the upstream works on it), then restarted; the
//!   store is redb or Postgres, drawn by the seed.
//! - `PgKill`: `fence-proxy postgres` is killed inside a fenced transaction, before its COMMIT or
//!   while a slow COMMIT runs, then restarted.
//! - `HttpShared`: two `fence-proxy http` processes share one Postgres epoch store; writers with
//!   different tokens race through both.
//! - `PgShared`: two `fence-proxy postgres` processes guard one fence table; writers with
//!   different tokens race through both.
//! - `PgRestart`: the Postgres behind `fence-proxy postgres` (a private cluster) crashes
//!   (immediate shutdown) while fenced transactions and slow COMMITs are in flight, and restarts
//!   on the same data directory and port.
//! - `HttpUpstream`: the upstream is slow, answers 200 or 413 before it has read the body, or
//!   closes the connection mid-body (with or without an early 200).
//!
//! After every kind a stale probe (a token below the highest acknowledged one) and a fresh write
//! (a higher token) go through the restarted or surviving proxies.
//!
//! # The oracle
//!
//! Every write is recorded with its resource, token, start and end times and outcome:
//! acknowledged (2xx, or COMMIT answered), refused (the proxy's 412 or 55P03, or another
//! refusal that forwards nothing), failed-not-done (an error before COMMIT was sent) or unknown
//! (anything else: a connection broken by a kill, a 502 or 504). What reached storage is read
//! back after the round: the upstream's log of applied requests in order, or the committed rows
//! in commit order (a deferred trigger numbers them at commit time). A round violates the
//! promise when, for one resource:
//!
//! 1. a token is applied after a higher one (`stale-applied`);
//! 2. an acknowledged write is not applied (`ack-lost`);
//! 3. a refused or failed-not-done write is applied (`refused-applied`);
//! 4. (Postgres) the fence table's record is below a committed token (`record-below-commit`).
//!
//! An unknown outcome may go either way; an acknowledgement is never assumed from a timeout.
//! `--bypass` sends the writers straight to the storage instead of through the proxies, which the
//! oracle must flag: the self-test that shows it is not blind.
//!
//! # Layout
//! - [`upstream`]: the misbehaving HTTP upstream and a raw HTTP client that streams a body.
//! - [`http`]: the HTTP scenarios.
//! - [`postgres`]: the Postgres scenarios, the proxy process and the fenced writer.

pub mod http;
pub mod postgres;
pub mod upstream;

use std::collections::BTreeMap;
use std::time::Instant;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// The scenario kinds, one drawn per round.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    HttpKill,
    PgKill,
    HttpShared,
    PgShared,
    PgRestart,
    HttpUpstream,
}

impl Kind {
    pub const ALL: [Kind; 6] = [
        Kind::HttpKill,
        Kind::PgKill,
        Kind::HttpShared,
        Kind::PgShared,
        Kind::PgRestart,
        Kind::HttpUpstream,
    ];

    pub fn parse(s: &str) -> Option<Kind> {
        Kind::ALL
            .into_iter()
            .find(|k| format!("{k:?}").eq_ignore_ascii_case(s))
    }
}

#[derive(Clone, Debug)]
pub struct Config {
    pub seed: u64,
    pub rounds: u64,
    /// Only these kinds (all when empty).
    pub kinds: Vec<Kind>,
    /// Run only this round (replay).
    pub only_round: Option<u64>,
    /// Writers bypass the proxies (oracle self-test: violations expected).
    pub bypass: bool,
    pub verbose: bool,
}

impl Config {
    pub fn new(seed: u64, rounds: u64) -> Config {
        Config {
            seed,
            rounds,
            kinds: Vec::new(),
            only_round: None,
            bypass: false,
            verbose: false,
        }
    }
}

/// How one write ended, as its client saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// 2xx, or COMMIT answered: the write must be in storage.
    Acked,
    /// The proxy refused it as stale (412, 55P03): it must not be in storage.
    Stale,
    /// Refused or failed in a way that forwards or commits nothing (another proxy refusal, an
    /// error before COMMIT was sent): it must not be in storage.
    NotDone(String),
    /// Anything else (connection broken, 502, 504, a COMMIT without answer): either way.
    Unknown(String),
}

/// One write of a round.
#[derive(Clone, Debug)]
pub struct Write {
    pub id: u64,
    pub resource: String,
    pub token: u64,
    /// Which proxy (or "direct") it went through, and what was done to it.
    pub via: String,
    pub started: Instant,
    pub ended: Instant,
    pub outcome: Outcome,
    /// The scenario knows the proxy recorded a higher token before this write (it reached the
    /// upstream, or committed): the write must be refused as stale.
    pub must_refuse: bool,
}

/// What storage holds after a round: per resource, the (write id, token) pairs applied, in the
/// order applied; and (Postgres) the fence table's record.
#[derive(Clone, Debug, Default)]
pub struct Applied {
    pub order: BTreeMap<String, Vec<(u64, u64)>>,
    pub records: BTreeMap<String, u64>,
}

/// One broken promise.
#[derive(Clone, Debug)]
pub struct Violation {
    pub round: u64,
    pub kind: Kind,
    pub what: String,
}

#[derive(Clone, Debug, Default)]
pub struct Summary {
    pub rounds: u64,
    pub per_kind: BTreeMap<String, u64>,
    pub writes: u64,
    pub acked: u64,
    /// Writes started after a higher token of their resource was acknowledged.
    pub stale_attempts: u64,
    /// Writes the proxy refused as stale (412, 55P03).
    pub stale_refused: u64,
    pub unknown: u64,
    /// Proxy kills, Postgres crashes, upstream misbehaviours injected.
    pub faults: u64,
    pub violations: Vec<Violation>,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kinds: Vec<String> = self
            .per_kind
            .iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        write!(
            f,
            "{} rounds ({}), {} faults, {} writes, {} acknowledged, {} unknown, {} stale attempts, {} refused as stale, {} violations",
            self.rounds,
            kinds.join(", "),
            self.faults,
            self.writes,
            self.acked,
            self.unknown,
            self.stale_attempts,
            self.stale_refused,
            self.violations.len()
        )
    }
}

/// What a scenario hands back: its writes, what storage holds, and how many faults it made.
pub struct RoundResult {
    pub writes: Vec<Write>,
    pub applied: Applied,
    pub faults: u64,
}

/// The random source of one round: the same `(seed, round)` gives the same draws.
pub fn round_rng(seed: u64, round: u64) -> StdRng {
    StdRng::seed_from_u64(seed ^ round.wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// Runs the rounds and checks each.
pub async fn run(cfg: Config) -> anyhow::Result<Summary> {
    crate::pg::require_postgres();
    let kinds = if cfg.kinds.is_empty() {
        Kind::ALL.to_vec()
    } else {
        cfg.kinds.clone()
    };
    let mut summary = Summary::default();
    for round in 0..cfg.rounds {
        if cfg.only_round.is_some_and(|r| r != round) {
            continue;
        }
        let mut rng = round_rng(cfg.seed, round);
        let kind = kinds[rng.random_range(0..kinds.len())];
        let started = Instant::now();
        let result = match kind {
            Kind::HttpKill => http::kill(&mut rng, cfg.bypass).await,
            Kind::HttpShared => http::shared(&mut rng, cfg.bypass).await,
            Kind::HttpUpstream => http::upstream_faults(&mut rng, cfg.bypass).await,
            Kind::PgKill => postgres::kill(&mut rng, cfg.bypass).await,
            Kind::PgShared => postgres::shared(&mut rng, cfg.bypass).await,
            Kind::PgRestart => postgres::restart(&mut rng, cfg.bypass).await,
        }
        .map_err(|e| anyhow::anyhow!("seed {} round {round} ({kind:?}): {e:#}", cfg.seed))?;
        let found = check(&result.writes, &result.applied);
        if cfg.verbose {
            for w in &result.writes {
                eprintln!(
                    "  round {round} {kind:?}: write {} {}:{} via {} -> {:?}",
                    w.id, w.resource, w.token, w.via, w.outcome
                );
            }
            eprintln!("  round {round} {kind:?}: applied {:?}", result.applied);
        }
        eprintln!(
            "fence-faults: round {round} {kind:?}: {} writes, {} faults, {} violations, {:.1} s",
            result.writes.len(),
            result.faults,
            found.len(),
            started.elapsed().as_secs_f64()
        );
        summary.rounds += 1;
        *summary.per_kind.entry(format!("{kind:?}")).or_default() += 1;
        summary.faults += result.faults;
        summary.writes += result.writes.len() as u64;
        summary.acked += count(&result.writes, |o| *o == Outcome::Acked);
        summary.stale_refused += count(&result.writes, |o| *o == Outcome::Stale);
        summary.unknown += count(&result.writes, |o| matches!(o, Outcome::Unknown(_)));
        summary.stale_attempts += stale_attempts(&result.writes).len() as u64;
        summary.violations.extend(
            found
                .into_iter()
                .map(|what| Violation { round, kind, what }),
        );
    }
    Ok(summary)
}

fn count(writes: &[Write], f: impl Fn(&Outcome) -> bool) -> u64 {
    writes.iter().filter(|w| f(&w.outcome)).count() as u64
}

/// Writes started after a write of the same resource with a higher token was acknowledged.
pub fn stale_attempts(writes: &[Write]) -> Vec<&Write> {
    writes
        .iter()
        .filter(|w| {
            writes.iter().any(|a| {
                a.outcome == Outcome::Acked
                    && a.resource == w.resource
                    && a.token > w.token
                    && a.ended < w.started
            })
        })
        .collect()
}

/// The oracle (see the module docs); returns one line per broken promise.
pub fn check(writes: &[Write], applied: &Applied) -> Vec<String> {
    let mut found = Vec::new();
    for (resource, order) in &applied.order {
        let mut highest: Option<(u64, u64)> = None;
        for &(id, token) in order {
            if let Some((hid, htoken)) = highest
                && token < htoken
            {
                found.push(format!(
                    "stale-applied: {resource}: write {id} with token {token} applied after write {hid} with token {htoken}"
                ));
            }
            if highest.is_none_or(|(_, h)| token >= h) {
                highest = Some((id, token));
            }
        }
        if let (Some(&record), Some((_, top))) = (applied.records.get(resource), highest)
            && record < top
        {
            found.push(format!(
                "record-below-commit: {resource}: fence record {record} below committed token {top}"
            ));
        }
    }
    let is_applied = |w: &Write| {
        applied
            .order
            .get(&w.resource)
            .is_some_and(|o| o.iter().any(|&(id, _)| id == w.id))
    };
    for w in writes {
        match &w.outcome {
            Outcome::Acked if !is_applied(w) => found.push(format!(
                "ack-lost: {}: write {} with token {} (via {}) was acknowledged but is not in storage",
                w.resource, w.id, w.token, w.via
            )),
            Outcome::Stale | Outcome::NotDone(_) if is_applied(w) => found.push(format!(
                "refused-applied: {}: write {} with token {} (via {}) was answered {:?} but is in storage",
                w.resource, w.id, w.token, w.via, w.outcome
            )),
            _ => {}
        }
    }
    for w in writes
        .iter()
        .filter(|w| w.must_refuse && w.outcome != Outcome::Stale)
    {
        found.push(format!(
            "record-lost: {}: write {} with token {} (via {}) came after a higher token was recorded but was answered {:?}",
            w.resource, w.id, w.token, w.via, w.outcome
        ));
    }
    for w in stale_attempts(writes) {
        if is_applied(w) {
            found.push(format!(
                "stale-applied: {}: write {} with token {} (via {}) started after a higher token was acknowledged, and was applied",
                w.resource, w.id, w.token, w.via
            ));
        }
    }
    found
}

/// Tokens of a race of `n` writers: mostly rising with the writer's index (two writers per
/// token), some stale (up to three below).
pub fn race_tokens(rng: &mut StdRng, base: u64, n: usize) -> Vec<u64> {
    (0..n)
        .map(|i| {
            let rising = base + (i as u64) / 2;
            if rng.random_bool(0.3) {
                rising.saturating_sub(rng.random_range(1..4))
            } else {
                rising
            }
        })
        .collect()
}

/// A write id unique within the process, so rows and upstream log lines name their write.
pub fn next_write_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// A resource name unique to this run (random, not drawn from the seed: two runs of one seed on
/// the shared Postgres must not see each other's fence records).
pub fn resource_name(prefix: &str) -> String {
    crate::pg::unique_name(prefix)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(id: u64, token: u64, outcome: Outcome, at: u64) -> Write {
        let base = Instant::now();
        Write {
            id,
            resource: "r".into(),
            token,
            via: "p".into(),
            started: base + std::time::Duration::from_millis(at),
            ended: base + std::time::Duration::from_millis(at + 1),
            outcome,
            must_refuse: false,
        }
    }

    fn applied(order: &[(u64, u64)]) -> Applied {
        let mut a = Applied::default();
        a.order.insert("r".into(), order.to_vec());
        a
    }

    #[test]
    fn oracle_accepts_a_clean_history() {
        let writes = [
            w(1, 5, Outcome::Acked, 0),
            w(2, 4, Outcome::Stale, 10),
            w(3, 6, Outcome::Unknown("killed".into()), 20),
            w(4, 7, Outcome::Acked, 30),
        ];
        assert!(check(&writes, &applied(&[(1, 5), (4, 7)])).is_empty());
        assert!(check(&writes, &applied(&[(1, 5), (3, 6), (4, 7)])).is_empty());
    }

    #[test]
    fn oracle_flags_each_broken_promise() {
        let writes = [
            w(1, 5, Outcome::Acked, 0),
            w(2, 4, Outcome::Unknown("502".into()), 10),
            w(3, 7, Outcome::Acked, 30),
            w(4, 3, Outcome::NotDone("412".into()), 40),
        ];
        let found = check(&writes, &applied(&[(1, 5), (2, 4)]));
        assert!(
            found.iter().any(|f| f.starts_with("stale-applied")),
            "{found:?}"
        );
        assert!(found.iter().any(|f| f.starts_with("ack-lost")), "{found:?}");
        let found = check(&writes, &applied(&[(1, 5), (3, 7), (4, 3)]));
        assert!(
            found.iter().any(|f| f.starts_with("refused-applied")),
            "{found:?}"
        );
        let mut a = applied(&[(1, 5), (3, 7)]);
        a.records.insert("r".into(), 6);
        let found = check(&writes, &a);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].starts_with("record-below-commit"), "{found:?}");
    }
}
