//! TLS and client access of fence-proxy: the Postgres front end terminating TLS for
//! psql and connecting to an upstream that requires it, `--require-tls`, `--allow-client`, and
//! the HTTP front end over HTTPS towards an https upstream.
//!
//! Method: throwaway CAs and certificates (rcgen, `lockd_tests::tls::TestCa`); real psql, real
//! curl, the machine's Postgres, and private Postgres clusters started from the installed server
//! binaries for the upstreams that require TLS. Each test says which attack it refutes.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use fence_proxy_postgres::AccessArgs;
use lockd_tests::fence_proxy::FenceProxy;
use lockd_tests::http_upstream::HttpUpstream;
use lockd_tests::pg::{
    self, PG_DATABASE, PG_USER, PRIVATE_PASSWORD, PgProxy, PrivateCluster, direct_url, free_port,
    unique_name,
};
use lockd_tests::tls::{Issued, TestCa};

const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// Runs psql with a libpq connection string and one command; `env` adds PGOPTIONS and the like.
fn psql(conninfo: &str, sql: &str, env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new("psql");
    cmd.args([
        "-X",
        "--no-psqlrc",
        "-At",
        "-v",
        "ON_ERROR_STOP=1",
        "-v",
        "VERBOSITY=verbose",
    ])
    .arg("-d")
    .arg(conninfo)
    .arg("-c")
    .arg(sql)
    .env_remove("PGSSLMODE")
    .env("PGCONNECT_TIMEOUT", "10")
    .stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("running psql (postgresql-client)")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).trim().to_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).trim().to_owned()
}

fn assert_ok(o: &Output, what: &str) -> String {
    assert!(
        o.status.success(),
        "{what} failed: {}\n{}",
        stderr(o),
        stdout(o)
    );
    stdout(o)
}

fn assert_fails_with(o: &Output, needle: &str, what: &str) {
    assert!(!o.status.success(), "{what} succeeded: {}", stdout(o));
    assert!(
        stderr(o).contains(needle),
        "{what}: expected {needle:?} in: {}",
        stderr(o)
    );
}

/// A libpq connection string for the proxy at `addr`, as the shared database's user.
fn via(addr: SocketAddr, ssl: &str) -> String {
    format!(
        "host={} port={} user={PG_USER} dbname={PG_DATABASE} {ssl}",
        addr.ip(),
        addr.port()
    )
}

/// A proxy certificate naming `localhost` and 127.0.0.1, from a fresh CA.
fn proxy_ca(dir: &Path) -> (TestCa, Issued) {
    let ca = TestCa::new(dir, "pxtls").unwrap();
    let cert = ca
        .issue("proxy", &["localhost".to_owned()], &[LOOPBACK])
        .unwrap();
    (ca, cert)
}

fn tls_access(cert: &Issued) -> AccessArgs {
    AccessArgs {
        tls_cert: Some(cert.cert.clone()),
        tls_key: Some(cert.key.clone()),
        ..AccessArgs::default()
    }
}

/// The highest token the shared database's fence table holds for `resource`.
fn recorded_token(resource: &str) -> String {
    let o = psql(
        &direct_url(),
        &format!(
            "SELECT token FROM {} WHERE resource = '{resource}'",
            pg::fence_table()
        ),
        &[],
    );
    assert_ok(&o, "reading the fence table")
}

/// The `/usr/lib/postgresql/*/bin` holding initdb and postgres, or `None` (the test is skipped).
fn server_binaries() -> Option<PathBuf> {
    std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("bin"))
        .find(|p| p.join("initdb").exists() && p.join("postgres").exists())
}

