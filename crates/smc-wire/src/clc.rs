//! CLC (Connection Layer Control) messages: RFC 7609 A.2, wire-formats.md §3–§6.
//!
//! CLC messages travel in the TCP byte stream right after the handshake: Proposal (client),
//! Accept (server), Confirm (client), or a Decline from either side instead of any of them.

use core::net::{Ipv4Addr, Ipv6Addr};

use crate::clc_v2::{
    smc_type, AcceptConfirmV2, FirstContactExt, ProposalV2Ext, ACCEPT_CONFIRM_V2_LEN,
    ACCEPT_V2_FIRST_CONTACT_LEN, MAX_V2_EXT_OFFSET, OS_TYPE_LINUX, SMCD_V2_EXT_FIXED_LEN,
    SMCD_V2_ISM_ENTRY_LEN,
};
use crate::codec::{Reader, Writer};
use crate::eid::{Eid, MAX_PROPOSAL_EIDS};
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
/// Length of an SMCv2 Decline.
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
        /// smc-rs: the client stopped waiting for the Accept (the server's application did
        /// not accept the TCP connection in time: a program connecting to its own listener,
        /// or a server that accepts only after the client used another connection).
        NOACCEPT = 0x0999_0100 => "no accept in time (connection to a listener of the same process)",
        /// smc-rs: the server handed the accepted TCP connection to a program it exec'd
        /// before the rendezvous (the new program uses the socket as TCP).
        EXECED = 0x0999_0200 => "accepted connection handed to an exec'd program",
        /// smc-rs: the accepted TCP connection was first used by a process made by a raw
        /// `clone` (no fork handlers ran: its own children could not be relayed to).
        CLONED = 0x0999_0300 => "accepted connection first used by a raw clone's child",
        /// smc-rs: the server passed the accepted TCP connection to another process
        /// (SCM_RIGHTS) before the rendezvous (the receiver uses the socket as TCP).
        PASSED = 0x0999_0400 => "accepted connection passed to another process",
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
/// Parsed in the RFC 7609 version-1 layout (IP-area offset 0 or 40) and in the version-2
/// layout Linux ≥ 5.10 always sends (smc-rv2.md §5): a 40-byte SMC-D area at byte 40, the IP
/// area only when the v1 type is not "none", then the SMC v2 extension with the UEIDs and the
/// client's RoCEv2 GID, then an SMC-Dv2 extension (kept verbatim).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Proposal {
    /// Header version (1, or 2 for the version-2 layout).
    pub version: u8,
    /// The version-1 SMC type (byte 7 bits 0x03): 0 SMC-R, 1 SMC-D, 2 none, 3 both.
    pub smc_type_v1: u8,
    /// The version-2 SMC type (byte 7 bits 0x0C), meaningful only when `version >= 2`.
    pub smc_type_v2: u8,
    /// Sender's peer ID.
    pub peer_id: PeerId,
    /// GID of the client's preferred RNIC port (RoCE v1; zero in a v2-only Proposal).
    pub preferred_gid: Gid,
    /// MAC of the client's preferred RNIC.
    pub preferred_mac: Mac,
    /// The SMC-D area (always present in the version-2 layout; in version 1 when the IP-area
    /// offset is 40).
    pub smcd_area: Option<SmcdArea>,
    /// IPv4 network number of the outgoing interface (0 for IPv6 or without IP area).
    pub ipv4_subnet: Ipv4Addr,
    /// IPv4 prefix length (0 for IPv6 or without IP area).
    pub ipv4_prefix_len: u8,
    /// IPv6 prefixes (empty for IPv4), at most 8.
    pub ipv6_prefixes: Vec<Ipv6Prefix>,
    /// The SMC v2 extension (version 2, v2 type not "none").
    pub v2_ext: Option<ProposalV2Ext>,
    /// The bytes after the v2 extension's EIDs (the SMC-Dv2 extension), kept verbatim.
    pub smcd_v2_ext: Vec<u8>,
}

impl Proposal {
    /// Whether the client offers SMC-R version 1 (v1 type 0 "SMC-R" or 3 "both").
    pub fn offers_smcr_v1(&self) -> bool {
        smc_type::includes_r(self.smc_type_v1)
    }

    /// Whether the client offers SMC-Rv2 (version ≥ 2, v2 type includes SMC-R, with an
    /// extension).
    pub fn offers_smcr_v2(&self) -> bool {
        self.version >= 2 && smc_type::includes_r(self.smc_type_v2) && self.v2_ext.is_some()
    }

