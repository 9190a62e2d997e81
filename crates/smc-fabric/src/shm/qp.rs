//! Reliably connected queue pairs over the shm fabric.

use super::control::{self, Watch};
use super::cq::CqShared;
use super::device::{lock, DeviceCore, DeviceHandle};
use super::mem::{self, Mapping};
use super::mr::{resolve_local, MrInner};
use super::wire::{self, Msg, Received};
use crate::error::{FabricError, Result};
use crate::ring::{
    ring_bytes, Consumer, Producer, RawSlots, RingHeader, SlotMem as _, HEADER_SIZE, MAX_INLINE,
    MAX_SEND, MAX_SEND_SLOTS,
};
use crate::types::{
    Gid, LocalQpInfo, Mtu, PostStatus, QpCaps, QpState, RecvWr, RemoteQpInfo, SendWr, WcOpcode,
    WcStatus, WorkCompletion,
};
use foldhash::{HashMap, HashMapExt as _};
use rustix::fd::{AsFd, OwnedFd};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// A [`SendWr::WriteShared`] past [`SendWr::flattened`] (not reached: `post_send` flattens
/// every work request first).
const NOT_FLAT: FabricError = FabricError::InvalidArgument("shared WRITE not flattened");

/// Largest receive-ring capacity accepted from a peer.
const MAX_RING_CAP: u32 = 1 << 16;

struct Meta {
    remote: Option<RemoteQpInfo>,
    /// The peer that connected to our receive side (from its Hello).
    peer: Option<(Gid, u32)>,
}

struct PostedRecv {
    wr_id: u64,
    mr: Arc<MrInner>,
    off: usize,
    len: u32,
}

struct RecvSide {
    consumer: Consumer,
    posted: VecDeque<PostedRecv>,
    /// Receive WRs ever posted (published to the peer as ring credits).
    posted_total: u64,
    /// Doorbell of the peer's send CQ (rung when it waits for ring space).
    peer_tx_bell: Option<OwnedFd>,
}

struct RemoteMr {
    mapping: Mapping,
    vaddr: u64,
}

/// Our connection to the peer's receive side.
struct Outbound {
    sock: Arc<OwnedFd>,
    ring: Mapping,
    capacity: u32,
    producer: Producer,
    rx_bell: OwnedFd,
    /// Shared: a WRITE placed outside the send lock keeps its mapping while it copies.
    mrs: HashMap<u32, Arc<RemoteMr>>,
    epoch: u64,
    /// SENDs placed into the peer's ring.
    sent: u64,
    /// SENDs known to have a receive WR at the peer (covered by its credits, or consumed).
    acked: u64,
    /// Executed work requests whose completion waits for `acked` (in order).
    inflight: VecDeque<Inflight>,
}

/// An executed work request whose completion waits until the SENDs up to `seq` were accepted
/// by a receive WR of the peer (RC: a SEND completes once the receiver took it; a work request
/// completes only after those before it).
struct Inflight {
    wr_id: u64,
    opcode: WcOpcode,
    len: u32,
    signaled: bool,
    seq: u64,
    /// The ring's tail (in slots) after the SENDs up to `seq`: the peer consumed them once its
    /// `head` reached it.
    slot_end: u64,
}

impl Outbound {
    fn header(&self) -> &RingHeader {
        ring_header(&self.ring)
    }
    fn slots(&self) -> RawSlots {
        // SAFETY: the slot area follows the header inside the mapping owned by `self`; the
        // returned value is used only while `self` is borrowed.
        unsafe { RawSlots::new(self.ring.ptr().add(HEADER_SIZE), self.capacity as usize) }
    }
}

/// The header of a peer's ring mapping.
fn ring_header(ring: &Mapping) -> &RingHeader {
    // SAFETY: the mapping is page aligned and at least `ring_bytes(capacity)` long (validated
    // against the sealed memfd's size); `RingHeader` consists of atomics only, so any bytes
    // the peer writes are a valid value and concurrent modification is permitted. The
    // reference does not outlive the borrow of the mapping.
    unsafe { &*(ring.ptr() as *const RingHeader) }
}

enum WriteSrc {
    Mr(Arc<MrInner>, usize, u32),
    Bytes(Vec<u8>),
}

/// The bytes of a queued SEND: a short one inline, a long one (an SMC-Rv2 LLC message) on
/// the heap.
enum SendBytes {
    Inline([u8; MAX_INLINE], usize),
    Long(Box<[u8]>),
}

impl SendBytes {
    fn new(data: &[u8]) -> SendBytes {
        if data.len() <= MAX_INLINE {
            let mut buf = [0u8; MAX_INLINE];
            buf[..data.len()].copy_from_slice(data);
            SendBytes::Inline(buf, data.len())
        } else {
            SendBytes::Long(data.into())
        }
    }
    fn as_slice(&self) -> &[u8] {
        match self {
            SendBytes::Inline(buf, len) => &buf[..*len],
            SendBytes::Long(b) => b,
        }
    }
}

enum Pending {
    Send {
        wr_id: u64,
        data: SendBytes,
        signaled: bool,
    },
    Write {
        wr_id: u64,
        src: WriteSrc,
        remote_addr: u64,
        rkey: u32,
        signaled: bool,
    },
}

impl Pending {
    fn wr_id(&self) -> u64 {
        match self {
            Pending::Send { wr_id, .. } | Pending::Write { wr_id, .. } => *wr_id,
        }
    }
    fn opcode(&self) -> WcOpcode {
        match self {
            Pending::Send { .. } => WcOpcode::Send,
            Pending::Write { .. } => WcOpcode::RdmaWrite,
        }
    }
}

/// A work request ready to execute, borrowing its source bytes.
enum Op<'a> {
    Send {
        data: &'a [u8],
    },
    /// The source is a raw range: it may be a local region a peer can also write, so it is
    /// never turned into a slice.
    Write {
        src: *const u8,
        len: usize,
        remote_addr: u64,
        rkey: u32,
        _p: std::marker::PhantomData<&'a [u8]>,
    },
}

