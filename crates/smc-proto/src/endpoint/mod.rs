//! The per-stack SMC-R endpoint: CLC rendezvous, link groups, LLC exchanges, connections,
//! failover and keepalive, as one sans-IO object (RFC 7609 §3, §4.5.3, §4.6, App. C).
//!
//! See [`Endpoint`] for the contract and the call order.

mod clc;
mod data;
mod llc;
mod replay;
mod v2;

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, VecDeque};
use std::net::Ipv4Addr;
use std::time::Duration;

use smc_wire::clc::Ipv6Prefix;
use smc_wire::llc::DeleteLinkReason;
use smc_wire::{Cursor, DeclineCode, LlcMessage, PeerId, RmbeSize};

use crate::conn::{ConnError, Connection};
use crate::fabric::{Device, DeviceId, FabricOp, LgrId, LinkId, RemoteQp, Resources, WrId};
use crate::link_group::LinkGroup;
use crate::rmb_pool::{PeerRmbeKey, RmbPoolConfig, RmbeAllocation, RmbeHandle};
use crate::time::Timestamp;
use crate::timer::DeadlineMap;

pub use clc::{subnet_matches, ConnectOptions, Handshake};
pub use replay::{Strided, WritePiece};
pub use v2::{llc_from_v2 as llc_view_of_v2, LgrV2, SmcVersions, V2_MAX_LINKS};

/// The runtime's handle for one TCP connection (a socket); chosen by the caller, unique while
/// the connection exists in the endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TcpId(pub u64);

/// Configuration of one endpoint (one SMC-R peer).
#[derive(Debug, Clone)]
pub struct EndpointConfig {
    /// Our peer ID; the caller draws the instance number at random when the stack starts.
    pub peer_id: PeerId,
    /// Our RNICs on the RoCE LAN, in order of preference.
    pub devices: Vec<Device>,
    /// Our IPv4 subnets (network number, prefix length), for the server's subnet check and
    /// the client's Proposal (the first one).
    pub ipv4_subnets: Vec<(Ipv4Addr, u8)>,
    /// Our IPv6 prefixes.
    pub ipv6_prefixes: Vec<Ipv6Prefix>,
    /// Most symmetric links per link group we support (2..=8).
    pub max_links: u8,
    /// Most connections per link group; a server with a full group for a peer creates a
    /// parallel link group.
    pub max_conns_per_lgr: usize,
    /// RMB pool of each link group.
    pub rmb_pool: RmbPoolConfig,
    /// RMBE size asked for each connection.
    pub rmbe_size: RmbeSize,
    /// C.5: the whole CLC handshake must complete within this time.
    pub clc_timeout: Duration,
    /// A client that has no answer to its Proposal after this time declines in place of the
    /// Accept (`NOACCEPT`, C.1) and falls back to TCP, as Linux's client does after its
    /// 6 s wait on the CLC socket: a server whose program accepts the connection only after
    /// the client sent something on another one (FTP's data connections) cannot answer
    /// before; TCP completes the handshake in the kernel's backlog. `None`: wait the whole
    /// `clc_timeout`.
    pub accept_wait: Option<Duration>,
    /// C.7: LLC reply timer during the first contact setup of a link group.
    pub llc_timeout_first_contact: Duration,
    /// C.7: LLC reply timer while maintaining a link group.
    pub llc_timeout: Duration,
    /// C.8: retry adding a second link after this time.
    pub add_link_retry: Duration,
    /// §4.5.3: TEST LINK when a link has been idle this long (`None`: no keepalive).
    pub keepalive: Option<Duration>,
    /// The server terminates a link group without connections after this time.
    pub lgr_idle_timeout: Duration,
    /// Connection timers (close and abort waits).
    pub close_timeout: Duration,
    /// The SMC versions we offer (client) and accept (server); default both.
    pub versions: SmcVersions,
    /// Our UEIDs (at most 4, Linux's table size); SMC-Rv2 needs at least one shared with the
    /// peer.
    pub ueids: Vec<smc_wire::Eid>,
    /// The host name of the SMC-Rv2 first-contact extension, blank-padded.
    pub hostname: [u8; 32],
}

