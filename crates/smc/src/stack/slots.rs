//! The stack's connection table, which keeps count of the connections the runtime thread
//! must keep polling the completion queues for (a rendezvous in progress, an event loop).
//!
//! The runtime thread asks that on every turn while an application thread polls; scanning
//! the table for it cost a visit of every connection per turn under the core lock. A slot's
//! `state` and `notify` therefore change only through [`Slots`], which counts them.

use super::*;

/// One connection known to the stack.
#[derive(Debug)]
pub(crate) struct Slot {
    /// Where the connection is (changed by [`Slots::set_state`]).
    state: SlotState,
    /// The TCP socket (CLC messages are written on it; reset on `SendTcpReset`): the same
    /// descriptor as the stream's, shared, not a duplicate (one fd per connection). Dropped
    /// (and taken out of the reset watch) on reset or when the slot goes; the descriptor
    /// closes when the stream has gone too.
    pub(crate) sock: Option<crate::tcpwatch::SlotSock>,
    /// The established connection failed.
    pub(crate) error: Option<ConnError>,
    /// The engine reached `Closed`.
    pub(crate) closed: bool,
    /// The application dropped its stream.
    pub(crate) dropped: bool,
    /// Our alert token (set when established).
    pub(crate) token: Option<u32>,
    /// Event loops waiting on this connection (tokio streams), if any (made by
    /// [`Slots::notifiers`]).
    notify: Option<Arc<Notifiers>>,
    /// Blocked readers and writers of this connection that do not poll the completion
    /// queues themselves wait here (with the core mutex).
    pub(crate) cond: Arc<Condvar>,
    /// How many threads wait on `cond` (it is signalled only then: no system call otherwise).
    pub(crate) waiters: u32,
    /// `cond` is queued for a notify when the core lock is released (`CoreGuard`): a second
    /// event before a waiter looks adds nothing. Cleared whenever a waiter registers or
    /// returns, so that a waiter that registered after the queued notify is never skipped.
    pub(crate) wake_queued: bool,
    /// Signalled when the setup ends (established, fell back, reset), for a rendezvous that
    /// waits for an LLC exchange another thread handles: made only then (an eventfd).
    pub(crate) setup_waker: Option<Arc<rustix::fd::OwnedFd>>,
    /// A reader of this connection copies its unread bytes out of the RMBE without the
    /// core lock (see `SmcStream::smc_read`): until it has consumed them, no other read of
    /// the connection may take the same bytes.
    pub(crate) copying_out: bool,
    /// A writer of this connection copies into the peer's RMBE without the core lock (see
    /// `Core::send_preplaced`): until its bytes are produced, no other write of the
    /// connection may plan the same free space.
    pub(crate) copying_in: bool,
    /// A write came after the peer closed and was taken (and dropped), as TCP takes the
    /// first one before the peer's RST is back: the next one fails with EPIPE.
    pub(crate) wrote_after_peer_close: bool,
    /// The bytes the peer wrote before it reset the connection, unread then (copied out of
    /// the RMBE when the reset came): reads take them before they see the error.
    pub(crate) left_by_reset: Vec<u8>,
    /// The link group was lost while the TCP connection already held the peer's FIN: the
    /// peer's process ended (its stack with it) and its kernel closed its TCP socket in
    /// order, which a TCP peer sees as an end of stream. Reads give end of stream after
    /// the bytes kept (`left_by_reset`), writes fail as after a peer's close, and no error
    /// is reported; without the FIN (the peer's host or the path is gone) the connection
    /// is reset.
    pub(crate) peer_exited: bool,
    /// When the link group was lost: whether the peer had consumed every byte we wrote
    /// (a TCP socket closed with unread data sends a RST, not a FIN).
    pub(crate) peer_read_all: bool,
}

impl Slot {
    /// A new slot in state `Setup` for socket `sock`.
    pub(crate) fn new(sock: Arc<TcpStream>) -> Slot {
        Slot {
            state: SlotState::Setup,
            sock: Some(crate::tcpwatch::SlotSock::new(sock)),
            error: None,
            closed: false,
            dropped: false,
            token: None,
            notify: None,
            cond: Arc::new(Condvar::new()),
            waiters: 0,
            wake_queued: false,
            setup_waker: None,
            copying_out: false,
            copying_in: false,
            wrote_after_peer_close: false,
            left_by_reset: Vec::new(),
            peer_exited: false,
            peer_read_all: false,
        }
    }

    /// Where the connection is.
    pub(crate) fn state(&self) -> &SlotState {
        &self.state
    }

    /// The eventfds of event loops waiting on this connection, if any.
    pub(crate) fn notify(&self) -> Option<&Arc<Notifiers>> {
        self.notify.as_ref()
    }

    /// Wake the rendezvous thread of this slot, if it sleeps on its waker.
    pub(super) fn setup_ended(&self) {
        if let Some(w) = &self.setup_waker {
            Notifiers::signal(w);
        }
    }

