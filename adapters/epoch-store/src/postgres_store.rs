//! The shared epoch store: one Postgres table, used by many proxy replicas at once.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use lockd_fence::FencingToken;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use sqlx::{AssertSqlSafe, PgPool, Postgres};
use tokio::sync::Semaphore;
use tokio::time::{Instant, timeout};

use crate::{Admission, EpochStore, ForwardOutcome, Permit, PermitRelease, SlotGuard, Slots};
use crate::{StoreError, Timing};

/// Default table name; `--store-table` changes it, for example to give each test its own.
pub const DEFAULT_TABLE: &str = "fence_proxy_epochs";

/// Postgres identifiers longer than this are silently truncated; refuse them instead.
const TABLE_NAME_MAX_BYTES: usize = 63;

/// Largest token the store holds: the column is a signed `bigint`, and an order-preserving
/// re-encoding would make the table unreadable to operators.
pub const TOKEN_MAX: u64 = i64::MAX as u64;

/// SQLSTATE `lock_not_available`: `lock_timeout` expired while waiting for the advisory lock.
const SQLSTATE_LOCK_NOT_AVAILABLE: &str = "55P03";
/// SQLSTATEs two replicas can get when they create the table at the same moment:
/// `duplicate_table`, `unique_violation` (on `pg_type`) and `duplicate_object` ("type ... already
/// exists", for the table's row type).
const SQLSTATE_ALREADY_CREATED: [&str; 3] = ["42P07", "23505", "42710"];

/// Why a write waited in vain for a resource's advisory lock.
const LOCKED_BY_ANOTHER_REPLICA: &str = "another proxy replica is forwarding a write of it, or \
     keeps it quarantined after a forward with an unknown outcome";

/// The statements of one table, built once because the table name is part of them.
struct Statements {
    create: Arc<str>,
    lock: Arc<str>,
    select: Arc<str>,
    upsert: Arc<str>,
    mark: Arc<str>,
    unlock: Arc<str>,
    /// The records, counted up to a bound (`--max-resources`), or 0 where the table's
    /// statistics put it well below the bound.
    count: Arc<str>,
}

impl Statements {
    fn new(table: &str) -> Self {
        let s = |sql: String| -> Arc<str> { sql.into() };
        Statements {
            create: s(format!(
                "CREATE TABLE IF NOT EXISTS {table} (\
                   resource text PRIMARY KEY, \
                   token bigint NOT NULL CHECK (token >= 0), \
                   busy_until timestamptz, \
                   updated_at timestamptz NOT NULL DEFAULT now())"
            )),
            lock: s("SELECT pg_advisory_lock(hashtextextended($1, 0))".to_owned()),
            select: s(format!(
                "SELECT token, COALESCE(CEIL(EXTRACT(EPOCH FROM (busy_until - now())) * 1000), 0)::bigint \
                 FROM {table} WHERE resource = $1"
            )),
            upsert: s(format!(
                "INSERT INTO {table} AS t (resource, token, busy_until, updated_at) \
                 VALUES ($1, $2, now() + $3::float8 * interval '1 millisecond', now()) \
                 ON CONFLICT (resource) DO UPDATE \
                 SET token = EXCLUDED.token, busy_until = EXCLUDED.busy_until, updated_at = now() \
                 WHERE t.token <= EXCLUDED.token \
                 RETURNING token"
            )),
            mark: s(format!(
                "UPDATE {table} SET busy_until = CASE WHEN $2::bigint > 0 \
                   THEN now() + $2::float8 * interval '1 millisecond' ELSE NULL END \
                 WHERE resource = $1"
            )),
            unlock: s("SELECT pg_advisory_unlock(hashtextextended($1, 0))".to_owned()),
            // The statistics first (O(1)): well below a large bound a new resource needs no
            // count. Near it, and for bounds up to 10,000 (a count of that many index entries
            // takes about a millisecond), the records are counted, up to the bound, so the
            // refusal is exact where it matters; the statistics lag a second or so (and reset
            // with `pg_stat_reset`), and a tenth of the bound is the margin for that.
            count: s(format!(
                "SELECT CASE WHEN $1 > 10000 AND GREATEST( \
                   COALESCE((SELECT n_live_tup FROM pg_stat_user_tables \
                             WHERE relid = to_regclass('{table}')), 0), \
                   COALESCE((SELECT reltuples::bigint FROM pg_class \
                             WHERE oid = to_regclass('{table}')), 0)) < $1 / 10 * 9 \
                 THEN 0 \
                 ELSE (SELECT count(*) FROM (SELECT 1 FROM {table} LIMIT $1) AS records) END"
            )),
        }
    }
}

