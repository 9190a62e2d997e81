//! Link groups and links (RFC 7609 §2.2, §3.5.5): the state the [`Endpoint`] keeps per link
//! group, and the configuration exchanges in progress on it.
//!
//! A link group joins two SMC-R peers (identified by peer ID) over one or more links, each link
//! an RC QP between one RNIC on each side. The server assigns link numbers and drives every
//! change of the group's configuration; the client may ask (ADD LINK or DELETE LINK request).
//! Every RMB of the group is registered on every link, so each RMB has one RToken per link.
//!
//! [`Endpoint`]: crate::endpoint::Endpoint

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use smc_wire::llc::RtokenPair;
use smc_wire::{LlcMessage, PeerId, QpMtu};

use crate::endpoint::TcpId;
use crate::fabric::{DeviceId, DeviceSet, LgrId, LinkId, LlcVersion, MrInfo, QpInfo, RemoteQp};
use crate::rmb_pool::{PeerRmbeRegistry, RmbId, RmbPool};
use crate::time::Timestamp;
use crate::timer::{TimerKind, TimerTable};

/// Which side of the link group we are: the server (accepted the first TCP connection) owns
/// the configuration of the group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// We connected (CLC client).
    Client,
    /// We accepted (CLC server).
    Server,
}

/// The life of one link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinkState {
    /// The QP exists; the CONFIRM LINK exchange has not completed.
    Activating,
    /// Confirmed; carries LLC, CDC and RDMA traffic.
    Active,
}

/// The timers of one link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LinkTimer {
    /// Check whether the link has been idle past the keepalive interval (§4.5.3).
    Keepalive,
    /// A TEST LINK is outstanding; its reply is due.
    TestLinkReply,
}

impl TimerKind for LinkTimer {
    const ALL: &'static [Self] = &[LinkTimer::Keepalive, LinkTimer::TestLinkReply];
    fn index(self) -> usize {
        self as usize
    }
}

/// One SMC-R link: a reliably connected QP between one RNIC on each side.
#[derive(Debug, Clone)]
pub struct Link {
    /// Endpoint-wide identifier (the runtime's handle for the QP).
    pub id: LinkId,
    /// Link number in the group, assigned by the server.
    pub num: u8,
    /// Our RNIC.
    pub device: DeviceId,
    /// Our QP.
    pub local_qp: QpInfo,
    /// The peer's QP, once known.
    pub remote: Option<RemoteQp>,
    /// Confirmed or not.
    pub state: LinkState,
    /// Our link user ID (random, for display).
    pub local_user_id: u32,
    /// The peer's link user ID from its CONFIRM LINK.
    pub peer_user_id: Option<u32>,
    /// The link shares an RNIC with another link of the group on one side (RFC 7609 §2.2,
    /// Fig. 6): at most one per group, not counted toward the maximum.
    pub asymmetric: bool,
    /// Last time anything was sent or received on the link (keepalive, §4.5.3).
    pub last_activity: Timestamp,
    /// User data of the outstanding TEST LINK.
    pub test_link: Option<[u8; 16]>,
    /// Keepalive timers.
    pub timers: TimerTable<LinkTimer, 2>,
}

impl Link {
    /// Activity on the link: an active link that waits for no TEST LINK reply sends its next
    /// TEST LINK after `keepalive` (if any) of silence from now.
    pub(crate) fn rearm_keepalive(
        &mut self,
        keepalive: Option<std::time::Duration>,
        now: Timestamp,
    ) {
        if let Some(interval) = keepalive {
            if self.state == LinkState::Active && self.test_link.is_none() {
                self.timers.set(LinkTimer::Keepalive, now + interval);
            }
        }
    }

    /// A link being set up (its CONFIRM LINK exchange to come) on our `device` with QP
    /// `local_qp`; the peer's QP not known yet, symmetric.
    pub(crate) fn activating(
        id: LinkId,
        num: u8,
        device: DeviceId,
        local_qp: QpInfo,
        local_user_id: u32,
        now: Timestamp,
    ) -> Self {
        Link {
            id,
            num,
            device,
            local_qp,
            remote: None,
            state: LinkState::Activating,
            local_user_id,
            peer_user_id: None,
            asymmetric: false,
            last_activity: now,
            test_link: None,
            timers: TimerTable::new(),
        }
    }
}

