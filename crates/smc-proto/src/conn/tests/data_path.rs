//! §4.5.1 window updates, B and R flags, §4.5.2 corking and coalescing, CDC sequence numbers.

use std::time::Duration;

use super::*;
use crate::conn::{
    window_update_needed, ApiError, Coalescing, ConnTimer, Connection, ConnectionConfig, Event,
    State,
};
use crate::harness::{Pair, Side, TOKEN_A, TOKEN_B};
use crate::time::Timestamp;

const K: u32 = 1024;

#[test]
fn window_rule_worked_examples() {
    // a. 64K buffer, sender window 50K: no update.
    assert!(!window_update_needed(64 * K, 50 * K, 64 * K));
    // b. sender window 30K, receiver window 31K: growth 1K < 6.4K, no update.
    assert!(!window_update_needed(64 * K, 30 * K, 31 * K));
    // c. sender window 30K, receiver window 64K: update.
    assert!(window_update_needed(64 * K, 30 * K, 64 * K));
    // Edges: exactly half is not "less than half"; exactly 10% growth is enough.
    assert!(!window_update_needed(100, 50, 100));
    assert!(window_update_needed(100, 49, 59));
    assert!(!window_update_needed(100, 49, 58));
}

fn pair64k() -> Pair {
    let mut p = Pair::symmetric(RmbeLayout::Linux, 64 * K);
    p.a.auto_read = false;
    p.b.auto_read = false;
    p
}

#[test]
fn worked_example_a_sender_window_50k_no_update() {
    let mut p = pair64k();
    p.app_send(Side::A, &stream(0, 14 * K as usize));
    p.pump(Side::A);
    deliver_cdc(&mut p, Side::B);
    assert_eq!(p.read(Side::B, usize::MAX), 14 * K as usize);
    assert!(p.wire.is_empty());
    assert_eq!(p.b.conn.stats().cdc_sent, 0);
}

#[test]
fn worked_examples_b_and_c() {
    let mut p = pair64k();
    p.app_send(Side::A, &stream(0, 34 * K as usize));
    p.pump(Side::A);
    deliver_cdc(&mut p, Side::B);
    // b. Consume 1K: receiver window 31K, sender window 30K: no update.
    assert_eq!(p.read(Side::B, K as usize), K as usize);
    assert!(p.wire.is_empty());
    // c. Consume the rest: receiver window 64K: update.
    assert_eq!(p.read(Side::B, usize::MAX), 33 * K as usize);
    let u = deliver_cdc(&mut p, Side::A);
    assert_eq!(u.consumer, Cursor::new(0, 34 * K));
    assert_eq!(p.a.conn.window(), 64 * K);
    assert_eq!(p.b.conn.stats().window_updates_sent, 1);
}

#[test]
fn consumer_cursor_rides_on_reverse_data() {
    let mut p = pair64k();
    p.app_send(Side::A, &stream(0, 100));
    p.pump(Side::A);
    deliver_cdc(&mut p, Side::B);
    p.read(Side::B, usize::MAX);
    assert!(p.wire.is_empty());
    p.app_send(Side::B, b"x");
    p.pump(Side::B);
    let m = deliver_cdc(&mut p, Side::A);
    assert_eq!(m.consumer, Cursor::new(0, 100));
    assert_eq!(p.a.conn.peer_consumer_cursor(), Cursor::new(0, 100));
    assert_eq!(p.b.conn.stats().window_updates_sent, 0);
}

#[test]
fn write_blocked_peer_gets_an_update_on_every_consumption() {
    let mut p = Pair::symmetric(RmbeLayout::Linux, 1000);
    p.a.auto_read = false;
    p.b.auto_read = false;
    p.app_send(Side::A, &stream(0, 1500));
    assert_eq!(p.pump(Side::A), 1000);
    let m = deliver_cdc(&mut p, Side::B);
    assert!(m.prod_flags.write_blocked);
    // Tiny consumptions would never pass the 10% rule, but B is set.
    for i in 1..=3u32 {
        assert_eq!(p.read(Side::B, 1), 1);
        let u = deliver_cdc(&mut p, Side::A);
        assert_eq!(u.consumer, Cursor::new(0, i));
    }
    // A writes 3 bytes; its CDC still carries B (500 bytes left, window full again).
    assert_eq!(p.pump(Side::A), 3);
    let m = deliver_cdc(&mut p, Side::B);
    assert!(m.prod_flags.write_blocked);
    // Consume enough to let A finish; A's next CDC clears B and B stops updating.
    assert_eq!(p.read(Side::B, 600), 600);
    deliver_cdc(&mut p, Side::A);
    assert_eq!(p.pump(Side::A), 497);
    let m = deliver_cdc(&mut p, Side::B);
    assert!(!m.prod_flags.write_blocked);
    assert_eq!(p.read(Side::B, 1), 1);
    assert!(p.wire.is_empty(), "no update once B is cleared");
}

