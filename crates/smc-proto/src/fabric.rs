//! The fabric as the endpoint sees it: RNICs, reliably connected QPs, registered RMBs, and the
//! operations the runtime performs on them.
//!
//! The model follows the verbs of `smc-fabric` (device GID/MAC, RC QP with QP number, PSN and
//! MTU, memory region with rkey and address) without depending on that crate. Resource
//! allocation that must return identifiers synchronously (a new QP's number and initial PSN,
//! a registered RMB's rkey and address) and every random identifier go through the
//! caller-supplied [`Resources`] trait; everything else (connecting a QP, posting a SEND or an
//! RDMA WRITE, destroying a QP) is an output, [`FabricOp`], that the runtime performs and
//! completes with [`Endpoint::handle_completion`](crate::endpoint::Endpoint::handle_completion).

use core::fmt;

use smc_wire::{Gid, Mac, QpMtu, U24};

use crate::rmb_pool::RmbId;

/// Index of one of the endpoint's RNICs in [`EndpointConfig::devices`](crate::endpoint::EndpointConfig::devices).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceId(pub u8);

/// A set of the endpoint's RNICs: those on the physical network (PNET) of one connection.
///
/// A link group uses only RNICs of its set, so all its links stay on the physical network
/// its connections' TCP traffic uses. [`DeviceSet::ALL`] (the default) puts no restriction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeviceSet {
    bits: [u64; 4],
}

impl DeviceSet {
    /// Every RNIC, also those added later.
    pub const ALL: DeviceSet = DeviceSet {
        bits: [u64::MAX; 4],
    };
    /// No RNIC.
    pub const EMPTY: DeviceSet = DeviceSet { bits: [0; 4] };

    /// The set of the given RNICs.
    pub fn from_ids(ids: impl IntoIterator<Item = DeviceId>) -> DeviceSet {
        let mut s = DeviceSet::EMPTY;
        for d in ids {
            s.insert(d);
        }
        s
    }

    /// Add `d`.
    pub fn insert(&mut self, d: DeviceId) {
        self.bits[usize::from(d.0 >> 6)] |= 1u64 << (d.0 & 63);
    }

    /// Whether `d` is in the set.
    pub fn contains(&self, d: DeviceId) -> bool {
        self.bits[usize::from(d.0 >> 6)] & (1u64 << (d.0 & 63)) != 0
    }

    /// The lowest-numbered member below `devices`.
    pub fn first(&self, devices: usize) -> Option<DeviceId> {
        (0..devices.min(256))
            .map(|d| DeviceId(d as u8))
            .find(|d| self.contains(*d))
    }
}

impl Default for DeviceSet {
    fn default() -> Self {
        DeviceSet::ALL
    }
}

/// One RNIC (RoCE port) the endpoint may use: its addresses on the RoCE LAN and path MTU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Device {
    /// GID of the port.
    pub gid: Gid,
    /// MAC of the port.
    pub mac: Mac,
    /// Largest path MTU the port supports.
    pub mtu: QpMtu,
    /// Whether the port can carry SMC-Rv2, `gid` then being its RoCEv2 GID (IPv4-mapped on a
    /// RoCE port; the shm fabric's own GID on shm, see docs/v2.md).
    pub roce_v2: bool,
}

/// Identifies a link group inside one endpoint (never reused).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LgrId(pub u32);

/// Identifies one link (one RC QP) inside one endpoint, across all link groups (never reused,
/// unlike link numbers, which the server assigns per link group).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LinkId(pub u32);

impl fmt::Display for LinkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "link#{}", self.0)
    }
}

/// Identifies one posted work request; its completion comes back with the same id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WrId(pub u64);

/// What a newly created QP returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QpInfo {
    /// QP number.
    pub qpn: U24,
    /// Initial packet sequence number (random, from the fabric).
    pub psn: U24,
}

/// What registering an RMB with one link's protection domain returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MrInfo {
    /// Remote key the peer uses in RDMA WRITEs on that link.
    pub rkey: u32,
    /// Virtual address of the RMB's first byte as the peer addresses it.
    pub vaddr: u64,
}

