//! Blocking sockets: [`SmcListener`] and [`SmcStream`], shaped like `std::net`'s.
//!
//! A connection starts as TCP. When discovery says both sides offered SMC-R (or the
//! application asserted it, [`DiscoveryMode::AssertPeer`]), the CLC handshake runs over the
//! TCP socket, driven through the stack's endpoint; afterwards data moves over the fabric and
//! the TCP socket only stays open. Otherwise, or when either side declines, the stream is the
//! plain TCP stream, and [`SmcStream::mode`] says why.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::net::{AddressFamily, SocketType};
use smc_proto::endpoint::TcpId;
use smc_proto::rmbe::Regions;
use smc_wire::Cursor;

use crate::config::DiscoveryMode;
use crate::crossing::Stripper;
use crate::discovery::Outcome;
use crate::error::{conn_error, reset_error, FallbackReason, Mode};
use crate::stack::{Core, Slot, SlotState, Stack, StreamEntry};

mod reactor;
use reactor::{First, Parked, Reactor, FIRST_BYTES_WAIT, WORKER_WAIT};

/// The CLC eye catcher ("SMCR" in EBCDIC) that starts every CLC message.
const CLC_EYECATCHER: [u8; 4] = [0xE2, 0xD4, 0xC3, 0xD9];
/// How long a rendezvous waits for CLC bytes before it looks at its connection's state again
/// (a timer of the runtime thread may have ended the setup).
const RENDEZVOUS_SLICE: Duration = Duration::from_millis(10);

/// How long a blocked call waits on the condition variable before looking again.
const POLL_SLICE: Duration = Duration::from_millis(50);
/// A spinning poller looks at the completion queues' lock-free readiness hint this many times
/// (a few µs) before it takes the core lock again to read the clock and its connection.
const SPINS_BETWEEN_LOOKS: u32 = 64;

/// Signed distance in bytes from cursor `a` to cursor `b` in a ring of `len` bytes.
pub(crate) fn cursor_distance(a: Cursor, b: Cursor, len: u32) -> i64 {
    let wraps = i64::from(b.wrap.wrapping_sub(a.wrap) as i16);
    wraps * i64::from(len) + i64::from(b.count) - i64::from(a.count)
}

/// A sleep up to this many times the longest spin counts as short (see [`AdaptiveSpin`]).
const SPIN_GROW_WINDOW: u32 = 4;

/// The adaptive spin budget starts here after a short sleep.
const SPIN_GROW_START: Duration = Duration::from_micros(5);

/// Adaptive spinning of a blocked read that follows a write of the stream (it likely waits
/// for a reply) before it sleeps, for streams without busy polling, in the manner of a
/// hypervisor's halt polling. A sleep costs two system calls here
/// and a wake-up (and a doorbell system call) at the peer; when the peer answers within a few
/// tens of microseconds, polling the completion queues for that long instead saves all three.
/// A short sleep without a spin (within [`SPIN_GROW_WINDOW`] × `max`) starts a spin of
/// [`SPIN_GROW_START`]; a spin that found nothing doubles (up to `max`) when the sleep after
/// it was shorter than the spin, and halves otherwise, down to nothing; a spin that caught
/// the answer stays. A connection whose peer is slow or idle soon sleeps at once again and
/// costs no CPU, and so does one whose peer cannot answer while this thread spins (a loaded
/// machine: the spin takes the CPU the peer needs).
#[derive(Debug)]
struct AdaptiveSpin {
    /// Longest spin (the configured [`adaptive_spin`](crate::StackConfig::adaptive_spin)).
    max: Option<Duration>,
    /// Current budget in nanoseconds.
    budget_ns: std::sync::atomic::AtomicU64,
    /// The stream wrote since its last read returned data: a read now likely waits for a
    /// reply, which spinning catches.
    after_write: std::sync::atomic::AtomicBool,
}

impl AdaptiveSpin {
    fn new(max: Option<Duration>) -> AdaptiveSpin {
        AdaptiveSpin {
            max: max.filter(|m| !m.is_zero()),
            budget_ns: std::sync::atomic::AtomicU64::new(0),
            after_write: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// How long to spin now; `None`: sleep at once.
    fn budget(&self) -> Option<Duration> {
        self.max?;
        match self.budget_ns.load(Ordering::Relaxed) {
            0 => None,
            ns => Some(Duration::from_nanos(ns)),
        }
    }

    /// A blocked call slept for `d` after its spin of `spun` (zero: none) found nothing.
    fn slept(&self, spun: Duration, d: Duration) {
        let Some(max) = self.max else {
            return;
        };
        let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let cur = self.budget_ns.load(Ordering::Relaxed);
        let next = if spun.is_zero() {
            // No spin: start one when the sleep was short. A sleep includes this thread's
            // own wake-up, which a loaded machine stretches well beyond the spin.
            if d <= max.saturating_mul(SPIN_GROW_WINDOW) {
                ns(SPIN_GROW_START).min(ns(max))
            } else {
                cur
            }
        } else if d <= spun {
            // The answer came within one more spin: spin longer.
            cur.saturating_mul(2).min(ns(max))
        } else {
            // The spin did not help (the peer is slow, or needed this CPU to answer).
            // Below a microsecond a spin catches nothing: stop.
            let half = cur / 2;
            if half < 1_000 {
                0
            } else {
                half
            }
        };
        self.budget_ns.store(next, Ordering::Relaxed);
    }
}

/// A listening socket that accepts SMC-R connections (and plain TCP ones, by fallback).
///
/// Setup workers accept TCP connections as they come and run each one's discovery and
/// rendezvous, a worker per connection in setup, so a slow or silent client delays nobody
/// else; [`accept`](Self::accept) hands out the connections that are ready. A server
/// handshake that waits for the client's Confirm while an application thread waits in
/// `accept` is finished by that thread itself (it wakes on the Confirm, no hand-over after).
#[derive(Debug)]
pub struct SmcListener {
    stack: Stack,
    tcp: Arc<TcpListener>,
    port: u16,
    shared: Arc<AcceptShared>,
}

impl SmcListener {
    /// Bind on the process-wide stack ([`Stack::global`]).
    pub fn bind(addr: impl ToSocketAddrs) -> io::Result<SmcListener> {
        SmcListener::bind_with(&Stack::global()?, addr)
    }

    /// Bind on `stack`.
    pub fn bind_with(stack: &Stack, addr: impl ToSocketAddrs) -> io::Result<SmcListener> {
        let mut last = io::Error::new(io::ErrorKind::InvalidInput, "no address to bind");
        for a in addr.to_socket_addrs()? {
            match listen(stack, a) {
                Ok(l) => return Ok(l),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Accept a connection: the next one whose TCP handshake and SMC-R rendezvous (or
    /// fallback) completed.
    pub fn accept(&self) -> io::Result<(SmcStream, SocketAddr)> {
        let shared = &self.shared;
        let mut q = shared.queue();
        loop {
            // A handshake handed to a waiting thread first: it was promised one.
            if let Some(r) = q.handed.pop_front() {
                q.promised = q.promised.saturating_sub(1);
                drop(q);
                let peer = r.peer;
                match r.run_handed(&|| !shared.queue().ready.is_empty()) {
                    Ok(Ok(s)) => return Ok((s, peer)),
                    // The client's rendezvous failed (its connection is reset): not the
                    // listener's error.
                    Ok(Err(e)) => tracing::debug!(%e, %peer, "rendezvous failed"),
                    Err(r) => shared.finish_elsewhere(r),
                }
                q = shared.queue();
                continue;
            }
            if let Some(r) = q.ready.pop_front() {
                return r;
            }
            if q.workers == 0 {
                return Err(io::Error::other("the accepting thread ended"));
            }
            q.waiting += 1;
            q = shared.cond.wait(q).unwrap_or_else(|p| p.into_inner());
            q.waiting -= 1;
        }
    }

    /// An iterator over accepted connections.
    pub fn incoming(&self) -> impl Iterator<Item = io::Result<SmcStream>> + '_ {
        std::iter::from_fn(move || Some(self.accept().map(|(s, _)| s)))
    }

    /// The local address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.local_addr()
    }

    /// The stack this listener belongs to.
    pub fn stack(&self) -> &Stack {
        &self.stack
    }

    /// SO_RCVBUF for connections accepted from now on: over SMC-R the size of each
    /// connection's RMBE, rounded up to 16 KiB · 2ⁿ (at most 1 MiB); 0 restores the stack's
    /// [`buffer_size`](crate::StackConfig::buffer_size). Fallen-back connections get it as
    /// their TCP receive buffer.
    pub fn set_recv_buffer_size(&self, bytes: usize) {
        let b = u32::try_from(bytes).unwrap_or(u32::MAX);
        self.shared.recv_buffer.store(b, Ordering::Relaxed);
    }
}

impl Drop for SmcListener {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        // Ends the reactor's thread, and with it the handshakes parked there.
        self.shared.reactor.wake();
        // Wakes the setup workers (accept() fails on a shut-down listening socket).
        let _ = rustix::net::shutdown(&*self.tcp, rustix::net::Shutdown::Both);
        if let Some(d) = &self.stack.inner.discovery {
            d.unmark_listener(self.port);
        }
    }
}

fn family(a: &SocketAddr) -> AddressFamily {
    if a.is_ipv4() {
        AddressFamily::INET
    } else {
        AddressFamily::INET6
    }
}

fn listen(stack: &Stack, addr: SocketAddr) -> io::Result<SmcListener> {
    let fd: OwnedFd = rustix::net::socket(family(&addr), SocketType::STREAM, None)?;
    rustix::net::sockopt::set_socket_reuseaddr(&fd, true)?;
    rustix::net::bind(&fd, &addr)?;
    let local = SocketAddr::try_from(rustix::net::getsockname(&fd)?)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "not an inet socket"))?;
    if let Some(d) = &stack.inner.discovery {
        d.mark_listener(local.port()).map_err(io::Error::other)?;
    }
    rustix::net::listen(&fd, 1024)?;
    let tcp = Arc::new(TcpListener::from(fd));
    let shared = Arc::new(AcceptShared {
        stack: stack.clone(),
        tcp: tcp.clone(),
        stop: std::sync::atomic::AtomicBool::new(false),
        recv_buffer: std::sync::atomic::AtomicU32::new(0),
        accepting: std::sync::atomic::AtomicUsize::new(0),
        queue: std::sync::Mutex::new(AcceptQueue::default()),
        cond: std::sync::Condvar::new(),
        reserve: std::sync::Mutex::new(reserve_fd()),
        reactor: Reactor::new()?,
    });
    spawn_setup_worker(&shared)?;
    Ok(SmcListener {
        stack: stack.clone(),
        tcp,
        port: local.port(),
        shared,
    })
}

/// Setup workers at most this many may wait in `accept()` at once; one finishing a setup
/// while this many wait ends.
const IDLE_SETUP_WORKERS: usize = 2;

/// What the setup workers of one listener and its `accept` share.
#[derive(Debug)]
struct AcceptShared {
    stack: Stack,
    tcp: Arc<TcpListener>,
    stop: std::sync::atomic::AtomicBool,
    /// Receive buffer (RMBE) size for connections accepted from now on; 0: the stack's.
    recv_buffer: std::sync::atomic::AtomicU32,
    /// Workers waiting in `accept()`.
    accepting: std::sync::atomic::AtomicUsize,
    queue: std::sync::Mutex<AcceptQueue>,
    /// Signalled when the queue gains something (or the last worker ends).
    cond: std::sync::Condvar,
    /// A descriptor held in reserve: when `accept()` fails for want of descriptors, it is
    /// given up for the pending connection, whose setup then declines SMC-R for want of
    /// resources and falls back to TCP, instead of the client waiting in the backlog until
    /// its CLC timer gives up.
    reserve: std::sync::Mutex<Option<OwnedFd>>,
    /// Where connections whose client is slow wait without a thread of their own.
    reactor: Reactor,
}

/// Setup workers at most: each waits at most [`WORKER_WAIT`] for a client before it parks
/// the connection in the reactor, so a few keep up with any number of handshakes, and a
/// flood of slow ones makes no thread per connection.
const MAX_SETUP_WORKERS: usize = 8;

/// A descriptor to keep in reserve (`/dev/null`), if one can be had.
fn reserve_fd() -> Option<OwnedFd> {
    rustix::fs::open(
        "/dev/null",
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .ok()
}

/// Whether `e` says the process or the system ran out of descriptors.
fn out_of_descriptors(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(c) if c == rustix::io::Errno::MFILE.raw_os_error()
            || c == rustix::io::Errno::NFILE.raw_os_error()
    )
}

/// What the setup workers hand to `SmcListener::accept`.
#[derive(Debug, Default)]
struct AcceptQueue {
    /// Connections set up (or failed to be accepted), in order.
    ready: std::collections::VecDeque<io::Result<(SmcStream, SocketAddr)>>,
    /// Server handshakes waiting for the client, each promised to a thread waiting in
    /// `accept` (which finishes it).
    handed: std::collections::VecDeque<Box<Rendezvous>>,
    /// Application threads waiting in `accept`.
    waiting: usize,
    /// Waiting threads already promised a handed handshake.
    promised: usize,
    /// Setup worker threads alive.
    workers: usize,
}

impl AcceptShared {
    fn queue(&self) -> std::sync::MutexGuard<'_, AcceptQueue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn deliver(&self, r: io::Result<(SmcStream, SocketAddr)>) {
        self.queue().ready.push_back(r);
        self.cond.notify_one();
    }

