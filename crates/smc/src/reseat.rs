//! Getting the two ends of a local conversation off one CPU when another is free: the period
//! that bounds how often a process tries ([`due`]), shared by the shm event loop's spin
//! (`fdapi::spin::Reseat`, which sleeps on purpose so that a wake-up places it anew) and the
//! software RoCE read spin ([`move_to_idle_cpu`], which moves the thread itself).
//!
//! Why the two differ. Two shm spinners that take turns on one vCPU never sleep, so the
//! scheduler never places them again; a sleep of one of them is a new placement. A software
//! RoCE reader whose spin fails on one CPU already sleeps (`stream::AdaptiveSpin::catching`
//! holds its spin off), and every one of its wake-ups is a placement: the kernel wakes it on
//! the CPU it slept on (its peer's, busy) unless the wake-up's search for an idle CPU, which it
//! skips when the cache domain looks busy on average, finds one. So one more sleep changes
//! nothing there; what does is a move: the reader that finds its peer answered while it was
//! switched out (the peer ran on its CPU) and sees another CPU of its affinity mask idle over
//! the last [`MIN_WINDOW`] or more goes there (`sched_setaffinity` to that CPU, then its own
//! mask back). Its peer's next wake-up then finds its own CPU idle and stays there.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// At most one new placement per process in this long.
pub(crate) const PERIOD: Duration = Duration::from_millis(20);

/// The shortest window over which a CPU's idle time counts (`/proc/stat` counts in ticks of
/// 10 ms: ten of them).
const MIN_WINDOW: Duration = Duration::from_millis(100);

/// A sample older than this says nothing about now: a new window starts.
const MAX_WINDOW: Duration = Duration::from_secs(1);

/// A CPU idle for at least this share of the window (percent) counts as free.
const IDLE_PERCENT: u64 = 75;

fn epoch() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Whether the process may try a new placement now (claims the period when so).
pub(crate) fn due(now: Instant) -> bool {
    static LAST: AtomicU64 = AtomicU64::new(0);
    let at = u64::try_from(now.saturating_duration_since(epoch()).as_micros()).unwrap_or(u64::MAX);
    let period = u64::try_from(PERIOD.as_micros()).unwrap_or(u64::MAX);
    claim(&LAST, at, period)
}

/// Whether a period of `period` µs has passed at `at` (µs) since the last claim in `last` (0:
/// none yet; the first look only starts the period); claims it when so. One of several
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

/// Each CPU's idle time so far (idle and iowait, in ticks), from the text of `/proc/stat`.
fn idle_ticks(stat: &str) -> Vec<(usize, u64)> {
    stat.lines()
        .filter_map(|line| {
            let mut f = line.split_ascii_whitespace();
            let cpu = f.next()?.strip_prefix("cpu")?.parse::<usize>().ok()?;
            // user nice system idle iowait ...
            let mut f = f.skip(3);
            let idle = f.next()?.parse::<u64>().ok()?;
            let iowait = f.next().and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
            Some((cpu, idle.saturating_add(iowait)))
        })
        .collect()
}

/// The CPU to move to: of the CPUs `allowed` other than `here`, the one idle longest between
/// the samples `before` and `after`, `window` ticks apart, if idle for [`IDLE_PERCENT`] of it.
fn pick(
    before: &[(usize, u64)],
    after: &[(usize, u64)],
    window: u64,
    here: usize,
    allowed: impl Fn(usize) -> bool,
) -> Option<usize> {
    if window == 0 {
        return None;
    }
    after
        .iter()
        .filter(|(cpu, _)| *cpu != here && allowed(*cpu))
        .filter_map(|&(cpu, now)| {
            let then = before.iter().find(|(c, _)| *c == cpu)?.1;
            let idle = now.checked_sub(then)?;
            (idle.saturating_mul(100) >= window.saturating_mul(IDLE_PERCENT)).then_some((cpu, idle))
        })
        .max_by_key(|&(_, idle)| idle)
        .map(|(cpu, _)| cpu)
}

/// What the last look at `/proc/stat` saw (process-wide): when, and each CPU's idle ticks.
static SAMPLE: Mutex<Option<(Instant, Vec<(usize, u64)>)>> = Mutex::new(None);

