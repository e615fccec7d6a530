//! `fence-gen`: the adversarial generator for the Postgres front end of fence-proxy.
//!
//! Each case takes a fresh resource `r`; a holder records token T through the proxy (fence
//! `r:T`, one INSERT); then an attacker session, built from random [`blocks::Block`]s and sent
//! as raw wire messages, tries to commit rows with fence `r:(T-1)` (or none, against a proxy
//! started with `--require-fence`). Every write inserts `(case_id, resource, token_claimed,
//! session_kind)` into a per-run data table. The oracle, run after each case from a direct
//! connection: under `--require-fence` no attacker row may be committed at all (the attacker never
//! holds a token >= T, or holds none); without it, no committed attacker row may claim a stale
//! token (rows written while the generator is unsure whether the fence was cleared claim -1 and
//! are not counted); and the fence table's token for `r` must still be at least T.
//!
//! Cases are seeded from `(seed, case_id)`, so a case replays identically with `--case N`,
//! whatever `--jobs`.
//!
//! # Layout
//! - [`blocks`]: the building blocks and what the generator believes about the fence.
//! - [`wire`]: the raw frontend that sends them.

pub mod blocks;
pub mod wire;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use tokio::sync::Semaphore;

use crate::pg;
use crate::process::{ChildGuard, command};
use blocks::{Block, Claim, Ctx, Step};
use wire::RawSession;

/// Longest a block may take to be answered before the session counts as stuck.
const STEP_TIMEOUT: Duration = Duration::from_secs(5);
/// Blocks per attacker session, at most.
const BLOCKS_MAX: usize = 6;
/// How long a started proxy may take to accept connections.
const PROXY_STARTUP: Duration = Duration::from_secs(20);

/// Which proxies the cases go to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FenceMode {
    /// Half the cases against a `--require-fence` proxy (attackers with or without a fence),
    /// half against a plain one (attackers with a stale fence).
    Both,
    RequireFence,
    Plain,
}

#[derive(Clone, Debug)]
pub struct Config {
    pub seed: u64,
    pub sessions: u64,
    pub jobs: usize,
    pub mode: FenceMode,
    /// The fence table the proxy is told to use (`--fence-table`); also read by the oracle.
    pub fence_table: String,
    /// Run `fence-proxy postgres init --upstream URL --fence-table NAME` first.
    pub init: bool,
    /// Run only this case (replay).
    pub only_case: Option<u64>,
    /// Attackers connect to Postgres directly instead of through the proxy: every write commits,
    /// which the oracle must flag (a self-test of the oracle).
    pub attack_directly: bool,
    /// Print each case's steps.
    pub verbose: bool,
}

impl Config {
    pub fn new(seed: u64, sessions: u64) -> Config {
        Config {
            seed,
            sessions,
            jobs: 4,
            mode: FenceMode::Both,
            fence_table: "public.lockd_fence".to_owned(),
            init: true,
            only_case: None,
            attack_directly: false,
            verbose: false,
        }
    }
}

/// One violation, with what is needed to replay it.
#[derive(Clone, Debug)]
pub struct Violation {
    pub case_id: u64,
    pub require_fence: bool,
    pub what: String,
    pub steps: Vec<Step>,
}

#[derive(Clone, Debug, Default)]
pub struct Summary {
    pub cases: u64,
    /// Cases that could not run (the holder's write failed, Postgres refused a connection).
    pub setup_failures: u64,
    /// ErrorResponse messages the attackers received (refusals are fine).
    pub errors_seen: u64,
    /// Sessions that stopped answering within the step timeout or were closed by the proxy.
    pub stuck_sessions: u64,
    pub steps_sent: u64,
    pub violations: Vec<Violation>,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} cases, {} messages sent, {} errors answered, {} stuck sessions, {} setup failures, {} violations",
            self.cases,
            self.steps_sent,
            self.errors_seen,
            self.stuck_sessions,
            self.setup_failures,
            self.violations.len()
        )
    }
}

/// A `fence-proxy postgres` child process.
struct Proxy {
    addr: SocketAddr,
    _child: ChildGuard,
}

