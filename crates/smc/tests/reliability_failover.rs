//! Failover under load, two real processes on the shm fabric with two devices each: this
//! process is the server of a link group with two links and accepts `STREAMS` connections
//! from the peer process, which echoes every byte. Each connection carries a stream in both
//! directions (our bytes out, the echo back), checked by length and SHA-256. Meanwhile, at
//! random moments, one of our ports goes down (every QP on it enters the error state and
//! flushes) or one link's QP is moved to the error state (`Stack::fail_link`); the connections
//! fail over to the other link, the port comes back and the server adds the link again (ADD
//! LINK). After `SMC_REL_FAILOVERS` failovers (default 100 here; the full run
//! is 1000) not a byte is lost or corrupted and no application call saw an error. Finally
//! both ports go down: every connection is reset with `ConnectionReset`.
//!
//! Times are printed, never asserted (the bounds below only catch hangs).
#![allow(missing_docs)]

mod reliability_common;

use std::io::{Read, Write};
use std::net::Shutdown;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use reliability_common::*;
use sha2::{Digest, Sha256};
use smc::{Mode, PortState, SmcListener, SmcStream, Stack};

#[test]
fn child_entry() {
    let Ok(role) = std::env::var("SMC_REL_CHILD") else {
        return;
    };
    let dir = PathBuf::from(std::env::var("SMC_REL_DIR").expect("dir"));
    exit_on_stdin_eof();
    match role.as_str() {
        // Connect `SMC_REL_STREAMS` times to `SMC_REL_PORT` and echo each connection.
        "echo-connector" => {
            let st = stack(&dir);
            let port: u16 = std::env::var("SMC_REL_PORT")
                .expect("port")
                .parse()
                .expect("port");
            let n = env_count("SMC_REL_STREAMS", 4);
            let threads: Vec<_> = (0..n)
                .map(|_| {
                    let s = SmcStream::connect_with(&st, ("127.0.0.1", port)).expect("connect");
                    std::thread::spawn(move || echo(s))
                })
                .collect();
            for t in threads {
                let _ = t.join();
            }
            // Stay until the parent closes our stdin.
            loop {
                std::thread::park();
            }
        }
        other => panic!("unknown role {other}"),
    }
}

/// One direction-pair stream: write until `stop`, then half-close; read the echo to EOF.
/// Returns (bytes written, SHA-256 written, bytes read, SHA-256 read).
fn run_stream(
    s: SmcStream,
    seed: u64,
    stop: Arc<AtomicBool>,
    progress: Arc<AtomicU64>,
) -> std::io::Result<(u64, [u8; 32], u64, [u8; 32])> {
    let mut r = s;
    // A stalled stream fails (TimedOut) instead of hanging the test.
    r.set_read_timeout(Some(Duration::from_secs(120)))?;
    let mut w = r.try_clone()?;
    w.set_write_timeout(Some(Duration::from_secs(120)))?;
    let writer = std::thread::spawn(move || -> std::io::Result<(u64, [u8; 32])> {
        let mut p = Pattern::new(seed);
        let mut h = Sha256::new();
        let mut rng = Rng::new(seed);
        let mut buf = vec![0u8; 128 * 1024];
        let mut total = 0u64;
        while !stop.load(Ordering::Acquire) {
            // Writes of varied sizes, so that failovers hit every position in the RMBE.
            let n = 1 + rng.below(buf.len() as u64) as usize;
            p.fill(&mut buf[..n]);
            w.write_all(&buf[..n])?;
            h.update(&buf[..n]);
            total += n as u64;
        }
        w.shutdown(Shutdown::Write)?;
        Ok((total, h.finalize().into()))
    });
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut got = 0u64;
    let read = loop {
        match r.read(&mut buf) {
            Ok(0) => break Ok(()),
            Ok(n) => {
                h.update(&buf[..n]);
                got += n as u64;
                progress.fetch_add(n as u64, Ordering::Relaxed);
            }
            Err(e) => break Err(e),
        }
    };
    let written = writer
        .join()
        .map_err(|_| std::io::Error::other("writer panicked"))?;
    read?;
    let (total, sent) = written?;
    Ok((total, sent, got, h.finalize().into()))
}

/// A listener on `st` and the peer process that connects to it `streams` times and echoes.
fn listen_for_echo_peer(st: &Stack, dir: &std::path::Path, streams: u64) -> (SmcListener, Peer) {
    let l = SmcListener::bind_with(st, "127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    let peer = Peer::spawn_connector(
        "child_entry",
        "echo-connector",
        dir,
        &[
            ("SMC_REL_PORT", port.to_string()),
            ("SMC_REL_STREAMS", streams.to_string()),
        ],
    );
    (l, peer)
}

/// Whether every link group of `st` has two active links.
fn both_links_active(st: &Stack) -> bool {
    let g = st.link_groups();
    !g.is_empty()
        && g.iter()
            .all(|g| g.links.len() == 2 && g.links.iter().all(|l| l.active))
}

