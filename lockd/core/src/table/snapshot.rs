//! The snapshot encoding of a [`LockTable`]: what a replica persists and what a lagging follower
//! receives from the leader.
//!
//! Format 4 is a magic prefix, the postcard encoding of the table, then the postcard encoding of
//! the signing keys ([`crate::keys`]). Format 3 (lockd before signed sequencers) is the same
//! without the keys: it loads with none, and the next leader installs one. Format 2 (lockd
//! before the monotonic table clock) had another prefix and no clock anchor. Format 1 (lockd
//! before the compact dedup window) had no prefix and kept the dedup records in an ordered map
//! plus a separate time-order list. Both are still read, so data dirs and snapshots from a
//! leader still on an old version load.

use imbl::{OrdMap, OrdSet, Vector};
use serde::{Deserialize, Serialize};

use super::dedup::{DedupState, DedupWindow, Ident, RecordV2};
use super::{LockTable, ResourceState};
use crate::keys::SigningKeys;
use crate::types::{RequestKey, ResourceName};

/// Starts every format-4 snapshot (see [`MAGIC_V3`] for why the 0xFF bytes).
const MAGIC_V4: &[u8] = b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xfflockd-table-4";
/// Starts every format-3 snapshot. Ten 0xFF bytes are not a valid postcard varint, so no
/// format-1 snapshot (which starts with the varint count of active resources) begins this way.
const MAGIC_V3: &[u8] = b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xfflockd-table-3";
/// Starts every format-2 snapshot.
const MAGIC_V2: &[u8] = b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xfflockd-table-2";

/// Why a snapshot could not be read back into a table.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The bytes are not a table of that format.
    #[error("lock table snapshot (format {format}) does not decode: {source}")]
    Decode {
        /// The snapshot format it was read as (from its magic prefix; 1 without one).
        format: u8,
        /// What postcard could not read.
        source: postcard::Error,
    },
    /// The table decoded but bytes were left over.
    #[error("lock table snapshot (format {format}) has {count} bytes after the table")]
    TrailingBytes {
        /// The snapshot format it was read as (from its magic prefix; 1 without one).
        format: u8,
        /// How many bytes were left over.
        count: usize,
    },
    /// The table decoded but does not convert to the current table.
    #[error("lock table snapshot (format {format}) is invalid: {reason}")]
    Invalid {
        /// The snapshot format it was read as (from its magic prefix; 1 without one).
        format: u8,
        /// Why not.
        reason: String,
    },
}

/// A copy of the table taken for a snapshot, to encode off the apply path. Taking it shares
/// structure (persistent collections, the dedup window's records by chunk; the dedup index,
/// derived data, is left out), and it can only be
/// encoded, never applied to.
pub struct SnapshotCopy(LockTable);

impl SnapshotCopy {
    /// The snapshot bytes (format 4).
    pub fn encode(&self) -> Vec<u8> {
        self.0.encode_snapshot()
    }

    /// Writes the snapshot bytes (format 4) to `out` as they are encoded, without holding them
    /// all in memory.
    pub fn encode_to<W: std::io::Write>(&self, mut out: W) -> std::io::Result<()> {
        out.write_all(MAGIC_V4)?;
        let out = postcard::to_io(&self.0, out).map_err(std::io::Error::other)?;
        postcard::to_io(&self.0.keys, out).map_err(std::io::Error::other)?;
        Ok(())
    }
}

impl LockTable {
    /// The snapshot bytes of this table (format 4).
    pub fn encode_snapshot(&self) -> Vec<u8> {
        let mut out = MAGIC_V4.to_vec();
        postcard::to_io(self, &mut out).expect("encoding into a Vec cannot fail");
        postcard::to_io(&self.keys, &mut out).expect("encoding into a Vec cannot fail");
        out
    }

    /// See [`SnapshotCopy`].
    pub fn snapshot_copy(&self) -> SnapshotCopy {
        SnapshotCopy(LockTable {
            resources: self.resources.clone(),
            expiries: self.expiries.clone(),
            wait_deadlines: self.wait_deadlines.clone(),
            dedup: self.dedup.copy_for_encoding(),
            tenant_waiters: self.tenant_waiters.clone(),
            last_token: self.last_token,
            now_ms: self.now_ms,
            term: self.term,
            anchor: self.anchor,
            secret: self.secret,
            abandoned: self.abandoned.clone(),
            tenant_resources: self.tenant_resources.clone(),
            tenant_records: self.tenant_records.clone(),
            held: self.held,
            waiting: self.waiting,
            keys: self.keys.clone(),
        })
    }

