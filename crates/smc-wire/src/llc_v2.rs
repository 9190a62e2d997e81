//! LLC messages of an SMC-Rv2 link group (smc-rv2.md §10).
//!
//! The high nibble of the type byte is the LLC version (2), the low nibble the v1 type
//! number. Bytes 1–2 are the total length as a u16 in the **sender's CPU byte order**; Linux
//! on x86-64 writes it little-endian, so we write it little-endian (smc-rv2.md §2). On receipt
//! the size of a message is the size of the SEND (bytes received), never bytes 1–2, which
//! are only checked to be at least 44 as Linux does.
//!
//! CONFIRM LINK, DELETE LINK, CONFIRM RKEY and TEST LINK keep their v1 layout; ADD LINK
//! carries its rkeys itself (no ADD LINK CONTINUATION in v2); DELETE RKEY counts invalid rkeys
//! instead of a bit mask; REQ ADD LINK (`0x25`) is new.

use crate::codec::{check_room, Reader, Writer};
use crate::error::{Error, Result};
use crate::llc::{
    AddLink, ConfirmLink, ConfirmRkey, DeleteLink, LlcMessage, RtokenPair, TestLink, FLAG_REPLY,
};
use crate::types::Gid;
use crate::MSG44_LEN;

/// The LLC version nibble of a v2 type byte.
pub const LLC_VERSION_2: u8 = 0x20;
/// Largest LLC v2 message: the size of a Linux receive buffer in a v2 link group.
pub const LLC_V2_MAX_LEN: usize = 8192;
/// Size of ADD LINK v2 before its rkey entries.
pub const ADD_LINK_V2_FIXED_LEN: usize = 72;
/// Size of one ADD LINK v2 rkey entry.
pub const ADD_LINK_V2_RKEY_LEN: usize = 16;
/// Size of REQ ADD LINK v2 before its GIDs.
pub const REQ_ADD_LINK_V2_FIXED_LEN: usize = 28;
/// Size of DELETE RKEY v2 before its rkeys.
pub const DELETE_RKEY_V2_FIXED_LEN: usize = 8;
/// The v1 type number of REQ ADD LINK (only sent in its v2 form, `0x25`).
pub const REQ_ADD_LINK_TYPE: u8 = 0x05;

/// Whether a SEND's first byte is an LLC version-2 type byte.
pub fn is_v2_type(type_byte: u8) -> bool {
    type_byte & 0xF0 == LLC_VERSION_2
}

/// The v2 extension of ADD LINK (bytes 44 onwards, smc-rv2.md §10.4).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct AddLinkV2Ext {
    /// Byte 44 bit 0x80: the new link needs no IP gateway.
    pub v2_direct: bool,
    /// The GID the peer should connect the new link to (Linux: the sender's new-link GID).
    pub target_gid: Gid,
    /// The rkey count as written (bytes 70–71, CPU order = little-endian). Emitted as is:
    /// set it to `rtokens.len()` when building a message ([`AddLinkV2Ext::new`] does).
    pub rkey_count: u16,
    /// The entries the message really carries: min(count, (length − 72) / 16).
    pub rtokens: Vec<RtokenPair>,
}

impl AddLinkV2Ext {
    /// An extension carrying `rtokens` (at most 65535, and 8120 / 16 to stay within 8192).
    pub fn new(v2_direct: bool, target_gid: Gid, rtokens: Vec<RtokenPair>) -> Self {
        AddLinkV2Ext {
            v2_direct,
            target_gid,
            rkey_count: rtokens.len().min(usize::from(u16::MAX)) as u16,
            rtokens,
        }
    }
}

/// ADD LINK v2 (`0x22`): the v1 fields plus, in a request or an accepting reply, the v2
/// extension. A reject is the request's first 44 bytes with flags `0xC0` and carries no
/// reason (byte 2 is the length's high byte).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct AddLinkV2 {
    /// The fields shared with v1 (`reject_reason` is always 0 in v2).
    pub base: AddLink,
    /// The extension, absent in a 44-byte message (a reject).
    pub ext: Option<AddLinkV2Ext>,
}

/// REQ ADD LINK v2 (`0x25`): a client asks the server to start ADD LINK (smc-rv2.md §10.9).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct ReqAddLinkV2 {
    /// Reply flag.
    pub reply: bool,
    /// The client's RoCEv2 GIDs, the current link's first.
    pub gids: Vec<Gid>,
}

