//! The per-process SMC-R stack: the sans-IO [`Endpoint`] of smc-proto driven over the
//! smc-fabric devices, with a runtime thread that polls completion queues and fires timers.
//!
//! Locking: one mutex guards the endpoint, the fabric objects and the connection table
//! ([`Core`]). The data path (`SmcStream::read`/`write`) takes it in the calling thread and
//! copies once: a write posts RDMA WRITEs straight from the application's slice (the shm
//! fabric executes them at post), a read copies out of our RMB into the application's buffer.
//!
//! Progress: a reader or writer that must wait becomes the *poller* unless another thread is:
//! it sleeps on the completion channels itself and handles what arrives (no hop through the
//! runtime thread); with busy polling it first spins on the completion queues. Other waiting
//! threads sleep on their connection's condition variable, signalled by the events of that
//! connection. The runtime thread fires timers, polls device events, and watches the
//! completion channels only while no application thread polls (or others wait, a rendezvous
//! runs, or an event loop waits on a connection's eventfds).

// Maps keyed by the stack's own ids (TcpId, LinkId): foldhash instead of SipHash, which cost
// 5-10 % of the work per message on the data path.
use foldhash::{HashMap, HashMapExt as _};
use std::io::Write as _;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use smc_fabric::{
    AccessFlags, CompletionQueue, Device, DeviceEvent, MemoryRegion, PortState, PostStatus,
    ProtectionDomain, QpCaps, QueuePair, RecvWr, RemoteQpInfo, SendWr, WorkCompletion,
};
use smc_proto::endpoint::{EndpointEvent, ResetReason, TcpId, WriteOutcome};
use smc_proto::fabric::{
    DeviceId, FabricOp, LgrId, LinkId, MrInfo, QpInfo, ResourceError, Resources, SendMsg, WrId,
};
use smc_proto::rmb_pool::RmbId;
use smc_proto::{ConnError, Endpoint, EndpointConfig, Timestamp};
use smc_wire::{PeerId, QpMtu, U24};

use crate::config::{DiscoveryMode, StackConfig};
use crate::discovery::TcpOptionDiscovery;
use crate::error::{FallbackReason, Mode, StackError};

mod fabric;
mod introspect;
mod runtime;
mod send;
mod slots;

pub(crate) use fabric::{copy_regions, Fabric};
use fabric::{open_fabric, LinkQp};
pub use introspect::{LinkGroupInfo, LinkInfo};
use runtime::runtime;
use send::{reset_socket, waits_for_room, Deferred, DirectSend};
pub(crate) use slots::{Slot, Slots};

/// How long the connections of a lost link group wait, together, for their peer's FIN (its
/// process died and its kernel closes its sockets; see `Slot::peer_exited`).
const FIN_GRACE: Duration = Duration::from_millis(20);

/// Receive buffers posted per QP.
const RECV_SLOTS: u64 = 128;
/// Bytes per receive slot of a v1 link (its messages are 44 bytes).
const RECV_SLOT_LEN: usize = 64;
/// Bytes per receive slot of a v2 link: an LLC v2 message reaches 8192 bytes, and a SEND
/// longer than the buffer it lands in fails the QP (spec §10.2). Every slot of a v2 link is
/// this long, since a sender cannot steer its SEND to a large slot.
const RECV_SLOT_LEN_V2: usize = smc_wire::llc_v2::LLC_V2_MAX_LEN;
/// Work-request ids of receives carry this bit; the rest is `link << 8 | slot`.
const RECV_FLAG: u64 = 1 << 63;
/// The runtime thread sleeps at most this long (device events are polled, not signalled).
const MAX_SLEEP: Duration = Duration::from_millis(20);
/// While an application thread polls the completion queues, the runtime thread looks again
/// after at most this long (in case that thread stops polling).
const PARK_SLICE: Duration = Duration::from_millis(2);
/// While parked, how many looks in a row may find the core locked (an application thread
/// works under it) and sleep another slice instead of waiting for the lock, as long as no
/// timer seen at the last look is due.
const PARKED_SKIPS: u32 = 3;
/// An application thread that became the poller this recently counts as polling (it is
/// likely between two waits).
const POLLER_RECENT: Duration = Duration::from_millis(20);
/// An event loop that handled the completions at a wait call this recently counts as
/// handling them (see `Inner::loop_polled_at`): short, since a loop that stops calling (it
/// computes, or blocks elsewhere) leaves its connections' news to the runtime thread again
/// within this and one [`PARK_SLICE`].
const LOOP_RECENT: Duration = Duration::from_millis(2);
/// Longest time a small send's producer-cursor update is held back without TCP_NODELAY
/// (RFC 7609 §4.5.2: coalescing needs a timer that ensures the data is eventually sent).
const COALESCING_DELAY: Duration = Duration::from_micros(500);
/// A failed post is reported at the latest after this time (see `Core::failed_posts`).
const FAILED_POST_GRACE: Duration = Duration::from_millis(100);

/// Longest time a dropped stack waits for its connections' close handshakes.
const CLOSE_LINGER: Duration = Duration::from_millis(200);

/// Longest time a removed link's QP is kept for the messages still queued on it.
const RETIRED_GRACE: Duration = Duration::from_secs(2);

/// Where a connection is in its life, as the stack tracks it.
#[derive(Debug, Clone)]
pub(crate) enum SlotState {
    /// CLC handshake (and link setup) in progress.
    Setup,
    /// Running over SMC-R.
    Smc,
    /// Fell back to TCP; `leftover` are TCP bytes read during the handshake.
    FellBack {
        reason: FallbackReason,
        leftover: Vec<u8>,
    },
    /// Reset during setup.
    Reset(ResetReason),
}

/// Two eventfds per connection, for event loops: one signalled when reading may progress
/// (data, end of stream, failure), one when writing may (room in the peer's RMBE, failure).
#[derive(Debug)]
pub(crate) struct Notifiers {
    pub(crate) read: rustix::fd::OwnedFd,
    pub(crate) write: rustix::fd::OwnedFd,
    /// How many times each was signalled (an edge-triggered epoll emulation tells new
    /// events from ones it already reported by these).
    pub(crate) read_count: std::sync::atomic::AtomicU64,
    pub(crate) write_count: std::sync::atomic::AtomicU64,
    /// Threads that wait for this connection with an eventfd of their own (`fdapi::Waiter`):
    /// signalled too. A shared eventfd drained by one waiting thread would take the wake-up
    /// from another one sleeping on it (poll re-reads a woken descriptor's state).
    pub(crate) subscribers: Mutex<Vec<Subscriber>>,
    /// How many `subscribers` there are (the signal looks at the list only then).
    pub(crate) subscribed: AtomicUsize,
    /// The waits that may sleep on `read` and `write` now: an epoll wait about to sleep
    /// (`fdapi::Conn::arm`), a reactor that watches them for good (tokio's registration, an
    /// epoll instance inside another one). The eventfds are written only while there is one:
    /// an event loop that finds its news by looking (its own completion handling, its spin)
    /// makes no `write` system call per CDC. The signal counts move regardless.
    pub(crate) sleepers: smc_fabric::Sleepers,
}

