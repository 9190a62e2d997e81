//! `smc roce-floor` (hidden; run by `smc bench --fabric roce`): the per-byte work a software
//! RoCEv2 stream cannot avoid, with no protocol around it, so that the bench can say how far
//! SMC-R over a software device is from the best any such device could do on the same veth.
//!
//! The sender reads its input in 64 KiB pieces (as `smc nc` does), copies each piece into
//! packets laid out flat (a 28-byte header where BTH and RETH go, a path MTU of payload, a
//! 4-byte CRC-32 over header and payload with a fixed start hashed once, as the ICRC), and sends
//! them as `UDP_SEGMENT` runs of up to 62 packets, one `send` per run from one buffer. The
//! receiver takes the runs whole (`UDP_GRO`) into a buffer that starts half-way into a page,
//! checks each packet's CRC, copies its payload into a 1 MiB ring (the RMB) and then out of
//! the ring into a 64 KiB buffer it writes to its output (the application's read). The
//! receiver returns credit every 256 KiB it has read; the sender keeps at most 1 MiB
//! (the RMB) unread.
//!
//! What the floor leaves out, and a real device has to do: PSNs, ACKs and their timers,
//! keeping unacknowledged packets, the RETH's checks, CDC messages, several connections on
//! one socket (the floor's sockets are connected: no route lookup per datagram). With
//! `--no-placement` the receiver skips the copy into the ring (a device could only do that
//! by receiving straight into the RMB before checking the CRC, which RoCE forbids).
use anyhow::{bail, Context, Result};
use clap::Args;
use std::io::{Read, Write};
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// BTH (12) + RETH (16): the header bytes of an RDMA WRITE ONLY packet.
const HEAD: usize = 28;
/// The ICRC.
const TAIL: usize = 4;
/// Packets per `UDP_SEGMENT` run: as many as fit in one UDP datagram at a path MTU of 1024.
const RUN: usize = 62;
/// The receiver's ring (the RMB) and the most the sender keeps unread.
const RING: usize = 1 << 20;
/// The receiver returns credit after reading this much.
const CREDIT_EVERY: u64 = 256 << 10;
/// The application's reads and writes.
const PIECE: usize = 64 << 10;

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
    if !(256..=4096).contains(&args.mtu) {
        bail!("--mtu {} is not a RoCE path MTU (256 ... 4096)", args.mtu);
    }
    match (args.listen, args.connect) {
        (Some(at), None) => {
            let sock = UdpSocket::bind(at)?;
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

// No safe wrapper exists for UDP_SEGMENT and UDP_GRO (rustix has none).
#[allow(unsafe_code)]
fn set_int(sock: &UdpSocket, level: i32, name: i32, value: i32) -> std::io::Result<()> {
    // SAFETY: a plain setsockopt with a pointer to a live c_int and its size.
    let r = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            level,
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

/// Credit from the receiver: the total bytes it has read. `wait` blocks until one arrives.
fn credit(sock: &UdpSocket, wait: bool) -> Result<Option<u64>> {
    use rustix::net::RecvFlags;
    let mut b = [0u8; 8];
    let flags = if wait {
        RecvFlags::empty()
    } else {
        RecvFlags::DONTWAIT
    };
    match rustix::net::recv(sock, &mut b, flags) {
        Ok((8, _)) => Ok(Some(u64::from_le_bytes(b))),
        Ok((n, _)) => bail!("a credit datagram of {n} bytes"),
        Err(rustix::io::Errno::AGAIN) if !wait => Ok(None),
        Err(e) => Err(e).context("waiting for the receiver's credit"),
    }
}

/// Send `input` to the receiver at `to`, at most `window` bytes ahead of what it has read.
fn send(to: SocketAddr, mtu: usize, window: usize, input: &mut dyn Read) -> Result<()> {
    let any: SocketAddr = if to.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }.parse()?;
    let sock = UdpSocket::bind(any)?;
    sock.connect(to)?;
    sock.set_read_timeout(Some(Duration::from_secs(5)))?;
    let seg = HEAD + mtu + TAIL;
    let run = RUN.min(65_507 / seg);
    set_int(&sock, libc::SOL_UDP, libc::UDP_SEGMENT, seg as i32).context("UDP_SEGMENT")?;
    let _ = set_int(&sock, libc::SOL_SOCKET, libc::SO_SNDBUF, 4 << 20);
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
        let n = input.read(&mut piece)?;
        if n == 0 {
            break;
        }
        for chunk in piece[..n].chunks(mtu) {
            while sent + chunk.len() as u64 - read_by_peer > window {
                flush(&out, &mut used)?;
                read_by_peer = read_by_peer.max(credit(&sock, true)?.unwrap_or(0));
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
                while let Some(c) = credit(&sock, false)? {
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

/// Receive one sender's stream on `sock` into `output`, returning credit every
/// `credit_every` bytes read.
fn receive(
    sock: &UdpSocket,
    mtu: usize,
    placement: bool,
    credit_every: u64,
    output: &mut dyn Write,
) -> Result<Received> {
    sock.set_read_timeout(Some(Duration::from_secs(10)))?;
    set_int(sock, libc::SOL_UDP, libc::UDP_GRO, 1).context("UDP_GRO")?;
    if set_int(sock, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, 8 << 20).is_err() {
        let _ = set_int(sock, libc::SOL_SOCKET, libc::SO_RCVBUF, 8 << 20);
    }
    let seg = HEAD + mtu + TAIL;
    let pre = prefix();
    // One datagram (GRO gives at most 64 KiB), starting half-way into a page.
    let mut slot = vec![0u8; (80 << 10) + 4096];
    let off = (2048 + 4096 - (slot.as_ptr() as usize % 4096)) % 4096;
    let mut ring = vec![0u8; if placement { RING } else { 0 }];
    let mut app = vec![0u8; PIECE];
    let (mut got, mut credited, mut bad) = (0u64, 0u64, 0u64);
    let mut first: Option<Instant> = None;
    // Not connected: credit sent after the sender has gone must not turn into an error
    // (an ICMP port unreachable) on the receive of a datagram still queued.
    let mut peer: Option<SocketAddr> = None;
    loop {
        let buf = &mut slot[off..off + (80 << 10)];
        let (n, from) = sock.recv_from(buf).context("receiving")?;
        first.get_or_insert_with(Instant::now);
        let peer = *peer.get_or_insert(from);
        let d = &buf[..n];
        if n == HEAD && d[8] == 1 {
            let total = u64::from_le_bytes(d[..8].try_into()?);
            if total != got {
                bail!("the sender sent {total} bytes, {got} arrived (a datagram was lost)");
            }
            break;
        }
        let mut placed = 0;
        for p in d.chunks(seg) {
            if p.len() <= HEAD + TAIL {
                bad += 1;
                continue;
            }
            let (body, icrc) = p.split_at(p.len() - TAIL);
            let mut h = pre.clone();
            h.update(body);
            if h.finalize().to_le_bytes() != icrc {
                bad += 1;
                continue;
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
        if got - credited >= credit_every {
            // Lost credit only slows the sender (the next one covers it).
            let _ = sock.send_to(&got.to_le_bytes(), peer);
            credited = got;
        }
    }
    output.flush()?;
    if bad > 0 {
        bail!("{bad} packets failed their CRC");
    }
    Ok(Received {
        bytes: got,
        secs: first.map(|t| t.elapsed().as_secs_f64()).unwrap_or(0.0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Over loopback, every byte arrives in order, whatever the path MTU, with a last packet
    /// shorter than the rest and pieces not a multiple of it.
    #[test]
    fn the_floor_moves_every_byte() {
        let data: Vec<u8> = (0..(3 << 20) + 1234u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
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
            send(to, mtu, 64 << 10, &mut &data[..]).expect("send");
            let (n, out) = receiver.join().expect("receiver");
            assert_eq!(n as usize, data.len());
            assert!(out == data, "path MTU {mtu}: the bytes differ");
        }
    }
}
