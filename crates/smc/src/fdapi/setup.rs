//! Setting a program's TCP socket up: a listener marked for discovery, an accepted
//! connection's server rendezvous (or its Decline when none can run here), a client's
//! connect; the result is an SMC-R [`Conn`] or a [`TcpConn`] (fallback).

use super::*;

/// A listening socket whose port the eBPF discovery of the stack that marked it knows.
#[derive(Debug, Clone)]
pub struct Listening {
    stack: Stack,
    port: u16,
}

/// Mark the port `fd` is bound to for discovery (call before `listen()`); `None` when
/// discovery is off (every accepted connection stays TCP).
pub fn listen_mark(fd: BorrowedFd<'_>) -> io::Result<Option<Listening>> {
    let stack = stack()?;
    let local = local_addr(fd)?;
    match (&stack.inner.discovery, stack.discovery_mode()) {
        (Some(d), DiscoveryMode::Ebpf) => {
            d.mark_listener(local.port()).map_err(io::Error::other)?;
            Ok(Some(Listening {
                stack: stack.clone(),
                port: local.port(),
            }))
        }
        // Assert-peer: every client is taken to speak SMC-R (the server waits for its
        // Proposal at the rendezvous).
        (_, DiscoveryMode::AssertPeer) => Ok(Some(Listening {
            stack: stack.clone(),
            port: local.port(),
        })),
        _ => Ok(None),
    }
}

impl Listening {
    /// The port marked.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// For the connection `fd` just accepted on this listener: whether both SYN and SYN-ACK
    /// carried the SMC option, so that the server rendezvous ([`setup_server`]) follows. Asks
    /// the map of the stack that marked the port (in a forked worker, the parent's; the map
    /// is a kernel object both share).
    pub fn accepted(&self, fd: BorrowedFd<'_>) -> io::Result<bool> {
        match (&self.stack.inner.discovery, self.stack.discovery_mode()) {
            (Some(d), DiscoveryMode::Ebpf) => {
                let local = local_addr(fd)?;
                let peer = peer_addr(fd)?;
                Ok(matches!(
                    d.server_outcome(local, peer),
                    Ok(Outcome::BothOffered)
                ))
            }
            (_, DiscoveryMode::AssertPeer) => Ok(true),
            _ => Ok(false),
        }
    }
}

/// What a rendezvous ended in.
#[derive(Debug)]
pub enum Setup {
    /// SMC-R: the program's I/O on the socket goes through the [`Conn`].
    Smc(Arc<Conn>),
    /// TCP: the program uses its socket as it is; the [`TcpConn`] only keeps the connection
    /// listed (`smc ss`) and counted until the program closes it.
    Tcp(TcpConn),
}

/// A connection that stayed on (or fell back to) TCP.
#[derive(Debug)]
pub struct TcpConn {
    stream: SmcStream,
    /// CLC messages of the peer that crossed our Decline and may still be in front of its
    /// data in the program's socket (0: none; see `crate::crossing`).
    crossing: std::sync::atomic::AtomicU8,
    /// Held while they are being taken out (one reader at a time).
    stripping: Mutex<()>,
}

impl TcpConn {
    fn new(stream: SmcStream) -> TcpConn {
        let left = if stream.strips_crossing() {
            crate::crossing::MAX_CROSSING
        } else {
            0
        };
        TcpConn {
            stream,
            crossing: std::sync::atomic::AtomicU8::new(left),
            stripping: Mutex::new(()),
        }
    }

    /// Why it is TCP.
    pub fn mode(&self) -> Mode {
        self.stream.mode()
    }

    /// Whether the peer's CLC messages that crossed our Decline may still be in front of
    /// its data (then [`TcpConn::strip_crossed`] must run before the program reads).
    pub fn strips_crossed(&self) -> bool {
        self.crossing.load(Ordering::Acquire) > 0
    }

