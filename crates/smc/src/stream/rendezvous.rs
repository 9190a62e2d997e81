//! The CLC rendezvous of one TCP connection, client or server side.

use super::*;

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
pub(super) struct Rendezvous {
    stack: Stack,
    pub(super) sock: Arc<TcpStream>,
    id: TcpId,
    client: bool,
    local: Option<SocketAddr>,
    pub(super) peer: SocketAddr,
    /// Signalled when an LLC exchange handled by another thread ends the setup (made only
    /// when the handshake waits for one).
    pub(super) waker: Option<Arc<OwnedFd>>,
    buf: Vec<u8>,
    /// Bytes of the current CLC message not yet read (0: the next read starts a message).
    msg_left: usize,
    /// The handshake ended (its slot now belongs to the stream, or is gone).
    done: bool,
}

/// What the connection's slot says about a handshake.
pub(super) enum Progress {
    /// Still in setup; `answered`: a server that answered the client's Proposal (it waits for
    /// the client's Confirm, or for the CONFIRM RKEY of a new RMB before its Accept).
    Setup { answered: bool },
    /// Over: established, fallen back or failed.
    Ended(io::Result<SmcStream>),
}

impl Rendezvous {
    /// Start the handshake (a client sends its Proposal).
    pub(super) fn start(
        stack: &Stack,
        sock: Arc<TcpStream>,
        client: bool,
        recv_buffer: Option<u32>,
        peer: SocketAddr,
    ) -> io::Result<Box<Rendezvous>> {
        Rendezvous::start_with(stack, sock, client, recv_buffer, peer, None)
    }

    /// [`start`](Self::start); a client with `decline` sends a Decline with that code in
    /// place of its Proposal and falls back at once.
    pub(super) fn start_with(
        stack: &Stack,
        sock: Arc<TcpStream>,
        client: bool,
        recv_buffer: Option<u32>,
        peer: SocketAddr,
        decline: Option<smc_wire::DeclineCode>,
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
            let started = if let (true, Some(code)) = (client, decline) {
                core.ep.connect_declined(id, code, now)
            } else if client {
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
            msg_left: 0,
            done: false,
        }))
    }

    /// Drive the handshake until the connection is established over SMC-R, falls back, or
    /// fails. A server's handshake that waits for the client after answering its Proposal is
    /// offered to `hand_off` first; `None`: taken over (finished elsewhere).
    pub(super) fn run(
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
    pub(super) fn run_for(
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
    pub(super) fn run_handed(
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
    pub(super) fn progress(&mut self) -> io::Result<Progress> {
        let p = self.look()?;
        self.done = matches!(p, Progress::Ended(_));
        Ok(p)
    }

    fn look(&mut self) -> io::Result<Progress> {
        let inner = &self.stack.inner;
        let id = self.id;
        let mut core = inner.lock();
        let state = core.slots.get(&id).map(|s| s.state().clone());
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
    pub(super) fn wait_and_read(&mut self, slice: Option<Duration>) -> io::Result<()> {
        if self.waker.is_some() || slice.is_some() {
            let slice = slice.unwrap_or(RENDEZVOUS_SLICE);
            if !wait_socket_or_waker(&self.sock, self.waker.as_deref(), slice)? {
                return Ok(());
            }
        }
        let Some(want) = self.clc_read_len() else {
            // Part of a CLC header is in; the rest follows at once.
            std::thread::sleep(Duration::from_micros(200));
            return Ok(());
        };
        let (inner, id, client) = (&self.stack.inner, self.id, self.client);
        // Under the core lock, and only while the setup lasts: another thread may have ended
        // it while this one waited (a Decline it sent after a refused CONFIRM RKEY), and what
        // the peer sent after that Decline is the application's data, not CLC: read here, it
        // was lost. The Decline goes out under the same lock, so nothing the peer sent in
        // answer to it can be in the socket while the slot still shows the setup.
        let mut core = inner.lock();
        if !matches!(
            core.slots.get(&id).map(|s| s.state()),
            Some(SlotState::Setup)
        ) {
            return Ok(());
        }
        let read = rustix::net::recv(
            &*self.sock,
            &mut self.buf[..want],
            rustix::net::RecvFlags::DONTWAIT,
        )
        .map(|(n, _)| n)
        .map_err(io::Error::from);
        if let Ok(n) = read {
            self.msg_left = self.msg_left.saturating_sub(n);
        }
        match read {
            Ok(0) => {
                if core.ep.connection(id).is_some() {
                    // The connection was established meanwhile (by an LLC exchange another
                    // thread handled) and the peer has already closed it: a closing peer
                    // shuts its TCP connection down first (a FIN, not a reset), and the
                    // SMC-R close follows over the link. The stream takes it from here.
                    tracing::debug!(?id, client, "TCP FIN right after the handshake");
                } else {
                    // The TCP connection ended before the handshake did: it cannot finish.
                    let now = core.now();
                    core.ep.handle_tcp_reset(id, now);
                }
                core.drain();
            }
            Ok(n) => {
                tracing::debug!(?id, n, client, "CLC bytes");
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
                let now = core.now();
                core.ep.handle_tcp_reset(id, now);
                core.drain();
            }
        }
        Ok(())
    }

    /// How many bytes the next read may take: never past the end of the CLC message it is
    /// in, so that what the peer sends after its last CLC message stays in the socket. A
    /// program under `smc run` reads its own socket after a fallback, not the stream's
    /// leftover: a server that declines and then writes first (a greeting) would otherwise
    /// lose the greeting into the leftover. `None`: part of a header is in, wait for the rest.
    fn clc_read_len(&mut self) -> Option<usize> {
        if self.msg_left > 0 {
            return Some(self.msg_left.min(self.buf.len()));
        }
        // The CLC header: eye catcher (4), type (1), length (2), version and flags (1).
        let mut head = [0u8; 8];
        let mut waited = false;
        loop {
            match rustix::net::recv(
                &*self.sock,
                &mut head,
                rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT,
            ) {
                Ok((8, _)) => {
                    // A length below the header's is malformed: the endpoint rejects the
                    // header.
                    self.msg_left = usize::from(u16::from_be_bytes([head[5], head[6]])).max(8);
                    return Some(self.msg_left.min(self.buf.len()));
                }
                Ok((n, _)) if n > 0 => return None,
                // Nothing yet: wait (within the socket's read timeout) for the first byte
                // without taking it, then look at the header. A read of the whole buffer
                // here would take, with the peer's Decline, the bytes the peer program
                // writes right after it (a greeting) whenever both are in by the time this
                // thread wakes.
                Err(rustix::io::Errno::AGAIN) if !waited => {
                    waited = true;
                    match rustix::net::recv(
                        &*self.sock,
                        &mut head[..1],
                        rustix::net::RecvFlags::PEEK,
                    ) {
                        Ok((1, _)) => {}
                        // The read timeout: look again on the next turn.
                        Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => return None,
                        // End of stream or an error: the read tells.
                        _ => return Some(self.buf.len()),
                    }
                }
                // End of stream or an error: the read tells.
                _ => return Some(self.buf.len()),
            }
        }
    }

    /// This thread cannot go on with the handshake (no eventfd, a failed poll): end it as
    /// if the TCP connection broke, and let go of the slot.
    pub(super) fn abandon(&mut self, e: io::Error) -> io::Error {
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
pub(super) fn finish(result: io::Result<SmcStream>) -> io::Result<SmcStream> {
    let stream = result?;
    stream.sock.set_read_timeout(None)?;
    if stream.stack.config().nodelay {
        stream.set_nodelay(true)?;
    }
    Ok(stream)
}
