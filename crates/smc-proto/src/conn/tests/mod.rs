//! Tests of the connection engine, most of them through the two-peer harness.

mod close;
mod data_path;
mod figures;
mod forged;
mod model;
mod termination_model;

use smc_wire::{CdcMessage, Cursor};

use crate::harness::{InFlight, Pair, Side, Wire};
use crate::rmbe::RmbeLayout;

/// The RMBE size of the RFC 7609 §4.7 scenarios.
pub(super) const FIG_RMBE: u32 = 10_000;

/// A figure's RFC-mode cursor offset `x` mapped to `layout` (Linux cursors start at 0).
pub(super) fn pos(layout: RmbeLayout, x: u32) -> u32 {
    x - 4 + layout.data_start()
}

/// Cursor `wrap:x` of a figure, mapped to `layout`.
pub(super) fn cur(layout: RmbeLayout, wrap: u16, x: u32) -> Cursor {
    Cursor::new(wrap, pos(layout, x))
}

/// Payload bytes `start..start+len` of a recognisable stream.
pub(super) fn stream(start: usize, len: usize) -> Vec<u8> {
    (start..start + len).map(|i| (i % 251) as u8).collect()
}

/// The CDC in `m`, panicking on anything else.
pub(super) fn cdc(m: Option<InFlight>) -> CdcMessage {
    match m {
        Some(InFlight {
            what: Wire::Cdc(c), ..
        }) => c,
        other => panic!("expected a CDC, got {other:?}"),
    }
}

/// Deliver the next message, which must be a CDC to `to`.
pub(super) fn deliver_cdc(p: &mut Pair, to: Side) -> CdcMessage {
    let m = p.deliver_next();
    assert_eq!(m.map(|m| m.to), Some(to), "next message goes to {to:?}");
    cdc(m)
}

pub(super) const LAYOUTS: [RmbeLayout; 2] = [RmbeLayout::Rfc, RmbeLayout::Linux];
