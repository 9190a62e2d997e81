//! The adaptive spin of a waiting call of the fd-level API (an event loop's wait, a blocking
//! read on the interruptible path): [`LoopSpin`], and what it learns from the peer's spin
//! words ([`SpinBeacon`]) and when it sleeps on purpose ([`Reseat`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::{current_stack, loop_poll};

/// The adaptive spin of an event loop's wait (one per epoll instance, or per poll/select
/// call site): before its thread sleeps, it spins on the completion queues for the budget of
/// [`crate::StackConfig::adaptive_spin`]'s rules (started at the longest after a short
/// sleep, halved to nothing while the spin does not catch the news), so that a reply a few
/// µs away is taken without the two wake-ups of a sleep (the doorbell's and the thread's).
#[derive(Debug)]
pub struct LoopSpin(
    crate::stream::AdaptiveSpin,
    /// The last spin saw the peer take turns with it on its CPU ([`SpinBeacon`]): the next
    /// one yields at once instead of after a round of pauses the peer needs the CPU for.
    AtomicBool,
    /// The last spin ended early to sleep for a new placement ([`Reseat`]): the sleep after
    /// it says nothing about the budget.
    AtomicBool,
);

/// When a spinner that takes turns with its peer on one CPU last went to sleep on purpose, so
/// that the scheduler's wake-up places it anew (process-wide; µs since [`Reseat::epoch`]).
///
/// Two processes that spin and yield never sleep, so the scheduler never places them again:
/// once on one vCPU (as the start of a connection often leaves them), every message costs a
/// process switch there (sockperf 64 B: about 3 µs one way against 1 µs on two vCPUs), while
/// the load balancer leaves two tasks that each use half a CPU together even next to an idle
/// CPU. A sleep ends in a wake-up by the peer's doorbell, and a wake-up looks for an idle CPU
/// when the waker's is busy. So, at most once per [`Reseat::PERIOD`], a spin that sees its
/// peer on its own CPU ends and sleeps: on an idle CPU the two then run at once (the spin
/// keeps its CPU while the peer's word names another); with no idle CPU the wake-up leaves
/// it where it was, for one sleep's cost (about 10 µs) per period.
struct Reseat;

impl Reseat {
    /// At most one such sleep per process in this long.
    const PERIOD: std::time::Duration = std::time::Duration::from_millis(20);

    fn epoch() -> std::time::Instant {
        static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        *EPOCH.get_or_init(std::time::Instant::now)
    }

    /// Whether the spin should sleep now for a new placement (claims the period when so).
    fn due(now: std::time::Instant) -> bool {
        static LAST: AtomicU64 = AtomicU64::new(0);
        let at = u64::try_from(now.saturating_duration_since(Reseat::epoch()).as_micros())
            .unwrap_or(u64::MAX);
        let period = u64::try_from(Reseat::PERIOD.as_micros()).unwrap_or(u64::MAX);
        Reseat::claim(&LAST, at, period)
    }

    /// Whether a period of `period` µs has passed at `at` (µs) since the last claim in `last`
    /// (0: none yet; the first look only starts the period); claims it when so. One of several
    /// threads looking at once gets it.
    fn claim(last: &AtomicU64, at: u64, period: u64) -> bool {
        // +1: a claim at time 0 is not "none yet".
        let at = at.saturating_add(1);
        let seen = last.load(Ordering::Relaxed);
        if seen == 0 {
            let _ = last.compare_exchange(0, at, Ordering::Relaxed, Ordering::Relaxed);
            return false;
        }
        at.saturating_sub(seen) >= period
            && last
                .compare_exchange(seen, at, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }
}

impl LoopSpin {
    /// A spin with the longest budget of this process's stack (none without a stack).
    pub fn new() -> LoopSpin {
        LoopSpin::with_max(current_stack().and_then(|s| s.config().adaptive_spin))
    }

    /// A spin whose longest budget is `max` (`None`: never spins).
    pub(super) fn with_max(max: Option<std::time::Duration>) -> LoopSpin {
        // Starting at the longest: a loop's peer usually sleeps too, so the first replies
        // come a wake-up later (10-20 µs here), which a short first spin never catches.
        LoopSpin(
            crate::stream::AdaptiveSpin::with_start(max, max.unwrap_or_default()),
            AtomicBool::new(false),
            AtomicBool::new(false),
        )
    }

