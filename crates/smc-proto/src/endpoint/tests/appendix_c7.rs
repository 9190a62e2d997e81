//! One test per row of the RFC 7609 App. C.7.1 tables: LLC timeouts (the reply is lost
//! silently, as when "the sender thinks the send succeeded but it actually didn't") and
//! invalid LLC messages.

use std::time::Duration;

use smc_wire::llc::{
    AddLink, AddLinkCont, ConfirmLink, ConfirmRkey, DeleteLink, DeleteLinkReason, DeleteRkey,
    LinkRtoken, TestLink,
};
use smc_wire::{LlcMessage, QpMtu};

use super::*;
use crate::lgr_harness::{config, device, Traced};

/// A pair whose drop knob loses the matching messages silently.
fn lossy(
    a: u8,
    b: u8,
    f: impl FnMut(&crate::lgr_harness::TraceEntry) -> bool + 'static,
) -> EndpointPair {
    let mut p = EndpointPair::with_devices(a, b);
    p.knobs.silent_drop = true;
    p.knobs.drop = Some(Box::new(f));
    p
}

fn llc(e: &crate::lgr_harness::TraceEntry) -> Option<&LlcMessage> {
    match &e.what {
        Traced::Llc(_, m) => Some(m),
        _ => None,
    }
}

fn is_confirm_link(e: &crate::lgr_harness::TraceEntry, num: u8, reply: bool) -> bool {
    matches!(llc(e), Some(LlcMessage::ConfirmLink(c)) if c.link_num == num && c.reply == reply)
}

fn lgr_of(p: &EndpointPair, s: Side) -> crate::fabric::LgrId {
    p.host(s)
        .ep
        .link_groups()
        .next()
        .map(|g| g.id)
        .expect("group")
}

fn links(p: &EndpointPair, s: Side) -> Vec<u8> {
    p.host(s)
        .ep
        .link_groups()
        .next()
        .map(|g| g.links.keys().copied().collect())
        .unwrap_or_default()
}

const LONG: Duration = Duration::from_secs(30);

// ----- Timeouts -----------------------------------------------------------------------------

/// CONFIRM LINK from server (first contact, first link): no reply → RST, link cleaned up.
#[test]
fn c7_timeout_confirm_link_first_link() {
    let mut p = lossy(1, 1, |e| is_confirm_link(e, 1, true));
    p.connect(T1);
    p.run_for(LONG);
    assert_eq!(
        reset(&p, Side::B, T1),
        Some(ResetReason::LlcTimeout("CONFIRM LINK reply"))
    );
    assert_eq!(p.b.ep.link_groups().count(), 0);
    assert!(fell_back(&p, Side::B, T1).is_none());
}

/// CONFIRM LINK from server (first contact, second link): no reply → DELETE LINK to the
/// client; the connection is usable only after its reply.
#[test]
fn c7_timeout_confirm_link_second_link_first_contact() {
    let mut p = lossy(2, 2, |e| is_confirm_link(e, 2, true));
    p.connect(T1);
    p.run_for(LONG);
    assert!(p.sent("B->A DELETE LINK link=2"), "{:#?}", p.flow(true));
    assert!(p.sent("A->B DELETE LINK link=2 rsp"));
    let est =
        p.b.events
            .iter()
            .position(|(_, e)| matches!(e, EndpointEvent::Established { .. }));
    let rsp_at = p
        .trace
        .iter()
        .find(|e| e.to_string() == "A->B DELETE LINK link=2 rsp")
        .map(|e| e.at);
    assert!(est.is_some());
    let est_at = p.b.events[est.unwrap_or(0)].0;
    assert!(
        rsp_at.is_some_and(|r| est_at > r),
        "server established only after the reply"
    );
    assert!(!links(&p, Side::B).contains(&2));
    assert!(!links(&p, Side::A).contains(&2));
}

/// CONFIRM LINK from server (not first contact): no reply → clean up the new link, DELETE
/// LINK to the client, retry timer.
#[test]
fn c7_timeout_confirm_link_not_first_contact() {
    let mut p = lossy(1, 1, |e| is_confirm_link(e, 3, true));
    p.connect(T1);
    p.run();
    p.act(Side::A, |ep, res, now| {
        ep.add_device(device(Side::A, 1), res, now)
    });
    p.run_for(Duration::from_secs(3));
    assert!(p.sent("B->A CONFIRM LINK link=3"));
    assert!(p.sent("B->A DELETE LINK link=3"));
    assert_eq!(links(&p, Side::B), [1]);
    let g = p.b.ep.link_groups().next().expect("group");
    assert!(g.timers.is_set(crate::link_group::LgrTimer::AddLinkRetry));
    assert!(established(&p, Side::A, T1));
}

