//! RC queue pairs of the roce backend: the QP's state and the requester (segmentation, PSNs,
//! AckReq, packed WRITEs sealed at post, a window of 512 KiB of packets, cumulative ACKs,
//! go-back-N on a PSN-sequence NAK, on an RNR NAK after its timer and on the retransmission
//! timer). The responder (PSN check, duplicate ACKs, one sequence NAK, RNR NAK without a posted
//! receive, opcode-sequence and length rules, R_Key and bounds check of every WRITE, placement
//! straight into the registered region, coalesced ACKs) is in `qp/responder.rs`.
//!
//! Rules are those of rdma_rxe as shared/spec/rocev2.md sections 6–10 state them.

mod responder;

use super::cq::RoceCq;
use super::device::{bump, lock, Dest, RoceCore, Tables};
use super::inbound::RxBatch;
use super::mr::RoceMr;
use super::txpkt::{Body, TxPkt, Wire};
use crate::error::{FabricError, Result};
use crate::types::{
    AccessFlags, LocalQpInfo, PackedBytes, PostStatus, QpCaps, QpState, RecvWr, RemoteQpInfo,
    SendWr, WcOpcode, WcStatus, WorkCompletion,
};
use smc_wire::roce::{
    self, nak, psn_add, psn_diff, Aeth, AethKind, Bth, IcrcHeaders, IcrcPrefix, Opcode, Packet,
    PacketRepr, Reth,
};
use std::collections::VecDeque;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Fewest packets of one length for which a post or a received datagram hashes the ICRC's
/// fixed start once (`gso::icrc_prefix`, about 30 ns) instead of in each packet (it saves
/// about 30 ns per packet of 1,024 bytes).
pub(crate) const PREFIX_MIN_PACKETS: usize = 2;
/// Largest SEND message (SMC-Rv2 LLC messages reach 8192 bytes, rocev2.md 6.2).
pub(crate) const MAX_SEND: usize = 8192;
/// Most payload bytes in flight beyond the oldest unacknowledged packet: the requester's
/// window is [`window`] PSNs, this many bytes' worth of packets at the path MTU. rxe's
/// requester keeps 128 PSNs (rocev2.md 10.1); the window is the requester's own business (a
/// responder takes any PSN in order). Half the default RMBE of 1 MiB: eight 64 KiB SMC-R
/// updates in flight. With 256 KiB a stream's writer filled the window, the peer's reader
/// drained what had arrived and slept, and the writer then waited for room in the RMBE that
/// the reader could not free (session 22 had found 512 PSNs slower, before sessions 23–27 made
/// posting cheaper — likely why it no longer holds; not traced); measured at a path MTU of 1024
/// (docs/performance.md, "Session 28"): a 256 MiB stream's median 1,426 → 1,693 MB/s in ten
/// alternating rounds, `smc bench --fabric roce --tests stream` 0.80–0.95× → 0.79–1.03× TCP
/// in seven alternating pairs, and 1 MiB (the whole RMBE) slower again. Not larger: go-back-N
/// resends everything after a lost packet, up to a window, and more bytes in flight wake both
/// sides more.
const WINDOW_BYTES: usize = 512 << 10;

/// The requester's window in PSNs at path MTU `mtu`: [`WINDOW_BYTES`] of packets, 512 at a
/// path MTU of 1024, 128 at 4096 (at least 16).
pub(crate) fn window(mtu: usize) -> i32 {
    (WINDOW_BYTES / mtu.max(1)).clamp(16, 2048) as i32
}
/// The requester window a responder must keep open: rxe's, the smallest a peer has.
const PEER_WINDOW: i32 = 128;
/// Most bytes of packet buffers a send queue keeps for reuse: what a stream has posted and not
/// yet had acknowledged when it fills the default RMBE of 1 MiB (up to 1,024 packets at a path
/// MTU of 1024, of which the window sends 512). A smaller pool (a window's worth was tried)
/// freed buffers at every drained window and allocated them again at the next posts.
const SPARE_BYTES: usize = 1 << 20;
/// AckReq at least every 65 packets inside a long message (rocev2.md 8.1).
const ACKREQ_EVERY: u32 = 64;
/// Bytes of an Acknowledge packet: BTH, AETH, ICRC.
const ACK_LEN: usize = roce::BTH_LEN + roce::AETH_LEN + roce::ICRC_LEN;
/// QP attribute `timeout` as Linux SMC-R sets it: 4.096 µs × 2^15 = 134 ms (rocev2.md 10.2).
pub(crate) const TIMEOUT_CODE: u32 = 15;
/// QP attributes `retry_cnt` and `rnr_retry` as Linux SMC-R sets them; rxe treats 7 as
/// "retry forever" for both, and so does this backend (rocev2.md 10.2).
pub(crate) const RETRY_CNT: u8 = 7;
/// See [`RETRY_CNT`].
pub(crate) const RNR_RETRY: u8 = 7;
/// `min_rnr_timer` as Linux SMC-R sets it: code 5, 0.06 ms (rocev2.md 8.5).
const MIN_RNR_TIMER: u8 = 5;
/// rxe waits at least one jiffy after an RNR NAK whatever the code (4 ms at HZ 250); the
/// progress thread's tick is the floor here.
const RNR_FLOOR: Duration = Duration::from_millis(1);
/// Longest that packets of held posts wait for a doorbell before the progress thread sends
/// them itself (a caller that holds is expected to ring at once; this is the safety net).
const HOLD_MAX: Duration = Duration::from_millis(5);
/// How long a destroyed QP keeps delivering its unacknowledged requests.
pub(crate) const LINGER: Duration = Duration::from_secs(2);
/// Longest a responder holds back an ACK that a request asked for, hoping to send it in the
/// same system call as a request of its own on the QP (the reply; rocev2.md 8.3: coalescing is
/// allowed well inside the peer's retransmission timeout, 134 ms for SMC-R). The progress
/// thread sends what is still owed after this (its wake-up granularity comes on top).
pub(crate) const ACK_DELAY: Duration = Duration::from_micros(200);
/// A responder ACKs at once when this many PSNs or more would be left unacknowledged, so a
/// held-back ACK never closes a requester's window of [`PEER_WINDOW`] PSNs (a stream of large
/// messages is ACKed as before, message by message).
const ACK_SPAN: i32 = PEER_WINDOW / 4;
/// A held-back ACK younger than this does not ride along with the QP's next transmission: in
/// a fast request/response exchange one ACK then answers several requests (ACKs are
/// cumulative), and most round trips carry none. (A thread that goes to sleep sends only those
/// [`ACK_DELAY`] old, device.rs `ReceiveWait::new`.)
pub(crate) const ACK_COALESCE: Duration = Duration::from_micros(50);

/// Most ticks in a row that leave a QP's timers alone because its send queue is busy
/// ([`RoceQp::on_tick`]): a timer fires at most this many ticks late.
const MAX_TICKS_SKIPPED: u8 = 3;

fn retransmit_timeout() -> Duration {
    Duration::from_nanos(4096 << TIMEOUT_CODE)
}

#[derive(Clone, Copy)]
pub(super) struct Conn {
    /// The peer's address and our GID index (socket) for it.
    pub(super) ip: Dest,
    dest_qp: u32,
    mtu: usize,
    icrc: IcrcHeaders,
    remote: RemoteQpInfo,
}

