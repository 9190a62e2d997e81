//! The socket and descriptor calls: connect, listen, accept, the data calls, close, dup,
//! fcntl, ioctl, getsockopt, shutdown, sendfile (exec: `exec.rs`).

use std::net::{Shutdown, SocketAddr};
use std::os::fd::BorrowedFd;
use std::sync::Arc;

use libc::{c_int, c_ulong, c_void, iovec, msghdr, off_t, size_t, sockaddr, socklen_t, ssize_t};
use smc::fdapi::{self, Conn, Setup};

use crate::table::{self, Entry, Kind};
use crate::{errno_of, guard, log, real, set_errno};

/// What a call on a descriptor goes to.
pub(crate) enum Target {
    /// The C library (not managed, or a connection on TCP).
    Pass,
    /// An SMC-R connection of this process.
    Smc(Arc<Conn>),
    /// An SMC-R connection of another process that cannot be relayed here (inherited across
    /// exec, or its owner is gone): fails.
    Foreign,
    /// An SMC-R connection relayed through the process whose stack holds it (`relay.rs`):
    /// the call is made on this process's copy of the relay socket.
    Relay(Arc<crate::relay::Relay>),
}

/// Borrow a raw descriptor for a call that does not outlive it.
pub(crate) fn bfd<'a>(fd: c_int) -> BorrowedFd<'a> {
    // SAFETY: the program's descriptor, open for the duration of the call.
    unsafe { BorrowedFd::borrow_raw(fd) }
}

/// The O_NONBLOCK flag of `fd`'s open file description.
pub(crate) fn nonblocking_flag(fd: c_int) -> bool {
    // SAFETY: plain fcntl.
    let fl = unsafe { real::fcntl(fd, libc::F_GETFL, 0) };
    fl >= 0 && fl & libc::O_NONBLOCK != 0
}

/// Set or clear O_NONBLOCK on `fd`.
pub(crate) fn set_nonblocking_flag(fd: c_int, on: bool) {
    // SAFETY: plain fcntl.
    unsafe {
        let fl = real::fcntl(fd, libc::F_GETFL, 0);
        if fl >= 0 {
            let nfl = if on {
                fl | libc::O_NONBLOCK
            } else {
                fl & !libc::O_NONBLOCK
            };
            real::fcntl(fd, libc::F_SETFL, nfl as usize);
        }
    }
}

/// Run a rendezvous on `fd` in blocking mode (the program's flag is put back after).
pub(crate) fn blocking<R>(fd: c_int, f: impl FnOnce() -> R) -> (R, bool) {
    let nb = nonblocking_flag(fd);
    if nb {
        set_nonblocking_flag(fd, false);
    }
    let r = f();
    if nb {
        set_nonblocking_flag(fd, true);
    }
    (r, nb)
}

/// Install what a rendezvous on `fd` ended in.
pub(crate) fn install(fd: c_int, setup: Setup, nonblocking: bool) {
    if let Setup::Smc(c) = &setup {
        crate::wait::adopt(fd, c);
    }
    let kind = kind_of(fd, setup, nonblocking);
    if let Some(old) = table::set(fd, Entry::new(kind)).ok().flatten() {
        table::release(old);
    }
}

/// Install what a rendezvous on `fd` ended in if `old` is still the entry of `fd` (the
/// program may have closed or reused the number meanwhile); `false`: not installed (what
/// the rendezvous made is dropped: an SMC-R connection is closed).
pub(crate) fn install_if(fd: c_int, old: &Arc<Entry>, setup: Setup, nonblocking: bool) -> bool {
    let smc = match &setup {
        Setup::Smc(c) => Some(c.clone()),
        Setup::Tcp(_) => None,
    };
    let new = Entry::new(kind_of(fd, setup, nonblocking));
    if let Some(id) = old.socket.get() {
        let _ = new.socket.set(*id);
    }
    if !table::replace(fd, old, new) {
        return false;
    }
    if let Some(c) = smc {
        crate::wait::adopt(fd, &c);
    }
    true
}

/// The entry kind of what a rendezvous on `fd` ended in.
pub(crate) fn kind_of(fd: c_int, setup: Setup, nonblocking: bool) -> Kind {
    match setup {
        Setup::Smc(c) => {
            c.set_nonblocking(nonblocking);
            log!("fd {fd}: SMC-R");
            Kind::Smc(c)
        }
        Setup::Tcp(t) => {
            log!("fd {fd}: TCP ({:?})", t.mode());
            if t.strips_crossed() {
                CROSSING.store(true, std::sync::atomic::Ordering::Relaxed);
            }
            Kind::Tcp(t)
        }
    }
}

/// Whether some connection fell back to TCP after our own Decline (reads look no further
/// until then).
static CROSSING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Before the program reads a TCP connection that fell back after our own Decline: the
/// peer's CLC messages that crossed the Decline are taken out of the socket first
/// (`TcpConn::strip_crossed`; without this a root client and a server run by another user,
/// whose stacks cannot reach each other's fabric directory, both declined and each program
/// read the other's Decline as 28 bytes of data). `None`: go on with the read; `Some(-1)`:
/// the read fails with the errno set (nothing readable yet for a nonblocking read, or the
/// wait was interrupted).
pub(crate) fn crossed(fd: c_int, flags: c_int) -> Option<ssize_t> {
    if !CROSSING.load(std::sync::atomic::Ordering::Relaxed) || !table::maybe(fd) || crate::inside()
    {
        return None;
    }
    let e = table::get(fd)?;
    let Kind::Tcp(t) = &e.kind else {
        return None;
    };
    if !t.strips_crossed() {
        return None;
    }
    let wait = flags & libc::MSG_DONTWAIT == 0 && !nonblocking_flag(fd);
    guard(Some(-1), || match t.strip_crossed(bfd(fd), wait) {
        Ok(()) => None,
        Err(e) => {
            set_errno(e.raw_os_error().unwrap_or(libc::EIO));
            Some(-1)
        }
    })
}

