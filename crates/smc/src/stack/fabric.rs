//! The fabric objects the endpoint allocates from (devices, QPs, RMBs) and their opening.

use super::*;
use smc_proto::fabric::LlcVersion;
use std::io;

/// A link's QP and its receive buffers.
pub(super) struct LinkQp {
    pub(super) qp: QueuePair,
    /// The receive slots, `RECV_SLOTS` of `slot_len` bytes.
    pub(super) rx: MemoryRegion,
    /// Bytes per receive slot: [`RECV_SLOT_LEN`] on a v1 link, [`RECV_SLOT_LEN_V2`] on a v2
    /// link.
    pub(super) slot_len: usize,
}

impl LinkQp {
    /// Offset of receive slot `slot` in `rx`.
    pub(super) fn slot_offset(&self, slot: u64) -> usize {
        slot as usize * self.slot_len
    }

    /// The buffer a message received in one of our slots is copied into (see
    /// [`message_buf`]).
    pub(super) fn message_buf<'a>(
        &self,
        byte_len: u32,
        small: &'a mut [u8; RECV_SLOT_LEN],
        large: &'a mut Vec<u8>,
    ) -> &'a mut [u8] {
        message_buf(self.slot_len, byte_len, small, large)
    }
}

/// The buffer a received message of `byte_len` bytes (the completion's, capped at the slot's
/// `slot_len`) is copied into: `small` when it fits, else `large`, grown to the message.
fn message_buf<'a>(
    slot_len: usize,
    byte_len: u32,
    small: &'a mut [u8; RECV_SLOT_LEN],
    large: &'a mut Vec<u8>,
) -> &'a mut [u8] {
    let len = (byte_len as usize).min(slot_len);
    if len <= small.len() {
        &mut small[..len]
    } else {
        large.resize(len, 0);
        large
    }
}

/// One RoCE port as the endpoint sees it (one of its `Device`s): a fabric device and one GID
/// of that device's table. A roce device with IPv6 GIDs is several ports to the endpoint, one
/// per GID (as a verbs consumer picks a port and a GID index); a connection's device set holds
/// at most one port of each fabric device (`pnet::ports_for`), so the ports of one device never
/// count as redundant RNICs of one link group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Port {
    /// Index of the fabric device in [`Fabric::devices`].
    pub(crate) dev: usize,
    /// The GID this port speaks from.
    pub(crate) gid: smc_fabric::Gid,
}

/// The ports of `devices`, in the order of the endpoint's device indexes: every GID of every
/// device, each device's GIDs in its table's order.
pub(crate) fn ports_of(devices: &[Device]) -> Vec<Port> {
    devices
        .iter()
        .enumerate()
        .flat_map(|(dev, d)| d.gids().into_iter().map(move |gid| Port { dev, gid }))
        .collect()
}

/// Whether a GID is IPv4-mapped (reached over IPv4), the other kind being IPv6 (rocev2.md 11.1).
pub(crate) fn gid_is_v4(gid: &[u8; 16]) -> bool {
    std::net::Ipv6Addr::from(*gid).to_ipv4_mapped().is_some()
}

/// The fabric objects of the stack: the [`Resources`] the endpoint allocates from.
pub(crate) struct Fabric {
    pub(crate) devices: Vec<Device>,
    /// The endpoint's devices (indexed by `DeviceId`): ports of `devices`.
    pub(crate) ports: Vec<Port>,
    pub(super) pds: Vec<ProtectionDomain>,
    pub(super) cqs: Vec<CompletionQueue>,
    pub(super) links: HashMap<LinkId, LinkQp>,
    /// RMB memory per (group, RMB): one registration per device, all of the same memory
    /// (the first is registered, the others are aliases of it), so WRITEs that arrive over
    /// either link land in one buffer.
    /// Shared handles: a reader copying out of its RMBE without the core lock keeps the
    /// registration (and its mapping) alive while it copies, even if the RMB is freed then.
    pub(crate) rmbs: HashMap<(LgrId, RmbId), Vec<Option<Arc<MemoryRegion>>>>,
    pub(super) rng: u64,
    /// The fabric's directory, where each open port has a socket `<device>/<gid>.sock`.
    pub(super) dir: std::path::PathBuf,
}

impl Fabric {
    /// The fabric device of the endpoint's device `id`.
    pub(crate) fn port_device(&self, id: DeviceId) -> Option<&Device> {
        let p = self.ports.get(usize::from(id.0))?;
        self.devices.get(p.dev)
    }

    /// The fabric device index of the endpoint's device `id`.
    fn dev_index(&self, id: DeviceId) -> Option<usize> {
        self.ports.get(usize::from(id.0)).map(|p| p.dev)
    }

