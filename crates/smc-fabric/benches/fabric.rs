//! Fabric benchmarks over the shm backend (two ports of one process, peer on its own thread):
//! SEND ping-pong latency (busy polling and blocking waits) and 64 KiB RDMA WRITE bandwidth with
//! the same-run memcpy bandwidth as the ceiling.
#![allow(missing_docs, clippy::unwrap_used)]

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use smc_fabric::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SLOTS: usize = 32;

struct End {
    _dev: Device,
    _pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
    rmb: MemoryRegion,
    rx: MemoryRegion,
}

impl End {
    fn new(cfg: &FabricConfig) -> End {
        let dev = Device::open(cfg, "shm0").unwrap();
        let pd = dev.alloc_pd().unwrap();
        let cq = dev.create_cq().unwrap();
        let qp = pd
            .create_qp(
                &cq,
                &cq,
                QpCaps {
                    max_send_wr: 64,
                    max_recv_wr: SLOTS as u32,
                },
            )
            .unwrap();
        let rmb = pd
            .register(
                1 << 20,
                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
            )
            .unwrap();
        let rx = pd.register(SLOTS * 64, AccessFlags::LOCAL_WRITE).unwrap();
        qp.to_init().unwrap();
        for i in 0..SLOTS {
            qp.post_recv(&RecvWr {
                wr_id: i as u64,
                sge: rx.sge(i * 64, 64).unwrap(),
            })
            .unwrap();
        }
        End {
            _dev: dev,
            _pd: pd,
            cq,
            qp,
            rmb,
            rx,
        }
    }
    fn remote(&self) -> RemoteQpInfo {
        let l = self.qp.local_info();
        RemoteQpInfo {
            gid: l.gid,
            qp_num: l.qp_num,
            psn: l.psn,
            mtu: l.mtu,
        }
    }
    fn repost(&self, wc: &WorkCompletion) {
        let i = wc.wr_id as usize;
        self.qp
            .post_recv(&RecvWr {
                wr_id: wc.wr_id,
                sge: self.rx.sge(i * 64, 64).unwrap(),
            })
            .unwrap();
    }
    /// Next receive completion, busy polling or blocking.
    fn recv(&self, busy: bool, wcs: &mut [WorkCompletion; 8], stop: Option<&AtomicBool>) -> bool {
        loop {
            let n = if busy {
                self.cq.poll(wcs)
            } else {
                self.cq.wait(wcs, Some(Duration::from_millis(50))).unwrap()
            };
            let mut got = false;
            for wc in &wcs[..n] {
                if wc.opcode == WcOpcode::Recv {
                    assert!(wc.is_ok());
                    self.repost(wc);
                    got = true;
                }
            }
            if got {
                return true;
            }
            if stop.is_some_and(|s| s.load(Ordering::Relaxed)) {
                return false;
            }
            if busy {
                std::hint::spin_loop();
            }
        }
    }
}

fn pair(tag: &str) -> (End, End) {
    let dir = std::env::temp_dir().join(format!("smcf-bench-{tag}-{}", std::process::id()));
    let cfg = FabricConfig::with_dir(dir, 1);
    let a = End::new(&cfg);
    let b = End::new(&cfg);
    a.qp.to_rtr(b.remote()).unwrap();
    b.qp.to_rtr(a.remote()).unwrap();
    a.qp.to_rts().unwrap();
    b.qp.to_rts().unwrap();
    (a, b)
}

fn ping_pong(c: &mut Criterion, busy: bool) {
    let name = if busy {
        "send_ping_pong_busy_poll"
    } else {
        "send_ping_pong_blocking"
    };
    let (a, b) = pair(name);
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    let echo = std::thread::spawn(move || {
        let mut wcs = [WorkCompletion::EMPTY; 8];
        while b.recv(busy, &mut wcs, Some(&s2)) {
            b.qp.post_send(&SendWr::Send {
                wr_id: 0,
                data: &[0u8; 44],
                signaled: false,
            })
            .unwrap();
        }
    });
    let msg = [7u8; 44];
    let mut wcs = [WorkCompletion::EMPTY; 8];
    c.bench_function(name, |bench| {
        bench.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                a.qp.post_send(&SendWr::Send {
                    wr_id: 0,
                    data: &msg,
                    signaled: false,
                })
                .unwrap();
                a.recv(busy, &mut wcs, None);
            }
            // One round trip per iteration.
            t.elapsed()
        })
    });
    stop.store(true, Ordering::Relaxed);
    echo.join().unwrap();
}

/// Floor of the blocking ping-pong: two threads waking each other through eventfds (poll +
/// read + write per hop), no fabric involved. Wake-up latency of idle (v)CPUs dominates both.
fn eventfd_baseline(c: &mut Criterion) {
    use rustix::event::{eventfd, poll, EventfdFlags, PollFd, PollFlags};
    use rustix::fd::OwnedFd;
    fn hop(wait_on: &OwnedFd) {
        let mut fds = [PollFd::new(wait_on, PollFlags::IN)];
        let _ = poll(&mut fds, None);
        let mut b = [0u8; 8];
        let _ = rustix::io::read(wait_on, &mut b);
    }
    let ping = Arc::new(eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK).unwrap());
    let pong = Arc::new(eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let (p2, q2, s2) = (ping.clone(), pong.clone(), stop.clone());
    let echo = std::thread::spawn(move || loop {
        hop(&p2);
        let _ = rustix::io::write(&*q2, &1u64.to_ne_bytes());
        if s2.load(Ordering::Relaxed) {
            break;
        }
    });
    c.bench_function("eventfd_ping_pong_baseline", |bench| {
        bench.iter(|| {
            let _ = rustix::io::write(&*ping, &1u64.to_ne_bytes());
            hop(&pong);
        })
    });
    stop.store(true, Ordering::Relaxed);
    let _ = rustix::io::write(&*ping, &1u64.to_ne_bytes());
    echo.join().unwrap();
}

fn latency(c: &mut Criterion) {
    ping_pong(c, true);
    ping_pong(c, false);
    eventfd_baseline(c);
}

fn bandwidth(c: &mut Criterion) {
    const LEN: usize = 64 * 1024;
    let (a, b) = pair("bw");
    let src = vec![0x5au8; LEN];
    let mut group = c.benchmark_group("write_64KiB");
    group.throughput(Throughput::Bytes(LEN as u64));
    let (rkey, base) = (b.rmb.rkey(), b.rmb.addr());
    let mut k = 0u64;
    group.bench_function("rdma_write", |bench| {
        bench.iter(|| {
            let off = (k % 16) * LEN as u64;
            k += 1;
            a.qp.post_send(&SendWr::WriteInline {
                wr_id: k,
                data: &src,
                remote_addr: base + off,
                rkey,
                signaled: false,
            })
            .unwrap();
        })
    });
    let mut dst = vec![0u8; 16 * LEN];
    let mut k = 0usize;
    group.bench_function("memcpy_ceiling", |bench| {
        bench.iter(|| {
            let off = (k % 16) * LEN;
            k += 1;
            dst[off..off + LEN].copy_from_slice(black_box(&src));
            black_box(&dst);
        })
    });
    group.finish();
    drop(b);
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = latency, bandwidth
}
criterion_main!(benches);