#[test]
fn update_requested_flag_is_honoured() {
    let mut p = pair64k();
    p.app_send(Side::A, &stream(0, 100));
    p.pump(Side::A);
    deliver_cdc(&mut p, Side::B);
    p.read(Side::B, 10);
    assert!(p.wire.is_empty());
    // R with an unreported consumption: immediate update.
    p.a.conn.request_consumer_update().expect("active");
    p.flush(Side::A);
    let r = deliver_cdc(&mut p, Side::B);
    assert!(r.prod_flags.cons_update_requested);
    let u = deliver_cdc(&mut p, Side::A);
    assert_eq!(u.consumer, Cursor::new(0, 10));
    // R with nothing to report: the next consumption is reported, once.
    p.a.conn.request_consumer_update().expect("active");
    p.flush(Side::A);
    deliver_cdc(&mut p, Side::B);
    assert!(p.wire.is_empty());
    p.read(Side::B, 1);
    let u = deliver_cdc(&mut p, Side::A);
    assert_eq!(u.consumer, Cursor::new(0, 11));
    p.read(Side::B, 1);
    assert!(p.wire.is_empty());
}

#[test]
fn sequence_numbers_start_at_1_and_wrap_to_0() {
    let mut p = pair64k();
    let mut seen = Vec::new();
    for _ in 0..65_537u32 {
        p.a.conn.request_consumer_update().expect("active");
        let m = p.a.conn.poll_transmit().expect("a CDC");
        seen.push(m.seqno);
        let now = p.now;
        p.b.conn.handle_cdc(m, now);
        // Answer R so B stays in sync; drop B's replies.
        while p.b.conn.poll_transmit().is_some() {}
    }
    assert_eq!(seen[0], 1);
    assert_eq!(seen[65_534], 65_535);
    assert_eq!(seen[65_535], 0);
    assert_eq!(seen[65_536], 1);
    // B accepted every one of them across the wrap (serial number arithmetic).
    assert_eq!(p.b.conn.stats().cdc_stale, 0);
    assert_eq!(p.b.conn.stats().cdc_received, 65_537);
}

#[test]
fn stale_and_misrouted_cdcs_are_ignored() {
    let mut p = pair64k();
    p.app_send(Side::A, &stream(0, 100));
    p.pump(Side::A);
    let m = deliver_cdc(&mut p, Side::B);
    p.inject(Side::B, m);
    assert_eq!(p.b.conn.stats().cdc_stale, 1);
    let mut other = m;
    other.seqno = 9;
    other.alert_token = 0xDEAD;
    p.inject(Side::B, other);
    assert_eq!(p.b.conn.stats().cdc_wrong_token, 1);
    assert_eq!(p.b.conn.state(), State::Active);
    assert_eq!(p.b.conn.stats().aborts.total(), 0);
}

fn cfg(coalescing: Option<Coalescing>, nodelay: bool) -> Pair {
    let (mut a, b) = Pair::configs(RmbeLayout::Linux, 64 * K);
    a.coalescing = coalescing;
    a.nodelay = nodelay;
    let mut p = Pair::new(a, b);
    p.b.auto_read = false;
    p
}

const COALESCE: Coalescing = Coalescing {
    delay: Duration::from_millis(1),
    min_bytes: 1000,
    while_unconsumed: false,
};

#[test]
fn coalescing_holds_small_sends_until_threshold() {
    let mut p = cfg(Some(COALESCE), false);
    p.app_send(Side::A, &[1; 100]);
    p.pump(Side::A);
    p.app_send(Side::A, &[2; 100]);
    p.pump(Side::A);
    assert!(p.wire.is_empty());
    assert_eq!(
        p.a.conn.timer(ConnTimer::Flush),
        Some(Timestamp::ZERO + Duration::from_millis(1))
    );
    p.app_send(Side::A, &[3; 900]);
    p.pump(Side::A);
    let m = deliver_cdc(&mut p, Side::B);
    assert_eq!(m.producer, Cursor::new(0, 1100));
    assert_eq!(p.a.conn.stats().cdc_sent, 1);
    assert_eq!(p.a.conn.timer(ConnTimer::Flush), None);
}

