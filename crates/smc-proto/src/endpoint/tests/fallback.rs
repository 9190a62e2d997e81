//! Decline and fallback, the point of no return, out of sync, CLC timeouts and protocol
//! errors (App. C.1–C.6, Fig. 42, §3.5.2.4).

use std::time::Duration;

use smc_wire::{ClcMessage, DeclineCode, LlcMessage};

use super::*;
use crate::endpoint::{Fallback, ResetReason};
use crate::lgr_harness::{config, Traced};

fn no_rdma_data(p: &EndpointPair) -> bool {
    !p.trace
        .iter()
        .any(|e| matches!(e.what, Traced::Cdc(..) | Traced::Write(..)))
}

/// C.1: the server declines in lieu of Accept (subnet mismatch); both fall back.
#[test]
fn server_declines_on_subnet_mismatch() {
    let mut b = config(Side::B, 1);
    b.ipv4_subnets = vec![(std::net::Ipv4Addr::new(10, 9, 0, 0), 16)];
    let mut p = EndpointPair::new(config(Side::A, 1), b, 1);
    p.connect(T1);
    p.run();
    assert_eq!(
        p.flow(true),
        ["A->B SMC Proposal", "B->A SMC Decline(0x03070000)"]
    );
    assert_eq!(
        fell_back(&p, Side::B, T1),
        Some(Fallback::Declined(DeclineCode::DIFFPREFIX))
    );
    assert_eq!(
        fell_back(&p, Side::A, T1),
        Some(Fallback::PeerDeclined {
            code: DeclineCode::DIFFPREFIX,
            out_of_sync: false
        })
    );
    assert_eq!(p.b.ep.link_groups().count(), 0);
}

/// A client that declines in place of its Proposal (C.1): one Decline on the wire, both
/// sides fall back, no link group is made and no RDMA data moves.
#[test]
fn client_declines_in_place_of_the_proposal() {
    let mut p = EndpointPair::new(config(Side::A, 1), config(Side::B, 1), 1);
    let now = p.now;
    p.b.ep.accept(T1, now).expect("accept");
    p.a.ep
        .connect_declined(T1, DeclineCode::NOACCEPT, now)
        .expect("declined");
    p.flush();
    p.run();
    assert_eq!(p.flow(true), ["A->B SMC Decline(0x09990100)"]);
    assert_eq!(
        fell_back(&p, Side::A, T1),
        Some(Fallback::Declined(DeclineCode::NOACCEPT))
    );
    assert_eq!(
        fell_back(&p, Side::B, T1),
        Some(Fallback::PeerDeclined {
            code: DeclineCode::NOACCEPT,
            out_of_sync: false
        })
    );
    assert_eq!(p.a.ep.link_groups().count(), 0);
    assert_eq!(p.b.ep.link_groups().count(), 0);
    assert!(no_rdma_data(&p));
}

/// The IPv6 prefix list matches even when IPv4 does not.
#[test]
fn ipv6_prefix_match_accepts() {
    let prefix = smc_wire::clc::Ipv6Prefix {
        prefix: "2001:db8:1::".parse().expect("addr"),
        prefix_len: 64,
    };
    let mut a = config(Side::A, 1);
    a.ipv4_subnets.clear();
    a.ipv6_prefixes = vec![prefix];
    let mut b = config(Side::B, 1);
    b.ipv4_subnets = vec![(std::net::Ipv4Addr::new(10, 9, 0, 0), 16)];
    b.ipv6_prefixes = vec![prefix];
    let mut p = EndpointPair::new(a, b, 1);
    p.connect(T1);
    p.run();
    assert!(established(&p, Side::A, T1));
}

/// Same network number with another prefix length does not match (Linux's rule).
#[test]
fn subnet_check_needs_same_prefix_length() {
    let mut b = config(Side::B, 1);
    b.ipv4_subnets = vec![(std::net::Ipv4Addr::new(10, 0, 0, 0), 16)];
    let mut p = EndpointPair::new(config(Side::A, 1), b, 1);
    p.connect(T1);
    p.run();
    assert_eq!(
        fell_back(&p, Side::B, T1),
        Some(Fallback::Declined(DeclineCode::DIFFPREFIX))
    );
}

