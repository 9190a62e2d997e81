//! The sending side of a connection: the window into the peer's RMBE, the producer cursor,
//! urgent data, corking and coalescing (RFC 7609 §4.3–§4.5).

use super::*;

impl Connection {
    pub(super) fn can_write(&self) -> bool {
        self.error.is_none()
            && matches!(self.state, State::Active | State::AppCloseWait1)
            && !self.write_shut
            && !self.local_closed
            && !self.peer_closed
    }

    /// Whether the peer closed the connection (PeerConnectionClosed received): nothing
    /// written from now on can be delivered.
    pub fn peer_closed(&self) -> bool {
        self.peer_closed
    }

    /// Whether no write can succeed any more — the connection failed, this side shut down
    /// writing or closed, or the peer closed — as opposed to a full window, which the peer's
    /// consumption reopens.
    pub fn write_ended(&self) -> bool {
        !self.can_write()
    }

    pub(crate) fn check_write(&self) -> Result<(), ApiError> {
        if let Some(e) = self.error {
            return Err(ApiError::Failed(e));
        }
        // While a close or shutdown is pending the runtime still writes its backlog.
        if self.write_shut || self.local_closed {
            return Err(ApiError::WriteShutdown);
        }
        if !self.can_write() {
            return Err(ApiError::InvalidState(self.state));
        }
        Ok(())
    }

    /// Free bytes in the peer's RMBE: capacity minus what we produced and the peer has not
    /// consumed (ignores the pause after urgent data).
    pub fn window(&self) -> u32 {
        let cap = self.peer_ring.capacity();
        cap - self
            .peer_ring
            .distance(self.peer_cons, self.prod)
            .unwrap_or(cap)
    }

    /// Where the next bytes may be written in the peer's RMBE (empty when the window is closed,
    /// writing is shut down, or urgent data awaits the peer's acknowledgement).
    //= https://www.rfc-editor.org/rfc/rfc7609#section-4.3
    //# The sender cannot write beyond this cursor into the receiver's RMBE without causing
    //# data loss.
    pub fn write_regions(&self) -> Regions {
        if !self.can_write() || matches!(self.urgent, SendUrgent::InFlight { .. }) {
            return Regions::default();
        }
        self.peer_ring.regions(self.prod, self.window())
    }

    /// Whether a poll reports this connection writable ([`super::stream_writable`] of the
    /// room and the peer's RMBE).
    pub fn stream_writable(&self) -> bool {
        super::stream_writable(self.write_room(), self.peer_ring.capacity())
    }

    /// Bytes the next write may take: the total of [`write_regions`](Self::write_regions),
    /// without building them.
    pub fn write_room(&self) -> u32 {
        let room = if !self.can_write()
            || matches!(self.urgent, SendUrgent::InFlight { .. })
            || !self.peer_ring.contains(self.prod)
        {
            0
        } else {
            // At most the capacity, as the regions are.
            self.window().min(self.peer_ring.capacity())
        };
        debug_assert_eq!(room, self.write_regions().total());
        room
    }

    pub(super) fn advance_producer(&mut self, n: u32) -> Result<(), ApiError> {
        self.check_write()?;
        let available = self.write_room();
        if n > available {
            return Err(ApiError::ExceedsWindow {
                requested: n,
                available,
            });
        }
        self.prod = self.peer_ring.advance(self.prod, n);
        self.stats.bytes_produced += u64::from(n);
        Ok(())
    }

    /// The caller wrote `n` bytes at the start of [`write_regions`](Self::write_regions).
    pub fn produced(&mut self, n: u32, now: Timestamp) -> Result<(), ApiError> {
        if n == 0 {
            return Ok(());
        }
        self.advance_producer(n)?;
        self.after_send_change(now);
        Ok(())
    }

    /// [`produced`](Self::produced) and [`set_send_backlog`](Self::set_send_backlog) at once
    /// (one pass over the send state instead of two, for the data path): `n` bytes written,
    /// `backlog` bytes of the application's write left over.
    pub fn produced_with_backlog(
        &mut self,
        n: u32,
        backlog: u64,
        now: Timestamp,
    ) -> Result<(), ApiError> {
        if self.produced_settle_later(n, backlog, now)? {
            self.settle_send(now);
        }
        Ok(())
    }

