//! An SMC-R connection passed to another process with `sendmsg` and SCM_RIGHTS (a part of
//! `relay.rs`): the receiver gets the real TCP socket, which carries nothing once SMC-R runs,
//! so, as a forked child does, it asks the connection's owner for a relay.
//!
//! * **The sender** (`sendmsg` or `sendmmsg` with SCM_RIGHTS naming an SMC-R connection,
//!   [`passing`]) makes sure the owner serves relays and tells it of the pass before the
//!   message goes: the owner itself notes it; any other holder (a forked child, a relayed
//!   receiver passing it on) sends the owner a [`PASS`] request with its copy of the TCP
//!   socket as the proof and a copy of the unix socket the message goes through. The owner binds, once per
//!   connection, the abstract name `smc-rs-passed/<device>/<inode>` of the TCP socket (what
//!   a receiver sees with `fstat`) and keeps the copy of the unix socket while its queue
//!   holds what was sent (`SIOCOUTQ`: the kernel charges a unix socket for what it sent
//!   until the receiver takes it, or its socket goes): the pass is *in flight*. The note
//!   comes before the message goes (the receiver may look it up before the sender's call
//!   returns) and is undone when the send fails ([`sent`]; [`UNPASS`] to another owner).
//!   When another socket holds the name (anyone can bind it first: `/proc/net/tcp` shows
//!   the inode), the owner binds a name under it with 128 random bits ([`random_name`]).
//! * **The receiver** (`recvmsg` that brings SCM_RIGHTS, [`received`]) looks at each
//!   descriptor: an AF_INET/AF_INET6 TCP socket (not listening) of a connection this
//!   process already has an entry for is a duplicate (a pass to itself, or to another
//!   thread); any other is looked up at that name ([`LOOKUP`], with the socket as the
//!   proof, checked as a relay request is): the owner answers with its nonce and notes the receiver's pid, and the
//!   descriptor gets an entry that asks that owner for a relay at its first use, as an
//!   exec'd image's inherited one does. The server at the name must run as the receiver's
//!   user or root (SO_PEERCRED, before anything is sent: [`connect_cred`]); one that is
//!   refused, answers as no owner, or holds the name without listening sends the receiver
//!   to the names under it, read from `/proc/net/unix` ([`candidates`]). No name: not an
//!   SMC-R connection, or its owner is gone or in another network namespace (abstract names
//!   are per namespace); the socket stays as it is. The look-ups of one `recvmsg` take at
//!   most [`LOOKUP_CONNECT_WAIT`] in all; one that runs out of time leaves its socket too.
//! * **How long** (`keep.rs`): once the owner's program closed its numbers, a passed
//!   connection is kept while a pass is in flight, for [`GRACE`] after the last pass was
//!   taken when fewer receivers looked it up than passes were made (a receiver between its
//!   `recvmsg` and its look-up, or one without the library), and while a process holds the
//!   socket among the usual candidates and the receivers that looked it up (and their
//!   children). A pass is in flight at most `SMC_PASS_WAIT_MS` (default 60000): a queue
//!   nobody reads does not keep a connection for ever.

use super::*;

/// A holder tells the owner of a pass: the proof and the sender's unix socket.
pub(super) const PASS: u8 = b'P';
/// A receiver asks who owns a connection: the proof.
pub(super) const LOOKUP: u8 = b'L';
/// A holder's send of an announced pass failed: the proof and the sender's unix socket.
pub(super) const UNPASS: u8 = b'U';

/// How often the server thread looks at the queues of passes in flight.
pub(super) const TICK: Duration = Duration::from_millis(10);

/// How long a passed connection is kept after its last pass was taken, when fewer receivers
/// looked it up than passes were made.
pub(super) const GRACE: Duration = Duration::from_secs(2);

/// How long an announced pass (a holder's, not the owner's) counts as being sent before its
/// message was seen queued: the holder sends it right after the owner's answer (or undoes
/// it, [`UNPASS`]), and one taken before the owner looked is then taken.
const SEND_WAIT: Duration = Duration::from_secs(1);

/// How long the look-ups of the descriptors one `recvmsg` brought take, in all: every
/// connect (a full backlog refuses a nonblocking connect; a squatter's that is never
/// accepted) and every answer (an owner that is stopped) must not hold the receiver's
/// `recvmsg` for long.
const LOOKUP_CONNECT_WAIT: Duration = Duration::from_secs(2);

/// How many sockets named under a connection's name a look-up reads at most from
/// `/proc/net/unix` (the look-up's time, [`LOOKUP_CONNECT_WAIT`], is its real bound: a
/// refused candidate costs a nonblocking connect and SO_PEERCRED).
const MAX_CANDIDATES: usize = 1024;