/// Linux's version-2 Proposal (40-byte SMC-D area, SMC-R v1 offered) is accepted and
/// answered with a version-1 Accept (wire-formats.md §1 item 4).
#[test]
fn linux_v2_proposal_answered_with_v1() {
    let mut b = config(Side::B, 1);
    b.ipv4_subnets = vec![(std::net::Ipv4Addr::new(192, 168, 1, 0), 24)];
    let mut p = EndpointPair::new(config(Side::A, 1), b, 1);
    p.act(Side::B, |ep, _, now| ep.accept(T1, now))
        .expect("accept");
    let bytes = smc_wire::examples::bytes("clc_proposal_linux_v2_style").expect("vector");
    p.inject_tcp(Side::B, T1, bytes);
    p.run();
    let accept = p.trace.iter().find_map(|e| match &e.what {
        Traced::Clc(_, ClcMessage::Accept(a)) => Some(a.clone()),
        _ => None,
    });
    let accept = accept.expect("an Accept");
    assert_eq!(accept.version, 1);
    assert!(accept.first_contact);
}

/// Fig. 42 / C.2: the client's CONFIRM LINK response is lost (write failure): the client
/// declines, both fall back, no RDMA data was ever sent.
#[test]
fn fig42_decline_during_llc_negotiation() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.knobs.drop = Some(Box::new(
        |e| matches!(&e.what, Traced::Llc(_, LlcMessage::ConfirmLink(c)) if c.reply),
    ));
    p.connect(T1);
    p.run();
    assert_eq!(
        p.flow(true),
        [
            "A->B SMC Proposal",
            "B->A SMC Accept(first contact)",
            "A->B SMC Confirm",
            "B->A CONFIRM LINK link=1",
            "A->B CONFIRM LINK link=1 rsp (lost)",
            "A->B SMC Decline(0x02010000)",
        ]
    );
    assert!(matches!(
        fell_back(&p, Side::A, T1),
        Some(Fallback::Declined(_))
    ));
    assert!(matches!(
        fell_back(&p, Side::B, T1),
        Some(Fallback::PeerDeclined { .. })
    ));
    assert!(no_rdma_data(&p));
    assert_eq!(p.a.ep.link_groups().count(), 0);
    assert_eq!(p.b.ep.link_groups().count(), 0);
}

/// Server side of C.2: its CONFIRM LINK send fails: it declines in lieu of its CONFIRM LINK.
#[test]
fn server_confirm_link_send_failure_declines() {
    let mut p = EndpointPair::with_devices(1, 1);
    p.knobs.drop = Some(Box::new(
        |e| matches!(&e.what, Traced::Llc(_, LlcMessage::ConfirmLink(c)) if !c.reply),
    ));
    p.connect(T1);
    p.run();
    assert_eq!(p.flow(true)[4], "B->A SMC Decline(0x02010000)");
    assert!(matches!(
        fell_back(&p, Side::A, T1),
        Some(Fallback::PeerDeclined { .. })
    ));
    assert!(matches!(
        fell_back(&p, Side::B, T1),
        Some(Fallback::Declined(_))
    ));
    assert!(no_rdma_data(&p));
}

/// C.3: after the point of no return (CONFIRM LINK done) a failure resets, never falls back:
/// the only link dies during the second-link exchange.
#[test]
fn after_point_of_no_return_errors_reset() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.knobs.drop = Some(Box::new(
        |e| matches!(&e.what, Traced::Llc(_, LlcMessage::AddLink(a)) if a.reply),
    ));
    p.connect(T1);
    p.run_for(Duration::from_secs(20));
    assert!(fell_back(&p, Side::A, T1).is_none());
    assert!(fell_back(&p, Side::B, T1).is_none());
    assert!(reset(&p, Side::A, T1).is_some());
    assert!(reset(&p, Side::B, T1).is_some());
    assert!(!p
        .trace
        .iter()
        .any(|e| matches!(&e.what, Traced::Clc(_, ClcMessage::Decline(_)))));
}

