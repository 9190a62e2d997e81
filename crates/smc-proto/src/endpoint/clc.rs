//! CLC rendezvous (RFC 7609 §3.5.1–§3.5.2, App. C.1–C.6) and the first contact's link setup
//! (§3.5.3, Fig. 8, Fig. 42).
//!
//! Each handshake state holds only what its phase needs: the client goes `ExpectAccept` →
//! (`ClientAwaitRkey` →) established, or on a first contact `ExpectAccept` →
//! `ExpectConfirmLink` → `ConfirmLinkSending` → `ExpectSecondLink` → established; the server
//! goes `ExpectProposal` → (`ServerAwaitRkey` →) `ExpectConfirm` → established, or on a first
//! contact `ExpectConfirm` → `ExpectConfirmLinkReply` → `ExpectSecondLink` → established.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use smc_wire::clc::{Ipv6Prefix, SmcdArea};
use smc_wire::clc_v2::{smc_type, AcceptConfirmV2, ProposalV2Ext, SMC_RELEASE};
use smc_wire::llc::ConfirmLink;
use smc_wire::{
    AcceptConfirm, CdcMessage, ClcHeader, ClcMessage, Decline, DeclineCode, ErrorClass, LlcMessage,
    Proposal, QpMtu,
};

use super::{
    Endpoint, EndpointError, EndpointEvent, Entry, Fallback, LocalSetup, ResetReason, SmcConn,
    TcpId,
};
use crate::conn::{Connection, ConnectionConfig};
use crate::fabric::{DeviceId, DeviceSet, LgrId, LlcVersion, MrInfo, RemoteQp, Resources};
use crate::link_group::{Link, LinkGroup, LinkState, LocalRequest, LocalRmb, PeerRmb, Role};
use crate::rmb_pool::{PeerRmbeKey, RmbPool};
use crate::rmbe::RmbeLayout;
use crate::time::Timestamp;

/// Linux's flag bits in CONFIRM LINK: "no RMBE eye catcher" (wire-formats.md §1 item 1).
const CONFIRM_LINK_NO_EYECATCHER: bool = true;

/// A TCP connection whose CLC handshake (and, on a first contact, link setup) is in progress.
#[derive(Debug)]
pub struct Handshake {
    role: Role,
    state: HsState,
    /// CLC bytes received and not yet parsed.
    buf: Vec<u8>,
    /// C.5: deadline of the whole CLC exchange.
    clc_deadline: Timestamp,
    /// Client: when it stops waiting for an answer to its Proposal and declines
    /// ([`EndpointConfig::accept_wait`](super::EndpointConfig::accept_wait)).
    accept_deadline: Option<Timestamp>,
    /// C.7: deadline of the LLC message awaited during a first contact.
    llc_deadline: Option<Timestamp>,
    /// Client, subsequent contact: the server's Accept, kept while our CONFIRM RKEY runs.
    peer_accept: Option<AcceptConfirm>,
    /// Client, subsequent contact: index of the server's RMB in the group's table.
    peer_rmb: Option<usize>,
    /// CDCs that overtook the end of a first contact's second-link exchange.
    held: Vec<CdcMessage>,
    /// What the application chose for this connection.
    opts: ConnectOptions,
    /// Client: our Proposal offered SMC-Rv2.
    offered_v2: bool,
    /// The CLC exchange is in version 2 (a v2 Proposal received, or a v2 Accept): our
    /// Declines are 44-byte version-2 Declines (smc-rv2.md §4.3).
    clc_v2: bool,
    /// Server: the SMC-Rv2 agreement reached on the Proposal, until the Confirm is checked.
    agreed_v2: Option<super::LgrV2>,
}

/// Per-connection choices the application makes before the CLC handshake.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConnectOptions {
    /// The RNICs on the physical network (PNET) the connection's TCP traffic uses. A link
    /// group serving the connection uses only these; with none, the connection falls back
    /// (Decline "no SMC-R device found").
    pub pnet: DeviceSet,
    /// Size of the connection's RMBE (its receive buffer); `None`: the endpoint's default
    /// ([`EndpointConfig::rmbe_size`](super::EndpointConfig::rmbe_size)).
    pub rmbe_size: Option<smc_wire::RmbeSize>,
}

/// Most CDCs held for a connection not yet open (a well-behaved peer sends few: it cannot
/// write more than one RMBE's worth without our consumer cursor).
const MAX_HELD_CDCS: usize = 256;

