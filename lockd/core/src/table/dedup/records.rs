//! The window's records in creation order, in chunks that share a time base and a token base.
//!
//! A record is 79 bytes as a value ([`Record`]). Stored, its creation time and its fencing token
//! are kept as 2-byte offsets from bases its chunk keeps: 67 bytes a record ([`Slot`]). The
//! offsets of neighbours are small because records are created in time order and, since every
//! grant creates one record at once, in token order: the 244 records of a chunk span at most 244
//! tokens.
//!
//! - **Time.** A record created 65.5 s or more after the chunk's first (or before it, which only
//!   a snapshot written by hand can hold) starts the next chunk, and the rest of the chunk before
//!   is filled with removed records. So every chunk but the last has exactly [`CHUNK_SLOTS`]
//!   slots and a record's chunk is found by a division. This happens at most once per 65.5 s of
//!   the retention, whatever clients do.
//! - **Token.** The base is set 32,767 below the chunk's first token, so tokens up to 32,767 below
//!   and 32,766 above it fit. A token outside (a snapshot written before lockd granted waiters at
//!   the back of the window holds waiters granted in place: their records sit at the enqueue,
//!   with a token issued up to minutes of grants later) is kept whole in a side map by slot,
//!   never by closing the chunk: such records can alternate with ordinary ones, and closing
//!   chunks for them would take a 16 KiB chunk per record.
//!
//! No value is clamped here: what goes in comes out.
//!
//! A chunk and the `Arc` around it take exactly 16,384 bytes, one mimalloc size class: 67.1 bytes
//! a record, where the 79-byte records in an `imbl` vector took 80 (64 of them in a 5,120-byte
//! block), about 15 MB less for the 1.2 million records of a full window. Cloning for a snapshot
//! copies the chunk pointers (about 5,000 for a full window, 0.2 ms) and the side map (O(1),
//! persistent); a later write to a chunk the snapshot still shares copies that chunk alone.

use std::collections::VecDeque;
use std::sync::Arc;

use imbl::OrdMap;

use super::{Record, Status};

/// Records per chunk: the most for which a chunk and its `Arc` fit in 16,384 bytes.
pub(super) const CHUNK_SLOTS: usize = 244;

/// `token_after` of a record whose token is 0 (it holds no grant).
const NO_TOKEN: u16 = u16::MAX;
/// `token_after` of a record whose token is in `Records::far_tokens`.
const FAR_TOKEN: u16 = u16::MAX - 1;
/// How far below a chunk's first token its base is.
const TOKEN_BACK: u64 = 32_767;

/// A stored record: [`Record`] with its creation time and token relative to its chunk.
#[derive(Clone, Copy)]
struct Slot {
    key: [u8; 16],
    args: [u8; 16],
    lease_id: [u8; 16],
    tenant: [u8; 8],
    expires_after: [u8; 4],
    ttl_status: [u8; 3],
    /// Creation time, ms after the chunk's `created_base`.
    created_after: [u8; 2],
    /// Fencing token minus the chunk's `token_base`; `NO_TOKEN` for a token of 0, `FAR_TOKEN`
    /// for one kept in `Records::far_tokens`.
    token_after: [u8; 2],
}

impl Slot {
    const EMPTY: Slot = Slot {
        key: [0; 16],
        args: [0; 16],
        lease_id: [0; 16],
        tenant: [0; 8],
        expires_after: [0; 4],
        ttl_status: [0; 3],
        created_after: [0; 2],
        token_after: NO_TOKEN.to_le_bytes(),
    };
}

#[derive(Clone)]
struct Chunk {
    /// Creation time of the chunk's first record.
    created_base: i64,
    /// `TOKEN_BACK` below the token of the chunk's first record with a token.
    token_base: u64,
    /// Whether `token_base` is set.
    has_token_base: bool,
    /// Slots in use, fillers included.
    len: u8,
    slots: [Slot; CHUNK_SLOTS],
}

const _: () = assert!(
    std::mem::size_of::<Chunk>() + 2 * std::mem::size_of::<usize>() <= 16_384,
    "a chunk and its Arc counts must fit mimalloc's 16,384-byte size class"
);
const _: () = assert!(CHUNK_SLOTS < u8::MAX as usize);

