//! The `lockd` of an earlier commit, built from this repository's own history, for the rolling
//! upgrade test (`tests/tests/failover/upgrade.rs`).
//!
//! The commit is [`PREVIOUS_FORMAT_COMMIT`]: the last one before the current peer protocol
//! version that changed what nodes exchange or keep (Raft messages, log entries, snapshots). Its
//! source comes out of `git archive` (the checkout needs its history: a clone, not a tarball) and
//! is built once into a cache folder, `$LOCKD_PREVIOUS_CACHE` or
//! `$HOME/.cache/lockd-ci/previous`, keyed by the commit: later runs take the binary from there.
//! The build is seeded with a copy of this build's compiled dependencies (the same `Cargo.lock`
//! yields the same artifacts), so only the workspace's own crates compile.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, bail};

/// Commit afd6dd9 (backup and restore, with the restore id on every Raft message): lockd of peer
/// protocol 1, the last format before the protocol version travelled on every message.
pub const PREVIOUS_FORMAT_COMMIT: &str = "afd6dd99661a51dd9134a80da279e11f7b2ac445";

/// The path of the previous commit's `lockd`, building it first if the cache has none.
pub fn lockd_binary() -> anyhow::Result<PathBuf> {
    let cache = cache_root()?.join(&PREVIOUS_FORMAT_COMMIT[..12]);
    let binary = cache.join("lockd");
    if binary.exists() {
        return Ok(binary);
    }
    std::fs::create_dir_all(&cache).with_context(|| format!("creating {}", cache.display()))?;
    // One build at a time, also across test processes; a second caller finds the binary.
    let lock = File::create(cache.join("build.lock"))?;
    lock.lock()
        .with_context(|| format!("locking {}", cache.display()))?;
    if binary.exists() {
        return Ok(binary);
    }
    let started = Instant::now();
    eprintln!(
        "building lockd of commit {} into {} (once; later runs reuse it)",
        &PREVIOUS_FORMAT_COMMIT[..12],
        cache.display()
    );
    let src = cache.join("src");
    let target = cache.join("target");
    let _ = std::fs::remove_dir_all(&src);
    std::fs::create_dir_all(&src)?;
    export_commit(&src)?;
    seed_dependencies(&target);
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        // `--workspace`: features unify over every member as in this build, so the seeded
        // dependencies match (and the commit's own crates compile as they did there).
        .args(["build", "--locked", "--workspace", "--bin", "lockd"])
        .current_dir(&src)
        .env("CARGO_TARGET_DIR", &target)
        // What this test run's cargo set for itself must not steer the inner build.
        .env_remove("CARGO_MANIFEST_DIR")
        .env_remove("CARGO_PKG_NAME")
        .env_remove("RUSTC_WRAPPER")
        .stdin(Stdio::null())
        .status()
        .context("running cargo build for the previous commit")?;
    if !status.success() {
        bail!(
            "building lockd of commit {PREVIOUS_FORMAT_COMMIT} failed ({status}); its source is in {}",
            src.display()
        );
    }
    // Copy under a temporary name, then rename: a crash leaves no half-written binary.
    let partial = cache.join("lockd.partial");
    std::fs::copy(target.join("debug").join("lockd"), &partial)?;
    std::fs::rename(&partial, &binary)?;
    // The binary is all that is needed; the source and build tree are gigabytes.
    let _ = std::fs::remove_dir_all(&src);
    let _ = std::fs::remove_dir_all(&target);
    eprintln!(
        "built lockd of commit {} in {:.0} s",
        &PREVIOUS_FORMAT_COMMIT[..12],
        started.elapsed().as_secs_f64()
    );
    Ok(binary)
}

fn cache_root() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("LOCKD_PREVIOUS_CACHE") {
        return Ok(PathBuf::from(dir));
    }
    let home = std::env::var_os("HOME").context("neither LOCKD_PREVIOUS_CACHE nor HOME is set")?;
    Ok(PathBuf::from(home).join(".cache/lockd-ci/previous"))
}

/// `git archive COMMIT | tar -x -C dir`, from the repository this crate lives in. A shallow
/// clone lacks the commit: it is fetched from `origin` first.
fn export_commit(dir: &Path) -> anyhow::Result<()> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let has_commit = |repo: &Path| {
        Command::new("git")
            .arg("-C")
            .arg(repo)
            .args([
                "cat-file",
                "-e",
                &format!("{PREVIOUS_FORMAT_COMMIT}^{{commit}}"),
            ])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !has_commit(&repo) {
        let _ = Command::new("git")
            .arg("-C")
            .arg(&repo)
            .args(["fetch", "--quiet", "origin", PREVIOUS_FORMAT_COMMIT])
            .status();
    }
    let mut git = Command::new("git")
        .arg("-C")
        .arg(&repo)
        .args(["archive", "--format=tar", PREVIOUS_FORMAT_COMMIT])
        .stdout(Stdio::piped())
        .spawn()
        .context("running git archive (is git installed?)")?;
    let stdout = git.stdout.take().context("git archive's stdout")?;
    let tar = Command::new("tar")
        .arg("-x")
        .arg("-C")
        .arg(dir)
        .stdin(stdout)
        .status()
        .context("running tar")?;
    let git = git.wait()?;
    if !git.success() {
        bail!(
            "git archive {PREVIOUS_FORMAT_COMMIT} failed ({git}) in {}: the rolling upgrade test \
             needs the repository's history (a clone that contains that commit)",
            repo.display()
        );
    }
    if !tar.success() {
        bail!("unpacking commit {PREVIOUS_FORMAT_COMMIT} failed ({tar})");
    }
    Ok(())
}

/// Copies this build's compiled dependencies into the inner build's target dir, where cargo
/// reuses every artifact whose inputs match (`cp -a` keeps the times cargo compares). The test
/// and binary executables are left out: they are most of the size and none is reused. Best
/// effort: without the seed the build is only slower.
fn seed_dependencies(target: &Path) {
    let Some(ours) = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.to_path_buf()))
    else {
        return;
    };
    let debug = target.join("debug");
    if debug.exists() || std::fs::create_dir_all(debug.join("deps")).is_err() {
        return;
    }
    for part in ["build", ".fingerprint"] {
        copy_keeping_times(&[ours.join(part)], &debug);
    }
    let Ok(entries) = std::fs::read_dir(ours.join("deps")) else {
        return;
    };
    let libraries: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            name.starts_with("lib") || name.ends_with(".d")
        })
        .collect();
    for chunk in libraries.chunks(500) {
        copy_keeping_times(chunk, &debug.join("deps"));
    }
}

fn copy_keeping_times(from: &[PathBuf], into: &Path) {
    let _ = Command::new("cp")
        .arg("-a")
        .arg("-t")
        .arg(into)
        .args(from)
        .status();
}
