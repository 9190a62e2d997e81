//! Seeded chaos: random message losses (loud or silent), late completions and link kills
//! during setup and traffic. Every connection must end in exactly one clear outcome —
//! established with every byte delivered in order, fallen back, or reset — and nothing may
//! hang (every handshake ends, the drive loop is bounded).

use std::time::Duration;

use super::*;
use crate::lgr_harness::{Rng, Traced};

fn outcome(p: &EndpointPair, s: Side, tcp: TcpId) -> (bool, bool, bool) {
    let h = p.host(s);
    let est = h.saw(|e| matches!(e, EndpointEvent::Established { tcp: t, .. } if *t == tcp));
    let fb = h.saw(|e| matches!(e, EndpointEvent::FellBack { tcp: t, .. } if *t == tcp));
    let rs = h.saw(|e| matches!(e, EndpointEvent::Reset { tcp: t, .. } if *t == tcp))
        || h.saw(|e| {
            matches!(
                e,
                EndpointEvent::Conn { tcp: t, event: crate::conn::Event::Failed(_) } if *t == tcp
            )
        });
    (est, fb, rs)
}

fn chaos_run(seed: u64) {
    let mut rng = Rng::new(seed);
    let devs = (1 + rng.below(2) as u8, 1 + rng.below(2) as u8);
    let mut p = EndpointPair::new(
        crate::lgr_harness::config(Side::A, devs.0),
        crate::lgr_harness::config(Side::B, devs.1),
        seed,
    );
    p.knobs.completion_delay = Duration::from_micros(rng.below(300));
    p.knobs.silent_drop = rng.below(2) == 0;
    // Half the runs send as the runtime does: WRITEs executed at post, no replay copy.
    p.knobs.direct_writes = seed % 2 == 1;
    let loss = rng.below(40);
    let mut drop_rng = Rng::new(seed ^ 0xABCD);
    p.knobs.drop = Some(Box::new(move |e| {
        // Only LLC messages are lost (TCP is reliable; CDCs and writes are lost only with
        // their link).
        matches!(e.what, Traced::Llc(..)) && drop_rng.below(1000) < loss
    }));
    let conns = 1 + rng.below(3);
    let data: Vec<u8> = (0..20_000u32).map(|i| (i % 253) as u8).collect();
    for t in 0..conns {
        p.connect(TcpId(t + 1));
        let steps = rng.below(30);
        for _ in 0..steps {
            p.deliver_next();
        }
        if rng.below(4) == 0 {
            if let Some(l) = p.a.link(1 + rng.below(2) as u8) {
                p.kill_link(Side::A, l);
            }
        }
    }
    p.run_for(Duration::from_secs(120));
    p.knobs.drop = None;
    for t in 0..conns {
        let tcp = TcpId(t + 1);
        if p.a.established.contains(&tcp) && p.b.established.contains(&tcp) {
            p.app_send(Side::A, tcp, &data);
        }
    }
    p.run_for(Duration::from_secs(120));
    for t in 0..conns {
        let tcp = TcpId(t + 1);
        for s in [Side::A, Side::B] {
            let (est, fb, rs) = outcome(&p, s, tcp);
            assert!(est || fb || rs, "seed {seed}: {tcp:?} on {s:?} never ended");
            assert!(
                !(est && fb),
                "seed {seed}: {tcp:?} both established and fell back"
            );
            assert!(
                p.host(s).ep.handshake_state(tcp).is_none(),
                "seed {seed}: handshake hangs"
            );
        }
        let (ea, _, ra) = outcome(&p, Side::A, tcp);
        let (eb, _, rb) = outcome(&p, Side::B, tcp);
        if ea && eb && !ra && !rb && p.a.tx.get(&tcp).is_some_and(|q| q.is_empty()) {
            assert_eq!(
                p.b.rx.get(&tcp).map(Vec::len),
                Some(data.len()),
                "seed {seed}: {tcp:?}"
            );
            assert!(p.b.rx[&tcp] == data, "seed {seed}: bytes differ");
        }
    }
}

/// 300 seeded chaos runs (`SMC_CHAOS_RUNS` for more).
#[test]
fn chaos_every_connection_ends_clearly() {
    let runs: u64 = std::env::var("SMC_CHAOS_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    for seed in 0..runs {
        chaos_run(seed);
    }
}
