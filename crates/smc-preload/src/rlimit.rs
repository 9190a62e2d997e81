//! `RLIMIT_AS` as the program means it: a limit on the program's own address space.
//!
//! A stack's threads leave their stacks and the C library's malloc arenas (64 MiB of
//! reservation per thread) in the process, and a forked or cloned child inherits them. A
//! program that caps its address space after it made a socket (vsftpd's session process:
//! 200 MiB, set after the listener's stack made five threads) then failed its own next
//! `mmap` ("500 OOPS: mmap", also towards a plain TCP client), which it would not have done
//! without the library. So a limit set while a stack's leftovers are in the address space is
//! raised by what the process gained since the first stack was made
//! ([`smc::fdapi::address_space_since_stack`]), and reading the limit back shows the value
//! the program set. A stack the limited process would make later may not fit: its threads
//! fail to start, and its connections are TCP (the rendezvous declines the client).
//!
//! Only `setrlimit`/`prlimit` on the calling process are adjusted; every other resource, and
//! a limit set before any stack was made, passes through unchanged.

use std::sync::Mutex;

use libc::{c_int, pid_t, rlim_t, rlimit, RLIMIT_AS, RLIM_INFINITY};

use crate::{guard, log, real};

/// The last `RLIMIT_AS` the program set through the library and what was set in its place.
struct Adjusted {
    asked: (rlim_t, rlim_t),
    given: (rlim_t, rlim_t),
}

static ADJUSTED: Mutex<Option<Adjusted>> = Mutex::new(None);

/// `limit` raised by `extra`; "unlimited" stays so.
fn raised(limit: rlim_t, extra: u64) -> rlim_t {
    if limit == RLIM_INFINITY {
        limit
    } else {
        limit.saturating_add(extra).min(RLIM_INFINITY - 1)
    }
}

/// The limit to set in place of `asked` (cur, max), given the address space the library's
/// stack added (`extra`) and the hard limit in force (`hard`, which an unprivileged process
/// cannot raise: the raised values stay under it).
fn adjusted(asked: (rlim_t, rlim_t), extra: u64, hard: rlim_t) -> (rlim_t, rlim_t) {
    let max = raised(asked.1, extra).min(hard).max(asked.1);
    let cur = raised(asked.0, extra).min(max).max(asked.0);
    (cur, max)
}

/// Whether `pid` names the calling process.
fn is_self(pid: pid_t) -> bool {
    // SAFETY: getpid has no preconditions.
    pid == 0 || pid == unsafe { libc::getpid() }
}

/// Set `RLIMIT_AS` of the calling process to `asked`, adjusted; None: not adjusted (the
/// caller passes the call on unchanged).
fn set_adjusted(asked: (rlim_t, rlim_t)) -> Option<c_int> {
    let extra = smc::fdapi::address_space_since_stack()?;
    if extra == 0 || (asked.0 == RLIM_INFINITY && asked.1 == RLIM_INFINITY) {
        return None;
    }
    let mut now = rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid out pointer.
    if unsafe { real::prlimit(0, RLIMIT_AS as c_int, std::ptr::null(), &mut now) } != 0 {
        return None;
    }
    // Raising the hard limit needs privilege: stay under the one in force.
    let hard = if now.rlim_max == RLIM_INFINITY || asked.1 <= now.rlim_max {
        now.rlim_max
    } else {
        asked.1
    };
    let given = adjusted(asked, extra, hard);
    let new = rlimit {
        rlim_cur: given.0,
        rlim_max: given.1,
    };
    // SAFETY: a valid limit.
    let r = unsafe { real::prlimit(0, RLIMIT_AS as c_int, &new, std::ptr::null_mut()) };
    if r != 0 {
        return Some(r);
    }
    log!(
        "RLIMIT_AS {} set as {} (the library's stack added {} MiB to this address space)",
        asked.0,
        given.0,
        extra >> 20
    );
    *ADJUSTED.lock().unwrap_or_else(|p| p.into_inner()) = Some(Adjusted { asked, given });
    Some(0)
}