/// What the descriptor `fd` names for a data call; an accepted connection waiting for its
/// server rendezvous runs it now (this process uses it first).
pub(crate) fn target(fd: c_int) -> Target {
    if !table::maybe(fd) || crate::inside() {
        return Target::Pass;
    }
    let Some(e) = table::get(fd) else {
        return Target::Pass;
    };
    match &e.kind {
        Kind::Smc(c) if e.ours() => Target::Smc(c.clone()),
        Kind::Relayed(r) => Target::Relay(r.clone()),
        Kind::Smc(_) => {
            // Another process's connection (inherited across fork): relayed through it. Not
            // from the child of a vfork, which must leave its parent's table alone.
            if table::borrowed_memory() || e.ours() {
                return if e.ours() {
                    target(fd)
                } else {
                    Target::Foreign
                };
            }
            ask_relay(fd, crate::relay::Owner::of_tree(e.pid))
        }
        // A connection of another process named by the image before the exec.
        Kind::Inherited(Some(owner)) if !table::borrowed_memory() => ask_relay(fd, *owner),
        Kind::Inherited(_) => Target::Foreign,
        // A client handshake still waiting for the server's answer: finished first (a
        // write may not reach the TCP socket in front of the CLC messages).
        Kind::Connecting(c) if e.ours() => {
            crate::connecting::finish(&e, c);
            target(fd)
        }
        // (Finished before every fork: a copy here is another process's, mid handshake.)
        Kind::Connecting(_) => Target::Foreign,
        Kind::Pending(once) => {
            // In a process cloned without fork handlers, its own stack (see there).
            let _ = table::borrowed_memory();
            // One thread runs the rendezvous; another one using the number meanwhile waits
            // for it and then looks again.
            let _g = once.lock().unwrap_or_else(|p| p.into_inner());
            match table::get(fd) {
                Some(now) if Arc::ptr_eq(&now, &e) => {}
                _ => return target(fd),
            }
            if table::sandboxed_clone()
                && e.pid != table::PID.load(std::sync::atomic::Ordering::Relaxed)
            {
                return cloned_as_tcp(fd);
            }
            let (r, nb) = blocking(fd, || fdapi::setup_server(bfd(fd)));
            match r {
                Ok(setup) => {
                    install(fd, setup, nb);
                    target(fd)
                }
                Err(e) => {
                    log!("fd {fd}: server rendezvous failed: {e}");
                    if let Some(old) = table::take(fd) {
                        table::release(old);
                    }
                    Target::Pass
                }
            }
        }
        _ => Target::Pass,
    }
}

/// [`target`] for a call that must not wait for a client handshake in progress (the wait
/// calls, SO_ERROR, O_NONBLOCK): such a connection is its real TCP socket for now.
pub(crate) fn target_wait(fd: c_int) -> Target {
    if table::maybe(fd) && !crate::inside() {
        if let Some(e) = table::get(fd) {
            if matches!(e.kind, Kind::Connecting(_)) && e.ours() {
                return Target::Pass;
            }
        }
    }
    target(fd)
}

/// An accepted connection made before a raw `clone` into new namespaces and first used in
/// the clone: settled as TCP (the client's Proposal declined, `CLONED`). A process made that
/// way ran no fork handler, so no relay could serve a connection it owned to the processes
/// it clones in turn: vsftpd's session process (`CLONE_NEWIPC`) clones the one that talks to
/// the client into a new network namespace with `RLIMIT_NOFILE` 0, which could not reach a
/// relay (nor open one). A raw clone without namespaces serves the connection over a stack
/// of its own, as before.
fn cloned_as_tcp(fd: c_int) -> Target {
    pending_as_tcp(
        fd,
        fdapi::decline_cloned,
        "accepted before a raw clone, first used in it",
    );
    Target::Pass
}

