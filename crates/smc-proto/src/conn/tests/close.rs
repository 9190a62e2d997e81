//! Normal (Fig. 22) and abnormal (Fig. 23) termination: every transition of the table is
//! taken by at least one scenario below (checked by `every_transition_is_exercised`).

use std::collections::BTreeSet;
use std::time::Duration;

use super::*;
use crate::conn::state::render_table;
use crate::conn::{AbortReason, ConnError, ConnTimer, Event, Input, State, TRANSITIONS};
use crate::harness::{Pair, Side};

type Seen = BTreeSet<(State, Input, State)>;

fn record(p: &Pair, seen: &mut Seen) {
    for peer in [&p.a, &p.b] {
        for (_, e) in &peer.events {
            if let Event::StateChanged { from, input, to } = e {
                seen.insert((*from, *input, *to));
            }
        }
    }
}

fn pair() -> Pair {
    Pair::symmetric(RmbeLayout::Linux, 16 * 1024)
}

fn now(p: &Pair) -> crate::time::Timestamp {
    p.now
}

fn states(p: &Pair) -> (State, State) {
    (p.a.conn.state(), p.b.conn.state())
}

fn shut_wr(p: &mut Pair, side: Side) {
    p.act(side, |c, t| c.shutdown_write(t)).expect("shutdown");
}

fn close(p: &mut Pair, side: Side) {
    p.act(side, |c, t| c.close(t)).expect("close");
}

fn abort(p: &mut Pair, side: Side) {
    p.act(side, |c, t| c.abort(t));
}

fn both_closed_cleanly(p: &Pair) {
    assert_eq!(states(p), (State::Closed, State::Closed));
    assert!(p.a.saw(Event::Closed) && p.b.saw(Event::Closed));
    assert_eq!(p.a.conn.error(), None);
    assert_eq!(p.b.conn.error(), None);
    assert_eq!(p.a.conn.poll_timeout(), None);
    assert_eq!(p.b.conn.poll_timeout(), None);
}

/// 3A/4A, 3C/4C: close on A, then close on B.
fn sc_close_then_close(seen: &mut Seen) {
    let mut p = pair();
    close(&mut p, Side::A);
    assert_eq!(p.a.conn.state(), State::PeerCloseWait1);
    let m = deliver_cdc(&mut p, Side::B);
    assert!(m.conn_flags.peer_conn_closed);
    assert_eq!(p.b.conn.state(), State::AppCloseWait1);
    assert!(p.b.saw(Event::ReadClosed));
    assert!(p.b.conn.is_read_closed());
    close(&mut p, Side::B);
    assert_eq!(p.b.conn.state(), State::Closed);
    p.settle();
    both_closed_cleanly(&p);
    record(&p, seen);
}

/// 3A, 3B, 4A, 4B, 3C (local closed), 4C (peer closed), 3A close-after-shutdown in PCW2,
/// 4A (D then C) in AppCloseWait2.
fn sc_shutdown_both_then_a_closes_first(seen: &mut Seen) {
    let mut p = pair();
    shut_wr(&mut p, Side::A);
    p.settle();
    assert_eq!(states(&p), (State::PeerCloseWait1, State::AppCloseWait1));
    // Half-closed: B can still send to A.
    p.app_send(Side::B, b"late reply");
    p.settle();
    assert_eq!(p.a.rx, b"late reply");
    shut_wr(&mut p, Side::B);
    p.settle();
    assert_eq!(states(&p), (State::PeerCloseWait2, State::AppCloseWait2));
    close(&mut p, Side::A);
    assert_eq!(p.a.conn.state(), State::PeerCloseWait2);
    assert!(p.a.conn.timer(ConnTimer::PeerCloseWait).is_some());
    p.settle();
    assert_eq!(p.b.conn.state(), State::AppCloseWait2);
    close(&mut p, Side::B);
    p.settle();
    both_closed_cleanly(&p);
    record(&p, seen);
}

/// 3B then 3C (local not closed) → AppFinCloseWait → 3D; 4C (peer not closed) → 4D.
fn sc_shutdown_both_then_b_closes_first(seen: &mut Seen) {
    let mut p = pair();
    shut_wr(&mut p, Side::A);
    p.settle();
    shut_wr(&mut p, Side::B);
    p.settle();
    close(&mut p, Side::B);
    assert_eq!(p.b.conn.state(), State::PeerFinCloseWait);
    assert!(p.b.conn.timer(ConnTimer::PeerFinCloseWait).is_some());
    p.settle();
    assert_eq!(p.a.conn.state(), State::AppFinCloseWait);
    close(&mut p, Side::A);
    assert_eq!(p.a.conn.state(), State::Closed);
    p.settle();
    both_closed_cleanly(&p);
    record(&p, seen);
}