impl Chunk {
    fn empty() -> Chunk {
        Chunk {
            created_base: 0,
            token_base: 0,
            has_token_base: false,
            len: 0,
            slots: [Slot::EMPTY; CHUNK_SLOTS],
        }
    }

    fn is_full(&self) -> bool {
        usize::from(self.len) == CHUNK_SLOTS
    }

    /// Appends `record` if there is room and its time fits; an empty chunk takes any record.
    /// Returns whether it did, and whether its token is to be kept aside (`FAR_TOKEN`).
    fn try_push(&mut self, record: &Record) -> Option<bool> {
        if self.is_full() {
            return None;
        }
        let created = record.created_ms();
        let created_base = if self.len == 0 {
            created
        } else {
            self.created_base
        };
        let created_after = u16::try_from(i128::from(created) - i128::from(created_base)).ok()?;
        self.created_base = created_base;
        let token = u64::from_le_bytes(record.fencing_token);
        if token != 0 && !self.has_token_base {
            self.token_base = token.saturating_sub(TOKEN_BACK);
            self.has_token_base = true;
        }
        let token_after = if token == 0 {
            NO_TOKEN
        } else {
            token
                .checked_sub(self.token_base)
                .and_then(|after| u16::try_from(after).ok())
                .filter(|&after| after < FAR_TOKEN)
                .unwrap_or(FAR_TOKEN)
        };
        self.slots[usize::from(self.len)] = Slot {
            key: record.key,
            args: record.args,
            lease_id: record.lease_id,
            tenant: record.tenant,
            expires_after: record.expires_after,
            ttl_status: record.ttl_status,
            created_after: created_after.to_le_bytes(),
            token_after: token_after.to_le_bytes(),
        };
        self.len += 1;
        Some(token_after == FAR_TOKEN)
    }

    /// Fills the unused slots with removed records created with the last one, so that the
    /// chunk is full; returns how many. The chunk holds at least one record.
    fn fill(&mut self) -> usize {
        let used = usize::from(self.len);
        let filler = Record::from(super::RecordWire {
            key: [0; 16],
            args: [0; 16],
            tenant: 0,
            created_ms: 0,
            status: Status::Forgotten,
            legacy: false,
            lease_id: [0; 16],
            fencing_token: 0,
            expires_at_ms: 0,
            lease_ttl_ms: 0,
        });
        let slot = Slot {
            ttl_status: filler.ttl_status,
            expires_after: filler.expires_after,
            created_after: self.slots[used.saturating_sub(1)].created_after,
            ..Slot::EMPTY
        };
        self.slots[used..].fill(slot);
        self.len = CHUNK_SLOTS as u8;
        CHUNK_SLOTS - used
    }

    /// The record in slot `at`; `far` gives a token kept aside.
    fn record(&self, at: usize, far: impl FnOnce() -> u64) -> Record {
        let slot = &self.slots[at];
        // Exact: each offset was taken from the value it gives back, so neither sum overflows.
        let created = self
            .created_base
            .wrapping_add(i64::from(u16::from_le_bytes(slot.created_after)));
        let token = match u16::from_le_bytes(slot.token_after) {
            NO_TOKEN => 0,
            FAR_TOKEN => far(),
            after => self.token_base.wrapping_add(u64::from(after)),
        };
        Record {
            key: slot.key,
            args: slot.args,
            lease_id: slot.lease_id,
            tenant: slot.tenant,
            created_ms: created.to_le_bytes(),
            fencing_token: token.to_le_bytes(),
            expires_after: slot.expires_after,
            ttl_status: slot.ttl_status,
        }
    }
}

/// The records, oldest first: a deque of shared chunks.
#[derive(Clone, Default)]
pub(super) struct Records {
    chunks: VecDeque<Arc<Chunk>>,
    /// Slots of the front chunk already popped.
    head: usize,
    /// Slots from `head` on, fillers included.
    len: usize,
    /// Slots popped since the deque was made: slot `i` from the front is number `popped + i`.
    popped: u64,
    /// The tokens that did not fit their chunk's base, by slot number.
    far_tokens: OrdMap<u64, u64>,
    /// Chunks closed early (for tests that must exercise it).
    #[cfg(test)]
    pub(super) closed_early: usize,
}

