//! Hot paths of the runtime through the public API: two stacks of one process on a private shm
//! fabric (the peer on its own thread), an SMC-R connection between them, and the same
//! measurement over TCP loopback for scale.
//!
//! - `pingpong_1b/*`: one byte there and back (blocking waits, and busy polling).
//! - `stream_64k/*`: 64 KiB writes drained by the peer.
//!
//! `smc bench` measures across processes; these are for quick before/after comparisons of a
//! change to the data path (`cargo bench -p smc --bench stream`).
#![allow(missing_docs, clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use smc::{DiscoveryMode, FabricConfig, Mode, SmcListener, SmcStream, Stack, StackConfig};

const BULK: usize = 64 * 1024;

fn fabric_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "smc-crit-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0)
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn stack(dir: &PathBuf) -> Stack {
    let mut c = StackConfig::new(FabricConfig::with_dir(dir, 2));
    c.discovery = DiscoveryMode::AssertPeer;
    Stack::new(c).unwrap()
}

/// What the peer thread does with each connection.
#[derive(Clone, Copy)]
enum Peer {
    Echo,
    Drain,
}

fn serve<S: Read + Write>(mut s: S, peer: Peer, busy: impl FnOnce(&mut S)) {
    busy(&mut s);
    let mut buf = vec![0u8; BULK];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if matches!(peer, Peer::Echo) && s.write_all(&buf[..n]).is_err() {
                    return;
                }
            }
        }
    }
}

/// An SMC-R connection to a peer thread, with both stacks and the fabric directory.
struct SmcPair {
    s: SmcStream,
    _server: Stack,
    _client: Stack,
    dir: PathBuf,
}

impl Drop for SmcPair {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn smc_pair(peer: Peer, busy: Option<Duration>) -> SmcPair {
    let dir = fabric_dir();
    let server = stack(&dir);
    let client = stack(&dir);
    let l = SmcListener::bind_with(&server, "127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        serve(s, peer, |s| s.set_busy_poll(busy));
    });
    let mut s = SmcStream::connect_with(&client, ("127.0.0.1", port)).unwrap();
    assert_eq!(s.mode(), Mode::Smc);
    s.set_busy_poll(busy);
    SmcPair {
        s,
        _server: server,
        _client: client,
        dir,
    }
}

fn tcp_pair(peer: Peer) -> TcpStream {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        s.set_nodelay(true).unwrap();
        serve(s, peer, |_| {});
    });
    let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_nodelay(true).unwrap();
    s
}

fn round_trip<S: Read + Write>(s: &mut S) {
    let mut b = [7u8; 1];
    s.write_all(&b).unwrap();
    s.read_exact(&mut b).unwrap();
}

fn pingpong(c: &mut Criterion) {
    let mut g = c.benchmark_group("pingpong_1b");
    {
        let mut p = smc_pair(Peer::Echo, None);
        g.bench_function("smc_blocking", |b| b.iter(|| round_trip(&mut p.s)));
    }
    {
        let mut p = smc_pair(Peer::Echo, Some(Duration::from_millis(1)));
        g.bench_function("smc_busy_poll", |b| b.iter(|| round_trip(&mut p.s)));
    }
    {
        let mut s = tcp_pair(Peer::Echo);
        g.bench_function("tcp_blocking", |b| b.iter(|| round_trip(&mut s)));
    }
    g.finish();
}

fn stream(c: &mut Criterion) {
    let mut g = c.benchmark_group("stream_64k");
    g.throughput(Throughput::Bytes(BULK as u64));
    let buf = vec![0xa5u8; BULK];
    {
        let mut p = smc_pair(Peer::Drain, None);
        g.bench_function("smc", |b| b.iter(|| p.s.write_all(&buf).unwrap()));
    }
    {
        let mut s = tcp_pair(Peer::Drain);
        g.bench_function("tcp", |b| b.iter(|| s.write_all(&buf).unwrap()));
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    targets = pingpong, stream
}
criterion_main!(benches);
