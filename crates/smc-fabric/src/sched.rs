//! A sleep whose wake-up does not preempt the thread running on the CPU it lands on.
//!
//! A stream's reader on software RoCE sleeps in its device socket's receive call and is
//! woken by the first datagram of every update; the kernel's wake-up then takes the CPU from
//! whatever runs there — on a busy two-core machine, often the peer's writer in the middle of
//! sending that very update (docs/performance.md, "Who takes the writer's CPU": 43 % of a
//! stream sender's context switches). TCP's receiver sleeps about once per 256 KiB; the RoCE
//! one, faster than its sender, about once per 64 KiB update. A thread under `SCHED_BATCH`
//! is not put on the CPU by its wake-up (Linux: "Batch and idle tasks do not preempt
//! non-idle tasks"): it runs at once on an idle CPU, else when the running task sleeps or
//! has used its slice, and finds more work waiting then.
//!
//! [`QuietWake`] puts the calling thread under `SCHED_BATCH` for its sleep, keeping its nice
//! value, and leaves alone a thread under any other policy (an application's real-time or
//! idle thread). The wake-up latency it adds is at most a scheduler slice, and only when no
//! CPU is idle: for sleeps that wait for bulk data, not for a reply.
//!
//! A stream's reader sleeps once per update or so, and switching its policy there and back
//! took three system calls per sleep — 7 % of a RoCE receiver's samples in a profile, 14 % of
//! its CPU with each process on a CPU of its own (docs/performance.md, "Session 24"). So the policy is *kept* after the sleep: the reader's next bulk sleep, a
//! few tens of µs later, begins without a system call. It is given back (`SCHED_OTHER`)
//! when the thread next waits for something other than bulk data ([`QuietWake::settle`],
//! called by the stack before such a wait), and by [`restore_stale`] once the thread's last
//! bulk sleep ended more than [`KEEP_MAX`] ago — a software RoCE device's progress thread
//! calls it every tick — so that whatever the application does between its reads, or after
//! its last one, runs under its own policy within a few ms.
//!
//! The progress thread itself runs under `SCHED_BATCH` for good ([`batch_if_other`]): it is
//! woken for datagrams nobody waits for, leases and ticks, none of which needs the CPU before
//! the thread running there sleeps or ends its slice.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

/// How long after its last bulk sleep a thread may stay under that sleep's `SCHED_BATCH`
/// before [`restore_stale`] gives its policy back (a stream's reader begins its next sleep
/// well within it). The progress thread's tick comes on top: a thread is given back
/// between `KEEP_MAX` and `KEEP_MAX` + 2 ms after that sleep (device.rs `TICK`).
pub const KEEP_MAX: Duration = Duration::from_millis(1);

/// `Slot::state` of a thread under its own policy.
const NORMAL: u64 = 0;
/// `Slot::state` of a thread asleep under `SCHED_BATCH` ([`QuietWake`] alive).
const ASLEEP: u64 = u64::MAX;

/// Threads of a process that can be kept at once; a thread that finds no free slot is
/// given its policy back after each sleep, as before slots were kept.
const SLOTS: usize = 256;