/// Epoch store in a Postgres table shared by every proxy replica.
///
/// Per resource, a write takes an in-process mutex (so that a replica's own waiters do not hold
/// connections) and then a session-level advisory lock keyed by `table/resource` (so that
/// replicas exclude one another). Holding both, it reads the record, refuses a lower token, and
/// commits the new token together with `busy_until = now() + forward timeout + quarantine`
/// before the forward starts. Release clears `busy_until` and unlocks. After an unknown outcome
/// it sets `busy_until` to the quarantine and keeps the advisory lock for the quarantine, timed
/// on this process's monotonic clock: the other replicas wait on the lock, not on the database's
/// wall clock, which an NTP step forward would cut short. A replica that dies mid-forward (or
/// mid-quarantine) loses its session, which frees the advisory lock; its `busy_until` still
/// makes the next writer wait out the forward it may have left in flight, as far as the
/// database's clock keeps time.
pub struct PostgresStore {
    pub(crate) pool: PgPool,
    /// `host:port/database` (never the password), for error messages.
    name: String,
    table: String,
    sql: Arc<Statements>,
    /// Set once the table exists; retried on each write until it succeeds, so that a proxy can
    /// start while the database is down and fail closed until it is back.
    schema_ready: tokio::sync::OnceCell<()>,
    slots: Slots,
    timing: Timing,
    /// Sessions that may keep their advisory lock through a quarantine at once: under half the
    /// pool, so that quarantines cannot take every connection; beyond that `busy_until` alone.
    quarantine_holds: Arc<Semaphore>,
    /// Resources the table may record (`--max-resources`): a write of a resource without a
    /// record reads the statistics first and, near the bound, counts the records (up to this
    /// many, an index-only scan).
    max_resources: u64,
    /// Set once a count found the table at `max_resources`: records are never deleted by the
    /// proxy, so it stays full, and new resources are refused without counting again (a count
    /// of a full table of a million records takes tens of milliseconds and a pool connection).
    full: Arc<std::sync::atomic::AtomicBool>,
}

/// Whether the store URL (or PGSSLROOTCERT, which sqlx also reads) names a root certificate.
fn names_root_cert(url: &str) -> bool {
    let in_url = url.split_once('?').is_some_and(|(_, query)| {
        query.split('&').any(|pair| {
            pair.split_once('=')
                .is_some_and(|(k, v)| k.eq_ignore_ascii_case("sslrootcert") && !v.is_empty())
        })
    });
    in_url || std::env::var_os("PGSSLROOTCERT").is_some_and(|v| !v.is_empty())
}

/// Refuses a store connection that a machine in the network path could read or rewrite: the
/// recorded tokens decide which writes pass, so one who rewrites `highest` lets a stale write
/// through. A host other than loopback or a Unix socket needs `sslmode=verify-full` (the chain
/// to `sslrootcert` and the host name checked); `prefer` and `require` check no certificate,
/// and `verify-ca` under sqlx trusts every public CA as well.
fn check_transport(options: &PgConnectOptions, url: &str) -> Result<(), StoreError> {
    let host = options.get_host();
    // A Unix socket from the URL sets `socket`; one from PGHOST or sqlx's default host is a
    // host that is a path.
    let local = options.get_socket().is_some()
        || host.starts_with('/')
        || host == "localhost"
        || host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    let mode = options.get_ssl_mode();
    if local {
        return Ok(());
    }
    if matches!(mode, PgSslMode::VerifyFull) {
        // Without a root of its own sqlx would trust any public CA for the host name.
        if names_root_cert(url) {
            return Ok(());
        }
        return Err(StoreError::Config(format!(
            "postgres url: sslmode=verify-full for the host {host:?} needs sslrootcert=FILE (the CA that issued the server's certificate; without it any public CA would do)"
        )));
    }
    Err(StoreError::Config(format!(
        "postgres url: sslmode={} for the host {host:?}: the store's tokens decide which writes pass, so a store beyond loopback needs sslmode=verify-full&sslrootcert=FILE (the CA that issued the server's certificate)",
        match mode {
            PgSslMode::Disable => "disable",
            PgSslMode::Allow => "allow",
            PgSslMode::Prefer => "prefer",
            PgSslMode::Require => "require",
            PgSslMode::VerifyCa => "verify-ca",
            PgSslMode::VerifyFull => "verify-full",
        }
    )))
}

