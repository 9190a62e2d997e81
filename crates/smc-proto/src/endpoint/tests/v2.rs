//! SMC-Rv2 negotiation between two endpoints (shared/spec/smc-rv2.md §4.3, §5.5, §9): v1 and
//! v2 offered together, v2 chosen when both offer it, share a UEID and have a RoCEv2-capable
//! device, the Linux decline codes otherwise; v2 first and subsequent contact; LLC in v2 form.

use smc_wire::clc_v2::smc_type;
use smc_wire::{ClcMessage, DeclineCode, Eid};

use super::*;
use crate::endpoint::{EndpointConfig, SmcVersions};
use crate::fabric::LlcVersion;
use crate::lgr_harness::{config, Traced};

fn ueid(s: &str) -> Eid {
    Eid::ueid(s).expect("valid UEID")
}

fn side(s: Side, versions: SmcVersions, ueids: &[&str]) -> EndpointConfig {
    let mut c = config(s, 1);
    c.versions = versions;
    c.ueids = ueids.iter().map(|u| ueid(u)).collect();
    c
}

const BOTH: SmcVersions = SmcVersions { v1: true, v2: true };
const V1: SmcVersions = SmcVersions {
    v1: true,
    v2: false,
};
const V2: SmcVersions = SmcVersions {
    v1: false,
    v2: true,
};

fn pair(a: EndpointConfig, b: EndpointConfig) -> EndpointPair {
    EndpointPair::new(a, b, 7)
}

fn clc(p: &EndpointPair) -> Vec<ClcMessage> {
    p.trace
        .iter()
        .filter_map(|e| match &e.what {
            Traced::Clc(_, m) => Some(m.clone()),
            _ => None,
        })
        .collect()
}

