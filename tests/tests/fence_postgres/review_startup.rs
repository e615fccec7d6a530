//! Adversarial review of the startup packet: the database a client names (M1), how the startup
//! fence is read (L1), and a shutdown held up by a client that stops reading (L3).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use lockd_fence::FencingToken;
use lockd_fence::sequencer::{SigningKey, encode_text};
use lockd_tests::pg::{self, PgProxy, RawConn, RawReply};

/// A verify key written where `--verify-key` reads it, and the means to sign with it.
struct Keys {
    _dir: tempfile::TempDir,
    key: SigningKey,
    file: PathBuf,
}

impl Keys {
    fn new() -> Keys {
        let dir = tempfile::tempdir().unwrap();
        let key = SigningKey::generate();
        let file = dir.path().join("lockd.pub.pem");
        std::fs::write(&file, key.public_key().to_pem()).unwrap();
        Keys {
            _dir: dir,
            key,
            file,
        }
    }

    /// `<resource>:<sequencer>` for `token`, as `lockctl hold` would export it.
    fn fence(&self, resource: &str, token: u64) -> String {
        let seq = encode_text(
            &self
                .key
                .sign(resource, FencingToken(token), 1_700_000_000_000),
        );
        format!("{resource}:{seq}")
    }
}

/// URL of database `db` of the shared Postgres, as the proxy's `--upstream`.
fn url_of(db: &str) -> String {
    format!(
        "postgres://{}@{}:{}/{db}",
        pg::PG_USER,
        pg::PG_HOST,
        pg::PG_PORT
    )
}