/// PCW1 + C without local close → AppFinCloseWait; AppCloseWait1 close → PeerFinCloseWait.
fn sc_shutdown_then_peer_closes(seen: &mut Seen) {
    let mut p = pair();
    shut_wr(&mut p, Side::A);
    p.settle();
    close(&mut p, Side::B);
    assert_eq!(p.b.conn.state(), State::PeerFinCloseWait);
    p.settle();
    assert_eq!(p.a.conn.state(), State::AppFinCloseWait);
    close(&mut p, Side::A);
    p.settle();
    both_closed_cleanly(&p);
    record(&p, seen);
}

/// PCW1 close after shutdown(WR); AppCloseWait1 sees D then C.
fn sc_shutdown_then_close(seen: &mut Seen) {
    let mut p = pair();
    shut_wr(&mut p, Side::A);
    close(&mut p, Side::A);
    assert_eq!(p.a.conn.state(), State::PeerCloseWait1);
    p.settle();
    assert_eq!(p.b.conn.state(), State::AppCloseWait1);
    close(&mut p, Side::B);
    p.settle();
    both_closed_cleanly(&p);
    record(&p, seen);
}

/// Both close at once: both take the active path.
//= https://www.rfc-editor.org/rfc/rfc7609#section-4.8.1
//# In that scenario, the flows above still apply; however, both endpoints follow the
//# active close path (path 3).
fn sc_simultaneous_close(seen: &mut Seen) {
    let mut p = pair();
    close(&mut p, Side::A);
    close(&mut p, Side::B);
    assert_eq!(states(&p), (State::PeerCloseWait1, State::PeerCloseWait1));
    p.settle();
    both_closed_cleanly(&p);
    record(&p, seen);
    // Simultaneous shutdown(WR), then simultaneous close.
    let mut p = pair();
    shut_wr(&mut p, Side::A);
    shut_wr(&mut p, Side::B);
    p.settle();
    assert_eq!(states(&p), (State::PeerCloseWait2, State::PeerCloseWait2));
    close(&mut p, Side::A);
    close(&mut p, Side::B);
    p.settle();
    both_closed_cleanly(&p);
    record(&p, seen);
}

/// Each anti-stranding timer expiring: TCP reset, Closed, no more CDCs.
fn sc_timers(seen: &mut Seen) {
    // PeerCloseWait1: the peer never answers.
    let mut p = pair();
    p.knobs.drop_from_b = true;
    p.knobs.deliver_tcp_rst = false;
    close(&mut p, Side::A);
    let deadline = p.a.conn.timer(ConnTimer::PeerCloseWait).expect("armed");
    assert_eq!(deadline, now(&p) + Duration::from_secs(30));
    p.b.auto_read = false;
    close(&mut p, Side::B);
    p.drive();
    assert_eq!(p.a.conn.state(), State::Closed);
    assert_eq!(p.a.conn.error(), Some(ConnError::TimedOut));
    assert!(p.a.saw(Event::SendTcpReset));
    assert_eq!(p.a.conn.stats().aborts.get(AbortReason::CloseTimeout), 1);
    // B had A's C, so its own close completed at once (its C was lost on the way).
    assert_eq!(p.b.conn.state(), State::Closed);
    assert_eq!(p.b.conn.error(), None);
    record(&p, seen);

    // PeerFinCloseWait: A shut down writing, B closed, A's application never closes.
    let mut p = pair();
    shut_wr(&mut p, Side::A);
    p.settle();
    close(&mut p, Side::B);
    p.settle();
    assert_eq!(
        states(&p),
        (State::AppFinCloseWait, State::PeerFinCloseWait)
    );
    let deadline = p.b.conn.timer(ConnTimer::PeerFinCloseWait).expect("armed");
    assert_eq!(
        p.a.conn.poll_timeout(),
        None,
        "AppFinCloseWait waits for the app"
    );
    p.knobs.deliver_tcp_rst = false;
    p.drive();
    assert_eq!(p.now, deadline);
    assert_eq!(p.b.conn.state(), State::Closed);
    assert_eq!(p.b.conn.error(), Some(ConnError::TimedOut));
    assert!(p.b.saw(Event::SendTcpReset));
    assert_eq!(p.a.conn.state(), State::AppFinCloseWait);
    record(&p, seen);

    // PeerCloseWait2: the peer shut down writing but never closes.
    let mut p = pair();
    shut_wr(&mut p, Side::A);
    p.settle();
    shut_wr(&mut p, Side::B);
    p.settle();
    close(&mut p, Side::A);
    p.settle();
    assert_eq!(p.a.conn.state(), State::PeerCloseWait2);
    let cdcs_before = p.a.conn.stats().cdc_sent;
    p.knobs.deliver_tcp_rst = false;
    p.drive();
    assert_eq!(p.a.conn.state(), State::Closed);
    assert_eq!(p.a.conn.error(), Some(ConnError::TimedOut));
    assert_eq!(p.a.conn.stats().cdc_sent, cdcs_before, "no flows after C");
    assert_eq!(p.b.conn.state(), State::AppCloseWait2);
    record(&p, seen);

    // PeerAbortWait: the abort reply is lost.
    let mut p = pair();
    p.knobs.drop_from_b = true;
    abort(&mut p, Side::A);
    assert_eq!(p.a.conn.state(), State::PeerAbortWait);
    assert!(p.a.conn.timer(ConnTimer::PeerAbortWait).is_some());
    p.drive();
    assert_eq!(p.a.conn.state(), State::Closed);
    assert_eq!(p.b.conn.state(), State::Closed);
    record(&p, seen);
}

