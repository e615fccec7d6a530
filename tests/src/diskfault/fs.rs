//! The FUSE filesystem: passes every call through to a backing directory and tells the
//! [`Model`] what became durable, and injects the faults of [`Faults`].
//!
//! One session thread serves the mount (fuser's loop); the harness reaches the same state
//! through [`super::DiskFaultMount`], under one mutex.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use fuser::{
    FileAttr, FileType, Filesystem, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow,
};
use libc::{EIO, ENOENT, ENOSPC};

use super::model::{Entry, FileState, Ino, Model, Unsynced};

/// Attributes and names are not cached by the kernel: every call reaches the layer, so what a
/// program sees is always what the layer decided.
const TTL: Duration = Duration::ZERO;

/// Faults to inject, set by the harness at any time.
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// The next this many fsyncs of a file whose name contains `fail_fsync_name` (any file if
    /// empty) fail with EIO and lose the writes they were asked to persist.
    pub fail_fsyncs: u32,
    pub fail_fsync_name: String,
    /// Every call that would allocate space (write, create, mkdir, growing truncate) fails with
    /// ENOSPC.
    pub disk_full: bool,
    /// Deliberately broken: fsync answers success and persists nothing (a lying disk). Only for
    /// showing that the checker catches lost acknowledged writes.
    pub no_fsync: bool,
}

/// What the layer saw and did, for reports.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Stats {
    pub writes: u64,
    pub bytes_written: u64,
    pub fsyncs: u64,
    pub dir_fsyncs: u64,
    pub fsyncs_failed: u64,
    pub writes_lost_to_failed_fsync: u64,
    pub enospc: u64,
    pub fsyncs_not_persisted: u64,
    /// Names of files whose fsync failed, in order.
    pub failed_fsync_files: Vec<String>,
}

/// Everything the filesystem knows, shared with the harness.
pub struct Inner {
    pub backing: PathBuf,
    /// Current relative path of every inode handed to the kernel (root: "").
    paths: HashMap<Ino, PathBuf>,
    inos: HashMap<PathBuf, Ino>,
    next_ino: Ino,
    handles: HashMap<u64, (Ino, File)>,
    next_fh: u64,
    pub model: Model,
    pub faults: Faults,
    pub stats: Stats,
}