    /// How long to spin before the next sleep (`None`: sleep at once).
    pub fn budget(&self) -> Option<std::time::Duration> {
        self.0.budget()
    }

    /// The wait slept for `slept` after a spin of `spun` (zero: none) that found nothing.
    pub fn slept(&self, spun: std::time::Duration, slept: std::time::Duration) {
        // A spin that ended to sleep for a new placement did not fail: the budget stays.
        if !self.2.swap(false, Ordering::Relaxed) {
            self.0.slept(spun, slept);
        }
    }

    /// Spin until `until`: whenever a completion queue may hold something, handle it (as
    /// [`poll_before_wait`](super::poll_before_wait)) and ask `look` whether the loop has
    /// news now. Returns whether `look` said so; `false` when `until` passed first, or when
    /// the spin ends early to sleep for a new placement ([`Reseat`]). Only the connections'
    /// news is looked for: the loop's other descriptors wait for the sleep that follows (at
    /// most the budget later).
    pub fn spin(&self, until: std::time::Instant, mut look: impl FnMut() -> bool) -> bool {
        let Some(stack) = current_stack() else {
            return false;
        };
        let inner = &stack.inner;
        let mut wcs = [smc_fabric::WorkCompletion::EMPTY; 32];
        let mut beacon = SpinBeacon::new(self.1.load(Ordering::Relaxed));
        let found = loop {
            let mut hint = false;
            // With the peer on this CPU, pausing only keeps it from answering.
            let pauses = if beacon.here {
                1
            } else {
                crate::stream::SPINS_BETWEEN_LOOKS
            };
            for _ in 0..pauses {
                if inner.cqs.iter().any(|cq| cq.maybe_ready()) {
                    hint = true;
                    break;
                }
                std::hint::spin_loop();
            }
            if hint {
                // (Another thread that polls handles it and signals the connections.)
                if !inner.poller.load(Ordering::Acquire) {
                    loop_poll(inner, &mut wcs);
                }
                if look() {
                    break true;
                }
            }
            let now = std::time::Instant::now();
            if now >= until {
                break false;
            }
            if !hint && !beacon.round(&inner.cqs) {
                if beacon.here && Reseat::due(now) {
                    // Taking turns with the peer on this CPU: sleep once, so that the
                    // wake-up may place this thread on an idle CPU (`Reseat`).
                    self.2.store(true, Ordering::Relaxed);
                    break false;
                }
                // The peer may need this CPU to answer (both on one vCPU: spinning there
                // only delays the reply); a yield hands it over and costs no sleep. Unless
                // the peer is seen spinning on another CPU right now (`SpinBeacon`): a
                // yield every 2 or 4 rounds gave 1.0-1.6 µs when the two ran on two vCPUs
                // but 7-14 µs on one (sockperf 64 B p50), every round 5.3 µs always.
                std::thread::yield_now();
            }
        };
        beacon.stop(&inner.cqs);
        self.1.store(beacon.here, Ordering::Relaxed);
        found
    }
}

/// What a spinning event loop tells its peers through the shm fabric's spin words
/// ([`smc_fabric::CompletionQueue::spin_words`]), and what it learns from theirs: "I spin
/// on CPU `c`, round `r`" (`r << 16 | c + 1`; zero: not spinning).
///
/// A spinner keeps its CPU (no yield between rounds) only while a peer is seen spinning on
/// *another* CPU and its word moved within the last [`SpinBeacon::FRESH`] rounds: both then
/// run at once, and the reply is taken the moment it lands. When the peer's last word names
/// this CPU, or stopped moving (the peer sleeps, works, or waits for a CPU — possibly this
/// one), the spinner yields every round as before: two spinners on one vCPU would otherwise
/// hold the CPU from each other until the scheduler's tick. When the peer's moving word
/// names this CPU (the two take turns on it), a round is one look and a yield: its pauses
/// would only delay the peer's answer.
#[derive(Debug)]
struct SpinBeacon {
    round: u64,
    cpu: Option<u16>,
    /// The peers' words as last seen (summed), and for how many rounds they have not moved.
    seen: u64,
    still: u32,
    /// A peer's moving word names this CPU.
    here: bool,
}

impl SpinBeacon {
    /// Rounds (of `SPINS_BETWEEN_LOOKS` pauses each) without news from the peer after which
    /// it counts as not running.
    const FRESH: u32 = 2;

