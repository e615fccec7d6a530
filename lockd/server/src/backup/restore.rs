//! `lockd restore FILE --data-dir DIR --token-floor N`: seeds one member's data dir from a backup.
//!
//! **Every member is restored, from the same file with the same floor and membership.** Each
//! data dir then holds the same state: `snapshot.bin` with the restored table at the backup's
//! last log id (byte for byte the same on every member: it depends on nothing but the file, the
//! floor and the membership), and in `lockd.redb` the records of a node that took a snapshot
//! there and purged its whole log (that log id committed and purged, a vote in its term for its
//! leader). So the restored cluster is an ordinary cluster whose nodes all kept their log: none
//! is "empty", every vote gate is open, and the first election happens in the next term between
//! equal logs. A member started later with an empty data dir is a wiped node to the vote gate
//! (`raft/vote_gate.rs`) and catches up from the restored ones.
//!
//! Restoring one node and starting the others empty does not work (and did not in an earlier
//! design): a wiped node needs `n - majority + 1` answers from peers that kept their log, and one
//! restored node is one answer.
//!
//! # The restore id
//!
//! A restore derives a *restore id*: SHA-256 over the backup's digest, the floor and the
//! membership (`restore_id`). It is kept in the data dir for good (`raft_meta.restore_id`) and
//! carried on the peer protocol: on every Raft message (`lockd-restore-id` header) and in
//! `CurrentVote` replies. A node refuses Raft messages, and does not count `CurrentVote` answers,
//! of a peer whose restore id differs from its own or is absent (`raft::restore_id`). So members
//! restored from different files or with different floors, and members of the old cluster that
//! are still alive (or whose data dir comes back), never mix with the restored cluster: they
//! would disagree on the token counter or on the log. A wiped member (empty data dir) learns the
//! restore id from the peers that vouch for its proof.
//!
//! What the restore changes in the backed-up table is decided in `lockd-core`
//! (`LockTable::prepare_restore`): the token counter rises to the floor; leases, waiters and
//! request-id records are kept; the active signing key is retired (kept, so its sequencers still
//! verify), and the restored cluster's first leader installs a key of its own
//! (`crate::signing::ensure_key`), so that a restored copy never signs for the backed-up cluster.
//!
//! The backup file is not authenticated: its digest detects damage, not tampering. Whoever can
//! write it chooses the restored cluster's state, the keys it lists included, so a file must be
//! kept and fetched as carefully as the signing key it contains. The checks on read
//! (`Backup::verify`, `LockTable::check_consistency`) refuse values no lockd writes, such as a
//! token of a lease or request-id record above the counter, not a well-formed forgery.
//!
//! Nothing is half-applied: the data dir must be empty or missing; while the files are written a
//! marker file (`restore.incomplete`) sits in it, and lockd refuses to start on a data dir that
//! has one.

use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::Context;
use lockd_core::RestoreReport;
use openraft::{BasicNode, Membership, SnapshotMeta, StoredMembership, Vote};

use super::file::{Backup, BackupHeader, hex};
use crate::config::Peer;
use crate::raft::{LogId, NodeId};
use crate::storage::snapshot_file::StoredSnapshot;
use crate::storage::{KEY_COMMITTED, KEY_LAST_PURGED, KEY_RESTORE_ID, KEY_VOTE, META};

/// Present in a data dir while `lockd restore` writes it; lockd will not start on such a dir.
pub const RESTORE_MARKER: &str = "restore.incomplete";

/// Why `--token-floor` has no default: said whenever it is missing.
pub const TOKEN_FLOOR_REQUIRED: &str = "--token-floor is required: a backup does not know the \
tokens issued after it was taken, and their holders may still use them (fence stores, \
`lockctl hold`'s LOCKD_FENCING_TOKEN, conditional updates keyed on a token). Give the backup's \
last fencing token plus a margin for the grants made after the backup (grant rate x the \
backup's age), and no less than the highest token any fence store has accepted plus that \
margin (`fence-proxy epochs max --store SPEC` prints it for a fence-proxy epoch store, \
`fence-proxy epochs max --upstream URL` for the fence table of the Postgres front end); the \
restored cluster's tokens start above the floor";

