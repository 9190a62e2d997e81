//! The packets a roce requester keeps until they are acknowledged (go-back-N resends them as
//! they are), and their view for transmission.
//!
//! A packet is kept one of three ways, and a packed WRITE's packets a fourth. *Run*: the
//! packets of a packed WRITE (qp.rs `post_write_packed`) that one `UDP_SEGMENT` run carries,
//! kept as one entry — a slice of the post's immutable buffer where they lie end to end, each
//! sealed at post for its place in the run; sent as they lie (one iovec, one message), or
//! packet by packet as resealed copies where a transmission gives them other places (a
//! retransmission after part of the run was acknowledged). *Flat*: the whole sealed packet in one
//! buffer of the send queue's pool (SENDs, WRITEs of the caller's slice or of a registered
//! region: their bytes are copied into the packet once). *Shared*: a WRITE ONLY packet of
//! [`SendWr::WriteShared`](crate::SendWr::WriteShared) bytes, kept as its headers (BTH and
//! RETH, in an inline array), a slice of the shared, reference-counted buffer, and its pad
//! and ICRC: the payload is never copied in user space. The kernel gathers the pieces of a
//! datagram from an iovec list (`sendmmsg`, and with `UDP_SEGMENT` it cuts the gathered bytes
//! every `gso_size` bytes, so a run of shared packets is one message as a run of flat ones is,
//! gso.rs). The buffer is immutable, and the packet holds a reference to it until the packet
//! is acknowledged or its QP fails, so a retransmission sends the bytes that were posted.

use bytes::Bytes;
use smc_wire::roce::{self, IcrcHeaders, IcrcPrefix, PacketRepr, BTH_LEN, ICRC_LEN, RETH_LEN};

/// Where the AckReq bit lives in a packet: BTH byte 8, bit 7 (rocev2.md 3.1).
const BTH_ACKREQ: (usize, u8) = (8, 0x80);
/// The headers of a shared packet: BTH and RETH (every shared packet is a WRITE ONLY).
const HEAD_MAX: usize = BTH_LEN + RETH_LEN;
/// Pad (at most 3 bytes) and ICRC.
const TAIL_MAX: usize = 3 + ICRC_LEN;

/// How a kept packet holds its bytes.
pub(crate) enum Body {
    /// Packets of a packed WRITE (`RoceQp::post_write_packed`): a slice of the post's
    /// immutable buffer where they lie end to end, `stride` bytes each but a shorter last,
    /// packet j sealed for identification `first_id + j` (`Some(first_id)`: sealed for a
    /// `UDP_SEGMENT` run; over IPv6, which has no identification, the places are nominal) or
    /// for 0 (`None`: they leave one by one). Sent as they lie; a
    /// transmission that needs one sealed for another identification sends a copy (gso.rs
    /// `Layout::lay_out`).
    Run {
        bytes: Bytes,
        stride: u16,
        first_id: Option<u16>,
    },
    /// The whole sealed packet (a buffer of the send queue's pool).
    Flat(Vec<u8>),
    /// Headers, payload and tail (pad zeros, then the ICRC) apart; the payload a slice of the
    /// WRITE's shared bytes.
    Shared {
        head: [u8; HEAD_MAX],
        head_len: u8,
        payload: Bytes,
        tail: [u8; TAIL_MAX],
        tail_len: u8,
    },
}

/// A packet posted and not yet acknowledged, or (a [`Body::Run`]) `count` packets of
/// consecutive PSNs from `psn`.
pub(crate) struct TxPkt {
    pub(crate) psn: u32,
    pub(crate) body: Body,
    /// The IPv4 identification the packet's ICRC is sealed for (gso.rs; a run keeps its
    /// packets' in its body).
    pub(crate) ipv4_id: u16,
    /// Whether the BTH's AckReq bit is set (of a run: of its last packet, which has it).
    pub(crate) ack_req: bool,
    /// Packets the entry holds: 1, or a run's.
    pub(crate) count: u16,
}