impl Records {
    /// Slots in use, fillers (removed records) included.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The chunk and slot of position `i`.
    fn locate(&self, i: usize) -> Option<(usize, usize)> {
        (i < self.len).then(|| {
            let at = self.head + i;
            (at / CHUNK_SLOTS, at % CHUNK_SLOTS)
        })
    }

    pub(super) fn get(&self, i: usize) -> Option<Record> {
        let (chunk, at) = self.locate(i)?;
        Some(self.chunks[chunk].record(at, || self.far_token(i)))
    }

    fn far_token(&self, i: usize) -> u64 {
        let number = self.popped.wrapping_add(i as u64);
        // Every FAR_TOKEN slot has its entry (see `push_back` and `pop_front`).
        self.far_tokens.get(&number).copied().unwrap_or(0)
    }

    /// The key of the record at `i`, without decoding the rest.
    pub(super) fn key(&self, i: usize) -> Option<[u8; 16]> {
        let (chunk, at) = self.locate(i)?;
        Some(self.chunks[chunk].slots[at].key)
    }

    pub(super) fn front(&self) -> Option<Record> {
        self.get(0)
    }

    #[cfg(test)]
    pub(super) fn back(&self) -> Option<Record> {
        self.get(self.len.checked_sub(1)?)
    }

    /// Appends `record`; returns its position (after any fillers that closed the last chunk).
    pub(super) fn push_back(&mut self, record: Record) -> usize {
        if let Some(back) = self.chunks.back_mut()
            && !back.is_full()
        {
            let chunk = Arc::make_mut(back);
            if let Some(far) = chunk.try_push(&record) {
                return self.pushed(&record, far);
            }
            self.len += chunk.fill();
            #[cfg(test)]
            {
                self.closed_early += 1;
            }
        }
        let mut chunk = Chunk::empty();
        // An empty chunk takes any record.
        let far = chunk.try_push(&record).unwrap_or(false);
        self.chunks.push_back(Arc::new(chunk));
        self.pushed(&record, far)
    }

    /// Counts a record just stored in the last slot; returns its position.
    fn pushed(&mut self, record: &Record, far: bool) -> usize {
        let at = self.len;
        self.len += 1;
        if far {
            self.far_tokens.insert(
                self.popped.wrapping_add(at as u64),
                u64::from_le_bytes(record.fencing_token),
            );
        }
        at
    }

    pub(super) fn pop_front(&mut self) -> Option<Record> {
        let record = self.front()?;
        if !self.far_tokens.is_empty() {
            self.far_tokens.remove(&self.popped);
        }
        self.popped = self.popped.wrapping_add(1);
        self.head += 1;
        self.len -= 1;
        if self.len == 0 {
            self.chunks.clear();
            self.head = 0;
        } else if self.head == CHUNK_SLOTS {
            self.chunks.pop_front();
            self.head = 0;
        }
        Some(record)
    }

    /// Sets the status of the record at `i` (creation time and token are unchanged, so it
    /// stays in its slot); returns the record as changed.
    pub(super) fn set_status(&mut self, i: usize, status: Status) -> Option<Record> {
        let mut record = self.get(i)?;
        let (chunk, at) = self.locate(i)?;
        let chunk = Arc::make_mut(&mut self.chunks[chunk]);
        record.set_status(status);
        chunk.slots[at].ttl_status = record.ttl_status;
        Some(record)
    }

    /// Every slot in order, fillers included.
    pub(super) fn iter(&self) -> impl Iterator<Item = Record> + '_ {
        self.chunks.iter().enumerate().flat_map(move |(c, chunk)| {
            let first = if c == 0 { self.head } else { 0 };
            (first..usize::from(chunk.len)).map(move |at| {
                chunk.record(at, || self.far_token(c * CHUNK_SLOTS + at - self.head))
            })
        })
    }

    /// Tokens kept aside (for tests of the bound).
    #[cfg(test)]
    fn far_tokens(&self) -> usize {
        self.far_tokens.len()
    }
}