    /// Hand the server handshake `r` (waiting for the client) to a thread waiting in
    /// `accept`, if one waits that was not promised one yet; `Err`: none, `r` back.
    fn hand_off(&self, r: Box<Rendezvous>) -> Result<(), Box<Rendezvous>> {
        let mut q = self.queue();
        if q.waiting <= q.promised {
            return Err(r);
        }
        q.promised += 1;
        q.handed.push_back(r);
        drop(q);
        self.cond.notify_one();
        Ok(())
    }
}

impl AcceptShared {
    /// A thread of its own finishes the handed handshake `r` (the client is slow, or other
    /// connections wait) and delivers the connection.
    fn finish_elsewhere(self: &Arc<AcceptShared>, r: Box<Rendezvous>) {
        let r = match self.reactor.park(self, Parked::Handshake(r)) {
            Ok(()) => return,
            Err(Parked::Handshake(r)) => r,
            Err(Parked::FirstBytes { .. }) => return,
        };
        let shared = self.clone();
        let spawned = std::thread::Builder::new()
            .name("smc-accept".into())
            .spawn(move || {
                let peer = r.peer;
                match r.run(&mut |r| Err(r)) {
                    Some(Ok(s)) => shared.deliver(Ok((s, peer))),
                    Some(Err(e)) => tracing::debug!(%e, %peer, "rendezvous failed"),
                    None => {}
                }
            });
        if let Err(e) = spawned {
            // The handshake went with the closure (and ended as a broken connection).
            tracing::debug!(%e, "no thread to finish a rendezvous");
        }
    }
}

/// Counts a setup worker alive; the last one to end wakes `accept` (which then fails).
struct WorkerAlive(Arc<AcceptShared>);

impl Drop for WorkerAlive {
    fn drop(&mut self) {
        let mut q = self.0.queue();
        q.workers -= 1;
        if q.workers == 0 {
            drop(q);
            self.0.cond.notify_all();
        }
    }
}

fn spawn_setup_worker(shared: &Arc<AcceptShared>) -> io::Result<()> {
    shared.queue().workers += 1;
    let alive = WorkerAlive(shared.clone());
    std::thread::Builder::new()
        .name("smc-accept".into())
        .spawn(move || accept_loop(alive))
        .map(drop)
    // On a failed spawn the closure, and with it `alive`, is dropped: the count is right.
}

