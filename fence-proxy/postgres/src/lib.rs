//! Postgres wire-protocol front end of fence-proxy: clients point their connection string at it,
//! and every client statement runs inside a transaction block the proxy opened, with the guard
//! function (installed by `fence-proxy postgres init`) run before the first data statement and
//! before every commit. The guard records the session's fence (`lockd.fence`, however it was set)
//! in the fence table, so a stale holder's transaction fails with SQLSTATE 55P03 instead of
//! overwriting a newer holder's rows.
//!
//! It terminates TLS on both sides (rustls) and can restrict client networks, but it deliberately
//! does not authenticate roles or multiplex sessions onto shared upstream connections:
//! authentication passes through to the upstream, so each client session owns one upstream
//! connection for its lifetime (see `docs/fence-proxy-postgres.md`).
//!
//! # Layout
//! - [`Args`], [`run`] and [`run_with_reload`]: flags and the accept loop.
//! - `access`: [`AccessArgs`], TLS towards clients and the client allow-list.
//! - [`upstream`]: `sslmode`/`sslrootcert` of `--upstream`, TLS towards the upstream.
//! - `config`: settings shared by sessions.
//! - `limits`: every bound, with its reason.
//! - `codec`: length-bounded message framing.
//! - `frontend`: complete, strict reading of each client message, as Postgres reads it.
//! - `startup`: SSL/cancel requests, startup packet, authentication relay, and the session's
//!   first query (its database is the one checked at start; its fence from the start).
//! - `session`: the relay, the proxy's blocks and the guard placement.
//! - [`classify`]: statement classification by Postgres's own parser (pure, fuzzable).
//! - `fence_sql`: the fence table, the guard function and `init`'s SQL.
//! - `fence_value`: the fence value rules for the early startup check.
//! - `verify`: signed sequencers in `lockd.fence` (`--verify-key`) and the proofs for the guard.
//! - `error`: proxy-made errors and their SQLSTATE table.
//! - `metrics_names`: metric names.
//! - [`epochs`]: the highest token of a fence table (`fence-proxy epochs max --upstream`).

mod access;
pub mod classify;
mod codec;
mod config;
pub mod epochs;
mod error;
pub mod fence_sql;
mod fence_value;
mod frontend;
pub mod limits;
mod metrics_names;
mod parser;
mod session;
mod startup;
pub mod upstream;
mod verify;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use fence_proxy_net::TlsReloader;
use lockd_service_kit::checks::{Check, Readiness};
use lockd_service_kit::durations::parse_duration_or_ms;
use sqlx::Connection;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::error::ProxyError;
use crate::fence_sql::FenceTable;
use crate::startup::Startup;
use fence_proxy_net::ConnectionThreads;

pub use crate::access::AccessArgs;

pub use crate::error::{
    ADMIN_SHUTDOWN, BAD_FENCE, BAD_SEQUENCER, CONNECTION_FAILURE, INVALID_AUTHORIZATION,
    LIMIT_EXCEEDED, NOT_SUPPORTED, PROTOCOL_VIOLATION, SEQUENCER_REQUIRED, STALE_TOKEN,
    TOO_MANY_CONNECTIONS,
};

