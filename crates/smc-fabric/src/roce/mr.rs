//! Memory regions of the roce backend: anonymous mappings owned by the fabric, registered under
//! an lkey/rkey in one device's table. An alias registration (another device, another protection
//! domain) shares the mapping, so a WRITE arriving on either link lands in the same bytes.

use crate::error::{FabricError, Result};
use crate::types::AccessFlags;
use std::sync::Arc;

/// An anonymous, zeroed, page-aligned mapping.
pub(crate) struct Mapping {
    ptr: *mut u8,
    len: usize,
    map_len: usize,
}

// SAFETY: the mapping is plain memory; every access goes through raw copies (a peer may write
// it at any time, as RDMA memory), so sharing the pointer between threads is sound.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn new(len: usize) -> Result<Mapping> {
        let map_len = len.div_ceil(4096).max(1) * 4096;
        // SAFETY: a fresh anonymous private mapping aliases nothing.
        let ptr = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                map_len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
            )
        }
        .map_err(|e| FabricError::os("mmap", e))?;
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
            map_len,
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping was created by `new` and nothing refers to it any more (every
        // user holds the Arc that is being dropped).
        let _ = unsafe { rustix::mm::munmap(self.ptr.cast(), self.map_len) };
    }
}

/// One registration of a mapping.
pub(crate) struct RoceMr {
    pub(crate) key: u32,
    pub(crate) pd: u32,
    pub(crate) access: AccessFlags,
    pub(crate) mem: Arc<Mapping>,
}

impl RoceMr {
    pub(crate) fn new(key: u32, pd: u32, len: usize, access: AccessFlags) -> Result<RoceMr> {
        if len == 0 {
            return Err(FabricError::InvalidArgument("memory region length 0"));
        }
        Ok(RoceMr {
            key,
            pd,
            access,
            mem: Arc::new(Mapping::new(len)?),
        })
    }

    pub(crate) fn alias(&self, key: u32, pd: u32, access: AccessFlags) -> RoceMr {
        RoceMr {
            key,
            pd,
            access,
            mem: self.mem.clone(),
        }
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.mem.ptr
    }
    /// The region's virtual address: its real address in this process, as with verbs.
    pub(crate) fn vaddr(&self) -> u64 {
        self.mem.ptr as u64
    }
    pub(crate) fn len(&self) -> usize {
        self.mem.len
    }

    /// The byte offset of [`addr`, `addr + len`) inside the region, if it lies inside.
    pub(crate) fn offset_of(&self, addr: u64, len: u64) -> Option<usize> {
        let off = addr.checked_sub(self.vaddr())?;
        let end = off.checked_add(len)?;
        (end <= self.len() as u64).then_some(off as usize)
    }

    /// Copy `src` into the region at `offset` (bounds checked by the caller with `offset_of`;
    /// checked again here).
    pub(crate) fn place(&self, offset: usize, src: &[u8]) -> bool {
        if offset
            .checked_add(src.len())
            .is_none_or(|end| end > self.len())
        {
            return false;
        }
        // SAFETY: the range is inside the live mapping (checked above); region memory is only
        // accessed with raw copies; `src` is private memory.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr().add(offset), src.len()) };
        true
    }

    pub(crate) fn read_at(&self, offset: usize, buf: &mut [u8]) -> Result<()> {
        let end = offset
            .checked_add(buf.len())
            .ok_or(FabricError::LocalAccess)?;
        if end > self.len() {
            return Err(FabricError::LocalAccess);
        }
        // SAFETY: the range is inside the live mapping; `buf` is private memory.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr().add(offset), buf.as_mut_ptr(), buf.len())
        };
        Ok(())
    }

    pub(crate) fn write_at(&self, offset: usize, buf: &[u8]) -> Result<()> {
        if self.place(offset, buf) {
            Ok(())
        } else {
            Err(FabricError::LocalAccess)
        }
    }

    pub(crate) fn prefetch_hint(&self, offset: usize, len: usize) -> Option<crate::PrefetchHint> {
        if offset >= self.len() {
            return None;
        }
        let line = crate::shm::LINE;
        let end = offset.saturating_add(len.max(1)).min(self.len());
        let base = self.ptr() as usize;
        let (first, last) = ((base + offset) / line, (base + end - 1) / line);
        Some(crate::PrefetchHint {
            addr: first * line,
            lines: (last - first + 1).min(crate::PrefetchHint::MAX_LINES) as u8,
        })
    }
}