#[derive(Debug)]
enum HsState {
    /// Server: waiting for the client's Proposal.
    ExpectProposal,
    /// Client: Proposal sent from `device`.
    ExpectAccept { device: DeviceId },
    /// Client, subsequent contact: our new RMB is being confirmed (Fig. 13); Confirm follows.
    ClientAwaitRkey { setup: LocalSetup, link: u8 },
    /// Server, subsequent contact: our new RMB is being confirmed; Accept follows.
    ServerAwaitRkey { setup: LocalSetup, link: u8 },
    /// Server: Accept sent; Confirm awaited. CDCs that overtake the Confirm are held
    /// (§3.5.2.4).
    ExpectConfirm {
        setup: LocalSetup,
        link: u8,
        first_contact: bool,
        held: Vec<CdcMessage>,
    },
    /// Client, first contact: Confirm sent; the server's CONFIRM LINK awaited on the new link.
    ExpectConfirmLink {
        setup: LocalSetup,
        peer: AcceptConfirm,
        link: u8,
    },
    /// Server, first contact: our QP is being connected to the client's (`posted` false:
    /// the CONFIRM LINK goes once it is and the client's RMB is taken in,
    /// [`Endpoint::link_connected`]); then CONFIRM LINK sent (`sent`: its completion came),
    /// the reply awaited.
    ExpectConfirmLinkReply {
        setup: LocalSetup,
        peer: AcceptConfirm,
        link: u8,
        posted: bool,
        sent: bool,
    },
    /// Client, first contact: CONFIRM LINK reply posted; its completion is the point of no
    /// return (C.2).
    ConfirmLinkSending {
        setup: LocalSetup,
        peer: AcceptConfirm,
        link: u8,
    },
    /// First contact past the point of no return: the second-link exchange runs.
    ExpectSecondLink {
        setup: LocalSetup,
        peer: AcceptConfirm,
        link: u8,
    },
}

impl Handshake {
    /// The state's name (diagnostics).
    pub fn name(&self) -> &'static str {
        match self.state {
            HsState::ExpectProposal => "ExpectProposal",
            HsState::ExpectAccept { .. } => "ExpectAccept",
            HsState::ClientAwaitRkey { .. } => "ClientAwaitRkey",
            HsState::ServerAwaitRkey { .. } => "ServerAwaitRkey",
            HsState::ExpectConfirm { .. } => "ExpectConfirm",
            HsState::ExpectConfirmLink { .. } => "ExpectConfirmLink",
            HsState::ExpectConfirmLinkReply { .. } => "ExpectConfirmLinkReply",
            HsState::ConfirmLinkSending { .. } => "ConfirmLinkSending",
            HsState::ExpectSecondLink { .. } => "ExpectSecondLink",
        }
    }

    /// Our role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// Whether CLC messages are still expected (C.5 timer applies).
    fn in_clc(&self) -> bool {
        matches!(
            self.state,
            HsState::ExpectProposal
                | HsState::ExpectAccept { .. }
                | HsState::ClientAwaitRkey { .. }
                | HsState::ServerAwaitRkey { .. }
                | HsState::ExpectConfirm { .. }
        )
    }

    /// Whether the handshake waits for an LLC exchange (see
    /// [`Endpoint::handshake_awaits_fabric`]).
    pub(super) fn awaits_fabric(&self) -> bool {
        match self.state {
            HsState::ExpectProposal | HsState::ExpectAccept { .. } => false,
            HsState::ExpectConfirm { .. } => false,
            HsState::ClientAwaitRkey { .. }
            | HsState::ServerAwaitRkey { .. }
            | HsState::ExpectConfirmLink { .. }
            | HsState::ExpectConfirmLinkReply { .. }
            | HsState::ConfirmLinkSending { .. }
            | HsState::ExpectSecondLink { .. } => true,
        }
    }

    /// The next deadline.
    pub(super) fn deadline(&self) -> Option<Timestamp> {
        let clc = self.in_clc().then_some(self.clc_deadline);
        clc.into_iter()
            .chain(self.llc_deadline)
            .chain(self.accept_wait_deadline())
            .min()
    }

    /// A client still without any byte of the server's answer to its Proposal: when it
    /// stops waiting for it.
    fn accept_wait_deadline(&self) -> Option<Timestamp> {
        match self.state {
            HsState::ExpectAccept { .. } if self.buf.is_empty() => self.accept_deadline,
            _ => None,
        }
    }

    fn setup(&self) -> Option<(LocalSetup, u8)> {
        match &self.state {
            HsState::ExpectProposal | HsState::ExpectAccept { .. } => None,
            HsState::ClientAwaitRkey { setup, link }
            | HsState::ServerAwaitRkey { setup, link }
            | HsState::ExpectConfirm { setup, link, .. }
            | HsState::ExpectConfirmLink { setup, link, .. }
            | HsState::ExpectConfirmLinkReply { setup, link, .. }
            | HsState::ConfirmLinkSending { setup, link, .. }
            | HsState::ExpectSecondLink { setup, link, .. } => Some((*setup, *link)),
        }
    }

    fn is_first_contact(&self) -> bool {
        matches!(
            self.state,
            HsState::ExpectConfirm {
                first_contact: true,
                ..
            } | HsState::ExpectConfirmLink { .. }
                | HsState::ExpectConfirmLinkReply { .. }
                | HsState::ConfirmLinkSending { .. }
                | HsState::ExpectSecondLink { .. }
        )
    }
}

/// The server's subnet check (RFC 7609 §3.5.1): the client's IPv4 network number and prefix
/// length equal one of ours, or one of its IPv6 prefixes equals one of ours.
//= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.1
//# For IPv4, the server does this by verifying that it has an interface with an IP subnet
//# number that matches the subnet number sent by the client in the SMC Proposal.  For
//# IPv6, it does this by verifying that it is directly attached to at least one IP prefix
//# that was listed by the client in its SMC Proposal message.
pub fn subnet_matches(proposal: &Proposal, ipv4: &[(Ipv4Addr, u8)], ipv6: &[Ipv6Prefix]) -> bool {
    let v4 = proposal.ipv4_prefix_len > 0
        && ipv4.iter().any(|(net, len)| {
            *len == proposal.ipv4_prefix_len
                && mask4(*net, *len) == mask4(proposal.ipv4_subnet, *len)
        });
    let v6 = proposal.ipv6_prefixes.iter().any(|p| {
        ipv6.iter().any(|q| {
            q.prefix_len == p.prefix_len
                && mask6(q.prefix.octets(), q.prefix_len) == mask6(p.prefix.octets(), p.prefix_len)
        })
    });
    v4 || v6
}