/// Move the calling thread to a free CPU of its affinity mask, if one was idle over the last
/// window (see the module's text); at most once per [`PERIOD`] per process (a call within it
/// returns `false` at once). For a thread whose peer likely runs on its CPU. Returns whether
/// it moved. Its affinity mask is the same afterwards (a program that changes this thread's
/// mask from another thread at the same moment may see its change undone).
pub(crate) fn move_to_idle_cpu(now: Instant) -> bool {
    if !due(now) {
        return false;
    }
    let Ok(stat) = std::fs::read_to_string("/proc/stat") else {
        return false;
    };
    let after = idle_ticks(&stat);
    let before = {
        let mut sample = SAMPLE.lock().unwrap_or_else(|p| p.into_inner());
        match sample.take() {
            // Too young to tell: keep it.
            Some((at, idle)) if now.saturating_duration_since(at) < MIN_WINDOW => {
                *sample = Some((at, idle));
                return false;
            }
            Some((at, idle)) if now.saturating_duration_since(at) <= MAX_WINDOW => {
                *sample = Some((now, after.clone()));
                (now.saturating_duration_since(at), idle)
            }
            _ => {
                *sample = Some((now, after));
                return false;
            }
        }
    };
    // SAFETY: sysconf has no preconditions.
    let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).unwrap_or(100);
    let window = u64::try_from(before.0.as_millis())
        .unwrap_or(u64::MAX)
        .saturating_mul(hz)
        / 1000;
    let Ok(mask) = rustix::thread::sched_getaffinity(None) else {
        return false;
    };
    let here = rustix::thread::sched_getcpu();
    let Some(to) = pick(&before.1, &after, window, here, |c| {
        c < rustix::thread::CpuSet::MAX_CPU && mask.is_set(c)
    }) else {
        return false;
    };
    let mut only = rustix::thread::CpuSet::new();
    only.set(to);
    // Setting the mask to that CPU alone migrates this thread there at once; the thread stays
    // there when its own mask comes back (it includes the CPU).
    if rustix::thread::sched_setaffinity(None, &only).is_err() {
        return false;
    }
    let _ = rustix::thread::sched_setaffinity(None, &mask);
    // The window spanned the old placement: the next decision needs a new one.
    *SAMPLE.lock().unwrap_or_else(|p| p.into_inner()) = None;
    tracing::debug!(from = here, to, "moved to an idle CPU");
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first look starts the period; a look within it is refused; the first look after
    /// it is granted and starts the next period; of two looks at once only one is granted.
    #[test]
    fn once_per_period() {
        let last = AtomicU64::new(0);
        assert!(
            !claim(&last, 0, 100),
            "the first look only starts the period"
        );
        assert!(!claim(&last, 50, 100));
        assert!(!claim(&last, 98, 100));
        assert!(claim(&last, 100, 100));
        assert!(!claim(&last, 100, 100), "the period was claimed already");
        assert!(!claim(&last, 150, 100));
        assert!(claim(&last, 260, 100));
        // A clock reading older than the claim (another thread's) is never due.
        assert!(!claim(&last, 10, 100));
    }

    /// The per-CPU lines of `/proc/stat` give idle + iowait; the summary line and the others
    /// are skipped; a short or garbled line is skipped, not a panic.
    #[test]
    fn idle_ticks_from_proc_stat() {
        let stat = "cpu  100 0 50 900 10 0 0 0 0 0\n\
                    cpu0 50 0 25 400 5 0 0 0 0 0\n\
                    cpu1 50 0 25 500 5 0 0 0 0 0\n\
                    cpu2 1 2\n\
                    cpux 1 2 3 4 5\n\
                    cpu3 1 2 3 7\n\
                    intr 12345 0 1\n\
                    ctxt 999\n";
        assert_eq!(idle_ticks(stat), vec![(0, 405), (1, 505), (3, 7)]);
        assert!(idle_ticks("").is_empty());
    }

    /// Of the allowed CPUs other than this one, the one idle longest, if idle for most of the
    /// window; none when all others were busy, not allowed, or unknown before.
    #[test]
    fn pick_an_idle_cpu() {
        let before = [(0, 1000), (1, 2000), (2, 3000), (3, 4000)];
        // A window of 20 ticks: CPU 1 idle 19, CPU 2 idle 16, CPU 3 idle 5, CPU 0 (here) 20.
        let after = [(0, 1020), (1, 2019), (2, 3016), (3, 4005)];
        let all = |_| true;
        assert_eq!(pick(&before, &after, 20, 0, all), Some(1));
        assert_eq!(
            pick(&before, &after, 20, 0, |c| c != 1),
            Some(2),
            "CPU 1 is not in the mask"
        );
        assert_eq!(
            pick(&before, &after, 20, 0, |c| c == 3),
            None,
            "CPU 3 was busy for most of the window"
        );
        assert_eq!(
            pick(&before, &after, 20, 1, |c| c == 1),
            None,
            "this CPU is never a target"
        );
        assert_eq!(pick(&before, &after, 0, 0, all), None, "an empty window");
        assert_eq!(
            pick(&before[..1], &after, 20, 0, all),
            None,
            "CPUs not seen before have no window"
        );
        // A counter that went backwards (a CPU taken offline and back) is no idle time.
        assert_eq!(pick(&[(1, 5000)], &[(1, 10)], 20, 0, all), None);
    }
}
