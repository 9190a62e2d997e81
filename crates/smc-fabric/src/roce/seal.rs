//! Building the full packets of a post four at a time: each payload copied into its packet
//! and folded into its ICRC (rocev2.md 12.1) in the same pass, four packets side by side with
//! 512-bit carry-less multiplies, where one packet's CRC alone is bound by the latency of its
//! folds and its copy is a second pass over the bytes.
//!
//! A packed WRITE (qp.rs `post_write_packed`) lays its packets end to end, all but the last a
//! full path MTU; each needs CRC-32 over 8 × `0xFF`, the masked IPv4 and UDP headers, the BTH
//! (byte 4 masked), the RETH and the payload. Over IPv4 the part in front of the payload is
//! 36 + 12 + 16 = 64 bytes, and a path MTU of 1024 or 4096 is a whole number of 64-byte blocks,
//! so every full packet's covered bytes are one 64-byte block built on the stack followed by
//! the blocks of its payload. Each packet's blocks are folded in one 512-bit register (four
//! 128-bit lanes, the fold-by-4 of the PCLMULQDQ method: each lane carried 512 bits ahead onto
//! the same lane of the next block), four packets at once so that their folds overlap, each
//! block stored into the packet as it is loaded; at the end the four lanes are folded into one
//! and the 128-bit remainder reduced to the CRC (Barrett). crc32fast alone takes about 50 ns
//! for a 1,052-byte packet on this machine (an AMD EPYC with AVX-512: its wide kernels start at
//! 2 KiB), and the copy before it another pass; see docs/performance.md, "Session 32". The
//! receiver folds the packets of a coalesced datagram the same way, without the copy
//! ([`Seal4::icrc4`], before the checks of inbound.rs compare the ICRCs).
//!
//! The constants are x^n mod P and ⌊x^64 / P⌋ for the CRC-32 polynomial, bit-reflected —
//! computed below at compile time, and tested against the published values.

// Off x86_64 no `Seal4` is made; the constants and the kernel's helpers go unused there.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

use std::mem::MaybeUninit;

use smc_wire::roce::{IcrcHeaders, BTH_LEN, ICRC_LEN, RETH_LEN};

/// A WRITE ONLY's BTH and RETH: after the 36 covered bytes in front of the BTH (IPv4) they
/// complete the first 64-byte block.
const HEAD: usize = BTH_LEN + RETH_LEN;
const BLOCK: usize = 64;

/// The full packets of a post built four at a time, on a CPU that has the instructions
/// (AVX-512F, VPCLMULQDQ): each payload copied into its packet and folded into its ICRC in the
/// same pass. Made per post by [`Seal4::new`], which says `None` where it does not apply; the
/// caller then builds and seals each packet alone.
pub(crate) struct Seal4 {
    /// The endpoints, for packets that are not of the length this was made for.
    headers: IcrcHeaders,
    /// The first block of every packet with its BTH and RETH still to be filled in.
    first: [u8; BLOCK],
    /// The UDP payload length of a full packet (BTH, RETH, payload, ICRC; no pad).
    full: usize,
}

impl Seal4 {
    /// For packets of `full` bytes between the endpoints `h` (identification 0, as
    /// [`IcrcHeaders::new`]): only over IPv4, with a payload that is a whole number of 64-byte
    /// blocks (a path MTU of 256–4096), and where the CPU has the instructions.
    pub(crate) fn new(h: &IcrcHeaders, full: usize) -> Option<Seal4> {
        let payload = full.checked_sub(HEAD + ICRC_LEN)?;
        if payload == 0 || !payload.is_multiple_of(BLOCK) || !available() {
            return None;
        }
        let pre = h.ipv4_pre_bth(full)?;
        let mut first = [0u8; BLOCK];
        first[..36].copy_from_slice(&pre);
        Some(Seal4 {
            headers: *h,
            first,
            full,
        })
    }

