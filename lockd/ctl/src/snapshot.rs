//! `lockctl snapshot save FILE`: a backup of the cluster's state, streamed from the leader.
//!
//! The file is written whole or not at all: into a temporary file beside FILE (mode 0600: a
//! backup holds every lease id and the sequencer signing keys), checked, synced, then renamed
//! over FILE and the directory synced. It is kept only if its size and SHA-256 match both the
//! digest at its end and the summary the leader sends last.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use lockd_api::v1::SnapshotSummary;
use lockd_client::Client;
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::cli::SnapshotCommand;
use crate::exit::{self, Failure};

/// The first bytes of every backup file (`lockd restore` checks them again with the rest).
const BACKUP_MAGIC: &[u8] = b"LKDBACK1";
/// The file ends with the SHA-256 of everything before it.
const DIGEST_LEN: usize = 32;

pub async fn run(
    client: &Client,
    command: SnapshotCommand,
    idle_timeout: Duration,
    json: bool,
) -> Result<u8, Failure> {
    match command {
        SnapshotCommand::Save { file } => {
            let started = std::time::Instant::now();
            let tmp = temp_path(&file)?;
            let result = save(client, &file, &tmp, idle_timeout).await;
            if result.is_err() {
                let _ = std::fs::remove_file(&tmp);
            }
            let summary = result?;
            let took_ms = started.elapsed().as_millis() as u64;
            if json {
                println!(
                    "{}",
                    json!({
                        "file": file.display().to_string(),
                        "size_bytes": summary.size_bytes,
                        "sha256": summary.sha256,
                        "last_applied_index": summary.last_applied_index,
                        "last_applied_term": summary.last_applied_term,
                        "last_fencing_token": summary.last_fencing_token,
                        "active_locks": summary.active_locks,
                        "waiters": summary.waiters,
                        "dedup_records": summary.dedup_records,
                        "node_id": summary.node_id,
                        "took_ms": took_ms,
                    })
                );
            } else {
                println!("file                {}", file.display());
                println!("size_bytes          {}", summary.size_bytes);
                println!("sha256              {}", summary.sha256);
                println!(
                    "last_applied_index  {} (term {})",
                    summary.last_applied_index, summary.last_applied_term
                );
                println!("last_fencing_token  {}", summary.last_fencing_token);
                println!(
                    "contents            {} active locks, {} waiters, {} request ids",
                    summary.active_locks, summary.waiters, summary.dedup_records
                );
                println!("made_by_node        {}", summary.node_id);
                println!("took_ms             {took_ms}");
            }
            Ok(exit::OK)
        }
    }
}

/// `.<name>.tmp.<pid>` in FILE's directory, so the final rename stays on one filesystem.
fn temp_path(file: &Path) -> Result<PathBuf, Failure> {
    let name = file.file_name().ok_or_else(|| {
        Failure::new(
            exit::USAGE,
            "bad_path",
            format!("{} does not name a file", file.display()),
        )
    })?;
    let mut tmp = std::ffi::OsString::from(".");
    tmp.push(name);
    tmp.push(format!(".tmp.{}", std::process::id()));
    Ok(file.with_file_name(tmp))
}

async fn save(
    client: &Client,
    file: &Path,
    tmp: &Path,
    idle_timeout: Duration,
) -> Result<SnapshotSummary, Failure> {
    let mut stream = client.save_snapshot().await?;
    let mut out = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(tmp)
            .map_err(|e| io_failure(tmp, e))?
    };
    let mut check = Check::default();
    let summary = loop {
        let message = match tokio::time::timeout(idle_timeout, stream.message()).await {
            Err(_) => {
                return Err(broken(format!(
                    "no data from lockd for {} after {} bytes",
                    humantime::format_duration(idle_timeout),
                    check.size
                )));
            }
            Ok(Err(status)) => {
                return Err(broken(format!(
                    "the stream failed after {} bytes: {}: {}",
                    check.size,
                    status.code(),
                    status.message()
                )));
            }
            Ok(Ok(None)) => {
                return Err(broken(format!(
                    "the stream ended after {} bytes without its summary",
                    check.size
                )));
            }
            Ok(Ok(Some(m))) => m,
        };
        if !message.data.is_empty() {
            check.add(&message.data);
            out.write_all(&message.data)
                .map_err(|e| io_failure(tmp, e))?;
        }
        if let Some(summary) = message.summary {
            break summary;
        }
    };
    check.verify(&summary)?;
    out.sync_all().map_err(|e| io_failure(tmp, e))?;
    drop(out);
    std::fs::rename(tmp, file).map_err(|e| io_failure(file, e))?;
    let dir = match file.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_failure(dir, e))?;
    Ok(summary)
}

