//! UDP generic segmentation offload on the send path (rocev2.md 13.2, 15): the packets of one
//! QP that a window lets go leave in runs of equal-size packets, each run one message with a
//! `UDP_SEGMENT` control message (a run of one packet has none), all runs of one transmission
//! in one `sendmmsg`, so the kernel's IP and UDP work is paid once per run and the system call
//! once per transmission (a WRITE and the CDC SEND after it: one call).
//!
//! The kernel numbers the IPv4 identification of segment k of such a send k (0, 1, 2, …; the
//! socket is unconnected with `IP_PMTUDISC_DO`), and the ICRC covers the identification, so
//! packet k of a run is re-sealed for identification k before it leaves: the ICRC changes by a
//! value that depends only on the packet length and k ([`Ipv4IdColumns`]), so re-sealing is
//! four XORed bytes, not a pass over the packet. A kept packet remembers which identification
//! its ICRC is sealed for, so a retransmission in another run (or alone, with identification 0)
//! re-seals it again. The receiver recovers the identification from the ICRC the same way.
//!
//! A run is at most [`MAX_SEGMENTS`] packets (the limit of older kernels) and 65,507 bytes, all
//! of one length except a shorter last one (the kernel cuts the payload into `gso_size` pieces).
//! All packets of a run belong to one QP, so the whole run has one destination QPN: the
//! reuseport steering of `steer.rs` (which sees a loopback GSO send as one unit) stays right.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, BorrowedFd};

use rustix::io::Errno;
use smc_wire::roce::{IcrcHeaders, IcrcPrefix, Ipv4IdColumns, ICRC_LEN};

/// Most segments in one send (64 before Linux 6.x raised `UDP_MAX_SEGMENTS` to 128).
pub(crate) const MAX_SEGMENTS: usize = 64;
/// Largest UDP payload of one send.
const MAX_SEND_BYTES: usize = 65_507;
/// `UDP_SEGMENT` (`SOL_UDP`): the segment size of a GSO send.
const UDP_SEGMENT: libc::c_int = 103;

/// Longest UDP payload whose columns a thread keeps (a RoCE packet's length is a multiple
/// of 4: payloads padded, BTH and ICRC 4-byte words): at a path MTU of 4096, about 1,050
/// entries of 64 bytes; the table grows only to the longest length a thread has seen.
const COLUMN_MAX_LEN: usize = 8192;

/// A thread's identification columns by packet length, indexed by `len / 4` and filled when
/// a length is first asked for: a lookup (once per packet on both sides) is one index,
/// where a SipHash per packet was 1–2 % of a stream's CPU on each side. Every length a
/// connection can produce keeps its slot (a stream whose updates do not end on a path-MTU
/// boundary makes a new last-packet length for many updates; a small cache replaced in turn
/// computed the columns again for most of them, about 17 CRC combines each).
struct ColumnCache {
    columns: Vec<Option<Ipv4IdColumns>>,
    /// [`smc_wire::roce::bth_mask_fix`] by length (4 bytes per slot).
    mask_fixes: Vec<Option<u32>>,
}

impl ColumnCache {
    /// [`smc_wire::roce::bth_mask_fix`] by length, cached as the columns are.
    fn mask_fix(&mut self, len: usize) -> u32 {
        by_len(&mut self.mask_fixes, len, smc_wire::roce::bth_mask_fix)
    }

    fn get(&mut self, len: usize) -> Ipv4IdColumns {
        by_len(&mut self.columns, len, Ipv4IdColumns::for_len)
    }
}

/// The value for packet length `len` in `slots` (indexed by `len / 4`), made by `make` the
/// first time; a length no packet has (not a multiple of 4, or past [`COLUMN_MAX_LEN`]) is
/// made afresh and not kept.
fn by_len<T: Copy>(slots: &mut Vec<Option<T>>, len: usize, make: fn(usize) -> T) -> T {
    if !len.is_multiple_of(4) || len > COLUMN_MAX_LEN {
        return make(len);
    }
    let i = len / 4;
    if slots.len() <= i {
        slots.resize(i + 1, None);
    }
    *slots[i].get_or_insert_with(|| make(len))
}

