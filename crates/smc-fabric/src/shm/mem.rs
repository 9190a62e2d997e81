//! Sealed memfds, shared mappings and eventfds: the OS resources of the shm fabric.

use crate::error::{FabricError, Result};
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};
use std::ptr::NonNull;

/// A shared read/write mapping of a memfd, unmapped on drop.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; all accesses go through raw pointers
// (or atomics) and the mapping stays valid until drop, so it may move and be shared between
// threads.
unsafe impl Send for Mapping {}
// SAFETY: see `Send`; no method hands out Rust references to the bytes.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Start of the mapping.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Map `len` bytes of `fd` shared read/write.
    pub(crate) fn map(fd: BorrowedFd<'_>, len: usize) -> Result<Mapping> {
        if len == 0 {
            return Err(FabricError::InvalidArgument("zero-length mapping"));
        }
        // SAFETY: a fresh mapping at a kernel-chosen address cannot alias any Rust object.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd,
                0,
            )
        }
        .map_err(|e| FabricError::os("mmap", e))?;
        let ptr =
            NonNull::new(ptr.cast::<u8>()).ok_or(FabricError::InvalidArgument("mmap null"))?;
        Ok(Mapping { ptr, len })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len describe a mapping created by `map` and not unmapped before.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Seals every fabric memfd carries: its size can never change again, so a mapping of it can
/// never fault with SIGBUS because a peer truncated it.
const SEALS: SealFlags = SealFlags::SHRINK
    .union(SealFlags::GROW)
    .union(SealFlags::SEAL);

/// Create a zeroed memfd of `len` bytes sealed against shrink and grow.
pub(crate) fn sealed_memfd(name: &str, len: usize) -> Result<OwnedFd> {
    crate::fdplace::make(|| {
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .map_err(|e| FabricError::os("memfd_create", e))?;
        rustix::fs::ftruncate(&fd, len as u64).map_err(|e| FabricError::os("ftruncate", e))?;
        rustix::fs::fcntl_add_seals(&fd, SEALS).map_err(|e| FabricError::os("add seals", e))?;
        Ok(fd)
    })
}

/// Check that a memfd received from a peer is sealed against shrinking and holds at least `len`
/// bytes, so that mapping `len` bytes of it is safe for as long as we keep the mapping.
pub(crate) fn validate_peer_memfd(fd: BorrowedFd<'_>, len: usize) -> Result<()> {
    let seals = rustix::fs::fcntl_get_seals(fd)
        .map_err(|_| FabricError::PeerViolation("fd is not a sealable memfd"))?;
    if !seals.contains(SealFlags::SHRINK) {
        return Err(FabricError::PeerViolation(
            "memfd not sealed against shrink",
        ));
    }
    let st = rustix::fs::fstat(fd).map_err(|e| FabricError::os("fstat", e))?;
    if st.st_size < 0 || (st.st_size as u64) < len as u64 {
        return Err(FabricError::PeerViolation("memfd smaller than announced"));
    }
    Ok(())
}

/// A non-blocking eventfd.
pub(crate) fn new_eventfd() -> Result<OwnedFd> {
    use rustix::event::EventfdFlags;
    crate::fdplace::make(|| {
        rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
    })
    .map_err(|e| FabricError::os("eventfd", e))
}

/// Make a doorbell fd received from a peer non-blocking, so that ringing it can never stall
/// our data path even if the peer passed a pipe or socket instead of an eventfd.
pub(crate) fn make_peer_bell(fd: OwnedFd) -> Result<OwnedFd> {
    let fl =
        rustix::fs::fcntl_getfl(&fd).map_err(|_| FabricError::PeerViolation("bad doorbell fd"))?;
    rustix::fs::fcntl_setfl(&fd, fl | rustix::fs::OFlags::NONBLOCK)
        .map_err(|_| FabricError::PeerViolation("bad doorbell fd"))?;
    Ok(fd)
}

/// Add one to an eventfd counter (a doorbell). Errors (counter saturated, fd gone) are ignored:
/// a saturated counter is already readable.
pub(crate) fn ring_eventfd(fd: BorrowedFd<'_>) {
    let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
}

