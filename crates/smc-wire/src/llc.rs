//! LLC (Link Layer Control) messages: RFC 7609 A.3, wire-formats.md §7.
//!
//! Every LLC message is 44 bytes, sent as an IB SEND on a link's RC QP. The first four bytes
//! are type, length (44), one reserved byte (the reject reason in ADD LINK) and flags, whose
//! top bit `0x80` marks a reply.

use crate::codec::{check_room, Reader, Writer};
use crate::error::{Error, Result};
use crate::types::{wire_enum, Gid, Mac, QpMtu, U24};
use crate::MSG44_LEN;

/// The reply flag, bit 0x80 of byte 3 in every LLC message.
pub const FLAG_REPLY: u8 = 0x80;

wire_enum! {
    /// The LLC type byte (RFC 7609 A.3).
    pub struct LlcType(u8) {
        /// CONFIRM LINK.
        CONFIRM_LINK = 0x01 => "CONFIRM LINK",
        /// ADD LINK.
        ADD_LINK = 0x02 => "ADD LINK",
        /// ADD LINK CONTINUATION.
        ADD_LINK_CONT = 0x03 => "ADD LINK CONTINUATION",
        /// DELETE LINK.
        DELETE_LINK = 0x04 => "DELETE LINK",
        /// CONFIRM RKEY.
        CONFIRM_RKEY = 0x06 => "CONFIRM RKEY",
        /// TEST LINK.
        TEST_LINK = 0x07 => "TEST LINK",
        /// CONFIRM RKEY CONTINUATION.
        CONFIRM_RKEY_CONT = 0x08 => "CONFIRM RKEY CONTINUATION",
        /// DELETE RKEY.
        DELETE_RKEY = 0x09 => "DELETE RKEY",
    }
}

impl LlcType {
    /// RFC 7609 A.3: "The two high-order bits of the type ... b'10' ... optional ... the
    /// receiver can silently discard" an optional message it does not support.
    pub fn is_optional(self) -> bool {
        self.0 & 0xC0 == 0x80
    }
}

wire_enum! {
    /// DELETE LINK reason codes (RFC 7609 A.3.4; `0x00200000` is Linux's).
    pub struct DeleteLinkReason(u32) {
        /// Lost path (link failure).
        LOST_PATH = 0x0001_0000 => "lost path",
        /// Operator initiated termination.
        OPERATOR_INITIATED = 0x0002_0000 => "operator initiated termination",
        /// Program initiated termination (e.g. link inactivity).
        PROGRAM_INITIATED = 0x0003_0000 => "program initiated termination",
        /// LLC protocol violation.
        PROTOCOL_VIOLATION = 0x0004_0000 => "LLC protocol violation",
        /// Asymmetric link no longer needed.
        ASYM_NOT_NEEDED = 0x0005_0000 => "asymmetric link no longer needed",
        /// Reply: unknown link ID.
        UNKNOWN_LINK = 0x0010_0000 => "unknown link ID",
        /// Reply (Linux): unknown link group.
        UNKNOWN_LINK_GROUP = 0x0020_0000 => "unknown link group",
    }
}

wire_enum! {
    /// ADD LINK reject reasons (low nibble of byte 2 in a rejected reply).
    pub struct AddLinkRejectReason(u8) {
        /// No alternate path available.
        NO_ALTERNATE_PATH = 1 => "no alternate path available",
        /// Invalid MTU value.
        INVALID_MTU = 2 => "invalid MTU value",
    }
}

/// A checked view of any LLC (or CDC) message: 44 bytes with length byte 44.
#[derive(Debug, Clone, Copy)]
pub struct LlcPacket<T: AsRef<[u8]>> {
    buf: T,
}

impl<T: AsRef<[u8]>> LlcPacket<T> {
    /// Wrap `buf` after checking that it holds at least 44 bytes and its length byte says 44
    /// (Linux drops version-1 LLC messages with any other length).
    pub fn new_checked(buf: T) -> Result<Self> {
        let b = buf.as_ref();
        if b.len() < MSG44_LEN {
            return Err(Error::Truncated {
                what: "LLC",
                need: MSG44_LEN,
                have: b.len(),
            });
        }
        if usize::from(b[1]) != MSG44_LEN {
            return Err(Error::BadLength {
                what: "LLC",
                found: usize::from(b[1]),
                expected: "44",
            });
        }
        Ok(LlcPacket { buf })
    }

    fn byte(&self, i: usize) -> u8 {
        self.buf.as_ref().get(i).copied().unwrap_or(0)
    }