/// CONFIRM LINK reply from client (first contact): no ADD LINK → RST, link cleaned up.
#[test]
fn c7_timeout_client_waits_for_add_link() {
    let mut p = lossy(
        1,
        1,
        |e| matches!(llc(e), Some(LlcMessage::AddLink(a)) if !a.reply),
    );
    p.knobs.deliver_tcp_rst = false;
    p.connect(T1);
    p.run_for(LONG);
    assert_eq!(
        reset(&p, Side::A, T1),
        Some(ResetReason::LlcTimeout("ADD LINK"))
    );
    assert_eq!(p.a.ep.link_groups().count(), 0);
}

/// ADD LINK from server (first contact): no reply → RST, RoCE resources cleaned up.
#[test]
fn c7_timeout_add_link_first_contact() {
    let mut p = lossy(
        2,
        2,
        |e| matches!(llc(e), Some(LlcMessage::AddLink(a)) if a.reply),
    );
    p.knobs.deliver_tcp_rst = false;
    p.connect(T1);
    p.run_for(LONG);
    assert_eq!(
        reset(&p, Side::B, T1),
        Some(ResetReason::LlcTimeout("ADD LINK reply"))
    );
    assert_eq!(p.b.ep.link_groups().count(), 0);
}

/// Three RNICs each, max 3 links: a third link is added over link 1 after the first contact.
fn three_link_pair(
    drop: impl FnMut(&crate::lgr_harness::TraceEntry) -> bool + 'static,
) -> EndpointPair {
    three_link_pair_with(Duration::from_secs(2), drop)
}

/// [`three_link_pair`] with the server's maintenance LLC timer set to `server_llc`.
fn three_link_pair_with(
    server_llc: Duration,
    drop: impl FnMut(&crate::lgr_harness::TraceEntry) -> bool + 'static,
) -> EndpointPair {
    let mut a = config(Side::A, 2);
    a.max_links = 3;
    let mut b = config(Side::B, 2);
    b.max_links = 3;
    b.llc_timeout = server_llc;
    let mut p = EndpointPair::new(a, b, 5);
    p.connect(T1);
    p.run();
    assert_eq!(links(&p, Side::B), [1, 2]);
    p.knobs.silent_drop = true;
    p.knobs.drop = Some(Box::new(drop));
    p.act(Side::A, |ep, res, now| {
        ep.add_device(device(Side::A, 2), res, now)
    });
    p.run();
    p.act(Side::B, |ep, res, now| {
        ep.add_device(device(Side::B, 2), res, now)
    });
    p
}

/// ADD LINK from server (not first contact): no reply → clean up the new link and treat the
/// link the ADD LINK went over as failed (DELETE LINK for it); connections move.
#[test]
fn c7_timeout_add_link_not_first_contact() {
    let mut p = three_link_pair(
        |e| matches!(llc(e), Some(LlcMessage::AddLink(a)) if a.reply && a.link_num == 3),
    );
    p.run_for(Duration::from_secs(3));
    assert!(p.sent("B->A ADD LINK link=3"));
    assert!(p.sent("B->A DELETE LINK link=1"), "{:#?}", p.flow(true));
    assert!(!links(&p, Side::B).contains(&1));
    assert!(!links(&p, Side::B).contains(&3));
    p.knobs.drop = None;
    p.app_send(Side::A, T1, b"moved");
    p.run();
    assert_eq!(p.b.rx[&T1], b"moved");
}

/// ADD LINK reply from client (more RKeys): no ADD LINK CONTINUATION → as an ADD LINK
/// failure: the client drops the new link and treats the exchange's link as failed.
#[test]
fn c7_timeout_client_waits_for_continuation() {
    let mut p = three_link_pair(
        |e| matches!(llc(e), Some(LlcMessage::AddLinkCont(c)) if !c.reply && c.link_num == 3),
    );
    p.run_for(Duration::from_secs(3));
    assert!(p.sent("A->B DELETE LINK link=1"), "{:#?}", p.flow(true));
    assert!(!links(&p, Side::A).contains(&3));
}

