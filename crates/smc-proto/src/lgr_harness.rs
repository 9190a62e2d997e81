//! Deterministic two-endpoint harness: two [`Endpoint`]s, a fake TCP pipe per connection, a
//! fake fabric with QPs carrying SENDs and RDMA WRITEs between the endpoints' RMB memory, a
//! virtual clock and a bounded drive loop, and a message trace for flow-by-flow assertions.
//!
//! The fabric is FIFO with a fixed delay: each posted operation is delivered (SEND →
//! [`Endpoint::handle_message`], RDMA WRITE → copied into the peer host's RMB memory after an
//! rkey and bounds check) and then completed on the sender ([`Endpoint::handle_completion`]).
//! [`EndpointPair::kill_link`] breaks a QP pair: what is still in flight on it is lost, every
//! outstanding work request completes in error on both sides, and both endpoints get
//! [`Endpoint::handle_link_failure`].
//!
//! Enabled by the `harness` feature (always on in this crate's tests).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::time::Duration;

use smc_wire::{ClcMessage, ControlMessage, Gid, LlcMessage, Mac, PeerId, QpMtu, U24};

use crate::endpoint::{
    Endpoint, EndpointConfig, EndpointEvent, RdmaWriteTarget, SendPath, TcpId, WriteOutcome,
};
use crate::fabric::{
    Device, DeviceId, FabricOp, LgrId, LinkId, LlcVersion, MrInfo, QpInfo, ResourceError,
    Resources, WrId,
};
use crate::harness::Side;
use crate::rmb_pool::RmbId;
use crate::time::Timestamp;

/// Seeded xorshift generator: the harness's only source of "randomness".
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// The fake fabric resources of one host: QP numbers, RMB memory and registrations.
#[derive(Debug)]
pub struct FakeResources {
    rng: Rng,
    next_qpn: u32,
    next_rkey: u32,
    next_vaddr: u64,
    /// QP number of each link.
    pub qps: BTreeMap<LinkId, QpInfo>,
    /// LLC version each link's QP was created for (its receive buffers).
    pub qp_llc: BTreeMap<LinkId, LlcVersion>,
    /// RMB memory by (group, RMB).
    pub memory: BTreeMap<(LgrId, RmbId), (u64, Vec<u8>)>,
    /// rkey → (group, RMB, link).
    pub mrs: BTreeMap<u32, (LgrId, RmbId, LinkId)>,
    /// Fail the next QP creations (resource exhaustion knob).
    pub fail_create_qp: usize,
    /// Fail one RMB registration after this many more succeed (resource exhaustion knob;
    /// `Some(1)`: an RMB of a two-link group is registered on the first link only).
    pub fail_register_rmb: Option<usize>,
    /// Fail this many `take_peer_rtoken` calls (a peer RMB that cannot be mapped), after
    /// `pass_take_peer_rtoken` more have succeeded.
    pub fail_take_peer_rtoken: usize,
    /// `take_peer_rtoken` calls that succeed before `fail_take_peer_rtoken` applies.
    pub pass_take_peer_rtoken: usize,
    /// [`Resources::port_for`] (several GIDs of one RNIC as devices): `None` keeps the
    /// default, every device speaks to every GID.
    pub port_for: Option<fn(DeviceId, Gid) -> Option<DeviceId>>,
    /// [`Resources::connectable`]: `false` as if the peer's ports were on another fabric
    /// (a shm fabric directory this host does not share).
    pub connectable: bool,
}

impl FakeResources {
    /// Resources whose identifiers come from `seed`; `base` separates the QPN/rkey spaces of
    /// the two hosts (for readability of traces only).
    pub fn new(seed: u64, base: u32) -> FakeResources {
        FakeResources {
            rng: Rng::new(seed),
            next_qpn: base + 8,
            next_rkey: base * 0x100 + 1,
            next_vaddr: u64::from(base) << 32,
            qps: BTreeMap::new(),
            memory: BTreeMap::new(),
            mrs: BTreeMap::new(),
            qp_llc: BTreeMap::new(),
            fail_create_qp: 0,
            fail_register_rmb: None,
            fail_take_peer_rtoken: 0,
            pass_take_peer_rtoken: 0,
            port_for: None,
            connectable: true,
        }
    }
}

impl Resources for FakeResources {
    fn create_qp(
        &mut self,
        link: LinkId,
        _device: DeviceId,
        llc: LlcVersion,
    ) -> Result<QpInfo, ResourceError> {
        if self.fail_create_qp > 0 {
            self.fail_create_qp -= 1;
            return Err(ResourceError("no QP"));
        }
        let qp = QpInfo {
            qpn: U24::truncate(self.next_qpn),
            psn: U24::truncate(self.rng.next_u64() as u32),
        };
        self.next_qpn += 1;
        self.qps.insert(link, qp);
        self.qp_llc.insert(link, llc);
        Ok(qp)
    }

    fn register_rmb(
        &mut self,
        lgr: LgrId,
        rmb: RmbId,
        len: u64,
        link: LinkId,
        _device: DeviceId,
    ) -> Result<MrInfo, ResourceError> {
        match self.fail_register_rmb {
            Some(0) => {
                self.fail_register_rmb = None;
                return Err(ResourceError("no memory"));
            }
            Some(n) => self.fail_register_rmb = Some(n - 1),
            None => {}
        }
        let next_vaddr = &mut self.next_vaddr;
        let (vaddr, _) = self.memory.entry((lgr, rmb)).or_insert_with(|| {
            let v = *next_vaddr;
            *next_vaddr += len + 0x1000;
            (v, vec![0u8; len as usize])
        });
        let rkey = self.next_rkey;
        self.next_rkey += 1;
        self.mrs.insert(rkey, (lgr, rmb, link));
        Ok(MrInfo {
            rkey,
            vaddr: *vaddr,
        })
    }