/// The payload of a send work request being posted.
enum Payload<'a> {
    /// The caller's bytes (SEND, WRITE inline).
    Bytes(&'a [u8]),
    /// Shared bytes (WRITE shared): each packet keeps a slice of them, not a copy.
    Shared(&'a bytes::Bytes),
    /// `len` bytes at `off` in a registered region (WRITE from an SGE), bounds checked.
    Region {
        mr: Arc<RoceMr>,
        off: usize,
        len: usize,
    },
}

impl Payload<'_> {
    fn len(&self) -> usize {
        match self {
            Payload::Bytes(d) => d.len(),
            Payload::Shared(d) => d.len(),
            Payload::Region { len, .. } => *len,
        }
    }
}

struct PendingWr {
    wr_id: u64,
    opcode: WcOpcode,
    byte_len: u32,
    last_psn: u32,
    signaled: bool,
}

struct SendQueue {
    next_psn: u32,
    wrs: VecDeque<PendingWr>,
    /// Packets not yet acknowledged, oldest first (kept so that a resend is a re-send).
    pkts: VecDeque<TxPkt>,
    /// Buffers of acknowledged packets, for the next posts: a stream's packets are built
    /// without an allocation, a zeroing and a free each (the free of a packet was often on the
    /// progress thread, which receives the ACK, and the allocation on the posting thread).
    /// At most [`SPARE_BYTES`] of them; each has room for the largest packet ([`max_packet`]).
    spare: Vec<Vec<u8>>,
    /// Buffers of packed posts ([`RoceQp::post_write_packed`]), back once no packet and no
    /// caller holds a slice of them.
    post_pool: Arc<super::txpkt::PostPool>,
    /// Index in `pkts` of the next packet to (re)transmit.
    next_tx: usize,
    /// The highest PSN ever transmitted (a packet at or before it is a retransmission).
    high_psn: Option<u32>,
    last_progress: Instant,
    rnr_until: Option<Instant>,
    since_ackreq: u32,
    /// Since when packets of held posts wait for the doorbell ([`RoceQp::post_send_held`]).
    held_since: Option<Instant>,
    /// Whether the last transmission kept a last run back for the next post to continue
    /// ([`RoceQp::doorbell_runs`]): an ACK's transmission keeps it back too, a post that rings
    /// or a doorbell sends it.
    keep_open: bool,
    /// Transport retries left before the QP fails (unused while `retry_cnt` is 7: forever).
    retries_left: u8,
    /// RNR retries left (unused while `rnr_retry` is 7: forever).
    rnr_retries_left: u8,
}

impl SendQueue {
    /// Whether no packet of `p` has ever been transmitted.
    fn never_sent(&self, p: &TxPkt) -> bool {
        self.high_psn.is_none_or(|h| psn_diff(p.psn, h) > 0)
    }
}

struct RecvEntry {
    wr_id: u64,
    mr: Arc<RoceMr>,
    offset: usize,
    len: usize,
}

enum Cursor {
    Send {
        entry: RecvEntry,
        done: usize,
    },
    Write {
        mr: Arc<RoceMr>,
        offset: usize,
        remaining: u64,
    },
}

struct Responder {
    epsn: u32,
    msn: u32,
    nak_sent: bool,
    cursor: Option<Cursor>,
    ack_pending: Option<u32>,
}

/// The ACK a responder owes but holds back ([`ACK_DELAY`]): it leaves with the QP's next
/// transmission (one `sendmmsg` with the reply), when the receiving thread goes to sleep, or
/// from the progress thread once it is [`ACK_DELAY`] old. A leaf lock (taken under `sq` or
/// `resp`, never the other way round).
struct OwedAck {
    /// PSN and MSN of the ACK owed, and since when the oldest request it covers waits.
    owed: Option<(u32, u32, Instant)>,
    /// The PSN of the last ACK sent (for [`ACK_SPAN`]).
    sent_psn: u32,
}

pub(crate) struct RoceQp {
    pub(crate) qpn: u32,
    pub(crate) pd: u32,
    core: Arc<RoceCore>,
    pub(crate) send_cq: Arc<RoceCq>,
    pub(crate) recv_cq: Arc<RoceCq>,
    caps: QpCaps,
    state: AtomicU8,
    sq_psn: u32,
    pub(super) conn: OnceLock<Conn>,
    sq: Mutex<SendQueue>,
    rq: Mutex<VecDeque<RecvEntry>>,
    resp: Mutex<Responder>,
    ack: Mutex<OwedAck>,
    /// Whether `ack.owed` is set (read without the lock on the send path).
    ack_owed: AtomicBool,
    /// Ticks in a row that found the send queue's lock held and left the timers for the next
    /// one (see [`on_tick`](Self::on_tick)).
    ticks_skipped: AtomicU8,
    /// Set when destroyed with unacknowledged requests (see [`RoceQp::destroy`]).
    linger_until: Mutex<Option<Instant>>,
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

impl RoceQp {
    pub(crate) fn create(
        core: Arc<RoceCore>,
        pd: u32,
        send_cq: Arc<RoceCq>,
        recv_cq: Arc<RoceCq>,
        caps: QpCaps,
    ) -> Result<Arc<RoceQp>> {
        if caps.max_send_wr == 0 || caps.max_recv_wr == 0 {
            return Err(FabricError::InvalidArgument("queue depth 0"));
        }
        let sq_psn = u32::from_ne_bytes(crate::shm::mem::random_bytes::<4>()) & roce::U24_MASK;
        let qp = Arc::new(RoceQp {
            qpn: core.alloc_qpn(),
            pd,
            core: core.clone(),
            send_cq,
            recv_cq,
            caps,
            state: AtomicU8::new(QpState::Reset.to_u8()),
            sq_psn,
            conn: OnceLock::new(),
            sq: Mutex::new(SendQueue {
                next_psn: sq_psn,
                wrs: VecDeque::new(),
                pkts: VecDeque::new(),
                spare: Vec::new(),
                post_pool: Arc::default(),
                next_tx: 0,
                high_psn: None,
                last_progress: Instant::now(),
                rnr_until: None,
                since_ackreq: 0,
                held_since: None,
                keep_open: false,
                retries_left: RETRY_CNT,
                rnr_retries_left: RNR_RETRY,
            }),
            rq: Mutex::new(VecDeque::new()),
            resp: Mutex::new(Responder {
                epsn: 0,
                msn: 0,
                nak_sent: false,
                cursor: None,
                ack_pending: None,
            }),
            ack: Mutex::new(OwedAck {
                owed: None,
                sent_psn: 0,
            }),
            ack_owed: AtomicBool::new(false),
            ticks_skipped: AtomicU8::new(0),
            linger_until: Mutex::new(None),
        });
        core.add_qp(&qp);
        Ok(qp)
    }

    pub(crate) fn state(&self) -> QpState {
        QpState::from_u8(self.state.load(Ordering::Acquire))
    }

