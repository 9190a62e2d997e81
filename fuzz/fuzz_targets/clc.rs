//! Fuzz the CLC parsers: any input either fails cleanly or parses into a message whose
//! re-emitted bytes parse to the same message.
#![no_main]

use libfuzzer_sys::fuzz_target;
use smc_wire::tcp_option;
use smc_wire::ClcMessage;

fuzz_target!(|data: &[u8]| {
    let _ = tcp_option::find_in_options(data);
    let mut rest = data;
    while let Ok((m, used)) = ClcMessage::parse(rest) {
        assert!(used <= rest.len() && used >= 12);
        let again = m.to_vec();
        let (m2, used2) = ClcMessage::parse(&again).expect("re-emitted CLC parses");
        assert_eq!(m2, m);
        assert_eq!(used2, again.len());
        rest = &rest[used..];
    }
});
