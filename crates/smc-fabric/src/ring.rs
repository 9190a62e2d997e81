//! Lock-free single-producer/single-consumer message ring in shared memory, with the
//! doorbell ("sleeping" flag) protocols used by SEND delivery.
//!
//! Layout of a ring region (all offsets in bytes, little cache-line padded header):
//!
//! | offset | field | written by |
//! |---|---|---|
//! | 0 | reserved (`u64`, zero) | |
//! | 8 | `rx_armed: u32` (consumer sleeps, wants a doorbell) | consumer sets, producer clears |
//! | 64 | `head: u64` (messages consumed) | consumer |
//! | 72 | `tx_waiting: u32` (producer waits for space) | producer sets, consumer clears |
//! | 128 | `epoch: u64` (memory-region revocation epoch) | ring owner (consumer) |
//! | 192 | `credits: u64` (receive WRs ever posted; [`CREDITS_REVOKED`] once in error) | consumer |
//! | 200 | `spin: u64` (the consumer's spin word, opaque here: [`crate::CompletionQueue::spin_words`]) | consumer |
//! | 256 | `capacity` slots of [`SLOT_SIZE`] bytes: `len: u32`, `seq: u32`, payload | producer |
//!
//! A message is published by its slot's `seq`, stored (Release) after the rest of the slot:
//! slot use `n` (counting from 0, the ring's `tail`) carries `seq = n + 1` (modulo 2^32), which
//! differs from the `seq` of the slot's previous use (`n + 1 - capacity`) and from a fresh
//! ring's zeros.
//!
//! A message of up to [`MAX_INLINE`] (56) bytes takes one slot: every CDC and v1 LLC message
//! (44 bytes). A longer one (an SMC-Rv2 LLC message, up to [`MAX_SEND`] = 8192 bytes) is split
//! over [`slots_for`]`(len)` consecutive slots (wrapping at the ring's end): the first carries
//! the whole message's `len` and its first 56 bytes, each continuation slot the next 56 (its
//! `len` field unused). The producer publishes the continuation slots first and the first slot
//! last, so the consumer waits on one `seq` per message as before: when the first slot is
//! published, the whole message is (its Acquire load pairs with that Release store, which
//! follows every continuation write in program order). `head` and `tail` count slots. The
//! consumer learns of a message from the very line that holds it: a consumer that spins on the
//! ring waits for one cache line to come over from the producer's core, not for an index line
//! first and for the slot's line after it (measured: the copy of a slot found through a shared
//! tail index waited 190 cycles for its line when the two cores were far apart).
//!
//! The peer process may scribble over every byte of the region at any time. Both sides therefore
//! keep their own copy of their index, validate the other's (`0 <= sent - head <= capacity`)
//! and every slot length before use, and copy slots out with raw pointer copies before parsing.
//! A scribbled `seq` can only make the consumer take a slot's bytes early (validated as any
//! message) or late. The only Rust references formed over shared memory are to atomic types,
//! which permit concurrent modification.
//!
//! Doorbell protocol (a Dekker pair of SeqCst fences, so no wake-up is lost and a busy consumer
//! costs the producer no system call):
//! - consumer before sleeping: `rx_armed = 1; fence(SeqCst); re-check the next slot's seq`,
//!   sleep only if it is not published;
//! - producer after publishing a slot's `seq` (Release): `fence(SeqCst); if rx_armed != 0 &&
//!   swap(rx_armed, 0) != 0 { ring the doorbell }`.
//!
//! The same protocol with `tx_waiting` and `head` wakes a producer that waits for space.

use crate::sync::{fence, AtomicU32, AtomicU64};
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release, SeqCst};

/// Size of one ring slot in bytes.
pub const SLOT_SIZE: usize = 64;
/// Bytes of a slot used by its header.
const SLOT_HEADER: usize = 8;
/// Offset in a slot of its `seq` (a `u32`, 4-aligned like every slot).
pub(crate) const SLOT_SEQ: usize = 4;
/// Largest SEND payload a slot carries (a longer SEND is split over consecutive slots).
pub const MAX_INLINE: usize = SLOT_SIZE - SLOT_HEADER;
/// Largest SEND payload: an SMC-Rv2 LLC message is at most 8192 bytes (spec §10.2).
pub const MAX_SEND: usize = 8192;

