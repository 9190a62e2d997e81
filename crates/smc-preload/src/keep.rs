//! A connection whose owner's program closed its last number while another process still
//! holds the TCP socket (socat's and inetd's `accept; fork; close` in the parent, a client
//! that hands its connection to a child and closes it): TCP goes on for the other process,
//! so the owner's stack keeps the connection for it (a part of `relay.rs`).
//!
//! * **Who may hold it.** Only processes made while the owner held the connection can: its
//!   children forked then (and theirs), and programs they exec. A process that forks while it
//!   holds SMC-R connections makes a page of its own shared with its descendants (a
//!   `MAP_SHARED` mapping, [`Forked`]); every process forked below it through the fork
//!   handlers writes its pid there (also grandchildren whose parent exits: they are not the
//!   owner's children any more). The connections present at the fork are marked
//!   ([`table::Entry::forked`]); a connection made after the last fork closes as before.
//! * **Whether one holds it.** The candidates are the pids in the owner's page and the
//!   children of every candidate and of the owner (`/proc/<pid>/task/*/children`: an exec'd
//!   image forks without the page), each looked at in `/proc/<pid>/fd`: a number naming the
//!   socket's inode (and, with kcmp, the same open file as the owner's copy) that is not one
//!   of the owner's internal numbers at the fork (the stack's duplicate, which a forked
//!   child keeps) holds it. A connection passed to another process by SCM_RIGHTS
//!   (`pass.rs`) adds the receivers that looked its owner up, and is kept while a pass of
//!   it is still in flight. A zombie holds nothing; a process this one may not look at
//!   (another user) could not be relayed to either, and does not count.
//! * **Kept.** At the program's close of its last number of a marked connection (or at exit,
//!   for the numbers it left open), when a candidate holds the socket, the connection is kept
//!   (a [`Kept`]): the stack's connection, a copy of the TCP socket (the proof a request is
//!   checked against), and, once a holder asked, this process's copy of the relay socket A
//!   (so that another holder can still ask). The relay server's thread looks again every
//!   [`SWEEP`] while connections are kept, and drops a record when no process holds the
//!   socket any more: the connection closes as the program's close would have (not yet
//!   relayed), or its relay ends when the holders' copies of A are closed too. The peer sees
//!   the end of stream then, as with TCP when the last holder closes.
//! * **Bounded.** An owner that exits waits for its kept connections as for its relays (at
//!   most `SMC_RELAY_EXIT_MS`, `relay::linger`); one that ends by `_exit`, a signal or an
//!   exec ends them at once.

use std::sync::atomic::AtomicPtr;

use super::*;

/// How often kept connections are looked at.
pub(super) const SWEEP: Duration = Duration::from_millis(100);

/// The pids of the processes forked below the process that made the page (`maker`), in a
/// page shared by all of them.
#[repr(C)]
struct Forked {
    maker: AtomicI32,
    pids: [AtomicI32; 1023],
}

/// The pages this process has: its own (made by it) and those of its ancestors.
static PAGES: [AtomicPtr<Forked>; 8] = [const { AtomicPtr::new(std::ptr::null_mut()) }; 8];

/// Before `fork()` in a process that holds connections: make its page if it has none yet.
pub(super) fn fork_prepare(pid: i32) {
    if own_page(pid).is_some() {
        return;
    }
    let Some(slot) = PAGES
        .iter()
        .find(|p| p.load(Ordering::Relaxed).is_null())
        .or_else(|| PAGES.last())
    else {
        return;
    };
    // SAFETY: a new shared anonymous mapping of ours, of the page's size.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            std::mem::size_of::<Forked>(),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        log!(
            "relay: no page for the forked processes: {}",
            io::Error::last_os_error()
        );
        return;
    }
    let page = p.cast::<Forked>();
    // SAFETY: the zeroed mapping is a valid `Forked` (atomics of zero).
    unsafe { (*page).maker.store(pid, Ordering::Relaxed) };
    // (An ancestor's page in the last slot, when all were taken, is forgotten: its owner
    // then does not see this process's later children.)
    slot.store(page, Ordering::Release);
}

