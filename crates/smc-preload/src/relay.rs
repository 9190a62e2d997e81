//! An SMC-R connection used by more than one process: relayed through the process whose
//! stack holds it (its *owner*).
//!
//! After a `fork()`, parent and child both hold the connection's TCP socket, and TCP lets
//! either read and write it (rsync's receiver and generator, vsftpd's two session
//! processes). The connection's state and its RMBs belong to the owner's stack, whose
//! threads the child does not have. So the first time a process other than the owner uses
//! the connection, it asks the owner for a *relay*:
//!
//! * The owner serves requests on an abstract unix socket named after its pid and a random
//!   nonce that its forked descendants know from their copy of its memory
//!   (`smc-rs-relay/<pid>/<nonce>`), bound at the first `fork()` while the process holds
//!   SMC-R connections (a fork without connections, or a program that never forks, costs
//!   nothing), served by one thread started after that fork, which no requester holds up
//!   (`relay_server.rs`).
//! * The requester proves it holds the connection by sending its copy of the TCP socket
//!   (SCM_RIGHTS); the owner checks that it is, as an open file, the one a number of its
//!   connection names (kcmp; see [`same_file`]), and the requester's credentials
//!   (SO_PEERCRED: the same user, or an owner running as root). The requester checks that
//!   the server is the owner (its pid) running as the same user or root, and that what it
//!   gets back is a unix stream socket.
//! * The owner makes a socketpair (A, B): two pump threads copy the connection into B and B
//!   into the connection; A goes back to the requester, and *every* holder's entry (the
//!   owner's too) becomes [`Kind::Relayed`](crate::table::Kind::Relayed): each later call on
//!   the program's number is made on A with the real system call (data calls, shutdown,
//!   FIONREAD, O_NONBLOCK, timeouts), and poll, select and epoll watch A. All holders share
//!   one byte stream in order, as with one TCP socket; the program's number stays the real
//!   TCP socket (getsockname, getpeername, socket options, `ss`).
//! * Only a connection another process actually uses is converted: a child that never
//!   touches its inherited connections (redis's BGSAVE) costs nothing per connection.
//! * An exec'd image asks in the same way: the image before the exec names each connection
//!   with its owner's pid and nonce in `SMC_PRELOAD_INHERITED` (`exec.rs`).
//! * When the owner's program closes its last number before anyone asked, while a process
//!   it forked still holds the TCP socket, the connection is kept for that process until no
//!   process holds it (`keep.rs`).
//! * A connection passed to another process with SCM_RIGHTS: the owner binds a name of the
//!   TCP socket (`smc-rs-passed/<dev>/<ino>`, or a random name under it when another
//!   socket holds that) where the receiver's library looks it up; the
//!   receiver then asks as an exec'd image does, and the connection is kept while the pass
//!   is in flight or a receiver holds it (`pass.rs`).
//!
//! Ends: a holder's `shutdown(SHUT_WR)` ends A's writing; the pump reads the end of B and
//! shuts the connection down for writing. The peer's end of stream shuts B down for writing:
//! every holder reads the end. A holder closing its number closes only its copy of A; once
//! every copy is closed (B reports POLLHUP) the pumps end and the connection is closed as a
//! program's close does. A reset of the connection: the bytes before it are delivered, then
//! B is closed with a byte left unread in it, which Linux reports to A's next reader as
//! ECONNRESET (once; then end of stream and EPIPE), as TCP reports a reset.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use libc::{c_int, c_void, size_t, ssize_t};
use smc::fdapi::{Conn, Waiter};

use crate::table::{self, Entry, Kind, SpinLock};
use crate::{log, real};

/// Where the owner of a connection serves relays: its pid and the nonce of its server's
/// name (what a forked child knows from its copy of the memory, and an exec'd image from
/// `SMC_PRELOAD_INHERITED`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Owner {
    pub(crate) pid: i32,
    pub(crate) nonce: u64,
}

impl Owner {
    /// Process `pid` of this image's process tree (its server is named with this image's
    /// nonce).
    pub(crate) fn of_tree(pid: i32) -> Owner {
        Owner {
            pid,
            nonce: nonce(),
        }
    }
}

/// One process's handle of a relayed connection: its copy of A.
pub(crate) struct Relay {
    a: OwnedFd,
    /// The process whose stack holds the connection.
    owner: Owner,
    /// The kernel epoll registrations of A made for the program's numbers: (the process
    /// that made it, epfd, fd), under [`EPOLLS_LOCK`].
    epolls: std::cell::UnsafeCell<Vec<(i32, c_int, c_int)>>,
}

// SAFETY: `epolls` is only touched under EPOLLS_LOCK.
unsafe impl Sync for Relay {}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay").field("a", &self.a).finish()
    }
}

/// The lock of every relay's epoll registrations: a spin lock held across `fork()` (a
/// forked child never inherits it held, as it could a `Mutex` another thread held).
static EPOLLS_LOCK: SpinLock = SpinLock::new();

impl Relay {
    fn new(a: OwnedFd, owner: Owner) -> Relay {
        Relay {
            a,
            owner,
            epolls: std::cell::UnsafeCell::new(Vec::new()),
        }
    }

    /// The process whose stack holds the connection (named to an exec'd image).
    pub(crate) fn owner(&self) -> Owner {
        self.owner
    }

    /// A's descriptor: where the program's calls go.
    pub(crate) fn fd(&self) -> c_int {
        self.a.as_raw_fd()
    }

    fn with_epolls<R>(&self, f: impl FnOnce(&mut Vec<(i32, c_int, c_int)>) -> R) -> R {
        EPOLLS_LOCK.lock();
        // SAFETY: the lock is held: the only reference.
        let r = f(unsafe { &mut *self.epolls.get() });
        EPOLLS_LOCK.unlock();
        r
    }