/// Active abort, passive abort, and the TCP RST interplay.
fn sc_abort(seen: &mut Seen) {
    let mut p = pair();
    p.app_send(Side::B, b"in flight");
    p.b.auto_read = false;
    p.a.auto_read = false;
    p.pump(Side::B);
    abort(&mut p, Side::A);
    assert_eq!(p.a.conn.state(), State::PeerAbortWait);
    assert_eq!(
        p.a.conn.error(),
        Some(ConnError::Aborted(AbortReason::ApplicationAbort))
    );
    assert!(p.a.saw(Event::SendTcpReset));
    // A ignores B's data while waiting.
    p.deliver_next();
    assert_eq!(p.a.conn.stats().cdc_ignored, 1);
    let m = deliver_cdc(&mut p, Side::B);
    assert!(m.conn_flags.peer_abnormal_close);
    // B: passive abort, replies and closes.
    assert_eq!(p.b.conn.state(), State::Closed);
    assert_eq!(
        p.b.conn.error(),
        Some(ConnError::Reset(AbortReason::PeerAbort))
    );
    // The TCP RST reaches B after the SMC-R abort: nothing more happens there.
    p.settle();
    assert_eq!(p.a.conn.state(), State::Closed);
    assert!(p.trace.iter().any(|t| t.from == Side::B
        && matches!(t.what, crate::harness::Wire::Cdc(m) if m.conn_flags.peer_abnormal_close)));
    assert_eq!(p.b.conn.stats().aborts.get(AbortReason::TcpReset), 0);
    assert_eq!(p.b.conn.stats().cdc_sent, 2, "data, then the abort reply");
    record(&p, seen);

    // TCP RST first: B starts an abort of its own.
    let mut p = pair();
    let t = now(&p);
    p.b.conn.handle_tcp_reset(t);
    p.flush(Side::B);
    assert_eq!(p.b.conn.state(), State::PeerAbortWait);
    assert_eq!(
        p.b.conn.error(),
        Some(ConnError::Reset(AbortReason::TcpReset))
    );
    assert!(!p.b.saw(Event::SendTcpReset), "the RST came from outside");
    p.settle();
    assert_eq!(states(&p), (State::Closed, State::Closed));
    record(&p, seen);

    // Both abort at once: both take the active path.
    let mut p = pair();
    abort(&mut p, Side::A);
    abort(&mut p, Side::B);
    p.settle();
    assert_eq!(states(&p), (State::Closed, State::Closed));
    assert_eq!(
        p.a.conn.error(),
        Some(ConnError::Aborted(AbortReason::ApplicationAbort))
    );
    record(&p, seen);
}

