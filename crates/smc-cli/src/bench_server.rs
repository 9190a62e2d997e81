//! The server process of `smc bench` (hidden `smc bench-server TRANSPORT`) and what client and
//! server share: the stream type over the three transports and the per-connection protocol.
//!
//! Every connection starts with an 8-byte header from the client: the operation (1 byte), busy
//! polling (1 byte, 0 or 1), two zero bytes and the message size (4 bytes, big endian).
//!
//! | op | server |
//! |---|---|
//! | `S` stream | reads until end of stream, answers the byte count (8 bytes, big endian) |
//! | `P` ping-pong | echoes every message of `size` bytes until end of stream |
//! | `C` connect | answers 1 byte, then reads until end of stream |
//! | `H` handshake | the connect floor: the header opens a [`PROPOSAL`]-byte message; reads the rest, answers [`ACCEPT`] bytes, reads [`CONFIRM`] bytes, answers 1 byte, then reads until end of stream |
//! | `I` idle | answers 1 byte and keeps the connection, without a thread, until an `R` |
//! | `R` release | drops every idle connection, answers 1 byte |

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use smc::{SmcListener, SmcStream, Stack};

/// How long a busy-polling SMC-R socket spins on the completion queues before it sleeps.
pub const SPIN: Duration = Duration::from_millis(2);

/// The server's read buffer for streams (the same for every transport and the stream floor).
pub const SINK: usize = 256 * 1024;

/// Size of an SMC-R CLC Proposal without IP prefixes (the connect floor's first message).
pub const PROPOSAL: usize = 52;
/// Size of an SMC-R CLC Accept (the connect floor's answer to the Proposal).
pub const ACCEPT: usize = 68;
/// Size of an SMC-R CLC Confirm (the connect floor's answer to the Accept).
pub const CONFIRM: usize = 68;

/// A transport under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Transport {
    /// SMC-R over the shm fabric (smc-rs).
    Smc,
    /// TCP over loopback.
    Tcp,
    /// Unix domain stream sockets.
    Uds,
}

impl Transport {
    /// Every transport, in the order measurements alternate.
    pub const ALL: [Transport; 3] = [Transport::Smc, Transport::Tcp, Transport::Uds];

    /// The name used in JSON and tables.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Smc => "smc",
            Transport::Tcp => "tcp",
            Transport::Uds => "uds",
        }
    }
}

/// The operations of the bench protocol (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Stream to a sink.
    Stream,
    /// Echo messages.
    PingPong,
    /// Connection setup.
    Connect,
    /// Connection setup with the CLC message pattern (the connect floor).
    Handshake,
    /// Hold an idle connection.
    Idle,
    /// Drop the idle connections.
    Release,
}

impl Op {
    fn code(self) -> u8 {
        match self {
            Op::Stream => b'S',
            Op::PingPong => b'P',
            Op::Connect => b'C',
            Op::Handshake => b'H',
            Op::Idle => b'I',
            Op::Release => b'R',
        }
    }

    fn from_code(c: u8) -> Option<Op> {
        Some(match c {
            b'S' => Op::Stream,
            b'P' => Op::PingPong,
            b'C' => Op::Connect,
            b'H' => Op::Handshake,
            b'I' => Op::Idle,
            b'R' => Op::Release,
            _ => return None,
        })
    }
}

/// The header that opens every bench connection.
pub fn header(op: Op, busy: bool, size: usize) -> Result<[u8; 8]> {
    let size = u32::try_from(size).context("message size")?;
    let s = size.to_be_bytes();
    Ok([op.code(), u8::from(busy), 0, 0, s[0], s[1], s[2], s[3]])
}

/// A stream of any of the transports.
pub enum Conn {
    /// SMC-R (or its TCP fallback).
    Smc(SmcStream),
    /// TCP.
    Tcp(TcpStream),
    /// Unix domain socket.
    Uds(UnixStream),
}

