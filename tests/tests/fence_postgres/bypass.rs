//! Attacks on the guard (docs/fence-proxy-postgres.md, "Design"). Setup for each: a resource
//! whose token 42 is recorded through the proxy, a table `(id bigserial, token bigint)` where every
//! write carries the writer's token, and an attacking session fenced with 41 (or unfenced under
//! --require-fence). The oracle is always the table itself: no row written by the attacker
//! committed.

use std::time::Duration;

use lockd_tests::pg::{self, PgProxy};
use lockd_tests::pg::{Attack, RawConn, wire};

/// Goal: a failed transaction must not let a statement after ROLLBACK or
/// ROLLBACK TO SAVEPOINT in the same query run without the fence.
/// Method: BEGIN; SELECT 1/0; then `ROLLBACK; INSERT` in one query; and `ROLLBACK TO SAVEPOINT s;
/// INSERT` then COMMIT; with fence 41 (42 recorded) and unfenced under --require-fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_bypass1_failed_transaction_skips_the_guard() {
    lockd_tests::skip_without_postgres!();
    for require_fence in [false, true] {
        let a = Attack::new(require_fence, "attack").await;
        let token = (!require_fence).then_some(41);
        let mut c = a.attacker(token).await;
        c.query("BEGIN").await;
        c.query("SELECT 1/0").await;
        let r = c.query(&format!("ROLLBACK; {}", a.insert(41))).await;
        eprintln!("ROLLBACK; INSERT -> {:?}", r.errors);
        c.query("ROLLBACK").await;
        a.assert_nothing_committed("ROLLBACK; INSERT").await;

        c.query("BEGIN").await;
        c.query("SAVEPOINT s").await;
        c.query("SELECT 1/0").await;
        let r = c
            .query(&format!("ROLLBACK TO SAVEPOINT s; {}", a.insert(41)))
            .await;
        eprintln!("ROLLBACK TO; INSERT -> {:?}", r.errors);
        let r = c.query("COMMIT").await;
        eprintln!("COMMIT -> {:?}", r.errors);
        a.assert_nothing_committed("ROLLBACK TO SAVEPOINT s; INSERT; COMMIT")
            .await;
    }
}

/// Goal: the kind of a statement name comes from what the upstream holds.
/// Method: (a) Parse s1 = SHOW, SQL DEALLOCATE s1, SQL PREPARE s1 AS INSERT, Bind/Execute s1.
/// (b) Parse s2 = INSERT, Sync; Parse s2 = SHOW (the upstream answers 42P05); Bind/Execute s2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_bypass2_statement_kinds_go_stale() {
    lockd_tests::skip_without_postgres!();
    let a = Attack::new(false, "attack").await;
    let mut c = a.attacker(Some(41)).await;
    let mut out = bytes::BytesMut::new();
    wire::parse("s1", "SHOW work_mem", &mut out);
    wire::sync(&mut out);
    c.send(&out).await;
    c.read_until_ready().await;
    c.query("DEALLOCATE s1").await;
    c.query(&format!("PREPARE s1 AS {}", a.insert(41))).await;
    let mut out = bytes::BytesMut::new();
    wire::bind("", "s1", &mut out);
    wire::execute("", &mut out);
    wire::sync(&mut out);
    c.send(&out).await;
    let r = c.read_until_ready().await;
    eprintln!("(a) -> {:?}", r.errors);
    a.assert_nothing_committed("(a) SQL PREPARE over a SHOW name")
        .await;

    let mut out = bytes::BytesMut::new();
    wire::parse("s2", &a.insert(41), &mut out);
    wire::sync(&mut out);
    wire::parse("s2", "SHOW work_mem", &mut out);
    wire::sync(&mut out);
    c.send(&out).await;
    c.read_until_ready().await;
    let r = c.read_until_ready().await;
    assert_eq!(r.first_error(), "42P05", "{r:?}");
    let mut out = bytes::BytesMut::new();
    wire::bind("", "s2", &mut out);
    wire::execute("", &mut out);
    wire::sync(&mut out);
    c.send(&out).await;
    let r = c.read_until_ready().await;
    eprintln!("(b) -> {:?}", r.errors);
    a.assert_nothing_committed("(b) failed re-Parse of s2")
        .await;
}

