//! Floors of `smc bench`: what this machine allows, measured in the same run as SMC-R, TCP
//! and Unix sockets (the fourth transport of the table, `floor`).
//!
//! A floor is the least that *any* implementation of the measured kind can cost here, so a
//! missed goal can be told apart: if the floor misses it as well, the machine stops every
//! implementation (ours included); if the floor meets it, the miss is ours.
//!
//! - `stream`: the least a copy-in/copy-out shared-memory byte stream costs, the better of two
//!   layouts. Any SMC-R data path copies each byte at least twice (into the peer's RMBE, out of
//!   it) and runs its writer and reader either on two cores at once or on one core by turns:
//!   - [`Layout::TwoCores`]: a writer thread copies `size`-byte messages from a private buffer
//!     into a ring of the RMBE's size (with the stores the shm fabric places RDMA WRITEs with:
//!     non-temporal from 4 KiB on, see `smc_fabric::place_rdma_write`), a reader thread copies whatever is there (up to the
//!     bench server's 256 KiB read buffer) into a private buffer. The cursors are atomics on
//!     cache lines of their own; both sides spin, without system calls, and nothing else is
//!     done: no headers, no flags, no wake-ups, no window updates. Every byte crosses between
//!     the cores' caches.
//!   - [`Layout::OneCore`]: one thread takes both turns: it copies messages into the ring until
//!     it is full, then copies everything out (up to 256 KiB at a time), and so on. This is
//!     what a writer and a reader that take turns on one core cost without the switches
//!     between them; the bytes stay in that core's cache (plain stores: streaming ones would
//!     push them out of the one cache that reads them). On a machine whose cores exchange
//!     cache lines slowly (a VM's vCPUs may sit far apart) it is the faster of the two.
//! - `pingpong` busy: one shared buffer per direction and a sequence number on a cache line of
//!   its own; one side copies the message in and publishes the sequence number, the other spins
//!   on it, copies the message out, and answers the same way.
//! - `pingpong` blocking: the same copies, but each waiting side sleeps (std's thread parker,
//!   a futex on Linux) and is woken once per direction: the least a sleeping reader costs.
//! - `connect` (in `bench.rs`, served by the TCP bench server): plain TCP loopback carrying the
//!   CLC messages of an SMC-R subsequent contact (Proposal, Accept, Confirm) and a 1-byte
//!   answer, the ceiling of any SMC-R whose CLC handshake rides the kernel's TCP.
//!
//! The stream and ping-pong floors run as threads of the bench process: cache coherence
//! between two cores is the same whether two threads share a process or a mapping.
//!
//! A spinning wait that has seen no progress for [`SPIN_BUDGET`] naps ([`NAP`], a futex
//! sleep with a timeout) between further looks. On an idle machine with a core per thread that
//! never happens (the other side answers within microseconds, so the floor makes no system
//! call); on a loaded one it keeps a spinner from burning the time slice of the thread it
//! waits for, which would push the floor below what the machine allows (and below a sleeping
//! implementation).

#![allow(unsafe_code)]

use std::cell::UnsafeCell;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::Thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use crate::bench_server::SINK;

/// How long a spinning wait may see no progress before it naps.
pub const SPIN_BUDGET: Duration = Duration::from_micros(50);

/// How long a wait naps between looks once its spin budget is spent.
pub const NAP: Duration = Duration::from_micros(20);

/// Spins between two looks at the clock.
const SPINS_PER_CLOCK: u32 = 256;

/// A value on cache lines of its own (128 bytes: adjacent-line prefetch pairs 64-byte lines).
#[repr(align(128))]
struct Line<T>(T);

impl<T> Deref for Line<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// Bytes shared between two threads that take turns on disjoint ranges. The turns are
/// arranged by the callers through acquire/release atomics; the methods are `unsafe` because
/// only the callers can know that no one else touches the range at the same time.
struct Shared {
    bytes: Box<[UnsafeCell<u8>]>,
}

// SAFETY: every access goes through `copy_in`/`copy_out`, whose callers guarantee (and say why
// at each call) that a range is never written while another thread reads or writes it.
unsafe impl Sync for Shared {}

