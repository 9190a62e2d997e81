//! What the library knows about a program's file descriptors: nothing for almost all of
//! them (a relaxed load of one byte tells), an [`Entry`] for the TCP sockets it manages and
//! the epoll instances that watch SMC-R connections.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU8, Ordering};
use std::sync::Arc;

use smc::fdapi::{Conn, Listening, TcpConn};

use crate::wait::EpollSet;

/// Descriptors at or above this number are never managed (their calls pass through).
pub(crate) const MAX_FD: usize = 1 << 16;

/// Per descriptor number: 1 when the map may hold an entry for it.
static MAYBE: [AtomicU8; MAX_FD] = [const { AtomicU8::new(0) }; MAX_FD];

/// Whether any entry was ever made (the pass-through paths of poll and select look no
/// further while none was).
pub(crate) static ANY: AtomicBool = AtomicBool::new(false);

/// This process's id (updated in a forked child).
pub(crate) static PID: AtomicI32 = AtomicI32::new(0);

/// Whether the calling thread runs in a process that shares this library's memory without
/// being the process it belongs to: the child of a `vfork` (or a `clone` with shared memory,
/// as `posix_spawn` and Python's subprocess make) between its start and its exec, in which
/// no fork handler ran. Its closes and dups must not change the table, which is its
/// parent's.
///
/// A process made by a raw `clone` without `CLONE_VM` (vsftpd's session processes) has its
/// own memory but ran no fork handler either: it is told from a `vfork` child by the page
/// [`fork_probe_init`] marked `MADV_WIPEONFORK` (zero in a child with copied memory, still
/// marked in one that shares it), and made a forked child here (its own id, the parent's
/// stack forgotten), as the fork handlers would have.
pub(crate) fn borrowed_memory() -> bool {
    // SAFETY: getpid has no preconditions (the system call: no cached value).
    let pid = unsafe { libc::syscall(libc::SYS_getpid) } as i32;
    if pid == PID.load(Ordering::Relaxed) {
        return false;
    }
    let probe = PROBE.load(Ordering::Relaxed);
    if probe.is_null() {
        return true;
    }
    // SAFETY: the probe page mapped at load, never unmapped.
    let wiped = unsafe { std::ptr::read_volatile(probe) } == 0;
    if !wiped {
        return true;
    }
    smc_fabric::fdplace::fork_child();
    let forgot = smc::fdapi::forked_without_handlers();
    RAW_CLONED.store(true, Ordering::Relaxed);
    PID.store(pid, Ordering::Relaxed);
    // SAFETY: as above.
    unsafe { std::ptr::write_volatile(probe, 1) };
    crate::log!("a process cloned without fork handlers: its own table from here (stack forgotten: {forgot})");
    false
}

/// Whether this process, or one it was copied from, was made by a raw `clone` without
/// `CLONE_VM` (seen by [`borrowed_memory`]).
pub(crate) static RAW_CLONED: AtomicBool = AtomicBool::new(false);

/// The flags of the raw `clone` system call (through `syscall(2)`) that made this process,
/// 0 if none did (or it was made by the C library's `clone()`, which the library does not
/// see).
pub(crate) static RAW_CLONE_FLAGS: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(0);

/// Whether this process was made by a raw clone into new namespaces: a sandbox (vsftpd's
/// session processes), whose own children, cloned the same way into yet other namespaces
/// with no descriptors to spare, could not reach a relay for a connection it owned.
pub(crate) fn sandboxed_clone() -> bool {
    const NAMESPACES: u64 = (libc::CLONE_NEWNET
        | libc::CLONE_NEWPID
        | libc::CLONE_NEWIPC
        | libc::CLONE_NEWNS
        | libc::CLONE_NEWUSER
        | libc::CLONE_NEWUTS
        | libc::CLONE_NEWCGROUP) as u64;
    RAW_CLONED.load(Ordering::Relaxed) && RAW_CLONE_FLAGS.load(Ordering::Relaxed) & NAMESPACES != 0
}

/// A page whose first byte is 1 in the process that mapped it and 0 in a child with a copy
/// of its memory (`MADV_WIPEONFORK`, Linux 4.14).
static PROBE: std::sync::atomic::AtomicPtr<u8> =
    std::sync::atomic::AtomicPtr::new(std::ptr::null_mut());

