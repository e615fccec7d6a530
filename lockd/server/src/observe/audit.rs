//! The audit log: one JSON line per state change of the lock table, in log order, with the log
//! index, so an operator can prove after an incident who held what and when.
//!
//! Every replica writes its own audit log from the entries it applies, so each change appears
//! exactly once per file whichever node led. On restart openraft replays entries after the last
//! snapshot; lines up to the last index already in the file are skipped, so replay writes nothing
//! twice. A node that catches up by installing a snapshot never sees the entries it covers: it
//! writes one `snapshot_installed` line naming the gap instead of pretending. Payloads (lease ids)
//! are never written, and neither are request ids: a retry with a request id returns its lease
//! id, so an id is a bearer credential. A line carries `request_digest`, a
//! keyed digest of the id (see [`AuditKey`]), enough to correlate the attempts of one request.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};

use lockd_core::{Event, EventKind};
use serde::Serialize;

/// Lines buffered between apply and the writer thread. When the disk is slower than apply, apply
/// waits rather than dropping audit lines.
const AUDIT_QUEUE_MAX: usize = 65_536;
/// Rotated files kept beside the current one (`audit.log.1` ... `.N`).
pub const AUDIT_ROTATED_KEPT: usize = 5;
/// Bytes read from the end of an existing file to find its last log index.
const TAIL_READ_BYTES: u64 = 64 * 1024;

/// Where audit lines go.
#[derive(Clone, Debug)]
pub enum AuditTarget {
    Stdout,
    File { path: PathBuf, max_bytes: u64 },
}

#[derive(Serialize)]
struct Line<'a> {
    time: String,
    unix_ms: i64,
    log_index: u64,
    node: u64,
    op: &'static str,
    outcome: &'static str,
    resource: &'a str,
    fencing_token: u64,
    holder: &'a str,
    request_digest: String,
    /// The caller whose Acquire made the lease or waiter (with `--auth-policy` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    identity: Option<&'a str>,
}

enum Msg {
    Line(String),
    #[cfg_attr(
        not(test),
        allow(dead_code, reason = "sent only by `flush`, which the unit tests use")
    )]
    Flush(std::sync::mpsc::Sender<()>),
}

/// Key of the request digests in audit lines: HMAC-SHA256 keyed, so a reader of the log can
/// neither recover an id nor test guesses of a weak caller-chosen one without the key.
///
/// With `--audit-key-file` every replica uses the operator's key: a request has the same digest
/// in all audit logs, and whoever holds the key can compute the digest of an id they know. Without
/// it each node creates a random key once, in `audit.key` in its data dir (so digests stay stable
/// across restarts); lines of different replicas then still line up by `log_index`.
#[derive(Clone)]
pub struct AuditKey(Vec<u8>);

/// Shortest key accepted from `--audit-key-file`: 128 bits.
pub const AUDIT_KEY_MIN_BYTES: usize = 16;
/// Length of the key a node creates for itself.
const AUDIT_KEY_CREATED_BYTES: usize = 32;
/// Digest bytes written (hex-encoded): 128 bits keep chance collisions out of reach.
const AUDIT_DIGEST_BYTES: usize = 16;

impl AuditKey {
    /// The key from `file` (hex, at least [`AUDIT_KEY_MIN_BYTES`] bytes) or, without one, the
    /// node's own key in `data_dir/audit.key`, created on first use.
    pub fn load(file: Option<&Path>, data_dir: &Path) -> anyhow::Result<Self> {
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|e| {
                anyhow::anyhow!("lockd: reading --audit-key-file {}: {e}", path.display())
            })?;
            return Self::from_hex(text.trim())
                .map_err(|e| anyhow::anyhow!("lockd: --audit-key-file {}: {e}", path.display()));
        }
        let path = data_dir.join("audit.key");
        match std::fs::read_to_string(&path) {
            Ok(text) => Self::from_hex(text.trim())
                .map_err(|e| anyhow::anyhow!("lockd: {}: {e}", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let key: [u8; AUDIT_KEY_CREATED_BYTES] = rand::random();
                write_private(&path, &to_hex(&key))?;
                Ok(AuditKey(key.to_vec()))
            }
            Err(e) => Err(anyhow::anyhow!("lockd: reading {}: {e}", path.display())),
        }
    }

    pub fn from_hex(text: &str) -> Result<Self, String> {
        let bytes = from_hex(text)?;
        if bytes.len() < AUDIT_KEY_MIN_BYTES {
            return Err(format!(
                "the key has {} bytes, at least {AUDIT_KEY_MIN_BYTES} are needed",
                bytes.len()
            ));
        }
        Ok(AuditKey(bytes))
    }

    /// Hex of the first `AUDIT_DIGEST_BYTES` bytes of HMAC-SHA256(key, request_id).
    pub fn digest(&self, request_id: &str) -> String {
        use hmac::{KeyInit, Mac};
        let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(&self.0)
            .expect("HMAC takes keys of any length");
        mac.update(request_id.as_bytes());
        to_hex(&mac.finalize().into_bytes()[..AUDIT_DIGEST_BYTES])
    }
}