/// The highest floor accepted: 2^62. Tokens are 63-bit numbers in several places (a Postgres
/// `bigint` in fence tables), and a floor near the top would leave no room to grant.
pub const TOKEN_FLOOR_MAX: u64 = 1 << 62;

/// What to restore, and where.
#[derive(Clone, Debug)]
pub struct RestoreOptions {
    /// The backup file (`lockctl snapshot save FILE`).
    pub file: PathBuf,
    /// The data dir to seed: missing or empty.
    pub data_dir: PathBuf,
    /// The operator's floor decision; `None` is refused with [`TOKEN_FLOOR_REQUIRED`].
    pub token_floor: Option<u64>,
    /// The members of the restored cluster (`--peer`); empty = the backup's membership.
    pub peers: Vec<Peer>,
}

/// What a restore did, for the operator.
#[derive(Clone, Debug)]
pub struct Restored {
    /// The backup's header.
    pub header: BackupHeader,
    /// What `LockTable::prepare_restore` did: counters and the token floor.
    pub report: RestoreReport,
    /// The backup's SHA-256.
    pub digest: [u8; 32],
    /// The backup's size in bytes.
    pub size: u64,
    /// The log entry the restored node starts after.
    pub last_log_id: LogId,
    /// The members of the restored cluster.
    pub members: Vec<(NodeId, String)>,
    /// The restore id (hex) kept in the data dir; the same on every member restored alike.
    pub restore_id: String,
    /// Said to the operator, not refused: a floor equal to the backup's last token.
    pub warning: Option<String>,
}

/// The restore id: SHA-256 over a domain tag, the backup's digest, the floor and the
/// membership (postcard of openraft's stored membership: ids, addresses, voter sets), in hex.
/// Restores of the same file with the same floor and members give the same id; any difference
/// gives another one.
pub fn restore_id(
    backup_digest: &[u8; 32],
    token_floor: u64,
    membership: &StoredMembership<NodeId, BasicNode>,
) -> anyhow::Result<String> {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(b"lockd-restore-id-v1\0");
    h.update(backup_digest);
    h.update(token_floor.to_le_bytes());
    h.update(postcard::to_allocvec(membership)?);
    Ok(hex(&h.finalize()))
}

/// Verifies the backup, checks the data dir, and seeds it.
pub fn restore(opts: &RestoreOptions) -> anyhow::Result<Restored> {
    let floor = opts
        .token_floor
        .ok_or_else(|| anyhow::anyhow!(TOKEN_FLOOR_REQUIRED))?;
    // Checked before the file is read: the value is wrong whatever the backup holds.
    if floor > TOKEN_FLOOR_MAX {
        anyhow::bail!(
            "--token-floor {floor} is above the highest floor accepted, 2^62 = {TOKEN_FLOOR_MAX}: \
             tokens are 63-bit numbers (a Postgres bigint in fence tables), so a floor near the \
             top would leave no room for grants; check the value (`fence-proxy epochs max` prints \
             the highest token a store accepted)"
        );
    }
    let name = opts.file.display().to_string();
    let bytes = std::fs::read(&opts.file).with_context(|| format!("reading backup {name}"))?;
    let Backup {
        header,
        mut table,
        digest,
        size,
    } = Backup::verify(&name, &bytes)?;
    drop(bytes);
    let warning = check_floor(floor, &header, now_unix_ms())?;
    let last_log_id = header.last_log_id.ok_or_else(|| {
        anyhow::anyhow!("{name}: the backup covers no log entry, so there is nothing to restore")
    })?;
    check_empty(&opts.data_dir)?;
    let membership = if opts.peers.is_empty() {
        header.membership.clone()
    } else {
        let nodes: std::collections::BTreeMap<NodeId, BasicNode> = opts
            .peers
            .iter()
            .map(|p| (p.id, BasicNode::new(&p.addr)))
            .collect();
        let voters = nodes.keys().copied().collect();
        StoredMembership::new(
            *header.membership.log_id(),
            Membership::new(vec![voters], nodes),
        )
    };
    let members: Vec<(NodeId, String)> = membership
        .membership()
        .nodes()
        .map(|(id, n)| (*id, n.addr.clone()))
        .collect();
    if membership.membership().voter_ids().next().is_none() {
        anyhow::bail!("{name}: the backup's membership has no voter; give the members with --peer");
    }
    let restore_id = restore_id(&digest, floor, &membership)?;
    let report = table.prepare_restore(floor);
    table
        .check_consistency()
        .map_err(|e| anyhow::anyhow!("the restored table is inconsistent: {e}"))?;
    let meta = SnapshotMeta {
        last_log_id: Some(last_log_id),
        last_membership: membership,
        snapshot_id: format!(
            "restore-{}-{}-{}",
            last_log_id.leader_id.term,
            last_log_id.index,
            &restore_id[..16]
        ),
    };
    seed(
        &opts.data_dir,
        meta,
        table.encode_snapshot(),
        last_log_id,
        &restore_id,
    )?;
    Ok(Restored {
        header,
        report,
        digest,
        size,
        last_log_id,
        members,
        restore_id,
        warning,
    })
}

