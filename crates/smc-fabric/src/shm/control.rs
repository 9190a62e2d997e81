//! The per-device control thread: accepts QP connections, answers ring and memory-region
//! requests, and turns closed connections into QP errors.

use super::device::{lock, DeviceCore};
use super::mem;
use super::qp::QpShared;
use super::wire::{self, Msg, Received};
use crate::error::{FabricError, Result};
use crate::types::{AccessFlags, QpState};
use rustix::event::{PollFd, PollFlags};
use rustix::fd::{AsFd, OwnedFd};
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// An outgoing QP connection the control thread watches for hang-up (the QP's own thread uses
/// the socket for requests; the control thread never reads from it).
pub(crate) struct Watch {
    pub(crate) qpn: u32,
    pub(crate) sock: Arc<OwnedFd>,
}

/// A connection accepted from a peer: requests arrive here.
struct Incoming {
    sock: OwnedFd,
    /// Local QP this connection was bound to by its Hello.
    qpn: Option<u32>,
}

/// Create the device's listening SEQPACKET socket at `path`.
pub(crate) fn listen(path: &Path) -> Result<OwnedFd> {
    let _ = std::fs::remove_file(path);
    let sock = crate::fdplace::make(|| {
        rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )
    })
    .map_err(|e| FabricError::os("socket", e))?;
    let short = crate::sockpath::SocketPath::new(path)?;
    let addr =
        SocketAddrUnix::new(short.as_path()).map_err(|e| FabricError::os("socket path", e))?;
    rustix::net::bind(&sock, &addr).map_err(|e| FabricError::os("bind device socket", e))?;
    drop(short);
    if let Some(dir) = path.parent() {
        // Reachable by the users the directory is granted to (`crate::access`).
        if let Err(e) = crate::access::share_socket(path, dir) {
            tracing::debug!(%e, path = %path.display(), "device socket not shared");
        }
    }
    rustix::net::listen(&sock, 128).map_err(|e| FabricError::os("listen", e))?;
    Ok(sock)
}

/// Connect to a peer device socket (blocking, with send/receive timeouts).
pub(crate) fn connect(path: &Path) -> Result<OwnedFd> {
    let sock = crate::fdplace::make(|| {
        rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
    })
    .map_err(|e| FabricError::os("socket", e))?;
    let short = crate::sockpath::SocketPath::new(path)?;
    let addr = SocketAddrUnix::new(short.as_path())
        .map_err(|e| FabricError::PeerUnreachable(e.to_string()))?;
    rustix::net::connect(&sock, &addr).map_err(|e| FabricError::PeerUnreachable(e.to_string()))?;
    for t in [
        rustix::net::sockopt::Timeout::Recv,
        rustix::net::sockopt::Timeout::Send,
    ] {
        rustix::net::sockopt::set_socket_timeout(&sock, t, Some(REQUEST_TIMEOUT))
            .map_err(|e| FabricError::os("socket timeout", e))?;
    }
    Ok(sock)
}

/// Longest wait for a peer's answer to a control request.
pub(crate) const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// Body of the control thread.
pub(crate) fn run(core: Arc<DeviceCore>, listener: OwnedFd) {
    let mut incoming: Vec<Incoming> = Vec::new();
    let mut watches: Vec<Watch> = Vec::new();
    loop {
        let n_in = incoming.len();
        let revents: Vec<PollFlags> = {
            let mut fds = Vec::with_capacity(2 + n_in + watches.len());
            fds.push(PollFd::new(&core.wake, PollFlags::IN));
            fds.push(PollFd::new(&listener, PollFlags::IN));
            for c in &incoming {
                fds.push(PollFd::new(&c.sock, PollFlags::IN | PollFlags::RDHUP));
            }
            for w in &watches {
                fds.push(PollFd::new(&*w.sock, PollFlags::RDHUP));
            }
            match rustix::event::poll(&mut fds, None) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => {
                    tracing::error!(error = %e, "fabric control poll failed");
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
            }
            fds.iter().map(|f| f.revents()).collect()
        };
        // Drain the wake-up before checking for shutdown: a wake-up drained after the check
        // could be the shutdown's own, and the next poll would then sleep forever.
        if !revents[0].is_empty() {
            mem::drain_eventfd(&core.wake);
        }
        if core.shutdown.load(Ordering::Acquire) {
            break;
        }
        if !revents[0].is_empty() {
            watches.append(&mut lock(&core.inbox));
        }
        // Hang-ups of outgoing connections.
        let mut dead_qps: Vec<u32> = Vec::new();
        for (i, w) in watches.iter().enumerate() {
            if let Some(ev) = revents.get(2 + n_in + i) {
                if ev.intersects(
                    PollFlags::HUP | PollFlags::RDHUP | PollFlags::ERR | PollFlags::NVAL,
                ) {
                    dead_qps.push(w.qpn);
                }
            }
        }
        // Requests and hang-ups of incoming connections.
        let mut closed = vec![false; n_in];
        for i in 0..n_in {
            let ev = revents[2 + i];
            if ev.is_empty() {
                continue;
            }
            if ev.contains(PollFlags::IN) {
                // Drain every queued request before acting on a hang-up.
                loop {
                    match wire::recv(incoming[i].sock.as_fd()) {
                        Ok(Received::Msg(msg, fds)) => {
                            if let Err(e) = handle_request(&core, &mut incoming[i], msg, fds) {
                                tracing::debug!(error = %e, "dropping peer connection");
                                closed[i] = true;
                                break;
                            }
                        }
                        Ok(Received::WouldBlock) => break,
                        Ok(Received::Closed) | Err(_) => {
                            closed[i] = true;
                            break;
                        }
                    }
                }
            } else if ev
                .intersects(PollFlags::HUP | PollFlags::RDHUP | PollFlags::ERR | PollFlags::NVAL)
            {
                closed[i] = true;
            }
        }
        for (i, c) in incoming.iter().enumerate() {
            if closed[i] {
                if let Some(q) = c.qpn {
                    dead_qps.push(q);
                }
            }
        }
        let mut i = 0;
        incoming.retain(|_| {
            let keep = !closed[i];
            i += 1;
            keep
        });
        for qpn in dead_qps {
            if let Some(qp) = lookup(&core, qpn) {
                qp.enter_error("peer connection closed");
            }
        }
        // New connections.
        if revents[1].contains(PollFlags::IN) {
            loop {
                // (Nonblocking: made and placed while the program's closes wait.)
                match crate::fdplace::make(|| {
                    rustix::net::accept_with(
                        &listener,
                        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
                    )
                }) {
                    Ok(sock) => incoming.push(Incoming { sock, qpn: None }),
                    Err(rustix::io::Errno::INTR) => continue,
                    Err(_) => break,
                }
            }
        }
        // Forget connections of QPs that are gone or in error (closing them tells the peer).
        incoming.retain(|c| match c.qpn {
            None => true,
            Some(q) => lookup(&core, q).is_some_and(|qp| qp.state() != QpState::Error),
        });
        watches.retain(|w| lookup(&core, w.qpn).is_some_and(|qp| qp.state() != QpState::Error));
    }
}

