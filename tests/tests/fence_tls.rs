//! TLS and client access of fence-proxy: the Postgres front end terminating TLS for
//! psql and connecting to an upstream that requires it, `--require-tls`, `--allow-client`, and
//! the HTTP front end over HTTPS towards an https upstream, and certificate reload on SIGHUP
//! (both front ends, listener and upstream side, bad files, no TLS at all).
//!
//! Method: throwaway CAs and certificates (rcgen, `lockd_tests::tls::TestCa`); real psql, real
//! curl, the machine's Postgres, and private Postgres clusters started from the installed server
//! binaries for the upstreams that require TLS. Each test says which attack it refutes.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use fence_proxy_postgres::AccessArgs;
use lockd_tests::fence_proxy::FenceProxy;
use lockd_tests::http_upstream::HttpUpstream;
use lockd_tests::pg::{
    self, PG_DATABASE, PG_USER, PRIVATE_PASSWORD, PgProxy, PrivateCluster, direct_url, free_port,
    unique_name,
};
use lockd_tests::process::{ChildGuard, command};
use lockd_tests::tls::{Issued, TestCa};
use nix::sys::signal::Signal;

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

// ---------------------------------------------------------------------------------------------
// Certificate reload on SIGHUP (issue 15): files replaced in place, `kill -HUP <pid>`.
// ---------------------------------------------------------------------------------------------

/// How long a reload may take to show (log line, new certificate served) after SIGHUP.
const RELOAD_WAIT: Duration = Duration::from_secs(15);

/// A `fence-proxy` process of either front end with its log (RUST_LOG=info) in a file, so the
/// SIGHUP tests can signal it by PID and read what it said. Killed when dropped.
struct LoggedProxy {
    addr: SocketAddr,
    metrics_addr: SocketAddr,
    log: PathBuf,
    child: ChildGuard,
}

