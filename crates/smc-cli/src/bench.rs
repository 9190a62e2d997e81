//! `smc bench`: SMC-R on the shm fabric against TCP loopback and Unix domain sockets, in the
//! same run, measurement points alternating between the transports (smc, tcp, uds, floor,
//! smc, …) and the median of the rounds reported.
//!
//! The server side of each transport is a separate process (`smc bench-server`, hidden), so
//! SMC-R really crosses processes; CPU time is read from `/proc/<pid>/stat` of both the
//! client (this process) and the server.
//!
//! The fourth transport, `floor`, is what the machine allows (see [`crate::bench_floor`]):
//! for `stream` and `pingpong` threads of this process sharing a buffer, for `connect`
//! plain TCP carrying SMC-R's CLC message pattern. The other tests have no floor.

use std::io::{IsTerminal, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use smc::{DiscoveryMode, Mode, SmcStream, Stack, StackConfig};

use crate::bench_floor::{self, Layout};
use crate::bench_report::{self, Sample};
use crate::bench_server::{header, Conn, Op, Server, Transport, ACCEPT, PROPOSAL};

/// Arguments of `smc bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// A short run for CI (seconds): one round, short measurement windows, fewer samples.
    #[arg(long)]
    quick: bool,
    /// Print one JSON object per line per measurement instead of the table.
    #[arg(long)]
    json: bool,
    /// Also write the JSON lines to this file.
    #[arg(long, value_name = "FILE")]
    json_out: Option<PathBuf>,
    /// Write an SVG plot of throughput and latency against message size.
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
    /// Rounds per measurement point (the median is reported); default 5, 1 with --quick.
    #[arg(long)]
    rounds: Option<usize>,
    /// `shm`: this host's shared-memory fabric (every workload); `roce`: two network
    /// namespaces joined by veth with software RoCEv2 devices (root; created and removed by
    /// the bench): a stream over SMC-R against TCP on the same veth.
    #[arg(long, default_value = "shm", value_parser = ["shm", "roce"])]
    fabric: String,
    /// With `--fabric roce`: the veth pair's MTU, bytes (1500: a RoCE path MTU of 1,024;
    /// 4176 or more: 4,096, as RoCE networks with jumbo frames run). TCP runs over the same
    /// veth.
    #[arg(long, value_name = "BYTES", value_parser = crate::roce_netns::parse_mtu)]
    mtu: Option<u32>,
    /// Measure nothing: read the results from a JSON lines file of an earlier run (for the
    /// table and the plot).
    #[arg(long, value_name = "FILE")]
    from: Option<PathBuf>,
    /// Receive buffer (RMBE) size of every SMC-R connection, bytes; default: the stack's.
    #[arg(long)]
    buffer: Option<u32>,
    /// Longest adaptive spin of blocked SMC-R reads and writes without busy polling, µs, on
    /// both ends (0: off); default: the stack's.
    #[arg(long, value_name = "US")]
    adaptive_spin_us: Option<u64>,
    /// Only these tests (comma-separated: stream, pingpong, connect, multistream, idle,
    /// fallback); default all.
    #[arg(long, value_delimiter = ',')]
    tests: Vec<String>,
    /// Stream counts of the multistream test (comma-separated); default 1,4,16,256.
    #[arg(long, value_delimiter = ',', value_name = "N")]
    streams: Vec<usize>,
}

/// Arguments of the hidden `smc bench-server`.
pub use crate::bench_server::BenchServerArgs;

/// What a run measures and for how long.
struct Plan {
    rounds: usize,
    stream_sizes: Vec<usize>,
    stream_time: Duration,
    pingpong_sizes: Vec<usize>,
    pingpong_time: Duration,
    connect_time: Duration,
    first_contacts: usize,
    multistreams: Vec<usize>,
    multistream_time: Duration,
    idle_conns: usize,
    fallback_time: Duration,
}

/// Message size of the multistream and fallback tests.
const BULK: usize = 64 * 1024;

