//! The request-dedup window: the outcome of every Acquire of the last `dedup_retention_ms`, by
//! request key, so that a retry returns the original outcome instead of acting again.
//!
//! At the design load (2,000 acquires/s, 10-minute retention) the window holds 1.2 million
//! records, by far the largest part of the table, so its layout is chosen for size:
//!
//! - records are fixed-size and kept in creation order, which is time order (the table's clock
//!   never goes back), in shared chunks of 244 that store each record's time and token as small
//!   offsets from the chunk's first (67 bytes a record, see [`records`]). Pruning pops the
//!   front; cloning for a snapshot copies chunk pointers, and later writes copy only the chunks
//!   they touch.
//! - a hash index maps a key to its record's sequence number (4 bytes a slot). It is derived
//!   data: snapshots carry only the records, and loading one rebuilds the index.
//!   Its hash is keyed per process (SipHash with a random key), so clients cannot choose
//!   request_ids that collide in it; outcomes and encodings never depend on it.

use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::BuildHasher;

use hashbrown::HashTable;
use serde::de::{SeqAccess, Visitor};
use serde::ser::SerializeSeq;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::FencingToken;
use crate::command::Grant;
use crate::types::{LeaseId, RequestKey};

mod records;

use records::Records;

/// What a retry of an Acquire is answered with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) enum DedupState {
    /// Still queued: the retry learns its position.
    Waiting,
    Granted(Grant),
    TimedOut,
    /// Refused without waiting because the resource was held: final, like a grant, so a late
    /// copy of the first attempt cannot be granted after a retry was refused.
    Held,
}

/// One Acquire's record as a snapshot encodes it (formats 3 and 4).
/// Keys and lease ids are byte arrays rather than `u128`, whose varint encoding takes up to 19
/// bytes instead of 16.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct RecordWire {
    key: [u8; 16],
    /// Keyed 128-bit digest of the Acquire's arguments: a retry must match it.
    args: [u8; 16],
    /// Keyed 64-bit tag of the resource's tenant, for the per-tenant record quota; 0 = not
    /// counted (records made before tenants were counted).
    tenant: u64,
    /// Table clock when the record was created, granted, or last carried over while waiting.
    created_ms: i64,
    status: Status,
    /// Keyed with the unkeyed hashes of lockd before the table had a secret (see
    /// `LockTable::lookup`).
    legacy: bool,
    // The grant, meaningful when `status` is `Granted`.
    lease_id: [u8; 16],
    fencing_token: u64,
    expires_at_ms: i64,
    lease_ttl_ms: u32,
}

/// One Acquire's record as a value: the fields of [`RecordWire`] in 79 bytes. The window stores
/// it as a 67-byte slot whose creation time and token are relative to its chunk's
/// ([`records`]); every other field is kept as here. Two fields are narrowed, both derived from
/// values the table bounds:
/// - the expiry is kept as its distance from `created_ms` (a grant expires one ttl after it was
///   made, at most 300 s), in an `i32` of milliseconds, with `EXPIRES_ZERO` standing for an
///   expiry of 0 (the value of every record that holds no grant);
/// - the ttl (at most `LEASE_TTL_MAX_MS`, validated at the edge) shares 3 bytes with the status
///   and the legacy flag.
///
/// Values beyond either range (possible only in a hand-made snapshot) are clamped, the same way
/// on every replica; the expiry is informative only (times derived from the table's clock are).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Record {
    key: [u8; 16],
    args: [u8; 16],
    lease_id: [u8; 16],
    tenant: [u8; 8],
    created_ms: [u8; 8],
    fencing_token: [u8; 8],
    /// `expires_at_ms - created_ms`, little-endian `i32`, clamped; `EXPIRES_ZERO` = 0.
    expires_after: [u8; 4],
    /// Little-endian: bits 0-19 the ttl (clamped), 20-22 the status, 23 the legacy flag.
    ttl_status: [u8; 3],
}

/// `expires_after` of a record whose expiry is 0 (no grant).
const EXPIRES_ZERO: i32 = i32::MIN;
const TTL_BITS: u32 = 20;
const TTL_MAX: u32 = (1 << TTL_BITS) - 1;
const _: () = assert!(
    crate::limits::LEASE_TTL_MAX_MS <= TTL_MAX as u64,
    "a record keeps the ttl in 20 bits: widen `ttl_status` before raising the limit"
);
// A grant's expiry is at most a wait plus a ttl after its record was created (a waiter granted
// in place by lockd before fe2d2ab kept its enqueue time), so the offset is exact, never clamped,
// and old and new replicas answer a retry alike.
const _: () = assert!(
    crate::limits::WAIT_TIMEOUT_MAX_MS + crate::limits::LEASE_TTL_MAX_MS < i32::MAX as u64,
    "a record keeps the expiry as an i32 offset: widen `expires_after` before raising the limits"
);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum Status {
    Waiting,
    Granted,
    TimedOut,
    /// Removed (a cancelled wait); the slot stays until pruning reaches it.
    Forgotten,
    /// Refused: the resource was held. Last, so older snapshots decode unchanged.
    Held,
}

impl Status {
    const ALL: [Status; 5] = [
        Status::Waiting,
        Status::Granted,
        Status::TimedOut,
        Status::Forgotten,
        Status::Held,
    ];
}

/// What identifies one Acquire in the window: its key, the digest of its arguments, its
/// tenant's tag, and whether the key and digest are of the legacy (unkeyed) kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Ident {
    pub key: RequestKey,
    pub args: u128,
    pub tenant: u64,
    pub legacy: bool,
}

