//! The window's records in creation order, in chunks that share a time base and a token base.
//!
//! A record is 79 bytes as a value ([`Record`]). Stored, its creation time and its fencing token
//! are kept as 2-byte offsets from its chunk's first ones: 67 bytes a record ([`Slot`]). The
//! offsets of neighbours are small because records are created in time order and, since every
//! grant creates one record, in token order. A record whose offsets do not fit (created more
//! than 65.5 s after the chunk's first record, a token 65,535 or more past the chunk's first,
//! or one that goes back, which only a snapshot written by hand can hold) starts the next chunk,
//! and the rest of the chunk before is filled with removed records. So every chunk but the last
//! has exactly [`CHUNK_SLOTS`] slots and a record's chunk is found by a division. No value is
//! ever clamped here: what goes in comes out.
//!
//! A chunk and the `Arc` around it take exactly 16,384 bytes, one mimalloc size class: 67.1 bytes
//! a record, where the 79-byte records in an `imbl` vector took 80 (64 of them in a 5,120-byte
//! block), about 15 MB less for the 1.2 million records of a full window. Cloning for a snapshot
//! copies the chunk pointers (about 5,000 for a full window, 0.2 ms); a later write to a chunk the
//! snapshot still shares copies that chunk alone.
//!
//! A chunk closed early wastes its unused slots, whatever clients do, boundedly: by time, once
//! per 65.5 s of the retention at most; by token, once per 65,535 tokens issued at most, and
//! then only when the records between are missing (every grant creates a record).

use std::collections::VecDeque;
use std::sync::Arc;

use super::{Record, Status};

/// Records per chunk: the most for which a chunk and its `Arc` fit in 16,384 bytes.
pub(super) const CHUNK_SLOTS: usize = 244;

/// `token_after` of a record whose token is 0 (it holds no grant).
const NO_TOKEN: u16 = u16::MAX;

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
    /// Fencing token minus the chunk's `token_base`, or `NO_TOKEN` for a token of 0.
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
    /// Token of the chunk's first record with a token; 0 until it holds one.
    token_base: u64,
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
            len: 0,
            slots: [Slot::EMPTY; CHUNK_SLOTS],
        }
    }

    fn is_full(&self) -> bool {
        usize::from(self.len) == CHUNK_SLOTS
    }

    /// Appends `record` if there is room and its offsets fit; an empty chunk takes any record.
    fn try_push(&mut self, record: &Record) -> bool {
        if self.is_full() {
            return false;
        }
        let created = record.created_ms();
        let created_base = if self.len == 0 {
            created
        } else {
            self.created_base
        };
        let Ok(created_after) = u16::try_from(i128::from(created) - i128::from(created_base))
        else {
            return false;
        };
        let token = u64::from_le_bytes(record.fencing_token);
        let (token_after, token_base) = if token == 0 {
            (NO_TOKEN, self.token_base)
        } else {
            let base = if self.token_base == 0 {
                token
            } else {
                self.token_base
            };
            match token
                .checked_sub(base)
                .and_then(|after| u16::try_from(after).ok())
            {
                Some(after) if after != NO_TOKEN => (after, base),
                _ => return false,
            }
        };
        self.created_base = created_base;
        self.token_base = token_base;
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
        true
    }

    /// Fills the unused slots with removed records created with the last one, so that the
    /// chunk is full; returns how many. The chunk holds at least one record.
    fn fill(&mut self) -> usize {
        let used = usize::from(self.len);
        let mut filler = Record::from(super::RecordWire {
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
        filler.set_status(Status::Forgotten);
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

    fn record(&self, at: usize) -> Record {
        let slot = &self.slots[at];
        // Exact: each offset was taken from the value it gives back, so neither sum overflows.
        let created = self
            .created_base
            .wrapping_add(i64::from(u16::from_le_bytes(slot.created_after)));
        let token = match u16::from_le_bytes(slot.token_after) {
            NO_TOKEN => 0,
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
        Some(self.chunks[chunk].record(at))
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
            if chunk.try_push(&record) {
                self.len += 1;
                return self.len - 1;
            }
            self.len += chunk.fill();
        }
        let mut chunk = Chunk::empty();
        let pushed = chunk.try_push(&record);
        debug_assert!(pushed, "an empty chunk takes any record");
        self.chunks.push_back(Arc::new(chunk));
        self.len += 1;
        self.len - 1
    }

    pub(super) fn pop_front(&mut self) -> Option<Record> {
        let record = self.front()?;
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
        let (chunk, at) = self.locate(i)?;
        let chunk = Arc::make_mut(&mut self.chunks[chunk]);
        let mut record = chunk.record(at);
        record.set_status(status);
        chunk.slots[at].ttl_status = record.ttl_status;
        Some(record)
    }

    /// Every slot in order, fillers included.
    pub(super) fn iter(&self) -> impl Iterator<Item = Record> + '_ {
        self.chunks.iter().enumerate().flat_map(move |(i, chunk)| {
            let first = if i == 0 { self.head } else { 0 };
            (first..usize::from(chunk.len)).map(move |at| chunk.record(at))
        })
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
        // Tokens: 65,534 past the chunk's first fits, 65,535 and a token that goes back do not.
        let at = r.push_back(record(base + 200_000, 10, Status::Granted, 5));
        assert_eq!(
            r.push_back(record(base + 200_000, 10 + 65_534, Status::Granted, 6)),
            at + 1
        );
        assert_eq!(
            r.push_back(record(base + 200_000, 10 + 65_535, Status::Granted, 7)),
            4 * CHUNK_SLOTS
        );
        assert_eq!(
            r.push_back(record(base + 200_000, 9, Status::Granted, 8)),
            5 * CHUNK_SLOTS
        );
        // A chunk whose first record has no token takes its base from the first that has.
        let at = r.push_back(record(base + 300_000, 0, Status::Held, 9));
        assert_eq!(
            r.push_back(record(base + 300_000, u64::MAX, Status::Granted, 10)),
            at + 1
        );
        assert_eq!(r.get(at + 1).unwrap().fencing_token, u64::MAX.to_le_bytes());
        // Time that goes back starts a chunk too (only a hand-made snapshot can hold it).
        assert_eq!(
            r.push_back(record(base, 0, Status::Held, 11)),
            7 * CHUNK_SLOTS
        );
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
        /// (0: none).
        Push {
            after: u32,
            step: u32,
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
            6 => (prop_oneof![0..10u32, 60_000..70_000u32], prop_oneof![0..3u32, 65_530..65_540u32], 0..5u8)
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
            let (mut popped, mut created, mut token) = (0usize, 1_764_000_000_000i64, 100u64);
            let mut clones: Vec<(Records, Vec<Record>)> = Vec::new();
            for (n, op) in ops.into_iter().enumerate() {
                match op {
                    Op::Push { after, step, status } => {
                        created += i64::from(after);
                        let t = if step == 0 { 0 } else { token += u64::from(step); token };
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