impl TxPkt {
    /// The packets `bytes` holds end to end (`stride` bytes each but a shorter last),
    /// `count` of them from PSN `psn`, sealed as [`Body::Run`] says; the last asks for an
    /// ACK.
    pub(crate) fn run(
        psn: u32,
        bytes: Bytes,
        count: u16,
        stride: u16,
        first_id: Option<u16>,
    ) -> TxPkt {
        // One UDP_SEGMENT message as it lies (gso.rs): every packet `stride` bytes but a
        // shorter last, within the kernel's limits.
        debug_assert!(
            usize::from(count) <= super::gso::MAX_SEGMENTS
                && bytes.len() <= super::gso::MAX_SEND_BYTES
                && stride > 0
                && usize::from(count.max(1) - 1) * usize::from(stride) < bytes.len()
                && bytes.len() <= usize::from(count.max(1)) * usize::from(stride),
            "a packed run outside one message's limits"
        );
        TxPkt {
            psn,
            body: Body::Run {
                bytes,
                stride,
                first_id,
            },
            ipv4_id: 0,
            ack_req: true,
            count: count.max(1),
        }
    }

    /// Where the message a packed run leaves in would take its next packet, and the run's
    /// stride, when that message has room for more: the run's packets are all full (no
    /// shorter last one ends it), sealed for a `UDP_SEGMENT` run, and end before the run's
    /// capacity (gso.rs `run_capacity`). A packed post of the same stride can then be sealed
    /// for the places after it (`RoceQp::post_write_packed`) and leave in the same datagram.
    pub(crate) fn open_end(&self) -> Option<(u16, usize)> {
        let Body::Run {
            bytes,
            stride,
            first_id: Some(first),
        } = &self.body
        else {
            return None;
        };
        let stride = usize::from(*stride);
        let end = usize::from(*first) + usize::from(self.count);
        (bytes.len() == usize::from(self.count) * stride && end < super::gso::run_capacity(stride))
            .then(|| u16::try_from(end).ok().map(|e| (e, stride)))
            .flatten()
    }

    /// The PSN of the entry's last packet.
    pub(crate) fn last_psn(&self) -> u32 {
        (self.psn + u32::from(self.count) - 1) & roce::U24_MASK
    }

    /// Let go of the first `k` packets of a run (acknowledged; `k` less than its count): the
    /// entry keeps the rest, sealed as they were.
    pub(crate) fn trim_front(&mut self, k: u16) {
        let Body::Run {
            bytes,
            stride,
            first_id,
        } = &mut self.body
        else {
            return;
        };
        debug_assert!(
            k < self.count,
            "a trim of a whole run (it is popped instead)"
        );
        let k = k.min(self.count.saturating_sub(1));
        *bytes = bytes.slice((usize::from(k) * usize::from(*stride)).min(bytes.len())..);
        *first_id = first_id.map(|f| f.wrapping_add(k));
        self.count -= k;
        self.psn = (self.psn + u32::from(k)) & roce::U24_MASK;
    }

    /// A packet of `repr`'s headers and `payload` (`repr.payload` is not used), sealed with
    /// `prefix` for identification 0 (a prefix made for the packet's length, or any other: it
    /// falls back to the full computation), without copying the payload.
    pub(crate) fn shared(
        psn: u32,
        repr: &PacketRepr<'_>,
        payload: Bytes,
        prefix: &IcrcPrefix,
        ack_req: bool,
    ) -> Result<TxPkt, roce::RoceError> {
        let mut head = [0u8; HEAD_MAX];
        let head_len = repr.emit_head(payload.len(), &mut head)?;
        let pad = roce::pad_len(payload.len());
        let mut tail = [0u8; TAIL_MAX];
        let sum = prefix.compute_pieces(&head[..head_len], &payload, pad);
        tail[pad..pad + ICRC_LEN].copy_from_slice(&sum.to_le_bytes());
        Ok(TxPkt {
            psn,
            body: Body::Shared {
                head,
                head_len: head_len as u8,
                payload,
                tail,
                tail_len: (pad + ICRC_LEN) as u8,
            },
            ipv4_id: 0,
            ack_req,
            count: 1,
        })
    }