fn mask4(a: Ipv4Addr, len: u8) -> u32 {
    let m = if len == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(len.min(32)))
    };
    u32::from(a) & m
}

fn mask6(a: [u8; 16], len: u8) -> u128 {
    let m = if len == 0 {
        0
    } else {
        u128::MAX << (128 - u32::from(len.min(128)))
    };
    u128::from_be_bytes(a) & m
}

/// How one received CLC message is to be handled.
enum Parsed {
    Msg(ClcMessage),
    /// A message we cannot use because of a bad enumerated value: Decline (C.6).
    BadValue,
    /// Malformed: protocol error, terminate (C.6).
    Malformed(&'static str),
}

fn parse_one(bytes: &[u8]) -> Parsed {
    match ClcMessage::parse(bytes) {
        Ok((m, _)) => Parsed::Msg(m),
        Err(e) => match e.class() {
            ErrorClass::BadValue => Parsed::BadValue,
            _ => Parsed::Malformed("malformed CLC message"),
        },
    }
}

mod client;
mod server;

impl Endpoint {
    // ----- Application commands ------------------------------------------------------------

    /// Start the client side of the CLC handshake on a TCP connection whose SYN/SYN-ACK both
    /// carried the SMC-R option: sends the Proposal.
    pub fn connect(&mut self, tcp: TcpId, now: Timestamp) -> Result<(), EndpointError> {
        self.connect_with(tcp, ConnectOptions::default(), now)
    }

    /// [`connect`](Self::connect) with per-connection options (physical network, RMBE size).
    pub fn connect_with(
        &mut self,
        tcp: TcpId,
        opts: ConnectOptions,
        now: Timestamp,
    ) -> Result<(), EndpointError> {
        if self.entries.contains_key(&tcp) {
            return Err(EndpointError::DuplicateConnection);
        }
        let Some(device) = opts.pnet.first(self.config.devices.len()) else {
            // No RNIC on the connection's physical network (or none at all: a stack whose
            // fabric could not be opened): the Decline takes the place of the Proposal, so
            // the server falls back at once instead of waiting.
            self.begin_handshake(tcp, Role::Client, HsState::ExpectProposal, opts, now);
            self.decline(tcp, DeclineCode::NOSMCRDEV, false, now);
            return Ok(());
        };
        let dev = self.device(device).ok_or(EndpointError::NoDevice)?;
        let versions = self.config.versions;
        // smc-rv2.md §5.5: SMC-Rv2 is offered only with a UEID and a RoCEv2-capable device.
        let offer_v2 = versions.v2 && !self.config.ueids.is_empty() && dev.roce_v2;
        if !versions.v1 && !offer_v2 {
            // §5.5: "Neither → a v1 Decline 0x03030000 instead of a Proposal".
            self.begin_handshake(tcp, Role::Client, HsState::ExpectProposal, opts, now);
            self.decline(tcp, DeclineCode::NOSMCDEV, false, now);
            return Ok(());
        }
        let (ipv4_subnet, ipv4_prefix_len) = self
            .config
            .ipv4_subnets
            .first()
            .map(|(n, l)| (Ipv4Addr::from(mask4(*n, *l)), *l))
            .unwrap_or((Ipv4Addr::UNSPECIFIED, 0));
        //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.1
        //# If SMC-R is supported by both peers, the client sends an SMC Proposal CLC message
        //# to the server.
        let mut proposal = Proposal {
            version: 1,
            smc_type_v1: smc_type::R,
            smc_type_v2: smc_type::NONE,
            peer_id: self.config.peer_id,
            preferred_gid: dev.gid,
            preferred_mac: dev.mac,
            smcd_area: None,
            ipv4_subnet,
            ipv4_prefix_len,
            ipv6_prefixes: self.config.ipv6_prefixes.clone(),
            v2_ext: None,
            smcd_v2_ext: Vec::new(),
        };
        if offer_v2 {
            // smc-rv2.md §5: version 2, v1 type R (with its IP area) when v1 is offered too,
            // else none (v1 part zero except the peer ID, which we fill so that a restarted
            // process is never taken for its previous life, §9.3).
            proposal.version = 2;
            proposal.smc_type_v2 = smc_type::R;
            proposal.smcd_area = Some(SmcdArea::default());
            if !versions.v1 {
                proposal.smc_type_v1 = smc_type::NONE;
                proposal.preferred_gid = smc_wire::Gid::default();
                proposal.preferred_mac = smc_wire::Mac::default();
                proposal.ipv4_subnet = Ipv4Addr::UNSPECIFIED;
                proposal.ipv4_prefix_len = 0;
                proposal.ipv6_prefixes.clear();
            }
            proposal.v2_ext = Some(ProposalV2Ext {
                eids: self
                    .config
                    .ueids
                    .iter()
                    .take(smc_wire::eid::MAX_UEIDS)
                    .copied()
                    .collect(),
                release: SMC_RELEASE,
                roce_v2_gid: dev.gid,
                max_conns: self.config.max_conns_per_lgr.min(255) as u8,
                max_links: super::V2_MAX_LINKS,
                ..Default::default()
            });
        }
        self.send_clc(tcp, &ClcMessage::Proposal(proposal));
        self.begin_handshake(
            tcp,
            Role::Client,
            HsState::ExpectAccept { device },
            opts,
            now,
        );
        if let Some(Entry::Setup(h)) = self.entries.get_mut(&tcp) {
            h.offered_v2 = offer_v2;
        }
        Ok(())
    }

