//! The stream's data path: a write from the application into the peer's RMBE, a read out of
//! ours, and the waiting in between.

use super::*;

/// A sleep up to this many times the longest spin counts as short (see [`AdaptiveSpin`]).
const SPIN_GROW_WINDOW: u32 = 4;

/// The adaptive spin budget starts here after a short sleep.
const SPIN_GROW_START: Duration = Duration::from_micros(5);

/// Adaptive spinning of a blocked read that follows a write of the stream (it likely waits
/// for a reply) before it sleeps, for streams without busy polling, in the manner of a
/// hypervisor's halt polling. A sleep costs two system calls here
/// and a wake-up (and a doorbell system call) at the peer; when the peer answers within a few
/// tens of microseconds, polling the completion queues for that long instead saves all three.
/// A short sleep without a spin (within [`SPIN_GROW_WINDOW`] × `max`) starts a spin of
/// [`SPIN_GROW_START`]; a spin that found nothing doubles (up to `max`) when the sleep after
/// it was shorter than the spin, and halves otherwise, down to nothing; a spin that caught
/// the answer stays. A connection whose peer is slow or idle soon sleeps at once again and
/// costs no CPU, and so does one whose peer cannot answer while this thread spins (a loaded
/// machine: the spin takes the CPU the peer needs).
///
/// On software RoCE devices ([`AdaptiveSpin::for_stack`]) the policy is another, since there
/// a short sleep after a failed spin does not say that a longer spin would have caught the
/// answer: when both processes run on one CPU, the peer answers *because* this thread gave
/// the CPU up, however long it spun (measured: 1-byte ping-pong p50 27 µs without the spin,
/// 63–92 µs with a 50 µs one, which "grew" after every such sleep; docs/performance.md).
/// There a spin starts at `max`; one that catches the answer doubles back towards `max`, one
/// that fails is quartered, and when it falls to nothing the next [`hold`](Self::hold) short
/// sleeps start none, the hold doubling (up to [`ROCE_SPIN_HOLD_MAX`]) every time a series of
/// spins fails and going back to one when a spin catches: two processes on one CPU pay a
/// failed series every thousand round trips, two on two CPUs spin every time.
#[derive(Debug)]
pub(crate) struct AdaptiveSpin {
    /// Longest spin (the configured [`adaptive_spin`](crate::StackConfig::adaptive_spin)).
    pub(super) max: Option<Duration>,
    /// The budget after a short sleep without a spin.
    start: Duration,
    /// The software RoCE policy (see above): only a spin that caught the answer grows it.
    catch_only: bool,
    /// Current budget in nanoseconds.
    budget_ns: std::sync::atomic::AtomicU64,
    /// `catch_only`: short sleeps that still start no spin.
    hold: std::sync::atomic::AtomicU32,
    /// `catch_only`: the hold set when the next series of spins fails.
    backoff: std::sync::atomic::AtomicU32,
    /// The stream wrote since its last read returned data: a read now likely waits for a
    /// reply, which spinning catches.
    after_write: std::sync::atomic::AtomicBool,
}

/// A read of at least this many bytes makes the next wait of the stream's reader a bulk one
/// (see `quiet_wake`).
const STREAM_READ: usize = 16 * 1024;

/// Longest hold of the software RoCE policy, in short sleeps (see [`AdaptiveSpin`]).
const ROCE_SPIN_HOLD_MAX: u32 = 1024;

impl AdaptiveSpin {
    pub(crate) fn new(max: Option<Duration>) -> AdaptiveSpin {
        AdaptiveSpin::with_start(max, SPIN_GROW_START)
    }

    /// The spin of a stream of `stack`: with a software RoCE device, the policy for it (see
    /// above), which starts at the longest spin.
    pub(crate) fn for_stack(max: Option<Duration>, inner: &crate::stack::Inner) -> AdaptiveSpin {
        if inner.cqs.iter().any(|c| c.needs_receiver()) {
            AdaptiveSpin::catching(max)
        } else {
            AdaptiveSpin::new(max)
        }
    }

    /// The software RoCE policy (see above).
    pub(crate) fn catching(max: Option<Duration>) -> AdaptiveSpin {
        AdaptiveSpin {
            catch_only: true,
            ..AdaptiveSpin::with_start(max, max.unwrap_or_default())
        }
    }

    /// A spin like this one, for another stream.
    pub(crate) fn fresh(&self) -> AdaptiveSpin {
        AdaptiveSpin {
            catch_only: self.catch_only,
            ..AdaptiveSpin::with_start(self.max, self.start)
        }
    }

