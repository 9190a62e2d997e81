//! CLC (Connection Layer Control) messages: RFC 7609 A.2, wire-formats.md §3–§6.
//!
//! CLC messages travel in the TCP byte stream right after the handshake: Proposal (client),
//! Accept (server), Confirm (client), or a Decline from either side instead of any of them.

use core::net::{Ipv4Addr, Ipv6Addr};

use crate::codec::{Reader, Writer};
use crate::error::{Error, Result};
use crate::types::{wire_enum, Gid, Mac, PeerId, QpMtu, RmbeSize, U24};
use crate::{EYECATCHER_SMCD, EYECATCHER_SMCR};

/// Length of the CLC header.
pub const HEADER_LEN: usize = 8;
/// Length of the CLC trailer.
pub const TRAILER_LEN: usize = 4;
/// Length of an Accept or Confirm (version 1, SMC-R).
pub const ACCEPT_CONFIRM_LEN: usize = 68;
/// Length of a version-1 Decline.
pub const DECLINE_LEN: usize = 28;
/// Length of an SMCv2 Decline (accepted on receipt, never sent).
pub const DECLINE_V2_LEN: usize = 44;
/// Length of a version-1 IPv4 Proposal with IP-area offset 0.
pub const PROPOSAL_V4_LEN: usize = 52;
/// Size of one IPv6 prefix entry in a Proposal.
pub const IPV6_PREFIX_LEN: usize = 17;
/// Most IPv6 prefixes a Proposal may list (Linux's limit).
pub const MAX_IPV6_PREFIXES: usize = 8;
/// Size of the SMC-D area a version-2-format Proposal puts before the IP area.
pub const SMCD_AREA_LEN: usize = 40;
/// The largest CLC message we buffer; longer ones are malformed for SMC-R v1 purposes.
pub const MAX_CLC_LEN: usize = 1024;

wire_enum! {
    /// CLC message type (header byte 4).
    pub struct ClcType(u8) {
        /// Proposal, client → server.
        PROPOSAL = 1 => "Proposal",
        /// Accept, server → client.
        ACCEPT = 2 => "Accept",
        /// Confirm, client → server.
        CONFIRM = 3 => "Confirm",
        /// Decline, either side.
        DECLINE = 4 => "Decline",
    }
}

