//! The data path of established connections over a link group, and failover (RFC 7609 §4.5,
//! §4.6).

use smc_wire::{CdcMessage, ConnStateFlags, Cursor, ProducerFlags};

use super::{
    Endpoint, EndpointError, EndpointEvent, Entry, RdmaWriteTarget, ReadTarget, SendPath, TcpId,
    WrId, WrPurpose, WriteOutcome,
};
use crate::conn::{ApiError, Coalescing, Connection, Event};
use crate::fabric::{FabricOp, LgrId, LinkId};
use crate::rmbe::RmbeRing;
use crate::time::Timestamp;

impl Endpoint {
    /// A CDC message arrived: route it by alert token.
    pub(super) fn handle_cdc(&mut self, lgr: LgrId, cdc: CdcMessage, now: Timestamp) {
        let Some(&tcp) = self.alerts.get(&cdc.alert_token) else {
            return;
        };
        // The alert token must name a connection of the group the CDC arrived on.
        if !self.lgrs.get(&lgr).is_some_and(|g| g.conns.contains(&tcp)) {
            return;
        }
        match self.entries.get_mut(&tcp) {
            Some(Entry::Smc(c)) => {
                c.conn.handle_cdc(cdc, now);
                self.after_conn(tcp, now);
            }
            Some(Entry::Setup(_)) => {
                //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.2.4
                //# On a subsequent contact TCP/IP connection, a peer may send data as soon
                //# as it has received the peer RMB information for the connection.
                let _ = self.hold_early_cdc(tcp, cdc);
            }
            None => {}
        }
    }

    /// After any input to a connection engine: post its CDCs, forward its events, release
    /// it once Closed.
    pub(super) fn after_conn(&mut self, tcp: TcpId, now: Timestamp) {
        self.after_conn_with(tcp, now, |_, _, _| false, false);
    }

    /// [`after_conn`](Self::after_conn), offering each CDC to `post` first (see
    /// [`SendPath::post_cdc`]): what it posts does not go through the fabric queue. `settle`:
    /// the engine's [`settle_send`](Connection::settle_send) is due once the CDCs are out.
    fn after_conn_with(
        &mut self,
        tcp: TcpId,
        now: Timestamp,
        mut post: impl FnMut(LinkId, WrId, &[u8; 44]) -> bool,
        settle: bool,
    ) {
        // Fields borrowed apart: the connection's CDCs and events go straight to the output
        // queues (no vectors allocated per message on the data path).
        let Endpoint {
            entries,
            lgrs,
            wrs,
            next_wr,
            fabric_out,
            events,
            ..
        } = self;
        let Some(Entry::Smc(c)) = entries.get_mut(&tcp) else {
            return;
        };
        while let Some(m) = c.conn.poll_transmit() {
            c.last_posted = Some(m.seqno);
            let Some(link) = lgrs
                .get_mut(&c.lgr)
                .and_then(|g| g.links.get_mut(&c.send_link))
            else {
                continue;
            };
            link.last_activity = now;
            let wr = WrId(*next_wr);
            *next_wr += 1;
            let msg = m.to_bytes();
            // Behind queued operations it queues too (their order on the link is kept).
            if !(fabric_out.is_empty() && post(link.id, wr, &msg)) {
                fabric_out.push_back(FabricOp::PostSend {
                    link: link.id,
                    wr,
                    msg: msg.into(),
                });
            }
            // (Recorded after the post: its completion is handled later, by a call of ours.)
            wrs.insert(
                wr,
                WrPurpose::Cdc {
                    tcp,
                    link: link.id,
                    seq: m.seqno,
                    prod: m.producer,
                },
            );
        }
        if settle {
            c.conn.settle_send(now);
        }
        trim_unacked(c);
        let mut closed = false;
        while let Some(e) = c.conn.poll_event() {
            closed |= e == Event::Closed;
            if let (Event::Failed(_), Some(regions)) = (e, c.conn.unread_at_reset()) {
                events.push_back(EndpointEvent::UnreadAtReset {
                    tcp,
                    target: ReadTarget {
                        lgr: c.lgr,
                        rmb: c.local.rmb,
                        element_offset: c.local_element_offset,
                        regions,
                    },
                });
            }
            events.push_back(EndpointEvent::Conn { tcp, event: e });
        }
        if closed {
            // A connection that closed in order waits for its last CDC (which carries, or
            // follows, our PeerConnectionClosed) to complete: until then a failover must be
            // able to send it again. A failed connection has nothing left to tell the peer.
            let hold = match self.entries.get_mut(&tcp) {
                Some(Entry::Smc(c)) => {
                    let hold = c.conn.error().is_none() && c.last_posted.is_some_and(|s| s != c.ss);
                    c.held = hold;
                    hold
                }
                _ => false,
            };
            if hold {
                self.stats.closes_held += 1;
            } else {
                self.release_conn(tcp, now);
            }
        }
    }