impl PostgresStore {
    /// Prepares a pool for `url` without connecting: an unreachable database makes writes fail
    /// closed (503) instead of stopping the proxy from starting.
    pub fn connect_lazy(
        url: &str,
        table: &str,
        max_connections: u32,
        timing: Timing,
    ) -> Result<Self, StoreError> {
        validate_table(table)?;
        let options = PgConnectOptions::from_str(url)
            .map_err(|e| StoreError::Config(format!("postgres url: {e}")))?
            .application_name("fence-proxy")
            // A recorded token must survive a crash of the database: with the server's (or the
            // database's, or the role's) default `synchronous_commit = off` a commit is
            // acknowledged before its WAL is flushed, and a crash could lower the highest token
            // after a newer write was forwarded. Startup options override every such default.
            // A session keeps a resource's advisory lock through a forward and a quarantine,
            // idle meanwhile: a default `idle_session_timeout` (Postgres 14 and later) or
            // `idle_in_transaction_session_timeout` shorter than that would end the session and
            // free the lock, and the other replicas would fall back to `busy_until`, timed by the
            // database's clock. Both are off; the store's own timeouts bound every wait.
            .options([
                ("synchronous_commit", "on".to_owned()),
                ("idle_session_timeout", "0".to_owned()),
                ("idle_in_transaction_session_timeout", "0".to_owned()),
                (
                    "lock_timeout",
                    format!("{}ms", timing.lock_wait.as_millis()),
                ),
                (
                    "statement_timeout",
                    format!(
                        "{}ms",
                        (timing.lock_wait + timing.store_timeout).as_millis()
                    ),
                ),
            ]);
        check_transport(&options, url)?;
        let name = format!(
            "postgres://{}:{}/{}",
            options.get_host(),
            options.get_port(),
            options.get_database().unwrap_or("")
        );
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(timing.store_timeout)
            .connect_lazy_with(options);
        Ok(PostgresStore {
            pool,
            name,
            table: table.to_owned(),
            sql: Arc::new(Statements::new(table)),
            schema_ready: tokio::sync::OnceCell::new(),
            slots: Slots::new(),
            timing,
            // Fewer than half: a pool of one or two keeps its connection for writes.
            quarantine_holds: Arc::new(Semaphore::new(
                (max_connections as usize).saturating_sub(1) / 2,
            )),
            max_resources: crate::spec::DEFAULT_MAX_RESOURCES,
            full: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        })
    }

    /// The store with a bound on the resources its table records (default
    /// [`crate::spec::DEFAULT_MAX_RESOURCES`]): a write of a resource without a record is
    /// refused ([`StoreError::ResourceLimit`]) once the table holds `max` records. Replicas
    /// count the shared table, each under its own resource's lock: new resources written at
    /// the same moment on several replicas can pass the bound by as many.
    pub fn with_max_resources(mut self, max: u64) -> Self {
        self.max_resources = max;
        self
    }

    /// The table tokens are recorded in.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The highest token recorded for `resource`, if any.
    pub async fn highest(&self, resource: &str) -> Result<Option<FencingToken>, StoreError> {
        self.ensure_schema().await?;
        let row: Option<(i64, i64)> = self
            .bounded(
                "reading a record",
                sqlx::query_as(AssertSqlSafe(self.sql.select.clone()))
                    .bind(resource)
                    .fetch_optional(&self.pool),
            )
            .await?;
        Ok(row.map(|(t, _)| FencingToken(t as u64)))
    }

