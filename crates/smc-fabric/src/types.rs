//! Backend-agnostic verbs vocabulary: identifiers, states, work requests and completions.

use std::fmt;

/// A 16-byte RoCE/IB global identifier of a device port.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// Lower-case hex string of the 16 bytes (used in file names of the shm fabric).
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Gid {
    /// IPv6 notation without zero compression (GIDs are IPv6-shaped).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, pair) in self.0.chunks_exact(2).enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{:02x}{:02x}", pair[0], pair[1])?;
        }
        Ok(())
    }
}

/// A 6-byte MAC address of a device port.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Mac(pub [u8; 6]);

impl fmt::Debug for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            m[0], m[1], m[2], m[3], m[4], m[5]
        )
    }
}

/// Logical state of a device port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PortState {
    /// The port can carry traffic.
    Active,
    /// The port is down: QPs on it are in error and new connections fail.
    Down,
}

/// Asynchronous device events (port changes, fatal QP errors), polled with
/// [`crate::Device::poll_event`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceEvent {
    /// The port became active.
    PortActive,
    /// The port went down.
    PortDown,
    /// A QP of this device entered the error state (peer death, access error, fault).
    QpFatal {
        /// Number of the QP.
        qp_num: u32,
    },
}

/// Access rights of a memory region (a small bit set).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AccessFlags(u32);

impl AccessFlags {
    /// No access beyond local read (always allowed).
    pub const NONE: AccessFlags = AccessFlags(0);
    /// Local work requests (receives) may write the region.
    pub const LOCAL_WRITE: AccessFlags = AccessFlags(1);
    /// A connected remote QP may RDMA WRITE into the region.
    pub const REMOTE_WRITE: AccessFlags = AccessFlags(2);

    /// Raw bits.
    pub const fn bits(self) -> u32 {
        self.0
    }
    /// Whether every flag of `other` is set in `self`.
    pub const fn contains(self, other: AccessFlags) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for AccessFlags {
    type Output = AccessFlags;
    fn bitor(self, rhs: AccessFlags) -> AccessFlags {
        AccessFlags(self.0 | rhs.0)
    }
}

impl fmt::Debug for AccessFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if self.contains(AccessFlags::LOCAL_WRITE) {
            parts.push("LOCAL_WRITE");
        }
        if self.contains(AccessFlags::REMOTE_WRITE) {
            parts.push("REMOTE_WRITE");
        }
        if parts.is_empty() {
            parts.push("NONE");
        }
        f.write_str(&parts.join("|"))
    }
}

/// Path MTU of a queue pair (IB enumeration).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256,
    /// 512 bytes.
    Mtu512,
    /// 1024 bytes.
    Mtu1024,
    /// 2048 bytes.
    Mtu2048,
    /// 4096 bytes.
    Mtu4096,
}

impl Mtu {
    /// MTU in bytes.
    pub const fn bytes(self) -> usize {
        match self {
            Mtu::Mtu256 => 256,
            Mtu::Mtu512 => 512,
            Mtu::Mtu1024 => 1024,
            Mtu::Mtu2048 => 2048,
            Mtu::Mtu4096 => 4096,
        }
    }
    /// IB wire code (1 = 256 ... 5 = 4096), as carried in SMC-R CLC/LLC messages.
    pub const fn code(self) -> u8 {
        match self {
            Mtu::Mtu256 => 1,
            Mtu::Mtu512 => 2,
            Mtu::Mtu1024 => 3,
            Mtu::Mtu2048 => 4,
            Mtu::Mtu4096 => 5,
        }
    }
    /// Decode an IB wire code; `None` for unknown codes.
    pub const fn from_code(code: u8) -> Option<Mtu> {
        match code {
            1 => Some(Mtu::Mtu256),
            2 => Some(Mtu::Mtu512),
            3 => Some(Mtu::Mtu1024),
            4 => Some(Mtu::Mtu2048),
            5 => Some(Mtu::Mtu4096),
            _ => None,
        }
    }
}

/// Verbs states of a reliably connected queue pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QpState {
    /// Freshly created; nothing may be posted.
    Reset,
    /// Receives may be posted; nothing is processed.
    Init,
    /// Ready to receive: the remote QP is known.
    Rtr,
    /// Ready to send.
    Rts,
    /// Error: outstanding and newly posted work completes with [`WcStatus::WrFlushError`].
    Error,
}

