//! The fd-level API: SMC-R for a program that owns its TCP sockets as plain file
//! descriptors, as an interposing library (`crates/smc-preload`, `smc run`) needs it.
//!
//! The program keeps its real TCP socket; this module duplicates it for the stack (the
//! stack's handle of the socket is the duplicate, so the program's number stays the program's),
//! runs discovery and the CLC rendezvous on it, and afterwards moves the bytes over SMC-R.
//! What the caller gets:
//!
//! - [`listen_mark`]: before `listen()`, marks the port for the eBPF discovery of this
//!   process's stack and returns the [`Listening`] that later accepts ask.
//! - [`Listening::accepted`]: right after `accept()`, whether the client offered SMC-R (the
//!   answer lives in the marking stack's eBPF map, which a forked worker shares).
//! - [`setup_server`]: the server rendezvous of an accepted socket, in the calling process
//!   (lazily: the process that first uses the socket, so that a server that accepts and then
//!   forks a child to serve the connection works).
//! - [`connect`]: connect a program's socket (discovery, then rendezvous or fallback).
//! - [`Conn`]: an SMC-R connection's reads, writes, shutdown, readiness (the `tcp_poll()`
//!   mask an `epoll`/`poll` emulation reports) and the two eventfds its progress signals.
//!
//! One stack per process ([`stack`]); a forked child gets a new one ([`fork_child`]): the
//! parent's is abandoned, never used again, since its threads did not survive the fork.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use smc_proto::endpoint::TcpId;

use crate::config::DiscoveryMode;
use crate::discovery::Outcome;
use crate::error::{conn_error, FallbackReason};
use crate::stack::Notifiers;
use crate::{Mode, SmcStream, Stack};

mod setup;
mod spin;
mod uid;
pub use setup::{
    accepted_tcp, connect, connect_start, decline_accepted, decline_cloned, decline_passed,
    listen_mark, setup_server, ClientHandshake, Connecting, Listening, Setup, TcpConn,
};
pub use spin::LoopSpin;
pub use uid::{before_uid_change, refuse_after_uid_change, UidGrant};

/// The stack of this process (made at first use from the environment, as [`Stack::global`];
/// a forked child makes its own after [`forked_child`]).
static STACK: Mutex<Option<Stack>> = Mutex::new(None);

/// In a forked child: the eBPF discovery of the parent's stack (copied by the fork), for the
/// child's own stack to share (see [`Stack::new_inheriting`]). Read and written only with
/// [`STACK`] locked, which the forking thread holds across `fork()`, so no thread of the
/// parent can hold this lock at the fork.
static INHERITED_DISCOVERY: Mutex<Option<Arc<crate::discovery::TcpOptionDiscovery>>> =
    Mutex::new(None);

/// The `SMC_*` settings the program started with (see [`keep_settings`]).
static SETTINGS: std::sync::OnceLock<Vec<(std::ffi::OsString, std::ffi::OsString)>> =
    std::sync::OnceLock::new();

/// Remember the `SMC_*` environment variables now (the library's constructor calls this), so
/// that a stack made later uses them even if the program cleared its environment meanwhile
/// (nginx rebuilds its workers' environment, keeping only TZ).
/// The default fabric directory is fixed at the same time (the directory of the user and
/// environment the program started with: see [`smc_fabric::config::pin_default_dir`]).
pub fn keep_settings() {
    let _ = SETTINGS.set(
        std::env::vars_os()
            .filter(|(k, _)| k.to_string_lossy().starts_with("SMC_"))
            .collect(),
    );
    smc_fabric::config::pin_default_dir();
}

/// The value of the `SMC_*` setting `name`: from the environment, else as the program
/// started with it (see [`keep_settings`]).
pub fn setting(name: &str) -> Option<std::ffi::OsString> {
    std::env::var_os(name).or_else(|| {
        SETTINGS
            .get()?
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    })
}

/// Put the kept settings back into the environment where the program removed them.
fn restore_settings() {
    for (k, v) in SETTINGS.get().into_iter().flatten() {
        if std::env::var_os(k).is_none() {
            // Before the stack's threads exist; a program that reads its environment from
            // another thread at this moment is the caveat `docs/preload.md` names.
            std::env::set_var(k, v);
        }
    }
}

/// The stack of the calling process, made from the environment at first use.
/// After a uid change the program opted out of (`SMC_UID_CHANGE=tcp`), none: every later
/// connection is TCP.
pub fn stack() -> io::Result<Stack> {
    uid::check_allowed()?;
    let mut g = STACK.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(s) = g.as_ref() {
        return Ok(s.clone());
    }
    restore_settings();
    note_address_space();
    smc_fabric::fdplace::keep_high();
    let inherited = lock_inherited().clone();
    let config = crate::StackConfig::from_env().map_err(io::Error::other)?;
    // The stack's threads must never run the program's signal handlers: a handler written
    // for a single-threaded program (rsync's SIGCHLD handler reaps children) would then run
    // concurrently with the program's own code (rsync's generator lost its receiver's exit
    // status: "error returned by waitpid()", exit code 21).
    let s =
        signals_blocked(|| Stack::new_inheriting(config, inherited)).map_err(io::Error::other)?;
    *g = Some(s.clone());
    Ok(s)
}

/// The process's address space (bytes) just before the first stack of this address space
/// was made (0: none made yet). A forked or cloned child inherits it with the memory: the
/// parent's stack's threads left their stacks and the C library's malloc arenas (64 MiB of
/// reservation each) in the copy.
static ADDRESS_SPACE_BEFORE_STACK: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(0);

/// The process's address space now, in bytes (`/proc/self/statm`'s first field).
fn address_space() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().next()?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * u64::try_from(page).ok()?)
}

