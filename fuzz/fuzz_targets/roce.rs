//! Fuzz the RoCEv2 packet parser and the ICRC check (UDP payloads from an untrusted peer).
#![no_main]

use std::net::{IpAddr, Ipv4Addr};

use libfuzzer_sys::fuzz_target;
use smc_wire::roce::{IcrcHeaders, Packet};

fuzz_target!(|data: &[u8]| {
    let h = IcrcHeaders::new(
        IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)),
        IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)),
        49441,
    );
    let _ = h.verify(data);
    let _ = h.solve_ipv4_id(data);
    if let Ok(p) = Packet::parse(data) {
        assert!(p.payload.len() <= data.len());
        let repr = p.repr();
        let mut out = vec![0u8; repr.buffer_len()];
        let n = repr.emit(&mut out).expect("a parsed packet re-emits");
        // The emitter derives the pad from the payload; with a consistent pad count the
        // packet has its received length.
        if smc_wire::roce::pad_len(p.payload.len()) == usize::from(p.bth.pad) {
            assert_eq!(n, data.len());
        }
    }
});
