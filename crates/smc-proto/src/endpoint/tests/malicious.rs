//! A malicious peer, at the endpoint level: forged CDCs arriving on a real link of a link group
//! with several connections, stale or unknown rkeys, malformed LLC messages. Each gets the
//! RFC's reaction with a counted reason, confined to what the peer attacked: the forged
//! connection is reset, its siblings and the links carry on; a bad link is brought down and its
//! connections fail over without loss.

use std::time::Duration;

use smc_wire::{CdcMessage, Cursor, LlcMessage};

use super::*;
use crate::conn::{AbortReason, ConnError, Event};
use crate::lgr_harness::Rng;

/// A link group with two links and two connections, A client, B server.
fn two_conns() -> EndpointPair {
    let mut p = EndpointPair::with_devices(2, 2);
    p.knobs.strict_writes = false;
    p.connect(T1);
    p.run();
    p.connect(T2);
    p.run();
    assert!(established(&p, Side::A, T1) && established(&p, Side::A, T2));
    assert!(established(&p, Side::B, T1) && established(&p, Side::B, T2));
    p
}

fn bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut r = Rng::new(seed);
    (0..len).map(|_| r.next_u64() as u8).collect()
}

/// A CDC to side `to` for its connection `tcp` that repeats what it knows (fresh seqno).
fn baseline(p: &EndpointPair, to: Side, tcp: TcpId) -> CdcMessage {
    let c = p.host(to).ep.connection(tcp).expect("connection");
    CdcMessage {
        // Newer than anything the genuine peer sent in these short tests.
        seqno: 500,
        alert_token: c.config().local_alert_token,
        producer: c.peer_producer_cursor(),
        consumer: c.peer_consumer_cursor(),
        prod_flags: Default::default(),
        conn_flags: Default::default(),
    }
}

/// Deliver `m` to side `to` on its link number `num`.
fn inject_cdc(p: &mut EndpointPair, to: Side, num: u8, m: &CdcMessage) {
    let link = p.host(to).link(num).expect("link");
    let now = p.now;
    let h = p.host_mut(to);
    h.ep.handle_message(link, &m.to_bytes(), &mut h.res, now);
    p.flush();
}

/// The failure reported for `tcp` on side `s`.
fn failure(p: &EndpointPair, s: Side, tcp: TcpId) -> Option<ConnError> {
    p.host(s).events.iter().find_map(|(_, e)| match e {
        EndpointEvent::Conn {
            tcp: t,
            event: Event::Failed(err),
        } if *t == tcp => Some(*err),
        _ => None,
    })
}

/// The sibling connection T2 still moves bytes both ways, intact.
fn sibling_still_works(p: &mut EndpointPair) {
    let ab = bytes(30_000, 7);
    let ba = bytes(20_000, 8);
    let a0 = p.host(Side::B).rx.get(&T2).map_or(0, Vec::len);
    let b0 = p.host(Side::A).rx.get(&T2).map_or(0, Vec::len);
    p.app_send(Side::A, T2, &ab);
    p.app_send(Side::B, T2, &ba);
    p.run_for(Duration::from_secs(5));
    let got_b = &p.host(Side::B).rx[&T2];
    let got_a = &p.host(Side::A).rx[&T2];
    assert!(
        got_b.get(a0..) == Some(&ab[..]),
        "A->B: {} bytes",
        got_b.len() - a0
    );
    assert!(
        got_a.get(b0..) == Some(&ba[..]),
        "B->A: {} bytes",
        got_a.len() - b0
    );
    assert_eq!(failure(p, Side::A, T2), None);
    assert_eq!(failure(p, Side::B, T2), None);
}

fn forged_cdc_resets_only_its_connection(f: impl FnOnce(&mut CdcMessage), reason: AbortReason) {
    let mut p = two_conns();
    // Some genuine traffic on T1 first, so that cursors are not at zero.
    p.app_send(Side::A, T1, &bytes(5000, 1));
    p.run();
    let mut m = baseline(&p, Side::B, T1);
    f(&mut m);
    inject_cdc(&mut p, Side::B, 1, &m);
    p.run_for(Duration::from_secs(60));
    assert_eq!(
        failure(&p, Side::B, T1),
        Some(ConnError::Aborted(reason)),
        "{reason:?}"
    );
    assert!(reason.is_protocol_violation() || reason == AbortReason::EyeCatcherOverwritten);
    // The victim's peer learns of the abort (PeerConnAbort or the TCP reset).
    assert!(matches!(
        failure(&p, Side::A, T1),
        Some(ConnError::Reset(
            AbortReason::PeerAbort | AbortReason::TcpReset
        ))
    ));
    // The link group, both links and the other connection are untouched.
    for s in [Side::A, Side::B] {
        let g = p.host(s).ep.link_groups().next().expect("group");
        assert_eq!(g.links.len(), 2, "{s:?}");
        assert_eq!(p.host(s).ep.stats().link_failures, 0);
    }
    sibling_still_works(&mut p);
}

