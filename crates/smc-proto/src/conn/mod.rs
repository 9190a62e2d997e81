//! One SMC-R connection: cursors, windows, urgent data, close and abort (RFC 7609 §4.3–§4.8),
//! as a sans-IO state machine.
//!
//! See [`Connection`] for the API contract and the call order.

pub mod error;
pub mod state;
pub mod stats;

use std::collections::VecDeque;
use std::time::Duration;

use smc_wire::{CdcMessage, ConnStateFlags, Cursor, ProducerFlags};

use crate::rmbe::{CursorOrder, Regions, RmbeLayout, RmbeRing, RmbeTooSmall};
use crate::time::Timestamp;
use crate::timer::{TimerKind, TimerTable};

pub use error::{AbortReason, ApiError, ConnError};
pub use state::{GuardFacts, Input, State, Transition, TRANSITIONS};
pub use stats::{AbortCounts, ConnStats};

/// Coalescing of small sends (RFC 7609 §4.5.2), a Nagle-like option that is off by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Coalescing {
    /// Longest time a producer-cursor update is held back.
    pub delay: Duration,
    /// Unsignalled bytes at or above which the update is sent at once.
    pub min_bytes: u32,
    /// Hold an update only while bytes we announced before are not consumed by the peer
    /// (as far as its consumer cursor tells), as Nagle's algorithm holds small segments only
    /// while data is unacknowledged: a send after the peer caught up goes out at once.
    pub while_unconsumed: bool,
}

/// Parameters of one connection, fixed at rendezvous.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnectionConfig {
    /// RMBE layout of the link group (RFC eye catcher or Linux).
    pub layout: RmbeLayout,
    /// Length of our RMBE (the peer writes into it), eye catcher included.
    pub local_rmbe_len: u32,
    /// Length of the peer's RMBE (we write into it), eye catcher included.
    pub peer_rmbe_len: u32,
    /// Our alert token: the peer puts it in every CDC it sends us.
    pub local_alert_token: u32,
    /// The peer's alert token: we put it in every CDC we send.
    pub peer_alert_token: u32,
    /// TCP_NODELAY: never hold back a producer-cursor update for coalescing.
    pub nodelay: bool,
    /// Optional coalescing of small sends; ignored under `nodelay`.
    pub coalescing: Option<Coalescing>,
    /// Longest time TCP_CORK holds back an update (Linux TCP uses 200 ms).
    pub cork_ceiling: Duration,
    /// PeerCloseWait1/2 and PeerFinCloseWait timeout (anti-stranding, §4.8.1).
    pub close_timeout: Duration,
    /// PeerAbortWait timeout (§4.8.2).
    pub abort_timeout: Duration,
    /// How long a failover validation that found SR behind SS waits for SR to catch up
    /// before the connection is reset (see `handle_failover_validation`).
    pub validation_wait: Duration,
}

impl ConnectionConfig {
    /// A configuration with default timers, no coalescing and TCP_NODELAY off.
    pub fn new(
        layout: RmbeLayout,
        local_rmbe_len: u32,
        peer_rmbe_len: u32,
        local_alert_token: u32,
        peer_alert_token: u32,
    ) -> Self {
        ConnectionConfig {
            layout,
            local_rmbe_len,
            peer_rmbe_len,
            local_alert_token,
            peer_alert_token,
            nodelay: false,
            coalescing: None,
            cork_ceiling: Duration::from_millis(200),
            close_timeout: Duration::from_secs(30),
            abort_timeout: Duration::from_secs(30),
            validation_wait: Duration::from_secs(1),
        }
    }
}

/// The timers of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ConnTimer {
    /// Flush a producer-cursor update held back by TCP_CORK or coalescing (§4.5.2).
    Flush,
    /// Anti-stranding timer of PeerCloseWait1/PeerCloseWait2 (armed once we sent
    /// PeerConnectionClosed).
    PeerCloseWait,
    /// Anti-stranding timer of PeerFinCloseWait.
    PeerFinCloseWait,
    /// PeerAbortWait timer.
    PeerAbortWait,
    /// A failover validation waits for SR to reach SS.
    FailoverValidation,
}