/// C.4: the server believes it reuses a link group the client no longer has: the client
/// declines with the S flag, and the server tears down its group with the client.
#[test]
fn out_of_sync_first_contact_flag() {
    let mut p = EndpointPair::with_devices(1, 1);
    p.connect(T1);
    p.run();
    // The client loses its group silently (its DELETE LINK never arrives).
    p.act(Side::A, |ep, _, now| ep.close(T1, now))
        .expect("close");
    p.act(Side::B, |ep, _, now| ep.close(T1, now))
        .expect("close");
    p.run();
    p.knobs.drop = Some(Box::new(|e| {
        matches!(e.what, Traced::Llc(_, LlcMessage::DeleteLink(_)))
    }));
    let lgr = p.a.ep.link_groups().next().map(|g| g.id).expect("group");
    p.act(Side::A, |ep, _, now| ep.terminate_link_group(lgr, now));
    p.run();
    p.knobs.drop = None;
    assert_eq!(p.a.ep.link_groups().count(), 0);
    assert_eq!(p.b.ep.link_groups().count(), 1);
    p.connect(TcpId(2));
    p.run();
    assert!(p
        .flow(true)
        .contains(&"A->B SMC Decline(0x04000000, S)".to_string()));
    assert_eq!(
        fell_back(&p, Side::B, TcpId(2)),
        Some(Fallback::PeerDeclined {
            code: DeclineCode::SYNCERR,
            out_of_sync: true
        })
    );
    assert_eq!(
        p.b.ep.link_groups().count(),
        0,
        "the S flag tears down the group"
    );
    // The next connection is a clean first contact again.
    p.connect(TcpId(3));
    p.run();
    assert!(established(&p, Side::A, TcpId(3)));
}

/// C.5: the Accept never arrives: the client's CLC timer resets the connection; the server's
/// too (it waits for Confirm). (The client's accept wait, below, is off here.)
#[test]
fn clc_timeout_resets() {
    let mut a = config(Side::A, 1);
    a.accept_wait = None;
    let mut p = EndpointPair::new(a, config(Side::B, 1), 1);
    p.knobs.drop = Some(Box::new(|e| {
        matches!(&e.what, Traced::Clc(_, ClcMessage::Accept(_)))
    }));
    p.connect(T1);
    p.run_for(Duration::from_secs(31));
    assert_eq!(reset(&p, Side::A, T1), Some(ResetReason::ClcTimeout));
    assert_eq!(reset(&p, Side::B, T1), Some(ResetReason::ClcTimeout));
    assert_eq!(p.b.ep.link_groups().count(), 0);
}

/// A client without any answer to its Proposal within its accept wait (the server's
/// program has not accepted the connection) declines in place of the Accept (C.1,
/// `NOACCEPT`) and falls back; the server, whose Accept went unanswered, falls back on
/// reading that Decline in place of the Confirm. Nobody is reset, no link group is left.
#[test]
fn a_client_without_an_answer_declines_after_its_accept_wait() {
    let mut a = config(Side::A, 1);
    a.accept_wait = Some(Duration::from_secs(6));
    let mut p = EndpointPair::new(a, config(Side::B, 1), 1);
    p.knobs.drop = Some(Box::new(|e| {
        matches!(&e.what, Traced::Clc(_, ClcMessage::Accept(_)))
    }));
    p.connect(T1);
    p.run_for(Duration::from_secs(5));
    assert_eq!(fell_back(&p, Side::A, T1), None, "still waiting at 5 s");
    assert_eq!(reset(&p, Side::A, T1), None);
    p.run_for(Duration::from_secs(2));
    assert_eq!(
        fell_back(&p, Side::A, T1),
        Some(Fallback::Declined(DeclineCode::NOACCEPT))
    );
    assert_eq!(
        fell_back(&p, Side::B, T1),
        Some(Fallback::PeerDeclined {
            code: DeclineCode::NOACCEPT,
            out_of_sync: false
        })
    );
    assert_eq!(reset(&p, Side::A, T1), None);
    assert_eq!(reset(&p, Side::B, T1), None);
    p.run_for(Duration::from_secs(30));
    assert_eq!(p.a.ep.link_groups().count(), 0);
    assert_eq!(p.b.ep.link_groups().count(), 0);
    assert!(no_rdma_data(&p));
}

/// C.6: a malformed CLC message (bad eye catcher) is a protocol error: reset, no fallback.
#[test]
fn malformed_clc_terminates() {
    let mut p = EndpointPair::with_devices(1, 1);
    p.act(Side::B, |ep, _, now| ep.accept(T1, now))
        .expect("accept");
    let mut bytes = smc_wire::examples::bytes("clc_proposal_v4").expect("vector");
    bytes[0] = 0;
    p.inject_tcp(Side::B, T1, bytes);
    p.run();
    assert!(matches!(
        reset(&p, Side::B, T1),
        Some(ResetReason::ClcProtocolError(_))
    ));
    assert!(fell_back(&p, Side::B, T1).is_none());
}

