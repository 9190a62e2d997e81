//! Peer input is never trusted: each kind of bad CDC aborts cleanly with a counted reason,
//! and no CDC, however forged, makes the engine panic or hand out an out-of-bounds region.

use proptest::prelude::*;

use super::*;
use crate::conn::{AbortReason, ConnError, Event, State};
use crate::harness::{Pair, Side};

/// RFC mode, 10,000-byte RMBEs; A wrote 1000 bytes that B has not read.
fn setup() -> Pair {
    let mut p = Pair::symmetric(RmbeLayout::Rfc, FIG_RMBE);
    p.a.auto_read = false;
    p.b.auto_read = false;
    p.app_send(Side::A, &stream(0, 1000));
    p.pump(Side::A);
    deliver_cdc(&mut p, Side::B);
    p
}

/// A CDC to `to` that repeats what `to` already knows, with a fresh sequence number.
fn baseline(p: &Pair, to: Side, seqno: u16) -> CdcMessage {
    let c = &p.peer(to).conn;
    CdcMessage {
        seqno,
        alert_token: c.config().local_alert_token,
        producer: c.peer_producer_cursor(),
        consumer: c.peer_consumer_cursor(),
        prod_flags: Default::default(),
        conn_flags: Default::default(),
    }
}

fn assert_aborted(mut p: Pair, victim: Side, reason: AbortReason) {
    let me = p.peer(victim);
    assert_eq!(me.conn.state(), State::PeerAbortWait, "{reason:?}");
    assert_eq!(me.conn.error(), Some(ConnError::Aborted(reason)));
    assert_eq!(me.conn.stats().aborts.get(reason), 1);
    assert_eq!(me.conn.stats().aborts.total(), 1);
    assert!(me.saw(Event::SendTcpReset));
    assert!(me.saw(Event::Failed(ConnError::Aborted(reason))));
    assert_eq!(me.conn.readable(), 0);
    assert!(me.conn.write_regions().is_empty());
    // The forged sequence number makes the peer's genuine abort reply look stale to the
    // victim, which then leaves PeerAbortWait by its timer.
    p.drive();
    assert_eq!(p.peer(victim).conn.state(), State::Closed);
    let other = p.peer(victim.other());
    assert_eq!(other.conn.state(), State::Closed);
    assert_eq!(
        other.conn.error(),
        Some(ConnError::Reset(AbortReason::PeerAbort))
    );
}

fn forged(to: Side, f: impl FnOnce(&mut CdcMessage), reason: AbortReason) {
    let mut p = setup();
    let mut m = baseline(&p, to, 500);
    f(&mut m);
    p.inject(to, m);
    assert_aborted(p, to, reason);
}

#[test]
fn producer_outside_the_rmbe() {
    forged(
        Side::B,
        |m| m.producer.count = FIG_RMBE,
        AbortReason::ProducerOutOfBounds,
    );
    forged(
        Side::B,
        |m| m.producer.count = u32::MAX,
        AbortReason::ProducerOutOfBounds,
    );
    // RFC mode: the eye catcher is not data.
    forged(
        Side::B,
        |m| m.producer.count = 2,
        AbortReason::ProducerOutOfBounds,
    );
}

#[test]
fn consumer_outside_the_rmbe() {
    forged(
        Side::A,
        |m| m.consumer.count = FIG_RMBE + 1,
        AbortReason::ConsumerOutOfBounds,
    );
    forged(
        Side::A,
        |m| m.consumer.count = 0,
        AbortReason::ConsumerOutOfBounds,
    );
}

#[test]
fn producer_moving_backwards() {
    forged(
        Side::B,
        |m| m.producer = Cursor::new(0, 500),
        AbortReason::ProducerBackwards,
    );
    forged(
        Side::B,
        |m| m.producer = Cursor::new(u16::MAX, 5000),
        AbortReason::ProducerBackwards,
    );
}

#[test]
fn producer_claiming_more_than_the_buffer_holds() {
    // One wrap too far past the last producer cursor.
    forged(
        Side::B,
        |m| m.producer = Cursor::new(1, 1005),
        AbortReason::ProducerOverrun,
    );
    forged(
        Side::B,
        |m| m.producer = Cursor::new(7, 1004),
        AbortReason::ProducerOverrun,
    );
    // Within a buffer of the last producer cursor, but past B's unread data.
    forged(
        Side::B,
        |m| m.producer = Cursor::new(1, 500),
        AbortReason::ProducerOverrun,
    );
}

#[test]
fn consumer_claiming_unsent_data() {
    forged(
        Side::A,
        |m| m.consumer = Cursor::new(0, 2000),
        AbortReason::ConsumerAhead,
    );
    forged(
        Side::A,
        |m| m.consumer = Cursor::new(1, 4),
        AbortReason::ConsumerAhead,
    );
}

#[test]
fn consumer_moving_backwards() {
    let mut p = setup();
    let mut m = baseline(&p, Side::A, 500);
    m.consumer = Cursor::new(0, 1004);
    p.inject(Side::A, m);
    assert_eq!(p.a.conn.state(), State::Active, "a valid update");
    assert_eq!(p.a.conn.peer_consumer_cursor(), Cursor::new(0, 1004));
    let mut m = baseline(&p, Side::A, 501);
    m.consumer = Cursor::new(0, 600);
    p.inject(Side::A, m);
    assert_aborted(p, Side::A, AbortReason::ConsumerBackwards);
}