/// Reset an eventfd counter to zero (non-blocking read).
pub(crate) fn drain_eventfd(fd: impl AsFd) {
    let mut buf = [0u8; 8];
    let _ = rustix::io::read(fd, &mut buf);
}

/// Random bytes from the kernel (for GIDs, MACs, QP numbers and keys).
pub(crate) fn random_bytes<const N: usize>() -> [u8; N] {
    let mut out = [0u8; N];
    let mut filled = 0;
    while filled < N {
        match rustix::rand::getrandom(&mut out[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(_) => break,
        }
    }
    if filled < N {
        // Fall back to the hash of time and pid; uniqueness matters, secrecy does not.
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .elapsed()
                .map(|d| d.as_nanos())
                .unwrap_or(0),
        );
        h.write_u32(std::process::id());
        let v = h.finish().to_le_bytes();
        for (i, b) in out.iter_mut().enumerate() {
            *b ^= v[i % 8];
        }
    }
    out
}

/// Writes at least this long are placed with non-temporal stores (see [`place`]).
pub(crate) const NON_TEMPORAL_MIN: usize = 4096;

/// Copy `len` bytes from `src` to `dst` the way an RNIC's DMA would place an RDMA WRITE: into
/// memory, not into this core's cache. Below [`NON_TEMPORAL_MIN`] bytes (and where the ranges
/// overlap, a loopback QP writing a region onto itself) it is a plain copy.
///
/// Why: the peer reads the bytes from another core. Written with plain stores they sit
/// modified in our core's cache, and the peer pulls every line across; written with
/// non-temporal (streaming) stores they go to memory, which the peer's prefetchers read at
/// full speed, and our cache keeps the application's data. Measured here (two cores, 64 KiB
/// pieces through a 512 KiB ring): 142 Gbit/s against 18-68 with plain stores.
///
/// The stores are fenced (`sfence`) before returning: a CDC posted after the WRITE is never
/// seen before its data (non-temporal stores are weakly ordered).
///
/// # Safety
/// `src` must be valid for reading and `dst` for writing `len` bytes; `dst` may be shared
/// memory another process writes concurrently (it is only written, never referenced).
pub(crate) unsafe fn place(src: *const u8, dst: *mut u8, len: usize) {
    let overlap = (src as usize) < (dst as usize).wrapping_add(len)
        && (dst as usize) < (src as usize).wrapping_add(len);
    #[cfg(target_arch = "x86_64")]
    if len >= NON_TEMPORAL_MIN && !overlap {
        // SAFETY: forwarded from the caller; the ranges do not overlap.
        unsafe { place_non_temporal(src, dst, len) };
        return;
    }
    if !overlap {
        // SAFETY: forwarded from the caller; the ranges do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
        return;
    }
    // SAFETY: forwarded from the caller; `copy` tolerates overlap.
    unsafe { std::ptr::copy(src, dst, len) };
}

/// [`place`] with streaming stores: a plain copy up to the first 64-byte boundary of `dst`,
/// whole lines with `movntdq` (SSE2, part of every x86-64), a plain copy of the rest, then
/// `sfence`.
///
/// # Safety
/// As [`place`], and the ranges must not overlap.
#[cfg(target_arch = "x86_64")]
unsafe fn place_non_temporal(src: *const u8, dst: *mut u8, len: usize) {
    let head = ((LINE - (dst as usize) % LINE) % LINE).min(len);
    // SAFETY: `head <= len`; both ranges are valid per the caller and do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
    // SAFETY: the rest of both ranges; `dst + head` is 64-byte aligned.
    let done = unsafe { copy_lines::<true>(src.add(head), dst.add(head), len - head) };
    let i = head + done;
    // SAFETY: `i <= len`; the rest of both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i) };
    // SAFETY: `sfence` has no preconditions (SSE, part of every x86-64).
    unsafe { std::arch::x86_64::_mm_sfence() };
}

/// Bytes of a cache line, the unit of [`copy_lines`] and of prefetches.
pub(crate) const LINE: usize = 64;