/// Slots a message of `len` bytes (at most [`MAX_SEND`]) takes: one up to [`MAX_INLINE`] bytes,
/// then one more per further [`MAX_INLINE`] bytes.
pub const fn slots_for(len: usize) -> u32 {
    if len <= MAX_INLINE {
        1
    } else {
        len.div_ceil(MAX_INLINE) as u32
    }
}

/// Slots the longest message takes (147): every ring has at least this many.
pub const MAX_SEND_SLOTS: u32 = slots_for(MAX_SEND);
/// Size of the ring header in bytes (slots start here).
pub const HEADER_SIZE: usize = 256;

/// Ring header; `#[repr(C)]` so that it matches the shared-memory layout documented above.
///
/// The padding is made of atomics too, so that a reference to the header never covers plain
/// bytes the peer may write.
#[repr(C)]
pub(crate) struct RingHeader {
    /// Reserved (zero): a message is published by its slot's `seq`.
    _reserved: AtomicU64,
    pub(crate) rx_armed: AtomicU32,
    #[cfg(not(loom))]
    _pad0: [AtomicU32; 13],
    pub(crate) head: AtomicU64,
    pub(crate) tx_waiting: AtomicU32,
    #[cfg(not(loom))]
    _pad1: [AtomicU32; 13],
    pub(crate) epoch: AtomicU64,
    // The epoch is read by every RDMA WRITE and almost never written: it has a cache line of
    // its own, apart from the credits the consumer publishes for every receive it posts.
    #[cfg(not(loom))]
    _pad2: [AtomicU64; 7],
    /// Receive work requests the consumer ever posted (a SEND numbered `n`, counting from 1,
    /// has a receive WR waiting for it iff `n <= credits`), or [`CREDITS_REVOKED`].
    pub(crate) credits: AtomicU64,
    /// A word the consumer publishes to the producer while it spins (meaningful to the layer
    /// above: which CPU it spins on, and a count of its rounds), zero otherwise. In the
    /// consumer's line: the producer reads it only when it spins itself.
    pub(crate) spin: AtomicU64,
    #[cfg(not(loom))]
    _pad3: [AtomicU64; 6],
}

#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<RingHeader>() == HEADER_SIZE);

impl RingHeader {
    /// A zeroed header (used by the loom model, which allocates the header on the heap).
    #[cfg(loom)]
    pub(crate) fn new() -> RingHeader {
        RingHeader {
            _reserved: AtomicU64::new(0),
            rx_armed: AtomicU32::new(0),
            head: AtomicU64::new(0),
            tx_waiting: AtomicU32::new(0),
            epoch: AtomicU64::new(0),
            credits: AtomicU64::new(0),
            spin: AtomicU64::new(0),
        }
    }
}

/// `credits` value of a consumer that entered the error state: it accepts no further message.
pub(crate) const CREDITS_REVOKED: u64 = u64::MAX;

/// Bytes needed for a ring of `capacity` slots.
pub const fn ring_bytes(capacity: u32) -> usize {
    HEADER_SIZE + capacity as usize * SLOT_SIZE
}

/// Storage of ring slots: raw shared memory in production, loom cells in the model.
pub(crate) trait SlotMem {
    /// Copy `src` into slot `idx`, all but its `seq` (`idx < capacity`, checked by the caller).
    fn write_slot(&self, idx: usize, src: &[u8; SLOT_SIZE]);
    /// Copy slot `idx` into `dst` (`idx < capacity`, checked by the caller).
    fn read_slot(&self, idx: usize, dst: &mut [u8; SLOT_SIZE]);
    /// Publish slot `idx` as message `seq` (a Release store of its `seq`).
    fn publish(&self, idx: usize, seq: u32);
    /// The `seq` of slot `idx` (an Acquire load; 0 for an index out of range).
    fn published(&self, idx: usize) -> u32;
}

/// The `seq` that publishes message `n` (counting from 0).
fn seq_of(n: u64) -> u32 {
    // Modulo 2^32 on purpose.
    n.wrapping_add(1) as u32
}

/// The peer broke the ring invariants (indices or lengths out of range).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RingCorrupt;

/// Producer side state (kept in private memory).
#[derive(Debug)]
pub(crate) struct Producer {
    tail: u64,
    /// The consumer's `head` as last read: the ring has at least `capacity - (tail - head)`
    /// free slots, so the shared `head` (a cache line the consumer writes for every message)
    /// is read only when this copy says the ring is full.
    head: u64,
    capacity: u32,
    /// `tail % capacity`, kept as the tail moves (no division per message).
    slot: u32,
    /// Slots the message that last found the ring full needs (what a wait for space waits for).
    want: u32,
}