/// One of our RMBs: its size and its RToken on every link.
#[derive(Debug, Clone)]
pub struct LocalRmb {
    /// Total length.
    pub len: u64,
    /// Length of one element.
    pub element_len: u32,
    /// RToken per link number.
    pub tokens: BTreeMap<u8, MrInfo>,
    /// The peer knows this RMB on every link (CLC first contact or CONFIRM RKEY done).
    pub confirmed: bool,
}

/// One of the peer's RMBs, as RTokens per link number.
#[derive(Debug, Clone, Default)]
pub struct PeerRmb {
    /// (rkey, address) per link number.
    pub tokens: BTreeMap<u8, MrInfo>,
    /// Its tokens on links removed lately (newest last, at most [`GONE_REMOTES`]): a CLC
    /// Confirm sent before the client saw a link fail may still name the RMB by one.
    pub gone: Vec<MrInfo>,
}

impl PeerRmb {
    /// A peer RMB known so far on link `num` only, by `token`.
    pub(crate) fn on_link(num: u8, token: MrInfo) -> Self {
        PeerRmb {
            tokens: BTreeMap::from([(num, token)]),
            gone: Vec::new(),
        }
    }
}

/// A configuration change of the link (ADD LINK / DELETE LINK) in progress (RFC 7609
/// §3.5.5.3, second group).
#[derive(Debug, Clone)]
pub enum LinkExchange {
    /// Server: we added link `new` with an ADD LINK sent over link `via`.
    ServerAddLink {
        /// The new link's number.
        new: u8,
        /// The link the exchange flows on.
        via: u8,
        /// Where it stands.
        step: ServerAddStep,
        /// Part of a first contact (the connection that created the group waits for it).
        first_contact: bool,
        /// Our RToken pairs not yet sent in ADD LINK CONTINUATION.
        ours_left: Vec<RtokenPair>,
    },
    /// Client: the server adds link `new` over link `via`.
    ClientAddLink {
        /// The new link's number.
        new: u8,
        /// The link the exchange flows on.
        via: u8,
        /// Where it stands.
        step: ClientAddStep,
        /// Part of a first contact.
        first_contact: bool,
        /// Our RToken pairs not yet sent.
        ours_left: Vec<RtokenPair>,
    },
    /// Server: DELETE LINK for link `link` sent over `via`, reply awaited.
    DeleteLink {
        /// The link being deleted.
        link: u8,
        /// The link the request flows on.
        via: u8,
    },
    /// Client (first contact, C.7): our DELETE LINK for the second link is out; the socket
    /// opens once the server's DELETE LINK request for it arrives and we reply.
    ClientAwaitDelete {
        /// The link.
        link: u8,
    },
}

/// Steps of a server-side ADD LINK exchange (Fig. 9, Fig. 15).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ServerAddStep {
    /// ADD LINK request sent; ADD LINK reply awaited.
    SentAddLink,
    /// ADD LINK CONTINUATION sent; the client's continuation awaited.
    SentCont,
    /// CONFIRM LINK sent on the new link; its reply awaited.
    SentConfirmLink,
}

/// Steps of a client-side ADD LINK exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ClientAddStep {
    /// ADD LINK reply sent; the server's first continuation awaited.
    SentReply,
    /// Our continuation sent; the next one (or CONFIRM LINK on the new link) awaited.
    SentCont {
        /// The server announced more RToken pairs than it has sent so far.
        server_owes: bool,
    },
}