impl Shared {
    fn new(len: usize) -> Shared {
        Shared {
            bytes: (0..len).map(|_| UnsafeCell::new(0)).collect(),
        }
    }

    fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Copy `src` to the ring position `pos` (wrapping at the end).
    ///
    /// # Safety
    ///
    /// `src.len() <= self.len()`, and no other thread accesses the `src.len()` bytes from
    /// `pos` (modulo the length) until the caller publishes them.
    unsafe fn copy_in(&self, pos: usize, src: &[u8]) {
        let len = self.len();
        debug_assert!(src.len() <= len);
        let off = pos % len;
        let first = src.len().min(len - off);
        // `UnsafeCell<u8>` has the layout of `u8`, and `UnsafeCell` allows writes through a
        // shared reference.
        let base = UnsafeCell::raw_get(self.bytes.as_ptr());
        // Placed as the shm fabric places an RDMA WRITE (non-temporal stores from 4 KiB on):
        // the floor copies the way the data path it is compared with does.
        // SAFETY: `off + first <= len` and `src.len() - first <= len`; the caller owns the
        // ranges (see above) and no reference covers them (`UnsafeCell` bytes); `src` is
        // private memory, so the ranges do not overlap.
        unsafe {
            smc_fabric::place_rdma_write(&src[..first], base.add(off));
            smc_fabric::place_rdma_write(&src[first..], base);
        }
    }

    /// Copy from the ring position `pos` (wrapping at the end) to `dst`.
    ///
    /// # Safety
    ///
    /// `dst.len() <= self.len()`, and no other thread writes the `dst.len()` bytes from `pos`
    /// (modulo the length) while they are copied.
    unsafe fn copy_out(&self, pos: usize, dst: &mut [u8]) {
        let len = self.len();
        debug_assert!(dst.len() <= len);
        let off = pos % len;
        let first = dst.len().min(len - off);
        let base = UnsafeCell::raw_get(self.bytes.as_ptr()).cast_const();
        // SAFETY: as in `copy_in`, with the roles of the ranges swapped.
        unsafe {
            std::ptr::copy_nonoverlapping(base.add(off), dst.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(base, dst.as_mut_ptr().add(first), dst.len() - first);
        }
    }
}

/// Spin until `ready` gives a value; after [`SPIN_BUDGET`] without one, nap between looks
/// (see the module documentation).
fn spin_until<T>(mut ready: impl FnMut() -> Option<T>) -> T {
    let mut spins = 0u32;
    // When the clock was first read: only a wait that outlasts a few hundred spins reads it.
    let mut since: Option<Instant> = None;
    loop {
        if let Some(v) = ready() {
            return v;
        }
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(SPINS_PER_CLOCK)
            && since.get_or_insert_with(Instant::now).elapsed() >= SPIN_BUDGET
        {
            std::thread::park_timeout(NAP);
        } else {
            std::hint::spin_loop();
        }
    }
}

/// The two-core stream floor's reader hands ring room back after every piece of this size.
const PIECE: usize = 64 * 1024;

/// The byte every floor message is filled with; readers check it.
const FILL: u8 = 0xa5;

/// Where the stream floor's writer and reader run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Two threads at once, each spinning on the other's cursor.
    TwoCores,
    /// One thread taking both turns.
    OneCore,
}

/// What the stream floor moved.
#[derive(Debug)]
pub struct StreamResult {
    /// Bytes written (and read: the reader's count is checked against it).
    pub bytes: u64,
    /// From the writer's first copy to the reader's last.
    pub secs: f64,
    /// CPU seconds of the process meanwhile (as `cpu` of [`stream`] counts them).
    pub cpu_s: f64,
}

impl StreamResult {
    /// Gbit/s.
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 * 8.0 / self.secs / 1e9
    }
}

