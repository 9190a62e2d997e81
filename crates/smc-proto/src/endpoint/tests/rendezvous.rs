//! CLC rendezvous: first contact (Fig. 8, Fig. 9), subsequent contact, Decline and fallback
//! (App. C.1–C.6, Fig. 42).

use super::*;

#[test]
fn fig8_fig9_first_contact_with_second_link() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect(T1);
    p.run();
    dump(&p);
    assert_eq!(
        p.flow(true),
        vec![
            "A->B SMC Proposal",
            "B->A SMC Accept(first contact)",
            "A->B SMC Confirm",
            "B->A CONFIRM LINK link=1",
            "A->B CONFIRM LINK link=1 rsp",
            "B->A ADD LINK link=2",
            "A->B ADD LINK link=2 rsp",
            "B->A ADD LINK CONTINUATION link=2 pairs=1",
            "A->B ADD LINK CONTINUATION link=2 pairs=1 rsp",
            "B->A CONFIRM LINK link=2",
            "A->B CONFIRM LINK link=2 rsp",
        ]
    );
    assert!(established(&p, Side::A, T1));
    assert!(established(&p, Side::B, T1));
    for s in [Side::A, Side::B] {
        let g = p.host(s).ep.link_groups().next().expect("group");
        assert_eq!(g.active_count(), 2);
    }
}

/// Data flows both ways, byte-exact, once established.
#[test]
fn data_both_ways_after_first_contact() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect(T1);
    p.run();
    let a: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let b: Vec<u8> = (0..70_000u32).map(|i| (i % 241) as u8).collect();
    p.app_send(Side::A, T1, &a);
    p.app_send(Side::B, T1, &b);
    p.run();
    assert_eq!(p.b.rx.get(&T1).map(Vec::len), Some(a.len()));
    assert_eq!(p.b.rx[&T1], a);
    assert_eq!(p.a.rx[&T1], b);
}

/// A single RNIC on each side: the server's ADD LINK is rejected (no alternate path) and the
/// group continues with one link; the C.8 retry timer is armed.
#[test]
fn single_rnic_each_side_second_link_rejected() {
    let mut p = EndpointPair::with_devices(1, 1);
    p.connect(T1);
    p.run();
    assert_eq!(
        p.flow(true)[5..],
        [
            "B->A ADD LINK link=2",
            "A->B ADD LINK link=2 rejected(1) rsp",
        ]
    );
    assert!(established(&p, Side::A, T1) && established(&p, Side::B, T1));
    let g = p.b.ep.link_groups().next().expect("group");
    assert_eq!(g.active_count(), 1);
    assert!(g.timers.is_set(crate::link_group::LgrTimer::AddLinkRetry));
}

/// Client with two RNICs, server with one: the second link is asymmetric (Fig. 6).
#[test]
fn asymmetric_second_link_when_server_has_one_rnic() {
    let mut p = EndpointPair::with_devices(2, 1);
    p.connect(T1);
    p.run();
    let g = p.b.ep.link_groups().next().expect("group");
    assert_eq!(g.active_count(), 2);
    assert!(g.links.get(&2).is_some_and(|l| l.asymmetric));
    let ga = p.a.ep.link_groups().next().expect("group");
    assert!(ga.links.get(&2).is_some_and(|l| l.asymmetric));
    // At most one asymmetric link: a retry does not add another.
    p.run_for(std::time::Duration::from_secs(60));
    let g = p.b.ep.link_groups().next().expect("group");
    assert_eq!(g.links.len(), 2);
}

/// Server with two RNICs, client with one: asymmetric the other way.
#[test]
fn asymmetric_second_link_when_client_has_one_rnic() {
    let mut p = EndpointPair::with_devices(1, 2);
    p.connect(T1);
    p.run();
    let g = p.b.ep.link_groups().next().expect("group");
    assert_eq!(g.active_count(), 2);
    assert!(g.links.get(&2).is_some_and(|l| l.asymmetric));
}

