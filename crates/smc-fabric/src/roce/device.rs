//! A software RoCEv2 device: one UDP socket bound to `<netdev IPv4>:4791` and one more per
//! IPv6 GID (`[<netdev IPv6>]:4791`), tables of QPs and memory regions, counters, injected
//! faults, and the progress thread that receives packets, answers them, and runs the
//! retransmission and port-state timers.

use super::fault::Faults;
use super::inbound::RxBatch;
use super::mr::RoceMr;
use super::netdev;
use super::qp::RoceQp;
use crate::config::{DeviceConfig, FabricConfig, Fault};
use crate::error::{FabricError, Result};
use crate::types::{DeviceEvent, Gid, Mac, Mtu, PortState};
use foldhash::{HashMap, HashMapExt as _};
use rustix::fd::{AsFd, OwnedFd};
use rustix::net::{AddressFamily, SocketType};
use smc_wire::roce;
use std::collections::VecDeque;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Lock a mutex, recovering the data if another thread panicked while holding it.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// [`lock`] if nobody holds the mutex now.
fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

/// Packet and error counters of a roce device (all since it was opened).
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) tx_packets: AtomicU64,
    pub(crate) tx_bytes: AtomicU64,
    pub(crate) rx_packets: AtomicU64,
    pub(crate) rx_bytes: AtomicU64,
    pub(crate) retransmits: AtomicU64,
    pub(crate) timeouts: AtomicU64,
    pub(crate) naks_sent: AtomicU64,
    pub(crate) naks_received: AtomicU64,
    pub(crate) rnr_naks_sent: AtomicU64,
    pub(crate) rnr_naks_received: AtomicU64,
    pub(crate) acks_sent: AtomicU64,
    pub(crate) duplicates: AtomicU64,
    pub(crate) drop_icrc: AtomicU64,
    pub(crate) drop_malformed: AtomicU64,
    pub(crate) drop_unknown_qp: AtomicU64,
    pub(crate) drop_wrong_source: AtomicU64,
    pub(crate) drop_out_of_sequence: AtomicU64,
    pub(crate) drop_ghost_acks: AtomicU64,
    pub(crate) remote_access_errors: AtomicU64,
    pub(crate) tx_errors: AtomicU64,
    pub(crate) fault_drops: AtomicU64,
}

pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Smallest interval at which the progress thread looks at timers while QPs exist.
pub(crate) const TICK: Duration = Duration::from_millis(2);

/// How long the progress thread stays off the socket while an application thread sleeps on it
/// ([`ReceiveWait`]) and receives what arrives itself: it sleeps that long without watching the
/// socket (no wake-up per datagram), then looks again. A datagram that arrives just as no
/// application thread waits any more is received at most this late (by the next waiter, or by
/// the progress thread; one `LEASE` more when application threads received since the
/// progress thread's last look, see `run`). The lease doubles, up to [`TICK`], while the progress thread finds
/// a sleeper on the socket every time it looks (an idle connection's blocked reader costs it
/// no more wake-ups than the timers do), and starts again at this when it finds none.
const LEASE: Duration = Duration::from_micros(250);
/// Most looks in a row at which the progress thread leaves the socket to application threads
/// that waited on it since its last look but do not at this moment (see `run`).
pub(crate) const MAX_DEFERRED: u32 = 8;
/// Most IPv6 GIDs (and sockets) of one device: a GID index is a `u8`, and every socket is
/// looked at on each receive.
const MAX_V6_GIDS: usize = 32;
/// How often the netdev's state is looked at.
const PORT_CHECK: Duration = Duration::from_millis(50);

/// Where a packet goes: the peer's address, and which of the device's sockets (of its GIDs)
/// it leaves from and arrives on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Dest {
    pub(crate) ip: IpAddr,
    /// 0: the IPv4 socket (GID index 0); k ≥ 1: the socket of IPv6 GID k (`v6[k - 1]`).
    pub(crate) via: u8,
}

/// The device's socket on one of its netdev's IPv6 addresses: one IPv6 GID.
pub(crate) struct V6Sock {
    pub(crate) ip: Ipv6Addr,
    /// Prefix length of `ip` on the netdev: the LAN this GID reaches.
    pub(crate) prefix: u8,
    pub(crate) sock: OwnedFd,
}

pub(crate) struct RoceCore {
    pub(crate) config: DeviceConfig,
    pub(crate) netdev: String,
    pub(crate) ip: Ipv4Addr,
    /// Prefix length of `ip` on the netdev: the LAN this port reaches.
    pub(crate) prefix: u8,
    /// GID index 0: `::ffff:<ip>`.
    pub(crate) gid: Gid,
    /// The GID table: `gid`, then one IPv6 GID per entry of `v6`.
    pub(crate) gids: Vec<Gid>,
    /// The sockets of the IPv6 GIDs.
    pub(crate) v6: Vec<V6Sock>,
    /// With IPv6 GIDs: an epoll instance holding every socket of the device, readable when one
    /// of them is (what the progress thread and [`ReceiveWait`] sleep on). Without, they sleep
    /// on `sock` itself.
    waitset: Option<OwnedFd>,
    pub(crate) mac: Mac,
    pub(crate) netdev_mtu: AtomicU32,
    pub(crate) sock: OwnedFd,
    /// The netdev's state as last seen.
    link_up: AtomicBool,
    /// Fault injection: the port held down by `set_port_state`.
    admin_down: AtomicBool,
    pub(crate) fail_next: AtomicU32,
    pub(crate) qps: Mutex<HashMap<u32, Weak<RoceQp>>>,
    pub(crate) qps_gen: AtomicU64,
    pub(crate) mrs: Mutex<HashMap<u32, Arc<RoceMr>>>,
    pub(crate) mrs_gen: AtomicU64,
    next_qpn: AtomicU32,
    /// Set once the socket refused a `UDP_SEGMENT` send (gso.rs).
    gso_off: AtomicBool,
    /// Whether the socket coalesces received packets (`UDP_GRO`, rx.rs).
    gro: AtomicBool,
    /// Whether a waiter may sleep in the socket's receive call ([`ReceiveWait::block`]): the
    /// device has one socket, whose receive timeout is set to `rx::BLOCK`.
    blocking: bool,
    /// This process's QPN range (steer.rs): `qpn_base .. qpn_base + qpn_span`.
    qpn_base: u32,
    qpn_span: u32,
    next_key: AtomicU32,
    next_pd: AtomicU32,
    events: Mutex<VecDeque<DeviceEvent>>,
    pub(crate) counters: Counters,
    faults: Option<Mutex<Faults>>,
    shutdown: AtomicBool,
    /// Destroyed QPs still delivering their last requests (kept alive here).
    lingering: Mutex<Vec<Arc<RoceQp>>>,
    /// The receive path's state. Whoever holds it receives: the progress thread after its
    /// `poll` wakes, or an application thread that slept on the socket ([`ReceiveWait`]).
    rx: Mutex<RxState>,
    /// Application threads asleep on the socket that will receive when it wakes them (see
    /// [`ReceiveWait`]): while there is one, the progress thread leaves the datagrams to it.
    rx_waiters: AtomicU32,
    /// How many [`ReceiveWait`]s were ever made: changed since the progress thread's last look,
    /// application threads receive themselves even if none waits at this moment (see `run`).
    rx_waits_made: AtomicU64,
    /// How many QPs hold back an ACK (qp.rs, `ACK_DELAY`): a sleeper sends them first.
    pub(crate) acks_owed: AtomicUsize,
    /// The progress thread's kernel thread id, once it runs (0 before).
    progress_tid: AtomicI32,
}