    fn random_u32(&mut self) -> u32 {
        self.rng.next_u64() as u32
    }

    fn take_peer_rtoken(&mut self, _link: LinkId, _rkey: u32) -> Result<(), ResourceError> {
        if self.pass_take_peer_rtoken > 0 {
            self.pass_take_peer_rtoken -= 1;
            return Ok(());
        }
        if self.fail_take_peer_rtoken > 0 {
            self.fail_take_peer_rtoken -= 1;
            return Err(ResourceError("no descriptor"));
        }
        Ok(())
    }

    fn connectable(&self, _device: DeviceId, _gid: Gid) -> bool {
        self.connectable
    }

    fn port_for(&self, device: DeviceId, gid: Gid) -> Option<DeviceId> {
        match self.port_for {
            Some(f) => f(device, gid),
            None => Some(device),
        }
    }
}

/// One simulated host.
#[derive(Debug)]
pub struct Host {
    /// The endpoint under test.
    pub ep: Endpoint,
    /// Its fabric resources and RMB memory.
    pub res: FakeResources,
    /// Our QPs: link → (our QPN, peer QPN once connected, alive).
    pub qps: BTreeMap<LinkId, (U24, Option<U24>, bool)>,
    /// Every event, with its time.
    pub events: Vec<(Timestamp, EndpointEvent)>,
    /// Application bytes waiting to be sent, per connection.
    pub tx: BTreeMap<TcpId, VecDeque<u8>>,
    /// Application bytes read, per connection.
    pub rx: BTreeMap<TcpId, Vec<u8>>,
    /// Read whatever arrives at once.
    pub auto_read: bool,
    /// Connections established over SMC-R.
    pub established: BTreeSet<TcpId>,
    /// Outstanding work requests: id → link.
    pub outstanding: BTreeMap<WrId, LinkId>,
    /// LLC messages posted in their version-2 form (type `0x2X`), and their bytes.
    pub llc_v2_sent: Vec<crate::fabric::SendMsg>,
    /// LLC messages posted in their version-1 form.
    pub llc_v1_sent: usize,
}

impl Host {
    fn new(config: EndpointConfig, seed: u64, base: u32) -> Host {
        Host {
            ep: Endpoint::new(config),
            res: FakeResources::new(seed, base),
            qps: BTreeMap::new(),
            events: Vec::new(),
            tx: BTreeMap::new(),
            rx: BTreeMap::new(),
            auto_read: true,
            established: BTreeSet::new(),
            outstanding: BTreeMap::new(),
            llc_v2_sent: Vec::new(),
            llc_v1_sent: 0,
        }
    }

    /// Whether an event matching `f` was reported.
    pub fn saw(&self, f: impl Fn(&EndpointEvent) -> bool) -> bool {
        self.events.iter().any(|(_, e)| f(e))
    }

    /// The link id of link number `num` in the only (or first) link group.
    pub fn link(&self, num: u8) -> Option<LinkId> {
        self.ep
            .link_groups()
            .next()
            .and_then(|g| g.links.get(&num))
            .map(|l| l.id)
    }
}

/// What travelled, for the trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Traced {
    /// A CLC message on a TCP connection.
    Clc(TcpId, ClcMessage),
    /// Bytes on a TCP connection that are not a CLC message.
    TcpData(TcpId, usize),
    /// A TCP reset.
    TcpRst(TcpId),
    /// An LLC message on a link (the sender's link id).
    Llc(LinkId, LlcMessage),
    /// A CDC message on a link.
    Cdc(LinkId, smc_wire::CdcMessage),
    /// An RDMA WRITE of this many bytes.
    Write(LinkId, usize),
}

/// One trace entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceEntry {
    /// Post time.
    pub at: Timestamp,
    /// Sender.
    pub from: Side,
    /// What.
    pub what: Traced,
    /// Lost (dropped by a knob or on a killed link).
    pub lost: bool,
}

impl fmt::Display for TraceEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dir = match self.from {
            Side::A => "A->B",
            Side::B => "B->A",
        };
        write!(f, "{dir} {}", describe(&self.what))?;
        if self.lost {
            write!(f, " (lost)")?;
        }
        Ok(())
    }
}

/// A short description of a traced message, as the RFC figures name them.
pub fn describe(t: &Traced) -> String {
    match t {
        Traced::Clc(_, m) => match m {
            ClcMessage::Proposal(_) => "SMC Proposal".into(),
            ClcMessage::Accept(a) if a.first_contact => "SMC Accept(first contact)".into(),
            ClcMessage::Accept(_) => "SMC Accept".into(),
            ClcMessage::Confirm(_) => "SMC Confirm".into(),
            ClcMessage::Decline(d) => format!(
                "SMC Decline({:#010x}{})",
                d.diagnosis.0,
                if d.out_of_sync { ", S" } else { "" }
            ),
        },
        Traced::TcpData(_, n) => format!("TCP data {n}"),
        Traced::TcpRst(_) => "TCP RST".into(),
        Traced::Llc(_, m) => {
            let kind = match m {
                LlcMessage::ConfirmLink(c) => format!("CONFIRM LINK link={}", c.link_num),
                LlcMessage::AddLink(a) if a.rejected => {
                    format!(
                        "ADD LINK link={} rejected({})",
                        a.link_num, a.reject_reason.0
                    )
                }
                LlcMessage::AddLink(a) => format!("ADD LINK link={}", a.link_num),
                LlcMessage::AddLinkCont(c) => format!(
                    "ADD LINK CONTINUATION link={} pairs={}",
                    c.link_num,
                    c.valid_pairs().len()
                ),
                LlcMessage::DeleteLink(d) if d.all => "DELETE LINK all".into(),
                LlcMessage::DeleteLink(d) => format!("DELETE LINK link={}", d.link_num),
                LlcMessage::ConfirmRkey(c) if c.negative => "CONFIRM RKEY negative".into(),
                LlcMessage::ConfirmRkey(c) => format!("CONFIRM RKEY others={}", c.num_tokens),
                LlcMessage::ConfirmRkeyCont(_) => "CONFIRM RKEY CONTINUATION".into(),
                LlcMessage::DeleteRkey(d) if d.negative => "DELETE RKEY negative".into(),
                LlcMessage::DeleteRkey(d) => format!("DELETE RKEY count={}", d.count),
                LlcMessage::TestLink(_) => "TEST LINK".into(),
                LlcMessage::Optional { msg_type, .. } => format!("LLC optional {msg_type:#x}"),
            };
            if m.is_reply() {
                format!("{kind} rsp")
            } else {
                kind
            }
        }
        Traced::Cdc(_, c) if c.prod_flags.failover_validation => {
            format!("CDC failover validation seq={}", c.seqno)
        }
        Traced::Cdc(_, c) => format!("CDC seq={}", c.seqno),
        Traced::Write(_, n) => format!("RDMA WRITE {n}"),
    }
}