    /// Start the server side of the CLC handshake on an accepted TCP connection whose SYN and
    /// SYN-ACK both carried the SMC-R option: waits for the Proposal.
    pub fn accept(&mut self, tcp: TcpId, now: Timestamp) -> Result<(), EndpointError> {
        self.accept_with(tcp, ConnectOptions::default(), now)
    }

    /// [`accept`](Self::accept) with per-connection options (physical network, RMBE size).
    pub fn accept_with(
        &mut self,
        tcp: TcpId,
        opts: ConnectOptions,
        now: Timestamp,
    ) -> Result<(), EndpointError> {
        if self.entries.contains_key(&tcp) {
            return Err(EndpointError::DuplicateConnection);
        }
        self.begin_handshake(tcp, Role::Server, HsState::ExpectProposal, opts, now);
        Ok(())
    }

    /// Start the client side of a connection whose SYN/SYN-ACK both carried the SMC-R option
    /// with a Decline in place of the Proposal, and fall back to TCP at once: for a client
    /// that cannot wait for the server's answer (a program connecting to its own listener
    /// accepts only after `connect` returned). The server falls back on reading it.
    pub fn connect_declined(
        &mut self,
        tcp: TcpId,
        code: DeclineCode,
        now: Timestamp,
    ) -> Result<(), EndpointError> {
        if self.entries.contains_key(&tcp) {
            return Err(EndpointError::DuplicateConnection);
        }
        self.begin_handshake(
            tcp,
            Role::Client,
            HsState::ExpectProposal,
            ConnectOptions::default(),
            now,
        );
        //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.1
        //# when an SMC Decline is sent in lieu of an expected CLC message, no confirmation is
        //# required, and the TCP connection immediately falls back to using the IP fabric.
        self.decline(tcp, code, false, now);
        Ok(())
    }

    /// Track `tcp` as a CLC handshake starting in `state`; the C.5 timer runs from `now`.
    fn begin_handshake(
        &mut self,
        tcp: TcpId,
        role: Role,
        state: HsState,
        opts: ConnectOptions,
        now: Timestamp,
    ) {
        self.entries.insert(
            tcp,
            Entry::Setup(Box::new(Handshake {
                role,
                state,
                buf: Vec::new(),
                clc_deadline: now + self.config.clc_timeout,
                accept_deadline: match role {
                    Role::Client => self.config.accept_wait.map(|w| now + w),
                    Role::Server => None,
                },
                llc_deadline: None,
                peer_accept: None,
                peer_rmb: None,
                held: Vec::new(),
                opts,
                offered_v2: false,
                clc_v2: false,
                agreed_v2: None,
            })),
        );
    }

    /// The TCP connection was reset by the peer during setup (or later): forget it.
    pub fn handle_tcp_reset(&mut self, tcp: TcpId, now: Timestamp) {
        match self.entries.get_mut(&tcp) {
            Some(Entry::Setup(_)) => {
                self.setup_reset(tcp, ResetReason::PeerReset, now);
            }
            Some(Entry::Smc(c)) => {
                c.conn.handle_tcp_reset(now);
                self.after_conn(tcp, now);
            }
            None => {}
        }
    }

    // ----- TCP input -----------------------------------------------------------------------

    /// Bytes read from the TCP connection while its CLC handshake runs. Bytes for a
    /// connection that is not in a handshake are ignored (after a fallback they are
    /// application data and never come here).
    pub fn handle_tcp_data(
        &mut self,
        tcp: TcpId,
        bytes: &[u8],
        res: &mut dyn Resources,
        now: Timestamp,
    ) {
        let Some(Entry::Setup(h)) = self.entries.get_mut(&tcp) else {
            return;
        };
        h.buf.extend_from_slice(bytes);
        loop {
            let Some(Entry::Setup(h)) = self.entries.get_mut(&tcp) else {
                return;
            };
            if h.buf.len() < smc_wire::clc::HEADER_LEN {
                return;
            }
            let header = match ClcHeader::parse(&h.buf) {
                Ok(hd) => hd,
                Err(e) => {
                    //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.6
                    //# All protocol errors, with the exception of bad enumerated values,
                    //# must result in termination of the TCP connection.
                    let why = match e.class() {
                        ErrorClass::BadValue => "bad CLC header value",
                        _ => "malformed CLC header",
                    };
                    self.setup_reset(tcp, ResetReason::ClcProtocolError(why), now);
                    return;
                }
            };
            let len = usize::from(header.length);
            if h.buf.len() < len {
                return;
            }
            let rest = h.buf.split_off(len);
            let msg_bytes = std::mem::replace(&mut h.buf, rest);
            self.clc_message(tcp, &msg_bytes, res, now);
        }
    }