/// A local resource could not be had (no memory, no QP): the rendezvous declines with
/// "insufficient resources" or the link is not added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[error("local fabric resources unavailable: {0}")]
pub struct ResourceError(pub &'static str);

/// Local resources and randomness, supplied by the caller (runtime or harness).
///
/// The endpoint calls these synchronously while it processes an input. Identifiers that the
/// RFC wants random (link user IDs, alert tokens) come from [`random_u32`](Self::random_u32);
/// the peer-ID instance is chosen by the caller before the endpoint is created.
pub trait Resources {
    /// Create an RC QP on `device` for `link` (reset → init), with receive buffers for the
    /// messages of LLC version `llc`; return its number and initial PSN.
    fn create_qp(
        &mut self,
        link: LinkId,
        device: DeviceId,
        llc: LlcVersion,
    ) -> Result<QpInfo, ResourceError>;
    /// Allocate (once per `rmb`) and register RMB `rmb` of link group `lgr`, `len` bytes, for
    /// remote write on `link` (on `device`); return the rkey and address on that link.
    fn register_rmb(
        &mut self,
        lgr: LgrId,
        rmb: RmbId,
        len: u64,
        link: LinkId,
        device: DeviceId,
    ) -> Result<MrInfo, ResourceError>;
    /// A random 32-bit number.
    fn random_u32(&mut self) -> u32;

    /// Make the peer's RMB, named by its RToken `rkey` on `link`, writable over that link
    /// now, with whatever local resources that takes (the shm fabric maps the peer's memory,
    /// which takes a descriptor for a moment), so that no RDMA WRITE to it fails later for
    /// want of them. Called when the peer adds an RMB to a working link group (CONFIRM
    /// RKEY): an error there ends only the connection that wanted the RMB. The default needs
    /// nothing (an RNIC resolves an rkey at the peer).
    fn take_peer_rtoken(&mut self, link: LinkId, rkey: u32) -> Result<(), ResourceError> {
        let _ = (link, rkey);
        Ok(())
    }

    /// Whether our RNIC `device` reaches the RoCE port `gid` (is on the same LAN). A server
    /// prefers such an RNIC for a first contact; the default says yes to every pair.
    fn reaches(&self, device: DeviceId, gid: Gid) -> bool {
        let _ = (device, gid);
        true
    }

    /// Whether a QP of our RNIC `device` can be connected to the RoCE port `gid` at all, when
    /// that is known before trying: the shm fabric knows the ports of its fabric directory
    /// (a peer in another directory, a program of another user, is out of reach). The
    /// default says yes: only the QP's connect tells (a routed RoCEv2 path may work off the
    /// LAN). A client told no declines in place of its Confirm.
    fn connectable(&self, device: DeviceId, gid: Gid) -> bool {
        let _ = (device, gid);
        true
    }

    /// The device that speaks to the RoCE port `gid` from the RNIC of our `device`: `device`
    /// itself when its GID suits (the default), another GID of the same RNIC (a RoCEv2 RNIC
    /// with an IPv4-mapped and an IPv6 GID is one device per GID to the endpoint, and a
    /// peer's GID of one kind is reached only from a GID of that kind), or `None` when the
    /// RNIC has no GID for it.
    fn port_for(&self, device: DeviceId, gid: Gid) -> Option<DeviceId> {
        let _ = gid;
        Some(device)
    }
}

/// The peer side of a QP, to move our QP to ready-to-send.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteQp {
    /// Peer GID.
    pub gid: Gid,
    /// Peer MAC.
    pub mac: Mac,
    /// Peer QP number.
    pub qpn: U24,
    /// Peer initial PSN.
    pub psn: U24,
    /// Path MTU to use (the smaller of both sides).
    pub mtu: QpMtu,
}

/// The bytes of one SEND: 44 (every v1 LLC message and every CDC message, kept inline so that
/// the data path allocates nothing) or an LLC v2 message of up to
/// [`LLC_V2_MAX_LEN`](smc_wire::llc_v2::LLC_V2_MAX_LEN) bytes (spec §10.2: an LLC v2 message is
/// never longer than 8192 bytes).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum SendMsg {
    /// A 44-byte message.
    Msg44([u8; smc_wire::MSG44_LEN]),
    /// A longer LLC v2 message (more than 44, at most 8192 bytes).
    Long(Box<[u8]>),
}