/// How long a pass counts as in flight at most (`SMC_PASS_WAIT_MS`).
fn wait_bound() -> Duration {
    static MS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    Duration::from_millis(*MS.get_or_init(|| {
        std::env::var("SMC_PASS_WAIT_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(60_000)
    }))
}

/// The abstract name under which the owner of the connection whose TCP socket is `id`
/// answers look-ups.
pub(super) fn name(id: (u64, u64)) -> (libc::sockaddr_un, libc::socklen_t) {
    abstract_address(&name_text(id))
}

fn name_text((dev, ino): (u64, u64)) -> String {
    format!("smc-rs-passed/{dev}/{ino}")
}

/// The name an owner binds when another socket holds [`name`]: under it, with 128 random
/// bits (`None`: no randomness to be had). A receiver finds it in `/proc/net/unix`
/// ([`candidates`]); nobody can take it first.
fn random_name(id: (u64, u64)) -> Option<String> {
    let mut b = [0u8; 16];
    // SAFETY: a buffer of 16 bytes.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    (n == 16).then(|| {
        let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
        format!("{}/{hex}", name_text(id))
    })
}

/// The abstract names bound under connection `id`'s name that [`random_name`] could have
/// made (`smc-rs-passed/<dev>/<ino>/` and 32 lowercase hex digits), from `/proc/net/unix`
/// (readable by every process of the network namespace; empty without /proc), at most
/// [`MAX_CANDIDATES`]. Not sorted, nor cut to a few: whoever binds names under it (names
/// that sort first) hides the owner's from no receiver.
fn candidates(id: (u64, u64)) -> Vec<String> {
    use std::io::BufRead;
    let Ok(f) = std::fs::File::open("/proc/net/unix") else {
        return Vec::new();
    };
    candidates_in(io::BufReader::new(f).lines().map_while(Result::ok), id)
}

/// [`candidates`] in the lines of `/proc/net/unix`.
fn candidates_in(lines: impl Iterator<Item = String>, id: (u64, u64)) -> Vec<String> {
    let under = format!("@{}/", name_text(id));
    let mut v: Vec<String> = Vec::new();
    for l in lines {
        let Some(p) = l.split_whitespace().nth(7) else {
            continue;
        };
        let Some(hex) = p.strip_prefix(&under) else {
            continue;
        };
        let random = hex.len() == 32 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        if random && !v.iter().any(|n| *n == p[1..]) {
            v.push(p[1..].to_string());
            if v.len() == MAX_CANDIDATES {
                break;
            }
        }
    }
    v
}

/// A connection of this process passed to another one.
struct Passed {
    id: (u64, u64),
    /// Listening on [`name`] of `id`, or, when another socket held that, on a
    /// [`random_name`] under it (`random`).
    listener: OwnedFd,
    random: bool,
    /// With a random name: [`name`] of `id`, bound once the socket that held it let it go
    /// ([`retake`]): a receiver that finds the name free looks no further.
    retaken: Option<OwnedFd>,
    conn: Weak<Conn>,
    /// The passes in flight.
    in_flight: Vec<Flight>,
    passes: u32,
    lookups: u32,
    /// When the last pass in flight was seen taken.
    drained: Option<Instant>,
    /// The processes that looked the connection up.
    receivers: Vec<i32>,
}

/// A pass in flight: a copy of the unix socket it went through.
struct Flight {
    unix: OwnedFd,
    /// When it was noted.
    at: Instant,
    /// Noted before the program's send, which has not been seen to succeed yet: the
    /// owner's own pass until its send returned ([`sent`]), a holder's announced one until
    /// its message is seen queued (at most [`SEND_WAIT`]). Until then an empty queue does
    /// not mean taken.
    sending: bool,
    /// Announced by another holder ([`PASS`]).
    told: bool,
}

impl Flight {
    /// Whether the pass still counts as in flight at `now` (`bound`: `SMC_PASS_WAIT_MS`).
    fn stays(&mut self, now: Instant, bound: Duration) -> bool {
        let age = now.duration_since(self.at);
        if age >= bound {
            return false;
        }
        let queued = unsent(self.unix.as_raw_fd()) > 0;
        if self.sending {
            if self.told && queued {
                self.sending = false;
            }
            return !self.told || queued || age < SEND_WAIT;
        }
        queued
    }
}

impl Drop for Passed {
    fn drop(&mut self) {
        pump_fd_remove(self.listener.as_raw_fd());
        if let Some(l) = &self.retaken {
            pump_fd_remove(l.as_raw_fd());
        }
        for f in &self.in_flight {
            pump_fd_remove(f.unix.as_raw_fd());
        }
    }
}

impl Passed {
    fn keeps(&self, now: Instant) -> bool {
        keeps_rule(
            !self.in_flight.is_empty(),
            self.passes,
            self.lookups,
            self.drained,
            now,
        )
    }
}

/// Whether a passed connection is kept for a receiver that may still ask: a pass in flight,
/// or, when fewer look-ups came than passes were made, for [`GRACE`] after the last was
/// taken.
fn keeps_rule(
    in_flight: bool,
    passes: u32,
    lookups: u32,
    drained: Option<Instant>,
    now: Instant,
) -> bool {
    in_flight || (passes > lookups && drained.is_some_and(|d| now.duration_since(d) < GRACE))
}

/// The passed connections, under RELAYS_LOCK.
struct PassedList(std::cell::UnsafeCell<Vec<Passed>>);
// SAFETY: only touched under RELAYS_LOCK (or by the one thread of a forked child).
unsafe impl Sync for PassedList {}
static PASSED: PassedList = PassedList(std::cell::UnsafeCell::new(Vec::new()));
/// How many passes are in flight (read without the lock).
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);

