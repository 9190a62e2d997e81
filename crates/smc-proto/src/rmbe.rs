//! RMB elements (RMBEs): layout, eye catcher and cursor arithmetic (RFC 7609 §4.2–§4.4).
//!
//! An RMBE is a wrapping receive buffer written by the peer with RDMA WRITEs. Positions in it
//! are [`Cursor`]s: a byte offset plus a wrap sequence number. [`RmbeRing`] does all cursor
//! arithmetic for one RMBE and never panics, whatever cursor a peer presents.

use smc_wire::Cursor;

/// Length of the RFC-mode RMBE eye catcher.
pub const EYE_CATCHER_LEN: u32 = 4;

/// The eye catcher this implementation writes at the start of every RFC-mode RMBE: "RMBE" in
/// EBCDIC. RFC 7609 §4.2 leaves the contents implementation dependent.
pub const EYE_CATCHER: [u8; 4] = [0xD9, 0xD4, 0xC2, 0xC5];

/// How an RMBE is laid out; one layout per link group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RmbeLayout {
    /// RFC 7609 §4.2: a 4-byte eye catcher starts every RMBE; cursors start and wrap at 4.
    Rfc,
    /// Linux `net/smc` (wire-formats.md §1 row 1): no eye catcher; cursors start and wrap at 0.
    Linux,
}

impl RmbeLayout {
    /// Offset of the first data byte in an RMBE (where cursors start and wrap).
    pub const fn data_start(self) -> u32 {
        match self {
            RmbeLayout::Rfc => EYE_CATCHER_LEN,
            RmbeLayout::Linux => 0,
        }
    }

    /// Prepare an RMBE's memory before it is assigned to a connection: zero it and, in RFC
    /// mode, write the eye catcher.
    //= https://www.rfc-editor.org/rfc/rfc7609#section-4.4.1
    //# Initialization of an RMBE must include the following: o Zeroing out the entire RMBE
    //# receive buffer [...] o Setting the beginning RMBE eye catcher.
    pub fn initialize(self, element: &mut [u8]) {
        element.fill(0);
        if self == RmbeLayout::Rfc {
            if let Some(head) = element.get_mut(..EYE_CATCHER.len()) {
                head.copy_from_slice(&EYE_CATCHER);
            }
        }
    }

    /// Whether `head` (the first 4 bytes of an RMBE) holds an intact eye catcher; always true
    /// in Linux mode, which has none.
    pub fn eye_catcher_intact(self, head: [u8; 4]) -> bool {
        match self {
            RmbeLayout::Rfc => head == EYE_CATCHER,
            RmbeLayout::Linux => true,
        }
    }
}

/// A contiguous byte range inside an RMBE: `offset` from the start of the element.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Region {
    /// Offset from the start of the RMBE (eye catcher included).
    pub offset: u32,
    /// Number of bytes.
    pub len: u32,
}

/// Up to two regions of one RMBE: a range that wraps is split at the end of the element.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Regions {
    /// The first range (from the cursor towards the end of the element).
    pub first: Region,
    /// The wrapped part, starting at the data start; `len == 0` when the range does not wrap.
    pub second: Region,
}

impl Regions {
    /// Total bytes in both ranges.
    pub fn total(&self) -> u32 {
        self.first.len + self.second.len
    }

    /// Whether no byte is available.
    pub fn is_empty(&self) -> bool {
        self.total() == 0
    }

    /// The non-empty ranges in order.
    pub fn iter(&self) -> impl Iterator<Item = Region> {
        [self.first, self.second].into_iter().filter(|r| r.len > 0)
    }

    /// The same regions cut down to at most `max` bytes.
    pub fn truncate(&self, max: u32) -> Regions {
        let first_len = self.first.len.min(max);
        let second_len = self.second.len.min(max - first_len);
        Regions {
            first: Region {
                offset: self.first.offset,
                len: first_len,
            },
            second: Region {
                offset: self.second.offset,
                len: second_len,
            },
        }
    }
}

