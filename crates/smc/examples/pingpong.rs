//! Latency and throughput of SMC-R (shm fabric) next to TCP loopback and Unix sockets, measured
//! in one run.
//!
//! ```text
//! cargo run --release -p smc --example pingpong -- [ROUNDS] [BYTES]
//! ```
//!
//! `PINGPONG_BUFFER=<bytes>` sets the SMC-R receive buffer (RMBE) of both sides (default:
//! the stack's, 64 KiB).
//!
//! The SMC-R server is a second process (this binary re-executed with `PINGPONG_SERVER=1`);
//! the TCP and Unix-socket servers are threads. Every test connects afresh and sends one
//! byte naming the test first:
//! - `p`: ping-pong of 1 byte (`PINGPONG_SIZE` bytes) each way, ROUNDS round trips, in batches; prints the median batch's
//!   mean round-trip time. SMC-R runs it blocking and busy polling (50 µs, both sides).
//! - `s`: streaming BYTES in 64 KiB writes, then one byte back; throughput.
//! - `t`: streaming BYTES/16 in 64-byte writes (no TCP_NODELAY); throughput.
#![allow(missing_docs)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use smc::{DiscoveryMode, SmcListener, SmcStream, Stack, StackConfig};
use smc_fabric::FabricConfig;

const BATCHES: usize = 7;
const BUSY_POLL: Duration = Duration::from_micros(50);

fn stack(dir: &Path) -> Stack {
    let mut c = StackConfig::new(FabricConfig::with_dir(dir, 2));
    c.discovery = DiscoveryMode::AssertPeer;
    if let Some(b) = std::env::var("PINGPONG_BUFFER")
        .ok()
        .and_then(|b| b.parse().ok())
    {
        c.buffer_size = b;
    }
    Stack::new(c).expect("stack")
}

/// Serve one connection: the first byte names the test.
fn serve<S: Read + Write>(mut s: S, set_busy: impl FnOnce(&mut S, bool)) -> std::io::Result<()> {
    let mut kind = [0u8; 1];
    s.read_exact(&mut kind)?;
    set_busy(&mut s, kind[0] == b'P');
    match kind[0] {
        b'p' | b'P' => {
            // Echo what comes, as it comes.
            let mut b = [0u8; 64 * 1024];
            loop {
                let n = s.read(&mut b)?;
                if n == 0 {
                    return Ok(());
                }
                s.write_all(&b[..n])?;
            }
        }
        _ => {
            let mut buf = vec![0u8; 256 * 1024];
            let mut len = [0u8; 8];
            s.read_exact(&mut len)?;
            let mut left = u64::from_be_bytes(len);
            while left > 0 {
                let want = left.min(buf.len() as u64) as usize;
                let n = s.read(&mut buf[..want])?;
                if n == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                left -= n as u64;
            }
            s.write_all(b"k")
        }
    }
}

fn server_main(dir: PathBuf) {
    let stack = stack(&dir);
    let l = SmcListener::bind_with(&stack, "127.0.0.1:0").expect("bind");
    println!("PORT {}", l.local_addr().expect("addr").port());
    std::io::stdout().flush().expect("stdout");
    std::thread::spawn(|| {
        let mut b = [0u8; 16];
        while matches!(std::io::stdin().read(&mut b), Ok(n) if n > 0) {}
        std::process::exit(0);
    });
    for s in l.incoming() {
        let s = s.expect("accept");
        std::thread::spawn(move || {
            let _ = serve(s, |s, busy| s.set_busy_poll(busy.then_some(BUSY_POLL)));
        });
    }
}

/// Resident set size (VmRSS) from a `/proc/<pid>/status` file, in KiB.
fn rss_kib(status: &str) -> u64 {
    std::fs::read_to_string(status)
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Median over batches of the mean round-trip time in µs, `PINGPONG_SIZE` bytes (default 1)
/// each way.
fn pingpong<S: Read + Write>(mut s: S, kind: u8, rounds: usize) -> f64 {
    s.write_all(&[kind]).expect("kind");
    let size = std::env::var("PINGPONG_SIZE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1usize);
    let mut b = vec![7u8; size.clamp(1, 64 * 1024)];
    let per = rounds / BATCHES;
    // Warm up.
    for _ in 0..per / 4 {
        s.write_all(&b).expect("ping");
        s.read_exact(&mut b).expect("pong");
    }
    let mut means = Vec::new();
    for _ in 0..BATCHES {
        let t = Instant::now();
        for _ in 0..per {
            s.write_all(&b).expect("ping");
            s.read_exact(&mut b).expect("pong");
        }
        means.push(t.elapsed().as_secs_f64() * 1e6 / per as f64);
    }
    median(means)
}

/// MB/s streaming `bytes` in `chunk`-byte writes.
fn stream<S: Read + Write>(mut s: S, kind: u8, bytes: u64, chunk: usize) -> f64 {
    s.write_all(&[kind]).expect("kind");
    let data: Vec<u8> = (0..chunk).map(|i| i as u8).collect();
    let t = Instant::now();
    s.write_all(&bytes.to_be_bytes()).expect("len");
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk as u64) as usize;
        s.write_all(&data[..n]).expect("write");
        left -= n as u64;
    }
    let mut k = [0u8; 1];
    s.read_exact(&mut k).expect("ack");
    bytes as f64 / t.elapsed().as_secs_f64() / 1e6
}

