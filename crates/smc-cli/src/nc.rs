//! `smc nc`: netcat over smc-rs. stdin → socket → stdout; at stdin EOF the write side is shut
//! down (the peer reads EOF); the command ends when the peer's side ends.

use std::io::{Read, Write};
use std::net::Shutdown;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use smc::{SmcListener, SmcStream, Stack};

/// Arguments of `smc nc`.
#[derive(Args, Debug)]
pub struct NcArgs {
    /// Listen on PORT instead of connecting (`smc nc -l PORT`).
    #[arg(short = 'l', long = "listen", value_name = "PORT")]
    listen: Option<u16>,
    /// Listener: echo every client back to itself, any number at once, until killed.
    #[arg(long, requires = "listen")]
    echo: bool,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    bind: String,
    /// Print the connection mode (SMC-R or TCP and why) and addresses on stderr; a listener
    /// also says how many bytes it received, in how long from the first to the end of stream,
    /// and both ends say how much CPU time their process took while the stream ran.
    #[arg(short, long)]
    verbose: bool,
    /// Client: instead of copying stdin, send SIZE bytes and wait for SIZE bytes back (from an
    /// echo listener), again and again for `--time`; print round-trip latencies on stdout.
    #[arg(long, value_name = "SIZE", conflicts_with = "listen")]
    pingpong: Option<usize>,
    /// How long `--pingpong` runs, in seconds.
    #[arg(long, default_value_t = 2.0, requires = "pingpong")]
    time: f64,
    /// Host to connect to.
    host: Option<String>,
    /// Port to connect to.
    port: Option<u16>,
}

/// Run `smc nc`.
pub fn run(args: &NcArgs) -> Result<ExitCode> {
    exit_on_termination_signals()?;
    let stack = Stack::global().context("starting the SMC-R stack")?;
    if let Some(why) = stack.fabric_unavailable() {
        eprintln!("smc nc: warning: SMC-R unavailable, connections use TCP: {why}");
    }
    match (args.listen, &args.host, args.port) {
        (Some(port), None, None) => listen(&stack, args, port),
        (None, Some(host), Some(port)) => {
            let s = SmcStream::connect_with(&stack, (host.as_str(), port))
                .with_context(|| format!("connecting to {host}:{port}"))?;
            report(args, &s);
            match args.pingpong {
                Some(size) => pingpong(s, size, Duration::from_secs_f64(args.time.max(0.0)))?,
                None => {
                    let cpu = process_cpu();
                    pump(s)?;
                    report_cpu(args, cpu);
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        _ => bail!("usage: smc nc -l PORT [--echo] | smc nc HOST PORT"),
    }
}

/// SIGTERM, SIGINT and SIGHUP end `smc nc` through `exit`, as its normal end does, instead
/// of the signals' default action: `exit` runs the stack's exit handler, which sends the
/// peer a DELETE LINK for every RoCE link group (and resets the connections still on them),
/// so that a killed listener's clients learn it at once rather than after the keepalive
/// timeout. The exit status is the shell's for a death by that signal (128 + number).
fn exit_on_termination_signals() -> Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP])
        .context("installing the SIGTERM/SIGINT/SIGHUP handlers")?;
    std::thread::Builder::new()
        .name("smc-nc-signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                std::process::exit(128 + sig);
            }
        })
        .context("starting the signal thread")?;
    Ok(())
}

fn report(args: &NcArgs, s: &SmcStream) {
    if args.verbose {
        let peer = s
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        eprintln!("smc nc: connected to {peer} over {}", s.mode());
    }
}

fn listen(stack: &Stack, args: &NcArgs, port: u16) -> Result<ExitCode> {
    let l = SmcListener::bind_with(stack, (args.bind.as_str(), port))
        .with_context(|| format!("binding {}:{port}", args.bind))?;
    // Always said, so that scripts (and tests) can learn an ephemeral port.
    eprintln!("smc nc: listening on {}", l.local_addr()?);
    if args.echo {
        for s in l.incoming() {
            let s = match s {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("smc nc: accept: {e}");
                    continue;
                }
            };
            report(args, &s);
            std::thread::spawn(move || echo(s));
        }
        return Ok(ExitCode::SUCCESS);
    }
    let (s, _) = l.accept().context("accepting")?;
    report(args, &s);
    let cpu = process_cpu();
    let received = pump(s)?;
    if args.verbose {
        if let Some((bytes, secs)) = received.rate() {
            // Read by `smc bench --fabric roce` (the transfer rate without process start
            // and exit).
            eprintln!(
                "smc nc: received {bytes} bytes in {secs:.6} s (first byte to end of stream, {:.1} MB/s)",
                bytes as f64 / secs / 1e6
            );
        }
    }
    report_cpu(args, cpu);
    Ok(ExitCode::SUCCESS)
}

/// The CPU time the whole process has taken so far: every thread, the stack's helpers too
/// (`CLOCK_PROCESS_CPUTIME_ID`).
fn process_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    Duration::new(
        u64::try_from(t.tv_sec).unwrap_or(0),
        u32::try_from(t.tv_nsec).unwrap_or(0),
    )
}