/// After `fork()` in the child: its pid in every page it has (only atomics and `kill`: a
/// fork handler).
pub(super) fn fork_child(pid: i32) {
    for p in &PAGES {
        let page = p.load(Ordering::Acquire);
        if page.is_null() {
            continue;
        }
        // SAFETY: a page mapped by this process or an ancestor, never unmapped.
        let page = unsafe { &*page };
        if page.pids.iter().any(|s| {
            s.compare_exchange(0, pid, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        }) {
            continue;
        }
        // Full: the slot of a process that is gone.
        for s in &page.pids {
            let old = s.load(Ordering::Relaxed);
            // SAFETY: kill with signal 0 only checks that the process exists.
            if old > 0
                && unsafe { libc::kill(old, 0) } != 0
                && last_errno() == libc::ESRCH
                && s.compare_exchange(old, pid, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
            {
                break;
            }
        }
    }
    // The parent's kept connections are not this process's; their descriptors were closed
    // with the pumps' (`close_pump_fds`).
    let kept = KEPT.get();
    // SAFETY: one thread after the fork, RELAYS_LOCK released: the only reference. The
    // records (the parent's connections) are forgotten, never dropped here.
    std::mem::forget(std::mem::take(unsafe { &mut *kept }));
    KEPT_COUNT.store(0, Ordering::Relaxed);
    // SAFETY: as above.
    std::mem::forget(std::mem::take(unsafe { &mut *ORPHANS.0.get() }));
    ORPHAN_COUNT.store(0, Ordering::Relaxed);
    // A close under way in another thread of the parent is not this process's.
    for s in &CLOSING {
        s.store(0, Ordering::Relaxed);
    }
}

fn own_page(pid: i32) -> Option<&'static Forked> {
    PAGES.iter().find_map(|p| {
        let page = p.load(Ordering::Acquire);
        // SAFETY: a page mapped by this process or an ancestor, never unmapped.
        (!page.is_null() && unsafe { (*page).maker.load(Ordering::Relaxed) } == pid)
            .then(|| unsafe { &*page })
    })
}

/// A connection kept for the other processes that hold its TCP socket.
pub(super) struct Kept {
    pub(super) id: (u64, u64),
    /// This process's copy of the TCP socket.
    pub(super) tcp: OwnedFd,
    /// The numbers of this process naming the socket that are not the program's (a forked
    /// child has them too, without holding the connection).
    internal: Vec<c_int>,
    /// The connection, until a holder asks for a relay.
    pub(super) conn: Option<Arc<Conn>>,
    /// This process's copy of A, once a holder asked.
    pub(super) relay: Option<Arc<Relay>>,
    /// Sweeps in a row that found no holder: the record goes at the second (a holder in
    /// the middle of an `execve` was once missed by one look, and its relay refused).
    misses: u8,
}

impl Drop for Kept {
    fn drop(&mut self) {
        pump_fd_remove(self.tcp.as_raw_fd());
        if let Some(r) = &self.relay {
            pump_fd_remove(r.fd());
        }
    }
}

/// The kept connections, under RELAYS_LOCK.
struct KeptList(std::cell::UnsafeCell<Vec<Kept>>);
// SAFETY: only touched under RELAYS_LOCK (or by the one thread of a forked child).
unsafe impl Sync for KeptList {}
impl KeptList {
    fn get(&self) -> *mut Vec<Kept> {
        self.0.get()
    }
}
static KEPT: KeptList = KeptList(std::cell::UnsafeCell::new(Vec::new()));
/// How many connections are kept (read without the lock).
static KEPT_COUNT: AtomicUsize = AtomicUsize::new(0);

/// `f` on the kept connections, with RELAYS_LOCK held by the caller.
pub(super) fn with_kept_locked<R>(f: impl FnOnce(&mut Vec<Kept>) -> R) -> R {
    // SAFETY: the caller holds RELAYS_LOCK: the only reference.
    let v = unsafe { &mut *KEPT.get() };
    let r = f(v);
    KEPT_COUNT.store(v.len(), Ordering::Relaxed);
    r
}

fn with_kept<R>(f: impl FnOnce(&mut Vec<Kept>) -> R) -> R {
    RELAYS_LOCK.lock();
    let r = with_kept_locked(f);
    RELAYS_LOCK.unlock();
    r
}

/// Whether connections are kept.
pub(super) fn any() -> bool {
    KEPT_COUNT.load(Ordering::Relaxed) > 0 || ORPHAN_COUNT.load(Ordering::Relaxed) > 0
}

/// Relays made while the program closed a number of their connection (the entry the
/// conversion would have replaced was gone): the close's record ([`closing`]) takes this
/// process's copy of A from here, so that it is kept as for a connection relayed before its
/// close (without it, the record kept the connection itself, and a later request made a
/// second relay of a connection the first had handed over). Under RELAYS_LOCK; one not
/// taken within 5 s goes (the close kept nothing).
type Orphan = ((u64, u64), Arc<Relay>, Instant);
struct Orphans(std::cell::UnsafeCell<Vec<Orphan>>);
// SAFETY: only touched under RELAYS_LOCK (or by the one thread of a forked child).
unsafe impl Sync for Orphans {}
static ORPHANS: Orphans = Orphans(std::cell::UnsafeCell::new(Vec::new()));
static ORPHAN_COUNT: AtomicUsize = AtomicUsize::new(0);

/// See [`ORPHANS`] (RELAYS_LOCK held by the caller).
pub(super) fn orphan_locked(id: (u64, u64), relay: &Arc<Relay>) {
    // SAFETY: the caller holds RELAYS_LOCK.
    let v = unsafe { &mut *ORPHANS.0.get() };
    let _ = pump_fd_add(relay.fd());
    v.push((id, relay.clone(), Instant::now()));
    ORPHAN_COUNT.store(v.len(), Ordering::Relaxed);
}

/// The orphaned relay of `id`, taken (RELAYS_LOCK held by the caller); with `max_age`, those
/// older go.
fn take_orphan_locked(id: Option<(u64, u64)>, max_age: Duration) -> Option<Arc<Relay>> {
    // SAFETY: the caller holds RELAYS_LOCK.
    let v = unsafe { &mut *ORPHANS.0.get() };
    let r = id
        .and_then(|id| v.iter().position(|(i, _, _)| *i == id))
        .map(|i| v.swap_remove(i).1);
    v.retain(|(_, r, at)| {
        let keep = at.elapsed() < max_age;
        if !keep {
            pump_fd_remove(r.fd());
        }
        keep
    });
    ORPHAN_COUNT.store(v.len(), Ordering::Relaxed);
    r
}

/// Whether socket `fd` (a requester's proof) is, as an open file, a kept connection's; its
/// identity `id`.
pub(super) fn proves(fd: c_int, id: (u64, u64)) -> Result<bool, c_int> {
    with_kept(|v| {
        for k in v.iter().filter(|k| k.id == id) {
            if same_file(fd, k.tcp.as_raw_fd())? {
                return Ok(true);
            }
        }
        Ok(false)
    })
}

/// The program closes (or leaves at exit) its last numbers `program` of connection `conn`
/// (socket `id`), which was there when this process forked or was passed to another process
/// (`pass.rs`): keep it when another process holds the socket, or while a pass of it may
/// still reach one. `fd` is one of those numbers, still open. A passed connection already
/// relayed comes with its relay (`relay`, this process's copy of A) instead: kept, a later
/// receiver gets the same A.
pub(crate) fn closing(
    fd: c_int,
    program: &[c_int],
    id: (u64, u64),
    conn: Option<&Arc<Conn>>,
    relay: Option<&Arc<Relay>>,
) {
    let me = table::PID.load(Ordering::Relaxed);
    if !serving(me) {
        return;
    }
    let passed = pass::keeps(id);
    // Most closes end here: no process made since the fork names the socket at all (the
    // children are gone, or closed it), and no pass of it is under way.
    let cands = candidates(me);
    let named = |pid: &i32| sockets_of(*pid).iter().any(|&(_, i)| i == id.1);
    if !passed && !cands.iter().any(named) {
        return;
    }
    // A copy of the program's descriptor, still open.
    let Ok(tcp) = crate::relay::dup_high(fd) else {
        return;
    };
    let mut internal = numbers_of(me, id.1);
    internal.retain(|n| !program.contains(n));
    let holders = holders(me, &[(id.1, tcp.as_raw_fd(), internal.clone())]);
    match holders.first().and_then(|h| h.first()) {
        Some(pid) => log!(
            "fd {fd}: closed by the program while process {pid} holds the connection: kept for it"
        ),
        None if passed => log!(
            "fd {fd}: closed by the program while a pass of the connection is under way: kept for it"
        ),
        None => return,
    }
    if !pump_fd_add(tcp.as_raw_fd()) {
        log!("relay: more kept connections than noted for fork");
    }
    if let Some(r) = relay {
        let _ = pump_fd_add(r.fd());
    }
    with_kept(|v| {
        // Relayed while this close ran: the relay's copy of A is kept, not the connection.
        let (conn, relay) = match take_orphan_locked(Some(id), Duration::from_secs(5)) {
            Some(r) => (None, Some(r)),
            None => (conn.cloned(), relay.cloned()),
        };
        v.push(Kept {
            id,
            tcp,
            internal,
            misses: 0,
            conn,
            relay,
        })
    });
    kick();
}

/// The connection of kept record `id` not relayed yet (RELAYS_LOCK held).
pub(super) fn conn_of_locked(id: (u64, u64)) -> Option<Weak<Conn>> {
    with_kept_locked(|v| {
        v.iter()
            .find(|k| k.id == id)
            .and_then(|k| k.conn.as_ref().map(Arc::downgrade))
    })
}

/// The inodes of connections whose program numbers are being closed by a thread of this
/// process (0: a free slot): between the entry's removal from the table and the record made
/// by [`closing`] (which looks at `/proc` meanwhile), a request for such a connection would
/// find neither; the server waits for the close to end instead ([`being_closed`]). A
/// receiver that uses a passed connection at once runs into the sender's close at once.
static CLOSING: [AtomicU64; 32] = [const { AtomicU64::new(0) }; 32];

/// [`CLOSING`] holds an inode while this lives.
pub(crate) struct ClosingMark(Option<usize>);

impl Drop for ClosingMark {
    fn drop(&mut self) {
        if let Some(i) = self.0 {
            CLOSING[i].store(0, Ordering::Release);
        }
    }
}

/// Note that the program's numbers of connection `ino` are being closed.
pub(crate) fn closing_mark(ino: u64) -> ClosingMark {
    ClosingMark(CLOSING.iter().position(|s| {
        ino != 0
            && s.compare_exchange(0, ino, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
    }))
}

/// Whether a thread of this process is closing the program's numbers of connection `ino`.
pub(super) fn being_closed(ino: u64) -> bool {
    ino != 0 && CLOSING.iter().any(|s| s.load(Ordering::Acquire) == ino)
}

/// A holder asked for a relay of kept connection `id` (RELAYS_LOCK held): the connection
/// and the number that stands for the program's (its flags are the open file's).
pub(super) fn take_for_relay(id: (u64, u64)) -> Option<(c_int, Arc<Conn>)> {
    with_kept_locked(|v| {
        let k = v.iter_mut().find(|k| k.id == id && k.conn.is_some())?;
        Some((k.tcp.as_raw_fd(), k.conn.clone()?))
    })
}

/// The relay of kept connection `id` is made (RELAYS_LOCK held): the record keeps this
/// process's copy of A.
pub(super) fn relayed(id: (u64, u64), relay: &Arc<Relay>) {
    with_kept_locked(|v| {
        if let Some(k) = v.iter_mut().find(|k| k.id == id && k.conn.is_some()) {
            k.conn = None;
            let _ = pump_fd_add(relay.fd());
            k.relay = Some(relay.clone());
        }
    });
}

/// Drop the records of the connections no process holds any more (the server thread, every
/// [`SWEEP`] while some are kept).
pub(super) fn sweep() {
    let me = table::PID.load(Ordering::Relaxed);
    let old = {
        RELAYS_LOCK.lock();
        let r = take_orphan_locked(None, Duration::from_secs(5));
        RELAYS_LOCK.unlock();
        r
    };
    drop(old);
    type Look = (u64, c_int, Vec<c_int>);
    let (look, ids): (Vec<Look>, Vec<(u64, u64)>) = with_kept(|v| {
        v.iter()
            .map(|k| ((k.id.1, k.tcp.as_raw_fd(), k.internal.clone()), k.id))
            .unzip()
    });
    if look.is_empty() {
        return;
    }
    let mut held = holders(me, &look);
    // A pass still under way holds it too (`pass.rs`), and so does this process's program
    // when a pass brought the connection back to it (its entry asks for the relay).
    for (h, id) in held.iter_mut().zip(&ids) {
        if h.is_empty() && (pass::keeps(*id) || !table::entries_of_socket(*id).is_empty()) {
            h.push(me);
        }
    }
    let gone: Vec<Kept> = with_kept(|v| {
        let mut gone = Vec::new();
        let mut i = 0;
        while i < v.len() {
            let k = &mut v[i];
            let still = look
                .iter()
                .zip(&held)
                .any(|((_, fd, _), h)| *fd == k.tcp.as_raw_fd() && !h.is_empty());
            k.misses = if still { 0 } else { k.misses.saturating_add(1) };
            if k.misses < 2 {
                i += 1;
            } else {
                gone.push(v.swap_remove(i));
            }
        }
        gone
    });
    for k in gone {
        log!(
            "relay: no process holds the kept connection (inode {}) any more: closed",
            k.id.1
        );
        // (Dropped outside the lock: the connection's close takes the stack's.)
        drop(k);
    }
}

/// Wake the server thread (a record was added: its sweeps begin).
pub(super) fn kick() {
    let k = KICK_FD.load(Ordering::Relaxed);
    if k >= 0 {
        let one = 1u64.to_ne_bytes();
        // SAFETY: our eventfd and 8 bytes.
        unsafe { real::write(k, one.as_ptr().cast(), 8) };
    }
}

/// The numbers of process `pid` naming socket inode `ino`.
fn numbers_of(pid: i32, ino: u64) -> Vec<c_int> {
    sockets_of(pid)
        .into_iter()
        .filter(|&(_, i)| i == ino)
        .map(|(n, _)| n)
        .collect()
}

/// Every number of process `pid` naming a socket, with the socket's inode.
fn sockets_of(pid: i32) -> Vec<(c_int, u64)> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    dir.filter_map(|e| {
        let e = e.ok()?;
        let n: c_int = e.file_name().to_str()?.parse().ok()?;
        let link = std::fs::read_link(e.path()).ok()?;
        let ino = link
            .to_str()?
            .strip_prefix("socket:[")?
            .strip_suffix(']')?
            .parse()
            .ok()?;
        Some((n, ino))
    })
    .collect()
}

/// The processes that may hold this process's connections: those in its page and, below
/// them and below this process, their children (at most 4096).
fn candidates(me: i32) -> Vec<i32> {
    let mut out: Vec<i32> = Vec::new();
    if let Some(page) = own_page(me) {
        for s in &page.pids {
            let p = s.load(Ordering::Relaxed);
            if p <= 0 {
                continue;
            }
            if std::fs::metadata(format!("/proc/{p}")).is_err() {
                // Gone: its slot is free again.
                let _ = s.compare_exchange(p, 0, Ordering::Relaxed, Ordering::Relaxed);
                continue;
            }
            out.push(p);
        }
    }
    // The processes that received a connection of this one by SCM_RIGHTS (`pass.rs`).
    for p in pass::receivers() {
        if p != me && !out.contains(&p) {
            out.push(p);
        }
    }
    let mut queue: Vec<i32> = out.clone();
    queue.push(me);
    while let Some(p) = queue.pop() {
        if out.len() >= 4096 {
            break;
        }
        for c in children(p) {
            if c != me && !out.contains(&c) {
                out.push(c);
                queue.push(c);
            }
        }
    }
    out
}

/// The children of process `pid` (of every thread).
fn children(pid: i32) -> Vec<i32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for t in tasks.flatten() {
        if let Ok(s) = std::fs::read_to_string(t.path().join("children")) {
            out.extend(s.split_whitespace().filter_map(|x| x.parse::<i32>().ok()));
        }
    }
    out
}