#[test]
fn failover_under_load_loses_nothing() {
    if is_child() {
        return;
    }
    let failovers = env_count("SMC_REL_FAILOVERS", 100);
    let streams = env_count("SMC_REL_STREAMS", 4);
    let dir = test_dir("failover");
    let mut c = config(&dir);
    c.buffer_size = 64 * 1024;
    // A link lost to a QP error (its port stays up) is added back after this (App. C.8).
    c.add_link_retry = Duration::from_millis(20);
    let st = Stack::new(c).expect("stack");
    let (l, peer) = listen_for_echo_peer(&st, &dir, streams);
    let stop = Arc::new(AtomicBool::new(false));
    let progress = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    for i in 0..streams {
        let (s, _) = l.accept().expect("accept");
        assert_eq!(s.mode(), Mode::Smc);
        let (stop, progress) = (stop.clone(), progress.clone());
        threads.push(std::thread::spawn(move || {
            run_stream(s, 1000 + i, stop, progress)
        }));
    }
    assert!(
        wait_until(Duration::from_secs(30), || both_links_active(&st)),
        "{:?}",
        st.link_groups()
    );
    let devices = st.devices();
    let mut rng = Rng::new(env_count("SMC_REL_SEED", 7));
    let start = Instant::now();
    let mut down_to_failover = Duration::ZERO;
    let mut up_to_readded = Duration::ZERO;
    let links_down0 = st.stats().links_down;
    let mut qp_errors = 0u64;
    for i in 0..failovers {
        // A random moment: 0-50 ms of traffic on both links.
        std::thread::sleep(Duration::from_micros(rng.below(50_000)));
        // Half of the faults take a port down (every QP on it fails), half move one QP to
        // the error state (an RNIC's fatal QP error; the port stays up).
        let dev = &devices[rng.below(devices.len() as u64) as usize];
        let qp_error = rng.below(2) == 0;
        let before = st.stats().links_down;
        let t0 = Instant::now();
        if qp_error {
            let groups = st.link_groups();
            let g = &groups[rng.below(groups.len() as u64) as usize];
            let l = &g.links[rng.below(g.links.len() as u64) as usize];
            assert!(st.fail_link(g.id, l.num), "failover {i}: no link {}", l.num);
            qp_errors += 1;
        } else {
            assert!(st.set_port_state(dev, PortState::Down));
        }
        // After a port-down fault the group keeps one link until the port comes back; after
        // a QP error the port stays up and the link is added back on its own (after
        // `add_link_retry`, 20 ms), so that one-link moment can pass between two looks of
        // `wait_until` on a loaded machine: the failure count says the link went down.
        assert!(
            wait_until(Duration::from_secs(30), || st.stats().links_down > before
                && (qp_error
                    || st.link_groups().iter().any(|g| g.links.len() == 1))),
            "failover {i} (QP error: {qp_error}): the link never went down: {:?}",
            st.link_groups()
        );
        down_to_failover += t0.elapsed();
        // Traffic on the one remaining link for a moment, then the port comes back.
        std::thread::sleep(Duration::from_micros(rng.below(20_000)));
        let t1 = Instant::now();
        if !qp_error {
            assert!(st.set_port_state(dev, PortState::Active));
        }
        assert!(
            wait_until(Duration::from_secs(60), || both_links_active(&st)),
            "failover {i}: the link was never added back: {:?}",
            st.link_groups()
        );
        up_to_readded += t1.elapsed();
        // Bytes keep flowing after the failover (a lost CDC would stall the streams).
        let seen = progress.load(Ordering::Relaxed);
        assert!(
            wait_until(Duration::from_secs(30), || progress.load(Ordering::Relaxed)
                > seen),
            "failover {i}: the streams stalled at {seen} bytes"
        );
        if (i + 1) % 100 == 0 {
            println!(
                "{} failovers in {:?}, RSS {} KiB",
                i + 1,
                start.elapsed(),
                rss_kib()
            );
        }
    }
    let elapsed = start.elapsed();
    stop.store(true, Ordering::Release);
    let mut bytes = 0u64;
    for (i, t) in threads.into_iter().enumerate() {
        let (sent_n, sent_h, got_n, got_h) = t
            .join()
            .expect("stream thread")
            .unwrap_or_else(|e| panic!("stream {i}: the application saw an error: {e}"));
        assert_eq!(got_n, sent_n, "stream {i}: length");
        assert!(got_h == sent_h, "stream {i}: SHA-256 differs");
        bytes += sent_n;
    }
    let n = failovers.max(1) as u32;
    println!(
        "{failovers} failovers ({qp_errors} QP errors, the rest port down; {} link-down events) \
         in {elapsed:?} with {streams} streams: \
         {} MiB each way, intact (SHA-256); mean port down -> failed over {:?}, \
         mean port up -> link added back {:?}",
        st.stats().links_down - links_down0,
        bytes >> 20,
        down_to_failover / n,
        up_to_readded / n,
    );
    let stats_text = format!("{:?}", st.stats());
    println!("stack stats: {stats_text}");
    drop(l);
    drop(peer);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn losing_the_last_link_resets_every_connection() {
    if is_child() {
        return;
    }
    let streams = 4;
    let dir = test_dir("last-link");
    let st = stack(&dir);
    let (l, peer) = listen_for_echo_peer(&st, &dir, streams);
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    for i in 0..streams {
        let (s, _) = l.accept().expect("accept");
        let stop = stop.clone();
        let progress = Arc::new(AtomicU64::new(0));
        threads.push(std::thread::spawn(move || {
            let r = run_stream(s, i, stop, progress);
            (r, Instant::now())
        }));
    }
    assert!(wait_until(Duration::from_secs(30), || both_links_active(
        &st
    )));
    std::thread::sleep(Duration::from_millis(200));
    let t0 = Instant::now();
    for d in st.devices() {
        assert!(st.set_port_state(&d, PortState::Down));
    }
    let mut worst = Duration::ZERO;
    for t in threads {
        let (r, at) = t.join().expect("stream thread");
        let e = r.expect_err("a stream survived the loss of every link");
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}");
        worst = worst.max(at.saturating_duration_since(t0));
    }
    println!("last link lost: every connection reset after {worst:?}");
    assert!(worst < Duration::from_secs(60), "{worst:?}");
    stop.store(true, Ordering::Release);
    assert!(wait_until(Duration::from_secs(30), || st
        .link_groups()
        .is_empty()));
    drop(peer);
    let _ = std::fs::remove_dir_all(&dir);
}
