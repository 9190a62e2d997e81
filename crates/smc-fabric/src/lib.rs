//! # smc-fabric: the RDMA verbs model of smc-rs and its backends
//!
//! SMC-R (RFC 7609) moves payload by RDMA WRITE into the peer's memory and signals by RDMA SEND
//! of 44-byte CDC/LLC messages over reliably connected (RC) queue pairs. This crate models that
//! layer as a small set of backend-agnostic verbs objects:
//!
//! | object | verbs analogue | what it is for |
//! |---|---|---|
//! | [`Device`] | `ibv_context` + port | software RNIC: name, [`Gid`], [`Mac`], port state, events, fault injection |
//! | [`ProtectionDomain`] | `ibv_pd` | scope of memory regions a connected remote QP may access |
//! | [`MemoryRegion`] | `ibv_mr` | fabric-owned buffer with lkey, rkey, address, length, [`AccessFlags`] |
//! | [`CompletionQueue`] | `ibv_cq` + `ibv_comp_channel` | [`WorkCompletion`]s; busy [`poll`](CompletionQueue::poll), blocking [`wait`](CompletionQueue::wait), or an eventfd for epoll/tokio |
//! | [`QueuePair`] | RC `ibv_qp` | RESET → INIT → RTR → RTS (→ ERROR); post [`SendWr`] and [`RecvWr`] |
//!
//! Every object is an enum over backends (the shared-memory backend `shm` and the software
//! RoCEv2 backend `roce`, see docs/roce.md); a libibverbs backend would add a variant without
//! changing callers.
//!
//! ## Semantics
//!
//! - RDMA WRITE is executed at post time (the shm backend copies straight into the mapped remote
//!   region after checking rkey, bounds and access); SEND is placed into the peer's receive ring.
//!   Work requests of one QP execute in order, so a WRITE posted before a SEND is visible at the
//!   receiver before the SEND's receive completion.
//! - A remote-access violation completes with [`WcStatus::RemoteAccessError`] and moves the QP to
//!   [`QpState::Error`]; in the error state every outstanding and newly posted work request
//!   completes with [`WcStatus::WrFlushError`]. Synchronous misuse returns a [`FabricError`].
//! - A SEND completes successfully only once a receive WR of the peer is waiting for it (as in
//!   RC, where the receiver takes a receive WR on arrival): the peer publishes how many receive
//!   WRs it ever posted ("credits") in its ring, and a SEND placed into the ring without one is
//!   RNR-waiting: it completes (in order, and so does every later work request of the QP) when
//!   the peer posts a receive for it. SENDs that find the peer's ring full wait in the send
//!   queue (RC "RNR retry forever"); the queue advances whenever the QP posts or its send CQ is
//!   polled. A WRITE behind an RNR-waiting SEND is already visible at the peer, only its
//!   completion waits.
//! - When a QP enters the error state (port down, [`QueuePair::force_error`], a failed work
//!   request, or its peer's error reaching it), it first revokes its credits, then delivers the
//!   messages already in its receive ring as successful receive completions into the posted
//!   receive WRs (in order), and only then flushes the remaining receive WRs. The sender
//!   completes a SEND successfully iff the receiver consumed it or had a receive WR posted for
//!   it before revoking; every other SEND (RNR-waiting or queued) completes with
//!   [`WcStatus::WrFlushError`] when the error reaches the sender. Hence a SEND that completed
//!   successfully was delivered, and one that was flushed was not, except in two cases where
//!   real RC is ambiguous too: a peer *process* that dies cannot revoke, so SENDs it had
//!   credited complete successfully although it never polled them; and SENDs whose sender's QP
//!   failed first may still be delivered by the receiver (like an RC ACK that is lost).
//! - A peer process dying closes its control sockets: our QPs connected to it enter the error
//!   state immediately (messages it already sent are still delivered first).
//! - Work completions of receives report the message length; the bytes are in the posted
//!   receive buffer, read them with [`MemoryRegion::read_at`].
//! - The completion channel ([`CompletionQueue::fd`]) is an epoll fd over per-QP doorbell
//!   eventfds: it becomes readable only after [`CompletionQueue::req_notify`], so busy pollers
//!   never pay for doorbells.
//!
//! ## The shm backend
//!
//! Devices `shm0`, `shm1`, … come from [`FabricConfig`] (or the environment, see
//! [`config`]). Each process that opens a device is its own RNIC port with its own GID (derived
//! from pid, randomness and device index) and listens on a Unix SEQPACKET socket
//! `<dir>/<device>/<gid hex>.sock` in the fabric directory (default `$XDG_RUNTIME_DIR/smc-fabric`,
//! else `/tmp/smc-fabric-<uid>`). Moving a QP to RTR connects to the remote GID's socket; memory
//! regions and rings are sealed memfds passed with SCM_RIGHTS. A remote QP gets only regions of
//! the protection domain of the QP it is connected to, and only with remote-write access.
//! SEND uses a lock-free SPSC ring in shared memory whose eventfd doorbell is rung only when the
//! receiver sleeps, so a busy-polling receiver costs the sender no system call.
//!
//! ## Example
//!
//! ```no_run
//! use smc_fabric::*;
//!
//! /// `exchange` stands for the CLC/LLC exchange: it sends our QP info and RMB (rkey, address)
//! /// to the peer and returns the peer's.
//! fn link(
//!     exchange: impl FnOnce(LocalQpInfo, u32, u64) -> (RemoteQpInfo, u32, u64),
//! ) -> Result<()> {
//! let cfg = FabricConfig::from_env()?;
//! let dev = Device::open(&cfg, "shm0")?;
//! let pd = dev.alloc_pd()?;
//! let cq = dev.create_cq()?;
//! let rmb = pd.register(64 * 1024, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
//! let rx = pd.register(4096, AccessFlags::LOCAL_WRITE)?;
//! let qp = pd.create_qp(&cq, &cq, QpCaps::default())?;
//! qp.to_init()?;
//! let (remote, peer_rkey, peer_addr) = exchange(qp.local_info(), rmb.rkey(), rmb.addr());
//! qp.post_recv(&RecvWr { wr_id: 1, sge: rx.sge(0, 44)? })?;
//! qp.to_rtr(remote)?;
//! qp.to_rts()?;
//! qp.post_send(&SendWr::WriteInline { wr_id: 2, data: b"payload", remote_addr: peer_addr, rkey: peer_rkey, signaled: false })?;
//! qp.post_send(&SendWr::Send { wr_id: 3, data: &[0u8; 44], signaled: true })?;
//! let mut wcs = [WorkCompletion::EMPTY; 16];
//! let n = cq.wait(&mut wcs, None)?;
//! for wc in &wcs[..n] {
//!     assert!(wc.is_ok());
//! }
//! Ok(())
//! }
//! ```
//!
//! ## Limits of the shm backend
//!
//! - SEND payloads are at most [`MAX_SEND`] (8192) bytes, an SMC-Rv2 LLC message's maximum
//!   (CDC and v1 LLC messages are 44). Up to [`MAX_INLINE`] (56) bytes take one 64-byte slot of
//!   the peer's receive ring; a longer SEND is split over consecutive slots (`ring.rs`).
//! - A QP in the error state stays there (no ERROR → RESET recycling); create a new QP.
//! - QP state transitions of one QP must not be issued concurrently from several threads
//!   (as with verbs `modify_qp`); posting and polling may run on any threads.
//! - The first RDMA WRITE to a new rkey costs one control round trip (the region's memfd is
//!   granted and mapped, then cached); later WRITEs are a bounds check and a memcpy.
//!
//! ## Tests
//!
//! - `cargo test -p smc-fabric` runs unit tests, in-process fabric tests and the multi-process
//!   tests (`tests/multiprocess.rs` re-executes the test binary as the peer process). The
//!   WRITE-then-SEND stress test checks 100 000 messages by default; set
//!   `SMC_FABRIC_STRESS_MESSAGES=1000000` for the million-message run.
//! - The loom model of the ring, the doorbell/sleep protocol and [`Sleepers`] (use a separate target
//!   directory, the cfg change rebuilds everything):
//!   `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p smc-fabric --release --lib loom`.
//!   The search uses a preemption bound of 3 unless `LOOM_MAX_PREEMPTIONS` says otherwise.
//! - Benchmarks (SEND ping-pong busy/blocking, 64 KiB WRITE bandwidth next to memcpy):
//!   `cargo bench -p smc-fabric --bench fabric`.

