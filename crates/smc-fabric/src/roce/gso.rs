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
//! re-seals it again — a packed WRITE's packet, sealed at post and immutable, as a copy
//! ([`Layout::lay_out`]). The receiver recovers the identification from the ICRC the same way.
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
pub(crate) const MAX_SEND_BYTES: usize = 65_507;
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
#[cfg(test)]
pub(crate) fn runs(lens: &[usize]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < lens.len() {
        let end = run_end(|i| lens[i], |_| false, start, lens.len());
        out.push((start, end));
        start = end;
    }
    out
}

/// How many packets of `len` bytes one run carries at most ([`run_end`]'s limits): a packed
/// post (qp.rs) seals its packets for their places in runs of this many.
pub(crate) fn run_capacity(len: usize) -> usize {
    MAX_SEGMENTS.min(MAX_SEND_BYTES / len.max(1)).max(1)
}

/// Where the run that starts with packet `start` of `n` ends (exclusive), `len(i)` being
/// packet i's length: at most [`MAX_SEGMENTS`] packets and [`MAX_SEND_BYTES`] bytes, all of
/// the first one's length but a shorter last (the kernel cuts the payload into pieces of the
/// first length), and none after the first for which `starts_run` says so.
fn run_end(
    len: impl Fn(usize) -> usize,
    starts_run: impl Fn(usize) -> bool,
    start: usize,
    n: usize,
) -> usize {
    let size = len(start);
    let mut end = start + 1;
    let mut total = size;
    while end < n && end - start < MAX_SEGMENTS {
        let l = len(end);
        if l > size || total + l > MAX_SEND_BYTES || starts_run(end) {
            break;
        }
        total += l;
        end += 1;
        if l < size {
            break; // only the last segment may be shorter
        }
    }
    end
}

/// Pieces this short are gathered with their short neighbours into one iovec by
/// [`Layout::lay_out`]: a shared packet's pad and ICRC (4–7 bytes) and the next packet's BTH
/// and RETH (28 bytes), an ACK; a payload piece, or a flat packet, is longer.
const GLUE_MAX: usize = 64;

/// One message of a transmission: its iovecs (a range of [`Layout`]'s), the packets it
/// carries (the first one's index among the call's), its bytes, its `UDP_SEGMENT` size when
/// it holds more than one packet.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Msg {
    iovs: (usize, usize),
    pub(crate) first: usize,
    pub(crate) packets: usize,
    pub(crate) bytes: usize,
    pub(crate) gso_size: Option<u16>,
}

/// The messages of one transmission laid out for `sendmmsg`, in buffers a thread reuses from
/// one transmission to the next ([`with_layout`]): building them allocated nine vectors or
/// more per transmission (about 2 % of a stream sender's CPU with the glue's own pass,
/// docs/performance.md "Session 23"). Its iovecs point into the packets laid out (and into
/// its own glue) and are valid only until those are touched again: [`lay_out`](Self::lay_out)
/// and [`send`](Self::send) go together, with the packets borrowed in between.
#[derive(Default)]
pub(crate) struct Layout {
    iovs: Vec<libc::iovec>,
    /// Iovecs of glued stretches: (index in `iovs`, offset in `glue`), pointed at the glue
    /// once it is complete (it may move while it grows).
    glued: Vec<(usize, usize)>,
    glue: Vec<u8>,
    /// Copies of fixed packets sealed for another identification than their place in the
    /// run needs (a retransmission, a run cut elsewhere than at post), each resealed, and
    /// their iovecs: (index in `iovs`, offset in `copies`), pointed at once complete.
    copies: Vec<u8>,
    copied: Vec<(usize, usize)>,
    /// The packets copied: (index among the call's, offset in `copies`, length).
    copy_of: Vec<(usize, usize, usize)>,
    msgs: Vec<Msg>,
    hdrs: Vec<libc::mmsghdr>,
    /// One control buffer per message: room for one cmsg carrying a u16, aligned for
    /// cmsghdr.
    ctrls: Vec<[u64; 4]>,
}

thread_local! {
    static LAYOUT: std::cell::Cell<Layout> = const {
        std::cell::Cell::new(Layout {
            iovs: Vec::new(),
            glued: Vec::new(),
            glue: Vec::new(),
            copies: Vec::new(),
            copied: Vec::new(),
            copy_of: Vec::new(),
            msgs: Vec::new(),
            hdrs: Vec::new(),
            ctrls: Vec::new(),
        })
    };
}

