//! A CLC handshake flood: hundreds of clients connect to an `SmcListener` and then stall,
//! some before their first byte, some in the middle of their Proposal. The listener must not
//! make a thread per stalled connection (the tester saw 3,020 threads for 3,000), and a
//! genuine client must still get SMC-R meanwhile (issue #20 item 8).
#![allow(missing_docs)]

mod reliability_common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use reliability_common::*;
use smc::{Mode, SmcListener, SmcStream, Stack};

/// Stalled connections of each kind.
const STALLED: usize = 300;

fn threads() -> usize {
    proc_resources().threads
}

#[test]
fn stalled_handshakes_make_no_thread_each() {
    let dir = test_dir("flood");
    let mut cfg = config(&dir);
    // Long enough that nothing stalled ends during the test.
    cfg.assert_peer_wait = Duration::from_secs(20);
    cfg.clc_timeout = Duration::from_secs(30);
    // The test's long CLC timer covers the wait for the Accept too (not the 6 s default).
    cfg.accept_wait = cfg.clc_timeout;
    let server = Stack::new(cfg).expect("stack");
    let l = SmcListener::bind_with(&server, "127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for s in l.incoming() {
            match s {
                Ok(s) => {
                    std::thread::spawn(move || echo(s));
                }
                Err(e) => eprintln!("accept: {e}"),
            }
        }
    });
    let client = stack(&dir);
    // Warm up: one genuine connection (the link group exists from now on).
    let s = SmcStream::connect_with(&client, ("127.0.0.1", port)).expect("connect");
    assert_eq!(s.mode(), Mode::Smc);
    drop(s);
    std::thread::sleep(Duration::from_millis(200));
    let before = threads();
    let proposal = smc_wire::examples::bytes("clc_proposal_v4").expect("vector");
    let mut stalled = Vec::new();
    let t0 = Instant::now();
    for i in 0..2 * STALLED {
        let mut s = TcpStream::connect(("127.0.0.1", port)).expect("flood connect");
        if i % 2 == 1 {
            // Half a Proposal, then silence.
            s.write_all(&proposal[..20]).expect("write");
        }
        stalled.push(s);
    }
    // The listener takes them in; the peak thread count while it does is what counts.
    let mut peak = threads();
    let until = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < until {
        peak = peak.max(threads());
        std::thread::sleep(Duration::from_millis(20));
    }
    println!(
        "{} stalled connections in {:?}: threads {before} before, peak {peak}",
        stalled.len(),
        t0.elapsed()
    );
    // A genuine client is served meanwhile.
    let t = Instant::now();
    let mut s = SmcStream::connect_with(&client, ("127.0.0.1", port)).expect("connect");
    assert_eq!(s.mode(), Mode::Smc);
    s.write_all(b"through the flood").expect("write");
    let mut back = [0u8; 17];
    s.read_exact(&mut back).expect("echo");
    assert_eq!(&back, b"through the flood");
    println!("a genuine connection during the flood: {:?}", t.elapsed());
    assert!(
        peak < before + 64,
        "{} stalled handshakes took {} threads",
        stalled.len(),
        peak - before
    );
    drop(stalled);
    let _ = std::fs::remove_dir_all(&dir);
}
