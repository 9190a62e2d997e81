//! The server side of the CLC rendezvous: a Proposal answered with an Accept or a Decline,
//! first or subsequent contact, then the client's Confirm (RFC 7609 §3.5.1, App. C.1–C.6).

use super::*;

impl Endpoint {
    pub(super) fn on_proposal(
        &mut self,
        tcp: TcpId,
        p: Proposal,
        res: &mut dyn Resources,
        now: Timestamp,
    ) {
        // smc-rv2.md §4.3: a server Decline to a v2 Proposal is a version-2 Decline.
        if let Some(Entry::Setup(h)) = self.entries.get_mut(&tcp) {
            h.clc_v2 = p.version >= 2;
        }
        let opts = self.setup_options(tcp);
        let ndev = self.config.devices.len();
        // §9.1 steps 4–6: SMC-Rv2 first, when both sides offer it; the first failure is the
        // Decline code if v1 does not work out either.
        let mut first_failure = None;
        let mut agreed = None;
        if p.version >= 2 && smc_type::includes_r(p.smc_type_v2) {
            if self.config.versions.v2 {
                let have_device = (0..ndev.min(256)).any(|d| {
                    opts.pnet.contains(DeviceId(d as u8))
                        && self.config.devices.get(d).is_some_and(|x| x.roce_v2)
                });
                let max_conns = self.config.max_conns_per_lgr.min(255) as u8;
                match crate::endpoint::v2::negotiate_server(
                    &p,
                    &self.config.ueids,
                    max_conns,
                    have_device,
                ) {
                    Ok(a) => agreed = Some(a),
                    Err(code) => first_failure = Some(code),
                }
            } else {
                first_failure = Some(DeclineCode::NOSMCDEV);
            }
        }
        if agreed.is_none() {
            // Linux (since 5.10) proposes in version 2 with SMC-R v1 offered: parsed, answered
            // with version 1 (wire-formats.md §1 item 4).
            if !self.config.versions.v1 || !p.offers_smcr_v1() {
                let code = first_failure.unwrap_or(if self.config.versions.v1 {
                    DeclineCode::MODEUNSUPP
                } else {
                    DeclineCode::NOSMCDEV
                });
                self.decline(tcp, code, false, now);
                return;
            }
            if !subnet_matches(&p, &self.config.ipv4_subnets, &self.config.ipv6_prefixes) {
                self.decline(
                    tcp,
                    first_failure.unwrap_or(DeclineCode::DIFFPREFIX),
                    false,
                    now,
                );
                return;
            }
        }
        // The client's GID for this connection: its RoCEv2 GID in v2 (§7.5).
        let client_gid = agreed.map_or(p.preferred_gid, |a| a.client_gid);
        // The connection's RNICs as ports of the client GID's kind: an RNIC with an IPv4-mapped
        // and an IPv6 GID is two devices here, and the client's GID says which one speaks to
        // it (a RoCEv2 packet's addresses are of one IP version). An RNIC without a GID of
        // that kind drops out; with none left, no RoCE path matches the client's GID.
        // (A set whose every device suits stays as it is: `DeviceSet::ALL` also admits RNICs
        // added later.)
        let mut opts = opts;
        let members = (0..ndev.min(256))
            .map(|d| DeviceId(d as u8))
            .filter(|d| opts.pnet.contains(*d));
        if members
            .clone()
            .any(|d| res.port_for(d, client_gid) != Some(d))
        {
            opts.pnet = DeviceSet::from_ids(members.filter_map(|d| res.port_for(d, client_gid)));
        }
        if let Some(Entry::Setup(h)) = self.entries.get_mut(&tcp) {
            h.agreed_v2 = agreed;
            h.opts.pnet = opts.pnet;
        }
        let Some(first_device) = opts.pnet.first(ndev) else {
            //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.1.2
            //# If the server cannot or does not want to do SMC-R with the client, it sends
            //# an SMC Decline CLC message to the client
            self.decline(tcp, DeclineCode::NOSMCRDEV, false, now);
            return;
        };
        // A v2 connection goes into a v2 group with the same client GID (Linux's reuse key,
        // §9.1 step 7), a v1 connection into a v1 group.
        let same_version = |g: &LinkGroup| match (&g.v2, &agreed) {
            (None, None) => true,
            (Some(x), Some(a)) => x.client_gid == a.client_gid,
            _ => false,
        };
        // Subsequent contact: an existing group with this peer, usable and not full.
        let existing = self
            .lgrs
            .values()
            .filter(|g| {
                g.role == Role::Server
                    && g.peer_id == p.peer_id
                    && g.pnet == opts.pnet
                    && same_version(g)
                    && g.first_contact.is_none()
                    && g.conns.len() < self.config.max_conns_per_lgr
                    && g.active_count() > 0
            })
            .map(|g| {
                let link = g
                    .active_links()
                    .find(|l| l.remote.is_some_and(|r| r.gid == client_gid))
                    .or_else(|| g.active_links().next())
                    .map(|l| l.num);
                (g.id, link)
            })
            .next();
        if let Some((lgr, Some(link))) = existing {
            //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.2.1
            //# Upon receiving the client's proposal, the server looks up the provided peer
            //# ID to determine if it already has a usable SMC-R link group with this peer.
            let setup = match self.alloc_rmbe(lgr, opts.rmbe_size, res) {
                Ok(s) => s,
                Err(()) => {
                    self.decline(tcp, DeclineCode::MEM, false, now);
                    return;
                }
            };
            self.alerts.insert(setup.alert, tcp);
            if let Some(g) = self.lgrs.get_mut(&lgr) {
                g.conns.insert(tcp);
                g.timers.stop(crate::link_group::LgrTimer::Idle);
            }
            // Fig. 12: a new RMB is confirmed on every link before it is used, by the
            // connection that created it and by any other that takes one of its elements
            // meanwhile (the client would otherwise learn it from our Accept, on one link).
            let rmb = setup.alloc.handle.rmb;
            let awaits = self
                .lgrs
                .get_mut(&lgr)
                .is_some_and(|g| g.rmb_awaits_confirm(rmb));
            if awaits {
                self.set_state(tcp, HsState::ServerAwaitRkey { setup, link });
                self.llc_kick(lgr, res, now);
            } else {
                self.send_accept(tcp, setup, link, false, now);
            }
            return;
        }
        // The group with this peer is still in its first contact (until its second link is
        // up): the connection waits for it to become usable rather than opening a parallel
        // group (a client that reuses its group at once meets this), as a server that makes
        // one link group decision at a time does. Answered when that first contact ends,
        // either way (`run_parked`); the CLC timer keeps running meanwhile.
        let forming = self
            .lgrs
            .values()
            .find(|g| {
                g.role == Role::Server
                    && g.peer_id == p.peer_id
                    && g.pnet == opts.pnet
                    && same_version(g)
                    && g.first_contact.is_some()
                    && g.conns.len() < self.config.max_conns_per_lgr
            })
            .map(|g| g.id);
        if let Some(lgr) = forming {
            self.parked.push((tcp, p, lgr));
            return;
        }
        // First contact (or a parallel link group). Of the RNICs on the connection's network,
        // one on the LAN of the client's preferred RoCE port if there is one (looked up only
        // here: a subsequent contact uses the group's links).
        let v2_capable = |d: DeviceId| {
            agreed.is_none()
                || self
                    .config
                    .devices
                    .get(usize::from(d.0))
                    .is_some_and(|x| x.roce_v2)
        };
        let candidates: Vec<DeviceId> = (0..ndev.min(256))
            .map(|d| DeviceId(d as u8))
            .filter(|d| opts.pnet.contains(*d) && v2_capable(*d))
            .collect();
        let first_device = candidates
            .iter()
            .copied()
            .find(|d| res.reaches(*d, client_gid))
            .or(candidates.first().copied())
            .unwrap_or(first_device);
        let llc = if agreed.is_some() {
            LlcVersion::V2
        } else {
            LlcVersion::V1
        };
        let group =
            self.first_contact_group(tcp, Role::Server, p.peer_id, (first_device, llc), res, now);
        if let Some((lgr, setup)) = group {
            if let Some(a) = agreed {
                self.make_v2_group(lgr, a);
            }
            self.send_accept(tcp, setup, 1, true, now);
        }
    }