impl TimerKind for ConnTimer {
    const ALL: &'static [Self] = &[
        ConnTimer::Flush,
        ConnTimer::PeerCloseWait,
        ConnTimer::PeerFinCloseWait,
        ConnTimer::PeerAbortWait,
        ConnTimer::FailoverValidation,
    ];
    fn index(self) -> usize {
        self as usize
    }
}

/// Something the application or the runtime must learn about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Event {
    /// New data arrived in our RMBE (queued only while
    /// [`set_readable_events`](Connection::set_readable_events) is on, as it is by default).
    Readable,
    /// Room opened in the peer's RMBE after the window was closed (or urgent data was
    /// acknowledged).
    Writable,
    /// The peer is done writing: after the readable data, reads return end of stream.
    ReadClosed,
    /// The peer has urgent data pending (P flag): signal exceptional condition (POLLPRI).
    UrgentPending,
    /// Urgent data is in our RMBE; `mark` is the position of the urgent byte.
    UrgentData {
        /// Position of the last urgent byte.
        mark: Cursor,
    },
    /// The connection changed state.
    StateChanged {
        /// Before.
        from: State,
        /// Cause.
        input: Input,
        /// After.
        to: State,
    },
    /// The runtime must reset the TCP connection (send a RST).
    SendTcpReset,
    /// The connection failed; socket calls now return this error.
    Failed(ConnError),
    /// The connection reached `Closed`: release the local RMBE to the pool and forget the
    /// connection.
    Closed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SendUrgent {
    None,
    /// The application has urgent data it could not write yet (P announced).
    Pending,
    /// Urgent data was written; the producer cursor `end` is one past the urgent byte. No more
    /// writes until the peer's consumer cursor reaches `end`. `next_pending`: the application
    /// has queued further urgent data meanwhile.
    InFlight {
        end: Cursor,
        next_pending: bool,
    },
}

/// Whether a consumer-cursor CDC is worth sending (RFC 7609 §4.5.1): the sender's window is
/// below half the buffer and the update grows it by at least 10% of the buffer.
//= https://www.rfc-editor.org/rfc/rfc7609#section-4.5.1
//# The current window size (from a sender's perspective) is less than half of the receive
//# buffer space, and the consumer cursor update will result in a minimum increase in the
//# window size of 10% of the receive buffer space.
pub fn window_update_needed(buffer: u32, sender_window: u32, receiver_window: u32) -> bool {
    let (b, s, r) = (
        u64::from(buffer),
        u64::from(sender_window),
        u64::from(receiver_window),
    );
    s * 2 < b && r.saturating_sub(s) * 10 >= b
}