#![warn(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks, clippy::missing_safety_doc)]

pub mod access;
pub mod config;
mod error;
pub mod fdplace;
mod ring;
mod roce;
mod sched;
mod shm;
mod sleepers;
pub mod sockpath;
mod sync;
pub mod threads;
mod types;

pub use config::{DeviceConfig, DeviceKind, FabricConfig, Fault};
pub use error::{FabricError, Result};
pub use ring::{MAX_INLINE, MAX_SEND};
pub use sched::QuietWake;
pub use sleepers::Sleepers;
pub use types::{
    AccessFlags, DeviceEvent, Gid, LocalQpInfo, Mac, Mtu, PackedBytes, PortState, PostStatus,
    QpCaps, QpState, RecvWr, RemoteQpInfo, SendWr, Sge, WcOpcode, WcStatus, WorkCompletion,
};

use rustix::fd::BorrowedFd;
use std::sync::Arc;
use std::time::Duration;

/// Copy `src` to `dst` the way the shm fabric places an RDMA WRITE's payload in the peer's
/// memory: writes of 4 KiB and more with non-temporal stores, as an RNIC's DMA lands in memory
/// rather than in a core's cache; smaller ones with plain stores. Exposed so that `smc bench`
/// can give its stream floor the same placement as the data path it is compared with.
///
/// # Safety
/// `dst` must be valid for writing `src.len()` bytes that no Rust reference covers (shared
/// memory another thread or process may read, but does not write meanwhile).
pub unsafe fn place_rdma_write(src: &[u8], dst: *mut u8) {
    // SAFETY: `src` is a valid slice; `dst` as the caller promises.
    unsafe { shm::place(src.as_ptr(), dst, src.len()) }
}

/// The path MTU a software RoCE device offers on a netdev of MTU `netdev_mtu`, as rxe picks it
/// (the netdev's MTU less 80 bytes of headers, rounded down to an IB MTU): 1,024 on an
/// Ethernet MTU of 1,500, 4,096 from 4,176. `None` below 336.
pub fn roce_path_mtu(netdev_mtu: u32) -> Option<Mtu> {
    roce::active_mtu(netdev_mtu)
}

/// Names of the devices of a fabric configuration (verbs `ibv_get_device_list`).
pub fn list_devices(config: &FabricConfig) -> Vec<String> {
    config.device_names()
}

/// GIDs of the ports currently open on device `name` by any process of this fabric (one per
/// process that opened the device), e.g. for `smc device`. Sockets of dead processes are
/// skipped.
pub fn list_ports(config: &FabricConfig, name: &str) -> Result<Vec<Gid>> {
    config.device(name)?;
    let dir = config.dir.join(name);
    let Ok(rd) = std::fs::read_dir(&dir) else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for entry in rd.flatten() {
        let file = entry.file_name();
        let Some(hex) = file.to_str().and_then(|f| f.strip_suffix(".sock")) else {
            continue;
        };
        if hex.len() != 32 || !hex.is_ascii() {
            continue;
        }
        let mut gid = [0u8; 16];
        let parsed = gid.iter_mut().enumerate().all(|(i, b)| {
            u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
                .map(|v| *b = v)
                .is_ok()
        });
        let pid = u32::from_be_bytes([gid[8], gid[9], gid[10], gid[11]]);
        if parsed && std::path::Path::new(&format!("/proc/{pid}")).exists() {
            out.push(Gid(gid));
        }
    }
    out.sort();
    Ok(out)
}

#[derive(Clone)]
enum DeviceImpl {
    Shm(Arc<shm::DeviceHandle>),
    Roce(Arc<roce::RoceHandle>),
}

