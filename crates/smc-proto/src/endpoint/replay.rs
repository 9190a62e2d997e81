//! The replay store of a connection (RFC 7609 §4.6.2): the bytes written to the peer and not
//! known received, kept so that a failover can write them again over another link; and the
//! shared bytes a send path posts (one copy per byte: the store and the fabric's kept packets
//! hold the same reference-counted buffer, docs/performance.md).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, Weak};

use bytes::{Bytes, BytesMut};

/// Bytes of the arena a connection cuts small pieces' shared bytes from, at the least, when
/// its free space runs out: small updates share one allocation (no malloc per update), and an
/// idle connection keeps at most this much unused.
const ARENA_CHUNK: usize = 32 * 1024;
/// A piece this long or longer gets a buffer of its own from the connection's pool: a
/// stream's updates (64 KiB and more) would otherwise take a fresh allocation each, whose
/// pages the allocator may have given back (page faults and zeroing for every byte copied).
const POOLED_MIN: usize = 16 * 1024;
/// Most bytes of buffers a connection's pool keeps for reuse (a default RMBE's worth: what a
/// stream has in flight), and the largest buffer it keeps.
const POOL_BYTES: usize = 1 << 20;

/// How long a connection's arena and pool stay after its last write that took shared bytes
/// ([`Arena::trim`]): a stream's pauses are shorter, an idle connection's are not. (Bytes
/// still in the replay store or in packets stay theirs; they are freed, not pooled, when
/// their last slice drops.)
pub(super) const ARENA_IDLE: std::time::Duration = std::time::Duration::from_secs(1);

/// Buffers of a connection's large pieces, back for reuse once no packet and no replay store
/// holds a slice of them any more (the last reference may drop on another thread: the
/// fabric's progress thread, which receives the ACK).
type Pool = Mutex<Vec<Vec<u8>>>;

/// Where a connection's shared bytes come from. Its default allocates nothing (the engine
/// takes it out of the connection for each send and puts it back).
#[derive(Debug, Default)]
pub(super) struct Arena {
    small: BytesMut,
    /// Made at the first long piece.
    pool: Option<Arc<Pool>>,
}

/// A pooled buffer holding one piece's bytes; returned to its pool when dropped.
struct Pooled {
    buf: Vec<u8>,
    pool: Weak<Pool>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        let Some(pool) = self.pool.upgrade() else {
            return;
        };
        let buf = std::mem::take(&mut self.buf);
        let mut p = pool.lock().unwrap_or_else(|e| e.into_inner());
        let held: usize = p.iter().map(Vec::capacity).sum();
        if held + buf.capacity() <= POOL_BYTES {
            p.push(buf);
        }
    }
}

impl Arena {
    /// Whether it keeps memory of its own (a pool, or room in the small arena).
    pub(super) fn holds_memory(&self) -> bool {
        self.pool.is_some() || self.small.capacity() > 0
    }

    /// Let go of the pool's buffers and the small arena's room (an idle connection keeps
    /// nothing; the next long piece makes a new pool). Buffers still lent out are freed when
    /// their last slice drops.
    pub(super) fn trim(&mut self) {
        self.pool = None;
        self.small = BytesMut::new();
    }

    /// `bytes` copied once into a shared buffer: packed into the arena when short, else into
    /// a buffer of the pool.
    fn share(&mut self, bytes: &[u8]) -> Bytes {
        if bytes.len() < POOLED_MIN {
            if self.small.capacity() < bytes.len() {
                self.small.reserve(bytes.len().max(ARENA_CHUNK));
            }
            self.small.extend_from_slice(bytes);
            return self.small.split().freeze();
        }
        let pool = self.pool.get_or_insert_with(Arc::default);
        let mut buf = pool
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .unwrap_or_default();
        buf.clear();
        buf.extend_from_slice(bytes);
        Bytes::from_owner(Pooled {
            buf,
            pool: Arc::downgrade(pool),
        })
    }
}

/// Bytes laid out in pieces at a fixed distance in one buffer: a fabric's packed WRITE
/// (software RoCE), whose packets lie end to end with the WRITE's bytes between their
/// headers. A send path that posted one hands it to [`WritePiece::keep`], and the replay
/// store keeps the buffer instead of a copy of the bytes.
#[derive(Clone, Debug)]
pub struct Strided {
    /// The buffer.
    pub buf: Bytes,
    /// Where the first byte is in `buf`.
    pub first: usize,
    /// From one piece's start to the next one's.
    pub stride: usize,
    /// The length of every piece but a shorter last.
    pub piece: usize,
    /// How many bytes in all.
    pub len: usize,
}