    /// The link group of connection `tcp` is gone (or no surviving link can reach the peer's
    /// RMB): the connection is reset, or, if it had closed already and was only held for its
    /// closing CDC, released.
    pub(super) fn conn_link_group_lost(&mut self, tcp: TcpId, now: Timestamp) {
        match self.entries.get_mut(&tcp) {
            Some(Entry::Smc(c)) if c.held => self.release_conn(tcp, now),
            Some(Entry::Smc(c)) => {
                let peer_read_all = c.conn.peer_consumer_cursor() == c.conn.producer_cursor();
                self.events
                    .push_back(EndpointEvent::LinkGroupLost { tcp, peer_read_all });
                c.conn.handle_link_group_lost(now);
                self.after_conn(tcp, now);
            }
            _ => {}
        }
    }

    /// The connection reached Closed: its RMBE returns to the pool (§4.4.2).
    fn release_conn(&mut self, tcp: TcpId, now: Timestamp) {
        let Some(Entry::Smc(c)) = self.entries.remove(&tcp) else {
            return;
        };
        self.alerts.remove(&c.local_alert);
        tracing::debug!(
            ?tcp,
            lgr = ?c.lgr,
            local = ?c.local,
            peer = ?c.peer_key,
            error = ?c.conn.error(),
            "connection released, RMBE back to the pool"
        );
        if let Some(g) = self.lgrs.get_mut(&c.lgr) {
            let _ = g.pool.release(c.local);
            g.peer_rmbes.release(c.peer_key, tcp);
            g.conns.remove(&tcp);
            g.remove_sender(c.send_link);
        }
        self.maybe_idle(c.lgr, now);
    }

    /// A CDC's SEND completed: SS moves to its sequence number (§4.6.1) and the bytes it
    /// describes need no replay any more.
    pub(super) fn cdc_completed(
        &mut self,
        tcp: TcpId,
        link: crate::fabric::LinkId,
        seq: u16,
        prod: Cursor,
        now: Timestamp,
    ) {
        let links = &self.links;
        let Some(Entry::Smc(c)) = self.entries.get_mut(&tcp) else {
            return;
        };
        if links.get(&link).map(|(_, n)| *n) != Some(c.send_link) {
            return;
        }
        //= https://www.rfc-editor.org/rfc/rfc7609#section-4.6.1
        //# The sender must keep track of the sequence number of the CDC message that described
        //# the last write acknowledged by the peer RNIC, or Sequence Sent (SS).
        c.ss = seq;
        drop_unacked_to(c, prod);
        if c.held && c.last_posted == Some(seq) {
            self.release_conn(tcp, now);
        }
    }

    // ----- Application commands ------------------------------------------------------------