impl Record {
    fn new(ident: Ident, created_ms: i64, state: DedupState) -> Self {
        let mut record = Record::from(RecordWire {
            key: ident.key.0.to_le_bytes(),
            args: ident.args.to_le_bytes(),
            tenant: ident.tenant,
            created_ms,
            status: Status::Waiting,
            legacy: ident.legacy,
            lease_id: [0; 16],
            fencing_token: 0,
            expires_at_ms: 0,
            lease_ttl_ms: 0,
        });
        record.set_state(state);
        record
    }

    fn created_ms(&self) -> i64 {
        i64::from_le_bytes(self.created_ms)
    }

    fn tenant(&self) -> u64 {
        u64::from_le_bytes(self.tenant)
    }

    fn status(&self) -> Status {
        let bits = (self.packed() >> TTL_BITS) & 0b111;
        // Only `pack` writes these bits, always from a `Status`; a value it cannot write reads
        // as a removed record rather than stopping the replica.
        Status::ALL
            .get(bits as usize)
            .copied()
            .unwrap_or(Status::Forgotten)
    }

    fn legacy(&self) -> bool {
        (self.packed() >> (TTL_BITS + 3)) & 1 == 1
    }

    fn lease_ttl_ms(&self) -> u32 {
        self.packed() & TTL_MAX
    }

    fn expires_at_ms(&self) -> i64 {
        match i32::from_le_bytes(self.expires_after) {
            EXPIRES_ZERO => 0,
            after => self.created_ms().saturating_add(i64::from(after)),
        }
    }

    fn packed(&self) -> u32 {
        let [a, b, c] = self.ttl_status;
        u32::from_le_bytes([a, b, c, 0])
    }

    fn pack(&mut self, ttl: u32, status: Status, legacy: bool) {
        let index = Status::ALL
            .iter()
            .position(|s| *s == status)
            .expect("every status is in ALL") as u32;
        let packed = ttl.min(TTL_MAX) | (index << TTL_BITS) | (u32::from(legacy) << (TTL_BITS + 3));
        let [a, b, c, _] = packed.to_le_bytes();
        self.ttl_status = [a, b, c];
    }

    fn set_status(&mut self, status: Status) {
        self.pack(self.lease_ttl_ms(), status, self.legacy());
    }

    fn set_expires_at_ms(&mut self, expires_at_ms: i64) {
        let after = if expires_at_ms == 0 {
            EXPIRES_ZERO
        } else {
            let after = expires_at_ms.saturating_sub(self.created_ms());
            // Clamped short of the sentinel.
            after.clamp(i64::from(EXPIRES_ZERO) + 1, i64::from(i32::MAX)) as i32
        };
        self.expires_after = after.to_le_bytes();
    }

    fn set_state(&mut self, state: DedupState) {
        match state {
            DedupState::Waiting => self.set_status(Status::Waiting),
            DedupState::TimedOut => self.set_status(Status::TimedOut),
            DedupState::Held => self.set_status(Status::Held),
            DedupState::Granted(grant) => {
                self.lease_id = grant.lease_id.0.to_le_bytes();
                self.fencing_token = grant.fencing_token.0.to_le_bytes();
                self.set_expires_at_ms(grant.expires_at_ms);
                let ttl = u32::try_from(grant.lease_ttl_ms).unwrap_or(u32::MAX);
                self.pack(ttl, Status::Granted, self.legacy());
            }
        }
    }

    fn state(&self) -> Option<DedupState> {
        match self.status() {
            Status::Waiting => Some(DedupState::Waiting),
            Status::TimedOut => Some(DedupState::TimedOut),
            Status::Held => Some(DedupState::Held),
            Status::Forgotten => None,
            Status::Granted => Some(DedupState::Granted(Grant {
                lease_id: LeaseId(u128::from_le_bytes(self.lease_id)),
                fencing_token: FencingToken(u64::from_le_bytes(self.fencing_token)),
                expires_at_ms: self.expires_at_ms(),
                lease_ttl_ms: u64::from(self.lease_ttl_ms()),
            })),
        }
    }

    fn is_live(&self) -> bool {
        self.status() != Status::Forgotten
    }

    fn ident(&self) -> Ident {
        Ident {
            key: RequestKey(u128::from_le_bytes(self.key)),
            args: u128::from_le_bytes(self.args),
            tenant: self.tenant(),
            legacy: self.legacy(),
        }
    }
}

impl From<RecordWire> for Record {
    fn from(w: RecordWire) -> Self {
        let mut record = Record {
            key: w.key,
            args: w.args,
            lease_id: w.lease_id,
            tenant: w.tenant.to_le_bytes(),
            created_ms: w.created_ms.to_le_bytes(),
            fencing_token: w.fencing_token.to_le_bytes(),
            expires_after: [0; 4],
            ttl_status: [0; 3],
        };
        record.set_expires_at_ms(w.expires_at_ms);
        record.pack(w.lease_ttl_ms, w.status, w.legacy);
        record
    }
}

impl From<Record> for RecordWire {
    fn from(r: Record) -> Self {
        RecordWire {
            key: r.key,
            args: r.args,
            tenant: r.tenant(),
            created_ms: r.created_ms(),
            status: r.status(),
            legacy: r.legacy(),
            lease_id: r.lease_id,
            fencing_token: u64::from_le_bytes(r.fencing_token),
            expires_at_ms: r.expires_at_ms(),
            lease_ttl_ms: r.lease_ttl_ms(),
        }
    }
}

impl Serialize for Record {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        RecordWire::from(*self).serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Record {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        RecordWire::deserialize(deserializer).map(Record::from)
    }
}

/// A record as format 2 of the snapshot wrote it (before keyed digests and tenant tags).
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub(super) struct RecordV2 {
    key: [u8; 16],
    args_hash: u64,
    created_ms: i64,
    status: Status,
    lease_id: [u8; 16],
    fencing_token: u64,
    expires_at_ms: i64,
    lease_ttl_ms: u32,
}