/// Map the probe page of [`borrowed_memory`] (in the library's constructor).
pub(crate) fn fork_probe_init() {
    // SAFETY: an anonymous private page of our own.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if p == libc::MAP_FAILED {
            return;
        }
        if libc::madvise(p, 4096, libc::MADV_WIPEONFORK) != 0 {
            libc::munmap(p, 4096);
            return;
        }
        let p = p.cast::<u8>();
        std::ptr::write_volatile(p, 1);
        PROBE.store(p, Ordering::Relaxed);
    }
}

/// What a managed descriptor is.
#[derive(Debug)]
pub(crate) enum Kind {
    /// A listening socket whose port discovery knows.
    Listener(Listening),
    /// An accepted connection whose client offered SMC-R; the server rendezvous runs when
    /// the program first uses it (in whichever process that is; the lock is held while it
    /// runs).
    Pending(std::sync::Mutex<()>),
    /// A client connection whose Proposal is out and whose server has not answered yet
    /// (`connecting.rs`): the program's first use finishes the handshake; wait calls watch
    /// the real socket meanwhile.
    Connecting(Arc<crate::connecting::Connecting>),
    /// An SMC-R connection.
    Smc(Arc<Conn>),
    /// A connection on TCP (its calls pass through; the entry keeps it listed by `smc ss`).
    Tcp(#[allow(dead_code)] TcpConn),
    /// An epoll instance watching SMC-R connections.
    Epoll(Arc<EpollSet>),
    /// An SMC-R connection of another process image (named in `SMC_PRELOAD_INHERITED` by
    /// the image before the exec): relayed through its owner at the first use, as a forked
    /// child's (`relay.rs`); without an owner (the image before owned it and ended with
    /// the exec) its calls fail with EIO.
    Inherited(Option<crate::relay::Owner>),
    /// An SMC-R connection used by more than one process, relayed through the process whose
    /// stack holds it (`relay.rs`): the calls go to this process's copy of the relay socket.
    /// Usable in any process that has it (a forked child inherits the copy).
    Relayed(Arc<crate::relay::Relay>),
}

/// A managed descriptor: what it is and the process that made the entry (the stack of that
/// process owns an SMC-R connection; a forked child must not use or close it).
#[derive(Debug)]
pub(crate) struct Entry {
    pub(crate) kind: Kind,
    pub(crate) pid: i32,
    /// Device and inode of the socket, from the first number the entry was set on: what an
    /// exec names it by (a `vfork` child may have closed every number of it before its exec,
    /// and the new program may have it under another one).
    pub(crate) socket: std::sync::OnceLock<(u64, u64)>,
    /// The process forked while this (SMC-R) connection was its own: a child may hold its
    /// TCP socket after the program's close (`relay.rs`, `keep.rs`).
    pub(crate) forked: AtomicBool,
}

impl Entry {
    pub(crate) fn new(kind: Kind) -> Arc<Entry> {
        Arc::new(Entry {
            kind,
            pid: PID.load(Ordering::Relaxed),
            socket: std::sync::OnceLock::new(),
            forked: AtomicBool::new(false),
        })
    }

    /// Whether the calling process made this entry.
    pub(crate) fn ours(&self) -> bool {
        self.pid == PID.load(Ordering::Relaxed)
    }
}

/// A lock that a `fork()` handler can hold across the fork and release in both processes.
pub(crate) struct SpinLock(AtomicBool);

impl SpinLock {
    pub(crate) const fn new() -> SpinLock {
        SpinLock(AtomicBool::new(false))
    }

    pub(crate) fn lock(&self) {
        while self
            .0
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::thread::yield_now();
        }
    }

    pub(crate) fn unlock(&self) {
        self.0.store(false, Ordering::Release);
    }
}

static LOCK: SpinLock = SpinLock::new();

/// The entries (under [`LOCK`]).
struct Map(std::cell::UnsafeCell<Option<HashMap<i32, Arc<Entry>>>>);

// SAFETY: only touched under LOCK.
unsafe impl Sync for Map {}

static MAP: Map = Map(std::cell::UnsafeCell::new(None));