    /// Send application bytes: as many as fit in the peer's RMBE now are RDMA-written (see
    /// [`FabricOp::RdmaWrite`]) and announced by a CDC. Returns how many were taken.
    pub fn send(
        &mut self,
        tcp: TcpId,
        data: &[u8],
        now: Timestamp,
    ) -> Result<usize, EndpointError> {
        let Some(Entry::Smc(c)) = self.entries.get_mut(&tcp) else {
            return Err(self.not_established(tcp));
        };
        let regions = c.conn.write_regions();
        let n = regions
            .total()
            .min(u32::try_from(data.len()).unwrap_or(u32::MAX));
        if n == 0 {
            c.conn.set_send_backlog(data.len() as u64, now);
            self.after_conn(tcp, now);
            return Ok(0);
        }
        let Some(super::SendRoute { link, rkey, base }) = send_route(&self.lgrs, c) else {
            return Err(EndpointError::NotEstablished);
        };
        let mut off = 0usize;
        let mut writes = Vec::new();
        for r in regions.truncate(n).iter() {
            let len = r.len as usize;
            let chunk = data[off..off + len].to_vec();
            writes.push((base + u64::from(r.offset), chunk));
            off += len;
        }
        c.conn.produced(n, now)?;
        // The fabric queue's WRITEs copy their bytes (`FabricOp::RdmaWrite`): a copy of
        // its own for replay.
        c.unacked
            .push(bytes::Bytes::copy_from_slice(&data[..n as usize]));
        c.conn
            .set_send_backlog((data.len() - n as usize) as u64, now);
        self.post_writes(tcp, link, rkey, writes);
        self.after_conn(tcp, now);
        Ok(n as usize)
    }

    /// Send application bytes with one copy: the caller's `write` posts each RDMA WRITE of
    /// `data`'s pieces straight from the slice, unsignaled, and says what the fabric did with
    /// it ([`WriteOutcome`]). Only a WRITE that [`failed`](WriteOutcome::Failed) keeps its
    /// work-request id: report it to [`handle_completion`](Self::handle_completion) as failed
    /// (a WRITE only posted that fails later fails its QP, whose flushed receives report the
    /// link's failure). Taken bytes are produced and announced
    /// by a CDC; the first WRITE that [`failed`](WriteOutcome::Failed) ends the send (its
    /// bytes and the rest are not taken). Returns how many bytes were taken.
    ///
    /// Bytes [`placed`](WriteOutcome::Placed) need no replay copy: they are in the peer's
    /// RMBE before the CDC that announces them is posted, so after a failover only a CDC is
    /// sent again (the fresh CDC of the failover re-announces the producer cursor). Bytes
    /// only [`posted`](WriteOutcome::Posted) are kept for replay until known received, as
    /// with [`send`](Self::send).
    pub fn send_with(
        &mut self,
        tcp: TcpId,
        data: &[u8],
        now: Timestamp,
        path: impl SendPath,
    ) -> Result<usize, EndpointError> {
        self.send_inner(tcp, data, false, now, path)
    }

    /// Where a [`send_with`](Self::send_with) of up to `max` bytes on connection `tcp` would
    /// write them now, changing nothing: a runtime can copy them into the peer's RMBE
    /// beforehand, outside its own lock, and then, in `send_with` of exactly that many bytes,
    /// report the WRITEs whose target and length match as placed. The free space between our
    /// producer cursor and the peer's consumer cursor is ours to write (the peer reads only
    /// what a CDC announces), and a `send_with` with the same producer cursor and at most the
    /// window planned here cuts the same pieces. `None`: nothing to write now (no window, not
    /// established, no route).
    pub fn write_plan(&self, tcp: TcpId, max: u32) -> Option<super::WritePlan> {
        let Some(Entry::Smc(c)) = self.entries.get(&tcp) else {
            return None;
        };
        let regions = c.conn.write_regions();
        let n = regions.total().min(max);
        if n == 0 {
            return None;
        }
        let super::SendRoute { link, rkey, base } = send_route(&self.lgrs, c)?;
        let mut pieces = [(0u64, 0u32); 2];
        for (slot, r) in pieces.iter_mut().zip(regions.truncate(n).iter()) {
            *slot = (base + u64::from(r.offset), r.len);
        }
        Some(super::WritePlan { link, rkey, pieces })
    }