/// One waiting thread's eventfd, and what it waits for.
#[derive(Debug)]
pub(crate) struct Subscriber {
    pub(crate) fd: Arc<rustix::fd::OwnedFd>,
    pub(crate) read: bool,
    pub(crate) write: bool,
}

impl Notifiers {
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn new() -> std::io::Result<Notifiers> {
        let flags = rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC;
        Ok(Notifiers {
            read: smc_fabric::fdplace::make(|| rustix::event::eventfd(0, flags))?,
            write: smc_fabric::fdplace::make(|| rustix::event::eventfd(0, flags))?,
            read_count: Default::default(),
            write_count: Default::default(),
            subscribers: Mutex::new(Vec::new()),
            subscribed: AtomicUsize::new(0),
            sleepers: smc_fabric::Sleepers::new(),
        })
    }

    /// Signal the subscribers that wait for reading (`read`) or writing (`write`).
    pub(crate) fn signal_subscribers(&self, read: bool, write: bool) {
        let subs = self.subscribers.lock().unwrap_or_else(|p| p.into_inner());
        for s in subs
            .iter()
            .filter(|s| (read && s.read) || (write && s.write))
        {
            Notifiers::signal(&s.fd);
        }
    }

    pub(crate) fn signal(fd: &rustix::fd::OwnedFd) {
        // A full counter (never in practice) or a closed reader needs no further signal.
        let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
    }

    /// Consume the pending signals of `fd`.
    pub(crate) fn drain(fd: &rustix::fd::OwnedFd) {
        let mut b = [0u8; 8];
        let _ = rustix::io::read(fd, &mut b);
    }
}

/// Counters of a stack.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StackStats {
    /// Connections that run over SMC-R.
    pub smc: u64,
    /// Connections that fell back to TCP (by any reason).
    pub fallbacks: u64,
    /// Fallbacks because the peer did not offer SMC-R or discovery is off.
    pub fallback_no_smc_peer: u64,
    /// Fallbacks because a Decline was sent or received.
    pub fallback_declined: u64,
    /// Connections reset during setup.
    pub setup_resets: u64,
    /// Links that went down.
    pub links_down: u64,
    /// Links that came up.
    pub links_up: u64,
    /// SMC-R connections aborted because their TCP connection was reset (§4.8.2).
    pub tcp_resets: u64,
    /// SMC-R connections aborted because bytes arrived on their TCP connection, which stays
    /// silent once SMC-R runs: the peer program wrote past the stack (see `tcpwatch`).
    pub tcp_data_aborts: u64,
    /// Bytes the peer wrote before it reset a connection, kept for the application to read
    /// ahead of the reset (as TCP does).
    pub bytes_kept_at_reset: u64,
    /// SMC-R connections whose link group was lost after the peer's process had ended (its
    /// TCP socket closed in order): an end of stream for the application, not a reset.
    pub ended_by_peer_exit: u64,
}

/// A socket as `smc ss` shows it.
#[derive(Debug, Clone)]
pub(crate) struct StreamEntry {
    pub(crate) local: Option<std::net::SocketAddr>,
    pub(crate) peer: Option<std::net::SocketAddr>,
    /// The endpoint's connection, over SMC-R.
    pub(crate) smc: Option<TcpId>,
    /// Why the stream runs over TCP.
    pub(crate) fallback: Option<FallbackReason>,
    pub(crate) server: bool,
}

/// A packet capture in progress (`Stack::start_capture`).
pub(crate) struct Capture {
    w: smc_wire::capture::CaptureWriter<std::io::BufWriter<std::fs::File>>,
    start: Instant,
}

/// A synthetic IPv4 address for a GID in captures (its last four bytes).
fn gid_ip(gid: &[u8; 16]) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::new(gid[12], gid[13], gid[14], gid[15])
}

/// Everything the mutex guards.
pub(crate) struct Core {
    pub(crate) ep: Endpoint,
    pub(crate) fab: Fabric,
    pub(crate) slots: Slots,
    pub(crate) stats: StackStats,
    /// The endpoint's clock: the monotonic clock, then — once a thread of its own calibrated
    /// it (`crate::clock`) — the TSC where it is invariant.
    pub(crate) clock: crate::clock::EndpointClock,
    /// Work requests whose post failed synchronously (the QP is in error): reported to the
    /// endpoint only after the QP's receive flush was seen, so that every message that
    /// arrived before the failure is processed first (otherwise failover validation would
    /// see a lost CDC), or after [`FAILED_POST_GRACE`].
    failed_posts: Vec<(WrId, LinkId, Instant)>,
    /// Work requests that found their link's send queue full, in posting order: posted as
    /// completions make room (back-pressure, as an RNIC's bounded send queue gives).
    deferred: HashMap<LinkId, std::collections::VecDeque<Deferred>>,
    /// Links whose receive queue was flushed (their arrived messages are all processed).
    flushed: foldhash::HashSet<LinkId>,
    /// Links the endpoint removed, kept (QP and receive buffers) until their receive queue
    /// flushes or [`RETIRED_GRACE`] passes: messages that arrived before the failure are
    /// still read and handed over (a CDC there counts, see `Endpoint::handle_message`).
    retired: HashMap<LinkId, (LinkQp, Instant)>,
    /// Open streams by registration number (for `smc ss`).
    pub(crate) streams: std::collections::BTreeMap<u64, StreamEntry>,
    pub(crate) next_stream: u64,
    /// Fallbacks counted by reason.
    pub(crate) fallback_reasons: std::collections::BTreeMap<String, u64>,
    /// Packet capture of CLC (as TCP) and LLC/CDC (as RoCEv2 SENDs), if on.
    pub(crate) capture: Option<Capture>,
    /// TCP sockets of connections that closed while their stream was gone: closed by the
    /// runtime thread after it lets go of the lock (a close on loopback runs the peer's
    /// FIN processing too, tens of µs that would hold up every other thread).
    closing: Vec<crate::tcpwatch::SlotSock>,
    /// While the connections of a lost link group are settled: until when their TCP sockets
    /// may still get the peer's FIN (see [`send::fin_within`]).
    fin_deadline: Option<Instant>,
    /// Receive slots whose message was copied out, to be posted again at the next poll (see
    /// [`Core::repost_receives`]).
    reposts: Vec<(LinkId, u64)>,
    /// Condition variables of blocked readers and writers that this hold of the lock found
    /// something for: notified by [`CoreGuard`] once the lock is released (see there).
    wakes: Vec<Arc<Condvar>>,
}

impl Core {
    /// The IPv4 addresses of connection `tcp` (local, peer), for captures.
    fn tcp_addrs(&self, tcp: TcpId) -> Option<(std::net::SocketAddrV4, std::net::SocketAddrV4)> {
        let sock = self.slots.get(&tcp)?.sock.as_ref()?.tcp();
        match (sock.local_addr().ok()?, sock.peer_addr().ok()?) {
            (std::net::SocketAddr::V4(l), std::net::SocketAddr::V4(p)) => Some((l, p)),
            _ => None,
        }
    }

