//! SMC-Rv2 in the endpoint (shared/spec/smc-rv2.md): which versions we offer and accept, the
//! server's negotiation as Linux 6.12 does it (§9.1), the client's checks of a v2 Accept
//! (§9.2), and the LLC messages of a v2 link group in their v2 form (§10).
//!
//! A v2 link group has up to [`V2_MAX_LINKS`] (2) links: the server runs ADD LINK right after
//! CONFIRM LINK as Linux does (§13 items 1–2), with the rkeys of its RMBs in the ADD LINK v2
//! itself (§10.4, 72 + 16·n bytes; no ADD LINK CONTINUATION in v2), and a client that accepts
//! answers with its own (`llc/add_link.rs`). A client whose first contact agreed max links 2
//! waits up to [`V2_ADD_LINK_WAIT`] for that ADD LINK, as a Linux client does.

use smc_wire::clc::{DeclineCode, Proposal};
use smc_wire::clc_v2::{FirstContactExt, MIN_MAX_CONNS, OS_TYPE_LINUX, SMC_RELEASE};
use smc_wire::llc::{AddLinkRejectReason, DeleteRkey, LlcMessage};
use smc_wire::llc_v2::{AddLinkV2, DeleteRkeyV2, LlcV2Message};
use smc_wire::{Eid, Gid, MSG44_LEN};

/// The SMC versions an endpoint offers (client) and accepts (server).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SmcVersions {
    /// SMC-R version 1 (RFC 7609).
    pub v1: bool,
    /// SMC-Rv2 (needs a UEID and a RoCEv2-capable device).
    pub v2: bool,
}

impl Default for SmcVersions {
    /// Both, as Linux offers them together.
    fn default() -> Self {
        SmcVersions { v1: true, v2: true }
    }
}

/// Links per v2 link group we negotiate at most (the CLC range is 1..=2, smc-rv2.md §9.2).
pub const V2_MAX_LINKS: u8 = 2;

/// How long a v2 client whose first contact agreed max links 2 waits for the server's ADD
/// LINK after its CONFIRM LINK reply before it finishes with one link (smc-rv2.md §14: "client
/// waits for ADD LINK after CONFIRM LINK (max links > 1) | 2 s").
pub const V2_ADD_LINK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Most rkey entries in an ADD LINK v2 (smc-rv2.md §10.4: the receiver "uses at most 255
/// entries").
pub(crate) const ADD_LINK_V2_MAX_RKEYS: usize = 255;

/// What a v2 link group agreed on (the Accept's first-contact extension).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LgrV2 {
    /// The negotiated EID.
    pub eid: Eid,
    /// The negotiated SMC release.
    pub release: u8,
    /// Release ≥ 1: connections per link group.
    pub max_conns: u8,
    /// Release ≥ 1: links per link group.
    pub max_links: u8,
    /// The client's RoCEv2 GID (from its Proposal; the server's reuse key with the peer ID).
    pub client_gid: Gid,
}

impl LgrV2 {
    /// The first-contact extension describing this agreement.
    pub fn first_contact_ext(&self, hostname: &[u8; 32]) -> FirstContactExt {
        let limits = self.release >= 1;
        FirstContactExt {
            // One Ethernet segment (or one shm fabric): no gateway.
            v2_direct: true,
            os_type: OS_TYPE_LINUX,
            release: self.release,
            hostname: *hostname,
            max_conns: if limits { self.max_conns } else { 0 },
            max_links: if limits { self.max_links } else { 0 },
            feature_mask: 0,
            vendor_options: 0,
        }
    }
}

