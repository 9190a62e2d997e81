//! The `LD_PRELOAD` library of `smc run`: unmodified dynamically linked programs use SMC-R.
//!
//! Design (see `docs/preload.md`): the program keeps its real TCP socket; the library
//! exports the socket calls, the wait calls (epoll, poll, select) and the descriptor calls
//! (close, dup, fcntl, ioctl) under the C library's names, looks the descriptor up in its
//! table ([`table`]) and passes the call to the C library unless the descriptor is a managed
//! TCP socket. A managed connection runs discovery and the CLC rendezvous through
//! [`smc::fdapi`] at `connect` (client) or at the first use after `accept` (server, so that the
//! process that serves it, maybe a forked child, is the one whose stack owns it); over SMC-R
//! its reads and writes go to the stack, and the wait calls report its readiness computed in
//! user space, sleeping in the real system call on the connection's eventfds besides the
//! program's other descriptors. Only AF_INET/AF_INET6 stream sockets are touched.
//!
//! The library logs to the file named by `SMC_LOG` (never to the program's output).

// The exports are C functions under the C library's names: their safety contract is the
// C one, documented in the manual pages.
#![allow(clippy::missing_safety_doc)]

mod connect;
mod connecting;
mod creds;

/// Tests that make child processes, or look at this process's children, run one at a time:
/// a child of one (a copy of every descriptor of the test process) is a holder of another's
/// socket to `keep`'s look at the children.
#[cfg(test)]
pub(crate) static TEST_CHILDREN: std::sync::Mutex<()> = std::sync::Mutex::new(());
mod exec;
mod execl;
mod hooks;
mod rare;
mod real;
mod relay;
mod rlimit;
mod settle;
mod table;
mod vfork;
mod wait;

use std::io;
use std::sync::atomic::Ordering;

/// The `SMC_LOG` path, if any.
static LOG_PATH: std::sync::OnceLock<std::ffi::CString> = std::sync::OnceLock::new();

/// Write one line to the `SMC_LOG` file, if any. The file is opened for each line, not kept
/// open: a program that closes every descriptor it did not make (sshd's and ssh's
/// `closefrom(3)` at start, a daemon's close loop) would close a kept one, and the next
/// line would go to whatever file or socket the program opened under that number.
pub(crate) fn write_log(msg: std::fmt::Arguments<'_>) {
    let Some(path) = LOG_PATH.get() else {
        return;
    };
    let pid = table::PID.load(Ordering::Relaxed);
    let line = format!("smc-preload[{pid}]: {msg}\n");
    // SAFETY: a NUL-terminated path; a valid buffer; the descriptor is ours.
    unsafe {
        let fd = libc::open(
            path.as_ptr(),
            libc::O_WRONLY | libc::O_APPEND | libc::O_CREAT | libc::O_CLOEXEC,
            0o644,
        );
        if fd >= 0 {
            let _ = real::write(fd, line.as_ptr().cast(), line.len());
            real::close(fd);
        }
    }
}

macro_rules! log {
    ($($t:tt)*) => { $crate::write_log(format_args!($($t)*)) };
}
pub(crate) use log;

/// Set errno.
pub(crate) fn set_errno(e: i32) {
    // SAFETY: the calling thread's errno.
    unsafe { *libc::__errno_location() = e };
}

/// The errno TCP would give for `e`.
pub(crate) fn errno_of(e: &io::Error) -> i32 {
    if let Some(n) = e.raw_os_error() {
        return n;
    }
    match e.kind() {
        io::ErrorKind::WouldBlock => libc::EAGAIN,
        io::ErrorKind::ConnectionReset => libc::ECONNRESET,
        io::ErrorKind::ConnectionAborted => libc::ECONNABORTED,
        io::ErrorKind::ConnectionRefused => libc::ECONNREFUSED,
        io::ErrorKind::BrokenPipe => libc::EPIPE,
        io::ErrorKind::TimedOut => libc::ETIMEDOUT,
        io::ErrorKind::NotConnected => libc::ENOTCONN,
        io::ErrorKind::Interrupted => libc::EINTR,
        io::ErrorKind::InvalidInput => libc::EINVAL,
        io::ErrorKind::Unsupported => libc::EOPNOTSUPP,
        _ => libc::EIO,
    }
}

std::thread_local! {
    /// How many hook bodies ([`guard`]) this thread is in.
    static DEPTH: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Whether this thread runs the library's own code (a hook's body): a call it makes on a
/// descriptor — the stack closing an eventfd it replaced, reading its TCP socket — is the
/// library's, never the program's, and goes straight to the C library. (Otherwise a number
/// the table still names could route the library's own close back into the stack it is
/// running, under the stack's lock.)
pub(crate) fn inside() -> bool {
    DEPTH.try_with(|d| d.get() > 0).unwrap_or(false)
}

/// Run `f`, turning a panic into EIO (an unwind must not cross into C).
pub(crate) fn guard<R>(fail: R, f: impl FnOnce() -> R) -> R {
    struct Depth;
    impl Drop for Depth {
        fn drop(&mut self) {
            let _ = DEPTH.try_with(|d| d.set(d.get().saturating_sub(1)));
        }
    }
    let _ = DEPTH.try_with(|d| d.set(d.get() + 1));
    let _depth = Depth;
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(_) => {
            log!("panic in a hook; the call fails with EIO");
            set_errno(libc::EIO);
            fail
        }
    }
}

