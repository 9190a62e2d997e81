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
//! [`QuietWake`] puts the calling thread under `SCHED_BATCH` for one sleep and back under
//! `SCHED_OTHER` after it, keeping its nice value. It leaves alone a thread under any other
//! policy (an application's real-time or idle thread). The wake-up latency it adds is at
//! most a scheduler slice, and only when no CPU is idle: for sleeps that wait for bulk data,
//! not for a reply.

/// `SCHED_BATCH` for the calling thread while this lives (see the module's text).
#[derive(Debug)]
pub struct QuietWake {
    /// The thread was under `SCHED_OTHER` and is under `SCHED_BATCH` now.
    switched: bool,
}

impl QuietWake {
    /// Put the calling thread under `SCHED_BATCH` if it is under `SCHED_OTHER`.
    pub fn begin() -> QuietWake {
        QuietWake {
            switched: policy() == Some(libc::SCHED_OTHER) && set_policy(libc::SCHED_BATCH),
        }
    }

    /// Whether the thread's policy was changed (and is restored at drop).
    pub fn switched(&self) -> bool {
        self.switched
    }
}

impl Drop for QuietWake {
    fn drop(&mut self) {
        if self.switched {
            set_policy(libc::SCHED_OTHER);
        }
    }
}

/// The calling thread's scheduling policy (`SCHED_RESET_ON_FORK` included when set).
fn policy() -> Option<libc::c_int> {
    // SAFETY: no arguments but the calling thread's id (0).
    let p = unsafe { libc::sched_getscheduler(0) };
    (p >= 0).then_some(p)
}

/// Set the calling thread's policy, priority 0 (the only one of the normal policies; the nice
/// value stays); whether it took.
fn set_policy(policy: libc::c_int) -> bool {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a live sched_param for the duration of the call; pid 0 is the calling
    // thread.
    unsafe { libc::sched_setscheduler(0, policy, &param) == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_normal_thread_is_batch_for_the_sleep_and_normal_after() {
        std::thread::spawn(|| {
            assert_eq!(policy(), Some(libc::SCHED_OTHER));
            {
                let q = QuietWake::begin();
                assert!(q.switched());
                assert_eq!(policy(), Some(libc::SCHED_BATCH));
            }
            assert_eq!(policy(), Some(libc::SCHED_OTHER));
        })
        .join()
        .expect("thread");
    }

    #[test]
    fn a_thread_under_another_policy_is_left_alone() {
        std::thread::spawn(|| {
            assert!(set_policy(libc::SCHED_IDLE));
            {
                let q = QuietWake::begin();
                assert!(!q.switched());
                assert_eq!(policy(), Some(libc::SCHED_IDLE));
            }
            assert_eq!(policy(), Some(libc::SCHED_IDLE));
        })
        .join()
        .expect("thread");
    }
}
