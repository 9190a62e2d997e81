//! The stack's side of the one-copy send and of the posts it defers.

use super::*;
use smc_proto::endpoint::WritePiece;

/// The stack's side of the one-copy send ([`Core::send_direct`]): each RDMA WRITE is posted
/// straight from the application's slice (shm: placed in the peer's RMB at once), or, where
/// the fabric keeps a WRITE's bytes until acknowledged (roce), from the piece's shared buffer,
/// which the engine keeps for replay too: one copy per byte either way. The CDC that
/// announces them is posted as soon as the engine built it (see
/// [`smc_proto::endpoint::SendPath`]).
pub(super) struct DirectSend<'a> {
    pub(super) fab: &'a Fabric,
    pub(super) failed_posts: &'a mut Vec<(WrId, LinkId, Instant)>,
    pub(super) deferred: &'a mut HashMap<LinkId, std::collections::VecDeque<Deferred>>,
    /// A capture records every SEND: those go through the fabric queue (`Core::fabric_op`).
    pub(super) capturing: bool,
    /// Links with WRITEs posted held (`post_send_held`) and no CDC posted after them yet:
    /// their doorbell rings when this path is dropped, so nothing waits for the device's
    /// progress tick.
    pub(super) held: Vec<LinkId>,
}

impl Drop for DirectSend<'_> {
    fn drop(&mut self) {
        // WRITEs whose CDC the engine holds back (coalescing, TCP_CORK) or posts later: a
        // short last run of their packets may wait for the next write's packets to fill its
        // datagram (smc-fabric `doorbell_runs`); the CDC, when posted, takes it along.
        for link in self.held.drain(..) {
            if let Some(l) = self.fab.links.get(&link) {
                l.qp.doorbell_runs();
            }
        }
    }
}

/// Whether work already waits in software for room in `link`'s send queue (the map's
/// emptiness first: no hashing in the usual case); what is posted next queues behind it.
pub(super) fn waits_for_room(
    deferred: &HashMap<LinkId, std::collections::VecDeque<Deferred>>,
    link: LinkId,
) -> bool {
    !deferred.is_empty() && deferred.get(&link).is_some_and(|q| !q.is_empty())
}

