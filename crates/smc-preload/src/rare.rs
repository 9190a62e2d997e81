//! The less common calls a program may make on an SMC-R connection: `recvmmsg`/`sendmmsg`,
//! `splice`, `epoll_pwait2`, `close_range`/`closefrom`, `posix_spawn`/`posix_spawnp`,
//! `execvpe`/`fexecve`. Each
//! behaves on an SMC-R connection as on a TCP socket (or gives the errno TCP would give);
//! without a managed descriptor among the arguments it goes straight to the C library.

use std::time::Duration;

use libc::{
    c_char, c_int, c_long, c_uint, epoll_event, loff_t, mmsghdr, sigset_t, size_t, ssize_t,
};
use libc::{pid_t, posix_spawn_file_actions_t, posix_spawnattr_t, timespec};
use smc::fdapi::Conn;

use crate::exec;
use crate::hooks::{self, target, Target};
use crate::table::{self, Kind};
use crate::{guard, log, real, set_errno};

#[no_mangle]
pub unsafe extern "C" fn recvmmsg(
    fd: c_int,
    v: *mut mmsghdr,
    n: c_uint,
    flags: c_int,
    t: *mut timespec,
) -> c_int {
    if !matches!(
        target(fd),
        Target::Smc(_) | Target::Foreign | Target::Relay(_)
    ) {
        if let Some(r) = hooks::crossed(fd, flags) {
            return r as c_int;
        }
        // SAFETY: passed on unchanged.
        let got = unsafe { real::recvmmsg(fd, v, n, flags, t) };
        // SMC-R connections passed to this process (SCM_RIGHTS) in the messages received.
        for i in 0..got.max(0) as usize {
            // SAFETY: the kernel filled the first `got` of the caller's headers.
            unsafe { hooks::received_rights(0, &(*v.add(i)).msg_hdr) };
        }
        return got;
    }
    if v.is_null() {
        set_errno(libc::EFAULT);
        return -1;
    }
    // As the kernel does for a stream socket: one recvmsg per header, each blocking as the
    // flags say; MSG_WAITFORONE makes those after the first nonblocking. (The timeout is
    // looked at only between messages, as the kernel does; here each recvmsg decides.)
    let mut done = 0;
    for i in 0..n as usize {
        let f = if flags & libc::MSG_WAITFORONE != 0 && done > 0 {
            (flags & !libc::MSG_WAITFORONE) | libc::MSG_DONTWAIT
        } else {
            flags & !libc::MSG_WAITFORONE
        };
        // SAFETY: the caller's array of `n` headers.
        let m = unsafe { &mut *v.add(i) };
        // SAFETY: the header's message (our recvmsg checks what the connection needs).
        let r = unsafe { hooks::recvmsg(fd, &mut m.msg_hdr, f) };
        if r < 0 {
            if done == 0 {
                return -1;
            }
            break;
        }
        m.msg_len = r as c_uint;
        done += 1;
    }
    done
}

#[no_mangle]
pub unsafe extern "C" fn sendmmsg(fd: c_int, v: *mut mmsghdr, n: c_uint, flags: c_int) -> c_int {
    if !matches!(
        target(fd),
        Target::Smc(_) | Target::Foreign | Target::Relay(_)
    ) {
        if v.is_null()
            || n == 0
            || !table::ANY.load(std::sync::atomic::Ordering::Relaxed)
            || crate::inside()
        {
            // SAFETY: passed on unchanged.
            return unsafe { real::sendmmsg(fd, v, n, flags) };
        }
        // SCM_RIGHTS in any of the messages: looked at as sendmsg does, each message's
        // passes kept when the kernel sent it (the first `sent` of them), else undone.
        // (The kernel takes at most UIO_MAXIOV messages.)
        let n = n.min(1024);
        let mut noted = Vec::new();
        for i in 0..n as usize {
            // SAFETY: the caller's array of `n` headers.
            let m = unsafe { &(*v.add(i)).msg_hdr };
            noted.push(if m.msg_controllen > 0 {
                // SAFETY: the caller's valid message header.
                unsafe { hooks::passing_in(fd, m) }
            } else {
                crate::relay::Noted::none()
            });
        }
        // SAFETY: passed on unchanged.
        let sent = unsafe { real::sendmmsg(fd, v, n, flags) };
        guard((), || {
            for (i, note) in noted.into_iter().enumerate() {
                crate::relay::sent(note, fd, (i as c_int) < sent);
            }
        });
        return sent;
    }
    if v.is_null() {
        set_errno(libc::EFAULT);
        return -1;
    }
    let mut done = 0;
    for i in 0..n as usize {
        // SAFETY: the caller's array of `n` headers.
        let m = unsafe { &mut *v.add(i) };
        // SAFETY: the header's message.
        let r = unsafe { hooks::sendmsg(fd, &m.msg_hdr, flags) };
        if r < 0 {
            if done == 0 {
                return -1;
            }
            break;
        }
        m.msg_len = r as c_uint;
        done += 1;
    }
    done
}