/// Flags of `fence-proxy postgres`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Address the proxy accepts Postgres clients on.
    #[arg(long, default_value = "127.0.0.1:6432", env = "FENCE_PROXY_PG_LISTEN")]
    pub listen: SocketAddr,
    /// The Postgres server behind the proxy, as postgres://user@host:port/db. Clients connect
    /// to its host and port with their own user, database and credentials; the user and database
    /// of this URL serve the start-up check that the guard function exists.
    #[arg(long, env = "FENCE_PROXY_PG_UPSTREAM")]
    pub upstream: String,
    /// Sessions without a fence may only read: the guard makes each of their transactions
    /// read-only, and refuses the commit of one that wrote.
    #[arg(long, env = "FENCE_PROXY_PG_REQUIRE_FENCE")]
    pub require_fence: bool,
    /// Most concurrent client sessions; each holds one upstream connection.
    #[arg(long, default_value_t = limits::DEFAULT_MAX_SESSIONS, env = "FENCE_PROXY_PG_MAX_SESSIONS")]
    pub max_sessions: usize,
    /// Most connections from one client address that may be in startup and authentication at
    /// once; more are refused at once (53300), so that one client that opens connections and
    /// sends nothing cannot hold every session slot. Raise it for many clients behind one NAT
    /// address.
    #[arg(long, default_value_t = limits::DEFAULT_MAX_STARTUPS_PER_CLIENT, env = "FENCE_PROXY_PG_MAX_STARTUPS_PER_CLIENT")]
    pub max_startups_per_client: usize,
    /// Largest protocol message body accepted in either direction, in bytes.
    #[arg(long, default_value_t = limits::DEFAULT_MAX_MESSAGE_BYTES, env = "FENCE_PROXY_PG_MAX_MESSAGE_BYTES")]
    pub max_message_bytes: usize,
    /// Threads that serve client sessions, each with an event loop of its own; a session stays
    /// on one thread for its lifetime (no hand-offs between threads per message). 0: one per
    /// CPU.
    #[arg(long, default_value_t = 0, env = "FENCE_PROXY_PG_THREADS")]
    pub threads: usize,
    /// Timeout for opening a TCP connection to the upstream, like 5s. The old name
    /// --connect-timeout-ms (a number of milliseconds) still works.
    #[arg(
        long,
        alias = "connect-timeout-ms",
        value_name = "DURATION",
        default_value = "5s",
        value_parser = parse_duration_or_ms,
        env = "FENCE_PROXY_PG_CONNECT_TIMEOUT"
    )]
    pub connect_timeout: Duration,
    /// Time a client has to finish its startup and authentication, like 30s. The old name
    /// --startup-timeout-ms (a number of milliseconds) still works.
    #[arg(
        long,
        alias = "startup-timeout-ms",
        value_name = "DURATION",
        default_value = "30s",
        value_parser = parse_duration_or_ms,
        env = "FENCE_PROXY_PG_STARTUP_TIMEOUT"
    )]
    pub startup_timeout: Duration,
    /// Table the fences are recorded in, as given to `fence-proxy postgres init`; the guard
    /// function is `<table>_guard` in the same schema. An unqualified name means `public`.
    #[arg(
        long,
        default_value = DEFAULT_FENCE_TABLE,
        env = "FENCE_PROXY_PG_FENCE_TABLE"
    )]
    pub fence_table: String,
    #[command(flatten)]
    /// Who may connect: `--allow-client`, client TLS and certificate checks.
    pub access: AccessArgs,
    /// Public key (PEM, as `lockctl keys export` writes it) that verifies sequencers in
    /// `lockd.fence`; repeatable (key rotation). With one, every fence must be a sequencer that
    /// verifies; needs `init --require-verified` on the database.
    #[arg(
        long = "verify-key",
        env = "FENCE_PROXY_VERIFY_KEY",
        value_name = "FILE",
        value_delimiter = ','
    )]
    pub verify_key: Vec<std::path::PathBuf>,
    /// With --verify-key: still accept plain `<resource>:<token>` fences (migration). Without
    /// --verify-key it changes nothing.
    #[arg(long, env = "FENCE_PROXY_ALLOW_UNSIGNED")]
    pub allow_unsigned: bool,
    /// A database other than the --upstream URL's that clients may name (repeatable). Each is
    /// checked at start as the URL's is (guard, proof key), with the URL's role; a session
    /// naming a database not served is refused (FATAL 28000).
    #[arg(
        long = "allow-database",
        env = "FENCE_PROXY_PG_ALLOW_DATABASE",
        value_name = "NAME",
        value_delimiter = ','
    )]
    pub allow_database: Vec<String>,
}

/// The fence table when `--fence-table` is not given.
pub const DEFAULT_FENCE_TABLE: &str = "public.lockd_fence";

