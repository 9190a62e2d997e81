//! Endpoint tests, all in the deterministic two-endpoint harness ([`crate::lgr_harness`]).

mod failover;
mod fallback;
mod rendezvous;

use crate::endpoint::{EndpointEvent, TcpId};
use crate::harness::Side;
use crate::lgr_harness::EndpointPair;

/// The first TCP connection of the tests.
pub(super) const T1: TcpId = TcpId(1);

/// Whether side `s` established `tcp` over SMC-R.
pub(super) fn established(p: &EndpointPair, s: Side, tcp: TcpId) -> bool {
    p.host(s)
        .saw(|e| matches!(e, EndpointEvent::Established { tcp: t, .. } if *t == tcp))
}

/// Print the flow (visible with `--nocapture` when a test fails).
pub(super) fn dump(p: &EndpointPair) {
    for l in p.flow(false) {
        println!("{l}");
    }
}