/// The stream floor in one layout: `size`-byte messages for `time` through a ring of
/// `capacity` bytes (see the module documentation); `cpu` tells the CPU seconds used so far.
pub fn stream(
    layout: Layout,
    size: usize,
    capacity: usize,
    time: Duration,
    cpu: &dyn Fn() -> Result<f64>,
) -> Result<StreamResult> {
    if size == 0 || capacity == 0 {
        bail!("the stream floor needs messages and a ring");
    }
    let cpu0 = cpu()?;
    let (bytes, secs) = match layout {
        Layout::TwoCores => two_cores(size, capacity, time)?,
        Layout::OneCore => one_core(size, capacity, time)?,
    };
    Ok(StreamResult {
        bytes,
        secs,
        cpu_s: cpu()? - cpu0,
    })
}

/// Copy `src` into `ring` at position `pos`, wrapping at the end (`src` no longer than it).
fn ring_in(ring: &mut [u8], pos: usize, src: &[u8]) {
    let off = pos % ring.len();
    let first = src.len().min(ring.len() - off);
    let (a, b) = src.split_at(first);
    ring[off..off + first].copy_from_slice(a);
    ring[..b.len()].copy_from_slice(b);
}

/// Copy from `ring` at position `pos` into `dst`, wrapping at the end (`dst` no longer than it).
fn ring_out(ring: &[u8], pos: usize, dst: &mut [u8]) {
    let off = pos % ring.len();
    let first = dst.len().min(ring.len() - off);
    let (a, b) = dst.split_at_mut(first);
    a.copy_from_slice(&ring[off..off + first]);
    b.copy_from_slice(&ring[..b.len()]);
}

/// [`Layout::OneCore`]: (bytes, seconds).
fn one_core(size: usize, capacity: usize, time: Duration) -> Result<(u64, f64)> {
    let mut ring = vec![0u8; capacity];
    let mut buf = vec![0u8; SINK];
    let msg = vec![FILL; size];
    let cap = capacity as u64;
    let (mut head, mut tail) = (0u64, 0u64);
    let mut wrong = false;
    // The reader's turn: everything there, up to `SINK` bytes per copy.
    let drain = |ring: &[u8], buf: &mut Vec<u8>, wrong: &mut bool, head: u64, tail: &mut u64| {
        while *tail < head {
            let n = ((head - *tail) as usize).min(SINK);
            let dst = &mut buf[..n];
            ring_out(ring, *tail as usize, dst);
            *wrong |= dst.first() != Some(&FILL) || dst.last() != Some(&FILL);
            std::hint::black_box(&mut *buf);
            *tail += n as u64;
        }
    };
    let start = Instant::now();
    let deadline = start + time;
    while Instant::now() < deadline {
        let mut src = &msg[..];
        while !src.is_empty() {
            if head - tail == cap {
                drain(&ring, &mut buf, &mut wrong, head, &mut tail);
            }
            let n = src.len().min((cap - (head - tail)) as usize);
            let (now, rest) = src.split_at(n);
            ring_in(&mut ring, head as usize, now);
            head += n as u64;
            src = rest;
        }
    }
    drain(&ring, &mut buf, &mut wrong, head, &mut tail);
    if wrong {
        bail!("the stream floor read bytes that were not written");
    }
    Ok((tail, start.elapsed().as_secs_f64()))
}