/// A setup worker: accept a TCP connection and set it up in this thread (no hand-over to a
/// new thread per connection). A worker that takes a connection while no other one waits in
/// `accept()` starts another first, so that a slow rendezvous never holds up the next
/// connection; after its setup it waits for the next one unless enough others already do.
fn accept_loop(alive: WorkerAlive) {
    let shared = &alive.0;
    loop {
        shared.accepting.fetch_add(1, Ordering::AcqRel);
        let mut r = shared.tcp.accept();
        if r.as_ref().is_err_and(out_of_descriptors) {
            let reserve = shared
                .reserve
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take();
            if let Some(fd) = reserve {
                drop(fd);
                r = shared.tcp.accept();
            }
        }
        let others = shared.accepting.fetch_sub(1, Ordering::AcqRel) - 1;
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        match r {
            Ok((sock, peer)) => {
                if others == 0 && shared.queue().workers < MAX_SETUP_WORKERS {
                    if let Err(e) = spawn_setup_worker(shared) {
                        // This connection is still set up, here; the next waits for it.
                        tracing::debug!(%e, "no new setup worker");
                    }
                }
                let buffer = match shared.recv_buffer.load(Ordering::Relaxed) {
                    0 => None,
                    b => Some(b),
                };
                if let Some(r) = setup_accepted(shared, sock, peer, buffer) {
                    shared.deliver(r.map(|s| (s, peer)));
                }
                {
                    let mut reserve = shared.reserve.lock().unwrap_or_else(|p| p.into_inner());
                    if reserve.is_none() {
                        *reserve = reserve_fd();
                    }
                }
                if shared.accepting.load(Ordering::Acquire) >= IDLE_SETUP_WORKERS {
                    return;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                // Resource errors (EMFILE, ...) are the application's to see; pace retries.
                if out_of_descriptors(&e) {
                    let mut reserve = shared.reserve.lock().unwrap_or_else(|p| p.into_inner());
                    if reserve.is_none() {
                        *reserve = reserve_fd();
                    }
                }
                shared.deliver(Err(e));
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// Discovery, then the rendezvous or the fallback, for one accepted connection; `None` when
/// the client's rendezvous failed (not the listener's error: the connection is reset) or
/// `hand_off` took the handshake over.
fn setup_accepted(
    shared: &Arc<AcceptShared>,
    sock: TcpStream,
    peer: SocketAddr,
    recv_buffer: Option<u32>,
) -> Option<io::Result<SmcStream>> {
    let stack = &shared.stack;
    let accepted_at = Instant::now();
    if let Some(b) = recv_buffer {
        // The TCP receive buffer too, for a fallback (best effort: the kernel clamps it).
        let _ = rustix::net::sockopt::set_socket_recv_buffer_size(&sock, b as usize);
    }
    let offered = match stack.discovery_mode() {
        DiscoveryMode::Ebpf => match &stack.inner.discovery {
            Some(d) => match sock.local_addr() {
                Ok(local) => matches!(d.server_outcome(local, peer), Ok(Outcome::BothOffered))
                    .then_some(())
                    .ok_or(FallbackReason::PeerWithoutOption),
                Err(e) => return Some(Err(e)),
            },
            None => Err(FallbackReason::DiscoveryOff),
        },
        DiscoveryMode::AssertPeer => {
            let wait = stack.config().assert_peer_wait;
            let mut first = starts_with_clc(&sock, wait.min(FIRST_BYTES_WAIT));
            if matches!(first, Ok(First::Nothing)) && wait > FIRST_BYTES_WAIT {
                // A client that says nothing yet waits in the reactor, not in this thread.
                let parked = Parked::FirstBytes {
                    sock,
                    peer,
                    deadline: accepted_at + wait,
                    recv_buffer,
                };
                match shared.reactor.park(shared, parked) {
                    Ok(()) => return None,
                    Err(Parked::FirstBytes { sock: s, .. }) => {
                        first = starts_with_clc(&s, wait.saturating_sub(accepted_at.elapsed()));
                        return finish_discovery(shared, s, peer, recv_buffer, first);
                    }
                    Err(Parked::Handshake(_)) => return None,
                }
            }
            return finish_discovery(shared, sock, peer, recv_buffer, first);
        }
        DiscoveryMode::Auto | DiscoveryMode::Off => Err(FallbackReason::DiscoveryOff),
    };
    set_up(shared, sock, peer, recv_buffer, offered)
}

/// Assert-peer: the rendezvous or the fallback after the client's first bytes said which.
fn finish_discovery(
    shared: &Arc<AcceptShared>,
    sock: TcpStream,
    peer: SocketAddr,
    recv_buffer: Option<u32>,
    first: io::Result<First>,
) -> Option<io::Result<SmcStream>> {
    let offered = {
        {
            match first {
                Ok(First::Clc) => Ok(()),
                Ok(First::Other | First::Nothing) => match sock.set_read_timeout(None) {
                    Ok(()) => Err(FallbackReason::NoProposal),
                    Err(e) => return Some(Err(e)),
                },
                Err(e) => {
                    tracing::debug!(%e, %peer, "accepted connection failed before the rendezvous");
                    return None;
                }
            }
        }
    };
    set_up(shared, sock, peer, recv_buffer, offered)
}

/// The rendezvous (if SMC-R was offered) or the fallback of an accepted connection. The
/// rendezvous runs here while the client answers within [`WORKER_WAIT`]; a slower one is
/// parked in the listener's reactor.
fn set_up(
    shared: &Arc<AcceptShared>,
    sock: TcpStream,
    peer: SocketAddr,
    recv_buffer: Option<u32>,
    offered: Result<(), FallbackReason>,
) -> Option<io::Result<SmcStream>> {
    let stack = &shared.stack;
    tracing::debug!(%peer, ?offered, "accepted");
    match offered {
        Ok(()) => {
            let hand_off = &mut |r| shared.hand_off(r);
            let run = Rendezvous::start(stack, Arc::new(sock), false, recv_buffer, peer)
                .map(|r| r.run_for(hand_off, Some(WORKER_WAIT)));
            let run = match run {
                Ok(Err(slow)) => match shared.reactor.park(shared, Parked::Handshake(slow)) {
                    Ok(()) => return None,
                    Err(Parked::Handshake(r)) => Ok(r.run(hand_off)),
                    Err(Parked::FirstBytes { .. }) => return None,
                },
                Ok(Ok(done)) => Ok(done),
                Err(e) => Err(e),
            };
            match run {
                Ok(Some(Ok(s))) => Some(Ok(s)),
                Ok(None) => None,
                Ok(Some(Err(e))) | Err(e) => {
                    tracing::debug!(%e, %peer, "rendezvous failed");
                    None
                }
            }
        }
        Err(reason) => Some(Ok(SmcStream::fallback(
            stack,
            Arc::new(sock),
            reason,
            Vec::new(),
            true,
        ))),
    }
}

/// Assert-peer listener: whether the first bytes from the client are a CLC message, waiting
/// at most `wait` for them (`Nothing`: none, or part of an eye catcher, came in that time).
/// Leaves a read timeout on `sock` (the rendezvous sets its own; a fallback must clear it).
fn starts_with_clc(sock: &TcpStream, wait: Duration) -> io::Result<First> {
    let deadline = Instant::now() + wait;
    let mut buf = [0u8; 4];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(First::Nothing);
        }
        sock.set_read_timeout(Some(left))?;
        match sock.peek(&mut buf) {
            Ok(0) => return Ok(First::Other),
            Ok(n) if buf[..n] != CLC_EYECATCHER[..n] => return Ok(First::Other),
            Ok(4) => return Ok(First::Clc),
            // A partial eye catcher: wait for the rest.
            Ok(_) => std::thread::sleep(Duration::from_millis(1)),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Ok(First::Nothing)
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// An eventfd for a slot's `setup_waker`.
fn setup_waker() -> io::Result<Arc<OwnedFd>> {
    let flags = rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC;
    Ok(Arc::new(rustix::event::eventfd(0, flags)?))
}

/// Sleep until `sock` has bytes (or an error) or `waker` (if any) is signalled, at most
/// `slice` (under a second); `true`: the socket is readable.
fn wait_socket_or_waker(
    sock: &TcpStream,
    waker: Option<&OwnedFd>,
    slice: Duration,
) -> io::Result<bool> {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let mut fds = [PollFd::new(sock, PollFlags::IN)];
    let mut both;
    let fds: &mut [PollFd<'_>] = match waker {
        Some(w) => {
            both = [
                PollFd::new(sock, PollFlags::IN),
                PollFd::new(w, PollFlags::IN),
            ];
            &mut both
        }
        None => &mut fds,
    };
    let slice = Timespec {
        tv_sec: 0,
        tv_nsec: i64::from(slice.subsec_nanos()),
    };
    match rustix::event::poll(fds, Some(&slice)) {
        Ok(_) | Err(rustix::io::Errno::INTR) => {}
        Err(e) => return Err(e.into()),
    }
    let readable = !fds[0].revents().is_empty();
    if let (Some(w), Some(f)) = (waker, fds.get(1)) {
        if !f.revents().is_empty() {
            crate::stack::Notifiers::drain(w);
        }
    }
    Ok(readable)
}

/// How long a thread waiting in `accept` keeps a handshake handed to it (see
/// [`AcceptShared::hand_off`]) before a thread of its own finishes it: a client's Confirm
/// takes a round trip.
const HANDED_WAIT: Duration = Duration::from_millis(10);

/// How often that thread looks whether other connections became ready meanwhile (they are
/// not held up longer).
const HANDED_SLICE: Duration = Duration::from_millis(1);

/// A CLC handshake in progress on one TCP connection (client or server). A server's may
/// move to another thread while it waits for the client (see [`AcceptShared::hand_off`]).
#[derive(Debug)]
struct Rendezvous {
    stack: Stack,
    sock: Arc<TcpStream>,
    id: TcpId,
    client: bool,
    local: Option<SocketAddr>,
    peer: SocketAddr,
    /// Signalled when an LLC exchange handled by another thread ends the setup (made only
    /// when the handshake waits for one).
    waker: Option<Arc<OwnedFd>>,
    buf: Vec<u8>,
    /// The handshake ended (its slot now belongs to the stream, or is gone).
    done: bool,
}

/// What the connection's slot says about a handshake.
enum Progress {
    /// Still in setup; `answered`: a server that answered the client's Proposal (it waits for
    /// the client's Confirm, or for the CONFIRM RKEY of a new RMB before its Accept).
    Setup { answered: bool },
    /// Over: established, fallen back or failed.
    Ended(io::Result<SmcStream>),
}

impl Rendezvous {
    /// Start the handshake (a client sends its Proposal).
    fn start(
        stack: &Stack,
        sock: Arc<TcpStream>,
        client: bool,
        recv_buffer: Option<u32>,
        peer: SocketAddr,
    ) -> io::Result<Box<Rendezvous>> {
        let inner = &stack.inner;
        let local = sock.local_addr().ok();
        let opts = smc_proto::endpoint::ConnectOptions {
            pnet: match local {
                Some(a) => stack.pnet_devices(a.ip()),
                None => smc_proto::fabric::DeviceSet::ALL,
            },
            rmbe_size: recv_buffer.map(crate::config::rmbe_size_for),
        };
        let id = inner.new_tcp_id();
        // CLC bytes are read here with a short timeout (the stack writes its CLC messages on
        // the same socket, through the slot's reference to it).
        sock.set_read_timeout(Some(RENDEZVOUS_SLICE))?;
        {
            let mut core = inner.lock();
            core.slots.insert(id, Slot::new(sock.clone()));
            let now = core.now();
            let started = if client {
                core.ep.connect_with(id, opts, now)
            } else {
                core.ep.accept_with(id, opts, now)
            };
            if let Err(e) = started {
                core.slots.remove(&id);
                return Err(io::Error::other(e));
            }
            core.capture_handshake(id, client);
            core.drain();
        }
        Ok(Box::new(Rendezvous {
            stack: stack.clone(),
            sock,
            id,
            client,
            local,
            peer,
            waker: None,
            buf: vec![0u8; 4096],
            done: false,
        }))
    }

    /// Drive the handshake until the connection is established over SMC-R, falls back, or
    /// fails. A server's handshake that waits for the client after answering its Proposal is
    /// offered to `hand_off` first; `None`: taken over (finished elsewhere).
    fn run(
        self: Box<Self>,
        hand_off: &mut dyn FnMut(Box<Rendezvous>) -> Result<(), Box<Rendezvous>>,
    ) -> Option<io::Result<SmcStream>> {
        match self.run_for(hand_off, None) {
            Ok(r) => r,
            // Without a limit the loop ends only with the handshake.
            Err(_) => Some(Err(io::Error::other("rendezvous stopped"))),
        }
    }

    /// [`run`](Self::run) for at most `limit` (if given); `Err`: the handshake still waits
    /// for its peer after that, given back.
    fn run_for(
        mut self: Box<Self>,
        hand_off: &mut dyn FnMut(Box<Rendezvous>) -> Result<(), Box<Rendezvous>>,
        limit: Option<Duration>,
    ) -> Result<Option<io::Result<SmcStream>>, Box<Rendezvous>> {
        let start = Instant::now();
        let result = loop {
            let answered = match self.progress() {
                Ok(Progress::Setup { answered }) => answered,
                Ok(Progress::Ended(r)) => break r,
                Err(e) => break Err(self.abandon(e)),
            };
            if answered {
                match hand_off(self) {
                    Ok(()) => return Ok(None),
                    Err(back) => self = back,
                }
            }
            let slice = match limit {
                Some(l) => {
                    let left = l.saturating_sub(start.elapsed());
                    if left.is_zero() {
                        return Err(self);
                    }
                    Some(left.min(RENDEZVOUS_SLICE))
                }
                None => None,
            };
            if let Err(e) = self.wait_and_read(slice) {
                break Err(self.abandon(e));
            }
        };
        Ok(Some(finish(result)))
    }

    /// In a thread waiting in `accept`: finish a handshake handed to it, unless the client
    /// takes longer than [`HANDED_WAIT`] or `give_back()` (other connections are ready):
    /// then `Err` with the handshake, for another thread to finish.
    fn run_handed(
        mut self: Box<Self>,
        give_back: &dyn Fn() -> bool,
    ) -> Result<io::Result<SmcStream>, Box<Rendezvous>> {
        let start = Instant::now();
        loop {
            match self.progress() {
                Ok(Progress::Setup { .. }) => {}
                Ok(Progress::Ended(r)) => return Ok(finish(r)),
                Err(e) => return Ok(Err(self.abandon(e))),
            }
            if start.elapsed() >= HANDED_WAIT || give_back() {
                return Err(self);
            }
            if let Err(e) = self.wait_and_read(Some(HANDED_SLICE)) {
                return Ok(Err(self.abandon(e)));
            }
        }
    }

    /// Look at the connection's slot: still in setup, or the stream (or error) it ended in.
    fn progress(&mut self) -> io::Result<Progress> {
        let p = self.look()?;
        self.done = matches!(p, Progress::Ended(_));
        Ok(p)
    }

    fn look(&mut self) -> io::Result<Progress> {
        let inner = &self.stack.inner;
        let id = self.id;
        let mut core = inner.lock();
        let state = core.slots.get(&id).map(|s| s.state.clone());
        Ok(match state {
            Some(SlotState::Setup) => {
                // An LLC exchange (CONFIRM LINK, CONFIRM RKEY) that another thread handles
                // ends the setup: it wakes this one through the slot's waker rather than
                // leaving it to the read timeout.
                if self.waker.is_none() && core.ep.handshake_awaits_fabric(id) {
                    match setup_waker() {
                        Ok(w) => {
                            if let Some(s) = core.slots.get_mut(&id) {
                                s.setup_waker = Some(w.clone());
                            }
                            self.waker = Some(w);
                        }
                        // Out of descriptors (the setup may be about to decline for that
                        // very reason): the read timeout paces the wait instead.
                        Err(e) => tracing::debug!(%e, ?id, "no eventfd for the setup waker"),
                    }
                }
                let answered = !self.client
                    && core
                        .ep
                        .handshake_state(id)
                        .is_some_and(|s| s != "ExpectProposal");
                Progress::Setup { answered }
            }
            Some(SlotState::Smc) => {
                // Watched while the slot surely holds the socket (core lock).
                if let Some(slot) = core.slots.get_mut(&id) {
                    // The waker (if any) closes with this thread's reference.
                    slot.setup_waker = None;
                    if let Some(slot_sock) = slot.sock.as_mut() {
                        if let Err(e) = inner.tcp_watch.watch(slot_sock, id) {
                            tracing::debug!(%e, ?id, "TCP socket not watched for resets");
                        }
                    }
                }
                drop(core);
                let stack = &self.stack;
                let reg = Registration::new(
                    stack,
                    self.local,
                    Some(self.peer),
                    Some(id),
                    None,
                    !self.client,
                );
                let kind = Kind::Smc(Arc::new(SmcHandle {
                    stack: stack.clone(),
                    id,
                }));
                Progress::Ended(Ok(SmcStream::with_defaults(
                    stack,
                    reg,
                    self.sock.clone(),
                    kind,
                )))
            }
            Some(SlotState::FellBack { reason, leftover }) => {
                core.slots.remove(&id);
                drop(core);
                Progress::Ended(Ok(SmcStream::fallback(
                    &self.stack,
                    self.sock.clone(),
                    reason,
                    leftover,
                    !self.client,
                )))
            }
            Some(SlotState::Reset(r)) => {
                core.slots.remove(&id);
                Progress::Ended(Err(reset_error(r)))
            }
            None => Progress::Ended(Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "connection vanished during setup",
            ))),
        })
    }

    /// Wait for CLC bytes (or the waker; at most `slice` if given, else the socket's read
    /// timeout) and hand what came to the endpoint.
    fn wait_and_read(&mut self, slice: Option<Duration>) -> io::Result<()> {
        if self.waker.is_some() || slice.is_some() {
            let slice = slice.unwrap_or(RENDEZVOUS_SLICE);
            if !wait_socket_or_waker(&self.sock, self.waker.as_deref(), slice)? {
                return Ok(());
            }
        }
        let (inner, id, client) = (&self.stack.inner, self.id, self.client);
        match (&*self.sock).read(&mut self.buf) {
            Ok(0) => {
                let mut core = inner.lock();
                let now = core.now();
                core.ep.handle_tcp_reset(id, now);
                core.drain();
            }
            Ok(n) => {
                tracing::debug!(?id, n, client, "CLC bytes");
                let mut core = inner.lock();
                let now = core.now();
                let bytes = &self.buf[..n];
                core.capture_tcp(id, false, bytes);
                let Core { ep, fab, .. } = &mut *core;
                ep.handle_tcp_data(id, bytes, fab, now);
                core.drain();
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) => {}
            Err(_) => {
                let mut core = inner.lock();
                let now = core.now();
                core.ep.handle_tcp_reset(id, now);
                core.drain();
            }
        }
        Ok(())
    }

    /// This thread cannot go on with the handshake (no eventfd, a failed poll): end it as
    /// if the TCP connection broke, and let go of the slot.
    fn abandon(&mut self, e: io::Error) -> io::Error {
        self.done = true;
        let mut core = self.stack.inner.lock();
        let now = core.now();
        core.ep.handle_tcp_reset(self.id, now);
        core.drain();
        let slot = core.slots.remove(&self.id);
        drop(core);
        drop(slot);
        e
    }
}

impl Drop for Rendezvous {
    fn drop(&mut self) {
        // A handshake nobody finishes (a thread that could not be started for it): ended as
        // if its TCP connection broke, not left in the stack.
        if !self.done {
            let _ = self.abandon(io::Error::other("rendezvous dropped"));
        }
    }
}

/// A stream at the end of its rendezvous: blocking reads without a timeout, TCP_NODELAY as
/// configured.
fn finish(result: io::Result<SmcStream>) -> io::Result<SmcStream> {
    let stream = result?;
    stream.sock.set_read_timeout(None)?;
    if stream.stack.config().nodelay {
        stream.set_nodelay(true)?;
    }
    Ok(stream)
}

/// Choices for [`SmcStream::connect_with_options`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectOptions {
    /// SO_RCVBUF: over SMC-R the size of the connection's RMBE, rounded up to 16 KiB · 2ⁿ
    /// (at most 1 MiB); `None`: the stack's [`buffer_size`](crate::StackConfig::buffer_size).
    pub recv_buffer_size: Option<usize>,
    /// Timeout of the TCP handshake (the rendezvous has its own CLC timer).
    pub connect_timeout: Option<Duration>,
}

impl ConnectOptions {
    /// No choice made: the stack's defaults.
    pub fn new() -> ConnectOptions {
        ConnectOptions::default()
    }

    /// Set [`recv_buffer_size`](Self::recv_buffer_size).
    pub fn recv_buffer_size(mut self, bytes: usize) -> ConnectOptions {
        self.recv_buffer_size = Some(bytes);
        self
    }

    /// Set [`connect_timeout`](Self::connect_timeout).
    pub fn connect_timeout(mut self, t: Duration) -> ConnectOptions {
        self.connect_timeout = Some(t);
        self
    }
}

/// How the stream carries data.
#[derive(Debug)]
enum Kind {
    /// Over SMC-R: connection `id` of the stack.
    Smc(Arc<SmcHandle>),
    /// Plain TCP; `leftover` bytes were read during the rendezvous and come first; `strip`
    /// drops CLC messages that crossed our Decline (see [`crate::crossing`]).
    Tcp {
        reason: FallbackReason,
        leftover: Vec<u8>,
        strip: Stripper,
    },
}

/// A connected socket over SMC-R, or over TCP after a fallback.
#[derive(Debug)]
pub struct SmcStream {
    stack: Stack,
    /// The TCP socket. Over SMC-R shared with the stack's slot of the connection and with
    /// this stream's clones (one descriptor per connection); over TCP this handle's own.
    sock: Arc<TcpStream>,
    kind: Kind,
    read_timeout: Option<Duration>,
    write_timeout: Option<Duration>,
    nonblocking: bool,
    read_shut: bool,
    /// Spin on the completion queues this long before sleeping.
    busy_poll: Option<Duration>,
    /// Bytes the last SMC-R read returned (what the read prefetch of `wait_progress` covers).
    last_read: usize,
    /// Adaptive spin of blocked calls without busy polling (see [`AdaptiveSpin`]); boxed to
    /// keep the stream small.
    spin: Box<AdaptiveSpin>,
    nodelay: std::sync::atomic::AtomicBool,
    /// The entry in the stack's socket table (shared by clones).
    _reg: Arc<Registration>,
}

/// A stream's entry in the stack's socket table, removed when the last clone goes.
#[derive(Debug)]
struct Registration {
    stack: Stack,
    id: u64,
}

impl Registration {
    fn new(
        stack: &Stack,
        local: Option<SocketAddr>,
        peer: Option<SocketAddr>,
        smc: Option<TcpId>,
        fallback: Option<FallbackReason>,
        server: bool,
    ) -> Arc<Registration> {
        let id = stack.register_stream(StreamEntry {
            local,
            peer,
            smc,
            fallback,
            server,
        });
        Arc::new(Registration {
            stack: stack.clone(),
            id,
        })
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.stack.unregister_stream(self.id);
    }
}

impl SmcStream {
    /// Connect on the process-wide stack ([`Stack::global`]).
    pub fn connect(addr: impl ToSocketAddrs) -> io::Result<SmcStream> {
        SmcStream::connect_with(&Stack::global()?, addr)
    }

    /// Connect on `stack`: TCP connect, discovery, then the CLC rendezvous or the fallback.
    pub fn connect_with(stack: &Stack, addr: impl ToSocketAddrs) -> io::Result<SmcStream> {
        let mut last = io::Error::new(io::ErrorKind::InvalidInput, "no address to connect to");
        for a in addr.to_socket_addrs()? {
            match SmcStream::connect_addr(stack, a, None, None) {
                Ok(s) => return Ok(s),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Connect with a timeout for the TCP handshake (the rendezvous has its own CLC timer).
    pub fn connect_timeout(
        stack: &Stack,
        addr: &SocketAddr,
        timeout: Duration,
    ) -> io::Result<SmcStream> {
        SmcStream::connect_addr(stack, *addr, Some(timeout), None)
    }

    /// Connect with options chosen before the connection exists (receive buffer size,
    /// TCP connect timeout).
    pub fn connect_with_options(
        stack: &Stack,
        addr: impl ToSocketAddrs,
        options: &ConnectOptions,
    ) -> io::Result<SmcStream> {
        let mut last = io::Error::new(io::ErrorKind::InvalidInput, "no address to connect to");
        for a in addr.to_socket_addrs()? {
            let buffer = options
                .recv_buffer_size
                .map(|b| u32::try_from(b).unwrap_or(u32::MAX));
            match SmcStream::connect_addr(stack, a, options.connect_timeout, buffer) {
                Ok(s) => return Ok(s),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    fn connect_addr(
        stack: &Stack,
        addr: SocketAddr,
        timeout: Option<Duration>,
        recv_buffer: Option<u32>,
    ) -> io::Result<SmcStream> {
        let fd: OwnedFd = rustix::net::socket(family(&addr), SocketType::STREAM, None)?;
        SmcStream::connect_socket(stack, fd, addr, timeout, recv_buffer)
    }

    /// Connect the unconnected TCP socket `fd` (a blocking one) to `addr`: discovery, then
    /// the rendezvous or the fallback (the fd-level API of [`crate::fdapi`] hands in the
    /// application's own socket).
    pub(crate) fn connect_socket(
        stack: &Stack,
        fd: OwnedFd,
        addr: SocketAddr,
        timeout: Option<Duration>,
        recv_buffer: Option<u32>,
    ) -> io::Result<SmcStream> {
        if let Some(b) = recv_buffer {
            // The TCP receive buffer too, for a fallback (best effort: the kernel clamps it).
            let _ = rustix::net::sockopt::set_socket_recv_buffer_size(&fd, b as usize);
        }
        let mode = stack.discovery_mode();
        let cookie = match (&stack.inner.discovery, mode) {
            (Some(d), DiscoveryMode::Ebpf) => Some(d.mark_client(&fd).map_err(io::Error::other)?),
            _ => None,
        };
        let sock = match tcp_connect(fd, addr, timeout) {
            Ok(s) => Arc::new(s),
            Err(e) => {
                if let (Some(d), Some(c)) = (&stack.inner.discovery, cookie) {
                    d.unmark_client(c);
                }
                return Err(e);
            }
        };
        let offered = match mode {
            DiscoveryMode::Ebpf => match (&stack.inner.discovery, cookie) {
                (Some(d), Some(c)) => matches!(d.client_outcome(c), Ok(Outcome::BothOffered))
                    .then_some(())
                    .ok_or(FallbackReason::PeerWithoutOption),
                _ => Err(FallbackReason::DiscoveryOff),
            },
            DiscoveryMode::AssertPeer => Ok(()),
            DiscoveryMode::Auto | DiscoveryMode::Off => Err(FallbackReason::DiscoveryOff),
        };
        match offered {
            Ok(()) => SmcStream::rendezvous(stack, sock, true, recv_buffer, addr),
            Err(reason) => Ok(SmcStream::fallback(stack, sock, reason, Vec::new(), false)),
        }
    }

    pub(crate) fn fallback(
        stack: &Stack,
        sock: Arc<TcpStream>,
        reason: FallbackReason,
        leftover: Vec<u8>,
        server: bool,
    ) -> SmcStream {
        {
            let mut core = stack.inner.lock();
            core.stats.fallbacks += 1;
            *core.fallback_reasons.entry(reason.to_string()).or_default() += 1;
            match reason {
                FallbackReason::PeerDeclined { .. } | FallbackReason::Declined(_) => {
                    core.stats.fallback_declined += 1
                }
                _ => core.stats.fallback_no_smc_peer += 1,
            }
        }
        // Urgent data in line, as over SMC-R (`send_urgent`, `at_mark`).
        let _ = rustix::net::sockopt::set_socket_oobinline(&sock, true);
        if stack.config().nodelay {
            let _ = sock.set_nodelay(true);
        }
        let (local, peer) = (sock.local_addr().ok(), sock.peer_addr().ok());
        let reg = Registration::new(stack, local, peer, None, Some(reason), server);
        let kind = Kind::Tcp {
            reason,
            leftover,
            // Only after our own Decline can a message of the peer cross it.
            strip: Stripper::new(matches!(reason, FallbackReason::Declined(_))),
        };
        SmcStream::with_defaults(stack, reg, sock, kind)
    }

    /// A new stream with the stack's defaults: blocking, no timeouts, the configured busy
    /// polling and adaptive spin.
    fn with_defaults(
        stack: &Stack,
        reg: Arc<Registration>,
        sock: Arc<TcpStream>,
        kind: Kind,
    ) -> SmcStream {
        SmcStream {
            _reg: reg,
            stack: stack.clone(),
            sock,
            kind,
            read_timeout: None,
            write_timeout: None,
            nonblocking: false,
            read_shut: false,
            busy_poll: stack.config().busy_poll,
            spin: Box::new(AdaptiveSpin::new(stack.config().adaptive_spin)),
            last_read: 1,
            nodelay: Default::default(),
        }
    }

    /// Run the CLC handshake on `sock` (client or server, connected to `peer`) until the
    /// connection is established over SMC-R, falls back, or fails.
    pub(crate) fn rendezvous(
        stack: &Stack,
        sock: Arc<TcpStream>,
        client: bool,
        recv_buffer: Option<u32>,
        peer: SocketAddr,
    ) -> io::Result<SmcStream> {
        Rendezvous::start(stack, sock, client, recv_buffer, peer)?
            .run(&mut |r| Err(r))
            .unwrap_or_else(|| Err(io::Error::other("rendezvous handed off")))
    }

    /// Another handle to the same connection (reads and writes may run in different threads).
    /// The connection closes when the last handle is dropped. Bytes a fallen-back stream
    /// received during the rendezvous stay with the original handle, and so does the
    /// dropping of a CLC message that crossed our Decline (read with the original first).
    pub fn try_clone(&self) -> io::Result<SmcStream> {
        // Over SMC-R the clone shares the socket (no new descriptor); over TCP it gets its
        // own duplicate, so that each handle can become a tokio stream (`into_tcp`).
        let (kind, sock) = match &self.kind {
            Kind::Smc(h) => (Kind::Smc(h.clone()), self.sock.clone()),
            Kind::Tcp { reason, .. } => (
                Kind::Tcp {
                    reason: *reason,
                    leftover: Vec::new(),
                    strip: Stripper::new(false),
                },
                Arc::new(self.sock.try_clone()?),
            ),
        };
        Ok(SmcStream {
            _reg: self._reg.clone(),
            stack: self.stack.clone(),
            sock,
            kind,
            read_timeout: self.read_timeout,
            write_timeout: self.write_timeout,
            nonblocking: self.nonblocking,
            read_shut: self.read_shut,
            busy_poll: self.busy_poll,
            spin: Box::new(AdaptiveSpin::new(self.spin.max)),
            last_read: 1,
            nodelay: std::sync::atomic::AtomicBool::new(
                self.nodelay.load(std::sync::atomic::Ordering::Relaxed),
            ),
        })
    }

    /// The engine's id of the SMC-R connection; `None` over TCP.
    pub(crate) fn smc_id(&self) -> Option<TcpId> {
        match &self.kind {
            Kind::Smc(h) => Some(h.id),
            Kind::Tcp { .. } => None,
        }
    }

    /// Whether this connection runs over SMC-R or fell back to TCP, and why.
    pub fn mode(&self) -> Mode {
        match &self.kind {
            Kind::Smc(h) => self.stack.slot_mode(h.id).unwrap_or(Mode::Smc),
            Kind::Tcp { reason, .. } => Mode::Tcp(*reason),
        }
    }

    /// Over SMC-R: the link group and the name of our device of the link this connection
    /// sends on (each side chooses its own, RFC 7609 §2.3); `None` over TCP.
    pub fn send_link(&self) -> Option<(u32, String)> {
        let Kind::Smc(h) = &self.kind else {
            return None;
        };
        let core = self.stack.inner.lock();
        let (lgr, num) = core.ep.connection_link(h.id)?;
        let dev = core.ep.link_group(lgr)?.links.get(&num)?.device;
        let name = core.fab.devices.get(usize::from(dev.0))?.name().to_string();
        Some((lgr.0, name))
    }

    /// The eventfds that signal this connection's progress (created on first use); `None`
    /// over TCP.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn notifiers(&self) -> io::Result<Option<Arc<crate::stack::Notifiers>>> {
        let Kind::Smc(h) = &self.kind else {
            return Ok(None);
        };
        let mut core = self.stack.inner.lock();
        let Some(slot) = core.slots.get_mut(&h.id) else {
            return Err(io::ErrorKind::NotConnected.into());
        };
        if slot.notify.is_none() {
            slot.notify = Some(Arc::new(crate::stack::Notifiers::new()?));
        }
        let notify = slot.notify.clone();
        core.sync_readable_events(h.id);
        Ok(notify)
    }

    /// Over TCP: the socket and the bytes read during the rendezvous, for event loops. The
    /// returned guard keeps the socket listed by `smc ss`.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn into_tcp(
        self,
    ) -> Result<(TcpStream, Vec<u8>, Stripper, impl Sized + Send + Sync), Box<SmcStream>> {
        match self.kind {
            Kind::Tcp {
                leftover,
                reason,
                strip,
            } => {
                // A fallen-back stream's socket is its own (clones duplicate it); should it
                // be shared after all, a duplicate serves.
                let sock = match Arc::try_unwrap(self.sock) {
                    Ok(s) => s,
                    Err(shared) => match shared.try_clone() {
                        Ok(s) => s,
                        Err(_) => {
                            return Err(Box::new(SmcStream {
                                sock: shared,
                                kind: Kind::Tcp {
                                    leftover,
                                    reason,
                                    strip,
                                },
                                ..self
                            }))
                        }
                    },
                };
                Ok((sock, leftover, strip, self._reg))
            }
            kind => Err(Box::new(SmcStream { kind, ..self })),
        }
    }

    /// Over SMC-R: bytes we wrote that the peer has not consumed yet, as far as its last
    /// consumer-cursor update tells (like Linux's SIOCOUTQ); `None` over TCP.
    pub fn unconsumed_by_peer(&self) -> Option<u64> {
        let Kind::Smc(h) = &self.kind else {
            return None;
        };
        let core = self.stack.inner.lock();
        let c = core.ep.connection(h.id)?;
        let d = cursor_distance(
            c.peer_consumer_cursor(),
            c.producer_cursor(),
            c.config().peer_rmbe_len,
        );
        Some(u64::try_from(d).unwrap_or(0))
    }

    /// SO_RCVBUF: over SMC-R the size of our RMBE (the peer writes into it; at most this
    /// many bytes are in flight towards us), over TCP the socket's receive buffer.
    pub fn recv_buffer_size(&self) -> io::Result<usize> {
        match &self.kind {
            Kind::Tcp { .. } => Ok(rustix::net::sockopt::socket_recv_buffer_size(&self.sock)?),
            Kind::Smc(h) => {
                let core = self.stack.inner.lock();
                let c = core
                    .ep
                    .connection(h.id)
                    .ok_or(io::ErrorKind::NotConnected)?;
                Ok(c.config().local_rmbe_len as usize)
            }
        }
    }

    /// SO_SNDBUF: over SMC-R the size of the peer's RMBE (writes go straight into it, so it
    /// bounds the bytes in flight from us), over TCP the socket's send buffer.
    pub fn send_buffer_size(&self) -> io::Result<usize> {
        match &self.kind {
            Kind::Tcp { .. } => Ok(rustix::net::sockopt::socket_send_buffer_size(&self.sock)?),
            Kind::Smc(h) => {
                let core = self.stack.inner.lock();
                let c = core
                    .ep
                    .connection(h.id)
                    .ok_or(io::ErrorKind::NotConnected)?;
                Ok(c.config().peer_rmbe_len as usize)
            }
        }
    }

    /// Send `data` as urgent data (MSG_OOB): its last byte is the urgent byte, delivered in
    /// line (SO_OOBINLINE); the peer's [`at_mark`](Self::at_mark) says when its next read
    /// starts with it. Over SMC-R all of `data` is written at once (RFC 7609 §4.7.5), so it
    /// must fit in the peer's RMBE ([`send_buffer_size`](Self::send_buffer_size)); blocks
    /// (within the write timeout) until it does, the peer knowing meanwhile that urgent
    /// data is pending. Until the peer has read the urgent byte no further byte is written
    /// (§4.7.5: no RDMA write before the urgent data is acknowledged; smc-rs has no send
    /// buffer to park them in), so a following write blocks meanwhile. Over TCP:
    /// `send(MSG_OOB)`.
    pub fn send_urgent(&mut self, data: &[u8]) -> io::Result<()> {
        if data.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "no urgent byte",
            ));
        }
        let id = match &self.kind {
            Kind::Tcp { .. } => {
                let mut off = 0;
                while off < data.len() {
                    off +=
                        rustix::net::send(&self.sock, &data[off..], rustix::net::SendFlags::OOB)?;
                }
                return Ok(());
            }
            Kind::Smc(h) => h.id,
        };
        if data.len() > self.send_buffer_size()? {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "urgent data larger than the peer's receive buffer",
            ));
        }
        // A WRITE that fails part way (a link failure) takes only a part: the rest goes as
        // urgent data again.
        let mut off = 0;
        while off < data.len() {
            off += self.smc_write_inner(id, &data[off..], true)?;
        }
        Ok(())
    }

    /// SIOCATMARK: whether the next byte read is the urgent byte the peer sent last.
    pub fn at_mark(&self) -> io::Result<bool> {
        match &self.kind {
            Kind::Tcp { .. } => tcp_at_mark(&self.sock),
            Kind::Smc(h) => {
                let core = self.stack.inner.lock();
                Ok(core.ep.urgent_offset(h.id) == Some(0))
            }
        }
    }

    /// TCP keepalive on the connection's TCP socket (SO_KEEPALIVE, first probe after `idle`;
    /// `None`: off). Over SMC-R too: the kernel probes the idle TCP path and a failed probe
    /// ends the SMC-R connection as a TCP reset does (RFC 7609 §4.5.3, §4.8.2).
    pub fn set_tcp_keepalive(&self, idle: Option<Duration>) -> io::Result<()> {
        match idle {
            Some(d) => {
                rustix::net::sockopt::set_tcp_keepidle(&self.sock, d.max(Duration::from_secs(1)))?;
                rustix::net::sockopt::set_socket_keepalive(&self.sock, true)?;
            }
            None => rustix::net::sockopt::set_socket_keepalive(&self.sock, false)?,
        }
        Ok(())
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.sock.peer_addr()
    }

    /// Our address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.sock.local_addr()
    }

    /// The stack the stream belongs to.
    pub fn stack(&self) -> &Stack {
        &self.stack
    }

    /// Timeout of blocking reads (`None`: block forever).
    pub fn set_read_timeout(&mut self, t: Option<Duration>) -> io::Result<()> {
        if t == Some(Duration::ZERO) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "zero timeout"));
        }
        self.read_timeout = t;
        self.sock.set_read_timeout(t)
    }

    /// Timeout of blocking writes (`None`: block forever).
    pub fn set_write_timeout(&mut self, t: Option<Duration>) -> io::Result<()> {
        if t == Some(Duration::ZERO) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "zero timeout"));
        }
        self.write_timeout = t;
        self.sock.set_write_timeout(t)
    }

    /// Nonblocking mode of this handle's SMC-R reads and writes only, leaving the TCP
    /// socket's flag (the application's, under the fd-level API) as it is.
    pub(crate) fn set_nonblocking_calls(&mut self, nonblocking: bool) {
        self.nonblocking = nonblocking;
    }

    /// Nonblocking mode: reads and writes that would wait return `WouldBlock`.
    pub fn set_nonblocking(&mut self, nonblocking: bool) -> io::Result<()> {
        self.nonblocking = nonblocking;
        self.sock.set_nonblocking(nonblocking)
    }

    /// TCP_NODELAY. Over SMC-R, with it off (the default, as in TCP) a small write's
    /// producer-cursor update (its CDC) is held back while bytes written before are not
    /// consumed by the peer, until a quarter of the peer's RMBE is unsignalled, the writer
    /// blocks or reads, or a short timer fires (RFC 7609 §4.5.2 coalescing); with it on
    /// every write is announced at once.
    pub fn set_nodelay(&self, nodelay: bool) -> io::Result<()> {
        match &self.kind {
            Kind::Tcp { .. } => self.sock.set_nodelay(nodelay),
            Kind::Smc(h) => {
                let mut core = self.stack.inner.lock();
                let now = core.now();
                let r = core.ep.set_nodelay(h.id, nodelay, now);
                core.drain();
                r.map_err(|e| io::Error::new(io::ErrorKind::NotConnected, e))?;
                self.nodelay
                    .store(nodelay, std::sync::atomic::Ordering::Relaxed);
                Ok(())
            }
        }
    }

    /// TCP_NODELAY as set.
    pub fn nodelay(&self) -> io::Result<bool> {
        match &self.kind {
            Kind::Tcp { .. } => self.sock.nodelay(),
            Kind::Smc { .. } => Ok(self.nodelay.load(std::sync::atomic::Ordering::Relaxed)),
        }
    }

    /// Shut down reading, writing or both, as `TcpStream::shutdown` does.
    pub fn shutdown(&mut self, how: Shutdown) -> io::Result<()> {
        match &self.kind {
            Kind::Tcp { .. } => self.sock.shutdown(how),
            Kind::Smc(h) => {
                let id = h.id;
                if matches!(how, Shutdown::Read | Shutdown::Both) {
                    self.read_shut = true;
                }
                if matches!(how, Shutdown::Write | Shutdown::Both) {
                    let mut core = self.stack.inner.lock();
                    let now = core.now();
                    let r = core.ep.shutdown_write(id, now);
                    core.drain();
                    if let Err(e) = r {
                        if let Some(err) = core.slots.get(&id).and_then(|s| s.error) {
                            return Err(conn_error(err));
                        }
                        return Err(io::Error::new(io::ErrorKind::NotConnected, e));
                    }
                }
                Ok(())
            }
        }
    }

    /// Busy polling: before a blocked read or write sleeps, the calling thread polls the
    /// completion queues itself for up to this long (no system call and no thread switch
    /// while the peer is active). `None` (the default unless configured): sleep at once.
    pub fn set_busy_poll(&mut self, spin: Option<Duration>) {
        self.busy_poll = spin;
    }

    /// Wait until the stack made progress on connection `id` (or `wait` passed): spin on the
    /// completion queues first when busy polling is on (or, without it, for the adaptive spin
    /// budget, see [`AdaptiveSpin`]); then, unless another application thread does already,
    /// sleep on the completion channels and handle what arrives in this thread (no hop
    /// through the runtime thread); otherwise sleep on the connection's condition variable.
    /// May return with the endpoint's output not drained: the caller drains (`Core::drain`)
    /// before it lets the lock go.
    fn wait_progress<'a>(
        &self,
        inner: &'a crate::stack::Inner,
        id: TcpId,
        mut core: std::sync::MutexGuard<'a, Core>,
        now: smc_proto::Timestamp,
        wait: Duration,
        want: Want,
    ) -> (
        std::sync::MutexGuard<'a, Core>,
        Option<smc_proto::Timestamp>,
    ) {
        let mut wcs = [smc_fabric::WorkCompletion::EMPTY; 32];
        // Whether this thread is the poller (the flag changes only under the core lock).
        let mut polling = !inner.poller.swap(true, Ordering::AcqRel);
        // Adaptive spinning only for a read that follows a write of this stream (a reply
        // expected soon after a request); a streaming reader or a writer waiting for room
        // sleeps at once (on a loaded machine their spinning delays the peer that would end
        // the wait).
        let adaptive = self.busy_poll.is_none()
            && matches!(want, Want::Read)
            && self.spin.after_write.load(Ordering::Relaxed);
        let spin = self
            .busy_poll
            .or_else(|| adaptive.then(|| self.spin.budget()).flatten());
        if let Some(spin) = spin {
            // Where the next byte a read waits for lands in our RMB.
            let prefetch = match want {
                // As many bytes as the last read took (a reply as long as the last one).
                Want::Read => core.ep.next_read_at(id).and_then(|(lgr, rmb, at)| {
                    let mr = core.fab.rmbs.get(&(lgr, rmb))?.iter().flatten().next()?;
                    mr.prefetch_hint(usize::try_from(at).ok()?, self.last_read)
                }),
                Want::Write(_) => None,
            };
            // Spinning as the poller keeps the runtime thread off the completion channels,
            // so the peer rings no doorbell (no system call on either side). Recorded as a
            // recent poll, so that the runtime thread stays off them between two waits too
            // (else it arms them while this thread writes, and every completion of ours
            // writes its eventfd and wakes it onto the lock).
            // `now` is the caller's clock reading, taken just before (a read costs about as
            // much as handling a message: none is taken that is not needed).
            if polling {
                let micros = u64::try_from(now.as_duration().as_micros()).unwrap_or(u64::MAX);
                inner.poller_at.store(micros, Ordering::Release);
            }
            let until = now + spin.min(wait);
            // The clock as of the last look at it: at most one round of spins
            // (SPINS_BETWEEN_LOOKS) old, a few µs, which the engine's timers (500 µs and
            // longer) do not notice. The poll after a wake-up of the spin takes it instead of
            // reading the clock (25 ns, as much as handling a message) on the path of a reply.
            let mut looked_at = now;
            loop {
                // Completions that do not concern this call (our own SENDs completing, other
                // connections' data) are handled here and the spin goes on: returning would
                // only make the caller look again and come back.
                let mut polled_at = Some(looked_at);
                let handled = core.poll_completions_at(&mut wcs, &mut polled_at);
                // Whether what this poll handled, or what another thread (the runtime thread,
                // or another stream's) handled while the lock was free, lets the call go on.
                // Looked at once per look at the queues: after a wake-up of the spin, the poll
                // comes first (it likely holds the answer). What the poll left to the runtime
                // (the events of the messages, a CDC they call for) is then done by the
                // caller after its read or write, in one drain with what that leaves (the
                // callers drain before they let the lock go).
                if progressed(&core, id, want) {
                    if polling {
                        inner.poller.store(false, Ordering::Release);
                    }
                    // The time those completions were handled at (see `looked_at`): the
                    // caller need not read the clock again.
                    return (core, polled_at);
                }
                if handled {
                    core.drain();
                }
                looked_at = core.now();
                if looked_at >= until {
                    break;
                }
                drop(core);
                // Spin without the lock (no cache line of the core bounces, nobody else is
                // kept out) until a completion queue may hold something; every so often take
                // the lock anyway, to see the clock and what other threads handled.
                for _ in 0..SPINS_BETWEEN_LOOKS {
                    if inner.cqs.iter().any(|cq| cq.maybe_ready()) {
                        // Likely the peer's CDC, with its data before it: the data's line
                        // travels while the poll handles the CDC.
                        if let Some(p) = prefetch {
                            p.issue();
                        }
                        break;
                    }
                    std::hint::spin_loop();
                }
                core = inner.lock();
                if !polling {
                    polling = !inner.poller.swap(true, Ordering::AcqRel);
                    if polling {
                        inner.poller_at.store(core.now_micros(), Ordering::Release);
                    }
                }
            }
        }
        let slept = Instant::now();
        if polling {
            inner.poller_at.store(core.now_micros(), Ordering::Release);
            // Another thread may have handled what this call waits for (see above). Looked at
            // before arming, since an armed channel makes the peer ring a doorbell for every
            // message until someone sleeps on it; from here until the sleep this thread holds
            // the lock, so nobody else handles a completion meanwhile.
            if progressed(&core, id, want) {
                core.drain();
                inner.poller.store(false, Ordering::Release);
                return (core, None);
            }
            // Arm, then look once more before sleeping (verbs arm-then-recheck).
            for cq in &inner.cqs {
                cq.req_notify();
            }
            if !core.poll_completions(&mut wcs) {
                drop(core);
                let mut fds: Vec<rustix::event::PollFd<'_>> = inner
                    .cqs
                    .iter()
                    .map(|c| {
                        rustix::event::PollFd::from_borrowed_fd(
                            c.fd(),
                            rustix::event::PollFlags::IN,
                        )
                    })
                    .collect();
                let ts = rustix::event::Timespec {
                    tv_sec: wait.as_secs() as i64,
                    tv_nsec: i64::from(wait.subsec_nanos()),
                };
                let _ = rustix::event::poll(&mut fds, Some(&ts));
                let ready: Vec<bool> = fds.iter().map(|f| !f.revents().is_empty()).collect();
                drop(fds);
                for (cq, r) in inner.cqs.iter().zip(ready) {
                    if r {
                        cq.ack_notify();
                    }
                }
                if adaptive {
                    self.spin
                        .slept(spin.unwrap_or_default().min(wait), slept.elapsed());
                }
                core = inner.lock();
                core.poll_completions(&mut wcs);
            }
            core.drain();
            inner.poller.store(false, Ordering::Release);
            return (core, None);
        }
        let Some(cond) = core.slots.get_mut(&id).map(|s| {
            s.waiters += 1;
            s.cond.clone()
        }) else {
            return (core, None);
        };
        core.sync_readable_events(id);
        inner.followers.fetch_add(1, Ordering::AcqRel);
        let mut core = match cond.wait_timeout(core, wait) {
            Ok((g, _)) => g,
            Err(p) => p.into_inner().0,
        };
        if adaptive {
            self.spin
                .slept(spin.unwrap_or_default().min(wait), slept.elapsed());
        }
        inner.followers.fetch_sub(1, Ordering::AcqRel);
        if let Some(s) = core.slots.get_mut(&id) {
            s.waiters = s.waiters.saturating_sub(1);
        }
        core.sync_readable_events(id);
        (core, None)
    }

    fn deadline(&self, t: Option<Duration>) -> Option<Instant> {
        t.map(|t| Instant::now() + t)
    }

    fn smc_read(&mut self, id: TcpId, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() || self.read_shut {
            return Ok(0);
        }
        let inner: &crate::stack::Inner = &self.stack.inner;
        let deadline = self.deadline(self.read_timeout);
        let mut core = inner.lock();
        let mut now = core.now();
        let result = loop {
            // One pass: copied straight into `buf`, consumed, stopped in front of the urgent
            // byte as TCP does (so that `at_mark` can tell the next read starts with it).
            let max = u32::try_from(buf.len()).unwrap_or(u32::MAX);
            let Core { ep, fab, .. } = &mut *core;
            match ep.read_with(id, max, now, |target, n| {
                copy_out(fab, target, &mut buf[..n as usize])
            }) {
                Ok(Ok(0)) | Err(_) => {}
                Ok(Ok(n)) => {
                    self.spin.after_write.store(false, Ordering::Relaxed);
                    self.last_read = n as usize;
                    break Ok(n as usize);
                }
                Ok(Err(e)) => break Err(e),
            }
            // The end of stream the peer sent comes before a later failure (the peer said
            // it was done; a reset after that loses nothing).
            if core.ep.connection(id).is_some_and(|c| c.is_read_closed()) {
                break Ok(0);
            }
            if let Some(e) = core.slots.get(&id).and_then(|s| s.error) {
                break Err(conn_error(e));
            }
            if core.ep.connection(id).is_none() {
                break Ok(0);
            }
            // A reader that waits for the peer gains nothing from holding back the update
            // of what it wrote (the peer may be waiting for those bytes).
            if core.ep.flush(id, now).is_ok() {
                core.drain();
            }
            let wait = match self.wait_slice(deadline) {
                Ok(w) => w,
                Err(e) => break Err(e),
            };
            let (c, fresh) = self.wait_progress(inner, id, core, now, wait, Want::Read);
            core = c;
            now = fresh.unwrap_or_else(|| core.now());
        };
        // What the read (or the wait before it) left to the runtime: the consumer update
        // the read may call for, the events of the messages handled.
        core.drain();
        result
    }

    /// How long a blocked read or write may wait for progress now: `WouldBlock` in
    /// nonblocking mode or once the timeout's `deadline` passed, else up to one poll slice.
    fn wait_slice(&self, deadline: Option<Instant>) -> io::Result<Duration> {
        if self.nonblocking {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        match deadline {
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::ErrorKind::WouldBlock.into());
                }
                Ok(left.min(POLL_SLICE))
            }
            None => Ok(POLL_SLICE),
        }
    }

    fn smc_write(&mut self, id: TcpId, buf: &[u8]) -> io::Result<usize> {
        self.smc_write_inner(id, buf, false)
    }

    /// Write (or, `urgent`, write as urgent data, all or nothing) as much of `buf` as the
    /// peer's RMBE takes, blocking within the write timeout until some fits.
    fn smc_write_inner(&mut self, id: TcpId, buf: &[u8], urgent: bool) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let inner: &crate::stack::Inner = &self.stack.inner;
        let deadline = self.deadline(self.write_timeout);
        let mut core = inner.lock();
        loop {
            if let Some(e) = core.slots.get(&id).and_then(|s| s.error) {
                core.drain();
                return Err(conn_error(e));
            }
            let now = core.now();
            let sent = if urgent {
                core.send_urgent_direct(id, buf, now)
            } else {
                send_in_pieces(&mut core, id, buf, now)
            };
            match sent {
                Ok(0) => {}
                Ok(n) => {
                    core.drain();
                    self.spin.after_write.store(true, Ordering::Relaxed);
                    return Ok(n);
                }
                Err(e) => {
                    core.drain();
                    if let Some(err) = core.slots.get(&id).and_then(|s| s.error) {
                        return Err(conn_error(err));
                    }
                    return Err(io::Error::new(io::ErrorKind::BrokenPipe, e));
                }
            }
            core.drain();
            let wait = self.wait_slice(deadline)?;
            let want = if urgent {
                Want::Write(u32::try_from(buf.len()).unwrap_or(u32::MAX))
            } else {
                Want::Write(1)
            };
            core = self.wait_progress(inner, id, core, now, wait, want).0;
        }
    }
}