/// Flags of `fence-proxy postgres init`.
#[derive(Debug, Clone, clap::Args)]
pub struct InitArgs {
    /// The database to install the fence table and guard function in, as
    /// postgres://user@host:port/db; run it as the role that should own them (not an
    /// application role), once per database clients use.
    #[arg(long, env = "FENCE_PROXY_PG_UPSTREAM")]
    pub upstream: String,
    /// Table the fences are recorded in; the guard function is `<table>_guard` beside it.
    #[arg(long, default_value = DEFAULT_FENCE_TABLE, env = "FENCE_PROXY_PG_FENCE_TABLE")]
    pub fence_table: String,
    /// Application role to grant the use of the guard to (repeatable). Without it the GRANT
    /// statements are printed for you to run.
    #[arg(long = "grant-to", value_name = "ROLE")]
    pub grant_to: Vec<String>,
    /// Make the guard of this table accept only fences that a fence-proxy started with
    /// --verify-key verified: creates the table's proof key (kept if it exists). The proxy's
    /// --upstream role must be able to read it (see the printed GRANT).
    #[arg(long)]
    pub require_verified: bool,
    /// After the fence table was lost (dropped by its schema's owner, restored without it):
    /// refuse every token below N, which must be at least the highest fencing token lockd has
    /// granted (the token of a fresh Acquire on any resource is above every earlier one). init
    /// refuses to recreate a table it recorded without it.
    #[arg(long, value_name = "N")]
    pub token_floor: Option<u64>,
}

/// How long `init` waits for its connection (TCP, TLS, authentication) when the URL sets no
/// shorter `connect_timeout`: an operator's command, so a generous bound.
const INIT_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// Installs (or replaces) the fence table and the guard function in the upstream's database, in
/// one transaction, and grants the guard to `grant_to`. Returns a report for the operator: what
/// was done and the GRANT statements for roles not granted yet.
pub async fn init(args: &InitArgs) -> anyhow::Result<String> {
    let table =
        FenceTable::parse(&args.fence_table).map_err(|e| anyhow::anyhow!("--fence-table: {e}"))?;
    let upstream = upstream::parse(&args.upstream, "--upstream")?;
    let mut conn = upstream.connect(INIT_CONNECT_TIMEOUT).await.map_err(|e| {
        anyhow::anyhow!(
            "connecting to --upstream {:?}: {e:#}",
            upstream::redact(&args.upstream)
        )
    })?;
    if let Some(n) = args.token_floor {
        anyhow::ensure!(
            n >= 1,
            "--token-floor 0 refuses no token: give the highest fencing token lockd has granted"
        );
        anyhow::ensure!(
            n <= fence_sql::MAX_RECORDABLE_TOKEN,
            "--token-floor {n} is above {}, the largest token the fence table records",
            fence_sql::MAX_RECORDABLE_TOKEN
        );
    }
    let mut sql = format!("BEGIN;\n{}", table.init_sql(args.token_floor));
    for role in &args.grant_to {
        sql.push_str(&table.grant_sql(role));
    }
    if args.require_verified {
        sql.push_str(&table.require_verified_sql());
    }
    sql.push_str("COMMIT;");
    // Several statements in one simple query: the server runs them as one transaction, and a
    // failure leaves nothing behind.
    let result = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(&mut conn)
        .await;
    let _ = conn.close().await;
    result.map_err(|e| {
        anyhow::anyhow!(
            "installing {} and {} through {:?}: {}",
            table.qualified(),
            table.guard_signature(),
            upstream::redact(&args.upstream),
            upstream::sqlx_message(&e)
        )
    })?;
    let mut report = format!(
        "fence-proxy: installed table {} and guard function {} (SECURITY DEFINER); application roles get no privilege on the table\n",
        table.qualified(),
        table.guard_signature()
    );
    if args.require_verified {
        report.push_str(&format!(
            "fence-proxy: {} accepts only fences verified by a fence-proxy with --verify-key; \
             its proof key is in {}.proof_key, readable by this role; if the proxy's --upstream role is another, \
             grant it (never to an application role):\n",
            table.qualified(),
            fence_sql::GUARD_SCHEMA
        ));
        report.push_str(&FenceTable::grant_proof_key_sql("<proxy_role>"));
    }
    if args.grant_to.is_empty() {
        report.push_str(
            "-- grant the guard to each application role (or rerun with --grant-to ROLE):\n",
        );
        report.push_str(&table.grant_sql("<app_role>"));
    } else {
        for role in &args.grant_to {
            report.push_str(&format!("granted the guard to role {role:?}\n"));
        }
    }
    Ok(report)
}

