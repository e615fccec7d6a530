//! The window's records in creation order, in chunks that share a time base and a token base.
//!
//! A record is 79 bytes as a value ([`Record`]). Stored, its creation time and its fencing token
//! are kept as 2-byte offsets from bases its chunk keeps: 67 bytes a record ([`Slot`]). The
//! offsets of neighbours are small: records are created in time order (244 of them span 65 s
//! at any rate above 3.7 acquires a second) and, since every grant creates one record at once,
//! in token order (244 records span at most 244 tokens).
//!
//! - **Time.** The base is the chunk's first record's; offsets up to 65,534 ms fit.
//! - **Token.** The base is 32,767 below the chunk's first token, so tokens from 32,767 below to
//!   32,766 above it fit. (A snapshot written before lockd granted waiters at the back of the
//!   window holds waiters granted in place: their records sit at the enqueue, with a token
//!   issued up to minutes of grants later, between ordinary ones.)
//!
//! A value that does not fit is kept whole in a side map by slot number, and its slot says so.
//! Chunks are always filled in full, so a record's chunk is found by a division, and whatever
//! the values (an old snapshot, a slow trickle of acquires, a snapshot written by hand), a record
//! costs its slot plus, for each value kept aside, one map entry: never a chunk of its own. No
//! value is clamped: what goes in comes out.
//!
//! A chunk and the `Arc` around it take exactly 16,384 bytes, one mimalloc size class: 67.1 bytes
//! a record, where the 79-byte records in an `imbl` vector took 80 (64 of them in a 5,120-byte
//! block), about 15 MB less for the 1.2 million records of a full window. Cloning for a snapshot
//! copies the chunk pointers (about 5,000 for a full window, 0.15-0.3 ms) and the side maps (O(1),
//! persistent); a later write to a chunk the snapshot still shares copies that chunk alone.

use std::collections::VecDeque;
use std::sync::Arc;

use imbl::OrdMap;

use super::{Record, Status};

/// Records per chunk: the most for which a chunk and its `Arc` fit in 16,384 bytes.
pub(super) const CHUNK_SLOTS: usize = 244;

/// `created_after` of a record whose creation time is in `Records::far_times`.
const FAR_TIME: u16 = u16::MAX;
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
    /// Creation time, ms after the chunk's `created_base`, or `FAR_TIME`.
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
    /// Slots in use.
    len: u8,
    slots: [Slot; CHUNK_SLOTS],
}

const _: () = assert!(
    std::mem::size_of::<Chunk>() + 2 * std::mem::size_of::<usize>() <= 16_384,
    "a chunk and its Arc counts must fit mimalloc's 16,384-byte size class"
);
const _: () = assert!(CHUNK_SLOTS < u8::MAX as usize);

/// Which values of a record just stored are to be kept aside.
struct KeptAside {
    time: bool,
    token: bool,
}

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

    /// Stores `record` in the next slot; the chunk is not full.
    fn push(&mut self, record: &Record) -> KeptAside {
        let created = record.created_ms();
        if self.len == 0 {
            self.created_base = created;
        }
        let created_after = u16::try_from(i128::from(created) - i128::from(self.created_base))
            .ok()
            .filter(|&after| after < FAR_TIME)
            .unwrap_or(FAR_TIME);
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
        KeptAside {
            time: created_after == FAR_TIME,
            token: token_after == FAR_TOKEN,
        }
    }

    /// The record in slot `at`, record number `number` (for the values kept aside).
    fn record(&self, at: usize, far: FarValues<'_>, number: u64) -> Record {
        let slot = &self.slots[at];
        // Exact: each offset was taken from the value it gives back, so neither sum overflows.
        let created = match u16::from_le_bytes(slot.created_after) {
            FAR_TIME => far.time(number),
            after => self.created_base.wrapping_add(i64::from(after)),
        };
        let token = match u16::from_le_bytes(slot.token_after) {
            NO_TOKEN => 0,
            FAR_TOKEN => far.token(number),
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

/// The values kept aside, borrowed for decoding.
#[derive(Clone, Copy)]
struct FarValues<'a> {
    times: &'a OrdMap<u64, i64>,
    tokens: &'a OrdMap<u64, u64>,
}

impl FarValues<'_> {
    // Every FAR_TIME and FAR_TOKEN slot has its entry (see `Records::push_back`, `pop_front`
    // and `check`).
    fn time(&self, number: u64) -> i64 {
        self.times.get(&number).copied().unwrap_or(0)
    }

    fn token(&self, number: u64) -> u64 {
        self.tokens.get(&number).copied().unwrap_or(0)
    }
}

