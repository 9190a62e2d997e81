//! Where the stack's long-lived descriptors go in a process that does not know of them.
//!
//! The kernel gives every new descriptor the lowest free number. A program under `smc run`
//! (the preload library) shares its descriptor table with the stack, and sizes its own tables
//! by the numbers TCP would have given it: wrk refuses a socket numbered beyond
//! `10 + 3 × connections`, select() one beyond 1023. Once [`keep_high`] was called, the
//! descriptors the stack keeps (per connection: a duplicate of the socket and two eventfds;
//! per link: memfds, eventfds, epoll instances) move to the upper half of the soft
//! `RLIMIT_NOFILE`; when that half is full, or the limit is small, they stay where they are.

use rustix::fd::{AsRawFd as _, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

static HIGH: AtomicBool = AtomicBool::new(false);

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
        return fd;
    }
    rustix::io::fcntl_dupfd_cloexec(&fd, min).unwrap_or(fd)
}

/// A close-on-exec duplicate of `fd`, made in the upper half of the soft `RLIMIT_NOFILE` at
/// once (never at a low number, even for a moment) once [`keep_high`] was called.
pub fn dup_placed(fd: rustix::fd::BorrowedFd<'_>) -> rustix::io::Result<OwnedFd> {
    let min = if HIGH.load(Ordering::Relaxed) {
        lowest_high().unwrap_or(0)
    } else {
        0
    };
    rustix::io::fcntl_dupfd_cloexec(fd, min).or_else(|_| rustix::io::fcntl_dupfd_cloexec(fd, 0))
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
}
