//! The receive side of a device socket: one `recvmmsg` for up to [`BATCH`] datagrams, and
//! `UDP_GRO`, with which the kernel hands a `UDP_SEGMENT` send of the peer (gso.rs: up to 64
//! packets of one QP, as one buffer through a veth, or merged again by a NIC's GRO) to the
//! socket as one datagram with the segment size in a control message, instead of cutting it
//! into one socket buffer, one queueing and one wake-up test per packet. This side cuts it
//! (`packets`), so each packet still has its own ICRC check and goes to its QP alone.
//!
//! A NIC's GRO merges by 4-tuple, which all QPs between two hosts share (rocev2.md 16.2), and
//! the reuseport program steers a merged datagram as a unit by its first packet: with several
//! processes on the port, a merged datagram could carry another process's packets. A device
//! that receives such a packet turns `UDP_GRO` off for good (device.rs, `gro_off`); that packet
//! is dropped and the RC retransmission delivers it. Through a veth nothing is merged across
//! sends, so there a datagram never holds more than one QP's packets.

use rustix::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};

/// Datagrams per `recvmmsg`.
pub(crate) const BATCH: usize = 32;
/// Most `recvmmsg` calls in one go (up to `BATCH * ROUNDS` datagrams) before the ACKs of the
/// batch leave.
pub(crate) const ROUNDS: usize = 64;
/// Room for one datagram: the largest UDP payload (a coalesced one reaches 64 packets of
/// 1,024 bytes and more).
const RX_BUF: usize = 65_536;
/// `UDP_GRO` (`SOL_UDP`): coalesce received segments; the control message carries the
/// segment size as an `int`.
const UDP_GRO: libc::c_int = 104;
/// Where in a 4 KiB page each datagram's slot starts. The kernel copies a datagram out of
/// buffers whose data starts on a page boundary (a `UDP_SEGMENT` send's pages through a
/// veth); a slot that starts a few bytes after a page boundary, as one of a large heap
/// allocation does (16 with glibc), puts every load of that copy 4 KiB-aliased with a store
/// just made, and the copy ran at a third of its speed: 11.3 µs per 16 KiB round trip against
/// 4–5 µs with the slot at any other offset, and a 256 MiB stream's receive copy 1,000 perf
/// samples against 455 (TCP's copy of the same bytes: 569; docs/performance.md, "Session 21").
/// Half a page is as far from either side as a slot can be.
const SLOT_PAGE_OFFSET: usize = 2048;
/// How far past `addr` the first slot starts: the next address at [`SLOT_PAGE_OFFSET`]
/// into a page (less than 4096).
fn slot_start(addr: usize) -> usize {
    (SLOT_PAGE_OFFSET + 4096 - addr % 4096) % 4096
}
/// Control buffer per datagram: room for one cmsg carrying an `int`, aligned for cmsghdr.
type Ctrl = [u64; 4];
/// The receive timeout (`SO_RCVTIMEO`) of a device socket: the longest a thread sleeps in
/// [`RxRing::receive_blocking`] (every other receive on the socket is non-blocking). A sleeper
/// in the receive call sees only datagrams, not the completion channel, so a completion
/// another thread queues meanwhile (rare: the progress thread's timers, a QP's flush) waits
/// at most this long; the sleeper then goes on sleeping in `poll`, where it sees both.
pub(crate) const BLOCK: std::time::Duration = std::time::Duration::from_millis(1);

/// Set the socket's receive timeout to [`BLOCK`]; whether it took it.
pub(crate) fn set_block_timeout(sock: BorrowedFd<'_>) -> bool {
    rustix::net::sockopt::set_socket_timeout(sock, rustix::net::sockopt::Timeout::Recv, Some(BLOCK))
        .is_ok()
}

/// Turn `UDP_GRO` on or off; whether the socket took it.
pub(crate) fn set_gro(sock: BorrowedFd<'_>, on: bool) -> bool {
    let v: libc::c_int = on.into();
    // SAFETY: a plain setsockopt with a pointer to a live c_int and its size.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_UDP,
            UDP_GRO,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    rc == 0
}