    fn clc_message(&mut self, tcp: TcpId, bytes: &[u8], res: &mut dyn Resources, now: Timestamp) {
        let parsed = parse_one(bytes);
        let Some(Entry::Setup(h)) = self.entries.get(&tcp) else {
            return;
        };
        // A Decline may come in lieu of any expected CLC message (C.1), and during the LLC
        // negotiation of a first contact until our point of no return (C.2).
        let expecting_clc = h.in_clc()
            || matches!(
                h.state,
                HsState::ExpectConfirmLink { .. }
                    | HsState::ExpectConfirmLinkReply { .. }
                    | HsState::ConfirmLinkSending { .. }
            );
        let msg = match parsed {
            Parsed::Malformed(why) => {
                self.setup_reset(tcp, ResetReason::ClcProtocolError(why), now);
                return;
            }
            Parsed::BadValue if expecting_clc && self.may_decline(tcp) => {
                //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.6
                //# If a reserved value is received, the proper error response is to send an
                //# SMC Decline and fall back to IP
                self.decline(tcp, DeclineCode::CNFERR, false, now);
                return;
            }
            Parsed::BadValue => {
                self.setup_reset(tcp, ResetReason::ClcProtocolError("bad value"), now);
                return;
            }
            Parsed::Msg(m) => m,
        };
        if let ClcMessage::Decline(d) = &msg {
            if expecting_clc {
                self.peer_declined(tcp, d, now);
            } else {
                self.setup_reset(
                    tcp,
                    ResetReason::ClcProtocolError("Decline past the point of no return"),
                    now,
                );
            }
            return;
        }
        let Some(Entry::Setup(h)) = self.entries.get_mut(&tcp) else {
            return;
        };
        let state = std::mem::replace(&mut h.state, HsState::ExpectProposal);
        match (state, msg) {
            (HsState::ExpectProposal, ClcMessage::Proposal(p)) => {
                self.on_proposal(tcp, p, res, now)
            }
            (HsState::ExpectAccept { device }, ClcMessage::Accept(a)) => {
                self.on_accept(tcp, device, a, res, now)
            }
            (
                HsState::ExpectConfirm {
                    setup,
                    link,
                    first_contact,
                    held,
                },
                ClcMessage::Confirm(c),
            ) => self.on_confirm(tcp, setup, link, first_contact, held, c, now),
            (state, _) => {
                //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.6
                //# Protocol errors occur during CLC negotiation when a message is received
                //# that is not expected.
                if let Some(Entry::Setup(h)) = self.entries.get_mut(&tcp) {
                    h.state = state;
                }
                self.setup_reset(
                    tcp,
                    ResetReason::ClcProtocolError("unexpected CLC message"),
                    now,
                );
            }
        }
    }

    /// Whether we may still send a Decline on this connection (no chase, C.1; point of no
    /// return, C.3): only in lieu of a message we expect.
    fn may_decline(&self, tcp: TcpId) -> bool {
        matches!(
            self.entries.get(&tcp),
            Some(Entry::Setup(h)) if !matches!(
                h.state,
                HsState::ExpectSecondLink { .. }
                    | HsState::ExpectConfirmLinkReply { sent: true, .. }
            )
        )
    }

    // ----- Outcomes ------------------------------------------------------------------------

    /// Send a Decline (in lieu of the message we expect) and fall back to TCP.
    pub(super) fn decline(
        &mut self,
        tcp: TcpId,
        code: DeclineCode,
        out_of_sync: bool,
        now: Timestamp,
    ) {
        let v2 = matches!(self.entries.get(&tcp), Some(Entry::Setup(h)) if h.clc_v2);
        let d = if v2 {
            Decline::new_v2(self.config.peer_id, code, out_of_sync)
        } else {
            Decline::new(self.config.peer_id, code, out_of_sync)
        };
        self.send_clc(tcp, &ClcMessage::Decline(d));
        self.fall_back(tcp, Fallback::Declined(code), now);
    }

    fn peer_declined(&mut self, tcp: TcpId, d: &Decline, now: Timestamp) {
        self.fall_back(
            tcp,
            Fallback::PeerDeclined {
                code: d.diagnosis,
                out_of_sync: d.out_of_sync,
            },
            now,
        );
        //= https://www.rfc-editor.org/rfc/rfc7609#appendix-A.2.5
        //# Indicates that the link group is out of sync and the receiving peer must clean up
        //# its representation of the link group.
        if d.out_of_sync {
            let groups: Vec<LgrId> = self
                .lgrs
                .values()
                .filter(|g| g.peer_id == d.peer_id)
                .map(|g| g.id)
                .collect();
            for g in groups {
                self.terminate_group(
                    g,
                    smc_wire::llc::DeleteLinkReason::PROTOCOL_VIOLATION,
                    false,
                    now,
                );
            }
        }
    }

    /// The options the application gave for the connection being set up on `tcp`.
    fn setup_options(&self, tcp: TcpId) -> ConnectOptions {
        match self.entries.get(&tcp) {
            Some(Entry::Setup(h)) => h.opts,
            _ => ConnectOptions::default(),
        }
    }

