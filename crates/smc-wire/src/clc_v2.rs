//! The SMC version 2 parts of CLC messages (smc-rv2.md §5, §7, §8): the Proposal's SMC v2
//! extension, the EID and first-contact extension of an Accept or Confirm, and the GID list of
//! a first-contact Confirm. The messages themselves live in [`crate::clc`].

use crate::codec::{Reader, Writer};
use crate::eid::{Eid, EID_LEN};
use crate::error::Result;
use crate::types::Gid;

/// Length of a version-2 SMC-R Accept or Confirm without first-contact extension.
pub const ACCEPT_CONFIRM_V2_LEN: usize = 108;
/// Length of the first-contact extension (Accept/Confirm bytes 104–155).
pub const FIRST_CONTACT_EXT_LEN: usize = 52;
/// Length of a first-contact version-2 Accept.
pub const ACCEPT_V2_FIRST_CONTACT_LEN: usize = ACCEPT_CONFIRM_V2_LEN + FIRST_CONTACT_EXT_LEN;
/// Fixed part of the Proposal's SMC v2 extension, before the EIDs.
pub const PROPOSAL_V2_EXT_FIXED_LEN: usize = 40;
/// Fixed part of the SMC-Dv2 extension (system EID + reserved), before the ISM entries.
pub const SMCD_V2_EXT_FIXED_LEN: usize = 48;
/// One ISM entry of the SMC-Dv2 extension (GID + CHID).
pub const SMCD_V2_ISM_ENTRY_LEN: usize = 10;
/// Largest v2 extension offset Linux accepts in a Proposal (the end of its largest IP area).
pub const MAX_V2_EXT_OFFSET: usize = 172;
/// The SMC release this implementation speaks: release 1 (v2.1, with max conns/links).
pub const SMC_RELEASE: u8 = 1;
/// OS type "Linux" of the first-contact extension and the v2 Decline.
pub const OS_TYPE_LINUX: u8 = 2;
/// Feature-mask bit 0: emulated-ISM (SMC-D loopback) support.
pub const FEATURE_EMULATED_ISM: u16 = 0x0001;
/// Fewest connections per link group a v2.1 peer may negotiate (Linux's lower bound).
pub const MIN_MAX_CONNS: u8 = 16;

/// SMC type codes of a Proposal's byte 7 (v1 type in bits 0x03, v2 type in bits 0x0C).
pub mod smc_type {
    /// SMC-R.
    pub const R: u8 = 0;
    /// SMC-D.
    pub const D: u8 = 1;
    /// Neither.
    pub const NONE: u8 = 2;
    /// SMC-R and SMC-D.
    pub const BOTH: u8 = 3;

    /// Whether a type code includes SMC-R.
    pub fn includes_r(t: u8) -> bool {
        t == R || t == BOTH
    }

    /// Whether a type code includes SMC-D.
    pub fn includes_d(t: u8) -> bool {
        t == D || t == BOTH
    }
}

/// The SMC v2 extension of a Proposal (smc-rv2.md §5.2).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct ProposalV2Ext {
    /// The sender's user EIDs, in its order (Linux: its whole table, at most 4).
    pub eids: Vec<Eid>,
    /// Number of SMC-Dv2 ISM entries (0 for SMC-R).
    pub ism_gid_count: u8,
    /// SMC release (high nibble of byte 3): 0 = v2.0, 1 = v2.1.
    pub release: u8,
    /// Byte 3 bit 0x01: a system EID is present (s390 SMC-D only).
    pub seid: bool,
    /// Distance from the extension's byte 8 to the SMC-Dv2 extension; 0 if none.
    pub smcd_v2_ext_offset: u16,
    /// The client's IPv4-mapped RoCEv2 GID (zero if SMC-Rv2 is not offered).
    pub roce_v2_gid: Gid,
    /// Release ≥ 1: connections per link group the client wants.
    pub max_conns: u8,
    /// Release ≥ 1: links per link group the client wants.
    pub max_links: u8,
    /// Release ≥ 1: feature mask (bit 0: emulated ISM).
    pub feature_mask: u16,
}

impl ProposalV2Ext {
    /// Length on the wire: 40 + 32 per EID.
    pub fn buffer_len(&self) -> usize {
        PROPOSAL_V2_EXT_FIXED_LEN + EID_LEN * self.eids.len()
    }

    /// Parse the fixed part and the EIDs from `r`.
    pub(crate) fn read(r: &mut Reader<'_>) -> Result<ProposalV2Ext> {
        let eid_count = r.u8()?;
        let ism_gid_count = r.u8()?;
        r.skip(1)?;
        let rel = r.u8()?;
        r.skip(2)?;
        let smcd_v2_ext_offset = r.u16()?;
        let roce_v2_gid = Gid(r.array()?);
        let max_conns = r.u8()?;
        let max_links = r.u8()?;
        let feature_mask = r.u16()?;
        r.skip(12)?;
        let mut eids = Vec::with_capacity(usize::from(eid_count));
        for _ in 0..eid_count {
            eids.push(Eid(r.array()?));
        }
        Ok(ProposalV2Ext {
            eids,
            ism_gid_count,
            release: rel >> 4,
            seid: rel & 0x01 != 0,
            smcd_v2_ext_offset,
            roce_v2_gid,
            max_conns,
            max_links,
            feature_mask,
        })
    }

