//! lockd-bench's command line without a cluster: every failure is one line on stderr that starts
//! with `lockd-bench: ` and names the offending value, with a non-zero exit code.

use std::process::{Command, Output};

const BENCH: &str = env!("CARGO_BIN_EXE_lockd-bench");

fn bench(args: &[&str]) -> Output {
    Command::new(BENCH)
        .args(args)
        .env_remove("LOCKD_ENDPOINTS")
        .output()
        .expect("run lockd-bench")
}

/// Asserts exit `code` and a single stderr line containing every string of `names`.
fn assert_one_line_error(out: &Output, code: i32, names: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "stderr: {stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "expected one line, got: {stderr:?}");
    assert!(lines[0].starts_with("lockd-bench: "), "{stderr}");
    for name in names {
        assert!(lines[0].contains(name), "{name:?} missing from {stderr:?}");
    }
    assert!(out.stdout.is_empty(), "nothing on stdout on failure");
}

#[test]
fn unknown_flag_is_named() {
    assert_one_line_error(&bench(&["mixed", "--frobnicate"]), 2, &["--frobnicate"]);
}

#[test]
fn missing_subcommand_lists_them() {
    assert_one_line_error(&bench(&[]), 2, &["mixed", "max", "handoff"]);
}

#[test]
fn bad_duration_is_named() {
    assert_one_line_error(&bench(&["mixed", "--duration", "soon"]), 2, &["soon"]);
}

#[test]
fn inconsistent_held_is_named_before_connecting() {
    assert_one_line_error(
        &bench(&["mixed", "--resources", "1000", "--held", "900"]),
        1,
        &["--held 900", "--resources 1000"],
    );
}

#[test]
fn bad_status_callers_is_named() {
    assert_one_line_error(&bench(&["mixed", "--status-callers", "many"]), 2, &["many"]);
}

#[test]
fn too_many_status_callers_is_named_before_connecting() {
    assert_one_line_error(
        &bench(&["mixed", "--status-callers", "100000"]),
        1,
        &["--status-callers 100000", "256"],
    );
}

#[test]
fn unreachable_cluster_is_one_line() {
    // A bound-then-released local port: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let endpoint = format!("127.0.0.1:{port}");
    assert_one_line_error(
        &bench(&["max", "--smoke", "--endpoints", &endpoint]),
        1,
        &["no leader found", &endpoint],
    );
}

#[test]
fn zero_interval_is_named_before_connecting() {
    assert_one_line_error(
        &bench(&["mixed", "--interval", "0s"]),
        1,
        &["--interval 0ns", "at least 1s"],
    );
}

#[test]
fn interval_longer_than_the_run_is_named_before_connecting() {
    assert_one_line_error(
        &bench(&["mixed", "--duration", "30s", "--interval", "60s"]),
        1,
        &["--interval 60s", "--duration 30s"],
    );
}
