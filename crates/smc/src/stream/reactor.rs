//! Handshakes that wait for a slow peer, driven by one thread per listener.
//!
//! A setup worker sets up the connections it accepts itself as long as the client answers
//! promptly ([`WORKER_WAIT`]). A client that takes longer (it sends nothing yet, or stops in
//! the middle of its CLC handshake; a flood of such connections is the case) is parked here
//! instead of keeping a thread: one thread watches every parked socket (and setup waker) with
//! epoll, hands what arrives to the endpoint, and delivers each connection to `accept` once
//! its handshake ended. Parked handshakes are also looked at every [`SWEEP`], so that one the
//! runtime ended (a CLC or LLC timer) leaves at once.

use std::collections::{BTreeSet, HashMap};
use std::io;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use rustix::event::epoll;

use super::{
    finish, AcceptShared, FallbackReason, Progress, Rendezvous, SmcStream, CLC_EYECATCHER,
};

/// How long a setup worker waits for a client in the middle of its handshake before it
/// parks the connection here (a prompt client's next message takes a round trip, a first
/// contact's LLC exchanges a few more).
pub(super) const WORKER_WAIT: Duration = Duration::from_millis(5);

/// How long a setup worker waits for a client's first bytes (assert-peer) before it parks the
/// connection here: a client sends its Proposal as soon as its TCP handshake is done.
pub(super) const FIRST_BYTES_WAIT: Duration = Duration::from_millis(2);

/// Parked handshakes are looked at this often even without an event (their state only: a
/// timer of the runtime may have ended them).
const SWEEP: Duration = Duration::from_millis(100);

/// A connection waiting for its peer.
pub(super) enum Parked {
    /// Assert-peer: the client's first bytes (a CLC Proposal, or anything else: TCP) have not
    /// come yet; without them by `deadline` the connection is TCP.
    FirstBytes {
        sock: TcpStream,
        peer: SocketAddr,
        deadline: Instant,
        recv_buffer: Option<u32>,
    },
    /// A server rendezvous waiting for the client.
    Handshake(Box<Rendezvous>),
}

/// The parking place of one listener.
#[derive(Debug)]
pub(super) struct Reactor {
    /// The epoll set of the parked sockets (made with the listener, so that parking never
    /// needs a descriptor: a listener short of them parks too).
    ep: OwnedFd,
    inbox: Mutex<Vec<ParkedBox>>,
    /// Wakes the thread (new connections parked, the listener closed).
    wake: OwnedFd,
    /// Whether the thread runs (started at the first park).
    running: Mutex<bool>,
}

/// `Parked` with a `Debug` (the listener's shared state is `Debug`).
pub(super) struct ParkedBox(Parked);

impl std::fmt::Debug for ParkedBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Parked::FirstBytes { peer, .. } => write!(f, "FirstBytes({peer})"),
            Parked::Handshake(r) => write!(f, "Handshake({})", r.peer),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Reactor {
    pub(super) fn new() -> io::Result<Reactor> {
        let flags = rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC;
        let wake = smc_fabric::fdplace::make(|| rustix::event::eventfd(0, flags))?;
        let ep = smc_fabric::fdplace::make(|| epoll::create(epoll::CreateFlags::CLOEXEC))?;
        epoll::add(
            &ep,
            &wake,
            epoll::EventData::new_u64(WAKE),
            epoll::EventFlags::IN,
        )?;
        Ok(Reactor {
            ep,
            inbox: Mutex::new(Vec::new()),
            wake,
            running: Mutex::new(false),
        })
    }

    /// Wake the thread (after the listener closed: it ends, dropping what is parked).
    pub(super) fn wake(&self) {
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
    }

    /// Park `p` for the listener `shared`; `Err` gives it back when no thread could be
    /// started to drive it (the caller then finishes it itself).
    pub(super) fn park(&self, shared: &Arc<AcceptShared>, p: Parked) -> Result<(), Parked> {
        {
            let mut running = lock(&self.running);
            if !*running {
                let weak = Arc::downgrade(shared);
                let spawned = smc_fabric::threads::spawn_running(
                    std::thread::Builder::new().name("smc-clc".into()),
                    move || run(weak),
                );
                if let Err(e) = spawned {
                    tracing::debug!(%e, "no thread for parked handshakes");
                    return Err(p);
                }
                *running = true;
            }
        }
        lock(&self.inbox).push(ParkedBox(p));
        self.wake();
        Ok(())
    }
}

