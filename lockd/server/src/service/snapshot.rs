//! `lockd.v1.Cluster.SaveSnapshot` on the leader: a backup file of the state machine, streamed.
//!
//! The backup is taken at a linearizable point: the leader first confirms its leadership with a
//! quorum and waits until it has applied everything committed before the call, then copies the
//! table under the state lock. The copy shares structure (persistent collections; 0.15-0.3 ms
//! for a full request_id window), so apply waits for nothing more; encoding runs on a
//! low-priority thread and leaves in 1 MiB messages, at the pace the caller reads them (a
//! bounded channel), so a slow caller costs memory for a few messages only (and keeps the
//! table's copy alive: up to one more request_id window while apply moves on). The summary, with the file's SHA-256, comes last.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use lockd_api::v1::{SaveSnapshotResponse, SnapshotSummary};
use tokio::sync::mpsc;
use tonic::Status;

use super::errors;
use crate::backup::file::{BackupHeader, BackupWriter, hex};
use crate::node::NodeCtx;

/// Bytes of backup per message: well under the 4 MiB a gRPC client accepts by default.
const CHUNK_BYTES: usize = 1024 * 1024;
/// Messages encoded ahead of the caller.
const CHUNKS_AHEAD: usize = 4;
/// Deadline of the linearizable read that fixes the backup's point.
const READ_TIMEOUT: Duration = Duration::from_secs(3);
/// Budget of a backup forwarded to the leader: tens of megabytes over the network.
pub const FORWARD_TIMEOUT: Duration = Duration::from_secs(600);

pub type SnapshotStream = Pin<Box<dyn Stream<Item = Result<SaveSnapshotResponse, Status>> + Send>>;

/// Who may take a backup besides the policy's `admin` (checked by the caller first). A backup
/// holds every lease id and the private signing keys (with them anyone can forge a sequencer that
/// `fence-proxy --verify-key` accepts), so open mode (no `--auth-policy`) hands it to no one:
/// only to a call forwarded by a member authenticated by its node certificate (the member it came
/// to checked its caller), or to anyone at all with `--allow-backup-without-policy`. There is no
/// exemption for loopback callers: behind a sidecar proxy, a TLS terminator, an SSH tunnel or
/// `kubectl port-forward`, every remote client arrives from loopback. PERMISSION_DENIED names the
/// caller's address and the two ways out.
pub fn may_save(
    has_policy: bool,
    allow_without_policy: bool,
    forwarded_by_member: bool,
    remote: Option<std::net::SocketAddr>,
) -> Result<(), Status> {
    if has_policy || allow_without_policy || forwarded_by_member {
        return Ok(());
    }
    Err(errors::open_mode_refused(
        "snapshot save",
        "a backup holds the private signing keys and every lease id",
        "the backup is",
        "--allow-backup-without-policy",
        "download the keys",
        remote,
    ))
}