/// The slot after `slot` in a ring of `capacity` slots.
fn next_slot(slot: u32, capacity: u32) -> u32 {
    if slot + 1 >= capacity {
        0
    } else {
        slot + 1
    }
}

impl Producer {
    pub(crate) fn new(capacity: u32) -> Producer {
        Producer {
            tail: 0,
            head: 0,
            capacity,
            slot: 0,
            want: 1,
        }
    }

    /// Try to append `msg` (at most [`MAX_SEND`] bytes, split over [`slots_for`]`(len)` slots).
    /// `Ok(false)` when the ring has not that many free slots; an error for a message longer
    /// than [`MAX_SEND`] or than the ring can ever hold.
    pub(crate) fn try_push(
        &mut self,
        hdr: &RingHeader,
        slots: &impl SlotMem,
        msg: &[u8],
    ) -> Result<bool, RingCorrupt> {
        if msg.len() > MAX_SEND {
            return Err(RingCorrupt);
        }
        let need = slots_for(msg.len());
        if need > self.capacity {
            return Err(RingCorrupt);
        }
        let need = u64::from(need);
        if self.tail.wrapping_sub(self.head) + need > u64::from(self.capacity) {
            let head = hdr.head.load(Acquire);
            let used = self.tail.wrapping_sub(head);
            if used > u64::from(self.capacity) {
                return Err(RingCorrupt);
            }
            self.head = head;
            if used + need > u64::from(self.capacity) {
                // `need <= capacity`.
                self.want = need as u32;
                return Ok(false);
            }
        }
        let mut slot = [0u8; SLOT_SIZE];
        // `msg.len() <= MAX_SEND < u32::MAX`.
        slot[..4].copy_from_slice(&(msg.len() as u32).to_le_bytes());
        let (first, rest) = msg.split_at(msg.len().min(MAX_INLINE));
        slot[SLOT_HEADER..SLOT_HEADER + first.len()].copy_from_slice(first);
        let first_slot = self.slot;
        let first_seq = seq_of(self.tail);
        // Continuation slots (a long message only), each published before the first slot.
        for chunk in rest.chunks(MAX_INLINE) {
            self.slot = next_slot(self.slot, self.capacity);
            self.tail = self.tail.wrapping_add(1);
            let mut cont = [0u8; SLOT_SIZE];
            cont[SLOT_HEADER..SLOT_HEADER + chunk.len()].copy_from_slice(chunk);
            slots.write_slot(self.slot as usize, &cont);
            slots.publish(self.slot as usize, seq_of(self.tail));
        }
        slots.write_slot(first_slot as usize, &slot);
        slots.publish(first_slot as usize, first_seq);
        self.slot = next_slot(self.slot, self.capacity);
        self.tail = self.tail.wrapping_add(1);
        Ok(true)
    }

    /// Slots pushed so far (the ring's `tail`: the consumer's `head` reaches it once it took
    /// every message pushed).
    pub(crate) fn tail(&self) -> u64 {
        self.tail
    }

    /// After one or more pushes: whether the consumer sleeps and must get a doorbell.
    pub(crate) fn consumer_needs_doorbell(hdr: &RingHeader) -> bool {
        fence(SeqCst);
        hdr.rx_armed.load(Relaxed) != 0 && hdr.rx_armed.swap(0, AcqRel) != 0
    }

    /// The consumer's receive credits, read after a push (the SeqCst fence pairs with the one in
    /// [`Consumer::revoke_credits`]: either the consumer sees the pushed message when it drains
    /// at its error, or we see the revocation). `None` once revoked.
    pub(crate) fn credits(hdr: &RingHeader) -> Option<u64> {
        fence(SeqCst);
        Self::credits_after_fence(hdr)
    }

    /// [`credits`](Self::credits) for a caller that issued a SeqCst fence after its push
    /// already (the doorbell check's, [`consumer_needs_doorbell`](Self::consumer_needs_doorbell)).
    pub(crate) fn credits_after_fence(hdr: &RingHeader) -> Option<u64> {
        match hdr.credits.load(Acquire) {
            CREDITS_REVOKED => None,
            c => Some(c),
        }
    }