#[test]
fn data_after_done_writing() {
    let mut p = setup();
    let t = p.now;
    p.a.conn.shutdown_write(t).expect("ok");
    p.flush(Side::A);
    let d = deliver_cdc(&mut p, Side::B);
    assert!(d.conn_flags.peer_done_writing);
    let mut m = baseline(&p, Side::B, 500);
    m.producer = Cursor::new(0, 1100);
    p.inject(Side::B, m);
    let me = &p.b;
    assert_eq!(
        me.conn.error(),
        Some(ConnError::Aborted(AbortReason::DataAfterDone))
    );
    assert_eq!(me.conn.stats().aborts.get(AbortReason::DataAfterDone), 1);
    assert_eq!(me.conn.state(), State::PeerAbortWait);
}

#[test]
fn overwritten_eye_catcher_resets_before_any_read() {
    let mut p = setup();
    p.b.rmbe[1] ^= 0xFF;
    assert_eq!(p.read(Side::B, usize::MAX), 0);
    assert!(p.b.rx.is_empty());
    assert_aborted(p, Side::B, AbortReason::EyeCatcherOverwritten);
    // Linux mode has no eye catcher to check.
    let mut p = Pair::symmetric(RmbeLayout::Linux, 1000);
    p.b.auto_read = false;
    p.app_send(Side::A, b"abcd");
    p.settle();
    p.b.rmbe[0] = b'X';
    assert_eq!(p.read(Side::B, 10), 4);
    assert_eq!(p.b.conn.state(), State::Active);
}

fn any_cursor() -> impl Strategy<Value = Cursor> {
    prop_oneof![
        (any::<u16>(), any::<u32>()).prop_map(|(w, c)| Cursor::new(w, c)),
        (0u16..3, 0u32..10_010).prop_map(|(w, c)| Cursor::new(w, c)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Any CDC either applies cleanly, keeping every region inside the RMBE, or aborts with
    /// a protocol-violation reason (or a peer abort).
    #[test]
    fn arbitrary_cdcs_never_break_the_engine(
        prod in any_cursor(),
        cons in any_cursor(),
        pflags in any::<u8>(),
        cflags in any::<u8>(),
        seq in any::<u16>(),
    ) {
        let mut p = setup();
        let mut m = baseline(&p, Side::B, seq);
        m.producer = prod;
        m.consumer = cons;
        m.prod_flags = smc_wire::ProducerFlags::from_byte(pflags);
        m.conn_flags = smc_wire::ConnStateFlags::from_byte(cflags);
        p.inject(Side::B, m);
        let c = &p.b.conn;
        match c.error() {
            None => {
                let cap = FIG_RMBE - 4;
                prop_assert!(c.readable() <= cap);
                for r in c.write_regions().iter() {
                    prop_assert!(r.offset >= 4 && r.offset + r.len <= FIG_RMBE);
                }
                let head = p.b.rmbe_head();
                let t = p.now;
                let regions = p.b.conn.read_regions(head, t);
                if let Ok(regions) = regions {
                    for r in regions.iter() {
                        prop_assert!(r.offset >= 4 && r.offset + r.len <= FIG_RMBE);
                    }
                }
            }
            Some(ConnError::Aborted(r)) => prop_assert!(r.is_protocol_violation(), "{r:?}"),
            // An F-flag CDC whose sequence number is above SR is a failover data loss (§4.6.1).
            Some(ConnError::Reset(r)) => prop_assert!(
                r == AbortReason::PeerAbort || r == AbortReason::FailoverDataLoss,
                "{r:?}"
            ),
            Some(e) => prop_assert!(false, "unexpected {e:?}"),
        }
    }
}

#[test]
fn producer_using_a_consumer_update_we_never_sent() {
    let mut p = setup();
    // B consumed 1000 bytes but (window unconstrained) did not tell A.
    assert_eq!(p.read(Side::B, usize::MAX), 1000);
    assert!(p.wire.is_empty());
    // Writing a full buffer past B's *current* consumer cursor would be fine, but A can only
    // know the consumer cursor B sent (the initial one).
    let mut m = baseline(&p, Side::B, 500);
    m.producer = Cursor::new(1, 1004);
    p.inject(Side::B, m);
    assert_aborted(p, Side::B, AbortReason::ProducerOverrun);
}

#[test]
fn consumer_acknowledging_unannounced_data() {
    let mut p = setup();
    // A writes 100 more bytes under TCP_CORK: produced, but not yet announced.
    let t = p.now;
    p.a.conn.set_cork(true, t);
    p.app_send(Side::A, &stream(1000, 100));
    p.pump(Side::A);
    assert!(p.wire.is_empty());
    let mut m = baseline(&p, Side::A, 500);
    m.consumer = Cursor::new(0, 1104);
    p.inject(Side::A, m);
    assert_aborted(p, Side::A, AbortReason::ConsumerAhead);
}
