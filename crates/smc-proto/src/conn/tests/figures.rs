//! RFC 7609 §4.7 Figures 16–21, step by step, in RFC mode (cursors from 4, as in the
//! figures) and in Linux mode (the same flows with cursors from 0).
//!
//! The figures show, for the stream written by Host A, Host A's copy of Host B's consumer
//! cursor and Host B's copy of Host A's producer cursor and flags. RMBE size is 10,000 bytes,
//! so an RFC-mode RMBE holds 9,996 bytes of data.

use smc_wire::Cursor;

use super::*;
use crate::conn::Event;
use crate::harness::{Pair, Side};

fn new_pair(layout: RmbeLayout) -> Pair {
    let mut p = Pair::symmetric(layout, FIG_RMBE);
    p.a.auto_read = false;
    p.b.auto_read = false;
    p
}

fn cap(layout: RmbeLayout) -> usize {
    (FIG_RMBE - layout.data_start()) as usize
}

/// Assert the figure columns: A's view of B's consumer cursor, B's view of A's producer
/// cursor.
fn assert_views(p: &Pair, a_cons: Cursor, b_prod: Cursor) {
    assert_eq!(
        p.a.conn.peer_consumer_cursor(),
        a_cons,
        "Host A consumer cursor"
    );
    assert_eq!(
        p.b.conn.peer_producer_cursor(),
        b_prod,
        "Host B producer cursor"
    );
}

/// Bring the A→B stream to `wrap:x` (figure coordinates) with all data consumed and Host A
/// knowing it: one full window, then the rest, then a consumer update requested with R.
fn prime(p: &mut Pair, layout: RmbeLayout, wrap: u16, x: u32) -> usize {
    assert_eq!(wrap, 1);
    let mut sent = 0;
    let full = cap(layout);
    p.app_send(Side::A, &stream(0, full));
    p.pump(Side::A);
    deliver_cdc(p, Side::B);
    assert_eq!(p.read(Side::B, usize::MAX), full);
    // Sender window 0 < half, growth 100% >= 10%: B updates.
    let upd = deliver_cdc(p, Side::A);
    assert_eq!(upd.consumer, Cursor::new(1, layout.data_start()));
    sent += full;
    let rest = (x - 4) as usize;
    if rest > 0 {
        p.app_send(Side::A, &stream(sent, rest));
        p.pump(Side::A);
        deliver_cdc(p, Side::B);
        assert_eq!(p.read(Side::B, usize::MAX), rest);
        assert!(p.wire.is_empty(), "window unconstrained: no update");
        sent += rest;
        p.a.conn.request_consumer_update().expect("active");
        p.flush(Side::A);
        let r = deliver_cdc(p, Side::B);
        assert!(r.prod_flags.cons_update_requested);
        let u = deliver_cdc(p, Side::A);
        assert_eq!(u.consumer, cur(layout, wrap, x));
    }
    assert_views(p, cur(layout, wrap, x), cur(layout, wrap, x));
    sent
}

fn scenario1(layout: RmbeLayout) -> Pair {
    let mut p = new_pair(layout);
    // Time 0.
    assert_views(&p, cur(layout, 0, 4), cur(layout, 0, 4));
    // Time 1: RDMA WRITE of 1000 bytes at 4:1003.
    let data = stream(0, 1000);
    p.app_send(Side::A, &data);
    assert_eq!(p.pump(Side::A), 1000);
    let s = pos(layout, 4) as usize;
    assert_eq!(&p.b.rmbe[s..s + 1000], &data[..]);
    assert_views(&p, cur(layout, 0, 4), cur(layout, 0, 4));
    // Time 2: CDC with producer cursor 1004.
    let m = deliver_cdc(&mut p, Side::B);
    assert_eq!(m.seqno, 1);
    assert_eq!(m.producer, cur(layout, 0, 1004));
    assert_eq!(m.prod_flags.to_byte(), 0);
    assert_views(&p, cur(layout, 0, 4), cur(layout, 0, 1004));
    // Host B consumes everything; window unconstrained, no update.
    assert_eq!(p.read(Side::B, 10_000), 1000);
    assert_eq!(p.b.rx, data);
    assert_eq!(p.b.conn.consumer_cursor(), cur(layout, 0, 1004));
    assert!(p.wire.is_empty());
    assert_eq!(p.b.conn.stats().cdc_sent, 0);
    p
}

#[test]
fn fig16_scenario1_send_window_unconstrained() {
    for layout in LAYOUTS {
        scenario1(layout);
    }
}

#[test]
fn fig17_scenario2_send_receive_window_unconstrained() {
    for layout in LAYOUTS {
        let mut p = scenario1(layout);
        // Time 3: Host B writes 500 bytes into A's RMBE at 4:503.
        let reply = stream(7, 500);
        p.app_send(Side::B, &reply);
        assert_eq!(p.pump(Side::B), 500);
        // Time 4: B's CDC carries its producer cursor (504) and its consumer cursor (1004).
        let m = deliver_cdc(&mut p, Side::A);
        assert_eq!(m.seqno, 1);
        assert_eq!(m.producer, cur(layout, 0, 504));
        assert_eq!(m.consumer, cur(layout, 0, 1004));
        assert_views(&p, cur(layout, 0, 1004), cur(layout, 0, 1004));
        assert_eq!(p.b.conn.consumer_cursor_sent(), cur(layout, 0, 1004));
        assert_eq!(p.a.conn.readable(), 500);
        assert_eq!(p.read(Side::A, 1000), 500);
        assert_eq!(p.a.rx, reply);
    }
}