/// An application thread's promise to receive on a device's socket when it becomes readable
/// (it sleeps on [`fd`](Self::fd) and calls [`receive`](Self::receive)). While one is held the
/// device's own thread does not receive, so the reply to a request reaches the thread that
/// waits for it with one wake-up — the kernel's — instead of two.
pub(crate) struct ReceiveWait<'a> {
    core: &'a RoceCore,
    /// The waiter's completion queue, armed by it before it sleeps.
    cq: &'a super::RoceCq,
}

impl<'a> ReceiveWait<'a> {
    pub(crate) fn new(core: &'a RoceCore, cq: &'a super::RoceCq) -> ReceiveWait<'a> {
        core.rx_waiters.fetch_add(1, Ordering::AcqRel);
        core.rx_waits_made.fetch_add(1, Ordering::Relaxed);
        // A thread that goes to sleep has no reply to send now: the ACKs held back for one
        // that are due (`ACK_DELAY` old, as the progress thread would send them) leave before
        // it sleeps; younger ones wait for the next request to carry them (qp.rs). Sending
        // those of 50 µs (`ACK_COALESCE`) here instead cost a 1-byte ping-pong about 4 µs of
        // its 25 µs round trip (a lone ACK datagram every few round trips, and the wake-up it
        // causes at the peer; docs/performance.md). A stream's receiver needs no more: it
        // ACKs at once every `ACK_SPAN` PSNs.
        core.flush_owed_acks(Some(super::qp::ACK_DELAY));
        ReceiveWait { core, cq }
    }

    pub(crate) fn fd(&self) -> rustix::fd::BorrowedFd<'a> {
        self.core.wait_fd()
    }

    /// Receive what is waiting; returns how many datagrams.
    pub(crate) fn receive(&self) -> usize {
        // The waiter polls its queue next: what lands there need not ring its channel.
        self.cq.disarm();
        let mut st = lock(&self.core.rx);
        self.core.receive_pending(&mut st)
    }

    /// Receive what is waiting without sleeping, unless another thread is receiving (then
    /// nothing: what it receives lands in the queues all the same); returns how many
    /// datagrams. For a thread that spins instead of sleeping: while it holds this promise the
    /// device's thread stays off the socket, so its spin must receive (one non-blocking
    /// `recvmmsg` per look).
    pub(crate) fn try_receive(&self) -> usize {
        match try_lock(&self.core.rx) {
            Some(mut st) => self.core.receive_pending(&mut st),
            None => 0,
        }
    }

    /// Sleep in the socket's receive call itself, up to `rx::BLOCK`, and handle what
    /// arrives: one system call per wake-up where sleeping in `poll` on the socket and the
    /// completion channel, then receiving, takes two. `Some(n)`: there is something to poll
    /// (n datagrams were received; 0 when completions were already queued). `None`: nothing
    /// came within `rx::BLOCK`, or the device has several sockets (IPv6 GIDs) and cannot
    /// block on one — sleep on [`fd`](Self::fd) instead, which also sees the completion
    /// channel (a completion another thread queues while this one sleeps here is seen then,
    /// at most `rx::BLOCK` late).
    pub(crate) fn block(&self) -> Option<usize> {
        if !self.core.blocking {
            return None;
        }
        // Holding the receive lock, the progress thread cannot be receiving: one that was is
        // done (what it queued is seen below), and it will not start while this waiter is
        // counted (`rx_waiters`); it leaves the lock alone while a sleeper holds it (`run`).
        let mut st = lock(&self.core.rx);
        if self.cq.maybe_ready() {
            return Some(0);
        }
        let RxState {
            tables,
            ring,
            batch,
        } = &mut *st;
        let got = ring.receive_blocking(&self.core.sock);
        if got == 0 {
            return None;
        }
        self.cq.disarm();
        tables.refresh(self.core);
        self.core.handle_received(0, got, tables, ring, batch);
        let mut total = got;
        if got == super::rx::BATCH {
            total += self.core.receive_socket(0, tables, ring, batch);
        }
        batch.flush(self.core);
        Some(total)
    }
}

/// Receive what waits on a device's socket now, on the caller's thread, without the
/// promise of a [`ReceiveWait`] (the device's thread keeps receiving as before): for a
/// thread that must see what the fabric brought before it acts on news from elsewhere.
pub(crate) fn receive_now(core: &RoceCore) -> usize {
    let mut st = lock(&core.rx);
    core.receive_pending(&mut st)
}

