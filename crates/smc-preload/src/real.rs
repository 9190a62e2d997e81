//! The C library's own entry points behind our exports, resolved once with
//! `dlsym(RTLD_NEXT, …)` in the library's constructor. A call that comes before the
//! constructor ran (another library's constructor) goes straight to the system call.

use libc::{
    c_int, c_long, c_ulong, c_void, epoll_event, fd_set, iovec, msghdr, nfds_t, off_t, pollfd,
    sigset_t, size_t, sockaddr, socklen_t, ssize_t, timespec, timeval,
};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A system call with up to six arguments, as `syscall(2)` takes them.
unsafe fn sys(n: c_long, a: [usize; 6]) -> c_long {
    // SAFETY: the caller passes the arguments the system call `n` takes.
    unsafe { libc::syscall(n, a[0], a[1], a[2], a[3], a[4], a[5]) }
}

macro_rules! reals {
    ($( $name:ident ( $($arg:ident : $ty:ty),* ) -> $ret:ty = $sysno:expr ; )*) => {
        /// The resolved addresses, one per entry point (0: not resolved).
        #[allow(non_upper_case_globals)]
        mod addr {
            use super::AtomicUsize;
            $( pub(super) static $name: AtomicUsize = AtomicUsize::new(0); )*
        }
        $(
            /// The C library's own function of this name.
            #[allow(clippy::too_many_arguments, clippy::useless_conversion)]
            pub(crate) unsafe fn $name($($arg: $ty),*) -> $ret {
                let p = addr::$name.load(Ordering::Relaxed);
                if p == 0 {
                    let mut a = [0usize; 6];
                    let args: &[usize] = &[$($arg as usize),*];
                    a[..args.len()].copy_from_slice(args);
                    // SAFETY: the system call takes the same arguments as the function.
                    return unsafe { sys($sysno, a) } as $ret;
                }
                // SAFETY: `p` is the address dlsym gave for this name, whose C type this is.
                let f: unsafe extern "C" fn($($ty),*) -> $ret = unsafe { std::mem::transmute(p) };
                // SAFETY: the caller's arguments are passed on unchanged.
                unsafe { f($($arg),*) }
            }
        )*
        /// Resolve every entry point (the constructor calls this once).
        pub(crate) unsafe fn resolve() {
            RESOLVED.store(true, Ordering::Release);
            $(
                // SAFETY: a NUL-terminated name; RTLD_NEXT finds the next definition.
                let p = unsafe {
                    libc::dlsym(libc::RTLD_NEXT, concat!(stringify!($name), "\0").as_ptr().cast())
                };
                addr::$name.store(p as usize, Ordering::Relaxed);
            )*
        }
    };
}