    /// Whether the parked Proposal `p` may be answered now: the first contact it waits for
    /// ended (its group is gone or no longer in first contact).
    pub(in crate::endpoint) fn parked_runnable(&self, p: &(TcpId, Proposal, LgrId)) -> bool {
        self.lgrs
            .get(&p.2)
            .is_none_or(|g| g.first_contact.is_none())
    }

    /// Answer the parked Proposals whose first contact ended (those whose connection is
    /// still waiting for an answer: not reset or timed out meanwhile).
    pub(in crate::endpoint) fn run_parked(&mut self, res: &mut dyn Resources, now: Timestamp) {
        if !self.parked.iter().any(|p| self.parked_runnable(p)) {
            return;
        }
        let (run, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.parked)
            .into_iter()
            .partition(|p| self.parked_runnable(p));
        self.parked = keep;
        for (tcp, p, _) in run {
            let waiting = matches!(
                self.entries.get(&tcp),
                Some(Entry::Setup(h)) if matches!(h.state, HsState::ExpectProposal)
            );
            if waiting {
                self.on_proposal(tcp, p, res, now);
            }
        }
    }

    /// First contact: a new link group for `tcp` (one link, number 1, on our `device`) with
    /// the connection's RMBE, whose RMB the peer learns from the CLC exchange. Declines `tcp`
    /// when resources are short.
    pub(super) fn first_contact_group(
        &mut self,
        tcp: TcpId,
        role: Role,
        peer_id: smc_wire::PeerId,
        (device, llc): (DeviceId, LlcVersion),
        res: &mut dyn Resources,
        now: Timestamp,
    ) -> Option<(LgrId, LocalSetup)> {
        let opts = self.setup_options(tcp);
        let Ok(lgr) = self.new_link_group(role, peer_id, (device, llc), 1, res, now) else {
            self.decline(tcp, DeclineCode::MEM, false, now);
            return None;
        };
        if let Some(g) = self.lgrs.get_mut(&lgr) {
            g.pnet = opts.pnet;
        }
        //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.2
        //# a first contact peer can send an SMC Decline at any time during LLC
        //# negotiation until it has successfully sent its CONFIRM LINK (request or
        //# response) flow.
        // The server's ADD LINK comes after that point, and the client then waits for it
        // (C.7.1: "CONFIRM LINK reply from client (first contact) Timer waits for: ADD LINK
        // from server"): the QP of the second link is made now, while a shortage can still
        // be a Decline.
        if role == Role::Server && self.reserve_second_qp(lgr, llc, res).is_err() {
            self.destroy_link_group(lgr, now);
            self.decline(tcp, DeclineCode::MEM, false, now);
            return None;
        }
        let Ok(setup) = self.alloc_rmbe(lgr, opts.rmbe_size, res) else {
            self.destroy_link_group(lgr, now);
            self.decline(tcp, DeclineCode::MEM, false, now);
            return None;
        };
        self.alerts.insert(setup.alert, tcp);
        if let Some(g) = self.lgrs.get_mut(&lgr) {
            g.conns.insert(tcp);
            g.first_contact = Some(tcp);
            for r in g.local_rmbs.values_mut() {
                r.confirmed = true;
            }
        }
        Some((lgr, setup))
    }