wire_enum! {
    /// Peer diagnosis codes of a Decline (Linux `smc_clc.h`; the values are opaque to the peer).
    pub struct DeclineCode(u32) {
        /// Out of memory.
        MEM = 0x0101_0000 => "insufficient memory resources",
        /// Timeout waiting for CONFIRM LINK.
        TIMEOUT_CL = 0x0201_0000 => "timeout waiting for CONFIRM LINK",
        /// Timeout waiting for ADD LINK.
        TIMEOUT_AL = 0x0202_0000 => "timeout waiting for ADD LINK",
        /// Configuration error.
        CNFERR = 0x0300_0000 => "configuration error",
        /// The peer did not indicate SMC.
        PEERNOSMC = 0x0301_0000 => "peer did not indicate SMC",
        /// IPsec in use.
        IPSEC = 0x0302_0000 => "IPsec usage",
        /// No SMC device.
        NOSMCDEV = 0x0303_0000 => "no SMC device found (R or D)",
        /// No SMC-D device.
        NOSMCDDEV = 0x0303_0001 => "no SMC-D device found",
        /// No SMC-R device.
        NOSMCRDEV = 0x0303_0002 => "no SMC-R device found",
        /// No ISMv2 device.
        NOISM2SUPP = 0x0303_0003 => "hardware has no ISMv2 support",
        /// No v2 extension.
        NOV2EXT = 0x0303_0004 => "peer sent no clc v2 extension",
        /// No v2 SMC-D extension.
        NOV2DEXT = 0x0303_0005 => "peer sent no clc SMC-Dv2 extension",
        /// No SEID.
        NOSEID = 0x0303_0006 => "peer sent no SEID",
        /// No UEID.
        NOSMCD2DEV = 0x0303_0007 => "no SMC-Dv2 device found",
        /// No UEID.
        NOUEID = 0x0303_0008 => "peer sent no UEID",
        /// SMC release mismatch.
        RELEASEERR = 0x0303_0009 => "release version negotiation failed",
        /// Max connections mismatch.
        MAXCONNERR = 0x0303_000a => "max connections negotiation failed",
        /// Max links mismatch.
        MAXLINKERR = 0x0303_000b => "max links negotiation failed",
        /// SMC modes do not match.
        MODEUNSUPP = 0x0304_0000 => "SMC modes mismatch (R or D)",
        /// The peer uses an RMBE eye catcher.
        RMBE_EC = 0x0305_0000 => "peer has eyecatcher in RMBE",
        /// Socket option not supported.
        OPTUNSUPP = 0x0306_0000 => "fastopen sockopt not supported",
        /// IP subnet or prefix mismatch.
        DIFFPREFIX = 0x0307_0000 => "IP prefix / subnet mismatch",
        /// Cannot get VLAN.
        GETVLANERR = 0x0308_0000 => "err to get vlan id of ip device",
        /// Cannot register VLAN on ISM.
        ISMVLANERR = 0x0309_0000 => "err to reg vlan id on ism dev",
        /// No active link in the link group.
        NOACTLINK = 0x030a_0000 => "no active smc-r link in lgr",
        /// Server link not found.
        NOSRVLINK = 0x030b_0000 => "SMC-R link from srv not found",
        /// Version mismatch.
        VERSMISMAT = 0x030c_0000 => "SMC version mismatch",
        /// SMC-D DMB limit.
        MAX_DMB = 0x030d_0000 => "SMC-D DMB limit exceeded",
        /// SMC-Rv2: no route.
        NOROUTE = 0x030e_0000 => "SMC-Rv2 conn. no route to peer",
        /// SMC-Rv2: direct/indirect mismatch.
        NOINDIRECT = 0x030f_0000 => "SMC-Rv2 conn. indirect mismatch",
        /// Synchronisation error (sent with the S flag).
        SYNCERR = 0x0400_0000 => "synchronization error",
        /// Peer declined (local use only in Linux).
        PEERDECL = 0x0500_0000 => "peer declined during handshake",
        /// Internal error.
        INTERR = 0x0999_0000 => "internal error",
        /// Internal error: rtoken handling.
        ERR_RTOK = 0x0999_0001 => "rtoken handling failed",
        /// Internal error: link not ready.
        ERR_RDYLNK = 0x0999_0002 => "ib ready link failed",
        /// Internal error: buffer registration.
        ERR_REGBUF = 0x0999_0003 => "reg rdma bufs failed",
    }
}

/// The CLC header (RFC 7609 A.2): eye catcher, type, length, version and flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClcHeader {
    /// Message type.
    pub msg_type: ClcType,
    /// Whole message length including header and trailer.
    pub length: u16,
    /// Version (high nibble of byte 7).
    pub version: u8,
    /// The low nibble of byte 7: flags (F/S at 0x08) and the SMC type bits.
    pub flags: u8,
    /// Whether the eye catcher was "SMCD" rather than "SMCR".
    pub smcd_eyecatcher: bool,
}

impl ClcHeader {
    /// Parse the 8-byte header at the start of `buf`, checking the eye catcher, a known type,
    /// a version of at least 1 and a length that covers header and trailer. The message body
    /// need not be present yet: use this to learn how many bytes to read from the stream.
    pub fn parse(buf: &[u8]) -> Result<ClcHeader> {
        let mut r = Reader::new(buf, "CLC header");
        let eye: [u8; 4] = r.array()?;
        let smcd_eyecatcher = match eye {
            EYECATCHER_SMCR => false,
            EYECATCHER_SMCD => true,
            found => return Err(Error::BadEyeCatcher { found }),
        };
        let msg_type = ClcType(r.u8()?);
        let length = r.u16()?;
        let b7 = r.u8()?;
        if !msg_type.is_known() {
            return Err(Error::UnknownType {
                what: "CLC",
                found: msg_type.0,
            });
        }
        // Linux: "version must be ≥ 1".
        if b7 >> 4 == 0 {
            return Err(Error::Malformed {
                what: "CLC header",
                why: "version 0",
            });
        }
        if usize::from(length) < HEADER_LEN + TRAILER_LEN {
            return Err(Error::BadLength {
                what: "CLC",
                found: usize::from(length),
                expected: "at least 12",
            });
        }
        if usize::from(length) > MAX_CLC_LEN {
            return Err(Error::BadLength {
                what: "CLC",
                found: usize::from(length),
                expected: "at most 1024",
            });
        }
        Ok(ClcHeader {
            msg_type,
            length,
            version: b7 >> 4,
            flags: b7 & 0x0F,
            smcd_eyecatcher,
        })
    }