    /// Capture the TCP handshake of connection `tcp` (both segments carried the option).
    pub(crate) fn capture_handshake(&mut self, tcp: TcpId, client: bool) {
        if self.capture.is_none() {
            return;
        }
        let Some((l, p)) = self.tcp_addrs(tcp) else {
            return;
        };
        if let Some(c) = self.capture.as_mut() {
            let (cl, sv) = if client { (l, p) } else { (p, l) };
            let _ = c.w.tcp_handshake(c.start.elapsed(), cl, sv, true);
        }
    }

    /// Capture CLC bytes on connection `tcp`.
    pub(crate) fn capture_tcp(&mut self, tcp: TcpId, outgoing: bool, bytes: &[u8]) {
        if self.capture.is_none() {
            return;
        }
        let Some((l, p)) = self.tcp_addrs(tcp) else {
            return;
        };
        if let Some(c) = self.capture.as_mut() {
            let (from, to) = if outgoing { (l, p) } else { (p, l) };
            let _ = c.w.tcp_data(c.start.elapsed(), from, to, bytes);
        }
    }

    /// Capture a 44-byte message sent or received on `link`.
    fn capture_roce(&mut self, link: LinkId, outgoing: bool, msg: &[u8]) {
        if self.capture.is_none() {
            return;
        }
        let Some(l) = self
            .ep
            .link_groups()
            .flat_map(|g| g.links.values())
            .find(|l| l.id == link)
        else {
            return;
        };
        let Some(remote) = l.remote else {
            return;
        };
        let Some(dev) = self.fab.port_device(l.device) else {
            return;
        };
        let Some(port) = self.fab.ports.get(usize::from(l.device.0)) else {
            return;
        };
        let ours = smc_wire::capture::RoceEndpoint {
            mac: smc_wire::Mac(dev.mac().0),
            ip: gid_ip(&port.gid.0),
        };
        let theirs = smc_wire::capture::RoceEndpoint {
            mac: remote.mac,
            ip: gid_ip(&remote.gid.0),
        };
        let local_qpn = l.local_qp.qpn;
        if let Some(c) = self.capture.as_mut() {
            let ts = c.start.elapsed();
            let _ = if outgoing {
                c.w.roce_send(ts, ours, theirs, remote.qpn, msg)
            } else {
                c.w.roce_send(ts, theirs, ours, local_qpn, msg)
            };
        }
    }

    /// Current time on the endpoint's clock in µs (for atomics).
    pub(crate) fn now_micros(&self) -> u64 {
        u64::try_from(self.now().as_duration().as_micros()).unwrap_or(u64::MAX)
    }

    /// Current time on the endpoint's clock.
    pub(crate) fn now(&self) -> Timestamp {
        Timestamp::from_duration(self.clock.now())
    }

    /// Perform every output of the endpoint (TCP writes, fabric operations, events) until
    /// nothing is left.
    #[inline]
    pub(crate) fn drain(&mut self) {
        // The usual case after a read or write of the data path: nothing (the work of the
        // loop below, inlined as it is, costs as much as handling a message).
        if self.ep.has_output() {
            self.drain_all();
        }
    }

    #[inline(never)]
    fn drain_all(&mut self) {
        loop {
            let mut progress = false;
            // Fabric operations before TCP writes: a client's QP is ready to receive (RTR)
            // before its Confirm reaches the server, whose first act on it is to connect its
            // own QP and take in the client's RMB over it (`Endpoint::link_connected`).
            // An RMB freed with its link group waits for this turn's events: the unread
            // bytes of its connections are copied out of it at their `UnreadAtReset`.
            let mut frees = Vec::new();
            while let Some(op) = self.ep.poll_fabric() {
                progress = true;
                match op {
                    FabricOp::FreeRmb { .. } => frees.push(op),
                    op => self.fabric_op(op),
                }
            }
            while let Some((tcp, bytes)) = self.ep.poll_tcp_transmit() {
                progress = true;
                self.capture_tcp(tcp, true, &bytes);
                let failed = match self.slots.get(&tcp).and_then(|s| s.sock.as_ref()) {
                    Some(sock) => sock.tcp().write_all(&bytes).is_err(),
                    None => true,
                };
                if failed {
                    let now = self.now();
                    self.ep.handle_tcp_reset(tcp, now);
                }
            }
            while let Some(ev) = self.ep.poll_event() {
                progress = true;
                self.event(ev);
            }
            for op in frees {
                self.fabric_op(op);
            }
            if !progress {
                return;
            }
        }
    }

    fn fabric_op(&mut self, op: FabricOp) {
        tracing::trace!(?op, "fabric op");
        match op {
            FabricOp::ConnectQp {
                link,
                device,
                remote,
            } => {
                let port = self.fab.ports.get(usize::from(device.0)).copied();
                let ok = match (self.fab.links.get(&link), port) {
                    (Some(l), Some(port)) => {
                        let mtu = smc_fabric::Mtu::from_code(remote.mtu.0)
                            .unwrap_or(smc_fabric::Mtu::Mtu1024);
                        // From the GID the endpoint announced for this port (a roce device
                        // with IPv6 GIDs is one port per GID).
                        l.qp.to_rtr_from(
                            port.gid,
                            RemoteQpInfo {
                                gid: smc_fabric::Gid(remote.gid.0),
                                qp_num: remote.qpn.get(),
                                psn: remote.psn.get(),
                                mtu,
                            },
                        )
                        .and_then(|_| l.qp.to_rts())
                        .is_ok()
                    }
                    _ => false,
                };
                let now = self.now();
                if ok {
                    self.ep.link_connected(link, &mut self.fab, now);
                } else {
                    tracing::debug!(%link, "connecting QP failed");
                    self.ep.handle_link_failure(link, &mut self.fab, now);
                }
            }
            FabricOp::PostSend { link, wr, msg } => {
                self.capture_roce(link, true, &msg);
                self.post_or_defer(link, Deferred::Send { wr, msg });
            }
            FabricOp::RdmaWrite {
                link,
                wr,
                rkey,
                addr,
                data,
            } => {
                let op = Deferred::Write {
                    wr,
                    rkey,
                    addr,
                    data: data.into(),
                    signaled: true,
                };
                self.post_or_defer(link, op);
            }
            FabricOp::DestroyQp { link } => {
                // Not destroyed yet: what arrived before the failure is still to be read.
                if let Some(l) = self.fab.links.remove(&link) {
                    if !self.flushed.contains(&link) {
                        self.retired.insert(link, (l, Instant::now()));
                    }
                }
                self.retired
                    .retain(|_, (_, at)| at.elapsed() < RETIRED_GRACE);
                self.flushed.remove(&link);
                // What never reached the queue fails like the rest of the link's work.
                for op in self.deferred.remove(&link).into_iter().flatten() {
                    self.failed_posts.push((op.wr(), link, Instant::now()));
                }
            }
            FabricOp::FreeRmb { lgr, rmb } => {
                self.fab.rmbs.remove(&(lgr, rmb));
            }
        }
    }