thread_local! {
    static COLUMNS: RefCell<ColumnCache> =
        const {
        RefCell::new(ColumnCache {
            columns: Vec::new(),
            mask_fixes: Vec::new(),
        })
    };
}

/// The identification columns for a UDP payload of `len` bytes (cached per thread: a
/// connection uses a handful of lengths). Computed afresh when the thread's cache is gone: a
/// process's exit handlers (the link groups' DELETE LINK at `exit`) run after the C library
/// has destroyed the exiting thread's thread-locals.
pub(crate) fn id_columns(len: usize) -> Ipv4IdColumns {
    COLUMNS
        .try_with(|c| c.borrow_mut().get(len))
        .unwrap_or_else(|_| Ipv4IdColumns::for_len(len))
}

/// The ICRC's fixed start for packets of `len` bytes with headers `h` (smc-wire
/// `IcrcPrefix`), its mask correction cached per thread and length as the columns are: about
/// 30 ns, where hashing the correction takes about 300 at a path MTU of 1024.
/// A length no packet has (not a multiple of 4, shorter than a BTH and ICRC, or past
/// [`COLUMN_MAX_LEN`], the longest a path MTU of 4096 makes) gets no prefix: its packets are
/// computed the full way, and a peer's datagrams cannot make the correction be hashed afresh
/// for lengths outside the cache.
pub(crate) fn icrc_prefix(h: &IcrcHeaders, len: usize) -> IcrcPrefix {
    if !len.is_multiple_of(4)
        || !(smc_wire::roce::BTH_LEN + ICRC_LEN..=COLUMN_MAX_LEN).contains(&len)
    {
        return IcrcPrefix::none(*h);
    }
    let fix = COLUMNS
        .try_with(|c| c.borrow_mut().mask_fix(len))
        .unwrap_or_else(|_| smc_wire::roce::bth_mask_fix(len));
    h.prefix_with(len, fix)
}

/// Re-seal a packet whose ICRC is for identification `*id` for identification `to`.
#[cfg(test)]
pub(crate) fn reseal(bytes: &mut [u8], id: &mut u16, to: u16) {
    reseal_tail(bytes.len(), bytes, id, to);
}

/// [`reseal`] of a packet of `len` bytes whose ICRC is the last four bytes of `tail` (a
/// packet kept in pieces: only its ICRC changes).
pub(crate) fn reseal_tail(len: usize, tail: &mut [u8], id: &mut u16, to: u16) {
    if *id == to || len < ICRC_LEN {
        return;
    }
    let cols = id_columns(len);
    if let Some(tail) = tail.last_chunk_mut::<ICRC_LEN>() {
        let icrc = u32::from_le_bytes(*tail) ^ cols.delta(*id) ^ cols.delta(to);
        *tail = icrc.to_le_bytes();
        *id = to;
    }
}

/// Cut packets of lengths `lens` into runs `(start, end)` that one GSO send can carry.
pub(crate) fn runs(lens: &[usize]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < lens.len() {
        let size = lens[start];
        let mut end = start + 1;
        let mut total = size;
        while end < lens.len()
            && end - start < MAX_SEGMENTS
            && lens[end] <= size
            && total + lens[end] <= MAX_SEND_BYTES
        {
            total += lens[end];
            end += 1;
            if lens[end - 1] < size {
                break; // only the last segment may be shorter
            }
        }
        out.push((start, end));
        start = end;
    }
    out
}

/// Pieces this short are gathered with their short neighbours into one iovec by
/// [`glue_short`]: a shared packet's pad and ICRC (4–7 bytes) and the next packet's BTH and
/// RETH (28 bytes); a payload piece is longer.
const GLUE_MAX: usize = 64;

