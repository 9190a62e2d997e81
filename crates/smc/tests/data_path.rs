//! The one-copy data path, progress in the calling thread and coalescing, on two stacks in
//! this process sharing a private shm fabric.
#![allow(missing_docs)]

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use smc::{DiscoveryMode, Mode, SmcListener, SmcStream, Stack, StackConfig};
use smc_fabric::{FabricConfig, PortState};

fn test_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("smc-dp-{}-{}", tag, std::process::id()));
    std::fs::create_dir_all(&d).expect("fabric dir");
    d
}

fn stack(dir: &Path, buffer: u32) -> Stack {
    let mut c = StackConfig::new(FabricConfig::with_dir(dir, 2));
    c.discovery = DiscoveryMode::AssertPeer;
    c.buffer_size = buffer;
    c.clc_timeout = Duration::from_secs(20);
    // The test's long CLC timer covers the wait for the Accept too (not the 6 s default).
    c.accept_wait = c.clc_timeout;
    Stack::new(c).expect("stack")
}

fn pair(dir: &Path, buffer: u32) -> (Stack, Stack, SmcStream, SmcStream) {
    let a = stack(dir, buffer);
    let b = stack(dir, buffer);
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

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(131).wrapping_add(seed))
        .collect()
}

/// Without TCP_NODELAY small writes are coalesced; a writer that never reads and never
/// flushes still gets every byte to the peer (the coalescing timer announces the rest).
#[test]
fn coalesced_small_writes_all_arrive_without_flush() {
    let dir = test_dir("coalesce");
    let (_a, _b, mut server, mut client) = pair(&dir, 64 * 1024);
    assert!(!client.nodelay().expect("nodelay"));
    let data = pattern(64 * 100 + 7, 3);
    let writer = std::thread::spawn(move || {
        for piece in data.chunks(64) {
            client.write_all(piece).expect("write");
        }
        // Keep the stream open: no close, no flush, no read.
        std::thread::sleep(Duration::from_millis(300));
        client
    });
    server
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let mut got = vec![0u8; 64 * 100 + 7];
    server.read_exact(&mut got).expect("every byte arrives");
    assert_eq!(got, pattern(64 * 100 + 7, 3));
    drop(writer.join().expect("writer"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Streams far larger than the RMBE, both ways at once, with the RMBE wrapping at odd
/// offsets (writes of a prime size): every byte once and in order.
#[test]
fn bidirectional_stream_through_a_small_rmbe() {
    let dir = test_dir("bidir");
    let (_a, _b, mut server, mut client) = pair(&dir, 16 * 1024);
    client.set_nodelay(true).expect("nodelay");
    const LEN: usize = 3 << 20;
    let up = pattern(LEN, 1);
    let down = pattern(LEN, 2);
    let mut client_rd = client.try_clone().expect("clone");
    let mut server_rd = server.try_clone().expect("clone");
    let up_w = up.clone();
    let down_w = down.clone();
    let t1 = std::thread::spawn(move || {
        for piece in up_w.chunks(4099) {
            client.write_all(piece).expect("client write");
        }
        client
    });
    let t2 = std::thread::spawn(move || {
        for piece in down_w.chunks(1021) {
            server.write_all(piece).expect("server write");
        }
        server
    });
    let r1 = std::thread::spawn(move || {
        let mut got = vec![0u8; LEN];
        server_rd.read_exact(&mut got).expect("server read");
        got
    });
    let mut got = vec![0u8; LEN];
    client_rd.read_exact(&mut got).expect("client read");
    assert!(got == down, "server -> client bytes differ");
    assert!(
        r1.join().expect("reader") == up,
        "client -> server bytes differ"
    );
    drop((t1.join(), t2.join()));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A link failure in the middle of a one-copy stream: the connection moves to the other
/// link and no byte is lost or duplicated (the WRITEs executed at post need no replay).
#[test]
fn stream_survives_link_failure() {
    let dir = test_dir("failover");
    let (_a, b, mut server, mut client) = pair(&dir, 64 * 1024);
    const LEN: usize = 8 << 20;
    let data = pattern(LEN, 9);
    let expect = data.clone();
    let reader = std::thread::spawn(move || {
        let mut got = vec![0u8; LEN];
        server
            .read_exact(&mut got)
            .expect("read across the failover");
        got
    });
    let (_, dev) = client.send_link().expect("send link");
    for (i, piece) in data.chunks(32 * 1024).enumerate() {
        client.write_all(piece).expect("write across the failover");
        if i == 64 {
            assert!(b.set_port_state(&dev, PortState::Down));
        }
    }
    assert!(reader.join().expect("reader") == expect, "bytes differ");
    let (_, now_on) = client.send_link().expect("send link after the failover");
    assert_ne!(now_on, dev, "the connection moved off the failed device");
    let _ = std::fs::remove_dir_all(&dir);
}

/// With TCP_NODELAY every 1-byte write is announced by its own CDC; a reader that stops for
/// a while lets thousands of them pile up. The send queue filling up is back-pressure, not a
/// link failure: every byte arrives, in order, and the connection stays on its link group.
#[test]
fn nodelay_one_byte_writes_against_a_paused_reader() {
    let dir = test_dir("nodelay1");
    let (a, b, mut server, client) = pair(&dir, 64 * 1024);
    client.set_nodelay(true).expect("nodelay");
    let n = 20_000usize;
    let data = pattern(n, 9);
    let expect = data.clone();
    let writer = std::thread::spawn(move || {
        let mut client = client;
        for byte in data.chunks(1) {
            client.write_all(byte).expect("write");
        }
        client
    });
    std::thread::sleep(Duration::from_millis(200));
    let mut got = vec![0u8; n];
    server.read_exact(&mut got).expect("read");
    assert!(got == expect, "bytes differ");
    let _client = writer.join().expect("writer");
    assert_eq!(a.stats().links_down + b.stats().links_down, 0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Bytes written on the TCP connection under an SMC-R connection (a preloaded program's write
/// that went past the library) cannot be ordered with the SMC-R stream: the receiving stack
/// aborts the connection and counts it, so both ends get an error instead of waiting forever.
#[test]
fn bytes_on_the_silent_tcp_connection_abort_the_smc_connection() {
    use std::os::fd::BorrowedFd;
    let dir = test_dir("tcpbytes");
    let (a, b, mut server, mut client) = pair(&dir, 64 * 1024);
    client.write_all(b"over SMC-R").expect("write");
    let mut got = [0u8; 10];
    server.read_exact(&mut got).expect("read");
    assert_eq!(&got, b"over SMC-R");

    // The client's TCP socket: the descriptor whose addresses are the connection's.
    let (local, peer) = (
        client.local_addr().expect("local"),
        client.peer_addr().expect("peer"),
    );
    let tcp = (3..4096)
        .find(|&fd| {
            // SAFETY: only looked at while this test's stacks keep their descriptors open.
            let fd = unsafe { BorrowedFd::borrow_raw(fd) };
            let addr = |r: rustix::io::Result<Option<rustix::net::SocketAddrAny>>| {
                r.ok()
                    .flatten()
                    .and_then(|a| std::net::SocketAddr::try_from(a).ok())
            };
            rustix::io::fcntl_getfd(fd).is_ok()
                && addr(rustix::net::getsockname(fd).map(Some)) == Some(local)
                && addr(rustix::net::getpeername(fd)) == Some(peer)
        })
        .expect("the client's TCP socket");
    // SAFETY: as above.
    let fd = unsafe { BorrowedFd::borrow_raw(tcp) };
    assert_eq!(
        rustix::io::write(fd, b"past the stack").expect("raw write"),
        14
    );

    // The server's read ends with an error (it was aborted), and so does the client's.
    server
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let e = server
        .read(&mut got)
        .expect_err("server read after the abort");
    assert_ne!(e.kind(), std::io::ErrorKind::WouldBlock, "no abort: {e}");
    client
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let e = client
        .read(&mut got)
        .expect_err("client read after the abort");
    assert_ne!(
        e.kind(),
        std::io::ErrorKind::WouldBlock,
        "no abort at the client: {e}"
    );
    assert_eq!(
        a.stats().tcp_data_aborts,
        1,
        "server stats: {:?}",
        a.stats()
    );
    assert_eq!(b.stats().tcp_data_aborts, 0);
    drop((server, client));
    let _ = std::fs::remove_dir_all(&dir);
}

/// TCP's TIME-WAIT stays with the side that closed first, as with TCP: the client's stack
/// ends its TCP connection when its application closes first, not the server's after its
/// application closes in turn (which would leave the wait on the server's port, where a
/// restarted server that binds without SO_REUSEADDR would find it).
#[test]
fn time_wait_stays_with_the_side_that_closed_first() {
    let dir = test_dir("timewait");
    let (_a, _b, mut server, mut client) = pair(&dir, 64 * 1024);
    let (cport, sport) = (
        client.local_addr().expect("local").port(),
        client.peer_addr().expect("peer").port(),
    );
    client.write_all(b"bye").expect("write");
    drop(client);
    let mut got = Vec::new();
    server.read_to_end(&mut got).expect("read to the end");
    assert_eq!(got, b"bye");
    drop(server);
    // TIME-WAIT sockets of this pair of ports, by the local port they are on.
    let waits = || -> Vec<u16> {
        let mut v = Vec::new();
        for l in std::fs::read_to_string("/proc/net/tcp")
            .unwrap_or_default()
            .lines()
            .skip(1)
        {
            let f: Vec<&str> = l.split_whitespace().collect();
            let port = |a: &str| {
                a.rsplit(':')
                    .next()
                    .and_then(|p| u16::from_str_radix(p, 16).ok())
            };
            if f.len() > 3 && f[3] == "06" {
                let (lp, rp) = (port(f[1]), port(f[2]));
                if (lp, rp) == (Some(cport), Some(sport)) || (lp, rp) == (Some(sport), Some(cport))
                {
                    v.extend(lp);
                }
            }
        }
        v
    };
    let end = std::time::Instant::now() + Duration::from_secs(10);
    let mut w = waits();
    while w.is_empty() && std::time::Instant::now() < end {
        std::thread::sleep(Duration::from_millis(20));
        w = waits();
    }
    assert_eq!(
        w,
        vec![cport],
        "TIME-WAIT on local ports {w:?} (client {cport}, server {sport})"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two writers and two readers on the handles of one connection at once, with reads and
/// writes large enough to copy outside the stack's lock and small ones that copy under it:
/// no byte is taken twice or overwritten (each writer sends only its own byte value, so a
/// read of the same bytes by both readers, or a writer's copy over bytes another writer had
/// already announced, changes the counts).
#[test]
fn concurrent_readers_and_writers_of_one_connection_take_each_byte_once() {
    let dir = test_dir("concurrent");
    let (_a, _b, server, mut client) = pair(&dir, 64 * 1024);
    const PER_WRITER: usize = 4 << 20;
    let writers: Vec<_> = [1u8, 2u8]
        .into_iter()
        .map(|value| {
            let mut w = client.try_clone().expect("clone");
            std::thread::spawn(move || {
                let big = vec![value; 8192];
                let small = [value; 100];
                let mut sent = 0usize;
                let mut i = 0usize;
                while sent < PER_WRITER {
                    let piece = if i % 3 == 2 { &small[..] } else { &big[..] };
                    let piece = &piece[..piece.len().min(PER_WRITER - sent)];
                    w.write_all(piece).expect("write");
                    sent += piece.len();
                    i += 1;
                }
            })
        })
        .collect();
    let readers: Vec<_> = [32 * 1024usize, 1000]
        .into_iter()
        .map(|len| {
            let mut r = server.try_clone().expect("clone");
            r.set_read_timeout(Some(Duration::from_secs(60)))
                .expect("timeout");
            std::thread::spawn(move || {
                let mut counts = [0usize; 256];
                let mut buf = vec![0u8; len];
                loop {
                    let n = r.read(&mut buf).expect("read");
                    if n == 0 {
                        return counts;
                    }
                    for b in &buf[..n] {
                        counts[usize::from(*b)] += 1;
                    }
                }
            })
        })
        .collect();
    for w in writers {
        w.join().expect("writer");
    }
    client
        .shutdown(std::net::Shutdown::Write)
        .expect("shutdown");
    let mut counts = [0usize; 256];
    for r in readers {
        for (c, n) in counts.iter_mut().zip(r.join().expect("reader")) {
            *c += n;
        }
    }
    assert_eq!(counts[1], PER_WRITER, "bytes of writer 1");
    assert_eq!(counts[2], PER_WRITER, "bytes of writer 2");
    assert_eq!(
        counts.iter().sum::<usize>(),
        2 * PER_WRITER,
        "no other bytes"
    );
    drop((server, client));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Writes after the peer closed (its last bytes unread here) go as with TCP — the first is
/// taken, the peer's RST turns the next into EPIPE — never "would block", on which an event
/// loop would spin; and the bytes the peer sent before closing are still read, then the end
/// of stream (before: the write reset the connection and those bytes were lost).
#[test]
fn a_write_after_the_peer_closed_fails_and_keeps_what_the_peer_sent() {
    let dir = test_dir("peerclosed");
    let (_a, _b, mut server, mut client) = pair(&dir, 64 * 1024);
    let msg = pattern(1020, 9);
    server.write_all(&msg).expect("server write");
    drop(server);
    std::thread::sleep(Duration::from_millis(300));
    client.set_nonblocking(true).expect("nonblocking");
    // As TCP: the first write is taken, the next ones fail with EPIPE.
    assert_eq!(client.write(b"GET x\r\n").expect("first write"), 7);
    for i in 1..3 {
        let e = client
            .write(b"GET x\r\n")
            .expect_err("a write after the first");
        assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "write {i}: {e}");
    }
    client.set_nonblocking(false).expect("blocking");
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match client.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => {
                assert!(
                    got.len() == msg.len(),
                    "read error {e} after {} of {} bytes",
                    got.len(),
                    msg.len()
                );
                break;
            }
        }
    }
    assert_eq!(got, msg, "the bytes sent before the close");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A peer that closes with our request unread resets the connection (as TCP sends a RST):
/// what it wrote before — its answer — is still read, whole and first, and then the reset,
/// as over TCP (a program reading a server's last words must see them). Here the reset has
/// arrived, and the RMBE element is gone back to the pool, before the client reads at all.
#[test]
fn bytes_the_peer_wrote_before_it_reset_are_read_before_the_reset() {
    let dir = test_dir("keptatreset");
    let (_a, b, mut server, mut client) = pair(&dir, 64 * 1024);
    client.write_all(b"PING\r\n").expect("client write");
    let msg = pattern(3000, 5);
    server.write_all(&msg).expect("server write");
    // Closing with the client's request unread is an abortive close (PeerConnAbort).
    std::thread::sleep(Duration::from_millis(100));
    drop(server);
    let end = std::time::Instant::now() + Duration::from_secs(10);
    while b.stats().bytes_kept_at_reset == 0 && std::time::Instant::now() < end {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(b.stats().bytes_kept_at_reset, msg.len() as u64);
    let mut got = Vec::new();
    let mut buf = [0u8; 1000];
    let err = loop {
        match client.read(&mut buf) {
            Ok(0) => panic!("end of stream after {} bytes, not the reset", got.len()),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => break e,
        }
    };
    assert_eq!(got, msg, "the bytes written before the reset");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