/// Runs the proxy until `shutdown` is cancelled; open sessions then end with FATAL 57P01.
/// Certificates are read once; [`run_with_reload`] lets the caller read them again.
pub async fn run(args: Args, shutdown: CancellationToken) -> anyhow::Result<()> {
    run_with_reload(args, shutdown, &TlsReloader::new(), None).await
}

/// Names the upstream check in `/readyz` reasons. The fences live in the upstream's own
/// database, so the upstream is the only dependency to watch.
pub const UPSTREAM_CHECK: &str = "upstream";

/// [`run`], registering every TLS file it reads (`--tls-cert`, `--tls-key`, `--tls-client-ca`
/// and `--upstream`'s `sslrootcert`) with `reloader`: after `reloader.reload()` new client
/// handshakes and new upstream connections use the files as they are then; open sessions keep
/// the TLS they have. Once it listens it starts `readiness`'s check that the upstream accepts
/// a login and still has the guard function.
pub async fn run_with_reload(
    args: Args,
    shutdown: CancellationToken,
    reloader: &TlsReloader,
    readiness: Option<&Readiness>,
) -> anyhow::Result<()> {
    let fence_table = FenceTable::parse(&args.fence_table).map_err(|e| anyhow::anyhow!("{e}"))?;
    let upstream = upstream::parse(&args.upstream, "--upstream")?;
    // Above the bound a session semaphore cannot be made (it panicked at startup).
    for (flag, value) in [
        ("--max-sessions", args.max_sessions),
        ("--max-startups-per-client", args.max_startups_per_client),
    ] {
        anyhow::ensure!(
            (1..=limits::PLACES_MAX).contains(&value),
            "{flag} {value} must be between 1 and {}",
            limits::PLACES_MAX
        );
    }
    // Zero would refuse every client (startup) or never reach the upstream (connect).
    anyhow::ensure!(
        !args.connect_timeout.is_zero(),
        "--connect-timeout must be greater than zero"
    );
    anyhow::ensure!(
        !args.startup_timeout.is_zero(),
        "--startup-timeout must be greater than zero"
    );
    let verify_flags = verify::VerifyFlags::from_flags(&args.verify_key, args.allow_unsigned)?;
    // The proof key travels on the --upstream connection: whoever reads it there can forge the
    // proofs the guard trusts. So with --verify-key that connection must be checked TLS, or stay
    // on this machine.
    let host = upstream.host();
    let loopback = host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if verify_flags.is_some()
        && !loopback
        && !matches!(
            upstream.tls.mode,
            upstream::SslMode::VerifyCa | upstream::SslMode::VerifyFull
        )
    {
        anyhow::bail!(
            "--verify-key needs --upstream with sslmode=verify-full (or verify-ca) for the non-loopback host {host:?}, sslmode is {}: the guard's proof key is read over that connection",
            upstream.tls.mode.as_str()
        );
    }
    let mut cfg = Config {
        upstream_addr: upstream.addr(),
        fence_table,
        require_fence: args.require_fence,
        max_message_bytes: args.max_message_bytes,
        connect_timeout: args.connect_timeout,
        startup_timeout: args.startup_timeout,
        upstream_tls: upstream.tls.clone(),
        client_tls: args.access.server_tls()?,
        require_tls: args.access.tls_required(),
        databases: Default::default(),
        url_database: String::new(),
    };
    let allow = args.access.allow_list();
    if let Some(tls) = &cfg.client_tls {
        reloader.add_server(tls);
    }
    cfg.upstream_tls.register(reloader);

    // Every database a session may name is checked as the URL's is: a database the proxy never
    // looked at may have no guard, an older one, or (under --verify-key) one that takes plain
    // tokens, which a client naming it in its startup packet would reach.
    let verify = verify_flags.is_some();
    let (url_database, url_oid, proof_key) = check_guard(&upstream, &cfg, verify).await?;
    let mut checked = vec![(url_database.clone(), url_oid, proof_key)];
    for name in &args.allow_database {
        if checked.iter().any(|(d, _, _)| d == name) {
            continue;
        }
        let (found, oid, proof_key) = check_guard(&upstream.with_database(name), &cfg, verify)
            .await
            .map_err(|e| anyhow::anyhow!("--allow-database {name:?}: {e:#}"))?;
        anyhow::ensure!(
            &found == name,
            "--allow-database {name:?}: the server connected the check to database {found:?}"
        );
        checked.push((found, oid, proof_key));
    }
    for (database, oid, proof_key) in checked {
        let verification = match (&verify_flags, proof_key) {
            (Some(flags), Some(proof_key)) => Some(Arc::new(verify::Verification {
                keys: flags.keys.clone(),
                allow_unsigned: flags.allow_unsigned,
                proof_key,
            })),
            (None, Some(_)) => anyhow::bail!(
                "the guard of {} in database {database:?} accepts only verified fences (init --require-verified): start the proxy with --verify-key FILE",
                cfg.fence_table.qualified()
            ),
            (Some(_), None) => anyhow::bail!(
                "--verify-key needs the guard of {} in database {database:?} to require verified fences, or the guard would still take any token set by a statement the proxy does not read: run `fence-proxy postgres init --upstream <url of {database}> --fence-table {} --require-verified` first",
                cfg.fence_table.qualified(),
                cfg.fence_table.qualified()
            ),
            (None, None) => None,
        };
        cfg.databases
            .insert(database, config::Served { oid, verification });
    }
    cfg.url_database = url_database;
    let cfg = Arc::new(cfg);

    let listener = TcpListener::bind(args.listen)
        .await
        .map_err(|e| anyhow::anyhow!("fence-proxy: cannot listen on {}: {e}", args.listen))?;
    tracing::info!(
        listen = %args.listen,
        upstream = %cfg.upstream_addr,
        require_fence = cfg.require_fence,
        upstream_sslmode = cfg.upstream_tls.mode.as_str(),
        client_tls = cfg.client_tls.is_some(),
        require_tls = cfg.require_tls,
        allow_client = %allow,
        "postgres front end listening"
    );
    if let Some(readiness) = readiness {
        let (upstream, cfg) = (Arc::new(upstream), cfg.clone());
        readiness.start(
            vec![Check::new(UPSTREAM_CHECK, move || {
                let (upstream, cfg) = (upstream.clone(), cfg.clone());
                async move { probe_upstream(&upstream, &cfg).await }
            })],
            shutdown.clone(),
        );
    }
    parser::start().map_err(|e| {
        anyhow::anyhow!("fence-proxy: cannot start the SQL parser threads: {}", e.0)
    })?;
    let threads =
        ConnectionThreads::start_with(args.threads, "fence-proxy-pg", parser::session_threads())?;
    tracing::debug!(threads = threads.count(), "session threads started");
    let sessions = Arc::new(Semaphore::new(args.max_sessions));
    // Refusals being written: past the bound a refused connection is closed without its error,
    // so a flood of connections that are refused costs no more than the accepts.
    let refusals = Arc::new(Semaphore::new(limits::REFUSALS_IN_FLIGHT_MAX));
    let startups = lockd_service_kit::admission::SourceSlots::new(
        args.max_sessions,
        args.max_startups_per_client,
        lockd_service_kit::admission::TrustedSources::default(),
    );
    let tracker = TaskTracker::new();
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = shutdown.cancelled() => break,
        };
        let _ = stream.set_nodelay(true);
        // Before anything else: a client from outside the allow-list never costs a session slot,
        // a TLS handshake or an upstream connection.
        if !allow.allows(peer.ip()) {
            let e = ProxyError::fatal(
                error::INVALID_AUTHORIZATION,
                format!(
                    "client address {} is not in --allow-client {allow}",
                    peer.ip()
                ),
            );
            tracing::info!(%peer, "refusing a client outside --allow-client");
            if let Ok(place) = refusals.clone().try_acquire_owned() {
                tracker.spawn(async move {
                    startup::refuse_outsider(stream, e).await;
                    drop(place);
                });
            }
            continue;
        }
        let startup_place = match startups.admit(peer.ip()) {
            Ok(place) => place,
            Err(why) => {
                let e = ProxyError::fatal(
                    error::TOO_MANY_CONNECTIONS,
                    format!(
                        "sorry, too many clients already: {why} in startup (--max-startups-per-client)"
                    ),
                );
                tracing::info!(%peer, "refusing a connection: {why} in startup");
                refuse_at_once(&tracker, &refusals, stream, e);
                continue;
            }
        };
        let Ok(permit) = sessions.clone().try_acquire_owned() else {
            let e = ProxyError::fatal(
                error::TOO_MANY_CONNECTIONS,
                format!(
                    "sorry, too many clients already: {} sessions are open (--max-sessions)",
                    args.max_sessions
                ),
            );
            refuse_at_once(&tracker, &refusals, stream, e);
            continue;
        };
        // The socket moves to the session's thread, whose event loop then serves it.
        let stream = match stream.into_std() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(%peer, "cannot hand the connection to a session thread: {e}");
                continue;
            }
        };
        let cfg = cfg.clone();
        let shutdown = shutdown.clone();
        threads.spawn(&tracker, async move {
            let _permit = permit;
            let stream = match TcpStream::from_std(stream) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(%peer, "cannot register the connection on its session thread: {e}");
                    return;
                }
            };
            let startup = tokio::time::timeout(cfg.startup_timeout, startup::handshake(stream, cfg.clone()));
            let startup = tokio::select! {
                s = startup => s,
                // A client still authenticating is dropped at shutdown rather than waited for.
                () = shutdown.cancelled() => return,
            };
            drop(startup_place);
            let session = match startup {
                Ok(Ok(Startup::Session(s))) => s,
                Ok(Ok(Startup::Done)) => return,
                Ok(Err(e)) => {
                    tracing::debug!(%peer, "startup ended: {e}");
                    return;
                }
                Err(_) => {
                    tracing::info!(%peer, timeout_ms = cfg.startup_timeout.as_millis() as u64, "client did not finish startup in time");
                    return;
                }
            };
            // A session told to stop may be blocked writing to a client that does not read
            // (where it does not watch the shutdown): after the grace it is dropped, which
            // closes both connections; the upstream rolls back whatever was open.
            let run = session.run(shutdown.clone());
            let grace = async {
                shutdown.cancelled().await;
                tokio::time::sleep(limits::SHUTDOWN_GRACE).await;
            };
            tokio::select! {
                ended = run => if let Err(e) = ended {
                    tracing::debug!(%peer, "session ended: {e}");
                },
                () = grace => tracing::warn!(
                    %peer,
                    grace_ms = limits::SHUTDOWN_GRACE.as_millis() as u64,
                    "closing a session that did not end within the shutdown grace (a client that does not read?)"
                ),
            }
        });
    }
    tracker.close();
    // Every task ends within the grace (sessions above, refusals and startups by their own
    // bounds); the margin covers the closing writes.
    if tokio::time::timeout(limits::SHUTDOWN_GRACE * 2, tracker.wait())
        .await
        .is_err()
    {
        tracing::warn!("connections still open after the shutdown grace: exiting anyway");
    }
    drop(threads);
    Ok(())
}