/// ADD LINK (CONTINUATION) reply from client, no more RKeys, second link of a first
/// contact: no CONFIRM LINK → DELETE LINK to the server; the socket opens only after the
/// server's DELETE LINK request and our reply.
#[test]
fn c7_timeout_client_waits_for_confirm_link_first_contact() {
    let mut p = lossy(2, 2, |e| is_confirm_link(e, 2, false));
    p.connect(T1);
    p.run_for(LONG);
    assert!(p.sent("A->B DELETE LINK link=2"), "{:#?}", p.flow(true));
    assert!(p.sent("B->A DELETE LINK link=2"));
    let rsp = p
        .trace
        .iter()
        .find(|e| e.to_string() == "A->B DELETE LINK link=2 rsp")
        .map(|e| e.at);
    let est =
        p.a.events
            .iter()
            .find(|(_, e)| matches!(e, EndpointEvent::Established { .. }))
            .map(|(t, _)| *t);
    assert!(
        rsp.is_some() && est.is_some() && est >= rsp,
        "{:#?}",
        p.flow(true)
    );
}

/// Same, not first contact: DELETE LINK to the server, new link cleaned up.
#[test]
fn c7_timeout_client_waits_for_confirm_link() {
    let mut p = three_link_pair(|e| is_confirm_link(e, 3, false));
    p.run_for(Duration::from_secs(3));
    assert!(p.sent("A->B DELETE LINK link=3"), "{:#?}", p.flow(true));
    assert!(!links(&p, Side::A).contains(&3));
    assert!(links(&p, Side::A).contains(&1) && links(&p, Side::A).contains(&2));
}

/// ADD LINK CONTINUATION from server: no reply → as an ADD LINK failure.
#[test]
fn c7_timeout_continuation_reply() {
    let mut p = three_link_pair(
        |e| matches!(llc(e), Some(LlcMessage::AddLinkCont(c)) if c.reply && c.link_num == 3),
    );
    p.run_for(Duration::from_secs(3));
    assert!(p.sent("B->A DELETE LINK link=1"), "{:#?}", p.flow(true));
    assert!(!links(&p, Side::B).contains(&3));
}

/// Replace the server's ADD LINK CONTINUATION by one announcing more pairs than it sends.
fn owing_continuation(p: &mut EndpointPair, link: u8) {
    let cont = p.trace.iter().rev().find_map(|e| match llc(e) {
        Some(LlcMessage::AddLinkCont(c)) if !c.reply && c.link_num == link => Some(*c),
        _ => None,
    });
    let mut c = cont.expect("server continuation");
    // Two pairs in this message (the same RMB twice), three announced.
    c.pairs[1] = c.pairs[0];
    c.num_rtokens = 3;
    let via = p.a.link(1).expect("link 1");
    p.inject_llc(Side::A, via, LlcMessage::AddLinkCont(c));
}

/// ADD LINK CONTINUATION reply from client (first contact, server owes more): no more
/// continuation → RST.
#[test]
fn c7_timeout_server_owes_continuation_first_contact() {
    let mut p = lossy(
        2,
        2,
        |e| matches!(llc(e), Some(LlcMessage::AddLinkCont(c)) if !c.reply),
    );
    p.knobs.deliver_tcp_rst = false;
    p.connect(T1);
    p.run();
    p.knobs.drop = Some(Box::new(|_| true));
    owing_continuation(&mut p, 2);
    p.run_for(LONG);
    dump(&p);
    assert_eq!(
        reset(&p, Side::A, T1),
        Some(ResetReason::LlcTimeout("ADD LINK CONTINUATION"))
    );
}

/// Same, not first contact: treated as a failure of the exchange's link (DELETE LINK to the
/// server over another link).
#[test]
fn c7_timeout_server_owes_continuation() {
    // The server's own timer is longer, so that the client's expires first.
    let mut p = three_link_pair_with(
        Duration::from_secs(20),
        |e| matches!(llc(e), Some(LlcMessage::AddLinkCont(c)) if !c.reply && c.link_num == 3),
    );
    p.run();
    p.knobs.drop = Some(Box::new(|e| {
        matches!(&e.what, Traced::Llc(_, LlcMessage::AddLinkCont(_)))
    }));
    owing_continuation(&mut p, 3);
    p.run_for(Duration::from_secs(3));
    assert!(p.sent("A->B DELETE LINK link=1"), "{:#?}", p.flow(true));
}