/// Copy the whole 64-byte lines of `len` bytes from `src` to `dst` with 16-byte unaligned
/// loads and, with `STREAM`, non-temporal stores (`movntdq`, which needs `dst` 16-byte
/// aligned), else unaligned stores (SSE2, part of every x86-64). Returns the bytes copied (`len`
/// rounded down to a multiple of 64); the caller copies the rest.
///
/// # Safety
/// `src` valid for reading and `dst` for writing `len` bytes, not overlapping; with `STREAM`,
/// `dst` 16-byte aligned.
#[cfg(target_arch = "x86_64")]
unsafe fn copy_lines<const STREAM: bool>(src: *const u8, dst: *mut u8, len: usize) -> usize {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_storeu_si128, _mm_stream_si128};
    let mut i = 0;
    while i + LINE <= len {
        // SAFETY: `i + 64 <= len`, so the four 16-byte loads and stores stay inside both
        // ranges; the loads are unaligned loads, the stores unaligned or (STREAM) to a 16-byte
        // aligned address, as the caller promises.
        unsafe {
            let s = src.add(i);
            let d = dst.add(i);
            let v = [
                _mm_loadu_si128(s.cast::<__m128i>()),
                _mm_loadu_si128(s.add(16).cast::<__m128i>()),
                _mm_loadu_si128(s.add(32).cast::<__m128i>()),
                _mm_loadu_si128(s.add(48).cast::<__m128i>()),
            ];
            for (k, x) in v.into_iter().enumerate() {
                let p = d.add(16 * k).cast::<__m128i>();
                if STREAM {
                    _mm_stream_si128(p, x);
                } else {
                    _mm_storeu_si128(p, x);
                }
            }
        }
        i += LINE;
    }
    i
}

/// Copy `len` bytes out of a registered region (`src`) into the application's buffer (`dst`).
/// A plain copy, except where glibc's `memcpy` is slow: on this AMD machine its `rep movsb`
/// path moves 3-8 GB/s instead of 14-17 when the destination lies 1 to 39 bytes past the
/// source modulo 4 KiB (measured with the source in memory). An RMBE's data starts at a page
/// boundary and a buffer of 128 KiB or more from `malloc` 16 bytes past one, so a reader's
/// first large buffer hit exactly that case: a stream's reader copied at 2.6 GB/s until a
/// later buffer happened to be placed elsewhere. Those copies go through a loop of 16-byte
/// loads and stores instead (11-15 GB/s whatever the alignment).
///
/// # Safety
/// `src` must be valid for reading and `dst` for writing `len` bytes, and the ranges must not
/// overlap.
pub(crate) unsafe fn fetch(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let skew = (dst as usize).wrapping_sub(src as usize) % 4096;
        if len >= FETCH_LOOP_MIN && skew != 0 && skew < 64 {
            // SAFETY: forwarded from the caller.
            unsafe { fetch_loop(src, dst, len) };
            return;
        }
    }
    // SAFETY: forwarded from the caller.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

/// Copies at least this long take [`fetch_loop`] when misplaced (see [`fetch`]).
const FETCH_LOOP_MIN: usize = 1024;

/// [`fetch`] with 16-byte unaligned loads and stores (SSE2, part of every x86-64).
///
/// # Safety
/// As [`fetch`].
#[cfg(target_arch = "x86_64")]
unsafe fn fetch_loop(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: forwarded from the caller (plain stores: no alignment needed).
    let i = unsafe { copy_lines::<false>(src, dst, len) };
    // SAFETY: `i <= len`; the rest of both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i) };
}