/// The epoll token of the wake-up eventfd; others are a parked entry's number, shifted
/// left by one, with the low bit set for its setup waker.
const WAKE: u64 = u64::MAX;

struct Entry {
    parked: Parked,
    /// The setup waker registered for a handshake, if any (kept to unregister it).
    waker: Option<Arc<OwnedFd>>,
}

/// The parked entries by number, and the first-bytes deadlines among them in order: a turn
/// of the thread finds the next deadline and the expired ones without visiting every parked
/// connection (a flood parks thousands; each event would otherwise cost a visit of all).
#[derive(Default)]
struct ParkedSet {
    entries: HashMap<u64, Entry>,
    /// `(deadline, id)` of every `Parked::FirstBytes` entry.
    first_bytes: BTreeSet<(Instant, u64)>,
}

impl ParkedSet {
    fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn first_bytes_deadline(e: &Entry) -> Option<Instant> {
        match &e.parked {
            Parked::FirstBytes { deadline, .. } => Some(*deadline),
            Parked::Handshake(_) => None,
        }
    }

    fn insert(&mut self, id: u64, e: Entry) {
        self.remove(id);
        if let Some(d) = Self::first_bytes_deadline(&e) {
            self.first_bytes.insert((d, id));
        }
        self.entries.insert(id, e);
    }

    fn remove(&mut self, id: u64) -> Option<Entry> {
        let e = self.entries.remove(&id)?;
        if let Some(d) = Self::first_bytes_deadline(&e) {
            self.first_bytes.remove(&(d, id));
        }
        Some(e)
    }

    /// The earliest first-bytes deadline.
    fn next_deadline(&self) -> Option<Instant> {
        self.first_bytes.first().map(|(d, _)| *d)
    }

    /// The entries whose first bytes did not come by `now`.
    fn expired(&self, now: Instant) -> impl Iterator<Item = u64> + '_ {
        self.first_bytes
            .iter()
            .take_while(move |(d, _)| *d <= now)
            .map(|(_, id)| *id)
    }

    /// The entries that are handshakes.
    fn handshakes(&self) -> Vec<u64> {
        self.entries
            .iter()
            .filter(|(_, e)| matches!(e.parked, Parked::Handshake(_)))
            .map(|(id, _)| *id)
            .collect()
    }
}

fn run(weak: Weak<AcceptShared>) {
    let Some(shared) = weak.upgrade() else { return };
    // The thread keeps the listener's shared state (and with it the epoll set) until the
    // listener closes (`stop`).
    let ep_owner = shared.clone();
    drop(shared);
    let ep = &ep_owner.reactor.ep;
    let mut entries = ParkedSet::default();
    let mut next: u64 = 1;
    let mut events: Vec<epoll::Event> = Vec::with_capacity(256);
    let mut next_sweep = Instant::now() + SWEEP;
    loop {
        let now = Instant::now();
        let timeout = if entries.is_empty() {
            None
        } else {
            let first_bytes = entries.next_deadline();
            let until = first_bytes.map_or(next_sweep, |d| d.min(next_sweep));
            Some(until.saturating_duration_since(now))
        };
        let ts = timeout.map(|t| rustix::event::Timespec {
            tv_sec: t.as_secs() as i64,
            tv_nsec: i64::from(t.subsec_nanos()),
        });
        events.clear();
        match epoll::wait(ep, rustix::buffer::spare_capacity(&mut events), ts.as_ref()) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => {
                tracing::warn!(%e, "epoll wait failed");
                std::thread::sleep(SWEEP);
            }
        }
        let Some(shared) = weak.upgrade() else { return };
        if shared.stop.load(std::sync::atomic::Ordering::Acquire) {
            // The listener is gone: what is parked ends with it (a rendezvous is abandoned
            // as if its TCP connection broke).
            return;
        }
        let mut ready: Vec<u64> = Vec::new();
        for ev in &events {
            let t = ev.data.u64();
            if t == WAKE {
                super::super::stack::Notifiers::drain(&shared.reactor.wake);
                let new = std::mem::take(&mut *lock(&shared.reactor.inbox));
                for ParkedBox(p) in new {
                    let id = next;
                    next += 1;
                    if watch(ep, id, &p).is_ok() {
                        entries.insert(
                            id,
                            Entry {
                                parked: p,
                                waker: None,
                            },
                        );
                        // Bytes may have come before the socket was watched.
                        ready.push(id << 1);
                    } else {
                        // Cannot watch it: it ends as if its peer had gone.
                        drop(p);
                    }
                }
            } else {
                ready.push(t);
            }
        }
        let now = Instant::now();
        // Clients whose first bytes did not come in time.
        ready.extend(entries.expired(now).map(|id| id << 1));
        ready.sort_unstable();
        ready.dedup_by_key(|t| *t >> 1);
        for t in ready {
            let id = t >> 1;
            let Some(e) = entries.remove(id) else {
                continue;
            };
            if let Some(e) = drive(ep, id, e, &shared, now, true) {
                entries.insert(id, e);
            }
        }
        if now >= next_sweep {
            next_sweep = now + SWEEP;
            for id in entries.handshakes() {
                let Some(e) = entries.remove(id) else {
                    continue;
                };
                if let Some(e) = drive(ep, id, e, &shared, now, false) {
                    entries.insert(id, e);
                }
            }
        }
    }
}

