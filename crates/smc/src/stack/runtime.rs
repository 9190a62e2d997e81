//! The runtime thread, and the linger of a stack that goes away.

use super::*;

/// The runtime thread: polls completions and device events, fires timers.
pub(super) fn runtime(weak: Weak<Inner>, devices: Vec<Device>, cqs: Vec<CompletionQueue>) {
    let mut wcs = [WorkCompletion::EMPTY; 64];
    let mut armed = false;
    // Parked at the last look: when the earliest timer seen then falls due, and how many
    // looks since found the core locked.
    let mut parked: Option<Instant> = None;
    let mut skipped = 0;
    // The TSC's rate, measured a step at each look under the lock (`crate::clock`): this
    // thread wakes at least every `MAX_SLEEP`; the stack reads the monotonic clock meanwhile.
    let mut measuring = crate::clock::Measurement::start();
    loop {
        let Some(inner) = weak.upgrade() else {
            return;
        };
        if inner.stop.load(Ordering::Acquire) {
            return;
        }
        let mut dev_events = Vec::new();
        for (i, d) in devices.iter().enumerate() {
            while let Some(e) = d.poll_event() {
                dev_events.push((i, e));
            }
        }
        // Parked, this thread only keeps time: a look that finds an application thread
        // working under the core lock (the poller, likely) leaves it alone and sleeps another
        // slice, unless a timer is due or a device had news. Waiting for the lock would cost
        // both threads a futex call, and that thread a wake-up of this one on its path.
        let mut core = None;
        if let Some(due) = parked.filter(|_| dev_events.is_empty() && skipped < PARKED_SKIPS) {
            core = inner.try_lock();
            let now = core.is_none().then(Instant::now);
            if let Some(left) = now.and_then(|now| due.checked_duration_since(now)) {
                skipped += 1;
                drop(core);
                drop(inner);
                std::thread::sleep(left.min(PARK_SLICE));
                continue;
            }
        }
        let core = core.unwrap_or_else(|| inner.lock());
        skipped = 0;
        parked = None;
        let (deadline, closing) = {
            let mut core = core;
            let closing = std::mem::take(&mut core.closing);
            if let Some(done) = measuring.as_mut().and_then(|m| m.step()) {
                if let Some(scale) = done {
                    core.clock.install(scale);
                }
                measuring = None;
            }
            let now = core.now();
            // Completions are polled under the lock, so that busy-polling application
            // threads and this thread process them in order.
            let mut did = core.poll_completions(&mut wcs) || !dev_events.is_empty();
            for (dev, e) in &dev_events {
                core.device_event(*dev, *e);
            }
            did |= core.report_failed_posts();
            if !core.retired.is_empty() {
                core.retired
                    .retain(|_, (_, at)| at.elapsed() < RETIRED_GRACE);
            }
            if core.ep.poll_timeout().is_some_and(|t| t <= now) {
                let Core { ep, fab, .. } = &mut *core;
                ep.handle_timeout(fab, now);
                did = true;
            }
            if did {
                core.drain();
                if !dev_events.is_empty() {
                    core.wake_all();
                }
            }
            let deadline = if did {
                None
            } else {
                let sleep = core
                    .ep
                    .poll_timeout()
                    .map(|t| t.saturating_duration_since(now))
                    .unwrap_or(MAX_SLEEP)
                    .min(MAX_SLEEP);
                // An application thread polls the completion queues: stay off them (both
                // would wake for every message) and only keep time.
                let recent = now.saturating_duration_since(Timestamp::from_duration(
                    Duration::from_micros(inner.poller_at.load(Ordering::Acquire)),
                )) < POLLER_RECENT;
                // An event loop that handles the completions at every wait call (the
                // preload's epoll, poll and select) sees its connections' news itself.
                let loop_recent = now.saturating_duration_since(Timestamp::from_duration(
                    Duration::from_micros(inner.loop_polled_at.load(Ordering::Acquire)),
                )) < LOOP_RECENT;
                // A poller handles every completion (and wakes whoever waits for it); one
                // that polled recently will likely poll again soon, unless others wait.
                let park = inner.poller.load(Ordering::Acquire)
                    || (inner.followers.load(Ordering::Acquire) == 0
                        && (loop_recent || (recent && !core.needs_runtime_polling())));
                Some((sleep, park))
            };
            (deadline, closing)
        };
        drop(closing);
        let Some((sleep, park)) = deadline else {
            armed = false;
            continue;
        };
        if park {
            drop(inner);
            armed = false;
            parked = Some(Instant::now() + sleep);
            std::thread::sleep(sleep.min(PARK_SLICE));
            continue;
        }
        if !armed {
            // Arm, then look once more before sleeping (verbs arm-then-recheck).
            for cq in &cqs {
                cq.req_notify();
            }
            armed = true;
            continue;
        }
        drop(inner);
        let mut fds: Vec<rustix::event::PollFd<'_>> = cqs
            .iter()
            .map(|c| rustix::event::PollFd::from_borrowed_fd(c.fd(), rustix::event::PollFlags::IN))
            .collect();
        let ts = rustix::event::Timespec {
            tv_sec: sleep.as_secs() as i64,
            tv_nsec: i64::from(sleep.subsec_nanos()),
        };
        let _ = rustix::event::poll(&mut fds, Some(&ts));
        let ready: Vec<bool> = fds.iter().map(|f| !f.revents().is_empty()).collect();
        drop(fds);
        if ready.iter().any(|r| *r) {
            let Some(inner) = weak.upgrade() else {
                return;
            };
            // Consuming the channel's readiness while an application thread sleeps on it
            // would leave that thread asleep: it consumes it itself. (The flag changes only
            // under the core lock.)
            let core = inner.lock();
            if !inner.poller.load(Ordering::Acquire) {
                for (cq, r) in cqs.iter().zip(ready) {
                    if r {
                        cq.ack_notify();
                    }
                }
            }
            drop(core);
        }
        armed = false;
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Linger, as a kernel keeps a closed socket's FIN exchange going: connections the
        // application closed may still wait for the peer's closing CDC (PeerCloseWait1/2).
        // Without this, the link group would vanish under them and the peer would see its
        // connection reset (LinkGroupLost) instead of closed. Bounded by CLOSE_LINGER.
        let deadline = Instant::now() + CLOSE_LINGER;
        let core = self.core.get_mut().unwrap_or_else(|p| p.into_inner());
        let mut wcs = [WorkCompletion::EMPTY; 64];
        while core.ep.link_groups().any(|g| !g.conns.is_empty()) && Instant::now() < deadline {
            let mut did = core.poll_completions(&mut wcs);
            did |= core.report_failed_posts();
            let now = core.now();
            if core.ep.poll_timeout().is_some_and(|t| t <= now) {
                let Core { ep, fab, .. } = &mut *core;
                ep.handle_timeout(fab, now);
                did = true;
            }
            core.drain();
            if !did {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        if let Some(c) = self.control.get() {
            c.close();
        }
    }
}