/// Settle the pending accepted connection `fd` as TCP: its client's Proposal answered by
/// `decline`, the entry gone (the caller holds the entry's lock). `why` goes to the log.
fn pending_as_tcp(
    fd: c_int,
    decline: fn(std::os::fd::BorrowedFd<'_>) -> std::io::Result<bool>,
    why: &str,
) {
    let (r, _) = blocking(fd, || decline(bfd(fd)));
    match r {
        Ok(_) => log!("fd {fd}: {why}: TCP"),
        Err(e) => log!("fd {fd}: {why}: {e}"),
    }
    if let Some(old) = table::take(fd) {
        table::release(old);
    }
}

/// Accepted connections waiting for their first use that the program passes to another
/// process (SCM_RIGHTS naming `fds`): settled as TCP first (the client's Proposal declined,
/// `PASSED`). The receiver's library would find no owner to ask for it, and left pending,
/// the client would wait for an Accept nobody sends, and the sender's close would reset the
/// connection over the client's unread CLC bytes (vsftpd's passive data connections: the
/// privileged process accepts, the session process sends the file). SMC-R connections are
/// announced to their owners (`relay::passing`).
fn settle_passed(fds: &[c_int]) {
    for &fd in fds {
        if !table::maybe(fd) {
            continue;
        }
        let Some(e) = table::get(fd) else {
            continue;
        };
        if let Kind::Connecting(c) = &e.kind {
            // The receiver has no entry for it: the handshake ends here first.
            if e.ours() {
                crate::connecting::finish(&e, c);
            }
            continue;
        }
        let Kind::Pending(once) = &e.kind else {
            continue;
        };
        let _g = once.lock().unwrap_or_else(|p| p.into_inner());
        if !table::get(fd).is_some_and(|now| Arc::ptr_eq(&now, &e)) {
            continue;
        }
        pending_as_tcp(
            fd,
            fdapi::decline_passed,
            "accepted connection passed to another process",
        );
    }
}

/// Ask `owner` for a relay of `fd`'s connection (this process's first use of it).
fn ask_relay(fd: c_int, owner: crate::relay::Owner) -> Target {
    match crate::relay::attach(fd, owner) {
        Ok(r) => Target::Relay(r),
        Err(err) => {
            let err = std::io::Error::from_raw_os_error(err);
            log!("fd {fd}: no relay from process {} ({err})", owner.pid);
            Target::Foreign
        }
    }
}

/// Fail a call on another process's connection.
pub(crate) fn foreign(fd: c_int) -> ssize_t {
    log!("fd {fd}: an SMC-R connection of another process, not relayed; the call fails with EIO");
    set_errno(libc::EIO);
    -1
}

pub(crate) fn io_result(r: std::io::Result<usize>) -> ssize_t {
    match r {
        Ok(n) => n as ssize_t,
        Err(e) => {
            if fdapi::is_handed_over(&e) {
                HANDED_OVER.with(|h| h.set(true));
            }
            set_errno(errno_of(&e));
            -1
        }
    }
}

/// A write's failure: EPIPE also raises SIGPIPE unless MSG_NOSIGNAL, as for TCP (the first
/// write to meet a reset gets ECONNRESET and no signal; the later ones EPIPE, see
/// `smc::fdapi::Conn::write`).
pub(crate) fn write_result(r: std::io::Result<usize>, nosignal: bool) -> ssize_t {
    match r {
        Ok(n) => n as ssize_t,
        Err(e) => {
            let n = errno_of(&e);
            if n == libc::EPIPE && !nosignal {
                // SAFETY: raising a signal on the calling thread.
                unsafe { libc::raise(libc::SIGPIPE) };
            }
            set_errno(n);
            -1
        }
    }
}

/// Whether `fd` is a TCP socket of family AF_INET or AF_INET6.
pub(crate) fn is_inet_stream(fd: c_int) -> bool {
    let get = |name| sock_opt(fd, name);
    matches!(get(libc::SO_DOMAIN), Some(libc::AF_INET | libc::AF_INET6))
        && get(libc::SO_TYPE) == Some(libc::SOCK_STREAM)
        && matches!(get(libc::SO_PROTOCOL), Some(0 | libc::IPPROTO_TCP))
}

/// An int socket option (SOL_SOCKET) of `fd` (`None`: not a socket, or no such option).
pub(crate) fn sock_opt(fd: c_int, name: c_int) -> Option<c_int> {
    let mut v: c_int = 0;
    let mut len = std::mem::size_of::<c_int>() as socklen_t;
    // SAFETY: an int and its length.
    let r = unsafe {
        real::getsockopt(
            fd,
            libc::SOL_SOCKET,
            name,
            (&mut v as *mut c_int).cast(),
            &mut len,
        )
    };
    (r == 0).then_some(v)
}

/// A socket address from C.
pub(crate) unsafe fn sockaddr_of(addr: *const sockaddr, len: socklen_t) -> Option<SocketAddr> {
    if addr.is_null() {
        return None;
    }
    // SAFETY: the caller's address of `len` bytes.
    let family = c_int::from(unsafe { (*addr).sa_family });
    match family {
        libc::AF_INET if len as usize >= std::mem::size_of::<libc::sockaddr_in>() => {
            // SAFETY: checked family and length.
            let a = unsafe { &*(addr as *const libc::sockaddr_in) };
            Some(SocketAddr::from((
                u32::from_be(a.sin_addr.s_addr).to_be_bytes(),
                u16::from_be(a.sin_port),
            )))
        }
        libc::AF_INET6 if len as usize >= std::mem::size_of::<libc::sockaddr_in6>() => {
            // SAFETY: checked family and length.
            let a = unsafe { &*(addr as *const libc::sockaddr_in6) };
            Some(SocketAddr::V6(std::net::SocketAddrV6::new(
                a.sin6_addr.s6_addr.into(),
                u16::from_be(a.sin6_port),
                u32::from_be(a.sin6_flowinfo),
                a.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

#[no_mangle]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    // (A number may be marked with no entry left: a process cloned without fork handlers
    // keeps its parent's marks and starts an empty table.)
    if (!table::maybe(fd) || table::get(fd).is_none()) && is_inet_stream(fd) {
        guard((), || match fdapi::listen_mark(bfd(fd)) {
            Ok(Some(l)) => {
                log!("fd {fd}: listening on port {} (SMC-R offered)", l.port());
                if let Ok(Some(old)) = table::set(fd, Entry::new(Kind::Listener(l))) {
                    table::release(old);
                }
            }
            Ok(None) => log!("fd {fd}: listening without discovery (TCP only)"),
            Err(e) => log!("fd {fd}: listening, discovery failed: {e} (TCP only)"),
        });
    }
    // SAFETY: passed on unchanged.
    unsafe { real::listen(fd, backlog) }
}

/// After the real accept of `new` on listening socket `fd`.
fn accepted(fd: c_int, new: c_int) {
    let Some(e) = table::get(fd) else {
        return;
    };
    let Kind::Listener(l) = &e.kind else {
        return;
    };
    guard((), || match l.accepted(bfd(new)) {
        Ok(true) => {
            let e = Entry::new(Kind::Pending(Default::default()));
            if let Ok(old) = table::set(new, e.clone()) {
                if let Some(old) = old {
                    table::release(old);
                }
                crate::settle::accepted(new, &e);
            }
        }
        Ok(false) => match fdapi::accepted_tcp(bfd(new)) {
            Ok(t) => install(new, Setup::Tcp(t), false),
            Err(e) => log!("fd {new}: {e}"),
        },
        Err(e) => log!("fd {new}: discovery: {e}"),
    });
}

#[no_mangle]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // SAFETY: passed on unchanged.
    let new = unsafe { real::accept(fd, addr, len) };
    if new >= 0 && table::maybe(fd) {
        accepted(fd, new);
    }
    new
}

#[no_mangle]
pub unsafe extern "C" fn accept4(
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
    flags: c_int,
) -> c_int {
    // SAFETY: passed on unchanged.
    let new = unsafe { real::accept4(fd, addr, len, flags) };
    if new >= 0 && table::maybe(fd) {
        accepted(fd, new);
    }
    new
}

/// Slices of the caller's iovecs.
unsafe fn iovecs<'a>(iov: *const iovec, n: c_int) -> Vec<&'a mut [u8]> {
    if iov.is_null() || n <= 0 {
        return Vec::new();
    }
    // SAFETY: the caller's array of `n` iovecs.
    let v = unsafe { std::slice::from_raw_parts(iov, n as usize) };
    v.iter()
        .filter(|i| !i.iov_base.is_null() && i.iov_len > 0)
        // SAFETY: each iovec names the caller's buffer.
        .map(|i| unsafe { std::slice::from_raw_parts_mut(i.iov_base.cast::<u8>(), i.iov_len) })
        .collect()
}

std::thread_local! {
    /// The last read of this thread failed because its connection became relayed meanwhile
    /// (`fdapi::Conn::hand_over`).
    static HANDED_OVER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// recv on an SMC-R connection with flags; when the connection became relayed before or
/// during the call (another process asked for it, `relay.rs`), the read is made on the relay
/// socket, which has the bytes that follow those this process already read.
pub(crate) fn smc_recv(c: &Conn, bufs: &mut [&mut [u8]], flags: c_int) -> ssize_t {
    if !c.handed_over() {
        HANDED_OVER.with(|h| h.set(false));
        let n = smc_recv_conn(c, bufs, flags);
        if n >= 0 || !HANDED_OVER.with(|h| h.replace(false)) {
            return n;
        }
        log!("a read under way when its connection became relayed: redone on the relay socket");
    }
    match crate::relay::of_conn(c) {
        Some(r) => crate::relay::recv_bufs(&r, bufs, flags),
        None => {
            set_errno(libc::EIO);
            -1
        }
    }
}

/// recv on an SMC-R connection of this process's stack with flags.
fn smc_recv_conn(c: &Conn, bufs: &mut [&mut [u8]], flags: c_int) -> ssize_t {
    if flags & libc::MSG_OOB != 0 {
        // The urgent byte, out of band as TCP keeps it without SO_OOBINLINE.
        let Some(first) = bufs.iter_mut().find(|b| !b.is_empty()) else {
            return 0;
        };
        return match c.read_urgent(flags & libc::MSG_PEEK != 0) {
            Ok(b) => {
                first[0] = b;
                1
            }
            Err(e) => io_result(Err(e)),
        };
    }
    if flags & libc::MSG_PEEK != 0 {
        let Some(first) = bufs.iter_mut().find(|b| !b.is_empty()) else {
            return 0;
        };
        return io_result(c.peek(first, flags & libc::MSG_DONTWAIT != 0));
    }
    let dontwait = flags & libc::MSG_DONTWAIT != 0;
    let timeout = c.timeout(false);
    if !dontwait && !c.nonblocking() && (interruptible() || timeout.is_some()) {
        // A wait that a signal handler interrupts (EINTR) and SO_RCVTIMEO ends (EAGAIN).
        let Some(first) = bufs.iter_mut().position(|b| !b.is_empty()) else {
            return 0;
        };
        let n = match c.read_interruptible(bufs[first], timeout) {
            Ok(n) => n,
            Err(e) => return io_result(Err(e)),
        };
        if n < bufs[first].len() || n == 0 {
            return n as ssize_t;
        }
        let more = c.read_vectored(&mut bufs[first + 1..], true).unwrap_or(0);
        return (n + more) as ssize_t;
    }
    if flags & libc::MSG_WAITALL != 0 && !dontwait && !c.nonblocking() {
        let want: usize = bufs.iter().map(|b| b.len()).sum();
        let mut got = 0usize;
        while got < want {
            // The first `got` bytes are in; read into what is left.
            let mut skip = got;
            let mut rest: Vec<&mut [u8]> = Vec::new();
            for b in bufs.iter_mut() {
                if skip >= b.len() {
                    skip -= b.len();
                    continue;
                }
                rest.push(&mut b[skip..]);
                skip = 0;
            }
            match c.read_vectored(&mut rest, false) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if got > 0 => {
                    let _ = e;
                    break;
                }
                Err(e) => return io_result(Err(e)),
            }
        }
        return got as ssize_t;
    }
    io_result(c.read_vectored(bufs, dontwait))
}

/// send on an SMC-R connection with flags.
pub(crate) fn smc_send(c: &Conn, bufs: &[&[u8]], flags: c_int) -> ssize_t {
    let dontwait = flags & libc::MSG_DONTWAIT != 0;
    let nosignal = flags & libc::MSG_NOSIGNAL != 0;
    if flags & libc::MSG_OOB != 0 {
        // Urgent data: the last byte is urgent (SMC-R's urgent data, RFC 7609 §4.7.5).
        let all: Vec<u8> = bufs.concat();
        return write_result(c.write_urgent(&all, dontwait), nosignal);
    }
    if dontwait || c.nonblocking() {
        return write_result(c.write_vectored(bufs, true), nosignal);
    }
    // Blocking: everything is written, as a blocking TCP send does, unless a signal handler
    // interrupts (the bytes written so far count) or SO_SNDTIMEO passes.
    let timeout = c.timeout(true);
    let plain = !interruptible() && timeout.is_none();
    let mut total = 0usize;
    for b in bufs {
        let mut off = 0;
        while off < b.len() {
            let r = if plain {
                c.write(&b[off..], false)
            } else {
                c.write_interruptible(&b[off..], timeout)
            };
            match r {
                Ok(n) => off += n,
                Err(_) if total + off > 0 => return (total + off) as ssize_t,
                Err(e) => return write_result(Err(e), nosignal),
            }
        }
        total += off;
    }
    total as ssize_t
}

/// Whether the program installed a signal handler without SA_RESTART: then a blocking call
/// on an SMC-R connection must return EINTR when it runs, so it waits in one interruptible
/// system call (without such a handler, the kernel would restart the call: the stack's own
/// faster wait serves).
fn interruptible() -> bool {
    INTERRUPTIBLE.load(std::sync::atomic::Ordering::Relaxed)
}

static INTERRUPTIBLE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The C library's sigaction, resolved at first use (not through the constructor's table: a
/// raw rt_sigaction takes another structure).
unsafe fn real_sigaction(
    sig: c_int,
    act: *const libc::sigaction,
    old: *mut libc::sigaction,
) -> c_int {
    type F = unsafe extern "C" fn(c_int, *const libc::sigaction, *mut libc::sigaction) -> c_int;
    static P: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let mut p = P.load(std::sync::atomic::Ordering::Relaxed);
    if p == 0 {
        // SAFETY: a NUL-terminated name.
        p = unsafe { libc::dlsym(libc::RTLD_NEXT, c"sigaction".as_ptr()) } as usize;
        P.store(p, std::sync::atomic::Ordering::Relaxed);
    }
    if p == 0 {
        set_errno(libc::ENOSYS);
        return -1;
    }
    // SAFETY: dlsym's address of sigaction.
    let f: F = unsafe { std::mem::transmute(p) };
    // SAFETY: passed on unchanged.
    unsafe { f(sig, act, old) }
}

#[no_mangle]
pub unsafe extern "C" fn sigaction(
    sig: c_int,
    act: *const libc::sigaction,
    old: *mut libc::sigaction,
) -> c_int {
    if !act.is_null() {
        // SAFETY: the caller's action.
        let a = unsafe { act.read_unaligned() };
        if a.sa_sigaction != libc::SIG_DFL
            && a.sa_sigaction != libc::SIG_IGN
            && a.sa_flags & libc::SA_RESTART == 0
        {
            INTERRUPTIBLE.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
    // SAFETY: passed on unchanged.
    unsafe { real_sigaction(sig, act, old) }
}

#[no_mangle]
pub unsafe extern "C" fn setsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    // SAFETY: passed on unchanged.
    let r = unsafe { real::setsockopt(fd, level, name, val, len) };
    if r == 0
        && level == libc::SOL_SOCKET
        && name == libc::SO_OOBINLINE
        && !val.is_null()
        && len as usize >= std::mem::size_of::<c_int>()
        && table::maybe(fd)
    {
        if let Target::Smc(c) = target(fd) {
            // SAFETY: the caller's int.
            c.set_oobinline(unsafe { (val as *const c_int).read_unaligned() } != 0);
        }
    }
    if r == 0
        && level == libc::SOL_SOCKET
        && (name == libc::SO_RCVTIMEO || name == libc::SO_SNDTIMEO)
        && !val.is_null()
        && len as usize >= std::mem::size_of::<libc::timeval>()
        && table::maybe(fd)
    {
        match target(fd) {
            Target::Smc(c) => {
                // SAFETY: the caller's timeval of `len` bytes.
                let tv = unsafe { (val as *const libc::timeval).read_unaligned() };
                let t = std::time::Duration::from_secs(tv.tv_sec.max(0) as u64)
                    + std::time::Duration::from_micros(tv.tv_usec.max(0) as u64);
                c.set_timeout(name == libc::SO_SNDTIMEO, (!t.is_zero()).then_some(t));
            }
            Target::Relay(r) => {
                // Mirrored on the relay socket, which every holder shares as it shares the
                // TCP socket.
                // SAFETY: the caller's timeval of `len` bytes.
                unsafe { real::setsockopt(r.fd(), level, name, val, len) };
            }
            _ => {}
        }
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    if let Some(r) = crate::connecting::read_would_block(fd, 0) {
        return r;
    }
    match target(fd) {
        // SAFETY: passed on unchanged.
        Target::Pass => crossed(fd, 0).unwrap_or_else(|| unsafe { real::read(fd, buf, n) }),
        Target::Foreign => foreign(fd),
        // SAFETY: the caller's buffer, on the relay socket.
        Target::Relay(r) => unsafe { real::read(r.fd(), buf, n) },
        Target::Smc(c) => guard(-1, || {
            if n == 0 {
                return 0;
            }
            // SAFETY: the caller's buffer of `n` bytes.
            let b = unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), n) };
            smc_recv(&c, &mut [b], 0)
        }),
    }
}

#[no_mangle]
pub unsafe extern "C" fn __read_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    _len: size_t,
) -> ssize_t {
    // SAFETY: as read.
    unsafe { read(fd, buf, n) }
}

#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    match target(fd) {
        // SAFETY: passed on unchanged.
        Target::Pass => unsafe { real::write(fd, buf, n) },
        Target::Foreign => foreign(fd),
        // SAFETY: the caller's buffer, on the relay socket.
        Target::Relay(r) => unsafe { real::write(r.fd(), buf, n) },
        Target::Smc(c) => guard(-1, || {
            if n == 0 {
                return 0;
            }
            // SAFETY: the caller's buffer of `n` bytes.
            let b = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), n) };
            smc_send(&c, &[b], 0)
        }),
    }
}