/// Both offer v1 and v2 and share a UEID: SMC-Rv2 with Linux's message sizes (Proposal with
/// IP area and extension, 160-byte first-contact Accept, 180-byte Confirm), every LLC message
/// in v2 form, max links 2 agreed; with one RNIC each the server's ADD LINK v2 (an asymmetric
/// link on its one RNIC) is rejected as a Linux client does (§13 item 1) and the group keeps
/// one link; data both ways; a second connection reuses the group (108 bytes).
#[test]
fn both_versions_shared_ueid_gives_v2() {
    let mut p = pair(
        side(Side::A, BOTH, &["SMC-RS-TEST"]),
        side(Side::B, BOTH, &["OTHER", "SMC-RS-TEST"]),
    );
    p.connect(T1);
    p.run();
    dump(&p);
    assert!(established(&p, Side::A, T1) && established(&p, Side::B, T1));
    let m = clc(&p);
    let ClcMessage::Proposal(prop) = &m[0] else {
        panic!("{m:?}")
    };
    assert_eq!(prop.version, 2);
    assert_eq!(
        (prop.smc_type_v1, prop.smc_type_v2),
        (smc_type::R, smc_type::R)
    );
    assert_eq!(prop.buffer_len(), 80 + 8 + 40 + 32 + 4);
    let ext = prop.v2_ext.as_ref().expect("v2 extension");
    assert_eq!(ext.eids, vec![ueid("SMC-RS-TEST")]);
    assert_eq!((ext.release, ext.max_links), (1, 2));
    let ClcMessage::Accept(acc) = &m[1] else {
        panic!("{m:?}")
    };
    assert_eq!(
        (acc.version, acc.first_contact, acc.buffer_len()),
        (2, true, 160)
    );
    let v2 = acc.v2.as_ref().expect("v2 part");
    assert_eq!(v2.eid, ueid("SMC-RS-TEST"));
    let fce = v2.first_contact_ext.expect("first-contact extension");
    assert_eq!((fce.release, fce.max_conns, fce.max_links), (1, 255, 2));
    assert!(fce.v2_direct);
    let ClcMessage::Confirm(con) = &m[2] else {
        panic!("{m:?}")
    };
    assert_eq!(
        (con.version, con.first_contact, con.buffer_len()),
        (2, true, 180)
    );
    assert_eq!(
        con.v2.as_ref().and_then(|v| v.gid_list.clone()),
        Some(vec![con.gid])
    );
    // Every LLC message of the group in its v2 form, length 44 little-endian, but the
    // server's ADD LINK v2 (72 bytes + 16 per RMB, here one).
    for s in [Side::A, Side::B] {
        let h = p.host(s);
        assert_eq!(h.llc_v1_sent, 0, "{s:?}");
        assert!(!h.llc_v2_sent.is_empty(), "{s:?}");
        for b in &h.llc_v2_sent {
            if b[0] == 0x22 && b[3] == 0 {
                assert_eq!(
                    (s, &b[1..3], &b[70..72]),
                    (Side::B, &[88, 0][..], &[1, 0][..])
                );
            } else {
                assert_eq!(&b[1..3], &[44, 0]);
            }
        }
        let g = h.ep.link_groups().next().expect("group");
        assert!(g.v2.is_some());
        assert_eq!(g.active_count(), 1);
        assert_eq!(g.max_links, 2);
        // Every QP of a v2 group has receive buffers for 8192-byte LLC v2 messages (the
        // server's second is the one it offered for the rejected link).
        assert!(h.res.qp_llc.values().all(|v| *v == LlcVersion::V2), "{s:?}");
        assert_eq!(g.llc_version().max_recv(), 8192);
    }
    // The client's reject: 44 bytes, flags 0xC0, the request's link number.
    let reject = p
        .host(Side::A)
        .llc_v2_sent
        .iter()
        .find(|b| b[0] == 0x22)
        .expect("ADD LINK reject");
    assert_eq!((&reject[1..4], reject[31]), (&[44, 0, 0xC0][..], 2));
    // CONFIRM LINK carries max links / max conns (smc-rv2.md §10.3).
    let cl = &p.host(Side::B).llc_v2_sent[0];
    assert_eq!((cl[0], cl[3], cl[34], cl[35]), (0x21, 0x03, 2, 255));
    let a: Vec<u8> = (0..200_000u32).map(|i| (i % 253) as u8).collect();
    p.app_send(Side::A, T1, &a);
    p.app_send(Side::B, T1, &a[..50_000]);
    p.run();
    assert_eq!(p.b.rx[&T1], a);
    assert_eq!(p.a.rx[&T1], a[..50_000]);

    // Subsequent contact on the same v2 group: 108-byte Accept and Confirm.
    p.connect(T2);
    p.run();
    assert!(established(&p, Side::A, T2) && established(&p, Side::B, T2));
    let m = clc(&p);
    let n = m.len();
    assert!(
        matches!(&m[n - 2], ClcMessage::Accept(a) if a.version == 2 && !a.first_contact && a.buffer_len() == 108)
    );
    assert!(matches!(&m[n - 1], ClcMessage::Confirm(c) if c.version == 2 && c.buffer_len() == 108));
    assert_eq!(p.host(Side::A).ep.link_groups().count(), 1);
    assert_eq!(p.host(Side::A).llc_v1_sent, 0);
}

/// Without a shared UEID both fall through to v1 (the v1 part of the Proposal is there).
#[test]
fn no_shared_ueid_falls_back_to_v1() {
    let mut p = pair(
        side(Side::A, BOTH, &["ALPHA"]),
        side(Side::B, BOTH, &["BETA"]),
    );
    p.connect(T1);
    p.run();
    assert!(established(&p, Side::A, T1) && established(&p, Side::B, T1));
    let m = clc(&p);
    assert!(matches!(&m[1], ClcMessage::Accept(a) if a.version == 1 && a.buffer_len() == 68));
    assert!(matches!(&m[2], ClcMessage::Confirm(c) if c.version == 1 && !c.first_contact));
    assert_eq!(p.host(Side::A).llc_v2_sent.len(), 0);
    assert!(p.host(Side::A).ep.link_groups().all(|g| g.v2.is_none()));
    for s in [Side::A, Side::B] {
        let qps = &p.host(s).res.qp_llc;
        assert!(!qps.is_empty() && qps.values().all(|v| *v == LlcVersion::V1));
    }
}

