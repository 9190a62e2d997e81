//! Failover (§2.3, §4.6), DELETE LINK, keepalive (§4.5.3).

use std::time::Duration;

use super::*;
use crate::conn::{AbortReason, ConnError};
use crate::lgr_harness::{config, Rng, Traced};

fn pattern(len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(salt))
        .collect()
}

/// Two links, two connections, data both ways; link `link` killed after `kill_at` delivered
/// items. Asserts exact delivery; returns the pair.
fn run_failover(seed: u64, kill_at: usize, bytes: usize, link: u8) -> EndpointPair {
    // Half the runs send as the runtime does on shm: WRITEs executed at post, no replay copy.
    run_failover_with(seed, kill_at, bytes, link, |p| {
        p.knobs.direct_writes = seed % 4 >= 2
    })
}

/// [`run_failover`] with the harness's knobs set by `knobs`.
fn run_failover_with(
    seed: u64,
    kill_at: usize,
    bytes: usize,
    link: u8,
    knobs: impl FnOnce(&mut EndpointPair),
) -> EndpointPair {
    let mut p = EndpointPair::new(config(Side::A, 2), config(Side::B, 2), seed);
    // Completions late or not: SS lags behind what the peer received by varying amounts.
    p.knobs.completion_delay = Duration::from_micros([0, 25, 400][(seed % 3) as usize]);
    knobs(&mut p);
    p.connect(T1);
    p.run();
    p.connect(TcpId(2));
    p.run();
    assert!(established(&p, Side::A, T1) && established(&p, Side::A, TcpId(2)));
    let a = pattern(bytes, 1);
    let b = pattern(bytes, 2);
    for t in [T1, TcpId(2)] {
        p.app_send(Side::A, t, &a);
        p.app_send(Side::B, t, &b);
    }
    for _ in 0..kill_at {
        if !p.deliver_next() {
            break;
        }
    }
    let victim = if seed.is_multiple_of(2) {
        Side::A
    } else {
        Side::B
    };
    if let Some(l) = p.host(victim).link(link) {
        p.kill_link(victim, l);
    }
    p.run_for(Duration::from_secs(5));
    for t in [T1, TcpId(2)] {
        assert_eq!(
            p.b.rx.get(&t).map(Vec::len),
            Some(a.len()),
            "seed {seed} kill_at {kill_at} {t:?} A->B"
        );
        assert!(
            p.b.rx[&t] == a,
            "seed {seed} kill_at {kill_at}: A->B bytes differ"
        );
        assert_eq!(
            p.a.rx.get(&t).map(Vec::len),
            Some(b.len()),
            "seed {seed} kill_at {kill_at} {t:?} B->A"
        );
        assert!(
            p.a.rx[&t] == b,
            "seed {seed} kill_at {kill_at}: B->A bytes differ"
        );
    }
    for s in [Side::A, Side::B] {
        assert_senders_counted(&p, s);
    }
    p
}

/// The flow of a failover: validation CDC with F flag on the surviving link, replay, DELETE
/// LINK from the server, and data keeps flowing.
#[test]
fn failover_moves_connections_and_replays() {
    let p = run_failover(3, 40, 60_000, 1);
    assert!(p
        .trace
        .iter()
        .any(|e| matches!(&e.what, Traced::Cdc(_, c) if c.prod_flags.failover_validation)));
    let flow = p.flow(true);
    assert!(
        flow.iter().any(|l| l == "B->A DELETE LINK link=1"),
        "{flow:#?}"
    );
    for s in [Side::A, Side::B] {
        assert!(p.host(s).ep.stats().failovers > 0 || p.host(s).ep.connection_link(T1).is_some());
        assert!(p
            .host(s)
            .saw(|e| matches!(e, EndpointEvent::LinkDown { num: 1, .. })));
    }
}