impl Conn {
    /// Busy polling on or off. SMC-R spins on its completion queues ([`SPIN`]); TCP and Unix
    /// sockets become nonblocking and the bench's own loops retry on `WouldBlock`, yielding
    /// the CPU between tries (the machine may have fewer cores than spinning threads).
    pub fn set_busy(&mut self, busy: bool) -> io::Result<()> {
        match self {
            Conn::Smc(s) => {
                s.set_busy_poll(busy.then_some(SPIN));
                Ok(())
            }
            Conn::Tcp(s) => s.set_nonblocking(busy),
            Conn::Uds(s) => s.set_nonblocking(busy),
        }
    }

    /// Close our sending direction.
    pub fn shutdown_write(&mut self) -> io::Result<()> {
        match self {
            Conn::Smc(s) => s.shutdown(Shutdown::Write),
            Conn::Tcp(s) => s.shutdown(Shutdown::Write),
            Conn::Uds(s) => s.shutdown(Shutdown::Write),
        }
    }

    /// `read_exact` that retries on `WouldBlock` (busy mode). `Ok(false)`: the stream ended
    /// before the first byte.
    pub fn read_full(&mut self, buf: &mut [u8]) -> io::Result<bool> {
        let mut got = 0;
        while got < buf.len() {
            match self.read(&mut buf[got..]) {
                Ok(0) if got == 0 => return Ok(false),
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    /// `write_all` that retries on `WouldBlock` (busy mode).
    pub fn write_full(&mut self, mut buf: &[u8]) -> io::Result<()> {
        while !buf.is_empty() {
            match self.write(buf) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => buf = &buf[n..],
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Conn::Smc(s) => s.read(buf),
            Conn::Tcp(s) => s.read(buf),
            Conn::Uds(s) => s.read(buf),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Conn::Smc(s) => s.write(buf),
            Conn::Tcp(s) => s.write(buf),
            Conn::Uds(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Arguments of the hidden `smc bench-server`.
#[derive(Args, Debug)]
pub struct BenchServerArgs {
    /// The transport to serve.
    #[arg(value_enum)]
    transport: Transport,
    /// The socket path (Unix domain sockets only).
    #[arg(long)]
    path: Option<PathBuf>,
}

/// Idle connections held for `I` until an `R`.
static IDLE: Mutex<Vec<Conn>> = Mutex::new(Vec::new());

/// The bench server: prints `READY <port>` (or `READY 0` for a Unix socket), serves every
/// connection in its own thread, and exits when stdin closes.
pub fn run_server(args: &BenchServerArgs) -> Result<ExitCode> {
    std::thread::spawn(|| {
        let mut buf = [0u8; 16];
        while matches!(io::stdin().read(&mut buf), Ok(n) if n > 0) {}
        std::process::exit(0);
    });
    let mut out = io::stdout();
    match args.transport {
        Transport::Smc => {
            let stack = Stack::global().context("starting the SMC-R stack")?;
            let l = SmcListener::bind_with(&stack, "127.0.0.1:0")?;
            writeln!(out, "READY {}", l.local_addr()?.port())?;
            out.flush()?;
            for s in l.incoming() {
                match s {
                    Ok(s) => spawn_serve(Conn::Smc(s)),
                    Err(e) => eprintln!("smc bench-server: accept: {e}"),
                }
            }
        }
        Transport::Tcp => {
            let l = TcpListener::bind("127.0.0.1:0")?;
            writeln!(out, "READY {}", l.local_addr()?.port())?;
            out.flush()?;
            for s in l.incoming() {
                match s {
                    Ok(s) => {
                        s.set_nodelay(true)?;
                        spawn_serve(Conn::Tcp(s))
                    }
                    Err(e) => eprintln!("smc bench-server: accept: {e}"),
                }
            }
        }
        Transport::Uds => {
            let path = args.path.as_ref().context("--path is required for uds")?;
            let l = UnixListener::bind(path)?;
            writeln!(out, "READY 0")?;
            out.flush()?;
            for s in l.incoming() {
                match s {
                    Ok(s) => spawn_serve(Conn::Uds(s)),
                    Err(e) => eprintln!("smc bench-server: accept: {e}"),
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn spawn_serve(c: Conn) {
    let spawned = std::thread::Builder::new()
        .stack_size(128 * 1024)
        .spawn(move || {
            if let Err(e) = serve(c) {
                eprintln!("smc bench-server: {e:#}");
            }
        });
    if let Err(e) = spawned {
        eprintln!("smc bench-server: thread: {e}");
    }
}

fn serve(mut c: Conn) -> Result<()> {
    let mut h = [0u8; 8];
    if !c.read_full(&mut h)? {
        return Ok(());
    }
    let op = Op::from_code(h[0]).with_context(|| format!("unknown op {:#04x}", h[0]))?;
    let busy = h[1] != 0;
    let size = usize::try_from(u32::from_be_bytes([h[4], h[5], h[6], h[7]]))?;
    match op {
        Op::Stream => {
            let mut buf = vec![0u8; SINK];
            let mut total = 0u64;
            loop {
                match c.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => total += n as u64,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e.into()),
                }
            }
            c.write_full(&total.to_be_bytes())?;
        }
        Op::PingPong => {
            if size == 0 {
                bail!("ping-pong with empty messages");
            }
            c.set_busy(busy)?;
            let mut buf = vec![0u8; size];
            while c.read_full(&mut buf)? {
                c.write_full(&buf)?;
            }
        }
        Op::Connect => {
            c.write_full(&[1])?;
            let mut buf = [0u8; 64];
            while c.read(&mut buf)? > 0 {}
        }
        Op::Handshake => {
            let mut proposal = [0u8; PROPOSAL - 8];
            let mut confirm = [0u8; CONFIRM];
            if !c.read_full(&mut proposal)? {
                bail!("the handshake ended in the Proposal");
            }
            c.write_full(&[0u8; ACCEPT])?;
            if !c.read_full(&mut confirm)? {
                bail!("the handshake ended before the Confirm");
            }
            c.write_full(&[1])?;
            let mut buf = [0u8; 64];
            while c.read(&mut buf)? > 0 {}
        }
        Op::Idle => {
            c.write_full(&[1])?;
            IDLE.lock().unwrap_or_else(|p| p.into_inner()).push(c);
        }
        Op::Release => {
            let idle = std::mem::take(&mut *IDLE.lock().unwrap_or_else(|p| p.into_inner()));
            drop(idle);
            c.write_full(&[1])?;
        }
    }
    Ok(())
}

/// A running bench server process; stopped (stdin closed) when dropped.
pub struct Server {
    child: Child,
    /// The TCP port (SMC-R and TCP servers).
    pub port: u16,
    /// The socket path (Unix domain socket server).
    pub path: Option<PathBuf>,
}

impl Server {
    /// Start `smc bench-server` for `transport`; SMC-R servers use the fabric in `dir`, RMBEs
    /// of `buffer` bytes and an adaptive spin of at most `spin_us` µs (0: off).
    pub fn spawn(transport: Transport, dir: &Path, buffer: u32, spin_us: u128) -> Result<Server> {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.arg("bench-server").arg(transport.name());
        let path = (transport == Transport::Uds).then(|| dir.join("bench.sock"));
        if let Some(p) = &path {
            cmd.arg("--path").arg(p);
        }
        let mut child = cmd
            .env("SMC_FABRIC_DIR", dir)
            .env("SMC_DISCOVERY", "assert-peer")
            .env("SMC_BUFFER_SIZE", buffer.to_string())
            .env("SMC_ADAPTIVE_SPIN_US", spin_us.to_string())
            .env_remove("SMC_BUSY_POLL_US")
            .env_remove("SMC_CONFIG")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting a bench server process")?;
        let out = child.stdout.take().context("server stdout")?;
        let mut line = String::new();
        BufReader::new(out).read_line(&mut line)?;
        let Some(port) = line
            .trim()
            .strip_prefix("READY ")
            .and_then(|p| p.parse().ok())
        else {
            let _ = child.kill();
            let _ = child.wait();
            bail!("the {} server said {line:?}", transport.name());
        };
        Ok(Server { child, port, path })
    }

    /// The server's process ID.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}