#[test]
fn fig18_scenario3_send_window_constrained() {
    for layout in LAYOUTS {
        let mut p = new_pair(layout);
        // Times 1-2: 3000 bytes, CDC with producer 3004.
        p.app_send(Side::A, &stream(0, 3000));
        p.pump(Side::A);
        let m = deliver_cdc(&mut p, Side::B);
        assert_eq!(m.producer, cur(layout, 0, 3004));
        assert_views(&p, cur(layout, 0, 4), cur(layout, 0, 3004));
        // Time 3: B consumes; 7000 bytes still open, no update.
        assert_eq!(p.read(Side::B, 10_000), 3000);
        assert!(p.wire.is_empty());
        // Times 4-5: 4000 bytes at 3004:7003, CDC with producer 7004.
        p.app_send(Side::A, &stream(3000, 4000));
        p.pump(Side::A);
        let m = deliver_cdc(&mut p, Side::B);
        assert_eq!(m.seqno, 2);
        assert_eq!(m.producer, cur(layout, 0, 7004));
        assert_views(&p, cur(layout, 0, 4), cur(layout, 0, 7004));
        // Time 6: B consumes; sender window ~3000 < half, growth 7000 >= 10%: update.
        assert_eq!(p.read(Side::B, 10_000), 4000);
        let u = deliver_cdc(&mut p, Side::A);
        assert_eq!(u.consumer, cur(layout, 0, 7004));
        assert_eq!(u.producer, cur(layout, 0, 4), "B has sent nothing");
        assert_views(&p, cur(layout, 0, 7004), cur(layout, 0, 7004));
        assert_eq!(p.b.conn.stats().window_updates_sent, 1);
        assert_eq!(p.b.rx, stream(0, 7000));
    }
}

#[test]
fn fig19_scenario4_large_send_full_window_writes() {
    for layout in LAYOUTS {
        let mut p = new_pair(layout);
        let primed = prime(&mut p, layout, 1, 1004);
        let cap = cap(layout);
        // 20,000 bytes in RFC mode: two full windows and 8 bytes.
        let total = 2 * cap + 8;
        p.app_send(Side::A, &stream(primed, total));
        // Times 1-3: writes at 1004:9999 and 4:1003, then CDC: producer wrap 2, writer
        // blocked.
        assert_eq!(p.pump(Side::A), cap);
        let m = deliver_cdc(&mut p, Side::B);
        assert_eq!(m.producer, cur(layout, 2, 1004));
        assert!(m.prod_flags.write_blocked);
        assert_views(&p, cur(layout, 1, 1004), cur(layout, 2, 1004));
        // Time 4: same cursor, new wrap: a full window is readable, in two segments.
        let regions = p.b.conn.read_regions(p.b.rmbe_head(), p.now).expect("ok");
        assert_eq!(regions.first.offset, pos(layout, 1004));
        assert_eq!(regions.first.len, FIG_RMBE - pos(layout, 1004));
        assert_eq!(regions.second.offset, pos(layout, 4));
        assert_eq!(regions.second.len, 1000);
        assert_eq!(p.read(Side::B, usize::MAX), cap);
        // Writer blocked: the consumption is reported at once.
        let u = deliver_cdc(&mut p, Side::A);
        assert_eq!(u.consumer, cur(layout, 2, 1004));
        assert_views(&p, cur(layout, 2, 1004), cur(layout, 2, 1004));
        assert!(p.a.saw(Event::Writable));
        // Times 5-7: the second full window; 8 bytes remain, so still blocked.
        assert_eq!(p.pump(Side::A), cap);
        let m = deliver_cdc(&mut p, Side::B);
        assert_eq!(m.producer, cur(layout, 3, 1004));
        assert!(m.prod_flags.write_blocked);
        // Time 8.
        assert_eq!(p.read(Side::B, usize::MAX), cap);
        let u = deliver_cdc(&mut p, Side::A);
        assert_eq!(u.consumer, cur(layout, 3, 1004));
        assert_views(&p, cur(layout, 3, 1004), cur(layout, 3, 1004));
        // The final 8 bytes at 1004:1011, writer no longer blocked.
        assert_eq!(p.pump(Side::A), 8);
        let m = deliver_cdc(&mut p, Side::B);
        assert_eq!(m.producer, cur(layout, 3, 1012));
        assert!(!m.prod_flags.write_blocked);
        assert_eq!(p.read(Side::B, usize::MAX), 8);
        assert_eq!(p.b.rx, stream(0, primed + total));
        assert_eq!(p.a.conn.stats().write_blocked_signals, 1);
    }
}