/// Refuses to start unless the guard function exists in `upstream`'s database: without it
/// every transaction would fail, and the operator should learn that now, not from clients.
/// Returns the database's name (as the server calls it), its oid (which each session compares
/// with the database it is in, see `config::Served::oid`) and the fence table's proof key when
/// the guard requires verified fences. `verify`: the proxy has verify keys, so it must be able
/// to read the proof key, and the guard must be of a revision that refuses proofs without one.
async fn check_guard(
    upstream: &upstream::ParsedUpstream,
    cfg: &Config,
    verify: bool,
) -> anyhow::Result<(String, u32, Option<verify::ProofKey>)> {
    let mut conn = upstream.connect(cfg.connect_timeout).await.map_err(|e| {
        anyhow::anyhow!(
            "cannot reach the upstream {} to check the guard function: {e:#}",
            cfg.upstream_addr
        )
    })?;
    // Bounded: a lock held on the catalog or a server that stalls after authentication must not
    // leave the proxy starting forever, unseen by its supervisor.
    let result = tokio::time::timeout(GUARD_CHECK_TIMEOUT, read_guard(&mut conn, cfg, verify))
        .await
        .unwrap_or_else(|_| {
            Err(anyhow::anyhow!(
                "the upstream {} did not answer the guard check within {} s",
                cfg.upstream_addr,
                GUARD_CHECK_TIMEOUT.as_secs()
            ))
        });
    let _ = conn.close().await;
    result
}