/// 1000 seeded runs (override with `SMC_FAILOVER_RUNS`): link 1 or 2 dies at a random point,
/// seen first by a random side; every byte arrives exactly once and in order, both ways, on both
/// connections.
#[test]
fn failover_seeded_runs_deliver_exactly_once_in_order() {
    let runs: u64 = std::env::var("SMC_FAILOVER_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let mut rng = Rng::new(0xF00D);
    for seed in 0..runs {
        let kill_at = rng.below(600) as usize;
        let bytes = 20_000 + rng.below(40_000) as usize;
        let link = 1 + rng.below(2) as u8;
        run_failover(seed, kill_at, bytes, link);
    }
}

/// As the roce fabric sends: every WRITE only posted (none placed at post), from its piece's
/// shared bytes, which the engine keeps for replay instead of a copy of its own. A link dies
/// at a random point with WRITEs and CDCs in flight: the replay from the shared buffers
/// delivers every byte exactly once and in order, both ways, on both connections.
#[test]
fn failover_replays_shared_bytes_exactly() {
    let mut rng = Rng::new(0x5EED);
    let mut failovers = 0;
    for seed in 0..200u64 {
        let kill_at = rng.below(600) as usize;
        let bytes = 20_000 + rng.below(40_000) as usize;
        let link = 1 + rng.below(2) as u8;
        let p = run_failover_with(seed, kill_at, bytes, link, |p| {
            p.knobs.direct_writes = true;
            p.knobs.all_posted = true;
        });
        failovers += p.a.ep.stats().failovers + p.b.ep.stats().failovers;
    }
    assert!(
        failovers >= 200,
        "connections moved with bytes to replay: {failovers}"
    );
}

/// As the roce fabric sends (every WRITE posted from shared bytes): a connection that writes
/// nothing for `ARENA_IDLE` lets go of its arena and pool (counted once); one that goes on
/// writing keeps them; the next bytes after a trim arrive right.
#[test]
fn an_idle_connection_lets_go_of_its_arena() {
    let mut p = EndpointPair::new(config(Side::A, 1), config(Side::B, 1), 7);
    p.knobs.direct_writes = true;
    p.knobs.all_posted = true;
    p.connect(T1);
    p.run();
    assert!(established(&p, Side::A, T1));
    let a = pattern(100_000, 1);
    p.app_send(Side::A, T1, &a);
    p.run();
    assert_eq!(p.b.rx.get(&T1).map(Vec::len), Some(a.len()));
    assert_eq!(p.a.ep.stats().arenas_trimmed, 0);
    // Writing on, well within the idle time: nothing trimmed.
    for i in 0..5u8 {
        p.run_for(Duration::from_millis(300));
        p.app_send(Side::A, T1, &pattern(20_000, i));
        p.run();
    }
    assert_eq!(p.a.ep.stats().arenas_trimmed, 0);
    p.run_for(Duration::from_secs(2));
    assert_eq!(p.a.ep.stats().arenas_trimmed, 1);
    // B wrote nothing: it never had an arena to let go of.
    assert_eq!(p.b.ep.stats().arenas_trimmed, 0);
    let more = pattern(70_000, 9);
    p.app_send(Side::A, T1, &more);
    p.run_for(Duration::from_secs(2));
    let rx = &p.b.rx[&T1];
    assert_eq!(&rx[rx.len() - more.len()..], &more[..]);
    assert_eq!(p.a.ep.stats().arenas_trimmed, 2);
}

/// One link only: when it dies every connection is reset with a clear error.
#[test]
fn last_link_failure_resets_connections() {
    let mut p = EndpointPair::with_devices(1, 1);
    p.connect(T1);
    p.run();
    p.app_send(Side::A, T1, &pattern(50_000, 3));
    for _ in 0..10 {
        p.deliver_next();
    }
    let l1 = p.a.link(1).expect("link");
    p.kill_link(Side::A, l1);
    p.run();
    for s in [Side::A, Side::B] {
        assert!(p.host(s).saw(|e| matches!(
            e,
            EndpointEvent::Conn {
                event: crate::conn::Event::Failed(ConnError::Reset(AbortReason::LinkGroupLost)),
                ..
            }
        )));
        assert!(p
            .host(s)
            .saw(|e| matches!(e, EndpointEvent::LinkGroupTerminated { .. })));
        assert_eq!(p.host(s).ep.link_groups().count(), 0);
    }
}

/// A failover validation CDC (F flag) with sequence number `ss`, for connection T1 of side B.
fn validation(p: &EndpointPair, ss: u16) -> smc_wire::CdcMessage {
    let c = p.b.ep.connection(T1).expect("conn");
    smc_wire::CdcMessage {
        seqno: ss,
        alert_token: c.config().local_alert_token,
        producer: Default::default(),
        consumer: Default::default(),
        prod_flags: smc_wire::ProducerFlags {
            failover_validation: true,
            ..Default::default()
        },
        conn_flags: Default::default(),
    }
}

fn data_loss_reset(p: &EndpointPair) -> bool {
    p.b.saw(|e| {
        matches!(
            e,
            EndpointEvent::Conn {
                event: crate::conn::Event::Failed(ConnError::Reset(AbortReason::FailoverDataLoss)),
                ..
            }
        )
    })
}

/// §4.6.1: a validation CDC whose sequence number stays above SR resets the connection —
/// once the wait for the CDCs still queued on the failed link is over.
#[test]
fn validation_above_sr_resets() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect(T1);
    p.run();
    let sr =
        p.b.ep
            .connection(T1)
            .and_then(|c| c.sequence_received())
            .unwrap_or(0);
    let forged = validation(&p, sr.wrapping_add(5));
    let l2 = p.b.link(2).expect("link 2");
    let now = p.now;
    p.b.ep
        .handle_message(l2, &forged.to_bytes(), &mut p.b.res, now);
    p.flush();
    assert!(!data_loss_reset(&p), "reset before the wait ended");
    let c = p.b.ep.connection(T1).expect("conn");
    assert_eq!(c.stats().failover_validations_held, 1);
    p.run_for(c.config().validation_wait + Duration::from_millis(10));
    assert!(data_loss_reset(&p));
}

