//! The Postgres scenarios: `fence-proxy postgres` killed inside fenced transactions, two proxies
//! on one fence table, and the Postgres behind the proxy crashing during fenced transactions.
//!
//! Every write is one transaction `BEGIN; INSERT ...; COMMIT` in a session fenced at startup
//! (`-c lockd.fence=<resource>:<token>`). The row's deferred trigger runs inside COMMIT: it
//! sleeps as long as the row asks (a slow COMMIT, to kill something during it) and numbers the
//! row from a sequence, so that the committed rows can be read back in commit order.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rand::RngExt;
use rand::rngs::StdRng;
use tokio::sync::oneshot;

use super::{Applied, Outcome, RoundResult, Write, next_write_id, race_tokens, resource_name};
use crate::pg;
use crate::process::{ChildGuard, command};

/// How long a started proxy may take to accept connections.
const PROXY_STARTUP: Duration = Duration::from_secs(20);
/// Longest one statement of a writer may take before its outcome counts as unknown.
const STEP_TIMEOUT: Duration = Duration::from_secs(15);
/// SQLSTATE of the guard's refusal of a stale token.
const STALE_SQLSTATE: &str = "55P03";

/// A `fence-proxy postgres` child process that can be killed and started again on its address.
pub struct PgProxyProcess {
    pub addr: SocketAddr,
    upstream: String,
    fence_table: String,
    child: Option<ChildGuard>,
}

impl PgProxyProcess {
    pub fn start(upstream: &str, fence_table: &str) -> anyhow::Result<PgProxyProcess> {
        let mut p = PgProxyProcess {
            addr: format!("127.0.0.1:{}", pg::free_port()).parse()?,
            upstream: upstream.to_owned(),
            fence_table: fence_table.to_owned(),
            child: None,
        };
        p.restart()?;
        Ok(p)
    }

    /// kill -9.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill();
        }
    }

    /// Starts the process (again) with the same flags and address, and waits until it accepts.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        let mut cmd = command("fence-proxy");
        cmd.args(["postgres", "--listen", &self.addr.to_string()])
            .args(["--upstream", &self.upstream])
            .args(["--fence-table", &self.fence_table])
            .args(["--threads", "1"])
            .env("RUST_LOG", "error");
        let mut child = ChildGuard::spawn(format!("fence-proxy postgres {}", self.addr), cmd)?;
        let deadline = Instant::now() + PROXY_STARTUP;
        while std::net::TcpStream::connect_timeout(&self.addr, Duration::from_millis(200)).is_err()
        {
            if let Some(status) = child.try_wait() {
                anyhow::bail!("fence-proxy postgres exited at startup: {status}");
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "fence-proxy postgres did not accept on {} within {PROXY_STARTUP:?}",
                self.addr
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.child = Some(child);
        Ok(())
    }
}

/// The data table of one round: rows carry their write's id and token, and are numbered at
/// commit time by a deferred trigger (which also sleeps as the row asks).
struct DataTable {
    name: String,
}

impl DataTable {
    async fn create(direct: &tokio_postgres::Client) -> anyhow::Result<DataTable> {
        let t = pg::unique_name("ff_data");
        direct
            .batch_execute(&format!(
                "CREATE TABLE {t} (id bigserial PRIMARY KEY, resource text NOT NULL, \
                   token bigint NOT NULL, write_id bigint NOT NULL, \
                   commit_sleep_ms int NOT NULL DEFAULT 0, commit_seq bigint);
                 CREATE SEQUENCE {t}_seq;
                 CREATE FUNCTION {t}_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
                 BEGIN
                   PERFORM pg_sleep(NEW.commit_sleep_ms / 1000.0);
                   UPDATE {t} SET commit_seq = nextval('{t}_seq') WHERE id = NEW.id;
                   RETURN NULL;
                 END $$;
                 CREATE CONSTRAINT TRIGGER {t}_commit AFTER INSERT ON {t}
                   DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {t}_at_commit();"
            ))
            .await?;
        Ok(DataTable { name: t })
    }