#[derive(Debug, Clone)]
enum Item {
    Tcp {
        to: Side,
        tcp: TcpId,
        bytes: Vec<u8>,
    },
    Rst {
        to: Side,
        tcp: TcpId,
    },
    Send {
        from: Side,
        link: LinkId,
        wr: WrId,
        msg: crate::fabric::SendMsg,
    },
    Write {
        from: Side,
        link: LinkId,
        wr: WrId,
        rkey: u32,
        addr: u64,
        data: Vec<u8>,
    },
    Completion {
        side: Side,
        wr: WrId,
        ok: bool,
    },
    LinkFailure {
        side: Side,
        link: LinkId,
    },
}

/// A decision of the drop knob.
pub type DropFn = Box<dyn FnMut(&TraceEntry) -> bool>;

/// Knobs of the harness.
pub struct Knobs {
    /// One-way delay of every TCP segment and fabric operation.
    pub delay: Duration,
    /// Extra delay of work completions (after delivery), so that replies can overtake them.
    pub completion_delay: Duration,
    /// Lose the messages for which this returns true (TCP bytes, SENDs, WRITEs).
    pub drop: Option<DropFn>,
    /// Messages lost by `drop` complete successfully on the sender (the RNIC acknowledged
    /// them, App. C.7's "sender thinks the send succeeded") instead of in error.
    pub silent_drop: bool,
    /// Carry a TCP RST to the peer when an endpoint resets a connection.
    pub deliver_tcp_rst: bool,
    /// Bound of the drive loop; exceeding it is a livelock and panics.
    pub max_steps: usize,
    /// The application sends with [`Endpoint::send_with`] and the fabric executes each RDMA
    /// WRITE at post, as the shm fabric does: a WRITE on a live link lands in the peer's
    /// memory at once (no replay copy is kept, no completion), every fifth only queues (lands
    /// one delay later, like the classic path, and is kept for replay), and one on a dead
    /// link or lost by the `drop` knob fails (not taken, completes in error).
    pub direct_writes: bool,
    /// With `direct_writes`: every WRITE on a live link only queues, as on the roce fabric
    /// (none is placed at post), posted from its piece's shared bytes, which the engine keeps
    /// for replay in place of a copy.
    pub all_posted: bool,
    /// An RDMA WRITE with an unknown rkey or outside the registered RMB panics (an engine
    /// bug when both peers are honest). When false it completes in error instead, as a real
    /// RNIC reports a remote access error: for tests and fuzzing that forge peer input.
    pub strict_writes: bool,
}

impl fmt::Debug for Knobs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Knobs")
            .field("delay", &self.delay)
            .field("completion_delay", &self.completion_delay)
            .field("drop", &self.drop.is_some())
            .field("silent_drop", &self.silent_drop)
            .field("deliver_tcp_rst", &self.deliver_tcp_rst)
            .field("max_steps", &self.max_steps)
            .field("direct_writes", &self.direct_writes)
            .field("all_posted", &self.all_posted)
            .field("strict_writes", &self.strict_writes)
            .finish()
    }
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs {
            delay: Duration::from_micros(10),
            completion_delay: Duration::ZERO,
            drop: None,
            silent_drop: false,
            deliver_tcp_rst: true,
            max_steps: 200_000,
            direct_writes: false,
            all_posted: false,
            strict_writes: true,
        }
    }
}

/// Two endpoints joined by fake TCP and a fake fabric. Side A is the client of the
/// connections opened with [`connect`](Self::connect), side B the server.
#[derive(Debug)]
pub struct EndpointPair {
    /// Host A.
    pub a: Host,
    /// Host B.
    pub b: Host,
    /// Virtual time.
    pub now: Timestamp,
    /// Knobs.
    pub knobs: Knobs,
    queue: VecDeque<(Timestamp, Item)>,
    /// Everything sent, in order.
    pub trace: Vec<TraceEntry>,
    /// Links killed by the test (both sides' ids).
    pub dead: BTreeSet<(Side, LinkId)>,
    /// Steps taken.
    pub steps: usize,
    /// WRITEs only posted so far (with `Knobs::all_posted`, every other one is packed).
    posted_writes: u64,
}

/// A device on side `s` number `i`: distinct GIDs and MACs per side and device.
pub fn device(s: Side, i: u8) -> Device {
    let sb = match s {
        Side::A => 0xA0,
        Side::B => 0xB0,
    };
    let mut gid = [0u8; 16];
    gid[0] = 0xfe;
    gid[1] = 0x80;
    gid[14] = sb;
    gid[15] = i + 1;
    Device {
        gid: Gid(gid),
        mac: Mac([0x02, 0, 0, 0, sb, i + 1]),
        mtu: QpMtu::MTU_1024,
        roce_v2: true,
    }
}