    async fn ensure_schema(&self) -> Result<(), StoreError> {
        self.schema_ready
            .get_or_try_init(|| async {
                let what = "creating the table";
                let create = || sqlx::query(AssertSqlSafe(self.sql.create.clone()));
                // Bounded by time, not by a count of tries: on a loaded server one creator's
                // commit can outlast our lock_timeout several times in a row.
                let window = (self.timing.store_timeout * 4).max(CREATE_RACE_WINDOW_MIN);
                let give_up = tokio::time::Instant::now() + window;
                loop {
                    match timeout(self.timing.store_timeout, create().execute(&self.pool)).await {
                        Ok(Ok(_)) => return Ok(()),
                        // Another replica was creating it at the same moment ("already
                        // exists", or our lock_timeout ran out waiting for its catalog lock).
                        // Run the statement again: once that creation has committed it is a
                        // no-op; anything else under the name (a stray type, say) keeps failing
                        // and is reported when the window has passed.
                        Ok(Err(e))
                            if tokio::time::Instant::now() < give_up
                                && (is_already_created(&e) || is_lock_timeout(&e)) =>
                        {
                            tokio::time::sleep(CREATE_RACE_PAUSE).await;
                        }
                        Ok(Err(e)) => return Err(self.unavailable(what, e)),
                        Err(_) => return Err(self.no_answer(what)),
                    }
                }
            })
            .await
            .map(|_| ())
    }

    /// Runs one statement with the store timeout, mapping every failure to `Unavailable`.
    pub(crate) async fn bounded<T>(
        &self,
        what: &str,
        fut: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, StoreError> {
        match timeout(self.timing.store_timeout, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(self.unavailable(what, e)),
            Err(_) => Err(self.no_answer(what)),
        }
    }

    fn no_answer(&self, what: &str) -> StoreError {
        self.unavailable(
            what,
            format!(
                "no answer within {} ms",
                self.timing.store_timeout.as_millis()
            ),
        )
    }

    fn unavailable(&self, what: &str, e: impl std::fmt::Display) -> StoreError {
        StoreError::Unavailable {
            store: self.name.clone(),
            detail: format!("{what}: {e}"),
        }
    }

    async fn admit_inner(
        &self,
        resource: &str,
        token: FencingToken,
    ) -> Result<Admission, StoreError> {
        if token.0 > TOKEN_MAX {
            return Err(StoreError::TokenOutOfRange {
                token,
                max: TOKEN_MAX,
                store: "postgres",
            });
        }
        let started = Instant::now();
        let guard = self.slots.lock(resource, self.timing.lock_wait).await?;
        self.ensure_schema().await?;
        let conn = self.bounded("connecting", self.pool.acquire()).await?;
        let mut conn = SessionConn(Some(conn));
        let key = format!("{}/{}", self.table, resource);
        match self
            .decide(&mut conn, &key, resource, token, started)
            .await?
        {
            Decision::Accepted => Ok(Admission::Accepted(Permit::new(
                resource,
                token,
                PgPermit {
                    conn,
                    guard,
                    key,
                    resource: resource.to_owned(),
                    sql: self.sql.clone(),
                    store: self.name.clone(),
                    quarantine: self.timing.quarantine,
                    dropped_quarantine: self.timing.forward_timeout + self.timing.quarantine,
                    store_timeout: self.timing.store_timeout,
                    holds: self.quarantine_holds.clone(),
                },
            ))),
            Decision::Stale(highest) => {
                unlock(conn, &self.sql, &key, self.timing.store_timeout).await;
                Ok(Admission::Stale { highest })
            }
            Decision::Refused(e) => {
                unlock(conn, &self.sql, &key, self.timing.store_timeout).await;
                Err(e)
            }
        }
    }

    /// Takes the advisory lock and decides. An `Err` leaves the lock in an unknown state: the
    /// caller drops the connection, which closes the session and so frees the lock.
    async fn decide(
        &self,
        conn: &mut SessionConn,
        key: &str,
        resource: &str,
        token: FencingToken,
        started: Instant,
    ) -> Result<Decision, StoreError> {
        let wait_max = self.timing.lock_wait;
        let remaining = wait_max.saturating_sub(started.elapsed());
        let lock = sqlx::query(AssertSqlSafe(self.sql.lock.clone()))
            .bind(key)
            .execute(conn.get());
        let busy = |why| StoreError::busy(resource, why, started.elapsed(), wait_max);
        match timeout(remaining, lock).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) if sqlstate(&e).as_deref() == Some(SQLSTATE_LOCK_NOT_AVAILABLE) => {
                return Err(busy(LOCKED_BY_ANOTHER_REPLICA));
            }
            Ok(Err(e)) => return Err(self.unavailable("taking the resource's advisory lock", e)),
            Err(_) => return Err(busy(LOCKED_BY_ANOTHER_REPLICA)),
        }

