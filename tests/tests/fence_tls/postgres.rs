//! The Postgres front end: TLS towards psql, `--require-tls`, `--allow-client`, and upstreams that
//! require (or lack) TLS.

use crate::{
    LOOPBACK, assert_fails_with, assert_ok, proxy_ca, psql, recorded_token, server_binaries,
    stderr, tls_access, via,
};
use fence_proxy_postgres::AccessArgs;
use lockd_tests::pg::{
    self, PG_DATABASE, PG_USER, PRIVATE_PASSWORD, PgProxy, PrivateCluster, direct_url, unique_name,
};
use lockd_tests::tls::TestCa;

/// Attack: an eavesdropper or man in the middle between a client and the proxy. psql with
/// sslmode=verify-full reaches the proxy over TLS, checks its certificate and name, and a fenced
/// write goes through the guard (a stale one is still refused); a client that does not trust the
/// proxy's CA refuses the connection.
#[test]
fn psql_verify_full_through_the_proxy() {
    lockd_tests::skip_without_postgres!();
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
    lockd_tests::skip_without_postgres!();
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
    lockd_tests::skip_without_postgres!();
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
    lockd_tests::skip_without_postgres!();
    if server_binaries().is_none() {
        lockd_tests::skip::report(
            "no initdb/postgres under /usr/lib/postgresql/*/bin (install postgresql)",
        );
        return;
    }
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
    lockd_tests::skip_without_postgres!();
    if server_binaries().is_none() {
        lockd_tests::skip::report(
            "no initdb/postgres under /usr/lib/postgresql/*/bin (install postgresql)",
        );
        return;
    }
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
