//! Signed fencing tokens at fence-proxy: with `--verify-key` both front ends accept a
//! write only with a sequencer that verifies offline; a forged, altered or foreign one, or a plain
//! token where a sequencer is required, is refused and changes no recorded epoch.
//!
//! Keys and sequencers are made here with `lockd_fence::sequencer::SigningKey`, as lockd makes
//! them. Epochs are read straight from the stores (the HTTP proxy's Postgres store table, the
//! Postgres front end's fence table).

use std::path::{Path, PathBuf};

use lockd_fence::FencingToken;
use lockd_fence::sequencer::{SigningKey, encode_text};
use lockd_tests::fence_proxy::{FenceProxy, Reply};
use lockd_tests::http_upstream::HttpUpstream;
use lockd_tests::pg::{self, PgProxy, RawConn};
use lockd_tests::process::command;

/// Offsets in a sequencer (see `lockd_fence::sequencer`): token, resource, and the signature at
/// the end.
const TOKEN_AT: usize = 12;
const RESOURCE_AT: usize = 30;

const POISON: u64 = i64::MAX as u64;

fn write_public_key(dir: &Path, name: &str, key: &SigningKey) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, key.public_key().to_pem()).unwrap();
    path
}

fn seq(key: &SigningKey, resource: &str, token: u64) -> String {
    encode_text(&key.sign(resource, FencingToken(token), 1_700_000_000_000))
}

/// Sequencers that must not verify for `resource` with `ours` among the verify keys, each with
/// what it is.
fn bad_sequencers(ours: &SigningKey, resource: &str) -> Vec<(&'static str, String)> {
    let foreign = SigningKey::generate();
    let mut forged_sig = ours.sign(resource, FencingToken(POISON), 0);
    let last = forged_sig.len() - 1;
    forged_sig[last] ^= 0x01;
    let mut altered_token = ours.sign(resource, FencingToken(5), 0);
    altered_token[TOKEN_AT..TOKEN_AT + 8].copy_from_slice(&POISON.to_be_bytes());
    let mut altered_resource = ours.sign(resource, FencingToken(POISON), 0);
    altered_resource[RESOURCE_AT] ^= 0x01;
    vec![
        ("forged signature", encode_text(&forged_sig)),
        ("altered token", encode_text(&altered_token)),
        ("altered resource", encode_text(&altered_resource)),
        (
            "sequencer for another resource",
            seq(ours, &format!("{resource}-other"), POISON),
        ),
        ("unknown key", seq(&foreign, resource, POISON)),
        ("not base64", "!!!not-base64!!!".to_owned()),
        (
            "base64 of garbage",
            encode_text(b"LKS1 definitely not a sequencer"),
        ),
    ]
}

// ----- HTTP --------------------------------------------------------------------------------------

async fn recorded_http(
    direct: &tokio_postgres::Client,
    table: &str,
    resource: &str,
) -> Option<i64> {
    direct
        .query_opt(
            &format!("SELECT token FROM {table} WHERE resource = $1"),
            &[&resource],
        )
        .await
        .unwrap()
        .map(|r| r.get(0))
}

async fn put_signed(proxy: &FenceProxy, resource: &str, headers: &[(&str, &str)]) -> Reply {
    let mut all = vec![("Lock-Resource", resource)];
    all.extend_from_slice(headers);
    lockd_tests::fence_proxy::send("PUT", &proxy.url("/obj"), &all, "body")
        .await
        .unwrap()
}

fn assert_refused(reply: &Reply, status: u16, reason: &str, what: &str) {
    assert_eq!(reply.status, status, "{what}: {reply:?}");
    assert_eq!(reply.proxy_error(), Some(reason), "{what}: {reply:?}");
    let json = reply.json();
    assert_eq!(json["error"], reason, "{what}: {reply:?}");
    assert!(
        json["message"]
            .as_str()
            .unwrap_or("")
            .starts_with("fence-proxy: "),
        "{what}: {reply:?}"
    );
}