        let row: Option<(i64, i64)> = self
            .bounded(
                "reading the record",
                sqlx::query_as(AssertSqlSafe(self.sql.select.clone()))
                    .bind(resource)
                    .fetch_optional(conn.get()),
            )
            .await?;
        if let Some((highest, busy_ms)) = row {
            if highest as u64 > token.0 {
                return Ok(Decision::Stale(FencingToken(highest as u64)));
            }
            if busy_ms > 0 {
                let busy_for = Duration::from_millis(busy_ms as u64);
                if started.elapsed() + busy_for > wait_max {
                    return Ok(Decision::Refused(busy(
                        "a forward with an unknown outcome (timeout or crashed replica) may still be in flight",
                    )));
                }
                tokio::time::sleep(busy_for).await;
            }
        } else {
            let limit = self.max_resources;
            let full = || {
                Ok(Decision::Refused(StoreError::ResourceLimit {
                    resource: resource.to_owned(),
                    limit,
                    store: self.name.clone(),
                }))
            };
            if self.full.load(std::sync::atomic::Ordering::Relaxed) {
                return full();
            }
            let records: i64 = self
                .bounded(
                    "counting the records",
                    sqlx::query_scalar(AssertSqlSafe(self.sql.count.clone()))
                        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                        .fetch_one(conn.get()),
                )
                .await?;
            if records as u64 >= limit {
                self.full.store(true, std::sync::atomic::Ordering::Relaxed);
                return full();
            }
        }

        let hold_ms = (self.timing.forward_timeout + self.timing.quarantine).as_millis() as i64;
        let recorded: Option<i64> = self
            .bounded(
                "recording the token",
                sqlx::query_scalar(AssertSqlSafe(self.sql.upsert.clone()))
                    .bind(resource)
                    .bind(token.0 as i64)
                    .bind(hold_ms)
                    .fetch_optional(conn.get()),
            )
            .await?;
        if recorded.is_some() {
            return Ok(Decision::Accepted);
        }
        // Only a writer that bypasses the advisory lock can raise the record between our read
        // and our upsert; the conditional upsert still refused to lower it.
        let highest: i64 = self
            .bounded(
                "re-reading the record",
                sqlx::query_scalar(AssertSqlSafe(format!(
                    "SELECT token FROM {} WHERE resource = $1",
                    self.table
                )))
                .bind(resource)
                .fetch_one(conn.get()),
            )
            .await?;
        Ok(Decision::Stale(FencingToken(highest as u64)))
    }
}

enum Decision {
    Accepted,
    Stale(FencingToken),
    /// Neither accepted nor stale: busy, or a new resource beyond `--max-resources`.
    Refused(StoreError),
}

fn sqlstate(e: &sqlx::Error) -> Option<String> {
    e.as_database_error()
        .and_then(|d| d.code())
        .map(|c| c.into_owned())
}

/// How long a replica keeps running the table's CREATE again while it loses races with other
/// replicas: four store timeouts, at least this.
const CREATE_RACE_WINDOW_MIN: std::time::Duration = std::time::Duration::from_secs(2);
/// Pause between two CREATE attempts that lost a race.
const CREATE_RACE_PAUSE: std::time::Duration = std::time::Duration::from_millis(20);

/// `55P03` lock_not_available: the session's lock_timeout ran out.
fn is_lock_timeout(e: &sqlx::Error) -> bool {
    sqlstate(e).is_some_and(|c| c == "55P03")
}

fn is_already_created(e: &sqlx::Error) -> bool {
    sqlstate(e).is_some_and(|c| SQLSTATE_ALREADY_CREATED.contains(&c.as_str()))
}

fn validate_table(table: &str) -> Result<(), StoreError> {
    let mut chars = table.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    let rest_ok = chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !first_ok || !rest_ok || table.len() > TABLE_NAME_MAX_BYTES {
        return Err(StoreError::Config(format!(
            "table name {table:?} must be 1 to {TABLE_NAME_MAX_BYTES} bytes of a-z, 0-9 and _, \
             not starting with a digit"
        )));
    }
    Ok(())
}

/// A pooled connection that may hold a session advisory lock. Dropped, it closes the session
/// (which frees the lock) instead of going back to the pool still locked; only
/// [`SessionConn::into_pool`] returns it, after a successful unlock.
struct SessionConn(Option<PoolConnection<Postgres>>);

