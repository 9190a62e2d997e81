//! `smc roce-floor` (hidden; run by `smc bench --fabric roce`): the per-byte work a software
//! RoCEv2 stream cannot avoid, with no protocol around it, so that the bench can say how far
//! SMC-R over a software device is from the best any such device could do on the same veth.
//!
//! The sender reads its input in 64 KiB pieces (as `smc nc` does), copies each piece into
//! packets laid out flat (a 28-byte header where BTH and RETH go, a path MTU of payload, a
//! 4-byte CRC-32 over header and payload with a fixed start hashed once, as the ICRC), and sends
//! them as `UDP_SEGMENT` runs of up to 62 packets, one `send` per run from one buffer. The
//! receiver takes the runs whole (`UDP_GRO`) into a buffer that starts half-way into a page,
//! checks each packet's CRC and its place in the stream (the header carries its offset),
//! copies its payload into a 1 MiB ring (the RMB) and then out of the ring into a buffer it
//! writes to its output (the application's read). The receiver returns credit every 256 KiB it
//! has read; the sender keeps at most 1 MiB (the RMB) unread. A bad CRC, a packet out of place
//! or a lost datagram ends the run with an error that says so: the floor moves every byte, or
//! fails.
//!
//! What the floor leaves out, and a real device has to do: PSNs, ACKs and their timers,
//! keeping unacknowledged packets, the RETH's checks, CDC messages, several connections on
//! one socket (the floor's sockets are connected: no route lookup per datagram). It is an
//! upper bound on what a software RoCE device's stream can reach, not a rate an RC transport
//! reaches as it is. With
//! `--no-placement` the receiver skips the copy into the ring (a device could only do that
//! by receiving straight into the RMB before checking the CRC, which RoCE forbids).
use anyhow::{bail, Context, Result};
use clap::Args;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// BTH (12) + RETH (16): the header bytes of an RDMA WRITE ONLY packet. The floor's carry the
/// packet's offset in the stream (8 bytes) and, in the end marker, a flag (byte 8).
const HEAD: usize = 28;
/// The ICRC.
const TAIL: usize = 4;
/// Most packets per `UDP_SEGMENT` run: as many as fit in one UDP datagram at a path MTU of 1024.
const RUN: usize = 62;
/// The receiver's ring (the RMB) and the most the sender keeps unread.
const RING: usize = 1 << 20;
/// The receiver returns credit after reading this much.
const CREDIT_EVERY: u64 = 256 << 10;
/// The application's reads and writes.
const PIECE: usize = 64 << 10;
/// The longest UDP payload: a coalesced datagram is never longer.
const DATAGRAM_MAX: usize = 65_535;
/// How long the sender waits for credit, and the receiver for a datagram.
const SENDER_WAIT: Duration = Duration::from_secs(5);
const RECEIVER_WAIT: Duration = Duration::from_secs(10);

#[derive(Args, Debug)]
pub struct FloorArgs {
    /// Receive on this address and port (the receiver), writing the bytes to stdout.
    #[arg(long, conflicts_with = "connect")]
    listen: Option<SocketAddr>,
    /// Send stdin to this address and port (the sender).
    #[arg(long)]
    connect: Option<SocketAddr>,
    /// Payload bytes per packet (the path MTU).
    #[arg(long, default_value_t = 1024)]
    mtu: usize,
    /// The receiver does not copy payloads into its ring (reads them from the datagram).
    #[arg(long)]
    no_placement: bool,
}

pub fn run(args: &FloorArgs) -> Result<ExitCode> {
    if !matches!(args.mtu, 256 | 512 | 1024 | 2048 | 4096) {
        bail!(
            "--mtu {} is not a RoCE path MTU (256, 512, 1024, 2048 or 4096)",
            args.mtu
        );
    }
    match (args.listen, args.connect) {
        (Some(at), None) => {
            let sock = UdpSocket::bind(at).with_context(|| format!("binding {at}"))?;
            let mut out = std::io::stdout().lock();
            let r = receive(&sock, args.mtu, !args.no_placement, CREDIT_EVERY, &mut out)?;
            eprintln!(
                "smc roce-floor: received {} bytes in {:.6} s (first byte to end of stream, {:.1} MB/s)",
                r.bytes,
                r.secs,
                r.bytes as f64 / r.secs.max(1e-9) / 1e6
            );
        }
        (None, Some(to)) => send(to, args.mtu, RING, &mut std::io::stdin().lock())?,
        _ => bail!("give --listen ADDR:PORT or --connect ADDR:PORT"),
    }
    Ok(ExitCode::SUCCESS)
}

