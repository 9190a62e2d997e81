//! Errors of a connection: why it failed (what the application sees) and API misuse.

use crate::conn::state::State;

/// Why a connection was terminated abnormally. Every reason is counted in
/// [`ConnStats::aborts`](crate::conn::ConnStats::aborts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AbortReason {
    /// Peer CDC: producer cursor outside our RMBE's data area.
    ProducerOutOfBounds,
    /// Peer CDC: consumer cursor outside the peer RMBE's data area.
    ConsumerOutOfBounds,
    /// Peer CDC: producer cursor moved backwards.
    ProducerBackwards,
    /// Peer CDC: producer cursor claims more unread data than our RMBE holds (it wrote past
    /// our consumer cursor).
    ProducerOverrun,
    /// Peer CDC: consumer cursor moved backwards.
    ConsumerBackwards,
    /// Peer CDC: consumer cursor claims data we never produced.
    ConsumerAhead,
    /// Peer CDC: the producer cursor moved after the peer said it was done writing.
    DataAfterDone,
    /// Our RMBE's eye catcher was overwritten (RFC 7609 §4.4.1).
    EyeCatcherOverwritten,
    /// The application closed with unread data in the RMBE (RFC 7609 §4.8.1 3A).
    UnreadDataOnClose,
    /// The peer closed while we still had data to write (RFC 7609 §4.8.1 4A).
    PeerClosedWithPendingData,
    /// The application asked for an abortive close (e.g. SO_LINGER 0).
    ApplicationAbort,
    /// A TCP RST arrived on the connection's TCP socket (RFC 7609 §4.8.2).
    TcpReset,
    /// The peer sent PeerConnAbort.
    PeerAbort,
    /// The peer presented this connection's RMBE for another connection (§4.4.2).
    RmbeConflict,
    /// A termination timer expired (PeerCloseWait1/2, PeerFinCloseWait).
    CloseTimeout,
    /// The connection's link group lost its last link or was terminated (RFC 7609 §2.3).
    LinkGroupLost,
    /// A failover validation CDC showed that data was lost (RFC 7609 §4.6.1: SR < SS).
    FailoverDataLoss,
}

impl AbortReason {
    /// Every reason, in counter order.
    pub const ALL: [AbortReason; 17] = [
        AbortReason::ProducerOutOfBounds,
        AbortReason::ConsumerOutOfBounds,
        AbortReason::ProducerBackwards,
        AbortReason::ProducerOverrun,
        AbortReason::ConsumerBackwards,
        AbortReason::ConsumerAhead,
        AbortReason::DataAfterDone,
        AbortReason::EyeCatcherOverwritten,
        AbortReason::UnreadDataOnClose,
        AbortReason::PeerClosedWithPendingData,
        AbortReason::ApplicationAbort,
        AbortReason::TcpReset,
        AbortReason::PeerAbort,
        AbortReason::RmbeConflict,
        AbortReason::CloseTimeout,
        AbortReason::LinkGroupLost,
        AbortReason::FailoverDataLoss,
    ];

    /// Whether the peer misbehaved (malformed or inconsistent CDC): a protocol violation.
    pub fn is_protocol_violation(self) -> bool {
        matches!(
            self,
            AbortReason::ProducerOutOfBounds
                | AbortReason::ConsumerOutOfBounds
                | AbortReason::ProducerBackwards
                | AbortReason::ProducerOverrun
                | AbortReason::ConsumerBackwards
                | AbortReason::ConsumerAhead
                | AbortReason::DataAfterDone
        )
    }

    /// The error the application sees when the connection ends for this reason.
    pub fn app_error(self) -> ConnError {
        match self {
            AbortReason::PeerAbort
            | AbortReason::TcpReset
            | AbortReason::RmbeConflict
            | AbortReason::PeerClosedWithPendingData
            | AbortReason::LinkGroupLost
            | AbortReason::FailoverDataLoss => ConnError::Reset(self),
            AbortReason::CloseTimeout => ConnError::TimedOut,
            _ => ConnError::Aborted(self),
        }
    }
}

/// The error a failed connection reports to the application (App. B: the socket API keeps
/// TCP's error codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum ConnError {
    /// Reset by the peer or the network (ECONNRESET).
    #[error("connection reset ({0:?})")]
    Reset(AbortReason),
    /// Aborted locally (ECONNABORTED).
    #[error("connection aborted ({0:?})")]
    Aborted(AbortReason),
    /// A termination timer expired (ETIMEDOUT).
    #[error("connection termination timed out")]
    TimedOut,
}

/// Misuse of the connection API by the caller (never caused by the peer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum ApiError {
    /// The connection has failed; the error is the one reported to the application.
    #[error("connection failed: {0}")]
    Failed(ConnError),
    /// The operation is not allowed in this state.
    #[error("operation not allowed in state {0}")]
    InvalidState(State),
    /// Writing was shut down (shutdown(WR) or close()).
    #[error("writing was shut down")]
    WriteShutdown,
    /// More bytes were reported produced than the peer's window had room for.
    #[error("produced {requested} bytes but only {available} fit in the peer RMBE")]
    ExceedsWindow {
        /// Bytes reported.
        requested: u32,
        /// Room there was.
        available: u32,
    },
    /// More bytes were reported consumed than were readable.
    #[error("consumed {requested} bytes but only {available} were readable")]
    ExceedsReadable {
        /// Bytes reported.
        requested: u32,
        /// Bytes readable.
        available: u32,
    },
    /// Urgent data needs at least one byte.
    #[error("urgent data needs at least one byte")]
    EmptyUrgent,
}