    /// Server, first contact: create the QP the second link will use (on the RNIC
    /// `start_add_link` will choose: one no link uses, else the first link's for an
    /// asymmetric offer) and keep it in the group ([`LinkGroup::spare`]).
    pub(super) fn reserve_second_qp(
        &mut self,
        lgr: LgrId,
        llc: LlcVersion,
        res: &mut dyn Resources,
    ) -> Result<(), ()> {
        let n = self.config.devices.len();
        let Some(g) = self.lgrs.get(&lgr) else {
            return Err(());
        };
        // (A v2 group's limit is set after this, by `make_v2_group`.)
        let max_links = match llc {
            LlcVersion::V1 => g.max_links,
            LlcVersion::V2 => g.max_links.min(crate::endpoint::V2_MAX_LINKS),
        };
        if max_links < 2 {
            return Ok(());
        }
        let Some(device) = g.unused_device(n).or_else(|| g.first_device()) else {
            return Ok(());
        };
        let id = self.new_link_id();
        let qp = res.create_qp(id, device, llc).map_err(|_| ())?;
        if let Some(g) = self.lgrs.get_mut(&lgr) {
            g.spare = Some(crate::link_group::SpareQp { id, device, qp });
        }
        Ok(())
    }

    pub(super) fn send_accept(
        &mut self,
        tcp: TcpId,
        setup: LocalSetup,
        link: u8,
        first_contact: bool,
        now: Timestamp,
    ) {
        // The link may have failed while our CONFIRM RKEY ran: any active link will do.
        let link = match self.lgrs.get(&setup.lgr) {
            Some(g)
                if !g
                    .links
                    .get(&link)
                    .is_some_and(|l| l.state == LinkState::Active) =>
            {
                g.active_links().next().map(|l| l.num).unwrap_or(link)
            }
            _ => link,
        };
        let Some(msg) = self.local_accept_confirm(setup, link, first_contact) else {
            self.setup_reset(tcp, ResetReason::ClcProtocolError("no link"), now);
            return;
        };
        self.send_clc(tcp, &ClcMessage::Accept(msg));
        //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.3
        //# the server cannot send an SMC Decline after sending an SMC Accept
        self.set_state(
            tcp,
            HsState::ExpectConfirm {
                setup,
                link,
                first_contact,
                held: Vec::new(),
            },
        );
    }