impl Op<'_> {
    fn write(src: *const u8, len: usize, remote_addr: u64, rkey: u32) -> Self {
        Op::Write {
            src,
            len,
            remote_addr,
            rkey,
            _p: std::marker::PhantomData,
        }
    }
}

enum Exec {
    /// Executed (or flushed); completion if one is due.
    Done(Option<WorkCompletion>),
    /// An RDMA WRITE was executed: its bytes are in the peer's memory (the completion, if one
    /// is due now, is returned; otherwise it follows the SENDs before it).
    Written(Option<WorkCompletion>),
    /// The peer's receive ring is full; retry later.
    Full,
    /// Failed: the completion carries the error and the QP must enter the error state.
    Fatal(WorkCompletion),
}

struct SendSide {
    out: Option<Outbound>,
    pending: VecDeque<Pending>,
}

/// A queue pair.
pub(crate) struct QpShared {
    pub(crate) dev: Arc<DeviceHandle>,
    pub(crate) qpn: u32,
    pub(crate) pd: u32,
    psn: u32,
    caps: QpCaps,
    state: AtomicU8,
    pub(crate) send_cq: Arc<CqShared>,
    pub(crate) recv_cq: Arc<CqShared>,
    meta: Mutex<Meta>,
    /// Serialises INIT → RTR (which connects without holding `meta`, so that two processes
    /// connecting to each other at once cannot deadlock on each other's control threads).
    transition: Mutex<()>,
    inbound_fd: OwnedFd,
    inbound: Mapping,
    inbound_cap: u32,
    /// Doorbell the peer rings when it put a message into our ring (in the recv CQ's channel).
    rx_bell: OwnedFd,
    /// Doorbell the peer rings when it freed ring space we wait for (in the send CQ's channel).
    tx_bell: OwnedFd,
    recv: Mutex<RecvSide>,
    send: Mutex<SendSide>,
    has_pending: AtomicBool,
    /// The next message of our receive ring, for the lock-free
    /// [`maybe_readable`](Self::maybe_readable): its slot (high 32 bits) and the `seq` that
    /// publishes it (low 32 bits), one word so that the two never disagree.
    rx_next: AtomicU64,
    /// Where our next small RDMA WRITE most likely lands (just past the last one, in the
    /// peer's mapped region; 0: unknown, or the last one was large) and how many lines it
    /// likely covers (as many as the last one, at most 4), for the write prefetch of
    /// [`maybe_readable`](Self::maybe_readable). A plain address, never dereferenced.
    tx_next_write_at: AtomicUsize,
    tx_next_write_lines: AtomicUsize,
}

/// [`QpShared::rx_next`] for the next message of `c`.
fn rx_next_word(c: &Consumer) -> u64 {
    u64::from(c.slot()) << 32 | u64::from(c.next_seq())
}

fn wc(
    wr_id: u64,
    status: WcStatus,
    opcode: WcOpcode,
    byte_len: u32,
    qp_num: u32,
) -> WorkCompletion {
    WorkCompletion {
        wr_id,
        status,
        opcode,
        byte_len,
        qp_num,
    }
}

impl QpShared {
    pub(crate) fn create(
        dev: Arc<DeviceHandle>,
        pd: u32,
        send_cq: Arc<CqShared>,
        recv_cq: Arc<CqShared>,
        caps: QpCaps,
    ) -> Result<Arc<QpShared>> {
        if caps.max_send_wr == 0 || caps.max_recv_wr == 0 || caps.max_recv_wr > MAX_RING_CAP {
            return Err(FabricError::InvalidArgument("queue depths"));
        }
        if !Arc::ptr_eq(&send_cq.dev, &dev) || !Arc::ptr_eq(&recv_cq.dev, &dev) {
            return Err(FabricError::Mismatch);
        }
        let cap = caps
            .max_recv_wr
            .max(MAX_SEND_SLOTS)
            .next_power_of_two()
            .min(MAX_RING_CAP);
        let inbound_fd = mem::sealed_memfd("smc-fabric-ring", ring_bytes(cap))?;
        let inbound = Mapping::map(inbound_fd.as_fd(), ring_bytes(cap))?;
        let core = &dev.core;
        let rx_bell = mem::new_eventfd()?;
        let tx_bell = mem::new_eventfd()?;
        recv_cq.add_bell(rx_bell.as_fd())?;
        if let Err(e) = send_cq.add_bell(tx_bell.as_fd()) {
            recv_cq.remove_bell(rx_bell.as_fd());
            return Err(e);
        }
        let qpn = core.alloc_qpn();
        let psn = u32::from_le_bytes(mem::random_bytes()) & 0x00ff_ffff;
        let qp = Arc::new(QpShared {
            dev: dev.clone(),
            qpn,
            pd,
            psn,
            caps,
            state: AtomicU8::new(QpState::Reset.to_u8()),
            send_cq: send_cq.clone(),
            recv_cq: recv_cq.clone(),
            transition: Mutex::new(()),
            meta: Mutex::new(Meta {
                remote: None,
                peer: None,
            }),
            inbound_fd,
            inbound,
            inbound_cap: cap,
            rx_bell,
            tx_bell,
            recv: Mutex::new(RecvSide {
                consumer: Consumer::new(cap),
                posted: VecDeque::new(),
                posted_total: 0,
                peer_tx_bell: None,
            }),
            send: Mutex::new(SendSide {
                out: None,
                pending: VecDeque::new(),
            }),
            has_pending: AtomicBool::new(false),
            rx_next: AtomicU64::new(rx_next_word(&Consumer::new(cap))),
            tx_next_write_at: AtomicUsize::new(0),
            tx_next_write_lines: AtomicUsize::new(1),
        });
        lock(&core.qps).insert(qpn, Arc::downgrade(&qp));
        send_cq.attach(&qp);
        recv_cq.attach(&qp);
        Ok(qp)
    }

    fn core(&self) -> &DeviceCore {
        &self.dev.core
    }

    pub(crate) fn state(&self) -> QpState {
        QpState::from_u8(self.state.load(Ordering::Acquire))
    }

