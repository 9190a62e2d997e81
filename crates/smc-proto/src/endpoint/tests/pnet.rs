//! Per-connection options: the physical network (PNET) a connection's link group may use, and
//! the size of its RMBE.

use smc_wire::{DeclineCode, RmbeSize};

use super::*;
use crate::endpoint::ConnectOptions;
use crate::fabric::{DeviceId, DeviceSet};

fn on(devices: &[u8]) -> ConnectOptions {
    ConnectOptions {
        pnet: DeviceSet::from_ids(devices.iter().map(|d| DeviceId(*d))),
        rmbe_size: None,
    }
}

fn devices_used(p: &EndpointPair, s: Side) -> Vec<Vec<u8>> {
    p.host(s)
        .ep
        .link_groups()
        .map(|g| g.links.values().map(|l| l.device.0).collect())
        .collect()
}

#[test]
fn device_set_membership() {
    let s = DeviceSet::from_ids([DeviceId(1), DeviceId(70), DeviceId(255)]);
    assert!(s.contains(DeviceId(1)) && s.contains(DeviceId(70)) && s.contains(DeviceId(255)));
    assert!(!s.contains(DeviceId(0)) && !s.contains(DeviceId(64)));
    assert_eq!(s.first(2), Some(DeviceId(1)));
    assert_eq!(s.first(1), None);
    assert_eq!(DeviceSet::EMPTY.first(256), None);
    assert_eq!(DeviceSet::ALL.first(3), Some(DeviceId(0)));
    assert_eq!(DeviceSet::default(), DeviceSet::ALL);
}

/// The client's connection runs on the network of its second RNIC only: its link group uses
/// that RNIC alone (no second link on the other network).
#[test]
fn client_link_group_stays_on_its_network() {
    let mut p = EndpointPair::with_devices(3, 2);
    p.connect_with(T1, on(&[2]), ConnectOptions::default());
    p.run();
    assert!(established(&p, Side::A, T1) && established(&p, Side::B, T1));
    for links in devices_used(&p, Side::A) {
        assert!(links.iter().all(|d| *d == 2), "client links on {links:?}");
    }
    let data: Vec<u8> = (0..50_000u32).map(|i| (i % 253) as u8).collect();
    p.app_send(Side::A, T1, &data);
    p.run();
    assert_eq!(p.b.rx[&T1], data);
}

/// Server side: the group serving a connection uses only the RNICs of its network, second
/// link included.
#[test]
fn server_link_group_stays_on_its_network() {
    let mut p = EndpointPair::with_devices(2, 3);
    p.connect_with(T1, ConnectOptions::default(), on(&[1, 2]));
    p.run();
    assert!(established(&p, Side::B, T1));
    let used = devices_used(&p, Side::B);
    assert_eq!(used.len(), 1);
    assert!(used[0].iter().all(|d| [1, 2].contains(d)), "{used:?}");
    assert_eq!(
        used[0].len(),
        2,
        "second link on the other RNIC of the network"
    );
}

/// No RNIC of ours on the connection's network: the client declines in place of the
/// Proposal and both sides fall back at once.
#[test]
fn client_without_device_on_network_declines() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect_with(T1, on(&[]), ConnectOptions::default());
    p.run();
    assert_eq!(p.flow(true), ["A->B SMC Decline(0x03030002)"]);
    assert_eq!(
        fell_back(&p, Side::A, T1),
        Some(Fallback::Declined(DeclineCode::NOSMCRDEV))
    );
    assert_eq!(
        fell_back(&p, Side::B, T1),
        Some(Fallback::PeerDeclined {
            code: DeclineCode::NOSMCRDEV,
            out_of_sync: false
        })
    );
    assert_eq!(p.a.ep.link_groups().count(), 0);
}

/// The server has no RNIC on the network the Proposal arrived on: Decline, fallback.
#[test]
fn server_without_device_on_network_declines() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect_with(T1, ConnectOptions::default(), on(&[5]));
    p.run();
    assert_eq!(
        p.flow(true),
        ["A->B SMC Proposal", "B->A SMC Decline(0x03030002)"]
    );
    assert_eq!(
        fell_back(&p, Side::B, T1),
        Some(Fallback::Declined(DeclineCode::NOSMCRDEV))
    );
    assert_eq!(p.b.ep.link_groups().count(), 0);
}