/// The server's v2 decision for a Proposal (smc-rv2.md §9.1 steps 4–6): the agreement, or the
/// Decline code of the first check that failed.
pub(super) fn negotiate_server(
    p: &Proposal,
    ueids: &[Eid],
    our_max_conns: u8,
    have_device: bool,
) -> Result<LgrV2, DeclineCode> {
    let Some(ext) = p.v2_ext.as_ref().filter(|_| p.offers_smcr_v2()) else {
        return Err(DeclineCode::NOV2EXT);
    };
    // §9.1 step 4: "EID count 0 → no SMC-Rv2".
    if ext.eids.is_empty() {
        return Err(DeclineCode::NOUEID);
    }
    let release = ext.release.min(SMC_RELEASE);
    let (mut max_conns, mut max_links) = (0, 0);
    if release >= 1 {
        // Step 5: the minima must be at least 16 connections and 1 link.
        max_conns = ext.max_conns.min(our_max_conns);
        if max_conns < MIN_MAX_CONNS {
            return Err(DeclineCode::MAXCONNERR);
        }
        max_links = ext.max_links.min(V2_MAX_LINKS);
        if max_links < 1 {
            return Err(DeclineCode::MAXLINKERR);
        }
    }
    // Step 6: the first Proposal UEID (in Proposal order) equal to one of ours, all 32 bytes.
    let Some(eid) = ext.eids.iter().find(|e| ueids.contains(e)).copied() else {
        return Err(DeclineCode::NOSMCDEV);
    };
    if !have_device {
        return Err(DeclineCode::NOSMCRDEV);
    }
    Ok(LgrV2 {
        eid,
        release,
        max_conns,
        max_links,
        client_gid: ext.roce_v2_gid,
    })
}

/// The client's check of a v2 Accept's first-contact extension (§9.2): release, and for
/// release ≥ 1 max conns 16..=255 and max links 1..=2; returns the agreement.
pub(super) fn check_accept_ext(
    fce: &FirstContactExt,
    eid: Eid,
    our_gid: Gid,
) -> Result<LgrV2, DeclineCode> {
    if fce.release > SMC_RELEASE {
        return Err(DeclineCode::RELEASEERR);
    }
    if fce.release >= 1 {
        if fce.max_conns < MIN_MAX_CONNS {
            return Err(DeclineCode::MAXCONNERR);
        }
        if !(1..=2).contains(&fce.max_links) {
            return Err(DeclineCode::MAXLINKERR);
        }
    }
    Ok(LgrV2 {
        eid,
        release: fce.release,
        max_conns: fce.max_conns,
        max_links: fce.max_links,
        client_gid: our_gid,
    })
}

/// The server's check of a first-contact v2 Confirm (§9.1 step 8): it must repeat the
/// Accept's release and, for release ≥ 1, its limits.
pub(super) fn check_confirm_ext(
    fce: Option<&FirstContactExt>,
    agreed: &LgrV2,
) -> Result<(), DeclineCode> {
    let Some(fce) = fce else {
        return Err(DeclineCode::RELEASEERR);
    };
    if fce.release != agreed.release {
        return Err(DeclineCode::RELEASEERR);
    }
    if agreed.release >= 1 {
        if fce.max_conns != agreed.max_conns {
            return Err(DeclineCode::MAXCONNERR);
        }
        if fce.max_links != agreed.max_links {
            return Err(DeclineCode::MAXLINKERR);
        }
    }
    Ok(())
}