impl EndpointConfig {
    /// A configuration with the RFC's spirit of defaults: two links, 30 s CLC timer, 10 s
    /// first-contact LLC timer (long enough for the peer's write-completion timeout and a few
    /// Decline retransmissions), 2 s maintenance LLC timer, 10 s add-link retry.
    pub fn new(peer_id: PeerId, devices: Vec<Device>) -> Self {
        EndpointConfig {
            peer_id,
            devices,
            ipv4_subnets: Vec::new(),
            ipv6_prefixes: Vec::new(),
            max_links: 2,
            max_conns_per_lgr: 255,
            rmb_pool: RmbPoolConfig::default(),
            rmbe_size: RmbeSize(0),
            clc_timeout: Duration::from_secs(30),
            accept_wait: Some(Duration::from_secs(6)),
            llc_timeout_first_contact: Duration::from_secs(10),
            llc_timeout: Duration::from_secs(2),
            add_link_retry: Duration::from_secs(10),
            keepalive: None,
            lgr_idle_timeout: Duration::from_secs(600),
            close_timeout: Duration::from_secs(30),
            versions: SmcVersions::default(),
            ueids: Vec::new(),
            hostname: smc_wire::clc_v2::FirstContactExt::hostname_field("smc-rs"),
        }
    }
}

/// Why a TCP connection fell back to plain TCP (RFC 7609 App. C.1–C.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fallback {
    /// The peer sent a Decline with this reason (and the S flag if `out_of_sync`).
    PeerDeclined {
        /// The peer's diagnosis.
        code: DeclineCode,
        /// S flag: the peer is out of sync with our link group.
        out_of_sync: bool,
    },
    /// We sent a Decline with this reason.
    Declined(DeclineCode),
}

impl Fallback {
    /// The Decline reason code, whoever sent it.
    pub fn code(self) -> DeclineCode {
        match self {
            Fallback::PeerDeclined { code, .. } | Fallback::Declined(code) => code,
        }
    }
}

/// Why a TCP connection must be reset (no fallback possible, App. C.3, C.5, C.6, C.7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum ResetReason {
    /// C.5: the CLC handshake did not complete in time.
    #[error("CLC handshake timed out")]
    ClcTimeout,
    /// C.6: a malformed or unexpected CLC message (protocol error).
    #[error("CLC protocol error: {0}")]
    ClcProtocolError(&'static str),
    /// C.7: an LLC reply of the first contact setup did not come.
    #[error("LLC timeout during link group setup: {0}")]
    LlcTimeout(&'static str),
    /// The link group (or its last link) failed past the point of no return.
    #[error("link group lost")]
    LinkGroupLost,
    /// §4.4.2: the peer presented an RMBE that is in use.
    #[error("RMB element conflict")]
    RmbeConflict,
    /// The peer reset the TCP connection during setup.
    #[error("TCP connection reset by the peer")]
    PeerReset,
    /// The established connection failed.
    #[error("connection failed: {0}")]
    Connection(ConnError),
}

/// Something the runtime or the application must learn.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum EndpointEvent {
    /// The TCP connection runs over SMC-R from now on.
    Established {
        /// The connection.
        tcp: TcpId,
        /// Its link group.
        lgr: LgrId,
        /// Whether it created the link group.
        first_contact: bool,
    },
    /// The TCP connection falls back to plain TCP; `leftover` are TCP bytes received after
    /// the CLC messages (application data), to be delivered to the application.
    FellBack {
        /// The connection.
        tcp: TcpId,
        /// Why.
        reason: Fallback,
        /// Bytes after the last CLC message.
        leftover: Vec<u8>,
    },
    /// The runtime must reset the TCP connection (RST) and report the error.
    Reset {
        /// The connection.
        tcp: TcpId,
        /// Why.
        reason: ResetReason,
    },
    /// The peer reset connection `tcp` with bytes it had written before still unread in our
    /// RMBE (see [`Connection::unread_at_reset`](crate::conn::Connection::unread_at_reset)):
    /// the runtime copies them out now, before the element goes back to the pool, for the
    /// application to read ahead of the reset. Comes just before the connection's `Failed`.
    UnreadAtReset {
        /// The connection.
        tcp: TcpId,
        /// Where the bytes are.
        target: ReadTarget,
    },
    /// An event of an established connection (data, close states).
    Conn {
        /// The connection.
        tcp: TcpId,
        /// The event.
        event: crate::conn::Event,
    },
    /// A link became active.
    LinkUp {
        /// Group.
        lgr: LgrId,
        /// Link.
        link: LinkId,
        /// Link number.
        num: u8,
    },
    /// A link went away.
    LinkDown {
        /// Group.
        lgr: LgrId,
        /// Link.
        link: LinkId,
        /// Link number.
        num: u8,
        /// Why.
        reason: DeleteLinkReason,
    },
    /// A link group was terminated.
    LinkGroupTerminated {
        /// Group.
        lgr: LgrId,
    },
    /// Connection `tcp` is reset because its link group was lost (no link left); comes
    /// before the connection's `Failed`.
    LinkGroupLost {
        /// The connection.
        tcp: TcpId,
        /// Whether the peer had consumed every byte we wrote. A runtime whose peer may be a
        /// process that ended (a userspace stack dies with its process, and the link group
        /// with it) tells the application what TCP would: a peer closed with everything read
        /// (its kernel sent a FIN) is an end of stream, one with unread data (a RST) a reset.
        peer_read_all: bool,
    },
}