    fn emit(w: &mut Writer<'_>, msg_type: ClcType, length: usize, version: u8, flags: u8) {
        w.put(&EYECATCHER_SMCR);
        w.u8(msg_type.0);
        w.u16(length as u16);
        w.u8((version << 4) | (flags & 0x0F));
    }
}

/// A checked view of a whole CLC message: header validated and `length` bytes present.
#[derive(Debug, Clone, Copy)]
pub struct ClcPacket<T: AsRef<[u8]>> {
    buf: T,
    header: ClcHeader,
}

impl<T: AsRef<[u8]>> ClcPacket<T> {
    /// Wrap `buf` after validating the header and that the buffer holds `length` bytes.
    /// Bytes after `length` are not part of the message.
    pub fn new_checked(buf: T) -> Result<Self> {
        let header = ClcHeader::parse(buf.as_ref())?;
        let have = buf.as_ref().len();
        if have < usize::from(header.length) {
            return Err(Error::Truncated {
                what: "CLC",
                need: usize::from(header.length),
                have,
            });
        }
        Ok(ClcPacket { buf, header })
    }

    /// The validated header.
    pub fn header(&self) -> ClcHeader {
        self.header
    }

    /// The message bytes (exactly `length` of them).
    pub fn as_bytes(&self) -> &[u8] {
        let b = self.buf.as_ref();
        &b[..usize::from(self.header.length).min(b.len())]
    }

    /// The bytes between header and trailer.
    pub fn body(&self) -> &[u8] {
        let b = self.as_bytes();
        &b[HEADER_LEN..b.len().saturating_sub(TRAILER_LEN).max(HEADER_LEN)]
    }

    /// The four trailer bytes.
    pub fn trailer(&self) -> [u8; 4] {
        let b = self.as_bytes();
        let mut t = [0u8; 4];
        if b.len() >= TRAILER_LEN {
            t.copy_from_slice(&b[b.len() - TRAILER_LEN..]);
        }
        t
    }

    /// Check the trailer eye catcher (RFC 7609 A.2: both eye catchers must be validated).
    pub fn check_trailer(&self) -> Result<()> {
        match self.trailer() {
            EYECATCHER_SMCR | EYECATCHER_SMCD => Ok(()),
            found => Err(Error::BadTrailer { found }),
        }
    }
}

/// One IPv6 prefix of a Proposal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ipv6Prefix {
    /// The address with all bits after the prefix length cleared.
    pub prefix: Ipv6Addr,
    /// Prefix length, 0..=128.
    pub prefix_len: u8,
}

/// The SMC-D area and v2 header fields of a version-2-format Proposal (wire-formats.md §4.3).
/// Kept so that a Linux Proposal re-encodes to the same bytes; a v1 server ignores it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SmcdArea {
    /// ISM GID (SMC-D only).
    pub ism_gid: u64,
    /// ISM CHID (SMC-D v2).
    pub ism_chid: u16,
    /// Distance from byte 52 to the v2 extension, 0 if none.
    pub v2_ext_offset: u16,
}

/// A CLC Proposal (type 1): the client offers SMC-R.
///
/// Parsed in both the RFC 7609 version-1 layout (IP-area offset 0) and the version-2 format
/// that Linux ≥ 5.10 always sends (offset 40 over an SMC-D area, optional v2 extensions,
/// which are skipped).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Proposal {
    /// Header version (1, or 2 for Linux's format).
    pub version: u8,
    /// The version-1 SMC type (byte 7 bits 0x03): 0 SMC-R, 1 SMC-D, 2 none, 3 both.
    pub smc_type_v1: u8,
    /// The version-2 SMC type (byte 7 bits 0x0C), meaningful only when `version >= 2`.
    pub smc_type_v2: u8,
    /// Sender's peer ID.
    pub peer_id: PeerId,
    /// GID of the client's preferred RNIC port.
    pub preferred_gid: Gid,
    /// MAC of the client's preferred RNIC.
    pub preferred_mac: Mac,
    /// The SMC-D area (present when the IP-area offset is 40).
    pub smcd_area: Option<SmcdArea>,
    /// IPv4 network number of the outgoing interface (0 for IPv6).
    pub ipv4_subnet: Ipv4Addr,
    /// IPv4 prefix length (0 for IPv6).
    pub ipv4_prefix_len: u8,
    /// IPv6 prefixes (empty for IPv4), at most 8.
    pub ipv6_prefixes: Vec<Ipv6Prefix>,
    /// Bytes between the IP area and the trailer (SMCv2 extensions), kept verbatim.
    pub v2_extensions: Vec<u8>,
}

