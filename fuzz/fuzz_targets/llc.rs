//! Fuzz the LLC parsers of both versions (and the LLC/CDC dispatch): any input either fails
//! cleanly or parses into a message whose re-emitted bytes parse to the same message.
#![no_main]

use libfuzzer_sys::fuzz_target;
use smc_wire::llc_v2::LlcV2Message;
use smc_wire::{ControlMessage, LlcMessage, SendMessage};

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = LlcMessage::parse(data) {
        let again = m.to_bytes();
        assert_eq!(LlcMessage::parse(&again).expect("re-emitted LLC parses"), m);
    }
    // LLC v2: the whole input is one SEND of up to 8192 bytes.
    if let Ok(m) = LlcV2Message::parse(data) {
        let again = m.to_vec();
        assert!(again.len() >= 44 && again.len() <= 8192);
        assert_eq!(
            LlcV2Message::parse(&again).expect("re-emitted LLC v2 parses"),
            m
        );
    }
    let _ = ControlMessage::parse(data);
    let _ = SendMessage::parse(data);
});