impl LoggedProxy {
    /// Starts `fence-proxy FRONTEND --listen A --metrics-listen M ARGS...` and waits until it
    /// accepts on both addresses.
    async fn start(dir: &Path, frontend: &str, args: &[String]) -> LoggedProxy {
        let addr = loopback(free_port());
        let metrics_addr = loopback(free_port());
        let log = dir.join(format!("{}.log", unique_name(frontend)));
        let file = std::fs::File::create(&log).unwrap();
        let mut cmd = command("fence-proxy");
        cmd.arg(frontend)
            .arg("--listen")
            .arg(addr.to_string())
            .arg("--metrics-listen")
            .arg(metrics_addr.to_string())
            .args(args)
            .env("RUST_LOG", "info")
            .env_remove("FENCE_PROXY_LOG_FORMAT")
            .stdout(Stdio::null())
            .stderr(file);
        let child = ChildGuard::spawn(format!("fence-proxy {frontend} {addr}"), cmd).unwrap();
        let mut proxy = LoggedProxy {
            addr,
            metrics_addr,
            log,
            child,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            proxy.assert_running("starting");
            let listening = tokio::net::TcpStream::connect(addr).await.is_ok();
            let metrics = tokio::net::TcpStream::connect(metrics_addr).await.is_ok();
            if listening && metrics {
                return proxy;
            }
            assert!(
                Instant::now() < deadline,
                "fence-proxy {frontend} did not accept within 30 s; log:\n{}",
                proxy.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn assert_running(&mut self, when: &str) {
        if let Some(status) = self.child.try_wait() {
            panic!("fence-proxy exited {when}: {status}; log:\n{}", self.log());
        }
    }

    /// `kill -HUP <pid>`.
    fn hup(&self) {
        self.child.signal(Signal::SIGHUP);
    }

    /// Waits until the log holds `needle` at least `times` times; fails at once if the process
    /// exits meanwhile (SIGHUP's default action would end it).
    async fn wait_for_log(&mut self, needle: &str, times: usize) -> String {
        let deadline = Instant::now() + RELOAD_WAIT;
        loop {
            self.assert_running(&format!("while waiting for {needle:?} in its log"));
            let log = self.log();
            if log.matches(needle).count() >= times {
                return log;
            }
            assert!(
                Instant::now() < deadline,
                "{needle:?} not logged {times} time(s) within {RELOAD_WAIT:?}; log:\n{log}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The value of the series of `name` whose labels include every one of `labels`
    /// (`key="value"`).
    async fn metric(&self, name: &str, labels: &[&str]) -> Option<f64> {
        let text = lockd_tests::fence_proxy::get(&format!("http://{}/metrics", self.metrics_addr))
            .await
            .unwrap()
            .body;
        text.lines()
            .filter(|l| l.starts_with(&format!("{name}{{")))
            .filter(|l| labels.iter().all(|label| l.contains(label)))
            .find_map(|l| l.rsplit(' ').next()?.parse().ok())
    }
}

/// Polls `check` every 50 ms until it holds, for at most [`RELOAD_WAIT`].
async fn poll_until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + RELOAD_WAIT;
    while !check().await {
        assert!(
            Instant::now() < deadline,
            "{what}: not within {RELOAD_WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One HTTP/1.1 connection over TLS, kept open across requests.
type KeptHttps = hyper::client::conn::http1::SendRequest<http_body_util::Full<bytes::Bytes>>;

/// Connects to `addr` over TLS trusting only the CA in `ca`, checking the name `localhost`.
/// Fails when the server's certificate does not chain to it.
async fn https_connect(addr: SocketAddr, ca: &Path) -> anyhow::Result<KeptHttps> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::CertificateDer::pem_file_iter(ca)? {
        roots.add(c?)?;
    }
    let mut config = rustls::ClientConfig::builder_with_provider(
        rustls::crypto::ring::default_provider().into(),
    )
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(rustls::pki_types::ServerName::try_from("localhost")?, tcp)
        .await?;
    let (sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls)).await?;
    tokio::spawn(connection);
    Ok(sender)
}

/// A fenced PUT on `conn`; returns the status.
async fn https_put(conn: &mut KeptHttps, resource: &str, token: u64) -> anyhow::Result<u16> {
    conn.ready().await?;
    let request = hyper::Request::builder()
        .method("PUT")
        .uri("/things/1")
        .header("host", "localhost")
        .header("Lock-Resource", resource)
        .header("Fencing-Token", token.to_string())
        .body(http_body_util::Full::new(bytes::Bytes::from_static(b"v")))?;
    let response = conn.send_request(request).await?;
    let status = response.status().as_u16();
    http_body_util::BodyExt::collect(response.into_body()).await?;
    Ok(status)
}

/// Whether a new connection trusting only `ca` gets a fenced write through (200).
async fn new_connection_writes(addr: SocketAddr, ca: &Path, resource: &str, token: u64) -> bool {
    match https_connect(addr, ca).await {
        Ok(mut conn) => https_put(&mut conn, resource, token).await.ok() == Some(200),
        Err(_) => false,
    }
}

fn copy_pair(from: &Issued, cert: &Path, key: &Path) {
    std::fs::copy(&from.cert, cert).unwrap();
    std::fs::copy(&from.key, key).unwrap();
}

/// Issue 15 (certificate rotation): the HTTP front end reads `--tls-cert`/`--tls-key` again on
/// SIGHUP. Method: serve cert A (CA1), keep one client connection open, replace the files with
/// cert B (CA2) and SIGHUP the process by PID. New connections then present B (a client of CA2
/// gets through, a client of CA1 is refused), the process keeps running, the reload is logged
/// with its generation and counted, and the connection opened before still completes a write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_certificates_reload_on_sighup() {
    let dir = tempfile::tempdir().unwrap();
    let ca1 = TestCa::new(dir.path(), "ca1").unwrap();
    let ca2 = TestCa::new(dir.path(), "ca2").unwrap();
    let a = ca1
        .issue("a", &["localhost".to_owned()], &[LOOPBACK])
        .unwrap();
    let b = ca2
        .issue("b", &["localhost".to_owned()], &[LOOPBACK])
        .unwrap();
    let (cert, key) = (
        dir.path().join("proxy.pem"),
        dir.path().join("proxy-key.pem"),
    );
    copy_pair(&a, &cert, &key);
    let service = HttpUpstream::start().await.unwrap();
    let store = format!("redb:{}", dir.path().join("epochs.redb").display());
    let mut proxy = LoggedProxy::start(
        dir.path(),
        "http",
        &[
            "--upstream".to_owned(),
            service.url(),
            "--store".to_owned(),
            store,
            "--tls-cert".to_owned(),
            cert.display().to_string(),
            "--tls-key".to_owned(),
            key.display().to_string(),
            // The kept connection idles across the reload: longer than the poll below.
            "--header-read-timeout".to_owned(),
            "120s".to_owned(),
        ],
    )
    .await;
    let resource = unique_name("reload_http");

    // Phase 1: cert A serves; a client of CA2 is refused (so the checks below can fail).
    let mut kept = https_connect(proxy.addr, &ca1.cert_path).await.unwrap();
    assert_eq!(https_put(&mut kept, &resource, 1).await.unwrap(), 200);
    assert!(!new_connection_writes(proxy.addr, &ca2.cert_path, &resource, 2).await);

    // Phase 2: B replaces A on disk; SIGHUP.
    copy_pair(&b, &cert, &key);
    proxy.hup();
    let mut token = 2;
    poll_until("a new connection trusting CA2 writes", || {
        token += 1;
        new_connection_writes(proxy.addr, &ca2.cert_path, &resource, token)
    })
    .await;
    let refused = https_connect(proxy.addr, &ca1.cert_path).await.err();
    assert!(
        refused.is_some(),
        "a client trusting only CA1 still accepted the proxy after the reload"
    );
    let log = proxy.wait_for_log("certificates reloaded", 1).await;
    assert!(log.contains("generation=1"), "{log}");
    assert!(log.contains(&cert.display().to_string()), "{log}");
    assert_eq!(
        proxy
            .metric("fence_proxy_tls_reloads_total", &["result=\"ok\""])
            .await,
        Some(1.0)
    );
    assert_eq!(
        proxy
            .metric("fence_proxy_tls_generation", &["frontend=\"http\""])
            .await,
        Some(1.0)
    );

    // Phase 3: the connection opened under A was not dropped.
    token += 1;
    assert_eq!(https_put(&mut kept, &resource, token).await.unwrap(), 200);
    proxy.assert_running("after the reload");
    let last = service.writes().last().and_then(|w| w.token());
    assert_eq!(last, Some(token));
}

/// Issue 15 (certificate rotation, bad files): a garbage key on SIGHUP is refused whole. The
/// process stays up, logs an error naming the key file, counts `result="error"`, and new
/// connections still get cert A; once a good key is in place, the next SIGHUP takes B.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_reload_refuses_a_broken_key_and_keeps_the_old_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let ca1 = TestCa::new(dir.path(), "ca1").unwrap();
    let ca2 = TestCa::new(dir.path(), "ca2").unwrap();
    let a = ca1
        .issue("a", &["localhost".to_owned()], &[LOOPBACK])
        .unwrap();
    let b = ca2
        .issue("b", &["localhost".to_owned()], &[LOOPBACK])
        .unwrap();
    let (cert, key) = (
        dir.path().join("proxy.pem"),
        dir.path().join("proxy-key.pem"),
    );
    copy_pair(&a, &cert, &key);
    let service = HttpUpstream::start().await.unwrap();
    let store = format!("redb:{}", dir.path().join("epochs.redb").display());
    let mut proxy = LoggedProxy::start(
        dir.path(),
        "http",
        &[
            "--upstream".to_owned(),
            service.url(),
            "--store".to_owned(),
            store,
            "--tls-cert".to_owned(),
            cert.display().to_string(),
            "--tls-key".to_owned(),
            key.display().to_string(),
        ],
    )
    .await;
    let resource = unique_name("reload_bad");

    std::fs::copy(&b.cert, &cert).unwrap();
    std::fs::write(
        &key,
        "-----BEGIN PRIVATE KEY-----\ngarbage\n-----END PRIVATE KEY-----\n",
    )
    .unwrap();
    proxy.hup();
    let log = proxy.wait_for_log("certificate reload failed", 1).await;
    let line = log
        .lines()
        .find(|l| l.contains("certificate reload failed"))
        .unwrap();
    assert!(line.contains("ERROR"), "{line}");
    assert!(line.contains(&key.display().to_string()), "{line}");
    assert_eq!(
        proxy
            .metric("fence_proxy_tls_reloads_total", &["result=\"error\""])
            .await,
        Some(1.0)
    );
    // Cert A still serves new connections; B is not half-installed.
    assert!(new_connection_writes(proxy.addr, &ca1.cert_path, &resource, 1).await);
    assert!(https_connect(proxy.addr, &ca2.cert_path).await.is_err());
    proxy.assert_running("after a failed reload");

    // Fixed files: the next SIGHUP installs B.
    std::fs::copy(&b.key, &key).unwrap();
    proxy.hup();
    poll_until("a new connection trusting CA2 writes", || {
        new_connection_writes(proxy.addr, &ca2.cert_path, &resource, 2)
    })
    .await;
    let log = proxy.wait_for_log("certificates reloaded", 1).await;
    assert!(log.contains("generation=1"), "{log}");
}

/// Issue 15 (rotation of the https upstream's CA): `--upstream-ca` is read again on SIGHUP and
/// new upstream connections use it. Method: proxy P trusts a wrong CA for its https upstream U,
/// so requests through it are 502 and no upstream connection is pooled; the right CA is put in
/// the file and P gets SIGHUP; reads, then a fenced write, reach the service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_upstream_ca_reloads_on_sighup() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "upstream").unwrap();
    let wrong = TestCa::new(dir.path(), "wrong").unwrap();
    let u_cert = ca
        .issue("u", &["localhost".to_owned()], &[LOOPBACK])
        .unwrap();
    let service = HttpUpstream::start().await.unwrap();
    let u = LoggedProxy::start(
        dir.path(),
        "http",
        &[
            "--upstream".to_owned(),
            service.url(),
            "--store".to_owned(),
            format!("redb:{}", dir.path().join("u.redb").display()),
            "--tls-cert".to_owned(),
            u_cert.cert.display().to_string(),
            "--tls-key".to_owned(),
            u_cert.key.display().to_string(),
        ],
    )
    .await;
    // Not `upstream-ca.pem`: that is the CA's own file (TestCa writes `<name>-ca.pem`).
    let upstream_ca = dir.path().join("p-upstream-roots.pem");
    std::fs::copy(&wrong.cert_path, &upstream_ca).unwrap();
    let mut p = LoggedProxy::start(
        dir.path(),
        "http",
        &[
            "--upstream".to_owned(),
            format!("https://localhost:{}", u.addr.port()),
            "--upstream-ca".to_owned(),
            upstream_ca.display().to_string(),
            "--store".to_owned(),
            format!("redb:{}", dir.path().join("p.redb").display()),
        ],
    )
    .await;
    // Reads pass through unchecked: a failed forward of a write would quarantine its resource.
    let p_addr = p.addr;
    let read = || {
        let url = format!("http://{p_addr}/things/1");
        async move {
            lockd_tests::fence_proxy::get(&url)
                .await
                .map(|r| r.status)
                .unwrap_or(0)
        }
    };
    assert_eq!(read().await, 502);
    assert!(service.applied().is_empty());

    std::fs::copy(&ca.cert_path, &upstream_ca).unwrap();
    p.hup();
    let log = p.wait_for_log("certificates reloaded", 1).await;
    assert!(log.contains(&upstream_ca.display().to_string()), "{log}");
    poll_until("a read through P reaches the service", || {
        let r = read();
        async move { r.await == 200 }
    })
    .await;
    let resource = unique_name("reload_up");
    let reply = lockd_tests::fence_proxy::send(
        "PUT",
        &format!("http://{}/things/1", p.addr),
        &[("Lock-Resource", resource.as_str()), ("Fencing-Token", "7")],
        "v",
    )
    .await
    .unwrap();
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(service.writes().last().and_then(|w| w.token()), Some(7));
}

/// The proxy's Postgres session through `fence-proxy postgres` at `addr`, over TLS with
/// sslmode=verify-ca against `ca` (the proxy's own rustls client code, as a libpq stand-in that
/// keeps a session open).
async fn pg_tls_session(addr: SocketAddr, ca: &Path) -> anyhow::Result<tokio_postgres::Client> {
    let url = format!(
        "postgres://{PG_USER}@{}:{}/{PG_DATABASE}?sslmode=verify-ca&sslrootcert={}",
        addr.ip(),
        addr.port(),
        ca.display()
    );
    let parsed = fence_proxy_postgres::upstream::parse(&url, "test client")?;
    let (client, connection) = parsed.config.connect(parsed.tls.connector()).await?;
    tokio::spawn(connection);
    Ok(client)
}

/// psql with sslmode=verify-ca trusting `ca`, off the async workers.
fn psql_verify_ca(addr: SocketAddr, ca: &Path, sql: &str) -> Output {
    let conninfo = via(
        addr,
        &format!("sslmode=verify-ca sslrootcert={}", ca.display()),
    );
    tokio::task::block_in_place(|| psql(&conninfo, sql, &[]))
}

/// Issue 15 (certificate rotation, Postgres front end): SIGHUP makes `fence-proxy postgres`
/// read `--tls-cert`/`--tls-key` again. Method: cert A (CA1), one TLS session kept open; the
/// files are replaced with cert B (CA2) and the process gets SIGHUP. Then psql with
/// sslmode=verify-ca trusting CA2 connects, psql trusting CA1 fails the certificate check, and
/// the session opened before still runs queries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_certificates_reload_on_sighup() {
    pg::require_postgres();
    let dir = tempfile::tempdir().unwrap();
    let ca1 = TestCa::new(dir.path(), "ca1").unwrap();
    let ca2 = TestCa::new(dir.path(), "ca2").unwrap();
    let a = ca1
        .issue("a", &["localhost".to_owned()], &[LOOPBACK])
        .unwrap();
    let b = ca2
        .issue("b", &["localhost".to_owned()], &[LOOPBACK])
        .unwrap();
    let (cert, key) = (
        dir.path().join("proxy.pem"),
        dir.path().join("proxy-key.pem"),
    );
    copy_pair(&a, &cert, &key);
    let mut proxy = LoggedProxy::start(
        dir.path(),
        "postgres",
        &[
            "--upstream".to_owned(),
            direct_url(),
            "--fence-table".to_owned(),
            pg::fence_table(),
            "--pool-size".to_owned(),
            "1".to_owned(),
            "--tls-cert".to_owned(),
            cert.display().to_string(),
            "--tls-key".to_owned(),
            key.display().to_string(),
        ],
    )
    .await;

    // Phase 1: A serves; a client of CA2 is refused (so the checks below can fail).
    let kept = pg_tls_session(proxy.addr, &ca1.cert_path).await.unwrap();
    let row = kept.query_one("SELECT 'before'::text", &[]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), "before");
    let o = psql_verify_ca(proxy.addr, &ca2.cert_path, "SELECT 1");
    assert_fails_with(
        &o,
        "certificate verify failed",
        "psql trusting CA2 before the reload",
    );

    // Phase 2: B replaces A; SIGHUP.
    copy_pair(&b, &cert, &key);
    proxy.hup();
    poll_until("psql trusting CA2 connects", || {
        let ok = psql_verify_ca(proxy.addr, &ca2.cert_path, "SELECT 1")
            .status
            .success();
        async move { ok }
    })
    .await;
    let o = psql_verify_ca(proxy.addr, &ca1.cert_path, "SELECT 1");
    assert_fails_with(
        &o,
        "certificate verify failed",
        "psql trusting CA1 after the reload",
    );
    let log = proxy.wait_for_log("certificates reloaded", 1).await;
    assert!(log.contains("generation=1"), "{log}");
    assert_eq!(
        proxy
            .metric(
                "fence_proxy_tls_reloads_total",
                &["frontend=\"postgres\"", "result=\"ok\""]
            )
            .await,
        Some(1.0)
    );

    // Phase 3: the session opened under A still works.
    let row = kept.query_one("SELECT 'after'::text", &[]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), "after");
    proxy.assert_running("after the reload");
}

