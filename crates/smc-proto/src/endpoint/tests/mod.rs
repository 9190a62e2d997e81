//! Endpoint tests, all in the deterministic two-endpoint harness ([`crate::lgr_harness`]).

mod appendix_c7;
mod chaos;
mod collisions;
mod exit;
mod failover;
mod fallback;
mod forged;
mod malicious;
mod pnet;
mod reads;
mod rendezvous;
mod rtoken_set;
mod v2;
mod v2_links;

use crate::endpoint::{EndpointEvent, Fallback, ResetReason, TcpId};
use crate::harness::Side;
use crate::lgr_harness::EndpointPair;

/// The first TCP connection of the tests.
pub(super) const T1: TcpId = TcpId(1);
pub(super) const T2: TcpId = TcpId(2);

/// Whether side `s` established `tcp` over SMC-R.
pub(super) fn established(p: &EndpointPair, s: Side, tcp: TcpId) -> bool {
    p.host(s)
        .saw(|e| matches!(e, EndpointEvent::Established { tcp: t, .. } if *t == tcp))
}

/// Every link group of side `s` counts, for each link, exactly the established connections
/// sending on it (the count the least loaded link is chosen by).
pub(super) fn assert_senders_counted(p: &EndpointPair, s: Side) {
    let ep = &p.host(s).ep;
    for g in ep.link_groups() {
        let mut nums: Vec<u8> = g.links.keys().copied().collect();
        let sending: Vec<u8> = g
            .conns
            .iter()
            .filter_map(|t| ep.connection_link(*t))
            .filter(|(lgr, _)| *lgr == g.id)
            .map(|(_, num)| num)
            .collect();
        nums.extend(sending.iter().copied());
        nums.sort_unstable();
        nums.dedup();
        for num in nums {
            let want = sending.iter().filter(|n| **n == num).count();
            assert_eq!(
                g.senders_on(num),
                want,
                "{s:?} group {:?} link {num}: senders counted",
                g.id
            );
        }
    }
}

/// Print the flow (visible with `--nocapture` when a test fails).
pub(super) fn dump(p: &EndpointPair) {
    for l in p.flow(false) {
        println!("{l}");
    }
}

/// The fallback reason reported on side `s` for `tcp`.
pub(super) fn fell_back(p: &EndpointPair, s: Side, tcp: TcpId) -> Option<Fallback> {
    p.host(s).events.iter().find_map(|(_, e)| match e {
        EndpointEvent::FellBack { tcp: t, reason, .. } if *t == tcp => Some(*reason),
        _ => None,
    })
}

/// The reset reason reported on side `s` for `tcp`.
pub(super) fn reset(p: &EndpointPair, s: Side, tcp: TcpId) -> Option<ResetReason> {
    p.host(s).events.iter().find_map(|(_, e)| match e {
        EndpointEvent::Reset { tcp: t, reason } if *t == tcp => Some(*reason),
        _ => None,
    })
}
