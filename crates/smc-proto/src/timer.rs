//! One timer table per protocol object: an enum of timer kinds mapped to deadlines.
//!
//! `poll_timeout` is derived from the table ([`TimerTable::next_deadline`]) and never kept by
//! hand, so a timer cannot be armed without being reported to the runtime.
//!
//! [`DeadlineMap`] keeps many such objects (an endpoint's connections) indexed by their
//! earliest deadline, so that the endpoint's `poll_timeout` and the objects due at a time are
//! found without visiting every object.

use core::fmt;
use core::marker::PhantomData;
use std::collections::{BTreeMap, BTreeSet};

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

/// An object with timers: its earliest deadline is a function of its state alone.
pub trait HasDeadline {
    /// The earliest armed deadline.
    fn deadline(&self) -> Option<Timestamp>;
}

/// A map of objects with timers, indexed by their earliest deadlines.
///
/// Objects change only through [`get_mut`](Self::get_mut), [`insert`](Self::insert) and
/// [`remove`](Self::remove). The object last handed out mutably is *stale* (its deadline may
/// have changed while it was borrowed); the next mutable access, which can only begin once
/// that borrow has ended, indexes it again, and [`next_deadline`](Self::next_deadline) asks
/// it directly meanwhile. So the index can never miss a timer, whatever the caller changed,
/// and each access costs O(log n) rather than a visit of every object.
#[derive(Debug, Clone)]
pub struct DeadlineMap<K, V> {
    slots: BTreeMap<K, Slot<V>>,
    /// `(deadline, key)` of every object with a deadline, as last indexed.
    by_deadline: BTreeSet<(Timestamp, K)>,
    /// The key last handed out mutably, not indexed since.
    stale: Option<K>,
}

#[derive(Debug, Clone)]
struct Slot<V> {
    value: V,
    /// The deadline under which `by_deadline` holds this object.
    indexed: Option<Timestamp>,
}

impl<K: Ord + Copy, V: HasDeadline> Default for DeadlineMap<K, V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Ord + Copy, V: HasDeadline> DeadlineMap<K, V> {
    /// An empty map.
    pub fn new() -> Self {
        DeadlineMap {
            slots: BTreeMap::new(),
            by_deadline: BTreeSet::new(),
            stale: None,
        }
    }

    /// The number of objects.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether the map is empty.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The object of `key`.
    pub fn get(&self, key: &K) -> Option<&V> {
        self.slots.get(key).map(|s| &s.value)
    }

    /// Whether `key` has an object.
    pub fn contains_key(&self, key: &K) -> bool {
        self.slots.contains_key(key)
    }