/// Where the unread bytes of a connection are in our RMB: the runtime copies them out of
/// the element and then reports them consumed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReadTarget {
    /// Link group of the RMB.
    pub lgr: LgrId,
    /// Our RMB.
    pub rmb: crate::rmb_pool::RmbId,
    /// Offset of the connection's element in the RMB.
    pub element_offset: u64,
    /// Unread ranges, offsets within the element.
    pub regions: crate::rmbe::Regions,
}

/// Where one RDMA WRITE of [`Endpoint::send_with`] goes: the peer's RMB on the link the
/// connection sends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RdmaWriteTarget {
    /// The link (QP) to post the WRITE on.
    pub link: LinkId,
    /// The work-request id to post it with (unsignaled: see [`Endpoint::send_with`]).
    pub wr: WrId,
    /// The peer's rkey of its RMB on that link.
    pub rkey: u32,
    /// Remote address of the first byte.
    pub addr: u64,
    /// Bytes of free space in the peer's RMBE from `addr` on without a wrap (at least the
    /// piece's length): the space between our producer cursor and the peer's consumer
    /// cursor, which the peer has consumed and reads again only after a CDC announces new
    /// bytes there (RFC 7609 §4.5.1). A WRITE may cover more than its piece, up to this, with
    /// bytes no CDC announces (a runtime widens a short WRITE so that it leaves in one
    /// datagram with its CDC); a later WRITE of real bytes overwrites them before they are
    /// announced.
    pub room: u32,
}

/// Where a [`send_with`](Endpoint::send_with) of connection `tcp` would write its bytes now
/// (see [`Endpoint::write_plan`]): the link, the peer's rkey on it, and up to two pieces
/// (remote address, length), the second where the free space wraps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WritePlan {
    /// The link (QP) the WRITEs go over.
    pub link: LinkId,
    /// The peer's rkey of its RMB on that link.
    pub rkey: u32,
    /// (remote address, length) of each piece; `len == 0` for an unused second piece.
    pub pieces: [(u64, u32); 2],
}

impl WritePlan {
    /// Bytes of both pieces.
    pub fn total(&self) -> u32 {
        self.pieces[0].1 + self.pieces[1].1
    }
}

/// The runtime's side of [`Endpoint::send_with`]: it posts each RDMA WRITE straight from the
/// application's slice and may post the CDC that announces them at once. Any
/// `FnMut(RdmaWriteTarget, &[u8]) -> WriteOutcome` is one that posts only the WRITEs (the CDC
/// then comes out of [`Endpoint::poll_fabric`] as usual).
pub trait SendPath {
    /// Post one RDMA WRITE of `piece` to `target`, unsignaled; say what the fabric did. A
    /// path whose fabric keeps a posted WRITE's bytes (roce) posts
    /// [`piece.shared()`](WritePiece::shared): the engine then keeps that buffer for replay
    /// rather than a copy (one copy per byte in all).
    fn write(&mut self, target: RdmaWriteTarget, piece: &mut WritePiece<'_>) -> WriteOutcome;

    /// Post the CDC message `msg` on `link` as a signaled SEND with work-request id `wr`,
    /// now, if nothing stands in its way; `false` leaves it to [`Endpoint::poll_fabric`]
    /// (a [`FabricOp::PostSend`] that the runtime posts as any other). Offered only while
    /// no earlier fabric operation waits in that queue, so the order of the link's work
    /// requests is kept. The CDC leaves before the engine's bookkeeping of the send: on the
    /// path of a request-response exchange, the SEND is the moment the peer waits for.
    fn post_cdc(&mut self, link: LinkId, wr: WrId, msg: &[u8; 44]) -> bool {
        let _ = (link, wr, msg);
        false
    }
}

impl<F: FnMut(RdmaWriteTarget, &[u8]) -> WriteOutcome> SendPath for F {
    fn write(&mut self, target: RdmaWriteTarget, piece: &mut WritePiece<'_>) -> WriteOutcome {
        self(target, piece.bytes())
    }
}

/// What the fabric did with one RDMA WRITE of [`Endpoint::send_with`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WriteOutcome {
    /// Executed during the post: the bytes are in the peer's memory.
    Placed,
    /// Posted; the bytes reach the peer by the time the WRITE completes successfully.
    Posted,
    /// Not posted (the link failed): the bytes were not taken.
    Failed,
}