    /// A spin whose budget starts at `start` after a short sleep (instead of
    /// [`SPIN_GROW_START`]).
    pub(crate) fn with_start(max: Option<Duration>, start: Duration) -> AdaptiveSpin {
        AdaptiveSpin {
            start,
            max: max.filter(|m| !m.is_zero()),
            catch_only: false,
            budget_ns: std::sync::atomic::AtomicU64::new(0),
            hold: std::sync::atomic::AtomicU32::new(0),
            backoff: std::sync::atomic::AtomicU32::new(1),
            after_write: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// How long to spin now; `None`: sleep at once.
    pub(crate) fn budget(&self) -> Option<Duration> {
        self.max?;
        match self.budget_ns.load(Ordering::Relaxed) {
            0 => None,
            ns => Some(Duration::from_nanos(ns)),
        }
    }

    /// A spin of the current budget found the answer, `in_time` (before the budget ran out)
    /// or not (the thread was kept off the CPU meanwhile: under the software RoCE policy a
    /// failed spin).
    pub(crate) fn caught(&self, in_time: bool) {
        let Some(max) = self.max.filter(|_| self.catch_only) else {
            return;
        };
        let cur = self.budget_ns.load(Ordering::Relaxed);
        if !in_time {
            self.slept(Duration::from_nanos(cur.max(1)), Duration::ZERO);
            return;
        }
        let max = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX);
        self.budget_ns
            .store(cur.saturating_mul(2).min(max), Ordering::Relaxed);
        self.backoff.store(1, Ordering::Relaxed);
    }

    /// A blocked call slept for `d` after its spin of `spun` (zero: none) found nothing.
    pub(crate) fn slept(&self, spun: Duration, d: Duration) {
        let Some(max) = self.max else {
            return;
        };
        let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let cur = self.budget_ns.load(Ordering::Relaxed);
        let next = if spun.is_zero() {
            // No spin: start one when the sleep was short. A sleep includes this thread's
            // own wake-up, which a loaded machine stretches well beyond the spin.
            if d > max.saturating_mul(SPIN_GROW_WINDOW) {
                cur
            } else if self.catch_only && self.hold.load(Ordering::Relaxed) > 0 {
                self.hold.fetch_sub(1, Ordering::Relaxed);
                cur
            } else {
                ns(self.start).min(ns(max))
            }
        } else if self.catch_only {
            // The spin failed, whatever the sleep after it (see above).
            let quarter = cur / 4;
            if quarter < 1_000 {
                let b = self.backoff.load(Ordering::Relaxed);
                self.hold.store(b, Ordering::Relaxed);
                self.backoff
                    .store((b * 2).min(ROCE_SPIN_HOLD_MAX), Ordering::Relaxed);
                0
            } else {
                quarter
            }
        } else if d <= spun {
            // The answer came within one more spin: spin longer.
            cur.saturating_mul(2).min(ns(max))
        } else {
            // The spin did not help (the peer is slow, or needed this CPU to answer).
            // Below a microsecond a spin catches nothing: stop.
            let half = cur / 2;
            if half < 1_000 {
                0
            } else {
                half
            }
        };
        self.budget_ns.store(next, Ordering::Relaxed);
    }
}

/// How many times the calling thread was switched out, preempted or asleep
/// (`getrusage(RUSAGE_THREAD)`'s `ru_nivcsw` and `ru_nvcsw`).
fn switches() -> Option<i64> {
    // SAFETY: getrusage fills the plain-old-data struct it is given and nothing else.
    unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        (libc::getrusage(libc::RUSAGE_THREAD, &mut ru) == 0).then_some(ru.ru_nivcsw + ru.ru_nvcsw)
    }
}