/// Connections on different networks get different link groups (no subsequent contact
/// across networks); a third on the first network reuses the first group.
#[test]
fn subsequent_contact_only_within_one_network() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect_with(T1, on(&[0]), on(&[0]));
    p.run();
    p.connect_with(TcpId(2), on(&[1]), on(&[1]));
    p.run();
    p.connect_with(TcpId(3), on(&[0]), on(&[0]));
    p.run();
    for t in [T1, TcpId(2), TcpId(3)] {
        assert!(established(&p, Side::A, t) && established(&p, Side::B, t));
    }
    for s in [Side::A, Side::B] {
        let mut used = devices_used(&p, s);
        used.sort();
        assert_eq!(used, vec![vec![0], vec![1]], "{s:?}");
    }
    let g = p.b.ep.connection_link(T1).map(|(g, _)| g);
    assert_eq!(g, p.b.ep.connection_link(TcpId(3)).map(|(g, _)| g));
    assert_ne!(g, p.b.ep.connection_link(TcpId(2)).map(|(g, _)| g));
}

/// Per-connection receive buffers: each side's RMBE has the size its application asked
/// for, and the peer's send window follows it.
#[test]
fn per_connection_rmbe_size() {
    let mut p = EndpointPair::with_devices(2, 2);
    let big = ConnectOptions {
        rmbe_size: Some(RmbeSize(4)),
        ..ConnectOptions::default()
    };
    let small = ConnectOptions {
        rmbe_size: Some(RmbeSize(0)),
        ..ConnectOptions::default()
    };
    p.connect_with(T1, big, small);
    p.run();
    let a = p.a.ep.connection(T1).expect("client connection");
    let b = p.b.ep.connection(T1).expect("server connection");
    assert_eq!(a.config().local_rmbe_len, 256 * 1024);
    assert_eq!(b.config().peer_rmbe_len, 256 * 1024);
    assert_eq!(b.config().local_rmbe_len, 16 * 1024);
    assert_eq!(a.config().peer_rmbe_len, 16 * 1024);
    // Beyond both sizes, byte-exact both ways.
    let x: Vec<u8> = (0..600_000u32).map(|i| (i % 249) as u8).collect();
    p.app_send(Side::A, T1, &x);
    p.app_send(Side::B, T1, &x);
    p.run();
    assert_eq!(p.b.rx[&T1], x);
    assert_eq!(p.a.rx[&T1], x);
}

/// The client's new link fails locally (its RNIC cannot reach the server's: two LANs) right
/// after its ADD LINK reply; the server's ADD LINK CONTINUATION for it arrives after the
/// client deleted it. That is a timing window, not a protocol error: the group keeps its
/// first link and the connection its data.
#[test]
fn late_add_link_continuation_for_a_failed_link_is_ignored() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect(T1);
    assert!(p.run_until(|p| p.sent("A->B ADD LINK link=2 rsp")));
    let new = p.a.link(2).expect("client's new link");
    p.act(Side::A, |ep, res, now| {
        ep.handle_link_failure(new, res, now)
    });
    // The server's exchange ends by its LLC timer at the latest.
    p.run_for(std::time::Duration::from_secs(10));
    // The server ends its exchange on the client's report and deletes the link itself.
    assert_eq!(
        p.flow(true)[6..],
        [
            "A->B ADD LINK link=2 rsp",
            "A->B DELETE LINK link=2",
            "B->A ADD LINK CONTINUATION link=2 pairs=1",
            "B->A DELETE LINK link=2",
            "A->B DELETE LINK link=2 rsp",
        ]
    );
    assert!(established(&p, Side::A, T1) && established(&p, Side::B, T1));
    for s in [Side::A, Side::B] {
        let g = p.host(s).ep.link_groups().next().expect("group survives");
        assert!(g.links.contains_key(&1), "{s:?} keeps link 1");
    }
    let data: Vec<u8> = (0..200_000u32).map(|i| (i % 241) as u8).collect();
    p.app_send(Side::A, T1, &data);
    p.app_send(Side::B, T1, &data);
    p.run();
    assert_eq!(p.b.rx[&T1], data);
    assert_eq!(p.a.rx[&T1], data);
}
