//! The HTTP scenarios: a proxy killed mid-forward, two proxies sharing a Postgres epoch store,
//! and an upstream that is slow, answers early or closes mid-body.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rand::RngExt;
use rand::rngs::StdRng;
use tokio::sync::oneshot;

use super::upstream::{FAULT_HEADER, Fault, FaultUpstream, RawOutcome, WRITE_ID_HEADER, put};
use super::{Applied, Outcome, RoundResult, Write, next_write_id, race_tokens, resource_name};
use crate::fence_proxy::FenceProxy;
use crate::pg;

/// `--upstream-timeout` of the proxies: short, so rounds are short.
const UPSTREAM_TIMEOUT: &str = "2s";
/// `--quarantine`.
const QUARANTINE_MS: u64 = 1_000;
/// `--lock-wait`: longer than a forward plus a quarantine, so that writes queued behind an
/// unknown outcome are served rather than refused as busy.
const LOCK_WAIT: &str = "6s";
/// Longest a `Slow` upstream holds a write: below `UPSTREAM_TIMEOUT`, so a slow write is
/// answered (the documented limit covers upstreams slower than timeout plus quarantine).
const SLOW_MAX_MS: u64 = 1_500;

/// An upstream that closes mid-body does so within this many bytes, inside the first piece of a
/// body of at least three. The proxy learns that the upstream has gone from a failed write of
/// the body, and TCP accepts the first write after the peer has closed (the reset comes back
/// after it): an upstream that answered 200 early and closed before only the *last* piece would
/// go unnoticed (a limit documented in docs/fence-proxy.md).
const CLOSE_WITHIN_BYTES: usize = 10;