#[test]
fn producer_cursor_past_the_rmbe() {
    forged_cdc_resets_only_its_connection(
        |m| m.producer.count = u32::MAX - 3,
        AbortReason::ProducerOutOfBounds,
    );
}

#[test]
fn producer_cursor_backwards() {
    forged_cdc_resets_only_its_connection(
        |m| m.producer.count = m.producer.count.saturating_sub(1000),
        AbortReason::ProducerBackwards,
    );
}

#[test]
fn producer_wrap_jump() {
    // Two wraps ahead: more unread data than the RMBE can hold.
    forged_cdc_resets_only_its_connection(
        |m| m.producer.wrap = m.producer.wrap.wrapping_add(2),
        AbortReason::ProducerOverrun,
    );
}

#[test]
fn consumer_cursor_claiming_unsent_data() {
    forged_cdc_resets_only_its_connection(
        |m| m.consumer = Cursor::new(m.consumer.wrap, m.consumer.count + 17),
        AbortReason::ConsumerAhead,
    );
}

#[test]
fn consumer_cursor_past_the_peer_rmbe() {
    forged_cdc_resets_only_its_connection(
        |m| m.consumer.count = u32::MAX,
        AbortReason::ConsumerOutOfBounds,
    );
}

/// A CDC naming an alert token that does not exist, or one of another link group, is
/// ignored: no connection is touched.
#[test]
fn cdc_with_an_unknown_alert_token_is_ignored() {
    let mut p = two_conns();
    let mut m = baseline(&p, Side::B, T1);
    let t1 = m.alert_token;
    let t2 = baseline(&p, Side::B, T2).alert_token;
    m.alert_token = (1..).find(|t| *t != t1 && *t != t2).expect("free token");
    m.producer.count = u32::MAX;
    inject_cdc(&mut p, Side::B, 1, &m);
    p.run_for(Duration::from_secs(5));
    assert_eq!(failure(&p, Side::B, T1), None);
    assert_eq!(failure(&p, Side::B, T2), None);
    sibling_still_works(&mut p);
}

/// Stale rkeys: the peer no longer honours the rkeys of link 1 (its RMB registration on that
/// link is gone). Our RDMA WRITEs there complete in error; the link goes down and the
/// connections fail over to link 2 without losing a byte.
#[test]
fn stale_rkey_brings_the_link_down_and_connections_fail_over() {
    let mut p = two_conns();
    let b_link1 = p.b.link(1).expect("link 1");
    p.b.res.mrs.retain(|_, (_, _, link)| *link != b_link1);
    let d1 = bytes(200_000, 11);
    let d2 = bytes(150_000, 12);
    p.app_send(Side::A, T1, &d1);
    p.app_send(Side::A, T2, &d2);
    p.run_for(Duration::from_secs(30));
    assert!(
        p.b.rx[&T1] == d1,
        "T1: {} of {} bytes",
        p.b.rx[&T1].len(),
        d1.len()
    );
    assert!(
        p.b.rx[&T2] == d2,
        "T2: {} of {} bytes",
        p.b.rx[&T2].len(),
        d2.len()
    );
    assert!(p.a.ep.stats().link_failures >= 1);
    assert!(failure(&p, Side::A, T1).is_none() && failure(&p, Side::B, T1).is_none());
}

/// Every rkey of the peer is unknown: no link can carry data, the link group is lost and
/// every connection is reset with `LinkGroupLost` (never a hang).
#[test]
fn unknown_rkeys_on_every_link_reset_every_connection() {
    let mut p = two_conns();
    p.b.res.mrs.clear();
    p.app_send(Side::A, T1, &bytes(10_000, 13));
    p.app_send(Side::A, T2, &bytes(10_000, 14));
    p.run_for(Duration::from_secs(60));
    for t in [T1, T2] {
        assert_eq!(
            failure(&p, Side::A, t),
            Some(ConnError::Reset(AbortReason::LinkGroupLost)),
            "{t:?}"
        );
    }
    assert_eq!(p.a.ep.link_groups().count(), 0);
}

