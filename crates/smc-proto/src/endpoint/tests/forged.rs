//! Robustness: arbitrary peer input (LLC/CDC bytes on a link, CLC bytes on TCP) never makes
//! the endpoint panic, and the group stays consistent (proptest; cases via PROPTEST_CASES).

use proptest::prelude::*;

use super::*;

fn established_pair() -> EndpointPair {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect(T1);
    p.run();
    p
}

/// 64 cases by default; `PROPTEST_CASES` for more.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    /// Random 44-byte messages (with a plausible type byte) on both links of both sides.
    #[test]
    fn arbitrary_link_messages_never_panic(
        msgs in proptest::collection::vec(
            (any::<bool>(), any::<bool>(), 0u8..12, any::<[u8; 43]>()),
            1..12,
        )
    ) {
        let mut p = established_pair();
        for (side_a, link1, ty, rest) in msgs {
            let side = if side_a { Side::A } else { Side::B };
            let num = if link1 { 1 } else { 2 };
            let Some(link) = p.host(side).link(num) else { continue };
            let mut raw = [0u8; 44];
            raw[0] = match ty {
                10 => 0xFE,
                11 => 0x85,
                t => t,
            };
            raw[1..].copy_from_slice(&rest);
            raw[1] = 44;
            let now = p.now;
            let h = p.host_mut(side);
            h.ep.handle_message(link, &raw, &mut h.res, now);
            p.run();
        }
        p.run_for(std::time::Duration::from_secs(60));
        for s in [Side::A, Side::B] {
            for g in p.host(s).ep.link_groups() {
                // Links are keyed by their number; an active link knows its peer QP.
                for (num, l) in &g.links {
                    prop_assert_eq!(*num, l.num);
                    if l.state == crate::link_group::LinkState::Active {
                        prop_assert!(l.remote.is_some());
                    }
                }
            }
        }
    }

    /// Random CLC bytes to a server and to a client in every handshake phase.
    #[test]
    fn arbitrary_clc_bytes_never_panic(
        cut in 0usize..4,
        bytes in proptest::collection::vec(any::<u8>(), 0..120),
        eyecatcher in any::<bool>(),
    ) {
        let mut p = EndpointPair::with_devices(1, 1);
        p.connect(T1);
        for _ in 0..cut {
            p.deliver_next();
        }
        let mut b = bytes;
        if eyecatcher && b.len() >= 8 {
            b[..4].copy_from_slice(&smc_wire::EYECATCHER_SMCR);
            let len = b.len() as u16;
            b[5..7].copy_from_slice(&len.to_be_bytes());
        }
        p.inject_tcp(Side::B, T1, b.clone());
        p.inject_tcp(Side::A, T1, b);
        p.run_for(std::time::Duration::from_secs(60));
        // Every connection ended one way or another: established, fell back or reset.
        for s in [Side::A, Side::B] {
            let h = p.host(s);
            let ended = h.saw(|e| matches!(
                e,
                EndpointEvent::Established { .. }
                    | EndpointEvent::FellBack { .. }
                    | EndpointEvent::Reset { .. }
            ));
            prop_assert!(ended);
            prop_assert!(h.ep.handshake_state(T1).is_none());
        }
    }
}
