//! How callers are identified: bearer tokens, forwarded identities, status and admin calls under
//! the policy, and the policy's start-up checks.

use std::time::Duration;

use super::{
    ALICE, BOB, CI_SECRET, POLICY, acquire, acquire_req, assert_denied, channel,
    leader_and_follower, lock, setup, with_headers,
};
use lockd_api::v1::cluster_client::ClusterClient;
use lockd_api::v1::{DescribeRequest, StatusRequest};
use lockd_tests::tls::TestCa;
use tonic::Code;

/// Goal: a bearer token from `--auth-tokens` identifies a caller; a wrong token is
/// UNAUTHENTICATED (not anonymous), and so is another scheme. lockctl takes the token from
/// `--auth-token-file` and prints PERMISSION_DENIED and UNAUTHENTICATED as one line each with
/// their own exit codes (11, 12). Method: a raw gRPC client with the header, then lockctl.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue15_bearer_tokens_identify_and_wrong_tokens_are_unauthenticated() {
    let mut s = setup().await;
    let (leader, follower) = leader_and_follower(&mut s.cluster).await;
    for node in [leader, follower] {
        let mut c = lock(&s.cluster, node, None);
        let bearer = format!("Bearer {CI_SECRET}");
        c.acquire(with_headers(
            acquire_req(&format!("tenant-b/tok-{node}"), &format!("t-{node}")),
            &[("authorization", &bearer)],
        ))
        .await
        .unwrap();
        assert_denied(
            c.acquire(with_headers(
                acquire_req("tenant-a/tok", &format!("t2-{node}")),
                &[("authorization", &bearer)],
            ))
            .await,
            "token:ci",
            "\"tenant-a/tok\"",
        );
        for bad in [
            format!("Bearer {}x", CI_SECRET),
            "Bearer short".to_owned(),
            format!("Basic {CI_SECRET}"),
        ] {
            let st = c
                .acquire(with_headers(
                    acquire_req("tenant-b/bad", "bad"),
                    &[("authorization", &bad)],
                ))
                .await
                .unwrap_err();
            assert_eq!(st.code(), Code::Unauthenticated, "{bad}: {st:?}");
            assert!(!st.message().contains(CI_SECRET), "{st:?}");
        }
        // A wrong token with a good certificate is still refused: the token was asked for.
        let st = lock(&s.cluster, node, Some(&s.bob))
            .acquire(with_headers(
                acquire_req("tenant-b/bad2", "bad2"),
                &[("authorization", "Bearer 0000000000000000000000000000")],
            ))
            .await
            .unwrap_err();
        assert_eq!(st.code(), Code::Unauthenticated, "{st:?}");
    }

    // lockctl.
    let ca = s.cluster.tls.as_ref().unwrap().peer_ca.cert_path.clone();
    let token_file = s.tokens.with_file_name("ci.token");
    std::fs::write(&token_file, format!("{CI_SECRET}\n")).unwrap();
    let bad_file = s.tokens.with_file_name("bad.token");
    std::fs::write(&bad_file, "not-the-secret-0000000000000000\n").unwrap();
    let eps = s.cluster.endpoints();
    let run = |extra: &[&str]| {
        let out = lockd_tests::process::command("lockctl")
            .args([
                "--endpoints",
                eps.as_str(),
                "--cacert",
                ca.to_str().unwrap(),
                "--timeout",
                "5s",
            ])
            .args(extra)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let tf = token_file.to_str().unwrap();
    let (code, out, err) = run(&["--auth-token-file", tf, "acquire", "tenant-b/ctl"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("fencing_token"), "{out}");
    let (code, out, err) = run(&["--auth-token-file", tf, "acquire", "tenant-a/ctl"]);
    assert_eq!(code, 11, "{out}{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(
        err.starts_with("lockctl: ")
            && err.contains("permission denied")
            && err.contains("token:ci")
            && err.contains("\"tenant-a/ctl\""),
        "{err}"
    );
    let (code, out, err) = run(&["--auth-token-file", bad_file.to_str().unwrap(), "status"]);
    assert_eq!(code, 12, "{out}{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("bearer token is not valid"), "{err}");
    // The environment variable works as the flag does.
    let out = lockd_tests::process::command("lockctl")
        .args([
            "--endpoints",
            eps.as_str(),
            "--cacert",
            ca.to_str().unwrap(),
        ])
        .args(["describe", "tenant-b/ctl"])
        .env("LOCKCTL_AUTH_TOKEN_FILE", tf)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    // Certificates work through lockctl too, and a denial is one line.
    let (code, _, err) = run(&[
        "--cert",
        s.alice.cert.to_str().unwrap(),
        "--key",
        s.alice.key.to_str().unwrap(),
        "describe",
        "tenant-b/ctl",
    ]);
    assert_eq!(code, 11, "{err}");
    assert!(err.contains(ALICE), "{err}");
}

/// Goal: a client that sets the forwarding headers itself gains nothing: it can claim
/// neither another identity nor forwarded status. Method: with alice's certificate, with no
/// certificate, and with a client certificate naming node 2 (issued by the client CA, not the
/// peer CA), send calls carrying `lockd-forwarded-by` and/or `lockd-forwarded-identity-bin`
/// naming bob, to the leader and to a follower. Every one is UNAUTHENTICATED, and nothing was
/// acquired. Control: the same calls without the headers are judged as the caller itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue15_clients_cannot_claim_forwarded_identities() {
    let mut s = setup().await;
    let (leader, follower) = leader_and_follower(&mut s.cluster).await;
    let fake_node = s
        .client_ca
        .issue("fake-node2", &["node-2.test.lockd".to_owned()], &[])
        .unwrap();
    let by = lockd_api::FORWARDED_HEADER;
    let ident = lockd_server::auth::FORWARDED_IDENTITY_HEADER;
    let header_sets: Vec<Vec<(&str, &str)>> = vec![
        vec![(by, "2"), (ident, BOB)],
        vec![(ident, BOB)],
        vec![(by, "2")],
    ];
    for who in [Some(&s.alice), None, Some(&fake_node)] {
        for node in [leader, follower] {
            for headers in &header_sets {
                let mut c = lock(&s.cluster, node, who);
                let st = c
                    .acquire(with_headers(
                        acquire_req("tenant-b/forged", "forged"),
                        headers,
                    ))
                    .await
                    .unwrap_err();
                assert_eq!(st.code(), Code::Unauthenticated, "{headers:?}: {st:?}");
                assert!(st.message().starts_with("lockd: "), "{st:?}");
                let st = ClusterClient::new(channel(&s.cluster, node, who))
                    .status(with_headers(StatusRequest {}, headers))
                    .await
                    .unwrap_err();
                assert_eq!(st.code(), Code::Unauthenticated, "{headers:?}: {st:?}");
            }
        }
    }
    // Control: without the headers, alice is alice.
    assert_denied(
        acquire(
            &mut lock(&s.cluster, follower, Some(&s.alice)),
            "tenant-b/forged",
            "f2",
        )
        .await,
        ALICE,
        "\"tenant-b/forged\"",
    );
    let d = lock(&s.cluster, leader, Some(&s.bob))
        .describe(with_headers(
            DescribeRequest {
                resource: "tenant-b/forged".into(),
            },
            &[],
        ))
        .await
        .unwrap()
        .into_inner();
    assert!(!d.held, "{d:?}");
}

/// Goal: status (and admin) follow the policy. Method: `cert:ops` and `anonymous`
/// are granted status, alice is not: alice gets PERMISSION_DENIED naming her and the operation,
/// on every node (status is answered locally, never forwarded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue15_status_follows_the_policy() {
    let s = setup().await;
    for node in 1..=3 {
        let st = ClusterClient::new(channel(&s.cluster, node, Some(&s.alice)))
            .status(with_headers(StatusRequest {}, &[]))
            .await
            .unwrap_err();
        assert_eq!(st.code(), Code::PermissionDenied, "{st:?}");
        assert!(
            st.message().contains(ALICE) && st.message().contains("status"),
            "{st:?}"
        );
        ClusterClient::new(channel(&s.cluster, node, Some(&s.ops)))
            .status(with_headers(StatusRequest {}, &[]))
            .await
            .unwrap();
        ClusterClient::new(channel(&s.cluster, node, None))
            .status(with_headers(StatusRequest {}, &[]))
            .await
            .unwrap();
        // ops may not lock anything, anonymous neither.
        for who in [Some(&s.ops), None] {
            let st = acquire(&mut lock(&s.cluster, node, who), "tenant-a/x", "o-1")
                .await
                .unwrap_err();
            assert_eq!(st.code(), Code::PermissionDenied, "{st:?}");
        }
    }
}

