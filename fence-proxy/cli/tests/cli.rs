//! The `fence-proxy` binary refuses bad flags with one line on stderr and a non-zero exit, and
//! serves its metrics and health endpoints.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a failed unwrap is a failed test, with its message"
)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_fence-proxy");

fn refused(args: &[&str]) -> String {
    let out = Command::new(BIN)
        .args(args)
        .output()
        .expect("run fence-proxy");
    assert!(!out.status.success(), "{args:?} succeeded");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        stderr.trim_end().lines().count(),
        1,
        "{args:?}: not one line: {stderr:?}"
    );
    assert!(stderr.starts_with("fence-proxy: "), "{stderr:?}");
    stderr
}

/// Goal: every bad invocation names what is wrong, on one line, with a non-zero status.
#[test]
fn bad_flags_give_one_line_and_non_zero_exit() {
    assert!(refused(&[]).contains("a command is required"));
    assert!(refused(&["bogus"]).contains("'bogus'"));
    assert!(refused(&["http", "--upstream", "http://127.0.0.1:1"]).contains("--listen"));
    assert!(refused(&["http", "--listen", "nope", "--upstream", "http://h"]).contains("'nope'"));
    let e = refused(&["http", "--listen", "127.0.0.1:0", "--upstream", "https://h"]);
    assert!(e.contains("https"), "{e}");
    let e = refused(&[
        "http",
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        "http://h",
        "--store",
        "mysql://u:pw@h/d",
    ]);
    assert!(e.contains("redb:PATH"), "{e}");
    let e = refused(&[
        "http",
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        "http://h",
        "--upstream-timeout",
        "soon",
    ]);
    assert!(e.contains("'soon'"), "{e}");
    // Parsed fine, but the store cannot be opened: a one-line runtime error, exit 1.
    let e = refused(&[
        "http",
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        "http://h",
        "--store",
        "redb:/nonexistent/dir/e.redb",
    ]);
    assert!(e.contains("/nonexistent/dir/e.redb"), "{e}");
}

