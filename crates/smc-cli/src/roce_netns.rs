//! `smc demo --fabric roce` and `smc bench --fabric roce`: two network namespaces joined by
//! two veth pairs, created here and removed at the end (root needed), with `smc nc` (this
//! binary) on software RoCEv2 devices in each. The demo streams data with a SHA-256 check and
//! takes one veth pair down mid-stream (the connection fails over to the other link); the
//! bench streams the same bytes over SMC-R and over TCP on the same veth and compares.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// The UDP port of the floor's receiver (`smc roce-floor`; not RoCEv2's 4791, which the
/// devices of a stack in the namespace may hold).
const FLOOR_PORT: u16 = 4792;

/// Two namespaces `a` and `b`, veth pairs 0 and 1 between them (10.N.1.0/24, 10.N.2.0/24).
struct Net {
    a: String,
    b: String,
    n: u8,
    tag: String,
    dir: PathBuf,
}

fn ip(args: &[&str]) -> Result<()> {
    let o = Command::new("ip")
        .args(args)
        .output()
        .context("running ip (iproute2)")?;
    if !o.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&o.stderr).trim()
        );
    }
    Ok(())
}

/// The veth MTU when none is asked for: Ethernet's, a path MTU of 1,024 bytes.
pub const DEFAULT_MTU: u32 = 1500;

/// Check a veth MTU given on the command line: a software RoCEv2 device needs room for a
/// path MTU of at least 256 bytes plus its headers, and a veth takes at most 65,535.
pub fn parse_mtu(s: &str) -> std::result::Result<u32, String> {
    let v: u32 = s
        .parse()
        .map_err(|_| format!("{s:?} is not a number of bytes"))?;
    if !(576..=65_535).contains(&v) {
        return Err(format!(
            "{v} is outside 576..=65535 (the veth's MTU, bytes)"
        ));
    }
    Ok(v)
}