impl Proxy {
    fn start(fence_table: &str, require_fence: bool) -> anyhow::Result<Proxy> {
        let addr: SocketAddr = format!("127.0.0.1:{}", pg::free_port()).parse()?;
        let mut cmd = command("fence-proxy");
        cmd.args(["postgres", "--listen", &addr.to_string()])
            .args(["--upstream", &pg::direct_url()])
            .args(["--fence-table", fence_table])
            .env("RUST_LOG", "error");
        if require_fence {
            cmd.arg("--require-fence");
        }
        let mut child = ChildGuard::spawn(format!("fence-proxy postgres {addr}"), cmd)?;
        let deadline = Instant::now() + PROXY_STARTUP;
        while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            if let Some(status) = child.try_wait() {
                anyhow::bail!("fence-proxy postgres exited at startup: {status}");
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "fence-proxy postgres did not listen on {addr} within {PROXY_STARTUP:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Proxy {
            addr,
            _child: child,
        })
    }
}

/// Names of one run's objects in the shared database.
struct RunObjects {
    data_table: String,
    write_fn: String,
    proc_name: String,
    gid_prefix: String,
}

async fn admin() -> anyhow::Result<tokio_postgres::Client> {
    let (client, conn) = tokio_postgres::connect(&pg::direct_url(), tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(client)
}

/// Runs the generator and returns its summary (violations included; never panics on them).
pub async fn run(cfg: Config) -> anyhow::Result<Summary> {
    pg::require_postgres();
    if cfg.init {
        let out = command("fence-proxy")
            .args(["postgres", "init", "--upstream", &pg::direct_url()])
            .args(["--fence-table", &cfg.fence_table])
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "fence-proxy postgres init failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let run_id = format!("fencegen_{:x}_{}", cfg.seed, std::process::id());
    let objects = Arc::new(RunObjects {
        data_table: format!("public.{run_id}_data"),
        write_fn: format!("public.{run_id}_write"),
        proc_name: format!("public.{run_id}_proc"),
        gid_prefix: run_id.clone(),
    });
    let db = admin().await?;
    db.batch_execute(&format!(
        "CREATE TABLE {d} (case_id bigint NOT NULL, resource text NOT NULL, \
           token_claimed bigint NOT NULL, session_kind text NOT NULL);
         CREATE FUNCTION {f}(c bigint, r text, t bigint, k text) RETURNS int LANGUAGE sql AS
           $$ INSERT INTO {d} VALUES (c, r, t, k); SELECT 1 $$;
         CREATE PROCEDURE {p}(c bigint, r text, t bigint) LANGUAGE plpgsql AS
           $$ BEGIN INSERT INTO {d} VALUES (c, r, t, 'attacker'); COMMIT;
                    INSERT INTO {d} VALUES (c, r, t, 'attacker'); END $$;
         CREATE FUNCTION {f}_check(v text) RETURNS bool LANGUAGE plpgsql AS
           $$ BEGIN INSERT INTO {d} VALUES (split_part(v, '|', 1)::bigint, split_part(v, '|', 2),
                      split_part(v, '|', 3)::bigint, 'attacker');
                    RETURN true; END $$;
         CREATE DOMAIN {f}_dom AS text CHECK ({f}_check(VALUE));",
        d = objects.data_table,
        f = objects.write_fn,
        p = objects.proc_name
    ))
    .await?;

    let db = Arc::new(db);
    let result = run_cases(&cfg, &run_id, objects.clone(), db.clone()).await;

    // Cleanup: prepared transactions of this run, then the run's objects.
    let leftover = db
        .query(
            "SELECT gid FROM pg_prepared_xacts WHERE gid LIKE $1",
            &[&format!("{}%", objects.gid_prefix)],
        )
        .await
        .unwrap_or_default();
    for row in leftover {
        let gid: String = row.get(0);
        let _ = db
            .batch_execute(&format!("ROLLBACK PREPARED '{gid}'"))
            .await;
    }
    let _ = db
        .batch_execute(&format!(
            "DROP PROCEDURE IF EXISTS {p}; DROP DOMAIN IF EXISTS {f}_dom; \
             DROP FUNCTION IF EXISTS {f}_check; DROP FUNCTION IF EXISTS {f}; \
             DROP TABLE IF EXISTS {d}",
            p = objects.proc_name,
            f = objects.write_fn,
            d = objects.data_table
        ))
        .await;
    result
}

async fn run_cases(
    cfg: &Config,
    run_id: &str,
    objects: Arc<RunObjects>,
    db: Arc<tokio_postgres::Client>,
) -> anyhow::Result<Summary> {
    let plain = match cfg.mode {
        FenceMode::RequireFence => None,
        _ => Some(Proxy::start(&cfg.fence_table, false)?),
    };
    let strict = match cfg.mode {
        FenceMode::Plain => None,
        _ => Some(Proxy::start(&cfg.fence_table, true)?),
    };
    let cases: Vec<u64> = match cfg.only_case {
        Some(c) => vec![c],
        None => (0..cfg.sessions).collect(),
    };
    let permits = Arc::new(Semaphore::new(cfg.jobs.max(1)));
    let mut tasks = Vec::new();
    for case_id in cases {
        let require_fence = match cfg.mode {
            FenceMode::RequireFence => true,
            FenceMode::Plain => false,
            FenceMode::Both => case_id % 2 == 1,
        };
        let proxy_addr = if require_fence {
            strict.as_ref().map(|p| p.addr)
        } else {
            plain.as_ref().map(|p| p.addr)
        }
        .expect("a proxy exists for every mode a case can take");
        let permit = permits.clone().acquire_owned().await?;
        let (cfg, objects, run_id) = (cfg.clone(), objects.clone(), run_id.to_owned());
        let db = db.clone();
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            run_case(
                &cfg,
                &run_id,
                &objects,
                &db,
                case_id,
                require_fence,
                proxy_addr,
            )
            .await
        }));
    }
    let mut summary = Summary::default();
    for task in tasks {
        let outcome = task.await?;
        summary.cases += 1;
        match outcome {
            Ok(case) => {
                summary.errors_seen += case.seen.errors;
                summary.stuck_sessions += u64::from(case.seen.stuck);
                summary.steps_sent += case.steps as u64;
                summary.violations.extend(case.violation);
            }
            Err(e) => {
                summary.setup_failures += 1;
                eprintln!("fence-gen: setup failure: {e:#}");
            }
        }
    }
    drop((plain, strict));
    Ok(summary)
}

