//! Multi-link SMC-Rv2 link groups (shared/spec/smc-rv2.md §10.4, §13): the ADD LINK v2 exchange
//! with the rkeys in the message itself, two links, failover; the kernel's captured ADD LINK
//! accepted by our client; malformed ADD LINK v2 from a peer.

use std::time::Duration;

use smc_wire::llc_v2::LlcV2Message;
use smc_wire::{Eid, SendMessage};

use super::*;
use crate::endpoint::{EndpointConfig, SmcVersions};
use crate::fabric::LlcVersion;
use crate::lgr_harness::{config, Traced};

fn v2_side(s: Side, devices: u8, ueid: &str) -> EndpointConfig {
    let mut c = config(s, devices);
    c.versions = SmcVersions {
        v1: false,
        v2: true,
    };
    c.ueids = vec![Eid::ueid(ueid).expect("valid UEID")];
    c
}

fn v(name: &str) -> Vec<u8> {
    smc_wire::examples::bytes(name).expect("vector")
}

fn pattern(len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(salt))
        .collect()
}

/// The LLC v2 messages `s` sent with type byte `t`.
fn sent_type(p: &EndpointPair, s: Side, t: u8) -> Vec<Vec<u8>> {
    p.host(s)
        .llc_v2_sent
        .iter()
        .filter(|b| b[0] == t)
        .map(|b| b.to_vec())
        .collect()
}

/// Two smc-rs endpoints with two RNICs each, v2 only: the server's ADD LINK v2 right after
/// CONFIRM LINK carries its RMB's rkey on the new link (88 bytes), the client's accepting
/// reply its own, no continuation, CONFIRM LINK over the new link: two active links on both
/// sides. A second connection confirms its RMBs on both links; data flows; one link is
/// killed mid-transfer and every byte arrives over the other.
#[test]
fn two_link_v2_group_adds_its_link_in_one_exchange_and_fails_over() {
    let mut p = EndpointPair::new(
        v2_side(Side::A, 2, "SMC-RS-TEST"),
        v2_side(Side::B, 2, "SMC-RS-TEST"),
        11,
    );
    p.connect(T1);
    p.run();
    dump(&p);
    assert!(established(&p, Side::A, T1) && established(&p, Side::B, T1));
    for s in [Side::A, Side::B] {
        let h = p.host(s);
        let g = h.ep.link_groups().next().expect("group");
        assert!(g.v2.is_some());
        assert_eq!((g.max_links, g.active_count()), (2, 2), "{s:?}");
        assert_eq!(h.llc_v1_sent, 0);
        assert!(h.res.qp_llc.values().all(|v| *v == LlcVersion::V2));
        // No ADD LINK CONTINUATION in v2 (in either form).
        assert!(sent_type(&p, s, 0x23).is_empty());
    }
    let req = sent_type(&p, Side::B, 0x22);
    let reply = sent_type(&p, Side::A, 0x22);
    assert_eq!(req.len(), 1);
    assert_eq!(reply.len(), 1);
    for (m, flags) in [(&req[0], 0x00), (&reply[0], 0x80)] {
        // 72 + 16: one RMB each; count 1 little-endian; link 2; target GID = sender GID.
        assert_eq!(&m[..4], &[0x22, 88, 0, flags]);
        assert_eq!((m[31], &m[70..72]), (2, &[1u8, 0][..]));
        assert_eq!(&m[12..28], &m[46..62]);
        assert_eq!(m[44], 0x80, "v2 direct");
    }
    // The reference rkey of each is the sender's RMB as the peer knows it on link 1, and the
    // new rkey and address are what the peer writes to over link 2.
    let Ok(SendMessage::LlcV2(LlcV2Message::AddLink(r))) = SendMessage::parse(&req[0]) else {
        panic!("ADD LINK v2")
    };
    let pair = r.ext.expect("rkeys").rtokens[0];
    let g = p.host(Side::A).ep.link_groups().next().expect("group");
    let peer = &g.peer_rmbs[0];
    assert_eq!(
        peer.tokens.get(&1).map(|t| t.rkey),
        Some(pair.reference_rkey)
    );
    assert_eq!(
        peer.tokens.get(&2).map(|t| (t.rkey, t.vaddr)),
        Some((pair.new_rkey, pair.new_vaddr))
    );
    // CONFIRM LINK went over link 2 (request and reply).
    let confirms = |s| {
        p.trace
            .iter()
            .filter(|e| e.from == s)
            .filter(|e| matches!(&e.what, Traced::Llc(_, smc_wire::LlcMessage::ConfirmLink(c)) if c.link_num == 2))
            .count()
    };
    assert_eq!((confirms(Side::B), confirms(Side::A)), (1, 1));

    // A second connection (its RMBs confirmed on both links), then data on both, and link 1
    // dies mid-transfer.
    p.connect(T2);
    p.run();
    assert!(established(&p, Side::A, T2) && established(&p, Side::B, T2));
    let a = pattern(300_000, 1);
    let b = pattern(200_000, 2);
    for t in [T1, T2] {
        p.app_send(Side::A, t, &a);
        p.app_send(Side::B, t, &b);
    }
    for _ in 0..40 {
        if !p.deliver_next() {
            break;
        }
    }
    let victim = p.host(Side::A).link(1).expect("link 1");
    p.kill_link(Side::A, victim);
    p.run_for(Duration::from_secs(5));
    for t in [T1, T2] {
        assert!(p.b.rx[&t] == a, "{t:?} A->B");
        assert!(p.a.rx[&t] == b, "{t:?} B->A");
    }
    assert!(p.host(Side::A).ep.stats().failovers > 0);
    for s in [Side::A, Side::B] {
        let g = p.host(s).ep.link_groups().next().expect("group");
        assert!(g.active_count() >= 1, "{s:?}");
    }
}