    /// The type byte.
    pub fn msg_type(&self) -> LlcType {
        LlcType(self.byte(0))
    }

    /// The flags byte (byte 3).
    pub fn flags(&self) -> u8 {
        self.byte(3)
    }

    /// Whether the reply flag is set.
    pub fn is_reply(&self) -> bool {
        self.flags() & FLAG_REPLY != 0
    }

    /// The 44 message bytes.
    pub fn as_bytes(&self) -> &[u8] {
        let b = self.buf.as_ref();
        &b[..MSG44_LEN.min(b.len())]
    }
}

/// CONFIRM LINK (type 1, RFC 7609 A.3.1): each side describes itself on a new link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ConfirmLink {
    /// Reply flag.
    pub reply: bool,
    /// Linux's flag bits `0x03`: the sender's RMBEs carry no eye catcher (cursors from 0).
    pub no_rmbe_eyecatcher: bool,
    /// Sender's RoCE MAC.
    pub sender_mac: Mac,
    /// Sender's GID.
    pub sender_gid: Gid,
    /// Sender's QP number.
    pub sender_qp: U24,
    /// Link number, assigned by the server.
    pub link_num: u8,
    /// Link user ID (opaque, for display).
    pub link_user_id: u32,
    /// Most links the sender supports per link group.
    pub max_links: u8,
    /// Byte 35: Linux SMC-R v2.1 "max connections"; zero in version 1.
    pub max_conns: u8,
}

/// ADD LINK (type 2, RFC 7609 A.3.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AddLink {
    /// Reply flag.
    pub reply: bool,
    /// Z flag (0x40): the request is rejected (replies only).
    pub rejected: bool,
    /// Reject reason (byte 2, low nibble).
    pub reject_reason: AddLinkRejectReason,
    /// Sender's RoCE MAC for the new link.
    pub sender_mac: Mac,
    /// Sender's GID for the new link.
    pub sender_gid: Gid,
    /// Sender's QP number for the new link.
    pub sender_qp: U24,
    /// Link number of the new link.
    pub link_num: u8,
    /// QP MTU code (byte 32, low nibble).
    pub mtu: QpMtu,
    /// Initial packet sequence number.
    pub initial_psn: U24,
}

/// One RToken pair of ADD LINK CONTINUATION: an RMB identified by its rkey on the link the
/// message travels on, and the same RMB's rkey and address on the new link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RtokenPair {
    /// The RMB's rkey on the link this message travels on.
    pub reference_rkey: u32,
    /// The RMB's rkey on the new link.
    pub new_rkey: u32,
    /// The RMB's virtual address on the new link.
    pub new_vaddr: u64,
}

/// ADD LINK CONTINUATION (type 3, RFC 7609 A.3.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct AddLinkCont {
    /// Reply flag.
    pub reply: bool,
    /// The new link's number.
    pub link_num: u8,
    /// RTokens still to send, including the ones in this message (≤ 2 → last message).
    pub num_rtokens: u8,
    /// Up to two pairs; those past `num_rtokens` are zero.
    pub pairs: [RtokenPair; 2],
}

impl AddLinkCont {
    /// The pairs this message actually carries.
    pub fn valid_pairs(&self) -> &[RtokenPair] {
        &self.pairs[..usize::from(self.num_rtokens.min(2))]
    }
}

/// DELETE LINK (type 4, RFC 7609 A.3.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct DeleteLink {
    /// Reply flag.
    pub reply: bool,
    /// A flag (0x40): delete all links, terminating the link group.
    pub all: bool,
    /// O flag (0x20): orderly termination.
    pub orderly: bool,
    /// The link to delete (0 with `all`).
    pub link_num: u8,
    /// Reason code.
    pub reason: DeleteLinkReason,
}

/// A link's RToken for one RMB in CONFIRM RKEY (CONTINUATION): link number, rkey, address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct LinkRtoken {
    /// Link number.
    pub link_num: u8,
    /// The RMB's rkey on that link.
    pub rkey: u32,
    /// The RMB's virtual address on that link.
    pub vaddr: u64,
}

/// CONFIRM RKEY (type 6, RFC 7609 A.3.5): a new RMB's RToken on every link of the group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ConfirmRkey {
    /// Reply flag.
    pub reply: bool,
    /// Z flag (0x20): negative reply.
    pub negative: bool,
    /// C flag (0x10): retry after the current configuration change.
    pub retry: bool,
    /// Number of other links' tokens (not counting this link's).
    pub num_tokens: u8,
    /// The RMB's rkey on the link the message travels on.
    pub rkey: u32,
    /// The RMB's virtual address on that link.
    pub vaddr: u64,
    /// Up to two other links' tokens.
    pub others: [LinkRtoken; 2],
}