    fn transition(&self, from: QpState, to: QpState) -> Result<()> {
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

    pub(crate) fn local_info(&self) -> LocalQpInfo {
        // Before it is connected, the device's first GID; then the one it speaks from.
        let via = self.conn.get().map_or(0, |c| c.ip.via);
        LocalQpInfo {
            gid: self
                .core
                .gids
                .get(usize::from(via))
                .copied()
                .unwrap_or(self.core.gid),
            qp_num: self.qpn,
            psn: self.sq_psn,
            mtu: self.core.active_mtu(),
        }
    }

    pub(crate) fn remote_info(&self) -> Option<RemoteQpInfo> {
        self.conn.get().map(|c| c.remote)
    }

    pub(crate) fn to_init(&self) -> Result<()> {
        self.transition(QpState::Reset, QpState::Init)
    }

    /// Connect to `remote` from our GID `local` (the verbs address vector's source GID
    /// index), or from the GID [`RoceCore::source_for`] picks.
    pub(crate) fn to_rtr(&self, local: Option<crate::Gid>, remote: RemoteQpInfo) -> Result<()> {
        if self.core.port_state() == crate::PortState::Down {
            return Err(FabricError::PortDown);
        }
        let via = match local {
            Some(g) => self.core.gid_index(g).ok_or_else(|| {
                FabricError::PeerUnreachable(format!("GID {g} is not one of this device's"))
            })?,
            None => self.core.source_for(remote.gid).ok_or_else(|| {
                FabricError::PeerUnreachable(format!(
                    "GID {} is IPv6 and this device has no IPv6 GID",
                    remote.gid
                ))
            })?,
        };
        let peer = roce::gid_ip(remote.gid.0);
        let src = self.core.local_ip(via);
        // rocev2.md 11.1: a v4-mapped GID is reached over IPv4, any other over IPv6; both
        // ends of a packet are of one family.
        if peer.is_ipv4() != src.is_ipv4() {
            return Err(FabricError::PeerUnreachable(format!(
                "GID {} and our GID {} are not of one IP version",
                remote.gid,
                crate::Gid(roce_gid(src))
            )));
        }
        if remote.qp_num == 0 || remote.qp_num > roce::U24_MASK || remote.psn > roce::U24_MASK {
            return Err(FabricError::InvalidArgument("remote QPN or PSN"));
        }
        if self.state() != QpState::Init {
            return Err(FabricError::InvalidTransition {
                from: self.state(),
                to: QpState::Rtr,
            });
        }
        // Path MTU: the smaller of the peer's and ours, never above what the netdev carries.
        let mtu = remote.mtu.min(self.core.active_mtu());
        let conn = Conn {
            ip: Dest { ip: peer, via },
            dest_qp: remote.qp_num,
            mtu: mtu.bytes(),
            icrc: IcrcHeaders::new(src, peer, roce::UDP_PORT),
            remote: RemoteQpInfo { mtu, ..remote },
        };
        if self.conn.set(conn).is_err() {
            return Err(FabricError::InvalidArgument("QP already connected"));
        }
        lock(&self.resp).epsn = remote.psn;
        lock(&self.ack).sent_psn = psn_add(remote.psn, roce::U24_MASK);
        self.transition(QpState::Init, QpState::Rtr)
    }

    pub(crate) fn to_rts(&self) -> Result<()> {
        self.transition(QpState::Rtr, QpState::Rts)
    }

    /// Enter the error state: the first outstanding send WR completes with `first` (the
    /// status a NAK gave it), every other one and every posted receive with a flush error.
    pub(crate) fn enter_error(&self, first: Option<WcStatus>, reason: &'static str) {
        let prev = self.state.swap(QpState::Error.to_u8(), Ordering::AcqRel);
        if prev == QpState::Error.to_u8() {
            return;
        }
        tracing::debug!(qpn = self.qpn, reason, "roce QP error");
        self.take_owed_ack(Duration::ZERO);
        self.core
            .push_event(crate::DeviceEvent::QpFatal { qp_num: self.qpn });
        {
            let mut sq = lock(&self.sq);
            sq.pkts.clear();
            // A QP in error sends nothing again: its pool of packet buffers (up to 1 MiB)
            // goes now rather than with the QP, which may linger.
            sq.spare = Vec::new();
            // Its packed posts' buffers too; those the caller still holds are freed, not
            // pooled, when it lets go of them.
            sq.post_pool = Arc::default();
            sq.next_tx = 0;
            let mut first = first;
            let wcs: Vec<WorkCompletion> = sq
                .wrs
                .drain(..)
                .map(|w| {
                    let st = first.take().unwrap_or(WcStatus::WrFlushError);
                    wc(w.wr_id, st, w.opcode, w.byte_len, self.qpn)
                })
                .collect();
            // Pushed under the send queue's lock (the CQ's is taken inside it): a post that
            // finds the QP in error once it has the lock completes after these, in order.
            self.send_cq.push_all(wcs);
        }
        let mut rwcs = Vec::new();
        if let Ok(mut r) = self.resp.try_lock() {
            if let Some(Cursor::Send { entry, .. }) = r.cursor.take() {
                rwcs.push(wc(
                    entry.wr_id,
                    WcStatus::WrFlushError,
                    WcOpcode::Recv,
                    0,
                    self.qpn,
                ));
            }
        }
        rwcs.extend(
            lock(&self.rq)
                .drain(..)
                .map(|e| wc(e.wr_id, WcStatus::WrFlushError, WcOpcode::Recv, 0, self.qpn)),
        );
        self.recv_cq.push_all(rwcs);
    }

    /// Destroy: a QP with requests still unacknowledged lingers (the progress thread keeps
    /// sending and retransmitting them for up to [`LINGER`]), as a kernel keeps a closed
    /// socket's data going: SMC-R closes a connection by posting its last CDC, and the process
    /// may exit right after. Then it leaves the table and flushes.
    pub(crate) fn destroy(self: &Arc<Self>) {
        self.flush_owed_ack(None);
        let pending = self.state() == QpState::Rts && !lock(&self.sq).pkts.is_empty();
        if pending && self.core.port_state() == crate::PortState::Active {
            *lock(&self.linger_until) = Some(Instant::now() + LINGER);
            self.core.add_lingering(self.clone());
            return;
        }
        self.core.remove_qp(self.qpn);
        self.enter_error(None, "destroyed");
    }

    /// Whether requests are waiting for their acknowledgement.
    pub(crate) fn has_unacked(&self) -> bool {
        self.state() == QpState::Rts && !lock(&self.sq).pkts.is_empty()
    }

    /// For a lingering QP: whether it is done (all acknowledged, failed, or out of time); then
    /// it is removed and flushed.
    pub(crate) fn linger_done(&self, now: Instant) -> bool {
        let until = *lock(&self.linger_until);
        let done = self.state() != QpState::Rts
            || lock(&self.sq).pkts.is_empty()
            || until.is_none_or(|t| now >= t);
        if done {
            self.core.remove_qp(self.qpn);
            self.enter_error(None, "destroyed");
        }
        done
    }

    pub(crate) fn post_recv(&self, wr: &RecvWr) -> Result<()> {
        match self.state() {
            QpState::Reset => return Err(FabricError::InvalidState(QpState::Reset)),
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
        let mr = self
            .core
            .lookup_mr(wr.sge.lkey)
            .filter(|m| m.pd == self.pd)
            .ok_or(FabricError::InvalidLkey(wr.sge.lkey))?;
        if !mr.access.contains(AccessFlags::LOCAL_WRITE) {
            return Err(FabricError::LocalAccess);
        }
        let offset = mr
            .offset_of(wr.sge.addr, u64::from(wr.sge.length))
            .ok_or(FabricError::LocalAccess)?;
        let mut rq = lock(&self.rq);
        if rq.len() >= self.caps.max_recv_wr as usize {
            return Err(FabricError::QueueFull);
        }
        rq.push_back(RecvEntry {
            wr_id: wr.wr_id,
            mr,
            offset,
            len: wr.sge.length as usize,
        });
        Ok(())
    }

    /// Post a send WR and transmit what the window lets go (the doorbell rings at once).
    pub(crate) fn post_send(&self, wr: &SendWr<'_>) -> Result<PostStatus> {
        self.post(wr, true)
    }

    /// Post a send WR whose packets wait for the doorbell: the next post on this QP that
    /// rings it, [`RoceQp::doorbell`], or at the latest the progress thread's next tick, so
    /// that the WRITE and the CDC SEND of one SMC-R update leave in one system call and the
    /// WRITE needs no acknowledgement of its own.
    pub(crate) fn post_send_held(&self, wr: &SendWr<'_>) -> Result<PostStatus> {
        self.post(wr, false)
    }

    /// Transmit the packets that held posts left waiting.
    pub(crate) fn doorbell(&self) {
        self.ring(false);
    }

    /// [`doorbell`](Self::doorbell), except that a last run whose message has room for more
    /// packets (`TxPkt::open_end`: a packed post's short tail) stays held: the next packed
    /// post is sealed to continue its message ([`post_write_packed`](Self::post_write_packed)),
    /// and the next post that rings, doorbell, or the progress thread's [`HOLD_MAX`] sends
    /// it. For WRITEs whose CDC is not posted yet: their bytes are of no use to the peer
    /// before it, and a stream's 64 KiB update is 64 packets at a path MTU of 1024, a run
    /// of 62 and one of 2 — a datagram of 2 packets for every update, where its kernel work
    /// costs about what 62 do.
    pub(crate) fn doorbell_runs(&self) {
        self.ring(true);
    }

    fn ring(&self, keep_open: bool) {
        if self.state() != QpState::Rts {
            return;
        }
        let Some(conn) = self.conn.get().copied() else {
            return;
        };
        let mut sq = lock(&self.sq);
        if sq.next_tx < sq.pkts.len() {
            self.transmit(&mut sq, &conn, keep_open);
        }
    }

    /// The checks every post makes before it queues anything, in order: the QP's state (in
    /// error: the request completes flushed at once, `Ok(None)`), its connection, room in
    /// the send queue, an injected failure (the request fails and the QP with it,
    /// `Ok(None)`). The state is looked at again under the send queue's lock: `enter_error`
    /// sets it before it takes that lock to flush what is queued, so a post that gets the
    /// lock after the flush completes flushed rather than queue on a QP in error.
    fn begin_post(
        &self,
        wr_id: u64,
        opcode: WcOpcode,
        byte_len: u32,
    ) -> Result<Option<(Conn, std::sync::MutexGuard<'_, SendQueue>)>> {
        let flushed = || {
            self.send_cq.push(wc(
                wr_id,
                WcStatus::WrFlushError,
                opcode,
                byte_len,
                self.qpn,
            ));
            Ok(None)
        };
        match self.state() {
            QpState::Rts => {}
            QpState::Error => return flushed(),
            s => return Err(FabricError::InvalidState(s)),
        }
        let Some(conn) = self.conn.get().copied() else {
            return Err(FabricError::InvalidState(self.state()));
        };
        let sq = lock(&self.sq);
        if self.state() == QpState::Error {
            drop(sq);
            return flushed();
        }
        if sq.wrs.len() >= self.caps.max_send_wr as usize {
            return Err(FabricError::QueueFull);
        }
        if self.core.take_fail_token() {
            drop(sq);
            self.send_cq.push(wc(
                wr_id,
                WcStatus::RetryExceeded,
                opcode,
                byte_len,
                self.qpn,
            ));
            self.enter_error(None, "injected failure");
            return Ok(None);
        }
        Ok(Some((conn, sq)))
    }

    fn post(&self, wr: &SendWr<'_>, ring: bool) -> Result<PostStatus> {
        // In the error state every request completes flushed, whatever it holds (looked at
        // again under the lock, `begin_post`).
        if self.state() == QpState::Error {
            let (op, len) = wr_shape(wr);
            self.send_cq
                .push(wc(wr.wr_id(), WcStatus::WrFlushError, op, len, self.qpn));
            return Ok(PostStatus::Queued);
        }
        // Where the payload comes from: the caller's bytes, or (a WRITE from a registered
        // region) the region itself, read chunk by chunk straight into each packet.
        let (src, write, signaled) = match *wr {
            SendWr::Send { data, signaled, .. } => {
                if data.len() > MAX_SEND {
                    return Err(FabricError::MessageTooLarge {
                        len: data.len(),
                        max: MAX_SEND,
                    });
                }
                (Payload::Bytes(data), None, signaled)
            }
            SendWr::WriteInline {
                data,
                remote_addr,
                rkey,
                signaled,
                ..
            } => (Payload::Bytes(data), Some((remote_addr, rkey)), signaled),
            SendWr::WriteShared {
                data,
                remote_addr,
                rkey,
                signaled,
                ..
            } => (Payload::Shared(data), Some((remote_addr, rkey)), signaled),
            SendWr::Write {
                local,
                remote_addr,
                rkey,
                signaled,
                ..
            } => {
                let mr = self
                    .core
                    .lookup_mr(local.lkey)
                    .filter(|m| m.pd == self.pd)
                    .ok_or(FabricError::InvalidLkey(local.lkey))?;
                // The whole range is checked here, before anything is queued; each chunk's
                // read checks its own range again (`RoceMr::read_at`).
                let off = mr
                    .offset_of(local.addr, u64::from(local.length))
                    .ok_or(FabricError::LocalAccess)?;
                (
                    Payload::Region {
                        mr,
                        off,
                        len: local.length as usize,
                    },
                    Some((remote_addr, rkey)),
                    signaled,
                )
            }
        };
        let data_len = src.len();
        let (opcode, byte_len) = wr_shape(wr);
        if data_len > u32::MAX as usize >> 1 {
            return Err(FabricError::MessageTooLarge {
                len: data_len,
                max: u32::MAX as usize >> 1,
            });
        }
        let Some((conn, mut sq)) = self.begin_post(wr.wr_id(), opcode, byte_len)? else {
            return Ok(PostStatus::Queued);
        };
        // rocev2.md 6.2: ceil(L / MTU) packets, at least one. A SEND is one message (ONLY,
        // or FIRST / MIDDLE… / LAST: FIRST and MIDDLE carry exactly one MTU). A WRITE is cut
        // into one WRITE ONLY message per path MTU, each with its own RETH (its piece's
        // address, the rkey, its length): legal RC (the peer sees consecutive WRITEs to
        // adjacent addresses), and every packet but a shorter last one has the same length,
        // so an update's packets and the CDC SEND behind them make UDP_SEGMENT runs of equal
        // packets (with FIRST / MIDDLE / LAST the RETH makes the first packet 16 bytes longer
        // than the rest, and it needs a run of its own: one more datagram, one more wake-up
        // of the receiver per update; gso.rs).
        let count = data_len.div_ceil(conn.mtu).max(1);
        // Where this post's packets start, to take them back should a region read fail.
        let undo = (sq.pkts.len(), sq.next_psn, sq.since_ackreq);
        // The ICRC's fixed start for the packets' common length (all but a shorter last),
        // hashed once per post where enough packets share it (smc-wire `IcrcPrefix`).
        let mut prefix = IcrcPrefix::none(conn.icrc);
        for i in 0..count {
            let start = (i * conn.mtu).min(data_len);
            let len = ((i + 1) * conn.mtu).min(data_len) - start;
            let last = i + 1 == count;
            sq.since_ackreq += 1;
            // AckReq (rocev2.md 8.1) on the last packet of a work request whose completion
            // is wanted or that ends what this post transmits, and every ACKREQ_EVERY packets.
            // ACKs are cumulative: an unsignaled message whose packets leave with a later
            // one is acknowledged by the later one's ACK. `pump` makes sure the last packet
            // of every transmission asks for an ACK (these packets are re-sealed with it; a
            // packed post's are sealed with it where a transmission may end), so no packet is
            // ever left waiting for the retransmission timer for want of one.
            let ack_req = (last && (signaled || ring)) || sq.since_ackreq > ACKREQ_EVERY;
            if ack_req {
                sq.since_ackreq = 0;
            }
            let psn = sq.next_psn;
            let (opcode, reth) = match write {
                Some((va, rkey)) => (
                    Opcode::WRITE_ONLY,
                    Some(Reth {
                        va: va.wrapping_add(start as u64),
                        rkey,
                        dma_len: len as u32,
                    }),
                ),
                None => (Opcode::for_segment(false, i, count, false), None),
            };
            if i == 0 && count >= PREFIX_MIN_PACKETS {
                prefix = super::gso::icrc_prefix(
                    &conn.icrc,
                    roce::BTH_LEN + opcode.ext_len() + len + roce::pad_len(len) + roce::ICRC_LEN,
                );
            }
            let repr = PacketRepr {
                bth: Bth {
                    opcode,
                    // SMC-R asks for a solicited event on every SEND.
                    se: last && write.is_none(),
                    pkey: roce::DEFAULT_PKEY,
                    dest_qp: conn.dest_qp,
                    ack_req,
                    psn,
                    ..Bth::default()
                },
                reth,
                aeth: None,
                immdt: None,
                payload: &[],
            };
            let built = match &src {
                // No copy: the packet keeps a slice of the shared bytes (txpkt.rs).
                Payload::Shared(data) => {
                    TxPkt::shared(psn, &repr, data.slice(start..start + len), &prefix, ack_req)
                        .map_err(|_| FabricError::InvalidArgument("shared WRITE headers"))
                }
                _ => {
                    // A reused buffer is overwritten, not zeroed first (`emit_to_vec` and
                    // `emit_to_vec_with` write every byte once); a new one has room for the
                    // largest packet of the connection, so that any buffer of the pool fits
                    // any packet (one of a CDC SEND included).
                    let mut bytes = sq
                        .spare
                        .pop()
                        .unwrap_or_else(|| Vec::with_capacity(max_packet(conn.mtu)));
                    let filled = match &src {
                        // One copy, region to packet: the region is memory a peer may write
                        // at any time, so it is read with `read_at`'s raw copy into the
                        // packet (private memory), and the ICRC below covers the bytes as
                        // copied.
                        Payload::Region { mr, off, .. } => {
                            repr.emit_to_vec_with(&mut bytes, len, |buf| {
                                match off.checked_add(start) {
                                    Some(at) => mr.read_at(at, buf),
                                    None => Err(FabricError::LocalAccess),
                                }
                            })
                        }
                        Payload::Bytes(data) => {
                            PacketRepr {
                                payload: &data[start..start + len],
                                ..repr
                            }
                            .emit_to_vec(&mut bytes);
                            Ok(())
                        }
                        Payload::Shared(_) => Ok(()),
                    };
                    match filled {
                        Ok(()) => {
                            prefix.seal(&mut bytes);
                            Ok(TxPkt {
                                psn,
                                body: Body::Flat(bytes),
                                ipv4_id: 0,
                                ack_req,
                                count: 1,
                            })
                        }
                        Err(e) => {
                            sq.spare.push(bytes);
                            Err(e)
                        }
                    }
                }
            };
            match built {
                Ok(p) => sq.pkts.push_back(p),
                Err(e) => {
                    // Not reached (the whole range was checked above, and a region never
                    // shrinks; a WRITE ONLY's headers fit the inline array); were it, the
                    // post is taken back whole rather than half sent.
                    let q = &mut *sq;
                    q.spare
                        .extend(q.pkts.drain(undo.0..).filter_map(TxPkt::into_buffer));
                    (q.next_psn, q.since_ackreq) = (undo.1, undo.2);
                    return Err(e);
                }
            }
            sq.next_psn = psn_add(psn, 1);
        }
        let last_psn = psn_add(sq.next_psn, roce::U24_MASK);
        sq.wrs.push_back(PendingWr {
            wr_id: wr.wr_id(),
            opcode,
            byte_len,
            last_psn,
            signaled,
        });
        if ring {
            self.pump(&mut sq, &conn);
        } else if sq.held_since.is_none() {
            sq.held_since = Some(Instant::now());
        }
        Ok(PostStatus::Queued)
    }

    /// The shortest WRITE of more than one packet (see `QueuePair::packs_writes_from`).
    pub(crate) fn packs_writes_from(&self) -> usize {
        self.conn.get().map_or(usize::MAX, |c| c.mtu + 1)
    }

    /// Post an unsignaled RDMA WRITE of `data`, held as [`RoceQp::post_send_held`] holds, its
    /// packets built end to end in one buffer of the QP's pool and sealed at post for good:
    /// the bytes are copied once, from `data` into the packets, and the packets leave from
    /// the buffer as they lie, several in one iovec. One WRITE ONLY per path MTU as in
    /// [`post`](Self::post); packet i is sealed for IPv4 identification i mod c, c the
    /// packets one `UDP_SEGMENT` run carries (gso.rs), and asks for an ACK at every c-th
    /// packet and at the last — the places where [`pump`](Self::pump) ends a transmission,
    /// so that a stream's runs start where the post's packets expect them to. A packet sent
    /// elsewhere (a retransmission from inside a run) leaves as a copy resealed for its
    /// place (gso.rs `Layout::lay_out`). Returns the buffer with where the WRITE's bytes lie
    /// in it, for the caller to keep instead of a copy; `None` when the QP is in error (the
    /// request completes flushed).
    pub(crate) fn post_write_packed(
        &self,
        wr_id: u64,
        data: &[u8],
        remote_addr: u64,
        rkey: u32,
    ) -> Result<Option<PackedBytes>> {
        let Some((conn, mut sq)) =
            self.begin_post(wr_id, WcOpcode::RdmaWrite, data.len() as u32)?
        else {
            return Ok(None);
        };
        if data.len() > u32::MAX as usize >> 1 {
            return Err(FabricError::MessageTooLarge {
                len: data.len(),
                max: u32::MAX as usize >> 1,
            });
        }
        let mtu = conn.mtu;
        let count = data.len().div_ceil(mtu).max(1);
        let head_len = roce::BTH_LEN + roce::RETH_LEN;
        let packet_len = |len: usize| head_len + len + roce::pad_len(len) + roce::ICRC_LEN;
        let full = packet_len(mtu.min(data.len()));
        let per_run = super::gso::run_capacity(full);
        // Where packets leave one by one (injected faults, no UDP_SEGMENT), each is sealed
        // for identification 0; IPv6 has none.
        let runs = self.core.sends_runs();
        let by_run = conn.ip.ip.is_ipv4() && runs;
        let total = (count - 1) * full + packet_len(data.len() - (count - 1) * mtu);
        // The last run queued, not yet sent, may leave room in its message (a doorbell kept
        // it back for more, `doorbell_runs`): this post's first packets then take the places
        // after it, and both leave in one datagram instead of the short run in one of its own.
        let phase = match sq.pkts.back() {
            Some(last) if runs && sq.never_sent(last) => match last.open_end() {
                Some((end, stride)) if stride == full => usize::from(end),
                _ => 0,
            },
            _ => 0,
        };
        // Packet i's place in its run.
        let place = |i: usize| (phase + i) % per_run;
        // A post of more than a packet takes a buffer of the pool (a stream's: the same few
        // go round); a lone packet a buffer of its own, not a large one for a few bytes.
        let mut buf = if count > 1 {
            sq.post_pool.take()
        } else {
            Vec::new()
        };
        buf.reserve(total);
        // rocev2.md 8.1: AckReq where a transmission may end (see above).
        let ends_run = |i: usize| place(i) + 1 == per_run || i + 1 == count;
        let first_psn = sq.next_psn;
        let repr = |i: usize, len: usize| PacketRepr {
            bth: Bth {
                opcode: Opcode::WRITE_ONLY,
                pkey: roce::DEFAULT_PKEY,
                dest_qp: conn.dest_qp,
                ack_req: ends_run(i),
                psn: psn_add(first_psn, i as u32),
                ..Bth::default()
            },
            reth: Some(Reth {
                va: remote_addr.wrapping_add((i * mtu) as u64),
                rkey,
                dma_len: len as u32,
            }),
            aeth: None,
            immdt: None,
            payload: &[],
        };
        // The headers of a full packet, built once: packets differ only in the AckReq bit
        // (BTH byte 8, bit 7), the PSN (BTH bytes 9–11) and the RETH's virtual address (its
        // first 8 bytes), which each packet patches (rocev2.md 3.1, 4). The short last
        // packet, whose pad count and DMA length differ, is built from its own headers.
        let mut full_head = [0u8; roce::BTH_LEN + roce::RETH_LEN];
        if repr(0, mtu).emit_head(mtu, &mut full_head).is_err() {
            // Not reached: a WRITE ONLY's headers fit.
            return Err(FabricError::InvalidArgument("packed WRITE headers"));
        }
        // AckReq off in the template: each packet sets its own.
        full_head[8] &= !0x80;
        // The identification columns of a full packet's length, looked up once (gso.rs).
        let cols = by_run.then(|| super::gso::id_columns(full));
        // Full packets built and sealed four at a time where the CPU and the layout allow
        // (seal.rs: each payload copied and folded into its ICRC in one pass); those left
        // over, and the short last packet, one by one.
        let full_count = if data.len().is_multiple_of(mtu) {
            count
        } else {
            count - 1
        };
        let seal4 = (full_count >= 4)
            .then(|| super::seal::Seal4::new(&conn.icrc, full))
            .flatten();
        let by_four = seal4.as_ref().map_or(0, |_| full_count - full_count % 4);
        // The ICRC's fixed start for the full packets' length, hashed once per post for the
        // packets sealed one by one (none when all but the last went four at a time).
        let prefix = if count - by_four >= PREFIX_MIN_PACKETS {
            super::gso::icrc_prefix(&conn.icrc, full)
        } else {
            IcrcPrefix::none(conn.icrc)
        };
        let head_of = |i: usize| {
            let mut head = full_head;
            if ends_run(i) {
                head[8] |= 0x80;
            }
            head[9..12].copy_from_slice(&psn_add(first_psn, i as u32).to_be_bytes()[1..]);
            head[roce::BTH_LEN..roce::BTH_LEN + 8]
                .copy_from_slice(&remote_addr.wrapping_add((i * mtu) as u64).to_be_bytes());
            head
        };
        let delta = |i: usize| cols.map_or(0, |c| c.delta(place(i) as u16));
        if let Some(seal) = &seal4 {
            for g in (0..by_four).step_by(4) {
                seal.build4(
                    &mut buf,
                    &std::array::from_fn(|j| head_of(g + j)),
                    std::array::from_fn(|j| &data[(g + j) * mtu..(g + j + 1) * mtu]),
                    std::array::from_fn(|j| delta(g + j)),
                );
            }
        }
        for i in by_four..count {
            let start = i * mtu;
            let len = (data.len() - start).min(mtu);
            let k = place(i) as u16;
            let off = buf.len();
            if len == mtu {
                buf.extend_from_slice(&head_of(i));
            } else {
                let mut head = [0u8; roce::BTH_LEN + roce::RETH_LEN];
                let Ok(h) = repr(i, len).emit_head(len, &mut head) else {
                    // Not reached: a WRITE ONLY's headers fit (the buffer is freed).
                    return Err(FabricError::InvalidArgument("packed WRITE headers"));
                };
                buf.extend_from_slice(&head[..h]);
            }
            buf.extend_from_slice(&data[start..start + len]);
            buf.extend_from_slice(
                &[0u8; 3 + roce::ICRC_LEN][..roce::pad_len(len) + roce::ICRC_LEN],
            );
            let packet = &mut buf[off..];
            // Sealed for identification k of its run (gso.rs): ICRC(k) = ICRC(0) ⊕ the
            // columns of k's set bits (rocev2.md 13.3).
            let icrc = if packet.len() == full {
                prefix.compute(packet) ^ cols.map_or(0, |c| c.delta(k))
            } else {
                let sum = conn.icrc.compute(packet);
                match by_run {
                    true => sum ^ super::gso::id_columns(packet.len()).delta(k),
                    false => sum,
                }
            };
            if let Some(tail) = packet.last_chunk_mut::<{ roce::ICRC_LEN }>() {
                *tail = icrc.to_le_bytes();
            }
        }
        let bytes = bytes::Bytes::from_owner(super::txpkt::PostBuf {
            buf,
            pool: if count > 1 {
                Arc::downgrade(&sq.post_pool)
            } else {
                std::sync::Weak::new()
            },
        });
        // One entry per run (packet i at i × `full`, the last one to the end): the packets
        // from one AckReq packet to the next, sealed for identifications 0, 1, 2… of a run
        // (the first one's from `phase` on).
        let mut i = 0;
        while i < count {
            let n = (per_run - place(i)).min(count - i);
            let off = i * full;
            let end = if i + n == count {
                total
            } else {
                off + n * full
            };
            sq.pkts.push_back(TxPkt::run(
                psn_add(first_psn, i as u32),
                bytes.slice(off..end),
                n as u16,
                full as u16,
                // IPv6 has no identification: its places are nominal (a run at place 0 fits
                // any place, and leaves whole too).
                runs.then_some(place(i) as u16),
            ));
            i += n;
        }
        let psn = psn_add(first_psn, count as u32);
        sq.next_psn = psn;
        sq.since_ackreq = 0;
        sq.wrs.push_back(PendingWr {
            wr_id,
            opcode: WcOpcode::RdmaWrite,
            byte_len: data.len() as u32,
            last_psn: psn_add(psn, roce::U24_MASK),
            signaled: false,
        });
        if sq.held_since.is_none() {
            sq.held_since = Some(Instant::now());
        }
        Ok(Some(PackedBytes {
            buf: bytes,
            first: head_len,
            stride: full,
            // A lone packet's piece is the whole WRITE (shorter than a path MTU).
            piece: mtu.min(data.len()).max(1),
            len: data.len(),
        }))
    }

    /// Transmit queued packets while the window allows.
    fn pump(&self, sq: &mut SendQueue, conn: &Conn) {
        self.transmit(sq, conn, false);
    }

    /// [`pump`](Self::pump); with `keep_open`, a last run that leaves room in its message
    /// stays held (see [`doorbell_runs`](Self::doorbell_runs)).
    fn transmit(&self, sq: &mut SendQueue, conn: &Conn, keep_open: bool) {
        let held_since = sq.held_since.take();
        sq.keep_open = false;
        if sq.rnr_until.is_some() {
            return;
        }
        let Some(oldest) = sq.pkts.front().map(|p| p.psn) else {
            return;
        };
        if sq.next_tx == 0 {
            sq.last_progress = Instant::now();
        }
        let start = sq.next_tx;
        let mut end = start;
        let window = window(conn.mtu);
        // Whole entries: a packed post's run (sealed for its place in a run, its last packet
        // asking for an ACK) leaves whole or waits for the window while packets are in
        // flight (their ACKs open it); with none in flight it leaves whole however far it
        // reaches (not reached: the window takes a whole run,
        // `the_window_takes_a_whole_packed_run`).
        while sq
            .pkts
            .get(end)
            .is_some_and(|p| psn_diff(p.last_psn(), oldest) < window)
        {
            end += 1;
        }
        if end == start && start == 0 {
            end = 1;
        }
        // Where the socket refused `UDP_SEGMENT` (or faults are injected) every packet
        // leaves alone: nothing could continue a kept run's datagram, so none is kept.
        let keep_open = keep_open && self.core.sends_runs();
        if keep_open && end < sq.pkts.len() {
            // The window cut: the ACKs that open it keep a last open run back when they
            // reach it.
            sq.keep_open = true;
        } else if keep_open && end > start {
            let last = &sq.pkts[end - 1];
            if sq.never_sent(last) && last.open_end().is_some() {
                end -= 1;
                sq.held_since = held_since.or_else(|| Some(Instant::now()));
                sq.keep_open = true;
            }
        }
        if end == start {
            return;
        }
        // What leaves now: the highest PSN sent (the bound of the ACKs taken), and what is
        // sent again.
        for p in sq.pkts.range(start..end) {
            let again = match sq.high_psn {
                Some(h) if psn_diff(p.psn, h) <= 0 => {
                    (psn_diff(h, p.psn) + 1).min(i32::from(p.count)) as u64
                }
                _ => 0,
            };
            if again > 0 {
                self.core
                    .counters
                    .retransmits
                    .fetch_add(again, Ordering::Relaxed);
            }
            if sq.high_psn.is_none_or(|h| psn_diff(p.last_psn(), h) > 0) {
                sq.high_psn = Some(p.last_psn());
            }
        }
        // The last packet of a transmission always asks for an ACK (a held post's last
        // packet, or one the window cut a run before, may not yet): re-sealed once, and the
        // kept copy keeps the bit for any retransmission.
        if let Some(p) = sq.pkts.get_mut(end - 1) {
            if !p.ack_req {
                p.ask_ack(&conn.icrc);
                sq.since_ackreq = 0;
            }
        }
        // The packets the window lets go: UDP_SEGMENT runs, else one sendmmsg (a packed
        // post's run as it lies, one wire).
        let whole = self.core.sends_runs();
        let mut batch: Vec<Wire<'_>> = Vec::with_capacity(end - start + 1);
        // A packed post sealed to continue the message of the run before it goes whole there.
        let mut open = None;
        for p in sq.pkts.range_mut(start..end) {
            open = p.wires(whole, open, &mut batch);
        }
        // An ACK this QP owes as responder leaves in the same system call, after the requests
        // (the peer, woken by the first datagram, finds the reply first). RoCE has no
        // piggybacked acknowledgement: it is an ACK packet of its own, but no datagram of
        // its own costs a system call and a wake-up on either side.
        let mut ack = [0u8; ACK_LEN];
        let mut ack_id = 0u16;
        if let Some((psn, msn)) = self.take_owed_ack(ACK_COALESCE) {
            self.ack_packet(conn, AethKind::Ack { credit: 31 }, psn, msn, &mut ack);
            batch.push(Wire::flat(&mut ack, &mut ack_id));
        }
        self.core.transmit_pkts(conn.ip, &mut batch);
        sq.next_tx = end;
    }

    /// Everything up to and including `psn` is acknowledged (ACKs are cumulative,
    /// rocev2.md 8.3); completes the work requests it covers.
    fn acked_through(&self, sq: &mut SendQueue, psn: u32, done: &mut Vec<WorkCompletion>) {
        let Some(oldest) = sq.pkts.front().map(|p| p.psn) else {
            return;
        };
        // Only what has left at least once can have been received: an ACK past the highest
        // PSN transmitted (a forged or confused responder) would complete posted packets that
        // never left, whose bytes the peer then never gets. Ignored, as an ACK outside the
        // requests outstanding is (rocev2.md 8.3).
        let Some(newest) = sq.high_psn else {
            bump(&self.core.counters.drop_ghost_acks);
            return;
        };
        if psn_diff(psn, oldest) < 0 || psn_diff(psn, newest) > 0 {
            if psn_diff(psn, newest) > 0 {
                bump(&self.core.counters.drop_ghost_acks);
            }
            return;
        }
        let mut removed = 0;
        let keep = SPARE_BYTES / max_packet(self.conn.get().map_or(4096, |c| c.mtu));
        while sq
            .pkts
            .front()
            .is_some_and(|p| psn_diff(p.last_psn(), psn) <= 0)
        {
            // A shared packet lets go of its slice of the WRITE's bytes here.
            if let Some(b) = sq.pkts.pop_front().and_then(TxPkt::into_buffer) {
                if sq.spare.len() < keep {
                    sq.spare.push(b);
                }
            }
            removed += 1;
        }
        sq.next_tx = sq.next_tx.saturating_sub(removed);
        // A packed run acknowledged in part keeps the rest (in its place: it may have left).
        let mut trimmed = false;
        if let Some(p) = sq.pkts.front_mut() {
            let k = psn_diff(psn, p.psn) + 1;
            if k > 0 && matches!(p.body, Body::Run { .. }) {
                p.trim_front(k as u16);
                trimmed = true;
            }
        }
        while sq
            .wrs
            .front()
            .is_some_and(|w| psn_diff(w.last_psn, psn) <= 0)
        {
            if let Some(w) = sq.wrs.pop_front() {
                if w.signaled {
                    done.push(wc(
                        w.wr_id,
                        WcStatus::Success,
                        w.opcode,
                        w.byte_len,
                        self.qpn,
                    ));
                }
            }
        }
        if removed > 0 || trimmed {
            sq.last_progress = Instant::now();
            sq.retries_left = RETRY_CNT;
            sq.rnr_retries_left = RNR_RETRY;
        }
    }

    /// An Acknowledge packet for this QP (requester side).
    pub(super) fn on_ack(&self, aeth: Aeth, psn: u32) {
        let Some(conn) = self.conn.get().copied() else {
            return;
        };
        let mut done = Vec::new();
        let mut fail = None;
        {
            let mut sq = lock(&self.sq);
            match aeth.kind() {
                AethKind::Ack { .. } => {
                    self.acked_through(&mut sq, psn, &mut done);
                    let keep_open = sq.keep_open;
                    self.transmit(&mut sq, &conn, keep_open);
                }
                AethKind::RnrNak { timer } => {
                    bump(&self.core.counters.rnr_naks_received);
                    self.acked_through(&mut sq, psn_add(psn, roce::U24_MASK), &mut done);
                    if !spend_retry(&mut sq.rnr_retries_left) {
                        fail = Some(WcStatus::RetryExceeded);
                    } else {
                        let wait =
                            Duration::from_micros(roce::rnr_timer_micros(timer)).max(RNR_FLOOR);
                        sq.rnr_until = Some(Instant::now() + wait);
                        sq.next_tx = 0;
                    }
                }
                AethKind::Nak { code } if code == nak::PSN_SEQUENCE => {
                    bump(&self.core.counters.naks_received);
                    // rocev2.md 10.1: acknowledges everything before the NAK's PSN, then
                    // go-back-N from it.
                    self.acked_through(&mut sq, psn_add(psn, roce::U24_MASK), &mut done);
                    if sq.pkts.front().is_some_and(|p| p.psn == psn) {
                        if spend_retry(&mut sq.retries_left) {
                            sq.next_tx = 0;
                            self.pump(&mut sq, &conn);
                        } else {
                            fail = Some(WcStatus::RetryExceeded);
                        }
                    }
                }
                AethKind::Nak { code } => {
                    bump(&self.core.counters.naks_received);
                    self.acked_through(&mut sq, psn_add(psn, roce::U24_MASK), &mut done);
                    fail = Some(match code {
                        nak::INVALID_REQUEST => WcStatus::RemoteInvalidRequest,
                        nak::REMOTE_ACCESS => WcStatus::RemoteAccessError,
                        _ => WcStatus::GeneralError,
                    });
                }
                AethKind::Reserved => bump(&self.core.counters.drop_malformed),
            }
        }
        self.send_cq.push_all(done);
        if let Some(st) = fail {
            self.enter_error(Some(st), "NAK from the responder");
        }
    }

    /// Timers: the end of an RNR wait, and the retransmission timeout (go-back-N).
    pub(crate) fn on_tick(&self, now: Instant) {
        if self.state() != QpState::Rts {
            return;
        }
        let Some(conn) = self.conn.get().copied() else {
            return;
        };
        // The send queue's lock held means a thread posts or pumps right now (likely inside
        // its send system call, where the woken peer may preempt it): waiting for it costs
        // both threads a futex call and a context switch, for timers of milliseconds. Leave
        // them to the next tick, a few times in a row at most.
        let mut sq = match self.sq.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                if self.ticks_skipped.fetch_add(1, Ordering::Relaxed) < MAX_TICKS_SKIPPED {
                    return;
                }
                lock(&self.sq)
            }
        };
        self.ticks_skipped.store(0, Ordering::Relaxed);
        let mut exceeded = false;
        if let Some(t) = sq.rnr_until {
            if now >= t {
                sq.rnr_until = None;
                sq.next_tx = 0;
                self.pump(&mut sq, &conn);
            }
            return;
        }
        if sq
            .held_since
            .is_some_and(|t| now.duration_since(t) >= HOLD_MAX)
        {
            // Held packets nobody rang the doorbell for: never stranded.
            self.pump(&mut sq, &conn);
        }
        if sq.next_tx > 0 && now.duration_since(sq.last_progress) >= retransmit_timeout() {
            bump(&self.core.counters.timeouts);
            if spend_retry(&mut sq.retries_left) {
                sq.next_tx = 0;
                self.pump(&mut sq, &conn);
            } else {
                exceeded = true;
            }
        }
        drop(sq);
        if exceeded {
            self.enter_error(Some(WcStatus::RetryExceeded), "transport retries exceeded");
        }
    }
}

/// The longest packet a requester of path MTU `mtu` builds: BTH, RETH, a full payload, pad,
/// ICRC.
fn max_packet(mtu: usize) -> usize {
    roce::BTH_LEN + roce::RETH_LEN + mtu + 3 + roce::ICRC_LEN
}

/// The shortest WRITE payload whose WRITE ONLY packet (BTH, RETH, payload padded to 4 bytes,
/// ICRC) is not shorter than the SEND ONLY packet of `send_len` bytes (BTH, padded payload,
/// ICRC): then the two make one `UDP_SEGMENT` run (gso.rs), one datagram. For SMC-R's 44-byte
/// CDC: 25 (padded to 28, a 60-byte packet as the SEND's).
pub(crate) fn shortest_shared_write(send_len: usize) -> usize {
    // The padded length needed is a multiple of 4; the shortest payload padded to it is 3
    // bytes less (0 stays 0).
    send_len
        .next_multiple_of(4)
        .saturating_sub(roce::RETH_LEN)
        .saturating_sub(3)
}

/// Take one retry from a 3-bit retry counter; 7 means "retry forever" (rxe and Linux SMC-R,
/// rocev2.md 10.2). False when none is left.
fn spend_retry(left: &mut u8) -> bool {
    match *left {
        7 => true,
        0 => false,
        _ => {
            *left -= 1;
            true
        }
    }
}

fn wr_shape(wr: &SendWr<'_>) -> (WcOpcode, u32) {
    match *wr {
        SendWr::Send { data, .. } => (WcOpcode::Send, data.len() as u32),
        SendWr::WriteInline { data, .. } => (WcOpcode::RdmaWrite, data.len() as u32),
        SendWr::WriteShared { data, .. } => (WcOpcode::RdmaWrite, data.len() as u32),
        SendWr::Write { local, .. } => (WcOpcode::RdmaWrite, local.length),
    }
}

/// The GID of an address: itself for IPv6, `::ffff:a.b.c.d` for IPv4.
fn roce_gid(a: IpAddr) -> [u8; 16] {
    match a {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

#[cfg(test)]
mod tests {
    /// The window holds the same bytes at every path MTU: 512 KiB of packets.
    #[test]
    fn the_window_is_bytes_not_packets() {
        assert_eq!(super::window(1024), 512);
        assert_eq!(super::window(2048), 256);
        assert_eq!(super::window(4096), 128);
        assert_eq!(super::window(256), 2048);
    }
}