/// Our client with two RNICs, fed the Linux 6.12 server's captured first contact: the
/// kernel's 88-byte ADD LINK v2 (link 2, one rkey: the kernel's RMB 0x3a5 known on link 2 as
/// 0x5aa at 0xff3be41d42f70000) is accepted with a real second QP on our second RNIC, our
/// accepting reply (88 bytes, our RMB) goes back, the kernel's rkey is installed for link 2
/// before its CONFIRM LINK over it, which we answer over link 2: two active links.
#[test]
fn client_accepts_the_kernels_captured_add_link_with_a_second_rnic() {
    let mut p = EndpointPair::new(
        v2_side(Side::A, 2, "KERNEL-PEER-SMCR-TEST"),
        v2_side(Side::B, 1, "KERNEL-PEER-SMCR-TEST"),
        5,
    );
    // Side B plays no part: the "kernel" is the injected bytes.
    p.knobs.drop = Some(Box::new(|e| {
        e.from == Side::A && matches!(e.what, Traced::Llc(..) | Traced::Cdc(..))
    }));
    p.knobs.silent_drop = true;
    let now = p.now;
    p.a.ep.connect(T1, now).expect("connect");
    p.flush();
    p.inject_tcp(Side::A, T1, v("clc_accept_v2_first_contact"));
    p.run();
    let link1 = p.host(Side::A).link(1).expect("link 1");
    p.act(Side::A, |ep, res, now| {
        ep.handle_message(link1, &v("llc2_confirm_link_req"), res, now)
    });
    p.run();
    let qps_before = p.host(Side::A).res.qps.len();
    p.act(Side::A, |ep, res, now| {
        ep.handle_message(link1, &v("llc2_add_link_req_1rkey"), res, now)
    });
    p.run();
    dump(&p);
    let reply = sent_type(&p, Side::A, 0x22);
    assert_eq!(reply.len(), 1);
    let r = &reply[0];
    assert_eq!((&r[..4], r[31]), (&[0x22, 88, 0, 0x80][..], 2));
    assert_eq!(&r[70..72], &[1, 0]);
    // Our second RNIC's GID (not the first link's) as sender and target.
    let dev1 = crate::lgr_harness::device(Side::A, 1);
    assert_eq!(&r[12..28], &dev1.gid.0);
    assert_eq!(&r[46..62], &dev1.gid.0);
    assert_eq!(p.host(Side::A).res.qps.len(), qps_before + 1, "a new QP");
    let link2 = p.host(Side::A).link(2).expect("link 2");
    assert_ne!(link1, link2);
    let g = p.host(Side::A).ep.link_groups().next().expect("group");
    let kernel_rmb = &g.peer_rmbs[0];
    assert_eq!(kernel_rmb.tokens.get(&1).map(|t| t.rkey), Some(0x3a5));
    assert_eq!(
        kernel_rmb.tokens.get(&2).map(|t| (t.rkey, t.vaddr)),
        Some((0x5aa, 0xff3be41d42f70000))
    );
    // The kernel's CONFIRM LINK over the new link: its QP 0x12, link 2.
    let mut confirm = v("llc2_confirm_link_req");
    confirm[26..29].copy_from_slice(&[0, 0, 0x12]);
    confirm[29] = 2;
    let before = p.host(Side::A).llc_v2_sent.len();
    p.act(Side::A, |ep, res, now| {
        ep.handle_message(link2, &confirm, res, now)
    });
    p.run();
    let answer = p.host(Side::A).llc_v2_sent[before..]
        .iter()
        .find(|b| b[0] == 0x21)
        .expect("CONFIRM LINK reply")
        .clone();
    assert_eq!((&answer[..4], answer[29]), (&[0x21, 44, 0, 0x83][..], 2));
    assert!(established(&p, Side::A, T1));
    let g = p.host(Side::A).ep.link_groups().next().expect("group");
    assert_eq!(g.active_count(), 2);
}