/// Subsequent contact: the existing link group is reused; only the three CLC messages flow
/// (§3.5.2.2), and data flows on both connections.
#[test]
fn subsequent_contact_reuses_link_group() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect(T1);
    p.run();
    let before = p.trace.len();
    p.connect(TcpId(2));
    p.run();
    let flow: Vec<String> = p.trace[before..]
        .iter()
        .filter(|e| {
            matches!(
                e.what,
                crate::lgr_harness::Traced::Clc(..) | crate::lgr_harness::Traced::Llc(..)
            )
        })
        .map(|e| e.to_string())
        .collect();
    assert_eq!(
        flow,
        ["A->B SMC Proposal", "B->A SMC Accept", "A->B SMC Confirm"]
    );
    assert!(established(&p, Side::A, TcpId(2)) && established(&p, Side::B, TcpId(2)));
    assert_eq!(p.a.ep.link_groups().count(), 1);
    assert_eq!(p.b.ep.link_groups().count(), 1);
    // The two connections use different links on the server (spread, §2.3).
    let l1 = p.b.ep.connection_link(T1).map(|x| x.1);
    let l2 = p.b.ep.connection_link(TcpId(2)).map(|x| x.1);
    assert_ne!(l1, l2);
    p.app_send(Side::A, TcpId(2), b"second");
    p.app_send(Side::B, T1, b"first");
    p.run();
    assert_eq!(p.b.rx[&TcpId(2)], b"second");
    assert_eq!(p.a.rx[&T1], b"first");
}

/// Fig. 13: the client needs a new RMB on a subsequent contact: CONFIRM RKEY before Confirm.
#[test]
fn fig13_client_adds_rmb_during_setup() {
    let mut a = crate::lgr_harness::config(Side::A, 2);
    a.rmb_pool.rmb_target_bytes = 16 * 1024;
    let b = crate::lgr_harness::config(Side::B, 2);
    let mut p = EndpointPair::new(a, b, 7);
    p.connect(T1);
    p.run();
    let before = p.trace.len();
    p.connect(TcpId(2));
    p.run();
    let flow: Vec<String> = p.trace[before..].iter().map(|e| e.to_string()).collect();
    assert_eq!(
        flow,
        [
            "A->B SMC Proposal",
            "B->A SMC Accept",
            "A->B CONFIRM RKEY others=1",
            "B->A CONFIRM RKEY others=1 rsp",
            "A->B SMC Confirm",
        ]
    );
    assert!(established(&p, Side::B, TcpId(2)));
    p.app_send(Side::B, TcpId(2), b"into the new RMB");
    p.run();
    assert_eq!(p.a.rx[&TcpId(2)], b"into the new RMB");
}

/// Fig. 12: the server adds an RMB to the existing group (before its Accept).
#[test]
fn fig12_server_adds_rmb() {
    let a = crate::lgr_harness::config(Side::A, 2);
    let mut b = crate::lgr_harness::config(Side::B, 2);
    b.rmb_pool.rmb_target_bytes = 16 * 1024;
    let mut p = EndpointPair::new(a, b, 7);
    p.connect(T1);
    p.run();
    let before = p.trace.len();
    p.connect(TcpId(2));
    p.run();
    let flow: Vec<String> = p.trace[before..].iter().map(|e| e.to_string()).collect();
    assert_eq!(
        flow,
        [
            "A->B SMC Proposal",
            "B->A CONFIRM RKEY others=1",
            "A->B CONFIRM RKEY others=1 rsp",
            "B->A SMC Accept",
            "A->B SMC Confirm",
        ]
    );
    p.app_send(Side::A, TcpId(2), b"into the server's new RMB");
    p.run();
    assert_eq!(p.b.rx[&TcpId(2)], b"into the server's new RMB");
}

