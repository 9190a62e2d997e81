//! The SMC TCP experimental option (RFC 7609 A.1, RFC 6994 layout; wire-formats.md §2).
//!
//! Both peers announce SMC-R capability on the SYN and SYN-ACK with TCP option kind 254,
//! length 6, experiment ID `E2 D4 C3 D9`. Only when both carried it do the peers run CLC.

use crate::error::{Error, Result};
use crate::EYECATCHER_SMCR;

/// TCP option kind 254: shared experimental option (RFC 6994).
pub const KIND_EXPERIMENTAL: u8 = 254;
/// Length of the SMC option: kind, length and the 4-byte ExID.
pub const OPTION_LEN: u8 = 6;
/// The option as Linux emits it: two NOPs for alignment, then kind, length and ExID.
pub const LINUX_ALIGNED: [u8; 8] = [0x01, 0x01, 0xFE, 0x06, 0xE2, 0xD4, 0xC3, 0xD9];

/// The 6 option bytes `FE 06 E2 D4 C3 D9`.
pub fn option_bytes() -> [u8; 6] {
    [
        KIND_EXPERIMENTAL,
        OPTION_LEN,
        EYECATCHER_SMCR[0],
        EYECATCHER_SMCR[1],
        EYECATCHER_SMCR[2],
        EYECATCHER_SMCR[3],
    ]
}

/// Whether a single option (kind, length, data) is the SMC option: kind 254, an even length
/// of at least 6 and the ExID `E2D4C3D9` (what Linux accepts).
pub fn is_smc_option(kind: u8, data: &[u8]) -> bool {
    let len = data.len() + 2;
    kind == KIND_EXPERIMENTAL && len >= 6 && len.is_multiple_of(2) && data[..4] == EYECATCHER_SMCR
}

/// Walk a TCP options block (the bytes after the 20-byte TCP header) and report whether it
/// carries the SMC option. A malformed block (an option whose length runs past the end or is
/// below 2) is an error; End of Option List stops the walk.
pub fn find_in_options(options: &[u8]) -> Result<bool> {
    let mut i = 0usize;
    let mut found = false;
    while i < options.len() {
        match options[i] {
            0 => break,
            1 => i += 1,
            kind => {
                let len = match options.get(i + 1) {
                    Some(&l) => usize::from(l),
                    None => {
                        return Err(Error::Truncated {
                            what: "TCP option",
                            need: i + 2,
                            have: options.len(),
                        })
                    }
                };
                if len < 2 {
                    return Err(Error::Malformed {
                        what: "TCP option",
                        why: "option length below 2",
                    });
                }
                let end = i + len;
                let data = options.get(i + 2..end).ok_or(Error::Truncated {
                    what: "TCP option",
                    need: end,
                    have: options.len(),
                })?;
                if is_smc_option(kind, data) {
                    found = true;
                }
                i = end;
            }
        }
    }
    Ok(found)
}

/// Whether a whole TCP header (with options) carries the SMC option.
pub fn find_in_tcp_header(tcp: &[u8]) -> Result<bool> {
    let off = tcp
        .get(12)
        .map(|b| usize::from(b >> 4) * 4)
        .ok_or(Error::Truncated {
            what: "TCP header",
            need: 13,
            have: tcp.len(),
        })?;
    if off < 20 {
        return Err(Error::Malformed {
            what: "TCP header",
            why: "data offset below 5 words",
        });
    }
    let opts = tcp.get(20..off).ok_or(Error::Truncated {
        what: "TCP header",
        need: off,
        have: tcp.len(),
    })?;
    find_in_options(opts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linux_aligned_block() {
        assert_eq!(find_in_options(&LINUX_ALIGNED), Ok(true));
    }

    #[test]
    fn within_full_syn_options() {
        // MSS 1460, SACK permitted, timestamps, NOP, window scale 7, then the SMC option.
        let mut o = vec![
            2, 4, 0x05, 0xb4, 4, 2, 8, 10, 0, 0, 0, 1, 0, 0, 0, 0, 1, 3, 3, 7,
        ];
        o.extend_from_slice(&LINUX_ALIGNED);
        assert_eq!(find_in_options(&o), Ok(true));
        o.truncate(20);
        assert_eq!(find_in_options(&o), Ok(false));
    }

    #[test]
    fn other_experiment_ids_and_odd_lengths() {
        assert_eq!(
            find_in_options(&[0xFE, 6, 0xE2, 0xD4, 0xC3, 0xC4]),
            Ok(false)
        );
        assert_eq!(
            find_in_options(&[0xFE, 7, 0xE2, 0xD4, 0xC3, 0xD9, 0]),
            Ok(false)
        );
        assert_eq!(
            find_in_options(&[0xFE, 8, 0xE2, 0xD4, 0xC3, 0xD9, 0, 0]),
            Ok(true)
        );
        assert_eq!(find_in_options(&[0xFE, 4, 0xE2, 0xD4]), Ok(false));
    }

    #[test]
    fn eol_stops_and_bad_lengths_error() {
        assert_eq!(
            find_in_options(&[0, 0xFE, 6, 0xE2, 0xD4, 0xC3, 0xD9]),
            Ok(false)
        );
        assert!(find_in_options(&[0xFE, 6, 0xE2]).is_err());
        assert!(find_in_options(&[0xFE]).is_err());
        assert!(find_in_options(&[0xFE, 1]).is_err());
    }

    #[test]
    fn tcp_header() {
        let mut h = vec![0u8; 20];
        h[12] = 7 << 4;
        h.extend_from_slice(&LINUX_ALIGNED);
        assert_eq!(find_in_tcp_header(&h), Ok(true));
        h[12] = 4 << 4;
        assert!(find_in_tcp_header(&h).is_err());
    }
}
