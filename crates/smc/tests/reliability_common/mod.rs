//! Shared helpers of the reliability tests (`reliability_*.rs`): a peer process (the test
//! binary re-executed with `SMC_REL_CHILD=<role>`), stacks on a private shm fabric with two
//! devices, SHA-256 patterns, and counts of this process's fds, mappings and threads.
#![allow(dead_code, missing_docs)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::Shutdown;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use sha2::{Digest, Sha256};
use smc::{DiscoveryMode, SmcListener, SmcStream, Stack, StackConfig};
use smc_fabric::FabricConfig;

/// Whether this process is a peer (child) rather than the test itself.
pub fn is_child() -> bool {
    std::env::var_os("SMC_REL_CHILD").is_some()
}

/// A count from the environment, else `default`.
pub fn env_count(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

pub fn test_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "smc-rel-{}-{}-{}",
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

/// Tracing to stderr filtered by `SMC_LOG`; with `SMC_LOG_DIR` set, to a file per process
/// there instead (`<pid>.log`), so that the logs of both sides of a test stay apart.
pub fn init_log() {
    let filter = tracing_subscriber::EnvFilter::from_env("SMC_LOG");
    if let Ok(dir) = std::env::var("SMC_LOG_DIR") {
        let path = PathBuf::from(dir).join(format!("{}.log", std::process::id()));
        if let Ok(f) = std::fs::File::create(path) {
            let f = std::sync::Arc::new(f);
            let _ = tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_ansi(false)
                .with_writer(move || f.clone())
                .try_init();
            return;
        }
    }
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// A stack configuration on the fabric in `dir` with two devices and assert-peer discovery.
pub fn config(dir: &Path) -> StackConfig {
    init_log();
    let mut c = StackConfig::new(FabricConfig::with_dir(dir, 2));
    c.discovery = DiscoveryMode::AssertPeer;
    c.clc_timeout = Duration::from_secs(20);
    // The test's long CLC timer covers the wait for the Accept too (not the 6 s default).
    c.accept_wait = c.clc_timeout;
    c
}

pub fn stack(dir: &Path) -> Stack {
    Stack::new(config(dir)).expect("stack")
}

/// Deterministic bytes for stream `seed`, chunk by chunk (xorshift).
pub struct Pattern(u64);

impl Pattern {
    pub fn new(seed: u64) -> Pattern {
        Pattern(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        for c in buf.chunks_mut(8) {
            let mut x = self.0;
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            self.0 = x;
            c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
        }
    }
}

pub fn sha256(data: &[u8]) -> [u8; 32] {
    Sha256::digest(data).into()
}

/// Write `total` pattern bytes of stream `seed` on `w` and read them back (echoed) on `r`
/// at the same time; returns (SHA-256 sent, SHA-256 received, bytes received) or the first
/// I/O error of either side.
pub fn echo_stream(
    mut r: SmcStream,
    mut w: SmcStream,
    seed: u64,
    total: u64,
) -> std::io::Result<([u8; 32], [u8; 32], u64)> {
    let writer = std::thread::spawn(move || -> std::io::Result<[u8; 32]> {
        let mut p = Pattern::new(seed);
        let mut h = Sha256::new();
        let mut buf = vec![0u8; 61 * 1024 + 7];
        let mut left = total;
        while left > 0 {
            let n = buf.len().min(left as usize);
            p.fill(&mut buf[..n]);
            w.write_all(&buf[..n])?;
            h.update(&buf[..n]);
            left -= n as u64;
        }
        Ok(h.finalize().into())
    });
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut got = 0u64;
    let mut err = None;
    while got < total {
        match r.read(&mut buf) {
            Ok(0) => {
                err = Some(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
                break;
            }
            Ok(n) => {
                h.update(&buf[..n]);
                got += n as u64;
            }
            Err(e) => {
                err = Some(e);
                break;
            }
        }
    }
    let sent = writer
        .join()
        .map_err(|_| std::io::Error::other("writer panicked"))?;
    if let Some(e) = err {
        return Err(e);
    }
    Ok((sent?, h.finalize().into(), got))
}

/// A peer process running `role`, with the port it listens on.
pub struct Peer {
    pub child: Child,
    pub port: u16,
}

impl Peer {
    /// Start the test binary `exe_test` (the name of the `#[test]` fn that dispatches roles)
    /// as a peer in `role`.
    pub fn spawn(entry: &str, role: &str, dir: &Path, env: &[(&str, String)]) -> Peer {
        let mut cmd = Command::new(std::env::current_exe().expect("exe"));
        cmd.args([entry, "--exact", "--nocapture", "--test-threads=1"])
            .env("SMC_REL_CHILD", role)
            .env("SMC_REL_DIR", dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        Peer::start(cmd, true)
    }

    /// Start a peer that prints no port (it connects to us).
    pub fn spawn_connector(entry: &str, role: &str, dir: &Path, env: &[(&str, String)]) -> Peer {
        let mut cmd = Command::new(std::env::current_exe().expect("exe"));
        cmd.args([entry, "--exact", "--nocapture", "--test-threads=1"])
            .env("SMC_REL_CHILD", role)
            .env("SMC_REL_DIR", dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::null());
        for (k, v) in env {
            cmd.env(k, v);
        }
        Peer::start(cmd, false)
    }

    fn start(mut cmd: Command, wait_port: bool) -> Peer {
        let mut child = cmd.spawn().expect("spawn peer");
        if !wait_port {
            return Peer { child, port: 0 };
        }
        let out = child.stdout.take().expect("stdout");
        let mut port = 0;
        for line in BufReader::new(out).lines() {
            let line = line.expect("peer output");
            if let Some(i) = line.find("PORT ") {
                port = line[i + 5..].trim().parse().expect("port");
                break;
            }
        }
        assert_ne!(port, 0, "peer did not report its port");
        // The peer prints nothing more on stdout (diagnostics go to stderr); its end of the
        // pipe closes here so that no fd or thread of ours outlives the peer.
        Peer { child, port }
    }

    /// Close the peer's stdin (it exits) and check its status.
    pub fn finish(mut self) {
        drop(self.child.stdin.take());
        let status = self.child.wait().expect("wait peer");
        assert!(status.success(), "peer failed: {status}");
    }
}

/// In a peer: exit when the parent closes our stdin (or dies).
pub fn exit_on_stdin_eof() {
    std::thread::spawn(|| {
        let mut buf = [0u8; 16];
        while matches!(std::io::stdin().read(&mut buf), Ok(n) if n > 0) {}
        std::process::exit(0);
    });
}

/// In a peer: echo every byte of `s` back until end of stream or an error.
pub fn echo(mut s: SmcStream) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut total = 0u64;
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if let Err(e) = s.write_all(&buf[..n]) {
                    eprintln!("echo: write failed after {total} bytes: {e}");
                    return;
                }
                total += n as u64;
            }
            Err(e) => {
                eprintln!("echo: read failed after {total} bytes: {e}");
                return;
            }
        }
    }
    let _ = s.shutdown(Shutdown::Write);
}

/// In a peer: an SMC echo server on `stack` (one thread per connection); prints its port.
pub fn run_echo_server(stack: &Stack) -> ! {
    let l = SmcListener::bind_with(stack, "127.0.0.1:0").expect("bind");
    println!("PORT {}", l.local_addr().expect("addr").port());
    for s in l.incoming() {
        match s {
            Ok(s) => {
                std::thread::spawn(move || echo(s));
            }
            Err(e) => eprintln!("accept: {e}"),
        }
    }
    std::process::exit(0)
}

/// Counts of this process's kernel resources.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcResources {
    /// Open file descriptors (`/proc/self/fd`).
    pub fds: usize,
    /// Of which sockets (TCP, and the fabric's Unix sockets).
    pub sockets: usize,
    /// Of which eventfds (tokio streams' notifiers).
    pub eventfds: usize,
    /// Of which memfds.
    pub memfds: usize,
    /// Mappings (`/proc/self/maps` lines).
    pub maps: usize,
    /// Of which map a memfd.
    pub memfd_maps: usize,
    /// Threads (`/proc/self/task`).
    pub threads: usize,
}