fn with_passed<R>(f: impl FnOnce(&mut Vec<Passed>) -> R) -> R {
    RELAYS_LOCK.lock();
    // SAFETY: the lock is held: the only reference.
    let v = unsafe { &mut *PASSED.0.get() };
    let r = f(v);
    IN_FLIGHT.store(v.iter().map(|p| p.in_flight.len()).sum(), Ordering::Relaxed);
    RELAYS_LOCK.unlock();
    r
}

/// Whether a pass is in flight (the server thread then looks every [`TICK`]).
pub(super) fn in_flight() -> bool {
    IN_FLIGHT.load(Ordering::Relaxed) > 0
}

/// Whether the passed connection `id` is to be kept for a receiver that may still ask.
pub(super) fn keeps(id: (u64, u64)) -> bool {
    let now = Instant::now();
    with_passed(|v| v.iter().any(|p| p.id == id && p.keeps(now)))
}

/// Whether a passed connection has a random name only (its name held by another socket):
/// the server thread then sweeps every `keep::SWEEP`, to bind the name once let go
/// ([`retake`]).
pub(super) fn to_retake() -> bool {
    with_passed(|v| v.iter().any(|p| p.random && p.retaken.is_none()))
}

/// The processes that looked up a connection of this process.
pub(super) fn receivers() -> Vec<i32> {
    with_passed(|v| v.iter().flat_map(|p| p.receivers.clone()).collect())
}

/// The listening sockets of the passed connections' names (the server thread's poll).
pub(super) fn listeners() -> Vec<c_int> {
    with_passed(|v| {
        v.iter()
            .flat_map(|p| std::iter::once(&p.listener).chain(&p.retaken))
            .map(|l| l.as_raw_fd())
            .collect()
    })
}

/// In a forked child: the parent's records are not this process's (their descriptors were
/// closed with the pumps', `close_pump_fds`).
pub(super) fn fork_child() {
    // SAFETY: one thread after the fork, RELAYS_LOCK released: the only reference. The
    // records are forgotten, never dropped here (their descriptors are closed already).
    std::mem::forget(std::mem::take(unsafe { &mut *PASSED.0.get() }));
    IN_FLIGHT.store(0, Ordering::Relaxed);
}

/// The bytes a unix socket sent that its receiver has not taken yet (`SIOCOUTQ`; 0 when
/// unknown).
pub(super) fn unsent(fd: c_int) -> usize {
    let mut n: c_int = 0;
    // SAFETY: SIOCOUTQ writes an int.
    let r = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut n) };
    if r == 0 {
        n.max(0) as usize
    } else {
        0
    }
}

/// This process passes its connection `id` (`conn`) through unix socket `unix` (a copy of
/// the sender's; `told`: announced by another holder): note the pass before its message
/// goes, bind the connection's name if not yet. The number of the copy noted (-1: none), by
/// which [`unnote`] finds it when the send fails.
fn note(
    id: (u64, u64),
    conn: Weak<Conn>,
    unix: Option<OwnedFd>,
    told: bool,
) -> Result<c_int, c_int> {
    // The records of closed connections of the same socket go first (their listener's name
    // is this one).
    let stale: Vec<Passed> = with_passed(|v| {
        let (gone, keep): (Vec<Passed>, Vec<Passed>) = std::mem::take(v)
            .into_iter()
            .partition(|p| p.id == id && p.conn.strong_count() == 0);
        *v = keep;
        gone
    });
    drop(stale);
    let mut random = None;
    let r = with_passed(|v| {
        let i = match v.iter().position(|p| p.id == id) {
            Some(i) => i,
            None => {
                // Bound under the lock: another thread's pass of the same connection finds
                // this record, so a name held by another socket is never ours.
                let (listener, r) = listen(id)?;
                random = r;
                if !pump_fd_add(listener.as_raw_fd()) {
                    log!("relay: more passed connections than noted for fork");
                }
                v.push(Passed {
                    id,
                    listener,
                    random: random.is_some(),
                    retaken: None,
                    conn,
                    in_flight: Vec::new(),
                    passes: 0,
                    lookups: 0,
                    drained: None,
                    receivers: Vec::new(),
                });
                v.len() - 1
            }
        };
        let p = &mut v[i];
        p.passes = p.passes.saturating_add(1);
        Ok(match unix {
            Some(u) => {
                let raw = u.as_raw_fd();
                let _ = pump_fd_add(raw);
                p.in_flight.push(Flight {
                    unix: u,
                    at: Instant::now(),
                    sending: true,
                    told,
                });
                raw
            }
            None => -1,
        })
    });
    match &r {
        Err(e) => log!(
            "relay: the name of a passed connection (inode {}) cannot be bound: {}",
            id.1,
            io::Error::from_raw_os_error(*e)
        ),
        Ok(_) => {
            if let Some(n) = random {
                log!("relay: the name of a passed connection (inode {}) is held by another socket: bound as {n}", id.1);
            }
        }
    }
    keep::kick();
    r
}

