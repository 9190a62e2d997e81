//! Serialization of LLC exchanges and every collision rule of RFC 7609 §3.5.5.3.

use smc_wire::llc::{AddLink, ConfirmRkey, DeleteLink, DeleteLinkReason, TestLink};
use smc_wire::LlcMessage;

use super::*;
use crate::lgr_harness::{config, device};

fn lgr_of(p: &EndpointPair, s: Side) -> crate::fabric::LgrId {
    p.host(s)
        .ep
        .link_groups()
        .next()
        .map(|g| g.id)
        .expect("group")
}

fn pos(p: &EndpointPair, text: &str) -> Option<usize> {
    p.trace.iter().position(|e| e.to_string() == text)
}

fn test_link() -> LlcMessage {
    LlcMessage::TestLink(TestLink {
        reply: false,
        user_data: [0x5A; 16],
    })
}

fn client_add_link() -> LlcMessage {
    let d = device(Side::A, 3);
    LlcMessage::AddLink(AddLink {
        sender_mac: d.mac,
        sender_gid: d.gid,
        mtu: d.mtu,
        ..AddLink::default()
    })
}

fn client_delete(link: u8) -> LlcMessage {
    LlcMessage::DeleteLink(DeleteLink {
        link_num: link,
        reason: DeleteLinkReason::OPERATOR_INITIATED,
        orderly: true,
        ..DeleteLink::default()
    })
}

fn delete_all() -> LlcMessage {
    LlcMessage::DeleteLink(DeleteLink {
        all: true,
        reason: DeleteLinkReason::OPERATOR_INITIATED,
        ..DeleteLink::default()
    })
}

fn client_rkey() -> LlcMessage {
    LlcMessage::ConfirmRkey(ConfirmRkey {
        rkey: 0x7777,
        vaddr: 0x1000,
        ..ConfirmRkey::default()
    })
}

/// One link (single RNICs), then the server gets a second RNIC and starts an ADD LINK
/// exchange over link 1 (not yet delivered).
fn during_add_link() -> EndpointPair {
    let mut p = EndpointPair::with_devices(1, 1);
    p.connect(T1);
    p.run();
    p.act(Side::B, |ep, res, now| {
        ep.add_device(device(Side::B, 1), res, now)
    });
    assert!(p.sent("B->A ADD LINK link=3"));
    p
}

/// Two links; the server deletes link 2 (DELETE LINK exchange in progress).
fn during_delete_link() -> EndpointPair {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect(T1);
    p.run();
    let lgr = lgr_of(&p, Side::B);
    p.act(Side::B, |ep, res, now| {
        ep.request_delete_link(lgr, 2, true, res, now)
    })
    .expect("delete");
    assert!(p.sent("B->A DELETE LINK link=2"));
    p
}

/// The server adds an RMB (single-element RMBs) for a second connection: its CONFIRM RKEY
/// exchange is in progress.
fn during_server_rkey(devs: u8) -> EndpointPair {
    let mut b = config(Side::B, devs);
    b.rmb_pool.rmb_target_bytes = 16 * 1024;
    let mut p = EndpointPair::new(config(Side::A, devs), b, 2);
    p.connect(T1);
    p.run();
    p.connect(TcpId(2));
    assert!(p.run_until(|p| p
        .trace
        .iter()
        .any(|e| e.to_string().starts_with("B->A CONFIRM RKEY"))));
    p
}

fn inject_b(p: &mut EndpointPair, m: LlcMessage) {
    let l1 = p.b.link(1).expect("link 1");
    p.inject_llc(Side::B, l1, m);
}

// ----- §3.5.5.3.1 Collisions with ADD LINK / CONFIRM LINK exchange ---------------------------

#[test]
fn add_link_exchange_test_link_answered_at_once() {
    let mut p = during_add_link();
    inject_b(&mut p, test_link());
    assert!(
        p.sent("B->A TEST LINK rsp"),
        "answered before the exchange ends"
    );
    p.run();
    assert!(p.sent("A->B CONFIRM LINK link=3 rsp"));
}

#[test]
fn add_link_exchange_client_add_link_ignored() {
    let mut p = during_add_link();
    inject_b(&mut p, client_add_link());
    p.run();
    let adds = p
        .flow(true)
        .iter()
        .filter(|l| l.starts_with("B->A ADD LINK link="))
        .count();
    assert_eq!(
        adds,
        2,
        "first-contact attempt and this one only: {:#?}",
        p.flow(true)
    );
    assert!(p.sent("A->B CONFIRM LINK link=3 rsp"));
}