/// A write larger than a quarter of the peer's RMBE goes out in pieces of that size (at least
/// 16 KiB), each announced by its own CDC, so that the reader copies the first piece out of its
/// RMBE while this thread copies the next one in; in one piece, a write that fills the whole
/// RMBE makes the two copies take turns (measured: 256 KiB and 1 MiB writes into 256 KiB RMBEs
/// at 24 Gbit/s in one piece, 41 in pieces). Returns what was taken, as `send_direct` does.
fn send_in_pieces(
    core: &mut Core,
    id: TcpId,
    buf: &[u8],
    now: smc_proto::Timestamp,
) -> Result<usize, smc_proto::endpoint::EndpointError> {
    if buf.len() <= PIECE_MIN {
        // One piece whatever the RMBE (no lookup of the connection for a small write).
        return core.send_direct(id, buf, now);
    }
    let piece = core.ep.connection(id).map_or(buf.len(), |c| {
        (c.config().peer_rmbe_len as usize / 4).max(PIECE_MIN)
    });
    let mut total = 0usize;
    while total < buf.len() {
        let end = buf.len().min(total + piece);
        match core.send_direct(id, &buf[total..end], now) {
            Ok(n) => {
                total += n;
                if total < end {
                    // The RMBE is full (or n is 0): the caller waits for room.
                    break;
                }
                // Post this piece's WRITE and CDC before copying the next one.
                core.drain();
            }
            // What was taken stays taken; the failure shows at the next call.
            Err(_) if total > 0 => break,
            Err(e) => return Err(e),
        }
    }
    Ok(total)
}