    /// Our half of Accept / Confirm for a connection set up on `link`.
    pub(super) fn local_accept_confirm(
        &self,
        setup: LocalSetup,
        link: u8,
        first_contact: bool,
    ) -> Option<AcceptConfirm> {
        let g = self.lgrs.get(&setup.lgr)?;
        let l = g.links.get(&link)?;
        let dev = self.device(l.device)?;
        let token = g
            .local_rmbs
            .get(&setup.alloc.handle.rmb)?
            .tokens
            .get(&link)?;
        // SMC-Rv2 (smc-rv2.md §7): the EID; on first contact the extension with the agreed
        // release and limits (also in the Confirm, which then has the first-contact bit too
        // and a GID list with our link GID).
        let v2 = g.v2.map(|a| AcceptConfirmV2 {
            eid: a.eid,
            first_contact_ext: first_contact.then(|| a.first_contact_ext(&self.config.hostname)),
            gid_list: (first_contact && g.role == Role::Client).then(|| vec![dev.gid]),
        });
        Some(AcceptConfirm {
            version: if v2.is_some() { 2 } else { 1 },
            first_contact: first_contact && (v2.is_some() || g.role == Role::Server),
            peer_id: self.config.peer_id,
            gid: dev.gid,
            mac: dev.mac,
            qp_num: l.local_qp.qpn,
            rmb_rkey: token.rkey,
            rmbe_idx: setup.alloc.handle.index,
            rmbe_alert_token: setup.alert,
            rmbe_size: setup.alloc.size,
            qp_mtu: g.mtu,
            rmb_vaddr: token.vaddr,
            initial_psn: l.local_qp.psn,
            v2,
        })
    }