    /// Announce that the producer waits for space (for the slots of the message that last found
    /// the ring full); returns `true` if that space appeared meanwhile (then the caller retries
    /// at once instead of sleeping).
    pub(crate) fn arm_wait_for_space(&self, hdr: &RingHeader) -> bool {
        hdr.tx_waiting.store(1, Relaxed);
        fence(SeqCst);
        let head = hdr.head.load(Acquire);
        self.tail.wrapping_sub(head) + u64::from(self.want) <= u64::from(self.capacity)
    }
}

/// Consumer side state (kept in private memory).
#[derive(Debug)]
pub(crate) struct Consumer {
    head: u64,
    capacity: u32,
    /// `head % capacity`, kept as the head moves (no division per message).
    slot: u32,
}

impl Consumer {
    pub(crate) fn new(capacity: u32) -> Consumer {
        Consumer {
            head: 0,
            capacity,
            slot: 0,
        }
    }

    /// The slot of the oldest message (the next one [`peek`](Self::peek) reads).
    pub(crate) fn slot(&self) -> u32 {
        self.slot
    }

    /// The `seq` that publishes the next message (see [`ready`](Self::ready)).
    pub(crate) fn next_seq(&self) -> u32 {
        seq_of(self.head)
    }

    /// Whether the next message is published (its slot's `seq`).
    pub(crate) fn ready(&self, slots: &impl SlotMem) -> bool {
        slots.published(self.slot as usize) == self.next_seq()
    }

    /// Copy the oldest message's first [`MAX_INLINE`] bytes (all of a short message) into `out`
    /// and return its length, without consuming it; a longer message's remainder is read with
    /// [`peek_rest`](Self::peek_rest). Call only when [`Consumer::ready`] said it is published.
    /// The length is the peer's: longer than [`MAX_SEND`] or than the ring is an error.
    pub(crate) fn peek(
        &self,
        slots: &impl SlotMem,
        out: &mut [u8; MAX_INLINE],
    ) -> Result<usize, RingCorrupt> {
        let mut slot = [0u8; SLOT_SIZE];
        slots.read_slot(self.slot as usize, &mut slot);
        let len = u32::from_le_bytes([slot[0], slot[1], slot[2], slot[3]]) as usize;
        if len > MAX_INLINE && (len > MAX_SEND || slots_for(len) > self.capacity) {
            return Err(RingCorrupt);
        }
        let first = len.min(MAX_INLINE);
        out[..first].copy_from_slice(&slot[SLOT_HEADER..SLOT_HEADER + first]);
        Ok(len)
    }

    /// Copy bytes `MAX_INLINE..len` of the oldest message (of the `len` that
    /// [`peek`](Self::peek) returned) from its continuation slots into `out[..len - MAX_INLINE]`
    /// (`out` at least that long; nothing for a short message).
    pub(crate) fn peek_rest(&self, slots: &impl SlotMem, len: usize, out: &mut [u8]) {
        let mut idx = self.slot;
        let mut slot = [0u8; SLOT_SIZE];
        let rest = len.saturating_sub(MAX_INLINE).min(out.len());
        for chunk in out[..rest].chunks_mut(MAX_INLINE) {
            idx = next_slot(idx, self.capacity);
            slots.read_slot(idx as usize, &mut slot);
            chunk.copy_from_slice(&slot[SLOT_HEADER..SLOT_HEADER + chunk.len()]);
        }
    }

    /// Release the oldest message's slots (of a message of `len` bytes, as
    /// [`peek`](Self::peek) returned it) to the producer. Returns whether the producer waits
    /// for space and must get a doorbell.
    pub(crate) fn advance(&mut self, hdr: &RingHeader, len: usize) -> bool {
        if len <= MAX_INLINE {
            self.head = self.head.wrapping_add(1);
            self.slot = next_slot(self.slot, self.capacity);
        } else {
            // `peek` checked `slots_for(len) <= capacity`.
            let n = slots_for(len);
            self.head = self.head.wrapping_add(u64::from(n));
            let slot = self.slot + n;
            self.slot = if slot >= self.capacity {
                slot - self.capacity
            } else {
                slot
            };
        }
        hdr.head.store(self.head, Release);
        fence(SeqCst);
        hdr.tx_waiting.load(Relaxed) != 0 && hdr.tx_waiting.swap(0, AcqRel) != 0
    }

