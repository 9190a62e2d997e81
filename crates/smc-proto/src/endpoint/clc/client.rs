//! The client side of the CLC rendezvous (Proposal, the server's Accept, our Confirm) and the
//! verification of a first contact's link (CONFIRM LINK, Fig. 8, Fig. 42).

use super::*;

impl Endpoint {
    pub(super) fn on_accept(
        &mut self,
        tcp: TcpId,
        device: DeviceId,
        a: AcceptConfirm,
        res: &mut dyn Resources,
        now: Timestamp,
    ) {
        let opts = self.setup_options(tcp);
        let offered_v2 = matches!(self.entries.get(&tcp), Some(Entry::Setup(h)) if h.offered_v2);
        let v2_accept = a.version >= 2;
        if v2_accept {
            if let Some(Entry::Setup(h)) = self.entries.get_mut(&tcp) {
                h.clc_v2 = true;
            }
            // §9.2: a version-2 Accept of type R only if we proposed SMC-Rv2.
            if !offered_v2 {
                self.decline(tcp, DeclineCode::MODEUNSUPP, false, now);
                return;
            }
        } else if !self.config.versions.v1 {
            self.decline(tcp, DeclineCode::MODEUNSUPP, false, now);
            return;
        }
        let v2_eid = a.v2.as_ref().map(|v| v.eid);
        // Our side of the agreement on first contact (the Accept's extension checked).
        let agreed = match (a.v2.as_ref(), a.first_contact) {
            (Some(v), true) => {
                let Some(fce) = v.first_contact_ext.as_ref() else {
                    self.decline(tcp, DeclineCode::RELEASEERR, false, now);
                    return;
                };
                let our_gid = self.device(device).map(|d| d.gid).unwrap_or_default();
                match crate::endpoint::v2::check_accept_ext(fce, v.eid, our_gid) {
                    Ok(x) => Some(x),
                    Err(code) => {
                        self.decline(tcp, code, false, now);
                        return;
                    }
                }
            }
            _ => None,
        };
        // Subsequent contact: the server's peer ID, GID, MAC and QP match a known link.
        //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.2.2
        //# It is a subsequent contact if the server-side peer ID, GID, MAC, and QP number
        //# provided in the packet match a known SMC-R link, and the first contact flag is
        //# not set.
        let known = self
            .lgrs
            .values()
            .filter(|g| {
                g.role == Role::Client
                    && g.peer_id == a.peer_id
                    && g.pnet == opts.pnet
                    && g.v2.is_some() == v2_accept
                    && g.v2.is_none_or(|x| Some(x.eid) == v2_eid)
            })
            .find_map(|g| {
                g.active_links()
                    .find(|l| {
                        l.remote
                            .is_some_and(|r| r.qpn == a.qp_num && r.gid == a.gid && r.mac == a.mac)
                    })
                    .map(|l| (g.id, l.num))
            });
        if !a.first_contact {
            // The server may name a link of a group we share that has just failed here (it
            // has not seen the failure yet): the groups are in sync. When its RMB is known on
            // a surviving link, the connection runs there; else it stays on TCP.
            let raced = match known {
                Some(_) => None,
                None => self.lgrs.values().find_map(|g| {
                    let ours = g.role == Role::Client
                        && g.peer_id == a.peer_id
                        && g.pnet == opts.pnet
                        && g.gone_remotes
                            .iter()
                            .any(|r| r.qpn == a.qp_num && r.gid == a.gid && r.mac == a.mac);
                    ours.then(|| (g.id, raced_rmb(g, a.rmb_rkey, a.rmb_vaddr)))
                }),
            };
            let known = known.or(match raced {
                Some((lgr, Some((_, link)))) => Some((lgr, link)),
                _ => None,
            });
            let Some((lgr, link)) = known else {
                if raced.is_some() {
                    self.decline(tcp, DeclineCode::NOSRVLINK, false, now);
                    return;
                }
                //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.4
                //# Because the first contact flag is off, the client realizes it is out of
                //# sync with the server and sends an SMC Decline to cause the connection to
                //# fall back to IP.
                self.decline(tcp, DeclineCode::SYNCERR, true, now);
                return;
            };
            let setup = match self.alloc_rmbe(lgr, opts.rmbe_size, res) {
                Ok(s) => s,
                Err(()) => {
                    self.decline(tcp, DeclineCode::MEM, false, now);
                    return;
                }
            };
            if let Some(g) = self.lgrs.get_mut(&lgr) {
                g.conns.insert(tcp);
                g.timers.stop(crate::link_group::LgrTimer::Idle);
            }
            self.alerts.insert(setup.alert, tcp);
            let idx = match raced {
                Some((_, Some((idx, _)))) => Some(idx),
                _ => {
                    // Remember the server's RMB (a new RToken on this link means a new RMB).
                    self.note_peer_rmb(lgr, link, a.rmb_rkey, a.rmb_vaddr);
                    self.lgrs
                        .get(&lgr)
                        .and_then(|g| g.peer_rmb_index(link, a.rmb_rkey))
                }
            };
            if let Some(Entry::Setup(h)) = self.entries.get_mut(&tcp) {
                h.peer_rmb = idx;
            }
            //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.2.2
            //# If the client allocates a new RMB for this TCP connection, it performs the
            //# processing described in Section 3.5.5.2.1
            // So does a connection given an element of an RMB still being confirmed.
            let rmb = setup.alloc.handle.rmb;
            let awaits = self
                .lgrs
                .get_mut(&lgr)
                .is_some_and(|g| g.rmb_awaits_confirm(rmb));
            if awaits {
                self.set_state(tcp, HsState::ClientAwaitRkey { setup, link });
                self.set_peer_accept(tcp, a);
                self.llc_kick(lgr, res, now);
            } else {
                self.client_send_confirm(tcp, setup, link, a, now);
            }
            return;
        }
        // First contact (possibly a parallel link group the server chose to create). A
        // server port our RNIC cannot connect a QP to (the shm fabric: a peer in another
        // fabric directory) is declined in place of the Confirm. A Confirm followed by the
        // Decline of the failed QP connect would cross the server's own Decline (it fails
        // its connect to our QP as well, C.2), and the server's Decline would then stand in
        // front of the program's data in our TCP socket, where a program that waits for
        // readability takes it for data.
        //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.1.6.4
        //# The SMC Decline CLC message may be sent in place of any expected message
        if !res.connectable(device, a.gid) {
            self.decline(tcp, DeclineCode::ERR_RDYLNK, false, now);
            return;
        }
        let llc = if agreed.is_some() {
            LlcVersion::V2
        } else {
            LlcVersion::V1
        };
        let group = self.first_contact_group(tcp, Role::Client, a.peer_id, (device, llc), res, now);
        let Some((lgr, setup)) = group else {
            return;
        };
        if let Some(x) = agreed {
            self.make_v2_group(lgr, x);
        }
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            return;
        };
        let mtu = QpMtu(g.mtu.0.min(a.qp_mtu.0));
        g.mtu = mtu;
        g.peer_rmbs.push(PeerRmb::on_link(1, clc_rmb_token(&a)));
        if !self.connect_link(lgr, 1, clc_qp(&a, mtu)) {
            return;
        }
        // The first-contact bit: set in a v2 Confirm (smc-rv2.md §4.1), never in v1.
        let Some(confirm) = self.local_accept_confirm(setup, 1, true) else {
            return;
        };
        //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.1
        //# sends an SMC Confirm CLC message to the server over the TCP connection with its
        //# SMC-R link information included.
        self.send_clc(tcp, &ClcMessage::Confirm(confirm));
        //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7
        //# the client sets a timer to wait for a RoCE verification message from the server
        //# that the QP is actually connected and usable.
        let deadline = now + self.config.llc_timeout_first_contact;
        if let Some(Entry::Setup(h)) = self.entries.get_mut(&tcp) {
            h.state = HsState::ExpectConfirmLink {
                setup,
                peer: a,
                link: 1,
            };
            h.llc_deadline = Some(deadline);
        }
    }

    /// Keep the server's Accept while the client's CONFIRM RKEY runs (it is needed to
    /// establish afterwards).
    pub(super) fn set_peer_accept(&mut self, tcp: TcpId, a: AcceptConfirm) {
        if let Some(Entry::Setup(h)) = self.entries.get_mut(&tcp) {
            h.peer_accept = Some(a);
        }
    }

    pub(super) fn client_send_confirm(
        &mut self,
        tcp: TcpId,
        setup: LocalSetup,
        link: u8,
        a: AcceptConfirm,
        now: Timestamp,
    ) {
        // The Accept's link may have failed meanwhile: any active link will do (§3.5.2.3).
        let hint = match self.entries.get(&tcp) {
            Some(Entry::Setup(h)) => h.peer_rmb,
            _ => None,
        };
        let link = match self.lgrs.get(&setup.lgr) {
            Some(g)
                if g.links
                    .get(&link)
                    .is_some_and(|l| l.state == LinkState::Active) =>
            {
                link
            }
            Some(g) => match g.active_links().next() {
                Some(l) => l.num,
                None => link,
            },
            None => link,
        };
        let Some(confirm) = self.local_accept_confirm(setup, link, false) else {
            self.setup_reset(tcp, ResetReason::LinkGroupLost, now);
            return;
        };
        self.send_clc(tcp, &ClcMessage::Confirm(confirm));
        //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.1
        //# once the client sends an SMC Confirm on a TCP connection that isn't a first
        //# contact, it is committed to SMC-R for this TCP connection
        self.establish(tcp, setup, hint, link, &a, Vec::new(), now);
    }

    /// A CONFIRM RKEY we started for a handshake finished (`ok`) or failed.
    pub(in crate::endpoint) fn handshake_rkey_done(
        &mut self,
        lgr: LgrId,
        rmb: crate::rmb_pool::RmbId,
        ok: bool,
        now: Timestamp,
    ) {
        // A setup holding an element of the group's RMB is one of the group's connections.
        let group: Vec<TcpId> = self
            .lgrs
            .get(&lgr)
            .map(|g| g.conns.iter().copied().collect())
            .unwrap_or_default();
        let waiting: Vec<TcpId> = group
            .into_iter()
            .filter(|t| match self.entries.get(t) {
                Some(Entry::Setup(h)) => matches!(
                    &h.state,
                    HsState::ClientAwaitRkey { setup, .. }
                    | HsState::ServerAwaitRkey { setup, .. }
                        if setup.lgr == lgr && setup.alloc.handle.rmb == rmb
                ),
                _ => false,
            })
            .collect();
        // A refused RMB (a negative CONFIRM RKEY, or none confirmed) declines as Linux does
        // when its RMB's CONFIRM RKEY exchange fails: "reg rdma bufs failed" (0x09990003).
        let refused = DeclineCode::ERR_REGBUF;
        for tcp in waiting {
            let Some(Entry::Setup(h)) = self.entries.get_mut(&tcp) else {
                continue;
            };
            let state = std::mem::replace(&mut h.state, HsState::ExpectProposal);
            let accept = h.peer_accept.take();
            match state {
                HsState::ClientAwaitRkey { setup, link } => match (ok, accept) {
                    (true, Some(a)) => self.client_send_confirm(tcp, setup, link, a, now),
                    _ => self.decline(tcp, refused, false, now),
                },
                HsState::ServerAwaitRkey { setup, link } => {
                    if ok {
                        self.send_accept(tcp, setup, link, false, now);
                    } else {
                        self.decline(tcp, refused, false, now);
                    }
                }
                other => {
                    if let Some(Entry::Setup(h)) = self.entries.get_mut(&tcp) {
                        h.state = other;
                    }
                }
            }
        }
    }

    // ----- First contact link verification (Fig. 8, Fig. 42) --------------------------------

    /// CONFIRM LINK message for our link `num` of `lgr`.
    pub(in crate::endpoint) fn confirm_link_msg(
        &self,
        lgr: LgrId,
        num: u8,
        reply: bool,
    ) -> Option<LlcMessage> {
        let g = self.lgrs.get(&lgr)?;
        let l = g.links.get(&num)?;
        let dev = self.device(l.device)?;
        //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.3
        //# CONFIRM LINK(MA,GA,QP8, link lim, server link user ID, linknum)
        Some(LlcMessage::ConfirmLink(ConfirmLink {
            reply,
            no_rmbe_eyecatcher: CONFIRM_LINK_NO_EYECATCHER,
            sender_mac: dev.mac,
            sender_gid: dev.gid,
            sender_qp: l.local_qp.qpn,
            link_num: num,
            link_user_id: l.local_user_id,
            // The server supplies its maximum; the client answers with the negotiated value,
            // which cannot exceed the server's (§2.2.2).
            // SMC-Rv2: the values agreed in CLC, as Linux writes them (our own v2 group may
            // keep fewer links than a Linux server agreed to, rejecting its ADD LINK).
            max_links: g.v2.map_or(g.max_links, |a| a.max_links),
            // smc-rv2.md §10.3: byte 35 carries the negotiated max conns in v2.1.
            max_conns: g.v2.map_or(0, |a| a.max_conns),
        }))
    }

    /// A client's first link of a new group takes in the server's RMB named in the Accept
    /// when the server's CONFIRM LINK arrives, before the link carries anything: on the shm
    /// fabric that maps the peer's memory, a descriptor each, and a process that ran out of
    /// them found out only at the connection's first WRITE, which then failed the link and,
    /// with it, the new group (a reset). Failing here, the connection is declined instead
    /// ("rtoken handling failed", as Linux says when it cannot take in the peer's rtoken)
    /// and falls back to TCP. `false`: declined.
    fn first_link_takes_peer_rmbs(
        &mut self,
        tcp: TcpId,
        lgr: LgrId,
        num: u8,
        res: &mut dyn Resources,
        now: Timestamp,
    ) -> bool {
        if self.take_peer_rmbs_on(lgr, num, res) {
            return true;
        }
        self.decline(tcp, DeclineCode::ERR_RTOK, false, now);
        false
    }

    /// A CONFIRM LINK arrived on the first link of a group whose first contact is `tcp`.
    /// Returns false when the message was not for the handshake.
    pub(in crate::endpoint) fn handshake_confirm_link(
        &mut self,
        tcp: TcpId,
        lgr: LgrId,
        via: u8,
        m: ConfirmLink,
        res: &mut dyn Resources,
        now: Timestamp,
    ) -> bool {
        let Some(Entry::Setup(h)) = self.entries.get_mut(&tcp) else {
            return false;
        };
        let state = std::mem::replace(&mut h.state, HsState::ExpectProposal);
        match state {
            HsState::ExpectConfirmLink { setup, peer, link } if !m.reply && via == link => {
                // The state stays while the message is checked: a Decline's cleanup needs the
                // setup to remove the group made for this first contact.
                if let Some(Entry::Setup(h)) = self.entries.get_mut(&tcp) {
                    h.state = HsState::ExpectConfirmLink {
                        setup,
                        peer: peer.clone(),
                        link,
                    };
                }
                //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
                //# What it indicates: Incorrect link information.
                if m.sender_qp != peer.qp_num || m.sender_gid != peer.gid || m.link_num == 0 {
                    self.decline(tcp, DeclineCode::CNFERR, false, now);
                    return true;
                }
                if !m.no_rmbe_eyecatcher {
                    self.decline(tcp, DeclineCode::RMBE_EC, false, now);
                    return true;
                }
                // The server assigns the link number: renumber our provisional link.
                let num = m.link_num;
                if let Some(g) = self.lgrs.get_mut(&lgr) {
                    if num != link {
                        if let Some(mut l) = g.links.remove(&link) {
                            l.num = num;
                            self.links.insert(l.id, (lgr, num));
                            g.links.insert(num, l);
                        }
                        for r in g.local_rmbs.values_mut() {
                            if let Some(t) = r.tokens.remove(&link) {
                                r.tokens.insert(num, t);
                            }
                        }
                        for r in g.peer_rmbs.iter_mut() {
                            if let Some(t) = r.tokens.remove(&link) {
                                r.tokens.insert(num, t);
                            }
                        }
                    }
                    g.last_link_num = num;
                    if g.v2.is_none() {
                        g.max_links = negotiated_max_links(self.config.max_links, m.max_links);
                    }
                }
                // The server's RMB named in its Accept, taken in before the link carries
                // anything (see `first_link_takes_peer_rmbs`).
                if !self.first_link_takes_peer_rmbs(tcp, lgr, num, res, now) {
                    return true;
                }
                self.activate_link(lgr, num, m.link_user_id, now);
                if let Some(reply) = self.confirm_link_msg(lgr, num, true) {
                    self.post_llc(lgr, num, reply, Some(tcp), now);
                }
                if let Some(Entry::Setup(h)) = self.entries.get_mut(&tcp) {
                    h.state = HsState::ConfirmLinkSending {
                        setup,
                        peer,
                        link: num,
                    };
                }
                true
            }
            HsState::ExpectConfirmLinkReply {
                setup,
                peer,
                link,
                posted: true,
                ..
            } if m.reply && via == link => {
                if m.sender_qp != peer.qp_num || m.sender_gid != peer.gid || m.link_num != link {
                    self.decline(tcp, DeclineCode::CNFERR, false, now);
                    return true;
                }
                if !m.no_rmbe_eyecatcher {
                    // The client wants RMBE eye catchers (RFC layout): we follow Linux and
                    // decline (wire-formats.md §1 item 1).
                    self.decline(tcp, DeclineCode::RMBE_EC, false, now);
                    return true;
                }
                if let Some(g) = self.lgrs.get_mut(&lgr) {
                    if g.v2.is_none() {
                        g.max_links = negotiated_max_links(self.config.max_links, m.max_links);
                    }
                }
                // (The server took in the client's RMB before its CONFIRM LINK went:
                // `link_connected`.)
                self.activate_link(lgr, link, m.link_user_id, now);
                if let Some(Entry::Setup(h)) = self.entries.get_mut(&tcp) {
                    h.state = HsState::ExpectSecondLink { setup, peer, link };
                    h.llc_deadline = None;
                }
                // Fig. 9: the second link is set up right away, before data flows.
                if let Some(g) = self.lgrs.get_mut(&lgr) {
                    g.pending.push_front(LocalRequest::AddLink);
                }
                true
            }
            other => {
                if let Some(Entry::Setup(h)) = self.entries.get_mut(&tcp) {
                    h.state = other;
                }
                false
            }
        }
    }

    /// Completion of the first contact's CONFIRM LINK (request or reply).
    pub(in crate::endpoint) fn handshake_confirm_completion(
        &mut self,
        tcp: TcpId,
        ok: bool,
        now: Timestamp,
    ) {
        let Some(Entry::Setup(h)) = self.entries.get_mut(&tcp) else {
            return;
        };
        if !ok {
            //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.2
            //# a first contact peer can send an SMC Decline at any time during LLC
            //# negotiation until it has successfully sent its CONFIRM LINK (request or
            //# response) flow.
            if self.may_decline(tcp) {
                self.decline(tcp, DeclineCode::TIMEOUT_CL, false, now);
            }
            return;
        }
        let state = std::mem::replace(&mut h.state, HsState::ExpectProposal);
        h.state = match state {
            // A late completion after the second-link exchange started: nothing to do.
            HsState::ExpectSecondLink { .. } => state,
            HsState::ConfirmLinkSending { setup, peer, link } => {
                //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
                //# LLC message: CONFIRM LINK reply from client (first contact) Timer waits
                //# for: ADD LINK from server.
                let v2 = self.lgrs.get(&setup.lgr).and_then(|g| g.v2);
                // SMC-Rv2: as a Linux client, wait 2 s for the ADD LINK, then go on with one
                // link (smc-rv2.md §14); with max links 1 agreed none comes (a Linux client
                // waits for one only when the negotiated max links is above 1, §9.2).
                let wait = match v2 {
                    Some(_) => crate::endpoint::v2::V2_ADD_LINK_WAIT,
                    None => self.config.llc_timeout_first_contact,
                };
                h.llc_deadline = Some(now + wait);
                if v2.is_some_and(|a| a.max_links <= 1) {
                    let lgr = setup.lgr;
                    h.state = HsState::ExpectSecondLink { setup, peer, link };
                    self.first_contact_done(lgr, now);
                    return;
                }
                HsState::ExpectSecondLink { setup, peer, link }
            }
            HsState::ExpectConfirmLinkReply {
                setup,
                peer,
                link,
                posted,
                ..
            } => HsState::ExpectConfirmLinkReply {
                setup,
                peer,
                link,
                posted,
                sent: true,
            },
            other => other,
        };
    }

    /// The client's ADD LINK of the first contact arrived: the handshake's own timer stops
    /// (the exchange's timers take over).
    pub(in crate::endpoint) fn handshake_second_link_started(&mut self, tcp: TcpId) {
        if let Some(Entry::Setup(h)) = self.entries.get_mut(&tcp) {
            let state = std::mem::replace(&mut h.state, HsState::ExpectProposal);
            h.state = match state {
                // The server sends ADD LINK only after it got our CONFIRM LINK reply: the
                // reply arrived even if its completion has not (yet) come back.
                HsState::ConfirmLinkSending { setup, peer, link } => {
                    HsState::ExpectSecondLink { setup, peer, link }
                }
                other => other,
            };
            if matches!(h.state, HsState::ExpectSecondLink { .. }) {
                h.llc_deadline = None;
            }
        }
    }

    /// The second-link exchange of a first contact ended (link added, rejected or failed):
    /// the connection is established.
    pub(in crate::endpoint) fn first_contact_done(&mut self, lgr: LgrId, now: Timestamp) {
        if let Some(spare) = self.lgrs.get_mut(&lgr).and_then(|g| g.spare.take()) {
            self.fabric_out
                .push_back(crate::fabric::FabricOp::DestroyQp { link: spare.id });
        }
        let Some(tcp) = self.lgrs.get_mut(&lgr).and_then(|g| g.first_contact.take()) else {
            return;
        };
        let Some(Entry::Setup(h)) = self.entries.get_mut(&tcp) else {
            return;
        };
        let state = std::mem::replace(&mut h.state, HsState::ExpectProposal);
        match state {
            HsState::ExpectSecondLink { setup, peer, link } => {
                self.establish(tcp, setup, None, link, &peer, Vec::new(), now);
            }
            other => {
                h.state = other;
            }
        }
    }

    /// Whether the first contact of `lgr` is still before its point of no return.
    pub(in crate::endpoint) fn first_contact_may_decline(&self, lgr: LgrId) -> Option<TcpId> {
        let tcp = self.lgrs.get(&lgr)?.first_contact?;
        self.may_decline(tcp).then_some(tcp)
    }
}
