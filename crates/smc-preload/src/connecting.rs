//! Client connections whose `connect` returned before the server's answer to the Proposal.
//!
//! The client's `connect` makes the TCP connection and sends the Proposal; the server
//! library answers it when its program accepts the connection and first uses it (or
//! [`crate::settle`]'s 50 ms after the accept). A server program that accepts a connection
//! only after its client used *another* connection — FTP: the client connects its passive
//! data connection, then sends RETR on the control connection, and the server accepts the
//! data connection after reading RETR — would keep a `connect` that waits for the Accept
//! waiting until the stack's `accept_wait` (6 s, then a Decline and TCP). Over TCP the
//! kernel's backlog completes that handshake at once.
//!
//! So `connect` waits for the answer only [`connect_wait`] (20 ms: a server under `smc run`
//! that serves at once answers within that), then returns with the handshake pending
//! ([`Kind::Connecting`]). The handshake ends:
//! - in the completer thread of this module, as soon as the server's answer makes the
//!   socket readable (or on its 100 ms tick, which notices the stack's `accept_wait`
//!   Decline), so that the server, whose first use waits for our Confirm, is not held up by
//!   a client that waits on another connection;
//! - at the program's first data call, `shutdown`, `sendfile`, a socket option the stack
//!   keeps (SO_RCVTIMEO, SO_SNDTIMEO, SO_OOBINLINE) or FIONREAD: the call waits for the end
//!   (a write may not go to the TCP socket in front of the CLC messages), except a
//!   nonblocking read with no answer in yet, which gets EAGAIN;
//! - before a `fork` or an `exec` (the child or the new image would have the socket mid
//!   handshake) and before the socket is passed by SCM_RIGHTS.
//!
//! Meanwhile the wait calls never wait for it: `poll`/`select` and `epoll_ctl` watch the
//! real TCP socket (writable at once, readable when the answer arrives), and when the
//! handshake ends in SMC-R the registrations in epoll instances move to the connection's
//! eventfds (`wait::adopt`, which also wakes a thread asleep in the instance), while a
//! `poll` asleep on it wakes on the entry's `done` eventfd and looks again.

use std::os::fd::{AsRawFd as _, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use libc::{c_int, ssize_t};
use smc::fdapi::{ClientHandshake, Setup};

use crate::hooks::{bfd, kind_of, nonblocking_flag};
use crate::table::{self, Entry, Kind};
use crate::{log, real, set_errno};

/// How long `connect` waits for the server's answer before it returns with the handshake
/// pending (`SMC_CONNECT_WAIT_MS` overrides it; 0: right after the Proposal).
const CONNECT_WAIT: Duration = Duration::from_millis(20);

/// How often the completer (and a call waiting for the end) looks whether the stack ended a
/// handshake without a byte arriving (the `accept_wait` Decline).
const TICK: Duration = Duration::from_millis(100);

/// How long one step of a handshake whose answer is in may take (the Confirm, and on first
/// contact the link's LLC exchange); a longer one goes on at the next step.
const STEP: Duration = Duration::from_secs(2);

pub(crate) fn connect_wait() -> Duration {
    static WAIT: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *WAIT.get_or_init(|| {
        std::env::var("SMC_CONNECT_WAIT_MS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .map(Duration::from_millis)
            .unwrap_or(CONNECT_WAIT)
    })
}

/// A client handshake in progress (the entry of its numbers: [`Kind::Connecting`]).
#[derive(Debug)]
pub(crate) struct Connecting {
    /// `None` once it ended (what it ended in is installed under every number of it).
    handshake: Mutex<Option<ClientHandshake>>,
    /// A duplicate of the socket (the completer and a waiting call poll it).
    watch: OwnedFd,
    /// An eventfd written once when the handshake ends (a `poll` asleep on the socket
    /// wakes on it).
    done: OwnedFd,
    ended: AtomicBool,
    /// What it ended in, when that is a connection to install: a number that still names
    /// this entry afterwards (a `dup` while it ended, or one the end's listing missed) takes
    /// it from here ([`settle_leftover`]).
    result: std::sync::OnceLock<Arc<Entry>>,
}

impl Connecting {
    /// Whether the handshake ended.
    pub(crate) fn ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    /// The eventfd that becomes readable when the handshake ends.
    pub(crate) fn done_fd(&self) -> c_int {
        self.done.as_raw_fd()
    }

    fn lock(&self) -> MutexGuard<'_, Option<ClientHandshake>> {
        self.handshake.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn signal_end(&self) {
        self.ended.store(true, Ordering::Release);
        let one = 1u64.to_ne_bytes();
        // SAFETY: our eventfd and an 8-byte buffer.
        unsafe { real::write(self.done.as_raw_fd(), one.as_ptr().cast(), 8) };
    }
}

/// Pending handshakes: number at `connect`, entry.
type PendingList = Vec<(c_int, Weak<Entry>)>;

/// The pending handshakes of this process, for the completer.
static LIST: Mutex<PendingList> = Mutex::new(Vec::new());
/// The completer's wake-up eventfd, with the process it belongs to (a forked child makes
/// its own).
static WAKE: Mutex<Option<(i32, OwnedFd)>> = Mutex::new(None);
/// The process whose completer thread runs.
static COMPLETER_PID: AtomicI32 = AtomicI32::new(0);

fn eventfd() -> Option<OwnedFd> {
    // SAFETY: plain eventfd.
    crate::relay::made(|| unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) }).ok()
}

