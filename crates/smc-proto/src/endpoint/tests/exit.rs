//! The end of a process: each side withdraws its RMBs with DELETE RKEY (RFC 7609 §3.5.5.2.2)
//! and a group is done once both have ([`LinkGroup::rmbs_withdrawn`]), so the exit handler of
//! `smc` (`lgr_exit.rs`) deletes it without waiting for quiet.
//!
//! [`LinkGroup::rmbs_withdrawn`]: crate::link_group::LinkGroup::rmbs_withdrawn

use super::*;
use crate::fabric::LgrId;

/// A pair with `conns` connections made and closed again on both sides, each connection with
/// an RMB of its own on side A (16 KiB RMBs): (pair, A's group, B's group).
fn closed_pair(conns: u64, seed: u64) -> (EndpointPair, LgrId, LgrId) {
    let mut a = crate::lgr_harness::config(Side::A, 1);
    a.rmb_pool.rmb_target_bytes = 16 * 1024;
    let b = crate::lgr_harness::config(Side::B, 1);
    let mut p = EndpointPair::new(a, b, seed);
    for t in 1..=conns {
        p.connect(TcpId(t));
        p.run();
        assert!(established(&p, Side::A, TcpId(t)));
    }
    for t in 1..=conns {
        for s in [Side::A, Side::B] {
            p.act(s, |ep, _, now| ep.close(TcpId(t), now))
                .expect("close");
        }
    }
    p.run();
    let ga = p.a.ep.link_groups().next().map(|g| g.id).expect("group");
    let gb = p.b.ep.link_groups().next().map(|g| g.id).expect("group");
    for (s, g) in [(Side::A, ga), (Side::B, gb)] {
        let g = p.host(s).ep.link_group(g).expect("group");
        assert!(g.conns.is_empty(), "{s:?}: connections left");
        assert!(!g.rmbs_withdrawn(), "{s:?}: withdrawn before anyone asked");
    }
    (p, ga, gb)
}

fn withdrawn(p: &EndpointPair, s: Side, g: LgrId) -> bool {
    p.host(s).ep.link_group(g).expect("group").rmbs_withdrawn()
}

/// Both sides end at once: their DELETE RKEY requests cross, both are answered, and each side
/// then has nothing of the other's left and nothing of its own the other still knows. No
/// DELETE LINK is part of it (the exit handler sends that next).
#[test]
fn both_sides_withdraw_their_rmbs_crossing() {
    let (mut p, ga, gb) = closed_pair(1, 21);
    let before = p.trace.len();
    let n = p.act(Side::A, |ep, res, now| ep.withdraw_rmbs(ga, res, now));
    assert_eq!(n, 1);
    let n = p.act(Side::B, |ep, res, now| ep.withdraw_rmbs(gb, res, now));
    assert_eq!(n, 1);
    assert!(
        !withdrawn(&p, Side::A, ga),
        "A's request is not answered yet"
    );
    p.run();
    dump(&p);
    let mut flow: Vec<String> = p.trace[before..].iter().map(|e| e.to_string()).collect();
    flow.sort();
    assert_eq!(
        flow,
        [
            "A->B DELETE RKEY count=1",
            "A->B DELETE RKEY count=1 rsp",
            "B->A DELETE RKEY count=1",
            "B->A DELETE RKEY count=1 rsp",
        ]
    );
    assert!(withdrawn(&p, Side::A, ga));
    assert!(withdrawn(&p, Side::B, gb));
    for s in [Side::A, Side::B] {
        let g = p.host(s).ep.link_groups().next().expect("the group stays");
        assert!(g.local_rmbs.is_empty(), "{s:?}: own RMBs freed");
        assert!(g.peer_rmbs.iter().all(|r| r.tokens.is_empty()));
    }
    // Asking again sends nothing.
    let before = p.trace.len();
    assert_eq!(
        p.act(Side::A, |ep, res, now| ep.withdraw_rmbs(ga, res, now)),
        0
    );
    p.run();
    assert_eq!(p.trace.len(), before);
    assert!(!p.sent("DELETE LINK"));
}

/// Only one side withdraws (its peer goes on, as a long-lived server does): neither side is
/// done — the withdrawing side still knows the peer's RMB, the peer still has its own. When
/// the peer withdraws its RMB too (as the Linux kernel does when it frees a connection), both
/// are.
#[test]
fn one_side_alone_is_not_withdrawn() {
    let (mut p, ga, gb) = closed_pair(1, 22);
    p.act(Side::A, |ep, res, now| ep.withdraw_rmbs(ga, res, now));
    p.run();
    assert!(!withdrawn(&p, Side::A, ga), "B's RMB is still known");
    assert!(!withdrawn(&p, Side::B, gb), "B's RMB is still B's");
    let g = p.b.ep.link_group(gb).expect("group");
    assert!(g.peer_rmbs.iter().all(|r| r.tokens.is_empty()));
    assert_eq!(g.local_rmbs.len(), 1);
    let n = p.act(Side::B, |ep, res, now| ep.delete_unused_rmbs(gb, res, now));
    assert_eq!(n, 1);
    p.run();
    assert!(withdrawn(&p, Side::A, ga));
    assert!(withdrawn(&p, Side::B, gb));
}

/// An RMB a connection still uses is not withdrawn, and a group with a connection is not done.
#[test]
fn rmbs_in_use_stay() {
    let (mut p, ga, gb) = closed_pair(2, 23);
    p.connect(TcpId(5));
    p.run();
    assert!(established(&p, Side::A, TcpId(5)));
    let before = p.trace.len();
    for (s, g) in [(Side::A, ga), (Side::B, gb)] {
        p.act(s, |ep, res, now| ep.withdraw_rmbs(g, res, now));
    }
    p.run();
    let flow: Vec<String> = p.trace[before..].iter().map(|e| e.to_string()).collect();
    // Of A's two RMBs, the one the new connection did not get goes; the new connection's
    // and B's one RMB (which all connections share) stay.
    assert_eq!(
        flow,
        ["A->B DELETE RKEY count=1", "B->A DELETE RKEY count=1 rsp"]
    );
    assert!(!withdrawn(&p, Side::A, ga));
    assert!(!withdrawn(&p, Side::B, gb));
    p.app_send(Side::A, TcpId(5), b"still fine");
    p.run();
    assert_eq!(p.b.rx[&TcpId(5)], b"still fine");
}

/// More RMBs than one DELETE RKEY names (8): one request per 8, one after the other (one
/// exchange at a time, §3.5.5.3).
#[test]
fn many_rmbs_take_several_requests() {
    let (mut p, ga, gb) = closed_pair(10, 24);
    assert_eq!(p.a.ep.link_group(ga).map(|g| g.local_rmbs.len()), Some(10));
    let before = p.trace.len();
    let n = p.act(Side::A, |ep, res, now| ep.withdraw_rmbs(ga, res, now));
    assert_eq!(n, 10);
    p.act(Side::B, |ep, res, now| ep.withdraw_rmbs(gb, res, now));
    p.run();
    let flow: Vec<String> = p.trace[before..]
        .iter()
        .map(|e| e.to_string())
        .filter(|l| l.starts_with("A->B DELETE RKEY") && !l.ends_with("rsp"))
        .collect();
    assert_eq!(
        flow,
        ["A->B DELETE RKEY count=8", "A->B DELETE RKEY count=2"]
    );
    assert!(withdrawn(&p, Side::A, ga));
    assert!(withdrawn(&p, Side::B, gb));
}