    /// Append four full packets to `buf`: packet j is `heads[j]` (its BTH and its RETH), the
    /// payload `payloads[j]` and its ICRC — for IPv4 identification 0,
    /// XORed with `deltas[j]` (gso.rs: the columns of the identification it will leave with).
    /// Payloads of another length than the one this was made for are built and sealed the
    /// plain way.
    pub(crate) fn build4(
        &self,
        buf: &mut Vec<u8>,
        heads: &[[u8; HEAD]; 4],
        payloads: [&[u8]; 4],
        deltas: [u32; 4],
    ) {
        let mtu = self.full - HEAD - ICRC_LEN;
        if payloads.iter().any(|p| p.len() != mtu) {
            for j in 0..4 {
                let at = buf.len();
                buf.extend_from_slice(&heads[j]);
                buf.extend_from_slice(payloads[j]);
                buf.extend_from_slice(
                    &[0u8; 3 + ICRC_LEN][..pad_len(payloads[j].len()) + ICRC_LEN],
                );
                let icrc = self.headers.compute(&buf[at..]) ^ deltas[j];
                if let Some(tail) = buf.last_chunk_mut::<ICRC_LEN>() {
                    *tail = icrc.to_le_bytes();
                }
            }
            return;
        }
        let firsts = heads.map(|h| self.first_block(&h));
        let len = buf.len();
        buf.reserve(4 * self.full);
        let mut spare = buf.spare_capacity_mut();
        let mut dst: [&mut [MaybeUninit<u8>]; 4] = Default::default();
        for d in &mut dst {
            let (pkt, rest) = std::mem::take(&mut spare).split_at_mut(self.full);
            *d = pkt;
            spare = rest;
        }
        let icrcs = {
            let [d0, d1, d2, d3] = &mut dst;
            let bodies = [d0, d1, d2, d3].map(|d| &mut d[HEAD..HEAD + mtu]);
            fold4::<true>(&firsts, payloads, bodies)
        };
        for j in 0..4 {
            let (head, rest) = dst[j].split_at_mut(HEAD);
            for (d, s) in head.iter_mut().zip(&heads[j]) {
                d.write(*s);
            }
            let tail = (icrcs[j] ^ deltas[j]).to_le_bytes();
            for (d, s) in rest[mtu..].iter_mut().zip(&tail) {
                d.write(*s);
            }
        }
        // SAFETY: the four packets' bytes after `len` are written — each its head (`HEAD`
        // bytes), its payload (`mtu`, by `fold4`) and its ICRC (`ICRC_LEN`): `full`
        // bytes, a path MTU that is a multiple of 64 needing no pad.
        unsafe { buf.set_len(len + 4 * self.full) };
    }

    /// A packet's first covered block: the 36 bytes in front of its BTH, then its BTH (byte 4
    /// masked: FECN, BECN, reserved) and its RETH, or whatever 28 bytes it starts with.
    fn first_block(&self, head: &[u8; HEAD]) -> [u8; BLOCK] {
        let mut f = self.first;
        f[36..].copy_from_slice(head);
        f[36 + 4] = 0xFF;
        f
    }

    /// The ICRCs of four received packets of the length this was made for (whole UDP
    /// payloads, their last four bytes not covered), as [`IcrcHeaders::compute`] gives them
    /// for identification 0: the packet's first 28 bytes, whatever its headers, complete the
    /// first block. A packet of another length gets the full computation.
    pub(crate) fn icrc4(&self, pkts: [&[u8]; 4]) -> [u32; 4] {
        let mut heads = [[0u8; HEAD]; 4];
        for (h, p) in heads.iter_mut().zip(pkts) {
            match p.first_chunk::<HEAD>() {
                Some(c) if p.len() == self.full => *h = *c,
                _ => return pkts.map(|p| self.headers.compute(p)),
            }
        }
        let firsts = heads.map(|h| self.first_block(&h));
        let rest = pkts.map(|p| &p[HEAD..self.full - ICRC_LEN]);
        fold4::<false>(&firsts, rest, Default::default())
    }
}

/// Pad bytes after a payload of `len` bytes (BTH PadCnt: to a multiple of four).
fn pad_len(len: usize) -> usize {
    (4 - len % 4) % 4
}