/// One SMC-R connection between two RMBEs, after rendezvous.
///
/// # Contract
///
/// The engine owns no memory and performs no I/O. It holds the connection's cursors, flags,
/// state and timers, and tells its caller (the runtime, or the test harness) what to do:
///
/// * Inputs: [`handle_cdc`](Self::handle_cdc) for every CDC message received with this
///   connection's alert token, [`handle_timeout`](Self::handle_timeout) when
///   [`poll_timeout`](Self::poll_timeout) is reached, [`handle_tcp_reset`](Self::handle_tcp_reset)
///   and [`handle_rmbe_conflict`](Self::handle_rmbe_conflict); and the application commands
///   [`produced`](Self::produced), [`produced_urgent`](Self::produced_urgent),
///   [`urgent_pending`](Self::urgent_pending), [`set_send_backlog`](Self::set_send_backlog),
///   [`consumed`](Self::consumed), [`set_cork`](Self::set_cork),
///   [`shutdown_write`](Self::shutdown_write), [`shutdown_read`](Self::shutdown_read),
///   [`close`](Self::close), [`abort`](Self::abort).
/// * Outputs: [`poll_transmit`](Self::poll_transmit) (CDC messages to SEND, in order),
///   [`poll_event`](Self::poll_event) (application and runtime events),
///   [`poll_timeout`](Self::poll_timeout) (the next deadline).
///
/// After **every** input, drain `poll_transmit` until `None` and post each CDC on the link
/// (after the RDMA WRITEs that preceded it: a reliably connected QP keeps that order), drain
/// `poll_event`, and re-read `poll_timeout`.
///
/// Time is a [`Timestamp`] supplied by the caller; the engine never reads a clock.
///
/// # Sending
///
/// 1. [`write_regions`](Self::write_regions): the free part of the peer's RMBE, between our
///    producer cursor and the peer's consumer cursor, as up to two ranges (offsets within the
///    peer RMBE).
/// 2. The caller copies up to that many bytes there (RDMA WRITE), in order.
/// 3. [`produced(n)`](Self::produced) (or [`produced_urgent`](Self::produced_urgent) when the
///    last byte is urgent) moves the producer cursor; then
///    [`set_send_backlog`](Self::set_send_backlog) tells how many bytes the application still
///    holds that did not fit (this drives the writer-blocked flag and pending close).
/// 4. `poll_transmit` yields the CDC (unless held back by TCP_CORK or coalescing).
///
/// # Receiving
///
/// 1. `handle_cdc` validates and applies the peer's cursors and flags ([`Event::Readable`]).
/// 2. [`read_regions`](Self::read_regions), given the first 4 bytes of our RMBE (checked
///    against the eye catcher in RFC mode), yields the unread ranges of our RMBE.
/// 3. The caller copies out and calls [`consumed(n)`](Self::consumed); `poll_transmit` then
///    yields a consumer-cursor CDC if §4.5.1 asks for one.
///
/// # Termination
///
/// `shutdown_write`, `close`, `abort` and peer flags move the state along RFC 7609 Fig. 22
/// and Fig. 23 ([`TRANSITIONS`]). [`Event::Closed`] means the RMBE may be reused.
#[derive(Debug, Clone)]
pub struct Connection {
    config: ConnectionConfig,
    state: State,
    // Send direction: we write into the peer's RMBE.
    peer_ring: RmbeRing,
    prod: Cursor,
    prod_sent: Cursor,
    peer_cons: Cursor,
    send_backlog: u64,
    urgent: SendUrgent,
    cork: bool,
    nodelay: bool,
    flush_due: bool,
    request_update: bool,
    resend_due: bool,
    // Receive direction: the peer writes into our RMBE.
    local_ring: RmbeRing,
    cons: Cursor,
    cons_sent: Cursor,
    peer_prod: Cursor,
    peer_flags: ProducerFlags,
    peer_update_requested: bool,
    urgent_mark: Option<Cursor>,
    cons_update_due: bool,
    // CDC bookkeeping.
    next_seq: u16,
    last_rx_seq: Option<u16>,
    sent_prod_flags: ProducerFlags,
    sent_conn_flags: ConnStateFlags,
    // Termination.
    write_shut: bool,
    write_shut_pending: bool,
    read_shut: bool,
    local_closed: bool,
    close_pending: bool,
    peer_done: bool,
    peer_closed: bool,
    abort_pending: bool,
    error: Option<ConnError>,
    timers: TimerTable<ConnTimer, 5>,
    /// A failover validation's SS that SR has not reached yet.
    validation_pending: Option<u16>,
    events: VecDeque<Event>,
    /// Whether arriving data queues [`Event::Readable`].
    readable_events: bool,
    stats: ConnStats,
}

