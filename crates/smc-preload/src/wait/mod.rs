//! The wait calls: epoll, poll, select (and their variants) over a mix of SMC-R
//! connections and other descriptors.
//!
//! An SMC-R connection's TCP socket never becomes readable (its bytes arrive in memory), so
//! its readiness is computed in user space (the `tcp_poll()` mask, [`Conn::ready`]) and the
//! sleep happens in the real system call over the program's other descriptors plus the
//! connection's two eventfds, which the stack signals when reading or writing may progress:
//! signals, sigmasks and timeouts behave as the kernel makes them.
//!
//! epoll: the program's epoll instance stays a kernel one; other descriptors go to it
//! directly. A connection's interest (events, data word, edge-triggered and one-shot state) is
//! kept in an [`EpollSet`], and its eventfds are registered in the kernel instance
//! edge-triggered under a data word of ours, so that each signal wakes every instance that
//! watches the connection and marks its interest as having news (what an edge-triggered
//! interest reports).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libc::{c_int, epoll_event, fd_set, nfds_t, pollfd, sigset_t, timespec, timeval};
use smc::fdapi::{Conn, Ready};

use crate::hooks::{target, Target};
use crate::table::{self, Entry, Kind};
use crate::{guard, real, set_errno};

mod poll;

/// The upper half of the data word of our eventfds in a kernel epoll instance (the lower
/// half: the connection's descriptor number and which eventfd). The top bit set: never a
/// user-space pointer, which is what programs usually store.
const MARK: u64 = 0xE2D4_C3D9 << 32;

/// One connection's interest in an epoll instance.
#[derive(Debug)]
struct Interest {
    conn: Arc<Conn>,
    events: u32,
    data: u64,
    /// Edge-triggered: added or modified since the last report (the current state is
    /// reported once).
    news: bool,
    /// Edge-triggered: the connection's signal counts (read, write) at the last report;
    /// a signal since is a new event.
    seen: (u64, u64),
    /// One-shot: reported; silent until EPOLL_CTL_MOD.
    disabled: bool,
}

/// The SMC-R connections an epoll instance watches.
#[derive(Debug, Default)]
pub(crate) struct EpollSet {
    interests: Mutex<BTreeMap<c_int, Interest>>,
    /// How many of the stack's completion channels are registered in the kernel instance.
    channels: std::sync::atomic::AtomicUsize,
    /// The spin before a sleep of this instance's waits (made at the first wait: the stack
    /// may not exist when the instance is created).
    spin: std::sync::OnceLock<smc::fdapi::LoopSpin>,
    /// Threads asleep (or about to be) in a wait on this instance, each with the watched
    /// connections armed ([`EpollSet::arm_for_sleep`]); changed under the interests' lock.
    sleeping: std::sync::atomic::AtomicU32,
    /// The instance is itself waited on by another wait (registered in another epoll
    /// instance, given to poll or select), which sleeps in the kernel without our arming:
    /// its connections are armed for good (changed under the interests' lock).
    nested: std::sync::atomic::AtomicBool,
    /// Connections the program removed (EPOLL_CTL_DEL) whose eventfds stay registered in
    /// the kernel instance, by number (taken under the interests' lock): an event loop that
    /// adds and removes a connection's interest for every request (redis-benchmark: DEL and
    /// ADD twice per request) then makes no system call for it, where each registration of
    /// the two eventfds cost two (an `epoll_ctl` that allocates and links the kernel's item)
    /// and each removal two more. A parked registration only wakes a wait of this instance
    /// when the connection's eventfds are written, which happens while some wait armed it
    /// (this instance arms only the connections it watches), and such a wake-up reports
    /// nothing (see `filter_marks`). Weak: a parked registration does not keep the
    /// connection open (its eventfds close with it, which ends their kernel registration).
    parked: Mutex<BTreeMap<c_int, std::sync::Weak<Conn>>>,
}

/// The connections of an epoll instance armed for one sleep (see `Conn::arm`); disarmed
/// when dropped.
struct ArmedSet<'a> {
    set: &'a EpollSet,
    conns: Vec<Arc<Conn>>,
}

impl Drop for ArmedSet<'_> {
    fn drop(&mut self) {
        for c in &self.conns {
            c.disarm();
        }
        self.set
            .sleeping
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The data word of completion channel `i` in a kernel instance (bit 31 of the lower half
/// tells it from a connection's eventfds, whose lower half is `fd << 1 | which`).
const CHANNEL: u64 = MARK | 0x8000_0000;

impl EpollSet {
    /// Register the stack's completion channels in kernel instance `epfd` (once), so that the
    /// waiting thread, as the stack's poller, wakes on a doorbell itself.
    fn register_channels(&self, epfd: c_int) -> usize {
        let have = self.channels.load(std::sync::atomic::Ordering::Relaxed);
        if have > 0 {
            return have;
        }
        let fds = smc::fdapi::completion_fds();
        for (i, fd) in fds.iter().enumerate() {
            let mut ev = epoll_event {
                events: (libc::EPOLLIN | libc::EPOLLET) as u32,
                u64: CHANNEL | i as u64,
            };
            // SAFETY: the stack's eventfd and a valid event.
            unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, *fd, &mut ev) };
        }
        self.channels
            .store(fds.len(), std::sync::atomic::Ordering::Relaxed);
        fds.len()
    }
}