    /// Record that A is registered in epoll instance `epfd` for the program's number `fd`.
    pub(crate) fn registered(&self, epfd: c_int, fd: c_int, on: bool) {
        let pid = table::PID.load(Ordering::Relaxed);
        self.with_epolls(|v| {
            v.retain(|&(_, e, n)| (e, n) != (epfd, fd));
            if on {
                v.push((pid, epfd, fd));
            }
        });
    }

    /// The program's number `fd` is being closed: as the kernel drops a closed file from
    /// its epoll instances, A's registrations made for that number go. Only those this
    /// process made: a forked child shares its parent's epoll instances, and the parent's
    /// registration of A (its own number is still open) stays.
    pub(crate) fn closed(&self, fd: c_int) {
        let pid = table::PID.load(Ordering::Relaxed);
        self.with_epolls(|v| {
            v.retain(|&(by, epfd, n)| {
                if n != fd {
                    return true;
                }
                if by == pid {
                    let mut ev = libc::epoll_event { events: 0, u64: 0 };
                    // SAFETY: removing our registration of A.
                    unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_DEL, self.fd(), &mut ev) };
                }
                false
            });
        });
    }
}

/// The nonce of the relay servers' names in this process tree (made when the library
/// loads; a forked child has it in its copy of the memory).
static NONCE: AtomicU64 = AtomicU64::new(0);

/// Make the nonce (the library's constructor).
pub(crate) fn init() {
    let mut b = [0u8; 8];
    // SAFETY: a buffer of 8 bytes.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    let mut v = u64::from_ne_bytes(b);
    if n != 8 {
        // No getrandom: the clock's nanoseconds will do (the name is also checked by pid).
        v = Instant::now().elapsed().as_nanos() as u64 ^ std::process::id() as u64;
        v ^= std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
    }
    NONCE.store(v | 1, Ordering::Relaxed);
}

/// The nonce of this process tree.
pub(crate) fn nonce() -> u64 {
    NONCE.load(Ordering::Relaxed)
}

/// The abstract unix address of the relay server of process `pid`.
fn address(pid: i32, nonce: u64) -> (libc::sockaddr_un, libc::socklen_t) {
    abstract_address(&format!("smc-rs-relay/{pid}/{nonce:016x}"))
}

/// The abstract unix address `name`.
fn abstract_address(name: &str) -> (libc::sockaddr_un, libc::socklen_t) {
    // SAFETY: zeroed is a valid sockaddr_un.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    a.sun_family = libc::AF_UNIX as libc::sa_family_t;
    // (The first byte stays 0: an abstract name, gone with the socket.)
    for (d, s) in a.sun_path[1..].iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    let len = std::mem::offset_of!(libc::sockaddr_un, sun_path) + 1 + name.len();
    (a, len as libc::socklen_t)
}

/// Bind `fd` to the unix address (`addr`, `len`) and listen on it (the library's own
/// listen, not the hooked one).
fn bind_listen(fd: &OwnedFd, addr: &libc::sockaddr_un, len: libc::socklen_t) -> bool {
    // SAFETY: a valid address of `len` bytes; plain bind and listen on our own descriptor.
    unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (addr as *const libc::sockaddr_un).cast(),
            len,
        ) == 0
            && real::listen(fd.as_raw_fd(), 64) == 0
    }
}

