//! Per-connection options and the PNET table, end to end: two stacks on a private shm fabric
//! talking over loopback TCP (assert-peer discovery, no privileges needed).
#![allow(missing_docs)]

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use smc::{
    ConnectOptions, DiscoveryMode, FallbackReason, Mode, SmcListener, SmcStream, Stack, StackConfig,
};
use smc_fabric::FabricConfig;
use smc_wire::DeclineCode;

fn test_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "smc-opt-{}-{}-{}",
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

/// A stack whose devices `shm0`, `shm1` serve the given netdevs (empty: every interface).
fn stack(dir: &Path, netdevs: [&[&str]; 2]) -> Stack {
    let mut f = FabricConfig::with_dir(dir, 2);
    for (d, n) in f.devices.iter_mut().zip(netdevs) {
        d.netdevs = n.iter().map(|s| s.to_string()).collect();
    }
    let mut c = StackConfig::new(f);
    c.discovery = DiscoveryMode::AssertPeer;
    c.clc_timeout = Duration::from_secs(20);
    // The test's long CLC timer covers the wait for the Accept too (not the 6 s default).
    c.accept_wait = c.clc_timeout;
    Stack::new(c).expect("stack")
}

fn connect(
    server: &Stack,
    client: &Stack,
    listener_buf: Option<usize>,
    opts: ConnectOptions,
) -> (SmcStream, SmcStream) {
    let l = SmcListener::bind_with(server, "127.0.0.1:0").expect("bind");
    if let Some(b) = listener_buf {
        l.set_recv_buffer_size(b);
    }
    let addr = l.local_addr().expect("addr");
    let c = client.clone();
    let t = std::thread::spawn(move || {
        SmcStream::connect_with_options(&c, addr, &opts).expect("connect")
    });
    let (s, _) = l.accept().expect("accept");
    (s, t.join().expect("client"))
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 % 251) as u8).collect()
}

/// Send `data` both ways at once and check what arrives.
fn exchange(a: &mut SmcStream, b: &mut SmcStream, data: &[u8]) {
    let mut aw = a.try_clone().expect("clone");
    let mut bw = b.try_clone().expect("clone");
    let (d1, d2) = (data.to_vec(), data.to_vec());
    let t1 = std::thread::spawn(move || aw.write_all(&d1).expect("write a"));
    let t2 = std::thread::spawn(move || bw.write_all(&d2).expect("write b"));
    let mut got = vec![0u8; data.len()];
    b.read_exact(&mut got).expect("read b");
    assert!(got == data, "a->b bytes differ");
    a.read_exact(&mut got).expect("read a");
    assert!(got == data, "b->a bytes differ");
    t1.join().expect("t1");
    t2.join().expect("t2");
}