/// Goal: RESET ALL after a write in the same query, and DISCARD ALL refused
/// inside a block, must not unfence the write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_bypass3_reset_all_and_discard_all() {
    lockd_tests::skip_without_postgres!();
    let a = Attack::new(false, "attack").await;
    let mut c = a.attacker(Some(41)).await;
    let r = c.query(&format!("{}; RESET ALL", a.insert(41))).await;
    eprintln!("INSERT; RESET ALL -> {:?}", r.errors);
    a.assert_nothing_committed("INSERT; RESET ALL").await;

    let mut c = a.attacker(Some(41)).await;
    c.query("BEGIN").await;
    let r = c.query("DISCARD ALL").await;
    // Refused by Postgres inside a block (25001), or by the guard first (55P03).
    assert!(!r.errors.is_empty(), "DISCARD ALL inside a block: {r:?}");
    c.query("ROLLBACK").await;
    let shown = c.query("SHOW lockd.fence").await;
    eprintln!("SHOW after refused DISCARD ALL -> {shown:?}");
    let r = c.query(&a.insert(41)).await;
    eprintln!("INSERT after refused DISCARD ALL -> {:?}", r.errors);
    a.assert_nothing_committed("INSERT after a refused DISCARD ALL")
        .await;
}

/// Goal: a DO block (or procedure) cannot COMMIT its way out of the guard.
/// Method: the attacker holds 41 (current) and runs, over the extended protocol, a DO block that
/// inserts, COMMITs, sleeps while the holder of 42 records and writes, then inserts again. No row
/// of 41 may land after 42's. Under --require-fence, an unfenced DO that COMMITs then inserts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_bypass4_commit_inside_do_block() {
    lockd_tests::skip_without_postgres!();
    let proxy = PgProxy::start(false);
    let direct = pg::connect(&pg::direct_url().parse().unwrap()).await;
    let resource = pg::unique_name("do_commit");
    let tbl = pg::unique_name("do_commit");
    direct
        .batch_execute(&format!(
            "CREATE TABLE {tbl} (id bigserial PRIMARY KEY, token bigint NOT NULL)"
        ))
        .await
        .unwrap();
    let mut c = RawConn::connect(
        proxy.addr,
        pg::PG_USER,
        Some(&format!("-c lockd.fence={resource}:41")),
    )
    .await;
    let mut out = bytes::BytesMut::new();
    wire::run(
        &format!(
            "DO $$ BEGIN INSERT INTO {tbl} (token) VALUES (41); COMMIT; PERFORM pg_sleep(2); \
             INSERT INTO {tbl} (token) VALUES (41); END $$"
        ),
        &mut out,
    );
    wire::sync(&mut out);
    c.send(&out).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    let holder = pg::connect(&proxy.config(Some(&format!("{resource}:42")))).await;
    let newer = tokio::time::timeout(
        Duration::from_secs(10),
        holder.execute(&format!("INSERT INTO {tbl} (token) VALUES (42)"), &[]),
    )
    .await
    .expect("42's write finishes");
    let r = c.read_until_ready().await;
    eprintln!("DO with COMMIT -> {:?}; 42's write -> {newer:?}", r.errors);
    let late: i64 = direct
        .query_one(
            &format!(
                "SELECT count(*) FROM {tbl} WHERE token = 41 AND id > \
                 coalesce((SELECT min(id) FROM {tbl} WHERE token = 42), 0)"
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(late, 0, "a row of 41 committed after 42's");

    let a = Attack::new(true, "attack").await;
    let mut c = a.attacker(None).await;
    let mut out = bytes::BytesMut::new();
    wire::run(
        &format!("DO $$ BEGIN COMMIT; {}; END $$", a.insert(41)),
        &mut out,
    );
    wire::sync(&mut out);
    c.send(&out).await;
    let r = c.read_until_ready().await;
    eprintln!("require-fence DO COMMIT; INSERT -> {:?}", r.errors);
    let r = c
        .query(&format!("CALL pg_catalog.pg_sleep(0); {}", a.insert(41)))
        .await;
    eprintln!("require-fence CALL; INSERT -> {:?}", r.errors);
    a.assert_nothing_committed("unfenced DO that COMMITs").await;
}

/// Goal: the proxy reads statement boundaries exactly as Postgres does.
/// Method: under --require-fence, unfenced: a dollar tag made of bytes >= 0x80 hiding
/// `COMMIT; INSERT`; and `standard_conforming_strings = off` with `'\''` doing the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_bypass5_splitter_disagrees_with_postgres() {
    lockd_tests::skip_without_postgres!();
    let a = Attack::new(true, "attack").await;
    let mut c = a.attacker(None).await;
    let r = c
        .query(&format!(
            "SELECT $€$ $$ $€$; COMMIT; {}; SELECT $€$ $$ $€$",
            a.insert(41)
        ))
        .await;
    eprintln!("dollar tag -> {:?}", r.errors);
    c.query("ROLLBACK").await;
    a.assert_nothing_committed("dollar tag with non-letter bytes")
        .await;

    let mut c = a.attacker(None).await;
    c.query("SET standard_conforming_strings = off").await;
    let r = c
        .query(&format!(
            "SELECT '\\'' ; COMMIT; {}; SELECT ' '",
            a.insert(41)
        ))
        .await;
    eprintln!("standard_conforming_strings off -> {:?}", r.errors);
    c.query("ROLLBACK").await;
    a.assert_nothing_committed("standard_conforming_strings = off")
        .await;
}