/// Why two cursors are not in the expected order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CursorOrder {
    /// The later cursor lies before the earlier one (it moved backwards).
    Backwards,
    /// The later cursor lies more than one full buffer after the earlier one.
    TooFar,
    /// A cursor lies outside the data area of the RMBE.
    OutOfBounds,
}

/// The data area of one RMBE, `[data_start, len)`, and arithmetic on cursors into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RmbeRing {
    start: u32,
    len: u32,
}

/// An RMBE too small to hold a data byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("RMBE of {len} bytes has no data area with layout {layout:?}")]
pub struct RmbeTooSmall {
    /// The rejected length.
    pub len: u32,
    /// The layout in effect.
    pub layout: RmbeLayout,
}

impl RmbeRing {
    /// The ring of an RMBE of `len` bytes (eye catcher included) in `layout`.
    pub fn new(layout: RmbeLayout, len: u32) -> Result<RmbeRing, RmbeTooSmall> {
        let start = layout.data_start();
        if len <= start {
            return Err(RmbeTooSmall { len, layout });
        }
        Ok(RmbeRing { start, len })
    }

    /// Offset of the first data byte.
    pub fn data_start(&self) -> u32 {
        self.start
    }

    /// Length of the RMBE, eye catcher included.
    pub fn rmbe_len(&self) -> u32 {
        self.len
    }

    /// Bytes of data the RMBE holds when full.
    pub fn capacity(&self) -> u32 {
        self.len - self.start
    }

    /// The cursor of a new connection: the data start, wrap 0.
    //= https://www.rfc-editor.org/rfc/rfc7609#section-4.7
    //# Note that the cursor values in the diagram reflect the necessity of skipping over
    //# the eye catcher in the RMBE data area.  They start and wrap at 4, not 0.
    pub fn initial(&self) -> Cursor {
        Cursor::new(0, self.start)
    }

    /// Whether `c` points into the data area.
    pub fn contains(&self, c: Cursor) -> bool {
        c.count >= self.start && c.count < self.len
    }

    /// `c` moved forward by `n` bytes (`n` at most the capacity; larger values are clamped).
    pub fn advance(&self, c: Cursor, n: u32) -> Cursor {
        let cap = u64::from(self.capacity());
        // Clamp so that even a cursor outside the data area cannot produce one.
        let here = u64::from(c.count.saturating_sub(self.start)).min(cap - 1);
        let off = here + u64::from(n).min(cap);
        if off >= cap {
            // off - cap < cap <= u32::MAX, so the conversion cannot fail.
            let rest = u32::try_from(off - cap).unwrap_or(0);
            Cursor::new(c.wrap.wrapping_add(1), self.start + rest)
        } else {
            let rest = u32::try_from(off).unwrap_or(0);
            Cursor::new(c.wrap, self.start + rest)
        }
    }

    /// `c` moved back by one byte (the position of the last byte before `c`).
    pub fn retreat_one(&self, c: Cursor) -> Cursor {
        if c.count <= self.start {
            Cursor::new(c.wrap.wrapping_sub(1), self.len - 1)
        } else {
            Cursor::new(c.wrap, c.count - 1)
        }
    }

    /// Bytes from `from` to `to`, where `to` must not be before `from` and at most one full
    /// buffer after it (the wrap count tells a full buffer from an empty one).
    pub fn distance(&self, from: Cursor, to: Cursor) -> Result<u32, CursorOrder> {
        if !self.contains(from) || !self.contains(to) {
            return Err(CursorOrder::OutOfBounds);
        }
        let wraps = to.wrap.wrapping_sub(from.wrap) as i16;
        match wraps {
            0 if to.count >= from.count => Ok(to.count - from.count),
            0 => Err(CursorOrder::Backwards),
            1 if to.count <= from.count => Ok(self.capacity() - (from.count - to.count)),
            1 => Err(CursorOrder::TooFar),
            w if w < 0 => Err(CursorOrder::Backwards),
            _ => Err(CursorOrder::TooFar),
        }
    }

