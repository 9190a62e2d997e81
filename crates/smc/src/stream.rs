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
use smc_wire::Cursor;

use crate::config::DiscoveryMode;
use crate::crossing::Stripper;
use crate::discovery::Outcome;
use crate::error::{conn_error, reset_error, FallbackReason, Mode};
use crate::stack::{Core, Slot, SlotState, Stack, StreamEntry};

mod reactor;
use reactor::{First, Parked, Reactor, FIRST_BYTES_WAIT, WORKER_WAIT};
mod connect;
mod data;
mod listener;
mod rendezvous;

pub use connect::ConnectOptions;
pub(crate) use connect::{ClientRendezvous, ClientStart};
pub(crate) use data::AdaptiveSpin;
pub use listener::SmcListener;
use listener::{setup_waker, wait_socket_or_waker, AcceptShared};
use rendezvous::{finish, Progress, Rendezvous};

/// The CLC eye catcher ("SMCR" in EBCDIC) that starts every CLC message.
const CLC_EYECATCHER: [u8; 4] = [0xE2, 0xD4, 0xC3, 0xD9];
/// How long a rendezvous waits for CLC bytes before it looks at its connection's state again
/// (a timer of the runtime thread may have ended the setup).
const RENDEZVOUS_SLICE: Duration = Duration::from_millis(10);

/// How long a blocked call waits on the condition variable before looking again.
const POLL_SLICE: Duration = Duration::from_millis(50);
/// A spinning poller looks at the completion queues' lock-free readiness hint this many times
/// (a few µs) before it takes the core lock again to read the clock and its connection.
pub(crate) const SPINS_BETWEEN_LOOKS: u32 = 64;

/// Signed distance in bytes from cursor `a` to cursor `b` in a ring of `len` bytes.
pub(crate) fn cursor_distance(a: Cursor, b: Cursor, len: u32) -> i64 {
    let wraps = i64::from(b.wrap.wrapping_sub(a.wrap) as i16);
    wraps * i64::from(len) + i64::from(b.count) - i64::from(a.count)
}