    /// Whether this Proposal has an IP area (version 1 always; version 2 when the v1 type is
    /// not "none").
    fn has_ip_area(&self) -> bool {
        self.version < 2 || self.smc_type_v1 != smc_type::NONE
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
        if h.version >= 2 {
            return Self::parse_v2(p.as_bytes(), h);
        }
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
        let (ipv4_subnet, ipv4_prefix_len, ipv6_prefixes) = read_ip_area(&mut r)?;
        // A version-1 message must have exactly the RFC length.
        if r.remaining() != 0 {
            return Err(Error::BadLength {
                what: "CLC Proposal",
                found: bytes.len(),
                expected: "40 + offset + 8 + 17·n + 4",
            });
        }
        Ok(Proposal {
            version: h.version,
            smc_type_v1: h.flags & 0x03,
            smc_type_v2: 0,
            peer_id,
            preferred_gid,
            preferred_mac,
            smcd_area,
            ipv4_subnet,
            ipv4_prefix_len,
            ipv6_prefixes,
            v2_ext: None,
            smcd_v2_ext: Vec::new(),
        })
    }

    /// The version-2 layout (smc-rv2.md §5.1, §5.4). Linux drops a Proposal that breaks its
    /// length formula without a Decline; we additionally require the canonical placement
    /// Linux itself uses (IP area at 80 when present, extension right after it).
    fn parse_v2(bytes: &[u8], h: ClcHeader) -> Result<Proposal> {
        let malformed = |why| Error::Malformed {
            what: "CLC Proposal v2",
            why,
        };
        let smc_type_v1 = h.flags & 0x03;
        let smc_type_v2 = (h.flags >> 2) & 0x03;
        let body_end = bytes.len() - TRAILER_LEN;
        let mut r = Reader::new(&bytes[HEADER_LEN..body_end], "CLC Proposal v2");
        let peer_id = PeerId::from_bytes(r.array()?);
        let preferred_gid = Gid(r.array()?);
        let preferred_mac = Mac(r.array()?);
        let ip_offset = usize::from(r.u16()?);
        let mut a = r.sub(SMCD_AREA_LEN)?;
        let smcd_area = SmcdArea {
            ism_gid: a.u64()?,
            ism_chid: a.u16()?,
            v2_ext_offset: a.u16()?,
        };
        let has_ip_area = smc_type_v1 != smc_type::NONE;
        let expected_ip_offset = if has_ip_area { SMCD_AREA_LEN } else { 0 };
        if ip_offset > SMCD_AREA_LEN {
            return Err(malformed("IP area offset larger than 40"));
        }
        if ip_offset != expected_ip_offset {
            return Err(malformed(
                "IP area offset must be 40 with a v1 type, 0 without",
            ));
        }
        let (ipv4_subnet, ipv4_prefix_len, ipv6_prefixes) = if has_ip_area {
            read_ip_area(&mut r)?
        } else {
            (Ipv4Addr::UNSPECIFIED, 0, Vec::new())
        };
        // Where the IP area (or the SMC-D area) ends in the whole message.
        let ext_pos = HEADER_LEN + r.position();
        let mut v2_ext = None;
        let mut smcd_v2_ext = Vec::new();
        let mut expected_len = HEADER_LEN + 32 + SMCD_AREA_LEN + TRAILER_LEN;
        if has_ip_area {
            expected_len += 8 + IPV6_PREFIX_LEN * ipv6_prefixes.len();
        }
        if smc_type_v2 != smc_type::NONE {
            let off = usize::from(smcd_area.v2_ext_offset);
            if off == 0 || off > MAX_V2_EXT_OFFSET {
                return Err(malformed("v2 extension offset 0 or larger than 172"));
            }
            if 52 + off != ext_pos {
                return Err(malformed("v2 extension not right after the IP area"));
            }
            let mut er = Reader::new(&bytes[ext_pos..body_end], "CLC v2 extension");
            let ext = ProposalV2Ext::read(&mut er)?;
            if ext.eids.len() > MAX_PROPOSAL_EIDS {
                return Err(malformed("more than 8 EIDs"));
            }
            expected_len += ext.buffer_len();
            if smc_type::includes_d(smc_type_v2) {
                expected_len +=
                    SMCD_V2_EXT_FIXED_LEN + SMCD_V2_ISM_ENTRY_LEN * usize::from(ext.ism_gid_count);
            }
            smcd_v2_ext = er.rest().to_vec();
            v2_ext = Some(ext);
        }
        if bytes.len() != expected_len {
            return Err(Error::BadLength {
                what: "CLC Proposal v2",
                found: bytes.len(),
                expected: "80 + IP area + v2 extension + SMC-Dv2 extension + 4",
            });
        }
        Ok(Proposal {
            version: h.version,
            smc_type_v1,
            smc_type_v2,
            peer_id,
            preferred_gid,
            preferred_mac,
            smcd_area: Some(smcd_area),
            ipv4_subnet,
            ipv4_prefix_len,
            ipv6_prefixes,
            v2_ext,
            smcd_v2_ext,
        })
    }