#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t {
    if let Some(r) = crate::connecting::read_would_block(fd, 0) {
        return r;
    }
    match target(fd) {
        // SAFETY: passed on unchanged.
        Target::Pass => crossed(fd, 0).unwrap_or_else(|| unsafe { real::readv(fd, iov, n) }),
        Target::Foreign => foreign(fd),
        // SAFETY: the caller's iovecs, on the relay socket.
        Target::Relay(r) => unsafe { real::readv(r.fd(), iov, n) },
        Target::Smc(c) => guard(-1, || {
            // SAFETY: the caller's iovecs.
            let mut v = unsafe { iovecs(iov, n) };
            if v.is_empty() {
                return 0;
            }
            smc_recv(&c, &mut v, 0)
        }),
    }
}

#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t {
    match target(fd) {
        // SAFETY: passed on unchanged.
        Target::Pass => unsafe { real::writev(fd, iov, n) },
        Target::Foreign => foreign(fd),
        // SAFETY: the caller's iovecs, on the relay socket.
        Target::Relay(r) => unsafe { real::writev(r.fd(), iov, n) },
        Target::Smc(c) => guard(-1, || {
            // SAFETY: the caller's iovecs.
            let v = unsafe { iovecs(iov, n) };
            if v.is_empty() {
                return 0;
            }
            let v: Vec<&[u8]> = v.into_iter().map(|b| &*b).collect();
            smc_send(&c, &v, 0)
        }),
    }
}