/// Wall clock now, for the backup's age in messages (informative only).
fn now_unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// The floor against the backup's last token M. Below M is refused: the counter would start at
/// M, leaving no margin for the grants made after the backup, and such a floor was not worked
/// out from this backup (the old guidance "0 without a fence store" reissued tokens that clients
/// still hold through `lockctl hold` or conditional updates). Exactly M is accepted with a warning (safe only if
/// nothing was granted after the backup). Above M is what the runbook asks for.
fn check_floor(floor: u64, header: &BackupHeader, now_ms: i64) -> anyhow::Result<Option<String>> {
    let last = header.last_token;
    let age_s = (now_ms.saturating_sub(header.created_unix_ms) / 1000).max(0);
    if floor < last {
        anyhow::bail!(
            "--token-floor {floor} is below the backup's last fencing token {last}: it leaves no \
             room for the grants made after the backup, whose tokens (above {last}) their \
             holders may still use, and the restored cluster would issue them again. Give {last} \
             plus a margin of the grant rate (grants per second) x the backup's age ({age_s} s \
             by the clock of the node that made it), and no less than the highest token of \
             every fence store (`fence-proxy epochs max`) plus that margin; tokens are 63-bit \
             numbers, so a generous margin costs nothing"
        );
    }
    Ok((floor == last).then(|| {
        format!(
            "--token-floor {floor} equals the backup's last fencing token: this is safe only if \
             the cluster granted nothing after the backup was taken ({age_s} s ago by the clock of \
             the node that made it); any later grant's token will be issued again. If unsure, \
             restore every member again with a floor of {last} plus a margin"
        )
    }))
}

/// Refuses a data dir that holds anything: a restore seeds a new node, never mixes with one.
fn check_empty(dir: &Path) -> anyhow::Result<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => anyhow::bail!("reading data dir {}: {e}", dir.display()),
    };
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.with_context(|| format!("reading data dir {}", dir.display()))?;
        names.push(entry.file_name().to_string_lossy().into_owned());
    }
    if names.is_empty() {
        return Ok(());
    }
    names.sort();
    if names.iter().any(|n| n == RESTORE_MARKER) {
        anyhow::bail!(
            "data dir {} holds an interrupted restore ({RESTORE_MARKER}): delete its contents and \
             run lockd restore again",
            dir.display()
        );
    }
    let shown: Vec<&str> = names.iter().take(5).map(String::as_str).collect();
    anyhow::bail!(
        "refusing to restore into data dir {}: it is not empty (it holds {}{}); a restore seeds a \
         new node and must not mix with existing state: give an empty or new directory",
        dir.display(),
        shown.join(", "),
        if names.len() > shown.len() {
            format!(" and {} more", names.len() - shown.len())
        } else {
            String::new()
        }
    )
}