#[cfg(test)]
mod tests {
    use super::super::RecordWire;
    use super::*;
    use proptest::prelude::*;

    fn record(created_ms: i64, token: u64, status: Status, n: u8) -> Record {
        Record::from(RecordWire {
            key: [n; 16],
            args: [n.wrapping_add(1); 16],
            tenant: u64::from(n) << 3,
            created_ms,
            status,
            legacy: n.is_multiple_of(5),
            lease_id: [n.wrapping_add(2); 16],
            fencing_token: token,
            expires_at_ms: if token == 0 {
                0
            } else {
                created_ms.saturating_add(30_000)
            },
            lease_ttl_ms: 30_000,
        })
    }

    #[test]
    fn a_slot_is_67_bytes_and_a_chunk_fits_16384() {
        assert_eq!(std::mem::size_of::<Slot>(), 67);
        assert_eq!(std::mem::align_of::<Slot>(), 1);
        // The chunk and the two counts of its `Arc`.
        assert_eq!(std::mem::size_of::<Chunk>() + 16, 16_384);
    }

    #[test]
    fn neighbours_share_a_chunk_and_outliers_start_the_next() {
        let mut r = Records::default();
        let base = 1_764_000_000_000;
        for i in 0..CHUNK_SLOTS as i64 {
            assert_eq!(
                r.push_back(record(base + i, 1_000 + i as u64, Status::Granted, 1)),
                i as usize
            );
        }
        assert_eq!(r.chunks.len(), 1);
        // Full: the next starts a chunk without fillers.
        assert_eq!(
            r.push_back(record(base + 100, 2_000, Status::Granted, 2)),
            CHUNK_SLOTS
        );
        // 65,535 ms after the chunk's first still fits; 65,536 does not.
        assert_eq!(
            r.push_back(record(base + 100 + 65_535, 0, Status::Waiting, 3)),
            CHUNK_SLOTS + 1
        );
        let at = r.push_back(record(base + 100 + 65_536, 0, Status::Waiting, 4));
        assert_eq!(at, 2 * CHUNK_SLOTS);
        assert_eq!(r.chunks.len(), 3);
        // The fillers are removed records created with the record before them.
        let filler = r.get(CHUNK_SLOTS + 2).unwrap();
        assert_eq!(filler.status(), Status::Forgotten);
        assert_eq!(filler.created_ms(), base + 100 + 65_535);
        // Tokens: from 32,767 below the chunk's first to 32,766 above it in the slot, farther
        // ones aside; neither closes the chunk.
        let at = r.push_back(record(base + 200_000, 100_000, Status::Granted, 5));
        assert_eq!(at, 3 * CHUNK_SLOTS);
        for (n, token) in [
            100_000 - 32_767,
            100_000 + 32_766,
            100_000 - 32_768,
            100_000 + 32_767,
            1,
            u64::MAX,
        ]
        .into_iter()
        .enumerate()
        {
            let pushed = record(base + 200_000, token, Status::Granted, 6 + n as u8);
            assert_eq!(r.push_back(pushed), at + 1 + n, "token {token}");
            assert_eq!(
                r.get(at + 1 + n).map(RecordWire::from),
                Some(RecordWire::from(pushed))
            );
        }
        assert_eq!(r.chunks.len(), 4);
        assert_eq!(r.far_tokens(), 4);
        // A chunk whose first record has no token takes its base from the first that has.
        let at = r.push_back(record(base + 300_000, 0, Status::Held, 20));
        assert_eq!(
            r.push_back(record(base + 300_000, u64::MAX, Status::Granted, 21)),
            at + 1
        );
        assert_eq!(r.get(at + 1).unwrap().fencing_token, u64::MAX.to_le_bytes());
        assert_eq!(r.far_tokens(), 4);
        // Time that goes back starts a chunk too (only a hand-made snapshot can hold it).
        assert_eq!(
            r.push_back(record(base, 0, Status::Held, 22)),
            5 * CHUNK_SLOTS
        );
        // Popping drops the tokens kept aside with their records.
        while r.len() > 2 {
            r.pop_front();
        }
        assert_eq!(r.far_tokens(), 0);
        assert_eq!(r.back().unwrap().created_ms(), base);
    }