/// SMC_VERSIONS=1 on either side: plain v1 as before (a version-1 Proposal from a v1 client).
#[test]
fn v1_only_either_side() {
    for (a, b) in [(V1, BOTH), (BOTH, V1)] {
        let mut p = pair(side(Side::A, a, &["U"]), side(Side::B, b, &["U"]));
        p.connect(T1);
        p.run();
        assert!(established(&p, Side::A, T1) && established(&p, Side::B, T1));
        let m = clc(&p);
        let ClcMessage::Proposal(prop) = &m[0] else {
            panic!()
        };
        assert_eq!(prop.version, if a.v2 { 2 } else { 1 });
        assert!(matches!(&m[1], ClcMessage::Accept(x) if x.version == 1));
        assert_eq!(p.host(Side::B).llc_v2_sent.len(), 0);
    }
}

/// SMC_VERSIONS=2 on both sides with a shared UEID: a v2-only Proposal (v1 part zero except
/// the peer ID, 156 bytes as Linux's) and v2.
#[test]
fn v2_only_both_sides() {
    let mut p = pair(side(Side::A, V2, &["U"]), side(Side::B, V2, &["U"]));
    p.connect(T1);
    p.run();
    dump(&p);
    assert!(established(&p, Side::A, T1) && established(&p, Side::B, T1));
    let m = clc(&p);
    let ClcMessage::Proposal(prop) = &m[0] else {
        panic!()
    };
    assert_eq!(prop.smc_type_v1, smc_type::NONE);
    assert_eq!(prop.buffer_len(), 156);
    assert!(prop.preferred_gid.0.iter().all(|&b| b == 0));
    assert_ne!(prop.peer_id, smc_wire::PeerId::default());
}

fn declined_with(p: &EndpointPair, server: DeclineCode, len: usize) {
    assert_eq!(
        fell_back(p, Side::A, T1),
        Some(Fallback::PeerDeclined {
            code: server,
            out_of_sync: false
        })
    );
    let m = clc(p);
    let d = m
        .iter()
        .find_map(|x| match x {
            ClcMessage::Decline(d) => Some(*d),
            _ => None,
        })
        .expect("a Decline");
    assert_eq!(d.buffer_len(), len);
}

/// The server's Decline codes (smc-rv2.md §8, §9.1), version 2 (44 bytes) to a v2 Proposal.
#[test]
fn v2_decline_codes() {
    // No UEID shared, nothing else offered: 0x03030000.
    let mut p = pair(
        side(Side::A, V2, &["ALPHA"]),
        side(Side::B, BOTH, &["BETA"]),
    );
    p.connect(T1);
    p.run();
    declined_with(&p, DeclineCode::NOSMCDEV, 44);

    // The server does not do v2 at all: the same code.
    let mut p = pair(side(Side::A, V2, &["U"]), side(Side::B, V1, &["U"]));
    p.connect(T1);
    p.run();
    declined_with(&p, DeclineCode::NOSMCDEV, 44);

    // The server's RNIC cannot carry RoCEv2: 0x03030002.
    let mut b = side(Side::B, BOTH, &["U"]);
    b.devices[0].roce_v2 = false;
    let mut p = pair(side(Side::A, V2, &["U"]), b);
    p.connect(T1);
    p.run();
    declined_with(&p, DeclineCode::NOSMCRDEV, 44);

    // The server allows fewer than 16 connections per group: 0x0303000a.
    let mut b = side(Side::B, BOTH, &["U"]);
    b.max_conns_per_lgr = 8;
    let mut p = pair(side(Side::A, V2, &["U"]), b);
    p.connect(T1);
    p.run();
    declined_with(&p, DeclineCode::MAXCONNERR, 44);

    // A v1 client that offers nothing v1 can use gets a v1 Decline (28 bytes) from a v1
    // Proposal... here: a v2-only client against a v2-only server without a UEID in common
    // but a v1-only Proposal is impossible; a v1 Proposal to a v2-only server: 0x03030000, v1.
    let mut p = pair(side(Side::A, V1, &["U"]), side(Side::B, V2, &["U"]));
    p.connect(T1);
    p.run();
    declined_with(&p, DeclineCode::NOSMCDEV, 28);
}