impl Drop for ReceiveWait<'_> {
    fn drop(&mut self) {
        self.core.rx_waiters.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What receiving needs: the QP and MR tables as last seen, the `recvmmsg` buffers and the
/// ACKs the current batch owes.
pub(crate) struct RxState {
    tables: Tables,
    ring: super::rx::RxRing,
    batch: RxBatch,
}

/// The largest path MTU rxe would offer on a netdev of this MTU: the netdev MTU less 80 bytes
/// of header budget, rounded down to an IB MTU (rocev2.md 6.2).
pub(crate) fn active_mtu(netdev_mtu: u32) -> Option<Mtu> {
    let budget = netdev_mtu.checked_sub(80)? as usize;
    [
        Mtu::Mtu4096,
        Mtu::Mtu2048,
        Mtu::Mtu1024,
        Mtu::Mtu512,
        Mtu::Mtu256,
    ]
    .into_iter()
    .find(|m| m.bytes() <= budget)
}

impl RoceCore {
    pub(crate) fn port_state(&self) -> PortState {
        if self.link_up.load(Ordering::Acquire) && !self.admin_down.load(Ordering::Acquire) {
            PortState::Active
        } else {
            PortState::Down
        }
    }

    /// Whether a peer port with this GID is on this port's LAN (its IPv4 address inside the
    /// netdev's subnet, or its IPv6 address inside the prefix of one of our IPv6 GIDs): RFC
    /// 7609 §2.1.2 wants RoCE links between RNICs of one layer-2 network, and Linux SMC-R
    /// sends with TTL 1 (rocev2.md 2.2).
    pub(crate) fn reaches(&self, gid: Gid) -> bool {
        let Some(peer) = gid_ipv4(gid) else {
            let peer = Ipv6Addr::from(gid.0);
            return self
                .v6
                .iter()
                .any(|s| same_prefix(s.ip, peer, s.prefix) && s.ip != peer);
        };
        let mask = u32::MAX
            .checked_shl(32 - u32::from(self.prefix.min(32)))
            .unwrap_or(0);
        u32::from(peer) & mask == u32::from(self.ip) & mask && peer != self.ip
    }

    /// What the progress thread and a [`ReceiveWait`] sleep on: readable when a datagram
    /// waits on any of the device's sockets.
    pub(crate) fn wait_fd(&self) -> rustix::fd::BorrowedFd<'_> {
        self.waitset.as_ref().unwrap_or(&self.sock).as_fd()
    }

    /// The socket of GID index `via` (the IPv4 socket for an index the table does not have).
    pub(crate) fn sock_of(&self, via: u8) -> &OwnedFd {
        match usize::from(via).checked_sub(1).and_then(|k| self.v6.get(k)) {
            Some(s) => &s.sock,
            None => &self.sock,
        }
    }

    /// The address of GID index `via`.
    pub(crate) fn local_ip(&self, via: u8) -> IpAddr {
        match usize::from(via).checked_sub(1).and_then(|k| self.v6.get(k)) {
            Some(s) => IpAddr::V6(s.ip),
            None => IpAddr::V4(self.ip),
        }
    }

    /// The GID index of `gid` in this device's table.
    pub(crate) fn gid_index(&self, gid: Gid) -> Option<u8> {
        self.gids
            .iter()
            .position(|g| *g == gid)
            .and_then(|i| u8::try_from(i).ok())
    }

    /// The GID index a QP uses to speak to the peer GID `peer` when it is not told one: the
    /// IPv4 GID for an IPv4-mapped peer; for an IPv6 peer, the IPv6 GID on its prefix, else
    /// the first IPv6 GID; `None` without IPv6 GIDs (rocev2.md 11.1: a packet to a v4-mapped
    /// GID is IPv4, to any other GID IPv6, and source and destination are of one family).
    pub(crate) fn source_for(&self, peer: Gid) -> Option<u8> {
        if gid_ipv4(peer).is_some() {
            return Some(0);
        }
        let p = Ipv6Addr::from(peer.0);
        let k = self
            .v6
            .iter()
            .position(|s| same_prefix(s.ip, p, s.prefix))
            .or((!self.v6.is_empty()).then_some(0))?;
        u8::try_from(k + 1).ok()
    }

    pub(crate) fn active_mtu(&self) -> Mtu {
        active_mtu(self.netdev_mtu.load(Ordering::Relaxed)).unwrap_or(Mtu::Mtu256)
    }

    pub(crate) fn push_event(&self, ev: DeviceEvent) {
        let mut q = lock(&self.events);
        if q.len() >= 1024 {
            q.pop_front();
        }
        q.push_back(ev);
    }

    pub(crate) fn poll_event(&self) -> Option<DeviceEvent> {
        lock(&self.events).pop_front()
    }

    pub(crate) fn take_fail_token(&self) -> bool {
        self.fail_next.load(Ordering::Relaxed) > 0
            && self
                .fail_next
                .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok()
    }

    /// A QPN for a new QP: never 0 or 1 (special in IB), unique on the device, inside this
    /// process's range (the reuseport program steers the range's datagrams to this socket).
    pub(crate) fn alloc_qpn(&self) -> u32 {
        let qps = lock(&self.qps);
        loop {
            let n = self.qpn_base
                + (self.next_qpn.fetch_add(1, Ordering::Relaxed) & (self.qpn_span - 1));
            if n > 1 && !qps.contains_key(&n) {
                return n;
            }
        }
    }

    /// A key for a new memory region: random upper bits, so that a stale or guessed rkey of a
    /// peer rarely names a live region.
    pub(crate) fn alloc_key(&self) -> u32 {
        let mrs = lock(&self.mrs);
        loop {
            let r = u32::from_ne_bytes(crate::shm::mem::random_bytes::<4>());
            let n = (r & 0xFFFF_F000) | (self.next_key.fetch_add(1, Ordering::Relaxed) & 0xFFF);
            if n != 0 && !mrs.contains_key(&n) {
                return n;
            }
        }
    }

    pub(crate) fn alloc_pd(&self) -> u32 {
        self.next_pd.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn add_mr(&self, mr: Arc<RoceMr>) {
        lock(&self.mrs).insert(mr.key, mr);
        self.mrs_gen.fetch_add(1, Ordering::Release);
    }

    pub(crate) fn remove_mr(&self, key: u32) {
        lock(&self.mrs).remove(&key);
        self.mrs_gen.fetch_add(1, Ordering::Release);
    }

    pub(crate) fn lookup_mr(&self, key: u32) -> Option<Arc<RoceMr>> {
        lock(&self.mrs).get(&key).cloned()
    }

    pub(crate) fn add_qp(&self, qp: &Arc<RoceQp>) {
        lock(&self.qps).insert(qp.qpn, Arc::downgrade(qp));
        self.qps_gen.fetch_add(1, Ordering::Release);
    }

    pub(crate) fn remove_qp(&self, qpn: u32) {
        lock(&self.qps).remove(&qpn);
        self.qps_gen.fetch_add(1, Ordering::Release);
    }

    pub(crate) fn add_lingering(&self, qp: Arc<RoceQp>) {
        lock(&self.lingering).push(qp);
    }

    fn live_qps(&self) -> Vec<Arc<RoceQp>> {
        lock(&self.qps).values().filter_map(Weak::upgrade).collect()
    }

    /// Send the ACKs held back for a reply (qp.rs, `ACK_DELAY`): all, or those at least
    /// `age` old.
    pub(crate) fn flush_owed_acks(&self, age: Option<Duration>) {
        if self.acks_owed.load(Ordering::Acquire) == 0 {
            return;
        }
        let now = Instant::now();
        for qp in self.live_qps() {
            qp.flush_owed_ack(age.map(|a| (now, a)));
        }
    }

    /// Send one UDP payload to `dst:4791` (through the injected faults, if any).
    pub(crate) fn transmit(&self, dst: Dest, pkt: &[u8]) {
        if let Some(f) = &self.faults {
            let out = lock(f).on_transmit(dst, pkt);
            if out.dropped {
                bump(&self.counters.fault_drops);
            }
            for (d, p) in out.send {
                self.send_raw(d, &p);
            }
            return;
        }
        self.send_raw(dst, pkt);
    }

    /// Send several UDP payloads to `dst:4791` with one `sendmmsg` per batch, each given as
    /// pieces laid end to end (one iovec each; faults, when configured, apply per packet).
    pub(crate) fn transmit_batch(&self, dst: Dest, pkts: &[[&[u8]; 3]]) {
        if self.faults.is_some() {
            // The faults act on whole packets: each joined into one buffer.
            for p in pkts {
                self.transmit(dst, &p.concat());
            }
            return;
        }
        if let [p] = pkts {
            self.send_vectored(dst, p);
            return;
        }
        use rustix::net::addr::SocketAddrArg as _;
        use rustix::net::{MMsgHdr, SendAncillaryBuffer};
        let addr = SocketAddr::new(dst.ip, roce::UDP_PORT).as_any();
        let iovs: Vec<[std::io::IoSlice<'_>; 3]> =
            pkts.iter().map(|p| p.map(std::io::IoSlice::new)).collect();
        let mut ctrls: Vec<SendAncillaryBuffer<'_, '_, '_>> = pkts
            .iter()
            .map(|_| SendAncillaryBuffer::default())
            .collect();
        let mut msgs: Vec<MMsgHdr<'_>> = iovs
            .iter()
            .zip(ctrls.iter_mut())
            .map(|(iov, c)| MMsgHdr::new_with_addr(&addr, iov, c))
            .collect();
        let mut sent = 0;
        while sent < msgs.len() {
            match rustix::net::sendmmsg(
                self.sock_of(dst.via),
                &mut msgs[sent..],
                rustix::net::SendFlags::DONTWAIT,
            ) {
                Ok(0) | Err(_) => break,
                Ok(k) => sent += k,
            }
        }
        let bytes: usize = pkts[..sent]
            .iter()
            .map(|p| p.iter().map(|s| s.len()).sum::<usize>())
            .sum();
        self.counters
            .tx_packets
            .fetch_add(sent as u64, Ordering::Relaxed);
        self.counters
            .tx_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
        // A full socket buffer loses the rest: the RC retransmission recovers them.
        self.counters
            .tx_errors
            .fetch_add((pkts.len() - sent) as u64, Ordering::Relaxed);
    }

    /// Whether packets leave in `UDP_SEGMENT` runs ([`transmit_pkts`](Self::transmit_pkts)):
    /// not once the kernel refused them, nor while faults are injected (they act per packet).
    /// Tests: turn `UDP_SEGMENT` off as the kernel's refusal of it does.
    #[cfg(test)]
    pub(crate) fn refuse_runs(&self) {
        self.gso_off.store(true, Ordering::Relaxed);
    }

    pub(crate) fn sends_runs(&self) -> bool {
        self.faults.is_none() && !self.gso_off.load(Ordering::Relaxed)
    }

    /// Send a QP's kept packets, each with the IPv4 identification its ICRC is sealed for:
    /// in `UDP_SEGMENT` runs (gso.rs), all runs of one call in one `sendmmsg`, where the socket
    /// can, else one datagram per packet with identification 0 (also when faults are
    /// injected, which act per packet). IPv6 has no identification: nothing is re-sealed. A
    /// packet's pieces (txpkt.rs) go as iovecs, in runs and alone alike (in a run, the short
    /// pieces between two payloads — a tail and the next packet's headers — as one,
    /// `gso::Layout`); only when faults are injected is each packet joined into one
    /// buffer first.
    pub(crate) fn transmit_pkts(&self, dst: Dest, pkts: &mut [super::txpkt::Wire<'_>]) {
        let mut done = 0;
        let v4 = dst.ip.is_ipv4();
        if (pkts.len() > 1 || pkts.first().is_some_and(|w| w.packets > 1)) && self.sends_runs() {
            let to = SocketAddr::new(dst.ip, roce::UDP_PORT);
            let n = pkts.len();
            done = super::gso::with_layout(|layout| {
                let mut laid = layout.lay_out(pkts, v4);
                let mut next = 0;
                while let Some(&msg) = laid.msgs().get(next) {
                    match laid.send(self.sock_of(dst.via).as_fd(), to, next) {
                        Ok(k) => {
                            let sent = laid.msgs().get(next..next + k).unwrap_or_default();
                            let (n, bytes) = sent
                                .iter()
                                .fold((0, 0), |(n, b), m| (n + m.packets, b + m.bytes));
                            self.counters
                                .tx_packets
                                .fetch_add(n as u64, Ordering::Relaxed);
                            self.counters
                                .tx_bytes
                                .fetch_add(bytes as u64, Ordering::Relaxed);
                            next += k;
                        }
                        Err(e) if msg.gso_size.is_some() && super::gso::unsupported(e) => {
                            tracing::info!(
                                device = %self.config.name,
                                error = %e,
                                "roce: UDP_SEGMENT refused; one datagram per packet from now on"
                            );
                            self.gso_off.store(true, Ordering::Relaxed);
                            break;
                        }
                        // A full socket buffer or a network that is down loses the message:
                        // the RC retransmission recovers it.
                        Err(_) => {
                            self.counters
                                .tx_errors
                                .fetch_add(msg.packets as u64, Ordering::Relaxed);
                            next += 1;
                        }
                    }
                }
                laid.msgs().get(next).map_or(n, |m| m.first)
            });
        }
        if done == pkts.len() {
            return;
        }
        // Alone, each packet is sealed for identification 0 (a fixed one sealed for another:
        // a copy); a whole run's packets one by one.
        let mut singles: Vec<super::txpkt::Wire<'_>> = pkts[done..]
            .iter_mut()
            .flat_map(super::txpkt::Wire::split)
            .collect();
        let copies: Vec<Option<Vec<u8>>> = singles
            .iter_mut()
            .map(|w| if v4 { w.seal_for(0) } else { None })
            .collect();
        let rest: Vec<[&[u8]; 3]> = singles
            .iter()
            .zip(&copies)
            .map(|(w, c)| match c {
                Some(c) => [&c[..], &[], &[]],
                None => w.pieces(),
            })
            .collect();
        self.transmit_batch(dst, &rest);
    }

    /// Send one packet given as pieces laid end to end (one `sendmsg`, one iovec each: no
    /// join in user space).
    fn send_vectored(&self, dst: Dest, pieces: &[&[u8]; 3]) {
        use rustix::net::SendAncillaryBuffer;
        let addr = SocketAddr::new(dst.ip, roce::UDP_PORT);
        let iov = pieces.map(std::io::IoSlice::new);
        let len: usize = pieces.iter().map(|p| p.len()).sum();
        match rustix::net::sendmsg_addr(
            self.sock_of(dst.via),
            &addr,
            &iov,
            &mut SendAncillaryBuffer::default(),
            rustix::net::SendFlags::DONTWAIT,
        ) {
            Ok(_) => {
                bump(&self.counters.tx_packets);
                self.counters
                    .tx_bytes
                    .fetch_add(len as u64, Ordering::Relaxed);
            }
            // As send_raw: the RC retransmission recovers a packet lost here.
            Err(_) => bump(&self.counters.tx_errors),
        }
    }

    fn send_raw(&self, dst: Dest, pkt: &[u8]) {
        let addr = SocketAddr::new(dst.ip, roce::UDP_PORT);
        let sock = self.sock_of(dst.via);
        match rustix::net::sendto(sock, pkt, rustix::net::SendFlags::DONTWAIT, &addr) {
            Ok(_) => {
                bump(&self.counters.tx_packets);
                self.counters
                    .tx_bytes
                    .fetch_add(pkt.len() as u64, Ordering::Relaxed);
            }
            // A full socket buffer or an unreachable network is a lost packet: the RC
            // retransmission recovers it.
            Err(_) => bump(&self.counters.tx_errors),
        }
    }

    fn set_down(&self, reason: &'static str) {
        for qp in self.live_qps() {
            qp.enter_error(None, reason);
        }
        self.push_event(DeviceEvent::PortDown);
    }
}

/// Every roce device of the process, for the exit-time drain.
static DEVICES: Mutex<Vec<Weak<RoceCore>>> = Mutex::new(Vec::new());
static AT_EXIT: std::sync::Once = std::sync::Once::new();
/// Longest the process exit waits for unacknowledged packets.
const EXIT_DRAIN: Duration = Duration::from_secs(2);

/// Runs at process exit (libc `atexit`): while any QP of any roce device still has requests
/// unacknowledged, wait (up to [`EXIT_DRAIN`], until 20 ms passed with nothing outstanding).
/// A program that wrote its last bytes to an SMC-R socket and returns from `main` would
/// otherwise take them along: a posted WRITE is only queued here, where the shared-memory
/// fabric places it at once; the progress threads keep running during the wait.
extern "C" fn drain_at_exit() {
    let start = Instant::now();
    let mut quiet_since = Instant::now();
    while start.elapsed() < EXIT_DRAIN {
        let cores: Vec<Arc<RoceCore>> = match DEVICES.try_lock() {
            Ok(d) => d.iter().filter_map(Weak::upgrade).collect(),
            Err(_) => return,
        };
        for c in &cores {
            c.flush_owed_acks(None);
        }
        let busy = cores.iter().any(|c| {
            c.live_qps().iter().any(|q| q.has_unacked()) || !lock(&c.lingering).is_empty()
        });
        drop(cores);
        if busy {
            quiet_since = Instant::now();
        } else if quiet_since.elapsed() >= Duration::from_millis(20) {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// An opened roce device; the progress thread stops when the last handle goes.
pub(crate) struct RoceHandle {
    pub(crate) core: Arc<RoceCore>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

fn bind_error(entry: &str, ip: IpAddr, e: super::steer::BindError) -> String {
    use super::steer::BindError;
    match e {
        BindError::InUse { shared: true } => format!(
            "{entry}: UDP port 4791 on {ip} is already owned by a socket outside smc-rs's \
             shared group (the kernel's rdma_rxe module, which binds 4791 once loaded, or an \
             smc-rs process that could not load the eBPF steering program)"
        ),
        BindError::InUse { shared: false } => format!(
            "{entry}: UDP port 4791 on {ip} is already owned (the kernel's rdma_rxe module, or \
             another smc-rs process on this address; sharing an address between smc-rs \
             processes needs CAP_BPF and CAP_SYS_ADMIN for the eBPF steering program, \
             otherwise give each its own address or network namespace)"
        ),
        BindError::ForeignGroup { registry } => format!(
            "{entry}: UDP port 4791 on {ip} is shared by smc-rs processes registered outside \
             {} (another SMC_FABRIC_DIR; processes sharing an address must share the fabric \
             directory), or this process may not open their eBPF map by id (CAP_SYS_ADMIN)",
            registry.display()
        ),
        BindError::SlotsFull => format!(
            "{entry}: all 256 QPN ranges of UDP port 4791 on {ip} are held by live processes"
        ),
        BindError::SlotTaken(k) => format!(
            "{entry}: QPN range {k} of UDP port 4791 on {ip} is held by another process (a \
             process that shares this IPv6 address but not the device's IPv4 address)"
        ),
        BindError::Other(detail) => format!("{entry}: {detail}"),
    }
}

fn open_err(name: &str, detail: String) -> FabricError {
    FabricError::DeviceOpen {
        device: name.to_owned(),
        detail,
    }
}

impl RoceHandle {
    pub(crate) fn open(fabric: &FabricConfig, name: &str) -> Result<Arc<RoceHandle>> {
        Self::open_at(fabric, name, None)
    }

    /// Open with the GID's address given instead of taken from the netdev (tests put several
    /// devices on loopback addresses 127.x.y.z this way).
    pub(crate) fn open_at(
        fabric: &FabricConfig,
        name: &str,
        address: Option<Ipv4Addr>,
    ) -> Result<Arc<RoceHandle>> {
        Self::open_with(fabric, name, address, None)
    }

    /// [`open_at`](Self::open_at) with the IPv6 GIDs (address, prefix length) given instead of
    /// taken from the netdev (tests put one on `::1`, which is never a GID otherwise).
    pub(crate) fn open_with(
        fabric: &FabricConfig,
        name: &str,
        address: Option<Ipv4Addr>,
        ipv6: Option<Vec<(Ipv6Addr, u8)>>,
    ) -> Result<Arc<RoceHandle>> {
        let (_, config) = fabric.device(name)?;
        let crate::config::DeviceKind::Roce { netdev } = &config.kind else {
            return Err(FabricError::InvalidArgument("not a roce device"));
        };
        let entry = format!("roce:{name}={netdev}");
        let info = netdev::info(netdev).map_err(|e| open_err(name, format!("getifaddrs: {e}")))?;
        if !info.exists {
            return Err(open_err(
                name,
                format!("{entry}: no network interface '{netdev}' in this namespace"),
            ));
        }
        let prefix = match address {
            Some(a) => info
                .ipv4
                .iter()
                .position(|x| *x == a)
                .and_then(|i| info.ipv4_prefix.get(i).copied())
                .unwrap_or(8),
            None => info.ipv4_prefix.first().copied().unwrap_or(32),
        };
        let Some(ip) = address.or(info.ipv4.first().copied()) else {
            return Err(open_err(
                name,
                format!(
                    "{entry}: interface '{netdev}' has no IPv4 address (the GID is ::ffff:a.b.c.d)"
                ),
            ));
        };
        let sock = rustix::net::socket_with(
            AddressFamily::INET,
            SocketType::DGRAM,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .map(crate::fdplace::placed)
        .map_err(|e| FabricError::os("socket", e))?;
        // rocev2.md 13.2: an unconnected socket with IP_PMTUDISC_DO sends identification 0 and
        // DF, which the ICRC covers.
        rustix::net::sockopt::set_ip_mtu_discover(
            &sock,
            rustix::net::sockopt::Ipv4PathMtuDiscovery::DO,
        )
        .map_err(|e| FabricError::os("IP_MTU_DISCOVER", e))?;
        // rocev2.md 15.3: room for bursts of up to 128 packets per QP.
        if rustix::net::sockopt::set_socket_recv_buffer_size_force(&sock, 8 << 20).is_err() {
            let _ = rustix::net::sockopt::set_socket_recv_buffer_size(&sock, 8 << 20);
        }
        let _ = rustix::net::sockopt::set_socket_send_buffer_size(&sock, 4 << 20);
        let binding = match super::steer::bind(
            &sock,
            IpAddr::V4(ip),
            roce::UDP_PORT,
            &fabric.dir,
            super::steer::Slot::Any,
        ) {
            Ok(b) => b,
            Err(e) => return Err(open_err(name, bind_error(&entry, IpAddr::V4(ip), e))),
        };
        let mtu = netdev::mtu(sock.as_fd(), netdev).unwrap_or(1500);
        if active_mtu(mtu).is_none() {
            return Err(open_err(
                name,
                format!("{entry}: MTU {mtu} of '{netdev}' is too small for RoCEv2"),
            ));
        }
        let up = netdev::is_up(sock.as_fd(), netdev);
        let mut faults = Faults::default();
        let mut any_fault = false;
        let core_fail = AtomicU32::new(0);
        let admin_down = AtomicBool::new(false);
        for (dev, fault) in &fabric.faults {
            if dev != name {
                continue;
            }
            match fault {
                Fault::PortDown => admin_down.store(true, Ordering::Relaxed),
                Fault::FailNext(n) => {
                    core_fail.fetch_add(*n, Ordering::Relaxed);
                }
                f => {
                    faults.add(f);
                    any_fault = true;
                }
            }
        }
        let gid = ip.to_ipv6_mapped().octets();
        // The IPv6 GIDs: one socket each, in the QPN range of the IPv4 socket. One that
        // cannot be had is left out of the table (the device still speaks IPv4), said in
        // the log.
        let slot = match binding {
            super::steer::Binding::Shared { slot } => super::steer::Slot::Exactly(slot),
            super::steer::Binding::Exclusive => super::steer::Slot::Alone,
        };
        let mut v6 = Vec::new();
        let mut v6_addrs = ipv6.unwrap_or_else(|| info.ipv6_gids());
        if v6_addrs.len() > MAX_V6_GIDS {
            tracing::warn!(
                device = name,
                "roce: only the first {MAX_V6_GIDS} IPv6 addresses become GIDs"
            );
            v6_addrs.truncate(MAX_V6_GIDS);
        }
        for (a, prefix) in v6_addrs {
            match open_v6(a, &fabric.dir, slot) {
                Ok(sock) => v6.push(V6Sock {
                    ip: a,
                    prefix,
                    sock,
                }),
                Err(e) => {
                    let why = match e {
                        V6Error::Os(what, e) => format!("{entry}: {what}: {e}"),
                        V6Error::Bind(e) => bind_error(&entry, IpAddr::V6(a), e),
                    };
                    tracing::warn!(device = name, address = %a, "roce: no IPv6 GID: {why}");
                }
            }
        }
        let mut gids = vec![Gid(gid)];
        gids.extend(v6.iter().map(|s| Gid(s.ip.octets())));
        let waitset = if v6.is_empty() {
            None
        } else {
            let ep = crate::fdplace::make(|| {
                rustix::event::epoll::create(rustix::event::epoll::CreateFlags::CLOEXEC)
            })
            .map_err(|e| FabricError::os("epoll_create", e))?;
            for (via, s) in std::iter::once(&sock)
                .chain(v6.iter().map(|s| &s.sock))
                .enumerate()
            {
                rustix::event::epoll::add(
                    &ep,
                    s,
                    rustix::event::epoll::EventData::new_u64(via as u64),
                    rustix::event::epoll::EventFlags::IN,
                )
                .map_err(|e| FabricError::os("epoll_ctl", e))?;
            }
            Some(ep)
        };
        let (qpn_base, qpn_span) = binding.qpn_range();
        let first_qpn = 0x11 + (u32::from_ne_bytes(crate::shm::mem::random_bytes::<4>()) & 0xFFF);
        // rx.rs: received packets coalesced per UDP_SEGMENT send (off with SMC_ROCE_NO_GRO).
        let gro =
            std::env::var_os("SMC_ROCE_NO_GRO").is_none() && super::rx::set_gro(sock.as_fd(), true);
        if gro {
            for s in &v6 {
                super::rx::set_gro(s.sock.as_fd(), true);
            }
        }
        // A waiter may sleep in the receive call itself when the device has this one socket
        // (`ReceiveWait::block`); the timeout bounds that sleep (SMC_ROCE_NO_BLOCK=1: never).
        let blocking = v6.is_empty()
            && std::env::var_os("SMC_ROCE_NO_BLOCK").is_none()
            && super::rx::set_block_timeout(sock.as_fd());
        let core = Arc::new(RoceCore {
            config: config.clone(),
            netdev: netdev.clone(),
            ip,
            prefix,
            gid: Gid(gid),
            gids,
            v6,
            waitset,
            mac: Mac(info.mac),
            netdev_mtu: AtomicU32::new(mtu),
            sock,
            link_up: AtomicBool::new(up),
            admin_down,
            fail_next: core_fail,
            qps: Mutex::new(HashMap::new()),
            qps_gen: AtomicU64::new(0),
            mrs: Mutex::new(HashMap::new()),
            mrs_gen: AtomicU64::new(0),
            next_qpn: AtomicU32::new(first_qpn),
            qpn_base,
            qpn_span,
            gso_off: AtomicBool::new(std::env::var_os("SMC_ROCE_NO_GSO").is_some()),
            gro: AtomicBool::new(gro),
            blocking,
            next_key: AtomicU32::new(1),
            next_pd: AtomicU32::new(1),
            events: Mutex::new(VecDeque::new()),
            counters: Counters::default(),
            faults: any_fault.then(|| Mutex::new(faults)),
            shutdown: AtomicBool::new(false),
            lingering: Mutex::new(Vec::new()),
            rx: Mutex::new(RxState {
                tables: Tables {
                    qps_gen: u64::MAX,
                    qps: HashMap::new(),
                    mrs_gen: u64::MAX,
                    mrs: HashMap::new(),
                },
                ring: super::rx::RxRing::new(),
                batch: RxBatch::default(),
            }),
            rx_waiters: AtomicU32::new(0),
            rx_waits_made: AtomicU64::new(0),
            acks_owed: AtomicUsize::new(0),
            progress_tid: AtomicI32::new(0),
        });
        {
            let mut d = lock(&DEVICES);
            d.retain(|w| w.strong_count() > 0);
            d.push(Arc::downgrade(&core));
        }
        AT_EXIT.call_once(|| {
            // SAFETY: registers a plain function with no preconditions.
            unsafe { libc::atexit(drain_at_exit) };
        });
        let c2 = core.clone();
        let thread = crate::threads::spawn_running(
            std::thread::Builder::new().name(format!("smc-roce-{name}")),
            move || run(c2),
        )
        .map_err(|e| FabricError::os("spawn roce thread", e))?;
        Ok(Arc::new(RoceHandle {
            core,
            thread: Mutex::new(Some(thread)),
        }))
    }

    /// The scheduling policy of the device's progress thread, once it has started (its
    /// kernel thread id: `pthread_getschedparam` would answer from glibc's cache, filled by
    /// the first question, perhaps before the thread set its policy).
    #[cfg(test)]
    pub(crate) fn progress_policy(&self) -> Option<libc::c_int> {
        let tid = self.core.progress_tid.load(Ordering::Acquire);
        if tid == 0 {
            return None;
        }
        crate::sched::policy_of(tid)
    }

    pub(crate) fn set_port_state(&self, state: PortState) {
        let was = self.core.port_state();
        self.core
            .admin_down
            .store(state == PortState::Down, Ordering::Release);
        let now = self.core.port_state();
        if was != now {
            match now {
                PortState::Down => self.core.set_down("port down"),
                PortState::Active => self.core.push_event(DeviceEvent::PortActive),
            }
        }
    }
}

impl Drop for RoceHandle {
    fn drop(&mut self) {
        // Let lingering QPs finish (bounded by their own deadline).
        let deadline = Instant::now() + super::qp::LINGER + Duration::from_millis(100);
        while !lock(&self.core.lingering).is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.core.shutdown.store(true, Ordering::Release);
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
    }
}

/// The progress thread's copy of the QP and MR tables, refreshed when their generation moves:
/// a packet looks its QP and rkey up without a lock shared with other connections.
pub(crate) struct Tables {
    qps_gen: u64,
    pub(crate) qps: HashMap<u32, Arc<RoceQp>>,
    mrs_gen: u64,
    pub(crate) mrs: HashMap<u32, Arc<RoceMr>>,
}

impl Tables {
    fn refresh(&mut self, core: &RoceCore) {
        let g = core.qps_gen.load(Ordering::Acquire);
        if g != self.qps_gen {
            self.qps = lock(&core.qps)
                .iter()
                .filter_map(|(k, w)| w.upgrade().map(|q| (*k, q)))
                .collect();
            self.qps_gen = g;
        }
        let g = core.mrs_gen.load(Ordering::Acquire);
        if g != self.mrs_gen {
            self.mrs = lock(&core.mrs).clone();
            self.mrs_gen = g;
        }
    }
}

impl RoceCore {
    /// Receive and handle every datagram waiting on the socket (up to [`BATCH`] rounds of one
    /// `recvmmsg` each), then send the ACKs they owe; returns how many were received.
    fn receive_pending(&self, st: &mut RxState) -> usize {
        let RxState {
            tables,
            ring,
            batch,
        } = st;
        tables.refresh(self);
        let mut total = self.receive_socket(0, tables, ring, batch);
        for via in 1..=self.v6.len() {
            total += self.receive_socket(via as u8, tables, ring, batch);
        }
        batch.flush(self);
        total
    }

    /// Receive what waits on the socket of GID index `via`; returns how many datagrams.
    fn receive_socket(
        &self,
        via: u8,
        tables: &mut Tables,
        ring: &mut super::rx::RxRing,
        batch: &mut RxBatch,
    ) -> usize {
        let mut total = 0;
        for _ in 0..super::rx::ROUNDS {
            let got = ring.receive(self.sock_of(via));
            total += got;
            self.handle_received(via, got, tables, ring, batch);
            if got < super::rx::BATCH {
                break;
            }
        }
        total
    }

    /// Handle the `got` datagrams the last receive on the socket of GID index `via` put in
    /// `ring`.
    fn handle_received(
        &self,
        via: u8,
        got: usize,
        tables: &mut Tables,
        ring: &super::rx::RxRing,
        batch: &mut RxBatch,
    ) {
        for i in 0..got {
            let (from, data, seg) = ring.datagram(i);
            self.counters
                .rx_bytes
                .fetch_add(data.len() as u64, Ordering::Relaxed);
            tables.refresh(self);
            // A coalesced datagram (UDP_GRO) holds several packets of `seg` bytes each
            // (the last one may be shorter): each is a packet of its own. Counted once per
            // datagram, before they are handled (an atomic add per packet was the only shared
            // write of the loop).
            let packets = super::rx::packets(data, seg).count();
            self.counters
                .rx_packets
                .fetch_add(packets as u64, Ordering::Relaxed);
            let seg_len = seg.unwrap_or(data.len());
            let rx_from =
                super::inbound::RxFrom::new(self, from.ip(), from.port(), via, seg_len, packets);
            // A coalesced datagram's packets of the segment length, four at a time, have their
            // ICRCs (for identification 0) computed side by side first (seal.rs).
            let by_four = match &rx_from.seal4 {
                Some(_) if seg.is_some() => (data.len() / seg_len) / 4 * 4,
                _ => 0,
            };
            let mut icrc0 = [0u32; 4];
            for (k, pkt) in super::rx::packets(data, seg).enumerate() {
                if seg.is_some() && !self.owns_qpn(pkt) {
                    self.gro_off("a coalesced datagram held another process's packets");
                }
                let pre = match &rx_from.seal4 {
                    Some(s) if k < by_four => {
                        if k % 4 == 0 {
                            let at = |j: usize| (k + j) * seg_len;
                            icrc0 = s.icrc4(std::array::from_fn(|j| &data[at(j)..at(j) + seg_len]));
                        }
                        Some(icrc0[k % 4])
                    }
                    _ => None,
                };
                // Packet k of a coalesced send left with IPv4 identification k (gso.rs).
                let id = if seg.is_some() { k as u16 } else { 0 };
                super::inbound::receive(self, tables, batch, &rx_from, id, pkt, pre);
            }
        }
    }

    /// Whether the packet's destination QPN (BTH bytes 5–7) is in this process's range (a
    /// packet too short for a BTH counts as ours: the checks drop it).
    fn owns_qpn(&self, pkt: &[u8]) -> bool {
        let Some(b) = pkt.get(5..8) else {
            return true;
        };
        let qpn = u32::from_be_bytes([0, b[0], b[1], b[2]]);
        qpn.wrapping_sub(self.qpn_base) < self.qpn_span
    }

    /// Stop coalescing on receive (see rx.rs): the kernel's GRO may merge packets of QPs of
    /// other processes sharing the port into one datagram, which is steered as a unit.
    fn gro_off(&self, why: &str) {
        if self.gro.swap(false, Ordering::AcqRel) {
            tracing::info!(device = %self.config.name, why, "roce: UDP_GRO off");
            super::rx::set_gro(self.sock.as_fd(), false);
            for s in &self.v6 {
                super::rx::set_gro(s.sock.as_fd(), false);
            }
        }
    }
}

/// What the progress thread does at a look at the socket (`run`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Look {
    /// An application thread sleeps on the socket: stay off it for the (doubling) lease.
    Lease,
    /// None does right now, but some waited since the last look: stay off it for `LEASE`.
    Defer,
    /// Watch the socket and receive.
    Watch,
}

impl Look {
    /// The look given whether an application thread waits on the socket now, whether one
    /// waited since the last look, and how many looks in a row deferred (updated): at most
    /// [`MAX_DEFERRED`] in a row.
    pub(crate) fn at(waiting: bool, waited_since: bool, deferred: &mut u32) -> Look {
        let look = if waiting {
            Look::Lease
        } else if waited_since && *deferred < MAX_DEFERRED {
            Look::Defer
        } else {
            Look::Watch
        };
        *deferred = if look == Look::Defer {
            *deferred + 1
        } else {
            0
        };
        look
    }
}

fn run(core: Arc<RoceCore>) {
    // Under `SCHED_BATCH` for good (sched.rs): its wake-ups — for a datagram nobody waits
    // for (a stream writer's ACKs), a lease's end, a tick — never take a busy CPU from the
    // thread on it (on a two-core machine, often the stream's writer: up to 180 times per
    // 256 MiB, docs/performance.md, "Session 29"). It runs at once on an idle CPU, else
    // when the running thread sleeps or its slice ends: well inside its own deadlines
    // (`ACK_DELAY`, 200 µs, is the shortest; the transport's timers are 1 ms and more).
    // An application's own policy (a thread that made the device under another) is kept.
    crate::sched::batch_if_other();
    // SAFETY: no arguments.
    let tid = unsafe { libc::gettid() };
    core.progress_tid.store(tid, Ordering::Release);
    let mut last_port_check = Instant::now();
    // When the oldest ACK held back for a reply falls due (qp.rs, `ACK_DELAY`).
    let mut ack_due: Option<Instant> = None;
    let mut lease = LEASE;
    // `rx_waits_made` at the last look.
    let mut waits_seen = 0;
    // Looks in a row that left the socket to application threads between their waits.
    let mut deferred = 0;
    while !core.shutdown.load(Ordering::Acquire) {
        // Whether the device has a live QP, from the shared table: the receive lock is left
        // to the receivers (an application thread about to sleep in the socket's receive
        // call, `ReceiveWait::block`, that found it held here would wait on a futex for it).
        let idle = lock(&core.qps).values().all(|w| w.strong_count() == 0);
        // Application threads that a bulk read's sleep left under `SCHED_BATCH` and that
        // have not slept again since get their own policy back (sched.rs; an atomic load
        // when there are none). While there are, this thread ticks at its shortest.
        crate::sched::restore_stale(crate::sched::KEEP_MAX);
        let mut timeout = if idle && !crate::sched::any_kept() {
            Duration::from_millis(20)
        } else {
            TICK
        };
        if let Some(t) = ack_due {
            timeout = timeout.min(t.saturating_duration_since(Instant::now()));
        }
        let waits = core.rx_waits_made.load(Ordering::Relaxed);
        let look = Look::at(
            core.rx_waiters.load(Ordering::Acquire) > 0,
            waits != waits_seen,
            &mut deferred,
        );
        waits_seen = waits;
        // Whether this look watches the socket (else it sleeps a lease).
        let polled = look == Look::Watch;
        if look == Look::Lease {
            // An application thread sleeps on the socket and receives what arrives itself:
            // stay off the socket, so that its datagrams wake that thread only.
            std::thread::sleep(timeout.min(lease));
            lease = (lease * 2).min(TICK);
        } else if look == Look::Defer {
            // None sleeps on it right now, but application threads did since the last look:
            // likely one is between two waits (a ping-pong's, handling a reply and writing
            // the next request). Watching the socket now, this thread would wake beside it
            // for the next datagram; look again after the shortest lease instead. A datagram
            // nobody waits for is then received at most a lease and `LEASE` late (and
            // [`MAX_DEFERRED`] `LEASE`s late at worst, should the waits go on without
            // receiving it).
            std::thread::sleep(timeout.min(LEASE));
        } else {
            lease = LEASE;
            let ts = rustix::event::Timespec {
                tv_sec: 0,
                tv_nsec: timeout.as_nanos() as _,
            };
            let mut fds = [rustix::event::PollFd::from_borrowed_fd(
                core.wait_fd(),
                rustix::event::PollFlags::IN,
            )];
            let _ = rustix::event::poll(&mut fds, Some(&ts));
            if !fds[0].revents().is_empty() && core.rx_waiters.load(Ordering::Acquire) > 0 {
                // An application thread began to sleep on the socket meanwhile, woken by the
                // same datagram: leave it to that thread.
                continue;
            }
        }
        let now = {
            let mut tick = |qps: &mut dyn Iterator<Item = &Arc<RoceQp>>| {
                let now = Instant::now();
                ack_due = None;
                for qp in qps {
                    qp.on_tick(now);
                    if let Some(t) = qp.flush_owed_ack(Some((now, super::qp::ACK_DELAY))) {
                        ack_due = Some(ack_due.map_or(t, |d| d.min(t)));
                    }
                }
                now
            };
            // Receive only while no application thread promised to, and hold the receive
            // lock only for that: the timers run from the shared table, so that a thread
            // going to sleep in the receive call (`ReceiveWait::block`) never waits for them.
            // Nor while application threads began to wait since the look above (they
            // receive between their waits too; the next look sees it).
            let left_to_us = || {
                core.rx_waiters.load(Ordering::Acquire) == 0
                    && (polled || core.rx_waits_made.load(Ordering::Relaxed) == waits_seen)
            };
            if left_to_us() {
                // A waiter asleep in the socket's receive call holds the receive lock: never
                // wait for it here.
                if let Some(mut st) = try_lock(&core.rx) {
                    if left_to_us() {
                        core.receive_pending(&mut st);
                    }
                }
            }
            tick(&mut core.live_qps().iter())
        };
        {
            let mut l = lock(&core.lingering);
            if !l.is_empty() {
                l.retain(|q| !q.linger_done(now));
            }
        }
        if let Some(f) = &core.faults {
            let due = lock(f).due(now);
            for (d, p) in due {
                core.send_raw(d, &p);
            }
        }
        if now.duration_since(last_port_check) >= PORT_CHECK {
            last_port_check = now;
            check_port(&core);
        }
    }
    core.flush_owed_acks(None);
    // No tick restores them any more.
    crate::sched::restore_stale(Duration::ZERO);
}

/// Follow the netdev: down (or gone, or without carrier) is a port failure, as an RNIC's port
/// going down (RFC 7609 §2.1.2: "an RNIC or port failure … the link is lost").
fn check_port(core: &RoceCore) {
    let was = core.port_state();
    let up = netdev::is_up(core.sock.as_fd(), &core.netdev);
    if let Some(m) = netdev::mtu(core.sock.as_fd(), &core.netdev) {
        core.netdev_mtu.store(m, Ordering::Relaxed);
    }
    core.link_up.store(up, Ordering::Release);
    let now = core.port_state();
    if was != now {
        tracing::info!(device = %core.config.name, netdev = %core.netdev, ?now, "roce port state");
        match now {
            PortState::Down => core.set_down("netdev down"),
            PortState::Active => core.push_event(DeviceEvent::PortActive),
        }
    }
}

/// A snapshot of a roce device's counters, see [`crate::DeviceCounters`].
pub(crate) fn snapshot(core: &RoceCore) -> crate::DeviceCounters {
    let c = &core.counters;
    let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
    crate::DeviceCounters {
        tx_packets: g(&c.tx_packets),
        tx_bytes: g(&c.tx_bytes),
        rx_packets: g(&c.rx_packets),
        rx_bytes: g(&c.rx_bytes),
        retransmits: g(&c.retransmits),
        timeouts: g(&c.timeouts),
        naks_sent: g(&c.naks_sent),
        naks_received: g(&c.naks_received),
        rnr_naks_sent: g(&c.rnr_naks_sent),
        rnr_naks_received: g(&c.rnr_naks_received),
        acks_sent: g(&c.acks_sent),
        duplicates: g(&c.duplicates),
        drop_icrc: g(&c.drop_icrc),
        drop_malformed: g(&c.drop_malformed),
        drop_unknown_qp: g(&c.drop_unknown_qp),
        drop_wrong_source: g(&c.drop_wrong_source),
        drop_out_of_sequence: g(&c.drop_out_of_sequence),
        drop_ghost_acks: g(&c.drop_ghost_acks),
        remote_access_errors: g(&c.remote_access_errors),
        tx_errors: g(&c.tx_errors),
        fault_drops: g(&c.fault_drops),
    }
}

/// The IP address a peer GID stands for, if it is an IPv4-mapped one.
pub(crate) fn gid_ipv4(gid: Gid) -> Option<Ipv4Addr> {
    roce::gid_ipv4(gid.0)
}

/// Whether `a` and `b` share their first `prefix` bits.
pub(crate) fn same_prefix(a: Ipv6Addr, b: Ipv6Addr, prefix: u8) -> bool {
    let mask = u128::MAX
        .checked_shl(128 - u32::from(prefix.min(128)))
        .unwrap_or(0);
    u128::from(a) & mask == u128::from(b) & mask
}

/// Why the socket of an IPv6 GID could not be had.
enum V6Error {
    Os(&'static str, rustix::io::Errno),
    Bind(super::steer::BindError),
}

/// Set an integer socket option rustix has no call for.
pub(crate) fn setsockopt_int(
    sock: impl rustix::fd::AsFd,
    level: i32,
    name: i32,
    value: i32,
) -> rustix::io::Result<()> {
    use rustix::fd::AsRawFd as _;
    let sock = sock.as_fd();
    // SAFETY: a plain setsockopt with a pointer to a live c_int and its size.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(
            rustix::io::Errno::from_io_error(&std::io::Error::last_os_error())
                .unwrap_or(rustix::io::Errno::INVAL),
        )
    }
}

/// The socket of IPv6 GID `a`: bound to `[a]:4791` in QPN slot `slot` of that address's
/// group (steer.rs).
fn open_v6(
    a: Ipv6Addr,
    dir: &std::path::Path,
    slot: super::steer::Slot,
) -> std::result::Result<OwnedFd, V6Error> {
    let sock = rustix::net::socket_with(
        AddressFamily::INET6,
        SocketType::DGRAM,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .map(crate::fdplace::placed)
    .map_err(|e| V6Error::Os("socket", e))?;
    rustix::net::sockopt::set_ipv6_v6only(&sock, true)
        .map_err(|e| V6Error::Os("IPV6_V6ONLY", e))?;
    // rocev2.md 15.1: never fragment (an IPv6 packet carries no identification the ICRC
    // covers, so this is only about the path MTU).
    setsockopt_int(
        &sock,
        libc::IPPROTO_IPV6,
        libc::IPV6_MTU_DISCOVER,
        libc::IPV6_PMTUDISC_DO,
    )
    .map_err(|e| V6Error::Os("IPV6_MTU_DISCOVER", e))?;
    // rocev2.md 2.4: rxe sends UDP checksum 0 over IPv6 too, which a Linux socket drops
    // without this option.
    setsockopt_int(&sock, libc::IPPROTO_UDP, libc::UDP_NO_CHECK6_RX, 1)
        .map_err(|e| V6Error::Os("UDP_NO_CHECK6_RX", e))?;
    // An address still in duplicate address detection (tentative) can be bound all the same:
    // it answers once DAD ends, and the retransmission covers the meantime.
    let _ = setsockopt_int(&sock, libc::IPPROTO_IPV6, libc::IPV6_FREEBIND, 1);
    if rustix::net::sockopt::set_socket_recv_buffer_size_force(&sock, 8 << 20).is_err() {
        let _ = rustix::net::sockopt::set_socket_recv_buffer_size(&sock, 8 << 20);
    }
    let _ = rustix::net::sockopt::set_socket_send_buffer_size(&sock, 4 << 20);
    super::steer::bind(&sock, IpAddr::V6(a), roce::UDP_PORT, dir, slot).map_err(V6Error::Bind)?;
    Ok(sock)
}