/// The records, oldest first: a deque of shared chunks.
#[derive(Clone, Default)]
pub(super) struct Records {
    chunks: VecDeque<Arc<Chunk>>,
    /// Slots of the front chunk already popped.
    head: usize,
    /// Records from `head` on.
    len: usize,
    /// Records popped since the deque was made: record `i` from the front is number
    /// `popped + i`.
    popped: u64,
    /// The creation times that did not fit their chunk's base, by record number.
    far_times: OrdMap<u64, i64>,
    /// The tokens that did not fit their chunk's base, by record number.
    far_tokens: OrdMap<u64, u64>,
}

impl Records {
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

    fn far(&self) -> FarValues<'_> {
        FarValues {
            times: &self.far_times,
            tokens: &self.far_tokens,
        }
    }

    fn number(&self, i: usize) -> u64 {
        self.popped.wrapping_add(i as u64)
    }

    pub(super) fn get(&self, i: usize) -> Option<Record> {
        let (chunk, at) = self.locate(i)?;
        Some(self.chunks[chunk].record(at, self.far(), self.number(i)))
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

    /// Appends `record`; returns its position.
    pub(super) fn push_back(&mut self, record: Record) -> usize {
        let chunk = match self.chunks.back_mut() {
            Some(back) if !back.is_full() => Arc::make_mut(back),
            _ => {
                self.chunks.push_back(Arc::new(Chunk::empty()));
                Arc::make_mut(self.chunks.back_mut().expect("just pushed"))
            }
        };
        let far = chunk.push(&record);
        let at = self.len;
        self.len += 1;
        let number = self.number(at);
        if far.time {
            self.far_times.insert(number, record.created_ms());
        }
        if far.token {
            self.far_tokens
                .insert(number, u64::from_le_bytes(record.fencing_token));
        }
        at
    }

    pub(super) fn pop_front(&mut self) -> Option<Record> {
        let record = self.front()?;
        let slot = &self.chunks[0].slots[self.head];
        if u16::from_le_bytes(slot.created_after) == FAR_TIME {
            self.far_times.remove(&self.popped);
        }
        if u16::from_le_bytes(slot.token_after) == FAR_TOKEN {
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
        record.set_status(status);
        Arc::make_mut(&mut self.chunks[chunk]).slots[at].ttl_status = record.ttl_status;
        Some(record)
    }

    /// Every record in order.
    pub(super) fn iter(&self) -> impl Iterator<Item = Record> + '_ {
        let far = self.far();
        self.chunks.iter().enumerate().flat_map(move |(c, chunk)| {
            let first = if c == 0 { self.head } else { 0 };
            (first..usize::from(chunk.len)).map(move |at| {
                // Position c * CHUNK_SLOTS + at - head (c > 0 or at >= head).
                let number = self.number(c * CHUNK_SLOTS + at - self.head);
                chunk.record(at, far, number)
            })
        })
    }

    /// Checks the layout (every chunk full but the last) and that the values kept aside are
    /// those of the slots that say so. O(n).
    pub(super) fn check(&self) -> Result<(), String> {
        let slots: usize = self.chunks.iter().map(|c| usize::from(c.len)).sum();
        let full = self.chunks.iter().rev().skip(1).all(|c| c.is_full());
        if !full || self.head >= CHUNK_SLOTS || slots != self.head + self.len {
            return Err(format!(
                "dedup records: {} chunks of {slots} slots, {} popped from the first, {} records",
                self.chunks.len(),
                self.head,
                self.len
            ));
        }
        let (mut times, mut tokens) = (0, 0);
        for i in 0..self.len {
            let (chunk, at) = self.locate(i).expect("i < len");
            let slot = &self.chunks[chunk].slots[at];
            let number = self.number(i);
            if u16::from_le_bytes(slot.created_after) == FAR_TIME {
                if !self.far_times.contains_key(&number) {
                    return Err(format!("dedup record {i} lost its creation time"));
                }
                times += 1;
            }
            if u16::from_le_bytes(slot.token_after) == FAR_TOKEN {
                if !self.far_tokens.contains_key(&number) {
                    return Err(format!("dedup record {i} lost its token"));
                }
                tokens += 1;
            }
        }
        if times != self.far_times.len() || tokens != self.far_tokens.len() {
            return Err(format!(
                "{} creation times and {} tokens kept aside for {times} and {tokens} records",
                self.far_times.len(),
                self.far_tokens.len()
            ));
        }
        Ok(())
    }

    /// Values kept aside: creation times and tokens (for tests of the bound).
    #[cfg(test)]
    pub(super) fn far_values(&self) -> (usize, usize) {
        (self.far_times.len(), self.far_tokens.len())
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

    fn wire(records: impl IntoIterator<Item = Record>) -> Vec<RecordWire> {
        records.into_iter().map(RecordWire::from).collect()
    }

    #[test]
    fn a_slot_is_67_bytes_and_a_chunk_fits_16384() {
        assert_eq!(std::mem::size_of::<Record>(), 79);
        assert_eq!(std::mem::size_of::<Slot>(), 67);
        assert_eq!(std::mem::align_of::<Slot>(), 1);
        // The chunk and the two counts of its `Arc`.
        assert_eq!(std::mem::size_of::<Chunk>() + 16, 16_384);
    }

    #[test]
    fn values_near_the_bases_stay_in_the_slot_and_the_rest_go_aside() {
        let mut r = Records::default();
        let base = 1_764_000_000_000;
        let mut pushed = Vec::new();
        let mut push = |r: &mut Records, one: Record| {
            assert_eq!(r.push_back(one), pushed.len());
            pushed.push(one);
        };
        // Time: up to 65,534 ms after the chunk's first in the slot; later, or earlier (only a
        // hand-made snapshot), aside.
        push(&mut r, record(base, 0, Status::Waiting, 1));
        push(&mut r, record(base + 65_534, 0, Status::Waiting, 2));
        assert_eq!(r.far_values(), (0, 0));
        push(&mut r, record(base + 65_535, 0, Status::Waiting, 3));
        push(&mut r, record(base - 1, 0, Status::Waiting, 4));
        push(&mut r, record(i64::MAX, 0, Status::Waiting, 5));
        assert_eq!(r.far_values(), (3, 0));
        // Tokens: from 32,767 below the chunk's first to 32,766 above it in the slot, farther
        // ones aside.
        for (n, token) in [
            100_000,
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
            push(&mut r, record(base, token, Status::Granted, 10 + n as u8));
        }
        assert_eq!(r.far_values(), (3, 4));
        // None of it took a chunk of its own.
        assert_eq!(r.chunks.len(), 1);
        // The next chunk has bases of its own.
        while r.len() < CHUNK_SLOTS {
            push(&mut r, record(base, 0, Status::Held, 30));
        }
        push(
            &mut r,
            record(i64::MAX - 10, u64::MAX - 5, Status::Granted, 31),
        );
        push(&mut r, record(i64::MAX, u64::MAX, Status::Granted, 32));
        assert_eq!(r.chunks.len(), 2);
        assert_eq!(r.far_values(), (3, 4));
        r.check().unwrap();
        assert_eq!(wire(r.iter()), wire(pushed.iter().copied()));
        // Popping drops the values kept aside with their records.
        let mut popped = 0;
        while r.len() > 2 {
            let got = r.pop_front().unwrap();
            assert_eq!(RecordWire::from(got), RecordWire::from(pushed[popped]));
            popped += 1;
            r.check().unwrap();
        }
        assert_eq!(r.far_values(), (0, 0));
        assert_eq!(wire(r.iter()), wire(pushed[popped..].iter().copied()));
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
        assert_eq!(r.chunks.len(), 100_000usize.div_ceil(CHUNK_SLOTS));
        assert_eq!(r.far_values(), (0, 50_000));
        r.check().unwrap();
        let copy = r.clone();
        // Iterate with the front chunk part popped.
        for (n, want) in records.iter().take(100).enumerate() {
            let got = r.pop_front().unwrap();
            assert_eq!(RecordWire::from(got), RecordWire::from(*want), "record {n}");
        }
        assert_eq!(wire(r.iter()), wire(records[100..].iter().copied()));
        while r.pop_front().is_some() {}
        assert_eq!(r.far_values(), (0, 0));
        assert_eq!(copy.far_values(), (0, 50_000));
        assert_eq!(wire(copy.iter()), wire(records.iter().copied()));
    }

    /// A trickle of acquires (one a minute) or times written by hand take no chunk per record
    /// either: every chunk is full but the last.
    #[test]
    fn times_far_apart_take_no_chunk_of_their_own() {
        let mut r = Records::default();
        let mut records = Vec::new();
        for n in 0..2_000i64 {
            // Alternately forward by a minute and back: the worst a snapshot could hold.
            let created = 1_764_000_000_000 + n * 60_000 - (n % 2) * 1_000_000;
            records.push(record(created, 0, Status::Waiting, n as u8));
        }
        for one in &records {
            r.push_back(*one);
        }
        assert_eq!(r.chunks.len(), 2_000usize.div_ceil(CHUNK_SLOTS));
        r.check().unwrap();
        assert_eq!(wire(r.iter()), wire(records.iter().copied()));
    }

    #[test]
    fn a_clone_keeps_its_records_while_the_original_changes() {
        let mut r = Records::default();
        for i in 0..300 {
            r.push_back(record(i, 1 + i as u64, Status::Granted, i as u8));
        }
        let copy = r.clone();
        r.set_status(70, Status::Forgotten);
        r.pop_front();
        r.push_back(record(500, 900, Status::Granted, 200));
        assert_eq!(copy.len(), 300);
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
            after: i64,
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
        let after = prop_oneof![0..10i64, 65_530..65_540i64, -10..0i64, -100_000..100_000i64];
        let step = prop_oneof![
            0..3i64,
            32_760..32_770i64,
            -32_770..-32_760i64,
            -1_000_000..1_000_000i64
        ];
        prop_oneof![
            6 => (after, step, 0..5u8).prop_map(|(after, step, status)| Op::Push { after, step, status }),
            3 => Just(Op::Pop),
            1 => (0..800usize, 0..5u8).prop_map(|(at, status)| Op::SetStatus { at, status }),
            1 => Just(Op::Clone),
        ]
    }

    proptest! {
        /// Against a deque of plain records: what was pushed comes back at the position push
        /// returned, pops come out in order, every value kept aside belongs to a record still
        /// there, and a clone is unaffected by later changes.
        #[test]
        fn records_behave_as_a_deque_of_values(ops in proptest::collection::vec(op(), 1..800)) {
            let mut r = Records::default();
            let mut model: VecDeque<Record> = VecDeque::new();
            let (mut created, mut token) = (1_764_000_000_000i64, 10_000_000u64);
            let mut clones: Vec<(Records, Vec<RecordWire>)> = Vec::new();
            for (n, op) in ops.into_iter().enumerate() {
                match op {
                    Op::Push { after, step, status } => {
                        created += after;
                        let t = if step == 0 {
                            0
                        } else {
                            token = token.saturating_add_signed(step).max(1);
                            token
                        };
                        let one = record(created, t, Status::ALL[usize::from(status)], n as u8);
                        prop_assert_eq!(r.push_back(one), model.len());
                        model.push_back(one);
                    }
                    Op::Pop => {
                        let got = r.pop_front().map(RecordWire::from);
                        prop_assert_eq!(got, model.pop_front().map(RecordWire::from));
                    }
                    Op::SetStatus { at, status } => {
                        let status = Status::ALL[usize::from(status)];
                        let changed = r.set_status(at, status).map(RecordWire::from);
                        if let Some(want) = model.get_mut(at) {
                            want.set_status(status);
                            prop_assert_eq!(changed, Some(RecordWire::from(*want)));
                        } else {
                            prop_assert_eq!(changed, None);
                        }
                    }
                    Op::Clone => clones.push((r.clone(), wire(r.iter()))),
                }
                prop_assert_eq!(r.len(), model.len());
                prop_assert!(r.check().is_ok(), "{:?}", r.check());
            }
            prop_assert_eq!(wire(r.iter()), wire(model.iter().copied()));
            for (i, want) in model.iter().enumerate() {
                prop_assert_eq!(r.key(i), Some(want.key));
                prop_assert_eq!(r.get(i).map(RecordWire::from), Some(RecordWire::from(*want)));
            }
            for (copy, then) in clones {
                prop_assert_eq!(wire(copy.iter()), then);
            }
        }
    }
}