    pub(crate) fn write(&self, w: &mut Writer<'_>) {
        w.u8(self.eids.len() as u8);
        w.u8(self.ism_gid_count);
        w.zeros(1);
        w.u8(((self.release & 0x0F) << 4) | u8::from(self.seid));
        w.zeros(2);
        w.u16(self.smcd_v2_ext_offset);
        w.put(&self.roce_v2_gid.0);
        w.u8(self.max_conns);
        w.u8(self.max_links);
        w.u16(self.feature_mask);
        w.zeros(12);
        for e in &self.eids {
            w.put(&e.0);
        }
    }
}

/// The first-contact extension of a version-2 Accept or Confirm (smc-rv2.md §7.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FirstContactExt {
    /// Byte 104 bit 0x80: the peers reach each other without an IP gateway.
    pub v2_direct: bool,
    /// OS type (high nibble of byte 105): 1 z/OS, 2 Linux, 3 AIX.
    pub os_type: u8,
    /// SMC release (low nibble of byte 105).
    pub release: u8,
    /// The sender's host name, ASCII, blank-padded.
    pub hostname: [u8; 32],
    /// Release ≥ 1: negotiated connections per link group.
    pub max_conns: u8,
    /// Release ≥ 1: negotiated links per link group.
    pub max_links: u8,
    /// Release ≥ 1: common features.
    pub feature_mask: u16,
    /// Vendor options (0).
    pub vendor_options: u32,
}

impl Default for FirstContactExt {
    fn default() -> Self {
        FirstContactExt {
            v2_direct: true,
            os_type: OS_TYPE_LINUX,
            release: SMC_RELEASE,
            hostname: [b' '; 32],
            max_conns: 0,
            max_links: 0,
            feature_mask: 0,
            vendor_options: 0,
        }
    }
}

impl FirstContactExt {
    /// A host name blank-padded (or cut) to 32 bytes; non-ASCII bytes become `?`.
    pub fn hostname_field(name: &str) -> [u8; 32] {
        let mut b = [b' '; 32];
        for (d, s) in b.iter_mut().zip(name.bytes()) {
            *d = if s.is_ascii_graphic() { s } else { b'?' };
        }
        b
    }

    /// The host name without its padding.
    pub fn hostname_text(&self) -> String {
        let end = self
            .hostname
            .iter()
            .rposition(|&c| c != b' ' && c != 0)
            .map_or(0, |i| i + 1);
        self.hostname[..end].escape_ascii().to_string()
    }

    pub(crate) fn read(r: &mut Reader<'_>) -> Result<FirstContactExt> {
        let flags = r.u8()?;
        let os_rel = r.u8()?;
        r.skip(2)?;
        let hostname = r.array()?;
        let max_conns = r.u8()?;
        let max_links = r.u8()?;
        let feature_mask = r.u16()?;
        let vendor_options = r.u32()?;
        r.skip(8)?;
        Ok(FirstContactExt {
            v2_direct: flags & 0x80 != 0,
            os_type: os_rel >> 4,
            release: os_rel & 0x0F,
            hostname,
            max_conns,
            max_links,
            feature_mask,
            vendor_options,
        })
    }

    pub(crate) fn write(&self, w: &mut Writer<'_>) {
        w.u8(if self.v2_direct { 0x80 } else { 0 });
        w.u8(((self.os_type & 0x0F) << 4) | (self.release & 0x0F));
        w.zeros(2);
        w.put(&self.hostname);
        w.u8(self.max_conns);
        w.u8(self.max_links);
        w.u16(self.feature_mask);
        w.u32(self.vendor_options);
        w.zeros(8);
    }
}

/// What a version-2 Accept or Confirm carries beyond the 64 bytes it shares with version 1
/// (smc-rv2.md §7.1).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct AcceptConfirmV2 {
    /// The negotiated EID (bytes 64–95): the server picks it, the client echoes it.
    pub eid: Eid,
    /// The first-contact extension, present exactly when byte 7 has the first-contact bit.
    pub first_contact_ext: Option<FirstContactExt>,
    /// A first-contact Confirm's GID list (the client's RoCEv2 GIDs, its link GID first).
    pub gid_list: Option<Vec<Gid>>,
}

impl AcceptConfirmV2 {
    /// Bytes after the v1 part (64): EID, reserved, extension, GID list.
    pub fn buffer_len(&self) -> usize {
        EID_LEN
            + 8
            + self.first_contact_ext.map_or(0, |_| FIRST_CONTACT_EXT_LEN)
            + self.gid_list.as_ref().map_or(0, |g| 4 + 16 * g.len())
    }
}