/// One run of the `/readyz` upstream check: what a new session needs, not only an open port.
/// It logs in as the proxy's own role with the TLS `--upstream` asks for (so a refused
/// certificate, a `pg_hba.conf` change, a database that is gone or refuses connections all show)
/// and checks that the guard function is still installed (without it every write is refused).
async fn probe_upstream(upstream: &upstream::ParsedUpstream, cfg: &Config) -> Result<(), String> {
    let addr = &cfg.upstream_addr;
    let mut conn = upstream
        .connect(cfg.connect_timeout)
        .await
        .map_err(|e| format!("{addr}: {e:#}"))?;
    let exists = sqlx::query_scalar::<_, bool>(sqlx::AssertSqlSafe(cfg.fence_table.exists_sql()))
        .fetch_one(&mut conn)
        .await;
    let _ = conn.close().await;
    match exists {
        Ok(true) => Ok(()),
        Ok(false) => Err(format!(
            "{addr}: the guard function {} is gone: run `fence-proxy postgres init --fence-table {}` again",
            cfg.fence_table.guard_signature(),
            cfg.fence_table.qualified()
        )),
        Err(e) => Err(format!(
            "{addr}: checking the guard function: {}",
            upstream::sqlx_message(&e)
        )),
    }
}

/// How long the start-up check's queries may take once connected.
const GUARD_CHECK_TIMEOUT: Duration = Duration::from_secs(30);