impl Net {
    /// Two namespaces joined by two veth pairs of the given MTU.
    fn new(mtu: u32) -> Result<Net> {
        let uid = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("Uid:"))
                    .and_then(|l| l.split_whitespace().nth(2).map(str::to_owned))
            });
        if uid.as_deref() != Some("0") {
            bail!(
                "--fabric roce creates network namespaces and veth pairs: run as root \
                 (e.g. sudo smc demo --fabric roce)"
            );
        }
        let pid = std::process::id();
        let tag = format!("{:x}", pid % 0xFFFFF);
        let net = Net {
            a: format!("smcdemo-a{tag}"),
            b: format!("smcdemo-b{tag}"),
            n: 200 + (pid % 50) as u8,
            tag,
            // Memory-backed where there is /dev/shm: the bench's TCP figure moved by a
            // factor of three with a disk-backed file's writes.
            dir: if Path::new("/dev/shm").is_dir() {
                PathBuf::from("/dev/shm")
            } else {
                std::env::temp_dir()
            }
            .join(format!("smc-roce-demo-{pid}")),
        };
        std::fs::create_dir_all(&net.dir)?;
        ip(&["netns", "add", &net.a])?;
        ip(&["netns", "add", &net.b])?;
        for k in 0..2 {
            let (va, vb) = (net.veth('a', k), net.veth('b', k));
            ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])?;
            ip(&["link", "set", &va, "netns", &net.a])?;
            ip(&["link", "set", &vb, "netns", &net.b])?;
            for (ns, v, side) in [(&net.a, &va, 'a'), (&net.b, &vb, 'b')] {
                let addr = format!("{}/24", net.addr(side, k));
                ip(&["-n", ns, "addr", "add", &addr, "dev", v])?;
                ip(&["-n", ns, "link", "set", v, "mtu", &mtu.to_string()])?;
                ip(&["-n", ns, "link", "set", v, "up"])?;
                ip(&["-n", ns, "link", "set", "lo", "up"])?;
            }
        }
        Ok(net)
    }

    fn veth(&self, side: char, k: u8) -> String {
        format!("sd{side}{k}{}", self.tag)
    }

    fn addr(&self, side: char, k: u8) -> String {
        format!(
            "10.{}.{}.{}",
            self.n,
            k + 1,
            if side == 'a' { 1 } else { 2 }
        )
    }

    fn nc(
        &self,
        side: char,
        smc: bool,
        args: &[&str],
        stdin: Stdio,
        stdout: Stdio,
    ) -> Result<Child> {
        let ns = if side == 'a' { &self.a } else { &self.b };
        let devices = format!(
            "roce:r0={},roce:r1={}+{}",
            self.veth(side, 0),
            self.veth(side, 1),
            self.addr(side, 0)
        );
        let exe = std::env::current_exe().context("locating the smc binary")?;
        Command::new("ip")
            .args(["netns", "exec", ns, "env"])
            .arg(format!("SMC_FABRIC_DEVICES={devices}"))
            .arg(format!("SMC_FABRIC_DIR={}/{side}", self.dir.display()))
            .arg(format!(
                "SMC_DISCOVERY={}",
                if smc { "assert-peer" } else { "off" }
            ))
            .arg(format!("SMC_IPV4_SUBNETS=10.{}.0.0/16", self.n))
            .arg(exe)
            .arg("nc")
            .args(args)
            .stdin(stdin)
            .stdout(stdout)
            .stderr(Stdio::piped())
            .spawn()
            .context("starting smc nc in a namespace")
    }

    /// Stream `src` from b to a; `during` runs once the receiver has `trigger` bytes (only
    /// with `keep`). With `keep` the receiver writes into a file whose SHA-256 is compared
    /// with `src`'s; without, it discards the bytes (as iperf3's receiver does) and only
    /// their count is checked.
    fn stream(
        &self,
        smc: bool,
        src: &Path,
        keep: bool,
        trigger: u64,
        during: impl FnOnce() -> Result<()>,
    ) -> Result<Streamed> {
        let out = self.dir.join("out");
        let mut server = Reaped(Some(self.nc(
            'a',
            smc,
            &["-v", "-l", "7000", "--bind", &self.addr('a', 0)],
            Stdio::null(),
            if keep {
                Stdio::from(File::create(&out)?)
            } else {
                Stdio::null()
            },
        )?));
        self.wait_listening(7000)?;
        let start = Instant::now();
        let client = self.nc(
            'b',
            smc,
            &["-v", &self.addr('a', 0), "7000"],
            Stdio::from(File::open(src)?),
            Stdio::null(),
        )?;
        let end = Instant::now() + Duration::from_secs(120);
        while keep
            && std::fs::metadata(&out).map(|m| m.len()).unwrap_or(0) < trigger
            && Instant::now() < end
        {
            std::thread::sleep(Duration::from_millis(2));
        }
        during()?;
        let ce = finish(client, "client")?;
        let se = finish(server.take(), "server")?;
        let took = start.elapsed();
        let want = if smc { "over SMC-R" } else { "over TCP" };
        if !se.contains(want) || !ce.contains(want) {
            bail!("the connection did not run {want}:\n{ce}\n{se}");
        }
        let transfer = transfer_of(&se);
        if keep {
            if sha256(src)? != sha256(&out)? {
                bail!("SHA-256 of the received bytes differs from the sent ones");
            }
        } else {
            let len = std::fs::metadata(src)?.len();
            match transfer {
                Some((n, _)) if n == len => {}
                _ => bail!("the receiver did not say it received all {len} bytes:\n{se}"),
            }
        }
        Ok(Streamed {
            took,
            transfer: transfer.map(|(_, secs)| secs),
            cpu: [cpu_of(&ce), cpu_of(&se)],
        })
    }
}

