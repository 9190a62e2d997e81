//! A count of the waiters that may sleep on an event source (an eventfd that a producer
//! writes to announce a state change), so that the producer makes the wake-up system call
//! only while somebody may be asleep on it.
//!
//! The protocol is the ring doorbell's (`ring.rs`), a Dekker pair of SeqCst fences, with a
//! count in place of a flag (several waiters, each arming and disarming on its own):
//!
//! - waiter, before it sleeps: [`Sleepers::arm`] (count + 1, then a full fence), look at the
//!   state again, sleep only when it shows nothing; after the sleep (or instead of it)
//!   [`Sleepers::disarm`];
//! - producer, after the state change: [`Sleepers::any`] (a full fence, then the count) and
//!   the wake-up only when it says so.
//!
//! Either the waiter's look sees the change, or the producer's load sees the waiter's arm:
//! both fences are SeqCst, so they are ordered one way or the other, and whichever comes
//! second sees what was stored before the first. A waiter that stays watching for good (an
//! event source registered in a reactor that may sleep at any time) arms once and never
//! disarms. The count is private memory of one process: unlike the ring's flags, no peer
//! can write it.

use crate::sync::{fence, AtomicU32};
use std::sync::atomic::Ordering::{Relaxed, SeqCst};

/// The waiters that may be asleep on one event source now (see the module's text).
#[derive(Debug, Default)]
pub struct Sleepers(AtomicU32);

impl Sleepers {
    /// Nobody waits.
    pub fn new() -> Sleepers {
        Sleepers(AtomicU32::new(0))
    }

    /// One more waiter may sleep from now on. Call before the look at the state that decides
    /// the sleep (the look must follow the arm).
    pub fn arm(&self) {
        self.0.fetch_add(1, SeqCst);
        fence(SeqCst);
    }

    /// A waiter that [`arm`](Self::arm)ed is awake again (or will not sleep).
    pub fn disarm(&self) {
        // (Saturating: an unbalanced disarm leaves the count at zero rather than wrapping to
        // "always".)
        let _ = self
            .0
            .fetch_update(Relaxed, Relaxed, |n| Some(n.saturating_sub(1)));
    }

    /// After a state change: whether a waiter may be asleep, so that the wake-up is needed.
    pub fn any(&self) -> bool {
        fence(SeqCst);
        self.0.load(Relaxed) > 0
    }

    /// How many waiters are armed (for tests and statistics).
    pub fn count(&self) -> u32 {
        self.0.load(Relaxed)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn arms_count_and_disarms_saturate() {
        let s = Sleepers::new();
        assert!(!s.any());
        s.arm();
        s.arm();
        assert!(s.any());
        assert_eq!(s.count(), 2);
        s.disarm();
        assert!(s.any());
        s.disarm();
        assert!(!s.any());
        s.disarm();
        assert_eq!(s.count(), 0, "an extra disarm does not wrap");
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use crate::sync::AtomicU32;
    use loom::sync::Arc;

    /// The producer of both models: changes the state, then wakes (sets `woken`) only when
    /// [`Sleepers::any`].
    fn producer(
        state: &Arc<AtomicU32>,
        woken: &Arc<AtomicU32>,
        gate: &Arc<Sleepers>,
    ) -> loom::thread::JoinHandle<()> {
        let (state, woken, gate) = (state.clone(), woken.clone(), gate.clone());
        loom::thread::spawn(move || {
            state.store(1, Relaxed);
            if gate.any() {
                woken.store(1, Relaxed);
            }
        })
    }

    /// A producer changes the state (a relaxed store: the real state is behind a lock or
    /// anything weaker) and wakes only when [`Sleepers::any`]; a waiter arms, looks, and would
    /// sleep when it saw nothing. Every execution: a waiter that would sleep was woken.
    #[test]
    fn loom_sleepers_no_lost_wakeup() {
        loom::model(|| {
            let state = Arc::new(AtomicU32::new(0));
            let woken = Arc::new(AtomicU32::new(0));
            let gate = Arc::new(Sleepers::new());
            let producer = producer(&state, &woken, &gate);
            gate.arm();
            let saw = state.load(Relaxed);
            producer.join().unwrap();
            if saw == 0 {
                assert_eq!(
                    woken.load(Relaxed),
                    1,
                    "the waiter sleeps and nobody wakes it"
                );
            }
            gate.disarm();
        });
    }

    /// Two waiters: one arms, looks and disarms (it found news of its own) while the other is
    /// about to sleep; the producer still wakes the one that sleeps.
    #[test]
    fn loom_sleepers_two_waiters() {
        loom::model(|| {
            let state = Arc::new(AtomicU32::new(0));
            let woken = Arc::new(AtomicU32::new(0));
            let gate = Arc::new(Sleepers::new());
            let producer = producer(&state, &woken, &gate);
            let other = {
                let gate = gate.clone();
                loom::thread::spawn(move || {
                    gate.arm();
                    gate.disarm();
                })
            };
            gate.arm();
            let saw = state.load(Relaxed);
            producer.join().unwrap();
            other.join().unwrap();
            if saw == 0 {
                assert_eq!(woken.load(Relaxed), 1, "the sleeping waiter was not woken");
            }
        });
    }
}