impl SessionConn {
    fn get(&mut self) -> &mut sqlx::PgConnection {
        self.0.as_mut().expect("SessionConn used after into_pool")
    }

    fn into_pool(mut self) {
        drop(self.0.take());
    }
}

impl Drop for SessionConn {
    fn drop(&mut self) {
        if let Some(conn) = self.0.take() {
            drop(conn.detach());
        }
    }
}

/// Unlocks and returns the connection to the pool; on any failure the connection is closed.
async fn unlock(mut conn: SessionConn, sql: &Statements, key: &str, bound: Duration) {
    let unlocked = timeout(
        bound,
        sqlx::query_scalar::<_, bool>(AssertSqlSafe(sql.unlock.clone()))
            .bind(key)
            .fetch_one(conn.get()),
    )
    .await;
    match unlocked {
        Ok(Ok(true)) => conn.into_pool(),
        Ok(Ok(false)) => {
            tracing::warn!(%key, "advisory lock was not held at unlock; closing the session")
        }
        Ok(Err(e)) => {
            tracing::warn!(%key, error = %e, "advisory unlock failed; closing the session")
        }
        Err(_) => tracing::warn!(%key, "advisory unlock timed out; closing the session"),
    }
}

/// The release half of a Postgres permit.
struct PgPermit {
    conn: SessionConn,
    guard: SlotGuard,
    key: String,
    resource: String,
    sql: Arc<Statements>,
    /// The store's name, for error messages.
    store: String,
    quarantine: Duration,
    /// The quarantine of a permit dropped unreleased: its write may have been sent just before,
    /// so the forward's whole time is added.
    dropped_quarantine: Duration,
    store_timeout: Duration,
    holds: Arc<Semaphore>,
}

impl PermitRelease for PgPermit {
    fn release(
        self: Box<Self>,
        outcome: ForwardOutcome,
    ) -> BoxFuture<'static, Result<(), StoreError>> {
        let quarantine = match outcome {
            ForwardOutcome::Unknown => self.quarantine,
            ForwardOutcome::Answered | ForwardOutcome::NotSent => Duration::ZERO,
        };
        self.end(quarantine)
    }

    fn abandon(self: Box<Self>) -> BoxFuture<'static, Result<(), StoreError>> {
        let quarantine = self.dropped_quarantine;
        self.end(quarantine)
    }
}

impl PgPermit {
    /// Marks the record busy for `quarantine` (none: clears the mark) and unlocks, at once or,
    /// with a quarantine, once it has passed on this process's clock.
    fn end(self: Box<Self>, quarantine: Duration) -> BoxFuture<'static, Result<(), StoreError>> {
        Box::pin(async move {
            let PgPermit {
                mut conn,
                mut guard,
                key,
                resource,
                sql,
                store,
                store_timeout,
                holds,
                ..
            } = *self;
            if !quarantine.is_zero() {
                guard.quarantine(quarantine);
            }
            let busy_ms = quarantine.as_millis() as i64;
            let marked = timeout(
                store_timeout,
                sqlx::query(AssertSqlSafe(sql.mark.clone()))
                    .bind(&resource)
                    .bind(busy_ms)
                    .execute(conn.get()),
            )
            .await;
            let result = match marked {
                Ok(Ok(_)) => Ok(()),
                // The in-flight mark written at admission stays: others wait longer, never less.
                Ok(Err(e)) => Err(StoreError::Unavailable {
                    store: store.clone(),
                    detail: format!("clearing the in-flight mark of {resource:?}: {e}"),
                }),
                Err(_) => Err(StoreError::Unavailable {
                    store: store.clone(),
                    detail: format!(
                        "clearing the in-flight mark of {resource:?}: no answer within {} ms",
                        store_timeout.as_millis()
                    ),
                }),
            };
            // This replica's own writers wait out the quarantine in the process (the guard
            // starts it as it goes), the others on the advisory lock below.
            drop(guard);
            if result.is_ok() {
                if quarantine.is_zero() {
                    unlock(conn, &sql, &key, store_timeout).await;
                } else if let Ok(hold) = holds.try_acquire_owned() {
                    // The other replicas wait on the advisory lock until this clock says the
                    // quarantine is over; the client has its answer meanwhile.
                    tokio::spawn(async move {
                        tokio::time::sleep(quarantine).await;
                        unlock(conn, &sql, &key, store_timeout).await;
                        drop(hold);
                    });
                    return result;
                } else {
                    tracing::warn!(
                        %resource,
                        "every session the store may keep for quarantines (under half the \
                         pool) is kept: this one rests on busy_until, the database's clock, alone"
                    );
                    unlock(conn, &sql, &key, store_timeout).await;
                }
            }
            result
        })
    }
}