    /// Whether the runtime thread must keep polling for this connection.
    fn polled(&self) -> bool {
        matches!(self.state, SlotState::Setup) || self.notify.is_some()
    }
}

/// The connections known to the stack, by id.
#[derive(Debug, Default)]
pub(crate) struct Slots {
    map: HashMap<TcpId, Slot>,
    /// How many slots are [`Slot::polled`].
    polled: usize,
}

impl Slots {
    /// The slot of `tcp`.
    pub(crate) fn get(&self, tcp: &TcpId) -> Option<&Slot> {
        self.map.get(tcp)
    }

    /// The slot of `tcp`, to change (not its state nor its notifiers).
    pub(crate) fn get_mut(&mut self, tcp: &TcpId) -> Option<&mut Slot> {
        self.map.get_mut(tcp)
    }

    /// Every slot, in no particular order.
    pub(crate) fn iter(&self) -> std::collections::hash_map::Iter<'_, TcpId, Slot> {
        self.map.iter()
    }

    /// Every slot, in no particular order.
    pub(crate) fn values(&self) -> std::collections::hash_map::Values<'_, TcpId, Slot> {
        self.map.values()
    }

    /// Put `slot` under `tcp`; the slot it replaces, if any.
    pub(crate) fn insert(&mut self, tcp: TcpId, slot: Slot) -> Option<Slot> {
        let old = self.remove(&tcp);
        self.polled += usize::from(slot.polled());
        self.map.insert(tcp, slot);
        old
    }

    /// Take the slot of `tcp` out.
    pub(crate) fn remove(&mut self, tcp: &TcpId) -> Option<Slot> {
        let slot = self.map.remove(tcp)?;
        self.polled -= usize::from(slot.polled());
        Some(slot)
    }

    /// Move the connection `tcp` to `state`; its slot, if it has one.
    pub(crate) fn set_state(&mut self, tcp: &TcpId, state: SlotState) -> Option<&mut Slot> {
        let slot = self.map.get_mut(tcp)?;
        let was = slot.polled();
        slot.state = state;
        self.polled = self.polled - usize::from(was) + usize::from(slot.polled());
        Some(slot)
    }

    /// The eventfds of connection `tcp` for event loops, made on first use; `None` when
    /// there is no such connection.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn notifiers(&mut self, tcp: &TcpId) -> std::io::Result<Option<Arc<Notifiers>>> {
        let Some(slot) = self.map.get_mut(tcp) else {
            return Ok(None);
        };
        if slot.notify.is_none() {
            let was = slot.polled();
            slot.notify = Some(Arc::new(Notifiers::new()?));
            self.polled = self.polled - usize::from(was) + usize::from(slot.polled());
        }
        Ok(slot.notify.clone())
    }

    /// Whether any connection needs the runtime thread to keep polling: a rendezvous in
    /// progress or an event loop waiting on eventfds.
    pub(crate) fn any_polled(&self) -> bool {
        self.polled > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sock() -> (Arc<TcpStream>, std::net::TcpListener) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let s = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        (Arc::new(s), l)
    }

    /// The count follows setups that end, event loops that register, and slots that go,
    /// whatever the order; it equals a scan of the table at every step.
    #[test]
    fn polled_count_follows_state_notifiers_and_removal() {
        let (s, _l) = sock();
        let mut slots = Slots::default();
        let scan = |slots: &Slots| slots.values().any(Slot::polled);
        assert!(!slots.any_polled());
        slots.insert(TcpId(1), Slot::new(s.clone()));
        slots.insert(TcpId(2), Slot::new(s.clone()));
        assert!(slots.any_polled() && scan(&slots));
        slots.set_state(&TcpId(1), SlotState::Smc).expect("1");
        assert!(slots.any_polled());
        slots.set_state(&TcpId(2), SlotState::Smc).expect("2");
        assert!(!slots.any_polled() && !scan(&slots));
        // Set twice, counted once.
        slots.notifiers(&TcpId(2)).expect("eventfd").expect("2");
        slots.notifiers(&TcpId(2)).expect("eventfd").expect("2");
        assert!(slots.any_polled() && scan(&slots));
        slots.remove(&TcpId(2)).expect("2");
        assert!(!slots.any_polled() && !scan(&slots));
        assert!(slots.notifiers(&TcpId(9)).expect("none").is_none());
        assert!(slots.set_state(&TcpId(9), SlotState::Smc).is_none());
        // A slot replaced by another.
        slots.insert(TcpId(3), Slot::new(s.clone()));
        slots.insert(TcpId(3), Slot::new(s));
        slots.set_state(&TcpId(3), SlotState::Smc).expect("3");
        assert!(!slots.any_polled() && !scan(&slots));
        assert_eq!(slots.iter().count(), 2);
    }
}