/// C.6: an Accept with a reserved QP MTU (a bad enumerated value) is declined, not fatal.
#[test]
fn bad_enumerated_value_declines() {
    let mut p = EndpointPair::with_devices(1, 1);
    p.knobs.drop = Some(Box::new(|e| {
        matches!(&e.what, Traced::Clc(_, ClcMessage::Accept(_)))
    }));
    p.connect(T1);
    p.run();
    let accept = p.trace.iter().find_map(|e| match &e.what {
        Traced::Clc(_, ClcMessage::Accept(a)) => Some(a.clone()),
        _ => None,
    });
    let mut bytes = ClcMessage::Accept(accept.expect("accept")).to_vec();
    // Byte 50: RMBE size (high nibble) and QP MTU (low nibble); 7 is reserved.
    bytes[50] = (bytes[50] & 0xF0) | 0x07;
    p.inject_tcp(Side::A, T1, bytes);
    p.run();
    assert_eq!(
        fell_back(&p, Side::A, T1),
        Some(Fallback::Declined(DeclineCode::CNFERR))
    );
}

/// C.6: an unexpected (well-formed) CLC message is a protocol error.
#[test]
fn unexpected_clc_message_terminates() {
    let mut p = EndpointPair::with_devices(1, 1);
    p.act(Side::B, |ep, _, now| ep.accept(T1, now))
        .expect("accept");
    let d = smc_wire::Decline::new(smc_wire::PeerId::default(), DeclineCode::CNFERR, false);
    let mut accept_like = ClcMessage::Decline(d).to_vec();
    accept_like.clear();
    // A Confirm where a Proposal is expected.
    let c = smc_wire::AcceptConfirm {
        version: 1,
        first_contact: false,
        peer_id: smc_wire::PeerId::default(),
        gid: smc_wire::Gid::default(),
        mac: smc_wire::Mac::default(),
        qp_num: smc_wire::U24::truncate(1),
        rmb_rkey: 1,
        rmbe_idx: 1,
        rmbe_alert_token: 1,
        rmbe_size: smc_wire::RmbeSize(0),
        qp_mtu: smc_wire::QpMtu::MTU_1024,
        rmb_vaddr: 0,
        initial_psn: smc_wire::U24::truncate(1),
        v2: None,
    };
    p.inject_tcp(Side::B, T1, ClcMessage::Confirm(c).to_vec());
    p.run();
    assert!(matches!(
        reset(&p, Side::B, T1),
        Some(ResetReason::ClcProtocolError(_))
    ));
}

/// A Decline in lieu of Confirm (the client declines after the server's Accept).
#[test]
fn client_declines_in_lieu_of_confirm() {
    let mut p = EndpointPair::with_devices(1, 1);
    p.a.res.fail_create_qp = 1;
    p.connect(T1);
    p.run();
    assert_eq!(
        p.flow(true),
        [
            "A->B SMC Proposal",
            "B->A SMC Accept(first contact)",
            "A->B SMC Decline(0x01010000)",
        ]
    );
    assert!(matches!(
        fell_back(&p, Side::B, T1),
        Some(Fallback::PeerDeclined { .. })
    ));
    assert_eq!(p.b.ep.link_groups().count(), 0);
}

/// §3.5.2.4: data (a CDC) overtaking the Confirm of a subsequent contact is held until the
/// Confirm is processed.
#[test]
fn data_before_confirm_is_held() {
    let mut p = EndpointPair::with_devices(1, 1);
    p.connect(T1);
    p.run();
    // Lose the Confirm of the second connection, keep its bytes, deliver them after the data.
    p.knobs.drop = Some(Box::new(|e| {
        matches!(&e.what, Traced::Clc(_, ClcMessage::Confirm(_)))
    }));
    p.connect(TcpId(2));
    p.run();
    p.knobs.drop = None;
    let confirm = p.trace.iter().rev().find_map(|e| match &e.what {
        Traced::Clc(TcpId(2), m @ ClcMessage::Confirm(_)) => Some(m.to_vec()),
        _ => None,
    });
    assert!(established(&p, Side::A, TcpId(2)));
    assert!(!established(&p, Side::B, TcpId(2)));
    p.app_send(Side::A, TcpId(2), b"early bird");
    p.run();
    assert_eq!(p.b.ep.handshake_state(TcpId(2)), Some("ExpectConfirm"));
    // The Confirm comes over TCP: the setup does not wait on the fabric.
    assert!(!p.b.ep.handshake_awaits_fabric(TcpId(2)));
    p.inject_tcp(Side::B, TcpId(2), confirm.expect("confirm bytes"));
    p.run();
    assert!(established(&p, Side::B, TcpId(2)));
    assert_eq!(p.b.rx[&TcpId(2)], b"early bird");
}