/// close() with unread data resets; a peer close with data still to write resets.
fn sc_abnormal_closes(seen: &mut Seen) {
    let mut p = pair();
    p.b.auto_read = false;
    p.app_send(Side::A, b"never read");
    p.settle();
    close(&mut p, Side::B);
    assert_eq!(p.b.conn.state(), State::PeerAbortWait);
    assert_eq!(
        p.b.conn.error(),
        Some(ConnError::Aborted(AbortReason::UnreadDataOnClose))
    );
    p.settle();
    assert_eq!(states(&p), (State::Closed, State::Closed));
    assert_eq!(
        p.a.conn.error(),
        Some(ConnError::Reset(AbortReason::PeerAbort))
    );
    record(&p, seen);

    // A has data it cannot write (B's window is full and B never reads); B closes.
    let mut p = Pair::symmetric(RmbeLayout::Linux, 1000);
    p.b.auto_read = false;
    p.app_send(Side::A, &stream(0, 1500));
    p.settle();
    let t = now(&p);
    p.b.conn.shutdown_read(t).expect("ok");
    p.b.auto_read = false;
    close(&mut p, Side::B);
    p.settle();
    assert_eq!(
        p.a.conn.error(),
        Some(ConnError::Reset(AbortReason::PeerClosedWithPendingData))
    );
    assert_eq!(
        p.a.conn
            .stats()
            .aborts
            .get(AbortReason::PeerClosedWithPendingData),
        1
    );
    record(&p, seen);
}

/// close() while data is still to be written completes once it is written.
fn sc_pending_close(seen: &mut Seen) {
    let mut p = Pair::symmetric(RmbeLayout::Rfc, 1000);
    p.b.auto_read = false;
    let data = stream(0, 2500);
    p.app_send(Side::A, &data);
    p.settle();
    close(&mut p, Side::A);
    assert_eq!(p.a.conn.state(), State::Active, "close pending");
    assert!(p.wire.is_empty());
    assert!(!p.a.conn.stats().aborts.total() > 0);
    p.b.auto_read = true;
    p.settle();
    assert_eq!(p.b.rx, data);
    assert_eq!(p.b.conn.state(), State::AppCloseWait1);
    assert_eq!(p.a.conn.state(), State::PeerCloseWait1);
    close(&mut p, Side::B);
    p.settle();
    both_closed_cleanly(&p);
    // A deferred shutdown(WR) likewise.
    let mut p = Pair::symmetric(RmbeLayout::Linux, 1000);
    p.b.auto_read = false;
    p.app_send(Side::A, &stream(0, 1200));
    p.settle();
    shut_wr(&mut p, Side::A);
    assert_eq!(p.a.conn.state(), State::Active);
    p.b.auto_read = true;
    p.settle();
    assert_eq!(states(&p), (State::PeerCloseWait1, State::AppCloseWait1));
    assert_eq!(p.b.rx.len(), 1200);
    record(&p, seen);
}

/// shutdown(RD): no flow; data is discarded so the writer is never stranded.
fn sc_shutdown_read(seen: &mut Seen) {
    let mut p = Pair::symmetric(RmbeLayout::Linux, 1000);
    let t = now(&p);
    p.b.conn.shutdown_read(t).expect("ok");
    p.flush(Side::B);
    assert!(p.wire.is_empty());
    assert!(p.b.conn.is_read_closed());
    p.app_send(Side::A, &stream(0, 5000));
    p.settle();
    assert!(p.b.rx.is_empty());
    assert_eq!(p.b.conn.stats().bytes_discarded, 5000);
    assert_eq!(p.a.written_total(), 5000);
    close(&mut p, Side::B);
    close(&mut p, Side::A);
    p.settle();
    both_closed_cleanly(&p);
    record(&p, seen);
}

