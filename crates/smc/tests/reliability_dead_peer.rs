//! Dead peer: the peer process is killed (SIGKILL) in the middle of transfers on several
//! connections. Every connection must fail with `ConnectionReset` (or, as over TCP when the
//! peer had read everything, end), never hang, and every fd,
//! memfd, mapping and thread this process held for the peer's link group must be released.
//!
//! The reset latency is printed (`reset after ...`); the test asserts only a generous hang
//! bound, timings belong in docs/reliability.md.
#![allow(missing_docs)]

mod reliability_common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use reliability_common::*;
use smc::{Mode, SmcStream};

#[test]
fn child_entry() {
    let Ok(role) = std::env::var("SMC_REL_CHILD") else {
        return;
    };
    let dir = PathBuf::from(std::env::var("SMC_REL_DIR").expect("dir"));
    exit_on_stdin_eof();
    match role.as_str() {
        "echo-server" => run_echo_server(&stack(&dir)),
        other => panic!("unknown role {other}"),
    }
}

/// Connections open when the peer dies.
const CONNS: u64 = 8;

#[test]
fn sigkill_of_the_peer_resets_every_connection_and_releases_everything() {
    if is_child() {
        return;
    }
    let dir = test_dir("dead-peer");
    let st = stack(&dir);
    let rounds = env_count("SMC_REL_DEAD_ROUNDS", 2);
    // The first round warms up what stays for the life of the stack (lazily created
    // per-process state); the baseline is taken after it and every later round must
    // return to it exactly.
    let mut baseline = None;
    for round in 0..rounds {
        let mut peer = Peer::spawn("child_entry", "echo-server", &dir, &[]);
        let ended_before = st.stats().ended_by_peer_exit;
        let before = proc_resources();
        let mut threads = Vec::new();
        for i in 0..CONNS {
            let s = SmcStream::connect_with(&st, ("127.0.0.1", peer.port)).expect("connect");
            assert_eq!(s.mode(), Mode::Smc);
            let w = s.try_clone().expect("clone");
            threads.push(std::thread::spawn(move || {
                // Far more than can move before the kill: the stream is cut mid-transfer.
                let r = echo_stream(s, w, round * 100 + i, 1 << 40);
                (r.map(|_| ()), Instant::now())
            }));
        }
        assert_eq!(st.link_groups().len(), 1);
        // Let bytes flow in both directions, then kill the peer with SIGKILL.
        std::thread::sleep(Duration::from_millis(300));
        let during = proc_resources();
        peer.child.kill().expect("SIGKILL the peer");
        let killed = Instant::now();
        let _ = peer.child.wait();
        let mut worst = Duration::ZERO;
        let mut ended = 0;
        for t in threads {
            let (r, at) = t.join().expect("stream thread");
            let e = r.expect_err("a stream survived its peer's death");
            // As over TCP: the dead peer's kernel resets a connection it had unread bytes
            // of, and ends one it had read everything of (FIN) — rare mid-transfer, and
            // counted by the stack as `ended_by_peer_exit`.
            match e.kind() {
                std::io::ErrorKind::ConnectionReset => {}
                std::io::ErrorKind::UnexpectedEof => ended += 1,
                _ => panic!("round {round}: {e}"),
            }
            worst = worst.max(at.saturating_duration_since(killed));
        }
        assert_eq!(
            ended,
            st.stats().ended_by_peer_exit - ended_before,
            "round {round}"
        );
        println!("round {round}: every connection reset after {worst:?} (SIGKILL to last error)");
        // A hang bound, not a timing assertion.
        assert!(worst < Duration::from_secs(60), "resets took {worst:?}");
        // The link group and everything it held go away.
        assert!(
            wait_until(Duration::from_secs(30), || st.link_groups().is_empty()),
            "link group still there: {:?}",
            st.link_groups()
        );
        let mut after = proc_resources();
        let released = wait_until(Duration::from_secs(30), || {
            after = proc_resources();
            after.fds <= before.fds
                && after.memfds <= before.memfds
                && after.memfd_maps <= before.memfd_maps
                && after.threads <= before.threads
        });
        println!("round {round}: before {before:?}\n  during {during:?}\n  after {after:?}");
        assert!(
            released,
            "round {round}: not released: before {before:?}, after {after:?}"
        );
        assert!(during.memfd_maps > before.memfd_maps, "{during:?}");
        match baseline {
            None => baseline = Some(after),
            Some(b) => assert_eq!(after, b, "round {round} leaked relative to round 1"),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