    fn fall_back(&mut self, tcp: TcpId, reason: Fallback, now: Timestamp) {
        //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.1
        //# when an SMC Decline is sent in lieu of an expected CLC message, no confirmation
        //# is required, and the TCP connection immediately falls back to using the IP
        //# fabric.
        let Some(Entry::Setup(h)) = self.entries.remove(&tcp) else {
            return;
        };
        tracing::debug!(?tcp, ?reason, leftover = h.buf.len(), "fell back to TCP");
        self.cleanup_setup(tcp, &h, now);
        self.stats.fallbacks += 1;
        self.events.push_back(EndpointEvent::FellBack {
            tcp,
            reason,
            leftover: h.buf.clone(),
        });
    }

    /// Break the TCP connection during setup (C.5, C.6, C.7).
    pub(super) fn setup_reset(&mut self, tcp: TcpId, reason: ResetReason, now: Timestamp) {
        let Some(Entry::Setup(h)) = self.entries.remove(&tcp) else {
            return;
        };
        tracing::info!(?tcp, ?reason, "setup reset");
        self.cleanup_setup(tcp, &h, now);
        self.stats.setup_resets += 1;
        self.events.push_back(EndpointEvent::Reset { tcp, reason });
    }

    /// Release what a failed setup held: the RMBE and alert token, and the whole link group
    /// when it was this connection's first contact.
    fn cleanup_setup(&mut self, tcp: TcpId, h: &Handshake, now: Timestamp) {
        let first = h.is_first_contact();
        if let Some((setup, _)) = h.setup() {
            self.alerts.remove(&setup.alert);
            if let Some(g) = self.lgrs.get_mut(&setup.lgr) {
                g.conns.remove(&tcp);
                let _ = g.pool.release(setup.alloc.handle);
                if g.first_contact == Some(tcp) {
                    g.first_contact = None;
                }
            }
            if first {
                self.destroy_link_group(setup.lgr, now);
            } else {
                self.maybe_idle(setup.lgr, now);
            }
        }
    }

    fn handshake_timeout_reason(h: &Handshake) -> ResetReason {
        match h.state {
            HsState::ExpectConfirmLink { .. } => ResetReason::LlcTimeout("CONFIRM LINK"),
            HsState::ExpectConfirmLinkReply { .. } => ResetReason::LlcTimeout("CONFIRM LINK reply"),
            HsState::ConfirmLinkSending { .. } => ResetReason::LlcTimeout("CONFIRM LINK send"),
            HsState::ExpectSecondLink { .. } => ResetReason::LlcTimeout("ADD LINK"),
            _ => ResetReason::ClcTimeout,
        }
    }

    /// A handshake's timer fired.
    pub(super) fn handshake_timeout(
        &mut self,
        tcp: TcpId,
        _res: &mut dyn Resources,
        now: Timestamp,
    ) {
        let Some(Entry::Setup(h)) = self.entries.get(&tcp) else {
            return;
        };
        if h.deadline().is_some_and(|d| d > now) {
            return;
        }
        // A client whose Proposal the server has not answered at all within its wait: the
        // server's program has not accepted the connection (a protocol that accepts it only
        // after the client used another connection: FTP's data connections). Not a broken
        // TCP connection (C.5 is for those): decline in place of the Accept and use TCP, as
        // Linux's client does when its wait on the CLC socket ends.
        if h.accept_wait_deadline().is_some_and(|d| d <= now) && now < h.clc_deadline {
            //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.1
            //# when an SMC Decline is sent in lieu of an expected CLC message, no
            //# confirmation is required, and the TCP connection immediately falls back to
            //# using the IP fabric.
            self.decline(tcp, DeclineCode::NOACCEPT, false, now);
            return;
        }
        // An SMC-Rv2 client that waited its 2 s for the server's ADD LINK goes on with one
        // link, as a Linux client does (smc-rv2.md §13 item 2, §14).
        if let HsState::ExpectSecondLink { setup, .. } = &h.state {
            let lgr = setup.lgr;
            if self.lgrs.get(&lgr).is_some_and(|g| g.v2.is_some()) {
                self.first_contact_done(lgr, now);
                return;
            }
        }
        //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.5
        //# If the TCP and/or CLC handshakes time out, the TCP connection must be terminated
        //# as it would be in a legacy IP environment
        //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7
        //# If the client's timer expires without receiving either an SMC Decline or a RoCE
        //# message confirmation from the server, there is a problem with either the server
        //# or the TCP fabric.  In either case, the client must break the TCP connection and
        //# clean up the SMC-R link.
        let reason = Self::handshake_timeout_reason(h);
        self.setup_reset(tcp, reason, now);
    }

    fn set_state(&mut self, tcp: TcpId, state: HsState) {
        if let Some(Entry::Setup(h)) = self.entries.get_mut(&tcp) {
            h.state = state;
        }
    }

    // ----- Link groups and RMBEs -----------------------------------------------------------

    /// Create a link group with one link (number `num`, provisional on the client) on
    /// `device`.
    fn new_link_group(
        &mut self,
        role: Role,
        peer_id: smc_wire::PeerId,
        (device, llc): (DeviceId, LlcVersion),
        num: u8,
        res: &mut dyn Resources,
        now: Timestamp,
    ) -> Result<LgrId, ()> {
        let dev = self.device(device).ok_or(())?;
        let pool = RmbPool::new(crate::rmb_pool::RmbPoolConfig {
            layout: RmbeLayout::Linux,
            ..self.config.rmb_pool
        })
        .map_err(|_| ())?;
        let id = self.new_lgr_id();
        let link_id = self.new_link_id();
        let qp = res.create_qp(link_id, device, llc).map_err(|_| ())?;
        let user_id = res.random_u32();
        let max_links = self.config.max_links.clamp(2, 8);
        let mut g = LinkGroup::new(id, role, peer_id, max_links, pool, dev.mtu);
        g.links.insert(
            num,
            Link::activating(link_id, num, device, qp, user_id, now),
        );
        g.last_link_num = num;
        self.links.insert(link_id, (id, num));
        self.lgrs.insert(id, g);
        Ok(id)
    }