struct CaseOutcome {
    seen: wire::Seen,
    steps: usize,
    violation: Option<Violation>,
}

/// The steps of one case, from its own seed: the same case replays identically.
pub fn case_steps(
    seed: u64,
    case_id: u64,
    resource: &str,
    holder_token: i64,
    start: Claim,
    names: (&str, &str, &str, &str, &str),
) -> Vec<Step> {
    let mut rng = StdRng::seed_from_u64(seed ^ case_id.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let blocks: Vec<Block> = (0..rng.random_range(1..=BLOCKS_MAX))
        .map(|_| blocks::ALL[rng.random_range(0..blocks::ALL.len())])
        .collect();
    let mut ctx = Ctx {
        rng: &mut rng,
        case_id: case_id as i64,
        resource,
        holder_token,
        data_table: names.0,
        write_fn: names.1,
        proc_name: names.2,
        fence_table_base: names.3,
        gid_prefix: names.4,
        claim: start,
        names: 0,
        steps: Vec::new(),
    };
    for b in blocks {
        b.generate(&mut ctx);
    }
    // Whatever was pipelined is synced at the end.
    ctx.steps.push(Step::Sync);
    ctx.steps
}

async fn run_case(
    cfg: &Config,
    run_id: &str,
    objects: &RunObjects,
    db: &tokio_postgres::Client,
    case_id: u64,
    require_fence: bool,
    proxy: SocketAddr,
) -> anyhow::Result<CaseOutcome> {
    let mut rng = StdRng::seed_from_u64(cfg.seed.wrapping_add(case_id));
    let resource = format!("{run_id}/{case_id}");
    let holder_token: i64 = rng.random_range(10..1_000_000_000);
    let unfenced = require_fence && rng.random_bool(0.5);
    let start = if unfenced {
        Claim::Unfenced
    } else {
        Claim::Stale(holder_token - 1)
    };

    // Phase 1: the holder records T through the proxy.
    let mut holder_cfg: tokio_postgres::Config =
        format!("postgres://{}@{}/{}", pg::PG_USER, proxy, pg::PG_DATABASE).parse()?;
    holder_cfg.options(format!("-c lockd.fence={resource}:{holder_token}"));
    let (holder, conn) = holder_cfg.connect(tokio_postgres::NoTls).await?;
    let conn = tokio::spawn(conn);
    holder
        .batch_execute(&format!(
            "INSERT INTO {} VALUES ({case_id}, '{resource}', {holder_token}, 'holder')",
            objects.data_table
        ))
        .await
        .map_err(|e| anyhow::anyhow!("the holder's write through the proxy failed: {e}"))?;
    drop(holder);
    let _ = conn.await;
    let recorded = fence_token(db, &cfg.fence_table, &resource).await?;
    anyhow::ensure!(
        recorded == Some(holder_token),
        "the holder's token {holder_token} for {resource:?} was not recorded in {} (found {recorded:?})",
        cfg.fence_table
    );

    // Phase 2: the attacker.
    let base = cfg
        .fence_table
        .rsplit('.')
        .next()
        .unwrap_or(&cfg.fence_table)
        .to_owned();
    let steps = case_steps(
        cfg.seed,
        case_id,
        &resource,
        holder_token,
        start,
        (
            &objects.data_table,
            &objects.write_fn,
            &objects.proc_name,
            &base,
            &objects.gid_prefix,
        ),
    );
    if cfg.verbose {
        eprintln!("case {case_id} (require_fence {require_fence}, start {start:?}): {steps:#?}");
    }
    let target = if cfg.attack_directly {
        format!("{}:{}", pg::PG_HOST, pg::PG_PORT)
    } else {
        proxy.to_string()
    };
    let fence = format!("-c lockd.fence={resource}:{}", holder_token - 1);
    let mut params = vec![("user", pg::PG_USER), ("database", pg::PG_DATABASE)];
    if !unfenced {
        params.push(("options", fence.as_str()));
    }
    let mut session = RawSession::connect(&target, &params, STEP_TIMEOUT).await?;
    // Steps are sent up to each Query or Sync, then answered, as a client would.
    let mut from = 0;
    for (i, step) in steps.iter().enumerate() {
        let boundary = matches!(step, Step::Query(_) | Step::Sync)
            && !matches!(steps.get(i + 1), Some(Step::CopyData(_)));
        let copy_end = matches!(step, Step::CopyDone);
        if boundary || copy_end || i + 1 == steps.len() {
            session.send(&steps[from..=i], STEP_TIMEOUT).await?;
            from = i + 1;
            if session.seen.stuck {
                break;
            }
        }
    }
    let seen = session.seen;
    session.terminate().await;

    // Phase 3: the oracle.
    let rows = db
        .query(
            &format!(
                "SELECT token_claimed, count(*) FROM {} WHERE case_id = $1 AND resource = $2 \
                 AND session_kind = 'attacker' GROUP BY 1 ORDER BY 1",
                objects.data_table
            ),
            &[&(case_id as i64), &resource],
        )
        .await?;
    let committed: Vec<(i64, i64)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let forbidden: Vec<(i64, i64)> = committed
        .iter()
        .copied()
        .filter(|(claimed, _)| require_fence || *claimed > 0)
        .collect();
    let after = fence_token(db, &cfg.fence_table, &resource).await?;
    let mut what = Vec::new();
    if !forbidden.is_empty() {
        what.push(format!(
            "committed attacker rows (token_claimed, count) {forbidden:?} with T = {holder_token}{}",
            if require_fence {
                " under --require-fence"
            } else {
                ""
            }
        ));
    }
    if after.is_none_or(|t| t < holder_token) {
        what.push(format!(
            "fence token of {resource:?} went from {holder_token} to {after:?}"
        ));
    }
    let violation = (!what.is_empty()).then(|| Violation {
        case_id,
        require_fence,
        what: what.join("; "),
        steps: steps.clone(),
    });
    Ok(CaseOutcome {
        seen,
        steps: steps.len(),
        violation,
    })
}

async fn fence_token(
    db: &tokio_postgres::Client,
    table: &str,
    resource: &str,
) -> anyhow::Result<Option<i64>> {
    let row = db
        .query_opt(
            &format!("SELECT token FROM {table} WHERE resource = $1"),
            &[&resource],
        )
        .await?;
    Ok(row.map(|r| r.get(0)))
}

/// Prints a violation so that it can be replayed: the command and the exact messages.
pub fn report(seed: u64, v: &Violation) -> String {
    let mut s = format!(
        "VIOLATION seed {seed} case {} (require_fence {}): {}\n  replay: cargo run -p lockd-tests --bin fence-gen -- --seed {seed} --case {}{}\n  messages:\n",
        v.case_id,
        v.require_fence,
        v.what,
        v.case_id,
        if v.require_fence {
            " --require-fence"
        } else {
            " --no-require-fence"
        }
    );
    for step in &v.steps {
        s.push_str(&format!("    {step:?}\n"));
    }
    s
}
