//! poll, ppoll, select and pselect over a mix of SMC-R connections and other descriptors:
//! the connections' readiness computed in user space, the sleep in the real call over the
//! other descriptors plus the connections' eventfds (see the parent module).

use super::*;
use crate::hooks::target_wait;

/// poll's revents of an SMC-R connection for `events`.
pub(super) fn poll_revents(r: Ready, events: i16) -> i16 {
    let mut m = 0i16;
    if r.readable {
        m |= libc::POLLIN | libc::POLLRDNORM;
    }
    if r.writable {
        m |= libc::POLLOUT | libc::POLLWRNORM;
    }
    if r.read_hup {
        m |= libc::POLLRDHUP;
    }
    if r.urgent {
        m |= libc::POLLPRI;
    }
    m &= events;
    if r.hup {
        m |= libc::POLLHUP;
    }
    if r.error {
        m |= libc::POLLERR;
    }
    m
}

/// ppoll with SMC-R connections among `fds`; `None`: none is, the caller passes the call on.
unsafe fn ppoll_managed(
    fds: *mut pollfd,
    n: nfds_t,
    timeout: Option<Duration>,
    mask: *const sigset_t,
) -> Option<c_int> {
    if fds.is_null() || n == 0 {
        return None;
    }
    // SAFETY: the caller's array of `n` pollfds.
    let fds = unsafe { std::slice::from_raw_parts_mut(fds, n as usize) };
    if ANY_EPOLL.load(std::sync::atomic::Ordering::Relaxed) {
        for p in fds.iter() {
            note_nested(p.fd);
        }
    }
    if !table::ANY.load(std::sync::atomic::Ordering::Relaxed) {
        return None;
    }
    if !fds.iter().any(|p| table::maybe(p.fd)) {
        return None;
    }
    // Client handshakes in progress (`connecting.rs`), looked for before the targets: one
    // that ends after this wakes the wait through its `done` eventfd, and the wait starts
    // over with what it became.
    let pending: Vec<Arc<crate::connecting::Connecting>> = fds
        .iter()
        .filter_map(|p| crate::connecting::of(p.fd).map(|(_, c)| c))
        .collect();
    let mut targets: Vec<Target> = fds.iter().map(|p| target_wait(p.fd)).collect();
    if targets.iter().any(|t| matches!(t, Target::Foreign)) {
        // Another process's connection: its idle TCP socket would never be ready; report
        // the error at once (the read that follows fails with EIO).
        let mut n = 0;
        for (p, t) in fds.iter_mut().zip(&targets) {
            p.revents = match t {
                Target::Foreign => libc::POLLERR | libc::POLLHUP,
                _ => 0,
            };
            if p.revents != 0 {
                n += 1;
            }
        }
        return Some(n);
    }
    // Relayed connections: their relay sockets in the caller's array for the call (put back
    // after), watched by the kernel as the program's other descriptors.
    let mut swapped: Vec<(usize, c_int, Arc<crate::relay::Relay>)> = Vec::new();
    for (i, t) in targets.iter_mut().enumerate() {
        if matches!(t, Target::Relay(_)) {
            if let Target::Relay(r) = std::mem::replace(t, Target::Pass) {
                swapped.push((i, fds[i].fd, r));
            }
        }
    }
    for (i, _, r) in &swapped {
        fds[*i].fd = r.fd();
    }
    let restore = |fds: &mut [pollfd]| {
        for (i, fd, _) in &swapped {
            fds[*i].fd = *fd;
        }
    };
    let conns: Vec<Option<Arc<Conn>>> = targets
        .into_iter()
        .map(|t| match t {
            Target::Smc(c) => Some(c),
            _ => None,
        })
        .collect();
    if conns.iter().all(Option::is_none) && pending.is_empty() {
        if swapped.is_empty() {
            return None;
        }
        // Relayed connections and other descriptors only: the kernel's wait.
        let ts = timeout.map(|t| timespec {
            tv_sec: t.as_secs() as libc::time_t,
            tv_nsec: libc::c_long::from(t.subsec_nanos() as i32),
        });
        let tp = ts
            .as_ref()
            .map_or(std::ptr::null(), |t| t as *const timespec);
        // SAFETY: the caller's array (relay sockets in place) and a valid or null timeout.
        let k = unsafe { real::ppoll(fds.as_mut_ptr(), n, tp, mask) };
        let e = std::io::Error::last_os_error();
        restore(fds);
        if k < 0 {
            set_errno(e.raw_os_error().unwrap_or(libc::EINTR));
        }
        return Some(k);
    }
    let deadline = timeout.map(|t| Instant::now() + t);
    // A connection of this set converted to a relay meanwhile (another process asked for
    // it; `relay.rs`): the wait starts over with the relay socket in its number's place.
    let conversions = crate::relay::conversions();
    let mut again = false;
    let list: Vec<&Conn> = conns.iter().flatten().map(|c| &**c).collect();
    // Made before the first sleep: this thread's own wake-up (see `smc::fdapi::Waiter`).
    let mut waiter: Option<smc::fdapi::Waiter> = None;
    // Without one (no descriptor left for its eventfd): short sleeps that look again.
    let mut no_waiter = false;
    let k = guard(-1, || loop {
        if let Some(w) = &waiter {
            w.clear();
        }
        if crate::relay::conversions() != conversions || pending.iter().any(|p| p.ended()) {
            again = true;
            return 0;
        }
        // What arrived since the last call, handled here rather than by the runtime thread.
        smc::fdapi::poll_before_wait();
        let mut ready = vec![Ready::default(); list.len()];
        Conn::ready_many(&list, &mut ready);
        let mut ready = ready.into_iter();
        // The real poll's array: the other descriptors as given, then the waiter's eventfd
        // (for the connections) and the completion channels.
        let mut real_fds: Vec<pollfd> = Vec::with_capacity(fds.len() + 3);
        let mut smc_ready = 0;
        let mut smc_revents = vec![0i16; fds.len()];
        for (i, (p, c)) in fds.iter().zip(&conns).enumerate() {
            match c {
                None => real_fds.push(pollfd {
                    fd: p.fd,
                    events: p.events,
                    revents: 0,
                }),
                Some(_) => {
                    let r = poll_revents(ready.next().unwrap_or_default(), p.events);
                    smc_revents[i] = r;
                    if r != 0 {
                        smc_ready += 1;
                    }
                }
            }
        }
        let sleeps = smc_ready == 0 && deadline.is_none_or(|d| d > Instant::now());
        if sleeps && waiter.is_none() && !no_waiter {
            // Subscribe, then look again: a change after that look is signalled to it.
            match smc::fdapi::Waiter::new() {
                Ok(mut w) => {
                    for (p, c) in fds.iter().zip(&conns) {
                        if let Some(c) = c {
                            w.watch(c, true, p.events & libc::POLLOUT != 0);
                        }
                    }
                    waiter = Some(w);
                }
                Err(_) => no_waiter = true,
            }
            continue;
        }
        for p in &pending {
            real_fds.push(pollfd {
                fd: p.done_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        if let Some(w) = &waiter {
            real_fds.push(pollfd {
                fd: std::os::fd::AsRawFd::as_raw_fd(&w.fd()),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        // About to sleep: become the stack's poller (see `epoll_wait_managed`).
        let state = if sleeps {
            smc::fdapi::poller_prepare()
        } else {
            smc::fdapi::PollerState::Other
        };
        if state == smc::fdapi::PollerState::Progress {
            continue;
        }
        let channels_at = real_fds.len();
        if state == smc::fdapi::PollerState::Armed {
            for fd in smc::fdapi::completion_fds() {
                real_fds.push(pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                });
            }
        }
        let left = if smc_ready > 0 {
            Some(Duration::ZERO)
        } else {
            deadline.map(|d| d.saturating_duration_since(Instant::now()))
        };
        let left = if no_waiter {
            Some(left.map_or(NO_WAITER_SLICE, |l| l.min(NO_WAITER_SLICE)))
        } else {
            left
        };
        let ts;
        let t: *const timespec = match left {
            None => std::ptr::null(),
            Some(left) => {
                ts = timespec {
                    tv_sec: left.as_secs() as libc::time_t,
                    tv_nsec: libc::c_long::from(left.subsec_nanos() as i32),
                };
                &ts
            }
        };
        // SAFETY: our array and a valid or null timeout.
        let k = unsafe { real::ppoll(real_fds.as_mut_ptr(), real_fds.len() as nfds_t, t, mask) };
        if state == smc::fdapi::PollerState::Armed {
            let e = std::io::Error::last_os_error();
            let fired: Vec<bool> = real_fds[channels_at..]
                .iter()
                .map(|p| k > 0 && p.revents != 0)
                .collect();
            smc::fdapi::poller_finish(&fired);
            if let Some(n) = e.raw_os_error() {
                set_errno(n);
            }
        }
        if k < 0 && smc_ready == 0 {
            return -1;
        }
        // Copy back.
        let mut total = 0;
        let mut j = 0;
        for (i, (p, c)) in fds.iter_mut().zip(&conns).enumerate() {
            match c {
                None => {
                    p.revents = if k < 0 { 0 } else { real_fds[j].revents };
                    j += 1;
                }
                Some(_) => p.revents = smc_revents[i],
            }
            if p.revents != 0 {
                total += 1;
            }
        }
        if total > 0 {
            return total;
        }
        if k == 0 && !no_waiter {
            return 0;
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return 0;
        }
        // Only our eventfd or a channel: look again.
    });
    let e = std::io::Error::last_os_error();
    restore(fds);
    if again {
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        // SAFETY: the caller's array, as given.
        return unsafe { ppoll_managed(fds.as_mut_ptr(), n, left, mask) };
    }
    if k < 0 {
        set_errno(e.raw_os_error().unwrap_or(libc::EINTR));
    }
    Some(k)
}

/// How long a poll sleeps between looks when it could not make its waiter's eventfd.
const NO_WAITER_SLICE: Duration = Duration::from_millis(10);

#[no_mangle]
pub unsafe extern "C" fn ppoll(
    fds: *mut pollfd,
    n: nfds_t,
    t: *const timespec,
    mask: *const sigset_t,
) -> c_int {
    let timeout = if t.is_null() {
        None
    } else {
        // SAFETY: the caller's timeout.
        let t = unsafe { t.read_unaligned() };
        Some(Duration::new(
            t.tv_sec.max(0) as u64,
            t.tv_nsec.clamp(0, 999_999_999) as u32,
        ))
    };
    // SAFETY: the caller's arguments.
    match unsafe { ppoll_managed(fds, n, timeout, mask) } {
        Some(r) => r,
        // SAFETY: passed on unchanged.
        None => unsafe { real::ppoll(fds, n, t, mask) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn poll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int {
    let t = (timeout >= 0).then(|| Duration::from_millis(timeout as u64));
    // SAFETY: the caller's arguments.
    match unsafe { ppoll_managed(fds, n, t, std::ptr::null()) } {
        Some(r) => r,
        // SAFETY: passed on unchanged.
        None => unsafe { real::poll(fds, n, timeout) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn __poll_chk(
    fds: *mut pollfd,
    n: nfds_t,
    timeout: c_int,
    _len: usize,
) -> c_int {
    // SAFETY: as poll.
    unsafe { poll(fds, n, timeout) }
}

/// select/pselect as poll: readfds → POLLIN, writefds → POLLOUT, exceptfds → POLLPRI;
/// `None` when no SMC-R connection is among the sets.
unsafe fn select_managed(
    nfds: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    e: *mut fd_set,
    timeout: Option<Duration>,
    mask: *const sigset_t,
) -> Option<c_int> {
    if nfds <= 0 {
        return None;
    }
    let nfds = nfds.min(libc::FD_SETSIZE as c_int);
    let isset = |s: *mut fd_set, fd: c_int| -> bool {
        // SAFETY: the caller's set, fd below FD_SETSIZE.
        !s.is_null() && unsafe { libc::FD_ISSET(fd, s) }
    };
    if ANY_EPOLL.load(std::sync::atomic::Ordering::Relaxed) {
        for fd in (0..nfds).filter(|&fd| isset(r, fd) || isset(w, fd) || isset(e, fd)) {
            note_nested(fd);
        }
    }
    if !table::ANY.load(std::sync::atomic::Ordering::Relaxed) {
        return None;
    }
    let mut fds: Vec<pollfd> = Vec::new();
    let mut any_smc = false;
    for fd in 0..nfds {
        let mut ev = 0i16;
        if isset(r, fd) {
            ev |= libc::POLLIN;
        }
        if isset(w, fd) {
            ev |= libc::POLLOUT;
        }
        if isset(e, fd) {
            ev |= libc::POLLPRI;
        }
        if ev != 0 {
            any_smc |= table::maybe(fd);
            fds.push(pollfd {
                fd,
                events: ev,
                revents: 0,
            });
        }
    }
    if !any_smc {
        return None;
    }
    // SAFETY: our array.
    let k = unsafe { ppoll_managed(fds.as_mut_ptr(), fds.len() as nfds_t, timeout, mask) }?;
    if k < 0 {
        return Some(-1);
    }
    // SAFETY: the caller's sets (cleared, then the ready bits set).
    unsafe {
        for s in [r, w, e] {
            if !s.is_null() {
                for fd in 0..nfds {
                    libc::FD_CLR(fd, s);
                }
            }
        }
        let mut count = 0;
        for p in &fds {
            let rv = p.revents;
            if p.events & libc::POLLIN != 0
                && rv & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0
            {
                libc::FD_SET(p.fd, r);
                count += 1;
            }
            if p.events & libc::POLLOUT != 0 && rv & (libc::POLLOUT | libc::POLLERR) != 0 {
                libc::FD_SET(p.fd, w);
                count += 1;
            }
            if p.events & libc::POLLPRI != 0 && rv & libc::POLLPRI != 0 {
                libc::FD_SET(p.fd, e);
                count += 1;
            }
        }
        Some(count)
    }
}

#[no_mangle]
pub unsafe extern "C" fn select(
    nfds: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    e: *mut fd_set,
    t: *mut timeval,
) -> c_int {
    let timeout = if t.is_null() {
        None
    } else {
        // SAFETY: the caller's timeout.
        let t = unsafe { t.read_unaligned() };
        Some(Duration::from_micros(
            (t.tv_sec.max(0) as u64) * 1_000_000 + t.tv_usec.max(0) as u64,
        ))
    };
    // SAFETY: the caller's arguments.
    match unsafe { select_managed(nfds, r, w, e, timeout, std::ptr::null()) } {
        Some(k) => k,
        // SAFETY: passed on unchanged.
        None => unsafe { real::select(nfds, r, w, e, t) },
    }
}

#[no_mangle]
pub unsafe extern "C" fn pselect(
    nfds: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    e: *mut fd_set,
    t: *const timespec,
    mask: *const sigset_t,
) -> c_int {
    let timeout = if t.is_null() {
        None
    } else {
        // SAFETY: the caller's timeout.
        let t = unsafe { t.read_unaligned() };
        Some(Duration::new(
            t.tv_sec.max(0) as u64,
            t.tv_nsec.clamp(0, 999_999_999) as u32,
        ))
    };
    // SAFETY: the caller's arguments.
    if let Some(k) = unsafe { select_managed(nfds, r, w, e, timeout, mask) } {
        return k;
    }
    // SAFETY: passed on unchanged.
    unsafe { real::pselect(nfds, r, w, e, t, mask) }
}
