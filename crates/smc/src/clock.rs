//! The endpoint's clock: the monotonic clock until the stack has measured the TSC's rate
//! against it, then the TSC.
//!
//! A data-path message needs a reading or two, and at about 27 ns a reading `Instant::now`
//! costs as much as handling a CDC (docs/performance.md, session 5); the TSC reads in about 10.
//! Its rate is measured once per process, off the program's path, by the stack's runtime
//! thread, a step at each of its looks ([`Measurement`]): a pair of readings (the TSC
//! bracketed by two monotonic readings, the tightest of a few) when the stack starts, and
//! another once 20 ms have passed — a few microseconds of CPU, no thread or sleep of its own.
//! (quanta, used before, spins until its estimate settles, up to 200 ms; on this VM about one
//! start in eight spun the full 200 ms, and on a thread beside the program that spin took
//! the CPU from a stream's first fifth of a second: docs/performance.md, session 27.) The stack
//! reads the monotonic clock until the runtime installs the TSC clock, under the core's lock
//! like every reading, continuing from the monotonic reading, so the readings stay ordered
//! across the switch.
//!
//! The TSC is used only where the kernel itself keeps time with it (`current_clocksource` is
//! `tsc`): the kernel has then checked that it runs at a constant rate and in step on every CPU
//! (the vDSO's `clock_gettime` reads it the same way). Elsewhere, or where that file cannot be
//! read, the stack stays on the monotonic clock.
//!
//! The measured rate is kept for the process ([`measured`]): a later stack installs it at once.
//! Nothing here blocks, so a process forked during a measurement cannot inherit a lock held for
//! good; `fdapi::fork_prepare` still waits for measurements under way ([`settle_before_fork`],
//! at most 200 ms, and only in a stack's first moments), so that a pre-forked worker's stack
//! starts with the rate known.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The TSC's rate as measured for the process: nanoseconds per tick in 32.32 fixed point. 0:
/// not measured yet; [`UNUSABLE`]: the TSC is not to be used here.
static SCALE: AtomicU64 = AtomicU64::new(0);
const UNUSABLE: u64 = u64::MAX;
/// How many threads are measuring now (the stacks made before the first measurement ends
/// measure each).
static CALIBRATING: AtomicUsize = AtomicUsize::new(0);

/// How long apart the two pairs of readings are taken.
const SPAN: Duration = Duration::from_millis(20);
/// Readings per pair; the tightest bracket is kept.
const TRIES: usize = 5;
/// A pair whose monotonic readings lie further apart than this (the thread was preempted in
/// every try) is taken again after another span.
const WIDEST: Duration = Duration::from_micros(20);
/// Attempts at a measurement before the process gives up on the TSC.
const ATTEMPTS: usize = 5;

/// The TSC's rate: nanoseconds per tick in 32.32 fixed point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TscScale {
    mult: u64,
}

impl TscScale {
    /// Nanoseconds in `ticks` ticks.
    #[inline]
    fn ns(self, ticks: u64) -> u64 {
        let ns = (u128::from(ticks) * u128::from(self.mult)) >> 32;
        u64::try_from(ns).unwrap_or(u64::MAX)
    }

    /// The rate of `ticks` ticks in `ns` nanoseconds, if it is one of a TSC (50 MHz to 20 GHz).
    fn from_span(ns: u64, ticks: u64) -> Option<TscScale> {
        if ticks == 0 {
            return None;
        }
        let mult = u64::try_from((u128::from(ns) << 32) / u128::from(ticks)).ok()?;
        // 0.05 to 20 ns per tick.
        ((1u64 << 32) / 20..=20u64 << 32)
            .contains(&mult)
            .then_some(TscScale { mult })
    }
}