/// A new database, dropped (with its sessions) when the returned guard drops.
async fn database(direct: &tokio_postgres::Client, prefix: &str) -> (String, pg::SqlOnDrop) {
    let db = pg::unique_name(prefix);
    direct
        .batch_execute(&format!("CREATE DATABASE {db}"))
        .await
        .unwrap();
    let cleanup = pg::SqlOnDrop(vec![format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)")]);
    (db, cleanup)
}

/// A proxy in front of `upstream` with `--verify-key`.
fn verifying_proxy(upstream: String, table: &str, keys: &Keys, require_fence: bool) -> PgProxy {
    let mut args = pg::proxy_args(upstream, table.to_owned(), require_fence);
    args.verify_key = vec![keys.file.clone()];
    PgProxy::start_args(args)
}

async fn recorded(db: &tokio_postgres::Client, table: &str, resource: &str) -> Option<i64> {
    db.query_opt(
        &format!("SELECT token FROM {table} WHERE resource = $1"),
        &[&resource],
    )
    .await
    .unwrap()
    .map(|r| r.get(0))
}

async fn count(db: &tokio_postgres::Client, tbl: &str) -> i64 {
    db.query_one(&format!("SELECT count(*) FROM {tbl}"), &[])
        .await
        .unwrap()
        .get(0)
}

/// The errors of a startup, or of the queries after it, in one line.
fn errors(r: &RawReply) -> String {
    format!("{:?}", r.errors)
}

/// Goal (review M1): under `--verify-key` only a fence the proxy verified raises a recorded
/// token, whatever database the client names in its startup packet. The proxy checked the proof
/// key only in the `--upstream` URL's database and forwarded the client's `database` unchanged;
/// in a database whose guard `init` installed without `--require-verified`, a fence the proxy
/// does not read (a bundled `-ec lockd.fence=...`, or `set_config` inside a data statement)
/// reached a guard that takes plain tokens, and a forged token locked the real holder out.
/// Method: database A (the URL's, `init --require-verified`) and B (plain `init`, same fence
/// table, a data table); proxies with `--verify-key` in front of A, one with `--require-fence`
/// and one without. Sessions naming B: `options=-ec lockd.fence=<r>:999999` and an INSERT
/// (`--require-fence`); unfenced, `SELECT set_config('lockd.fence', '<r>:999999', false)` then an
/// INSERT (without). Nothing may be recorded or written in B.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_m1_verify_key_holds_in_every_database_a_client_names() {
    lockd_tests::skip_without_postgres!();
    let direct = pg::connect(&pg::direct_url().parse().unwrap()).await;
    let (db_a, _drop_a) = database(&direct, "review_m1_a").await;
    let (db_b, _drop_b) = database(&direct, "review_m1_b").await;
    let table = format!("{}.lockd_fence", pg::unique_name("review_m1"));
    pg::try_init_guard_with(&url_of(&db_a), &table, true).unwrap();
    pg::try_init_guard_with(&url_of(&db_b), &table, false).unwrap();
    let in_b = pg::connect(&url_of(&db_b).parse().unwrap()).await;
    in_b.batch_execute("CREATE TABLE m1_rows (token bigint NOT NULL)")
        .await
        .unwrap();
    let keys = Keys::new();
    let resource = pg::unique_name("review_m1");
    let fenced = verifying_proxy(url_of(&db_a), &table, &keys, true);
    let open = verifying_proxy(url_of(&db_a), &table, &keys, false);

    let mut seen = Vec::new();
    let options = format!("-ec lockd.fence={resource}:999999");
    let (mut s, r) = RawConn::start(
        fenced.addr,
        &[
            ("user", pg::PG_USER),
            ("database", &db_b),
            ("options", &options),
        ],
    )
    .await;
    seen.push(format!("startup in B with {options:?} -> {}", errors(&r)));
    let startup_b = r;
    if startup_b.errors.is_empty() {
        let r = s.query("INSERT INTO m1_rows VALUES (999999)").await;
        seen.push(format!("INSERT -> {}", errors(&r)));
    }
    let (mut s, r) = RawConn::start(open.addr, &[("user", pg::PG_USER), ("database", &db_b)]).await;
    seen.push(format!("unfenced startup in B -> {}", errors(&r)));
    if r.errors.is_empty() {
        let r = s
            .query(&format!(
                "SELECT set_config('lockd.fence', '{resource}:999999', false); INSERT INTO m1_rows VALUES (999999)"
            ))
            .await;
        seen.push(format!("set_config and INSERT -> {}", errors(&r)));
    }
    eprintln!("{seen:#?}");
    assert_eq!(
        (
            recorded(&in_b, &table, &resource).await,
            count(&in_b, "m1_rows").await
        ),
        (None, 0),
        "a fence the proxy never verified was recorded, or a row written, in database {db_b}: {seen:#?}"
    );
    // Refused at the door, with a message that names the database.
    assert_eq!(startup_b.first_error(), "28000", "{seen:#?}");
    assert!(
        startup_b.errors[0].1.contains(&db_b),
        "{:?}",
        startup_b.errors
    );
}

