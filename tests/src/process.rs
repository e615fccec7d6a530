//! Child processes owned by a test: killed by PID when dropped, so a failing test leaves nothing
//! running.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use nix::sys::signal::{self, Signal};
use nix::unistd::Pid;

/// Path of a binary of this workspace, built by the same `cargo test` run.
///
/// Integration test executables live in `target/<profile>/deps/`; the binaries one level up.
/// Cargo builds every binary target of a package that has integration tests, and each binary's
/// package has one, so `cargo test --workspace` provides them all.
pub fn bin_path(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    // A binary of this package (`lockd-tests --bin chaos`) sits next to the others.
    if let Some(beside) = exe.parent().map(|d| d.join(name)).filter(|p| p.exists()) {
        return beside;
    }
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("test executable lives in target/<profile>/deps");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "binary {} not found; build it with `cargo build --workspace --bins` or run `cargo test --workspace`",
        path.display()
    );
    path
}

/// A running child process that is killed (SIGKILL) and reaped when dropped.
pub struct ChildGuard {
    pub name: String,
    child: Option<Child>,
}

impl ChildGuard {
    /// Starts `cmd` with stdin closed; stdout and stderr are inherited so that `cargo test` shows
    /// them for failing tests only.
    pub fn spawn(name: impl Into<String>, mut cmd: Command) -> anyhow::Result<Self> {
        let name = name.into();
        let child = cmd
            .stdin(Stdio::null())
            .spawn()
            .map_err(|e| anyhow::anyhow!("starting {name}: {e}"))?;
        Ok(ChildGuard {
            name,
            child: Some(child),
        })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends a signal (SIGSTOP, SIGCONT, SIGTERM...) to the process.
    pub fn signal(&self, sig: Signal) {
        if let Some(pid) = self.pid() {
            let _ = signal::kill(Pid::from_raw(pid as i32), sig);
        }
    }

    /// kill -9 and reap. Idempotent.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = signal::kill(Pid::from_raw(child.id() as i32), Signal::SIGCONT);
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Whether the process has exited (reaping it if so), with its status.
    pub fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    pub fn is_running(&mut self) -> bool {
        self.child.is_some() && self.try_wait().is_none()
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A random loopback address 127.x.y.z (z != 0, 255), so that concurrent tests can use fixed port
/// numbers without colliding.
pub fn random_loopback_ip() -> std::net::Ipv4Addr {
    use rand::RngExt;
    let mut rng = rand::rng();
    std::net::Ipv4Addr::new(
        127,
        rng.random_range(1..=254),
        rng.random_range(0..=255),
        rng.random_range(1..=254),
    )
}

/// Builds a `Command` for a workspace binary.
pub fn command(name: &str) -> Command {
    Command::new(bin_path(name))
}
