//! The RMB pool of one link group: which RMBs exist, their element size, which RMB elements
//! are free (RFC 7609 §2.1, §4.1, §4.4), and the registry of the peer's RMBEs in use that
//! detects the §4.4.2 conflict.
//!
//! The pool is bookkeeping only. The memory (registration, RTokens, zeroing) belongs to the
//! fabric/runtime or the test harness: after [`RmbPool::allocate`] the caller prepares the
//! element with [`RmbeLayout::initialize`] before communicating its index to the peer.

use std::collections::BTreeMap;

use smc_wire::RmbeSize;

use crate::rmbe::RmbeLayout;

/// Slot of an RMB in its link group (0-based; at most 255 RMBs per link group).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RmbId(pub u8);

/// One RMB element: the RMB it lives in and its 1-based RMBE index (as sent in CLC Accept and
/// Confirm).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RmbeHandle {
    /// The RMB.
    pub rmb: RmbId,
    /// The RMBE index within the RMB, 1-based.
    pub index: u8,
}

/// The shape of one RMB.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RmbInfo {
    /// The RMB's slot.
    pub id: RmbId,
    /// The size code of its elements.
    pub size: RmbeSize,
    /// Bytes per element (eye catcher included).
    pub element_len: u32,
    /// Number of equal elements (1..=255).
    pub elements: u8,
}

impl RmbInfo {
    /// Total bytes of the RMB.
    pub fn len(&self) -> u64 {
        u64::from(self.element_len) * u64::from(self.elements)
    }

    /// Whether the RMB has no byte (never true for a pool RMB).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The result of [`RmbPool::allocate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RmbeAllocation {
    /// The element.
    pub handle: RmbeHandle,
    /// Its size code (sent to the peer).
    pub size: RmbeSize,
    /// Byte offset of the element in its RMB: `(index - 1) * element_len`.
    pub element_offset: u64,
    /// Bytes in the element.
    pub element_len: u32,
    /// `Some` when the pool created a new RMB for this element: the caller must allocate and
    /// register its memory (and have its RToken confirmed on every link) before use.
    pub new_rmb: Option<RmbInfo>,
}

/// Pool configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RmbPoolConfig {
    /// RFC or Linux layout of every element in this link group.
    pub layout: RmbeLayout,
    /// Smallest element size handed out.
    pub min_size: RmbeSize,
    /// Largest element size handed out (code 6 = 1 MiB; Linux sends at most code 5).
    pub max_size: RmbeSize,
    /// Most RMBs in the link group (at most 255, RFC 7609 §2.1).
    pub max_rmbs: u8,
    /// Target bytes per RMB: an RMB holds `clamp(target / element_len, 1, 255)` elements.
    pub rmb_target_bytes: u32,
}

impl Default for RmbPoolConfig {
    fn default() -> Self {
        RmbPoolConfig {
            layout: RmbeLayout::Linux,
            min_size: RmbeSize(0),
            max_size: RmbeSize(6),
            max_rmbs: 255,
            // Two elements of the largest size (1 MiB, the stack's default RMBE) per RMB, as
            // two 512 KiB ones before: every RMB costs a memory registration per link, a
            // CONFIRM RKEY exchange, a descriptor for its memfd on both sides and one of the
            // link group's 255 RMBs.
            rmb_target_bytes: 2 * 1024 * 1024,
        }
    }
}

/// Errors of the RMB pool (all local: resources or API misuse).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// The link group already has its maximum number of RMBs and none has a free element.
    #[error("no free RMB element of size {0} and no room for another RMB")]
    Exhausted(RmbeSize),
    /// The size code is outside the pool's configured range.
    #[error("RMBE size {0} outside the pool's range")]
    SizeOutOfRange(RmbeSize),
    /// The handle names no element of this pool.
    #[error("unknown RMB element {0:?}")]
    UnknownElement(RmbeHandle),
    /// The element is not in use.
    #[error("RMB element {0:?} is not in use")]
    NotInUse(RmbeHandle),
    /// The configuration is invalid.
    #[error("invalid RMB pool configuration: {0}")]
    BadConfig(&'static str),
}

#[derive(Debug, Clone)]
struct RmbSlot {
    size: RmbeSize,
    in_use: Vec<bool>,
    /// Retired (being deleted with DELETE RKEY): never allocated from again.
    retired: bool,
}