/// Never prints the key.
impl std::fmt::Debug for AuditKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AuditKey({} bytes)", self.0.len())
    }
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn from_hex(text: &str) -> Result<Vec<u8>, String> {
    if !text.len().is_multiple_of(2) || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!(
            "the key must be hex digits in pairs, got {} characters",
            text.len()
        ));
    }
    Ok((0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("checked hex"))
        .collect())
}

/// Writes a file readable by its owner only, durably, replacing it atomically.
fn write_private(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("key.tmp");
    let mut f = OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| anyhow::anyhow!("lockd: creating {}: {e}", tmp.display()))?;
    f.write_all(text.as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, path).map_err(|e| {
        anyhow::anyhow!(
            "lockd: renaming {} to {}: {e}",
            tmp.display(),
            path.display()
        )
    })?;
    if let Some(dir) = path.parent() {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// Handle to the writer thread.
pub struct AuditLog {
    tx: SyncSender<Msg>,
    node: u64,
    key: AuditKey,
    /// Highest log index already written (from the file at start, then from apply).
    written_up_to: std::sync::atomic::AtomicU64,
    /// Whether request ids carry the caller's identity (`--auth-policy`; see
    /// `crate::auth::Auth::scope_request_id`). Off in open mode, where a client's own id could
    /// be made to look scoped.
    identities: bool,
}

impl AuditLog {
    pub fn open(target: AuditTarget, node: u64, key: AuditKey) -> anyhow::Result<Self> {
        let (tx, rx) = sync_channel(AUDIT_QUEUE_MAX);
        let last = match &target {
            AuditTarget::Stdout => 0,
            AuditTarget::File { path, .. } => last_index_in(path)?,
        };
        let writer: Box<dyn Write + Send> = match &target {
            AuditTarget::Stdout => Box::new(std::io::stdout()),
            AuditTarget::File { path, .. } => Box::new(open_append(path)?),
        };
        std::thread::Builder::new()
            .name(format!("audit-{node}"))
            .spawn(move || write_loop(rx, writer, target))?;
        Ok(AuditLog {
            tx,
            node,
            key,
            written_up_to: std::sync::atomic::AtomicU64::new(last),
            identities: false,
        })
    }

    /// Names the identity on every line, taken from the scoped request id.
    pub fn naming_identities(mut self, on: bool) -> Self {
        self.identities = on;
        self
    }

    /// Records the events of one applied entry, unless the file already has that entry.
    pub fn record(&self, log_index: u64, unix_ms: i64, events: &[Event]) {
        use std::sync::atomic::Ordering;
        if log_index <= self.written_up_to.load(Ordering::Relaxed) {
            return;
        }
        self.written_up_to.store(log_index, Ordering::Relaxed);
        let time = format_rfc3339_ms(unix_ms);
        for e in events {
            let (op, outcome) = match e.kind {
                EventKind::Granted {
                    to_waiter: None, ..
                } => ("acquire", "granted"),
                EventKind::Granted {
                    to_waiter: Some(_), ..
                } => ("handoff", "granted"),
                EventKind::Renewed => ("renew", "renewed"),
                EventKind::Released => ("release", "released"),
                EventKind::Expired => ("expire", "expired"),
                EventKind::Queued => ("acquire", "queued"),
                EventKind::Cancelled { .. } => ("wait", "cancelled"),
                EventKind::TimedOut { .. } => ("wait", "timed_out"),
            };
            let (identity, request_id) = if self.identities {
                crate::auth::split_request_id(&e.request_id)
            } else {
                (None, e.request_id.as_str())
            };
            let line = Line {
                time: time.clone(),
                unix_ms,
                log_index,
                node: self.node,
                op,
                outcome,
                resource: e.resource.as_str(),
                fencing_token: e.fencing_token.0,
                holder: &e.holder,
                request_digest: self.key.digest(request_id),
                identity,
            };
            let text = serde_json::to_string(&line).expect("audit line serialises");
            let _ = self.tx.send(Msg::Line(text));
        }
    }

    /// Notes that a snapshot replaced the table: the changes up to `to_index` are not in this file.
    pub fn snapshot_installed(&self, to_index: u64, unix_ms: i64) {
        use std::sync::atomic::Ordering;
        let from = self.written_up_to.swap(
            to_index.max(self.written_up_to.load(Ordering::Relaxed)),
            Ordering::Relaxed,
        );
        if to_index <= from {
            return;
        }
        let text = serde_json::json!({
            "time": format_rfc3339_ms(unix_ms),
            "unix_ms": unix_ms,
            "log_index": to_index,
            "node": self.node,
            "op": "snapshot_installed",
            "outcome": "gap",
            "gap_from_log_index": from + 1,
        })
        .to_string();
        let _ = self.tx.send(Msg::Line(text));
    }

    /// Waits until every line recorded so far is written and flushed.
    #[cfg(test)]
    pub fn flush(&self) {
        let (tx, rx) = std::sync::mpsc::channel();
        if self.tx.send(Msg::Flush(tx)).is_ok() {
            let _ = rx.recv();
        }
    }
}

fn open_append(path: &Path) -> anyhow::Result<File> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| anyhow::anyhow!("opening audit log {}: {e}", path.display()))
}

