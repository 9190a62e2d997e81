//! Fuzz the capture dissector (frames from an untrusted pcap file).
#![no_main]

use libfuzzer_sys::fuzz_target;
use smc_wire::dissect::{read_capture, Dissector};

fuzz_target!(|data: &[u8]| {
    let mut d = Dissector::new();
    for frame in data.split(|b| *b == 0xA5) {
        let _ = d.frame(frame);
    }
    let _ = read_capture(data);
});
