//! The responder side of a roce RC queue pair (rocev2.md 9): the checks of a request in
//! rxe's order (PSN, duplicates, one sequence NAK, opcode sequence and lengths, RNR NAK without
//! a posted receive, R_Key and bounds of every WRITE), placement straight into the registered
//! region, and the ACKs it owes — coalesced per receive batch, held back to leave with a reply
//! (`ACK_DELAY`), and sent alone when [`ACK_SPAN`] PSNs wait or the progress thread finds one
//! old enough. The requester side (posts, `pump`, ACK handling, timers) is in qp.rs.

use super::*;

impl RoceQp {
    pub(super) fn send_ack(&self, conn: &Conn, kind: AethKind, psn: u32, msn: u32) {
        let mut b = [0u8; ACK_LEN];
        self.ack_packet(conn, kind, psn, msn, &mut b);
        self.core.transmit(conn.ip, &b);
    }

    /// An Acknowledge packet (ACK, NAK or RNR NAK) for the peer, sealed for identification 0,
    /// counted as sent.
    pub(super) fn ack_packet(
        &self,
        conn: &Conn,
        kind: AethKind,
        psn: u32,
        msn: u32,
        b: &mut [u8; ACK_LEN],
    ) {
        if matches!(kind, AethKind::Ack { .. }) {
            let mut a = lock(&self.ack);
            if psn_diff(psn, a.sent_psn) > 0 {
                a.sent_psn = psn;
            }
        }
        let repr = PacketRepr {
            bth: Bth {
                opcode: Opcode::ACKNOWLEDGE,
                pkey: roce::DEFAULT_PKEY,
                dest_qp: conn.dest_qp,
                psn,
                ..Bth::default()
            },
            reth: None,
            aeth: Some(Aeth::new(kind, msn)),
            immdt: None,
            payload: &[],
        };
        let _ = repr.emit(b);
        conn.icrc.seal(b);
        match kind {
            AethKind::Ack { .. } => bump(&self.core.counters.acks_sent),
            AethKind::RnrNak { .. } => bump(&self.core.counters.rnr_naks_sent),
            _ => bump(&self.core.counters.naks_sent),
        }
    }