/// Goal (review M1, the fix): `--allow-database` serves another database only after checking
/// it as the URL's (under `--verify-key`: a proof key and a current guard), and each database's
/// sessions use that database's proof key.
/// Method: databases A (the URL's) and C with `init --require-verified`, B with a plain init;
/// a `--verify-key` proxy with `--allow-database B` must refuse to start naming B; one with
/// `--allow-database C` serves C: a sequencer set at startup writes there and is recorded.
/// Then C's guard is replaced by one without the current revision line (as an older init left
/// it): a `--verify-key` proxy must refuse to start, naming init.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_m1_allow_database_checks_each_database() {
    lockd_tests::skip_without_postgres!();
    let direct = pg::connect(&pg::direct_url().parse().unwrap()).await;
    let (db_a, _drop_a) = database(&direct, "review_m1x_a").await;
    let (db_b, _drop_b) = database(&direct, "review_m1x_b").await;
    let (db_c, _drop_c) = database(&direct, "review_m1x_c").await;
    let table = format!("{}.lockd_fence", pg::unique_name("review_m1x"));
    pg::try_init_guard_with(&url_of(&db_a), &table, true).unwrap();
    pg::try_init_guard_with(&url_of(&db_b), &table, false).unwrap();
    pg::try_init_guard_with(&url_of(&db_c), &table, true).unwrap();
    let keys = Keys::new();
    let args = |allow: &str| {
        let mut args = pg::proxy_args(url_of(&db_a), table.clone(), false);
        args.verify_key = vec![keys.file.clone()];
        args.allow_database = vec![allow.to_owned()];
        args
    };

    let e = PgProxy::try_start_args(args(&db_b))
        .err()
        .expect("a plain database under --verify-key");
    let e = format!("{e:#}");
    assert!(e.contains(&db_b) && e.contains("--require-verified"), "{e}");

    let in_c = pg::connect(&url_of(&db_c).parse().unwrap()).await;
    in_c.batch_execute("CREATE TABLE m1_rows (token bigint NOT NULL)")
        .await
        .unwrap();
    let proxy = PgProxy::start_args(args(&db_c));
    let resource = pg::unique_name("review_m1x");
    let options = format!("-c lockd.fence={}", keys.fence(&resource, 7));
    let (mut s, r) = RawConn::start(
        proxy.addr,
        &[
            ("user", pg::PG_USER),
            ("database", &db_c),
            ("options", &options),
        ],
    )
    .await;
    assert!(r.errors.is_empty(), "{r:?}");
    let r = s.query("INSERT INTO m1_rows VALUES (7)").await;
    assert!(r.errors.is_empty(), "{r:?}");
    assert_eq!(recorded(&in_c, &table, &resource).await, Some(7));
    drop((s, proxy));

    let guard = fence_proxy_postgres::fence_sql::FenceTable::parse(&table)
        .unwrap()
        .guard_function();
    in_c.batch_execute(&format!(
        "CREATE OR REPLACE FUNCTION {guard}(require_fence boolean, proofs text[], at_commit boolean) \
         RETURNS void LANGUAGE sql SECURITY DEFINER AS 'SELECT NULL::void'"
    ))
    .await
    .unwrap();
    let e = PgProxy::try_start_args(args(&db_c))
        .err()
        .expect("an older guard under --verify-key");
    let e = format!("{e:#}");
    assert!(e.contains(&db_c) && e.contains("init"), "{e}");
}

/// Goal (review M1, the guard's half): a guard called with proofs (from a proxy with
/// `--verify-key`) never takes a plain token, even when its table has no proof key: the proof
/// key's row deleted while such a proxy runs (or a database the proxy's start-up check never
/// saw) must fail closed, not fall back to plain tokens.
/// Method: a fence table with a proof key in a database of its own; a `--verify-key` proxy in
/// front of it; the proof key's row deleted directly; an unfenced session sets a plain token
/// with `set_config` inside a data statement and inserts. The guard must refuse (28000), and
/// nothing is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_m1_guard_with_proofs_refuses_a_table_without_proof_key() {
    lockd_tests::skip_without_postgres!();
    let direct = pg::connect(&pg::direct_url().parse().unwrap()).await;
    let (db, _drop) = database(&direct, "review_m1_key").await;
    let table = format!("{}.lockd_fence", pg::unique_name("review_m1_key"));
    pg::try_init_guard_with(&url_of(&db), &table, true).unwrap();
    let in_db = pg::connect(&url_of(&db).parse().unwrap()).await;
    in_db
        .batch_execute("CREATE TABLE m1_rows (token bigint NOT NULL)")
        .await
        .unwrap();
    let keys = Keys::new();
    let resource = pg::unique_name("review_m1_key");
    let proxy = verifying_proxy(url_of(&db), &table, &keys, false);
    in_db
        .execute(
            "DELETE FROM lockd_fence_proxy.proof_key WHERE fence_table = $1",
            &[&table],
        )
        .await
        .unwrap();
    let (mut s, r) = RawConn::start(proxy.addr, &[("user", pg::PG_USER), ("database", &db)]).await;
    assert!(r.errors.is_empty(), "{r:?}");
    let r = s
        .query(&format!(
            "SELECT set_config('lockd.fence', '{resource}:999999', false); INSERT INTO m1_rows VALUES (999999)"
        ))
        .await;
    eprintln!("set_config and INSERT without a proof key -> {r:?}");
    assert_eq!(
        (
            recorded(&in_db, &table, &resource).await,
            count(&in_db, "m1_rows").await
        ),
        (None, 0),
        "a guard called with proofs took a plain token on a table without proof key: {r:?}"
    );
    assert_eq!(r.first_error(), "28000", "{r:?}");
}

