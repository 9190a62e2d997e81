//! RoCEv2 packets: the InfiniBand transport headers carried in UDP (destination port 4791) and
//! the invariant CRC (ICRC) that ends every packet (shared/spec/rocev2.md sections 3–6, 12, 13).
//!
//! One codec for everything in smc-rs that reads or writes RoCEv2: the capture writer
//! ([`crate::capture`]) and the software RoCEv2 device of smc-fabric. The layout and the ICRC
//! recipe are those Linux's Soft-RoCE (rdma_rxe) puts on the wire; the tests recompute the ICRC
//! of every frame of an rxe capture.
//!
//! A packet as carried in a UDP datagram:
//!
//! ```text
//! BTH 12 | RETH 16 (WRITE FIRST/ONLY) | AETH 4 (ACK) | ImmDt 4 (…with Immediate) | payload | pad 0..3 | ICRC 4
//! ```
//!
//! [`Packet::parse`] checks a received UDP payload so that no accessor can go out of bounds;
//! [`PacketRepr::emit`] writes one (ICRC excluded, as it depends on the IP and UDP headers the
//! kernel writes); [`IcrcHeaders`] computes, writes and checks the ICRC.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// IANA UDP port of RoCEv2 ("roce"): the destination port of every packet, in both directions.
pub const UDP_PORT: u16 = 4791;
/// Length of the Base Transport Header.
pub const BTH_LEN: usize = 12;
/// Length of the RDMA Extended Transport Header.
pub const RETH_LEN: usize = 16;
/// Length of the ACK Extended Transport Header.
pub const AETH_LEN: usize = 4;
/// Length of the immediate data.
pub const IMMDT_LEN: usize = 4;
/// Length of the invariant CRC.
pub const ICRC_LEN: usize = 4;
/// The default partition key (full membership of the default partition), sent by rxe.
pub const DEFAULT_PKEY: u16 = 0xFFFF;
/// PSNs, QPNs and MSNs are 24-bit values.
pub const U24_MASK: u32 = 0x00FF_FFFF;

/// Why a UDP payload is not a RoCEv2 packet we can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RoceError {
    /// Shorter than the BTH, its extension headers, the pad and the ICRC.
    #[error("packet too short: {len} bytes, headers, pad and ICRC need {need}")]
    Truncated {
        /// Bytes present.
        len: usize,
        /// Bytes the headers say there must be at least.
        need: usize,
    },
    /// A transport header version other than 0 (rxe drops these).
    #[error("BTH transport version {0} (only 0 exists)")]
    BadTver(u8),
    /// An opcode this codec does not parse (UC, RD, UD, CNP, READ, atomics, …).
    #[error("unsupported BTH opcode {0:#04x}")]
    UnsupportedOpcode(u8),
    /// The buffer is too small for what is emitted into it.
    #[error("buffer of {len} bytes too small for a {need}-byte packet")]
    BufferTooSmall {
        /// Bytes available.
        len: usize,
        /// Bytes needed.
        need: usize,
    },
}

/// The BTH opcode: transport class (bits 7..5) and operation (bits 4..0). A newtype so that
/// values this codec does not know survive; the constants name the RC operations SMC-R uses.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
pub struct Opcode(pub u8);

impl Opcode {
    /// RC SEND First.
    pub const SEND_FIRST: Opcode = Opcode(0x00);
    /// RC SEND Middle.
    pub const SEND_MIDDLE: Opcode = Opcode(0x01);
    /// RC SEND Last.
    pub const SEND_LAST: Opcode = Opcode(0x02);
    /// RC SEND Last with Immediate.
    pub const SEND_LAST_IMM: Opcode = Opcode(0x03);
    /// RC SEND Only.
    pub const SEND_ONLY: Opcode = Opcode(0x04);
    /// RC SEND Only with Immediate.
    pub const SEND_ONLY_IMM: Opcode = Opcode(0x05);
    /// RC RDMA WRITE First.
    pub const WRITE_FIRST: Opcode = Opcode(0x06);
    /// RC RDMA WRITE Middle.
    pub const WRITE_MIDDLE: Opcode = Opcode(0x07);
    /// RC RDMA WRITE Last.
    pub const WRITE_LAST: Opcode = Opcode(0x08);
    /// RC RDMA WRITE Last with Immediate.
    pub const WRITE_LAST_IMM: Opcode = Opcode(0x09);
    /// RC RDMA WRITE Only.
    pub const WRITE_ONLY: Opcode = Opcode(0x0A);
    /// RC RDMA WRITE Only with Immediate.
    pub const WRITE_ONLY_IMM: Opcode = Opcode(0x0B);
    /// RC Acknowledge (ACK and every NAK).
    pub const ACKNOWLEDGE: Opcode = Opcode(0x11);