/// Bring `side` of a fresh pair to `state`.
fn reach(state: State, local_closed: bool) -> (Pair, Side) {
    let mut p = pair();
    let side = match (state, local_closed) {
        (State::Active, _) => Side::A,
        (State::PeerCloseWait1, false) => {
            shut_wr(&mut p, Side::A);
            p.settle();
            Side::A
        }
        (State::PeerCloseWait1, true) => {
            close(&mut p, Side::A);
            p.settle();
            Side::A
        }
        (State::PeerCloseWait2, lc) => {
            shut_wr(&mut p, Side::A);
            p.settle();
            shut_wr(&mut p, Side::B);
            p.settle();
            if lc {
                close(&mut p, Side::A);
                p.settle();
            }
            Side::A
        }
        (State::AppCloseWait1, _) => {
            shut_wr(&mut p, Side::A);
            p.settle();
            Side::B
        }
        (State::AppCloseWait2, _) => {
            shut_wr(&mut p, Side::A);
            p.settle();
            shut_wr(&mut p, Side::B);
            p.settle();
            Side::B
        }
        (State::AppFinCloseWait, _) | (State::PeerFinCloseWait, _) => {
            shut_wr(&mut p, Side::A);
            p.settle();
            close(&mut p, Side::B);
            p.settle();
            if state == State::AppFinCloseWait {
                Side::A
            } else {
                Side::B
            }
        }
        (State::PeerAbortWait, _) => {
            p.knobs.drop_from_b = true;
            abort(&mut p, Side::A);
            Side::A
        }
        (s, _) => panic!("reach({s:?}) not supported"),
    };
    assert_eq!(p.peer(side).conn.state(), state);
    (p, side)
}

const REACHABLE: [(State, bool); 10] = [
    (State::Active, false),
    (State::PeerCloseWait1, false),
    (State::PeerCloseWait1, true),
    (State::PeerCloseWait2, false),
    (State::PeerCloseWait2, true),
    (State::AppCloseWait1, false),
    (State::AppCloseWait2, false),
    (State::AppFinCloseWait, false),
    (State::PeerFinCloseWait, true),
    (State::PeerAbortWait, false),
];

/// An abort from every state: PeerConnAbort before our PeerConnectionClosed, a bare TCP
/// reset after it; the peer always ends Closed with a reset error.
fn sc_abort_from_every_state(seen: &mut Seen) {
    for (state, local_closed) in REACHABLE {
        if state == State::PeerAbortWait {
            continue;
        }
        let (mut p, side) = reach(state, local_closed);
        abort(&mut p, side);
        let me = p.peer(side);
        if local_closed {
            assert_eq!(
                me.conn.state(),
                State::Closed,
                "{state:?}: no abort flow after C"
            );
        } else {
            assert_eq!(me.conn.state(), State::PeerAbortWait, "{state:?}");
        }
        assert!(me.saw(Event::SendTcpReset));
        p.drive();
        assert_eq!(states(&p), (State::Closed, State::Closed), "from {state:?}");
        let other = p.peer(side.other());
        assert!(
            matches!(other.conn.error(), Some(ConnError::Reset(_)) | None),
            "{state:?}: peer error {:?}",
            other.conn.error()
        );
        record(&p, seen);
    }
}

/// A PeerConnAbort arriving in every state.
fn sc_peer_abort_in_every_state(seen: &mut Seen) {
    for (state, local_closed) in REACHABLE {
        let (mut p, side) = reach(state, local_closed);
        let me = p.peer(side);
        let forged = smc_wire::CdcMessage {
            seqno: 1000,
            alert_token: me.conn.config().local_alert_token,
            producer: me.conn.peer_producer_cursor(),
            consumer: me.conn.peer_consumer_cursor(),
            prod_flags: Default::default(),
            conn_flags: smc_wire::ConnStateFlags {
                peer_abnormal_close: true,
                ..Default::default()
            },
        };
        p.inject(side, forged);
        let me = p.peer(side);
        assert_eq!(me.conn.state(), State::Closed, "{state:?}");
        if state != State::PeerAbortWait {
            assert_eq!(
                me.conn.error(),
                Some(ConnError::Reset(AbortReason::PeerAbort))
            );
            let reply = p.trace.last().expect("a reply");
            assert!(matches!(reply.what, crate::harness::Wire::Cdc(m)
                if m.conn_flags.peer_abnormal_close && reply.from == side));
        }
        record(&p, seen);
    }
}

