//! The reference vectors of shared/spec/test-vectors.md (hand-assembled from the layouts,
//! checked with tshark), bundled so that tests, `smc decode --example` and captures use them.

/// `(name, hex)` of every reference vector.
pub const VECTORS: &[(&str, &str)] = &[
    (
        "tcp_option",
        "0101fe06e2d4c3d9",
    ),
    (
        "clc_proposal_v4",
        "e2d4c3d901003410123498039b000001fe800000000000009a039bfffe00000198039b0000010000c0a8010018000000e2d4c3d9",
    ),
    (
        "clc_proposal_v6",
        "e2d4c3d901004510123498039b000001fe800000000000009a039bfffe00000198039b0000010000000000000000000120010db800010000000000000000000040e2d4c3d9",
    ),
    (
        "clc_proposal_linux_v2_style",
        "e2d4c3d901005c28123498039b000001fe800000000000009a039bfffe00000198039b000001002800000000000000000000000000000000000000000000000000000000000000000000000000000000c0a8010018000000e2d4c3d9",
    ),
    (
        "clc_accept_first_contact",
        "e2d4c3d902004418567898039b000002fe800000000000009a039bfffe00000298039b0000020001230000a1b20100000005230000000000f0a60000000abcdee2d4c3d9",
    ),
    (
        "clc_confirm",
        "e2d4c3d903004410123498039b000001fe800000000000009a039bfffe00000198039b0000010001240000c3d40100000006230000000000f0a4000000012345e2d4c3d9",
    ),
    (
        "clc_decline",
        "e2d4c3d904001c10567898039b0000020303000000000000e2d4c3d9",
    ),
    (
        "llc_confirm_link_req",
        "012c000398039b000002fe800000000000009a039bfffe000002000123010000010102000000000000000000",
    ),
    (
        "llc_add_link_req",
        "022c000098039b0000120000fe800000000000009a039bfffe000012000125020300a0b00000000000000000",
    ),
    (
        "llc_add_link_cont",
        "032c0000020100000000a1b20000b1c200000000f0b000000000000000000000000000000000000000000000",
    ),
    (
        "llc_delete_link_req",
        "042c002002000300000000000000000000000000000000000000000000000000000000000000000000000000",
    ),
    (
        "llc_confirm_rkey_req",
        "062c0000010000d4e500000000f0c00000020000e5f600000000f0d000000000000000000000000000000000",
    ),
    (
        "llc_delete_rkey_req",
        "092c0000010000000000d4e50000000000000000000000000000000000000000000000000000000000000000",
    ),
    (
        "llc_test_link_req",
        "072c0000000102030405060708090a0b0c0d0e0f000000000000000000000000000000000000000000000000",
    ),
    (
        "cdc_data",
        "fe2c000100000005000000000000100000000000000000000000000000000000000000000000000000000000",
    ),
    (
        "cdc_close",
        "fe2c0003000000050000000100000040000000000000c00010c0000000000000000000000000000000000000",
    ),
];

/// Variants a decoder must also accept (derived from the vectors).
pub const VARIANTS: &[(&str, &str)] = &[
    (
        "llc_confirm_link_reply",
        "012c008398039b000001fe800000000000009a039bfffe000001000124010000020102000000000000000000",
    ),
    (
        "llc_add_link_reject",
        "022c01c098039b0000120000fe800000000000009a039bfffe000012000125020300a0b00000000000000000",
    ),
    (
        "clc_decline_out_of_sync",
        "e2d4c3d904001c18567898039b0000020400000000000000e2d4c3d9",
    ),
    (
        "llc_test_link_reply",
        "072c0080000102030405060708090a0b0c0d0e0f000000000000000000000000000000000000000000000000",
    ),
];

/// The bytes of a named vector or variant.
pub fn bytes(name: &str) -> Option<Vec<u8>> {
    VECTORS
        .iter()
        .chain(VARIANTS)
        .find(|(n, _)| *n == name)
        .and_then(|(_, h)| from_hex(h))
}

/// Decode a hex string (whitespace and `:` ignored); `None` if it is not valid hex.
pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    let digits: Vec<u8> = s
        .bytes()
        .filter(|c| !c.is_ascii_whitespace() && *c != b':')
        .collect();
    if digits.len() % 2 != 0 {
        return None;
    }
    digits
        .chunks(2)
        .map(|p| {
            let hi = (p[0] as char).to_digit(16)?;
            let lo = (p[1] as char).to_digit(16)?;
            Some((hi * 16 + lo) as u8)
        })
        .collect()
}