/// Whether `fd` is a pipe (or FIFO).
fn is_pipe(fd: c_int) -> bool {
    // SAFETY: a stat buffer for fstat to fill.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: plain fstat.
    unsafe { libc::fstat(fd, &mut st) == 0 && st.st_mode & libc::S_IFMT == libc::S_IFIFO }
}

/// Free room in pipe `fd` (its capacity less what it holds).
fn pipe_room(fd: c_int) -> usize {
    // SAFETY: plain fcntl.
    let size = unsafe { real::fcntl(fd, libc::F_GETPIPE_SZ, 0) };
    let mut held: c_int = 0;
    // SAFETY: FIONREAD fills in an int.
    let r = unsafe { real::ioctl(fd, libc::FIONREAD, &mut held as *mut c_int as usize) };
    if size < 0 || r < 0 {
        return 0;
    }
    (size.max(0) as usize).saturating_sub(held.max(0) as usize)
}

/// Wait until `fd` is ready for `events` (a signal ends the wait with EINTR, as the
/// kernel's pipe wait does).
fn wait_for(fd: c_int, events: i16) -> Result<(), c_int> {
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    // SAFETY: one pollfd.
    match unsafe { real::poll(&mut p, 1, -1) } {
        r if r >= 0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EINTR)),
    }
}

/// A write end of pipe `out` that never waits: a description of the pipe of our own, opened
/// nonblocking through `/proc/self/fd`, so that the program's description (and its
/// O_NONBLOCK) stays as it is. `None` without /proc (a chroot) or without a reader.
fn nonblocking_writer(out: c_int) -> Option<c_int> {
    let path = format!("/proc/self/fd/{out}\0");
    // SAFETY: a NUL-terminated path; the descriptor is ours and closed by the caller.
    let fd = unsafe {
        libc::open(
            path.as_ptr().cast(),
            libc::O_WRONLY | libc::O_NONBLOCK | libc::O_CLOEXEC,
        )
    };
    (fd >= 0).then_some(fd)
}

/// Write `buf` to pipe `out` without waiting: what its free pages take (a pipe counts
/// pages, not bytes, so its capacity less FIONREAD may be more than a write can put in).
/// `Ok(0)` when nothing fits.
fn write_pipe_nonblocking(out: c_int, buf: &[u8]) -> Result<usize, c_int> {
    let own = nonblocking_writer(out);
    let w = match own {
        // SAFETY: our descriptor and buffer.
        Some(fd) => unsafe { real::write(fd, buf.as_ptr().cast(), buf.len()) },
        None => {
            // No description of our own: the program's, made nonblocking for this write.
            // SAFETY: plain fcntl and write on the program's pipe.
            unsafe {
                let fl = real::fcntl(out, libc::F_GETFL, 0);
                if fl >= 0 && fl & libc::O_NONBLOCK == 0 {
                    real::fcntl(out, libc::F_SETFL, (fl | libc::O_NONBLOCK) as usize);
                }
                let w = real::write(out, buf.as_ptr().cast(), buf.len());
                let e = *libc::__errno_location();
                if fl >= 0 && fl & libc::O_NONBLOCK == 0 {
                    real::fcntl(out, libc::F_SETFL, fl as usize);
                }
                set_errno(e);
                w
            }
        }
    };
    let e = std::io::Error::last_os_error().raw_os_error();
    if let Some(fd) = own {
        // SAFETY: our own descriptor.
        unsafe { real::close(fd) };
    }
    match w {
        w if w >= 0 => Ok(w as usize),
        _ if e == Some(libc::EAGAIN) => Ok(0),
        _ => Err(e.unwrap_or(libc::EIO)),
    }
}

