//! Where the stack's long-lived descriptors go in a process that does not know of them.
//!
//! The kernel gives every new descriptor the lowest free number. A program under `smc run`
//! (the preload library) shares its descriptor table with the stack, and sizes its own tables
//! by the numbers TCP would have given it: wrk refuses a socket numbered beyond
//! `10 + 3 × connections`, select() one beyond 1023. Once [`keep_high`] was called, the
//! descriptors the stack keeps (per connection: a duplicate of the socket and two eventfds;
//! per link: memfds, eventfds, epoll instances) move to the upper half of the soft
//! `RLIMIT_NOFILE`; when that half is full, or the limit is small, they stay where they are.
//!
//! Every number placed there is noted ([`is_placed`], [`unplaced_runs`]): a program that
//! closes every descriptor it did not make (`closefrom(3)`, `close_range(3, ~0U, 0)`) must
//! not close the stack's, whose threads then spun on the closed numbers
//! (varnishd's manager process: three threads of the library at 13–20 % CPU each for good,
//! and its next `listen` could not mark the port: EBADF on the discovery's map). A number
//! stays noted after the stack closed it (nothing tells this module): the program gets a
//! number of the upper half only when the lower half is full or it asks for one, and the
//! stack's next descriptor usually takes the freed number again.

use rustix::fd::{AsRawFd as _, OwnedFd};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

static HIGH: AtomicBool = AtomicBool::new(false);

/// Numbers below this are noted when placed (the soft limit is taken as at most this).
const NOTED: usize = 1 << 20;
/// One bit per number below [`NOTED`]: placed in the upper half by this module.
static PLACED: [AtomicU64; NOTED / 64] = [const { AtomicU64::new(0) }; NOTED / 64];
/// One more than the highest number noted (0: none).
static PLACED_END: AtomicU64 = AtomicU64::new(0);

fn note(fd: i32) {
    let Ok(n) = usize::try_from(fd) else {
        return;
    };
    if n >= NOTED {
        return;
    }
    PLACED[n / 64].fetch_or(1 << (n % 64), Ordering::AcqRel);
    PLACED_END.fetch_max(n as u64 + 1, Ordering::AcqRel);
}

/// Whether `fd` is a number this module placed in the upper half (for the stack).
pub fn is_placed(fd: i32) -> bool {
    usize::try_from(fd)
        .ok()
        .filter(|&n| n < NOTED)
        .is_some_and(|n| PLACED[n / 64].load(Ordering::Acquire) & (1 << (n % 64)) != 0)
}

/// The runs of `first..=last` that hold no placed number, in order, as `(first, last)`: what
/// a program's `close_range`/`closefrom` over that range may close.
pub fn unplaced_runs(first: u32, last: u32) -> Vec<(u32, u32)> {
    let mut runs = Vec::new();
    if first > last {
        return runs;
    }
    let end = PLACED_END.load(Ordering::Acquire).min(u64::from(last) + 1);
    let mut start = first;
    let mut n = u64::from(first);
    while n < end {
        let i = n as usize;
        let word = PLACED[i / 64].load(Ordering::Acquire) >> (i % 64);
        if word == 0 {
            // No placed number in the rest of this word.
            n = (n | 63) + 1;
            continue;
        }
        let at = n + u64::from(word.trailing_zeros());
        if at >= end {
            break;
        }
        if at > u64::from(start) {
            runs.push((start, (at - 1) as u32));
        }
        n = at + 1;
        start = n as u32;
        if n > u64::from(last) {
            return runs;
        }
    }
    runs.push((start, last));
    runs
}

// ---- the moment between a descriptor's making and its placing ----
//
// A thread of the stack that makes a descriptor gets the lowest free number, which the
// program may close (or `dup2` onto) at that very moment: a number it closed already, as bash
// closes some of its pipes twice. That second close then closes the stack's descriptor, and
// the stack later closes a number it no longer owns (in a debug build Rust aborts the process:
// "IO Safety violation"). So a make and its placing ([`make`], [`making`]) and the program's
// closes ([`program_closes`], the preload library's `close`, `dup2`, `dup3`, `close_range`)
// exclude each other: two counters, each side announcing itself and then waiting for the
// other side's count to be zero (sequentially consistent, so that of two sides arriving at
// once at least one sees the other). Makes win: a close arriving during one waits for it.
// Makes are system calls that do not block (a blocking accept or receive waits for
// readiness first, outside); a close usually does not either, but may (a lingering TCP
// socket), so a long wait sleeps. Overlapping makes on many threads can hold a close off
// for as long as they overlap.