fn with_map<R>(f: impl FnOnce(&mut HashMap<i32, Arc<Entry>>) -> R) -> R {
    LOCK.lock();
    // SAFETY: LOCK is held, so this is the only reference.
    let m = unsafe { &mut *MAP.0.get() }.get_or_insert_with(HashMap::new);
    let r = f(m);
    LOCK.unlock();
    r
}

fn slot(fd: i32) -> Option<&'static AtomicU8> {
    usize::try_from(fd).ok().and_then(|i| MAYBE.get(i))
}

/// The socket's identity: device and inode of what `fd` names (`None`: not a socket).
pub(crate) fn socket_id(fd: i32) -> Option<(u64, u64)> {
    // SAFETY: fstat into a zeroed struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd, &mut st) } != 0 || st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return None;
    }
    Some((st.st_dev, st.st_ino))
}

/// The socket identities of the entries that are SMC-R connections (this process's or an
/// inherited one), each once.
pub(crate) fn connection_sockets() -> Vec<(u64, u64)> {
    with_map(|m| {
        let mut ids: Vec<(u64, u64)> = m
            .values()
            .filter(|e| matches!(e.kind, Kind::Smc(_) | Kind::Inherited(_) | Kind::Relayed(_)))
            .filter_map(|e| e.socket.get().copied())
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    })
}

/// The numbers of the entries made for socket `id` (device and inode), with their entries.
pub(crate) fn entries_of_socket(id: (u64, u64)) -> Vec<(i32, Arc<Entry>)> {
    with_map(|m| {
        m.iter()
            .filter(|(_, e)| e.socket.get() == Some(&id))
            .map(|(fd, e)| (*fd, e.clone()))
            .collect()
    })
}

/// Before a `fork()` (or a spawn): mark the SMC-R connections this process's stack holds
/// as forked; whether there are any.
pub(crate) fn mark_forked() -> bool {
    ANY.load(Ordering::Relaxed)
        && with_map(|m| {
            let mut any = false;
            for e in m.values() {
                if matches!(e.kind, Kind::Smc(_)) && e.ours() {
                    e.forked.store(true, Ordering::Relaxed);
                    any = true;
                }
            }
            any
        })
}

/// Make `new` the entry of `fd` if `old` still is (the program may have closed or reused
/// the number meanwhile); `true` when replaced.
pub(crate) fn replace(fd: i32, old: &Arc<Entry>, new: Arc<Entry>) -> bool {
    with_map(|m| match m.get_mut(&fd) {
        Some(e) if Arc::ptr_eq(e, old) => {
            *e = new;
            true
        }
        _ => false,
    })
}

/// The numbers whose entry is `e`.
pub(crate) fn numbers_of(e: &Arc<Entry>) -> Vec<i32> {
    with_map(|m| {
        let mut v: Vec<i32> = m
            .iter()
            .filter(|(_, x)| Arc::ptr_eq(x, e))
            .map(|(fd, _)| *fd)
            .collect();
        v.sort_unstable();
        v
    })
}

/// Remove the entry of `fd` if it still is `old`.
pub(crate) fn take_if(fd: i32, old: &Arc<Entry>) -> Option<Arc<Entry>> {
    let s = slot(fd)?;
    with_map(|m| match m.get(&fd) {
        Some(e) if Arc::ptr_eq(e, old) => {
            s.store(0, Ordering::Relaxed);
            m.remove(&fd)
        }
        _ => None,
    })
}

/// The entry of `fd`, if it has one.
#[inline]
pub(crate) fn get(fd: i32) -> Option<Arc<Entry>> {
    let s = slot(fd)?;
    if s.load(Ordering::Relaxed) == 0 {
        return None;
    }
    with_map(|m| m.get(&fd).cloned())
}

/// Whether `fd` may have an entry (one relaxed load).
#[inline]
pub(crate) fn maybe(fd: i32) -> bool {
    slot(fd).is_some_and(|s| s.load(Ordering::Relaxed) != 0)
}