/// The client of a two-RNIC v2 first contact, up to the server's ADD LINK (dropped): its link
/// 1 and the pair.
fn client_awaiting_add_link() -> (EndpointPair, crate::fabric::LinkId) {
    let mut p = EndpointPair::new(v2_side(Side::A, 2, "U"), v2_side(Side::B, 2, "U"), 3);
    // The server's ADD LINK never arrives: the tests hand the client their own.
    p.knobs.drop = Some(Box::new(|e| {
        e.from == Side::B && matches!(&e.what, Traced::Llc(_, smc_wire::LlcMessage::AddLink(_)))
    }));
    p.knobs.silent_drop = true;
    p.connect(T1);
    p.run_for(Duration::from_millis(500));
    let link = p.host(Side::A).link(1).expect("link 1");
    (p, link)
}

/// Malformed ADD LINK v2 requests from a server are counted and rejected (44 bytes, flags
/// 0xC0), the group keeps its link, nothing panics: too short for the rkey count (60 bytes),
/// a count above what the message holds with no entry at all, an entry naming an RMB we do
/// not know; a REQ ADD LINK v2 to a client is discarded. Data still flows.
#[test]
fn malformed_add_link_v2_is_counted_and_rejected() {
    let (mut p, link) = client_awaiting_add_link();
    // The server's real request, as it would have arrived.
    let mut good = sent_type(&p, Side::B, 0x22)
        .into_iter()
        .next()
        .expect("the server's ADD LINK v2");
    assert_eq!(good.len(), 88);
    let short = {
        let mut b = good[..60].to_vec();
        b[1..3].copy_from_slice(&60u16.to_le_bytes());
        b
    };
    let no_entries = {
        let mut b = good[..72].to_vec();
        b[1..3].copy_from_slice(&72u16.to_le_bytes());
        b[70..72].copy_from_slice(&200u16.to_le_bytes());
        b
    };
    let unknown_rmb = {
        let mut b = good.clone();
        b[72..76].copy_from_slice(&0xdead_beefu32.to_be_bytes());
        b
    };
    let req_add_link = LlcV2Message::ReqAddLink(smc_wire::llc_v2::ReqAddLinkV2 {
        reply: false,
        gids: vec![smc_wire::Gid([7; 16])],
    })
    .to_vec();
    for (i, bad) in [short, no_entries, unknown_rmb].into_iter().enumerate() {
        let before = p.host(Side::A).llc_v2_sent.len();
        let invalid = p.host(Side::A).ep.stats().llc_v2_add_link_invalid;
        p.act(Side::A, |ep, res, now| {
            ep.handle_message(link, &bad, res, now)
        });
        p.run_for(Duration::from_millis(100));
        let reject = p.host(Side::A).llc_v2_sent[before..]
            .iter()
            .find(|b| b[0] == 0x22)
            .unwrap_or_else(|| panic!("case {i}: no reply"))
            .clone();
        assert_eq!(&reject[1..4], &[44, 0, 0xC0], "case {i}");
        assert_eq!(
            p.host(Side::A).ep.stats().llc_v2_add_link_invalid,
            invalid + 1,
            "case {i}"
        );
        let g = p.host(Side::A).ep.link_groups().next().expect("group");
        assert_eq!(g.links.len(), 1, "case {i}");
    }
    let discarded = p.host(Side::A).ep.stats().llc_discarded;
    p.act(Side::A, |ep, res, now| {
        ep.handle_message(link, &req_add_link, res, now)
    });
    assert_eq!(p.host(Side::A).ep.stats().llc_discarded, discarded + 1);
    // The well-formed one is still accepted afterwards.
    good[3] = 0;
    p.act(Side::A, |ep, res, now| {
        ep.handle_message(link, &good, res, now)
    });
    p.run_for(Duration::from_millis(100));
    assert!(sent_type(&p, Side::A, 0x22)
        .iter()
        .any(|b| b.len() == 88 && b[3] == 0x80));
    p.app_send(Side::A, T1, &pattern(10_000, 3));
    p.run();
    assert_eq!(p.b.rx.get(&T1).map(Vec::len), Some(10_000));
}