/// The runs' pieces with every stretch of two or more consecutive short pieces (at most
/// [`GLUE_MAX`] bytes each) copied end to end into `glue` and sent as one piece; longer pieces
/// and lone short ones stay as they are, empty ones are left out. The bytes each run lays end
/// to end do not change. A run of n shared packets (headers, payload, tail each) goes as
/// 2n + 1 iovecs instead of 3n: the kernel's gather costs about 40 ns per iovec
/// (docs/performance.md, "Session 21"), and the glue copies 32–36 bytes per packet. The runs'
/// vectors are rewritten in place, and `glue` takes its room once.
pub(crate) fn glue_short<'a>(
    mut runs: Vec<Vec<&'a [u8]>>,
    glue: &'a mut Vec<u8>,
) -> Vec<Vec<&'a [u8]>> {
    for run in &mut runs {
        run.retain(|p| !p.is_empty());
    }
    glue.clear();
    // One allocation: room for every short piece (growing piece by piece reallocated several
    // times per transmission: the most frequent allocation of a 16 KiB round trip).
    glue.reserve(
        runs.iter()
            .flatten()
            .filter(|p| p.len() <= GLUE_MAX)
            .map(|p| p.len())
            .sum(),
    );
    // Each stretch's bytes, in order.
    for run in &runs {
        let mut i = 0;
        while i < run.len() {
            let j = stretch_end(run, i);
            if j - i >= 2 {
                for p in &run[i..j] {
                    glue.extend_from_slice(p);
                }
                i = j;
            } else {
                i += 1;
            }
        }
    }
    // Filled: from here on only read, for as long as the pieces live.
    let glue: &'a [u8] = glue;
    // The same stretches in the same order, each replaced by its bytes in `glue` (the write
    // index never passes the read index).
    let mut at = 0;
    for run in &mut runs {
        let (mut w, mut i) = (0, 0);
        while i < run.len() {
            let j = stretch_end(run, i);
            if j - i >= 2 {
                let len: usize = run[i..j].iter().map(|p| p.len()).sum();
                run[w] = &glue[at..at + len];
                at += len;
                i = j;
            } else {
                run[w] = run[i];
                i += 1;
            }
            w += 1;
        }
        run.truncate(w);
    }
    runs
}

/// Where the stretch of short pieces starting at `i` ends (`i` itself when `run[i]` is long).
fn stretch_end(run: &[&[u8]], i: usize) -> usize {
    let mut j = i;
    while j < run.len() && run[j].len() <= GLUE_MAX {
        j += 1;
    }
    j
}

/// Whether a failed GSO send means this socket cannot do GSO at all (then the device falls
/// back to one datagram per packet), rather than a passing condition (a full buffer, a
/// network that is down) after which the retransmission recovers the run.
pub(crate) fn unsupported(e: Errno) -> bool {
    matches!(
        e,
        Errno::IO | Errno::INVAL | Errno::NOPROTOOPT | Errno::OPNOTSUPP | Errno::MSGSIZE
    )
}

/// One message of [`send_runs`]: the pieces of its packets in order (one iovec each; the
/// kernel lays them end to end and, with `UDP_SEGMENT`, cuts the result every `gso_size`
/// bytes, wherever the pieces' own bounds are), how many packets they make, and the
/// `UDP_SEGMENT` size when more than one.
pub(crate) struct Run<'a> {
    pub(crate) pieces: Vec<&'a [u8]>,
    pub(crate) packets: usize,
    pub(crate) gso_size: Option<u16>,
}