impl Proposal {
    /// Whether the client offers SMC-R version 1 (type 0 "SMC-R" or 3 "both").
    pub fn offers_smcr_v1(&self) -> bool {
        self.smc_type_v1 == 0 || self.smc_type_v1 == 3
    }

    /// Parse a whole Proposal (exactly `length` bytes of `buf` are used).
    pub fn parse(buf: &[u8]) -> Result<Proposal> {
        let p = ClcPacket::new_checked(buf)?;
        let h = p.header();
        if h.msg_type != ClcType::PROPOSAL {
            return Err(Error::UnknownType {
                what: "CLC Proposal",
                found: h.msg_type.0,
            });
        }
        p.check_trailer()?;
        let bytes = p.as_bytes();
        let mut r = Reader::new(
            &bytes[HEADER_LEN..bytes.len() - TRAILER_LEN],
            "CLC Proposal",
        );
        let peer_id = PeerId::from_bytes(r.array()?);
        let preferred_gid = Gid(r.array()?);
        let preferred_mac = Mac(r.array()?);
        let offset = usize::from(r.u16()?);
        // Linux accepts an IP-area offset 0..=40 from a version-1 peer and rejects more.
        if offset > SMCD_AREA_LEN {
            return Err(Error::Malformed {
                what: "CLC Proposal",
                why: "IP area offset larger than 40",
            });
        }
        let smcd_area = if offset == SMCD_AREA_LEN {
            let mut a = r.sub(SMCD_AREA_LEN)?;
            Some(SmcdArea {
                ism_gid: a.u64()?,
                ism_chid: a.u16()?,
                v2_ext_offset: a.u16()?,
            })
        } else {
            r.skip(offset)?;
            None
        };
        let ipv4_subnet = Ipv4Addr::from(r.u32()?);
        let ipv4_prefix_len = r.u8()?;
        r.skip(2)?;
        let count = usize::from(r.u8()?);
        if count > MAX_IPV6_PREFIXES {
            return Err(Error::Malformed {
                what: "CLC Proposal",
                why: "more than 8 IPv6 prefixes",
            });
        }
        let mut ipv6_prefixes = Vec::with_capacity(count);
        for _ in 0..count {
            let prefix = Ipv6Addr::from(r.array::<16>()?);
            let prefix_len = r.u8()?;
            ipv6_prefixes.push(Ipv6Prefix { prefix, prefix_len });
        }
        let version = h.version;
        // A version-1 message must have exactly the RFC length; a newer one may carry
        // extensions between the IP area and the trailer, which a v1 server skips.
        let v2_extensions = r.rest().to_vec();
        if version == 1 && !v2_extensions.is_empty() {
            return Err(Error::BadLength {
                what: "CLC Proposal",
                found: bytes.len(),
                expected: "40 + offset + 8 + 17·n + 4",
            });
        }
        if ipv4_prefix_len > 32 {
            return Err(Error::BadValue {
                field: "IPv4 prefix length",
                value: u64::from(ipv4_prefix_len),
            });
        }
        if let Some(bad) = ipv6_prefixes.iter().find(|p| p.prefix_len > 128) {
            return Err(Error::BadValue {
                field: "IPv6 prefix length",
                value: u64::from(bad.prefix_len),
            });
        }
        Ok(Proposal {
            version,
            smc_type_v1: h.flags & 0x03,
            smc_type_v2: if version >= 2 {
                (h.flags >> 2) & 0x03
            } else {
                0
            },
            peer_id,
            preferred_gid,
            preferred_mac,
            smcd_area,
            ipv4_subnet,
            ipv4_prefix_len,
            ipv6_prefixes,
            v2_extensions,
        })
    }