/// Packet counters of a software RoCEv2 device ([`Device::counters`]), since it was opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceCounters {
    /// Packets sent (first transmissions, retransmissions, ACKs and NAKs).
    pub tx_packets: u64,
    /// UDP payload bytes sent.
    pub tx_bytes: u64,
    /// Datagrams received on the device's socket.
    pub rx_packets: u64,
    /// UDP payload bytes received.
    pub rx_bytes: u64,
    /// Packets sent again (go-back-N after a NAK, an RNR NAK or a timeout).
    pub retransmits: u64,
    /// Retransmission timer expiries.
    pub timeouts: u64,
    /// NAKs sent (PSN sequence errors and error NAKs).
    pub naks_sent: u64,
    /// NAKs received.
    pub naks_received: u64,
    /// RNR NAKs sent (a SEND arrived with no receive posted).
    pub rnr_naks_sent: u64,
    /// RNR NAKs received.
    pub rnr_naks_received: u64,
    /// ACKs sent (coalesced: one per QP per receive batch, plus one per duplicate).
    pub acks_sent: u64,
    /// Duplicate request packets received (answered, not executed again).
    pub duplicates: u64,
    /// Packets dropped for a bad ICRC.
    pub drop_icrc: u64,
    /// Packets dropped as malformed (length, version, opcode, P_Key).
    pub drop_malformed: u64,
    /// Packets for a QP that does not exist or is not ready.
    pub drop_unknown_qp: u64,
    /// Packets from an address that is not the QP's peer.
    pub drop_wrong_source: u64,
    /// Request packets ahead of the expected PSN (dropped; the first is NAKed).
    pub drop_out_of_sequence: u64,
    /// ACKs past the highest PSN this QP transmitted (ignored: they would complete packets
    /// that never left).
    pub drop_ghost_acks: u64,
    /// WRITEs refused for a bad R_Key, protection domain, access or range (NAKed).
    pub remote_access_errors: u64,
    /// Sends the kernel refused (full buffer, unreachable network): recovered by retransmission.
    pub tx_errors: u64,
    /// Packets dropped by fault injection.
    pub fault_drops: u64,
}

/// An opened software RNIC port. Cloning gives another handle to the same port.
#[derive(Clone)]
pub struct Device {
    inner: DeviceImpl,
}

impl Device {
    /// Open the configured device `name`: a shared-memory device, or a software RoCEv2 device
    /// on its netdev (an error naming the entry when the netdev is missing, has no IPv4
    /// address, or port 4791 on it is taken).
    pub fn open(config: &FabricConfig, name: &str) -> Result<Device> {
        let (_, dc) = config.device(name)?;
        let inner = match dc.kind {
            DeviceKind::Shm => DeviceImpl::Shm(shm::DeviceHandle::open(config, name)?),
            DeviceKind::Roce { .. } => DeviceImpl::Roce(roce::RoceHandle::open(config, name)?),
        };
        Ok(Device { inner })
    }

    /// The backend of this device.
    pub fn kind(&self) -> &DeviceKind {
        &self.config().kind
    }

    /// The netdev a roce device sends on (`None` for shm devices).
    pub fn netdev(&self) -> Option<&str> {
        match &self.inner {
            DeviceImpl::Shm(_) => None,
            DeviceImpl::Roce(d) => Some(&d.core.netdev),
        }
    }

    /// The largest path MTU the port offers: for a roce device the netdev's MTU less 80 bytes
    /// of headers, rounded down to an IB MTU (as rxe); for shm devices, which carry no
    /// packets, 1024 (what SMC-R announces most often).
    pub fn active_mtu(&self) -> Mtu {
        match &self.inner {
            DeviceImpl::Shm(_) => Mtu::Mtu1024,
            DeviceImpl::Roce(d) => d.core.active_mtu(),
        }
    }

    /// The MTU of the netdev of a roce device.
    pub fn netdev_mtu(&self) -> Option<u32> {
        match &self.inner {
            DeviceImpl::Shm(_) => None,
            DeviceImpl::Roce(d) => {
                Some(d.core.netdev_mtu.load(std::sync::atomic::Ordering::Relaxed))
            }
        }
    }

    /// Whether this port can reach the port with GID `gid` (roce: the peer's IPv4 address is
    /// on the netdev's subnet, or its IPv6 address on the prefix of one of our IPv6 GIDs);
    /// `None` when the backend cannot tell from the GID (shm).
    pub fn reaches(&self, gid: Gid) -> Option<bool> {
        match &self.inner {
            DeviceImpl::Shm(_) => None,
            DeviceImpl::Roce(d) => Some(d.core.reaches(gid)),
        }
    }

    /// Packet counters (roce devices; `None` for shm devices, which have no packets).
    pub fn counters(&self) -> Option<DeviceCounters> {
        match &self.inner {
            DeviceImpl::Shm(_) => None,
            DeviceImpl::Roce(d) => Some(roce::snapshot(&d.core)),
        }
    }

    /// Device name, e.g. `shm0`.
    pub fn name(&self) -> &str {
        match &self.inner {
            DeviceImpl::Shm(d) => &d.core.config.name,
            DeviceImpl::Roce(d) => &d.core.config.name,
        }
    }

    /// GID of this port (unique per process and device): index 0 of [`gids`](Self::gids).
    pub fn gid(&self) -> Gid {
        match &self.inner {
            DeviceImpl::Shm(d) => d.core.gid,
            DeviceImpl::Roce(d) => d.core.gid,
        }
    }

    /// The port's GID table: a shm port has one GID; a roce port has `::ffff:a.b.c.d` of its
    /// netdev's IPv4 address first, then one GID per global or unique-local IPv6 address
    /// the netdev had when the device was opened (docs/roce.md, "IPv6 GIDs").
    pub fn gids(&self) -> Vec<Gid> {
        match &self.inner {
            DeviceImpl::Shm(d) => vec![d.core.gid],
            DeviceImpl::Roce(d) => d.core.gids.clone(),
        }
    }

    /// MAC address of this port.
    pub fn mac(&self) -> Mac {
        match &self.inner {
            DeviceImpl::Shm(d) => d.core.mac,
            DeviceImpl::Roce(d) => d.core.mac,
        }
    }

    /// Configuration of the device (netdevs and addresses it serves).
    pub fn config(&self) -> &DeviceConfig {
        match &self.inner {
            DeviceImpl::Shm(d) => &d.core.config,
            DeviceImpl::Roce(d) => &d.core.config,
        }
    }

    /// Largest SEND payload in bytes.
    pub fn max_inline(&self) -> usize {
        match &self.inner {
            DeviceImpl::Shm(_) => MAX_SEND,
            DeviceImpl::Roce(_) => roce::MAX_SEND,
        }
    }