    /// [`send_direct`](Self::send_direct) for urgent data: all of `buf` or nothing, its last
    /// byte urgent (see [`Endpoint::send_urgent_with`]).
    pub(crate) fn send_urgent_direct(
        &mut self,
        id: TcpId,
        buf: &[u8],
        now: Timestamp,
    ) -> Result<usize, smc_proto::endpoint::EndpointError> {
        self.send_direct_inner(id, buf, true, now)
    }

    /// Send `buf` on connection `id` with one copy: each RDMA WRITE is posted straight from
    /// the application's slice (see [`Endpoint::send_with`]).
    pub(crate) fn send_direct(
        &mut self,
        id: TcpId,
        buf: &[u8],
        now: Timestamp,
    ) -> Result<usize, smc_proto::endpoint::EndpointError> {
        self.send_direct_inner(id, buf, false, now)
    }

    /// The endpoint and the one-copy send path over this core's fabric (split borrows).
    fn direct_path(&mut self) -> (&mut Endpoint, DirectSend<'_>) {
        let Core {
            ep,
            fab,
            failed_posts,
            deferred,
            capture,
            ..
        } = self;
        let path = DirectSend {
            fab: &*fab,
            failed_posts,
            deferred,
            capturing: capture.is_some(),
            held: Vec::new(),
        };
        (ep, path)
    }

    fn send_direct_inner(
        &mut self,
        id: TcpId,
        buf: &[u8],
        urgent: bool,
        now: Timestamp,
    ) -> Result<usize, smc_proto::endpoint::EndpointError> {
        let (ep, path) = self.direct_path();
        if urgent {
            ep.send_urgent_with(id, buf, now, path)
        } else {
            ep.send_with(id, buf, now, path)
        }
    }

    /// Where a write of up to `max` bytes on connection `tcp` would go, and the handle that
    /// places it without the core lock, when that is possible: the link's QP places WRITEs
    /// at post (shm), no work waits for room on it, and no capture records the traffic.
    pub(crate) fn plan_unlocked_write(
        &self,
        tcp: TcpId,
        max: u32,
    ) -> Option<(smc_proto::endpoint::WritePlan, smc_fabric::WritePlacer)> {
        if self.capture.is_some() {
            return None;
        }
        let plan = self.ep.write_plan(tcp, max)?;
        if send::waits_for_room(&self.deferred, plan.link) {
            return None;
        }
        let placer = self.fab.links.get(&plan.link)?.qp.placer()?;
        Some((plan, placer))
    }

    /// [`send_direct`](Self::send_direct) of exactly the bytes of `plan` (made by
    /// [`plan_unlocked_write`](Self::plan_unlocked_write)), whose pieces `placed` are already
    /// in the peer's RMBE: those are not copied again.
    pub(crate) fn send_preplaced(
        &mut self,
        id: TcpId,
        buf: &[u8],
        plan: smc_proto::endpoint::WritePlan,
        placed: [bool; 2],
        now: Timestamp,
    ) -> Result<usize, smc_proto::endpoint::EndpointError> {
        let (ep, direct) = self.direct_path();
        let path = send::PrePlaced {
            direct,
            plan,
            placed,
        };
        ep.send_with(id, buf, now, path)
    }

    /// Whether the engine queues a `Readable` event for each CDC of `tcp` that brings data:
    /// only while a thread sleeps on the slot's condition variable or an event loop watches
    /// its eventfds, the only ones the event reaches (see `signal`). A reader that polls
    /// finds the bytes by looking; for it the event was queued, handled and dropped per CDC
    /// (busy 1-byte ping-pong without it: 12 of 12 alternating pairs faster, median per-pair
    /// ratio 0.90). Called whenever `waiters` or `notify` of the slot change, and when the
    /// connection is established; all under the core lock, so a reader that looked and found
    /// nothing cannot miss the event of what arrives before it sleeps.
    pub(crate) fn sync_readable_events(&mut self, tcp: TcpId) {
        let on = self
            .slots
            .get(&tcp)
            .is_some_and(|s| s.waiters > 0 || s.notify().is_some());
        // (Not established yet, or gone: nothing to set; establishment calls this again.)
        let _ = self.ep.set_readable_events(tcp, on);
    }

    /// Wake the threads blocked on connection `tcp`.
    pub(crate) fn wake(&self, tcp: TcpId) {
        if let Some(s) = self.slots.get(&tcp) {
            if s.waiters > 0 {
                s.cond.notify_all();
            }
        }
    }

    /// Wake every blocked thread (after changes not tied to one connection).
    pub(crate) fn wake_all(&self) {
        for s in self.slots.values() {
            if s.waiters > 0 {
                s.cond.notify_all();
            }
        }
    }

    /// Whether the runtime thread must keep polling the completion queues even while an
    /// application thread does: a rendezvous in progress (its LLC exchanges must not wait for
    /// an application thread) or an event loop waiting on eventfds.
    fn needs_runtime_polling(&self) -> bool {
        // Counted by the table, not looked for: the runtime thread asks on every turn.
        self.slots.any_polled()
    }

    /// Wake event loops and threads waiting on connection `tcp`.
    fn signal(&mut self, tcp: TcpId, read: bool, write: bool) {
        // (One lookup: this runs for every CDC that brings data.)
        let Some(s) = self.slots.get_mut(&tcp) else {
            return;
        };
        // Woken once the lock is released (`CoreGuard`), once per connection until a waiter
        // registers or returns (`Slot::wake_queued`).
        if s.waiters > 0 && !s.wake_queued {
            s.wake_queued = true;
            self.wakes.push(s.cond.clone());
        }
        if let Some(n) = s.notify() {
            if read {
                n.read_count
                    .fetch_add(1, std::sync::atomic::Ordering::Release);
            }
            if write {
                n.write_count
                    .fetch_add(1, std::sync::atomic::Ordering::Release);
            }
            // The state change (and the counts) first, then the look for sleepers (a full
            // fence inside): a wait that armed after this look sees the change when it looks
            // at the connection (`smc_fabric::Sleepers`).
            if n.sleepers.any() {
                if read {
                    Notifiers::signal(&n.read);
                }
                if write {
                    Notifiers::signal(&n.write);
                }
            }
            // (Read under the core lock, as the subscriber's look at the connection after
            // it subscribed: a change it did not see is signalled to it here.)
            if n.subscribed.load(Ordering::Acquire) > 0 {
                n.signal_subscribers(read, write);
            }
        }
    }

