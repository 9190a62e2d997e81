//! `smc demo`: a server and a client process on a private shm fabric; the link group with its
//! two links; a transfer with a progress bar during which one link is taken down (fault
//! injection) and the data fails over; the checksum checked end to end; the same transfer
//! over plain TCP loopback for comparison.
//!
//! The server is this binary again (`smc demo-server`, hidden). Protocol per connection: the
//! client sends the length (8 bytes, big endian) and the bytes; the server answers with the
//! CRC-32 of what it received (4 bytes, big endian).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use comfy_table::Table;
use indicatif::{ProgressBar, ProgressStyle};
use smc::{DiscoveryMode, PortState, SmcListener, SmcStream, Stack, StackConfig};

/// Arguments of `smc demo`.
#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Bytes to transfer (suffixes K, M, G).
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    bytes: u64,
    /// Take the connection's link down after this percentage of the transfer (0: never).
    #[arg(long, default_value_t = 40)]
    fail_at: u8,
    /// Receive buffer (RMBE) size per connection (suffixes K, M).
    #[arg(long, default_value = "512K", value_parser = parse_size)]
    buffer: u64,
    /// Busy polling in both processes: blocked reads and writes spin this many microseconds
    /// on the completion queues before sleeping (0: off).
    #[arg(long, default_value_t = 0)]
    busy_poll_us: u64,
    /// No progress bar (for scripts and tests).
    #[arg(long)]
    quiet: bool,
    /// Write a pcap capture of the client's SMC-R connection (CLC as TCP, LLC/CDC as RoCEv2
    /// SENDs; `smc decode FILE` or Wireshark read it).
    #[arg(long, value_name = "FILE")]
    pcap: Option<PathBuf>,
    /// `shm`: two processes on this host's shared-memory fabric; `roce`: two network
    /// namespaces joined by two veth pairs with software RoCEv2 devices (root; created and
    /// removed by the demo; `--fail-at` takes one veth pair down).
    #[arg(long, default_value = "shm", value_parser = ["shm", "roce"])]
    fabric: String,
    /// With `--fabric roce`: the veth pairs' MTU, bytes (1500: a RoCE path MTU of 1,024;
    /// 4176 or more: 4,096).
    #[arg(long, value_name = "BYTES", value_parser = crate::roce_netns::parse_mtu)]
    mtu: Option<u32>,
}

/// Arguments of the hidden `smc demo-server`.
#[derive(Args, Debug)]
pub struct DemoServerArgs {}

fn parse_size(s: &str) -> Result<u64, String> {
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .ok_or_else(|| format!("not a size: {s:?}"))
}

