//! Completion queues of the roce backend: a locked queue filled by posting threads and the
//! device's progress thread, a condition variable for blocking waits, and an eventfd as the
//! completion channel (rung only when armed).

use crate::error::Result;
use crate::shm::mem;
use crate::types::WorkCompletion;
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use super::device::lock;

pub(crate) struct RoceCq {
    queue: Mutex<VecDeque<WorkCompletion>>,
    queued: AtomicBool,
    cond: Condvar,
    /// Threads blocked in [`wait`](RoceCq::wait): without one, a push wakes nobody (no
    /// futex system call on every completion).
    sleepers: AtomicUsize,
    armed: AtomicBool,
    bell: OwnedFd,
}

impl RoceCq {
    pub(crate) fn new() -> Result<RoceCq> {
        Ok(RoceCq {
            queue: Mutex::new(VecDeque::new()),
            queued: AtomicBool::new(false),
            cond: Condvar::new(),
            sleepers: AtomicUsize::new(0),
            armed: AtomicBool::new(false),
            bell: mem::new_eventfd()?,
        })
    }

    pub(crate) fn push_all(&self, wcs: impl IntoIterator<Item = WorkCompletion>) {
        let any = {
            let mut q = lock(&self.queue);
            let before = q.len();
            q.extend(wcs);
            let any = q.len() > before;
            if any {
                self.queued.store(true, Ordering::Release);
            }
            any
        };
        if any {
            // A sleeper counts itself under the queue's lock before it looks at the queue,
            // and the push above was made under that lock: either it saw the completion or
            // it is counted here.
            if self.sleepers.load(Ordering::Acquire) > 0 {
                self.cond.notify_all();
            }
            // Pairs with the fence in `req_notify`: either the waiter sees `queued` or we see
            // `armed` (a store followed by a load of another location needs a full fence).
            std::sync::atomic::fence(Ordering::SeqCst);
            if self.armed.load(Ordering::Acquire) && self.armed.swap(false, Ordering::AcqRel) {
                mem::ring_eventfd(self.bell.as_fd());
            }
        }
    }

    pub(crate) fn push(&self, wc: WorkCompletion) {
        self.push_all([wc]);
    }

    pub(crate) fn poll(&self, out: &mut [WorkCompletion]) -> usize {
        if !self.queued.load(Ordering::Acquire) {
            return 0;
        }
        let mut q = lock(&self.queue);
        let n = out.len().min(q.len());
        for (slot, wc) in out.iter_mut().zip(q.drain(..n)) {
            *slot = wc;
        }
        if q.is_empty() {
            self.queued.store(false, Ordering::Release);
        }
        n
    }

    pub(crate) fn maybe_ready(&self) -> bool {
        self.queued.load(Ordering::Acquire)
    }

    pub(crate) fn wait(
        &self,
        out: &mut [WorkCompletion],
        timeout: Option<Duration>,
    ) -> Result<usize> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut q = lock(&self.queue);
        loop {
            if !q.is_empty() {
                drop(q);
                return Ok(self.poll(out));
            }
            self.sleepers.fetch_add(1, Ordering::AcqRel);
            match deadline {
                None => q = self.cond.wait(q).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        self.sleepers.fetch_sub(1, Ordering::AcqRel);
                        return Ok(0);
                    }
                    q = self
                        .cond
                        .wait_timeout(q, d - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
            self.sleepers.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Disarm the channel without reading it: for the thread that armed it and is about to
    /// receive the completions itself (see `ReceiveWait`), whose own pushes need ring nobody.
    pub(crate) fn disarm(&self) {
        self.armed.store(false, Ordering::Release);
    }

    pub(crate) fn req_notify(&self) {
        self.armed.store(true, Ordering::Release);
        std::sync::atomic::fence(Ordering::SeqCst);
        // A completion queued before arming rings at once, as the shm channel does for
        // messages already waiting.
        if self.queued.load(Ordering::Acquire) && self.armed.swap(false, Ordering::AcqRel) {
            mem::ring_eventfd(self.bell.as_fd());
        }
    }

    pub(crate) fn ack_notify(&self) {
        mem::drain_eventfd(&self.bell);
    }

    pub(crate) fn channel(&self) -> BorrowedFd<'_> {
        self.bell.as_fd()
    }
}