/// splice from SMC-R connection `c` into pipe `out`, as the kernel's splice from a TCP socket:
/// it waits (unless nonblocking) for data and for room in the pipe, then moves what the pipe
/// takes. The bytes are peeked at, written to the pipe without waiting, and only what the
/// pipe took is consumed: a write that waited for the rest would hang a program that
/// empties the pipe itself (haproxy's splice forwarding, one thread per pipe), and bytes
/// read past what the pipe took could not go back.
fn splice_from(c: &Conn, out: c_int, len: size_t, nonblock: bool) -> ssize_t {
    loop {
        let room = loop {
            let room = pipe_room(out);
            if room > 0 {
                break room;
            }
            if nonblock {
                set_errno(libc::EAGAIN);
                return -1;
            }
            if let Err(e) = wait_for(out, libc::POLLOUT) {
                set_errno(e);
                return -1;
            }
        };
        let mut buf = vec![0u8; len.min(room).min(1 << 20)];
        let flags = libc::MSG_PEEK | if nonblock { libc::MSG_DONTWAIT } else { 0 };
        let n = hooks::smc_recv(c, &mut [&mut buf[..]], flags);
        if n <= 0 {
            return n;
        }
        let took = match write_pipe_nonblocking(out, &buf[..n as usize]) {
            Ok(0) if nonblock => {
                set_errno(libc::EAGAIN);
                return -1;
            }
            Ok(0) => {
                // The free pages did not take the first of these bytes: wait for a reader.
                if let Err(e) = wait_for(out, libc::POLLOUT) {
                    set_errno(e);
                    return -1;
                }
                continue;
            }
            Ok(w) => w,
            Err(e) => {
                set_errno(e);
                return -1;
            }
        };
        // Consume what the pipe took (peeked, so there without waiting).
        let got = hooks::smc_recv(c, &mut [&mut buf[..took]], libc::MSG_DONTWAIT);
        if got != took as ssize_t {
            log!("splice: {took} bytes went into pipe {out}, {got} consumed from the connection");
        }
        return took as ssize_t;
    }
}