impl SmcStream {
    /// Send `data` as urgent data (MSG_OOB): its last byte is the urgent byte, delivered in
    /// line (SO_OOBINLINE); the peer's [`at_mark`](Self::at_mark) says when its next read
    /// starts with it. Over SMC-R all of `data` is written at once (RFC 7609 §4.7.5), so it
    /// must fit in the peer's RMBE ([`send_buffer_size`](Self::send_buffer_size)); blocks
    /// (within the write timeout) until it does, the peer knowing meanwhile that urgent
    /// data is pending. Until the peer has read the urgent byte no further byte is written
    /// (§4.7.5: no RDMA write before the urgent data is acknowledged; smc-rs has no send
    /// buffer to park them in), so a following write blocks meanwhile. Over TCP:
    /// `send(MSG_OOB)`.
    pub fn send_urgent(&mut self, data: &[u8]) -> io::Result<()> {
        if data.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "no urgent byte",
            ));
        }
        let id = match &self.kind {
            Kind::Tcp { .. } => {
                let mut off = 0;
                while off < data.len() {
                    off +=
                        rustix::net::send(&self.sock, &data[off..], rustix::net::SendFlags::OOB)?;
                }
                return Ok(());
            }
            Kind::Smc(h) => h.id,
        };
        if data.len() > self.send_buffer_size()? {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "urgent data larger than the peer's receive buffer",
            ));
        }
        // A WRITE that fails part way (a link failure) takes only a part: the rest goes as
        // urgent data again.
        let mut off = 0;
        while off < data.len() {
            off += self.smc_write_inner(id, &data[off..], true)?;
        }
        Ok(())
    }

    /// SIOCATMARK: whether the next byte read is the urgent byte the peer sent last.
    pub fn at_mark(&self) -> io::Result<bool> {
        match &self.kind {
            Kind::Tcp { .. } => tcp_at_mark(&self.sock),
            Kind::Smc(h) => {
                let core = self.stack.inner.lock();
                Ok(core.ep.urgent_offset(h.id) == Some(0))
            }
        }
    }

    /// Wait until the stack made progress on connection `id` (or `wait` passed): spin on the
    /// completion queues first when busy polling is on (or, without it, for the adaptive spin
    /// budget, see [`AdaptiveSpin`]); then, unless another application thread does already,
    /// sleep on the completion channels and handle what arrives in this thread (no hop
    /// through the runtime thread); otherwise sleep on the connection's condition variable.
    /// May return with the endpoint's output not drained: the caller drains (`Core::drain`)
    /// before it lets the lock go.
    fn wait_progress<'a>(
        &self,
        inner: &'a crate::stack::Inner,
        id: TcpId,
        mut core: crate::stack::CoreGuard<'a>,
        now: smc_proto::Timestamp,
        wait: Duration,
        want: Want,
    ) -> (crate::stack::CoreGuard<'a>, Option<smc_proto::Timestamp>) {
        let mut wcs = [smc_fabric::WorkCompletion::EMPTY; 32];
        // A thread that a bulk read's sleep left under `SCHED_BATCH` waits for something else
        // now (a reply, room to write): under its own policy again (smc-fabric sched.rs).
        if !self.quiet_wake(want) {
            smc_fabric::QuietWake::settle();
        }
        // Whether this thread is the poller (the flag changes only under the core lock).
        let mut polling = !inner.poller.swap(true, Ordering::AcqRel);
        // Adaptive spinning only for a read that follows a write of this stream (a reply
        // expected soon after a request); a streaming reader or a writer waiting for room
        // sleeps at once (on a loaded machine their spinning delays the peer that would end
        // the wait).
        let adaptive = self.busy_poll.is_none()
            && matches!(want, Want::Read)
            && self.spin.after_write.load(Ordering::Relaxed);
        let spin = self
            .busy_poll
            .or_else(|| adaptive.then(|| self.spin.budget()).flatten());
        // On software RoCE devices the completions come from datagrams that whoever holds a
        // `ReceiveWait` receives (the device's thread stays off the socket meanwhile): a
        // spinning thread takes that duty and looks at the socket itself (a non-blocking
        // `recvmmsg`) at every look at the queues, as a sleeping one sleeps in it below.
        let mut receivers: Vec<smc_fabric::ReceiveWait<'_>> = Vec::new();
        if let Some(spin) = spin {
            receivers = inner.cqs.iter().filter_map(|c| c.receive_wait()).collect();
            // Where the next byte a read waits for lands in our RMB.
            let prefetch = match want {
                // As many bytes as the last read took (a reply as long as the last one).
                Want::Read => core.ep.next_read_at(id).and_then(|(lgr, rmb, at)| {
                    let mr = core.fab.rmbs.get(&(lgr, rmb))?.iter().flatten().next()?;
                    mr.prefetch_hint(usize::try_from(at).ok()?, self.last_read)
                }),
                Want::Write(_) => None,
            };
            // Spinning as the poller keeps the runtime thread off the completion channels,
            // so the peer rings no doorbell (no system call on either side). Recorded as a
            // recent poll, so that the runtime thread stays off them between two waits too
            // (else it arms them while this thread writes, and every completion of ours
            // writes its eventfd and wakes it onto the lock).
            // `now` is the caller's clock reading, taken just before (a read costs about as
            // much as handling a message: none is taken that is not needed).
            if polling {
                let micros = u64::try_from(now.as_duration().as_micros()).unwrap_or(u64::MAX);
                inner.poller_at.store(micros, Ordering::Release);
            }
            let until = now + spin.min(wait);
            // Under the software RoCE policy: whether the thread is preempted during the spin
            // (see `caught` below).
            let switched = (adaptive && self.spin.catch_only).then(switches).flatten();
            // The clock as of the last look at it: at most one round of spins
            // (SPINS_BETWEEN_LOOKS) old, a few µs, which the engine's timers (500 µs and
            // longer) do not notice. The poll after a wake-up of the spin takes it instead of
            // reading the clock (25 ns, as much as handling a message) on the path of a reply.
            let mut looked_at = now;
            // Looks at the sockets of software RoCE devices so far.
            let mut looks = 0u32;
            loop {
                // Completions that do not concern this call (our own SENDs completing, other
                // connections' data) are handled here and the spin goes on: returning would
                // only make the caller look again and come back.
                let mut polled_at = Some(looked_at);
                let handled = core.poll_completions_at(&mut wcs, &mut polled_at);
                // Whether what this poll handled, or what another thread (the runtime thread,
                // or another stream's) handled while the lock was free, lets the call go on.
                // Looked at once per look at the queues: after a wake-up of the spin, the poll
                // comes first (it likely holds the answer). What the poll left to the runtime
                // (the events of the messages, a CDC they call for) is then done by the
                // caller after its read or write, in one drain with what that leaves (the
                // callers drain before they let the lock go).
                if progressed(&core, id, want) {
                    if polling {
                        inner.poller.store(false, Ordering::Release);
                    }
                    // Found at the first look at the socket, the answer had come before the
                    // spin began (it says nothing about spinning). Else: caught by the spin,
                    // or only because this thread was kept off the CPU meanwhile, likely by
                    // the peer on the same CPU (no catch: the spin only delayed it).
                    if adaptive && looks > 1 {
                        let kept_off = switched.is_some_and(|n| switches() != Some(n));
                        self.spin.caught(core.now() <= until && !kept_off);
                    }
                    // The time those completions were handled at (see `looked_at`): the
                    // caller need not read the clock again.
                    return (core, polled_at);
                }
                if handled {
                    core.drain();
                }
                looked_at = core.now();
                if looked_at >= until {
                    break;
                }
                drop(core);
                // Software RoCE: one non-blocking receive per look (a system call costs about
                // as much as a round of pauses below).
                for r in &receivers {
                    r.try_receive();
                }
                looks += 1;
                // Spin without the lock (no cache line of the core bounces, nobody else is
                // kept out) until a completion queue may hold something; every so often take
                // the lock anyway, to see the clock and what other threads handled.
                let spins = if receivers.is_empty() {
                    SPINS_BETWEEN_LOOKS
                } else {
                    1
                };
                for _ in 0..spins {
                    if inner.cqs.iter().any(|cq| cq.maybe_ready()) {
                        // Likely the peer's CDC, with its data before it: the data's line
                        // travels while the poll handles the CDC.
                        if let Some(p) = prefetch {
                            p.issue();
                        }
                        break;
                    }
                    std::hint::spin_loop();
                }
                core = inner.lock();
                if !polling {
                    polling = !inner.poller.swap(true, Ordering::AcqRel);
                    if polling {
                        inner.poller_at.store(core.now_micros(), Ordering::Release);
                    }
                }
            }
        }
        let slept = Instant::now();
        if polling {
            inner.poller_at.store(core.now_micros(), Ordering::Release);
            // Another thread may have handled what this call waits for (see above). Looked at
            // before arming, since an armed channel makes the peer ring a doorbell for every
            // message until someone sleeps on it; from here until the sleep this thread holds
            // the lock, so nobody else handles a completion meanwhile.
            if progressed(&core, id, want) {
                core.drain();
                inner.poller.store(false, Ordering::Release);
                return (core, None);
            }
            // Arm, then look once more before sleeping (verbs arm-then-recheck).
            for cq in &inner.cqs {
                cq.req_notify();
            }
            if !core.poll_completions(&mut wcs) {
                drop(core);
                // A datagram on the socket of a software RoCE device wakes this thread, which
                // receives it itself (no hop through the device's thread on the path of a
                // reply).
                if receivers.is_empty() {
                    receivers = inner.cqs.iter().filter_map(|c| c.receive_wait()).collect();
                }
                // A bulk wait on software RoCE (see `quiet_wake`): its wake-up leaves the CPU
                // to whatever runs there, likely the peer sending more.
                let quiet = (!receivers.is_empty() && self.quiet_wake(want))
                    .then(smc_fabric::QuietWake::begin);
                // One software RoCE device and nothing else to watch: sleep in its socket's
                // receive call (one system call per wake-up, as a blocking TCP read; `poll`
                // and then the receive are two) for a while, then in `poll` for the rest.
                let blocked = match (&inner.cqs[..], &receivers[..]) {
                    ([_], [r]) if wait >= smc_fabric::ReceiveWait::BLOCK => r.block(),
                    _ => None,
                };
                if blocked.is_none() {
                    let wait = wait.saturating_sub(slept.elapsed());
                    // The completion channels, and the sockets of software RoCE devices.
                    let mut fds: Vec<rustix::event::PollFd<'_>> = inner
                        .cqs
                        .iter()
                        .map(|c| {
                            rustix::event::PollFd::from_borrowed_fd(
                                c.fd(),
                                rustix::event::PollFlags::IN,
                            )
                        })
                        .collect();
                    fds.extend(receivers.iter().map(|r| {
                        rustix::event::PollFd::from_borrowed_fd(
                            r.fd(),
                            rustix::event::PollFlags::IN,
                        )
                    }));
                    let ts = rustix::event::Timespec {
                        tv_sec: wait.as_secs() as i64,
                        tv_nsec: i64::from(wait.subsec_nanos()),
                    };
                    let _ = rustix::event::poll(&mut fds, Some(&ts));
                    let ready: Vec<bool> = fds.iter().map(|f| !f.revents().is_empty()).collect();
                    drop(fds);
                    for (cq, r) in inner.cqs.iter().zip(&ready) {
                        if *r {
                            cq.ack_notify();
                        }
                    }
                    for (r, readable) in receivers.iter().zip(&ready[inner.cqs.len()..]) {
                        if *readable {
                            r.receive();
                        }
                    }
                }
                drop(quiet);
                drop(receivers);
                if adaptive {
                    self.spin
                        .slept(spin.unwrap_or_default().min(wait), slept.elapsed());
                }
                core = inner.lock();
                core.poll_completions(&mut wcs);
            }
            core.drain();
            inner.poller.store(false, Ordering::Release);
            return (core, None);
        }
        // Sleeping on the condition variable, this thread receives nothing: the promise goes.
        drop(receivers);
        let Some(cond) = core.slots.get_mut(&id).map(|s| {
            s.waiters += 1;
            s.wake_queued = false;
            s.cond.clone()
        }) else {
            return (core, None);
        };
        core.sync_readable_events(id);
        inner.followers.fetch_add(1, Ordering::AcqRel);
        let mut core =
            crate::stack::CoreGuard::new(match cond.wait_timeout(core.into_std(), wait) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            });
        if adaptive {
            self.spin
                .slept(spin.unwrap_or_default().min(wait), slept.elapsed());
        }
        inner.followers.fetch_sub(1, Ordering::AcqRel);
        if let Some(s) = core.slots.get_mut(&id) {
            s.waiters = s.waiters.saturating_sub(1);
            s.wake_queued = false;
        }
        core.sync_readable_events(id);
        (core, None)
    }

    /// Whether a sleep for `want` waits for bulk data rather than for a reply, so that its
    /// wake-up need not preempt the thread running where it lands ([`smc_fabric::QuietWake`]):
    /// a read whose last read took at least [`STREAM_READ`] bytes, with nothing written since
    /// (a stream's sink; a read after a write waits for a reply, and the first read of a
    /// connection may be a request). A writer waiting for room is not one: measured, its
    /// quiet wake-ups made more context switches, not fewer (docs/performance.md, "A
    /// stream's reader that does not preempt its writer"). `SMC_ROCE_NO_QUIET_WAKE=1` turns
    /// it off.
    fn quiet_wake(&self, want: Want) -> bool {
        static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        matches!(want, Want::Read)
            && self.last_read >= STREAM_READ
            && !self.spin.after_write.load(Ordering::Relaxed)
            && !*OFF.get_or_init(|| std::env::var_os("SMC_ROCE_NO_QUIET_WAKE").is_some())
    }

    fn deadline(&self, t: Option<Duration>) -> Option<Instant> {
        t.map(|t| Instant::now() + t)
    }

    fn smc_read(&mut self, id: TcpId, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() || self.read_shut {
            return Ok(0);
        }
        let inner: &crate::stack::Inner = &self.stack.inner;
        let deadline = self.deadline(self.read_timeout);
        let mut core = inner.lock();
        let mut now = core.now();
        let result = loop {
            if core.slots.get(&id).is_some_and(|s| s.copying_out) {
                // Another read of this connection copies without the lock (see
                // `unlocked_read`): the bytes it copies are not ours; wait until consumed.
                drop(core);
                std::thread::yield_now();
                core = inner.lock();
                now = core.now();
                continue;
            }
            // Out of band (SO_OOBINLINE off): the urgent byte, when the read reached it, goes
            // to the slot rather than to `buf`.
            if let Some(slot) = &self.urgent_slot {
                let state = slot.state.load(Ordering::Acquire);
                if state & UrgentSlot::INLINE == 0 && core.ep.urgent_offset(id) == Some(0) {
                    let mut b = [0u8; 1];
                    let Core { ep, fab, .. } = &mut *core;
                    if let Ok(Ok(1)) =
                        ep.read_with(id, 1, now, |t, n| fab.copy_unread(t, &mut b[..n as usize]))
                    {
                        slot.state
                            .store(UrgentSlot::PRESENT | u16::from(b[0]), Ordering::Release);
                        continue;
                    }
                }
            }
            let max = u32::try_from(buf.len()).unwrap_or(u32::MAX);
            // A large read copies without the core lock (other connections' reads and
            // writes, and the completions, go on meanwhile).
            if max >= UNLOCKED_COPY_MIN {
                let (c, outcome) = unlocked_read(inner, core, id, buf, now);
                core = c;
                match outcome {
                    Unlocked::NotTaken => {}
                    Unlocked::Done(Ok(n)) => {
                        self.spin.after_write.store(false, Ordering::Relaxed);
                        self.last_read = n;
                        break Ok(n);
                    }
                    Unlocked::Done(Err(e)) => break Err(e),
                    // Consumed failed: the connection failed or went meanwhile; the checks
                    // below say how.
                    Unlocked::Failed => now = core.now(),
                }
            }
            // One pass: copied straight into `buf`, consumed, stopped in front of the urgent
            // byte as TCP does (so that `at_mark` can tell the next read starts with it).
            let Core { ep, fab, .. } = &mut *core;
            match ep.read_with(id, max, now, |target, n| {
                fab.copy_unread(target, &mut buf[..n as usize])
            }) {
                Ok(Ok(0)) | Err(_) => {}
                Ok(Ok(n)) => {
                    self.spin.after_write.store(false, Ordering::Relaxed);
                    self.last_read = n as usize;
                    break Ok(n as usize);
                }
                Ok(Err(e)) => break Err(e),
            }
            // What the peer wrote before it reset the connection comes before the reset.
            if let Some(s) = core.slots.get_mut(&id) {
                if !s.left_by_reset.is_empty() {
                    let n = s.left_by_reset.len().min(buf.len());
                    buf[..n].copy_from_slice(&s.left_by_reset[..n]);
                    s.left_by_reset.drain(..n);
                    self.last_read = n;
                    break Ok(n);
                }
            }
            // The end of stream the peer sent comes before a later failure (the peer said
            // it was done; a reset after that loses nothing).
            if core.ep.connection(id).is_some_and(|c| c.is_read_closed()) {
                break Ok(0);
            }
            if let Some(s) = core.slots.get(&id) {
                // The peer's process ended: over TCP, its kernel's FIN.
                if s.peer_exited {
                    break Ok(0);
                }
                if let Some(e) = s.error {
                    break Err(conn_error(e));
                }
            }
            if core.ep.connection(id).is_none() {
                break Ok(0);
            }
            // A reader that waits for the peer gains nothing from holding back the update
            // of what it wrote (the peer may be waiting for those bytes).
            if core.ep.flush(id, now).is_ok() {
                core.drain();
            }
            let wait = match self.wait_slice(deadline) {
                Ok(w) => w,
                Err(e) => break Err(e),
            };
            let (c, fresh) = self.wait_progress(inner, id, core, now, wait, Want::Read);
            core = c;
            now = fresh.unwrap_or_else(|| core.now());
        };
        // What the read (or the wait before it) left to the runtime: the consumer update
        // the read may call for, the events of the messages handled.
        core.drain();
        result
    }

    /// How long a blocked read or write may wait for progress now: `WouldBlock` in
    /// nonblocking mode or once the timeout's `deadline` passed, else up to one poll slice.
    fn wait_slice(&self, deadline: Option<Instant>) -> io::Result<Duration> {
        if self.nonblocking {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        match deadline {
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::ErrorKind::WouldBlock.into());
                }
                Ok(left.min(POLL_SLICE))
            }
            None => Ok(POLL_SLICE),
        }
    }

    fn smc_write(&mut self, id: TcpId, buf: &[u8]) -> io::Result<usize> {
        self.smc_write_inner(id, buf, false)
    }

    /// Write (or, `urgent`, write as urgent data, all or nothing) as much of `buf` as the
    /// peer's RMBE takes, blocking within the write timeout until some fits.
    fn smc_write_inner(&mut self, id: TcpId, buf: &[u8], urgent: bool) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let inner: &crate::stack::Inner = &self.stack.inner;
        let deadline = self.deadline(self.write_timeout);
        let mut core = inner.lock();
        loop {
            if let Some(s) = core.slots.get_mut(&id) {
                // The peer's process ended (see `Slot::peer_exited`): as after a TCP
                // peer's close, the first write is taken, the next fails with EPIPE.
                if s.peer_exited {
                    let first = !std::mem::replace(&mut s.wrote_after_peer_close, true);
                    core.drain();
                    return match first {
                        true => Ok(buf.len()),
                        false => Err(io::ErrorKind::BrokenPipe.into()),
                    };
                }
                if let Some(e) = s.error {
                    core.drain();
                    return Err(conn_error(e));
                }
            }
            if core.slots.get(&id).is_some_and(|s| s.copying_in) {
                // Another write of this connection copies without the lock into the space
                // this one would take (see `unlocked_write`): wait until it is produced.
                drop(core);
                std::thread::yield_now();
                core = inner.lock();
                continue;
            }
            let now = core.now();
            let sent = if urgent {
                core.send_urgent_direct(id, buf, now)
            } else if buf.len() >= UNLOCKED_COPY_MIN as usize {
                let (c, sent) = unlocked_write(inner, core, id, buf, now);
                core = c;
                sent
            } else {
                send_in_pieces(&mut core, id, buf, now)
            };
            match sent {
                Ok(0) => {}
                Ok(n) => {
                    core.drain();
                    self.spin.after_write.store(true, Ordering::Relaxed);
                    return Ok(n);
                }
                Err(e) => {
                    core.drain();
                    if let Some(err) = core.slots.get(&id).and_then(|s| s.error) {
                        return Err(conn_error(err));
                    }
                    // The peer closed: nothing written can reach it. TCP takes the first
                    // write after the peer's close (its kernel answers with a RST) and fails
                    // the next with EPIPE; so here. The bytes the peer sent before its close
                    // stay readable, as with TCP. (Failing this first write already made a
                    // program that reads the peer's last words only after a successful write,
                    // redis-benchmark against a server that refuses it, spin on the error.)
                    let peer_closed = core.ep.connection(id).is_some_and(|c| c.peer_closed());
                    if let Some(s) = core.slots.get_mut(&id) {
                        if peer_closed && !s.wrote_after_peer_close {
                            s.wrote_after_peer_close = true;
                            return Ok(buf.len());
                        }
                    }
                    return Err(io::Error::new(io::ErrorKind::BrokenPipe, e));
                }
            }
            core.drain();
            let wait = self.wait_slice(deadline)?;
            let want = if urgent {
                Want::Write(u32::try_from(buf.len()).unwrap_or(u32::MAX))
            } else {
                Want::Write(1)
            };
            core = self.wait_progress(inner, id, core, now, wait, want).0;
        }
    }
}