/// Undo a pass of connection `id` noted by [`note`] whose send failed: one pass less, and
/// the pass that `is_it` recognizes (the newest) is no longer in flight;
/// a record left with no pass, look-up or pass in flight goes (its name with it).
fn unnote(id: (u64, u64), is_it: impl Fn(&Flight) -> bool) -> Result<(), c_int> {
    let gone = with_passed(|v| -> Result<(Option<Flight>, Option<Passed>), c_int> {
        let i = v.iter().position(|p| p.id == id).ok_or(libc::ENOENT)?;
        let p = &mut v[i];
        p.passes = p.passes.saturating_sub(1);
        let copy = p
            .in_flight
            .iter()
            .rposition(&is_it)
            .map(|j| p.in_flight.remove(j));
        let record =
            (p.passes == 0 && p.lookups == 0 && p.in_flight.is_empty()).then(|| v.swap_remove(i));
        Ok((copy, record))
    });
    // (Closed outside the lock; among the pumps' descriptors until then, for a fork.)
    let (copy, record) = gone?;
    if let Some(f) = copy {
        pump_fd_remove(f.unix.as_raw_fd());
        drop(f);
    }
    drop(record);
    keep::kick();
    Ok(())
}

/// Bind and listen on the name of connection `id`, or, when another socket holds it (the
/// caller holds the lock under which this process's records are made: not one of ours), on
/// a random name under it (`Some(that name)`).
fn listen(id: (u64, u64)) -> Result<(OwnedFd, Option<String>), c_int> {
    match listen_at(&name_text(id)) {
        Err(libc::EADDRINUSE) => {}
        r => return r.map(|l| (l, None)),
    }
    let n = random_name(id).ok_or(libc::EADDRINUSE)?;
    listen_at(&n).map(|l| (l, Some(n)))
}

/// Bind and listen on abstract name `n` (nonblocking).
fn listen_at(n: &str) -> Result<OwnedFd, c_int> {
    // SAFETY: a new socket of ours.
    let s =
        made(|| unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) })?;
    let (addr, len) = abstract_address(n);
    if !bind_listen(&s, &addr, len) {
        return Err(last_errno());
    }
    set_nonblocking(s.as_raw_fd(), true);
    Ok(s)
}

/// The server thread: the passes taken or too old go (their copies of the unix sockets are
/// closed: the program's close of its own reaches the peer), so do the records of
/// connections this process no longer has, and the receivers that are gone; a name let go
/// by the socket that held it is bound ([`retake`], at most every `keep::SWEEP`). The lock
/// of the records (a spin lock the program's threads wait on in `sendmsg`, `close`, `fork`)
/// is not held across a close, a bind or a look at /proc.
pub(super) fn sweep() {
    let now = Instant::now();
    let bound = wait_bound();
    let pids: Vec<i32> = with_passed(|v| v.iter().flat_map(|p| p.receivers.clone()).collect());
    let ended: Vec<i32> = pids
        .into_iter()
        .filter(|pid| std::fs::metadata(format!("/proc/{pid}")).is_err())
        .collect();
    let (gone, taken) = with_passed(|v| {
        let mut gone: Vec<Passed> = Vec::new();
        let mut taken: Vec<Flight> = Vec::new();
        let mut i = 0;
        while i < v.len() {
            if v[i].conn.strong_count() == 0 {
                gone.push(v.swap_remove(i));
                continue;
            }
            let p = &mut v[i];
            let before = p.in_flight.len();
            let mut j = 0;
            while j < p.in_flight.len() {
                if p.in_flight[j].stays(now, bound) {
                    j += 1;
                } else {
                    taken.push(p.in_flight.remove(j));
                }
            }
            if before > 0 && p.in_flight.is_empty() {
                p.drained = Some(now);
            }
            p.receivers.retain(|pid| !ended.contains(pid));
            i += 1;
        }
        (gone, taken)
    });
    drop(gone);
    // (Among the pumps' descriptors until closed here: a child forked meanwhile closes its
    // copy.)
    for f in taken {
        pump_fd_remove(f.unix.as_raw_fd());
        drop(f);
    }
    static RETAKEN: std::sync::Mutex<Option<Instant>> = std::sync::Mutex::new(None);
    let mut last = RETAKEN.lock().unwrap_or_else(|p| p.into_inner());
    if last.is_none_or(|t| now.duration_since(t) >= keep::SWEEP) {
        *last = Some(now);
        for ino in retake() {
            log!("relay: the name of a passed connection (inode {ino}) was let go by the socket that held it: bound");
        }
    }
}