/// A Proposal with no EID: 0x03030008 (peer sent no UEID).
#[test]
fn proposal_without_ueid_is_declined_0x03030008() {
    let mut p = pair(side(Side::A, V2, &["U"]), side(Side::B, V2, &["U"]));
    let raw = smc_wire::examples::bytes("clc_proposal_v2_smcr_only").expect("vector");
    let mut prop = smc_wire::Proposal::parse(&raw).expect("parses");
    prop.v2_ext.as_mut().expect("ext").eids.clear();
    let now = p.now;
    p.b.ep.accept(T1, now).expect("accept");
    p.inject_tcp(Side::B, T1, ClcMessage::Proposal(prop).to_vec());
    p.run();
    assert_eq!(
        fell_back(&p, Side::B, T1),
        Some(Fallback::Declined(DeclineCode::NOUEID))
    );
}

/// A client that can offer nothing (v2 only, no UEID) declines instead of proposing, with a
/// version-1 Decline 0x03030000 as Linux does (smc-rv2.md §5.5).
#[test]
fn client_without_ueid_declines_instead_of_proposing() {
    let mut p = pair(side(Side::A, V2, &[]), side(Side::B, BOTH, &["U"]));
    p.connect(T1);
    p.run();
    let m = clc(&p);
    assert!(
        matches!(&m[0], ClcMessage::Decline(d) if d.diagnosis == DeclineCode::NOSMCDEV && d.buffer_len() == 28)
    );
    assert_eq!(
        fell_back(&p, Side::A, T1),
        Some(Fallback::Declined(DeclineCode::NOSMCDEV))
    );
}

/// Kernel behaviour 13.1: a peer's ADD LINK on a v2 group (here: the kernel's captured ADD LINK
/// request, addressed to link 1) is rejected with a 44-byte v2 reject, flags 0xC0.
#[test]
fn add_link_on_a_v2_group_is_rejected_in_v2_form() {
    let mut p = pair(side(Side::A, BOTH, &["U"]), side(Side::B, BOTH, &["U"]));
    p.connect(T1);
    p.run();
    assert!(established(&p, Side::A, T1));
    let link = p.host(Side::A).link(1).expect("link 1");
    let before = p.host(Side::A).llc_v2_sent.len();
    let add = smc_wire::examples::bytes("llc2_add_link_req_1rkey").expect("vector");
    p.act(Side::A, |ep, res, now| {
        ep.handle_message(link, &add, res, now)
    });
    p.run();
    let sent = &p.host(Side::A).llc_v2_sent[before..];
    let reject = sent
        .iter()
        .find(|b| b[0] == 0x22)
        .expect("an ADD LINK reply");
    assert_eq!(&reject[1..4], &[44, 0, 0xC0]);
    assert!(established(&p, Side::A, T1));
    assert_eq!(
        p.host(Side::A)
            .ep
            .link_groups()
            .next()
            .map(|g| g.active_count()),
        Some(1)
    );
}

/// A v2 Accept to a client that did not propose v2: Decline 0x03040000 (smc-rv2.md §9.2).
#[test]
fn unasked_v2_accept_is_declined_0x03040000() {
    let mut p = pair(side(Side::A, V1, &["U"]), side(Side::B, BOTH, &["U"]));
    let now = p.now;
    p.a.ep.connect(T1, now).expect("connect");
    p.flush();
    let accept = smc_wire::examples::bytes("clc_accept_v2_first_contact").expect("vector");
    p.inject_tcp(Side::A, T1, accept);
    p.run();
    assert_eq!(
        fell_back(&p, Side::A, T1),
        Some(Fallback::Declined(DeclineCode::MODEUNSUPP))
    );
}

