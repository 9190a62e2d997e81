//! What a connection asks of its caller: timers, the CDC message to transmit next, events.

use super::*;

impl Connection {
    pub(super) fn state_sends_cdcs(&self) -> bool {
        !matches!(
            self.state,
            State::Closed | State::PeerAbortWait | State::ProcessAbort
        )
    }

    pub(super) fn desired_flags(&self) -> (ProducerFlags, ConnStateFlags) {
        let pf = ProducerFlags {
            //= https://www.rfc-editor.org/rfc/rfc7609#section-4.7.4
            //# Since the entire receive buffer space is filled, the producer writer blocked
            //# flag (the "Wrt Blk" indicator (flag) in Figure 19) is set
            write_blocked: self.send_backlog > 0 && self.window() == 0 && self.can_write(),
            urgent_pending: self.urgent != SendUrgent::None,
            urgent_present: matches!(self.urgent, SendUrgent::InFlight { .. }),
            cons_update_requested: false,
            failover_validation: false,
        };
        let cf = ConnStateFlags {
            peer_done_writing: self.write_shut,
            peer_conn_closed: self.local_closed,
            peer_abnormal_close: false,
        };
        (pf, cf)
    }

    pub(super) fn cdc_needed(&self) -> bool {
        // The usual answer after an input of the data path, without computing the flags: no
        // new bytes, nothing requested or due, no flag that could be newly set (every flag
        // below follows one of these fields), so no branch further down can say yes.
        if !self.abort_pending
            && !self.resend_due
            && !self.request_update
            && !self.cons_update_due
            && !self.local_closed
            && !self.write_shut
            && self.send_backlog == 0
            && self.urgent == SendUrgent::None
            && self.prod == self.prod_sent
        {
            debug_assert!(!self.cdc_needed_in_full());
            return false;
        }
        self.cdc_needed_in_full()
    }

    /// [`cdc_needed`](Self::cdc_needed) without its shortcut.
    pub(super) fn cdc_needed_in_full(&self) -> bool {
        if self.abort_pending {
            return true;
        }
        // After a failover the last CDC may have been lost with the failed link, our
        // PeerConnectionClosed included: it goes out again (the peer takes it once).
        if self.resend_due && (self.state_sends_cdcs() || self.closed_in_order()) {
            return true;
        }
        //= https://www.rfc-editor.org/rfc/rfc7609#section-4.8.1
        //# When the PeerConnectionClosed indicator is turned on, the SMC-R peer is
        //# indicating that it is done updating the partner's RMBE.
        if self.sent_conn_flags.peer_conn_closed {
            return false;
        }
        // A flag newly set goes out at once; a flag merely cleared (writer no longer
        // blocked, urgent data acknowledged) rides on the next CDC sent anyway.
        let (pf, cf) = self.desired_flags();
        let newly_set = |want: u8, sent: u8| want & !sent != 0;
        // Our PeerConnectionClosed still goes out when the close took us straight to Closed
        // (Fig. 22 3D and 4C), unless the connection failed.
        if self.local_closed && self.error.is_none() {
            return true;
        }
        if !self.state_sends_cdcs() {
            return false;
        }
        newly_set(pf.to_byte(), self.sent_prod_flags.to_byte())
            || newly_set(cf.to_byte(), self.sent_conn_flags.to_byte())
            || self.request_update
            || self.resend_due
            || self.cons_update_due
            || (self.prod != self.prod_sent && !self.holding())
    }

    /// The next CDC message to SEND to the peer, built from the current cursors and flags.
    /// Every CDC carries our consumer cursor.
    //= https://www.rfc-editor.org/rfc/rfc7609#section-4.5.1
    //# The receiver must always include a consumer cursor update whenever it sends a CDC
    //# message to the partner for another flow (i.e., send flow in the opposite direction).
    pub fn poll_transmit(&mut self) -> Option<CdcMessage> {
        if !self.cdc_needed() {
            return None;
        }
        let (mut pf, mut cf) = self.desired_flags();
        let window_update_only = pf == self.sent_prod_flags
            && cf == self.sent_conn_flags
            && self.prod == self.prod_sent
            && !self.request_update
            && !self.abort_pending;
        pf.cons_update_requested = self.request_update;
        if self.abort_pending {
            cf.peer_abnormal_close = true;
        }
        let msg = CdcMessage {
            seqno: self.next_seq,
            alert_token: self.config.peer_alert_token,
            producer: self.prod,
            consumer: self.cons,
            prod_flags: pf,
            conn_flags: cf,
        };
        self.next_seq = self.next_seq.wrapping_add(1);
        if pf.write_blocked && !self.sent_prod_flags.write_blocked {
            self.stats.write_blocked_signals += 1;
        }
        pf.cons_update_requested = false;
        self.sent_prod_flags = pf;
        self.sent_conn_flags = cf;
        self.prod_sent = self.prod;
        self.cons_sent = self.cons;
        self.cons_update_due = false;
        self.peer_update_requested = false;
        self.request_update = false;
        self.resend_due = false;
        self.flush_due = false;
        self.timers.stop(ConnTimer::Flush);
        self.stats.cdc_sent += 1;
        if window_update_only {
            self.stats.window_updates_sent += 1;
        }
        if self.abort_pending {
            self.abort_pending = false;
            //= https://www.rfc-editor.org/rfc/rfc7609#section-4.8.2
            //# Send a CDC message to notify the peer of the PeerConnAbort indicator and, once
            //# that is completed, transition this RMBE to the Closed state.
            if self.state == State::ProcessAbort {
                self.transition(Input::AbortSent);
            }
        }
        Some(msg)
    }

    /// The next event for the application or the runtime.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }
}