#[tokio::test]
async fn http_verifies_sequencers_offline() {
    pg::require_postgres();
    let dir = tempfile::tempdir().unwrap();
    let k1 = SigningKey::generate();
    let k2 = SigningKey::generate();
    let p1 = write_public_key(dir.path(), "k1.pub.pem", &k1);
    let p2 = write_public_key(dir.path(), "k2.pub.pem", &k2);
    let table = pg::unique_name("seq_http_epochs");
    let direct = pg::connect(&pg::direct_url().parse().unwrap()).await;
    let upstream = HttpUpstream::start().await.unwrap();
    let (p1s, p2s) = (p1.display().to_string(), p2.display().to_string());
    let proxy = FenceProxy::start(
        &upstream.url(),
        &pg::direct_url(),
        &[
            "--store-table",
            &table,
            "--verify-key",
            &p1s,
            "--verify-key",
            &p2s,
        ],
    )
    .await
    .unwrap();
    let r = pg::unique_name("orders/seq");

    // A verified sequencer is accepted and records its token; a plain token beside it must agree.
    let reply = put_signed(&proxy, &r, &[("Lock-Sequencer", &seq(&k1, &r, 10))]).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(recorded_http(&direct, &table, &r).await, Some(10));
    let reply = put_signed(
        &proxy,
        &r,
        &[
            ("Lock-Sequencer", &seq(&k1, &r, 10)),
            ("Fencing-Token", "10"),
        ],
    )
    .await;
    assert_eq!(reply.status, 200, "{reply:?}");
    let writes = upstream.writes().len();
    assert_eq!(writes, 2);

    // Every forgery: 403 bad-sequencer, nothing forwarded, the epoch unchanged.
    for (what, bad) in bad_sequencers(&k1, &r) {
        let reply = put_signed(&proxy, &r, &[("Lock-Sequencer", &bad)]).await;
        assert_refused(&reply, 403, "bad-sequencer", what);
        assert_eq!(recorded_http(&direct, &table, &r).await, Some(10), "{what}");
    }
    let reply = put_signed(
        &proxy,
        &r,
        &[
            ("Lock-Sequencer", &seq(&k1, &r, 11)),
            ("Fencing-Token", &POISON.to_string()),
        ],
    )
    .await;
    assert_refused(
        &reply,
        403,
        "bad-sequencer",
        "token disagreeing with the sequencer",
    );
    // Plain tokens, the poisoning one included: 403 sequencer-required.
    for token in ["11", &POISON.to_string()] {
        let reply = put_signed(&proxy, &r, &[("Fencing-Token", token)]).await;
        assert_refused(&reply, 403, "sequencer-required", token);
        assert!(
            reply.json()["message"].as_str().unwrap().contains(&r),
            "{reply:?}"
        );
    }
    // No fence at all is still 428.
    let reply = put_signed(&proxy, &r, &[]).await;
    assert_refused(&reply, 428, "fence-required", "no fence");
    assert_eq!(recorded_http(&direct, &table, &r).await, Some(10));
    assert_eq!(
        upstream.writes().len(),
        writes,
        "a refused write was forwarded"
    );

    // Key rotation: sequencers of the second key verify too; the order of tokens still holds.
    let reply = put_signed(&proxy, &r, &[("Lock-Sequencer", &seq(&k2, &r, 12))]).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(recorded_http(&direct, &table, &r).await, Some(12));
    let reply = put_signed(&proxy, &r, &[("Lock-Sequencer", &seq(&k1, &r, 11))]).await;
    assert_refused(
        &reply,
        412,
        "stale-fencing-token",
        "older verified sequencer",
    );

    // --allow-unsigned (migration): plain tokens pass, forgeries are still refused.
    let migrating = FenceProxy::start(
        &upstream.url(),
        &pg::direct_url(),
        &[
            "--store-table",
            &table,
            "--verify-key",
            &p1s,
            "--allow-unsigned",
        ],
    )
    .await
    .unwrap();
    let reply = put_signed(&migrating, &r, &[("Fencing-Token", "13")]).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(recorded_http(&direct, &table, &r).await, Some(13));
    for (what, bad) in bad_sequencers(&k1, &r) {
        let reply = put_signed(&migrating, &r, &[("Lock-Sequencer", &bad)]).await;
        assert_refused(&reply, 403, "bad-sequencer", what);
    }
    // A sequencer of a key this proxy was not given (k2) is foreign to it.
    let reply = put_signed(&migrating, &r, &[("Lock-Sequencer", &seq(&k2, &r, 14))]).await;
    assert_refused(&reply, 403, "bad-sequencer", "key not given to this proxy");
    assert_eq!(recorded_http(&direct, &table, &r).await, Some(13));

    let _ = direct
        .batch_execute(&format!("DROP TABLE IF EXISTS {table}"))
        .await;
}

#[test]
fn http_bad_key_file_fails_at_start_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let private = dir.path().join("not-a-public-key.pem");
    std::fs::write(&private, SigningKey::generate().to_pem()).unwrap();
    let missing = dir.path().join("missing.pem");
    for bad in [&private, &missing] {
        let out = command("fence-proxy")
            .args([
                "http",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:9",
                "--store",
                &format!("redb:{}", dir.path().join("e.redb").display()),
                "--verify-key",
                &bad.display().to_string(),
            ])
            .output()
            .unwrap();
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(&bad.display().to_string()),
            "the error names the file: {stderr}"
        );
    }
}

// ----- Postgres ----------------------------------------------------------------------------------

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
    pg::require_postgres();
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