/// A new RMB that cannot be registered: the connection that needed it is declined
/// ("insufficient memory resources") and falls back; the half-made RMB is never handed out
/// again (the next connection gets a new one, registered, not an element without an rkey)
/// and nothing of it stays registered.
#[test]
fn rmb_registration_failure_declines_and_the_next_connection_gets_a_new_rmb() {
    let a = crate::lgr_harness::config(Side::A, 2);
    let mut b = crate::lgr_harness::config(Side::B, 2);
    // One element per RMB: every connection needs a new RMB.
    b.rmb_pool.rmb_target_bytes = 16 * 1024;
    let mut p = EndpointPair::new(a, b, 7);
    p.connect(T1);
    p.run();
    assert!(established(&p, Side::B, T1));
    let lgr = p.b.ep.link_groups().next().map(|g| g.id).expect("group");
    let rmbs = |p: &EndpointPair| p.b.res.memory.keys().filter(|k| k.0 == lgr).count();
    let before = rmbs(&p);
    // Registered on link 1, not on link 2.
    p.b.res.fail_register_rmb = Some(1);
    p.connect(TcpId(2));
    p.run();
    assert_eq!(
        fell_back(&p, Side::B, TcpId(2)),
        Some(Fallback::Declined(smc_wire::DeclineCode::MEM))
    );
    assert_eq!(
        fell_back(&p, Side::A, TcpId(2)),
        Some(Fallback::PeerDeclined {
            code: smc_wire::DeclineCode::MEM,
            out_of_sync: false
        })
    );
    assert_eq!(rmbs(&p), before, "nothing of the failed RMB stays");
    p.connect(TcpId(3));
    p.run();
    dump(&p);
    assert_eq!(reset(&p, Side::B, TcpId(3)), None);
    assert!(established(&p, Side::A, TcpId(3)));
    assert!(established(&p, Side::B, TcpId(3)));
    assert_eq!(rmbs(&p), before + 1);
    p.app_send(Side::A, TcpId(3), b"into a registered RMB");
    p.run();
    assert_eq!(p.b.rx[&TcpId(3)], b"into a registered RMB");
}

/// Issue #22/#20: the peer adds an RMB for a second connection and this side cannot take it
/// in (`take_peer_rtoken` fails: on shm, no descriptor to map it). A negative CONFIRM RKEY
/// reply; the peer declines that connection only ("reg rdma bufs failed", as Linux when its
/// CONFIRM RKEY fails); the link group, its links and the first connection go on, and the
/// next connection confirms the same RMB again (the RFC's "next natural stimulus").
fn refused_peer_rmb(refuser: Side) {
    let mut a = crate::lgr_harness::config(Side::A, 2);
    let mut b = crate::lgr_harness::config(Side::B, 2);
    // One element per RMB: every connection brings a new RMB on both sides.
    a.rmb_pool.rmb_target_bytes = 16 * 1024;
    b.rmb_pool.rmb_target_bytes = 16 * 1024;
    let mut p = EndpointPair::new(a, b, 11);
    p.connect(T1);
    p.run();
    assert!(established(&p, Side::A, T1) && established(&p, Side::B, T1));
    let (adder, dir) = match refuser {
        Side::A => (Side::B, "A->B"),
        Side::B => (Side::A, "B->A"),
    };
    p.host_mut(refuser).res.fail_take_peer_rtoken = 1;
    p.connect(TcpId(2));
    p.run();
    dump(&p);
    assert!(p.sent(&format!("{dir} CONFIRM RKEY negative rsp")));
    assert_eq!(p.host(refuser).ep.stats().rkeys_refused, 1);
    let code = smc_wire::DeclineCode::ERR_REGBUF;
    assert_eq!(
        fell_back(&p, adder, TcpId(2)),
        Some(Fallback::Declined(code))
    );
    assert_eq!(
        fell_back(&p, refuser, TcpId(2)),
        Some(Fallback::PeerDeclined {
            code,
            out_of_sync: false
        })
    );
    for side in [Side::A, Side::B] {
        let g = p.host(side).ep.link_groups().next().expect("group");
        assert_eq!(g.links.len(), 2, "{side:?}: both links stay");
        assert_eq!(p.host(side).ep.stats().link_failures, 0);
    }
    p.app_send(Side::A, T1, b"still here");
    p.app_send(Side::B, T1, b"and back");
    p.run();
    assert_eq!(p.b.rx[&T1], b"still here");
    assert_eq!(p.a.rx[&T1], b"and back");
    p.connect(TcpId(3));
    p.run();
    assert!(established(&p, Side::A, TcpId(3)) && established(&p, Side::B, TcpId(3)));
    p.app_send(Side::A, TcpId(3), b"third");
    p.app_send(Side::B, TcpId(3), b"third back");
    p.run();
    assert_eq!(p.b.rx[&TcpId(3)], b"third");
    assert_eq!(p.a.rx[&TcpId(3)], b"third back");
}