    /// Length of the emitted message.
    pub fn buffer_len(&self) -> usize {
        let offset = if self.smcd_area.is_some() {
            SMCD_AREA_LEN
        } else {
            0
        };
        HEADER_LEN
            + 8
            + 16
            + 6
            + 2
            + offset
            + 8
            + IPV6_PREFIX_LEN * self.ipv6_prefixes.len()
            + self.v2_extensions.len()
            + TRAILER_LEN
    }

    /// Emit into `buf`.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        let len = self.buffer_len();
        if self.ipv6_prefixes.len() > MAX_IPV6_PREFIXES || len > MAX_CLC_LEN {
            return Err(Error::Malformed {
                what: "CLC Proposal",
                why: "too many prefixes or extension bytes",
            });
        }
        let mut w = Writer::new(buf);
        let mut flags = self.smc_type_v1 & 0x03;
        if self.version >= 2 {
            flags |= (self.smc_type_v2 & 0x03) << 2;
        }
        ClcHeader::emit(&mut w, ClcType::PROPOSAL, len, self.version, flags);
        w.put(&self.peer_id.to_bytes());
        w.put(&self.preferred_gid.0);
        w.put(&self.preferred_mac.0);
        match &self.smcd_area {
            Some(a) => {
                w.u16(SMCD_AREA_LEN as u16);
                w.u64(a.ism_gid);
                w.u16(a.ism_chid);
                w.u16(a.v2_ext_offset);
                w.zeros(SMCD_AREA_LEN - 12);
            }
            None => w.u16(0),
        }
        w.put(&self.ipv4_subnet.octets());
        w.u8(self.ipv4_prefix_len);
        w.zeros(2);
        w.u8(self.ipv6_prefixes.len() as u8);
        for p in &self.ipv6_prefixes {
            w.put(&p.prefix.octets());
            w.u8(p.prefix_len);
        }
        w.put(&self.v2_extensions);
        w.put(&EYECATCHER_SMCR);
        w.finish()
    }
}

/// The body shared by CLC Accept (type 2) and Confirm (type 3): the sender's RoCE, QP and RMB
/// data for the link and connection (RFC 7609 A.2.3, A.2.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AcceptConfirm {
    /// Header version.
    pub version: u8,
    /// Byte 7 bit 0x08: in an Accept the F (first contact) flag; Linux also sets it in the
    /// Confirm of a first contact (we send 0 there and ignore it on receipt).
    pub first_contact: bool,
    /// Sender's peer ID.
    pub peer_id: PeerId,
    /// GID the sender uses for this link.
    pub gid: Gid,
    /// MAC of that RNIC.
    pub mac: Mac,
    /// Sender's QP number for the link.
    pub qp_num: U24,
    /// rkey of the RMB the peer must RDMA-write into.
    pub rmb_rkey: u32,
    /// RMBE index within the RMB, 1-based.
    pub rmbe_idx: u8,
    /// The sender's alert token for the connection.
    pub rmbe_alert_token: u32,
    /// RMBE size code.
    pub rmbe_size: RmbeSize,
    /// QP MTU code.
    pub qp_mtu: QpMtu,
    /// Virtual address of the RMB.
    pub rmb_vaddr: u64,
    /// Initial packet sequence number of the sender's QP.
    pub initial_psn: U24,
}

