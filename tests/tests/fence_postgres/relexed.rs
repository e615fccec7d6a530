//! Client text the proxy sends after other client statements of the same query have run. Those
//! statements may change how the server lexes text (`standard_conforming_strings`,
//! `client_encoding`), so text the proxy classified before they ran can mean something else by
//! the time it runs. Found in the review of 2026-12-03 (issue 13): the COMMIT at the end of a
//! multi-statement query, sent after the guard as the client's own text.

use lockd_tests::pg::{self, Attack, PgProxy};

/// Attack: under `--require-fence`, on a server with prepared transactions enabled, an unfenced
/// session sends one Query,
/// `SET standard_conforming_strings = off; PREPARE TRANSACTION 'a\' -- '; INSERT ...`.
/// Read with the setting on (as the proxy read it), that is a SET and a PREPARE TRANSACTION,
/// the rest a comment. The proxy runs the SET in its block, then the guard before the commit
/// (which passes: nothing was written; the transaction becomes read-only), then the commit.
/// Sent as the client's text, the server read it with the setting off: the literal ends at the
/// second quote, PREPARE TRANSACTION ends the guarded block, and the INSERT ran and committed in
/// an implicit transaction of its own, unfenced. (Where a guard fails instead, the abort puts
/// the setting back before the commit is read, so a stale session cannot use this.)
/// Oracle: no row commits; the proxy sends the commit rebuilt from the parse tree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_sent_after_a_lexer_setting_changed_is_the_one_the_proxy_read() {
    lockd_tests::skip_without_postgres!();
    let cluster = pg::PrivateCluster::start_with(&["max_prepared_transactions=4"])
        .unwrap_or_else(|reason| panic!("cannot start a private Postgres cluster: {reason}"));
    let admin = cluster.admin().await;
    admin
        .batch_execute("CREATE TABLE relexed (token bigint NOT NULL)")
        .await
        .unwrap();
    let proxy = PgProxy::start_with(cluster.url("postgres"), true);
    let mut config: tokio_postgres::Config = proxy.url_as("postgres", "postgres").parse().unwrap();
    config.password(pg::PRIVATE_PASSWORD);

    for (what, setting) in [
        ("SET", "SET standard_conforming_strings = off"),
        ("SET LOCAL", "SET LOCAL standard_conforming_strings = off"),
    ] {
        let unfenced = pg::connect(&config).await;
        let result = unfenced
            .batch_execute(&format!(
                "{setting}; PREPARE TRANSACTION 'a\\' -- '; INSERT INTO relexed VALUES (0)"
            ))
            .await;
        eprintln!("{what}: {result:?}");
        let committed: i64 = admin
            .query_one("SELECT count(*) FROM relexed", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(
            committed, 0,
            "{what}: an unfenced INSERT committed under --require-fence ({result:?})"
        );
        // A transaction the attack prepared holds nothing the next round needs; clear it.
        for row in admin
            .query("SELECT gid FROM pg_prepared_xacts", &[])
            .await
            .unwrap()
        {
            let gid: String = row.get(0);
            admin
                .batch_execute(&format!(
                    "ROLLBACK PREPARED E'{}'",
                    gid.replace('\'', "''").replace('\\', "\\\\")
                ))
                .await
                .unwrap();
        }
    }
}

/// Attack: a PREPARE TRANSACTION whose identifier the proxy cannot rebuild (not printable ASCII)
/// at the end of a multi-statement query. Oracle: the query is refused with 0A000 before any of
/// it runs, nothing commits, and the session goes on (its next query meets the guard).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_the_proxy_cannot_rebuild_is_refused() {
    lockd_tests::skip_without_postgres!();
    let attack = Attack::new(false, "relexed_gid").await;
    let mut conn = attack.attacker(Some(41)).await;
    let reply = conn
        .query(&format!("{}; PREPARE TRANSACTION 'ü'", attack.insert(41)))
        .await;
    assert_eq!(reply.first_error(), "0A000", "{reply:?}");
    assert!(reply.completions.is_empty(), "nothing ran: {reply:?}");
    assert_eq!(reply.status, b'I', "{reply:?}");
    attack
        .assert_nothing_committed("a refused PREPARE TRANSACTION")
        .await;
    // The session is served on, and still refused as stale.
    let after = conn.query("SELECT 1").await;
    assert_eq!(after.first_error(), "55P03", "{after:?}");
    assert_eq!(after.status, b'I', "{after:?}");
}