/// The first contact's second link, on which a side cannot take in the peer's RMB (named
/// in ADD LINK CONTINUATION), fails alone before it carries anything; the group runs on its
/// first link.
fn new_link_refusing_peer_rmb(refuser: Side) {
    let mut p = EndpointPair::new(
        crate::lgr_harness::config(Side::A, 2),
        crate::lgr_harness::config(Side::B, 2),
        13,
    );
    // Each side's first link takes in the peer's RMB (its first call), the second link
    // cannot.
    p.host_mut(refuser).res.pass_take_peer_rtoken = 1;
    p.host_mut(refuser).res.fail_take_peer_rtoken = 1;
    p.connect(T1);
    p.run();
    dump(&p);
    assert!(established(&p, Side::A, T1) && established(&p, Side::B, T1));
    assert_eq!(p.host(refuser).ep.stats().rkeys_refused, 1);
    p.app_send(Side::A, T1, b"over one link");
    p.app_send(Side::B, T1, b"and back");
    p.run();
    assert_eq!(p.b.rx[&T1], b"over one link");
    assert_eq!(p.a.rx[&T1], b"and back");
    // The server that gave the link up tries again (C.8) and, with the resource back, the
    // group gets its second link; a link the client gave up (its DELETE LINK) is not retried.
    p.run_for(std::time::Duration::from_secs(30));
    let links = if refuser == Side::B { 2 } else { 1 };
    for side in [Side::A, Side::B] {
        let g = p.host(side).ep.link_groups().next().expect("group");
        assert_eq!(g.active_links().count(), links, "{side:?}");
    }
    p.app_send(Side::A, T1, b"later");
    p.run();
    assert_eq!(p.b.rx[&T1], b"over one linklater");
}

/// A first contact whose client cannot take in the server's RMB named in the Accept (on
/// shm, no descriptor to map it): declined when the server's CONFIRM LINK arrives, before
/// the link carries anything ("rtoken handling failed"); or whose server cannot take in the
/// client's RMB named in the Confirm: declined once its QP is connected, in lieu of its
/// CONFIRM LINK (`link_connected`). Both sides fall back to TCP, no group is left half
/// made; the next connection, with the resource back, is SMC-R.
fn first_link_refusing_peer_rmb(refuser: Side) {
    let mut p = EndpointPair::new(
        crate::lgr_harness::config(Side::A, 2),
        crate::lgr_harness::config(Side::B, 2),
        17,
    );
    p.host_mut(refuser).res.fail_take_peer_rtoken = 1;
    p.connect(T1);
    p.run();
    dump(&p);
    let code = smc_wire::DeclineCode::ERR_RTOK;
    let other = match refuser {
        Side::A => Side::B,
        Side::B => Side::A,
    };
    assert_eq!(fell_back(&p, refuser, T1), Some(Fallback::Declined(code)));
    assert_eq!(
        fell_back(&p, other, T1),
        Some(Fallback::PeerDeclined {
            code,
            out_of_sync: false
        })
    );
    assert_eq!(p.host(refuser).ep.stats().rkeys_refused, 1);
    p.run_for(std::time::Duration::from_secs(5));
    for side in [Side::A, Side::B] {
        assert_eq!(p.host(side).ep.link_groups().count(), 0, "{side:?}");
    }
    p.connect(TcpId(2));
    p.run();
    assert!(established(&p, Side::A, TcpId(2)) && established(&p, Side::B, TcpId(2)));
    p.app_send(Side::A, TcpId(2), b"second");
    p.run();
    assert_eq!(p.b.rx[&TcpId(2)], b"second");
}

#[test]
fn client_first_link_without_the_peers_rmb_declines() {
    first_link_refusing_peer_rmb(Side::A);
}

#[test]
fn server_first_link_without_the_peers_rmb_declines() {
    first_link_refusing_peer_rmb(Side::B);
}

#[test]
fn client_new_link_without_the_peers_rmb_fails_alone() {
    new_link_refusing_peer_rmb(Side::A);
}

#[test]
fn server_new_link_without_the_peers_rmb_fails_alone() {
    new_link_refusing_peer_rmb(Side::B);
}

#[test]
fn client_refusing_the_servers_new_rmb_ends_only_that_connection() {
    refused_peer_rmb(Side::A);
}

#[test]
fn server_refusing_the_clients_new_rmb_ends_only_that_connection() {
    refused_peer_rmb(Side::B);
}