/// A fence table with a proof key in the shared database, a data table, and a `--verify-key`
/// proxy in front of them.
struct Verified {
    keys: Keys,
    table: String,
    tbl: String,
    resource: String,
    direct: tokio_postgres::Client,
    proxy: PgProxy,
}

impl Verified {
    async fn new(prefix: &str) -> Verified {
        let table = format!("{}.lockd_fence", pg::unique_name(prefix));
        pg::init_guard_with(&pg::direct_url(), &table, true);
        let direct = pg::connect(&pg::direct_url().parse().unwrap()).await;
        let tbl = pg::unique_name(prefix);
        direct
            .batch_execute(&format!("CREATE TABLE {tbl} (token bigint NOT NULL)"))
            .await
            .unwrap();
        let keys = Keys::new();
        let proxy = verifying_proxy(pg::direct_url(), &table, &keys, false);
        Verified {
            keys,
            table,
            tbl,
            resource: pg::unique_name(prefix),
            direct,
            proxy,
        }
    }

    /// A startup with the user and database, then `params`.
    async fn start(&self, params: &[(&str, &str)]) -> (RawConn, RawReply) {
        let mut all = vec![("user", pg::PG_USER), ("database", pg::PG_DATABASE)];
        all.extend_from_slice(params);
        RawConn::start(self.proxy.addr, &all).await
    }
}

/// Goal (review L1): the proxy reads the startup fence as Postgres sets it. Postgres applies
/// `options` first and the startup parameters after them, so a `lockd.fence` parameter wins over
/// the options; GUC names are case-insensitive; `options` are read by getopt, so `-ec name=value`
/// is `-e` and `-c name=value`. The proxy applied the parameter first (and refused a valid
/// parameter because of a malformed option Postgres overrides), and did not see bundled switches
/// or differently-cased names.
/// Method: a `--verify-key` proxy; startups with (1) a verified parameter and a malformed option:
/// the session starts and writes under the verified token; (2) `-ec lockd.fence=<r>:999999`,
/// (3) a parameter `LOCKD.FENCE=<r>:999999`, (4) the verified value as option and a plain
/// parameter: each refused at startup (28000, a plain token, which is what Postgres holds), never
/// a session whose fence differs from the one the proxy checked; (5) `lockd.` in a form the proxy
/// does not read exactly (a non-ASCII byte in the options): refused at startup.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_l1_startup_fence_is_read_as_postgres_reads_it() {
    lockd_tests::skip_without_postgres!();
    let w = Verified::new("review_l1").await;
    let r = &w.resource;
    let mut broken = Vec::new();

    let good = w.keys.fence(r, 6);
    let (mut s, reply) = w
        .start(&[
            ("options", "-c lockd.fence=garbage"),
            ("lockd.fence", &good),
        ])
        .await;
    if reply.errors.is_empty() {
        let ins = s.query(&format!("INSERT INTO {} VALUES (6)", w.tbl)).await;
        if !ins.errors.is_empty() || recorded(&w.direct, &w.table, r).await != Some(6) {
            broken.push(format!(
                "verified parameter and malformed option: the INSERT got {}",
                errors(&ins)
            ));
        }
    } else {
        broken.push(format!(
            "verified parameter and malformed option: refused at startup {}",
            errors(&reply)
        ));
    }

    let plain = format!("{r}:999999");
    let bundled = format!("-ec lockd.fence={plain}");
    let option_good = format!("-c lockd.fence={good}");
    let cases: [(&str, Vec<(&str, &str)>); 3] = [
        ("bundled -ec", vec![("options", bundled.as_str())]),
        (
            "upper-case parameter",
            vec![("LOCKD.FENCE", plain.as_str())],
        ),
        (
            "verified option, plain parameter",
            vec![
                ("options", option_good.as_str()),
                ("lockd.fence", plain.as_str()),
            ],
        ),
    ];
    for (what, params) in cases {
        let (_s, reply) = w.start(&params).await;
        if reply.first_error() != "28000" || !reply.errors[0].1.contains(r.as_str()) {
            broken.push(format!(
                "{what}: startup got {} (expected FATAL 28000 naming the resource)",
                errors(&reply)
            ));
        }
    }
    let odd = format!("-c\u{a0}lockd.fence={good}");
    let (_s, reply) = w.start(&[("options", &odd)]).await;
    if reply.errors.is_empty() || !reply.errors[0].1.contains("lockd.") {
        broken.push(format!(
            "non-ASCII options naming lockd.: startup got {} (expected a FATAL naming lockd.)",
            errors(&reply)
        ));
    }
    assert_eq!(
        recorded(&w.direct, &w.table, r).await.unwrap_or(6),
        6,
        "{broken:#?}"
    );
    assert!(broken.is_empty(), "{broken:#?}");
}