/// [`Layout::TwoCores`]: (bytes, seconds).
fn two_cores(size: usize, capacity: usize, time: Duration) -> Result<(u64, f64)> {
    let ring = Shared::new(capacity);
    // Bytes written and read so far; ring positions are these modulo the capacity.
    let produced = Line(AtomicU64::new(0));
    let consumed = Line(AtomicU64::new(0));
    let done = Line(AtomicBool::new(false));
    let cap = capacity as u64;
    std::thread::scope(|scope| {
        let writer = scope.spawn(|| {
            let msg = vec![FILL; size];
            let start = Instant::now();
            let deadline = start + time;
            let mut head = 0u64;
            // The reader's cursor as last seen: reread only when the ring looks full.
            let mut tail = 0u64;
            // The same loop as the other transports' stream test: check the clock, write.
            while Instant::now() < deadline {
                let mut src = &msg[..];
                while !src.is_empty() {
                    if head - tail == cap {
                        tail = spin_until(|| {
                            let t = consumed.load(Ordering::Acquire);
                            (t != tail).then_some(t)
                        });
                    }
                    let n = src.len().min((cap - (head - tail)) as usize);
                    let (now, rest) = src.split_at(n);
                    // SAFETY: `n` bytes from `head` are free room: the reader has consumed
                    // everything before `tail` (acquire above) and reads nothing at or past
                    // `head` until the release store below.
                    unsafe { ring.copy_in(head as usize, now) };
                    head += n as u64;
                    produced.store(head, Ordering::Release);
                    src = rest;
                }
            }
            done.store(true, Ordering::Release);
            (head, start)
        });
        let reader = scope.spawn(|| -> Result<(u64, Instant)> {
            let mut buf = vec![0u8; SINK];
            let mut tail = 0u64;
            // A wrong byte is reported at the end: the writer may wait for room until then.
            let mut wrong = false;
            loop {
                let head = spin_until(|| {
                    let h = produced.load(Ordering::Acquire);
                    if h != tail {
                        Some(Some(h))
                    } else if done.load(Ordering::Acquire) {
                        // `done` is stored after the last cursor: reread it once more.
                        let h = produced.load(Ordering::Acquire);
                        Some((h != tail).then_some(h))
                    } else {
                        None
                    }
                });
                let Some(head) = head else {
                    if wrong {
                        bail!("the stream floor read bytes that were not written");
                    }
                    return Ok((tail, Instant::now()));
                };
                // Everything there (up to the read buffer), handed back to the writer piece
                // by piece, so that its next copy overlaps with the rest of this one.
                let n = ((head - tail) as usize).min(SINK);
                let mut done_n = 0;
                while done_n < n {
                    let k = (n - done_n).min(PIECE);
                    let dst = &mut buf[done_n..done_n + k];
                    // SAFETY: the writer published these bytes (acquire above) and does not
                    // write them again before the release store of `consumed` below.
                    unsafe { ring.copy_out(tail as usize, dst) };
                    wrong |= dst.first() != Some(&FILL) || dst.last() != Some(&FILL);
                    tail += k as u64;
                    done_n += k;
                    consumed.store(tail, Ordering::Release);
                }
                // The copy must happen although nothing else reads `buf`.
                std::hint::black_box(&mut buf);
            }
        });
        let (sent, start) = writer
            .join()
            .map_err(|_| anyhow::anyhow!("the floor writer panicked"))?;
        let (got, end) = reader
            .join()
            .map_err(|_| anyhow::anyhow!("the floor reader panicked"))??;
        if got != sent {
            bail!("the floor writer wrote {sent} bytes, the reader read {got}");
        }
        Ok((sent, end.duration_since(start).as_secs_f64()))
    })
}

/// One direction of the ping-pong floor: the message buffer and its sequence number.
struct Mailbox {
    seq: Line<AtomicU64>,
    data: Shared,
}

/// The sequence number that tells the echo thread to stop.
const STOP: u64 = u64::MAX;

impl Mailbox {
    fn new(size: usize) -> Mailbox {
        Mailbox {
            seq: Line(AtomicU64::new(0)),
            data: Shared::new(size),
        }
    }

    /// Publish sequence number `seq` (and wake `peer` if it sleeps).
    fn publish(&self, seq: u64, peer: Option<&Thread>) {
        self.seq.store(seq, Ordering::Release);
        if let Some(p) = peer {
            p.unpark();
        }
    }

    /// Wait until the sequence number differs from `old`; spin (`busy`) or sleep.
    fn wait_past(&self, old: u64, busy: bool) -> u64 {
        if busy {
            spin_until(|| {
                let s = self.seq.load(Ordering::Acquire);
                (s != old).then_some(s)
            })
        } else {
            loop {
                let s = self.seq.load(Ordering::Acquire);
                if s != old {
                    return s;
                }
                std::thread::park();
            }
        }
    }
}

