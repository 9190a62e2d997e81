//! Typed errors of the fabric API.

use crate::types::QpState;

/// Every synchronous failure of the fabric API.
///
/// Failures of posted work are reported as [`crate::WcStatus`] in work completions instead.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FabricError {
    /// No device with this name is configured.
    #[error("no such fabric device: {0}")]
    NoSuchDevice(String),
    /// The device port is down (fault injection or configuration).
    #[error("device port is down")]
    PortDown,
    /// A device entry of the configuration is malformed or cannot be opened.
    #[error("bad device entry '{entry}': {reason}")]
    BadDeviceEntry {
        /// The entry as written (e.g. `roce:r0=veth0`).
        entry: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A device could not be opened; `entry` names its configuration.
    #[error("cannot open device '{device}': {detail}")]
    DeviceOpen {
        /// Device name.
        device: String,
        /// What failed.
        detail: String,
    },
    /// The requested QP state transition is not allowed from the current state.
    #[error("invalid QP state transition from {from:?} to {to:?}")]
    InvalidTransition {
        /// State the QP is in.
        from: QpState,
        /// State that was requested.
        to: QpState,
    },
    /// Posting is not allowed in the QP's current state (e.g. SEND before RTS).
    #[error("operation not allowed in QP state {0:?}")]
    InvalidState(QpState),
    /// The send or receive queue already holds its maximum number of work requests.
    #[error("work queue is full")]
    QueueFull,
    /// An inline payload is larger than the backend allows.
    #[error("message of {len} bytes exceeds the maximum of {max}")]
    MessageTooLarge {
        /// Requested length.
        len: usize,
        /// Maximum length.
        max: usize,
    },
    /// A local key does not name a memory region of this protection domain.
    #[error("invalid local key {0:#x}")]
    InvalidLkey(u32),
    /// An address range is outside the memory region or access is not permitted.
    #[error("local access outside memory region bounds or permissions")]
    LocalAccess,
    /// An argument is out of range (sizes, queue depths, PSN).
    #[error("invalid argument: {0}")]
    InvalidArgument(&'static str),
    /// The objects belong to different devices or protection domains.
    #[error("objects belong to different devices or protection domains")]
    Mismatch,
    /// The remote QP could not be reached or refused the connection.
    #[error("remote QP unreachable: {0}")]
    PeerUnreachable(String),
    /// The peer's memory region `rkey` could not be made writable from this QP (shm: its
    /// memfd not received or not mapped, for want of a descriptor or address space, or the
    /// peer refused it); `status` is what a WRITE to it would have completed with.
    #[error("peer memory region {rkey:#x} unavailable ({status:?})")]
    RemoteRegion {
        /// The peer's rkey.
        rkey: u32,
        /// The completion status a WRITE would have had.
        status: crate::WcStatus,
    },
    /// The peer sent a malformed or inconsistent control message or resource.
    #[error("peer protocol violation: {0}")]
    PeerViolation(&'static str),
    /// The fabric directory exists but is not safe to use: another user's, open to others,
    /// or not a directory (a symlink or a file planted in its place).
    #[error("{} is {why}: refusing it as the fabric directory", path.display())]
    UntrustedDirectory {
        /// The directory.
        path: std::path::PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// A Unix socket path that no socket address can hold (see [`crate::sockpath`]).
    #[error(
        "socket path {} is longer than the {} bytes a Unix socket address holds, and {why}",
        path.display(),
        crate::sockpath::SUN_PATH_MAX
    )]
    SocketPath {
        /// The path.
        path: std::path::PathBuf,
        /// Why the way around the limit failed.
        why: String,
    },
    /// An environment variable's value is not UTF-8.
    #[error("{0} is not valid UTF-8")]
    NotUtf8(&'static str),
    /// A wait timed out.
    #[error("timed out")]
    Timeout,
    /// An operating-system call failed. (The message includes the OS error; it is not also
    /// given as the error's `source`, which would print it twice in a chain of causes.)
    #[error("{context}: {error}")]
    Os {
        /// What the fabric was doing.
        context: &'static str,
        /// The underlying error.
        error: std::io::Error,
    },
}

impl FabricError {
    pub(crate) fn os(context: &'static str, err: impl Into<std::io::Error>) -> Self {
        FabricError::Os {
            context,
            error: err.into(),
        }
    }
}

/// Result alias of the fabric API.
pub type Result<T> = std::result::Result<T, FabricError>;