/// Fig. 14: an RMB no connection uses is deleted with DELETE RKEY.
#[test]
fn fig14_delete_rmb() {
    let mut a = crate::lgr_harness::config(Side::A, 2);
    a.rmb_pool.rmb_target_bytes = 16 * 1024;
    let b = crate::lgr_harness::config(Side::B, 2);
    let mut p = EndpointPair::new(a, b, 7);
    p.connect(T1);
    p.run();
    p.connect(TcpId(2));
    p.run();
    p.act(Side::A, |ep, _, now| ep.close(TcpId(2), now))
        .expect("close");
    p.act(Side::B, |ep, _, now| ep.close(TcpId(2), now))
        .expect("close");
    p.run();
    assert!(p.a.ep.connection(TcpId(2)).is_none());
    let before = p.trace.len();
    let lgr = p.a.ep.link_groups().next().map(|g| g.id).expect("group");
    let n = p.act(Side::A, |ep, res, now| ep.delete_unused_rmbs(lgr, res, now));
    assert_eq!(n, 1);
    p.run();
    let flow: Vec<String> = p.trace[before..].iter().map(|e| e.to_string()).collect();
    assert_eq!(
        flow,
        ["A->B DELETE RKEY count=1", "B->A DELETE RKEY count=1 rsp"]
    );
    assert_eq!(p.a.ep.link_group(lgr).map(|g| g.local_rmbs.len()), Some(1));
    let gb = p.b.ep.link_groups().next().expect("group");
    assert_eq!(
        gb.peer_rmbs.iter().filter(|r| !r.tokens.is_empty()).count(),
        1
    );
    // T1 still works.
    p.app_send(Side::B, T1, b"still here");
    p.run();
    assert_eq!(p.a.rx[&T1], b"still here");
}

/// Fig. 15: a link is added to a group with several RMBs on each side (3 on the server, 4 on
/// the client): the RToken pairs travel in ADD LINK CONTINUATIONs, two per message.
#[test]
fn fig15_rtoken_pairs_when_link_added() {
    let mut a = crate::lgr_harness::config(Side::A, 1);
    a.rmb_pool.rmb_target_bytes = 16 * 1024;
    let mut b = crate::lgr_harness::config(Side::B, 1);
    b.rmb_pool.rmb_target_bytes = 16 * 1024;
    let mut p = EndpointPair::new(a, b, 9);
    for t in 1..=4 {
        p.connect(TcpId(t));
        p.run();
    }
    // Free one server RMB: the server has 3 RMBs in use, the client 4.
    p.act(Side::A, |ep, _, now| ep.close(TcpId(4), now))
        .expect("close");
    p.act(Side::B, |ep, _, now| ep.close(TcpId(4), now))
        .expect("close");
    p.run();
    let lgr = p.b.ep.link_groups().next().map(|g| g.id).expect("group");
    p.act(Side::B, |ep, res, now| ep.delete_unused_rmbs(lgr, res, now));
    p.run();
    assert_eq!(p.b.ep.link_group(lgr).map(|g| g.local_rmbs.len()), Some(3));
    assert_eq!(
        p.a.ep.link_groups().next().map(|g| g.local_rmbs.len()),
        Some(4)
    );
    let before = p.trace.len();
    // The client gets a second RNIC and tells the server (ADD LINK request, an "FYI"); the
    // server, with one RNIC, adds an (asymmetric) link and exchanges RToken pairs.
    p.act(Side::A, |ep, res, now| {
        ep.add_device(crate::lgr_harness::device(Side::A, 1), res, now)
    });
    p.run();
    let flow: Vec<String> = p.trace[before..].iter().map(|e| e.to_string()).collect();
    assert_eq!(
        flow,
        [
            "A->B ADD LINK link=0",
            // Link number 2 went to the rejected first attempt: not reused (§2.2.2).
            "B->A ADD LINK link=3",
            "A->B ADD LINK link=3 rsp",
            "B->A ADD LINK CONTINUATION link=3 pairs=2",
            "A->B ADD LINK CONTINUATION link=3 pairs=2 rsp",
            "B->A ADD LINK CONTINUATION link=3 pairs=1",
            "A->B ADD LINK CONTINUATION link=3 pairs=2 rsp",
            "B->A CONFIRM LINK link=3",
            "A->B CONFIRM LINK link=3 rsp",
        ]
    );
    for s in [Side::A, Side::B] {
        let g = p.host(s).ep.link_groups().next().expect("group");
        assert_eq!(g.active_count(), 2);
        assert!(g
            .peer_rmbs
            .iter()
            .filter(|r| !r.tokens.is_empty())
            .all(|r| r.tokens.contains_key(&3)));
        assert!(g.local_rmbs.values().all(|r| r.tokens.contains_key(&3)));
    }
    // A new server RNIC: the server tries again, the client has no RNIC left and one
    // asymmetric link already: rejected (no parallel link, one asymmetric at most).
    let before = p.trace.len();
    p.act(Side::B, |ep, res, now| {
        ep.add_device(crate::lgr_harness::device(Side::B, 1), res, now)
    });
    p.run();
    let flow: Vec<String> = p.trace[before..].iter().map(|e| e.to_string()).collect();
    assert_eq!(
        flow,
        [
            "B->A ADD LINK link=4",
            "A->B ADD LINK link=4 rejected(1) rsp"
        ]
    );
}

