//! The HTTP front end over HTTPS towards an https upstream, and its Postgres epoch store over TLS.

use std::path::PathBuf;

use crate::{assert_ok, curl, loopback, proxy_ca, psql, stderr, stdout};
use lockd_tests::fence_proxy::FenceProxy;
use lockd_tests::http_upstream::HttpUpstream;
use lockd_tests::pg::{PG_DATABASE, PG_USER, direct_url, free_port, unique_name};
use lockd_tests::tls::TestCa;

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
    lockd_tests::skip_without_postgres!();
    let o = psql(&direct_url(), "SHOW ssl", &[]);
    let cert_file = psql(&direct_url(), "SHOW ssl_cert_file", &[]);
    let cert_file = PathBuf::from(stdout(&cert_file));
    if stdout(&o) != "on" || !cert_file.is_absolute() || std::fs::read(&cert_file).is_err() {
        lockd_tests::skip::report(&format!(
            "the Postgres at 127.0.0.1:5432 has no readable TLS certificate (ssl={})",
            stdout(&o)
        ));
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

// Certificate reload on SIGHUP: files replaced in place, `kill -HUP <pid>`.
