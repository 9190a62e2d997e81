//! Accepted connections that the program leaves unused: their server rendezvous runs after
//! a short while in a thread of the library, not at the program's first use.
//!
//! The rendezvous of an accepted connection whose client offered SMC-R runs at its first use
//! (`hooks::target`), in whichever process that is (socat's forked child serves what its
//! parent accepted, over its own stack). Its client waits in `connect` meanwhile. Linux's
//! SMC-R answers the Proposal in the kernel as soon as the TCP handshake is done, and RFC
//! 7609 C.5 has the client end the connection when the CLC handshake does not complete:
//! "If the TCP and/or CLC handshakes time out, the TCP connection must be terminated as it
//! would be in a legacy IP environment when connection setup doesn't complete in a timely
//! manner." So a server that accepts several connections before it serves any (or one that
//! waits in a read on another connection, or whose workers are all busy) kept its clients
//! in `connect` — a client that connects again only after its first `connect` returned
//! waited for the whole CLC timeout (30 s), and its `connect` then failed with ETIMEDOUT;
//! over TCP the kernel's backlog completes every handshake at once.
//!
//! Now a connection accepted by this process and not used within [`SETTLE_AFTER`] has its
//! rendezvous run by the settler thread, as the first use would run it: under the entry's
//! lock (a first use meanwhile waits for it and then finds the result), on a duplicate of the
//! socket (the program may close or reuse its number meanwhile), installed only if the
//! number still names the same entry. A connection that existed at a `fork()` is left to its
//! first use: the child may be the one that serves it (the parent closes its copy), and the
//! child's own table holds the same pending entry. A process that forked while it held an
//! unused accepted connection (a server that forks per connection) settles nothing from then
//! on, and a fork waits for a settle under way ([`SETTLING`]).

use std::os::fd::{AsFd as _, AsRawFd as _};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use libc::c_int;

use crate::hooks::{bfd, install_if, nonblocking_flag, set_nonblocking_flag};
use crate::log;
use crate::table::{self, Entry, Kind};

/// How long an accepted connection may stay unused before the settler runs its rendezvous
/// (`SMC_SETTLE_MS` overrides it). Long enough for a forked child or a worker thread to take
/// it first, short against the time a client's `connect` may wait.
const SETTLE_AFTER: Duration = Duration::from_millis(50);

/// Accepted connections waiting for their first use: number, entry, when accepted, the
/// fork generation then.
struct Unused {
    list: Vec<(c_int, Weak<Entry>, Instant, u64)>,
}

static UNUSED: Mutex<Unused> = Mutex::new(Unused { list: Vec::new() });
static WAKE: Condvar = Condvar::new();
/// The process whose settler thread runs (a forked child has none until it starts one).
static SETTLER_PID: AtomicI32 = AtomicI32::new(0);
/// Counts the forks: an entry accepted before the latest one is left to its first use.
static FORKS: AtomicU64 = AtomicU64::new(0);
/// Held by the settler through a settle and by a `fork()` while it counts itself: a settle
/// runs entirely before a fork or not at all for what the fork copies (otherwise the parent's
/// settler and the child's first use ran two server rendezvous on one socket: each read part
/// of the client's messages, and the connection fell back to TCP).
static SETTLING: Mutex<()> = Mutex::new(());
/// This process forked while it held an unused accepted connection: a server that forks per
/// connection (a postmaster, socat, sshd). Its children serve what it accepts; a settle here
/// would only make them relay through it. Nothing is settled here from then on.
static FORKING_SERVER: AtomicBool = AtomicBool::new(false);

