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

/// Read a pcap or pcapng capture (detected by its magic number) and dissect every
/// Ethernet frame in it.
pub fn read_capture(mut r: impl Read) -> Result<Vec<Finding>, ReadError> {
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
    Ok(out)
}