    /// Current port state.
    pub fn port_state(&self) -> PortState {
        match &self.inner {
            DeviceImpl::Shm(d) => d.port_state(),
            DeviceImpl::Roce(d) => d.core.port_state(),
        }
    }

    /// Fault injection: bring the port down (every QP enters the error state and flushes) or up.
    pub fn set_port_state(&self, state: PortState) {
        match &self.inner {
            DeviceImpl::Shm(d) => d.set_port_state(state),
            DeviceImpl::Roce(d) => d.set_port_state(state),
        }
    }

    /// Fault injection: the next `n` send-queue work requests on this device fail with
    /// [`WcStatus::RetryExceeded`] (and move their QP to the error state).
    pub fn fail_next_work_requests(&self, n: u32) {
        match &self.inner {
            DeviceImpl::Shm(d) => {
                d.core
                    .fail_next
                    .fetch_add(n, std::sync::atomic::Ordering::AcqRel);
            }
            DeviceImpl::Roce(d) => {
                d.core
                    .fail_next
                    .fetch_add(n, std::sync::atomic::Ordering::AcqRel);
            }
        }
    }

    /// Next asynchronous event (port change, fatal QP error), if any.
    pub fn poll_event(&self) -> Option<DeviceEvent> {
        match &self.inner {
            DeviceImpl::Shm(d) => d.poll_event(),
            DeviceImpl::Roce(d) => d.core.poll_event(),
        }
    }

    /// Allocate a protection domain.
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        match &self.inner {
            DeviceImpl::Shm(d) => Ok(ProtectionDomain {
                inner: PdImpl::Shm {
                    dev: d.clone(),
                    id: d.core.alloc_pd(),
                },
            }),
            DeviceImpl::Roce(d) => Ok(ProtectionDomain {
                inner: PdImpl::Roce {
                    dev: d.clone(),
                    id: d.core.alloc_pd(),
                },
            }),
        }
    }

    /// Create a completion queue with its completion channel.
    pub fn create_cq(&self) -> Result<CompletionQueue> {
        match &self.inner {
            DeviceImpl::Shm(d) => Ok(CompletionQueue {
                inner: CqImpl::Shm(shm::CqShared::new(d.clone())?),
            }),
            DeviceImpl::Roce(d) => Ok(CompletionQueue {
                inner: CqImpl::Roce(d.clone(), Arc::new(roce::RoceCq::new()?)),
            }),
        }
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.name())
            .field("gid", &self.gid())
            .finish()
    }
}

#[derive(Clone)]
enum PdImpl {
    Shm {
        dev: Arc<shm::DeviceHandle>,
        id: u32,
    },
    Roce {
        dev: Arc<roce::RoceHandle>,
        id: u32,
    },
}

/// A protection domain: memory regions and QPs created from it belong together; a remote QP
/// reaches only regions of its peer QP's protection domain.
#[derive(Clone)]
pub struct ProtectionDomain {
    inner: PdImpl,
}

impl ProtectionDomain {
    /// Allocate and register a zeroed memory region of `len` bytes owned by the fabric.
    pub fn register(&self, len: usize, access: AccessFlags) -> Result<MemoryRegion> {
        match &self.inner {
            PdImpl::Shm { dev, id } => Ok(MemoryRegion {
                inner: MrImpl::Shm {
                    dev: dev.clone(),
                    mr: shm::MrInner::register(&dev.core, *id, len, access)?,
                },
            }),
            PdImpl::Roce { dev, id } => {
                let mr = Arc::new(roce::RoceMr::new(dev.core.alloc_key(), *id, len, access)?);
                dev.core.add_mr(mr.clone());
                Ok(MemoryRegion {
                    inner: MrImpl::Roce {
                        dev: dev.clone(),
                        mr,
                    },
                })
            }
        }
    }

    /// Register the memory of an existing region again in this protection domain (possibly of
    /// another device), with its own keys and access: the same bytes become reachable through
    /// QPs of both domains. SMC-R registers each RMB on every link of a link group this way, so
    /// that WRITEs arriving over either link (before and after a failover) land in one buffer.
    /// The region's address is the same in both registrations.
    pub fn register_alias(
        &self,
        region: &MemoryRegion,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        match (&self.inner, &region.inner) {
            (PdImpl::Shm { dev, id }, MrImpl::Shm { mr: src, .. }) => Ok(MemoryRegion {
                inner: MrImpl::Shm {
                    dev: dev.clone(),
                    mr: shm::MrInner::register_alias(&dev.core, *id, src, access)?,
                },
            }),
            (PdImpl::Roce { dev, id }, MrImpl::Roce { mr: src, .. }) => {
                let mr = Arc::new(src.alias(dev.core.alloc_key(), *id, access));
                dev.core.add_mr(mr.clone());
                Ok(MemoryRegion {
                    inner: MrImpl::Roce {
                        dev: dev.clone(),
                        mr,
                    },
                })
            }
            // Shared memory and software RoCE regions live in different kinds of memory.
            _ => Err(FabricError::Mismatch),
        }
    }

    /// Create an RC queue pair in state RESET whose send and receive work completes on the given
    /// completion queues (which must belong to the same device).
    pub fn create_qp(
        &self,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        caps: QpCaps,
    ) -> Result<QueuePair> {
        match (&self.inner, &send_cq.inner, &recv_cq.inner) {
            (PdImpl::Shm { dev, id }, CqImpl::Shm(s), CqImpl::Shm(r)) => Ok(QueuePair {
                inner: QpImpl::Shm(shm::QpShared::create(
                    dev.clone(),
                    *id,
                    s.clone(),
                    r.clone(),
                    caps,
                )?),
            }),
            (PdImpl::Roce { dev, id }, CqImpl::Roce(sd, s), CqImpl::Roce(rd, r))
                if Arc::ptr_eq(dev, sd) && Arc::ptr_eq(dev, rd) =>
            {
                Ok(QueuePair {
                    inner: QpImpl::Roce(
                        dev.clone(),
                        roce::RoceQp::create(dev.core.clone(), *id, s.clone(), r.clone(), caps)?,
                    ),
                })
            }
            _ => Err(FabricError::Mismatch),
        }
    }
}

