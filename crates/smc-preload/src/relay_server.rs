//! The relay server's thread (a part of `relay.rs`): it accepts on this process's relay
//! address and on the names of its passed connections (`pass.rs`), and answers each request
//! — a relay ([`ASK`]), a pass ([`pass::PASS`], [`pass::UNPASS`]), a look-up
//! ([`pass::LOOKUP`]).
//!
//! **No requester holds up another.** Whoever can connect to a name (anyone, when the owner
//! runs as root: the credentials are checked, but only after the connect) could send
//! nothing, and a thread that waited for the request of each in turn (1 s each) stalled
//! every relay and look-up behind it. So an accepted request waits in a list
//! ([`Requests`]) polled with the listeners, each answered when its bytes are there and
//! dropped when they are not within [`REQUEST_WAIT`]; the list is bounded (at most
//! [`MAX_WAITING`], of them at most [`MAX_WAITING_OF_USER`] of any one user other than this
//! process's and root, and [`MAX_WAITING_OF_OTHERS`] of all such users together, so that
//! places stay for this process's user and root however many users ask; more are refused
//! at once), and requesters of another user are refused at the accept unless this process
//! runs as root.

use super::*;

/// How long a requester has, once connected, to send its request.
pub(super) const REQUEST_WAIT: Duration = Duration::from_secs(1);
/// How many accepted requests wait for their bytes at most.
pub(super) const MAX_WAITING: usize = 128;
/// How many of them may come from one user other than this process's and root.
pub(super) const MAX_WAITING_OF_USER: usize = 8;
/// How many of them may come from all users other than this process's and root together
/// (any user may have many uids: subordinate ids).
pub(super) const MAX_WAITING_OF_OTHERS: usize = 64;

/// The server thread: answer the requests as they come; while connections are kept for
/// other holders (`keep.rs`), look at them every sweep; while passed connections are in
/// flight (`pass.rs`), look at their queues every tick.
pub(super) fn serve() {
    let mut swept = Instant::now();
    let mut requests = Requests::default();
    loop {
        let l = SERVER_FD.load(Ordering::Relaxed);
        if l < 0 {
            return;
        }
        let kick = KICK_FD.load(Ordering::Relaxed);
        // The listeners of passed connections' names (only this thread closes them).
        let mut listeners = vec![l];
        listeners.extend(pass::listeners());
        let mut others = [libc::pollfd {
            fd: kick,
            events: libc::POLLIN,
            revents: 0,
        }];
        let timeout = poll_timeout(pass::in_flight(), keep::any(), pass::to_retake());
        requests.round(&listeners, &mut others, timeout);
        if others[0].revents != 0 {
            let mut b = [0u8; 8];
            // SAFETY: our eventfd and 8 bytes.
            unsafe { real::read(kick, b.as_mut_ptr().cast(), 8) };
        }
        // (After the listeners' accepts: a sweep may close a passed name's listener.)
        pass::sweep();
        if keep::any() && swept.elapsed() >= keep::SWEEP {
            swept = Instant::now();
            keep::sweep();
        }
    }
}

/// How long the server waits for news (ms; -1: no bound): a tick while passes are in flight,
/// a sweep while connections are kept for other holders or a passed connection's name is
/// held by another socket (the sweep binds it once let go, `pass::retake`).
pub(super) fn poll_timeout(in_flight: bool, kept: bool, to_retake: bool) -> c_int {
    if in_flight {
        pass::TICK.as_millis() as c_int
    } else if kept || to_retake {
        keep::SWEEP.as_millis() as c_int
    } else {
        -1
    }
}

/// A request accepted whose bytes have not come yet.
struct Waiting {
    c: OwnedFd,
    cred: libc::ucred,
    until: Instant,
}

/// The accepted requests waiting for their bytes.
#[derive(Default)]
pub(super) struct Requests {
    waiting: Vec<Waiting>,
}

