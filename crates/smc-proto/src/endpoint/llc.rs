//! LLC exchanges of a link group (RFC 7609 §3.5.3–§3.5.5, App. C.7, C.8), link failure and
//! keepalive (§2.3, §4.5.3).

use std::collections::BTreeMap;
use std::time::Duration;

use smc_wire::llc::{
    AddLink, AddLinkCont, AddLinkRejectReason, ConfirmRkey, ConfirmRkeyCont, DeleteLink,
    DeleteLinkReason, DeleteRkey, LinkRtoken, RtokenPair, TestLink,
};
use smc_wire::{ControlMessage, ErrorClass, LlcMessage, QpMtu};

use super::{Endpoint, EndpointError, EndpointEvent, Entry, ResetReason, WrPurpose};
use crate::fabric::{
    Device, DeviceId, FabricOp, LgrId, LinkId, MrInfo, QpInfo, RemoteQp, Resources, WrId,
};
use crate::link_group::{
    ClientAddStep, LgrTimer, Link, LinkExchange, LinkState, LinkTimer, LocalRequest, RkeyExchange,
    Role, ServerAddStep,
};
use crate::rmb_pool::RmbId;
use crate::time::Timestamp;

impl Endpoint {
    // ----- Fabric inputs -------------------------------------------------------------------

    /// A 44-byte message received by SEND on `link` (LLC or CDC).
    pub fn handle_message(
        &mut self,
        link: LinkId,
        bytes: &[u8],
        res: &mut dyn Resources,
        now: Timestamp,
    ) {
        let Some(&(lgr, num)) = self.links.get(&link) else {
            // A CDC that arrived on a link before it failed still describes data that is in
            // our RMBE (its write came first on that link): handle it (its sequence number
            // tells whether a later CDC already covered it). LLC messages of a removed link
            // are over.
            let retired = self
                .retired_links
                .iter()
                .find(|(l, _)| *l == link)
                .map(|(_, g)| *g);
            match (retired, ControlMessage::parse(bytes)) {
                (Some(lgr), Ok(ControlMessage::Cdc(cdc))) => {
                    self.stats.cdc_on_retired_link += 1;
                    self.handle_cdc(lgr, cdc, now);
                }
                _ => self.stats.llc_discarded += 1,
            }
            return;
        };
        let keepalive = self.config.keepalive;
        if let Some(l) = self.lgrs.get_mut(&lgr).and_then(|g| g.links.get_mut(&num)) {
            l.last_activity = now;
            l.rearm_keepalive(keepalive, now);
        }
        // An LLC v2 message (type 0x2X, smc-rv2.md §10): Linux accepts both forms in any group;
        // so do we, through the engine's v1 view of it.
        if bytes
            .first()
            .is_some_and(|&t| smc_wire::llc_v2::is_v2_type(t))
        {
            match smc_wire::llc_v2::LlcV2Message::parse(bytes) {
                Ok(m) => match super::v2::llc_from_v2(m) {
                    Some(m) => self.handle_llc(lgr, num, m, res, now),
                    None => self.stats.llc_discarded += 1,
                },
                Err(e) => {
                    tracing::debug!(?e, "bad LLC v2 message: link out of sync");
                    self.fail_link(lgr, num, DeleteLinkReason::PROTOCOL_VIOLATION, res, now);
                }
            }
            self.run_parked(res, now);
            return;
        }
        match ControlMessage::parse(bytes) {
            // A CDC changes no link group: it cannot end a first contact (below).
            Ok(ControlMessage::Cdc(cdc)) => {
                self.handle_cdc(lgr, cdc, now);
                return;
            }
            //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
            //# Recovery action: Ignore (silently discard) the message.
            Ok(ControlMessage::Llc(LlcMessage::Optional { .. })) => self.stats.llc_discarded += 1,
            Ok(ControlMessage::Llc(m)) => self.handle_llc(lgr, num, m, res, now),
            Err(e) => {
                //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
                //# Any other unknown or unsupported LLC opcode is an error.
                tracing::debug!(?e, class = ?e.class(), "bad LLC/CDC message: link out of sync");
                let _ = ErrorClass::Malformed;
                self.fail_link(lgr, num, DeleteLinkReason::PROTOCOL_VIOLATION, res, now);
            }
        }
        // The message may have ended a first contact that Proposals wait for.
        self.run_parked(res, now);
    }

    /// A work completion: `ok` false for any completion error (flush, retry exceeded...).
    pub fn handle_completion(
        &mut self,
        wr: WrId,
        ok: bool,
        res: &mut dyn Resources,
        now: Timestamp,
    ) {
        if let Some(ops) = self.deferred.remove(&wr) {
            self.fabric_out.extend(ops);
        }
        let Some(purpose) = self.wrs.remove(&wr) else {
            return;
        };
        let link = match purpose {
            WrPurpose::Llc { link, .. }
            | WrPurpose::Cdc { link, .. }
            | WrPurpose::Write { link, .. } => link,
        };
        if let WrPurpose::Llc {
            confirm_for: Some(tcp),
            ..
        } = purpose
        {
            if matches!(self.entries.get(&tcp), Some(Entry::Setup(_))) {
                self.handshake_confirm_completion(tcp, ok, now);
                // Declined (fell back): the group is gone. Past the point of no return the
                // failure is a link failure like any other.
                if !ok && !matches!(self.entries.get(&tcp), Some(Entry::Setup(_))) {
                    return;
                }
            }
        }
        if ok {
            if let WrPurpose::Cdc { tcp, seq, prod, .. } = purpose {
                self.cdc_completed(tcp, link, seq, prod, now);
            }
            return;
        }
        //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
        //# A write completion failure or other indication of send failure for an LLC command
        //# is treated the same as a timeout.
        self.handle_link_failure(link, res, now);
    }

    /// The QP of `link` failed (completion error, async QP error, port down).
    pub fn handle_link_failure(&mut self, link: LinkId, res: &mut dyn Resources, now: Timestamp) {
        let Some(&(lgr, num)) = self.links.get(&link) else {
            return;
        };
        self.fail_link(lgr, num, DeleteLinkReason::LOST_PATH, res, now);
    }

    // ----- Application / operator commands -------------------------------------------------

    /// Ask for another link in `lgr`: the server starts an ADD LINK exchange when a usable
    /// RNIC pair exists; the client sends an ADD LINK request to the server (an "FYI",
    /// §3.5.5.3) when it has an RNIC no link uses.
    pub fn request_add_link(
        &mut self,
        lgr: LgrId,
        res: &mut dyn Resources,
        now: Timestamp,
    ) -> Result<(), EndpointError> {
        let devices = self.config.devices.clone();
        let g = self
            .lgrs
            .get_mut(&lgr)
            .ok_or(EndpointError::UnknownLinkGroup)?;
        match g.role {
            Role::Server => {
                g.pending.push_back(LocalRequest::AddLink);
                self.llc_kick(lgr, res, now);
            }
            Role::Client => {
                let free = g.unused_device(self.config.devices.len());
                let Some(dev) = free.and_then(|d| devices.get(usize::from(d.0)).copied()) else {
                    return Err(EndpointError::NoDevice);
                };
                let Some(via) = g.active_links().next().map(|l| l.num) else {
                    return Err(EndpointError::NotEstablished);
                };
                //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.5.3
                //# This message is provided as an "FYI" to the server to let it know that the
                //# client has an additional RNIC available.
                let no_qp = QpInfo {
                    qpn: smc_wire::U24::truncate(0),
                    psn: smc_wire::U24::truncate(0),
                };
                let msg = add_link(false, dev, no_qp, 0, dev.mtu);
                self.post_llc(lgr, via, msg, None, now);
            }
        }
        Ok(())
    }

    /// A new RNIC became available. The server retries adding links to its groups at once
    /// (App. C.8); the client tells each server with an ADD LINK request.
    pub fn add_device(
        &mut self,
        device: crate::fabric::Device,
        res: &mut dyn Resources,
        now: Timestamp,
    ) -> DeviceId {
        self.config.devices.push(device);
        let id = DeviceId((self.config.devices.len() - 1) as u8);
        let groups: Vec<(LgrId, Role)> = self.lgrs.values().map(|g| (g.id, g.role)).collect();
        for (lgr, role) in groups {
            match role {
                //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.8
                //# A new RNIC becomes available to the server, on the same LAN as the SMC-R
                //# link group.
                Role::Server => {
                    if let Some(g) = self.lgrs.get_mut(&lgr) {
                        if g.symmetric_count() < usize::from(g.max_links) {
                            g.timers.stop(LgrTimer::AddLinkRetry);
                            g.pending.push_back(LocalRequest::AddLink);
                        }
                    }
                    self.llc_kick(lgr, res, now);
                }
                Role::Client => {
                    let _ = self.request_add_link(lgr, res, now);
                }
            }
        }
        id
    }

    /// Delete link `num` of `lgr` (operator command): the server runs a DELETE LINK exchange;
    /// the client asks the server with a DELETE LINK request.
    pub fn request_delete_link(
        &mut self,
        lgr: LgrId,
        num: u8,
        orderly: bool,
        res: &mut dyn Resources,
        now: Timestamp,
    ) -> Result<(), EndpointError> {
        let g = self
            .lgrs
            .get_mut(&lgr)
            .ok_or(EndpointError::UnknownLinkGroup)?;
        let reason = DeleteLinkReason::OPERATOR_INITIATED;
        match g.role {
            Role::Server => {
                g.pending.push_back(LocalRequest::DeleteLink {
                    link: num,
                    orderly,
                    reason,
                });
                self.llc_kick(lgr, res, now);
            }
            Role::Client => {
                let via = g
                    .active_links()
                    .find(|l| l.num != num)
                    .or_else(|| g.active_links().next())
                    .map(|l| l.num)
                    .ok_or(EndpointError::NotEstablished)?;
                self.client_delete_link(lgr, via, num, orderly, reason, now);
            }
        }
        Ok(())
    }