/// Writes the snapshot and the log records, between the creation and the removal of the marker.
fn seed(
    dir: &Path,
    meta: SnapshotMeta<NodeId, BasicNode>,
    table: Vec<u8>,
    last: LogId,
    restore_id: &str,
) -> anyhow::Result<()> {
    seed_with(dir, meta, table, last, restore_id, |_| Ok(()))
}

/// [`seed`], with `after_open` run once the storage files exist (tests stop there, as a crash
/// would). The marker is made durable before anything else is put in the data dir: a restore
/// interrupted at any later point leaves a dir that lockd refuses to start on and `lockd
/// restore` names as interrupted, never a `lockd.redb` without a marker.
fn seed_with(
    dir: &Path,
    meta: SnapshotMeta<NodeId, BasicNode>,
    table: Vec<u8>,
    last: LogId,
    restore_id: &str,
    after_open: impl FnOnce(&Path) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    crate::storage::create_data_dir(dir)?;
    let marker = dir.join(RESTORE_MARKER);
    File::create(&marker)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("creating {}", marker.display()))?;
    sync_dir(dir)?;
    let dbs = crate::storage::open_unmarked(dir)?;
    after_open(dir)?;
    dbs.snapshots.write(&StoredSnapshot { meta, table })?;
    // The records a node has after a snapshot at `last` and a purge of its whole log, in one
    // durable commit, encoded as the log store reads them, and the restore id. The vote is the
    // one a member of the backed-up cluster held for the leader of `last`: the same on every
    // restored member, so the first election is in the next term, between equal logs.
    let vote = Vote::new(last.leader_id.term, last.leader_id.node_id);
    let txn = dbs.log.begin_write()?;
    {
        let mut meta = txn.open_table(META)?;
        meta.insert(KEY_VOTE, postcard::to_allocvec(&vote)?.as_slice())?;
        meta.insert(
            KEY_COMMITTED,
            postcard::to_allocvec(&Some(last))?.as_slice(),
        )?;
        meta.insert(KEY_LAST_PURGED, postcard::to_allocvec(&last)?.as_slice())?;
        meta.insert(
            KEY_RESTORE_ID,
            postcard::to_allocvec(&restore_id.to_owned())?.as_slice(),
        )?;
    }
    txn.commit()?;
    drop(dbs);
    std::fs::remove_file(&marker).with_context(|| format!("removing {}", marker.display()))?;
    sync_dir(dir)
}