/// Descriptors a thread of the library holds at a low number for a while (just made, before
/// it is moved up; a pump's waiting eventfd): the program's `close` of such a number fails
/// with EBADF instead of closing it. The number cannot be the program's own at the same
/// time, so the program closes a number it had already closed (bash closes some pipes
/// twice): without this, that second close closed the relay server's socket in the middle
/// of a request, or a pump's eventfd.
static HELD: [std::sync::atomic::AtomicI32; 64] =
    [const { std::sync::atomic::AtomicI32::new(-1) }; 64];
/// How many numbers [`HELD`] holds (the close hook looks no further while none).
static HELD_N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A number held in [`HELD`] while this lives.
pub(crate) struct Held(i32);

impl Held {
    pub(crate) fn new(fd: i32) -> Held {
        let noted = fd >= 0
            && HELD.iter().any(|s| {
                s.compare_exchange(-1, fd, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            });
        if noted {
            HELD_N.fetch_add(1, Ordering::AcqRel);
            Held(fd)
        } else {
            Held(-1)
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if self.0 >= 0
            && HELD.iter().any(|s| {
                s.compare_exchange(self.0, -1, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            })
        {
            HELD_N.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Whether a thread of the library holds number `fd` ([`HELD`]).
pub(crate) fn held(fd: i32) -> bool {
    HELD_N.load(Ordering::Acquire) > 0 && HELD.iter().any(|s| s.load(Ordering::Acquire) == fd)
}

extern "C" fn at_fork_prepare() {
    // The child inherits the policy: not a bulk read's kept `SCHED_BATCH` (smc-fabric
    // sched.rs), nor do the programs of `exec`, `posix_spawn` and `vfork` below.
    smc_fabric::QuietWake::settle();
    guard((), connecting::fork_prepare);
    settle::fork_prepare();
    guard((), relay::fork_prepare);
    smc::fdapi::fork_prepare();
    table::fork_prepare();
}

extern "C" fn at_fork_parent() {
    table::fork_release();
    smc::fdapi::fork_parent();
    guard((), relay::fork_parent);
    settle::fork_parent();
    connecting::fork_parent();
}

extern "C" fn at_fork_child() {
    // The parent's other threads' makes and closes are not here.
    smc_fabric::fdplace::fork_child();
    // SAFETY: getpid has no preconditions.
    table::PID.store(unsafe { libc::getpid() }, Ordering::Relaxed);
    table::fork_release();
    smc::fdapi::fork_child();
    relay::fork_child();
    settle::fork_child();
    connecting::fork_child();
    // The numbers the parent's threads held are ordinary copies here.
    for s in &HELD {
        s.store(-1, Ordering::Relaxed);
    }
    HELD_N.store(0, Ordering::Relaxed);
}

/// The constructor: resolve the C library's functions, open the log, register the fork
/// handlers.
extern "C" fn init() {
    // SAFETY: dlsym with valid names; getpid has no preconditions.
    unsafe {
        real::resolve();
        table::PID.store(libc::getpid(), Ordering::Relaxed);
    }
    smc::fdapi::keep_settings();
    table::fork_probe_init();
    relay::init();
    if let Some(path) = std::env::var_os("SMC_LOG") {
        use std::os::unix::ffi::OsStrExt;
        if let Ok(c) = std::ffi::CString::new(path.as_bytes()) {
            let _ = LOG_PATH.set(c);
        }
    }
    // SAFETY: handlers that only touch this library's state.
    unsafe {
        libc::pthread_atfork(
            Some(at_fork_prepare),
            Some(at_fork_parent),
            Some(at_fork_child),
        );
    }
    let exe = std::env::current_exe().unwrap_or_default();
    log!("loaded into {}", exe.display());
    exec::adopt_inherited();
}

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;

/// The destructor (at `exit()`): close the connections the program left open, then give the
/// peers the time to read what was sent (see [`smc::fdapi::linger`]); at most
/// `SMC_EXIT_LINGER_MS` (default 2000).
extern "C" fn fini() {
    guard((), || {
        if !table::ANY.load(Ordering::Relaxed) {
            return;
        }
        // (A relay request meanwhile waits for the records: `relay::closing_mark`.)
        let marks: Vec<_> = table::connection_sockets()
            .into_iter()
            .map(|id| relay::closing_mark(id.1))
            .collect();
        let open = table::take_all_ours();
        // Connections a forked child (or a receiver of a pass) may still hold: kept for it
        // (`relay::closing`).
        let mut seen = Vec::new();
        for (fd, e) in &open {
            let Some(&id) = e.socket.get() else {
                continue;
            };
            if seen.contains(&id) {
                continue;
            }
            let numbers = || -> Vec<i32> {
                open.iter()
                    .filter(|(_, x)| x.socket.get() == Some(&id))
                    .map(|(n, _)| *n)
                    .collect()
            };
            match &e.kind {
                table::Kind::Smc(c) if e.ours() && e.forked.load(Ordering::Relaxed) => {
                    seen.push(id);
                    relay::closing(*fd, &numbers(), id, Some(c), None);
                }
                // A passed connection this process relays (`relay::closing_relayed`).
                table::Kind::Relayed(r) => {
                    seen.push(id);
                    relay::closing_relayed(*fd, &numbers(), e, r);
                }
                _ => {}
            }
        }
        drop(open);
        drop(marks);
        let ms = |var: &str, default: u64| {
            std::env::var(var)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(default)
        };
        // Other processes still using connections relayed through this one (a parent that
        // exits before its children): the pumps go on until they close, bounded.
        relay::linger(std::time::Duration::from_millis(ms(
            "SMC_RELAY_EXIT_MS",
            60_000,
        )));
        smc::fdapi::linger(std::time::Duration::from_millis(ms(
            "SMC_EXIT_LINGER_MS",
            2000,
        )));
    });
}

#[used]
#[link_section = ".fini_array"]
static FINI: extern "C" fn() = fini;