    /// The regions of `n` bytes starting at cursor `from` (`n` is clamped to the capacity).
    pub fn regions(&self, from: Cursor, n: u32) -> Regions {
        let n = n.min(self.capacity());
        if !self.contains(from) || n == 0 {
            return Regions::default();
        }
        let to_end = self.len - from.count;
        let first_len = n.min(to_end);
        Regions {
            first: Region {
                offset: from.count,
                len: first_len,
            },
            second: Region {
                offset: self.start,
                len: n - first_len,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rfc10k() -> RmbeRing {
        RmbeRing::new(RmbeLayout::Rfc, 10_000).expect("valid ring")
    }

    #[test]
    fn rfc_cursors_start_and_wrap_at_4() {
        let r = rfc10k();
        assert_eq!(r.initial(), Cursor::new(0, 4));
        assert_eq!(r.capacity(), 9996);
        assert_eq!(r.advance(Cursor::new(0, 4), 1000), Cursor::new(0, 1004));
        assert_eq!(r.advance(Cursor::new(1, 1004), 9996), Cursor::new(2, 1004));
        assert_eq!(r.advance(Cursor::new(0, 9999), 1), Cursor::new(1, 4));
        assert_eq!(r.retreat_one(Cursor::new(1, 4)), Cursor::new(0, 9999));
    }

    #[test]
    fn distance_tells_full_from_empty() {
        let r = rfc10k();
        assert_eq!(
            r.distance(Cursor::new(1, 1004), Cursor::new(1, 1004)),
            Ok(0)
        );
        assert_eq!(
            r.distance(Cursor::new(1, 1004), Cursor::new(2, 1004)),
            Ok(9996)
        );
        assert_eq!(
            r.distance(Cursor::new(1, 1004), Cursor::new(2, 1005)),
            Err(CursorOrder::TooFar)
        );
        assert_eq!(
            r.distance(Cursor::new(1, 1004), Cursor::new(1, 1003)),
            Err(CursorOrder::Backwards)
        );
        assert_eq!(
            r.distance(Cursor::new(1, 1004), Cursor::new(0, 5000)),
            Err(CursorOrder::Backwards)
        );
        assert_eq!(
            r.distance(Cursor::new(u16::MAX, 9000), Cursor::new(0, 10)),
            Ok(1006)
        );
        assert_eq!(
            r.distance(Cursor::new(0, 4), Cursor::new(0, 2)),
            Err(CursorOrder::OutOfBounds)
        );
    }

    #[test]
    fn regions_split_at_the_end() {
        let r = rfc10k();
        let g = r.regions(Cursor::new(1, 1004), 9996);
        assert_eq!(
            g.first,
            Region {
                offset: 1004,
                len: 8996
            }
        );
        assert_eq!(
            g.second,
            Region {
                offset: 4,
                len: 1000
            }
        );
        assert_eq!(g.truncate(9000).second.len, 4);
        let l = RmbeRing::new(RmbeLayout::Linux, 16).expect("valid ring");
        let g = l.regions(Cursor::new(0, 10), 8);
        assert_eq!(g.first, Region { offset: 10, len: 6 });
        assert_eq!(g.second, Region { offset: 0, len: 2 });
    }

    #[test]
    fn initialize_zeroes_and_sets_eye_catcher() {
        let mut m = vec![0xAAu8; 32];
        RmbeLayout::Rfc.initialize(&mut m);
        assert_eq!(m[..4], EYE_CATCHER);
        assert!(m[4..].iter().all(|&b| b == 0));
        assert!(RmbeLayout::Rfc.eye_catcher_intact(EYE_CATCHER));
        assert!(!RmbeLayout::Rfc.eye_catcher_intact([0; 4]));
        RmbeLayout::Linux.initialize(&mut m);
        assert!(m.iter().all(|&b| b == 0));
        assert!(RmbeLayout::Linux.eye_catcher_intact([1, 2, 3, 4]));
        assert!(RmbeRing::new(RmbeLayout::Rfc, 4).is_err());
    }
}
