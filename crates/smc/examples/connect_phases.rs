//! Connection setup on a reused link group, phase by phase: the client's connect (TCP
//! handshake and CLC rendezvous), the first exchange (a byte each way) and the close, as
//! medians over ROUNDS connections, and the mean and 99th percentile of the whole (the mean
//! is what a rate such as `smc bench`'s conn/s sees); TCP loopback next to it.
//!
//! ```text
//! cargo run --release -p smc --example connect_phases -- [ROUNDS]
//! ```
//!
//! The SMC-R server is a second process (this binary re-executed with `PHASES_SERVER=1`)
//! that serves every connection in its own thread (as `smc bench` does); the TCP server is a
//! thread. `PHASES_ONLY_SMC=1` skips TCP (for `strace -c -f` or `perf record` of SMC-R alone).
#![allow(missing_docs)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use smc::{DiscoveryMode, SmcListener, SmcStream, Stack, StackConfig};
use smc_fabric::FabricConfig;

fn stack(dir: &Path) -> Stack {
    let mut c = StackConfig::new(FabricConfig::with_dir(dir, 2));
    c.discovery = DiscoveryMode::AssertPeer;
    Stack::new(c).expect("stack")
}

/// Answer the first byte with one byte, then read until end of stream.
fn serve<S: Read + Write>(mut s: S) {
    let mut b = [0u8; 64];
    if s.read_exact(&mut b[..1]).is_err() {
        return;
    }
    if s.write_all(&[1]).is_err() {
        return;
    }
    while matches!(s.read(&mut b), Ok(n) if n > 0) {}
}

fn server(dir: &Path) {
    let stack = stack(dir);
    let l = SmcListener::bind_with(&stack, "127.0.0.1:0").expect("bind");
    println!("{}", l.local_addr().expect("addr").port());
    std::thread::spawn(|| {
        let mut b = [0u8; 1];
        let _ = std::io::stdin().read(&mut b);
        std::process::exit(0);
    });
    for s in l.incoming() {
        let s = s.expect("accept");
        std::thread::spawn(move || serve(s));
    }
}

#[derive(Default)]
struct Phases {
    connect: Vec<f64>,
    exchange: Vec<f64>,
    close: Vec<f64>,
    total: Vec<f64>,
}

impl Phases {
    /// Time one connection: `connect`, a 1-byte request and answer, close. Recorded only when
    /// `record` (the first SMC-R connection creates the link group).
    fn measure<S: Read + Write>(&mut self, record: bool, connect: impl FnOnce() -> S) {
        let mut b = [0u8; 1];
        let t0 = Instant::now();
        let mut s = connect();
        let t1 = Instant::now();
        s.write_all(&[1]).expect("write");
        s.read_exact(&mut b).expect("read");
        let t2 = Instant::now();
        drop(s);
        let t3 = Instant::now();
        if record {
            let us = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e6;
            self.connect.push(us(t0, t1));
            self.exchange.push(us(t1, t2));
            self.close.push(us(t2, t3));
            self.total.push(us(t0, t3));
        }
    }

    fn print(&mut self, name: &str) {
        let med = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let mean = self.total.iter().sum::<f64>() / self.total.len() as f64;
        let total = med(&mut self.total);
        let p99 = self.total[self.total.len() * 99 / 100];
        println!(
            "{name:4} connect {:7.1} µs  exchange {:7.1} µs  close {:7.1} µs  total {total:7.1} µs \
             (mean {mean:7.1} µs = {:.0} conn/s, p99 {p99:7.1} µs)",
            med(&mut self.connect),
            med(&mut self.exchange),
            med(&mut self.close),
            1e6 / mean,
        );
    }
}

fn main() {
    let dir = std::env::temp_dir().join(format!("smc-phases-{}", std::process::id()));
    if std::env::var_os("PHASES_SERVER").is_some() {
        server(Path::new(&std::env::var("PHASES_DIR").expect("dir")));
        return;
    }
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|r| r.parse().ok())
        .unwrap_or(2000);
    std::fs::create_dir_all(&dir).expect("dir");
    let mut child = Command::new(std::env::current_exe().expect("exe"))
        .env("PHASES_SERVER", "1")
        .env("PHASES_DIR", &dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("server");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("port");
    let port: u16 = line.trim().parse().expect("port");
    let stack = stack(&dir);

    let tcp = TcpListener::bind("127.0.0.1:0").expect("bind");
    let tcp_port = tcp.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for s in tcp.incoming() {
            let s = s.expect("accept");
            s.set_nodelay(true).expect("nodelay");
            std::thread::spawn(move || serve(s));
        }
    });

    for _ in 0..2 {
        let mut smc = Phases::default();
        let mut plain = Phases::default();
        for i in 0..=rounds {
            // The first connection creates the link group.
            smc.measure(i > 0, || {
                SmcStream::connect_with(&stack, ("127.0.0.1", port)).expect("connect")
            });
            if std::env::var_os("PHASES_ONLY_SMC").is_some() {
                continue;
            }
            plain.measure(true, || {
                let s = TcpStream::connect(("127.0.0.1", tcp_port)).expect("connect");
                s.set_nodelay(true).expect("nodelay");
                s
            });
        }
        smc.print("smc");
        if std::env::var_os("PHASES_ONLY_SMC").is_none() {
            plain.print("tcp");
        }
    }
    drop(child.stdin.take());
    let _ = child.wait();
    std::thread::sleep(Duration::from_millis(10));
    let _ = std::fs::remove_dir_all(&dir);
}