/// The CDC the validation counts on arrives after it (it sat in the failed link's receive
/// queue, handled after the new link's): SR reaches SS, nothing is reset.
#[test]
fn validation_ahead_of_a_late_cdc_waits_for_it() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect(T1);
    p.run();
    // A sends a little; its CDC is held back from B (still queued on the "failed" link).
    p.app_send(Side::A, T1, b"late but not lost");
    let late = p.take_cdc_from(Side::A).expect("A's CDC");
    let seq = smc_wire::CdcMessage::parse(&late).expect("cdc").seqno;
    let forged = validation(&p, seq);
    let l1 = p.b.link(1).expect("link 1");
    let l2 = p.b.link(2).expect("link 2");
    let now = p.now;
    p.b.ep
        .handle_message(l2, &forged.to_bytes(), &mut p.b.res, now);
    p.b.ep.handle_message(l1, &late, &mut p.b.res, now);
    p.flush();
    let c = p.b.ep.connection(T1).expect("conn");
    assert_eq!(c.stats().failover_validations_held, 1);
    p.run_for(c.config().validation_wait * 2);
    assert!(!data_loss_reset(&p));
    assert_eq!(
        p.b.ep.connection(T1).map(|c| c.stats().bytes_received),
        Some(b"late but not lost".len() as u64)
    );
}

/// Server-initiated DELETE LINK of one link (orderly): connections move, the link goes.
#[test]
fn server_deletes_one_link_orderly() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect(T1);
    p.run();
    let lgr = p.b.ep.link_groups().next().map(|g| g.id).expect("group");
    let before = p.trace.len();
    p.act(Side::B, |ep, res, now| {
        ep.request_delete_link(lgr, 1, true, res, now)
    })
    .expect("delete");
    p.run();
    let flow: Vec<String> = p.trace[before..]
        .iter()
        .filter(|e| matches!(e.what, Traced::Llc(..)))
        .map(|e| e.to_string())
        .collect();
    assert_eq!(
        flow,
        ["B->A DELETE LINK link=1", "A->B DELETE LINK link=1 rsp"]
    );
    for s in [Side::A, Side::B] {
        let g = p.host(s).ep.link_groups().next().expect("group");
        assert_eq!(g.links.keys().copied().collect::<Vec<_>>(), [2]);
    }
    p.app_send(Side::A, T1, b"after delete");
    p.run();
    assert_eq!(p.b.rx[&T1], b"after delete");
}

