//! How a connection ends: shutdown, normal close, abort, a lost link group or TCP reset
//! (RFC 7609 §4.8, Fig. 22).

use super::*;

impl Connection {
    /// shutdown(SHUT_WR): send PeerDoneWriting (Fig. 22 3A from Active, 4B from
    /// AppCloseWait1). Deferred while data is still to be written.
    pub fn shutdown_write(&mut self, now: Timestamp) -> Result<(), ApiError> {
        if let Some(e) = self.error {
            return Err(ApiError::Failed(e));
        }
        if self.write_shut || self.write_shut_pending || self.local_closed || self.close_pending {
            return Ok(());
        }
        if !matches!(self.state, State::Active | State::AppCloseWait1) {
            return Err(ApiError::InvalidState(self.state));
        }
        if self.has_pending_writes() {
            self.write_shut_pending = true;
        } else {
            self.do_shutdown_write();
        }
        self.sync_timers(now);
        Ok(())
    }

    pub(super) fn do_shutdown_write(&mut self) {
        self.write_shut = true;
        self.transition(Input::AppShutdownWrite);
    }

    /// shutdown(SHUT_RD): no flow to the peer; unread and later data is discarded (consumed
    /// on the application's behalf so the peer is never stranded) and reads return end of
    /// stream.
    //= https://www.rfc-editor.org/rfc/rfc7609#section-4.8.1
    //# Shutdown for read is typically not a very useful operation and in normal
    //# circumstances does not trigger any network flows to notify the partner TCP endpoint
    //# of this operation.
    pub fn shutdown_read(&mut self, now: Timestamp) -> Result<(), ApiError> {
        if let Some(e) = self.error {
            return Err(ApiError::Failed(e));
        }
        self.read_shut = true;
        self.discard_unread();
        self.sync_timers(now);
        Ok(())
    }

    /// close() or shutdown(SHUT_RDWR). Unread data resets the connection; data still to be
    /// written defers the close until [`set_send_backlog`](Self::set_send_backlog) reports
    /// zero; otherwise PeerConnectionClosed is sent.
    ///
    /// RDMA WRITEs already posted need no wait: the CDC carrying PeerConnectionClosed is a
    /// SEND on the same reliably connected QP, which the peer sees only after those writes.
    /// After close the application is gone: later data from the peer is discarded.
    pub fn close(&mut self, now: Timestamp) -> Result<(), ApiError> {
        if self.error.is_some() || self.local_closed || self.close_pending {
            return Ok(());
        }
        if matches!(
            self.state,
            State::Closed | State::PeerAbortWait | State::ProcessAbort
        ) {
            return Ok(());
        }
        //= https://www.rfc-editor.org/rfc/rfc7609#section-4.8.1
        //# If unread data is detected, the SMC-R connection must be abnormally reset
        if !self.read_shut
            && self
                .local_ring
                .distance(self.cons, self.peer_prod)
                .is_ok_and(|n| n > 0)
        {
            self.abort_with(AbortReason::UnreadDataOnClose, now, true);
            return Ok(());
        }
        //= https://www.rfc-editor.org/rfc/rfc7609#section-4.8.1
        //# If either of these two scenarios is true, an indicator that this connection is in
        //# a pending close state is saved in internal data structures representing this
        //# SMC-R connection, and control is returned to the application.
        if self.has_pending_writes() {
            self.close_pending = true;
        } else {
            self.do_close();
        }
        self.sync_timers(now);
        Ok(())
    }

    pub(super) fn do_close(&mut self) {
        self.local_closed = true;
        self.read_shut = true;
        self.discard_unread();
        self.transition(Input::AppClose);
    }

    /// Abortive close requested by the application (e.g. SO_LINGER with zero timeout): TCP
    /// reset plus PeerConnAbort (Fig. 23 path 1).
    ///
    /// Does nothing once the connection is closed or already aborting.
    pub fn abort(&mut self, now: Timestamp) {
        self.abort_with(AbortReason::ApplicationAbort, now, true);
    }

    /// The TCP connection was reset by the peer. Starts abnormal termination unless the peer
    /// already aborted.
    //= https://www.rfc-editor.org/rfc/rfc7609#section-4.8.2
    //# If an SMC-R peer receives a TCP RST for a given SMC-R connection, it also initiates
    //# SMC-R abnormal connection termination processing if it has not already been notified
    //# (via the PeerConnAbort indicator) that the partner is severing the connection.
    pub fn handle_tcp_reset(&mut self, now: Timestamp) {
        self.abort_with(AbortReason::TcpReset, now, false);
    }

