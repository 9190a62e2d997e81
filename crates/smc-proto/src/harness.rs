//! Deterministic two-peer harness: two [`Connection`] engines, the RMBE memory of both, a fake
//! fabric carrying RDMA WRITEs and CDC SENDs (and a fake TCP carrying RSTs), and a virtual
//! clock that jumps to the next deadline.
//!
//! The harness plays the runtime: it asks an engine where to write, copies the application's
//! bytes into the peer's RMBE buffer (RDMA WRITE), reports them produced, carries each CDC
//! (SEND) to the other engine after a configurable delay, and copies received bytes out of the
//! local RMBE for the application. While doing so it checks, from its omniscient view, that no
//! write ever lands on bytes the receiving application has not consumed.
//!
//! Enabled by the `harness` cargo feature (always on for this crate's own tests), so that
//! link-group and reliability tests in other crates can reuse it.

use std::collections::VecDeque;
use std::time::Duration;

use smc_wire::CdcMessage;

use crate::conn::{Connection, ConnectionConfig, Event};
use crate::rmbe::{RmbeLayout, RmbeRing};
use crate::time::Timestamp;

/// One of the two peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Side {
    /// Host A.
    A,
    /// Host B.
    B,
}

impl Side {
    /// The other peer.
    pub fn other(self) -> Side {
        match self {
            Side::A => Side::B,
            Side::B => Side::A,
        }
    }
}

/// One simulated host: its engine, its RMBE memory and its application buffers.
#[derive(Debug)]
pub struct PeerSim {
    /// The engine under test.
    pub conn: Connection,
    /// Our RMBE; the other peer's RDMA WRITEs land here.
    pub rmbe: Vec<u8>,
    /// Application bytes not yet written to the peer.
    pub tx: VecDeque<u8>,
    /// Number of leading bytes of `tx` that end with an urgent byte (MSG_OOB), if any.
    pub tx_urgent_len: Option<usize>,
    /// Bytes the application read, in order.
    pub rx: Vec<u8>,
    /// Read everything as soon as it arrives (when driven by [`Pair::drive`]).
    pub auto_read: bool,
    /// Every event the engine reported, with its time.
    pub events: Vec<(Timestamp, Event)>,
    /// Total bytes written into the other peer's RMBE (omniscient bookkeeping).
    written_total: u64,
    /// Total bytes the application consumed from our RMBE.
    consumed_total: u64,
}

impl PeerSim {
    fn new(config: ConnectionConfig) -> PeerSim {
        let conn = Connection::new(config).unwrap_or_else(|e| panic!("bad harness config: {e}"));
        let mut rmbe = vec![0u8; config.local_rmbe_len as usize];
        config.layout.initialize(&mut rmbe);
        PeerSim {
            conn,
            rmbe,
            tx: VecDeque::new(),
            tx_urgent_len: None,
            rx: Vec::new(),
            auto_read: true,
            events: Vec::new(),
            written_total: 0,
            consumed_total: 0,
        }
    }

    /// The first 4 bytes of our RMBE (the eye catcher in RFC mode).
    pub fn rmbe_head(&self) -> [u8; 4] {
        let mut h = [0u8; 4];
        for (d, s) in h.iter_mut().zip(self.rmbe.iter()) {
            *d = *s;
        }
        h
    }

    /// Whether the engine reported `e`.
    pub fn saw(&self, e: Event) -> bool {
        self.events.iter().any(|(_, x)| *x == e)
    }

    /// Total bytes this peer wrote into the other's RMBE.
    pub fn written_total(&self) -> u64 {
        self.written_total
    }
}

/// What travels between the peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wire {
    /// A CDC message (IB SEND on the link).
    Cdc(CdcMessage),
    /// A TCP RST on the connection's TCP socket.
    TcpRst,
}

/// One message on its way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InFlight {
    /// Delivery time.
    pub at: Timestamp,
    /// Receiver.
    pub to: Side,
    /// The message.
    pub what: Wire,
}

/// A record of one message sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceEntry {
    /// When it was sent.
    pub at: Timestamp,
    /// Who sent it.
    pub from: Side,
    /// What.
    pub what: Wire,
}