/// The time-stamp counter.
#[cfg(target_arch = "x86_64")]
#[inline]
fn rdtsc() -> u64 {
    // SAFETY: RDTSC exists on every x86_64 CPU and only reads the counter.
    unsafe { core::arch::x86_64::_rdtsc() }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn rdtsc() -> u64 {
    0
}

/// Whether the kernel keeps time with the TSC (see the module's text).
fn tsc_usable() -> bool {
    cfg!(target_arch = "x86_64")
        && std::fs::read_to_string(
            "/sys/devices/system/clocksource/clocksource0/current_clocksource",
        )
        .is_ok_and(|s| s.trim() == "tsc")
}

/// A TSC reading and the monotonic time it was taken at (the middle of the tightest of
/// [`TRIES`] brackets), with that bracket's width.
fn pair() -> (Instant, u64, Duration) {
    let mut best: Option<(Instant, u64, Duration)> = None;
    for _ in 0..TRIES {
        let a = Instant::now();
        let t = rdtsc();
        let b = Instant::now();
        let w = b.duration_since(a);
        if best.is_none_or(|(_, _, bw)| w < bw) {
            best = Some((a + w / 2, t, w));
        }
    }
    best.unwrap_or_else(|| (Instant::now(), rdtsc(), Duration::MAX))
}

/// A measurement of the TSC's rate under way, taken a step at a time by a thread that wakes
/// often anyway (the stack's runtime thread): no thread of its own, no sleep of its own.
pub(crate) struct Measurement {
    /// The first pair of readings (see [`pair`]) and how many attempts were made.
    first: (Instant, u64, Duration),
    attempts: usize,
}

impl Measurement {
    /// A measurement for a stack, unless the process has one (or needs none): then `None`.
    pub(crate) fn start() -> Option<Measurement> {
        if measured().is_some() {
            return None;
        }
        if !tsc_usable() {
            let _ = SCALE.compare_exchange(0, UNUSABLE, Ordering::AcqRel, Ordering::Acquire);
            tracing::debug!("the TSC is not used: the monotonic clock stays");
            return None;
        }
        CALIBRATING.fetch_add(1, Ordering::AcqRel);
        Some(Measurement {
            first: pair(),
            attempts: 0,
        })
    }

    /// Take the second pair once [`SPAN`] has passed since the first. `None`: not done yet.
    /// `Some(rate)`: done — the process's rate (or none, given up), to install.
    pub(crate) fn step(&mut self) -> Option<Option<TscScale>> {
        if let Some(m) = measured() {
            // Another stack's measurement ended first.
            return Some(self.finish(m));
        }
        let (m0, t0, w0) = self.first;
        if m0.elapsed() < SPAN {
            return None;
        }
        let (m1, t1, w1) = pair();
        if w0 > WIDEST || w1 > WIDEST {
            self.attempts += 1;
            if self.attempts >= ATTEMPTS {
                return Some(self.finish(None));
            }
            self.first = (m1, t1, w1);
            return None;
        }
        let ns = u64::try_from(m1.duration_since(m0).as_nanos()).unwrap_or(u64::MAX);
        let m = TscScale::from_span(ns, t1.wrapping_sub(t0));
        match m {
            Some(s) => tracing::debug!(
                mhz = (1u64 << 32) as f64 / s.mult as f64 * 1e3,
                "the TSC's rate measured"
            ),
            None => tracing::debug!("the TSC is not used: the monotonic clock stays"),
        }
        Some(self.finish(m))
    }

    /// Publish `m` for the process (the first measurement to end is the process's) and
    /// return the process's rate.
    fn finish(&mut self, m: Option<TscScale>) -> Option<TscScale> {
        let v = m.map_or(UNUSABLE, |s| s.mult);
        let _ = SCALE.compare_exchange(0, v, Ordering::AcqRel, Ordering::Acquire);
        measured().flatten()
    }
}

impl Drop for Measurement {
    fn drop(&mut self) {
        CALIBRATING.fetch_sub(1, Ordering::AcqRel);
    }
}

/// `Some(rate or None)` once the process has measured (or given up on) the TSC — a later
/// stack installs it at once; `None` before.
pub(crate) fn measured() -> Option<Option<TscScale>> {
    match SCALE.load(Ordering::Acquire) {
        0 => None,
        UNUSABLE => Some(None),
        mult => Some(Some(TscScale { mult })),
    }
}

/// Before a `fork()`: wait (sleeping, at most 200 ms) for a measurement under way, so that a
/// child's stacks start with the rate known.
pub(crate) fn settle_before_fork() {
    let end = Instant::now() + Duration::from_millis(200);
    while CALIBRATING.load(Ordering::Acquire) > 0 && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The stack's time since its start.
pub(crate) struct EndpointClock {
    start: Instant,
    tsc: Option<Tsc>,
}

/// The TSC's rate and where its readings begin: `raw0` was read when the monotonic clock read
/// `base` since the start.
struct Tsc {
    scale: TscScale,
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
            Some(t) => t.base + Duration::from_nanos(t.scale.ns(rdtsc().saturating_sub(t.raw0))),
            None => self.start.elapsed(),
        }
    }

    /// Read the TSC at `scale` from now on, continuing from the monotonic clock's reading.
    pub(crate) fn install(&mut self, scale: TscScale) {
        let base = self.start.elapsed();
        let raw0 = rdtsc();
        self.tsc = Some(Tsc { scale, raw0, base });
    }

    /// Whether the TSC clock is installed.
    #[cfg(test)]
    pub(crate) fn calibrated(&self) -> bool {
        self.tsc.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scales_convert_ticks_and_refuse_rates_no_tsc_has() {
        // 2.5 GHz: 0.4 ns per tick.
        let s = TscScale::from_span(1_000_000_000, 2_500_000_000).expect("2.5 GHz");
        assert!((s.ns(2_500_000_000) as i64 - 1_000_000_000).abs() <= 1);
        assert_eq!(s.ns(0), 0);
        // A long uptime's worth of ticks does not overflow.
        assert!(s.ns(u64::MAX) > 1 << 62);
        // 1 GHz exactly.
        let g = TscScale::from_span(1000, 1000).expect("1 GHz");
        assert_eq!(g.ns(123_456), 123_456);
        // No ticks, or a rate outside 50 MHz to 20 GHz: not a TSC's.
        assert_eq!(TscScale::from_span(1000, 0), None);
        assert_eq!(TscScale::from_span(1_000_000, 10), None);
        assert_eq!(TscScale::from_span(10, 1_000_000), None);
    }

    #[test]
    fn readings_go_on_across_the_switch_to_the_tsc() {
        // The process's rate, as a runtime thread measures it: a step now and then.
        if let Some(mut m) = Measurement::start() {
            while m.step().is_none() {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        let Some(Some(scale)) = measured() else {
            // Not on a TSC the kernel keeps time with: nothing to switch to.
            assert!(!tsc_usable() || measured() == Some(None));
            return;
        };
        let mut c = EndpointClock::new();
        std::thread::sleep(Duration::from_millis(2));
        let before = c.now();
        assert!(before >= Duration::from_millis(2));
        assert!(!c.calibrated());
        c.install(scale);
        assert!(c.calibrated());
        let after = c.now();
        assert!(after >= before, "{after:?} < {before:?}");
        // The two clocks agree: a reading after the switch lies between the monotonic
        // clock's readings taken around it, give or take the measurement's error (parts per
        // million; a millisecond is ample on this span).
        std::thread::sleep(Duration::from_millis(50));
        let m0 = c.start.elapsed();
        let t = c.now();
        let m1 = c.start.elapsed();
        let slack = Duration::from_millis(1);
        assert!(t + slack >= m0 && t <= m1 + slack, "{m0:?} {t:?} {m1:?}");
    }

    /// A stack starts on the monotonic clock and its runtime thread installs the TSC clock
    /// where the kernel keeps time with the TSC.
    #[test]
    fn a_stacks_runtime_installs_the_tsc_clock() {
        use crate::{DiscoveryMode, Stack, StackConfig};
        let dir = std::env::temp_dir().join(format!("smc-clock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("fabric dir");
        let mut c = StackConfig::new(smc_fabric::FabricConfig::with_dir(&dir, 1));
        c.discovery = DiscoveryMode::AssertPeer;
        let stack = Stack::new(c).expect("stack");
        let want = tsc_usable();
        let end = Instant::now() + Duration::from_secs(10);
        while stack.inner.lock().clock.calibrated() != want && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(
            stack.inner.lock().clock.calibrated(),
            want,
            "the kernel's clocksource is{} the TSC",
            if want { "" } else { " not" }
        );
        let a = stack.inner.lock().now();
        let b = stack.inner.lock().now();
        assert!(b >= a);
        drop(stack);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