/// `UDP_SEGMENT` and `UDP_GRO`, which rustix has no setter for.
#[allow(unsafe_code)]
fn set_udp(sock: &UdpSocket, name: i32, value: i32) -> std::io::Result<()> {
    // SAFETY: a plain setsockopt with a pointer to a live c_int and its size.
    let r = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_UDP,
            name,
            (&value as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The CRC state after the bytes every packet's ICRC starts with (eight ones, then the
/// masked IP and UDP headers): hashed once, cloned per packet.
fn prefix() -> crc32fast::Hasher {
    let mut h = crc32fast::Hasher::new();
    h.update(&[0xFF; 8]);
    h.update(&[0; 28]);
    h
}

/// Credit from the receiver: the total bytes it has read, never more than was `sent`.
/// `wait` blocks until one arrives (at most [`SENDER_WAIT`]).
fn credit(sock: &UdpSocket, wait: bool, sent: u64) -> Result<Option<u64>> {
    use rustix::net::RecvFlags;
    let mut b = [0u8; 8];
    let flags = if wait {
        RecvFlags::TRUNC
    } else {
        RecvFlags::TRUNC | RecvFlags::DONTWAIT
    };
    match rustix::net::recv(sock, &mut b, flags) {
        Ok((8, 8)) => {
            let c = u64::from_le_bytes(b);
            if c > sent {
                bail!("the receiver credits {c} bytes, {sent} were sent");
            }
            Ok(Some(c))
        }
        Ok((_, n)) => bail!("a credit datagram of {n} bytes"),
        Err(rustix::io::Errno::AGAIN) if !wait => Ok(None),
        Err(rustix::io::Errno::AGAIN) => {
            bail!("no credit from the receiver for {SENDER_WAIT:?} ({sent} bytes sent)")
        }
        Err(e) => Err(e).context("waiting for the receiver's credit"),
    }
}

/// Read until `buf` is full or the input ends (as `smc nc` reads: whole pieces).
fn fill(input: &mut dyn Read, buf: &mut [u8]) -> Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match input.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e).context("reading the input"),
        }
    }
    Ok(n)
}

/// Send `input` to the receiver at `to`, at most `window` bytes ahead of what it has read.
fn send(to: SocketAddr, mtu: usize, window: usize, input: &mut dyn Read) -> Result<()> {
    let any: SocketAddr = if to.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }.parse()?;
    let sock = UdpSocket::bind(any)?;
    sock.connect(to)?;
    sock.set_read_timeout(Some(SENDER_WAIT))?;
    let seg = HEAD + mtu + TAIL;
    let run = RUN.min(65_507 / seg);
    set_udp(&sock, libc::UDP_SEGMENT, seg as i32).context("UDP_SEGMENT")?;
    let _ = rustix::net::sockopt::set_socket_send_buffer_size(&sock, 4 << 20);
    let pre = prefix();
    let window = window as u64;
    let mut piece = vec![0u8; PIECE];
    let mut out = vec![0u8; run * seg];
    let (mut used, mut sent, mut read_by_peer) = (0usize, 0u64, 0u64);
    let flush = |out: &[u8], used: &mut usize| -> Result<()> {
        if *used > 0 {
            sock.send(&out[..*used]).context("sending a run")?;
            *used = 0;
        }
        Ok(())
    };
    loop {
        let n = fill(input, &mut piece)?;
        if n == 0 {
            break;
        }
        for chunk in piece[..n].chunks(mtu) {
            while sent + chunk.len() as u64 > read_by_peer + window {
                flush(&out, &mut used)?;
                read_by_peer = read_by_peer.max(credit(&sock, true, sent)?.unwrap_or(0));
            }
            let p = &mut out[used..used + HEAD + chunk.len() + TAIL];
            p[..8].copy_from_slice(&sent.to_le_bytes());
            p[HEAD..HEAD + chunk.len()].copy_from_slice(chunk);
            let mut h = pre.clone();
            h.update(&p[..HEAD + chunk.len()]);
            let icrc = h.finalize();
            p[HEAD + chunk.len()..].copy_from_slice(&icrc.to_le_bytes());
            used += p.len();
            sent += chunk.len() as u64;
            // A short packet ends a run (every packet of a run but its last has one size).
            if used == out.len() || chunk.len() < mtu {
                flush(&out, &mut used)?;
                while let Some(c) = credit(&sock, false, sent)? {
                    read_by_peer = read_by_peer.max(c);
                }
            }
        }
    }
    flush(&out, &mut used)?;
    // The end: a header alone, carrying the total.
    let mut end = [0u8; HEAD];
    end[..8].copy_from_slice(&sent.to_le_bytes());
    end[8] = 1;
    sock.send(&end)?;
    Ok(())
}