impl smc_proto::endpoint::SendPath for DirectSend<'_> {
    fn write(
        &mut self,
        t: smc_proto::endpoint::RdmaWriteTarget,
        piece: &mut WritePiece<'_>,
    ) -> WriteOutcome {
        let Some(l) = self.fab.links.get(&t.link) else {
            self.failed_posts.push((t.wr, t.link, Instant::now()));
            return WriteOutcome::Failed;
        };
        let defer = |deferred: &mut HashMap<LinkId, std::collections::VecDeque<Deferred>>,
                     piece: &mut WritePiece<'_>| {
            deferred
                .entry(t.link)
                .or_default()
                .push_back(Deferred::Write {
                    wr: t.wr,
                    rkey: t.rkey,
                    addr: t.addr,
                    // The engine keeps the same buffer for replay.
                    data: piece.shared().clone(),
                    signaled: false,
                });
            // Queued in software: the engine keeps the bytes until the CDC after them
            // completes.
            WriteOutcome::Posted
        };
        if waits_for_room(self.deferred, t.link) {
            // Behind work already waiting for room: keep the order.
            return defer(self.deferred, piece);
        }
        // A WRITE shorter than the CDC SEND behind it would leave in a datagram of its own on
        // the roce backend: widened into the free space after it (bytes no CDC announces,
        // `RdmaWriteTarget::room`), it shares the CDC's. (Copied into its packet: at most
        // 24 bytes, and the engine keeps its own copy of them.)
        let mut wide = [0u8; WIDEN_MAX];
        let want = l.qp.shortest_shared_write(CDC_LEN);
        let bytes = piece.bytes();
        let data = widened(bytes, t.room, want, &mut wide);
        // Held: the WRITE leaves with the CDC SEND posted next (one system call on the roce
        // backend, and one acknowledgement for both), or when this path is dropped. Only a
        // failure is of interest (see `Endpoint::send_with`): unsignaled, no completion to
        // queue and process per WRITE.
        let posted = if data.len() == bytes.len() && bytes.len() >= l.qp.packs_writes_from() {
            // roce, a WRITE of several packets: the bytes copied once, straight into the
            // WRITE's packets (built end to end and sealed at post, smc-fabric
            // `post_write_packed_held`); the engine keeps the packets' buffer for replay, not
            // a copy.
            match l.qp.post_write_packed_held(t.wr.0, bytes, t.addr, t.rkey) {
                Ok(Some(p)) => {
                    let kept = piece.keep(smc_proto::endpoint::Strided {
                        buf: p.buf,
                        first: p.first,
                        stride: p.stride,
                        piece: p.piece,
                        len: p.len,
                    });
                    // Refused, the engine would copy the bytes again for replay.
                    debug_assert!(kept, "a packed WRITE's buffer the engine cannot keep");
                    Ok(PostStatus::Queued)
                }
                // The QP is in error: the request completes flushed (the engine copies the
                // bytes for replay, as for any WRITE whose bytes it was not given).
                Ok(None) => Ok(PostStatus::Queued),
                Err(e) => Err(e),
            }
        } else if data.len() == bytes.len() && l.qp.keeps_write_bytes() {
            // roce, a WRITE of one packet: its packet keeps a slice of the piece's shared
            // buffer (the engine's replay keeps the same buffer), cut from the connection's
            // arena without an allocation of its own.
            l.qp.post_send_held(&SendWr::WriteShared {
                wr_id: t.wr.0,
                data: piece.shared(),
                remote_addr: t.addr,
                rkey: t.rkey,
                signaled: false,
            })
        } else {
            l.qp.post_send_held(&SendWr::WriteInline {
                wr_id: t.wr.0,
                data,
                remote_addr: t.addr,
                rkey: t.rkey,
                signaled: false,
            })
        };
        match posted {
            Ok(PostStatus::Executed) => WriteOutcome::Placed,
            Ok(PostStatus::Queued) => {
                if !self.held.contains(&t.link) {
                    self.held.push(t.link);
                }
                WriteOutcome::Posted
            }
            Err(smc_fabric::FabricError::QueueFull) => defer(self.deferred, piece),
            Err(_) => {
                self.failed_posts.push((t.wr, t.link, Instant::now()));
                WriteOutcome::Failed
            }
        }
    }

    fn post_cdc(&mut self, link: LinkId, wr: WrId, msg: &[u8; 44]) -> bool {
        if self.capturing || waits_for_room(self.deferred, link) {
            return false;
        }
        let Some(l) = self.fab.links.get(&link) else {
            return false;
        };
        // Anything but a plain success (a full queue, a failure) is left to the fabric
        // queue, whose handling (`Core::post_or_defer`) defers or fails it.
        let ok = Deferred::Send {
            wr,
            msg: (*msg).into(),
        }
        .post(&l.qp)
        .is_ok();
        if ok {
            // This post rang the doorbell for the WRITEs held before it.
            self.held.retain(|h| *h != link);
        }
        ok
    }
}

/// Bytes of a CDC message (the SEND behind an update's WRITEs).
const CDC_LEN: usize = 44;
/// Longest a short WRITE is widened to (more than any backend asks for: 25 bytes on roce).
const WIDEN_MAX: usize = 64;

/// `piece`, or — when it is shorter than `want` bytes and `room` bytes of free space follow
/// its target — `piece` followed by zeros up to `want` bytes in `buf`.
fn widened<'b>(piece: &'b [u8], room: u32, want: usize, buf: &'b mut [u8; WIDEN_MAX]) -> &'b [u8] {
    if piece.len() >= want || want > WIDEN_MAX || (room as usize) < want {
        return piece;
    }
    buf[..piece.len()].copy_from_slice(piece);
    &buf[..want]
}

/// The send path of a write whose bytes were placed into the peer's RMBE beforehand, outside
/// the core lock (see [`Core::send_preplaced`]): a WRITE whose target and length are those of
/// a placed piece of the plan is reported placed without a copy; any other (the route
/// changed meanwhile, a piece that was not placed) goes the direct way.
pub(super) struct PrePlaced<'a> {
    pub(super) direct: DirectSend<'a>,
    pub(super) plan: smc_proto::endpoint::WritePlan,
    /// Which pieces of `plan` are in place.
    pub(super) placed: [bool; 2],
}