fn lookup(core: &DeviceCore, qpn: u32) -> Option<Arc<QpShared>> {
    lock(&core.qps).get(&qpn).and_then(|w| w.upgrade())
}

fn refuse(conn: &Incoming, reason: u32) -> Result<()> {
    wire::send(conn.sock.as_fd(), &Msg::Refused { reason }, &[])
}

/// Answer one request on an incoming connection. An error closes the connection.
fn handle_request(
    core: &DeviceCore,
    conn: &mut Incoming,
    msg: Msg,
    mut fds: Vec<OwnedFd>,
) -> Result<()> {
    match (msg, conn.qpn) {
        (
            Msg::Hello {
                src_gid,
                src_qpn,
                dst_qpn,
            },
            None,
        ) => {
            let Some(qp) = lookup(core, dst_qpn) else {
                refuse(conn, wire::REFUSE_NO_QP)?;
                return Err(FabricError::PeerViolation("hello for unknown QP"));
            };
            if fds.len() != 1 {
                return Err(FabricError::PeerViolation("hello without doorbell fd"));
            }
            let peer_bell =
                mem::make_peer_bell(fds.pop().ok_or(FabricError::PeerViolation("hello fd"))?)?;
            if !core.port_up.load(Ordering::Acquire) {
                refuse(conn, wire::REFUSE_STATE)?;
                return Err(FabricError::PortDown);
            }
            match qp.accept_peer(src_gid, src_qpn, peer_bell) {
                Ok(()) => {}
                Err(reason) => {
                    refuse(conn, reason)?;
                    return Err(FabricError::PeerViolation("hello refused"));
                }
            }
            conn.qpn = Some(dst_qpn);
            let reply = Msg::HelloOk {
                capacity: qp.inbound_capacity(),
            };
            wire::send(
                conn.sock.as_fd(),
                &reply,
                &[qp.inbound_memfd(), qp.rx_bell()],
            )
        }
        (Msg::MrRequest { rkey }, Some(qpn)) => {
            let Some(qp) = lookup(core, qpn) else {
                return Err(FabricError::PeerViolation("QP gone"));
            };
            if !matches!(qp.state(), QpState::Rtr | QpState::Rts) || !qp.peer_confirmed() {
                return refuse(conn, wire::REFUSE_STATE);
            }
            let mr = {
                let mrs = lock(&core.mrs);
                let mr = mrs.get(&rkey).cloned();
                if let Some(m) = mr.as_ref().filter(|m| m.pd == qp.pd) {
                    m.note_grant(qpn);
                }
                mr
            };
            match mr {
                Some(mr) if mr.pd == qp.pd && mr.access.contains(AccessFlags::REMOTE_WRITE) => {
                    let grant = Msg::MrGrant {
                        rkey,
                        vaddr: mr.vaddr(),
                        len: mr.len() as u64,
                    };
                    wire::send(conn.sock.as_fd(), &grant, &[mr.memfd.as_fd()])
                }
                _ => refuse(conn, wire::REFUSE_ACCESS),
            }
        }
        _ => Err(FabricError::PeerViolation("unexpected control message")),
    }
}