/// Goal (review L3): a client that stops reading must not hold up the proxy's shutdown. Writes
/// to the client happened inside the session's handlers, where the shutdown was not watched, and
/// the proxy waited for every session without a bound: after SIGTERM it ran until the client
/// went away.
/// Method: a client with a 4 KiB receive buffer sends a SELECT of about 50 MB and reads nothing;
/// once the proxy's writes block, its shutdown token is cancelled; the proxy must return within
/// 15 s (the grace is 5 s), with the client still connected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_l3_a_client_that_stops_reading_does_not_block_shutdown() {
    lockd_tests::skip_without_postgres!();
    let args = pg::proxy_args(pg::direct_url(), pg::fence_table(), false);
    let addr = args.listen;
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
    let socket = loop {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        match socket.connect(addr).await {
            Ok(s) => break s,
            Err(_) if !proxy.is_finished() => tokio::time::sleep(Duration::from_millis(20)).await,
            Err(e) => panic!("the proxy did not start: {e}"),
        }
    };
    let (mut client, reply) = RawConn::start_on(
        socket,
        &[("user", pg::PG_USER), ("database", pg::PG_DATABASE)],
    )
    .await;
    assert!(reply.errors.is_empty(), "{reply:?}");
    let mut out = bytes::BytesMut::new();
    postgres_protocol::message::frontend::query(
        "SELECT repeat('x', 1000000) FROM generate_series(1, 50)",
        &mut out,
    )
    .unwrap();
    client.send(&out).await;
    // Long enough for the rows to fill the client's buffer and the proxy's writes to block.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let asked = Instant::now();
    shutdown.cancel();
    while !proxy.is_finished() && asked.elapsed() < Duration::from_secs(15) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took = asked.elapsed();
    eprintln!(
        "the proxy returned {took:?} after shutdown: {}",
        proxy.is_finished()
    );
    let stopped = proxy.is_finished();
    // Lets a proxy that is still waiting end, so the test process does not hang.
    drop(client);
    let _ = proxy.join();
    assert!(
        stopped,
        "the proxy was still running {took:?} after shutdown, held by a client that stopped reading"
    );
}