/// Goal: every spelling of the fence setting is the fence: what Postgres
/// holds is what is checked.
/// Method: an unfenced session sets `<resource>:41` inside its transaction with quoted
/// identifiers, U&"", set_config, then writes and commits: in one query, and as separate queries
/// of one block. A role whose ALTER ROLE ... SET gives the fence writes in autocommit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_bypass6_spellings_of_the_setting() {
    lockd_tests::skip_without_postgres!();
    let a = Attack::new(false, "attack").await;
    let r = &a.resource;
    for set in [
        format!("SET \"lockd\".\"fence\" = '{r}:41'"),
        format!("SET lockd.\"fence\" TO '{r}:41'"),
        format!("SET U&\"lockd\".U&\"fenc\\0065\" = '{r}:41'"),
        format!("SELECT set_config('lockd.fence', '{r}:41', false)"),
        format!("SET LOCAL lockd.fence = '{r}:41'"),
    ] {
        let mut c = a.attacker(None).await;
        let w = c
            .query(&format!("BEGIN; {set}; {}; COMMIT", a.insert(41)))
            .await;
        eprintln!("BEGIN; {set}; INSERT; COMMIT -> {:?}", w.errors);
        c.query("ROLLBACK").await;
        a.assert_nothing_committed(&set).await;
        c.query("BEGIN").await;
        c.query(&set).await;
        c.query(&a.insert(41)).await;
        let w = c.query("COMMIT").await;
        eprintln!("separate queries, {set} -> {:?}", w.errors);
        a.assert_nothing_committed(&set).await;
    }
    let role = pg::unique_name("attacker_role");
    a.direct
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN; ALTER ROLE {role} SET lockd.fence = '{r}:41'; \
             GRANT ALL ON {t} TO {role}; GRANT ALL ON SEQUENCE {t}_id_seq TO {role}; {grant}",
            t = a.tbl,
            grant = pg::grant_guard_sql(&role),
        ))
        .await
        .unwrap();
    let mut c = RawConn::connect(a.proxy.addr, &role, None).await;
    let w = c.query(&a.insert(41)).await;
    eprintln!("ALTER ROLE SET -> {:?}", w.errors);
    a.direct
        .batch_execute(&format!("DROP OWNED BY {role}; DROP ROLE {role}"))
        .await
        .ok();
    a.assert_nothing_committed("ALTER ROLE ... SET lockd.fence")
        .await;
}

/// Goal: the fence table cannot be shadowed by a temporary table or a
/// search_path without public.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_bypass7_fence_table_shadowed() {
    lockd_tests::skip_without_postgres!();
    let a = Attack::new(false, "attack").await;
    let mut c = a.attacker(Some(41)).await;
    let r = c
        .query(
            "CREATE TEMP TABLE lockd_fence (resource text PRIMARY KEY, token bigint NOT NULL, \
             updated_at timestamptz NOT NULL)",
        )
        .await;
    eprintln!("CREATE TEMP TABLE -> {:?}", r.errors);
    let r = c.query(&a.insert(41)).await;
    eprintln!("INSERT with temp table -> {:?}", r.errors);
    a.assert_nothing_committed("temporary lockd_fence").await;

    let schema = pg::unique_name("attacker_schema");
    a.direct
        .batch_execute(&format!("CREATE SCHEMA {schema}"))
        .await
        .unwrap();
    let mut c = a.attacker(Some(41)).await;
    c.query(&format!("SET search_path = {schema}")).await;
    let r = c
        .query(&format!("INSERT INTO public.{} (token) VALUES (41)", a.tbl))
        .await;
    eprintln!("INSERT with search_path = {schema} -> {:?}", r.errors);
    a.direct
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .await
        .unwrap();
    a.assert_nothing_committed("search_path without public")
        .await;
}

