//! `lockctl hold RESOURCE -- COMMAND`: run COMMAND while the lease is held, stop it as soon as the
//! lease is lost or uncertain.
//!
//! Timeline on loss: the lost signal fires at the local deadline (send time + ttl − margin) or on
//! `NOT_FOUND`; COMMAND gets SIGTERM at once and SIGKILL one safety margin later, that is no later
//! than the earliest moment the server may let the lease expire. COMMAND should still pass
//! `LOCKD_FENCING_TOKEN` with its writes: a process paused at the wrong moment (SIGSTOP, swap) can
//! outlive any local timer, and only a fencing check at the storage catches that.

use std::io;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::Duration;

use lockd_client::{AcquireOptions, Client, LeaseGuard};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::json;
use tokio::process::{Child, Command};
use tokio::signal::unix::{SignalKind, signal};
use tokio::time::timeout;

use crate::exit::{self, Failure};

/// Environment variable naming the resource for COMMAND.
pub const ENV_RESOURCE: &str = "LOCKD_RESOURCE";
/// Environment variable carrying the decimal fencing token for COMMAND.
pub const ENV_FENCING_TOKEN: &str = "LOCKD_FENCING_TOKEN";
/// Environment variable carrying the signed sequencer (base64) for COMMAND, for stores that
/// verify sequencers (fence-proxy's `Lock-Sequencer` header, `lockd.fence`).
pub const ENV_SEQUENCER: &str = "LOCKD_SEQUENCER";

/// Shortest grace between SIGTERM and SIGKILL, for tiny margins: a process needs a moment to run
/// its signal handler at all.
const KILL_GRACE_MIN: Duration = Duration::from_millis(100);

/// How long `hold` tries to release a lease it already considers lost before exiting: the lease has
/// most likely expired (nothing to release), and the cluster may be unreachable, which is often why
/// it was lost; an operator should not wait a full call timeout for a courtesy call.
const RELEASE_AFTER_LOSS_TIMEOUT: Duration = Duration::from_secs(1);

/// How COMMAND ended.
enum Ended {
    Exited(ExitStatus),
    /// The lease was lost; COMMAND was stopped with the named signal.
    Stopped {
        reason: String,
        signal: Signal,
    },
}

pub async fn hold(
    client: &Client,
    resource: &str,
    opts: AcquireOptions,
    command: &[String],
    json: bool,
) -> Result<u8, Failure> {
    let guard = client.lock(resource, opts).await?;
    let token = guard.fencing_token();
    let mut child = match spawn(command, resource, &guard) {
        Ok(child) => child,
        Err(e) => {
            let _ = guard.release().await;
            let code = match e.kind() {
                io::ErrorKind::NotFound => exit::COMMAND_NOT_FOUND,
                _ => exit::CANNOT_EXECUTE,
            };
            return Err(Failure::new(
                code,
                "command_failed",
                format!("cannot run {:?}: {e}", command[0]),
            ));
        }
    };
    let pid = child.id().map(|p| Pid::from_raw(p as i32));
    let ended = supervise(&mut child, pid, &guard).await.map_err(|e| {
        Failure::new(
            exit::INTERNAL,
            "io",
            format!("waiting for {:?}: {e}", command[0]),
        )
    })?;

    // COMMAND has exited: only now give the lock up.
    let released = match &ended {
        Ended::Exited(_) => guard.release().await,
        Ended::Stopped { .. } => {
            let _ = timeout(RELEASE_AFTER_LOSS_TIMEOUT, guard.release()).await;
            Ok(false)
        }
    };
    match ended {
        Ended::Exited(status) => {
            let code = exit_code(status);
            if let Err(e) = &released {
                eprintln!(
                    "lockctl: {:?} exited with {code}, but releasing {resource:?} failed: {e}",
                    command[0]
                );
            }
            if json {
                println!(
                    "{}",
                    json!({
                        "resource": resource, "fencing_token": token.0,
                        "exit_code": code, "lease_lost": false,
                        "released": released.as_ref().ok().copied(),
                    })
                );
            }
            Ok(code)
        }
        Ended::Stopped { reason, signal } => Err(Failure::new(
            exit::LEASE_LOST,
            "lease_lost",
            format!(
                "lease on {resource:?} (fencing token {token}) lost: {reason}; stopped {:?} (pid {}) with {signal}",
                command[0],
                pid.map(|p| p.to_string()).unwrap_or_else(|| "?".into())
            ),
        )),
    }
}