/// Our client against the Linux 6.12 server of the capture (smc-rv2.md §12, §13): the kernel's
/// own first-contact Accept (max links 2), its CONFIRM LINK and its ADD LINK v2 with one rkey
/// are fed to the client. The client confirms in v2 form with Linux's sizes and flags, echoes
/// the agreed limits, and rejects the second link exactly as the Linux client did (the
/// request's first 44 bytes with flags 0xC0), and the connection is established.
#[test]
fn client_against_the_kernel_server_of_the_capture() {
    let mut p = pair(
        side(Side::A, BOTH, &["KERNEL-PEER-SMCR-TEST"]),
        side(Side::B, BOTH, &["KERNEL-PEER-SMCR-TEST"]),
    );
    // Side B plays no part: the "kernel" is the injected bytes. Our SENDs to it are taken by
    // its (absent) RNIC and acknowledged, as rxe would.
    p.knobs.drop = Some(Box::new(|e| {
        e.from == Side::A && matches!(e.what, Traced::Llc(..) | Traced::Cdc(..))
    }));
    p.knobs.silent_drop = true;
    let now = p.now;
    p.a.ep.connect(T1, now).expect("connect");
    p.flush();
    let v = |n: &str| smc_wire::examples::bytes(n).expect("vector");
    p.inject_tcp(Side::A, T1, v("clc_accept_v2_first_contact"));
    p.run();
    let m = clc(&p);
    let ClcMessage::Confirm(c) = m.last().expect("a Confirm") else {
        panic!("{m:?}")
    };
    assert_eq!((c.version, c.first_contact, c.buffer_len()), (2, true, 180));
    let fce =
        c.v2.as_ref()
            .and_then(|x| x.first_contact_ext)
            .expect("extension");
    assert_eq!((fce.release, fce.max_conns, fce.max_links), (1, 255, 2));
    assert_eq!(
        c.v2.as_ref().map(|x| x.eid),
        Some(ueid("KERNEL-PEER-SMCR-TEST"))
    );
    let link = p.host(Side::A).link(1).expect("link 1");
    p.act(Side::A, |ep, res, now| {
        ep.handle_message(link, &v("llc2_confirm_link_req"), res, now)
    });
    p.run();
    let reply = p
        .host(Side::A)
        .llc_v2_sent
        .last()
        .expect("CONFIRM LINK reply")
        .clone();
    assert_eq!(&reply[..4], &[0x21, 0x2c, 0x00, 0x83]);
    assert_eq!((reply[29], reply[34], reply[35]), (1, 2, 255));
    let before = p.host(Side::A).llc_v2_sent.len();
    p.act(Side::A, |ep, res, now| {
        ep.handle_message(link, &v("llc2_add_link_req_1rkey"), res, now)
    });
    p.run();
    let sent = p.host(Side::A).llc_v2_sent[before..].to_vec();
    dump(&p);
    assert_eq!(
        sent.first().map(|b| b.to_vec()),
        Some(v("llc2_add_link_reject")),
        "the Linux client's reject, byte for byte"
    );
    assert!(established(&p, Side::A, T1));

    // A second connection on the same group (smc-rv2.md §12, §13 item 4): the kernel server
    // confirms a new RMB of its own between our Proposal and its Accept; we answer in v2 form
    // while the CLC handshake waits, then take its 108-byte Accept naming that RMB.
    p.act(Side::A, |ep, _, now| ep.connect(T2, now))
        .expect("connect");
    p.run();
    let mut rkey_req = v("llc2_confirm_rkey_req");
    rkey_req[5..9].copy_from_slice(&0x3b0u32.to_be_bytes());
    let before = p.host(Side::A).llc_v2_sent.len();
    p.act(Side::A, |ep, res, now| {
        ep.handle_message(link, &rkey_req, res, now)
    });
    p.run();
    let mut want = rkey_req.clone();
    want[3] = 0x80;
    assert_eq!(
        p.host(Side::A).llc_v2_sent[before..]
            .first()
            .map(|b| b.to_vec()),
        Some(want),
        "the CONFIRM RKEY reply is the request with flags 0x80"
    );
    let mut accept = v("clc_accept_v2");
    accept[41..45].copy_from_slice(&0x3b0u32.to_be_bytes());
    p.inject_tcp(Side::A, T2, accept);
    p.run();
    // Our own new RMB, if the connection needs one, is confirmed before the Confirm: answer
    // every CONFIRM RKEY request we sent as the kernel does (the request with flags 0x80).
    for _ in 0..4 {
        let pending: Vec<Vec<u8>> = p.host(Side::A).llc_v2_sent[before..]
            .iter()
            .filter(|b| b[0] == 0x26 && b[3] == 0)
            .map(|b| b.to_vec())
            .collect();
        for mut r in pending {
            r[3] = 0x80;
            p.act(Side::A, |ep, res, now| {
                ep.handle_message(link, &r, res, now)
            });
        }
        p.run();
        if established(&p, Side::A, T2) {
            break;
        }
    }
    let m = clc(&p);
    assert!(
        matches!(m.last(), Some(ClcMessage::Confirm(c)) if c.version == 2 && c.buffer_len() == 108 && c.rmbe_alert_token != 0),
        "{m:?}"
    );
    assert!(established(&p, Side::A, T2));
    assert_eq!(p.host(Side::A).ep.link_groups().count(), 1);
}

