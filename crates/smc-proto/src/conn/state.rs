//! Connection states of RFC 7609 Fig. 22 (normal termination) and Fig. 23 (abnormal
//! termination), declared as one transition table.
//!
//! The engine moves between states only through [`next_state`], which reads [`TRANSITIONS`];
//! a transition that is not in the table is a bug and leaves the state unchanged (debug
//! builds assert). The table is pinned by a snapshot test.

use core::fmt;

/// An SMC-R connection state, named as in RFC 7609 §4.8.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum State {
    /// The RMBE is not in use (before rendezvous, or after termination).
    Closed,
    /// Rendezvous done; data flows both ways.
    Active,
    /// Active close: we sent PeerDoneWriting or PeerConnectionClosed and wait for the peer.
    PeerCloseWait1,
    /// Active close: the peer is done writing too; we wait for its PeerConnectionClosed.
    PeerCloseWait2,
    /// Passive close: the peer is done writing (or closed); we wait for our application.
    AppCloseWait1,
    /// Passive close: our application shut down writing; we wait for its close().
    AppCloseWait2,
    /// The peer closed while our application had only shut down writing; waiting for close().
    AppFinCloseWait,
    /// Passive close: we sent PeerConnectionClosed and wait for the peer's.
    PeerFinCloseWait,
    /// Active abort: we sent PeerConnAbort and wait for the peer's.
    PeerAbortWait,
    /// Passive abort: the peer aborted; our PeerConnAbort is being sent.
    ProcessAbort,
}

impl State {
    /// Every state.
    pub const ALL: [State; 10] = [
        State::Closed,
        State::Active,
        State::PeerCloseWait1,
        State::PeerCloseWait2,
        State::AppCloseWait1,
        State::AppCloseWait2,
        State::AppFinCloseWait,
        State::PeerFinCloseWait,
        State::PeerAbortWait,
        State::ProcessAbort,
    ];
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// What drives a state transition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Input {
    /// Rendezvous completed and RMBE indices were exchanged (Fig. 22 transition 2).
    RendezvousComplete,
    /// The application shut down writing; PeerDoneWriting is sent.
    AppShutdownWrite,
    /// The application called close() or shutdown(both); PeerConnectionClosed is sent.
    AppClose,
    /// A CDC with PeerDoneWriting (and not PeerConnectionClosed) arrived.
    PeerDoneWriting,
    /// A CDC with PeerConnectionClosed arrived.
    PeerConnectionClosed,
    /// The PeerCloseWait or PeerFinCloseWait timer expired.
    CloseTimerExpired,
    /// We abort: application abort, protocol violation, unread data at close, TCP RST.
    ActiveAbort,
    /// A CDC with PeerConnAbort arrived.
    PeerConnAbort,
    /// Our PeerConnAbort reply was handed to the fabric.
    AbortSent,
    /// The PeerAbortWait timer expired.
    AbortTimerExpired,
    /// The peer presented this connection's peer RMBE for a new connection (§4.4.2).
    RmbeConflict,
    /// The link group lost its last link (or was terminated): no CDC can flow any more, the
    /// TCP connection is reset (RFC 7609 §2.3, §4.5.3).
    LinkGroupLost,
}

/// A condition on the connection that selects between transitions on the same input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Guard {
    /// No condition.
    Always,
    /// We have sent PeerConnectionClosed.
    LocalClosed,
    /// We have not sent PeerConnectionClosed.
    LocalNotClosed,
    /// The peer has sent PeerConnectionClosed.
    PeerClosed,
    /// The peer has not sent PeerConnectionClosed.
    PeerNotClosed,
}

/// One row of the transition table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Transition {
    /// State before.
    pub from: State,
    /// The input.
    pub input: Input,
    /// Condition that must hold.
    pub guard: Guard,
    /// State after.
    pub to: State,
    /// Where the RFC describes it (figure transition label or section).
    pub rfc: &'static str,
}

/// What the guards test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct GuardFacts {
    /// We have sent (or are sending) PeerConnectionClosed.
    pub local_closed: bool,
    /// The peer has sent PeerConnectionClosed.
    pub peer_closed: bool,
}