fn note_address_space() {
    if ADDRESS_SPACE_BEFORE_STACK.load(std::sync::atomic::Ordering::Relaxed) == 0 {
        if let Some(v) = address_space() {
            ADDRESS_SPACE_BEFORE_STACK.store(v, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// The address space this process gained since the first stack of its address space was
/// made (its threads' stacks and malloc arenas, the fabric's mappings — and whatever the
/// program mapped meanwhile), or `None` when no stack was made. The preload library adds it
/// to a program's `RLIMIT_AS`.
pub fn address_space_since_stack() -> Option<u64> {
    let before = ADDRESS_SPACE_BEFORE_STACK.load(std::sync::atomic::Ordering::Relaxed);
    if before == 0 {
        return None;
    }
    Some(address_space()?.saturating_sub(before))
}

/// Before a privilege drop in a process that has no stack (and so no eBPF discovery): load
/// the discovery now, while the process may, and keep it for the stack the process makes
/// later as the new user, as a forked child keeps its parent's ([`Stack::new_inheriting`]).
/// mosquitto and mariadbd change to their own user before they open their listening
/// sockets: the stack made at the `listen`, as the new user, could not load the program
/// (EPERM), and every connection stayed TCP. Returns whether it was loaded (`false`: a stack
/// or a usable discovery is there already, or the configuration asks for no eBPF program).
pub(super) fn load_discovery_ahead() -> Result<bool, String> {
    let g = STACK.lock().unwrap_or_else(|p| p.into_inner());
    if g.is_some() {
        return Ok(false);
    }
    let mut inherited = lock_inherited();
    if inherited.as_ref().is_some_and(|d| d.usable_after_fork()) {
        return Ok(false);
    }
    restore_settings();
    let config = crate::StackConfig::from_env().map_err(|e| e.to_string())?;
    if !matches!(config.discovery, DiscoveryMode::Ebpf | DiscoveryMode::Auto) {
        return Ok(false);
    }
    // Its descriptors go to the upper half, as the stack's own would.
    smc_fabric::fdplace::keep_high();
    let d = crate::discovery::TcpOptionDiscovery::load(None).map_err(|e| e.to_string())?;
    *inherited = Some(Arc::new(d));
    Ok(true)
}

std::thread_local! {
    /// The stack lock held across a `fork()` by the forking thread (see [`fork_prepare`]).
    static FORK_GUARD: std::cell::RefCell<Option<std::sync::MutexGuard<'static, Option<Stack>>>> =
        const { std::cell::RefCell::new(None) };
}

/// Before `fork()` (a `pthread_atfork` prepare handler): wait for a measurement of the TSC's
/// rate under way, and hold the stack lock across the fork, so that the child never inherits it
/// held by a thread it does not have.
pub fn fork_prepare() {
    // A child's stacks should start with the TSC's rate known (`crate::clock`).
    crate::clock::settle_before_fork();
    let g = STACK.lock().unwrap_or_else(|p| p.into_inner());
    FORK_GUARD.with_borrow_mut(|s| *s = Some(g));
}

/// After `fork()` in the parent: release the lock [`fork_prepare`] took.
pub fn fork_parent() {
    FORK_GUARD.with_borrow_mut(|s| drop(s.take()));
}

/// After `fork()` in the child (one thread): forget the parent's stack without dropping it
/// (its runtime thread did not survive the fork; its connections belong to the parent), so
/// that the child's first use makes its own; then release the lock.
pub fn fork_child() {
    FORK_GUARD.with_borrow_mut(|s| {
        if let Some(mut g) = s.take() {
            if let Some(parent) = g.take() {
                forget_parent(parent);
            }
        }
    });
}

fn lock_inherited(
) -> std::sync::MutexGuard<'static, Option<Arc<crate::discovery::TcpOptionDiscovery>>> {
    INHERITED_DISCOVERY
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// Forget the parent's stack in a forked child (with [`STACK`] locked), keeping its eBPF
/// discovery for the child's stack; without a parent's stack the discovery a grandparent
/// passed on stays.
fn forget_parent(parent: Stack) {
    if let Some(d) = &parent.inner.discovery {
        *lock_inherited() = Some(d.clone());
    }
    std::mem::forget(parent);
}

/// In a child made by a `clone` system call without `CLONE_VM` that is not `fork()` (vsftpd
/// makes its session processes so, for their namespaces): no fork handler ran. Forget the
/// parent's stack as [`fork_child`] does. `false` when another thread of the parent held
/// the stack lock at the clone (the child cannot take it: its stack stays unusable).
pub fn forked_without_handlers() -> bool {
    let mut g = match STACK.try_lock() {
        Ok(g) => g,
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => return false,
    };
    if let Some(parent) = g.take() {
        forget_parent(parent);
    }
    true
}

/// Run `f` with every signal blocked in the calling thread, so that the threads it starts
/// (which inherit the mask) never take a signal meant for the program; the mask is put back
/// after.
pub fn signals_blocked<R>(f: impl FnOnce() -> R) -> R {
    // SAFETY: signal sets of our own; pthread_sigmask on the calling thread.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old);
        let r = f();
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        r
    }
}

/// `fd`, moved out of the low descriptor numbers the program counts on (as the stack's own
/// descriptors are, see `smc_fabric::fdplace`), for a library's long-lived descriptors.
pub fn place_high(fd: OwnedFd) -> OwnedFd {
    smc_fabric::fdplace::placed(fd)
}

/// Readiness of a connection, as Linux's `tcp_poll()` reports it for a TCP socket.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ready {
    /// Data to read, or end of stream (a read does not block).
    pub readable: bool,
    /// Room in the peer's RMBE (a write does not block).
    pub writable: bool,
    /// The peer is done writing (EPOLLRDHUP).
    pub read_hup: bool,
    /// The connection is gone in both directions (EPOLLHUP).
    pub hup: bool,
    /// A failure is pending (EPOLLERR).
    pub error: bool,
    /// Urgent data is pending or its byte not yet read with `MSG_OOB` (EPOLLPRI).
    pub urgent: bool,
}

/// One handle of an SMC-R connection and the nonblocking mode it was last set to.
#[derive(Debug)]
struct Handle {
    s: SmcStream,
    nonblocking: bool,
    /// Bytes a MSG_PEEK read took out of the RMB (the reading handle's only): the next reads
    /// return them first.
    peeked: Vec<u8>,
}

impl Handle {
    fn mode(&mut self, nonblocking: bool) {
        if self.nonblocking != nonblocking {
            self.s.set_nonblocking_calls(nonblocking);
            self.nonblocking = nonblocking;
        }
    }
}

/// An SMC-R connection of a program: a reading and a writing handle (a read blocked in one
/// thread does not hold up a write in another), its eventfds, its nonblocking flag.
#[derive(Debug)]
pub struct Conn {
    stack: Stack,
    id: TcpId,
    rd: Mutex<Handle>,
    wr: Mutex<Handle>,
    notify: Arc<Notifiers>,
    nonblocking: AtomicBool,
    /// The connection's failure (a reset, an abort, a timeout) was reported once, by a
    /// read, a write or SO_ERROR: as TCP's pending socket error, which the first of them
    /// takes. After it reads return end of stream and writes EPIPE.
    failure_reported: AtomicBool,
    /// SO_RCVTIMEO and SO_SNDTIMEO in microseconds (0: none), as the program set them.
    timeouts: [std::sync::atomic::AtomicU64; 2],
    /// How many peeked bytes wait in the reading handle (readiness looks here without its
    /// lock, which a blocked reader holds).
    peeked_len: std::sync::atomic::AtomicUsize,
    /// The urgent byte out of band (TCP without SO_OOBINLINE), shared with the reading
    /// handle's stream, which takes it out when a read reaches it.
    urgent: Arc<crate::stream::UrgentSlot>,
    /// The spin of blocking reads before they sleep ([`Conn::read_interruptible`]).
    spin: LoopSpin,
    /// The program's reads moved elsewhere ([`Conn::hand_over`]).
    handed_over: AtomicBool,
}

/// The error of a program's read on a connection whose reading was handed over
/// ([`Conn::hand_over`]): the caller redoes the read where the connection went.
#[derive(Debug)]
struct HandedOver;

impl std::fmt::Display for HandedOver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the connection's reading was handed over")
    }
}