impl From<RecordV2> for Record {
    fn from(v2: RecordV2) -> Self {
        Record::from(RecordWire {
            key: v2.key,
            args: u128::from(v2.args_hash).to_le_bytes(),
            tenant: 0,
            created_ms: v2.created_ms,
            status: v2.status,
            legacy: true,
            lease_id: v2.lease_id,
            fencing_token: v2.fencing_token,
            expires_at_ms: v2.expires_at_ms,
            lease_ttl_ms: v2.lease_ttl_ms,
        })
    }
}

/// The dedup records, oldest first, with a hash index by key.
#[derive(Clone, Default)]
pub(super) struct DedupWindow {
    records: Records,
    /// Sequence number of `records[0]`; record `i` has `front + i` (wrapping: the window is far
    /// smaller than 2³²).
    front: u32,
    /// Number of live (not Forgotten) records.
    live: usize,
    /// Sequence numbers of live records, found by key: 4 bytes a slot (plus hashbrown's
    /// control byte), 10.5 MB at 1.2 million records where slots that also kept a 32-bit hash
    /// tag took 18.9 MB. A slot's hash is its record key's, so growing through hashbrown would
    /// look up every slot's record to hash it again (1.4 s at the doubling near 917,000
    /// records, apply stalled on every replica at the same log index; a pass over the records
    /// in order still took 0.2 s). Instead a full index becomes `draining` and a new one with
    /// twice the room takes new records, and each `push` moves a few old ones across.
    index: HashTable<u32>,
    /// How many slots `index` had room for when it was made (its capacity shrinks as removals
    /// leave tombstones).
    index_room: usize,
    /// The previous index while its slots move to `index`.
    draining: Option<Draining>,
    hasher: RandomState,
    /// Times the index was rebuilt from the records (the fallback `moves_due` should avoid).
    #[cfg(test)]
    rebuilds: usize,
}

/// An index being emptied into its successor, in record order.
#[derive(Clone)]
struct Draining {
    slots: HashTable<u32>,
    /// Sequence number of the next record to move.
    next: u32,
    /// One past the last record the old index can hold.
    end: u32,
}

/// The hash of the slot `seq`: its record's key's. hashbrown asks for it only to grow a table,
/// which the window never lets it do (see `DedupWindow::index`); 0 for a slot without a record.
fn slot_hash(records: &Records, front: u32, hasher: &RandomState, seq: u32) -> u64 {
    records
        .key(seq.wrapping_sub(front) as usize)
        .map_or(0, |key| hasher.hash_one(key))
}

/// Records visited for the draining index per record pushed, at least: more when the new index
/// would otherwise fill first (see `DedupWindow::moves_due`).
const MOVES_PER_PUSH: usize = 8;

impl DedupWindow {
    /// Number of live records.
    pub(super) fn len(&self) -> usize {
        self.live
    }

    /// Number of live records whose request is still queued.
    pub(super) fn waiting(&self) -> usize {
        self.records
            .iter()
            .filter(|r| r.status() == Status::Waiting)
            .count()
    }

    /// The same records without the index, for a snapshot to encode: one pointer per chunk of
    /// records (0.15-0.3 ms at 1.2 million records), where a full clone would also copy the
    /// index (about 10 MB) while apply waits.
    pub(super) fn copy_for_encoding(&self) -> DedupWindow {
        DedupWindow {
            records: self.records.clone(),
            front: self.front,
            live: self.live,
            index: HashTable::new(),
            index_room: 0,
            draining: None,
            #[cfg(test)]
            rebuilds: 0,
            hasher: self.hasher.clone(),
        }
    }

    fn hash(&self, key: &[u8; 16]) -> u64 {
        self.hasher.hash_one(key)
    }

    fn position(&self, seq: u32) -> usize {
        seq.wrapping_sub(self.front) as usize
    }

    fn find(&self, key: RequestKey) -> Option<u32> {
        let key = key.0.to_le_bytes();
        let hash = self.hash(&key);
        let is_key = |&seq: &u32| self.records.key(self.position(seq)) == Some(key);
        self.index
            .find(hash, is_key)
            .or_else(|| self.draining.as_ref()?.slots.find(hash, is_key))
            .copied()
    }

    /// The record of `key`: what identifies it, and the state.
    pub(super) fn get(&self, key: RequestKey) -> Option<(Ident, DedupState)> {
        let record = self.records.get(self.position(self.find(key)?))?;
        Some((record.ident(), record.state()?))
    }

    /// Adds a record for a key that has none (a key that has one is left as it is); returns
    /// whether it did.
    pub(super) fn insert(&mut self, ident: Ident, created_ms: i64, state: DedupState) -> bool {
        if self.contains(ident.key) {
            return false;
        }
        self.push(Record::new(ident, created_ms, state));
        true
    }

    /// Moves `key`'s record to the back with state `state`, created at `now_ms`: a grant to a
    /// waiter is remembered for the full retention after the grant, not after the enqueue.
    pub(super) fn renew(&mut self, key: RequestKey, now_ms: i64, state: DedupState) {
        let Some((ident, _)) = self.get(key) else {
            return;
        };
        self.remove(key);
        self.push(Record::new(ident, now_ms, state));
    }

    pub(super) fn contains(&self, key: RequestKey) -> bool {
        self.find(key).is_some()
    }

    /// Appends a record and indexes it under the next sequence number.
    fn push(&mut self, record: Record) {
        self.drain(self.moves_due());
        if self.index.len() == self.index.capacity() {
            if self.draining.is_some() {
                // `moves_due` ends every drain before the new index fills; were one still
                // going, one pass over the records rebuilds a single index.
                self.rebuild_from_records();
            } else {
                self.grow_index();
            }
        }
        let hash = self.hash(&record.key);
        let seq = self
            .front
            .wrapping_add(self.records.push_back(record) as u32);
        self.live += 1;
        let (records, front, hasher) = (&self.records, self.front, &self.hasher);
        // There is room (made above), so hashbrown never calls the closure.
        self.index
            .insert_unique(hash, seq, |&s| slot_hash(records, front, hasher, s));
    }