/// Smallest piece a large write is cut into (see [`send_in_pieces`]).
const PIECE_MIN: usize = 16 * 1024;

/// Whether a blocked read or write (`want`) of connection `id` can go on: data, end of
/// stream or room in the peer's RMBE, or a failure. A waiting thread looks at this whenever
/// it held the core lock anew, since whoever handles a completion (not necessarily the
/// waiting thread) changes it.
fn progressed(core: &Core, id: TcpId, want: Want) -> bool {
    let conn = core.ep.connection(id);
    // The usual answer first (a failure recorded meanwhile shows at the read that follows).
    if matches!(want, Want::Read) && conn.is_some_and(|c| c.readable() > 0) {
        return true;
    }
    if core.slots.get(&id).is_some_and(|s| s.error.is_some()) {
        return true;
    }
    match (conn, want) {
        (None, _) => true,
        (Some(c), Want::Read) => c.readable() > 0 || c.is_read_closed(),
        // What the send path can take (not `window()`: after urgent data no write is taken
        // until the peer read the urgent byte, whatever the window).
        (Some(c), Want::Write(n)) => c.write_room() >= n.max(1),
    }
}

/// What a blocked call waits for.
#[derive(Debug, Clone, Copy)]
enum Want {
    /// Something to read (or the end of the stream).
    Read,
    /// This much room in the peer's RMBE (urgent data is written all at once).
    Write(u32),
}