impl QpState {
    pub(crate) const fn to_u8(self) -> u8 {
        match self {
            QpState::Reset => 0,
            QpState::Init => 1,
            QpState::Rtr => 2,
            QpState::Rts => 3,
            QpState::Error => 4,
        }
    }
    pub(crate) const fn from_u8(v: u8) -> QpState {
        match v {
            0 => QpState::Reset,
            1 => QpState::Init,
            2 => QpState::Rtr,
            3 => QpState::Rts,
            _ => QpState::Error,
        }
    }
}

/// What the remote side of an RC connection told us (SMC-R carries it in CLC and LLC messages).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteQpInfo {
    /// GID of the remote device port.
    pub gid: Gid,
    /// Remote QP number (24 bits).
    pub qp_num: u32,
    /// The remote's initial send PSN (24 bits): our expected receive PSN.
    pub psn: u32,
    /// Path MTU agreed for the connection.
    pub mtu: Mtu,
}

/// What we tell the remote side about our QP (mirror of [`RemoteQpInfo`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LocalQpInfo {
    /// GID of our device port.
    pub gid: Gid,
    /// Our QP number.
    pub qp_num: u32,
    /// Our initial send PSN.
    pub psn: u32,
    /// Our MTU.
    pub mtu: Mtu,
}

/// Capacities requested at QP creation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpCaps {
    /// Maximum outstanding send-queue work requests.
    pub max_send_wr: u32,
    /// Maximum posted receive work requests.
    pub max_recv_wr: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps {
            max_send_wr: 64,
            max_recv_wr: 64,
        }
    }
}

/// A scatter/gather element: a range of a local memory region named by its lkey.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sge {
    /// Virtual address inside the region (see [`crate::MemoryRegion::addr`]).
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// Local key of the region.
    pub lkey: u32,
}

/// A send-queue work request.
#[derive(Clone, Copy, Debug)]
pub enum SendWr<'a> {
    /// SEND of a small message (copied at post time) into the peer's next posted receive.
    Send {
        /// Caller's identifier, returned in the completion.
        wr_id: u64,
        /// Message bytes (at most [`crate::Device::max_inline`]).
        data: &'a [u8],
        /// Generate a completion on success (errors always complete).
        signaled: bool,
    },
    /// RDMA WRITE from a local memory-region range into (`rkey`, `remote_addr`).
    Write {
        /// Caller's identifier, returned in the completion.
        wr_id: u64,
        /// Source range; must stay unchanged until the work request completes.
        local: Sge,
        /// Destination virtual address in the remote region.
        remote_addr: u64,
        /// Remote key of the destination region.
        rkey: u32,
        /// Generate a completion on success (errors always complete).
        signaled: bool,
    },
    /// RDMA WRITE of caller bytes (copied straight into the remote region when possible).
    WriteInline {
        /// Caller's identifier, returned in the completion.
        wr_id: u64,
        /// Source bytes.
        data: &'a [u8],
        /// Destination virtual address in the remote region.
        remote_addr: u64,
        /// Remote key of the destination region.
        rkey: u32,
        /// Generate a completion on success (errors always complete).
        signaled: bool,
    },
    /// RDMA WRITE of shared, reference-counted bytes: a backend that keeps a WRITE's bytes
    /// until the peer acknowledges them (roce, for retransmission) keeps a reference to
    /// `data` instead of a copy (its packets are sent from the buffer itself); one that places
    /// them at once (shm) treats it as [`SendWr::WriteInline`]. The bytes are immutable
    /// (`Bytes`), so what a retransmission sends is what was posted.
    WriteShared {
        /// Caller's identifier, returned in the completion.
        wr_id: u64,
        /// Source bytes.
        data: &'a bytes::Bytes,
        /// Destination virtual address in the remote region.
        remote_addr: u64,
        /// Remote key of the destination region.
        rkey: u32,
        /// Generate a completion on success (errors always complete).
        signaled: bool,
    },
}