fn last_errno() -> c_int {
    io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

fn set_timeouts(fd: c_int, t: Duration) {
    let tv = libc::timeval {
        tv_sec: t.as_secs() as libc::time_t,
        tv_usec: libc::suseconds_t::from(t.subsec_micros() as i32),
    };
    for name in [libc::SO_RCVTIMEO, libc::SO_SNDTIMEO] {
        // SAFETY: a timeval and its length.
        unsafe {
            real::setsockopt(
                fd,
                libc::SOL_SOCKET,
                name,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
    }
}

/// The credentials of the process at the other end of unix socket `fd`.
fn peer_cred(fd: c_int) -> Option<libc::ucred> {
    let mut c = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: a ucred and its length.
    let r = unsafe {
        real::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut c as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (r == 0).then_some(c)
}

/// Send one byte with `fd` attached (SCM_RIGHTS) when given.
fn send_with_fd(sock: c_int, byte: u8, fd: Option<c_int>) -> Result<(), c_int> {
    send_with_fds(sock, byte, fd.as_slice())
}

/// Send one byte with `fds` (at most 4) attached (SCM_RIGHTS).
fn send_with_fds(sock: c_int, byte: u8, fds: &[c_int]) -> Result<(), c_int> {
    if fds.len() > 4 {
        return Err(libc::EINVAL);
    }
    let mut b = [byte];
    let mut iov = libc::iovec {
        iov_base: b.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // Room for four descriptors, aligned for the header.
    let mut space = [0u64; 6];
    // SAFETY: zeroed is a valid msghdr.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        let bytes = std::mem::size_of_val(fds) as u32;
        // SAFETY: CMSG_SPACE and CMSG_LEN are pure arithmetic.
        let (sp, ln) = unsafe { (libc::CMSG_SPACE(bytes), libc::CMSG_LEN(bytes)) };
        msg.msg_control = space.as_mut_ptr().cast();
        msg.msg_controllen = sp as usize;
        // SAFETY: the control buffer holds one header and up to four ints (sp ≤ 48 bytes).
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = ln as usize;
            for (i, &fd) in fds.iter().enumerate() {
                libc::CMSG_DATA(c)
                    .cast::<c_int>()
                    .add(i)
                    .write_unaligned(fd);
            }
        }
    }
    loop {
        // SAFETY: the message built above.
        let r = unsafe { real::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
        if r == 1 {
            return Ok(());
        }
        let e = last_errno();
        if r < 0 && e == libc::EINTR {
            continue;
        }
        return Err(if r < 0 { e } else { libc::EIO });
    }
}

/// Receive one byte and the descriptors attached to it (every one is returned, owned, so
/// that none is left open by a misbehaving sender).
fn recv_with_fds(sock: c_int) -> Result<(u8, Vec<OwnedFd>), c_int> {
    // First wait for the byte as the socket's mode and timeouts say, taking nothing: a peek
    // without room for control data installs no descriptor.
    let mut b = [0u8];
    let r = loop {
        // SAFETY: a one-byte buffer of ours.
        let r = unsafe { real::recv(sock, b.as_mut_ptr().cast(), 1, libc::MSG_PEEK) };
        if r < 0 && last_errno() == libc::EINTR {
            continue;
        }
        break r;
    };
    if r < 0 {
        return Err(last_errno());
    }
    if r == 0 {
        return Err(libc::ECONNRESET);
    }
    // Then take it with its descriptors, without blocking, placed before the program's
    // closes go on (see `made`).
    smc_fabric::fdplace::making(|| take_with_fds(sock))
}

/// [`recv_with_fds`]' receive of the byte that is there, with its descriptors.
fn take_with_fds(sock: c_int) -> Result<(u8, Vec<OwnedFd>), c_int> {
    let mut b = [0u8];
    let mut iov = libc::iovec {
        iov_base: b.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut space = [0u64; 16];
    // SAFETY: zeroed is a valid msghdr.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = space.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&space);
    let r = loop {
        // SAFETY: the message built above.
        let r =
            unsafe { real::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT) };
        if r < 0 && last_errno() == libc::EINTR {
            continue;
        }
        break r;
    };
    if r < 0 {
        return Err(last_errno());
    }
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote into our buffer.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c);
                let head = data as usize - c as usize;
                let n =
                    ((*c).cmsg_len as usize).saturating_sub(head) / std::mem::size_of::<c_int>();
                for i in 0..n {
                    let fd = data.cast::<c_int>().add(i).read_unaligned();
                    if fd >= 0 {
                        fds.push(high(fd));
                    }
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if r == 0 {
        return Err(libc::ECONNRESET);
    }
    Ok((b[0], fds))
}

/// The request byte.
const ASK: u8 = b'R';

/// A descriptor made by `make` (a system call that does not block: the number, or -1 with
/// errno), moved to the upper half of the descriptor numbers (`smc::fdapi::place_high`).
/// The kernel gives it the lowest free number, which the program may close at that moment
/// (a number it closed already: bash closes some of its pipes twice); its closes wait until
/// ours is placed (`smc_fabric::fdplace::making`).
pub(crate) fn made(make: impl FnOnce() -> c_int) -> Result<OwnedFd, c_int> {
    smc_fabric::fdplace::making(|| {
        let fd = make();
        if fd < 0 {
            return Err(last_errno());
        }
        Ok(high(fd))
    })
}

/// A close-on-exec copy of the program's descriptor `fd`, made high at once
/// (`smc_fabric::fdplace::dup_placed`); EBADF for a negative number.
pub(crate) fn dup_high(fd: c_int) -> Result<OwnedFd, c_int> {
    if fd < 0 {
        return Err(libc::EBADF);
    }
    smc_fabric::fdplace::dup_placed(crate::hooks::bfd(fd)).map_err(|e| e.raw_os_error())
}

/// `fd`, just made inside [`smc_fabric::fdplace::making`], moved to the upper half.
fn high(fd: RawFd) -> OwnedFd {
    // SAFETY: just made by the caller, ours.
    smc::fdapi::place_high(unsafe { OwnedFd::from_raw_fd(fd) })
}

// ---------------------------------------------------------------------------------------
// The requester's side.

/// Ask `owner` for a relay of the connection whose TCP socket this process has as `fd`; on
/// success, every number of this process naming that socket becomes relayed. `Err`: an errno
/// for the log (the caller's call fails with EIO).
pub(crate) fn attach(fd: c_int, owner: Owner) -> Result<Arc<Relay>, c_int> {
    let Some(id) = table::socket_id(fd) else {
        return Err(libc::ENOTSOCK);
    };
    let a = request(fd, owner.pid, owner.nonce)?;
    // Another thread's first use may have asked at the same time and been answered first
    // (the owner gave both the same A): its relay serves, this copy goes.
    if let Some(r) = table::entries_of_socket(id)
        .into_iter()
        .find_map(|(_, e)| match &e.kind {
            Kind::Relayed(r) => Some(r.clone()),
            _ => None,
        })
    {
        return Ok(r);
    }
    let relay = Arc::new(Relay::new(a, owner));
    let mut n = 0;
    for (num, e) in table::entries_of_socket(id) {
        // Another process's connection: inherited across fork, or across exec (named by
        // the image before).
        let foreign = match e.kind {
            Kind::Smc(_) => !e.ours(),
            Kind::Inherited(_) => true,
            _ => false,
        };
        if foreign {
            let new = Entry::new(Kind::Relayed(relay.clone()));
            let _ = new.socket.set(id);
            if table::replace(num, &e, new) {
                n += 1;
                table::release(e);
            }
        }
    }
    log!(
        "fd {fd}: SMC-R connection of process {}, relayed through it ({n} numbers)",
        owner.pid
    );
    Ok(relay)
}

/// The request itself: connect, check the server, send the proof, receive A.
fn request(fd: c_int, owner: i32, nonce: u64) -> Result<OwnedFd, c_int> {
    // Bounded waits (a unix connect to a full backlog sleeps for the send timeout: an owner
    // that does not answer is an error, not a hang), and the server must be the owner (its
    // pid) running as this user or as root: anyone else who bound the name first gets
    // neither our socket nor our data.
    let s = pass::connect_to(address(owner, nonce), Some(owner))?;
    send_with_fd(s.as_raw_fd(), ASK, Some(fd))?;
    let (status, mut fds) = recv_with_fds(s.as_raw_fd())?;
    if status != 0 {
        return Err(c_int::from(status));
    }
    if fds.len() != 1 {
        return Err(libc::EPROTO);
    }
    let a = fds.pop().ok_or(libc::EPROTO)?;
    check_relay_socket(a.as_raw_fd())?;
    Ok(a)
}

/// What the owner sent back, on which the program's calls will be made: a unix stream
/// socket, nothing else (EPROTO).
fn check_relay_socket(a: c_int) -> Result<(), c_int> {
    if sock_opt(a, libc::SO_DOMAIN) != Some(libc::AF_UNIX)
        || sock_opt(a, libc::SO_TYPE) != Some(libc::SOCK_STREAM)
    {
        return Err(libc::EPROTO);
    }
    Ok(())
}

use crate::hooks::sock_opt;

/// Whether descriptors `a` and `b` of this process name the same open file description
/// (kcmp KCMP_FILE). After a fork, parent and child share the TCP socket's open file
/// description, so this is the proof that a requester holds the connection; the socket's
/// inode number alone is not (inode numbers wrap, and /proc/net/tcp shows them to anyone).
/// Without kcmp (ENOSYS: a kernel without CONFIG_KCMP; EPERM: a seccomp filter) there is
/// no proof that cannot be forged by a process of the same user holding another socket
/// (SO_COOKIE names the socket, not its file, and a dup'd look-alike cannot be told
/// apart), so the request is refused: `Err(errno)`.
fn same_file(a: c_int, b: c_int) -> Result<bool, c_int> {
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    kcmp_file(me, a, me, b)
}

/// Whether descriptor `a` of process `pa` and `b` of `pb` name the same open file
/// description (kcmp KCMP_FILE; `Err(errno)` without kcmp or without the right to look).
fn kcmp_file(pa: i32, a: c_int, pb: i32, b: c_int) -> Result<bool, c_int> {
    const KCMP_FILE: libc::c_long = 0;
    // SAFETY: kcmp compares two descriptors; no memory is passed.
    let r = unsafe {
        libc::syscall(
            libc::SYS_kcmp,
            libc::c_long::from(pa),
            libc::c_long::from(pb),
            KCMP_FILE,
            libc::c_long::from(a),
            libc::c_long::from(b),
        )
    };
    if r < 0 {
        return Err(last_errno());
    }
    Ok(r == 0)
}

// ---------------------------------------------------------------------------------------
// The owner's side.

/// The listening socket of this process's relay server (-1: none) and the process that
/// bound it (a forked child has its parent's number in its copy: it closes it).
static SERVER_FD: AtomicI32 = AtomicI32::new(-1);
static SERVER_PID: AtomicI32 = AtomicI32::new(0);
/// The process whose server thread runs.
static THREAD_PID: AtomicI32 = AtomicI32::new(0);
/// An eventfd that wakes the server thread (-1: none), made with the server.
static KICK_FD: AtomicI32 = AtomicI32::new(-1);
/// Pump threads running in this process.
static PUMPS: AtomicUsize = AtomicUsize::new(0);
/// The descriptors the pumps of this process hold (B and the stop eventfds; -1: a free
/// slot), which a forked child closes (see [`fork_child`]).
static PUMP_FDS: [AtomicI32; 256] = [const { AtomicI32::new(-1) }; 256];

/// Note a pump descriptor (`false`: no free slot; a forked child then keeps its copy).
fn pump_fd_add(fd: RawFd) -> bool {
    PUMP_FDS.iter().any(|s| {
        s.compare_exchange(-1, fd, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    })
}

/// In a forked child: close the copies of the parent's pumps' descriptors (B, the stop
/// eventfds), which would keep B open (its holders would never see the end) while this
/// child lives. Only atomics and close (a fork handler).
fn close_pump_fds() {
    for slot in &PUMP_FDS {
        let fd = slot.swap(-1, Ordering::Relaxed);
        if fd >= 0 {
            // SAFETY: an inherited copy of the parent's pump descriptor: ours to close.
            unsafe { real::close(fd) };
        }
    }
}

/// Forget a pump descriptor (before it is closed: a fork in between leaves the child a copy
/// it does not close, never a number it closes after reuse).
fn pump_fd_remove(fd: RawFd) {
    for s in &PUMP_FDS {
        let _ = s.compare_exchange(fd, -1, Ordering::Relaxed, Ordering::Relaxed);
    }
}

/// The relays this process's stack runs (by socket identity), under [`RELAYS_LOCK`] (held
/// across a fork, so a child never inherits it held).
static RELAYS_LOCK: SpinLock = SpinLock::new();
/// Socket identity (device, inode) → the relay, with its connection (for [`of_conn`]; the
/// weak reference keeps the address from being reused by another connection) and its pumps
/// (an entry whose pumps ended is stale: a later socket may have the same inode).
type RelayList = Vec<((u64, u64), Weak<Relay>, Weak<Conn>, Weak<Pump>)>;
struct Relays(std::cell::UnsafeCell<RelayList>);
// SAFETY: only touched under RELAYS_LOCK.
unsafe impl Sync for Relays {}
static RELAYS: Relays = Relays(std::cell::UnsafeCell::new(Vec::new()));

/// Before `fork()`: a process that holds SMC-R connections binds its relay server now (the
/// child may ask at once; the kernel queues its connection until the server thread, started
/// after the fork, accepts it).
pub(crate) fn fork_prepare() {
    let pid = table::PID.load(Ordering::Relaxed);
    if table::mark_forked() {
        if SERVER_PID.load(Ordering::Relaxed) != pid {
            bind(pid);
        }
        keep::fork_prepare(pid);
    }
    RELAYS_LOCK.lock();
    EPOLLS_LOCK.lock();
}

/// After `fork()` in the parent: start the server thread (once per process).
pub(crate) fn fork_parent() {
    EPOLLS_LOCK.unlock();
    RELAYS_LOCK.unlock();
    start_server();
}

/// After `fork()` in the child: the parent's server and relays are not this process's.
pub(crate) fn fork_child() {
    EPOLLS_LOCK.unlock();
    RELAYS_LOCK.unlock();
    close_pump_fds();
    // SAFETY: the lock was just released and this process has one thread.
    unsafe { &mut *RELAYS.0.get() }.clear();
    for fd in [
        SERVER_FD.swap(-1, Ordering::Relaxed),
        KICK_FD.swap(-1, Ordering::Relaxed),
    ] {
        if fd >= 0 {
            // SAFETY: the parent's listening socket or eventfd, inherited: ours to close.
            unsafe { real::close(fd) };
        }
    }
    SERVER_PID.store(0, Ordering::Relaxed);
    PUMPS.store(0, Ordering::Relaxed);
    keep::fork_child(table::PID.load(Ordering::Relaxed));
    pass::fork_child();
}

/// Bind and listen on this process's relay address.
fn bind(pid: i32) {
    // SAFETY: a new socket of ours.
    let made_s =
        made(|| unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) });
    let Ok(s) = made_s else {
        return;
    };
    let (addr, len) = address(pid, nonce());
    if !bind_listen(&s, &addr, len) {
        log!("relay server: bind failed: {}", io::Error::last_os_error());
        return;
    }
    // Nonblocking: the thread accepts after a poll that also waits for its eventfd.
    set_nonblocking(s.as_raw_fd(), true);
    if KICK_FD.load(Ordering::Relaxed) < 0 {
        // SAFETY: a new eventfd of ours.
        let k = made(|| unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) });
        if let Ok(k) = k {
            KICK_FD.store(std::os::fd::IntoRawFd::into_raw_fd(k), Ordering::Relaxed);
        }
    }
    let old = SERVER_FD.swap(std::os::fd::IntoRawFd::into_raw_fd(s), Ordering::Relaxed);
    if old >= 0 {
        // SAFETY: an earlier listening socket of ours.
        unsafe { real::close(old) };
    }
    SERVER_PID.store(pid, Ordering::Relaxed);
}

fn start_server() {
    let pid = table::PID.load(Ordering::Relaxed);
    if SERVER_PID.load(Ordering::Relaxed) != pid || THREAD_PID.swap(pid, Ordering::Relaxed) == pid {
        return;
    }
    let spawned = smc::fdapi::signals_blocked(|| {
        smc_fabric::threads::spawn_running(
            std::thread::Builder::new().name("smc-relay".into()),
            || crate::guard((), serve),
        )
    });
    if let Err(e) = spawned {
        log!("relay server: no thread: {e}");
        THREAD_PID.store(0, Ordering::Relaxed);
    }
}

/// Whether process `pid` (this one, or the parent whose memory a `vfork` child borrows)
/// serves relay requests: its server is bound and its thread started.
pub(crate) fn serving(pid: i32) -> bool {
    SERVER_PID.load(Ordering::Relaxed) == pid && THREAD_PID.load(Ordering::Relaxed) == pid
}

/// Before this process starts another program that inherits its connections without a
/// `fork()` (`posix_spawn`): serve relays, as a fork would have made it.
pub(crate) fn serve_spawned() {
    let pid = table::PID.load(Ordering::Relaxed);
    if table::mark_forked() && SERVER_PID.load(Ordering::Relaxed) != pid {
        bind(pid);
    }
    start_server();
}

/// Before this process passes one of its connections to another process (SCM_RIGHTS,
/// `pass.rs`): serve relays (the receiver asks this process), as a fork would have made it.
fn serve_passed() {
    let pid = table::PID.load(Ordering::Relaxed);
    if SERVER_PID.load(Ordering::Relaxed) != pid {
        bind(pid);
    }
    start_server();
}

/// This process's connection whose TCP socket is `id`, wherever it is held: a number of the
/// program, a record kept for other holders, or a running relay (RELAYS_LOCK not held).
fn conn_of(id: (u64, u64)) -> Option<Weak<Conn>> {
    for (_, e) in table::entries_of_socket(id) {
        if let Kind::Smc(c) = &e.kind {
            if e.ours() {
                return Some(Arc::downgrade(c));
            }
        }
    }
    RELAYS_LOCK.lock();
    // SAFETY: the lock is held.
    let r = unsafe { &*RELAYS.0.get() }
        .iter()
        .find(|(i, _, c, p)| *i == id && p.strong_count() > 0 && c.strong_count() > 0)
        .map(|(_, _, c, _)| c.clone())
        .or_else(|| keep::conn_of_locked(id));
    RELAYS_LOCK.unlock();
    r
}

/// The proof of a request (its byte and the descriptors that came with it): one TCP socket
/// that is, as an open file, the one a number of this process's connection names. The
/// socket's identity (device, inode) on success.
fn check_proof(b: u8, fds: &[OwnedFd]) -> Result<(u64, u64), c_int> {
    let [fd] = fds else {
        return Err(libc::EPROTO);
    };
    if b != ASK {
        return Err(libc::EPROTO);
    }
    let fd = fd.as_raw_fd();
    // A socket before anything else looks at it (an fstat of a file may block).
    if sock_opt(fd, libc::SO_TYPE) != Some(libc::SOCK_STREAM) {
        return Err(libc::ENOTSOCK);
    }
    let id = table::socket_id(fd).ok_or(libc::ENOTSOCK)?;
    for (num, _) in table::entries_of_socket(id) {
        if same_file(fd, num)? {
            return Ok(id);
        }
    }
    // A connection the program closed, kept for the processes that still hold it.
    if keep::proves(fd, id)? {
        return Ok(id);
    }
    Err(libc::ENOENT)
}

/// The relay of this process's connection whose TCP socket is `id`: the one running, or a
/// new one (the program's numbers of it become relayed).
fn convert(id: (u64, u64)) -> Result<Arc<Relay>, c_int> {
    RELAYS_LOCK.lock();
    let r = convert_locked(id);
    RELAYS_LOCK.unlock();
    r
}

fn convert_locked(id: (u64, u64)) -> Result<Arc<Relay>, c_int> {
    // SAFETY: RELAYS_LOCK is held by the caller.
    let relays = unsafe { &mut *RELAYS.0.get() };
    relays.retain(|(_, w, _, p)| w.strong_count() > 0 && p.strong_count() > 0);
    if let Some(r) = relays
        .iter()
        .find(|(i, _, _, _)| *i == id)
        .and_then(|(_, w, _, _)| w.upgrade())
    {
        return Ok(r);
    }
    let own: Vec<(c_int, Arc<Entry>, Arc<Conn>)> = table::entries_of_socket(id)
        .into_iter()
        .filter(|(_, e)| e.ours())
        .filter_map(|(fd, e)| match &e.kind {
            Kind::Smc(c) => {
                let c = c.clone();
                Some((fd, e, c))
            }
            _ => None,
        })
        .collect();
    let (first, conn) = match own.first() {
        Some((first, _, conn)) => (*first, conn.clone()),
        None => keep::take_for_relay(id).ok_or(libc::ENOENT)?,
    };
    // Both ends placed before the program's closes go on (see `made`).
    let (a, b) = smc_fabric::fdplace::making(|| {
        let mut pair = [0; 2];
        // SAFETY: an array of two ints.
        if unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
                0,
                pair.as_mut_ptr(),
            )
        } != 0
        {
            return Err(last_errno());
        }
        Ok((high(pair[0]), high(pair[1])))
    })?;
    // A stands for the TCP socket, whose open file description every holder shares: its
    // O_NONBLOCK and timeouts are the program's (later changes are mirrored, see hooks).
    // SAFETY: plain fcntl.
    let fl = unsafe { real::fcntl(first, libc::F_GETFL, 0) };
    if fl >= 0 && fl & libc::O_NONBLOCK != 0 {
        set_nonblocking(a.as_raw_fd(), true);
    }
    for (send, name) in [(false, libc::SO_RCVTIMEO), (true, libc::SO_SNDTIMEO)] {
        if let Some(t) = conn.timeout(send) {
            set_timeout(a.as_raw_fd(), name, t);
        }
    }
    let relay = Arc::new(Relay::new(
        a,
        Owner::of_tree(table::PID.load(Ordering::Relaxed)),
    ));
    // The program's reads of the connection itself stop before the pump's first read (one
    // under way completes first): the bytes stay in order.
    // Both pump threads exist (waiting) before the hand-over, which cannot be undone: a
    // thread that cannot be started leaves the connection the program's.
    let pump = start_pumps(conn.clone(), b, Arc::downgrade(&relay))?;
    conn.hand_over();
    pump.open_gate(true);
    relays.push((
        id,
        Arc::downgrade(&relay),
        Arc::downgrade(&conn),
        Arc::downgrade(&pump),
    ));
    keep::relayed(id, &relay);
    let mut lost = false;
    for (fd, e, _) in own {
        let new = Entry::new(Kind::Relayed(relay.clone()));
        let _ = new.socket.set(id);
        if table::replace(fd, &e, new) {
            crate::wait::moved_to_relay(fd, &relay);
            table::release(e);
        } else {
            lost = true;
        }
    }
    if lost {
        // The program closed a number meanwhile: its close's record takes this copy of A.
        keep::orphan_locked(id, &relay);
    }
    // A wait of the program already asleep on the connection (poll, select) looks again and
    // finds the relay socket in the number's place.
    CONVERSIONS.fetch_add(1, Ordering::SeqCst);
    conn.wake_all();
    log!("fd {first}: SMC-R connection relayed for another process");
    Ok(relay)
}