/// The line of `smc bench --fabric roce` that lists each round's transfer rates, SMC-R / TCP
/// MB/s and their ratio (TCP's time over SMC-R's), in the order run; a round missing either
/// time shows a dash.
fn rounds_line(bytes: u64, each: &[[Option<f64>; 2]]) -> String {
    let rounds: Vec<String> = each
        .iter()
        .map(|[s, t]| match (s, t) {
            (Some(s), Some(t)) => format!(
                "{:.1} / {:.1} ({:.2}x)",
                bytes as f64 / s / 1e6,
                bytes as f64 / t / 1e6,
                t / s
            ),
            _ => "-".to_string(),
        })
        .collect();
    format!(
        "each round, transfer SMC-R / TCP MB/s: {}",
        rounds.join(" · ")
    )
}

/// One stream's times.
struct Streamed {
    /// From the client's start to both ends' exit.
    took: Duration,
    /// From the receiver's first byte to its end of stream (its `smc nc -v` line).
    transfer: Option<f64>,
    /// Seconds of CPU the sender and the receiver took while the stream ran (their `smc nc
    /// -v` lines).
    cpu: [Option<f64>; 2],
}

/// Seconds of the line `smc nc: CPU while the stream ran: S s`.
fn cpu_of(stderr: &str) -> Option<f64> {
    stderr.lines().find_map(|l| {
        l.strip_prefix("smc nc: CPU while the stream ran: ")?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    })
}

/// The middle value of the rounds' figures (the upper one of two), as every row of
/// `smc bench --fabric roce` reports; NaN for none.
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The rows of `smc bench --fabric roce` with each end's CPU per GiB streamed (medians over
/// the rounds that reported it) and SMC-R's over TCP's; an end's row is left out when either
/// kind has no round with that end's figure.
fn cpu_rows(bytes: u64, smc: &[[Option<f64>; 2]], tcp: &[[Option<f64>; 2]]) -> Vec<String> {
    let gib = bytes as f64 / f64::from(1u32 << 30);
    let per_gib_ms = |v: &[[Option<f64>; 2]], end: usize| {
        let mut x: Vec<f64> = v
            .iter()
            .filter_map(|c| c[end])
            .map(|s| s / gib * 1e3)
            .collect();
        (!x.is_empty()).then(|| median(&mut x))
    };
    ["sender", "receiver"]
        .iter()
        .enumerate()
        .filter_map(|(end, name)| {
            let (s, t) = (per_gib_ms(smc, end)?, per_gib_ms(tcp, end)?);
            Some(format!(
                "{:<46} {:>11.1} ms {:>11.1} ms {:>7.2}x",
                format!("{name} CPU per GiB (SMC-R's ÷ TCP's)"),
                s,
                t,
                s / t
            ))
        })
        .collect()
}

/// Bytes and seconds of the receiver's line `smc nc: received N bytes in S s (...)` (or
/// `smc roce-floor: received ...`).
fn transfer_of(stderr: &str) -> Option<(u64, f64)> {
    stderr.lines().find_map(|l| {
        let rest = l
            .strip_prefix("smc nc: received ")
            .or_else(|| l.strip_prefix("smc roce-floor: received "))?;
        let (n, t) = rest.split_once(" bytes in ")?;
        Some((n.parse().ok()?, t.split_whitespace().next()?.parse().ok()?))
    })
}

impl Net {
    /// Round trips of `size` bytes from b to an echo listener in a for `secs`; returns the
    /// client's line (`pingpong SIZE round_trips N p50_us X p99_us Y mean_us Z`) parsed.
    fn pingpong(&self, smc: bool, size: usize, secs: f64) -> Result<PingPong> {
        let _server = Reaped(Some(self.nc(
            'a',
            smc,
            &["-v", "-l", "7001", "--echo", "--bind", &self.addr('a', 0)],
            Stdio::null(),
            Stdio::null(),
        )?));
        self.wait_listening(7001)?;
        let size_s = size.to_string();
        let secs_s = secs.to_string();
        let client = self.nc(
            'b',
            smc,
            &[
                "-v",
                &self.addr('a', 0),
                "7001",
                "--pingpong",
                &size_s,
                "--time",
                &secs_s,
            ],
            Stdio::null(),
            Stdio::piped(),
        );
        let result = client.and_then(|mut c| {
            let mut out = String::new();
            if let Some(mut o) = c.stdout.take() {
                o.read_to_string(&mut out)?;
            }
            let err = finish(c, "ping-pong client")?;
            let want = if smc { "over SMC-R" } else { "over TCP" };
            if !err.contains(want) {
                bail!("the ping-pong connection did not run {want}:\n{err}");
            }
            PingPong::parse(&out)
        });
        result
    }