/// Maximum links: each side announces its own in CONFIRM LINK; the group uses the smaller,
/// within 2..=8 (§2.2.2); a client's 0 accepts the server's.
#[test]
fn max_links_negotiated() {
    use crate::endpoint::clc::negotiated_max_links;
    assert_eq!(negotiated_max_links(8, 3), 3);
    assert_eq!(negotiated_max_links(3, 8), 3);
    assert_eq!(negotiated_max_links(4, 0), 4);
    assert_eq!(negotiated_max_links(8, 1), 2);
    assert_eq!(negotiated_max_links(9, 9), 8);
    let mut a = crate::lgr_harness::config(Side::A, 4);
    a.max_links = 3;
    let mut b = crate::lgr_harness::config(Side::B, 4);
    b.max_links = 4;
    let mut p = EndpointPair::new(a, b, 1);
    p.connect(T1);
    p.run();
    for s in [Side::A, Side::B] {
        let g = p.host(s).ep.link_groups().next().expect("group");
        assert_eq!(g.max_links, 3);
        // The server keeps adding links while it has a free RNIC, up to the maximum.
        assert_eq!(g.active_count(), 3);
    }
}

/// Four links: a new RMB's RTokens do not fit in one CONFIRM RKEY (this link + 2 others):
/// the third other link's token follows in a CONFIRM RKEY CONTINUATION.
#[test]
fn confirm_rkey_continuation_with_four_links() {
    let mut a = crate::lgr_harness::config(Side::A, 4);
    a.max_links = 4;
    a.rmb_pool.rmb_target_bytes = 16 * 1024;
    let mut b = crate::lgr_harness::config(Side::B, 4);
    b.max_links = 4;
    let mut p = EndpointPair::new(a, b, 1);
    p.connect(T1);
    p.run();
    assert_eq!(
        p.b.ep.link_groups().next().map(|g| g.active_count()),
        Some(4)
    );
    let before = p.trace.len();
    p.connect(TcpId(2));
    p.run();
    let flow: Vec<String> = p.trace[before..].iter().map(|e| e.to_string()).collect();
    assert_eq!(
        flow,
        [
            "A->B SMC Proposal",
            "B->A SMC Accept",
            "A->B CONFIRM RKEY others=3",
            "A->B CONFIRM RKEY CONTINUATION",
            "B->A CONFIRM RKEY others=3 rsp",
            "A->B SMC Confirm",
        ]
    );
    let g = p.b.ep.link_groups().next().expect("group");
    let last = g.peer_rmbs.last().expect("peer rmb");
    assert_eq!(
        last.tokens.len(),
        4,
        "the server knows the RMB on every link"
    );
    assert_eq!(g.active_count(), 4);
}

/// A peer whose CONFIRM LINK lacks the 0x03 flags wants RMBE eye catchers (RFC layout): we
/// follow Linux and decline with 0x03050000 (wire-formats.md §1 item 1).
#[test]
fn confirm_link_without_linux_flags_declined() {
    use smc_wire::LlcMessage;
    let mut p = EndpointPair::with_devices(1, 1);
    p.knobs.silent_drop = true;
    p.knobs.drop = Some(Box::new(
        |e| matches!(&e.what, crate::lgr_harness::Traced::Llc(_, LlcMessage::ConfirmLink(c)) if !c.reply),
    ));
    p.connect(T1);
    p.run();
    let mut c = p
        .trace
        .iter()
        .find_map(|e| match &e.what {
            crate::lgr_harness::Traced::Llc(_, LlcMessage::ConfirmLink(c)) => Some(*c),
            _ => None,
        })
        .expect("confirm link");
    c.no_rmbe_eyecatcher = false;
    p.knobs.drop = None;
    let l1 = p.a.link(1).expect("link");
    p.inject_llc(Side::A, l1, LlcMessage::ConfirmLink(c));
    p.run();
    assert!(p.sent("A->B SMC Decline(0x03050000)"));
    assert_eq!(
        fell_back(&p, Side::A, T1),
        Some(Fallback::Declined(smc_wire::DeclineCode::RMBE_EC))
    );
    assert!(matches!(
        fell_back(&p, Side::B, T1),
        Some(Fallback::PeerDeclined { .. })
    ));
}