    /// A window written before waiters were granted at the back: a waiter's record sits at its
    /// enqueue, holding a token issued many grants later, between ordinary grants. Loading it
    /// must not take a chunk per record (a replica could not load such a snapshot at all).
    #[test]
    fn waiters_granted_in_place_by_an_older_lockd_take_no_chunk_of_their_own() {
        let mut r = Records::default();
        let mut records = Vec::new();
        for n in 0..100_000u64 {
            // Every other record a waiter granted 100,000 to 1,000,000 grants after its enqueue.
            let token = if n % 2 == 0 {
                1_000 + n
            } else {
                1_000 + n + 100_000 + (n * 7_919) % 900_000
            };
            records.push(record(
                1_764_000_000_000 + n as i64 / 2,
                token,
                Status::Granted,
                n as u8,
            ));
        }
        for (n, one) in records.iter().enumerate() {
            assert_eq!(r.push_back(*one), n);
        }
        assert!(
            r.chunks.len() <= 100_000 / CHUNK_SLOTS + 1,
            "{} chunks",
            r.chunks.len()
        );
        assert_eq!(r.far_tokens(), 50_000);
        for (n, got) in r.iter().enumerate() {
            assert_eq!(
                RecordWire::from(got),
                RecordWire::from(records[n]),
                "record {n}"
            );
        }
        let copy = r.clone();
        for (n, want) in records.iter().enumerate() {
            let got = r.pop_front().unwrap();
            assert_eq!(RecordWire::from(got), RecordWire::from(*want), "record {n}");
        }
        assert_eq!(r.far_tokens(), 0);
        assert_eq!(copy.far_tokens(), 50_000);
        assert_eq!(
            copy.get(99_999).map(RecordWire::from),
            Some(RecordWire::from(records[99_999]))
        );
    }

    /// Extremes at non-zero offsets within one chunk.
    #[test]
    fn extremes_at_the_far_end_of_a_chunk_come_back_exactly() {
        for (created, token) in [
            (i64::MAX - 65_535, u64::MAX - 32_765),
            (i64::MIN, 32_768),
            (-32_768, u64::MAX - 40_000),
        ] {
            let mut r = Records::default();
            let first = record(created, token, Status::Granted, 1);
            let last = record(
                created.saturating_add(65_535),
                token.saturating_add(32_766),
                Status::Granted,
                2,
            );
            let below = record(
                created.saturating_add(65_535),
                token - 32_767,
                Status::Granted,
                3,
            );
            for one in [first, last, below] {
                r.push_back(one);
            }
            assert_eq!(r.chunks.len(), 1);
            assert_eq!(r.far_tokens(), 0);
            let got: Vec<RecordWire> = r.iter().map(RecordWire::from).collect();
            let want: Vec<RecordWire> = [first, last, below]
                .into_iter()
                .map(RecordWire::from)
                .collect();
            assert_eq!(got, want);
        }
    }

    #[test]
    fn extreme_values_come_back_exactly() {
        for created in [i64::MIN, -1, 0, 1, i64::MAX] {
            for token in [0, 1, u64::MAX - 1, u64::MAX] {
                let mut r = Records::default();
                let one = record(created, token, Status::Granted, 3);
                r.push_back(one);
                assert_eq!(RecordWire::from(r.get(0).unwrap()), RecordWire::from(one));
            }
        }
    }

    #[test]
    fn a_clone_keeps_its_records_while_the_original_changes() {
        let mut r = Records::default();
        for i in 0..150 {
            r.push_back(record(i, 1 + i as u64, Status::Granted, i as u8));
        }
        let copy = r.clone();
        r.set_status(70, Status::Forgotten);
        r.pop_front();
        r.push_back(record(500, 900, Status::Granted, 200));
        assert_eq!(copy.len(), 150);
        assert_eq!(copy.get(70).unwrap().status(), Status::Granted);
        assert_eq!(copy.front().unwrap().created_ms(), 0);
        assert_eq!(r.get(69).unwrap().status(), Status::Forgotten);
        assert_eq!(r.back().unwrap().created_ms(), 500);
    }