impl Strided {
    /// Whether every piece lies inside the buffer without overlapping the next.
    fn is_sound(&self) -> bool {
        if self.piece == 0 || self.stride < self.piece {
            return false;
        }
        if self.len == 0 {
            return true;
        }
        let last = (self.len - 1) / self.piece;
        last.checked_mul(self.stride)
            .and_then(|a| a.checked_add(self.first))
            .and_then(|a| a.checked_add(self.len - last * self.piece))
            .is_some_and(|end| end <= self.buf.len())
    }
}

/// One stretch of kept bytes.
#[derive(Debug)]
enum Chunk {
    /// In one piece.
    Flat(Bytes),
    /// The bytes of a [`Strided`] from `skip` bytes into the piece at `start`, `len` of them.
    Strided {
        buf: Bytes,
        start: usize,
        skip: usize,
        stride: usize,
        piece: usize,
        len: usize,
    },
}

impl Chunk {
    fn len(&self) -> usize {
        match self {
            Chunk::Flat(b) => b.len(),
            Chunk::Strided { len, .. } => *len,
        }
    }

    /// Forget the first `n` bytes (fewer than it holds).
    fn drop_front(&mut self, n: usize) {
        match self {
            Chunk::Flat(b) => {
                let _ = b.split_to(n.min(b.len()));
            }
            Chunk::Strided {
                start,
                skip,
                stride,
                piece,
                len,
                ..
            } => {
                let n = n.min(*len);
                *len -= n;
                let at = *skip + n;
                *start += at / *piece * *stride;
                *skip = at % *piece;
            }
        }
    }

    /// Keep the first `n` bytes only.
    fn truncate(&mut self, n: usize) {
        match self {
            Chunk::Flat(b) => b.truncate(n),
            Chunk::Strided { len, .. } => *len = (*len).min(n),
        }
    }

    /// Its bytes, in order, after `out`'s.
    fn extend_into(&self, out: &mut Vec<u8>) {
        match self {
            Chunk::Flat(b) => out.extend_from_slice(b),
            Chunk::Strided {
                buf,
                start,
                skip,
                stride,
                piece,
                len,
            } => {
                let (mut at, mut from, mut left) = (*start, *skip, *len);
                while left > 0 {
                    let take = (*piece - from).min(left);
                    let Some(b) = buf.get(at + from..at + from + take) else {
                        break; // not reached: checked sound when kept
                    };
                    out.extend_from_slice(b);
                    left -= take;
                    at += *stride;
                    from = 0;
                }
            }
        }
    }
}

/// Bytes a send path's piece left for the replay store: its shared buffer, or the packed
/// WRITE's (see [`WritePiece::keep`]).
#[derive(Debug)]
pub(super) struct Kept(Chunk);

impl Kept {
    /// Bytes `from..to` of it.
    pub(super) fn range(mut self, from: usize, to: usize) -> Kept {
        self.0.truncate(to);
        self.0.drop_front(from);
        self
    }
}

/// The bytes kept for replay, oldest first, as the shared buffers they were posted from (or
/// copies, where the send path posted none).
#[derive(Debug, Default)]
pub(super) struct Replay {
    chunks: VecDeque<Chunk>,
    len: usize,
}

impl Replay {
    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Keep `b` after the bytes kept.
    pub(super) fn push(&mut self, b: Bytes) {
        self.push_chunk(Chunk::Flat(b));
    }

    /// Keep what a send path's piece left after the bytes kept.
    pub(super) fn push_kept(&mut self, k: Kept) {
        self.push_chunk(k.0);
    }

    fn push_chunk(&mut self, c: Chunk) {
        if c.len() > 0 {
            self.len += c.len();
            self.chunks.push_back(c);
        }
    }

    /// Forget the first `n` bytes (at most all of them).
    pub(super) fn drop_front(&mut self, mut n: usize) {
        n = n.min(self.len);
        self.len -= n;
        while n > 0 {
            let Some(front) = self.chunks.front_mut() else {
                break;
            };
            if front.len() <= n {
                n -= front.len();
                self.chunks.pop_front();
            } else {
                front.drop_front(n);
                n = 0;
            }
        }
    }

    /// The bytes kept, in order, copied into one buffer (a failover's replay, which is rare).
    pub(super) fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.len);
        for c in &self.chunks {
            c.extend_into(&mut v);
        }
        v
    }
}

/// One piece of a [`send_with`](super::Endpoint::send_with) for a
/// [`SendPath`](super::SendPath) to post: the application's bytes, and, when the path asks,
/// the same bytes in a shared, reference-counted buffer, which the engine then keeps for
/// replay instead of a copy of its own.
#[derive(Debug)]
pub struct WritePiece<'a> {
    bytes: &'a [u8],
    arena: &'a mut Arena,
    shared: Option<Bytes>,
    /// A packed WRITE's buffer ([`WritePiece::keep`]).
    packed: Option<Strided>,
}

