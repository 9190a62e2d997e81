//! Finds SMC-R messages in captured frames (pcap or pcapng): CLC messages in TCP streams,
//! the SMC TCP option on SYNs, and LLC/CDC messages in RoCEv2 (UDP 4791) or RoCEv1
//! (EtherType 0x8915) SEND frames.

use std::collections::HashMap;
use std::io::Read;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use pcap_file::pcap::PcapReader;
use pcap_file::pcapng::{Block, PcapNgReader};

use crate::capture::ROCEV2_UDP_PORT;
use crate::llc_v2::LLC_V2_MAX_LEN;

/// Largest SEND payload reported: an LLC v2 message.
const MAX_SEND_LEN: usize = LLC_V2_MAX_LEN;
use crate::clc::{ClcHeader, HEADER_LEN};
use crate::roce;
use crate::{tcp_option, MSG44_LEN};

/// Where a found message came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// The payload of a TCP stream.
    Tcp {
        /// Sender.
        src: SocketAddr,
        /// Receiver.
        dst: SocketAddr,
    },
    /// An InfiniBand SEND carried by RoCE.
    Roce {
        /// Destination QP number from the BTH.
        dest_qp: u32,
        /// Packet sequence number from the BTH.
        psn: u32,
    },
}

/// What was found in a frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// A SYN carrying the SMC TCP option (`syn_ack` for the SYN-ACK).
    TcpOption {
        /// Whether the segment also had ACK set.
        syn_ack: bool,
    },
    /// The bytes of one whole CLC message (not yet validated beyond the header).
    Clc(Vec<u8>),
    /// The payload of a SEND (LLC v1/v2 or CDC, 44..8192 bytes, not yet validated).
    Send(Vec<u8>),
    /// A CLC stream became unreadable (bad header): the reason, and the flow is dropped.
    ClcError(crate::Error),
    /// A RoCEv2 packet whose ICRC is wrong for the IP and UDP headers it was captured with
    /// (`packet`: its index in a datagram captured before segmentation, else 0).
    IcrcMismatch {
        /// Index of the packet in its datagram.
        packet: usize,
    },
}

/// What the RoCEv2 frames of a capture held, counted by [`Dissector`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RoceTally {
    /// UDP datagrams to port 4791.
    pub frames: usize,
    /// RoCE packets in them (more than `frames` when some were captured before segmentation).
    pub packets: usize,
    /// Datagrams captured before UDP segmentation (`UDP_SEGMENT`/GSO on the sending host or a
    /// veth, or merged by GRO on the receiving one): several RoCE packets of one size (the last
    /// may be shorter), packet k sent with IPv4 identification id + k.
    pub segmented: usize,
    /// Packets whose ICRC verified.
    pub icrc_ok: usize,
}

/// One finding: frame number (1-based), origin and content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// Frame number in the capture, 1-based.
    pub frame: usize,
    /// Origin.
    pub origin: Origin,
    /// Content.
    pub found: Found,
}

/// An error reading a capture file.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// Neither pcap nor pcapng, or a damaged file.
    #[error("cannot read capture: {0}")]
    Pcap(pcap_file::PcapError),
    /// I/O.
    #[error("cannot read capture: {0}")]
    Io(std::io::Error),
}

// By hand rather than `#[from]` (which would also make the cause the `source`, printed twice
// in a chain of causes after the message that includes it).
impl From<pcap_file::PcapError> for ReadError {
    fn from(e: pcap_file::PcapError) -> Self {
        ReadError::Pcap(e)
    }
}

impl From<std::io::Error> for ReadError {
    fn from(e: std::io::Error) -> Self {
        ReadError::Io(e)
    }
}

#[derive(Default)]
struct Flow {
    buf: Vec<u8>,
    dead: bool,
}

/// Stateful dissector: feed it Ethernet frames in order.
#[derive(Default)]
pub struct Dissector {
    /// RoCEv2 frames, packets and ICRC results so far.
    pub roce: RoceTally,
    flows: HashMap<(SocketAddr, SocketAddr), Flow>,
    /// SENDs being reassembled, by destination QP.
    sends: HashMap<u32, Vec<u8>>,
    frame: usize,
}

