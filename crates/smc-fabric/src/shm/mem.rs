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
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
        .map_err(|e| FabricError::os("memfd_create", e))?;
    rustix::fs::ftruncate(&fd, len as u64).map_err(|e| FabricError::os("ftruncate", e))?;
    rustix::fs::fcntl_add_seals(&fd, SEALS).map_err(|e| FabricError::os("add seals", e))?;
    Ok(fd)
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
    rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
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
