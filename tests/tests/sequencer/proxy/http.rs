//! The HTTP front end verifies sequencers offline; a bad key file fails at start naming it.

use super::{POISON, bad_sequencers, seq, write_public_key};
use lockd_fence::sequencer::SigningKey;
use lockd_tests::fence_proxy::{FenceProxy, Reply};
use lockd_tests::http_upstream::HttpUpstream;
use lockd_tests::pg::{self};
use lockd_tests::process::command;

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
    lockd_tests::skip_without_postgres!();
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
    // The verified token goes upstream as a Fencing-Token, also when only a sequencer came.
    assert_eq!(upstream.writes()[0].header("fencing-token"), Some("10"));

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
