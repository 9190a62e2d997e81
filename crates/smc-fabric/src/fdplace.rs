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
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

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
            high
        }
        Err(_) => fd,
    }
}

/// A close-on-exec duplicate of `fd`, made in the upper half of the soft `RLIMIT_NOFILE` at
/// once (never at a low number, even for a moment) once [`keep_high`] was called.
pub fn dup_placed(fd: rustix::fd::BorrowedFd<'_>) -> rustix::io::Result<OwnedFd> {
    let min = if HIGH.load(Ordering::Relaxed) {
        lowest_high().unwrap_or(0)
    } else {
        0
    };
    match rustix::io::fcntl_dupfd_cloexec(fd, min) {
        Ok(high) => {
            if min > 0 {
                note(high.as_raw_fd());
            }
            Ok(high)
        }
        Err(_) => rustix::io::fcntl_dupfd_cloexec(fd, 0),
    }
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