/// Misuse of the endpoint API (never the peer's fault).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum EndpointError {
    /// No such TCP connection.
    #[error("unknown TCP connection")]
    UnknownConnection,
    /// No such link group.
    #[error("unknown link group")]
    UnknownLinkGroup,
    /// The TCP connection id is already in use.
    #[error("TCP connection id in use")]
    DuplicateConnection,
    /// The connection is not (yet) running over SMC-R.
    #[error("connection not established over SMC-R")]
    NotEstablished,
    /// The endpoint has no RNIC.
    #[error("no RoCE device")]
    NoDevice,
    /// The connection refused the operation.
    #[error("connection: {0}")]
    Conn(crate::conn::ApiError),
}

// By hand rather than `#[from]`, which would also make the cause the `source`: its text,
// already in the message, would be printed twice in a chain of causes.
impl From<crate::conn::ApiError> for EndpointError {
    fn from(e: crate::conn::ApiError) -> Self {
        EndpointError::Conn(e)
    }
}

/// What a posted work request was for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WrPurpose {
    /// An LLC message on link `num` of `lgr`; `confirm_for` marks the first contact's
    /// CONFIRM LINK (request or reply), whose completion is the point of no return (C.2).
    Llc {
        lgr: LgrId,
        link: LinkId,
        confirm_for: Option<TcpId>,
    },
    /// A CDC message of a connection.
    Cdc {
        tcp: TcpId,
        link: LinkId,
        seq: u16,
        prod: Cursor,
    },
    /// An RDMA WRITE of a connection.
    Write { tcp: TcpId, link: LinkId },
}

/// An established SMC-R connection: the data engine and where its bytes go.
#[derive(Debug)]
struct SmcConn {
    lgr: LgrId,
    conn: Connection,
    local: RmbeHandle,
    local_element_offset: u64,
    local_alert: u32,
    /// Index of the peer RMB in the group's table.
    peer_rmb: usize,
    peer_element_offset: u64,
    peer_key: PeerRmbeKey,
    /// The link we send on (each side chooses its own, §2.3).
    send_link: u8,
    /// Where the data path writes: `send_link`'s id and the peer's RMBE through it, looked
    /// up whenever `send_link` is set ([`SendRoute::of`]), not for every write.
    route: Option<SendRoute>,
    /// Bytes written to the peer but not known received: from `unacked_from` to our
    /// producer cursor (kept for replay, §4.6.2).
    unacked: replay::Replay,
    unacked_from: Cursor,
    /// Where the shared bytes of this connection's WRITEs are cut from
    /// ([`WritePiece::shared`]).
    arena: replay::Arena,
    /// When the arena's idleness is checked next ([`replay::ARENA_IDLE`]): it is trimmed
    /// then if nothing was written since `arena_used` for that long.
    arena_idle_until: Option<Timestamp>,
    /// The last write that took shared bytes from the arena.
    arena_used: Timestamp,
    /// SS (§4.6.1): sequence number of the last CDC whose send completed.
    ss: u16,
    /// Sequence number of the last CDC posted.
    last_posted: Option<u16>,
    /// Closed (the application saw it), but kept until the last CDC posted, our closing
    /// indication, completes: a link that fails before that may have lost it, and the failover
    /// sends it again (the peer would otherwise wait for its close timer).
    held: bool,
}

/// Where a connection's RDMA WRITEs and CDCs go (see [`SmcConn::route`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SendRoute {
    /// The id of the link (QP) the connection sends on.
    link: LinkId,
    /// The peer's rkey of its RMB on that link.
    rkey: u32,
    /// Remote address of the first byte of the peer's RMBE.
    base: u64,
}

impl SendRoute {
    /// The route through link `num` of group `g` to the peer's RMB `peer_rmb` (its element at
    /// `element_offset`); `None` when the link or the peer's token on it is unknown.
    fn of(g: &LinkGroup, peer_rmb: usize, element_offset: u64, num: u8) -> Option<SendRoute> {
        let token = g.peer_rmbs.get(peer_rmb)?.tokens.get(&num).copied()?;
        let link = g.links.get(&num)?.id;
        Some(SendRoute {
            link,
            rkey: token.rkey,
            base: token.vaddr + element_offset,
        })
    }
}