/// Register the socket of `p` with token `id`.
fn watch(ep: &OwnedFd, id: u64, p: &Parked) -> rustix::io::Result<()> {
    let fd = match p {
        Parked::FirstBytes { sock, .. } => sock.as_fd(),
        Parked::Handshake(r) => r.sock.as_fd(),
    };
    epoll::add(
        ep,
        fd,
        epoll::EventData::new_u64(id << 1),
        epoll::EventFlags::IN | epoll::EventFlags::RDHUP,
    )
}

/// Stop watching entry `e`'s descriptors.
fn unwatch(ep: &OwnedFd, e: &Entry) {
    let fd = match &e.parked {
        Parked::FirstBytes { sock, .. } => sock.as_fd(),
        Parked::Handshake(r) => r.sock.as_fd(),
    };
    let _ = epoll::delete(ep, fd);
    if let Some(w) = &e.waker {
        let _ = epoll::delete(ep, &**w);
    }
}

/// Make progress on one parked connection (`event`: its socket or waker said something, so
/// read; else only look at its state); `Some` while it still waits.
fn drive(
    ep: &OwnedFd,
    id: u64,
    mut e: Entry,
    shared: &Arc<AcceptShared>,
    now: Instant,
    event: bool,
) -> Option<Entry> {
    match e.parked {
        Parked::FirstBytes {
            sock,
            peer,
            deadline,
            recv_buffer,
        } => {
            let first = match peek_first(&sock) {
                Ok(f) => f,
                Err(err) => {
                    tracing::debug!(%err, %peer, "parked connection failed before the rendezvous");
                    let _ = epoll::delete(ep, &sock);
                    return None;
                }
            };
            let clc = match first {
                First::Clc => true,
                First::Other => false,
                First::Nothing if now < deadline => {
                    return Some(Entry {
                        parked: Parked::FirstBytes {
                            sock,
                            peer,
                            deadline,
                            recv_buffer,
                        },
                        waker: None,
                    });
                }
                First::Nothing => false,
            };
            let _ = epoll::delete(ep, &sock);
            if !clc {
                let r = sock.set_read_timeout(None).map(|()| {
                    let s = SmcStream::fallback(
                        &shared.stack,
                        Arc::new(sock),
                        FallbackReason::NoProposal,
                        Vec::new(),
                        true,
                    );
                    (s, peer)
                });
                shared.deliver(r);
                return None;
            }
            let r = match Rendezvous::start(&shared.stack, Arc::new(sock), false, recv_buffer, peer)
            {
                Ok(r) => r,
                Err(err) => {
                    tracing::debug!(%err, %peer, "rendezvous failed");
                    return None;
                }
            };
            let e = Entry {
                parked: Parked::Handshake(r),
                waker: None,
            };
            if watch(ep, id, &e.parked).is_err() {
                return None;
            }
            drive(ep, id, e, shared, now, true)
        }
        Parked::Handshake(mut r) => {
            if let Err(err) = if event {
                r.wait_and_read(Some(Duration::ZERO))
            } else {
                Ok(())
            } {
                let err = r.abandon(err);
                tracing::debug!(%err, peer = %r.peer, "rendezvous failed");
                e.parked = Parked::Handshake(r);
                unwatch(ep, &e);
                return None;
            }
            match r.progress() {
                Ok(Progress::Setup { .. }) => {
                    if e.waker.is_none() {
                        if let Some(w) = r.waker.clone() {
                            let data = epoll::EventData::new_u64((id << 1) | 1);
                            if epoll::add(ep, &*w, data, epoll::EventFlags::IN).is_ok() {
                                e.waker = Some(w);
                            }
                        }
                    }
                    e.parked = Parked::Handshake(r);
                    Some(e)
                }
                Ok(Progress::Ended(res)) => {
                    let peer = r.peer;
                    e.parked = Parked::Handshake(r);
                    unwatch(ep, &e);
                    match finish(res) {
                        Ok(s) => shared.deliver(Ok((s, peer))),
                        Err(err) => tracing::debug!(%err, %peer, "rendezvous failed"),
                    }
                    None
                }
                Err(err) => {
                    let err = r.abandon(err);
                    tracing::debug!(%err, peer = %r.peer, "rendezvous failed");
                    e.parked = Parked::Handshake(r);
                    unwatch(ep, &e);
                    None
                }
            }
        }
    }
}

