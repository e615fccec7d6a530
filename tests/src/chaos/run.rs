//! One chaos run from start to verdict: cluster, targets, workers and nemesis for the configured
//! time, then faults lifted, liveness probed, logs collected and the history checked.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use lockd_api::v1::lock_client::LockClient;
use lockd_api::v1::{AcquireRequest, ReleaseRequest};
use tokio_util::sync::CancellationToken;

use super::checker::{
    self, Applied, AuditLine, AvailabilityInput, CheckInput, Gap, Liveness, Violation,
};
use super::clock::{ClockMode, FakeClocks, MAX_RATE_ERROR_PCT};
use super::cluster::{ChaosCluster, NODES, Timings, client_channel, start_http_proxy};
use super::history::{History, OpKind, Outcome};
use super::linearizable::{self, LinReport};
use super::nemesis::{ALL, COMPOSED, Fault, MAX_CLOCK_OFFSET_MS, NETNS, Nemesis, run_clock_steps};
use super::register::Register;
use super::workload::{self, Endpoints, MAX_TTL_MS, MAX_WAIT_MS, Mode, PgTarget, Worker};

/// Liveness bound, from the moment faults stopped and clients stopped: a restarted node starts
/// and an election completes (6 s: start-up plus up to two randomised election timeouts of
/// 0.6-1.2 s and a commit), then a lease left by a stopped client runs out: one ttl, plus one more
/// ttl because a new term extends every lease (conservative failover), plus a queued waiter whose
/// caller vanished (its wait, then one unrenewed ttl), plus the largest clock offset (a leader
/// whose clock is behind holds the table clock back by that much).
pub const LIVENESS_BOUND: Duration = Duration::from_millis(
    6_000 + 2 * MAX_TTL_MS + (MAX_WAIT_MS + MAX_TTL_MS) + MAX_CLOCK_OFFSET_MS as u64,
);

/// [`LIVENESS_BOUND`] when clocks may run `rate_error_pct` % slow: its timed parts (election
/// timeouts and lease ttls, all but the clock offset) last up to `1 / (1 - rate)` times longer.
pub fn liveness_bound(rate_error_pct: u64) -> Duration {
    let timed = LIVENESS_BOUND.as_millis() as u64 - MAX_CLOCK_OFFSET_MS as u64;
    let extra = (timed * rate_error_pct).div_ceil(100 - rate_error_pct.min(99));
    LIVENESS_BOUND + Duration::from_millis(extra)
}
/// How long stopped workers may take to finish their current operation.
const WORKER_STOP_WAIT: Duration = Duration::from_secs(20);
/// Port of the run's `fence-proxy postgres`, on the run's own harness IP (so that runs going on
/// at once never race for an ephemeral port).
const PG_PROXY_PORT: u16 = 6432;

#[derive(Clone, Debug)]
pub struct RunConfig {
    pub seed: u64,
    pub duration: Duration,
    pub workers: usize,
    pub resources: usize,
    pub mode: Mode,
    /// Also write to a Postgres table through `fence-proxy postgres`.
    pub postgres: bool,
    /// Forces the first fault (the broken-mode test starts with a client pause).
    pub first_fault: Option<Fault>,
    /// The fault kinds the nemesis draws from.
    pub faults: Vec<Fault>,
    /// The nodes run with TLS (certificates of a CA made for the run) and clients use it.
    pub tls: bool,
    /// Clock faults made with libfaketime (`--clock`, `--clock-rate`).
    pub clock: Option<ClockMode>,
    /// Each node in a network namespace of its own, partitions made in the kernel (`--netns`).
    pub netns: bool,
}

impl RunConfig {
    pub fn short(seed: u64) -> RunConfig {
        RunConfig {
            seed,
            duration: Duration::from_secs(60),
            workers: 6,
            resources: 3,
            mode: Mode::Correct,
            postgres: true,
            first_fault: None,
            faults: ALL.to_vec(),
            tls: false,
            clock: None,
            netns: false,
        }
    }