/// The handshake of `fd` (just connected) is pending: enter it, and have the completer
/// watch it. `Err`: no descriptor for the watch (the handshake given back, for the caller
/// to finish at once).
pub(crate) fn started(fd: c_int, h: ClientHandshake) -> Result<(), ClientHandshake> {
    if usize::try_from(fd).map_or(true, |i| i >= table::MAX_FD) {
        return Err(h);
    }
    let Ok(watch) = smc_fabric::fdplace::dup_placed(bfd(fd)) else {
        return Err(h);
    };
    let Some(done) = eventfd() else {
        return Err(h);
    };
    let c = Arc::new(Connecting {
        handshake: Mutex::new(Some(h)),
        watch,
        done,
        ended: AtomicBool::new(false),
        result: std::sync::OnceLock::new(),
    });
    let e = Entry::new(Kind::Connecting(c.clone()));
    // (In range, checked above.)
    if let Ok(Some(old)) = table::set(fd, e.clone()) {
        table::release(old);
    }
    log!("fd {fd}: connected, Proposal sent; the server's answer is not in yet");
    LIST.lock()
        .unwrap_or_else(|p| p.into_inner())
        .push((fd, Arc::downgrade(&e)));
    start_completer();
    wake_completer();
    Ok(())
}

/// The pending handshake `fd` names in this process, if any.
pub(crate) fn of(fd: c_int) -> Option<(Arc<Entry>, Arc<Connecting>)> {
    if !table::maybe(fd) {
        return None;
    }
    let e = table::get(fd)?;
    let Kind::Connecting(c) = &e.kind else {
        return None;
    };
    let c = c.clone();
    if !e.ours() {
        return None;
    }
    if c.ended() {
        // A number left naming the ended handshake: it takes what the handshake ended in.
        settle_leftover(&e, &c);
        return None;
    }
    Some((e, c))
}

/// Run `f` (a registration of `fd`'s real socket in a kernel epoll instance) while the
/// handshake of `fd` is still pending, under its lock, so that it ends either before (then
/// `None`: the caller treats `fd` as what it became) or after (then the end finds the
/// registration and moves it, `wait::adopt`).
pub(crate) fn while_pending<R>(fd: c_int, f: impl FnOnce() -> R) -> Option<R> {
    let (e, c) = of(fd)?;
    let g = c.lock();
    if g.is_none() || !table::get(fd).is_some_and(|now| Arc::ptr_eq(&now, &e)) {
        return None;
    }
    let r = f();
    drop(g);
    Some(r)
}

/// A read of `fd` that must not wait (`MSG_DONTWAIT` or O_NONBLOCK) on a pending handshake
/// whose answer is not in yet: EAGAIN (`Some(-1)`), as TCP's empty socket. `None`: go on
/// (not pending, or the answer is in: the read finishes the handshake first).
pub(crate) fn read_would_block(fd: c_int, flags: c_int) -> Option<ssize_t> {
    if !table::maybe(fd) || crate::inside() {
        return None;
    }
    let (_, c) = of(fd)?;
    if flags & libc::MSG_DONTWAIT == 0 && !nonblocking_flag(fd) {
        return None;
    }
    let g = c.lock();
    if g.as_ref().is_some_and(|h| !h.answered()) {
        set_errno(libc::EAGAIN);
        return Some(-1);
    }
    None
}