/// Goal (robustness): a second guard in one block works (the proxy's portal is closed
/// after use), as pgjdbc's autosave needs: a savepoint rolled back, then more writes, then COMMIT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_robustness_second_guard_in_one_block() {
    lockd_tests::skip_without_postgres!();
    let a = Attack::new(false, "attack").await;
    let mut client = pg::connect(&a.proxy.config(Some(&format!("{}:42", a.resource)))).await;
    let mut tx = client.transaction().await.unwrap();
    tx.execute(&a.insert(42), &[]).await.unwrap();
    {
        let sp = tx.savepoint("sp").await.unwrap();
        sp.execute(&a.insert(42), &[]).await.unwrap();
        sp.rollback().await.unwrap();
    }
    tx.execute(&a.insert(42), &[])
        .await
        .expect("write after ROLLBACK TO");
    tx.execute(&a.insert(42), &[]).await.unwrap();
    tx.commit().await.unwrap();
    let n: i64 = a
        .direct
        .query_one(&format!("SELECT count(*) FROM {}", a.tbl), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 4);
}

/// Goal (robustness): with the documented setup (the table owned by the init role, the
/// client an application role granted by `init`), fenced writes work and the application role
/// can neither lower nor delete fence rows, directly or through the proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_robustness_app_role_grants() {
    lockd_tests::skip_without_postgres!();
    let a = Attack::new(false, "attack").await;
    let role = pg::unique_name("app_role");
    a.direct
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN; GRANT ALL ON {t} TO {role}; \
             GRANT ALL ON SEQUENCE {t}_id_seq TO {role}; {grant}",
            t = a.tbl,
            grant = pg::grant_guard_sql(&role),
        ))
        .await
        .unwrap();
    let mut app = RawConn::connect(
        a.proxy.addr,
        &role,
        Some(&format!("-c lockd.fence={}:43", a.resource)),
    )
    .await;
    let w = app.query(&a.insert(42)).await;
    let table = pg::fence_table();
    let lower = app.query(&format!("UPDATE {table} SET token = 0")).await;
    let delete = app.query(&format!("DELETE FROM {table}")).await;
    let mut plain = RawConn::connect(a.proxy.addr, &role, None).await;
    let lower2 = plain.query(&format!("UPDATE {table} SET token = 0")).await;
    a.direct
        .batch_execute(&format!("DROP OWNED BY {role}; DROP ROLE {role}"))
        .await
        .ok();
    assert!(w.errors.is_empty(), "fenced write of the app role: {w:?}");
    for (what, r) in [
        ("UPDATE", lower),
        ("DELETE", delete),
        ("UPDATE unfenced", lower2),
    ] {
        assert_eq!(
            r.first_error(),
            "42501",
            "{what} of the fence table by the app role: {r:?}"
        );
    }
}

/// Goal (robustness): the number and total size of statement names the proxy tracks
/// per session are bounded.
/// Method: Parse transaction-control statements under 64 KiB names until the proxy refuses with
/// 54000 (program_limit_exceeded), well before 8 MiB of names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_robustness_unbounded_statement_names() {
    lockd_tests::skip_without_postgres!();
    let proxy = PgProxy::start(false);
    let mut c = RawConn::connect(proxy.addr, pg::PG_USER, None).await;
    let mut refused = None;
    for i in 0..128 {
        let name = format!("{i:04}{}", "n".repeat(64 * 1024));
        let mut out = bytes::BytesMut::new();
        wire::parse(&name, "COMMIT", &mut out);
        wire::sync(&mut out);
        c.send(&out).await;
        let r = c.read_until_ready().await;
        if !r.errors.is_empty() || r.status == b'X' {
            refused = Some((i, r));
            break;
        }
    }
    let (i, r) = refused.expect("128 names of 64 KiB were all tracked");
    assert_eq!(r.first_error(), "54000", "{r:?}");
    eprintln!("refused at name {i}: {:?}", r.errors);
}
