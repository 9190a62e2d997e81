//! Resource shortage: a peer that runs out of file descriptors (RLIMIT_NOFILE) while it builds
//! a link or a connection must decline and let the connection fall back to TCP, or (for a
//! second link) go on with the links it has; it must never fail a connect after a long timer
//! or stop serving SMC-R once descriptors are free again (issue #20 item 1).
//!
//! The peer is the test binary re-executed with `SMC_REL_NOFILE=<n>`: it lowers its own
//! limit before it creates its stack, as `ulimit -n <n>` before `smc nc -l --echo` does.
#![allow(missing_docs)]

mod reliability_common;

use std::io::{Read, Write};
use std::net::Shutdown;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use reliability_common::*;
use smc::{Mode, SmcStream, Stack};

#[test]
fn child_entry() {
    let Ok(role) = std::env::var("SMC_REL_CHILD") else {
        return;
    };
    let dir = PathBuf::from(std::env::var("SMC_REL_DIR").expect("dir"));
    let nofile: u64 = std::env::var("SMC_REL_NOFILE")
        .expect("SMC_REL_NOFILE")
        .parse()
        .expect("number");
    // The limit applies to what is opened from now on: the test harness and the stdin
    // thread already hold theirs, as a shell's `ulimit -n` leaves the program its start-up.
    // `ulimit -n <n>` as for a program that starts with only stdin, stdout and stderr: the
    // descriptors this process inherited (a CI runner's, a job shell's) would otherwise eat
    // into the budget, so the limit is raised past them until `n - 3` numbers are free.
    let open: std::collections::BTreeSet<u64> = std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    let want_free = nofile.saturating_sub(3);
    let (mut limit, mut free) = (0u64, 0u64);
    while free < want_free {
        if !open.contains(&limit) {
            free += 1;
        }
        limit += 1;
    }
    let nofile = limit;
    let lim = rustix::process::Rlimit {
        current: Some(nofile),
        maximum: Some(nofile),
    };
    rustix::process::setrlimit(rustix::process::Resource::Nofile, lim).expect("setrlimit");
    match role.as_str() {
        "echo-server" => {
            exit_on_stdin_eof();
            run_echo_server(&stack(&dir))
        }
        "client" => {
            // A client under the limit, connecting to the parent's listener.
            let port: u16 = std::env::var("SMC_REL_PORT")
                .expect("port")
                .parse()
                .expect("port");
            let st = stack(&dir);
            let mut held = Vec::new();
            for i in 0..CLIENTS {
                match round_trip(&st, port, i) {
                    Ok((s, mode)) => {
                        eprintln!("client under the limit, connection {i}: {mode}");
                        check_mode(mode, "client under the limit");
                        held.push(s);
                    }
                    // No descriptor left even for the TCP socket: a plain TCP client could
                    // not connect either (checked), which is no SMC-R matter.
                    Err(RoundTrip::NoSocket(e)) => {
                        let plain = std::net::TcpStream::connect(("127.0.0.1", port));
                        eprintln!(
                            "client under the limit, connection {i}: {e}; plain TCP: {plain:?}"
                        );
                        assert!(plain.is_err(), "plain TCP connected where SMC failed: {e}");
                        break;
                    }
                    Err(RoundTrip::Failed(e)) => panic!("{e}"),
                }
            }
            // Descriptors free again once the closed connections' sockets are released
            // (the runtime closes them after the closing exchange with the peer): SMC-R, or
            // a Decline and TCP, works again.
            drop(held);
            let mut mode = None;
            let ok = wait_until(Duration::from_secs(20), || {
                match round_trip(&st, port, 99) {
                    Ok((_, m)) => {
                        mode = Some(m);
                        true
                    }
                    Err(RoundTrip::NoSocket(_)) => false,
                    Err(e) => panic!("{e}"),
                }
            });
            assert!(ok, "client: no descriptor came back after closing");
            let mode = mode.expect("mode");
            eprintln!("client under the limit, after closing: {mode}");
            check_mode(mode, "client, after closing");
            std::process::exit(0);
        }
        other => panic!("unknown role {other}"),
    }
}