/// One TCP connection known to the endpoint.
#[derive(Debug)]
enum Entry {
    /// CLC handshake (and, on a first contact, the link setup) in progress.
    Setup(Box<Handshake>),
    /// Running over SMC-R.
    Smc(Box<SmcConn>),
}

impl crate::timer::HasDeadline for Entry {
    fn deadline(&self) -> Option<Timestamp> {
        match self {
            Entry::Setup(h) => h.deadline(),
            Entry::Smc(c) => match (c.conn.poll_timeout(), c.arena_idle_until) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            },
        }
    }
}

/// The RMBE and alert token a connection got during its setup.
#[derive(Debug, Clone, Copy)]
struct LocalSetup {
    lgr: LgrId,
    alloc: RmbeAllocation,
    alert: u32,
}

/// How many removed links an endpoint remembers for the CDCs still queued on them.
pub const RETIRED_LINKS: usize = 64;

/// The SMC-R peer of one process: owns link groups, links, RMB pools, connection engines and
/// the CLC handshakes in progress.
///
/// # Contract
///
/// Sans-IO, like [`Connection`]: no clock, no I/O, no randomness of its own.
///
/// * Inputs: [`handle_tcp_data`](Self::handle_tcp_data) (bytes read from a TCP connection
///   during its CLC handshake), [`handle_tcp_reset`](Self::handle_tcp_reset),
///   [`handle_message`](Self::handle_message) (a 44-byte SEND received on a link),
///   [`handle_completion`](Self::handle_completion) (a work completion, good or failed),
///   [`handle_link_failure`](Self::handle_link_failure) (QP error, port down),
///   [`handle_timeout`](Self::handle_timeout); application commands
///   [`connect`](Self::connect), [`accept`](Self::accept), [`send`](Self::send),
///   [`read_target`](Self::read_target) + [`consumed`](Self::consumed),
///   [`shutdown_write`](Self::shutdown_write), [`close`](Self::close),
///   [`abort`](Self::abort), [`request_add_link`](Self::request_add_link),
///   [`request_delete_link`](Self::request_delete_link),
///   [`terminate_link_group`](Self::terminate_link_group).
/// * Outputs: [`poll_tcp_transmit`](Self::poll_tcp_transmit) (bytes to write on a TCP
///   connection), [`poll_fabric`](Self::poll_fabric) (QPs to connect, SENDs and RDMA WRITEs to
///   post, QPs to destroy, RMBs to free — perform them in order: a link's posts keep their
///   order), [`poll_event`](Self::poll_event), [`poll_timeout`](Self::poll_timeout).
///
/// After every input drain the three queues and re-read `poll_timeout`. Identifiers that need
/// synchronous answers (QP numbers, rkeys) and randomness come from the [`Resources`] passed
/// to each input.
///
/// # Design decisions
///
/// * RMBE layout: we follow Linux — no eye catcher, cursors from 0 — and always send the
///   `0x03` flags in CONFIRM LINK. A peer whose CONFIRM LINK lacks them wants the RFC
///   eye-catcher layout; we answer with a Decline `0x03050000` (RMBE_EC) and fall back,
///   like Linux, rather than run a second layout on the wire (wire-formats.md §1 item 1).
/// * Maximum links: each side announces its maximum in CONFIRM LINK; the group uses the
///   smaller, clamped to 2..=8 (a 0 from an old peer counts as 2).
/// * The point of no return of a first contact is the successful completion of our CONFIRM
///   LINK (request or reply) send (App. C.2); of a subsequent contact, sending Accept
///   (server) or Confirm (client) (App. C.1, C.3). Before it, RoCE failures Decline; after
///   it, they reset.
/// * A first contact completes (the application sees [`EndpointEvent::Established`]) only
///   after the second-link ADD LINK exchange ended — added, rejected, or failed (App. C.8
///   retry timer armed) — so no data flows during it.
/// * Failover replays by the RFC's second option (§4.6.2): the bytes not known received
///   are rewritten over the new link and described by one CDC with a new sequence number.
#[derive(Debug)]
pub struct Endpoint {
    config: EndpointConfig,
    lgrs: BTreeMap<LgrId, LinkGroup>,
    /// Indexed by their timers' deadlines: `poll_timeout`, asked after every input, must
    /// not visit every connection (it did, and setting up 10,000 connections took 0.47 ms
    /// each instead of 0.28 ms for 2,000).
    entries: DeadlineMap<TcpId, Entry>,
    /// Alert token → connection (established or awaiting Confirm).
    alerts: BTreeMap<u32, TcpId>,
    /// Link id → (group, link number).
    links: BTreeMap<LinkId, (LgrId, u8)>,
    /// Links removed lately (newest last, at most [`RETIRED_LINKS`]) and their groups: CDCs
    /// that arrived on a link before it failed may be handled after its removal (its receive
    /// queue drains after the new link's), and still count.
    retired_links: VecDeque<(LinkId, LgrId)>,
    /// Purposes of outstanding work requests (an insert and a removal per CDC: hashed, not
    /// ordered; never iterated, so the engine stays deterministic).
    wrs: foldhash::HashMap<WrId, WrPurpose>,
    /// Fabric operations held until a work request completes (QPs of a terminated group are
    /// destroyed once its DELETE LINK has been delivered, App. C.7).
    deferred: BTreeMap<WrId, Vec<FabricOp>>,
    next_lgr: u32,
    next_link: u32,
    next_wr: u64,
    tcp_out: VecDeque<(TcpId, Vec<u8>)>,
    fabric_out: VecDeque<FabricOp>,
    events: VecDeque<EndpointEvent>,
    stats: EndpointStats,
    /// Proposals from a peer whose link group with us is still in its first contact
    /// (server): answered once that first contact ends (see `on_proposal`).
    parked: Vec<(TcpId, smc_wire::clc::Proposal, LgrId)>,
}