/// DELETE LINK from client: no DELETE LINK request from the server → the link it went over
/// is unusable too; resend over a surviving link.
#[test]
fn c7_timeout_client_delete_link() {
    let mut p = three_link_pair(|_| false);
    p.run();
    assert_eq!(links(&p, Side::A), [1, 2, 3]);
    p.knobs.drop = Some(Box::new(|e| {
        e.from == Side::B && matches!(llc(e), Some(LlcMessage::DeleteLink(_)))
    }));
    let lgr = lgr_of(&p, Side::A);
    p.act(Side::A, |ep, res, now| {
        ep.request_delete_link(lgr, 3, true, res, now)
    })
    .expect("delete");
    p.run_for(Duration::from_secs(3));
    let flow = p.flow(true);
    let asks: Vec<_> = flow
        .iter()
        .filter(|l| l.starts_with("A->B DELETE LINK link=3"))
        .collect();
    assert!(asks.len() >= 2, "resent over a surviving link: {flow:#?}");
    assert!(
        !links(&p, Side::A).contains(&1),
        "the link it went over is unusable"
    );
}

/// DELETE LINK from server (entire group): QPs are destroyed only once the adapter confirmed
/// delivery (the client gets it), then everything is torn down.
#[test]
fn c7_delete_all_waits_for_delivery() {
    let mut p = EndpointPair::with_devices(1, 1);
    p.connect(T1);
    p.run();
    let lgr = lgr_of(&p, Side::B);
    p.act(Side::B, |ep, _, now| ep.terminate_link_group(lgr, now));
    p.run();
    assert!(p
        .a
        .saw(|e| matches!(e, EndpointEvent::LinkGroupTerminated { .. })));
    assert!(
        p.b.qps.values().all(|q| !q.2),
        "QPs destroyed after delivery"
    );
}

/// DELETE LINK from server (single link): no reply → the link it went over is unusable too;
/// with no link left, connections are reset.
#[test]
fn c7_timeout_server_delete_link() {
    let mut p = lossy(
        2,
        2,
        |e| matches!(llc(e), Some(LlcMessage::DeleteLink(d)) if d.reply),
    );
    p.knobs.drop = None;
    p.connect(T1);
    p.run();
    p.knobs.drop = Some(Box::new(
        |e| matches!(llc(e), Some(LlcMessage::DeleteLink(d)) if d.reply),
    ));
    let lgr = lgr_of(&p, Side::B);
    p.act(Side::B, |ep, res, now| {
        ep.request_delete_link(lgr, 1, true, res, now)
    })
    .expect("delete");
    p.run_for(Duration::from_secs(5));
    assert!(p.b.saw(|e| matches!(
        e,
        EndpointEvent::Conn {
            event: crate::conn::Event::Failed(_),
            ..
        }
    )));
    assert_eq!(p.b.ep.link_groups().count(), 0);
}

/// CONFIRM RKEY (from the client): no reply → the link it went over failed; the exchange is
/// retried on the surviving link and the connection completes (Fig. 13 path).
#[test]
fn c7_timeout_confirm_rkey_from_client() {
    let mut a = config(Side::A, 2);
    a.rmb_pool.rmb_target_bytes = 16 * 1024;
    let mut p = EndpointPair::new(a, config(Side::B, 2), 3);
    p.connect(T1);
    p.run();
    p.knobs.silent_drop = true;
    let mut first = true;
    p.knobs.drop = Some(Box::new(move |e| {
        let hit = matches!(llc(e), Some(LlcMessage::ConfirmRkey(c)) if c.reply) && first;
        if hit {
            first = false;
        }
        hit
    }));
    p.connect(TcpId(2));
    p.run_for(Duration::from_secs(5));
    dump(&p);
    assert!(p.sent("A->B DELETE LINK link=1"), "{:#?}", p.flow(true));
    assert_eq!(
        p.flow(true)
            .iter()
            .filter(|l| l.starts_with("A->B CONFIRM RKEY"))
            .count(),
        2
    );
    assert!(established(&p, Side::A, TcpId(2)) && established(&p, Side::B, TcpId(2)));
}