/// A write larger than a quarter of the peer's RMBE goes out in pieces of that size (at least
/// 16 KiB), each announced by its own CDC, so that the reader copies the first piece out of its
/// RMBE while this thread copies the next one in; in one piece, a write that fills the whole
/// RMBE makes the two copies take turns (measured: 256 KiB and 1 MiB writes into 256 KiB RMBEs
/// at 24 Gbit/s in one piece, 41 in pieces). Returns what was taken, as `send_direct` does.
fn send_in_pieces(
    core: &mut Core,
    id: TcpId,
    buf: &[u8],
    now: smc_proto::Timestamp,
) -> Result<usize, smc_proto::endpoint::EndpointError> {
    if buf.len() <= PIECE_MIN {
        // One piece whatever the RMBE (no lookup of the connection for a small write).
        return core.send_direct(id, buf, now);
    }
    let piece = core.ep.connection(id).map_or(buf.len(), |c| {
        (c.config().peer_rmbe_len as usize / 4).max(PIECE_MIN)
    });
    let mut total = 0usize;
    while total < buf.len() {
        let end = buf.len().min(total + piece);
        match core.send_direct(id, &buf[total..end], now) {
            Ok(n) => {
                total += n;
                if total < end {
                    // The RMBE is full (or n is 0): the caller waits for room.
                    break;
                }
                // Post this piece's WRITE and CDC before copying the next one.
                core.drain();
            }
            // What was taken stays taken; the failure shows at the next call.
            Err(_) if total > 0 => break,
            Err(e) => return Err(e),
        }
    }
    Ok(total)
}