impl std::error::Error for HandedOver {}

/// Whether `e` is the error of a read on a connection handed over ([`Conn::hand_over`]).
pub fn is_handed_over(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|i| i.is::<HandedOver>())
}

impl Conn {
    fn new(mut s: SmcStream, id: TcpId) -> io::Result<Conn> {
        // Small writes go out at once: an event loop that writes a request and then sleeps
        // in epoll_wait has no blocked reader to flush a held-back cursor update.
        s.set_nodelay(true)?;
        let notify = s
            .notifiers()?
            .ok_or_else(|| io::Error::other("SMC-R connection without notifiers"))?;
        let w = s.try_clone()?;
        let max = s.stack().config().adaptive_spin;
        let spin = LoopSpin::with_max(max);
        let urgent = Arc::new(crate::stream::UrgentSlot::default());
        s.urgent_slot = Some(urgent.clone());
        Ok(Conn {
            spin,
            urgent,
            stack: s.stack().clone(),
            id,
            rd: Mutex::new(Handle {
                s,
                nonblocking: false,
                peeked: Vec::new(),
            }),
            wr: Mutex::new(Handle {
                s: w,
                nonblocking: false,
                peeked: Vec::new(),
            }),
            peeked_len: std::sync::atomic::AtomicUsize::new(0),
            timeouts: Default::default(),
            notify,
            nonblocking: AtomicBool::new(false),
            failure_reported: AtomicBool::new(false),
            handed_over: AtomicBool::new(false),
        })
    }

