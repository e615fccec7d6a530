//! Disk faults under a lockd node's data dir: a FUSE layer that remembers what is durable.
//!
//! [`DiskFaultMount`] mounts a pass-through filesystem over a node's data dir (the data lives in a
//! backing directory next to it) and keeps, per file, every write not yet fsynced. The harness,
//! which owns the FUSE session in-process, can then simulate a power loss (drop every unsynced
//! write, optionally tear the last one of each file), fail fsyncs with EIO, or report a full disk
//! (ENOSPC). What counts as durable is described in [`model`].
//!
//! [`mod@run`] drives a three-node cluster through one of the [`Scenario`]s under a lock workload
//! and checks that every acknowledged grant survives.
//!
//! # Layout
//! - [`model`]: durable content and names, and what a power loss leaves.
//! - [`fs`]: the fuser filesystem over the backing directory, and the fault switches.
//! - [`mod@run`]: scenarios, workload and checks.

pub mod fs;
pub mod model;
pub mod run;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

pub use fs::{Faults, Stats};
pub use run::{Options, Report, Scenario, run};

use fs::{FaultFs, Inner};
use model::Restored;

/// How long an unmount may take before the harness gives up on it (a process still holding a
/// file open keeps the session alive).
const UNMOUNT_WAIT: Duration = Duration::from_secs(10);

/// A mounted fault-injecting filesystem. Dropping it unmounts.
pub struct DiskFaultMount {
    mountpoint: PathBuf,
    backing: PathBuf,
    inner: Arc<Mutex<Inner>>,
    session: Option<fuser::BackgroundSession>,
}

/// What a simulated power loss did.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct PowerLoss {
    /// Writes and truncations dropped because no fsync had made them durable.
    pub unsynced_dropped: usize,
    /// Files whose last unsynced write was torn, with the bytes of it kept.
    pub torn: Vec<(String, usize)>,
    /// Files in the tree the power loss left.
    pub files_after: usize,
}

impl DiskFaultMount {
    /// Mounts the layer at `mountpoint` over `backing` (both created if missing). Whatever
    /// `backing` holds counts as durable.
    pub fn mount(mountpoint: &Path, backing: &Path) -> anyhow::Result<DiskFaultMount> {
        std::fs::create_dir_all(mountpoint)
            .with_context(|| format!("creating {}", mountpoint.display()))?;
        std::fs::create_dir_all(backing)
            .with_context(|| format!("creating {}", backing.display()))?;
        let inner = Inner::scan(backing)
            .with_context(|| format!("reading the backing directory {}", backing.display()))?;
        let mut m = DiskFaultMount {
            mountpoint: mountpoint.to_path_buf(),
            backing: backing.to_path_buf(),
            inner: Arc::new(Mutex::new(inner)),
            session: None,
        };
        m.spawn()?;
        Ok(m)
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        let fs = FaultFs {
            inner: self.inner.clone(),
        };
        let options = [
            fuser::MountOption::FSName("lockd-diskfault".into()),
            fuser::MountOption::RW,
        ];
        let session = fuser::spawn_mount2(fs, &self.mountpoint, &options)
            .with_context(|| format!("mounting the FUSE layer at {}", self.mountpoint.display()))?;
        self.session = Some(session);
        Ok(())
    }