/// Client-initiated DELETE LINK (Fig. 11): the client asks, the server deletes.
#[test]
fn client_requests_delete_link() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect(T1);
    p.run();
    let lgr = p.a.ep.link_groups().next().map(|g| g.id).expect("group");
    let before = p.trace.len();
    p.act(Side::A, |ep, res, now| {
        ep.request_delete_link(lgr, 2, true, res, now)
    })
    .expect("delete");
    p.run();
    let flow: Vec<String> = p.trace[before..]
        .iter()
        .filter(|e| matches!(e.what, Traced::Llc(..)))
        .map(|e| e.to_string())
        .collect();
    assert_eq!(
        flow,
        [
            "A->B DELETE LINK link=2",
            "B->A DELETE LINK link=2",
            "A->B DELETE LINK link=2 rsp",
        ]
    );
}

/// DELETE LINK for the whole group (operator): every connection is reset on both sides.
#[test]
fn delete_all_links_terminates_group() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect(T1);
    p.run();
    let lgr = p.b.ep.link_groups().next().map(|g| g.id).expect("group");
    p.act(Side::B, |ep, _, now| ep.terminate_link_group(lgr, now));
    p.run();
    assert_eq!(
        p.flow(true)
            .iter()
            .filter(|l| l.contains("DELETE LINK all"))
            .count(),
        1
    );
    for s in [Side::A, Side::B] {
        assert_eq!(p.host(s).ep.link_groups().count(), 0);
        assert!(p
            .host(s)
            .saw(|e| matches!(e, EndpointEvent::LinkGroupTerminated { .. })));
    }
}

/// Keepalive: an idle link gets a TEST LINK; the reply keeps it up.
#[test]
fn keepalive_test_link_on_idle_link() {
    let mut a = config(Side::A, 1);
    a.keepalive = Some(Duration::from_secs(5));
    let mut p = EndpointPair::new(a, config(Side::B, 1), 1);
    p.connect(T1);
    p.run();
    p.run_for(Duration::from_secs(6));
    let flow = p.flow(false);
    assert!(flow.contains(&"A->B TEST LINK".to_string()), "{flow:#?}");
    assert!(flow.contains(&"B->A TEST LINK rsp".to_string()));
    assert!(p
        .a
        .ep
        .link_groups()
        .next()
        .is_some_and(|g| g.active_count() == 1));
}

/// Keepalive: a link that stays silent after a TEST LINK was answered is tested again every
/// interval, not only after the next message that arrives (a sender whose peer stopped
/// reading and then died would otherwise never learn of it).
#[test]
fn keepalive_keeps_testing_a_silent_link() {
    let mut a = config(Side::A, 1);
    a.keepalive = Some(Duration::from_secs(2));
    let mut p = EndpointPair::new(a, config(Side::B, 1), 1);
    p.connect(T1);
    p.run();
    // (The server's ADD LINK attempts, every 10 s here, are the only other messages.)
    p.run_for(Duration::from_secs(21));
    let flow = p.flow(false);
    let tests = flow.iter().filter(|f| *f == "A->B TEST LINK").count();
    let replies = flow.iter().filter(|f| *f == "B->A TEST LINK rsp").count();
    assert!(
        tests >= 6 && replies == tests,
        "{tests} TEST LINKs, {replies} replies: {flow:#?}"
    );
    // Then the peer goes silent for good: the next TEST LINK finds it gone.
    p.knobs.drop = Some(Box::new(
        |e| matches!(&e.what, Traced::Llc(_, smc_wire::LlcMessage::TestLink(t)) if t.reply),
    ));
    p.run_for(Duration::from_secs(8));
    assert!(p
        .a
        .saw(|e| matches!(e, EndpointEvent::LinkGroupTerminated { .. })));
}