    /// SO_OOBINLINE as the program set it: urgent data in line (`true`) or out of band.
    pub fn set_oobinline(&self, on: bool) {
        use crate::stream::UrgentSlot;
        let _ = self
            .urgent
            .state
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                Some(if on {
                    v | UrgentSlot::INLINE
                } else {
                    v & !UrgentSlot::INLINE
                })
            });
    }

    /// SIOCATMARK: whether the next byte of the stream is the urgent byte.
    pub fn at_mark(&self) -> bool {
        let core = self.stack.inner.lock();
        core.ep.urgent_offset(self.id) == Some(0)
    }

    /// `recv(MSG_OOB)` (`peek`: with MSG_PEEK): the urgent byte, as TCP without SO_OOBINLINE
    /// returns it, even before the bytes in front of it were read (those are kept for the
    /// next reads, as MSG_PEEK keeps bytes). `InvalidInput` (EINVAL) when no urgent byte is
    /// there to read (none sent, already read, or SO_OOBINLINE on), as TCP's.
    pub fn read_urgent(&self, peek: bool) -> io::Result<u8> {
        use crate::stream::UrgentSlot;
        let take = |peek: bool| -> Option<u8> {
            let v = self.urgent.state.load(Ordering::Acquire);
            if v & UrgentSlot::PRESENT == 0 {
                return None;
            }
            if !peek {
                self.urgent
                    .state
                    .fetch_and(!(UrgentSlot::PRESENT | 0xFF), Ordering::AcqRel);
            }
            Some(v as u8)
        };
        let none = || io::Error::from(io::ErrorKind::InvalidInput);
        if self.urgent.state.load(Ordering::Acquire) & UrgentSlot::INLINE != 0 {
            return Err(none());
        }
        if let Some(b) = take(peek) {
            return Ok(b);
        }
        // Not taken out yet: read up to it (the bytes in front go to the peeked ones), then
        // one more read takes it out.
        let mut h = self.rd.lock().unwrap_or_else(|p| p.into_inner());
        for _ in 0..64 {
            if let Some(b) = take(peek) {
                return Ok(b);
            }
            let Some(k) = ({
                let core = self.stack.inner.lock();
                core.ep.urgent_offset(self.id)
            }) else {
                return take(peek).ok_or_else(none);
            };
            let mut tmp = vec![0u8; (k as usize).max(1)];
            h.mode(true);
            match h.s.read(&mut tmp) {
                Ok(n) => h.peeked.extend_from_slice(&tmp[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
            self.peeked_len.store(h.peeked.len(), Ordering::Relaxed);
        }
        take(peek).ok_or_else(|| io::ErrorKind::WouldBlock.into())
    }

    /// `send(MSG_OOB)`: `buf`, its last byte urgent (TCP's urgent pointer), the bytes in front
    /// written as usual; blocks unless nonblocking. Returns what was taken.
    pub fn write_urgent(&self, buf: &[u8], dontwait: bool) -> io::Result<usize> {
        let Some((last, front)) = buf.split_last() else {
            return Ok(0);
        };
        let nb = dontwait || self.nonblocking();
        let mut off = 0;
        while off < front.len() {
            match self.write(&front[off..], nb) {
                Ok(n) => off += n,
                Err(_) if off > 0 => return Ok(off),
                Err(e) => return Err(e),
            }
            if nb && off < front.len() {
                return Ok(off);
            }
        }
        let mut h = self.wr.lock().unwrap_or_else(|p| p.into_inner());
        h.mode(nb);
        match h.s.send_urgent(std::slice::from_ref(last)) {
            Ok(()) => Ok(buf.len()),
            Err(_) if off > 0 => Ok(off),
            Err(e) => Err(e),
        }
    }

    /// Set the connection's nonblocking mode (the program's O_NONBLOCK / FIONBIO).
    pub fn set_nonblocking(&self, nonblocking: bool) {
        self.nonblocking.store(nonblocking, Ordering::Relaxed);
    }

    /// Record SO_RCVTIMEO (`send` false) or SO_SNDTIMEO (`send` true); `None` or zero: none.
    pub fn set_timeout(&self, send: bool, t: Option<std::time::Duration>) {
        let us = t.map_or(0, |t| u64::try_from(t.as_micros()).unwrap_or(u64::MAX));
        self.timeouts[usize::from(send)].store(us, Ordering::Relaxed);
    }

    /// SO_RCVTIMEO (`send` false) or SO_SNDTIMEO (`send` true) as recorded.
    pub fn timeout(&self, send: bool) -> Option<std::time::Duration> {
        match self.timeouts[usize::from(send)].load(Ordering::Relaxed) {
            0 => None,
            us => Some(std::time::Duration::from_micros(us)),
        }
    }

    /// The nonblocking mode set.
    pub fn nonblocking(&self) -> bool {
        self.nonblocking.load(Ordering::Relaxed)
    }

    /// Read into `buf`; `dontwait`: this call does not block (MSG_DONTWAIT).
    pub fn read(&self, buf: &mut [u8], dontwait: bool) -> io::Result<usize> {
        self.read_checked(buf, dontwait, true)
    }

    /// From now on the program's reads ([`read`](Self::read), [`peek`](Self::peek) and what
    /// is built on them) fail with an error [`is_handed_over`] recognises, and only
    /// [`read_handed_over`](Self::read_handed_over) reads: for a library that moves the
    /// connection's reading elsewhere (a relay). A read already under way when this is called
    /// completes; the check is made under the reading handle's lock, so no program read takes
    /// bytes after the first read of the new reader.
    pub fn hand_over(&self) {
        self.handed_over.store(true, Ordering::SeqCst);
    }

    /// Whether [`hand_over`](Self::hand_over) was called.
    pub fn handed_over(&self) -> bool {
        self.handed_over.load(Ordering::SeqCst)
    }

    /// A nonblocking read for the reader the connection was handed over to.
    pub fn read_handed_over(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.read_checked(buf, true, false)
    }

    fn read_checked(&self, buf: &mut [u8], dontwait: bool, check: bool) -> io::Result<usize> {
        let mut h = self.rd.lock().unwrap_or_else(|p| p.into_inner());
        if check && self.handed_over.load(Ordering::SeqCst) {
            return Err(io::Error::other(HandedOver));
        }
        if !h.peeked.is_empty() {
            let n = h.peeked.len().min(buf.len());
            buf[..n].copy_from_slice(&h.peeked[..n]);
            h.peeked.drain(..n);
            self.peeked_len.store(h.peeked.len(), Ordering::Relaxed);
            if n == buf.len() {
                return Ok(n);
            }
            // Then what else is there, without waiting.
            h.mode(true);
            return match h.s.read(&mut buf[n..]) {
                Ok(m) => Ok(n + m),
                Err(_) => Ok(n),
            };
        }
        h.mode(dontwait || self.nonblocking());
        let r = h.s.read(buf);
        self.failure_once(r, false)
    }

    /// A read's or write's result as TCP reports a failed connection: the first call that
    /// meets the failure gets its error (ECONNRESET, ECONNABORTED, ETIMEDOUT; a write
    /// then raises no SIGPIPE), later reads end of stream and later writes EPIPE.
    fn failure_once(&self, r: io::Result<usize>, write: bool) -> io::Result<usize> {
        match r {
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionReset
                        | io::ErrorKind::ConnectionAborted
                        | io::ErrorKind::TimedOut
                ) =>
            {
                if !self.failure_reported.swap(true, Ordering::AcqRel) {
                    Err(e)
                } else if write {
                    Err(io::ErrorKind::BrokenPipe.into())
                } else {
                    Ok(0)
                }
            }
            r => r,
        }
    }

    /// Read into `buf` without consuming (MSG_PEEK): the bytes stay for the next read. Waits
    /// (unless nonblocking) for the first byte only, as TCP does.
    pub fn peek(&self, buf: &mut [u8], dontwait: bool) -> io::Result<usize> {
        let mut h = self.rd.lock().unwrap_or_else(|p| p.into_inner());
        if self.handed_over.load(Ordering::SeqCst) {
            return Err(io::Error::other(HandedOver));
        }
        if h.peeked.len() < buf.len() {
            let mut more = vec![0u8; buf.len() - h.peeked.len()];
            let nb = dontwait || self.nonblocking() || !h.peeked.is_empty();
            h.mode(nb);
            match h.s.read(&mut more) {
                Ok(n) => h.peeked.extend_from_slice(&more[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && !h.peeked.is_empty() => {}
                Err(e) => return Err(e),
            }
            self.peeked_len.store(h.peeked.len(), Ordering::Relaxed);
        }
        let n = h.peeked.len().min(buf.len());
        buf[..n].copy_from_slice(&h.peeked[..n]);
        Ok(n)
    }

    /// A blocking read whose wait is one `poll` system call on the connection's read eventfd,
    /// so that a signal handler that ran returns EINTR (`Interrupted`), as a TCP read without
    /// SA_RESTART does; `timeout` (SO_RCVTIMEO) ends the wait with `WouldBlock`.
    pub fn read_interruptible(
        &self,
        buf: &mut [u8],
        timeout: Option<std::time::Duration>,
    ) -> io::Result<usize> {
        let deadline = timeout.map(|t| std::time::Instant::now() + t);
        let mut waiter = None;
        // The spin before the first sleep, and when that sleep began (for the budget).
        let mut spun = std::time::Duration::ZERO;
        let mut asleep: Option<std::time::Instant> = None;
        loop {
            match self.read(buf, true) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                r => {
                    if let Some(at) = asleep {
                        self.spin.slept(spun, at.elapsed());
                    }
                    return r;
                }
            }
            if waiter.is_none() {
                // Before the first sleep: spin a little for the bytes (a reply likely is a
                // few µs away; a sleep costs this thread's and the doorbell's wake-ups).
                if let Some(budget) = self.spin.budget() {
                    let start = std::time::Instant::now();
                    let until = deadline.map_or(start + budget, |d| d.min(start + budget));
                    if self.spin.spin(until, || {
                        let r = self.ready();
                        r.readable || r.error || r.hup
                    }) {
                        continue;
                    }
                    spun = start.elapsed();
                }
                asleep = Some(std::time::Instant::now());
            }
            self.wait_step(&mut waiter, true, deadline)?;
        }
    }

    /// One step of a blocking call's wait for reading (`read`) or writing: the first makes
    /// the thread's [`Waiter`] (then the caller looks again: a change after that look is
    /// signalled to it), the next ones sleep on it. Without a descriptor for its eventfd
    /// (EMFILE), short sleeps that look again: a read or write does not fail for that.
    fn wait_step(
        &self,
        waiter: &mut Option<Option<Waiter>>,
        read: bool,
        deadline: Option<std::time::Instant>,
    ) -> io::Result<()> {
        match waiter {
            None => {
                *waiter = Some(Waiter::new().ok().map(|mut w| {
                    w.watch(self, read, !read);
                    w
                }));
                Ok(())
            }
            Some(Some(w)) => {
                // About to sleep: become the stack's poller (as an event loop's wait does),
                // so that a doorbell wakes this thread rather than the runtime thread, which
                // would then wake this one (sockperf's blocking ping-pong, which installs a
                // SIGALRM handler: p50 about 26 µs before, release build).
                let mut channels = completion_fds();
                let state = if channels.is_empty() {
                    PollerState::Other
                } else {
                    poller_prepare()
                };
                if state == PollerState::Progress {
                    return Ok(());
                }
                if state != PollerState::Armed {
                    channels.clear();
                }
                let mut fired = vec![false; channels.len()];
                let r = wait_fds(w.fd(), &channels, &mut fired, deadline);
                if state == PollerState::Armed {
                    poller_finish(&fired);
                }
                r?;
                w.clear();
                Ok(())
            }
            Some(None) => wait_fd(None, deadline),
        }
    }

    /// A blocking write whose wait is interruptible (see [`Conn::read_interruptible`]).
    pub fn write_interruptible(
        &self,
        buf: &[u8],
        timeout: Option<std::time::Duration>,
    ) -> io::Result<usize> {
        let deadline = timeout.map(|t| std::time::Instant::now() + t);
        let mut waiter = None;
        loop {
            match self.write(buf, true) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                r => return r,
            }
            self.wait_step(&mut waiter, false, deadline)?;
        }
    }

    /// Read into several buffers in order (readv): what the first read returns, then more
    /// without blocking while buffers are left.
    pub fn read_vectored(&self, bufs: &mut [&mut [u8]], dontwait: bool) -> io::Result<usize> {
        let mut total = 0;
        for b in bufs.iter_mut() {
            if b.is_empty() {
                continue;
            }
            let r = self.read(b, dontwait || total > 0);
            match r {
                Ok(n) => {
                    total += n;
                    if n < b.len() {
                        break;
                    }
                }
                Err(e) if total > 0 && e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) if total > 0 => break,
                Err(e) => return Err(e),
            }
        }
        Ok(total)
    }

    /// Write from `buf` (what the peer's RMBE takes; blocks for room unless nonblocking).
    pub fn write(&self, buf: &[u8], dontwait: bool) -> io::Result<usize> {
        let mut h = self.wr.lock().unwrap_or_else(|p| p.into_inner());
        h.mode(dontwait || self.nonblocking());
        let r = h.s.write(buf);
        self.failure_once(r, true)
    }

    /// Write several buffers in order (writev): blocks (unless nonblocking) until the first
    /// bytes are taken, then takes what fits without blocking.
    pub fn write_vectored(&self, bufs: &[&[u8]], dontwait: bool) -> io::Result<usize> {
        let mut total = 0;
        for b in bufs {
            if b.is_empty() {
                continue;
            }
            match self.write(b, dontwait || total > 0) {
                Ok(n) => {
                    total += n;
                    if n < b.len() {
                        break;
                    }
                }
                Err(_) if total > 0 => break,
                Err(e) => return Err(e),
            }
        }
        Ok(total)
    }

    /// shutdown(2).
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        if matches!(how, Shutdown::Read | Shutdown::Both) {
            self.rd
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .s
                .shutdown(Shutdown::Read)?;
        }
        if matches!(how, Shutdown::Write | Shutdown::Both) {
            self.wr
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .s
                .shutdown(Shutdown::Write)?;
        }
        Ok(())
    }

    /// SO_ERROR: the connection's failure, if no read, write or SO_ERROR reported it yet.
    pub fn take_error(&self) -> Option<io::Error> {
        let e = self.failure()?;
        (!self.failure_reported.swap(true, Ordering::AcqRel)).then_some(e)
    }

    /// Bytes readable now (FIONREAD / SIOCINQ).
    pub fn readable_bytes(&self) -> usize {
        let core = self.stack.inner.lock();
        self.peeked_len.load(Ordering::Relaxed)
            + core
                .ep
                .connection(self.id)
                .map_or(0, |c| c.readable() as usize)
            + core
                .slots
                .get(&self.id)
                .map_or(0, |s| s.left_by_reset.len())
    }

    /// Bytes a write takes now without waiting (room in the peer's RMBE).
    pub fn write_room(&self) -> usize {
        let core = self.stack.inner.lock();
        core.ep
            .connection(self.id)
            .map_or(0, |c| c.write_room() as usize)
    }

    /// The readiness of this connection now.
    pub fn ready(&self) -> Ready {
        let mut out = [Ready::default()];
        Conn::ready_many(&[self], &mut out);
        out[0]
    }

    /// The readiness of several connections (of one stack) under one lock.
    pub fn ready_many(conns: &[&Conn], out: &mut [Ready]) {
        let Some(first) = conns.first() else {
            return;
        };
        let core = first.stack.inner.lock();
        for (c, o) in conns.iter().zip(out.iter_mut()) {
            if !Arc::ptr_eq(&c.stack.inner, &first.stack.inner) {
                *o = c.ready();
                continue;
            }
            let slot = core.slots.get(&c.id);
            if slot.is_some_and(|s| s.peer_exited) {
                // As a TCP socket after the peer's FIN.
                *o = Ready {
                    readable: true,
                    writable: true,
                    read_hup: true,
                    ..Ready::default()
                };
                continue;
            }
            let err = slot.and_then(|s| s.error);
            *o = match core.ep.connection(c.id) {
                None => Ready {
                    // (End of stream, or the bytes peeked before the connection ended.)
                    readable: true,
                    writable: true,
                    read_hup: true,
                    hup: true,
                    error: err.is_some(),
                    urgent: c.urgent.state.load(Ordering::Relaxed)
                        & crate::stream::UrgentSlot::PRESENT
                        != 0,
                },
                Some(conn) => {
                    let closed = conn.is_read_closed();
                    let peeked = c.peeked_len.load(Ordering::Relaxed) > 0;
                    Ready {
                        readable: peeked || conn.readable() > 0 || closed || err.is_some(),
                        // As `tcp_poll`: writable also once writing has ended (the peer
                        // closed, or this side shut writing down): a write does not block.
                        // POLLOUT from a third of the RMBE free, as `tcp_poll`'s
                        // (`smc_proto::conn::stream_writable`).
                        writable: conn.stream_writable() || conn.write_ended() || err.is_some(),
                        // As `tcp_poll`: RDHUP as soon as the peer is done writing, also
                        // while bytes before its end are unread. tokio counts on it: a read
                        // that returns less than asked clears its read readiness but keeps
                        // the read-closed one, so it reads once more and meets the end of
                        // stream; reported only once drained, the end came with no new
                        // edge after that read (a tokio echo server never saw its client's
                        // shutdown when the shutdown arrived while data was unread).
                        read_hup: conn.is_read_shut(),
                        hup: err.is_some(),
                        error: err.is_some(),
                        urgent: core.ep.urgent_offset(c.id).is_some()
                            || c.urgent.state.load(Ordering::Relaxed)
                                & crate::stream::UrgentSlot::PRESENT
                                != 0,
                    }
                }
            };
        }
    }

    /// How many times the read and the write eventfd were signalled so far.
    pub fn signal_counts(&self) -> (u64, u64) {
        (
            self.notify.read_count.load(Ordering::Acquire),
            self.notify.write_count.load(Ordering::Acquire),
        )
    }

    /// A wait that may sleep on [`notifier_fds`](Self::notifier_fds) from now on: the stack
    /// writes them only while one is armed (an event loop that finds its news by looking, in
    /// its own completion handling or its spin, then costs no `write` system call per CDC).
    /// Arm first, then look at the readiness, then sleep; [`disarm`](Self::disarm) after the
    /// sleep. A reactor that may sleep on them at any time arms once and never disarms.
    pub fn arm(&self) {
        self.notify.sleepers.arm();
    }

    /// The wait that [`arm`](Self::arm)ed is over.
    pub fn disarm(&self) {
        self.notify.sleepers.disarm();
    }

    /// Write both eventfds once, whether or not a wait is armed: a wait that sleeps on them
    /// then wakes and looks again (for a connection added to an epoll instance while a
    /// thread sleeps in it: that sleeper armed the instance's connections before).
    pub fn kick(&self) {
        Notifiers::signal(&self.notify.read);
        Notifiers::signal(&self.notify.write);
    }

    /// Wake every wait on this connection (the shared eventfds and every subscribed
    /// [`Waiter`]) without a change of its state: for a library that moved the program's
    /// number elsewhere (a relay), so that a wait already asleep on the connection looks at
    /// what the number names now.
    pub fn wake_all(&self) {
        self.kick();
        self.notify.signal_subscribers(true, true);
    }

    /// The raw numbers of both eventfds (read, write). Nobody drains them: each signal is an
    /// edge for an edge-triggered epoll registration; to sleep until a change, use a
    /// [`Waiter`] (draining a shared eventfd takes the wake-up from other waiting threads).
    /// They are written only while a wait is armed ([`arm`](Self::arm)).
    pub fn notifier_fds(&self) -> (RawFd, RawFd) {
        (self.notify.read.as_raw_fd(), self.notify.write.as_raw_fd())
    }

    /// The failure of the connection, if it has one, as the error a read would return.
    pub fn failure(&self) -> Option<io::Error> {
        let core = self.stack.inner.lock();
        core.slots
            .get(&self.id)
            .filter(|s| !s.peer_exited)
            .and_then(|s| s.error)
            .map(conn_error)
    }
}

