//! `fence-proxy epochs max`: the highest token a store or fence table has accepted, the floor of
//! a lock cluster restored from a backup (`lockd restore --token-floor`).

use std::process::Stdio;

use lockd_tests::fence_proxy::FenceProxy;
use lockd_tests::http_upstream::HttpUpstream;
use lockd_tests::pg;
use lockd_tests::process::bin_path;

/// `fence-proxy ARGS`: exit code, stdout, stderr.
async fn fence_proxy(args: &[&str]) -> (Option<i32>, String, String) {
    let out = tokio::process::Command::new(bin_path("fence-proxy"))
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json(stdout: &str) -> serde_json::Value {
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout:?}"))
}

/// Goal: `fence-proxy epochs max` prints the highest token over all resources of a redb epoch
/// store, also the file of a proxy that was killed (redb must repair it first), and says
/// clearly when a running proxy holds the file; the same for a Postgres epoch store and a
/// Postgres front end's fence table. Method: writes through a real proxy with a redb store,
/// read while it runs and after kill -9; rows written into a Postgres store table and a fence
/// table of the shared test database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn epochs_max_prints_the_highest_token_of_every_kind_of_store() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("epochs.redb");
    let store = format!("redb:{}", path.display());
    let upstream = HttpUpstream::start().await.unwrap();
    let mut proxy = FenceProxy::start(&upstream.url(), &store, &[])
        .await
        .unwrap();
    for (resource, token) in [("orders/1", "17"), ("orders/2", "4242"), ("orders/1", "18")] {
        let r = proxy
            .write("POST", "/x", (Some(resource), Some(token)), &[], "")
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{r:?}");
    }
    // Held by the running proxy: refused, saying why and what to do.
    let (code, _, stderr) = fence_proxy(&["epochs", "max", "--store", &store]).await;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("held open by a running process")
            && stderr.contains("stop that proxy")
            && stderr.contains("epochs.redb"),
        "{stderr}"
    );
    // Killed: the file needs redb's repair, which `epochs max` does.
    proxy.kill();
    let (code, stdout, stderr) = fence_proxy(&["epochs", "max", "--store", &store, "--json"]).await;
    assert_eq!(code, Some(0), "{stderr}");
    let j = json(&stdout);
    assert_eq!(j["highest_token"].as_u64(), Some(4242), "{j}");
    assert_eq!(j["resource"].as_str(), Some("orders/2"));
    assert_eq!(j["resources"].as_u64(), Some(2));
    let (code, stdout, stderr) = fence_proxy(&["epochs", "max", "--store", &store]).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.starts_with("4242\t"), "{stdout}");

    // No store named: a clear refusal.
    let (code, _, stderr) = fence_proxy(&["epochs", "max"]).await;
    assert_ne!(code, Some(0));
    assert!(
        stderr.contains("--store") && stderr.contains("--upstream"),
        "{stderr}"
    );

    // Postgres: an epoch store table and a fence table.
    pg::require_postgres();
    let url = pg::direct_url();
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let epochs = pg::unique_name("epochs");
    let fences = pg::unique_name("fence");
    client
        .batch_execute(&format!(
            "CREATE TABLE {epochs} (resource text PRIMARY KEY, token bigint NOT NULL, \
               busy_until timestamptz, updated_at timestamptz NOT NULL DEFAULT now()); \
             INSERT INTO {epochs} (resource, token) VALUES ('a', 5), ('b', 9000000000), ('c', 7); \
             CREATE TABLE {fences} (resource text PRIMARY KEY, token bigint NOT NULL, \
               updated_at timestamptz NOT NULL DEFAULT now()); \
             INSERT INTO {fences} (resource, token) VALUES ('x', 31), ('y', 30);"
        ))
        .await
        .unwrap();
    let store_run = fence_proxy(&[
        "epochs",
        "max",
        "--store",
        &url,
        "--store-table",
        &epochs,
        "--json",
    ])
    .await;
    let table_run = fence_proxy(&[
        "epochs",
        "max",
        "--upstream",
        &url,
        "--fence-table",
        &fences,
        "--json",
    ])
    .await;
    client
        .batch_execute(&format!("DROP TABLE {epochs}; DROP TABLE {fences};"))
        .await
        .unwrap();
    assert_eq!(store_run.0, Some(0), "{}", store_run.2);
    let j = json(&store_run.1);
    assert_eq!(j["highest_token"].as_u64(), Some(9_000_000_000), "{j}");
    assert_eq!(j["resources"].as_u64(), Some(3));
    // The table it read, schema-qualified (found through the search_path), to compare with the
    // proxy's --store-table.
    let qualified = format!("public.{epochs}");
    assert_eq!(j["table"].as_str(), Some(qualified.as_str()), "{j}");
    assert!(j["source"].as_str().unwrap().contains(&qualified), "{j}");
    assert_eq!(table_run.0, Some(0), "{}", table_run.2);
    let j = json(&table_run.1);
    assert_eq!(j["highest_token"].as_u64(), Some(31), "{j}");
    assert_eq!(j["resource"].as_str(), Some("x"));
    let qualified = format!("public.{fences}");
    assert_eq!(j["table"].as_str(), Some(qualified.as_str()), "{j}");
}
