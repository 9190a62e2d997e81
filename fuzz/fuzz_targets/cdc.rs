//! Fuzz the CDC parser and its zero-copy view.
#![no_main]

use libfuzzer_sys::fuzz_target;
use smc_wire::{CdcMessage, CdcPacket};

fuzz_target!(|data: &[u8]| {
    if let Ok(p) = CdcPacket::new_checked(data) {
        let m = CdcMessage::from_packet(&p);
        assert_eq!(CdcMessage::parse(&m.to_bytes()).expect("re-emitted CDC parses"), m);
    }
});