impl Guard {
    /// Whether the guard holds.
    pub fn holds(self, f: GuardFacts) -> bool {
        match self {
            Guard::Always => true,
            Guard::LocalClosed => f.local_closed,
            Guard::LocalNotClosed => !f.local_closed,
            Guard::PeerClosed => f.peer_closed,
            Guard::PeerNotClosed => !f.peer_closed,
        }
    }
}

const fn t(from: State, input: Input, guard: Guard, to: State, rfc: &'static str) -> Transition {
    Transition {
        from,
        input,
        guard,
        to,
        rfc,
    }
}

use Guard::*;
use Input::*;
use State::*;

/// Every legal transition (RFC 7609 Fig. 22, Fig. 23, §4.4.2).
#[rustfmt::skip]
pub const TRANSITIONS: &[Transition] = &[
    t(Closed, RendezvousComplete, Always, Active, "Fig22 2"),
    // Active close (path 3).
    t(Active, AppShutdownWrite, Always, PeerCloseWait1, "Fig22 3A"),
    t(Active, AppClose, Always, PeerCloseWait1, "Fig22 3A"),
    t(PeerCloseWait1, AppClose, Always, PeerCloseWait1, "4.8.1 3A (close after shutdown(WR))"),
    t(PeerCloseWait1, PeerDoneWriting, Always, PeerCloseWait2, "Fig22 3B"),
    t(PeerCloseWait1, PeerConnectionClosed, LocalClosed, Closed, "Fig22 3C"),
    t(PeerCloseWait1, PeerConnectionClosed, LocalNotClosed, AppFinCloseWait, "Fig22 3C"),
    t(PeerCloseWait2, AppClose, Always, PeerCloseWait2, "4.8.1 3A (close after shutdown(WR))"),
    t(PeerCloseWait2, PeerConnectionClosed, LocalClosed, Closed, "Fig22 3C"),
    t(PeerCloseWait2, PeerConnectionClosed, LocalNotClosed, AppFinCloseWait, "Fig22 3C"),
    t(AppFinCloseWait, AppClose, Always, Closed, "Fig22 3D"),
    t(PeerCloseWait1, CloseTimerExpired, Always, Closed, "4.8.1 stranding timer"),
    t(PeerCloseWait2, CloseTimerExpired, Always, Closed, "4.8.1 stranding timer"),
    // Passive close (path 4).
    t(Active, PeerDoneWriting, Always, AppCloseWait1, "Fig22 4A"),
    t(Active, PeerConnectionClosed, Always, AppCloseWait1, "Fig22 4A"),
    t(AppCloseWait1, PeerConnectionClosed, Always, AppCloseWait1, "4.8.1 4A (D then C)"),
    t(AppCloseWait1, AppShutdownWrite, Always, AppCloseWait2, "Fig22 4B"),
    t(AppCloseWait1, AppClose, PeerClosed, Closed, "Fig22 4C"),
    t(AppCloseWait1, AppClose, PeerNotClosed, PeerFinCloseWait, "Fig22 4C"),
    t(AppCloseWait2, PeerConnectionClosed, Always, AppCloseWait2, "4.8.1 4A (D then C)"),
    t(AppCloseWait2, AppClose, PeerClosed, Closed, "Fig22 4C"),
    t(AppCloseWait2, AppClose, PeerNotClosed, PeerFinCloseWait, "Fig22 4C"),
    t(PeerFinCloseWait, PeerConnectionClosed, Always, Closed, "Fig22 4D"),
    t(PeerFinCloseWait, CloseTimerExpired, Always, Closed, "4.8.1 stranding timer"),
    // Active abort (Fig. 23 path 1): before PeerConnectionClosed was sent, send PeerConnAbort.
    t(Active, ActiveAbort, Always, PeerAbortWait, "Fig23 1A"),
    t(PeerCloseWait1, ActiveAbort, LocalNotClosed, PeerAbortWait, "Fig23 1A"),
    t(PeerCloseWait2, ActiveAbort, LocalNotClosed, PeerAbortWait, "Fig23 1A"),
    t(AppCloseWait1, ActiveAbort, Always, PeerAbortWait, "Fig23 1A"),
    t(AppCloseWait2, ActiveAbort, Always, PeerAbortWait, "Fig23 1A"),
    t(AppFinCloseWait, ActiveAbort, Always, PeerAbortWait, "Fig23 1A"),
    // After PeerConnectionClosed was sent, no abort flows: TCP reset and free (4.8.1).
    t(PeerCloseWait1, ActiveAbort, LocalClosed, Closed, "4.8.1 reset after close"),
    t(PeerCloseWait2, ActiveAbort, LocalClosed, Closed, "4.8.1 reset after close"),
    t(PeerFinCloseWait, ActiveAbort, Always, Closed, "4.8.1 reset after close"),
    t(PeerAbortWait, PeerConnAbort, Always, Closed, "Fig23 1B"),
    t(PeerAbortWait, AbortTimerExpired, Always, Closed, "4.8.2 1B timer"),
    // Passive abort (Fig. 23 path 2).
    t(Active, PeerConnAbort, Always, ProcessAbort, "Fig23 2A"),
    t(PeerCloseWait1, PeerConnAbort, Always, ProcessAbort, "Fig23 2A"),
    t(PeerCloseWait2, PeerConnAbort, Always, ProcessAbort, "Fig23 2A"),
    t(AppCloseWait1, PeerConnAbort, Always, ProcessAbort, "Fig23 2A"),
    t(AppCloseWait2, PeerConnAbort, Always, ProcessAbort, "Fig23 2A"),
    t(AppFinCloseWait, PeerConnAbort, Always, ProcessAbort, "Fig23 2A"),
    t(PeerFinCloseWait, PeerConnAbort, Always, ProcessAbort, "Fig23 2A"),
    t(ProcessAbort, AbortSent, Always, Closed, "Fig23 2B"),
    // RMBE conflict (4.4.2): abort without any flow on the fabric.
    t(Active, RmbeConflict, Always, Closed, "4.4.2 conflict"),
    t(PeerCloseWait1, RmbeConflict, Always, Closed, "4.4.2 conflict"),
    t(PeerCloseWait2, RmbeConflict, Always, Closed, "4.4.2 conflict"),
    t(AppCloseWait1, RmbeConflict, Always, Closed, "4.4.2 conflict"),
    t(AppCloseWait2, RmbeConflict, Always, Closed, "4.4.2 conflict"),
    t(AppFinCloseWait, RmbeConflict, Always, Closed, "4.4.2 conflict"),
    t(PeerFinCloseWait, RmbeConflict, Always, Closed, "4.4.2 conflict"),
    t(PeerAbortWait, RmbeConflict, Always, Closed, "4.4.2 conflict"),
    t(ProcessAbort, RmbeConflict, Always, Closed, "4.4.2 conflict"),
    // Link group lost (2.3, 4.5.3): no fabric left to flow on; reset the TCP connection.
    t(Active, LinkGroupLost, Always, Closed, "2.3 no link left"),
    t(PeerCloseWait1, LinkGroupLost, Always, Closed, "2.3 no link left"),
    t(PeerCloseWait2, LinkGroupLost, Always, Closed, "2.3 no link left"),
    t(AppCloseWait1, LinkGroupLost, Always, Closed, "2.3 no link left"),
    t(AppCloseWait2, LinkGroupLost, Always, Closed, "2.3 no link left"),
    t(AppFinCloseWait, LinkGroupLost, Always, Closed, "2.3 no link left"),
    t(PeerFinCloseWait, LinkGroupLost, Always, Closed, "2.3 no link left"),
    t(PeerAbortWait, LinkGroupLost, Always, Closed, "2.3 no link left"),
    t(ProcessAbort, LinkGroupLost, Always, Closed, "2.3 no link left"),
];

/// The transition taken from `from` on `input` given `facts`, if the table has one.
pub fn next_state(from: State, input: Input, facts: GuardFacts) -> Option<&'static Transition> {
    TRANSITIONS
        .iter()
        .find(|t| t.from == from && t.input == input && t.guard.holds(facts))
}

/// The table as text, one row per line (used by the snapshot test and `smc` diagnostics).
pub fn render_table() -> String {
    let mut s = String::new();
    for t in TRANSITIONS {
        s.push_str(&format!(
            "{:<17} --{:<21} [{:<14}]--> {:<17} ({})\n",
            format!("{:?}", t.from),
            format!("{:?}", t.input),
            format!("{:?}", t.guard),
            format!("{:?}", t.to),
            t.rfc
        ));
    }
    s
}
