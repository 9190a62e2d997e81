//! The receiving side of a connection: readable bytes, the consumer cursor and when to
//! announce it, and the peer's CDC messages (RFC 7609 §4.3–§4.5, §4.8).

use super::*;

impl Connection {
    pub(super) fn discarding(&self) -> bool {
        self.read_shut || self.local_closed
    }

    /// Bytes the application can read from our RMBE.
    pub fn readable(&self) -> u32 {
        if self.error.is_some() || self.discarding() {
            return 0;
        }
        self.local_ring
            .distance(self.cons, self.peer_prod)
            .unwrap_or(0)
    }

    /// After the peer reset the connection (its PeerConnAbort, a TCP RST, or its close
    /// while we still had data to write) or the link group was lost (no link left: the
    /// peer's host, or the peer's process with its userspace stack, is gone): the bytes it
    /// had written and announced before, still unread in our RMBE. A TCP receiver reads what
    /// arrived ahead of a reset before it sees the reset, so these are handed to the
    /// application ahead of the error; the runtime copies them out when the failure is
    /// reported (the RMBE goes back to the pool with the connection, or with its link
    /// group). Every byte up to the peer's producer cursor was placed before the CDC that
    /// announced it (the WRITEs precede the SEND on the same reliably connected QP), so they
    /// are whole even when the links are gone. `None` for every other failure: after a
    /// protocol violation or a local abort the cursors are not to be trusted, or the bytes
    /// were thrown away.
    pub fn unread_at_reset(&self) -> Option<Regions> {
        let Some(ConnError::Reset(
            AbortReason::PeerAbort
            | AbortReason::TcpReset
            | AbortReason::PeerClosedWithPendingData
            | AbortReason::LinkGroupLost,
        )) = self.error
        else {
            return None;
        };
        if self.discarding() {
            return None;
        }
        let n = self.local_ring.distance(self.cons, self.peer_prod).ok()?;
        (n > 0).then(|| self.local_ring.regions(self.cons, n))
    }

    /// Whether no more bytes will arrive: the peer is done writing (its PeerDoneWriting or
    /// PeerConnectionClosed came), or reading was shut down here — bytes that came before
    /// may still be unread. What a TCP socket's receive shutdown (a FIN, or `SHUT_RD`)
    /// means, which `tcp_poll()` reports as EPOLLRDHUP at once, unread bytes or not.
    pub fn is_read_shut(&self) -> bool {
        self.discarding() || self.peer_done
    }

    /// Whether reads have reached end of stream (the peer is done writing and everything was
    /// read, or reading was shut down).
    pub fn is_read_closed(&self) -> bool {
        self.discarding() || (self.peer_done && self.readable() == 0)
    }

    /// The unread ranges of our RMBE. `rmbe_head` is the first 4 bytes of our RMBE, checked
    /// against the eye catcher in RFC mode (ignored in Linux mode); an overwritten eye catcher
    /// resets the connection.
    //= https://www.rfc-editor.org/rfc/rfc7609#section-4.4.1
    //# If the eye catchers are found to be corrupted, the local host must reset the TCP
    //# connection associated with this RMBE and log the appropriate diagnostic information.
    pub fn read_regions(
        &mut self,
        rmbe_head: [u8; 4],
        now: Timestamp,
    ) -> Result<Regions, ApiError> {
        if let Some(e) = self.error {
            return Err(ApiError::Failed(e));
        }
        if !self.config.layout.eye_catcher_intact(rmbe_head) {
            tracing::warn!(
                head = ?rmbe_head,
                alert_token = self.config.local_alert_token,
                "RMBE eye catcher overwritten; resetting connection"
            );
            self.abort_with(AbortReason::EyeCatcherOverwritten, now, true);
            return Err(ApiError::Failed(
                self.error
                    .unwrap_or(ConnError::Aborted(AbortReason::EyeCatcherOverwritten)),
            ));
        }
        Ok(self.local_ring.regions(self.cons, self.readable()))
    }

    /// The caller copied `n` bytes out of the start of [`read_regions`](Self::read_regions).
    pub fn consumed(&mut self, n: u32, now: Timestamp) -> Result<(), ApiError> {
        if let Some(e) = self.error {
            return Err(ApiError::Failed(e));
        }
        let available = self.readable();
        if n > available {
            return Err(ApiError::ExceedsReadable {
                requested: n,
                available,
            });
        }
        if n == 0 {
            return Ok(());
        }
        self.cons = self.local_ring.advance(self.cons, n);
        self.stats.bytes_consumed += u64::from(n);
        self.decide_consumer_update();
        self.sync_timers(now);
        Ok(())
    }