    /// Take the peer's CLC messages that crossed our Decline out of the front of the
    /// program's socket `fd`, before the program reads it. Both ends of a first contact may
    /// decline at once during the LLC negotiation (RFC 7609 C.2): two stacks that cannot
    /// reach each other's fabric (programs of two users, each with a fabric directory of
    /// its own) both failed the link and declined, and each program read the other's
    /// 28-byte Decline as data. `wait`: the program's read would block (then this waits for
    /// the first bytes too); otherwise an empty socket gives `WouldBlock`, so that a
    /// message arriving after this look is never handed to the program.
    pub fn strip_crossed(&self, fd: BorrowedFd<'_>, wait: bool) -> io::Result<()> {
        use crate::crossing::{classify, Leading};
        use rustix::net::RecvFlags;
        let _one = self.stripping.lock().unwrap_or_else(|p| p.into_inner());
        // Longer than any CLC message this stack parses (a v2 Proposal is the longest).
        let mut buf = [0u8; 4096];
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while self.crossing.load(Ordering::Acquire) > 0 {
            let mut flags = RecvFlags::PEEK;
            if !wait {
                flags |= RecvFlags::DONTWAIT;
            }
            let n = rustix::net::recv(fd, &mut buf[..], flags)?.0;
            let done = || self.crossing.store(0, Ordering::Release);
            if n == 0 {
                done();
                break;
            }
            match classify(&buf[..n]) {
                Leading::Data => done(),
                Leading::Clc(len) => {
                    let mut got = 0;
                    while got < len {
                        got += rustix::net::recv(fd, &mut buf[got..len], RecvFlags::empty())?.0;
                    }
                    tracing::debug!(len, "dropped a CLC message that crossed our Decline");
                    self.crossing.fetch_sub(1, Ordering::AcqRel);
                }
                // (The rest of a message sent in one write is on its way.)
                Leading::NeedMore if n < buf.len() && std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                Leading::NeedMore => done(),
            }
        }
        Ok(())
    }
}

/// Record that the accepted connection `fd` stays on TCP because its client did not offer
/// SMC-R (listed by `smc ss`, counted as a fallback).
pub fn accepted_tcp(fd: BorrowedFd<'_>) -> io::Result<TcpConn> {
    let stack = stack()?;
    let sock = Arc::new(dup_stream(fd)?);
    let reason = match stack.discovery_mode() {
        DiscoveryMode::Ebpf => FallbackReason::PeerWithoutOption,
        _ => FallbackReason::DiscoveryOff,
    };
    let was = oobinline(fd);
    let stream = SmcStream::fallback(&stack, sock, reason, Vec::new(), true);
    set_oobinline(fd, was);
    Ok(TcpConn::new(stream))
}

/// SO_OOBINLINE of the program's socket. A stream that falls back turns it on (its own API
/// delivers urgent data in line, as over SMC-R); the program's TCP connection keeps the
/// program's setting, so its urgent data stays out of band (`recv(MSG_OOB)`), as TCP's.
fn oobinline(fd: BorrowedFd<'_>) -> bool {
    rustix::net::sockopt::socket_oobinline(fd).unwrap_or(false)
}

fn set_oobinline(fd: BorrowedFd<'_>, on: bool) {
    let _ = rustix::net::sockopt::set_socket_oobinline(fd, on);
}

/// The server rendezvous of the accepted connection `fd` (whose client offered SMC-R), in
/// this process's stack. The socket must be in blocking mode for the call (the rendezvous
/// reads the client's CLC messages from it).
pub fn setup_server(fd: BorrowedFd<'_>) -> io::Result<Setup> {
    // When no stack or no descriptor can be made here, the client (which offered SMC-R and
    // waits for the server's CLC answer) is declined, so that both ends use the TCP
    // connection; otherwise it would read the program's first bytes as a CLC message.
    let made = stack().and_then(|s| Ok((s, dup_stream(fd)?)));
    let (stack, sock) = match made {
        Ok((stack, sock)) => (stack, Arc::new(sock)),
        Err(e) => {
            return Err(match decline_unserved(fd) {
                Ok(true) => io::Error::new(e.kind(), format!("{e} (the client was declined)")),
                _ => e,
            });
        }
    };
    let peer = sock.peer_addr()?;
    let was = oobinline(fd);
    if stack.discovery_mode() == DiscoveryMode::Ebpf {
        if let Some(reason) = leading_decline(&sock, stack.config().clc_timeout)? {
            let stream = SmcStream::fallback(&stack, sock, reason, Vec::new(), true);
            set_oobinline(fd, was);
            return Ok(Setup::Tcp(TcpConn::new(stream)));
        }
    }
    let s = SmcStream::rendezvous(&stack, sock, false, None, peer)?;
    set_oobinline(fd, was);
    Setup::of(s)
}

/// Settle the accepted connection `fd` (whose client offered SMC-R) as TCP without a
/// rendezvous, for a program that hands the socket to another one before using it (sshd
/// re-executes itself with the connection on its standard input; the new image has no
/// table and would read the client's CLC messages as its own data). The client's first CLC
/// message is waited for (at most the CLC timeout) and read whole; a Proposal is answered
/// with a Decline (`EXECED`, of the Proposal's version), after which both ends use the TCP
/// connection as it is. A leading Decline of the client (a connection to a listener of its
/// own process) needs no answer. Anything else is left in the socket. Returns whether a
/// Decline was sent.
pub fn decline_accepted(fd: BorrowedFd<'_>) -> io::Result<bool> {
    decline_client(fd, smc_wire::DeclineCode::EXECED)
}