/// A thread's `SCHED_BATCH` as [`QuietWake`] left it, shared with [`restore_stale`]. A
/// fixed table of atomics rather than a registry under a lock: a forked child copies it in
/// any state (the child's fork handler, [`forked`], takes the parent's other threads out).
#[repr(align(64))]
struct Slot {
    /// The thread's id; 0: the slot is free.
    tid: AtomicI32,
    /// Whether [`restore_stale`] looks at it (not for the tests' own threads, which
    /// [`restore`] alone gives back: the progress threads of other tests sweep meanwhile).
    swept: AtomicBool,
    /// [`NORMAL`], [`ASLEEP`], or since when it is kept: µs on the monotonic clock
    /// ([`now_stamp`], at least 1).
    state: AtomicU64,
    /// How many times a sweep gave this thread its policy back.
    sweeps: AtomicU32,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Slot = Slot {
    tid: AtomicI32::new(0),
    swept: AtomicBool::new(true),
    state: AtomicU64::new(NORMAL),
    sweeps: AtomicU32::new(0),
};

static TABLE: [Slot; SLOTS] = [FREE; SLOTS];

/// Threads kept under `SCHED_BATCH` or asleep under it right now.
static KEPT: AtomicUsize = AtomicUsize::new(0);

/// One past the highest slot ever taken: a sweep looks at no slot beyond (most processes use
/// a few of the 256).
static USED: AtomicUsize = AtomicUsize::new(0);

/// The process whose threads the table names (set at the first claim and by [`forked`]): a
/// child made without fork handlers (a raw `clone`) has the parent's table, and its sweeps
/// leave it alone rather than reach the parent's threads.
static OWNER: AtomicI32 = AtomicI32::new(0);

/// Whether [`forked`] is registered as a fork handler (a flag, not a `Once`: a child forked
/// while another thread ran a `Once` would inherit it running).
static AT_FORK: AtomicBool = AtomicBool::new(false);

/// `Mine`'s value before the thread's first switch.
const UNSET: usize = usize::MAX;
/// `Mine`'s value when no slot was free.
const NO_SLOT: usize = usize::MAX - 1;

/// The calling thread's slot index (or [`UNSET`], [`NO_SLOT`]), taken at its first switch
/// to `SCHED_BATCH` and freed when the thread ends.
struct Mine(Cell<usize>);

impl Mine {
    fn slot(&self) -> Option<&'static Slot> {
        TABLE.get(self.0.get())
    }
}

impl Drop for Mine {
    fn drop(&mut self) {
        if let Some(k) = self.slot() {
            if k.state.swap(NORMAL, Ordering::AcqRel) != NORMAL {
                KEPT.fetch_sub(1, Ordering::AcqRel);
            }
            k.tid.store(0, Ordering::Release);
        }
    }
}

thread_local! {
    static MINE: Mine = const { Mine(Cell::new(UNSET)) };
    /// Whether `MINE` was ever touched on this thread: [`QuietWake::settle`] looks here
    /// first, so that a thread that never slept quietly touches no thread-local with a
    /// destructor (whose registration may allocate: `settle` runs in `fork` and `exec`
    /// hooks, also in the child of a `vfork`).
    static TOUCHED: Cell<bool> = const { Cell::new(false) };
}

/// Whether some thread is kept under `SCHED_BATCH` or asleep under it (the progress thread
/// then ticks at its shortest even when it has no QP, so that the bound holds).
pub fn any_kept() -> bool {
    KEPT.load(Ordering::Acquire) > 0
}

/// Take a free slot for the calling thread: its index, or [`NO_SLOT`].
fn take_slot() -> usize {
    if !AT_FORK.load(Ordering::Acquire) {
        // SAFETY: a handler with no arguments that only touches atomics and this thread's
        // own thread-locals. Registered twice by two threads at once: harmless (it is
        // idempotent). Not registered: the table is the parent's in a child, which `OWNER`
        // keeps the child's sweeps off.
        if unsafe { libc::pthread_atfork(None, None, Some(forked)) } == 0 {
            AT_FORK.store(true, Ordering::Release);
        }
        OWNER.store(getpid(), Ordering::Release);
    }
    #[cfg(test)]
    let swept = !tests::UNSWEPT.with(|u| u.get());
    #[cfg(not(test))]
    let swept = true;
    let tid = gettid();
    for (i, k) in TABLE.iter().enumerate() {
        if k.tid
            .compare_exchange(0, tid, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            k.swept.store(swept, Ordering::Release);
            k.sweeps.store(0, Ordering::Release);
            k.state.store(NORMAL, Ordering::Release);
            USED.fetch_max(i + 1, Ordering::AcqRel);
            return i;
        }
    }
    NO_SLOT
}

/// In a forked child (fork handler): the parent's other threads are not here, and the
/// forking thread has another id. Their slots are freed; the forking thread's keeps its
/// state under its new id.
extern "C" fn forked() {
    // Not `MINE` on a thread that never touched it (its first touch registers a destructor).
    let me = if TOUCHED.try_with(|t| t.get()).unwrap_or(false) {
        MINE.try_with(|m| m.0.get()).unwrap_or(UNSET)
    } else {
        UNSET
    };
    OWNER.store(getpid(), Ordering::Release);
    let tid = gettid();
    let mut kept = 0;
    for (i, k) in TABLE.iter().enumerate() {
        if i == me {
            k.tid.store(tid, Ordering::Release);
            if k.state.load(Ordering::Acquire) != NORMAL {
                kept += 1;
            }
        } else {
            k.state.store(NORMAL, Ordering::Release);
            k.tid.store(0, Ordering::Release);
        }
    }
    KEPT.store(kept, Ordering::Release);
}