/// CONFIRM RKEY CONTINUATION (type 8, RFC 7609 A.3.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ConfirmRkeyCont {
    /// Reply flag.
    pub reply: bool,
    /// Z flag (0x20): negative reply.
    pub negative: bool,
    /// Tokens left including these (≤ 3 → last message).
    pub num_tokens_left: u8,
    /// Up to three link tokens.
    pub tokens: [LinkRtoken; 3],
}

/// DELETE RKEY (type 9, RFC 7609 A.3.7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct DeleteRkey {
    /// Reply flag.
    pub reply: bool,
    /// Z flag (0x20): negative reply (some rkey unknown).
    pub negative: bool,
    /// Number of RMBs deleted, 1..8.
    pub count: u8,
    /// Reply only: bit 0x80 = first rkey failed, 0x40 = second, ...
    pub error_mask: u8,
    /// Up to 8 rkeys (as known on this link); unused ones zero.
    pub rkeys: [u32; 8],
}

impl DeleteRkey {
    /// The rkeys this message actually names.
    pub fn valid_rkeys(&self) -> &[u32] {
        &self.rkeys[..usize::from(self.count.min(8))]
    }
}

/// TEST LINK (type 7, RFC 7609 A.3.8): keepalive; the reply echoes the user data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TestLink {
    /// Reply flag.
    pub reply: bool,
    /// 16 bytes echoed unchanged by the peer.
    pub user_data: [u8; 16],
}

/// Any LLC message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LlcMessage {
    /// CONFIRM LINK.
    ConfirmLink(ConfirmLink),
    /// ADD LINK.
    AddLink(AddLink),
    /// ADD LINK CONTINUATION.
    AddLinkCont(AddLinkCont),
    /// DELETE LINK.
    DeleteLink(DeleteLink),
    /// CONFIRM RKEY.
    ConfirmRkey(ConfirmRkey),
    /// CONFIRM RKEY CONTINUATION.
    ConfirmRkeyCont(ConfirmRkeyCont),
    /// DELETE RKEY.
    DeleteRkey(DeleteRkey),
    /// TEST LINK.
    TestLink(TestLink),
    /// An optional message (type b'10xxxxxx') this implementation does not know: RFC 7609
    /// A.3 lets the receiver silently discard it. The raw bytes are kept for tracing.
    Optional {
        /// The type byte.
        msg_type: u8,
        /// The whole message.
        raw: [u8; MSG44_LEN],
    },
}

fn read_link_rtoken(r: &mut Reader<'_>) -> Result<LinkRtoken> {
    Ok(LinkRtoken {
        link_num: r.u8()?,
        rkey: r.u32()?,
        vaddr: r.u64()?,
    })
}

fn write_link_rtoken(w: &mut Writer<'_>, t: &LinkRtoken) {
    w.u8(t.link_num);
    w.u32(t.rkey);
    w.u64(t.vaddr);
}

impl LlcMessage {
    /// The type byte.
    pub fn msg_type(&self) -> LlcType {
        match self {
            LlcMessage::ConfirmLink(_) => LlcType::CONFIRM_LINK,
            LlcMessage::AddLink(_) => LlcType::ADD_LINK,
            LlcMessage::AddLinkCont(_) => LlcType::ADD_LINK_CONT,
            LlcMessage::DeleteLink(_) => LlcType::DELETE_LINK,
            LlcMessage::ConfirmRkey(_) => LlcType::CONFIRM_RKEY,
            LlcMessage::ConfirmRkeyCont(_) => LlcType::CONFIRM_RKEY_CONT,
            LlcMessage::DeleteRkey(_) => LlcType::DELETE_RKEY,
            LlcMessage::TestLink(_) => LlcType::TEST_LINK,
            LlcMessage::Optional { msg_type, .. } => LlcType(*msg_type),
        }
    }

    /// Whether the reply flag is set.
    pub fn is_reply(&self) -> bool {
        match self {
            LlcMessage::ConfirmLink(m) => m.reply,
            LlcMessage::AddLink(m) => m.reply,
            LlcMessage::AddLinkCont(m) => m.reply,
            LlcMessage::DeleteLink(m) => m.reply,
            LlcMessage::ConfirmRkey(m) => m.reply,
            LlcMessage::ConfirmRkeyCont(m) => m.reply,
            LlcMessage::DeleteRkey(m) => m.reply,
            LlcMessage::TestLink(m) => m.reply,
            LlcMessage::Optional { raw, .. } => raw[3] & FLAG_REPLY != 0,
        }
    }