/// The Nagle-like mode: an update is held only while bytes announced earlier are not
/// consumed; the peer's consumer cursor catching up releases it, and so does `flush`.
#[test]
fn coalescing_while_unconsumed_holds_only_behind_unconsumed_bytes() {
    let nagle = Coalescing {
        while_unconsumed: true,
        ..COALESCE
    };
    let mut p = cfg(Some(nagle), false);
    // Nothing outstanding: the first small send goes out at once.
    p.app_send(Side::A, &[1; 10]);
    p.pump(Side::A);
    assert_eq!(deliver_cdc(&mut p, Side::B).producer, Cursor::new(0, 10));
    // Behind 10 unconsumed bytes: held, with the flush timer armed.
    p.app_send(Side::A, &[2; 10]);
    p.pump(Side::A);
    assert!(p.wire.is_empty());
    assert!(p.a.conn.timer(ConnTimer::Flush).is_some());
    // B consumes and answers with data: its CDC carries consumer cursor 10, A caught up.
    assert_eq!(p.read(Side::B, 100), 10);
    p.app_send(Side::B, &[3; 1]);
    p.pump(Side::B);
    let m = deliver_cdc(&mut p, Side::A);
    assert_eq!(m.consumer, Cursor::new(0, 10));
    p.flush(Side::A);
    assert_eq!(deliver_cdc(&mut p, Side::B).producer, Cursor::new(0, 20));
    assert_eq!(p.a.conn.timer(ConnTimer::Flush), None);
    // Held again behind the unconsumed 10: an explicit flush releases it.
    p.app_send(Side::A, &[4; 10]);
    p.pump(Side::A);
    assert!(p.wire.is_empty());
    let now = p.now;
    p.a.conn.flush(now);
    p.flush(Side::A);
    assert_eq!(deliver_cdc(&mut p, Side::B).producer, Cursor::new(0, 30));
}

#[test]
fn coalescing_flush_timer_sends_eventually() {
    let mut p = cfg(Some(COALESCE), false);
    p.app_send(Side::A, &[1; 10]);
    p.pump(Side::A);
    assert!(p.wire.is_empty());
    p.drive();
    assert_eq!(p.b.conn.peer_producer_cursor(), Cursor::new(0, 10));
    assert_eq!(p.trace[0].at, Timestamp::ZERO + Duration::from_millis(1));
}

#[test]
fn nodelay_disables_coalescing() {
    let mut p = cfg(Some(COALESCE), true);
    p.app_send(Side::A, &[1; 10]);
    p.pump(Side::A);
    assert_eq!(deliver_cdc(&mut p, Side::B).producer, Cursor::new(0, 10));
    // Switching NODELAY off at run time re-enables it.
    let now = p.now;
    p.a.conn.set_nodelay(false, now);
    p.app_send(Side::A, &[1; 10]);
    p.pump(Side::A);
    assert!(p.wire.is_empty());
    let now = p.now;
    p.a.conn.set_nodelay(true, now);
    p.flush(Side::A);
    assert_eq!(deliver_cdc(&mut p, Side::B).producer, Cursor::new(0, 20));
}

#[test]
fn tcp_cork_holds_until_uncork_or_ceiling_even_with_nodelay() {
    let mut p = cfg(None, true);
    let now = p.now;
    p.a.conn.set_cork(true, now);
    p.app_send(Side::A, &[1; 10]);
    p.pump(Side::A);
    assert!(p.wire.is_empty());
    let now = p.now;
    p.a.conn.set_cork(false, now);
    p.flush(Side::A);
    assert_eq!(deliver_cdc(&mut p, Side::B).producer, Cursor::new(0, 10));
    // Corked again: the 200 ms ceiling flushes.
    let now = p.now;
    p.a.conn.set_cork(true, now);
    p.app_send(Side::A, &[1; 10]);
    p.pump(Side::A);
    let t0 = p.now;
    assert_eq!(
        p.a.conn.timer(ConnTimer::Flush),
        Some(t0 + Duration::from_millis(200))
    );
    p.drive();
    assert_eq!(p.b.conn.peer_producer_cursor(), Cursor::new(0, 20));
    // A full window is never held.
    p.b.auto_read = false;
    let before = p.a.conn.stats().cdc_sent;
    let room = p.a.conn.window() as usize;
    p.app_send(Side::A, &vec![7; room]);
    p.pump(Side::A);
    assert_eq!(p.a.conn.stats().cdc_sent, before + 1);
}

#[test]
fn api_misuse_is_reported_not_panicked() {
    let cfg = ConnectionConfig::new(RmbeLayout::Rfc, 100, 100, TOKEN_A, TOKEN_B);
    let mut c = Connection::new(cfg).expect("valid");
    let now = Timestamp::ZERO;
    assert_eq!(
        c.produced(97, now),
        Err(ApiError::ExceedsWindow {
            requested: 97,
            available: 96
        })
    );
    assert_eq!(
        c.consumed(1, now),
        Err(ApiError::ExceedsReadable {
            requested: 1,
            available: 0
        })
    );
    assert_eq!(c.produced_urgent(0, now), Err(ApiError::EmptyUrgent));
    assert!(Connection::new(ConnectionConfig::new(RmbeLayout::Rfc, 4, 100, 1, 2)).is_err());
    c.shutdown_write(now).expect("ok");
    assert_eq!(c.produced(1, now), Err(ApiError::WriteShutdown));
    assert!(c.write_regions().is_empty());
}