/// On the leader: fixes the backup's point, then streams the file.
pub async fn save_local(ctx: &Arc<NodeCtx>) -> Result<SnapshotStream, Status> {
    match tokio::time::timeout(READ_TIMEOUT, ctx.reads.confirm()).await {
        Ok(Ok(_)) => {}
        Ok(Err(e @ crate::read_barrier::ReadRefused::Overloaded)) => {
            return Err(errors::overloaded(format!(
                "node {}: {e}; nothing was done, retry later",
                ctx.id
            )));
        }
        Ok(Err(e)) => {
            return Err(errors::no_quorum(format!(
                "node {} cannot take a consistent backup: {e}",
                ctx.id
            )));
        }
        Err(_) => {
            return Err(errors::no_quorum(format!(
                "node {} could not confirm leadership with a quorum within {} ms; no backup taken",
                ctx.id,
                READ_TIMEOUT.as_millis()
            )));
        }
    }
    let (copy, header) = {
        let sm = ctx.sm.read().expect("state lock");
        let stats = sm.table.stats();
        let header = BackupHeader {
            created_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as i64)
                .unwrap_or(0),
            node_id: ctx.id,
            lockd_version: env!("CARGO_PKG_VERSION").to_owned(),
            last_log_id: sm.last_applied,
            membership: sm.membership.clone(),
            last_token: stats.last_token,
            active_locks: stats.active_locks,
            waiters: stats.waiters,
            dedup_records: stats.dedup_records,
        };
        (sm.table.snapshot_copy(), header)
    };
    let (tx, rx) = mpsc::channel(CHUNKS_AHEAD);
    let node_id = ctx.id;
    tokio::spawn(async move {
        let errors_to = tx.clone();
        let made = crate::storage::background(move || {
            let started = std::time::Instant::now();
            let sink = ChunkSink {
                tx,
                buf: Vec::with_capacity(CHUNK_BYTES),
            };
            let mut w = BackupWriter::start(sink, &header)?;
            copy.encode_to(&mut w)?;
            let (sink, digest, size) = w.finish()?;
            let summary = SnapshotSummary {
                size_bytes: size,
                sha256: hex(&digest),
                last_applied_index: header.last_log_id.map(|l| l.index).unwrap_or(0),
                last_applied_term: header.last_log_id.map(|l| l.leader_id.term).unwrap_or(0),
                last_fencing_token: header.last_token,
                active_locks: header.active_locks,
                waiters: header.waiters,
                dedup_records: header.dedup_records,
                node_id,
            };
            tracing::info!(
                bytes = size,
                last_applied_index = summary.last_applied_index,
                last_fencing_token = summary.last_fencing_token,
                encode_ms = started.elapsed().as_millis() as u64,
                "backup streamed"
            );
            sink.send(SaveSnapshotResponse {
                data: Vec::new(),
                summary: Some(summary),
            })?;
            Ok(())
        })
        .await;
        if let Err(e) = made {
            // A caller that went away needs no answer; anyone else learns why the stream ended.
            tracing::warn!(error = %e, "lockd: backup stream ended early");
            let _ = errors_to
                .send(Err(errors::internal(format!(
                    "node {node_id}: the backup stream failed: {e}"
                ))))
                .await;
        }
    });
    Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
}

/// Cuts what the encoder writes into messages and hands them to the stream, blocking while the
/// caller is [`CHUNKS_AHEAD`] messages behind.
struct ChunkSink {
    tx: mpsc::Sender<Result<SaveSnapshotResponse, Status>>,
    buf: Vec<u8>,
}

impl ChunkSink {
    fn send(&self, chunk: SaveSnapshotResponse) -> std::io::Result<()> {
        self.tx
            .blocking_send(Ok(chunk))
            .map_err(|_| std::io::Error::other("the caller went away"))
    }

    fn send_buf(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let data = std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK_BYTES));
        self.send(SaveSnapshotResponse {
            data,
            summary: None,
        })
    }
}

impl std::io::Write for ChunkSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = buf.len().min(CHUNK_BYTES - self.buf.len());
        self.buf.extend_from_slice(&buf[..n]);
        if self.buf.len() == CHUNK_BYTES {
            self.send_buf()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.send_buf()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: open mode hands a backup to no caller by its address, loopback included (behind
    /// a sidecar or a port-forward every remote client is on loopback): only to calls a
    /// TLS-authenticated member forwarded, and to anyone with --allow-backup-without-policy. A
    /// refusal is PERMISSION_DENIED naming the caller's address and the two ways out. A policy
    /// decides by itself (its `admin` check runs before this one).
    #[test]
    fn open_mode_backups_only_forwarded_by_a_member_or_with_the_flag() {
        let remote: std::net::SocketAddr = "192.0.2.7:5000".parse().unwrap();
        for caller in [
            "127.3.4.5:5000",
            "[::1]:9",
            "[::ffff:127.0.0.1]:9",
            "192.0.2.7:5000",
        ] {
            let addr: std::net::SocketAddr = caller.parse().unwrap();
            let e = may_save(false, false, false, Some(addr)).unwrap_err();
            assert_eq!(e.code(), tonic::Code::PermissionDenied);
            assert!(
                e.message().contains(&addr.to_string())
                    && e.message().contains("--allow-backup-without-policy")
                    && e.message().contains("--auth-policy"),
                "{e:?}"
            );
        }
        assert!(may_save(false, false, false, None).is_err());
        assert!(may_save(false, true, false, Some(remote)).is_ok());
        assert!(may_save(false, false, true, Some(remote)).is_ok());
        assert!(may_save(true, false, false, Some(remote)).is_ok());
    }
}