    #[derive(Clone, Debug)]
    enum Op {
        /// Push a record created `after` ms after the last, with a token `step` after the last
        /// (0: none; a negative step, a token below the last, as a snapshot of an older lockd
        /// can hold).
        Push {
            after: u32,
            step: i64,
            status: u8,
        },
        Pop,
        SetStatus {
            at: usize,
            status: u8,
        },
        Clone,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (prop_oneof![0..10u32, 60_000..70_000u32], prop_oneof![0..3i64, 32_760..32_770i64, -32_770..-32_760i64, 65_530..65_540i64, -1_000_000..1_000_000i64], 0..5u8)
                .prop_map(|(after, step, status)| Op::Push { after, step, status }),
            3 => Just(Op::Pop),
            1 => (0..400usize, 0..5u8).prop_map(|(at, status)| Op::SetStatus { at, status }),
            1 => Just(Op::Clone),
        ]
    }

    proptest! {
        /// Against a deque of plain records: what was pushed comes back at the position push
        /// returned, every other slot is a removed filler, pops come out in order, and a clone
        /// is unaffected by later changes.
        #[test]
        fn records_behave_as_a_deque_of_values(ops in proptest::collection::vec(op(), 1..600)) {
            let mut r = Records::default();
            // (position counted from the first push, record): the records pushed, not popped.
            let mut model: VecDeque<(usize, Record)> = VecDeque::new();
            let (mut popped, mut created, mut token) = (0usize, 1_764_000_000_000i64, 10_000_000u64);
            let mut clones: Vec<(Records, Vec<Record>)> = Vec::new();
            for (n, op) in ops.into_iter().enumerate() {
                match op {
                    Op::Push { after, step, status } => {
                        created += i64::from(after);
                        let t = if step == 0 {
                            0
                        } else {
                            token = token.saturating_add_signed(step).max(1);
                            token
                        };
                        let one = record(created, t, Status::ALL[usize::from(status)], n as u8);
                        let at = r.push_back(one);
                        model.push_back((popped + at, one));
                    }
                    Op::Pop => {
                        let Some(got) = r.pop_front() else {
                            prop_assert!(model.is_empty());
                            continue;
                        };
                        match model.front() {
                            Some(&(at, want)) if at == popped => {
                                prop_assert_eq!(RecordWire::from(got), RecordWire::from(want));
                                model.pop_front();
                            }
                            _ => prop_assert_eq!(got.status(), Status::Forgotten),
                        }
                        popped += 1;
                    }
                    Op::SetStatus { at, status } => {
                        // The window changes records it found by key, never a filler.
                        let status = Status::ALL[usize::from(status)];
                        let Some(len) = std::num::NonZeroUsize::new(model.len()) else {
                            continue;
                        };
                        let entry = &mut model[at % len];
                        let changed = r.set_status(entry.0 - popped, status);
                        entry.1.set_status(status);
                        prop_assert_eq!(changed.map(RecordWire::from), Some(RecordWire::from(entry.1)));
                    }
                    Op::Clone => clones.push((r.clone(), r.iter().collect())),
                }
                prop_assert_eq!(r.iter().count(), r.len());
                // A token kept aside belongs to a slot still there.
                prop_assert!(r.far_tokens() <= r.len());
            }
            let all: Vec<Record> = r.iter().collect();
            let mut wanted = model.iter().peekable();
            for (i, got) in all.iter().enumerate() {
                match wanted.peek() {
                    Some(&&(at, want)) if at == popped + i => {
                        prop_assert_eq!(RecordWire::from(*got), RecordWire::from(want));
                        prop_assert_eq!(r.key(i), Some(want.key));
                        wanted.next();
                    }
                    _ => prop_assert_eq!(got.status(), Status::Forgotten),
                }
            }
            prop_assert!(wanted.next().is_none());
            for (copy, then) in clones {
                let now: Vec<RecordWire> = copy.iter().map(RecordWire::from).collect();
                let then: Vec<RecordWire> = then.into_iter().map(RecordWire::from).collect();
                prop_assert_eq!(now, then);
            }
        }
    }
}