/// Keepalive: no TEST LINK reply → the link failed → failover to the other link.
#[test]
fn keepalive_no_reply_fails_over() {
    let mut a = config(Side::A, 2);
    a.keepalive = Some(Duration::from_secs(5));
    let mut p = EndpointPair::new(a, config(Side::B, 2), 1);
    p.connect(T1);
    p.run();
    p.knobs.drop = Some(Box::new(
        |e| matches!(&e.what, Traced::Llc(_, smc_wire::LlcMessage::TestLink(t)) if t.reply),
    ));
    p.run_for(Duration::from_secs(8));
    p.knobs.drop = None;
    p.run();
    assert!(p.a.saw(|e| matches!(e, EndpointEvent::LinkDown { .. })));
    p.app_send(Side::A, T1, b"still alive");
    p.run();
    assert_eq!(p.b.rx[&T1], b"still alive");
}

/// Keepalive on the last link: no reply → every connection is reset.
#[test]
fn keepalive_no_reply_on_last_link_resets() {
    let mut a = config(Side::A, 1);
    a.keepalive = Some(Duration::from_secs(5));
    let mut p = EndpointPair::new(a, config(Side::B, 1), 1);
    p.knobs.deliver_tcp_rst = false;
    p.connect(T1);
    p.run();
    p.knobs.drop = Some(Box::new(
        |e| matches!(&e.what, Traced::Llc(_, smc_wire::LlcMessage::TestLink(t)) if t.reply),
    ));
    p.run_for(Duration::from_secs(8));
    assert!(p.a.saw(|e| matches!(
        e,
        EndpointEvent::Conn {
            event: crate::conn::Event::Failed(ConnError::Reset(AbortReason::LinkGroupLost)),
            ..
        }
    )));
}

/// The server terminates a link group that stayed without connections for the idle time.
#[test]
fn idle_link_group_terminated_by_server() {
    let mut p = EndpointPair::with_devices(1, 1);
    p.connect(T1);
    p.run();
    p.act(Side::A, |ep, _, now| ep.close(T1, now))
        .expect("close");
    p.act(Side::B, |ep, _, now| ep.close(T1, now))
        .expect("close");
    p.run();
    p.run_for(Duration::from_secs(601));
    assert!(p.flow(true).contains(&"B->A DELETE LINK all".to_string()));
    assert_eq!(p.a.ep.link_groups().count(), 0);
    assert_eq!(p.b.ep.link_groups().count(), 0);
}

/// Link 1 dies; the server re-adds a link after the C.8 retry time (RTokens exchanged for
/// every RMB); then link 2 dies too: the connections survive on the new link.
#[test]
fn second_failure_after_link_readded() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect(T1);
    p.run();
    let a = pattern(30_000, 5);
    p.app_send(Side::A, T1, &a);
    for _ in 0..20 {
        p.deliver_next();
    }
    let l1 = p.b.link(1).expect("link 1");
    p.kill_link(Side::B, l1);
    p.run_for(Duration::from_secs(11));
    let nums: Vec<u8> =
        p.b.ep
            .link_groups()
            .next()
            .map(|g| g.links.keys().copied().collect())
            .unwrap_or_default();
    assert_eq!(nums, [2, 3], "link 3 added by the retry timer");
    let l2 = p.b.link(2).expect("link 2");
    let b = pattern(30_000, 6);
    p.app_send(Side::B, T1, &b);
    for _ in 0..20 {
        p.deliver_next();
    }
    p.kill_link(Side::B, l2);
    p.run_for(Duration::from_secs(1));
    assert_eq!(p.b.rx[&T1], a);
    assert_eq!(p.a.rx[&T1], b);
    for s in [Side::A, Side::B] {
        assert_eq!(p.host(s).ep.connection_link(T1).map(|x| x.1), Some(3));
        assert_senders_counted(&p, s);
    }
}