impl Dissector {
    /// A new dissector.
    pub fn new() -> Self {
        Self::default()
    }

    /// Dissect one Ethernet frame; returns what it held.
    pub fn frame(&mut self, data: &[u8]) -> Vec<Finding> {
        self.frame += 1;
        let mut out = Vec::new();
        let Some(ethertype) = data.get(12..14) else {
            return out;
        };
        let ethertype = u16::from_be_bytes([ethertype[0], ethertype[1]]);
        let rest = &data[14..];
        match ethertype {
            0x0800 => self.ipv4(rest, &mut out),
            0x86DD => self.ipv6(rest, &mut out),
            // RoCEv1: 40-byte GRH, then the BTH.
            0x8915 => {
                if let Some(ib) = rest.get(40..) {
                    self.bth(ib, &mut out);
                }
            }
            _ => {}
        }
        out
    }

    fn ipv4(&mut self, p: &[u8], out: &mut Vec<Finding>) {
        let Some(&vihl) = p.first() else { return };
        let ihl = usize::from(vihl & 0x0F) * 4;
        if vihl >> 4 != 4 || ihl < 20 || p.len() < ihl {
            return;
        }
        let total = usize::from(u16::from_be_bytes([p[2], p[3]])).clamp(ihl, p.len());
        if is_rocev2(p[9], &p[ihl..total]) {
            return self.roce_datagram(&p[..total], ihl + 8, out);
        }
        let src = IpAddr::V4(Ipv4Addr::new(p[12], p[13], p[14], p[15]));
        let dst = IpAddr::V4(Ipv4Addr::new(p[16], p[17], p[18], p[19]));
        self.l4(p[9], src, dst, &p[ihl..total], out);
    }

    fn ipv6(&mut self, p: &[u8], out: &mut Vec<Finding>) {
        if p.len() < 40 {
            return;
        }
        let mut s = [0u8; 16];
        let mut d = [0u8; 16];
        s.copy_from_slice(&p[8..24]);
        d.copy_from_slice(&p[24..40]);
        let plen = usize::from(u16::from_be_bytes([p[4], p[5]]));
        let end = (40 + plen).min(p.len());
        if is_rocev2(p[6], &p[40..end]) {
            return self.roce_datagram(&p[..end], 48, out);
        }
        self.l4(
            p[6],
            IpAddr::V6(Ipv6Addr::from(s)),
            IpAddr::V6(Ipv6Addr::from(d)),
            &p[40..end],
            out,
        );
    }

    fn l4(&mut self, proto: u8, src: IpAddr, dst: IpAddr, p: &[u8], out: &mut Vec<Finding>) {
        match proto {
            6 => self.tcp(src, dst, p, out),
            17 if p.len() >= 8 && u16::from_be_bytes([p[2], p[3]]) == ROCEV2_UDP_PORT => {
                self.bth(&p[8..], out)
            }
            _ => {}
        }
    }

    fn tcp(&mut self, src: IpAddr, dst: IpAddr, p: &[u8], out: &mut Vec<Finding>) {
        if p.len() < 20 {
            return;
        }
        let sport = u16::from_be_bytes([p[0], p[1]]);
        let dport = u16::from_be_bytes([p[2], p[3]]);
        let off = usize::from(p[12] >> 4) * 4;
        let flags = p[13];
        if off < 20 || off > p.len() {
            return;
        }
        let src = SocketAddr::new(src, sport);
        let dst = SocketAddr::new(dst, dport);
        let origin = Origin::Tcp { src, dst };
        if flags & 0x02 != 0 {
            if let Ok(true) = tcp_option::find_in_tcp_header(p) {
                out.push(Finding {
                    frame: self.frame,
                    origin: origin.clone(),
                    found: Found::TcpOption {
                        syn_ack: flags & 0x10 != 0,
                    },
                });
            }
            return;
        }
        let payload = &p[off..];
        if payload.is_empty() {
            return;
        }
        let flow = self.flows.entry((src, dst)).or_default();
        if flow.dead {
            return;
        }
        flow.buf.extend_from_slice(payload);
        loop {
            if flow.buf.len() < HEADER_LEN {
                break;
            }
            match ClcHeader::parse(&flow.buf[..HEADER_LEN]) {
                Ok(h) => {
                    let len = usize::from(h.length);
                    if flow.buf.len() < len {
                        break;
                    }
                    let msg: Vec<u8> = flow.buf.drain(..len).collect();
                    out.push(Finding {
                        frame: self.frame,
                        origin: origin.clone(),
                        found: Found::Clc(msg),
                    });
                }
                Err(e) => {
                    // Not (or no longer) CLC: the rest of the stream is application data.
                    // Only report it when it looked like CLC (eye catcher present).
                    flow.dead = true;
                    let looked_like_clc = flow.buf.starts_with(&crate::EYECATCHER_SMCR)
                        || flow.buf.starts_with(&crate::EYECATCHER_SMCD);
                    flow.buf.clear();
                    if looked_like_clc {
                        out.push(Finding {
                            frame: self.frame,
                            origin: origin.clone(),
                            found: Found::ClcError(e),
                        });
                    }
                    break;
                }
            }
        }
    }

