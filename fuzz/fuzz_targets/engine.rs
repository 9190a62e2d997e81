//! Fuzz the endpoint engine (smc-proto) as a whole: two honest endpoints in the deterministic
//! harness, driven by an arbitrary sequence of steps read from the input: open connections,
//! deliver and run timers, application sends, close and abort, kill links, and inject
//! forged peer input (raw 44-byte LLC/CDC messages on a link, CDCs aimed at a live
//! connection's alert token with arbitrary cursors and flags, raw CLC bytes on a TCP
//! connection). Any panic (engine, or the harness's checks: reads outside the RMB, livelock)
//! is a finding; RDMA WRITEs the peer's forgeries make invalid complete in error, as a real
//! RNIC reports them.
#![no_main]

use libfuzzer_sys::fuzz_target;
use smc_proto::harness::Side;
use smc_proto::lgr_harness::EndpointPair;
use smc_proto::TcpId;
use std::time::Duration;

/// The input, consumed from the front.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }

    fn u32(&mut self) -> Option<u32> {
        let mut v = [0u8; 4];
        for b in &mut v {
            *b = self.byte()?;
        }
        Some(u32::from_be_bytes(v))
    }

    fn take(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.0.len());
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        a
    }
}

fn side(b: u8) -> Side {
    if b & 1 == 0 {
        Side::A
    } else {
        Side::B
    }
}

/// At most this many steps per input, so that one input stays fast.
const MAX_OPS: usize = 64;

fuzz_target!(|data: &[u8]| {
    let mut inp = Input(data);
    let devs = inp.byte().unwrap_or(0);
    // Bits 2–3 (side A) and 4–5 (side B) choose the SMC versions and UEIDs: default (no UEID:
    // v1), v1 + v2 with a UEID, v2 only, v1 only; bit 6 gives B another UEID (no match).
    let versioned = |s: Side, code: u8, ueid: &str| {
        let mut c = smc_proto::lgr_harness::config(
            s,
            1 + if s == Side::A {
                devs & 1
            } else {
                (devs >> 1) & 1
            },
        );
        let (v1, v2, with_ueid) = match code & 3 {
            0 => (true, true, false),
            1 => (true, true, true),
            2 => (false, true, true),
            _ => (true, false, true),
        };
        c.versions = smc_proto::endpoint::SmcVersions { v1, v2 };
        if with_ueid {
            c.ueids = vec![smc_wire::Eid::ueid(ueid).expect("valid UEID")];
        }
        c
    };
    let b_ueid = if devs & 0x40 != 0 { "OTHER" } else { "FUZZ" };
    let mut p = EndpointPair::new(
        versioned(Side::A, devs >> 2, "FUZZ"),
        versioned(Side::B, devs >> 4, b_ueid),
        u64::from(devs),
    );
    p.knobs.strict_writes = false;
    p.knobs.max_steps = 50_000;
    let mut next_tcp = 1u64;
    let mut tcps: Vec<TcpId> = Vec::new();
    for _ in 0..MAX_OPS {
        let Some(op) = inp.byte() else { break };
        let arg = inp.byte().unwrap_or(0);
        let pick = |tcps: &[TcpId], a: u8| -> Option<TcpId> {
            if tcps.is_empty() {
                None
            } else {
                Some(tcps[usize::from(a) % tcps.len()])
            }
        };
        match op % 12 {
            0 if tcps.len() < 8 => {
                let t = TcpId(next_tcp);
                next_tcp += 1;
                tcps.push(t);
                p.connect(t);
            }
            1 => {
                for _ in 0..=(arg % 16) {
                    if !p.deliver_next() {
                        break;
                    }
                }
            }
            2 => p.run(),
            3 => p.run_for(Duration::from_millis(u64::from(arg) * 250)),
            4 => {
                if let Some(t) = pick(&tcps, arg) {
                    let len = usize::from(inp.byte().unwrap_or(0)) * 97;
                    let s = side(arg >> 4);
                    let bytes: Vec<u8> = (0..len).map(|i| i as u8).collect();
                    p.app_send(s, t, &bytes);
                }
            }
            5 => {
                // A raw 44-byte message (LLC or CDC, any content) on a link.
                let s = side(arg);
                let num = 1 + (arg >> 1) % 3;
                let mut raw = [0u8; 44];
                let body = inp.take(44);
                raw[..body.len()].copy_from_slice(body);
                if let Some(link) = p.host(s).link(num) {
                    let now = p.now;
                    let h = p.host_mut(s);
                    h.ep.handle_message(link, &raw, &mut h.res, now);
                    p.flush();
                }
            }
            6 => {
                // A forged CDC aimed at a live connection, with arbitrary cursors and flags.
                let s = side(arg);
                let Some(t) = pick(&tcps, arg >> 1) else {
                    continue;
                };
                let Some(token) = p
                    .host(s)
                    .ep
                    .connection(t)
                    .map(|c| c.config().local_alert_token)
                else {
                    continue;
                };
                let mut raw = [0u8; 44];
                raw[0] = 0xFE;
                raw[1] = 44;
                raw[4..8].copy_from_slice(&token.to_be_bytes());
                let body = inp.take(18);
                raw[2..4].copy_from_slice(&[body.first().copied().unwrap_or(0), 1]);
                raw[8..8 + body.len().min(18)].copy_from_slice(&body[..body.len().min(18)]);
                let num = 1 + (arg >> 5) % 2;
                if let Some(link) = p.host(s).link(num) {
                    let now = p.now;
                    let h = p.host_mut(s);
                    h.ep.handle_message(link, &raw, &mut h.res, now);
                    p.flush();
                }
            }
            7 => {
                // Raw bytes on a TCP connection (CLC-shaped when the input says so).
                let Some(t) = pick(&tcps, arg) else { continue };
                let len = usize::from(inp.byte().unwrap_or(0) % 96);
                let mut bytes = inp.take(len).to_vec();
                if arg & 0x80 != 0 && bytes.len() >= 4 {
                    bytes[..4].copy_from_slice(&smc_wire::EYECATCHER_SMCR);
                }
                p.inject_tcp(side(arg >> 4), t, bytes);
            }
            8 => {
                let s = side(arg);
                let Some(link) = p.host(s).link(1 + (arg >> 1) % 2) else {
                    continue;
                };
                p.kill_link(s, link);
            }
            9 => {
                if let Some(t) = pick(&tcps, arg) {
                    let s = side(arg >> 4);
                    let _ = p.act(s, |ep, _, now| ep.close(t, now));
                }
            }
            10 => {
                if let Some(t) = pick(&tcps, arg) {
                    let s = side(arg >> 4);
                    let _ = p.act(s, |ep, _, now| ep.abort(t, now));
                }
            }
            11 => {
                if let Some(t) = pick(&tcps, arg) {
                    let s = side(arg >> 4);
                    let _ = p.act(s, |ep, _, now| ep.shutdown_write(t, now));
                }
                let _ = inp.u32();
            }
            _ => {}
        }
    }
    // Whatever happened, the pair settles: every timer fires within a bounded number of steps.
    p.run_for(Duration::from_secs(120));
});