/// Make `e` the entry of `fd`; returns the one it replaces. `false`: `fd` is out of range
/// (the entry is dropped and the descriptor stays unmanaged).
pub(crate) fn set(fd: i32, e: Arc<Entry>) -> Result<Option<Arc<Entry>>, Arc<Entry>> {
    let Some(s) = slot(fd) else {
        return Err(e);
    };
    ANY.store(true, Ordering::Relaxed);
    s.store(1, Ordering::Relaxed);
    if e.socket.get().is_none() {
        if let Some(id) = socket_id(fd) {
            let _ = e.socket.set(id);
        }
    }
    Ok(with_map(|m| m.insert(fd, e)))
}

/// The entry that `fds` (the numbers of one thing) share: the first entry of theirs that
/// `fits`, else `make()`'s, given to each of them that has no entry, in one step under the
/// table's lock: two threads that make the first entry of one epoll instance at once agree
/// on one (tokio registers connections from several threads; with two sets, those of one
/// went where no wait looked). Returns the entry of `fds[0]` when it fits.
pub(crate) fn share(
    fds: &[i32],
    make: impl FnOnce() -> Arc<Entry>,
    fits: impl Fn(&Entry) -> bool,
) -> Option<Arc<Entry>> {
    let slots: Vec<(i32, &'static AtomicU8)> = fds
        .iter()
        .filter_map(|&fd| slot(fd).map(|s| (fd, s)))
        .collect();
    let first = *fds.first()?;
    ANY.store(true, Ordering::Relaxed);
    with_map(|m| {
        let found = fds
            .iter()
            .filter_map(|fd| m.get(fd))
            .find(|e| fits(e))
            .cloned();
        let e = found.unwrap_or_else(make);
        for (fd, s) in slots {
            s.store(1, Ordering::Relaxed);
            m.entry(fd).or_insert_with(|| e.clone());
        }
        m.get(&first).filter(|e| fits(e)).cloned()
    })
}

/// Remove the entry of `fd`.
pub(crate) fn take(fd: i32) -> Option<Arc<Entry>> {
    let s = slot(fd)?;
    if s.load(Ordering::Relaxed) == 0 {
        return None;
    }
    with_map(|m| {
        let e = m.remove(&fd);
        s.store(0, Ordering::Relaxed);
        e
    })
}

/// The descriptors of the listening sockets whose port discovery knows (a `connect` to one of
/// them is a connection to this process, which may accept only later).
pub(crate) fn listeners() -> Vec<i32> {
    with_map(|m| {
        m.iter()
            .filter(|(_, e)| matches!(e.kind, Kind::Listener(_)))
            .map(|(fd, _)| *fd)
            .collect()
    })
}

/// Every epoll instance watching SMC-R connections (for the cleanup when a connection's
/// number is closed).
pub(crate) fn epolls() -> Vec<(i32, Arc<EpollSet>)> {
    with_map(|m| {
        m.iter()
            .filter_map(|(fd, e)| match &e.kind {
                Kind::Epoll(s) => Some((*fd, s.clone())),
                _ => None,
            })
            .collect()
    })
}

/// Drop an entry: in the process that made it, normally; in a forked child, without running
/// anything (the connection and its stack belong to the parent). A relayed connection's
/// entry is dropped normally anywhere: the copy of the relay socket it closes is this
/// process's own (inherited).
pub(crate) fn release(e: Arc<Entry>) {
    if !e.ours() && !matches!(e.kind, Kind::Relayed(_)) {
        std::mem::forget(e);
    }
}

/// `fork()` handlers: hold the table across the fork.
pub(crate) fn fork_prepare() {
    LOCK.lock();
}

/// After `fork()`, in the parent and in the child.
pub(crate) fn fork_release() {
    LOCK.unlock();
}

/// Every entry this process made, and every relayed one (at exit: the connections the
/// program left open; the relay socket copies go, so that the pumps see the holders gone).
pub(crate) fn take_all_ours() -> Vec<(i32, Arc<Entry>)> {
    with_map(|m| {
        let fds: Vec<i32> = m
            .iter()
            .filter(|(_, e)| e.ours() || matches!(e.kind, Kind::Relayed(_)))
            .map(|(fd, _)| *fd)
            .collect();
        fds.into_iter()
            .filter_map(|fd| {
                if let Some(s) = slot(fd) {
                    s.store(0, Ordering::Relaxed);
                }
                Some((fd, m.remove(&fd)?))
            })
            .collect()
    })
}