    /// Every object, in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.slots.iter().map(|(k, s)| (k, &s.value))
    }

    /// The object of `key`, to change (its deadline is indexed again on the next mutable
    /// access).
    pub fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        self.reindex();
        let slot = self.slots.get_mut(key)?;
        self.stale = Some(*key);
        Some(&mut slot.value)
    }

    /// Put `value` under `key`; the object it replaces, if any.
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        let old = self.remove(&key);
        let indexed = value.deadline();
        if let Some(d) = indexed {
            self.by_deadline.insert((d, key));
        }
        self.slots.insert(key, Slot { value, indexed });
        old
    }

    /// Take the object of `key` out.
    pub fn remove(&mut self, key: &K) -> Option<V> {
        self.reindex();
        let slot = self.slots.remove(key)?;
        if let Some(d) = slot.indexed {
            self.by_deadline.remove(&(d, *key));
        }
        Some(slot.value)
    }

    /// The earliest deadline of every object.
    pub fn next_deadline(&self) -> Option<Timestamp> {
        let stale = self.stale;
        let indexed = self
            .by_deadline
            .iter()
            .find(|(_, k)| Some(*k) != stale)
            .map(|(d, _)| *d);
        let current = stale
            .and_then(|k| self.slots.get(&k))
            .and_then(|s| s.value.deadline());
        indexed.into_iter().chain(current).min()
    }

    /// The keys of the objects with a deadline at or before `now`, in key order.
    pub fn due(&mut self, now: Timestamp) -> Vec<K> {
        self.reindex();
        let mut due: Vec<K> = self
            .by_deadline
            .iter()
            .take_while(|(d, _)| *d <= now)
            .map(|(_, k)| *k)
            .collect();
        due.sort_unstable();
        due
    }

    /// Index the stale object under its deadline now.
    fn reindex(&mut self) {
        let Some(key) = self.stale.take() else {
            return;
        };
        let Some(slot) = self.slots.get_mut(&key) else {
            return;
        };
        let now = slot.value.deadline();
        if now == slot.indexed {
            return;
        }
        if let Some(d) = slot.indexed {
            self.by_deadline.remove(&(d, key));
        }
        if let Some(d) = now {
            self.by_deadline.insert((d, key));
        }
        slot.indexed = now;
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

    /// An object whose deadline is whatever the test set.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct Obj(Option<Timestamp>);

    impl HasDeadline for Obj {
        fn deadline(&self) -> Option<Timestamp> {
            self.0
        }
    }

    fn ms(ms: u64) -> Timestamp {
        Timestamp::from_duration(Duration::from_millis(ms))
    }

    #[test]
    fn deadline_map_follows_changes_made_through_get_mut() {
        let mut m: DeadlineMap<u32, Obj> = DeadlineMap::new();
        assert_eq!(m.next_deadline(), None);
        m.insert(1, Obj(Some(ms(30))));
        m.insert(2, Obj(None));
        m.insert(3, Obj(Some(ms(20))));
        assert_eq!(m.next_deadline(), Some(ms(20)));
        // Changed while borrowed: seen at once, before any other access.
        m.get_mut(&3).expect("3").0 = Some(ms(40));
        assert_eq!(m.next_deadline(), Some(ms(30)));
        m.get_mut(&2).expect("2").0 = Some(ms(5));
        assert_eq!(m.next_deadline(), Some(ms(5)));
        assert_eq!(m.due(ms(30)), vec![1, 2]);
        m.get_mut(&2).expect("2").0 = None;
        assert_eq!(m.due(ms(100)), vec![1, 3]);
        assert_eq!(m.remove(&1), Some(Obj(Some(ms(30)))));
        assert_eq!(m.next_deadline(), Some(ms(40)));
        // Replacing an object replaces its deadline.
        assert_eq!(m.insert(3, Obj(None)), Some(Obj(Some(ms(40)))));
        assert_eq!(m.next_deadline(), None);
        assert_eq!(m.len(), 2);
        assert!(m.get_mut(&9).is_none());
        assert_eq!(m.due(ms(1000)), Vec::<u32>::new());
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u8, Option<u16>),
        Set(u8, Option<u16>),
        Remove(u8),
        Due(u16),
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        let t = proptest::option::of(0u16..500);
        prop_oneof![
            (0u8..16, t.clone()).prop_map(|(k, t)| Op::Insert(k, t)),
            (0u8..16, t).prop_map(|(k, t)| Op::Set(k, t)),
            (0u8..16).prop_map(Op::Remove),
            (0u16..500).prop_map(Op::Due),
        ]
    }

    proptest::proptest! {
        /// Whatever the order of changes, the map answers as a scan of every object would.
        #[test]
        fn deadline_map_answers_as_a_scan_would(ops in proptest::collection::vec(op(), 0..200)) {
            let t = |v: Option<u16>| v.map(|v| ms(u64::from(v)));
            let mut m: DeadlineMap<u8, Obj> = DeadlineMap::new();
            let mut model: BTreeMap<u8, Obj> = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Insert(k, d) => {
                        proptest::prop_assert_eq!(m.insert(k, Obj(t(d))), model.insert(k, Obj(t(d))));
                    }
                    Op::Set(k, d) => {
                        if let Some(o) = m.get_mut(&k) {
                            o.0 = t(d);
                        }
                        if let Some(o) = model.get_mut(&k) {
                            o.0 = t(d);
                        }
                    }
                    Op::Remove(k) => proptest::prop_assert_eq!(m.remove(&k), model.remove(&k)),
                    Op::Due(at) => {
                        let want: Vec<u8> = model
                            .iter()
                            .filter(|(_, o)| o.0.is_some_and(|d| d <= ms(u64::from(at))))
                            .map(|(k, _)| *k)
                            .collect();
                        proptest::prop_assert_eq!(m.due(ms(u64::from(at))), want);
                    }
                }
                let want = model.values().filter_map(|o| o.0).min();
                proptest::prop_assert_eq!(m.next_deadline(), want);
                proptest::prop_assert_eq!(m.len(), model.len());
            }
        }
    }
}
