//! Device (software RNIC port) state shared by all objects of one opened device.

use super::control::{self, Watch};
use super::mem;
use super::mr::MrInner;
use super::qp::QpShared;
use crate::config::{DeviceConfig, FabricConfig, Fault};
use crate::error::{FabricError, Result};
use crate::types::{DeviceEvent, Gid, Mac, PortState};
use rustix::fd::OwnedFd;
// Looked up per work request (lkeys): foldhash, not SipHash.
use foldhash::{HashMap, HashMapExt as _};
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::thread::{JoinHandle, ThreadId};

/// Lock a mutex, recovering the data if another thread panicked while holding it (the fabric's
/// invariants are re-validated on every use, so a poisoned lock is not a reason to fail).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Tables and identity of one opened device, shared with its control thread.
pub(crate) struct DeviceCore {
    pub(crate) config: DeviceConfig,
    pub(crate) fabric: FabricConfig,
    pub(crate) gid: Gid,
    pub(crate) mac: Mac,
    pub(crate) dev_dir: PathBuf,
    pub(crate) sock_path: PathBuf,
    pub(crate) port_up: AtomicBool,
    pub(crate) fail_next: AtomicU32,
    pub(crate) qps: Mutex<HashMap<u32, Weak<QpShared>>>,
    pub(crate) mrs: Mutex<HashMap<u32, Arc<MrInner>>>,
    next_qpn: AtomicU32,
    next_key: AtomicU32,
    next_pd: AtomicU32,
    events: Mutex<VecDeque<DeviceEvent>>,
    /// New sockets for the control thread to watch.
    pub(crate) inbox: Mutex<Vec<Watch>>,
    /// Wakes the control thread (new watches, QP errors, shutdown).
    pub(crate) wake: OwnedFd,
    pub(crate) shutdown: AtomicBool,
}

impl DeviceCore {
    /// Queue an asynchronous event (bounded: the oldest events are dropped beyond 1024).
    pub(crate) fn push_event(&self, ev: DeviceEvent) {
        let mut q = lock(&self.events);
        if q.len() >= 1024 {
            q.pop_front();
        }
        q.push_back(ev);
    }

    pub(crate) fn wake_control(&self) {
        mem::ring_eventfd(wire_b(&self.wake));
    }

    /// Consume one "fail the next work request" token, if any is left.
    pub(crate) fn take_fail_token(&self) -> bool {
        self.fail_next.load(Ordering::Relaxed) > 0
            && self
                .fail_next
                .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok()
    }

    pub(crate) fn alloc_qpn(&self) -> u32 {
        let qps = lock(&self.qps);
        loop {
            let n = self.next_qpn.fetch_add(1, Ordering::Relaxed) & 0x00ff_ffff;
            if n != 0 && !qps.contains_key(&n) {
                return n;
            }
        }
    }

    pub(crate) fn alloc_key(&self) -> u32 {
        let mrs = lock(&self.mrs);
        loop {
            let n = self.next_key.fetch_add(0x101, Ordering::Relaxed);
            if n != 0 && !mrs.contains_key(&n) {
                return n;
            }
        }
    }

    pub(crate) fn alloc_pd(&self) -> u32 {
        self.next_pd.fetch_add(1, Ordering::Relaxed)
    }

    /// Live QPs of this device.
    pub(crate) fn live_qps(&self) -> Vec<Arc<QpShared>> {
        lock(&self.qps).values().filter_map(Weak::upgrade).collect()
    }
}

fn wire_b(fd: &OwnedFd) -> rustix::fd::BorrowedFd<'_> {
    use rustix::fd::AsFd;
    fd.as_fd()
}

/// An opened device: owns the control thread; every PD, CQ and QP keeps it alive.
pub(crate) struct DeviceHandle {
    pub(crate) core: Arc<DeviceCore>,
    thread: Mutex<Option<JoinHandle<()>>>,
    thread_id: ThreadId,
}

