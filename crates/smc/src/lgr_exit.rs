//! Ending the link groups of a process that exits.
//!
//! A link group lives in the process that made it: when the process ends, so do its QPs.
//! A peer that is not told keeps its side of the group — the Linux kernel for its idle time
//! (10 minutes on a server), with a QP that later retransmits its own DELETE LINK every 136 ms
//! into a port nobody listens on (shared/spec/smc-rv2.md §13 item 3). So at process exit
//! (`atexit`) every link group of a stack with RoCE devices is deleted with a DELETE LINK for
//! the entire group, as the kernel does when it frees a link group — once both sides have
//! withdrawn their RMBs from it (DELETE RKEY), or else after a quiet period
//! ([`end_link_groups`]). The roce fabric's own exit handler, registered before this one
//! (`atexit` handlers run in reverse order), then waits until the peer has acknowledged those
//! SENDs.
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
/// With no connection left, how long nothing must arrive before the groups are deleted, when
/// the peer has not withdrawn all its RMBs (a peer whose process goes on, or one that keeps
/// its RMBs: a DELETE RKEY of its own may still follow the close).
const QUIET: Duration = Duration::from_millis(100);
/// A client whose groups are withdrawn both ways waits this long for the server's DELETE LINK
/// before it sends its own (a server that ends too sends it at once; the Linux kernel, whose
/// DELETE RKEY follows every connection's end, keeps the group and sends none).
const SERVER_DELETE_WAIT: Duration = Duration::from_millis(20);