reals! {
    connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int = libc::SYS_connect;
    listen(fd: c_int, backlog: c_int) -> c_int = libc::SYS_listen;
    accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int = libc::SYS_accept;
    accept4(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int = libc::SYS_accept4;
    read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t = libc::SYS_read;
    write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t = libc::SYS_write;
    readv(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t = libc::SYS_readv;
    writev(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t = libc::SYS_writev;
    recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t = libc::SYS_recvfrom;
    recvfrom(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> ssize_t = libc::SYS_recvfrom;
    recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t = libc::SYS_recvmsg;
    send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t = libc::SYS_sendto;
    sendto(fd: c_int, buf: *const c_void, n: size_t, flags: c_int, addr: *const sockaddr, len: socklen_t) -> ssize_t = libc::SYS_sendto;
    sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t = libc::SYS_sendmsg;
    sendfile(out: c_int, inp: c_int, off: *mut off_t, n: size_t) -> ssize_t = libc::SYS_sendfile;
    close(fd: c_int) -> c_int = libc::SYS_close;
    shutdown(fd: c_int, how: c_int) -> c_int = libc::SYS_shutdown;
    dup(fd: c_int) -> c_int = libc::SYS_dup;
    dup2(fd: c_int, to: c_int) -> c_int = libc::SYS_dup2;
    dup3(fd: c_int, to: c_int, flags: c_int) -> c_int = libc::SYS_dup3;
    fcntl(fd: c_int, cmd: c_int, arg: usize) -> c_int = libc::SYS_fcntl;
    ioctl(fd: c_int, req: c_ulong, arg: usize) -> c_int = libc::SYS_ioctl;
    setsockopt(fd: c_int, level: c_int, name: c_int, val: *const c_void, len: socklen_t) -> c_int = libc::SYS_setsockopt;
    getsockopt(fd: c_int, level: c_int, name: c_int, val: *mut c_void, len: *mut socklen_t) -> c_int = libc::SYS_getsockopt;
    epoll_create1(flags: c_int) -> c_int = libc::SYS_epoll_create1;
    epoll_ctl(epfd: c_int, op: c_int, fd: c_int, ev: *mut epoll_event) -> c_int = libc::SYS_epoll_ctl;
    epoll_pwait(epfd: c_int, evs: *mut epoll_event, max: c_int, timeout: c_int, mask: *const sigset_t) -> c_int = libc::SYS_epoll_pwait;
    ppoll(fds: *mut pollfd, n: nfds_t, t: *const timespec, mask: *const sigset_t) -> c_int = libc::SYS_ppoll;
    select(n: c_int, r: *mut fd_set, w: *mut fd_set, e: *mut fd_set, t: *mut timeval) -> c_int = libc::SYS_select;
    pselect(n: c_int, r: *mut fd_set, w: *mut fd_set, e: *mut fd_set, t: *const timespec, mask: *const sigset_t) -> c_int = libc::SYS_pselect6;
    recvmmsg(fd: c_int, v: *mut libc::mmsghdr, n: libc::c_uint, flags: c_int, t: *mut timespec) -> c_int = libc::SYS_recvmmsg;
    sendmmsg(fd: c_int, v: *mut libc::mmsghdr, n: libc::c_uint, flags: c_int) -> c_int = libc::SYS_sendmmsg;
    splice(fd_in: c_int, off_in: *mut libc::loff_t, fd_out: c_int, off_out: *mut libc::loff_t, len: size_t, flags: libc::c_uint) -> ssize_t = libc::SYS_splice;
    epoll_pwait2(epfd: c_int, evs: *mut epoll_event, max: c_int, t: *const timespec, mask: *const sigset_t) -> c_int = libc::SYS_epoll_pwait2;
    close_range(first: libc::c_uint, last: libc::c_uint, flags: c_int) -> c_int = libc::SYS_close_range;
    execv(path: *const libc::c_char, argv: *const *const libc::c_char) -> c_int = libc::SYS_execve;
    execvp(file: *const libc::c_char, argv: *const *const libc::c_char) -> c_int = libc::SYS_execve;
    execve(path: *const libc::c_char, argv: *const *const libc::c_char, envp: *const *const libc::c_char) -> c_int = libc::SYS_execve;
    prlimit(pid: libc::pid_t, res: c_int, new: *const libc::rlimit, old: *mut libc::rlimit) -> c_int = libc::SYS_prlimit64;
}

/// Whether the constructor resolved the entry points (before it, our exports pass every
/// call straight on).
static RESOLVED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub(crate) fn resolved() -> bool {
    RESOLVED.load(Ordering::Acquire)
}

/// The C library's `syscall`, found on first use (our export of that name is what
/// `libc::syscall` reaches from inside this library too, so it cannot be the fallback).
static SYSCALL: AtomicUsize = AtomicUsize::new(0);

/// The C library's own `syscall(2)`.
pub(crate) unsafe fn syscall(n: c_long, a: [c_long; 6]) -> c_long {
    let mut p = SYSCALL.load(Ordering::Relaxed);
    if p == 0 {
        // SAFETY: a NUL-terminated name; RTLD_NEXT finds the C library's definition.
        p = unsafe { libc::dlsym(libc::RTLD_NEXT, c"syscall".as_ptr()) } as usize;
        if p == 0 {
            // SAFETY: the calling thread's errno.
            unsafe { *libc::__errno_location() = libc::ENOSYS };
            return -1;
        }
        SYSCALL.store(p, Ordering::Relaxed);
    }
    // SAFETY: `p` is the C library's `syscall`, a variadic function of this shape.
    let f: unsafe extern "C" fn(c_long, ...) -> c_long = unsafe { std::mem::transmute(p) };
    // SAFETY: the caller's arguments, passed on unchanged (the kernel ignores those the
    // system call does not take).
    unsafe { f(n, a[0], a[1], a[2], a[3], a[4], a[5]) }
}

/// `poll` through `ppoll` (one real entry point for both).
pub(crate) unsafe fn poll(fds: *mut pollfd, n: nfds_t, timeout_ms: c_int) -> c_int {
    let ts;
    let t = if timeout_ms < 0 {
        std::ptr::null()
    } else {
        ts = timespec {
            tv_sec: libc::time_t::from(timeout_ms / 1000),
            tv_nsec: c_long::from(timeout_ms % 1000) * 1_000_000,
        };
        &ts as *const timespec
    };
    // SAFETY: the caller's array; a valid or null timeout.
    unsafe { ppoll(fds, n, t, std::ptr::null()) }
}
