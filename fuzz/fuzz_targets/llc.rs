//! Fuzz the LLC parser (and the LLC/CDC dispatch).
#![no_main]

use libfuzzer_sys::fuzz_target;
use smc_wire::{ControlMessage, LlcMessage};

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = LlcMessage::parse(data) {
        let again = m.to_bytes();
        assert_eq!(LlcMessage::parse(&again).expect("re-emitted LLC parses"), m);
    }
    let _ = ControlMessage::parse(data);
});