    pub(crate) fn local_info(&self) -> LocalQpInfo {
        LocalQpInfo {
            gid: self.core().gid,
            qp_num: self.qpn,
            psn: self.psn,
            mtu: Mtu::Mtu4096,
        }
    }

    pub(crate) fn remote_info(&self) -> Option<RemoteQpInfo> {
        lock(&self.meta).remote
    }

    pub(crate) fn inbound_header(&self) -> &RingHeader {
        // SAFETY: our own ring mapping is page aligned and at least HEADER_SIZE long; the header
        // holds atomics only (the peer may write them concurrently, which atomics permit); the
        // mapping lives as long as `self`.
        unsafe { &*(self.inbound.ptr() as *const RingHeader) }
    }

    /// Start of our receive-ring mapping (tests scribble over it like a hostile peer).
    #[cfg(test)]
    pub(crate) fn inbound_ptr(&self) -> *mut u8 {
        self.inbound.ptr()
    }

    fn inbound_slots(&self) -> RawSlots {
        // SAFETY: the slot area of our ring mapping, which lives as long as `self`.
        unsafe {
            RawSlots::new(
                self.inbound.ptr().add(HEADER_SIZE),
                self.inbound_cap as usize,
            )
        }
    }

    pub(crate) fn inbound_capacity(&self) -> u32 {
        self.inbound_cap
    }