    /// The floor (`smc roce-floor`, roce_floor.rs): `src` from b to a over the same veth
    /// pair with only the per-byte work of a software RoCE stream (copy into packets, CRC,
    /// `UDP_SEGMENT` runs; CRC check, placement, read) at the path MTU the devices use; the
    /// receiver's transfer seconds (first byte to end of stream).
    fn floor(&self, src: &Path, path_mtu: usize) -> Result<f64> {
        let exe = std::env::current_exe().context("locating the smc binary")?;
        let at = format!("{}:{FLOOR_PORT}", self.addr('a', 0));
        let mtu = path_mtu.to_string();
        let run = |ns: &str, role: &str, stdin: Stdio| {
            Command::new("ip")
                .args(["netns", "exec", ns])
                .arg(&exe)
                .args(["roce-floor", role, &at, "--mtu", &mtu])
                .stdin(stdin)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .context("starting smc roce-floor in a namespace")
        };
        let mut server = Reaped(Some(run(&self.a, "--listen", Stdio::null())?));
        self.wait_bound(FLOOR_PORT, true)?;
        let client = run(&self.b, "--connect", Stdio::from(File::open(src)?))?;
        finish(client, "floor sender")?;
        let se = finish(server.take(), "floor receiver")?;
        let len = std::fs::metadata(src)?.len();
        match transfer_of(&se) {
            Some((n, secs)) if n == len => Ok(secs),
            _ => bail!("the floor's receiver did not say it received all {len} bytes:\n{se}"),
        }
    }

    /// Until something listens on TCP `port` in namespace a (at most 30 s: a stack's first
    /// start in a namespace loads its devices and eBPF program).
    fn wait_listening(&self, port: u16) -> Result<()> {
        self.wait_bound(port, false)
    }