/// The `log_index` of the last complete line of an existing audit file (0 if none).
fn last_index_in(path: &Path) -> anyhow::Result<u64> {
    let Ok(mut f) = File::open(path) else {
        return Ok(0);
    };
    let len = f.metadata()?.len();
    f.seek(SeekFrom::Start(len.saturating_sub(TAIL_READ_BYTES)))?;
    let mut last = 0;
    for line in BufReader::new(f).lines() {
        let Ok(line) = line else { continue };
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line)
            && let Some(i) = v.get("log_index").and_then(|i| i.as_u64())
        {
            last = last.max(i);
        }
    }
    Ok(last)
}

fn write_loop(rx: Receiver<Msg>, writer: Box<dyn Write + Send>, target: AuditTarget) {
    let mut out = BufWriter::new(writer);
    let mut size = match &target {
        AuditTarget::File { path, .. } => std::fs::metadata(path).map(|m| m.len()).unwrap_or(0),
        AuditTarget::Stdout => 0,
    };
    loop {
        // Block for one message, then drain what queued, then flush once.
        let Ok(first) = rx.recv() else { return };
        let mut pending = vec![first];
        while let Ok(m) = rx.try_recv() {
            pending.push(m);
        }
        let mut acks = Vec::new();
        for m in pending {
            match m {
                Msg::Line(text) => {
                    if let AuditTarget::File { path, max_bytes } = &target
                        && size > 0
                        && size + text.len() as u64 + 1 > *max_bytes
                    {
                        let _ = out.flush();
                        match rotate(path) {
                            Ok(f) => {
                                out = BufWriter::new(Box::new(f));
                                size = 0;
                            }
                            Err(e) => {
                                tracing::error!(error = %e, "audit log rotation failed; appending to the current file")
                            }
                        }
                    }
                    if let Err(e) = writeln!(out, "{text}") {
                        tracing::error!(error = %e, "audit log write failed");
                    }
                    size += text.len() as u64 + 1;
                }
                Msg::Flush(ack) => acks.push(ack),
            }
        }
        let _ = out.flush();
        for ack in acks {
            let _ = ack.send(());
        }
    }
}

/// Moves `audit.log` to `audit.log.1` (shifting older ones, dropping the oldest) and opens a new
/// current file.
fn rotate(path: &Path) -> anyhow::Result<File> {
    let name = |n: usize| PathBuf::from(format!("{}.{n}", path.display()));
    let _ = std::fs::remove_file(name(AUDIT_ROTATED_KEPT));
    for n in (1..AUDIT_ROTATED_KEPT).rev() {
        let _ = std::fs::rename(name(n), name(n + 1));
    }
    std::fs::rename(path, name(1))?;
    open_append(path)
}