impl AcceptConfirm {
    /// Parse an Accept or Confirm; `expect` says which.
    ///
    /// A length other than 68 is malformed. A reserved QP MTU is a bad value (Decline, C.6).
    pub fn parse(buf: &[u8], expect: ClcType) -> Result<AcceptConfirm> {
        let p = ClcPacket::new_checked(buf)?;
        let h = p.header();
        if h.msg_type != expect {
            return Err(Error::UnknownType {
                what: "CLC Accept/Confirm",
                found: h.msg_type.0,
            });
        }
        if usize::from(h.length) != ACCEPT_CONFIRM_LEN {
            if h.version >= 2 {
                // An SMCv2 Accept/Confirm: we only ever propose version 1.
                return Err(Error::BadValue {
                    field: "CLC version",
                    value: u64::from(h.version),
                });
            }
            return Err(Error::BadLength {
                what: "CLC Accept/Confirm",
                found: usize::from(h.length),
                expected: "68",
            });
        }
        p.check_trailer()?;
        // Linux: "SMC type must be 0 (R) or 1 (D)"; we only speak SMC-R.
        if h.flags & 0x03 != 0 {
            return Err(Error::BadValue {
                field: "CLC SMC type",
                value: u64::from(h.flags & 0x03),
            });
        }
        let mut r = Reader::new(p.body(), "CLC Accept/Confirm");
        let peer_id = PeerId::from_bytes(r.array()?);
        let gid = Gid(r.array()?);
        let mac = Mac(r.array()?);
        let qp_num = U24::truncate(r.u24()?);
        let rmb_rkey = r.u32()?;
        let rmbe_idx = r.u8()?;
        let rmbe_alert_token = r.u32()?;
        let size_mtu = r.u8()?;
        r.skip(1)?;
        let rmb_vaddr = r.u64()?;
        r.skip(1)?;
        let initial_psn = U24::truncate(r.u24()?);
        let qp_mtu = QpMtu(size_mtu & 0x0F).validate()?;
        if rmbe_idx == 0 {
            return Err(Error::BadValue {
                field: "RMBE index",
                value: 0,
            });
        }
        Ok(AcceptConfirm {
            version: h.version,
            first_contact: h.flags & 0x08 != 0,
            peer_id,
            gid,
            mac,
            qp_num,
            rmb_rkey,
            rmbe_idx,
            rmbe_alert_token,
            rmbe_size: RmbeSize(size_mtu >> 4),
            qp_mtu,
            rmb_vaddr,
            initial_psn,
        })
    }

    /// Length of the emitted message: 68.
    pub const fn buffer_len(&self) -> usize {
        ACCEPT_CONFIRM_LEN
    }

    /// Emit as `msg_type` (Accept or Confirm) into `buf`.
    pub fn emit(&self, msg_type: ClcType, buf: &mut [u8]) -> Result<usize> {
        let mut w = Writer::new(buf);
        let flags = if self.first_contact { 0x08 } else { 0 };
        ClcHeader::emit(&mut w, msg_type, ACCEPT_CONFIRM_LEN, self.version, flags);
        w.put(&self.peer_id.to_bytes());
        w.put(&self.gid.0);
        w.put(&self.mac.0);
        w.u24(self.qp_num.get());
        w.u32(self.rmb_rkey);
        w.u8(self.rmbe_idx);
        w.u32(self.rmbe_alert_token);
        w.u8(((self.rmbe_size.0 & 0x0F) << 4) | (self.qp_mtu.0 & 0x0F));
        w.zeros(1);
        w.u64(self.rmb_vaddr);
        w.zeros(1);
        w.u24(self.initial_psn.get());
        w.put(&EYECATCHER_SMCR);
        w.finish()
    }
}

/// A CLC Decline (type 4): "no SMC for this connection" (RFC 7609 A.2.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Decline {
    /// Header version.
    pub version: u8,
    /// S flag (0x08): out of sync; the receiver must tear down its link group with the sender.
    pub out_of_sync: bool,
    /// Sender's peer ID (Linux: zeros when it has no RoCE device).
    pub peer_id: PeerId,
    /// Peer diagnosis (reason code).
    pub diagnosis: DeclineCode,
    /// SMCv2 Decline only: byte 20 high nibble, the OS type.
    pub os_type: u8,
    /// SMCv2 Decline only (44 bytes): four more diagnosis codes.
    pub v2_diagnoses: Option<[DeclineCode; 4]>,
}

impl Decline {
    /// A version-1 Decline.
    pub fn new(peer_id: PeerId, diagnosis: DeclineCode, out_of_sync: bool) -> Decline {
        Decline {
            version: 1,
            out_of_sync,
            peer_id,
            diagnosis,
            os_type: 0,
            v2_diagnoses: None,
        }
    }