    fn event(&mut self, ev: EndpointEvent) {
        tracing::trace!(?ev, "endpoint event");
        match &ev {
            EndpointEvent::Conn { tcp, event } => match event {
                smc_proto::Event::Readable
                | smc_proto::Event::UrgentPending
                | smc_proto::Event::UrgentData { .. } => self.signal(*tcp, true, false),
                // The peer's close also makes the connection writable for good (a write no
                // longer waits: it is taken or fails, as on TCP after the peer's FIN), and
                // a TCP socket's wake-up at the FIN reports EPOLLOUT too.
                smc_proto::Event::ReadClosed => self.signal(*tcp, true, true),
                smc_proto::Event::Writable => self.signal(*tcp, false, true),
                smc_proto::Event::StateChanged { .. } => {}
                _ => self.signal(*tcp, true, true),
            },
            EndpointEvent::Reset { tcp, .. } => self.signal(*tcp, true, true),
            _ => {}
        }
        match ev {
            EndpointEvent::Established { tcp, .. } => {
                self.stats.smc += 1;
                // TCP_NODELAY is off until the application sets it: small sends are
                // coalesced while earlier bytes are unconsumed, as TCP's Nagle does.
                let peer_len = self.ep.connection(tcp).map(|c| c.config().peer_rmbe_len);
                if let Some(len) = peer_len {
                    let now = self.now();
                    let _ = self.ep.set_coalescing(
                        tcp,
                        Some(smc_proto::conn::Coalescing {
                            delay: COALESCING_DELAY,
                            min_bytes: (len / 4).max(1),
                            while_unconsumed: true,
                        }),
                        now,
                    );
                }
                let token = self
                    .ep
                    .connection(tcp)
                    .map(|c| c.config().local_alert_token);
                if let Some(s) = self.slots.set_state(&tcp, SlotState::Smc) {
                    s.token = token;
                    s.setup_ended();
                }
                self.sync_readable_events(tcp);
            }
            EndpointEvent::FellBack {
                tcp,
                reason,
                leftover,
            } => {
                // Counted when the stream is built (`SmcStream::fallback`).
                let state = SlotState::FellBack {
                    reason: reason.into(),
                    leftover,
                };
                if let Some(s) = self.slots.set_state(&tcp, state) {
                    s.setup_ended();
                }
            }
            EndpointEvent::Reset { tcp, reason } => {
                self.stats.setup_resets += 1;
                let setup = self
                    .slots
                    .get(&tcp)
                    .is_some_and(|s| matches!(s.state(), SlotState::Setup));
                let slot = if setup {
                    self.slots.set_state(&tcp, SlotState::Reset(reason))
                } else {
                    self.slots.get_mut(&tcp)
                };
                if let Some(s) = slot {
                    if setup {
                        s.setup_ended();
                    } else if let ResetReason::Connection(e) = reason {
                        s.error.get_or_insert(e);
                    }
                    reset_socket(s.sock.take());
                }
            }
            EndpointEvent::UnreadAtReset { tcp, target } => {
                // What the peer wrote before it reset the connection stays readable ahead of
                // the error, as over TCP; taken out of the RMBE now, before the element can
                // be given to another connection.
                let mut b = vec![0u8; target.regions.total() as usize];
                if self.fab.copy_unread(&target, &mut b).is_ok() {
                    if let Some(s) = self.slots.get_mut(&tcp) {
                        self.stats.bytes_kept_at_reset += b.len() as u64;
                        s.left_by_reset = b;
                    }
                }
            }
            EndpointEvent::Conn { tcp, event } => match event {
                smc_proto::Event::Failed(e) => {
                    if let Some(s) = self.slots.get_mut(&tcp) {
                        s.error.get_or_insert(e);
                    }
                }
                smc_proto::Event::SendTcpReset => {
                    if let Some(s) = self.slots.get_mut(&tcp) {
                        if s.peer_read_all
                            && s.error
                                == Some(ConnError::Reset(
                                    smc_proto::conn::AbortReason::LinkGroupLost,
                                ))
                            && s.sock.as_ref().is_some_and(|k| {
                                // The peer's kernel closes its sockets as its process ends;
                                // the FIN may trail the fabric's news of the death by a
                                // little: one short wait per lost group, shared by its
                                // connections.
                                let until = *self
                                    .fin_deadline
                                    .get_or_insert_with(|| Instant::now() + FIN_GRACE);
                                send::fin_within(std::os::fd::AsFd::as_fd(k.tcp()), until)
                            })
                        {
                            s.peer_exited = true;
                            self.stats.ended_by_peer_exit += 1;
                        }
                        reset_socket(s.sock.take());
                    }
                }
                smc_proto::Event::Closed => {
                    let remove = match self.slots.get_mut(&tcp) {
                        Some(s) => {
                            s.closed = true;
                            s.dropped
                        }
                        None => false,
                    };
                    if remove {
                        let sock = self.slots.remove(&tcp).and_then(|mut s| s.sock.take());
                        self.closing.extend(sock);
                    }
                }
                _ => {}
            },
            EndpointEvent::LinkUp { .. } => self.stats.links_up += 1,
            EndpointEvent::LinkDown { .. } => self.stats.links_down += 1,
            EndpointEvent::LinkGroupTerminated { .. } => self.fin_deadline = None,
            EndpointEvent::LinkGroupLost { tcp, peer_read_all } => {
                if let Some(s) = self.slots.get_mut(&tcp) {
                    s.peer_read_all = peer_read_all;
                }
            }
        }
    }

    /// Poll every completion queue once and process what came; returns whether anything did.
    pub(crate) fn poll_completions(&mut self, wcs: &mut [WorkCompletion]) -> bool {
        self.poll_completions_at(wcs, &mut None)
    }

    /// [`poll_completions`](Self::poll_completions) with the clock read at most once, and only
    /// when something came (a read costs about 25 ns here, as much as handling a CDC's
    /// completion): `now` is that reading afterwards (left as it was if it held one already).
    pub(crate) fn poll_completions_at(
        &mut self,
        wcs: &mut [WorkCompletion],
        now: &mut Option<Timestamp>,
    ) -> bool {
        self.repost_receives();
        let mut any = false;
        for dev in 0..self.fab.cqs.len() {
            let n = self.fab.cqs[dev].poll(wcs);
            if n > 0 {
                let now = *now.get_or_insert_with(|| self.now());
                for wc in &wcs[..n] {
                    self.completion(dev, wc, now);
                }
            }
            any |= n > 0;
        }
        if !self.deferred.is_empty() {
            any |= self.post_deferred();
        }
        any
    }

    /// Post the receive slots of the messages handled since the last poll again. A slot goes
    /// back to its queue at the poll after its message, not as the message is handled: the
    /// repost (the SGE's region looked up, the peer's credits published behind a full fence)
    /// then lies in the time a ping-pong waits for the answer, not on the path of the reply.
    /// Every poll starts here, and a thread polls once more after arming the channels before
    /// it sleeps, so at most one poll's messages (32) of a link's 128 slots are out at a time.
    fn repost_receives(&mut self) {
        if self.reposts.is_empty() {
            return;
        }
        let mut reposts = std::mem::take(&mut self.reposts);
        for (link, slot) in reposts.drain(..) {
            // A link removed meanwhile takes its slots with it.
            let Some(l) = self.fab.links.get(&link) else {
                continue;
            };
            if self.fab.post_recv(link, l, slot).is_err() {
                // (The clock only for a failure.)
                let now = self.now();
                self.ep.handle_link_failure(link, &mut self.fab, now);
            }
        }
        // The vector's allocation is kept for the next poll.
        self.reposts = reposts;
    }

