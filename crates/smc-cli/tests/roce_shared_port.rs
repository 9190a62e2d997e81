//! Several smc-rs processes on one address (issue 21, item 3; root only, skipped with a message
//! otherwise): three `smc nc` servers in one network namespace share one roce device address
//! (so one UDP port 4791), three clients in another namespace, also sharing one address,
//! connect to one server each at the same time. Every transfer must go over SMC-R and arrive
//! with the SHA-256 it left with — which needs the eBPF program steering each datagram to the
//! process owning its destination QPN on both sides.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

fn root_with_ip() -> bool {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.trim_ascii() == b"0");
    let ip = Command::new("ip")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    if !root || !ip {
        eprintln!("skipped: needs root and iproute2 (network namespaces and veth pairs)");
    }
    root && ip
}

fn run(args: &[&str]) {
    let o = Command::new(args[0])
        .args(&args[1..])
        .output()
        .expect("run command");
    assert!(
        o.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Namespaces `a` (10.N.1.1) and `b` (10.N.1.2) joined by one veth pair; removed on drop.
struct Net {
    a: String,
    b: String,
    n: u8,
    tag: String,
    dir: PathBuf,
}

impl Net {
    fn new() -> Net {
        let pid = std::process::id();
        let tag = format!("{:x}s", pid % 0xFFFF);
        let n = 120 + (pid % 7) as u8;
        let net = Net {
            a: format!("smcsa{tag}"),
            b: format!("smcsb{tag}"),
            n,
            tag: tag.clone(),
            dir: std::env::temp_dir().join(format!("smc-roce-shared-{tag}")),
        };
        std::fs::create_dir_all(&net.dir).expect("test dir");
        run(&["ip", "netns", "add", &net.a]);
        run(&["ip", "netns", "add", &net.b]);
        let (va, vb) = (net.veth('a'), net.veth('b'));
        run(&[
            "ip", "link", "add", &va, "type", "veth", "peer", "name", &vb,
        ]);
        run(&["ip", "link", "set", &va, "netns", &net.a]);
        run(&["ip", "link", "set", &vb, "netns", &net.b]);
        for (ns, v, side) in [(&net.a, &va, 'a'), (&net.b, &vb, 'b')] {
            let addr = format!("{}/24", net.addr(side));
            run(&["ip", "-n", ns, "addr", "add", &addr, "dev", v]);
            run(&["ip", "-n", ns, "link", "set", v, "up"]);
            run(&["ip", "-n", ns, "link", "set", "lo", "up"]);
        }
        net
    }

    fn veth(&self, side: char) -> String {
        format!("s{side}{}", self.tag)
    }

    fn addr(&self, side: char) -> String {
        format!("10.{}.1.{}", self.n, if side == 'a' { 1 } else { 2 })
    }

    /// `smc nc` in namespace `side` with one roce device on the veth; every process of a side
    /// shares the fabric directory (and so the reuseport registry).
    fn nc(&self, side: char, args: &[&str], stdin: Stdio, stdout: Stdio) -> Child {
        let ns = if side == 'a' { &self.a } else { &self.b };
        Command::new("ip")
            .args(["netns", "exec", ns, "env"])
            .arg(format!("SMC_FABRIC_DEVICES=roce:r0={}", self.veth(side)))
            .arg(format!("SMC_FABRIC_DIR={}/{side}", self.dir.display()))
            .arg("SMC_DISCOVERY=assert-peer")
            .arg(format!("SMC_IPV4_SUBNETS=10.{}.0.0/16", self.n))
            .arg(env!("CARGO_BIN_EXE_smc"))
            .arg("nc")
            .args(args)
            .stdin(stdin)
            .stdout(stdout)
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn smc nc")
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.a]).status();
        let _ = Command::new("ip").args(["netns", "del", &self.b]).status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn sha256_file(p: &Path) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(std::fs::read(p).expect("read"));
    h.finalize().into()
}

/// `len` pseudo-random bytes, different for every `seed`.
fn input(dir: &Path, seed: u64, len: usize) -> PathBuf {
    let p = dir.join(format!("in{seed}"));
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15 ^ (seed << 32) ^ len as u64;
    let mut buf = vec![0u8; len];
    for b in buf.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    File::create(&p)
        .and_then(|mut f| f.write_all(&buf))
        .expect("write input");
    p
}

fn wait(mut c: Child, limit: Duration, what: &str) -> String {
    let end = Instant::now() + limit;
    loop {
        if let Some(st) = c.try_wait().expect("wait") {
            let mut err = String::new();
            if let Some(mut e) = c.stderr.take() {
                let _ = e.read_to_string(&mut err);
            }
            assert!(st.success(), "{what} failed: {st}: {err}");
            return err;
        }
        if Instant::now() > end {
            let _ = c.kill();
            let _ = c.wait();
            panic!("{what} did not finish in {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn roce_three_processes_share_one_address() {
    if !root_with_ip() {
        return;
    }
    let net = Net::new();
    const N: u64 = 3;
    let len = 8 << 20;
    let mut servers = Vec::new();
    for i in 0..N {
        let out = net.dir.join(format!("out{i}"));
        let port = (7100 + i).to_string();
        let s = net.nc(
            'a',
            &["-v", "-l", &port, "--bind", &net.addr('a')],
            Stdio::null(),
            Stdio::from(File::create(&out).expect("out")),
        );
        servers.push((s, out));
    }
    std::thread::sleep(Duration::from_millis(500));
    // The servers joined the shared group: its registry names the steering map.
    let registry = std::fs::read_dir(net.dir.join("a"))
        .expect("fabric dir")
        .filter_map(|e| e.ok())
        .find(|e| e.file_name().to_string_lossy().ends_with(".reuseport"))
        .expect("no reuseport registry: the servers did not share the port");
    let id = std::fs::read_to_string(registry.path()).expect("registry");
    assert!(id.trim().parse::<u32>().is_ok(), "registry holds {id:?}");
    let mut clients = Vec::new();
    for i in 0..N {
        let src = input(&net.dir, i, len);
        let port = (7100 + i).to_string();
        let c = net.nc(
            'b',
            &["-v", &net.addr('a'), &port],
            Stdio::from(File::open(&src).expect("in")),
            Stdio::null(),
        );
        clients.push((c, src));
    }
    let limit = Duration::from_secs(120);
    let mut sums = Vec::new();
    for (i, (c, src)) in clients.into_iter().enumerate() {
        let err = wait(c, limit, &format!("client {i}"));
        assert!(err.contains("over SMC-R"), "client {i}: {err}");
        sums.push(sha256_file(&src));
    }
    for (i, (s, out)) in servers.into_iter().enumerate() {
        let err = wait(s, limit, &format!("server {i}"));
        assert!(err.contains("over SMC-R"), "server {i}: {err}");
        assert_eq!(
            sha256_file(&out),
            sums[i],
            "server {i}: SHA-256 of what arrived differs"
        );
    }
}