    /// The faults a run draws from unless told (`--faults`): the single ones, the composed ones
    /// with `--composed`, the namespace-only ones with `--netns`.
    pub fn default_faults(composed: bool, netns: bool) -> Vec<Fault> {
        let mut f = ALL.to_vec();
        if composed {
            f.extend(COMPOSED);
        }
        if netns {
            f.extend(NETNS);
        }
        f
    }

    /// Whether the nemesis may compose faults (the cluster then snapshots often).
    pub fn composed(&self) -> bool {
        self.faults.iter().any(|f| COMPOSED.contains(f))
    }

    /// The bound on clock rates the checks allow for, percent.
    pub fn rate_error_pct(&self) -> u64 {
        if self.clock == Some(ClockMode::Rates) {
            MAX_RATE_ERROR_PCT
        } else {
            0
        }
    }

    /// The command that reruns this configuration.
    pub fn rerun_command(&self) -> String {
        let mut c = format!(
            "cargo run -p lockd-tests --bin chaos -- --seed {} --duration {}s --workers {} --resources {}",
            self.seed,
            self.duration.as_secs(),
            self.workers,
            self.resources
        );
        if let Some(name) = self.mode.broken_name() {
            c.push_str(&format!(" --broken {name}"));
        }
        if !self.postgres {
            c.push_str(" --no-postgres");
        }
        if self.netns {
            c.push_str(" --netns");
        }
        if self.faults == Self::default_faults(true, self.netns) {
            c.push_str(" --composed");
        } else if self.faults != Self::default_faults(false, self.netns) {
            let names: Vec<String> = self.faults.iter().map(|f| format!("{f:?}")).collect();
            c.push_str(&format!(" --faults {}", names.join(",")));
        }
        if let Some(m) = self.clock {
            c.push(' ');
            c.push_str(m.flag());
        }
        if let Some(f) = self.first_fault {
            c.push_str(&format!(" --first-fault {f:?}"));
        }
        if self.tls {
            c.push_str(" --tls");
        }
        c
    }
}

#[derive(Debug)]
pub struct RunReport {
    pub config: RunConfig,
    pub violations: Vec<Violation>,
    /// History, audit logs and the verdict of the run.
    pub artifacts: PathBuf,
    pub faults: Vec<Fault>,
    pub ops: usize,
    pub grants: usize,
    pub writes_ok: usize,
    pub writes_refused: usize,
    pub unknown: usize,
    /// `Describe` calls answered.
    pub describes: usize,
    pub liveness: Vec<Liveness>,
    /// The linearizability check of the lock operations (its violations are in `violations`).
    pub lin: LinReport,
    /// Runtime wall-clock offset changes, and clock rates drawn at node starts.
    pub clock_steps: u64,
    pub clock_rates: u64,
    /// Windows (history ms) in which the nemesis left no quorum possible.
    pub no_quorum: Vec<(u64, u64)>,
    /// The longest stretch without a definite answer outside those windows.
    pub longest_gap: Gap,
    /// From start-up to verdict.
    pub elapsed: Duration,
}

