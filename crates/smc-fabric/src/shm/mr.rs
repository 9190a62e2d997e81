//! Memory regions: sealed memfds owned by the fabric, mapped locally and granted to peers.

use super::device::{lock, DeviceCore};
use super::mem::{self, Mapping};
use crate::error::{FabricError, Result};
use crate::types::AccessFlags;
use rustix::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// A registered memory region.
///
/// The memory (memfd and mapping) may be shared by several registrations, in different
/// protection domains and devices of this process (one RMB registered on every link of a link
/// group, as SMC-R failover needs).
pub(crate) struct MrInner {
    pub(crate) mapping: Arc<Mapping>,
    pub(crate) memfd: Arc<OwnedFd>,
    pub(crate) pd: u32,
    pub(crate) key: u32,
    pub(crate) access: AccessFlags,
    /// The QPs (numbers) whose peers were granted this region (`MrRequest`): only their
    /// cached mappings must go when it is deregistered.
    granted: std::sync::Mutex<Vec<u32>>,
}

impl MrInner {
    pub(crate) fn register(
        core: &DeviceCore,
        pd: u32,
        len: usize,
        access: AccessFlags,
    ) -> Result<Arc<MrInner>> {
        if len == 0 || len > core.fabric.max_mr_size {
            return Err(FabricError::InvalidArgument("memory region size"));
        }
        let memfd = mem::sealed_memfd("smc-fabric-mr", len)?;
        let mapping = Mapping::map(rustix::fd::AsFd::as_fd(&memfd), len)?;
        let key = core.alloc_key();
        let mr = Arc::new(MrInner {
            mapping: Arc::new(mapping),
            memfd: Arc::new(memfd),
            pd,
            key,
            access,
            granted: Default::default(),
        });
        lock(&core.mrs).insert(key, mr.clone());
        Ok(mr)
    }

    /// Register the memory of `src` again, in protection domain `pd` of device `core` (which may
    /// be another device of this process), with its own keys and access flags.
    pub(crate) fn register_alias(
        core: &DeviceCore,
        pd: u32,
        src: &MrInner,
        access: AccessFlags,
    ) -> Result<Arc<MrInner>> {
        let key = core.alloc_key();
        let mr = Arc::new(MrInner {
            mapping: src.mapping.clone(),
            memfd: src.memfd.clone(),
            pd,
            key,
            access,
            granted: Default::default(),
        });
        lock(&core.mrs).insert(key, mr.clone());
        Ok(mr)
    }

    /// Virtual address (the local mapping address, as with hardware verbs).
    pub(crate) fn vaddr(&self) -> u64 {
        self.mapping.ptr() as u64
    }

    pub(crate) fn len(&self) -> usize {
        self.mapping.len()
    }

    /// Byte offset of `[addr, addr+len)` inside the region, if it lies inside.
    pub(crate) fn offset_of(&self, addr: u64, len: u64) -> Option<usize> {
        let off = addr.checked_sub(self.vaddr())?;
        let end = off.checked_add(len)?;
        if end > self.len() as u64 {
            return None;
        }
        usize::try_from(off).ok()
    }

    /// Copy `buf.len()` bytes from `offset` into `buf`.
    pub(crate) fn read_at(&self, offset: usize, buf: &mut [u8]) -> Result<()> {
        let end = offset
            .checked_add(buf.len())
            .ok_or(FabricError::LocalAccess)?;
        if end > self.len() {
            return Err(FabricError::LocalAccess);
        }
        // SAFETY: the range is inside the live mapping; shared memory is only copied with raw
        // pointer copies, never referenced; `buf` is private memory (no overlap).
        unsafe { mem::fetch(self.mapping.ptr().add(offset), buf.as_mut_ptr(), buf.len()) };
        Ok(())
    }

    /// See [`crate::MemoryRegion::prefetch_hint`].
    pub(crate) fn prefetch_hint(&self, offset: usize, len: usize) -> Option<crate::PrefetchHint> {
        if offset >= self.len() {
            return None;
        }
        let end = offset.saturating_add(len.max(1)).min(self.len());
        let base = self.mapping.ptr() as usize;
        let (first, last) = (
            (base + offset) / super::LINE,
            (base + end - 1) / super::LINE,
        );
        Some(crate::PrefetchHint {
            addr: first * super::LINE,
            // At most MAX_LINES (4): fits.
            lines: (last - first + 1).min(crate::PrefetchHint::MAX_LINES) as u8,
        })
    }

    /// Copy `buf` into the region at `offset`.
    pub(crate) fn write_at(&self, offset: usize, buf: &[u8]) -> Result<()> {
        let end = offset
            .checked_add(buf.len())
            .ok_or(FabricError::LocalAccess)?;
        if end > self.len() {
            return Err(FabricError::LocalAccess);
        }
        // SAFETY: as in `read_at`.
        unsafe {
            std::ptr::copy_nonoverlapping(buf.as_ptr(), self.mapping.ptr().add(offset), buf.len())
        };
        Ok(())
    }

    /// Note that the peer of QP `qpn` was granted this region. Called with the device's
    /// region table locked (the lookup that found it), so that a deregistration, which
    /// removes the region from that table first, sees every grant made before.
    pub(crate) fn note_grant(&self, qpn: u32) {
        let mut g = lock(&self.granted);
        if !g.contains(&qpn) {
            g.push(qpn);
        }
    }

    /// Remove the region from the device table and tell the peer of every QP it was granted
    /// over to drop its cached mappings (revocation epoch in the QP's receive ring). Peers it
    /// was never granted to keep theirs: a mapping dropped is requested again at the next
    /// WRITE, which takes a descriptor in the peer's process, and a peer out of descriptors
    /// then failed the WRITE and with it the link (issue #22: one process's link group
    /// ending, or a receive buffer freed, used to revoke every peer's mappings).
    pub(crate) fn deregister(&self, core: &DeviceCore) {
        lock(&core.mrs).remove(&self.key);
        let granted = std::mem::take(&mut *lock(&self.granted));
        if granted.is_empty() {
            return;
        }
        for qp in core.live_qps() {
            if qp.pd == self.pd && granted.contains(&qp.qpn) {
                qp.inbound_header().epoch.fetch_add(1, Ordering::AcqRel);
            }
        }
    }
}

/// Resolve a local SGE to (region, offset), checking PD, bounds and (optionally) local write.
pub(crate) fn resolve_local(
    core: &DeviceCore,
    pd: u32,
    lkey: u32,
    addr: u64,
    len: u32,
    need_write: bool,
) -> Result<(Arc<MrInner>, usize)> {
    let mr = lock(&core.mrs)
        .get(&lkey)
        .cloned()
        .ok_or(FabricError::InvalidLkey(lkey))?;
    if mr.pd != pd {
        return Err(FabricError::InvalidLkey(lkey));
    }
    if need_write && !mr.access.contains(AccessFlags::LOCAL_WRITE) {
        return Err(FabricError::LocalAccess);
    }
    let off = mr
        .offset_of(addr, u64::from(len))
        .ok_or(FabricError::LocalAccess)?;
    Ok((mr, off))
}
