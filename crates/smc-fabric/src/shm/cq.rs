//! Completion queues: locally generated completions plus receive-side progress over the shared
//! rings of attached QPs, with an eventfd completion channel.

use super::device::{lock, DeviceHandle};
use super::mem;
use super::qp::QpShared;
use crate::error::{FabricError, Result};
use crate::sync::fence;
use crate::types::WorkCompletion;
use rustix::event::{epoll, PollFd, PollFlags};
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A completion queue.
///
/// The completion channel is an epoll instance holding edge-triggered eventfds: one for locally
/// generated completions and one doorbell per attached QP direction (the only fds a peer ever
/// gets). A peer can thus only ring, never drain, the doorbells of other connections.
pub(crate) struct CqShared {
    pub(crate) dev: Arc<DeviceHandle>,
    epfd: OwnedFd,
    local_bell: OwnedFd,
    armed: AtomicBool,
    local: Mutex<VecDeque<WorkCompletion>>,
    /// Whether `local` may hold completions (set when one is queued, cleared when a poll
    /// emptied it; both under its lock), for the lock-free [`CqShared::maybe_ready`].
    local_queued: AtomicBool,
    /// QPs whose send or receive queue completes here (detached when the QP is destroyed).
    qps: Mutex<Vec<Arc<QpShared>>>,
}

impl CqShared {
    pub(crate) fn new(dev: Arc<DeviceHandle>) -> Result<Arc<CqShared>> {
        let epfd = crate::fdplace::make(|| epoll::create(epoll::CreateFlags::CLOEXEC))
            .map_err(|e| FabricError::os("epoll_create", e))?;
        let local_bell = mem::new_eventfd()?;
        epoll::add(
            &epfd,
            &local_bell,
            epoll::EventData::new_u64(0),
            epoll::EventFlags::IN | epoll::EventFlags::ET,
        )
        .map_err(|e| FabricError::os("epoll_ctl", e))?;
        Ok(Arc::new(CqShared {
            dev,
            epfd,
            local_bell,
            armed: AtomicBool::new(false),
            local: Mutex::new(VecDeque::new()),
            local_queued: AtomicBool::new(false),
            qps: Mutex::new(Vec::new()),
        }))
    }