/// How [`end_link_groups`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExitEnd {
    /// The stack's lock stayed taken: nothing was done.
    Locked,
    /// No link group was left (the peer deleted them): nothing to send.
    NoGroup,
    /// Every group's RMBs were withdrawn both ways: the groups were deleted without waiting
    /// for quiet.
    Withdrawn,
    /// Nothing arrived for [`QUIET`]: the groups were deleted then.
    Quiet,
    /// Connections were still closing after [`CLOSE_WAIT`]: the groups were deleted (and
    /// those connections reset).
    Deadline,
}

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
///
/// First the connections the application closed finish their close (the peer's closing
/// CDC), as the stack's drop lets them: deleting the group under them would reset them. Then
/// every RMB of ours is withdrawn with DELETE RKEY, and the groups are deleted as soon as each
/// is withdrawn both ways ([`LinkGroup::rmbs_withdrawn`]): the peer has withdrawn all its RMBs
/// (the Linux kernel does it for each connection it frees, shared/spec/smc-rv2.md §12; an
/// smc-rs peer at its own exit) and answered our DELETE RKEY, so nothing but a DELETE LINK can
/// still come. Otherwise they are deleted once nothing arrived for [`QUIET`] — a peer's
/// DELETE RKEY racing our DELETE LINK would meet a QP that is gone.
///
/// [`LinkGroup::rmbs_withdrawn`]: smc_proto::link_group::LinkGroup::rmbs_withdrawn
pub(crate) fn end_link_groups(inner: &Inner) -> ExitEnd {
    let start = Instant::now();
    let mut core = loop {
        match inner.core.try_lock() {
            Ok(c) => break crate::stack::CoreGuard::new(c),
            Err(TryLockError::Poisoned(p)) => break crate::stack::CoreGuard::new(p.into_inner()),
            Err(TryLockError::WouldBlock) if start.elapsed() < LOCK_WAIT => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(TryLockError::WouldBlock) => return ExitEnd::Locked,
        }
    };
    let mut wcs = [WorkCompletion::EMPTY; 64];
    let deadline = start + CLOSE_WAIT;
    let mut quiet_since = Instant::now();
    let mut withdrawn_since: Option<Instant> = None;
    let end = loop {
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
            return ExitEnd::NoGroup;
        }
        let open = core.ep.link_groups().any(|g| !g.conns.is_empty());
        if !open {
            // Withdraw our RMBs (only those not put up for deletion yet: a no-op once done).
            let ids: Vec<_> = core.ep.link_groups().map(|g| g.id).collect();
            let Core { ep, fab, .. } = &mut *core;
            let mut asked = 0;
            for id in ids {
                asked += ep.withdraw_rmbs(id, fab, now);
            }
            if asked > 0 {
                core.drain();
                quiet_since = Instant::now();
            }
            if core.ep.link_groups().all(|g| g.rmbs_withdrawn()) {
                //= https://www.rfc-editor.org/rfc/rfc7609#section-3.5.4
                //# When the last TCP connection over an SMC-R link group terminates, the
                //# link group can be terminated.  Similar to creation of SMC-R links and
                //# link groups, the primary responsibility for determining that normal
                //# termination is needed and initiating it lies with the server.
                // A server deletes at once; a client gives an ending server the moment to
                // do it (its DELETE LINK then makes the group go here, above), so that the
                // two DELETE LINKs do not cross: one sent after a stall of its sender could
                // reach a process already gone and be resent until its sender's exit drain
                // gives up (2 s).
                let since = *withdrawn_since.get_or_insert_with(Instant::now);
                let servers_only = core
                    .ep
                    .link_groups()
                    .all(|g| g.role == smc_proto::link_group::Role::Server);
                if servers_only || since.elapsed() >= SERVER_DELETE_WAIT {
                    break ExitEnd::Withdrawn;
                }
            }
        }
        if Instant::now() >= deadline {
            break ExitEnd::Deadline;
        }
        if !open && quiet_since.elapsed() >= QUIET {
            break ExitEnd::Quiet;
        }
        if !did {
            std::thread::sleep(Duration::from_micros(200));
        }
    };
    let ids: Vec<_> = core.ep.link_groups().map(|g| g.id).collect();
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
    tracing::debug!(?end, "link groups ended at exit");
    end
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DiscoveryMode, SmcListener, SmcStream, Stack, StackConfig};
    use std::io::{Read, Write};

    /// Two stacks on one shm fabric in a fresh directory, one connection between them over
    /// SMC-R that carried a few bytes and was closed by both: (directory, server, client).
    fn closed_pair(tag: &str) -> (std::path::PathBuf, Stack, Stack) {
        let dir = std::env::temp_dir().join(format!("smc-exit-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("fabric dir");
        let stack = || {
            let mut c = StackConfig::new(smc_fabric::FabricConfig::with_dir(&dir, 1));
            c.discovery = DiscoveryMode::AssertPeer;
            Stack::new(c).expect("stack")
        };
        let (server, client) = (stack(), stack());
        let l = SmcListener::bind_with(&server, "127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        let c = client.clone();
        let t = std::thread::spawn(move || {
            let mut s = SmcStream::connect_with(&c, addr).expect("connect");
            s.write_all(b"last words").expect("write");
            s
        });
        let (mut s, _) = l.accept().expect("accept");
        let mut got = [0u8; 10];
        s.read_exact(&mut got).expect("read");
        assert_eq!(&got, b"last words");
        let c = t.join().expect("client");
        assert!(
            c.smc_id().is_some() && s.smc_id().is_some(),
            "not over SMC-R"
        );
        drop((c, s, l));
        (dir, server, client)
    }

    fn groups(s: &Stack) -> usize {
        s.inner.lock().ep.link_groups().count()
    }

    /// Both processes of a connection end at once (as the two `smc nc` of a transfer do): each
    /// withdraws its RMBs, sees the other's withdrawn, and the server deletes the group at once
    /// — no wait for quiet on either side; the client's group goes with the server's DELETE
    /// LINK (or, should it come late, with its own).
    #[test]
    fn an_ending_pair_deletes_its_group_without_waiting_for_quiet() {
        let (dir, server, client) = closed_pair("pair");
        assert_eq!((groups(&server), groups(&client)), (1, 1));
        let (si, ci) = (server.inner.clone(), client.inner.clone());
        let s = std::thread::spawn(move || end_link_groups(&si));
        let c = std::thread::spawn(move || end_link_groups(&ci));
        let (s, c) = (s.join().expect("server"), c.join().expect("client"));
        assert_eq!(s, ExitEnd::Withdrawn, "server");
        assert!(
            matches!(c, ExitEnd::NoGroup | ExitEnd::Withdrawn),
            "client: {c:?}"
        );
        assert_eq!((groups(&server), groups(&client)), (0, 0));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A client that ends while its server goes on: the server keeps its RMB (an smc-rs stack
    /// withdraws none before it ends), so the client cannot know that nothing more comes and
    /// deletes the group only after the quiet period. The server answered its DELETE RKEY
    /// and then lost the group to its DELETE LINK.
    #[test]
    fn a_client_whose_server_goes_on_waits_for_quiet() {
        let (dir, server, client) = closed_pair("alone");
        assert_eq!(end_link_groups(&client.inner), ExitEnd::Quiet);
        assert_eq!(groups(&client), 0);
        let end = Instant::now() + Duration::from_secs(10);
        while groups(&server) > 0 && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(groups(&server), 0, "the server kept the group");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