impl SendMsg {
    /// `bytes` as a SEND: inline when 44 bytes long; `None` when shorter than 44 or longer than
    /// 8192 bytes (no SMC-R message is).
    pub fn new(bytes: &[u8]) -> Option<SendMsg> {
        if let Ok(b) = <[u8; smc_wire::MSG44_LEN]>::try_from(bytes) {
            return Some(SendMsg::Msg44(b));
        }
        (smc_wire::MSG44_LEN..=smc_wire::llc_v2::LLC_V2_MAX_LEN)
            .contains(&bytes.len())
            .then(|| SendMsg::Long(bytes.into()))
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            SendMsg::Msg44(b) => b,
            SendMsg::Long(b) => b,
        }
    }
}

impl From<[u8; smc_wire::MSG44_LEN]> for SendMsg {
    fn from(b: [u8; smc_wire::MSG44_LEN]) -> SendMsg {
        SendMsg::Msg44(b)
    }
}

impl core::ops::Deref for SendMsg {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_bytes()
    }
}

/// The LLC version of a link's group, which sizes the receive buffers of its QP: every SEND
/// of a v1 link is 44 bytes; a v2 link receives LLC v2 messages of up to 8192 bytes (spec
/// §10.2: a receive buffer shorter than the SEND fails the QP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LlcVersion {
    /// SMC-R v1 (RFC 7609): 44-byte messages.
    V1,
    /// SMC-Rv2: LLC v2 messages up to 8192 bytes.
    V2,
}

impl LlcVersion {
    /// The longest SEND a link of this version receives.
    pub fn max_recv(self) -> usize {
        match self {
            LlcVersion::V1 => smc_wire::MSG44_LEN,
            LlcVersion::V2 => smc_wire::llc_v2::LLC_V2_MAX_LEN,
        }
    }
}

/// A fabric operation the runtime must perform, in the order given.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum FabricOp {
    /// Connect our QP of `link` to the peer's QP (init → RTR → RTS), then call
    /// [`Endpoint::link_connected`](crate::Endpoint::link_connected) (or, when it could not
    /// be connected, [`Endpoint::handle_link_failure`](crate::Endpoint::handle_link_failure)).
    ConnectQp {
        /// The link.
        link: LinkId,
        /// Our device.
        device: DeviceId,
        /// The peer's QP.
        remote: RemoteQp,
    },
    /// Post an IB SEND of an LLC or CDC message on `link`.
    PostSend {
        /// The link.
        link: LinkId,
        /// Completion id.
        wr: WrId,
        /// The message.
        msg: SendMsg,
    },
    /// Post an RDMA WRITE of `data` to the peer's memory `(rkey, addr)` on `link`.
    ///
    /// The engine keeps a copy of the bytes until the peer is known to have them, so that it
    /// can replay the write on another link after a failure (RFC 7609 §4.6.2).
    RdmaWrite {
        /// The link.
        link: LinkId,
        /// Completion id.
        wr: WrId,
        /// Peer rkey of the target RMB on this link.
        rkey: u32,
        /// Target address.
        addr: u64,
        /// The bytes.
        data: Vec<u8>,
    },
    /// Destroy the QP of `link` (flushing whatever is still posted).
    DestroyQp {
        /// The link.
        link: LinkId,
    },
    /// Deregister and free RMB `rmb` of link group `lgr` on every link.
    FreeRmb {
        /// The link group.
        lgr: LgrId,
        /// The RMB.
        rmb: RmbId,
    },
}

#[cfg(test)]
mod tests {
    use super::SendMsg;

    #[test]
    fn send_msg_lengths() {
        // 44 bytes stay inline; 45..=8192 are an LLC v2 message; nothing else is a SEND.
        assert!(matches!(SendMsg::new(&[7; 44]), Some(SendMsg::Msg44(b)) if b == [7; 44]));
        for len in [45, 88, 72 + 16 * 255, 8192] {
            let m = SendMsg::new(&vec![3; len]).expect("a v2 length");
            assert!(matches!(m, SendMsg::Long(_)));
            assert_eq!(m.as_bytes(), &vec![3; len][..]);
            assert_eq!(m.len(), len);
        }
        for len in [0, 1, 43, 8193, 65536] {
            assert_eq!(SendMsg::new(&vec![0; len]), None, "{len}");
        }
        assert_eq!(SendMsg::from([1; 44]).as_bytes(), &[1; 44]);
    }
}
