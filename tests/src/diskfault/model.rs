//! What the disk under a data dir holds durably, apart from what the running programs see.
//!
//! The backing directory always holds the *current* content (what a read returns, as the page
//! cache would). This model keeps, per file, the content made durable by the last successful
//! fsync and the writes since then (the *unsynced* record), and per directory the names made
//! durable by its last fsync. A power loss rebuilds the backing directory from the durable side
//! only (see [`Model::durable_tree`]).
//!
//! Rules (strict POSIX, the weakest common guarantee):
//! - A file's data and size become durable by an fsync or fdatasync of that file.
//! - A name (create, rename, unlink, mkdir, rmdir) becomes durable only by an fsync of its
//!   directory; until then the durable directory still has the old name (pointing at the old
//!   file content, which an unlinked or replaced file keeps).
//! - A failed fsync (EIO) loses the writes it was asked to persist: they stay readable, but no
//!   later fsync makes them durable (Linux marks the pages clean after a writeback error). Later
//!   writes are persisted by later fsyncs as usual.
//! - A power loss drops every unsynced write; optionally it keeps a prefix of the last unsynced
//!   write of each file (a torn write).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// An inode number of the FUSE layer (1 is the root).
pub type Ino = u64;

/// One change to a file's content not yet made durable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unsynced {
    Write { offset: u64, data: Vec<u8> },
    SetLen(u64),
}

/// A regular file's durability state.
#[derive(Clone, Debug, Default)]
pub struct FileState {
    /// The content as of the last successful fsync.
    pub durable: Vec<u8>,
    /// Changes since then, in order.
    pub unsynced: Vec<Unsynced>,
}

fn apply(content: &mut Vec<u8>, change: &Unsynced) {
    match change {
        Unsynced::Write { offset, data } => {
            let start = *offset as usize;
            let end = start + data.len();
            if content.len() < end {
                content.resize(end, 0);
            }
            content[start..end].copy_from_slice(data);
        }
        Unsynced::SetLen(len) => content.resize(*len as usize, 0),
    }
}

impl FileState {
    /// Makes every unsynced change durable (a successful fsync).
    pub fn sync(&mut self) {
        for change in std::mem::take(&mut self.unsynced) {
            apply(&mut self.durable, &change);
        }
    }

    /// Forgets the unsynced changes without making them durable (a failed fsync).
    pub fn lose_unsynced(&mut self) -> usize {
        std::mem::take(&mut self.unsynced).len()
    }

    /// The content a power loss leaves: the durable content, plus the first `torn` bytes of the
    /// last unsynced change if that is a write.
    pub fn after_power_loss(&self, torn: Option<usize>) -> Vec<u8> {
        let mut content = self.durable.clone();
        if let (Some(keep), Some(Unsynced::Write { offset, data })) = (torn, self.unsynced.last()) {
            let keep = keep.min(data.len());
            apply(
                &mut content,
                &Unsynced::Write {
                    offset: *offset,
                    data: data[..keep].to_vec(),
                },
            );
        }
        content
    }
}

/// What a durable directory entry names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    File(Ino),
    Dir,
}

/// Every file's durability state and the durable namespace, by path relative to the root.
#[derive(Debug, Default)]
pub struct Model {
    pub files: HashMap<Ino, FileState>,
    /// Durable names: relative path to what it names. The root is implicit.
    pub durable_names: BTreeMap<PathBuf, Entry>,
}

/// One file or directory of the tree a power loss leaves.
#[derive(Debug, PartialEq, Eq)]
pub enum Restored {
    Dir(PathBuf),
    File(PathBuf, Vec<u8>),
}

impl Model {
    /// Makes the current children of `dir` its durable children (an fsync of the directory).
    /// `current` lists them with what each names now.
    pub fn sync_dir(&mut self, dir: &Path, current: Vec<(PathBuf, Entry)>) {
        let children: Vec<PathBuf> = self
            .durable_names
            .keys()
            .filter(|p| p.parent() == Some(dir))
            .cloned()
            .collect();
        for child in children {
            self.durable_names.remove(&child);
        }
        for (path, entry) in current {
            self.durable_names.insert(path, entry);
        }
    }