/// Scenario 5/6 common end: B consumes the urgent data and must report it; A then writes
/// the 1000 normal bytes and clears the urgent flags.
fn urgent_tail(p: &mut Pair, layout: RmbeLayout, wrap: u16) {
    // B consumes up to and including the urgent byte: mandatory consumer update.
    assert_eq!(p.read(Side::B, usize::MAX), 500);
    let u = deliver_cdc(p, Side::A);
    assert_eq!(u.consumer, cur(layout, wrap, 1500));
    assert_views(p, cur(layout, wrap, 1500), cur(layout, wrap, 1500));
    assert_eq!(p.b.conn.urgent_mark(), None);
    // A resumes: 1000 bytes at 1500:2499, flags cleared.
    assert_eq!(p.pump(Side::A), 1000);
    let m = deliver_cdc(p, Side::B);
    assert_eq!(m.producer, cur(layout, wrap, 2500));
    assert_eq!(m.prod_flags.to_byte(), 0);
    // Figure 21 prints Host A's consumer cursor as 1000 at time 7; nothing moves it back, so
    // it stays at 1500 (the figure's value looks like a typo).
    assert_views(p, cur(layout, wrap, 1500), cur(layout, wrap, 2500));
    // Window unconstrained: no update after consuming the normal data.
    assert_eq!(p.read(Side::B, usize::MAX), 1000);
    assert!(p.wire.is_empty());
}

#[test]
fn fig20_scenario5_urgent_data_window_open() {
    for layout in LAYOUTS {
        let mut p = new_pair(layout);
        let primed = prime(&mut p, layout, 1, 1000);
        let urgent = stream(primed, 500);
        let normal = stream(primed + 500, 1000);
        p.app_send_urgent(Side::A, &urgent);
        p.app_send(Side::A, &normal);
        // Times 1-2: 500 bytes at 1000:1499, CDC with producer 1500 and P+U. No more writes
        // until acknowledged.
        assert_eq!(p.pump(Side::A), 500);
        assert!(p.a.conn.write_regions().is_empty());
        let m = deliver_cdc(&mut p, Side::B);
        assert_eq!(m.producer, cur(layout, 1, 1500));
        assert!(m.prod_flags.urgent_pending && m.prod_flags.urgent_present);
        assert!(!m.prod_flags.write_blocked);
        assert_views(&p, cur(layout, 1, 1000), cur(layout, 1, 1500));
        assert!(p.b.saw(Event::UrgentPending));
        let mark = cur(layout, 1, 1499);
        assert!(p.b.saw(Event::UrgentData { mark }));
        assert_eq!(p.b.conn.urgent_mark(), Some(mark));
        // Times 3-5.
        urgent_tail(&mut p, layout, 1);
        let mut all = stream(0, primed);
        all.extend_from_slice(&urgent);
        all.extend_from_slice(&normal);
        assert_eq!(p.b.rx, all);
    }
}

#[test]
fn fig21_scenario6_urgent_data_window_closed() {
    for layout in LAYOUTS {
        let mut p = new_pair(layout);
        let mut sent = prime(&mut p, layout, 1, 1000);
        // Close the window: a full window written, unread by B.
        let cap = cap(layout);
        p.app_send(Side::A, &stream(sent, cap));
        assert_eq!(p.pump(Side::A), cap);
        sent += cap;
        deliver_cdc(&mut p, Side::B);
        assert_views(&p, cur(layout, 1, 1000), cur(layout, 2, 1000));
        // Time 1: urgent send with the window closed: CDC with B and P, cursor unchanged.
        let urgent = stream(sent, 500);
        let normal = stream(sent + 500, 1000);
        p.app_send_urgent(Side::A, &urgent);
        p.app_send(Side::A, &normal);
        assert_eq!(p.pump(Side::A), 0);
        let m = deliver_cdc(&mut p, Side::B);
        assert_eq!(m.producer, cur(layout, 2, 1000));
        assert!(m.prod_flags.write_blocked && m.prod_flags.urgent_pending);
        assert!(!m.prod_flags.urgent_present);
        assert!(p.b.saw(Event::UrgentPending));
        // Time 2: B consumes the full window and reports it.
        assert_eq!(p.read(Side::B, usize::MAX), cap);
        let u = deliver_cdc(&mut p, Side::A);
        assert_eq!(u.consumer, cur(layout, 2, 1000));
        assert_views(&p, cur(layout, 2, 1000), cur(layout, 2, 1000));
        // Times 3-4: urgent data at 1000:1499; P+U, writer-blocked cleared.
        assert_eq!(p.pump(Side::A), 500);
        let m = deliver_cdc(&mut p, Side::B);
        assert_eq!(m.producer, cur(layout, 2, 1500));
        assert!(m.prod_flags.urgent_pending && m.prod_flags.urgent_present);
        assert!(!m.prod_flags.write_blocked);
        assert!(p.b.saw(Event::UrgentData {
            mark: cur(layout, 2, 1499)
        }));
        // Times 5-7.
        urgent_tail(&mut p, layout, 2);
        let mut all = stream(0, sent);
        all.extend_from_slice(&urgent);
        all.extend_from_slice(&normal);
        assert_eq!(p.b.rx, all);
    }
}