#[test]
fn add_link_exchange_client_delete_link_queued() {
    let mut p = during_add_link();
    inject_b(&mut p, client_delete(1));
    assert!(!p.sent("B->A DELETE LINK link=1"));
    p.run();
    let done = pos(&p, "A->B CONFIRM LINK link=3 rsp").expect("exchange completes");
    let del = pos(&p, "B->A DELETE LINK link=1").expect("queued delete processed");
    assert!(del > done);
    assert!(p.sent("A->B DELETE LINK link=1 rsp"));
    p.app_send(Side::A, T1, b"on link 3");
    p.run();
    assert_eq!(p.b.rx[&T1], b"on link 3");
}

#[test]
fn add_link_exchange_delete_all_cleans_up_at_once() {
    let mut p = during_add_link();
    inject_b(&mut p, delete_all());
    assert_eq!(p.b.ep.link_groups().count(), 0);
}

#[test]
fn add_link_exchange_client_confirm_rkey_refused() {
    let mut p = during_add_link();
    inject_b(&mut p, client_rkey());
    assert!(p.sent("B->A CONFIRM RKEY negative rsp"));
    assert_eq!(p.b.ep.stats().rkey_collisions, 1);
}

// ----- §3.5.5.3.2 Collisions during DELETE LINK exchange --------------------------------------

#[test]
fn delete_link_exchange_test_link_answered_at_once() {
    let mut p = during_delete_link();
    inject_b(&mut p, test_link());
    assert!(p.sent("B->A TEST LINK rsp"));
}

#[test]
fn delete_link_exchange_client_add_link_queued() {
    let mut p = during_delete_link();
    inject_b(&mut p, client_add_link());
    p.run();
    let done = pos(&p, "A->B DELETE LINK link=2 rsp").expect("exchange completes");
    let add = pos(&p, "B->A ADD LINK link=3").expect("queued ADD LINK processed");
    assert!(add > done);
}

#[test]
fn delete_link_exchange_client_delete_link_queued() {
    let mut p = during_delete_link();
    inject_b(&mut p, client_delete(1));
    p.run();
    let done = pos(&p, "A->B DELETE LINK link=2 rsp").expect("exchange completes");
    // Link 1 is the last one: deleting it ends the group.
    let del = pos(&p, "B->A DELETE LINK all").expect("queued delete processed");
    assert!(del > done);
}

#[test]
fn delete_link_exchange_delete_all_cleans_up_at_once() {
    let mut p = during_delete_link();
    inject_b(&mut p, delete_all());
    assert_eq!(p.b.ep.link_groups().count(), 0);
}

#[test]
fn delete_link_exchange_client_confirm_rkey_refused() {
    let mut p = during_delete_link();
    inject_b(&mut p, client_rkey());
    assert!(p.sent("B->A CONFIRM RKEY negative rsp"));
}

// ----- §3.5.5.3.3 Collisions during CONFIRM RKEY exchange -------------------------------------

#[test]
fn rkey_exchange_test_link_answered_at_once() {
    let mut p = during_server_rkey(2);
    inject_b(&mut p, test_link());
    assert!(p.sent("B->A TEST LINK rsp"));
    p.run();
    assert!(established(&p, Side::B, TcpId(2)));
}

#[test]
fn rkey_exchange_client_add_link_queued() {
    let mut p = during_server_rkey(1);
    inject_b(&mut p, client_add_link());
    assert!(!p
        .flow(true)
        .iter()
        .any(|l| l.starts_with("B->A ADD LINK link=3")));
    p.run();
    let done = pos(&p, "A->B CONFIRM RKEY others=0 rsp").expect("exchange completes");
    let add = pos(&p, "B->A ADD LINK link=3").expect("queued ADD LINK processed");
    assert!(add > done);
}

#[test]
fn rkey_exchange_client_delete_link_queued() {
    let mut p = during_server_rkey(2);
    inject_b(&mut p, client_delete(2));
    assert!(!p.sent("B->A DELETE LINK link=2"));
    p.run();
    let done = pos(&p, "A->B CONFIRM RKEY others=1 rsp").expect("exchange completes");
    let del = pos(&p, "B->A DELETE LINK link=2").expect("queued delete processed");
    assert!(del > done);
    assert!(established(&p, Side::A, TcpId(2)));
}

#[test]
fn rkey_exchange_delete_all_cleans_up_at_once() {
    let mut p = during_server_rkey(2);
    inject_b(&mut p, delete_all());
    assert_eq!(p.b.ep.link_groups().count(), 0);
}

