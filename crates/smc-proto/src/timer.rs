//! One timer table per protocol object: an enum of timer kinds mapped to deadlines.
//!
//! `poll_timeout` is derived from the table ([`TimerTable::next_deadline`]) and never kept by
//! hand, so a timer cannot be armed without being reported to the runtime.

use core::fmt;
use core::marker::PhantomData;

use crate::time::Timestamp;

/// A kind of timer of one protocol object (an enum with a dense index).
pub trait TimerKind: Copy + Eq + fmt::Debug + 'static {
    /// Every kind, in index order.
    const ALL: &'static [Self];
    /// The dense index of this kind, below `ALL.len()`.
    fn index(self) -> usize;
}

/// Deadlines of up to `N` timer kinds `K` (`N` must equal `K::ALL.len()`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimerTable<K: TimerKind, const N: usize> {
    deadlines: [Option<Timestamp>; N],
    _kind: PhantomData<K>,
}

impl<K: TimerKind, const N: usize> Default for TimerTable<K, N> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: TimerKind, const N: usize> TimerTable<K, N> {
    /// A table with no timer armed.
    pub const fn new() -> Self {
        TimerTable {
            deadlines: [None; N],
            _kind: PhantomData,
        }
    }

    /// Arm (or re-arm) `kind` to fire at `deadline`.
    pub fn set(&mut self, kind: K, deadline: Timestamp) {
        if let Some(slot) = self.deadlines.get_mut(kind.index()) {
            *slot = Some(deadline);
        }
    }

    /// Disarm `kind`.
    pub fn stop(&mut self, kind: K) {
        if let Some(slot) = self.deadlines.get_mut(kind.index()) {
            *slot = None;
        }
    }

    /// Disarm every timer.
    pub fn stop_all(&mut self) {
        self.deadlines = [None; N];
    }

    /// The deadline of `kind`, if armed.
    pub fn get(&self, kind: K) -> Option<Timestamp> {
        self.deadlines.get(kind.index()).copied().flatten()
    }

    /// Whether `kind` is armed.
    pub fn is_set(&self, kind: K) -> bool {
        self.get(kind).is_some()
    }

    /// The earliest armed deadline.
    pub fn next_deadline(&self) -> Option<Timestamp> {
        self.deadlines.iter().flatten().min().copied()
    }

    /// Disarm and return the earliest timer whose deadline is at or before `now`.
    pub fn pop_expired(&mut self, now: Timestamp) -> Option<K> {
        let kind = K::ALL
            .iter()
            .copied()
            .filter(|k| self.get(*k).is_some_and(|d| d <= now))
            .min_by_key(|k| self.get(*k))?;
        self.stop(kind);
        Some(kind)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum K {
        X,
        Y,
    }

    impl TimerKind for K {
        const ALL: &'static [K] = &[K::X, K::Y];
        fn index(self) -> usize {
            self as usize
        }
    }

    #[test]
    fn earliest_deadline_first() {
        let t = |ms| Timestamp::from_duration(Duration::from_millis(ms));
        let mut table: TimerTable<K, 2> = TimerTable::new();
        assert_eq!(table.next_deadline(), None);
        table.set(K::X, t(20));
        table.set(K::Y, t(10));
        assert_eq!(table.next_deadline(), Some(t(10)));
        assert_eq!(table.pop_expired(t(5)), None);
        assert_eq!(table.pop_expired(t(30)), Some(K::Y));
        assert_eq!(table.pop_expired(t(30)), Some(K::X));
        assert_eq!(table.pop_expired(t(30)), None);
        table.set(K::X, t(1));
        table.stop(K::X);
        assert!(!table.is_set(K::X));
    }
}