/// Bind the names of the passed connections that have a random name only, where the socket
/// that held the name let it go (bound outside the lock of the records); their inodes.
fn retake() -> Vec<u64> {
    let ids: Vec<(u64, u64)> = with_passed(|v| {
        v.iter()
            .filter(|p| p.random && p.retaken.is_none())
            .map(|p| p.id)
            .collect()
    });
    let mut done = Vec::new();
    for id in ids {
        let Ok(l) = listen_at(&name_text(id)) else {
            continue;
        };
        let _ = pump_fd_add(l.as_raw_fd());
        let raw = l.as_raw_fd();
        // (The record may have gone meanwhile: then the name goes too, outside the lock.)
        let unused = with_passed(|v| {
            match v
                .iter_mut()
                .find(|p| p.id == id && p.random && p.retaken.is_none())
            {
                Some(p) => {
                    p.retaken = Some(l);
                    None
                }
                None => Some(l),
            }
        });
        match unused {
            Some(l) => {
                pump_fd_remove(raw);
                drop(l);
            }
            None => done.push(id.1),
        }
    }
    done
}

/// A [`PASS`] request (RELAYS_LOCK not held): `fds` are the proof and the sender's unix
/// socket; the latter is taken out (kept while the pass is in flight).
pub(super) fn announced(fds: &mut Vec<OwnedFd>) -> Result<(), c_int> {
    let [proof, unix] = &fds[..] else {
        return Err(libc::EPROTO);
    };
    if sock_opt(unix.as_raw_fd(), libc::SO_DOMAIN) != Some(libc::AF_UNIX) {
        return Err(libc::EPROTO);
    }
    let id = check_proof(ASK, std::slice::from_ref(proof))?;
    let conn = conn_of(id).ok_or(libc::ENOENT)?;
    mark_passed(id);
    let unix = fds.pop().ok_or(libc::EPROTO)?;
    note(id, conn, Some(unix), true).map(|_| ())
}

/// An [`UNPASS`] request (RELAYS_LOCK not held): `fds` are the proof and the sender's unix
/// socket, whose send of an announced pass failed: the pass is undone.
pub(super) fn unannounced(fds: &[OwnedFd]) -> Result<(), c_int> {
    let [proof, unix] = fds else {
        return Err(libc::EPROTO);
    };
    let id = check_proof(ASK, std::slice::from_ref(proof))?;
    // Only a pass another holder announced: this process's own pass through the same open
    // file (a forked child's unix socket is its parent's) went, whatever the child's did.
    // Compared (kcmp) outside the lock of the records, on copies of the flights' sockets.
    let told: Vec<(c_int, Option<OwnedFd>)> = with_passed(|v| {
        v.iter()
            .filter(|p| p.id == id)
            .flat_map(|p| &p.in_flight)
            .filter(|f| f.told)
            .map(|f| (f.unix.as_raw_fd(), f.unix.try_clone().ok()))
            .collect()
    });
    let theirs: Vec<c_int> = told
        .iter()
        .filter(|(_, c)| {
            c.as_ref()
                .is_some_and(|c| same_file(c.as_raw_fd(), unix.as_raw_fd()) == Ok(true))
        })
        .map(|(fd, _)| *fd)
        .collect();
    drop(told);
    unnote(id, |f| f.told && theirs.contains(&f.unix.as_raw_fd()))
}

/// A [`LOOKUP`] by process `pid` (RELAYS_LOCK not held): `fds` is the proof.
pub(super) fn looked_up(fds: &[OwnedFd], pid: i32) -> Result<(), c_int> {
    let id = check_proof(ASK, fds)?;
    with_passed(|v| {
        if let Some(p) = v.iter_mut().find(|p| p.id == id) {
            p.lookups = p.lookups.saturating_add(1);
            if pid > 0 && !p.receivers.contains(&pid) {
                p.receivers.push(pid);
            }
        }
    });
    log!(
        "relay: process {pid} received a passed connection (inode {})",
        id.1
    );
    Ok(())
}

/// The program closes (or leaves at exit) its last numbers `program` of a relayed connection
/// whose relay this process runs (`e`, `r`; `fd` one of them, still open): when it was
/// passed, it is kept as an unrelayed one would be (`keep.rs`), with this process's copy of
/// A for a receiver that has not asked yet.
pub(crate) fn closing_relayed(fd: c_int, program: &[c_int], e: &Entry, r: &Arc<Relay>) {
    let me = table::PID.load(Ordering::Relaxed);
    if r.owner() != Owner::of_tree(me) {
        return;
    }
    let Some(&id) = e.socket.get() else {
        return;
    };
    if !table::entries_of_socket(id).is_empty() || !with_passed(|v| v.iter().any(|p| p.id == id)) {
        return;
    }
    keep::closing(fd, program, id, None, Some(r));
}

/// The program's numbers of connection `id` now may name a socket another process holds:
/// their close looks for holders (`keep.rs`), as after a fork.
fn mark_passed(id: (u64, u64)) {
    for (_, e) in table::entries_of_socket(id) {
        e.forked.store(true, Ordering::Relaxed);
    }
}

// ---------------------------------------------------------------------------------------
// The program's side.