/// The calling thread's id.
fn gettid() -> libc::pid_t {
    // SAFETY: no arguments; it cannot fail.
    unsafe { libc::gettid() }
}

/// The calling process's id.
fn getpid() -> libc::pid_t {
    // SAFETY: no arguments; it cannot fail.
    unsafe { libc::getpid() }
}

/// Now on the monotonic clock in µs, at least 1 (0 is [`NORMAL`]; read with no lazily made
/// state, which a forked child could inherit half made).
fn now_stamp() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a live timespec for the call's duration.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    let us = (ts.tv_sec as u64)
        .saturating_mul(1_000_000)
        .saturating_add(ts.tv_nsec as u64 / 1_000);
    us.clamp(1, ASLEEP - 1)
}

/// `SCHED_BATCH` for the calling thread while this lives, and after it until given back (see
/// the module's text).
#[derive(Debug)]
pub struct QuietWake {
    /// The thread was switched to `SCHED_BATCH` for this sleep, now or by an earlier one.
    switched: bool,
    /// Not `Send`: its drop marks the calling thread's slot.
    _thread: std::marker::PhantomData<*const ()>,
}

impl QuietWake {
    /// Put the calling thread under `SCHED_BATCH` if it is under `SCHED_OTHER` (no system
    /// call if its last bulk sleep left it there and nobody has given it back since).
    pub fn begin() -> QuietWake {
        TOUCHED.set(true);
        let switched = MINE
            .try_with(|m| {
                if let Some(k) = m.slot() {
                    let s = k.state.load(Ordering::Acquire);
                    // Kept since the last sleep (an application that set a policy of its
                    // own meanwhile is not looked for here; `settle` and `restore_stale`
                    // leave such a policy alone). `restore_stale` may take it back at this
                    // very moment: then it is NORMAL, and the policy is looked at below.
                    if s != NORMAL
                        && s != ASLEEP
                        && k.state
                            .compare_exchange(s, ASLEEP, Ordering::AcqRel, Ordering::Acquire)
                            .is_ok()
                    {
                        return true;
                    }
                }
                if !batch_if_other() {
                    return false;
                }
                if m.0.get() == UNSET {
                    m.0.set(take_slot());
                }
                if let Some(k) = m.slot() {
                    if k.state.swap(ASLEEP, Ordering::AcqRel) == NORMAL {
                        KEPT.fetch_add(1, Ordering::AcqRel);
                    }
                }
                true
            })
            .unwrap_or(false);
        QuietWake {
            switched,
            _thread: std::marker::PhantomData,
        }
    }

    /// Whether the thread is under `SCHED_BATCH` for this sleep by this type's doing.
    pub fn switched(&self) -> bool {
        self.switched
    }

    /// Give the calling thread its own policy back if a bulk sleep left it under
    /// `SCHED_BATCH` (and it is still under it): the stack calls it before a stream's other
    /// waits and before it starts a thread, and `smc run` before `fork`, `exec`,
    /// `posix_spawn` and `vfork`, which would pass the policy on (the progress thread's
    /// sweep covers the rest within [`KEEP_MAX`] and a tick). A thread-local load when
    /// there is nothing to give back.
    pub fn settle() {
        if !TOUCHED.try_with(|t| t.get()).unwrap_or(false) {
            return;
        }
        let _ = MINE.try_with(|m| {
            let Some(k) = m.slot() else {
                return;
            };
            if k.state.load(Ordering::Acquire) == NORMAL {
                return;
            }
            // In the child of a `vfork` (an exec hook), the thread-locals and the table are
            // the parent's: only the child's own policy is given back there.
            if k.tid.load(Ordering::Acquire) != gettid() {
                give_back(0);
                return;
            }
            if k.state.swap(NORMAL, Ordering::AcqRel) != NORMAL {
                KEPT.fetch_sub(1, Ordering::AcqRel);
                give_back(0);
            }
        });
    }
}