/// An RMB configuration change we started (CONFIRM RKEY / DELETE RKEY); may run concurrently
/// with the peer's own (RFC 7609 §3.5.5.3).
#[derive(Debug, Clone)]
pub enum RkeyExchange {
    /// CONFIRM RKEY for `rmb` sent over `via`, reply awaited.
    Confirm {
        /// The RMB.
        rmb: RmbId,
        /// The link used.
        via: u8,
    },
    /// DELETE RKEY for `rmbs` sent over `via`, reply awaited.
    Delete {
        /// The RMBs.
        rmbs: Vec<RmbId>,
        /// The link used.
        via: u8,
    },
}

impl RkeyExchange {
    /// The link the exchange flows on.
    pub(crate) fn via(&self) -> u8 {
        match self {
            RkeyExchange::Confirm { via, .. } | RkeyExchange::Delete { via, .. } => *via,
        }
    }

    /// The local request that starts this exchange again.
    pub(crate) fn retry(self) -> LocalRequest {
        match self {
            RkeyExchange::Confirm { rmb, .. } => LocalRequest::ConfirmRkey(rmb),
            RkeyExchange::Delete { rmbs, .. } => LocalRequest::DeleteRkey(rmbs),
        }
    }
}

/// A configuration change we want to start once none is in progress.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LocalRequest {
    /// Tell the peer about a new RMB on every link (Fig. 12, Fig. 13).
    ConfirmRkey(RmbId),
    /// Remove RMBs (Fig. 14).
    DeleteRkey(Vec<RmbId>),
    /// Server: add a link if a usable pair of RNICs exists.
    AddLink,
    /// Server: delete one link.
    DeleteLink {
        /// The link.
        link: u8,
        /// Orderly (the link is still usable) or not.
        orderly: bool,
        /// Reason.
        reason: smc_wire::llc::DeleteLinkReason,
    },
}

/// The timers of a link group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LgrTimer {
    /// The reply (or next message) of the link exchange in progress is due (App. C.7).
    LinkExchange,
    /// The reply to our CONFIRM RKEY / DELETE RKEY is due (App. C.7).
    RkeyExchange,
    /// Retry adding a second link (App. C.8).
    AddLinkRetry,
    /// The group has had no connection for the idle time: the server terminates it.
    Idle,
    /// Client: the server's DELETE LINK for a link we asked to delete is due (App. C.7).
    DeleteLinkWait,
}

impl TimerKind for LgrTimer {
    const ALL: &'static [Self] = &[
        LgrTimer::LinkExchange,
        LgrTimer::RkeyExchange,
        LgrTimer::AddLinkRetry,
        LgrTimer::Idle,
        LgrTimer::DeleteLinkWait,
    ];
    fn index(self) -> usize {
        self as usize
    }
}

