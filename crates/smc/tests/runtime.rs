//! The runtime end to end: two processes (this test binary re-executes itself as the peer,
//! `child_entry` with `SMC_RT_CHILD=<role>`) on a private shm fabric with two devices, talking
//! over real TCP on loopback and the fabric.
//!
//! Discovery: the explicit assert-peer mode, so the tests need no privileges; the eBPF path
//! has its own test (root only, like `ebpf_discovery.rs`).
#![allow(missing_docs)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use smc::{DiscoveryMode, FallbackReason, Mode, SmcListener, SmcStream, Stack, StackConfig};
use smc_fabric::FabricConfig;

fn test_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "smc-rt-{}-{}-{}",
        tag,
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0)
    ));
    std::fs::create_dir_all(&d).expect("fabric dir");
    d
}

fn stack(dir: &Path, discovery: DiscoveryMode) -> Stack {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("SMC_LOG"))
        .with_writer(std::io::stderr)
        .try_init();
    let mut c = StackConfig::new(FabricConfig::with_dir(dir, 2));
    c.discovery = discovery;
    c.clc_timeout = Duration::from_secs(20);
    // The test's long CLC timer covers the wait for the Accept too (not the 6 s default).
    c.accept_wait = c.clc_timeout;
    Stack::new(c).expect("stack")
}

/// FNV-1a: a checksum that catches reordered, lost or duplicated bytes.
fn checksum(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A peer process running `role`, with the port it listens on (if it prints one).
struct Peer {
    child: Child,
    port: u16,
}

impl Peer {
    fn spawn(role: &str, dir: &Path, arg: &str) -> Peer {
        let mut child = Command::new(std::env::current_exe().expect("exe"))
            .args(["child_entry", "--exact", "--nocapture", "--test-threads=1"])
            .env("SMC_RT_CHILD", role)
            .env("SMC_RT_DIR", dir)
            .env("SMC_RT_ARG", arg)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn peer");
        let out = child.stdout.take().expect("stdout");
        let mut port = 0;
        for line in BufReader::new(out).lines() {
            let line = line.expect("peer output");
            // libtest prints "test child_entry ... " on the same line first.
            if let Some(i) = line.find("PORT ") {
                port = line[i + 5..].trim().parse().expect("port");
                break;
            }
        }
        assert_ne!(port, 0, "peer did not report its port");
        Peer { child, port }
    }

    fn finish(mut self) {
        drop(self.child.stdin.take());
        let status = self.child.wait().expect("wait peer");
        assert!(status.success(), "peer failed: {status}");
    }
}

/// Exit when the parent closes our stdin (or dies).
fn exit_on_stdin_eof() {
    std::thread::spawn(|| {
        let mut buf = [0u8; 16];
        while matches!(std::io::stdin().read(&mut buf), Ok(n) if n > 0) {}
        std::process::exit(0);
    });
}

fn echo(mut s: SmcStream) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if s.write_all(&buf[..n]).is_err() {
                    return;
                }
            }
            Err(_) => return,
        }
    }
    let _ = s.shutdown(Shutdown::Write);
}

#[test]
fn child_entry() {
    let Ok(role) = std::env::var("SMC_RT_CHILD") else {
        return;
    };
    let dir = PathBuf::from(std::env::var("SMC_RT_DIR").expect("dir"));
    let arg = std::env::var("SMC_RT_ARG").unwrap_or_default();
    let discovery: DiscoveryMode = if arg.is_empty() {
        DiscoveryMode::AssertPeer
    } else {
        arg.parse().expect("discovery")
    };
    exit_on_stdin_eof();
    match role.as_str() {
        // An SMC echo server: every connection echoed in its own thread.
        "echo-server" => {
            let st = stack(&dir, discovery);
            let l = SmcListener::bind_with(&st, "127.0.0.1:0").expect("bind");
            println!("PORT {}", l.local_addr().expect("addr").port());
            for s in l.incoming() {
                let s = s.expect("accept");
                std::thread::spawn(move || echo(s));
            }
        }
        other => panic!("unknown role {other}"),
    }
}

/// Write `data` from a second handle while reading the echo; returns what came back.
fn roundtrip(s: &mut SmcStream, data: &[u8]) -> Vec<u8> {
    let mut w = s.try_clone().expect("clone");
    let out = data.to_vec();
    let t = std::thread::spawn(move || {
        w.write_all(&out).expect("write");
    });
    let mut back = vec![0u8; data.len()];
    s.read_exact(&mut back).expect("read echo");
    t.join().expect("writer");
    back
}