impl Plan {
    fn new(quick: bool, rounds: Option<usize>) -> Plan {
        let ms = Duration::from_millis;
        let stream_sizes = (0..=10).map(|i| 1usize << (2 * i)).collect();
        let pingpong_sizes = vec![1, 64, 1024, 16 * 1024, 64 * 1024];
        if quick {
            Plan {
                rounds: rounds.unwrap_or(1),
                stream_sizes,
                stream_time: ms(30),
                pingpong_sizes,
                pingpong_time: ms(30),
                connect_time: ms(100),
                first_contacts: 2,
                multistreams: vec![1, 4, 16, 256],
                multistream_time: ms(50),
                idle_conns: 16,
                fallback_time: ms(30),
            }
        } else {
            Plan {
                rounds: rounds.unwrap_or(5),
                stream_sizes,
                stream_time: ms(400),
                pingpong_sizes,
                pingpong_time: ms(300),
                connect_time: ms(1000),
                first_contacts: 10,
                multistreams: vec![1, 4, 16, 256],
                multistream_time: ms(500),
                idle_conns: 256,
                fallback_time: ms(400),
            }
        }
    }
}

impl Plan {
    /// The multistream test with these stream counts (`--streams`; empty: the default ones).
    fn with_streams(mut self, streams: &[usize]) -> Result<Plan> {
        if streams.contains(&0) {
            bail!("--streams: a stream count must be at least 1");
        }
        if !streams.is_empty() {
            self.multistreams = streams.to_vec();
        }
        Ok(self)
    }
}

/// One measurement of one transport.
#[derive(Debug, Clone, Copy)]
enum Job {
    Idle(Transport),
    Stream(Transport, usize),
    PingPong(Transport, usize, bool),
    Connect(Transport),
    FirstContact,
    Multi(Transport, usize),
    Fallback(Transport),
    /// The stream floor (module [`bench_floor`]).
    FloorStream(usize),
    /// The ping-pong floor, busy or blocking.
    FloorPingPong(usize, bool),
    /// The connect floor: TCP with the CLC message pattern.
    FloorConnect,
}

fn jobs(plan: &Plan, wanted: &dyn Fn(&str) -> bool) -> Vec<Job> {
    let mut v = Vec::new();
    // Every round: each transport and the floor if the test has one, the order rotated by one
    // place per round, so that no transport always goes first (right after another test,
    // or right after a given other transport).
    let alternate =
        |v: &mut Vec<Job>, rounds: usize, f: &dyn Fn(Transport) -> Job, floor: Option<Job>| {
            let mut round: Vec<Job> = Transport::ALL.iter().map(|&t| f(t)).collect();
            round.extend(floor);
            for r in 0..rounds {
                let k = r % round.len();
                v.extend(round[k..].iter().chain(&round[..k]).copied());
            }
        };
    // Idle memory first: later tests leave buffers in the stacks' pools, which would hide
    // what a new connection costs. One round: a second one would reuse the first's buffers.
    if wanted("idle") {
        alternate(&mut v, 1, &Job::Idle, None);
    }
    if wanted("stream") {
        for &s in &plan.stream_sizes {
            let floor = Some(Job::FloorStream(s));
            alternate(&mut v, plan.rounds, &|t| Job::Stream(t, s), floor);
        }
    }
    if wanted("pingpong") {
        for busy in [false, true] {
            for &s in &plan.pingpong_sizes {
                let floor = Some(Job::FloorPingPong(s, busy));
                alternate(&mut v, plan.rounds, &|t| Job::PingPong(t, s, busy), floor);
            }
        }
    }
    if wanted("connect") {
        alternate(&mut v, plan.rounds, &Job::Connect, Some(Job::FloorConnect));
        v.push(Job::FirstContact);
    }
    if wanted("multistream") {
        for &n in &plan.multistreams {
            alternate(&mut v, plan.rounds, &|t| Job::Multi(t, n), None);
        }
    }
    if wanted("fallback") {
        // Twice the rounds, each order as often: the row compares two TCP streams of the same
        // cost against a 2 % goal, finer than the run-to-run noise of one TCP stream (±10 %
        // here), and with an odd count one order would be the median's majority.
        for r in 0..2 * plan.rounds {
            let (first, second) = if r % 2 == 0 {
                (Transport::Smc, Transport::Tcp)
            } else {
                (Transport::Tcp, Transport::Smc)
            };
            v.push(Job::Fallback(first));
            v.push(Job::Fallback(second));
        }
    }
    v
}