/// The local RMBs of one link group and the state of each element.
#[derive(Debug, Clone)]
pub struct RmbPool {
    config: RmbPoolConfig,
    rmbs: Vec<RmbSlot>,
}

impl RmbPool {
    /// An empty pool.
    pub fn new(config: RmbPoolConfig) -> Result<RmbPool, PoolError> {
        if config.max_rmbs == 0 {
            return Err(PoolError::BadConfig("max_rmbs must be at least 1"));
        }
        if config.min_size > config.max_size || config.max_size.0 > 15 {
            return Err(PoolError::BadConfig(
                "min_size must not exceed max_size <= 15",
            ));
        }
        Ok(RmbPool {
            config,
            rmbs: Vec::new(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RmbPoolConfig {
        &self.config
    }

    /// The element size for a socket whose receive buffer is `rcvbuf` bytes: the smallest size
    /// whose data area holds the whole receive buffer, within the configured range.
    //= https://www.rfc-editor.org/rfc/rfc7609#section-4.1
    //# The RMBE associated with a TCP socket endpoint must have a receive buffer that is at
    //# least as large as the TCP receive buffer size in effect for that connection.
    pub fn size_for_rcvbuf(&self, rcvbuf: u32) -> RmbeSize {
        let need = rcvbuf.saturating_add(self.config.layout.data_start());
        let code = RmbeSize::for_bytes(need)
            .0
            .clamp(self.config.min_size.0, self.config.max_size.0);
        RmbeSize(code)
    }

    /// Number of elements in an RMB of `size`.
    pub fn elements_per_rmb(&self, size: RmbeSize) -> u8 {
        let n = self.config.rmb_target_bytes / size.bytes().max(1);
        u8::try_from(n.clamp(1, 255)).unwrap_or(255)
    }

    /// Take a free element of `size`, creating a new RMB if every RMB of that size is full.
    pub fn allocate(&mut self, size: RmbeSize) -> Result<RmbeAllocation, PoolError> {
        if size < self.config.min_size || size > self.config.max_size {
            return Err(PoolError::SizeOutOfRange(size));
        }
        let element_len = size.bytes();
        for (slot_no, slot) in self.rmbs.iter_mut().enumerate() {
            if slot.size != size || slot.retired {
                continue;
            }
            if let Some(i) = slot.in_use.iter().position(|u| !u) {
                slot.in_use[i] = true;
                return Ok(Self::allocation(slot_no, i, size, None));
            }
        }
        if self.rmbs.len() >= usize::from(self.config.max_rmbs) {
            return Err(PoolError::Exhausted(size));
        }
        let elements = self.elements_per_rmb(size);
        let mut in_use = vec![false; usize::from(elements)];
        in_use[0] = true;
        self.rmbs.push(RmbSlot {
            size,
            in_use,
            retired: false,
        });
        let slot_no = self.rmbs.len() - 1;
        let info = RmbInfo {
            id: RmbId(u8::try_from(slot_no).unwrap_or(u8::MAX)),
            size,
            element_len,
            elements,
        };
        Ok(Self::allocation(slot_no, 0, size, Some(info)))
    }

    fn allocation(
        slot: usize,
        i: usize,
        size: RmbeSize,
        new_rmb: Option<RmbInfo>,
    ) -> RmbeAllocation {
        let element_len = size.bytes();
        RmbeAllocation {
            handle: RmbeHandle {
                rmb: RmbId(u8::try_from(slot).unwrap_or(u8::MAX)),
                index: u8::try_from(i + 1).unwrap_or(u8::MAX),
            },
            size,
            element_offset: u64::from(element_len) * (i as u64),
            element_len,
            new_rmb,
        }
    }

    /// Return an element to the free pool. Call only when both peers are done with it: the
    /// connection reached `Closed` (both sent PeerConnectionClosed, or an abort completed, or a
    /// termination timer expired, RFC 7609 §4.8).
    //= https://www.rfc-editor.org/rfc/rfc7609#section-4.4.2
    //# Under normal and abnormal SMC-R connection termination processing, both SMC-R peers
    //# must explicitly acknowledge that they are done using an RMBE before that element can
    //# be freed and reassigned to another SMC-R connection instance.
    pub fn release(&mut self, handle: RmbeHandle) -> Result<(), PoolError> {
        let used = self
            .rmbs
            .get_mut(usize::from(handle.rmb.0))
            .and_then(|s| s.in_use.get_mut(usize::from(handle.index).wrapping_sub(1)))
            .ok_or(PoolError::UnknownElement(handle))?;
        if !*used {
            return Err(PoolError::NotInUse(handle));
        }
        *used = false;
        Ok(())
    }

    /// Whether `handle` is currently assigned to a connection.
    pub fn is_in_use(&self, handle: RmbeHandle) -> Result<bool, PoolError> {
        self.rmbs
            .get(usize::from(handle.rmb.0))
            .and_then(|s| s.in_use.get(usize::from(handle.index).wrapping_sub(1)))
            .copied()
            .ok_or(PoolError::UnknownElement(handle))
    }

    /// The RMBs of the pool.
    pub fn rmbs(&self) -> impl Iterator<Item = RmbInfo> + '_ {
        self.rmbs.iter().enumerate().map(|(i, s)| RmbInfo {
            id: RmbId(u8::try_from(i).unwrap_or(u8::MAX)),
            size: s.size,
            element_len: s.size.bytes(),
            elements: u8::try_from(s.in_use.len()).unwrap_or(u8::MAX),
        })
    }

    /// Whether RMB `id` exists, is not retired and has no element in use.
    pub fn rmb_unused(&self, id: RmbId) -> bool {
        self.rmbs
            .get(usize::from(id.0))
            .is_some_and(|s| !s.retired && s.in_use.iter().all(|u| !u))
    }

    /// Retire RMB `id` (it is being deleted, RFC 7609 §3.5.5.2.2): no element of it is
    /// handed out again. Its slot number is not reused.
    pub fn retire(&mut self, id: RmbId) {
        if let Some(s) = self.rmbs.get_mut(usize::from(id.0)) {
            s.retired = true;
        }
    }

    /// Number of elements in use.
    pub fn in_use(&self) -> usize {
        self.rmbs
            .iter()
            .map(|s| s.in_use.iter().filter(|u| **u).count())
            .sum()
    }
}

/// Identifies one RMBE of the peer: the RMB's RKey (from its RToken) and the element index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PeerRmbeKey {
    /// RKey of the peer RMB (on the link the connection was set up on).
    pub rkey: u32,
    /// 1-based RMBE index the peer sent in CLC Accept/Confirm.
    pub index: u8,
}

/// The peer RMBEs our connections write into, to detect the §4.4.2 conflict: the peer
/// presents, for a new connection, an RMBE we believe another connection still uses.
#[derive(Debug, Clone, Default)]
pub struct PeerRmbeRegistry<C> {
    by_key: BTreeMap<PeerRmbeKey, C>,
}

impl<C: Copy + Eq> PeerRmbeRegistry<C> {
    /// An empty registry.
    pub fn new() -> Self {
        PeerRmbeRegistry {
            by_key: BTreeMap::new(),
        }
    }

    /// Record that `conn` writes into `key`. Returns the connection that was still using that
    /// RMBE, which the caller must abort with `Connection::handle_rmbe_conflict` (no RDMA write
    /// to the RMBE, local data ignored, TCP reset, application told of the reset).
    //= https://www.rfc-editor.org/rfc/rfc7609#section-4.4.2
    //# In this case, the SMC-R peer must abort the existing SMC-R connection associated with
    //# this RMBE.
    pub fn claim(&mut self, key: PeerRmbeKey, conn: C) -> Option<C> {
        match self.by_key.insert(key, conn) {
            Some(old) if old != conn => Some(old),
            _ => None,
        }
    }

    /// Forget `key` if `conn` still owns it; returns whether it did.
    pub fn release(&mut self, key: PeerRmbeKey, conn: C) -> bool {
        if self.by_key.get(&key) == Some(&conn) {
            self.by_key.remove(&key);
            true
        } else {
            false
        }
    }

    /// The connection using `key`, if any.
    pub fn owner(&self, key: PeerRmbeKey) -> Option<C> {
        self.by_key.get(&key).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(layout: RmbeLayout, max_rmbs: u8) -> RmbPool {
        RmbPool::new(RmbPoolConfig {
            layout,
            max_rmbs,
            ..RmbPoolConfig::default()
        })
        .expect("valid config")
    }

    #[test]
    fn size_from_receive_buffer() {
        let p = pool(RmbeLayout::Linux, 255);
        assert_eq!(p.size_for_rcvbuf(0), RmbeSize(0));
        assert_eq!(p.size_for_rcvbuf(16 * 1024), RmbeSize(0));
        assert_eq!(p.size_for_rcvbuf(16 * 1024 + 1), RmbeSize(1));
        assert_eq!(p.size_for_rcvbuf(64 * 1024), RmbeSize(2));
        assert_eq!(p.size_for_rcvbuf(100 * 1024 * 1024), RmbeSize(6));
        // RFC mode: the eye catcher takes 4 bytes, so 16 KiB of data needs a 32 KiB element.
        let r = pool(RmbeLayout::Rfc, 255);
        assert_eq!(r.size_for_rcvbuf(16 * 1024 - 4), RmbeSize(0));
        assert_eq!(r.size_for_rcvbuf(16 * 1024), RmbeSize(1));
    }

    #[test]
    fn elements_are_one_based_and_reused_after_release() {
        let mut p = pool(RmbeLayout::Rfc, 255);
        let a = p.allocate(RmbeSize(0)).expect("alloc");
        assert_eq!(a.handle.index, 1);
        let info = a.new_rmb.expect("first allocation creates an RMB");
        assert_eq!(info.elements, 128);
        assert_eq!(info.len(), 2 * 1024 * 1024);
        let b = p.allocate(RmbeSize(0)).expect("alloc");
        assert_eq!(
            b.handle,
            RmbeHandle {
                rmb: RmbId(0),
                index: 2
            }
        );
        assert_eq!(b.element_offset, 16 * 1024);
        assert!(b.new_rmb.is_none());
        p.release(a.handle).expect("release");
        assert_eq!(p.release(a.handle), Err(PoolError::NotInUse(a.handle)));
        let c = p.allocate(RmbeSize(0)).expect("alloc");
        assert_eq!(c.handle.index, 1);
        assert_eq!(p.in_use(), 2);
    }

    #[test]
    fn one_mib_rmbs_hold_two_elements_and_the_rmb_count_is_bounded() {
        let mut p = pool(RmbeLayout::Linux, 2);
        let a = p.allocate(RmbeSize(6)).expect("alloc");
        assert_eq!(a.element_len, 1024 * 1024);
        assert_eq!(a.new_rmb.map(|i| i.elements), Some(2));
        assert!(p
            .allocate(RmbeSize(6))
            .expect("second element")
            .new_rmb
            .is_none());
        assert!(p
            .allocate(RmbeSize(6))
            .expect("second RMB")
            .new_rmb
            .is_some());
        p.allocate(RmbeSize(6)).expect("its second element");
        assert_eq!(
            p.allocate(RmbeSize(6)),
            Err(PoolError::Exhausted(RmbeSize(6)))
        );
        assert_eq!(
            p.allocate(RmbeSize(7)),
            Err(PoolError::SizeOutOfRange(RmbeSize(7)))
        );
        let bogus = RmbeHandle {
            rmb: RmbId(9),
            index: 1,
        };
        assert_eq!(p.release(bogus), Err(PoolError::UnknownElement(bogus)));
        let zero = RmbeHandle {
            rmb: RmbId(0),
            index: 0,
        };
        assert_eq!(p.release(zero), Err(PoolError::UnknownElement(zero)));
    }

    #[test]
    fn small_elements_cap_at_255_per_rmb() {
        let p = RmbPool::new(RmbPoolConfig {
            rmb_target_bytes: u32::MAX,
            ..RmbPoolConfig::default()
        })
        .expect("valid");
        assert_eq!(p.elements_per_rmb(RmbeSize(0)), 255);
        assert!(RmbPool::new(RmbPoolConfig {
            max_rmbs: 0,
            ..RmbPoolConfig::default()
        })
        .is_err());
    }

    #[test]
    fn conflict_rule_names_the_connection_to_abort() {
        let mut r = PeerRmbeRegistry::new();
        let key = PeerRmbeKey { rkey: 7, index: 3 };
        assert_eq!(r.claim(key, 1u32), None);
        assert_eq!(r.claim(key, 1u32), None);
        assert_eq!(r.claim(key, 2u32), Some(1));
        assert_eq!(r.owner(key), Some(2));
        assert!(!r.release(key, 1));
        assert!(r.release(key, 2));
        assert_eq!(r.owner(key), None);
    }
}