/// A client's accepting ADD LINK v2 reply without its rkeys (44 bytes: the v1 layout) or
/// naming an RMB the server does not know: the server counts it, gives the new link up
/// (DELETE LINK for it) and keeps the group on its first link.
#[test]
fn server_refuses_an_add_link_v2_reply_without_usable_rkeys() {
    for case in 0..2 {
        let mut p = EndpointPair::new(v2_side(Side::A, 2, "U"), v2_side(Side::B, 2, "U"), 4);
        // The client's reply is replaced by a bad one.
        p.knobs.drop = Some(Box::new(|e| {
            e.from == Side::A
                && matches!(&e.what, Traced::Llc(_, smc_wire::LlcMessage::AddLink(a)) if a.reply)
        }));
        p.knobs.silent_drop = true;
        p.connect(T1);
        p.run_for(Duration::from_millis(500));
        let reply = sent_type(&p, Side::A, 0x22)
            .into_iter()
            .next()
            .expect("the client's reply");
        let bad = if case == 0 {
            let mut b = reply[..44].to_vec();
            b[1..3].copy_from_slice(&44u16.to_le_bytes());
            b
        } else {
            let mut b = reply.clone();
            b[72..76].copy_from_slice(&0x0bad_0badu32.to_be_bytes());
            b
        };
        let link = p.host(Side::B).link(1).expect("link 1");
        p.act(Side::B, |ep, res, now| {
            ep.handle_message(link, &bad, res, now)
        });
        p.run_for(Duration::from_secs(3));
        assert_eq!(
            p.host(Side::B).ep.stats().llc_v2_add_link_invalid,
            1,
            "case {case}"
        );
        assert!(
            !sent_type(&p, Side::B, 0x24).is_empty(),
            "case {case}: DELETE LINK for the new link"
        );
        assert!(established(&p, Side::A, T1) && established(&p, Side::B, T1));
        let g = p.host(Side::B).ep.link_groups().next().expect("group");
        assert_eq!(g.active_count(), 1, "case {case}");
    }
}

