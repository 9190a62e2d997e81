//! Several smc-rs processes on one address (issue 21, item 3; root only, skipped with a message
//! otherwise): three `smc nc` servers in one network namespace share one roce device address
//! (so one UDP port 4791), three clients in another namespace, also sharing one address,
//! connect to one server each at the same time. Every transfer must go over SMC-R and arrive
//! with the SHA-256 it left with — which needs the eBPF program steering each datagram to the
//! process owning its destination QPN on both sides.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::Duration;

mod netns;
use netns::{root_with_ip, sha256_file, wait, NsPair};

/// Namespaces `a` (10.N.1.1) and `b` (10.N.1.2) joined by one veth pair (netns::NsPair).
struct Net(NsPair);

impl std::ops::Deref for Net {
    type Target = NsPair;
    fn deref(&self) -> &NsPair {
        &self.0
    }
}

impl Net {
    fn new() -> Net {
        Net(NsPair::new(
            's',
            "s",
            120 + (std::process::id() % 7) as u8,
            1,
        ))
    }

    /// `smc nc` in namespace `side` with one roce device on the veth; every process of a side
    /// shares the fabric directory (and so the reuseport registry).
    fn nc(&self, side: char, args: &[&str], stdin: Stdio, stdout: Stdio) -> Child {
        let dir = self.dir.join(side.to_string());
        self.smc_cmd(side, &self.roce_devices(side, 1), &dir, &[])
            .arg("nc")
            .args(args)
            .stdin(stdin)
            .stdout(stdout)
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn smc nc")
    }
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
            &["-v", "-l", &port, "--bind", &net.addr('a', 0)],
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
            &["-v", &net.addr('a', 0), &port],
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