    /// The peer presented this connection's peer RMBE for a new connection (§4.4.2): abort
    /// without any RDMA write or CDC, reset TCP, ignore local data, report a reset.
    //= https://www.rfc-editor.org/rfc/rfc7609#section-4.4.2
    //# The abort processing resets the TCP connection (if it is still active), but it must
    //# not attempt to perform any RDMA writes to this RMBE and must also ignore any data
    //# sitting in the local RMBE associated with the existing connection.
    pub fn handle_rmbe_conflict(&mut self, now: Timestamp) {
        if self.state == State::Closed {
            return;
        }
        // The common case is no error at all: we closed, the peer consumed every byte we
        // wrote, and its closing CDC is still on its way (over RDMA) while its next
        // rendezvous (over TCP) already reuses the RMBE. A peer that reassigns the RMBE is done
        // with the connection: it ends as a normal close, without a reset.
        if matches!(self.state, State::PeerCloseWait1 | State::PeerCloseWait2)
            && self.local_closed
            && self.peer_consumer_cursor() == self.producer_cursor()
        {
            self.stats.closed_by_rmbe_reuse += 1;
            self.purge();
            self.transition(Input::RmbeConflict);
            self.sync_timers(now);
            return;
        }
        self.stats.aborts.add(AbortReason::RmbeConflict);
        self.fail(AbortReason::RmbeConflict.app_error());
        self.events.push_back(Event::SendTcpReset);
        self.purge();
        self.abort_pending = false;
        self.transition(Input::RmbeConflict);
        self.sync_timers(now);
    }

    pub(super) fn fail(&mut self, e: ConnError) {
        if self.error.is_none() {
            self.error = Some(e);
            self.events.push_back(Event::Failed(e));
        }
    }

    pub(super) fn purge(&mut self) {
        self.send_backlog = 0;
        self.urgent = SendUrgent::None;
        self.cons_update_due = false;
        self.request_update = false;
        self.write_shut_pending = false;
        self.close_pending = false;
        self.urgent_mark = None;
    }

    /// Active abort (Fig. 23 path 1).
    pub(super) fn abort_with(&mut self, reason: AbortReason, now: Timestamp, send_rst: bool) {
        if matches!(
            self.state,
            State::Closed | State::PeerAbortWait | State::ProcessAbort
        ) {
            return;
        }
        self.stats.aborts.add(reason);
        self.fail(reason.app_error());
        //= https://www.rfc-editor.org/rfc/rfc7609#section-4.8.2
        //# When an SMC-R peer initiates a TCP connection reset, it also initiates an SMC-R
        //# abnormal connection flow at the same time.
        if send_rst {
            self.events.push_back(Event::SendTcpReset);
        }
        self.purge();
        //= https://www.rfc-editor.org/rfc/rfc7609#section-4.8.2
        //# Send the PeerConnAbort indicator to the partner in a CDC message, and then
        //# transition to the PeerAbortWait state.
        if !self.local_closed {
            self.abort_pending = true;
        }
        self.transition(Input::ActiveAbort);
        self.sync_timers(now);
    }

    /// Passive abort (Fig. 23 path 2).
    //= https://www.rfc-editor.org/rfc/rfc7609#section-4.8.2
    //# Using the appropriate error codes, indicate to the socket application that this
    //# connection has been aborted, and then purge all in-flight data for this connection
    //# that is waiting to be read or waiting to be sent.
    pub(super) fn passive_abort(&mut self, now: Timestamp) {
        self.stats.aborts.add(AbortReason::PeerAbort);
        self.fail(AbortReason::PeerAbort.app_error());
        self.purge();
        self.abort_pending = true;
        self.transition(Input::PeerConnAbort);
        self.sync_timers(now);
    }

    /// Fire every timer whose deadline is at or before `now`.
    pub fn handle_timeout(&mut self, now: Timestamp) {
        while let Some(kind) = self.timers.pop_expired(now) {
            match kind {
                ConnTimer::Flush => self.flush_due = true,
                //= https://www.rfc-editor.org/rfc/rfc7609#section-4.8.1
                //# When this timeout occurs, the local SMC-R peer performs TCP reset
                //# processing for this connection.  However, no additional RDMA writes to the
                //# partner RMBE can occur at this point
                ConnTimer::PeerCloseWait | ConnTimer::PeerFinCloseWait => {
                    self.stats.aborts.add(AbortReason::CloseTimeout);
                    self.fail(AbortReason::CloseTimeout.app_error());
                    self.events.push_back(Event::SendTcpReset);
                    self.purge();
                    self.transition(Input::CloseTimerExpired);
                }
                //= https://www.rfc-editor.org/rfc/rfc7609#section-4.8.2
                //# a timer can be set after entering the PeerAbortWait state, and if that
                //# timer pops before the peer has sent its local PeerConnAbort indicator (to
                //# the active abort side), this RMBE can be returned to the free pool
                ConnTimer::PeerAbortWait => {
                    self.transition(Input::AbortTimerExpired);
                }
                ConnTimer::FailoverValidation => {
                    if self.validation_pending.take().is_some() {
                        //= https://www.rfc-editor.org/rfc/rfc7609#section-4.6.1
                        //# If SR is less than the sequence number value in the validation
                        //# message, data has been lost, and the receiver must immediately
                        //# reset the TCP connection.
                        tracing::debug!("failover validation: SR never reached SS; resetting");
                        self.abort_with(AbortReason::FailoverDataLoss, now, true);
                    }
                }
            }
        }
        self.sync_timers(now);
    }
}