/// Goal: the signing key's admin RPCs follow the
/// policy's `admin`: a tenant may neither list nor rotate the key, on the leader or through a
/// follower, and the operator (`cert:ops`, granted `admin`) may, through a follower as well
/// (the follower forwards the operator's identity, which the leader authorizes again). Method:
/// the policy cluster; SigningKeys and RotateSigningKey from alice, anonymous and ops, on every
/// node; the active key id before and after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue15_signing_key_admin_calls_follow_the_policy() {
    use lockd_api::v1::{RotateSigningKeyRequest, SigningKeysRequest};
    let mut s = setup().await;
    let (leader, follower) = leader_and_follower(&mut s.cluster).await;
    // The key is installed right after the first leader's first commit.
    let mut active = None;
    for _ in 0..50 {
        let keys = ClusterClient::new(channel(&s.cluster, leader, Some(&s.ops)))
            .signing_keys(with_headers(SigningKeysRequest {}, &[]))
            .await
            .unwrap()
            .into_inner();
        active = keys
            .keys
            .iter()
            .find(|k| k.active)
            .map(|k| k.key_id.clone());
        if active.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let active = active.expect("an active signing key");
    for node in [leader, follower] {
        for who in [Some(&s.alice), None] {
            let st = ClusterClient::new(channel(&s.cluster, node, who))
                .rotate_signing_key(with_headers(
                    RotateSigningKeyRequest {
                        replaces_key_id: active.clone(),
                    },
                    &[],
                ))
                .await
                .unwrap_err();
            assert_eq!(st.code(), Code::PermissionDenied, "node {node}: {st:?}");
            assert!(st.message().contains("admin"), "{st:?}");
            let st = ClusterClient::new(channel(&s.cluster, node, who))
                .signing_keys(with_headers(SigningKeysRequest {}, &[]))
                .await
                .unwrap_err();
            assert_eq!(st.code(), Code::PermissionDenied, "node {node}: {st:?}");
        }
    }
    let keys = ClusterClient::new(channel(&s.cluster, follower, Some(&s.ops)))
        .signing_keys(with_headers(SigningKeysRequest {}, &[]))
        .await
        .unwrap()
        .into_inner();
    let still = keys.keys.iter().find(|k| k.active).unwrap();
    assert_eq!(still.key_id, active, "refused calls rotated nothing");
    let rotated = ClusterClient::new(channel(&s.cluster, follower, Some(&s.ops)))
        .rotate_signing_key(with_headers(
            RotateSigningKeyRequest {
                replaces_key_id: active.clone(),
            },
            &[],
        ))
        .await
        .expect("the operator rotates through a follower")
        .into_inner();
    assert_ne!(rotated.key_id, active);
}