    /// Client: ask the server to delete `link` with a DELETE LINK over `via`; the server's
    /// DELETE LINK is then due.
    fn client_delete_link(
        &mut self,
        lgr: LgrId,
        via: u8,
        link: u8,
        orderly: bool,
        reason: DeleteLinkReason,
        now: Timestamp,
    ) {
        self.post_delete_link(lgr, via, link, orderly, reason, now);
        let timeout = self.config.llc_timeout;
        if let Some(g) = self.lgrs.get_mut(&lgr) {
            g.client_deleting.insert(link, via);
            //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
            //# LLC message: DELETE LINK from client Timer waits for: DELETE LINK request from
            //# server.
            g.timers.set(LgrTimer::DeleteLinkWait, now + timeout);
        }
    }

    /// Post a DELETE LINK request for the single link `link` over link `via`.
    fn post_delete_link(
        &mut self,
        lgr: LgrId,
        via: u8,
        link: u8,
        orderly: bool,
        reason: DeleteLinkReason,
        now: Timestamp,
    ) {
        let msg = LlcMessage::DeleteLink(DeleteLink {
            reply: false,
            all: false,
            orderly,
            link_num: link,
            reason,
        });
        self.post_llc(lgr, via, msg, None, now);
    }

    /// Terminate link group `lgr` (operator command): DELETE LINK for all links, every
    /// connection on it is reset.
    pub fn terminate_link_group(&mut self, lgr: LgrId, now: Timestamp) {
        self.terminate_group(lgr, DeleteLinkReason::OPERATOR_INITIATED, true, now);
    }

    // ----- LLC dispatch --------------------------------------------------------------------

    fn handle_llc(
        &mut self,
        lgr: LgrId,
        via: u8,
        m: LlcMessage,
        res: &mut dyn Resources,
        now: Timestamp,
    ) {
        let Some(g) = self.lgrs.get(&lgr) else {
            return;
        };
        let role = g.role;
        tracing::trace!(?lgr, via, ?m, "LLC received");
        //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
        //# Any link group command from the server, except DELETE LINK for the entire link
        //# group What it indicates: Client has sent a DELETE LINK for the link on which the
        //# message was received.  Recovery action: Ignore the LLC message.
        if role == Role::Client
            && g.client_deleting.contains_key(&via)
            && !matches!(m, LlcMessage::DeleteLink(_) | LlcMessage::TestLink(_))
        {
            self.stats.llc_discarded += 1;
            return;
        }
        match m {
            LlcMessage::TestLink(t) => self.on_test_link(lgr, via, t, res, now),
            LlcMessage::ConfirmLink(c) => {
                if let Some(tcp) = g.first_contact {
                    if self.handshake_confirm_link(tcp, lgr, via, c, now) {
                        self.llc_kick(lgr, res, now);
                        return;
                    }
                }
                self.on_confirm_link(lgr, via, c, res, now)
            }
            LlcMessage::AddLink(a) => match (role, a.reply) {
                (Role::Client, false) => self.client_on_add_link(lgr, via, a, res, now),
                (Role::Server, false) => self.server_on_client_add_link(lgr, via, a, res, now),
                (Role::Server, true) => self.server_on_add_link_reply(lgr, via, a, res, now),
                (Role::Client, true) => self.stats.llc_discarded += 1,
            },
            LlcMessage::AddLinkCont(c) => self.on_add_link_cont(lgr, via, c, res, now),
            LlcMessage::DeleteLink(d) => self.on_delete_link(lgr, via, d, res, now),
            LlcMessage::ConfirmRkey(c) => self.on_confirm_rkey(lgr, via, c, res, now),
            LlcMessage::ConfirmRkeyCont(c) => self.on_confirm_rkey_cont(lgr, via, c, res, now),
            LlcMessage::DeleteRkey(d) => self.on_delete_rkey(lgr, via, d, res, now),
            LlcMessage::Optional { .. } => self.stats.llc_discarded += 1,
        }
    }

    // ----- TEST LINK (§4.5.3) ---------------------------------------------------------------

    fn on_test_link(
        &mut self,
        lgr: LgrId,
        via: u8,
        t: TestLink,
        res: &mut dyn Resources,
        now: Timestamp,
    ) {
        if !t.reply {
            //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.5.3.1
            //# Colliding LLC message: TEST LINK Action to resolve: Send immediate TEST LINK
            //# reply.
            let reply = LlcMessage::TestLink(TestLink {
                reply: true,
                user_data: t.user_data,
            });
            self.post_llc(lgr, via, reply, None, now);
            return;
        }
        let Some(l) = self.lgrs.get_mut(&lgr).and_then(|g| g.links.get_mut(&via)) else {
            return;
        };
        if l.test_link.is_none() {
            // A reply to nothing we asked (a late duplicate): discard.
            self.stats.llc_discarded += 1;
        } else if l.test_link == Some(t.user_data) {
            l.test_link = None;
            l.timers.stop(LinkTimer::TestLinkReply);
        } else {
            //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
            //# User data doesn't match what was sent in the TEST LINK request.  Recovery
            //# action: Treat as if detected that the link has gone down.
            self.fail_link(lgr, via, DeleteLinkReason::PROTOCOL_VIOLATION, res, now);
        }
    }

    pub(super) fn rearm_keepalive(&mut self, lgr: LgrId, num: u8, now: Timestamp) {
        let keepalive = self.config.keepalive;
        if let Some(l) = self.lgrs.get_mut(&lgr).and_then(|g| g.links.get_mut(&num)) {
            l.rearm_keepalive(keepalive, now);
        }
    }

    // ----- CONFIRM LINK on a new link --------------------------------------------------------

    /// Mark link `num` active after its CONFIRM LINK exchange.
    pub(super) fn activate_link(&mut self, lgr: LgrId, num: u8, peer_user_id: u32, now: Timestamp) {
        let Some(l) = self.lgrs.get_mut(&lgr).and_then(|g| g.links.get_mut(&num)) else {
            return;
        };
        l.state = LinkState::Active;
        tracing::info!(?lgr, num, "link active");
        l.peer_user_id = Some(peer_user_id);
        l.last_activity = now;
        let id = l.id;
        self.events
            .push_back(EndpointEvent::LinkUp { lgr, link: id, num });
        self.rearm_keepalive(lgr, num, now);
    }

