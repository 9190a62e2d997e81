//! CDC (Connection Data Control) messages: RFC 7609 A.4, wire-formats.md §9.
//!
//! A CDC message is a 44-byte IB SEND that carries one connection's producer and consumer
//! cursors and its flags. It follows every RDMA WRITE of data and also carries window
//! updates, close and abort.

use core::fmt;

use crate::codec::{check_room, Writer};
use crate::error::{Error, Result};
use crate::MSG44_LEN;

/// The CDC message type byte.
pub const CDC_TYPE: u8 = 0xFE;

/// Byte ranges of the CDC fields.
pub mod field {
    use core::ops::Range;
    /// Type (0xFE).
    pub const TYPE: usize = 0;
    /// Length (44).
    pub const LENGTH: usize = 1;
    /// Sequence number.
    pub const SEQNO: Range<usize> = 2..4;
    /// Alert token (the receiver's).
    pub const ALERT_TOKEN: Range<usize> = 4..8;
    /// Producer cursor: reserved u16, wrap u16, count u32.
    pub const PRODUCER: Range<usize> = 8..16;
    /// Consumer cursor: reserved u16, wrap u16, count u32.
    pub const CONSUMER: Range<usize> = 16..24;
    /// Producer flags.
    pub const PROD_FLAGS: usize = 24;
    /// Connection state flags.
    pub const CONN_FLAGS: usize = 25;
    /// Trailing reserved bytes.
    pub const RESERVED: Range<usize> = 26..44;
}

/// A cursor into an RMBE: byte offset `count` after `wrap` wraps (RFC 7609 A.4).
///
/// "The producer cursor ... 4-byte unsigned integer ... The wrap sequence number is a
/// 2-byte unsigned integer that is incremented every time the cursor wraps."
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Cursor {
    /// Wrap sequence number (u16, wraps through 0).
    pub wrap: u16,
    /// Byte offset within the RMBE.
    pub count: u32,
}

impl Cursor {
    /// A cursor.
    pub const fn new(wrap: u16, count: u32) -> Cursor {
        Cursor { wrap, count }
    }

    fn write(self, w: &mut Writer<'_>) {
        w.zeros(2);
        w.u16(self.wrap);
        w.u32(self.count);
    }
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.wrap, self.count)
    }
}

/// CDC byte 24, the producer flags (RFC 7609 A.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ProducerFlags {
    /// B (0x80): "Writer blocked": the sender has data it cannot write for lack of space.
    pub write_blocked: bool,
    /// P (0x40): urgent data pending.
    pub urgent_pending: bool,
    /// U (0x20): urgent data present; the producer cursor points one past the last urgent byte.
    pub urgent_present: bool,
    /// R (0x10): the sender requests a consumer cursor update now.
    pub cons_update_requested: bool,
    /// F (0x08): failover validation message.
    pub failover_validation: bool,
}

impl ProducerFlags {
    /// From the wire byte; reserved bits (0x07) are ignored.
    pub fn from_byte(b: u8) -> Self {
        ProducerFlags {
            write_blocked: b & 0x80 != 0,
            urgent_pending: b & 0x40 != 0,
            urgent_present: b & 0x20 != 0,
            cons_update_requested: b & 0x10 != 0,
            failover_validation: b & 0x08 != 0,
        }
    }

    /// The wire byte; reserved bits are zero.
    pub fn to_byte(self) -> u8 {
        (u8::from(self.write_blocked) << 7)
            | (u8::from(self.urgent_pending) << 6)
            | (u8::from(self.urgent_present) << 5)
            | (u8::from(self.cons_update_requested) << 4)
            | (u8::from(self.failover_validation) << 3)
    }
}

/// CDC byte 25, the connection state flags (RFC 7609 A.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ConnStateFlags {
    /// D (0x80): "Sending done": the sender will write no more data (like a FIN).
    pub peer_done_writing: bool,
    /// C (0x40): "Peer connection closed": the sender closed the connection completely.
    pub peer_conn_closed: bool,
    /// A (0x20): "Abnormal close" (like a TCP RST).
    pub peer_abnormal_close: bool,
}

impl ConnStateFlags {
    /// From the wire byte; reserved bits (0x1F) are ignored.
    pub fn from_byte(b: u8) -> Self {
        ConnStateFlags {
            peer_done_writing: b & 0x80 != 0,
            peer_conn_closed: b & 0x40 != 0,
            peer_abnormal_close: b & 0x20 != 0,
        }
    }

    /// The wire byte; reserved bits are zero.
    pub fn to_byte(self) -> u8 {
        (u8::from(self.peer_done_writing) << 7)
            | (u8::from(self.peer_conn_closed) << 6)
            | (u8::from(self.peer_abnormal_close) << 5)
    }
}

/// A checked, zero-copy view of a CDC message.
///
/// After [`CdcPacket::new_checked`] succeeded, no accessor can panic.
#[derive(Debug, Clone, Copy)]
pub struct CdcPacket<T: AsRef<[u8]>> {
    buf: T,
}

impl<T: AsRef<[u8]>> CdcPacket<T> {
    /// Wrap `buf` without checks; accessors may then return wrong values but never panic
    /// only if the buffer is at least 44 bytes, so prefer [`CdcPacket::new_checked`].
    pub fn new_unchecked(buf: T) -> Self {
        CdcPacket { buf }
    }

    /// Wrap `buf` after checking its size (44 bytes or more), type byte and length byte.
    pub fn new_checked(buf: T) -> Result<Self> {
        let b = buf.as_ref();
        if b.len() < MSG44_LEN {
            return Err(Error::Truncated {
                what: "CDC",
                need: MSG44_LEN,
                have: b.len(),
            });
        }
        if b[field::TYPE] != CDC_TYPE {
            return Err(Error::UnknownType {
                what: "CDC",
                found: b[field::TYPE],
            });
        }
        if usize::from(b[field::LENGTH]) != MSG44_LEN {
            return Err(Error::BadLength {
                what: "CDC",
                found: usize::from(b[field::LENGTH]),
                expected: "44",
            });
        }
        Ok(CdcPacket { buf })
    }