    /// The tree a power loss leaves, parents before children. A name whose directory is not
    /// durable is gone with it. `torn` gives, per file, how many bytes of its last unsynced
    /// write survive (absent: none).
    pub fn durable_tree(&self, torn: &HashMap<Ino, usize>) -> Vec<Restored> {
        let mut out = Vec::new();
        let mut dirs: Vec<&Path> = vec![Path::new("")];
        for (path, entry) in &self.durable_names {
            let parent = path.parent().unwrap_or(Path::new(""));
            if !dirs.contains(&parent) {
                continue;
            }
            match entry {
                Entry::Dir => {
                    dirs.push(path);
                    out.push(Restored::Dir(path.clone()));
                }
                Entry::File(ino) => {
                    let content = self
                        .files
                        .get(ino)
                        .map(|f| f.after_power_loss(torn.get(ino).copied()))
                        .unwrap_or_default();
                    out.push(Restored::File(path.clone(), content));
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(offset: u64, data: &[u8]) -> Unsynced {
        Unsynced::Write {
            offset,
            data: data.to_vec(),
        }
    }

    #[test]
    fn only_synced_writes_survive_and_a_torn_write_keeps_a_prefix() {
        let mut f = FileState::default();
        f.unsynced.push(write(0, b"hello"));
        f.sync();
        f.unsynced.push(write(5, b" world"));
        f.unsynced.push(write(0, b"J"));
        assert_eq!(f.after_power_loss(None), b"hello");
        f.sync();
        assert_eq!(f.after_power_loss(None), b"Jello world");
        f.unsynced.push(Unsynced::SetLen(3));
        f.unsynced.push(write(3, b"p!!!"));
        assert_eq!(f.after_power_loss(None), b"Jello world");
        // The torn write lands on the durable content: only its prefix, nothing before it.
        assert_eq!(f.after_power_loss(Some(2)), b"Jelp! world");
    }

    #[test]
    fn a_failed_fsync_loses_its_writes_for_good() {
        let mut f = FileState::default();
        f.unsynced.push(write(0, b"aaaa"));
        assert_eq!(f.lose_unsynced(), 1);
        f.unsynced.push(write(2, b"bb"));
        f.sync();
        assert_eq!(f.after_power_loss(None), b"\0\0bb");
    }

    #[test]
    fn names_are_durable_only_after_their_directory_is_synced() {
        let mut m = Model::default();
        m.files.insert(2, FileState::default());
        m.files.get_mut(&2).unwrap().unsynced.push(write(0, b"x"));
        m.files.get_mut(&2).unwrap().sync();
        assert_eq!(m.durable_tree(&HashMap::new()), vec![]);
        m.sync_dir(Path::new(""), vec![("a".into(), Entry::File(2))]);
        assert_eq!(
            m.durable_tree(&HashMap::new()),
            vec![Restored::File("a".into(), b"x".to_vec())]
        );
        // Renamed over by file 3, not yet synced: the old name and content stay.
        m.files.insert(3, FileState::default());
        assert_eq!(
            m.durable_tree(&HashMap::new()),
            vec![Restored::File("a".into(), b"x".to_vec())]
        );
        m.sync_dir(Path::new(""), vec![("a".into(), Entry::File(3))]);
        assert_eq!(
            m.durable_tree(&HashMap::new()),
            vec![Restored::File("a".into(), Vec::new())]
        );
        // A file in a directory that was never made durable is lost with it.
        m.sync_dir(Path::new("d"), vec![("d/b".into(), Entry::File(2))]);
        assert_eq!(m.durable_tree(&HashMap::new()).len(), 1);
    }
}
