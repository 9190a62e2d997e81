//! smc-wire: every byte of SMC-R version 1 (RFC 7609 Appendix A, as Linux `net/smc` speaks it).
//!
//! Each message has two levels, in the manner of smoltcp:
//! - a checked zero-copy view (`ClcPacket`, `LlcPacket`, `CdcPacket`) over a byte buffer, whose
//!   `new_checked` validates sizes so that no accessor can panic afterwards;
//! - a validated representation (`Proposal`, `AcceptConfirm`, `LlcMessage`, `CdcMessage`, ...)
//!   with `parse`, `buffer_len` and `emit`. Reserved bytes are emitted as zero; enumerations
//!   keep values they do not know.
//!
//! Parse errors are classified by [`ErrorClass`] the way RFC 7609 Appendix C.6 needs: a
//! malformed message terminates; a bad enumerated value leads to a Decline.
//!
//! Nothing here performs I/O, allocates while parsing a fixed-size message, or uses `unsafe`.
#![forbid(unsafe_code)]

pub mod capture;
pub mod cdc;
pub mod clc;
pub mod clc_v2;
pub mod codec;
pub mod describe;
pub mod dissect;
pub mod eid;
pub mod error;
pub mod examples;
pub mod llc;
pub mod llc_v2;
pub mod message;
pub mod roce;
pub mod tcp_option;
pub mod types;

pub use cdc::{CdcMessage, CdcPacket, ConnStateFlags, Cursor, ProducerFlags};
pub use clc::{
    AcceptConfirm, ClcHeader, ClcMessage, ClcPacket, ClcType, Decline, DeclineCode, Proposal,
};
pub use eid::{Eid, UeidError};
pub use error::{Error, ErrorClass, Result};
pub use llc::{LlcMessage, LlcPacket, LlcType};
pub use message::{ControlMessage, SendMessage};
pub use types::{Gid, Mac, PeerId, QpMtu, RmbeSize, U24};

/// Length of every LLC and CDC message (RFC 7609 A.3, A.4).
pub const MSG44_LEN: usize = 44;

/// "SMCR" in EBCDIC (IBM-1047): the CLC eye catcher and the TCP option's experiment ID.
pub const EYECATCHER_SMCR: [u8; 4] = [0xE2, 0xD4, 0xC3, 0xD9];
/// "SMCD" in EBCDIC, accepted from Linux as an alternative CLC eye catcher.
pub const EYECATCHER_SMCD: [u8; 4] = [0xE2, 0xD4, 0xC3, 0xC4];