    /// Set the AckReq bit of a packet that has it not, and seal it again (for identification
    /// 0): the kept packet keeps the bit for any retransmission.
    pub(crate) fn ask_ack(&mut self, icrc: &IcrcHeaders) {
        if self.ack_req {
            return;
        }
        match &mut self.body {
            // Sealed at post, AckReq included (the QP ends transmissions where it is set).
            Body::Run { .. } => return,
            Body::Flat(bytes) => {
                if let Some(b) = bytes.get_mut(BTH_ACKREQ.0) {
                    *b |= BTH_ACKREQ.1;
                }
                icrc.seal(bytes);
            }
            Body::Shared {
                head,
                head_len,
                payload,
                tail,
                tail_len,
            } => {
                head[BTH_ACKREQ.0] |= BTH_ACKREQ.1;
                let pad = usize::from(*tail_len).saturating_sub(ICRC_LEN);
                let sum = icrc.compute_pieces(&head[..usize::from(*head_len)], payload, pad);
                tail[pad..pad + ICRC_LEN].copy_from_slice(&sum.to_le_bytes());
            }
        }
        self.ipv4_id = 0;
        self.ack_req = true;
    }

    /// The entry's pieces for transmission, into `out`: a packet's; a run's as one wire of
    /// all its packets where `whole` allows and they are sealed for the identifications their
    /// place in a message gives — a run starting with them (0, 1, 2…), or, `open` being
    /// `Some(f)`, the message of the entry before, which ends with a full packet at place
    /// f − 1 (a packed post sealed to continue it) — else one wire per packet. Returns
    /// where the message ends now for the next entry, when it ends open ([`open_end`]).
    ///
    /// [`open_end`]: Self::open_end
    pub(crate) fn wires<'a>(
        &'a mut self,
        whole: bool,
        open: Option<u16>,
        out: &mut Vec<Wire<'a>>,
    ) -> Option<u16> {
        let count = self.count;
        if !matches!(self.body, Body::Run { .. }) {
            out.push(self.wire());
            return None;
        }
        let Body::Run {
            bytes,
            stride,
            first_id,
        } = &self.body
        else {
            return None;
        };
        // Whole where the message is the run's own (several packets from place 0: gso.rs
        // starts a message with them) or the open one it was sealed to continue.
        let fits = first_id.is_some_and(|f| (f == 0 && count > 1) || open == Some(f));
        if whole && fits {
            let next = self.open_end().map(|(end, _)| end);
            out.push(Wire {
                parts: [&bytes[..], &[]],
                tail: &mut [],
                id: Sealed::Fixed(first_id.unwrap_or(0)),
                packets: count,
                seg: *stride,
            });
            return next;
        }
        out.extend(run_packets(bytes, *stride, count, *first_id));
        None
    }

    /// The packet's pieces for transmission: an entry of one packet (a run goes through
    /// [`wires`](Self::wires), which cuts it).
    fn wire(&mut self) -> Wire<'_> {
        debug_assert!(self.count == 1, "a run's wire taken whole as one packet");
        match &mut self.body {
            Body::Run {
                bytes,
                stride,
                first_id,
            } => Wire {
                parts: [&bytes[..usize::from(*stride).min(bytes.len())], &[]],
                tail: &mut [],
                id: Sealed::Fixed(first_id.unwrap_or(0)),
                packets: 1,
                seg: 0,
            },
            Body::Flat(bytes) => Wire::flat(bytes, &mut self.ipv4_id),
            Body::Shared {
                head,
                head_len,
                payload,
                tail,
                tail_len,
            } => Wire {
                parts: [&head[..usize::from(*head_len)], &payload[..]],
                tail: &mut tail[..usize::from(*tail_len)],
                id: Sealed::Kept(&mut self.ipv4_id),
                packets: 1,
                seg: 0,
            },
        }
    }

    /// The pool buffer of a flat packet, for reuse; a shared or packed packet lets go of its
    /// slice.
    pub(crate) fn into_buffer(self) -> Option<Vec<u8>> {
        match self.body {
            Body::Flat(bytes) => Some(bytes),
            Body::Shared { .. } | Body::Run { .. } => None,
        }
    }
}