/// Set RLIMIT_NOFILE (soft and hard) so that exactly `free` descriptor numbers below it are
/// unused now: the next `free` descriptors this process opens succeed, the one after fails
/// with EMFILE (as long as no other thread opens or closes one meanwhile).
fn limit_to_free(free: u64) {
    // The listing's own descriptor takes the lowest unused number, which is free again
    // after it: found by opening and closing one just before.
    let probe = std::fs::File::open("/dev/null").expect("/dev/null");
    let listing = rustix::fd::AsRawFd::as_raw_fd(&probe) as u64;
    drop(probe);
    let mut open: std::collections::BTreeSet<u64> = std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    open.remove(&listing);
    let (mut limit, mut unused) = (0u64, 0u64);
    // Up to the number the next descriptor would get once `free` are taken (open numbers
    // below it count toward the limit, as the kernel compares numbers, and poll(2) refuses
    // more descriptors than the limit).
    while unused < free || open.contains(&limit) {
        if !open.contains(&limit) {
            unused += 1;
        }
        limit += 1;
    }
    let lim = rustix::process::Rlimit {
        current: Some(limit),
        maximum: Some(limit),
    };
    rustix::process::setrlimit(rustix::process::Resource::Nofile, lim).expect("setrlimit");
}

/// Clients per round (each its own stack: its own peer, a first contact on the server).
const CLIENTS: u64 = 8;

/// Connect to `port` on `st`, echo 64 KiB through the connection and check them; returns the
/// open stream (held, so that the peer's descriptors stay in use) and its mode.
/// How a round trip failed.
#[derive(Debug)]
enum RoundTrip {
    /// The TCP socket itself could not be made (EMFILE at `socket()`, before any SMC-R).
    NoSocket(std::io::Error),
    /// Anything else.
    Failed(String),
}

impl std::fmt::Display for RoundTrip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RoundTrip::NoSocket(e) => write!(f, "no socket: {e}"),
            RoundTrip::Failed(e) => f.write_str(e),
        }
    }
}

impl From<String> for RoundTrip {
    fn from(s: String) -> Self {
        RoundTrip::Failed(s)
    }
}

fn round_trip(st: &Stack, port: u16, seed: u64) -> Result<(SmcStream, Mode), RoundTrip> {
    let t0 = Instant::now();
    let mut s = match SmcStream::connect_with(st, ("127.0.0.1", port)) {
        Ok(s) => s,
        Err(e) if e.raw_os_error() == Some(24) && t0.elapsed() < Duration::from_secs(1) => {
            return Err(RoundTrip::NoSocket(e));
        }
        Err(e) => {
            return Err(RoundTrip::Failed(format!(
                "connection {seed}: connect failed after {:?}: {e}",
                t0.elapsed()
            )));
        }
    };
    let mode = s.mode();
    let mut data = vec![0u8; 64 * 1024];
    Pattern::new(seed).fill(&mut data);
    // In steps, on this one stream: a writer thread would need a second descriptor (a
    // `try_clone`), which under the limit is the test's own shortage, not the stack's.
    let mut back = vec![0u8; data.len()];
    for (out, into) in data.chunks(8 * 1024).zip(back.chunks_mut(8 * 1024)) {
        s.write_all(out)
            .map_err(|e| format!("connection {seed} ({mode}): write: {e}"))?;
        s.read_exact(into)
            .map_err(|e| format!("connection {seed} ({mode}): echo read: {e}"))?;
    }
    if back != data {
        return Err(format!("connection {seed} ({mode}): echo differs").into());
    }
    // A hang bound (the tester saw 10 s LLC timeouts): not a timing assertion.
    if t0.elapsed() > Duration::from_secs(8) {
        return Err(format!(
            "connection {seed} ({mode}) took {:?}: it waited for a timer",
            t0.elapsed()
        )
        .into());
    }
    Ok((s, mode))
}

fn check_mode(mode: Mode, what: &str) {
    match mode {
        Mode::Smc => {}
        Mode::Tcp(r) => assert!(
            r.decline_code().is_some(),
            "{what}: fell back without a Decline: {r}"
        ),
    }
}