/// splice from pipe `inp` into SMC-R connection `c`: no more than the connection takes
/// without waiting when it (or the call) is nonblocking, read from the pipe, then written.
fn splice_to(c: &Conn, inp: c_int, len: size_t, nonblock: bool) -> ssize_t {
    let nonblock = nonblock || c.nonblocking();
    let mut want = len.min(1 << 20);
    if nonblock {
        want = want.min(c.write_room());
        if want == 0 {
            set_errno(libc::EAGAIN);
            return -1;
        }
        let mut p = libc::pollfd {
            fd: inp,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd, no wait.
        if unsafe { real::poll(&mut p, 1, 0) } == 0 {
            set_errno(libc::EAGAIN);
            return -1;
        }
    }
    let mut buf = vec![0u8; want];
    // SAFETY: our buffer of `want` bytes.
    let n = unsafe { real::read(inp, buf.as_mut_ptr().cast(), want) };
    if n <= 0 {
        return n;
    }
    let n = n as usize;
    let mut off = 0;
    while off < n {
        // Blocking for the rest: the bytes taken from the pipe must all go out (in the
        // nonblocking case they fit the room looked at above).
        match c.write(&buf[off..n], false) {
            Ok(w) => off += w,
            Err(e) if off > 0 => {
                log!("splice into an SMC-R connection failed after {off} of {n} bytes: {e}");
                break;
            }
            Err(e) => return hooks::write_result(Err(e), false),
        }
    }
    off as ssize_t
}

#[no_mangle]
pub unsafe extern "C" fn splice(
    fd_in: c_int,
    off_in: *mut loff_t,
    fd_out: c_int,
    off_out: *mut loff_t,
    len: size_t,
    flags: c_uint,
) -> ssize_t {
    let (tin, tout) = (target(fd_in), target(fd_out));
    if matches!(tin, Target::Pass) && matches!(tout, Target::Pass) {
        let nb = if flags & libc::SPLICE_F_NONBLOCK != 0 {
            libc::MSG_DONTWAIT
        } else {
            0
        };
        if let Some(r) = hooks::crossed(fd_in, nb) {
            return r;
        }
        // SAFETY: passed on unchanged.
        return unsafe { real::splice(fd_in, off_in, fd_out, off_out, len, flags) };
    }
    if matches!(tin, Target::Foreign) {
        return hooks::foreign(fd_in);
    }
    if matches!(tout, Target::Foreign) {
        return hooks::foreign(fd_out);
    }
    if matches!(tin, Target::Relay(_)) || matches!(tout, Target::Relay(_)) {
        // The relay socket in place of the TCP socket: the kernel's splice, as for TCP (a
        // nonblocking program socket makes the socket's side nonblocking, through the relay
        // socket's mirrored O_NONBLOCK).
        let fin = if let Target::Relay(r) = &tin {
            r.fd()
        } else {
            fd_in
        };
        let fout = if let Target::Relay(r) = &tout {
            r.fd()
        } else {
            fd_out
        };
        if matches!((&tin, &tout), (Target::Smc(_), _) | (_, Target::Smc(_))) {
            // Two sockets: neither is a pipe.
            set_errno(libc::EINVAL);
            return -1;
        }
        // SAFETY: the caller's arguments, the relay socket in place of the program's.
        return unsafe { real::splice(fin, off_in, fout, off_out, len, flags) };
    }
    guard(-1, || {
        let nonblock = flags & libc::SPLICE_F_NONBLOCK != 0;
        match (tin, tout) {
            (Target::Smc(c), Target::Pass) => {
                // As for a TCP socket: an offset on the socket's side is ESPIPE, the other
                // end must be a pipe.
                if !off_in.is_null() {
                    set_errno(libc::ESPIPE);
                    return -1;
                }
                if !is_pipe(fd_out) {
                    set_errno(libc::EINVAL);
                    return -1;
                }
                if len == 0 {
                    return 0;
                }
                splice_from(&c, fd_out, len, nonblock || c.nonblocking())
            }
            (Target::Pass, Target::Smc(c)) => {
                if !off_out.is_null() {
                    set_errno(libc::ESPIPE);
                    return -1;
                }
                if !is_pipe(fd_in) {
                    set_errno(libc::EINVAL);
                    return -1;
                }
                if len == 0 {
                    return 0;
                }
                splice_to(&c, fd_in, len, nonblock)
            }
            // Two sockets: neither is a pipe.
            _ => {
                set_errno(libc::EINVAL);
                -1
            }
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn epoll_pwait2(
    epfd: c_int,
    evs: *mut epoll_event,
    max: c_int,
    t: *const timespec,
    mask: *const sigset_t,
) -> c_int {
    if max > 0 && table::maybe(epfd) {
        if let Some(e) = table::get(epfd) {
            if let Kind::Epoll(set) = &e.kind {
                let set = set.clone();
                let timeout = if t.is_null() {
                    None
                } else {
                    // SAFETY: the caller's timeout.
                    let t = unsafe { t.read_unaligned() };
                    if t.tv_sec < 0 || !(0..1_000_000_000).contains(&t.tv_nsec) {
                        set_errno(libc::EINVAL);
                        return -1;
                    }
                    Some(Duration::new(t.tv_sec as u64, t.tv_nsec as u32))
                };
                // SAFETY: the caller's arguments.
                return guard(-1, || unsafe {
                    crate::wait::epoll_wait_managed(epfd, &set, evs, max, timeout, mask)
                });
            }
        }
    }
    // SAFETY: passed on unchanged.
    unsafe { real::epoll_pwait2(epfd, evs, max, t, mask) }
}

/// Forget the entries of the numbers from `first` to `last` (they are being closed).
fn forget_range(first: c_uint, last: c_uint) {
    if !(table::ANY.load(std::sync::atomic::Ordering::Relaxed) || crate::wait::any_epoll())
        || table::borrowed_memory()
    {
        return;
    }
    let last = (last as usize).min(table::MAX_FD - 1);
    for fd in first as usize..=last {
        let fd = fd as c_int;
        crate::wait::closed(fd);
        if table::maybe(fd) {
            hooks::forget(fd);
        }
    }
}

/// `syscall(2)` itself: programs that close descriptors with `syscall(SYS_close, fd)` —
/// libuv does, so node's sockets close that way — must not leave the table naming a
/// connection under a number the kernel will hand out again. `SYS_close` and
/// `SYS_close_range` go through our `close` and `close_range`, `SYS_execve` and
/// `SYS_execveat` through what `execve` does first; every other number goes on to the C
/// library unchanged.
///
/// `syscall` is variadic in C; defined here with its six possible arguments. On the ABIs this
/// library is built for (x86-64 and AArch64 Linux), a variadic call passes its integer
/// arguments exactly as a call with that many named ones does, and the C library's
/// `syscall` itself reads all six whatever the call passed (the kernel ignores the extra).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn syscall(
    n: c_long,
    a1: c_long,
    a2: c_long,
    a3: c_long,
    a4: c_long,
    a5: c_long,
    a6: c_long,
) -> c_long {
    if real::resolved() && !crate::inside() {
        if n == libc::SYS_close {
            // SAFETY: the program's call, as close(2).
            return c_long::from(unsafe { hooks::close(a1 as c_int) });
        }
        if n == libc::SYS_close_range {
            // SAFETY: the program's call, as close_range(2).
            return c_long::from(unsafe { close_range(a1 as c_uint, a2 as c_uint, a3 as c_int) });
        }
        // A raw clone that copies the memory (no CLONE_VM): the child notes its flags (see
        // `table::RAW_CLONE_FLAGS`); the call itself is the program's, unchanged.
        if n == libc::SYS_clone || n == libc::SYS_clone3 {
            let flags = if n == libc::SYS_clone {
                a1 as u64
            } else if a1 != 0 {
                // SAFETY: clone3's first argument points at `struct clone_args`, whose first
                // field is the flags (a bad pointer faults in the kernel's copy as well).
                unsafe { (a1 as *const u64).read_unaligned() }
            } else {
                0
            };
            if flags & libc::CLONE_VM as u64 == 0 {
                // SAFETY: passed on unchanged.
                let r = unsafe { real::syscall(n, [a1, a2, a3, a4, a5, a6]) };
                if r == 0 {
                    table::RAW_CLONE_FLAGS.store(flags, std::sync::atomic::Ordering::Relaxed);
                    // The parent's other threads' makes and closes are not here.
                    smc_fabric::fdplace::fork_child();
                }
                return r;
            }
        }
        // An exec made as a raw system call names the inherited connections to the new
        // program as `execve` does (the environment is its third argument, execveat's fourth).
        if n == libc::SYS_execve || n == libc::SYS_execveat {
            if let Some(v) = guard(None, exec::before_exec) {
                let mut args = [a1, a2, a3, a4, a5, a6];
                let at = if n == libc::SYS_execve { 2 } else { 3 };
                let (_owned, env) = exec::env_with(args[at] as *const *const c_char, &v);
                args[at] = env.as_ptr() as c_long;
                // SAFETY: the program's exec with an environment that lives until then.
                return unsafe { real::syscall(n, args) };
            }
        }
    }
    // SAFETY: passed on unchanged.
    unsafe { real::syscall(n, [a1, a2, a3, a4, a5, a6]) }
}

#[no_mangle]
pub unsafe extern "C" fn close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int {
    // CLOSE_RANGE_CLOEXEC only marks the numbers; anything else closes them.
    if flags as c_uint & libc::CLOSE_RANGE_CLOEXEC == 0 && first <= last {
        guard((), || forget_range(first, last));
        if smc_fabric::fdplace::keeps_high() {
            // SAFETY: the program's call, split around the stack's numbers.
            return unsafe { close_sparing(first, last, flags) };
        }
    }
    // SAFETY: passed on unchanged (as close).
    smc_fabric::fdplace::program_closes(|| unsafe { real::close_range(first, last, flags) })
}

/// The program's `close_range(first, last, flags)` over every number in the range but the
/// stack's (`smc_fabric::fdplace`: its descriptors in the upper half of the limit, which a
/// program's `closefrom(3)` would close under its threads). One system call per run of the
/// program's numbers; the first failure is the call's.
unsafe fn close_sparing(first: c_uint, last: c_uint, flags: c_int) -> c_int {
    // One exclusion over the runs' reckoning and their closes: a descriptor the stack makes
    // and places meanwhile would otherwise fall inside a run reckoned before it.
    smc_fabric::fdplace::program_closes(|| {
        let mut r = 0;
        let mut err = 0;
        for (a, b) in smc_fabric::fdplace::unplaced_runs(first, last) {
            // SAFETY: close_range(2) over numbers that are not the library's.
            if unsafe { real::close_range(a, b, flags) } != 0 && r == 0 {
                r = -1;
                err = std::io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EBADF);
            }
        }
        if r != 0 {
            set_errno(err);
        }
        r
    })
}

#[no_mangle]
pub unsafe extern "C" fn closefrom(first: c_int) {
    type F = unsafe extern "C" fn(c_int);
    static P: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    guard((), || forget_range(first.max(0) as c_uint, c_uint::MAX));
    if smc_fabric::fdplace::keeps_high() {
        // SAFETY: as closefrom(3): every number from `first` on, but the stack's.
        unsafe { close_sparing(first.max(0) as c_uint, c_uint::MAX, 0) };
        return;
    }
    let mut p = P.load(std::sync::atomic::Ordering::Relaxed);
    if p == 0 {
        // SAFETY: a NUL-terminated name.
        p = unsafe { libc::dlsym(libc::RTLD_NEXT, c"closefrom".as_ptr()) } as usize;
        P.store(p, std::sync::atomic::Ordering::Relaxed);
    }
    if p == 0 {
        // SAFETY: the system call closefrom is made of (as close).
        smc_fabric::fdplace::program_closes(|| unsafe {
            real::close_range(first.max(0) as c_uint, c_uint::MAX, 0)
        });
        return;
    }
    // SAFETY: dlsym's address of closefrom.
    let f: F = unsafe { std::mem::transmute(p) };
    // SAFETY: passed on unchanged (as close).
    smc_fabric::fdplace::program_closes(|| unsafe { f(first) })
}

type Spawn = unsafe extern "C" fn(
    *mut pid_t,
    *const c_char,
    *const posix_spawn_file_actions_t,
    *const posix_spawnattr_t,
    *const *mut c_char,
    *const *mut c_char,
) -> c_int;

/// posix_spawn and posix_spawnp: the C library runs the new program's exec itself (not
/// through `execve`), so the SMC-R connections it inherits are named here, in its
/// environment, as for a forked child's exec: their calls fail with EIO there, never a wait
/// on the idle TCP socket. This process keeps them as they are.
unsafe fn spawn(
    real: Option<Spawn>,
    pid: *mut pid_t,
    path: *const c_char,
    actions: *const posix_spawn_file_actions_t,
    attr: *const posix_spawnattr_t,
    argv: *const *mut c_char,
    envp: *const *mut c_char,
) -> c_int {
    let Some(real) = real else {
        return libc::ENOSYS;
    };
    smc_fabric::QuietWake::settle();
    match guard(None, || exec::surviving_connections(true)) {
        // SAFETY: passed on unchanged.
        None => unsafe { real(pid, path, actions, attr, argv, envp) },
        Some(v) => {
            log!("posix_spawn: SMC-R connections {v} named to the new program");
            let (_owned, env) = exec::env_with(envp as *const *const c_char, &v);
            // SAFETY: the caller's arguments, an environment that lives until the call ends.
            unsafe {
                real(
                    pid,
                    path,
                    actions,
                    attr,
                    argv,
                    env.as_ptr() as *const *mut c_char,
                )
            }
        }
    }
}

static SPAWN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static SPAWNP: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[no_mangle]
pub unsafe extern "C" fn posix_spawn(
    pid: *mut pid_t,
    path: *const c_char,
    actions: *const posix_spawn_file_actions_t,
    attr: *const posix_spawnattr_t,
    argv: *const *mut c_char,
    envp: *const *mut c_char,
) -> c_int {
    // SAFETY: the caller's arguments.
    unsafe {
        spawn(
            resolve::<Spawn>(&SPAWN, c"posix_spawn"),
            pid,
            path,
            actions,
            attr,
            argv,
            envp,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn posix_spawnp(
    pid: *mut pid_t,
    file: *const c_char,
    actions: *const posix_spawn_file_actions_t,
    attr: *const posix_spawnattr_t,
    argv: *const *mut c_char,
    envp: *const *mut c_char,
) -> c_int {
    // SAFETY: the caller's arguments.
    unsafe {
        spawn(
            resolve::<Spawn>(&SPAWNP, c"posix_spawnp"),
            pid,
            file,
            actions,
            attr,
            argv,
            envp,
        )
    }
}

type ExecWithEnv =
    unsafe extern "C" fn(*const c_char, *const *const c_char, *const *const c_char) -> c_int;
type FdExec = unsafe extern "C" fn(c_int, *const *const c_char, *const *const c_char) -> c_int;

/// The C library's function `name` (resolved at first use), as a `T`.
fn resolve<T: Copy>(slot: &std::sync::atomic::AtomicUsize, name: &std::ffi::CStr) -> Option<T> {
    let mut p = slot.load(std::sync::atomic::Ordering::Relaxed);
    if p == 0 {
        // SAFETY: a NUL-terminated name.
        p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
        slot.store(p, std::sync::atomic::Ordering::Relaxed);
    }
    // SAFETY: dlsym's address of a function whose C type `T` is (a function pointer, the
    // size of a usize).
    (p != 0).then(|| unsafe { std::mem::transmute_copy::<usize, T>(&p) })
}

static EXECVPE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static FEXECVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The C library's `execvpe` (ENOSYS if it has none).
pub(crate) unsafe fn real_execvpe(
    file: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    let Some(real) = resolve::<ExecWithEnv>(&EXECVPE, c"execvpe") else {
        set_errno(libc::ENOSYS);
        return -1;
    };
    // SAFETY: passed on.
    unsafe { real(file, argv, envp) }
}

/// execvpe and fexecve as execve (`exec::before_exec`): the C library's `execvp` reaches
/// `execvpe` inside itself, but a program may call these directly.
#[no_mangle]
pub unsafe extern "C" fn execvpe(
    file: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    match guard(None, exec::before_exec) {
        // SAFETY: passed on unchanged.
        None => unsafe { real_execvpe(file, argv, envp) },
        Some(v) => {
            let (_owned, env) = exec::env_with(envp, &v);
            // SAFETY: the caller's arguments, an environment that lives until the exec.
            unsafe { real_execvpe(file, argv, env.as_ptr()) }
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn fexecve(
    fd: c_int,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    let Some(real) = resolve::<FdExec>(&FEXECVE, c"fexecve") else {
        set_errno(libc::ENOSYS);
        return -1;
    };
    match guard(None, exec::before_exec) {
        // SAFETY: passed on unchanged.
        None => unsafe { real(fd, argv, envp) },
        Some(v) => {
            let (_owned, env) = exec::env_with(envp, &v);
            // SAFETY: the caller's arguments, an environment that lives until the exec.
            unsafe { real(fd, argv, env.as_ptr()) }
        }
    }
}