/// Fault and timing knobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Knobs {
    /// Latency of every CDC and RST.
    pub delay: Duration,
    /// Drop every CDC sent by A (a dead link or a dead peer, seen from B).
    pub drop_from_a: bool,
    /// Drop every CDC sent by B.
    pub drop_from_b: bool,
    /// Deliver TCP RSTs (off: the TCP path is dead too).
    pub deliver_tcp_rst: bool,
    /// Largest number of steps [`Pair::drive`] may take before it declares a livelock.
    pub max_steps: usize,
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs {
            delay: Duration::from_micros(10),
            drop_from_a: false,
            drop_from_b: false,
            deliver_tcp_rst: true,
            max_steps: 100_000,
        }
    }
}

/// Two peers joined by a fake fabric and a virtual clock.
#[derive(Debug)]
pub struct Pair {
    /// Host A.
    pub a: PeerSim,
    /// Host B.
    pub b: PeerSim,
    /// The virtual clock.
    pub now: Timestamp,
    /// Faults and timing.
    pub knobs: Knobs,
    /// Messages in flight, in send order (the fabric is reliable and ordered per direction).
    pub wire: VecDeque<InFlight>,
    /// Every message sent.
    pub trace: Vec<TraceEntry>,
    /// Messages dropped by the knobs.
    pub dropped: usize,
}

/// Alert token of host A in [`Pair::symmetric`].
pub const TOKEN_A: u32 = 0x0A0A_0A0A;
/// Alert token of host B in [`Pair::symmetric`].
pub const TOKEN_B: u32 = 0x0B0B_0B0B;

impl Pair {
    /// Two peers with the given configurations (each one's tokens must mirror the other's).
    pub fn new(a: ConnectionConfig, b: ConnectionConfig) -> Pair {
        Pair {
            a: PeerSim::new(a),
            b: PeerSim::new(b),
            now: Timestamp::ZERO,
            knobs: Knobs::default(),
            wire: VecDeque::new(),
            trace: Vec::new(),
            dropped: 0,
        }
    }

    /// Two peers with RMBEs of `rmbe_len` bytes each in `layout`.
    pub fn symmetric(layout: RmbeLayout, rmbe_len: u32) -> Pair {
        let (a, b) = Self::configs(layout, rmbe_len);
        Pair::new(a, b)
    }

    /// The configurations [`Pair::symmetric`] uses, to adjust before [`Pair::new`].
    pub fn configs(layout: RmbeLayout, rmbe_len: u32) -> (ConnectionConfig, ConnectionConfig) {
        (
            ConnectionConfig::new(layout, rmbe_len, rmbe_len, TOKEN_A, TOKEN_B),
            ConnectionConfig::new(layout, rmbe_len, rmbe_len, TOKEN_B, TOKEN_A),
        )
    }

    /// One peer.
    pub fn peer(&self, side: Side) -> &PeerSim {
        match side {
            Side::A => &self.a,
            Side::B => &self.b,
        }
    }

    /// One peer, mutably.
    pub fn peer_mut(&mut self, side: Side) -> &mut PeerSim {
        match side {
            Side::A => &mut self.a,
            Side::B => &mut self.b,
        }
    }

    /// Both peers, the first being `side`.
    fn both_mut(&mut self, side: Side) -> (&mut PeerSim, &mut PeerSim) {
        match side {
            Side::A => (&mut self.a, &mut self.b),
            Side::B => (&mut self.b, &mut self.a),
        }
    }

    /// The application of `side` queues `data` for sending.
    pub fn app_send(&mut self, side: Side, data: &[u8]) {
        self.peer_mut(side).tx.extend(data.iter().copied());
    }

    /// The application of `side` sends `data` with MSG_OOB: its last byte is urgent. Any data
    /// queued before is sent first.
    pub fn app_send_urgent(&mut self, side: Side, data: &[u8]) {
        let p = self.peer_mut(side);
        assert!(p.tx_urgent_len.is_none(), "one urgent send at a time");
        p.tx.extend(data.iter().copied());
        p.tx_urgent_len = Some(p.tx.len());
    }