    /// The completion channel (pollable epoll fd).
    pub(crate) fn channel(&self) -> BorrowedFd<'_> {
        self.epfd.as_fd()
    }

    /// Add a per-QP doorbell eventfd to the channel.
    pub(crate) fn add_bell(&self, bell: BorrowedFd<'_>) -> Result<()> {
        epoll::add(
            &self.epfd,
            bell,
            epoll::EventData::new_u64(1),
            epoll::EventFlags::IN | epoll::EventFlags::ET,
        )
        .map_err(|e| FabricError::os("epoll_ctl", e))
    }

    /// Remove a doorbell (explicitly: the peer's copy of the fd keeps the registration alive
    /// otherwise).
    pub(crate) fn remove_bell(&self, bell: BorrowedFd<'_>) {
        let _ = epoll::delete(&self.epfd, bell);
    }

    pub(crate) fn attach(&self, qp: &Arc<QpShared>) {
        {
            let mut qps = lock(&self.qps);
            if qps.iter().any(|q| Arc::ptr_eq(q, qp)) {
                return;
            }
            qps.push(qp.clone());
        }
        // A waiter may have armed the channel before this QP existed (its `req_notify` armed
        // only the QPs attached then): arm the new QP's doorbell as it would have, or the
        // QP's first messages ring nothing and the waiter sleeps through them. (A `req_notify`
        // after the push above arms it itself.)
        fence(Ordering::SeqCst);
        if self.armed.load(Ordering::Relaxed) && std::ptr::eq(Arc::as_ptr(&qp.recv_cq), self) {
            qp.arm_recv_doorbell();
        }
    }

    pub(crate) fn detach(&self, qp: &QpShared) {
        lock(&self.qps).retain(|q| !std::ptr::eq(Arc::as_ptr(q), qp));
    }

    /// Queue a locally generated completion and ring the channel if a waiter armed it.
    pub(crate) fn push(&self, wc: WorkCompletion) {
        {
            let mut q = lock(&self.local);
            q.push_back(wc);
            self.local_queued.store(true, Ordering::Release);
        }
        self.notify_if_armed();
    }

    /// Queue several completions at once.
    pub(crate) fn push_all(&self, wcs: impl IntoIterator<Item = WorkCompletion>) {
        let mut any = false;
        {
            let mut q = lock(&self.local);
            for wc in wcs {
                q.push_back(wc);
                any = true;
            }
            if any {
                self.local_queued.store(true, Ordering::Release);
            }
        }
        if any {
            self.notify_if_armed();
        }
    }

    pub(crate) fn notify_if_armed(&self) {
        fence(Ordering::SeqCst);
        if self.armed.load(Ordering::Relaxed) && self.armed.swap(false, Ordering::AcqRel) {
            mem::ring_eventfd(self.local_bell.as_fd());
        }
    }

    /// Poll up to `out.len()` completions without blocking.
    ///
    /// Nothing is locked that cannot hold something: the local queue only when
    /// `local_queued` says it may hold completions, a QP's receive side only when its ring's
    /// tail moved past what we consumed (both hints have no false negatives for what happened
    /// before the call). A poll that finds one CDC thus takes two locks instead of five, and an
    /// empty poll (the second device's queue, a spinning reader's idle look) one.
    pub(crate) fn poll(&self, out: &mut [WorkCompletion]) -> usize {
        let mut n = self.pop_local(out, 0);
        if n == out.len() {
            return n;
        }
        let mut failed: Vec<Arc<QpShared>> = Vec::new();
        {
            let qps = lock(&self.qps);
            for qp in qps.iter() {
                if std::ptr::eq(Arc::as_ptr(&qp.recv_cq), self) && qp.maybe_readable() {
                    let (k, broken) = qp.progress_recv(&mut out[n..]);
                    n += k;
                    if broken {
                        failed.push(qp.clone());
                    }
                }
                if std::ptr::eq(Arc::as_ptr(&qp.send_cq), self) && qp.has_pending() {
                    qp.progress_send();
                }
                if n == out.len() {
                    break;
                }
            }
        }
        // (Looked at first: taking the empty vector apart costs as much as a poll's lookup.)
        if !failed.is_empty() {
            for qp in failed {
                qp.enter_error("receive ring corrupted by peer");
            }
        }
        // Completions generated by the send progress above.
        self.pop_local(out, n)
    }

    /// Move locally generated completions into `out[n..]`; returns the new count.
    fn pop_local(&self, out: &mut [WorkCompletion], mut n: usize) -> usize {
        if n == out.len() || !self.local_queued.load(Ordering::Acquire) {
            return n;
        }
        let mut q = lock(&self.local);
        while n < out.len() {
            match q.pop_front() {
                Some(wc) => {
                    out[n] = wc;
                    n += 1;
                }
                None => break,
            }
        }
        if q.is_empty() {
            self.local_queued.store(false, Ordering::Relaxed);
        }
        n
    }

    /// Whether a [`poll`](Self::poll) may find something: a queued local completion, a message
    /// in an attached QP's receive ring, or queued sends to move on. No false negatives for
    /// what happened before the call; cheap enough to spin on (atomic loads, and the QP list's
    /// lock, which only attach and detach take otherwise).
    pub(crate) fn maybe_ready(&self) -> bool {
        if self.local_queued.load(Ordering::Acquire) {
            return true;
        }
        let qps = lock(&self.qps);
        qps.iter().any(|qp| {
            (std::ptr::eq(Arc::as_ptr(&qp.recv_cq), self) && qp.maybe_readable())
                || (std::ptr::eq(Arc::as_ptr(&qp.send_cq), self) && qp.has_pending())
        })
    }

    /// For a spinning poller: publish `word` to the peers whose SENDs complete here (see
    /// [`QpShared::exchange_spin_words`]) and hand each peer's word to `peer`.
    pub(crate) fn spin_words(&self, word: u64, peer: &mut dyn FnMut(u64)) {
        let qps = lock(&self.qps);
        for qp in qps
            .iter()
            .filter(|qp| std::ptr::eq(Arc::as_ptr(&qp.recv_cq), self))
        {
            if let Some(w) = qp.exchange_spin_words(word) {
                peer(w);
            }
        }
    }

    /// Arm the completion channel: the eventfd becomes readable at the next completion.
    /// Callers must poll once more after arming before sleeping.
    pub(crate) fn req_notify(&self) {
        self.armed.store(true, Ordering::Relaxed);
        let qps: Vec<Arc<QpShared>> = lock(&self.qps).clone();
        for qp in &qps {
            if std::ptr::eq(Arc::as_ptr(&qp.recv_cq), self) {
                qp.arm_recv_doorbell();
            }
            if std::ptr::eq(Arc::as_ptr(&qp.send_cq), self) {
                qp.arm_send_space();
            }
        }
        fence(Ordering::SeqCst);
    }

    /// Reset the channel counter after the eventfd was reported readable.
    pub(crate) fn ack_notify(&self) {
        // The channel fired: like a verbs CQ it is disarmed until the next `req_notify`, so
        // completions that arrive while the consumer is awake ring no doorbell.
        self.armed.store(false, Ordering::Relaxed);
        for qp in lock(&self.qps).iter() {
            if std::ptr::eq(Arc::as_ptr(&qp.recv_cq), self) {
                qp.disarm_recv_doorbell();
            }
        }
        // Edge-triggered registrations: fetching the ready events resets the channel; the
        // eventfd counters themselves are never read (a peer cannot drain them for us either).
        let zero = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        loop {
            let mut buf = [std::mem::MaybeUninit::<epoll::Event>::uninit(); 16];
            match epoll::wait(&self.epfd, &mut buf[..], Some(&zero)) {
                Ok((ready, _)) if ready.len() == 16 => continue,
                Err(rustix::io::Errno::INTR) => continue,
                _ => break,
            }
        }
    }

    /// Block until at least one completion is available or `timeout` elapses (`None`: forever).
    pub(crate) fn wait(
        &self,
        out: &mut [WorkCompletion],
        timeout: Option<Duration>,
    ) -> Result<usize> {
        if out.is_empty() {
            return Err(FabricError::InvalidArgument("empty completion buffer"));
        }
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let n = self.poll(out);
            if n > 0 {
                return Ok(n);
            }
            self.req_notify();
            let n = self.poll(out);
            if n > 0 {
                return Ok(n);
            }
            let remaining = match deadline {
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Ok(0);
                    }
                    Some(d - now)
                }
                None => None,
            };
            let ts = remaining.and_then(|r| rustix::event::Timespec::try_from(r).ok());
            let mut fds = [PollFd::new(&self.epfd, PollFlags::IN)];
            match rustix::event::poll(&mut fds, ts.as_ref()) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(FabricError::os("poll completion channel", e)),
            }
            self.ack_notify();
        }
    }
}