    /// Publish the number of receive WRs ever posted. Returns whether the producer waits (for
    /// space or credits) and must get a doorbell.
    pub(crate) fn grant_credits(hdr: &RingHeader, total: u64) -> bool {
        hdr.credits.store(total, Release);
        fence(SeqCst);
        hdr.tx_waiting.load(Relaxed) != 0 && hdr.tx_waiting.swap(0, AcqRel) != 0
    }

    /// Revoke all credits (the consumer entered the error state); the caller drains the ring
    /// afterwards.
    pub(crate) fn revoke_credits(hdr: &RingHeader) {
        hdr.credits.store(CREDITS_REVOKED, Release);
        fence(SeqCst);
    }

    /// Announce that the consumer is about to sleep. Returns `true` if a message arrived
    /// meanwhile (then the caller must not sleep).
    pub(crate) fn arm_sleep(&self, hdr: &RingHeader, slots: &impl SlotMem) -> bool {
        hdr.rx_armed.store(1, Relaxed);
        fence(SeqCst);
        self.ready(slots)
    }
}

/// Slots in a mapped shared-memory region.
pub(crate) struct RawSlots {
    base: *mut u8,
    capacity: usize,
}

impl RawSlots {
    /// # Safety
    /// `base` must point to `capacity * SLOT_SIZE` bytes that stay mapped (readable and
    /// writable) for the lifetime of the returned value.
    pub(crate) unsafe fn new(base: *mut u8, capacity: usize) -> RawSlots {
        RawSlots { base, capacity }
    }
}

impl RawSlots {
    /// The `seq` field of slot `idx` as an atomic (`None` past the capacity).
    fn seq_cell(&self, idx: usize) -> Option<&std::sync::atomic::AtomicU32> {
        if idx >= self.capacity {
            return None;
        }
        // SAFETY: the field lies inside the mapping promised by `new` (idx < capacity), is
        // 4-aligned (slots are 64-aligned in a page-aligned mapping after a 256-byte header),
        // and is only ever accessed atomically by this side; the peer may write it at any
        // time, which an atomic permits. The reference lives no longer than `self`.
        // (The std atomic also under loom: this is real shared memory, never modelled.)
        Some(unsafe {
            &*(self.base.add(idx * SLOT_SIZE + SLOT_SEQ) as *const std::sync::atomic::AtomicU32)
        })
    }
}

impl SlotMem for RawSlots {
    fn write_slot(&self, idx: usize, src: &[u8; SLOT_SIZE]) {
        if idx >= self.capacity {
            return;
        }
        // SAFETY: idx < capacity, so the slot lies inside the mapping promised by `new`. The
        // destination is shared memory the peer may write concurrently; a raw byte copy never
        // forms a reference to it. The `seq` field (bytes 4..8) is left to `publish`.
        unsafe {
            let dst = self.base.add(idx * SLOT_SIZE);
            std::ptr::copy_nonoverlapping(src.as_ptr(), dst, SLOT_SEQ);
            std::ptr::copy_nonoverlapping(
                src.as_ptr().add(SLOT_HEADER),
                dst.add(SLOT_HEADER),
                SLOT_SIZE - SLOT_HEADER,
            )
        }
    }

    fn publish(&self, idx: usize, seq: u32) {
        if let Some(a) = self.seq_cell(idx) {
            a.store(seq, Release);
        }
    }

    fn published(&self, idx: usize) -> u32 {
        self.seq_cell(idx).map_or(0, |a| a.load(Acquire))
    }

    fn read_slot(&self, idx: usize, dst: &mut [u8; SLOT_SIZE]) {
        if idx >= self.capacity {
            return;
        }
        // SAFETY: as in `write_slot`; the bytes are copied out before being interpreted.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.base.add(idx * SLOT_SIZE),
                dst.as_mut_ptr(),
                SLOT_SIZE,
            )
        }
    }
}

#[cfg(test)]
#[cfg(not(loom))]
mod tests {
    use super::*;

    struct HeapRing {
        mem: Vec<u64>,
    }

    impl HeapRing {
        fn new(cap: u32) -> HeapRing {
            HeapRing {
                mem: vec![0u64; ring_bytes(cap) / 8],
            }
        }
        fn hdr(&self) -> &RingHeader {
            // SAFETY: the buffer is 8-aligned, zeroed (a valid RingHeader) and long enough.
            unsafe { &*(self.mem.as_ptr() as *const RingHeader) }
        }
        fn slots(&mut self, cap: u32) -> RawSlots {
            // SAFETY: the slot area follows the header inside `mem`, which outlives the test.
            unsafe {
                RawSlots::new(
                    (self.mem.as_mut_ptr() as *mut u8).add(HEADER_SIZE),
                    cap as usize,
                )
            }
        }
    }

