//! Capture framing: writes pcap files that Wireshark decodes as SMC-R
//! (shared/spec/wireshark.md).
//!
//! CLC messages become the TCP payload of an IPv4 4-tuple stream (with a SYN / SYN-ACK / ACK
//! handshake that carries the SMC TCP option); LLC and CDC messages become RoCEv2 frames:
//! Ethernet / IPv4 / UDP 4791 / BTH "RC SEND Only" / 44-byte payload / ICRC.

use std::collections::HashMap;
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::Duration;

use pcap_file::pcap::{PcapHeader, PcapPacket, PcapWriter};
use pcap_file::DataLink;

use crate::types::{Mac, U24};
use crate::{roce, tcp_option};

/// UDP destination port of RoCEv2.
pub const ROCEV2_UDP_PORT: u16 = roce::UDP_PORT;
/// UDP source port used in our RoCEv2 frames.
pub const ROCEV2_SRC_PORT: u16 = 54321;
/// BTH opcode "RC SEND Only".
pub const BTH_OPCODE_RC_SEND_ONLY: u8 = roce::Opcode::SEND_ONLY.0;

/// An error while writing a capture.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// The pcap writer failed (I/O or format).
    #[error("pcap write failed: {0}")]
    Pcap(pcap_file::PcapError),
}

// By hand rather than `#[from]`, which would also make the cause the error's `source`: its
// text, already in the message, would be printed twice in a chain of causes.
impl From<pcap_file::PcapError> for CaptureError {
    fn from(e: pcap_file::PcapError) -> Self {
        CaptureError::Pcap(e)
    }
}

/// One end of a RoCEv2 exchange: the RNIC's MAC and IPv4 address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RoceEndpoint {
    /// Ethernet address.
    pub mac: Mac,
    /// IPv4 address (a RoCEv2 GID `::ffff:a.b.c.d`).
    pub ip: Ipv4Addr,
}