/// A waiting thread's own wake-up for SMC-R connections: an eventfd that the stack signals
/// when a watched connection's reading or writing may progress, besides the connection's
/// shared eventfds. Threads that wait for one connection at the same time (a reader thread
/// and a writer thread polling one socket) each consume only their own signals: had they
/// drained the shared eventfd, a signal one consumed would never wake the other (poll looks
/// at a woken descriptor again and sleeps on when it finds it drained).
///
/// Watch the connections first, then look at their readiness, then sleep on [`fd`](Self::fd):
/// a change after the look is signalled. Dropping the waiter unsubscribes it.
#[derive(Debug)]
pub struct Waiter {
    fd: Arc<OwnedFd>,
    watched: Vec<Arc<Notifiers>>,
}

impl Waiter {
    /// A new waiter (one eventfd) watching nothing yet.
    pub fn new() -> io::Result<Waiter> {
        let flags = rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC;
        Ok(Waiter {
            fd: Arc::new(smc_fabric::fdplace::make(|| {
                rustix::event::eventfd(0, flags)
            })?),
            watched: Vec::new(),
        })
    }

    /// Be signalled when `c`'s reading (`read`) or writing (`write`) may progress (a failure
    /// signals both).
    pub fn watch(&mut self, c: &Conn, read: bool, write: bool) {
        let mut subs = c
            .notify
            .subscribers
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if self.watched.iter().any(|n| Arc::ptr_eq(n, &c.notify)) {
            // Watched already (a number twice in one poll, or a dup): both interests.
            for s in subs.iter_mut().filter(|s| Arc::ptr_eq(&s.fd, &self.fd)) {
                s.read |= read;
                s.write |= write;
            }
            return;
        }
        subs.push(crate::stack::Subscriber {
            fd: self.fd.clone(),
            read,
            write,
        });
        c.notify.subscribed.fetch_add(1, Ordering::AcqRel);
        drop(subs);
        self.watched.push(c.notify.clone());
    }