impl Requests {
    /// How many requests wait.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.waiting.len()
    }

    /// One wait of the server: poll `listeners` (what they accept is answered at once when
    /// its request is there, else waits), `others` (their `revents` are left for the caller)
    /// and the waiting requests, for at most `timeout` ms (-1: no bound; shortened to the
    /// first request's deadline); answer the requests whose bytes came, drop those overdue.
    pub(super) fn round(
        &mut self,
        listeners: &[c_int],
        others: &mut [libc::pollfd],
        timeout: c_int,
    ) {
        let poll_in = |fd: c_int| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let mut p: Vec<libc::pollfd> = listeners.iter().map(|&fd| poll_in(fd)).collect();
        p.extend(self.waiting.iter().map(|w| poll_in(w.c.as_raw_fd())));
        let n_listeners = listeners.len();
        p.extend(others.iter().map(|o| libc::pollfd { revents: 0, ..*o }));
        let now = Instant::now();
        let timeout = match self.waiting.iter().map(|w| w.until).min() {
            Some(first) => {
                let ms = first.saturating_duration_since(now).as_millis() as c_int + 1;
                if timeout < 0 {
                    ms
                } else {
                    timeout.min(ms)
                }
            }
            None => timeout,
        };
        // SAFETY: our array (a negative fd is ignored by poll).
        unsafe { real::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, timeout) };
        let n_waiting = self.waiting.len();
        for (o, q) in others.iter_mut().zip(&p[n_listeners + n_waiting..]) {
            o.revents = q.revents;
        }
        let now = Instant::now();
        // The waiting first (their indices are those polled), then the new ones.
        let ready: Vec<bool> = p[n_listeners..n_listeners + n_waiting]
            .iter()
            .map(|q| q.revents != 0)
            .collect();
        let mut w = std::mem::take(&mut self.waiting).into_iter();
        for r in ready {
            let Some(req) = w.next() else { break };
            let req = if r { try_answer(req) } else { Some(req) };
            self.waiting.extend(req);
        }
        self.waiting.extend(w);
        for q in p[..n_listeners].iter().filter(|q| q.revents != 0) {
            self.accept(q.fd, now);
        }
        self.expire(now);
    }

    /// Accept what listening socket `l` (nonblocking) has, up to 16 requests: each is
    /// answered at once when its request is there, else it waits.
    pub(super) fn accept(&mut self, l: c_int, now: Instant) {
        for _ in 0..16 {
            // SAFETY: our listening socket (nonblocking).
            let c = made(|| unsafe {
                real::accept4(
                    l,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                )
            });
            let c = match c {
                Ok(c) => c,
                Err(libc::EINTR | libc::ECONNABORTED | libc::EAGAIN) => return,
                Err(_) => {
                    // (EMFILE and the like: the next round tries again, a little later.)
                    std::thread::sleep(Duration::from_millis(10));
                    return;
                }
            };
            // SAFETY: geteuid has no preconditions.
            let me = unsafe { libc::geteuid() };
            let cred = peer_cred(c.as_raw_fd());
            match admit(self.waiting.iter().map(|w| w.cred.uid), cred, me) {
                Ok(cred) => {
                    let req = Waiting {
                        c,
                        cred,
                        until: now + REQUEST_WAIT,
                    };
                    if let Some(req) = try_answer(req) {
                        self.waiting.push(req);
                    }
                }
                Err(e) => {
                    note_refusal(cred, e, "refused at the connect");
                    reply(c.as_raw_fd(), Err(e));
                }
            }
        }
    }

    /// Drop the requests whose bytes did not come by their deadline (the requester reads the
    /// end of stream).
    pub(super) fn expire(&mut self, now: Instant) {
        self.waiting.retain(|w| {
            let keep = now < w.until;
            if !keep {
                note_refusal(Some(w.cred), libc::ETIMEDOUT, "sent nothing in time");
            }
            keep
        });
    }
}

/// Whether a requester with credentials `cred` may wait for its request among those of
/// `waiting` (their users), this process running as user `me`: `Err(errno)` to refuse.
pub(super) fn admit(
    waiting: impl Iterator<Item = libc::uid_t>,
    cred: Option<libc::ucred>,
    me: libc::uid_t,
) -> Result<libc::ucred, c_int> {
    let p = cred.ok_or(libc::EACCES)?;
    if !trusted_requester(&p, me) {
        return Err(libc::EACCES);
    }
    let other = |uid: libc::uid_t| uid != me && uid != 0;
    let (mut all, mut theirs, mut others) = (0, 0, 0);
    for uid in waiting {
        all += 1;
        theirs += usize::from(uid == p.uid);
        others += usize::from(other(uid));
    }
    if all >= MAX_WAITING
        || (other(p.uid) && (theirs >= MAX_WAITING_OF_USER || others >= MAX_WAITING_OF_OTHERS))
    {
        return Err(libc::EAGAIN);
    }
    Ok(p)
}

/// Whether a requester of credentials `p` may ask this process (running as `me`): the same
/// user, or anyone when this process runs as root (a privileged process passing
/// connections to workers that dropped their privileges).
fn trusted_requester(p: &libc::ucred, me: libc::uid_t) -> bool {
    p.uid == me || me == 0
}

/// Log a refused or dropped requester, not more often than the powers of two (a requester
/// that connects again and again does not fill the log).
fn note_refusal(cred: Option<libc::ucred>, e: c_int, what: &str) {
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let n = COUNT.fetch_add(1, Ordering::Relaxed) + 1;
    if n.is_power_of_two() {
        let (pid, uid) = cred.map_or((0, u32::MAX), |c| (c.pid, c.uid));
        log!(
            "relay request of process {pid} (uid {uid}) {what}: {} ({n} so far)",
            io::Error::from_raw_os_error(e)
        );
    }
}