/// Hashes the file as it arrives, all but its last [`DIGEST_LEN`] bytes, which it keeps.
#[derive(Default)]
struct Check {
    hash: Sha256,
    /// The last bytes seen, at most `DIGEST_LEN` of them: not hashed (yet).
    tail: Vec<u8>,
    size: u64,
    head: Vec<u8>,
}

impl Check {
    fn add(&mut self, data: &[u8]) {
        self.size += data.len() as u64;
        if self.head.len() < BACKUP_MAGIC.len() {
            let want = (BACKUP_MAGIC.len() - self.head.len()).min(data.len());
            self.head.extend_from_slice(&data[..want]);
        }
        self.tail.extend_from_slice(data);
        if self.tail.len() > DIGEST_LEN {
            let hashed = self.tail.len() - DIGEST_LEN;
            self.hash.update(&self.tail[..hashed]);
            self.tail.drain(..hashed);
        }
    }

    fn verify(self, summary: &SnapshotSummary) -> Result<(), Failure> {
        if self.head != BACKUP_MAGIC {
            return Err(broken(format!(
                "the data does not start like a lockd backup ({:?})",
                String::from_utf8_lossy(&self.head)
            )));
        }
        if self.size != summary.size_bytes || self.tail.len() != DIGEST_LEN {
            return Err(broken(format!(
                "received {} bytes, the leader says the backup has {}",
                self.size, summary.size_bytes
            )));
        }
        let actual: String = self
            .hash
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let recorded: String = self.tail.iter().map(|b| format!("{b:02x}")).collect();
        if actual != recorded || actual != summary.sha256 {
            return Err(broken(format!(
                "checksum mismatch: the data hashes to SHA-256 {actual}, the file records \
                 {recorded} and the leader sent {}",
                summary.sha256
            )));
        }
        Ok(())
    }
}

fn broken(why: String) -> Failure {
    Failure::new(
        exit::INTERNAL,
        "backup_incomplete",
        format!("snapshot save: {why}; no file written"),
    )
}

fn io_failure(path: &Path, e: std::io::Error) -> Failure {
    Failure::new(exit::INTERNAL, "io", format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file made like a backup: magic, some bytes, then SHA-256 of all before it.
    fn file(len: usize) -> Vec<u8> {
        let mut bytes = BACKUP_MAGIC.to_vec();
        bytes.extend((0..len).map(|i| (i % 251) as u8));
        let digest = Sha256::digest(&bytes);
        bytes.extend_from_slice(&digest);
        bytes
    }

    fn summary_of(bytes: &[u8]) -> SnapshotSummary {
        SnapshotSummary {
            size_bytes: bytes.len() as u64,
            sha256: bytes[bytes.len() - 32..]
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect(),
            ..Default::default()
        }
    }

    /// Goal: the check accepts a file however it is cut into messages, and refuses one changed
    /// byte, a missing byte, or a summary that disagrees.
    #[test]
    fn the_check_accepts_any_cut_and_refuses_any_change() {
        let bytes = file(5_000);
        for step in [1, 7, 31, 32, 33, 1_000, 10_000] {
            let mut check = Check::default();
            for chunk in bytes.chunks(step) {
                check.add(chunk);
            }
            check.verify(&summary_of(&bytes)).unwrap();
        }
        let mut bad = bytes.clone();
        bad[100] ^= 1;
        let mut check = Check::default();
        check.add(&bad);
        let e = check.verify(&summary_of(&bytes)).unwrap_err().message;
        assert!(e.contains("checksum mismatch"), "{e}");

        let mut check = Check::default();
        check.add(&bytes[..bytes.len() - 1]);
        let e = check.verify(&summary_of(&bytes)).unwrap_err().message;
        assert!(e.contains("received"), "{e}");
    }

    #[test]
    fn the_temporary_file_sits_beside_the_target() {
        let tmp = temp_path(Path::new("/backups/b.lockd")).unwrap();
        assert_eq!(tmp.parent(), Some(Path::new("/backups")));
        assert!(
            tmp.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(".b.lockd.tmp.")
        );
        assert!(temp_path(Path::new("/")).is_err());
    }
}
