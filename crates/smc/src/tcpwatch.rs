//! Watching the TCP connection under each SMC-R connection.
//!
//! Once a connection runs over SMC-R its TCP connection carries nothing but, at the end, the
//! FIN or RST of its termination, and TCP keepalives that the kernel answers by itself (RFC
//! 7609 §4.5.3). A reset, or a keepalive timeout, on that TCP connection ends the SMC-R
//! connection too:
//!
//! > If an SMC-R peer receives a TCP RST for a given SMC-R connection, it also initiates
//! > SMC-R abnormal connection termination processing if it has not already been notified
//! > (via the PeerConnAbort indicator) that the partner is severing the connection. (§4.8.2)
//!
//! One thread per stack waits (epoll, edge-triggered) for error and hang-up events on those
//! sockets and hands a pending socket error to the endpoint as a TCP reset. A FIN alone is
//! left to the SMC-R close protocol.
//!
//! > Typically, once a TCP connection has completed the SMC-R Rendezvous processing and is
//! > using SMC-R for data flows, no new inbound TCP segments are expected on that TCP
//! > connection, other than TCP termination segments (FIN, RST, etc.). (§4.5.3)
//!
//! Bytes arriving on that TCP connection mean the peer program wrote to its socket past its
//! SMC-R stack: a preloaded program whose write the library could not see (glibc's stdio
//! writes through an internal entry point; raw system calls; io_uring). Those bytes can never
//! be placed in order with the stream's SMC-R bytes, and the program's reads wait on SMC-R for
//! an answer that will not come. So the connection is aborted (PeerConnAbort to the peer, and
//! the reset is counted as `tcp_data_aborts`): both programs get an error instead of a hang.

use std::io;
use std::net::TcpStream;
use std::sync::{Arc, Weak};
use std::time::Duration;

use rustix::event::epoll;
use rustix::fd::OwnedFd;
use smc_proto::TcpId;

use crate::stack::Inner;

/// How long the watcher sleeps at most before checking whether its stack still exists.
const TICK: Duration = Duration::from_millis(500);

/// The TCP socket of a connection as the stack's slot holds it: the stream's own socket,
/// shared (one descriptor per connection, no `dup`), and the epoll set it is in once the
/// connection runs over SMC-R.
///
/// The descriptor stays open as long as this value lives (it holds a reference), so its
/// number cannot be closed and reused by another file while it is watched; dropping it takes
/// the socket out of the epoll set first, by a number that still names this socket. (Closing
/// the last descriptor would remove it too, but only if no other descriptor of the same open
/// file exists, e.g. one inherited by a forked child.)
#[derive(Debug)]
pub(crate) struct SlotSock {
    sock: Arc<TcpStream>,
    watched: Option<Arc<OwnedFd>>,
}

impl SlotSock {
    pub(crate) fn new(sock: Arc<TcpStream>) -> SlotSock {
        SlotSock {
            sock,
            watched: None,
        }
    }

    /// The socket.
    pub(crate) fn tcp(&self) -> &TcpStream {
        &self.sock
    }
}

impl Drop for SlotSock {
    fn drop(&mut self) {
        if let Some(ep) = self.watched.take() {
            let _ = epoll::delete(&*ep, &*self.sock);
        }
    }
}

/// The epoll set of one stack's SMC-R TCP sockets.
#[derive(Debug)]
pub(crate) struct TcpWatch {
    epoll: Arc<OwnedFd>,
}

impl TcpWatch {
    pub(crate) fn new() -> io::Result<TcpWatch> {
        Ok(TcpWatch {
            epoll: Arc::new(smc_fabric::fdplace::make(|| {
                epoll::create(epoll::CreateFlags::CLOEXEC)
            })?),
        })
    }

