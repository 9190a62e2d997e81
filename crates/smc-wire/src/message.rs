//! Dispatch of a 44-byte SEND payload to LLC or CDC.

use crate::cdc::{CdcMessage, CDC_TYPE};
use crate::error::{Error, Result};
use crate::llc::LlcMessage;

/// A message received by IB SEND on a link: LLC or CDC (RFC 7609 A.3: "The two high-order
/// bits of the type ... b'11' CDC").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ControlMessage {
    /// A link-level control message.
    Llc(LlcMessage),
    /// A connection data control message.
    Cdc(CdcMessage),
}

impl ControlMessage {
    /// Parse the first 44 bytes of a receive buffer.
    pub fn parse(buf: &[u8]) -> Result<ControlMessage> {
        match buf.first() {
            Some(&CDC_TYPE) => CdcMessage::parse(buf).map(ControlMessage::Cdc),
            Some(_) => LlcMessage::parse(buf).map(ControlMessage::Llc),
            None => Err(Error::Truncated {
                what: "LLC/CDC",
                need: crate::MSG44_LEN,
                have: 0,
            }),
        }
    }

    /// The 44 wire bytes.
    pub fn to_bytes(&self) -> [u8; crate::MSG44_LEN] {
        match self {
            ControlMessage::Llc(m) => m.to_bytes(),
            ControlMessage::Cdc(m) => m.to_bytes(),
        }
    }
}