/// Counters of an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct EndpointStats {
    /// Connections established over SMC-R.
    pub established: u64,
    /// Connections that fell back to TCP.
    pub fallbacks: u64,
    /// Connections reset during setup.
    pub setup_resets: u64,
    /// Connections moved to another link.
    pub failovers: u64,
    /// LLC messages received and discarded (optional types, stale links).
    pub llc_discarded: u64,
    /// SMC-Rv2 ADD LINK requests and accepting replies refused because their rkeys were
    /// missing (shorter than 72 bytes), named an RMB not known on the link they came over, or
    /// would not fit (more than 255 RMBs of ours).
    pub llc_v2_add_link_invalid: u64,
    /// CDCs handled after their link was removed (they arrived before it failed).
    pub cdc_on_retired_link: u64,
    /// Links that failed.
    pub link_failures: u64,
    /// Negative CONFIRM RKEY replies we sent because of a collision.
    pub rkey_collisions: u64,
    /// Peer RMBs that could not be taken in (a local resource ran out, see
    /// `Resources::take_peer_rtoken`): a new RMB refused with a negative CONFIRM RKEY reply
    /// (the peer declines the connection that wanted it), or a new link abandoned before it
    /// carried anything; the link group goes on either way.
    pub rkeys_refused: u64,
    /// TEST LINK requests sent.
    pub test_links_sent: u64,
    /// Connections that closed in order and were held until their last CDC completed (see
    /// the failover of a closing indication).
    pub closes_held: u64,
    /// Idle connections' shared-byte arenas and pools let go (`ARENA_IDLE` after their last
    /// write while they held memory).
    pub arenas_trimmed: u64,
}