    /// Whether this codec parses the opcode (the RC SEND, WRITE and ACK operations).
    pub const fn is_supported(self) -> bool {
        matches!(self.0, 0x00..=0x0B | 0x11)
    }
    /// Whether the packet carries a RETH (WRITE FIRST and ONLY).
    pub const fn has_reth(self) -> bool {
        matches!(self.0, 0x06 | 0x0A | 0x0B)
    }
    /// Whether the packet carries an AETH (Acknowledge).
    pub const fn has_aeth(self) -> bool {
        self.0 == 0x11
    }
    /// Whether the packet carries immediate data.
    pub const fn has_immdt(self) -> bool {
        matches!(self.0, 0x03 | 0x05 | 0x09 | 0x0B)
    }
    /// A SEND packet of any position.
    pub const fn is_send(self) -> bool {
        matches!(self.0, 0x00..=0x05)
    }
    /// An RDMA WRITE packet of any position.
    pub const fn is_write(self) -> bool {
        matches!(self.0, 0x06..=0x0B)
    }
    /// The first (or only) packet of a message.
    pub const fn starts_message(self) -> bool {
        matches!(self.0, 0x00 | 0x04 | 0x05 | 0x06 | 0x0A | 0x0B)
    }
    /// The last (or only) packet of a message.
    pub const fn ends_message(self) -> bool {
        matches!(self.0, 0x02..=0x05 | 0x08..=0x0B)
    }
    /// Length of the extension headers between the BTH and the payload.
    pub const fn ext_len(self) -> usize {
        (if self.has_reth() { RETH_LEN } else { 0 })
            + (if self.has_aeth() { AETH_LEN } else { 0 })
            + (if self.has_immdt() { IMMDT_LEN } else { 0 })
    }
    /// The opcode of packet `index` of `count` of a SEND (`write == false`) or RDMA WRITE
    /// message (rocev2.md 6.2: one ONLY packet, or FIRST, MIDDLE…, LAST), with immediate data
    /// on the last packet when `imm`.
    pub const fn for_segment(write: bool, index: usize, count: usize, imm: bool) -> Opcode {
        let base = if write { 0x06 } else { 0x00 };
        let op = if count <= 1 {
            base + 4 + imm as u8
        } else if index == 0 {
            base
        } else if index + 1 < count {
            base + 1
        } else {
            base + 2 + imm as u8
        };
        Opcode(op)
    }
}

/// Base Transport Header (rocev2.md section 3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Bth {
    /// Operation.
    pub opcode: Opcode,
    /// Solicited event (byte 1 bit 7).
    pub se: bool,
    /// MigReq (byte 1 bit 6); sent as 0, ignored on receive.
    pub migreq: bool,
    /// Pad count: bytes of zero pad after the payload (0..3).
    pub pad: u8,
    /// Transport header version (must be 0).
    pub tver: u8,
    /// Partition key.
    pub pkey: u16,
    /// Byte 4: FECN, BECN and reserved bits (masked in the ICRC; sent as 0).
    pub byte4: u8,
    /// Destination QP number (24 bits).
    pub dest_qp: u32,
    /// Acknowledge request (byte 8 bit 7).
    pub ack_req: bool,
    /// Reserved bits 6..0 of byte 8 (covered by the ICRC; sent as 0).
    pub resv8: u8,
    /// Packet sequence number (24 bits).
    pub psn: u32,
}

impl Bth {
    /// Read the 12 bytes of a BTH.
    pub fn parse(b: &[u8; BTH_LEN]) -> Bth {
        Bth {
            opcode: Opcode(b[0]),
            se: b[1] & 0x80 != 0,
            migreq: b[1] & 0x40 != 0,
            pad: (b[1] >> 4) & 0x03,
            tver: b[1] & 0x0F,
            pkey: u16::from_be_bytes([b[2], b[3]]),
            byte4: b[4],
            dest_qp: u32::from_be_bytes([0, b[5], b[6], b[7]]),
            ack_req: b[8] & 0x80 != 0,
            resv8: b[8] & 0x7F,
            psn: u32::from_be_bytes([0, b[9], b[10], b[11]]),
        }
    }

    /// Write the 12 bytes of the BTH (24-bit fields are truncated to 24 bits).
    pub fn emit(&self, b: &mut [u8; BTH_LEN]) {
        b[0] = self.opcode.0;
        b[1] = (u8::from(self.se) << 7)
            | (u8::from(self.migreq) << 6)
            | ((self.pad & 0x03) << 4)
            | (self.tver & 0x0F);
        b[2..4].copy_from_slice(&self.pkey.to_be_bytes());
        b[4] = self.byte4;
        b[5..8].copy_from_slice(&(self.dest_qp & U24_MASK).to_be_bytes()[1..]);
        b[8] = (u8::from(self.ack_req) << 7) | (self.resv8 & 0x7F);
        b[9..12].copy_from_slice(&(self.psn & U24_MASK).to_be_bytes()[1..]);
    }
}

/// RDMA Extended Transport Header: where a WRITE goes (rocev2.md section 4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Reth {
    /// Virtual address of the first byte of the message at the responder.
    pub va: u64,
    /// Remote key of the responder's memory region.
    pub rkey: u32,
    /// Length of the whole message (not of this packet).
    pub dma_len: u32,
}

impl Reth {
    fn parse(b: &[u8]) -> Reth {
        let mut va = [0u8; 8];
        va.copy_from_slice(&b[..8]);
        Reth {
            va: u64::from_be_bytes(va),
            rkey: u32::from_be_bytes([b[8], b[9], b[10], b[11]]),
            dma_len: u32::from_be_bytes([b[12], b[13], b[14], b[15]]),
        }
    }
    fn emit(&self, b: &mut [u8]) {
        b[..8].copy_from_slice(&self.va.to_be_bytes());
        b[8..12].copy_from_slice(&self.rkey.to_be_bytes());
        b[12..16].copy_from_slice(&self.dma_len.to_be_bytes());
    }
}

/// NAK codes of an AETH whose type bits are `11` (rocev2.md 8.4).
pub mod nak {
    /// PSN sequence error: the packet's PSN was ahead of the expected one.
    pub const PSN_SEQUENCE: u8 = 0;
    /// Invalid request (opcode sequence, length, operation not allowed).
    pub const INVALID_REQUEST: u8 = 1;
    /// Remote access error (R_Key, bounds, access rights).
    pub const REMOTE_ACCESS: u8 = 2;
    /// Remote operational error.
    pub const REMOTE_OPERATIONAL: u8 = 3;
}

/// What an AETH syndrome says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AethKind {
    /// ACK with a credit code (31 = invalid, what rxe always sends).
    Ack {
        /// Credit code 0..31.
        credit: u8,
    },
    /// Receiver not ready: retry after the time of this RNR timer code (rocev2.md 8.5).
    RnrNak {
        /// RNR timer code 0..31.
        timer: u8,
    },
    /// Negative acknowledgement with a NAK code (see [`nak`]).
    Nak {
        /// NAK code 0..31.
        code: u8,
    },
    /// Type bits `10` or bit 7 set: reserved.
    Reserved,
}