/// The relay of connection `c` of this process (a read of the program that was under way on
/// the connection itself when it became relayed is redone there).
pub(crate) fn of_conn(c: &Conn) -> Option<Arc<Relay>> {
    RELAYS_LOCK.lock();
    // SAFETY: the lock is held.
    let r = unsafe { &*RELAYS.0.get() }
        .iter()
        .find(|(_, _, wc, _)| std::ptr::eq(wc.as_ptr(), c))
        .and_then(|(_, w, _, _)| w.upgrade());
    RELAYS_LOCK.unlock();
    r
}

/// How many connections this process converted to relays (a wait that began before
/// one looks again when this moves).
static CONVERSIONS: AtomicU64 = AtomicU64::new(0);

/// See [`CONVERSIONS`].
pub(crate) fn conversions() -> u64 {
    CONVERSIONS.load(Ordering::SeqCst)
}

/// Set or clear O_NONBLOCK on `fd`.
pub(crate) fn set_nonblocking(fd: c_int, on: bool) {
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

/// SO_RCVTIMEO or SO_SNDTIMEO (`name`) of `fd`.
pub(crate) fn set_timeout(fd: c_int, name: c_int, t: Duration) {
    let tv = libc::timeval {
        tv_sec: t.as_secs() as libc::time_t,
        tv_usec: libc::suseconds_t::from(t.subsec_micros() as i32),
    };
    // SAFETY: a timeval and its length.
    unsafe {
        real::setsockopt(
            fd,
            libc::SOL_SOCKET,
            name,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
}

// ---------------------------------------------------------------------------------------
// The pumps.

/// What both pump threads of one relay share.
struct Pump {
    conn: Arc<Conn>,
    b: OwnedFd,
    /// Written once when the relay ends (never drained): wakes both threads.
    stop: OwnedFd,
    /// The connection failed: B is to be closed with a byte left in it (see [`reset`]).
    /// Held while the outbound thread reads B, so that it never reads that byte.
    reset: Mutex<bool>,
    /// Whether the threads may start (`None`: not yet; `Some(false)`: the relay was not
    /// made, they end without touching the connection).
    gate: Mutex<Option<bool>>,
    gate_cv: std::sync::Condvar,
}

impl Drop for Pump {
    fn drop(&mut self) {
        pump_fd_remove(self.b.as_raw_fd());
        pump_fd_remove(self.stop.as_raw_fd());
    }
}

impl Pump {
    fn open_gate(&self, go: bool) {
        *self.gate.lock().unwrap_or_else(|e| e.into_inner()) = Some(go);
        self.gate_cv.notify_all();
    }

    /// Wait until the gate opens; `true`: pump.
    fn started(&self) -> bool {
        let mut g = self.gate.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(go) = *g {
                return go;
            }
            g = self.gate_cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn stop(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: our eventfd and 8 bytes.
        unsafe { real::write(self.stop.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    /// Wait until one of `fds` (with `events`) or the stop eventfd is ready; `true`: stop.
    fn wait(&self, fds: &[(RawFd, i16)]) -> bool {
        let mut p: Vec<libc::pollfd> = fds
            .iter()
            .map(|&(fd, events)| libc::pollfd {
                fd,
                events,
                revents: 0,
            })
            .collect();
        p.push(libc::pollfd {
            fd: self.stop.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        // A bounded sleep: a change nobody signalled is looked at again within a second.
        // SAFETY: our array.
        unsafe { real::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, 1000) };
        p.last().is_some_and(|s| s.revents != 0)
    }
}

/// Start both pump threads, waiting at the gate ([`Pump::open_gate`]); `Err`: neither will
/// touch the connection.
fn start_pumps(conn: Arc<Conn>, b: OwnedFd, relay: Weak<Relay>) -> Result<Arc<Pump>, c_int> {
    // SAFETY: a new eventfd of ours.
    let stop = made(|| unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })?;
    let pump = Arc::new(Pump {
        conn,
        b,
        stop,
        reset: Mutex::new(false),
        gate: Mutex::new(None),
        gate_cv: std::sync::Condvar::new(),
    });
    for fd in [pump.b.as_raw_fd(), pump.stop.as_raw_fd()] {
        if !pump_fd_add(fd) {
            log!("relay: more pumps than noted for fork; a forked child keeps fd {fd}");
        }
    }
    PUMPS.fetch_add(2, Ordering::AcqRel);
    if spawn_pump("smc-relay-in", &pump, relay.clone(), inbound).is_err() {
        PUMPS.fetch_sub(2, Ordering::AcqRel);
        return Err(libc::EAGAIN);
    }
    if spawn_pump("smc-relay-out", &pump, relay, outbound).is_err() {
        pump.open_gate(false);
        PUMPS.fetch_sub(1, Ordering::AcqRel);
        return Err(libc::EAGAIN);
    }
    Ok(pump)
}

/// Start one of a pump's two threads (signals blocked): it waits at the pump's gate, runs
/// `f` if the gate opens, and counts itself out of `PUMPS` when it ends.
fn spawn_pump(
    name: &str,
    pump: &Arc<Pump>,
    relay: Weak<Relay>,
    f: fn(&Pump, &Weak<Relay>),
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let p = pump.clone();
    smc::fdapi::signals_blocked(|| {
        smc_fabric::threads::spawn_running(
            std::thread::Builder::new().name(name.into()),
            move || {
                if p.started() {
                    crate::guard((), || f(&p, &relay));
                }
                drop(p);
                PUMPS.fetch_sub(1, Ordering::AcqRel);
            },
        )
    })
}

/// The connection into B, until the peer's end of stream (B shut down for writing), a
/// failure ([`reset`]), or every holder gone.
fn inbound(p: &Pump, relay: &Weak<Relay>) {
    let mut buf = vec![0u8; 64 * 1024];
    // (Its eventfd is placed high; where it cannot be, it stays low while the pump runs:
    // held from its making on.)
    let (mut waiter, _held) = smc_fabric::fdplace::making(|| {
        let w = Waiter::new().ok();
        let held = w.as_ref().map(|w| crate::Held::new(w.fd().as_raw_fd()));
        (w, held)
    });
    if let Some(w) = waiter.as_mut() {
        w.watch(&p.conn, true, false);
    }
    loop {
        if let Some(w) = &waiter {
            w.clear();
        }
        match p.conn.read_handed_over(&mut buf) {
            Ok(0) => {
                // SAFETY: our socket.
                unsafe { real::shutdown(p.b.as_raw_fd(), libc::SHUT_WR) };
                return;
            }
            Ok(n) => {
                if !write_all(p, &buf[..n]) {
                    return;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let w = waiter
                    .as_ref()
                    .map(|w| std::os::fd::AsRawFd::as_raw_fd(&w.fd()));
                let fds: Vec<(RawFd, i16)> = w.into_iter().map(|fd| (fd, libc::POLLIN)).collect();
                if p.wait(&fds) {
                    return;
                }
            }
            Err(e) => {
                log!("relay: the connection failed ({e}); its holders get a reset");
                reset(p, relay);
                return;
            }
        }
    }
}

/// Write all of `buf` into B (blocking, as a TCP receive queue fills); `false` when every
/// holder is gone.
fn write_all(p: &Pump, buf: &[u8]) -> bool {
    let mut off = 0;
    while off < buf.len() {
        // SAFETY: our socket and buffer.
        let r = unsafe {
            real::send(
                p.b.as_raw_fd(),
                buf[off..].as_ptr().cast(),
                buf.len() - off,
                libc::MSG_NOSIGNAL,
            )
        };
        if r > 0 {
            off += r as usize;
            continue;
        }
        if r < 0 && last_errno() == libc::EINTR {
            continue;
        }
        return false;
    }
    true
}

/// The connection failed: A's readers get what B holds, then ECONNRESET once. Linux gives
/// the peer of a unix stream socket closed with unread data ECONNRESET; the byte left unread
/// in B is written through this process's copy of A. Without one (the owner's program
/// closed its numbers), B is shut down instead: its readers get the end of stream.
fn reset(p: &Pump, relay: &Weak<Relay>) {
    let mut g = p.reset.lock().unwrap_or_else(|e| e.into_inner());
    *g = true;
    let sent = relay.upgrade().is_some_and(|r| {
        // SAFETY: our socket and one byte.
        unsafe {
            real::send(
                r.fd(),
                [0u8].as_ptr().cast(),
                1,
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            ) == 1
        }
    });
    if !sent {
        // SAFETY: our socket.
        unsafe { real::shutdown(p.b.as_raw_fd(), libc::SHUT_RDWR) };
    }
    drop(g);
    p.stop();
}

/// B into the connection, until the holders' end of stream (the connection shut down for
/// writing), then until every holder closed A (POLLHUP on B): the relay ends.
fn outbound(p: &Pump, relay: &Weak<Relay>) {
    let mut buf = vec![0u8; 64 * 1024];
    // (Its eventfd is placed high; where it cannot be, it stays low while the pump runs:
    // held from its making on.)
    let (mut waiter, _held) = smc_fabric::fdplace::making(|| {
        let w = Waiter::new().ok();
        let held = w.as_ref().map(|w| crate::Held::new(w.fd().as_raw_fd()));
        (w, held)
    });
    if let Some(w) = waiter.as_mut() {
        w.watch(&p.conn, false, true);
    }
    let b = p.b.as_raw_fd();
    let mut conn_ok = true;
    loop {
        if p.wait(&[(b, libc::POLLIN)]) {
            return;
        }
        let n = {
            let g = p.reset.lock().unwrap_or_else(|e| e.into_inner());
            if *g {
                return;
            }
            // SAFETY: our socket and buffer.
            let n =
                unsafe { real::recv(b, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
            drop(g);
            n
        };
        if n < 0 {
            match last_errno() {
                libc::EAGAIN | libc::EINTR => continue,
                _ => break,
            }
        }
        if n == 0 {
            break;
        }
        let n = n as usize;
        let mut off = 0;
        while conn_ok && off < n {
            if let Some(w) = &waiter {
                w.clear();
            }
            match p.conn.write(&buf[off..n], true) {
                Ok(w) => off += w,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let w = waiter
                        .as_ref()
                        .map(|w| std::os::fd::AsRawFd::as_raw_fd(&w.fd()));
                    let fds: Vec<(RawFd, i16)> =
                        w.into_iter().map(|fd| (fd, libc::POLLIN)).collect();
                    if p.wait(&fds) {
                        return;
                    }
                }
                Err(e) => {
                    log!("relay: a write to the connection failed ({e})");
                    if matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionReset
                            | io::ErrorKind::ConnectionAborted
                            | io::ErrorKind::TimedOut
                    ) {
                        // This write took the connection's failure (reported once): the
                        // holders get it as the inbound pump would have passed it on.
                        reset(p, relay);
                        return;
                    }
                    // The holders' writes fail from now on (EPIPE).
                    // SAFETY: our socket.
                    unsafe { real::shutdown(b, libc::SHUT_RD) };
                    conn_ok = false;
                }
            }
        }
    }
    // The holders are done writing.
    if conn_ok {
        let _ = p.conn.shutdown(std::net::Shutdown::Write);
    }
    // Then until every copy of A is closed.
    loop {
        let mut q = [libc::pollfd {
            fd: b,
            events: 0,
            revents: 0,
        }];
        // SAFETY: one pollfd, no wait.
        unsafe { real::poll(q.as_mut_ptr(), 1, 0) };
        if q[0].revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
            break;
        }
        if p.wait(&[(b, 0)]) {
            return;
        }
    }
    p.stop();
}

/// At exit (the library's destructor, after the program's own numbers were closed): while
/// other processes still use connections relayed through this one, keep pumping, at most
/// `max`.
pub(crate) fn linger(max: Duration) {
    let busy = || PUMPS.load(Ordering::Acquire) > 0 || keep::any();
    if !busy() {
        return;
    }
    log!("exit: waiting for the other holders of relayed connections (at most {max:?})");
    let deadline = Instant::now() + max;
    while busy() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[path = "keep.rs"]
mod keep;
pub(crate) use keep::{closing, closing_mark};

#[path = "relay_calls.rs"]
mod calls;
pub(crate) use calls::{recv, recv_bufs, recvmsg, send, sendmsg};

#[path = "relay_server.rs"]
mod server;
use server::serve;
#[cfg(test)]
use server::{answer, Answer};

#[path = "pass.rs"]
mod pass;
pub(crate) use pass::{closing_relayed, passing, received, rights, sent, Noted};

#[cfg(test)]
#[path = "relay_tests.rs"]
mod tests;