#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    if let Some(r) = crate::connecting::read_would_block(fd, flags) {
        return r;
    }
    match target(fd) {
        // SAFETY: passed on unchanged.
        Target::Pass => {
            crossed(fd, flags).unwrap_or_else(|| unsafe { real::recv(fd, buf, n, flags) })
        }
        Target::Foreign => foreign(fd),
        // SAFETY: the caller's buffer, on the relay socket.
        Target::Relay(r) => unsafe { crate::relay::recv(&r, buf, n, flags) },
        Target::Smc(c) => guard(-1, || {
            if n == 0 {
                return 0;
            }
            // SAFETY: the caller's buffer of `n` bytes.
            let b = unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), n) };
            smc_recv(&c, &mut [b], flags)
        }),
    }
}

#[no_mangle]
pub unsafe extern "C" fn __recv_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    _len: size_t,
    flags: c_int,
) -> ssize_t {
    // SAFETY: as recv.
    unsafe { recv(fd, buf, n, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> ssize_t {
    if let Some(r) = crate::connecting::read_would_block(fd, flags) {
        return r;
    }
    match target(fd) {
        // SAFETY: passed on unchanged.
        Target::Pass => crossed(fd, flags)
            .unwrap_or_else(|| unsafe { real::recvfrom(fd, buf, n, flags, addr, len) }),
        Target::Foreign => foreign(fd),
        Target::Relay(r) => {
            if !len.is_null() {
                // A connected stream fills in no address (as TCP).
                // SAFETY: the caller's length.
                unsafe { len.write_unaligned(0) };
            }
            // SAFETY: the caller's buffer, on the relay socket.
            unsafe { crate::relay::recv(&r, buf, n, flags) }
        }
        Target::Smc(c) => guard(-1, || {
            if !len.is_null() {
                // A connected stream fills in no address (as TCP).
                // SAFETY: the caller's length.
                unsafe { len.write_unaligned(0) };
            }
            if n == 0 {
                return 0;
            }
            // SAFETY: the caller's buffer of `n` bytes.
            let b = unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), n) };
            smc_recv(&c, &mut [b], flags)
        }),
    }
}