impl Connection {
    /// A connection whose rendezvous just completed (Fig. 22 transition 2: Closed → Active).
    pub fn new(config: ConnectionConfig) -> Result<Connection, RmbeTooSmall> {
        let local_ring = RmbeRing::new(config.layout, config.local_rmbe_len)?;
        let peer_ring = RmbeRing::new(config.layout, config.peer_rmbe_len)?;
        let mut c = Connection {
            config,
            state: State::Closed,
            peer_ring,
            prod: peer_ring.initial(),
            prod_sent: peer_ring.initial(),
            peer_cons: peer_ring.initial(),
            send_backlog: 0,
            urgent: SendUrgent::None,
            cork: false,
            nodelay: config.nodelay,
            flush_due: false,
            request_update: false,
            resend_due: false,
            local_ring,
            cons: local_ring.initial(),
            cons_sent: local_ring.initial(),
            peer_prod: local_ring.initial(),
            peer_flags: ProducerFlags::default(),
            peer_update_requested: false,
            urgent_mark: None,
            cons_update_due: false,
            //= https://www.rfc-editor.org/rfc/rfc7609#section-4.3
            //# This sequence number starts at 1, is increased each send, and wraps to 0.
            next_seq: 1,
            last_rx_seq: None,
            sent_prod_flags: ProducerFlags::default(),
            sent_conn_flags: ConnStateFlags::default(),
            write_shut: false,
            write_shut_pending: false,
            read_shut: false,
            local_closed: false,
            close_pending: false,
            peer_done: false,
            peer_closed: false,
            abort_pending: false,
            error: None,
            timers: TimerTable::new(),
            validation_pending: None,
            events: VecDeque::new(),
            readable_events: true,
            stats: ConnStats::default(),
        };
        c.transition(Input::RendezvousComplete);
        Ok(c)
    }

    // ----- Observation ---------------------------------------------------------------------

    /// The configuration.
    pub fn config(&self) -> &ConnectionConfig {
        &self.config
    }

    /// The current state.
    pub fn state(&self) -> State {
        self.state
    }

    /// The counters.
    pub fn stats(&self) -> ConnStats {
        self.stats
    }

    /// The error socket calls return, once the connection failed.
    pub fn error(&self) -> Option<ConnError> {
        self.error
    }

    /// Our producer cursor in the peer's RMBE (local copy, may be ahead of the last CDC).
    pub fn producer_cursor(&self) -> Cursor {
        self.prod
    }

    /// The producer cursor we last sent to the peer.
    pub fn producer_cursor_sent(&self) -> Cursor {
        self.prod_sent
    }

    /// The peer's consumer cursor in its RMBE, from its last CDC.
    pub fn peer_consumer_cursor(&self) -> Cursor {
        self.peer_cons
    }

    /// Our consumer cursor in our RMBE.
    pub fn consumer_cursor(&self) -> Cursor {
        self.cons
    }

    /// The consumer cursor we last sent to the peer.
    pub fn consumer_cursor_sent(&self) -> Cursor {
        self.cons_sent
    }

    /// The peer's producer cursor in our RMBE, from its last CDC.
    pub fn peer_producer_cursor(&self) -> Cursor {
        self.peer_prod
    }

    /// The producer flags of the peer's last CDC.
    pub fn peer_producer_flags(&self) -> ProducerFlags {
        self.peer_flags
    }

    /// Position of the urgent byte not yet consumed, if the peer sent urgent data.
    pub fn urgent_mark(&self) -> Option<Cursor> {
        self.urgent_mark
    }

