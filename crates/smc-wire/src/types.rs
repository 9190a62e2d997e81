//! Value types shared by CLC, LLC and CDC messages (wire-formats.md §10).

use core::fmt;

use crate::error::{Error, Result};

/// Declares a wire enumeration as a newtype over its integer, with named constants, so that
/// values we do not know survive a parse/emit round trip (a newer peer's value is kept, not lost).
macro_rules! wire_enum {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident($int:ty) {
            $( $(#[$cmeta:meta])* $const:ident = $val:expr => $text:expr, )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
        $vis struct $name(pub $int);

        impl $name {
            $( $(#[$cmeta])* pub const $const: $name = $name($val); )*

            /// Every value this implementation has a name for.
            pub const KNOWN: &'static [$name] = &[$($name::$const),*];

            /// The human description of a known value, `None` for an unknown one.
            pub fn description(self) -> Option<&'static str> {
                match self.0 {
                    $( v if v == $val => Some($text), )*
                    _ => None,
                }
            }

            /// Whether this value is one this implementation knows.
            pub fn is_known(self) -> bool {
                self.description().is_some()
            }
        }

        impl core::fmt::Debug for $name {
            fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
                match self.0 {
                    $( v if v == $val => write!(f, concat!(stringify!($name), "::", stringify!($const))), )*
                    v => write!(f, concat!(stringify!($name), "({:#x})"), v),
                }
            }
        }

        impl core::fmt::Display for $name {
            fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
                match self.description() {
                    Some(t) => write!(f, "{:#x} ({})", self.0, t),
                    None => write!(f, "{:#x} (unknown)", self.0),
                }
            }
        }
    };
}
pub(crate) use wire_enum;

/// A 24-bit unsigned value (QP numbers and packet sequence numbers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct U24(u32);

impl U24 {
    /// The largest 24-bit value.
    pub const MAX: U24 = U24(0x00FF_FFFF);

    /// A 24-bit value, or an error if `v` does not fit in 24 bits.
    pub fn new(v: u32) -> Result<U24> {
        if v <= Self::MAX.0 {
            Ok(U24(v))
        } else {
            Err(Error::BadValue {
                field: "24-bit value",
                value: u64::from(v),
            })
        }
    }

    /// The low 24 bits of `v`.
    pub const fn truncate(v: u32) -> U24 {
        U24(v & 0x00FF_FFFF)
    }

    /// The value.
    pub const fn get(self) -> u32 {
        self.0
    }
}

impl fmt::Display for U24 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#08x}", self.0)
    }
}

/// An InfiniBand/RoCE GID: 16 bytes in IPv6 address format.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Gid(pub [u8; 16]);

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        core::net::Ipv6Addr::from(self.0).fmt(f)
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

/// A RoCE MAC address (6 bytes).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Mac(pub [u8; 6]);

impl fmt::Display for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            m[0], m[1], m[2], m[3], m[4], m[5]
        )
    }
}

impl fmt::Debug for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Mac({self})")
    }
}

/// The SMC-R peer ID (RFC 7609 A.2.1): a 2-byte instance number that changes whenever the
/// stack restarts, followed by the MAC of one of the sender's RNICs.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct PeerId {
    /// Instance number (random at every start).
    pub instance: u16,
    /// A RoCE MAC of the sender.
    pub mac: Mac,
}

impl PeerId {
    /// The 8 wire bytes.
    pub fn to_bytes(self) -> [u8; 8] {
        let mut b = [0u8; 8];
        b[..2].copy_from_slice(&self.instance.to_be_bytes());
        b[2..].copy_from_slice(&self.mac.0);
        b
    }

    /// From the 8 wire bytes.
    pub fn from_bytes(b: [u8; 8]) -> PeerId {
        PeerId {
            instance: u16::from_be_bytes([b[0], b[1]]),
            mac: Mac([b[2], b[3], b[4], b[5], b[6], b[7]]),
        }
    }
}

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04x}@{}", self.instance, self.mac)
    }
}

impl fmt::Debug for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PeerId({self})")
    }
}

wire_enum! {
    /// QP MTU code (4 bits; the InfiniBand path MTU enumeration). 0 and 6..15 are reserved.
    pub struct QpMtu(u8) {
        /// 256 bytes.
        MTU_256 = 1 => "256",
        /// 512 bytes.
        MTU_512 = 2 => "512",
        /// 1024 bytes.
        MTU_1024 = 3 => "1024",
        /// 2048 bytes.
        MTU_2048 = 4 => "2048",
        /// 4096 bytes.
        MTU_4096 = 5 => "4096",
    }
}

impl QpMtu {
    /// The MTU in bytes, `None` for a reserved code.
    pub fn bytes(self) -> Option<u32> {
        if self.is_known() {
            Some(128u32 << self.0)
        } else {
            None
        }
    }

    /// The code for the largest known MTU not above `bytes` (at least 256).
    pub fn from_bytes(bytes: u32) -> QpMtu {
        let mut code = QpMtu::MTU_256;
        for c in QpMtu::KNOWN {
            if let Some(b) = c.bytes() {
                if b <= bytes {
                    code = *c;
                }
            }
        }
        code
    }

    /// Check that the code is not reserved (RFC 7609 App. C.6: a reserved value → Decline).
    pub fn validate(self) -> Result<QpMtu> {
        if self.is_known() {
            Ok(self)
        } else {
            Err(Error::BadValue {
                field: "QP MTU",
                value: u64::from(self.0),
            })
        }
    }
}

/// RMBE size code (4 bits): the element size is 16 KiB · 2^code (RFC 7609 A.2.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct RmbeSize(pub u8);

impl RmbeSize {
    /// The smallest element, 16 KiB.
    pub const MIN_BYTES: u32 = 16 * 1024;
    /// The largest code SMC-R sends (512 KiB; Linux `SMCR_RMBE_SIZES`).
    pub const MAX_SENT: RmbeSize = RmbeSize(5);

    /// The element size in bytes (codes are 4 bits; 15 gives 512 MiB).
    pub fn bytes(self) -> u32 {
        Self::MIN_BYTES << (self.0 & 0x0F)
    }

    /// The smallest code whose size is at least `bytes` (capped at code 15).
    pub fn for_bytes(bytes: u32) -> RmbeSize {
        let mut code = 0u8;
        while code < 15 && RmbeSize(code).bytes() < bytes {
            code += 1;
        }
        RmbeSize(code)
    }
}

impl fmt::Display for RmbeSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({} KiB)", self.0, self.bytes() / 1024)
    }
}