/// A configuration for side `s` with `devices` RNICs on the 10.0.0.0/24 subnet.
pub fn config(s: Side, devices: u8) -> EndpointConfig {
    let peer_id = PeerId {
        instance: match s {
            Side::A => 0x0A0A,
            Side::B => 0x0B0B,
        },
        mac: device(s, 0).mac,
    };
    let mut c = EndpointConfig::new(peer_id, (0..devices).map(|i| device(s, i)).collect());
    c.ipv4_subnets = vec![(std::net::Ipv4Addr::new(10, 0, 0, 0), 24)];
    c
}

impl EndpointPair {
    /// Two endpoints with the given configurations and a seed for their random identifiers.
    pub fn new(a: EndpointConfig, b: EndpointConfig, seed: u64) -> EndpointPair {
        EndpointPair {
            a: Host::new(a, seed, 0x100),
            b: Host::new(b, seed ^ 0x5555, 0x200),
            now: Timestamp::ZERO,
            knobs: Knobs::default(),
            queue: VecDeque::new(),
            trace: Vec::new(),
            dead: BTreeSet::new(),
            steps: 0,
            posted_writes: 0,
        }
    }

    /// Two endpoints with `a_devs` and `b_devs` RNICs each.
    pub fn with_devices(a_devs: u8, b_devs: u8) -> EndpointPair {
        Self::new(config(Side::A, a_devs), config(Side::B, b_devs), 1)
    }

    /// One host.
    pub fn host(&self, s: Side) -> &Host {
        match s {
            Side::A => &self.a,
            Side::B => &self.b,
        }
    }

    /// One host, mutable.
    pub fn host_mut(&mut self, s: Side) -> &mut Host {
        match s {
            Side::A => &mut self.a,
            Side::B => &mut self.b,
        }
    }

    /// Open TCP connection `tcp` from A (client) to B (server), both having negotiated the
    /// SMC-R option, and start the CLC handshake.
    pub fn connect(&mut self, tcp: TcpId) {
        let now = self.now;
        self.b.ep.accept(tcp, now).expect("accept");
        self.a.ep.connect(tcp, now).expect("connect");
        self.flush();
    }

    /// [`connect`](Self::connect) with per-connection options on each side.
    pub fn connect_with(
        &mut self,
        tcp: TcpId,
        client: crate::endpoint::ConnectOptions,
        server: crate::endpoint::ConnectOptions,
    ) {
        let now = self.now;
        self.b.ep.accept_with(tcp, server, now).expect("accept");
        self.a.ep.connect_with(tcp, client, now).expect("connect");
        self.flush();
    }

    /// Run `f` on one endpoint with its resources, then collect its outputs.
    pub fn act<R>(
        &mut self,
        s: Side,
        f: impl FnOnce(&mut Endpoint, &mut FakeResources, Timestamp) -> R,
    ) -> R {
        let now = self.now;
        let h = self.host_mut(s);
        let r = f(&mut h.ep, &mut h.res, now);
        self.flush();
        r
    }

    /// Queue application bytes on `tcp` at side `s`.
    pub fn app_send(&mut self, s: Side, tcp: TcpId, data: &[u8]) {
        self.host_mut(s)
            .tx
            .entry(tcp)
            .or_default()
            .extend(data.iter().copied());
        self.flush();
    }

    /// Inject raw TCP bytes to side `to` (as if the peer sent them).
    pub fn inject_tcp(&mut self, to: Side, tcp: TcpId, bytes: Vec<u8>) {
        let at = self.now + self.knobs.delay;
        self.push((at, Item::Tcp { to, tcp, bytes }));
    }

    /// Inject an LLC message to side `to`, as if it arrived on that side's link `link`.
    pub fn inject_llc(&mut self, to: Side, link: LinkId, msg: LlcMessage) {
        let now = self.now;
        let h = self.host_mut(to);
        h.ep.handle_message(link, &msg.to_bytes(), &mut h.res, now);
        self.flush();
    }

    /// Collect every output of both endpoints and run the applications.
    pub fn flush(&mut self) {
        for _ in 0..64 {
            let mut progress = false;
            for s in [Side::A, Side::B] {
                progress |= self.collect(s);
                progress |= self.run_app(s);
            }
            if !progress {
                break;
            }
        }
    }

    fn collect(&mut self, s: Side) -> bool {
        let mut progress = false;
        let now = self.now;
        let delay = self.knobs.delay;
        let deliver_rst = self.knobs.deliver_tcp_rst;
        loop {
            let h = self.host_mut(s);
            let Some((tcp, bytes)) = h.ep.poll_tcp_transmit() else {
                break;
            };
            progress = true;
            let what = match ClcMessage::parse(&bytes) {
                Ok((m, _)) => Traced::Clc(tcp, m),
                Err(_) => Traced::TcpData(tcp, bytes.len()),
            };
            if self.record(s, what) {
                self.push((
                    now + delay,
                    Item::Tcp {
                        to: s.other(),
                        tcp,
                        bytes,
                    },
                ));
            }
        }
        loop {
            let h = self.host_mut(s);
            let Some(op) = h.ep.poll_fabric() else {
                break;
            };
            progress = true;
            self.fabric_op(s, op);
        }
        loop {
            let h = self.host_mut(s);
            let Some(e) = h.ep.poll_event() else {
                break;
            };
            progress = true;
            match &e {
                EndpointEvent::Established { tcp, .. } => {
                    h.established.insert(*tcp);
                }
                EndpointEvent::Reset { tcp, .. }
                | EndpointEvent::Conn {
                    tcp,
                    event: crate::conn::Event::SendTcpReset,
                } if deliver_rst => {
                    h.established.remove(tcp);
                    let tcp = *tcp;
                    self.record(s, Traced::TcpRst(tcp));
                    self.push((now + delay, Item::Rst { to: s.other(), tcp }));
                }
                EndpointEvent::Reset { tcp, .. } => {
                    h.established.remove(tcp);
                }
                EndpointEvent::Conn {
                    tcp,
                    event: crate::conn::Event::Closed,
                } => {
                    h.established.remove(tcp);
                }
                _ => {}
            }
            let h = self.host_mut(s);
            h.events.push((now, e));
        }
        progress
    }