/// The client's CONFIRM RKEY crosses the server's ADD LINK: the client processes the ADD
/// LINK, the server refuses the CONFIRM RKEY, the client redoes it (now with the new link's
/// RToken) after the ADD LINK exchange, and the connection completes.
#[test]
fn rkey_exchange_crosses_server_add_link() {
    let mut a = config(Side::A, 1);
    a.rmb_pool.rmb_target_bytes = 16 * 1024;
    let mut p = EndpointPair::new(a, config(Side::B, 1), 4);
    p.connect(T1);
    p.run();
    p.connect(TcpId(2));
    assert!(p.run_until(|p| p.sent("A->B CONFIRM RKEY others=0")));
    p.act(Side::B, |ep, res, now| {
        ep.add_device(device(Side::B, 1), res, now)
    });
    p.run();
    let neg = pos(&p, "B->A CONFIRM RKEY negative rsp").expect("refused");
    let added = pos(&p, "A->B CONFIRM LINK link=3 rsp").expect("ADD LINK processed");
    let redo = pos(&p, "A->B CONFIRM RKEY others=1").expect("redone with the new link");
    assert!(neg < redo && added < redo, "{:#?}", p.flow(true));
    assert!(established(&p, Side::A, TcpId(2)) && established(&p, Side::B, TcpId(2)));
    p.app_send(Side::B, TcpId(2), b"ok");
    p.run();
    assert_eq!(p.a.rx[&TcpId(2)], b"ok");
}

/// The client's CONFIRM RKEY crosses the server's DELETE LINK: the client processes the
/// DELETE LINK, the server refuses the CONFIRM RKEY, the client redoes it without the
/// deleted link.
#[test]
fn rkey_exchange_crosses_server_delete_link() {
    let mut a = config(Side::A, 2);
    a.rmb_pool.rmb_target_bytes = 16 * 1024;
    let mut p = EndpointPair::new(a, config(Side::B, 2), 4);
    p.connect(T1);
    p.run();
    p.connect(TcpId(2));
    assert!(p.run_until(|p| p.sent("A->B CONFIRM RKEY others=1")));
    let lgr = lgr_of(&p, Side::B);
    p.act(Side::B, |ep, res, now| {
        ep.request_delete_link(lgr, 2, true, res, now)
    })
    .expect("delete");
    p.run();
    assert!(
        p.sent("B->A CONFIRM RKEY negative rsp"),
        "{:#?}",
        p.flow(true)
    );
    assert!(p.sent("A->B DELETE LINK link=2 rsp"));
    let redo = pos(&p, "A->B CONFIRM RKEY others=0").expect("redone without link 2");
    let neg = pos(&p, "B->A CONFIRM RKEY negative rsp").expect("refused");
    assert!(neg < redo);
    assert!(established(&p, Side::A, TcpId(2)) && established(&p, Side::B, TcpId(2)));
}

/// Concurrent CONFIRM RKEYs from both peers are not a collision: both are answered.
#[test]
fn concurrent_confirm_rkeys_both_processed() {
    let mut a = config(Side::A, 2);
    a.rmb_pool.rmb_target_bytes = 16 * 1024;
    let mut b = config(Side::B, 2);
    b.rmb_pool.rmb_target_bytes = 16 * 1024;
    let mut p = EndpointPair::new(a, b, 4);
    p.connect(T1);
    p.run();
    p.connect(TcpId(2));
    assert!(p.run_until(|p| p.sent("B->A CONFIRM RKEY others=1")));
    // The client's own RMB for another connection (server side already busy with its own).
    p.act(Side::B, |ep, _, now| ep.accept(TcpId(3), now))
        .expect("accept");
    p.act(Side::A, |ep, _, now| ep.connect(TcpId(3), now))
        .expect("connect");
    p.run();
    assert!(!p.sent("B->A CONFIRM RKEY negative rsp"));
    assert!(!p.sent("A->B CONFIRM RKEY negative rsp"));
    for t in [TcpId(2), TcpId(3)] {
        assert!(established(&p, Side::A, t) && established(&p, Side::B, t));
    }
}

/// A CONFIRM LINK from the peer while our CONFIRM RKEY exchange runs is queued and processed
/// after it (here it is out of sync, so processing it brings the link down).
#[test]
fn rkey_exchange_confirm_link_queued() {
    let mut p = during_server_rkey(2);
    let d = device(Side::A, 0);
    let c = smc_wire::llc::ConfirmLink {
        sender_mac: d.mac,
        sender_gid: d.gid,
        link_num: 1,
        no_rmbe_eyecatcher: true,
        ..Default::default()
    };
    inject_b(&mut p, LlcMessage::ConfirmLink(c));
    assert!(!p
        .flow(true)
        .iter()
        .any(|l| l.starts_with("B->A DELETE LINK")));
    p.run();
    let done = pos(&p, "A->B CONFIRM RKEY others=1 rsp").expect("exchange completes");
    let del = pos(&p, "B->A DELETE LINK link=1").expect("queued CONFIRM LINK processed");
    assert!(del > done);
}