/// A server whose group with the peer is full creates a parallel link group (first contact
/// again, §3.5.3); the client follows the first-contact flag.
#[test]
fn parallel_link_group_created_by_server() {
    let a = crate::lgr_harness::config(Side::A, 1);
    let mut b = crate::lgr_harness::config(Side::B, 1);
    b.max_conns_per_lgr = 1;
    let mut p = EndpointPair::new(a, b, 1);
    p.connect(T1);
    p.run();
    p.connect(TcpId(2));
    p.run();
    assert!(p.sent("B->A SMC Accept(first contact)"));
    assert_eq!(
        p.flow(true)
            .iter()
            .filter(|l| *l == "B->A SMC Accept(first contact)")
            .count(),
        2
    );
    assert_eq!(p.a.ep.link_groups().count(), 2);
    assert_eq!(p.b.ep.link_groups().count(), 2);
    assert!(established(&p, Side::A, TcpId(2)));
    p.app_send(Side::A, TcpId(2), b"parallel");
    p.app_send(Side::A, T1, b"first");
    p.run();
    assert_eq!(p.b.rx[&TcpId(2)], b"parallel");
    assert_eq!(p.b.rx[&T1], b"first");
}

/// §3.5.2.2 / §4.4.2: the server presents, for a new connection, the <rtoken, index> another
/// connection still uses: the existing connection is aborted (reset), the new one proceeds.
#[test]
fn subsequent_contact_rmbe_in_use_aborts_old_connection() {
    use crate::lgr_harness::Traced;
    use smc_wire::ClcMessage;
    let mut p = EndpointPair::with_devices(1, 1);
    p.connect(T1);
    p.run();
    let first = p
        .trace
        .iter()
        .find_map(|e| match &e.what {
            Traced::Clc(_, ClcMessage::Accept(a)) => Some(a.clone()),
            _ => None,
        })
        .expect("first accept");
    p.knobs.drop = Some(Box::new(|e| {
        matches!(&e.what, Traced::Clc(TcpId(2), ClcMessage::Accept(_)))
    }));
    p.connect(TcpId(2));
    p.run();
    p.knobs.drop = None;
    let mut second = p
        .trace
        .iter()
        .rev()
        .find_map(|e| match &e.what {
            Traced::Clc(TcpId(2), ClcMessage::Accept(a)) => Some(a.clone()),
            _ => None,
        })
        .expect("second accept");
    second.rmb_rkey = first.rmb_rkey;
    second.rmbe_idx = first.rmbe_idx;
    p.inject_tcp(Side::A, TcpId(2), ClcMessage::Accept(second).to_vec());
    p.run();
    assert!(established(&p, Side::A, TcpId(2)));
    assert!(p.a.saw(|e| matches!(
        e,
        EndpointEvent::Conn {
            tcp: T1,
            event: crate::conn::Event::Failed(crate::conn::ConnError::Reset(
                crate::conn::AbortReason::RmbeConflict
            )),
        }
    )));
}

/// Work completions arrive late (after the peer's next messages): the first contact still
/// completes — the server's ADD LINK proves our CONFIRM LINK reply arrived.
#[test]
fn late_completions_do_not_stall_first_contact() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.knobs.completion_delay = std::time::Duration::from_millis(5);
    p.connect(T1);
    p.run_for(std::time::Duration::from_secs(60));
    assert!(established(&p, Side::A, T1), "{:#?}", p.flow(true));
    assert!(established(&p, Side::B, T1));
    assert!(reset(&p, Side::A, T1).is_none());
    p.app_send(Side::A, T1, b"late but fine");
    p.run();
    assert_eq!(p.b.rx[&T1], b"late but fine");
}