/// ACK Extended Transport Header (rocev2.md section 4, 8.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Aeth {
    /// Syndrome byte.
    pub syndrome: u8,
    /// Message sequence number (24 bits).
    pub msn: u32,
}

impl Aeth {
    /// Syndrome of an ACK with the invalid credit count, as rxe sends.
    pub const ACK_SYNDROME: u8 = 0x1F;

    /// An AETH of the given kind.
    pub fn new(kind: AethKind, msn: u32) -> Aeth {
        let syndrome = match kind {
            AethKind::Ack { credit } => credit & 0x1F,
            AethKind::RnrNak { timer } => 0x20 | (timer & 0x1F),
            AethKind::Nak { code } => 0x60 | (code & 0x1F),
            AethKind::Reserved => 0x40,
        };
        Aeth {
            syndrome,
            msn: msn & U24_MASK,
        }
    }
    /// The syndrome's meaning.
    pub fn kind(&self) -> AethKind {
        let value = self.syndrome & 0x1F;
        match self.syndrome >> 5 {
            0 => AethKind::Ack { credit: value },
            1 => AethKind::RnrNak { timer: value },
            3 => AethKind::Nak { code: value },
            _ => AethKind::Reserved,
        }
    }
    fn parse(b: &[u8]) -> Aeth {
        Aeth {
            syndrome: b[0],
            msn: u32::from_be_bytes([0, b[1], b[2], b[3]]),
        }
    }
    fn emit(&self, b: &mut [u8]) {
        b[0] = self.syndrome;
        b[1..4].copy_from_slice(&(self.msn & U24_MASK).to_be_bytes()[1..]);
    }
}

/// Microseconds an RNR NAK's timer code asks the requester to wait (rocev2.md 8.5;
/// code 0 is the longest, 655.36 ms).
pub fn rnr_timer_micros(code: u8) -> u64 {
    const US: [u64; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560,
        3_840, 5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880,
        163_840, 245_760, 327_680, 491_520,
    ];
    US[usize::from(code & 0x1F)]
}

/// A parsed RC packet borrowing its payload from the received datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packet<'a> {
    /// Base transport header.
    pub bth: Bth,
    /// RETH of WRITE FIRST/ONLY.
    pub reth: Option<Reth>,
    /// AETH of an Acknowledge.
    pub aeth: Option<Aeth>,
    /// Immediate data of the "with Immediate" opcodes.
    pub immdt: Option<u32>,
    /// The payload (pad excluded).
    pub payload: &'a [u8],
    /// The ICRC as received (the last four bytes read least significant byte first).
    pub icrc: u32,
}

impl<'a> Packet<'a> {
    /// Parse the UDP payload of a RoCEv2 datagram. Checks what rxe checks before it looks at a
    /// QP (rocev2.md 9.1 step 1): the length covers BTH, extension headers, pad and ICRC, TVer is
    /// 0, and the opcode is one we handle. The ICRC is not verified here (see [`IcrcHeaders`]).
    pub fn parse(buf: &'a [u8]) -> Result<Packet<'a>, RoceError> {
        let Some(bth_bytes) = buf.first_chunk::<BTH_LEN>() else {
            return Err(RoceError::Truncated {
                len: buf.len(),
                need: BTH_LEN + ICRC_LEN,
            });
        };
        let bth = Bth::parse(bth_bytes);
        if bth.tver != 0 {
            return Err(RoceError::BadTver(bth.tver));
        }
        if !bth.opcode.is_supported() {
            return Err(RoceError::UnsupportedOpcode(bth.opcode.0));
        }
        let hdr = BTH_LEN + bth.opcode.ext_len();
        let need = hdr + usize::from(bth.pad) + ICRC_LEN;
        if buf.len() < need {
            return Err(RoceError::Truncated {
                len: buf.len(),
                need,
            });
        }
        let mut at = BTH_LEN;
        let mut reth = None;
        let mut aeth = None;
        let mut immdt = None;
        if bth.opcode.has_reth() {
            reth = Some(Reth::parse(&buf[at..at + RETH_LEN]));
            at += RETH_LEN;
        }
        if bth.opcode.has_aeth() {
            aeth = Some(Aeth::parse(&buf[at..at + AETH_LEN]));
            at += AETH_LEN;
        }
        if bth.opcode.has_immdt() {
            immdt = Some(u32::from_be_bytes([
                buf[at],
                buf[at + 1],
                buf[at + 2],
                buf[at + 3],
            ]));
            at += IMMDT_LEN;
        }
        let end = buf.len() - ICRC_LEN;
        let t = &buf[end..];
        Ok(Packet {
            bth,
            reth,
            aeth,
            immdt,
            payload: &buf[at..end - usize::from(bth.pad)],
            icrc: u32::from_le_bytes([t[0], t[1], t[2], t[3]]),
        })
    }

    /// The representation of this packet (for re-emitting it).
    pub fn repr(&self) -> PacketRepr<'a> {
        PacketRepr {
            bth: self.bth,
            reth: self.reth,
            aeth: self.aeth,
            immdt: self.immdt,
            payload: self.payload,
        }
    }
}

/// A packet to emit: headers and payload; pad count and pad bytes are derived from the payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PacketRepr<'a> {
    /// Base transport header; its `pad` and `opcode`-dependent headers are taken from here,
    /// `pad` is overwritten by [`emit`](Self::emit).
    pub bth: Bth,
    /// RETH, written when the opcode has one (zero otherwise).
    pub reth: Option<Reth>,
    /// AETH, written when the opcode has one.
    pub aeth: Option<Aeth>,
    /// Immediate data, written when the opcode has one.
    pub immdt: Option<u32>,
    /// Payload bytes.
    pub payload: &'a [u8],
}