    #[test]
    fn push_pop_wraps_and_reports_full() {
        let mut ring = HeapRing::new(4);
        let slots = ring.slots(4);
        let hdr = ring.hdr();
        let mut p = Producer::new(4);
        let mut c = Consumer::new(4);
        let mut buf = [0u8; MAX_INLINE];
        for round in 0..10u8 {
            for i in 0..4u8 {
                assert_eq!(p.try_push(hdr, &slots, &[round, i, 7]), Ok(true));
            }
            assert_eq!(p.try_push(hdr, &slots, &[0]), Ok(false));
            for i in 0..4u8 {
                assert!(c.ready(&slots), "round {round}, message {i}");
                assert_eq!(c.peek(&slots, &mut buf), Ok(3));
                assert_eq!(&buf[..3], &[round, i, 7]);
                c.advance(hdr, 3);
            }
            assert!(!c.ready(&slots), "round {round}: all consumed");
        }
    }

    #[test]
    fn scribbled_seqs_indices_and_lengths_are_rejected() {
        let mut ring = HeapRing::new(4);
        let slots = ring.slots(4);
        let hdr = ring.hdr();
        let c = Consumer::new(4);
        // Only the seq of the next message publishes a slot: a stale lap's, another slot's or
        // a later message's does not.
        for seq in [0, 2, 5, u32::MAX] {
            slots.publish(0, seq);
            assert!(!c.ready(&slots), "seq {seq}");
        }
        slots.publish(1, 1);
        assert!(!c.ready(&slots));
        // A published slot with a length beyond the slot.
        slots.write_slot(0, &[0xff; SLOT_SIZE]);
        slots.publish(0, 1);
        assert!(c.ready(&slots));
        let mut buf = [0u8; MAX_INLINE];
        assert_eq!(c.peek(&slots, &mut buf), Err(RingCorrupt));
        // The producer reads the shared head once its own copy says the ring is full.
        let mut p = Producer::new(4);
        for i in 0..4 {
            assert_eq!(p.try_push(hdr, &slots, &[i]), Ok(true));
        }
        hdr.head.store(9, Relaxed);
        assert_eq!(p.try_push(hdr, &slots, &[1]), Err(RingCorrupt));
    }

    /// A message of `len` bytes whose every byte tells its message and position.
    fn long_msg(tag: u8, len: usize) -> Vec<u8> {
        (0..len).map(|i| tag ^ (i as u8) ^ (i >> 8) as u8).collect()
    }

    fn pop(c: &mut Consumer, hdr: &RingHeader, slots: &RawSlots) -> Vec<u8> {
        assert!(c.ready(slots));
        let mut first = [0u8; MAX_INLINE];
        let len = c.peek(slots, &mut first).expect("valid message");
        let mut msg = first[..len.min(MAX_INLINE)].to_vec();
        let mut rest = vec![0u8; len.saturating_sub(MAX_INLINE)];
        c.peek_rest(slots, len, &mut rest);
        msg.extend_from_slice(&rest);
        c.advance(hdr, len);
        msg
    }

    #[test]
    fn slots_for_lengths() {
        assert_eq!(slots_for(0), 1);
        assert_eq!(slots_for(44), 1);
        assert_eq!(slots_for(56), 1);
        assert_eq!(slots_for(57), 2);
        assert_eq!(slots_for(88), 2);
        assert_eq!(slots_for(112), 2);
        assert_eq!(slots_for(113), 3);
        assert_eq!(MAX_SEND_SLOTS, 147);
    }