/// The buffers of a QP's packed posts of several packets, back for reuse once no packet and
/// no replay store holds a slice of them (the last slice may drop on any thread), with their
/// capacities' sum.
#[derive(Default)]
pub(crate) struct PostPool(std::sync::Mutex<(Vec<Vec<u8>>, usize)>);

impl PostPool {
    /// A buffer of the pool (empty), or a new one.
    pub(crate) fn take(&self) -> Vec<u8> {
        let mut p = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let buf = p.0.pop().unwrap_or_default();
        p.1 -= buf.capacity();
        buf
    }

    /// Keep `buf` for reuse if the pool has room ([`POST_POOL_BYTES`]); else free it.
    fn put(&self, mut buf: Vec<u8>) {
        buf.clear();
        let mut p = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if p.1 + buf.capacity() <= POST_POOL_BYTES {
            p.1 += buf.capacity();
            p.0.push(buf);
        }
    }
}

/// Most bytes of buffers a QP's pool keeps: what a stream has posted and not had
/// acknowledged (a default RMBE, 1 MiB, of packets and the replay's hold on them), with room.
pub(crate) const POST_POOL_BYTES: usize = 2 << 20;

/// A packed post's buffer, returned to its QP's pool when the last slice of it drops (a
/// lone packet's, with no pool, freed: small buffers would crowd the pool out).
pub(crate) struct PostBuf {
    pub(crate) buf: Vec<u8>,
    pub(crate) pool: std::sync::Weak<PostPool>,
}

impl AsRef<[u8]> for PostBuf {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for PostBuf {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            pool.put(std::mem::take(&mut self.buf));
        }
    }
}

/// One packet as it leaves: its bytes are `parts` then `tail`, laid end to end by the kernel
/// (one iovec each); the ICRC is the last four bytes of `tail`, sealed for identification
/// `id` — or, [`Sealed::Fixed`], the last four of `parts[0]`, the whole packet, which is
/// immutable: [`reseal`](Wire::reseal) leaves it as it is, and [`seal_for`](Wire::seal_for)
/// gives a copy where a transmission needs it sealed for another identification. Or (`packets`
/// more than 1) a whole run of a packed WRITE: `parts[0]` holds that many fixed packets end
/// to end, `seg` bytes each but a shorter last, sealed for identifications 0, 1, 2…: one
/// `UDP_SEGMENT` message as it lies (gso.rs).
pub(crate) struct Wire<'a> {
    pub(crate) parts: [&'a [u8]; 2],
    pub(crate) tail: &'a mut [u8],
    pub(crate) id: Sealed<'a>,
    pub(crate) packets: u16,
    pub(crate) seg: u16,
}

/// The identification a packet's ICRC is sealed for.
pub(crate) enum Sealed<'a> {
    /// Kept in the packet, which a transmission re-seals in place (and notes here).
    Kept(&'a mut u16),
    /// Fixed at post: the packet is immutable.
    Fixed(u16),
}

impl Sealed<'_> {
    /// The identification.
    pub(crate) fn get(&self) -> u16 {
        match self {
            Sealed::Kept(id) => **id,
            Sealed::Fixed(id) => *id,
        }
    }
}