/// The queries of [`check_guard`] on its connection.
async fn read_guard(
    conn: &mut sqlx::PgConnection,
    cfg: &Config,
    verify: bool,
) -> anyhow::Result<(String, u32, Option<verify::ProofKey>)> {
    let (database, oid): (String, Option<i64>) =
        sqlx::query_as(sqlx::AssertSqlSafe(fence_sql::CHECKED_DATABASE_SQL))
            .fetch_one(&mut *conn)
            .await
            .map_err(guard_check_failed)?;
    let oid = oid
        .and_then(|oid| u32::try_from(oid).ok())
        .ok_or_else(|| anyhow::anyhow!("database {database:?} has no oid in pg_database"))?;
    let key = read_guard_in(conn, cfg, verify, &database).await?;
    Ok((database, oid, key))
}

/// A query of the start-up guard check that failed.
fn guard_check_failed(e: sqlx::Error) -> anyhow::Error {
    anyhow::anyhow!(
        "checking the guard function: {}",
        upstream::sqlx_message(&e)
    )
}

/// [`read_guard`] once the database is known.
async fn read_guard_in(
    conn: &mut sqlx::PgConnection,
    cfg: &Config,
    verify: bool,
    database: &str,
) -> anyhow::Result<Option<verify::ProofKey>> {
    let exists: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(cfg.fence_table.exists_sql()))
        .fetch_one(&mut *conn)
        .await
        .map_err(guard_check_failed)?;
    anyhow::ensure!(
        exists,
        "the guard function {} does not exist in database {database:?}: run `fence-proxy postgres init --upstream <url of {database}> --fence-table {}` first",
        cfg.fence_table.guard_signature(),
        cfg.fence_table.qualified()
    );
    tracing::info!(guard = %cfg.fence_table.guard_signature(), database, "guard function present");
    if !verify {
        // Only whether a proof key exists: the key itself stays in the database, since this
        // proxy has no use for it and its upstream connection may be unchecked TLS.
        return match sqlx::query_scalar::<_, bool>(sqlx::AssertSqlSafe(
            cfg.fence_table.proof_key_exists_sql(),
        ))
        .fetch_one(&mut *conn)
        .await
        {
            Ok(false) => Ok(None),
            Ok(true) => anyhow::bail!(
                "the guard of {} in database {database:?} accepts only verified fences (init --require-verified): start the proxy with --verify-key FILE",
                cfg.fence_table.qualified()
            ),
            // A role that may not see the proof keys learns nothing here; a guard that requires
            // verified fences then refuses every fenced transaction with 28000.
            Err(e) => {
                tracing::debug!("cannot read the proof keys: {e}");
                Ok(None)
            }
        };
    }
    // An older init's guard takes the token from the value when the proof key is gone.
    let current: Option<bool> =
        sqlx::query_scalar(sqlx::AssertSqlSafe(cfg.fence_table.revision_sql()))
            .fetch_optional(&mut *conn)
            .await
            .map_err(|e| {
                anyhow::anyhow!(
                    "checking the guard's revision: {}",
                    upstream::sqlx_message(&e)
                )
            })?;
    anyhow::ensure!(
        current == Some(true),
        "--verify-key needs the guard {} in database {database:?} from a newer init (one that refuses proofs on a table without proof key): rerun `fence-proxy postgres init --upstream <url of {database}> --fence-table {} --require-verified`",
        cfg.fence_table.guard_signature(),
        cfg.fence_table.qualified()
    );
    let rows: Vec<(Vec<u8>, Vec<u8>)> = match sqlx::query_as(sqlx::AssertSqlSafe(
        cfg.fence_table.proof_key_sql(),
    ))
    .fetch_all(&mut *conn)
    .await
    {
        Ok(rows) => rows,
        Err(e) => anyhow::bail!(
            "--verify-key: cannot read the proof key of {} in {}.proof_key of database {database:?}: {}; grant it to the --upstream role: {}",
            cfg.fence_table.qualified(),
            fence_sql::GUARD_SCHEMA,
            upstream::sqlx_message(&e),
            FenceTable::grant_proof_key_sql("<role>").replace('\n', " ")
        ),
    };
    match rows.into_iter().next() {
        None => Ok(None),
        Some((kin, kout)) => {
            let key = verify::ProofKey::new(kin, kout)
                .map_err(|e| anyhow::anyhow!("{}: {e}", cfg.fence_table.qualified()))?;
            Ok(Some(key))
        }
    }
}

/// Writes `e` to a refused client on a task of its own, if fewer than
/// [`limits::REFUSALS_IN_FLIGHT_MAX`] refusals are being written; otherwise just closes it.
fn refuse_at_once(
    tracker: &TaskTracker,
    refusals: &Arc<Semaphore>,
    mut stream: TcpStream,
    e: ProxyError,
) {
    if let Ok(place) = refusals.clone().try_acquire_owned() {
        tracker.spawn(async move {
            let _ = tokio::time::timeout(
                Duration::from_secs(2),
                stream.write_all(&e.to_message().frame),
            )
            .await;
            drop(place);
        });
    }
}
