//! Dispatch of a 44-byte SEND payload to LLC or CDC.

use crate::cdc::{CdcMessage, CDC_TYPE};
use crate::error::{Error, Result};
use crate::llc::LlcMessage;
use crate::llc_v2::{is_v2_type, LlcV2Message};

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

/// Any message received by IB SEND on a link of either LLC version: LLC v1 (44 bytes), LLC v2
/// (44..8192 bytes, type `0x2X`, smc-rv2.md §10) or CDC (44 bytes, not versioned).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum SendMessage {
    /// A version-1 LLC message.
    Llc(LlcMessage),
    /// A version-2 LLC message.
    LlcV2(LlcV2Message),
    /// A CDC message.
    Cdc(CdcMessage),
}

impl SendMessage {
    /// Parse the payload of one SEND; `buf` is exactly the bytes received (the completion's
    /// length), which for LLC v2 is the message size.
    pub fn parse(buf: &[u8]) -> Result<SendMessage> {
        match buf.first() {
            Some(&t) if is_v2_type(t) => LlcV2Message::parse(buf).map(SendMessage::LlcV2),
            Some(_) => ControlMessage::parse(buf).map(|m| match m {
                ControlMessage::Llc(l) => SendMessage::Llc(l),
                ControlMessage::Cdc(c) => SendMessage::Cdc(c),
            }),
            None => Err(Error::Truncated {
                what: "LLC/CDC",
                need: crate::MSG44_LEN,
                have: 0,
            }),
        }
    }

    /// The wire bytes.
    pub fn to_vec(&self) -> Vec<u8> {
        match self {
            SendMessage::Llc(m) => m.to_bytes().to_vec(),
            SendMessage::LlcV2(m) => m.to_vec(),
            SendMessage::Cdc(m) => m.to_bytes().to_vec(),
        }
    }
}