    /// Post `op` on `link`, or queue it when the link's send queue is full (or work is
    /// already waiting there, to keep the order); any other error fails it.
    fn post_or_defer(&mut self, link: LinkId, op: Deferred) {
        if waits_for_room(&self.deferred, link) {
            self.deferred.entry(link).or_default().push_back(op);
            return;
        }
        match self.fab.links.get(&link).map(|l| op.post(&l.qp)) {
            Some(Ok(())) => {}
            Some(Err(smc_fabric::FabricError::QueueFull)) => {
                self.deferred.entry(link).or_default().push_back(op);
            }
            _ => self.failed_posts.push((op.wr(), link, Instant::now())),
        }
    }

    /// Post the deferred work requests for which the send queues now have room. Returns
    /// whether any was posted or failed.
    fn post_deferred(&mut self) -> bool {
        let mut progress = false;
        let links: Vec<LinkId> = self.deferred.keys().copied().collect();
        for link in links {
            let Some(mut q) = self.deferred.remove(&link) else {
                continue;
            };
            while let Some(op) = q.pop_front() {
                match self.fab.links.get(&link).map(|l| op.post(&l.qp)) {
                    Some(Ok(())) => progress = true,
                    Some(Err(smc_fabric::FabricError::QueueFull)) => {
                        q.push_front(op);
                        break;
                    }
                    _ => {
                        self.failed_posts.push((op.wr(), link, Instant::now()));
                        progress = true;
                    }
                }
            }
            if !q.is_empty() {
                self.deferred.insert(link, q);
            }
        }
        progress
    }

    /// One work completion from the completion queue of device `dev`.
    fn completion(&mut self, _dev: usize, wc: &WorkCompletion, now: Timestamp) {
        if wc.wr_id & RECV_FLAG == 0 {
            self.ep
                .handle_completion(WrId(wc.wr_id), wc.is_ok(), &mut self.fab, now);
            return;
        }
        let link = LinkId(((wc.wr_id & !RECV_FLAG) >> 8) as u32);
        let slot = wc.wr_id & 0xff;
        if !wc.is_ok() {
            self.flushed.insert(link);
            // A retired link's queue is drained: the QP can go.
            self.retired.remove(&link);
            self.ep.handle_link_failure(link, &mut self.fab, now);
            return;
        }
        // 44-byte messages (every CDC) are copied to the stack; an LLC v2 message longer
        // than a v1 slot, rare, to the heap.
        let mut small = [0u8; RECV_SLOT_LEN];
        let mut large = Vec::new();
        let Some(l) = self.fab.links.get(&link) else {
            // A message that arrived on a link before its removal.
            if let Some((l, _)) = self.retired.get(&link) {
                let buf = l.message_buf(wc.byte_len, &mut small, &mut large);
                if l.rx.read_at(l.slot_offset(slot), buf).is_ok() {
                    self.ep.handle_message(link, buf, &mut self.fab, now);
                }
            }
            return;
        };
        let buf = l.message_buf(wc.byte_len, &mut small, &mut large);
        let read = l.rx.read_at(l.slot_offset(slot), buf);
        if read.is_err() {
            self.ep.handle_link_failure(link, &mut self.fab, now);
            return;
        }
        // Posted again at the next poll (see `repost_receives`).
        self.reposts.push((link, slot));
        self.ep.handle_message(link, buf, &mut self.fab, now);
    }

    /// A device event. Port-down and QP-fatal events are not turned into link failures here:
    /// the QP's flushed receives report the failure in completion order, after the messages
    /// that arrived before it (the event is queued before those completions).
    fn device_event(&mut self, _dev: usize, ev: DeviceEvent) {
        let now = self.now();
        if ev == DeviceEvent::PortActive {
            // A device came back: ask every group for its links again (App. C.8).
            let groups: Vec<LgrId> = self.ep.link_groups().map(|g| g.id).collect();
            for g in groups {
                let _ = self.ep.request_add_link(g, &mut self.fab, now);
            }
        }
    }

    /// Report failed posts whose link's receive flush was seen (or that waited long enough).
    pub(crate) fn report_failed_posts(&mut self) -> bool {
        if self.failed_posts.is_empty() {
            return false;
        }
        let now = self.now();
        let (due, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.failed_posts)
            .into_iter()
            .partition(|(_, link, at)| {
                self.flushed.contains(link) || at.elapsed() >= FAILED_POST_GRACE
            });
        self.failed_posts = keep;
        for (wr, _, _) in &due {
            self.ep.handle_completion(*wr, false, &mut self.fab, now);
        }
        !due.is_empty()
    }
}

/// The core lock, held. The threads blocked on a connection that this hold found something
/// for (`Core::signal`: data, room, a close) are woken when it is released, not under it.
/// Woken under it, a reader or writer either preempted the thread that woke it (on this
/// 2-core VM it often shares the CPU) or ran on the other CPU, and then found the lock still
/// taken and went back to sleep on it until the waker let go: measured with
/// `perf record -e sched:sched_switch` on `smc bench --tests multistream --streams 256`,
/// about a third of the bench server's and the client's switches were such a woken thread
/// blocking on the lock (`lock_contended` under `Condvar::wait_timeout`), the waker's switch
/// out in `notify_all` (preempted by the thread it woke, the lock held) another tenth.
pub(crate) struct CoreGuard<'a> {
    /// `None` only after [`into_std`](Self::into_std).
    guard: Option<MutexGuard<'a, Core>>,
}

impl<'a> CoreGuard<'a> {
    /// The lock held as `guard`.
    pub(crate) fn new(guard: MutexGuard<'a, Core>) -> CoreGuard<'a> {
        CoreGuard { guard: Some(guard) }
    }

    /// The standard guard, for a condition variable's wait (which releases the lock itself):
    /// the wakes found so far are made now, under the lock.
    pub(crate) fn into_std(mut self) -> MutexGuard<'a, Core> {
        let Some(mut g) = self.guard.take() else {
            unreachable!("the guard is taken only here, by value")
        };
        for c in g.wakes.drain(..) {
            c.notify_all();
        }
        g
    }
}

impl std::ops::Deref for CoreGuard<'_> {
    type Target = Core;
    fn deref(&self) -> &Core {
        match &self.guard {
            Some(g) => g,
            None => unreachable!("the guard is taken only by into_std, which consumes it"),
        }
    }
}

impl std::ops::DerefMut for CoreGuard<'_> {
    fn deref_mut(&mut self) -> &mut Core {
        match &mut self.guard {
            Some(g) => g,
            None => unreachable!("the guard is taken only by into_std, which consumes it"),
        }
    }
}

impl Drop for CoreGuard<'_> {
    fn drop(&mut self) {
        let Some(mut g) = self.guard.take() else {
            return;
        };
        if g.wakes.is_empty() {
            return;
        }
        let wakes = std::mem::take(&mut g.wakes);
        drop(g);
        for c in wakes {
            c.notify_all();
        }
    }
}