/// The bytes of a packed RDMA WRITE ([`QueuePair::post_write_packed_held`](crate::QueuePair::post_write_packed_held))
/// where the backend keeps them: its packets lie end to end in `buf`, each with the WRITE's
/// next `piece` bytes `stride` bytes after the previous packet's (the last piece may be
/// shorter). The buffer is immutable and reference-counted: a caller that keeps it (SMC-R's
/// replay store) needs no copy of its own.
#[derive(Clone, Debug)]
pub struct PackedBytes {
    /// The buffer the packets lie in.
    pub buf: bytes::Bytes,
    /// Where the WRITE's first byte is in `buf`.
    pub first: usize,
    /// From one piece's start to the next one's.
    pub stride: usize,
    /// The length of every piece but a shorter last.
    pub piece: usize,
    /// The WRITE's length.
    pub len: usize,
}

impl PackedBytes {
    /// The WRITE's bytes, piece by piece.
    pub fn pieces(&self) -> impl Iterator<Item = &[u8]> + '_ {
        let n = if self.piece == 0 {
            0
        } else {
            self.len.div_ceil(self.piece)
        };
        (0..n).filter_map(move |i| {
            let at = self.first + i * self.stride;
            let len = self.piece.min(self.len - i * self.piece);
            self.buf.get(at..at + len)
        })
    }
}

impl<'a> SendWr<'a> {
    /// The work request identifier.
    pub fn wr_id(&self) -> u64 {
        match *self {
            SendWr::Send { wr_id, .. }
            | SendWr::Write { wr_id, .. }
            | SendWr::WriteInline { wr_id, .. }
            | SendWr::WriteShared { wr_id, .. } => wr_id,
        }
    }

    /// This work request with a [`SendWr::WriteShared`] seen as the
    /// [`SendWr::WriteInline`] of the same bytes (for a backend that copies them anyway).
    pub fn flattened(&self) -> SendWr<'a> {
        match *self {
            SendWr::WriteShared {
                wr_id,
                data,
                remote_addr,
                rkey,
                signaled,
            } => SendWr::WriteInline {
                wr_id,
                data: &data[..],
                remote_addr,
                rkey,
                signaled,
            },
            wr => wr,
        }
    }
}

/// A receive work request: where the next incoming SEND lands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecvWr {
    /// Caller's identifier, returned in the completion.
    pub wr_id: u64,
    /// Destination range (region needs [`AccessFlags::LOCAL_WRITE`]).
    pub sge: Sge,
}

/// Status of a work completion (subset of `ibv_wc_status`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WcStatus {
    /// The work request completed.
    Success,
    /// An incoming message was larger than the posted receive buffer.
    LocalLengthError,
    /// A local key or range was invalid when the work request executed.
    LocalProtectionError,
    /// The QP was in (or went to) the error state; the work request was not executed.
    WrFlushError,
    /// The remote side rejected an RDMA access (rkey, bounds or permission).
    RemoteAccessError,
    /// The remote side rejected the request as invalid.
    RemoteInvalidRequest,
    /// Transport retries exhausted (peer unreachable; also used by fault injection).
    RetryExceeded,
    /// Any other failure.
    GeneralError,
}

/// Operation that completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WcOpcode {
    /// A SEND work request.
    Send,
    /// An RDMA WRITE work request.
    RdmaWrite,
    /// A receive work request consumed by an incoming SEND.
    Recv,
}

/// A work completion, as returned by [`crate::CompletionQueue::poll`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkCompletion {
    /// Identifier of the completed work request.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// Operation.
    pub opcode: WcOpcode,
    /// Bytes received (receives) or transferred (sends/writes).
    pub byte_len: u32,
    /// Local QP number the work request belonged to.
    pub qp_num: u32,
}

impl WorkCompletion {
    /// A placeholder value for initialising completion arrays.
    pub const EMPTY: WorkCompletion = WorkCompletion {
        wr_id: 0,
        status: WcStatus::Success,
        opcode: WcOpcode::Send,
        byte_len: 0,
        qp_num: 0,
    };

    /// Whether the status is [`WcStatus::Success`].
    pub fn is_ok(&self) -> bool {
        self.status == WcStatus::Success
    }
}

/// What posting a send-queue work request did at once ([`QueuePair::post_send_status`]).
///
/// [`QueuePair::post_send_status`]: crate::QueuePair::post_send_status
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PostStatus {
    /// An RDMA WRITE was executed during the post: its bytes are in the peer's memory now
    /// (its completion, when signaled, still follows the SENDs posted before it).
    Executed,
    /// Queued (or flushed, on a QP in the error state): the outcome is reported only by the
    /// completion. Every SEND reports this.
    Queued,
}