fn settle_after() -> Duration {
    static AFTER: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *AFTER.get_or_init(|| {
        std::env::var("SMC_SETTLE_MS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .map(Duration::from_millis)
            .unwrap_or(SETTLE_AFTER)
    })
}

/// `fd` was just accepted and waits for its rendezvous (entry `e`, `Kind::Pending`).
pub(crate) fn accepted(fd: c_int, e: &Arc<Entry>) {
    if FORKING_SERVER.load(Ordering::Relaxed) {
        return;
    }
    let mut u = UNUSED.lock().unwrap_or_else(|p| p.into_inner());
    u.list.push((
        fd,
        Arc::downgrade(e),
        Instant::now(),
        FORKS.load(Ordering::Relaxed),
    ));
    drop(u);
    let pid = table::PID.load(Ordering::Relaxed);
    if SETTLER_PID.swap(pid, Ordering::AcqRel) != pid {
        let started = smc::fdapi::signals_blocked(|| {
            smc_fabric::threads::spawn_running(
                std::thread::Builder::new().name("smc-settle".into()),
                run,
            )
            .is_ok()
        });
        if !started {
            // Left to the first use, as before; another accept tries again.
            SETTLER_PID.store(0, Ordering::Release);
        }
    }
    WAKE.notify_one();
}

std::thread_local! {
    /// The settler's locks, held by the forking thread from [`fork_prepare`] until
    /// [`fork_parent`] or [`fork_child`].
    static FORK_HELD: std::cell::RefCell<Option<ForkHeld>> = const { std::cell::RefCell::new(None) };
}

struct ForkHeld {
    // Released in this order: the list, then the settle lock.
    _unused: std::sync::MutexGuard<'static, Unused>,
    _settling: std::sync::MutexGuard<'static, ()>,
}

/// Before a `fork()`: what is pending now is left to its first use. The settler's locks are
/// held across the fork (released by [`fork_parent`] and [`fork_child`]): the child gets a
/// copy of each only unlocked. (They were released at the end of this handler before: a
/// settler that took one in the instant before the fork left it locked in the child, whose
/// own next fork then waited forever — socat's serving child, which forks for `SYSTEM:cat`.)
pub(crate) fn fork_prepare() {
    let settling = SETTLING.lock().unwrap_or_else(|p| p.into_inner());
    FORKS.fetch_add(1, Ordering::AcqRel);
    let unused = UNUSED.lock().unwrap_or_else(|p| p.into_inner());
    if !unused.list.is_empty() {
        FORKING_SERVER.store(true, Ordering::Relaxed);
    }
    FORK_HELD.with(|h| {
        *h.borrow_mut() = Some(ForkHeld {
            _unused: unused,
            _settling: settling,
        })
    });
}

/// After a `fork()`, in the parent.
pub(crate) fn fork_parent() {
    FORK_HELD.with(|h| drop(h.borrow_mut().take()));
}

/// After a `fork()`, in the child (the forking thread is this one: it unlocks its own).
pub(crate) fn fork_child() {
    FORK_HELD.with(|h| drop(h.borrow_mut().take()));
}

/// The settler thread: sleeps until the oldest pending connection is due.
fn run() {
    // The library's own code: its calls on descriptors go straight to the C library.
    crate::guard((), || loop {
        let due = {
            let mut u = UNUSED.lock().unwrap_or_else(|p| p.into_inner());
            let forks = FORKS.load(Ordering::Relaxed);
            let after = settle_after();
            let now = Instant::now();
            u.list
                .retain(|(_, e, _, gen)| *gen == forks && e.strong_count() > 0);
            let mut due = Vec::new();
            u.list.retain(|(fd, e, at, gen)| {
                if now.duration_since(*at) < after {
                    return true;
                }
                if let Some(e) = e.upgrade() {
                    due.push((*fd, e, *gen));
                }
                false
            });
            if due.is_empty() {
                let wait = u
                    .list
                    .iter()
                    .map(|(_, _, at, _)| (*at + after).saturating_duration_since(now))
                    .min();
                match wait {
                    Some(w) => drop(WAKE.wait_timeout(u, w)),
                    None => drop(WAKE.wait(u)),
                }
                continue;
            }
            due
        };
        for (fd, e, gen) in due {
            let _settling = SETTLING.lock().unwrap_or_else(|p| p.into_inner());
            // Checked again where a fork cannot slip in between.
            if FORKS.load(Ordering::Acquire) == gen && !FORKING_SERVER.load(Ordering::Relaxed) {
                settle(fd, &e);
            }
        }
    });
}

/// Run the rendezvous of `fd` (entry `e`) if it is still pending and this process's.
fn settle(fd: c_int, e: &Arc<Entry>) {
    let Kind::Pending(once) = &e.kind else {
        return;
    };
    if !e.ours() {
        return;
    }
    let _g = once.lock().unwrap_or_else(|p| p.into_inner());
    match table::get(fd) {
        Some(now) if Arc::ptr_eq(&now, e) => {}
        // Used (installed), closed or replaced meanwhile.
        _ => return,
    }
    // A duplicate of our own, checked to be the same socket: from here the program may close
    // or reuse its number without the rendezvous touching anything else.
    let Ok(dup) = smc_fabric::fdplace::dup_placed(bfd(fd)) else {
        return;
    };
    let same = table::socket_id(dup.as_raw_fd());
    if same.is_none() || same != e.socket.get().copied() {
        return;
    }
    let nb = nonblocking_flag(dup.as_raw_fd());
    if nb {
        set_nonblocking_flag(dup.as_raw_fd(), false);
    }
    let r = smc::fdapi::setup_server(dup.as_fd());
    if nb {
        set_nonblocking_flag(dup.as_raw_fd(), true);
    }
    match r {
        Ok(setup) => {
            if install_if(fd, e, setup, nb) {
                log!(
                    "fd {fd}: unused for {:?} after accept: rendezvous run",
                    settle_after()
                );
            } else {
                log!("fd {fd}: closed during its rendezvous: connection closed");
            }
        }
        Err(err) => {
            log!("fd {fd}: server rendezvous failed: {err}");
            if let Some(old) = table::take_if(fd, e) {
                table::release(old);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The settler's locks are never copied locked into a forked child: a thread that takes
    /// them over and over (as the settler does, for every due connection) while this one
    /// forks through the library's handlers, and each child forks once more (socat's serving
    /// child forks for `SYSTEM:cat`). When the handler released them before the fork, a child
    /// in most runs inherited one held by the other thread and waited forever in its own
    /// `fork_prepare`.
    #[test]
    fn a_forked_child_never_inherits_the_settlers_locks_held() {
        let _children = crate::TEST_CHILDREN
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let stop = Arc::new(AtomicBool::new(false));
        let s2 = stop.clone();
        let settler = std::thread::spawn(move || {
            while !s2.load(Ordering::Relaxed) {
                let _settling = SETTLING.lock().unwrap_or_else(|p| p.into_inner());
                let _unused = UNUSED.lock().unwrap_or_else(|p| p.into_inner());
                std::hint::spin_loop();
            }
        });
        for round in 0..100 {
            fork_prepare();
            // A fork without the C library's fork handlers (the test binary registered the
            // library's own, which would run these handlers a second time): this module's
            // handlers around it, as `at_fork_*` run them.
            // SAFETY: the child calls only this module's fork handlers (futex locks) and
            // `_exit`.
            let pid =
                unsafe { libc::syscall(libc::SYS_clone, libc::SIGCHLD, 0, 0, 0, 0) } as libc::pid_t;
            if pid == 0 {
                fork_child();
                fork_prepare();
                fork_child();
                // SAFETY: ends the child at once.
                unsafe { libc::_exit(0) };
            }
            fork_parent();
            assert!(pid > 0, "fork failed");
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut status = 0;
            loop {
                // SAFETY: our child; a valid status pointer.
                let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
                if r == pid {
                    break;
                }
                if Instant::now() > deadline {
                    // SAFETY: our child.
                    unsafe {
                        libc::kill(pid, libc::SIGKILL);
                        libc::waitpid(pid, &mut status, 0);
                    }
                    stop.store(true, Ordering::Relaxed);
                    panic!("round {round}: the child hung in its own fork_prepare");
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
        }
        stop.store(true, Ordering::Relaxed);
        settler.join().expect("settler");
    }
}