    /// `here`: what the last spin of this loop ended with.
    fn new(here: bool) -> SpinBeacon {
        SpinBeacon {
            round: 0,
            cpu: None,
            seen: 0,
            still: u32::MAX,
            here,
        }
    }

    /// The word for `cpu` in round `round`.
    fn word(cpu: u16, round: u64) -> u64 {
        (round << 16) | (u64::from(cpu) + 1)
    }

    /// The CPU a word names (`None`: not spinning).
    fn cpu_of(word: u64) -> Option<u16> {
        match (word & 0xFFFF) as u16 {
            0 => None,
            c => Some(c - 1),
        }
    }

    /// One round of the spin without news: publish this thread's word, read the peers'.
    /// Whether to keep the CPU (a peer spins on another CPU right now).
    fn round(&mut self, cqs: &[smc_fabric::CompletionQueue]) -> bool {
        // SAFETY: sched_getcpu has no preconditions (the vDSO or rseq answers it).
        let cpu = unsafe { libc::sched_getcpu() };
        let Ok(cpu) = u16::try_from(cpu).map(|c| c.min(0xFFFE)) else {
            return false;
        };
        self.cpu = Some(cpu);
        self.round = self.round.wrapping_add(1);
        let word = SpinBeacon::word(cpu, self.round);
        let (mut sum, mut elsewhere, mut here) = (0u64, false, false);
        for cq in cqs {
            cq.spin_words(word, &mut |w| {
                sum = sum.wrapping_add(w);
                match SpinBeacon::cpu_of(w) {
                    Some(c) if c == cpu => here = true,
                    Some(_) => elsewhere = true,
                    None => {}
                }
            });
        }
        if sum != self.seen {
            self.seen = sum;
            self.still = 0;
        } else {
            self.still = self.still.saturating_add(1);
        }
        let fresh = self.still < SpinBeacon::FRESH;
        self.here = here && fresh;
        elsewhere && !here && fresh
    }

    /// The spin ended: not spinning any more (only when a word was published).
    fn stop(&self, cqs: &[smc_fabric::CompletionQueue]) {
        if self.cpu.is_some() {
            for cq in cqs {
                cq.spin_words(0, &mut |_| {});
            }
        }
    }
}

impl Default for LoopSpin {
    fn default() -> LoopSpin {
        LoopSpin::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// The first look starts the period; a look within it is refused; the first look after
    /// it is granted and starts the next period; of two looks at once only one is granted.
    #[test]
    fn reseat_once_per_period() {
        let last = AtomicU64::new(0);
        assert!(
            !Reseat::claim(&last, 0, 100),
            "the first look only starts the period"
        );
        assert!(!Reseat::claim(&last, 50, 100));
        assert!(!Reseat::claim(&last, 98, 100));
        assert!(Reseat::claim(&last, 100, 100));
        assert!(
            !Reseat::claim(&last, 100, 100),
            "the period was claimed already"
        );
        assert!(!Reseat::claim(&last, 150, 100));
        assert!(Reseat::claim(&last, 260, 100));
        // A clock reading older than the claim (another thread's) is never due.
        assert!(!Reseat::claim(&last, 10, 100));
    }

    /// A sleep that followed a spin ended for a new placement leaves the budget alone; the
    /// same sleep after a spin that found nothing halves it.
    #[test]
    fn reseat_sleep_keeps_the_budget() {
        let max = Duration::from_micros(40);
        let spin = LoopSpin::with_max(Some(max));
        assert_eq!(spin.budget(), None, "no spin before the first short sleep");
        spin.slept(Duration::ZERO, Duration::from_micros(10));
        assert_eq!(
            spin.budget(),
            Some(max),
            "a short sleep starts at the longest"
        );
        spin.2.store(true, Ordering::Relaxed);
        spin.slept(Duration::from_micros(5), Duration::from_millis(1));
        assert_eq!(
            spin.budget(),
            Some(max),
            "a placement sleep is no failed spin"
        );
        assert!(
            !spin.2.load(Ordering::Relaxed),
            "the mark is taken by that sleep"
        );
        spin.slept(Duration::from_micros(5), Duration::from_millis(1));
        assert_eq!(
            spin.budget(),
            Some(max / 2),
            "a failed spin halves the budget"
        );
    }
}