    /// Allocate an RMBE (registering a new RMB on every link if one is needed) and an alert
    /// token.
    fn alloc_rmbe(
        &mut self,
        lgr: LgrId,
        size: Option<smc_wire::RmbeSize>,
        res: &mut dyn Resources,
    ) -> Result<LocalSetup, ()> {
        let size = size.unwrap_or(self.config.rmbe_size);
        let alert = self.new_alert_token(res);
        let g = self.lgrs.get_mut(&lgr).ok_or(())?;
        let alloc = g.pool.allocate(size).map_err(|_| ())?;
        if let Some(info) = alloc.new_rmb {
            let mut tokens = BTreeMap::new();
            for l in g.links.values() {
                match res.register_rmb(lgr, info.id, info.len(), l.id, l.device) {
                    Ok(mr) => {
                        tokens.insert(l.num, mr);
                    }
                    Err(_) => {
                        // The new RMB is in the pool but not registered on every link: no
                        // element of it may be handed out again (the next connection would
                        // get an RMBE without an rkey and be reset instead of declined), and
                        // what was registered is freed.
                        let _ = g.pool.release(alloc.handle);
                        g.pool.retire(info.id);
                        self.fabric_out
                            .push_back(crate::fabric::FabricOp::FreeRmb { lgr, rmb: info.id });
                        return Err(());
                    }
                }
            }
            g.local_rmbs.insert(
                info.id,
                LocalRmb {
                    len: info.len(),
                    element_len: info.element_len,
                    tokens,
                    confirmed: false,
                },
            );
        }
        Ok(LocalSetup { lgr, alloc, alert })
    }

    /// Record the peer's RMB known on `link` by (rkey, vaddr), if new.
    fn note_peer_rmb(&mut self, lgr: LgrId, link: u8, rkey: u32, vaddr: u64) {
        if let Some(g) = self.lgrs.get_mut(&lgr) {
            if g.peer_rmb_index(link, rkey).is_none() {
                let token = MrInfo { rkey, vaddr };
                g.peer_rmbs.push(PeerRmb::on_link(link, token));
            }
        }
    }

    /// The connection is set up: build its engine (Fig. 22 transition 2).
    #[allow(clippy::too_many_arguments)]
    fn establish(
        &mut self,
        tcp: TcpId,
        setup: LocalSetup,
        peer_rmb_hint: Option<usize>,
        peer_link: u8,
        peer: &AcceptConfirm,
        held: Vec<CdcMessage>,
        now: Timestamp,
    ) {
        let lgr = setup.lgr;
        if peer_rmb_hint.is_none() {
            self.note_peer_rmb(lgr, peer_link, peer.rmb_rkey, peer.rmb_vaddr);
        }
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            self.setup_reset(tcp, ResetReason::LinkGroupLost, now);
            return;
        };
        let Some(peer_rmb) = peer_rmb_hint.or_else(|| g.peer_rmb_index(peer_link, peer.rmb_rkey))
        else {
            self.setup_reset(tcp, ResetReason::LinkGroupLost, now);
            return;
        };
        let peer_len = peer.rmbe_size.bytes();
        let peer_key = PeerRmbeKey {
            rkey: peer.rmb_rkey,
            index: peer.rmbe_idx,
        };
        //= https://www.rfc-editor.org/rfc/rfc7609#section-4.4.2
        //# In this case, the SMC-R peer must abort the existing SMC-R connection associated
        //# with this RMBE.
        let conflict = g.peer_rmbes.claim(peer_key, tcp);
        // Spread connections over the links: each side chooses its own (§2.3).
        let send_link = least_loaded_link(g, peer_rmb).unwrap_or(peer_link);
        let peer_element_offset =
            u64::from(peer.rmbe_size.bytes()) * u64::from(peer.rmbe_idx.saturating_sub(1));
        let route = super::SendRoute::of(g, peer_rmb, peer_element_offset, send_link);
        let mut config = ConnectionConfig::new(
            RmbeLayout::Linux,
            setup.alloc.element_len,
            peer_len,
            setup.alert,
            peer.rmbe_alert_token,
        );
        config.close_timeout = self.config.close_timeout;
        config.abort_timeout = self.config.close_timeout;
        let conn = match Connection::new(config) {
            Ok(c) => c,
            Err(_) => {
                self.setup_reset(tcp, ResetReason::ClcProtocolError("RMBE too small"), now);
                return;
            }
        };
        let (first_contact, mut held) = match self.entries.get_mut(&tcp) {
            Some(Entry::Setup(h)) => {
                let mut early = std::mem::take(&mut h.held);
                early.extend(held);
                (h.is_first_contact(), early)
            }
            _ => (false, held),
        };
        held.sort_by_key(|c| c.seqno);
        let unacked_from = conn.producer_cursor();
        tracing::debug!(
            ?tcp,
            ?lgr,
            local = ?setup.alloc.handle,
            ?peer_key,
            send_link,
            "connection active"
        );
        self.entries.insert(
            tcp,
            Entry::Smc(Box::new(SmcConn {
                lgr,
                conn,
                local: setup.alloc.handle,
                local_element_offset: setup.alloc.element_offset,
                local_alert: setup.alert,
                peer_rmb,
                peer_element_offset,
                peer_key,
                send_link,
                route,
                unacked: super::replay::Replay::default(),
                unacked_from,
                arena: super::replay::Arena::default(),
                arena_idle_until: None,
                arena_used: Timestamp::ZERO,
                ss: 0,
                last_posted: None,
                held: false,
            })),
        );
        if let Some(g) = self.lgrs.get_mut(&lgr) {
            g.add_sender(send_link);
        }
        self.alerts.insert(setup.alert, tcp);
        self.stats.established += 1;
        self.events.push_back(EndpointEvent::Established {
            tcp,
            lgr,
            first_contact,
        });
        if let Some(old) = conflict {
            if let Some(Entry::Smc(c)) = self.entries.get_mut(&old) {
                c.conn.handle_rmbe_conflict(now);
            }
            self.after_conn(old, now);
        }
        //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.2.4
        //# the server must handle this race condition and not provide the arrived TCP data to
        //# the socket application until the SMC Confirm CLC message has been received and
        //# fully processed, opening the socket.
        for cdc in held {
            if let Some(Entry::Smc(c)) = self.entries.get_mut(&tcp) {
                c.conn.handle_cdc(cdc, now);
            }
        }
        self.after_conn(tcp, now);
    }

