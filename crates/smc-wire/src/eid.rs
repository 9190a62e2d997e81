//! Enterprise IDs (EIDs) of SMC version 2: 32-byte identifiers that two SMC-Rv2 peers must
//! share (smc-rv2.md §6). The user-defined ones (UEIDs) are what SMC-R peers exchange.

use core::fmt;

/// Length of an EID on the wire.
pub const EID_LEN: usize = 32;
/// Most UEIDs a Linux host keeps in its table (`SMC_MAX_UEID`), and so sends in a Proposal.
pub const MAX_UEIDS: usize = 4;
/// Most EIDs Linux accepts in a received Proposal.
pub const MAX_PROPOSAL_EIDS: usize = 8;

/// One 32-byte EID exactly as it travels: a UEID is up to 32 characters padded with ASCII
/// blanks (0x20), never NULs — the whole 32 bytes are compared, padding included.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Eid(pub [u8; EID_LEN]);

impl Default for Eid {
    fn default() -> Self {
        Eid([0; EID_LEN])
    }
}

/// Why a string is not a valid UEID (the rules Linux applies when a UEID is added).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UeidError {
    /// Nothing but blanks.
    #[error("UEID {0:?} is empty")]
    Empty(String),
    /// More than 32 characters.
    #[error("UEID {0:?} is longer than 32 characters")]
    TooLong(String),
    /// The first character is not a letter or digit.
    #[error("UEID {0:?} must start with an upper-case letter or a digit")]
    BadStart(String),
    /// A character outside A–Z, 0–9, `.` and `-` (lower case included: Linux refuses it).
    #[error("UEID {ueid:?} has {found:?} at position {pos}: only A-Z, 0-9, '.' and '-' are allowed (upper case only)")]
    BadChar {
        /// The whole UEID as given.
        ueid: String,
        /// The offending character.
        found: char,
        /// Its position, from 0.
        pos: usize,
    },
    /// Two dots in a row (refused by smc-tools' `ueid add`).
    #[error("UEID {0:?} has two consecutive dots")]
    DoubleDot(String),
}

impl Eid {
    /// Build a UEID from its text: at most 32 characters from `A–Z`, `0–9`, `.`, `-`, starting
    /// with a letter or digit, no `..`; trailing blanks are taken as padding. The result is
    /// padded with blanks to 32 bytes.
    pub fn ueid(text: &str) -> Result<Eid, UeidError> {
        let t = text.trim_end_matches(' ');
        if t.is_empty() {
            return Err(UeidError::Empty(text.to_string()));
        }
        if t.chars().count() > EID_LEN {
            return Err(UeidError::TooLong(text.to_string()));
        }
        for (pos, c) in t.chars().enumerate() {
            let ok = c.is_ascii_uppercase() || c.is_ascii_digit() || c == '.' || c == '-';
            if !ok {
                return Err(UeidError::BadChar {
                    ueid: text.to_string(),
                    found: c,
                    pos,
                });
            }
            if pos == 0 && !c.is_ascii_alphanumeric() {
                return Err(UeidError::BadStart(text.to_string()));
            }
        }
        if t.contains("..") {
            return Err(UeidError::DoubleDot(text.to_string()));
        }
        let mut b = [b' '; EID_LEN];
        b[..t.len()].copy_from_slice(t.as_bytes());
        Ok(Eid(b))
    }

    /// The EID as text without its blank padding (non-printable bytes escaped).
    pub fn text(&self) -> String {
        let end = self.0.iter().rposition(|&c| c != b' ').map_or(0, |i| i + 1);
        self.0[..end].escape_ascii().to_string()
    }

    /// Whether all 32 bytes are zero (an absent EID).
    pub fn is_zero(&self) -> bool {
        self.0.iter().all(|&b| b == 0)
    }
}

impl fmt::Debug for Eid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Eid({:?})", self.text())
    }
}

impl fmt::Display for Eid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ueid_is_blank_padded() {
        let e = Eid::ueid("KERNEL-PEER-SMCR-TEST").unwrap();
        assert_eq!(&e.0[..21], b"KERNEL-PEER-SMCR-TEST");
        assert!(e.0[21..].iter().all(|&b| b == b' '));
        assert_eq!(e.text(), "KERNEL-PEER-SMCR-TEST");
        // Trailing blanks are padding, not part of the name.
        assert_eq!(Eid::ueid("ABC  ").unwrap(), Eid::ueid("ABC").unwrap());
        assert!(Eid::ueid(&"A".repeat(32)).is_ok());
    }

    #[test]
    fn bad_ueids_name_themselves() {
        let e = Eid::ueid("lower").unwrap_err();
        assert!(e.to_string().contains("\"lower\""), "{e}");
        assert!(matches!(
            e,
            UeidError::BadChar {
                found: 'l',
                pos: 0,
                ..
            }
        ));
        assert!(matches!(Eid::ueid(""), Err(UeidError::Empty(_))));
        assert!(matches!(Eid::ueid("   "), Err(UeidError::Empty(_))));
        assert!(matches!(
            Eid::ueid(&"A".repeat(33)),
            Err(UeidError::TooLong(_))
        ));
        assert!(matches!(Eid::ueid("-AB"), Err(UeidError::BadStart(_))));
        assert!(matches!(Eid::ueid(".AB"), Err(UeidError::BadStart(_))));
        assert!(matches!(Eid::ueid("A..B"), Err(UeidError::DoubleDot(_))));
        assert!(matches!(
            Eid::ueid("A B"),
            Err(UeidError::BadChar { found: ' ', .. })
        ));
        assert!(matches!(Eid::ueid("AÄ"), Err(UeidError::BadChar { .. })));
    }
}