/// The packets in a received datagram: `seg`-byte pieces of a coalesced one (the last may be
/// shorter), else the datagram itself (also when empty: the checks count it).
pub(crate) fn packets(data: &[u8], seg: Option<usize>) -> impl Iterator<Item = &[u8]> {
    let size = match seg {
        Some(s) if s > 0 && s < data.len() => s,
        _ => data.len().max(1),
    };
    let empty = data.is_empty().then_some(data);
    data.chunks(size).chain(empty)
}

/// The sender's address the kernel wrote: a `sockaddr_in6` on an IPv6 socket, else (an IPv4
/// socket) a `sockaddr_in` at the start of the same storage.
fn sender(a: &libc::sockaddr_in6) -> SocketAddr {
    if i32::from(a.sin6_family) == libc::AF_INET6 {
        return SocketAddr::new(
            Ipv6Addr::from(a.sin6_addr.s6_addr).into(),
            u16::from_be(a.sin6_port),
        );
    }
    // SAFETY: a sockaddr_in is smaller than the sockaddr_in6 it lies in and has no stricter
    // alignment; both are plain old data.
    let v4 = unsafe { &*(a as *const libc::sockaddr_in6).cast::<libc::sockaddr_in>() };
    SocketAddr::new(
        Ipv4Addr::from(u32::from_be(v4.sin_addr.s_addr)).into(),
        u16::from_be(v4.sin_port),
    )
}

/// Buffers for one `recvmmsg` of up to [`BATCH`] datagrams.
pub(crate) struct RxRing {
    /// The slots, from `start` on (`SLOT_PAGE_OFFSET`).
    bufs: Vec<u8>,
    /// Where slot 0 starts in `bufs`.
    start: usize,
    /// Senders' addresses: room for an IPv6 one (an IPv4 socket writes a `sockaddr_in`).
    addrs: Vec<libc::sockaddr_in6>,
    iovs: Vec<libc::iovec>,
    ctrls: Vec<Ctrl>,
    hdrs: Vec<libc::mmsghdr>,
}

// SAFETY: the raw pointers inside point into the ring's own vectors, used by one thread at a
// time (under the device's receive lock).
unsafe impl Send for RxRing {}

impl RxRing {
    pub(crate) fn new() -> RxRing {
        // SAFETY: sockaddr_in6, iovec and mmsghdr are plain old data; all-zero is valid.
        let zero_addr: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
        let bufs = vec![0u8; BATCH * RX_BUF + 4096];
        let start = slot_start(bufs.as_ptr() as usize);
        RxRing {
            bufs,
            start,
            addrs: vec![zero_addr; BATCH],
            iovs: Vec::with_capacity(BATCH),
            ctrls: vec![[0u64; 4]; BATCH],
            // SAFETY: as above.
            hdrs: (0..BATCH).map(|_| unsafe { std::mem::zeroed() }).collect(),
        }
    }

    /// Receive up to [`BATCH`] datagrams without blocking; returns how many.
    pub(crate) fn receive(&mut self, sock: &OwnedFd) -> usize {
        self.receive_with(sock, libc::MSG_DONTWAIT)
    }

    /// Sleep in the receive call until a datagram arrives or the socket's `SO_RCVTIMEO`
    /// ([`BLOCK`]) passes, then take up to [`BATCH`] of what waits without sleeping again
    /// (`MSG_WAITFORONE`); returns how many (0: nothing came, or a signal interrupted).
    pub(crate) fn receive_blocking(&mut self, sock: &OwnedFd) -> usize {
        self.receive_with(sock, libc::MSG_WAITFORONE)
    }

