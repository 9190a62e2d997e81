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