/// Attack: an eavesdropper or man in the middle between a client and the proxy. psql with
/// sslmode=verify-full reaches the proxy over TLS, checks its certificate and name, and a fenced
/// write goes through the guard (a stale one is still refused); a client that does not trust the
/// proxy's CA refuses the connection.
#[test]
fn psql_verify_full_through_the_proxy() {
    pg::require_postgres();
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert) = proxy_ca(dir.path());
    let proxy = PgProxy::start_with_access(direct_url(), false, tls_access(&cert)).unwrap();
    let table = unique_name("tls_rows");
    let resource = unique_name("tls_res");
    let full = format!("sslmode=verify-full sslrootcert={}", ca.cert_path.display());

    let o = psql(
        &via(proxy.addr, &full),
        &format!("CREATE TABLE {table} (x int)"),
        &[],
    );
    assert_ok(&o, "psql verify-full");
    let fence7 = format!("-c lockd.fence={resource}:7");
    let o = psql(
        &via(proxy.addr, &full),
        &format!("INSERT INTO {table} VALUES (7)"),
        &[("PGOPTIONS", &fence7)],
    );
    assert_ok(&o, "fenced insert over TLS");
    assert_eq!(recorded_token(&resource), "7");
    let fence6 = format!("-c lockd.fence={resource}:6");
    let o = psql(
        &via(proxy.addr, &full),
        &format!("INSERT INTO {table} VALUES (6)"),
        &[("PGOPTIONS", &fence6)],
    );
    assert_fails_with(&o, "55P03", "stale insert over TLS");

    // The name is checked too: localhost is in the certificate, so verify-full by name works.
    let o = psql(
        &format!(
            "host=localhost hostaddr=127.0.0.1 port={} user={PG_USER} dbname={PG_DATABASE} {full}",
            proxy.addr.port()
        ),
        "SELECT 1",
        &[],
    );
    assert_ok(&o, "verify-full by host name");

    // A client that trusts another CA refuses the proxy.
    let other = TestCa::new(dir.path(), "other").unwrap();
    let o = psql(
        &via(
            proxy.addr,
            &format!(
                "sslmode=verify-full sslrootcert={}",
                other.cert_path.display()
            ),
        ),
        "SELECT 1",
        &[],
    );
    assert_fails_with(&o, "certificate verify failed", "psql trusting another CA");

    let o = psql(&direct_url(), &format!("DROP TABLE {table}"), &[]);
    assert_ok(&o, "cleanup");
}

/// Attack: a client (or a downgrading man in the middle) that skips TLS. Under --require-tls a
/// plain-text session is refused with FATAL 28000 before the upstream is contacted; TLS clients
/// get through. Without --require-tls the same plain client would be served.
#[test]
fn require_tls_refuses_plain_text() {
    pg::require_postgres();
    let dir = tempfile::tempdir().unwrap();
    let (_ca, cert) = proxy_ca(dir.path());
    let access = AccessArgs {
        require_tls: true,
        ..tls_access(&cert)
    };
    let proxy = PgProxy::start_with_access(direct_url(), false, access).unwrap();
    let o = psql(&via(proxy.addr, "sslmode=disable"), "SELECT 1", &[]);
    assert_fails_with(&o, "requires TLS", "plain text under --require-tls");
    let o = psql(&via(proxy.addr, "sslmode=require"), "SELECT 'in'", &[]);
    assert_eq!(assert_ok(&o, "TLS under --require-tls"), "in");

    // The same proxy without --require-tls serves plain text (the test above can fail).
    let open = PgProxy::start_with_access(direct_url(), false, tls_access(&cert)).unwrap();
    let o = psql(&via(open.addr, "sslmode=disable"), "SELECT 'plain'", &[]);
    assert_eq!(assert_ok(&o, "plain text without --require-tls"), "plain");
}