enum MrImpl {
    Shm {
        dev: Arc<shm::DeviceHandle>,
        mr: Arc<shm::MrInner>,
    },
    Roce {
        dev: Arc<roce::RoceHandle>,
        mr: Arc<roce::RoceMr>,
    },
}

/// A registered memory region. Dropping it deregisters it: remote WRITEs with its rkey then
/// fail with [`WcStatus::RemoteAccessError`].
///
/// The memory may be written by the peer at any time (when registered with remote write), so
/// this type never hands out Rust references to it: use [`read_at`](Self::read_at),
/// [`write_at`](Self::write_at) or the raw [`as_ptr`](Self::as_ptr).
pub struct MemoryRegion {
    inner: MrImpl,
}

impl MemoryRegion {
    /// Local key (names the region in local [`Sge`]s).
    pub fn lkey(&self) -> u32 {
        match &self.inner {
            MrImpl::Shm { mr, .. } => mr.key,
            MrImpl::Roce { mr, .. } => mr.key,
        }
    }
    /// Remote key (names the region in remote WRITEs; SMC-R sends it in CLC/LLC).
    pub fn rkey(&self) -> u32 {
        match &self.inner {
            MrImpl::Shm { mr, .. } => mr.key,
            MrImpl::Roce { mr, .. } => mr.key,
        }
    }
    /// Virtual address of the first byte (the base of remote addresses and SGE addresses).
    pub fn addr(&self) -> u64 {
        match &self.inner {
            MrImpl::Shm { mr, .. } => mr.vaddr(),
            MrImpl::Roce { mr, .. } => mr.vaddr(),
        }
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match &self.inner {
            MrImpl::Shm { mr, .. } => mr.len(),
            MrImpl::Roce { mr, .. } => mr.len(),
        }
    }
    /// Whether the region is empty (never true: regions have at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Access flags.
    pub fn access(&self) -> AccessFlags {
        match &self.inner {
            MrImpl::Shm { mr, .. } => mr.access,
            MrImpl::Roce { mr, .. } => mr.access,
        }
    }
    /// Raw pointer to the first byte (valid while the region lives). Access it only with raw
    /// copies or atomics: a peer may write it concurrently.
    pub fn as_ptr(&self) -> *mut u8 {
        match &self.inner {
            MrImpl::Shm { mr, .. } => mr.mapping.ptr(),
            MrImpl::Roce { mr, .. } => mr.ptr(),
        }
    }
    /// An SGE for `len` bytes at byte `offset` of this region (bounds checked).
    pub fn sge(&self, offset: usize, len: u32) -> Result<Sge> {
        let end = offset
            .checked_add(len as usize)
            .ok_or(FabricError::LocalAccess)?;
        if end > self.len() {
            return Err(FabricError::LocalAccess);
        }
        Ok(Sge {
            addr: self.addr() + offset as u64,
            length: len,
            lkey: self.lkey(),
        })
    }
    /// A hint to fetch the cache lines of the `len` bytes at `offset` of the region (at most
    /// [`PrefetchHint::MAX_LINES`] of them, none past its end; `None` when `offset` is past
    /// it), to be issued when the bytes are about to be read: a reader that learns from a
    /// completion that a peer wrote there can start the lines' transfer from the writer's
    /// cache while it handles the completion, instead of waiting for them at the copy.
    pub fn prefetch_hint(&self, offset: usize, len: usize) -> Option<PrefetchHint> {
        match &self.inner {
            MrImpl::Shm { mr, .. } => mr.prefetch_hint(offset, len),
            MrImpl::Roce { mr, .. } => mr.prefetch_hint(offset, len),
        }
    }
    /// Copy bytes out of the region starting at `offset`.
    pub fn read_at(&self, offset: usize, buf: &mut [u8]) -> Result<()> {
        match &self.inner {
            MrImpl::Shm { mr, .. } => mr.read_at(offset, buf),
            MrImpl::Roce { mr, .. } => mr.read_at(offset, buf),
        }
    }
    /// Copy bytes into the region starting at `offset`.
    pub fn write_at(&self, offset: usize, buf: &[u8]) -> Result<()> {
        match &self.inner {
            MrImpl::Shm { mr, .. } => mr.write_at(offset, buf),
            MrImpl::Roce { mr, .. } => mr.write_at(offset, buf),
        }
    }
    /// Deregister now (same as dropping).
    pub fn deregister(self) {}
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        match &self.inner {
            MrImpl::Shm { dev, mr } => mr.deregister(&dev.core),
            MrImpl::Roce { dev, mr } => dev.core.remove_mr(mr.key),
        }
    }
}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("rkey", &self.rkey())
            .field("addr", &self.addr())
            .field("len", &self.len())
            .field("access", &self.access())
            .finish()
    }
}

#[derive(Clone)]
enum CqImpl {
    Shm(Arc<shm::CqShared>),
    Roce(Arc<roce::RoceHandle>, Arc<roce::RoceCq>),
}

/// Where to start fetching a cache line ahead of a read (see
/// [`MemoryRegion::prefetch_hint`]). Issuing it is always harmless: a prefetch never faults,
/// even after the region is gone, and changes nothing but what the cache holds.
#[derive(Debug, Clone, Copy)]
pub struct PrefetchHint {
    /// Address of the first line.
    pub(crate) addr: usize,
    /// Lines from there on (1 to [`MAX_LINES`](Self::MAX_LINES)).
    pub(crate) lines: u8,
}

impl PrefetchHint {
    /// Most lines one hint fetches (a longer read streams well enough once started).
    pub const MAX_LINES: usize = 4;

    /// How many lines [`issue`](Self::issue) fetches.
    pub fn lines(&self) -> usize {
        usize::from(self.lines)
    }

    /// Start fetching the lines into this core's cache (returns at once).
    #[inline]
    pub fn issue(self) {
        for i in 0..usize::from(self.lines) {
            shm::prefetch(self.addr + i * shm::LINE);
        }
    }
}

/// See [`CompletionQueue::receive_wait`]; dropping it ends the promise.
pub struct ReceiveWait<'a>(roce::ReceiveWait<'a>);