/// §4.4.2: the peer reuses an RMBE we still write into: abort without flows.
fn sc_rmbe_conflict_in_every_state(seen: &mut Seen) {
    let mut quiet_closes = 0;
    for (state, local_closed) in REACHABLE {
        let (mut p, side) = reach(state, local_closed);
        let sent = p.peer(side).conn.stats().cdc_sent;
        let t = now(&p);
        let drained =
            p.peer(side).conn.peer_consumer_cursor() == p.peer(side).conn.producer_cursor();
        p.peer_mut(side).conn.handle_rmbe_conflict(t);
        p.flush(side);
        let me = p.peer(side);
        assert_eq!(me.conn.state(), State::Closed);
        assert_eq!(me.conn.stats().cdc_sent, sent, "no CDC after a conflict");
        // We closed and the peer consumed everything: the reuse completes the close.
        let quiet = matches!(state, State::PeerCloseWait1 | State::PeerCloseWait2)
            && local_closed
            && drained;
        if quiet {
            quiet_closes += 1;
            assert!(!me.saw(Event::SendTcpReset), "{state:?}");
            assert_eq!(me.conn.error(), None, "{state:?}");
            assert_eq!(me.conn.stats().closed_by_rmbe_reuse, 1);
        } else {
            assert!(me.saw(Event::SendTcpReset), "{state:?}");
        }
        if state != State::PeerAbortWait && !quiet {
            assert_eq!(
                me.conn.error(),
                Some(ConnError::Reset(AbortReason::RmbeConflict))
            );
        }
        record(&p, seen);
    }
    assert_eq!(quiet_closes, 2, "PeerCloseWait1/2 after our close");
}

/// The link group is lost (last link failed) in every state: Closed at once, no CDC, TCP reset.
fn sc_link_group_lost_in_every_state(seen: &mut Seen) {
    for (state, local_closed) in REACHABLE {
        let (mut p, side) = reach(state, local_closed);
        let sent = p.peer(side).conn.stats().cdc_sent;
        let t = now(&p);
        p.peer_mut(side).conn.handle_link_group_lost(t);
        p.flush(side);
        let me = p.peer(side);
        assert_eq!(me.conn.state(), State::Closed);
        assert_eq!(me.conn.stats().cdc_sent, sent, "no CDC without a link");
        assert!(me.saw(Event::SendTcpReset));
        if state != State::PeerAbortWait {
            assert_eq!(
                me.conn.error(),
                Some(ConnError::Reset(AbortReason::LinkGroupLost))
            );
        }
        record(&p, seen);
    }
    // ProcessAbort: the queued abort reply is dropped.
    let mut p = pair();
    let b = &p.b.conn;
    let abort = smc_wire::CdcMessage {
        seqno: 1,
        alert_token: b.config().local_alert_token,
        producer: b.peer_producer_cursor(),
        consumer: b.peer_consumer_cursor(),
        prod_flags: Default::default(),
        conn_flags: smc_wire::ConnStateFlags {
            peer_abnormal_close: true,
            ..Default::default()
        },
    };
    let t = now(&p);
    p.b.conn.handle_cdc(abort, t);
    p.b.conn.handle_link_group_lost(t);
    assert_eq!(p.b.conn.state(), State::Closed);
    assert_eq!(p.b.conn.poll_transmit(), None);
    p.flush(Side::B);
    record(&p, seen);
}

#[test]
fn link_group_lost_in_every_state() {
    sc_link_group_lost_in_every_state(&mut Seen::new());
}

/// A conflict while our abort reply is still queued (ProcessAbort): the reply is dropped.
fn sc_rmbe_conflict_in_process_abort(seen: &mut Seen) {
    let mut p = pair();
    let b = &p.b.conn;
    let abort = smc_wire::CdcMessage {
        seqno: 1,
        alert_token: b.config().local_alert_token,
        producer: b.peer_producer_cursor(),
        consumer: b.peer_consumer_cursor(),
        prod_flags: Default::default(),
        conn_flags: smc_wire::ConnStateFlags {
            peer_abnormal_close: true,
            ..Default::default()
        },
    };
    let t = now(&p);
    p.b.conn.handle_cdc(abort, t);
    assert_eq!(p.b.conn.state(), State::ProcessAbort);
    p.b.conn.handle_rmbe_conflict(t);
    assert_eq!(p.b.conn.state(), State::Closed);
    assert_eq!(p.b.conn.poll_transmit(), None);
    p.flush(Side::B);
    record(&p, seen);
}

#[test]
fn rmbe_conflict_in_process_abort() {
    sc_rmbe_conflict_in_process_abort(&mut Seen::new());
}

#[test]
fn close_then_close() {
    sc_close_then_close(&mut Seen::new());
}

#[test]
fn shutdown_both_then_a_closes_first() {
    sc_shutdown_both_then_a_closes_first(&mut Seen::new());
}

#[test]
fn shutdown_both_then_b_closes_first() {
    sc_shutdown_both_then_b_closes_first(&mut Seen::new());
}