/// Shared state of a stack.
pub(crate) struct Inner {
    pub(crate) config: StackConfig,
    pub(crate) core: Mutex<Core>,
    /// The completion queues (one per device), polled by whichever thread needs progress.
    pub(crate) cqs: Vec<CompletionQueue>,
    /// An application thread sleeps on the completion channels (the "poller"): it handles
    /// what arrives itself, without a hop through the runtime thread.
    pub(crate) poller: AtomicBool,
    /// Application threads blocked on a connection's condition variable (not polling).
    pub(crate) followers: AtomicUsize,
    /// When an application thread last became the poller (µs on the core's clock): an
    /// application that waits again and again keeps the runtime thread off the channels
    /// also between its waits.
    pub(crate) poller_at: AtomicU64,
    /// When an event loop of the preload library last handled the completions itself at the
    /// start of a wait call (µs on the core's clock, see `fdapi::poll_before_wait`): while it
    /// does so regularly, the runtime thread stays off the completion channels although the
    /// loop's connections have eventfds (it would otherwise take every doorbell, wake, and
    /// signal the loop's eventfds: two wake-ups and a system call per message).
    pub(crate) loop_polled_at: AtomicU64,
    /// The eBPF discovery (shared with the parent's stack in a forked child, see
    /// [`Stack::new_inheriting`]).
    pub(crate) discovery: Option<Arc<TcpOptionDiscovery>>,
    pub(crate) peer_id: PeerId,
    /// The endpoint's devices as (fabric device index, GID), by `DeviceId` (fixed at start;
    /// read without the lock to choose a connection's device set, `pnet::ports_for`).
    pub(crate) ports: Vec<(usize, smc_fabric::Gid)>,
    next_tcp: AtomicU64,
    stop: AtomicBool,
    /// Where the control socket goes, if the stack has one.
    control_path: Option<std::path::PathBuf>,
    /// The control socket, removed when the stack goes.
    control: std::sync::OnceLock<crate::control::ControlSocket>,
    /// Why the stack runs without a fabric (every connection over TCP), if it does.
    fabric_unavailable: Option<String>,
    /// The TCP sockets of SMC-R connections, watched for resets.
    pub(crate) tcp_watch: crate::tcpwatch::TcpWatch,
}

impl Inner {
    /// Lock the core (a poisoned lock is still usable: every operation leaves it consistent
    /// enough to continue, and panics are bugs that tests catch).
    pub(crate) fn lock(&self) -> CoreGuard<'_> {
        CoreGuard::new(self.core.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// [`lock`](Self::lock) if nobody holds the core now.
    pub(crate) fn try_lock(&self) -> Option<CoreGuard<'_>> {
        match self.core.try_lock() {
            Ok(g) => Some(CoreGuard::new(g)),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(CoreGuard::new(p.into_inner())),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// A fresh connection id.
    pub(crate) fn new_tcp_id(&self) -> TcpId {
        TcpId(self.next_tcp.fetch_add(1, Ordering::Relaxed))
    }
}

/// One SMC-R stack (one SMC-R peer with its own peer ID): the fabric devices, the protocol
/// endpoint and the runtime thread. Cloning gives another handle to the same stack; the
/// runtime thread ends when the last handle and the last socket are gone.
#[derive(Clone)]
pub struct Stack {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for Stack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stack")
            .field("peer_id", &self.inner.peer_id)
            .field("discovery", &self.discovery_mode())
            .finish()
    }
}

impl Stack {
    /// A stack configured from the environment (see [`StackConfig::from_env`]).
    pub fn from_env() -> Result<Stack, StackError> {
        Stack::new(StackConfig::from_env()?)
    }

    /// A stack with the given configuration: opens the devices, loads discovery, starts the
    /// runtime thread, and draws a new peer ID.
    pub fn new(config: StackConfig) -> Result<Stack, StackError> {
        Stack::new_inheriting(config, None)
    }