/// Issue 15 (rotation of the upstream's CA, Postgres front end): `--upstream`'s `sslrootcert`
/// is read again on SIGHUP, for every new upstream connection. Method: a private TLS-only
/// Postgres; the proxy starts with its CA in the file. The file is replaced with another CA and
/// the proxy gets SIGHUP: new sessions fail the certificate check, while the session opened
/// before keeps working. The right CA back and another SIGHUP: new sessions work again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_upstream_root_reloads_on_sighup() {
    if server_binaries().is_none() {
        eprintln!(
            "SKIPPED postgres_upstream_root_reloads_on_sighup: no initdb/postgres under /usr/lib/postgresql/*/bin"
        );
        return;
    }
    pg::require_postgres();
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "upstream").unwrap();
    let other = TestCa::new(dir.path(), "other").unwrap();
    let server = ca
        .issue("pg-server", &["localhost".to_owned()], &[])
        .unwrap();
    let cluster = PrivateCluster::start_ssl(&server.cert, &server.key).unwrap();
    let root = dir.path().join("upstream-root.pem");
    std::fs::copy(&ca.cert_path, &root).unwrap();
    let upstream = format!(
        "postgres://postgres:{PRIVATE_PASSWORD}@localhost:{}/postgres?sslmode=verify-full&sslrootcert={}",
        cluster.port,
        root.display()
    );
    let table = format!("{}.lockd_fence", unique_name("reload"));
    if let Err(e) = pg::try_init_guard(&upstream, &table) {
        panic!("fence-proxy postgres init: {e:#}");
    }
    let mut proxy = LoggedProxy::start(
        dir.path(),
        "postgres",
        &[
            "--upstream".to_owned(),
            upstream,
            "--fence-table".to_owned(),
            table,
            "--pool-size".to_owned(),
            "1".to_owned(),
        ],
    )
    .await;
    let client_url = format!(
        "postgres://postgres:{PRIVATE_PASSWORD}@127.0.0.1:{}/postgres?sslmode=disable",
        proxy.addr.port()
    );
    let session = || async {
        let (client, connection) = client_url
            .parse::<tokio_postgres::Config>()
            .unwrap()
            .connect(tokio_postgres::NoTls)
            .await?;
        tokio::spawn(connection);
        Ok::<_, tokio_postgres::Error>(client)
    };
    let encrypted = "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()";
    let kept = session().await.unwrap();
    assert!(
        kept.query_one(encrypted, &[])
            .await
            .unwrap()
            .get::<_, bool>(0)
    );

    std::fs::copy(&other.cert_path, &root).unwrap();
    proxy.hup();
    proxy.wait_for_log("certificates reloaded", 1).await;
    let Err(e) = session().await else {
        panic!("a new session with an upstream root that did not issue its certificate connected");
    };
    assert!(format!("{e:?}").contains("UnknownIssuer"), "{e:?}");
    assert!(
        kept.query_one(encrypted, &[])
            .await
            .unwrap()
            .get::<_, bool>(0)
    );

    std::fs::copy(&ca.cert_path, &root).unwrap();
    proxy.hup();
    proxy.wait_for_log("certificates reloaded", 2).await;
    let fresh = session().await.unwrap();
    assert!(
        fresh
            .query_one(encrypted, &[])
            .await
            .unwrap()
            .get::<_, bool>(0)
    );
}

