//! SIGHUP reloads of the HTTP front end: its certificate, a broken key, the upstream CA.

use super::{LoggedProxy, copy_pair, https_connect, https_put, new_connection_writes, poll_until};
use crate::LOOPBACK;
use lockd_tests::http_upstream::HttpUpstream;
use lockd_tests::pg::unique_name;
use lockd_tests::tls::TestCa;

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