impl<'a> Wire<'a> {
    /// A packet in one buffer (its last four bytes the ICRC).
    pub(crate) fn flat(bytes: &'a mut [u8], id: &'a mut u16) -> Wire<'a> {
        let at = bytes.len().saturating_sub(ICRC_LEN);
        let (body, tail) = bytes.split_at_mut(at);
        Wire {
            parts: [body, &[]],
            tail,
            id: Sealed::Kept(id),
            packets: 1,
            seg: 0,
        }
    }

    /// Whether the packet is immutable, sealed at post.
    pub(crate) fn fixed(&self) -> bool {
        matches!(self.id, Sealed::Fixed(_))
    }

    /// The packet's length (the UDP payload).
    pub(crate) fn len(&self) -> usize {
        self.parts[0].len() + self.parts[1].len() + self.tail.len()
    }

    /// Its pieces in order (some may be empty).
    pub(crate) fn pieces(&self) -> [&[u8]; 3] {
        [self.parts[0], self.parts[1], &self.tail[..]]
    }

    /// Its bytes laid end to end (tests).
    #[cfg(test)]
    pub(crate) fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.len());
        for p in self.pieces() {
            v.extend_from_slice(p);
        }
        v
    }

    /// Seal the packet for identification `to` (four XORed bytes, gso.rs); a fixed packet
    /// stays as it is (see [`seal_for`](Wire::seal_for)).
    pub(crate) fn reseal(&mut self, to: u16) {
        let len = self.len();
        if let Sealed::Kept(id) = &mut self.id {
            super::gso::reseal_tail(len, self.tail, id, to);
        }
    }

    /// Seal the packet for identification `to`: in place, or — a fixed packet sealed for
    /// another — as a copy, returned (to be sent instead of the packet).
    pub(crate) fn seal_for(&mut self, to: u16) -> Option<Vec<u8>> {
        let mut copy = Vec::new();
        self.seal_into(to, &mut copy).map(|_| copy)
    }

    /// [`seal_for`](Self::seal_for), a copy appended to `out` (no allocation of its own):
    /// its length, or `None` when the packet was sealed in place (or already was).
    pub(crate) fn seal_into(&mut self, to: u16, out: &mut Vec<u8>) -> Option<usize> {
        if !self.fixed() || self.id.get() == to {
            self.reseal(to);
            return None;
        }
        let at = out.len();
        for p in self.pieces() {
            out.extend_from_slice(p);
        }
        let mut id = self.id.get();
        let len = out.len() - at;
        super::gso::reseal_tail(len, &mut out[at..], &mut id, to);
        Some(len)
    }

    /// The wire's packets one by one: a whole run's, each as sealed at post; a packet's, itself.
    pub(crate) fn split(&mut self) -> impl Iterator<Item = Wire<'_>> {
        let (bytes, seg, packets, first) = (self.parts[0], self.seg, self.packets, self.id.get());
        let run = (packets > 1).then(|| run_packets(bytes, seg, packets, Some(first)));
        let single = (packets <= 1).then_some(Wire {
            parts: self.parts,
            tail: &mut *self.tail,
            id: match &mut self.id {
                Sealed::Kept(id) => Sealed::Kept(id),
                Sealed::Fixed(id) => Sealed::Fixed(*id),
            },
            packets: 1,
            seg: 0,
        });
        single.into_iter().chain(run.into_iter().flatten())
    }
}