/// Run `f` with the calling thread's [`Layout`] (a fresh one when the thread's is gone, at
/// exit, or in use).
pub(crate) fn with_layout<R>(f: impl FnOnce(&mut Layout) -> R) -> R {
    let mut layout = LAYOUT.try_with(std::cell::Cell::take).unwrap_or_default();
    let r = f(&mut layout);
    // No pointer outlives the call.
    layout.clear();
    let _ = LAYOUT.try_with(|c| c.set(layout));
    r
}

/// A stretch of short pieces being gathered: the first one (sent from where it lies if it
/// stays alone), where its copy starts in the glue, how many.
struct Stretch {
    first: libc::iovec,
    at: usize,
    count: usize,
}

impl Layout {
    fn clear(&mut self) {
        self.iovs.clear();
        self.glued.clear();
        self.glue.clear();
        self.copies.clear();
        self.copied.clear();
        self.copy_of.clear();
        self.msgs.clear();
        self.hdrs.clear();
        self.ctrls.clear();
    }

    /// Lay `pkts` out as messages: runs of equal packets (a shorter last), each packet of a
    /// run re-sealed for its index in the run when `v4` (the kernel numbers the segments'
    /// identifications 0, 1, 2…), each run one message of the packets' pieces, every stretch
    /// of two or more consecutive short pieces ([`GLUE_MAX`] bytes at most each) copied end to
    /// end into one iovec; longer pieces and lone short ones go from where they lie, empty
    /// ones are left out. A run of n shared packets (headers, payload, tail each) goes as
    /// 2n + 1 iovecs instead of 3n: the kernel's gather costs about 40 ns per iovec
    /// (docs/performance.md, "Session 21"), the glue 32–36 bytes of copy per packet.
    pub(crate) fn lay_out<'l>(
        &'l mut self,
        pkts: &'l mut [super::txpkt::Wire<'_>],
        v4: bool,
    ) -> Laid<'l> {
        self.clear();
        let n = pkts.len();
        let mut start = 0;
        // A packed post's first packet (sealed at post for identification 0) starts a run:
        // after the last packets of the post before it, it would need a copy; so does a
        // packed post's whole run (one wire of several packets).
        let starts_run =
            |w: &super::txpkt::Wire<'_>| w.packets > 1 || (v4 && w.fixed() && w.id.get() == 0);
        while start < n {
            let (end, packets, seg) = match pkts.get(start).filter(|w| w.packets > 1) {
                // A packed post's whole run, sealed at post for its places, goes as it lies
                // (one iovec); when its last packet is full, packets no longer than its own
                // may follow it in the message (an update's CDC SEND).
                Some(w) => {
                    let seg = usize::from(w.seg);
                    let mut packets = usize::from(w.packets);
                    let mut bytes = w.parts[0].len();
                    debug_assert!(
                        packets <= MAX_SEGMENTS
                            && bytes <= MAX_SEND_BYTES
                            && (packets - 1) * seg < bytes
                            && bytes <= packets * seg,
                        "a whole run outside one message's limits"
                    );
                    debug_assert!(
                        !v4 || w.id.get() == 0,
                        "a whole run that does not start its message at place 0"
                    );
                    let mut end = start + 1;
                    if bytes == packets * seg {
                        while let Some(x) = pkts.get(end) {
                            let l = x.len();
                            // A whole run sealed for the places after these packets (a packed
                            // post continuing the run before it, qp.rs `doorbell_runs`).
                            if x.packets > 1
                                && x.seg == w.seg
                                && x.fixed()
                                && usize::from(x.id.get()) == packets
                                && packets + usize::from(x.packets) <= MAX_SEGMENTS
                                && bytes + l <= MAX_SEND_BYTES
                            {
                                bytes += l;
                                packets += usize::from(x.packets);
                                end += 1;
                                if l < usize::from(x.packets) * seg {
                                    break;
                                }
                                continue;
                            }
                            if packets >= MAX_SEGMENTS
                                || starts_run(x)
                                || l > seg
                                || bytes + l > MAX_SEND_BYTES
                            {
                                break;
                            }
                            bytes += l;
                            packets += 1;
                            end += 1;
                            if l < seg {
                                break;
                            }
                        }
                    }
                    (end, packets, seg)
                }
                None => {
                    let end = run_end(|i| pkts[i].len(), |i| starts_run(&pkts[i]), start, n);
                    (end, end - start, pkts[start].len())
                }
            };
            // Each packet sealed for its index in the run: in place, or (a fixed packet
            // sealed for another place) a copy into `copies`, noted by packet.
            let copies_from = self.copy_of.len();
            if v4 {
                let mut k = 0u16;
                for (i, w) in pkts.iter_mut().enumerate().take(end).skip(start) {
                    if w.packets == 1 {
                        let at = self.copies.len();
                        if let Some(len) = w.seal_into(k, &mut self.copies) {
                            self.copy_of.push((i, at, len));
                        }
                    }
                    k = k.wrapping_add(w.packets);
                }
            }
            let mut next_copy = copies_from;
            let first_iov = self.iovs.len();
            let mut bytes = 0;
            let mut stretch: Option<Stretch> = None;
            for (i, w) in pkts.iter().enumerate().take(end).skip(start) {
                if let Some(&(_, at, len)) = self.copy_of.get(next_copy).filter(|c| c.0 == i) {
                    next_copy += 1;
                    bytes += len;
                    self.end_stretch(stretch.take());
                    self.copied.push((self.iovs.len(), at));
                    self.iovs.push(libc::iovec {
                        iov_base: std::ptr::null_mut(),
                        iov_len: len,
                    });
                    continue;
                }
                for p in w.pieces().into_iter().filter(|p| !p.is_empty()) {
                    bytes += p.len();
                    if p.len() > GLUE_MAX {
                        self.end_stretch(stretch.take());
                        // Pieces that lie end to end (a packed post's packets) are one.
                        match self.iovs[first_iov..].last_mut() {
                            Some(v)
                                if (v.iov_base as usize).wrapping_add(v.iov_len)
                                    == p.as_ptr() as usize
                                    && !v.iov_base.is_null() =>
                            {
                                v.iov_len += p.len();
                            }
                            _ => self.iovs.push(iovec(p)),
                        }
                        continue;
                    }
                    let s = stretch.get_or_insert(Stretch {
                        first: iovec(p),
                        at: self.glue.len(),
                        count: 0,
                    });
                    s.count += 1;
                    self.glue.extend_from_slice(p);
                }
            }
            self.end_stretch(stretch);
            self.msgs.push(Msg {
                iovs: (first_iov, self.iovs.len()),
                first: start,
                packets,
                bytes,
                gso_size: (packets > 1).then(|| u16::try_from(seg).ok()).flatten(),
            });
            start = end;
        }
        // The glue and the copies are complete: their iovecs point into them from here on.
        for (list, buf) in [(&self.glued, &self.glue), (&self.copied, &self.copies)] {
            for &(i, at) in list {
                if let (Some(v), Some(b)) = (self.iovs.get_mut(i), buf.get(at..)) {
                    v.iov_base = b.as_ptr() as *mut libc::c_void;
                }
            }
        }
        Laid {
            layout: self,
            _pkts: std::marker::PhantomData,
        }
    }

    /// Close a stretch of short pieces: alone, its piece goes from where it lies (its copy is
    /// taken back); else its copy in the glue is one iovec.
    fn end_stretch(&mut self, s: Option<Stretch>) {
        let Some(s) = s else { return };
        if s.count == 1 {
            self.glue.truncate(s.at);
            self.iovs.push(s.first);
        } else {
            self.glued.push((self.iovs.len(), s.at));
            self.iovs.push(libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: self.glue.len() - s.at,
            });
        }
    }
}