fn checksum16(chunks: &[&[u8]]) -> u16 {
    let mut sum: u32 = 0;
    for c in chunks {
        let mut it = c.chunks_exact(2);
        for p in &mut it {
            sum += u32::from(u16::from_be_bytes([p[0], p[1]]));
        }
        if let [last] = it.remainder() {
            sum += u32::from(*last) << 8;
        }
    }
    while sum > 0xFFFF {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    !(sum as u16)
}

pub(crate) fn ipv4_header(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    proto: u8,
    payload_len: usize,
    id: u16,
) -> [u8; 20] {
    let mut h = [0u8; 20];
    h[0] = 0x45;
    let total = (20 + payload_len) as u16;
    h[2..4].copy_from_slice(&total.to_be_bytes());
    h[4..6].copy_from_slice(&id.to_be_bytes());
    h[6] = 0x40; // don't fragment
    h[8] = 64;
    h[9] = proto;
    h[12..16].copy_from_slice(&src.octets());
    h[16..20].copy_from_slice(&dst.octets());
    let c = checksum16(&[&h]);
    h[10..12].copy_from_slice(&c.to_be_bytes());
    h
}

pub(crate) fn ethernet(dst: Mac, src: Mac, ethertype: u16) -> [u8; 14] {
    let mut e = [0u8; 14];
    e[..6].copy_from_slice(&dst.0);
    e[6..12].copy_from_slice(&src.0);
    e[12..].copy_from_slice(&ethertype.to_be_bytes());
    e
}

/// TCP flag bits.
mod tcp_flags {
    pub const FIN: u8 = 0x01;
    pub const SYN: u8 = 0x02;
    pub const PSH: u8 = 0x08;
    pub const ACK: u8 = 0x10;
}

/// An Ethernet/IPv4/TCP frame. `smc_option` adds the 8-byte aligned SMC option.
#[allow(clippy::too_many_arguments)]
pub fn tcp_frame(
    src: SocketAddrV4,
    dst: SocketAddrV4,
    seq: u32,
    ack: u32,
    flags: u8,
    smc_option: bool,
    payload: &[u8],
) -> Vec<u8> {
    let opt_len = if smc_option { 8 } else { 0 };
    let mut tcp = Vec::with_capacity(20 + opt_len + payload.len());
    tcp.extend_from_slice(&src.port().to_be_bytes());
    tcp.extend_from_slice(&dst.port().to_be_bytes());
    tcp.extend_from_slice(&seq.to_be_bytes());
    tcp.extend_from_slice(&ack.to_be_bytes());
    tcp.push((((20 + opt_len) / 4) as u8) << 4);
    tcp.push(flags);
    tcp.extend_from_slice(&65535u16.to_be_bytes());
    tcp.extend_from_slice(&[0, 0, 0, 0]); // checksum, urgent pointer
    if smc_option {
        tcp.extend_from_slice(&tcp_option::LINUX_ALIGNED);
    }
    tcp.extend_from_slice(payload);
    let mut pseudo = [0u8; 12];
    pseudo[..4].copy_from_slice(&src.ip().octets());
    pseudo[4..8].copy_from_slice(&dst.ip().octets());
    pseudo[9] = 6;
    pseudo[10..12].copy_from_slice(&(tcp.len() as u16).to_be_bytes());
    let c = checksum16(&[&pseudo, &tcp]);
    tcp[16..18].copy_from_slice(&c.to_be_bytes());
    let mut f = Vec::with_capacity(34 + tcp.len());
    f.extend_from_slice(&ethernet(
        Mac([2, 0, 0, 0, 0, 2]),
        Mac([2, 0, 0, 0, 0, 1]),
        0x0800,
    ));
    f.extend_from_slice(&ipv4_header(*src.ip(), *dst.ip(), 6, tcp.len(), 0));
    f.extend_from_slice(&tcp);
    f
}

/// A RoCEv2 "RC SEND Only" frame carrying `payload` (an LLC or CDC message), with the ICRC
/// computed as RoCEv2 defines it over the invariant fields (by the shared codec,
/// [`crate::roce`]).
pub fn rocev2_send_frame(
    src: RoceEndpoint,
    dst: RoceEndpoint,
    dest_qp: U24,
    psn: U24,
    payload: &[u8],
) -> Vec<u8> {
    let repr = roce::PacketRepr {
        bth: roce::Bth {
            opcode: roce::Opcode::SEND_ONLY,
            se: true,
            pkey: roce::DEFAULT_PKEY,
            dest_qp: dest_qp.get(),
            psn: psn.get(),
            ..roce::Bth::default()
        },
        reth: None,
        aeth: None,
        immdt: None,
        payload,
    };
    let mut ib = vec![0u8; repr.buffer_len()];
    // The buffer is exactly `buffer_len` bytes, so emitting cannot fail.
    let _ = repr.emit(&mut ib);
    let udp_len = (8 + ib.len()) as u16;
    let mut udp = [0u8; 8];
    udp[..2].copy_from_slice(&ROCEV2_SRC_PORT.to_be_bytes());
    udp[2..4].copy_from_slice(&ROCEV2_UDP_PORT.to_be_bytes());
    udp[4..6].copy_from_slice(&udp_len.to_be_bytes());
    let ip = ipv4_header(src.ip, dst.ip, 17, usize::from(udp_len), 0);
    roce::IcrcHeaders::new(src.ip.into(), dst.ip.into(), ROCEV2_SRC_PORT).seal(&mut ib);

    let mut f = Vec::with_capacity(14 + 20 + 8 + ib.len());
    f.extend_from_slice(&ethernet(dst.mac, src.mac, 0x0800));
    f.extend_from_slice(&ip);
    f.extend_from_slice(&udp);
    f.extend_from_slice(&ib);
    f
}

/// Writes SMC-R traffic into a pcap file (link type Ethernet).
///
/// TCP sequence numbers are tracked per direction of each 4-tuple, and RoCE PSNs per
/// destination QP, so the capture reads as a consistent conversation.
pub struct CaptureWriter<W: Write> {
    writer: PcapWriter<W>,
    tcp_seq: HashMap<(SocketAddrV4, SocketAddrV4), u32>,
    psn: HashMap<(Ipv4Addr, u32), u32>,
    frames: usize,
}

impl<W: Write> CaptureWriter<W> {
    /// Start a capture on `w` (writes the pcap file header).
    pub fn new(w: W) -> Result<Self, CaptureError> {
        let header = PcapHeader {
            datalink: DataLink::ETHERNET,
            ..Default::default()
        };
        Ok(CaptureWriter {
            writer: PcapWriter::with_header(w, header)?,
            tcp_seq: HashMap::new(),
            psn: HashMap::new(),
            frames: 0,
        })
    }

    /// Frames written so far.
    pub fn frames(&self) -> usize {
        self.frames
    }

    fn frame(&mut self, ts: Duration, data: &[u8]) -> Result<(), CaptureError> {
        let p = PcapPacket::new(ts, data.len() as u32, data);
        self.writer.write_packet(&p)?;
        self.frames += 1;
        Ok(())
    }

    fn next_seq(&mut self, from: SocketAddrV4, to: SocketAddrV4) -> u32 {
        *self.tcp_seq.entry((from, to)).or_insert(1000)
    }

    /// A TCP three-way handshake; with `smc` both SYN and SYN-ACK carry the SMC option.
    pub fn tcp_handshake(
        &mut self,
        ts: Duration,
        client: SocketAddrV4,
        server: SocketAddrV4,
        smc: bool,
    ) -> Result<(), CaptureError> {
        let (c0, s0) = (1000u32, 5000u32);
        let syn = tcp_frame(client, server, c0, 0, tcp_flags::SYN, smc, &[]);
        self.frame(ts, &syn)?;
        let synack = tcp_frame(
            server,
            client,
            s0,
            c0 + 1,
            tcp_flags::SYN | tcp_flags::ACK,
            smc,
            &[],
        );
        self.frame(ts, &synack)?;
        let ack = tcp_frame(client, server, c0 + 1, s0 + 1, tcp_flags::ACK, false, &[]);
        self.frame(ts, &ack)?;
        self.tcp_seq.insert((client, server), c0 + 1);
        self.tcp_seq.insert((server, client), s0 + 1);
        Ok(())
    }

    /// Bytes on the TCP stream from `from` to `to` (CLC messages, or fallback data).
    pub fn tcp_data(
        &mut self,
        ts: Duration,
        from: SocketAddrV4,
        to: SocketAddrV4,
        data: &[u8],
    ) -> Result<(), CaptureError> {
        let seq = self.next_seq(from, to);
        let ack = self.next_seq(to, from);
        let f = tcp_frame(
            from,
            to,
            seq,
            ack,
            tcp_flags::PSH | tcp_flags::ACK,
            false,
            data,
        );
        self.frame(ts, &f)?;
        self.tcp_seq
            .insert((from, to), seq.wrapping_add(data.len() as u32));
        Ok(())
    }

    /// A FIN on the TCP stream from `from` to `to`.
    pub fn tcp_fin(
        &mut self,
        ts: Duration,
        from: SocketAddrV4,
        to: SocketAddrV4,
    ) -> Result<(), CaptureError> {
        let seq = self.next_seq(from, to);
        let ack = self.next_seq(to, from);
        let f = tcp_frame(
            from,
            to,
            seq,
            ack,
            tcp_flags::FIN | tcp_flags::ACK,
            false,
            &[],
        );
        self.frame(ts, &f)?;
        self.tcp_seq.insert((from, to), seq.wrapping_add(1));
        Ok(())
    }

    /// An LLC or CDC message sent by IB SEND from `src` to the QP `dest_qp` at `dst`.
    pub fn roce_send(
        &mut self,
        ts: Duration,
        src: RoceEndpoint,
        dst: RoceEndpoint,
        dest_qp: U24,
        payload: &[u8],
    ) -> Result<(), CaptureError> {
        let psn = self.psn.entry((dst.ip, dest_qp.get())).or_insert(0);
        let this = U24::truncate(*psn);
        *psn = psn.wrapping_add(1) & 0x00FF_FFFF;
        let f = rocev2_send_frame(src, dst, dest_qp, this, payload);
        self.frame(ts, &f)
    }

    /// Flush and return the underlying writer.
    pub fn into_inner(self) -> W {
        self.writer.into_writer()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_checksum_verifies() {
        let h = ipv4_header(
            Ipv4Addr::new(192, 168, 1, 10),
            Ipv4Addr::new(192, 168, 1, 20),
            6,
            40,
            7,
        );
        assert_eq!(checksum16(&[&h]), 0);
    }

    #[test]
    fn rocev2_frame_layout() {
        let a = RoceEndpoint {
            mac: Mac([2, 0, 0, 0, 0, 1]),
            ip: Ipv4Addr::new(10, 0, 0, 1),
        };
        let b = RoceEndpoint {
            mac: Mac([2, 0, 0, 0, 0, 2]),
            ip: Ipv4Addr::new(10, 0, 0, 2),
        };
        let f = rocev2_send_frame(a, b, U24::truncate(0x123), U24::truncate(7), &[0xAB; 44]);
        assert_eq!(f.len(), 14 + 20 + 8 + 12 + 44 + 4);
        assert_eq!(&f[36..38], &4791u16.to_be_bytes());
        assert_eq!(f[42], BTH_OPCODE_RC_SEND_ONLY);
        assert_eq!(&f[47..50], &[0, 1, 0x23]);
        assert_eq!(&f[51..54], &[0, 0, 7]);
        // The ICRC changes when the payload changes but not when TTL does.
        let g = rocev2_send_frame(a, b, U24::truncate(0x123), U24::truncate(7), &[0xAC; 44]);
        assert_ne!(f[f.len() - 4..], g[g.len() - 4..]);
        // The frame's ICRC verifies against its own IP header (identification 0, DF).
        let (h, udp) = roce::icrc_of_ip_packet(&f[14..]).expect("ip/udp");
        assert!(h.verify(udp));
        let p = roce::Packet::parse(udp).expect("bth");
        assert!(p.bth.se && p.bth.pad == 0 && p.payload == [0xAB; 44]);
    }

    #[test]
    fn tcp_checksum_verifies() {
        let s = SocketAddrV4::new(Ipv4Addr::new(192, 168, 1, 10), 40000);
        let d = SocketAddrV4::new(Ipv4Addr::new(192, 168, 1, 20), 12345);
        let f = tcp_frame(s, d, 1, 2, tcp_flags::SYN, true, b"abc");
        let tcp = &f[34..];
        let mut pseudo = [0u8; 12];
        pseudo[..4].copy_from_slice(&s.ip().octets());
        pseudo[4..8].copy_from_slice(&d.ip().octets());
        pseudo[9] = 6;
        pseudo[10..12].copy_from_slice(&(tcp.len() as u16).to_be_bytes());
        assert_eq!(checksum16(&[&pseudo, tcp]), 0);
        assert_eq!(tcp_option::find_in_tcp_header(tcp), Ok(true));
    }
}