    #[test]
    fn long_messages_split_wrap_and_reassemble() {
        // 8 slots: messages of 1, 2 and 3 slots interleaved, wrapping at every offset.
        let cap = 8;
        let mut ring = HeapRing::new(cap);
        let slots = ring.slots(cap);
        let hdr = ring.hdr();
        let mut p = Producer::new(cap);
        let mut c = Consumer::new(cap);
        let lens = [44usize, 88, 57, 168, 56, 113, 1, 0, 112];
        for round in 0..40u8 {
            let len = lens[round as usize % lens.len()];
            let msg = long_msg(round, len);
            assert_eq!(p.try_push(hdr, &slots, &msg), Ok(true), "round {round}");
            // Fill what is left with short messages, then a long one finds the ring full.
            let mut shorts = 0u8;
            while p.try_push(hdr, &slots, &[round, shorts]) == Ok(true) {
                shorts += 1;
            }
            assert_eq!(p.try_push(hdr, &slots, &long_msg(0, 100)), Ok(false));
            assert!(!p.arm_wait_for_space(hdr));
            assert_eq!(pop(&mut c, hdr, &slots), msg, "round {round}, len {len}");
            for i in 0..shorts {
                assert_eq!(pop(&mut c, hdr, &slots), vec![round, i]);
            }
            assert!(!c.ready(&slots));
            assert_eq!(c.head, p.tail());
        }
    }

    #[test]
    fn longest_message_fills_its_slots_and_a_ring_too_small_refuses_it() {
        let cap = 256;
        let mut ring = HeapRing::new(cap);
        let slots = ring.slots(cap);
        let hdr = ring.hdr();
        let mut p = Producer::new(cap);
        let mut c = Consumer::new(cap);
        for tag in 0..4u8 {
            let msg = long_msg(tag, MAX_SEND);
            assert_eq!(p.try_push(hdr, &slots, &msg), Ok(true));
            assert_eq!(pop(&mut c, hdr, &slots), msg);
        }
        assert_eq!(c.head, 4 * u64::from(MAX_SEND_SLOTS));
        assert_eq!(
            p.try_push(hdr, &slots, &vec![0; MAX_SEND + 1]),
            Err(RingCorrupt)
        );
        let mut small = HeapRing::new(16);
        let small_slots = small.slots(16);
        let mut p = Producer::new(16);
        assert_eq!(
            p.try_push(small.hdr(), &small_slots, &vec![0; 17 * MAX_INLINE]),
            Err(RingCorrupt)
        );
    }

    #[test]
    fn scribbled_long_lengths_are_rejected() {
        let cap = 16;
        let mut ring = HeapRing::new(cap);
        let slots = ring.slots(cap);
        let c = Consumer::new(cap);
        let mut buf = [0u8; MAX_INLINE];
        // Longer than any SEND, and longer than this ring's 16 slots.
        for len in [u32::MAX, MAX_SEND as u32 + 1, 17 * MAX_INLINE as u32] {
            let mut slot = [0u8; SLOT_SIZE];
            slot[..4].copy_from_slice(&len.to_le_bytes());
            slots.write_slot(0, &slot);
            slots.publish(0, 1);
            assert_eq!(c.peek(&slots, &mut buf), Err(RingCorrupt), "len {len}");
        }
        // The longest that fits is taken (its bytes are whatever the slots hold).
        let mut slot = [0u8; SLOT_SIZE];
        slot[..4].copy_from_slice(&(16 * MAX_INLINE as u32).to_le_bytes());
        slots.write_slot(0, &slot);
        assert_eq!(c.peek(&slots, &mut buf), Ok(16 * MAX_INLINE));
    }