    /// [`send_with`](Self::send_with) for urgent data (MSG_OOB): the last byte of `data` is
    /// the urgent byte. All of `data` is written at once or nothing is: when it does not fit
    /// in the peer's RMBE now, the peer is told that urgent data is pending (the P flag) and
    /// 0 is returned; try again when writable.
    //= https://www.rfc-editor.org/rfc/rfc7609#section-4.7.5
    //# the producer cursor points 1 byte beyond the last byte of urgent data
    pub fn send_urgent_with(
        &mut self,
        tcp: TcpId,
        data: &[u8],
        now: Timestamp,
        path: impl SendPath,
    ) -> Result<usize, EndpointError> {
        let Some(Entry::Smc(c)) = self.entries.get_mut(&tcp) else {
            return Err(self.not_established(tcp));
        };
        if data.is_empty() {
            return Err(crate::conn::ApiError::EmptyUrgent.into());
        }
        if (c.conn.write_room() as usize) < data.len() {
            c.conn.urgent_pending(now)?;
            self.after_conn(tcp, now);
            return Ok(0);
        }
        self.send_inner(tcp, data, true, now, path)
    }

    fn send_inner(
        &mut self,
        tcp: TcpId,
        data: &[u8],
        urgent: bool,
        now: Timestamp,
        mut path: impl SendPath,
    ) -> Result<usize, EndpointError> {
        let Some(Entry::Smc(c)) = self.entries.get_mut(&tcp) else {
            return Err(self.not_established(tcp));
        };
        let regions = c.conn.write_regions();
        let n = regions
            .total()
            .min(u32::try_from(data.len()).unwrap_or(u32::MAX));
        if n == 0 {
            // Nothing will ever fit (the peer closed, or this side shut writing down): the
            // write fails. Recording it as waiting data would make it "pending data" when
            // the peer has closed, which resets the connection (§4.8.1) and takes the bytes
            // the peer sent before its close with it.
            if c.conn.write_ended() {
                c.conn.check_write()?;
                return Err(EndpointError::Conn(crate::conn::ApiError::InvalidState(
                    c.conn.state(),
                )));
            }
            c.conn.set_send_backlog(data.len() as u64, now);
            self.after_conn(tcp, now);
            return Ok(0);
        }
        let Some(super::SendRoute { link, rkey, base }) = send_route(&self.lgrs, c) else {
            return Err(EndpointError::NotEstablished);
        };
        let keep_all = !c.unacked.is_empty();
        // At most two pieces (the free space may wrap around the end of the RMBE).
        let mut pieces = [(0u64, 0u32); 2];
        // The free space of each piece's region, untruncated (see `RdmaWriteTarget::room`):
        // up to the peer's consumer cursor, and the peer reads only up to our producer cursor.
        //= https://www.rfc-editor.org/rfc/rfc7609#section-2.1
        //# The local peer cannot write into the remote peer's RMBE beyond
        //# this point without causing data loss.
        //= https://www.rfc-editor.org/rfc/rfc7609#section-2.1
        //# tells the local peer how
        //# far it can consume data in the RMBE buffer.
        let mut rooms = [0u32; 2];
        let mut count = 0;
        for ((slot, room), (r, whole)) in pieces
            .iter_mut()
            .zip(rooms.iter_mut())
            .zip(regions.truncate(n).iter().zip(regions.iter()))
        {
            *slot = (base + u64::from(r.offset), r.len);
            *room = whole.len;
            count += 1;
        }
        let mut done = 0u32;
        // Offset in `data` of the first byte that must be kept for replay.
        let mut keep_from: Option<u32> = keep_all.then_some(0);
        // Each piece's shared buffer, where the path posted one (the replay keeps it).
        let mut shared: [Option<super::replay::Kept>; 2] = [None, None];
        // The arena is the connection's; taken out while `self` posts (put back below).
        let mut arena = std::mem::take(&mut c.arena);
        for ((&(addr, len), &room), kept) in pieces[..count].iter().zip(&rooms).zip(&mut shared) {
            let Some(piece) = data.get(done as usize..(done + len) as usize) else {
                break;
            };
            // The outcome is known at once: only a failed write's purpose is recorded, for
            // the failure its work request reports later (a map insert and removal saved per
            // write otherwise).
            let wr = self.fresh_wr();
            let target = RdmaWriteTarget {
                link,
                wr,
                rkey,
                addr,
                room,
            };
            let mut wp = super::WritePiece::new(piece, &mut arena);
            let outcome = path.write(target, &mut wp);
            *kept = wp.take_kept();
            match outcome {
                WriteOutcome::Placed => {}
                WriteOutcome::Posted => {
                    keep_from.get_or_insert(done);
                }
                WriteOutcome::Failed => {
                    self.wrs.insert(wr, WrPurpose::Write { tcp, link });
                    break;
                }
            }
            done += len;
        }
        let Some(Entry::Smc(c)) = self.entries.get_mut(&tcp) else {
            return Err(EndpointError::NotEstablished);
        };
        c.arena = arena;
        if c.arena.holds_memory() {
            // Its trim is checked ARENA_IDLE after the first write, then after the last.
            c.arena_used = now;
            c.arena_idle_until
                .get_or_insert(now + super::replay::ARENA_IDLE);
        }
        if done == 0 {
            // The link refused the WRITE (its failure is on its way): nothing was taken.
            return Ok(0);
        }
        let before = c.conn.producer_cursor();
        let backlog = (data.len() - done as usize) as u64;
        let settle = if urgent && done as usize == data.len() {
            c.conn.produced_urgent(done, now)?;
            c.conn.set_send_backlog(backlog, now);
            false
        } else {
            // The timers after the CDC (the engine says when that changes nothing else).
            c.conn.produced_settle_later(done, backlog, now)?
        };
        match keep_from {
            // Nothing awaits replay: the replay window starts after these bytes.
            None => c.unacked_from = c.conn.producer_cursor(),
            Some(k) => {
                if c.unacked.is_empty() {
                    if let Ok(ring) =
                        RmbeRing::new(c.conn.config().layout, c.conn.config().peer_rmbe_len)
                    {
                        c.unacked_from = ring.advance(before, k);
                    }
                }
                // Each piece from `k` on: its shared buffer (no copy), else a copy.
                let mut at = 0u32;
                for (&(_, len), kept) in pieces[..count].iter().zip(&mut shared) {
                    let end = (at + len).min(done);
                    if end > at && end > k {
                        let from = at.max(k);
                        match kept.take() {
                            Some(b) if from == at && end == at + len => c.unacked.push_kept(b),
                            Some(b) => c
                                .unacked
                                .push_kept(b.range((from - at) as usize, (end - at) as usize)),
                            None => c.unacked.push(bytes::Bytes::copy_from_slice(
                                &data[from as usize..end as usize],
                            )),
                        }
                    }
                    at += len;
                }
            }
        }
        self.after_conn_with(
            tcp,
            now,
            |link, wr, msg| path.post_cdc(link, wr, msg),
            settle,
        );
        Ok(done as usize)
    }