/// Unix ms as `YYYY-MM-DDTHH:MM:SS.mmmZ` (UTC), without a date-time dependency.
pub fn format_rfc3339_ms(unix_ms: i64) -> String {
    let secs = unix_ms.div_euclid(1000);
    let ms = unix_ms.rem_euclid(1000);
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{ms:03}Z",
        tod / 3600,
        tod % 3600 / 60,
        tod % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_utc_times() {
        assert_eq!(format_rfc3339_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            format_rfc3339_ms(1_796_000_000_123),
            "2026-11-30T00:53:20.123Z"
        );
        assert_eq!(
            format_rfc3339_ms(951_782_400_000),
            "2000-02-29T00:00:00.000Z"
        );
    }

    /// Goal: an audit line never carries the request id in clear, only its
    /// keyed digest. Method: record a grant, read the file, look for the id.
    #[test]
    fn issue14_finding3_audit_lines_carry_a_keyed_digest_not_the_request_id() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        let key = AuditKey::from_hex(&"ab".repeat(16)).unwrap();
        let log = AuditLog::open(
            AuditTarget::File {
                path: path.clone(),
                max_bytes: 1 << 20,
            },
            1,
            key.clone(),
        )
        .unwrap();
        let id = "secret-request-id-0123456789";
        log.record(
            1,
            1_000,
            &[Event {
                kind: EventKind::Queued,
                resource: lockd_core::validate::resource("r").unwrap(),
                fencing_token: lockd_core::FencingToken(1),
                holder: "h".into(),
                request_id: id.into(),
            }],
        );
        log.flush();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains(id), "request id in clear: {text}");
        let line: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
        assert_eq!(line["request_digest"], key.digest(id), "{text}");
        assert_eq!(key.digest(id).len(), 2 * AUDIT_DIGEST_BYTES);
        // Another key gives another digest: a reader without the key cannot test guesses.
        let other = AuditKey::from_hex(&"cd".repeat(16)).unwrap();
        assert_ne!(other.digest(id), key.digest(id));
    }

    #[test]
    fn audit_keys_are_checked_and_a_node_key_is_kept() {
        assert!(AuditKey::from_hex("abcd").unwrap_err().contains("2 bytes"));
        assert!(AuditKey::from_hex("zz").is_err());
        let dir = tempfile::tempdir().unwrap();
        let a = AuditKey::load(None, dir.path()).unwrap();
        let b = AuditKey::load(None, dir.path()).unwrap();
        assert_eq!(a.digest("x"), b.digest("x"), "the created key is reused");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("audit.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "readable by others: {mode:o}");
    }

    #[test]
    fn rotates_by_size_and_resumes_after_the_last_index() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        let ev = |i: u64| Event {
            kind: EventKind::Renewed,
            resource: lockd_core::validate::resource("r").unwrap(),
            fencing_token: lockd_core::FencingToken(i),
            holder: "h".into(),
            request_id: "q".into(),
        };
        let log = AuditLog::open(
            AuditTarget::File {
                path: path.clone(),
                max_bytes: 600,
            },
            1,
            AuditKey::load(None, dir.path()).unwrap(),
        )
        .unwrap();
        for i in 1..=10 {
            log.record(i, 1_000, &[ev(i)]);
        }
        log.flush();
        assert!(dir.path().join("audit.log.1").exists(), "rotated");
        drop(log);
        // Reopened (a restart): replayed entries up to the last index are skipped.
        let log = AuditLog::open(
            AuditTarget::File {
                path: path.clone(),
                max_bytes: 600,
            },
            1,
            AuditKey::load(None, dir.path()).unwrap(),
        )
        .unwrap();
        log.record(10, 1_000, &[ev(10)]);
        log.record(11, 1_000, &[ev(11)]);
        log.flush();
        let all: String = [dir.path().join("audit.log.1"), path.clone()]
            .iter()
            .map(|p| std::fs::read_to_string(p).unwrap())
            .collect();
        let indexes: Vec<u64> = all
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["log_index"]
                    .as_u64()
                    .unwrap()
            })
            .collect();
        let mut sorted = indexes.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(
            sorted.len(),
            indexes.len(),
            "a line was written twice: {indexes:?}"
        );
        assert!(indexes.contains(&11));
    }
}