/// Pad bytes after a payload of `len` bytes: (−len) mod 4 (rocev2.md 6.1).
pub const fn pad_len(len: usize) -> usize {
    (4 - len % 4) % 4
}

impl PacketRepr<'_> {
    /// The UDP payload length: headers, payload, pad and ICRC.
    pub fn buffer_len(&self) -> usize {
        BTH_LEN
            + self.bth.opcode.ext_len()
            + self.payload.len()
            + pad_len(self.payload.len())
            + ICRC_LEN
    }

    /// [`emit`](Self::emit) into `out`, whose contents it replaces: the same bytes, each
    /// written once, so a reused buffer (a sender's pool of packet buffers) is neither zeroed
    /// first nor grown when its capacity suffices.
    pub fn emit_to_vec(&self, out: &mut Vec<u8>) {
        out.clear();
        out.reserve(self.buffer_len());
        let pad = pad_len(self.payload.len());
        let mut bth = self.bth;
        bth.pad = pad as u8;
        let mut head = [0u8; BTH_LEN];
        bth.emit(&mut head);
        out.extend_from_slice(&head);
        if bth.opcode.has_reth() {
            let mut b = [0u8; RETH_LEN];
            self.reth.unwrap_or_default().emit(&mut b);
            out.extend_from_slice(&b);
        }
        if bth.opcode.has_aeth() {
            let mut b = [0u8; AETH_LEN];
            self.aeth.unwrap_or_default().emit(&mut b);
            out.extend_from_slice(&b);
        }
        if bth.opcode.has_immdt() {
            out.extend_from_slice(&self.immdt.unwrap_or(0).to_be_bytes());
        }
        out.extend_from_slice(self.payload);
        // Pad and ICRC placeholder: seven zeros cut back to `pad + 4` (a copy of fixed length
        // is a move; one of variable length would call `memmove`).
        out.extend_from_slice(&[0u8; 3 + ICRC_LEN]);
        out.truncate(out.len() - (3 - pad));
    }

    /// [`emit_to_vec`](Self::emit_to_vec) for a payload of `payload_len` bytes that `fill`
    /// writes in place (`self.payload` is not used): the caller copies the payload from where
    /// it lives straight into the packet, once, with no staging buffer. `out` ends up exactly
    /// the packet's length; its old bytes are overwritten, not zeroed first (a buffer at least
    /// that long is cut to length, a shorter one grown with zeros), so `fill` must write every
    /// byte of the slice it is given. Headers, pad and the ICRC placeholder are as
    /// [`emit`](Self::emit) writes them. `fill`'s error is returned as is (`out` then holds no
    /// packet).
    pub fn emit_to_vec_with<E>(
        &self,
        out: &mut Vec<u8>,
        payload_len: usize,
        fill: impl FnOnce(&mut [u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        let pad = pad_len(payload_len);
        let mut bth = self.bth;
        bth.pad = pad as u8;
        let hdr = BTH_LEN + bth.opcode.ext_len();
        out.resize(hdr + payload_len + pad + ICRC_LEN, 0);
        let (head, rest) = out.split_at_mut(hdr);
        self.emit_headers(&bth, head);
        let (payload, tail) = rest.split_at_mut(payload_len);
        fill(payload)?;
        // Pad and ICRC placeholder: at most seven bytes, written one by one (no `memset`).
        for b in tail {
            *b = 0;
        }
        Ok(())
    }

    /// The packet's headers for a payload of `payload_len` bytes that travels apart from them
    /// (a sender that keeps the payload where it is and sends headers, payload, pad and ICRC
    /// as pieces of one datagram): BTH, with the pad count for that payload, and the extension
    /// headers its opcode has, into the start of `head`. Returns their length, `BTH_LEN +
    /// ext_len()`, or an error when `head` is shorter. The bytes are those
    /// [`emit`](Self::emit) writes before the payload (`self.payload` is not used).
    pub fn emit_head(&self, payload_len: usize, head: &mut [u8]) -> Result<usize, RoceError> {
        let mut bth = self.bth;
        bth.pad = pad_len(payload_len) as u8;
        let len = BTH_LEN + bth.opcode.ext_len();
        let Some(out) = head.get_mut(..len) else {
            return Err(RoceError::BufferTooSmall {
                len: head.len(),
                need: len,
            });
        };
        self.emit_headers(&bth, out);
        Ok(len)
    }

    /// BTH (with its pad count set) and the extension headers its opcode has, into `head`
    /// (exactly `BTH_LEN + ext_len()` bytes).
    fn emit_headers(&self, bth: &Bth, head: &mut [u8]) {
        let (b, ext) = head.split_at_mut(BTH_LEN);
        if let Ok(b) = <&mut [u8; BTH_LEN]>::try_from(b) {
            bth.emit(b);
        }
        let mut at = 0;
        if bth.opcode.has_reth() {
            if let Some(r) = ext.get_mut(at..at + RETH_LEN) {
                self.reth.unwrap_or_default().emit(r);
            }
            at += RETH_LEN;
        }
        if bth.opcode.has_aeth() {
            if let Some(a) = ext.get_mut(at..at + AETH_LEN) {
                self.aeth.unwrap_or_default().emit(a);
            }
            at += AETH_LEN;
        }
        if bth.opcode.has_immdt() {
            if let Some(i) = ext.get_mut(at..at + IMMDT_LEN) {
                i.copy_from_slice(&self.immdt.unwrap_or(0).to_be_bytes());
            }
        }
    }

    /// Write the packet into `buf[..buffer_len()]` with zero pad and a zero ICRC placeholder
    /// (fill it with [`IcrcHeaders::seal`]). Returns the length written.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, RoceError> {
        let len = self.buffer_len();
        let Some(out) = buf.get_mut(..len) else {
            return Err(RoceError::BufferTooSmall {
                len: buf.len(),
                need: len,
            });
        };
        let pad = pad_len(self.payload.len());
        let mut bth = self.bth;
        bth.pad = pad as u8;
        let (head, rest) = out.split_at_mut(BTH_LEN + bth.opcode.ext_len());
        self.emit_headers(&bth, head);
        let (payload, tail) = rest.split_at_mut(self.payload.len());
        payload.copy_from_slice(self.payload);
        tail.fill(0);
        Ok(len)
    }
}