    /// Record a trace entry; returns false if the drop knob loses it.
    fn record(&mut self, from: Side, what: Traced) -> bool {
        let mut e = TraceEntry {
            at: self.now,
            from,
            what,
            lost: false,
        };
        if let Some(d) = self.knobs.drop.as_mut() {
            e.lost = d(&e);
        }
        let keep = !e.lost;
        self.trace.push(e);
        keep
    }

    fn fabric_op(&mut self, s: Side, op: FabricOp) {
        let at = self.now + self.knobs.delay;
        match op {
            FabricOp::ConnectQp { link, remote, .. } => {
                let now = self.now;
                let h = self.host_mut(s);
                let qpn = h.res.qps.get(&link).map(|q| q.qpn).unwrap_or_default();
                h.qps.insert(link, (qpn, Some(remote.qpn), true));
                // The driver's part: report the QP connected (a server's first link sends its
                // CONFIRM LINK then).
                h.ep.link_connected(link, &mut h.res, now);
            }
            FabricOp::PostSend { link, wr, msg } => {
                let what = if smc_wire::llc_v2::is_v2_type(msg[0]) {
                    self.host_mut(s).llc_v2_sent.push(msg.clone());
                    match smc_wire::llc_v2::LlcV2Message::parse(&msg)
                        .ok()
                        .and_then(crate::endpoint::llc_view_of_v2)
                    {
                        Some(m) => Traced::Llc(link, m),
                        None => Traced::Write(link, 0),
                    }
                } else {
                    match ControlMessage::parse(&msg) {
                        Ok(ControlMessage::Cdc(c)) => Traced::Cdc(link, c),
                        Ok(ControlMessage::Llc(m)) => {
                            self.host_mut(s).llc_v1_sent += 1;
                            Traced::Llc(link, m)
                        }
                        Err(_) => Traced::Write(link, 0),
                    }
                };
                self.host_mut(s).outstanding.insert(wr, link);
                let dead = self.dead.contains(&(s, link));
                if dead || !self.record(s, what) {
                    // Lost: the sender learns only by the completion error (unless the loss
                    // is silent).
                    let ok = !dead && self.knobs.silent_drop;
                    self.push((at, Item::Completion { side: s, wr, ok }));
                    return;
                }
                self.push((
                    at,
                    Item::Send {
                        from: s,
                        link,
                        wr,
                        msg,
                    },
                ));
            }
            FabricOp::RdmaWrite {
                link,
                wr,
                rkey,
                addr,
                data,
            } => {
                self.host_mut(s).outstanding.insert(wr, link);
                if self.dead.contains(&(s, link))
                    || !self.record(s, Traced::Write(link, data.len()))
                {
                    self.push((
                        at,
                        Item::Completion {
                            side: s,
                            wr,
                            ok: false,
                        },
                    ));
                    return;
                }
                self.push((
                    at,
                    Item::Write {
                        from: s,
                        link,
                        wr,
                        rkey,
                        addr,
                        data,
                    },
                ));
            }
            FabricOp::DestroyQp { link } => {
                let h = self.host_mut(s);
                if let Some(q) = h.qps.get_mut(&link) {
                    q.2 = false;
                }
            }
            FabricOp::FreeRmb { lgr, rmb } => {
                let h = self.host_mut(s);
                h.res.memory.remove(&(lgr, rmb));
                h.res.mrs.retain(|_, v| !(v.0 == lgr && v.1 == rmb));
            }
        }
    }

    /// Queue an item in time order (FIFO among equal times).
    fn push(&mut self, entry: (Timestamp, Item)) {
        let at = entry.0;
        let idx = self
            .queue
            .iter()
            .position(|(t, _)| *t > at)
            .unwrap_or(self.queue.len());
        self.queue.insert(idx, entry);
    }

    /// The peer side's link connected to our `link`, if both QPs are alive and connected to
    /// each other.
    fn peer_link(&self, s: Side, link: LinkId) -> Option<LinkId> {
        let (qpn, remote, alive) = *self.host(s).qps.get(&link)?;
        if !alive || self.dead.contains(&(s, link)) {
            return None;
        }
        let remote = remote?;
        let peer = self.host(s.other());
        peer.qps
            .iter()
            .find(|(_, (q, r, alive))| *q == remote && *r == Some(qpn) && *alive)
            .map(|(l, _)| *l)
            .filter(|l| !self.dead.contains(&(s.other(), *l)))
    }