/// SIOCATMARK on a TCP socket.
fn tcp_at_mark(sock: &TcpStream) -> io::Result<bool> {
    const SIOCATMARK: rustix::ioctl::Opcode = 0x8905;
    // SAFETY: SIOCATMARK takes a pointer to an int the kernel fills in, which is what
    // `Getter<_, c_int>` passes.
    let at = unsafe {
        rustix::ioctl::ioctl(
            sock,
            rustix::ioctl::Getter::<SIOCATMARK, std::ffi::c_int>::new(),
        )
    }?;
    Ok(at != 0)
}

/// Copy the first `out.len()` unread bytes of connection `id` out of our RMB (one copy,
/// straight into the application's buffer). Every device's registration of the RMB is the
/// same memory, so any of them serves.
fn copy_out(
    fab: &crate::stack::Fabric,
    target: &smc_proto::endpoint::ReadTarget,
    out: &mut [u8],
) -> io::Result<()> {
    let regions: &Regions = &target.regions;
    let mr = fab
        .rmbs
        .get(&(target.lgr, target.rmb))
        .and_then(|r| r.iter().flatten().next())
        .ok_or_else(|| io::Error::other("RMB missing"))?;
    let mut done = 0usize;
    for r in regions.iter() {
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

fn tcp_connect(fd: OwnedFd, addr: SocketAddr, timeout: Option<Duration>) -> io::Result<TcpStream> {
    let Some(t) = timeout else {
        rustix::net::connect(&fd, &addr)?;
        return Ok(TcpStream::from(fd));
    };
    let sock = TcpStream::from(fd);
    sock.set_nonblocking(true)?;
    match rustix::net::connect(&sock, &addr) {
        Ok(()) => {}
        Err(rustix::io::Errno::INPROGRESS) => {
            let mut fds = [rustix::event::PollFd::new(
                &sock,
                rustix::event::PollFlags::OUT,
            )];
            let ts = rustix::event::Timespec {
                tv_sec: t.as_secs() as i64,
                tv_nsec: i64::from(t.subsec_nanos()),
            };
            let n = rustix::event::poll(&mut fds, Some(&ts))?;
            if n == 0 {
                return Err(io::ErrorKind::TimedOut.into());
            }
            if let Some(e) = sock.take_error()? {
                return Err(e);
            }
        }
        Err(e) => return Err(e.into()),
    }
    sock.set_nonblocking(false)?;
    Ok(sock)
}

impl Read for SmcStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match &mut self.kind {
            Kind::Tcp {
                leftover, strip, ..
            } => {
                while strip.active() && !strip.strip(leftover) {
                    let mut more = [0u8; 1024];
                    let n = (&*self.sock).read(&mut more)?;
                    if n == 0 {
                        strip.finish();
                    }
                    leftover.extend_from_slice(&more[..n]);
                }
                if !leftover.is_empty() {
                    let n = leftover.len().min(buf.len());
                    buf[..n].copy_from_slice(&leftover[..n]);
                    leftover.drain(..n);
                    return Ok(n);
                }
                (&*self.sock).read(buf)
            }
            Kind::Smc(h) => {
                let id = h.id;
                self.smc_read(id, buf)
            }
        }
    }
}