#[test]
fn receive_buffer_sizes_become_rmbe_sizes() {
    let dir = test_dir("buf");
    let (a, b) = (stack(&dir, [&[], &[]]), stack(&dir, [&[], &[]]));
    let opts = ConnectOptions::new().recv_buffer_size(20_000);
    let (mut server, mut client) = connect(&a, &b, Some(256 * 1024), opts);
    assert_eq!(server.mode(), Mode::Smc);
    assert_eq!(client.mode(), Mode::Smc);
    // 20 000 rounds up to 32 KiB; the listener's 256 KiB is exact.
    assert_eq!(client.recv_buffer_size().expect("rcvbuf"), 32 * 1024);
    assert_eq!(server.send_buffer_size().expect("sndbuf"), 32 * 1024);
    assert_eq!(server.recv_buffer_size().expect("rcvbuf"), 256 * 1024);
    assert_eq!(client.send_buffer_size().expect("sndbuf"), 256 * 1024);
    exchange(&mut server, &mut client, &pattern(1_000_003));
    // Without options: the stack's default (1 MiB).
    let (s2, c2) = connect(&a, &b, None, ConnectOptions::new());
    assert_eq!(s2.recv_buffer_size().expect("rcvbuf"), 1024 * 1024);
    assert_eq!(c2.recv_buffer_size().expect("rcvbuf"), 1024 * 1024);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn pnet_without_a_device_for_the_interface_falls_back_with_the_reason() {
    let dir = test_dir("pnet-none");
    let server = stack(&dir, [&[], &[]]);
    // The client's devices serve only an interface loopback traffic never uses.
    let client = stack(&dir, [&["smc-test-none0"], &["smc-test-none1"]]);
    let (mut s, mut c) = connect(&server, &client, None, ConnectOptions::new());
    assert_eq!(
        c.mode(),
        Mode::Tcp(FallbackReason::Declined(DeclineCode::NOSMCRDEV))
    );
    assert_eq!(
        s.mode(),
        Mode::Tcp(FallbackReason::PeerDeclined {
            code: DeclineCode::NOSMCRDEV,
            out_of_sync: false
        })
    );
    assert!(client.link_groups().is_empty());
    exchange(&mut s, &mut c, &pattern(100_000));
    // The same on the server side.
    let (s2, c2) = connect(&client, &server, None, ConnectOptions::new());
    assert_eq!(
        s2.mode(),
        Mode::Tcp(FallbackReason::Declined(DeclineCode::NOSMCRDEV))
    );
    drop((s2, c2));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn pnet_keeps_the_link_group_on_the_devices_of_the_interface() {
    let dir = test_dir("pnet-lo");
    let server = stack(&dir, [&[], &[]]);
    // Only shm1 serves `lo` on the client.
    let client = stack(&dir, [&["smc-test-other"], &["lo"]]);
    let table = client.pnet_table();
    assert_eq!(table.len(), 2);
    assert_eq!(table[1].netdevs, vec!["lo".to_string()]);
    let (mut s, mut c) = connect(&server, &client, None, ConnectOptions::new());
    assert_eq!(c.mode(), Mode::Smc);
    exchange(&mut s, &mut c, &pattern(300_000));
    let groups = client.link_groups();
    assert_eq!(groups.len(), 1);
    assert!(!groups[0].links.is_empty());
    for l in &groups[0].links {
        assert_eq!(l.device, "shm1", "client link on {}", l.device);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A TCP reset under an SMC-R connection ends it on both sides (RFC 7609 §4.8.2). The reset
/// is made with `ss -K` (root; skipped otherwise), which aborts our client's TCP socket and
/// sends the server a RST.
#[test]
fn tcp_reset_under_an_smc_connection_resets_it() {
    if !rustix::process::geteuid().is_root()
        || std::process::Command::new("ss").arg("-V").output().is_err()
    {
        eprintln!("skipped: needs root and ss (iproute2)");
        return;
    }
    let dir = test_dir("rst");
    let (a, b) = (stack(&dir, [&[], &[]]), stack(&dir, [&[], &[]]));
    let (mut server, mut client) = connect(&a, &b, None, ConnectOptions::new());
    assert_eq!(client.mode(), Mode::Smc);
    client
        .set_tcp_keepalive(Some(Duration::from_secs(30)))
        .expect("keepalive");
    exchange(&mut server, &mut client, &pattern(10_000));
    kill_tcp_and_expect_resets(&mut server, &mut client);
    assert!(a.stats().tcp_resets + b.stats().tcp_resets >= 1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Abort the client's TCP socket with `ss -K` (which sends the server a RST) and check both
/// streams end with a reset.
fn kill_tcp_and_expect_resets(server: &mut SmcStream, client: &mut SmcStream) {
    let (cp, sp) = (
        client.local_addr().expect("local").port(),
        server.local_addr().expect("local").port(),
    );
    let out = std::process::Command::new("ss")
        .args([
            "-K",
            "-t",
            "src",
            "127.0.0.1",
            "sport",
            "=",
            &format!(":{cp}"),
        ])
        .args(["dst", "127.0.0.1", "dport", "=", &format!(":{sp}")])
        .output()
        .expect("ss -K");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (name, s) in [("server", server), ("client", client)] {
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let mut buf = [0u8; 16];
        let r = s.read(&mut buf);
        let kind = r.as_ref().map_err(|e| e.kind()).err();
        assert!(
            matches!(
                kind,
                Some(std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted)
            ),
            "{name}: {r:?}"
        );
    }
}

/// The descriptor numbers of the TCP sockets of connection `server`–`client` (both in this
/// process): their inodes from `/proc/net/tcp` (by port pair), then the descriptor naming each.
fn conn_fds(server: &SmcStream, client: &SmcStream) -> Vec<u32> {
    let (cp, sp) = (
        client.local_addr().expect("local").port(),
        server.local_addr().expect("local").port(),
    );
    let port = |a: &str| {
        a.rsplit_once(':')
            .and_then(|(_, p)| u16::from_str_radix(p, 16).ok())
    };
    let inodes: Vec<String> = std::fs::read_to_string("/proc/net/tcp")
        .expect("/proc/net/tcp")
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (lp, rp) = (port(f.get(1)?)?, port(f.get(2)?)?);
            let inode = f.get(9)?;
            ((lp, rp) == (cp, sp) || (lp, rp) == (sp, cp)).then(|| format!("socket:[{inode}]"))
        })
        .collect();
    std::fs::read_dir("/proc/self/fd")
        .expect("fd dir")
        .flatten()
        .filter_map(|e| {
            let t = std::fs::read_link(e.path()).ok()?;
            if !inodes.contains(&t.to_string_lossy().into_owned()) {
                return None;
            }
            e.file_name().to_str()?.parse().ok()
        })
        .collect()
}

/// The reset watch when descriptor numbers are reused: an SMC-R connection closes (the slot
/// lets go of its TCP socket and takes it out of the watch; the numbers become free), a later
/// connection gets one of the same numbers, and a TCP reset under it must still end it on
/// both sides (a registration removed by number after the number was reused would lose it).
/// Needs root for `ss -K`, as above.
#[test]
fn tcp_reset_detected_after_descriptor_numbers_are_reused() {
    if !rustix::process::geteuid().is_root()
        || std::process::Command::new("ss").arg("-V").output().is_err()
    {
        eprintln!("skipped: needs root and ss (iproute2)");
        return;
    }
    let dir = test_dir("fd-reuse");
    let (a, b) = (stack(&dir, [&[], &[]]), stack(&dir, [&[], &[]]));
    // Numbers our closed connections' sockets had. Other tests of this binary open and close
    // descriptors meanwhile, so a number comes back after a few connections at most.
    let mut freed = std::collections::BTreeSet::new();
    for round in 0..50 {
        let (mut s, mut c) = connect(&a, &b, None, ConnectOptions::new());
        assert_eq!(c.mode(), Mode::Smc);
        exchange(&mut s, &mut c, &pattern(10_000));
        let fds = conn_fds(&s, &c);
        assert_eq!(fds.len(), 2, "one descriptor per side: {fds:?}");
        if fds.iter().any(|n| freed.contains(n)) {
            println!("round {round}: descriptors {fds:?} reused (freed before: {freed:?})");
            let resets = a.stats().tcp_resets + b.stats().tcp_resets;
            kill_tcp_and_expect_resets(&mut s, &mut c);
            assert!(a.stats().tcp_resets + b.stats().tcp_resets > resets);
            let _ = std::fs::remove_dir_all(&dir);
            return;
        }
        drop((s, c));
        // The SMC-R close completes, then the slots let go of the sockets.
        let gone = |a: &Stack| a.link_groups().iter().all(|g| g.connections == 0);
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !(gone(&a) && gone(&b)) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        freed.extend(fds);
    }
    panic!("no descriptor number came back in 50 connections: {freed:?}");
}

/// `hello`, urgent `U`, `world`: the reader's first read stops in front of the urgent byte,
/// `at_mark` is then true, and the urgent byte comes in line with what follows. (Over SMC-R
/// the write after urgent data waits until the reader has taken the urgent byte, RFC 7609
/// §4.7.5, so the writer runs in its own thread.)
fn urgent_in_line(server: &mut SmcStream, client: SmcStream) -> SmcStream {
    let writer = std::thread::spawn(move || {
        let mut client = client;
        client.write_all(b"hello").expect("write");
        client.send_urgent(b"U").expect("urgent");
        client.write_all(b"world").expect("write");
        client.flush().expect("flush");
        client
    });
    std::thread::sleep(Duration::from_millis(300));
    let mut buf = [0u8; 64];
    let n = server.read(&mut buf).expect("read");
    assert_eq!(&buf[..n], b"hello");
    assert!(server.at_mark().expect("at_mark"));
    let mut rest = Vec::new();
    while rest.len() < 6 {
        let n = server.read(&mut buf).expect("read");
        assert!(n > 0);
        rest.extend_from_slice(&buf[..n]);
    }
    assert_eq!(rest, b"Uworld");
    assert!(!server.at_mark().expect("at_mark"));
    writer.join().expect("writer")
}

#[test]
fn urgent_data_over_smc_and_after_fallback() {
    let dir = test_dir("urg");
    let (a, b) = (stack(&dir, [&[], &[]]), stack(&dir, [&[], &[]]));
    let (mut s, c) = connect(&a, &b, None, ConnectOptions::new());
    assert_eq!(c.mode(), Mode::Smc);
    let mut c = urgent_in_line(&mut s, c);
    // Urgent data larger than the peer's buffer cannot be written at once.
    let big = vec![1u8; s.recv_buffer_size().expect("rcvbuf") + 1];
    assert_eq!(
        c.send_urgent(&big).map_err(|e| e.kind()),
        Err(std::io::ErrorKind::InvalidInput)
    );
    // The same on a fallen-back connection (no device for the client's interface).
    let fb = stack(&dir, [&["smc-test-none0"], &["smc-test-none1"]]);
    let (mut s, c) = connect(&a, &fb, None, ConnectOptions::new());
    assert!(matches!(c.mode(), Mode::Tcp(_)));
    urgent_in_line(&mut s, c);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `StackConfig::nodelay`: new streams start with TCP_NODELAY (no corking); the default is
/// corking.
#[test]
fn stack_nodelay_setting_applies_to_new_streams() {
    let dir = test_dir("nodelay");
    let a = stack(&dir, [&[], &[]]);
    let mut f = FabricConfig::with_dir(&dir, 2);
    f.devices.truncate(2);
    let mut c = StackConfig::new(f);
    c.discovery = DiscoveryMode::AssertPeer;
    c.nodelay = true;
    let b = Stack::new(c).expect("stack");
    let (s, cl) = connect(&a, &b, None, ConnectOptions::new());
    assert_eq!(cl.mode(), Mode::Smc);
    assert!(cl.nodelay().expect("nodelay"));
    assert!(!s.nodelay().expect("nodelay"));
    let _ = std::fs::remove_dir_all(&dir);
}