/// [`send_in_pieces`] with each piece copied into the peer's RMBE outside the core lock:
/// under the lock, where the piece goes ([`Endpoint::write_plan`]) and that no other write of
/// the connection plans the same space (`copying_in`); without it, the copy
/// ([`smc_fabric::WritePlacer`]: neither the core lock nor the QP's send lock is held, so
/// the writers of many connections copy at once); under it again, the same bytes sent with
/// the pieces that were placed reported as such (the CDC announces them, RFC 7609 §4.5.1:
/// the peer reads only what a CDC's producer cursor covers, so bytes in the free space before
/// it are not seen). Where the plan is small or the fabric cannot place without its lock,
/// the piece goes the locked way.
///
/// [`Endpoint::write_plan`]: smc_proto::Endpoint::write_plan
fn unlocked_write<'a>(
    inner: &'a crate::stack::Inner,
    mut core: crate::stack::CoreGuard<'a>,
    id: TcpId,
    buf: &[u8],
    mut now: smc_proto::Timestamp,
) -> (
    crate::stack::CoreGuard<'a>,
    Result<usize, smc_proto::endpoint::EndpointError>,
) {
    let piece = core.ep.connection(id).map_or(buf.len(), |c| {
        (c.config().peer_rmbe_len as usize / 4).max(PIECE_MIN)
    });
    let mut total = 0usize;
    while total < buf.len() {
        let want = u32::try_from((buf.len() - total).min(piece)).unwrap_or(u32::MAX);
        let planned = core
            .plan_unlocked_write(id, want)
            .filter(|(plan, _)| plan.total() >= UNLOCKED_COPY_MIN);
        let Some((plan, placer)) = planned else {
            // The locked way (it also reports why nothing can be written).
            let rest = &buf[total..];
            let end = rest.len().min(piece);
            return match core.send_direct(id, &rest[..end], now) {
                Ok(n) => (core, Ok(total + n)),
                Err(_) if total > 0 => (core, Ok(total)),
                Err(e) => (core, Err(e)),
            };
        };
        if let Some(s) = core.slots.get_mut(&id) {
            s.copying_in = true;
        }
        drop(core);
        let bytes = &buf[total..total + plan.total() as usize];
        let mut placed = [false; 2];
        let mut off = 0usize;
        for (done, &(addr, len)) in placed.iter_mut().zip(&plan.pieces) {
            let len = len as usize;
            if len == 0 || !placer.place(&bytes[off..off + len], addr, plan.rkey) {
                break;
            }
            *done = true;
            off += len;
        }
        drop(placer);
        core = inner.lock();
        if let Some(s) = core.slots.get_mut(&id) {
            s.copying_in = false;
        }
        now = core.now();
        match core.send_preplaced(id, bytes, plan, placed, now) {
            Ok(n) => {
                total += n;
                if n < bytes.len() {
                    break;
                }
                // Post this piece's CDC before copying the next one.
                core.drain();
            }
            // What was taken stays taken; the failure shows at the next call.
            Err(_) if total > 0 => break,
            Err(e) => return (core, Err(e)),
        }
    }
    (core, Ok(total))
}