    /// Committed rows in commit order, and the fence table's records of their resources.
    async fn applied(
        &self,
        direct: &tokio_postgres::Client,
        fence_table: &str,
    ) -> anyhow::Result<Applied> {
        let mut a = Applied::default();
        let rows = direct
            .query(
                &format!(
                    "SELECT resource, write_id, token FROM {} ORDER BY commit_seq NULLS FIRST, id",
                    self.name
                ),
                &[],
            )
            .await?;
        for row in rows {
            let (r, id, token): (String, i64, i64) = (row.get(0), row.get(1), row.get(2));
            a.order
                .entry(r)
                .or_default()
                .push((id as u64, token as u64));
        }
        let resources: Vec<String> = a.order.keys().cloned().collect();
        for r in resources {
            let rec = direct
                .query_opt(
                    &format!("SELECT token FROM {fence_table} WHERE resource = $1"),
                    &[&r],
                )
                .await?;
            if let Some(row) = rec {
                a.records.insert(r, row.get::<_, i64>(0) as u64);
            }
        }
        Ok(a)
    }

    async fn drop_now(&self, direct: &tokio_postgres::Client) {
        let t = &self.name;
        let _ = direct
            .batch_execute(&format!(
                "DROP TABLE IF EXISTS {t}; DROP SEQUENCE IF EXISTS {t}_seq; \
                 DROP FUNCTION IF EXISTS {t}_at_commit()"
            ))
            .await;
    }
}

/// One fenced transaction.
#[derive(Clone)]
struct PgWrite {
    /// Where to connect (a proxy, or Postgres itself with `--bypass`), user and password included.
    url: String,
    via: String,
    table: String,
    resource: String,
    token: u64,
    commit_sleep_ms: u32,
}

/// Hooks to time a fault inside one transaction.
#[derive(Default)]
struct Hooks {
    /// Told when the INSERT is done and COMMIT is about to be sent.
    inserted: Option<oneshot::Sender<()>>,
    /// Waited for before COMMIT is sent.
    go: Option<oneshot::Receiver<()>>,
}

impl PgWrite {
    fn spawn(self, hooks: Hooks) -> Pending {
        Pending {
            handle: tokio::spawn(self.run(next_write_id(), hooks)),
        }
    }

    async fn send(self) -> Write {
        self.run(next_write_id(), Hooks::default()).await
    }

    async fn run(self, id: u64, mut hooks: Hooks) -> Write {
        let started = Instant::now();
        let outcome = self.transaction(id, &mut hooks).await;
        Write {
            id,
            resource: self.resource,
            token: self.token,
            via: self.via,
            started,
            ended: Instant::now(),
            outcome,
            must_refuse: false,
        }
    }