#[no_mangle]
pub unsafe extern "C" fn __recvfrom_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    _buflen: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> ssize_t {
    // SAFETY: as recvfrom.
    unsafe { recvfrom(fd, buf, n, flags, addr, len) }
}

#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    if let Some(r) = crate::connecting::read_would_block(fd, flags) {
        return r;
    }
    match target(fd) {
        // SAFETY: passed on unchanged.
        Target::Pass => crossed(fd, flags).unwrap_or_else(|| {
            // SAFETY: the caller's message header.
            let r = unsafe { real::recvmsg(fd, msg, flags) };
            // SAFETY: as above, filled by the kernel.
            unsafe { received_rights(r, msg) };
            r
        }),
        Target::Foreign => foreign(fd),
        // SAFETY: the caller's message header, on the relay socket.
        Target::Relay(r) => unsafe { crate::relay::recvmsg(&r, msg, flags) },
        Target::Smc(c) => guard(-1, || {
            if msg.is_null() {
                set_errno(libc::EFAULT);
                return -1;
            }
            // SAFETY: the caller's message header.
            let m = unsafe { &mut *msg };
            m.msg_namelen = 0;
            m.msg_controllen = 0;
            m.msg_flags = 0;
            // SAFETY: the header's iovecs.
            let mut v = unsafe { iovecs(m.msg_iov, m.msg_iovlen as c_int) };
            if v.is_empty() {
                return 0;
            }
            smc_recv(&c, &mut v, flags)
        }),
    }
}

/// After a `recvmsg` that returned `r` into `msg`: SMC-R connections passed to this process
/// (SCM_RIGHTS) get their entries (`relay::received`).
///
/// # Safety
/// `msg` is null or the valid message header the call filled.
pub(crate) unsafe fn received_rights(r: ssize_t, msg: *const msghdr) {
    // SAFETY: the caller's header, read only when it is there.
    if r >= 0 && !msg.is_null() && unsafe { (*msg).msg_controllen } > 0 && !crate::inside() {
        guard((), || {
            // SAFETY: as above.
            let fds = unsafe { crate::relay::rights(&*msg) };
            crate::relay::received(&fds);
        });
    }
}

#[no_mangle]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    match target(fd) {
        // SAFETY: passed on unchanged.
        Target::Pass => unsafe { real::send(fd, buf, n, flags) },
        Target::Foreign => foreign(fd),
        // SAFETY: the caller's buffer, on the relay socket.
        Target::Relay(r) => unsafe { crate::relay::send(&r, buf, n, flags) },
        Target::Smc(c) => guard(-1, || {
            if n == 0 {
                return 0;
            }
            // SAFETY: the caller's buffer of `n` bytes.
            let b = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), n) };
            smc_send(&c, &[b], flags)
        }),
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    n: size_t,
    flags: c_int,
    addr: *const sockaddr,
    len: socklen_t,
) -> ssize_t {
    match target(fd) {
        // SAFETY: passed on unchanged.
        Target::Pass => unsafe { real::sendto(fd, buf, n, flags, addr, len) },
        Target::Foreign => foreign(fd),
        // (The address of a connected stream is ignored, as TCP does.)
        // SAFETY: the caller's buffer, on the relay socket.
        Target::Relay(r) => unsafe { crate::relay::send(&r, buf, n, flags) },
        // The address of a connected stream is ignored, as TCP does.
        Target::Smc(c) => guard(-1, || {
            if n == 0 {
                return 0;
            }
            // SAFETY: the caller's buffer of `n` bytes.
            let b = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), n) };
            smc_send(&c, &[b], flags)
        }),
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    // SAFETY: the caller's message header, read only when it is there.
    if !msg.is_null()
        && unsafe { (*msg).msg_controllen } > 0
        && table::ANY.load(std::sync::atomic::Ordering::Relaxed)
        && !crate::inside()
    {
        // SAFETY: the caller's valid message header.
        let noted = unsafe { passing_in(fd, &*msg) };
        // SAFETY: as below.
        let r = unsafe { sendmsg_on(fd, msg, flags) };
        // A pass is one only when its message went.
        guard((), || crate::relay::sent(noted, fd, r >= 0));
        return r;
    }
    // SAFETY: the caller's arguments.
    unsafe { sendmsg_on(fd, msg, flags) }
}

/// The SMC-R connections among the descriptors that `msg` (sent on `fd`) carries with
/// SCM_RIGHTS: those waiting for their first use settle as TCP, the others are noted as
/// passed (`relay::passing`; `relay::sent` keeps or undoes the note after the send).
///
/// # Safety
/// `msg` is a valid message header whose control buffer is `msg_controllen` bytes.
pub(crate) unsafe fn passing_in(fd: c_int, msg: &msghdr) -> crate::relay::Noted {
    guard(crate::relay::Noted::none(), || {
        // SAFETY: as the caller promised.
        let fds = unsafe { crate::relay::rights(msg) };
        settle_passed(&fds);
        crate::relay::passing(fd, &fds)
    })
}

/// sendmsg itself (the SCM_RIGHTS were looked at).
unsafe fn sendmsg_on(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    match target(fd) {
        // SAFETY: passed on unchanged.
        Target::Pass => unsafe { real::sendmsg(fd, msg, flags) },
        Target::Foreign => foreign(fd),
        // SAFETY: the caller's message header, on the relay socket.
        Target::Relay(r) => unsafe { crate::relay::sendmsg(&r, msg, flags) },
        Target::Smc(c) => guard(-1, || {
            if msg.is_null() {
                set_errno(libc::EFAULT);
                return -1;
            }
            // SAFETY: the caller's message header.
            let m = unsafe { &*msg };
            if m.msg_controllen > 0 {
                log!("sendmsg with control data on an SMC-R connection: EOPNOTSUPP");
                set_errno(libc::EOPNOTSUPP);
                return -1;
            }
            // SAFETY: the header's iovecs.
            let v = unsafe { iovecs(m.msg_iov, m.msg_iovlen as c_int) };
            if v.is_empty() {
                return 0;
            }
            let v: Vec<&[u8]> = v.into_iter().map(|b| &*b).collect();
            smc_send(&c, &v, flags)
        }),
    }
}

