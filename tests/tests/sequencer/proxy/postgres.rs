//! The Postgres front end verifies sequencers offline; a refused SET keeps the old fence, unsigned
//! tokens pass only when allowed, and the start-up checks name the problem.

use std::path::{Path, PathBuf};

use super::{POISON, bad_sequencers, seq, write_public_key};
use lockd_fence::sequencer::SigningKey;
use lockd_tests::pg::{self, PgProxy, RawConn};

/// A fence table of its own whose guard requires verified fences, a data table, and a proxy
/// with verify keys `keys`.
struct PgWorld {
    table: String,
    tbl: String,
    resource: String,
    direct: tokio_postgres::Client,
    proxy: PgProxy,
}

impl PgWorld {
    async fn new(prefix: &str, keys: &[&Path], allow_unsigned: bool) -> PgWorld {
        pg::require_postgres();
        let table = format!("{}.lockd_fence", pg::unique_name(prefix));
        pg::init_guard_with(&pg::direct_url(), &table, true);
        let direct = pg::connect(&pg::direct_url().parse().unwrap()).await;
        let tbl = pg::unique_name(prefix);
        direct
            .batch_execute(&format!(
                "CREATE TABLE {tbl} (id bigserial PRIMARY KEY, token bigint NOT NULL)"
            ))
            .await
            .unwrap();
        let proxy = PgWorld::proxy(&table, keys, allow_unsigned);
        PgWorld {
            table,
            tbl,
            resource: pg::unique_name("res"),
            direct,
            proxy,
        }
    }

    fn proxy(table: &str, keys: &[&Path], allow_unsigned: bool) -> PgProxy {
        let mut args = pg::proxy_args(pg::direct_url(), table.to_owned(), false);
        args.verify_key = keys.iter().map(|p| p.to_path_buf()).collect();
        args.allow_unsigned = allow_unsigned;
        PgProxy::start_args(args)
    }

    async fn recorded(&self) -> Option<i64> {
        self.direct
            .query_opt(
                &format!("SELECT token FROM {} WHERE resource = $1", self.table),
                &[&self.resource],
            )
            .await
            .unwrap()
            .map(|r| r.get(0))
    }

    async fn rows(&self) -> i64 {
        self.direct
            .query_one(&format!("SELECT count(*) FROM {}", self.tbl), &[])
            .await
            .unwrap()
            .get(0)
    }

    fn insert(&self, token: i64) -> String {
        format!("INSERT INTO {} (token) VALUES ({token})", self.tbl)
    }

    fn fence(&self, sequencer: &str) -> String {
        format!("{}:{sequencer}", self.resource)
    }

    async fn session(&self, fence: Option<&str>) -> RawConn {
        let options = fence.map(|f| format!("-c lockd.fence={f}"));
        RawConn::connect(self.proxy.addr, pg::PG_USER, options.as_deref()).await
    }
}

async fn ok(conn: &mut RawConn, sql: &str) {
    let reply = conn.query(sql).await;
    assert!(reply.errors.is_empty(), "{sql}: {:?}", reply.errors);
}

async fn refused(conn: &mut RawConn, sql: &str, code: &str, what: &str) -> String {
    let reply = conn.query(sql).await;
    assert_eq!(
        reply.first_error(),
        code,
        "{what}: {sql}: {:?}",
        reply.errors
    );
    reply.errors[0].1.clone()
}

