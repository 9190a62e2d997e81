//! The fabric objects the endpoint allocates from (devices, QPs, RMBs) and their opening.

use super::*;

/// A link's QP and its receive buffers.
pub(super) struct LinkQp {
    pub(super) qp: QueuePair,
    pub(super) rx: MemoryRegion,
}

/// The fabric objects of the stack: the [`Resources`] the endpoint allocates from.
pub(crate) struct Fabric {
    pub(crate) devices: Vec<Device>,
    pub(super) pds: Vec<ProtectionDomain>,
    pub(super) cqs: Vec<CompletionQueue>,
    pub(super) links: HashMap<LinkId, LinkQp>,
    /// RMB memory per (group, RMB): one registration per device, all of the same memory
    /// (the first is registered, the others are aliases of it), so WRITEs that arrive over
    /// either link land in one buffer.
    pub(crate) rmbs: HashMap<(LgrId, RmbId), Vec<Option<MemoryRegion>>>,
    pub(super) rng: u64,
    /// The fabric's directory, where each open port has a socket `<device>/<gid>.sock`.
    pub(super) dir: std::path::PathBuf,
}

impl Fabric {
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
        let sge =
            l.rx.sge(slot as usize * RECV_SLOT_LEN, RECV_SLOT_LEN as u32)?;
        l.qp.post_recv(&RecvWr {
            wr_id: RECV_FLAG | u64::from(link.0) << 8 | slot,
            sge,
        })
    }
}

impl Resources for Fabric {
    fn create_qp(&mut self, link: LinkId, device: DeviceId) -> Result<QpInfo, ResourceError> {
        let d = usize::from(device.0);
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
        let rx = pd
            .register(
                RECV_SLOTS as usize * RECV_SLOT_LEN,
                AccessFlags::LOCAL_WRITE,
            )
            .map_err(|_| ResourceError("receive buffer registration failed"))?;
        let info = qp.local_info();
        let l = LinkQp { qp, rx };
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
        let pd = self.pds.get(d).ok_or(ResourceError("no such device"))?;
        let len = usize::try_from(len).map_err(|_| ResourceError("RMB too large"))?;
        let slots = self
            .rmbs
            .entry((lgr, rmb))
            .or_insert_with(|| (0..self.devices.len()).map(|_| None).collect());
        if slots[d].is_none() {
            let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
            let mr = match slots.iter().flatten().next() {
                Some(first) => pd.register_alias(first, access),
                None => pd.register(len, access),
            }
            .map_err(|_| ResourceError("RMB registration failed"))?;
            slots[d] = Some(mr);
        }
        let mr = slots[d].as_ref().ok_or(ResourceError("RMB missing"))?;
        Ok(MrInfo {
            rkey: mr.rkey(),
            vaddr: mr.addr(),
        })
    }

    fn reaches(&self, device: smc_proto::fabric::DeviceId, gid: smc_wire::Gid) -> bool {
        // On the shm fabric a device is one LAN: the port is reachable when it is open on the
        // same device name.
        let Some(d) = self.devices.get(usize::from(device.0)) else {
            return false;
        };
        // A software RoCE port reaches the GIDs on its netdev's subnet.
        if let Some(r) = d.reaches(smc_fabric::Gid(gid.0)) {
            return r;
        }
        let hex: String = gid.0.iter().map(|b| format!("{b:02x}")).collect();
        self.dir.join(d.name()).join(format!("{hex}.sock")).exists()
    }

    fn random_u32(&mut self) -> u32 {
        (self.next_random() >> 32) as u32
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