/// Send several runs to `dst` with one `sendmmsg`: each run is one message, with its own
/// `UDP_SEGMENT` control message when it holds several packets. Returns how many messages
/// the kernel took (at least one), or the error of the first.
pub(crate) fn send_runs(
    sock: BorrowedFd<'_>,
    dst: SocketAddr,
    runs: &[Run<'_>],
) -> Result<usize, Errno> {
    if runs.is_empty() {
        return Ok(0);
    }
    let (addr, addr_len) = sockaddr(dst);
    let mut iovs: Vec<Vec<libc::iovec>> = runs
        .iter()
        .map(|r| {
            r.pieces
                .iter()
                .filter(|s| !s.is_empty())
                .map(|s| libc::iovec {
                    iov_base: s.as_ptr() as *mut libc::c_void,
                    iov_len: s.len(),
                })
                .collect()
        })
        .collect();
    // One control buffer per message, room for one cmsg carrying a u16, aligned for cmsghdr.
    let mut ctrls: Vec<[u64; 4]> = vec![[0u64; 4]; runs.len()];
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<u16>() as u32) } as usize;
    debug_assert!(space <= std::mem::size_of::<[u64; 4]>());
    // SAFETY: mmsghdr is plain data; every pointer stored in it points to a live local buffer
    // of the stated length (`addr`, `iovs`, `ctrls` outlive the call), and the kernel only
    // reads them during the call.
    let rc = unsafe {
        let mut msgs: Vec<libc::mmsghdr> = Vec::with_capacity(runs.len());
        for ((run, iov), ctrl) in runs.iter().zip(iovs.iter_mut()).zip(ctrls.iter_mut()) {
            let mut m: libc::mmsghdr = std::mem::zeroed();
            m.msg_hdr.msg_name = (&addr as *const libc::sockaddr_in6).cast_mut().cast();
            m.msg_hdr.msg_namelen = addr_len;
            m.msg_hdr.msg_iov = iov.as_mut_ptr();
            m.msg_hdr.msg_iovlen = iov.len() as _;
            if let Some(gso) = run.gso_size {
                m.msg_hdr.msg_control = ctrl.as_mut_ptr().cast();
                m.msg_hdr.msg_controllen = space as _;
                let c = libc::CMSG_FIRSTHDR(&m.msg_hdr);
                (*c).cmsg_level = libc::SOL_UDP;
                (*c).cmsg_type = UDP_SEGMENT;
                (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<u16>() as u32) as _;
                std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<u16>(), gso);
            }
            msgs.push(m);
        }
        libc::sendmmsg(
            sock.as_raw_fd(),
            msgs.as_mut_ptr(),
            msgs.len() as libc::c_uint,
            libc::MSG_DONTWAIT,
        )
    };
    if rc <= 0 {
        Err(Errno::from_io_error(&std::io::Error::last_os_error()).unwrap_or(Errno::IO))
    } else {
        Ok(rc as usize)
    }
}