    /// Send side `s`'s queued bytes of `tcp` with [`Endpoint::send_with`], executing WRITEs
    /// at post (see [`Knobs::direct_writes`]). Returns whether bytes were taken.
    fn send_direct(&mut self, s: Side, tcp: TcpId) -> bool {
        let now = self.now;
        let at = now + self.knobs.delay;
        let data: Vec<u8> = match self.host(s).tx.get(&tcp) {
            Some(q) if !q.is_empty() => q.iter().copied().collect(),
            _ => return false,
        };
        let alive: BTreeMap<LinkId, bool> = self
            .host(s)
            .qps
            .keys()
            .map(|l| (*l, self.peer_link(s, *l).is_some()))
            .collect();
        let mut drop = self.knobs.drop.take();
        let all_posted = self.knobs.all_posted;
        let mut posted_writes = self.posted_writes;
        let posts = &mut posted_writes;
        let mut traced = Vec::new();
        // (rkey, addr, bytes) executed at post; work requests that failed.
        let mut placed = Vec::new();
        let mut failed = Vec::new();
        let mut posted = Vec::new();
        // CDCs the engine posted at once (see `DirectCdcs`).
        let mut cdcs = Vec::new();
        let h = self.host_mut(s);
        // Where the engine says the WRITEs go, asked before: `send_with` must write there.
        let plan =
            h.ep.write_plan(tcp, u32::try_from(data.len()).unwrap_or(u32::MAX));
        let mut seen: Vec<(RdmaWriteTarget, usize)> = Vec::new();
        let write = |t: RdmaWriteTarget, wp: &mut crate::endpoint::WritePiece<'_>| {
            let piece = wp.bytes();
            seen.push((t, piece.len()));
            if !alive.get(&t.link).copied().unwrap_or(false) {
                h.outstanding.insert(t.wr, t.link);
                traced.push(TraceEntry {
                    at: now,
                    from: s,
                    what: Traced::Write(t.link, piece.len()),
                    lost: true,
                });
                failed.push(t.wr);
                return WriteOutcome::Failed;
            }
            let mut e = TraceEntry {
                at: now,
                from: s,
                what: Traced::Write(t.link, piece.len()),
                lost: false,
            };
            if let Some(d) = drop.as_mut() {
                e.lost = d(&e);
            }
            let lost = e.lost;
            traced.push(e);
            if lost {
                // The WRITE failed (on shm a WRITE is executed at post or fails its QP).
                h.outstanding.insert(t.wr, t.link);
                failed.push(t.wr);
                WriteOutcome::Failed
            } else if all_posted || t.wr.0.is_multiple_of(5) {
                // Now and then a WRITE queues behind earlier work (as on shm when the peer's
                // ring is full, and every WRITE on roce): only posted, it lands later and its
                // bytes are kept for replay. Posted from the piece's shared bytes, as the
                // roce path posts them: the replay then keeps that buffer, not a copy.
                // With `all_posted`, every other WRITE as a fabric's packed WRITE instead
                // (software RoCE's packets laid end to end): the replay then keeps that
                // buffer, whose pieces lie between other bytes.
                *posts += 1;
                if all_posted && posts.is_multiple_of(2) {
                    assert!(
                        wp.keep(packed(piece)),
                        "a packed buffer of the piece's bytes"
                    );
                    posted.push((t.link, t.wr, t.rkey, t.addr, piece.to_vec()));
                } else {
                    posted.push((t.link, t.wr, t.rkey, t.addr, wp.shared().to_vec()));
                }
                WriteOutcome::Posted
            } else {
                // Widened as a runtime may (`RdmaWriteTarget::room`): up to 64 bytes the peer is
                // never told about follow the piece. Were `room` to reach into bytes the peer
                // has not consumed, the stream checks would see them.
                assert!(
                    t.room as usize >= piece.len(),
                    "room shorter than the piece"
                );
                let mut bytes = piece.to_vec();
                bytes.resize(piece.len() + (t.room as usize - piece.len()).min(64), 0xEE);
                placed.push((t.rkey, t.addr, bytes));
                WriteOutcome::Placed
            }
        };
        let r = h.ep.send_with(
            tcp,
            &data,
            now,
            DirectCdcs {
                write,
                cdcs: &mut cdcs,
            },
        );
        match plan {
            Some(p) => {
                for ((t, len), (addr, plen)) in seen.iter().zip(p.pieces) {
                    assert_eq!(
                        (t.link, t.rkey, t.addr, *len as u64),
                        (p.link, p.rkey, addr, u64::from(plen)),
                        "a WRITE of send_with differs from write_plan"
                    );
                }
                assert!(seen.len() <= p.pieces.iter().filter(|(_, l)| *l > 0).count());
            }
            None => assert!(
                seen.is_empty(),
                "send_with wrote where write_plan saw no room"
            ),
        }
        self.knobs.drop = drop;
        self.trace.extend(traced);
        self.posted_writes = posted_writes;
        let peer = self.host_mut(s.other());
        for (rkey, addr, bytes) in &placed {
            let (lgr, rmb, _) = *peer
                .res
                .mrs
                .get(rkey)
                .expect("RDMA WRITE with an unknown rkey");
            let (vaddr, mem) = peer.res.memory.get_mut(&(lgr, rmb)).expect("RMB memory");
            let off = addr.checked_sub(*vaddr).expect("address below the RMB") as usize;
            assert!(off + bytes.len() <= mem.len(), "RDMA WRITE past the RMB");
            mem[off..off + bytes.len()].copy_from_slice(bytes);
        }
        for (link, wr, rkey, addr, data) in posted {
            self.push((
                at,
                Item::Write {
                    from: s,
                    link,
                    wr,
                    rkey,
                    addr,
                    data,
                },
            ));
        }
        // Posted after the WRITEs, as the engine did.
        for (link, wr, msg) in cdcs {
            self.fabric_op(
                s,
                FabricOp::PostSend {
                    link,
                    wr,
                    msg: msg.into(),
                },
            );
        }
        // Executed WRITEs are unsignaled: no completion.
        for wr in failed {
            self.push((
                at,
                Item::Completion {
                    side: s,
                    wr,
                    ok: false,
                },
            ));
        }
        match r {
            Ok(n) if n > 0 => {
                if let Some(q) = self.host_mut(s).tx.get_mut(&tcp) {
                    q.drain(..n);
                }
                true
            }
            _ => false,
        }
    }

    fn run_app(&mut self, s: Side) -> bool {
        let now = self.now;
        let mut progress = false;
        let h = self.host_mut(s);
        let conns: Vec<TcpId> = h.established.iter().copied().collect();
        for tcp in conns {
            if self.knobs.direct_writes {
                progress |= self.send_direct(s, tcp);
            } else {
                let h = self.host_mut(s);
                if let Some(q) = h.tx.get_mut(&tcp) {
                    if !q.is_empty() {
                        let data: Vec<u8> = q.iter().copied().collect();
                        if let Ok(n) = h.ep.send(tcp, &data, now) {
                            if n > 0 {
                                q.drain(..n);
                                progress = true;
                            }
                        }
                    }
                }
            }
            let h = self.host_mut(s);
            if h.auto_read {
                if let Ok(t) = h.ep.read_target(tcp, now) {
                    let total = t.regions.total();
                    if total > 0 {
                        let mut got = Vec::new();
                        if let Some((_, mem)) = h.res.memory.get(&(t.lgr, t.rmb)) {
                            for r in t.regions.iter() {
                                let start = t.element_offset as usize + r.offset as usize;
                                got.extend_from_slice(&mem[start..start + r.len as usize]);
                            }
                        }
                        h.rx.entry(tcp).or_default().extend(got);
                        let _ = h.ep.consumed(tcp, total, now);
                        progress = true;
                    }
                }
            }
        }
        progress
    }

    /// Deliver in-flight items in order until the next one is TCP bytes to side `to` that
    /// start with a CLC message of type `ty`; that one stays in flight (returned: its bytes).
    pub fn hold_clc_to(&mut self, to: Side, ty: smc_wire::ClcType) -> Option<Vec<u8>> {
        loop {
            if let Some((_, Item::Tcp { to: t, bytes, .. })) = self.queue.front() {
                let is = smc_wire::clc::ClcHeader::parse(bytes).is_ok_and(|h| h.msg_type == ty);
                if *t == to && is {
                    return Some(bytes.clone());
                }
            }
            if !self.deliver_next() {
                return None;
            }
        }
    }

    /// Deliver in-flight items in order up to the next CDC that side `from` sent, and take
    /// that one out of flight (never delivered, never completed): for tests that hand it to
    /// the peer themselves, late or on another link.
    pub fn take_cdc_from(&mut self, from: Side) -> Option<[u8; smc_wire::MSG44_LEN]> {
        loop {
            let next_is_cdc = matches!(
                self.queue.front(),
                Some((_, Item::Send { from: f, msg, .. }))
                    if *f == from && msg[0] == smc_wire::cdc::CDC_TYPE
            );
            if next_is_cdc {
                return match self.queue.pop_front() {
                    Some((
                        _,
                        Item::Send {
                            msg: crate::fabric::SendMsg::Msg44(msg),
                            ..
                        },
                    )) => Some(msg),
                    _ => None,
                };
            }
            if !self.deliver_next() {
                return None;
            }
        }
    }

    /// Deliver in-flight items in order up to the next CDC that side `from` sent, and lose it
    /// (never delivered, never completed, as on a link that fails under it); returns the link
    /// it was sent on.
    pub fn lose_cdc_from(&mut self, from: Side) -> Option<LinkId> {
        loop {
            if let Some((
                _,
                Item::Send {
                    from: f, msg, link, ..
                },
            )) = self.queue.front()
            {
                if *f == from && msg[0] == smc_wire::cdc::CDC_TYPE {
                    let link = *link;
                    self.queue.pop_front();
                    return Some(link);
                }
            }
            if !self.deliver_next() {
                return None;
            }
        }
    }

    /// Deliver the next in-flight item (advancing the clock to it). Returns false when
    /// nothing is in flight.
    pub fn deliver_next(&mut self) -> bool {
        let Some((at, item)) = self.queue.pop_front() else {
            return false;
        };
        self.steps += 1;
        assert!(
            self.steps <= self.knobs.max_steps,
            "livelock: more than {} steps",
            self.knobs.max_steps
        );
        if at > self.now {
            self.now = at;
        }
        let now = self.now;
        let delay = self.knobs.delay;
        match item {
            Item::Tcp { to, tcp, bytes } => {
                let h = self.host_mut(to);
                h.ep.handle_tcp_data(tcp, &bytes, &mut h.res, now);
            }
            Item::Rst { to, tcp } => {
                let h = self.host_mut(to);
                h.ep.handle_tcp_reset(tcp, now);
            }
            Item::Send {
                from,
                link,
                wr,
                msg,
            } => {
                let ok = match self.peer_link(from, link) {
                    Some(pl) => {
                        let h = self.host_mut(from.other());
                        h.ep.handle_message(pl, &msg, &mut h.res, now);
                        true
                    }
                    None => false,
                };
                let cd = self.knobs.completion_delay;
                self.push((now + delay + cd, Item::Completion { side: from, wr, ok }));
            }
            Item::Write {
                from,
                link,
                wr,
                rkey,
                addr,
                data,
            } => {
                let strict = self.knobs.strict_writes;
                let ok = match self.peer_link(from, link) {
                    Some(_) => {
                        let h = self.host_mut(from.other());
                        let target = h.res.mrs.get(&rkey).and_then(|&(lgr, rmb, _)| {
                            let (vaddr, mem) = h.res.memory.get_mut(&(lgr, rmb))?;
                            let off = usize::try_from(addr.checked_sub(*vaddr)?).ok()?;
                            let end = off.checked_add(data.len())?;
                            mem.get_mut(off..end)
                        });
                        match target {
                            Some(t) => {
                                t.copy_from_slice(&data);
                                true
                            }
                            None => {
                                assert!(
                                    !strict,
                                    "RDMA WRITE with an unknown rkey {rkey:#x} or outside its RMB \
                                     (address {addr:#x}, {} bytes)",
                                    data.len()
                                );
                                false
                            }
                        }
                    }
                    None => false,
                };
                let cd = self.knobs.completion_delay;
                self.push((now + delay + cd, Item::Completion { side: from, wr, ok }));
                if !ok && !strict && !self.dead.contains(&(from, link)) {
                    // A remote access error puts both QPs of the pair in the error state:
                    // nothing posted after the WRITE (its CDC) is delivered.
                    self.kill_link(from, link);
                }
            }
            Item::Completion { side, wr, ok } => {
                let h = self.host_mut(side);
                if h.outstanding.remove(&wr).is_some() {
                    h.ep.handle_completion(wr, ok, &mut h.res, now);
                }
            }
            Item::LinkFailure { side, link } => {
                let h = self.host_mut(side);
                h.ep.handle_link_failure(link, &mut h.res, now);
            }
        }
        self.flush();
        true
    }

    /// Deliver items until `pred` holds (checked before each delivery); returns whether it
    /// held.
    pub fn run_until(&mut self, mut pred: impl FnMut(&EndpointPair) -> bool) -> bool {
        self.flush();
        loop {
            if pred(self) {
                return true;
            }
            if !self.deliver_next() {
                return pred(self);
            }
        }
    }

    /// Whether a message whose description is `text` was sent (trace).
    pub fn sent(&self, text: &str) -> bool {
        self.trace.iter().any(|e| e.to_string() == text)
    }

    /// Deliver everything in flight (no timers fire).
    pub fn run(&mut self) {
        self.flush();
        while self.deliver_next() {}
    }

    /// The earliest timer deadline of both endpoints.
    pub fn next_deadline(&self) -> Option<Timestamp> {
        [self.a.ep.poll_timeout(), self.b.ep.poll_timeout()]
            .into_iter()
            .flatten()
            .min()
    }

    /// Deliver everything and fire timers up to `now + d`, jumping the clock from deadline
    /// to deadline.
    pub fn run_for(&mut self, d: Duration) {
        let end = self.now + d;
        loop {
            self.run();
            match self.next_deadline() {
                Some(t) if t <= end => {
                    self.steps += 1;
                    assert!(self.steps <= self.knobs.max_steps, "livelock in timers");
                    if t > self.now {
                        self.now = t;
                    }
                    let now = self.now;
                    for s in [Side::A, Side::B] {
                        let h = self.host_mut(s);
                        h.ep.handle_timeout(&mut h.res, now);
                    }
                    self.flush();
                }
                _ => break,
            }
        }
        if end > self.now {
            self.now = end;
        }
    }

    /// Break the QP pair of side `s`'s link `link`: what is in flight on it is lost,
    /// outstanding work requests complete in error, both sides see a link failure.
    pub fn kill_link(&mut self, s: Side, link: LinkId) {
        let peer = self.peer_link(s, link);
        self.dead.insert((s, link));
        if let Some(pl) = peer {
            self.dead.insert((s.other(), pl));
        }
        let dead = self.dead.clone();
        let now = self.now;
        let mut lost = Vec::new();
        self.queue.retain(|(_, item)| match item {
            Item::Send { from, link, wr, .. } | Item::Write { from, link, wr, .. }
                if dead.contains(&(*from, *link)) =>
            {
                lost.push((*from, *wr));
                false
            }
            _ => true,
        });
        for (side, wr) in lost {
            self.push((
                now,
                Item::Completion {
                    side,
                    wr,
                    ok: false,
                },
            ));
        }
        self.push((now, Item::LinkFailure { side: s, link }));
        if let Some(pl) = peer {
            self.push((
                now,
                Item::LinkFailure {
                    side: s.other(),
                    link: pl,
                },
            ));
        }
    }

    /// The trace as text lines, optionally only LLC and CLC (no CDC or WRITE).
    pub fn flow(&self, control_only: bool) -> Vec<String> {
        self.trace
            .iter()
            .filter(|e| {
                !control_only
                    || matches!(
                        e.what,
                        Traced::Clc(..) | Traced::Llc(..) | Traced::TcpRst(_)
                    )
            })
            .filter(|e| !matches!(e.what, Traced::Llc(_, LlcMessage::TestLink(_))) || !control_only)
            .map(|e| e.to_string())
            .collect()
    }
}

