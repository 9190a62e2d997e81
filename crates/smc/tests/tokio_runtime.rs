//! The tokio sockets (feature `tokio`): two stacks in one process on a private shm fabric,
//! in the explicit assert-peer discovery mode. Run with `cargo test -p smc --features tokio`.
#![cfg(feature = "tokio")]
#![allow(missing_docs)]

use std::path::PathBuf;
use std::time::Duration;

use smc::tokio::{SmcListener, SmcStream};
use smc::{DiscoveryMode, FabricConfig, FallbackReason, Mode, Stack, StackConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The tests of this binary run one at a time: `descriptors_per_tokio_stream` counts the
/// process's descriptors, which another test's connections (and their setups) would change.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn test_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "smc-tokio-{}-{}-{}",
        tag,
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0)
    ));
    std::fs::create_dir_all(&d).expect("dir");
    d
}

fn stack(dir: &PathBuf) -> Stack {
    let mut c = StackConfig::new(FabricConfig::with_dir(dir, 2));
    c.discovery = DiscoveryMode::AssertPeer;
    c.assert_peer_wait = Duration::from_millis(300);
    Stack::new(c).expect("stack")
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len as u32).map(|i| (i ^ (i >> 9)) as u8).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_echo_with_half_close() {
    let _serial = SERIAL.lock().await;
    let dir = test_dir("echo");
    let server_stack = stack(&dir);
    let client_stack = stack(&dir);
    let l = SmcListener::bind(&server_stack, "127.0.0.1:0".parse().expect("addr")).expect("bind");
    let addr = l.local_addr().expect("addr");
    let server = tokio::spawn(async move {
        let (s, _) = l.accept().await.expect("accept");
        assert_eq!(s.mode(), Mode::Smc);
        let (mut r, mut w) = tokio::io::split(s);
        tokio::io::copy(&mut r, &mut w).await.expect("echo");
        w.shutdown().await.expect("shutdown");
    });
    let s = SmcStream::connect(&client_stack, addr)
        .await
        .expect("connect");
    assert_eq!(s.mode(), Mode::Smc);
    let data = pattern(3_000_000);
    let (mut r, mut w) = tokio::io::split(s);
    let out = data.clone();
    let writer = tokio::spawn(async move {
        w.write_all(&out).await.expect("write");
        w.shutdown().await.expect("shutdown");
        w
    });
    let mut back = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), r.read_to_end(&mut back))
        .await
        .expect("echo within the bound")
        .expect("read");
    assert_eq!(back.len(), data.len());
    assert!(back == data, "echoed bytes differ");
    let _w = writer.await.expect("writer");
    server.await.expect("server");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_tokio_client_falls_back() {
    let _serial = SERIAL.lock().await;
    let dir = test_dir("plain");
    let server_stack = stack(&dir);
    let l = SmcListener::bind(&server_stack, "127.0.0.1:0".parse().expect("addr")).expect("bind");
    let addr = l.local_addr().expect("addr");
    let client = tokio::spawn(async move {
        let mut c = tokio::net::TcpStream::connect(addr).await.expect("connect");
        c.write_all(b"plain tcp").await.expect("write");
        let mut back = [0u8; 9];
        c.read_exact(&mut back).await.expect("read");
        back
    });
    let (mut s, _) = l.accept().await.expect("accept");
    assert_eq!(s.mode(), Mode::Tcp(FallbackReason::NoProposal));
    let mut buf = [0u8; 9];
    s.read_exact(&mut buf).await.expect("read");
    s.write_all(&buf).await.expect("write");
    assert_eq!(&client.await.expect("client"), b"plain tcp");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Descriptors of this process by kind: (all, sockets, eventfds).
fn fd_kinds() -> (usize, usize, usize) {
    let (mut all, mut sockets, mut eventfds) = (0, 0, 0);
    for e in std::fs::read_dir("/proc/self/fd")
        .expect("fd dir")
        .flatten()
    {
        all += 1;
        let t = std::fs::read_link(e.path())
            .map(|t| t.to_string_lossy().into_owned())
            .unwrap_or_default();
        sockets += usize::from(t.starts_with("socket:"));
        eventfds += usize::from(t == "anon_inode:[eventfd]");
    }
    (all, sockets, eventfds)
}

/// What an SMC-R tokio stream holds: its TCP socket (shared with the stack, not duplicated)
/// and the two eventfds that wake its reader and its writer; the link group adds a few.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn descriptors_per_tokio_stream() {
    let _serial = SERIAL.lock().await;
    const N: usize = 32;
    let dir = test_dir("fds");
    let server_stack = stack(&dir);
    let client_stack = stack(&dir);
    let l = SmcListener::bind(&server_stack, "127.0.0.1:0".parse().expect("addr")).expect("bind");
    let addr = l.local_addr().expect("addr");
    let before = fd_kinds();
    let mut streams = Vec::new();
    for _ in 0..N {
        let c = SmcStream::connect(&client_stack, addr)
            .await
            .expect("connect");
        let (s, _) = l.accept().await.expect("accept");
        assert_eq!((c.mode(), s.mode()), (Mode::Smc, Mode::Smc));
        streams.push((c, s));
    }
    let after = fd_kinds();
    let (all, sockets, eventfds) = (after.0 - before.0, after.1 - before.1, after.2 - before.2);
    println!(
        "{} tokio streams (both ends in this process): +{all} fds = {:.2} per stream \
         (+{sockets} sockets, +{eventfds} eventfds)",
        2 * N,
        all as f64 / (2 * N) as f64
    );
    // Per stream one socket and two eventfds; per link group (one on each side here) a few
    // sockets, eventfds and memfds.
    assert!(sockets <= 2 * N + 16, "{sockets} sockets");
    assert!(eventfds <= 4 * N + 32, "{eventfds} eventfds");
    // Every stream still works.
    for (c, s) in streams.iter_mut() {
        c.write_all(b"ping").await.expect("write");
        let mut b = [0u8; 4];
        s.read_exact(&mut b).await.expect("read");
        assert_eq!(&b, b"ping");
    }
    drop(streams);
    let _ = std::fs::remove_dir_all(&dir);
}
