//! A received packet's way in: the checks every packet passes before its QP sees it (rocev2.md
//! 9.1 step 1: parse, ICRC, P_Key, destination QP and its state, source address), then the
//! requester side (an ACK or NAK) or the responder side (a request) of that QP, and the ACKs
//! one receive batch owes. rx.rs receives the datagrams; device.rs cuts them into packets.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use smc_wire::roce::{IcrcHeaders, IcrcPrefix, Opcode, Packet};

use super::device::{bump, Dest, RoceCore, Tables};
use super::qp::{RoceQp, PREFIX_MIN_PACKETS};
use crate::types::QpState;

/// What one receive batch owes: the QPs with an ACK to send. ACKs are cumulative, so one per
/// QP per batch, for the highest AckReq PSN executed, answers them all (rocev2.md 8.3).
#[derive(Default)]
pub(crate) struct RxBatch {
    pub(super) acks: Vec<Arc<RoceQp>>,
}

impl RxBatch {
    pub(crate) fn flush(&mut self, _core: &RoceCore) {
        if self.acks.is_empty() {
            return;
        }
        let now = Instant::now();
        for qp in self.acks.drain(..) {
            qp.flush_ack(now);
        }
    }
}

/// Where a received datagram came from, for the checks of each of its packets: built once per
/// datagram (per packet, the address, port and ICRC headers were rebuilt and passed by value,
/// and reading them back stalled on store forwarding: a third of `receive`'s own samples).
pub(crate) struct RxFrom {
    /// The sender's address.
    pub(crate) src: IpAddr,
    /// Our GID index (socket) it arrived on.
    pub(crate) via: u8,
    /// The ICRC's IP and UDP fields for packets from the sender to us, with its fixed start
    /// for the datagram's segment length hashed when the datagram holds at least
    /// [`PREFIX_MIN_PACKETS`] packets (smc-wire `IcrcPrefix`), else none.
    pub(crate) prefix: IcrcPrefix,
    /// For a datagram of at least four packets whose segment length suits it (seal.rs), the
    /// ICRCs of its packets four at a time.
    pub(crate) seal4: Option<super::seal::Seal4>,
}

impl RxFrom {
    /// The sender of a datagram of `packets` packets of `seg` bytes each (the last may be
    /// shorter).
    pub(crate) fn new(
        core: &RoceCore,
        src: IpAddr,
        src_port: u16,
        via: u8,
        seg: usize,
        packets: usize,
    ) -> RxFrom {
        let icrc = IcrcHeaders::new(src, core.local_ip(via), src_port);
        RxFrom {
            src,
            via,
            seal4: (packets >= 4)
                .then(|| super::seal::Seal4::new(&icrc, seg))
                .flatten(),
            prefix: if packets >= PREFIX_MIN_PACKETS {
                super::gso::icrc_prefix(&icrc, seg)
            } else {
                IcrcPrefix::none(icrc)
            },
        }
    }
}

/// One received UDP payload from `from`, likely sent with IPv4 identification `id` (packet k
/// of a coalesced datagram: k): packet checks (rocev2.md 9.1 step 1), then the requester or
/// responder side of its QP. `icrc0`: its ICRC for identification 0 where already computed.
pub(crate) fn receive(
    core: &RoceCore,
    tables: &Tables,
    batch: &mut RxBatch,
    from: &RxFrom,
    id: u16,
    buf: &[u8],
    icrc0: Option<u32>,
) {
    let (src, via) = (from.src, from.via);
    let p = match Packet::parse(buf) {
        Ok(p) => p,
        Err(_) => {
            bump(&core.counters.drop_malformed);
            return;
        }
    };
    // The ICRC: identification 0 (how this engine and any kernel socket with IP_PMTUDISC_DO
    // send) or the one expected (segment k of a UDP_SEGMENT send carries k), else the
    // identification solved from it (rxe's are hashed; rocev2.md 13.3) with the columns cached
    // per length. The expected one costs a few XORs; solving, an elimination. IPv6 has no
    // identification: its ICRC is checked in full (rocev2.md 13.3).
    let wire = buf.last_chunk::<4>().map(|t| u32::from_le_bytes(*t));
    let icrc0 = icrc0.unwrap_or_else(|| from.prefix.compute(buf));
    let fits = |w: u32| {
        if w == icrc0 {
            return true;
        }
        if !src.is_ipv4() {
            return false;
        }
        let cols = super::gso::id_columns(buf.len());
        (id != 0 && w ^ icrc0 == cols.delta(id)) || cols.solve(w ^ icrc0).is_some()
    };
    if !wire.is_some_and(fits) {
        bump(&core.counters.drop_icrc);
        return;
    }
    if p.bth.pkey & 0x7FFF != 0x7FFF {
        bump(&core.counters.drop_malformed);
        return;
    }
    let Some(qp) = tables.qps.get(&p.bth.dest_qp) else {
        bump(&core.counters.drop_unknown_qp);
        return;
    };
    let state = qp.state();
    if !matches!(state, QpState::Rtr | QpState::Rts) {
        bump(&core.counters.drop_unknown_qp);
        return;
    }
    let Some(conn) = qp.conn.get() else {
        bump(&core.counters.drop_unknown_qp);
        return;
    };
    // Only the connected peer's address may speak to a QP (RC carries no source QPN; the
    // source address is what identifies the peer), and only to the GID the QP speaks from
    // (rocev2.md 11.1: rxe checks both addresses against the QP's address vector).
    if conn.ip != (Dest { ip: src, via }) {
        bump(&core.counters.drop_wrong_source);
        return;
    }
    if p.bth.opcode == Opcode::ACKNOWLEDGE {
        if state == QpState::Rts {
            if let Some(aeth) = p.aeth {
                qp.on_ack(aeth, p.bth.psn);
            }
        }
        return;
    }
    qp.on_request(tables, batch, qp, &p);
}