/// CONFIRM RKEY (from the server): no reply → the link it went over failed.
#[test]
fn c7_timeout_confirm_rkey_from_server() {
    let mut b = config(Side::B, 2);
    b.rmb_pool.rmb_target_bytes = 16 * 1024;
    let mut p = EndpointPair::new(config(Side::A, 2), b, 3);
    p.connect(T1);
    p.run();
    p.knobs.silent_drop = true;
    let mut first = true;
    p.knobs.drop = Some(Box::new(move |e| {
        let hit = matches!(llc(e), Some(LlcMessage::ConfirmRkey(c)) if c.reply) && first;
        if hit {
            first = false;
        }
        hit
    }));
    p.connect(TcpId(2));
    p.run_for(Duration::from_secs(5));
    dump(&p);
    assert!(p.sent("B->A DELETE LINK link=1"), "{:#?}", p.flow(true));
    assert!(established(&p, Side::B, TcpId(2)));
}

/// TEST LINK from the server (keepalive): no reply → link failed → failover.
#[test]
fn c7_timeout_test_link_from_server() {
    let a = config(Side::A, 2);
    let mut b = config(Side::B, 2);
    b.keepalive = Some(Duration::from_secs(5));
    let mut p = EndpointPair::new(a, b, 1);
    p.connect(T1);
    p.run();
    p.knobs.silent_drop = true;
    p.knobs.drop = Some(Box::new(
        |e| matches!(llc(e), Some(LlcMessage::TestLink(t)) if t.reply),
    ));
    p.run_for(Duration::from_secs(8));
    assert!(p.b.saw(|e| matches!(e, EndpointEvent::LinkDown { .. })));
    assert!(p
        .flow(true)
        .iter()
        .any(|l| l.starts_with("B->A DELETE LINK")));
}

/// TEST LINK from the client: no reply → link failed → the client asks the server to
/// delete it (and moves its connections).
#[test]
fn c7_timeout_test_link_from_client() {
    let mut a = config(Side::A, 2);
    a.keepalive = Some(Duration::from_secs(5));
    let mut p = EndpointPair::new(a, config(Side::B, 2), 1);
    p.connect(T1);
    p.run();
    p.knobs.silent_drop = true;
    p.knobs.drop = Some(Box::new(
        |e| matches!(llc(e), Some(LlcMessage::TestLink(t)) if t.reply),
    ));
    p.run_for(Duration::from_secs(8));
    assert!(p.a.saw(|e| matches!(e, EndpointEvent::LinkDown { .. })));
    assert!(p
        .flow(true)
        .iter()
        .any(|l| l.starts_with("A->B DELETE LINK")));
}

// ----- Invalid messages -----------------------------------------------------------------------

/// CONFIRM LINK from server with incorrect link information (first contact): Decline.
#[test]
fn c7_invalid_confirm_link_first_contact() {
    let mut p = lossy(1, 1, |e| is_confirm_link(e, 1, false));
    p.connect(T1);
    p.run();
    let real = p.trace.iter().find_map(|e| match llc(e) {
        Some(LlcMessage::ConfirmLink(c)) => Some(*c),
        _ => None,
    });
    let mut c: ConfirmLink = real.expect("confirm link");
    c.sender_qp = smc_wire::U24::truncate(0x999);
    p.knobs.drop = None;
    let l = p.a.link(1).expect("link");
    p.inject_llc(Side::A, l, LlcMessage::ConfirmLink(c));
    p.run();
    assert_eq!(
        fell_back(&p, Side::A, T1),
        Some(Fallback::Declined(smc_wire::DeclineCode::CNFERR))
    );
}

/// CONFIRM LINK out of any exchange: protocol error, the link is brought down (DELETE LINK
/// over another link).
#[test]
fn c7_invalid_confirm_link_established() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect(T1);
    p.run();
    let l1 = p.a.link(1).expect("link");
    p.inject_llc(Side::A, l1, LlcMessage::ConfirmLink(ConfirmLink::default()));
    p.run();
    assert!(p.sent("A->B DELETE LINK link=1"));
    assert_eq!(links(&p, Side::A), [2]);
}

/// ADD LINK with an undefined MTU: negative reply, reason 2.
#[test]
fn c7_invalid_add_link_mtu() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect(T1);
    p.run();
    let l1 = p.a.link(1).expect("link");
    let m = AddLink {
        link_num: 7,
        mtu: QpMtu(9),
        ..AddLink::default()
    };
    p.inject_llc(Side::A, l1, LlcMessage::AddLink(m));
    p.run();
    assert!(p.sent("A->B ADD LINK link=7 rejected(2) rsp"));
}