/// `ulimit -n <n>` on the server: every client gets SMC-R or a Decline and TCP, each in
/// time; after the clients left, a new one is served again (no dead SMC-R service).
#[test]
fn server_out_of_descriptors_declines_and_recovers() {
    if is_child() {
        return;
    }
    for nofile in [30u64, 40, 64] {
        let dir = test_dir("nofile");
        let peer = Peer::spawn(
            "child_entry",
            "echo-server",
            &dir,
            &[("SMC_REL_NOFILE", nofile.to_string())],
        );
        let mut held = Vec::new();
        let (mut smc, mut tcp) = (0, 0);
        for i in 0..CLIENTS {
            let st = stack(&dir);
            let (s, mode) =
                round_trip(&st, peer.port, i).unwrap_or_else(|e| panic!("ulimit -n {nofile}: {e}"));
            check_mode(mode, &format!("ulimit -n {nofile}, connection {i}"));
            println!("ulimit -n {nofile}: connection {i}: {mode}");
            // SMC-R connections stay open (their link groups hold the server's
            // descriptors); a fallen-back one holds one descriptor there, as a plain TCP
            // server's would, and is closed at once so that the server stays within what
            // a TCP server could serve.
            if mode == Mode::Smc {
                smc += 1;
                held.push((s, st));
            } else {
                tcp += 1;
            }
        }
        println!("ulimit -n {nofile}: {smc} SMC-R, {tcp} TCP while held");
        for (mut s, st) in held.drain(..) {
            let _ = s.shutdown(Shutdown::Both);
            drop(s);
            drop(st);
        }
        // Everyone left: the server's link groups go with their peers; SMC-R serves again
        // where one SMC-R connection fits in the limit (the server's start-up holds 13
        // descriptors, an SMC-R connection with its two links about 21 more), and a
        // connection works in any case.
        let need_smc = nofile >= 40;
        let mut again = None;
        let ok = wait_until(Duration::from_secs(30), || {
            let st = stack(&dir);
            // (A server that cannot take in a first contact's client RMB declines it,
            // `Endpoint::link_connected`: no reset at the limit's edge.)
            let (s, mode) = round_trip(&st, peer.port, 100)
                .unwrap_or_else(|e| panic!("ulimit -n {nofile}, after: {e}"));
            check_mode(mode, "after");
            again = Some(mode);
            drop(s);
            if mode != Mode::Smc && need_smc {
                // A failed attempt's QPs stay retired on the server for up to 2 s (their
                // receive queues may still hold messages): at the edge of the limit, attempts
                // faster than that would keep the descriptors taken.
                std::thread::sleep(Duration::from_millis(2500));
            }
            mode == Mode::Smc || !need_smc
        });
        println!("ulimit -n {nofile}: after the clients left: {again:?}");
        assert!(ok, "ulimit -n {nofile}: no SMC-R after the clients left");
        peer.finish();
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// `ulimit -n <n>` on the client: its connections get SMC-R or a Decline and TCP, in time.
#[test]
fn client_out_of_descriptors_declines() {
    if is_child() {
        return;
    }
    let dir = test_dir("nofile-client");
    let st = stack(&dir);
    let server = smc::SmcListener::bind_with(&st, "127.0.0.1:0").expect("bind");
    let port = server.local_addr().expect("addr").port();
    // Accept for as long as the test runs: how many connections a client gets under its
    // limit depends on how many descriptors its start-up took (a CI runner's differ from a
    // shell's), so no count is right here; the thread ends with the test process.
    serve_echo(server);
    for nofile in [30u64, 40] {
        let peer = Peer::spawn_connector(
            "child_entry",
            "client",
            &dir,
            &[
                ("SMC_REL_NOFILE", nofile.to_string()),
                ("SMC_REL_PORT", port.to_string()),
            ],
        );
        let mut child = peer.child;
        let status = child.wait().expect("wait");
        assert!(
            status.success(),
            "client under ulimit -n {nofile}: {status}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// One element per RMB: every connection of a link group brings a new RMB on both sides (a
/// memfd, a CONFIRM RKEY exchange), as a stack configured with `rmb_bytes` equal to its
/// RMBE size has (the default holds two 1 MiB RMBEs per RMB).
const ONE_RMB: u32 = 1024 * 1024;

fn one_rmb_stack(dir: &std::path::Path) -> Stack {
    let mut c = config(dir);
    c.buffer_size = ONE_RMB;
    c.rmb_bytes = ONE_RMB;
    Stack::new(c).expect("stack")
}

/// Descriptors left free after the first connection (the link group) is up: every count
/// from none to a few connections' worth, so that each step of a new connection's setup (its
/// TCP socket, our new RMB's memfd, mapping the peer's new RMB) is the one that runs out.
const FREE_AFTER_FIRST: [u64; 6] = [0, 1, 2, 3, 4, 5];

/// The counts to run: `SMC_REL_FREE_LIST` (comma-separated) or [`FREE_AFTER_FIRST`].
fn free_counts() -> Vec<u64> {
    match std::env::var("SMC_REL_FREE_LIST") {
        Ok(v) => v.split(',').filter_map(|n| n.trim().parse().ok()).collect(),
        Err(_) => FREE_AFTER_FIRST.to_vec(),
    }
}

/// Echo `total` pattern bytes of `seed` through `s` in 8 KiB steps (no second descriptor for
/// a writer thread) and compare the SHA-256 of what came back with what went out.
fn echo_check(s: &mut SmcStream, seed: u64, total: usize) -> Result<(), String> {
    use sha2::{Digest, Sha256};
    let (mut sent, mut got) = (Sha256::new(), Sha256::new());
    let mut p = Pattern::new(seed);
    let (mut out, mut back) = (vec![0u8; 8 * 1024], vec![0u8; 8 * 1024]);
    let mut left = total;
    while left > 0 {
        let n = left.min(out.len());
        p.fill(&mut out[..n]);
        s.write_all(&out[..n])
            .map_err(|e| format!("write after {} bytes: {e}", total - left))?;
        s.read_exact(&mut back[..n])
            .map_err(|e| format!("read after {} bytes: {e}", total - left))?;
        sent.update(&out[..n]);
        got.update(&back[..n]);
        left -= n;
    }
    if sent.finalize() != got.finalize() {
        return Err(format!("{total} bytes echoed differ (SHA-256)"));
    }
    Ok(())
}

/// Wait (bounded) until `st` has both links of its link group up.
fn wait_links_up(st: &Stack) {
    assert!(
        wait_until(Duration::from_secs(10), || st.stats().links_up >= 2),
        "the link group's second link did not come up"
    );
}

#[test]
fn child_entry_one_rmb() {
    let Ok(role) = std::env::var("SMC_REL_CHILD") else {
        return;
    };
    let dir = PathBuf::from(std::env::var("SMC_REL_DIR").expect("dir"));
    let free: u64 = env_count("SMC_REL_FREE", 0);
    match role.as_str() {
        "one-rmb-server" => {
            exit_on_stdin_eof();
            let st = one_rmb_stack(&dir);
            let l = smc::SmcListener::bind_with(&st, "127.0.0.1:0").expect("bind");
            println!("PORT {}", l.local_addr().expect("addr").port());
            let first = l.accept().expect("first connection").0;
            let echoed = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
            let count = echoed.clone();
            std::thread::spawn(move || echo_counting(first, &count));
            wait_links_up(&st);
            let seen = wait_until(Duration::from_secs(10), || {
                echoed.load(std::sync::atomic::Ordering::Acquire) >= 64 * 1024
            });
            assert!(seen, "the first connection's echo did not complete");
            let mark = dir.join("limited.tmp");
            std::fs::write(&mark, b"").expect("mark");
            limit_to_free(free);
            std::fs::rename(&mark, dir.join("limited")).expect("rename");
            for s in l.incoming() {
                match s {
                    Ok(s) => {
                        std::thread::spawn(move || echo(s));
                    }
                    Err(e) => eprintln!("one-rmb server, {free} free: accept: {e}"),
                }
            }
            std::process::exit(0)
        }
        "one-rmb-client" => {
            let port: u16 = env_count("SMC_REL_PORT", 0) as u16;
            let st = one_rmb_stack(&dir);
            let (mut first, mode) = round_trip(&st, port, 0).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(mode, Mode::Smc, "the first connection");
            wait_links_up(&st);
            // The result file is opened before the limit: writing it needs no descriptor.
            let mut result =
                std::fs::File::create(dir.join(format!("result-{free}"))).expect("result");
            limit_to_free(free);
            let (mut held, mut modes) = (Vec::new(), Vec::new());
            for i in 1..=6 {
                match round_trip(&st, port, i) {
                    Ok((s, mode)) => {
                        check_mode(mode, &format!("{free} free, connection {i}"));
                        modes.push(mode);
                        held.push((i, s, mode));
                    }
                    Err(RoundTrip::NoSocket(_)) => break,
                    Err(RoundTrip::Failed(e)) => panic!("{free} free: {e}"),
                }
            }
            // The link group and every connection on it survived: a megabyte more through
            // the first connection, 64 KiB more through every other SMC-R one.
            echo_check(&mut first, 100, 1 << 20)
                .unwrap_or_else(|e| panic!("{free} free: the first connection: {e}"));
            for (i, s, mode) in held.iter_mut() {
                echo_check(s, 100 + *i, 64 * 1024)
                    .unwrap_or_else(|e| panic!("{free} free: connection {i} ({mode}): {e}"));
            }
            let stats = st.stats();
            assert_eq!(stats.links_down, 0, "{free} free: a link went down");
            let refused = st.endpoint_stats().rkeys_refused;
            eprintln!("one-rmb client, {free} free: {modes:?}, {refused} peer RMBs refused");
            writeln!(result, "{refused}").expect("result");
            std::process::exit(0);
        }
        other => panic!("unknown role {other}"),
    }
}

/// Echo every client of `server` in a thread of its own, for as long as the test process
/// runs.
fn serve_echo(server: smc::SmcListener) {
    std::thread::spawn(move || {
        for s in server.incoming() {
            match s {
                Ok(s) => {
                    std::thread::spawn(move || echo(s));
                }
                Err(e) => eprintln!("accept: {e}"),
            }
        }
    });
}

/// `echo`, counting the bytes echoed in `count`.
fn echo_counting(mut s: SmcStream, count: &std::sync::atomic::AtomicU64) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if s.write_all(&buf[..n]).is_err() {
                    break;
                }
                count.fetch_add(n as u64, std::sync::atomic::Ordering::AcqRel);
            }
        }
    }
    let _ = s.shutdown(Shutdown::Write);
}

/// Issue #22/#20: a client with one element per RMB runs out of descriptors while the
/// server adds an RMB for its next connection. Each such connection gets SMC-R, or a
/// Decline and TCP; the link group, its first connection and its data survive.
#[test]
fn client_out_of_descriptors_keeps_the_link_group() {
    if is_child() {
        return;
    }
    let dir = test_dir("one-rmb-client");
    let st = one_rmb_stack(&dir);
    let server = smc::SmcListener::bind_with(&st, "127.0.0.1:0").expect("bind");
    let port = server.local_addr().expect("addr").port();
    serve_echo(server);
    let mut refused = 0;
    for free in free_counts() {
        let peer = Peer::spawn_connector(
            "child_entry_one_rmb",
            "one-rmb-client",
            &dir,
            &[
                ("SMC_REL_FREE", free.to_string()),
                ("SMC_REL_PORT", port.to_string()),
            ],
        );
        let mut child = peer.child;
        let status = child.wait().expect("wait");
        assert!(status.success(), "client with {free} free: {status}");
        let r = std::fs::read_to_string(dir.join(format!("result-{free}"))).expect("result");
        refused += r.trim().parse::<u64>().expect("count");
    }
    // At least one of the counts ran out exactly where the server's new RMB is taken in.
    assert!(
        refused > 0,
        "no peer RMB was refused: the case was not reached"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The same with the server out of descriptors: it takes in the client's new RMB.
#[test]
fn server_out_of_descriptors_keeps_the_link_group() {
    if is_child() {
        return;
    }
    let mut regbuf = 0;
    for free in free_counts() {
        let dir = test_dir("one-rmb-server");
        let peer = Peer::spawn(
            "child_entry_one_rmb",
            "one-rmb-server",
            &dir,
            &[("SMC_REL_FREE", free.to_string())],
        );
        let st = one_rmb_stack(&dir);
        let (mut first, mode) =
            round_trip(&st, peer.port, 0).unwrap_or_else(|e| panic!("{free} free: {e}"));
        assert_eq!(mode, Mode::Smc, "{free} free: the first connection");
        assert!(
            wait_until(Duration::from_secs(10), || dir.join("limited").exists()),
            "{free} free: the server did not lower its limit"
        );
        let (mut held, mut modes) = (Vec::new(), Vec::new());
        for i in 1..=6 {
            let (s, mode) =
                round_trip(&st, peer.port, i).unwrap_or_else(|e| panic!("{free} free: {e}"));
            check_mode(mode, &format!("{free} free, connection {i}"));
            if let Mode::Tcp(r) = mode {
                if r.decline_code().map(|c| c.0) == Some(0x0999_0003) {
                    regbuf += 1;
                }
            }
            modes.push(mode);
            // SMC-R connections stay open (they hold the server's descriptors); a fallen-back
            // one is closed at once, as a TCP server's client would find it.
            if mode == Mode::Smc {
                held.push((i, s));
            }
        }
        println!("one-rmb server, {free} free: {modes:?}");
        echo_check(&mut first, 100, 1 << 20)
            .unwrap_or_else(|e| panic!("{free} free: the first connection: {e}"));
        for (i, s) in held.iter_mut() {
            echo_check(s, 100 + *i, 64 * 1024)
                .unwrap_or_else(|e| panic!("{free} free: connection {i}: {e}"));
        }
        assert_eq!(st.stats().links_down, 0, "{free} free: a link went down");
        drop(held);
        drop(first);
        peer.finish();
        let _ = std::fs::remove_dir_all(&dir);
    }
    // At least one count ran out where the server takes in the client's new RMB: the
    // client declined "reg rdma bufs failed" after the negative CONFIRM RKEY.
    assert!(regbuf > 0, "no connection was declined for a refused RMB");
}
