//! lockctl's behaviour without a cluster: flag errors, endpoint errors and the JSON error object.
//! Every failure must be exactly one line on stderr with the documented exit code.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a failed unwrap is a failed test, with its message"
)]

use std::process::{Command, Output};

const LOCKCTL: &str = env!("CARGO_BIN_EXE_lockctl");

fn lockctl(args: &[&str]) -> Output {
    Command::new(LOCKCTL)
        .args(args)
        .env_remove("LOCKD_ENDPOINTS")
        .env_remove("RUST_LOG")
        .output()
        .expect("run lockctl")
}

/// Asserts a failure with `code` and a single stderr line starting with `lockctl: ` that contains
/// every string of `names`.
fn assert_one_line_error(out: &Output, code: i32, names: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "stderr: {stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "expected one line, got: {stderr:?}");
    assert!(lines[0].starts_with("lockctl: "), "{stderr}");
    for name in names {
        assert!(lines[0].contains(name), "{name:?} missing from {stderr:?}");
    }
}

/// A local port with nothing listening (bound, then released).
fn dead_endpoint() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

#[test]
fn missing_command_is_a_usage_error() {
    assert_one_line_error(&lockctl(&[]), 2, &["command is required"]);
}

#[test]
fn unknown_flag_is_named() {
    assert_one_line_error(&lockctl(&["status", "--frobnicate"]), 2, &["--frobnicate"]);
}

#[test]
fn bad_duration_is_named() {
    assert_one_line_error(
        &lockctl(&["acquire", "r", "--ttl", "soon"]),
        2,
        &["soon", "--ttl"],
    );
}

#[test]
fn hold_needs_a_command() {
    assert_one_line_error(&lockctl(&["hold", "r"]), 2, &["COMMAND"]);
}

#[test]
fn malformed_endpoint_is_named() {
    let out = lockctl(&["--endpoints", "127.0.0.1:7001,nonsense", "describe", "r"]);
    assert_one_line_error(&out, 2, &["\"nonsense\"", "port"]);
}

#[test]
fn unreachable_endpoints_fail_with_code_9_within_the_timeout() {
    let dead = dead_endpoint();
    let started = std::time::Instant::now();
    let out = lockctl(&["--endpoints", &dead, "--timeout", "1s", "describe", "r"]);
    assert!(
        started.elapsed() < std::time::Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_one_line_error(&out, 9, &[&dead, "not done"]);
}

#[test]
fn json_errors_are_one_object() {
    let dead = dead_endpoint();
    let out = lockctl(&[
        "--json",
        "--endpoints",
        &dead,
        "--timeout",
        "500ms",
        "acquire",
        "r",
    ]);
    assert_one_line_error(&out, 9, &[&dead]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    let v: serde_json::Value =
        serde_json::from_str(stdout.trim()).expect("stdout is one JSON object");
    assert_eq!(v["error"]["kind"], "unavailable", "{v}");
    assert_eq!(v["error"]["exit_code"], 9, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains(&dead),
        "{v}"
    );
}

#[test]
fn bad_request_id_is_refused_before_sending() {
    let long = "x".repeat(129);
    let dead = dead_endpoint();
    let out = lockctl(&["--endpoints", &dead, "acquire", "r", "--request-id", &long]);
    assert_one_line_error(&out, 7, &["129"]);
}

#[test]
fn help_succeeds_and_lists_commands() {
    let out = lockctl(&["--help"]);
    assert_eq!(out.status.code(), Some(0));
    let help = String::from_utf8(out.stdout).unwrap();
    for cmd in ["acquire", "renew", "release", "describe", "status", "hold"] {
        assert!(help.contains(cmd), "{cmd} missing from help");
    }
}

/// A local endpoint that accepts connections and never answers: every attempt sent there may
/// have arrived, so an acquire against it ends as "outcome unknown" (exit 8). The listener and
/// its connections live until the process ends.
fn silent_endpoint() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in l.incoming().flatten() {
            held.push(conn);
        }
    });
    addr
}

/// The one 32-hex-digit word of `text` (a random request id), if any.
fn hex_id_in(text: &str) -> Option<String> {
    text.split(|c: char| !c.is_ascii_hexdigit())
        .find(|w| w.len() == 32)
        .map(str::to_owned)
}

/// Goal (review "clients2" finding 1): after exit 8 on `acquire` the user can repeat it with
/// `--request-id`, so lockctl must show the whole request id (the library's message shortens it,
/// as it is a credential): on a second stderr line, and as `request_id` in the JSON error.
/// Method: acquire against a node that never answers, with a random id and with a given one.
#[test]
fn review_clients2_finding1_outcome_unknown_shows_the_full_request_id() {
    let silent = silent_endpoint();
    let out = lockctl(&[
        "--json",
        "--endpoints",
        &silent,
        "--timeout",
        "1s",
        "acquire",
        "r",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(8), "stderr: {stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 2, "the error and the request id: {stderr:?}");
    assert!(lines[0].starts_with("lockctl: "), "{stderr}");
    let id = hex_id_in(lines[1]).unwrap_or_else(|| panic!("no full request id in {stderr:?}"));
    assert!(
        lines[1].contains("--request-id") && lines[1].contains("credential"),
        "{stderr}"
    );
    assert!(
        lines[0].contains(&id[..8]) && !lines[0].contains(&id),
        "the message shows the id shortened: {stderr}"
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let v: serde_json::Value =
        serde_json::from_str(stdout.trim()).expect("stdout is one JSON object");
    assert_eq!(v["error"]["kind"], "outcome_unknown", "{v}");
    assert_eq!(v["error"]["request_id"], id.as_str(), "{v}");
    assert!(
        !v["error"]["message"].as_str().unwrap().contains(&id),
        "{v}"
    );

    // A given id is shown whole as well (in text mode, without a JSON object).
    let given = "given-0123456789-abcdef";
    let out = lockctl(&[
        "--endpoints",
        &silent,
        "--timeout",
        "1s",
        "acquire",
        "r",
        "--request-id",
        given,
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(8), "stderr: {stderr}");
    assert!(
        stderr.lines().nth(1).is_some_and(|l| l.contains(given)),
        "{stderr}"
    );
    assert!(
        out.stdout.is_empty(),
        "{:?}",
        String::from_utf8_lossy(&out.stdout)
    );
}