    fn b(&self) -> &[u8] {
        self.buf.as_ref()
    }

    fn be16(&self, at: usize) -> u16 {
        let b = self.b();
        match (b.get(at), b.get(at + 1)) {
            (Some(&x), Some(&y)) => u16::from_be_bytes([x, y]),
            _ => 0,
        }
    }

    fn be32(&self, at: usize) -> u32 {
        (u32::from(self.be16(at)) << 16) | u32::from(self.be16(at + 2))
    }

    /// The sequence number.
    pub fn seqno(&self) -> u16 {
        self.be16(field::SEQNO.start)
    }

    /// The alert token (the receiver's connection identifier).
    pub fn alert_token(&self) -> u32 {
        self.be32(field::ALERT_TOKEN.start)
    }

    /// The producer cursor.
    pub fn producer(&self) -> Cursor {
        Cursor::new(
            self.be16(field::PRODUCER.start + 2),
            self.be32(field::PRODUCER.start + 4),
        )
    }

    /// The consumer cursor.
    pub fn consumer(&self) -> Cursor {
        Cursor::new(
            self.be16(field::CONSUMER.start + 2),
            self.be32(field::CONSUMER.start + 4),
        )
    }

    /// The producer flags.
    pub fn producer_flags(&self) -> ProducerFlags {
        ProducerFlags::from_byte(self.b().get(field::PROD_FLAGS).copied().unwrap_or(0))
    }

    /// The connection state flags.
    pub fn conn_state_flags(&self) -> ConnStateFlags {
        ConnStateFlags::from_byte(self.b().get(field::CONN_FLAGS).copied().unwrap_or(0))
    }
}

/// A validated CDC message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CdcMessage {
    /// Sequence number: "first CDC on a connection = 1, +1 per CDC, wraps through 0".
    pub seqno: u16,
    /// The receiver's alert token, which identifies the connection at the receiver.
    pub alert_token: u32,
    /// Producer cursor: where the sender writes next in the receiver's RMBE.
    pub producer: Cursor,
    /// Consumer cursor: how far the sender has consumed its own RMBE.
    pub consumer: Cursor,
    /// Producer flags (byte 24).
    pub prod_flags: ProducerFlags,
    /// Connection state flags (byte 25).
    pub conn_flags: ConnStateFlags,
}

impl CdcMessage {
    /// Parse a CDC message from exactly 44 bytes (a receive buffer may be longer: use the
    /// first 44 bytes). Reserved fields are ignored.
    pub fn parse(buf: &[u8]) -> Result<CdcMessage> {
        let p = CdcPacket::new_checked(buf)?;
        Ok(Self::from_packet(&p))
    }

    /// The message in a checked view.
    pub fn from_packet<T: AsRef<[u8]>>(p: &CdcPacket<T>) -> CdcMessage {
        CdcMessage {
            seqno: p.seqno(),
            alert_token: p.alert_token(),
            producer: p.producer(),
            consumer: p.consumer(),
            prod_flags: p.producer_flags(),
            conn_flags: p.conn_state_flags(),
        }
    }

    /// Length of the emitted message: always 44.
    pub const fn buffer_len(&self) -> usize {
        MSG44_LEN
    }

    /// Emit into `buf`, which must hold at least 44 bytes. Reserved bytes are written as zero.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        check_room(buf, MSG44_LEN)?;
        let mut w = Writer::new(buf);
        w.u8(CDC_TYPE);
        w.u8(MSG44_LEN as u8);
        w.u16(self.seqno);
        w.u32(self.alert_token);
        self.producer.write(&mut w);
        self.consumer.write(&mut w);
        w.u8(self.prod_flags.to_byte());
        w.u8(self.conn_flags.to_byte());
        w.zeros(field::RESERVED.len());
        w.finish()
    }

    /// The 44 wire bytes.
    pub fn to_bytes(&self) -> [u8; MSG44_LEN] {
        let mut b = [0u8; MSG44_LEN];
        // A 44-byte buffer always has room.
        let _ = self.emit(&mut b);
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursor_reserved_bytes_ignored() {
        let mut b = CdcMessage::default().to_bytes();
        b[8] = 0xAA;
        b[9] = 0xBB;
        b[11] = 1;
        b[15] = 0x40;
        let m = CdcMessage::parse(&b).unwrap();
        assert_eq!(m.producer, Cursor::new(1, 0x40));
        assert_eq!(m.to_bytes()[8..10], [0, 0]);
    }

    #[test]
    fn reserved_flag_bits_ignored() {
        assert_eq!(ProducerFlags::from_byte(0x07), ProducerFlags::default());
        assert_eq!(ConnStateFlags::from_byte(0x1F), ConnStateFlags::default());
        assert_eq!(ProducerFlags::from_byte(0xFF).to_byte(), 0xF8);
        assert_eq!(ConnStateFlags::from_byte(0xFF).to_byte(), 0xE0);
    }

    #[test]
    fn bad_type_and_length() {
        let mut b = CdcMessage::default().to_bytes();
        b[1] = 43;
        assert!(matches!(
            CdcMessage::parse(&b),
            Err(Error::BadLength { .. })
        ));
        b[1] = 44;
        b[0] = 0x01;
        assert!(matches!(
            CdcMessage::parse(&b),
            Err(Error::UnknownType { .. })
        ));
        assert!(matches!(
            CdcMessage::parse(&b[..43]),
            Err(Error::Truncated { .. })
        ));
    }
}