/// Finish the pending handshake of entry `e` in the calling thread: wait (without its lock)
/// for the server's answer or the stack's Decline, then finish it. Returns when it ended
/// and what it ended in is installed.
pub(crate) fn finish(e: &Arc<Entry>, c: &Connecting) {
    loop {
        {
            let mut g = c.lock();
            let limit = match g.as_ref() {
                None => {
                    drop(g);
                    settle_leftover(e, c);
                    return;
                }
                Some(h) if h.answered() => STEP,
                Some(_) => Duration::ZERO,
            };
            if step(e, c, &mut g, limit) {
                return;
            }
        }
        let mut fds = [
            libc::pollfd {
                fd: c.watch.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: c.done.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: our array.
        unsafe { real::poll(fds.as_mut_ptr(), 2, TICK.as_millis() as c_int) };
    }
}

/// Numbers that still name entry `e` after its handshake ended (a `dup` while it ended):
/// they take the connection it ended in; when it ended in nothing to install (failed, the
/// socket shut down) they are forgotten and the program uses the socket as it is.
fn settle_leftover(e: &Arc<Entry>, c: &Connecting) {
    match c.result.get() {
        Some(new) => {
            let conn = match &new.kind {
                Kind::Smc(conn) => Some(conn.clone()),
                _ => None,
            };
            for fd in table::numbers_of(e) {
                if table::replace(fd, e, new.clone()) {
                    if let Some(conn) = &conn {
                        crate::wait::adopt(fd, conn);
                    }
                }
            }
        }
        None => drop_stale(e),
    }
}

/// A number that still names an entry whose handshake ended with nothing to install:
/// forgotten, the program uses the socket as it is.
fn drop_stale(e: &Arc<Entry>) {
    for fd in table::numbers_of(e) {
        if let Some(old) = table::take_if(fd, e) {
            table::release(old);
        }
    }
}

/// One step of the handshake (its lock held: `g`) of at most `limit`; `true` when it ended
/// (and its result is installed).
fn step(
    e: &Arc<Entry>,
    c: &Connecting,
    g: &mut MutexGuard<'_, Option<ClientHandshake>>,
    limit: Duration,
) -> bool {
    let Some(h) = g.as_mut() else {
        return true;
    };
    let numbers = table::numbers_of(e);
    if numbers.is_empty() {
        // Every number of it closed: the handshake goes with the entry.
        **g = None;
        c.signal_end();
        return true;
    }
    let r = crate::guard(Err(std::io::Error::other("panicked")), || {
        h.advance(Some(limit))
    });
    match r {
        Ok(None) => false,
        Ok(Some(setup)) => {
            **g = None;
            // Listed again: the step may have taken a while, and the program may have
            // duplicated or closed numbers meanwhile (bash's `dup2` of a new connection).
            let numbers = table::numbers_of(e);
            install_all(e, c, &numbers, setup);
            c.signal_end();
            true
        }
        Err(err) => {
            **g = None;
            log!(
                "fd {}: client rendezvous failed: {err}; the TCP connection is shut down",
                numbers[0]
            );
            // RFC 7609 C.5: "If the TCP and/or CLC handshakes time out, the TCP
            // connection must be terminated as it would be in a legacy IP environment when
            // connection setup doesn't complete in a timely manner."
            // SAFETY: the connection's socket (our duplicate of it).
            unsafe { real::shutdown(c.watch.as_raw_fd(), libc::SHUT_RDWR) };
            drop_stale(e);
            c.signal_end();
            true
        }
    }
}

/// Install what the handshake of entry `e` ended in under each of its numbers (kept in `c`
/// for numbers that name `e` later, [`settle_leftover`]).
fn install_all(e: &Arc<Entry>, c: &Connecting, numbers: &[c_int], setup: Setup) {
    let first = numbers.first().copied().unwrap_or(-1);
    let conn = match &setup {
        Setup::Smc(c) => Some(c.clone()),
        Setup::Tcp(_) => None,
    };
    // O_NONBLOCK from the watch, which shares the socket's open file description (the
    // program's number may already name another file).
    let new = Entry::new(kind_of(first, setup, nonblocking_flag(c.watch.as_raw_fd())));
    if let Some(id) = e.socket.get() {
        let _ = new.socket.set(*id);
    }
    let _ = c.result.set(new.clone());
    for &fd in numbers {
        if table::replace(fd, e, new.clone()) {
            if let Some(c) = &conn {
                crate::wait::adopt(fd, c);
            }
        }
    }
}

/// Finish every pending handshake of this process (before a `fork` or an `exec`: the child
/// or the new image would find the socket in the middle of it).
pub(crate) fn finish_all() {
    let list: Vec<Arc<Entry>> = LIST
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter_map(|(_, w)| w.upgrade())
        .collect();
    for e in list {
        if let Kind::Connecting(c) = &e.kind {
            if e.ours() && !c.ended() {
                finish(&e, c);
            }
        }
    }
}

fn start_completer() {
    let pid = table::PID.load(Ordering::Relaxed);
    if COMPLETER_PID.swap(pid, Ordering::AcqRel) == pid {
        return;
    }
    let started = smc::fdapi::signals_blocked(|| {
        smc_fabric::threads::spawn_running(
            std::thread::Builder::new().name("smc-connect".into()),
            run,
        )
        .is_ok()
    });
    if !started {
        // Left to the program's first use; the next pending handshake tries again.
        COMPLETER_PID.store(0, Ordering::Release);
    }
}

/// The completer's wake-up eventfd of this process (made when missing).
fn wake_fd() -> Option<c_int> {
    let pid = table::PID.load(Ordering::Relaxed);
    let mut w = WAKE.lock().unwrap_or_else(|p| p.into_inner());
    if w.as_ref().is_none_or(|(p, _)| *p != pid) {
        // (A forked child's copy of the parent's is left open: it is the parent's too.)
        if let Some((_, old)) = w.take() {
            std::mem::forget(old);
        }
        *w = eventfd().map(|fd| (pid, fd));
    }
    w.as_ref().map(|(_, fd)| fd.as_raw_fd())
}

fn wake_completer() {
    if let Some(fd) = wake_fd() {
        let one = 1u64.to_ne_bytes();
        // SAFETY: our eventfd and an 8-byte buffer.
        unsafe { real::write(fd, one.as_ptr().cast(), 8) };
    }
}

/// The completer thread: waits for an answer on any pending handshake's socket, and
/// finishes the handshakes that have one (or that the stack ended meanwhile).
fn run() {
    crate::guard((), || loop {
        let items: Vec<(Arc<Entry>, Arc<Connecting>)> = {
            let mut l = LIST.lock().unwrap_or_else(|p| p.into_inner());
            l.retain(|(_, w)| {
                w.upgrade().is_some_and(|e| match &e.kind {
                    Kind::Connecting(c) => e.ours() && !c.ended(),
                    _ => false,
                })
            });
            l.iter()
                .filter_map(|(_, w)| {
                    let e = w.upgrade()?;
                    let Kind::Connecting(c) = &e.kind else {
                        return None;
                    };
                    let c = c.clone();
                    Some((e, c))
                })
                .collect()
        };
        let Some(wake) = wake_fd() else {
            std::thread::sleep(TICK);
            continue;
        };
        let mut fds: Vec<libc::pollfd> = std::iter::once(wake)
            .chain(items.iter().map(|(_, c)| c.watch.as_raw_fd()))
            .map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        let timeout = if items.is_empty() {
            -1
        } else {
            TICK.as_millis() as c_int
        };
        // SAFETY: our array.
        let k = unsafe { real::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
        if fds[0].revents != 0 {
            let mut b = [0u8; 8];
            // SAFETY: draining our eventfd.
            unsafe { real::read(wake, b.as_mut_ptr().cast(), 8) };
        }
        for ((e, c), p) in items.iter().zip(&fds[1..]) {
            if k > 0 && p.revents == 0 {
                continue;
            }
            let mut g = c.lock();
            let limit = match g.as_ref() {
                Some(h) if h.answered() => STEP,
                Some(_) => Duration::ZERO,
                None => continue,
            };
            step(e, c, &mut g, limit);
        }
    });
}

/// The completer's locks held by the forking thread across a `fork()` (a child that
/// inherited one taken by the completer in that instant would wait for it forever, as the
/// settler's did, docs/preload.md).
type ForkHeld = (
    MutexGuard<'static, PendingList>,
    MutexGuard<'static, Option<(i32, OwnedFd)>>,
);

std::thread_local! {
    static FORK_HELD: std::cell::RefCell<Option<ForkHeld>> =
        const { std::cell::RefCell::new(None) };
}

/// Before a `fork()`: every pending handshake finished (the child would have the socket in
/// the middle of one, with no stack to finish it), then the list held across the fork.
pub(crate) fn fork_prepare() {
    finish_all();
    let l = LIST.lock().unwrap_or_else(|p| p.into_inner());
    let w = WAKE.lock().unwrap_or_else(|p| p.into_inner());
    FORK_HELD.with(|h| *h.borrow_mut() = Some((l, w)));
}

/// After a `fork()`, in the parent.
pub(crate) fn fork_parent() {
    FORK_HELD.with(|h| drop(h.borrow_mut().take()));
}

/// After a `fork()`, in the child: the parent's pending handshakes are not the child's.
pub(crate) fn fork_child() {
    FORK_HELD.with(|h| {
        if let Some((mut l, w)) = h.borrow_mut().take() {
            l.clear();
            drop(w);
        }
    });
}