    fn next_random(&mut self) -> u64 {
        // xorshift64*: identifiers only need to differ, not to be unpredictable.
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub(super) fn post_recv(&self, link: LinkId, l: &LinkQp, slot: u64) -> smc_fabric::Result<()> {
        let sge = l.rx.sge(l.slot_offset(slot), l.slot_len as u32)?;
        l.qp.post_recv(&RecvWr {
            wr_id: RECV_FLAG | u64::from(link.0) << 8 | slot,
            sge,
        })
    }
}

impl Fabric {
    /// Copy the first `out.len()` unread bytes of a connection out of our RMB (one copy,
    /// straight into the application's buffer). Every device's registration of the RMB is
    /// the same memory, so any of them serves.
    pub(crate) fn copy_unread(
        &self,
        target: &smc_proto::endpoint::ReadTarget,
        out: &mut [u8],
    ) -> io::Result<()> {
        let mr = self
            .rmbs
            .get(&(target.lgr, target.rmb))
            .and_then(|r| r.iter().flatten().next())
            .ok_or_else(|| io::Error::other("RMB missing"))?;
        copy_regions(mr, target, out)
    }
}

/// Copy the first `out.len()` bytes of `target`'s regions out of `mr`, our RMB.
pub(crate) fn copy_regions(
    mr: &MemoryRegion,
    target: &smc_proto::endpoint::ReadTarget,
    out: &mut [u8],
) -> io::Result<()> {
    let mut done = 0usize;
    for r in target.regions.iter() {
        if done == out.len() {
            break;
        }
        let take = (r.len as usize).min(out.len() - done);
        let at = target.element_offset as usize + r.offset as usize;
        mr.read_at(at, &mut out[done..done + take])
            .map_err(io::Error::other)?;
        done += take;
    }
    Ok(())
}

impl Resources for Fabric {
    fn create_qp(
        &mut self,
        link: LinkId,
        device: DeviceId,
        llc: LlcVersion,
    ) -> Result<QpInfo, ResourceError> {
        let d = self
            .dev_index(device)
            .ok_or(ResourceError("no such device"))?;
        let (pd, cq) = match (self.pds.get(d), self.cqs.get(d)) {
            (Some(p), Some(c)) => (p, c),
            _ => return Err(ResourceError("no such device")),
        };
        let caps = QpCaps {
            max_send_wr: 4096,
            max_recv_wr: RECV_SLOTS as u32,
        };
        let qp = pd
            .create_qp(cq, cq, caps)
            .map_err(|_| ResourceError("QP creation failed"))?;
        qp.to_init().map_err(|_| ResourceError("QP init failed"))?;
        let slot_len = match llc {
            LlcVersion::V1 => RECV_SLOT_LEN,
            LlcVersion::V2 => RECV_SLOT_LEN_V2,
        };
        debug_assert!(slot_len >= llc.max_recv());
        let rx = pd
            .register(RECV_SLOTS as usize * slot_len, AccessFlags::LOCAL_WRITE)
            .map_err(|_| ResourceError("receive buffer registration failed"))?;
        let info = qp.local_info();
        let l = LinkQp { qp, rx, slot_len };
        for slot in 0..RECV_SLOTS {
            self.post_recv(link, &l, slot)
                .map_err(|_| ResourceError("posting receives failed"))?;
        }
        self.links.insert(link, l);
        Ok(QpInfo {
            qpn: U24::truncate(info.qp_num),
            psn: U24::truncate(info.psn),
        })
    }

    fn register_rmb(
        &mut self,
        lgr: LgrId,
        rmb: RmbId,
        len: u64,
        _link: LinkId,
        device: DeviceId,
    ) -> Result<MrInfo, ResourceError> {
        let d = usize::from(device.0);
        let dev = self
            .dev_index(device)
            .ok_or(ResourceError("no such device"))?;
        let pd = self.pds.get(dev).ok_or(ResourceError("no such device"))?;
        let len = usize::try_from(len).map_err(|_| ResourceError("RMB too large"))?;
        let slots = self
            .rmbs
            .entry((lgr, rmb))
            .or_insert_with(|| (0..self.ports.len()).map(|_| None).collect());
        if slots[d].is_none() {
            let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
            let mr = match slots.iter().flatten().next() {
                Some(first) => pd.register_alias(first, access),
                None => pd.register(len, access),
            }
            .map_err(|_| ResourceError("RMB registration failed"))?;
            slots[d] = Some(Arc::new(mr));
        }
        let mr = slots[d].as_ref().ok_or(ResourceError("RMB missing"))?;
        Ok(MrInfo {
            rkey: mr.rkey(),
            vaddr: mr.addr(),
        })
    }