/// The demo server: prints `PORT n`, then checks every connection's data until stdin closes.
pub fn run_server(_args: &DemoServerArgs) -> Result<ExitCode> {
    let stack = Stack::global().context("starting the SMC-R stack")?;
    let l = SmcListener::bind_with(&stack, "127.0.0.1:0")?;
    println!("PORT {}", l.local_addr()?.port());
    std::io::stdout().flush()?;
    std::thread::spawn(|| {
        let mut buf = [0u8; 16];
        while matches!(std::io::stdin().read(&mut buf), Ok(n) if n > 0) {}
        std::process::exit(0);
    });
    for s in l.incoming() {
        match s {
            Ok(s) => {
                std::thread::spawn(move || {
                    if let Err(e) = serve(s) {
                        eprintln!("smc demo-server: {e:#}");
                    }
                });
            }
            Err(e) => eprintln!("smc demo-server: accept: {e}"),
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn serve(mut s: SmcStream) -> Result<()> {
    let mut len = [0u8; 8];
    s.read_exact(&mut len)?;
    let mut left = u64::from_be_bytes(len);
    let mut crc = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 256 * 1024];
    while left > 0 {
        let want = usize::try_from(left.min(buf.len() as u64))?;
        let n = s.read(&mut buf[..want])?;
        if n == 0 {
            bail!("connection closed with {left} bytes missing");
        }
        crc.update(&buf[..n]);
        left -= n as u64;
    }
    s.write_all(&crc.finalize().to_be_bytes())?;
    s.shutdown(Shutdown::Write)?;
    Ok(())
}

struct Server {
    child: Child,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

fn spawn_server(dir: &PathBuf, buffer: u64, busy_poll_us: u64) -> Result<Server> {
    let mut child = Command::new(std::env::current_exe()?)
        .arg("demo-server")
        .env("SMC_BUSY_POLL_US", busy_poll_us.to_string())
        .env("SMC_FABRIC_DIR", dir)
        .env("SMC_DISCOVERY", "assert-peer")
        .env("SMC_BUFFER_SIZE", buffer.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the server process")?;
    let out = child.stdout.take().context("server stdout")?;
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line)?;
    let port = line
        .trim()
        .strip_prefix("PORT ")
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("server said {line:?}"))?;
    Ok(Server { child, port })
}

fn link_table(stack: &Stack) -> Table {
    let mut t = Table::new();
    t.set_header(vec![
        "link group",
        "role",
        "peer",
        "link",
        "device",
        "state",
    ]);
    for g in stack.link_groups() {
        for l in &g.links {
            t.add_row(vec![
                g.id.to_string(),
                if g.server { "server" } else { "client" }.to_string(),
                g.peer.clone(),
                l.num.to_string(),
                l.device.clone(),
                if l.active { "active" } else { "activating" }.to_string(),
            ]);
        }
    }
    t
}

/// Deterministic bytes for the transfer.
fn pattern(len: usize) -> Vec<u8> {
    let mut x: u32 = 0x1234_5678;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

/// Send `total` bytes over `s`; calls `at_fail` once when `fail_at` bytes are sent. Returns
/// (our CRC-32, the server's CRC-32, elapsed time).
fn transfer<S: Read + Write>(
    s: &mut S,
    total: u64,
    fail_at: Option<u64>,
    mut at_fail: impl FnMut(),
    pb: &ProgressBar,
) -> Result<(u32, u32, Duration)> {
    let data = pattern(1 << 20);
    let start = Instant::now();
    s.write_all(&total.to_be_bytes())?;
    let mut crc = crc32fast::Hasher::new();
    let mut sent = 0u64;
    let mut failed = false;
    let chunk = 64 * 1024;
    while sent < total {
        let off = (sent % (data.len() as u64)) as usize;
        let n = usize::try_from((total - sent).min(chunk as u64))?.min(data.len() - off);
        let piece = &data[off..off + n];
        s.write_all(piece)?;
        crc.update(piece);
        sent += n as u64;
        pb.set_position(sent);
        if !failed && fail_at.is_some_and(|f| sent >= f) {
            failed = true;
            at_fail();
        }
    }
    let mut back = [0u8; 4];
    s.read_exact(&mut back)?;
    Ok((crc.finalize(), u32::from_be_bytes(back), start.elapsed()))
}

fn rate(bytes: u64, d: Duration) -> String {
    format!(
        "{:.1} MB/s",
        bytes as f64 / d.as_secs_f64().max(1e-9) / 1_000_000.0
    )
}

/// Run `smc demo`.
pub fn run(args: &DemoArgs) -> Result<ExitCode> {
    if args.fabric == "roce" {
        return crate::roce_netns::demo(
            args.bytes,
            args.fail_at,
            args.mtu.unwrap_or(crate::roce_netns::DEFAULT_MTU),
        );
    }
    if args.mtu.is_some() {
        bail!("--mtu sets the veth pairs of --fabric roce; the shm fabric has no MTU");
    }
    let dir = std::env::temp_dir().join(format!("smc-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = demo(args, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn demo(args: &DemoArgs, dir: &PathBuf) -> Result<ExitCode> {
    let server = spawn_server(dir, args.buffer, args.busy_poll_us)?;
    let mut cfg = StackConfig::new(smc_fabric_config(dir));
    cfg.discovery = DiscoveryMode::AssertPeer;
    cfg.buffer_size = u32::try_from(args.buffer).context("buffer size")?;
    cfg.busy_poll = (args.busy_poll_us > 0).then(|| Duration::from_micros(args.busy_poll_us));
    let stack = Stack::new(cfg)?;
    println!(
        "server process {} and client process {} on the shm fabric in {}",
        server.child.id(),
        std::process::id(),
        dir.display()
    );
    if let Some(p) = &args.pcap {
        stack
            .start_capture(p)
            .with_context(|| format!("creating {}", p.display()))?;
    }
    let mut s = SmcStream::connect_with(&stack, ("127.0.0.1", server.port))?;
    println!("connection: {}", s.mode());
    if s.mode() != smc::Mode::Smc {
        bail!("the demo connection did not run over SMC-R");
    }
    println!("{}", link_table(&stack));

    let pb = if args.quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(args.bytes)
    };
    pb.set_style(
        ProgressStyle::with_template(
            "{bar:40.cyan/blue} {bytes}/{total_bytes} {bytes_per_sec} {msg}",
        )
        .map_err(|e| anyhow::anyhow!("{e}"))?,
    );
    let fail_at = (args.fail_at > 0 && args.fail_at < 100)
        .then(|| args.bytes / 100 * u64::from(args.fail_at));
    let mut downed = None;
    let link = s.send_link();
    let stack2 = stack.clone();
    let pb2 = pb.clone();
    let (ours, theirs, smc_time) = transfer(
        &mut s,
        args.bytes,
        fail_at,
        || {
            // Taken down mid-stream, with writes and CDCs in flight: RFC 7609 §4.6.1 failover
            // replays what the peer has not confirmed on the surviving link.
            if let Some((_, dev)) = &link {
                let msg = format!(
                    "fault injection: taking {dev} (the link this connection sends on) down"
                );
                if pb2.is_hidden() {
                    println!("{msg}");
                } else {
                    pb2.println(msg);
                }
                stack2.set_port_state(dev, PortState::Down);
                downed = Some(dev.clone());
            }
        },
        &pb,
    )?;
    pb.finish_and_clear();
    if let Some(dev) = &downed {
        // Give the link group a moment to report the failed link, then show it.
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline && stack.link_groups().iter().any(|g| g.links.len() > 1) {
            std::thread::sleep(Duration::from_millis(20));
        }
        println!("after taking {dev} down:");
        println!("{}", link_table(&stack));
        if let Some((_, now_on)) = s.send_link() {
            println!("the connection now sends on {now_on}");
        }
    }
    if ours != theirs {
        bail!("checksum mismatch: sent crc32 {ours:08x}, server got {theirs:08x}");
    }
    println!(
        "{} bytes over SMC-R, checksum intact (crc32 {ours:08x})",
        args.bytes
    );
    drop(s);
    if let Some(p) = &args.pcap {
        let frames = stack.stop_capture()?;
        println!("capture: {frames} frames written to {}", p.display());
    }

    let mut tcp = TcpStream::connect(("127.0.0.1", server.port))?;
    let (ours, theirs, tcp_time) =
        transfer(&mut tcp, args.bytes, None, || {}, &ProgressBar::hidden())?;
    if ours != theirs {
        bail!("checksum mismatch over TCP");
    }
    let mut t = Table::new();
    t.set_header(vec!["transport", "bytes", "time", "throughput"]);
    t.add_row(vec![
        format!(
            "SMC-R (shm){}",
            if downed.is_some() {
                ", with failover"
            } else {
                ""
            }
        ),
        args.bytes.to_string(),
        format!("{:.3} s", smc_time.as_secs_f64()),
        rate(args.bytes, smc_time),
    ]);
    t.add_row(vec![
        "TCP loopback".to_string(),
        args.bytes.to_string(),
        format!("{:.3} s", tcp_time.as_secs_f64()),
        rate(args.bytes, tcp_time),
    ]);
    println!("{t}");
    println!(
        "(each time runs from the first byte written until the server's CRC-32 of all {} bytes \
         arrived back; one 1 MiB pattern, written in 64 KiB pieces{})",
        args.bytes,
        match (&downed, fail_at) {
            (Some(dev), Some(at)) =>
                format!("; the SMC-R time includes losing {dev} after {at} bytes and the failover"),
            _ => String::new(),
        }
    );
    Ok(ExitCode::SUCCESS)
}

fn smc_fabric_config(dir: &PathBuf) -> smc::FabricConfig {
    smc::FabricConfig::with_dir(dir, 2)
}