impl RunReport {
    pub fn summary(&self) -> String {
        let mut s = format!(
            "chaos seed {} ({:?}, {:?}{}{}{}): {} ops, {} grants, {} describes, {} fenced writes acknowledged, {} refused, {} unknown outcomes; faults {:?}; clock offset steps {}, clock rates drawn {}; no-quorum windows {:?} ms; longest silence with a quorum possible {} ms from {} ms; liveness {:?}; {:.0?} in all; artifacts {}\n{}\n",
            self.config.seed,
            self.config.duration,
            self.config.mode,
            if self.config.tls { ", tls" } else { "" },
            if self.config.netns { ", netns" } else { "" },
            self.config
                .clock
                .map(|m| format!(", {}", m.flag()))
                .unwrap_or_default(),
            self.ops,
            self.grants,
            self.describes,
            self.writes_ok,
            self.writes_refused,
            self.unknown,
            self.faults,
            self.clock_steps,
            self.clock_rates,
            self.no_quorum,
            self.longest_gap.len_ms,
            self.longest_gap.from_ms,
            self.liveness
                .iter()
                .map(|l| l.acquired_after_ms)
                .collect::<Vec<_>>(),
            self.elapsed,
            self.artifacts.display(),
            self.lin.summary()
        );
        if self.violations.is_empty() {
            s.push_str("no violations\n");
        } else {
            s.push_str(&format!("{} VIOLATIONS:\n", self.violations.len()));
            for v in self.violations.iter().take(30) {
                s.push_str(&format!("  {v}\n"));
            }
            s.push_str(&format!(
                "seed {}; rerun with: {}\n",
                self.config.seed,
                self.config.rerun_command()
            ));
        }
        s
    }
}

/// A new artifacts folder for a run of `seed`, in `parent` (the system's temporary folder when
/// `None`); kept until the caller deletes it.
pub fn artifacts_dir(seed: u64, parent: Option<&std::path::Path>) -> anyhow::Result<PathBuf> {
    let mut b = tempfile::Builder::new();
    let prefix = format!("lockd-chaos-{seed}-");
    b.prefix(&prefix);
    let dir = match parent {
        Some(p) => {
            std::fs::create_dir_all(p)
                .map_err(|e| anyhow::anyhow!("creating artifacts folder {}: {e}", p.display()))?;
            b.tempdir_in(p)?
        }
        None => b.tempdir()?,
    };
    Ok(dir.keep())
}

/// Runs one chaos run. Errors are harness failures (a process would not start); invariant
/// violations are in the report.
pub async fn run(config: RunConfig) -> anyhow::Result<RunReport> {
    let artifacts = artifacts_dir(config.seed, None)?;
    run_in(config, artifacts).await
}

