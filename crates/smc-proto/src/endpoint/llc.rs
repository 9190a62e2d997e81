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

mod add_link;
mod delete_link;
mod rkey;

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
            use smc_wire::llc_v2::LlcV2Message;
            match LlcV2Message::parse(bytes) {
                // ADD LINK v2 carries the rkeys of the new link itself (smc-rv2.md §10.4).
                Ok(LlcV2Message::AddLink(a)) => {
                    let m = LlcMessage::AddLink(a.base);
                    self.handle_llc_ext(lgr, num, m, a.ext, res, now)
                }
                Ok(LlcV2Message::ReqAddLink(r)) => self.on_req_add_link_v2(lgr, num, r, res, now),
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
                if g.v2.is_some() {
                    // SMC-Rv2: REQ ADD LINK v2 with our RoCEv2 GIDs, the current link's
                    // first (smc-rv2.md §10.9).
                    let current = g
                        .links
                        .get(&via)
                        .and_then(|l| devices.get(usize::from(l.device.0)))
                        .map(|d| d.gid);
                    let gids = current.into_iter().chain([dev.gid]).collect();
                    let m = smc_wire::llc_v2::LlcV2Message::ReqAddLink(
                        smc_wire::llc_v2::ReqAddLinkV2 { reply: false, gids },
                    );
                    self.post_llc_v2(lgr, via, &m, now);
                } else {
                    let msg = add_link(false, dev, no_qp, 0, dev.mtu);
                    self.post_llc(lgr, via, LlcMessage::AddLink(msg), None, now);
                }
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
        self.handle_llc_ext(lgr, via, m, None, res, now)
    }

    /// [`handle_llc`](Self::handle_llc); `add_link_ext`: the rkey extension of an ADD LINK v2
    /// (one of 72 bytes or more).
    fn handle_llc_ext(
        &mut self,
        lgr: LgrId,
        via: u8,
        m: LlcMessage,
        add_link_ext: Option<smc_wire::llc_v2::AddLinkV2Ext>,
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
                    if self.handshake_confirm_link(tcp, lgr, via, c, res, now) {
                        self.llc_kick(lgr, res, now);
                        return;
                    }
                }
                self.on_confirm_link(lgr, via, c, res, now)
            }
            LlcMessage::AddLink(a) => match (role, a.reply) {
                (Role::Client, false) => {
                    self.client_on_add_link(lgr, via, a, add_link_ext, res, now)
                }
                (Role::Server, false) => self.server_on_client_add_link(lgr, via, a, res, now),
                (Role::Server, true) => {
                    self.server_on_add_link_reply(lgr, via, a, add_link_ext, res, now)
                }
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
            // The link is viable: the next TEST LINK follows the next keepalive interval of
            // silence. (Re-arming only at a message's arrival, as before, stopped the
            // keepalive for good on a link silent since: a sender whose peer stopped reading
            // never learned of the peer's death.)
            //= https://www.rfc-editor.org/rfc/rfc7609#section-4.5.3
            //# If both conditions are met, the local host then performs a TEST LINK LLC
            //# command to test the viability of the SMC-R link
            let keepalive = self.config.keepalive;
            l.rearm_keepalive(keepalive, now);
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

    /// Take in every peer RMB known on the new link `num` (its RTokens from ADD LINK
    /// CONTINUATION or the CLC) before the link carries anything: a failover onto it must
    /// not find, at its first WRITE, that what a WRITE needs locally ran out (the shm fabric
    /// maps the peer's memory then, a descriptor each). `false`: one could not be taken in.
    pub(super) fn take_peer_rmbs_on(
        &mut self,
        lgr: LgrId,
        num: u8,
        res: &mut dyn Resources,
    ) -> bool {
        let Some(g) = self.lgrs.get(&lgr) else {
            return false;
        };
        let Some(link) = g.links.get(&num).map(|l| l.id) else {
            return false;
        };
        let taken = g
            .peer_rmbs
            .iter()
            .filter_map(|r| r.tokens.get(&num))
            .try_for_each(|t| res.take_peer_rtoken(link, t.rkey));
        match taken {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(
                    ?lgr,
                    num,
                    "new link cannot take in the peer's RMBs: {}",
                    e.0
                );
                self.stats.rkeys_refused += 1;
                false
            }
        }
    }

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
                // A new link whose RMBs cannot be taken in locally fails alone, as one whose
                // QP could not be made: the group goes on with the links it has, and the C.8
                // timer tries again.
                if !self.take_peer_rmbs_on(lgr, new, res) {
                    self.server_abandon_add_link(lgr, new, first_contact, res, now);
                    return;
                }
                let Some(g) = self.lgrs.get_mut(&lgr) else {
                    return;
                };
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
                // A new link whose RMBs cannot be taken in locally fails alone, as one whose
                // QP could not be made: the group goes on with the links it has.
                if !ok || !self.take_peer_rmbs_on(lgr, new, res) {
                    //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
                    //# Protocol error.  The link must be brought down by sending a DELETE LINK
                    //# for the link over another link in the link group if one exists.
                    self.abandon_new_link(lgr, new, true, now);
                    if first_contact {
                        self.first_contact_done(lgr, now);
                    }
                    return;
                }
                let Some(g) = self.lgrs.get_mut(&lgr) else {
                    return;
                };
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
fn add_link(reply: bool, dev: Device, qp: QpInfo, link_num: u8, mtu: QpMtu) -> AddLink {
    AddLink {
        reply,
        rejected: false,
        reject_reason: AddLinkRejectReason(0),
        sender_mac: dev.mac,
        sender_gid: dev.gid,
        sender_qp: qp.qpn,
        link_num,
        mtu,
        initial_psn: qp.psn,
    }
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
