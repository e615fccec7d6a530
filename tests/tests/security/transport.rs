//! TLS between clients and nodes: `lockctl` speaks TLS and refuses an untrusted cluster, and
//! certificates reload on SIGHUP under load without a failed call.

use std::time::Duration;

use lockd_tests::poll;

use lockd_tests::cluster::{Cluster, ClusterOptions};
use lockd_tests::tls::TestCa;

/// Runs `lockctl ARGS` to completion; (exit code, stdout, stderr).
fn lockctl(args: &[&str]) -> (i32, String, String) {
    let out = lockd_tests::process::command("lockctl")
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Goal (TLS for clients): lockctl talks TLS with `--cacert` (as etcdctl), and a
/// client that does not trust the nodes' CA, or speaks plaintext to a TLS port, is refused with
/// one line saying why. Method: a TLS cluster; lockctl acquire and status with the right CA, with
/// another CA, and without TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue15_lockctl_speaks_tls_and_refuses_an_untrusted_cluster() {
    let cluster = Cluster::start(ClusterOptions {
        tls: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let eps = cluster.endpoints();
    let ca = cluster
        .tls
        .as_ref()
        .unwrap()
        .peer_ca
        .cert_path
        .display()
        .to_string();
    let (code, out, err) = lockctl(&[
        "--endpoints",
        &eps,
        "--cacert",
        &ca,
        "acquire",
        "tls/job",
        "--ttl",
        "30s",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("fencing_token"), "{out}");
    let (code, out, err) = lockctl(&["--endpoints", &eps, "--cacert", &ca, "status"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        !out.contains("unreachable"),
        "every node answers over TLS: {out}"
    );

    let extra = tempfile::tempdir().unwrap();
    let other = TestCa::new(extra.path(), "other").unwrap();
    let other_ca = other.cert_path.display().to_string();
    for (what, args) in [
        ("another CA", vec!["--cacert", other_ca.as_str()]),
        ("no TLS", vec![]),
    ] {
        // The default 15 s call timeout: a refused certificate must end the call at once.
        let mut all = vec!["--endpoints", eps.as_str()];
        if what == "no TLS" {
            all.extend(["--timeout", "2s"]);
        }
        all.extend(args);
        all.extend(["acquire", "tls/other"]);
        let started = std::time::Instant::now();
        let (code, out, err) = lockctl(&all);
        if what == "another CA" {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "an untrusted certificate was retried for {:?}: {err}",
                started.elapsed()
            );
        }
        assert_ne!(code, 0, "{what}: accepted: {out}");
        // One line, but for the full request id lockctl adds when the outcome is unknown (exit
        // 8: a plaintext client's h2 error from a TLS port carries no ErrorInfo of lockd's).
        assert_eq!(
            err.trim_end()
                .lines()
                .filter(|l| !(code == 8 && l.starts_with("lockctl: request id: ")))
                .count(),
            1,
            "{what}: not one line: {err}"
        );
        assert!(err.starts_with("lockctl: "), "{what}: {err}");
        if what == "another CA" {
            assert!(
                err.contains("certificate"),
                "{what}: the line says why: {err}"
            );
        }
    }
    let (code, _, err) = lockctl(&[
        "--endpoints",
        &eps,
        "--cacert",
        "/nonexistent/ca.pem",
        "status",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("/nonexistent/ca.pem"), "{err}");
}

/// The leaf certificate (DER) that node `addr` serves to a new TLS connection.
async fn served_certificate(addr: &str, ca: &std::path::Path) -> Vec<u8> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(
        rustls::crypto::ring::default_provider().into(),
    )
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let ip: std::net::SocketAddr = addr.parse().unwrap();
    let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(
            rustls::pki_types::ServerName::IpAddress(ip.ip().into()),
            tcp,
        )
        .await
        .unwrap();
    tls.get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

fn pem_der(path: &std::path::Path) -> Vec<u8> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::from_pem_file(path)
        .unwrap()
        .to_vec()
}

/// Goal: certificates reload on SIGHUP during a running mixed load with no
/// failed call, and a reload with broken files keeps the certificates in use. Method: a TLS
/// cluster under acquire/renew/release from four clients (each on its own resource, so every
/// call must succeed) plus a fifth that opens a new connection for every call; midway every node
/// certificate is issued again (new keys) at the same paths and every node gets SIGHUP, then
/// node 1's certificate file is overwritten with garbage and it gets SIGHUP again. Checks: zero
/// failed calls; a new connection to each node is served the new certificate; node 1 still
/// serves it after the broken reload; a node restarted after the reload (so all its peer
/// connections are new) rejoins and the load goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue15_certificates_reload_on_sighup_under_load_without_a_failed_call() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    let mut cluster = Cluster::start(ClusterOptions {
        tls: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let ca_path = cluster.tls.as_ref().unwrap().peer_ca.cert_path.clone();
    let eps: Vec<String> = (1..=3).map(|id| cluster.addr(id)).collect();
    let client_config = || {
        let mut c = lockd_client::ClientConfig::new(eps.clone());
        c.tls = Some(lockd_client::ClientTls::from_files(&ca_path, None, None).unwrap());
        c
    };
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let failures = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let mut workers = Vec::new();
    for w in 0..4 {
        let client = lockd_client::Client::with_config(client_config()).unwrap();
        let (stop, ok, failures) = (stop.clone(), ok.clone(), failures.clone());
        workers.push(tokio::spawn(async move {
            let resource = format!("reload/{w}");
            while !stop.load(Ordering::Relaxed) {
                let result: Result<(), lockd_client::Error> = async {
                    let opts = lockd_client::AcquireOptions::default().ttl(Duration::from_secs(5));
                    let lease = client.acquire(&resource, opts).await?;
                    client.renew(&resource, &lease.lease_id, None).await?;
                    if !client.release(&resource, &lease.lease_id).await? {
                        return Err(lockd_client::Error::BadTls {
                            reason: "release of the current lease returned false".into(),
                        });
                    }
                    Ok(())
                }
                .await;
                match result {
                    Ok(()) => ok.fetch_add(3, Ordering::Relaxed),
                    Err(e) => {
                        failures.lock().unwrap().push(format!("worker {w}: {e}"));
                        0
                    }
                };
            }
        }));
    }
    {
        // New connections all the time: each call makes its handshake with whatever
        // certificates the node has at that moment.
        let (stop, ok, failures, config) =
            (stop.clone(), ok.clone(), failures.clone(), client_config());
        workers.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let client = lockd_client::Client::with_config(config.clone()).unwrap();
                match client.status().await {
                    Ok(_) => ok.fetch_add(1, Ordering::Relaxed),
                    Err(e) => {
                        failures
                            .lock()
                            .unwrap()
                            .push(format!("new connection: {e}"));
                        0
                    }
                };
            }
        }));
    }
    // Load for a while before the reload: calls in flight across it are the point.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before_reload = ok.load(Ordering::Relaxed);
    let (cluster_id, old_der) = {
        let tls = cluster.tls.as_ref().unwrap();
        (tls.cluster_id.clone(), pem_der(&tls.nodes[0].cert))
    };
    let mut renewed = Vec::new();
    for id in 1..=3u64 {
        let tls = cluster.tls.as_ref().unwrap();
        let issued = tls
            .peer_ca
            .issue_node(&cluster_id, id, cluster.ip.into())
            .unwrap();
        assert_eq!(issued.cert, tls.nodes[id as usize - 1].cert, "same paths");
        renewed.push(pem_der(&issued.cert));
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(cluster.pid(id).unwrap() as i32),
            nix::sys::signal::Signal::SIGHUP,
        )
        .unwrap();
    }
    assert_ne!(renewed[0], old_der, "a new certificate was issued");
    for id in 1..=3u64 {
        let (addr, want) = (cluster.addr(id), &renewed[id as usize - 1]);
        poll::until_async(
            &format!("node {id} serves the reloaded certificate to new connections"),
            Duration::from_secs(10),
            || async {
                if served_certificate(&addr, &ca_path).await == *want {
                    Ok(())
                } else {
                    Err("it still serves the old one".to_owned())
                }
            },
        )
        .await;
    }
    // A broken file: the reload fails and the node keeps serving the certificate it has.
    let node1_cert = cluster.tls.as_ref().unwrap().nodes[0].cert.clone();
    std::fs::write(&node1_cert, b"not a certificate").unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(cluster.pid(1).unwrap() as i32),
        nix::sys::signal::Signal::SIGHUP,
    )
    .unwrap();
    // Nothing to wait for: the reload must change nothing, so give it a second to do harm.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        served_certificate(&cluster.addr(1), &ca_path).await,
        renewed[0]
    );
    // The load runs on after the reloads for a while: what is measured is calls made then.
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.await.unwrap();
    }
    let failures = failures.lock().unwrap().clone();
    let total = ok.load(Ordering::Relaxed);
    assert!(
        failures.is_empty(),
        "{} failed calls: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert!(
        total > before_reload + 50,
        "the load went on after the reload: {before_reload} calls before, {total} in all"
    );
    // Peer connections made after the reload: restart a follower (not node 1, whose file is
    // broken now); it dials and is dialled with the new certificates only, and must catch up.
    let leader = cluster.leader().await.unwrap();
    let follower = (1..=3).find(|id| *id != leader && *id != 1).unwrap();
    cluster.kill(follower);
    cluster.start_node(follower).unwrap();
    let client = lockd_client::Client::with_config(client_config()).unwrap();
    let mut caught_up = false;
    for _ in 0..50 {
        let lease = client
            .acquire("reload/after", lockd_client::AcquireOptions::default())
            .await
            .unwrap();
        client
            .release("reload/after", &lease.lease_id)
            .await
            .unwrap();
        let (f, l) = (cluster.status(follower).await, cluster.status(leader).await);
        if let (Ok(f), Ok(l)) = (f, l)
            && f.leader_id == leader
            && f.applied_index + 10 >= l.applied_index
        {
            caught_up = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(caught_up, "node {follower} did not rejoin after the reload");

    // The metrics listener speaks TLS with the node certificate too, reloaded with it.
    let metrics = cluster.metrics_addr(leader);
    assert_eq!(
        served_certificate(&metrics, &ca_path).await,
        renewed[leader as usize - 1]
    );
    let out = std::process::Command::new("curl")
        .args(["-sS", "--max-time", "5", "--cacert"])
        .arg(&ca_path)
        .arg(format!("https://{metrics}/metrics"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("lockd_requests_total"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