impl EpochStore for PostgresStore {
    fn admit<'a>(
        &'a self,
        resource: &'a str,
        token: FencingToken,
    ) -> BoxFuture<'a, Result<Admission, StoreError>> {
        Box::pin(self.admit_inner(resource, token))
    }

    fn kind(&self) -> &'static str {
        "postgres"
    }

    /// No: an admission dropped after its record was sent leaves the record's in-flight mark
    /// (`busy_until`, `--upstream-timeout` + `--quarantine` ahead) set by a statement the server
    /// still commits, which closes the resource for every replica until it passes.
    fn admission_cancel_safe(&self) -> bool {
        false
    }

    /// `SELECT 1` on a pooled connection, bounded by the store timeout: it fails while the
    /// database cannot be reached or does not answer.
    fn check(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            self.bounded("checking", sqlx::query("SELECT 1").execute(&self.pool))
                .await
                .map(drop)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The readiness check of a store whose database is down names the store and fails within
    /// the store timeout (nothing listens on port 1).
    #[tokio::test]
    async fn check_fails_while_the_database_is_unreachable() {
        let timing = Timing {
            store_timeout: Duration::from_millis(500),
            ..Timing::default()
        };
        let store =
            PostgresStore::connect_lazy("postgres://u@127.0.0.1:1/db", DEFAULT_TABLE, 1, timing)
                .unwrap();
        let started = std::time::Instant::now();
        match store.check().await {
            Err(StoreError::Unavailable { store, detail }) => {
                assert_eq!(store, "postgres://127.0.0.1:1/db");
                assert!(detail.starts_with("checking: "), "{detail}");
            }
            other => panic!("{other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(3));
    }

    /// Goal: a store beyond loopback is refused unless its TLS checks the certificate and the
    /// host name; loopback hosts and Unix sockets need nothing.
    #[tokio::test]
    async fn a_remote_store_needs_verify_full() {
        let open = |url: &str| {
            PostgresStore::connect_lazy(url, DEFAULT_TABLE, 1, Timing::default()).map(|_| ())
        };
        for mode in ["disable", "allow", "prefer", "require", "verify-ca"] {
            let url = format!("postgres://u:pw@db.internal:5432/d?sslmode={mode}");
            match open(&url) {
                Err(StoreError::Config(e)) => {
                    assert!(e.contains(&format!("sslmode={mode}")), "{e}");
                    assert!(
                        e.contains("db.internal") && e.contains("verify-full"),
                        "{e}"
                    );
                    assert!(!e.contains("pw"), "{e}");
                }
                other => panic!("{url}: {:?}", other.err()),
            }
        }
        // Without sslmode sqlx prefers TLS without checking it: refused as well.
        assert!(open("postgres://u@10.0.0.5/d").is_err());
        // verify-full needs a root of its own, or any public CA would do.
        match open("postgres://u@db.internal/d?sslmode=verify-full") {
            Err(StoreError::Config(e)) => assert!(e.contains("sslrootcert"), "{e}"),
            other => panic!("{:?}", other.err()),
        }
        for url in [
            "postgres://u@127.0.0.1:5432/d",
            "postgres://u@localhost/d?sslmode=disable",
            "postgres://u@[::1]:5432/d",
            "postgres://u@%2Fvar%2Frun%2Fpostgresql/d",
            "postgres://u@db.internal/d?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
        ] {
            open(url).unwrap_or_else(|e| panic!("{url}: {e:?}"));
        }
    }

    #[test]
    fn table_names_are_plain_identifiers() {
        for ok in ["fence_proxy_epochs", "_t", "t1"] {
            validate_table(ok).unwrap();
        }
        for bad in ["", "1t", "T", "a-b", "a;drop", "a b", &"t".repeat(64)] {
            let err = validate_table(bad).unwrap_err();
            assert!(err.to_string().contains(&format!("{bad:?}")), "{err}");
        }
    }
}