/// The bytes of an LLC message on a link of a group of LLC version `v2`: the v1 form, or the
/// v2 form (type `0x2X`, little-endian length; DELETE RKEY replies with an invalid count over a
/// zeroed list, as Linux sends them; ADD LINK without reject reason).
pub(crate) fn llc_to_wire(msg: &LlcMessage, v2: bool) -> [u8; MSG44_LEN] {
    if !v2 {
        return msg.to_bytes();
    }
    let v = match *msg {
        LlcMessage::ConfirmLink(m) => LlcV2Message::ConfirmLink(m),
        LlcMessage::AddLink(mut m) => {
            m.reject_reason = AddLinkRejectReason(0);
            LlcV2Message::AddLink(AddLinkV2 { base: m, ext: None })
        }
        LlcMessage::DeleteLink(m) => LlcV2Message::DeleteLink(m),
        LlcMessage::ConfirmRkey(m) => LlcV2Message::ConfirmRkey(m),
        LlcMessage::TestLink(m) => LlcV2Message::TestLink(m),
        LlcMessage::DeleteRkey(m) => LlcV2Message::DeleteRkey(DeleteRkeyV2 {
            reply: m.reply,
            negative: m.negative,
            count: m.count,
            invalid_count: if m.reply {
                m.error_mask.count_ones() as u8
            } else {
                0
            },
            rkeys: if m.reply {
                vec![0; m.valid_rkeys().len()]
            } else {
                m.valid_rkeys().to_vec()
            },
        }),
        // No v2 form (never sent in a v2 group: no continuations in v2, §10.4).
        LlcMessage::AddLinkCont(_)
        | LlcMessage::ConfirmRkeyCont(_)
        | LlcMessage::Optional { .. } => return msg.to_bytes(),
    };
    let mut b = [0u8; MSG44_LEN];
    // Every message above is 44 bytes in v2 form (at most 8 rkeys in a DELETE RKEY).
    let _ = v.emit(&mut b);
    b
}