fn family(a: &SocketAddr) -> AddressFamily {
    if a.is_ipv4() {
        AddressFamily::INET
    } else {
        AddressFamily::INET6
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
    /// Urgent data out of band (see [`UrgentSlot`]); `None`: in line.
    pub(crate) urgent_slot: Option<Arc<UrgentSlot>>,
    /// The entry in the stack's socket table (shared by clones).
    _reg: Arc<Registration>,
}

/// Urgent data out of band, as a TCP socket without SO_OOBINLINE keeps it (the fd-level API's
/// emulation of TCP for programs, `crate::fdapi`): a read that reaches the urgent byte takes
/// it out of the stream into this slot (under the core lock, so that a byte arriving while the
/// read waits is taken out too), where `recv(MSG_OOB)` finds it.
#[derive(Debug, Default)]
pub(crate) struct UrgentSlot {
    /// `PRESENT | byte` when an urgent byte was taken out and not yet read; `INLINE`: the
    /// program turned SO_OOBINLINE on (the urgent byte stays in the stream).
    pub(crate) state: std::sync::atomic::AtomicU16,
}

impl UrgentSlot {
    pub(crate) const PRESENT: u16 = 0x100;
    pub(crate) const INLINE: u16 = 0x200;
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
            spin: Box::new(self.spin.fresh()),
            last_read: 1,
            nodelay: std::sync::atomic::AtomicBool::new(
                self.nodelay.load(std::sync::atomic::Ordering::Relaxed),
            ),
            urgent_slot: None,
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
        let name = core.fab.port_device(dev)?.name().to_string();
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
        let Some(notify) = core.slots.notifiers(&h.id)? else {
            return Err(io::ErrorKind::NotConnected.into());
        };
        core.sync_readable_events(h.id);
        Ok(Some(notify))
    }

    /// Whether this stream fell back after our own Decline, so that CLC messages of the
    /// peer that crossed it may come in front of its data (see [`crate::crossing`]).
    pub(crate) fn strips_crossing(&self) -> bool {
        matches!(&self.kind, Kind::Tcp { strip, .. } if strip.active())
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

    /// The stream's TCP socket (for socket options the caller keeps).
    pub(crate) fn socket_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&*self.sock)
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
        // The application closes first (active close: the peer has not closed): its TCP
        // connection ends now too, as Linux ends it at an active close, so that TCP's
        // TIME-WAIT stays on this side (the active closer's, as with TCP). Left to the end
        // of the SMC-R close, the peer's stack, whose application closes in turn within
        // microseconds, would often close its socket first and keep the wait on its port.
        // The FIN goes before the closing CDC so that it wins that race; nothing but the
        // termination segments travels on the TCP connection any more (RFC 7609 §4.5.3),
        // and neither end's close processing depends on it.
        use smc_proto::conn::State;
        if matches!(
            core.ep.connection(id).map(|c| c.state()),
            Some(State::Active | State::PeerCloseWait1 | State::PeerCloseWait2)
        ) {
            if let Some(sock) = core.slots.get(&id).and_then(|s| s.sock.as_ref()) {
                let _ = sock.tcp().shutdown(Shutdown::Both);
            }
        }
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

    /// Two stacks on one shm fabric in a fresh directory `smc-{tag}-{pid}`, and a connection
    /// between them over SMC-R: (directory, server end, client end). The stacks live as long
    /// as the streams.
    fn pair(tag: &str) -> (std::path::PathBuf, SmcStream, SmcStream) {
        let dir = std::env::temp_dir().join(format!("smc-{tag}-{}", std::process::id()));
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
        let client = t.join().expect("client");
        (dir, server, client)
    }

    /// The engine queues `Readable` for a connection only while a thread sleeps on it: a
    /// reader that follows another thread's polling (here a writer blocked on a full RMBE)
    /// turns the events on for as long as it sleeps, is woken by the event of the byte that
    /// arrives, and turns them off again.
    #[test]
    fn readable_events_only_while_a_reader_sleeps() {
        let (dir, server, mut client) = pair("rev");
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

    /// A connection's eventfds are written only while a wait is armed
    /// (`smc_fabric::Sleepers`); the signal counts move for every event regardless.
    #[test]
    fn eventfds_are_written_only_while_armed() {
        let (dir, mut server, mut client) = pair("arm");
        let n = server.notifiers().expect("notifiers").expect("over SMC-R");
        server.set_nonblocking(true).expect("nonblocking");
        // An eventfd's counter, taken (0: not written since the last take).
        let take = |fd: &rustix::fd::OwnedFd| {
            let mut b = [0u8; 8];
            rustix::io::read(fd, &mut b).map_or(0, |_| u64::from_ne_bytes(b))
        };
        take(&n.read);
        // Wait until the byte is readable (the runtime thread handles the CDC), read it.
        let got = |server: &mut SmcStream| {
            let mut b = [0u8; 1];
            loop {
                match server.read(&mut b) {
                    Ok(1) => return b[0],
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
                    r => panic!("read: {r:?}"),
                }
            }
        };
        let before = n.read_count.load(Ordering::Acquire);
        client.write_all(&[1]).expect("write");
        assert_eq!(got(&mut server), 1);
        while n.read_count.load(Ordering::Acquire) == before {
            std::thread::yield_now();
        }
        assert_eq!(take(&n.read), 0, "not written while nobody is armed");

        n.sleepers.arm();
        let before = n.read_count.load(Ordering::Acquire);
        client.write_all(&[2]).expect("write");
        assert_eq!(got(&mut server), 2);
        while n.read_count.load(Ordering::Acquire) == before {
            std::thread::yield_now();
        }
        assert!(take(&n.read) > 0, "written while a wait is armed");
        n.sleepers.disarm();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