    pub(super) fn discard_unread(&mut self) {
        let n = self
            .local_ring
            .distance(self.cons, self.peer_prod)
            .unwrap_or(0);
        if n > 0 {
            self.cons = self.peer_prod;
            self.stats.bytes_discarded += u64::from(n);
            self.urgent_mark = None;
            self.decide_consumer_update();
        }
    }

    /// §4.5.1: decide whether our consumer cursor goes to the peer in its own CDC.
    pub(super) fn decide_consumer_update(&mut self) {
        if self.cons == self.cons_sent {
            return;
        }
        let mut urgent_consumed = false;
        if let Some(mark) = self.urgent_mark {
            if self
                .local_ring
                .distance(mark, self.cons)
                .is_ok_and(|d| d >= 1)
            {
                urgent_consumed = true;
                self.urgent_mark = None;
            }
        }
        let cap = self.local_ring.capacity();
        let sender_window = cap
            - self
                .local_ring
                .distance(self.cons_sent, self.peer_prod)
                .unwrap_or(cap);
        let receiver_window = cap
            - self
                .local_ring
                .distance(self.cons, self.peer_prod)
                .unwrap_or(cap);
        //= https://www.rfc-editor.org/rfc/rfc7609#section-4.5.1
        //# If a peer has set the B-bit in a CDC message, then any consumption of data by the
        //# receiver causes a CDC message to be sent, updating the consumer cursor until a CDC
        //# message with that bit cleared is received from the peer.
        let blocked = self.peer_flags.write_blocked;
        //= https://www.rfc-editor.org/rfc/rfc7609#section-4.5.1
        //# When this indicator is on, the consumer must send a consumer cursor update
        //# immediately when data is consumed by the local application
        let requested = self.peer_update_requested;
        //= https://www.rfc-editor.org/rfc/rfc7609#section-4.7.5
        //# Note that this CDC message must occur, regardless of the current local window
        //# size that is available.
        let urgent = urgent_consumed || self.peer_flags.urgent_pending;
        if blocked
            || requested
            || urgent
            || window_update_needed(cap, sender_window, receiver_window)
        {
            self.cons_update_due = true;
        }
    }