fn main() {
    if let Ok(dir) = std::env::var("PINGPONG_SERVER") {
        server_main(PathBuf::from(dir));
        return;
    }
    let mut args = std::env::args().skip(1);
    let rounds: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(70_000);
    let bytes: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(1 << 30);
    let dir = std::env::temp_dir().join(format!("smc-pingpong-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let mut child = Command::new(std::env::current_exe().expect("exe"))
        .env("PINGPONG_SERVER", &dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("server");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("port");
    let port: u16 = line
        .trim()
        .strip_prefix("PORT ")
        .and_then(|p| p.parse().ok())
        .expect("PORT line");
    let st = stack(&dir);
    let smc = |busy: bool| {
        let mut s = SmcStream::connect_with(&st, ("127.0.0.1", port)).expect("connect");
        assert_eq!(s.mode(), smc::Mode::Smc, "the connection fell back");
        s.set_busy_poll(busy.then_some(BUSY_POLL));
        s
    };

    let tcp_l = TcpListener::bind("127.0.0.1:0").expect("tcp bind");
    let tcp_addr = tcp_l.local_addr().expect("addr");
    std::thread::spawn(move || {
        for s in tcp_l.incoming().flatten() {
            std::thread::spawn(move || serve(s, |_, _| {}));
        }
    });
    let uds_path = dir.join("uds.sock");
    let uds_l = UnixListener::bind(&uds_path).expect("uds bind");
    std::thread::spawn(move || {
        for s in uds_l.incoming().flatten() {
            std::thread::spawn(move || serve(s, |_, _| {}));
        }
    });
    let tcp = || {
        let s = TcpStream::connect(tcp_addr).expect("tcp");
        s.set_nodelay(true).expect("nodelay");
        s
    };
    let tcp_nagle = || TcpStream::connect(tcp_addr).expect("tcp");
    let uds = || UnixStream::connect(&uds_path).expect("uds");
    // A stack with discovery off: its streams fall back to TCP at once.
    let fb_stack = {
        let mut c = StackConfig::new(FabricConfig::with_dir(&dir, 2));
        c.discovery = DiscoveryMode::Off;
        Stack::new(c).expect("stack")
    };
    let fallback = || {
        let s = SmcStream::connect_with(&fb_stack, tcp_addr).expect("fallback connect");
        assert!(matches!(s.mode(), smc::Mode::Tcp(_)));
        s.set_nodelay(true).expect("nodelay");
        s
    };

    // PINGPONG_ONLY=memory: resident memory per idle SMC-R connection (client side).
    if std::env::var("PINGPONG_ONLY").is_ok_and(|o| o == "memory") {
        const N: usize = 1000;
        // One connection first: the link group and its links exist before the baseline.
        let first = smc(false);
        let server = format!("/proc/{}/status", child.id());
        let (before, sbefore) = (rss_kib("/proc/self/status"), rss_kib(&server));
        let mut conns: Vec<SmcStream> = (0..N).map(|_| smc(false)).collect();
        let (after, safter) = (rss_kib("/proc/self/status"), rss_kib(&server));
        let per = |a: u64, b: u64| a.saturating_sub(b) as f64 / N as f64;
        println!(
            "{N} idle SMC-R connections: client RSS {before} -> {after} KiB ({:.1} KiB each), \
             server RSS {sbefore} -> {safter} KiB ({:.1} KiB each, a thread per connection)",
            per(after, before),
            per(safter, sbefore),
        );
        // Each connection carries a few bytes both ways (its RMBEs get touched).
        for s in &mut conns {
            s.write_all(b"p!").expect("ping");
        }
        for s in &mut conns {
            let mut b = [0u8; 1];
            s.read_exact(&mut b).expect("pong");
        }
        let (used, sused) = (rss_kib("/proc/self/status"), rss_kib(&server));
        println!(
            "after 1 byte each way: client RSS {used} KiB ({:.1} KiB each), server {sused} KiB \
             ({:.1} KiB each)",
            per(used, before),
            per(sused, sbefore),
        );
        drop((first, conns));
        drop(child.stdin.take());
        let _ = child.wait();
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    // PINGPONG_ONLY=failover: stream BYTES, take the sending link's device down at 40%,
    // and report the longest a single write took (the failover's stall).
    if std::env::var("PINGPONG_ONLY").is_ok_and(|o| o == "failover") {
        let mut s = smc(false);
        s.write_all(b"s").expect("kind");
        s.write_all(&bytes.to_be_bytes()).expect("len");
        let data = vec![5u8; 64 * 1024];
        let (mut left, mut worst, mut at) = (bytes, Duration::ZERO, 0u64);
        let t = Instant::now();
        let mut failed = false;
        while left > 0 {
            let n = left.min(data.len() as u64) as usize;
            let w = Instant::now();
            s.write_all(&data[..n]).expect("write");
            let took = w.elapsed();
            if took > worst {
                worst = took;
                at = bytes - left;
            }
            left -= n as u64;
            if !failed && left < bytes * 6 / 10 {
                failed = true;
                let (_, dev) = s.send_link().expect("link");
                st.set_port_state(&dev, smc_fabric::PortState::Down);
            }
        }
        let mut k = [0u8; 1];
        s.read_exact(&mut k).expect("ack");
        println!(
            "{:.1} MB/s; longest write {worst:?} at byte {at} (failure at {})",
            bytes as f64 / t.elapsed().as_secs_f64() / 1e6,
            bytes * 4 / 10
        );
        drop(child.stdin.take());
        let _ = child.wait();
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    // PINGPONG_ONLY=smc-pingpong / smc-busy: only SMC-R's blocking / busy-polling ping-pong
    // (for profiling, and for alternating A/B timings of two builds: three decimals).
    let only = std::env::var("PINGPONG_ONLY").unwrap_or_default();
    if only == "smc-pingpong" || only == "smc-busy" {
        let busy = only == "smc-busy";
        let t = pingpong(smc(busy), if busy { b'P' } else { b'p' }, rounds);
        println!("SMC-R ping-pong (busy poll {busy}): {t:.3} µs");
        drop(child.stdin.take());
        let _ = child.wait();
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    // PINGPONG_ONLY=smc-stream: only SMC-R's 64 KiB streaming (for profiling).
    if std::env::var("PINGPONG_ONLY").is_ok_and(|o| o == "smc-stream") {
        let s_smc = stream(smc(false), b's', bytes, 64 * 1024);
        println!("SMC-R streaming in 64 KiB writes: {s_smc:.1} MB/s");
        drop(child.stdin.take());
        let _ = child.wait();
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    println!("1-byte ping-pong, median of {BATCHES} batches, {rounds} round trips in all:");
    let t_tcp = pingpong(tcp(), b'p', rounds);
    let t_uds = pingpong(uds(), b'p', rounds);
    let t_smc = pingpong(smc(false), b'p', rounds);
    let t_smc_busy = pingpong(smc(true), b'P', rounds);
    let t_fb = pingpong(fallback(), b'p', rounds);
    println!("  TCP loopback          {t_tcp:8.2} µs");
    println!(
        "  SmcStream fallen back {t_fb:8.2} µs  ({:.3}× TCP)",
        t_fb / t_tcp
    );
    println!("  Unix socket           {t_uds:8.2} µs");
    println!(
        "  SMC-R blocking        {t_smc:8.2} µs  ({:.2}× TCP, {:.2}× UDS)",
        t_smc / t_tcp,
        t_smc / t_uds
    );
    println!(
        "  SMC-R busy poll 50µs  {t_smc_busy:8.2} µs  ({:.3}× TCP)",
        t_smc_busy / t_tcp
    );

    println!("streaming {bytes} bytes in 64 KiB writes:");
    let s_tcp = stream(tcp(), b's', bytes, 64 * 1024);
    let s_uds = stream(uds(), b's', bytes, 64 * 1024);
    let s_smc = stream(smc(false), b's', bytes, 64 * 1024);
    let s_fb = stream(fallback(), b's', bytes, 64 * 1024);
    println!("  TCP loopback          {s_tcp:8.1} MB/s");
    println!(
        "  SmcStream fallen back {s_fb:8.1} MB/s  ({:.3}× TCP)",
        s_fb / s_tcp
    );
    println!("  Unix socket           {s_uds:8.1} MB/s");
    println!(
        "  SMC-R                 {s_smc:8.1} MB/s  ({:.2}× TCP)",
        s_smc / s_tcp
    );

    let small = bytes / 16;
    println!("streaming {small} bytes in 64-byte writes (TCP without TCP_NODELAY):");
    let m_tcp = stream(tcp_nagle(), b't', small, 64);
    let m_smc = stream(smc(false), b't', small, 64);
    println!("  TCP loopback          {m_tcp:8.1} MB/s");
    println!(
        "  SMC-R                 {m_smc:8.1} MB/s  ({:.2}× TCP)",
        m_smc / m_tcp
    );

    drop(child.stdin.take());
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
}