    /// The earliest timer deadline; call [`handle_timeout`](Self::handle_timeout) then.
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        self.timers.next_deadline()
    }

    /// The deadline of one timer (diagnostics and tests).
    pub fn timer(&self, kind: ConnTimer) -> Option<Timestamp> {
        self.timers.get(kind)
    }

    // ----- Send path -----------------------------------------------------------------------

    fn can_write(&self) -> bool {
        self.error.is_none()
            && matches!(self.state, State::Active | State::AppCloseWait1)
            && !self.write_shut
            && !self.local_closed
            && !self.peer_closed
    }

    fn check_write(&self) -> Result<(), ApiError> {
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

    fn advance_producer(&mut self, n: u32) -> Result<(), ApiError> {
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

    fn has_pending_writes(&self) -> bool {
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

    fn after_send_change(&mut self, now: Timestamp) {
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
    fn holding(&self) -> bool {
        let holding = self.holding_decided();
        debug_assert_eq!(holding, self.holding_by_the_rules());
        holding
    }

    /// [`holding`](Self::holding), with the cursor arithmetic only where it decides.
    fn holding_decided(&self) -> bool {
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
    fn holding_by_the_rules(&self) -> bool {
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

    // ----- Receive path --------------------------------------------------------------------

    fn discarding(&self) -> bool {
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

    fn discard_unread(&mut self) {
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
    fn decide_consumer_update(&mut self) {
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
            let was_blocked = self.write_room() == 0;
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
            if was_blocked && self.write_room() > 0 {
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
    fn handle_failover_validation(&mut self, ss: u16, now: Timestamp) {
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
    fn closed_in_order(&self) -> bool {
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
    fn validate(&self, msg: &CdcMessage) -> Result<(u32, u32), AbortReason> {
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

    // ----- Termination ---------------------------------------------------------------------

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

    fn do_shutdown_write(&mut self) {
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

    fn do_close(&mut self) {
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

    fn fail(&mut self, e: ConnError) {
        if self.error.is_none() {
            self.error = Some(e);
            self.events.push_back(Event::Failed(e));
        }
    }

    fn purge(&mut self) {
        self.send_backlog = 0;
        self.urgent = SendUrgent::None;
        self.cons_update_due = false;
        self.request_update = false;
        self.write_shut_pending = false;
        self.close_pending = false;
        self.urgent_mark = None;
    }

    /// Active abort (Fig. 23 path 1).
    fn abort_with(&mut self, reason: AbortReason, now: Timestamp, send_rst: bool) {
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
    fn passive_abort(&mut self, now: Timestamp) {
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

    // ----- Outputs -------------------------------------------------------------------------

    fn state_sends_cdcs(&self) -> bool {
        !matches!(
            self.state,
            State::Closed | State::PeerAbortWait | State::ProcessAbort
        )
    }

    fn desired_flags(&self) -> (ProducerFlags, ConnStateFlags) {
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

    fn cdc_needed(&self) -> bool {
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
    fn cdc_needed_in_full(&self) -> bool {
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

    // ----- Internals -----------------------------------------------------------------------

    fn transition(&mut self, input: Input) {
        let facts = GuardFacts {
            local_closed: self.local_closed,
            peer_closed: self.peer_closed,
        };
        let Some(t) = state::next_state(self.state, input, facts) else {
            debug_assert!(
                false,
                "no transition from {:?} on {:?} ({:?})",
                self.state, input, facts
            );
            return;
        };
        let from = self.state;
        self.state = t.to;
        self.events.push_back(Event::StateChanged {
            from,
            input,
            to: t.to,
        });
        if t.to == State::Closed {
            self.timers.stop_all();
            self.events.push_back(Event::Closed);
        }
    }

    fn sync_timers(&mut self, now: Timestamp) {
        // Changed in place, and only where the wish differs from what is set: this runs after
        // every input of the data path.
        let want =
            |t: &mut TimerTable<ConnTimer, 5>, k: ConnTimer, on: bool, after: Duration| match (
                on,
                t.is_set(k),
            ) {
                (true, false) => t.set(k, now + after),
                (false, true) => t.stop(k),
                _ => {}
            };
        let flush_after = if self.cork {
            self.config.cork_ceiling
        } else {
            self.config.coalescing.map_or(Duration::ZERO, |c| c.delay)
        };
        let holding = self.holding();
        let close_wait = matches!(self.state, State::PeerCloseWait1 | State::PeerCloseWait2)
            && self.local_closed;
        let fin_close_wait = self.state == State::PeerFinCloseWait;
        let abort_wait = self.state == State::PeerAbortWait;
        let t = &mut self.timers;
        want(t, ConnTimer::Flush, holding, flush_after);
        want(
            t,
            ConnTimer::PeerCloseWait,
            close_wait,
            self.config.close_timeout,
        );
        want(
            t,
            ConnTimer::PeerFinCloseWait,
            fin_close_wait,
            self.config.close_timeout,
        );
        want(
            t,
            ConnTimer::PeerAbortWait,
            abort_wait,
            self.config.abort_timeout,
        );
    }
}

#[cfg(test)]
mod tests;