fn spawn(command: &[String], resource: &str, guard: &LeaseGuard) -> io::Result<Child> {
    let mut cmd = Command::new(&command[0]);
    cmd.args(&command[1..])
        .env(ENV_RESOURCE, resource)
        .env(ENV_FENCING_TOKEN, guard.fencing_token().to_string())
        .env(
            ENV_SEQUENCER,
            lockd_fence::sequencer::encode_text(guard.sequencer()),
        )
        .kill_on_drop(true);
    // If lockctl itself dies (SIGKILL, OOM), nobody renews the lease any more: the kernel kills
    // COMMAND too instead of leaving it to run without a lock.
    #[cfg(target_os = "linux")]
    // SAFETY: pre_exec runs the closure in the child between fork and exec, where only
    // async-signal-safe work is sound: it calls prctl (async-signal-safe) and turns an errno
    // into an io::Error without allocating.
    #[allow(
        unsafe_code,
        reason = "pre_exec is unsafe: the closure runs after fork"
    )]
    unsafe {
        cmd.pre_exec(|| nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(io::Error::from));
    }
    cmd.spawn()
}

/// Waits for COMMAND to exit, forwarding SIGTERM/SIGINT/SIGHUP sent to lockctl, and stops it when
/// the lease is lost.
async fn supervise(child: &mut Child, pid: Option<Pid>, guard: &LeaseGuard) -> io::Result<Ended> {
    let lost = guard.lost();
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sighup = signal(SignalKind::hangup())?;
    loop {
        let forward = tokio::select! {
            biased;
            _ = lost.fired() => break,
            status = child.wait() => return Ok(Ended::Exited(status?)),
            _ = sigterm.recv() => Signal::SIGTERM,
            _ = sigint.recv() => Signal::SIGINT,
            _ = sighup.recv() => Signal::SIGHUP,
        };
        if let Some(pid) = pid {
            let _ = kill(pid, forward);
        }
    }
    let reason = lost
        .reason()
        .map(|r| r.to_string())
        .unwrap_or_else(|| "lease lost".into());
    let grace = guard.safety_margin().max(KILL_GRACE_MIN);
    if let Some(pid) = pid {
        let _ = kill(pid, Signal::SIGTERM);
    }
    if timeout(grace, child.wait()).await.is_ok() {
        return Ok(Ended::Stopped {
            reason,
            signal: Signal::SIGTERM,
        });
    }
    child.kill().await?;
    Ok(Ended::Stopped {
        reason,
        signal: Signal::SIGKILL,
    })
}

/// COMMAND's exit code, or 128 + signal number when a signal ended it (shell convention).
fn exit_code(status: ExitStatus) -> u8 {
    if let Some(code) = status.code() {
        return u8::try_from(code).unwrap_or(exit::INTERNAL);
    }
    status
        .signal()
        .map(|s| 128u8.saturating_add(s as u8))
        .unwrap_or(exit::INTERNAL)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_follow_the_shell_convention() {
        // Raw wait statuses: exit code in the second byte, terminating signal in the low bits.
        assert_eq!(exit_code(ExitStatus::from_raw(0)), 0);
        assert_eq!(exit_code(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code(ExitStatus::from_raw(Signal::SIGKILL as i32)), 137);
        assert_eq!(exit_code(ExitStatus::from_raw(Signal::SIGTERM as i32)), 143);
    }
}