impl DeviceHandle {
    /// Open device `name` of `fabric`: create the GID, the listening socket and the control thread.
    pub(crate) fn open(fabric: &FabricConfig, name: &str) -> Result<Arc<DeviceHandle>> {
        let (index, config) = fabric.device(name)?;
        let dev_dir = fabric.dir.join(name);
        create_private_dir(&fabric.dir)?;
        create_private_dir(&dev_dir)?;
        sweep_stale_sockets(&dev_dir);
        let rnd: [u8; 16] = mem::random_bytes();
        let mut gid = [0u8; 16];
        gid[0] = 0xfe;
        gid[1] = 0x80;
        gid[8..12].copy_from_slice(&std::process::id().to_be_bytes());
        gid[12..15].copy_from_slice(&rnd[0..3]);
        gid[15] = index as u8;
        let gid = Gid(gid);
        let mut mac = [0u8; 6];
        mac[0] = 0x02;
        mac[1..].copy_from_slice(&rnd[3..8]);
        let sock_path = dev_dir.join(format!("{}.sock", gid.to_hex()));
        let listener = control::listen(&sock_path)?;
        let wake = mem::new_eventfd()?;
        let qpn_seed = u32::from_le_bytes([rnd[8], rnd[9], rnd[10], 0]);
        let key_seed = u32::from_le_bytes([rnd[11], rnd[12], rnd[13], rnd[14]]);
        let core = Arc::new(DeviceCore {
            config: config.clone(),
            fabric: fabric.clone(),
            gid,
            mac: Mac(mac),
            dev_dir,
            sock_path: sock_path.clone(),
            port_up: AtomicBool::new(true),
            fail_next: AtomicU32::new(0),
            qps: Mutex::new(HashMap::new()),
            mrs: Mutex::new(HashMap::new()),
            next_qpn: AtomicU32::new(qpn_seed),
            next_key: AtomicU32::new(key_seed),
            next_pd: AtomicU32::new(1),
            events: Mutex::new(VecDeque::new()),
            inbox: Mutex::new(Vec::new()),
            wake,
            shutdown: AtomicBool::new(false),
        });
        for (dev, fault) in &fabric.faults {
            if dev == name {
                match fault {
                    Fault::PortDown => core.port_up.store(false, Ordering::Release),
                    Fault::FailNext(n) => {
                        core.fail_next.fetch_add(*n, Ordering::AcqRel);
                    }
                    // Packet faults concern the roce backend's wire; the shm fabric has none.
                    _ => {}
                }
            }
        }
        let c2 = core.clone();
        let thread = crate::threads::spawn_running(
            std::thread::Builder::new().name(format!("smc-fabric-{name}")),
            move || control::run(c2, listener),
        )
        .map_err(|e| {
            let _ = std::fs::remove_file(&sock_path);
            FabricError::os("spawn control thread", e)
        })?;
        let thread_id = thread.thread().id();
        tracing::debug!(device = name, gid = %gid, "shm device opened");
        Ok(Arc::new(DeviceHandle {
            core,
            thread: Mutex::new(Some(thread)),
            thread_id,
        }))
    }

    pub(crate) fn port_state(&self) -> PortState {
        if self.core.port_up.load(Ordering::Acquire) {
            PortState::Active
        } else {
            PortState::Down
        }
    }

    /// Fault injection: set the port state. Down moves every QP of the device to the error state.
    pub(crate) fn set_port_state(&self, state: PortState) {
        match state {
            PortState::Active => {
                if !self.core.port_up.swap(true, Ordering::AcqRel) {
                    self.core.push_event(DeviceEvent::PortActive);
                }
            }
            PortState::Down => {
                if self.core.port_up.swap(false, Ordering::AcqRel) {
                    self.core.push_event(DeviceEvent::PortDown);
                }
                for qp in self.core.live_qps() {
                    qp.enter_error("port down");
                }
            }
        }
    }

    pub(crate) fn poll_event(&self) -> Option<DeviceEvent> {
        lock(&self.core.events).pop_front()
    }
}

impl Drop for DeviceHandle {
    fn drop(&mut self) {
        self.core.shutdown.store(true, Ordering::Release);
        self.core.wake_control();
        let handle = lock(&self.thread).take();
        if let Some(h) = handle {
            if std::thread::current().id() != self.thread_id {
                let _ = h.join();
            }
        }
        let _ = std::fs::remove_file(&self.core.sock_path);
    }
}

fn create_private_dir(dir: &std::path::Path) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .mode(0o700)
        .recursive(true)
        .create(dir)
        .map_err(|e| FabricError::os("create fabric directory", e))?;
    // The directory may have existed before (e.g. planted in /tmp by another user): only use
    // it if we (or root) own it and nobody else can add sockets to it, except the users its
    // owner granted it to (`crate::access`).
    match crate::access::untrusted_dir(dir) {
        Ok(None) => Ok(()),
        Ok(Some(why)) => Err(FabricError::UntrustedDirectory {
            path: dir.to_owned(),
            why,
        }),
        Err(e) => Err(FabricError::os("stat fabric directory", e)),
    }
}

/// Remove sockets left behind by processes that died without cleaning up (the GID embeds the
/// owner's pid in bytes 8..12).
fn sweep_stale_sockets(dir: &std::path::Path) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in rd.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(hex) = name.strip_suffix(".sock") else {
            continue;
        };
        if hex.len() != 32 {
            continue;
        }
        let Ok(pid) = u32::from_str_radix(&hex[16..24], 16) else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}