impl Drop for QuietWake {
    fn drop(&mut self) {
        if !self.switched {
            return;
        }
        // Kept from now on (see the module's text); a thread without a slot is given its
        // policy back at once.
        let kept = MINE
            .try_with(|m| match m.slot() {
                Some(k) => {
                    let _ = k.state.compare_exchange(
                        ASLEEP,
                        now_stamp(),
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    );
                    true
                }
                None => false,
            })
            .unwrap_or(false);
        if !kept {
            set_policy(libc::SCHED_OTHER);
        }
    }
}

/// Give their own policy back to the threads whose last bulk sleep ended `max_age` or more
/// ago and that sleep no more (software RoCE's progress thread calls it every tick with
/// [`KEEP_MAX`]). Nothing but an atomic load while no thread is kept.
pub fn restore_stale(max_age: Duration) {
    restore(max_age, None);
}

/// [`restore_stale`] for every swept thread, or for thread `only` alone.
fn restore(max_age: Duration, only: Option<libc::pid_t>) {
    if !any_kept() || OWNER.load(Ordering::Acquire) != getpid() {
        return;
    }
    let now = now_stamp();
    let age = max_age.as_micros() as u64;
    let used = USED.load(Ordering::Acquire).min(SLOTS);
    for k in &TABLE[..used] {
        let tid = k.tid.load(Ordering::Acquire);
        if tid == 0 || !only.map_or(k.swept.load(Ordering::Acquire), |t| t == tid) {
            continue;
        }
        let s = k.state.load(Ordering::Acquire);
        // A stamp after `now` is a later owner's of the slot (its tid not the one read
        // above): left for the next sweep.
        if s == NORMAL || s == ASLEEP || s > now || now - s < age {
            continue;
        }
        if k.state
            .compare_exchange(s, NORMAL, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            KEPT.fetch_sub(1, Ordering::AcqRel);
            k.sweeps.fetch_add(1, Ordering::Relaxed);
            give_back(tid);
        }
    }
}

/// How many times a sweep gave the calling thread its policy back (tests).
#[cfg(test)]
pub(crate) fn sweeps_of_mine() -> u32 {
    MINE.with(|m| m.slot().map_or(0, |k| k.sweeps.load(Ordering::Acquire)))
}

/// Thread `tid` (0: the calling one) back under `SCHED_OTHER` — only if it is still under the
/// batch policy it was left in: an application that set its own meanwhile keeps it.
fn give_back(tid: libc::pid_t) {
    if policy_of(tid) == Some(libc::SCHED_BATCH) {
        set_policy_of(tid, libc::SCHED_OTHER);
    }
}

/// Put the calling thread under `SCHED_BATCH` when it is under `SCHED_OTHER` (a thread under
/// any other policy keeps it); whether it switched. [`QuietWake::begin`] does so for a sleep;
/// a software RoCE device's progress thread for good (device.rs `run`: not a thread of the
/// application's, so not kept in a slot or swept).
pub(crate) fn batch_if_other() -> bool {
    policy() == Some(libc::SCHED_OTHER) && set_policy(libc::SCHED_BATCH)
}

/// The calling thread's scheduling policy (`SCHED_RESET_ON_FORK` included when set).
fn policy() -> Option<libc::c_int> {
    policy_of(0)
}

/// Thread `tid`'s scheduling policy (0: the calling thread).
pub(crate) fn policy_of(tid: libc::pid_t) -> Option<libc::c_int> {
    // SAFETY: no arguments but a thread id.
    let p = unsafe { libc::sched_getscheduler(tid) };
    (p >= 0).then_some(p)
}

/// Set the calling thread's policy, priority 0 (the only one of the normal policies; the nice
/// value stays); whether it took.
fn set_policy(policy: libc::c_int) -> bool {
    set_policy_of(0, policy)
}