/// CPU seconds (user + system) a process used so far, from `/proc/<pid>/stat`.
fn cpu_seconds(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name (field 2) may contain spaces; the fields after it are plain.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("/proc stat format")?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 (utime) and 15 (stime), counted from field 3 right after the name.
    let ticks = |i: usize| -> Result<f64> {
        Ok(f.get(i).context("/proc stat format")?.parse::<u64>()? as f64)
    };
    // USER_HZ is 100 on every Linux architecture the fabric runs on.
    Ok((ticks(11)? + ticks(12)?) / 100.0)
}

/// Resident set size of a process in bytes, from `/proc/<pid>/statm`.
fn rss_bytes(pid: u32) -> Result<u64> {
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm"))?;
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .context("/proc statm format")?
        .parse()?;
    Ok(pages * 4096)
}

/// The transport name of the floor measurements.
const FLOOR: &str = "floor";

/// The ping-pong samples of sorted round-trip times (µs).
fn rtt_samples(transport: &'static str, size: usize, busy: bool, rtts: Vec<f64>) -> Vec<Sample> {
    let mode = if busy { "busy" } else { "blocking" };
    let s = Sample::new(transport, "pingpong", size, mode, 1);
    vec![
        s.with("rtt_p50_us", percentile(&rtts, 50.0)),
        s.with("rtt_p99_us", percentile(&rtts, 99.0)),
        s.with("rtt_p999_us", percentile(&rtts, 99.9)),
    ]
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

struct Bench {
    plan: Plan,
    client_cfg: StackConfig,
    stack: Stack,
    fallback_stack: Stack,
    fallback_discovery: &'static str,
    smc: Server,
    tcp: Server,
    uds: Server,
}

impl Bench {
    fn server(&self, t: Transport) -> &Server {
        match t {
            Transport::Smc => &self.smc,
            Transport::Tcp => &self.tcp,
            Transport::Uds => &self.uds,
        }
    }

    fn connect(&self, t: Transport) -> Result<Conn> {
        Ok(match t {
            Transport::Smc => {
                let s = SmcStream::connect_with(&self.stack, ("127.0.0.1", self.smc.port))?;
                if s.mode() != Mode::Smc {
                    bail!("an smc connection ran as {}", s.mode());
                }
                Conn::Smc(s)
            }
            Transport::Tcp => Conn::Tcp(TcpStream::connect(("127.0.0.1", self.tcp.port))?),
            Transport::Uds => Conn::Uds(UnixStream::connect(
                self.uds.path.as_ref().context("uds path")?,
            )?),
        })
    }

    /// CPU seconds of this process and `t`'s server together.
    fn cpu(&self, t: Transport) -> Result<f64> {
        Ok(cpu_seconds(std::process::id())? + cpu_seconds(self.server(t).pid())?)
    }

    fn run(&self, job: Job) -> Result<Vec<Sample>> {
        match job {
            Job::Idle(t) => self.idle(t),
            Job::Stream(t, size) => {
                let c = self.connect(t)?;
                let (gbps, cpu) = self.stream(c, t, size, self.plan.stream_time)?;
                let s = Sample::new(t.name(), "stream", size, "blocking", 1);
                Ok(vec![s.with("gbps", gbps), s.with("cpu_s_per_gb", cpu)])
            }
            Job::PingPong(t, size, busy) => self.pingpong(t, size, busy),
            Job::Connect(t) => self.connect_rate(t.name(), &|| self.one_connect(t)),
            Job::FirstContact => self.first_contact(),
            Job::Multi(t, n) => self.multistream(t, n),
            Job::Fallback(t) => {
                let c = match t {
                    Transport::Smc => {
                        let s = SmcStream::connect_with(
                            &self.fallback_stack,
                            ("127.0.0.1", self.tcp.port),
                        )?;
                        if s.mode() == Mode::Smc {
                            bail!("the fallback connection ran over SMC-R");
                        }
                        Conn::Smc(s)
                    }
                    _ => self.connect(t)?,
                };
                // Both sides talk to the plain TCP server.
                let (gbps, cpu) = self.stream(c, Transport::Tcp, BULK, self.plan.fallback_time)?;
                let s = Sample::new(t.name(), "fallback", BULK, "blocking", 1);
                Ok(vec![s.with("gbps", gbps), s.with("cpu_s_per_gb", cpu)])
            }
            Job::FloorStream(size) => {
                // Both layouts, each for the whole window; the faster one is the floor.
                let capacity = usize::try_from(self.client_cfg.buffer_size)?;
                let cpu = || cpu_seconds(std::process::id());
                let time = self.plan.stream_time;
                let two = bench_floor::stream(Layout::TwoCores, size, capacity, time, &cpu)?;
                let one = bench_floor::stream(Layout::OneCore, size, capacity, time, &cpu)?;
                let (two_gbps, one_gbps) = (two.gbps(), one.gbps());
                let r = if one_gbps > two_gbps { one } else { two };
                let s = Sample::new(FLOOR, "stream", size, "blocking", 1);
                // Each layout's own rate too: the two-core one is what a writer and a reader
                // that both keep running can do, the one-core one has no switches at all.
                Ok(vec![
                    s.with("gbps", r.gbps()),
                    s.with("cpu_s_per_gb", r.cpu_s / (r.bytes as f64 / 1e9)),
                    s.with("gbps_two_cores", two_gbps),
                    s.with("gbps_one_core", one_gbps),
                ])
            }
            Job::FloorPingPong(size, busy) => {
                let rtts = bench_floor::pingpong(size, busy, |rt| self.round_trips(rt))?;
                Ok(rtt_samples(FLOOR, size, busy, rtts))
            }
            Job::FloorConnect => self.connect_rate(FLOOR, &|| self.one_handshake()),
        }
    }

    /// Stream `size`-byte writes for `time`; (Gbit/s, CPU seconds per GB of both processes).
    fn stream(
        &self,
        mut c: Conn,
        server: Transport,
        size: usize,
        time: Duration,
    ) -> Result<(f64, f64)> {
        c.write_full(&header(Op::Stream, false, size)?)?;
        let buf = vec![0xa5u8; size];
        let cpu0 = self.cpu(server)?;
        let start = Instant::now();
        let deadline = start + time;
        let mut sent = 0u64;
        while Instant::now() < deadline {
            c.write_full(&buf)?;
            sent += size as u64;
        }
        c.shutdown_write()?;
        let mut count = [0u8; 8];
        if !c.read_full(&mut count)? {
            bail!("the server closed without a byte count");
        }
        let secs = start.elapsed().as_secs_f64();
        let cpu = self.cpu(server)? - cpu0;
        let got = u64::from_be_bytes(count);
        if got != sent {
            bail!("sent {sent} bytes, the server counted {got}");
        }
        let gb = sent as f64 / 1e9;
        Ok((gb * 8.0 / secs, cpu / gb))
    }

    fn pingpong(&self, t: Transport, size: usize, busy: bool) -> Result<Vec<Sample>> {
        let mut c = self.connect(t)?;
        if let Conn::Tcp(s) = &c {
            s.set_nodelay(true)?;
        }
        c.write_full(&header(Op::PingPong, busy, size)?)?;
        c.set_busy(busy)?;
        let mut buf = vec![0x5au8; size];
        let rtts = self.round_trips(&mut || {
            c.write_full(&buf)?;
            if !c.read_full(&mut buf)? {
                bail!("the server closed during ping-pong");
            }
            Ok(())
        })?;
        c.set_busy(false)?;
        c.shutdown_write()?;
        Ok(rtt_samples(t.name(), size, busy, rtts))
    }

    /// Round trips for the ping-pong window (after 5 uncounted ones, at least 20, at most a
    /// million); their times in µs, sorted. Each is timed with the TSC (`quanta`, about 10 ns
    /// a reading here against 27 for `Instant::now`), so that the clock adds as little as
    /// possible to a sub-microsecond round trip; the same for every transport.
    fn round_trips(&self, round_trip: &mut dyn FnMut() -> Result<()>) -> Result<Vec<f64>> {
        let clock = quanta::Clock::new();
        let mut rtts = Vec::new();
        let warmup = 5;
        let deadline = Instant::now() + self.plan.pingpong_time;
        let mut i = 0usize;
        while (i < warmup + 20 || Instant::now() < deadline) && rtts.len() < 1_000_000 {
            let t0 = clock.raw();
            round_trip()?;
            let t1 = clock.raw();
            if i >= warmup {
                rtts.push(clock.delta(t0, t1).as_secs_f64() * 1e6);
            }
            i += 1;
        }
        rtts.sort_by(f64::total_cmp);
        Ok(rtts)
    }

    /// One full setup: connect, the server accepts and answers a byte, close.
    fn one_connect(&self, t: Transport) -> Result<()> {
        let mut c = self.connect(t)?;
        c.write_full(&header(Op::Connect, false, 0)?)?;
        let mut b = [0u8; 1];
        if !c.read_full(&mut b)? {
            bail!("the server closed before answering");
        }
        Ok(())
    }

    /// The connect floor's setup: plain TCP to the TCP bench server with the messages of
    /// SMC-R's CLC handshake on a reused link group (Proposal, Accept, Confirm; the header is
    /// the Proposal's first 8 bytes), then the 1-byte answer, close.
    fn one_handshake(&self) -> Result<()> {
        let mut c = TcpStream::connect(("127.0.0.1", self.tcp.port))?;
        let mut proposal = [0u8; PROPOSAL];
        proposal[..8].copy_from_slice(&header(Op::Handshake, false, 0)?);
        c.write_all(&proposal)?;
        let mut accept = [0u8; ACCEPT];
        c.read_exact(&mut accept)?;
        // The Confirm has the Accept's size.
        c.write_all(&accept)?;
        let mut b = [0u8; 1];
        c.read_exact(&mut b)?;
        Ok(())
    }

    /// Setups per second by `one` for the connect window, after one uncounted setup.
    fn connect_rate(
        &self,
        name: &'static str,
        one: &dyn Fn() -> Result<()>,
    ) -> Result<Vec<Sample>> {
        // The first connection may create the link group; it is not counted.
        one()?;
        let start = Instant::now();
        let deadline = start + self.plan.connect_time;
        let mut n = 0u64;
        while n < 3 || Instant::now() < deadline {
            one()?;
            n += 1;
        }
        let rate = n as f64 / start.elapsed().as_secs_f64();
        Ok(vec![
            Sample::new(name, "connect", 0, "blocking", 1).with("conn_per_s", rate)
        ])
    }

    /// SMC-R first contact: every connection from a new stack (a new peer), so each one
    /// creates a link group (CONFIRM LINK, ADD LINK) on top of the CLC handshake.
    fn first_contact(&self) -> Result<Vec<Sample>> {
        let mut total = 0.0;
        for _ in 0..self.plan.first_contacts {
            let stack = Stack::new(self.client_cfg.clone())?;
            let t0 = Instant::now();
            let s = SmcStream::connect_with(&stack, ("127.0.0.1", self.smc.port))?;
            if s.mode() != Mode::Smc {
                bail!("a first-contact connection ran as {}", s.mode());
            }
            let mut c = Conn::Smc(s);
            c.write_full(&header(Op::Connect, false, 0)?)?;
            let mut b = [0u8; 1];
            if !c.read_full(&mut b)? {
                bail!("the server closed before answering");
            }
            total += t0.elapsed().as_secs_f64();
            drop(c);
        }
        let rate = self.plan.first_contacts as f64 / total;
        Ok(vec![
            Sample::new("smc", "connect", 0, "blocking", 1).with("first_contact_conn_per_s", rate)
        ])
    }

    fn multistream(&self, t: Transport, n: usize) -> Result<Vec<Sample>> {
        let mut conns = Vec::with_capacity(n);
        for _ in 0..n {
            let mut c = self.connect(t)?;
            c.write_full(&header(Op::Stream, false, BULK)?)?;
            conns.push(c);
        }
        let barrier = Barrier::new(n + 1);
        let time = self.plan.multistream_time;
        // One deadline for all streams, set by the first that starts. The rate is taken over
        // the streams' own first start to last end: the main thread may run late on a
        // machine with fewer cores than streams.
        let deadline = std::sync::OnceLock::new();
        let (secs, cpu, total) = std::thread::scope(|scope| -> Result<(f64, f64, u64)> {
            let handles: Vec<_> = conns
                .into_iter()
                .map(|mut c| {
                    let (barrier, deadline) = (&barrier, &deadline);
                    scope.spawn(move || -> Result<(u64, Instant, Instant)> {
                        let buf = vec![0xa5u8; BULK];
                        barrier.wait();
                        let start = Instant::now();
                        let deadline = *deadline.get_or_init(|| start + time);
                        let mut sent = 0u64;
                        while Instant::now() < deadline {
                            c.write_full(&buf)?;
                            sent += BULK as u64;
                        }
                        c.shutdown_write()?;
                        let mut count = [0u8; 8];
                        if !c.read_full(&mut count)? {
                            bail!("the server closed without a byte count");
                        }
                        let got = u64::from_be_bytes(count);
                        if got != sent {
                            bail!("sent {sent} bytes, the server counted {got}");
                        }
                        Ok((sent, start, Instant::now()))
                    })
                })
                .collect();
            let cpu0 = self.cpu(t)?;
            barrier.wait();
            let mut total = 0u64;
            let mut first: Option<Instant> = None;
            let mut last: Option<Instant> = None;
            for h in handles {
                let (sent, start, end) = h
                    .join()
                    .map_err(|_| anyhow::anyhow!("a stream thread panicked"))??;
                total += sent;
                first = Some(first.map_or(start, |f| f.min(start)));
                last = Some(last.map_or(end, |l| l.max(end)));
            }
            let secs = match (first, last) {
                (Some(f), Some(l)) => l.duration_since(f).as_secs_f64(),
                _ => f64::NAN,
            };
            Ok((secs, self.cpu(t)? - cpu0, total))
        })?;
        let gb = total as f64 / 1e9;
        let s = Sample::new(t.name(), "multistream", BULK, "blocking", n);
        Ok(vec![
            s.with("gbps", gb * 8.0 / secs),
            s.with("cpu_s_per_gb", cpu / gb),
        ])
    }

    /// Memory per idle connection: open N connections that then stay idle; the growth of
    /// both processes' resident set divided by N.
    fn idle(&self, t: Transport) -> Result<Vec<Sample>> {
        // A first connection sets up what every later one shares (the link group).
        self.one_connect(t)?;
        std::thread::sleep(Duration::from_millis(50));
        let server = self.server(t).pid();
        let me = std::process::id();
        let (c0, s0) = (rss_bytes(me)?, rss_bytes(server)?);
        let n = self.plan.idle_conns;
        let mut held = Vec::with_capacity(n);
        for _ in 0..n {
            let mut c = self.connect(t)?;
            c.write_full(&header(Op::Idle, false, 0)?)?;
            let mut b = [0u8; 1];
            if !c.read_full(&mut b)? {
                bail!("the server closed an idle connection");
            }
            held.push(c);
        }
        std::thread::sleep(Duration::from_millis(100));
        let (c1, s1) = (rss_bytes(me)?, rss_bytes(server)?);
        let mut r = self.connect(t)?;
        r.write_full(&header(Op::Release, false, 0)?)?;
        let mut b = [0u8; 1];
        r.read_full(&mut b)?;
        drop(held);
        let kib = |a: u64, b: u64| (b as f64 - a as f64) / 1024.0 / n as f64;
        let s = Sample::new(t.name(), "idle", 0, "blocking", n);
        Ok(vec![
            s.with("kib_per_idle_conn", kib(c0 + s0, c1 + s1)),
            s.with("kib_per_idle_conn_client", kib(c0, c1)),
            s.with("kib_per_idle_conn_server", kib(s0, s1)),
        ])
    }
}

/// The 1-minute load average (the machine may be shared; busy polling suffers most).
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".to_string())
}