/// DELETE RKEY v2 (`0x29`, smc-rv2.md §10.7).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct DeleteRkeyV2 {
    /// Reply flag.
    pub reply: bool,
    /// Flag 0x20: some rkey was unknown (reply).
    pub negative: bool,
    /// The rkey count as written (a reply echoes the request's).
    pub count: u8,
    /// Reply: the number of rkeys not found (v1 used a bit mask here).
    pub invalid_count: u8,
    /// The rkeys the message carries (a Linux reply zeroes them).
    pub rkeys: Vec<u32>,
}

/// An LLC message in its version-2 form.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum LlcV2Message {
    /// CONFIRM LINK (`0x21`), v1 layout; bytes 34/35 = negotiated max links / max conns.
    ConfirmLink(ConfirmLink),
    /// ADD LINK (`0x22`).
    AddLink(AddLinkV2),
    /// DELETE LINK (`0x24`), v1 layout.
    DeleteLink(DeleteLink),
    /// REQ ADD LINK (`0x25`).
    ReqAddLink(ReqAddLinkV2),
    /// CONFIRM RKEY (`0x26`), v1 layout.
    ConfirmRkey(ConfirmRkey),
    /// TEST LINK (`0x27`), v1 layout.
    TestLink(TestLink),
    /// DELETE RKEY (`0x29`).
    DeleteRkey(DeleteRkeyV2),
}

impl LlcV2Message {
    /// The type byte (with the version nibble).
    pub fn type_byte(&self) -> u8 {
        LLC_VERSION_2
            | match self {
                LlcV2Message::ConfirmLink(_) => 0x01,
                LlcV2Message::AddLink(_) => 0x02,
                LlcV2Message::DeleteLink(_) => 0x04,
                LlcV2Message::ReqAddLink(_) => REQ_ADD_LINK_TYPE,
                LlcV2Message::ConfirmRkey(_) => 0x06,
                LlcV2Message::TestLink(_) => 0x07,
                LlcV2Message::DeleteRkey(_) => 0x09,
            }
    }