/// The ping-pong floor: an echo thread for `size`-byte messages, spinning (`busy`) or
/// sleeping, while `measure` runs on this thread with a function that makes one round trip.
pub fn pingpong<R>(
    size: usize,
    busy: bool,
    measure: impl FnOnce(&mut dyn FnMut() -> Result<()>) -> Result<R>,
) -> Result<R> {
    if size == 0 {
        bail!("ping-pong with empty messages");
    }
    let there = Mailbox::new(size);
    let back = Mailbox::new(size);
    let me = std::thread::current();
    std::thread::scope(|scope| {
        let echo = scope.spawn(|| -> Result<()> {
            let mut buf = vec![0u8; size];
            let mut last = 0u64;
            // A wrong byte is reported at the end: the client waits for every answer.
            let mut wrong = false;
            loop {
                let seq = there.wait_past(last, busy);
                if seq == STOP {
                    if wrong {
                        bail!("the ping-pong floor read bytes that were not written");
                    }
                    return Ok(());
                }
                // SAFETY: the client wrote the message before publishing `seq` (acquired
                // above) and writes the next one only after our answer below.
                unsafe { there.data.copy_out(0, &mut buf) };
                wrong |= buf.first() != Some(&FILL) || buf.last() != Some(&FILL);
                // SAFETY: the client read our previous answer before it published `seq` and
                // reads this one only after the release below.
                unsafe { back.data.copy_in(0, &buf) };
                back.publish(seq, (!busy).then_some(&me));
                last = seq;
            }
        });
        let peer = echo.thread().clone();
        let mut msg = vec![FILL; size];
        let mut seq = 0u64;
        let mut round_trip = || -> Result<()> {
            seq += 1;
            // SAFETY: the echo thread read the previous message before it answered it.
            unsafe { there.data.copy_in(0, &msg) };
            there.publish(seq, (!busy).then_some(&peer));
            if back.wait_past(seq - 1, busy) != seq {
                bail!("the ping-pong floor's echo answered out of turn");
            }
            // SAFETY: the echo thread wrote the answer before publishing `seq` and writes the
            // next one only after our next message.
            unsafe { back.data.copy_out(0, &mut msg) };
            std::hint::black_box(&mut msg);
            Ok(())
        };
        let result = measure(&mut round_trip);
        there.publish(STOP, Some(&peer));
        echo.join()
            .map_err(|_| anyhow::anyhow!("the floor echo thread panicked"))??;
        result
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_wraps() {
        let r = Shared::new(8);
        let mut out = [0u8; 6];
        // SAFETY: one thread.
        unsafe {
            r.copy_in(5, &[1, 2, 3, 4, 5, 6]);
            r.copy_out(5, &mut out);
        }
        assert_eq!(out, [1, 2, 3, 4, 5, 6]);
        let mut all = [0u8; 8];
        // SAFETY: one thread.
        unsafe { r.copy_out(0, &mut all) };
        assert_eq!(all, [4, 5, 6, 0, 0, 1, 2, 3]);
    }

    #[test]
    fn the_plain_ring_wraps() {
        let mut r = [0u8; 8];
        ring_in(&mut r, 13, &[1, 2, 3, 4, 5]);
        assert_eq!(r, [4, 5, 0, 0, 0, 1, 2, 3]);
        let mut out = [0u8; 5];
        ring_out(&r, 5, &mut out);
        assert_eq!(out, [1, 2, 3, 4, 5]);
    }

    #[test]
    fn the_stream_floor_moves_every_byte_through_a_small_ring() {
        let cpu = || Ok(0.0);
        for layout in [Layout::TwoCores, Layout::OneCore] {
            // Messages larger than the ring and not dividing it: partial writes and wrapping.
            let r = stream(layout, 3000, 1024, Duration::from_millis(20), &cpu).unwrap();
            assert!(
                r.bytes > 0 && r.bytes.is_multiple_of(3000),
                "{layout:?}: {r:?}"
            );
            assert!(r.secs > 0.0 && r.gbps() > 0.0, "{layout:?}: {r:?}");
        }
    }

    #[test]
    fn the_pingpong_floor_echoes_in_both_modes() {
        for busy in [true, false] {
            let n = pingpong(100, busy, |rt| {
                for _ in 0..50 {
                    rt()?;
                }
                Ok(50)
            })
            .unwrap();
            assert_eq!(n, 50);
        }
    }
}