    /// A stack as [`Stack::new`], in a process forked from one whose stack loaded the eBPF
    /// discovery: `inherited` is that stack's instance, which the fork copied with its
    /// descriptors and attached program. When the copy is still usable
    /// ([`TcpOptionDiscovery::usable_after_fork`]) the new stack shares it instead of loading
    /// a program of its own (the parent's program marks the child's sockets as its own).
    pub fn new_inheriting(
        config: StackConfig,
        inherited: Option<Arc<TcpOptionDiscovery>>,
    ) -> Result<Stack, StackError> {
        let names = smc_fabric::list_devices(&config.fabric);
        if names.is_empty() {
            return Err(StackError::Config("no fabric devices configured".into()));
        }
        // A fabric that cannot be opened (its directory planted by another user, out of
        // inodes or descriptors, ...) is no reason to fail the program: the stack runs
        // without devices, every connection falls back to TCP (we decline SMC-R with "no
        // SMC-R device"), and the reason is kept for `fabric_unavailable` and logged.
        let (devices, pds, cqs, fabric_unavailable) = match open_fabric(&config.fabric, &names) {
            Ok((d, p, c)) => (d, p, c, None),
            Err(e) => {
                let why = match e {
                    smc_fabric::FabricError::UntrustedDirectory { .. } => e.to_string(),
                    e => format!("fabric directory {}: {e}", config.fabric.dir.display()),
                };
                tracing::warn!(reason = %why, "SMC-R unavailable: connections use TCP");
                (Vec::new(), Vec::new(), Vec::new(), Some(why))
            }
        };
        let discovery = match config.discovery {
            // Advertising SMC-R in the TCP handshake without a device would only make peers
            // try a rendezvous we must decline.
            _ if fabric_unavailable.is_some() => None,
            DiscoveryMode::Ebpf | DiscoveryMode::Auto
                if inherited.as_ref().is_some_and(|d| d.usable_after_fork()) =>
            {
                inherited
            }
            DiscoveryMode::Ebpf => Some(Arc::new(TcpOptionDiscovery::load(None)?)),
            DiscoveryMode::Auto => match TcpOptionDiscovery::load(None) {
                Ok(d) => Some(Arc::new(d)),
                Err(e) => {
                    tracing::info!(%e, "eBPF discovery unavailable: connections stay TCP");
                    None
                }
            },
            DiscoveryMode::AssertPeer | DiscoveryMode::Off => None,
        };
        let mut seed = random_seed();
        let instance = (seed & 0xffff) as u16;
        seed |= 1;
        // Without a device, a locally administered MAC of random bits (the peer ID is still
        // sent in the Declines of a stack without fabric).
        let mac = devices.first().map_or_else(
            || {
                let b = seed.to_le_bytes();
                [0x02, b[2], b[3], b[4], b[5], b[6]]
            },
            |d| d.mac().0,
        );
        let peer_id = PeerId {
            instance,
            mac: smc_wire::Mac(mac),
        };
        let ports = fabric::ports_of(&devices);
        let port_list = ports.iter().map(|p| (p.dev, p.gid)).collect();
        let proto_devices = ports
            .iter()
            .map(|p| (p, &devices[p.dev]))
            .map(|(p, d)| smc_proto::fabric::Device {
                gid: smc_wire::Gid(p.gid.0),
                mac: smc_wire::Mac(d.mac().0),
                // The path MTU the port offers (a roce device: from its netdev's MTU); the
                // QP uses the smaller of ours and the peer's.
                mtu: QpMtu(d.active_mtu().code()),
                // A roce device's GID is its IPv4-mapped RoCEv2 GID (what the Linux kernel
                // requires, docs/v2.md "Live interoperability"); the shm fabric's GID stands in
                // for one: SMC-Rv2 between smc-rs processes on shm uses it as the link GID.
                roce_v2: true,
            })
            .collect();
        let mut ec = EndpointConfig::new(peer_id, proto_devices);
        ec.ipv4_subnets = config.ipv4_subnets.clone();
        ec.ueids = config.ueids.clone();
        ec.versions = config.versions;
        // The host name of the SMC-Rv2 first-contact extension (informational for the peer).
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "smc-rs".into());
        ec.hostname = smc_wire::clc_v2::FirstContactExt::hostname_field(&host);
        ec.rmbe_size = config.rmbe_size();
        ec.rmb_pool.rmb_target_bytes = config.rmb_bytes;
        ec.clc_timeout = config.clc_timeout;
        ec.accept_wait = (!config.accept_wait.is_zero()).then_some(config.accept_wait);
        ec.llc_timeout = config.llc_timeout;
        ec.add_link_retry = config.add_link_retry;
        ec.keepalive = config.keepalive;
        ec.lgr_idle_timeout = config.lgr_idle_timeout;
        let fab = Fabric {
            devices: devices.clone(),
            ports,
            pds,
            cqs: cqs.clone(),
            links: HashMap::new(),
            rmbs: HashMap::new(),
            rng: seed,
            dir: config.fabric.dir.clone(),
        };
        let core = Core {
            ep: Endpoint::new(ec),
            fab,
            slots: Slots::default(),
            stats: StackStats::default(),
            clock: crate::clock::EndpointClock::new(),
            failed_posts: Vec::new(),
            deferred: HashMap::new(),
            flushed: Default::default(),
            retired: HashMap::new(),
            streams: Default::default(),
            next_stream: 1,
            fallback_reasons: Default::default(),
            capture: None,
            closing: Vec::new(),
            fin_deadline: None,
            reposts: Vec::new(),
            wakes: Vec::new(),
        };
        let control_path = crate::control::control_dir(&config.fabric.dir).join(format!(
            "{}-{:04x}.sock",
            std::process::id(),
            peer_id.instance
        ));
        let inner = Arc::new(Inner {
            config,
            core: Mutex::new(core),
            cqs: cqs.clone(),
            poller: AtomicBool::new(false),
            followers: AtomicUsize::new(0),
            poller_at: AtomicU64::new(0),
            loop_polled_at: AtomicU64::new(0),
            discovery,
            peer_id,
            ports: port_list,
            next_tcp: AtomicU64::new(1),
            stop: AtomicBool::new(false),
            // No control socket in a fabric directory we refused (it may be another user's).
            control_path: fabric_unavailable.is_none().then_some(control_path),
            control: std::sync::OnceLock::new(),
            fabric_unavailable,
            tcp_watch: crate::tcpwatch::TcpWatch::new().map_err(StackError::Thread)?,
        });
        if devices
            .iter()
            .any(|d| matches!(d.kind(), smc_fabric::DeviceKind::Roce { .. }))
        {
            crate::lgr_exit::register(&inner);
        }
        inner
            .tcp_watch
            .spawn(Arc::downgrade(&inner))
            .map_err(StackError::Thread)?;
        if let Some(p) = &inner.control_path {
            match crate::control::start(Arc::downgrade(&inner), p.clone()) {
                Ok(c) => {
                    let _ = inner.control.set(c);
                }
                Err(e) => tracing::warn!(%e, path = %p.display(), "no control socket"),
            }
        }
        // The TSC's rate (`crate::clock`): known already from an earlier stack of the
        // process, else measured by the runtime thread, off the program's path.
        if let Some(Some(scale)) = crate::clock::measured() {
            inner.lock().clock.install(scale);
        }
        let weak = Arc::downgrade(&inner);
        smc_fabric::threads::spawn_running(
            std::thread::Builder::new().name("smc-runtime".into()),
            move || runtime(weak, devices, cqs),
        )
        .map_err(StackError::Thread)?;
        Ok(Stack { inner })
    }

    /// The process-wide stack used by [`SmcStream::connect`](crate::SmcStream::connect) and
    /// [`SmcListener::bind`](crate::SmcListener::bind), created from the environment at first
    /// use.
    pub fn global() -> std::io::Result<Stack> {
        static GLOBAL: std::sync::OnceLock<Stack> = std::sync::OnceLock::new();
        if let Some(s) = GLOBAL.get() {
            return Ok(s.clone());
        }
        let s = Stack::from_env()?;
        Ok(GLOBAL.get_or_init(|| s).clone())
    }

    /// Why this stack has no SMC-R fabric, if it has none: its fabric directory could not
    /// be used (planted by another user, out of inodes, ...), and every connection runs over
    /// TCP. Programs should tell their user (the library only logs it).
    pub fn fabric_unavailable(&self) -> Option<&str> {
        self.inner.fabric_unavailable.as_deref()
    }

    /// Our peer ID (random instance number + a MAC, RFC 7609 §2.2.4).
    pub fn peer_id(&self) -> PeerId {
        self.inner.peer_id
    }

    /// The configuration.
    pub fn config(&self) -> &StackConfig {
        &self.inner.config
    }

    /// The discovery mode in effect: `Ebpf` when the program is loaded, else the configured
    /// mode (`Auto` without the program behaves as `Off`).
    pub fn discovery_mode(&self) -> DiscoveryMode {
        match (&self.inner.discovery, self.inner.config.discovery) {
            (Some(_), _) => DiscoveryMode::Ebpf,
            (None, DiscoveryMode::Auto) => DiscoveryMode::Off,
            (None, m) => m,
        }
    }

    /// Start writing a pcap capture of this stack's SMC-R traffic to `path`: CLC messages as
    /// TCP segments (with the handshake that carried the SMC option) and LLC/CDC messages as
    /// RoCEv2 SEND frames, both as Wireshark decodes them. RDMA WRITE payloads are not
    /// captured. Replaces a capture in progress.
    pub fn start_capture(&self, path: &std::path::Path) -> std::io::Result<()> {
        let f = std::io::BufWriter::new(std::fs::File::create(path)?);
        let w = smc_wire::capture::CaptureWriter::new(f).map_err(std::io::Error::other)?;
        self.inner.lock().capture = Some(Capture {
            w,
            start: Instant::now(),
        });
        Ok(())
    }

    /// Stop the capture and flush it; returns the number of frames written.
    pub fn stop_capture(&self) -> std::io::Result<usize> {
        let Some(c) = self.inner.lock().capture.take() else {
            return Ok(0);
        };
        let n = c.w.frames();
        let mut f = c.w.into_inner();
        std::io::Write::flush(&mut f)?;
        Ok(n)
    }

    /// How the connection `tcp` runs (internal helper for streams).
    pub(crate) fn slot_mode(&self, tcp: TcpId) -> Option<Mode> {
        let core = self.inner.lock();
        core.slots.get(&tcp).and_then(|s| match s.state() {
            SlotState::Smc => Some(Mode::Smc),
            SlotState::FellBack { reason, .. } => Some(Mode::Tcp(*reason)),
            _ => None,
        })
    }
}

/// A per-process random seed without a dependency: std's hasher keys are random per process.
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    h.finish()
}
