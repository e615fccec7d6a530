//! Shell completions and manual pages, generated from each binary's flags: what an operator
//! installs next to the binaries (README, "Install").

use std::path::Path;
use std::process::{Command, Output};

use lockd_tests::process::bin_path;

/// Each installed binary with words its completion script and manual pages must know: a
/// command and a flag of its own.
const BINARIES: [(&str, &str, &str); 3] = [
    ("lockd", "dev", "--data-dir"),
    ("lockctl", "acquire", "--endpoints"),
    ("fence-proxy", "postgres", "--listen"),
];

fn run(binary: &str, args: &[&str]) -> Output {
    let out = Command::new(bin_path(binary))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {binary}: {e}"));
    assert!(
        out.status.success(),
        "{binary} {args:?}: {:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Goal: `completions SHELL` prints a script the shell accepts that completes the binary's
/// commands and flags; a shell clap does not know is refused with a usage error naming it.
#[test]
fn completions_know_every_command_and_flag() {
    let dir = tempfile::tempdir().unwrap();
    for (binary, command, flag) in BINARIES {
        let bash = text(&run(binary, &["completions", "bash"]));
        assert!(
            bash.contains(command) && bash.contains(flag),
            "{binary}: {bash}"
        );
        let file = dir.path().join(format!("{binary}.bash"));
        std::fs::write(&file, &bash).unwrap();
        let check = Command::new("bash").arg("-n").arg(&file).output().unwrap();
        assert!(
            check.status.success(),
            "bash -n {binary}: {}",
            String::from_utf8_lossy(&check.stderr)
        );

        let zsh = text(&run(binary, &["completions", "zsh"]));
        assert!(zsh.starts_with(&format!("#compdef {binary}")), "{zsh}");
        let fish = text(&run(binary, &["completions", "fish"]));
        assert!(fish.contains(&format!("complete -c {binary}")), "{fish}");

        let out = Command::new(bin_path(binary))
            .args(["completions", "tcsh"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{binary}: {err}");
        assert!(err.contains("tcsh"), "{binary}: {err}");
    }
}

/// Goal: `man` prints the main page, and `man --out-dir DIR` writes one page per command,
/// subcommands of subcommands included, each a page groff renders without a warning.
#[test]
fn manual_pages_cover_every_command() {
    for (binary, command, flag) in BINARIES {
        let page = text(&run(binary, &["man"]));
        assert!(
            page.contains(&format!(".TH {binary} 1")),
            "{binary}: {page}"
        );
        assert!(page.contains(command), "{binary}: {page}");

        let dir = tempfile::tempdir().unwrap();
        let listed = text(&run(
            binary,
            &["man", "--out-dir", &dir.path().display().to_string()],
        ));
        let mut files: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        files.sort();
        assert_eq!(listed.lines().count(), files.len(), "{listed}");
        for expected in [format!("{binary}.1"), format!("{binary}-{command}.1")] {
            assert!(files.contains(&expected), "{binary}: {files:?}");
        }
        assert!(
            !files.iter().any(|f| f.ends_with("-help.1")),
            "{binary}: {files:?}"
        );
        let page =
            std::fs::read_to_string(dir.path().join(format!("{binary}-{command}.1"))).unwrap();
        // roff escapes the dashes of flags.
        assert!(page.contains(&flag.replace('-', "\\-")), "{binary}: {page}");
        for file in &files {
            check_renders(&dir.path().join(file));
        }
    }
    let dir = tempfile::tempdir().unwrap();
    run(
        "lockctl",
        &["man", "--out-dir", &dir.path().display().to_string()],
    );
    assert!(dir.path().join("lockctl-keys-rotate.1").exists());
}

/// groff reads `page` as a manual page with every warning on; none may show.
fn check_renders(page: &Path) {
    let out = match Command::new("groff")
        .args(["-man", "-Tutf8", "-ww", "-z"])
        .arg(page)
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            lockd_tests::skip::report(&format!("groff not runnable ({e}): install groff-base"));
            return;
        }
    };
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && err.trim().is_empty(),
        "{}: {err}",
        page.display()
    );
}