    /// Reads snapshot bytes of either format. Does not check consistency: see
    /// [`LockTable::check_consistency`].
    pub fn decode_snapshot(bytes: &[u8]) -> Result<LockTable, SnapshotError> {
        if let Some(body) = bytes.strip_prefix(MAGIC_V4) {
            let (mut table, rest) = postcard::take_from_bytes::<LockTable>(body)
                .map_err(|source| SnapshotError::Decode { format: 4, source })?;
            table.keys = decode_all(4, rest)?;
            return Ok(table);
        }
        if let Some(body) = bytes.strip_prefix(MAGIC_V3) {
            return decode_all::<LockTable>(3, body);
        }
        match bytes.strip_prefix(MAGIC_V2) {
            Some(body) => {
                decode_all::<TableV2>(2, body)?
                    .try_into()
                    .map_err(|e| SnapshotError::Invalid {
                        format: 2,
                        reason: e,
                    })
            }
            None => decode_all::<TableV1>(1, bytes).map(LockTable::from),
        }
    }
}

fn decode_all<T: serde::de::DeserializeOwned>(
    format: u8,
    bytes: &[u8],
) -> Result<T, SnapshotError> {
    let (value, rest) = postcard::take_from_bytes(bytes)
        .map_err(|source| SnapshotError::Decode { format, source })?;
    if !rest.is_empty() {
        return Err(SnapshotError::TrailingBytes {
            format,
            count: rest.len(),
        });
    }
    Ok(value)
}

/// Active resources per tenant, which formats 1 and 2 did not keep.
fn active_per_tenant(resources: &OrdMap<ResourceName, ResourceState>) -> OrdMap<String, u32> {
    let mut counts = OrdMap::new();
    for name in resources.keys() {
        *counts.entry(name.tenant().to_owned()).or_insert(0) += 1;
    }
    counts
}

/// The table as format 2 laid it out, field for field.
#[derive(Serialize, Deserialize)]
struct TableV2 {
    resources: OrdMap<ResourceName, ResourceState>,
    expiries: OrdSet<(i64, ResourceName)>,
    wait_deadlines: OrdSet<(i64, ResourceName, RequestKey)>,
    /// Live records, oldest first, in the record layout of format 2.
    dedup: Vec<RecordV2>,
    tenant_waiters: OrdMap<String, u32>,
    last_token: u64,
    now_ms: i64,
    term: u64,
    held: u64,
    waiting: u64,
}

/// A format-2 table has no clock anchor and no secret: the first stamped batch after loading
/// anchors the clock at the table's time and brings the secret; its dedup records keep their
/// unkeyed (legacy) keys until they are pruned.
impl TryFrom<TableV2> for LockTable {
    type Error = String;

    fn try_from(v2: TableV2) -> Result<Self, String> {
        let mut dedup = DedupWindow::default();
        dedup.extend_legacy(v2.dedup)?;
        Ok(LockTable {
            tenant_resources: active_per_tenant(&v2.resources),
            tenant_records: OrdMap::new(),
            abandoned: OrdSet::new(),
            resources: v2.resources,
            expiries: v2.expiries,
            wait_deadlines: v2.wait_deadlines,
            dedup,
            tenant_waiters: v2.tenant_waiters,
            last_token: v2.last_token,
            now_ms: v2.now_ms,
            term: v2.term,
            anchor: None,
            secret: None,
            held: v2.held,
            waiting: v2.waiting,
            keys: SigningKeys::default(),
        })
    }
}