impl EpollSet {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<c_int, Interest>> {
        self.interests.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The program closed connection number `fd`: as the kernel drops a closed file from its
    /// epoll instances.
    pub(crate) fn remove_closed(&self, fd: c_int) {
        let mut m = self.lock();
        m.remove(&fd);
        self.parked_lock().remove(&fd);
    }

    /// The parked registrations (see `parked`); taken with the interests' lock held.
    fn parked_lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<c_int, std::sync::Weak<Conn>>> {
        self.parked.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Register connection `c`'s eventfds under number `fd` in kernel instance `epfd` for a
    /// new interest (the interests' lock held), unless a registration of the same connection
    /// under that number was parked by an earlier EPOLL_CTL_DEL: then it serves again,
    /// without a system call. A parked registration of another connection under the number
    /// (still open through another number) is removed first.
    fn register(&self, m: &BTreeMap<c_int, Interest>, epfd: c_int, fd: c_int, c: &Arc<Conn>) {
        let old = self.parked_lock().remove(&fd);
        if let Some(old) = old.and_then(|w| w.upgrade()) {
            if Arc::ptr_eq(&old, c) {
                return;
            }
            unregister_parked(m, epfd, fd, &old);
        }
        kernel_notifiers(epfd, fd, c, true);
    }

    /// The program removed its interest in connection `c` under number `fd` (the interests'
    /// lock held): its kernel registration is parked for a later EPOLL_CTL_ADD (see
    /// `parked`).
    fn park(&self, fd: c_int, c: &Arc<Conn>) {
        self.parked_lock().insert(fd, Arc::downgrade(c));
    }

    /// Take the parked registration under `fd`, if any, out of kernel instance `epfd` (the
    /// interests' lock held: `m`).
    fn unpark(&self, m: &BTreeMap<c_int, Interest>, epfd: c_int, fd: c_int) {
        let old = self.parked_lock().remove(&fd);
        if let Some(old) = old.and_then(|w| w.upgrade()) {
            unregister_parked(m, epfd, fd, &old);
        }
    }

    /// Before a wait on this instance sleeps: arm every watched connection, so that the stack
    /// writes their eventfds (which the kernel instance watches) while it sleeps. The caller
    /// looks at their readiness after this, then sleeps; the returned guard disarms.
    fn arm_for_sleep(&self) -> ArmedSet<'_> {
        let m = self.lock();
        // (Under the lock: a connection added after this is kicked by `insert`.)
        self.sleeping
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let conns: Vec<Arc<Conn>> = m.values().map(|i| i.conn.clone()).collect();
        drop(m);
        for c in &conns {
            c.arm();
        }
        ArmedSet { set: self, conns }
    }

    /// Put `interest` under `fd` (the interests' lock held: `m`): a new connection of a
    /// nested instance is armed for good, and a thread asleep in a wait on this instance is
    /// woken to look again (it armed the connections it knew of, and the kernel would report
    /// an added or modified registration's readiness to it).
    fn insert(&self, m: &mut BTreeMap<c_int, Interest>, fd: c_int, interest: Interest) {
        let new = !m.contains_key(&fd);
        if new && self.nested.load(std::sync::atomic::Ordering::Relaxed) {
            interest.conn.arm();
        }
        if self.sleeping.load(std::sync::atomic::Ordering::Relaxed) > 0
            || PASS_SLEEPERS.load(std::sync::atomic::Ordering::SeqCst) > 0
        {
            interest.conn.kick();
        }
        m.insert(fd, interest);
    }