    /// RDMA-write each (address, bytes) of `writes` into the peer's RMB `rkey` over `link`,
    /// for connection `tcp`.
    fn post_writes(&mut self, tcp: TcpId, link: LinkId, rkey: u32, writes: Vec<(u64, Vec<u8>)>) {
        for (addr, data) in writes {
            let wr = self.new_wr(WrPurpose::Write { tcp, link });
            self.fabric_out.push_back(FabricOp::RdmaWrite {
                link,
                wr,
                rkey,
                addr,
                data,
            });
        }
    }

    /// Read up to `max` unread bytes of connection `tcp` in one pass (the data path's read):
    /// `copy(target, n)` copies the first `n` bytes of `target`'s regions out of our RMB
    /// (`n > 0`); they are then consumed. As TCP does, a read stops in front of the urgent
    /// byte, so that the next read starts with it (SIOCATMARK). Returns the bytes read (0:
    /// nothing unread now), or the copy's own error, in which case nothing is consumed.
    /// [`read_target`](Self::read_target), [`urgent_offset`](Self::urgent_offset) and
    /// [`consumed`](Self::consumed) do the same in three passes.
    pub fn read_with<E>(
        &mut self,
        tcp: TcpId,
        max: u32,
        now: Timestamp,
        copy: impl FnOnce(&ReadTarget, u32) -> Result<(), E>,
    ) -> Result<Result<u32, E>, EndpointError> {
        let Some(Entry::Smc(c)) = self.entries.get_mut(&tcp) else {
            return Err(self.not_established(tcp));
        };
        // Linux layout: no eye catcher to check.
        let regions = c.conn.read_regions([0; 4], now)?;
        let mut n = regions.total().min(max);
        if n == 0 {
            return Ok(Ok(0));
        }
        if let Some(mark) = c.conn.urgent_mark() {
            let before = RmbeRing::new(c.conn.config().layout, c.conn.config().local_rmbe_len)
                .ok()
                .and_then(|ring| ring.distance(c.conn.consumer_cursor(), mark).ok());
            if let Some(before) = before.filter(|d| *d > 0) {
                n = n.min(before);
            }
        }
        let target = ReadTarget {
            lgr: c.lgr,
            rmb: c.local.rmb,
            element_offset: c.local_element_offset,
            regions,
        };
        if let Err(e) = copy(&target, n) {
            return Ok(Err(e));
        }
        c.conn.consumed(n, now)?;
        self.after_conn(tcp, now);
        Ok(Ok(n))
    }