    /// Parse an LLC message from the first 44 bytes of `buf`.
    ///
    /// An unknown type whose two high-order bits are b'10' parses as
    /// [`LlcMessage::Optional`]; any other unknown type is [`Error::UnknownType`], which a
    /// link treats as a protocol violation (link out of sync).
    pub fn parse(buf: &[u8]) -> Result<LlcMessage> {
        let p = LlcPacket::new_checked(buf)?;
        let bytes = p.as_bytes();
        let flags = p.flags();
        let reply = flags & FLAG_REPLY != 0;
        let mut r = Reader::new(bytes, "LLC");
        r.skip(2)?;
        let byte2 = r.u8()?;
        r.skip(1)?;
        let t = p.msg_type();
        let msg = match t {
            LlcType::CONFIRM_LINK => LlcMessage::ConfirmLink(ConfirmLink {
                reply,
                no_rmbe_eyecatcher: flags & 0x03 != 0,
                sender_mac: Mac(r.array()?),
                sender_gid: Gid(r.array()?),
                sender_qp: U24::truncate(r.u24()?),
                link_num: r.u8()?,
                link_user_id: r.u32()?,
                max_links: r.u8()?,
                max_conns: r.u8()?,
            }),
            LlcType::ADD_LINK => {
                let sender_mac = Mac(r.array()?);
                r.skip(2)?;
                LlcMessage::AddLink(AddLink {
                    reply,
                    rejected: flags & 0x40 != 0,
                    reject_reason: AddLinkRejectReason(byte2 & 0x0F),
                    sender_mac,
                    sender_gid: Gid(r.array()?),
                    sender_qp: U24::truncate(r.u24()?),
                    link_num: r.u8()?,
                    mtu: QpMtu(r.u8()? & 0x0F),
                    initial_psn: U24::truncate(r.u24()?),
                })
            }
            LlcType::ADD_LINK_CONT => {
                let link_num = r.u8()?;
                let num_rtokens = r.u8()?;
                r.skip(2)?;
                let mut pairs = [RtokenPair::default(); 2];
                for p in &mut pairs {
                    *p = RtokenPair {
                        reference_rkey: r.u32()?,
                        new_rkey: r.u32()?,
                        new_vaddr: r.u64()?,
                    };
                }
                LlcMessage::AddLinkCont(AddLinkCont {
                    reply,
                    link_num,
                    num_rtokens,
                    pairs,
                })
            }
            LlcType::DELETE_LINK => LlcMessage::DeleteLink(DeleteLink {
                reply,
                all: flags & 0x40 != 0,
                orderly: flags & 0x20 != 0,
                link_num: r.u8()?,
                reason: DeleteLinkReason(r.u32()?),
            }),
            LlcType::CONFIRM_RKEY => {
                let num_tokens = r.u8()?;
                let rkey = r.u32()?;
                let vaddr = r.u64()?;
                let others = [read_link_rtoken(&mut r)?, read_link_rtoken(&mut r)?];
                LlcMessage::ConfirmRkey(ConfirmRkey {
                    reply,
                    negative: flags & 0x20 != 0,
                    retry: flags & 0x10 != 0,
                    num_tokens,
                    rkey,
                    vaddr,
                    others,
                })
            }
            LlcType::CONFIRM_RKEY_CONT => {
                let num_tokens_left = r.u8()?;
                let tokens = [
                    read_link_rtoken(&mut r)?,
                    read_link_rtoken(&mut r)?,
                    read_link_rtoken(&mut r)?,
                ];
                LlcMessage::ConfirmRkeyCont(ConfirmRkeyCont {
                    reply,
                    negative: flags & 0x20 != 0,
                    num_tokens_left,
                    tokens,
                })
            }
            LlcType::DELETE_RKEY => {
                let count = r.u8()?;
                if count > 8 {
                    return Err(Error::Malformed {
                        what: "DELETE RKEY",
                        why: "count exceeds 8 rkeys",
                    });
                }
                let error_mask = r.u8()?;
                r.skip(2)?;
                let mut rkeys = [0u32; 8];
                for k in &mut rkeys {
                    *k = r.u32()?;
                }
                LlcMessage::DeleteRkey(DeleteRkey {
                    reply,
                    negative: flags & 0x20 != 0,
                    count,
                    error_mask,
                    rkeys,
                })
            }
            LlcType::TEST_LINK => LlcMessage::TestLink(TestLink {
                reply,
                user_data: r.array()?,
            }),
            t if t.is_optional() => {
                let mut raw = [0u8; MSG44_LEN];
                raw.copy_from_slice(bytes);
                LlcMessage::Optional { msg_type: t.0, raw }
            }
            t => {
                return Err(Error::UnknownType {
                    what: "LLC",
                    found: t.0,
                })
            }
        };
        Ok(msg)
    }