impl smc_proto::endpoint::SendPath for PrePlaced<'_> {
    fn write(
        &mut self,
        t: smc_proto::endpoint::RdmaWriteTarget,
        piece: &mut WritePiece<'_>,
    ) -> WriteOutcome {
        let len = u32::try_from(piece.bytes().len()).unwrap_or(u32::MAX);
        for (placed, &(addr, plen)) in self.placed.iter_mut().zip(&self.plan.pieces) {
            if *placed
                && t.link == self.plan.link
                && t.rkey == self.plan.rkey
                && t.addr == addr
                && len == plen
            {
                *placed = false;
                return WriteOutcome::Placed;
            }
        }
        self.direct.write(t, piece)
    }

    fn post_cdc(&mut self, link: LinkId, wr: WrId, msg: &[u8; 44]) -> bool {
        self.direct.post_cdc(link, wr, msg)
    }
}

/// A work request waiting for room in its link's send queue.
#[derive(Debug)]
pub(super) enum Deferred {
    /// An LLC or CDC message (44 bytes inline, an LLC v2 message up to 8192).
    Send { wr: WrId, msg: SendMsg },
    /// An RDMA WRITE of application bytes (not the application's slice, which is gone: the
    /// shared buffer the engine keeps for replay, or the fabric queue's copy).
    Write {
        wr: WrId,
        rkey: u32,
        addr: u64,
        data: bytes::Bytes,
        /// Whether a success completes too (the direct send path wants only failures).
        signaled: bool,
    },
}

impl Deferred {
    pub(super) fn wr(&self) -> WrId {
        match self {
            Deferred::Send { wr, .. } | Deferred::Write { wr, .. } => *wr,
        }
    }

    pub(super) fn post(&self, qp: &smc_fabric::QueuePair) -> smc_fabric::Result<()> {
        match self {
            Deferred::Send { wr, msg } => qp.post_send(&SendWr::Send {
                wr_id: wr.0,
                data: msg,
                signaled: true,
            }),
            Deferred::Write {
                wr,
                rkey,
                addr,
                data,
                signaled,
            } => qp.post_send(&SendWr::WriteShared {
                wr_id: wr.0,
                data,
                remote_addr: *addr,
                rkey: *rkey,
                signaled: *signaled,
            }),
        }
    }
}

/// Send a RST instead of a FIN when the socket closes (when the stream, which shares the
/// descriptor, has gone too); the slot lets go of the socket and stops watching it.
/// Whether the TCP socket `fd` has received the peer's FIN (a read would return end of
/// stream), or receives it before `until`. An SMC-R connection's TCP connection carries
/// nothing once SMC-R runs, so this is the peer's kernel closing the socket: its process
/// closed it or ended.
pub(super) fn fin_within(fd: rustix::fd::BorrowedFd<'_>, until: Instant) -> bool {
    loop {
        let mut b = [0u8; 1];
        match rustix::net::recv(
            fd,
            &mut b,
            rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT,
        ) {
            Ok((0, _)) => return true,
            Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => {}
            // Bytes (the peer wrote past its stack) or an error (its RST): no FIN.
            _ => return false,
        }
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        let mut fds = [rustix::event::PollFd::new(
            &fd,
            rustix::event::PollFlags::IN | rustix::event::PollFlags::RDHUP,
        )];
        let ts = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: i64::from(left.subsec_nanos()),
        };
        let _ = rustix::event::poll(&mut fds, Some(&ts));
    }
}

pub(super) fn reset_socket(sock: Option<crate::tcpwatch::SlotSock>) {
    if let Some(s) = sock {
        let _ = rustix::net::sockopt::set_socket_linger(s.tcp(), Some(Duration::ZERO));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A short WRITE is widened with zeros to the length asked for when the free space after
    /// its target allows; otherwise, or when it is long enough already, it stays as it is.
    #[test]
    fn short_writes_widen_into_room_only() {
        let mut buf = [0u8; WIDEN_MAX];
        let w = widened(&[7], 100, 28, &mut buf);
        assert_eq!(w.len(), 28);
        assert_eq!(w[0], 7);
        assert!(w[1..].iter().all(|b| *b == 0));
        let mut buf = [0u8; WIDEN_MAX];
        assert_eq!(widened(&[7], 27, 28, &mut buf), &[7], "no room");
        assert_eq!(
            widened(&[7; 30], 100, 28, &mut buf),
            &[7; 30],
            "long enough"
        );
        assert_eq!(widened(&[7], 100, 0, &mut buf), &[7], "shm: nothing asked");
        assert_eq!(
            widened(&[7], 1000, 65, &mut buf),
            &[7],
            "more than the buffer"
        );
        assert_eq!(widened(&[7; 28], 28, 28, &mut buf).len(), 28);
    }
}