    /// A CDC for an alert token whose connection still awaits Confirm: held (§3.5.2.4).
    /// Returns false if `tcp` is not in that state.
    ///
    /// On a first contact the peer may also finish its side of the second-link exchange (and
    /// start sending) before we finish ours; those CDCs are held the same way.
    pub(super) fn hold_early_cdc(&mut self, tcp: TcpId, cdc: CdcMessage) -> bool {
        if let Some(Entry::Setup(h)) = self.entries.get_mut(&tcp) {
            if let HsState::ExpectConfirm { held, .. } = &mut h.state {
                held.push(cdc);
                return true;
            }
            if matches!(h.state, HsState::ExpectSecondLink { .. }) && h.held.len() < MAX_HELD_CDCS {
                h.held.push(cdc);
                return true;
            }
        }
        false
    }
}

/// The group's maximum links: the smaller announcement, clamped to 2..=8 (0: no limit of its own).
pub(super) fn negotiated_max_links(ours: u8, theirs: u8) -> u8 {
    //= https://www.rfc-editor.org/rfc/rfc7609#section-2.2.2
    //# When the client does not supply a value, it indicates that the client accepts the
    //# server-supplied maximum value.
    let theirs = if theirs == 0 { ours } else { theirs };
    ours.min(theirs).clamp(2, 8)
}

/// The active link with the fewest established connections sending on it, among those on
/// which the peer's RMB `peer_rmb` is known. With both peers following §3.5.5.2.1 that is
/// every active link; the filter only guards against a peer that names an RMB in CLC before
/// confirming it on every link (nothing could be written over a link lacking its RToken).
pub(super) fn least_loaded_link(g: &LinkGroup, peer_rmb: usize) -> Option<u8> {
    g.active_links()
        .filter(|l| {
            g.peer_rmbs
                .get(peer_rmb)
                .is_some_and(|r| r.tokens.contains_key(&l.num))
        })
        .map(|l| (g.senders_on(l.num), l.num))
        .min()
        .map(|(_, num)| num)
}

/// The peer's QP as its Accept or Confirm names it, on a path of MTU `mtu`.
fn clc_qp(m: &AcceptConfirm, mtu: QpMtu) -> RemoteQp {
    RemoteQp {
        gid: m.gid,
        mac: m.mac,
        qpn: m.qp_num,
        psn: m.initial_psn,
        mtu,
    }
}

/// The RToken of the peer's RMB as its Accept or Confirm names it.
fn clc_rmb_token(m: &AcceptConfirm) -> MrInfo {
    MrInfo {
        rkey: m.rmb_rkey,
        vaddr: m.rmb_vaddr,
    }
}

/// A Confirm that names a link of group `g` removed meanwhile, for an RMB of the client that
/// `g` knows on a surviving link: (the RMB's index, that link).
fn raced_confirm(g: &LinkGroup, c: &AcceptConfirm) -> Option<(usize, u8)> {
    let gone = g
        .gone_remotes
        .iter()
        .any(|r| r.qpn == c.qp_num && r.gid == c.gid);
    if !gone {
        return None;
    }
    raced_rmb(g, c.rmb_rkey, c.rmb_vaddr)
}

/// The peer RMB of group `g` whose token on a removed link was (`rkey`, `vaddr`), and an
/// active link that knows it: (its index, that link).
fn raced_rmb(g: &LinkGroup, rkey: u32, vaddr: u64) -> Option<(usize, u8)> {
    let named = MrInfo { rkey, vaddr };
    let rmb = g.peer_rmbs.iter().position(|r| r.gone.contains(&named))?;
    let link = g
        .active_links()
        .find(|l| {
            g.peer_rmbs
                .get(rmb)
                .is_some_and(|r| r.tokens.contains_key(&l.num))
        })?
        .num;
    Some((rmb, link))
}