/// Goal: start-up refuses a bad policy, tokens file or combination with one line
/// that names the problem. Method: `lockd` with each bad input exits non-zero; its stderr is one
/// line naming the flag, the file and the line or value.
#[test]
fn issue15_bad_policies_fail_at_start_naming_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "peer").unwrap();
    let node = ca
        .issue_node("lockd", 1, std::net::Ipv4Addr::LOCALHOST.into())
        .unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    let good = write("good.toml", POLICY);
    let typo = write(
        "typo.toml",
        "[[grant]]\nidentities = [\"cert:a\"]\nresources = [\"a/\"]\noperations = [\"aquire\"]\n",
    );
    let prefix = write(
        "prefix.toml",
        "[[grant]]\nidentities = [\"cert:a\"]\n\nresources = [\"a/*\"]\noperations = [\"acquire\"]\n",
    );
    let tokens = write("tokens", "ci not-hex\n");
    let port = 7000 + (std::process::id() % 1000) as u16;
    let tls: Vec<String> = vec![
        "--tls-cert".into(),
        node.cert.display().to_string(),
        "--tls-key".into(),
        node.key.display().to_string(),
        "--peer-ca".into(),
        ca.cert_path.display().to_string(),
    ];
    let cases: Vec<(Vec<String>, Vec<&str>)> = vec![
        (
            [tls.clone(), vec!["--auth-policy".into(), typo.clone()]].concat(),
            vec!["--auth-policy", "typo.toml", "line 4", "\"aquire\""],
        ),
        (
            [tls.clone(), vec!["--auth-policy".into(), prefix.clone()]].concat(),
            vec!["prefix.toml", "line 4", "\"a/*\""],
        ),
        (
            [
                tls.clone(),
                vec![
                    "--auth-policy".into(),
                    good.clone(),
                    "--auth-tokens".into(),
                    tokens.clone(),
                ],
            ]
            .concat(),
            vec!["--auth-tokens", "line 1", "64 hex digits"],
        ),
        (
            [
                tls.clone(),
                vec!["--auth-policy".into(), "/nonexistent/p.toml".into()],
            ]
            .concat(),
            vec!["--auth-policy", "/nonexistent/p.toml"],
        ),
        (
            vec!["--auth-policy".into(), good.clone()],
            vec!["--auth-policy", "needs TLS", "--tls-cert"],
        ),
        (
            [tls.clone(), vec!["--auth-tokens".into(), tokens.clone()]].concat(),
            vec!["--auth-tokens", "needs --auth-policy"],
        ),
    ];
    for (i, (args, expect)) in cases.into_iter().enumerate() {
        let out = lockd_tests::process::command("lockd")
            .args(["--id", "1", "--listen"])
            .arg(format!("127.0.0.1:{port}"))
            .arg("--data-dir")
            .arg(dir.path().join(format!("d{i}")))
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.trim_end().lines().last().unwrap_or_default().to_owned();
        assert!(!out.status.success(), "{args:?} started");
        for e in expect {
            assert!(
                last.contains(e),
                "{args:?}: {e:?} not in {last:?} (stderr {err})"
            );
        }
        assert!(last.starts_with("lockd: "), "{err}");
    }
}