    /// The name of the message type.
    pub fn name(&self) -> &'static str {
        match self {
            LlcV2Message::ConfirmLink(_) => "CONFIRM LINK",
            LlcV2Message::AddLink(_) => "ADD LINK",
            LlcV2Message::DeleteLink(_) => "DELETE LINK",
            LlcV2Message::ReqAddLink(_) => "REQ ADD LINK",
            LlcV2Message::ConfirmRkey(_) => "CONFIRM RKEY",
            LlcV2Message::TestLink(_) => "TEST LINK",
            LlcV2Message::DeleteRkey(_) => "DELETE RKEY",
        }
    }

    /// Whether the reply flag is set.
    pub fn is_reply(&self) -> bool {
        match self {
            LlcV2Message::ConfirmLink(m) => m.reply,
            LlcV2Message::AddLink(m) => m.base.reply,
            LlcV2Message::DeleteLink(m) => m.reply,
            LlcV2Message::ReqAddLink(m) => m.reply,
            LlcV2Message::ConfirmRkey(m) => m.reply,
            LlcV2Message::TestLink(m) => m.reply,
            LlcV2Message::DeleteRkey(m) => m.reply,
        }
    }

    /// The length field (bytes 1–2) of a received v2 message, read little-endian as an x86
    /// Linux sender writes it.
    pub fn length_field(buf: &[u8]) -> Option<u16> {
        Some(u16::from_le_bytes([*buf.get(1)?, *buf.get(2)?]))
    }

    /// Parse a received v2 LLC message; `buf` is exactly the bytes of the SEND.
    ///
    /// Checks what Linux checks (at least 44 bytes, the CPU-order length at least 44), plus at
    /// most 8192 bytes (larger SENDs cannot arrive in a Linux v2 link group). Types Linux does
    /// not register in v2 form (`0x23`, `0x28`, others) are [`Error::UnknownType`].
    pub fn parse(buf: &[u8]) -> Result<LlcV2Message> {
        if buf.len() < MSG44_LEN {
            return Err(Error::Truncated {
                what: "LLC v2",
                need: MSG44_LEN,
                have: buf.len(),
            });
        }
        if buf.len() > LLC_V2_MAX_LEN {
            return Err(Error::BadLength {
                what: "LLC v2",
                found: buf.len(),
                expected: "at most 8192",
            });
        }
        let t = buf[0];
        if !is_v2_type(t) {
            return Err(Error::UnknownType {
                what: "LLC v2",
                found: t,
            });
        }
        let length_field = Self::length_field(buf).unwrap_or(0);
        if usize::from(length_field) < MSG44_LEN {
            return Err(Error::BadLength {
                what: "LLC v2",
                found: usize::from(length_field),
                expected: "a length field of at least 44",
            });
        }
        let flags = buf[3];
        let reply = flags & FLAG_REPLY != 0;
        // The four messages that keep the v1 layout parse through the v1 parser once their
        // header is put in v1 form (byte 2, the v1 reserved/reason byte, is the length's high
        // byte here and means nothing).
        let as_v1 = || {
            let mut b = [0u8; MSG44_LEN];
            b.copy_from_slice(&buf[..MSG44_LEN]);
            b[0] = t & 0x0F;
            b[1] = MSG44_LEN as u8;
            b[2] = 0;
            LlcMessage::parse(&b)
        };
        let msg = match t & 0x0F {
            0x01 | 0x04 | 0x06 | 0x07 => match as_v1()? {
                LlcMessage::ConfirmLink(m) => LlcV2Message::ConfirmLink(m),
                LlcMessage::DeleteLink(m) => LlcV2Message::DeleteLink(m),
                LlcMessage::ConfirmRkey(m) => LlcV2Message::ConfirmRkey(m),
                LlcMessage::TestLink(m) => LlcV2Message::TestLink(m),
                _ => {
                    return Err(Error::UnknownType {
                        what: "LLC v2",
                        found: t,
                    })
                }
            },
            0x02 => {
                let LlcMessage::AddLink(base) = as_v1()? else {
                    return Err(Error::UnknownType {
                        what: "LLC v2",
                        found: t,
                    });
                };
                let ext = if buf.len() >= ADD_LINK_V2_FIXED_LEN {
                    let mut r = Reader::new(&buf[MSG44_LEN..], "ADD LINK v2");
                    let ext_flags = r.u8()?;
                    r.skip(1)?;
                    let target_gid = Gid(r.array()?);
                    r.skip(8)?;
                    let count_bytes: [u8; 2] = r.array()?;
                    let rkey_count = u16::from_le_bytes(count_bytes);
                    // smc-rv2.md §10.4: use min(count, (length − 72) / 16) entries.
                    let fit = r.remaining() / ADD_LINK_V2_RKEY_LEN;
                    let n = usize::from(rkey_count).min(fit);
                    let mut rtokens = Vec::with_capacity(n);
                    for _ in 0..n {
                        rtokens.push(RtokenPair {
                            reference_rkey: r.u32()?,
                            new_rkey: r.u32()?,
                            new_vaddr: r.u64()?,
                        });
                    }
                    Some(AddLinkV2Ext {
                        v2_direct: ext_flags & 0x80 != 0,
                        target_gid,
                        rkey_count,
                        rtokens,
                    })
                } else {
                    None
                };
                LlcV2Message::AddLink(AddLinkV2 { base, ext })
            }
            REQ_ADD_LINK_TYPE => {
                let mut r = Reader::new(&buf[4..], "REQ ADD LINK v2");
                r.skip(20)?;
                let count = usize::from(r.u8()?);
                r.skip(3)?;
                if count * 16 > r.remaining() {
                    return Err(Error::Malformed {
                        what: "REQ ADD LINK v2",
                        why: "GID count exceeds the message",
                    });
                }
                let mut gids = Vec::with_capacity(count);
                for _ in 0..count {
                    gids.push(Gid(r.array()?));
                }
                LlcV2Message::ReqAddLink(ReqAddLinkV2 { reply, gids })
            }
            0x09 => {
                let count = buf[4];
                let invalid_count = buf[5];
                // Linux reads the rkeys as a flexible array after byte 8: 9 fit in 44 bytes.
                let fit = (buf.len() - DELETE_RKEY_V2_FIXED_LEN) / 4;
                if !reply && usize::from(count) > fit {
                    return Err(Error::Malformed {
                        what: "DELETE RKEY v2",
                        why: "rkey count exceeds the message",
                    });
                }
                // A reply echoes the request's count but may be 44 bytes: read what fits.
                let n = usize::from(count).min(fit);
                let mut r = Reader::new(&buf[DELETE_RKEY_V2_FIXED_LEN..], "DELETE RKEY v2");
                let mut rkeys = Vec::with_capacity(n);
                for _ in 0..n {
                    rkeys.push(r.u32()?);
                }
                LlcV2Message::DeleteRkey(DeleteRkeyV2 {
                    reply,
                    negative: flags & 0x20 != 0,
                    count,
                    invalid_count,
                    rkeys,
                })
            }
            _ => {
                return Err(Error::UnknownType {
                    what: "LLC v2",
                    found: t,
                })
            }
        };
        Ok(msg)
    }

    /// Length of the emitted message: 44, except ADD LINK with its extension (72 + 16·n),
    /// REQ ADD LINK (28 + 16·g, at least 44) and DELETE RKEY with more than 8 rkeys (8 + 4·n).
    pub fn buffer_len(&self) -> usize {
        match self {
            LlcV2Message::AddLink(AddLinkV2 { ext: Some(e), .. }) => {
                ADD_LINK_V2_FIXED_LEN + ADD_LINK_V2_RKEY_LEN * e.rtokens.len()
            }
            LlcV2Message::ReqAddLink(m) => {
                (REQ_ADD_LINK_V2_FIXED_LEN + 16 * m.gids.len()).max(MSG44_LEN)
            }
            LlcV2Message::DeleteRkey(m) if m.rkeys.len() > 8 => {
                DELETE_RKEY_V2_FIXED_LEN + 4 * m.rkeys.len()
            }
            _ => MSG44_LEN,
        }
    }

    /// Emit into `buf`; the length field is written little-endian. Reserved bytes are zero.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        let len = self.buffer_len();
        if len > LLC_V2_MAX_LEN {
            return Err(Error::Malformed {
                what: "LLC v2",
                why: "longer than 8192 bytes",
            });
        }
        check_room(buf, len)?;
        let out = &mut buf[..len];
        out.fill(0);
        let v1 = match self {
            LlcV2Message::ConfirmLink(m) => Some(LlcMessage::ConfirmLink(*m)),
            LlcV2Message::AddLink(m) => Some(LlcMessage::AddLink(m.base)),
            LlcV2Message::DeleteLink(m) => Some(LlcMessage::DeleteLink(*m)),
            LlcV2Message::ConfirmRkey(m) => Some(LlcMessage::ConfirmRkey(*m)),
            LlcV2Message::TestLink(m) => Some(LlcMessage::TestLink(*m)),
            LlcV2Message::ReqAddLink(_) | LlcV2Message::DeleteRkey(_) => None,
        };
        if let Some(v1) = v1 {
            v1.emit(&mut out[..MSG44_LEN])?;
        }
        match self {
            LlcV2Message::AddLink(AddLinkV2 { ext: Some(e), .. }) => {
                let mut w = Writer::new(&mut out[MSG44_LEN..]);
                w.u8(if e.v2_direct { 0x80 } else { 0 });
                w.zeros(1);
                w.put(&e.target_gid.0);
                w.zeros(8);
                w.put(&e.rkey_count.to_le_bytes());
                for p in &e.rtokens {
                    w.u32(p.reference_rkey);
                    w.u32(p.new_rkey);
                    w.u64(p.new_vaddr);
                }
                w.finish()?;
            }
            LlcV2Message::ReqAddLink(m) => {
                if m.gids.len() > 255 {
                    return Err(Error::Malformed {
                        what: "REQ ADD LINK v2",
                        why: "more than 255 GIDs",
                    });
                }
                out[3] = if m.reply { FLAG_REPLY } else { 0 };
                out[24] = m.gids.len() as u8;
                for (i, g) in m.gids.iter().enumerate() {
                    let at = REQ_ADD_LINK_V2_FIXED_LEN + 16 * i;
                    out[at..at + 16].copy_from_slice(&g.0);
                }
            }
            LlcV2Message::DeleteRkey(m) => {
                out[3] = if m.reply { FLAG_REPLY } else { 0 } | if m.negative { 0x20 } else { 0 };
                out[4] = m.count;
                out[5] = m.invalid_count;
                for (i, k) in m.rkeys.iter().enumerate() {
                    let at = DELETE_RKEY_V2_FIXED_LEN + 4 * i;
                    out[at..at + 4].copy_from_slice(&k.to_be_bytes());
                }
            }
            _ => {}
        }
        // The v2 header: version nibble, CPU-order (little-endian) length, flags kept. This
        // overwrites byte 2, so an ADD LINK reject carries no reason (smc-rv2.md §10.4).
        out[0] = self.type_byte();
        out[1..3].copy_from_slice(&(len as u16).to_le_bytes());
        Ok(len)
    }

    /// The wire bytes.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.buffer_len()];
        let _ = self.emit(&mut v);
        v
    }
}