/// Each side spreads its connections over the links by the number sending on each (§2.3),
/// counted as they are established, moved by a failover and closed.
#[test]
fn connections_spread_by_senders_counted_per_link() {
    let mut p = EndpointPair::with_devices(2, 2);
    let tcps: Vec<TcpId> = (1..=6).map(TcpId).collect();
    for t in &tcps {
        p.connect(*t);
        p.run();
    }
    for s in [Side::A, Side::B] {
        assert_senders_counted(&p, s);
        let g = p.host(s).ep.link_groups().next().expect("group");
        assert_eq!((g.senders_on(1), g.senders_on(2)), (3, 3), "{s:?}");
    }
    // Two connections close on both sides: the counts follow.
    for t in [TcpId(1), TcpId(3)] {
        for s in [Side::A, Side::B] {
            p.act(s, |ep, _, now| ep.close(t, now)).expect("close");
        }
    }
    p.run();
    for s in [Side::A, Side::B] {
        assert_senders_counted(&p, s);
        let g = p.host(s).ep.link_groups().next().expect("group");
        assert_eq!(g.senders_on(1) + g.senders_on(2), 4, "{s:?}");
    }
    // Link 1 dies: every connection sends on link 2.
    let l1 = p.b.link(1).expect("link 1");
    p.kill_link(Side::B, l1);
    p.run_for(Duration::from_secs(1));
    for s in [Side::A, Side::B] {
        assert_senders_counted(&p, s);
        let g = p.host(s).ep.link_groups().next().expect("group");
        assert_eq!((g.senders_on(1), g.senders_on(2)), (0, 4), "{s:?}");
    }
}

/// A CDC that arrived on a link before it failed is handled after the link's removal (the
/// failed link's receive queue drains after the surviving one's): its bytes count, nothing
/// is reset.
#[test]
fn cdc_queued_on_a_removed_link_still_counts() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect(T1);
    p.run();
    // A sends on link 1; B knows that link under its own id.
    let on = p.b.link(1).expect("link 1 at B");
    p.app_send(Side::A, T1, b"sent before the failure");
    let late = p.take_cdc_from(Side::A).expect("A's CDC");
    let seq = smc_wire::CdcMessage::parse(&late).expect("cdc").seqno;
    // B loses link 1 (and fails over) before it handles the CDC that came on it.
    let l1_a = p.a.link(1).expect("link 1 at A");
    p.kill_link(Side::A, l1_a);
    p.run();
    assert!(p.b.link(1).is_none(), "link 1 still known at B");
    let now = p.now;
    p.b.ep.handle_message(on, &late, &mut p.b.res, now);
    p.flush();
    p.run_for(Duration::from_secs(3));
    assert!(!data_loss_reset(&p));
    assert_eq!(p.b.ep.stats().cdc_on_retired_link, 1);
    let c = p.b.ep.connection(T1).expect("conn");
    assert!(c
        .sequence_received()
        .is_some_and(|sr| sr.wrapping_sub(seq) as i16 >= 0));
    assert_eq!(
        c.stats().bytes_received,
        b"sent before the failure".len() as u64
    );
}

/// A subsequent contact's Confirm names the client's link that fails at the server while the
/// Confirm is in flight: the server runs the connection on the surviving link (the client's
/// RMB is known there) instead of resetting it.
#[test]
fn confirm_naming_a_link_that_just_failed_uses_the_surviving_one() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect(T1);
    p.run();
    assert_eq!(p.b.ep.link_groups().next().map(|g| g.links.len()), Some(2));
    p.connect(T2);
    let confirm = p
        .hold_clc_to(Side::B, smc_wire::ClcType::CONFIRM)
        .expect("the client's Confirm");
    let (msg, _) = smc_wire::ClcMessage::parse(&confirm).expect("parse");
    let smc_wire::ClcMessage::Confirm(c) = msg else {
        panic!("not a Confirm");
    };
    // The server's link whose peer QP the Confirm names fails now.
    let g = p.b.ep.link_groups().next().expect("group");
    let named = g
        .links
        .values()
        .find(|l| l.remote.is_some_and(|r| r.qpn == c.qp_num))
        .map(|l| l.num)
        .expect("named link");
    let id = p.b.link(named).expect("id");
    p.kill_link(Side::B, id);
    p.run();
    assert!(
        p.b.ep.connection(T2).is_some(),
        "the server reset the connection"
    );
    p.app_send(Side::A, T2, b"over the other link");
    p.run();
    assert_eq!(
        p.b.ep.connection(T2).map(|c| c.stats().bytes_received),
        Some(b"over the other link".len() as u64)
    );
}