    /// Until a TCP socket listens, or a UDP socket is bound (`udp`), on `port` in namespace a
    /// (at most 30 s).
    fn wait_bound(&self, port: u16, udp: bool) -> Result<()> {
        let filter = format!("sport = :{port}");
        let end = Instant::now() + Duration::from_secs(30);
        let flags = if udp { "-Hlun" } else { "-Hltn" };
        loop {
            let o = Command::new("ip")
                .args(["netns", "exec", &self.a, "ss", flags, &filter])
                .output()
                .context("running ss in the namespace")?;
            if o.status.success() && !o.stdout.is_empty() {
                return Ok(());
            }
            if Instant::now() > end {
                bail!("nothing listens on port {port} after 30 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A listener process that is killed and reaped when the run ends, however it ends (an
/// error on the client side must not leave it running).
struct Reaped(Option<Child>);

impl Reaped {
    /// The process, to be waited for normally.
    fn take(&mut self) -> Child {
        self.0.take().expect("taken once")
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// One `smc nc --pingpong` result.
#[derive(Debug, Clone, Copy)]
struct PingPong {
    round_trips: u64,
    p50_us: f64,
    p99_us: f64,
}

impl PingPong {
    fn parse(line: &str) -> Result<PingPong> {
        let f: Vec<&str> = line.split_whitespace().collect();
        let field = |name: &str| -> Result<&str> {
            f.iter()
                .position(|w| *w == name)
                .and_then(|i| f.get(i + 1).copied())
                .with_context(|| format!("no {name} in the ping-pong output {line:?}"))
        };
        Ok(PingPong {
            round_trips: field("round_trips")?.parse()?,
            p50_us: field("p50_us")?.parse()?,
            p99_us: field("p99_us")?.parse()?,
        })
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth ends inside it.
        let _ = Command::new("ip").args(["netns", "del", &self.a]).status();
        let _ = Command::new("ip").args(["netns", "del", &self.b]).status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn finish(mut c: Child, what: &str) -> Result<String> {
    let end = Instant::now() + Duration::from_secs(180);
    loop {
        if let Some(st) = c.try_wait()? {
            let mut err = String::new();
            if let Some(mut e) = c.stderr.take() {
                let _ = e.read_to_string(&mut err);
            }
            if !st.success() {
                bail!("{what} failed ({st}): {}", err.trim());
            }
            return Ok(err);
        }
        if Instant::now() > end {
            let _ = c.kill();
            bail!("{what} did not finish in 180 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn sha256(p: &Path) -> Result<Vec<u8>> {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    let mut f = File::open(p)?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().to_vec())
}

fn input(dir: &Path, len: u64) -> Result<PathBuf> {
    let p = dir.join("in");
    let mut f = std::io::BufWriter::new(File::create(&p)?);
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut chunk = vec![0u8; 1 << 16];
    let mut left = len;
    while left > 0 {
        for b in chunk.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        let n = left.min(chunk.len() as u64) as usize;
        f.write_all(&chunk[..n])?;
        left -= n as u64;
    }
    f.flush()?;
    Ok(p)
}

/// `smc demo --fabric roce`.
pub fn demo(bytes: u64, fail_at: u8, mtu: u32) -> Result<ExitCode> {
    let net = Net::new(mtu)?;
    println!(
        "namespaces {} and {}: veth pairs (MTU {mtu}) {}/{} ({}), {}/{} ({})",
        net.a,
        net.b,
        net.veth('a', 0),
        net.veth('b', 0),
        net.addr('a', 0),
        net.veth('a', 1),
        net.veth('b', 1),
        net.addr('a', 1)
    );
    let src = input(&net.dir, bytes)?;
    let trigger = bytes * u64::from(fail_at.min(100)) / 100;
    let (ns, veth) = (net.a.clone(), net.veth('a', 0));
    let took = net
        .stream(true, &src, true, trigger, || {
            if fail_at > 0 {
                println!("taking {veth} down after {trigger} bytes");
                ip(&["-n", &ns, "link", "set", &veth, "down"])?;
            }
            Ok(())
        })?
        .took;
    println!(
        "{bytes} bytes over SMC-R on software RoCEv2 in {:.2} s ({:.0} MB/s), SHA-256 equal{}",
        took.as_secs_f64(),
        bytes as f64 / took.as_secs_f64() / 1e6,
        if fail_at > 0 {
            ", failed over to the second link"
        } else {
            ""
        }
    );
    Ok(ExitCode::SUCCESS)
}

/// `smc bench --fabric roce`: streaming over SMC-R and TCP on the same veth pair, in the same
/// run, alternating, `rounds` times each; the median of each is reported.
pub fn bench(bytes: u64, rounds: usize, mtu: u32) -> Result<ExitCode> {
    let net = Net::new(mtu)?;
    let src = input(&net.dir, bytes)?;
    // One round of each kept in a file and checked by SHA-256, not timed.
    net.stream(true, &src, true, 0, || Ok(()))?;
    net.stream(false, &src, true, 0, || Ok(()))?;
    let path_mtu = smc_fabric::roce_path_mtu(mtu)
        .map(|m| m.bytes())
        .context("no RoCE path MTU on this veth MTU")?;
    let (mut smc, mut tcp) = (Vec::new(), Vec::new());
    let mut floor = Vec::new();
    // Each round's CPU of the sender and the receiver, per kind.
    let (mut smc_cpu, mut tcp_cpu) = (Vec::new(), Vec::new());
    // Each round's transfer times in the order run (SMC-R, TCP): the medians hide how far
    // apart the rounds were, which on a noisy machine is what a reader needs to weigh them.
    let mut each = Vec::new();
    for _ in 0..rounds.max(1) {
        let mut pair = [None; 2];
        for (i, (on, whole, cpu)) in [
            (true, &mut smc, &mut smc_cpu),
            (false, &mut tcp, &mut tcp_cpu),
        ]
        .into_iter()
        .enumerate()
        {
            let r = net.stream(on, &src, false, 0, || Ok(()))?;
            whole.push(r.took.as_secs_f64());
            cpu.push(r.cpu);
            pair[i] = r.transfer;
        }
        each.push(pair);
        // The floor is a yardstick: a round of it that fails is said, not fatal.
        match net.floor(&src, path_mtu) {
            Ok(secs) => floor.push(secs),
            Err(e) => eprintln!("smc bench: a round of the floor failed: {e:#}"),
        }
    }
    let mbs = |secs: f64| bytes as f64 / secs / 1e6;
    println!(
        "stream of {bytes} bytes from a file in memory between two namespaces over one veth \
         pair of MTU {mtu} (smc nc in 64 KiB reads and writes, received bytes counted and discarded after one untimed round of each checked by SHA-256; median of {} rounds)",
        smc.len()
    );
    println!("  {:<46} {:>14} {:>14} {:>8}", "", "SMC-R", "TCP", "ratio");
    // The transfer medians, from every round's pair when each round said both.
    let transfers = |k: usize| {
        each.iter()
            .map(|p: &[Option<f64>; 2]| p[k])
            .collect::<Option<Vec<f64>>>()
    };
    if let (Some(mut smc_x), Some(mut tcp_x)) = (transfers(0), transfers(1)) {
        let (s, t) = (median(&mut smc_x), median(&mut tcp_x));
        println!(
            "  {:<46} {:>9.1} MB/s {:>9.1} MB/s {:>7.2}x",
            "transfer (receiver: first byte to end of stream)",
            mbs(s),
            mbs(t),
            t / s
        );
        println!("  {}", rounds_line(bytes, &each));
        // What the rate is made of on a machine whose CPUs both ends need: each end's CPU
        // for the same bytes.
        for row in cpu_rows(bytes, &smc_cpu, &tcp_cpu) {
            println!("  {row}");
        }
        if !floor.is_empty() {
            let n = floor.len();
            let f = median(&mut floor);
            println!(
                "  {:<46} {:>9.1} MB/s {:>9.1} MB/s {:>7.2}x",
                format!("floor, transfer ({n} of {} rounds)", smc.len()),
                mbs(f),
                mbs(t),
                t / f
            );
            println!(
                "  (the floor, `smc roce-floor`, in place of SMC-R: the same bytes copied into \
                 packets of path MTU {path_mtu}, a CRC-32 each, UDP_SEGMENT runs; CRC check, \
                 placement and read at the receiver — the per-byte work of a software RoCE \
                 device with no protocol: an upper bound for a stream over it)"
            );
        }
    }
    let (s, t) = (median(&mut smc), median(&mut tcp));
    println!(
        "  {:<46} {:>9.1} MB/s {:>9.1} MB/s {:>7.2}x",
        "whole run (client start to both processes' exit)",
        mbs(s),
        mbs(t),
        t / s
    );
    // Ping-pong: SMC-R and TCP alternate, each round of each size; medians of the p50s.
    let secs = if bytes <= 64 << 20 { 1.0 } else { 2.0 };
    println!(
        "ping-pong between the namespaces (smc nc --pingpong against --echo, {secs} s per round, \
         median over {} rounds of each round's p50 / p99)",
        smc.len()
    );
    println!(
        "  {:>7}  {:>12} {:>12}  {:>12} {:>12}  {:>9}",
        "size", "SMC-R p50", "SMC-R p99", "TCP p50", "TCP p99", "p50 ratio"
    );
    for size in [1usize, 64, 1024, 16 * 1024] {
        let (mut sp, mut tp) = (Vec::new(), Vec::new());
        for _ in 0..rounds.max(1) {
            sp.push(net.pingpong(true, size, secs)?);
            tp.push(net.pingpong(false, size, secs)?);
        }
        let med = |v: &[PingPong], f: fn(&PingPong) -> f64| {
            let mut x: Vec<f64> = v.iter().map(f).collect();
            median(&mut x)
        };
        let (s50, s99) = (med(&sp, |p| p.p50_us), med(&sp, |p| p.p99_us));
        let (t50, t99) = (med(&tp, |p| p.p50_us), med(&tp, |p| p.p99_us));
        let n: u64 = sp.iter().chain(&tp).map(|p| p.round_trips).sum();
        println!(
            "  {size:>7}  {s50:>9.1} µs {s99:>9.1} µs  {t50:>9.1} µs {t99:>9.1} µs  {:>8.2}x   ({n} round trips)",
            s50 / t50
        );
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::{cpu_of, cpu_rows, parse_mtu, rounds_line, transfer_of};

    #[test]
    fn veth_mtus_outside_what_a_roce_device_and_a_veth_take_are_refused() {
        assert_eq!(parse_mtu("1500"), Ok(1500));
        assert_eq!(parse_mtu("9000"), Ok(9000));
        assert_eq!(parse_mtu("576"), Ok(576));
        assert_eq!(parse_mtu("65535"), Ok(65_535));
        for bad in ["575", "65536", "0", "-1", "9k", ""] {
            assert!(parse_mtu(bad).is_err(), "{bad:?} taken");
        }
    }

    #[test]
    fn reads_the_receivers_transfer_line() {
        let err = "smc nc: listening on 10.1.1.1:7000\nsmc nc: connected to 10.1.1.2:5 over SMC-R\n\
                   smc nc: received 1048576 bytes in 0.012500 s (first byte to end of stream, 83.9 MB/s)\n";
        assert_eq!(transfer_of(err), Some((1_048_576, 0.0125)));
        assert_eq!(transfer_of("smc nc: listening on 10.1.1.1:7000\n"), None);
        assert_eq!(transfer_of("smc nc: received 5 bytes in soon s\n"), None);
    }

    #[test]
    fn reads_each_ends_cpu_and_gives_it_per_gib() {
        let err = "smc nc: connected to 10.1.1.1:7000 over SMC-R\n\
                   smc nc: CPU while the stream ran: 0.150000 s\n";
        assert_eq!(cpu_of(err), Some(0.15));
        assert_eq!(cpu_of("smc nc: CPU while the stream ran: soon s\n"), None);
        assert_eq!(cpu_of("smc nc: listening on 10.1.1.1:7000\n"), None);
        // 256 MiB: a quarter GiB. Medians per end over the rounds that said it.
        let smc = [
            [Some(0.040), Some(0.030)],
            [Some(0.050), None],
            [Some(0.045), Some(0.020)],
        ];
        let tcp = [[Some(0.036), Some(0.012)], [Some(0.034), Some(0.014)]];
        assert_eq!(
            cpu_rows(256 << 20, &smc, &tcp),
            vec![
                format!(
                    "{:<46} {:>11.1} ms {:>11.1} ms {:>7.2}x",
                    "sender CPU per GiB (SMC-R's ÷ TCP's)", 180.0, 144.0, 1.25
                ),
                format!(
                    "{:<46} {:>11.1} ms {:>11.1} ms {:>7.2}x",
                    "receiver CPU per GiB (SMC-R's ÷ TCP's)",
                    120.0,
                    56.0,
                    120.0 / 56.0
                ),
            ]
        );
        // A kind without any figure for an end: no row for that end.
        assert_eq!(cpu_rows(256 << 20, &smc, &[[Some(0.036), None]]).len(), 1);
        assert!(cpu_rows(256 << 20, &[], &tcp).is_empty());
    }

    #[test]
    fn lists_each_rounds_rates_in_the_order_run() {
        let each = [
            [Some(0.5), Some(0.25)],
            [Some(0.2), None],
            [Some(1.0), Some(1.0)],
        ];
        assert_eq!(
            rounds_line(1_000_000, &each),
            "each round, transfer SMC-R / TCP MB/s: 2.0 / 4.0 (0.50x) · - · 1.0 / 1.0 (1.00x)"
        );
    }
}