    /// Where in our RMB the next byte of connection `tcp` will be read from (its consumer
    /// cursor): link group, RMB and offset in the RMB. A reader that waits for data can
    /// fetch that cache line as soon as a completion arrives (see the runtime's spin).
    pub fn next_read_at(&self, tcp: TcpId) -> Option<(LgrId, crate::rmb_pool::RmbId, u64)> {
        let Some(Entry::Smc(c)) = self.entries.get(&tcp) else {
            return None;
        };
        let at = c.local_element_offset + u64::from(c.conn.consumer_cursor().count);
        Some((c.lgr, c.local.rmb, at))
    }

    /// Where the unread bytes of a connection are in our RMB (the runtime copies them out and
    /// calls [`consumed`](Self::consumed)).
    pub fn read_target(&mut self, tcp: TcpId, now: Timestamp) -> Result<ReadTarget, EndpointError> {
        let Some(Entry::Smc(c)) = self.entries.get_mut(&tcp) else {
            return Err(self.not_established(tcp));
        };
        // Linux layout: no eye catcher to check.
        let regions = c.conn.read_regions([0; 4], now)?;
        Ok(ReadTarget {
            lgr: c.lgr,
            rmb: c.local.rmb,
            element_offset: c.local_element_offset,
            regions,
        })
    }

    /// Over SMC-R, how many unread bytes precede the peer's urgent byte (0: the next byte read
    /// is the urgent byte, SIOCATMARK); `None` without urgent data.
    pub fn urgent_offset(&self, tcp: TcpId) -> Option<u32> {
        let Some(Entry::Smc(c)) = self.entries.get(&tcp) else {
            return None;
        };
        let mark = c.conn.urgent_mark()?;
        let ring = RmbeRing::new(c.conn.config().layout, c.conn.config().local_rmbe_len).ok()?;
        ring.distance(c.conn.consumer_cursor(), mark).ok()
    }

    /// The application consumed `n` bytes.
    pub fn consumed(&mut self, tcp: TcpId, n: u32, now: Timestamp) -> Result<(), EndpointError> {
        self.conn_command(tcp, now, |conn| conn.consumed(n, now))
    }

    /// TCP_NODELAY of connection `tcp`: off lets coalescing hold small updates (§4.5.2).
    pub fn set_nodelay(
        &mut self,
        tcp: TcpId,
        nodelay: bool,
        now: Timestamp,
    ) -> Result<(), EndpointError> {
        self.conn_command(tcp, now, |conn| {
            conn.set_nodelay(nodelay, now);
            Ok(())
        })
    }

    /// Whether arriving data of connection `tcp` queues [`Event::Readable`]
    /// (see [`Connection::set_readable_events`]).
    pub fn set_readable_events(&mut self, tcp: TcpId, on: bool) -> Result<(), EndpointError> {
        let Some(Entry::Smc(c)) = self.entries.get_mut(&tcp) else {
            return Err(self.not_established(tcp));
        };
        c.conn.set_readable_events(on);
        Ok(())
    }