    /// Process one CDC message from the peer. Invalid cursors abort the connection (counted
    /// in [`ConnStats::aborts`]); stale, misrouted or late messages are ignored (counted).
    pub fn handle_cdc(&mut self, msg: CdcMessage, now: Timestamp) {
        self.stats.cdc_received += 1;
        if msg.alert_token != self.config.local_alert_token {
            self.stats.cdc_wrong_token += 1;
            return;
        }
        if msg.prod_flags.failover_validation {
            self.handle_failover_validation(msg.seqno, now);
            return;
        }
        if let Some(last) = self.last_rx_seq {
            if (msg.seqno.wrapping_sub(last) as i16) <= 0 {
                self.stats.cdc_stale += 1;
                return;
            }
        }
        self.last_rx_seq = Some(msg.seqno);
        if let Some(ss) = self.validation_pending {
            if (msg.seqno.wrapping_sub(ss) as i16) >= 0 {
                self.validation_pending = None;
                self.timers.stop(ConnTimer::FailoverValidation);
            }
        }
        match self.state {
            State::Closed | State::ProcessAbort => {
                self.stats.cdc_ignored += 1;
                return;
            }
            //= https://www.rfc-editor.org/rfc/rfc7609#section-4.8.2
            //# During this state, it will monitor this SMC-R connection waiting for the peer
            //# to send its corresponding PeerConnAbort indicator but will ignore any other
            //# activity in this connection (i.e., new incoming data).
            State::PeerAbortWait => {
                if msg.conn_flags.peer_abnormal_close {
                    self.transition(Input::PeerConnAbort);
                } else {
                    self.stats.cdc_ignored += 1;
                }
                self.sync_timers(now);
                return;
            }
            _ => {}
        }
        if msg.conn_flags.peer_abnormal_close {
            // Every CDC carries the peer's producer cursor, the abort's too (Linux sends
            // its current cursors with PeerConnAbort): bytes it wrote just before it
            // aborted, announced by this very message, are as valid as any (a peer that
            // answers and then closes with our request unread). A cursor that does not
            // validate is ignored: the connection ends anyway.
            if self.error.is_none() && !self.discarding() {
                if let Ok((new_bytes, _)) = self.validate(&msg) {
                    if new_bytes > 0 {
                        self.peer_prod = msg.producer;
                        self.stats.bytes_received += u64::from(new_bytes);
                    }
                }
            }
            self.passive_abort(now);
            return;
        }
        let (new_bytes, acked) = match self.validate(&msg) {
            Ok(v) => v,
            Err(reason) => {
                tracing::debug!(?reason, ?msg, "invalid CDC; aborting connection");
                self.abort_with(reason, now, true);
                return;
            }
        };
        // Receive direction.
        if new_bytes > 0 {
            self.peer_prod = msg.producer;
            self.stats.bytes_received += u64::from(new_bytes);
            if self.discarding() {
                self.discard_unread();
            } else if self.readable_events {
                self.events.push_back(Event::Readable);
            }
        }
        // Send direction.
        if acked > 0 {
            // Writable as a poll reports it (a third of the RMBE free, as TCP's), not at the
            // first free byte: a waiter woken then would find the connection not writable.
            let was_writable = self.stream_writable();
            self.peer_cons = msg.consumer;
            if let SendUrgent::InFlight { end, next_pending } = self.urgent {
                if self.peer_ring.distance(end, self.peer_cons).is_ok() {
                    self.urgent = if next_pending {
                        SendUrgent::Pending
                    } else {
                        SendUrgent::None
                    };
                }
            }
            if !was_writable && self.stream_writable() {
                self.events.push_back(Event::Writable);
            }
        }
        // Producer flags.
        let pf = msg.prod_flags;
        //= https://www.rfc-editor.org/rfc/rfc7609#section-4.7.5
        //# notices that the Urgent Data Pending flag is on, and proceeds with out-of-band
        //# socket API notification
        if pf.urgent_pending && !self.peer_flags.urgent_pending && !self.discarding() {
            self.events.push_back(Event::UrgentPending);
        }
        //= https://www.rfc-editor.org/rfc/rfc7609#section-4.7.5
        //# the producer cursor points 1 byte beyond the last byte of urgent data
        if pf.urgent_present && new_bytes > 0 && !self.discarding() {
            let mark = self.local_ring.retreat_one(msg.producer);
            self.urgent_mark = Some(mark);
            self.events.push_back(Event::UrgentData { mark });
        }
        self.peer_flags = pf;
        if pf.cons_update_requested {
            if self.cons != self.cons_sent {
                self.cons_update_due = true;
            } else {
                self.peer_update_requested = true;
            }
        }
        if (pf.write_blocked || pf.urgent_pending) && self.cons != self.cons_sent {
            self.cons_update_due = true;
        }
        // Connection state flags.
        let cf = msg.conn_flags;
        if cf.peer_conn_closed && !self.peer_closed {
            self.peer_closed = true;
            if !self.peer_done {
                self.peer_done = true;
                self.events.push_back(Event::ReadClosed);
            }
            //= https://www.rfc-editor.org/rfc/rfc7609#section-4.8.1
            //# If there is any pending data to be written and PeerConnectionClosed is on,
            //# then an SMC-R connection reset must be performed.
            if self.has_pending_writes() && !self.write_shut {
                self.abort_with(AbortReason::PeerClosedWithPendingData, now, true);
                return;
            }
            self.transition(Input::PeerConnectionClosed);
        } else if cf.peer_done_writing && !self.peer_done {
            self.peer_done = true;
            self.events.push_back(Event::ReadClosed);
            if matches!(self.state, State::Active | State::PeerCloseWait1) {
                self.transition(Input::PeerDoneWriting);
            }
        }
        self.sync_timers(now);
    }

    /// The failover data validation message (F flag) carries the sender's SS: the sequence
    /// number of the last CDC whose write it knows was received. We compare it with SR, the
    /// sequence number of the last CDC we received.
    ///
    /// SR may lag for a while without anything being lost: the CDCs the peer sent on the
    /// failed link did reach our receive queue of that link, but that queue's completions
    /// may be handled after the validation that came on the new link (two completion queues,
    /// no order between them). So a validation that finds SR behind SS is held for
    /// `validation_wait`: SR catches up when the late CDC is handled, or when the peer's
    /// next CDC arrives (it follows the validation at once, §4.6.2, and carries the
    /// cumulative cursors and flags of every CDC before it). Only an SR still behind SS
    /// when the wait ends means data was lost.
    //= https://www.rfc-editor.org/rfc/rfc7609#section-4.6.1
    //# Upon receipt of the failover validation message, the receiver must verify that its SR
    //# value for the TCP connection is equal to or greater than the sequence number in the
    //# failover validation message.
    pub(super) fn handle_failover_validation(&mut self, ss: u16, now: Timestamp) {
        self.stats.failover_validations += 1;
        // Before any CDC arrived SR is the number before the first one (sequence numbers start
        // at 1, §4.3), so SR = 0.
        let sr = self.last_rx_seq.unwrap_or(0);
        if (sr.wrapping_sub(ss) as i16) >= 0 || !self.state_sends_cdcs() {
            return;
        }
        tracing::debug!(sr, ss, "failover validation: SR behind SS; waiting for it");
        self.stats.failover_validations_held += 1;
        let later = self
            .validation_pending
            .is_some_and(|p| (p.wrapping_sub(ss) as i16) > 0);
        if !later {
            self.validation_pending = Some(ss);
        }
        if !self.timers.is_set(ConnTimer::FailoverValidation) {
            self.timers.set(
                ConnTimer::FailoverValidation,
                now + self.config.validation_wait,
            );
        }
    }