/// Answer the client of the accepted connection `fd` with a Decline (`CLONED`), as
/// [`decline_accepted`] does: the process that uses it first was made by a raw `clone`
/// (vsftpd's session processes), which runs no fork handlers, so a connection it owned could
/// not be relayed to the processes it clones in turn (vsftpd's, in a new network namespace
/// with no descriptors left to open).
pub fn decline_cloned(fd: BorrowedFd<'_>) -> io::Result<bool> {
    decline_client(fd, smc_wire::DeclineCode::CLONED)
}

/// Answer the client of the accepted connection `fd` with a Decline (`PASSED`), as
/// [`decline_accepted`] does: the program passes the connection to another process
/// (SCM_RIGHTS) before its first use (vsftpd's privileged process accepts a passive data
/// connection and hands it to the session process), which has no entry for it and would use
/// it as TCP while the client waited for an Accept.
pub fn decline_passed(fd: BorrowedFd<'_>) -> io::Result<bool> {
    decline_client(fd, smc_wire::DeclineCode::PASSED)
}

/// Answer the client of the accepted connection `fd`, whose server rendezvous failed here
/// (the client offered SMC-R and waits for the server's CLC answer), with a Decline
/// (`INTERR`), as [`decline_accepted`] does. Works on the
/// program's descriptor itself and needs no stack (without one the Decline carries a zero
/// peer ID, as Linux's without a device): the server rendezvous may have failed because
/// none can be made here (vsftpd's session process has RLIMIT_NOFILE 0, a chroot, another
/// network namespace and another uid).
fn decline_unserved(fd: BorrowedFd<'_>) -> io::Result<bool> {
    decline_client(fd, smc_wire::DeclineCode::INTERR)
}