/// The IP and UDP fields the ICRC covers (rocev2.md 12.1): addresses, the UDP ports and, over
/// IPv4, the identification and flags/fragment-offset words of the IP header the packet was (or
/// will be) sent with. Lengths follow from the UDP payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IcrcHeaders {
    /// Source IP address.
    pub src: IpAddr,
    /// Destination IP address.
    pub dst: IpAddr,
    /// UDP source port.
    pub src_port: u16,
    /// UDP destination port (4791).
    pub dst_port: u16,
    /// IPv4 identification (ignored for IPv6). A kernel UDP socket that is unconnected and
    /// uses `IP_PMTUDISC_DO` writes 0 (rocev2.md 13.2).
    pub ipv4_id: u16,
    /// IPv4 flags and fragment offset (ignored for IPv6): `0x4000`, don't fragment.
    pub ipv4_flags: u16,
}

/// Register value after the eight `0xFF` bytes that stand for the absent LRH (rocev2.md 12.1).
const LRH_ONES: [u8; 8] = [0xFF; 8];
/// Room for the eight `0xFF`, the longest masked IP and UDP headers (IPv6) and a BTH.
const PRE_MAX: usize = LRH_ONES.len() + 48 + BTH_LEN;

impl IcrcHeaders {
    /// The headers of a packet from `src` to `dst` sent the way the engine sends (identification
    /// 0, don't fragment).
    pub fn new(src: IpAddr, dst: IpAddr, src_port: u16) -> IcrcHeaders {
        IcrcHeaders {
            src,
            dst,
            src_port,
            dst_port: UDP_PORT,
            ipv4_id: 0,
            ipv4_flags: 0x4000,
        }
    }

