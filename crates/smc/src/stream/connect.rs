//! The client side: connect, the rendezvous it starts, and the fallback to TCP.

use super::*;

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
        SmcStream::connect_socket_declining(stack, fd, addr, timeout, recv_buffer, None)
    }

    /// [`connect_socket`](Self::connect_socket); `decline`: when discovery found SMC-R on
    /// both ends, a Decline with this code in place of the Proposal, and TCP (for a program
    /// that connects to its own listener and accepts only after `connect` returned: it
    /// cannot wait for the server's answer).
    pub(crate) fn connect_socket_declining(
        stack: &Stack,
        fd: OwnedFd,
        addr: SocketAddr,
        timeout: Option<Duration>,
        recv_buffer: Option<u32>,
        decline: Option<smc_wire::DeclineCode>,
    ) -> io::Result<SmcStream> {
        if let Some(b) = recv_buffer {
            // The TCP receive buffer too, for a fallback (best effort: the kernel clamps it).
            let _ = rustix::net::sockopt::set_socket_recv_buffer_size(&fd, b as usize);
        }
        let (sock, offered) = connect_discovered(stack, fd, addr, timeout)?;
        match offered {
            Ok(()) => handed(
                Rendezvous::start_with(stack, sock, true, recv_buffer, addr, decline)?
                    .run(&mut |r| Err(r)),
            ),
            Err(reason) => Ok(SmcStream::fallback(stack, sock, reason, Vec::new(), false)),
        }
    }

    /// [`connect_socket_declining`](Self::connect_socket_declining) up to the Proposal: the
    /// TCP connection made, discovery asked and the Proposal sent (or the Decline in its
    /// place), then `Waiting` with the handshake when the server's answer is not in yet.
    /// The caller finishes it ([`ClientRendezvous::advance`]) when it likes: a program whose
    /// server accepts only after the client used another connection (FTP's data
    /// connections) gets its `connect` back before the server's Accept.
    pub(crate) fn connect_socket_started(
        stack: &Stack,
        fd: OwnedFd,
        addr: SocketAddr,
        decline: Option<smc_wire::DeclineCode>,
    ) -> io::Result<ClientStart> {
        let (sock, offered) = connect_discovered(stack, fd, addr, None)?;
        if let Err(reason) = offered {
            return Ok(ClientStart::Ended(SmcStream::fallback(
                stack,
                sock,
                reason,
                Vec::new(),
                false,
            )));
        }
        let r = Rendezvous::start_with(stack, sock, true, None, addr, decline)?;
        let mut c = ClientRendezvous(Some(r));
        Ok(match c.advance(Duration::ZERO) {
            Some(r) => ClientStart::Ended(r?),
            None => ClientStart::Waiting(c),
        })
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
    pub(super) fn with_defaults(
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
            spin: Box::new(AdaptiveSpin::for_stack(
                stack.config().adaptive_spin,
                &stack.inner,
            )),
            last_read: 1,
            nodelay: Default::default(),
            urgent_slot: None,
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
        handed(Rendezvous::start(stack, sock, client, recv_buffer, peer)?.run(&mut |r| Err(r)))
    }
}

/// What [`SmcStream::connect_socket_started`] got to.
#[derive(Debug)]
pub(crate) enum ClientStart {
    /// The connection is set up (SMC-R) or on TCP (fallback, or the Decline in place of the
    /// Proposal).
    Ended(SmcStream),
    /// The Proposal is out; the server's answer is not in yet.
    Waiting(ClientRendezvous),
}

/// A client's CLC handshake whose Proposal is out, finished in steps by its owner.
#[derive(Debug)]
pub(crate) struct ClientRendezvous(Option<Box<Rendezvous>>);

impl ClientRendezvous {
    /// Drive the handshake for at most `limit` (zero: only look whether it ended, e.g. by
    /// the stack's `accept_wait` Decline): `Some` with what it ended in, `None` while it
    /// still waits for the server. Waits on the socket with `poll` in slices, so the
    /// socket's O_NONBLOCK flag (the program's) does not matter.
    pub(crate) fn advance(&mut self, limit: Duration) -> Option<io::Result<SmcStream>> {
        let Some(r) = self.0.take() else {
            return Some(Err(io::Error::other("rendezvous already ended")));
        };
        match r.run_for(&mut |r| Err(r), Some(limit)) {
            Ok(r) => Some(handed(r)),
            Err(back) => {
                self.0 = Some(back);
                None
            }
        }
    }

    /// The connection's TCP socket (the stack's duplicate of it).
    pub(crate) fn socket(&self) -> Option<&TcpStream> {
        self.0.as_ref().map(|r| &*r.sock)
    }
}

/// The end of a rendezvous run that hands off nothing.
fn handed(r: Option<io::Result<SmcStream>>) -> io::Result<SmcStream> {
    r.unwrap_or_else(|| Err(io::Error::other("rendezvous handed off")))
}

/// TCP connect of `fd` to `addr` with the discovery's marks around it: the socket, and
/// whether both ends offered SMC-R (else why not).
fn connect_discovered(
    stack: &Stack,
    fd: OwnedFd,
    addr: SocketAddr,
    timeout: Option<Duration>,
) -> io::Result<(Arc<TcpStream>, Result<(), FallbackReason>)> {
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
    Ok((sock, offered))
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