impl<'a> ReceiveWait<'a> {
    /// Readable when there is something to [`receive`](Self::receive).
    pub fn fd(&self) -> BorrowedFd<'a> {
        self.0.fd()
    }

    /// Receive what is waiting (completions land in their queues); returns how many
    /// datagrams were received.
    pub fn receive(&self) -> usize {
        self.0.receive()
    }

    /// Receive what is waiting without sleeping (nothing when another thread of the process
    /// is receiving on the device now); returns how many datagrams. For a thread that spins
    /// on the queue instead of sleeping: the device's own thread leaves the socket to whoever
    /// holds this promise, so the spinner must receive.
    pub fn try_receive(&self) -> usize {
        self.0.try_receive()
    }

    /// Longest one [`block`](Self::block) sleeps.
    pub const BLOCK: Duration = roce::BLOCK;

    /// Sleep in the device socket's receive call itself (no `poll` first: one system call
    /// per wake-up instead of two) for up to [`BLOCK`](Self::BLOCK), receiving what arrives.
    /// For a thread that has armed this queue's channel and waits on nothing else. `Some(n)`:
    /// poll the queue now (n datagrams were received; 0 when completions were queued
    /// already). `None`: nothing arrived, or the device cannot sleep on one socket (it has
    /// IPv6 GIDs); sleep on [`fd`](Self::fd) and the queue's channel instead, as before. A
    /// completion that another thread queues while this one sleeps here is seen at the
    /// latest when the sleep ends.
    pub fn block(&self) -> Option<usize> {
        self.0.block()
    }
}

/// A completion queue with a completion channel.
///
/// Busy polling: call [`poll`](Self::poll) in a loop (no system call while peers are active).
/// Blocking: [`wait`](Self::wait). Event loops (epoll, tokio `AsyncFd`): watch
/// [`fd`](Self::fd) for readability, and per wake-up call [`ack_notify`](Self::ack_notify),
/// drain with `poll`, then [`req_notify`](Self::req_notify) and `poll` once more before waiting
/// again (the usual verbs arm-then-recheck pattern).
#[derive(Clone)]
pub struct CompletionQueue {
    inner: CqImpl,
}

impl CompletionQueue {
    /// Poll up to `out.len()` completions without blocking; returns how many were written.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> usize {
        match &self.inner {
            CqImpl::Shm(c) => c.poll(out),
            CqImpl::Roce(_, c) => c.poll(out),
        }
    }

    /// Whether [`poll`](Self::poll) may find a completion now, without taking the queue's
    /// locks or moving anything (for a poller that spins): `false` means nothing that had
    /// happened before the call is waiting.
    pub fn maybe_ready(&self) -> bool {
        match &self.inner {
            CqImpl::Shm(c) => c.maybe_ready(),
            CqImpl::Roce(_, c) => c.maybe_ready(),
        }
    }

    /// For a thread about to sleep on [`fd`](Self::fd): on a software RoCE device, a promise
    /// to receive on the device's socket itself — sleep on [`ReceiveWait::fd`] as well and
    /// call [`ReceiveWait::receive`] when it is readable; the device's own thread leaves the
    /// socket to it meanwhile (one wake-up on a reply's path instead of two). `None` on the
    /// shm fabric, whose peers fill the queues themselves.
    pub fn receive_wait(&self) -> Option<ReceiveWait<'_>> {
        match &self.inner {
            CqImpl::Shm(_) => None,
            CqImpl::Roce(d, c) => Some(ReceiveWait(roce::ReceiveWait::new(&d.core, c))),
        }
    }

    /// On a software RoCE device: receive what waits on the device's socket now, in this
    /// thread (completions land in their queues; poll them next); returns how many datagrams.
    /// For a thread that must see what the fabric brought before it acts on news from
    /// elsewhere (a TCP reset that may have overtaken the peer's last messages). 0 on the shm
    /// fabric, whose peers fill the queues themselves.
    pub fn receive_now(&self) -> usize {
        match &self.inner {
            CqImpl::Shm(_) => 0,
            CqImpl::Roce(d, _) => roce::receive_now(&d.core),
        }
    }

    /// Whether completions reach this queue only when some thread receives them on the
    /// device's behalf (software RoCE: datagrams on a socket, which the device's thread leaves
    /// to a thread sleeping in [`receive_wait`](Self::receive_wait)), so that spinning on
    /// [`poll`](Self::poll) in place of sleeping there only delays them. `false` on the shm
    /// fabric, whose peers fill the queues themselves.
    pub fn needs_receiver(&self) -> bool {
        matches!(self.inner, CqImpl::Roce(..))
    }

    /// Spin on [`poll`](Self::poll) for up to `spins` iterations; returns on the first completion.
    pub fn poll_busy(&self, out: &mut [WorkCompletion], spins: u64) -> usize {
        for _ in 0..spins {
            let n = self.poll(out);
            if n > 0 {
                return n;
            }
            std::hint::spin_loop();
        }
        0
    }

    /// Block until at least one completion arrives or `timeout` elapses (`Ok(0)`).
    pub fn wait(&self, out: &mut [WorkCompletion], timeout: Option<Duration>) -> Result<usize> {
        match &self.inner {
            CqImpl::Shm(c) => c.wait(out, timeout),
            CqImpl::Roce(_, c) => c.wait(out, timeout),
        }
    }

    /// For a poller that spins on this queue: publish `word` (zero: not spinning; otherwise
    /// the caller's meaning) to the peers whose SENDs complete here, and hand each peer's
    /// word to `peer`. On the shm fabric the words live in the ring headers both processes
    /// map (a peer that never publishes reads as zero); a software RoCE peer has none (no
    /// call to `peer`). Cheap enough for every round of a spin (a few loads and stores).
    pub fn spin_words(&self, word: u64, peer: &mut dyn FnMut(u64)) {
        match &self.inner {
            CqImpl::Shm(c) => c.spin_words(word, peer),
            CqImpl::Roce(..) => {}
        }
    }

    /// Arm the completion channel: [`fd`](Self::fd) becomes readable at the next completion.
    pub fn req_notify(&self) {
        match &self.inner {
            CqImpl::Shm(c) => c.req_notify(),
            CqImpl::Roce(_, c) => c.req_notify(),
        }
    }

    /// Consume the channel's readiness after [`fd`](Self::fd) was reported readable. As with a
    /// verbs CQ, this also disarms the channel (completions and peer SENDs that arrive while
    /// the consumer is awake ring no doorbell): call [`req_notify`](Self::req_notify) and poll
    /// once more before waiting again.
    pub fn ack_notify(&self) {
        match &self.inner {
            CqImpl::Shm(c) => c.ack_notify(),
            CqImpl::Roce(_, c) => c.ack_notify(),
        }
    }

    /// The completion channel (a pollable fd, readable when armed and a completion arrived),
    /// for poll/epoll or tokio `AsyncFd`.
    pub fn fd(&self) -> BorrowedFd<'_> {
        match &self.inner {
            CqImpl::Shm(c) => c.channel(),
            CqImpl::Roce(_, c) => c.channel(),
        }
    }
}