#[test]
fn bulk_transfer_both_ways() {
    for layout in LAYOUTS {
        let mut p = Pair::symmetric(layout, 16 * K);
        let a_data = stream(0, 1 << 20);
        let b_data = stream(3, 700_000);
        p.app_send(Side::A, &a_data);
        p.app_send(Side::B, &b_data);
        p.drive();
        assert_eq!(p.b.rx, a_data);
        assert_eq!(p.a.rx, b_data);
        for c in [&p.a.conn, &p.b.conn] {
            assert_eq!(c.state(), State::Active);
            assert_eq!(c.stats().aborts.total(), 0);
            assert_eq!(c.stats().cdc_stale, 0);
        }
        // Window updates stay well below one per CDC of data.
        let s = p.b.conn.stats();
        assert!(s.window_updates_sent <= p.a.conn.stats().cdc_sent);
    }
}

#[test]
#[should_panic(expected = "livelock")]
fn drive_loop_fails_on_livelock() {
    let mut p = Pair::symmetric(RmbeLayout::Linux, 1000);
    p.knobs.max_steps = 3;
    p.app_send(Side::A, &stream(0, 100_000));
    p.drive();
}

#[test]
fn urgent_byte_consumed_in_pieces() {
    let mut p = pair64k();
    p.app_send(Side::A, &stream(0, 100));
    p.app_send_urgent(Side::A, &stream(100, 50));
    p.pump(Side::A);
    let m = deliver_cdc(&mut p, Side::B);
    assert!(m.prod_flags.urgent_present);
    assert_eq!(p.b.conn.urgent_mark(), Some(Cursor::new(0, 149)));
    // Reading up to, but not including, the urgent byte needs no update... except that the
    // peer still signals urgent data pending, which makes every consumption count.
    assert_eq!(p.read(Side::B, 149), 149);
    let u = deliver_cdc(&mut p, Side::A);
    assert_eq!(u.consumer, Cursor::new(0, 149));
    assert!(
        p.a.conn.write_regions().is_empty(),
        "urgent byte not yet acknowledged"
    );
    assert_eq!(p.read(Side::B, 1), 1);
    assert_eq!(p.b.conn.urgent_mark(), None);
    let u = deliver_cdc(&mut p, Side::A);
    assert_eq!(u.consumer, Cursor::new(0, 150));
    assert!(!p.a.conn.write_regions().is_empty());
    assert_eq!(p.b.rx, stream(0, 150));
}

#[test]
fn second_urgent_send_while_first_unacknowledged() {
    let mut p = pair64k();
    p.app_send_urgent(Side::A, &stream(0, 10));
    p.pump(Side::A);
    // The application sends more urgent data before the first is acknowledged.
    let now = p.now;
    p.a.conn.urgent_pending(now).expect("active");
    let m = deliver_cdc(&mut p, Side::B);
    assert!(m.prod_flags.urgent_present);
    p.read(Side::B, usize::MAX);
    deliver_cdc(&mut p, Side::A);
    // Acknowledged: the second urgent send is still announced (P without U).
    p.a.conn.request_consumer_update().expect("active");
    p.flush(Side::A);
    let m = deliver_cdc(&mut p, Side::B);
    assert!(m.prod_flags.urgent_pending);
    assert!(!m.prod_flags.urgent_present);
    p.app_send_urgent(Side::A, &stream(10, 5));
    p.pump(Side::A);
    let m = p.wire.back().map(|f| f.what);
    assert!(matches!(m, Some(crate::harness::Wire::Cdc(c))
        if c.prod_flags.urgent_present && c.producer == Cursor::new(0, 15)));
}

#[test]
fn readable_events_only_while_wanted() {
    let mut p = pair64k();
    let readables = |p: &mut Pair| {
        p.pump(Side::B);
        let n =
            p.b.events
                .iter()
                .filter(|(_, e)| *e == Event::Readable)
                .count();
        p.b.events.clear();
        n
    };
    p.app_send(Side::A, b"one");
    p.pump(Side::A);
    deliver_cdc(&mut p, Side::B);
    assert_eq!(readables(&mut p), 1, "on by default");
    // Off: the bytes arrive and count as readable, without an event.
    p.b.conn.set_readable_events(false);
    p.app_send(Side::A, b"two");
    p.pump(Side::A);
    deliver_cdc(&mut p, Side::B);
    assert_eq!(readables(&mut p), 0);
    assert_eq!(p.b.conn.readable(), 6);
    // On again: the next CDC with data has its event.
    p.b.conn.set_readable_events(true);
    p.app_send(Side::A, b"three");
    p.pump(Side::A);
    deliver_cdc(&mut p, Side::B);
    assert_eq!(readables(&mut p), 1);
    assert_eq!(p.read(Side::B, usize::MAX), 11);
}