/// The descriptors that SCM_RIGHTS messages in `m`'s control buffer carry.
///
/// # Safety
/// `m` is a valid message header whose control buffer is `msg_controllen` bytes.
pub(crate) unsafe fn rights(m: &libc::msghdr) -> Vec<c_int> {
    let mut fds = Vec::new();
    if m.msg_control.is_null() || m.msg_controllen == 0 {
        return fds;
    }
    // A header's `cmsg_len` larger than the whole buffer (near usize::MAX, its alignment
    // wraps and CMSG_NXTHDR gives the same header again) ends the walk, and no buffer holds
    // more headers than fit in it.
    let controllen = m.msg_controllen;
    let mut headers = controllen / std::mem::size_of::<libc::cmsghdr>();
    // SAFETY: walking the caller's control buffer with the C library's macros, which stay
    // within `msg_controllen`.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(m);
        while !c.is_null() && headers > 0 && (*c).cmsg_len as usize <= controllen {
            headers -= 1;
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<c_int>();
                // A `cmsg_len` past the control buffer (the program's mistake, which the
                // kernel answers with EINVAL) is cut at its end: nothing is read beyond it.
                let end = (m.msg_control as usize).saturating_add(m.msg_controllen);
                let room = end.saturating_sub(data as usize);
                let len = ((*c).cmsg_len as usize)
                    .saturating_sub(libc::CMSG_LEN(0) as usize)
                    .min(room);
                for i in 0..len / std::mem::size_of::<c_int>() {
                    fds.push(data.add(i).read_unaligned());
                }
            }
            c = libc::CMSG_NXTHDR(m, c);
        }
    }
    fds
}

/// The passes [`passing`] noted before the program's send: [`sent`] keeps or undoes them.
#[must_use]
pub(crate) struct Noted(Vec<Note>);

enum Note {
    /// This process's connection `id`, with the number of its copy of the unix socket
    /// (-1: none).
    Own { id: (u64, u64), unix: c_int },
    /// Announced to `owner`, with a copy of the TCP socket (the proof of the undo).
    Told { owner: Owner, proof: OwnedFd },
}

impl Noted {
    /// Nothing noted.
    pub(crate) fn none() -> Noted {
        Noted(Vec::new())
    }
}

/// `sendmsg` on `sock` with SCM_RIGHTS naming `fds`: each SMC-R connection among them is
/// noted as passed before the message goes (see the module's doc: the receiver may look it
/// up before the sender's call returns), and [`sent`] undoes it when the send fails.
/// Nothing fails the program's call: a pass the owner cannot note reaches the receiver as
/// a silent socket.
pub(crate) fn passing(sock: c_int, fds: &[c_int]) -> Noted {
    let mut noted = Noted::none();
    // (The child of a `vfork` leaves its parent's table alone.)
    if table::borrowed_memory() {
        return noted;
    }
    let me = Owner::of_tree(table::PID.load(Ordering::Relaxed));
    let mut seen = Vec::new();
    for &fd in fds {
        if !table::maybe(fd) {
            continue;
        }
        let Some(e) = table::get(fd) else {
            continue;
        };
        let Some(&id) = e.socket.get() else {
            continue;
        };
        if seen.contains(&id) {
            continue;
        }
        let owner = match &e.kind {
            Kind::Smc(_) if e.ours() => me,
            Kind::Smc(_) => Owner::of_tree(e.pid),
            Kind::Relayed(r) => r.owner(),
            Kind::Inherited(Some(o)) => *o,
            _ => continue,
        };
        seen.push(id);
        let r = if owner == me {
            serve_passed();
            mark_passed(id);
            // A copy of the program's unix socket, for the time the pass is in flight.
            let unix = crate::relay::dup_high(sock).ok();
            match conn_of(id) {
                Some(conn) => note(id, conn, unix, false).map(|unix| Note::Own { id, unix }),
                None => Err(libc::ENOENT),
            }
        } else {
            // A copy of the program's TCP socket, the proof of an undo.
            match crate::relay::dup_high(fd) {
                Err(e) => Err(e),
                Ok(proof) => announce(owner, PASS, proof.as_raw_fd(), sock)
                    .map(|()| Note::Told { owner, proof }),
            }
        };
        match r {
            Ok(n) => {
                noted.0.push(n);
                log!(
                    "fd {fd}: SMC-R connection passed to another process (owner {})",
                    owner.pid
                )
            }
            Err(e) => log!(
                "fd {fd}: SMC-R connection passed to another process, not announced to its owner {} ({}): the receiver gets a silent socket",
                owner.pid,
                io::Error::from_raw_os_error(e)
            ),
        }
    }
    noted
}

/// The program's send on `sock` of the message whose passes [`passing`] noted returned:
/// `ok` when it went (then the passes are in flight), else they are undone (a failed or
/// retried send is no pass). Keeps the caller's errno.
pub(crate) fn sent(noted: Noted, sock: c_int, ok: bool) {
    if noted.0.is_empty() {
        return;
    }
    let errno = io::Error::last_os_error().raw_os_error().unwrap_or(0);
    for n in noted.0 {
        match (n, ok) {
            (Note::Own { id, unix }, true) => with_passed(|v| {
                if let Some(f) = v
                    .iter_mut()
                    .filter(|p| p.id == id)
                    .flat_map(|p| p.in_flight.iter_mut())
                    .find(|f| f.unix.as_raw_fd() == unix)
                {
                    f.sending = false;
                    f.at = Instant::now();
                }
            }),
            // (An announced pass is seen sent by its owner when its message is queued.)
            (Note::Told { .. }, true) => {}
            (Note::Own { id, unix }, false) => {
                let _ = unnote(id, |f| f.unix.as_raw_fd() == unix);
                log!("inode {}: the send of a pass failed: undone", id.1);
            }
            (Note::Told { owner, proof }, false) => {
                let r = announce(owner, UNPASS, proof.as_raw_fd(), sock);
                log!(
                    "inode {}: the send of a pass failed: undone by its owner {} ({})",
                    table::socket_id(proof.as_raw_fd()).map_or(0, |id| id.1),
                    owner.pid,
                    match r {
                        Ok(()) => "done".to_string(),
                        Err(e) => io::Error::from_raw_os_error(e).to_string(),
                    }
                );
            }
        }
    }
    crate::set_errno(errno);
}