    /// The masked pseudo-header (IP with variant fields set to ones, then UDP with the
    /// checksum set to ones) for a UDP payload of `udp_payload_len` bytes, into `out`; returns
    /// its length (28 for IPv4, 48 for IPv6).
    fn pseudo_header(&self, udp_payload_len: usize, out: &mut [u8; 48]) -> usize {
        let udp_len = (8 + udp_payload_len) as u16;
        let ip_len = match (self.src, self.dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                let total = 20u16.wrapping_add(udp_len);
                out[0] = 0x45;
                out[1] = 0xFF; // TOS (DSCP + ECN): masked
                out[2..4].copy_from_slice(&total.to_be_bytes());
                out[4..6].copy_from_slice(&self.ipv4_id.to_be_bytes());
                out[6..8].copy_from_slice(&self.ipv4_flags.to_be_bytes());
                out[8] = 0xFF; // TTL: masked
                out[9] = 17;
                out[10] = 0xFF; // header checksum: masked
                out[11] = 0xFF;
                out[12..16].copy_from_slice(&s.octets());
                out[16..20].copy_from_slice(&d.octets());
                20
            }
            (s, d) => {
                // Traffic class and flow label all ones, hop limit masked.
                out[0..4].copy_from_slice(&[0x6F, 0xFF, 0xFF, 0xFF]);
                out[4..6].copy_from_slice(&udp_len.to_be_bytes());
                out[6] = 17;
                out[7] = 0xFF;
                out[8..24].copy_from_slice(&v6(s).octets());
                out[24..40].copy_from_slice(&v6(d).octets());
                40
            }
        };
        let u = &mut out[ip_len..ip_len + 8];
        u[0..2].copy_from_slice(&self.src_port.to_be_bytes());
        u[2..4].copy_from_slice(&self.dst_port.to_be_bytes());
        u[4..6].copy_from_slice(&udp_len.to_be_bytes());
        u[6] = 0xFF; // UDP checksum: masked
        u[7] = 0xFF;
        ip_len + 8
    }

    /// The ICRC of a UDP payload (`udp_payload` includes the four ICRC bytes, which are not
    /// covered): CRC-32 (zlib parameters) over eight `0xFF`, the masked IP and UDP headers,
    /// the BTH with byte 4 set to ones, and the rest up to the ICRC (rocev2.md 12.1).
    /// Payloads shorter than a BTH plus ICRC are hashed as they are.
    pub fn compute(&self, udp_payload: &[u8]) -> u32 {
        let mut h = self.hasher_to_bth(udp_payload);
        let end = udp_payload.len().saturating_sub(ICRC_LEN);
        if end > BTH_LEN {
            h.update(&udp_payload[BTH_LEN..end]);
        }
        h.finalize()
    }

    /// [`compute`](Self::compute) of a packet held in pieces: `head` (the BTH and the
    /// extension headers), `payload`, `pad` zero bytes (at most 3) and the four ICRC bytes,
    /// which are not covered. The same value as `compute` over the pieces laid end to end: the
    /// CRC runs over the header bytes, then over the payload where it lies, with no copy.
    pub fn compute_pieces(&self, head: &[u8], payload: &[u8], pad: usize) -> u32 {
        let pad = pad.min(3);
        let len = head.len() + payload.len() + pad + ICRC_LEN;
        if head.len() < BTH_LEN {
            // Not a packet of ours (every one has a whole BTH); hashed the plain way.
            let mut flat = Vec::with_capacity(len);
            flat.extend_from_slice(head);
            flat.extend_from_slice(payload);
            flat.extend_from_slice(&[0u8; 3 + ICRC_LEN][..pad + ICRC_LEN]);
            return self.compute(&flat);
        }
        let mut h = self.hasher_from(len, &head[..BTH_LEN]);
        h.update(&head[BTH_LEN..]);
        h.update(payload);
        h.update(&[0u8; 3][..pad]);
        h.finalize()
    }

    /// A hasher that has consumed the pseudo-packet up to the end of the (masked) BTH: the
    /// eight `0xFF`, the masked IP and UDP headers and the masked BTH laid out in one buffer
    /// and hashed in one update (48 bytes over IPv4: crc32fast folds them with PCLMULQDQ,
    /// where three updates of 8, 28 and 12 bytes each went through its byte table — about 2 %
    /// of a stream's receiver, docs/performance.md).
    fn hasher_to_bth(&self, udp_payload: &[u8]) -> crc32fast::Hasher {
        let end = udp_payload.len().saturating_sub(ICRC_LEN);
        self.hasher_from(udp_payload.len(), &udp_payload[..end.min(BTH_LEN)])
    }

    /// The eight `0xFF` and the masked IP and UDP headers for a UDP payload of `len` bytes,
    /// at the start of `pre`; returns how many bytes (36 over IPv4, 56 over IPv6). Copies of
    /// fixed lengths (IPv4 or IPv6 headers) in the usual cases: the compiler makes them moves,
    /// where a copy of a variable length calls `memmove`.
    fn lrh_and_pseudo_header(&self, len: usize, pre: &mut [u8; PRE_MAX]) -> usize {
        pre[..LRH_ONES.len()].copy_from_slice(&LRH_ONES);
        let mut ph = [0u8; 48];
        let n = self.pseudo_header(len, &mut ph);
        let at = LRH_ONES.len();
        if n == 28 {
            pre[at..at + 28].copy_from_slice(&ph[..28]);
        } else {
            pre[at..at + 48].copy_from_slice(&ph);
        }
        at + n
    }

    /// The covered bytes in front of the BTH of an IPv4 packet whose UDP payload is `len`
    /// bytes: the eight `0xFF` and the masked IPv4 and UDP headers (rocev2.md 12.1), 36 bytes,
    /// for a caller that hashes them with the packet's own bytes in blocks of its choosing (the
    /// roce backend seals four packets at a time in 64-byte blocks: these 36, the BTH and the
    /// RETH make the first). `None` over IPv6, whose 56 bytes make no such block.
    pub fn ipv4_pre_bth(&self, len: usize) -> Option<[u8; 36]> {
        if !matches!((self.src, self.dst), (IpAddr::V4(_), IpAddr::V4(_))) {
            return None;
        }
        let mut pre = [0u8; PRE_MAX];
        let n = self.lrh_and_pseudo_header(len, &mut pre);
        pre.first_chunk::<36>().filter(|_| n == 36).copied()
    }

    /// [`hasher_to_bth`](Self::hasher_to_bth) of a UDP payload of `len` bytes whose covered
    /// bytes start with `bth` (its whole BTH, or all it covers when shorter).
    fn hasher_from(&self, len: usize, bth: &[u8]) -> crc32fast::Hasher {
        // A whole BTH copied as a fixed length in the usual case (a move, not `memmove`).
        let mut pre = [0u8; PRE_MAX];
        let at = self.lrh_and_pseudo_header(len, &mut pre);
        let bth_end = bth.len().min(BTH_LEN);
        match bth.first_chunk::<BTH_LEN>() {
            Some(b) => pre[at..at + BTH_LEN].copy_from_slice(b),
            None => pre[at..at + bth_end].copy_from_slice(&bth[..bth_end]),
        }
        if bth_end > 4 {
            pre[at + 4] = 0xFF; // FECN, BECN, reserved: masked
        }
        let mut h = crc32fast::Hasher::new();
        h.update(&pre[..at + bth_end]);
        h
    }

    /// The ICRC's fixed start for UDP payloads of `udp_payload_len` bytes with these headers:
    /// the eight `0xFF` and the masked IP and UDP headers hashed once, for the packets of one
    /// length that follow (a run of full-size packets, the segments of a coalesced datagram),
    /// so each of them hashes only its own bytes ([`IcrcPrefix`]).
    pub fn prefix(&self, udp_payload_len: usize) -> IcrcPrefix {
        self.prefix_with(udp_payload_len, bth_mask_fix(udp_payload_len))
    }

    /// [`prefix`](Self::prefix) with the mask correction for the length already known
    /// ([`bth_mask_fix`], which a caller may keep per length: it is most of the cost).
    pub fn prefix_with(&self, udp_payload_len: usize, mask_fix: u32) -> IcrcPrefix {
        let mut pre = [0u8; PRE_MAX];
        let n = self.lrh_and_pseudo_header(udp_payload_len, &mut pre);
        let mut h = crc32fast::Hasher::new();
        h.update(&pre[..n]);
        IcrcPrefix {
            headers: *self,
            len: udp_payload_len,
            crc: h.finalize(),
            mask_fix,
        }
    }

    /// Compute the ICRC and store it in the last four bytes, least significant byte first.
    pub fn seal(&self, udp_payload: &mut [u8]) {
        let icrc = self.compute(udp_payload);
        if let Some(tail) = udp_payload.last_chunk_mut::<ICRC_LEN>() {
            *tail = icrc.to_le_bytes();
        }
    }

    /// Whether the last four bytes hold the right ICRC for these headers.
    pub fn verify(&self, udp_payload: &[u8]) -> bool {
        match udp_payload.last_chunk::<ICRC_LEN>() {
            Some(t) if udp_payload.len() >= BTH_LEN + ICRC_LEN => {
                u32::from_le_bytes(*t) == self.compute(udp_payload)
            }
            _ => false,
        }
    }

    /// For an IPv4 packet received through a socket (which hides the IP header): the IPv4
    /// identification the sender must have used for the received ICRC to be right, assuming
    /// don't-fragment and offset 0, or `None` when no identification fits (the packet is
    /// corrupt). rocev2.md 13.3: for a fixed length the ICRC is affine in the identification's
    /// 16 bits, ICRC(id) = ICRC(0) ⊕ L·id, and L has full rank, so the solution is unique.
    /// Costs one CRC pass over the packet plus 17 CRC combinations. This check is 16 bits
    /// weaker than a full one (a random corruption passes with probability 2⁻¹⁶).
    pub fn solve_ipv4_id(&self, udp_payload: &[u8]) -> Option<u16> {
        if !matches!((self.src, self.dst), (IpAddr::V4(_), IpAddr::V4(_))) {
            return None;
        }
        let t = udp_payload.last_chunk::<ICRC_LEN>()?;
        if udp_payload.len() < BTH_LEN + ICRC_LEN {
            return None;
        }
        let mut base = *self;
        base.ipv4_id = 0;
        let diff = u32::from_le_bytes(*t) ^ base.compute(udp_payload);
        Ipv4IdColumns::for_len(udp_payload.len()).solve(diff)
    }
}