    /// Coalescing of small sends of connection `tcp` (§4.5.2), or none.
    pub fn set_coalescing(
        &mut self,
        tcp: TcpId,
        coalescing: Option<Coalescing>,
        now: Timestamp,
    ) -> Result<(), EndpointError> {
        self.conn_command(tcp, now, |conn| {
            conn.set_coalescing(coalescing, now);
            Ok(())
        })
    }

    /// Send a producer-cursor update of `tcp` held back by coalescing now.
    pub fn flush(&mut self, tcp: TcpId, now: Timestamp) -> Result<(), EndpointError> {
        self.conn_command(tcp, now, |conn| {
            conn.flush(now);
            Ok(())
        })
    }

    /// shutdown(SHUT_WR).
    pub fn shutdown_write(&mut self, tcp: TcpId, now: Timestamp) -> Result<(), EndpointError> {
        self.conn_command(tcp, now, |conn| conn.shutdown_write(now))
    }

    /// close().
    pub fn close(&mut self, tcp: TcpId, now: Timestamp) -> Result<(), EndpointError> {
        self.conn_command(tcp, now, |conn| conn.close(now))
    }

    /// Abortive close.
    pub fn abort(&mut self, tcp: TcpId, now: Timestamp) -> Result<(), EndpointError> {
        self.conn_command(tcp, now, |conn| {
            conn.abort(now);
            Ok(())
        })
    }

    /// Run an application command on the established connection `tcp`; unless it fails, act
    /// on what it produced.
    fn conn_command(
        &mut self,
        tcp: TcpId,
        now: Timestamp,
        command: impl FnOnce(&mut Connection) -> Result<(), ApiError>,
    ) -> Result<(), EndpointError> {
        let Some(Entry::Smc(c)) = self.entries.get_mut(&tcp) else {
            return Err(self.not_established(tcp));
        };
        command(&mut c.conn)?;
        self.after_conn(tcp, now);
        Ok(())
    }

    fn not_established(&self, tcp: TcpId) -> EndpointError {
        if self.entries.contains_key(&tcp) {
            EndpointError::NotEstablished
        } else {
            EndpointError::UnknownConnection
        }
    }

    // ----- Failover (§4.6) -----------------------------------------------------------------

    /// Link `failed` of `lgr` is gone: move every connection that sent on it to a surviving
    /// link.
    pub(super) fn failover_link(&mut self, lgr: LgrId, failed: u8, now: Timestamp) {
        let group: Vec<TcpId> = self
            .lgrs
            .get(&lgr)
            .map(|g| g.conns.iter().copied().collect())
            .unwrap_or_default();
        let moving: Vec<TcpId> = group
            .into_iter()
            .filter(|t| {
                matches!(self.entries.get(t), Some(Entry::Smc(c)) if c.lgr == lgr && c.send_link == failed)
            })
            .collect();
        for tcp in moving {
            let Some(g) = self.lgrs.get(&lgr) else {
                return;
            };
            if g.active_count() == 0 {
                return;
            }
            let Some(Entry::Smc(c)) = self.entries.get(&tcp) else {
                continue;
            };
            let Some(new) = super::clc::least_loaded_link(g, c.peer_rmb) else {
                // No surviving link knows the peer's RMB: nothing can be written any more.
                self.conn_link_group_lost(tcp, now);
                continue;
            };
            self.failover_conn(tcp, new, now);
        }
    }

