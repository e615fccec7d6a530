//! How lockd and fence-proxy are installed and started: the command line a new operator meets
//! and the systemd units in packaging/systemd; and `lockd-bench`, the program an operator runs
//! to size a cluster, end to end.
//!
//! # Layout
//! - this file: the command line and the systemd units.
//! - `bench_smoke`: every mode of `lockd-bench` runs against a real cluster and reports.
//! - `docs`: shell completions and manual pages of lockd, lockctl and fence-proxy.

mod bench_smoke;
mod docs;

use std::path::{Path, PathBuf};
use std::process::Command;

use lockd_tests::process::bin_path;

/// `lockd` without a subcommand needs --id, --listen and --data-dir: its help marks them as
/// required, a run without them names every missing flag, and a mistyped flag keeps clap's
/// suggestion of the right one. Each error is one `lockd:` message with exit code 2.
#[test]
fn the_command_line_names_required_and_mistyped_flags() {
    let run = |args: &[&str]| {
        let out = Command::new(bin_path("lockd"))
            .args(args)
            .env_remove("LOCKD_ID")
            .env_remove("LOCKD_LISTEN")
            .env_remove("LOCKD_DATA_DIR")
            .output()
            .expect("running lockd");
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (out.status.code(), text(&out.stdout), text(&out.stderr))
    };

    let (code, help, _) = run(&["--help"]);
    assert_eq!(code, Some(0));
    let usage = help.lines().find(|l| l.starts_with("Usage:")).unwrap_or("");
    for flag in ["--id <ID>", "--listen <LISTEN>", "--data-dir <DATA_DIR>"] {
        assert!(usage.contains(flag), "{flag} not required in: {usage}");
    }

    let (code, _, err) = run(&[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.starts_with("lockd: "), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "not one line: {err}");
    for flag in ["--id", "--listen", "--data-dir"] {
        assert!(err.contains(flag), "{flag} not named in: {err}");
    }

    let (code, _, err) = run(&["--lisen", "127.0.0.1:1"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("'--lisen'") && err.contains("--listen"),
        "{err}"
    );

    // `lockd dev` needs none of them.
    let (code, help, _) = run(&["dev", "--help"]);
    assert_eq!(code, Some(0));
    assert!(!help.contains("--id"), "{help}");
}

/// The units in packaging/systemd, each with its binary.
fn units() -> Vec<(PathBuf, &'static str)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/systemd");
    let units = [
        ("lockd.service", "lockd"),
        ("fence-proxy-http.service", "fence-proxy"),
        ("fence-proxy-postgres.service", "fence-proxy"),
    ];
    units.iter().map(|(u, b)| (dir.join(u), *b)).collect()
}

/// Goal: the shipped systemd units are valid and hardened, and every variable their comments
/// tell operators to set is one the binary reads. Method: each unit, with ExecStart pointed at
/// the built binary, through `systemd-analyze verify` (no output allowed: unknown keys are only
/// warnings there) and `systemd-analyze security --offline` with an exposure threshold of 2.0;
/// the LOCKD_* / FENCE_PROXY_* names in the unit against the binary's --help.
#[test]
fn systemd_units_verify_and_are_hardened() {
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_err()
    {
        lockd_tests::skip::report("no systemd-analyze on PATH (apt-get install systemd)");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    for (unit, binary) in units() {
        let name = unit.file_name().unwrap().to_str().unwrap().to_owned();
        let text = std::fs::read_to_string(&unit).unwrap();
        let exe = bin_path(binary);
        let local = text.replace(&format!("/usr/local/bin/{binary}"), exe.to_str().unwrap());
        assert_ne!(
            local, text,
            "{name}: ExecStart is not /usr/local/bin/{binary}"
        );
        let copy = tmp.path().join(&name);
        std::fs::write(&copy, local).unwrap();

        let out = Command::new("systemd-analyze")
            .args(["verify", "--man=no"])
            .arg(&copy)
            .output()
            .unwrap();
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success() && said.trim().is_empty(),
            "{name}: {said}"
        );

        // Exposure is 0 (locked down) to 10 (unrestricted); the threshold is given times ten.
        let out = Command::new("systemd-analyze")
            .args(["security", "--offline=yes", "--threshold=20", "--no-pager"])
            .arg(&copy)
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        let overall = said
            .lines()
            .find(|l| l.contains("Overall exposure level"))
            .unwrap_or("");
        assert!(
            out.status.success(),
            "{name}: exposure above 2.0: {overall}"
        );

        let help = Command::new(&exe)
            .args(match binary {
                "lockd" => &["--help"][..],
                _ if name.contains("http") => &["http", "--help"],
                _ => &["postgres", "--help"],
            })
            .output()
            .unwrap();
        let help = String::from_utf8_lossy(&help.stdout);
        let named: Vec<&str> = text
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| w.starts_with("LOCKD_") || w.starts_with("FENCE_PROXY_"))
            .filter(|w| !w.ends_with('_'))
            .collect();
        assert!(!named.is_empty(), "{name} names no variable");
        for var in named {
            assert!(
                help.contains(&format!("[env: {var}=")),
                "{name} names {var}, which `{binary}` does not read"
            );
        }
    }
}
