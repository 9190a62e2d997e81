//! ADD LINK and ADD LINK CONTINUATION, server and client side (RFC 7609 §3.5.3, Fig. 8–11,
//! App. C.7): a second link for a link group, its QP and its rtokens.

use super::*;
use crate::endpoint::v2::ADD_LINK_V2_MAX_RKEYS;
use smc_wire::llc_v2::AddLinkV2Ext;

impl Endpoint {
    /// Start the next local request if no configuration exchange is in progress
    /// (§3.5.5.3: "When a peer knows that one of these exchanges is in progress, it must not
    /// start another exchange").
    pub(in crate::endpoint) fn llc_kick(
        &mut self,
        lgr: LgrId,
        res: &mut dyn Resources,
        now: Timestamp,
    ) {
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

    pub(super) fn llc_timer(&self, lgr: LgrId) -> std::time::Duration {
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
    pub(super) fn start_add_link(
        &mut self,
        lgr: LgrId,
        res: &mut dyn Resources,
        now: Timestamp,
    ) -> bool {
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
        let (mtu, v2) = self
            .lgrs
            .get(&lgr)
            .map_or((dev.mtu, false), |g| (g.mtu, g.v2.is_some()));
        let request = add_link(false, dev, qp, num, mtu);
        let ours_left = if v2 {
            // smc-rv2.md §10.4: "Both the server's request and a client's accepting reply
            // carry the extension with their own RMBs; there is no ADD LINK CONTINUATION
            // exchange in v2."
            if pairs.len() > ADD_LINK_V2_MAX_RKEYS {
                self.drop_link(lgr, num, now);
                if first_contact {
                    self.first_contact_done(lgr, now);
                }
                return false;
            }
            self.post_add_link_v2(lgr, via, request, pairs, now);
            Vec::new()
        } else {
            self.post_llc(lgr, via, LlcMessage::AddLink(request), None, now);
            pairs
        };
        let ex = LinkExchange::ServerAddLink {
            new: num,
            via,
            step: ServerAddStep::SentAddLink,
            first_contact,
            ours_left,
        };
        //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
        //# LLC message: ADD LINK from server (first contact) Timer waits for: ADD LINK
        //# reply from client.
        self.await_link_exchange(lgr, ex, timeout, now);
        true
    }

    /// Register every RMB of ours on the new link `num`; returns the RToken pairs (as known
    /// on `via`, as known on the new link) for ADD LINK CONTINUATION.
    pub(super) fn register_rmbs_on_link(
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

    /// Server: the client's reply to our ADD LINK; `ext`: the rkey extension of an ADD LINK v2
    /// reply.
    pub(super) fn server_on_add_link_reply(
        &mut self,
        lgr: LgrId,
        via: u8,
        a: AddLink,
        ext: Option<AddLinkV2Ext>,
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
        let v2 = g.v2.is_some();
        if !self.connect_link(lgr, new, add_link_qp(&a, mtu)) {
            return;
        }
        if !v2 {
            self.server_send_cont(lgr, new, via, first_contact, ours_left, timeout, now);
            return;
        }
        // SMC-Rv2: the accepting reply carries the client's rkeys on the new link (§10.4);
        // they are installed before CONFIRM LINK goes over it. A reply without them (shorter
        // than 72 bytes, or the v1 form) cannot set the link up.
        let installed = match &ext {
            Some(e) => self.install_peer_pairs(lgr, via, new, v2_entries(e)),
            None => false,
        };
        if !installed {
            self.stats.llc_v2_add_link_invalid += 1;
            self.server_abandon_add_link(lgr, new, first_contact, res, now);
            return;
        }
        self.server_confirm_new_link(lgr, new, via, first_contact, res, timeout, now);
    }

    /// The peer's RToken pairs for the new link `new`, received over `via`: its RMB known on
    /// `via` by `reference_rkey` is known on `new` by (`new_rkey`, `new_vaddr`). False when a
    /// pair names an RMB we do not know on `via`.
    pub(super) fn install_peer_pairs(
        &mut self,
        lgr: LgrId,
        via: u8,
        new: u8,
        pairs: &[RtokenPair],
    ) -> bool {
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            return false;
        };
        let mut known = true;
        //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.5.2.3
        //# the first RToken in each RToken pair will be the RToken for the RMB as known on
        //# the SMC-R link over which the LLC message is being sent.
        for p in pairs {
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
                None => known = false,
            }
        }
        known
    }

    /// Server: every RToken for link `new` is exchanged: verify the link with CONFIRM LINK over
    /// it (Fig. 9), or give it up when an RMB of the client is not known on it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn server_confirm_new_link(
        &mut self,
        lgr: LgrId,
        new: u8,
        via: u8,
        first_contact: bool,
        res: &mut dyn Resources,
        timeout: Duration,
        now: Timestamp,
    ) {
        if !self
            .lgrs
            .get(&lgr)
            .is_some_and(|g| g.peer_rmbs_known_on(new))
        {
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
            ours_left: Vec::new(),
        };
        //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
        //# LLC message: CONFIRM LINK from server (first contact, second link in the
        //# link group) Timer waits for: CONFIRM LINK reply from client.
        self.await_link_exchange(lgr, ex, timeout, now);
    }

    /// Server: send our next ADD LINK CONTINUATION for link `new` over `via`; the client's
    /// continuation is then due.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn server_send_cont(
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

