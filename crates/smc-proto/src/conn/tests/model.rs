//! Model check: random sends (normal and urgent), partial reads, deliveries, update requests
//! and clock ticks on both directions at once. The harness asserts on every RDMA WRITE that it
//! lands inside the window and continues the stream; at the end every byte must have been
//! delivered exactly once and in order.

use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::conn::{Coalescing, State};
use crate::harness::{Pair, Side};

#[derive(Debug, Clone)]
enum Op {
    Send(Side, u16),
    SendUrgent(Side, u16),
    Read(Side, u16),
    Deliver,
    RequestUpdate(Side),
    Tick,
}

fn side() -> impl Strategy<Value = Side> {
    prop_oneof![Just(Side::A), Just(Side::B)]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (side(), 1u16..3000).prop_map(|(s, n)| Op::Send(s, n)),
        1 => (side(), 1u16..200).prop_map(|(s, n)| Op::SendUrgent(s, n)),
        4 => (side(), 1u16..4000).prop_map(|(s, n)| Op::Read(s, n)),
        5 => Just(Op::Deliver),
        1 => side().prop_map(Op::RequestUpdate),
        1 => Just(Op::Tick),
    ]
}

fn base(side: Side) -> usize {
    match side {
        Side::A => 0,
        Side::B => 100,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn every_byte_once_in_order_never_past_the_window(
        rfc in any::<bool>(),
        len_a in 8u32..3000,
        len_b in 8u32..3000,
        coalesce in any::<bool>(),
        coalesce_nagle in any::<bool>(),
        ops in proptest::collection::vec(op(), 1..150),
    ) {
        let layout = if rfc { RmbeLayout::Rfc } else { RmbeLayout::Linux };
        let (mut ca, mut cb) = Pair::configs(layout, len_a);
        ca.peer_rmbe_len = len_b;
        cb.local_rmbe_len = len_b;
        if coalesce {
            let c = Coalescing { delay: Duration::from_millis(1), min_bytes: 512, while_unconsumed: coalesce_nagle };
            ca.coalescing = Some(c);
            cb.coalescing = Some(c);
        }
        let mut p = Pair::new(ca, cb);
        p.a.auto_read = false;
        p.b.auto_read = false;
        let mut sent = [0usize; 2];
        let idx = |s: Side| match s { Side::A => 0, Side::B => 1 };
        for op in ops {
            match op {
                Op::Send(s, n) => {
                    let n = usize::from(n);
                    p.app_send(s, &stream(base(s) + sent[idx(s)], n));
                    sent[idx(s)] += n;
                    p.pump(s);
                }
                Op::SendUrgent(s, n) => {
                    let n = usize::from(n);
                    let data = stream(base(s) + sent[idx(s)], n);
                    if p.peer(s).tx_urgent_len.is_none() {
                        p.app_send_urgent(s, &data);
                    } else {
                        p.app_send(s, &data);
                    }
                    sent[idx(s)] += n;
                    p.pump(s);
                }
                Op::Read(s, n) => {
                    p.read(s, usize::from(n));
                    // A reader may free room: the writer retries as an application would on
                    // its Writable event.
                }
                Op::Deliver => {
                    p.deliver_next();
                    p.pump(Side::A);
                    p.pump(Side::B);
                }
                Op::RequestUpdate(s) => {
                    prop_assert!(p.peer_mut(s).conn.request_consumer_update().is_ok());
                    p.flush(s);
                }
                Op::Tick => {
                    let t = p.now + Duration::from_millis(1);
                    p.fire_timers_until(t);
                    p.now = t;
                }
            }
            for s in [Side::A, Side::B] {
                let c = &p.peer(s).conn;
                // The shortcut the data path asks agrees with the regions it stands for.
                prop_assert_eq!(c.write_room(), c.write_regions().total());
                prop_assert_eq!(c.state(), State::Active);
                prop_assert_eq!(c.stats().aborts.total(), 0);
                let rx_so_far = p.peer(s).rx.len();
                let other = s.other();
                prop_assert_eq!(
                    &p.peer(s).rx[..],
                    &stream(base(other), rx_so_far)[..],
                    "in order, once"
                );
            }
        }
        p.a.auto_read = true;
        p.b.auto_read = true;
        p.drive();
        prop_assert_eq!(p.b.rx.len(), sent[0]);
        prop_assert_eq!(&p.b.rx[..], &stream(base(Side::A), sent[0])[..]);
        prop_assert_eq!(p.a.rx.len(), sent[1]);
        prop_assert_eq!(&p.a.rx[..], &stream(base(Side::B), sent[1])[..]);
        prop_assert!(p.a.tx.is_empty() && p.b.tx.is_empty());
    }
}