/// A transmission laid out ([`Layout::lay_out`]): it holds the packets borrowed, so the
/// iovecs that point into them stay valid for as long as it lives.
pub(crate) struct Laid<'l> {
    layout: &'l mut Layout,
    _pkts: std::marker::PhantomData<&'l mut ()>,
}

impl Laid<'_> {
    /// The messages laid out.
    pub(crate) fn msgs(&self) -> &[Msg] {
        &self.layout.msgs
    }

    /// The pieces of message `i` (tests).
    #[cfg(test)]
    fn pieces(&self, i: usize) -> Vec<&[u8]> {
        let (a, b) = self.layout.msgs[i].iovs;
        self.layout.iovs[a..b]
            .iter()
            // SAFETY: every iovec points at `iov_len` live bytes: a piece of the packets the
            // test still holds, or the glue.
            .map(|v| unsafe { std::slice::from_raw_parts(v.iov_base as *const u8, v.iov_len) })
            .collect()
    }

    /// Send the messages from `from` on to `dst` with one `sendmmsg`, each with its own
    /// `UDP_SEGMENT` control message when it holds several packets. Returns how many messages
    /// the kernel took (at least one), or the error of the first.
    pub(crate) fn send(
        &mut self,
        sock: BorrowedFd<'_>,
        dst: SocketAddr,
        from: usize,
    ) -> Result<usize, Errno> {
        let l = &mut *self.layout;
        let msgs = l.msgs.get(from..).unwrap_or_default();
        if msgs.is_empty() {
            return Ok(0);
        }
        let (addr, addr_len) = sockaddr(dst);
        l.ctrls.clear();
        l.ctrls.resize(msgs.len(), [0u64; 4]);
        l.hdrs.clear();
        // SAFETY: CMSG_SPACE only computes a size.
        let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<u16>() as u32) } as usize;
        debug_assert!(space <= std::mem::size_of::<[u64; 4]>());
        // SAFETY: mmsghdr is plain data; every pointer stored in it points to a live buffer of
        // the stated length (`addr`; `iovs` and `ctrls`, not resized until the call returns;
        // the iovecs' own targets, the packets borrowed by the caller since `lay_out` and the
        // glue), and the kernel only reads them during the call.
        let rc = unsafe {
            for (m, ctrl) in msgs.iter().zip(l.ctrls.iter_mut()) {
                let mut h: libc::mmsghdr = std::mem::zeroed();
                h.msg_hdr.msg_name = (&addr as *const libc::sockaddr_in6).cast_mut().cast();
                h.msg_hdr.msg_namelen = addr_len;
                h.msg_hdr.msg_iov = l.iovs.as_mut_ptr().add(m.iovs.0);
                h.msg_hdr.msg_iovlen = (m.iovs.1 - m.iovs.0) as _;
                if let Some(gso) = m.gso_size {
                    h.msg_hdr.msg_control = ctrl.as_mut_ptr().cast();
                    h.msg_hdr.msg_controllen = space as _;
                    let c = libc::CMSG_FIRSTHDR(&h.msg_hdr);
                    (*c).cmsg_level = libc::SOL_UDP;
                    (*c).cmsg_type = UDP_SEGMENT;
                    (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<u16>() as u32) as _;
                    std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<u16>(), gso);
                }
                l.hdrs.push(h);
            }
            libc::sendmmsg(
                sock.as_raw_fd(),
                l.hdrs.as_mut_ptr(),
                l.hdrs.len() as libc::c_uint,
                libc::MSG_DONTWAIT,
            )
        };
        if rc <= 0 {
            Err(Errno::from_io_error(&std::io::Error::last_os_error()).unwrap_or(Errno::IO))
        } else {
            Ok(rc as usize)
        }
    }
}

