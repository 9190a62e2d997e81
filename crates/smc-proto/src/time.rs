//! Virtual time for the sans-IO engine.
//!
//! smc-proto never reads a clock. Every input that may start, stop or fire a timer takes a
//! [`Timestamp`]: a monotonic point in time expressed as a [`Duration`] since an epoch the caller
//! chooses (the runtime typically uses `Instant::now().duration_since(stack_start)`, the test
//! harness a virtual clock that starts at zero and jumps to the next deadline). Only differences
//! between timestamps matter, so any epoch works as long as one caller uses one epoch.

use core::fmt;
use core::ops::Add;
use std::time::Duration;

/// A monotonic point in time: the [`Duration`] elapsed since a caller-chosen epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Timestamp(Duration);

impl Timestamp {
    /// The epoch itself.
    pub const ZERO: Timestamp = Timestamp(Duration::ZERO);

    /// The point `since_epoch` after the epoch.
    pub const fn from_duration(since_epoch: Duration) -> Timestamp {
        Timestamp(since_epoch)
    }

    /// Time elapsed since the epoch.
    pub const fn as_duration(self) -> Duration {
        self.0
    }

    /// Time from `earlier` to `self`, zero if `earlier` is later.
    pub fn saturating_duration_since(self, earlier: Timestamp) -> Duration {
        self.0.saturating_sub(earlier.0)
    }
}

impl Add<Duration> for Timestamp {
    type Output = Timestamp;

    /// Saturates at the largest representable time instead of overflowing.
    fn add(self, rhs: Duration) -> Timestamp {
        Timestamp(self.0.checked_add(rhs).unwrap_or(Duration::MAX))
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "t+{:?}", self.0)
    }
}