    fn receive_with(&mut self, sock: &OwnedFd, flags: libc::c_int) -> usize {
        // SAFETY: `start` < 4096 and `bufs` has 4096 bytes beyond the BATCH slots.
        let base = unsafe { self.bufs.as_mut_ptr().add(self.start) };
        self.iovs.clear();
        for i in 0..BATCH {
            self.iovs.push(libc::iovec {
                // SAFETY: slot i lies inside `bufs` (`start` + BATCH * RX_BUF bytes).
                iov_base: unsafe { base.add(i * RX_BUF) }.cast(),
                iov_len: RX_BUF,
            });
        }
        for i in 0..BATCH {
            let h = &mut self.hdrs[i].msg_hdr;
            h.msg_name = (&mut self.addrs[i] as *mut libc::sockaddr_in6).cast();
            h.msg_namelen = std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t;
            h.msg_iov = &mut self.iovs[i];
            h.msg_iovlen = 1;
            h.msg_control = self.ctrls[i].as_mut_ptr().cast();
            h.msg_controllen = std::mem::size_of::<Ctrl>() as _;
            h.msg_flags = 0;
            self.hdrs[i].msg_len = 0;
        }
        // SAFETY: every header points at a live iovec, buffer slot, control buffer and address
        // of this ring, which outlive the call; the kernel writes at most the lengths given.
        let n = unsafe {
            libc::recvmmsg(
                sock.as_raw_fd(),
                self.hdrs.as_mut_ptr(),
                BATCH as libc::c_uint,
                flags,
                std::ptr::null_mut(),
            )
        };
        usize::try_from(n).unwrap_or(0).min(BATCH)
    }

    /// Sender, bytes and (for a coalesced datagram) segment size of datagram `i` of the last
    /// `receive`.
    pub(crate) fn datagram(&self, i: usize) -> (SocketAddr, &[u8], Option<usize>) {
        let from = sender(&self.addrs[i]);
        let len = (self.hdrs[i].msg_len as usize).min(RX_BUF);
        (
            from,
            &self.bufs[self.start + i * RX_BUF..self.start + i * RX_BUF + len],
            self.segment_size(i),
        )
    }

    /// The `UDP_GRO` segment size the kernel reported for datagram `i`, if any.
    fn segment_size(&self, i: usize) -> Option<usize> {
        let h = &self.hdrs[i].msg_hdr;
        if h.msg_controllen == 0 {
            return None;
        }
        // SAFETY: the kernel filled `msg_control` (our `ctrls[i]`) with `msg_controllen` bytes
        // of well-formed cmsgs; the CMSG macros stay inside that length, and the data of a
        // UDP_GRO cmsg is one int (read unaligned).
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(h);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_UDP
                    && (*c).cmsg_type == UDP_GRO
                    && (*c).cmsg_len as usize
                        >= libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as usize
                {
                    let v = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::c_int>());
                    return usize::try_from(v).ok().filter(|s| *s > 0);
                }
                c = libc::CMSG_NXTHDR(h, c);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every slot starts half-way into a page, whatever address the allocator gives.
    #[test]
    fn slots_start_half_way_into_a_page() {
        for addr in (0..3 * 4096).step_by(8) {
            let start = slot_start(addr);
            assert!(start < 4096, "address {addr}");
            assert_eq!((addr + start) % 4096, SLOT_PAGE_OFFSET, "address {addr}");
        }
        let r = RxRing::new();
        let slot0 = r.bufs.as_ptr() as usize + r.start;
        assert_eq!(slot0 % 4096, SLOT_PAGE_OFFSET);
        assert!(r.start + BATCH * RX_BUF <= r.bufs.len());
        assert_eq!(RX_BUF % 4096, 0, "every slot at the same page offset");
    }

    #[test]
    fn coalesced_datagrams_are_cut_into_packets() {
        let d: Vec<u8> = (0..250u8).collect();
        let p: Vec<&[u8]> = packets(&d, Some(100)).collect();
        assert_eq!(p.len(), 3);
        assert_eq!(p[0], &d[..100]);
        assert_eq!(p[2], &d[200..]);
        // Not coalesced, or a size that does not cut: the datagram as it is.
        assert_eq!(packets(&d, None).count(), 1);
        assert_eq!(packets(&d, Some(250)).count(), 1);
        assert_eq!(packets(&d, Some(0)).count(), 1);
        // An empty datagram is still handed on once (the checks count it as malformed).
        assert_eq!(packets(&[], None).collect::<Vec<_>>(), [&[] as &[u8]]);
        assert_eq!(packets(&[], Some(10)).count(), 1);
    }
}