/// [`run`], with its artifacts (history, logs, node data dirs, verdict) in `artifacts`.
pub async fn run_in(config: RunConfig, artifacts: PathBuf) -> anyhow::Result<RunReport> {
    let started = Instant::now();
    let run_id = format!("c{:x}", config.seed);
    let unique = crate::pg::unique_name("chaos");
    // From here on: the history's clock (the cluster notes quorum windows and clock draws in it).
    let history = History::new(Instant::now());
    let clocks = match config.clock {
        Some(mode) => Some(Arc::new(FakeClocks::new(
            &artifacts,
            mode,
            config.mode.breaks_clocks(),
            config.seed,
            NODES,
        )?)),
        None => None,
    };
    if let Some(c) = clocks.as_ref().filter(|c| c.mode == ClockMode::Offsets) {
        history.note(
            "clock",
            format!("wall-clock offsets at start (s): {:?}", c.offsets_s()),
        );
    }
    let timings = if config.composed() {
        Timings::frequent_snapshots()
    } else {
        Timings::default()
    };
    let mut cluster = ChaosCluster::start(
        artifacts.clone(),
        timings,
        config.tls,
        clocks.clone(),
        history.clone(),
        config.netns,
    )
    .await?;
    let register = Register::start(cluster.harness_ip()).await?;
    let proxy_addr = std::net::SocketAddr::new(cluster.harness_ip(), 8080);
    let _http_proxy = start_http_proxy(proxy_addr, register.addr, &artifacts)?;
    let pg_listen = std::net::SocketAddr::new(cluster.harness_ip(), PG_PROXY_PORT);
    let (pg_proxy, pg_target) = if config.postgres {
        crate::pg::require_postgres();
        let direct: tokio_postgres::Config = crate::pg::direct_url().parse()?;
        let admin = workload_connect(&direct).await?;
        admin
            .batch_execute(&format!(
                "CREATE TABLE {unique} (id bigserial primary key, resource text not null, token bigint not null, value text not null)"
            ))
            .await?;
        let mut args =
            crate::pg::proxy_args(crate::pg::direct_url(), crate::pg::fence_table(), false);
        args.listen = pg_listen;
        let proxy = crate::pg::PgProxy::try_start_args(args)?;
        let target = PgTarget {
            proxy: proxy.config(None),
            direct,
            table: unique.clone(),
        };
        (Some((proxy, admin)), Some(target))
    } else {
        (None, None)
    };
    let endpoints = Endpoints {
        nodes: (1..=NODES).map(|i| cluster.addr(i)).collect(),
        relays: (1..=NODES).map(|i| cluster.client_relay_addr(i)).collect(),
        http_proxy: proxy_addr,
        register: register.addr,
        pg: pg_target,
        ca_pem: cluster.client_ca(),
    };
    // Resource names are unique per run: the Postgres fence table is shared with other suites.
    let resources: Vec<String> = (0..config.resources)
        .map(|i| format!("{unique}/r{i}"))
        .collect();
    let stop = CancellationToken::new();
    // A run abandoned midway (`chaos --runs` bounds each run) must not leave workers running.
    let _stop_workers_when_dropped = stop.clone().drop_guard();
    let mut pauses: Vec<Arc<AtomicBool>> = Vec::new();
    let mut handles = Vec::new();
    for id in 0..config.workers {
        let w = Worker::new(
            id,
            config.seed,
            run_id.clone(),
            resources.clone(),
            endpoints.clone(),
            history.clone(),
            config.mode,
            stop.clone(),
        );
        pauses.push(w.pause_next.clone());
        handles.push(tokio::spawn(w.run()));
    }

    let mut nemesis = Nemesis::new(config.seed, config.faults.clone(), history.clone(), pauses);
    nemesis.long_outages = config.mode == Mode::HiddenOutage;
    let faults_from_ms = history.now_ms();
    let until = Instant::now() + config.duration;
    let clock_steps = clocks
        .clone()
        .filter(|c| c.mode == ClockMode::Offsets)
        .map(|c| tokio::spawn(run_clock_steps(c, history.clone(), until)));
    let nemesis_result = nemesis.run(&mut cluster, until, config.first_fault).await;
    let clock_result = match clock_steps {
        Some(task) => task.await?,
        None => Ok(()),
    };
    cluster.heal_all()?;
    let faults_to_ms = history.now_ms();
    history.note("nemesis", "faults stopped");
    stop.cancel();
    let stopped_by = Instant::now() + WORKER_STOP_WAIT;
    for h in handles {
        let left = stopped_by.saturating_duration_since(Instant::now());
        if tokio::time::timeout(left, h).await.is_err() {
            history.note("harness", "a worker did not stop in time (aborted)");
        }
    }
    nemesis_result?;
    clock_result?;
    history.note("harness", "clients stopped; probing liveness");

    let quiet = Instant::now();
    let probes = resources.iter().map(|r| {
        probe_liveness(
            r.clone(),
            endpoints.nodes.clone(),
            endpoints.ca_pem.clone(),
            history.clone(),
            quiet,
            run_id.clone(),
            liveness_bound(config.rate_error_pct()),
        )
    });
    let liveness = futures::future::join_all(probes).await;

    let converged = cluster.wait_converged(Duration::from_secs(20)).await;
    cluster.stop_all();
    let mut audit = Vec::new();
    for id in 1..=NODES {
        let text = std::fs::read_to_string(cluster.audit_path(id)).unwrap_or_default();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            audit.push(serde_json::from_str::<AuditLine>(line)?);
        }
    }
    let http_applied = register.applied();
    let pg_applied = match &pg_proxy {
        Some((_, admin)) => {
            let rows = admin
                .query(
                    &format!("SELECT resource, token, value FROM {unique} ORDER BY id"),
                    &[],
                )
                .await?;
            admin.batch_execute(&format!("DROP TABLE {unique}")).await?;
            Some(
                rows.iter()
                    .map(|r| Applied {
                        resource: r.get(0),
                        token: r.get::<_, i64>(1) as u64,
                        value: r.get(2),
                    })
                    .collect(),
            )
        }
        None => None,
    };
    drop(pg_proxy);

    let ops = history.snapshot();
    // The audit log names requests by digest only: map them back to the ids the workers sent.
    let ids: std::collections::HashMap<String, String> = ops
        .iter()
        .filter_map(|o| match &o.kind {
            OpKind::Acquire { request_id, .. } => Some(request_id.clone()),
            _ => None,
        })
        .map(|id| (crate::audit::request_digest(&id), id))
        .collect();
    for line in &mut audit {
        if let Some(id) = ids.get(&line.request_digest) {
            line.request_id = id.clone();
        }
    }
    let no_quorum = cluster.no_quorum_windows();
    let availability = AvailabilityInput {
        from_ms: faults_from_ms,
        to_ms: faults_to_ms,
        // The broken mode keeps the checker from knowing its long outages.
        no_quorum: if config.mode == Mode::HiddenOutage {
            Vec::new()
        } else {
            no_quorum.clone()
        },
    };
    let (_, longest_gap) = checker::check_availability(&ops, &availability);
    let rate_error_pct = config.rate_error_pct();
    let input = CheckInput {
        ops: ops.clone(),
        audit,
        http_applied,
        pg_applied,
        liveness: liveness.clone(),
        availability: Some(availability),
        rate_error_pct,
    };
    let mut violations = checker::check(&input);
    let lin = if rate_error_pct > 0 {
        linearizable::check(
            &checker::with_rate_margin(&ops, rate_error_pct),
            linearizable::STEP_BUDGET,
        )
    } else {
        linearizable::check(&ops, linearizable::STEP_BUDGET)
    };
    violations.extend(lin.violations());
    if let Err(e) = converged {
        violations.push(Violation {
            check: "liveness",
            detail: format!("replicas did not converge after the faults stopped: {e}"),
        });
    }
    let count = |f: &dyn Fn(&OpKind, &Outcome) -> bool| {
        ops.iter()
            .filter(|o| f(&o.kind, o.outcome.as_ref().unwrap()))
            .count()
    };
    let report = RunReport {
        violations,
        artifacts: artifacts.clone(),
        faults: nemesis.injected.clone(),
        ops: ops.len(),
        grants: count(&|k, o| {
            matches!(k, OpKind::Acquire { .. }) && matches!(o, Outcome::Granted { .. })
        }),
        writes_ok: count(&|k, o| matches!(k, OpKind::Write { .. }) && o.is_ok()),
        writes_refused: count(&|k, o| {
            matches!(k, OpKind::Write { .. }) && matches!(o, Outcome::Fail { .. })
        }),
        unknown: count(&|_, o| matches!(o, Outcome::Unknown { .. })),
        describes: count(&|_, o| matches!(o, Outcome::Described { .. })),
        liveness,
        lin,
        clock_steps: clocks.as_ref().map(|c| c.counts().0).unwrap_or(0),
        clock_rates: clocks.as_ref().map(|c| c.counts().1).unwrap_or(0),
        no_quorum,
        longest_gap,
        elapsed: started.elapsed(),
        config,
    };
    write_artifacts(&report, &input)?;
    Ok(report)
}