impl Inner {
    /// State for a backing directory whose whole content is durable (a fresh disk, or the disk
    /// as a power loss left it).
    pub fn scan(backing: &Path) -> std::io::Result<Inner> {
        let mut inner = Inner {
            backing: backing.to_path_buf(),
            paths: HashMap::from([(fuser::FUSE_ROOT_ID, PathBuf::new())]),
            inos: HashMap::from([(PathBuf::new(), fuser::FUSE_ROOT_ID)]),
            next_ino: fuser::FUSE_ROOT_ID + 1,
            handles: HashMap::new(),
            next_fh: 1,
            model: Model::default(),
            faults: Faults::default(),
            stats: Stats::default(),
        };
        let mut stack = vec![PathBuf::new()];
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(backing.join(&dir))? {
                let e = e?;
                let rel = dir.join(e.file_name());
                if e.file_type()?.is_dir() {
                    inner.model.durable_names.insert(rel.clone(), Entry::Dir);
                    stack.push(rel);
                } else {
                    let ino = inner.ino_of(&rel);
                    let durable = std::fs::read(backing.join(&rel))?;
                    inner.model.files.insert(
                        ino,
                        FileState {
                            durable,
                            unsynced: Vec::new(),
                        },
                    );
                    inner.model.durable_names.insert(rel, Entry::File(ino));
                }
            }
        }
        Ok(inner)
    }

    fn ino_of(&mut self, rel: &Path) -> Ino {
        if let Some(ino) = self.inos.get(rel) {
            return *ino;
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        self.inos.insert(rel.to_path_buf(), ino);
        self.paths.insert(ino, rel.to_path_buf());
        ino
    }

    fn rel(&self, ino: Ino) -> Result<PathBuf, i32> {
        self.paths.get(&ino).cloned().ok_or(ENOENT)
    }

    fn child(&self, parent: Ino, name: &OsStr) -> Result<PathBuf, i32> {
        Ok(self.rel(parent)?.join(name))
    }

    fn attr(&mut self, rel: &Path) -> Result<FileAttr, i32> {
        let meta = std::fs::symlink_metadata(self.backing.join(rel)).map_err(errno)?;
        let ino = self.ino_of(rel);
        if meta.is_file() {
            self.model.files.entry(ino).or_default();
        }
        Ok(to_attr(ino, &meta))
    }

    /// The current children of directory `dir` and what each names, for a directory fsync.
    fn current_children(&mut self, dir: &Path) -> std::io::Result<Vec<(PathBuf, Entry)>> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(self.backing.join(dir))? {
            let e = e?;
            let rel = dir.join(e.file_name());
            if e.file_type()?.is_dir() {
                out.push((rel, Entry::Dir));
            } else {
                let ino = self.ino_of(&rel);
                self.model.files.entry(ino).or_default();
                out.push((rel, Entry::File(ino)));
            }
        }
        Ok(out)
    }

    fn name_matches(&self, ino: Ino) -> bool {
        self.faults.fail_fsync_name.is_empty()
            || self
                .paths
                .get(&ino)
                .is_some_and(|p| p.to_string_lossy().contains(&self.faults.fail_fsync_name))
    }

    fn fsync_file(&mut self, ino: Ino) -> Result<(), i32> {
        self.stats.fsyncs += 1;
        if self.faults.fail_fsyncs > 0 && self.name_matches(ino) {
            self.faults.fail_fsyncs -= 1;
            self.stats.fsyncs_failed += 1;
            let name = self
                .paths
                .get(&ino)
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| format!("inode {ino}"));
            self.stats.failed_fsync_files.push(name);
            let lost = self.model.files.entry(ino).or_default().lose_unsynced();
            self.stats.writes_lost_to_failed_fsync += lost as u64;
            return Err(EIO);
        }
        if self.faults.no_fsync {
            self.stats.fsyncs_not_persisted += 1;
            return Ok(());
        }
        self.model.files.entry(ino).or_default().sync();
        Ok(())
    }

    /// Moves the current-name maps after a rename of `from` to `to` (and everything under it).
    fn renamed(&mut self, from: &Path, to: &Path) {
        let moved: Vec<(PathBuf, Ino)> = self
            .inos
            .iter()
            .filter(|(p, _)| p.starts_with(from) || p.starts_with(to))
            .map(|(p, i)| (p.clone(), *i))
            .collect();
        for (p, ino) in &moved {
            self.inos.remove(p);
            self.paths.remove(ino);
        }
        for (p, ino) in moved {
            if let Ok(rest) = p.strip_prefix(from) {
                let new = if rest.as_os_str().is_empty() {
                    to.to_path_buf()
                } else {
                    to.join(rest)
                };
                self.inos.insert(new.clone(), ino);
                self.paths.insert(ino, new);
            }
        }
    }

    fn forget_name(&mut self, rel: &Path) {
        if let Some(ino) = self.inos.remove(rel) {
            self.paths.remove(&ino);
        }
    }
}

fn errno(e: std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(EIO)
}

fn to_attr(ino: Ino, meta: &std::fs::Metadata) -> FileAttr {
    let time = |s: i64, ns: i64| UNIX_EPOCH + Duration::new(s.max(0) as u64, ns as u32);
    FileAttr {
        ino,
        size: meta.len(),
        blocks: meta.blocks(),
        atime: time(meta.atime(), meta.atime_nsec()),
        mtime: time(meta.mtime(), meta.mtime_nsec()),
        ctime: time(meta.ctime(), meta.ctime_nsec()),
        crtime: time(meta.ctime(), meta.ctime_nsec()),
        kind: if meta.is_dir() {
            FileType::Directory
        } else if meta.file_type().is_symlink() {
            FileType::Symlink
        } else {
            FileType::RegularFile
        },
        perm: (meta.permissions().mode() & 0o7777) as u16,
        nlink: meta.nlink() as u32,
        uid: meta.uid(),
        gid: meta.gid(),
        rdev: meta.rdev() as u32,
        blksize: 4096,
        flags: 0,
    }
}

/// The filesystem fuser runs; a handle on the shared state.
pub struct FaultFs {
    pub inner: Arc<Mutex<Inner>>,
}

impl FaultFs {
    fn with<T>(&self, f: impl FnOnce(&mut Inner) -> Result<T, i32>) -> Result<T, i32> {
        let mut inner = self.inner.lock().expect("diskfault state");
        f(&mut inner)
    }
}

fn open_options(flags: i32) -> OpenOptions {
    let mut o = OpenOptions::new();
    match flags & libc::O_ACCMODE {
        libc::O_WRONLY => o.write(true),
        libc::O_RDWR => o.read(true).write(true),
        _ => o.read(true),
    };
    // Truncation arrives as a setattr, so the model sees it; appends are positioned writes.
    o.custom_flags(flags & !(libc::O_ACCMODE | libc::O_TRUNC | libc::O_APPEND | libc::O_CREAT));
    o
}