    fn take_peer_rtoken(&mut self, link: LinkId, rkey: u32) -> Result<(), ResourceError> {
        let l = self.links.get(&link).ok_or(ResourceError("no such link"))?;
        l.qp.map_remote(rkey).map_err(|e| {
            tracing::debug!(%link, rkey, "peer RMB not taken in: {e}");
            ResourceError("peer RMB could not be mapped")
        })
    }

    fn reaches(&self, device: smc_proto::fabric::DeviceId, gid: smc_wire::Gid) -> bool {
        // On the shm fabric a device is one LAN: the port is reachable when it is open on the
        // same device name.
        let (Some(d), Some(p)) = (
            self.port_device(device),
            self.ports.get(usize::from(device.0)),
        ) else {
            return false;
        };
        // A software RoCE port reaches the GIDs on its netdev's subnet, of its own IP version
        // (an IPv4-mapped GID is reached over IPv4 only, rocev2.md 11.1).
        if let Some(r) = d.reaches(smc_fabric::Gid(gid.0)) {
            return r && gid_is_v4(&p.gid.0) == gid_is_v4(&gid.0);
        }
        let hex: String = gid.0.iter().map(|b| format!("{b:02x}")).collect();
        self.dir.join(d.name()).join(format!("{hex}.sock")).exists()
    }

    fn connectable(&self, device: smc_proto::fabric::DeviceId, gid: smc_wire::Gid) -> bool {
        let Some(d) = self.port_device(device) else {
            return false;
        };
        // A software RoCE port: only the QP's connect tells (the peer may be routed).
        if d.reaches(smc_fabric::Gid(gid.0)).is_some() {
            return true;
        }
        // A shm device connects a QP through the peer port's socket in its own fabric
        // directory: without it (a peer using another directory, as two users' programs
        // with their default ones) the connect fails for sure.
        let hex: String = gid.0.iter().map(|b| format!("{b:02x}")).collect();
        self.dir.join(d.name()).join(format!("{hex}.sock")).exists()
    }

    fn random_u32(&mut self) -> u32 {
        (self.next_random() >> 32) as u32
    }

    fn port_for(&self, device: DeviceId, gid: smc_wire::Gid) -> Option<DeviceId> {
        let p = self.ports.get(usize::from(device.0))?;
        let d = self.devices.get(p.dev)?;
        // A shm port is the device's only one and its GID tells no IP version.
        if d.reaches(smc_fabric::Gid(gid.0)).is_none() || gid_is_v4(&p.gid.0) == gid_is_v4(&gid.0) {
            return Some(device);
        }
        // Another GID of the same RNIC, of the peer's IP version: one on the peer's LAN first.
        let twins: Vec<usize> = (0..self.ports.len())
            .filter(|&i| {
                self.ports[i].dev == p.dev && gid_is_v4(&self.ports[i].gid.0) == gid_is_v4(&gid.0)
            })
            .collect();
        let pick = twins
            .iter()
            .copied()
            .find(|&i| self.reaches(DeviceId(i as u8), gid))
            .or(twins.first().copied())?;
        u8::try_from(pick).ok().map(DeviceId)
    }
}

/// Open every configured device with its protection domain and completion queue.
#[allow(clippy::type_complexity)]
pub(super) fn open_fabric(
    fabric: &smc_fabric::FabricConfig,
    names: &[String],
) -> Result<(Vec<Device>, Vec<ProtectionDomain>, Vec<CompletionQueue>), smc_fabric::FabricError> {
    let mut devices = Vec::new();
    let mut pds = Vec::new();
    let mut cqs = Vec::new();
    for n in names {
        let d = Device::open(fabric, n)?;
        pds.push(d.alloc_pd()?);
        cqs.push(d.create_cq()?);
        devices.push(d);
    }
    Ok((devices, pds, cqs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn received_message_buffers() {
        let mut small = [0u8; RECV_SLOT_LEN];
        let mut large = Vec::new();
        // A CDC or v1 LLC message: on the stack, on either kind of link.
        for slot_len in [RECV_SLOT_LEN, RECV_SLOT_LEN_V2] {
            assert_eq!(message_buf(slot_len, 44, &mut small, &mut large).len(), 44);
            assert!(large.is_empty());
        }
        // A v1 slot never yields more than it holds, whatever the completion claims.
        let b = message_buf(RECV_SLOT_LEN, 8192, &mut small, &mut large);
        assert_eq!(b.len(), RECV_SLOT_LEN);
        // The kernel's 88-byte ADD LINK v2 and the longest LLC v2 message on a v2 link.
        for len in [88u32, 8192] {
            let b = message_buf(RECV_SLOT_LEN_V2, len, &mut small, &mut large);
            assert_eq!(b.len(), len as usize);
        }
        // Capped at the slot.
        let b = message_buf(RECV_SLOT_LEN_V2, u32::MAX, &mut small, &mut large);
        assert_eq!(b.len(), RECV_SLOT_LEN_V2);
    }
}