#[tokio::test]
async fn postgres_verifies_sequencers_offline() {
    lockd_tests::skip_without_postgres!();
    let dir = tempfile::tempdir().unwrap();
    let k1 = SigningKey::generate();
    let k2 = SigningKey::generate();
    let p1 = write_public_key(dir.path(), "k1.pub.pem", &k1);
    let p2 = write_public_key(dir.path(), "k2.pub.pem", &k2);
    let w = PgWorld::new("seq_pg", &[&p1, &p2], false).await;
    let r = w.resource.clone();

    // Accepted: a sequencer in the startup options, and one set with SET.
    let mut s = w.session(Some(&w.fence(&seq(&k1, &r, 10)))).await;
    ok(&mut s, &w.insert(10)).await;
    assert_eq!(w.recorded().await, Some(10));
    ok(
        &mut s,
        &format!("SET lockd.fence = '{}'", w.fence(&seq(&k1, &r, 11))),
    )
    .await;
    ok(&mut s, &w.insert(11)).await;
    assert_eq!(w.recorded().await, Some(11));
    // Key rotation: the second key's sequencers verify too.
    ok(
        &mut s,
        &format!("SET lockd.fence = '{}'", w.fence(&seq(&k2, &r, 12))),
    )
    .await;
    ok(&mut s, &w.insert(12)).await;
    assert_eq!(w.recorded().await, Some(12));
    let rows = w.rows().await;

    // Refused at SET: forgeries 42501, plain tokens (the poisoning one included) 28000. The
    // statement does not run, so the session keeps its verified fence and writes with it.
    let mut a = w.session(None).await;
    for (what, bad) in bad_sequencers(&k1, &r) {
        let msg = refused(
            &mut a,
            &format!("SET lockd.fence = '{}'", w.fence(&bad)),
            "42501",
            what,
        )
        .await;
        assert!(
            msg.contains(&r),
            "{what}: the message names the resource: {msg}"
        );
        assert_eq!(w.recorded().await, Some(12), "{what}");
    }
    for token in ["13", &POISON.to_string()] {
        let msg = refused(
            &mut a,
            &format!("SET lockd.fence = '{r}:{token}'"),
            "28000",
            token,
        )
        .await;
        assert!(msg.contains(&r), "{msg}");
    }
    // In one query with a write: nothing of it runs.
    refused(
        &mut a,
        &format!(
            "SET lockd.fence = '{r}:{POISON}'; {}",
            w.insert(POISON as i64)
        ),
        "28000",
        "SET and INSERT in one query",
    )
    .await;
    // Over the extended protocol: the Parse fails.
    let mut out = bytes::BytesMut::new();
    pg::wire::run(&format!("SET lockd.fence = '{r}:{POISON}'"), &mut out);
    pg::wire::run(&w.insert(POISON as i64), &mut out);
    pg::wire::sync(&mut out);
    a.send(&out).await;
    let reply = a.read_until_ready().await;
    assert_eq!(reply.first_error(), "28000", "{:?}", reply.errors);
    assert_eq!(reply.status, b'I');
    assert_eq!(w.recorded().await, Some(12));
    assert_eq!(w.rows().await, rows, "a refused session wrote");

    // Spellings the proxy does not read reach the guard without a proof: refused there, with
    // nothing recorded or written. Calling the guard directly with made-up proofs does not help.
    let guard = {
        let t = fence_proxy_postgres::fence_sql::FenceTable::parse(&w.table).unwrap();
        t.guard_function()
    };
    for (value, code) in [
        (format!("{r}:{POISON}"), "28000"),
        (w.fence(&bad_sequencers(&k1, &r)[0].1), "42501"),
    ] {
        let mut b = w.session(None).await;
        // On its own the set_config runs in the proxy's block, whose commit guard refuses it;
        // in a client block the guard before COMMIT does.
        refused(
            &mut b,
            &format!("SELECT set_config('lockd.fence', '{value}', false)"),
            code,
            "set_config",
        )
        .await;
        refused(
            &mut b,
            &format!(
                "BEGIN; SELECT set_config('lockd.fence', '{value}', false); {}; COMMIT",
                w.insert(POISON as i64)
            ),
            code,
            "set_config and a write in a block",
        )
        .await;
        // A session with a verified fence switches to the unverified value after the proxy's
        // guard ran, and calls the guard itself with a made-up proof: the MAC does not match.
        let mut c = w.session(Some(&w.fence(&seq(&k1, &r, 12)))).await;
        ok(&mut c, "BEGIN").await;
        ok(&mut c, &format!("SELECT count(*) FROM {}", w.tbl)).await;
        ok(
            &mut c,
            &format!("SELECT set_config('lockd.fence', '{value}', false)"),
        )
        .await;
        refused(
            &mut c,
            &format!(
                "SELECT {guard}(false, ARRAY['{POISON}:{}'], true)",
                "0".repeat(64)
            ),
            code,
            "direct guard call with a forged proof",
        )
        .await;
        ok(&mut c, "ROLLBACK").await;
        assert_eq!(w.recorded().await, Some(12), "{value}");
    }
    assert_eq!(w.rows().await, rows, "an unverified fence wrote");

    // A startup fence that does not verify is FATAL before anything reaches the upstream.
    for (value, code) in [
        (w.fence(&bad_sequencers(&k1, &r)[4].1), "42501"),
        (format!("{r}:{POISON}"), "28000"),
    ] {
        let err = tokio_postgres::connect(
            &format!("{} options='-c lockd.fence={value}'", pg_conninfo(&w.proxy)),
            tokio_postgres::NoTls,
        )
        .await
        .err()
        .expect("refused at startup");
        let code_seen = err.as_db_error().map(|d| d.code().code().to_owned());
        assert_eq!(code_seen.as_deref(), Some(code), "{err:?}");
    }
    assert_eq!(w.recorded().await, Some(12));
}

fn pg_conninfo(proxy: &PgProxy) -> String {
    format!(
        "host={} port={} user={} dbname={}",
        proxy.addr.ip(),
        proxy.addr.port(),
        pg::PG_USER,
        pg::PG_DATABASE
    )
}