/// Smallest piece a large write is cut into (see [`send_in_pieces`]).
const PIECE_MIN: usize = 16 * 1024;

/// Whether a blocked read or write (`want`) of connection `id` can go on: data, end of
/// stream or room in the peer's RMBE, or a failure. A waiting thread looks at this whenever
/// it held the core lock anew, since whoever handles a completion (not necessarily the
/// waiting thread) changes it.
fn progressed(core: &Core, id: TcpId, want: Want) -> bool {
    let conn = core.ep.connection(id);
    // The usual answer first (a failure recorded meanwhile shows at the read that follows).
    if matches!(want, Want::Read) && conn.is_some_and(|c| c.readable() > 0) {
        return true;
    }
    if core.slots.get(&id).is_some_and(|s| s.error.is_some()) {
        return true;
    }
    match (conn, want) {
        (None, _) => true,
        (Some(c), Want::Read) => c.readable() > 0 || c.is_read_closed(),
        // What the send path can take (not `window()`: after urgent data no write is taken
        // until the peer read the urgent byte, whatever the window).
        (Some(c), Want::Write(n)) => c.write_room() >= n.max(1),
    }
}

/// What a blocked call waits for.
#[derive(Debug, Clone, Copy)]
pub(super) enum Want {
    /// Something to read (or the end of the stream).
    Read,
    /// This much room in the peer's RMBE (urgent data is written all at once).
    Write(u32),
}