    #[test]
    fn doorbell_only_when_armed() {
        let mut ring = HeapRing::new(2);
        let slots = ring.slots(2);
        let hdr = ring.hdr();
        let mut p = Producer::new(2);
        let mut c = Consumer::new(2);
        assert!(!c.arm_sleep(hdr, &slots));
        assert_eq!(p.try_push(hdr, &slots, b"x"), Ok(true));
        assert!(Producer::consumer_needs_doorbell(hdr));
        assert_eq!(p.try_push(hdr, &slots, b"y"), Ok(true));
        assert!(
            !Producer::consumer_needs_doorbell(hdr),
            "one doorbell per arming"
        );
        assert!(!p.arm_wait_for_space(hdr));
        assert!(c.advance(hdr, 1), "producer waited for space");
        assert!(!c.advance(hdr, 1));
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::sync::{Arc, Notify};

    struct LoomSlots {
        cells: Vec<UnsafeCell<[u8; SLOT_SIZE]>>,
        /// The slots' `seq` fields, apart from the cells (whose bytes 4..8 go unused here).
        seqs: Vec<AtomicU32>,
    }

    impl SlotMem for LoomSlots {
        fn write_slot(&self, idx: usize, src: &[u8; SLOT_SIZE]) {
            // SAFETY: loom checks that producer and consumer never access a slot concurrently.
            self.cells[idx].with_mut(|p| unsafe { *p = *src });
        }
        fn read_slot(&self, idx: usize, dst: &mut [u8; SLOT_SIZE]) {
            // SAFETY: as above.
            self.cells[idx].with(|p| unsafe { *dst = *p });
        }
        fn publish(&self, idx: usize, seq: u32) {
            self.seqs[idx].store(seq, Release);
        }
        fn published(&self, idx: usize) -> u32 {
            self.seqs[idx].load(Acquire)
        }
    }

    struct Shared {
        hdr: RingHeader,
        slots: LoomSlots,
        rx_bell: Notify,
        tx_bell: Notify,
    }

    /// Producer pushes `n` messages into a ring of `cap` slots, sleeping when full; the consumer
    /// pops them, sleeping when empty. Loom explores all interleavings: a lost doorbell shows up
    /// as a deadlock, a missing Release/Acquire as a data race on a slot cell or wrong payload.
    fn model(cap: u32, n: u8) {
        model_lens(cap, n, |_| 2)
    }

    /// The message `i` of the model: `len(i)` bytes, each telling `i` and its position.
    fn model_msg(i: u8, len: usize) -> Vec<u8> {
        (0..len).map(|k| i.wrapping_mul(3) ^ k as u8).collect()
    }

    /// [`model`] with message `i` of `len(i)` bytes (longer than [`MAX_INLINE`]: split).
    fn model_lens(cap: u32, n: u8, len: fn(u8) -> usize) {
        let mut builder = loom::model::Builder::new();
        // Bounded preemption keeps the exhaustive search to seconds; lost wake-ups and missing
        // fences need at most two preemptions to show up. `LOOM_MAX_PREEMPTIONS` overrides.
        if builder.preemption_bound.is_none() {
            builder.preemption_bound = Some(3);
        }
        builder.check(move || {
            let shared = Arc::new(Shared {
                hdr: RingHeader::new(),
                slots: LoomSlots {
                    cells: (0..cap)
                        .map(|_| UnsafeCell::new([0u8; SLOT_SIZE]))
                        .collect(),
                    seqs: (0..cap).map(|_| AtomicU32::new(0)).collect(),
                },
                rx_bell: Notify::new(),
                tx_bell: Notify::new(),
            });
            let s2 = shared.clone();
            let producer = loom::thread::spawn(move || {
                let mut p = Producer::new(cap);
                let mut i = 0u8;
                while i < n {
                    match p.try_push(&s2.hdr, &s2.slots, &model_msg(i, len(i))) {
                        Ok(true) => {
                            i += 1;
                            if Producer::consumer_needs_doorbell(&s2.hdr) {
                                s2.rx_bell.notify();
                            }
                        }
                        Ok(false) => {
                            if !p.arm_wait_for_space(&s2.hdr) {
                                s2.tx_bell.wait();
                            }
                        }
                        Err(RingCorrupt) => panic!("ring corrupt"),
                    }
                }
            });
            let mut c = Consumer::new(cap);
            let mut buf = [0u8; MAX_INLINE];
            let mut expect = 0u8;
            while expect < n {
                if !c.ready(&shared.slots) {
                    if !c.arm_sleep(&shared.hdr, &shared.slots) {
                        shared.rx_bell.wait();
                    }
                    continue;
                }
                let got = c.peek(&shared.slots, &mut buf).expect("valid slot");
                let mut msg = buf[..got.min(MAX_INLINE)].to_vec();
                let mut rest = vec![0u8; got.saturating_sub(MAX_INLINE)];
                c.peek_rest(&shared.slots, got, &mut rest);
                msg.extend_from_slice(&rest);
                assert_eq!(msg, model_msg(expect, len(expect)));
                expect += 1;
                if c.advance(&shared.hdr, got) {
                    shared.tx_bell.notify();
                }
            }
            producer.join().expect("producer");
        });
    }

    #[test]
    fn loom_ring_doorbell_no_lost_wakeup() {
        model(1, 3);
    }

    #[test]
    fn loom_ring_doorbell_wraparound() {
        model(2, 3);
    }

    /// Split messages: a 2-slot message, a short one and a 3-slot one through a ring of 3
    /// slots (each long message waits for the short one before it to be consumed, and wraps).
    /// A continuation slot read before its write shows up as a data race or a wrong byte.
    #[test]
    fn loom_ring_split_messages() {
        model_lens(3, 3, |i| [100, 2, 3 * MAX_INLINE][i as usize]);
    }
}