    fn on_confirm_link(
        &mut self,
        lgr: LgrId,
        via: u8,
        c: smc_wire::llc::ConfirmLink,
        res: &mut dyn Resources,
        now: Timestamp,
    ) {
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            return;
        };
        match g.link_exchange.clone() {
            Some(LinkExchange::ServerAddLink {
                new,
                step: ServerAddStep::SentConfirmLink,
                first_contact,
                ..
            }) if c.reply && via == new => {
                let ok = c.link_num == new && g.link_reaches(new, c.sender_qp, c.sender_gid);
                if !ok {
                    self.abandon_new_link(lgr, new, true, now);
                    return;
                }
                g.end_link_exchange();
                g.timers.stop(LgrTimer::AddLinkRetry);
                // More links while the group is below its maximum and we have an RNIC no
                // link uses.
                let free = g.unused_device(self.config.devices.len()).is_some();
                if free && g.symmetric_count() < usize::from(g.max_links) {
                    g.pending.push_back(LocalRequest::AddLink);
                }
                self.activate_link(lgr, new, c.link_user_id, now);
                self.exchange_done(lgr, first_contact, res, now);
            }
            Some(LinkExchange::ClientAddLink {
                new, first_contact, ..
            }) if !c.reply && via == new => {
                let ok = c.link_num == new
                    && g.peer_rmbs_known_on(new)
                    && g.link_reaches(new, c.sender_qp, c.sender_gid);
                if !ok {
                    //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
                    //# Protocol error.  The link must be brought down by sending a DELETE LINK
                    //# for the link over another link in the link group if one exists.
                    self.abandon_new_link(lgr, new, true, now);
                    if first_contact {
                        self.first_contact_done(lgr, now);
                    }
                    return;
                }
                g.end_link_exchange();
                self.activate_link(lgr, new, c.link_user_id, now);
                if let Some(reply) = self.confirm_link_msg(lgr, new, true) {
                    self.post_llc(lgr, new, reply, None, now);
                }
                self.exchange_done(lgr, first_contact, res, now);
            }
            _ if g.rkey_exchange.is_some() && !c.reply => {
                //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.5.3.3
                //# Colliding LLC message: CONFIRM LINK from the peer that did not start the
                //# current CONFIRM LINK exchange Action to resolve: Queue the request, and
                //# process it after the current exchange completes.
                g.queued.push_back((via, LlcMessage::ConfirmLink(c)));
            }
            _ => {
                //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
                //# Any unambiguously incorrect or out-of-sync LLC message What it indicates:
                //# Link is out of sync.
                self.fail_link(lgr, via, DeleteLinkReason::PROTOCOL_VIOLATION, res, now);
            }
        }
    }

    /// A configuration exchange ended: the first contact (if it waited) is established,
    /// queued peer messages are processed, and the next local request starts.
    fn exchange_done(
        &mut self,
        lgr: LgrId,
        first_contact: bool,
        res: &mut dyn Resources,
        now: Timestamp,
    ) {
        if first_contact {
            self.first_contact_done(lgr, now);
        }
        // Connections may spread onto a new link; a queued message may start an exchange.
        while let Some(g) = self.lgrs.get_mut(&lgr) {
            if g.link_exchange.is_some() || g.rkey_exchange.is_some() {
                break;
            }
            let Some((via, m)) = g.queued.pop_front() else {
                break;
            };
            self.handle_llc(lgr, via, m, res, now);
        }
        self.llc_kick(lgr, res, now);
    }

    // ----- ADD LINK (server side) ------------------------------------------------------------

    /// Start the next local request if no configuration exchange is in progress
    /// (§3.5.5.3: "When a peer knows that one of these exchanges is in progress, it must not
    /// start another exchange").
    pub(super) fn llc_kick(&mut self, lgr: LgrId, res: &mut dyn Resources, now: Timestamp) {
        loop {
            let Some(g) = self.lgrs.get_mut(&lgr) else {
                return;
            };
            //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.5.3
            //# When a peer knows that one of these exchanges is in progress, it must not
            //# start another exchange.
            if g.link_exchange.is_some() || g.rkey_exchange.is_some() {
                return;
            }
            let Some(req) = g.pending.pop_front() else {
                return;
            };
            let started = match req {
                LocalRequest::AddLink => self.start_add_link(lgr, res, now),
                LocalRequest::DeleteLink {
                    link,
                    orderly,
                    reason,
                } => self.start_delete_link(lgr, link, orderly, reason, res, now),
                LocalRequest::ConfirmRkey(rmb) => self.start_confirm_rkey(lgr, rmb, now),
                LocalRequest::DeleteRkey(rmbs) => self.start_delete_rkey(lgr, rmbs, now),
            };
            if started {
                return;
            }
        }
    }

    fn llc_timer(&self, lgr: LgrId) -> std::time::Duration {
        if self
            .lgrs
            .get(&lgr)
            .is_some_and(|g| g.first_contact.is_some())
        {
            self.config.llc_timeout_first_contact
        } else {
            self.config.llc_timeout
        }
    }

    /// Server: choose an RNIC for a new link and send ADD LINK (Fig. 9). Returns whether an
    /// exchange started.
    fn start_add_link(&mut self, lgr: LgrId, res: &mut dyn Resources, now: Timestamp) -> bool {
        let timeout = self.llc_timer(lgr);
        let devices = self.config.devices.clone();
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            return false;
        };
        let first_contact = g.first_contact.is_some();
        if g.role != Role::Server {
            return false;
        }
        let Some(via) = g.active_links().next().map(|l| l.num) else {
            return false;
        };
        //= https://www.rfc-editor.org/rfc/rfc7609#section-2.2.2
        //# The SMC-R protocol defines a maximum of eight symmetric SMC-R links within a single
        //# SMC-R link group.
        if g.symmetric_count() >= usize::from(g.max_links) {
            if first_contact {
                self.first_contact_done(lgr, now);
            }
            return false;
        }
        let has_asym = g.links.values().any(|l| l.asymmetric);
        let llc = g.llc_version();
        let free = g.unused_device(self.config.devices.len());
        // Without a free RNIC of our own, offer the same RNIC: the client may have a second
        // one (an asymmetric link, at most one per group).
        let device = match (free, has_asym) {
            (Some(d), _) => d,
            (None, false) => g.first_device().unwrap_or(DeviceId(0)),
            (None, true) => {
                if first_contact {
                    self.first_contact_done(lgr, now);
                }
                return false;
            }
        };
        let Some(dev) = devices.get(usize::from(device.0)).copied() else {
            return false;
        };
        let Some(num) = g.next_link_num() else {
            return false;
        };
        // The QP made for this link while the first contact could still decline.
        let spare = match g.spare.take() {
            Some(s) if s.device == device => Some(s),
            Some(s) => {
                self.fabric_out
                    .push_back(FabricOp::DestroyQp { link: s.id });
                None
            }
            None => None,
        };
        let (id, qp) = match spare {
            Some(s) => (s.id, s.qp),
            None => {
                let id = self.new_link_id();
                let Ok(qp) = res.create_qp(id, device, llc) else {
                    // Out of resources for an added link: the group goes on with the links
                    // it has and tries again later (App. C.8).
                    if first_contact {
                        self.first_contact_done(lgr, now);
                    } else {
                        self.arm_add_link_retry(lgr, now);
                    }
                    return false;
                };
                (id, qp)
            }
        };
        let user_id = res.random_u32();
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            return false;
        };
        let link = Link {
            asymmetric: free.is_none(),
            ..Link::activating(id, num, device, qp, user_id, now)
        };
        g.links.insert(num, link);
        self.links.insert(id, (lgr, num));
        let pairs = match self.register_rmbs_on_link(lgr, num, via, res) {
            Ok(p) => p,
            Err(()) => {
                self.drop_link(lgr, num, now);
                if first_contact {
                    self.first_contact_done(lgr, now);
                } else {
                    self.arm_add_link_retry(lgr, now);
                }
                return false;
            }
        };
        let mtu = self.lgrs.get(&lgr).map_or(dev.mtu, |g| g.mtu);
        let msg = add_link(false, dev, qp, num, mtu);
        self.post_llc(lgr, via, msg, None, now);
        let ex = LinkExchange::ServerAddLink {
            new: num,
            via,
            step: ServerAddStep::SentAddLink,
            first_contact,
            ours_left: pairs,
        };
        //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
        //# LLC message: ADD LINK from server (first contact) Timer waits for: ADD LINK
        //# reply from client.
        self.await_link_exchange(lgr, ex, timeout, now);
        true
    }

    /// Register every RMB of ours on the new link `num`; returns the RToken pairs (as known
    /// on `via`, as known on the new link) for ADD LINK CONTINUATION.
    fn register_rmbs_on_link(
        &mut self,
        lgr: LgrId,
        num: u8,
        via: u8,
        res: &mut dyn Resources,
    ) -> Result<Vec<RtokenPair>, ()> {
        let g = self.lgrs.get_mut(&lgr).ok_or(())?;
        let l = g.links.get(&num).ok_or(())?;
        let (id, device) = (l.id, l.device);
        let mut pairs = Vec::new();
        for (rmb, info) in g.local_rmbs.iter_mut() {
            let mr = res
                .register_rmb(lgr, *rmb, info.len, id, device)
                .map_err(|_| ())?;
            info.tokens.insert(num, mr);
            // An RMB the peer does not know yet (its CONFIRM RKEY is pending) is announced by
            // that CONFIRM RKEY, with the new link's RToken, not here.
            if !info.confirmed {
                continue;
            }
            if let Some(r) = info.tokens.get(&via) {
                pairs.push(RtokenPair {
                    reference_rkey: r.rkey,
                    new_rkey: mr.rkey,
                    new_vaddr: mr.vaddr,
                });
            }
        }
        Ok(pairs)
    }

    fn server_on_add_link_reply(
        &mut self,
        lgr: LgrId,
        via: u8,
        a: AddLink,
        res: &mut dyn Resources,
        now: Timestamp,
    ) {
        let timeout = self.llc_timer(lgr);
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            return;
        };
        let Some(LinkExchange::ServerAddLink {
            new,
            via: ex_via,
            step: ServerAddStep::SentAddLink,
            first_contact,
            ours_left,
        }) = g.link_exchange.clone()
        else {
            self.stats.llc_discarded += 1;
            return;
        };
        if via != ex_via || a.link_num != new {
            self.stats.llc_discarded += 1;
            return;
        }
        g.timers.stop(LgrTimer::LinkExchange);
        if a.rejected {
            // The client has no usable RNIC: the group continues with one link (C.8).
            self.drop_link(lgr, new, now);
            if let Some(g) = self.lgrs.get_mut(&lgr) {
                g.link_exchange = None;
            }
            self.arm_add_link_retry(lgr, now);
            self.exchange_done(lgr, first_contact, res, now);
            return;
        }
        let Some(device) = g.links.get(&new).map(|l| l.device) else {
            return;
        };
        // The client reuses an RNIC of an existing link.
        let client_reuses = g
            .links
            .values()
            .any(|l| l.num != new && l.remote.is_some_and(|r| r.gid == a.sender_gid));
        //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
        //# Client-side link information that would result in a parallel link being set up.
        //# Recovery action: Parallel links are not permitted.  Delete the link by sending a
        //# DELETE LINK to the client over another link in the link group.
        if g.would_be_parallel(device, a.sender_gid)
            || (g.links.get(&new).is_some_and(|l| l.asymmetric) && client_reuses)
        {
            self.server_abandon_add_link(lgr, new, first_contact, res, now);
            return;
        }
        let mtu = QpMtu(g.mtu.0.min(a.mtu.0));
        // The link is asymmetric when the client reuses an RNIC of an existing link.
        if let Some(l) = g.links.get_mut(&new) {
            l.asymmetric = l.asymmetric || client_reuses;
        }
        if !self.connect_link(lgr, new, add_link_qp(&a, mtu)) {
            return;
        }
        self.server_send_cont(lgr, new, via, first_contact, ours_left, timeout, now);
    }

    /// Server: send our next ADD LINK CONTINUATION for link `new` over `via`; the client's
    /// continuation is then due.
    #[allow(clippy::too_many_arguments)]
    fn server_send_cont(
        &mut self,
        lgr: LgrId,
        new: u8,
        via: u8,
        first_contact: bool,
        ours_left: Vec<RtokenPair>,
        timeout: Duration,
        now: Timestamp,
    ) {
        let ex = LinkExchange::ServerAddLink {
            new,
            via,
            step: ServerAddStep::SentCont,
            first_contact,
            ours_left,
        };
        //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
        //# LLC message: ADD LINK CONTINUATION from server Timer waits for: ADD LINK
        //# CONTINUATION reply from client.
        self.send_add_link_cont(lgr, ex, timeout, now);
    }

    fn server_on_client_add_link(
        &mut self,
        lgr: LgrId,
        via: u8,
        a: AddLink,
        res: &mut dyn Resources,
        now: Timestamp,
    ) {
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            return;
        };
        match &g.link_exchange {
            //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.5.3.1
            //# Colliding LLC message: ADD LINK from client to server Action to resolve:
            //# Server ignores the ADD LINK message.
            Some(LinkExchange::ServerAddLink { .. }) => {
                self.stats.llc_discarded += 1;
            }
            //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.5.3.2
            //# Colliding LLC message: ADD LINK from client to server Action to resolve:
            //# Server queues the ADD LINK and processes it after the current exchange
            //# completes.
            Some(_) => g.queued.push_back((via, LlcMessage::AddLink(a))),
            None if g.rkey_exchange.is_some() => {
                //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.5.3.3
                //# Colliding LLC message: ADD LINK from client to server Action to resolve:
                //# Queue the ADD LINK, and process it after the current exchange completes.
                g.queued.push_back((via, LlcMessage::AddLink(a)))
            }
            None => {
                //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.8
                //# An ADD LINK LLC request message is received from the client; this
                //# indicates the availability of a new RNIC on the client side.
                g.timers.stop(LgrTimer::AddLinkRetry);
                g.pending.push_back(LocalRequest::AddLink);
                self.llc_kick(lgr, res, now);
            }
        }
    }

    // ----- ADD LINK (client side) ------------------------------------------------------------

    fn client_on_add_link(
        &mut self,
        lgr: LgrId,
        via: u8,
        a: AddLink,
        res: &mut dyn Resources,
        now: Timestamp,
    ) {
        let timeout = self.llc_timer(lgr);
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            return;
        };
        let first_contact = g.first_contact.is_some();
        if let Some(tcp) = g.first_contact {
            self.handshake_second_link_started(tcp);
        }
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            return;
        };
        //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
        //# What it indicates: Undefined enumerated MTU value.  Recovery action: Send a
        //# negative ADD LINK reply with reason code x'2'.
        if !a.mtu.is_known() {
            let reason = AddLinkRejectReason::INVALID_MTU;
            self.client_reject_add_link(lgr, via, a, reason, res, now);
            return;
        }
        // Pick our RNIC: one no link uses (symmetric); else, if the server offers a new RNIC
        // and no asymmetric link exists yet, reuse ours (asymmetric). Only RNICs that reach
        // the server's offered port count: a link between two LANs could never work.
        let sender = a.sender_gid;
        let free = (0..self.config.devices.len().min(256))
            .map(|d| DeviceId(d as u8))
            .filter(|d| g.pnet.contains(*d) && res.reaches(*d, sender))
            .find(|d| !g.links.values().any(|l| l.device == *d));
        let server_new_rnic = !g
            .links
            .values()
            .any(|l| l.remote.is_some_and(|r| r.gid == a.sender_gid));
        let has_asym = g.links.values().any(|l| l.asymmetric);
        let llc = g.llc_version();
        let device = match free {
            Some(d) => Some(d),
            None if server_new_rnic && !has_asym => {
                g.first_device().filter(|d| res.reaches(*d, sender))
            }
            None => None,
        };
        let full = g.symmetric_count() >= usize::from(g.max_links)
            || g.links.contains_key(&a.link_num)
            || a.link_num == 0;
        let Some(device) = device.filter(|_| !full) else {
            //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.4
            //# If it does not, the client rejects the ADD LINK request from the server,
            //# because the resulting link would be a parallel link
            let reason = AddLinkRejectReason::NO_ALTERNATE_PATH;
            self.client_reject_add_link(lgr, via, a, reason, res, now);
            return;
        };
        let Some(dev) = self.device(device) else {
            return;
        };
        let id = self.new_link_id();
        let Ok(qp) = res.create_qp(id, device, llc) else {
            let reason = AddLinkRejectReason::NO_ALTERNATE_PATH;
            self.client_reject_add_link(lgr, via, a, reason, res, now);
            return;
        };
        let user_id = res.random_u32();
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            return;
        };
        let mtu = QpMtu(g.mtu.0.min(a.mtu.0));
        let num = a.link_num;
        let link = Link {
            asymmetric: free.is_none() || !server_new_rnic,
            ..Link::activating(id, num, device, qp, user_id, now)
        };
        g.links.insert(num, link);
        if num > g.last_link_num {
            g.last_link_num = num;
        }
        self.links.insert(id, (lgr, num));
        self.connect_link(lgr, num, add_link_qp(&a, mtu));
        let pairs = match self.register_rmbs_on_link(lgr, num, via, res) {
            Ok(p) => p,
            Err(()) => {
                self.drop_link(lgr, num, now);
                let reason = AddLinkRejectReason::NO_ALTERNATE_PATH;
                self.client_reject_add_link(lgr, via, a, reason, res, now);
                return;
            }
        };
        let reply = add_link(true, dev, qp, num, mtu);
        self.post_llc(lgr, via, reply, None, now);
        let ex = LinkExchange::ClientAddLink {
            new: num,
            via,
            step: ClientAddStep::SentReply,
            first_contact,
            ours_left: pairs,
        };
        //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
        //# LLC message: ADD LINK reply from client (and there are more RKeys to be
        //# communicated) Timer waits for: ADD LINK CONTINUATION from server.
        self.await_link_exchange(lgr, ex, timeout, now);
    }

    /// Client: refuse the server's ADD LINK for link `link_num` with a negative reply; the
    /// exchange is over.
    fn client_reject_add_link(
        &mut self,
        lgr: LgrId,
        via: u8,
        request: AddLink,
        reason: AddLinkRejectReason,
        res: &mut dyn Resources,
        now: Timestamp,
    ) {
        let v2 = self.lgrs.get(&lgr).is_some_and(|g| g.v2.is_some());
        let msg = LlcMessage::AddLink(if v2 {
            // smc-rv2.md §10.4: a Linux client's v2 reject is the request's first 44 bytes
            // with flags 0xC0 (and no reason: byte 2 belongs to the length).
            AddLink {
                reply: true,
                rejected: true,
                ..request
            }
        } else {
            AddLink {
                reply: true,
                rejected: true,
                reject_reason: reason,
                link_num: request.link_num,
                ..AddLink::default()
            }
        });
        self.post_llc(lgr, via, msg, None, now);
        let first_contact = self
            .lgrs
            .get(&lgr)
            .is_some_and(|g| g.first_contact.is_some());
        self.exchange_done(lgr, first_contact, res, now);
    }

    // ----- ADD LINK CONTINUATION -------------------------------------------------------------

    fn on_add_link_cont(
        &mut self,
        lgr: LgrId,
        via: u8,
        c: AddLinkCont,
        res: &mut dyn Resources,
        now: Timestamp,
    ) {
        let timeout = self.llc_timer(lgr);
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            return;
        };
        let ex = g.link_exchange.clone();
        let (new, ex_via, first_contact, ours_left, server) = match ex {
            Some(LinkExchange::ServerAddLink {
                new,
                via,
                step: ServerAddStep::SentCont,
                first_contact,
                ours_left,
            }) if c.reply => (new, via, first_contact, ours_left, true),
            Some(LinkExchange::ClientAddLink {
                new,
                via,
                first_contact,
                ours_left,
                ..
            }) if !c.reply => (new, via, first_contact, ours_left, false),
            // The exchange for this link ended on our side because the new link failed (and
            // we sent DELETE LINK for it) while the peer's continuation was on its way: a
            // timing window, not a protocol error.
            _ if g.deleted.contains(&c.link_num) => {
                tracing::debug!(
                    ?lgr,
                    link = c.link_num,
                    "late ADD LINK CONTINUATION ignored"
                );
                return;
            }
            _ => {
                self.fail_link(lgr, via, DeleteLinkReason::PROTOCOL_VIOLATION, res, now);
                return;
            }
        };
        if via != ex_via || c.link_num != new {
            self.fail_link(lgr, via, DeleteLinkReason::PROTOCOL_VIOLATION, res, now);
            return;
        }
        // Store the peer's pairs: its RMB known on `via` by reference_rkey is known on the
        // new link by (new_rkey, new_vaddr).
        //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.5.2.3
        //# the first RToken in each RToken pair will be the RToken for the RMB as known on
        //# the SMC-R link over which the LLC message is being sent.
        let mut unknown = false;
        for p in c.valid_pairs() {
            match g.peer_rmb_index(via, p.reference_rkey) {
                Some(i) => {
                    if let Some(r) = g.peer_rmbs.get_mut(i) {
                        r.tokens.insert(
                            new,
                            MrInfo {
                                rkey: p.new_rkey,
                                vaddr: p.new_vaddr,
                            },
                        );
                    }
                }
                None => unknown = true,
            }
        }
        if unknown {
            //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
            //# Number of RMBs provided doesn't match count given on initial ADD LINK or ADD
            //# LINK reply message.  Recovery action: Protocol error.  Treat as if detected
            //# link outage.
            self.abandon_new_link(lgr, new, true, now);
            if first_contact {
                self.first_contact_done(lgr, now);
            } else if server {
                self.arm_add_link_retry(lgr, now);
            }
            self.llc_kick(lgr, res, now);
            return;
        }
        let peer_more = usize::from(c.num_rtokens) > c.valid_pairs().len();
        g.timers.stop(LgrTimer::LinkExchange);
        if server {
            if !ours_left.is_empty() || peer_more {
                self.server_send_cont(lgr, new, via, first_contact, ours_left, timeout, now);
                return;
            }
            // Every RToken is exchanged: verify the new link with CONFIRM LINK over it.
            if !g.peer_rmbs_known_on(new) {
                self.server_abandon_add_link(lgr, new, first_contact, res, now);
                return;
            }
            if let Some(msg) = self.confirm_link_msg(lgr, new, false) {
                self.post_llc(lgr, new, msg, None, now);
            }
            let ex = LinkExchange::ServerAddLink {
                new,
                via,
                step: ServerAddStep::SentConfirmLink,
                first_contact,
                ours_left,
            };
            //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
            //# LLC message: CONFIRM LINK from server (first contact, second link in the
            //# link group) Timer waits for: CONFIRM LINK reply from client.
            self.await_link_exchange(lgr, ex, timeout, now);
        } else {
            let ex = LinkExchange::ClientAddLink {
                new,
                via,
                step: ClientAddStep::SentCont {
                    server_owes: peer_more,
                },
                first_contact,
                ours_left,
            };
            //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
            //# Timer waits for: CONFIRM LINK from the server, over the new link.
            self.send_add_link_cont(lgr, ex, timeout, now);
        }
    }

    /// Send our next ADD LINK CONTINUATION for the ADD LINK exchange `ex` over its link (at
    /// most two of its `ours_left` pairs, which it no longer holds), then wait for the peer
    /// in `ex`.
    fn send_add_link_cont(
        &mut self,
        lgr: LgrId,
        mut ex: LinkExchange,
        timeout: Duration,
        now: Timestamp,
    ) {
        let (reply, new, via, ours_left) = match &mut ex {
            LinkExchange::ServerAddLink {
                new,
                via,
                ours_left,
                ..
            } => (false, *new, *via, ours_left),
            LinkExchange::ClientAddLink {
                new,
                via,
                ours_left,
                ..
            } => (true, *new, *via, ours_left),
            LinkExchange::DeleteLink { .. } | LinkExchange::ClientAwaitDelete { .. } => return,
        };
        //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.5.2.3
        //# ADD LINK CONTINUATION LLC messages are used to communicate these pairs
        let take = ours_left.len().min(2);
        let total = ours_left.len();
        let sent: Vec<RtokenPair> = ours_left.drain(..take).collect();
        let msg = add_link_cont(reply, new, total, &sent);
        self.post_llc(lgr, via, msg, None, now);
        self.await_link_exchange(lgr, ex, timeout, now);
    }

    /// The link exchange of `lgr` now stands at `ex`, waiting for the peer: its timer runs
    /// (App. C.7).
    fn await_link_exchange(
        &mut self,
        lgr: LgrId,
        ex: LinkExchange,
        timeout: Duration,
        now: Timestamp,
    ) {
        if let Some(g) = self.lgrs.get_mut(&lgr) {
            g.link_exchange = Some(ex);
            g.timers.set(LgrTimer::LinkExchange, now + timeout);
        }
    }

    /// Server: the ADD LINK exchange for link `new` failed: give the link up (telling the
    /// client), arm the retry, and end the exchange.
    fn server_abandon_add_link(
        &mut self,
        lgr: LgrId,
        new: u8,
        first_contact: bool,
        res: &mut dyn Resources,
        now: Timestamp,
    ) {
        self.abandon_new_link(lgr, new, true, now);
        self.arm_add_link_retry(lgr, now);
        self.exchange_done(lgr, first_contact, res, now);
    }

    /// Give up a link being added: destroy it, and tell the peer with a DELETE LINK over the
    /// exchange's link when `notify`.
    fn abandon_new_link(&mut self, lgr: LgrId, new: u8, notify: bool, now: Timestamp) {
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            return;
        };
        let via = match &g.link_exchange {
            Some(LinkExchange::ServerAddLink { via, .. })
            | Some(LinkExchange::ClientAddLink { via, .. }) => Some(*via),
            _ => None,
        };
        g.end_link_exchange();
        self.drop_link(lgr, new, now);
        if let (true, Some(via)) = (notify, via) {
            let reason = DeleteLinkReason::PROTOCOL_VIOLATION;
            self.post_delete_link(lgr, via, new, false, reason, now);
        }
    }

    /// Remove link `num` locally: destroy its QP, forget its RTokens. No failover (the link
    /// carried no connection) and no message.
    fn drop_link(&mut self, lgr: LgrId, num: u8, now: Timestamp) {
        let _ = now;
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            return;
        };
        let Some(l) = g.links.remove(&num) else {
            return;
        };
        if let Some(r) = l.remote {
            if g.gone_remotes.len() == crate::link_group::GONE_REMOTES {
                g.gone_remotes.pop_front();
            }
            g.gone_remotes.push_back(r);
        }
        for r in g.local_rmbs.values_mut() {
            r.tokens.remove(&num);
        }
        for r in g.peer_rmbs.iter_mut() {
            if let Some(t) = r.tokens.remove(&num) {
                if r.gone.len() == crate::link_group::GONE_REMOTES {
                    r.gone.remove(0);
                }
                r.gone.push(t);
            }
        }
        self.links.remove(&l.id);
        if self.retired_links.len() == super::RETIRED_LINKS {
            self.retired_links.pop_front();
        }
        self.retired_links.push_back((l.id, lgr));
        self.fabric_out
            .push_back(FabricOp::DestroyQp { link: l.id });
    }

    fn arm_add_link_retry(&mut self, lgr: LgrId, now: Timestamp) {
        let retry = self.config.add_link_retry;
        if let Some(g) = self.lgrs.get_mut(&lgr) {
            //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.8
            //# The server peer in the SMC-R link group must set a timer to drive it to retry
            //# setup of a failed additional SMC-R link.
            // C.8 is about the second link: a group without redundancy keeps trying.
            if g.role == Role::Server
                && g.active_count() < 2
                && g.symmetric_count() < usize::from(g.max_links)
            {
                g.timers.set(LgrTimer::AddLinkRetry, now + retry);
            }
        }
    }

    // ----- DELETE LINK -----------------------------------------------------------------------

    fn start_delete_link(
        &mut self,
        lgr: LgrId,
        link: u8,
        orderly: bool,
        reason: DeleteLinkReason,
        res: &mut dyn Resources,
        now: Timestamp,
    ) -> bool {
        let timeout = self.config.llc_timeout;
        let Some(g) = self.lgrs.get(&lgr) else {
            return false;
        };
        let Some(via) = g.active_links().find(|l| l.num != link).map(|l| l.num) else {
            // The last link: deleting it ends the group.
            self.terminate_group(lgr, reason, true, now);
            return false;
        };
        if g.links.contains_key(&link) {
            self.remove_link(lgr, link, reason, res, now);
        }
        self.post_delete_link(lgr, via, link, orderly, reason, now);
        //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
        //# LLC message: DELETE LINK from server (scope: single link) Timer waits for:
        //# DELETE LINK reply from client.
        self.await_link_exchange(lgr, LinkExchange::DeleteLink { link, via }, timeout, now);
        true
    }

    fn on_delete_link(
        &mut self,
        lgr: LgrId,
        via: u8,
        d: DeleteLink,
        res: &mut dyn Resources,
        now: Timestamp,
    ) {
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            return;
        };
        if d.all {
            //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.5.3.1
            //# Colliding LLC message: DELETE LINK from client to server, entire link group to
            //# be deleted Action to resolve: Immediately clean up the link group.
            self.terminate_group(lgr, d.reason, false, now);
            return;
        }
        match (g.role, d.reply) {
            (Role::Server, false) => {
                if let Some(LinkExchange::ServerAddLink {
                    new,
                    via: ex_via,
                    first_contact,
                    ..
                }) = g.link_exchange
                {
                    if new == d.link_num {
                        // The client reports the very link we are adding as failed (its end
                        // could not reach ours): the exchange cannot complete. End it and
                        // delete the link, which answers the client's request (App. C.7.1:
                        // a timing window, not an error).
                        g.end_link_exchange();
                        self.drop_link(lgr, new, now);
                        if let Some(g) = self.lgrs.get_mut(&lgr) {
                            g.deleted.insert(new);
                        }
                        self.post_delete_link(lgr, ex_via, new, false, d.reason, now);
                        if first_contact {
                            self.first_contact_done(lgr, now);
                        } else {
                            self.arm_add_link_retry(lgr, now);
                        }
                        self.llc_kick(lgr, res, now);
                        return;
                    }
                }
                if g.link_exchange.is_some() || g.rkey_exchange.is_some() {
                    //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.5.3.1
                    //# Colliding LLC message: DELETE LINK from client to server, specific link
                    //# specified Action to resolve: Server queues the DELETE LINK message and
                    //# processes it after the ADD LINK exchange completes.
                    g.queued.push_back((via, LlcMessage::DeleteLink(d)));
                    return;
                }
                //= https://www.rfc-editor.org/rfc/rfc7609#section-2.3
                //# While the client can notify the server of an apparent link failure with the
                //# DELETE LINK LLC command, the server performs the actual link deletion.
                if g.deleted.contains(&d.link_num) {
                    //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
                    //# If the link is in the process of being cleaned up, assume timing window
                    //# and ignore message.
                    self.stats.llc_discarded += 1;
                } else if g.links.contains_key(&d.link_num) {
                    g.pending.push_front(LocalRequest::DeleteLink {
                        link: d.link_num,
                        orderly: d.orderly,
                        reason: d.reason,
                    });
                    self.llc_kick(lgr, res, now);
                } else {
                    //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
                    //# Otherwise, send a DELETE LINK reply with reason code 1.
                    let reply = LlcMessage::DeleteLink(DeleteLink {
                        reply: true,
                        all: false,
                        orderly: false,
                        link_num: d.link_num,
                        reason: DeleteLinkReason::UNKNOWN_LINK,
                    });
                    self.post_llc(lgr, via, reply, None, now);
                }
            }
            (Role::Server, true) => {
                if let Some(LinkExchange::DeleteLink { link, .. }) = g.link_exchange {
                    if link == d.link_num {
                        g.end_link_exchange();
                        // A first contact whose second link failed completes now (C.7).
                        let fc = g.first_contact.is_some();
                        self.arm_add_link_retry(lgr, now);
                        self.exchange_done(lgr, fc, res, now);
                        return;
                    }
                }
                self.stats.llc_discarded += 1;
            }
            (Role::Client, false) => {
                g.client_deleting.remove(&d.link_num);
                if g.client_deleting.is_empty() {
                    g.timers.stop(LgrTimer::DeleteLinkWait);
                }
                let known = g.links.contains_key(&d.link_num);
                let waiting_fc = match g.link_exchange {
                    Some(LinkExchange::ClientAwaitDelete { link })
                    | Some(LinkExchange::ClientAddLink { new: link, .. })
                        if link == d.link_num =>
                    {
                        g.end_link_exchange();
                        true
                    }
                    _ => false,
                };
                if known {
                    self.remove_link(lgr, d.link_num, d.reason, res, now);
                }
                let reply = LlcMessage::DeleteLink(DeleteLink {
                    reply: true,
                    all: false,
                    orderly: d.orderly,
                    link_num: d.link_num,
                    reason: if known || waiting_fc {
                        d.reason
                    } else {
                        //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
                        //# LLC message received: DELETE LINK from server What it indicates:
                        //# Link indicated doesn't exist.  Recovery action: Send a DELETE LINK
                        //# reply with reason code 1.
                        DeleteLinkReason::UNKNOWN_LINK
                    },
                });
                if self.lgrs.contains_key(&lgr) {
                    let via = if self
                        .lgrs
                        .get(&lgr)
                        .is_some_and(|g| g.links.contains_key(&via))
                    {
                        via
                    } else {
                        match self.lgrs.get(&lgr).and_then(|g| g.active_links().next()) {
                            Some(l) => l.num,
                            None => return,
                        }
                    };
                    self.post_llc(lgr, via, reply, None, now);
                }
                if waiting_fc {
                    let fc = self
                        .lgrs
                        .get(&lgr)
                        .is_some_and(|g| g.first_contact.is_some());
                    self.exchange_done(lgr, fc, res, now);
                }
            }
            (Role::Client, true) => self.stats.llc_discarded += 1,
        }
    }

    /// Take link `num` out of the group: move its connections to a surviving link, destroy
    /// it. When no link survives, the group ends and its connections are reset.
    fn remove_link(
        &mut self,
        lgr: LgrId,
        num: u8,
        reason: DeleteLinkReason,
        res: &mut dyn Resources,
        now: Timestamp,
    ) {
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            return;
        };
        let Some(l) = g.links.get(&num) else {
            return;
        };
        let id = l.id;
        g.deleted.insert(num);
        let survivors = g.active_links().filter(|l| l.num != num).count();
        tracing::info!(?lgr, num, ?reason, survivors, "link removed");
        self.drop_link(lgr, num, now);
        self.events.push_back(EndpointEvent::LinkDown {
            lgr,
            link: id,
            num,
            reason,
        });
        if survivors == 0 {
            self.terminate_group(lgr, reason, false, now);
            return;
        }
        // LLC exchanges that used the link are retried by their initiator (§2.3).
        self.abort_exchanges_on(lgr, num, res, now);
        self.failover_link(lgr, num, now);
    }

    /// Exchanges that flowed on (or were adding) link `num`, which is gone.
    fn abort_exchanges_on(&mut self, lgr: LgrId, num: u8, res: &mut dyn Resources, now: Timestamp) {
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            return;
        };
        //= https://www.rfc-editor.org/rfc/rfc7609#section-2.3
        //# The initiator of an LLC message exchange that fails will be responsible for
        //# retrying once the link group configuration stabilizes.
        if let Some(ex) = g.rkey_exchange.clone().filter(|ex| ex.via() == num) {
            g.end_rkey_exchange();
            g.pending.push_front(ex.retry());
        }
        let mut done_fc = None;
        match g.link_exchange.clone() {
            Some(
                LinkExchange::ServerAddLink {
                    new,
                    via,
                    first_contact,
                    ..
                }
                | LinkExchange::ClientAddLink {
                    new,
                    via,
                    first_contact,
                    ..
                },
            ) if via == num || new == num => {
                g.end_link_exchange();
                if new != num {
                    self.drop_link(lgr, new, now);
                }
                // The server's retry (nothing on the client).
                self.arm_add_link_retry(lgr, now);
                done_fc = Some(first_contact);
            }
            Some(LinkExchange::DeleteLink { link, via }) if via == num => {
                g.end_link_exchange();
                g.pending.push_front(LocalRequest::DeleteLink {
                    link,
                    orderly: false,
                    reason: DeleteLinkReason::LOST_PATH,
                });
                done_fc = Some(false);
            }
            _ => {}
        }
        match done_fc {
            Some(fc) => self.exchange_done(lgr, fc, res, now),
            None => self.llc_kick(lgr, res, now),
        }
    }

    /// Link `num` failed (completion error, QP error, keepalive, protocol violation).
    pub(super) fn fail_link(
        &mut self,
        lgr: LgrId,
        num: u8,
        reason: DeleteLinkReason,
        res: &mut dyn Resources,
        now: Timestamp,
    ) {
        if !self
            .lgrs
            .get(&lgr)
            .is_some_and(|g| g.links.contains_key(&num))
        {
            return;
        }
        self.stats.link_failures += 1;
        // Before a first contact's point of no return the connection falls back (C.2).
        if let Some(tcp) = self.first_contact_may_decline(lgr) {
            let code = smc_wire::DeclineCode::TIMEOUT_CL;
            self.decline(tcp, code, false, now);
            return;
        }
        let role = self.lgrs.get(&lgr).map(|g| g.role);
        self.remove_link(lgr, num, reason, res, now);
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            return;
        };
        //= https://www.rfc-editor.org/rfc/rfc7609#section-2.3
        //# The server or the client can detect a failure, immediately move their TCP
        //# connections, and then notify their peer via the DELETE LINK LLC command.
        match role {
            Some(Role::Server) => {
                g.pending.push_front(LocalRequest::DeleteLink {
                    link: num,
                    orderly: false,
                    reason,
                });
                self.arm_add_link_retry(lgr, now);
                self.llc_kick(lgr, res, now);
            }
            Some(Role::Client) => {
                let via = g.active_links().next().map(|l| l.num);
                if let Some(via) = via {
                    self.client_delete_link(lgr, via, num, false, reason, now);
                }
            }
            None => {}
        }
    }

    // ----- CONFIRM RKEY / DELETE RKEY (Fig. 12, 13, 14) --------------------------------------

    fn start_confirm_rkey(&mut self, lgr: LgrId, rmb: RmbId, now: Timestamp) -> bool {
        let timeout = self.llc_timer(lgr);
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            return false;
        };
        let Some(via) = g.active_links().next().map(|l| l.num) else {
            return false;
        };
        let Some(info) = g.local_rmbs.get(&rmb) else {
            return false;
        };
        let Some(own) = info.tokens.get(&via).copied() else {
            return false;
        };
        let others: Vec<LinkRtoken> = info
            .tokens
            .iter()
            .filter(|(n, _)| **n != via)
            .map(|(n, t)| LinkRtoken {
                link_num: *n,
                rkey: t.rkey,
                vaddr: t.vaddr,
            })
            .collect();
        g.rkey_exchange = Some(RkeyExchange::Confirm { rmb, via });
        //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
        //# LLC message: CONFIRM RKEY from client Timer waits for: CONFIRM RKEY reply from
        //# server.
        g.timers.set(LgrTimer::RkeyExchange, now + timeout);
        let first = padded(&others);
        //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.5.2.1
        //# CONFIRM RKEY(request, Add,
        let msg = LlcMessage::ConfirmRkey(ConfirmRkey {
            reply: false,
            negative: false,
            retry: false,
            num_tokens: others.len() as u8,
            rkey: own.rkey,
            vaddr: own.vaddr,
            others: first,
        });
        self.post_llc(lgr, via, msg, None, now);
        // More links than fit: CONFIRM RKEY CONTINUATION, three tokens each.
        let mut rest: Vec<LinkRtoken> = others.iter().skip(2).copied().collect();
        while !rest.is_empty() {
            let left = rest.len() as u8;
            let chunk: Vec<LinkRtoken> = rest.drain(..rest.len().min(3)).collect();
            let tokens = padded(&chunk);
            let msg = LlcMessage::ConfirmRkeyCont(ConfirmRkeyCont {
                reply: false,
                negative: false,
                num_tokens_left: left,
                tokens,
            });
            self.post_llc(lgr, via, msg, None, now);
        }
        true
    }

    fn on_confirm_rkey(
        &mut self,
        lgr: LgrId,
        via: u8,
        c: ConfirmRkey,
        res: &mut dyn Resources,
        now: Timestamp,
    ) {
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            return;
        };
        if c.reply {
            let Some(RkeyExchange::Confirm { rmb, .. }) = g.rkey_exchange.clone() else {
                self.stats.llc_discarded += 1;
                return;
            };
            g.end_rkey_exchange();
            if c.negative {
                //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.5.3.1
                //# Once the current exchange finishes, client will have to recompute its RKey
                //# set to include the new link and then start a new CONFIRM RKEY exchange.
                g.pending.push_back(LocalRequest::ConfirmRkey(rmb));
                if g.link_exchange.is_none() && !c.retry {
                    // A plain refusal: the RMB cannot be used.
                    g.pending.pop_back();
                    self.handshake_rkey_done(lgr, rmb, false, now);
                }
                self.llc_kick(lgr, res, now);
                return;
            }
            if let Some(r) = g.local_rmbs.get_mut(&rmb) {
                r.confirmed = true;
            }
            self.handshake_rkey_done(lgr, rmb, true, now);
            self.exchange_done(lgr, false, res, now);
            return;
        }
        // The peer adds an RMB.
        if g.link_exchange.is_some() {
            //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.5.3.1
            //# Colliding LLC message: CONFIRM RKEY from client Action to resolve: Send a
            //# negative CONFIRM RKEY response to the client.
            self.stats.rkey_collisions += 1;
            let reply = LlcMessage::ConfirmRkey(ConfirmRkey {
                reply: true,
                negative: true,
                retry: true,
                ..c
            });
            self.post_llc(lgr, via, reply, None, now);
            return;
        }
        let mut tokens = BTreeMap::new();
        tokens.insert(
            via,
            MrInfo {
                rkey: c.rkey,
                vaddr: c.vaddr,
            },
        );
        let others = c.others.iter().take(usize::from(c.num_tokens).min(2));
        tokens.extend(others.map(link_token));
        // An RMB already known on `via` (a peer that named it in CLC before confirming it)
        // gets the RTokens added to its record rather than a second record: the connections
        // using it hold the first one's index.
        let idx = match g.peer_rmb_index(via, c.rkey) {
            Some(i) => {
                if let Some(r) = g.peer_rmbs.get_mut(i) {
                    r.tokens.extend(tokens);
                }
                i
            }
            None => {
                g.peer_rmbs.push(crate::link_group::PeerRmb {
                    tokens,
                    gone: Vec::new(),
                });
                g.peer_rmbs.len() - 1
            }
        };
        let left = c.num_tokens.saturating_sub(2);
        if left > 0 {
            // The rest comes in CONFIRM RKEY CONTINUATION; reply after it.
            g.rkey_cont = Some((idx, left, c));
            return;
        }
        self.finish_peer_rkey(lgr, via, idx, c, res, now);
    }

    fn on_confirm_rkey_cont(
        &mut self,
        lgr: LgrId,
        via: u8,
        c: ConfirmRkeyCont,
        res: &mut dyn Resources,
        now: Timestamp,
    ) {
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            return;
        };
        if c.reply {
            return;
        }
        let Some((idx, left, first)) = g.rkey_cont else {
            self.stats.llc_discarded += 1;
            return;
        };
        let n = usize::from(c.num_tokens_left.min(3));
        if let Some(r) = g.peer_rmbs.get_mut(idx) {
            r.tokens.extend(c.tokens.iter().take(n).map(link_token));
        }
        let left = left.saturating_sub(n as u8);
        if left > 0 {
            g.rkey_cont = Some((idx, left, first));
            return;
        }
        g.rkey_cont = None;
        self.finish_peer_rkey(lgr, via, idx, first, res, now);
    }

    /// The peer's new RMB (record `idx`) is known on every link it named: reply, and treat
    /// the links it did not name as failed (C.7).
    fn finish_peer_rkey(
        &mut self,
        lgr: LgrId,
        via: u8,
        idx: usize,
        c: ConfirmRkey,
        res: &mut dyn Resources,
        now: Timestamp,
    ) {
        let Some(g) = self.lgrs.get(&lgr) else {
            return;
        };
        let Some(last) = g.peer_rmbs.get(idx) else {
            return;
        };
        let missing: Vec<u8> = g
            .active_links()
            .map(|l| l.num)
            .filter(|n| !last.tokens.contains_key(n))
            .collect();
        let reply = LlcMessage::ConfirmRkey(ConfirmRkey {
            reply: true,
            negative: false,
            retry: false,
            ..c
        });
        self.post_llc(lgr, via, reply, None, now);
        //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
        //# No RKey provided for one or more of the links in the link group.  Recovery
        //# action: Treat as if detected failure of the link(s) for which no RKey was
        //# provided.
        for n in missing {
            self.fail_link(lgr, n, DeleteLinkReason::PROTOCOL_VIOLATION, res, now);
        }
    }

    /// Remove RMBs we no longer need (Fig. 14). Only RMBs with no element in use.
    pub fn delete_unused_rmbs(
        &mut self,
        lgr: LgrId,
        res: &mut dyn Resources,
        now: Timestamp,
    ) -> usize {
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            return 0;
        };
        let unused: Vec<RmbId> = g
            .local_rmbs
            .keys()
            .copied()
            .filter(|id| g.pool.rmb_unused(*id))
            .take(8)
            .collect();
        if unused.is_empty() {
            return 0;
        }
        for id in &unused {
            g.pool.retire(*id);
        }
        let n = unused.len();
        g.pending.push_back(LocalRequest::DeleteRkey(unused));
        self.llc_kick(lgr, res, now);
        n
    }

    fn start_delete_rkey(&mut self, lgr: LgrId, rmbs: Vec<RmbId>, now: Timestamp) -> bool {
        let timeout = self.config.llc_timeout;
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            return false;
        };
        let Some(via) = g.active_links().next().map(|l| l.num) else {
            return false;
        };
        let mut rkeys = [0u32; 8];
        let mut count = 0u8;
        for (slot, id) in rkeys.iter_mut().zip(rmbs.iter()) {
            if let Some(t) = g.local_rmbs.get(id).and_then(|r| r.tokens.get(&via)) {
                *slot = t.rkey;
                count += 1;
            }
        }
        g.rkey_exchange = Some(RkeyExchange::Delete { rmbs, via });
        g.timers.set(LgrTimer::RkeyExchange, now + timeout);
        //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.5.2.2
        //# Once an SMC-R peer decides to delete an RMB, it sends a DELETE RKEY LLC message to
        //# its peer.
        let msg = LlcMessage::DeleteRkey(DeleteRkey {
            reply: false,
            negative: false,
            count,
            error_mask: 0,
            rkeys,
        });
        self.post_llc(lgr, via, msg, None, now);
        true
    }

    fn on_delete_rkey(
        &mut self,
        lgr: LgrId,
        via: u8,
        d: DeleteRkey,
        res: &mut dyn Resources,
        now: Timestamp,
    ) {
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            return;
        };
        if d.reply {
            let Some(RkeyExchange::Delete { rmbs, .. }) = g.rkey_exchange.clone() else {
                self.stats.llc_discarded += 1;
                return;
            };
            g.end_rkey_exchange();
            //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.5.2.2
            //# It can then free the RMB once it receives a response from the peer.
            for id in rmbs {
                g.local_rmbs.remove(&id);
                self.fabric_out
                    .push_back(FabricOp::FreeRmb { lgr, rmb: id });
            }
            self.exchange_done(lgr, false, res, now);
            return;
        }
        if g.link_exchange.is_some() {
            self.stats.rkey_collisions += 1;
            let reply = LlcMessage::DeleteRkey(DeleteRkey {
                reply: true,
                negative: true,
                // Every rkey the request names failed; a request naming none (the count is the
                // peer's) has no failed rkey to mark, and a shift by the whole width is undefined.
                error_mask: 0xFFu8
                    .checked_shl(8 - d.valid_rkeys().len().min(8) as u32)
                    .unwrap_or(0),
                ..d
            });
            self.post_llc(lgr, via, reply, None, now);
            return;
        }
        let mut mask = 0u8;
        for (i, rkey) in d.valid_rkeys().iter().enumerate() {
            match g.peer_rmb_index(via, *rkey) {
                // Keep the slot (indices are held by connections); empty it.
                Some(idx) => {
                    if let Some(r) = g.peer_rmbs.get_mut(idx) {
                        r.tokens.clear();
                    }
                }
                //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
                //# Specified RKey doesn't exist.  Recovery action: Send a negative DELETE RKEY
                //# response.
                None => mask |= 0x80 >> i,
            }
        }
        let reply = LlcMessage::DeleteRkey(DeleteRkey {
            reply: true,
            negative: mask != 0,
            error_mask: mask,
            ..d
        });
        self.post_llc(lgr, via, reply, None, now);
    }

    // ----- Group lifetime --------------------------------------------------------------------

    /// End the group: reset its connections, fail its handshakes, optionally tell the peer
    /// (DELETE LINK with the "all" flag), and free everything.
    pub(super) fn terminate_group(
        &mut self,
        lgr: LgrId,
        reason: DeleteLinkReason,
        notify: bool,
        now: Timestamp,
    ) {
        let Some(g) = self.lgrs.get(&lgr) else {
            return;
        };
        let via = g.active_links().next().map(|l| l.num);
        let orderly = g.conns.is_empty();
        tracing::info!(
            ?lgr,
            ?reason,
            notify,
            conns = g.conns.len(),
            "link group terminated"
        );
        let mut notice = None;
        if notify {
            if let Some(via) = via {
                //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.5.3
                //# DELETE LINK from the server to the client, with the "delete entire link
                //# group" flag set: This message informs the client that the entire link
                //# group is being deleted.
                let msg = LlcMessage::DeleteLink(DeleteLink {
                    reply: false,
                    all: true,
                    orderly,
                    link_num: 0,
                    reason,
                });
                notice = self.post_llc(lgr, via, msg, None, now);
            }
        }
        let conns: Vec<_> = self
            .lgrs
            .get(&lgr)
            .map(|g| g.conns.iter().copied().collect())
            .unwrap_or_default();
        for tcp in conns {
            match self.entries.get_mut(&tcp) {
                Some(Entry::Smc(_)) => self.conn_link_group_lost(tcp, now),
                Some(Entry::Setup(_)) => self.setup_reset(tcp, ResetReason::LinkGroupLost, now),
                None => {}
            }
        }
        let queued = self.fabric_out.len();
        self.destroy_link_group(lgr, now);
        if let Some(wr) = notice {
            //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
            //# LLC message: DELETE LINK from server (scope: entire link group) Timer waits
            //# for: Confirmation from the adapter that the message was delivered.
            let ops: Vec<FabricOp> = self.fabric_out.drain(queued..).collect();
            self.deferred.insert(wr, ops);
        }
        self.events
            .push_back(EndpointEvent::LinkGroupTerminated { lgr });
    }

    /// Free the group's links and RMBs and forget it.
    pub(super) fn destroy_link_group(&mut self, lgr: LgrId, _now: Timestamp) {
        let Some(g) = self.lgrs.remove(&lgr) else {
            return;
        };
        if let Some(s) = g.spare {
            self.fabric_out
                .push_back(FabricOp::DestroyQp { link: s.id });
        }
        for l in g.links.values() {
            self.links.remove(&l.id);
            self.fabric_out
                .push_back(FabricOp::DestroyQp { link: l.id });
        }
        for rmb in g.local_rmbs.keys() {
            self.fabric_out
                .push_back(FabricOp::FreeRmb { lgr, rmb: *rmb });
        }
        let stale: Vec<u32> = self
            .alerts
            .iter()
            .filter(|(_, t)| g.conns.contains(t))
            .map(|(a, _)| *a)
            .collect();
        for a in stale {
            self.alerts.remove(&a);
        }
    }

    /// The server starts the idle timer of a group that has no connection left.
    pub(super) fn maybe_idle(&mut self, lgr: LgrId, now: Timestamp) {
        let idle = self.config.lgr_idle_timeout;
        if let Some(g) = self.lgrs.get_mut(&lgr) {
            if g.role == Role::Server && g.conns.is_empty() && g.first_contact.is_none() {
                g.timers.set(LgrTimer::Idle, now + idle);
            }
        }
    }

    // ----- Timers ----------------------------------------------------------------------------

    pub(super) fn lgr_timeout(&mut self, lgr: LgrId, res: &mut dyn Resources, now: Timestamp) {
        // Link timers first (keepalive).
        let links: Vec<u8> = self
            .lgrs
            .get(&lgr)
            .map(|g| g.links.keys().copied().collect())
            .unwrap_or_default();
        for num in links {
            while let Some(kind) = self
                .lgrs
                .get_mut(&lgr)
                .and_then(|g| g.links.get_mut(&num))
                .and_then(|l| l.timers.pop_expired(now))
            {
                match kind {
                    LinkTimer::Keepalive => self.keepalive_due(lgr, num, res, now),
                    //= https://www.rfc-editor.org/rfc/rfc7609#section-4.5.3
                    //# If, however, a response is not received in a reasonable amount of time
                    //# or there's a failure in sending the TEST LINK LLC command, then this is
                    //# considered a failure in the SMC-R link, and failover processing to an
                    //# alternate SMC-R link must be triggered.
                    LinkTimer::TestLinkReply => {
                        self.fail_link(lgr, num, DeleteLinkReason::LOST_PATH, res, now)
                    }
                }
            }
        }
        loop {
            let Some(g) = self.lgrs.get_mut(&lgr) else {
                return;
            };
            let Some(kind) = g.timers.pop_expired(now) else {
                return;
            };
            match kind {
                LgrTimer::LinkExchange => self.link_exchange_timeout(lgr, res, now),
                LgrTimer::RkeyExchange => {
                    //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
                    //# Recovery action: Perform normal client procedures for detection of
                    //# failed link.  The link over which the message was sent has failed.
                    let Some(via) = g.rkey_exchange.as_ref().map(RkeyExchange::via) else {
                        continue;
                    };
                    self.fail_link(lgr, via, DeleteLinkReason::LOST_PATH, res, now);
                }
                LgrTimer::AddLinkRetry => match g.role {
                    Role::Server => {
                        g.pending.push_back(LocalRequest::AddLink);
                        self.llc_kick(lgr, res, now);
                    }
                    Role::Client => {
                        let _ = self.request_add_link(lgr, res, now);
                    }
                },
                LgrTimer::DeleteLinkWait => {
                    let waiting: Vec<(u8, u8)> =
                        g.client_deleting.iter().map(|(l, v)| (*l, *v)).collect();
                    g.client_deleting.clear();
                    for (link, via) in waiting {
                        //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
                        //# If the scope of the request is to delete a single link, the
                        //# surviving link over which the client sent the DELETE LINK is no
                        //# longer usable either.
                        self.fail_link(lgr, via, DeleteLinkReason::LOST_PATH, res, now);
                        let Some(g) = self.lgrs.get(&lgr) else {
                            return;
                        };
                        let survivor = g.active_links().find(|l| l.num != link).map(|l| l.num);
                        if let Some(s) = survivor {
                            //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
                            //# If there are other surviving links in the link group, resend
                            //# over a surviving link.
                            let reason = DeleteLinkReason::LOST_PATH;
                            self.client_delete_link(lgr, s, link, false, reason, now);
                        }
                    }
                }
                LgrTimer::Idle => {
                    if g.conns.is_empty() && g.first_contact.is_none() {
                        self.terminate_group(lgr, DeleteLinkReason::PROGRAM_INITIATED, true, now);
                        return;
                    }
                }
            }
        }
    }

    fn keepalive_due(&mut self, lgr: LgrId, num: u8, res: &mut dyn Resources, now: Timestamp) {
        let (Some(interval), timeout) = (self.config.keepalive, self.config.llc_timeout) else {
            return;
        };
        let Some(l) = self.lgrs.get_mut(&lgr).and_then(|g| g.links.get_mut(&num)) else {
            return;
        };
        //= https://www.rfc-editor.org/rfc/rfc7609#section-4.5.3
        //# the host checks to see whether or not the SMC-R link has been idle for a duration
        //# longer than the keepalive timeout.  If both conditions are met, the local host then
        //# performs a TEST LINK LLC command to test the viability of the SMC-R link
        if now.saturating_duration_since(l.last_activity) < interval {
            l.timers
                .set(LinkTimer::Keepalive, l.last_activity + interval);
            return;
        }
        let mut data = [0u8; 16];
        for chunk in data.chunks_mut(4) {
            chunk.copy_from_slice(&res.random_u32().to_be_bytes());
        }
        l.test_link = Some(data);
        l.timers.set(LinkTimer::TestLinkReply, now + timeout);
        self.stats.test_links_sent += 1;
        let msg = LlcMessage::TestLink(TestLink {
            reply: false,
            user_data: data,
        });
        self.post_llc(lgr, num, msg, None, now);
    }

    fn link_exchange_timeout(&mut self, lgr: LgrId, res: &mut dyn Resources, now: Timestamp) {
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            return;
        };
        let Some(ex) = g.link_exchange.clone() else {
            return;
        };
        match ex {
            LinkExchange::ServerAddLink {
                new,
                via,
                step,
                first_contact,
                ..
            } => match (step, first_contact) {
                (ServerAddStep::SentAddLink, true) => {
                    //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
                    //# Recovery action: Break the TCP connection with a RST, and clean up
                    //# RoCE resources.
                    self.first_contact_timed_out(lgr, "ADD LINK reply", false, now);
                }
                (ServerAddStep::SentAddLink, false) | (ServerAddStep::SentCont, false) => {
                    //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
                    //# Recovery action: Clean up resources (QP, RKeys, etc.) for the new
                    //# link, and treat the link over which the ADD LINK was sent as if it
                    //# had failed.
                    g.link_exchange = None;
                    self.drop_link(lgr, new, now);
                    self.fail_link(lgr, via, DeleteLinkReason::LOST_PATH, res, now);
                    self.arm_add_link_retry(lgr, now);
                    self.llc_kick(lgr, res, now);
                }
                (ServerAddStep::SentCont, true) => {
                    self.first_contact_timed_out(lgr, "ADD LINK CONTINUATION reply", false, now);
                }
                (ServerAddStep::SentConfirmLink, _) => {
                    //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
                    //# Recovery action: The second link was not successfully set up.  Send a
                    //# DELETE LINK to the client.  Connection data cannot flow in the first
                    //# link in the link group, until the reply to this DELETE LINK is
                    //# received
                    g.link_exchange = None;
                    self.drop_link(lgr, new, now);
                    let reason = DeleteLinkReason::PROGRAM_INITIATED;
                    self.post_delete_link(lgr, via, new, false, reason, now);
                    let timeout = self.llc_timer(lgr);
                    let ex = LinkExchange::DeleteLink { link: new, via };
                    self.await_link_exchange(lgr, ex, timeout, now);
                    self.arm_add_link_retry(lgr, now);
                    // The first contact completes when the DELETE LINK reply arrives.
                    let _ = first_contact;
                }
            },
            LinkExchange::ClientAddLink {
                new,
                via,
                step,
                first_contact,
                ..
            } => {
                //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
                //# LLC message: ADD LINK reply from client (and there are more RKeys to be
                //# communicated) Timer waits for: ADD LINK CONTINUATION from server.
                //# Recovery action: Treat the same as ADD LINK timer failure.
                let server_owes = matches!(
                    step,
                    ClientAddStep::SentReply | ClientAddStep::SentCont { server_owes: true }
                );
                if server_owes && first_contact {
                    //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
                    //# Recovery action: Clean up the SMC-R link, and break the TCP connection
                    //# by sending a RST.  There is a problem with the server.
                    self.first_contact_timed_out(lgr, "ADD LINK CONTINUATION", false, now);
                    return;
                }
                if server_owes {
                    //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
                    //# Recovery action: Treat as if client detected link failure on the link
                    //# that the ADD LINK exchange is using.
                    g.link_exchange = None;
                    self.drop_link(lgr, new, now);
                    self.fail_link(lgr, via, DeleteLinkReason::LOST_PATH, res, now);
                    return;
                }
                //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
                //# Recovery action: The setup of the new link failed.  Send a DELETE LINK to
                //# the server.  Do not consider the socket opened to the client application
                //# until receiving confirmation from the server in the form of a DELETE LINK
                //# request for this link and sending the reply
                g.link_exchange = None;
                self.drop_link(lgr, new, now);
                let reason = DeleteLinkReason::PROGRAM_INITIATED;
                self.post_delete_link(lgr, via, new, false, reason, now);
                //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
                //# Set a timer to send another ADD LINK to the server if there is still an
                //# unused RNIC on the client side.
                let retry = self.config.add_link_retry;
                let devices = self.config.devices.len();
                if let Some(g) = self.lgrs.get_mut(&lgr) {
                    if g.unused_device(devices).is_some() {
                        g.timers.set(LgrTimer::AddLinkRetry, now + retry);
                    }
                }
                if first_contact {
                    let timeout = self.llc_timer(lgr);
                    let ex = LinkExchange::ClientAwaitDelete { link: new };
                    self.await_link_exchange(lgr, ex, timeout, now);
                } else {
                    self.exchange_done(lgr, false, res, now);
                }
            }
            LinkExchange::DeleteLink { link, via } => {
                //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
                //# The link over which the server sent the DELETE LINK is no longer usable
                //# either.
                g.link_exchange = None;
                g.pending.push_front(LocalRequest::DeleteLink {
                    link,
                    orderly: false,
                    reason: DeleteLinkReason::LOST_PATH,
                });
                if g.first_contact.is_some() && g.active_count() <= 1 {
                    // C.7: the first contact cannot complete.
                    self.first_contact_timed_out(lgr, "DELETE LINK reply", false, now);
                    return;
                }
                self.fail_link(lgr, via, DeleteLinkReason::LOST_PATH, res, now);
                self.llc_kick(lgr, res, now);
            }
            LinkExchange::ClientAwaitDelete { .. } => {
                self.first_contact_timed_out(lgr, "DELETE LINK request", true, now);
            }
        }
    }

    /// An LLC exchange of a first contact timed out waiting for `what`: reset the first
    /// contact's TCP connection and end the group (telling the peer when `notify`).
    fn first_contact_timed_out(
        &mut self,
        lgr: LgrId,
        what: &'static str,
        notify: bool,
        now: Timestamp,
    ) {
        if let Some(tcp) = self.lgrs.get(&lgr).and_then(|g| g.first_contact) {
            self.setup_reset(tcp, ResetReason::LlcTimeout(what), now);
        }
        self.terminate_group(lgr, DeleteLinkReason::PROGRAM_INITIATED, notify, now);
    }
}