impl Filesystem for FaultFs {
    fn lookup(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEntry) {
        match self.with(|s| {
            let rel = s.child(parent, name)?;
            s.attr(&rel)
        }) {
            Ok(attr) => reply.entry(&TTL, &attr, 0),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&mut self, _req: &Request<'_>, ino: u64, _fh: Option<u64>, reply: ReplyAttr) {
        match self.with(|s| {
            let rel = s.rel(ino)?;
            s.attr(&rel)
        }) {
            Ok(attr) => reply.attr(&TTL, &attr),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<std::time::SystemTime>,
        _fh: Option<u64>,
        _crtime: Option<std::time::SystemTime>,
        _chgtime: Option<std::time::SystemTime>,
        _bkuptime: Option<std::time::SystemTime>,
        _flags: Option<u32>,
        reply: ReplyAttr,
    ) {
        match self.with(|s| {
            let rel = s.rel(ino)?;
            let path = s.backing.join(&rel);
            if let Some(mode) = mode {
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode & 0o7777))
                    .map_err(errno)?;
            }
            if let Some(size) = size {
                let current = std::fs::metadata(&path).map_err(errno)?.len();
                if size > current && s.faults.disk_full {
                    s.stats.enospc += 1;
                    return Err(ENOSPC);
                }
                OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .and_then(|f| f.set_len(size))
                    .map_err(errno)?;
                s.model
                    .files
                    .entry(ino)
                    .or_default()
                    .unsynced
                    .push(Unsynced::SetLen(size));
            }
            s.attr(&rel)
        }) {
            Ok(attr) => reply.attr(&TTL, &attr),
            Err(e) => reply.error(e),
        }
    }