/// The proxy flags every scenario uses, plus `--store-table` for a Postgres store.
fn proxy_flags(store_table: Option<&str>) -> Vec<String> {
    let mut f: Vec<String> = [
        "--upstream-timeout",
        UPSTREAM_TIMEOUT,
        "--quarantine",
        "1s",
        "--lock-wait",
        LOCK_WAIT,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if let Some(t) = store_table {
        f.extend(["--store-table".to_owned(), t.to_owned()]);
    }
    f
}

async fn start_proxy(
    upstream: &FaultUpstream,
    store: &str,
    table: Option<&str>,
) -> anyhow::Result<FenceProxy> {
    let flags = proxy_flags(table);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    FenceProxy::start(&upstream.url(), store, &flags).await
}

/// A Postgres epoch-store table of one round, dropped at the end.
struct StoreTable(String);

impl StoreTable {
    fn new() -> StoreTable {
        StoreTable(pg::unique_name("ff_store"))
    }

    async fn drop_now(&self) {
        let direct = pg::connect(&pg::direct_url().parse().unwrap()).await;
        let _ = direct
            .batch_execute(&format!("DROP TABLE IF EXISTS {}", self.0))
            .await;
    }
}

/// One fenced PUT of `pieces` pieces through `target`.
#[derive(Clone)]
struct Put {
    target: SocketAddr,
    via: String,
    resource: String,
    token: u64,
    fault: Fault,
    pieces: usize,
    pause: Duration,
}

impl Put {
    fn new(target: SocketAddr, via: &str, resource: &str, token: u64) -> Put {
        Put {
            target,
            via: via.to_owned(),
            resource: resource.to_owned(),
            token,
            fault: Fault::None,
            pieces: 1,
            pause: Duration::ZERO,
        }
    }

    fn fault(mut self, fault: Fault) -> Put {
        self.fault = fault;
        self
    }

    fn pieces(mut self, pieces: usize, pause: Duration) -> Put {
        self.pieces = pieces.max(1);
        self.pause = pause;
        self
    }

    async fn send(self) -> Write {
        self.send_with_id(next_write_id(), None).await
    }

    /// Starts the write in a task of its own; `sent` is told when its head and first piece are
    /// out.
    fn spawn(self, sent: Option<oneshot::Sender<()>>) -> PendingWrite {
        let id = next_write_id();
        PendingWrite {
            id,
            handle: tokio::spawn(self.send_with_id(id, sent)),
        }
    }

    async fn send_with_id(self, id: u64, sent: Option<oneshot::Sender<()>>) -> Write {
        let started = Instant::now();
        let headers = [
            ("Lock-Resource", self.resource.clone()),
            ("Fencing-Token", self.token.to_string()),
            (WRITE_ID_HEADER, id.to_string()),
            (FAULT_HEADER, self.fault.header_value()),
        ];
        let pieces: Vec<Vec<u8>> = (0..self.pieces)
            .map(|i| format!("{id}:{}:piece-{i};", self.token).into_bytes())
            .collect();
        let raw = put(self.target, &headers, &pieces, self.pause, sent).await;
        Write {
            id,
            resource: self.resource,
            token: self.token,
            via: format!("{} ({})", self.via, self.fault.header_value()),
            started,
            ended: Instant::now(),
            outcome: outcome(raw),
            must_refuse: false,
        }
    }
}

/// A write running in a task of its own.
struct PendingWrite {
    id: u64,
    handle: tokio::task::JoinHandle<Write>,
}

impl PendingWrite {
    async fn finish(self) -> anyhow::Result<Write> {
        Ok(self.handle.await?)
    }
}

/// What the client was told, in the oracle's terms.
fn outcome(raw: RawOutcome) -> Outcome {
    match raw {
        RawOutcome::Answered { status, .. } if (200..300).contains(&status) => Outcome::Acked,
        RawOutcome::Answered { status: 412, .. } => Outcome::Stale,
        // Refusals made before anything is forwarded.
        RawOutcome::Answered {
            status,
            proxy_error: Some(reason),
        } if matches!(
            reason.as_str(),
            "resource-busy" | "store-unavailable" | "fence-required" | "bad-fence"
        ) =>
        {
            Outcome::NotDone(format!("{status} {reason}"))
        }
        RawOutcome::Answered {
            status,
            proxy_error,
        } => Outcome::Unknown(format!("{status} {}", proxy_error.unwrap_or_default())),
        RawOutcome::Broken(e) => Outcome::Unknown(e),
    }
}

fn applied_of(upstream: &FaultUpstream) -> Applied {
    let mut a = Applied::default();
    for w in upstream.applied() {
        a.order
            .entry(w.resource)
            .or_default()
            .push((w.write_id, w.token));
    }
    a
}

/// How the proxy of an `HttpKill` round goes away mid-forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stop {
    /// SIGKILL, then a restart.
    Kill,
    /// SIGKILL, a restart, at once a graceful stop (SIGTERM) of the restarted proxy, and another
    /// restart: the redb store's quarantine after the unclean stop must outlive the clean one.
    KillThenTerm,
    /// SIGTERM: the proxy drains (the write in flight ends first), closes its store cleanly and
    /// is restarted.
    Term,
}

/// How long a graceful stop may take: the proxy's drain (30 s) and a margin.
const TERM_WAIT: Duration = Duration::from_secs(40);