fn decline_client(fd: BorrowedFd<'_>, code: smc_wire::DeclineCode) -> io::Result<bool> {
    let have = STACK.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let (peer_id, wait) = match &have {
        Some(s) => (s.peer_id(), s.config().clc_timeout),
        None => (
            smc_wire::PeerId::from_bytes([0; 8]),
            crate::StackConfig::from_env()
                .map(|c| c.clc_timeout)
                .unwrap_or(std::time::Duration::from_secs(30)),
        ),
    };
    let sock = fd;
    let deadline = std::time::Instant::now() + wait;
    // The CLC header: eye catcher (4), type (1), length (2), version and flags (1).
    let mut msg = vec![0u8; 8];
    loop {
        let n = match rustix::net::recv(
            sock,
            &mut msg,
            rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT,
        ) {
            Ok((n, _)) => n,
            Err(rustix::io::Errno::AGAIN) => 0,
            Err(e) => return Err(e.into()),
        };
        if n == msg.len() && msg.len() == 8 {
            let len = usize::from(u16::from_be_bytes([msg[5], msg[6]]));
            if !(8..=4096).contains(&len) {
                return Ok(false);
            }
            msg.resize(len, 0);
            continue;
        }
        if n == msg.len() {
            break;
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Ok(false);
        }
        if n > 0 {
            // Part of the message is in (poll would not wait): the rest follows at once.
            std::thread::sleep(left.min(std::time::Duration::from_millis(1)));
            continue;
        }
        let mut fds = [rustix::event::PollFd::new(
            &sock,
            rustix::event::PollFlags::IN,
        )];
        let ts = rustix::event::Timespec {
            tv_sec: left.as_secs() as i64,
            tv_nsec: i64::from(left.subsec_nanos()),
        };
        match rustix::event::poll(&mut fds, Some(&ts)) {
            Ok(0) => return Ok(false),
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    let decline = match smc_wire::ClcMessage::parse(&msg) {
        Ok((smc_wire::ClcMessage::Proposal(_), _)) if msg[7] >> 4 >= 2 => {
            Some(smc_wire::Decline::new_v2(peer_id, code, false))
        }
        Ok((smc_wire::ClcMessage::Proposal(_), _)) => {
            Some(smc_wire::Decline::new(peer_id, code, false))
        }
        Ok((smc_wire::ClcMessage::Decline(d), _)) if !d.out_of_sync => None,
        _ => return Ok(false),
    };
    let mut got = 0;
    while got < msg.len() {
        match rustix::net::recv(sock, &mut msg[got..], rustix::net::RecvFlags::empty())?.0 {
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            n => got += n,
        }
    }
    let Some(d) = decline else {
        return Ok(false);
    };
    //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.1.2
    //# If the server cannot or does not want to do SMC-R with the client, it sends
    //# an SMC Decline CLC message to the client
    let mut out = vec![0u8; d.buffer_len()];
    d.emit(&mut out).map_err(io::Error::other)?;
    let mut sent = 0;
    while sent < out.len() {
        sent += rustix::net::send(sock, &out[sent..], rustix::net::SendFlags::NOSIGNAL)?;
    }
    drop_crossed_decline(sock)?;
    Ok(true)
}

/// A client that waited in vain for an answer to its Proposal declined in place of the
/// Accept (`NOACCEPT`, after `accept_wait`) before the program here accepted and this
/// Decline went out: its Decline is in the socket now, behind the Proposal. Read it (whole,
/// if it is there), so that the program that gets the socket finds the client's bytes at its
/// front, and its close does not reset the connection over unread CLC bytes.
fn drop_crossed_decline(sock: BorrowedFd<'_>) -> io::Result<()> {
    // A version 2 Decline is the longer one (44 bytes).
    let mut buf = [0u8; 44];
    let n = match rustix::net::recv(
        sock,
        &mut buf,
        rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT,
    ) {
        Ok((n, _)) => n,
        Err(rustix::io::Errno::AGAIN) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    if let Ok((smc_wire::ClcMessage::Decline(_), len)) = smc_wire::ClcMessage::parse(&buf[..n]) {
        let mut got = 0;
        while got < len {
            match rustix::net::recv(sock, &mut buf[got..len], rustix::net::RecvFlags::empty())?.0 {
                0 => break,
                k => got += k,
            }
        }
    }
    Ok(())
}

/// Whether the client's first CLC message, waited for (at most `wait`: it offered SMC-R, so
/// one comes), is a Decline in place of its Proposal (a client that connects to a listener
/// of its own process, [`connect`]): then exactly its bytes are read, so that what the
/// client wrote after it stays in the socket for the program (the rendezvous would read
/// them with the Decline, and the program reads its own socket, not the stream's leftover).
/// A Decline with the S flag (out of sync) goes to the rendezvous, which acts on it.
fn leading_decline(
    sock: &TcpStream,
    wait: std::time::Duration,
) -> io::Result<Option<FallbackReason>> {
    let mut fds = [rustix::event::PollFd::new(
        sock,
        rustix::event::PollFlags::IN,
    )];
    let ts = rustix::event::Timespec {
        tv_sec: wait.as_secs() as i64,
        tv_nsec: i64::from(wait.subsec_nanos()),
    };
    match rustix::event::poll(&mut fds, Some(&ts)) {
        Ok(0) | Err(rustix::io::Errno::INTR) => return Ok(None),
        Ok(_) => {}
        Err(e) => return Err(e.into()),
    }
    // A version-2 Decline is 44 bytes, a version-1 one 28.
    let mut head = [0u8; 64];
    let n = rustix::net::recv(
        sock,
        &mut head,
        rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT,
    )
    .map_or(0, |(n, _)| n);
    let Ok((smc_wire::ClcMessage::Decline(d), len)) = smc_wire::ClcMessage::parse(&head[..n])
    else {
        return Ok(None);
    };
    if d.out_of_sync || len > n {
        return Ok(None);
    }
    let mut used = vec![0u8; len];
    (&*sock).read_exact(&mut used)?;
    Ok(Some(FallbackReason::PeerDeclined {
        code: d.diagnosis,
        out_of_sync: false,
    }))
}

/// Connect the program's socket `fd` (unconnected, blocking for the call) to `addr`:
/// TCP connect, discovery, then the rendezvous or the fallback. `own_listener`: `addr` is a
/// listener of the calling process, which may accept only after `connect` returned (as TCP
/// lets it: the kernel's backlog holds the connection); the client cannot wait for the
/// server's answer then, so it declines in place of its Proposal and the connection stays
/// TCP (the server, whenever it comes to it, reads the Decline: [`setup_server`]).
pub fn connect(fd: BorrowedFd<'_>, addr: SocketAddr, own_listener: bool) -> io::Result<Setup> {
    let stack = stack()?;
    let dup: OwnedFd = smc_fabric::fdplace::dup_placed(fd)?;
    let decline = own_listener.then_some(smc_wire::DeclineCode::NOACCEPT);
    let was = oobinline(fd);
    let s = SmcStream::connect_socket_declining(&stack, dup, addr, None, None, decline)?;
    set_oobinline(fd, was);
    Setup::of(s)
}

/// What [`connect_start`] got to.
#[derive(Debug)]
pub enum Connecting {
    /// Set up: SMC-R, or TCP (the peer did not offer SMC-R, the server answered at once
    /// with a Decline, or the Decline in place of the Proposal).
    Done(Setup),
    /// The Proposal is out and the server's answer not in yet: finish it with
    /// [`ClientHandshake::advance`].
    Waiting(ClientHandshake),
}

/// A client's CLC handshake whose Proposal is out (see [`connect_start`]).
#[derive(Debug)]
pub struct ClientHandshake {
    rendezvous: crate::stream::ClientRendezvous,
    /// The program's SO_OOBINLINE (a fallback turns it on; put back at the end).
    oobinline: bool,
}

impl ClientHandshake {
    /// Drive the handshake for at most `limit` (`None`: until it ends; zero: only look
    /// whether it ended, as when the stack's `accept_wait` Decline ended it): `Ok(Some)`
    /// with the connection it ended in, `Ok(None)` while the server's answer is still
    /// missing. Works whatever the socket's O_NONBLOCK flag (it waits with `poll`).
    pub fn advance(&mut self, limit: Option<std::time::Duration>) -> io::Result<Option<Setup>> {
        const STEP: std::time::Duration = std::time::Duration::from_secs(1);
        let start = std::time::Instant::now();
        loop {
            let step = match limit {
                Some(l) => l.saturating_sub(start.elapsed()),
                None => STEP,
            };
            if let Some(r) = self.rendezvous.advance(step) {
                let s = r?;
                set_oobinline(s.socket_fd(), self.oobinline);
                return Setup::of(s).map(Some);
            }
            if limit.is_some() {
                return Ok(None);
            }
        }
    }

    /// Whether the server's answer (or anything else) is waiting in the socket: the
    /// handshake would go on at once.
    pub fn answered(&self) -> bool {
        let Some(sock) = self.rendezvous.socket() else {
            return true;
        };
        let mut b = [0u8; 1];
        !matches!(
            rustix::net::recv(
                sock,
                &mut b,
                rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT
            ),
            Err(rustix::io::Errno::AGAIN)
        )
    }
}

/// [`connect`] that returns once the Proposal is out when the server's answer takes longer
/// than `wait`: the caller finishes the handshake later ([`ClientHandshake::advance`]) — at
/// the program's first use of the connection, or in a thread of its own as soon as the
/// answer arrives. A server program that accepts a connection only after its client used
/// another one (FTP: the client connects the data connection, then sends RETR on the
/// control connection; the server accepts after RETR) answers only then.
pub fn connect_start(
    fd: BorrowedFd<'_>,
    addr: SocketAddr,
    own_listener: bool,
    wait: std::time::Duration,
) -> io::Result<Connecting> {
    let stack = stack()?;
    let dup: OwnedFd = smc_fabric::fdplace::dup_placed(fd)?;
    let decline = own_listener.then_some(smc_wire::DeclineCode::NOACCEPT);
    let was = oobinline(fd);
    match SmcStream::connect_socket_started(&stack, dup, addr, decline)? {
        crate::stream::ClientStart::Ended(s) => {
            set_oobinline(fd, was);
            Setup::of(s).map(Connecting::Done)
        }
        crate::stream::ClientStart::Waiting(rendezvous) => {
            let mut h = ClientHandshake {
                rendezvous,
                oobinline: was,
            };
            Ok(match h.advance(Some(wait))? {
                Some(setup) => Connecting::Done(setup),
                None => Connecting::Waiting(h),
            })
        }
    }
}

impl Setup {
    fn of(s: SmcStream) -> io::Result<Setup> {
        match s.smc_id() {
            None => Ok(Setup::Tcp(TcpConn::new(s))),
            Some(id) => Conn::new(s, id).map(|c| Setup::Smc(Arc::new(c))),
        }
    }
}

fn dup_stream(fd: BorrowedFd<'_>) -> io::Result<TcpStream> {
    let dup: OwnedFd = smc_fabric::fdplace::dup_placed(fd)?;
    Ok(TcpStream::from(dup))
}

fn local_addr(fd: BorrowedFd<'_>) -> io::Result<SocketAddr> {
    SocketAddr::try_from(rustix::net::getsockname(fd)?)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "not an inet socket"))
}

fn peer_addr(fd: BorrowedFd<'_>) -> io::Result<SocketAddr> {
    rustix::net::getpeername(fd)?
        .and_then(|a| SocketAddr::try_from(a).ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotConnected, "no inet peer"))
}
