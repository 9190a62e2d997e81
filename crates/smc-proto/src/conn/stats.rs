//! Plain `Copy` counters of one connection.

use crate::conn::error::AbortReason;

/// How often each [`AbortReason`] ended a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AbortCounts {
    counts: [u64; AbortReason::ALL.len()],
}

impl AbortCounts {
    /// The count for `reason`.
    pub fn get(&self, reason: AbortReason) -> u64 {
        AbortReason::ALL
            .iter()
            .position(|r| *r == reason)
            .and_then(|i| self.counts.get(i))
            .copied()
            .unwrap_or(0)
    }

    /// Add one to `reason`.
    pub fn add(&mut self, reason: AbortReason) {
        if let Some(i) = AbortReason::ALL.iter().position(|r| *r == reason) {
            if let Some(c) = self.counts.get_mut(i) {
                *c += 1;
            }
        }
    }

    /// Sum over all reasons.
    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Every reason with a non-zero count.
    pub fn nonzero(&self) -> impl Iterator<Item = (AbortReason, u64)> + '_ {
        AbortReason::ALL
            .iter()
            .zip(self.counts.iter())
            .filter(|(_, c)| **c > 0)
            .map(|(r, c)| (*r, *c))
    }
}

/// Counters of one connection, returned by value from `Connection::stats`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ConnStats {
    /// CDC messages handed to the fabric.
    pub cdc_sent: u64,
    /// CDC messages sent only to update the consumer cursor (§4.5.1 window updates).
    pub window_updates_sent: u64,
    /// CDC messages received.
    pub cdc_received: u64,
    /// Failover data validation CDCs (F flag) received (RFC 7609 §4.6.1).
    pub failover_validations: u64,
    /// Failover validations that found SR behind SS and waited for the missing CDC (still
    /// queued on the failed link) instead of resetting at once.
    pub failover_validations_held: u64,
    /// Closes completed by the peer reusing the RMBE (§4.4.2) after we had closed and it had
    /// consumed everything: its closing CDC was still on the way. Not an abort.
    pub closed_by_rmbe_reuse: u64,
    /// Received CDCs ignored because their sequence number was not newer than the last one.
    pub cdc_stale: u64,
    /// Received CDCs ignored because they carried another connection's alert token.
    pub cdc_wrong_token: u64,
    /// Received CDCs ignored for other reasons (after Closed, during an abort, failover
    /// validation messages which belong to the link layer).
    pub cdc_ignored: u64,
    /// Bytes we reported produced into the peer RMBE.
    pub bytes_produced: u64,
    /// Bytes the peer produced into our RMBE.
    pub bytes_received: u64,
    /// Bytes the application consumed.
    pub bytes_consumed: u64,
    /// Bytes consumed on the application's behalf and dropped (after shutdown(RD) or close).
    pub bytes_discarded: u64,
    /// CDCs sent with the writer-blocked flag newly set.
    pub write_blocked_signals: u64,
    /// Abnormal terminations by reason.
    pub aborts: AbortCounts,
}