/// The v1 view of a received LLC v2 message, for the link-group engine (and traces); `None` for what it
/// has no use for (REQ ADD LINK, which the engine takes in its v2 form; a DELETE RKEY of more
/// than 8 rkeys, which Linux never sends). An ADD LINK's rkeys are not in the view: the engine
/// takes them from the v2 form too.
pub fn llc_from_v2(m: LlcV2Message) -> Option<LlcMessage> {
    Some(match m {
        LlcV2Message::ConfirmLink(c) => LlcMessage::ConfirmLink(c),
        LlcV2Message::AddLink(a) => LlcMessage::AddLink(a.base),
        LlcV2Message::DeleteLink(d) => LlcMessage::DeleteLink(d),
        LlcV2Message::ConfirmRkey(c) => LlcMessage::ConfirmRkey(c),
        LlcV2Message::TestLink(t) => LlcMessage::TestLink(t),
        LlcV2Message::DeleteRkey(d) => {
            if usize::from(d.count) > 8 || d.rkeys.len() > 8 {
                return None;
            }
            let mut rkeys = [0u32; 8];
            rkeys[..d.rkeys.len()].copy_from_slice(&d.rkeys);
            // A v2 reply counts the invalid rkeys instead of marking them; mark as many from
            // the first (the engine only uses the mask to know whether any failed).
            let invalid = d.invalid_count.min(8);
            let error_mask = if d.reply && invalid > 0 {
                // `invalid` is the peer's and may be 8: a shift by the whole width is not
                // defined for u8, so 8 invalid rkeys mark all eight.
                !0xFFu8.checked_shr(u32::from(invalid)).unwrap_or(0)
            } else {
                0
            };
            LlcMessage::DeleteRkey(DeleteRkey {
                reply: d.reply,
                negative: d.negative,
                count: d.count,
                error_mask,
                rkeys,
            })
        }
        LlcV2Message::ReqAddLink(_) => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use smc_wire::examples::bytes;
    use smc_wire::SendMessage;

    #[test]
    fn delete_rkey_reply_invalid_count_from_the_peer() {
        // The count of invalid rkeys is the peer's: every value 0..=255 maps to a mask, 8 and
        // more to all eight (found by the engine fuzz target: a shift by 8 overflowed).
        for (invalid, mask) in [
            (0u8, 0u8),
            (1, 0x80),
            (3, 0xE0),
            (7, 0xFE),
            (8, 0xFF),
            (255, 0xFF),
        ] {
            let m = LlcV2Message::DeleteRkey(DeleteRkeyV2 {
                reply: true,
                negative: invalid > 0,
                count: 8,
                invalid_count: invalid,
                rkeys: vec![0; 8],
            });
            let Some(LlcMessage::DeleteRkey(d)) = llc_from_v2(m) else {
                panic!("DELETE RKEY has a v1 view")
            };
            assert_eq!(d.error_mask, mask, "invalid {invalid}");
        }
    }

    #[test]
    fn v2_llc_out_and_back() {
        // The captured DELETE RKEY request and its reply: our engine's v1 view re-emits in
        // v2 form to the kernel's bytes.
        for name in [
            "llc2_delete_rkey_req",
            "llc2_confirm_link_req",
            "llc2_add_link_reject",
        ] {
            let b = bytes(name).expect("vector");
            let Ok(SendMessage::LlcV2(m)) = SendMessage::parse(&b) else {
                panic!("{name}")
            };
            let v1 = llc_from_v2(m).expect("has a v1 view");
            assert_eq!(llc_to_wire(&v1, true).to_vec(), b, "{name}");
        }
        // Our v1 reply to a DELETE RKEY of one rkey, in v2 form, is Linux's reply.
        let reply = LlcMessage::DeleteRkey(DeleteRkey {
            reply: true,
            count: 1,
            rkeys: [0x3a5, 0, 0, 0, 0, 0, 0, 0],
            ..Default::default()
        });
        assert_eq!(
            llc_to_wire(&reply, true).to_vec(),
            bytes("llc2_delete_rkey_resp").expect("vector")
        );
        // A v1 group keeps the v1 bytes.
        assert_eq!(llc_to_wire(&reply, false), reply.to_bytes());
    }

    #[test]
    fn server_negotiation_follows_linux() {
        let ueid = Eid::ueid("KERNEL-PEER-SMCR-TEST").expect("ueid");
        let p =
            Proposal::parse(&bytes("clc_proposal_v2_smcr_only").expect("vector")).expect("parses");
        let ok = negotiate_server(&p, &[ueid], 255, true).expect("agrees");
        assert_eq!((ok.release, ok.max_conns, ok.max_links), (1, 255, 2));
        assert_eq!(ok.eid, ueid);
        let other = Eid::ueid("OTHER").expect("ueid");
        assert_eq!(
            negotiate_server(&p, &[other], 255, true),
            Err(DeclineCode::NOSMCDEV)
        );
        assert_eq!(
            negotiate_server(&p, &[ueid], 255, false),
            Err(DeclineCode::NOSMCRDEV)
        );
        assert_eq!(
            negotiate_server(&p, &[ueid], 15, true),
            Err(DeclineCode::MAXCONNERR)
        );
        let mut q = p.clone();
        q.v2_ext.as_mut().expect("ext").eids.clear();
        assert_eq!(
            negotiate_server(&q, &[ueid], 255, true),
            Err(DeclineCode::NOUEID)
        );
        let mut q = p.clone();
        q.v2_ext.as_mut().expect("ext").max_links = 0;
        assert_eq!(
            negotiate_server(&q, &[ueid], 255, true),
            Err(DeclineCode::MAXLINKERR)
        );
        // Release 0: no limits negotiated.
        let mut q = p;
        q.v2_ext.as_mut().expect("ext").release = 0;
        let r0 = negotiate_server(&q, &[ueid], 255, true).expect("agrees");
        assert_eq!((r0.release, r0.max_conns, r0.max_links), (0, 0, 0));
    }

    #[test]
    fn client_checks_the_accept() {
        let mut fce = FirstContactExt {
            max_conns: 255,
            max_links: 2,
            ..Default::default()
        };
        let eid = Eid::default();
        assert!(check_accept_ext(&fce, eid, Gid::default()).is_ok());
        fce.max_conns = 15;
        assert_eq!(
            check_accept_ext(&fce, eid, Gid::default()),
            Err(DeclineCode::MAXCONNERR)
        );
        fce.max_conns = 16;
        fce.max_links = 3;
        assert_eq!(
            check_accept_ext(&fce, eid, Gid::default()),
            Err(DeclineCode::MAXLINKERR)
        );
        fce.release = 2;
        assert_eq!(
            check_accept_ext(&fce, eid, Gid::default()),
            Err(DeclineCode::RELEASEERR)
        );
    }
}