    /// Move one connection to link `new`: send the failover validation CDC carrying SS, then
    /// replay the bytes not known received, then one CDC describing them (§4.6.1, §4.6.2).
    fn failover_conn(&mut self, tcp: TcpId, new: u8, now: Timestamp) {
        let Some(Entry::Smc(c)) = self.entries.get_mut(&tcp) else {
            return;
        };
        let lgr = c.lgr;
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            return;
        };
        if !g.links.contains_key(&new) {
            return;
        }
        let Some(route) = super::SendRoute::of(g, c.peer_rmb, c.peer_element_offset, new) else {
            // The peer's RMB is unknown on the surviving link: nothing can be written.
            self.conn_link_group_lost(tcp, now);
            return;
        };
        let link = route.link;
        self.stats.failovers += 1;
        tracing::debug!(
            ?tcp,
            ?lgr,
            from = c.send_link,
            to = new,
            ss = c.ss,
            replay = c.unacked.len(),
            "failover"
        );
        g.remove_sender(c.send_link);
        g.add_sender(new);
        c.send_link = new;
        c.route = Some(route);
        //= https://www.rfc-editor.org/rfc/rfc7609#section-4.6.1
        //# When an RNIC fails and the sender changes SMC-R links, the sender must first send
        //# a CDC message with the F-bit (failover validation indicator; see Appendix A.4) set
        //# over the new SMC-R link.  This is the failover data validation message.  The
        //# sequence number in this CDC message is equal to SS.
        let validation = CdcMessage {
            seqno: c.ss,
            alert_token: c.conn.config().peer_alert_token,
            producer: Cursor::default(),
            consumer: Cursor::default(),
            prod_flags: ProducerFlags {
                failover_validation: true,
                ..ProducerFlags::default()
            },
            conn_flags: ConnStateFlags::default(),
        };
        trim_unacked(c);
        // Replay: the bytes from `unacked_from` to our producer cursor, in order.
        let ring = RmbeRing::new(c.conn.config().layout, c.conn.config().peer_rmbe_len);
        let mut writes = Vec::new();
        if let Ok(ring) = ring {
            let n = c.unacked.len() as u32;
            let regions = ring.regions(c.unacked_from, n);
            let bytes: Vec<u8> = c.unacked.to_vec();
            let mut off = 0usize;
            for r in regions.iter() {
                let len = r.len as usize;
                if let Some(chunk) = bytes.get(off..off + len) {
                    writes.push((route.base + u64::from(r.offset), chunk.to_vec()));
                }
                off += len;
            }
        }
        // Always one fresh CDC: besides the replayed bytes it re-announces our consumer
        // cursor and flags, whose last CDC may have been lost with the link.
        c.conn.failover_resend();
        let wr = self.new_wr(WrPurpose::Cdc {
            tcp,
            link,
            seq: validation.seqno,
            prod: Cursor::default(),
        });
        // The validation CDC's completion must not move SS: forget its purpose.
        self.wrs.remove(&wr);
        self.fabric_out.push_back(FabricOp::PostSend {
            link,
            wr,
            msg: validation.to_bytes().into(),
        });
        //= https://www.rfc-editor.org/rfc/rfc7609#section-4.6.2
        //# the sender must replay any RDMA writes (and their associated CDC messages) that
        //# were in progress or failed when the previous SMC-R link failed, before sending new
        //# data on the new SMC-R link.
        self.post_writes(tcp, link, route.rkey, writes);
        self.after_conn(tcp, now);
    }
}

/// Where connection `c` writes: its route, kept with its send link (and checked against the
/// group's tables in debug builds).
fn send_route(
    lgrs: &std::collections::BTreeMap<LgrId, crate::link_group::LinkGroup>,
    c: &super::SmcConn,
) -> Option<super::SendRoute> {
    debug_assert_eq!(
        c.route,
        lgrs.get(&c.lgr).and_then(|g| super::SendRoute::of(
            g,
            c.peer_rmb,
            c.peer_element_offset,
            c.send_link
        )),
        "stale send route"
    );
    c.route
}

/// Forget replay bytes the peer has consumed (its consumer cursor passed them).
fn trim_unacked(c: &mut super::SmcConn) {
    let peer_cons = c.conn.peer_consumer_cursor();
    drop_unacked_to(c, peer_cons);
}

/// Forget replay bytes before cursor `to` (if `to` lies within them).
fn drop_unacked_to(c: &mut super::SmcConn, to: Cursor) {
    if c.unacked.is_empty() {
        // The usual case on the shm fabric: every write was placed at once.
        return;
    }
    let Ok(ring) = RmbeRing::new(c.conn.config().layout, c.conn.config().peer_rmbe_len) else {
        return;
    };
    if let Ok(n) = ring.distance(c.unacked_from, to) {
        let n = n as usize;
        if n > 0 && n <= c.unacked.len() {
            c.unacked.drop_front(n);
            c.unacked_from = to;
        }
    }
}