/// One link group.
#[derive(Debug)]
pub struct LinkGroup {
    /// Identifier.
    pub id: LgrId,
    /// Our role.
    pub role: Role,
    /// The peer.
    pub peer_id: PeerId,
    /// Negotiated maximum number of symmetric links (2..=8).
    pub max_links: u8,
    /// Links by link number.
    pub links: BTreeMap<u8, Link>,
    /// Last link number assigned (server), for the no-reuse rule.
    pub last_link_num: u8,
    /// Our RMB elements.
    pub pool: RmbPool,
    /// Our RMBs' RTokens.
    pub local_rmbs: BTreeMap<RmbId, LocalRmb>,
    /// The peer's RMBs' RTokens.
    pub peer_rmbs: Vec<PeerRmb>,
    /// Which peer RMBE each of our connections writes into (§4.4.2).
    pub peer_rmbes: PeerRmbeRegistry<TcpId>,
    /// The connections (established or being set up) on this group.
    pub conns: BTreeSet<TcpId>,
    /// How many established connections of the group send on each link (by link number),
    /// for choosing the least loaded link without visiting every connection.
    senders: BTreeMap<u8, usize>,
    /// The link exchange in progress.
    pub link_exchange: Option<LinkExchange>,
    /// Our RKey exchange in progress.
    pub rkey_exchange: Option<RkeyExchange>,
    /// Configuration changes we want to start.
    pub pending: VecDeque<LocalRequest>,
    /// Peer messages queued by a collision rule, processed after the current exchange.
    pub queued: VecDeque<(u8, LlcMessage)>,
    /// The TCP connection of the first contact, while its setup is not complete.
    pub first_contact: Option<TcpId>,
    /// Timers.
    pub timers: TimerTable<LgrTimer, 5>,
    /// The path MTU of our links.
    pub mtu: QpMtu,
    /// Link numbers deleted (a late DELETE LINK for them is a timing window, not an error).
    pub deleted: BTreeSet<u8>,
    /// The peer QPs of the last links removed (newest last, at most [`GONE_REMOTES`]): an
    /// Accept naming one of them raced with the link's failure and is no sign of a link
    /// group out of sync.
    pub gone_remotes: VecDeque<RemoteQp>,
    /// A peer CONFIRM RKEY awaiting its CONTINUATION: (peer RMB index, tokens still to
    /// come, the first message).
    pub rkey_cont: Option<(usize, u8, smc_wire::llc::ConfirmRkey)>,
    /// Client: links we asked the server to delete, with the link the request went over.
    pub client_deleting: BTreeMap<u8, u8>,
    /// The RNICs this group may use: those of its connections' physical network (PNET).
    pub pnet: DeviceSet,
    /// Server, first contact: the QP of the second link, made while the connection could
    /// still decline (so that running out of resources for it is a Decline and TCP, not a
    /// client waiting for an ADD LINK that never comes); used by the ADD LINK, destroyed
    /// if the first contact ends without it.
    pub spare: Option<SpareQp>,
    /// SMC-Rv2: what the group agreed on; `None` for a version-1 group. Its LLC messages go
    /// in their v2 form.
    pub v2: Option<crate::endpoint::LgrV2>,
}

/// A QP made ahead of the link that will use it ([`LinkGroup::spare`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpareQp {
    /// The link id the QP was created for.
    pub id: LinkId,
    /// Its RNIC.
    pub device: DeviceId,
    /// The QP.
    pub qp: QpInfo,
}

/// How many removed links' peer QPs a group remembers ([`LinkGroup::gone_remotes`]).
pub const GONE_REMOTES: usize = 8;

impl LinkGroup {
    /// A group with no link, no RMB, no connection and no exchange in progress.
    pub(crate) fn new(
        id: LgrId,
        role: Role,
        peer_id: PeerId,
        max_links: u8,
        pool: RmbPool,
        mtu: QpMtu,
    ) -> Self {
        LinkGroup {
            id,
            role,
            peer_id,
            max_links,
            links: BTreeMap::new(),
            last_link_num: 0,
            pool,
            local_rmbs: BTreeMap::new(),
            peer_rmbs: Vec::new(),
            peer_rmbes: PeerRmbeRegistry::new(),
            conns: BTreeSet::new(),
            senders: BTreeMap::new(),
            link_exchange: None,
            rkey_exchange: None,
            pending: VecDeque::new(),
            queued: VecDeque::new(),
            first_contact: None,
            timers: TimerTable::new(),
            mtu,
            deleted: BTreeSet::new(),
            gone_remotes: VecDeque::new(),
            rkey_cont: None,
            client_deleting: BTreeMap::new(),
            pnet: DeviceSet::ALL,
            spare: None,
            v2: None,
        }
    }

    /// The link exchange in progress is over: forget it and stop its timer.
    pub(crate) fn end_link_exchange(&mut self) {
        self.link_exchange = None;
        self.timers.stop(LgrTimer::LinkExchange);
    }

    /// Our RKey exchange in progress is over: forget it and stop its timer.
    pub(crate) fn end_rkey_exchange(&mut self) {
        self.rkey_exchange = None;
        self.timers.stop(LgrTimer::RkeyExchange);
    }

    /// Active links, in link-number order.
    pub fn active_links(&self) -> impl Iterator<Item = &Link> {
        self.links.values().filter(|l| l.state == LinkState::Active)
    }

    /// How many established connections of the group send on link `num`.
    pub fn senders_on(&self, num: u8) -> usize {
        self.senders.get(&num).copied().unwrap_or(0)
    }

