//! Panic-free big-endian reader and writer over byte slices.
//!
//! Every read is bounds-checked and returns [`Error::Truncated`] instead of panicking;
//! [`Reader::sub`] confines a nested parse to a length the peer claimed.

use crate::error::{Error, Result};

/// A cursor over received bytes.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// A reader over `buf`; `what` names the message in errors.
    pub fn new(buf: &'a [u8], what: &'static str) -> Self {
        Reader { buf, pos: 0, what }
    }

    /// Bytes not yet read.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Current offset from the start.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Take the next `n` bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(Error::Truncated {
                what: self.what,
                need: self.pos.saturating_add(n),
                have: self.buf.len(),
            }),
        }
    }

    /// A reader confined to the next `n` bytes, which this reader skips.
    pub fn sub(&mut self, n: usize) -> Result<Reader<'a>> {
        let what = self.what;
        self.take(n).map(|b| Reader::new(b, what))
    }

    /// Skip `n` bytes.
    pub fn skip(&mut self, n: usize) -> Result<()> {
        self.take(n).map(|_| ())
    }

    /// The next `N` bytes as an array.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    /// One byte.
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.array::<1>()?[0])
    }

    /// Big-endian u16.
    pub fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_be_bytes(self.array()?))
    }

    /// Big-endian 24-bit unsigned integer.
    pub fn u24(&mut self) -> Result<u32> {
        let [a, b, c] = self.array::<3>()?;
        Ok(u32::from_be_bytes([0, a, b, c]))
    }

    /// Big-endian u32.
    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_be_bytes(self.array()?))
    }

    /// Big-endian u64.
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_be_bytes(self.array()?))
    }

    /// Everything not yet read.
    pub fn rest(&mut self) -> &'a [u8] {
        let s = &self.buf[self.pos..];
        self.pos = self.buf.len();
        s
    }
}

/// A cursor that writes into a buffer whose size was checked beforehand.
///
/// Writes past the end are dropped and remembered, so `finish` reports an error instead of
/// a panic ever happening.
#[derive(Debug)]
pub struct Writer<'a> {
    buf: &'a mut [u8],
    pos: usize,
    overflow: bool,
}

impl<'a> Writer<'a> {
    /// A writer at the start of `buf`.
    pub fn new(buf: &'a mut [u8]) -> Self {
        Writer {
            buf,
            pos: 0,
            overflow: false,
        }
    }

    /// Append bytes.
    pub fn put(&mut self, bytes: &[u8]) {
        match self.pos.checked_add(bytes.len()) {
            Some(end) if end <= self.buf.len() => {
                self.buf[self.pos..end].copy_from_slice(bytes);
                self.pos = end;
            }
            _ => self.overflow = true,
        }
    }

    /// Append `n` zero bytes (reserved fields).
    pub fn zeros(&mut self, n: usize) {
        match self.pos.checked_add(n) {
            Some(end) if end <= self.buf.len() => {
                self.buf[self.pos..end].fill(0);
                self.pos = end;
            }
            _ => self.overflow = true,
        }
    }

    /// One byte.
    pub fn u8(&mut self, v: u8) {
        self.put(&[v]);
    }

    /// Big-endian u16.
    pub fn u16(&mut self, v: u16) {
        self.put(&v.to_be_bytes());
    }

    /// Big-endian 24-bit value (the top byte of `v` is dropped; callers pass [`crate::U24`]).
    pub fn u24(&mut self, v: u32) {
        self.put(&v.to_be_bytes()[1..]);
    }

    /// Big-endian u32.
    pub fn u32(&mut self, v: u32) {
        self.put(&v.to_be_bytes());
    }

    /// Big-endian u64.
    pub fn u64(&mut self, v: u64) {
        self.put(&v.to_be_bytes());
    }

    /// Bytes written so far, or an error if anything did not fit.
    pub fn finish(self) -> Result<usize> {
        if self.overflow {
            Err(Error::BufferTooSmall {
                need: self.pos + 1,
                have: self.buf.len(),
            })
        } else {
            Ok(self.pos)
        }
    }
}

/// Check that `buf` can hold `need` bytes before emitting.
pub(crate) fn check_room(buf: &[u8], need: usize) -> Result<()> {
    if buf.len() < need {
        Err(Error::BufferTooSmall {
            need,
            have: buf.len(),
        })
    } else {
        Ok(())
    }
}
