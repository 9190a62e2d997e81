//! CONFIRM RKEY and DELETE RKEY: a new or removed RMB's rkeys on every link of the group
//! (RFC 7609 §3.5.5, Fig. 12–14).

use super::*;

impl Endpoint {
    pub(super) fn start_confirm_rkey(&mut self, lgr: LgrId, rmb: RmbId, now: Timestamp) -> bool {
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

    pub(super) fn on_confirm_rkey(
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

    pub(super) fn on_confirm_rkey_cont(
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
    pub(super) fn finish_peer_rkey(
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
        // Take the RMB in on every link it was named for now: what that needs locally (the
        // shm fabric maps the peer's memory, a descriptor for a moment) can run out, and a
        // WRITE that found it missing later would fail the link, and with every link the
        // whole group. Refused here, only the connection that wanted the RMB ends: the peer
        // declines it.
        let taken = g
            .active_links()
            .filter_map(|l| last.tokens.get(&l.num).map(|t| (l.id, t.rkey)))
            .try_for_each(|(link, rkey)| res.take_peer_rtoken(link, rkey));
        if let Err(e) = taken {
            tracing::warn!(?lgr, rkey = c.rkey, "peer's new RMB refused: {}", e.0);
            self.stats.rkeys_refused += 1;
            //= https://www.rfc-editor.org/rfc/rfc7609#appendix-A.3.5
            //# The peer responds by simply echoing the message with the response flag set.
            //# If the response is a negative response, the sender must recalculate the
            //# RToken set and start a new CONFIRM RKEY exchange from the beginning.
            //= https://www.rfc-editor.org/rfc/rfc7609#appendix-A.3.5
            //# If this flag is not set on a negative response, the originator must wait for
            //# the next natural stimulus (for example, a new TCP connection started that
            //# requires a new RMB) before retrying.
            let reply = LlcMessage::ConfirmRkey(ConfirmRkey {
                reply: true,
                negative: true,
                retry: false,
                ..c
            });
            self.post_llc(lgr, via, reply, None, now);
            return;
        }
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

    /// Remove RMBs we no longer need (Fig. 14). Only RMBs with no element in use; at most
    /// one DELETE RKEY's worth (8).
    pub fn delete_unused_rmbs(
        &mut self,
        lgr: LgrId,
        res: &mut dyn Resources,
        now: Timestamp,
    ) -> usize {
        self.delete_rmbs_where(lgr, 8, |_| true, res, now)
    }

    /// Withdraw from group `lgr` every RMB of ours that the peer knows and no element of
    /// which is in use — at the end of the process, before the group is deleted, so that a
    /// peer that ends too sees that we will send nothing more (the Linux kernel withdraws its
    /// RMB in the same way when a connection is freed, shared/spec/smc-rv2.md §12). One
    /// DELETE RKEY per 8 RMBs, queued behind any exchange in progress. Returns how many RMBs
    /// were put up for deletion (0 when called again).
    pub fn withdraw_rmbs(&mut self, lgr: LgrId, res: &mut dyn Resources, now: Timestamp) -> usize {
        //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.5.2.2
        //# Either peer can delete one or more of its RMBs as long as it is not
        //# being used for any TCP connections.
        // An RMB the peer was never told of (its CONFIRM RKEY not done) has nothing to
        // withdraw: it is freed with the group.
        self.delete_rmbs_where(lgr, usize::MAX, |r| r.confirmed, res, now)
    }

    /// Queue DELETE RKEY for up to `max` unused RMBs of `lgr` that pass `which`, 8 per
    /// request, retiring them from the pool (no element of them is handed out again).
    fn delete_rmbs_where(
        &mut self,
        lgr: LgrId,
        max: usize,
        which: impl Fn(&crate::link_group::LocalRmb) -> bool,
        res: &mut dyn Resources,
        now: Timestamp,
    ) -> usize {
        let Some(g) = self.lgrs.get_mut(&lgr) else {
            return 0;
        };
        let unused: Vec<RmbId> = g
            .local_rmbs
            .iter()
            .filter(|(id, r)| g.pool.rmb_unused(**id) && which(r))
            .map(|(id, _)| *id)
            .take(max)
            .collect();
        if unused.is_empty() {
            return 0;
        }
        for id in &unused {
            g.pool.retire(*id);
        }
        let n = unused.len();
        //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.5.2.2
        //# Multiple RMBs can be deleted in a
        //# DELETE RKEY exchange.
        // Up to 8 rkeys fit the 44-byte message (RFC 7609 Fig. 39); a v2 group sends the same
        // count in its v2 form (shared/spec/smc-rv2.md §10.7).
        for chunk in unused.chunks(8) {
            g.pending
                .push_back(LocalRequest::DeleteRkey(chunk.to_vec()));
        }
        self.llc_kick(lgr, res, now);
        n
    }

    pub(super) fn start_delete_rkey(
        &mut self,
        lgr: LgrId,
        rmbs: Vec<RmbId>,
        now: Timestamp,
    ) -> bool {
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

    pub(super) fn on_delete_rkey(
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
}
