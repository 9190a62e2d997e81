//! Parse and emit errors, classified the way RFC 7609 Appendix C.6 needs them.

/// What a receiver must do about a message that failed to parse (RFC 7609 App. C.6).
///
/// RFC 7609 C.6: "If a CLC message is received that is malformed (for example, wrong
/// length, eye catcher, ...) ... the receiver must terminate" — while a well-formed message
/// carrying a value the receiver cannot use (for example a reserved QP MTU) is answered
/// with a Decline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    /// The bytes do not form a valid message (length, eye catcher, trailer, format).
    /// The connection (CLC) or link (LLC/CDC) is terminated.
    Malformed,
    /// The message is well formed but carries a value we cannot accept (for example a
    /// reserved enumeration). During CLC this leads to a Decline.
    BadValue,
    /// The caller's buffer was too small to emit into; a local programming error, not the peer's.
    Local,
}

/// An error from parsing or emitting an SMC-R message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// Fewer bytes than the message (or the part being read) needs.
    #[error("truncated {what}: need {need} bytes, have {have}")]
    Truncated {
        /// Which message or field.
        what: &'static str,
        /// Bytes needed.
        need: usize,
        /// Bytes available.
        have: usize,
    },
    /// The message's own length field does not match what its type allows.
    #[error("bad length in {what}: {found} (expected {expected})")]
    BadLength {
        /// Which message.
        what: &'static str,
        /// The length found on the wire.
        found: usize,
        /// What is allowed, in words.
        expected: &'static str,
    },
    /// The leading eye catcher is not "SMCR" (or "SMCD") in EBCDIC.
    #[error("bad eye catcher {found:02x?}")]
    BadEyeCatcher {
        /// The four bytes found.
        found: [u8; 4],
    },
    /// The trailing eye catcher of a CLC message is wrong.
    #[error("bad CLC trailer {found:02x?}")]
    BadTrailer {
        /// The four bytes found.
        found: [u8; 4],
    },
    /// A message type this implementation does not know and may not discard.
    #[error("unknown {what} type {found:#04x}")]
    UnknownType {
        /// "CLC" or "LLC".
        what: &'static str,
        /// The type byte.
        found: u8,
    },
    /// A structural inconsistency other than the above (for example an offset that points
    /// outside the message).
    #[error("malformed {what}: {why}")]
    Malformed {
        /// Which message or field.
        what: &'static str,
        /// Why, in words.
        why: &'static str,
    },
    /// A well-formed field holds a value that is reserved or unusable.
    #[error("bad value {value:#x} in {field}")]
    BadValue {
        /// The field.
        field: &'static str,
        /// The value found.
        value: u64,
    },
    /// The buffer given to `emit` is too small.
    #[error("emit buffer too small: need {need} bytes, have {have}")]
    BufferTooSmall {
        /// Bytes needed.
        need: usize,
        /// Bytes available.
        have: usize,
    },
}

impl Error {
    /// How a receiver must react to this error (RFC 7609 App. C.6).
    pub fn class(&self) -> ErrorClass {
        match self {
            Error::BadValue { .. } => ErrorClass::BadValue,
            Error::BufferTooSmall { .. } => ErrorClass::Local,
            _ => ErrorClass::Malformed,
        }
    }
}

/// Shorthand for results of this crate.
pub type Result<T> = core::result::Result<T, Error>;