pub fn proc_resources() -> ProcResources {
    proc_resources_of("self")
}

/// [`proc_resources`] of process `pid` (`"self"` or a number; another process of ours).
pub fn proc_resources_of(pid: &str) -> ProcResources {
    let (mut fds, mut sockets, mut eventfds, mut memfds) = (0, 0, 0, 0);
    for e in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fd dir")
        .flatten()
    {
        fds += 1;
        let target = std::fs::read_link(e.path())
            .map(|t| t.to_string_lossy().into_owned())
            .unwrap_or_default();
        if target.starts_with("socket:") {
            sockets += 1;
        } else if target == "anon_inode:[eventfd]" {
            eventfds += 1;
        } else if target.starts_with("/memfd:") {
            memfds += 1;
        }
    }
    let maps_text = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    let maps = maps_text.lines().count();
    let memfd_maps = maps_text.lines().filter(|l| l.contains("/memfd:")).count();
    let threads = std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("task dir")
        .count();
    ProcResources {
        fds,
        sockets,
        eventfds,
        memfds,
        maps,
        memfd_maps,
        threads,
    }
}

/// Resident set size of this process, in KiB.
pub fn rss_kib() -> u64 {
    rss_kib_of("self")
}

/// Resident set size of process `pid` (`"self"` or a number), in KiB.
pub fn rss_kib_of(pid: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

/// Wait (polling) until `f` holds, at most `limit`; returns whether it held.
pub fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = std::time::Instant::now() + limit;
    loop {
        if f() {
            return true;
        }
        if std::time::Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Seeded xorshift: the tests' only randomness, reproducible from `SMC_REL_SEED`.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// A number in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}