/// Goal (review M1, second round): a served database is the database the proxy checked at
/// start, not whatever database bears its name later. A clone of a served database (`CREATE
/// DATABASE ... TEMPLATE`, a restore) has the same guard, fence table and table OIDs, and records
/// the tokens of the moment it was taken; an application role that owns both and has CREATEDB
/// can rename the clone into the served name through the proxy (`ALTER DATABASE ... RENAME` runs
/// in a block), and a holder whose token the original had already refused then commits in it.
/// Method: role `o` (LOGIN CREATEDB); database A (the URL's) and C (`--allow-database`, owned by
/// `o`), each with `init --grant-to o`, and a data table in C. Through the proxy, the holder of
/// token 5 writes in C; C is cloned (`TEMPLATE`, owned by `o`) while 5 is the highest; the holder
/// of 6 writes; the holder of 5 is refused (55P03). Then `o`, in a session on A through the
/// proxy, renames C away and the clone in under C's name. The holder of 5 connects to C again and
/// inserts, through a proxy without and one with `--require-fence` (both started before the
/// swap): each must be refused, and no row of it may be written in the database now named C.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_m1_a_clone_renamed_into_a_served_name_takes_no_stale_token() {
    lockd_tests::skip_without_postgres!();
    let direct = pg::connect(&pg::direct_url().parse().unwrap()).await;
    let role = pg::unique_name("review_m1r_o");
    let db_a = pg::unique_name("review_m1r_a");
    let db_c = pg::unique_name("review_m1r_c");
    let db_old = format!("{db_c}_old");
    let db_clone = pg::unique_name("review_m1r_clone");
    // Databases first (they may be under any of these names by then), then the role.
    let _cleanup = pg::SqlOnDrop(vec![
        format!("DROP DATABASE IF EXISTS {db_a} WITH (FORCE)"),
        format!("DROP DATABASE IF EXISTS {db_c} WITH (FORCE)"),
        format!("DROP DATABASE IF EXISTS {db_old} WITH (FORCE)"),
        format!("DROP DATABASE IF EXISTS {db_clone} WITH (FORCE)"),
        format!("DROP ROLE IF EXISTS {role}"),
    ]);
    // One at a time: CREATE DATABASE cannot run in the implicit block of several statements.
    for sql in [
        format!("CREATE ROLE {role} LOGIN CREATEDB"),
        format!("CREATE DATABASE {db_a}"),
        format!("CREATE DATABASE {db_c} OWNER {role}"),
    ] {
        direct.batch_execute(&sql).await.unwrap();
    }
    let table = format!("{}.lockd_fence", pg::unique_name("review_m1r"));
    for db in [&db_a, &db_c] {
        pg::try_init(fence_proxy_postgres::InitArgs {
            upstream: url_of(db),
            fence_table: table.clone(),
            grant_to: vec![role.clone()],
            require_verified: false,
            token_floor: None,
        })
        .unwrap();
    }
    {
        let in_c = pg::connect(&url_of(&db_c).parse().unwrap()).await;
        in_c.batch_execute(&format!(
            "CREATE TABLE m1r_rows (v text NOT NULL); GRANT SELECT, INSERT ON m1r_rows TO {role}"
        ))
        .await
        .unwrap();
    }
    let proxies = [false, true].map(|require_fence| {
        let mut args = pg::proxy_args(url_of(&db_a), table.clone(), require_fence);
        args.allow_database = vec![db_c.clone()];
        PgProxy::start_args(args)
    });
    let proxy = &proxies[0];
    let resource = pg::unique_name("review_m1r");
    let holder = |token: u64, addr: std::net::SocketAddr| {
        let options = format!("-c lockd.fence={resource}:{token}");
        let (role, db_c) = (role.clone(), db_c.clone());
        async move {
            RawConn::start(
                addr,
                &[
                    ("user", role.as_str()),
                    ("database", db_c.as_str()),
                    ("options", options.as_str()),
                ],
            )
            .await
        }
    };

    let (mut s, r) = holder(5, proxy.addr).await;
    assert!(r.errors.is_empty(), "{r:?}");
    let r = s.query("INSERT INTO m1r_rows VALUES ('5')").await;
    assert!(r.errors.is_empty(), "holder of 5: {r:?}");
    drop(s);
    // An operator's copy of C (a staging clone, a restore) while 5 is the highest token; the
    // template must have no session, which Postgres waits up to 5 s for.
    direct
        .batch_execute(&format!(
            "CREATE DATABASE {db_clone} TEMPLATE {db_c} OWNER {role}"
        ))
        .await
        .unwrap();
    let (mut s, r) = holder(6, proxy.addr).await;
    assert!(r.errors.is_empty(), "{r:?}");
    let r = s.query("INSERT INTO m1r_rows VALUES ('6')").await;
    assert!(r.errors.is_empty(), "holder of 6: {r:?}");
    drop(s);
    let (mut s, r) = holder(5, proxy.addr).await;
    assert!(r.errors.is_empty(), "{r:?}");
    let r = s.query("INSERT INTO m1r_rows VALUES ('5-late')").await;
    assert_eq!(r.first_error(), crate::STALE, "holder of 5 after 6: {r:?}");
    drop(s);

    // The swap, by the application role through the proxy, from a session on A.
    let (mut attacker, r) =
        RawConn::start(proxy.addr, &[("user", &role), ("database", &db_a)]).await;
    assert!(r.errors.is_empty(), "{r:?}");
    for (from, to) in [(&db_c, &db_old), (&db_clone, &db_c)] {
        let r = attacker
            .query(&format!("ALTER DATABASE {from} RENAME TO {to}"))
            .await;
        assert!(r.errors.is_empty(), "renaming {from} to {to}: {r:?}");
    }
    drop(attacker);

    let mut seen = Vec::new();
    for (i, proxy) in proxies.iter().enumerate() {
        let (mut s, r) = holder(5, proxy.addr).await;
        let what = format!("holder of 5 after the swap (require_fence {})", i == 1);
        if !r.errors.is_empty() {
            seen.push((what, "startup".to_owned(), r));
            continue;
        }
        let r = s
            .query(&format!("INSERT INTO m1r_rows VALUES ('5-stale-{i}')"))
            .await;
        seen.push((what, "INSERT".to_owned(), r));
    }
    eprintln!("{seen:#?}");
    let now_c = pg::connect(&url_of(&db_c).parse().unwrap()).await;
    let stale: i64 = now_c
        .query_one(
            "SELECT count(*) FROM m1r_rows WHERE v LIKE '5-stale-%'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        stale, 0,
        "a token-5 holder committed in the clone renamed into {db_c}, after 6 was recorded: {seen:#?}"
    );
    for (what, at, r) in &seen {
        assert!(
            r.first_error() == "28000"
                && r.errors[0].1.contains(&db_c)
                && r.errors[0].1.contains("restart"),
            "{what}: {at} got {r:?}, expected FATAL 28000 naming {db_c} and saying to restart the proxy"
        );
    }
}

