//! Random termination sequences: closes, shutdowns, aborts, TCP resets and data from both
//! sides with random delivery order in time. Whatever happens, every state change is a row of
//! the transition table (the engine debug-asserts it), nothing livelocks, and once the clock
//! has run out both RMBEs are free (Closed) or still legitimately waiting for their own
//! application.

use proptest::prelude::*;

use super::*;
use crate::conn::{Event, State};
use crate::harness::{Pair, Side};

#[derive(Debug, Clone)]
enum Op {
    Send(Side, u16),
    Read(Side),
    ShutdownWrite(Side),
    ShutdownRead(Side),
    Close(Side),
    Abort(Side),
    TcpReset(Side),
    Deliver,
}

fn side() -> impl Strategy<Value = Side> {
    prop_oneof![Just(Side::A), Just(Side::B)]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (side(), 1u16..2000).prop_map(|(s, n)| Op::Send(s, n)),
        3 => side().prop_map(Op::Read),
        1 => side().prop_map(Op::ShutdownWrite),
        1 => side().prop_map(Op::ShutdownRead),
        2 => side().prop_map(Op::Close),
        1 => side().prop_map(Op::Abort),
        1 => side().prop_map(Op::TcpReset),
        4 => Just(Op::Deliver),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn termination_always_converges(
        rfc in any::<bool>(),
        ops in proptest::collection::vec(op(), 1..40),
    ) {
        let layout = if rfc { RmbeLayout::Rfc } else { RmbeLayout::Linux };
        let mut p = Pair::symmetric(layout, 1024);
        p.a.auto_read = false;
        p.b.auto_read = false;
        let mut closed_by_app = [false; 2];
        let i = |s: Side| usize::from(s == Side::B);
        for op in ops {
            let t = p.now;
            match op {
                Op::Send(s, n) => {
                    if !closed_by_app[i(s)] {
                        p.app_send(s, &stream(0, usize::from(n)));
                        p.pump(s);
                    }
                }
                Op::Read(s) => {
                    p.read(s, usize::MAX);
                }
                Op::ShutdownWrite(s) => {
                    // send() after shutdown(SHUT_WR) fails in the socket layer.
                    closed_by_app[i(s)] = true;
                    let _ = p.peer_mut(s).conn.shutdown_write(t);
                    p.flush(s);
                }
                Op::ShutdownRead(s) => {
                    let _ = p.peer_mut(s).conn.shutdown_read(t);
                    p.flush(s);
                }
                Op::Close(s) => {
                    closed_by_app[i(s)] = true;
                    prop_assert!(p.peer_mut(s).conn.close(t).is_ok());
                    p.flush(s);
                }
                Op::Abort(s) => {
                    closed_by_app[i(s)] = true;
                    p.peer_mut(s).conn.abort(t);
                    p.flush(s);
                }
                Op::TcpReset(s) => {
                    p.peer_mut(s).conn.handle_tcp_reset(t);
                    p.flush(s);
                }
                Op::Deliver => {
                    p.deliver_next();
                    p.pump(Side::A);
                    p.pump(Side::B);
                }
            }
            // In every state (closing, shut down, aborted), the data path's shortcut agrees
            // with the regions it stands for.
            for s in [Side::A, Side::B] {
                let c = &p.peer(s).conn;
                prop_assert_eq!(c.write_room(), c.write_regions().total());
            }
        }
        // Every application that has not closed now closes, reading what is left first (a
        // runtime drains its send buffer before the close completes).
        for s in [Side::A, Side::B] {
            {
                p.read(s, usize::MAX);
                let t = p.now;
                prop_assert!(p.peer_mut(s).conn.close(t).is_ok());
                p.flush(s);
            }
        }
        p.a.auto_read = true;
        p.b.auto_read = true;
        p.drive();
        for s in [Side::A, Side::B] {
            let peer = p.peer(s);
            prop_assert_eq!(peer.conn.state(), State::Closed, "{:?}", s);
            prop_assert!(peer.saw(Event::Closed));
            prop_assert_eq!(peer.conn.poll_timeout(), None);
            let closed_events = peer.events.iter().filter(|(_, e)| *e == Event::Closed).count();
            prop_assert_eq!(closed_events, 1);
        }
    }
}
