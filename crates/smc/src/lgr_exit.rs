//! Ending the link groups of a process that exits.
//!
//! A link group lives in the process that made it: when the process ends, so do its QPs.
//! A peer that is not told keeps its side of the group — the Linux kernel for its idle time
//! (10 minutes on a server), with a QP that later retransmits its own DELETE LINK every 136 ms
//! into a port nobody listens on (shared/spec/smc-rv2.md §13 item 3). So at process exit
//! (`atexit`) every link group of a stack with RoCE devices is deleted with a DELETE LINK for
//! the entire group, as the kernel does when it frees a link group. The roce fabric's own exit
//! handler, registered before this one (`atexit` handlers run in reverse order), then waits
//! until the peer has acknowledged those SENDs.
//!
//! Stacks on the shared-memory fabric only are left out: their peers are smc-rs processes,
//! which see the process end on the fabric's sockets.

use std::sync::{Arc, Mutex, Once, TryLockError, Weak};
use std::time::{Duration, Instant};

use smc_fabric::WorkCompletion;

use crate::stack::{Core, Inner};

/// The stacks to end at exit, with the process that made each: a child made by `fork`
/// inherits the list (and the devices' sockets) but must not end its parent's link groups.
static STACKS: Mutex<Vec<(u32, Weak<Inner>)>> = Mutex::new(Vec::new());
static AT_EXIT: Once = Once::new();
/// Longest the exit handler waits for a stack's lock (a thread may hold it when `exit` runs).
const LOCK_WAIT: Duration = Duration::from_millis(200);
/// Longest the exit handler waits for closing connections.
const CLOSE_WAIT: Duration = Duration::from_millis(1000);
/// With no connection left, how long nothing must arrive before the groups are deleted (the
/// peer's DELETE RKEY follows the close).
const QUIET: Duration = Duration::from_millis(100);

/// Have the link groups of `inner` deleted at process exit.
pub(crate) fn register(inner: &Arc<Inner>) {
    let mut s = STACKS.lock().unwrap_or_else(|p| p.into_inner());
    s.retain(|(_, w)| w.strong_count() > 0);
    s.push((std::process::id(), Arc::downgrade(inner)));
    drop(s);
    AT_EXIT.call_once(|| {
        // SAFETY: registers a plain function with no preconditions.
        unsafe { libc::atexit(end_all_at_exit) };
    });
}

extern "C" fn end_all_at_exit() {
    let stacks: Vec<Arc<Inner>> = match STACKS.try_lock() {
        Ok(s) => {
            let pid = std::process::id();
            s.iter()
                .filter(|(p, _)| *p == pid)
                .filter_map(|(_, w)| w.upgrade())
                .collect()
        }
        Err(_) => return,
    };
    for s in stacks {
        end_link_groups(&s);
    }
}

/// Delete every link group of `inner` with a DELETE LINK (entire group) to the peer; the
/// connections still on them are reset. Gives up when the stack's lock stays taken.
pub(crate) fn end_link_groups(inner: &Inner) {
    let start = Instant::now();
    let mut core = loop {
        match inner.core.try_lock() {
            Ok(c) => break crate::stack::CoreGuard::new(c),
            Err(TryLockError::Poisoned(p)) => break crate::stack::CoreGuard::new(p.into_inner()),
            Err(TryLockError::WouldBlock) if start.elapsed() < LOCK_WAIT => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(TryLockError::WouldBlock) => return,
        }
    };
    // First let the connections the application closed finish their close (the peer's
    // closing CDC, then its DELETE RKEY of their buffers, answered), as the stack's drop
    // does: deleting the group under them would reset them.
    let mut wcs = [WorkCompletion::EMPTY; 64];
    let deadline = start + CLOSE_WAIT;
    let mut quiet_since = Instant::now();
    loop {
        let mut did = core.poll_completions(&mut wcs);
        did |= core.report_failed_posts();
        let now = core.now();
        if core.ep.poll_timeout().is_some_and(|t| t <= now) {
            let Core { ep, fab, .. } = &mut *core;
            ep.handle_timeout(fab, now);
            did = true;
        }
        core.drain();
        if did {
            quiet_since = Instant::now();
        }
        // No link group left (the peer deleted them, as the peer of a process that exits
        // first does): nothing to wait for and nothing to delete.
        if core.ep.link_groups().next().is_none() {
            return;
        }
        let open = core.ep.link_groups().any(|g| !g.conns.is_empty());
        if Instant::now() >= deadline || (!open && quiet_since.elapsed() >= QUIET) {
            break;
        }
        if !did {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    let ids: Vec<_> = core.ep.link_groups().map(|g| g.id).collect();
    if ids.is_empty() {
        return;
    }
    let now = core.now();
    for id in ids {
        //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.5.3
        //# DELETE LINK from the server to the client, with the "delete entire link
        //# group" flag set: This message informs the client that the entire link
        //# group is being deleted.
        // (A client sends the same message; Linux accepts it from either side.)
        core.ep.terminate_link_group(id, now);
    }
    core.drain();
}