    pub(crate) fn inbound_memfd(&self) -> rustix::fd::BorrowedFd<'_> {
        self.inbound_fd.as_fd()
    }

    /// Our receive doorbell, handed to the peer.
    pub(crate) fn rx_bell(&self) -> rustix::fd::BorrowedFd<'_> {
        self.rx_bell.as_fd()
    }

    fn cas_state(&self, from: QpState, to: QpState) -> Result<()> {
        self.state
            .compare_exchange(
                from.to_u8(),
                to.to_u8(),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .map(|_| ())
            .map_err(|cur| FabricError::InvalidTransition {
                from: QpState::from_u8(cur),
                to,
            })
    }

    /// RESET → INIT.
    pub(crate) fn to_init(&self) -> Result<()> {
        self.cas_state(QpState::Reset, QpState::Init)
    }

    /// INIT → RTR: record the remote QP and connect to its device.
    pub(crate) fn to_rtr(&self, remote: RemoteQpInfo) -> Result<()> {
        let _transition = lock(&self.transition);
        let st = self.state();
        if st != QpState::Init {
            return Err(FabricError::InvalidTransition {
                from: st,
                to: QpState::Rtr,
            });
        }
        if remote.qp_num == 0 || remote.qp_num > 0x00ff_ffff || remote.psn > 0x00ff_ffff {
            return Err(FabricError::InvalidArgument(
                "remote QP number or PSN out of range",
            ));
        }
        let core = self.core();
        if !core.port_up.load(Ordering::Acquire) {
            return Err(FabricError::PortDown);
        }
        {
            let mut meta = lock(&self.meta);
            if let Some((g, q)) = meta.peer {
                if g != remote.gid || q != remote.qp_num {
                    return Err(FabricError::PeerViolation(
                        "another peer connected to this QP",
                    ));
                }
            }
            meta.remote = Some(remote);
        }
        let out = match self.connect(remote) {
            Ok(o) => o,
            Err(e) => {
                lock(&self.meta).remote = None;
                return Err(e);
            }
        };
        let sock = out.sock.clone();
        {
            let mut s = lock(&self.send);
            if self.state() != QpState::Init {
                return Err(FabricError::InvalidTransition {
                    from: self.state(),
                    to: QpState::Rtr,
                });
            }
            s.out = Some(out);
        }
        self.cas_state(QpState::Init, QpState::Rtr)?;
        lock(&core.inbox).push(Watch {
            qpn: self.qpn,
            sock,
        });
        core.wake_control();
        Ok(())
    }

    fn connect(&self, remote: RemoteQpInfo) -> Result<Outbound> {
        let core = self.core();
        let path = core.dev_dir.join(format!("{}.sock", remote.gid.to_hex()));
        let sock = control::connect(&path)?;
        let hello = Msg::Hello {
            src_gid: core.gid,
            src_qpn: self.qpn,
            dst_qpn: remote.qp_num,
        };
        wire::send(sock.as_fd(), &hello, &[self.tx_bell.as_fd()])?;
        let (capacity, mut fds) = match wire::recv(sock.as_fd())? {
            Received::Msg(Msg::HelloOk { capacity }, fds) => (capacity, fds),
            Received::Msg(Msg::Refused { reason }, _) => {
                return Err(FabricError::PeerUnreachable(format!(
                    "connection refused ({reason})"
                )))
            }
            Received::Msg(..) => return Err(FabricError::PeerViolation("unexpected hello reply")),
            Received::Closed | Received::WouldBlock => {
                return Err(FabricError::PeerUnreachable("no hello reply".into()))
            }
        };
        if capacity == 0 || capacity > MAX_RING_CAP || fds.len() != 2 {
            return Err(FabricError::PeerViolation("bad hello reply"));
        }
        let rx_bell =
            mem::make_peer_bell(fds.pop().ok_or(FabricError::PeerViolation("hello fds"))?)?;
        let ring_fd = fds.pop().ok_or(FabricError::PeerViolation("hello fds"))?;
        let len = ring_bytes(capacity);
        mem::validate_peer_memfd(ring_fd.as_fd(), len)?;
        let ring = Mapping::map(ring_fd.as_fd(), len)?;
        let mut out = Outbound {
            sock: Arc::new(sock),
            ring,
            capacity,
            producer: Producer::new(capacity),
            rx_bell,
            mrs: HashMap::new(),
            epoch: 0,
            sent: 0,
            acked: 0,
            inflight: VecDeque::new(),
        };
        out.epoch = out.header().epoch.load(Ordering::Acquire);
        Ok(out)
    }

    /// RTR → RTS.
    pub(crate) fn to_rts(&self) -> Result<()> {
        self.cas_state(QpState::Rtr, QpState::Rts)
    }

    /// Called by the control thread on a peer's Hello. `Err` carries the refusal reason.
    pub(crate) fn accept_peer(
        &self,
        gid: Gid,
        qpn: u32,
        peer_bell: OwnedFd,
    ) -> std::result::Result<(), u32> {
        if !matches!(self.state(), QpState::Init | QpState::Rtr | QpState::Rts) {
            return Err(wire::REFUSE_STATE);
        }
        {
            let mut meta = lock(&self.meta);
            if meta.peer.is_some() {
                return Err(wire::REFUSE_PEER);
            }
            if let Some(r) = meta.remote {
                if r.gid != gid || r.qp_num != qpn {
                    return Err(wire::REFUSE_PEER);
                }
            }
            meta.peer = Some((gid, qpn));
        }
        lock(&self.recv).peer_tx_bell = Some(peer_bell);
        Ok(())
    }

    /// Whether the connected peer is the remote this QP was moved to RTR with.
    pub(crate) fn peer_confirmed(&self) -> bool {
        let meta = lock(&self.meta);
        match (meta.remote, meta.peer) {
            (Some(r), Some((g, q))) => r.gid == g && r.qp_num == q,
            _ => false,
        }
    }

    pub(crate) fn has_pending(&self) -> bool {
        self.has_pending.load(Ordering::Acquire)
    }

    /// Whether the peer may have put a message into our receive ring that we did not consume
    /// yet: one load of the next slot's `seq`, no lock (that load brings the message's line
    /// along for the poll that follows). A hint for spinning pollers (a scribbled `seq` makes
    /// it say yes; polling then finds what is wrong).
    pub(crate) fn maybe_readable(&self) -> bool {
        let next = self.rx_next.load(Ordering::Relaxed);
        let (slot, seq) = ((next >> 32) as usize, next as u32);
        if self.inbound_slots().published(slot) != seq {
            return false;
        }
        // A message from the peer usually answers ours: the peer has read the bytes of our
        // last WRITE, and our next one lands right after them. That line (which the peer's
        // read left shared) starts coming over for writing now, so that the store of our
        // answer finds it in our cache instead of waiting for the peer's copy to be
        // invalidated at the first locked instruction after it, before the SEND that
        // announces it (A/B, busy 1-byte ping-pong without it: 4 of 16 alternating pairs
        // faster, median per-pair ratio 1.02). Not the slot of our next SEND: the peer spins
        // on it (its `seq`) from the moment it waits for our answer, and would only take it
        // back.
        let at = self.tx_next_write_at.load(Ordering::Relaxed);
        if at != 0 {
            let lines = self.tx_next_write_lines.load(Ordering::Relaxed);
            let first = at / mem::LINE;
            for line in first..first + lines.min(crate::PrefetchHint::MAX_LINES) {
                mem::prefetch_for_write(line * mem::LINE);
            }
        }
        true
    }

    /// Post a send-queue work request.
    pub(crate) fn post_send(&self, wr: &SendWr<'_>) -> Result<PostStatus> {
        // Bytes are placed at once (or copied into the pending queue): shared bytes are
        // written as inline ones.
        let flat = wr.flattened();
        let wr = &flat;
        let mut status = PostStatus::Queued;
        let st = self.state();
        match st {
            QpState::Rts => {}
            QpState::Error => {
                let op = match wr {
                    SendWr::Send { .. } => WcOpcode::Send,
                    _ => WcOpcode::RdmaWrite,
                };
                self.send_cq
                    .push(wc(wr.wr_id(), WcStatus::WrFlushError, op, 0, self.qpn));
                return Ok(PostStatus::Queued);
            }
            s => return Err(FabricError::InvalidState(s)),
        }
        let mut local_mr = None;
        match *wr {
            SendWr::Send { data, .. } => {
                if data.len() > MAX_SEND {
                    return Err(FabricError::MessageTooLarge {
                        len: data.len(),
                        max: MAX_SEND,
                    });
                }
            }
            SendWr::Write { local, .. } => {
                local_mr = Some(resolve_local(
                    self.core(),
                    self.pd,
                    local.lkey,
                    local.addr,
                    local.length,
                    false,
                )?);
            }
            SendWr::WriteShared { .. } => return Err(NOT_FLAT),
            SendWr::WriteInline { data, .. } => {
                if u32::try_from(data.len()).is_err() {
                    return Err(FabricError::MessageTooLarge {
                        len: data.len(),
                        max: u32::MAX as usize,
                    });
                }
            }
        }
        let mut queued = Ok(());
        let mut fatal;
        {
            let mut s = lock(&self.send);
            fatal = self.drain_pending(&mut s);
            if s.pending.is_empty() && !fatal {
                let (op, signaled, opcode) = match (*wr, &local_mr) {
                    (SendWr::Send { data, signaled, .. }, _) => {
                        (Op::Send { data }, signaled, WcOpcode::Send)
                    }
                    (
                        SendWr::Write {
                            local,
                            remote_addr,
                            rkey,
                            signaled,
                            ..
                        },
                        Some((mr, off)),
                    ) => {
                        // SAFETY: `resolve_local` checked that [off, off+length) lies inside the
                        // region's mapping, so the offset pointer stays in bounds.
                        let src = unsafe { mr.mapping.ptr().add(*off) }.cast_const();
                        let len = local.length as usize;
                        (
                            Op::write(src, len, remote_addr, rkey),
                            signaled,
                            WcOpcode::RdmaWrite,
                        )
                    }
                    (
                        SendWr::WriteInline {
                            data,
                            remote_addr,
                            rkey,
                            signaled,
                            ..
                        },
                        _,
                    ) => (
                        Op::write(data.as_ptr(), data.len(), remote_addr, rkey),
                        signaled,
                        WcOpcode::RdmaWrite,
                    ),
                    (SendWr::Write { .. }, None) => return Err(FabricError::LocalAccess),
                    (SendWr::WriteShared { .. }, _) => return Err(NOT_FLAT),
                };
                match self.exec(&mut s.out, wr.wr_id(), op, opcode, signaled) {
                    Exec::Done(Some(c)) => self.send_cq.push(c),
                    Exec::Done(None) => {}
                    Exec::Written(c) => {
                        status = PostStatus::Executed;
                        if let Some(c) = c {
                            self.send_cq.push(c);
                        }
                    }
                    Exec::Fatal(c) => {
                        self.flush_inflight(&mut s.out);
                        self.send_cq.push(c);
                        fatal = true;
                    }
                    Exec::Full => {
                        if let Err(e) = self.enqueue(&mut s, wr, local_mr) {
                            self.update_has_pending(&s);
                            return Err(e);
                        }
                    }
                }
            } else {
                // Behind queued work (or behind a failure that is about to flush the queue).
                queued = self.enqueue(&mut s, wr, local_mr);
            }
            self.update_has_pending(&s);
        }
        if fatal {
            self.enter_error("work request failed");
        }
        queued.map(|()| status)
    }

    fn enqueue(
        &self,
        s: &mut SendSide,
        wr: &SendWr<'_>,
        local: Option<(Arc<MrInner>, usize)>,
    ) -> Result<()> {
        if s.pending.len() >= self.caps.max_send_wr as usize {
            return Err(FabricError::QueueFull);
        }
        let p = match (*wr, local) {
            (
                SendWr::Send {
                    wr_id,
                    data,
                    signaled,
                },
                _,
            ) => Pending::Send {
                wr_id,
                data: SendBytes::new(data),
                signaled,
            },
            (
                SendWr::Write {
                    wr_id,
                    local,
                    remote_addr,
                    rkey,
                    signaled,
                },
                Some((mr, off)),
            ) => Pending::Write {
                wr_id,
                src: WriteSrc::Mr(mr, off, local.length),
                remote_addr,
                rkey,
                signaled,
            },
            (
                SendWr::WriteInline {
                    wr_id,
                    data,
                    remote_addr,
                    rkey,
                    signaled,
                },
                _,
            ) => Pending::Write {
                wr_id,
                src: WriteSrc::Bytes(data.to_vec()),
                remote_addr,
                rkey,
                signaled,
            },
            (SendWr::Write { .. }, None) => return Err(FabricError::LocalAccess),
            (SendWr::WriteShared { .. }, _) => return Err(NOT_FLAT),
        };
        s.pending.push_back(p);
        self.has_pending.store(true, Ordering::Release);
        Ok(())
    }

    /// Execute queued work requests in order while the ring has room. Returns whether one failed
    /// fatally (the caller moves the QP to the error state after releasing the lock).
    fn drain_pending(&self, s: &mut SendSide) -> bool {
        let mut fatal = false;
        if let Some(o) = s.out.as_mut() {
            self.reap(o);
        }
        let SendSide { out, pending } = s;
        while let Some(p) = pending.front() {
            let wr_id = p.wr_id();
            let opcode = p.opcode();
            let res = match p {
                Pending::Send { data, signaled, .. } => self.exec(
                    out,
                    wr_id,
                    Op::Send {
                        data: data.as_slice(),
                    },
                    opcode,
                    *signaled,
                ),
                Pending::Write {
                    src,
                    remote_addr,
                    rkey,
                    signaled,
                    ..
                } => {
                    let (remote_addr, rkey, signaled) = (*remote_addr, *rkey, *signaled);
                    // The source pointer stays valid: the pending entry (which owns the bytes or an
                    // `Arc` of the region) is popped only after `exec` returns.
                    let (src, len) = match src {
                        WriteSrc::Bytes(v) => (v.as_ptr(), v.len()),
                        // SAFETY: the range was checked against the region at post time.
                        WriteSrc::Mr(mr, off, len) => (
                            unsafe { mr.mapping.ptr().add(*off) }.cast_const(),
                            *len as usize,
                        ),
                    };
                    self.exec(
                        out,
                        wr_id,
                        Op::write(src, len, remote_addr, rkey),
                        opcode,
                        signaled,
                    )
                }
            };
            match res {
                Exec::Full => break,
                Exec::Done(c) | Exec::Written(c) => {
                    pending.pop_front();
                    if let Some(c) = c {
                        self.send_cq.push(c);
                    }
                }
                Exec::Fatal(c) => {
                    pending.pop_front();
                    self.flush_inflight(out);
                    self.send_cq.push(c);
                    fatal = true;
                    break;
                }
            }
        }
        self.update_has_pending(s);
        fatal
    }

    fn update_has_pending(&self, s: &SendSide) {
        let busy = !s.pending.is_empty() || s.out.as_ref().is_some_and(|o| !o.inflight.is_empty());
        self.has_pending.store(busy, Ordering::Release);
    }

    /// Complete in-flight work requests whose SENDs the peer accepted: consumed from the ring
    /// (its `head`) or covered by a receive WR it posted (its credits, unless revoked).
    fn reap(&self, o: &mut Outbound) {
        self.reap_fenced(o, false);
    }

    /// [`reap`](Self::reap); `fenced`: a full fence came after our last push (the doorbell
    /// check's), so the credits are read without another one.
    fn reap_fenced(&self, o: &mut Outbound, fenced: bool) {
        if o.inflight.is_empty() {
            return;
        }
        let hdr = o.header();
        let mut level = o.acked;
        // The peer may scribble: only values between what we know and what we sent count.
        let credits = if fenced {
            Producer::credits_after_fence(hdr)
        } else {
            Producer::credits(hdr)
        };
        if let Some(credits) = credits {
            level = level.max(credits.min(o.sent));
        }
        // The head only when the credits do not cover everything sent (they usually do): the
        // consumer writes its head for every message, and a read of ours here would make
        // that write wait for the line to come back (its full fence follows it), on the path
        // of every message it receives. The head counts slots (a long SEND takes several).
        let mut consumed = 0;
        if level < o.sent {
            let head = hdr.head.load(Ordering::Acquire);
            if head <= o.producer.tail() {
                consumed = head;
            }
        }
        while o
            .inflight
            .front()
            .is_some_and(|f| f.seq <= level || f.slot_end <= consumed)
        {
            if let Some(f) = o.inflight.pop_front() {
                level = level.max(f.seq);
                if f.signaled {
                    self.send_cq
                        .push(wc(f.wr_id, WcStatus::Success, f.opcode, f.len, self.qpn));
                }
            }
        }
        o.acked = level;
    }

    /// Before a failure completes: complete what the peer accepted, flush the rest.
    fn flush_inflight(&self, out: &mut Option<Outbound>) {
        if let Some(o) = out.as_mut() {
            self.reap(o);
            let wcs: Vec<_> = o
                .inflight
                .drain(..)
                .map(|f| wc(f.wr_id, WcStatus::WrFlushError, f.opcode, 0, self.qpn))
                .collect();
            self.send_cq.push_all(wcs);
        }
    }

    /// Execute one work request against the peer.
    fn exec(
        &self,
        out: &mut Option<Outbound>,
        wr_id: u64,
        op: Op<'_>,
        opcode: WcOpcode,
        signaled: bool,
    ) -> Exec {
        let Some(o) = out.as_mut() else {
            return Exec::Done(Some(wc(wr_id, WcStatus::WrFlushError, opcode, 0, self.qpn)));
        };
        let core = self.core();
        let fail = |status| Exec::Fatal(wc(wr_id, status, opcode, 0, self.qpn));
        if core.take_fail_token() {
            return fail(WcStatus::RetryExceeded);
        }
        match op {
            Op::Send { data } => {
                let slots = o.slots();
                match o.producer.try_push(ring_header(&o.ring), &slots, data) {
                    Ok(true) => {
                        // (Its full fence also orders the push before the credits `reap` reads
                        // below: see `Producer::credits`.)
                        if Producer::consumer_needs_doorbell(o.header()) {
                            mem::ring_eventfd(o.rx_bell.as_fd());
                        }
                        o.sent += 1;
                        o.inflight.push_back(Inflight {
                            wr_id,
                            opcode,
                            len: data.len() as u32,
                            signaled,
                            seq: o.sent,
                            slot_end: o.producer.tail(),
                        });
                        self.reap_fenced(o, true);
                        Exec::Done(None)
                    }
                    Ok(false) => Exec::Full,
                    Err(_) => fail(WcStatus::RemoteInvalidRequest),
                }
            }
            Op::Write {
                src,
                len,
                remote_addr,
                rkey,
                ..
            } => {
                let epoch = o.header().epoch.load(Ordering::Acquire);
                if epoch != o.epoch {
                    o.mrs.clear();
                    o.epoch = epoch;
                }
                if !o.mrs.contains_key(&rkey) {
                    match request_mr(o, rkey, core.fabric.max_mr_size) {
                        Ok(m) => {
                            o.mrs.insert(rkey, Arc::new(m));
                        }
                        Err(status) => return fail(status),
                    }
                }
                let Some(m) = o.mrs.get(&rkey) else {
                    return fail(WcStatus::RemoteAccessError);
                };
                let Some(off) = remote_addr.checked_sub(m.vaddr) else {
                    return fail(WcStatus::RemoteAccessError);
                };
                let in_bounds = off
                    .checked_add(len as u64)
                    .is_some_and(|end| end <= m.mapping.len() as u64);
                if !in_bounds {
                    return fail(WcStatus::RemoteAccessError);
                }
                // SAFETY: [off, off + len) was checked to lie inside the mapping of the granted
                // region, which stays mapped while `o` is borrowed; `src` points to `len`
                // readable bytes (checked local region or caller slice, see `Op::write`). The
                // destination is shared memory the peer owns: written only with a raw copy,
                // never referenced. A peer mapping and a local source never overlap (distinct
                // mappings), except for a loopback QP writing a region onto itself, where the
                // caller asked for it; `place` tolerates overlap (a plain `copy` then).
                // Placed as an RNIC's DMA would: large writes with non-temporal stores (see
                // `mem::place`).
                unsafe { mem::place(src, m.mapping.ptr().add(off as usize), len) };
                // (A large write's lines went to memory, non-temporal: nothing to prefetch.)
                let next = if len < mem::NON_TEMPORAL_MIN {
                    m.mapping.ptr() as usize + off as usize + len
                } else {
                    0
                };
                self.tx_next_write_at.store(next, Ordering::Relaxed);
                // The lines [next, next + len) touches.
                let lines = (next + len.max(1) - 1) / mem::LINE - next / mem::LINE + 1;
                self.tx_next_write_lines.store(lines, Ordering::Relaxed);
                if !o.inflight.is_empty() {
                    // Completes after the SENDs before it.
                    o.inflight.push_back(Inflight {
                        wr_id,
                        opcode,
                        len: len as u32,
                        signaled,
                        seq: o.sent,
                        slot_end: o.producer.tail(),
                    });
                    return Exec::Written(None);
                }
                Exec::Written(
                    signaled.then(|| wc(wr_id, WcStatus::Success, opcode, len as u32, self.qpn)),
                )
            }
        }
    }

    /// Map the peer's region `rkey` now (see `QueuePair::map_remote`): what the first WRITE
    /// to it does, so that WRITEs need no descriptor later. A region already mapped in the
    /// current epoch costs nothing.
    pub(crate) fn map_remote(&self, rkey: u32) -> Result<()> {
        let st = self.state();
        if !matches!(st, QpState::Rtr | QpState::Rts) {
            return Err(FabricError::InvalidState(st));
        }
        let mut s = lock(&self.send);
        let Some(o) = s.out.as_mut() else {
            return Err(FabricError::InvalidState(st));
        };
        let epoch = o.header().epoch.load(Ordering::Acquire);
        if epoch != o.epoch {
            o.mrs.clear();
            o.epoch = epoch;
        }
        if o.mrs.contains_key(&rkey) {
            return Ok(());
        }
        let m = request_mr(o, rkey, self.core().fabric.max_mr_size)
            .map_err(|status| FabricError::RemoteRegion { rkey, status })?;
        o.mrs.insert(rkey, Arc::new(m));
        Ok(())
    }

    /// Place the bytes of an unsignaled RDMA WRITE into the peer's region `rkey` at
    /// `remote_addr` with the copy outside the send lock (see
    /// [`WritePlacer`](crate::WritePlacer)): under the lock only the checks a post makes
    /// (ready to send, nothing queued before it, the region known, in bounds), then the copy
    /// without it, so that WRITEs of different connections over one QP copy at once. `false`:
    /// nothing was done (the QP is not ready, work waits in its queue, the region is not
    /// known yet, a failure is being injected, or the bounds do not hold): post the WRITE as
    /// usual, which reports what is wrong.
    pub(crate) fn place_unlocked(&self, data: &[u8], remote_addr: u64, rkey: u32) -> bool {
        if self.state() != QpState::Rts || self.core().fail_next.load(Ordering::Relaxed) > 0 {
            return false;
        }
        let (m, off) = {
            let s = lock(&self.send);
            if !s.pending.is_empty() {
                return false;
            }
            let Some(o) = s.out.as_ref() else {
                return false;
            };
            // A region the peer re-registered since (a new epoch) is looked up again by
            // the posting path.
            if o.header().epoch.load(Ordering::Acquire) != o.epoch {
                return false;
            }
            let Some(m) = o.mrs.get(&rkey) else {
                return false;
            };
            let Some(off) = remote_addr.checked_sub(m.vaddr) else {
                return false;
            };
            let in_bounds = off
                .checked_add(data.len() as u64)
                .is_some_and(|end| end <= m.mapping.len() as u64);
            if !in_bounds {
                return false;
            }
            (m.clone(), off as usize)
        };
        // SAFETY: [off, off + len) was checked to lie inside the mapping of the granted
        // region, which `m` keeps mapped during the copy; `data` is a readable slice. The
        // destination is shared memory the peer owns: written only with a raw copy, never
        // referenced (as `exec` places a WRITE, non-temporal from `mem::NON_TEMPORAL_MIN`
        // on, with the closing fence that orders the bytes before a later SEND).
        unsafe { mem::place(data.as_ptr(), m.mapping.ptr().add(off), data.len()) };
        true
    }

    /// Move queued sends forward (called from CQ polling).
    pub(crate) fn progress_send(&self) {
        let fatal = {
            let mut s = lock(&self.send);
            self.drain_pending(&mut s)
        };
        if fatal {
            self.enter_error("work request failed");
        }
    }

    /// Arm the "waiting for space" doorbell if sends are queued.
    pub(crate) fn arm_send_space(&self) {
        let s = lock(&self.send);
        if !s.pending.is_empty() || s.out.as_ref().is_some_and(|o| !o.inflight.is_empty()) {
            if let Some(o) = &s.out {
                let _ = o.producer.arm_wait_for_space(o.header());
            }
        }
    }

    /// Publish `word` as our spin word in our receive ring's header (the peer, which sends
    /// into that ring, reads it there), and return the peer's (in the header of the ring we
    /// send into; `None` before that ring is mapped, or while our send side is busy).
    pub(crate) fn exchange_spin_words(&self, word: u64) -> Option<u64> {
        self.inbound_header()
            .spin
            .store(word, std::sync::atomic::Ordering::Relaxed);
        let send = self.send.try_lock().ok()?;
        let out = send.out.as_ref()?;
        Some(out.header().spin.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Arm the "receiver sleeps" doorbell of our receive ring.
    pub(crate) fn arm_recv_doorbell(&self) {
        let r = lock(&self.recv);
        // Data that is already waiting is picked up by the caller's re-poll.
        let _ = r
            .consumer
            .arm_sleep(self.inbound_header(), &self.inbound_slots());
    }

    /// Withdraw the "receiver sleeps" flag of our receive ring: we are awake, the peer need
    /// not ring (we arm again, and look once more, before the next sleep).
    pub(crate) fn disarm_recv_doorbell(&self) {
        self.inbound_header()
            .rx_armed
            .store(0, std::sync::atomic::Ordering::Relaxed);
    }

    /// Post a receive work request.
    pub(crate) fn post_recv(&self, wr: &RecvWr) -> Result<()> {
        let st = self.state();
        match st {
            QpState::Reset => return Err(FabricError::InvalidState(st)),
            QpState::Error => {
                self.recv_cq.push(wc(
                    wr.wr_id,
                    WcStatus::WrFlushError,
                    WcOpcode::Recv,
                    0,
                    self.qpn,
                ));
                return Ok(());
            }
            _ => {}
        }
        let s = wr.sge;
        let (mr, off) = resolve_local(self.core(), self.pd, s.lkey, s.addr, s.length, true)?;
        let data_waiting = {
            let mut r = lock(&self.recv);
            if self.state() == QpState::Error {
                // Entered the error state meanwhile (which revoked the credits under this lock).
                self.recv_cq.push(wc(
                    wr.wr_id,
                    WcStatus::WrFlushError,
                    WcOpcode::Recv,
                    0,
                    self.qpn,
                ));
                return Ok(());
            }
            if r.posted.len() >= self.caps.max_recv_wr as usize {
                return Err(FabricError::QueueFull);
            }
            r.posted.push_back(PostedRecv {
                wr_id: wr.wr_id,
                mr,
                off,
                len: s.length,
            });
            r.posted_total += 1;
            if Consumer::grant_credits(self.inbound_header(), r.posted_total) {
                if let Some(bell) = &r.peer_tx_bell {
                    mem::ring_eventfd(bell.as_fd());
                }
            }
            matches!(st, QpState::Rtr | QpState::Rts) && r.consumer.ready(&self.inbound_slots())
        };
        if data_waiting {
            self.recv_cq.notify_if_armed();
        }
        Ok(())
    }

    /// Deliver ring messages into posted receives. Returns (completions written, QP broken).
    pub(crate) fn progress_recv(&self, out: &mut [WorkCompletion]) -> (usize, bool) {
        if !matches!(self.state(), QpState::Rtr | QpState::Rts) {
            return (0, false);
        }
        let mut r = lock(&self.recv);
        let mut n = 0;
        let mut broken = false;
        while n < out.len() {
            match self.consume_one(&mut r) {
                Ok(Some(c)) => {
                    out[n] = c;
                    n += 1;
                    if c.status != WcStatus::Success {
                        broken = true;
                        break;
                    }
                }
                Ok(None) => break,
                Err(()) => {
                    broken = true;
                    break;
                }
            }
        }
        (n, broken)
    }

    /// Deliver one message if one is waiting and a receive is posted.
    fn consume_one(&self, r: &mut RecvSide) -> std::result::Result<Option<WorkCompletion>, ()> {
        if r.posted.is_empty() {
            return Ok(None);
        }
        let hdr = self.inbound_header();
        if !r.consumer.ready(&self.inbound_slots()) {
            return Ok(None);
        }
        let mut buf = [0u8; MAX_INLINE];
        let len = r
            .consumer
            .peek(&self.inbound_slots(), &mut buf)
            .map_err(|_| ())?;
        // A long SEND (an SMC-Rv2 LLC message) continues in the slots after the first.
        let long = (len > MAX_INLINE).then(|| {
            let mut v = vec![0u8; len];
            v[..MAX_INLINE].copy_from_slice(&buf);
            r.consumer
                .peek_rest(&self.inbound_slots(), len, &mut v[MAX_INLINE..]);
            v
        });
        let Some(p) = r.posted.pop_front() else {
            return Ok(None);
        };
        let ring_space_wanted = r.consumer.advance(hdr, len);
        self.rx_next
            .store(rx_next_word(&r.consumer), Ordering::Relaxed);
        if ring_space_wanted {
            if let Some(bell) = &r.peer_tx_bell {
                mem::ring_eventfd(bell.as_fd());
            }
        }
        let status = if len > p.len as usize {
            WcStatus::LocalLengthError
        } else if p
            .mr
            .write_at(p.off, long.as_deref().unwrap_or_else(|| &buf[..len]))
            .is_err()
        {
            WcStatus::LocalProtectionError
        } else {
            WcStatus::Success
        };
        Ok(Some(wc(
            p.wr_id,
            status,
            WcOpcode::Recv,
            len as u32,
            self.qpn,
        )))
    }

    /// Move to the error state: deliver what already arrived, flush everything else, release the
    /// connection and peer mappings, and tell the control thread (which closes our sockets, so
    /// the peer's QP fails too).
    pub(crate) fn enter_error(&self, reason: &str) {
        let prev = QpState::from_u8(self.state.swap(QpState::Error.to_u8(), Ordering::AcqRel));
        if prev == QpState::Error {
            return;
        }
        tracing::debug!(qp = self.qpn, reason, "QP entered error state");
        // The event is queued before any flush completion becomes visible.
        self.core()
            .push_event(crate::types::DeviceEvent::QpFatal { qp_num: self.qpn });
        {
            let mut r = lock(&self.recv);
            let mut wcs = Vec::new();
            // Revoke the credits first: a SEND the peer places after our drain below sees the
            // revocation and does not complete successfully. Every SEND the peer completed
            // successfully is in the ring with a receive WR posted for it: deliver them (in
            // any state the peer could connect in), then flush the remaining receives.
            Consumer::revoke_credits(self.inbound_header());
            if prev != QpState::Reset {
                while let Ok(Some(c)) = self.consume_one(&mut r) {
                    wcs.push(c);
                }
            }
            for p in r.posted.drain(..) {
                wcs.push(wc(
                    p.wr_id,
                    WcStatus::WrFlushError,
                    WcOpcode::Recv,
                    0,
                    self.qpn,
                ));
            }
            r.peer_tx_bell = None;
            self.recv_cq.push_all(wcs);
        }
        {
            let mut s = lock(&self.send);
            // SENDs the peer accepted (consumed before it closed the connection, or covered by
            // its credits) complete successfully; the rest flush.
            self.flush_inflight(&mut s.out);
            let wcs: Vec<_> = s
                .pending
                .drain(..)
                .map(|p| wc(p.wr_id(), WcStatus::WrFlushError, p.opcode(), 0, self.qpn))
                .collect();
            s.out = None;
            self.has_pending.store(false, Ordering::Release);
            self.send_cq.push_all(wcs);
        }
        self.core().wake_control();
    }

    /// Destroy: release everything without generating completions.
    pub(crate) fn destroy(self: &Arc<Self>) {
        self.state.store(QpState::Error.to_u8(), Ordering::Release);
        {
            let mut r = lock(&self.recv);
            Consumer::revoke_credits(self.inbound_header());
            r.posted.clear();
            r.peer_tx_bell = None;
        }
        {
            let mut s = lock(&self.send);
            s.pending.clear();
            s.out = None;
        }
        self.send_cq.remove_bell(self.tx_bell.as_fd());
        self.recv_cq.remove_bell(self.rx_bell.as_fd());
        self.send_cq.detach(self);
        self.recv_cq.detach(self);
        lock(&self.core().qps).remove(&self.qpn);
        self.core().wake_control();
    }
}

/// Ask the peer for the region `rkey` over our control connection and map it.
fn request_mr(o: &Outbound, rkey: u32, max_len: usize) -> std::result::Result<RemoteMr, WcStatus> {
    if wire::send(o.sock.as_fd(), &Msg::MrRequest { rkey }, &[]).is_err() {
        return Err(WcStatus::RetryExceeded);
    }
    match wire::recv(o.sock.as_fd()) {
        Ok(Received::Msg(
            Msg::MrGrant {
                rkey: k,
                vaddr,
                len,
            },
            mut fds,
        )) => {
            if k != rkey || fds.len() != 1 || len == 0 || len > max_len as u64 {
                return Err(WcStatus::RemoteInvalidRequest);
            }
            let fd = fds.pop().ok_or(WcStatus::RemoteInvalidRequest)?;
            let len = len as usize;
            if mem::validate_peer_memfd(fd.as_fd(), len).is_err() {
                return Err(WcStatus::RemoteInvalidRequest);
            }
            let mapping = Mapping::map(fd.as_fd(), len).map_err(|_| WcStatus::GeneralError)?;
            Ok(RemoteMr { mapping, vaddr })
        }
        Ok(Received::Msg(Msg::Refused { .. }, _)) => Err(WcStatus::RemoteAccessError),
        Ok(Received::Msg(..)) => Err(WcStatus::RemoteInvalidRequest),
        _ => Err(WcStatus::RetryExceeded),
    }
}