    async fn transaction(&self, id: u64, hooks: &mut Hooks) -> Outcome {
        let not_done =
            |what: &str, e: &dyn std::fmt::Display| Outcome::NotDone(format!("{what}: {e}"));
        let mut config: tokio_postgres::Config = match self.url.parse() {
            Ok(c) => c,
            Err(e) => return not_done("url", &e),
        };
        config
            .options(format!("-c lockd.fence={}:{}", self.resource, self.token))
            .connect_timeout(Duration::from_secs(5));
        let client =
            match tokio::time::timeout(STEP_TIMEOUT, config.connect(tokio_postgres::NoTls)).await {
                Ok(Ok((client, conn))) => {
                    tokio::spawn(async move {
                        let _ = conn.await;
                    });
                    client
                }
                Ok(Err(e)) => return not_done("connect", &e),
                Err(_) => return Outcome::NotDone("connect timed out".into()),
            };
        // Before COMMIT is sent nothing can commit: any error there means "not done".
        let insert = format!(
            "INSERT INTO {} (resource, token, write_id, commit_sleep_ms) VALUES ('{}', {}, {id}, {})",
            self.table, self.resource, self.token, self.commit_sleep_ms
        );
        for sql in ["BEGIN", insert.as_str()] {
            match tokio::time::timeout(STEP_TIMEOUT, client.batch_execute(sql)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) if sqlstate(&e) == Some(STALE_SQLSTATE) => return Outcome::Stale,
                Ok(Err(e)) => return not_done(sql.split(' ').next().unwrap_or(sql), &e),
                Err(_) => return Outcome::NotDone(format!("{sql}: timed out")),
            }
        }
        if let Some(tx) = hooks.inserted.take() {
            let _ = tx.send(());
        }
        if let Some(rx) = hooks.go.take() {
            let _ = rx.await;
        }
        match tokio::time::timeout(STEP_TIMEOUT, client.batch_execute("COMMIT")).await {
            Ok(Ok(())) => Outcome::Acked,
            Ok(Err(e)) if sqlstate(&e) == Some(STALE_SQLSTATE) => Outcome::Stale,
            Ok(Err(e)) => Outcome::Unknown(format!("COMMIT: {e}")),
            Err(_) => Outcome::Unknown("COMMIT timed out".into()),
        }
    }
}

fn sqlstate(e: &tokio_postgres::Error) -> Option<&str> {
    e.code().map(|c| c.code())
}

struct Pending {
    handle: tokio::task::JoinHandle<Write>,
}

impl Pending {
    async fn finish(self) -> anyhow::Result<Write> {
        Ok(self.handle.await?)
    }
}

/// The world of one Postgres round: where writers connect, the data table and the fence table.
struct World {
    /// URL of the upstream database itself (for setup, the oracle and `--bypass`).
    direct_url: String,
    direct: tokio_postgres::Client,
    table: DataTable,
    fence_table: String,
    bypass: bool,
}

impl World {
    async fn new(direct_url: &str, fence_table: &str, bypass: bool) -> anyhow::Result<World> {
        let direct = pg::connect(&direct_url.parse()?).await;
        let table = DataTable::create(&direct).await?;
        Ok(World {
            direct_url: direct_url.to_owned(),
            direct,
            table,
            fence_table: fence_table.to_owned(),
            bypass,
        })
    }

    /// A write through `proxy` (or directly, with `--bypass`) as `user` (with `password`).
    fn write(&self, proxy: &PgProxyProcess, via: &str, resource: &str, token: u64) -> PgWrite {
        let url = if self.bypass {
            self.direct_url.clone()
        } else {
            // The same credentials and database as the direct URL, at the proxy's address.
            let mut c = self.direct_url.clone();
            let at = c.rfind('@').map_or(0, |i| i + 1);
            let slash = c[at..].find('/').map_or(c.len(), |i| at + i);
            c.replace_range(at..slash, &proxy.addr.to_string());
            c
        };
        PgWrite {
            url,
            via: via.to_owned(),
            table: self.table.name.clone(),
            resource: resource.to_owned(),
            token,
            commit_sleep_ms: 0,
        }
    }

    async fn finish(self, writes: Vec<Write>, faults: u64) -> anyhow::Result<RoundResult> {
        let applied = self.table.applied(&self.direct, &self.fence_table).await?;
        self.table.drop_now(&self.direct).await;
        Ok(RoundResult {
            writes,
            applied,
            faults,
        })
    }
}

/// Through `proxies`: a probe below the highest acknowledged token (must be refused) through
/// each, then a write above every token.
async fn probe_and_finish(
    world: &World,
    proxies: &[&PgProxyProcess],
    writes: &mut Vec<Write>,
    r: &str,
) {
    let acked = writes
        .iter()
        .filter(|w| w.outcome == Outcome::Acked)
        .map(|w| w.token)
        .max();
    let top = writes.iter().map(|w| w.token).max().unwrap_or(1);
    for (i, p) in proxies.iter().enumerate() {
        if let Some(h) = acked.filter(|h| *h > 0) {
            let mut probe = world
                .write(p, &format!("proxy {i} (probe)"), r, h - 1)
                .send()
                .await;
            probe.must_refuse = true;
            writes.push(probe);
        }
    }
    let last = proxies[proxies.len() - 1];
    writes.push(world.write(last, "final", r, top + 1).send().await);
}