    /// Write as much of `side`'s queued data as the window allows (RDMA WRITEs), report it to
    /// the engine, and put the resulting CDCs on the wire. Returns the bytes written.
    pub fn pump(&mut self, side: Side) -> usize {
        let now = self.now;
        let (me, peer) = self.both_mut(side);
        let mut written = 0usize;
        loop {
            let regions = me.conn.write_regions();
            let urgent_left = me.tx_urgent_len;
            let want = urgent_left.unwrap_or(me.tx.len());
            let n = (regions.total() as usize).min(want);
            if n == 0 {
                break;
            }
            // Omniscient check: the write must not land on unconsumed bytes and must start
            // where the stream continues.
            let ring = RmbeRing::new(peer.conn.config().layout, peer.conn.config().local_rmbe_len)
                .unwrap_or_else(|e| panic!("{e}"));
            let cap = u64::from(ring.capacity());
            // The receiver consumes through its application or, after shutdown(RD)/close,
            // on the application's behalf.
            let st = peer.conn.stats();
            let in_use = me.written_total - (st.bytes_consumed + st.bytes_discarded);
            assert!(
                in_use + n as u64 <= cap,
                "write of {n} bytes past the window: {in_use} unconsumed of {cap}"
            );
            let expect_off = u64::from(ring.data_start()) + me.written_total % cap;
            assert_eq!(
                u64::from(regions.first.offset),
                expect_off,
                "write region does not continue the stream"
            );
            let regions = regions.truncate(n as u32);
            for r in regions.iter() {
                let dst = r.offset as usize..(r.offset + r.len) as usize;
                for (d, s) in peer.rmbe[dst].iter_mut().zip(me.tx.drain(..r.len as usize)) {
                    *d = s;
                }
            }
            me.written_total += n as u64;
            written += n;
            let res = match urgent_left {
                Some(u) if u == n => {
                    me.tx_urgent_len = None;
                    me.conn.produced_urgent(n as u32, now)
                }
                Some(u) => {
                    me.tx_urgent_len = Some(u - n);
                    me.conn.produced(n as u32, now)
                }
                None => me.conn.produced(n as u32, now),
            };
            if let Err(e) = res {
                panic!("engine refused a write inside its own window: {e}");
            }
        }
        let backlog = me.tx.len() as u64;
        if me.tx_urgent_len.is_some() {
            // Urgent data is queued but could not be written: announce it (P flag).
            let _ = me.conn.urgent_pending(now);
        }
        me.conn.set_send_backlog(backlog, now);
        self.flush(side);
        written
    }

    /// `side`'s application reads up to `max` bytes (checking the eye catcher first), then
    /// the resulting CDCs go on the wire. Returns the bytes read.
    pub fn read(&mut self, side: Side, max: usize) -> usize {
        let now = self.now;
        let me = self.peer_mut(side);
        let head = me.rmbe_head();
        let regions = match me.conn.read_regions(head, now) {
            Ok(r) => r.truncate(u32::try_from(max).unwrap_or(u32::MAX)),
            Err(_) => {
                self.flush(side);
                return 0;
            }
        };
        let mut n = 0usize;
        for r in regions.iter() {
            let src = r.offset as usize..(r.offset + r.len) as usize;
            me.rx.extend_from_slice(&me.rmbe[src]);
            n += r.len as usize;
        }
        if n > 0 {
            if let Err(e) = me.conn.consumed(n as u32, now) {
                panic!("engine refused a consume inside its own readable range: {e}");
            }
            me.consumed_total += n as u64;
        }
        self.flush(side);
        n
    }

    /// Drain `side`'s CDCs onto the wire and its events into its log; RST requests become a
    /// TCP RST on the wire.
    pub fn flush(&mut self, side: Side) {
        let at = self.now + self.knobs.delay;
        let now = self.now;
        loop {
            let p = self.peer_mut(side);
            let mut progressed = false;
            if let Some(msg) = p.conn.poll_transmit() {
                progressed = true;
                self.trace.push(TraceEntry {
                    at: now,
                    from: side,
                    what: Wire::Cdc(msg),
                });
                let drop = match side {
                    Side::A => self.knobs.drop_from_a,
                    Side::B => self.knobs.drop_from_b,
                };
                if drop {
                    self.dropped += 1;
                } else {
                    self.wire.push_back(InFlight {
                        at,
                        to: side.other(),
                        what: Wire::Cdc(msg),
                    });
                }
            }
            let p = self.peer_mut(side);
            if let Some(ev) = p.conn.poll_event() {
                progressed = true;
                p.events.push((now, ev));
                if ev == Event::SendTcpReset {
                    self.trace.push(TraceEntry {
                        at: now,
                        from: side,
                        what: Wire::TcpRst,
                    });
                    if self.knobs.deliver_tcp_rst {
                        self.wire.push_back(InFlight {
                            at,
                            to: side.other(),
                            what: Wire::TcpRst,
                        });
                    }
                }
            }
            if !progressed {
                break;
            }
        }
    }