/// Run `smc bench`.
pub fn run(args: &BenchArgs) -> Result<ExitCode> {
    if args.fabric == "roce" {
        let bytes = if args.quick { 64 << 20 } else { 512 << 20 };
        return crate::roce_netns::bench(
            bytes,
            args.rounds.unwrap_or(if args.quick { 1 } else { 3 }),
            args.mtu.unwrap_or(crate::roce_netns::DEFAULT_MTU),
        );
    }
    if args.mtu.is_some() {
        bail!("--mtu sets the veth pair of --fabric roce; the shm fabric has no MTU");
    }
    if let Some(from) = &args.from {
        let text =
            std::fs::read_to_string(from).with_context(|| format!("reading {}", from.display()))?;
        let results = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(bench_report::Sample::from_json_line)
            .collect::<Result<Vec<_>>>()
            .with_context(|| format!("reading {}", from.display()))?;
        report(
            args,
            &results,
            &format!("smc bench: results of {}", from.display()),
            &[],
        )?;
        return Ok(ExitCode::SUCCESS);
    }
    let dir = std::env::temp_dir().join(format!("smc-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = bench(args, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn bench(args: &BenchArgs, dir: &Path) -> Result<ExitCode> {
    const TESTS: [&str; 6] = [
        "stream",
        "pingpong",
        "connect",
        "multistream",
        "idle",
        "fallback",
    ];
    for t in &args.tests {
        if !TESTS.contains(&t.as_str()) {
            bail!("unknown test {t:?} (expected one of {})", TESTS.join(", "));
        }
    }
    let wanted = |name: &str| args.tests.is_empty() || args.tests.iter().any(|t| t == name);
    let plan = Plan::new(args.quick, args.rounds).with_streams(&args.streams)?;
    let mut client_cfg = StackConfig::new(smc::FabricConfig::with_dir(dir, 2));
    client_cfg.discovery = DiscoveryMode::AssertPeer;
    if let Some(b) = args.buffer {
        client_cfg.buffer_size = b;
    }
    let buffer = client_cfg.buffer_size;
    client_cfg.busy_poll = None;
    if let Some(us) = args.adaptive_spin_us {
        client_cfg.adaptive_spin = (us > 0).then(|| Duration::from_micros(us));
    }
    let spin = client_cfg.adaptive_spin.map_or(0, |d| d.as_micros());
    let smc = Server::spawn(Transport::Smc, dir, buffer, spin)?;
    let tcp = Server::spawn(Transport::Tcp, dir, buffer, spin)?;
    let uds = Server::spawn(Transport::Uds, dir, buffer, spin)?;
    let stack = Stack::new(client_cfg.clone())?;
    // The fallback client: the eBPF TCP option when it loads (the plain server does not
    // echo it: fallback "peer without option"), otherwise discovery off.
    let mut fb_cfg = client_cfg.clone();
    fb_cfg.discovery = DiscoveryMode::Ebpf;
    let (fallback_stack, fallback_discovery) = match Stack::new(fb_cfg.clone()) {
        Ok(s) => (s, "ebpf"),
        Err(_) => {
            fb_cfg.discovery = DiscoveryMode::Off;
            (Stack::new(fb_cfg)?, "off")
        }
    };
    let b = Bench {
        plan,
        client_cfg,
        stack,
        fallback_stack,
        fallback_discovery,
        smc,
        tcp,
        uds,
    };
    let jobs = jobs(&b.plan, &wanted);
    let pb = if args.json || !std::io::stderr().is_terminal() {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(jobs.len() as u64)
    };
    pb.set_style(
        ProgressStyle::with_template("{bar:40.cyan/blue} {pos}/{len} {elapsed} {msg}")
            .map_err(|e| anyhow::anyhow!("{e}"))?,
    );
    let load_before = loadavg();
    let started = Instant::now();
    let mut raw = Vec::new();
    // A failed measurement (a connection reset, say) is reported and tried again on a new
    // connection, up to three attempts; the run goes on either way and fails at the end if a
    // point is missing.
    let mut failures: Vec<String> = Vec::new();
    let mut missing = 0usize;
    for job in jobs {
        pb.set_message(format!("{job:?}"));
        for attempt in 1..=3 {
            match b.run(job) {
                Ok(samples) => {
                    raw.extend(samples);
                    break;
                }
                Err(e) => {
                    let msg = format!("{job:?} (attempt {attempt}): {e:#}");
                    pb.suspend(|| eprintln!("smc bench: measurement failed: {msg}"));
                    failures.push(msg);
                    if attempt == 3 {
                        missing += 1;
                    }
                }
            }
        }
        pb.inc(1);
    }
    pb.finish_and_clear();
    let paired = bench_report::fallback_paired_ratio(&raw);
    let mut results = bench_report::medians(raw);
    results.extend(paired);
    let summary = format!(
        "smc bench: {} rounds per point, median shown; SMC-R RMBE {} bytes, adaptive spin {} µs; \
         fallback client discovery: {}; {:.0} s; load average {} before, {} after",
        b.plan.rounds,
        b.client_cfg.buffer_size,
        spin,
        b.fallback_discovery,
        started.elapsed().as_secs_f64(),
        load_before,
        loadavg(),
    );
    drop(b);
    report(args, &results, &summary, &failures)?;
    if missing > 0 {
        eprintln!("smc bench: {missing} measurements failed three times and are missing");
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

/// Print (table or JSON lines) and write (JSON lines file, plot) the results.
fn report(args: &BenchArgs, results: &[Sample], summary: &str, failures: &[String]) -> Result<()> {
    let lines: Vec<String> = results.iter().map(Sample::json_line).collect();
    if let Some(p) = &args.json_out {
        let mut f =
            std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?;
        for l in &lines {
            writeln!(f, "{l}")?;
        }
    }
    let mut out = std::io::stdout().lock();
    if args.json {
        for l in &lines {
            writeln!(out, "{l}")?;
        }
    } else {
        writeln!(out, "{summary}")?;
        writeln!(out)?;
        writeln!(out, "{}", bench_report::table(results))?;
        if !failures.is_empty() {
            writeln!(out)?;
            writeln!(out, "{} measurement attempts failed:", failures.len())?;
            writeln!(out)?;
            for f in failures {
                writeln!(out, "- {f}")?;
            }
        }
    }
    if let Some(p) = &args.plot {
        crate::bench_plot::plot(results, p)
            .with_context(|| format!("writing the plot {}", p.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The order of the transports rotates from round to round: each goes first once in as
    /// many rounds as there are transports (the floor included).
    #[test]
    fn rounds_rotate_the_order_of_the_transports() {
        let plan = Plan::new(true, Some(4));
        let v = jobs(&plan, &|t| t == "connect");
        let firsts: Vec<String> = v.chunks(4).take(4).map(|r| format!("{:?}", r[0])).collect();
        let mut unique = firsts.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), 4, "{firsts:?}");
        let fb = jobs(&plan, &|t| t == "fallback");
        let first = |i: usize| format!("{:?}", fb[i]);
        assert_ne!(first(0), first(2), "{fb:?}");
        assert_eq!(first(0), first(4), "{fb:?}");
    }

    /// `--streams` replaces the multistream test's stream counts; a count of 0 is refused.
    #[test]
    fn streams_choose_the_multistream_counts() {
        let counts = |plan: &Plan| -> Vec<usize> {
            let mut n: Vec<usize> = jobs(plan, &|t| t == "multistream")
                .iter()
                .filter_map(|j| match j {
                    Job::Multi(_, n) => Some(*n),
                    _ => None,
                })
                .collect();
            n.dedup();
            n
        };
        let default = Plan::new(true, Some(1)).with_streams(&[]).expect("default");
        assert_eq!(counts(&default), [1, 4, 16, 256]);
        let only = Plan::new(true, Some(2)).with_streams(&[256]).expect("256");
        assert_eq!(counts(&only), [256]);
        assert_eq!(
            jobs(&only, &|t| t == "multistream").len(),
            2 * Transport::ALL.len()
        );
        assert!(Plan::new(true, None).with_streams(&[4, 0]).is_err());
    }
}
