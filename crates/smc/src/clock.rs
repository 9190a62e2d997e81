//! The endpoint's clock: the monotonic clock until quanta's TSC calibration is done, then the
//! TSC.
//!
//! A data-path message needs a reading or two, and at about 27 ns a reading `Instant::now`
//! costs as much as handling a CDC (docs/performance.md, session 5); quanta reads the TSC in
//! about 10. But quanta calibrates the TSC against the monotonic clock once per process,
//! spinning until the two agree, for up to 200 ms: on this VM in about one process start in
//! eight the agreement never came and the spin ran its full 200 ms (session 26, `smc nc`
//! connecting: 14–18 ms of CPU, and 175–218 ms in those starts). So the calibration runs on a
//! thread of its own, and the stack reads the monotonic clock until that thread installs the
//! calibrated clock, under the core's lock like every reading, so the readings stay ordered
//! across the switch.
//!
//! The calibrated clock is kept for the process ([`calibrated`]): a later stack installs it at
//! once. A process forked while a thread calibrated would inherit quanta's calibration as
//! begun and never finished (the child's clock thread would wait for it for good, its stacks
//! on the monotonic clock): `fdapi::fork_prepare` waits for a calibration under way
//! ([`settle_before_fork`]) — at most 200 ms, and only in a stack's first moments (a
//! pre-forking server makes its stack and then its workers).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The process's calibrated clock, once a thread calibrated it.
static TSC: OnceLock<quanta::Clock> = OnceLock::new();
/// Whether a thread is calibrating now.
static CALIBRATING: AtomicBool = AtomicBool::new(false);

/// The stack's time since its start.
pub(crate) struct EndpointClock {
    start: Instant,
    tsc: Option<Tsc>,
}

/// The calibrated clock and where its readings begin: `raw0` was read when the monotonic
/// clock read `base` since the start.
struct Tsc {
    clock: quanta::Clock,
    raw0: u64,
    base: Duration,
}

impl EndpointClock {
    /// A clock reading zero now, on the monotonic clock.
    pub(crate) fn new() -> EndpointClock {
        EndpointClock {
            start: Instant::now(),
            tsc: None,
        }
    }

    /// The time since the start.
    #[inline]
    pub(crate) fn now(&self) -> Duration {
        match &self.tsc {
            Some(t) => t.base + t.clock.delta(t.raw0, t.clock.raw()),
            None => self.start.elapsed(),
        }
    }

    /// Read `clock` (calibrated) from now on, continuing from the monotonic clock's reading.
    pub(crate) fn install(&mut self, clock: quanta::Clock) {
        let base = self.start.elapsed();
        let raw0 = clock.raw();
        self.tsc = Some(Tsc { clock, raw0, base });
    }

    /// Whether the calibrated clock is installed.
    #[cfg(test)]
    pub(crate) fn calibrated(&self) -> bool {
        self.tsc.is_some()
    }
}

/// quanta's clock, calibrated (the first call of the process spins until it is, up to 200 ms),
/// and kept for the process's later stacks ([`calibrated`]).
pub(crate) fn calibrated_tsc() -> quanta::Clock {
    TSC.get_or_init(|| {
        CALIBRATING.store(true, Ordering::Release);
        let c = quanta::Clock::new();
        CALIBRATING.store(false, Ordering::Release);
        c
    })
    .clone()
}

/// The process's calibrated clock, if a thread made it already.
pub(crate) fn calibrated() -> Option<quanta::Clock> {
    TSC.get().cloned()
}

/// Before a `fork()`: wait for a calibration under way, so that the child inherits it done.
pub(crate) fn settle_before_fork() {
    if CALIBRATING.load(Ordering::Acquire) {
        // Waits for the calibrating thread (the `OnceLock` and quanta's own cell both wait).
        let _ = calibrated_tsc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readings_go_on_across_the_switch_to_the_calibrated_clock() {
        let mut c = EndpointClock::new();
        std::thread::sleep(Duration::from_millis(2));
        let before = c.now();
        assert!(before >= Duration::from_millis(2));
        assert!(!c.calibrated());
        c.install(calibrated_tsc());
        assert!(c.calibrated());
        let after = c.now();
        assert!(after >= before, "{after:?} < {before:?}");
        // The two clocks agree: a reading after the switch lies between the monotonic
        // clock's readings taken around it (give or take the calibration's error, well under
        // a millisecond on this span).
        std::thread::sleep(Duration::from_millis(5));
        let m0 = c.start.elapsed();
        let t = c.now();
        let m1 = c.start.elapsed();
        let slack = Duration::from_millis(1);
        assert!(t + slack >= m0 && t <= m1 + slack, "{m0:?} {t:?} {m1:?}");
    }

    /// A stack starts on the monotonic clock and its clock thread installs the calibrated one.
    #[test]
    fn a_stacks_clock_thread_installs_the_calibrated_clock() {
        use crate::{DiscoveryMode, Stack, StackConfig};
        let dir = std::env::temp_dir().join(format!("smc-clock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("fabric dir");
        let mut c = StackConfig::new(smc_fabric::FabricConfig::with_dir(&dir, 1));
        c.discovery = DiscoveryMode::AssertPeer;
        let stack = Stack::new(c).expect("stack");
        let end = Instant::now() + Duration::from_secs(10);
        while !stack.inner.lock().clock.calibrated() && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert!(
            stack.inner.lock().clock.calibrated(),
            "no calibrated clock after 10 s"
        );
        let a = stack.inner.lock().now();
        let b = stack.inner.lock().now();
        assert!(b >= a);
        drop(stack);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