#[test]
fn help_exits_zero() {
    let out = Command::new(BIN).args(["http", "--help"]).output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--listen",
        "--upstream",
        "--store",
        "--metrics-listen",
        "--upstream-timeout",
    ] {
        assert!(text.contains(flag), "{flag} missing from --help");
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn get(port: u16, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

/// Goal: `/healthz` answers, `/readyz` names the unreachable upstream, and `/metrics` shows the
/// histogram with bucket boundaries.
#[test]
fn metrics_and_health_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let (listen, metrics) = (free_port(), free_port());
    let mut child = Command::new(BIN)
        .args(["http", "--listen", &format!("127.0.0.1:{listen}")])
        .args(["--upstream", "http://127.0.0.1:1", "--metrics-listen"])
        .arg(format!("127.0.0.1:{metrics}"))
        .arg("--store")
        .arg(format!("redb:{}", dir.path().join("e.redb").display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let health = loop {
        if let Some(r) = get(metrics, "/healthz") {
            break r;
        }
        assert!(Instant::now() < deadline, "metrics endpoint never came up");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        health.starts_with("HTTP/1.1 200") && health.ends_with("ok\n"),
        "{health}"
    );
    // A read to a dead upstream: 502, counted, and its forward timed. The proxy's own listener
    // may bind a moment after the metrics one.
    let r = loop {
        if let Some(r) = get(listen, "/x") {
            break r;
        }
        assert!(Instant::now() < deadline, "proxy listener never came up");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(r.starts_with("HTTP/1.1 502"), "{r}");
    // Nothing listens on the upstream's port: /readyz says so (its first check runs as the
    // proxy starts listening).
    let ready = loop {
        let r = get(metrics, "/readyz").unwrap();
        if r.contains("upstream") || Instant::now() > deadline {
            break r;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        ready.starts_with("HTTP/1.1 503") && ready.contains("not ready: upstream: 127.0.0.1:1: "),
        "{ready}"
    );
    let m = get(metrics, "/metrics").unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        m.contains(r#"fence_proxy_requests_total{frontend="http",result="upstream-error"} 1"#),
        "{m}"
    );
    assert!(
        m.contains(r#"fence_proxy_forward_duration_seconds_bucket{frontend="http",le="0.001"}"#),
        "{m}"
    );
}

/// Goal: the Postgres front end is wired in and validates its flags the same way.
#[test]
fn postgres_subcommand_is_wired() {
    let out = Command::new(BIN)
        .args(["postgres", "--help"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("--upstream") && text.contains("--metrics-listen"),
        "{text}"
    );
    let e = refused(&["postgres", "--listen", "127.0.0.1:0"]);
    assert!(e.contains("--upstream"), "{e}");
}

/// Goal: a flag that was removed (`--pool-size` of the Postgres front end) is named as removed,
/// on one line with a non-zero status, whether given as a flag or in its environment variable.
#[test]
fn removed_pool_size_is_named() {
    let upstream = "postgres://postgres@127.0.0.1:1/test";
    let e = refused(&["postgres", "--upstream", upstream, "--pool-size", "2"]);
    assert!(e.contains("--pool-size was removed"), "{e}");
    let out = Command::new(BIN)
        .args(["postgres", "--upstream", upstream])
        .env("FENCE_PROXY_PG_POOL_SIZE", "2")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("FENCE_PROXY_PG_POOL_SIZE (--pool-size) was removed"),
        "{stderr}"
    );
}

/// Goal: `--config FILE` gives a front end all its flags (here the HTTP front end runs from a
/// file alone), a flag on the command line beats the file, and a bad file is refused on one
/// line naming the file and the key.
#[test]
fn a_config_file_supplies_the_flags() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("proxy.toml");
    let (listen, metrics) = (free_port(), free_port());
    std::fs::write(
        &file,
        format!(
            "log-format = \"json\"\n[http]\nlisten = \"127.0.0.1:{listen}\"\nupstream = \"http://127.0.0.1:1\"\nmetrics-listen = \"127.0.0.1:1\"\nstore = \"redb:{}\"\n",
            dir.path().join("e.redb").display()
        ),
    )
    .unwrap();
    // The file's metrics address (port 1) is overridden on the command line.
    let mut child = Command::new(BIN)
        .arg("--config")
        .arg(&file)
        .args(["http", "--metrics-listen", &format!("127.0.0.1:{metrics}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let reply = loop {
        if let (Some(_), Some(r)) = (get(metrics, "/healthz"), get(listen, "/x")) {
            break r;
        }
        assert!(Instant::now() < deadline, "the proxy never came up");
        std::thread::sleep(Duration::from_millis(50));
    };
    child.kill().unwrap();
    child.wait().unwrap();
    // Its upstream, from the file, does not answer.
    assert!(reply.starts_with("HTTP/1.1 502"), "{reply}");

    for (text, expected) in [
        (
            "[http]\nlisen = \"127.0.0.1:1\"\n",
            "unknown key \"http.lisen\"",
        ),
        (
            "[postgres]\npool-size = 2\n",
            "unknown key \"postgres.pool-size\"",
        ),
        ("[http]\nlisten = \"nope\"\n", "http.listen = \"nope\""),
        ("[htp]\n", "unknown table [htp]"),
        // A certificate without its key is refused as on the command line, never plain HTTP.
        (
            "[http]\nlisten = \"127.0.0.1:1\"\nupstream = \"http://h\"\ntls-cert = \"c.pem\"\ntls-client-ca = \"ca.pem\"\n",
            "--tls-key",
        ),
    ] {
        std::fs::write(&file, text).unwrap();
        let e = refused(&["--config", &file.display().to_string(), "http"]);
        assert!(e.contains(expected), "{text}: {e}");
    }
}