/// A refused SET is a failed SET, as in Postgres: the session keeps its previous (verified)
/// fence; inside the client's block it aborts the block, so nothing of it commits.
#[tokio::test]
async fn postgres_refused_set_keeps_the_old_fence_and_aborts_the_block() {
    lockd_tests::skip_without_postgres!();
    let dir = tempfile::tempdir().unwrap();
    let k = SigningKey::generate();
    let p = write_public_key(dir.path(), "k.pub.pem", &k);
    let w = PgWorld::new("seq_pg_set", &[&p], false).await;
    let r = w.resource.clone();
    let good = w.fence(&seq(&k, &r, 20));
    let mut s = w.session(None).await;
    ok(&mut s, &format!("SET lockd.fence = '{good}'")).await;

    ok(&mut s, "BEGIN").await;
    ok(&mut s, &w.insert(20)).await;
    refused(
        &mut s,
        &format!("SET lockd.fence = '{r}:{POISON}'"),
        "28000",
        "in a block",
    )
    .await;
    let reply = s.query(&w.insert(20)).await;
    assert_eq!(
        reply.first_error(),
        "25P02",
        "the block is aborted: {:?}",
        reply.errors
    );
    assert_eq!(reply.status, b'E');
    ok(&mut s, "COMMIT").await;
    assert_eq!(w.rows().await, 0, "the aborted block committed");
    // The SET on its own ran in a guarded block of the proxy's, which recorded 20 already.
    assert_eq!(w.recorded().await, Some(20));

    // Outside a block: the old fence stays and still writes.
    let bad = w.fence(&bad_sequencers(&k, &r)[1].1);
    refused(
        &mut s,
        &format!("SET lockd.fence = '{bad}'"),
        "42501",
        "outside a block",
    )
    .await;
    let reply = s
        .query(&format!(
            "DO $$ BEGIN IF current_setting('lockd.fence') <> '{good}' THEN RAISE EXCEPTION 'fence changed'; END IF; END $$"
        ))
        .await;
    assert!(reply.errors.is_empty(), "{:?}", reply.errors);
    ok(&mut s, &w.insert(20)).await;
    assert_eq!(w.recorded().await, Some(20));
    assert_eq!(w.rows().await, 1);
}

#[tokio::test]
async fn postgres_allow_unsigned_lets_plain_tokens_through() {
    lockd_tests::skip_without_postgres!();
    let dir = tempfile::tempdir().unwrap();
    let k = SigningKey::generate();
    let p = write_public_key(dir.path(), "k.pub.pem", &k);
    let w = PgWorld::new("seq_pg_unsigned", &[&p], true).await;
    let r = w.resource.clone();
    let mut s = w.session(Some(&format!("{r}:30"))).await;
    ok(&mut s, &w.insert(30)).await;
    assert_eq!(w.recorded().await, Some(30));
    ok(
        &mut s,
        &format!("SET lockd.fence = '{}'", w.fence(&seq(&k, &r, 31))),
    )
    .await;
    ok(&mut s, &w.insert(31)).await;
    assert_eq!(w.recorded().await, Some(31));
    // Forgeries are still refused, and a plain value the proxy never saw has no proof.
    for (what, bad) in bad_sequencers(&k, &r) {
        refused(
            &mut s,
            &format!("SET lockd.fence = '{}'", w.fence(&bad)),
            "42501",
            what,
        )
        .await;
    }
    refused(
        &mut s,
        &format!(
            "BEGIN; SELECT set_config('lockd.fence', '{r}:{POISON}', false); {}; COMMIT",
            w.insert(1)
        ),
        "28000",
        "plain value set by set_config",
    )
    .await;
    assert_eq!(w.recorded().await, Some(31));
}

/// The start-up checks: bad key files name the file; a proxy with keys needs a guard that
/// requires verified fences, and a guard that requires them needs a proxy with keys.
#[test]
fn postgres_start_checks() {
    lockd_tests::skip_without_postgres!();
    let dir = tempfile::tempdir().unwrap();
    let k = SigningKey::generate();
    let good = write_public_key(dir.path(), "k.pub.pem", &k);
    let private = dir.path().join("private.pem");
    std::fs::write(&private, k.to_pem()).unwrap();
    let plain_table = format!("{}.lockd_fence", pg::unique_name("seq_plain"));
    pg::init_guard(&pg::direct_url(), &plain_table);
    let verified_table = format!("{}.lockd_fence", pg::unique_name("seq_verified"));
    pg::init_guard_with(&pg::direct_url(), &verified_table, true);

    let run = |table: &str, keys: Vec<PathBuf>| -> String {
        let mut args = pg::proxy_args(pg::direct_url(), table.to_owned(), false);
        args.verify_key = keys;
        let result = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(fence_proxy_postgres::run(
                args,
                tokio_util::sync::CancellationToken::new(),
            ));
        format!("{:#}", result.expect_err("the proxy must not start"))
    };
    let e = run(&verified_table, vec![private.clone()]);
    assert!(e.contains(&private.display().to_string()), "{e}");
    let e = run(&plain_table, vec![good.clone()]);
    assert!(e.contains("--require-verified"), "{e}");
    let e = run(&verified_table, Vec::new());
    assert!(e.contains("--verify-key"), "{e}");
}