/// Proxy killed (SIGKILL) or stopped (SIGTERM) mid-forward and restarted; then stale probes and
/// a fresh write.
pub async fn kill(rng: &mut StdRng, bypass: bool) -> anyhow::Result<RoundResult> {
    let upstream = FaultUpstream::start().await?;
    let dir = tempfile::tempdir()?;
    let pg_store = rng.random_bool(0.5);
    let table = StoreTable::new();
    let store = if pg_store {
        pg::direct_url()
    } else {
        format!("redb:{}", dir.path().join("epochs.redb").display())
    };
    let mut proxy = start_proxy(&upstream, &store, pg_store.then_some(table.0.as_str())).await?;
    let target = |p: &FenceProxy| if bypass { upstream.addr } else { p.addr };
    let r = resource_name("ffkill");
    let base: u64 = rng.random_range(10..1_000_000);
    let mut writes = Vec::new();

    // Phase 1: the holder of `base` writes.
    writes.push(Put::new(target(&proxy), "proxy", &r, base).send().await);

    // Phase 2: `base + 1` streams its body; the proxy dies mid-body, or while the (slow)
    // upstream works on the complete body.
    let mid_body = rng.random_bool(0.5);
    let stop = [Stop::Kill, Stop::KillThenTerm, Stop::Term][rng.random_range(0..3)];
    let t1 = base + 1;
    let w1 = if mid_body {
        let what = match stop {
            Stop::Term => "proxy stopped mid-body",
            _ => "proxy killed mid-body",
        };
        Put::new(target(&proxy), what, &r, t1).pieces(3, Duration::from_millis(400))
    } else {
        let what = match stop {
            Stop::Term => "proxy stopped while upstream applies",
            _ => "proxy killed while upstream applies",
        };
        Put::new(target(&proxy), what, &r, t1).fault(Fault::Slow {
            ms: rng.random_range(300..SLOW_MAX_MS),
        })
    };
    let kill_after = Duration::from_millis(rng.random_range(20..250));
    let (sent_tx, sent_rx) = oneshot::channel();
    let w1 = w1.spawn(Some(sent_tx));
    let _ = sent_rx.await;
    tokio::time::sleep(kill_after).await;
    // No wait before a restart: a redb store restarted after a kill quarantines every resource
    // for --upstream-timeout + --quarantine, longer than the slow upstream works (SLOW_MAX_MS),
    // and one stopped gracefully saves its quarantines; the Postgres store's `busy_until` does
    // the same for the resource in flight.
    match stop {
        Stop::Kill | Stop::KillThenTerm => proxy.kill(),
        // The drain lets the write in flight end (its client sends every piece) first.
        Stop::Term => {
            let status = proxy.stop(TERM_WAIT).await?;
            anyhow::ensure!(
                status.success(),
                "fence-proxy exited {status} after SIGTERM"
            );
        }
    }
    // The proxy recorded `t1` (durably, before forwarding) if its head reached the upstream.
    let recorded_t1 = upstream.saw_head(w1.id);
    proxy.restart().await?;
    if stop == Stop::KillThenTerm {
        let status = proxy.stop(TERM_WAIT).await?;
        anyhow::ensure!(
            status.success(),
            "fence-proxy exited {status} after SIGTERM"
        );
        proxy.restart().await?;
    }
    writes.push(w1.finish().await?);

    // Phase 3: stale probes (below the acknowledged `base`; `base` itself, below the recorded
    // `t1`) and a fresh write, through the restarted proxy.
    let base_acked = writes[0].outcome == Outcome::Acked;
    let mut probe = Put::new(target(&proxy), "restarted proxy", &r, base - 1)
        .send()
        .await;
    probe.must_refuse = base_acked;
    writes.push(probe);
    let mut probe = Put::new(target(&proxy), "restarted proxy", &r, base)
        .send()
        .await;
    probe.must_refuse = recorded_t1;
    writes.push(probe);
    writes.push(
        Put::new(target(&proxy), "restarted proxy", &r, t1 + 1)
            .send()
            .await,
    );
    let applied = applied_of(&upstream);
    drop(proxy);
    if pg_store {
        table.drop_now().await;
    }
    Ok(RoundResult {
        writes,
        applied,
        faults: 1,
    })
}

/// Two proxies share one Postgres epoch store; writers with different tokens race through both.
pub async fn shared(rng: &mut StdRng, bypass: bool) -> anyhow::Result<RoundResult> {
    let upstream = FaultUpstream::start().await?;
    let table = StoreTable::new();
    let store = pg::direct_url();
    let proxies = [
        start_proxy(&upstream, &store, Some(&table.0)).await?,
        start_proxy(&upstream, &store, Some(&table.0)).await?,
    ];
    let target = |i: usize| {
        if bypass {
            upstream.addr
        } else {
            proxies[i].addr
        }
    };
    let r = resource_name("ffshared");
    let base: u64 = rng.random_range(10..1_000_000);
    let n = rng.random_range(6..12);
    let tokens = race_tokens(rng, base, n);
    let mut pending = Vec::new();
    for token in tokens {
        let i = rng.random_range(0..2);
        let fault = if rng.random_bool(0.3) {
            Fault::Slow {
                ms: rng.random_range(20..300),
            }
        } else {
            Fault::None
        };
        let put = Put::new(target(i), &format!("proxy {i}"), &r, token)
            .fault(fault)
            .pieces(rng.random_range(1..3), Duration::from_millis(20));
        pending.push(put.spawn(None));
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..60))).await;
    }
    let mut writes = Vec::new();
    for p in pending {
        writes.push(p.finish().await?);
    }
    probe_and_finish(&mut writes, &r, target).await;
    let applied = applied_of(&upstream);
    drop(proxies);
    table.drop_now().await;
    Ok(RoundResult {
        writes,
        applied,
        faults: 0,
    })
}