/// SIOCATMARK on a TCP socket.
fn tcp_at_mark(sock: &TcpStream) -> io::Result<bool> {
    const SIOCATMARK: rustix::ioctl::Opcode = 0x8905;
    // SAFETY: SIOCATMARK takes a pointer to an int the kernel fills in, which is what
    // `Getter<_, c_int>` passes.
    let at = unsafe {
        rustix::ioctl::ioctl(
            sock,
            rustix::ioctl::Getter::<SIOCATMARK, std::ffi::c_int>::new(),
        )
    }?;
    Ok(at != 0)
}

/// Reads of at least this many bytes copy without the core lock ([`unlocked_read`]); below
/// it, the two more lock round trips cost more than the copy holds the lock (the ping-pong
/// path stays as it was).
const UNLOCKED_COPY_MIN: u32 = 4096;

/// What [`unlocked_read`] did.
enum Unlocked {
    /// Less than [`UNLOCKED_COPY_MIN`] unread bytes (or none, or an urgent byte next, or a
    /// failure): the read goes the locked way, which also reports what is wrong.
    NotTaken,
    /// Copied and consumed (or the copy failed: nothing consumed).
    Done(io::Result<usize>),
    /// Copied, but the connection failed or went before the bytes were consumed.
    Failed,
}

/// Read the unread bytes of connection `id` into `buf` with the copy outside the core lock:
/// under the lock, where they are (and that no other read copies them: `copying_out`);
/// without it, the copy out of our RMBE; under it again, consumed. The bytes between the
/// consumer cursor and the producer cursor are ours until consumed: the peer writes only
/// past the producer cursor (RFC 7609 §4.5.1, the free space is what the consumer cursor
/// returns), so they cannot change meanwhile, and the RMB's registration is held (`Arc`)
/// even if the connection goes. Urgent data (out of band, or a read stopping in front of
/// the urgent byte) is left to the locked path.
fn unlocked_read<'a>(
    inner: &'a crate::stack::Inner,
    mut core: crate::stack::CoreGuard<'a>,
    id: TcpId,
    buf: &mut [u8],
    now: smc_proto::Timestamp,
) -> (crate::stack::CoreGuard<'a>, Unlocked) {
    let max = u32::try_from(buf.len()).unwrap_or(u32::MAX);
    // (The caller saw that no other read of the connection copies.)
    if core.slots.get(&id).is_none() {
        return (core, Unlocked::NotTaken);
    }
    if core.ep.connection(id).map_or(0, |c| c.readable()) < UNLOCKED_COPY_MIN
        || core.ep.urgent_offset(id).is_some()
    {
        return (core, Unlocked::NotTaken);
    }
    let Ok(target) = core.ep.read_target(id, now) else {
        return (core, Unlocked::NotTaken);
    };
    let n = target.regions.total().min(max);
    let Some(mr) = core
        .fab
        .rmbs
        .get(&(target.lgr, target.rmb))
        .and_then(|r| r.iter().flatten().next())
        .cloned()
    else {
        return (core, Unlocked::NotTaken);
    };
    if let Some(s) = core.slots.get_mut(&id) {
        s.copying_out = true;
    }
    drop(core);
    let copied = crate::stack::copy_regions(&mr, &target, &mut buf[..n as usize]);
    drop(mr);
    let mut core = inner.lock();
    if let Some(s) = core.slots.get_mut(&id) {
        s.copying_out = false;
    }
    if let Err(e) = copied {
        return (core, Unlocked::Done(Err(e)));
    }
    let now = core.now();
    match core.ep.consumed(id, n, now) {
        Ok(()) => (core, Unlocked::Done(Ok(n as usize))),
        Err(_) => (core, Unlocked::Failed),
    }
}