    /// A RoCEv2 datagram with its IP header: its ICRC checked, and when it is not one packet
    /// but several captured before segmentation, cut into them (each checked with its own
    /// identification) so that every SEND inside is found.
    /// `ib` is where the BTH starts.
    fn roce_datagram(&mut self, ip: &[u8], ib: usize, out: &mut Vec<Finding>) {
        self.roce.frames += 1;
        let Some((h, payload)) = roce::icrc_of_ip_packet(ip) else {
            // IPv4 options: not what RoCE sends; read unchecked.
            if let Some(packet) = ip.get(ib..) {
                self.roce.packets += 1;
                self.bth(packet, out);
            }
            return;
        };
        if h.verify(payload) {
            self.roce.packets += 1;
            self.roce.icrc_ok += 1;
            return self.bth(payload, out);
        }
        let Some(size) = segment_size(&h, payload) else {
            self.roce.packets += 1;
            out.push(Finding {
                frame: self.frame,
                origin: roce_origin(payload),
                found: Found::IcrcMismatch { packet: 0 },
            });
            return self.bth(payload, out);
        };
        self.roce.segmented += 1;
        for (k, packet) in payload.chunks(size).enumerate() {
            let hk = roce::IcrcHeaders {
                ipv4_id: h.ipv4_id.wrapping_add(k as u16),
                ..h
            };
            self.roce.packets += 1;
            if hk.verify(packet) {
                self.roce.icrc_ok += 1;
            } else {
                out.push(Finding {
                    frame: self.frame,
                    origin: roce_origin(packet),
                    found: Found::IcrcMismatch { packet: k },
                });
            }
            self.bth(packet, out);
        }
    }

    fn bth(&mut self, ib: &[u8], out: &mut Vec<Finding>) {
        // BTH (12) + payload + pad + ICRC (4), read by the shared RoCE codec.
        let Ok(p) = roce::Packet::parse(ib) else {
            return;
        };
        let (dest_qp, psn, payload) = (p.bth.dest_qp, p.bth.psn, p.payload);
        // A SEND longer than the path MTU (an LLC v2 message of up to 8192 bytes) arrives as
        // FIRST, MIDDLE..., LAST; the pieces are joined per destination QP.
        let whole = match p.bth.opcode {
            roce::Opcode::SEND_ONLY => {
                self.sends.remove(&dest_qp);
                payload.to_vec()
            }
            roce::Opcode::SEND_FIRST => {
                self.sends.insert(dest_qp, payload.to_vec());
                return;
            }
            roce::Opcode::SEND_MIDDLE => {
                if let Some(b) = self.sends.get_mut(&dest_qp) {
                    if b.len() + payload.len() <= MAX_SEND_LEN {
                        b.extend_from_slice(payload);
                    } else {
                        self.sends.remove(&dest_qp);
                    }
                }
                return;
            }
            roce::Opcode::SEND_LAST => match self.sends.remove(&dest_qp) {
                Some(mut b) => {
                    b.extend_from_slice(payload);
                    b
                }
                None => return,
            },
            _ => return,
        };
        if whole.len() < MSG44_LEN || whole.len() > MAX_SEND_LEN {
            return;
        }
        out.push(Finding {
            frame: self.frame,
            origin: Origin::Roce { dest_qp, psn },
            found: Found::Send(whole),
        });
    }
}