enum QpImpl {
    Shm(Arc<shm::QpShared>),
    /// The device handle keeps the device's progress thread alive as long as the QP.
    Roce(#[allow(dead_code)] Arc<roce::RoceHandle>, Arc<roce::RoceQp>),
}

/// A reliably connected queue pair. Dropping it destroys it (the peer's QP enters the error
/// state).
pub struct QueuePair {
    inner: QpImpl,
}

impl QueuePair {
    /// QP number (24 bits).
    pub fn qp_num(&self) -> u32 {
        match &self.inner {
            QpImpl::Shm(q) => q.qpn,
            QpImpl::Roce(_, q) => q.qpn,
        }
    }
    /// Current state.
    pub fn state(&self) -> QpState {
        match &self.inner {
            QpImpl::Shm(q) => q.state(),
            QpImpl::Roce(_, q) => q.state(),
        }
    }
    /// What the peer needs to connect to this QP (GID, QPN, PSN, MTU).
    pub fn local_info(&self) -> LocalQpInfo {
        match &self.inner {
            QpImpl::Shm(q) => q.local_info(),
            QpImpl::Roce(_, q) => q.local_info(),
        }
    }
    /// The remote QP given at RTR, if any.
    pub fn remote_info(&self) -> Option<RemoteQpInfo> {
        match &self.inner {
            QpImpl::Shm(q) => q.remote_info(),
            QpImpl::Roce(_, q) => q.remote_info(),
        }
    }
    /// RESET → INIT (receives may be posted from now on).
    pub fn to_init(&self) -> Result<()> {
        match &self.inner {
            QpImpl::Shm(q) => q.to_init(),
            QpImpl::Roce(_, q) => q.to_init(),
        }
    }
    /// INIT → RTR with the remote QP learnt from the peer. The shm backend connects to the
    /// remote device here; an unreachable peer is an error and the QP stays in INIT.
    pub fn to_rtr(&self, remote: RemoteQpInfo) -> Result<()> {
        match &self.inner {
            QpImpl::Shm(q) => q.to_rtr(remote),
            QpImpl::Roce(_, q) => q.to_rtr(None, remote),
        }
    }
    /// [`to_rtr`](Self::to_rtr) from our GID `local`, one of [`Device::gids`] (the verbs
    /// address vector's source GID index): a roce device sends from and receives on that
    /// GID's address. An error when `local` is not the device's, or is of another IP version
    /// than the peer's GID. The shm backend has one GID per port and ignores it.
    pub fn to_rtr_from(&self, local: Gid, remote: RemoteQpInfo) -> Result<()> {
        match &self.inner {
            QpImpl::Shm(q) => q.to_rtr(remote),
            QpImpl::Roce(_, q) => q.to_rtr(Some(local), remote),
        }
    }
    /// RTR → RTS (sends may be posted from now on).
    pub fn to_rts(&self) -> Result<()> {
        match &self.inner {
            QpImpl::Shm(q) => q.to_rts(),
            QpImpl::Roce(_, q) => q.to_rts(),
        }
    }
    /// Fault injection / teardown: move to ERROR, flushing outstanding work.
    pub fn force_error(&self) {
        match &self.inner {
            QpImpl::Shm(q) => q.enter_error("forced"),
            QpImpl::Roce(_, q) => q.enter_error(None, "forced"),
        }
    }
    /// Post a send-queue work request (SEND, RDMA WRITE).
    pub fn post_send(&self, wr: &SendWr<'_>) -> Result<()> {
        self.post_send_status(wr).map(|_| ())
    }
    /// Post a send-queue work request and say whether it was executed at once: an RDMA WRITE
    /// that reports [`PostStatus::Executed`] has placed its bytes in the peer's memory before
    /// this returns (the shm backend executes WRITEs at post unless SENDs before them wait for
    /// room in the peer's ring), so the caller need not keep a copy for a retransmission.
    pub fn post_send_status(&self, wr: &SendWr<'_>) -> Result<PostStatus> {
        match &self.inner {
            QpImpl::Shm(q) => q.post_send(wr),
            QpImpl::Roce(_, q) => q.post_send(wr),
        }
    }
    /// Post a send-queue work request whose transmission may wait for the doorbell: the
    /// next [`QueuePair::post_send`] on this QP, [`QueuePair::doorbell`], or at the latest a
    /// few milliseconds (the roce device's progress tick). Ringing once for several posts
    /// lets their packets leave in one system call, and an unsignaled WRITE so followed by a
    /// SEND needs no acknowledgement of its own (a packed WRITE,
    /// [`QueuePair::post_write_packed_held`], asks for some at post). The caller should ring (post or doorbell)
    /// when its batch is complete. The shm backend executes at once, as `post_send_status`.
    pub fn post_send_held(&self, wr: &SendWr<'_>) -> Result<PostStatus> {
        match &self.inner {
            QpImpl::Shm(q) => q.post_send(wr),
            QpImpl::Roce(_, q) => q.post_send_held(wr),
        }
    }
    /// Make the peer's memory region `rkey` writable from this QP now, with whatever local
    /// resources that takes, so that a later RDMA WRITE to it needs none: the shm backend
    /// maps the region (its memfd comes over the QP's control connection and takes a
    /// descriptor until it is mapped), as the first WRITE to it would; a RoCE RNIC resolves
    /// an rkey at the peer and needs nothing here. An error when the region cannot be had:
    /// no descriptor or address space left ([`FabricError::RemoteRegion`]), the peer does
    /// not grant it, or the QP is not ready to send.
    pub fn map_remote(&self, rkey: u32) -> Result<()> {
        match &self.inner {
            QpImpl::Shm(q) => q.map_remote(rkey),
            QpImpl::Roce(..) => Ok(()),
        }
    }
    /// A handle that places this QP's unsignaled RDMA WRITEs with the copy outside its send
    /// queue's lock, usable without a reference to the QP (see [`WritePlacer`]); `None` on a
    /// backend whose WRITEs do not execute at post (software RoCE).
    pub fn placer(&self) -> Option<WritePlacer> {
        match &self.inner {
            QpImpl::Shm(q) => Some(WritePlacer { qp: q.clone() }),
            QpImpl::Roce(..) => None,
        }
    }
    /// Whether this QP keeps the bytes of a posted WRITE until the peer acknowledges them
    /// (software RoCE: for retransmission): then a [`SendWr::WriteShared`] is kept by
    /// reference, where any other WRITE is copied into its packets, so a caller that keeps
    /// the bytes itself (SMC-R's replay store) saves a copy by posting shared bytes. `false`
    /// where WRITEs place their bytes at post (shm), which copies shared bytes as inline ones.
    pub fn keeps_write_bytes(&self) -> bool {
        match &self.inner {
            QpImpl::Shm(_) => false,
            QpImpl::Roce(..) => true,
        }
    }
    /// The shortest RDMA WRITE (bytes) that can leave in one datagram with a SEND of
    /// `send_len` bytes posted behind it; 0 where any can (shm). On the roce backend a WRITE
    /// and the SEND behind it share a `UDP_SEGMENT` run only when the SEND's packet is not
    /// longer than the WRITE's (only the last packet of a run may be shorter), so a WRITE of
    /// fewer bytes than this leaves in a datagram of its own, and the peer's receiver may be
    /// woken twice for one update. A caller that owns free space behind a short WRITE's
    /// target may widen the WRITE to this length.
    pub fn shortest_shared_write(&self, send_len: usize) -> usize {
        match &self.inner {
            QpImpl::Shm(_) => 0,
            QpImpl::Roce(..) => roce::shortest_shared_write(send_len),
        }
    }
    /// The shortest WRITE worth posting packed ([`QueuePair::post_write_packed_held`]): one of
    /// more than a path MTU (several packets, which leave as runs from one buffer); a WRITE of
    /// one packet gains nothing from it and costs an allocation or two. `usize::MAX` where
    /// WRITEs are not packed (shm) or the QP is not connected.
    pub fn packs_writes_from(&self) -> usize {
        match &self.inner {
            QpImpl::Shm(_) => usize::MAX,
            QpImpl::Roce(_, q) => q.packs_writes_from(),
        }
    }
    /// Post an unsignaled RDMA WRITE of `data` held as [`QueuePair::post_send_held`] does, on
    /// a backend that keeps a WRITE's bytes ([`QueuePair::keeps_write_bytes`]): its packets
    /// are built end to end in one buffer (the one copy of the bytes), sealed for the place
    /// each takes in the datagrams that carry them, and sent from it as they are; the buffer
    /// is returned for the caller to keep (no copy of its own for replay). `None` when the
    /// QP is in error (the request completes flushed, as any post does then).
    /// [`FabricError::InvalidArgument`] on a backend that places WRITEs at post (shm).
    pub fn post_write_packed_held(
        &self,
        wr_id: u64,
        data: &[u8],
        remote_addr: u64,
        rkey: u32,
    ) -> Result<Option<PackedBytes>> {
        match &self.inner {
            QpImpl::Shm(_) => Err(FabricError::InvalidArgument(
                "packed WRITEs are posted on software RoCE only",
            )),
            QpImpl::Roce(_, q) => q.post_write_packed(wr_id, data, remote_addr, rkey),
        }
    }
    /// Transmit what [`QueuePair::post_send_held`] left waiting (nothing to do if nothing
    /// waits).
    pub fn doorbell(&self) {
        match &self.inner {
            QpImpl::Shm(_) => {}
            QpImpl::Roce(_, q) => q.doorbell(),
        }
    }
    /// [`QueuePair::doorbell`] for WRITEs whose announcement (the CDC) is not posted yet:
    /// software RoCE keeps back a last run of packets that does not fill its datagram, for
    /// the next packed WRITE to continue it (it leaves with the next post that rings, the
    /// next doorbell, or at the latest a few milliseconds later from the device's progress
    /// thread). The shm backend has nothing waiting.
    pub fn doorbell_runs(&self) {
        match &self.inner {
            QpImpl::Shm(_) => {}
            QpImpl::Roce(_, q) => q.doorbell_runs(),
        }
    }
    /// Post a receive buffer for one incoming SEND.
    pub fn post_recv(&self, wr: &RecvWr) -> Result<()> {
        match &self.inner {
            QpImpl::Shm(q) => q.post_recv(wr),
            QpImpl::Roce(_, q) => q.post_recv(wr),
        }
    }
}

/// Places the bytes of unsignaled RDMA WRITEs of one QP (shm backend) with the copy outside
/// the QP's send lock, so that WRITEs of many connections over one link copy at the same
/// time (a post copies under the lock). What [`place`](Self::place) placed counts as a WRITE
/// executed at post (it needs no completion); the caller orders it before the SEND that
/// announces it by posting that SEND afterwards from the same thread. Holding a placer keeps
/// no QP alive: once the QP is destroyed, nothing is placed.
#[derive(Clone)]
pub struct WritePlacer {
    qp: Arc<shm::QpShared>,
}

impl WritePlacer {
    /// Place `data` at `remote_addr` of the peer's region `rkey` now. `true`: done; `false`:
    /// nothing was done (not ready, work queued before it, the region not yet known to this
    /// QP, a fault being injected, or out of bounds): post the WRITE instead, which reports
    /// any failure.
    pub fn place(&self, data: &[u8], remote_addr: u64, rkey: u32) -> bool {
        self.qp.place_unlocked(data, remote_addr, rkey)
    }
}

impl std::fmt::Debug for WritePlacer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WritePlacer")
            .field("qpn", &self.qp.qpn)
            .finish()
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        match &self.inner {
            QpImpl::Shm(q) => q.destroy(),
            QpImpl::Roce(_, q) => q.destroy(),
        }
    }
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("qp_num", &self.qp_num())
            .field("state", &self.state())
            .finish()
    }
}