    /// This instance is waited on by a wait of the kernel's (see `nested`): arm its
    /// connections for good, once.
    fn nest(&self) {
        let m = self.lock();
        if self.nested.swap(true, std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        for i in m.values() {
            i.conn.arm();
        }
    }
}

/// Remove the parked kernel registration of connection `c`'s eventfds (under number `fd`)
/// from kernel instance `epfd`, unless an interest in `m` watches the same connection under
/// another number: the kernel registers each eventfd once per instance, so that other
/// number's ADD found it there (EEXIST) and wakes through it.
fn unregister_parked(m: &BTreeMap<c_int, Interest>, epfd: c_int, fd: c_int, c: &Arc<Conn>) {
    if !m.values().any(|i| Arc::ptr_eq(&i.conn, c)) {
        kernel_notifiers(epfd, fd, c, false);
    }
}

/// Whether any epoll instance was made by the program (the nesting check of poll and select
/// looks no further otherwise).
static ANY_EPOLL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `EPOLL_FDS` value: an epoll instance the program made.
const EPOLL_MADE: u8 = 1;
/// `EPOLL_FDS` bit: that instance is (or was) waited on by another wait ([`EpollSet::nest`]).
const EPOLL_NESTED: u8 = 2;

/// `fd` is about to be waited on by a wait that is not ours (poll, select, another epoll
/// instance): when it is an epoll instance of the program, arm its connections for good.
pub(crate) fn note_nested(fd: c_int) {
    let Some(s) = usize::try_from(fd).ok().and_then(|i| EPOLL_FDS.get(i)) else {
        return;
    };
    let v = s.load(std::sync::atomic::Ordering::Relaxed);
    if v & EPOLL_MADE == 0 || v & EPOLL_NESTED != 0 {
        return;
    }
    s.fetch_or(EPOLL_NESTED, std::sync::atomic::Ordering::SeqCst);
    // (Mark, then look for the set; `epoll_set` makes a set, then looks for the mark: with
    // the fences, one of the two sees the other.)
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    if let Some(e) = table::get(fd) {
        if let Kind::Epoll(set) = &e.kind {
            set.nest();
        }
    }
}

/// The [`EpollSet`] of epoll instance `epfd`, made (and entered in the table) when it has
/// none; `None` when the number holds something else.
fn epoll_set(epfd: c_int) -> Option<Arc<EpollSet>> {
    match table::get(epfd) {
        Some(e) => match &e.kind {
            Kind::Epoll(s) => Some(s.clone()),
            _ => None,
        },
        None => {
            // Its duplicates (if any) share the set: the one one of them has, or a new one.
            let mut fds = vec![epfd];
            fds.extend(sibling_numbers(epfd));
            let e = table::share(
                &fds,
                || Entry::new(Kind::Epoll(Arc::new(EpollSet::default()))),
                |e| matches!(e.kind, Kind::Epoll(_)),
            )?;
            let Kind::Epoll(s) = &e.kind else {
                return None;
            };
            let s = s.clone();
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            let nest = fds.iter().any(|&fd| {
                epoll_slot(&EPOLL_FDS, fd).is_some_and(|v| {
                    v.load(std::sync::atomic::Ordering::SeqCst) & EPOLL_NESTED != 0
                })
            });
            if nest {
                s.nest();
            }
            Some(s)
        }
    }
}

fn ready_events(r: Ready, events: u32) -> u32 {
    let mut m = 0u32;
    let want = events | libc::EPOLLERR as u32 | libc::EPOLLHUP as u32;
    if r.readable {
        m |= (libc::EPOLLIN | libc::EPOLLRDNORM) as u32;
    }
    if r.writable {
        m |= (libc::EPOLLOUT | libc::EPOLLWRNORM) as u32;
    }
    if r.read_hup {
        m |= libc::EPOLLRDHUP as u32;
    }
    if r.hup {
        m |= libc::EPOLLHUP as u32;
    }
    if r.error {
        m |= libc::EPOLLERR as u32;
    }
    if r.urgent {
        m |= libc::EPOLLPRI as u32;
    }
    m & want
}

/// Register (or remove) a connection's eventfds in the kernel instance `epfd`.
fn kernel_notifiers(epfd: c_int, fd: c_int, c: &Conn, add: bool) {
    let (r, w) = c.notifier_fds();
    for (i, nfd) in [r, w].into_iter().enumerate() {
        let mut ev = epoll_event {
            events: (libc::EPOLLIN | libc::EPOLLET) as u32,
            u64: MARK | ((fd as u32 as u64) << 1) | i as u64,
        };
        let op = if add {
            libc::EPOLL_CTL_ADD
        } else {
            libc::EPOLL_CTL_DEL
        };
        // SAFETY: our eventfd and a valid event.
        unsafe { real::epoll_ctl(epfd, op, nfd, &mut ev) };
    }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_ctl(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    ev: *mut epoll_event,
) -> c_int {
    if op == libc::EPOLL_CTL_ADD && ANY_EPOLL.load(std::sync::atomic::Ordering::Relaxed) {
        note_nested(fd);
    }
    // A client handshake in progress: its real socket is registered (writable at once,
    // readable when the server answers), under the handshake's lock, so that its end, which
    // moves the registrations of an SMC-R connection to user space (`adopt`), finds it.
    // SAFETY: passed on unchanged.
    if let Some(rc) =
        crate::connecting::while_pending(fd, || unsafe { real::epoll_ctl(epfd, op, fd, ev) })
    {
        return rc;
    }
    let conn = match target(fd) {
        Target::Smc(c) => c,
        Target::Relay(r) => {
            // The relay socket's registration, under the program's events and data word: the
            // kernel reports its readiness (LT, ET, ONESHOT as asked).
            // SAFETY: the caller's event, for the relay socket.
            let rc = unsafe { real::epoll_ctl(epfd, op, r.fd(), ev) };
            if rc == 0 {
                r.registered(epfd, fd, op != libc::EPOLL_CTL_DEL);
            }
            return rc;
        }
        Target::Foreign if op != libc::EPOLL_CTL_DEL => {
            crate::log!("fd {fd}: epoll_ctl on another process's SMC-R connection: EIO");
            set_errno(libc::EIO);
            return -1;
        }
        // SAFETY: passed on unchanged.
        _ => return unsafe { real::epoll_ctl(epfd, op, fd, ev) },
    };
    guard(-1, || {
        if epfd == fd {
            set_errno(libc::EINVAL);
            return -1;
        }
        let Some(set) = epoll_set(epfd) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        let mut m = set.lock();
        match op {
            libc::EPOLL_CTL_ADD | libc::EPOLL_CTL_MOD => {
                if ev.is_null() {
                    set_errno(libc::EFAULT);
                    return -1;
                }
                // SAFETY: the caller's event.
                let e = unsafe { ev.read_unaligned() };
                // EPOLLEXCLUSIVE as the kernel takes it: only at ADD, with only these other
                // events, and such a registration cannot be modified.
                let excl = libc::EPOLLEXCLUSIVE as u32;
                let excl_ok = (libc::EPOLLIN
                    | libc::EPOLLOUT
                    | libc::EPOLLERR
                    | libc::EPOLLHUP
                    | libc::EPOLLWAKEUP
                    | libc::EPOLLET) as u32
                    | excl;
                if e.events & excl != 0 && (op == libc::EPOLL_CTL_MOD || e.events & !excl_ok != 0) {
                    set_errno(libc::EINVAL);
                    return -1;
                }
                if op == libc::EPOLL_CTL_MOD && m.get(&fd).is_some_and(|i| i.events & excl != 0) {
                    set_errno(libc::EINVAL);
                    return -1;
                }
                let exists = m.contains_key(&fd);
                if op == libc::EPOLL_CTL_ADD && exists {
                    set_errno(libc::EEXIST);
                    return -1;
                }
                if op == libc::EPOLL_CTL_MOD && !exists {
                    set_errno(libc::ENOENT);
                    return -1;
                }
                if !exists {
                    set.register(&m, epfd, fd, &conn);
                }
                set.insert(
                    &mut m,
                    fd,
                    Interest {
                        conn,
                        events: e.events,
                        data: e.u64,
                        news: true,
                        seen: (0, 0),
                        disabled: false,
                    },
                );
                0
            }
            libc::EPOLL_CTL_DEL => match m.remove(&fd) {
                Some(i) => {
                    set.park(fd, &i.conn);
                    0
                }
                None => {
                    set_errno(libc::ENOENT);
                    -1
                }
            },
            _ => {
                set_errno(libc::EINVAL);
                -1
            }
        }
    })
}

/// Report the ready connections of `set` into `out` (level-, edge-triggered and one-shot as
/// each interest asks); returns how many.
fn harvest(set: &EpollSet, out: &mut [epoll_event]) -> usize {
    let mut m = set.lock();
    let et = libc::EPOLLET as u32;
    let live: Vec<(c_int, Arc<Conn>, (u64, u64))> = m
        .iter()
        .filter(|(_, i)| !i.disabled)
        .filter_map(|(fd, i)| {
            // The counts are read before the state: a signal after this is news next time.
            let counts = i.conn.signal_counts();
            let fresh = i.events & et == 0
                || i.news
                || (i.events & (libc::EPOLLIN | libc::EPOLLRDHUP) as u32 != 0
                    && counts.0 != i.seen.0)
                || (i.events & libc::EPOLLOUT as u32 != 0 && counts.1 != i.seen.1);
            fresh.then(|| (*fd, i.conn.clone(), counts))
        })
        .collect();
    if live.is_empty() {
        return 0;
    }
    let conns: Vec<&Conn> = live.iter().map(|(_, c, _)| &**c).collect();
    let mut ready = vec![Ready::default(); conns.len()];
    Conn::ready_many(&conns, &mut ready);
    let mut n = 0;
    for ((fd, _, counts), r) in live.iter().zip(ready) {
        if n == out.len() {
            break;
        }
        let Some(i) = m.get_mut(fd) else { continue };
        let mask = ready_events(r, i.events);
        if i.events & et != 0 {
            i.news = false;
            i.seen = *counts;
        }
        if mask == 0 {
            continue;
        }
        out[n] = epoll_event {
            events: mask,
            u64: i.data,
        };
        n += 1;
        if i.events & libc::EPOLLONESHOT as u32 != 0 {
            i.disabled = true;
        }
    }
    n
}

/// Take our eventfds' events out of `evs` (noting in `fired` which completion channels
/// woke); returns how many of the program's are left (moved to the front) and whether one of
/// ours was there.
fn filter_marks(evs: &mut [epoll_event], fired: &mut [bool]) -> (usize, bool) {
    let mut keep = 0;
    let mut ours = false;
    for i in 0..evs.len() {
        let d = evs[i].u64;
        if d & 0xFFFF_FFFF_0000_0000 == MARK {
            ours = true;
            if d & CHANNEL == CHANNEL {
                if let Some(f) = fired.get_mut((d & 0xFFFF) as usize) {
                    *f = true;
                }
            }
            // A wake-up only: what is new, the signal counts tell (see `harvest`).
        } else {
            evs[keep] = evs[i];
            keep += 1;
        }
    }
    (keep, ours)
}

fn remaining_ms(deadline: Option<Instant>) -> c_int {
    match deadline {
        None => -1,
        Some(d) => {
            let left = d.saturating_duration_since(Instant::now());
            // Rounded up, so that a wait never ends before its deadline.
            c_int::try_from(left.as_micros().div_ceil(1000)).unwrap_or(c_int::MAX)
        }
    }
}

/// epoll_wait on an instance watching SMC-R connections; `timeout` `None`: no limit.
pub(crate) unsafe fn epoll_wait_managed(
    epfd: c_int,
    set: &EpollSet,
    evs: *mut epoll_event,
    max: c_int,
    timeout: Option<Duration>,
    mask: *const sigset_t,
) -> c_int {
    // SAFETY: the caller's array of `max` events.
    let out = unsafe { std::slice::from_raw_parts_mut(evs, max as usize) };
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        // What arrived since the last call, handled here rather than by the runtime thread.
        smc::fdapi::poll_before_wait();
        let n = harvest(set, out);
        if n == out.len() {
            return n as c_int;
        }
        let t = if n > 0 { 0 } else { remaining_ms(deadline) };
        // Nothing ready and about to sleep: first spin a little for the connections' news
        // (the adaptive budget), when this instance watches connections.
        let spin = set.spin.get_or_init(smc::fdapi::LoopSpin::new);
        let mut spun = Duration::ZERO;
        if t != 0 && !set.lock().is_empty() {
            if let Some(budget) = spin.budget() {
                let start = Instant::now();
                let until = deadline.map_or(start + budget, |d| d.min(start + budget));
                let mut found = 0;
                if spin.spin(until, || {
                    found = harvest(set, out);
                    found > 0
                }) {
                    return found as c_int;
                }
                spun = start.elapsed();
            }
        }
        // About to sleep: arm the connections (their eventfds are written only while a wait
        // is armed), then look once more (a change before the arm wrote nothing).
        let armed = (t != 0).then(|| set.arm_for_sleep());
        if armed.is_some() {
            let found = harvest(set, out);
            if found > 0 {
                return found as c_int;
            }
        }
        // Become the stack's poller, so that a doorbell wakes this thread rather than the
        // runtime thread, which would then wake this one.
        let channels = if t != 0 {
            set.register_channels(epfd)
        } else {
            0
        };
        let state = if channels > 0 {
            smc::fdapi::poller_prepare()
        } else {
            smc::fdapi::PollerState::Other
        };
        if state == smc::fdapi::PollerState::Progress {
            continue;
        }
        let rest = &mut out[n..];
        let slept = Instant::now();
        // SAFETY: the rest of the caller's array.
        let k = unsafe { real::epoll_pwait(epfd, rest.as_mut_ptr(), rest.len() as c_int, t, mask) };
        // (errno of a failed wait survives: the disarm makes no system call.)
        drop(armed);
        if t != 0 && n == 0 {
            spin.slept(spun, slept.elapsed());
        }
        let mut fired = [false; 8];
        let (kept, ours) = if k > 0 {
            filter_marks(&mut rest[..k as usize], &mut fired)
        } else {
            (0, false)
        };
        if state == smc::fdapi::PollerState::Armed {
            // (errno of a failed wait survives: the finish makes no failing call visible.)
            let e = std::io::Error::last_os_error();
            smc::fdapi::poller_finish(&fired[..channels.min(fired.len())]);
            if let Some(n) = e.raw_os_error() {
                set_errno(n);
            }
        }
        if k < 0 {
            return if n > 0 { n as c_int } else { -1 };
        }
        if n + kept > 0 {
            return (n + kept) as c_int;
        }
        if !ours && k == 0 {
            return 0;
        }
        if deadline.is_some_and(|d| Instant::now() >= d) && !ours {
            return 0;
        }
        // Only our eventfds: look at the connections again.
    }
}

/// How many threads sleep in a wait passed on to the kernel on an epoll instance the program
/// made through the library that watched no SMC-R connection when the wait began.
static PASS_SLEEPERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The set of `epfd` when it watches SMC-R connections.
fn managed_set(epfd: c_int) -> Option<Arc<EpollSet>> {
    if !table::maybe(epfd) {
        return None;
    }
    match &table::get(epfd)?.kind {
        Kind::Epoll(set) => Some(set.clone()),
        _ => None,
    }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_pwait(
    epfd: c_int,
    evs: *mut epoll_event,
    max: c_int,
    timeout: c_int,
    mask: *const sigset_t,
) -> c_int {
    let managed = |set: Arc<EpollSet>, timeout: Option<Duration>| {
        // SAFETY: the caller's arguments.
        guard(-1, || unsafe {
            epoll_wait_managed(epfd, &set, evs, max, timeout, mask)
        })
    };
    if max > 0 {
        if let Some(set) = managed_set(epfd) {
            return managed(
                set,
                (timeout >= 0).then(|| Duration::from_millis(timeout as u64)),
            );
        }
    }
    let made = usize::try_from(epfd)
        .ok()
        .and_then(|i| EPOLL_FDS.get(i))
        .is_some_and(|v| v.load(std::sync::atomic::Ordering::Relaxed) & EPOLL_MADE != 0);
    if max <= 0 || timeout == 0 || !made {
        // SAFETY: passed on unchanged.
        return unsafe { real::epoll_pwait(epfd, evs, max, timeout, mask) };
    }
    // An instance of the program's without connections yet: the kernel's wait, but a
    // connection added meanwhile (by another thread) must wake it, as the kernel wakes a
    // wait for a ready descriptor added to its instance (BEAM's poll thread sleeps without a
    // timeout while its schedulers add sockets: Erlang's gen_tcp never read its data). The
    // adding thread writes the connection's eventfds (registered in this instance under our
    // mark) when such a wait sleeps; the wait takes our events out and goes on managed.
    let deadline = (timeout > 0).then(|| Instant::now() + Duration::from_millis(timeout as u64));
    loop {
        PASS_SLEEPERS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        // (Counted, then looked at again; an ADD makes the set, then reads the count.)
        if let Some(set) = managed_set(epfd) {
            PASS_SLEEPERS.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
            return managed(
                set,
                deadline.map(|d| d.saturating_duration_since(Instant::now())),
            );
        }
        let t = remaining_ms(deadline);
        // SAFETY: the caller's arguments.
        let k = unsafe { real::epoll_pwait(epfd, evs, max, t, mask) };
        PASS_SLEEPERS.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        if k <= 0 {
            return k;
        }
        // SAFETY: the `k` events the kernel wrote.
        let got = unsafe { std::slice::from_raw_parts_mut(evs, k as usize) };
        let (kept, ours) = filter_marks(got, &mut [false; 8]);
        if kept > 0 || !ours {
            return kept as c_int;
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return 0;
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_wait(
    epfd: c_int,
    evs: *mut epoll_event,
    max: c_int,
    timeout: c_int,
) -> c_int {
    // SAFETY: as epoll_pwait without a mask.
    unsafe { epoll_pwait(epfd, evs, max, timeout, std::ptr::null()) }
}

/// Per descriptor number: 1 when it is an epoll instance the program made (so that a socket
/// registered in it before it became an SMC-R connection can be moved to user space).
static EPOLL_FDS: [std::sync::atomic::AtomicU8; table::MAX_FD] =
    [const { std::sync::atomic::AtomicU8::new(0) }; table::MAX_FD];

/// Per descriptor number of an epoll instance the program made: which instance (numbers
/// that `dup` made of one instance share the value; 0: none). tokio's reactor registers
/// its sockets through a duplicate of its epoll number (mio's `Registry::try_clone`) and
/// waits on the original: with a set per number, the connections went into the
/// duplicate's set, the wait looked at the original's (empty) one and dropped the
/// connections' wake-ups, and every tokio program hung at its first read.
static EPOLL_INSTANCE: [std::sync::atomic::AtomicU32; table::MAX_FD] =
    [const { std::sync::atomic::AtomicU32::new(0) }; table::MAX_FD];

/// The last instance value given out.
static EPOLL_INSTANCES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Whether the program ever duplicated an epoll instance's number (until then no instance
/// has a second number, and making a set looks for none).
static EPOLL_DUPLICATED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The other numbers of the epoll instance `epfd` names (its duplicates).
fn sibling_numbers(epfd: c_int) -> impl Iterator<Item = c_int> {
    let id = if EPOLL_DUPLICATED.load(std::sync::atomic::Ordering::SeqCst) {
        epoll_slot(&EPOLL_INSTANCE, epfd).map_or(0, |i| i.load(std::sync::atomic::Ordering::SeqCst))
    } else {
        0
    };
    EPOLL_INSTANCE
        .iter()
        .enumerate()
        .take(if id == 0 { 0 } else { table::MAX_FD })
        .filter(move |(fd, i)| {
            *fd as c_int != epfd && i.load(std::sync::atomic::Ordering::Relaxed) == id
        })
        .map(|(fd, _)| fd as c_int)
}

fn epoll_slot<T>(a: &'static [T], fd: c_int) -> Option<&'static T> {
    usize::try_from(fd).ok().and_then(|i| a.get(i))
}

fn note_epoll(fd: c_int) {
    if let Some(s) = epoll_slot(&EPOLL_FDS, fd) {
        let id = EPOLL_INSTANCES.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        if let Some(i) = epoll_slot(&EPOLL_INSTANCE, fd) {
            i.store(id, std::sync::atomic::Ordering::SeqCst);
        }
        s.store(EPOLL_MADE, std::sync::atomic::Ordering::Relaxed);
        ANY_EPOLL.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Whether the program made any epoll instance.
pub(crate) fn any_epoll() -> bool {
    ANY_EPOLL.load(std::sync::atomic::Ordering::Relaxed)
}

/// Whether `fd` is an epoll instance the program made (one relaxed load).
pub(crate) fn is_epoll(fd: c_int) -> bool {
    epoll_slot(&EPOLL_FDS, fd)
        .is_some_and(|v| v.load(std::sync::atomic::Ordering::Relaxed) & EPOLL_MADE != 0)
}

/// `new` was just made a duplicate of epoll instance `old` (`dup`, `dup2`, `dup3`,
/// `F_DUPFD`): both numbers name one kernel instance, so they share its set of
/// connections — now when it has one, else when it gets one ([`epoll_set`]).
pub(crate) fn duplicated_epoll(old: c_int, new: c_int) {
    let (Some(o), Some(n)) = (epoll_slot(&EPOLL_FDS, old), epoll_slot(&EPOLL_FDS, new)) else {
        return;
    };
    let (Some(oi), Some(ni)) = (
        epoll_slot(&EPOLL_INSTANCE, old),
        epoll_slot(&EPOLL_INSTANCE, new),
    ) else {
        return;
    };
    // (Before the number is stored: a set made after this flag was missed finds it.)
    EPOLL_DUPLICATED.store(true, std::sync::atomic::Ordering::SeqCst);
    ni.store(
        oi.load(std::sync::atomic::Ordering::SeqCst),
        std::sync::atomic::Ordering::SeqCst,
    );
    n.store(
        o.load(std::sync::atomic::Ordering::Relaxed),
        std::sync::atomic::Ordering::Relaxed,
    );
    // (Instance value stored, then the set looked for; `epoll_set` makes the set, then
    // looks for the numbers: with the fences, one of the two sees the other.)
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    if let Some(e) = table::get(old) {
        if let Kind::Epoll(_) = &e.kind {
            if let Ok(Some(x)) = table::set(new, e) {
                table::release(x);
            }
        }
    }
}

/// The number `fd` is closed (or reused): it is no longer an epoll instance of ours.
pub(crate) fn closed(fd: c_int) {
    if let Some(s) = epoll_slot(&EPOLL_FDS, fd) {
        if s.load(std::sync::atomic::Ordering::Relaxed) != 0 && !table::borrowed_memory() {
            s.store(0, std::sync::atomic::Ordering::Relaxed);
            if let Some(i) = epoll_slot(&EPOLL_INSTANCE, fd) {
                i.store(0, std::sync::atomic::Ordering::SeqCst);
            }
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_create1(flags: c_int) -> c_int {
    // SAFETY: passed on unchanged.
    let fd = unsafe { real::epoll_create1(flags) };
    note_epoll(fd);
    fd
}

#[no_mangle]
pub unsafe extern "C" fn epoll_create(size: c_int) -> c_int {
    if size <= 0 {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: as epoll_create1 without flags.
    unsafe { epoll_create1(0) }
}

/// The registrations of `fd` in kernel epoll instance `epfd`, from `/proc/self/fdinfo`
/// (lines `tfd: N events: HEX data: HEX ...`).
fn kernel_registration(epfd: c_int, fd: c_int) -> Option<(u32, u64)> {
    let text = std::fs::read_to_string(format!("/proc/self/fdinfo/{epfd}")).ok()?;
    for line in text.lines() {
        let mut it = line.split_whitespace();
        if it.next() != Some("tfd:") {
            continue;
        }
        if it.next()?.parse::<c_int>().ok()? != fd {
            continue;
        }
        let (mut events, mut data) = (None, None);
        while let Some(k) = it.next() {
            match k {
                "events:" => events = u32::from_str_radix(it.next()?, 16).ok(),
                "data:" => data = u64::from_str_radix(it.next()?, 16).ok(),
                _ => {}
            }
        }
        return Some((events?, data?));
    }
    None
}

/// `fd`'s connection became relayed (`relay.rs`): its interests in this process's epoll
/// instances move to the kernel instances, as registrations of the relay socket with the
/// program's events and data word (a one-shot interest already reported stays silent until
/// the program's EPOLL_CTL_MOD).
pub(crate) fn moved_to_relay(fd: c_int, relay: &crate::relay::Relay) {
    for (epfd, set) in table::epolls() {
        let mut m = set.lock();
        set.unpark(&m, epfd, fd);
        let Some(i) = m.remove(&fd) else {
            continue;
        };
        kernel_notifiers(epfd, fd, &i.conn, false);
        let mut events = i.events;
        if i.disabled {
            events &= (libc::EPOLLONESHOT | libc::EPOLLET) as u32;
        }
        let mut ev = epoll_event {
            events,
            u64: i.data,
        };
        // SAFETY: the relay socket and a valid event.
        if unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, relay.fd(), &mut ev) } == 0 {
            relay.registered(epfd, fd, true);
        }
        drop(m);
        crate::log!("fd {fd}: its registration in epoll {epfd} moved to the relay socket");
    }
}

/// `fd` just became an SMC-R connection: registrations the program made in its epoll
/// instances while it was a plain socket (nginx registers an upstream socket before
/// `connect`) move from the kernel to user space, since the socket itself will never be
/// readable.
pub(crate) fn adopt(fd: c_int, conn: &Arc<Conn>) {
    for (epfd, s) in EPOLL_FDS.iter().enumerate() {
        if s.load(std::sync::atomic::Ordering::Relaxed) == 0 {
            continue;
        }
        let epfd = epfd as c_int;
        let Some((events, data)) = kernel_registration(epfd, fd) else {
            continue;
        };
        let mut ev = epoll_event { events: 0, u64: 0 };
        // SAFETY: removing the program's registration of the socket.
        unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_DEL, fd, &mut ev) };
        let Some(set) = epoll_set(epfd) else {
            continue;
        };
        let mut m = set.lock();
        set.register(&m, epfd, fd, conn);
        // A one-shot registration the kernel already reported keeps only its flags (no
        // event left): it stays silent until the program's EPOLL_CTL_MOD, as there.
        let live = (libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLPRI | libc::EPOLLRDHUP) as u32;
        let disabled = events & libc::EPOLLONESHOT as u32 != 0 && events & live == 0;
        set.insert(
            &mut m,
            fd,
            Interest {
                conn: conn.clone(),
                events,
                data,
                news: true,
                seen: (0, 0),
                disabled,
            },
        );
        crate::log!("fd {fd}: its registration in epoll {epfd} moved to user space");
    }
}

#[cfg(test)]
mod tests {
    use super::poll::poll_revents;
    use super::*;

    #[test]
    fn readiness_maps_to_the_masks_tcp_poll_reports() {
        let r = Ready {
            readable: true,
            writable: true,
            read_hup: true,
            hup: false,
            error: false,
            urgent: false,
        };
        let all = (libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLRDHUP) as u32;
        assert_eq!(
            ready_events(r, all),
            (libc::EPOLLIN
                | libc::EPOLLRDNORM
                | libc::EPOLLOUT
                | libc::EPOLLWRNORM
                | libc::EPOLLRDHUP) as u32
                & (all | libc::EPOLLERR as u32 | libc::EPOLLHUP as u32)
        );
        // Only what was asked for, but HUP and ERR always.
        let failed = Ready {
            error: true,
            hup: true,
            ..Ready::default()
        };
        assert_eq!(
            ready_events(failed, libc::EPOLLIN as u32),
            (libc::EPOLLERR | libc::EPOLLHUP) as u32
        );
        assert_eq!(ready_events(r, libc::EPOLLIN as u32), libc::EPOLLIN as u32);
        assert_eq!(poll_revents(r, libc::POLLOUT), libc::POLLOUT);
        assert_eq!(
            poll_revents(failed, libc::POLLIN),
            libc::POLLHUP | libc::POLLERR
        );
        // Urgent data: PRI when asked for (select's exceptfds asks POLLPRI).
        let urgent = Ready {
            urgent: true,
            ..Ready::default()
        };
        assert_eq!(poll_revents(urgent, libc::POLLPRI), libc::POLLPRI);
        assert_eq!(poll_revents(urgent, libc::POLLIN), 0);
        assert_eq!(
            ready_events(urgent, (libc::EPOLLIN | libc::EPOLLPRI) as u32),
            libc::EPOLLPRI as u32
        );
    }

    #[test]
    fn our_marks_leave_the_programs_events() {
        let mut evs = [
            epoll_event { events: 1, u64: 7 },
            epoll_event {
                events: 1,
                u64: MARK | (5 << 1),
            },
            epoll_event {
                events: 1,
                u64: CHANNEL | 1,
            },
            epoll_event { events: 4, u64: 9 },
        ];
        let mut fired = [false; 2];
        let (kept, ours) = filter_marks(&mut evs, &mut fired);
        assert!(ours);
        assert_eq!(kept, 2);
        assert_eq!({ evs[0].u64 }, 7);
        assert_eq!({ evs[1].u64 }, 9);
        assert_eq!(fired, [false, true]);
    }

    #[test]
    fn a_kernel_registration_is_read_back_from_fdinfo() {
        let mut p = [0; 2];
        // SAFETY: plain system calls on descriptors this test owns.
        unsafe {
            assert_eq!(libc::pipe(p.as_mut_ptr()), 0);
            let ep = libc::epoll_create1(libc::EPOLL_CLOEXEC);
            assert!(ep >= 0);
            let mut ev = epoll_event {
                events: (libc::EPOLLIN | libc::EPOLLET) as u32,
                u64: 0xdead_beef_0042,
            };
            assert_eq!(libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, p[0], &mut ev), 0);
            let (events, data) = kernel_registration(ep, p[0]).expect("registered");
            assert_eq!(data, 0xdead_beef_0042);
            assert_eq!(
                events & (libc::EPOLLIN | libc::EPOLLET) as u32,
                (libc::EPOLLIN | libc::EPOLLET) as u32
            );
            assert!(kernel_registration(ep, p[1]).is_none());
            libc::close(ep);
            libc::close(p[0]);
            libc::close(p[1]);
        }
    }
}