/// `dst` as a socket address for the kernel, in a `sockaddr_in6` (which has room for a
/// `sockaddr_in`), with the length of the one it holds.
fn sockaddr(dst: SocketAddr) -> (libc::sockaddr_in6, libc::socklen_t) {
    // SAFETY: sockaddr_in6 is plain old data; all-zero is valid.
    let mut out: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
    match dst {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(v4.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: a sockaddr_in fits in the sockaddr_in6 and needs no stricter alignment.
            unsafe { std::ptr::write((&mut out as *mut libc::sockaddr_in6).cast(), sin) };
            (
                out,
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        }
        SocketAddr::V6(v6) => {
            out.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            out.sin6_port = v6.port().to_be();
            out.sin6_addr.s6_addr = v6.ip().octets();
            out.sin6_flowinfo = v6.flowinfo();
            out.sin6_scope_id = v6.scope_id();
            (
                out,
                std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// At `exit` the C library destroys the exiting thread's thread-locals before the exit
    /// handlers run, and the link groups' DELETE LINK is sent from such a handler: the cache
    /// may be gone then. Modelled by a thread-local registered before the cache whose
    /// destructor (run after the cache's) needs the columns. Before the fix this panicked in
    /// a destructor, which aborts the process (redis-benchmark under `smc run` died of SIGABRT
    /// at exit).
    #[test]
    fn id_columns_after_the_thread_cache_is_gone() {
        struct AtExit(std::sync::mpsc::Sender<Ipv4IdColumns>);
        impl Drop for AtExit {
            fn drop(&mut self) {
                let _ = self.0.send(id_columns(100));
            }
        }
        thread_local! {
            static EXIT: RefCell<Option<AtExit>> = const { RefCell::new(None) };
        }
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            EXIT.with(|e| *e.borrow_mut() = Some(AtExit(tx)));
            // The cache is made after the handler's thread-local: destroyed before it.
            let _ = id_columns(100);
        })
        .join()
        .expect("thread");
        let got = rx.recv().expect("the destructor ran");
        assert!(got == Ipv4IdColumns::for_len(100));
    }

    /// The thread's cache gives each length its own columns: many lengths in turn (a stream
    /// whose last packets vary), lengths that are no multiple of 4 and lengths past the table.
    #[test]
    fn id_columns_are_right_for_many_lengths() {
        let mut lens: Vec<usize> = (0..300).map(|i| 20 + 4 * i).collect();
        lens.extend([21, 1057, COLUMN_MAX_LEN, COLUMN_MAX_LEN + 4, 65_000]);
        for _ in 0..2 {
            for &len in &lens {
                assert!(
                    id_columns(len) == Ipv4IdColumns::for_len(len),
                    "length {len}"
                );
            }
        }
        // A length asked for again at once is a hit, and still right.
        assert!(id_columns(1056) == Ipv4IdColumns::for_len(1056));
        assert!(id_columns(1056) == Ipv4IdColumns::for_len(1056));
    }

    /// Short neighbours are joined, long pieces stay the same slices, each run's bytes are
    /// unchanged, and a run of n packets of (head, payload, tail) goes as 2n + 1 pieces.
    #[test]
    fn short_pieces_are_glued() {
        let payload = [[7u8; 1024], [8u8; 1024], [9u8; 1024]];
        let heads = [[1u8; 28], [2u8; 28], [3u8; 28]];
        let tails = [[4u8; 4], [5u8; 4], [6u8; 4]];
        let mut run = Vec::new();
        for k in 0..3 {
            run.extend([&heads[k][..], &payload[k][..], &tails[k][..]]);
        }
        // A second run: a flat packet (body, nothing, ICRC), a lone short piece between two
        // long ones, and empties.
        let body = [10u8; 1052];
        let icrc = [11u8; 4];
        let flat: Vec<&[u8]> = vec![&body, &[], &icrc, &body, &[], &[], &icrc[..2], &body];
        let mut glue = Vec::new();
        let out = glue_short(vec![run.clone(), flat.clone()], &mut glue);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].len(), 2 * 3 + 1);
        assert_eq!(out[0].concat(), run.concat());
        assert_eq!(out[1].concat(), flat.concat());
        for run in &out {
            assert!(run.iter().all(|p| !p.is_empty()));
            assert!(run
                .windows(2)
                .all(|w| w[0].len() > GLUE_MAX || w[1].len() > GLUE_MAX));
            for p in run.iter().filter(|p| p.len() > GLUE_MAX) {
                assert!(
                    payload.iter().any(|x| x.as_ptr() == p.as_ptr()) || p.as_ptr() == body.as_ptr(),
                    "a long piece is sent from where it lies"
                );
            }
        }
        assert_eq!(glue_short(Vec::new(), &mut glue).len(), 0);
    }

    /// The cached prefix is the one made afresh, for many lengths in turn, twice over.
    #[test]
    fn icrc_prefixes_are_right_for_many_lengths() {
        let h = IcrcHeaders::new(
            "10.1.2.3".parse().expect("ip"),
            "10.1.2.4".parse().expect("ip"),
            49152,
        );
        let mut lens: Vec<usize> = (0..300).map(|i| 16 + 4 * i).collect();
        lens.extend([21, 1057, COLUMN_MAX_LEN, COLUMN_MAX_LEN + 4, 65_000]);
        for _ in 0..2 {
            for &len in &lens {
                let want = if len.is_multiple_of(4) && len <= COLUMN_MAX_LEN {
                    h.prefix(len)
                } else {
                    IcrcPrefix::none(h)
                };
                assert_eq!(icrc_prefix(&h, len), want, "length {len}");
            }
        }
    }

    #[test]
    fn runs_keep_equal_sizes_and_a_shorter_last() {
        assert_eq!(runs(&[]), Vec::<(usize, usize)>::new());
        assert_eq!(runs(&[100]), [(0, 1)]);
        assert_eq!(runs(&[100, 100, 40]), [(0, 3)]);
        // A shorter packet ends a run; a longer one starts a new run.
        assert_eq!(runs(&[100, 40, 100, 100, 120]), [(0, 2), (2, 4), (4, 5)]);
        let many = vec![1000; 150];
        assert_eq!(runs(&many), [(0, 64), (64, 128), (128, 150)]);
        let big = vec![4000; 20];
        let r = runs(&big);
        assert!(r.iter().all(|(a, b)| (b - a) * 4000 <= MAX_SEND_BYTES));
        assert_eq!(r.last().map(|x| x.1), Some(20));
    }

    #[test]
    fn reseal_round_trips() {
        let mut p = vec![7u8; 1040];
        let orig = p.clone();
        let mut id = 0;
        reseal(&mut p, &mut id, 5);
        assert_eq!(id, 5);
        assert_ne!(p, orig);
        reseal(&mut p, &mut id, 0);
        assert_eq!(p, orig);
    }
}