impl Endpoint {
    /// A new endpoint.
    pub fn new(config: EndpointConfig) -> Endpoint {
        Endpoint {
            config,
            lgrs: BTreeMap::new(),
            entries: DeadlineMap::new(),
            alerts: BTreeMap::new(),
            links: BTreeMap::new(),
            retired_links: VecDeque::new(),
            wrs: foldhash::HashMap::default(),
            deferred: BTreeMap::new(),
            next_lgr: 1,
            next_link: 1,
            next_wr: 1,
            tcp_out: VecDeque::new(),
            fabric_out: VecDeque::new(),
            events: VecDeque::new(),
            stats: EndpointStats::default(),
            parked: Vec::new(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &EndpointConfig {
        &self.config
    }

    /// The counters.
    pub fn stats(&self) -> EndpointStats {
        self.stats
    }

    /// The link groups.
    pub fn link_groups(&self) -> impl Iterator<Item = &LinkGroup> {
        self.lgrs.values()
    }

    /// One link group.
    pub fn link_group(&self, id: LgrId) -> Option<&LinkGroup> {
        self.lgrs.get(&id)
    }

    /// The connection engine of an established connection.
    pub fn connection(&self, tcp: TcpId) -> Option<&Connection> {
        match self.entries.get(&tcp) {
            Some(Entry::Smc(c)) => Some(&c.conn),
            _ => None,
        }
    }

    /// The link group and send link number of an established connection.
    pub fn connection_link(&self, tcp: TcpId) -> Option<(LgrId, u8)> {
        match self.entries.get(&tcp) {
            Some(Entry::Smc(c)) => Some((c.lgr, c.send_link)),
            _ => None,
        }
    }

    /// The handshake state name of a connection being set up (diagnostics, tests).
    pub fn handshake_state(&self, tcp: TcpId) -> Option<&'static str> {
        match self.entries.get(&tcp) {
            Some(Entry::Setup(h)) => Some(h.name()),
            _ => None,
        }
    }

    /// Whether the setup of `tcp` waits for an LLC exchange over the fabric (CONFIRM LINK on
    /// first contact, CONFIRM RKEY for a new RMB) rather than for a CLC message: what ends
    /// that wait comes as a completion, not as bytes on the TCP connection.
    pub fn handshake_awaits_fabric(&self, tcp: TcpId) -> bool {
        match self.entries.get(&tcp) {
            Some(Entry::Setup(h)) => h.awaits_fabric(),
            _ => false,
        }
    }

    // ----- Outputs -------------------------------------------------------------------------

    /// Bytes to write on a TCP connection (CLC messages).
    pub fn poll_tcp_transmit(&mut self) -> Option<(TcpId, Vec<u8>)> {
        self.tcp_out.pop_front()
    }

    /// Whether any of [`poll_tcp_transmit`](Self::poll_tcp_transmit),
    /// [`poll_fabric`](Self::poll_fabric) and [`poll_event`](Self::poll_event) has something
    /// (a runtime that drains after every call asks this first: usually nothing).
    pub fn has_output(&self) -> bool {
        !(self.tcp_out.is_empty() && self.fabric_out.is_empty() && self.events.is_empty())
    }

    /// The next fabric operation to perform.
    pub fn poll_fabric(&mut self) -> Option<FabricOp> {
        self.fabric_out.pop_front()
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<EndpointEvent> {
        self.events.pop_front()
    }

    /// The earliest deadline of every timer of the endpoint.
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        // A parked Proposal whose first contact ended (by any input) is answered at once.
        if self.parked.iter().any(|p| self.parked_runnable(p)) {
            return Some(Timestamp::ZERO);
        }
        let lg = self.lgrs.values().filter_map(|g| g.next_deadline());
        lg.chain(self.entries.next_deadline()).min()
    }

    /// Fire every timer due at `now`.
    pub fn handle_timeout(&mut self, res: &mut dyn Resources, now: Timestamp) {
        self.run_parked(res, now);
        for tcp in self.entries.due(now) {
            match self.entries.get_mut(&tcp) {
                Some(Entry::Setup(_)) => self.handshake_timeout(tcp, res, now),
                Some(Entry::Smc(c)) => {
                    c.conn.handle_timeout(now);
                    if c.arena_idle_until.is_some_and(|t| t <= now) {
                        let idle_from = c.arena_used + replay::ARENA_IDLE;
                        if idle_from <= now {
                            c.arena.trim();
                            c.arena_idle_until = None;
                            self.stats.arenas_trimmed += 1;
                        } else {
                            c.arena_idle_until = Some(idle_from);
                        }
                    }
                    self.after_conn(tcp, now);
                }
                None => {}
            }
        }
        let groups: Vec<LgrId> = self
            .lgrs
            .iter()
            .filter(|(_, g)| g.next_deadline().is_some_and(|d| d <= now))
            .map(|(id, _)| *id)
            .collect();
        for id in groups {
            self.lgr_timeout(id, res, now);
        }
    }

    // ----- Internal helpers ----------------------------------------------------------------

    fn new_wr(&mut self, purpose: WrPurpose) -> WrId {
        let wr = self.fresh_wr();
        self.wrs.insert(wr, purpose);
        wr
    }

    /// A new work-request id whose purpose is not recorded (yet): for work the caller learns
    /// the outcome of at once, which records it only when it must wait for a completion.
    fn fresh_wr(&mut self) -> WrId {
        let wr = WrId(self.next_wr);
        self.next_wr += 1;
        wr
    }

    fn new_lgr_id(&mut self) -> LgrId {
        let id = LgrId(self.next_lgr);
        self.next_lgr += 1;
        id
    }

    fn new_link_id(&mut self) -> LinkId {
        let id = LinkId(self.next_link);
        self.next_link += 1;
        id
    }

    /// A fresh alert token, unique in the endpoint.
    fn new_alert_token(&mut self, res: &mut dyn Resources) -> u32 {
        loop {
            let t = res.random_u32();
            if t != 0 && !self.alerts.contains_key(&t) {
                return t;
            }
        }
    }

    /// Post an LLC message on link `num` of `lgr`.
    fn post_llc(
        &mut self,
        lgr: LgrId,
        num: u8,
        msg: LlcMessage,
        confirm_for: Option<TcpId>,
        now: Timestamp,
    ) -> Option<WrId> {
        let v2_group = self.lgrs.get(&lgr).is_some_and(|g| g.v2.is_some());
        tracing::trace!(?lgr, num, ?msg, "post LLC");
        let bytes = v2::llc_to_wire(&msg, v2_group).into();
        self.post_llc_bytes(lgr, num, bytes, confirm_for, now)
    }

    /// Post the LLC message `bytes` on link `num` of `lgr` (its activity stamped, the work
    /// request recorded as an LLC one).
    fn post_llc_bytes(
        &mut self,
        lgr: LgrId,
        num: u8,
        bytes: crate::fabric::SendMsg,
        confirm_for: Option<TcpId>,
        now: Timestamp,
    ) -> Option<WrId> {
        let link = self
            .lgrs
            .get_mut(&lgr)
            .and_then(|g| g.links.get_mut(&num))?;
        link.last_activity = now;
        let id = link.id;
        let wr = self.new_wr(WrPurpose::Llc {
            lgr,
            link: id,
            confirm_for,
        });
        self.fabric_out.push_back(FabricOp::PostSend {
            link: id,
            wr,
            msg: bytes,
        });
        Some(wr)
    }

    /// Post an LLC v2 message in its own form (an ADD LINK v2 with rkeys, a REQ ADD LINK v2:
    /// longer than 44 bytes, up to 8192) on link `num` of the v2 group `lgr`.
    fn post_llc_v2(
        &mut self,
        lgr: LgrId,
        num: u8,
        msg: &smc_wire::llc_v2::LlcV2Message,
        now: Timestamp,
    ) -> Option<WrId> {
        // At most 8192 bytes: ADD LINK v2 carries at most 255 rkeys (4152 bytes), REQ ADD
        // LINK v2 our few GIDs.
        let bytes = crate::fabric::SendMsg::new(&msg.to_vec())?;
        tracing::trace!(?lgr, num, ?msg, "post LLC v2");
        self.post_llc_bytes(lgr, num, bytes, None, now)
    }

    /// Post ADD LINK v2 `base` (request or accepting reply) with the extension carrying our
    /// RToken `pairs` for the new link (smc-rv2.md §10.4) on link `via`.
    fn post_add_link_v2(
        &mut self,
        lgr: LgrId,
        via: u8,
        base: smc_wire::llc::AddLink,
        pairs: Vec<smc_wire::llc::RtokenPair>,
        now: Timestamp,
    ) {
        // "target GID: the GID the peer should connect the new link to; Linux fills the
        // sender's own new-link GID"; v2 direct: one LAN, no gateway.
        let ext = smc_wire::llc_v2::AddLinkV2Ext::new(true, base.sender_gid, pairs);
        let m = smc_wire::llc_v2::LlcV2Message::AddLink(smc_wire::llc_v2::AddLinkV2 {
            base: smc_wire::llc::AddLink {
                reject_reason: smc_wire::llc::AddLinkRejectReason(0),
                ..base
            },
            ext: Some(ext),
        });
        self.post_llc_v2(lgr, via, &m, now);
    }

    /// Connect our QP of link `num` of `lgr` to the peer's QP `remote`. False when there is no
    /// such link.
    fn connect_link(&mut self, lgr: LgrId, num: u8, remote: RemoteQp) -> bool {
        let Some(l) = self.lgrs.get_mut(&lgr).and_then(|g| g.links.get_mut(&num)) else {
            return false;
        };
        l.remote = Some(remote);
        let (link, device) = (l.id, l.device);
        self.fabric_out.push_back(FabricOp::ConnectQp {
            link,
            device,
            remote,
        });
        true
    }

    fn send_clc(&mut self, tcp: TcpId, msg: &smc_wire::ClcMessage) {
        self.tcp_out.push_back((tcp, msg.to_vec()));
    }

    fn device(&self, d: DeviceId) -> Option<Device> {
        self.config.devices.get(usize::from(d.0)).copied()
    }
}