/// A malformed LLC message (an unknown, non-optional type; a wrong length byte) is a protocol
/// violation: the link it came on is brought down (counted), the connections continue on the
/// other link.
#[test]
fn malformed_llc_brings_its_link_down_only() {
    for raw in [
        {
            let mut r = [0u8; 44];
            r[0] = 0x3F; // unknown type, not optional (b'10xxxxxx')
            r[1] = 44;
            r
        },
        {
            let mut r = LlcMessage::TestLink(Default::default()).to_bytes();
            r[1] = 43; // wrong length
            r
        },
    ] {
        let mut p = two_conns();
        let link = p.a.link(1).expect("link 1");
        let now = p.now;
        p.a.ep.handle_message(link, &raw, &mut p.a.res, now);
        p.flush();
        p.run_for(Duration::from_secs(1));
        assert_eq!(p.a.ep.stats().link_failures, 1, "{raw:02x?}");
        let g = p.a.ep.link_groups().next().expect("group");
        assert!(!g.links.contains_key(&1) || g.links.len() == 2);
        sibling_still_works(&mut p);
        assert_eq!(failure(&p, Side::A, T1), None);
    }
}

/// An optional LLC type the stack does not know is silently discarded and counted.
#[test]
fn unknown_optional_llc_is_discarded_and_counted() {
    let mut p = two_conns();
    let mut raw = [0u8; 44];
    raw[0] = 0x9A; // b'10xxxxxx'
    raw[1] = 44;
    let link = p.a.link(2).expect("link 2");
    let now = p.now;
    p.a.ep.handle_message(link, &raw, &mut p.a.res, now);
    p.flush();
    assert_eq!(p.a.ep.stats().llc_discarded, 1);
    assert_eq!(p.a.ep.stats().link_failures, 0);
    sibling_still_works(&mut p);
}

/// Random bursts of forged CDCs at live connections (any cursors, flags, sequence numbers),
/// with genuine traffic in between: never a panic, a read outside the RMB, an invalid RDMA
/// WRITE or a livelock, and each affected connection fails with a peer-misbehaviour reason.
#[test]
fn random_forged_cdc_bursts_with_traffic() {
    let runs = std::env::var("SMC_REL_FORGED_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200u64);
    for seed in 0..runs {
        let mut p = two_conns();
        p.knobs.strict_writes = true;
        let mut r = Rng::new(seed);
        for _ in 0..6 {
            let t = if r.below(2) == 0 { T1 } else { T2 };
            let s = if r.below(2) == 0 { Side::A } else { Side::B };
            p.app_send(s, t, &bytes(r.below(40_000) as usize, r.next_u64()));
            p.run_for(Duration::from_millis(r.below(50)));
            if p.host(s).ep.connection(t).is_none() {
                continue;
            }
            let mut m = baseline(&p, s, t);
            m.seqno = r.next_u64() as u16;
            let w = r.next_u64();
            match r.below(5) {
                0 => m.producer.count = w as u32,
                1 => m.producer.wrap = m.producer.wrap.wrapping_add(w as u16),
                2 => m.consumer.count = w as u32,
                3 => m.consumer.wrap = m.consumer.wrap.wrapping_add(w as u16),
                _ => {
                    let raw = w.to_be_bytes();
                    m.prod_flags = smc_wire::cdc::ProducerFlags::from_byte(raw[0]);
                    m.conn_flags = smc_wire::cdc::ConnStateFlags::from_byte(raw[1]);
                }
            }
            inject_cdc(&mut p, s, 1 + r.below(2) as u8, &m);
        }
        p.run_for(Duration::from_secs(120));
        for s in [Side::A, Side::B] {
            for t in [T1, T2] {
                if let Some(ConnError::Aborted(reason)) = failure(&p, s, t) {
                    assert!(
                        reason.is_protocol_violation()
                            || matches!(
                                reason,
                                AbortReason::UnreadDataOnClose | AbortReason::ApplicationAbort
                            ),
                        "seed {seed}: {reason:?}"
                    );
                }
            }
        }
    }
}