#[cfg(target_arch = "x86_64")]
fn available() -> bool {
    use std::sync::atomic::{AtomicU8, Ordering};
    // 0 unknown, 1 no, 2 yes.
    static HAS: AtomicU8 = AtomicU8::new(0);
    match HAS.load(Ordering::Relaxed) {
        0 => {
            let yes = std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("vpclmulqdq")
                && std::is_x86_feature_detected!("pclmulqdq")
                && std::is_x86_feature_detected!("sse4.1")
                && std::env::var_os("SMC_ROCE_NO_SEAL4").is_none();
            HAS.store(if yes { 2 } else { 1 }, Ordering::Relaxed);
            yes
        }
        v => v == 2,
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn available() -> bool {
    false
}

/// The CRC-32 of `firsts[p]` followed by `src[p]` (of one length, a whole number of 64-byte
/// blocks); with `COPY`, each `src[p]` is also copied into `dst[p]` (as long), else `dst` is
/// not used.
#[cfg(target_arch = "x86_64")]
fn fold4<const COPY: bool>(
    firsts: &[[u8; BLOCK]; 4],
    src: [&[u8]; 4],
    dst: [&mut [MaybeUninit<u8>]; 4],
) -> [u32; 4] {
    let n = src[0].len();
    assert!(
        n.is_multiple_of(BLOCK)
            && src.iter().all(|s| s.len() == n)
            && (!COPY || dst.iter().all(|d| d.len() == n)),
        "fold4: four equal lengths of whole blocks"
    );
    // SAFETY: `Seal4` exists only where `available` found every feature the function enables;
    // the lengths it reads (and, with COPY, writes) are checked above.
    unsafe { fold4_avx512::<COPY>(firsts, src, dst) }
}

#[cfg(not(target_arch = "x86_64"))]
fn fold4<const COPY: bool>(
    _: &[[u8; BLOCK]; 4],
    _: [&[u8]; 4],
    _: [&mut [MaybeUninit<u8>]; 4],
) -> [u32; 4] {
    // Not reached: `available` is false here, so no `Seal4` is made.
    unreachable!("seal.rs: no Seal4 off x86_64")
}

/// x^n mod P (P the CRC-32 polynomial 0x1_04C1_1DB7, bits in their usual order).
const fn xpow_mod(n: u32) -> u32 {
    let mut r: u32 = 1;
    let mut i = 0;
    while i < n {
        let top = r & 0x8000_0000 != 0;
        r <<= 1;
        if top {
            r ^= 0x04C1_1DB7;
        }
        i += 1;
    }
    r
}

/// A 33-bit polynomial bit-reflected, as the reflected CRC's multiplies take it.
const fn reflect33(v: u64) -> u64 {
    v.reverse_bits() >> 31
}

/// A fold constant: x^n mod P, reflected, one place up (33 bits).
const fn key(n: u32) -> i64 {
    ((xpow_mod(n).reverse_bits() as u64) << 1) as i64
}

/// μ = ⌊x^64 / P⌋ for the Barrett reduction, 33 bits, in the usual order.
const fn barrett_mu() -> u64 {
    let p: u128 = 0x1_04C1_1DB7;
    let mut r: u128 = 1 << 64;
    let mut q: u64 = 0;
    let mut d = 64;
    while d >= 32 {
        if r & (1 << d) != 0 {
            r ^= p << (d - 32);
            q |= 1 << (d - 32);
        }
        d -= 1;
    }
    q
}

/// Carry a 128-bit lane 512 bits ahead: its low half times x^(512+32), its high half times
/// x^(512−32) (mod P).
const FOLD_512: (i64, i64) = (key(544), key(480));
/// The same 128 bits ahead: x^160 and x^96.
const FOLD_128: (i64, i64) = (key(160), key(96));
/// 128 → 96 bits takes x^96 (the high half of `FOLD_128`), 96 → 64 bits x^64.
const FOLD_64: i64 = key(64);
/// The Barrett reduction's μ and P, reflected.
const MU: i64 = reflect33(barrett_mu()) as i64;
const POLY: i64 = reflect33(0x1_04C1_1DB7) as i64;

/// [`fold4`]'s work (with `COPY`, each block is also stored into `dst[p]`): each packet's
/// blocks folded in one 512-bit register from a register of all ones, the four lanes folded
/// into one, and the 128-bit remainder reduced to the CRC (the PCLMULQDQ method's Barrett
/// reduction, bit-reflected).
///
/// # Safety
/// The CPU must have AVX-512F, VPCLMULQDQ, PCLMULQDQ and SSE4.1; the `src[p]` are of one
/// length, a whole number of 64-byte blocks, and with `COPY` each `dst[p]` is as long.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,vpclmulqdq,pclmulqdq,sse4.1")]
unsafe fn fold4_avx512<const COPY: bool>(
    firsts: &[[u8; BLOCK]; 4],
    src: [&[u8]; 4],
    dst: [&mut [MaybeUninit<u8>]; 4],
) -> [u32; 4] {
    use std::arch::x86_64::*;
    let k512 = _mm512_set_epi64(
        FOLD_512.1, FOLD_512.0, FOLD_512.1, FOLD_512.0, FOLD_512.1, FOLD_512.0, FOLD_512.1,
        FOLD_512.0,
    );
    // The register's initial all ones, XORed into the first four bytes.
    let init = _mm512_castsi128_si512(_mm_cvtsi32_si128(-1));
    let mut acc = [_mm512_setzero_si512(); 4];
    for (a, f) in acc.iter_mut().zip(firsts) {
        // SAFETY: 64 bytes read from a 64-byte array.
        *a = _mm512_xor_si512(unsafe { _mm512_loadu_si512(f.as_ptr().cast()) }, init);
    }
    let blocks = src[0].len() / BLOCK;
    for b in 0..blocks {
        let at = b * BLOCK;
        for p in 0..4 {
            // SAFETY: 64 bytes read from a slice of at least `at + 64` bytes (the caller's
            // lengths).
            let d = unsafe { _mm512_loadu_si512(src[p].as_ptr().add(at).cast()) };
            if COPY {
                // SAFETY: 64 bytes written to a slice as long as `src[p]`.
                unsafe { _mm512_storeu_si512(dst[p].as_mut_ptr().add(at).cast(), d) };
            }
            let lo = _mm512_clmulepi64_epi128(acc[p], k512, 0x00);
            let hi = _mm512_clmulepi64_epi128(acc[p], k512, 0x11);
            acc[p] = _mm512_ternarylogic_epi64(lo, hi, d, 0x96); // lo ⊕ hi ⊕ d
        }
    }
    let k128 = _mm_set_epi64x(FOLD_128.1, FOLD_128.0);
    let k64 = _mm_set_epi64x(0, FOLD_64);
    let barrett = _mm_set_epi64x(MU, POLY);
    let low32 = _mm_set_epi32(0, 0, 0, -1);
    let fold = |x: __m128i, next: __m128i| {
        let lo = _mm_clmulepi64_si128(x, k128, 0x00);
        let hi = _mm_clmulepi64_si128(x, k128, 0x11);
        _mm_xor_si128(_mm_xor_si128(lo, hi), next)
    };
    acc.map(|a| {
        let mut x = _mm512_castsi512_si128(a);
        x = fold(x, _mm512_extracti32x4_epi32(a, 1));
        x = fold(x, _mm512_extracti32x4_epi32(a, 2));
        x = fold(x, _mm512_extracti32x4_epi32(a, 3));
        // 128 → 96 bits: the low 64 carried 64 bits ahead onto the high 64.
        x = _mm_xor_si128(_mm_clmulepi64_si128(x, k128, 0x10), _mm_srli_si128(x, 8));
        // 96 → 64 bits: the low 32 carried 32 bits ahead.
        x = _mm_xor_si128(
            _mm_clmulepi64_si128(_mm_and_si128(x, low32), k64, 0x00),
            _mm_srli_si128(x, 4),
        );
        // Barrett: q = low32 · μ, then the low 32 of q times P cancel the remainder's low 32.
        let q = _mm_clmulepi64_si128(_mm_and_si128(x, low32), barrett, 0x10);
        let t = _mm_clmulepi64_si128(_mm_and_si128(q, low32), barrett, 0x00);
        !(_mm_extract_epi32(_mm_xor_si128(x, t), 1) as u32)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{IpAddr, Ipv4Addr};

    fn headers(seed: u32) -> IcrcHeaders {
        let a = IpAddr::V4(Ipv4Addr::from(0x0A00_0001 ^ seed.rotate_left(7)));
        let b = IpAddr::V4(Ipv4Addr::from(0x0A00_0002 ^ seed.rotate_left(13)));
        IcrcHeaders::new(a, b, (seed as u16) | 0xC000)
    }

    /// A full WRITE ONLY packet of `mtu` payload bytes with arbitrary headers and payload.
    fn packet(seed: u64, mtu: usize) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut p: Vec<u8> = (0..HEAD + mtu + ICRC_LEN)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        p[0] = 0x0A; // WRITE ONLY
        p[4] = 0; // as every packet the engine sends
        p
    }

    #[test]
    fn the_constants_are_the_known_ones() {
        // The constants of the PCLMULQDQ method for CRC-32 (bit-reflected), as published.
        assert_eq!(FOLD_512, (0x1_5444_2bd4, 0x1_c6e4_1596));
        assert_eq!(FOLD_128, (0x1_7519_97d0, 0x0_ccaa_009e));
        assert_eq!(FOLD_64, 0x1_63cd_6124);
        assert_eq!((MU, POLY), (0x1_f701_1641, 0x1_db71_0641));
    }

    /// Four packets built by `build4` after `lead` bytes already in the buffer, against the
    /// same packets laid out and sealed one by one.
    fn check(seal: &Seal4, h: &IcrcHeaders, mtu: usize, seed: u64, lead: usize) {
        let pkts: Vec<Vec<u8>> = (0..4).map(|j| packet(seed * 4 + j, mtu)).collect();
        let heads: [[u8; HEAD]; 4] = std::array::from_fn(|j| pkts[j][..HEAD].try_into().unwrap());
        let payloads: Vec<Vec<u8>> = (0..4).map(|j| pkts[j][HEAD..HEAD + mtu].to_vec()).collect();
        let deltas = [0, 0x1234_5678, 0xFFFF_FFFF, seed as u32];
        let mut buf = vec![0xA5u8; lead];
        seal.build4(
            &mut buf,
            &heads,
            std::array::from_fn(|j| &payloads[j][..]),
            deltas,
        );
        let full = HEAD + mtu + ICRC_LEN;
        assert_eq!(buf.len(), lead + 4 * full);
        assert!(buf[..lead].iter().all(|&b| b == 0xA5));
        for j in 0..4 {
            let got = &buf[lead + j * full..lead + (j + 1) * full];
            let mut want = pkts[j].clone();
            let icrc = h.compute(&want) ^ deltas[j];
            want[full - ICRC_LEN..].copy_from_slice(&icrc.to_le_bytes());
            assert_eq!(got, &want[..], "mtu {mtu} seed {seed} packet {j}");
        }
    }

    #[test]
    fn four_at_a_time_are_the_packets_sealed_one_by_one() {
        if !available() {
            // The caller builds and seals one by one here; nothing else to check.
            assert!(Seal4::new(&headers(1), HEAD + 1024 + ICRC_LEN).is_none());
            return;
        }
        for (n, mtu) in [256usize, 512, 1024, 4096].into_iter().enumerate() {
            for s in 0..24u64 {
                let h = headers(s as u32 * 31 + n as u32);
                let seal = Seal4::new(&h, HEAD + mtu + ICRC_LEN).expect("IPv4, whole blocks");
                check(&seal, &h, mtu, s, (s as usize * 37) % 300);
                // Received packets: any headers, byte 4 too (FECN, BECN: masked).
                let mut pkts: Vec<Vec<u8>> = (0..4).map(|j| packet(s * 8 + j, mtu)).collect();
                pkts[1][4] = 0xC0;
                pkts[2][0] = 0x08; // a WRITE MIDDLE's opcode: the bytes are what they are
                let got = seal.icrc4(std::array::from_fn(|j| &pkts[j][..]));
                for j in 0..4 {
                    assert_eq!(
                        got[j],
                        h.compute(&pkts[j]),
                        "mtu {mtu} seed {s} received {j}"
                    );
                }
            }
        }
    }

    #[test]
    fn it_does_not_apply_where_the_blocks_do_not_fit() {
        let h = headers(3);
        assert!(Seal4::new(&h, HEAD + 1000 + ICRC_LEN).is_none());
        assert!(Seal4::new(&h, HEAD + ICRC_LEN).is_none());
        assert!(Seal4::new(&h, 8).is_none());
        let v6 = IcrcHeaders::new("fd00::1".parse().unwrap(), "fd00::2".parse().unwrap(), 1);
        assert!(Seal4::new(&v6, HEAD + 1024 + ICRC_LEN).is_none());
        if available() {
            // Payloads of another length are built and sealed the plain way, rightly.
            let seal = Seal4::new(&h, HEAD + 1024 + ICRC_LEN).expect("applies");
            let a = packet(1, 1024);
            let b = packet(2, 510);
            let heads = [&a, &b, &a, &a].map(|p| -> [u8; HEAD] { p[..HEAD].try_into().unwrap() });
            let mut buf = Vec::new();
            let bodies = [
                &a[HEAD..HEAD + 1024],
                &b[HEAD..HEAD + 510],
                &a[HEAD..HEAD + 1024],
                &a[HEAD..HEAD + 1024],
            ];
            seal.build4(&mut buf, &heads, bodies, [0; 4]);
            let mut b_sealed = b[..HEAD + 510].to_vec();
            b_sealed.extend_from_slice(&[0; 2 + ICRC_LEN]);
            h.seal(&mut b_sealed);
            let a_len = HEAD + 1024 + ICRC_LEN;
            assert_eq!(&buf[a_len..a_len + b_sealed.len()], &b_sealed[..]);
            let got = seal.icrc4([&a, &b_sealed, &a, &a]);
            assert_eq!(got[1], h.compute(&b_sealed));
            assert_eq!(got[0], h.compute(&a));
        }
    }
}