/// No chase (C.1, C.3): on a subsequent contact the server cannot Decline after its Accept:
/// when the only link fails while the Confirm is in flight, the connection is reset.
#[test]
fn no_decline_after_accept_on_subsequent_contact() {
    let mut p = EndpointPair::with_devices(1, 1);
    p.connect(T1);
    p.run();
    p.connect(TcpId(2));
    assert!(p.run_until(|p| {
        p.flow(true)
            .iter()
            .filter(|l| *l == "A->B SMC Confirm")
            .count()
            == 2
    }));
    let l1 = p.b.link(1).expect("link");
    p.kill_link(Side::B, l1);
    p.run();
    assert!(fell_back(&p, Side::B, TcpId(2)).is_none());
    assert!(fell_back(&p, Side::A, TcpId(2)).is_none());
    // Reset during setup, or (when the Confirm got there first) the new connection fails.
    assert!(
        reset(&p, Side::B, TcpId(2)).is_some()
            || p.b.saw(|e| matches!(
                e,
                EndpointEvent::Conn {
                    tcp: TcpId(2),
                    event: crate::conn::Event::Failed(_)
                }
            ))
    );
    assert!(!p
        .trace
        .iter()
        .any(|e| matches!(&e.what, Traced::Clc(TcpId(2), ClcMessage::Decline(_)))));
}

/// A first contact of `T1` whose CONFIRM LINK reply for link 2 never reached the server: the
/// client is established, the server still waits for the second link's confirmation.
fn first_contact_without_second_confirm_reply() -> EndpointPair {
    let mut p = EndpointPair::with_devices(2, 2);
    p.knobs.silent_drop = true;
    p.knobs.drop = Some(Box::new(
        |e| matches!(&e.what, Traced::Llc(_, LlcMessage::ConfirmLink(c)) if c.reply && c.link_num == 2),
    ));
    p.connect(T1);
    p.run();
    p.knobs.drop = None;
    assert!(established(&p, Side::A, T1));
    p
}

/// First contact: the client finishes the second-link exchange (and sends data on link 1)
/// before its CONFIRM LINK reply on link 2 reaches the server: the data is held until the
/// server's side completes.
#[test]
fn data_overtaking_second_link_confirmation_is_held() {
    let mut p = first_contact_without_second_confirm_reply();
    assert!(!established(&p, Side::B, T1));
    p.app_send(Side::A, T1, b"overtaking");
    p.run();
    assert_eq!(p.b.ep.handshake_state(T1), Some("ExpectSecondLink"));
    // What ends the second-link exchange comes over the fabric, not over TCP.
    assert!(p.b.ep.handshake_awaits_fabric(T1));
    assert!(
        !p.a.ep.handshake_awaits_fabric(T1),
        "established: no handshake"
    );
    let rsp = p
        .trace
        .iter()
        .find_map(|e| match &e.what {
            Traced::Llc(_, LlcMessage::ConfirmLink(c)) if c.reply && c.link_num == 2 => Some(*c),
            _ => None,
        })
        .expect("reply");
    let l2 = p.b.link(2).expect("link 2");
    p.inject_llc(Side::B, l2, LlcMessage::ConfirmLink(rsp));
    p.run();
    assert!(established(&p, Side::B, T1));
    assert_eq!(p.b.rx[&T1], b"overtaking");
}

/// A Proposal from a peer whose link group with us is still in its first contact (the
/// server waits for the second link's confirmation; the client is already established and
/// connects again) waits for that first contact and then reuses the group, rather than
/// opening a parallel one.
#[test]
fn proposal_during_first_contact_waits_and_reuses_the_group() {
    let mut p = first_contact_without_second_confirm_reply();
    assert_eq!(p.b.ep.handshake_state(T1), Some("ExpectSecondLink"));
    p.connect(T2);
    p.run();
    assert_eq!(p.b.ep.handshake_state(T2), Some("ExpectProposal"), "parked");
    assert!(!established(&p, Side::A, T2));
    let rsp = p
        .trace
        .iter()
        .find_map(|e| match &e.what {
            Traced::Llc(_, LlcMessage::ConfirmLink(c)) if c.reply && c.link_num == 2 => Some(*c),
            _ => None,
        })
        .expect("reply");
    let l2 = p.b.link(2).expect("link 2");
    p.inject_llc(Side::B, l2, LlcMessage::ConfirmLink(rsp));
    p.run();
    dump(&p);
    assert!(established(&p, Side::B, T1));
    assert!(established(&p, Side::A, T2) && established(&p, Side::B, T2));
    assert_eq!(p.a.ep.link_groups().count(), 1);
    assert_eq!(p.b.ep.link_groups().count(), 1);
    assert_eq!(p.b.ep.link_groups().next().map(|g| g.conns.len()), Some(2));
}