/// `-v`: the CPU time the process took since `from` (the stream's start), on stderr. Read by
/// `smc bench --fabric roce` (CPU per byte of each end).
fn report_cpu(args: &NcArgs, from: Duration) {
    if args.verbose {
        let cpu = process_cpu().saturating_sub(from);
        eprintln!(
            "smc nc: CPU while the stream ran: {:.6} s",
            cpu.as_secs_f64()
        );
    }
}

/// Echo one client until it shuts down its write side, then shut down ours.
fn echo(mut s: SmcStream) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if s.write_all(&buf[..n]).is_err() {
                    return;
                }
            }
            Err(_) => return,
        }
    }
    let _ = s.shutdown(Shutdown::Write);
}

/// What [`pump`] read from the connection: bytes, and when the first and the last read
/// returned (the last one being the end of stream).
struct Received {
    bytes: u64,
    first: Option<Instant>,
    end: Instant,
}

impl Received {
    /// Bytes and seconds from the first byte to the end of stream, when anything came.
    fn rate(&self) -> Option<(u64, f64)> {
        let secs = self.end.duration_since(self.first?).as_secs_f64();
        (self.bytes > 0 && secs > 0.0).then_some((self.bytes, secs))
    }
}

/// stdin → socket in a thread (shutdown(WR) at EOF), socket → stdout here until EOF; ends
/// when both directions are done (or the connection fails). A failed write (the peer died
/// mid-upload) or read of either direction is the command's error: nonzero exit, a message.
fn pump(mut s: SmcStream) -> Result<Received> {
    let mut w = s.try_clone()?;
    let writer = std::thread::spawn(move || -> Result<()> {
        let mut stdin = std::io::stdin().lock();
        let mut buf = vec![0u8; 64 * 1024];
        let mut sent = 0u64;
        loop {
            let n = match stdin.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e).context("reading standard input"),
            };
            w.write_all(&buf[..n]).map_err(|e| write_error(e, sent))?;
            sent += n as u64;
        }
        w.flush().map_err(|e| write_error(e, sent))?;
        // The peer may be gone already (it ended its side first): its end of stream was
        // read, nothing is lost by a failed shutdown.
        let _ = w.shutdown(Shutdown::Write);
        Ok(())
    });
    let mut out = std::io::stdout().lock();
    let mut buf = vec![0u8; 64 * 1024];
    let (mut bytes, mut first) = (0u64, None);
    let read = loop {
        match s.read(&mut buf) {
            Ok(0) => break Ok(()),
            Ok(n) => {
                first.get_or_insert_with(Instant::now);
                bytes += n as u64;
                out.write_all(&buf[..n])?
            }
            Err(e) => break Err(e).context("reading from the connection"),
        }
    };
    let end = Instant::now();
    out.flush()?;
    drop(out);
    // A reset connection fails both directions: the first error said is the read's, the
    // writer (blocked on a dead peer) then fails too and is not waited for in vain.
    read?;
    writer
        .join()
        .map_err(|_| anyhow::anyhow!("the stdin thread panicked"))??;
    Ok(Received { bytes, first, end })
}

/// `--pingpong SIZE`: round trips of SIZE bytes through an echo listener for `time`; the
/// echoed bytes are checked against the sent ones. Prints one line on stdout:
/// `pingpong SIZE round_trips N p50_us X p99_us Y mean_us Z`.
fn pingpong(mut s: SmcStream, size: usize, time: Duration) -> Result<()> {
    if size == 0 {
        bail!("--pingpong needs a size of at least one byte");
    }
    let _ = s.set_nodelay(true);
    let mut out = vec![0u8; size];
    let mut back = vec![0u8; size];
    let mut rtts: Vec<Duration> = Vec::new();
    let start = Instant::now();
    let mut round: u64 = 0;
    while start.elapsed() < time || rtts.is_empty() {
        for (i, b) in out.iter_mut().enumerate() {
            *b = (round as usize).wrapping_add(i) as u8;
        }
        let t = Instant::now();
        s.write_all(&out)
            .map_err(|e| write_error(e, round * size as u64))?;
        s.read_exact(&mut back)
            .context("reading the echo from the connection")?;
        rtts.push(t.elapsed());
        if back != out {
            bail!("round trip {round}: the echoed bytes differ from the sent ones");
        }
        round += 1;
    }
    let _ = s.shutdown(Shutdown::Write);
    let total: Duration = rtts.iter().sum();
    let mean = total / rtts.len() as u32;
    rtts.sort();
    let pct = |p: usize| rtts[(rtts.len() * p / 100).min(rtts.len() - 1)];
    println!(
        "pingpong {size} round_trips {} p50_us {:.1} p99_us {:.1} mean_us {:.1}",
        rtts.len(),
        pct(50).as_secs_f64() * 1e6,
        pct(99).as_secs_f64() * 1e6,
        mean.as_secs_f64() * 1e6
    );
    Ok(())
}

/// A failed write to the connection, as a message: not an `io::Error` the caller could take
/// for a closed standard output (which `main` ends quietly), as EPIPE from a dead peer is.
fn write_error(e: std::io::Error, sent: u64) -> anyhow::Error {
    anyhow::anyhow!("writing to the connection after {sent} bytes: {e}")
}