/// Attack: a client from a network that should not reach the database at all, relying on the
/// upstream's `host ... <proxy address> trust` line. With --allow-client it is refused with
/// FATAL 28000 naming its address, in plain text and when it asks for TLS; an allowed network
/// gets through.
#[test]
fn allow_client_refuses_other_networks() {
    pg::require_postgres();
    let dir = tempfile::tempdir().unwrap();
    let (_ca, cert) = proxy_ca(dir.path());
    let refusing = AccessArgs {
        allow_client: vec!["10.0.0.0/8".parse().unwrap(), "fd00::/8".parse().unwrap()],
        ..tls_access(&cert)
    };
    let proxy = PgProxy::start_with_access(direct_url(), false, refusing).unwrap();
    for ssl in ["sslmode=disable", "sslmode=prefer"] {
        let o = psql(&via(proxy.addr, ssl), "SELECT 1", &[]);
        assert_fails_with(&o, "not in --allow-client", ssl);
        assert!(stderr(&o).contains("127.0.0.1"), "{}", stderr(&o));
    }
    // A client that insists on TLS is told the proxy has none for it: no handshake is done.
    let o = psql(&via(proxy.addr, "sslmode=require"), "SELECT 1", &[]);
    assert_fails_with(&o, "SSL", "sslmode=require outside --allow-client");
    let allowing = AccessArgs {
        allow_client: vec!["127.0.0.0/8".parse().unwrap()],
        ..tls_access(&cert)
    };
    let proxy = PgProxy::start_with_access(direct_url(), false, allowing).unwrap();
    let o = psql(&via(proxy.addr, "sslmode=require"), "SELECT 'allowed'", &[]);
    assert_eq!(assert_ok(&o, "allowed network"), "allowed");
}

/// Attack: a man in the middle between the proxy and its upstream. A private Postgres accepts
/// TLS only (`hostssl` lines, scram-sha-256): with sslmode=disable the proxy cannot even install
/// its guard; with verify-full it connects, sessions run over TLS (pg_stat_ssl) and a fenced
/// write goes through. A certificate that does not name the host dialled is refused under
/// verify-full (accepted under verify-ca, which checks the chain only), and a certificate from a
/// CA other than sslrootcert is refused under verify-ca.
#[test]
fn upstream_that_requires_tls() {
    if server_binaries().is_none() {
        eprintln!(
            "SKIPPED upstream_that_requires_tls: no initdb/postgres under /usr/lib/postgresql/*/bin (install postgresql)"
        );
        return;
    }
    pg::require_postgres();
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "upstream").unwrap();
    // Named by DNS only: `localhost` matches, the address 127.0.0.1 does not.
    let cert = ca
        .issue(
            "pg-server",
            &["localhost".to_owned(), "db.example.test".to_owned()],
            &[],
        )
        .unwrap();
    let cluster = PrivateCluster::start_ssl(&cert.cert, &cert.key).unwrap();
    let root = format!("sslrootcert={}", ca.cert_path.display());
    let url = |host: &str, ssl: &str| {
        format!(
            "postgres://postgres:{PRIVATE_PASSWORD}@{host}:{}/postgres?{ssl}",
            cluster.port
        )
    };

    // The server refuses plain text; the proxy, told not to encrypt, cannot connect.
    let e = PgProxy::start_with_access(
        url("127.0.0.1", "sslmode=disable"),
        false,
        AccessArgs::default(),
    )
    .err()
    .expect("a plain-text upstream connection to a hostssl-only server")
    .to_string();
    assert!(e.contains("no encryption"), "{e}");

    // verify-full with the name in the certificate: sessions are encrypted and fenced.
    let proxy_cert = ca
        .issue("pg-proxy", &["localhost".to_owned()], &[LOOPBACK])
        .unwrap();
    let proxy = PgProxy::start_with_access(
        url("localhost", &format!("sslmode=verify-full&{root}")),
        false,
        tls_access(&proxy_cert),
    )
    .unwrap();
    let client = format!(
        "postgres://postgres:{PRIVATE_PASSWORD}@127.0.0.1:{}/postgres?sslmode=disable",
        proxy.addr.port()
    );
    let o = psql(
        &client,
        "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
        &[],
    );
    assert_eq!(assert_ok(&o, "session through the proxy"), "t");
    let table = unique_name("tls_up");
    let resource = unique_name("tls_up_res");
    let o = psql(&client, &format!("CREATE TABLE {table} (x int)"), &[]);
    assert_ok(&o, "create");
    let fence = format!("-c lockd.fence={resource}:11");
    let o = psql(
        &client,
        &format!("INSERT INTO {table} VALUES (11)"),
        &[("PGOPTIONS", &fence)],
    );
    assert_ok(&o, "fenced insert to a TLS upstream");
    let o = psql(
        &client,
        &format!(
            "SELECT token FROM {} WHERE resource = '{resource}'",
            pg::fence_table()
        ),
        &[],
    );
    assert_eq!(assert_ok(&o, "fence row"), "11");
    // TLS on both legs: SCRAM channel binding cannot pass through (it would bind to the
    // proxy's certificate); the proxy says so and how to connect instead.
    let tls_client = format!(
        "postgres://postgres:{PRIVATE_PASSWORD}@localhost:{}/postgres?sslmode=verify-full&sslrootcert={}",
        proxy.addr.port(),
        ca.cert_path.display()
    );
    let o = psql(&tls_client, "SELECT 1", &[]);
    assert_fails_with(
        &o,
        "channel_binding=disable",
        "SCRAM with channel binding through TLS",
    );
    let o = psql(
        &format!("{tls_client}&channel_binding=disable"),
        "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
        &[],
    );
    assert_eq!(
        assert_ok(&o, "TLS on both legs, channel_binding=disable"),
        "t"
    );
    drop(proxy);

    // verify-full to an address the certificate does not name: refused.
    let e = PgProxy::start_with_access(
        url("127.0.0.1", &format!("sslmode=verify-full&{root}")),
        false,
        AccessArgs::default(),
    )
    .err()
    .expect("verify-full with a certificate for another name")
    .to_string();
    assert!(e.to_lowercase().contains("not valid for name"), "{e}");
    // verify-ca checks the chain only, as libpq: the same address is accepted.
    let proxy = PgProxy::start_with_access(
        url("127.0.0.1", &format!("sslmode=verify-ca&{root}")),
        false,
        AccessArgs::default(),
    )
    .unwrap();
    drop(proxy);
    // A server certificate from a CA other than sslrootcert: refused even under verify-ca.
    let other = TestCa::new(dir.path(), "other").unwrap();
    let e = PgProxy::start_with_access(
        url(
            "localhost",
            &format!(
                "sslmode=verify-ca&sslrootcert={}",
                other.cert_path.display()
            ),
        ),
        false,
        AccessArgs::default(),
    )
    .err()
    .expect("verify-ca with a foreign CA")
    .to_string();
    assert!(e.contains("UnknownIssuer"), "{e}");
}