/// What a receiver took: bytes, and seconds from the first to the end of the stream.
struct Received {
    bytes: u64,
    secs: f64,
}

/// Whether `p` is the end marker: a header alone with the flag set.
fn end_of(p: &[u8]) -> Option<u64> {
    (p.len() == HEAD && p[8] == 1).then(|| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&p[..8]);
        u64::from_le_bytes(b)
    })
}

/// Receive one sender's stream on `sock` into `output`, returning credit every
/// `credit_every` bytes read.
fn receive(
    sock: &UdpSocket,
    mtu: usize,
    placement: bool,
    credit_every: u64,
    output: &mut dyn Write,
) -> Result<Received> {
    sock.set_read_timeout(Some(RECEIVER_WAIT))?;
    set_udp(sock, libc::UDP_GRO, 1).context("UDP_GRO")?;
    if rustix::net::sockopt::set_socket_recv_buffer_size_force(sock, 8 << 20).is_err() {
        let _ = rustix::net::sockopt::set_socket_recv_buffer_size(sock, 8 << 20);
    }
    let seg = HEAD + mtu + TAIL;
    let pre = prefix();
    // One datagram (at most 64 KiB), starting half-way into a page.
    let mut slot = vec![0u8; DATAGRAM_MAX + 1 + 4096];
    let off = (2048 + 4096 - (slot.as_ptr() as usize % 4096)) % 4096;
    let mut ring = vec![0u8; if placement { RING } else { 0 }];
    let mut app = vec![0u8; DATAGRAM_MAX];
    let (mut got, mut credited) = (0u64, 0u64);
    let mut first: Option<Instant> = None;
    // The sender: the first source heard from; datagrams from any other are not the stream's.
    // Not connected: credit sent after the sender has gone must not turn into an error (an
    // ICMP port unreachable) on the receive of a datagram still queued.
    let mut sender: Option<SocketAddr> = None;
    loop {
        let buf = &mut slot[off..off + DATAGRAM_MAX + 1];
        let (n, from) = match sock.recv_from(buf) {
            Ok(r) => r,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                bail!("no datagram for {RECEIVER_WAIT:?} ({got} bytes arrived, no end of stream)")
            }
            Err(e) => return Err(e).context("receiving"),
        };
        if n > DATAGRAM_MAX {
            bail!("a datagram longer than {DATAGRAM_MAX} bytes");
        }
        let peer = *sender.get_or_insert(from);
        if from != peer {
            continue;
        }
        first.get_or_insert_with(Instant::now);
        let mut placed = 0;
        let mut total = None;
        for p in buf[..n].chunks(seg) {
            // The end marker, alone or (coalesced after a full last packet) at a datagram's end.
            if let Some(t) = end_of(p) {
                total = Some(t);
                break;
            }
            if p.len() <= HEAD + TAIL {
                bail!(
                    "a packet of {} bytes at byte {}",
                    p.len(),
                    got + placed as u64
                );
            }
            let (body, icrc) = p.split_at(p.len() - TAIL);
            let mut h = pre.clone();
            h.update(body);
            if h.finalize().to_le_bytes() != icrc {
                bail!("the packet at byte {} failed its CRC", got + placed as u64);
            }
            let mut at = [0u8; 8];
            at.copy_from_slice(&body[..8]);
            let at = u64::from_le_bytes(at);
            if at != got + placed as u64 {
                bail!(
                    "the packet of byte {at} arrived where byte {} was due (a datagram lost or reordered)",
                    got + placed as u64
                );
            }
            let payload = &body[HEAD..];
            if placement {
                let at = (got as usize + placed) % RING;
                let first_part = payload.len().min(RING - at);
                ring[at..at + first_part].copy_from_slice(&payload[..first_part]);
                ring[..payload.len() - first_part].copy_from_slice(&payload[first_part..]);
            } else {
                app[placed..placed + payload.len()].copy_from_slice(payload);
            }
            placed += payload.len();
        }
        if placement {
            let at = got as usize % RING;
            let first_part = placed.min(RING - at);
            app[..first_part].copy_from_slice(&ring[at..at + first_part]);
            app[first_part..placed].copy_from_slice(&ring[..placed - first_part]);
        }
        output.write_all(&app[..placed])?;
        got += placed as u64;
        if let Some(total) = total {
            if total != got {
                bail!("the sender sent {total} bytes, {got} arrived (a datagram was lost)");
            }
            break;
        }
        if got - credited >= credit_every {
            // Lost credit only slows the sender (the next one covers it).
            let _ = sock.send_to(&got.to_le_bytes(), peer);
            credited = got;
        }
    }
    output.flush()?;
    Ok(Received {
        bytes: got,
        secs: first.map(|t| t.elapsed().as_secs_f64()).unwrap_or(0.0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader that hands out its bytes in pieces of irregular sizes.
    struct Uneven<'a> {
        data: &'a [u8],
        sizes: std::iter::Cycle<std::slice::Iter<'static, usize>>,
    }

    impl Read for Uneven<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let k = (*self.sizes.next().unwrap_or(&1))
                .min(buf.len())
                .min(self.data.len());
            buf[..k].copy_from_slice(&self.data[..k]);
            self.data = &self.data[k..];
            Ok(k)
        }
    }

    fn pattern(len: usize) -> Vec<u8> {
        (0..len as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect()
    }

    /// Over loopback, every byte arrives in order, whatever the path MTU, with a last packet
    /// shorter than the rest, input that comes in uneven pieces (the sender gathers whole
    /// ones), and datagrams whose payload wraps around the end of the ring (3 MiB through a
    /// 1 MiB ring in datagrams of 62 KiB).
    #[test]
    fn the_floor_moves_every_byte() {
        let data = pattern((3 << 20) + 1234);
        for (mtu, placement) in [(1024, true), (4096, false), (2048, true)] {
            let rx = UdpSocket::bind("127.0.0.1:0").expect("bind");
            let to = rx.local_addr().expect("address");
            let receiver = std::thread::spawn(move || {
                let mut out = Vec::new();
                let r = receive(&rx, mtu, placement, 16 << 10, &mut out).expect("receive");
                (r.bytes, out)
            });
            // Over loopback the kernel may cut a datagram into its packets before the socket
            // (each then costs its socket buffer far more than its bytes): a window of 64 KiB
            // leaves the buffer room whatever the receiver's speed.
            let mut input = Uneven {
                data: &data,
                sizes: [1000usize, 4097, 65536, 7].iter().cycle(),
            };
            send(to, mtu, 64 << 10, &mut input).expect("send");
            let (n, out) = receiver.join().expect("receiver");
            assert_eq!(n as usize, data.len());
            assert!(out == data, "path MTU {mtu}: the bytes differ");
        }
    }

    /// A packet whose CRC does not match, and one out of place, end the run with an error that
    /// names them; datagrams from another source are not the stream's.
    #[test]
    fn bad_packets_are_errors() {
        let pre = prefix();
        let packet = |at: u64, fill: u8, corrupt: bool| {
            let mut p = vec![fill; HEAD + 1024 + TAIL];
            p[..HEAD].fill(0);
            p[..8].copy_from_slice(&at.to_le_bytes());
            let mut h = pre.clone();
            h.update(&p[..HEAD + 1024]);
            let sum = h.finalize().to_le_bytes();
            p[HEAD + 1024..].copy_from_slice(&sum);
            if corrupt {
                p[HEAD + 5] ^= 1;
            }
            p
        };
        for (second, want) in [
            (packet(1024, 2, true), "failed its CRC"),
            (packet(4096, 2, false), "where byte 1024 was due"),
        ] {
            let rx = UdpSocket::bind("127.0.0.1:0").expect("bind");
            let to = rx.local_addr().expect("address");
            let receiver = std::thread::spawn(move || {
                receive(&rx, 1024, true, 16 << 10, &mut Vec::new()).map(|r| r.bytes)
            });
            let tx = UdpSocket::bind("127.0.0.1:0").expect("bind");
            let stray = UdpSocket::bind("127.0.0.1:0").expect("bind");
            tx.send_to(&packet(0, 1, false), to).expect("send");
            stray.send_to(&packet(1024, 9, true), to).expect("send");
            tx.send_to(&second, to).expect("send");
            let err = receiver.join().expect("receiver").expect_err("an error");
            assert!(err.to_string().contains(want), "{err}");
        }
    }
}