/// [`set_policy`] for thread `tid` of this process (0: the calling thread).
fn set_policy_of(tid: libc::pid_t, policy: libc::c_int) -> bool {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a live sched_param for the duration of the call.
    unsafe { libc::sched_setscheduler(tid, policy, &param) == 0 }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    thread_local! {
        /// Set by a test's thread before its first quiet sleep: [`restore_stale`] leaves it.
        pub(crate) static UNSWEPT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// A thread for a test: unswept (see [`UNSWEPT`]).
    fn spawn<T: Send + 'static>(
        f: impl FnOnce() -> T + Send + 'static,
    ) -> std::thread::JoinHandle<T> {
        std::thread::spawn(move || {
            UNSWEPT.with(|u| u.set(true));
            f()
        })
    }

    #[test]
    fn a_normal_thread_is_batch_for_the_sleep_and_after_until_it_settles() {
        spawn(|| {
            assert_eq!(policy(), Some(libc::SCHED_OTHER));
            {
                let q = QuietWake::begin();
                assert!(q.switched());
                assert_eq!(policy(), Some(libc::SCHED_BATCH));
            }
            // Kept for the next bulk sleep, which begins without switching anything.
            assert_eq!(policy(), Some(libc::SCHED_BATCH));
            {
                let q = QuietWake::begin();
                assert!(q.switched());
                assert_eq!(policy(), Some(libc::SCHED_BATCH));
            }
            QuietWake::settle();
            assert_eq!(policy(), Some(libc::SCHED_OTHER));
            // Settled, the next sleep switches again.
            drop(QuietWake::begin());
            assert_eq!(policy(), Some(libc::SCHED_BATCH));
            QuietWake::settle();
            assert_eq!(policy(), Some(libc::SCHED_OTHER));
        })
        .join()
        .expect("thread");
    }

    #[test]
    fn a_thread_under_another_policy_is_left_alone() {
        spawn(|| {
            assert!(set_policy(libc::SCHED_IDLE));
            {
                let q = QuietWake::begin();
                assert!(!q.switched());
                assert_eq!(policy(), Some(libc::SCHED_IDLE));
            }
            QuietWake::settle();
            assert_eq!(policy(), Some(libc::SCHED_IDLE));
        })
        .join()
        .expect("thread");
    }

    /// A policy the application sets on a kept thread is its own: neither the thread's
    /// settling nor a sweep changes it (each thread ends under `SCHED_IDLE`, which an
    /// unprivileged thread may enter and not leave).
    #[test]
    fn an_applications_own_policy_is_left_alone() {
        let settled = spawn(|| {
            drop(QuietWake::begin());
            assert!(set_policy(libc::SCHED_IDLE));
            QuietWake::settle();
            policy()
        });
        let swept = spawn(|| {
            drop(QuietWake::begin());
            assert!(set_policy(libc::SCHED_IDLE));
            restore(Duration::ZERO, Some(gettid()));
            QuietWake::settle();
            policy()
        });
        assert_eq!(settled.join().expect("thread"), Some(libc::SCHED_IDLE));
        assert_eq!(swept.join().expect("thread"), Some(libc::SCHED_IDLE));
    }

    /// A thread left under `SCHED_BATCH` by its last bulk sleep is given its policy back by
    /// another thread once that sleep is old enough, and not before; one asleep is left be.
    #[test]
    fn a_kept_thread_is_restored_once_its_last_sleep_is_old() {
        let (to_main, from_thread) = std::sync::mpsc::channel();
        let (to_thread, from_main) = std::sync::mpsc::channel::<()>();
        let t = spawn(move || {
            drop(QuietWake::begin());
            to_main.send(gettid()).expect("send");
            // Asleep under the batch policy while the main thread looks.
            from_main.recv().expect("recv");
            let q = QuietWake::begin();
            to_main.send(0).expect("send");
            from_main.recv().expect("recv");
            drop(q);
            to_main.send(0).expect("send");
            from_main.recv().expect("recv");
        });
        let tid = from_thread.recv().expect("tid");
        assert_eq!(policy_of(tid), Some(libc::SCHED_BATCH));
        restore(Duration::from_secs(3600), Some(tid));
        assert_eq!(
            policy_of(tid),
            Some(libc::SCHED_BATCH),
            "restored too early"
        );
        restore(Duration::ZERO, Some(tid));
        assert_eq!(policy_of(tid), Some(libc::SCHED_OTHER));
        // Its next sleep switches again; while asleep nothing restores it.
        to_thread.send(()).expect("send");
        from_thread.recv().expect("asleep");
        assert_eq!(policy_of(tid), Some(libc::SCHED_BATCH));
        restore(Duration::ZERO, Some(tid));
        assert_eq!(
            policy_of(tid),
            Some(libc::SCHED_BATCH),
            "restored while asleep"
        );
        to_thread.send(()).expect("send");
        from_thread.recv().expect("woke");
        restore(Duration::ZERO, Some(tid));
        assert_eq!(policy_of(tid), Some(libc::SCHED_OTHER));
        to_thread.send(()).expect("send");
        t.join().expect("thread");
    }
}