/// An iovec of `p` (the kernel only reads through it).
fn iovec(p: &[u8]) -> libc::iovec {
    libc::iovec {
        iov_base: p.as_ptr() as *mut libc::c_void,
        iov_len: p.len(),
    }
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

    /// A transmission's layout: runs cut as [`runs`] cuts them, short neighbours joined, long
    /// pieces sent from where they lie, lone short ones too, each message's bytes the
    /// packets' bytes; a run of n packets of (head, payload, tail) goes as 2n + 1 iovecs. The
    /// thread's layout is reused: a second transmission starts afresh.
    #[test]
    fn layouts_glue_short_neighbours_and_cut_runs() {
        use super::super::txpkt::Wire;
        let payload = [[7u8; 1024], [8u8; 1024], [9u8; 1024]];
        let heads = [[1u8; 28], [2u8; 28], [3u8; 28]];
        let mut tails = [[4u8; 4], [5u8; 4], [6u8; 4]];
        // Two flat packets of the same length, a short one (an ACK's length), and one more
        // of the first length, which a shorter packet before it puts in a run of its own.
        let mut flat: Vec<Vec<u8>> = vec![vec![10u8; 1056], vec![11u8; 1056], vec![12u8; 20]];
        let mut last = vec![13u8; 1056];
        // Where the long pieces lie.
        let long: Vec<*const u8> = payload
            .iter()
            .map(|p| p.as_ptr())
            .chain(flat.iter().map(|b| b.as_ptr()))
            .chain([last.as_ptr()])
            .collect();
        let mut ids = [0u16; 7];
        let (id_shared, id_flat) = ids.split_at_mut(3);
        let mut pkts: Vec<Wire<'_>> = Vec::new();
        for ((k, tail), id) in tails.iter_mut().enumerate().zip(id_shared.iter_mut()) {
            pkts.push(Wire {
                parts: [&heads[k], &payload[k]],
                tail,
                id: super::super::txpkt::Sealed::Kept(id),
                packets: 1,
                seg: 0,
            });
        }
        let (id_flat, id_last) = id_flat.split_at_mut(3);
        for (b, id) in flat.iter_mut().zip(id_flat.iter_mut()) {
            pkts.push(Wire::flat(b, id));
        }
        pkts.push(Wire::flat(&mut last, &mut id_last[0]));
        let want: Vec<Vec<u8>> = pkts.iter().map(Wire::to_vec).collect();
        let lens: Vec<usize> = want.iter().map(Vec::len).collect();
        assert_eq!(runs(&lens), vec![(0, 6), (6, 7)]);
        for round in 0..2 {
            with_layout(|layout| {
                let l = layout.lay_out(&mut pkts, false);
                let msgs = l.msgs().to_vec();
                assert_eq!(msgs.len(), 2, "round {round}");
                assert_eq!((msgs[0].first, msgs[0].packets), (0, 6));
                assert_eq!((msgs[1].first, msgs[1].packets), (6, 1));
                assert_eq!(msgs[0].gso_size, Some(1056));
                assert_eq!(msgs[1].gso_size, None);
                for (i, m) in msgs.iter().enumerate() {
                    let pieces = l.pieces(i);
                    let bytes = want[m.first..m.first + m.packets].concat();
                    assert_eq!(pieces.concat(), bytes);
                    assert_eq!(m.bytes, bytes.len());
                    assert!(pieces.iter().all(|p| !p.is_empty()));
                    assert!(pieces
                        .windows(2)
                        .all(|w| w[0].len() > GLUE_MAX || w[1].len() > GLUE_MAX));
                    for p in pieces.iter().filter(|p| p.len() > GLUE_MAX) {
                        assert!(
                            long.contains(&p.as_ptr()),
                            "a long piece is sent from where it lies"
                        );
                    }
                }
                // Three shared packets: head, payload, then (tail + head) and payload twice,
                // the last tail alone before the first flat body (long): 7; the two flat
                // packets' bodies with a lone ICRC between them, then the second one's ICRC
                // glued to the short packet: 4.
                assert_eq!(l.pieces(0).len(), 7 + 4);
                assert_eq!(l.pieces(1).len(), 2);
            });
        }
        with_layout(|layout| {
            assert!(layout.lay_out(&mut [], true).msgs().is_empty());
        });
    }

    /// Packed posts' packets (fixed, sealed at post for their places): each post's first
    /// packet starts a run, the packets of a run that lie end to end go as one iovec from
    /// where they lie, and a packet sealed for another place than the one it gets goes as a
    /// copy resealed for it; over IPv6 (no identification) nothing is cut or copied.
    #[test]
    fn packed_packets_go_as_they_lie_or_as_resealed_copies() {
        use super::super::txpkt::Wire;
        // Two posts of 2 and 3 packets of 100 bytes (longer than glued pieces) in one buffer each, sealed for 0, 1 (, 2);
        // then the first post's second packet alone again (a retransmission).
        let a: Vec<u8> = (0..200u8).collect();
        let b: Vec<u8> = (0..=255u8).chain(0..44).map(|x| x ^ 0x5A).collect();
        let fixed = |bytes, id| Wire {
            parts: [bytes, &[]],
            tail: &mut [],
            id: super::super::txpkt::Sealed::Fixed(id),
            packets: 1,
            seg: 0,
        };
        let mut pkts = vec![
            fixed(&a[..100], 0),
            fixed(&a[100..], 1),
            fixed(&b[..100], 0),
            fixed(&b[100..200], 1),
            fixed(&b[200..], 2),
            fixed(&a[100..], 1),
        ];
        with_layout(|layout| {
            let l = layout.lay_out(&mut pkts, true);
            let msgs = l.msgs().to_vec();
            let runs: Vec<(usize, usize)> = msgs.iter().map(|m| (m.first, m.packets)).collect();
            // The retransmitted packet, sealed for 1, is the fourth of the second run.
            assert_eq!(runs, vec![(0, 2), (2, 4)]);
            assert_eq!(l.pieces(0), vec![&a[..]], "one iovec from where it lies");
            let second = l.pieces(1);
            assert_eq!(second.len(), 2);
            assert_eq!(second[0], &b[..]);
            assert_eq!(second[0].as_ptr(), b.as_ptr());
            let mut want = a[100..].to_vec();
            let mut id = 1;
            reseal(&mut want, &mut id, 3);
            assert_eq!(second[1], &want[..], "a copy sealed for its place");
            assert_ne!(second[1].as_ptr(), a[100..].as_ptr());
        });
        with_layout(|layout| {
            let l = layout.lay_out(&mut pkts, false);
            let runs: Vec<(usize, usize)> = l.msgs().iter().map(|m| (m.first, m.packets)).collect();
            assert_eq!(runs, vec![(0, 6)]);
            assert_eq!(l.pieces(0).concat(), [&a[..], &b[..], &a[100..]].concat());
        });
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