#[test]
fn echo_many_sizes_across_processes() {
    if std::env::var_os("SMC_RT_CHILD").is_some() {
        return;
    }
    let dir = test_dir("echo");
    let peer = Peer::spawn("echo-server", &dir, "");
    let st = stack(&dir, DiscoveryMode::AssertPeer);
    let mut s = SmcStream::connect_with(&st, ("127.0.0.1", peer.port)).expect("connect");
    assert_eq!(s.mode(), Mode::Smc);
    assert!(s.peer_addr().expect("peer").port() == peer.port);
    assert!(s.local_addr().expect("local").ip().is_loopback());
    let sizes = [
        1usize, 2, 43, 44, 1000, 4096, 16383, 16384, 65535, 65536, 65537, 200_000, 1_000_003,
    ];
    for (i, &n) in sizes.iter().enumerate() {
        let data = pattern(n, i as u64 + 7);
        let back = roundtrip(&mut s, &data);
        assert_eq!(back.len(), data.len());
        assert_eq!(checksum(&back), checksum(&data), "size {n}");
    }
    // The link group has two links, one per device.
    let groups = st.link_groups();
    assert_eq!(groups.len(), 1);
    assert_eq!(groups[0].links.len(), 2, "{groups:?}");
    // Half close: our FIN reaches the echo server, which closes its side: we read EOF.
    s.shutdown(Shutdown::Write).expect("shutdown");
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).expect("read to EOF");
    assert!(rest.is_empty());
    assert_eq!(st.stats().smc, 1);
    drop(s);
    peer.finish();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn plain_tcp_client_falls_back_against_smc_listener() {
    if std::env::var_os("SMC_RT_CHILD").is_some() {
        return;
    }
    let dir = test_dir("plain-client");
    let st = stack(&dir, DiscoveryMode::AssertPeer);
    let l = SmcListener::bind_with(&st, "127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let client = std::thread::spawn(move || {
        let mut c = TcpStream::connect(addr).expect("connect");
        c.write_all(b"hello over plain TCP").expect("write");
        let mut back = [0u8; 20];
        c.read_exact(&mut back).expect("read");
        assert_eq!(&back, b"hello over plain TCP");
    });
    let (mut s, _) = l.accept().expect("accept");
    assert_eq!(s.mode(), Mode::Tcp(FallbackReason::NoProposal));
    let mut buf = [0u8; 20];
    s.read_exact(&mut buf).expect("read");
    s.write_all(&buf).expect("write");
    client.join().expect("client");
    assert_eq!(st.stats().fallbacks, 1);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn plain_tcp_client_that_waits_falls_back_after_bounded_delay() {
    if std::env::var_os("SMC_RT_CHILD").is_some() {
        return;
    }
    let dir = test_dir("silent-client");
    let mut c = StackConfig::new(FabricConfig::with_dir(&dir, 2));
    c.discovery = DiscoveryMode::AssertPeer;
    c.assert_peer_wait = Duration::from_millis(200);
    let st = Stack::new(c).expect("stack");
    let l = SmcListener::bind_with(&st, "127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    // A server-speaks-first client: it sends nothing until it hears from us.
    let client = std::thread::spawn(move || {
        let mut c = TcpStream::connect(addr).expect("connect");
        let mut greet = [0u8; 5];
        c.read_exact(&mut greet).expect("greeting");
        assert_eq!(&greet, b"READY");
    });
    let (mut s, _) = l.accept().expect("accept");
    assert_eq!(s.mode(), Mode::Tcp(FallbackReason::NoProposal));
    s.write_all(b"READY").expect("write");
    client.join().expect("client");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn smc_stream_against_plain_listener_falls_back_with_ebpf() {
    if std::env::var_os("SMC_RT_CHILD").is_some() {
        return;
    }
    if !rustix::process::geteuid().is_root() {
        eprintln!("not root: the eBPF path is not available, skipping");
        return;
    }
    let dir = test_dir("plain-server");
    let st = stack(&dir, DiscoveryMode::Ebpf);
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let server = std::thread::spawn(move || {
        let (mut c, _) = l.accept().expect("accept");
        let mut buf = [0u8; 4];
        c.read_exact(&mut buf).expect("read");
        c.write_all(&buf).expect("write");
    });
    let mut s = SmcStream::connect_with(&st, addr).expect("connect");
    assert_eq!(s.mode(), Mode::Tcp(FallbackReason::PeerWithoutOption));
    s.write_all(b"ping").expect("write");
    let mut back = [0u8; 4];
    s.read_exact(&mut back).expect("read");
    assert_eq!(&back, b"ping");
    server.join().expect("server");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn ebpf_discovery_runs_smc_across_processes() {
    if std::env::var_os("SMC_RT_CHILD").is_some() {
        return;
    }
    if !rustix::process::geteuid().is_root() {
        eprintln!("not root: the eBPF path is not available, skipping");
        return;
    }
    let dir = test_dir("ebpf");
    let peer = Peer::spawn("echo-server", &dir, "ebpf");
    let st = stack(&dir, DiscoveryMode::Ebpf);
    // An SMC client: both handshake segments carry the option, CLC runs.
    let mut s = SmcStream::connect_with(&st, ("127.0.0.1", peer.port)).expect("connect");
    assert_eq!(s.mode(), Mode::Smc);
    let data = pattern(300_000, 99);
    assert_eq!(checksum(&roundtrip(&mut s, &data)), checksum(&data));
    drop(s);
    // A plain TCP client against the same SMC listener: no option, plain TCP.
    let mut c = TcpStream::connect(("127.0.0.1", peer.port)).expect("plain connect");
    c.write_all(b"plain").expect("write");
    let mut back = [0u8; 5];
    c.read_exact(&mut back).expect("read");
    assert_eq!(&back, b"plain");
    drop(c);
    peer.finish();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn thousand_concurrent_connections_across_rmbs_and_link_groups() {
    if std::env::var_os("SMC_RT_CHILD").is_some() {
        return;
    }
    const N: usize = 1000;
    let dir = test_dir("scale");
    let peer = Peer::spawn("echo-server", &dir, "");
    let mut c = StackConfig::new(FabricConfig::with_dir(&dir, 2));
    c.discovery = DiscoveryMode::AssertPeer;
    c.buffer_size = 16 * 1024;
    let st = Stack::new(c).expect("stack");
    let mut conns = Vec::with_capacity(N);
    for i in 0..N {
        let s = SmcStream::connect_with(&st, ("127.0.0.1", peer.port))
            .unwrap_or_else(|e| panic!("connection {i}: {e}"));
        assert_eq!(s.mode(), Mode::Smc, "connection {i}");
        conns.push(s);
    }
    // Every connection is open at once; each carries its own bytes.
    for (i, s) in conns.iter_mut().enumerate() {
        let msg = pattern(100, i as u64);
        s.write_all(&msg).expect("write");
    }
    for (i, s) in conns.iter_mut().enumerate() {
        let mut back = [0u8; 100];
        s.read_exact(&mut back).expect("read");
        assert_eq!(back.to_vec(), pattern(100, i as u64), "connection {i}");
    }
    assert_eq!(st.stats().smc, N as u64);
    let groups = st.link_groups();
    // At most 255 connections per link group: the server opened parallel groups.
    assert!(groups.len() >= N.div_ceil(255), "{} groups", groups.len());
    assert_eq!(groups.iter().map(|g| g.connections).sum::<usize>(), N);
    drop(conns);
    peer.finish();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two stacks in this process on one fabric, a connected SMC-R pair between them.
fn local_pair(dir: &Path) -> (Stack, Stack, SmcStream, SmcStream) {
    let a = stack(dir, DiscoveryMode::AssertPeer);
    let b = stack(dir, DiscoveryMode::AssertPeer);
    let l = SmcListener::bind_with(&a, "127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let bc = b.clone();
    let t = std::thread::spawn(move || SmcStream::connect_with(&bc, addr).expect("connect"));
    let (server, _) = l.accept().expect("accept");
    let client = t.join().expect("client");
    assert_eq!(server.mode(), Mode::Smc);
    assert_eq!(client.mode(), Mode::Smc);
    (a, b, server, client)
}

#[test]
fn nonblocking_and_timeouts() {
    if std::env::var_os("SMC_RT_CHILD").is_some() {
        return;
    }
    let dir = test_dir("nonblocking");
    let (_a, _b, mut server, mut client) = local_pair(&dir);
    client.set_nonblocking(true).expect("nonblocking");
    let mut buf = [0u8; 16];
    assert_eq!(
        client.read(&mut buf).map_err(|e| e.kind()),
        Err(std::io::ErrorKind::WouldBlock)
    );
    server.write_all(b"data").expect("write");
    // The bytes arrive; poll for them within a generous bound.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let n = loop {
        match client.read(&mut buf) {
            Ok(n) => break n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                assert!(std::time::Instant::now() < deadline, "data never arrived");
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => panic!("read: {e}"),
        }
    };
    assert_eq!(&buf[..n], b"data");
    // A nonblocking writer fills the peer's RMBE (nobody reads) and then gets WouldBlock.
    let chunk = vec![7u8; 64 * 1024];
    let mut total = 0usize;
    let would_block = loop {
        match client.write(&chunk) {
            Ok(n) => total += n,
            Err(e) => break e.kind(),
        }
        assert!(total < 64 * 1024 * 1024, "the window never closed");
    };
    assert_eq!(would_block, std::io::ErrorKind::WouldBlock);
    assert!(total > 0);
    let mut sink = vec![0u8; total];
    server.read_exact(&mut sink).expect("read what was written");
    // A blocking read with a timeout on a silent connection times out.
    server
        .set_read_timeout(Some(Duration::from_millis(1)))
        .expect("timeout");
    assert_eq!(
        server.read(&mut buf).map_err(|e| e.kind()),
        Err(std::io::ErrorKind::WouldBlock)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn close_behaves_as_tcp() {
    if std::env::var_os("SMC_RT_CHILD").is_some() {
        return;
    }
    let dir = test_dir("close");
    let (_a, _b, mut server, mut client) = local_pair(&dir);
    client.write_all(b"last words").expect("write");
    drop(client);
    // The bytes written before close are delivered, then end of stream.
    let mut got = Vec::new();
    server.read_to_end(&mut got).expect("read to EOF");
    assert_eq!(got, b"last words");
    // Writing to a closed peer fails (as with TCP, not necessarily at the first write).
    let mut failed = None;
    for _ in 0..1000 {
        if let Err(e) = server.write(b"anyone?") {
            failed = Some(e.kind());
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let kind = failed.expect("writes to a closed peer kept succeeding");
    assert!(
        matches!(
            kind,
            std::io::ErrorKind::BrokenPipe
                | std::io::ErrorKind::ConnectionReset
                | std::io::ErrorKind::NotConnected
        ),
        "{kind:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A peer process that dies takes its stack, and so its links, with it: the link group is
/// lost. Its kernel closes its TCP socket as it would any socket of a dead process — a FIN
/// when it had read everything it was sent, a RST when not — and the application sees what
/// TCP would show: the bytes the peer wrote before it died, then end of stream, or then
/// ECONNRESET.
/// Until every thread of process `pid` has stopped (a SIGSTOP takes effect on each thread
/// when it next enters the kernel or is interrupted, not when `kill` returns).
fn wait_stopped(pid: u32) {
    let end = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let all = std::fs::read_dir(format!("/proc/{pid}/task"))
            .expect("tasks")
            .filter_map(Result::ok)
            .all(|t| {
                std::fs::read_to_string(t.path().join("stat")).is_ok_and(|st| {
                    // "pid (comm) S ...": the state follows the last ')'.
                    st.rsplit(')')
                        .next()
                        .is_some_and(|r| r.trim_start().starts_with(['T', 't']))
                })
            });
        if all {
            return;
        }
        assert!(
            std::time::Instant::now() < end,
            "process {pid} did not stop"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn peer_process_death_shows_as_over_tcp() {
    if std::env::var_os("SMC_RT_CHILD").is_some() {
        return;
    }
    let dir = test_dir("death");
    let st = stack(&dir, DiscoveryMode::AssertPeer);
    for unread in [false, true] {
        let mut peer = Peer::spawn("echo-server", &dir, "");
        let mut s = SmcStream::connect_with(&st, ("127.0.0.1", peer.port)).expect("connect");
        assert_eq!(s.mode(), Mode::Smc);
        assert_eq!(roundtrip(&mut s, b"alive?"), b"alive?");
        // One CDC brings the whole echo: half of it is read, half stays in our RMBE.
        s.write_all(b"last words").expect("write");
        let mut half = [0u8; 5];
        s.read_exact(&mut half).expect("read half");
        assert_eq!(&half, b"last ");
        if unread {
            // The peer stops and gets bytes it will never read.
            let pid = rustix::process::Pid::from_raw(peer.child.id() as i32).expect("pid");
            rustix::process::kill_process(pid, rustix::process::Signal::STOP).expect("SIGSTOP");
            wait_stopped(peer.child.id());
            s.write_all(b"unread").expect("write to the stopped peer");
        }
        peer.child.kill().expect("kill peer");
        let _ = peer.child.wait();
        s.set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        let mut rest = Vec::new();
        let r = s.read_to_end(&mut rest);
        // What the peer wrote before it died is read first, whatever follows.
        assert_eq!(rest, b"words", "unread {unread}");
        if unread {
            let kind = r
                .expect_err("read after the peer died with unread data")
                .kind();
            assert_eq!(kind, std::io::ErrorKind::ConnectionReset);
        } else {
            r.expect("end of stream after the peer died having read everything");
            // Then writing fails as after a TCP peer's close: the first write is taken, the
            // next fails with EPIPE.
            s.write_all(b"anyone?")
                .expect("first write after the peer's end");
            let e = s.write_all(b"anyone?").expect_err("second write");
            assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe);
        }
    }
    assert!(st.stats().ended_by_peer_exit >= 1, "{:?}", st.stats());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_silent_client_does_not_delay_others() {
    if std::env::var_os("SMC_RT_CHILD").is_some() {
        return;
    }
    let dir = test_dir("silent-first");
    let mut c = StackConfig::new(FabricConfig::with_dir(&dir, 2));
    c.discovery = DiscoveryMode::AssertPeer;
    c.assert_peer_wait = Duration::from_secs(60);
    let server = Stack::new(c).expect("stack");
    let client = stack(&dir, DiscoveryMode::AssertPeer);
    let l = SmcListener::bind_with(&server, "127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    // A plain client that says nothing: its fallback waits for the (long) bound.
    let silent = TcpStream::connect(addr).expect("silent connect");
    let t = std::thread::spawn(move || SmcStream::connect_with(&client, addr).expect("connect"));
    let (first, _) = l.accept().expect("accept");
    assert_eq!(first.mode(), Mode::Smc);
    let _c = t.join().expect("client");
    // Once the silent client hangs up, it is handed out as a fallen-back connection.
    drop(silent);
    let (second, _) = l.accept().expect("accept");
    assert_eq!(second.mode(), Mode::Tcp(FallbackReason::NoProposal));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn many_threads_many_sockets_concurrent_echo() {
    if std::env::var_os("SMC_RT_CHILD").is_some() {
        return;
    }
    let dir = test_dir("threads");
    let peer = Peer::spawn("echo-server", &dir, "");
    let mut c = StackConfig::new(FabricConfig::with_dir(&dir, 2));
    c.discovery = DiscoveryMode::AssertPeer;
    c.buffer_size = 16 * 1024;
    let st = Stack::new(c).expect("stack");
    let port = peer.port;
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let st = st.clone();
            std::thread::spawn(move || {
                let mut conns: Vec<SmcStream> = (0..4)
                    .map(|_| SmcStream::connect_with(&st, ("127.0.0.1", port)).expect("connect"))
                    .collect();
                for round in 0..3u64 {
                    for (i, s) in conns.iter_mut().enumerate() {
                        let data = pattern(50_000 + i * 1000, t * 100 + round * 10 + i as u64);
                        assert_eq!(checksum(&roundtrip(s, &data)), checksum(&data));
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("thread");
    }
    assert_eq!(st.stats().smc, 32);
    peer.finish();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn busy_polling_streams_echo() {
    if std::env::var_os("SMC_RT_CHILD").is_some() {
        return;
    }
    let dir = test_dir("busy");
    let (_a, _b, server, mut client) = local_pair(&dir);
    let mut server = server;
    server.set_busy_poll(Some(Duration::from_micros(200)));
    client.set_busy_poll(Some(Duration::from_micros(200)));
    let t = std::thread::spawn(move || echo(server));
    let data = pattern(700_000, 5);
    assert_eq!(checksum(&roundtrip(&mut client, &data)), checksum(&data));
    client.shutdown(Shutdown::Write).expect("shutdown");
    let mut rest = Vec::new();
    client.read_to_end(&mut rest).expect("EOF");
    assert!(rest.is_empty());
    t.join().expect("echo thread");
    let _ = std::fs::remove_dir_all(&dir);
}