fn sync_dir(dir: &Path) -> anyhow::Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("syncing data dir {}", dir.display()))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use lockd_core::{Batch, Command, Event, LeaseId, LockTable, Policy, ResourceName, Stamp};
    use openraft::CommittedLeaderId;
    use openraft::storage::RaftLogStorage;

    use super::super::file::BackupWriter;
    use super::*;
    use crate::storage::log_store::LogStore;
    use crate::storage::state_machine::{AppliedSink, StateMachine};

    struct NoSink;
    impl AppliedSink for NoSink {
        fn on_applied(&self, _: u64, _: i64, _: &[Event], _: &[Option<u32>]) {}
        fn on_snapshot_installed(&self, _: u64, _: i64) {}
        fn on_table_replaced(&self, _: Vec<(ResourceName, u32)>) {}
    }

    fn last() -> LogId {
        LogId::new(CommittedLeaderId::new(4, 2), 77)
    }

    /// A backup file of a table with 10 leases (tokens 1..=10) and a signing key, at log id
    /// (4, 2, 77).
    fn backup_file(dir: &Path) -> PathBuf {
        let mut table = LockTable::new();
        let batch = Batch {
            now_ms: 1_000,
            stamp: Some(Stamp {
                term: 4,
                session: 1,
                mono_ms: 0,
                key_seed: 9,
            }),
            policy: Policy::default(),
            commands: (0..10)
                .map(|i| Command::Acquire {
                    resource: ResourceName::new_unchecked(format!("t/{i}")),
                    request_id: format!("r{i}"),
                    lease_ttl_ms: 30_000,
                    wait_timeout_ms: 0,
                    holder: "h".into(),
                    lease_id: LeaseId(i as u128 + 1),
                })
                .chain([Command::InstallSigningKey {
                    pkcs8: lockd_fence::sequencer::SigningKey::generate()
                        .pkcs8_der()
                        .to_vec(),
                    replaces: None,
                }])
                .collect(),
        };
        table.apply(4, &batch, &mut Vec::new());
        let nodes: std::collections::BTreeMap<u64, BasicNode> = (1..=3)
            .map(|i| (i, BasicNode::new(format!("127.0.0.1:{}", 7000 + i))))
            .collect();
        let header = BackupHeader {
            created_unix_ms: 1,
            node_id: 2,
            lockd_version: "test".into(),
            last_log_id: Some(last()),
            membership: StoredMembership::new(
                Some(LogId::new(CommittedLeaderId::new(1, 1), 1)),
                Membership::new(vec![nodes.keys().copied().collect()], nodes),
            ),
            last_token: 10,
            active_locks: 10,
            waiters: 0,
            dedup_records: 10,
        };
        let path = dir.join("backup.lockd");
        let mut w = BackupWriter::start(File::create(&path).unwrap(), &header).unwrap();
        table.snapshot_copy().encode_to(&mut w).unwrap();
        w.finish().unwrap();
        path
    }

    fn opts(file: &Path, data_dir: &Path, floor: Option<u64>) -> RestoreOptions {
        RestoreOptions {
            file: file.to_owned(),
            data_dir: data_dir.to_owned(),
            token_floor: floor,
            peers: Vec::new(),
        }
    }

    /// Goal: a restored data dir opens as a node that took a snapshot at the backup's last
    /// entry: vote in that term, log committed and purged up to it, the table with the raised
    /// token counter, no marker left.
    #[tokio::test]
    async fn a_restored_data_dir_opens_at_the_backup_with_the_raised_counter() {
        let tmp = tempfile::tempdir().unwrap();
        let file = backup_file(tmp.path());
        let data = tmp.path().join("node1");
        let restored = restore(&opts(&file, &data, Some(500))).unwrap();
        assert_eq!(restored.report.backup_last_token, 10);
        assert_eq!(restored.report.last_token, 500);
        assert_eq!(restored.members.len(), 3);
        assert!(!data.join(RESTORE_MARKER).exists());

        let dbs = crate::storage::open(&data).unwrap();
        let mut log = LogStore::new(dbs.log.clone(), dbs.snapshots.durable());
        assert_eq!(log.read_vote().await.unwrap(), Some(Vote::new(4, 2)));
        assert_eq!(log.read_committed().await.unwrap(), Some(last()));
        let state = log.get_log_state().await.unwrap();
        assert_eq!(state.last_purged_log_id, Some(last()));
        assert_eq!(state.last_log_id, Some(last()));
        assert!(!log.rejoining().unwrap());
        assert_eq!(log.restore_id().unwrap(), Some(restored.restore_id.clone()));
        let sm = StateMachine::open(dbs, Arc::new(NoSink)).await.unwrap();
        let shared = sm.shared();
        let s = shared.read().unwrap();
        assert_eq!(s.last_applied, Some(last()));
        assert_eq!(s.table.stats().last_token, 500);
        assert_eq!(s.table.stats().active_locks, 10);
        assert_eq!(s.membership.membership().voter_ids().count(), 3);
        // The backup's key is retired and listed; the first leader installs the next one.
        let keys = s.table.signing_keys();
        assert!(keys.active().is_none());
        assert_eq!(
            keys.all().iter().map(|k| k.id()).collect::<Vec<_>>(),
            vec![restored.report.retired_key.expect("the backup's key")]
        );
    }

    /// Goal: no floor, a non-empty data dir, an interrupted restore and a damaged file are each
    /// refused with an error that says what to do, and leave the data dir as it was.
    #[test]
    fn restore_refuses_without_a_floor_into_a_used_dir_or_from_a_damaged_file() {
        let tmp = tempfile::tempdir().unwrap();
        let file = backup_file(tmp.path());
        let data = tmp.path().join("node1");

        let e = restore(&opts(&file, &data, None)).unwrap_err().to_string();
        assert!(
            e.contains("--token-floor is required")
                && e.contains("last fencing token plus a margin")
                && !e.contains("--token-floor 0"),
            "{e}"
        );
        assert!(!data.exists());

        std::fs::create_dir(&data).unwrap();
        std::fs::write(data.join("lockd.redb"), b"x").unwrap();
        let e = restore(&opts(&file, &data, Some(500)))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not empty") && e.contains("lockd.redb"), "{e}");

        std::fs::remove_file(data.join("lockd.redb")).unwrap();
        std::fs::write(data.join(RESTORE_MARKER), b"").unwrap();
        let e = restore(&opts(&file, &data, Some(500)))
            .unwrap_err()
            .to_string();
        assert!(e.contains("interrupted restore"), "{e}");
        // And lockd does not start on it.
        let e = crate::storage::open(&data).err().unwrap().to_string();
        assert!(e.contains("interrupted"), "{e}");
        std::fs::remove_file(data.join(RESTORE_MARKER)).unwrap();

        let mut bytes = std::fs::read(&file).unwrap();
        let at = bytes.len() / 2;
        bytes[at] ^= 1;
        std::fs::write(&file, &bytes).unwrap();
        let e = restore(&opts(&file, &data, Some(500)))
            .unwrap_err()
            .to_string();
        assert!(e.contains("checksum mismatch"), "{e}");
        std::fs::write(&file, &bytes[..at]).unwrap();
        let e = restore(&opts(&file, &data, Some(500)))
            .unwrap_err()
            .to_string();
        assert!(e.contains("truncated"), "{e}");
        assert_eq!(std::fs::read_dir(&data).unwrap().count(), 0);
    }

    /// Goal: every member restored from the same file with the same floor and members gets the
    /// same state machine byte for byte (the retired signing key included), the same log
    /// records and the same restore id; another floor or another member list gives another
    /// restore id; a floor above 2^62 is refused naming the value.
    #[tokio::test]
    async fn restores_alike_are_identical_and_any_difference_changes_the_restore_id() {
        let tmp = tempfile::tempdir().unwrap();
        let file = backup_file(tmp.path());
        let mut ids = Vec::new();
        let mut snapshots = Vec::new();
        for node in 1..=3 {
            let data = tmp.path().join(format!("node{node}"));
            ids.push(restore(&opts(&file, &data, Some(500))).unwrap().restore_id);
            snapshots.push(std::fs::read(data.join("snapshot.bin")).unwrap());
            let dbs = crate::storage::open(&data).unwrap();
            let mut log = LogStore::new(dbs.log.clone(), dbs.snapshots.durable());
            assert_eq!(log.read_vote().await.unwrap(), Some(Vote::new(4, 2)));
            assert_eq!(log.read_committed().await.unwrap(), Some(last()));
            assert_eq!(
                log.get_log_state().await.unwrap().last_purged_log_id,
                Some(last())
            );
        }
        assert!(ids.iter().all(|id| *id == ids[0]), "{ids:?}");
        assert_eq!(ids[0].len(), 64);
        assert!(snapshots.iter().all(|s| *s == snapshots[0]));

        let other_floor = restore(&opts(&file, &tmp.path().join("f"), Some(501))).unwrap();
        assert_ne!(other_floor.restore_id, ids[0]);
        let mut o = opts(&file, &tmp.path().join("p"), Some(500));
        o.peers = vec![
            "1=127.0.0.1:7001".parse().unwrap(),
            "2=127.0.0.1:7002".parse().unwrap(),
            "3=127.0.0.1:7004".parse().unwrap(),
        ];
        assert_ne!(restore(&o).unwrap().restore_id, ids[0]);

        let data = tmp.path().join("high");
        let too_high = (1u64 << 62) + 1;
        let e = restore(&opts(&file, &data, Some(too_high)))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&too_high.to_string()) && e.contains("2^62"),
            "{e}"
        );
        assert!(!data.exists());
        restore(&opts(&file, &data, Some(1 << 62))).unwrap();
    }

    /// Goal: `--peer` replaces the backup's members (a cluster restored on other machines).
    #[test]
    fn peers_replace_the_backups_membership() {
        let tmp = tempfile::tempdir().unwrap();
        let file = backup_file(tmp.path());
        let data = tmp.path().join("node1");
        let mut o = opts(&file, &data, Some(500));
        o.peers = vec![
            "1=127.0.0.9:7101".parse().unwrap(),
            "2=127.0.0.9:7102".parse().unwrap(),
        ];
        let restored = restore(&o).unwrap();
        assert_eq!(
            restored.members,
            vec![
                (1, "127.0.0.9:7101".to_owned()),
                (2, "127.0.0.9:7102".to_owned())
            ]
        );
    }

    /// Goal: a floor below the backup's last token is refused naming both values and the
    /// margin to add (review finding 3: "--token-floor 0 without a fence store" reissued tokens
    /// that clients of `lockctl hold` or conditional updates still held); a floor equal to it is
    /// accepted with a warning that it is safe only if nothing was granted after the backup; a
    /// floor above it restores without a word.
    #[test]
    fn a_floor_below_the_backups_last_token_is_refused_and_equal_is_warned() {
        let tmp = tempfile::tempdir().unwrap();
        let file = backup_file(tmp.path());
        for floor in [0, 9] {
            let data = tmp.path().join(format!("below{floor}"));
            let e = restore(&opts(&file, &data, Some(floor)))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("--token-floor {floor} is below"))
                    && e.contains("last fencing token 10")
                    && e.contains("grant rate")
                    && e.contains("backup's age"),
                "{e}"
            );
            assert!(!data.exists());
        }
        let equal = restore(&opts(&file, &tmp.path().join("equal"), Some(10))).unwrap();
        assert_eq!(equal.report.last_token, 10);
        let w = equal
            .warning
            .expect("a warning for a floor equal to the last token");
        assert!(
            w.contains("--token-floor 10") && w.contains("granted nothing after the backup"),
            "{w}"
        );
        let above = restore(&opts(&file, &tmp.path().join("above"), Some(11))).unwrap();
        assert_eq!(above.warning, None);
        assert_eq!(above.report.last_token, 11);
    }

    /// Goal: a restore interrupted once the storage files exist leaves a data dir that lockd
    /// refuses to start on and that `lockd restore` names as interrupted (review finding 5: the
    /// storage was opened, creating `lockd.redb`, before the marker existed, so a crash in
    /// between left a dir lockd would start on as a new node). Method: `seed_with` stops right
    /// after opening the storage, as a crash would.
    #[test]
    fn a_restore_interrupted_after_the_storage_opened_leaves_the_marker() {
        let tmp = tempfile::tempdir().unwrap();
        let data = tmp.path().join("node1");
        let meta = SnapshotMeta {
            last_log_id: Some(last()),
            last_membership: StoredMembership::default(),
            snapshot_id: "t".into(),
        };
        let e = seed_with(&data, meta, Vec::new(), last(), "id", |dir| {
            assert!(dir.join("lockd.redb").exists());
            anyhow::bail!("crash")
        })
        .unwrap_err();
        assert_eq!(e.to_string(), "crash");
        assert!(data.join(RESTORE_MARKER).exists());
        let e = crate::storage::open(&data).err().unwrap().to_string();
        assert!(e.contains("interrupted"), "{e}");
        let file = backup_file(tmp.path());
        let e = restore(&opts(&file, &data, Some(500)))
            .unwrap_err()
            .to_string();
        assert!(e.contains("interrupted restore"), "{e}");
    }
}