/// A v2 client whose first contact agreed max links 2 waits for the server's ADD LINK after
/// its CONFIRM LINK reply; when none comes within 2 s it goes on with one link (smc-rv2.md
/// §14), as a Linux client does, instead of resetting the connection. (The server's side of
/// this pair lost its ADD LINK and handles that by its own timer.)
#[test]
fn client_without_add_link_goes_on_with_one_link_after_2s() {
    let (mut p, _) = client_awaiting_add_link();
    assert!(!established(&p, Side::A, T1), "still waiting for ADD LINK");
    p.run_for(Duration::from_millis(1000));
    assert!(!established(&p, Side::A, T1), "waits 2 s");
    p.run_for(Duration::from_millis(1000));
    assert!(established(&p, Side::A, T1));
    assert!(reset(&p, Side::A, T1).is_none());
    let g = p.host(Side::A).ep.link_groups().next().expect("group");
    assert_eq!((g.links.len(), g.active_count()), (1, 1));
}

/// A client's REQ ADD LINK v2 (smc-rv2.md §10.9) to a server whose group has all its links is
/// answered as Linux answers it: the same type, flags 0x80, no GIDs, 44 bytes.
#[test]
fn req_add_link_v2_to_a_full_group_is_answered() {
    let mut p = EndpointPair::new(v2_side(Side::A, 2, "U"), v2_side(Side::B, 2, "U"), 8);
    p.connect(T1);
    p.run();
    let g = p.host(Side::B).ep.link_groups().next().expect("group");
    assert_eq!(g.active_count(), 2);
    let req = LlcV2Message::ReqAddLink(smc_wire::llc_v2::ReqAddLinkV2 {
        reply: false,
        gids: vec![crate::lgr_harness::device(Side::A, 0).gid],
    })
    .to_vec();
    assert_eq!(req.len(), 44);
    let link = p.host(Side::B).link(1).expect("link 1");
    p.act(Side::B, |ep, res, now| {
        ep.handle_message(link, &req, res, now)
    });
    p.run();
    let answers = sent_type(&p, Side::B, 0x25);
    assert_eq!(answers.len(), 1);
    assert_eq!(&answers[0][..4], &[0x25, 44, 0, 0x80]);
    assert!(answers[0][4..].iter().all(|b| *b == 0));
}

/// A v2 client that gains an RNIC tells the server with REQ ADD LINK v2 (its GIDs, the current
/// link's first, smc-rv2.md §10.9) instead of v1's ADD LINK "FYI"; the server starts ADD
/// LINK v2, and the group gets its second link.
#[test]
fn new_client_rnic_sends_req_add_link_v2_and_gets_a_second_link() {
    let mut p = EndpointPair::new(v2_side(Side::A, 1, "U"), v2_side(Side::B, 1, "U"), 9);
    p.connect(T1);
    p.run();
    assert!(established(&p, Side::A, T1));
    let g = p.host(Side::A).ep.link_groups().next().expect("group");
    assert_eq!(g.active_count(), 1, "the asymmetric offer was rejected");
    let dev = crate::lgr_harness::device(Side::A, 1);
    p.act(Side::A, |ep, res, now| ep.add_device(dev, res, now));
    p.run();
    let req = sent_type(&p, Side::A, 0x25);
    assert_eq!(req.len(), 1);
    let Ok(SendMessage::LlcV2(LlcV2Message::ReqAddLink(r))) = SendMessage::parse(&req[0]) else {
        panic!("REQ ADD LINK v2")
    };
    assert!(!r.reply);
    assert_eq!(
        r.gids,
        vec![crate::lgr_harness::device(Side::A, 0).gid, dev.gid]
    );
    for s in [Side::A, Side::B] {
        let g = p.host(s).ep.link_groups().next().expect("group");
        assert_eq!(g.active_count(), 2, "{s:?}");
    }
    let a = pattern(100_000, 4);
    p.app_send(Side::A, T1, &a);
    p.run();
    assert!(p.b.rx[&T1] == a);
}