    /// SR (RFC 7609 §4.6.1): the sequence number of the last CDC received, if any.
    pub fn sequence_received(&self) -> Option<u16> {
        self.last_rx_seq
    }

    /// After a failover the sender replays the writes that were pending or failed and then
    /// sends one CDC, with a new sequence number, that describes them all (RFC 7609 §4.6.2,
    /// second option). Call this once the replayed RDMA WRITEs are posted; the next
    /// [`poll_transmit`](Self::poll_transmit) yields that CDC.
    //= https://www.rfc-editor.org/rfc/rfc7609#section-4.6.2
    //# Combine failed and pending messages into a single new write with a new sequence
    //# number.
    pub fn failover_resend(&mut self) {
        if self.state_sends_cdcs() || self.closed_in_order() {
            self.resend_due = true;
        }
    }

    /// Closed by an orderly close of ours (our PeerConnectionClosed went out, no failure):
    /// after a failover that indication goes out again, since the CDC that carried it may
    /// have been lost with the failed link.
    pub(super) fn closed_in_order(&self) -> bool {
        self.state == State::Closed
            && self.local_closed
            && self.error.is_none()
            && self.sent_conn_flags.peer_conn_closed
    }

    /// The link group this connection runs on is gone (its last link failed or it was
    /// terminated): no CDC or RDMA write can flow any more. The connection goes to Closed at
    /// once, the application sees a reset, and the runtime resets the TCP connection.
    //= https://www.rfc-editor.org/rfc/rfc7609#section-4.5.3
    //# If no alternate SMC-R link exists in the SMC-R link group, then all of the SMC-R
    //# connections on this link are abnormally terminated by resetting the TCP connections
    //# represented by these SMC-R connections.
    pub fn handle_link_group_lost(&mut self, now: Timestamp) {
        if self.state == State::Closed {
            return;
        }
        self.stats.aborts.add(AbortReason::LinkGroupLost);
        self.fail(AbortReason::LinkGroupLost.app_error());
        self.events.push_back(Event::SendTcpReset);
        self.purge();
        self.abort_pending = false;
        self.transition(Input::LinkGroupLost);
        self.sync_timers(now);
    }

    /// Check a CDC's cursors against our view; returns (new bytes, bytes acknowledged).
    pub(super) fn validate(&self, msg: &CdcMessage) -> Result<(u32, u32), AbortReason> {
        if !self.local_ring.contains(msg.producer) {
            return Err(AbortReason::ProducerOutOfBounds);
        }
        if !self.peer_ring.contains(msg.consumer) {
            return Err(AbortReason::ConsumerOutOfBounds);
        }
        let new_bytes = match self.local_ring.distance(self.peer_prod, msg.producer) {
            Ok(n) => n,
            Err(CursorOrder::Backwards) => return Err(AbortReason::ProducerBackwards),
            Err(_) => return Err(AbortReason::ProducerOverrun),
        };
        // The peer may not write past the consumer cursor we told it: what it claims to have
        // written since then never exceeds the RMBE.
        if self
            .local_ring
            .distance(self.cons_sent, msg.producer)
            .is_err()
        {
            return Err(AbortReason::ProducerOverrun);
        }
        if new_bytes > 0 && self.peer_done {
            return Err(AbortReason::DataAfterDone);
        }
        let acked = match self.peer_ring.distance(self.peer_cons, msg.consumer) {
            Ok(n) => n,
            Err(CursorOrder::Backwards) => return Err(AbortReason::ConsumerBackwards),
            Err(_) => return Err(AbortReason::ConsumerAhead),
        };
        // The peer cannot have consumed what we did not announce.
        if self
            .peer_ring
            .distance(msg.consumer, self.prod_sent)
            .is_err()
        {
            return Err(AbortReason::ConsumerAhead);
        }
        Ok((new_bytes, acked))
    }
}