#[test]
fn shutdown_then_peer_closes() {
    sc_shutdown_then_peer_closes(&mut Seen::new());
}

#[test]
fn shutdown_then_close() {
    sc_shutdown_then_close(&mut Seen::new());
}

#[test]
fn simultaneous_close() {
    sc_simultaneous_close(&mut Seen::new());
}

#[test]
fn termination_timers_expire() {
    sc_timers(&mut Seen::new());
}

#[test]
fn abort_paths() {
    sc_abort(&mut Seen::new());
}

#[test]
fn abnormal_closes() {
    sc_abnormal_closes(&mut Seen::new());
}

#[test]
fn pending_close_completes_after_writes() {
    sc_pending_close(&mut Seen::new());
}

#[test]
fn shutdown_read_discards() {
    sc_shutdown_read(&mut Seen::new());
}

#[test]
fn abort_from_every_state() {
    sc_abort_from_every_state(&mut Seen::new());
}

#[test]
fn peer_abort_in_every_state() {
    sc_peer_abort_in_every_state(&mut Seen::new());
}

#[test]
fn rmbe_conflict_in_every_state() {
    sc_rmbe_conflict_in_every_state(&mut Seen::new());
}

#[test]
fn every_transition_is_exercised() {
    let mut seen = Seen::new();
    sc_close_then_close(&mut seen);
    sc_shutdown_both_then_a_closes_first(&mut seen);
    sc_shutdown_both_then_b_closes_first(&mut seen);
    sc_shutdown_then_peer_closes(&mut seen);
    sc_shutdown_then_close(&mut seen);
    sc_simultaneous_close(&mut seen);
    sc_timers(&mut seen);
    sc_abort(&mut seen);
    sc_abnormal_closes(&mut seen);
    sc_pending_close(&mut seen);
    sc_shutdown_read(&mut seen);
    sc_abort_from_every_state(&mut seen);
    sc_peer_abort_in_every_state(&mut seen);
    sc_rmbe_conflict_in_every_state(&mut seen);
    sc_rmbe_conflict_in_process_abort(&mut seen);
    sc_link_group_lost_in_every_state(&mut seen);
    let table: Seen = TRANSITIONS
        .iter()
        .map(|t| (t.from, t.input, t.to))
        .collect();
    let missing: Vec<_> = table.difference(&seen).collect();
    assert!(missing.is_empty(), "transitions never taken: {missing:#?}");
    let extra: Vec<_> = seen.difference(&table).collect();
    assert!(extra.is_empty(), "transitions not in the table: {extra:#?}");
}

#[test]
fn transition_table_snapshot() {
    insta::assert_snapshot!("fig22_fig23_transitions", render_table());
}

#[test]
fn table_is_deterministic() {
    // No two rows share (from, input) with guards that can both hold.
    use crate::conn::state::{GuardFacts, Transition};
    for facts in [
        GuardFacts {
            local_closed: false,
            peer_closed: false,
        },
        GuardFacts {
            local_closed: true,
            peer_closed: false,
        },
        GuardFacts {
            local_closed: false,
            peer_closed: true,
        },
        GuardFacts {
            local_closed: true,
            peer_closed: true,
        },
    ] {
        for a in TRANSITIONS {
            let n = TRANSITIONS
                .iter()
                .filter(|b: &&Transition| {
                    b.from == a.from && b.input == a.input && b.guard.holds(facts)
                })
                .count();
            assert!(n <= 1, "{a:?} ambiguous under {facts:?}");
        }
    }
}

