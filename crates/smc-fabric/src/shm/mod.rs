//! The shared-memory backend: software RNICs between processes of one host.
//!
//! Each process that opens device `shmN` becomes its own RNIC port with its own GID and listens on
//! `<fabric dir>/shmN/<gid hex>.sock` (a Unix SEQPACKET socket). Moving a QP to RTR connects to the
//! remote GID's socket; the connection is the QP's control channel: the peer hands over its
//! receive ring (a sealed memfd) and doorbell eventfds, and grants memory regions of the QP's
//! protection domain on request, one rkey at a time. A closed connection means the peer QP (or
//! process) is gone: the QP goes to the error state and its outstanding work is flushed.

mod control;
mod cq;
mod device;
pub(crate) mod mem;
pub(crate) use mem::{place, prefetch, LINE};
mod mr;
mod qp;
mod wire;

pub(crate) use cq::CqShared;
pub(crate) use device::DeviceHandle;
pub(crate) use mr::MrInner;
pub(crate) use qp::QpShared;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::FabricConfig;
    use crate::types::{
        AccessFlags, QpCaps, QpState, RecvWr, RemoteQpInfo, SendWr, Sge, WcOpcode, WcStatus,
        WorkCompletion,
    };
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    struct End {
        qp: Arc<QpShared>,
        cq: Arc<CqShared>,
        _rx: Arc<MrInner>,
    }

    fn end(dev: &Arc<DeviceHandle>) -> End {
        let cq = CqShared::new(dev.clone()).expect("cq");
        let pd = dev.core.alloc_pd();
        let qp = QpShared::create(dev.clone(), pd, cq.clone(), cq.clone(), QpCaps::default())
            .expect("qp");
        let rx = MrInner::register(&dev.core, pd, 4096, AccessFlags::LOCAL_WRITE).expect("mr");
        qp.to_init().expect("init");
        for i in 0..8u64 {
            let sge = Sge {
                addr: rx.vaddr() + i * 64,
                length: 64,
                lkey: rx.key,
            };
            qp.post_recv(&RecvWr { wr_id: i, sge }).expect("recv");
        }
        End { qp, cq, _rx: rx }
    }

    fn remote(e: &End) -> RemoteQpInfo {
        let l = e.qp.local_info();
        RemoteQpInfo {
            gid: l.gid,
            qp_num: l.qp_num,
            psn: l.psn,
            mtu: l.mtu,
        }
    }

    /// Two ends on `dev` whose QPs are connected to each other and ready to send.
    fn connected_pair(dev: &Arc<DeviceHandle>) -> (End, End) {
        let (a, b) = (end(dev), end(dev));
        a.qp.to_rtr(remote(&b)).expect("rtr");
        b.qp.to_rtr(remote(&a)).expect("rtr");
        a.qp.to_rts().expect("rts");
        b.qp.to_rts().expect("rts");
        (a, b)
    }

    /// The lock-free readiness hint a spinning poller looks at: no on an idle queue, yes once a
    /// message is in the ring or a completion is queued, no again once polled.
    #[test]
    fn maybe_ready_follows_what_poll_would_find() {
        let dir = std::env::temp_dir().join(format!("smcf-ready-{}", std::process::id()));
        let cfg = FabricConfig::with_dir(&dir, 1);
        let dev = DeviceHandle::open(&cfg, "shm0").expect("open");
        let (a, b) = connected_pair(&dev);
        let mut w = [WorkCompletion::EMPTY; 4];
        assert!(!b.cq.maybe_ready());
        for round in 0..3u64 {
            a.qp.post_send(&SendWr::Send {
                wr_id: round,
                data: b"hi",
                signaled: true,
            })
            .expect("send");
            assert!(b.cq.maybe_ready(), "message in the ring, round {round}");
            let mut got = 0;
            while got == 0 {
                got = b.cq.poll(&mut w);
            }
            assert_eq!(w[0].opcode, WcOpcode::Recv);
            assert!(!b.cq.maybe_ready(), "ring consumed, round {round}");
            // The sender's completion waits in its queue until polled.
            let mut sent = 0;
            while sent == 0 {
                sent = a.cq.poll(&mut w);
            }
            assert!(!a.cq.maybe_ready(), "completion polled, round {round}");
        }
        a.qp.destroy();
        b.qp.destroy();
    }

    /// A peer that scribbles over our receive ring (sequence numbers, indices, slot lengths)
    /// breaks only the QP:
    /// it enters the error state and flushes, nothing panics or reads out of bounds.
    #[test]
    fn scribbled_ring_fails_the_qp_only() {
        let dir = std::env::temp_dir().join(format!("smcf-unit-{}", std::process::id()));
        let cfg = FabricConfig::with_dir(&dir, 1);
        for scribble in 0..3 {
            let dev = DeviceHandle::open(&cfg, "shm0").expect("open");
            let (a, b) = connected_pair(&dev);
            a.qp.post_send(&SendWr::Send {
                wr_id: 1,
                data: b"hi",
                signaled: false,
            })
            .expect("send");
            let hdr = b.qp.inbound_header();
            match scribble {
                0 => {
                    // Slot 1 published as the second message, with a length beyond any SEND
                    // (after "hi" in slot 0).
                    // SAFETY: slot 1 lies inside b's ring mapping, which outlives this write.
                    unsafe {
                        let p =
                            b.qp.inbound_ptr()
                                .add(crate::ring::HEADER_SIZE + crate::ring::SLOT_SIZE);
                        std::ptr::write_unaligned(p.cast::<u32>(), 9000);
                        std::ptr::write_unaligned(p.add(4).cast::<u32>(), 2);
                    }
                }
                1 => {
                    // Slot 0 length field beyond any SEND.
                    // SAFETY: slot 0 lies inside b's ring mapping, which outlives this write.
                    unsafe {
                        let p = b.qp.inbound_ptr().add(crate::ring::HEADER_SIZE);
                        std::ptr::write_unaligned(p.cast::<u32>(), 9000);
                    }
                }
                _ => {
                    // Let b consume "hi" first (its consumer publishes head), then scribble.
                    let mut w = [WorkCompletion::EMPTY; 1];
                    while b.cq.poll(&mut w) == 0 {
                        std::thread::yield_now();
                    }
                    assert_eq!(w[0].status, WcStatus::Success);
                    hdr.head.store(12345, Ordering::Release);
                }
            }
            let mut wcs = [WorkCompletion::EMPTY; 16];
            let mut seen = Vec::new();
            for _ in 0..100 {
                if scribble != 2 {
                    let n = b.cq.poll(&mut wcs);
                    seen.extend_from_slice(&wcs[..n]);
                }
                let n = a.cq.poll(&mut wcs);
                seen.extend_from_slice(&wcs[..n]);
                if scribble == 2 {
                    // A scribbled head is noticed by the producer when it reads the shared
                    // head, which it does once its own copy says the ring is full (b does not
                    // consume meanwhile, so the ring's 256 slots fill).
                    for _ in 0..4 {
                        let _ = a.qp.post_send(&SendWr::Send {
                            wr_id: 2,
                            data: b"x",
                            signaled: true,
                        });
                    }
                }
                if seen.iter().any(|w| w.status == WcStatus::WrFlushError) {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            let failed = if scribble == 2 { &a.qp } else { &b.qp };
            assert_eq!(failed.state(), QpState::Error, "scribble {scribble}");
            assert!(seen.iter().any(|w| w.status == WcStatus::WrFlushError));
            a.qp.destroy();
            b.qp.destroy();
        }
    }
}