/// Whether an IP payload of protocol `proto` is a UDP datagram to the RoCEv2 port.
fn is_rocev2(proto: u8, l4: &[u8]) -> bool {
    proto == 17 && l4.len() >= 8 && u16::from_be_bytes([l4[2], l4[3]]) == ROCEV2_UDP_PORT
}

/// The BTH's destination QP and PSN, for a finding about a packet (zeros if it has no BTH).
fn roce_origin(packet: &[u8]) -> Origin {
    match packet.first_chunk::<{ roce::BTH_LEN }>() {
        Some(b) => {
            let bth = roce::Bth::parse(b);
            Origin::Roce {
                dest_qp: bth.dest_qp,
                psn: bth.psn,
            }
        }
        None => Origin::Roce { dest_qp: 0, psn: 0 },
    }
}

/// Largest RoCE packet looked for at the start of a segmented datagram: a 4096-byte path MTU
/// with the largest headers (BTH, RETH, ImmDt or AETH) and the ICRC.
const MAX_SEGMENT: usize = 4096 + 64;

/// The segment size of a datagram captured before segmentation: the length of its first
/// packet, the shortest prefix (RoCE packets are whole 4-byte words) whose ICRC verifies for
/// the datagram's own identification — the kernel gives packet k identification id + k, and
/// every packet but the last has this length. `None` when no prefix verifies: one packet, with
/// a wrong ICRC. (A prefix that verifies by chance has probability 2⁻³² per length tried.)
fn segment_size(h: &roce::IcrcHeaders, payload: &[u8]) -> Option<usize> {
    let limit = payload.len().saturating_sub(1).min(MAX_SEGMENT);
    (roce::BTH_LEN + roce::ICRC_LEN..=limit)
        .step_by(4)
        .find(|&n| h.verify(&payload[..n]))
}

/// Read a pcap or pcapng capture (detected by its magic number) and dissect every
/// Ethernet frame in it.
pub fn read_capture(r: impl Read) -> Result<Vec<Finding>, ReadError> {
    read_capture_tally(r).map(|(f, _)| f)
}