fn write_artifacts(report: &RunReport, input: &CheckInput) -> anyhow::Result<()> {
    use std::io::Write;
    let mut h = std::io::BufWriter::new(std::fs::File::create(
        report.artifacts.join("history.jsonl"),
    )?);
    for op in &input.ops {
        writeln!(h, "{}", serde_json::to_string(op)?)?;
    }
    let mut a = std::io::BufWriter::new(std::fs::File::create(
        report.artifacts.join("applied.jsonl"),
    )?);
    for x in &input.http_applied {
        writeln!(a, "{}", serde_json::json!({"target": "http", "write": x}))?;
    }
    for x in input.pg_applied.iter().flatten() {
        writeln!(
            a,
            "{}",
            serde_json::json!({"target": "postgres", "write": x})
        )?;
    }
    std::fs::write(report.artifacts.join("verdict.txt"), report.summary())?;
    Ok(())
}

async fn workload_connect(
    config: &tokio_postgres::Config,
) -> anyhow::Result<tokio_postgres::Client> {
    let (client, conn) = config.connect(tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(client)
}

/// Acquires `resource` (waiting, retrying with one request id while the outcome is unknown) and
/// releases it; reports how long after `since` the grant came.
async fn probe_liveness(
    resource: String,
    nodes: Vec<std::net::SocketAddr>,
    ca_pem: Option<Vec<u8>>,
    history: History,
    since: Instant,
    run_id: String,
    bound: Duration,
) -> Liveness {
    let mut request_id = format!("{run_id}-liveness-{resource}");
    let mut attempt = 0u32;
    while since.elapsed() < bound {
        attempt += 1;
        let node = nodes[attempt as usize % nodes.len()];
        let ch = client_channel(node, ca_pem.as_deref());
        let wait_ms = 2_000;
        let op = history.invoke(
            "liveness",
            OpKind::Acquire {
                resource: resource.clone(),
                request_id: request_id.clone(),
                ttl_ms: 5_000,
                wait_ms,
                attempt,
                via: node.to_string(),
            },
        );
        let req = AcquireRequest {
            resource: resource.clone(),
            request_id: request_id.clone(),
            lease_ttl_ms: 5_000,
            wait_timeout_ms: wait_ms,
            holder: "liveness".into(),
        };
        let mut client = LockClient::new(ch);
        let outcome =
            match tokio::time::timeout(Duration::from_millis(wait_ms + 3_000), client.acquire(req))
                .await
            {
                Ok(Ok(r)) => {
                    let r = r.into_inner();
                    Outcome::Granted {
                        lease_id: r.lease_id,
                        token: r.fencing_token,
                    }
                }
                Ok(Err(s)) => workload::classify(&s),
                Err(_) => Outcome::Unknown {
                    reason: "no answer".into(),
                },
            };
        history.complete(op, outcome.clone());
        match outcome {
            Outcome::Granted { lease_id, token } => {
                let after = since.elapsed().as_millis() as u64;
                let rel = history.invoke(
                    "liveness",
                    OpKind::Release {
                        resource: resource.clone(),
                        lease_id: lease_id.clone(),
                        token,
                    },
                );
                let r = tokio::time::timeout(
                    Duration::from_secs(5),
                    client.release(ReleaseRequest {
                        resource: resource.clone(),
                        lease_id,
                    }),
                )
                .await;
                let o = match r {
                    Ok(Ok(r)) => Outcome::Done {
                        released: Some(r.into_inner().released),
                    },
                    Ok(Err(s)) => workload::classify(&s),
                    Err(_) => Outcome::Unknown {
                        reason: "no answer".into(),
                    },
                };
                history.complete(rel, o);
                return Liveness {
                    resource,
                    acquired_after_ms: Some(after),
                    bound_ms: bound.as_millis() as u64,
                };
            }
            // A waited-out attempt is a final "not this time": the next one needs a new id.
            Outcome::Fail { .. } => request_id = format!("{run_id}-liveness-{resource}-{attempt}"),
            Outcome::Unknown { .. } | Outcome::Done { .. } | Outcome::Described { .. } => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
        }
    }
    Liveness {
        resource,
        acquired_after_ms: None,
        bound_ms: bound.as_millis() as u64,
    }
}
