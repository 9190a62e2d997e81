//! Helpers shared by the integration tests.
#![allow(dead_code, missing_docs, clippy::unwrap_used)]

use smc_fabric::*;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// A fresh fabric directory for one test.
pub fn test_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "smcf-{}-{}-{}",
        tag,
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0)
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// One side of a connection: device, PD, CQ, QP, an RMB and a receive area.
pub struct Side {
    pub dev: Device,
    pub pd: ProtectionDomain,
    pub cq: CompletionQueue,
    pub qp: QueuePair,
    pub rmb: MemoryRegion,
    pub rx: MemoryRegion,
}

pub const RX_SLOTS: usize = 64;
pub const RX_SLOT: usize = 64;

impl Side {
    pub fn new(cfg: &FabricConfig, dev: &str, rmb_len: usize) -> Side {
        let dev = Device::open(cfg, dev).unwrap();
        let pd = dev.alloc_pd().unwrap();
        let cq = dev.create_cq().unwrap();
        let qp = pd
            .create_qp(
                &cq,
                &cq,
                QpCaps {
                    max_send_wr: 256,
                    max_recv_wr: RX_SLOTS as u32,
                },
            )
            .unwrap();
        let rmb = pd
            .register(
                rmb_len,
                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
            )
            .unwrap();
        let rx = pd
            .register(RX_SLOTS * RX_SLOT, AccessFlags::LOCAL_WRITE)
            .unwrap();
        qp.to_init().unwrap();
        Side {
            dev,
            pd,
            cq,
            qp,
            rmb,
            rx,
        }
    }

    pub fn remote(&self) -> RemoteQpInfo {
        let l = self.qp.local_info();
        RemoteQpInfo {
            gid: l.gid,
            qp_num: l.qp_num,
            psn: l.psn,
            mtu: l.mtu,
        }
    }

    pub fn post_rx(&self, slot: usize) {
        let sge = self.rx.sge(slot * RX_SLOT, RX_SLOT as u32).unwrap();
        self.qp
            .post_recv(&RecvWr {
                wr_id: slot as u64,
                sge,
            })
            .unwrap();
    }

    pub fn post_all_rx(&self) {
        for i in 0..RX_SLOTS {
            self.post_rx(i);
        }
    }

    /// Wait for the next completion, with a generous timeout.
    pub fn next_wc(&self) -> WorkCompletion {
        let mut wcs = [WorkCompletion::EMPTY; 1];
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let n = self
                .cq
                .wait(&mut wcs, Some(Duration::from_millis(200)))
                .unwrap();
            if n == 1 {
                return wcs[0];
            }
            assert!(Instant::now() < deadline, "no completion within 10 s");
        }
    }

    /// Read a received message into a vector.
    pub fn rx_bytes(&self, wc: &WorkCompletion) -> Vec<u8> {
        let mut v = vec![0u8; wc.byte_len as usize];
        self.rx
            .read_at(wc.wr_id as usize * RX_SLOT, &mut v)
            .unwrap();
        v
    }
}

/// Connect two sides (both to RTS).
pub fn connect(a: &Side, b: &Side) {
    a.qp.to_rtr(b.remote()).unwrap();
    b.qp.to_rtr(a.remote()).unwrap();
    a.qp.to_rts().unwrap();
    b.qp.to_rts().unwrap();
}

/// Number of open fds of this process.
pub fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Number of file-backed mappings of this process (memfd regions and rings included).
/// Anonymous mappings are left out: glibc creates malloc arenas (never released) for new
/// threads, which is allocator state, not a leak; thread leaks are checked via `/proc/self/task`.
pub fn map_count() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .map(|s| {
            s.lines()
                .filter(|l| l.split_whitespace().nth(5).is_some())
                .count()
        })
        .unwrap_or(0)
}

/// Number of mappings of fabric memfds (memory regions and rings).
pub fn fabric_map_count() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .map(|s| s.lines().filter(|l| l.contains("smc-fabric")).count())
        .unwrap_or(0)
}

/// Checksum used by the stress tests (FNV-1a 64).
pub fn fnv(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in data {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}