    /// [`produced_with_backlog`](Self::produced_with_backlog) for a caller that posts the
    /// CDC before the rest of the bookkeeping (the data path: the SEND is what the peer waits
    /// for). Returns `Ok(true)` when the rest was left for [`settle_send`](Self::settle_send),
    /// to be called after [`poll_transmit`](Self::poll_transmit): only when it cannot change
    /// the CDC (it then only adjusts timers), i.e. the peer has not closed and no shutdown or
    /// close waits for the backlog; otherwise it is done here, as `produced_with_backlog`
    /// does, and `Ok(false)` is returned.
    pub fn produced_settle_later(
        &mut self,
        n: u32,
        backlog: u64,
        now: Timestamp,
    ) -> Result<bool, ApiError> {
        if n > 0 {
            self.advance_producer(n)?;
        }
        self.send_backlog = backlog;
        if self.peer_closed || self.write_shut_pending || self.close_pending {
            self.after_send_change(now);
            return Ok(false);
        }
        Ok(true)
    }

    /// The rest of [`produced_settle_later`](Self::produced_settle_later) (its `Ok(true)`).
    pub fn settle_send(&mut self, now: Timestamp) {
        // What `after_send_change` does when neither the peer closed nor a shutdown or close
        // waits: the timers.
        debug_assert!(!self.peer_closed && !self.write_shut_pending && !self.close_pending);
        self.sync_timers(now);
    }

    /// The caller wrote `n` bytes whose last byte is urgent (MSG_OOB). The CDC carries P and
    /// U with the producer cursor just past the urgent byte; no more data is written until the
    /// peer's consumer cursor acknowledges it.
    //= https://www.rfc-editor.org/rfc/rfc7609#section-4.7.5
    //# The partner host (Host A) cannot initiate any additional RDMA writes until it
    //# receives acknowledgment that the urgent data has been processed (or at least
    //# processed/remembered at the SMC-R layer).
    pub fn produced_urgent(&mut self, n: u32, now: Timestamp) -> Result<(), ApiError> {
        if n == 0 {
            return Err(ApiError::EmptyUrgent);
        }
        self.advance_producer(n)?;
        self.urgent = SendUrgent::InFlight {
            end: self.prod,
            next_pending: false,
        };
        self.after_send_change(now);
        Ok(())
    }

    /// The application has urgent data it cannot write yet (window closed): announce it with
    /// the P flag.
    //= https://www.rfc-editor.org/rfc/rfc7609#section-4.7.6
    //# It then sends a CDC message to notify the peer of the Urgent Data Pending (UrgP)
    //# indicator (the writer blocked indicator remains on as well).
    pub fn urgent_pending(&mut self, now: Timestamp) -> Result<(), ApiError> {
        self.check_write()?;
        match &mut self.urgent {
            u @ SendUrgent::None => *u = SendUrgent::Pending,
            SendUrgent::Pending => {}
            SendUrgent::InFlight { next_pending, .. } => *next_pending = true,
        }
        self.after_send_change(now);
        Ok(())
    }

    /// How many bytes the application still holds for this connection that are not yet
    /// written (its send buffer). With a closed window this sets the writer-blocked flag; a
    /// pending close or shutdown completes when it reaches zero.
    pub fn set_send_backlog(&mut self, bytes: u64, now: Timestamp) {
        self.send_backlog = bytes;
        self.after_send_change(now);
    }

    /// TCP_CORK: while set, producer-cursor updates are held (until the window fills, the
    /// cork is removed, or the cork ceiling timer fires).
    pub fn set_cork(&mut self, cork: bool, now: Timestamp) {
        self.cork = cork;
        if !cork && self.prod != self.prod_sent {
            self.flush_due = true;
        }
        self.sync_timers(now);
    }

    /// Coalescing of small sends (§4.5.2), or none.
    pub fn set_coalescing(&mut self, coalescing: Option<Coalescing>, now: Timestamp) {
        self.config.coalescing = coalescing;
        self.sync_timers(now);
    }

    /// Send a producer-cursor update held back by coalescing now (the application waits for
    /// the peer, so holding it back gains nothing). TCP_CORK still holds.
    pub fn flush(&mut self, now: Timestamp) {
        if !self.cork && self.prod != self.prod_sent {
            self.flush_due = true;
        }
        self.sync_timers(now);
    }

    /// TCP_NODELAY: disables coalescing of small sends (TCP_CORK still applies, as in TCP).
    pub fn set_nodelay(&mut self, nodelay: bool, now: Timestamp) {
        self.nodelay = nodelay;
        self.sync_timers(now);
    }

    /// Whether arriving data queues [`Event::Readable`] (on at first). A runtime whose readers
    /// find new bytes by looking (a reader that spins on the completion queues, or polls once
    /// more before it sleeps) turns it off while nobody sleeps on the connection: the event
    /// would only be queued and dropped, for every CDC that brings data. It must be on before
    /// a reader sleeps (the engine keeps no record of what arrived while it was off).
    pub fn set_readable_events(&mut self, on: bool) {
        self.readable_events = on;
    }

