//! CLC messages that crossed our Decline on the wire.
//!
//! A Decline is final for the side that sends it: it falls back at once and writes
//! application bytes next. But RFC 7609 lets both peers decline at the same moment during a
//! first contact's LLC negotiation (a failing link is seen by both), and a peer whose own
//! timer fires may send a CLC message it had due. What the peer sent before it read our
//! Decline therefore arrives in front of its application bytes, and must not be handed to
//! the application as data: a stream that fell back after *our* Decline drops the complete
//! CLC messages it finds at its very start (at most [`MAX_CROSSING`]), nothing else.
//!
//! Application bytes that happen to start with a whole, well-formed CLC message (eye
//! catcher, known type, version, length, trailing eye catcher) would be dropped too; an
//! application that is not an SMC implementation does not send those.
//!
//! A read may wait for the rest of a CLC message whose beginning arrived (it cannot tell it
//! from data before the whole message is there); it never waits when the first bytes differ
//! from a CLC header.

//= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.2
//# a first contact peer can send an SMC Decline at any time during LLC negotiation until it
//# has successfully sent its CONFIRM LINK (request or response) flow.
//= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.1
//# when an SMC Decline is sent in lieu of an expected CLC message, no confirmation is
//# required, and the TCP connection immediately falls back to using the IP fabric.

use smc_wire::clc::{ClcHeader, ClcMessage, HEADER_LEN, TRAILER_LEN};

/// At most this many crossed CLC messages are dropped (the peer's Decline, and one message
/// it may have had in flight before it).
pub(crate) const MAX_CROSSING: u8 = 2;

/// What the first bytes of a fallen-back stream are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Leading {
    /// Application data (or nothing more to strip).
    Data,
    /// A complete CLC message of this many bytes: drop it.
    Clc(usize),
    /// Could be the start of a CLC message: read more before deciding.
    NeedMore,
}

/// Classify the start of `buf`.
pub(crate) fn classify(buf: &[u8]) -> Leading {
    let eye = smc_wire::EYECATCHER_SMCR;
    let n = buf.len().min(eye.len());
    if buf[..n] != eye[..n] {
        return Leading::Data;
    }
    if buf.len() < HEADER_LEN {
        return Leading::NeedMore;
    }
    let Ok(h) = ClcHeader::parse(buf) else {
        return Leading::Data;
    };
    let len = usize::from(h.length);
    if buf.len() < len {
        return Leading::NeedMore;
    }
    // Both eye catchers, and a message that parses whole.
    let trailer_ok = buf
        .get(len - TRAILER_LEN..len)
        .is_some_and(|t| t == eye || t == smc_wire::EYECATCHER_SMCD);
    match ClcMessage::parse(&buf[..len]) {
        Ok((_, used)) if used == len && trailer_ok => Leading::Clc(len),
        _ => Leading::Data,
    }
}

/// The filter state of one fallen-back stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stripper {
    /// Crossed messages that may still be dropped (0: the filter is off).
    left: u8,
}

impl Stripper {
    /// A filter for a stream that fell back after our own Decline (`armed`), else off.
    pub(crate) fn new(armed: bool) -> Stripper {
        Stripper {
            left: if armed { MAX_CROSSING } else { 0 },
        }
    }

    /// Whether bytes may still need to be stripped.
    pub(crate) fn active(&self) -> bool {
        self.left > 0
    }

    /// Drop the crossed messages at the start of `buf`. Returns `true` when the filter is
    /// done (from here on everything is data) and `false` when more bytes are needed.
    pub(crate) fn strip(&mut self, buf: &mut Vec<u8>) -> bool {
        while self.left > 0 {
            if buf.is_empty() {
                return false;
            }
            match classify(buf) {
                Leading::Data => self.left = 0,
                Leading::Clc(len) => {
                    tracing::debug!(len, "dropped a CLC message that crossed our Decline");
                    buf.drain(..len);
                    self.left -= 1;
                }
                Leading::NeedMore => return false,
            }
        }
        true
    }

    /// The peer closed (or the read failed for good): whatever is buffered is data.
    pub(crate) fn finish(&mut self) {
        self.left = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use smc_wire::clc::Decline;
    use smc_wire::{DeclineCode, PeerId};

    fn decline() -> Vec<u8> {
        let d = Decline::new(
            PeerId {
                instance: 7,
                mac: smc_wire::Mac([2, 0, 0, 0, 0, 1]),
            },
            DeclineCode::TIMEOUT_CL,
            false,
        );
        let mut b = vec![0u8; d.buffer_len()];
        d.emit(&mut b).expect("emit");
        b
    }

    #[test]
    fn a_crossed_decline_in_front_of_data_is_dropped() {
        let mut buf = decline();
        buf.extend_from_slice(b"hello");
        let mut s = Stripper::new(true);
        assert!(s.strip(&mut buf));
        assert_eq!(buf, b"hello");
        assert!(!s.active());
    }

    #[test]
    fn a_decline_arriving_in_pieces_waits_for_the_whole_message() {
        let d = decline();
        let mut s = Stripper::new(true);
        let mut buf = Vec::new();
        for b in &d {
            assert!(
                !s.strip(&mut buf),
                "decided before the message was complete"
            );
            buf.push(*b);
        }
        buf.extend_from_slice(b"x");
        assert!(s.strip(&mut buf));
        assert_eq!(buf, b"x");
    }

    #[test]
    fn data_is_never_touched() {
        for data in [
            &b"GET / HTTP/1.1\r\n"[..],
            &[0xE2, 0xD4, 0xC3, 0x00, 1, 2, 3, 4, 5][..],
        ] {
            let mut buf = data.to_vec();
            let mut s = Stripper::new(true);
            assert!(s.strip(&mut buf));
            assert_eq!(buf, data);
        }
        // Only the first bytes of the stream are looked at: a Decline after data stays.
        let mut buf = b"abc".to_vec();
        buf.extend_from_slice(&decline());
        let want = buf.clone();
        let mut s = Stripper::new(true);
        assert!(s.strip(&mut buf));
        assert_eq!(buf, want);
    }

    #[test]
    fn a_header_with_a_bad_trailer_is_data() {
        let mut d = decline();
        let n = d.len();
        d[n - 1] ^= 0xFF;
        let want = d.clone();
        let mut s = Stripper::new(true);
        assert!(s.strip(&mut d));
        assert_eq!(d, want);
    }

    #[test]
    fn at_most_two_messages_are_dropped_and_only_when_armed() {
        let mut buf = [decline(), decline(), decline()].concat();
        let mut s = Stripper::new(true);
        assert!(s.strip(&mut buf));
        assert_eq!(buf, decline());
        let mut buf = decline();
        let mut off = Stripper::new(false);
        assert!(off.strip(&mut buf));
        assert_eq!(buf, decline());
    }
}