impl<'a> WritePiece<'a> {
    pub(super) fn new(bytes: &'a [u8], arena: &'a mut Arena) -> WritePiece<'a> {
        WritePiece {
            bytes,
            arena,
            shared: None,
            packed: None,
        }
    }

    /// The piece's bytes (the application's slice).
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// The piece's bytes in a shared buffer, for a fabric that keeps a posted WRITE's bytes
    /// until they are acknowledged (roce, `SendWr::WriteShared`): copied from the
    /// application's slice once, at the first call, into the connection's arena. A WRITE
    /// posted from these bytes and reported [`Posted`](super::WriteOutcome::Posted) costs no
    /// second copy: the engine keeps this buffer for replay.
    pub fn shared(&mut self) -> &Bytes {
        let (bytes, arena) = (self.bytes, &mut *self.arena);
        self.shared.get_or_insert_with(|| arena.share(bytes))
    }

    /// Keep `packed` for replay: the buffer of a WRITE the path posted with the piece's bytes
    /// copied into it (a fabric's packed WRITE), so that the engine keeps no copy of its own.
    /// Refused (`false`, and the engine copies as for a path that shares nothing) unless it
    /// is as long as the piece, in pieces that lie inside its buffer; in debug builds, unless
    /// its pieces are the piece's bytes (a release build trusts the path that copied them).
    pub fn keep(&mut self, packed: Strided) -> bool {
        let ok = packed.is_sound()
            && packed.len == self.bytes.len()
            && (!cfg!(debug_assertions)
                || self
                    .bytes
                    .chunks(packed.piece)
                    .enumerate()
                    .all(|(i, want)| {
                        let at = packed.first + i * packed.stride;
                        packed.buf.get(at..at + want.len()) == Some(want)
                    }));
        if ok {
            self.packed = Some(packed);
        }
        ok
    }

    /// What the path left for replay: a packed WRITE's buffer, else the shared buffer, if
    /// it made one.
    pub(super) fn take_kept(&mut self) -> Option<Kept> {
        if let Some(p) = self.packed.take() {
            return Some(Kept(Chunk::Strided {
                buf: p.buf,
                start: p.first,
                skip: 0,
                stride: p.stride,
                piece: p.piece,
                len: p.len,
            }));
        }
        self.shared.take().map(|b| Kept(Chunk::Flat(b)))
    }

    /// The shared buffer, if the path made one (tests).
    #[cfg(test)]
    pub(super) fn take_shared(&mut self) -> Option<Bytes> {
        self.shared.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Dropping from the front walks over whole chunks and cuts into the next; what stays is
    /// the tail of the bytes pushed, in order.
    #[test]
    fn drop_front_keeps_the_tail() {
        let mut r = Replay::default();
        let all: Vec<u8> = (0..100u8).collect();
        r.push(Bytes::copy_from_slice(&all[..10]));
        r.push(Bytes::new());
        r.push(Bytes::copy_from_slice(&all[10..40]));
        r.push(Bytes::copy_from_slice(&all[40..]));
        assert_eq!(r.len(), 100);
        r.drop_front(0);
        assert_eq!(r.to_vec(), all);
        r.drop_front(15);
        assert_eq!(r.to_vec(), &all[15..]);
        r.drop_front(25);
        assert_eq!(r.to_vec(), &all[40..]);
        r.drop_front(1000);
        assert!(r.is_empty() && r.to_vec().is_empty());
    }

    /// A packed WRITE's buffer: 10 bytes of header before each piece of 7 (the last
    /// shorter), kept whole and in ranges; dropping from the front walks over pieces and cuts
    /// into them; what stays is always the tail of the bytes, in order. A buffer that does
    /// not hold the piece's bytes is refused.
    #[test]
    fn packed_buffers_are_kept_as_laid_out() {
        let data: Vec<u8> = (0..40u8).collect();
        let mut buf = Vec::new();
        for c in data.chunks(7) {
            buf.extend_from_slice(&[0xEE; 10]);
            buf.extend_from_slice(c);
            buf.extend_from_slice(&[0xDD; 3]);
        }
        let strided = |len: usize| Strided {
            buf: Bytes::from(buf.clone()),
            first: 10,
            stride: 20,
            piece: 7,
            len,
        };
        let mut arena = Arena::default();
        let mut p = WritePiece::new(&data, &mut arena);
        assert!(!p.keep(strided(39)), "a length that is not the piece's");
        assert!(
            !p.keep(Strided {
                first: 14,
                ..strided(40)
            }),
            "pieces past the buffer's end"
        );
        assert!(
            !p.keep(Strided {
                piece: 0,
                ..strided(40)
            }),
            "a zero piece"
        );
        if cfg!(debug_assertions) {
            assert!(
                !p.keep(Strided {
                    first: 9,
                    ..strided(40)
                }),
                "other bytes than the piece's"
            );
        }
        assert!(p.keep(strided(40)));
        let kept = p.take_kept().expect("kept");
        assert!(p.take_kept().is_none());
        let mut r = Replay::default();
        r.push(Bytes::copy_from_slice(b"ab"));
        r.push_kept(kept);
        let mut want: Vec<u8> = b"ab".to_vec();
        want.extend_from_slice(&data);
        assert_eq!(r.len(), 42);
        assert_eq!(r.to_vec(), want);
        for n in [1, 1, 3, 4, 7, 13, 2, 20] {
            r.drop_front(n);
            let left = want.len().saturating_sub(n);
            want.drain(..want.len() - left);
            assert_eq!(r.len(), want.len());
            assert_eq!(r.to_vec(), want, "after dropping {n}");
        }
        // Ranges: every cut of the buffer's bytes.
        for from in 0..40 {
            for to in from..=40 {
                let mut p = WritePiece::new(&data, &mut arena);
                assert!(p.keep(strided(40)));
                let mut r = Replay::default();
                r.push_kept(p.take_kept().expect("kept").range(from, to));
                assert_eq!(r.len(), to - from);
                assert_eq!(r.to_vec(), &data[from..to], "{from}..{to}");
            }
        }
    }

    #[test]
    fn a_trimmed_arena_keeps_nothing() {
        let mut arena = Arena::default();
        assert!(!arena.holds_memory());
        let long = vec![7u8; POOLED_MIN];
        let lent = WritePiece::new(&long, &mut arena).shared().clone();
        let short = WritePiece::new(b"abc", &mut arena).shared().clone();
        assert!(arena.holds_memory());
        let old_pool = Arc::downgrade(arena.pool.as_ref().expect("a pool"));
        arena.trim();
        assert!(!arena.holds_memory());
        // The pool is gone at once (a lent buffer holds it weakly); what was lent out stays
        // right, and is freed, not pooled, when its last slice drops.
        assert!(old_pool.upgrade().is_none());
        assert_eq!(&lent[..], &long[..]);
        assert_eq!(&short[..], b"abc");
        drop(lent);
        assert_eq!(pooled(&arena), 0);
        let again = WritePiece::new(&long, &mut arena).shared().clone();
        assert_eq!(&again[..], &long[..]);
    }

    fn pooled(a: &Arena) -> usize {
        a.pool.as_ref().map_or(0, |p| p.lock().expect("pool").len())
    }

    /// A piece's shared bytes are its bytes, made once; pieces cut from one arena do not
    /// overlap; a long piece gets a buffer of the pool, which comes back for the next one
    /// only when the last slice of it is gone.
    #[test]
    fn shared_pieces_are_their_bytes() {
        let mut arena = Arena::default();
        let a: Vec<u8> = (0..100u8).collect();
        let b = vec![7u8; 3 * ARENA_CHUNK];
        let mut p = WritePiece::new(&a, &mut arena);
        let sa = p.shared().clone();
        assert_eq!(p.shared().as_ptr(), sa.as_ptr(), "made once");
        assert_eq!(p.take_shared().as_deref(), Some(&a[..]));
        let mut q = WritePiece::new(&b, &mut arena);
        assert_eq!(&q.shared()[..], &b[..]);
        let long = q.take_shared().expect("made");
        let mut r = WritePiece::new(&a[..5], &mut arena);
        assert_eq!(&r.shared()[..], &a[..5]);
        assert_eq!(&sa[..], &a[..], "earlier pieces unchanged");
        // The long piece's buffer is in use: the next long piece gets another.
        let c = vec![9u8; POOLED_MIN];
        let sc = WritePiece::new(&c, &mut arena).shared().clone();
        assert_ne!(sc.as_ptr(), long.as_ptr());
        assert_eq!(&long[..], &b[..], "the long piece unchanged");
        // Once every slice of it is gone it comes back, and is reused.
        let tail = long.slice(10..);
        drop(long);
        assert_eq!(pooled(&arena), 0, "a slice still holds it");
        let at = tail.as_ptr() as usize - 10;
        drop(tail);
        assert_eq!(pooled(&arena), 1);
        let d = vec![5u8; POOLED_MIN + 1];
        let sd = WritePiece::new(&d, &mut arena).shared().clone();
        assert_eq!(sd.as_ptr() as usize, at, "the pooled buffer reused");
        assert_eq!(&sd[..], &d[..]);
        assert_eq!(&sc[..], &c[..]);
    }
}
