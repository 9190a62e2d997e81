//! Injected packet faults of a roce device (`SMC_FABRIC_FAULTS`): drop, reorder, duplicate,
//! corrupt and delay, applied to every packet the device transmits. The random numbers come
//! from a xorshift generator seeded from the kernel, so runs differ.

use super::device::Dest;
use crate::config::Fault;
use std::time::{Duration, Instant};

#[derive(Default)]
pub(crate) struct Faults {
    drop: f64,
    reorder: f64,
    dup: f64,
    corrupt: f64,
    delay: Option<Duration>,
    rng: u64,
    /// A packet held back to be sent after the next one.
    held: Option<(Dest, Vec<u8>)>,
    /// Delayed packets and when they are due, in order.
    delayed: Vec<(Instant, Dest, Vec<u8>)>,
}

/// What to do with one transmitted packet.
pub(crate) struct Outcome {
    /// Packets to send now, in order.
    pub(crate) send: Vec<(Dest, Vec<u8>)>,
    /// Whether the packet was dropped on purpose.
    pub(crate) dropped: bool,
}

impl Faults {
    pub(crate) fn add(&mut self, f: &Fault) {
        match *f {
            Fault::Drop(p) => self.drop = p / 100.0,
            Fault::Reorder(p) => self.reorder = p / 100.0,
            Fault::Duplicate(p) => self.dup = p / 100.0,
            Fault::Corrupt(p) => self.corrupt = p / 100.0,
            Fault::Delay(ms) => self.delay = Some(Duration::from_millis(ms)),
            Fault::PortDown | Fault::FailNext(_) => {}
        }
        if self.rng == 0 {
            self.rng = u64::from_ne_bytes(crate::shm::mem::random_bytes::<8>()) | 1;
        }
    }

    fn next(&mut self) -> u64 {
        let mut x = self.rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng = x;
        x
    }

    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && ((self.next() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    pub(crate) fn on_transmit(&mut self, dst: Dest, pkt: &[u8]) -> Outcome {
        let mut out = Outcome {
            send: Vec::new(),
            dropped: false,
        };
        if self.chance(self.drop) {
            out.dropped = true;
            return out;
        }
        let mut p = pkt.to_vec();
        if self.chance(self.corrupt) && !p.is_empty() {
            let bit = (self.next() % (p.len() as u64 * 8)) as usize;
            p[bit / 8] ^= 1 << (bit % 8);
        }
        let copies = if self.chance(self.dup) { 2 } else { 1 };
        if let Some(d) = self.delay {
            let due = Instant::now() + d;
            for _ in 0..copies {
                self.delayed.push((due, dst, p.clone()));
            }
            return out;
        }
        if self.held.is_none() && self.chance(self.reorder) {
            self.held = Some((dst, p));
            return out;
        }
        for _ in 0..copies {
            out.send.push((dst, p.clone()));
        }
        if let Some(h) = self.held.take() {
            out.send.push(h);
        }
        out
    }

    /// Packets whose delay is over, and a held-back packet that no later one released.
    pub(crate) fn due(&mut self, now: Instant) -> Vec<(Dest, Vec<u8>)> {
        let mut out = Vec::new();
        let n = self
            .delayed
            .iter()
            .take_while(|(t, _, _)| *t <= now)
            .count();
        for (_, d, p) in self.delayed.drain(..n) {
            out.push((d, p));
        }
        if let Some(h) = self.held.take() {
            out.push(h);
        }
        out
    }
}