/// What a client sent first.
pub(super) enum First {
    /// A CLC eye catcher.
    Clc,
    /// Anything else (or its end of stream): the connection is TCP.
    Other,
    /// Nothing yet, or part of an eye catcher.
    Nothing,
}

/// Look (without waiting) at the first bytes of `sock`.
pub(super) fn peek_first(sock: &TcpStream) -> io::Result<First> {
    let mut buf = [0u8; 4];
    match rustix::net::recv(
        sock,
        &mut buf,
        rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT,
    ) {
        Ok((0, _)) => Ok(First::Other),
        Ok((n, _)) if buf[..n] != CLC_EYECATCHER[..n] => Ok(First::Other),
        Ok((4, _)) => Ok(First::Clc),
        Ok(_) => Ok(First::Nothing),
        Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => Ok(First::Nothing),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection whose first bytes are due at `deadline`.
    fn first_bytes(l: &std::net::TcpListener, deadline: Instant) -> Entry {
        let sock = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        Entry {
            parked: Parked::FirstBytes {
                peer: sock.peer_addr().expect("peer"),
                sock,
                deadline,
                recv_buffer: None,
            },
            waker: None,
        }
    }

    /// The set answers the next first-bytes deadline and the expired entries as a scan of
    /// every entry would, as entries come, go and come back with another deadline.
    #[test]
    fn parked_set_orders_first_bytes_deadlines() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut set = ParkedSet::default();
        assert!(set.is_empty() && set.next_deadline().is_none());
        set.insert(1, first_bytes(&l, at(30)));
        set.insert(2, first_bytes(&l, at(10)));
        set.insert(3, first_bytes(&l, at(20)));
        assert_eq!(set.next_deadline(), Some(at(10)));
        assert_eq!(set.expired(at(20)).collect::<Vec<_>>(), [2, 3]);
        assert!(set.remove(2).is_some());
        assert!(set.remove(2).is_none());
        assert_eq!(set.next_deadline(), Some(at(20)));
        // Back under the same number with a later deadline: only the new one counts.
        set.insert(3, first_bytes(&l, at(40)));
        assert_eq!(set.expired(at(35)).collect::<Vec<_>>(), [1]);
        assert_eq!(set.next_deadline(), Some(at(30)));
        assert!(set.handshakes().is_empty());
        assert!(set.remove(1).is_some() && set.remove(3).is_some());
        assert!(set.is_empty() && set.next_deadline().is_none());
    }
}