/// sendfile onto an SMC-R connection: read the file at the offset and write; the file
/// position moves only when no offset pointer is given, as sendfile(2) says.
fn smc_sendfile(c: &Conn, inp: c_int, off: *mut off_t, count: size_t) -> ssize_t {
    let mut pos: off_t = if off.is_null() {
        // SAFETY: plain lseek.
        let p = unsafe { libc::lseek(inp, 0, libc::SEEK_CUR) };
        if p < 0 {
            return -1;
        }
        p
    } else {
        // SAFETY: the caller's offset.
        unsafe { off.read_unaligned() }
    };
    let mut buf = vec![0u8; count.clamp(1, 256 * 1024)];
    let mut sent = 0usize;
    while sent < count {
        let want = (count - sent).min(buf.len());
        // SAFETY: our buffer of at least `want` bytes.
        let n = unsafe { libc::pread(inp, buf.as_mut_ptr().cast(), want, pos) };
        if n < 0 {
            if sent > 0 {
                break;
            }
            return -1;
        }
        if n == 0 {
            break;
        }
        let n = n as usize;
        let mut done = 0;
        while done < n {
            match c.write(&buf[done..n], sent + done > 0) {
                Ok(w) => done += w,
                Err(e) if sent + done > 0 => {
                    let _ = e;
                    break;
                }
                Err(e) => return write_result(Err(e), false),
            }
        }
        sent += done;
        pos += done as off_t;
        if done < n {
            break;
        }
    }
    if off.is_null() {
        // SAFETY: plain lseek.
        unsafe { libc::lseek(inp, pos, libc::SEEK_SET) };
    } else {
        // SAFETY: the caller's offset.
        unsafe { off.write_unaligned(pos) };
    }
    sent as ssize_t
}