    fn unmount(&mut self) -> anyhow::Result<()> {
        let Some(session) = self.session.take() else {
            return Ok(());
        };
        let path = std::ffi::CString::new(self.mountpoint.as_os_str().as_encoded_bytes())?;
        // Lazy: the name goes at once, the session ends when the last open file is closed.
        // SAFETY: `path` is a NUL-terminated string that outlives the call; umount2 has no
        // other preconditions.
        #[allow(
            unsafe_code,
            reason = "FFI: umount2 with MNT_DETACH has no safe wrapper in libc"
        )]
        unsafe {
            libc::umount2(path.as_ptr(), libc::MNT_DETACH);
        }
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            session.join();
            let _ = tx.send(());
        });
        rx.recv_timeout(UNMOUNT_WAIT).map_err(|_| {
            anyhow::anyhow!(
                "the FUSE session at {} did not end within {UNMOUNT_WAIT:?}: a process still holds a file open",
                self.mountpoint.display()
            )
        })
    }

    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Changes the fault switches.
    pub fn set_faults(&self, f: impl FnOnce(&mut Faults)) {
        f(&mut self.inner.lock().expect("diskfault state").faults);
    }

    pub fn stats(&self) -> Stats {
        self.inner.lock().expect("diskfault state").stats.clone()
    }

    /// Writes and truncations not yet durable, over all files.
    pub fn unsynced(&self) -> usize {
        let inner = self.inner.lock().expect("diskfault state");
        inner.model.files.values().map(|f| f.unsynced.len()).sum()
    }

    /// A simulated power loss. The programs using the mount must be dead already (kill -9):
    /// the layer unmounts, rebuilds the backing directory from what was durable (tearing the
    /// last unsynced write of a file with probability `tear`, keeping a random prefix of it),
    /// and mounts again with every fault switched off, as after a reboot.
    pub fn power_loss(&mut self, rng: &mut StdRng, tear: f64) -> anyhow::Result<PowerLoss> {
        self.unmount()?;
        let mut report = PowerLoss::default();
        let tree = {
            let inner = self.inner.lock().expect("diskfault state");
            let mut torn = HashMap::new();
            let mut names: HashMap<u64, String> = HashMap::new();
            for (path, entry) in &inner.model.durable_names {
                if let model::Entry::File(ino) = entry {
                    names.insert(*ino, path.display().to_string());
                }
            }
            let mut inos: Vec<_> = inner.model.files.keys().copied().collect();
            inos.sort_unstable();
            for ino in inos {
                let f = &inner.model.files[&ino];
                report.unsynced_dropped += f.unsynced.len();
                if let Some(model::Unsynced::Write { data, .. }) = f.unsynced.last()
                    && data.len() > 1
                    && rng.random_bool(tear)
                {
                    let keep = rng.random_range(1..data.len());
                    torn.insert(ino, keep);
                    let name = names
                        .get(&ino)
                        .cloned()
                        .unwrap_or_else(|| format!("inode {ino} (no durable name)"));
                    report.torn.push((name, keep));
                }
            }
            inner.model.durable_tree(&torn)
        };
        let fresh = self.backing.with_extension("powerloss");
        if fresh.exists() {
            std::fs::remove_dir_all(&fresh)?;
        }
        std::fs::create_dir_all(&fresh)?;
        let mode = std::fs::metadata(&self.backing)?.permissions();
        std::fs::set_permissions(&fresh, mode)?;
        for item in tree {
            match item {
                Restored::Dir(p) => std::fs::create_dir(fresh.join(p))?,
                Restored::File(p, content) => {
                    std::fs::write(fresh.join(p), content)?;
                    report.files_after += 1;
                }
            }
        }
        std::fs::remove_dir_all(&self.backing)
            .with_context(|| format!("removing {}", self.backing.display()))?;
        std::fs::rename(&fresh, &self.backing)?;
        *self.inner.lock().expect("diskfault state") = Inner::scan(&self.backing)?;
        self.spawn()?;
        Ok(report)
    }
}

impl Drop for DiskFaultMount {
    fn drop(&mut self) {
        if let Err(e) = self.unmount() {
            eprintln!("diskfault: {e}");
        }
    }
}

/// Whether a FUSE filesystem can be mounted here (the device exists and this process may
/// mount): `Err` says why not.
pub fn probe() -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(|e| format!("a temporary folder: {e}"))?;
    let mut m = DiskFaultMount::mount(&dir.path().join("mnt"), &dir.path().join("backing"))
        .map_err(|e| format!("{e:#}"))?;
    let file = m.mountpoint().join("probe");
    std::fs::write(&file, b"synced")
        .and_then(|()| std::fs::File::open(&file)?.sync_all())
        .map_err(|e| format!("writing through the FUSE layer: {e}"))?;
    let mut rng = StdRng::seed_from_u64(0);
    m.power_loss(&mut rng, 0.0).map_err(|e| format!("{e:#}"))?;
    drop(m);
    Ok(())
}
