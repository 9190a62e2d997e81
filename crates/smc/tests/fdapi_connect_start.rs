//! `smc::fdapi::connect_start`: a client's `connect` that returns once its Proposal is out,
//! before the server's answer, and the handshake finished later
//! (`ClientHandshake::advance`). A server program that accepts a connection only after its
//! client used another one (FTP's passive data connections) answers the Proposal only then;
//! a `connect` that waited for the Accept waited the whole accept wait (6 s) and fell back
//! to TCP.
//!
//! The client is the process-wide stack of `smc::fdapi` (configured from the environment:
//! assert-peer discovery, a fabric directory of its own, a 1.5 s accept wait); the server a
//! process of its own on the same fabric directory, which runs its rendezvous only when the
//! test lets it accept.
#![allow(missing_docs)]

use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::time::Duration;

use smc::fdapi::{Connecting, Setup};
use smc::{FallbackReason, Mode};
use smc_wire::DeclineCode;

/// The environment of the process-wide stack, set once before anything else runs.
fn fdapi_dir() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        // (The server program, a process of its own, is given the client's directory.)
        let d = std::env::var_os("SMC_TEST_DIR").map_or_else(
            || std::env::temp_dir().join(format!("smc-connect-start-{}", std::process::id())),
            PathBuf::from,
        );
        std::fs::create_dir_all(&d).expect("fabric dir");
        std::env::set_var("SMC_FABRIC_DIR", &d);
        std::env::set_var("SMC_DISCOVERY", "assert-peer");
        std::env::set_var("SMC_ACCEPT_WAIT_MS", "1500");
        d
    })
    .clone()
}

fn socket() -> OwnedFd {
    rustix::net::socket(
        rustix::net::AddressFamily::INET,
        rustix::net::SocketType::STREAM,
        None,
    )
    .expect("socket")
}

fn start(fd: &OwnedFd, addr: SocketAddr) -> smc::fdapi::ClientHandshake {
    match smc::fdapi::connect_start(fd.as_fd(), addr, false, Duration::ZERO).expect("connect_start")
    {
        Connecting::Waiting(h) => h,
        Connecting::Done(s) => panic!("ended before the server accepted: {s:?}"),
    }
}

/// The server program of [`connect_returns_before_the_accept_and_the_handshake_ends_at_the_answer`],
/// run as a process of its own (this test binary with `SMC_TEST_SERVER` set; a stack
/// cannot reach itself): listens, prints its port, accepts only when a line comes on its
/// standard input, answers the Proposal with a Decline and echoes 5 bytes over TCP. Does nothing in an ordinary test run.
#[test]
fn server_program() {
    if std::env::var_os("SMC_TEST_SERVER").is_none() {
        return;
    }
    fdapi_dir();
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    println!("port {}", l.local_addr().expect("addr").port());
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).expect("go");
    let (mut s, _) = l.accept().expect("accept");
    // The server's answer: a Decline (as the library's for a connection handed to an
    // exec'd program), after which both ends use the TCP connection.
    assert!(smc::fdapi::decline_accepted(s.as_fd()).expect("answer"));
    use std::io::{Read, Write};
    let mut b = [0u8; 5];
    s.read_exact(&mut b).expect("request");
    s.write_all(&b).expect("echo");
    // Until the client is done.
    let _ = std::io::stdin().read_line(&mut line);
}

/// `connect_start` returns with the Proposal out while the server program has not
/// accepted; the handshake waits (no answer in the socket) until the server accepts and
/// answers, and ends with that answer (here a Decline: TCP; the SMC-R end is checked with
/// two programs under `smc run` by `scripts/preload-ftpstyle.py`).
#[test]
fn connect_returns_before_the_accept_and_the_handshake_ends_at_the_answer() {
    use std::io::{BufRead, Write};
    let dir = fdapi_dir();
    let mut server = std::process::Command::new(std::env::current_exe().expect("exe"))
        .args([
            "server_program",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("SMC_TEST_SERVER", "1")
        .env("SMC_TEST_DIR", &dir)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("server program");
    let mut out = std::io::BufReader::new(server.stdout.take().expect("stdout"));
    let port = loop {
        let mut line = String::new();
        assert!(
            out.read_line(&mut line).expect("port") > 0,
            "the server ended"
        );
        // (After the harness's "test server_program ... " on the same line.)
        if let Some(p) = line
            .trim()
            .rsplit("port ")
            .next()
            .filter(|_| line.contains("port "))
        {
            break p.parse::<u16>().expect("port number");
        }
    };
    let _ = smc::fdapi::stack().expect("fdapi stack");
    let fd = socket();
    let mut h = start(&fd, SocketAddr::from(([127, 0, 0, 1], port)));
    // Nobody accepted: no answer, and a look does not end it.
    std::thread::sleep(Duration::from_millis(200));
    assert!(!h.answered(), "an answer before the server's accept");
    assert!(h.advance(Some(Duration::ZERO)).expect("look").is_none());
    // The server program accepts only now (after its client "sent RETR").
    let mut stdin = server.stdin.take().expect("stdin");
    stdin.write_all(b"accept\n").expect("go");
    let t = match h.advance(None).expect("handshake") {
        Some(Setup::Tcp(t)) => t,
        other => panic!("not the server's Decline: {other:?}"),
    };
    assert!(
        matches!(
            t.mode(),
            Mode::Tcp(FallbackReason::PeerDeclined {
                code: DeclineCode::EXECED,
                ..
            })
        ),
        "{:?}",
        t.mode()
    );
    // The program's socket carries its bytes both ways from here.
    let mut s = std::net::TcpStream::from(fd);
    s.write_all(b"hello").expect("write");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut back = [0u8; 5];
    std::io::Read::read_exact(&mut s, &mut back).expect("echo");
    assert_eq!(&back, b"hello");
    drop(stdin);
    assert!(server.wait().expect("server").success());
}

/// A server that never answers: the stack's accept wait ends the handshake with a Decline
/// (`NOACCEPT`) and the connection is TCP; the program's socket is then usable as TCP.
#[test]
fn a_handshake_the_server_never_answers_falls_back_at_the_accept_wait() {
    fdapi_dir();
    let _ = smc::fdapi::stack().expect("fdapi stack");
    // A plain listener that accepts and never answers the Proposal.
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let fd = socket();
    let mut h = start(&fd, addr);
    let (mut peer, _) = l.accept().expect("accept");
    let t = match h.advance(None).expect("handshake") {
        Some(Setup::Tcp(t)) => t,
        other => panic!("not TCP: {other:?}"),
    };
    assert_eq!(
        t.mode(),
        Mode::Tcp(FallbackReason::Declined(DeclineCode::NOACCEPT))
    );
    // The peer reads our Proposal and Decline, then the program's bytes on its socket.
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::from(fd);
    s.write_all(b"data").expect("write");
    peer.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut all = Vec::new();
    let mut b = [0u8; 512];
    while !all.ends_with(b"data") {
        let n = peer.read(&mut b).expect("read");
        assert!(n > 0, "end of stream before the program's bytes");
        all.extend_from_slice(&b[..n]);
    }
}