/// Attack: a man in the middle who answers the proxy's SSLRequest with `N` to keep the upstream
/// connection in plain text. Under sslmode=require the proxy fails the connection instead; under
/// prefer it continues without TLS, as libpq does.
#[test]
fn require_against_a_server_without_tls_fails() {
    if server_binaries().is_none() {
        eprintln!(
            "SKIPPED require_against_a_server_without_tls_fails: no initdb/postgres under /usr/lib/postgresql/*/bin"
        );
        return;
    }
    pg::require_postgres();
    let cluster = PrivateCluster::start().unwrap();
    let e = PgProxy::start_with_access(
        format!("{}?sslmode=require", cluster.url("postgres")),
        false,
        AccessArgs::default(),
    )
    .err()
    .expect("sslmode=require against a server without TLS")
    .to_string();
    assert!(e.to_lowercase().contains("ssl") || e.contains("TLS"), "{e}");
    let proxy = PgProxy::start_with_access(
        format!("{}?sslmode=prefer", cluster.url("postgres")),
        false,
        AccessArgs::default(),
    )
    .unwrap();
    let client = format!(
        "postgres://postgres:{PRIVATE_PASSWORD}@127.0.0.1:{}/postgres",
        proxy.addr.port()
    );
    let o = psql(&client, "SELECT 'plain-upstream'", &[]);
    assert_eq!(assert_ok(&o, "prefer falls back"), "plain-upstream");
}