    /// Whether arriving data queues [`Event::Readable`] now.
    pub fn readable_events(&self) -> bool {
        self.readable_events
    }

    /// Whether TCP_NODELAY is in effect.
    pub fn nodelay(&self) -> bool {
        self.nodelay
    }

    /// Whether TCP_CORK is in effect.
    pub fn cork(&self) -> bool {
        self.cork
    }

    /// Ask the peer for a consumer-cursor update now (R flag; for diagnosing a stalled
    /// receiver, RFC 7609 §4.5.1).
    pub fn request_consumer_update(&mut self) -> Result<(), ApiError> {
        if let Some(e) = self.error {
            return Err(ApiError::Failed(e));
        }
        if self.local_closed || !self.state_sends_cdcs() {
            return Err(ApiError::InvalidState(self.state));
        }
        self.request_update = true;
        Ok(())
    }

    pub(super) fn has_pending_writes(&self) -> bool {
        if self.write_shut || self.local_closed {
            // Nothing can be written any more.
            return false;
        }
        self.send_backlog > 0
            || matches!(
                self.urgent,
                SendUrgent::Pending
                    | SendUrgent::InFlight {
                        next_pending: true,
                        ..
                    }
            )
    }

    pub(super) fn after_send_change(&mut self, now: Timestamp) {
        // Data that can never be written because the peer closed: reset, as on receipt of
        // PeerConnectionClosed with data pending (RFC 7609 §4.8.1 4A).
        if self.peer_closed && self.has_pending_writes() && self.error.is_none() {
            self.abort_with(AbortReason::PeerClosedWithPendingData, now, true);
            return;
        }
        if !self.has_pending_writes() && self.error.is_none() {
            //= https://www.rfc-editor.org/rfc/rfc7609#section-4.8.1
            //# If this process could not be completed synchronously (the pending close
            //# condition mentioned above), it is completed when all RDMA writes for data and
            //# control cursors have been completed.
            if self.write_shut_pending {
                self.write_shut_pending = false;
                self.do_shutdown_write();
            }
            if self.close_pending {
                self.close_pending = false;
                self.do_close();
            }
        }
        self.sync_timers(now);
    }

    /// Whether a producer-cursor update is being held back (TCP_CORK or coalescing).
    pub(super) fn holding(&self) -> bool {
        let holding = self.holding_decided();
        debug_assert_eq!(holding, self.holding_by_the_rules());
        holding
    }

    /// [`holding`](Self::holding), with the cursor arithmetic only where it decides.
    pub(super) fn holding_decided(&self) -> bool {
        if self.prod == self.prod_sent || self.flush_due {
            return false;
        }
        if self.write_shut || self.local_closed || self.urgent != SendUrgent::None {
            return false;
        }
        if self.send_backlog > 0 {
            return false;
        }
        // The cursor arithmetic last, and only where its answer counts: the usual small write
        // of a request-response exchange (nothing of ours unconsumed) is decided without it.
        let min_bytes = if self.cork {
            None
        } else {
            //= https://www.rfc-editor.org/rfc/rfc7609#section-4.5.2
            //# Also, the sending host would have to opt out of this processing if Nagle's
            //# algorithm had been disabled (programmatically or via system configuration).
            match self.config.coalescing {
                Some(c) if !self.nodelay => {
                    let outstanding = self.peer_cons != self.prod_sent;
                    if !outstanding && c.while_unconsumed {
                        return false;
                    }
                    Some(c.min_bytes)
                }
                _ => return false,
            }
        };
        if self.window() == 0 {
            return false;
        }
        match min_bytes {
            None => true,
            Some(min) => {
                let unsignalled = self
                    .peer_ring
                    .distance(self.prod_sent, self.prod)
                    .unwrap_or(u32::MAX);
                unsignalled < min
            }
        }
    }

    /// [`holding`](Self::holding) stated plainly, rule by rule (what the debug builds check
    /// the shortcut against).
    pub(super) fn holding_by_the_rules(&self) -> bool {
        if self.prod == self.prod_sent || self.flush_due {
            return false;
        }
        if self.write_shut || self.local_closed || self.urgent != SendUrgent::None {
            return false;
        }
        if self.window() == 0 || self.send_backlog > 0 {
            return false;
        }
        if self.cork {
            return true;
        }
        match self.config.coalescing {
            Some(c) if !self.nodelay => {
                let unsignalled = self
                    .peer_ring
                    .distance(self.prod_sent, self.prod)
                    .unwrap_or(u32::MAX);
                let outstanding = self.peer_cons != self.prod_sent;
                unsignalled < c.min_bytes && (outstanding || !c.while_unconsumed)
            }
            _ => false,
        }
    }
}
