//! Errors of the stack and why a connection runs over TCP instead of SMC-R.

use std::fmt;
use std::io;

use smc_proto::endpoint::{Fallback, ResetReason};
use smc_proto::ConnError;
use smc_wire::DeclineCode;

/// Creating or configuring a [`Stack`](crate::Stack) failed.
///
/// Each message includes its cause's; the cause is not also given as the error's `source`
/// (a chain of causes, as `anyhow` prints it, would repeat it).
#[derive(Debug, thiserror::Error)]
pub enum StackError {
    /// The fabric could not be opened or used.
    #[error("fabric: {0}")]
    Fabric(smc_fabric::FabricError),
    /// Capability discovery was asked for but is unavailable.
    #[error("discovery: {0}")]
    Discovery(crate::discovery::DiscoveryError),
    /// A configuration value is invalid.
    #[error("configuration: {0}")]
    Config(String),
    /// The runtime thread could not be started.
    #[error("runtime thread: {0}")]
    Thread(io::Error),
}

impl From<crate::discovery::DiscoveryError> for StackError {
    fn from(e: crate::discovery::DiscoveryError) -> Self {
        StackError::Discovery(e)
    }
}

impl From<StackError> for io::Error {
    fn from(e: StackError) -> io::Error {
        io::Error::other(e)
    }
}

/// Why a connection runs over plain TCP (recorded per connection and counted per stack).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FallbackReason {
    /// The stack does not try SMC-R (discovery off or unavailable).
    DiscoveryOff,
    /// The TCP handshake showed that the peer did not offer SMC-R (no TCP option).
    PeerWithoutOption,
    /// Assert-peer listener: the client sent no CLC Proposal in time (a plain TCP client).
    NoProposal,
    /// The peer declined with this code.
    PeerDeclined {
        /// The peer's reason code.
        code: DeclineCode,
        /// The peer's S flag (out of sync).
        out_of_sync: bool,
    },
    /// We declined with this code (no device, subnet mismatch, resources, ...).
    Declined(DeclineCode),
}

impl FallbackReason {
    /// The Decline code, for the reasons that have one.
    pub fn decline_code(self) -> Option<DeclineCode> {
        match self {
            FallbackReason::PeerDeclined { code, .. } | FallbackReason::Declined(code) => {
                Some(code)
            }
            _ => None,
        }
    }
}

impl From<Fallback> for FallbackReason {
    fn from(f: Fallback) -> Self {
        match f {
            Fallback::PeerDeclined { code, out_of_sync } => {
                FallbackReason::PeerDeclined { code, out_of_sync }
            }
            Fallback::Declined(code) => FallbackReason::Declined(code),
        }
    }
}

impl fmt::Display for FallbackReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FallbackReason::DiscoveryOff => write!(f, "SMC-R discovery is off"),
            FallbackReason::PeerWithoutOption => {
                write!(f, "peer did not offer SMC-R (no TCP option)")
            }
            FallbackReason::NoProposal => write!(f, "peer sent no CLC Proposal"),
            FallbackReason::PeerDeclined { code, out_of_sync } => write!(
                f,
                "peer declined: {code}{}",
                if *out_of_sync { ", out of sync" } else { "" }
            ),
            FallbackReason::Declined(code) => write!(f, "we declined: {code}"),
        }
    }
}

/// How a connection carries its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Over SMC-R (RDMA writes into the peer's RMBE).
    Smc,
    /// Over plain TCP, for this reason.
    Tcp(FallbackReason),
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mode::Smc => write!(f, "SMC-R"),
            Mode::Tcp(r) => write!(f, "TCP ({r})"),
        }
    }
}

/// The std::io error for a connection that failed during setup.
pub(crate) fn reset_error(r: ResetReason) -> io::Error {
    let kind = match r {
        ResetReason::ClcTimeout | ResetReason::LlcTimeout(_) => io::ErrorKind::TimedOut,
        ResetReason::PeerReset => io::ErrorKind::ConnectionReset,
        ResetReason::Connection(e) => return conn_error(e),
        _ => io::ErrorKind::ConnectionAborted,
    };
    io::Error::new(kind, r)
}

/// The std::io error for an established connection that failed.
pub(crate) fn conn_error(e: ConnError) -> io::Error {
    let kind = match e {
        ConnError::Reset(_) => io::ErrorKind::ConnectionReset,
        ConnError::Aborted(_) => io::ErrorKind::ConnectionAborted,
        ConnError::TimedOut => io::ErrorKind::TimedOut,
    };
    io::Error::new(kind, e)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The message and every cause below it, as `anyhow` prints a chain (`{:#}`).
    fn chain(e: &(dyn std::error::Error + 'static)) -> String {
        let mut s = e.to_string();
        let mut cur = e.source();
        while let Some(c) = cur {
            s.push_str(": ");
            s.push_str(&c.to_string());
            cur = c.source();
        }
        s
    }

    /// A stack error says its cause once, also wrapped in an `io::Error` (as the socket
    /// API returns it) and printed with its chain of causes.
    #[test]
    fn a_cause_is_said_once() {
        let os = smc_fabric::FabricError::Os {
            context: "create fabric directory",
            error: io::Error::from_raw_os_error(28),
        };
        let e: io::Error = StackError::Fabric(os).into();
        let text = chain(&e);
        assert_eq!(text.matches("No space left on device").count(), 1, "{text}");
        assert_eq!(text.matches("create fabric directory").count(), 1, "{text}");
        let e: io::Error = StackError::Thread(io::Error::from_raw_os_error(11)).into();
        let text = chain(&e);
        assert_eq!(text.matches("temporarily unavailable").count(), 1, "{text}");
    }
}