/// Zero bytes to hash in [`bth_mask_fix`].
static ZEROS: [u8; 1024] = [0; 1024];

/// For UDP payloads of `udp_payload_len` bytes: what the ICRC's mask of BTH byte 4 (FECN,
/// BECN, reserved: hashed as ones) changes in the CRC of a packet whose byte 4 is 0 (every
/// packet this engine sends, and rxe's). CRC-32 is affine, so such a packet can be hashed as
/// it lies and this XORed in: the linear part of a 0xFF followed by the covered bytes after
/// byte 4. Depends on the length only; costs two CRC passes over that many zero bytes.
pub fn bth_mask_fix(udp_payload_len: usize) -> u32 {
    let after = udp_payload_len.saturating_sub(ICRC_LEN + 5);
    let linear = |first: u8| {
        let mut z = crc32fast::Hasher::new();
        z.update(&[first]);
        let mut left = after;
        while left > 0 {
            let k = left.min(ZEROS.len());
            z.update(&ZEROS[..k]);
            left -= k;
        }
        z.finalize()
    };
    linear(0xFF) ^ linear(0)
}

/// [`IcrcHeaders::prefix`]: the ICRC's running value after the part of the pseudo-packet
/// that is the same for every UDP payload of one length between two endpoints, and the
/// correction for the BTH's masked byte. Per packet this saves the pseudo-header's assembly,
/// the copy and mask of the BTH and one CRC update — about 30 ns of a 1,024-byte packet's 100
/// (docs/performance.md, "Session 21").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IcrcPrefix {
    headers: IcrcHeaders,
    len: usize,
    crc: u32,
    mask_fix: u32,
}

impl IcrcPrefix {
    /// A prefix for no length: every packet is computed the full way (where too few packets
    /// of one length follow for [`IcrcHeaders::prefix`]'s own cost to pay).
    pub fn none(headers: IcrcHeaders) -> IcrcPrefix {
        IcrcPrefix {
            headers,
            len: 0,
            crc: 0,
            mask_fix: 0,
        }
    }

    /// [`IcrcHeaders::seal`] with [`compute`](Self::compute).
    pub fn seal(&self, udp_payload: &mut [u8]) {
        let icrc = self.compute(udp_payload);
        if let Some(tail) = udp_payload.last_chunk_mut::<ICRC_LEN>() {
            *tail = icrc.to_le_bytes();
        }
    }

    /// The UDP payload length the prefix was made for.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the prefix is for payloads of no bytes (never a packet).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// [`IcrcHeaders::compute`] of `udp_payload`: with the prefix when the payload has its
    /// length, a whole BTH and byte 4 clear, else the full computation.
    pub fn compute(&self, udp_payload: &[u8]) -> u32 {
        let end = udp_payload.len().saturating_sub(ICRC_LEN);
        if udp_payload.len() != self.len || end < BTH_LEN || udp_payload[4] != 0 {
            return self.headers.compute(udp_payload);
        }
        let mut h = crc32fast::Hasher::new_with_initial(self.crc);
        h.update(&udp_payload[..end]);
        h.finalize() ^ self.mask_fix
    }

    /// [`IcrcHeaders::compute_pieces`] with the prefix when the pieces make a packet of its
    /// length with a whole BTH whose byte 4 is clear, else the full computation.
    pub fn compute_pieces(&self, head: &[u8], payload: &[u8], pad: usize) -> u32 {
        let pad = pad.min(3);
        let len = head.len() + payload.len() + pad + ICRC_LEN;
        if len != self.len || head.len() < BTH_LEN || head[4] != 0 {
            return self.headers.compute_pieces(head, payload, pad);
        }
        let mut h = crc32fast::Hasher::new_with_initial(self.crc);
        h.update(head);
        h.update(payload);
        h.update(&[0u8; 3][..pad]);
        h.finalize() ^ self.mask_fix
    }
}

/// How the ICRC of an IPv4 packet depends on its identification (rocev2.md 13.3): for a UDP
/// payload of a given length, ICRC(id) = ICRC(0) ⊕ Σ over the set bits j of id of `col[j]`.
/// The columns depend on the length only (not on addresses, ports or content), so a sender can
/// re-seal a packet for another identification — segment k of a `UDP_SEGMENT` send carries
/// identification k (rocev2.md 13.2) — without another pass over it, and a receiver can solve
/// the identification from the ICRC difference alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ipv4IdColumns([u32; 16]);