    /// A request packet for this QP (responder side), in the order of rocev2.md 9.1 steps 2–8.
    pub(in crate::roce) fn on_request(
        &self,
        tables: &Tables,
        batch: &mut RxBatch,
        self_arc: &Arc<RoceQp>,
        p: &Packet<'_>,
    ) {
        let Some(conn) = self.conn.get().copied() else {
            return;
        };
        let op = p.bth.opcode;
        let psn = p.bth.psn;
        let mut r = lock(&self.resp);
        let d = psn_diff(psn, r.epsn);
        if d > 0 {
            // Ahead: one NAK carrying the expected PSN; later ones are dropped silently until
            // the expected PSN arrives.
            bump(&self.core.counters.drop_out_of_sequence);
            if !r.nak_sent {
                r.nak_sent = true;
                self.send_ack(
                    &conn,
                    AethKind::Nak {
                        code: nak::PSN_SEQUENCE,
                    },
                    r.epsn,
                    r.msn,
                );
            }
            return;
        }
        if d < 0 {
            // Duplicate: not executed again; ACK the last executed PSN at once (9.2).
            bump(&self.core.counters.duplicates);
            self.send_ack(
                &conn,
                AethKind::Ack { credit: 31 },
                psn_add(r.epsn, roce::U24_MASK),
                r.msn,
            );
            return;
        }
        let mtu = conn.mtu;
        let len = p.payload.len();
        // Opcode sequence (step 3) and unsupported operations.
        let mut error: Option<(u8, &'static str)> = None;
        if op.has_immdt() {
            error = Some((nak::INVALID_REQUEST, "immediate data not supported"));
        } else {
            let in_send = matches!(r.cursor, Some(Cursor::Send { .. }));
            let in_write = matches!(r.cursor, Some(Cursor::Write { .. }));
            let ok = match op {
                Opcode::SEND_MIDDLE | Opcode::SEND_LAST => in_send,
                Opcode::WRITE_MIDDLE | Opcode::WRITE_LAST => in_write,
                _ => !in_send && !in_write,
            };
            if !ok {
                error = Some((nak::INVALID_REQUEST, "opcode out of sequence"));
            } else if match op {
                Opcode::SEND_FIRST
                | Opcode::SEND_MIDDLE
                | Opcode::WRITE_FIRST
                | Opcode::WRITE_MIDDLE => len != mtu,
                _ => len > mtu,
            } {
                error = Some((nak::INVALID_REQUEST, "payload length"));
            }
        }
        if error.is_none() && op.is_send() {
            if op.starts_message() {
                // Step 5: a SEND FIRST/ONLY needs a posted receive, else RNR NAK.
                let Some(entry) = lock(&self.rq).pop_front() else {
                    self.send_ack(
                        &conn,
                        AethKind::RnrNak {
                            timer: MIN_RNR_TIMER,
                        },
                        psn,
                        r.msn,
                    );
                    return;
                };
                r.cursor = Some(Cursor::Send { entry, done: 0 });
            }
            if let Some(Cursor::Send { entry, done }) = &mut r.cursor {
                if *done + len > entry.len || !entry.mr.place(entry.offset + *done, p.payload) {
                    error = Some((nak::INVALID_REQUEST, "SEND longer than the receive buffer"));
                } else {
                    *done += len;
                }
            }
        } else if error.is_none() {
            if let Some(reth) = p.reth {
                // Step 7: R_Key, protection domain, access and bounds of the whole message.
                let dma = u64::from(reth.dma_len);
                let length_ok = if op == Opcode::WRITE_ONLY {
                    dma == len as u64
                } else {
                    dma > mtu as u64
                };
                if !length_ok || dma > 1 << 31 {
                    error = Some((nak::INVALID_REQUEST, "RETH length"));
                } else if dma == 0 {
                    r.cursor = None;
                } else {
                    let target = tables
                        .mrs
                        .get(&reth.rkey)
                        .filter(|m| m.pd == self.pd && m.access.contains(AccessFlags::REMOTE_WRITE))
                        .and_then(|m| m.offset_of(reth.va, dma).map(|o| (m, o)));
                    match target {
                        // A WRITE ONLY (every packet of this engine's WRITEs, `post`) is placed
                        // at once: no cursor, no reference to the region kept.
                        Some((mr, offset)) if op == Opcode::WRITE_ONLY => {
                            if !mr.place(offset, p.payload) {
                                error = Some((nak::REMOTE_ACCESS, "WRITE outside the region"));
                            }
                        }
                        Some((mr, offset)) => {
                            r.cursor = Some(Cursor::Write {
                                mr: mr.clone(),
                                offset,
                                remaining: dma,
                            })
                        }
                        None => {
                            bump(&self.core.counters.remote_access_errors);
                            error = Some((nak::REMOTE_ACCESS, "R_Key or range"));
                        }
                    }
                }
            }
            if error.is_none() && op != Opcode::WRITE_ONLY {
                if let Some(Cursor::Write {
                    mr,
                    offset,
                    remaining,
                }) = &mut r.cursor
                {
                    // rocev2.md 6.3: while more than one MTU remains a packet carries exactly
                    // one MTU; the final one exactly what remains.
                    let final_pkt = *remaining <= mtu as u64;
                    let want = if final_pkt { *remaining as usize } else { mtu };
                    if len != want || final_pkt != op.ends_message() {
                        error = Some((nak::INVALID_REQUEST, "WRITE length"));
                    } else if !mr.place(*offset, p.payload) {
                        error = Some((nak::REMOTE_ACCESS, "WRITE outside the region"));
                    } else {
                        *offset += len;
                        *remaining -= len as u64;
                    }
                }
            }
        }
        if let Some((code, why)) = error {
            self.send_ack(&conn, AethKind::Nak { code }, psn, r.msn);
            let mut rwc = None;
            if let Some(Cursor::Send { entry, .. }) = r.cursor.take() {
                let st = if code == nak::INVALID_REQUEST {
                    WcStatus::LocalLengthError
                } else {
                    WcStatus::WrFlushError
                };
                rwc = Some(wc(entry.wr_id, st, WcOpcode::Recv, 0, self.qpn));
            }
            drop(r);
            if let Some(w) = rwc {
                self.recv_cq.push(w);
            }
            self.enter_error(None, why);
            return;
        }
        // Step 8: executed.
        r.epsn = psn_add(r.epsn, 1);
        r.nak_sent = false;
        if op.ends_message() {
            r.msn = psn_add(r.msn, 1);
            if let Some(Cursor::Send { entry, done }) = r.cursor.take() {
                self.recv_cq.push(wc(
                    entry.wr_id,
                    WcStatus::Success,
                    WcOpcode::Recv,
                    done as u32,
                    self.qpn,
                ));
            }
            r.cursor = None;
        }
        if p.bth.ack_req {
            if r.ack_pending.is_none() {
                batch.acks.push(self_arc.clone());
            }
            r.ack_pending = Some(psn);
        }
    }

    /// The end of a receive batch: the ACK the batch's AckReq packets call for (one, for the
    /// highest; ACKs are cumulative) is held back for a reply to carry it ([`ACK_DELAY`]),
    /// unless that would leave [`ACK_SPAN`] PSNs or more unacknowledged.
    pub(in crate::roce) fn flush_ack(&self, now: Instant) {
        let Some(conn) = self.conn.get().copied() else {
            return;
        };
        let mut r = lock(&self.resp);
        let Some(psn) = r.ack_pending.take() else {
            return;
        };
        let msn = r.msn;
        let mut a = lock(&self.ack);
        if psn_diff(psn, a.sent_psn) >= ACK_SPAN {
            if a.owed.take().is_some() {
                self.ack_owed.store(false, Ordering::Release);
                self.core.acks_owed.fetch_sub(1, Ordering::AcqRel);
            }
            drop(a);
            drop(r);
            self.send_ack(&conn, AethKind::Ack { credit: 31 }, psn, msn);
            return;
        }
        let since = match a.owed {
            Some((_, _, since)) => since,
            None => {
                self.ack_owed.store(true, Ordering::Release);
                self.core.acks_owed.fetch_add(1, Ordering::AcqRel);
                now
            }
        };
        a.owed = Some((psn, msn, since));
    }

    /// Take the ACK owed (if any, and at least `age` old) to send it: PSN and MSN.
    pub(super) fn take_owed_ack(&self, age: Duration) -> Option<(u32, u32)> {
        if !self.ack_owed.load(Ordering::Acquire) {
            return None;
        }
        let mut a = lock(&self.ack);
        let (psn, msn, since) = a.owed?;
        if !age.is_zero() && since.elapsed() < age {
            return None;
        }
        a.owed = None;
        self.ack_owed.store(false, Ordering::Release);
        self.core.acks_owed.fetch_sub(1, Ordering::AcqRel);
        Some((psn, msn))
    }

    /// Send the ACK owed: any (`due` is `None`), or only one owed since `due.0 - due.1` or
    /// earlier. Returns when a younger one falls due.
    pub(crate) fn flush_owed_ack(&self, due: Option<(Instant, Duration)>) -> Option<Instant> {
        if !self.ack_owed.load(Ordering::Acquire) {
            return None;
        }
        let conn = self.conn.get().copied()?;
        let mut a = lock(&self.ack);
        let (psn, msn, since) = a.owed?;
        if let Some((now, delay)) = due {
            if now.saturating_duration_since(since) < delay {
                return Some(since + delay);
            }
        }
        a.owed = None;
        self.ack_owed.store(false, Ordering::Release);
        self.core.acks_owed.fetch_sub(1, Ordering::AcqRel);
        drop(a);
        if self.state() != QpState::Error {
            self.send_ack(&conn, AethKind::Ack { credit: 31 }, psn, msn);
        }
        None
    }
}
