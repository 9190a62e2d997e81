//! The RToken set stays in sync (RFC 7609 §3.5.5.2) while a first contact's ADD LINK exchange
//! overlaps subsequent contacts that create, or share, new RMBs on either side.
//!
//! After everything settles, every group on both sides must know every peer RMB on every
//! active link, and have every local RMB registered on every active link: otherwise a
//! connection cannot send over (or fail over to) some link of its group.

use std::collections::BTreeSet;

use super::*;
use crate::lgr_harness::{config, device, Rng};

/// A pair with `devs` RNICs per side whose RMBs hold `a_elems` (client) and `b_elems` (server)
/// 16 KiB elements, so that a few connections need new RMBs.
fn pair(devs: u8, a_elems: u32, b_elems: u32, seed: u64) -> EndpointPair {
    let mut a = config(Side::A, devs);
    a.rmb_pool.rmb_target_bytes = 16 * 1024 * a_elems;
    let mut b = config(Side::B, devs);
    b.rmb_pool.rmb_target_bytes = 16 * 1024 * b_elems;
    EndpointPair::new(a, b, seed)
}

/// The RToken-set invariant of every group on both sides (a description of the first
/// violation).
fn rtoken_sets_in_sync(p: &EndpointPair) -> Result<(), String> {
    for s in [Side::A, Side::B] {
        for g in p.host(s).ep.link_groups() {
            let active: Vec<u8> = g.active_links().map(|l| l.num).collect();
            //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.5.2
            //# Each RMB that is added to a link must be added to all links within the link
            //# group.
            for (id, r) in &g.local_rmbs {
                if let Some(n) = active.iter().find(|n| !r.tokens.contains_key(n)) {
                    return Err(format!("{s:?} {:?}: our {id:?} not on link {n}", g.id));
                }
            }
            let mut seen = BTreeSet::new();
            for (i, r) in g.peer_rmbs.iter().enumerate() {
                if r.tokens.is_empty() {
                    continue; // deleted (DELETE RKEY)
                }
                if let Some(n) = active.iter().find(|n| !r.tokens.contains_key(n)) {
                    return Err(format!(
                        "{s:?} {:?}: peer RMB {i} {:?} has no RToken on link {n}",
                        g.id, r.tokens
                    ));
                }
                for (n, t) in &r.tokens {
                    if !seen.insert((*n, t.rkey)) {
                        return Err(format!(
                            "{s:?} {:?}: peer RMB {i} recorded twice (rkey {:#x} on link {n})",
                            g.id, t.rkey
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

/// Every connection is established on both sides, its send link is active, and data flows
/// both ways byte-exact.
fn all_connections_work(p: &mut EndpointPair, tcps: &[TcpId]) -> Result<(), String> {
    for &tcp in tcps {
        for s in [Side::A, Side::B] {
            if !established(p, s, tcp) {
                return Err(format!(
                    "{s:?} {tcp:?} not established: {:?}",
                    reset(p, s, tcp)
                ));
            }
            let (lgr, link) = p
                .host(s)
                .ep
                .connection_link(tcp)
                .ok_or_else(|| format!("{s:?} {tcp:?}: no connection"))?;
            let g = p.host(s).ep.link_group(lgr).ok_or("group gone")?;
            if !g.active_links().any(|l| l.num == link) {
                return Err(format!("{s:?} {tcp:?} sends over inactive link {link}"));
            }
        }
    }
    for &tcp in tcps {
        let fill = tcp.0 as u8;
        p.app_send(Side::A, tcp, &vec![fill; 20_000]);
        p.app_send(Side::B, tcp, &vec![!fill; 20_000]);
    }
    p.run();
    for &tcp in tcps {
        let fill = tcp.0 as u8;
        if p.b.rx.get(&tcp) != Some(&vec![fill; 20_000]) {
            return Err(format!("{tcp:?}: A->B data lost"));
        }
        if p.a.rx.get(&tcp) != Some(&vec![!fill; 20_000]) {
            return Err(format!("{tcp:?}: B->A data lost"));
        }
    }
    Ok(())
}

/// More connections join the first contact: the `i`th after `gaps[i]` more deliveries (a
/// large first gap lets the first contact's ADD LINK exchange finish); a check of
/// everything once it settles.
fn overlap(a_elems: u32, b_elems: u32, gaps: &[u64], seed: u64) -> Result<(), String> {
    let mut p = pair(2, a_elems, b_elems, seed);
    p.connect(T1);
    let mut tcps = vec![T1];
    for (i, gap) in gaps.iter().enumerate() {
        for _ in 0..*gap {
            p.deliver_next();
        }
        let tcp = TcpId(i as u64 + 2);
        p.connect(tcp);
        tcps.push(tcp);
    }
    p.run();
    rtoken_sets_in_sync(&p)?;
    all_connections_work(&mut p, &tcps)?;
    rtoken_sets_in_sync(&p)
}

/// Once the group has its two links, six connections arrive at once on a server whose RMBs
/// hold two elements: the third connection's new RMB is confirmed (CONFIRM RKEY) while the
/// fourth takes its other element, and the fifth's new RMB waits behind that exchange while
/// the sixth takes its other element. No connection may use an RMB before the peer knows it
/// on every link.
#[test]
fn server_rmb_being_confirmed_shared_by_another_connection() {
    assert_eq!(overlap(1, 2, &[1000, 0, 0, 0, 0, 0], 1), Ok(()));
}

/// The same on the client (its RMBs hold two elements; the server's eight, so its Accepts
/// come at once).
#[test]
fn client_rmb_being_confirmed_shared_by_another_connection() {
    assert_eq!(overlap(2, 8, &[1000, 0, 0, 0, 0, 0], 1), Ok(()));
}

/// Both sides add RMBs of two elements at once.
#[test]
fn both_sides_share_rmbs_being_confirmed() {
    assert_eq!(overlap(2, 2, &[1000, 0, 0, 0, 0, 0], 1), Ok(()));
}

/// One RNIC per side: the group has one link until both get a second RNIC (App. C.8) after
/// `late` deliveries, and the server's ADD LINK exchange for it overlaps connections joining
/// `gaps[i]` deliveries apart (and their CONFIRM RKEY exchanges, which collide with it).
fn late_second_link(
    a_elems: u32,
    b_elems: u32,
    late: u64,
    gaps: &[u64],
    seed: u64,
) -> Result<(), String> {
    let mut p = pair(1, a_elems, b_elems, seed);
    p.connect(T1);
    p.run();
    let mut tcps = vec![T1];
    let mut step = 0;
    for (i, gap) in gaps.iter().enumerate() {
        for _ in 0..*gap {
            if step == late {
                p.act(Side::A, |ep, res, now| {
                    ep.add_device(device(Side::A, 1), res, now)
                });
                p.act(Side::B, |ep, res, now| {
                    ep.add_device(device(Side::B, 1), res, now)
                });
            }
            step += 1;
            p.deliver_next();
        }
        let tcp = TcpId(i as u64 + 2);
        p.connect(tcp);
        tcps.push(tcp);
    }
    if step <= late {
        p.act(Side::A, |ep, res, now| {
            ep.add_device(device(Side::A, 1), res, now)
        });
        p.act(Side::B, |ep, res, now| {
            ep.add_device(device(Side::B, 1), res, now)
        });
    }
    p.run();
    let links = |s| p.host(s).ep.link_groups().map(|g| g.active_count()).min();
    if links(Side::A) != Some(2) || links(Side::B) != Some(2) {
        return Err(format!("no second link: {:?}", p.flow(true)));
    }
    rtoken_sets_in_sync(&p)?;
    all_connections_work(&mut p, &tcps)?;
    rtoken_sets_in_sync(&p)
}

/// Seeded interleavings: small RMBs on either side or both, connections joining before,
/// during and after the first contact's ADD LINK exchange.
#[test]
fn rtoken_sets_stay_in_sync_over_interleavings() {
    let runs: u64 = std::env::var("SMC_RTOKEN_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let mut failures = Vec::new();
    for seed in 0..runs {
        let mut rng = Rng::new(seed);
        let elems = [1, 2, 3, 8];
        let a_elems = elems[rng.below(4) as usize];
        let b_elems = elems[rng.below(4) as usize];
        // The first joins before, during or after the first contact's ADD LINK exchange;
        // the others follow closely.
        let mut gaps = vec![rng.below(40)];
        gaps.extend((0..6).map(|_| rng.below(4).saturating_sub(1)));
        if let Err(e) = overlap(a_elems, b_elems, &gaps, seed) {
            failures.push(format!("seed {seed} ({a_elems},{b_elems},{gaps:?}): {e}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} failures: {:#?}",
        failures.len(),
        failures
    );
}

/// Seeded interleavings of a later ADD LINK exchange (second RNICs) with subsequent contacts.
#[test]
fn rtoken_sets_stay_in_sync_when_a_link_is_added_later() {
    let runs: u64 = std::env::var("SMC_RTOKEN_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let mut failures = Vec::new();
    for seed in 0..runs {
        let mut rng = Rng::new(seed ^ 0x1A7E);
        let elems = [1, 2, 3, 8];
        let a_elems = elems[rng.below(4) as usize];
        let b_elems = elems[rng.below(4) as usize];
        let gaps: Vec<u64> = (0..7).map(|_| rng.below(5)).collect();
        let late = rng.below(gaps.iter().sum::<u64>() + 1);
        if let Err(e) = late_second_link(a_elems, b_elems, late, &gaps, seed) {
            failures.push(format!(
                "seed {seed} ({a_elems},{b_elems},{late},{gaps:?}): {e}"
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} failures: {:#?}",
        failures.len(),
        failures
    );
}

/// A peer that names an RMB in CLC before confirming it: its CONFIRM RKEY completes the
/// record the connections already use instead of adding a second one.
#[test]
fn confirm_rkey_for_an_rmb_known_on_its_link_completes_that_record() {
    use smc_wire::llc::{ConfirmRkey, LinkRtoken};
    let mut p = pair(2, 8, 8, 1);
    p.connect(T1);
    p.run();
    let g = p.a.ep.link_groups().next().expect("group");
    assert_eq!(g.peer_rmbs.len(), 1);
    let known = g.peer_rmbs[0].tokens[&1];
    let mut others = [LinkRtoken::default(); 2];
    others[0] = LinkRtoken {
        link_num: 2,
        rkey: 0x4242,
        vaddr: 0x9000,
    };
    let msg = smc_wire::LlcMessage::ConfirmRkey(ConfirmRkey {
        num_tokens: 1,
        rkey: known.rkey,
        vaddr: known.vaddr,
        others,
        ..ConfirmRkey::default()
    });
    let l1 = p.a.link(1).expect("link 1");
    p.inject_llc(Side::A, l1, msg);
    p.run();
    assert!(p.sent("A->B CONFIRM RKEY others=1 rsp"));
    let g = p.a.ep.link_groups().next().expect("group");
    assert_eq!(g.peer_rmbs.len(), 1, "{:?}", g.peer_rmbs);
    assert_eq!(g.peer_rmbs[0].tokens[&2].rkey, 0x4242);
    assert_eq!(g.active_count(), 2);
}
