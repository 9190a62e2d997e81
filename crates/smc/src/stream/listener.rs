//! The listening socket: accept, the setup workers, and the server side of discovery.

use super::*;

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
pub(super) struct AcceptShared {
    pub(super) stack: Stack,
    tcp: Arc<TcpListener>,
    pub(super) stop: std::sync::atomic::AtomicBool,
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
    pub(super) reactor: Reactor,
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
    .map(smc_fabric::fdplace::placed)
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

    pub(super) fn deliver(&self, r: io::Result<(SmcStream, SocketAddr)>) {
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
        let spawned = smc_fabric::threads::spawn_running(
            std::thread::Builder::new().name("smc-accept".into()),
            move || {
                let peer = r.peer;
                match r.run(&mut |r| Err(r)) {
                    Some(Ok(s)) => shared.deliver(Ok((s, peer))),
                    Some(Err(e)) => tracing::debug!(%e, %peer, "rendezvous failed"),
                    None => {}
                }
            },
        );
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
    smc_fabric::threads::spawn_running(
        std::thread::Builder::new().name("smc-accept".into()),
        move || accept_loop(alive),
    )
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
pub(super) fn setup_waker() -> io::Result<Arc<OwnedFd>> {
    let flags = rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC;
    Ok(Arc::new(smc_fabric::fdplace::make(|| {
        rustix::event::eventfd(0, flags)
    })?))
}

/// Sleep until `sock` has bytes (or an error) or `waker` (if any) is signalled, at most
/// `slice` (under a second); `true`: the socket is readable.
pub(super) fn wait_socket_or_waker(
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