    /// Parse a Decline of 28 bytes (v1) or 44 bytes (SMCv2). The trailer is not checked
    /// (Linux does not check it on Declines either).
    pub fn parse(buf: &[u8]) -> Result<Decline> {
        let p = ClcPacket::new_checked(buf)?;
        let h = p.header();
        if h.msg_type != ClcType::DECLINE {
            return Err(Error::UnknownType {
                what: "CLC Decline",
                found: h.msg_type.0,
            });
        }
        let len = usize::from(h.length);
        if len != DECLINE_LEN && len != DECLINE_V2_LEN {
            return Err(Error::BadLength {
                what: "CLC Decline",
                found: len,
                expected: "28 or 44",
            });
        }
        let mut r = Reader::new(p.body(), "CLC Decline");
        let peer_id = PeerId::from_bytes(r.array()?);
        let diagnosis = DeclineCode(r.u32()?);
        let os_type = r.u8()? >> 4;
        r.skip(3)?;
        let v2_diagnoses = if len == DECLINE_V2_LEN {
            Some([
                DeclineCode(r.u32()?),
                DeclineCode(r.u32()?),
                DeclineCode(r.u32()?),
                DeclineCode(r.u32()?),
            ])
        } else {
            None
        };
        Ok(Decline {
            version: h.version,
            out_of_sync: h.flags & 0x08 != 0,
            peer_id,
            diagnosis,
            os_type: if len == DECLINE_V2_LEN { os_type } else { 0 },
            v2_diagnoses,
        })
    }

    /// Length of the emitted message: 28, or 44 with v2 diagnoses.
    pub fn buffer_len(&self) -> usize {
        if self.v2_diagnoses.is_some() {
            DECLINE_V2_LEN
        } else {
            DECLINE_LEN
        }
    }

    /// Emit into `buf`.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        let mut w = Writer::new(buf);
        let flags = if self.out_of_sync { 0x08 } else { 0 };
        ClcHeader::emit(
            &mut w,
            ClcType::DECLINE,
            self.buffer_len(),
            self.version,
            flags,
        );
        w.put(&self.peer_id.to_bytes());
        w.u32(self.diagnosis.0);
        match &self.v2_diagnoses {
            Some(d) => {
                w.u8((self.os_type & 0x0F) << 4);
                w.zeros(3);
                for c in d {
                    w.u32(c.0);
                }
            }
            None => w.zeros(4),
        }
        w.put(&EYECATCHER_SMCR);
        w.finish()
    }
}

/// Any CLC message.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ClcMessage {
    /// Proposal.
    Proposal(Proposal),
    /// Accept.
    Accept(AcceptConfirm),
    /// Confirm.
    Confirm(AcceptConfirm),
    /// Decline.
    Decline(Decline),
}

impl ClcMessage {
    /// Parse one whole CLC message at the start of `buf`; returns it and the bytes it used.
    pub fn parse(buf: &[u8]) -> Result<(ClcMessage, usize)> {
        let h = ClcHeader::parse(buf)?;
        let len = usize::from(h.length);
        let msg = match h.msg_type {
            ClcType::PROPOSAL => ClcMessage::Proposal(Proposal::parse(buf)?),
            ClcType::ACCEPT => ClcMessage::Accept(AcceptConfirm::parse(buf, ClcType::ACCEPT)?),
            ClcType::CONFIRM => ClcMessage::Confirm(AcceptConfirm::parse(buf, ClcType::CONFIRM)?),
            _ => ClcMessage::Decline(Decline::parse(buf)?),
        };
        Ok((msg, len))
    }

    /// The message type.
    pub fn msg_type(&self) -> ClcType {
        match self {
            ClcMessage::Proposal(_) => ClcType::PROPOSAL,
            ClcMessage::Accept(_) => ClcType::ACCEPT,
            ClcMessage::Confirm(_) => ClcType::CONFIRM,
            ClcMessage::Decline(_) => ClcType::DECLINE,
        }
    }

    /// Length of the emitted message.
    pub fn buffer_len(&self) -> usize {
        match self {
            ClcMessage::Proposal(m) => m.buffer_len(),
            ClcMessage::Accept(m) | ClcMessage::Confirm(m) => m.buffer_len(),
            ClcMessage::Decline(m) => m.buffer_len(),
        }
    }

    /// Emit into `buf`.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        match self {
            ClcMessage::Proposal(m) => m.emit(buf),
            ClcMessage::Accept(m) => m.emit(ClcType::ACCEPT, buf),
            ClcMessage::Confirm(m) => m.emit(ClcType::CONFIRM, buf),
            ClcMessage::Decline(m) => m.emit(buf),
        }
    }

    /// The wire bytes.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.buffer_len()];
        let _ = self.emit(&mut v);
        v
    }
}