/// Issue 15: SIGHUP's default action terminates a process; fence-proxy must never die of it.
/// Method: both front ends started without any TLS file get SIGHUP; each logs that there is
/// nothing to reload, keeps running and still serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_without_tls_leaves_the_proxy_running() {
    pg::require_postgres();
    let dir = tempfile::tempdir().unwrap();
    let service = HttpUpstream::start().await.unwrap();
    let mut http = LoggedProxy::start(
        dir.path(),
        "http",
        &[
            "--upstream".to_owned(),
            service.url(),
            "--store".to_owned(),
            format!("redb:{}", dir.path().join("e.redb").display()),
        ],
    )
    .await;
    let mut postgres = LoggedProxy::start(
        dir.path(),
        "postgres",
        &[
            "--upstream".to_owned(),
            direct_url(),
            "--fence-table".to_owned(),
            pg::fence_table(),
            "--pool-size".to_owned(),
            "1".to_owned(),
        ],
    )
    .await;
    for proxy in [&mut http, &mut postgres] {
        proxy.hup();
        proxy.wait_for_log("nothing to reload", 1).await;
        proxy.hup();
        proxy.wait_for_log("nothing to reload", 2).await;
    }
    let reply = lockd_tests::fence_proxy::get(&format!("http://{}/x", http.addr))
        .await
        .unwrap();
    assert_eq!(reply.status, 200);
    let o = tokio::task::block_in_place(|| {
        psql(
            &via(postgres.addr, "sslmode=disable"),
            "SELECT 'alive'",
            &[],
        )
    });
    assert_eq!(assert_ok(&o, "psql after SIGHUP"), "alive");
    http.assert_running("after SIGHUP");
    postgres.assert_running("after SIGHUP");
}