/// ADD LINK reply that would make a parallel link: the server deletes the new link.
#[test]
fn c7_invalid_add_link_reply_parallel() {
    let mut p = lossy(
        1,
        1,
        |e| matches!(llc(e), Some(LlcMessage::AddLink(a)) if a.reply),
    );
    p.connect(T1);
    p.run();
    // Forge a positive reply from the client's only RNIC: same RNIC pair as link 1.
    let d = device(Side::A, 0);
    let reply = AddLink {
        reply: true,
        sender_mac: d.mac,
        sender_gid: d.gid,
        sender_qp: smc_wire::U24::truncate(0x777),
        link_num: 2,
        mtu: QpMtu::MTU_1024,
        ..AddLink::default()
    };
    let l1 = p.b.link(1).expect("link");
    p.inject_llc(Side::B, l1, LlcMessage::AddLink(reply));
    p.run();
    assert!(p.sent("B->A DELETE LINK link=2"), "{:#?}", p.flow(true));
    assert_eq!(links(&p, Side::B), [1]);
}

/// A server command on a link the client asked to delete is ignored.
#[test]
fn c7_invalid_command_on_link_being_deleted() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect(T1);
    p.run();
    p.knobs.drop = Some(Box::new(|e| {
        matches!(llc(e), Some(LlcMessage::DeleteLink(_)))
    }));
    p.knobs.silent_drop = true;
    let lgr = lgr_of(&p, Side::A);
    p.act(Side::A, |ep, res, now| {
        ep.request_delete_link(lgr, 2, true, res, now)
    })
    .expect("delete");
    p.run();
    let discarded = p.a.ep.stats().llc_discarded;
    let l2 = p.a.link(2).expect("link 2");
    p.inject_llc(Side::A, l2, LlcMessage::ConfirmRkey(ConfirmRkey::default()));
    assert_eq!(p.a.ep.stats().llc_discarded, discarded + 1);
    assert!(!p.sent("A->B CONFIRM RKEY others=0 rsp"));
}

/// ADD LINK CONTINUATION naming RMBs we do not know (count mismatch): protocol error, the
/// new link is brought down.
#[test]
fn c7_invalid_continuation_count() {
    let mut p = lossy(
        2,
        2,
        |e| matches!(llc(e), Some(LlcMessage::AddLinkCont(c)) if !c.reply),
    );
    p.connect(T1);
    p.run();
    p.knobs.drop = None;
    let mut c = AddLinkCont {
        link_num: 2,
        num_rtokens: 1,
        ..AddLinkCont::default()
    };
    c.pairs[0].reference_rkey = 0xDEAD;
    let l1 = p.a.link(1).expect("link");
    p.inject_llc(Side::A, l1, LlcMessage::AddLinkCont(c));
    p.run();
    assert!(p.sent("A->B DELETE LINK link=2"), "{:#?}", p.flow(true));
    assert!(!links(&p, Side::A).contains(&2));
}

/// DELETE LINK from the client for a link that does not exist: reply with reason 1 (and a
/// link being cleaned up is ignored, see the failover tests).
#[test]
fn c7_invalid_delete_link_from_client() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect(T1);
    p.run();
    let l1 = p.b.link(1).expect("link");
    let d = DeleteLink {
        link_num: 9,
        reason: DeleteLinkReason::LOST_PATH,
        ..DeleteLink::default()
    };
    p.inject_llc(Side::B, l1, LlcMessage::DeleteLink(d));
    p.run();
    let reply = p.trace.iter().find_map(|e| match llc(e) {
        Some(LlcMessage::DeleteLink(d)) if d.reply && e.from == Side::B => Some(*d),
        _ => None,
    });
    assert_eq!(
        reply.map(|d| (d.link_num, d.reason)),
        Some((9, DeleteLinkReason::UNKNOWN_LINK))
    );
}

/// DELETE LINK from the server for a link that does not exist: reply with reason 1.
#[test]
fn c7_invalid_delete_link_from_server() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect(T1);
    p.run();
    let l1 = p.a.link(1).expect("link");
    let d = DeleteLink {
        link_num: 9,
        reason: DeleteLinkReason::LOST_PATH,
        ..DeleteLink::default()
    };
    p.inject_llc(Side::A, l1, LlcMessage::DeleteLink(d));
    p.run();
    let reply = p.trace.iter().find_map(|e| match llc(e) {
        Some(LlcMessage::DeleteLink(d)) if d.reply && e.from == Side::A => Some(*d),
        _ => None,
    });
    assert_eq!(
        reply.map(|d| (d.link_num, d.reason)),
        Some((9, DeleteLinkReason::UNKNOWN_LINK))
    );
    assert_eq!(links(&p, Side::A), [1, 2]);
}