/// Tell `owner` of a pass (`what`: [`PASS`]) of the connection whose TCP socket this
/// process has as `fd` through `unix`, or that its send failed ([`UNPASS`]).
fn announce(owner: Owner, what: u8, fd: c_int, unix: c_int) -> Result<(), c_int> {
    let s = connect_to(address(owner.pid, owner.nonce), Some(owner.pid))?;
    send_with_fds(s.as_raw_fd(), what, &[fd, unix])?;
    let (status, _) = recv_with_fds(s.as_raw_fd())?;
    if status != 0 {
        return Err(c_int::from(status));
    }
    Ok(())
}

/// A unix stream socket connected to `addr` with bounded waits (10 s for a full backlog;
/// the replies' timeouts set after the connect), whose server runs as this user or root
/// and, when given, is process `pid` (also the relay's request, `relay::request`).
pub(crate) fn connect_to(
    addr: (libc::sockaddr_un, libc::socklen_t),
    pid: Option<i32>,
) -> Result<OwnedFd, c_int> {
    connect_cred(addr, pid, Instant::now() + Duration::from_secs(10)).map(|(s, _)| s)
}

/// [`connect_to`], a full backlog tried again until `until` (at least once); the server's
/// pid with the socket. A server of another user (not root), or another process than `pid`,
/// is refused (EACCES) and logged: who bound the name first gets neither our descriptors
/// nor our data.
fn connect_cred(
    (addr, len): (libc::sockaddr_un, libc::socklen_t),
    pid: Option<i32>,
    until: Instant,
) -> Result<(OwnedFd, i32), c_int> {
    // SAFETY: a new socket of ours.
    let s = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if s < 0 {
        return Err(last_errno());
    }
    // SAFETY: just made.
    let s = unsafe { OwnedFd::from_raw_fd(s) };
    loop {
        // SAFETY: the address and its length.
        let r = unsafe {
            real::connect(
                s.as_raw_fd(),
                (&addr as *const libc::sockaddr_un).cast(),
                len,
            )
        };
        if r == 0 {
            break;
        }
        match last_errno() {
            libc::EINTR => {}
            // A full backlog (a unix connect completes at once or not at all).
            libc::EAGAIN if Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(5));
            }
            e => return Err(e),
        }
    }
    set_nonblocking(s.as_raw_fd(), false);
    set_timeouts(s.as_raw_fd(), Duration::from_secs(10));
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    match peer_cred(s.as_raw_fd()) {
        Some(c) if trusted_server(&c, me, pid) => Ok((s, c.pid)),
        c => {
            let (p, u) = c.map_or((0, u32::MAX), |c| (c.pid, c.uid));
            log!(
                "relay: the server at {} is process {p} of uid {u}, not {} of uid {me} or root: refused",
                address_text(&addr, len),
                pid.map_or("a process".to_string(), |p| format!("process {p}"))
            );
            Err(libc::EACCES)
        }
    }
}

/// Whether the server at the other end of a unix socket, of credentials `c`, may be asked
/// by this process (running as `me`): its user is ours or root, and it is process `pid` when
/// the asker knows which process it should be.
fn trusted_server(c: &libc::ucred, me: libc::uid_t, pid: Option<i32>) -> bool {
    pid.is_none_or(|p| c.pid == p) && (c.uid == me || c.uid == 0)
}

/// An abstract unix address as text (`@name`), for the log.
fn address_text(a: &libc::sockaddr_un, len: libc::socklen_t) -> String {
    let off = std::mem::offset_of!(libc::sockaddr_un, sun_path);
    let n = (len as usize).saturating_sub(off).min(a.sun_path.len());
    let b: Vec<u8> = a.sun_path[..n].iter().map(|&c| c as u8).collect();
    match b.split_first() {
        Some((0, name)) => format!("@{}", String::from_utf8_lossy(name)),
        _ => String::from_utf8_lossy(&b).into_owned(),
    }
}