/// The harness's side of [`Endpoint::send_with`]: WRITEs through `write`; two CDCs out of
/// three posted at once ([`SendPath::post_cdc`], collected in `cdcs` and then delivered like a
/// [`FabricOp::PostSend`]), the third left to the fabric queue, so that both ways are modelled.
struct DirectCdcs<'a, W> {
    write: W,
    cdcs: &'a mut Vec<(LinkId, WrId, [u8; 44])>,
}

impl<W: FnMut(RdmaWriteTarget, &mut crate::endpoint::WritePiece<'_>) -> WriteOutcome> SendPath
    for DirectCdcs<'_, W>
{
    fn write(
        &mut self,
        target: RdmaWriteTarget,
        piece: &mut crate::endpoint::WritePiece<'_>,
    ) -> WriteOutcome {
        (self.write)(target, piece)
    }

    fn post_cdc(&mut self, link: LinkId, wr: WrId, msg: &[u8; 44]) -> bool {
        if wr.0.is_multiple_of(3) {
            return false;
        }
        self.cdcs.push((link, wr, *msg));
        true
    }
}

/// `bytes` laid out as a fabric's packed WRITE lays them (software RoCE): pieces of 100 bytes,
/// each after 28 bytes of other bytes (where the packets' headers go) and before 4 (the ICRC).
fn packed(bytes: &[u8]) -> crate::endpoint::Strided {
    const HEAD: usize = 28;
    const PIECE: usize = 100;
    let mut buf = Vec::with_capacity(bytes.len() / PIECE * (PIECE + 32) + PIECE + 32);
    for c in bytes.chunks(PIECE) {
        buf.extend_from_slice(&[0xAB; HEAD]);
        buf.extend_from_slice(c);
        buf.extend_from_slice(&[0xCD; 4]);
    }
    crate::endpoint::Strided {
        buf: bytes::Bytes::from(buf),
        first: HEAD,
        stride: HEAD + PIECE + 4,
        piece: PIECE,
        len: bytes.len(),
    }
}