/// For each connection `(inode, this process's copy, internal numbers)`: the processes
/// other than this one that hold its socket.
fn holders(me: i32, conns: &[(u64, c_int, Vec<c_int>)]) -> Vec<Vec<i32>> {
    let mut out = vec![Vec::new(); conns.len()];
    for pid in candidates(me) {
        let socks = sockets_of(pid);
        for ((ino, ours, internal), h) in conns.iter().zip(out.iter_mut()) {
            let holds = socks.iter().any(|&(n, i)| {
                i == *ino
                    && !internal.contains(&n)
                    // The same open file (an inode number alone could be another socket's
                    // after the numbers wrapped); without kcmp, the inode.
                    && kcmp_file(me, *ours, pid, n).unwrap_or(true)
            });
            if holds {
                h.push(pid);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Run `f` in a forked child that then waits for a byte on `go` and exits; `f` and the
    /// wait make only system calls.
    fn child(f: impl FnOnce(), go: c_int, done: c_int) -> i32 {
        // SAFETY: the child makes only system calls and exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            f();
            let mut b = [0u8];
            // SAFETY: our pipes and a byte.
            unsafe {
                libc::write(done, b.as_ptr().cast(), 1);
                libc::read(go, b.as_mut_ptr().cast(), 1);
                libc::_exit(0);
            }
        }
        pid
    }

    #[test]
    fn a_forked_process_holds_the_socket_until_it_closes_its_number() {
        let _children = crate::TEST_CHILDREN
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        // SAFETY: a new socket of this test's.
        let s = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        assert!(s >= 0);
        // SAFETY: just made.
        let s = unsafe { OwnedFd::from_raw_fd(s) };
        let ino = table::socket_id(s.as_raw_fd()).expect("a socket").1;
        // A copy at another number stands for the stack's duplicate (internal).
        // SAFETY: plain fcntl on our socket.
        let internal = unsafe { libc::fcntl(s.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
        assert!(internal >= 0);
        let mut go = [0; 2];
        let mut done = [0; 2];
        // SAFETY: arrays of two ints.
        unsafe {
            assert_eq!(libc::pipe2(go.as_mut_ptr(), libc::O_CLOEXEC), 0);
            assert_eq!(libc::pipe2(done.as_mut_ptr(), libc::O_CLOEXEC), 0);
        }
        // SAFETY: getpid has no preconditions.
        let me = unsafe { libc::getpid() };
        let wait_done = || {
            let mut b = [0u8];
            // SAFETY: our pipe and a byte.
            assert_eq!(unsafe { libc::read(done[0], b.as_mut_ptr().cast(), 1) }, 1);
        };
        let conns = [(ino, s.as_raw_fd(), vec![internal])];
        // A child that keeps the program's number: it holds the socket.
        let keeper = child(|| {}, go[0], done[1]);
        wait_done();
        let h = holders(me, &conns);
        assert!(
            h[0].contains(&keeper),
            "the child holding the number is not seen: {h:?}"
        );
        // Its copy at the internal number alone does not count.
        let only_internal = [(ino, s.as_raw_fd(), vec![internal, s.as_raw_fd()])];
        assert!(!holders(me, &only_internal)[0].contains(&keeper));
        // A child that closed the program's number (keeping the internal copy) does not.
        let raw = s.as_raw_fd();
        let closer = child(
            || {
                // SAFETY: the child's copy of the number.
                unsafe { libc::close(raw) };
            },
            go[0],
            done[1],
        );
        wait_done();
        let h = holders(me, &conns);
        assert!(
            !h[0].contains(&closer),
            "a child that closed its number counted: {h:?}"
        );
        assert!(h[0].contains(&keeper));
        // Both exit: nobody holds it (a zombie holds nothing, reaped or not).
        // SAFETY: our pipe, two bytes, our children.
        unsafe {
            libc::write(go[1], [0u8, 0].as_ptr().cast(), 2);
            for pid in [keeper, closer] {
                let mut status = 0;
                assert_eq!(libc::waitpid(pid, &mut status, 0), pid);
            }
        }
        assert!(holders(me, &conns)[0].is_empty());
        // SAFETY: our descriptors.
        unsafe {
            for fd in [internal, go[0], go[1], done[0], done[1]] {
                libc::close(fd);
            }
        }
    }
}