    /// Room for the next index: twice the full one's, or the same when removals left the full
    /// one mostly tombstones (as hashbrown itself decides).
    fn next_room(&self) -> usize {
        if self.live + 1 > self.index_room / 2 {
            (self.index_room + 1).max(64)
        } else {
            self.index_room
        }
    }

    /// Starts a new index, into which the full one drains.
    fn grow_index(&mut self) {
        let index = HashTable::with_capacity(self.next_room());
        self.index_room = index.capacity();
        let old = std::mem::replace(&mut self.index, index);
        if !old.is_empty() {
            self.draining = Some(Draining {
                slots: old,
                next: self.front,
                end: self.front.wrapping_add(self.records.len() as u32),
            });
        }
    }

    /// Builds one index from the records in order (about 0.2 s at 917,000 records).
    fn rebuild_from_records(&mut self) {
        #[cfg(test)]
        {
            self.rebuilds += 1;
        }
        let mut index = HashTable::with_capacity(self.next_room().max(self.live + 1));
        let (records, front, hasher) = (&self.records, self.front, &self.hasher);
        let mut seq = front;
        for record in records.iter() {
            if record.is_live() {
                // There is room for every live record, so hashbrown never calls the closure.
                index.insert_unique(hasher.hash_one(record.key), seq, |&s| {
                    slot_hash(records, front, hasher, s)
                });
            }
            seq = seq.wrapping_add(1);
        }
        self.index_room = index.capacity().max(index.len());
        self.index = index;
        self.draining = None;
    }

    /// Sequence number of the next record the drain visits (pruning may have passed it; a
    /// window is far smaller than 2^31 records, so the wrapping difference tells).
    fn drain_cursor(&self, draining: &Draining) -> u32 {
        if (draining.next.wrapping_sub(self.front) as i32) < 0 {
            self.front
        } else {
            draining.next
        }
    }

    /// How many records the drain must visit on this push to end before the new index fills:
    /// the new index can take `spare` more pushes on top of every slot still to move.
    fn moves_due(&self) -> usize {
        let Some(draining) = &self.draining else {
            return 0;
        };
        let left = (draining.end.wrapping_sub(self.drain_cursor(draining)) as i32).max(0) as usize;
        let spare = (self.index.capacity() - self.index.len()).saturating_sub(draining.slots.len());
        MOVES_PER_PUSH.max(left.div_ceil(spare.max(1)))
    }

    /// Visits up to `moves` records in order, moving their slots from the draining index to the
    /// current one; ends the drain once every record the old index could hold was visited.
    fn drain(&mut self, moves: usize) {
        let Some(draining) = &self.draining else {
            return;
        };
        let mut next = self.drain_cursor(draining);
        let Some(draining) = &mut self.draining else {
            return;
        };
        let (records, front, hasher) = (&self.records, self.front, &self.hasher);
        for _ in 0..moves {
            if draining.slots.is_empty()
                || (draining.end.wrapping_sub(next) as i32) <= 0
                || self.index.len() == self.index.capacity()
            {
                break;
            }
            let Some(record) = records.get(next.wrapping_sub(front) as usize) else {
                break;
            };
            // A record that is not live has no slot: no need to hash it.
            if !record.is_live() {
                next = next.wrapping_add(1);
                continue;
            }
            let hash = hasher.hash_one(record.key);
            if let Ok(entry) = draining.slots.find_entry(hash, |&s| s == next) {
                entry.remove();
                // Checked above: there is room, so hashbrown never calls the closure.
                self.index
                    .insert_unique(hash, next, |&s| slot_hash(records, front, hasher, s));
            }
            next = next.wrapping_add(1);
        }
        draining.next = next;
        if draining.slots.is_empty() || (draining.end.wrapping_sub(next) as i32) <= 0 {
            // Every record the old index could hold was visited (its slots all lie between the
            // cursor and `end`: see `check`), so it is empty.
            self.draining = None;
        }
    }

    /// Marks `key`'s record, if it has one, as a wait that timed out. (A grant moves a record to
    /// the back instead, see `renew`: records are stored in creation and token order.)
    pub(super) fn time_out(&mut self, key: RequestKey) {
        if let Some(seq) = self.find(key) {
            self.records
                .set_status(self.position(seq), Status::TimedOut);
        }
    }

    /// Forgets `key`'s record: a later Acquire with the same request_id starts afresh. Returns
    /// the forgotten record's tenant tag.
    pub(super) fn remove(&mut self, key: RequestKey) -> Option<u64> {
        let seq = self.find(key)?;
        self.unindex(&key.0.to_le_bytes(), seq);
        let record = self
            .records
            .set_status(self.position(seq), Status::Forgotten)?;
        Some(record.tenant())
    }

    /// The live records in the layout of format 2 (to test loading it).
    #[cfg(test)]
    pub(super) fn to_v2(&self) -> Vec<RecordV2> {
        self.records
            .iter()
            .filter(|r| r.is_live())
            .map(RecordWire::from)
            .map(|r| RecordV2 {
                key: r.key,
                args_hash: u128::from_le_bytes(r.args) as u64,
                created_ms: r.created_ms,
                status: r.status,
                lease_id: r.lease_id,
                fencing_token: r.fencing_token,
                expires_at_ms: r.expires_at_ms,
                lease_ttl_ms: r.lease_ttl_ms,
            })
            .collect()
    }