#[no_mangle]
pub unsafe extern "C" fn sendfile(out: c_int, inp: c_int, off: *mut off_t, n: size_t) -> ssize_t {
    match target(out) {
        // SAFETY: passed on unchanged.
        Target::Pass => unsafe { real::sendfile(out, inp, off, n) },
        Target::Foreign => foreign(out),
        // SAFETY: the caller's arguments, into the relay socket.
        Target::Relay(r) => unsafe { real::sendfile(r.fd(), inp, off, n) },
        Target::Smc(c) => guard(-1, || smc_sendfile(&c, inp, off, n)),
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendfile64(out: c_int, inp: c_int, off: *mut off_t, n: size_t) -> ssize_t {
    // SAFETY: off_t is 64 bits on the 64-bit targets this library builds for.
    unsafe { sendfile(out, inp, off, n) }
}

/// Forget `fd`'s entry (its number is being closed or reused): out of every epoll set, then
/// dropped (which closes an SMC-R connection when no other number names it).
pub(crate) fn forget(fd: c_int) {
    if !table::maybe(fd) || table::borrowed_memory() {
        return;
    }
    // (A relay request meanwhile waits for the close's record: `relay::closing_mark`.)
    let _mark = table::get(fd)
        .and_then(|e| e.socket.get().copied())
        .map(|id| crate::relay::closing_mark(id.1));
    let Some(e) = table::take(fd) else {
        return;
    };
    match &e.kind {
        Kind::Smc(c) => {
            for (_, set) in table::epolls() {
                set.remove_closed(fd);
            }
            closing_last(fd, &e, c);
        }
        Kind::Relayed(r) => {
            r.closed(fd);
            crate::relay::closing_relayed(fd, &[fd], &e, r);
        }
        _ => {}
    }
    table::release(e);
}

/// The program closes number `fd` of its SMC-R connection `c`: when it was the last one and
/// the process forked while holding the connection, a process it forked may still hold the
/// TCP socket, for which the connection is kept (`relay::closing`).
fn closing_last(fd: c_int, e: &Entry, c: &Arc<Conn>) {
    if !e.ours() || !e.forked.load(std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    let Some(&id) = e.socket.get() else {
        return;
    };
    if table::entries_of_socket(id).is_empty() {
        crate::relay::closing(fd, &[fd], id, Some(c), None);
    }
}

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    if crate::inside() {
        // SAFETY: the library's own descriptor, passed on unchanged.
        return unsafe { real::close(fd) };
    }
    crate::wait::closed(fd);
    if table::maybe(fd) {
        guard((), || forget(fd));
    }
    // After any make of the library in flight (`smc_fabric::fdplace::making`), which may
    // hold the number it made.
    smc_fabric::fdplace::program_closes(|| {
        if crate::held(fd) {
            // A number a thread of the library holds: not the program's (it closed its own
            // of that number already).
            set_errno(libc::EBADF);
            return -1;
        }
        // SAFETY: passed on unchanged.
        unsafe { real::close(fd) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    match target(fd) {
        // SAFETY: passed on unchanged.
        Target::Pass => unsafe { real::shutdown(fd, how) },
        Target::Foreign => foreign(fd) as c_int,
        // SAFETY: the relay socket (its end of stream reaches the pump, which shuts the
        // connection down).
        Target::Relay(r) => unsafe { real::shutdown(r.fd(), how) },
        Target::Smc(c) => guard(-1, || {
            let how = match how {
                libc::SHUT_RD => Shutdown::Read,
                libc::SHUT_WR => Shutdown::Write,
                libc::SHUT_RDWR => Shutdown::Both,
                _ => {
                    set_errno(libc::EINVAL);
                    return -1;
                }
            };
            match c.shutdown(how) {
                Ok(()) => 0,
                Err(e) => {
                    set_errno(errno_of(&e));
                    -1
                }
            }
        }),
    }
}

/// After a successful dup of `old` onto `new`: `new` names what `old` does.
fn duplicated(old: c_int, new: c_int) {
    if new < 0 || table::borrowed_memory() {
        return;
    }
    forget(new);
    crate::wait::closed(new);
    if crate::wait::is_epoll(old) {
        crate::wait::duplicated_epoll(old, new);
        return;
    }
    if let Some(e) = table::get(old) {
        match &e.kind {
            Kind::Epoll(_) => {}
            _ => {
                if let Ok(Some(x)) = table::set(new, e) {
                    table::release(x);
                }
            }
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    // SAFETY: passed on unchanged.
    let new = unsafe { real::dup(fd) };
    if table::maybe(fd) || crate::wait::is_epoll(fd) {
        duplicated(fd, new);
    }
    new
}

#[no_mangle]
pub unsafe extern "C" fn dup2(fd: c_int, to: c_int) -> c_int {
    if fd != to && table::maybe(to) {
        forget(to);
    }
    // SAFETY: passed on unchanged (`to` is closed: as close).
    let new = smc_fabric::fdplace::program_closes(|| unsafe { real::dup2(fd, to) });
    if fd != to && (table::maybe(fd) || crate::wait::is_epoll(fd)) {
        duplicated(fd, new);
    }
    new
}

#[no_mangle]
pub unsafe extern "C" fn dup3(fd: c_int, to: c_int, flags: c_int) -> c_int {
    if fd != to && table::maybe(to) {
        forget(to);
    }
    // SAFETY: passed on unchanged (`to` is closed: as close).
    let new = smc_fabric::fdplace::program_closes(|| unsafe { real::dup3(fd, to, flags) });
    if table::maybe(fd) || crate::wait::is_epoll(fd) {
        duplicated(fd, new);
    }
    new
}

#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    // SAFETY: passed on unchanged (the third argument arrives in the same register whether
    // the caller passed an int, a pointer or nothing).
    let r = unsafe { real::fcntl(fd, cmd, arg) };
    if r >= 0 && (table::maybe(fd) || crate::wait::is_epoll(fd)) {
        match cmd {
            // (A client handshake in progress takes the flag from the socket at its end.)
            libc::F_SETFL => match target_wait(fd) {
                Target::Smc(c) => c.set_nonblocking(arg as c_int & libc::O_NONBLOCK != 0),
                // The relay socket stands for the TCP socket's open file description.
                Target::Relay(r) => {
                    crate::relay::set_nonblocking(r.fd(), arg as c_int & libc::O_NONBLOCK != 0)
                }
                _ => {}
            },
            libc::F_DUPFD | libc::F_DUPFD_CLOEXEC => duplicated(fd, r),
            _ => {}
        }
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    // SAFETY: as fcntl.
    unsafe { fcntl(fd, cmd, arg) }
}

/// SIOCATMARK (`linux/sockios.h`).
const SIOCATMARK: c_ulong = 0x8905;

#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, req: c_ulong, arg: usize) -> c_int {
    if table::maybe(fd) {
        match req {
            libc::FIONREAD => {
                let t = target(fd);
                if let Target::Relay(r) = &t {
                    // SAFETY: the caller's int, from the relay socket.
                    return unsafe { real::ioctl(r.fd(), req, arg) };
                }
                if let Target::Smc(c) = t {
                    if arg == 0 {
                        set_errno(libc::EFAULT);
                        return -1;
                    }
                    let n = c_int::try_from(c.readable_bytes()).unwrap_or(c_int::MAX);
                    // SAFETY: the caller's int.
                    unsafe { (arg as *mut c_int).write_unaligned(n) };
                    return 0;
                }
            }
            SIOCATMARK => {
                let t = target(fd);
                if let Target::Relay(_) = &t {
                    if arg == 0 {
                        set_errno(libc::EFAULT);
                        return -1;
                    }
                    // Urgent data does not cross a relay: never at a mark.
                    // SAFETY: the caller's int.
                    unsafe { (arg as *mut c_int).write_unaligned(0) };
                    return 0;
                }
                if let Target::Smc(c) = t {
                    if arg == 0 {
                        set_errno(libc::EFAULT);
                        return -1;
                    }
                    // SAFETY: the caller's int.
                    unsafe { (arg as *mut c_int).write_unaligned(c_int::from(c.at_mark())) };
                    return 0;
                }
            }
            libc::FIONBIO => match target_wait(fd) {
                Target::Smc(c) if arg != 0 => {
                    // SAFETY: the caller's int.
                    c.set_nonblocking(unsafe { (arg as *const c_int).read_unaligned() } != 0);
                }
                Target::Relay(r) if arg != 0 => {
                    // SAFETY: the caller's int.
                    let on = unsafe { (arg as *const c_int).read_unaligned() } != 0;
                    crate::relay::set_nonblocking(r.fd(), on);
                }
                _ => {}
            },
            _ => {}
        }
    }
    // SAFETY: passed on unchanged.
    unsafe { real::ioctl(fd, req, arg) }
}

#[no_mangle]
pub unsafe extern "C" fn getsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    if level == libc::SOL_SOCKET && name == libc::SO_ERROR && table::maybe(fd) {
        // (A client that waits for writability and then asks SO_ERROR, as a nonblocking
        // connect's caller does, must not wait for the server's answer here.)
        let t = target_wait(fd);
        if let Target::Relay(r) = &t {
            // A reset reaches the relay socket (see `relay.rs`): its pending error is the
            // connection's.
            // SAFETY: the caller's int and length, from the relay socket.
            return unsafe { real::getsockopt(r.fd(), level, name, val, len) };
        }
        if let Target::Smc(c) = t {
            if let Some(e) = c.take_error() {
                if val.is_null() || len.is_null() {
                    set_errno(libc::EFAULT);
                    return -1;
                }
                // SAFETY: the caller's int and its length.
                unsafe {
                    if (len.read_unaligned() as usize) < std::mem::size_of::<c_int>() {
                        set_errno(libc::EINVAL);
                        return -1;
                    }
                    (val as *mut c_int).write_unaligned(errno_of(&e));
                    len.write_unaligned(std::mem::size_of::<c_int>() as socklen_t);
                }
                return 0;
            }
        }
    }
    // SAFETY: passed on unchanged.
    unsafe { real::getsockopt(fd, level, name, val, len) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_addresses_from_c() {
        let sin = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: 6390u16.to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from_be_bytes([127, 0, 0, 1]).to_be(),
            },
            sin_zero: [0; 8],
        };
        let len = std::mem::size_of::<libc::sockaddr_in>() as socklen_t;
        let p = &sin as *const libc::sockaddr_in as *const sockaddr;
        // SAFETY: a valid sockaddr_in of `len` bytes.
        assert_eq!(
            unsafe { sockaddr_of(p, len) },
            Some("127.0.0.1:6390".parse().expect("addr"))
        );
        // Too short, or null: not an address we act on.
        // SAFETY: as above, with a shorter length.
        assert_eq!(unsafe { sockaddr_of(p, 4) }, None);
        // SAFETY: null is allowed.
        assert_eq!(unsafe { sockaddr_of(std::ptr::null(), len) }, None);
    }
}