/// Answer `req` when its request is there: `Some(req)` when it is not yet (it waits on).
fn try_answer(req: Waiting) -> Option<Waiting> {
    let c = req.c.as_raw_fd();
    match recv_with_fds(c) {
        Err(libc::EAGAIN) => Some(req),
        // The requester went (or its socket failed): nothing to answer.
        Err(_) => None,
        Ok((b, fds)) => {
            reply(c, respond(b, fds, &req.cred));
            None
        }
    }
}

/// Send the answer to a request on `c` (nonblocking: a few bytes on an empty socket).
fn reply(c: c_int, r: Result<Answer, c_int>) {
    match r {
        Ok(Answer::Relay(relay)) => {
            let _ = send_with_fd(c, 0, Some(relay.fd()));
        }
        Ok(Answer::Done) => {
            let _ = send_with_fd(c, 0, None);
        }
        Ok(Answer::Owner) => {
            let mut b = [0u8; 9];
            b[1..].copy_from_slice(&nonce().to_le_bytes());
            // SAFETY: our socket and buffer.
            unsafe { real::send(c, b.as_ptr().cast(), 9, libc::MSG_NOSIGNAL) };
        }
        Err(e) => {
            log!("relay request refused: {}", io::Error::from_raw_os_error(e));
            let _ = send_with_fd(c, e.clamp(1, 255) as u8, None);
        }
    }
}

/// What a request is answered with.
pub(super) enum Answer {
    /// The relay socket A (a request, [`ASK`]).
    Relay(Arc<Relay>),
    /// A status byte of 0 (an announced pass, [`pass::PASS`], or one undone,
    /// [`pass::UNPASS`]).
    Done,
    /// A status byte of 0 and this process's nonce (a receiver's look-up, [`pass::LOOKUP`]).
    Owner,
}

/// One request on `c`, whose bytes are there or come (a blocking socket): check the
/// requester, read it, answer it (see [`respond`]).
#[cfg(test)]
pub(super) fn answer(c: c_int) -> Result<Answer, c_int> {
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let peer = match peer_cred(c) {
        Some(p) if trusted_requester(&p, me) => p,
        _ => return Err(libc::EACCES),
    };
    let (b, fds) = recv_with_fds(c)?;
    respond(b, fds, &peer)
}

/// Answer request `b` with descriptors `fds` of the process of credentials `peer`: find or
/// make the relay ([`ASK`]), note a pass of one of this process's connections
/// ([`pass::PASS`]: the proof and the sender's unix socket) or undo one
/// ([`pass::UNPASS`]: the same, after the sender's send failed), or name this process to a
/// receiver ([`pass::LOOKUP`]).
fn respond(b: u8, mut fds: Vec<OwnedFd>, peer: &libc::ucred) -> Result<Answer, c_int> {
    // A connection whose numbers the program is closing right now is looked at again once
    // the close has made its record (`keep::closing_mark`), within 2 s.
    // (A socket before an fstat looks at it, as in `check_proof`.)
    let closing = fds
        .first()
        .filter(|f| sock_opt(f.as_raw_fd(), libc::SO_TYPE) == Some(libc::SOCK_STREAM))
        .and_then(|f| table::socket_id(f.as_raw_fd()))
        .map_or(0, |id| id.1);
    let deadline = Instant::now() + Duration::from_secs(2);
    let r = loop {
        let r = match b {
            pass::PASS => pass::announced(&mut fds).map(|()| Answer::Done),
            pass::UNPASS => pass::unannounced(&fds).map(|()| Answer::Done),
            pass::LOOKUP => pass::looked_up(&fds, peer.pid).map(|()| Answer::Owner),
            _ => check_proof(b, &fds).and_then(convert).map(Answer::Relay),
        };
        match r {
            Err(libc::ENOENT) if keep::being_closed(closing) && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(1));
            }
            r => break r,
        }
    };
    // The received copies are closed by a thread of their own: the close of a socket whose
    // last reference this is may block (a lingering TCP socket), never the server.
    if !fds.is_empty() {
        let spawned = smc::fdapi::signals_blocked(|| {
            smc_fabric::threads::spawn_running(
                std::thread::Builder::new().name("smc-relay-close".into()),
                move || drop(fds),
            )
        });
        if let Err(e) = spawned {
            log!("relay server: no thread to close a request's descriptor: {e}");
        }
    }
    r
}

#[cfg(test)]
#[path = "relay_server_tests.rs"]
mod tests;