/// Goal (review M1, second round): under `--verify-key` the proxy needs a guard of revision 5 or
/// later; the guard of a later init, whose revision line carries a higher number, must not be
/// refused (the check looked for revision 5's exact line), and one below, or without the line,
/// still is.
/// Method: a database with `init --require-verified`; its guard replaced by a no-op whose body
/// has the revision line with 6, then with 4, then none; a `--verify-key` proxy must start on
/// the first and refuse the others, naming init.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_m1_a_later_guard_revision_is_accepted() {
    lockd_tests::skip_without_postgres!();
    let direct = pg::connect(&pg::direct_url().parse().unwrap()).await;
    let (db, _drop) = database(&direct, "review_m1v").await;
    let table = format!("{}.lockd_fence", pg::unique_name("review_m1v"));
    pg::try_init_guard_with(&url_of(&db), &table, true).unwrap();
    let in_db = pg::connect(&url_of(&db).parse().unwrap()).await;
    let guard = fence_proxy_postgres::fence_sql::FenceTable::parse(&table)
        .unwrap()
        .guard_function();
    let keys = Keys::new();
    for (line, starts) in [
        ("-- fence-proxy guard revision 6: a later one", true),
        ("-- fence-proxy guard revision 4: an older one", false),
        ("-- no revision line", false),
    ] {
        in_db
            .batch_execute(&format!(
                "CREATE OR REPLACE FUNCTION {guard}(require_fence boolean, proofs text[], at_commit boolean) \
                 RETURNS void LANGUAGE plpgsql SECURITY DEFINER AS $g$ BEGIN\n{line}\nEND $g$"
            ))
            .await
            .unwrap();
        let mut args = pg::proxy_args(url_of(&db), table.clone(), false);
        args.verify_key = vec![keys.file.clone()];
        match PgProxy::try_start_args(args) {
            Ok(proxy) => {
                drop(proxy);
                assert!(starts, "{line}: the proxy started");
            }
            Err(e) => {
                let e = format!("{e:#}");
                assert!(!starts, "{line}: the proxy refused to start: {e}");
                assert!(e.contains(&db) && e.contains("init"), "{line}: {e}");
            }
        }
    }
}