    /// Run an application command on `side`'s engine at the current time, then put what it
    /// produced on the wire: `pair.act(Side::A, |c, now| c.close(now))`.
    pub fn act<R>(&mut self, side: Side, f: impl FnOnce(&mut Connection, Timestamp) -> R) -> R {
        let now = self.now;
        let r = f(&mut self.peer_mut(side).conn, now);
        self.flush(side);
        r
    }

    /// Hand `msg` to `to`'s engine now, as if it came from the fabric (for forged CDCs).
    pub fn inject(&mut self, to: Side, msg: CdcMessage) {
        let now = self.now;
        self.peer_mut(to).conn.handle_cdc(msg, now);
        self.flush(to);
    }

    /// The next time something happens: a delivery or a timer.
    pub fn next_deadline(&self) -> Option<Timestamp> {
        [
            self.wire.front().map(|m| m.at),
            self.a.conn.poll_timeout(),
            self.b.conn.poll_timeout(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Deliver the next message in flight (advancing the clock to its delivery time if
    /// needed), firing any timer due before it. Returns the message.
    pub fn deliver_next(&mut self) -> Option<InFlight> {
        let m = *self.wire.front()?;
        self.fire_timers_until(m.at);
        // A timer may have changed the wire; deliver whatever is first now.
        let m = self.wire.pop_front()?;
        self.now = self.now.max(m.at);
        let now = self.now;
        match m.what {
            Wire::Cdc(msg) => self.peer_mut(m.to).conn.handle_cdc(msg, now),
            Wire::TcpRst => self.peer_mut(m.to).conn.handle_tcp_reset(now),
        }
        self.flush(m.to);
        Some(m)
    }

    /// Deliver every message now in flight (and those they cause), without letting timers
    /// fire beyond the deliveries' times.
    pub fn deliver_all(&mut self) -> Vec<InFlight> {
        let mut out = Vec::new();
        let mut guard = 0usize;
        while let Some(m) = self.deliver_next() {
            out.push(m);
            guard += 1;
            assert!(guard <= self.knobs.max_steps, "livelock: CDC ping-pong");
        }
        out
    }

    /// Fire the timers of both peers that are due at or before `t`, in deadline order,
    /// advancing the clock to each.
    pub fn fire_timers_until(&mut self, t: Timestamp) {
        loop {
            let next = [
                (Side::A, self.a.conn.poll_timeout()),
                (Side::B, self.b.conn.poll_timeout()),
            ]
            .into_iter()
            .filter_map(|(s, d)| d.filter(|d| *d <= t).map(|d| (d, s)))
            .min_by_key(|(d, _)| *d);
            let Some((d, side)) = next else { break };
            self.now = self.now.max(d);
            let now = self.now;
            self.peer_mut(side).conn.handle_timeout(now);
            self.flush(side);
        }
    }

    /// Jump the clock to the next deadline and process it. Returns false when nothing is
    /// scheduled.
    pub fn step(&mut self) -> bool {
        match self.next_deadline() {
            None => false,
            Some(t) => {
                if self.wire.front().is_some_and(|m| m.at <= t) {
                    self.deliver_next();
                } else {
                    self.fire_timers_until(t);
                }
                true
            }
        }
    }

    /// Run both peers to quiescence: write queued data, auto-read, deliver, fire timers.
    /// Panics (livelock) if that takes more than `knobs.max_steps` steps.
    pub fn drive(&mut self) {
        self.drive_inner(true);
    }

    /// Like [`Pair::drive`] but never fires a timer whose deadline lies after the last
    /// delivery: the clock moves only as far as messages need.
    pub fn settle(&mut self) {
        self.drive_inner(false);
    }

    fn drive_inner(&mut self, timers: bool) {
        for step in 0.. {
            assert!(
                step <= self.knobs.max_steps,
                "livelock: no quiescence after {step} steps; last trace: {:?}",
                self.trace.iter().rev().take(6).collect::<Vec<_>>()
            );
            let mut progressed = false;
            for side in [Side::A, Side::B] {
                if !self.peer(side).tx.is_empty() && self.pump(side) > 0 {
                    progressed = true;
                }
                if self.peer(side).auto_read && self.read(side, usize::MAX) > 0 {
                    progressed = true;
                }
            }
            if progressed {
                continue;
            }
            if !self.wire.is_empty() {
                self.deliver_next();
                continue;
            }
            if timers && self.step() {
                continue;
            }
            break;
        }
    }
}