/// §4.4.2 end to end: the peer presents, for a new connection, the RMBE an old connection
/// still writes into; the old connection is aborted without flows and its local RMBE is
/// returned to the pool.
#[test]
fn rmbe_conflict_detected_at_rendezvous() {
    use crate::rmb_pool::{PeerRmbeKey, PeerRmbeRegistry, RmbPool, RmbPoolConfig};
    let mut pool = RmbPool::new(RmbPoolConfig::default()).expect("valid");
    let mut registry = PeerRmbeRegistry::new();
    let old_local = pool.allocate(smc_wire::RmbeSize(0)).expect("rmbe");
    let key = PeerRmbeKey {
        rkey: 0x1234,
        index: 5,
    };
    assert_eq!(registry.claim(key, 1u32), None);
    let mut old = pair();
    old.app_send(Side::B, b"unread data sitting in A's RMBE");
    old.a.auto_read = false;
    old.settle();
    // A new rendezvous: the peer names the same RMBE for connection 2.
    let victim = registry.claim(key, 2u32);
    assert_eq!(victim, Some(1));
    let sent = old.a.conn.stats().cdc_sent;
    let t = old.now;
    old.a.conn.handle_rmbe_conflict(t);
    old.flush(Side::A);
    assert_eq!(old.a.conn.state(), State::Closed);
    assert_eq!(old.a.conn.stats().cdc_sent, sent);
    assert_eq!(old.a.conn.readable(), 0, "local data ignored");
    assert_eq!(
        old.a.conn.error(),
        Some(ConnError::Reset(AbortReason::RmbeConflict))
    );
    assert!(old.a.saw(Event::Closed));
    pool.release(old_local.handle).expect("released");
    assert_eq!(pool.in_use(), 0);
    assert_eq!(registry.owner(key), Some(2));
}

/// After a failover our PeerConnectionClosed goes out again: the CDC that carried it may have
/// been lost with the failed link, and the peer would wait for it until its close timer.
#[test]
fn close_indication_is_sent_again_after_a_failover() {
    for state in [State::PeerCloseWait1, State::PeerCloseWait2] {
        let (mut p, side) = reach(state, true);
        let sent = p.peer(side).conn.stats().cdc_sent;
        p.peer_mut(side).conn.failover_resend();
        let m = p
            .peer_mut(side)
            .conn
            .poll_transmit()
            .expect("a CDC after the failover");
        assert!(m.conn_flags.peer_conn_closed, "{state:?}: {m:?}");
        assert_eq!(p.peer(side).conn.stats().cdc_sent, sent + 1);
        // Nothing more without another failover.
        assert!(p.peer_mut(side).conn.poll_transmit().is_none());
    }
}

/// The cursor of a PeerConnAbort counts: bytes the peer wrote and announced with the very
/// CDC that aborts (its last, as Linux sends its current cursors with the abort) are kept
/// for the application ahead of the reset, as TCP delivers what came before a RST. A cursor
/// that does not validate announces nothing; the connection is reset all the same.
#[test]
fn a_peer_abort_keeps_the_bytes_its_cursor_announces() {
    for forged in [false, true] {
        let mut p = pair();
        let t = now(&p);
        p.a.conn.set_nodelay(true, t);
        p.a.conn.produced(100, t).expect("produce");
        let mut m = p.a.conn.poll_transmit().expect("the data CDC");
        m.conn_flags.peer_abnormal_close = true;
        if forged {
            // Past what our RMBE can hold unread: an overrun.
            m.producer = smc_wire::Cursor {
                wrap: m.producer.wrap.wrapping_add(3),
                ..m.producer
            };
        }
        p.b.conn.handle_cdc(m, t);
        assert_eq!(
            p.b.conn.error(),
            Some(ConnError::Reset(AbortReason::PeerAbort))
        );
        assert_eq!(
            p.b.conn.readable(),
            0,
            "reads go through the runtime's copy"
        );
        let kept = p.b.conn.unread_at_reset().map(|r| r.total());
        assert_eq!(
            kept,
            if forged { None } else { Some(100) },
            "forged: {forged}"
        );
    }
}

/// The peer's end of writing is known as soon as its PeerDoneWriting arrives, also while bytes
/// before it are unread (`is_read_shut`, what TCP's RDHUP reports); the end of stream comes
/// only once they are read (`is_read_closed`).
#[test]
fn read_shut_before_the_unread_bytes_are_read() {
    let mut p = pair();
    assert!(!p.b.conn.is_read_shut());
    p.app_send(Side::A, b"last bytes");
    p.pump(Side::A);
    deliver_cdc(&mut p, Side::B);
    assert!(!p.b.conn.is_read_shut(), "data alone does not end reading");
    shut_wr(&mut p, Side::A);
    let m = deliver_cdc(&mut p, Side::B);
    assert!(m.conn_flags.peer_done_writing);
    assert_eq!(p.b.conn.readable(), 10);
    assert!(p.b.conn.is_read_shut());
    assert!(!p.b.conn.is_read_closed());
    assert_eq!(p.read(Side::B, usize::MAX), 10);
    assert!(p.b.conn.is_read_shut() && p.b.conn.is_read_closed());
}
