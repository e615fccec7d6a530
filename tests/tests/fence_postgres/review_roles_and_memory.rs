//! Adversarial review, continued: a database owner who replaces the guard, and a query that costs
//! the proxy far more memory than its size.

use std::time::Duration;

use bytes::BytesMut;
use lockd_tests::pg::{self, Attack};

/// Goal: the documented setup ("init as postgres, --grant-to app; applications cannot touch the
/// fence") must hold when the application role owns its database, the usual way databases are
/// created. It does not with the default `public.lockd_fence`: since Postgres 15 the `public`
/// schema is owned by `pg_database_owner`, i.e. by the database's owner, and the owner of a schema
/// may drop any object in it. The application role drops the guard function (owned by
/// `postgres`) and creates a no-op one under the same name, in one query so the proxy's own
/// closing guard already calls the replacement; from then on every session's guard is a no-op
/// and a stale session writes.
/// Method: role `o` owning database `d`; `fence-proxy postgres init` as postgres in `d` with the
/// default table and `--grant-to o`; a proxy in front of `d`; the holder of 42 writes; `o`,
/// unfenced, sends `DROP FUNCTION public.lockd_fence_guard(boolean); CREATE FUNCTION
/// public.lockd_fence_guard(require_fence boolean) RETURNS void ... no-op`; then `o` with fence
/// `r:41` inserts a row of 41.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review13_database_owner_replaces_the_guard_in_public() {
    lockd_tests::skip_without_postgres!();
    let direct = pg::connect(&pg::direct_url().parse().unwrap()).await;
    let role = pg::unique_name("review13_owner");
    let db = pg::unique_name("review13_db");
    direct
        .batch_execute(&format!("CREATE ROLE {role} LOGIN"))
        .await
        .unwrap();
    direct
        .batch_execute(&format!("CREATE DATABASE {db} OWNER {role}"))
        .await
        .unwrap();
    // Drops the database and role even when the test panics half-way.
    let _cleanup = pg::SqlOnDrop(vec![
        format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"),
        format!("DROP ROLE IF EXISTS {role}"),
    ]);
    let upstream = format!(
        "postgres://{}@{}:{}/{db}",
        pg::PG_USER,
        pg::PG_HOST,
        pg::PG_PORT
    );
    let init_args = fence_proxy_postgres::InitArgs {
        upstream: upstream.clone(),
        fence_table: fence_proxy_postgres::DEFAULT_FENCE_TABLE.to_owned(),
        grant_to: vec![role.clone()],
        require_verified: false,
        token_floor: None,
    };
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(fence_proxy_postgres::init(&init_args))
    })
    .join()
    .unwrap()
    .expect("init in the new database");

    let addr: std::net::SocketAddr = format!("127.0.0.1:{}", pg::free_port()).parse().unwrap();
    let args = fence_proxy_postgres::Args {
        listen: addr,
        upstream: upstream.clone(),
        require_fence: false,
        max_sessions: 16,
        max_startups_per_client: fence_proxy_postgres::limits::DEFAULT_MAX_STARTUPS_PER_CLIENT,
        max_message_bytes: fence_proxy_postgres::limits::DEFAULT_MAX_MESSAGE_BYTES,
        threads: 2,
        connect_timeout: Duration::from_secs(5),
        startup_timeout: Duration::from_secs(10),
        fence_table: fence_proxy_postgres::DEFAULT_FENCE_TABLE.to_owned(),
        access: Default::default(),
        verify_key: Vec::new(),
        allow_unsigned: false,
        allow_database: Vec::new(),
    };
    let shutdown = tokio_util::sync::CancellationToken::new();
    let token = shutdown.clone();
    let proxy = std::thread::spawn(move || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
            .block_on(fence_proxy_postgres::run(args, token))
    });
    let mut up = false;
    for _ in 0..300 {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            up = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(up, "proxy did not start");

    let through = |fence: Option<String>| {
        let mut c: tokio_postgres::Config =
            format!("postgres://{role}@{}:{}/{db}", addr.ip(), addr.port())
                .parse()
                .unwrap();
        if let Some(f) = fence {
            c.options(format!("-c lockd.fence={f}"));
        }
        c
    };
    let resource = pg::unique_name("review_owner");
    let owner = pg::connect(&through(None)).await;
    owner
        .batch_execute("CREATE TABLE fenced_rows (token bigint NOT NULL)")
        .await
        .unwrap();
    let holder = pg::connect(&through(Some(format!("{resource}:42")))).await;
    holder
        .batch_execute("INSERT INTO fenced_rows VALUES (42)")
        .await
        .expect("the holder of 42 writes");

    let replaced = owner
        .batch_execute(
            "DROP FUNCTION public.lockd_fence_guard(boolean); \
             CREATE FUNCTION public.lockd_fence_guard(require_fence boolean) RETURNS void \
             LANGUAGE sql AS 'SELECT NULL::void'",
        )
        .await;
    eprintln!("owner replaces the guard -> {replaced:?}");
    // The owner of `public` may also drop the fence table (owned by postgres) and create one of
    // its own; done directly, not through the proxy (whose closing guard would refuse it), this
    // must make every guard fail rather than read the owner's rows.
    let direct_owner = pg::connect(
        &format!("postgres://{role}@{}:{}/{db}", pg::PG_HOST, pg::PG_PORT)
            .parse()
            .unwrap(),
    )
    .await;
    let table_replaced = direct_owner
        .batch_execute(
            "DROP TABLE public.lockd_fence; \
             CREATE TABLE public.lockd_fence (resource text PRIMARY KEY, token bigint NOT NULL, \
             updated_at timestamptz NOT NULL)",
        )
        .await;
    eprintln!("owner replaces the fence table directly -> {table_replaced:?}");
    drop(direct_owner);
    let stale = pg::connect(&through(Some(format!("{resource}:41")))).await;
    let wrote = stale
        .batch_execute("INSERT INTO fenced_rows VALUES (41)")
        .await;
    eprintln!("stale 41 writes -> {wrote:?}");
    // Counted directly: through the proxy every guard now fails (closed) on the foreign table.
    let counter = pg::connect(
        &format!("postgres://{role}@{}:{}/{db}", pg::PG_HOST, pg::PG_PORT)
            .parse()
            .unwrap(),
    )
    .await;
    let rows: i64 = counter
        .query_one("SELECT count(*) FROM fenced_rows WHERE token <> 42", &[])
        .await
        .unwrap()
        .get(0);

    drop((owner, holder, stale, counter));
    shutdown.cancel();
    let _ = proxy.join();
    assert_eq!(
        rows, 0,
        "the database owner replaced the guard in public and a stale row committed"
    );
}