    /// Tenant tags of the live records (for consistency checks).
    pub(super) fn tenants(&self) -> impl Iterator<Item = u64> + '_ {
        self.records
            .iter()
            .filter(|r| r.is_live())
            .map(|r| r.tenant())
    }

    /// Appends records of an older format (live ones only), oldest first.
    pub(super) fn extend_legacy(&mut self, records: Vec<RecordV2>) -> Result<(), String> {
        for record in records {
            let record = Record::from(record);
            if !record.is_live() {
                return Err("a snapshot holds live dedup records only".into());
            }
            if self.contains(RequestKey(u128::from_le_bytes(record.key))) {
                return Err("a dedup key appears twice".into());
            }
            self.push(record);
        }
        Ok(())
    }

    /// Drops the index entry of a live record, which stops counting as live.
    fn unindex(&mut self, key: &[u8; 16], seq: u32) {
        let hash = self.hash(key);
        if let Ok(entry) = self.index.find_entry(hash, |&s| s == seq) {
            entry.remove();
            self.live -= 1;
        } else if let Some(draining) = &mut self.draining
            && let Ok(entry) = draining.slots.find_entry(hash, |&s| s == seq)
        {
            entry.remove();
            self.live -= 1;
        }
    }

    /// Forgets records created at or before `horizon_ms`, calling `forgot` with each forgotten
    /// record's tenant tag. A record whose request is still queued is carried over to the back,
    /// stamped `now_ms`: forgetting it would let a retry queue twice.
    pub(super) fn prune(&mut self, horizon_ms: i64, now_ms: i64, mut forgot: impl FnMut(u64)) {
        // Bounded by the length on entry, so records carried over are not visited again even if
        // `now_ms` is itself past the horizon.
        for _ in 0..self.records.len() {
            match self.records.front() {
                Some(record) if record.created_ms() <= horizon_ms => {}
                _ => break,
            }
            let record = self.records.pop_front().expect("front exists");
            let seq = self.front;
            self.front = self.front.wrapping_add(1);
            match record.status() {
                Status::Forgotten => {}
                Status::Waiting => {
                    self.unindex(&record.key, seq);
                    // Through the wire form, which keeps the expiry absolute.
                    self.push(Record::from(RecordWire {
                        created_ms: now_ms,
                        ..RecordWire::from(record)
                    }));
                }
                Status::Granted | Status::TimedOut | Status::Held => {
                    self.unindex(&record.key, seq);
                    forgot(record.tenant());
                }
            }
        }
        // Frees a draining index that pruning emptied, even when nothing is pushed for a while.
        self.drain(0);
    }

    /// The first live record's token above `last_token`, if any (by position, and the token).
    /// The table never makes one (tokens come from its counter); a crafted snapshot or backup
    /// can, and its retries would be answered with a token the counter grants again.
    pub(super) fn token_above(&self, last_token: u64) -> Option<(usize, u64)> {
        self.records
            .iter()
            .enumerate()
            .filter(|(_, record)| record.is_live())
            .map(|(i, record)| (i, u64::from_le_bytes(record.fencing_token)))
            .find(|(_, token)| *token > last_token)
    }

    /// Checks the index against the records. O(n): for tests and snapshot loading.
    pub(super) fn check(&self) -> Result<(), String> {
        self.records.check()?;
        let mut live = 0;
        let mut last_created = i64::MIN;
        for (i, record) in self.records.iter().enumerate() {
            if record.created_ms() < last_created {
                return Err(format!("dedup record {i} is older than the one before it"));
            }
            last_created = record.created_ms();
            if !record.is_live() {
                continue;
            }
            live += 1;
            let key = RequestKey(u128::from_le_bytes(record.key));
            if self.find(key).map(|seq| self.position(seq)) != Some(i) {
                return Err(format!(
                    "dedup record {i} ({key:?}) is not indexed at its place"
                ));
            }
        }
        if let Some(d) = &self.draining {
            let next = self.drain_cursor(d);
            if let Some(seq) = d.slots.iter().find(|&&seq| {
                (seq.wrapping_sub(next) as i32) < 0 || (d.end.wrapping_sub(seq) as i32) <= 0
            }) {
                return Err(format!(
                    "the draining dedup index holds sequence number {seq}, outside {next}..{}",
                    d.end
                ));
            }
        }
        if self.index.capacity() > self.index_room {
            return Err("the dedup index grew by itself".into());
        }
        let indexed = self.index.len() + self.draining.as_ref().map_or(0, |d| d.slots.len());
        if live != indexed || live != self.live {
            return Err(format!(
                "dedup index has {indexed} entries and counts {} for {live} live records",
                self.live
            ));
        }
        Ok(())
    }
}

impl fmt::Debug for DedupWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DedupWindow")
            .field("live", &self.live)
            .field("slots", &self.records.len())
            .finish()
    }
}

/// A snapshot holds the live records, oldest first; the index is rebuilt on load.
impl Serialize for DedupWindow {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut seq = serializer.serialize_seq(Some(self.live))?;
        for record in self.records.iter().filter(Record::is_live) {
            seq.serialize_element(&record)?;
        }
        seq.end()
    }
}

impl<'de> Deserialize<'de> for DedupWindow {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Records;
        impl<'de> Visitor<'de> for Records {
            type Value = DedupWindow;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a sequence of dedup records")
            }