/// curl with `--cacert` and extra arguments; returns (exit status, HTTP code or body).
fn curl(args: &[&str]) -> Output {
    Command::new("curl")
        .args(["-sS", "--max-time", "10"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("running curl")
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::new(LOOPBACK, port)
}

/// Attack: eavesdropping or tampering on either side of the HTTP front end, and clients from
/// networks that should not reach it. Proxy A serves HTTPS and forwards to proxy B over https
/// (B's certificate checked against --upstream-ca, by name); B forwards to the service. A write
/// through both arrives; a client without the CA, and an A that trusts another CA for its
/// upstream, fail; mutual TLS refuses a client without a certificate; --allow-client closes
/// connections from other networks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_over_tls_to_an_https_upstream() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert) = proxy_ca(dir.path());
    let service = HttpUpstream::start().await.unwrap();
    let store = |name: &str| format!("redb:{}", dir.path().join(name).display());
    let tls_flags = [
        "--tls-cert".to_owned(),
        cert.cert.display().to_string(),
        "--tls-key".to_owned(),
        cert.key.display().to_string(),
    ];
    let flags =
        |extra: &[String]| -> Vec<String> { tls_flags.iter().chain(extra).cloned().collect() };
    let start = |store_name: String, upstream: String, extra: Vec<String>| async move {
        let (port, metrics) = (free_port(), free_port());
        let refs: Vec<&str> = extra.iter().map(String::as_str).collect();
        FenceProxy::start_at(
            loopback(port),
            loopback(metrics),
            &upstream,
            &store_name,
            &refs,
        )
        .await
    };

    let b = start(store("b.redb"), service.url(), flags(&[]))
        .await
        .unwrap();
    let b_url = format!("https://localhost:{}", b.addr.port());
    let ca_path = ca.cert_path.display().to_string();
    let a = start(
        store("a.redb"),
        b_url.clone(),
        flags(&["--upstream-ca".to_owned(), ca_path.clone()]),
    )
    .await
    .unwrap();
    let a_url = format!("https://localhost:{}/things/1", a.addr.port());
    let write = |url: &str, token: &str, extra: &[&str]| {
        let mut args = vec![
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-X",
            "PUT",
            "-H",
            "Lock-Resource: tls/1",
        ];
        let token_header = format!("Fencing-Token: {token}");
        args.extend(["-H", &token_header, "--data", "v"]);
        args.extend(extra);
        args.push(url);
        curl(&args)
    };

    let o = write(&a_url, "5", &["--cacert", &ca_path]);
    assert_eq!(
        assert_ok(&o, "write over HTTPS to an https upstream"),
        "200"
    );
    let writes = service.writes();
    assert_eq!(writes.len(), 1, "{writes:?}");
    assert_eq!(writes[0].token(), Some(5));

    // A client that does not trust the proxy's CA (curl's own store) refuses it.
    let o = write(&a_url, "6", &[]);
    assert!(!o.status.success(), "curl without the CA: {}", stdout(&o));
    assert_eq!(o.status.code(), Some(60), "{}", stderr(&o));
    // Plain HTTP is not served on a TLS listener.
    let o = write(
        &format!("http://127.0.0.1:{}/things/1", a.addr.port()),
        "6",
        &[],
    );
    assert_ne!(stdout(&o), "200");

    // A proxy that trusts another CA for its upstream refuses B: 502, nothing applied.
    let other = TestCa::new(dir.path(), "other").unwrap();
    let wrong = start(
        store("w.redb"),
        b_url.clone(),
        flags(&[
            "--upstream-ca".to_owned(),
            other.cert_path.display().to_string(),
        ]),
    )
    .await
    .unwrap();
    let o = write(
        &format!("https://localhost:{}/things/1", wrong.addr.port()),
        "7",
        &["--cacert", &ca_path],
    );
    assert_eq!(assert_ok(&o, "write through a proxy distrusting B"), "502");
    assert_eq!(service.writes().len(), 1);

    // An https upstream without --upstream-ca does not start.
    let e = start(store("n.redb"), b_url.clone(), flags(&[]))
        .await
        .err()
        .expect("https upstream without --upstream-ca");
    assert!(e.to_string().contains("exited at startup"), "{e:#}");

    // Mutual TLS: a client certificate from the CA is required.
    let client = ca
        .issue("client", &["client.test".to_owned()], &[])
        .unwrap();
    let mtls = start(
        store("m.redb"),
        service.url(),
        flags(&["--tls-client-ca".to_owned(), ca_path.clone()]),
    )
    .await
    .unwrap();
    let m_url = format!("https://localhost:{}/things/1", mtls.addr.port());
    let o = write(&m_url, "8", &["--cacert", &ca_path]);
    assert!(!o.status.success(), "no client certificate: {}", stdout(&o));
    let (c, k) = (
        client.cert.display().to_string(),
        client.key.display().to_string(),
    );
    let o = write(
        &m_url,
        "8",
        &["--cacert", &ca_path, "--cert", &c, "--key", &k],
    );
    assert_eq!(assert_ok(&o, "write with a client certificate"), "200");
    assert_eq!(service.writes().len(), 2);

    // --allow-client: 127.0.0.1 is outside 10.0.0.0/8, so the connection is closed unanswered.
    let fenced_off = start(
        store("f.redb"),
        service.url(),
        flags(&["--allow-client".to_owned(), "10.0.0.0/8".to_owned()]),
    )
    .await
    .unwrap();
    let o = write(
        &format!("https://localhost:{}/things/1", fenced_off.addr.port()),
        "9",
        &["--cacert", &ca_path],
    );
    assert!(
        !o.status.success(),
        "client outside --allow-client: {}",
        stdout(&o)
    );
    assert_eq!(service.writes().len(), 2);
}

/// Attack: a man in the middle between the HTTP proxy and a shared Postgres epoch store. The
/// store URL's sslmode and sslrootcert are honoured (sqlx with rustls): verify-ca against the
/// server's own certificate works; a root that did not issue it fails closed (503
/// store-unavailable), and verify-full to an address the certificate does not name fails too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn epoch_store_over_tls() {
    pg::require_postgres();
    let o = psql(&direct_url(), "SHOW ssl", &[]);
    let cert_file = psql(&direct_url(), "SHOW ssl_cert_file", &[]);
    let cert_file = PathBuf::from(stdout(&cert_file));
    if stdout(&o) != "on" || !cert_file.is_absolute() || std::fs::read(&cert_file).is_err() {
        eprintln!(
            "SKIPPED epoch_store_over_tls: the Postgres at 127.0.0.1:5432 has no readable TLS certificate (ssl={})",
            stdout(&o)
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let service = HttpUpstream::start().await.unwrap();
    let base = format!("postgres://{PG_USER}@127.0.0.1:5432/{PG_DATABASE}");
    let resource = unique_name("tls_store");
    let start = |store: String| {
        let service_url = service.url();
        async move {
            FenceProxy::start_at(
                loopback(free_port()),
                loopback(free_port()),
                &service_url,
                &store,
                &["--store-timeout", "3s"],
            )
            .await
            .unwrap()
        }
    };
    let write = |proxy: &FenceProxy, token: &str| {
        curl(&[
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-X",
            "PUT",
            "-H",
            &format!("Lock-Resource: {resource}"),
            "-H",
            &format!("Fencing-Token: {token}"),
            "--data",
            "v",
            &proxy.url("/x"),
        ])
    };
    // The server's certificate is self-signed: it is its own root.
    let good = start(format!(
        "{base}?sslmode=verify-ca&sslrootcert={}",
        cert_file.display()
    ))
    .await;
    let o = write(&good, "3");
    assert_eq!(assert_ok(&o, "store over verify-ca"), "200");

    let other = TestCa::new(dir.path(), "other").unwrap();
    let bad = start(format!(
        "{base}?sslmode=verify-ca&sslrootcert={}",
        other.cert_path.display()
    ))
    .await;
    let o = write(&bad, "4");
    assert_eq!(assert_ok(&o, "store with a foreign root"), "503");
    // The certificate names localhost, not 127.0.0.1.
    let misnamed = start(format!(
        "{base}?sslmode=verify-full&sslrootcert={}",
        cert_file.display()
    ))
    .await;
    let o = write(&misnamed, "5");
    assert_eq!(assert_ok(&o, "store under verify-full by address"), "503");
    assert_eq!(service.writes().len(), 1);
}