    /// The eventfd to sleep on (readable once a watched connection was signalled).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Consume the signals received so far (before looking at the connections again).
    pub fn clear(&self) {
        Notifiers::drain(&self.fd);
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        for n in self.watched.drain(..) {
            let mut subs = n.subscribers.lock().unwrap_or_else(|p| p.into_inner());
            let before = subs.len();
            subs.retain(|s| !Arc::ptr_eq(&s.fd, &self.fd));
            n.subscribed
                .fetch_sub(before - subs.len(), Ordering::AcqRel);
        }
    }
}

/// At process exit: wait (at most `max`) until the peers consumed what this process's
/// connections sent, or those connections ended. The shared-memory fabric notices a peer
/// process's death and fails its links, and a failed connection's unread bytes are gone;
/// kernel TCP would still deliver them after the sender exited. Call after closing the
/// connections the program left open.
pub fn linger(max: std::time::Duration) {
    let stack = match STACK.try_lock() {
        Ok(g) => g.clone(),
        Err(_) => return,
    };
    let Some(stack) = stack else {
        return;
    };
    let deadline = std::time::Instant::now() + max;
    loop {
        let pending = {
            let core = stack.inner.lock();
            core.slots.iter().any(|(id, s)| {
                s.error.is_none()
                    && !s.closed
                    && core.ep.connection(*id).is_some_and(|c| {
                        crate::stream::cursor_distance(
                            c.peer_consumer_cursor(),
                            c.producer_cursor(),
                            c.config().peer_rmbe_len,
                        ) > 0
                    })
            })
        };
        if !pending || std::time::Instant::now() >= deadline {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Wait until `fd` (an eventfd) is readable, a signal handler ran (`Interrupted`) or the
/// deadline passed (`WouldBlock`). Bounded slices: a connection that ends without a signal
/// (never, the stack signals failures) is looked at again within a second; without `fd`,
/// within 10 ms.
fn wait_fd(fd: Option<BorrowedFd<'_>>, deadline: Option<std::time::Instant>) -> io::Result<()> {
    let slice = if fd.is_some() {
        std::time::Duration::from_secs(1)
    } else {
        std::time::Duration::from_millis(10)
    };
    let ts = slice_left(deadline, slice)?;
    let mut fds: Vec<rustix::event::PollFd<'_>> = fd
        .into_iter()
        .map(|fd| rustix::event::PollFd::from_borrowed_fd(fd, rustix::event::PollFlags::IN))
        .collect();
    match rustix::event::poll(&mut fds, Some(&ts)) {
        Ok(_) => Ok(()),
        Err(rustix::io::Errno::INTR) => Err(io::ErrorKind::Interrupted.into()),
        Err(e) => Err(e.into()),
    }
}

/// How long one bounded wait may sleep: `slice`, or less when `deadline` comes first;
/// `WouldBlock` once it has passed.
fn slice_left(
    deadline: Option<std::time::Instant>,
    slice: std::time::Duration,
) -> io::Result<rustix::event::Timespec> {
    let left = match deadline {
        Some(d) => {
            let left = d.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            left.min(slice)
        }
        None => slice,
    };
    Ok(rustix::event::Timespec {
        tv_sec: left.as_secs() as i64,
        tv_nsec: i64::from(left.subsec_nanos()),
    })
}

/// [`wait_fd`] on `fd` and the completion channels `channels` (while the caller is the
/// poller); `fired` tells which channels were readable.
fn wait_fds(
    fd: BorrowedFd<'_>,
    channels: &[RawFd],
    fired: &mut [bool],
    deadline: Option<std::time::Instant>,
) -> io::Result<()> {
    if channels.is_empty() {
        return wait_fd(Some(fd), deadline);
    }
    let slice = std::time::Duration::from_secs(1);
    let ts = slice_left(deadline, slice)?;
    // SAFETY: the channels are the stack's completion channels, open while the stack is (the
    // process-wide stack is never dropped).
    let borrowed: Vec<BorrowedFd<'_>> = channels
        .iter()
        .map(|&c| unsafe { BorrowedFd::borrow_raw(c) })
        .collect();
    let mut fds: Vec<rustix::event::PollFd<'_>> = std::iter::once(
        rustix::event::PollFd::from_borrowed_fd(fd, rustix::event::PollFlags::IN),
    )
    .chain(
        borrowed
            .iter()
            .map(|&c| rustix::event::PollFd::from_borrowed_fd(c, rustix::event::PollFlags::IN)),
    )
    .collect();
    let r = rustix::event::poll(&mut fds, Some(&ts));
    for (f, p) in fired.iter_mut().zip(&fds[1..]) {
        *f = !p.revents().is_empty();
    }
    match r {
        Ok(_) => Ok(()),
        Err(rustix::io::Errno::INTR) => Err(io::ErrorKind::Interrupted.into()),
        Err(e) => Err(e.into()),
    }
}

/// What [`poller_prepare`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PollerState {
    /// Another thread polls the completion queues: sleep as usual (its handling signals the
    /// connections' eventfds).
    Other,
    /// Completions were handled just now: look at the connections again before sleeping.
    Progress,
    /// The calling thread is the poller and the completion channels are armed: sleep on them
    /// too (see [`completion_fds`]) and call [`poller_finish`] after.
    Armed,
}

/// The completion channels of the calling process's stack, for an event loop's wait: while its
/// thread is the poller ([`poller_prepare`]), a doorbell wakes it directly rather than through
/// the stack's runtime thread (one wake-up per message instead of two). Empty when this
/// process has no stack.
pub fn completion_fds() -> Vec<RawFd> {
    let stack = match STACK.try_lock() {
        Ok(g) => g.clone(),
        Err(_) => None,
    };
    stack.map_or_else(Vec::new, |s| {
        s.inner.cqs.iter().map(|c| c.fd().as_raw_fd()).collect()
    })
}

/// At the start of an event loop's wait call (epoll, poll, select): handle what the completion
/// queues hold now, unless another thread polls them, and note that this loop does so (see
/// `Inner::loop_polled_at`): while the loop calls this regularly, the runtime thread stays
/// off the channels (no doorbell wakes it, and the peer rings none while nobody sleeps on
/// them), and the loop's readiness check that follows sees the news of its connections.
pub fn poll_before_wait() {
    let Some(stack) = current_stack() else {
        return;
    };
    let inner = &stack.inner;
    if !inner.poller.load(Ordering::Acquire) {
        loop_poll(inner, &mut [smc_fabric::WorkCompletion::EMPTY; 32]);
    }
}

/// An event loop's look at the completion queues: handle what they hold and note when the
/// loop did (`Inner::loop_polled_at`).
fn loop_poll(inner: &crate::stack::Inner, wcs: &mut [smc_fabric::WorkCompletion]) {
    let mut core = inner.lock();
    if core.poll_completions(wcs) {
        core.drain();
    }
    inner
        .loop_polled_at
        .store(core.now_micros(), Ordering::Release);
}

/// Before an event loop's thread sleeps with the completion channels among what it waits on:
/// become the stack's poller unless another thread is, handle what is there, arm the channels
/// and look once more (arm, then recheck, as verbs want).
pub fn poller_prepare() -> PollerState {
    let Some(stack) = current_stack() else {
        return PollerState::Other;
    };
    let inner = &stack.inner;
    let mut wcs = [smc_fabric::WorkCompletion::EMPTY; 32];
    let mut core = inner.lock();
    if inner.poller.swap(true, Ordering::AcqRel) {
        return PollerState::Other;
    }
    inner.poller_at.store(core.now_micros(), Ordering::Release);
    if core.poll_completions(&mut wcs) {
        core.drain();
        inner.poller.store(false, Ordering::Release);
        return PollerState::Progress;
    }
    for cq in &inner.cqs {
        cq.req_notify();
    }
    if core.poll_completions(&mut wcs) {
        core.drain();
        inner.poller.store(false, Ordering::Release);
        return PollerState::Progress;
    }
    PollerState::Armed
}

/// After the sleep that followed [`PollerState::Armed`]: consume the channels' readiness
/// (`fired`: which of [`completion_fds`] were readable), handle the completions, stop being the
/// poller.
pub fn poller_finish(fired: &[bool]) {
    let Some(stack) = current_stack() else {
        return;
    };
    let inner = &stack.inner;
    let mut wcs = [smc_fabric::WorkCompletion::EMPTY; 32];
    let mut core = inner.lock();
    for (cq, f) in inner.cqs.iter().zip(fired) {
        if *f {
            cq.ack_notify();
        }
    }
    inner.poller_at.store(core.now_micros(), Ordering::Release);
    core.poll_completions(&mut wcs);
    core.drain();
    inner.poller.store(false, Ordering::Release);
}

fn current_stack() -> Option<Stack> {
    STACK.try_lock().ok().and_then(|g| g.clone())
}