            // Straight into the window: no intermediate Vec of a million records.
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<DedupWindow, A::Error> {
                let mut window = DedupWindow::default();
                while let Some(record) = seq.next_element::<Record>()? {
                    if !record.is_live() {
                        return Err(serde::de::Error::custom(
                            "a snapshot holds live dedup records only",
                        ));
                    }
                    window.push(record);
                }
                Ok(window)
            }
        }
        deserializer.deserialize_seq(Records)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(token: u64) -> Grant {
        Grant {
            lease_id: LeaseId(u128::MAX - token as u128),
            fencing_token: FencingToken(token),
            expires_at_ms: 1_000 + token as i64,
            lease_ttl_ms: 30_000,
        }
    }

    fn id(key: RequestKey, args: u64) -> Ident {
        Ident {
            key,
            args: u128::from(args),
            tenant: 1,
            legacy: false,
        }
    }

    /// The record's argument digest (as the u64 the tests use) and state.
    fn get(w: &DedupWindow, key: RequestKey) -> Option<(u64, DedupState)> {
        w.get(key).map(|(ident, state)| (ident.args as u64, state))
    }

    fn wire(status: Status, created_ms: i64, expires_at_ms: i64, ttl: u32) -> RecordWire {
        RecordWire {
            key: [7; 16],
            args: [9; 16],
            tenant: u64::MAX - 3,
            created_ms,
            status,
            legacy: status == Status::Held,
            lease_id: [0xab; 16],
            fencing_token: u64::MAX - 1,
            expires_at_ms,
            lease_ttl_ms: ttl,
        }
    }

    #[test]
    fn the_compact_record_keeps_every_field_the_table_can_produce() {
        let created = 1_764_000_000_000;
        for status in Status::ALL {
            for legacy in [false, true] {
                for (expires, ttl) in [
                    (0, 0),
                    (created + 30_000, 30_000),
                    (created + 300_000, 300_000),
                    // A waiter granted by an older lockd: created at the enqueue.
                    (created + 600_000, 1),
                    (created - 5, 10),
                ] {
                    let w = RecordWire {
                        legacy,
                        ..wire(status, created, expires, ttl)
                    };
                    if (w.expires_at_ms - w.created_ms).abs() > i64::from(i32::MAX) {
                        continue;
                    }
                    assert_eq!(RecordWire::from(Record::from(w)), w);
                }
            }
        }
        // Extremes of the clock.
        for created in [i64::MIN, -1, 0, i64::MAX] {
            let w = wire(Status::Granted, created, created.saturating_add(1), 1);
            assert_eq!(RecordWire::from(Record::from(w)), w);
        }
    }

    #[test]
    fn values_beyond_the_compact_ranges_are_clamped_alike_everywhere() {
        let created = 1_000_000_000_000;
        let r = RecordWire::from(Record::from(wire(
            Status::Granted,
            created,
            created + (1 << 40),
            u32::MAX,
        )));
        assert_eq!(r.expires_at_ms, created + i64::from(i32::MAX));
        assert_eq!(r.lease_ttl_ms, TTL_MAX);
        assert_eq!(r.status, Status::Granted);
        let r = RecordWire::from(Record::from(wire(
            Status::Granted,
            created,
            1 - (1 << 40),
            5,
        )));
        assert_eq!(r.expires_at_ms, created + i64::from(EXPIRES_ZERO) + 1);
    }

    #[test]
    fn a_snapshot_encodes_records_as_the_wire_layout() {
        let w = wire(
            Status::Granted,
            1_764_000_000_000,
            1_764_000_030_000,
            30_000,
        );
        assert_eq!(
            postcard::to_allocvec(&Record::from(w)).unwrap(),
            postcard::to_allocvec(&w).unwrap()
        );
        let back: Record = postcard::from_bytes(&postcard::to_allocvec(&w).unwrap()).unwrap();
        assert_eq!(RecordWire::from(back), w);
    }

    #[test]
    fn a_waiting_record_carried_over_keeps_its_expiry() {
        let mut w = DedupWindow::default();
        let key = RequestKey::of("carried");
        w.insert(id(key, 1), 100, DedupState::Waiting);
        w.prune(100, 5_000, |_| {});
        assert_eq!(get(&w, key), Some((1, DedupState::Waiting)));
        let record = w.records.back().unwrap();
        assert_eq!(record.created_ms(), 5_000);
        assert_eq!(record.expires_at_ms(), 0);
        w.check().unwrap();
    }

    #[test]
    fn records_round_trip_their_state() {
        let mut w = DedupWindow::default();
        let (a, b, c) = (
            RequestKey::of("a"),
            RequestKey::of("b"),
            RequestKey::of("c"),
        );
        w.insert(id(a, 1), 10, DedupState::Granted(grant(7)));
        w.insert(id(b, 2), 11, DedupState::Waiting);
        w.insert(id(c, 3), 12, DedupState::TimedOut);
        assert_eq!(get(&w, a), Some((1, DedupState::Granted(grant(7)))));
        assert_eq!(get(&w, b), Some((2, DedupState::Waiting)));
        assert_eq!(get(&w, c), Some((3, DedupState::TimedOut)));
        assert_eq!(get(&w, RequestKey::of("d")), None);

        w.renew(b, 13, DedupState::Granted(grant(8)));
        w.time_out(a);
        w.remove(c);
        assert_eq!(get(&w, a), Some((1, DedupState::TimedOut)));
        assert_eq!(get(&w, b), Some((2, DedupState::Granted(grant(8)))));
        assert_eq!(get(&w, c), None);
        assert_eq!(w.len(), 2);
        w.check().unwrap();

        // A forgotten key can be used again.
        w.insert(id(c, 4), 14, DedupState::Waiting);
        assert_eq!(get(&w, c), Some((4, DedupState::Waiting)));
        w.check().unwrap();
    }

    #[test]
    fn prune_forgets_old_records_but_carries_waiting_ones_over() {
        let mut w = DedupWindow::default();
        for i in 0..100 {
            let state = if i % 10 == 0 {
                DedupState::Waiting
            } else {
                DedupState::TimedOut
            };
            w.insert(id(RequestKey::of(&i.to_string()), i), i as i64, state);
        }
        w.prune(49, 500, |_| {});
        w.check().unwrap();
        // 50..100 stay; of 0..50, the five waiting ones are carried over.
        assert_eq!(w.len(), 55);
        assert_eq!(
            get(&w, RequestKey::of("10")),
            Some((10, DedupState::Waiting))
        );
        assert_eq!(get(&w, RequestKey::of("11")), None);
        assert_eq!(
            get(&w, RequestKey::of("51")),
            Some((51, DedupState::TimedOut))
        );

        // Everything is past the horizon, and so is the carry-over stamp: prune still ends.
        w.prune(1_000, 1_000, |_| {});
        w.check().unwrap();
        assert_eq!(w.len(), 10);
        w.prune(1_000, 2_000, |_| {});
        assert_eq!(w.len(), 10);
    }

    #[test]
    fn snapshots_keep_live_records_in_order_and_rebuild_the_index() {
        let mut w = DedupWindow::default();
        for i in 0..1_000u64 {
            w.insert(
                id(RequestKey::of(&i.to_string()), i),
                i as i64,
                DedupState::Granted(grant(i)),
            );
        }
        for i in (0..1_000u64).step_by(3) {
            w.remove(RequestKey::of(&i.to_string()));
        }
        w.prune(99, 1_000, |_| {});
        let copy: DedupWindow = postcard::from_bytes(&postcard::to_allocvec(&w).unwrap()).unwrap();
        copy.check().unwrap();
        assert_eq!(copy.len(), w.len());
        for i in 0..1_000u64 {
            let key = RequestKey::of(&i.to_string());
            assert_eq!(get(&copy, key), get(&w, key), "record {i}");
        }
        assert!(copy.records.iter().all(|r| r.is_live()));
    }

    /// A window whose storage keeps creation times aside (a gap in time) and tokens (tokens far
    /// apart) encodes exactly the live records, in order, as the wire layout always did, and
    /// loads back to the same bytes.
    #[test]
    fn a_window_with_values_kept_aside_encodes_its_live_records_as_before() {
        let mut w = DedupWindow::default();
        let mut expected = Vec::new();
        for i in 0..1_000u64 {
            let created = i as i64 * 1_000 + if i > 500 { 100_000 } else { 0 };
            let state = if i % 7 == 0 {
                DedupState::Waiting
            } else {
                DedupState::Granted(grant(1 + i * 40_000))
            };
            let ident = id(RequestKey::of(&i.to_string()), i);
            w.insert(ident, created, state);
            if i % 3 == 0 {
                w.remove(ident.key);
            } else {
                expected.push(RecordWire::from(Record::new(ident, created, state)));
            }
        }
        let (times, tokens) = w.records.far_values();
        assert!(
            times > 0 && tokens > 0,
            "{times} times and {tokens} tokens aside"
        );
        let bytes = postcard::to_allocvec(&w).unwrap();
        assert_eq!(bytes, postcard::to_allocvec(&expected).unwrap());
        let copy: DedupWindow = postcard::from_bytes(&bytes).unwrap();
        copy.check().unwrap();
        assert_eq!(postcard::to_allocvec(&copy).unwrap(), bytes);
    }

    /// Random operations on a window against a map of what must be found, with `check` (which
    /// also fails if hashbrown grew an index by itself, the stall the drain avoids) at every
    /// step while a drain is in progress. `removals` in 20 of the operations remove a record
    /// (or grant a waiting one, which moves it to the back); `waiting` of every 10 records
    /// wait, so pruning carries them over.
    ///
    /// With `gaps`, the clock jumps by 70 s now and then, so the records after a jump keep their
    /// creation times aside (see `records`).
    fn churn(front: u32, steps: u64, removals: u64, waiting: u64, gaps: bool) {
        let mut w = DedupWindow {
            front,
            ..DedupWindow::default()
        };
        // Key number -> (argument digest, state, created).
        let mut model: std::collections::BTreeMap<u64, (u64, DedupState, i64)> = Default::default();
        let mut gone: Vec<u64> = Vec::new();
        let mut rng = 0x2545_f491_4f6c_dd1d_u64 ^ steps ^ (removals << 8) ^ (waiting << 16);
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let key = |k: u64| RequestKey::of(&k.to_string());
        let (mut drained, mut wrapped_while_draining, mut far_times) = (0, false, 0);
        // The clock at each step so far.
        let mut clock: Vec<i64> = Vec::new();
        for step in 0..steps {
            let jump = if gaps && next() % 1_500 == 0 {
                70_000
            } else {
                1
            };
            let now = clock.last().map_or(0, |last| last + jump);
            clock.push(now);
            let roll = next() % 20;
            if roll < removals {
                let pick = next();
                if pick % 4 == 0 && !model.is_empty() {
                    // Grant a waiting record: it moves to the back.
                    if let Some((&k, &(args, ..))) = model
                        .iter()
                        .find(|(_, (_, state, _))| *state == DedupState::Waiting)
                    {
                        w.renew(key(k), now, DedupState::Granted(grant(k)));
                        model.insert(k, (args, DedupState::Granted(grant(k)), now));
                    }
                } else if let Some((&k, _)) = model.range(pick % (step + 1_000_000)..).next() {
                    w.remove(key(k));
                    model.remove(&k);
                    gone.push(k);
                }
            } else if roll == 19 {
                // Forget what is older than a sliding horizon, now and then far ahead (past
                // the drain's cursor); waiting records are carried over.
                let lag: usize = if w.draining.is_some() && next() % 20 == 0 {
                    500
                } else {
                    15_000
                };
                let horizon = clock[(step as usize).saturating_sub(lag)];
                w.prune(horizon, now, |_| {});
                for (_, state, created) in model.values_mut() {
                    if *state == DedupState::Waiting && *created <= horizon {
                        *created = now;
                    }
                }
                model.retain(|_, (_, _, created)| *created > horizon);
            } else if roll == 18 && !gone.is_empty() {
                // A removed key comes back while its forgotten record may still be ahead of
                // the drain's cursor.
                let k = gone.swap_remove((next() % gone.len() as u64) as usize);
                if let std::collections::btree_map::Entry::Vacant(slot) = model.entry(k) {
                    w.insert(id(key(k), k + 1), now, DedupState::TimedOut);
                    slot.insert((k + 1, DedupState::TimedOut, now));
                }
            } else {
                let state = if next() % 10 < waiting {
                    DedupState::Waiting
                } else {
                    DedupState::TimedOut
                };
                w.insert(id(key(step + 1_000_000), step), now, state);
                model.insert(step + 1_000_000, (step, state, now));
            }
            far_times = far_times.max(w.records.far_values().0);
            if let Some(d) = &w.draining {
                drained += 1;
                // The records the drain covers span the wrap of sequence numbers.
                wrapped_while_draining |= w.front > d.end;
            }
            assert_eq!(w.len(), model.len(), "step {step}");
            if step % 997 == 0 || w.draining.is_some() && step % 5 == 0 {
                w.check().unwrap_or_else(|e| panic!("step {step}: {e}"));
                for (&k, &(args, state, _)) in model.iter().step_by(7) {
                    assert_eq!(
                        get(&w, key(k)),
                        Some((args, state)),
                        "step {step}, record {k}"
                    );
                }
                for &k in gone.iter().rev().take(20) {
                    if !model.contains_key(&k) {
                        assert_eq!(get(&w, key(k)), None, "step {step}, removed {k}");
                    }
                }
            }
            if w.draining.is_some() && step % 3_001 == 0 {
                // The fallback: one index rebuilt from the records in the middle of a drain.
                let mut rebuilt = w.clone();
                rebuilt.rebuild_from_records();
                assert!(rebuilt.draining.is_none());
                rebuilt.check().unwrap();
                for (&k, &(args, state, _)) in model.iter().step_by(13) {
                    assert_eq!(
                        get(&rebuilt, key(k)),
                        Some((args, state)),
                        "rebuilt, record {k}"
                    );
                }
                rebuilt.insert(id(key(u64::MAX - step), 1), now, DedupState::Held);
                rebuilt.check().unwrap();
            }
            if w.draining.is_some() && step % 1_001 == 0 {
                // A snapshot taken mid-drain loads into a consistent window, and a clone goes
                // on where the original left off.
                let copy: DedupWindow =
                    postcard::from_bytes(&postcard::to_allocvec(&w.copy_for_encoding()).unwrap())
                        .unwrap();
                copy.check().unwrap();
                assert_eq!(copy.len(), w.len());
                let mut clone = w.clone();
                clone.insert(id(key(u64::MAX - step), 1), now, DedupState::Held);
                clone.check().unwrap();
            }
        }
        assert!(drained > 500, "the index drained for only {drained} steps");
        if gaps {
            // The count varies from run to run (990 to 1,484 in nine runs on 2026-12-05; CI failed
            // once at 990 against a bound of 1,000): the bound says "many", with room below.
            assert!(
                far_times > 500,
                "only {far_times} creation times were kept aside"
            );
        }
        assert_eq!(
            w.rebuilds, 0,
            "a drain did not end before the new index filled"
        );
        if front > u32::MAX - 100_000 {
            assert!(
                wrapped_while_draining,
                "no drain crossed the wrap of sequence numbers"
            );
        }
        w.check().unwrap();
    }

    #[test]
    fn the_index_grows_without_losing_a_record() {
        // Mostly inserts: the window fills through several doublings, across the wrap.
        churn(u32::MAX - 3_000, 40_000, 4, 1, false);
    }

    #[test]
    fn records_after_gaps_in_time_stay_findable() {
        // The clock jumps past a storage chunk's span now and then: the records after the jump
        // keep their creation times aside, across the wrap of sequence numbers.
        churn(u32::MAX - 3_000, 40_000, 4, 1, true);
    }

    #[test]
    fn the_index_grows_in_time_when_most_records_are_forgotten() {
        // Nearly as many removals (or grants) as inserts: several records for each live one,
        // so a drain has many records to visit for each slot it moves.
        churn(0, 60_000, 8, 5, false);
    }

    /// Twenty records for each live one when the index fills: the drain has to visit them all
    /// before the new index fills, so it moves more than `MOVES_PER_PUSH` records a push.
    #[test]
    fn a_drain_over_mostly_forgotten_records_ends_in_time() {
        let mut w = DedupWindow::default();
        let key = |k: u64| RequestKey::of(&k.to_string());
        for k in 0..40_000u64 {
            w.insert(id(key(k), k), 0, DedupState::TimedOut);
            if k % 20 != 0 {
                w.remove(key(k));
            }
        }
        let mut drains = 0;
        for k in 40_000..60_000u64 {
            let was_draining = w.draining.is_some();
            w.insert(id(key(k), k), 0, DedupState::TimedOut);
            if w.draining.is_some() {
                if !was_draining {
                    drains += 1;
                }
                if k % 97 == 0 {
                    w.check().unwrap();
                }
            }
        }
        assert!(drains >= 2, "{drains} drains");
        assert_eq!(
            w.rebuilds, 0,
            "a drain did not end before the new index filled"
        );
        w.check().unwrap();
        for k in (0..60_000u64).filter(|k| *k >= 40_000 || k % 20 == 0) {
            assert_eq!(
                get(&w, key(k)),
                Some((k, DedupState::TimedOut)),
                "record {k}"
            );
        }
    }

    #[test]
    fn sequence_numbers_wrap() {
        let mut w = DedupWindow {
            front: u32::MAX - 5,
            ..DedupWindow::default()
        };
        for i in 0..20u64 {
            w.insert(
                id(RequestKey::of(&i.to_string()), i),
                i as i64,
                DedupState::TimedOut,
            );
        }
        w.prune(9, 20, |_| {});
        w.check().unwrap();
        assert_eq!(w.len(), 10);
        assert_eq!(
            get(&w, RequestKey::of("15")),
            Some((15, DedupState::TimedOut))
        );
    }
}