    pub(super) fn server_on_client_add_link(
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

    /// Server: a client's REQ ADD LINK v2 (smc-rv2.md §10.9: "Sent by a Linux client ... to
    /// ask the server to start ADD LINK"). "A Linux server either starts ADD LINK ... or
    /// answers with the same type, flags 0x80, data zeroed, 44 bytes": so do we, answering
    /// when the group has all its links. Anything else (a reply, a client receiving one, a v1
    /// group) is discarded.
    pub(super) fn on_req_add_link_v2(
        &mut self,
        lgr: LgrId,
        via: u8,
        r: smc_wire::llc_v2::ReqAddLinkV2,
        res: &mut dyn Resources,
        now: Timestamp,
    ) {
        let Some(g) = self.lgrs.get(&lgr) else {
            return;
        };
        if r.reply || g.role != Role::Server || g.v2.is_none() {
            self.stats.llc_discarded += 1;
            return;
        }
        if g.symmetric_count() >= usize::from(g.max_links) {
            let answer =
                smc_wire::llc_v2::LlcV2Message::ReqAddLink(smc_wire::llc_v2::ReqAddLinkV2 {
                    reply: true,
                    gids: Vec::new(),
                });
            self.post_llc_v2(lgr, via, &answer, now);
            return;
        }
        // As a v1 client's ADD LINK request (an "FYI", App. C.8): start ADD LINK when no
        // exchange is in progress, else after it.
        self.server_on_client_add_link(lgr, via, AddLink::default(), res, now);
    }

    // ----- ADD LINK (client side) ------------------------------------------------------------

    /// Client: the server's ADD LINK request; `ext`: the rkey extension of an ADD LINK v2.
    pub(super) fn client_on_add_link(
        &mut self,
        lgr: LgrId,
        via: u8,
        a: AddLink,
        ext: Option<AddLinkV2Ext>,
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
        // SMC-Rv2: the request carries the server's rkeys on the new link (§10.4: no ADD LINK
        // CONTINUATION in v2); one without them (shorter than 72 bytes, or the v1 form)
        // cannot set a link up.
        let v2 = g.v2.is_some();
        if v2 && ext.is_none() {
            self.stats.llc_v2_add_link_invalid += 1;
            let reason = AddLinkRejectReason::NO_ALTERNATE_PATH;
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
        if let (true, Some(ext)) = (v2, ext) {
            // The server's rkeys on the new link go in before its CONFIRM LINK over it can
            // arrive; our reply carries ours. A pair naming an RMB we do not know, an RMB of
            // the server's left out (its count may say more than the message holds: we read
            // min(count, (length - 72) / 16) entries, §10.4), or more RMBs of ours than an
            // ADD LINK v2 carries, and the link is refused.
            let complete = self.install_peer_pairs(lgr, via, num, v2_entries(&ext))
                && self
                    .lgrs
                    .get(&lgr)
                    .is_some_and(|g| g.peer_rmbs_known_on(num));
            if !complete || pairs.len() > ADD_LINK_V2_MAX_RKEYS {
                self.stats.llc_v2_add_link_invalid += 1;
                self.drop_link(lgr, num, now);
                let reason = AddLinkRejectReason::NO_ALTERNATE_PATH;
                self.client_reject_add_link(lgr, via, a, reason, res, now);
                return;
            }
            self.post_add_link_v2(lgr, via, reply, pairs, now);
            let ex = LinkExchange::ClientAddLink {
                new: num,
                via,
                step: ClientAddStep::SentCont { server_owes: false },
                first_contact,
                ours_left: Vec::new(),
            };
            //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
            //# Timer waits for: CONFIRM LINK from the server, over the new link.
            self.await_link_exchange(lgr, ex, timeout, now);
            return;
        }
        self.post_llc(lgr, via, LlcMessage::AddLink(reply), None, now);
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
    pub(super) fn client_reject_add_link(
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

    pub(super) fn on_add_link_cont(
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
        if !self.install_peer_pairs(lgr, via, new, c.valid_pairs()) {
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
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            return;
        };
        g.timers.stop(LgrTimer::LinkExchange);
        if server {
            if !ours_left.is_empty() || peer_more {
                self.server_send_cont(lgr, new, via, first_contact, ours_left, timeout, now);
                return;
            }
            // Every RToken is exchanged: verify the new link with CONFIRM LINK over it.
            self.server_confirm_new_link(lgr, new, via, first_contact, res, timeout, now);
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
    pub(super) fn send_add_link_cont(
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
    pub(super) fn await_link_exchange(
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
    pub(super) fn server_abandon_add_link(
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
    pub(super) fn abandon_new_link(&mut self, lgr: LgrId, new: u8, notify: bool, now: Timestamp) {
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
    pub(super) fn drop_link(&mut self, lgr: LgrId, num: u8, now: Timestamp) {
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
        if self.retired_links.len() == crate::endpoint::RETIRED_LINKS {
            self.retired_links.pop_front();
        }
        self.retired_links.push_back((l.id, lgr));
        self.fabric_out
            .push_back(FabricOp::DestroyQp { link: l.id });
    }

    pub(super) fn arm_add_link_retry(&mut self, lgr: LgrId, now: Timestamp) {
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
}

/// The rkey entries of an ADD LINK v2 that count: the message's `min(count, (length − 72) / 16)`
/// (the parser's), at most 255 (smc-rv2.md §10.4: Linux "uses at most 255 entries").
fn v2_entries(e: &AddLinkV2Ext) -> &[RtokenPair] {
    &e.rtokens[..e.rtokens.len().min(ADD_LINK_V2_MAX_RKEYS)]
}