impl Ipv4IdColumns {
    /// The columns for a UDP payload of `udp_payload_len` bytes (ICRC included).
    pub fn for_len(udp_payload_len: usize) -> Ipv4IdColumns {
        // The pseudo-packet is 8 × FF, IPv4 bytes 0..4, the identification, then 22 more
        // header bytes (IPv4 6..20, UDP 0..8) and the payload up to the ICRC. CRC-32 is affine,
        // so the difference two identifications make is the CRC's linear part of the
        // identification bytes alone, carried through the bytes after them; any content of
        // the same length gives the same difference.
        let tail = 22 + udp_payload_len.saturating_sub(ICRC_LEN) as u64;
        let full = |id: u16| {
            let mut h = crc32fast::Hasher::new();
            h.update(&[0u8; 12]);
            h.update(&id.to_be_bytes());
            h.combine(&crc32fast::Hasher::new_with_initial_len(0, tail));
            h.finalize()
        };
        let zero = full(0);
        let mut cols = [0u32; 16];
        for (j, c) in cols.iter_mut().enumerate() {
            *c = full(1 << j) ^ zero;
        }
        Ipv4IdColumns(cols)
    }

    /// ICRC(id) ⊕ ICRC(0).
    pub fn delta(&self, id: u16) -> u32 {
        // One XOR per set bit (segment k of a send has k < 64: at most six).
        let mut acc = 0;
        let mut bits = id;
        while bits != 0 {
            acc ^= self.0[bits.trailing_zeros() as usize];
            bits &= bits - 1;
        }
        acc
    }

    /// The identification whose [`delta`](Self::delta) is `icrc_diff`, or `None` when none
    /// is (the packet is corrupt).
    pub fn solve(&self, icrc_diff: u32) -> Option<u16> {
        solve_gf2(&self.0, icrc_diff)
    }
}

/// Solve `Σ x_j·cols[j] = target` over GF(2) for the 16 bits x_j by Gaussian elimination.
fn solve_gf2(cols: &[u32; 16], target: u32) -> Option<u16> {
    // Each pivot row is a (column combination, which x bits it is made of).
    let mut basis: Vec<(u32, u16)> = Vec::with_capacity(16);
    for (j, &c) in cols.iter().enumerate() {
        let mut v = c;
        let mut m = 1u16 << j;
        for &(bv, bm) in &basis {
            if v ^ bv < v {
                v ^= bv;
                m ^= bm;
            }
        }
        if v != 0 {
            basis.push((v, m));
            basis.sort_by_key(|b| std::cmp::Reverse(b.0));
        }
    }
    let mut t = target;
    let mut x = 0u16;
    for &(bv, bm) in &basis {
        if t ^ bv < t {
            t ^= bv;
            x ^= bm;
        }
    }
    (t == 0).then_some(x)
}

fn v6(a: IpAddr) -> Ipv6Addr {
    match a {
        IpAddr::V4(v) => v.to_ipv6_mapped(),
        IpAddr::V6(v) => v,
    }
}

/// The IPv4 address of an IPv4-mapped GID `::ffff:a.b.c.d` (rocev2.md 11.1), else `None`.
pub fn gid_ipv4(gid: [u8; 16]) -> Option<Ipv4Addr> {
    Ipv6Addr::from(gid).to_ipv4_mapped()
}

/// The IP address a GID stands for: IPv4 for a v4-mapped GID, else IPv6.
pub fn gid_ip(gid: [u8; 16]) -> IpAddr {
    match gid_ipv4(gid) {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(Ipv6Addr::from(gid)),
    }
}

/// The ICRC of a whole IP packet as captured (IPv4 without options or IPv6 without extension
/// headers, carrying UDP): the headers are read from the packet, so the identification and
/// flags are the ones really sent. `None` when the bytes are not such a packet.
pub fn icrc_of_ip_packet(ip: &[u8]) -> Option<(IcrcHeaders, &[u8])> {
    let version = ip.first()? >> 4;
    let (headers, udp) = match version {
        4 if ip.len() >= 28 && ip[0] == 0x45 && ip[9] == 17 => {
            let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
            let udp = ip.get(20..total.min(ip.len()))?;
            let h = IcrcHeaders {
                src: IpAddr::V4(Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15])),
                dst: IpAddr::V4(Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19])),
                src_port: 0,
                dst_port: 0,
                ipv4_id: u16::from_be_bytes([ip[4], ip[5]]),
                ipv4_flags: u16::from_be_bytes([ip[6], ip[7]]),
            };
            (h, udp)
        }
        6 if ip.len() >= 48 && ip[6] == 17 => {
            let plen = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
            let udp = ip.get(40..(40 + plen).min(ip.len()))?;
            let mut s = [0u8; 16];
            let mut d = [0u8; 16];
            s.copy_from_slice(&ip[8..24]);
            d.copy_from_slice(&ip[24..40]);
            let h = IcrcHeaders {
                src: IpAddr::V6(Ipv6Addr::from(s)),
                dst: IpAddr::V6(Ipv6Addr::from(d)),
                src_port: 0,
                dst_port: 0,
                ipv4_id: 0,
                ipv4_flags: 0,
            };
            (h, udp)
        }
        _ => return None,
    };
    if udp.len() < 8 {
        return None;
    }
    let headers = IcrcHeaders {
        src_port: u16::from_be_bytes([udp[0], udp[1]]),
        dst_port: u16::from_be_bytes([udp[2], udp[3]]),
        ..headers
    };
    Some((headers, &udp[8..]))
}

/// PSN arithmetic modulo 2²⁴ as rxe compares (rocev2.md 7): positive when `a` is later than
/// `b` (within 2²³ ahead), negative when earlier, 0 when equal.
pub fn psn_diff(a: u32, b: u32) -> i32 {
    (a.wrapping_sub(b) << 8) as i32 >> 8
}

/// `psn + n` modulo 2²⁴.
pub fn psn_add(psn: u32, n: u32) -> u32 {
    psn.wrapping_add(n) & U24_MASK
}

#[cfg(test)]
mod tests;