/// Through each of the two targets: a probe below the highest acknowledged token (must be
/// refused), then a write above every token.
async fn probe_and_finish(writes: &mut Vec<Write>, r: &str, target: impl Fn(usize) -> SocketAddr) {
    let acked = writes
        .iter()
        .filter(|w| w.outcome == Outcome::Acked)
        .map(|w| w.token)
        .max();
    let top = writes.iter().map(|w| w.token).max().unwrap_or(1);
    for i in 0..2 {
        if let Some(h) = acked.filter(|h| *h > 0) {
            let mut probe = Put::new(target(i), &format!("proxy {i} (probe)"), r, h - 1)
                .send()
                .await;
            probe.must_refuse = true;
            writes.push(probe);
        }
    }
    writes.push(
        Put::new(target(1), "proxy 1 (final)", r, top + 1)
            .send()
            .await,
    );
}

/// One proxy; the upstream is slow, answers 200 or 413 before it has read the body, or closes
/// mid-body, as each write asks; writers race with different tokens.
pub async fn upstream_faults(rng: &mut StdRng, bypass: bool) -> anyhow::Result<RoundResult> {
    let upstream = FaultUpstream::start().await?;
    let dir = tempfile::tempdir()?;
    let store = format!("redb:{}", dir.path().join("epochs.redb").display());
    let proxy = start_proxy(&upstream, &store, None).await?;
    let target = if bypass { upstream.addr } else { proxy.addr };
    let r = resource_name("ffupstream");
    let base: u64 = rng.random_range(10..1_000_000);
    let n = rng.random_range(5..10);
    let tokens = race_tokens(rng, base, n);
    let mut pending: Vec<PendingWrite> = Vec::new();
    let mut writes = Vec::new();
    let mut faults = 0;
    for token in tokens {
        let mut pieces = rng.random_range(2..4);
        let fault = match rng.random_range(0..6) {
            0 => Fault::None,
            1 => Fault::Slow {
                ms: rng.random_range(50..SLOW_MAX_MS),
            },
            2 => Fault::Early200,
            3 => Fault::Early413,
            // The upstream closes within the first piece (every piece is longer than
            // CLOSE_WITHIN_BYTES), and at least two more follow: see `CLOSE_WITHIN_BYTES`.
            4 => {
                pieces = rng.random_range(3..5);
                Fault::CloseMidBody {
                    bytes: rng.random_range(1..CLOSE_WITHIN_BYTES),
                }
            }
            _ => {
                pieces = rng.random_range(3..5);
                Fault::Early200ThenClose {
                    bytes: rng.random_range(1..CLOSE_WITHIN_BYTES),
                }
            }
        };
        faults += u64::from(fault != Fault::None);
        let closes = matches!(
            fault,
            Fault::CloseMidBody { .. } | Fault::Early200ThenClose { .. }
        );
        let pause = if closes {
            rng.random_range(60..120)
        } else {
            rng.random_range(20..80)
        };
        let put = Put::new(target, "proxy", &r, token)
            .fault(fault)
            .pieces(pieces, Duration::from_millis(pause));
        if closes {
            // A write that finds the resource busy (another write, or a quarantine) waits at
            // the proxy while its client sends the whole body; the proxy then forwards it in
            // one burst, and the close lands after the last byte was handed over (the limit in
            // `CLOSE_WITHIN_BYTES`). So a closing write goes alone, after any quarantine, and
            // its pieces reach the upstream one by one.
            for p in pending.drain(..) {
                writes.push(p.finish().await?);
            }
            tokio::time::sleep(Duration::from_millis(QUARANTINE_MS + 200)).await;
            writes.push(put.send().await);
        } else {
            pending.push(put.spawn(None));
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..150))).await;
    }
    for p in pending {
        writes.push(p.finish().await?);
    }
    probe_and_finish(&mut writes, &r, |_| target).await;
    let applied = applied_of(&upstream);
    Ok(RoundResult {
        writes,
        applied,
        faults,
    })
}