/// Start fetching the cache line of `addr` into this core's cache. Any address will do: a
/// prefetch never faults and changes nothing but the cache's contents.
#[inline]
pub(crate) fn prefetch(addr: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHT0 reads nothing architecturally and cannot fault, whatever the address
    // (an unmapped or protected one is ignored).
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(addr as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = addr;
}

/// Start taking the cache line of `addr` into this core's cache for writing (exclusive), so
/// that a store to it later does not wait for the other cores' copies to be invalidated. Any
/// address will do, as for [`prefetch`].
#[inline]
pub(crate) fn prefetch_for_write(addr: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHW reads and writes nothing architecturally and cannot fault, whatever
    // the address (an unmapped or protected one is ignored); it touches no register but its
    // operand's and no flag.
    unsafe {
        std::arch::asm!(
            "prefetchw [{0}]",
            in(reg) addr,
            options(nostack, preserves_flags, readonly)
        )
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = addr;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every length around the non-temporal threshold and the line size, at every alignment of
    /// the destination within a line: exactly the source bytes land, nothing around them.
    #[test]
    fn place_copies_exactly_at_every_alignment() {
        let src: Vec<u8> = (0..3 * NON_TEMPORAL_MIN)
            .map(|i| (i * 7 + 3) as u8)
            .collect();
        let lens = [
            0,
            1,
            63,
            64,
            65,
            NON_TEMPORAL_MIN - 1,
            NON_TEMPORAL_MIN,
            NON_TEMPORAL_MIN + 1,
            NON_TEMPORAL_MIN + 63,
            2 * NON_TEMPORAL_MIN + 17,
        ];
        for len in lens {
            for align in [0usize, 1, 15, 16, 31, 48, 63] {
                for src_off in [0usize, 5] {
                    let mut dst = vec![0xeeu8; len + 256];
                    // The destination starts `align` bytes past a 64-byte boundary.
                    let base = dst.as_mut_ptr();
                    let start = (64 - (base as usize) % 64) % 64 + align;
                    // SAFETY: `start + len <= dst.len()`; `src_off + len <= src.len()`; the
                    // vectors do not overlap.
                    unsafe { place(src.as_ptr().add(src_off), base.add(start), len) };
                    assert_eq!(
                        &dst[start..start + len],
                        &src[src_off..src_off + len],
                        "len {len} align {align}"
                    );
                    assert!(dst[..start].iter().all(|b| *b == 0xee), "before, len {len}");
                    assert!(
                        dst[start + len..].iter().all(|b| *b == 0xee),
                        "after, len {len}"
                    );
                }
            }
        }
    }

    /// Every skew (destination past source modulo 4 KiB) and length: exactly the source bytes.
    #[test]
    fn fetch_copies_exactly_at_every_skew() {
        let src: Vec<u8> = (0..3 * 4096).map(|i| (i * 13 + 1) as u8).collect();
        for len in [
            0usize,
            1,
            63,
            64,
            FETCH_LOOP_MIN - 1,
            FETCH_LOOP_MIN,
            4096 + 17,
        ] {
            for skew in [0usize, 1, 16, 39, 63, 64, 100] {
                let mut dst = vec![0x5au8; len + 4096 + 256];
                let s = src.as_ptr();
                let base = dst.as_mut_ptr();
                let start = ((s as usize + skew).wrapping_sub(base as usize)) % 4096;
                // SAFETY: `start + len <= dst.len()`, `len <= src.len()`; distinct vectors.
                unsafe { fetch(s, base.add(start), len) };
                assert_eq!(
                    &dst[start..start + len],
                    &src[..len],
                    "len {len} skew {skew}"
                );
                assert!(dst[..start].iter().all(|b| *b == 0x5a));
                assert!(dst[start + len..].iter().all(|b| *b == 0x5a));
            }
        }
    }

    /// Overlapping ranges (a loopback QP writing a region onto itself) move like `memmove`.
    #[test]
    fn place_moves_overlapping_ranges() {
        let mut buf: Vec<u8> = (0..3 * NON_TEMPORAL_MIN).map(|i| i as u8).collect();
        let want: Vec<u8> = buf[..2 * NON_TEMPORAL_MIN].to_vec();
        let p = buf.as_mut_ptr();
        // SAFETY: both ranges lie inside `buf`.
        unsafe { place(p, p.add(100), 2 * NON_TEMPORAL_MIN) };
        assert_eq!(&buf[100..100 + 2 * NON_TEMPORAL_MIN], &want[..]);
    }
}