impl Read for SmcStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match &mut self.kind {
            Kind::Tcp {
                leftover, strip, ..
            } => {
                while strip.active() && !strip.strip(leftover) {
                    let mut more = [0u8; 1024];
                    let n = (&*self.sock).read(&mut more)?;
                    if n == 0 {
                        strip.finish();
                    }
                    leftover.extend_from_slice(&more[..n]);
                }
                if !leftover.is_empty() {
                    let n = leftover.len().min(buf.len());
                    buf[..n].copy_from_slice(&leftover[..n]);
                    leftover.drain(..n);
                    return Ok(n);
                }
                (&*self.sock).read(buf)
            }
            Kind::Smc(h) => {
                let id = h.id;
                self.smc_read(id, buf)
            }
        }
    }
}

impl Write for SmcStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match &self.kind {
            Kind::Tcp { .. } => (&*self.sock).write(buf),
            Kind::Smc(h) => {
                let id = h.id;
                self.smc_write(id, buf)
            }
        }
    }

    /// Over SMC-R: announce bytes whose producer-cursor update coalescing holds back (see
    /// [`set_nodelay`](SmcStream::set_nodelay)) now.
    fn flush(&mut self) -> io::Result<()> {
        match &self.kind {
            Kind::Tcp { .. } => (&*self.sock).flush(),
            Kind::Smc(h) => {
                let mut core = self.stack.inner.lock();
                let now = core.now();
                // A connection that is gone or failed has nothing left to announce; its
                // error shows at the next read or write.
                if core.ep.flush(h.id, now).is_ok() {
                    core.drain();
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adaptive_spin_grows_while_it_nearly_catches_and_stops_when_it_does_not() {
        let us = Duration::from_micros;
        let s = AdaptiveSpin::new(Some(us(50)));
        assert_eq!(s.budget(), None, "no spin before the first short sleep");
        s.slept(Duration::ZERO, us(900));
        assert_eq!(s.budget(), None, "a long sleep starts no spin");
        s.slept(Duration::ZERO, us(150));
        assert_eq!(s.budget(), Some(SPIN_GROW_START));
        for _ in 0..10 {
            let b = s.budget().unwrap_or_default();
            s.slept(b, b / 2);
        }
        assert_eq!(s.budget(), Some(us(50)), "capped at the maximum");
        s.slept(us(50), us(80));
        assert_eq!(
            s.budget(),
            Some(us(25)),
            "halved after a spin that did not help"
        );
        for _ in 0..10 {
            let b = s.budget().unwrap_or_default();
            s.slept(b, Duration::from_millis(5));
        }
        assert_eq!(s.budget(), None, "a slow peer ends the spinning");
        let off = AdaptiveSpin::new(None);
        off.caught(true);
        assert_eq!(off.budget(), None);
        off.slept(Duration::ZERO, us(1));
        assert_eq!(off.budget(), None);
        assert_eq!(AdaptiveSpin::new(Some(Duration::ZERO)).budget(), None);
    }

    #[test]
    fn roce_spin_backs_off_when_its_spins_fail_and_stays_while_they_catch() {
        let us = Duration::from_micros;
        let s = AdaptiveSpin::catching(Some(us(40)));
        assert_eq!(s.budget(), None, "no spin before the first short sleep");
        s.slept(Duration::ZERO, us(30));
        assert_eq!(s.budget(), Some(us(40)), "starts at the maximum");
        s.caught(true);
        assert_eq!(s.budget(), Some(us(40)), "a catch keeps it");
        // A short sleep after a failed spin does not grow it (unlike the shm policy).
        s.slept(us(40), us(5));
        assert_eq!(s.budget(), Some(us(10)), "quartered");
        s.caught(true);
        assert_eq!(s.budget(), Some(us(20)), "a catch doubles it back");
        // A late catch (the thread was kept off the CPU) is a failure.
        s.caught(false);
        assert_eq!(s.budget(), Some(us(5)));
        s.slept(us(5), us(5));
        s.slept(us(1), us(5));
        assert_eq!(s.budget(), None, "below a microsecond: stop");
        // Held for one short sleep (the first series failed), then two, then four.
        for hold in [1, 2, 4] {
            for _ in 0..hold {
                s.slept(Duration::ZERO, us(20));
                assert_eq!(s.budget(), None, "held");
            }
            s.slept(Duration::ZERO, us(20));
            assert_eq!(s.budget(), Some(us(40)), "restarted after {hold}");
            for _ in 0..3 {
                let b = s.budget().unwrap_or_default();
                s.slept(b, us(20));
            }
            assert_eq!(s.budget(), None);
        }
        // Held for eight; then a catch ends the backoff: the next failed series holds one
        // sleep again.
        for _ in 0..9 {
            s.slept(Duration::ZERO, us(20));
        }
        assert_eq!(s.budget(), Some(us(40)));
        s.caught(true);
        for _ in 0..3 {
            let b = s.budget().unwrap_or_default();
            s.slept(b, us(20));
        }
        s.slept(Duration::ZERO, us(20));
        assert_eq!(s.budget(), None, "held one");
        s.slept(Duration::ZERO, us(20));
        assert_eq!(s.budget(), Some(us(40)));
        // A long sleep neither starts a spin nor counts against the hold.
        let t = AdaptiveSpin::catching(Some(us(40)));
        t.slept(Duration::ZERO, Duration::from_millis(5));
        assert_eq!(t.budget(), None);
        assert_eq!(t.fresh().budget(), None);
        t.slept(Duration::ZERO, us(1));
        assert_eq!(t.budget(), Some(us(40)));
    }
}