/// Show the program the limit it set where the library set another in its place.
fn as_asked(l: &mut rlimit) {
    let g = ADJUSTED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(a) = g.as_ref() {
        if (l.rlim_cur, l.rlim_max) == a.given {
            (l.rlim_cur, l.rlim_max) = a.asked;
        }
    }
}

/// The program's `prlimit`, which `setrlimit` and `getrlimit` also come to.
unsafe fn prlimit_as(pid: pid_t, res: c_int, new: *const rlimit, old: *mut rlimit) -> c_int {
    if res != RLIMIT_AS as c_int || !is_self(pid) || !real::resolved() {
        // SAFETY: passed on unchanged.
        return unsafe { real::prlimit(pid, res, new, old) };
    }
    if !old.is_null() {
        // SAFETY: the program's out pointer.
        if unsafe { real::prlimit(pid, res, std::ptr::null(), old) } != 0 {
            return -1;
        }
        // SAFETY: just written.
        guard((), || as_asked(unsafe { &mut *old }));
    }
    if new.is_null() {
        return 0;
    }
    // SAFETY: the program's limit (read once; a bad pointer faults as in the C library).
    let asked = unsafe { ((*new).rlim_cur, (*new).rlim_max) };
    if let Some(r) = guard(None, || set_adjusted(asked)) {
        return r;
    }
    // SAFETY: passed on unchanged.
    let r = unsafe { real::prlimit(pid, res, new, std::ptr::null_mut()) };
    if r == 0 {
        *ADJUSTED.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn prlimit(
    pid: pid_t,
    res: c_int,
    new: *const rlimit,
    old: *mut rlimit,
) -> c_int {
    // SAFETY: the program's arguments.
    unsafe { prlimit_as(pid, res, new, old) }
}

#[no_mangle]
pub unsafe extern "C" fn prlimit64(
    pid: pid_t,
    res: c_int,
    new: *const rlimit,
    old: *mut rlimit,
) -> c_int {
    // SAFETY: the program's arguments (rlimit64 is rlimit on 64-bit Linux).
    unsafe { prlimit_as(pid, res, new, old) }
}

#[no_mangle]
pub unsafe extern "C" fn setrlimit(res: c_int, l: *const rlimit) -> c_int {
    // SAFETY: the program's arguments.
    unsafe { prlimit_as(0, res, l, std::ptr::null_mut()) }
}

#[no_mangle]
pub unsafe extern "C" fn setrlimit64(res: c_int, l: *const rlimit) -> c_int {
    // SAFETY: the program's arguments.
    unsafe { prlimit_as(0, res, l, std::ptr::null_mut()) }
}

#[no_mangle]
pub unsafe extern "C" fn getrlimit(res: c_int, l: *mut rlimit) -> c_int {
    // SAFETY: the program's arguments.
    unsafe { prlimit_as(0, res, std::ptr::null(), l) }
}

#[no_mangle]
pub unsafe extern "C" fn getrlimit64(res: c_int, l: *mut rlimit) -> c_int {
    // SAFETY: the program's arguments.
    unsafe { prlimit_as(0, res, std::ptr::null(), l) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_limit_is_raised_by_the_stacks_share_and_stays_under_the_hard_limit() {
        let mib = 1 << 20;
        // vsftpd: 200 MiB both, 330 MiB added by the stack, no hard limit in force.
        assert_eq!(
            adjusted((200 * mib, 200 * mib), 330 * mib, RLIM_INFINITY),
            (530 * mib, 530 * mib)
        );
        // Unlimited stays unlimited; a finite soft limit under it is raised.
        assert_eq!(
            adjusted((100 * mib, RLIM_INFINITY), 50 * mib, RLIM_INFINITY),
            (150 * mib, RLIM_INFINITY)
        );
        // A hard limit in force caps the raise (never below what was asked).
        assert_eq!(
            adjusted((200 * mib, 200 * mib), 330 * mib, 300 * mib),
            (300 * mib, 300 * mib)
        );
        assert_eq!(
            adjusted((200 * mib, 250 * mib), 330 * mib, 250 * mib),
            (250 * mib, 250 * mib)
        );
        // No overflow into "unlimited".
        assert_eq!(raised(RLIM_INFINITY - 2, 10), RLIM_INFINITY - 1);
    }
}