/// Peak resident memory of this process (the in-process proxy and the test client), in KiB.
fn high_water_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Goal: one client must not be able to exhaust the proxy's memory. The proxy accepts messages of
/// up to 64 MiB by default and hands every query text to pg_query, whose parse tree and protobuf
/// encoding (then decoded again by prost) cost hundreds of bytes per byte of SQL: a 4 MB
/// `SELECT 1,1,...` raised this process's peak by 2.7 GB (and 29 s of CPU) in a debug build,
/// so a default-sized message (64 MiB), or a few sessions at once, gets the proxy OOM-killed with
/// every session on it.
/// Method: one `SELECT 1,1,...,1` of 1 MB through the proxy (the server refuses it with 54011
/// after the proxy classified it); the process's peak resident memory must grow by less than
/// 256 MiB (a quarter of the 1 MiB × 1,024 amplification a 64 MiB message would need to stay
/// under 16 GiB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review13_one_query_costs_hundreds_of_times_its_size_in_memory() {
    lockd_tests::skip_without_postgres!();
    let a = Attack::new(false, "review").await;
    let mut c = a.session(None).await;
    let before = high_water_kib();
    let sql = format!("SELECT 1{}", ",1".repeat(500_000));
    let mut out = BytesMut::new();
    postgres_protocol::message::frontend::query(&sql, &mut out).unwrap();
    c.send(&out).await;
    let r = c.read_until_ready().await;
    let after = high_water_kib();
    eprintln!(
        "query of {} bytes: {:?}; peak {} KiB -> {} KiB",
        sql.len(),
        r.first_error(),
        before,
        after
    );
    assert!(
        after.saturating_sub(before) < 256 * 1024,
        "one {}-byte query raised the proxy's peak memory by {} MiB",
        sql.len(),
        (after - before) / 1024
    );
}

/// Resets this process's peak resident memory to its current resident memory (Linux 4.0+).
fn reset_high_water() {
    std::fs::write("/proc/self/clear_refs", "5")
        .expect("reset VmHWM through /proc/self/clear_refs");
}

/// Goal: many sessions together must not be able to exhaust the proxy's memory either. A text
/// at the 128 KiB limit costs the parser hundreds of times its size while it is parsed, and each
/// long text used to get a parser thread of its own, so a client with a few dozen connections
/// sending such texts at once ran that many parses side by side and could get the proxy
/// OOM-killed with every session on it.
/// Method: measure the peak memory of one `SELECT 1,1,...` just under the limit alone (40-90 MiB
/// in a debug build), then send it on 16 sessions at once; the peak must grow by less than
/// 512 MiB (the long-text parser threads are at most four). Sixteen side-by-side parses raised
/// it by 1,069 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review13_many_long_queries_at_once_are_parsed_a_few_at_a_time() {
    lockd_tests::skip_without_postgres!();
    const SESSIONS: usize = 16;
    let a = Attack::new(false, "review").await;
    let sql = format!("SELECT 1{}", ",1".repeat(65_000));
    assert!(sql.len() <= 128 * 1024);
    let mut out = BytesMut::new();
    postgres_protocol::message::frontend::query(&sql, &mut out).unwrap();
    let out = out.freeze();

    let mut one = a.session(None).await;
    // The first long parse starts nothing new: the parser threads started with the proxy.
    one.send(&out).await;
    one.read_until_ready().await;
    reset_high_water();
    let before = high_water_kib();
    one.send(&out).await;
    let r = one.read_until_ready().await;
    let single = high_water_kib().saturating_sub(before);
    eprintln!(
        "one long query: {:?}; peak +{} MiB",
        r.first_error(),
        single / 1024
    );
    assert!(
        single > 8 * 1024,
        "a long parse should cost memory: {single} KiB"
    );

    let mut sessions = Vec::new();
    for _ in 0..SESSIONS {
        sessions.push(a.session(None).await);
    }
    reset_high_water();
    let before = high_water_kib();
    let started = std::time::Instant::now();
    let replies = futures::future::join_all(sessions.iter_mut().map(|c| {
        let out = out.clone();
        async move {
            c.send(&out).await;
            c.read_until_ready().await.first_error().to_owned()
        }
    }))
    .await;
    let together = high_water_kib().saturating_sub(before);
    eprintln!(
        "{SESSIONS} long queries at once in {:?}: peak +{} MiB ({:.1} single parses); first answer {:?}",
        started.elapsed(),
        together / 1024,
        together as f64 / single as f64,
        replies[0]
    );
    assert!(
        replies.iter().all(|e| e.contains("54011")),
        "each query reaches Postgres, which refuses its 65,001 columns: {replies:?}"
    );
    assert!(
        together < 512 * 1024,
        "{SESSIONS} long queries at once raised the proxy's peak by {} MiB, {:.1} times one parse",
        together / 1024,
        together as f64 / single as f64
    );
}