    fn ip_area_len(&self) -> usize {
        if self.has_ip_area() {
            8 + IPV6_PREFIX_LEN * self.ipv6_prefixes.len()
        } else {
            0
        }
    }

    /// Length of the emitted message.
    pub fn buffer_len(&self) -> usize {
        let smcd = if self.version >= 2 || self.smcd_area.is_some() {
            SMCD_AREA_LEN
        } else {
            0
        };
        HEADER_LEN
            + 32
            + smcd
            + self.ip_area_len()
            + self.v2_ext.as_ref().map_or(0, ProposalV2Ext::buffer_len)
            + self.smcd_v2_ext.len()
            + TRAILER_LEN
    }

    /// Emit into `buf`.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        let len = self.buffer_len();
        let too_many_eids = self
            .v2_ext
            .as_ref()
            .is_some_and(|e| e.eids.len() > MAX_PROPOSAL_EIDS);
        if self.ipv6_prefixes.len() > MAX_IPV6_PREFIXES || len > MAX_CLC_LEN || too_many_eids {
            return Err(Error::Malformed {
                what: "CLC Proposal",
                why: "too many prefixes, EIDs or extension bytes",
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
        if self.version >= 2 {
            let a = self.smcd_area.unwrap_or_default();
            let ext_offset = match &self.v2_ext {
                Some(_) => (HEADER_LEN + 32 + SMCD_AREA_LEN + self.ip_area_len() - 52) as u16,
                None => a.v2_ext_offset,
            };
            w.u16(if self.has_ip_area() {
                SMCD_AREA_LEN as u16
            } else {
                0
            });
            w.u64(a.ism_gid);
            w.u16(a.ism_chid);
            w.u16(ext_offset);
            w.zeros(SMCD_AREA_LEN - 12);
        } else {
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
        }
        if self.has_ip_area() {
            w.put(&self.ipv4_subnet.octets());
            w.u8(self.ipv4_prefix_len);
            w.zeros(2);
            w.u8(self.ipv6_prefixes.len() as u8);
            for p in &self.ipv6_prefixes {
                w.put(&p.prefix.octets());
                w.u8(p.prefix_len);
            }
        }
        if let Some(e) = &self.v2_ext {
            e.write(&mut w);
        }
        w.put(&self.smcd_v2_ext);
        w.put(&EYECATCHER_SMCR);
        w.finish()
    }
}

/// The IP area (RFC 7609 A.2.2): IPv4 subnet, prefix length, 2 reserved, IPv6 prefix count
/// and prefixes.
fn read_ip_area(r: &mut Reader<'_>) -> Result<(Ipv4Addr, u8, Vec<Ipv6Prefix>)> {
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
    Ok((ipv4_subnet, ipv4_prefix_len, ipv6_prefixes))
}

/// The body shared by CLC Accept (type 2) and Confirm (type 3): the sender's RoCE, QP and RMB
/// data for the link and connection (RFC 7609 A.2.3, A.2.4), and in version 2 the EID, the
/// first-contact extension and a first-contact Confirm's GID list (smc-rv2.md §7).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AcceptConfirm {
    /// Header version.
    pub version: u8,
    /// Byte 7 bit 0x08: in an Accept the F (first contact) flag; Linux also sets it in the
    /// Confirm of a first contact (version 1: we send 0 there and ignore it on receipt;
    /// version 2: it says the first-contact extension follows).
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
    /// Version 2 only: EID, first-contact extension, GID list.
    pub v2: Option<AcceptConfirmV2>,
}

impl AcceptConfirm {
    /// Parse an Accept or Confirm; `expect` says which.
    ///
    /// Version 1: exactly 68 bytes. Version 2: at least 108 bytes, 160 with the first-contact
    /// bit (Linux reads the extension without a length check, so a shorter one is malformed
    /// here), bytes after the known parts ignored as Linux does. A reserved QP MTU is a bad
    /// value (Decline, C.6).
    pub fn parse(buf: &[u8], expect: ClcType) -> Result<AcceptConfirm> {
        let p = ClcPacket::new_checked(buf)?;
        let h = p.header();
        if h.msg_type != expect {
            return Err(Error::UnknownType {
                what: "CLC Accept/Confirm",
                found: h.msg_type.0,
            });
        }
        let len = usize::from(h.length);
        let first_contact = h.flags & 0x08 != 0;
        if h.version >= 2 {
            if len < ACCEPT_CONFIRM_V2_LEN {
                return Err(Error::BadLength {
                    what: "CLC Accept/Confirm v2",
                    found: len,
                    expected: "at least 108",
                });
            }
            if first_contact && len < ACCEPT_V2_FIRST_CONTACT_LEN {
                return Err(Error::BadLength {
                    what: "CLC Accept/Confirm v2 with first contact",
                    found: len,
                    expected: "at least 160",
                });
            }
        } else if len != ACCEPT_CONFIRM_LEN {
            return Err(Error::BadLength {
                what: "CLC Accept/Confirm",
                found: len,
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
        let v2 = if h.version >= 2 {
            let eid = Eid(r.array()?);
            r.skip(8)?;
            let first_contact_ext = if first_contact {
                Some(FirstContactExt::read(&mut r)?)
            } else {
                None
            };
            // smc-rv2.md §7.3: the GID list follows the extension in a first-contact Confirm.
            let gid_list = if expect == ClcType::CONFIRM && first_contact && r.remaining() >= 4 {
                let count = r.u8()?;
                r.skip(3)?;
                let mut gids = Vec::with_capacity(usize::from(count));
                for _ in 0..count {
                    gids.push(Gid(r.array()?));
                }
                Some(gids)
            } else {
                None
            };
            Some(AcceptConfirmV2 {
                eid,
                first_contact_ext,
                gid_list,
            })
        } else {
            None
        };
        let qp_mtu = QpMtu(size_mtu & 0x0F).validate()?;
        if rmbe_idx == 0 {
            return Err(Error::BadValue {
                field: "RMBE index",
                value: 0,
            });
        }
        Ok(AcceptConfirm {
            version: h.version,
            first_contact,
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
            v2,
        })
    }

    /// Length of the emitted message: 68 in version 1; 108, 160 or 164 + 16·g in version 2.
    pub fn buffer_len(&self) -> usize {
        match &self.v2 {
            Some(v2) => 64 + v2.buffer_len() + TRAILER_LEN,
            None => ACCEPT_CONFIRM_LEN,
        }
    }

    /// Emit as `msg_type` (Accept or Confirm) into `buf`.
    pub fn emit(&self, msg_type: ClcType, buf: &mut [u8]) -> Result<usize> {
        if let Some(v2) = &self.v2 {
            if v2.first_contact_ext.is_some() != self.first_contact {
                return Err(Error::Malformed {
                    what: "CLC Accept/Confirm v2",
                    why: "first-contact extension without first-contact bit or the reverse",
                });
            }
            if v2.gid_list.as_ref().is_some_and(|g| g.len() > 255)
                || self.buffer_len() > MAX_CLC_LEN
            {
                return Err(Error::Malformed {
                    what: "CLC Confirm v2",
                    why: "GID list too long",
                });
            }
        }
        let len = self.buffer_len();
        let mut w = Writer::new(buf);
        let flags = if self.first_contact { 0x08 } else { 0 };
        ClcHeader::emit(&mut w, msg_type, len, self.version, flags);
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
        if let Some(v2) = &self.v2 {
            w.put(&v2.eid.0);
            w.zeros(8);
            if let Some(fce) = &v2.first_contact_ext {
                fce.write(&mut w);
            }
            if let Some(gids) = &v2.gid_list {
                w.u8(gids.len() as u8);
                w.zeros(3);
                for g in gids {
                    w.put(&g.0);
                }
            }
        }
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

    /// A version-2 Decline (44 bytes, smc-rv2.md §8): OS type Linux, no further diagnoses.
    pub fn new_v2(peer_id: PeerId, diagnosis: DeclineCode, out_of_sync: bool) -> Decline {
        Decline {
            version: 2,
            out_of_sync,
            peer_id,
            diagnosis,
            os_type: OS_TYPE_LINUX,
            v2_diagnoses: Some([DeclineCode(0); 4]),
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
        // smc-rv2.md §4.2: exactly 28 bytes when byte 7 says version 1, exactly 44 when it
        // says version 2 (Linux checks both).
        let (want, expected) = if h.version >= 2 {
            (DECLINE_V2_LEN, "44 for version 2")
        } else {
            (DECLINE_LEN, "28 for version 1")
        };
        if len != want {
            return Err(Error::BadLength {
                what: "CLC Decline",
                found: len,
                expected,
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
