//! DELETE LINK: one link or the whole link group, orderly or not (RFC 7609 §3.5.4, App. C.7).

use super::*;

impl Endpoint {
    pub(super) fn start_delete_link(
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

    pub(super) fn on_delete_link(
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
    pub(super) fn remove_link(
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
    pub(super) fn abort_exchanges_on(
        &mut self,
        lgr: LgrId,
        num: u8,
        res: &mut dyn Resources,
        now: Timestamp,
    ) {
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
    pub(in crate::endpoint) fn fail_link(
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
}