/// A subsequent contact's Accept names the server's link that fails at the client while the
/// Accept is in flight: the client uses the surviving link (the server's RMB is known there)
/// instead of declining; no Decline with the out-of-sync flag ends the group.
#[test]
fn accept_naming_a_link_that_just_failed_uses_the_surviving_one() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect(T1);
    p.run();
    p.connect(T2);
    let accept = p
        .hold_clc_to(Side::A, smc_wire::ClcType::ACCEPT)
        .expect("the server's Accept");
    let (msg, _) = smc_wire::ClcMessage::parse(&accept).expect("parse");
    let smc_wire::ClcMessage::Accept(a) = msg else {
        panic!("not an Accept");
    };
    let g = p.a.ep.link_groups().next().expect("group");
    let named = g
        .links
        .values()
        .find(|l| l.remote.is_some_and(|r| r.qpn == a.qp_num))
        .map(|l| l.num)
        .expect("named link");
    let id = p.a.link(named).expect("id");
    p.kill_link(Side::A, id);
    p.run();
    assert!(p.a.ep.connection(T2).is_some(), "the client fell back");
    assert!(
        p.b.ep.connection(T1).is_some(),
        "the first connection is gone"
    );
    p.app_send(Side::A, T2, b"over the other link");
    p.run();
    assert_eq!(
        p.b.ep.connection(T2).map(|c| c.stats().bytes_received),
        Some(b"over the other link".len() as u64)
    );
}

/// The passive closer's PeerConnectionClosed is lost with a link that fails before its send
/// completed: the connection, Closed for the application, is held until that CDC completes,
/// so the failover sends it again and the active closer closes at once (not after its close
/// timer), in order; then both release the connection.
#[test]
fn a_lost_closing_cdc_of_the_passive_closer_goes_out_again_after_a_failover() {
    let closed = |p: &EndpointPair, s: Side| {
        p.host(s).saw(|e| {
            matches!(
                e,
                EndpointEvent::Conn {
                    tcp: T1,
                    event: crate::conn::Event::Closed
                }
            )
        })
    };
    let mut p = EndpointPair::new(config(Side::A, 2), config(Side::B, 2), 7);
    p.connect(T1);
    p.run();
    assert!(established(&p, Side::A, T1));
    p.app_send(Side::A, T1, b"last words");
    p.run();
    // A closes first (active closer); B sees it, then closes too (passive closer).
    p.act(Side::A, |ep, _, now| ep.close(T1, now))
        .expect("close A");
    p.run();
    assert!(!closed(&p, Side::A));
    p.act(Side::B, |ep, _, now| ep.close(T1, now))
        .expect("close B");
    assert!(closed(&p, Side::B), "the passive closer is Closed at once");
    // B's closing CDC is lost with its link.
    let link = p.lose_cdc_from(Side::B).expect("B's closing CDC");
    assert!(
        p.b.ep.connection(T1).is_some(),
        "held until its closing CDC completes"
    );
    p.kill_link(Side::B, link);
    p.run_for(Duration::from_secs(1));
    assert!(closed(&p, Side::A), "A got the closing indication again");
    assert_eq!(p.a.rx.get(&T1).map(Vec::as_slice), None);
    assert_eq!(p.b.rx.get(&T1).map(Vec::as_slice), Some(&b"last words"[..]));
    assert!(
        !p.host(Side::A).saw(|e| matches!(
            e,
            EndpointEvent::Conn {
                tcp: T1,
                event: crate::conn::Event::Failed(_)
            }
        )),
        "an orderly close, no reset"
    );
    assert!(p.a.ep.connection(T1).is_none(), "A released it");
    assert!(p.b.ep.connection(T1).is_none(), "B released it");
    assert_eq!(p.b.ep.stats().closes_held, 1);
}