    /// Watch `sock`, the TCP connection of SMC-R connection `id` (with the core lock held:
    /// the slot cannot let go of the socket meanwhile). The event carries `id`, never the
    /// descriptor number: identifiers are not reused, so an event of an old registration
    /// finds no slot (or a slot without a socket) and is ignored.
    pub(crate) fn watch(&self, sock: &mut SlotSock, id: TcpId) -> io::Result<()> {
        if sock.watched.is_some() {
            return Ok(());
        }
        // A RST or a keepalive timeout sets the socket error (EPOLLERR; the connection is
        // closed: EPOLLHUP). Bytes make it readable (EPOLLIN); so does a FIN, which is left to
        // the SMC-R close protocol (a peek tells them apart).
        let flags = epoll::EventFlags::HUP
            | epoll::EventFlags::ERR
            | epoll::EventFlags::IN
            | epoll::EventFlags::ET;
        epoll::add(
            &*self.epoll,
            &*sock.sock,
            epoll::EventData::new_u64(id.0),
            flags,
        )?;
        sock.watched = Some(self.epoll.clone());
        Ok(())
    }

    /// Start the watcher thread of the stack `weak`.
    pub(crate) fn spawn(&self, weak: Weak<Inner>) -> io::Result<()> {
        let epoll = self.epoll.clone();
        smc_fabric::threads::spawn_running(
            std::thread::Builder::new().name("smc-tcpwatch".into()),
            move || run(weak, &epoll),
        )?;
        Ok(())
    }
}

/// Whether bytes wait on `sock` (not only its FIN): a peek that takes nothing.
fn has_bytes(sock: &TcpStream) -> bool {
    let mut b = [0u8; 1];
    matches!(
        rustix::net::recv(
            sock,
            &mut b[..],
            rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT,
        ),
        Ok((n, _)) if n > 0
    )
}

/// The watcher thread of a stack; ends when the stack goes.
fn run(weak: Weak<Inner>, epoll_fd: &OwnedFd) {
    let mut events: Vec<epoll::Event> = Vec::with_capacity(64);
    let tick = rustix::event::Timespec {
        tv_sec: 0,
        tv_nsec: i64::from(TICK.subsec_nanos()),
    };
    loop {
        events.clear();
        match epoll::wait(
            epoll_fd,
            rustix::buffer::spare_capacity(&mut events),
            Some(&tick),
        ) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(_) => return,
        }
        let Some(inner) = weak.upgrade() else {
            return;
        };
        if events.is_empty() {
            continue;
        }
        // What the fabric brought before the reset first: a peer that resets its TCP
        // connection posts its last CDCs (the producer cursor of the bytes it wrote, its
        // PeerConnAbort) before its RST leaves, but over software RoCE they wait on the
        // device's socket for whoever receives next, while the RST is here already. Handled
        // now, the bytes stay readable ahead of the reset as over TCP (otherwise our abort
        // would come first and make us ignore them, RFC 7609 §4.8.2).
        for cq in &inner.cqs {
            cq.receive_now();
        }
        let mut core = inner.lock();
        let mut wcs = [smc_fabric::WorkCompletion::EMPTY; 32];
        for _ in 0..8 {
            if !core.poll_completions(&mut wcs) {
                break;
            }
        }
        core.drain();
        let mut reset = Vec::new();
        for ev in &events {
            let id = TcpId(ev.data.u64());
            let Some(sock) = core.slots.get(&id).and_then(|s| s.sock.as_ref()) else {
                continue;
            };
            // RST, or keepalive timeout: the socket holds the error.
            if let Ok(Err(errno)) = rustix::net::sockopt::socket_error(sock.tcp()) {
                tracing::debug!(?id, %errno, "TCP connection of an SMC-R connection failed");
                let now = core.now();
                core.ep.handle_tcp_reset(id, now);
                core.stats.tcp_resets += 1;
                reset.push(id);
            } else if { ev.flags }.contains(epoll::EventFlags::IN) && has_bytes(sock.tcp()) {
                tracing::debug!(?id, "bytes on the TCP connection of an SMC-R connection");
                let now = core.now();
                if core.ep.abort(id, now).is_ok() {
                    core.stats.tcp_data_aborts += 1;
                    reset.push(id);
                }
            }
        }
        if !reset.is_empty() {
            core.drain();
            for id in reset {
                core.wake(id);
            }
        }
    }
}