/// `fence-proxy postgres` killed inside a fenced transaction (before its COMMIT, or while a slow
/// COMMIT runs) and restarted.
pub async fn kill(rng: &mut StdRng, bypass: bool) -> anyhow::Result<RoundResult> {
    let fence_table = pg::fence_table();
    let world = World::new(&pg::direct_url(), &fence_table, bypass).await?;
    let mut proxy = PgProxyProcess::start(&pg::direct_url(), &fence_table)?;
    let r = resource_name("ffpgkill");
    let base: u64 = rng.random_range(10..1_000_000);
    let mut writes = vec![world.write(&proxy, "proxy", &r, base).send().await];

    // Phase 2: `base + 1` inserts; the proxy dies before COMMIT is sent, or during the COMMIT.
    let before_commit = rng.random_bool(0.5);
    let mut w1 = world.write(&proxy, "proxy killed in the transaction", &r, base + 1);
    w1.commit_sleep_ms = rng.random_range(200..600);
    let kill_into_commit =
        Duration::from_millis(rng.random_range(0..u64::from(w1.commit_sleep_ms)));
    let (ins_tx, ins_rx) = oneshot::channel();
    let (go_tx, go_rx) = oneshot::channel();
    let w1 = w1.spawn(Hooks {
        inserted: Some(ins_tx),
        go: Some(go_rx),
    });
    let _ = ins_rx.await;
    if before_commit {
        proxy.kill();
        let _ = go_tx.send(());
    } else {
        let _ = go_tx.send(());
        tokio::time::sleep(kill_into_commit).await;
        proxy.kill();
    }
    proxy.restart()?;
    let mut w1 = w1.finish().await?;
    if before_commit && !bypass && w1.outcome != Outcome::Acked {
        // Its COMMIT never reached Postgres: the transaction must have been rolled back.
        w1.outcome = Outcome::NotDone(format!("proxy killed before COMMIT ({:?})", w1.outcome));
    }
    let w1_id = w1.id;
    writes.push(w1);

    // Phase 3: probes below `base` and at `base` (refused if `base + 1` committed), a fresh
    // write.
    let mut probe = world
        .write(&proxy, "restarted proxy", &r, base - 1)
        .send()
        .await;
    probe.must_refuse = writes[0].outcome == Outcome::Acked;
    writes.push(probe);
    let probe_at_base = world
        .write(&proxy, "restarted proxy", &r, base)
        .send()
        .await;
    let probe_index = writes.len();
    writes.push(probe_at_base);
    writes.push(
        world
            .write(&proxy, "restarted proxy", &r, base + 2)
            .send()
            .await,
    );
    let mut result = world.finish(writes, 1).await?;
    let t1_committed = result
        .applied
        .order
        .get(&r)
        .is_some_and(|o| o.iter().any(|&(id, _)| id == w1_id));
    result.writes[probe_index].must_refuse = t1_committed;
    drop(proxy);
    Ok(result)
}

/// Two `fence-proxy postgres` processes guard one fence table; writers with different tokens
/// race through both.
pub async fn shared(rng: &mut StdRng, bypass: bool) -> anyhow::Result<RoundResult> {
    let fence_table = pg::fence_table();
    let world = World::new(&pg::direct_url(), &fence_table, bypass).await?;
    let proxies = [
        PgProxyProcess::start(&pg::direct_url(), &fence_table)?,
        PgProxyProcess::start(&pg::direct_url(), &fence_table)?,
    ];
    let r = resource_name("ffpgshared");
    let base: u64 = rng.random_range(10..1_000_000);
    let n = rng.random_range(6..12);
    let mut pending = Vec::new();
    for token in race_tokens(rng, base, n) {
        let i = rng.random_range(0..2);
        let mut w = world.write(&proxies[i], &format!("proxy {i}"), &r, token);
        w.commit_sleep_ms = rng.random_range(0..150);
        pending.push(w.spawn(Hooks::default()));
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..60))).await;
    }
    let mut writes = Vec::new();
    for p in pending {
        writes.push(p.finish().await?);
    }
    probe_and_finish(&world, &[&proxies[0], &proxies[1]], &mut writes, &r).await;
    let result = world.finish(writes, 0).await?;
    drop(proxies);
    Ok(result)
}