/// The table as format 1 laid it out, field for field.
#[derive(Serialize, Deserialize)]
struct TableV1 {
    resources: OrdMap<ResourceName, ResourceState>,
    expiries: OrdSet<(i64, ResourceName)>,
    wait_deadlines: OrdSet<(i64, ResourceName, RequestKey)>,
    dedup: OrdMap<RequestKey, DedupRecordV1>,
    /// (created_ms, seq, key) in creation order; an entry whose seq differs from the record's is
    /// stale.
    dedup_order: Vector<(i64, u64, RequestKey)>,
    dedup_seq: u64,
    tenant_waiters: OrdMap<String, u32>,
    last_token: u64,
    now_ms: i64,
    term: u64,
    held: u64,
    waiting: u64,
}

#[derive(Clone, Serialize, Deserialize)]
struct DedupRecordV1 {
    args_hash: u64,
    seq: u64,
    state: DedupState,
}

impl From<TableV1> for LockTable {
    fn from(v1: TableV1) -> Self {
        let mut dedup = DedupWindow::default();
        for (created_ms, seq, key) in &v1.dedup_order {
            let current = v1.dedup.get(key).filter(|r| r.seq == *seq);
            // A repeated order entry would insert the key twice; check_consistency would then
            // reject the table, but the first one is the record.
            if let Some(record) = current.filter(|_| !dedup.contains(*key)) {
                let ident = Ident {
                    key: *key,
                    args: u128::from(record.args_hash),
                    tenant: 0,
                    legacy: true,
                };
                dedup.insert(ident, *created_ms, record.state);
            }
        }
        LockTable {
            tenant_resources: active_per_tenant(&v1.resources),
            tenant_records: OrdMap::new(),
            abandoned: OrdSet::new(),
            resources: v1.resources,
            expiries: v1.expiries,
            wait_deadlines: v1.wait_deadlines,
            dedup,
            tenant_waiters: v1.tenant_waiters,
            last_token: v1.last_token,
            now_ms: v1.now_ms,
            term: v1.term,
            anchor: None,
            secret: None,
            held: v1.held,
            waiting: v1.waiting,
            keys: SigningKeys::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::{Batch, Command};
    use crate::limits::Policy;
    use crate::types::LeaseId;

    fn acquire(resource: &str, request_id: &str, wait_ms: u64, id: u128) -> Command {
        Command::Acquire {
            resource: ResourceName::new_unchecked(resource.into()),
            request_id: request_id.into(),
            lease_ttl_ms: 30_000,
            wait_timeout_ms: wait_ms,
            holder: "h".into(),
            lease_id: LeaseId(id),
        }
    }

    fn stamp() -> Option<crate::command::Stamp> {
        Some(crate::command::Stamp {
            term: 1,
            session: 7,
            mono_ms: 5,
            key_seed: 0x5eed,
        })
    }

    /// A table with a holder, a waiter, and granted and waiting dedup records.
    fn sample() -> LockTable {
        sample_stamped(stamp())
    }

    /// The same table as lockd made it before stamps (unkeyed dedup records).
    fn legacy_sample() -> LockTable {
        sample_stamped(None)
    }

    fn sample_stamped(stamp: Option<crate::command::Stamp>) -> LockTable {
        let mut table = LockTable::new();
        let batch = Batch {
            now_ms: 1_000,
            stamp,
            policy: Policy::default(),
            commands: vec![
                acquire("a", "r1", 0, 1),
                acquire("a", "r2", 60_000, 2),
                acquire("b", "r3", 0, 3),
            ],
        };
        table.apply(1, &batch, &mut Vec::new());
        table
    }

    /// A sample table with an active and a retired signing key.
    fn sample_with_keys() -> LockTable {
        let mut table = sample();
        let key = |_| {
            lockd_fence::sequencer::SigningKey::generate()
                .pkcs8_der()
                .to_vec()
        };
        let first = match table.apply(2, &install(key(0), None), &mut Vec::new())[0] {
            crate::command::Outcome::SigningKeyInstalled { key_id } => key_id,
            ref other => panic!("{other:?}"),
        };
        table.apply(3, &install(key(1), Some(first)), &mut Vec::new());
        assert_eq!(table.signing_keys().all().len(), 2);
        table
    }

    fn install(pkcs8: Vec<u8>, replaces: Option<[u8; 8]>) -> Batch {
        Batch {
            now_ms: 1_000,
            stamp: stamp(),
            policy: Policy::default(),
            commands: vec![Command::InstallSigningKey { pkcs8, replaces }],
        }
    }

    #[test]
    fn format_4_round_trips_with_the_signing_keys() {
        let table = sample_with_keys();
        let bytes = table.encode_snapshot();
        assert!(bytes.starts_with(MAGIC_V4));
        let copy = LockTable::decode_snapshot(&bytes).unwrap();
        copy.check_consistency().unwrap();
        assert_eq!(copy.signing_keys(), table.signing_keys());
        assert_eq!(copy.encode_snapshot(), bytes);
        assert_eq!(copy.stats(), table.stats());
    }

    /// Goal: data dirs and leaders from before signed sequencers still load. Method: write the
    /// table as format 3 did (no keys) and load it: same table, no keys.
    #[test]
    fn format_3_snapshots_still_load_without_keys() {
        let table = sample_with_keys();
        let mut v3 = MAGIC_V3.to_vec();
        postcard::to_io(&table, &mut v3).unwrap();
        let loaded = LockTable::decode_snapshot(&v3).unwrap();
        loaded.check_consistency().unwrap();
        assert!(loaded.signing_keys().is_empty());
        assert_eq!(loaded.stats(), table.stats());
        // Re-encoded: format 4, the same table, an empty key list.
        let mut expected = MAGIC_V4.to_vec();
        expected.extend_from_slice(&v3[MAGIC_V3.len()..]);
        expected.push(0);
        assert_eq!(loaded.encode_snapshot(), expected);
    }

    #[test]
    fn a_snapshot_with_a_key_that_does_not_match_is_inconsistent() {
        let table = sample_with_keys();
        let mut bytes = table.encode_snapshot();
        // The last key's created/retired fields end the encoding; the public key sits before
        // the pkcs8 bytes: flip a byte of the first record's public key.
        let keys = table.signing_keys().clone();
        let encoded_keys = postcard::to_allocvec(&keys).unwrap();
        let at = bytes.len() - encoded_keys.len();
        assert_eq!(&bytes[at..], &encoded_keys[..]);
        bytes[at + 1 + 8] ^= 1;
        let loaded = LockTable::decode_snapshot(&bytes).unwrap();
        let err = loaded.check_consistency().unwrap_err();
        assert!(err.contains("does not match"), "{err}");
        keys.check().unwrap();
    }

    /// Goal: a snapshot (or backup: `lockd restore` checks it the same way) whose request-id
    /// record holds a token above the token counter is refused, naming both (review of the
    /// restore, M1: only lease tokens were compared with the counter, so a crafted backup could
    /// make the restored cluster answer a retry with a signed grant of token X and later grant X
    /// again). Method: a grant of token 2 released (its record stays, its lease goes), the
    /// counter set back to 1, encoded and loaded as a snapshot from disk or a leader would be.
    #[test]
    fn a_dedup_record_above_the_counter_is_refused() {
        let mut table = sample();
        table.apply(
            1,
            &Batch {
                now_ms: 1_000,
                stamp: stamp(),
                policy: Policy::default(),
                commands: vec![Command::Release {
                    resource: ResourceName::new_unchecked("b".into()),
                    lease_id: LeaseId(3),
                }],
            },
            &mut Vec::new(),
        );
        table.check_consistency().unwrap();
        assert_eq!(table.last_token, 2);
        table.last_token = 1;
        let loaded = LockTable::decode_snapshot(&table.encode_snapshot()).unwrap();
        let err = loaded
            .check_consistency()
            .expect_err("a request-id record above the counter was accepted");
        assert!(
            err.contains("fencing token 2") && err.contains("last token issued 1"),
            "{err}"
        );
    }

    #[test]
    fn format_4_round_trips_without_keys() {
        let table = sample();
        let bytes = table.encode_snapshot();
        assert!(bytes.starts_with(MAGIC_V4));
        assert!(table.anchor.is_some());
        let copy = LockTable::decode_snapshot(&bytes).unwrap();
        copy.check_consistency().unwrap();
        assert_eq!(copy.encode_snapshot(), bytes);
        assert_eq!(copy.stats(), table.stats());
    }

    #[test]
    fn format_2_snapshots_still_load_and_answer_retries() {
        let table = legacy_sample();
        let v2 = TableV2 {
            resources: table.resources.clone(),
            expiries: table.expiries.clone(),
            wait_deadlines: table.wait_deadlines.clone(),
            dedup: table.dedup.to_v2(),
            tenant_waiters: table.tenant_waiters.clone(),
            last_token: table.last_token,
            now_ms: table.now_ms,
            term: table.term,
            held: table.held,
            waiting: table.waiting,
        };
        let mut bytes = MAGIC_V2.to_vec();
        bytes.extend(postcard::to_allocvec(&v2).unwrap());
        let mut loaded = LockTable::decode_snapshot(&bytes).unwrap();
        loaded.check_consistency().unwrap();
        assert_eq!(loaded.anchor, None);
        assert_eq!(loaded.stats(), table.stats());
        assert_eq!(loaded.encode_snapshot(), table.encode_snapshot());
        // The first stamped batch brings the secret; the records made before still answer
        // their retries (under their legacy keys), a changed argument is still refused, and
        // the queued request keeps its single place.
        let retries = Batch {
            now_ms: 2_000,
            stamp: stamp(),
            policy: Policy::default(),
            commands: vec![
                acquire("a", "r1", 0, 11),
                acquire("a", "r2", 60_000, 12),
                acquire("c", "r3", 0, 13),
            ],
        };
        let outcomes = loaded.apply(2, &retries, &mut Vec::new());
        assert!(loaded.secret.is_some());
        assert!(
            matches!(outcomes[0], crate::command::Outcome::Granted(g) if g.lease_id == LeaseId(1))
        );
        assert_eq!(outcomes[1], crate::command::Outcome::Queued { position: 1 });
        assert!(matches!(
            outcomes[2],
            crate::command::Outcome::InvalidArgument(_)
        ));
        loaded.check_consistency().unwrap();
    }

    #[test]
    fn format_1_snapshots_still_load() {
        let table = legacy_sample();
        // The same table as format 1 wrote it.
        let mut dedup = OrdMap::new();
        let mut dedup_order = Vector::new();
        for (seq, request_id) in ["r1", "r2", "r3"].into_iter().enumerate() {
            let key = RequestKey::of(request_id);
            let (ident, state) = table.dedup.get(key).unwrap();
            dedup.insert(
                key,
                DedupRecordV1 {
                    args_hash: ident.args as u64,
                    seq: seq as u64 + 1,
                    state,
                },
            );
            dedup_order.push_back((1_000, seq as u64 + 1, key));
        }
        // A stale order entry (a key re-created later) is skipped.
        dedup_order.push_front((900, 99, RequestKey::of("r1")));
        let v1 = TableV1 {
            resources: table.resources.clone(),
            expiries: table.expiries.clone(),
            wait_deadlines: table.wait_deadlines.clone(),
            dedup,
            dedup_order,
            dedup_seq: 3,
            tenant_waiters: table.tenant_waiters.clone(),
            last_token: table.last_token,
            now_ms: table.now_ms,
            term: table.term,
            held: table.held,
            waiting: table.waiting,
        };
        let loaded = LockTable::decode_snapshot(&postcard::to_allocvec(&v1).unwrap()).unwrap();
        loaded.check_consistency().unwrap();
        assert_eq!(loaded.encode_snapshot(), table.encode_snapshot());
    }

    #[test]
    fn garbage_is_an_error_not_a_table() {
        let bytes = sample().encode_snapshot();
        let truncated = LockTable::decode_snapshot(&bytes[..bytes.len() - 1]).unwrap_err();
        assert!(truncated.to_string().contains("format 4"), "{truncated}");
        let mut longer = bytes.clone();
        longer.push(0);
        let trailing = LockTable::decode_snapshot(&longer).unwrap_err();
        assert!(trailing.to_string().contains("1 bytes after"), "{trailing}");
        assert!(LockTable::decode_snapshot(b"").is_err());
        assert!(LockTable::decode_snapshot(b"\x05junk").is_err());
    }

    #[test]
    fn a_snapshot_copy_encodes_like_the_table() {
        let table = sample();
        assert_eq!(table.snapshot_copy().encode(), table.encode_snapshot());
        let mut streamed = Vec::new();
        table.snapshot_copy().encode_to(&mut streamed).unwrap();
        assert_eq!(streamed, table.encode_snapshot());
    }
}