    /// An established connection sends on link `num` from now on.
    pub(crate) fn add_sender(&mut self, num: u8) {
        *self.senders.entry(num).or_insert(0) += 1;
    }

    /// An established connection no longer sends on link `num` (moved or gone).
    pub(crate) fn remove_sender(&mut self, num: u8) {
        if let Some(n) = self.senders.get_mut(&num) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.senders.remove(&num);
            }
        }
    }

    /// The number of active links.
    pub fn active_count(&self) -> usize {
        self.active_links().count()
    }

    /// The link with endpoint id `id`.
    pub fn link_by_id(&self, id: LinkId) -> Option<&Link> {
        self.links.values().find(|l| l.id == id)
    }

    /// Next link number for a new link: the one after the last assigned that is free,
    /// so numbers are not reused until the space 1..=255 is exhausted.
    //= https://www.rfc-editor.org/rfc/rfc7609#section-2.2.2
    //# link numbers cannot be reused until the entire link numbering space has been
    //# exhausted.
    pub fn next_link_num(&mut self) -> Option<u8> {
        let mut n = self.last_link_num;
        for _ in 0..255 {
            n = if n == 255 { 1 } else { n + 1 };
            if !self.links.contains_key(&n) {
                self.last_link_num = n;
                return Some(n);
            }
        }
        None
    }

    /// The first of our `devices` RNICs (by index) of the group's physical network that no
    /// link of the group uses.
    pub(crate) fn unused_device(&self, devices: usize) -> Option<DeviceId> {
        (0..devices.min(256))
            .map(|d| DeviceId(d as u8))
            .filter(|d| self.pnet.contains(*d))
            .find(|d| !self.links.values().any(|l| l.device == *d))
    }

    /// The RNIC of the lowest-numbered link.
    pub(crate) fn first_device(&self) -> Option<DeviceId> {
        self.links.values().next().map(|l| l.device)
    }

    /// Link `num` is connected to the peer's QP `qpn` on its RNIC `gid`.
    pub(crate) fn link_reaches(&self, num: u8, qpn: smc_wire::U24, gid: smc_wire::Gid) -> bool {
        self.links
            .get(&num)
            .and_then(|l| l.remote)
            .is_some_and(|r| r.qpn == qpn && r.gid == gid)
    }

    /// Whether a connection given an element of our RMB `rmb` must wait before it goes
    /// active: the RMB's RTokens have not yet been confirmed to the peer on every link. A
    /// CONFIRM RKEY for it is then queued unless one is already pending or in progress (the
    /// connection that created the RMB queued it; a later one sharing the RMB waits for the
    /// same exchange).
    //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.5.2.1
    //# To preserve failover capability, any TCP connection that uses a newly added RMB
    //# cannot go active until all RTokens for the RMB have been communicated for all of the
    //# links in the link group.
    pub(crate) fn rmb_awaits_confirm(&mut self, rmb: RmbId) -> bool {
        if self.local_rmbs.get(&rmb).is_none_or(|r| r.confirmed) {
            return false;
        }
        let request = LocalRequest::ConfirmRkey(rmb);
        let running =
            matches!(self.rkey_exchange, Some(RkeyExchange::Confirm { rmb: r, .. }) if r == rmb);
        if !running && !self.pending.contains(&request) {
            self.pending.push_back(request);
        }
        true
    }

    /// Every peer RMB in use has an RToken on link `num`.
    pub(crate) fn peer_rmbs_known_on(&self, num: u8) -> bool {
        self.peer_rmbs
            .iter()
            .all(|r| r.tokens.is_empty() || r.tokens.contains_key(&num))
    }

    /// Both sides have withdrawn every RMB they gave the group and no connection is on it:
    /// no connection, no RMB of the peer still known here (each one withdrawn by the peer's
    /// DELETE RKEY), none of ours the peer still knows (each DELETE RKEY of ours answered)
    /// and no configuration exchange running or waiting. Nothing is left that either side
    /// would still send on the group but a DELETE LINK — what a process that ends waits for
    /// before it deletes the group (`smc::lgr_exit`).
    //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.5.2.2
    //# Once an SMC-R peer decides to delete an RMB, it sends a DELETE RKEY
    //# LLC message to its peer.  It can then free the RMB once it receives
    //# a response from the peer.
    pub fn rmbs_withdrawn(&self) -> bool {
        self.conns.is_empty()
            && self.first_contact.is_none()
            && self.link_exchange.is_none()
            && self.rkey_exchange.is_none()
            && self.pending.is_empty()
            && self.queued.is_empty()
            && self.rkey_cont.is_none()
            && self.peer_rmbs.iter().all(|r| r.tokens.is_empty())
            && self.local_rmbs.values().all(|r| !r.confirmed)
    }

    /// Whether a link between our `device` and the peer's `gid` would be parallel to an
    /// existing link (same RNIC pair).
    //= https://www.rfc-editor.org/rfc/rfc7609#section-2.2.1
    //# Parallel link: not allowed -- SMC-R links having the same physical RNIC at both hosts
    pub fn would_be_parallel(&self, device: DeviceId, peer_gid: smc_wire::Gid) -> bool {
        self.links
            .values()
            .any(|l| l.device == device && l.remote.is_some_and(|r| r.gid == peer_gid))
    }

    /// The LLC version of the group's links (which sizes their receive buffers).
    pub fn llc_version(&self) -> LlcVersion {
        if self.v2.is_some() {
            LlcVersion::V2
        } else {
            LlcVersion::V1
        }
    }

    /// Symmetric links (asymmetric ones are not counted toward the maximum).
    pub fn symmetric_count(&self) -> usize {
        self.links.values().filter(|l| !l.asymmetric).count()
    }

    /// The peer RMB whose RToken on link `num` is `rkey`.
    pub fn peer_rmb_index(&self, num: u8, rkey: u32) -> Option<usize> {
        self.peer_rmbs
            .iter()
            .position(|r| r.tokens.get(&num).is_some_and(|t| t.rkey == rkey))
    }

    /// Our RMB whose RToken on link `num` is `rkey`.
    pub fn local_rmb_by_rkey(&self, num: u8, rkey: u32) -> Option<RmbId> {
        self.local_rmbs
            .iter()
            .find(|(_, r)| r.tokens.get(&num).is_some_and(|t| t.rkey == rkey))
            .map(|(id, _)| *id)
    }

    /// The earliest deadline of the group and its links.
    pub fn next_deadline(&self) -> Option<Timestamp> {
        self.links
            .values()
            .filter_map(|l| l.timers.next_deadline())
            .chain(self.timers.next_deadline())
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rmb_pool::RmbPoolConfig;

    fn lgr() -> LinkGroup {
        let pool = RmbPool::new(RmbPoolConfig::default()).expect("pool");
        LinkGroup::new(
            LgrId(1),
            Role::Server,
            PeerId::default(),
            2,
            pool,
            QpMtu::MTU_1024,
        )
    }

    fn link(num: u8) -> Link {
        let qp = QpInfo {
            qpn: smc_wire::U24::truncate(1),
            psn: smc_wire::U24::truncate(1),
        };
        let id = LinkId(u32::from(num));
        Link {
            state: LinkState::Active,
            ..Link::activating(id, num, DeviceId(0), qp, 0, Timestamp::ZERO)
        }
    }

    #[test]
    fn link_numbers_not_reused_until_exhausted() {
        let mut g = lgr();
        assert_eq!(g.next_link_num(), Some(1));
        g.links.insert(1, link(1));
        assert_eq!(g.next_link_num(), Some(2));
        // Link 2 was deleted again: the next number is 3, not 2.
        assert_eq!(g.next_link_num(), Some(3));
        g.last_link_num = 255;
        // Wraps, skipping the number in use.
        assert_eq!(g.next_link_num(), Some(2));
        for n in 1..=255u8 {
            g.links.insert(n, link(n));
        }
        assert_eq!(g.next_link_num(), None);
    }
}