/// The Postgres behind the proxy (a private cluster) crashes while fenced transactions are in
/// flight, some inside a slow COMMIT, and restarts on the same data dir and port.
pub async fn restart(rng: &mut StdRng, bypass: bool) -> anyhow::Result<RoundResult> {
    const FENCE_TABLE: &str = "public.lockd_fence";
    let mut cluster = tokio::task::spawn_blocking(pg::PrivateCluster::start)
        .await?
        .map_err(|e| anyhow::anyhow!("private cluster: {e}"))?;
    let url = cluster.url("postgres");
    pg::try_init_guard(&url, FENCE_TABLE)?;
    let world = World::new(&url, FENCE_TABLE, bypass).await?;
    let proxy = PgProxyProcess::start(&url, FENCE_TABLE)?;
    let r = resource_name("ffpgrestart");
    let base: u64 = rng.random_range(10..1_000_000);
    let mut writes = vec![world.write(&proxy, "proxy", &r, base).send().await];

    // Phase 2: writers with higher tokens insert; some send COMMIT (slow) before the crash,
    // the others after it.
    let n = rng.random_range(2..5);
    let mut pending = Vec::new();
    let mut inserted = Vec::new();
    let mut held = Vec::new();
    for k in 0..n {
        let mut w = world.write(&proxy, "proxy", &r, base + 1 + k as u64 / 2);
        w.commit_sleep_ms = rng.random_range(300..900);
        let commit_after_crash = rng.random_bool(0.4);
        w.via = if commit_after_crash {
            "COMMIT sent after the crash".into()
        } else {
            "COMMIT in flight at the crash".into()
        };
        let (ins_tx, ins_rx) = oneshot::channel();
        let (go_tx, go_rx) = oneshot::channel();
        inserted.push(ins_rx);
        if commit_after_crash {
            held.push(go_tx);
        } else {
            let _ = go_tx.send(());
        }
        pending.push((
            commit_after_crash,
            w.spawn(Hooks {
                inserted: Some(ins_tx),
                go: Some(go_rx),
            }),
        ));
    }
    for rx in inserted {
        let _ = tokio::time::timeout(STEP_TIMEOUT, rx).await;
    }
    tokio::time::sleep(Duration::from_millis(rng.random_range(0..300))).await;
    cluster = tokio::task::spawn_blocking(move || {
        let mut c = cluster;
        c.crash_restart().map(|()| c)
    })
    .await?
    .map_err(|e| anyhow::anyhow!("restarting the private cluster: {e}"))?;
    drop(held);
    let mut writes_after = Vec::new();
    for (commit_after_crash, p) in pending {
        let mut w = p.finish().await?;
        if commit_after_crash && !bypass && w.outcome != Outcome::Acked {
            // Its COMMIT went out after the server it was for had crashed.
            w.outcome = Outcome::NotDone(format!("COMMIT after the crash ({:?})", w.outcome));
        }
        writes_after.push(w);
    }
    writes.extend(writes_after);

    // Phase 3: the oracle's connection died with the server; reconnect, then probe.
    let world = World {
        direct: pg::connect(&url.parse()?).await,
        ..world
    };
    probe_and_finish(&world, &[&proxy], &mut writes, &r).await;
    let result = world.finish(writes, 1).await?;
    drop(proxy);
    drop(cluster);
    Ok(result)
}
