//! `smc::fdapi::connect_start`: a client's `connect` that returns once its Proposal is out,
//! before the server's answer, and the handshake finished later
//! (`ClientHandshake::advance`). A server program that accepts a connection only after its
//! client used another one (FTP's passive data connections) answers the Proposal only then;
//! a `connect` that waited for the Accept waited the whole accept wait (6 s) and fell back
//! to TCP.
//!
//! The client is the process-wide stack of `smc::fdapi` (configured from the environment:
//! assert-peer discovery, a fabric directory of its own, a 1.5 s accept wait); the server a
//! stack of the API on the same fabric directory, which answers only when the test accepts.
#![allow(missing_docs)]

use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::time::Duration;

use smc::fdapi::{Connecting, Setup};
use smc::{DiscoveryMode, FallbackReason, Mode, SmcListener, Stack, StackConfig};
use smc_fabric::FabricConfig;
use smc_wire::DeclineCode;

/// The environment of the process-wide stack, set once before anything else runs.
fn fdapi_dir() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("smc-connect-start-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("fabric dir");
        std::env::set_var("SMC_FABRIC_DIR", &d);
        std::env::set_var("SMC_DISCOVERY", "assert-peer");
        std::env::set_var("SMC_ACCEPT_WAIT_MS", "1500");
        d
    })
    .clone()
}

fn server_stack() -> Stack {
    let mut c = StackConfig::new(FabricConfig::with_dir(fdapi_dir(), 2));
    c.discovery = DiscoveryMode::AssertPeer;
    Stack::new(c).expect("server stack")
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

/// `connect_start` returns with the Proposal out while the server has not accepted; the
/// handshake waits (no answer in the socket) until the server accepts, and then ends in
/// SMC-R: bytes cross both ways.
#[test]
fn connect_returns_before_the_accept_and_the_handshake_ends_in_smc_r_later() {
    let _ = smc::fdapi::stack().expect("fdapi stack");
    let server = server_stack();
    let l = SmcListener::bind_with(&server, "127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let fd = socket();
    let mut h = start(&fd, addr);
    // Nobody accepted: no answer, and a look does not end it.
    std::thread::sleep(Duration::from_millis(200));
    assert!(!h.answered(), "an answer before the server's accept");
    assert!(h.advance(Some(Duration::ZERO)).expect("look").is_none());
    // The server program accepts only now (after its client "sent RETR").
    let srv = std::thread::spawn(move || {
        let (mut s, _) = l.accept().expect("accept");
        use std::io::{Read, Write};
        let mut b = [0u8; 5];
        s.read_exact(&mut b).expect("request");
        s.write_all(&b).expect("echo");
        s.mode()
    });
    let conn = match h.advance(None).expect("handshake") {
        Some(Setup::Smc(c)) => c,
        other => panic!("not SMC-R: {other:?}"),
    };
    assert_eq!(conn.write(b"hello", false).expect("write"), 5);
    let mut back = [0u8; 5];
    let mut got = 0;
    while got < 5 {
        got += conn.read(&mut back[got..], false).expect("read");
    }
    assert_eq!(&back, b"hello");
    assert_eq!(srv.join().expect("server"), Mode::Smc);
}

/// A server that never answers: the stack's accept wait ends the handshake with a Decline
/// (`NOACCEPT`) and the connection is TCP; the program's socket is then usable as TCP.
#[test]
fn a_handshake_the_server_never_answers_falls_back_at_the_accept_wait() {
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