/// ADD LINK (request, or positive reply when `reply`) for link `link_num` offering our RNIC
/// `dev` and QP `qp`.
fn add_link(reply: bool, dev: Device, qp: QpInfo, link_num: u8, mtu: QpMtu) -> LlcMessage {
    LlcMessage::AddLink(AddLink {
        reply,
        rejected: false,
        reject_reason: AddLinkRejectReason(0),
        sender_mac: dev.mac,
        sender_gid: dev.gid,
        sender_qp: qp.qpn,
        link_num,
        mtu,
        initial_psn: qp.psn,
    })
}

/// The peer's QP as its ADD LINK (request or reply) offers it, on a path of MTU `mtu`.
fn add_link_qp(a: &AddLink, mtu: QpMtu) -> RemoteQp {
    RemoteQp {
        gid: a.sender_gid,
        mac: a.sender_mac,
        qpn: a.sender_qp,
        psn: a.initial_psn,
        mtu,
    }
}

/// ADD LINK CONTINUATION carrying `pairs` (at most two); `total` counts this message's pairs
/// and those still to come.
fn add_link_cont(reply: bool, link_num: u8, total: usize, pairs: &[RtokenPair]) -> LlcMessage {
    LlcMessage::AddLinkCont(AddLinkCont {
        reply,
        link_num,
        num_rtokens: total.min(255) as u8,
        pairs: padded(pairs),
    })
}

/// The first `N` of `items`, padded with defaults (an LLC message's fixed slots).
fn padded<T: Copy + Default, const N: usize>(items: &[T]) -> [T; N] {
    let mut slots = [T::default(); N];
    for (slot, x) in slots.iter_mut().zip(items) {
        *slot = *x;
    }
    slots
}

/// A CONFIRM RKEY (CONTINUATION) token as (link number, RToken on that link).
fn link_token(t: &LinkRtoken) -> (u8, MrInfo) {
    let token = MrInfo {
        rkey: t.rkey,
        vaddr: t.vaddr,
    };
    (t.link_num, token)
}