impl Write for SmcStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match &self.kind {
            Kind::Tcp { .. } => (&*self.sock).write(buf),
            Kind::Smc(h) => {
                let id = h.id;
                self.smc_write(id, buf)
            }
        }
    }

    /// Over SMC-R: announce bytes whose producer-cursor update coalescing holds back (see
    /// [`set_nodelay`](SmcStream::set_nodelay)) now.
    fn flush(&mut self) -> io::Result<()> {
        match &self.kind {
            Kind::Tcp { .. } => (&*self.sock).flush(),
            Kind::Smc(h) => {
                let mut core = self.stack.inner.lock();
                let now = core.now();
                // A connection that is gone or failed has nothing left to announce; its
                // error shows at the next read or write.
                if core.ep.flush(h.id, now).is_ok() {
                    core.drain();
                }
                Ok(())
            }
        }
    }
}

/// The SMC-R connection shared by a stream and its clones: closed when the last goes.
#[derive(Debug)]
struct SmcHandle {
    stack: Stack,
    id: TcpId,
}

impl Drop for SmcHandle {
    fn drop(&mut self) {
        let id = self.id;
        let mut core = self.stack.inner.lock();
        let now = core.now();
        let _ = core.ep.close(id, now);
        core.drain();
        let gone = core.ep.connection(id).is_none();
        let remove = match core.slots.get_mut(&id) {
            Some(s) => {
                s.dropped = true;
                s.closed || gone
            }
            None => false,
        };
        // The socket closes after the lock is released (see `Core::closing`).
        let slot = if remove { core.slots.remove(&id) } else { None };
        drop(core);
        drop(slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DiscoveryMode, SmcListener, StackConfig};

    /// The engine queues `Readable` for a connection only while a thread sleeps on it: a
    /// reader that follows another thread's polling (here a writer blocked on a full RMBE)
    /// turns the events on for as long as it sleeps, is woken by the event of the byte that
    /// arrives, and turns them off again.
    #[test]
    fn readable_events_only_while_a_reader_sleeps() {
        let dir = std::env::temp_dir().join(format!("smc-rev-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("fabric dir");
        let stack = |dir: &std::path::Path| {
            let mut c = StackConfig::new(smc_fabric::FabricConfig::with_dir(dir, 1));
            c.discovery = DiscoveryMode::AssertPeer;
            Stack::new(c).expect("stack")
        };
        let (a, b) = (stack(&dir), stack(&dir));
        let l = SmcListener::bind_with(&a, "127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        let t = std::thread::spawn(move || SmcStream::connect_with(&b, addr).expect("connect"));
        let (server, _) = l.accept().expect("accept");
        let mut client = t.join().expect("client");
        let Kind::Smc(h) = &server.kind else {
            panic!("not over SMC-R");
        };
        let id = h.id;
        let inner = server.stack.inner.clone();
        let events = || inner.lock().ep.connection(id).map(|c| c.readable_events());
        assert_eq!(events(), Some(false), "nobody sleeps on a new connection");

        // A writer that fills the client's RMBE and waits for room: the server's poller.
        let mut writer = server.try_clone().expect("clone");
        let w = std::thread::spawn(move || writer.write_all(&vec![7u8; 4 << 20]));
        while !inner.poller.load(Ordering::Acquire) {
            std::thread::yield_now();
        }
        // A reader that waits meanwhile sleeps on the connection's condition variable.
        let mut reader = server.try_clone().expect("clone");
        let r = std::thread::spawn(move || {
            let mut b = [0u8; 1];
            reader.read_exact(&mut b).map(|()| b[0])
        });
        // (Both looked at under the core lock, which a sleeper holds while it registers and
        // while it leaves. Between two of its poll slices the writer may hand the polling to
        // the reader and sleep instead: then it is the sleeper.)
        loop {
            let core = inner.lock();
            if inner.followers.load(Ordering::Acquire) > 0 {
                let on = core.ep.connection(id).map(|c| c.readable_events());
                assert_eq!(on, Some(true), "on while a reader sleeps");
                break;
            }
            drop(core);
            std::thread::yield_now();
        }
        client.write_all(&[42]).expect("client write");
        assert_eq!(r.join().expect("reader").expect("read"), 42);
        // Let the writer finish: with nobody waiting any more, the events are off again.
        let mut sink = vec![0u8; 4 << 20];
        client.read_exact(&mut sink).expect("client read");
        w.join().expect("writer").expect("write");
        assert_eq!(events(), Some(false), "off once nobody sleeps");
        // An event loop's interest turns them on for good.
        server.notifiers().expect("notifiers");
        assert_eq!(events(), Some(true), "on while an event loop watches");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn adaptive_spin_grows_while_it_nearly_catches_and_stops_when_it_does_not() {
        let us = Duration::from_micros;
        let s = AdaptiveSpin::new(Some(us(50)));
        assert_eq!(s.budget(), None, "no spin before the first short sleep");
        s.slept(Duration::ZERO, us(900));
        assert_eq!(s.budget(), None, "a long sleep starts no spin");
        s.slept(Duration::ZERO, us(150));
        assert_eq!(s.budget(), Some(SPIN_GROW_START));
        for _ in 0..10 {
            let b = s.budget().unwrap_or_default();
            s.slept(b, b / 2);
        }
        assert_eq!(s.budget(), Some(us(50)), "capped at the maximum");
        s.slept(us(50), us(80));
        assert_eq!(
            s.budget(),
            Some(us(25)),
            "halved after a spin that did not help"
        );
        for _ in 0..10 {
            let b = s.budget().unwrap_or_default();
            s.slept(b, Duration::from_millis(5));
        }
        assert_eq!(s.budget(), None, "a slow peer ends the spinning");
        let off = AdaptiveSpin::new(None);
        off.slept(Duration::ZERO, us(1));
        assert_eq!(off.budget(), None);
        assert_eq!(AdaptiveSpin::new(Some(Duration::ZERO)).budget(), None);
    }
}