    /// Length of the emitted message: always 44.
    pub const fn buffer_len(&self) -> usize {
        MSG44_LEN
    }

    /// Emit into `buf` (at least 44 bytes). Reserved bytes are written as zero.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        check_room(buf, MSG44_LEN)?;
        if let LlcMessage::Optional { raw, .. } = self {
            buf[..MSG44_LEN].copy_from_slice(raw);
            return Ok(MSG44_LEN);
        }
        let rf = |reply: bool| if reply { FLAG_REPLY } else { 0 };
        let (byte2, flags) = match self {
            LlcMessage::ConfirmLink(m) => {
                (0, rf(m.reply) | if m.no_rmbe_eyecatcher { 0x03 } else { 0 })
            }
            LlcMessage::AddLink(m) => (
                m.reject_reason.0 & 0x0F,
                rf(m.reply) | if m.rejected { 0x40 } else { 0 },
            ),
            LlcMessage::AddLinkCont(m) => (0, rf(m.reply)),
            LlcMessage::DeleteLink(m) => (
                0,
                rf(m.reply) | if m.all { 0x40 } else { 0 } | if m.orderly { 0x20 } else { 0 },
            ),
            LlcMessage::ConfirmRkey(m) => (
                0,
                rf(m.reply) | if m.negative { 0x20 } else { 0 } | if m.retry { 0x10 } else { 0 },
            ),
            LlcMessage::ConfirmRkeyCont(m) => (0, rf(m.reply) | if m.negative { 0x20 } else { 0 }),
            LlcMessage::DeleteRkey(m) => (0, rf(m.reply) | if m.negative { 0x20 } else { 0 }),
            LlcMessage::TestLink(m) => (0, rf(m.reply)),
            LlcMessage::Optional { .. } => (0, 0),
        };
        let mut w = Writer::new(&mut buf[..MSG44_LEN]);
        w.u8(self.msg_type().0);
        w.u8(MSG44_LEN as u8);
        w.u8(byte2);
        w.u8(flags);
        match self {
            LlcMessage::ConfirmLink(m) => {
                w.put(&m.sender_mac.0);
                w.put(&m.sender_gid.0);
                w.u24(m.sender_qp.get());
                w.u8(m.link_num);
                w.u32(m.link_user_id);
                w.u8(m.max_links);
                w.u8(m.max_conns);
            }
            LlcMessage::AddLink(m) => {
                w.put(&m.sender_mac.0);
                w.zeros(2);
                w.put(&m.sender_gid.0);
                w.u24(m.sender_qp.get());
                w.u8(m.link_num);
                w.u8(m.mtu.0 & 0x0F);
                w.u24(m.initial_psn.get());
            }
            LlcMessage::AddLinkCont(m) => {
                w.u8(m.link_num);
                w.u8(m.num_rtokens);
                w.zeros(2);
                for p in &m.pairs {
                    w.u32(p.reference_rkey);
                    w.u32(p.new_rkey);
                    w.u64(p.new_vaddr);
                }
            }
            LlcMessage::DeleteLink(m) => {
                w.u8(m.link_num);
                w.u32(m.reason.0);
            }
            LlcMessage::ConfirmRkey(m) => {
                w.u8(m.num_tokens);
                w.u32(m.rkey);
                w.u64(m.vaddr);
                for t in &m.others {
                    write_link_rtoken(&mut w, t);
                }
            }
            LlcMessage::ConfirmRkeyCont(m) => {
                w.u8(m.num_tokens_left);
                for t in &m.tokens {
                    write_link_rtoken(&mut w, t);
                }
            }
            LlcMessage::DeleteRkey(m) => {
                w.u8(m.count);
                w.u8(m.error_mask);
                w.zeros(2);
                for k in &m.rkeys {
                    w.u32(*k);
                }
            }
            LlcMessage::TestLink(m) => w.put(&m.user_data),
            LlcMessage::Optional { .. } => {}
        }
        let n = w.finish()?;
        // Whatever is left of the 44 bytes is reserved: zero.
        buf[n..MSG44_LEN].fill(0);
        Ok(MSG44_LEN)
    }

    /// The 44 wire bytes.
    pub fn to_bytes(&self) -> [u8; MSG44_LEN] {
        let mut b = [0u8; MSG44_LEN];
        let _ = self.emit(&mut b);
        b
    }
}
