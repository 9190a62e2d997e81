//! What the root tests of the roce device share: two network namespaces `a` and `b` joined by
//! veth pairs, and the helpers to run commands and wait for them. Each test binary includes this
//! module (`mod netns;`) and uses the parts it needs.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

/// The test file's `Net`: a [`NsPair`] (it derefs to it) to which the file adds its own
/// constructor and helpers. The doc comment given is the struct's.
macro_rules! net_type {
    ($(#[$doc:meta])*) => {
        $(#[$doc])*
        struct Net(netns::NsPair);

        impl std::ops::Deref for Net {
            type Target = netns::NsPair;
            fn deref(&self) -> &netns::NsPair {
                &self.0
            }
        }
    };
}
pub(crate) use net_type;

/// Whether this process may create namespaces and veths (root with iproute2); says why not.
pub fn root_with_ip() -> bool {
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

/// Run a command that must succeed.
pub fn run(args: &[&str]) {
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

/// Namespaces `a` and `b` joined by `pairs` veth pairs: pair k on 10.N.(k+1).0/24, `a` is .1
/// and `b` is .2. Everything is removed on drop (deleting a namespace deletes its veth ends).
pub struct NsPair {
    pub a: String,
    pub b: String,
    pub n: u8,
    pub dir: PathBuf,
    letter: char,
    tag: String,
}

impl NsPair {
    /// `letter` tells this test's namespaces, veths and scratch directory from other tests';
    /// `tag` is appended to the process id in their names; `n` is the second octet.
    pub fn new(letter: char, tag: &str, n: u8, pairs: u8) -> NsPair {
        let tag = format!("{:x}{tag}", std::process::id() % 0xFFFF);
        let net = NsPair {
            a: format!("smc{letter}a{tag}"),
            b: format!("smc{letter}b{tag}"),
            n,
            dir: std::env::temp_dir().join(format!("smc-roce-{letter}-{tag}")),
            letter,
            tag,
        };
        std::fs::create_dir_all(&net.dir).expect("test dir");
        run(&["ip", "netns", "add", &net.a]);
        run(&["ip", "netns", "add", &net.b]);
        for k in 0..pairs {
            let (va, vb) = (net.veth('a', k), net.veth('b', k));
            run(&[
                "ip", "link", "add", &va, "type", "veth", "peer", "name", &vb,
            ]);
            run(&["ip", "link", "set", &va, "netns", &net.a]);
            run(&["ip", "link", "set", &vb, "netns", &net.b]);
            for side in ['a', 'b'] {
                let (ns, v) = (net.ns(side), net.veth(side, k));
                let addr = format!("{}/24", net.addr(side, k));
                run(&["ip", "-n", ns, "addr", "add", &addr, "dev", &v]);
                run(&["ip", "-n", ns, "link", "set", &v, "up"]);
                run(&["ip", "-n", ns, "link", "set", "lo", "up"]);
            }
        }
        net
    }

    /// The namespace of `side` ('a' or 'b').
    pub fn ns(&self, side: char) -> &str {
        if side == 'a' {
            &self.a
        } else {
            &self.b
        }
    }

    /// The veth of pair `k` on `side`.
    pub fn veth(&self, side: char, k: u8) -> String {
        format!("{}{side}{k}{}", self.letter, self.tag)
    }

    /// `SMC_FABRIC_DEVICES` for `side` with one roce device per veth pair: `r0` on pair 0,
    /// and every further device also serving pair 0's TCP address, so that all of them form
    /// one link group (`roce:r0=VETH0,roce:r1=VETH1+ADDR0`).
    pub fn roce_devices(&self, side: char, pairs: u8) -> String {
        (0..pairs)
            .map(|k| {
                if k == 0 {
                    format!("roce:r0={}", self.veth(side, 0))
                } else {
                    format!("roce:r{k}={}+{}", self.veth(side, k), self.addr(side, 0))
                }
            })
            .collect::<Vec<_>>()
            .join(",")
    }

    /// A command that runs `smc` in namespace `side`: roce devices `devices`, control sockets
    /// in `fabric_dir`, the SMC-R capability asserted, this pair's subnets, and `env`
    /// (`NAME=VALUE` settings) — with no `SMC_VERSIONS`/`SMC_UEIDS` of the test's own
    /// environment. The `smc` subcommand and its arguments come next.
    pub fn smc_cmd(&self, side: char, devices: &str, fabric_dir: &Path, env: &[String]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", self.ns(side), "env"])
            .args(["-u", "SMC_VERSIONS", "-u", "SMC_UEIDS"])
            .arg(format!("SMC_FABRIC_DEVICES={devices}"))
            .arg(format!("SMC_FABRIC_DIR={}", fabric_dir.display()))
            .arg("SMC_DISCOVERY=assert-peer")
            .arg(format!("SMC_IPV4_SUBNETS=10.{}.0.0/16", self.n))
            .args(env)
            .arg(env!("CARGO_BIN_EXE_smc"));
        c
    }

    /// The address of `side` on pair `k`.
    pub fn addr(&self, side: char, k: u8) -> String {
        format!(
            "10.{}.{}.{}",
            self.n,
            k + 1,
            if side == 'a' { 1 } else { 2 }
        )
    }

    /// The IPv6 address of `side` on pair `k` (`fdNN:k+1::1` and `::2`), once
    /// [`add_addr6`](Self::add_addr6) put it there.
    pub fn addr6(&self, side: char, k: u8) -> String {
        format!(
            "fd{:02x}:{}::{}",
            self.n,
            k + 1,
            if side == 'a' { 1 } else { 2 }
        )
    }

    /// Put the IPv6 addresses of pair `k` on its two veths, with `nodad` so that they are
    /// usable at once.
    pub fn add_addr6(&self, k: u8) {
        for side in ['a', 'b'] {
            let addr = format!("{}/64", self.addr6(side, k));
            let v = self.veth(side, k);
            run(&[
                "ip",
                "-n",
                self.ns(side),
                "addr",
                "add",
                &addr,
                "dev",
                &v,
                "nodad",
            ]);
        }
    }
}

/// Spawn `smc nc ARGS` from `cmd` (made by [`NsPair::smc_cmd`]); stderr is piped.
pub fn spawn_nc(mut cmd: Command, args: &[&str], stdin: Stdio, stdout: Stdio) -> Child {
    cmd.arg("nc")
        .args(args)
        .stdin(stdin)
        .stdout(stdout)
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn smc nc")
}

/// A file `in{seed}` in `dir` of `len` pseudo-random bytes, different for every `seed`.
pub fn input(dir: &Path, seed: u64, len: usize) -> PathBuf {
    let p = dir.join(format!("in{seed}"));
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15 ^ (seed << 32) ^ len as u64;
    let mut buf = vec![0u8; len];
    for b in buf.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    std::fs::write(&p, &buf).expect("write input");
    p
}

impl Drop for NsPair {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.a]).status();
        let _ = Command::new("ip").args(["netns", "del", &self.b]).status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `smc WHAT --json --dir DIR` about the stacks whose control sockets are in `dir`; `null`
/// when none answers.
pub fn query(dir: &Path, what: &str) -> serde_json::Value {
    Command::new(env!("CARGO_BIN_EXE_smc"))
        .args([what, "--json", "--dir"])
        .arg(dir)
        .output()
        .ok()
        .and_then(|o| serde_json::from_slice(&o.stdout).ok())
        .unwrap_or(serde_json::Value::Null)
}

/// The link groups (objects with `links`) anywhere in `smc linkgroup --json` output.
pub fn link_groups(v: &serde_json::Value) -> Vec<&serde_json::Value> {
    let mut out = Vec::new();
    fn walk<'a>(v: &'a serde_json::Value, out: &mut Vec<&'a serde_json::Value>) {
        match v {
            serde_json::Value::Array(a) => a.iter().for_each(|x| walk(x, out)),
            serde_json::Value::Object(o) if o.contains_key("links") => out.push(v),
            serde_json::Value::Object(o) => o.values().for_each(|x| walk(x, out)),
            _ => {}
        }
    }
    walk(v, &mut out);
    out
}

/// The active links of link group `g`.
pub fn active_links(g: &serde_json::Value) -> usize {
    g.get("links").and_then(|l| l.as_array()).map_or(0, |l| {
        l.iter()
            .filter(|x| x.get("state").and_then(|s| s.as_str()) == Some("active"))
            .count()
    })
}

/// The sum of every number named `key` anywhere in `v` (a counter over all stacks).
pub fn sum_key(v: &serde_json::Value, key: &str) -> u64 {
    match v {
        serde_json::Value::Array(a) => a.iter().map(|x| sum_key(x, key)).sum(),
        serde_json::Value::Object(o) => o
            .iter()
            .map(|(k, x)| {
                if k == key {
                    x.as_u64().unwrap_or(0)
                } else {
                    sum_key(x, key)
                }
            })
            .sum(),
        _ => 0,
    }
}

/// The SHA-256 of a file.
pub fn sha256_file(p: &Path) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(std::fs::read(p).expect("read"));
    h.finalize().into()
}

/// Wait at most `limit` for `c` to exit successfully; its stderr.
pub fn wait(mut c: Child, limit: Duration, what: &str) -> String {
    let end = Instant::now() + limit;
    loop {
        if let Some(st) = c.try_wait().expect("wait") {
            let mut err = String::new();
            if let Some(mut e) = c.stderr.take() {
                use std::io::Read;
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