/// `recvmsg` brought SCM_RIGHTS with `fds`: give each SMC-R connection among them an entry
/// (see the module's doc). The look-ups of all of them take at most [`LOOKUP_CONNECT_WAIT`]
/// in all (a name held by a listener that never accepts, or an owner that never answers,
/// holds the program's `recvmsg` no longer); one that runs out of time leaves its socket
/// as it is.
pub(crate) fn received(fds: &[c_int]) {
    let until = Instant::now() + LOOKUP_CONNECT_WAIT;
    for &fd in fds {
        // (A listening socket carries no connection.)
        if !crate::hooks::is_inet_stream(fd) || sock_opt(fd, libc::SO_ACCEPTCONN) != Some(0) {
            continue;
        }
        let Some(id) = table::socket_id(fd) else {
            continue;
        };
        // A connection this process has under another number: a duplicate.
        if let Some((_, e)) = table::entries_of_socket(id)
            .into_iter()
            .find(|(n, e)| *n != fd && !matches!(e.kind, Kind::Epoll(_)))
        {
            if let Ok(Some(old)) = table::set(fd, e) {
                table::release(old);
            }
            continue;
        }
        match lookup(fd, id, until) {
            Ok(owner) => {
                log!(
                    "fd {fd}: a passed SMC-R connection of process {}: its relay is asked for at the first use",
                    owner.pid
                );
                let e = Entry::new(Kind::Inherited(Some(owner)));
                let _ = e.socket.set(id);
                if let Ok(Some(old)) = table::set(fd, e) {
                    table::release(old);
                }
            }
            // No name: not an SMC-R connection (or its owner cannot be reached).
            Err(libc::ECONNREFUSED) | Err(libc::ENOENT) => {}
            Err(e) => log!(
                "fd {fd}: a passed socket whose owner did not answer ({}): left as it is",
                io::Error::from_raw_os_error(e)
            ),
        }
    }
}

/// Ask who owns the connection whose TCP socket this process has as `fd` (identity `id`),
/// by `until` (every connect and answer; ETIMEDOUT once it passed): at its name; when
/// another socket holds that (one that is refused, or does not answer as the owner), at the
/// names bound under it ([`random_name`], found by [`candidates`]).
fn lookup(fd: c_int, id: (u64, u64), until: Instant) -> Result<Owner, c_int> {
    if Instant::now() >= until {
        return Err(libc::ETIMEDOUT);
    }
    let first = ask_owner(name(id), fd, until);
    match first {
        Ok(o) => return Ok(o),
        // Nothing holds the name: not a connection passed by an owner this process can reach.
        Err(libc::ECONNREFUSED) if !name_held(id) => return first,
        Err(_) => {}
    }
    let mut last = first;
    for n in candidates(id) {
        if Instant::now() >= until {
            return Err(libc::ETIMEDOUT);
        }
        last = ask_owner(abstract_address(&n), fd, until);
        if let Ok(o) = &last {
            log!(
                "fd {fd}: the name of a passed connection is held by another socket; its owner {} answered at @{n}",
                o.pid
            );
            break;
        }
    }
    last
}

/// A [`LOOKUP`] at `addr` with the proof `fd`, answered by `until`.
fn ask_owner(
    addr: (libc::sockaddr_un, libc::socklen_t),
    fd: c_int,
    until: Instant,
) -> Result<Owner, c_int> {
    let (s, pid) = connect_cred(addr, None, until)?;
    // (Not the 10 s of a relay's request: the rest of the look-up's time.)
    let left = until.saturating_duration_since(Instant::now());
    set_timeouts(s.as_raw_fd(), left.max(Duration::from_millis(1)));
    send_with_fds(s.as_raw_fd(), LOOKUP, &[fd])?;
    let nonce = lookup_answer(s.as_raw_fd())?;
    Ok(Owner { pid, nonce })
}

/// Whether a socket holds connection `id`'s name (one that refused the connect: bound, not
/// listening): a bind of it fails.
fn name_held(id: (u64, u64)) -> bool {
    // SAFETY: a new socket of ours.
    let s = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if s < 0 {
        return false;
    }
    // SAFETY: just made.
    let s = unsafe { OwnedFd::from_raw_fd(s) };
    let (addr, len) = name(id);
    // SAFETY: the address and its length.
    let r = unsafe {
        libc::bind(
            s.as_raw_fd(),
            (&addr as *const libc::sockaddr_un).cast(),
            len,
        )
    };
    r != 0 && last_errno() == libc::EADDRINUSE
}

/// The answer to a [`LOOKUP`]: a status byte of 0 and the owner's nonce.
fn lookup_answer(s: c_int) -> Result<u64, c_int> {
    let mut b = [0u8; 9];
    let mut got = 0;
    while got < b.len() {
        // SAFETY: our socket and the rest of the buffer.
        let r = unsafe { real::recv(s, b[got..].as_mut_ptr().cast(), b.len() - got, 0) };
        if r < 0 && last_errno() == libc::EINTR {
            continue;
        }
        if r <= 0 {
            break;
        }
        got += r as usize;
    }
    match (got, b[0]) {
        (9, 0) => {
            let mut n = [0u8; 8];
            n.copy_from_slice(&b[1..]);
            let nonce = u64::from_le_bytes(n);
            (nonce != 0).then_some(nonce).ok_or(libc::EPROTO)
        }
        (n, e) if n >= 1 && e != 0 => Err(c_int::from(e)),
        _ => Err(libc::EPROTO),
    }
}

#[cfg(test)]
#[path = "pass_tests.rs"]
mod tests;
