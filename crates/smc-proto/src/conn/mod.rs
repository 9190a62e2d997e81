//! One SMC-R connection: cursors, windows, urgent data, close and abort (RFC 7609 §4.3–§4.8),
//! as a sans-IO state machine.
//!
//! See [`Connection`] for the API contract and the call order.

mod close;
pub mod error;
mod output;
mod recv;
mod send;
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

/// Whether a sender with `room` free bytes in the peer's RMBE of `size` bytes counts as
/// writable (POLLOUT, and [`Event::Writable`] when it becomes so), as Linux's `tcp_poll()`
/// reports a TCP socket (`sk_stream_is_writeable`: the free send space is at least half of
/// what is queued), the queue being what the peer has not consumed: at least a third of the
/// RMBE free. Reported for any room before, a program that polls and then writes its buffer
/// to a blocking socket (socat: 8 KiB) waited in that write with its own input unread: a
/// chain socat → stunnel4 (TLS) → stunnel4 → socat echo stopped with every RMBE full.
pub fn stream_writable(room: u32, size: u32) -> bool {
    room > 0 && u64::from(room) * 3 >= u64::from(size)
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