/// Our server against the Linux 6.12 client of the capture: the kernel's own Proposal (v2
/// only, zero peer ID, max links 2) gets a 160-byte first-contact Accept agreeing on max links
/// 2; the kernel's Confirm (echoing what we sent) is taken, CONFIRM LINK goes in v2 form with
/// flags 0x03; on the kernel's reply our ADD LINK v2 follows at once (so a Linux client does
/// not wait for it, smc-rv2.md §13 item 2): with our one RNIC, an asymmetric link on it, which
/// the kernel client rejects as in the capture (§10.4). On that reject the group keeps its one
/// link, the connection is established, and no DELETE LINK goes out.
#[test]
fn server_against_the_kernel_client_of_the_capture() {
    let mut p = pair(
        side(Side::A, BOTH, &["KERNEL-PEER-SMCR-TEST"]),
        side(Side::B, BOTH, &["OTHER", "KERNEL-PEER-SMCR-TEST"]),
    );
    p.knobs.drop = Some(Box::new(|e| {
        e.from == Side::B && matches!(e.what, Traced::Llc(..) | Traced::Cdc(..))
    }));
    p.knobs.silent_drop = true;
    let v = |n: &str| smc_wire::examples::bytes(n).expect("vector");
    let now = p.now;
    p.b.ep.accept(T1, now).expect("accept");
    p.inject_tcp(Side::B, T1, v("clc_proposal_v2_smcr_only"));
    p.run();
    let m = clc(&p);
    let ClcMessage::Accept(a) = m.last().expect("an Accept") else {
        panic!("{m:?}")
    };
    assert_eq!((a.version, a.first_contact, a.buffer_len()), (2, true, 160));
    let fce =
        a.v2.as_ref()
            .and_then(|x| x.first_contact_ext)
            .expect("extension");
    assert_eq!((fce.release, fce.max_conns, fce.max_links), (1, 255, 2));
    assert_eq!(
        a.v2.as_ref().map(|x| x.eid),
        Some(ueid("KERNEL-PEER-SMCR-TEST"))
    );
    // The kernel client's Confirm, echoing our limits (max links 2 at byte 141).
    let confirm = v("clc_confirm_v2_first_contact");
    assert_eq!(confirm[141], 2);
    p.inject_tcp(Side::B, T1, confirm);
    p.run();
    let cl = p.host(Side::B).llc_v2_sent[0].clone();
    assert_eq!(&cl[..4], &[0x21, 0x2c, 0x00, 0x03]);
    assert_eq!((cl[34], cl[35]), (2, 255));
    let link = p.host(Side::B).link(1).expect("link 1");
    p.act(Side::B, |ep, res, now| {
        ep.handle_message(link, &v("llc2_confirm_link_resp"), res, now)
    });
    p.run();
    let add = p
        .host(Side::B)
        .llc_v2_sent
        .iter()
        .find(|b| b[0] == 0x22)
        .expect("ADD LINK v2")
        .clone();
    // 72 + 16 bytes: our one RMB; link 2; our own GID (the one RNIC) as sender and target.
    assert_eq!((&add[..4], add[31]), (&[0x22, 88, 0, 0][..], 2));
    assert_eq!(&add[12..28], &add[46..62]);
    assert_eq!(&add[70..72], &[1, 0]);
    // The kernel's reject: the request's first 44 bytes, flags 0xC0.
    let mut reject = add[..44].to_vec();
    reject[1] = 44;
    reject[3] = 0xC0;
    p.act(Side::B, |ep, res, now| {
        ep.handle_message(link, &reject, res, now)
    });
    p.run();
    assert!(established(&p, Side::B, T1));
    let g = p.host(Side::B).ep.link_groups().next().expect("group");
    assert_eq!((g.active_count(), g.links.len()), (1, 1));
    assert!(
        !p.host(Side::B).llc_v2_sent.iter().any(|b| b[0] == 0x24),
        "no DELETE LINK"
    );
}