/// As [`read_capture`], with what the RoCEv2 frames held.
pub fn read_capture_tally(mut r: impl Read) -> Result<(Vec<Finding>, RoceTally), ReadError> {
    let mut data = Vec::new();
    r.read_to_end(&mut data)?;
    let mut d = Dissector::new();
    let mut out = Vec::new();
    if data.starts_with(&[0x0A, 0x0D, 0x0D, 0x0A]) {
        let mut rd = PcapNgReader::new(&data[..])?;
        while let Some(block) = rd.next_block() {
            match block? {
                Block::EnhancedPacket(p) => out.extend(d.frame(&p.data)),
                Block::SimplePacket(p) => out.extend(d.frame(&p.data)),
                _ => {}
            }
        }
    } else {
        let mut rd = PcapReader::new(&data[..])?;
        while let Some(p) = rd.next_packet() {
            out.extend(d.frame(&p?.data));
        }
    }
    Ok((out, d.roce))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capture::{ethernet, ipv4_header, ROCEV2_SRC_PORT};
    use crate::types::Mac;

    /// RC packets to QP 0x33: `writes` WRITE MIDDLEs of 1024 bytes, then a SEND ONLY of a
    /// 44-byte message; packet k sealed for IPv4 identification `id + k` (as the kernel numbers
    /// the segments of one `UDP_SEGMENT` send).
    fn packets(writes: usize, id: u16) -> Vec<Vec<u8>> {
        let (src, dst) = (Ipv4Addr::new(10, 1, 0, 2), Ipv4Addr::new(10, 1, 0, 1));
        let data = [0x5Au8; 1024];
        let msg = [0xFEu8; MSG44_LEN];
        (0..=writes)
            .map(|k| {
                let last = k == writes;
                let repr = roce::PacketRepr {
                    bth: roce::Bth {
                        opcode: if last {
                            roce::Opcode::SEND_ONLY
                        } else {
                            roce::Opcode::WRITE_MIDDLE
                        },
                        pkey: roce::DEFAULT_PKEY,
                        dest_qp: 0x33,
                        psn: 100 + k as u32,
                        ..roce::Bth::default()
                    },
                    reth: None,
                    aeth: None,
                    immdt: None,
                    payload: if last { &msg[..] } else { &data[..] },
                };
                let mut ib = vec![0u8; repr.buffer_len()];
                repr.emit(&mut ib).expect("emit");
                roce::IcrcHeaders {
                    ipv4_id: id.wrapping_add(k as u16),
                    ..roce::IcrcHeaders::new(src.into(), dst.into(), ROCEV2_SRC_PORT)
                }
                .seal(&mut ib);
                ib
            })
            .collect()
    }

    /// One Ethernet frame holding the packets as one UDP datagram with identification `id`.
    fn datagram(packets: &[Vec<u8>], id: u16) -> Vec<u8> {
        let ib: Vec<u8> = packets.concat();
        let udp_len = 8 + ib.len();
        let mut f = ethernet(Mac([2; 6]), Mac([4; 6]), 0x0800).to_vec();
        let ip = ipv4_header(
            Ipv4Addr::new(10, 1, 0, 2),
            Ipv4Addr::new(10, 1, 0, 1),
            17,
            udp_len,
            id,
        );
        f.extend_from_slice(&ip);
        f.extend_from_slice(&ROCEV2_SRC_PORT.to_be_bytes());
        f.extend_from_slice(&ROCEV2_UDP_PORT.to_be_bytes());
        f.extend_from_slice(&(udp_len as u16).to_be_bytes());
        f.extend_from_slice(&[0, 0]);
        f.extend_from_slice(&ib);
        f
    }

    #[test]
    fn a_datagram_captured_before_segmentation_is_cut_and_every_icrc_checked() {
        // As segmented on the wire: one packet per datagram, identification id + k each.
        let mut d = Dissector::new();
        let ps = packets(3, 7);
        let mut found = Vec::new();
        for (k, p) in ps.iter().enumerate() {
            found.extend(d.frame(&datagram(std::slice::from_ref(p), 7 + k as u16)));
        }
        assert_eq!(d.roce.packets, 4);
        assert_eq!(d.roce.icrc_ok, 4);
        assert_eq!(d.roce.segmented, 0);
        assert!(matches!(&found[..], [Finding { found: Found::Send(m), .. }] if m.len() == 44));

        // As captured before segmentation: one datagram with the first identification; the
        // SEND at its end is found, every packet's ICRC verifies.
        let mut d = Dissector::new();
        let found = d.frame(&datagram(&ps, 7));
        assert_eq!(
            d.roce,
            RoceTally {
                frames: 1,
                packets: 4,
                segmented: 1,
                icrc_ok: 4
            }
        );
        assert!(matches!(
            &found[..],
            [Finding {
                found: Found::Send(_),
                ..
            }]
        ));

        // A byte changed in the third packet: that packet's ICRC is reported wrong, the others
        // still verify.
        let mut bad = ps.clone();
        bad[2][40] ^= 1;
        let mut d = Dissector::new();
        let found = d.frame(&datagram(&bad, 7));
        assert_eq!(d.roce.icrc_ok, 3);
        assert!(found
            .iter()
            .any(|f| f.found == Found::IcrcMismatch { packet: 2 }
                && f.origin
                    == Origin::Roce {
                        dest_qp: 0x33,
                        psn: 102
                    }));

        // One packet with a wrong ICRC (no prefix verifies): one mismatch, nothing cut.
        let mut one = packets(0, 0);
        one[0][20] ^= 0x80;
        let mut d = Dissector::new();
        let found = d.frame(&datagram(&one, 0));
        assert_eq!(
            (d.roce.packets, d.roce.icrc_ok, d.roce.segmented),
            (1, 0, 0)
        );
        assert!(found
            .iter()
            .any(|f| f.found == Found::IcrcMismatch { packet: 0 }));
    }
}
