//! The tokio sockets (feature `tokio`): two stacks in one process on a private shm fabric,
//! in the explicit assert-peer discovery mode. Run with `cargo test -p smc --features tokio`.
#![cfg(feature = "tokio")]
#![allow(missing_docs)]

use std::path::PathBuf;
use std::time::Duration;

use smc::tokio::{SmcListener, SmcStream};
use smc::{DiscoveryMode, FabricConfig, FallbackReason, Mode, Stack, StackConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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