/// CONFIRM RKEY without an RKey for one of the links: that link is treated as failed.
#[test]
fn c7_invalid_confirm_rkey_missing_link() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect(T1);
    p.run();
    let l1 = p.a.link(1).expect("link");
    let m = ConfirmRkey {
        rkey: 0x4242,
        vaddr: 0x1000,
        num_tokens: 0,
        ..ConfirmRkey::default()
    };
    p.inject_llc(Side::A, l1, LlcMessage::ConfirmRkey(m));
    p.run();
    assert!(p.sent("A->B CONFIRM RKEY others=0 rsp"));
    assert_eq!(links(&p, Side::A), [1]);
    assert!(p.sent("A->B DELETE LINK link=2"));
}

/// CONFIRM RKEY naming every link is accepted (the control case of the row above).
#[test]
fn c7_valid_confirm_rkey_all_links() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect(T1);
    p.run();
    let l1 = p.a.link(1).expect("link");
    let mut m = ConfirmRkey {
        rkey: 0x4242,
        vaddr: 0x1000,
        num_tokens: 1,
        ..ConfirmRkey::default()
    };
    m.others[0] = LinkRtoken {
        link_num: 2,
        rkey: 0x4343,
        vaddr: 0x1000,
    };
    p.inject_llc(Side::A, l1, LlcMessage::ConfirmRkey(m));
    p.run();
    assert_eq!(links(&p, Side::A), [1, 2]);
}

/// DELETE RKEY naming an unknown RKey: negative reply with the error mask.
#[test]
fn c7_invalid_delete_rkey_unknown() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect(T1);
    p.run();
    let l1 = p.a.link(1).expect("link");
    let mut d = DeleteRkey {
        count: 1,
        ..DeleteRkey::default()
    };
    d.rkeys[0] = 0xDEAD;
    p.inject_llc(Side::A, l1, LlcMessage::DeleteRkey(d));
    p.run();
    let reply = p.trace.iter().find_map(|e| match llc(e) {
        Some(LlcMessage::DeleteRkey(d)) if d.reply => Some(*d),
        _ => None,
    });
    assert_eq!(
        reply.map(|d| (d.negative, d.error_mask)),
        Some((true, 0x80))
    );
}

/// TEST LINK reply whose user data does not match: the link is treated as down.
#[test]
fn c7_invalid_test_link_reply() {
    let mut a = config(Side::A, 2);
    a.keepalive = Some(Duration::from_secs(5));
    let mut p = EndpointPair::new(a, config(Side::B, 2), 1);
    p.connect(T1);
    p.run();
    p.knobs.silent_drop = true;
    p.knobs.drop = Some(Box::new(
        |e| matches!(llc(e), Some(LlcMessage::TestLink(t)) if t.reply),
    ));
    p.run_for(Duration::from_secs(6));
    assert!(p.sent("A->B TEST LINK"));
    let l1 = p.a.link(1).expect("link");
    let t = TestLink {
        reply: true,
        user_data: [7; 16],
    };
    p.inject_llc(Side::A, l1, LlcMessage::TestLink(t));
    assert_eq!(links(&p, Side::A), [2]);
}

/// Unknown LLC type with high-order bits b'10': silently discarded.
#[test]
fn c7_optional_llc_discarded() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect(T1);
    p.run();
    let l1 = p.a.link(1).expect("link");
    let mut raw = [0u8; 44];
    raw[0] = 0x85;
    raw[1] = 44;
    let now = p.now;
    p.a.ep.handle_message(l1, &raw, &mut p.a.res, now);
    p.run();
    assert_eq!(links(&p, Side::A), [1, 2]);
    assert_eq!(p.a.ep.stats().llc_discarded, 1);
}

/// Any other unknown LLC type: the link is out of sync and treated as down.
#[test]
fn c7_unknown_llc_type_fails_link() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect(T1);
    p.run();
    let l1 = p.a.link(1).expect("link");
    let mut raw = [0u8; 44];
    raw[0] = 0x05;
    raw[1] = 44;
    let now = p.now;
    p.a.ep.handle_message(l1, &raw, &mut p.a.res, now);
    p.run();
    assert_eq!(links(&p, Side::A), [2]);
    assert!(p.sent("A->B DELETE LINK link=1"));
}