/// The `count` packets `bytes` holds end to end, `stride` bytes each but a shorter last, as
/// fixed wires: packet j sealed for identification `first + j` (for 0 without `first`).
fn run_packets(
    bytes: &[u8],
    stride: u16,
    count: u16,
    first: Option<u16>,
) -> impl Iterator<Item = Wire<'_>> {
    bytes
        .chunks(usize::from(stride).max(1))
        .take(usize::from(count))
        .enumerate()
        .map(move |(j, packet)| Wire {
            parts: [packet, &[]],
            tail: &mut [],
            id: Sealed::Fixed(first.map_or(0, |f| f.wrapping_add(j as u16))),
            packets: 1,
            seg: 0,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use smc_wire::roce::{Bth, Opcode, Reth};
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

    fn repr(psn: u32, len: usize, ack_req: bool) -> PacketRepr<'static> {
        PacketRepr {
            bth: Bth {
                opcode: Opcode::WRITE_ONLY,
                pkey: roce::DEFAULT_PKEY,
                dest_qp: 0x12,
                ack_req,
                psn,
                ..Bth::default()
            },
            reth: Some(Reth {
                va: 0x1000 + psn as u64,
                rkey: 0xAB,
                dma_len: len as u32,
            }),
            aeth: None,
            immdt: None,
            payload: &[],
        }
    }

    /// A shared packet, laid end to end, is the flat packet `emit_to_vec` and `seal` make of
    /// the same headers and payload, for payloads of every pad, over IPv4 and IPv6; after
    /// `ask_ack` it is the flat packet with AckReq set; resealed for an identification, it
    /// is the flat packet resealed for it.
    #[test]
    fn shared_packets_are_the_flat_ones() {
        let v4 = IcrcHeaders::new(
            IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)),
            IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)),
            49152,
        );
        let v6 = IcrcHeaders::new(
            IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 1)),
            IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 2)),
            49152,
        );
        let all: Bytes = (0..5000u32).map(|i| (i * 7 + 3) as u8).collect();
        for icrc in [v4, v6] {
            for len in [0usize, 1, 2, 3, 4, 25, 1023, 1024, 4096] {
                let payload = all.slice(100..100 + len);
                let r = repr(7, len, false);
                let mut flat = Vec::new();
                PacketRepr {
                    payload: &payload,
                    ..r
                }
                .emit_to_vec(&mut flat);
                icrc.seal(&mut flat);
                // With a prefix for the packet's length, and with none (the full way).
                let pre = icrc.prefix(flat.len());
                let p2 = TxPkt::shared(7, &r, payload.clone(), &IcrcPrefix::none(icrc), false);
                assert_eq!(p2.expect("shared").wire().to_vec(), flat, "length {len}");
                let mut p = TxPkt::shared(7, &r, payload.clone(), &pre, false).expect("shared");
                assert_eq!(p.wire().to_vec(), flat, "length {len}");
                // AckReq set afterwards: the packet built with it.
                p.ask_ack(&icrc);
                let mut want = Vec::new();
                PacketRepr {
                    payload: &payload,
                    ..repr(7, len, true)
                }
                .emit_to_vec(&mut want);
                icrc.seal(&mut want);
                assert_eq!(p.wire().to_vec(), want, "length {len}, AckReq");
                // Resealed for identification 9 and back.
                let mut id0 = 0u16;
                let mut flat9 = want.clone();
                super::super::gso::reseal(&mut flat9, &mut id0, 9);
                p.wire().reseal(9);
                assert_eq!(p.ipv4_id, 9);
                assert_eq!(p.wire().to_vec(), flat9, "length {len}, id 9");
                p.wire().reseal(0);
                assert_eq!(p.wire().to_vec(), want);
                assert!(p.into_buffer().is_none());
            }
        }
    }

    /// A QP's pool of packed posts' buffers keeps at most `POST_POOL_BYTES` of them, counts
    /// what it lends, and gets back a buffer whose last slice drops; a buffer with no pool
    /// (a lone packet's) is freed.
    #[test]
    fn the_post_pool_keeps_a_bounded_number_of_bytes() {
        let pool = std::sync::Arc::new(PostPool::default());
        let chunk = 256 << 10;
        for _ in 0..(POST_POOL_BYTES / chunk + 3) {
            pool.put(Vec::with_capacity(chunk));
        }
        let held = |p: &PostPool| {
            let g = p.0.lock().expect("pool");
            (g.0.len(), g.1, g.0.iter().map(Vec::capacity).sum::<usize>())
        };
        let (n, bytes, sum) = held(&pool);
        assert_eq!((n, bytes), (POST_POOL_BYTES / chunk, sum));
        let mut lent = pool.take();
        assert!(lent.capacity() >= chunk && lent.is_empty());
        lent.push(7);
        assert_eq!(held(&pool).1, bytes - lent.capacity());
        let b = Bytes::from_owner(PostBuf {
            buf: lent,
            pool: std::sync::Arc::downgrade(&pool),
        });
        let slice = b.slice(..1);
        drop(b);
        assert_eq!(held(&pool).1, bytes - chunk, "a slice still holds it");
        drop(slice);
        assert_eq!(held(&pool), (n, bytes, bytes), "back in the pool");
        drop(Bytes::from_owner(PostBuf {
            buf: vec![1, 2, 3],
            pool: std::sync::Weak::new(),
        }));
        assert_eq!(held(&pool).0, n);
    }

    /// A flat packet's wire view is its buffer, cut before the ICRC.
    #[test]
    fn flat_wire_is_the_buffer() {
        let mut b: Vec<u8> = (0..40u8).collect();
        let mut id = 0;
        let w = Wire::flat(&mut b, &mut id);
        assert_eq!(w.len(), 40);
        assert_eq!(w.tail.len(), ICRC_LEN);
        assert_eq!(w.to_vec(), (0..40u8).collect::<Vec<_>>());
    }
}