/// The server's RNIC has no GID of the kind the client proposed (an IPv6 GID to a server with
/// IPv4-mapped GIDs only: `Resources::port_for` finds none): Decline "no SMC-R device found"
/// in lieu of the Accept, both fall back, no link group.
#[test]
fn server_declines_a_gid_no_device_speaks_to() {
    let mut p = EndpointPair::new(config(Side::A, 1), config(Side::B, 1), 1);
    p.b.res.port_for = Some(|_, _| None);
    p.connect(T1);
    p.run();
    assert_eq!(
        p.flow(true),
        ["A->B SMC Proposal", "B->A SMC Decline(0x03030002)"]
    );
    assert_eq!(
        fell_back(&p, Side::A, T1),
        Some(Fallback::PeerDeclined {
            code: DeclineCode::NOSMCRDEV,
            out_of_sync: false
        })
    );
    assert_eq!(p.b.ep.link_groups().count(), 0);
}

/// Server devices 0 and 1 are two GIDs of one RNIC, and only 1 is of the client GID's kind:
/// the connection's set (device 0, chosen by its TCP address) is re-expressed as device 1,
/// which the Accept announces and the link group uses.
#[test]
fn server_answers_from_the_gid_of_the_clients_kind() {
    let mut p = EndpointPair::new(config(Side::A, 1), config(Side::B, 2), 1);
    p.b.res.port_for = Some(|_, _| Some(crate::fabric::DeviceId(1)));
    let only = |d: u8| crate::endpoint::ConnectOptions {
        pnet: crate::fabric::DeviceSet::from_ids([crate::fabric::DeviceId(d)]),
        ..Default::default()
    };
    p.connect_with(T1, only(0), only(0));
    p.run();
    assert_eq!(fell_back(&p, Side::A, T1), None);
    assert_eq!(fell_back(&p, Side::B, T1), None);
    let g = p.b.ep.link_groups().next().expect("server link group");
    assert!(!g.links.is_empty());
    assert!(
        g.links
            .values()
            .all(|l| l.device == crate::fabric::DeviceId(1)
                && l.state == crate::link_group::LinkState::Active),
        "{:?}",
        g.links
    );
    assert!(
        g.pnet.contains(crate::fabric::DeviceId(1)) && !g.pnet.contains(crate::fabric::DeviceId(0))
    );
    let a = p.a.ep.link_groups().next().expect("client link group");
    let dev1 = crate::lgr_harness::device(Side::B, 1).gid;
    assert!(a
        .links
        .values()
        .all(|l| l.remote.is_some_and(|r| r.gid == dev1)));
}

/// The client's RNIC cannot connect a QP to the server's port at all (`Resources::
/// connectable`: a peer in another shm fabric directory, as two users' programs with their
/// default ones): the client declines in place of its Confirm, before any link group of its
/// own; the server, still waiting for the Confirm, falls back on reading it and sends no
/// Decline of its own, so none crosses ours on the way (the program would find it in front
/// of its data). Both link groups are gone.
#[test]
fn client_declines_in_place_of_confirm_a_port_it_cannot_connect_to() {
    let mut p = EndpointPair::new(config(Side::A, 1), config(Side::B, 1), 1);
    p.a.res.connectable = false;
    p.connect(T1);
    p.run();
    assert_eq!(
        p.flow(true),
        [
            "A->B SMC Proposal",
            "B->A SMC Accept(first contact)",
            "A->B SMC Decline(0x09990002)"
        ]
    );
    assert_eq!(
        fell_back(&p, Side::A, T1),
        Some(Fallback::Declined(DeclineCode::ERR_RDYLNK))
    );
    assert_eq!(
        fell_back(&p, Side::B, T1),
        Some(Fallback::PeerDeclined {
            code: DeclineCode::ERR_RDYLNK,
            out_of_sync: false
        })
    );
    assert_eq!(p.a.ep.link_groups().count(), 0);
    assert_eq!(p.b.ep.link_groups().count(), 0);
}