/// Makes in flight.
static MAKING: AtomicUsize = AtomicUsize::new(0);
/// The program's closes in flight.
static CLOSING: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread is inside a make or a close (a signal handler that closes in the middle
    /// of one must not wait for itself).
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

/// Clears [`INSIDE`] and takes this side's count back, on return and on unwind alike.
struct Side(&'static AtomicUsize);

impl Drop for Side {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
        INSIDE.with(|c| c.set(false));
    }
}

/// Wait until `n` is zero: spinning a little, then yielding, then sleeping 50 µs at a time
/// (a close may block: a TCP socket lingering, a file on NFS flushing; and `sched_yield`
/// gives nothing to a thread of lower priority under a real-time policy).
fn wait_for_zero(n: &AtomicUsize) {
    let mut spins = 0u32;
    while n.load(Ordering::SeqCst) != 0 {
        if spins < 64 {
            std::hint::spin_loop();
        } else if spins < 128 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
        spins = spins.saturating_add(1);
    }
}

/// Run `f`, a make of descriptors that does not block (with their placing, [`placed`]),
/// while no close of the program runs.
pub fn making<T>(f: impl FnOnce() -> T) -> T {
    if INSIDE.with(|c| c.replace(true)) {
        return f();
    }
    MAKING.fetch_add(1, Ordering::SeqCst);
    let _side = Side(&MAKING);
    wait_for_zero(&CLOSING);
    f()
}

/// A descriptor made by `make` (a call that does not block) and placed ([`placed`]), with
/// the program's closes held off meanwhile ([`making`]).
pub fn make<E>(make: impl FnOnce() -> Result<OwnedFd, E>) -> Result<OwnedFd, E> {
    making(|| make().map(placed))
}

/// Run `f`, the program's close of numbers (a system call that does not block), while no
/// make of the stack is between its making and its placing.
pub fn program_closes<T>(f: impl FnOnce() -> T) -> T {
    if INSIDE.with(|c| c.replace(true)) {
        return f();
    }
    loop {
        CLOSING.fetch_add(1, Ordering::SeqCst);
        if MAKING.load(Ordering::SeqCst) == 0 {
            break;
        }
        CLOSING.fetch_sub(1, Ordering::SeqCst);
        wait_for_zero(&MAKING);
    }
    let _side = Side(&CLOSING);
    f()
}

/// In a forked child: the makes and closes of the parent's other threads are not here.
pub fn fork_child() {
    MAKING.store(0, Ordering::SeqCst);
    CLOSING.store(0, Ordering::SeqCst);
    INSIDE.with(|c| c.set(false));
}

/// Keep the descriptors made from now on out of the low numbers (process-wide, for good).
pub fn keep_high() {
    HIGH.store(true, Ordering::Relaxed);
}

/// Whether [`keep_high`] was called.
pub fn keeps_high() -> bool {
    HIGH.load(Ordering::Relaxed)
}

/// `fd`, or a close-on-exec duplicate of it in the upper half of the soft `RLIMIT_NOFILE`
/// (`fd` itself is closed then) once [`keep_high`] was called.
pub fn placed(fd: OwnedFd) -> OwnedFd {
    if !HIGH.load(Ordering::Relaxed) {
        return fd;
    }
    let Some(min) = lowest_high() else {
        return fd;
    };
    if fd.as_raw_fd() >= min {
        note(fd.as_raw_fd());
        return fd;
    }
    match rustix::io::fcntl_dupfd_cloexec(&fd, min) {
        Ok(high) => {
            note(high.as_raw_fd());
            // The low number closed by the system call itself: `OwnedFd`'s drop calls the C
            // library's `close`, which under the preload library is the program's hooked
            // close (with its table look-ups and locks, inside a make).
            // SAFETY: `fd` is ours and consumed here.
            unsafe { rustix::io::close(std::os::fd::IntoRawFd::into_raw_fd(fd)) };
            high
        }
        Err(_) => fd,
    }
}

/// A close-on-exec duplicate of `fd`, made in the upper half of the soft `RLIMIT_NOFILE` at
/// once once [`keep_high`] was called (at a low number only when the upper half is full), as
/// a make ([`making`]: a program's `close_range` in flight must not take it).
pub fn dup_placed(fd: rustix::fd::BorrowedFd<'_>) -> rustix::io::Result<OwnedFd> {
    let min = if HIGH.load(Ordering::Relaxed) {
        lowest_high().unwrap_or(0)
    } else {
        0
    };
    making(|| match rustix::io::fcntl_dupfd_cloexec(fd, min) {
        Ok(high) => {
            if min > 0 {
                note(high.as_raw_fd());
            }
            Ok(high)
        }
        Err(_) => rustix::io::fcntl_dupfd_cloexec(fd, 0),
    })
}

/// The first number of the upper half of the soft limit; `None` below 256 descriptors.
fn lowest_high() -> Option<i32> {
    let soft = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX)
        .min(1 << 20);
    if soft < 256 {
        return None;
    }
    i32::try_from(soft / 2).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placed_moves_up_only_when_asked() {
        let low = || rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap();
        let before = placed(low());
        let min = lowest_high();
        keep_high();
        let after = placed(low());
        match min {
            Some(min) => {
                assert!(after.as_raw_fd() >= min, "{} < {min}", after.as_raw_fd());
                assert!(before.as_raw_fd() < min);
                // Still close-on-exec.
                let fl = rustix::io::fcntl_getfd(&after).unwrap();
                assert!(fl.contains(rustix::io::FdFlags::CLOEXEC));
            }
            None => assert!(after.as_raw_fd() < 256),
        }
    }

    #[test]
    fn a_close_waits_for_a_make_in_flight() {
        use std::sync::atomic::AtomicBool;
        use std::sync::Arc;
        let placed = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel();
        let maker = {
            let placed = placed.clone();
            std::thread::spawn(move || {
                making(|| {
                    tx.send(()).unwrap();
                    std::thread::sleep(std::time::Duration::from_millis(50));
                    placed.store(true, Ordering::SeqCst);
                })
            })
        };
        rx.recv().unwrap();
        // The make is between its making and its placing: the close runs after it.
        assert!(program_closes(|| placed.load(Ordering::SeqCst)));
        maker.join().unwrap();
        // Inside a make, a close (a signal handler's) does not wait for itself, and the
        // other way round.
        assert_eq!(making(|| program_closes(|| 7)), 7);
        assert_eq!(program_closes(|| making(|| 8)), 8);
        let fd = make(|| rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC));
        assert!(fd.is_ok());
    }

    #[test]
    fn runs_skip_placed_numbers() {
        // Numbers far above any this test process places.
        let base = 900_000u32;
        for n in [base + 3, base + 4, base + 70, base + 200] {
            note(n as i32);
        }
        assert!(is_placed(base as i32 + 3) && !is_placed(base as i32 + 5));
        assert_eq!(
            unplaced_runs(base, base + 300),
            [
                (base, base + 2),
                (base + 5, base + 69),
                (base + 71, base + 199),
                (base + 201, base + 300)
            ]
        );
        assert_eq!(unplaced_runs(base + 3, base + 4), []);
        assert_eq!(unplaced_runs(base + 4, base + 9), [(base + 5, base + 9)]);
        assert_eq!(
            unplaced_runs(base + 199, u32::MAX),
            [(base + 199, base + 199), (base + 201, u32::MAX)]
        );
        assert_eq!(unplaced_runs(10, 5), []);
        // Out of the noted range: nothing noted, every number closable.
        note(-1);
        note(NOTED as i32);
        assert!(!is_placed(-1) && !is_placed(NOTED as i32));
    }
}