    /// Make the new group `lgr` an SMC-Rv2 group: its agreement, its link limit (the agreed
    /// max links, 1..=2; one link with release 0, which negotiates no limits).
    pub(super) fn make_v2_group(&mut self, lgr: LgrId, a: crate::endpoint::LgrV2) {
        if let Some(g) = self.lgrs.get_mut(&lgr) {
            g.v2 = Some(a);
            g.max_links = if a.release >= 1 {
                a.max_links.clamp(1, crate::endpoint::V2_MAX_LINKS)
            } else {
                1
            };
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn on_confirm(
        &mut self,
        tcp: TcpId,
        setup: LocalSetup,
        link: u8,
        first_contact: bool,
        held: Vec<CdcMessage>,
        c: AcceptConfirm,
        now: Timestamp,
    ) {
        let lgr = setup.lgr;
        // SMC-Rv2 first contact (smc-rv2.md §9.1 step 8): the Confirm repeats the Accept's
        // release and limits.
        let agreed = match self.entries.get(&tcp) {
            Some(Entry::Setup(h)) => h.agreed_v2,
            _ => None,
        };
        if let (true, Some(a)) = (first_contact, agreed) {
            let fce = c.v2.as_ref().and_then(|v| v.first_contact_ext.as_ref());
            if let Err(code) = crate::endpoint::v2::check_confirm_ext(fce, &a) {
                self.decline(tcp, code, false, now);
                return;
            }
        }
        if agreed.is_some() != (c.version >= 2) {
            self.decline(tcp, DeclineCode::VERSMISMAT, false, now);
            return;
        }
        if first_contact {
            // The client's QP: connect ours to it and verify it with CONFIRM LINK (Fig. 8).
            let Some(g) = self.lgrs.get_mut(&lgr) else {
                return;
            };
            let mtu = QpMtu(g.mtu.0.min(c.qp_mtu.0));
            g.mtu = mtu;
            if !self.connect_link(lgr, link, clc_qp(&c, mtu)) {
                return;
            }
            if let Some(g) = self.lgrs.get_mut(&lgr) {
                g.peer_rmbs.push(PeerRmb::on_link(link, clc_rmb_token(&c)));
            }
            // The CONFIRM LINK goes once the stack has connected our QP (`link_connected`).
            //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.7.1
            //# Timer waits for: CONFIRM LINK reply from client.
            let deadline = now + self.config.llc_timeout_first_contact;
            if let Some(Entry::Setup(h)) = self.entries.get_mut(&tcp) {
                h.state = HsState::ExpectConfirmLinkReply {
                    setup,
                    peer: c,
                    link,
                    posted: false,
                    sent: false,
                };
                h.llc_deadline = Some(deadline);
            }
            return;
        }
        //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.2.3
        //# The MAC/GID/QP information provided by the client matches an active link within
        //# the link group.
        let Some(g) = self.lgrs.get(&lgr) else {
            self.setup_reset(tcp, ResetReason::LinkGroupLost, now);
            return;
        };
        let client_link = g
            .active_links()
            .find(|l| {
                l.remote
                    .is_some_and(|r| r.qpn == c.qp_num && r.gid == c.gid)
            })
            .map(|l| l.num);
        let Some(client_link) = client_link else {
            // The client named a link that failed here after it sent the Confirm (it had not
            // seen the failure yet): if the RMB it names is one we know on a surviving link,
            // the connection runs there; the group is fine.
            if let Some((rmb, link)) = raced_confirm(g, &c) {
                self.establish(tcp, setup, Some(rmb), link, &c, held, now);
                return;
            }
            // No Decline after Accept (C.1): break the TCP connection.
            self.setup_reset(
                tcp,
                ResetReason::ClcProtocolError("Confirm names no active link"),
                now,
            );
            return;
        };
        self.establish(tcp, setup, None, client_link, &c, held, now);
    }

    /// The stack connected the QP of `link` ([`FabricOp::ConnectQp`](crate::fabric::FabricOp)
    /// done). A server's first link of a new group takes in the client's RMB named in the
    /// Confirm now, before its CONFIRM LINK goes: on the shm fabric that maps the client's
    /// memory, a descriptor, and a process out of descriptors found out only at the
    /// connection's first WRITE, which failed the link and the new group with it (a reset),
    /// too late for a Decline. Now the connection is declined ("rtoken handling failed") and
    /// both sides use TCP; the client still waits for the CONFIRM LINK, in lieu of which a
    /// Decline may come.
    //= https://www.rfc-editor.org/rfc/rfc7609#appendix-C.2
    //# a first contact peer can send an SMC Decline at any time during LLC negotiation until
    //# it has successfully sent its CONFIRM LINK (request or response) flow.
    pub fn link_connected(
        &mut self,
        link: crate::fabric::LinkId,
        res: &mut dyn Resources,
        now: Timestamp,
    ) {
        let Some(&(lgr, num)) = self.links.get(&link) else {
            return;
        };
        let Some(tcp) = self.lgrs.get(&lgr).and_then(|g| g.first_contact) else {
            return;
        };
        let waiting = matches!(
            self.entries.get(&tcp),
            Some(Entry::Setup(h)) if matches!(
                h.state,
                HsState::ExpectConfirmLinkReply { link, posted: false, .. } if link == num
            )
        );
        if !waiting {
            return;
        }
        if !self.take_peer_rmbs_on(lgr, num, res) {
            self.decline(tcp, DeclineCode::ERR_RTOK, false, now);
            return;
        }
        if let Some(Entry::Setup(h)) = self.entries.get_mut(&tcp) {
            if let HsState::ExpectConfirmLinkReply { posted, .. } = &mut h.state {
                *posted = true;
            }
        }
        if let Some(msg) = self.confirm_link_msg(lgr, num, false) {
            self.post_llc(lgr, num, msg, Some(tcp), now);
        }
    }
}