    fn mkdir(
        &mut self,
        _req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        match self.with(|s| {
            if s.faults.disk_full {
                s.stats.enospc += 1;
                return Err(ENOSPC);
            }
            let rel = s.child(parent, name)?;
            std::fs::create_dir(s.backing.join(&rel)).map_err(errno)?;
            std::fs::set_permissions(
                s.backing.join(&rel),
                std::fs::Permissions::from_mode(mode & 0o7777),
            )
            .map_err(errno)?;
            s.attr(&rel)
        }) {
            Ok(attr) => reply.entry(&TTL, &attr, 0),
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEmpty) {
        match self.with(|s| {
            let rel = s.child(parent, name)?;
            std::fs::remove_file(s.backing.join(&rel)).map_err(errno)?;
            s.forget_name(&rel);
            Ok(())
        }) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rmdir(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEmpty) {
        match self.with(|s| {
            let rel = s.child(parent, name)?;
            std::fs::remove_dir(s.backing.join(&rel)).map_err(errno)?;
            s.forget_name(&rel);
            Ok(())
        }) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rename(
        &mut self,
        _req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        newparent: u64,
        newname: &OsStr,
        flags: u32,
        reply: ReplyEmpty,
    ) {
        match self.with(|s| {
            if flags != 0 {
                // RENAME_NOREPLACE / RENAME_EXCHANGE: not used by lockd; say so plainly.
                return Err(libc::EINVAL);
            }
            let from = s.child(parent, name)?;
            let to = s.child(newparent, newname)?;
            std::fs::rename(s.backing.join(&from), s.backing.join(&to)).map_err(errno)?;
            s.renamed(&from, &to);
            Ok(())
        }) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn open(&mut self, _req: &Request<'_>, ino: u64, flags: i32, reply: ReplyOpen) {
        match self.with(|s| {
            let rel = s.rel(ino)?;
            let file = open_options(flags)
                .open(s.backing.join(&rel))
                .map_err(errno)?;
            s.model.files.entry(ino).or_default();
            let fh = s.next_fh;
            s.next_fh += 1;
            s.handles.insert(fh, (ino, file));
            Ok(fh)
        }) {
            Ok(fh) => reply.opened(fh, 0),
            Err(e) => reply.error(e),
        }
    }

    fn create(
        &mut self,
        _req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        match self.with(|s| {
            if s.faults.disk_full {
                s.stats.enospc += 1;
                return Err(ENOSPC);
            }
            let rel = s.child(parent, name)?;
            let mut o = open_options(flags);
            o.create(true).mode(mode & 0o7777);
            if flags & libc::O_ACCMODE == libc::O_RDONLY {
                o.write(true);
            }
            let existed = s.backing.join(&rel).exists();
            let file = o.open(s.backing.join(&rel)).map_err(errno)?;
            if !existed {
                // A new, empty file (a name reused after an unlink is a new inode).
                s.forget_name(&rel);
                let ino = s.ino_of(&rel);
                s.model.files.insert(ino, FileState::default());
            }
            let ino = s.ino_of(&rel);
            let attr = s.attr(&rel)?;
            let fh = s.next_fh;
            s.next_fh += 1;
            s.handles.insert(fh, (ino, file));
            Ok((attr, fh))
        }) {
            Ok((attr, fh)) => reply.created(&TTL, &attr, 0, fh, 0),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &mut self,
        _req: &Request<'_>,
        _ino: u64,
        fh: u64,
        offset: i64,
        size: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyData,
    ) {
        match self.with(|s| {
            let (_, file) = s.handles.get(&fh).ok_or(libc::EBADF)?;
            let mut buf = vec![0u8; size as usize];
            let mut filled = 0;
            while filled < buf.len() {
                match file.read_at(&mut buf[filled..], offset as u64 + filled as u64) {
                    Ok(0) => break,
                    Ok(n) => filled += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(errno(e)),
                }
            }
            buf.truncate(filled);
            Ok(buf)
        }) {
            Ok(data) => reply.data(&data),
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &mut self,
        _req: &Request<'_>,
        _ino: u64,
        fh: u64,
        offset: i64,
        data: &[u8],
        _write_flags: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyWrite,
    ) {
        match self.with(|s| {
            if s.faults.disk_full {
                s.stats.enospc += 1;
                return Err(ENOSPC);
            }
            let (ino, file) = s.handles.get(&fh).ok_or(libc::EBADF)?;
            let ino = *ino;
            file.write_all_at(data, offset as u64).map_err(errno)?;
            s.stats.writes += 1;
            s.stats.bytes_written += data.len() as u64;
            s.model
                .files
                .entry(ino)
                .or_default()
                .unsynced
                .push(Unsynced::Write {
                    offset: offset as u64,
                    data: data.to_vec(),
                });
            Ok(data.len() as u32)
        }) {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(e),
        }
    }

    fn flush(&mut self, _req: &Request<'_>, _ino: u64, _fh: u64, _lo: u64, reply: ReplyEmpty) {
        reply.ok();
    }

    fn release(
        &mut self,
        _req: &Request<'_>,
        _ino: u64,
        fh: u64,
        _flags: i32,
        _lock_owner: Option<u64>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.inner
            .lock()
            .expect("diskfault state")
            .handles
            .remove(&fh);
        reply.ok();
    }

    fn fsync(&mut self, _req: &Request<'_>, ino: u64, _fh: u64, _data: bool, reply: ReplyEmpty) {
        match self.with(|s| s.fsync_file(ino)) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn readdir(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        mut reply: ReplyDirectory,
    ) {
        let entries = self.with(|s| {
            let rel = s.rel(ino)?;
            let mut out = vec![
                (ino, FileType::Directory, ".".into()),
                (ino, FileType::Directory, "..".into()),
            ];
            for e in std::fs::read_dir(s.backing.join(&rel)).map_err(errno)? {
                let e = e.map_err(errno)?;
                let child = rel.join(e.file_name());
                let kind = if e.file_type().map_err(errno)?.is_dir() {
                    FileType::Directory
                } else {
                    FileType::RegularFile
                };
                out.push((s.ino_of(&child), kind, e.file_name()));
            }
            Ok(out)
        });
        match entries {
            Ok(entries) => {
                for (i, (ino, kind, name)) in entries.into_iter().enumerate().skip(offset as usize)
                {
                    if reply.add(ino, (i + 1) as i64, kind, name) {
                        break;
                    }
                }
                reply.ok();
            }
            Err(e) => reply.error(e),
        }
    }

    fn fsyncdir(&mut self, _req: &Request<'_>, ino: u64, _fh: u64, _d: bool, reply: ReplyEmpty) {
        match self.with(|s| {
            s.stats.dir_fsyncs += 1;
            if s.faults.no_fsync {
                s.stats.fsyncs_not_persisted += 1;
                return Ok(());
            }
            let rel = s.rel(ino)?;
            let children = s.current_children(&rel).map_err(errno)?;
            s.model.sync_dir(&rel, children);
            Ok(())
        }) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn statfs(&mut self, _req: &Request<'_>, _ino: u64, reply: ReplyStatfs) {
        let full = self.inner.lock().expect("diskfault state").faults.disk_full;
        let free = if full { 0 } else { 1 << 20 };
        reply.statfs(1 << 21, free, free, 1 << 20, 1 << 19, 4096, 255, 4096);
    }
}
