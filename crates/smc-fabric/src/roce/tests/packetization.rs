//! What a WRITE looks like on the wire (qp.rs, `post`): one WRITE ONLY message per path MTU,
//! each with its own RETH, so that an update and the CDC SEND behind it make one
//! `UDP_SEGMENT` run; and that the responder still takes rxe's WRITE FIRST / MIDDLE / LAST.

use super::*;
use crate::error::FabricError;
use crate::roce::rx::{packets, set_gro, RxRing};
use std::os::fd::{AsFd, OwnedFd};

/// A device on `me` with one QP connected to a plain UDP socket on `peer_ip`:4791 (QPN
/// `PEER_QPN`, PSN 0, MTU 1024) that receives with `UDP_GRO`, as our devices do.
struct RawPeer {
    a: End,
    me: Ipv4Addr,
    peer_ip: Ipv4Addr,
    sock: std::net::UdpSocket,
    fd: OwnedFd,
    ring: RxRing,
}

const PEER_QPN: u32 = 0x4343;

fn raw_peer(test: u8) -> RawPeer {
    let me = addr(test, 0);
    let peer_ip = addr(test, 1);
    let a = end(
        RoceHandle::open_at(&fabric(Vec::new()), "ra", Some(me)).expect("open ra"),
        4,
    );
    let sock = std::net::UdpSocket::bind((peer_ip, wire::UDP_PORT)).expect("bind peer");
    assert!(set_gro(sock.as_fd(), true), "UDP_GRO on the peer's socket");
    let fd = OwnedFd::from(sock.try_clone().expect("clone"));
    let mut gid = [0u8; 16];
    gid[10] = 0xFF;
    gid[11] = 0xFF;
    gid[12..].copy_from_slice(&peer_ip.octets());
    a.qp.to_rtr(
        None,
        RemoteQpInfo {
            gid: crate::Gid(gid),
            qp_num: PEER_QPN,
            psn: 0,
            mtu: crate::Mtu::Mtu1024,
        },
    )
    .expect("rtr");
    a.qp.to_rts().expect("rts");
    RawPeer {
        a,
        me,
        peer_ip,
        sock,
        fd,
        ring: RxRing::new(),
    }
}

/// One received datagram: the `UDP_GRO` segment size (None: not coalesced) and its packets.
type Datagram = (Option<usize>, Vec<Vec<u8>>);

impl RawPeer {
    /// Datagrams from the device until `want` packets arrived (or 5 s passed).
    fn datagrams(&mut self, want: usize) -> Vec<Datagram> {
        let mut out: Vec<Datagram> = Vec::new();
        let end = Instant::now() + Duration::from_secs(5);
        while out.iter().map(|d| d.1.len()).sum::<usize>() < want && Instant::now() < end {
            let n = self.ring.receive(&self.fd);
            if n == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            for i in 0..n {
                let (from, data, seg) = self.ring.datagram(i);
                assert_eq!(from.ip(), std::net::IpAddr::V4(self.me));
                out.push((seg, packets(data, seg).map(<[u8]>::to_vec).collect()));
            }
        }
        out
    }

    /// The datagrams waiting in the socket now.
    fn datagrams_now(&mut self) -> Vec<Datagram> {
        let mut out = Vec::new();
        loop {
            let n = self.ring.receive(&self.fd);
            if n == 0 {
                return out;
            }
            for i in 0..n {
                let (_, data, seg) = self.ring.datagram(i);
                out.push((seg, packets(data, seg).map(<[u8]>::to_vec).collect()));
            }
        }
    }

    /// Acknowledge everything up to `psn`.
    fn ack(&self, psn: u32) {
        self.acknowledge(psn, wire::AethKind::Ack { credit: 31 });
    }

    /// An Acknowledge packet of `kind` for `psn`.
    fn acknowledge(&self, psn: u32, kind: wire::AethKind) {
        let repr = wire::PacketRepr {
            bth: wire::Bth {
                opcode: wire::Opcode::ACKNOWLEDGE,
                pkey: wire::DEFAULT_PKEY,
                dest_qp: self.a.qp.qpn,
                psn,
                ..wire::Bth::default()
            },
            reth: None,
            aeth: Some(wire::Aeth::new(kind, 0)),
            immdt: None,
            payload: &[],
        };
        let mut b = vec![0u8; repr.buffer_len()];
        repr.emit(&mut b).expect("emit");
        wire::IcrcHeaders::new(self.peer_ip.into(), self.me.into(), wire::UDP_PORT).seal(&mut b);
        self.sock
            .send_to(&b, (self.me, wire::UDP_PORT))
            .expect("ack");
    }

    /// A held WRITE of `data` to `va` and the 44-byte SEND after it (an SMC-R update); retried
    /// (after acknowledging what came) when this thread was kept off the CPU between the two
    /// posts for longer than the hold limit, so that the WRITE left alone. Returns the
    /// datagrams and the PSN of the SEND.
    fn update(&mut self, data: &[u8], va: u64, psn: &mut u32) -> Vec<Datagram> {
        self.update_wr(
            &SendWr::WriteInline {
                wr_id: 1,
                data,
                remote_addr: va,
                rkey: 0x77,
                signaled: false,
            },
            data.len(),
            psn,
        )
    }

    /// A packed WRITE of `data` to `va` (`RoceQp::post_write_packed`) and the 44-byte SEND
    /// after it; the WRITE's buffer.
    fn packed_update(&self, data: &[u8], va: u64) -> crate::PackedBytes {
        let packed = self
            .a
            .qp
            .post_write_packed(1, data, va, 0x77)
            .expect("packed")
            .expect("a QP ready to send");
        self.cdc();
        packed
    }

    /// The 44-byte SEND of an update (work request 2, signaled), ringing the doorbell.
    fn cdc(&self) {
        self.a
            .qp
            .post_send(&SendWr::Send {
                wr_id: 2,
                data: &[0xCD; 44],
                signaled: true,
            })
            .expect("send");
    }

    /// [`update`](Self::update) with the WRITE `wr` of `len` bytes.
    fn update_wr(&mut self, wr: &SendWr<'_>, len: usize, psn: &mut u32) -> Vec<Datagram> {
        let want = len.div_ceil(1024).max(1) + 1;
        for attempt in 0..3 {
            self.a.qp.post_send_held(wr).expect("write");
            self.cdc();
            let got = self.datagrams(want);
            let n: usize = got.iter().map(|d| d.1.len()).sum();
            assert_eq!(n, want, "packets of the update");
            *psn = wire::psn_add(*psn, want as u32);
            let last = wire::psn_add(*psn, wire::U24_MASK);
            self.ack(last);
            let done = collect(&self.a.cq, 1);
            assert_eq!((done[0].wr_id, done[0].status), (2, WcStatus::Success));
            // The WRITE left alone (the hold limit passed): its last packet asks for an ACK.
            let alone = got.iter().flat_map(|d| &d.1).any(|p| {
                wire::Packet::parse(p)
                    .is_ok_and(|p| p.bth.opcode == wire::Opcode::WRITE_ONLY && p.bth.ack_req)
            });
            if !alone || attempt == 2 {
                return got;
            }
        }
        unreachable!()
    }

    /// Check the packets of an update: WRITE ONLYs of at most one MTU, each RETH naming its
    /// piece, payloads equal to `data`'s, consecutive PSNs from `first`, no AckReq; then the
    /// SEND with AckReq; every ICRC sealed for the IPv4 identification the kernel gives
    /// segment k of its datagram (k).
    fn check(&self, got: &[Datagram], data: &[u8], va: u64, first: u32) {
        self.check_with(got, data, va, first, &|_| false);
    }

    /// [`check`](Self::check) with AckReq on the WRITE's packets `ack_req` says (by index).
    fn check_with(
        &self,
        got: &[Datagram],
        data: &[u8],
        va: u64,
        first: u32,
        ack_req: &dyn Fn(usize) -> bool,
    ) {
        let mut psn = first;
        let mut off = 0usize;
        let all: Vec<(usize, &Vec<u8>)> = got
            .iter()
            .flat_map(|(_, pkts)| pkts.iter().enumerate())
            .collect();
        let h = wire::IcrcHeaders::new(self.me.into(), self.peer_ip.into(), wire::UDP_PORT);
        for (n, &(k, pkt)) in all.iter().enumerate() {
            let cols = crate::roce::gso::id_columns(pkt.len());
            let wire_icrc = pkt.last_chunk::<4>().map(|t| u32::from_le_bytes(*t));
            assert_eq!(
                wire_icrc,
                Some(h.compute(pkt) ^ cols.delta(k as u16)),
                "ICRC of packet {n} (segment {k})"
            );
            let p = wire::Packet::parse(pkt).expect("parse");
            assert_eq!((p.bth.dest_qp, p.bth.psn), (PEER_QPN, psn), "packet {n}");
            psn = wire::psn_add(psn, 1);
            if n + 1 == all.len() {
                assert_eq!(p.bth.opcode, wire::Opcode::SEND_ONLY);
                assert!(p.bth.ack_req && p.bth.se);
                assert_eq!(p.payload, &[0xCD; 44]);
                continue;
            }
            assert_eq!(p.bth.opcode, wire::Opcode::WRITE_ONLY, "packet {n}");
            assert_eq!(p.bth.ack_req, ack_req(n), "AckReq of packet {n}");
            let piece = &data[off..(off + 1024).min(data.len())];
            assert_eq!(
                p.reth,
                Some(wire::Reth {
                    va: va + off as u64,
                    rkey: 0x77,
                    dma_len: piece.len() as u32,
                }),
                "RETH of packet {n}"
            );
            assert!(p.payload == piece, "payload of packet {n}");
            let pad = usize::from(p.bth.pad);
            assert_eq!(
                pkt[pkt.len() - 4 - pad..pkt.len() - 4],
                [0u8; 3][..pad],
                "pad of packet {n}"
            );
            off += piece.len();
        }
        assert_eq!(off, data.len(), "the WRITE's bytes, each once");
    }
}

/// Segment sizes and packet counts of each datagram.
fn shape(got: &[Datagram]) -> Vec<(Option<usize>, usize)> {
    got.iter().map(|(s, p)| (*s, p.len())).collect()
}

impl RawPeer {
    /// Room for a window's datagrams (eight of 64 KiB) in the peer's socket, as our devices
    /// make for theirs; false, said on stderr, without root (the test is skipped).
    fn room_for_a_window(&self) -> bool {
        let ok = crate::roce::device::setsockopt_int(
            &self.sock,
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            8 << 20,
        )
        .is_ok();
        if !ok {
            eprintln!("skipped: SO_RCVBUFFORCE needs root (a window's datagrams would not fit)");
        }
        ok
    }

    /// Every packet of `got` with its ICRC checked (sealed for its segment in its datagram)
    /// and parsed, with its index: its PSN's distance from `first`. Returns how often each
    /// index below `n` arrived.
    fn each_packet(
        &self,
        got: &[Datagram],
        first: u32,
        n: usize,
        mut f: impl FnMut(usize, &wire::Packet<'_>),
    ) -> Vec<usize> {
        let h = wire::IcrcHeaders::new(self.me.into(), self.peer_ip.into(), wire::UDP_PORT);
        let mut seen = vec![0usize; n];
        for (seg, pkt) in got.iter().flat_map(|d| d.1.iter().enumerate()) {
            let cols = crate::roce::gso::id_columns(pkt.len());
            let icrc = pkt.last_chunk::<4>().map(|t| u32::from_le_bytes(*t));
            assert_eq!(icrc, Some(h.compute(pkt) ^ cols.delta(seg as u16)));
            let x = wire::Packet::parse(pkt).expect("parse");
            let i = (x.bth.psn.wrapping_sub(first) & wire::U24_MASK) as usize;
            if let Some(k) = seen.get_mut(i) {
                *k += 1;
            }
            f(i, &x);
        }
        seen
    }
}

/// A WRITE leaves as one WRITE ONLY message per path MTU, each with its own RETH: an update
/// of 61 KiB and its CDC SEND reach a peer with `UDP_GRO` as one datagram (62 packets: 61 of
/// 1,056 bytes, the SEND of 60 last); one of 64 KiB, which cannot fit one UDP datagram
/// (65,507 bytes), as two, the larger first; one with a shorter last piece as two.
#[test]
fn write_only_per_mtu_one_datagram_per_update() {
    let mut p = raw_peer(11);
    // The device's first PSN is its own (random).
    let mut psn = p.a.qp.local_info().psn;
    let va = 0x7000_0000;

    let data = pattern(61 * 1024, 1);
    let first = psn;
    let got = p.update(&data, va, &mut psn);
    assert_eq!(shape(&got), [(Some(1056), 62)], "one datagram");
    assert_eq!(got[0].1.last().map(Vec::len), Some(60));
    p.check(&got, &data, va, first);

    let data = pattern(64 * 1024, 2);
    let first = psn;
    let got = p.update(&data, va + 0x10000, &mut psn);
    assert_eq!(shape(&got), [(Some(1056), 62), (Some(1056), 3)]);
    p.check(&got, &data, va + 0x10000, first);

    let data = pattern(1500, 3);
    let first = psn;
    let got = p.update(&data, va + 3, &mut psn);
    assert_eq!(shape(&got), [(Some(1056), 2), (None, 1)]);
    p.check(&got, &data, va + 3, first);
    assert_eq!(p.a.qp.state(), QpState::Rts);
    assert!(!p.a.qp.has_unacked());
}

/// The responder still takes a WRITE of FIRST / MIDDLE / LAST packets (how rxe sends one):
/// the bytes land where the RETH of the first says, the LAST's AckReq is answered with an
/// ACK of its PSN; a WRITE ONLY after it too. A MIDDLE without a FIRST is NAKed (invalid
/// request) and fails the QP.
#[test]
fn responder_takes_write_first_middle_last() {
    let p = raw_peer(12);
    let a = &p.a;
    // Connected with the peer's PSN 0: the first request it takes is PSN 0.
    let send = |op: wire::Opcode, psn: u32, reth: Option<wire::Reth>, payload: &[u8], req| {
        let repr = wire::PacketRepr {
            bth: wire::Bth {
                opcode: op,
                pkey: wire::DEFAULT_PKEY,
                dest_qp: a.qp.qpn,
                ack_req: req,
                psn,
                ..wire::Bth::default()
            },
            reth,
            aeth: None,
            immdt: None,
            payload,
        };
        let mut b = vec![0u8; repr.buffer_len()];
        repr.emit(&mut b).expect("emit");
        wire::IcrcHeaders::new(p.peer_ip.into(), p.me.into(), wire::UDP_PORT).seal(&mut b);
        p.sock.send_to(&b, (p.me, wire::UDP_PORT)).expect("send");
    };
    let data = pattern(2500, 7);
    let reth = |va: u64, len: usize| {
        Some(wire::Reth {
            va,
            rkey: a.rmb.key,
            dma_len: len as u32,
        })
    };
    let base = a.rmb.vaddr() + 100;
    send(
        wire::Opcode::WRITE_FIRST,
        0,
        reth(base, 2500),
        &data[..1024],
        false,
    );
    send(
        wire::Opcode::WRITE_MIDDLE,
        1,
        None,
        &data[1024..2048],
        false,
    );
    send(wire::Opcode::WRITE_LAST, 2, None, &data[2048..], true);
    send(
        wire::Opcode::WRITE_ONLY,
        3,
        reth(base + 5000, 100),
        &data[..100],
        true,
    );
    // The ACK of PSN 3 (the responder may coalesce them: the last one counts).
    let mut buf = [0u8; 256];
    p.sock
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut acked = None;
    while acked != Some(3) {
        let (n, _) = p.sock.recv_from(&mut buf).expect("an ACK");
        let ack = wire::Packet::parse(&buf[..n]).expect("parse");
        assert_eq!(ack.bth.opcode, wire::Opcode::ACKNOWLEDGE);
        assert!(matches!(
            ack.aeth.map(|a| a.kind()),
            Some(wire::AethKind::Ack { .. })
        ));
        acked = Some(ack.bth.psn);
    }
    let mut back = vec![0u8; 2500];
    a.rmb.read_at(100, &mut back).expect("read");
    assert!(back == data);
    a.rmb.read_at(5100, &mut back[..100]).expect("read");
    assert!(back[..100] == data[..100]);
    assert_eq!(a.qp.state(), QpState::Rts);

    send(wire::Opcode::WRITE_MIDDLE, 4, None, &data[..1024], true);
    let end = Instant::now() + Duration::from_secs(5);
    while a.qp.state() != QpState::Error && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(a.qp.state(), QpState::Error, "a MIDDLE without a FIRST");
    assert_eq!(
        a.dev.core.counters.naks_sent.load(Ordering::Relaxed),
        1,
        "NAK invalid request"
    );
}

/// `shortest_shared_write`: a WRITE of that many bytes and the 44-byte CDC SEND behind it
/// leave as one datagram (both packets 60 bytes, the WRITE's with 3 bytes of pad); one byte
/// less, as two (the SEND's packet would be the longer).
#[test]
fn shortest_shared_write_shares_the_sends_datagram() {
    let want = crate::roce::shortest_shared_write(44);
    assert_eq!(want, 25);
    let mut p = raw_peer(13);
    let mut psn = p.a.qp.local_info().psn;
    let va = 0x5000_0000;
    let data = pattern(want, 4);
    let first = psn;
    let got = p.update(&data, va, &mut psn);
    assert_eq!(shape(&got), [(Some(60), 2)], "one datagram");
    p.check(&got, &data, va, first);
    let data = pattern(want - 1, 5);
    let first = psn;
    let got = p.update(&data, va, &mut psn);
    assert_eq!(shape(&got), [(None, 1), (None, 1)], "two datagrams");
    p.check(&got, &data, va, first);
}

/// A WRITE from a registered region (`SendWr::Write`) is read from the region straight into
/// its packets: the same packets as a WRITE inline of the same bytes (one WRITE ONLY per path
/// MTU, RETHs, payloads, zero pad, ICRCs), at region offsets and lengths that are not
/// multiples of the MTU, up to the region's last byte, in buffers of the pool that held
/// longer and shorter packets before. A WRITE reaching outside the region fails with
/// `LocalAccess` (an unknown lkey or one of another protection domain with `InvalidLkey`)
/// and sends nothing, takes no PSN and leaves the QP as it was.
#[test]
fn write_from_region_is_read_into_its_packets() {
    let mut p = raw_peer(15);
    let mut psn = p.a.qp.local_info().psn;
    let rmb = p.a.rmb.clone();
    let region = rmb.len();
    let va = 0x6000_0000;
    let cases = [
        (0, 61 * 1024),
        (1, 3 * 1024 + 1),
        (4095, 1500),
        (region - 25, 25),
        (7, 1),
        (region - (64 * 1024 - 3), 64 * 1024 - 3),
        (3, 2 * 1024),
        (region - 1, 1),
    ];
    for (i, &(off, len)) in cases.iter().enumerate() {
        let data = pattern(len, 20 + i as u8);
        rmb.write_at(off, &data).expect("fill the region");
        let wr = SendWr::Write {
            wr_id: 1,
            local: Sge {
                addr: rmb.vaddr() + off as u64,
                length: len as u32,
                lkey: rmb.key,
            },
            remote_addr: va + off as u64,
            rkey: 0x77,
            signaled: false,
        };
        let first = psn;
        let got = p.update_wr(&wr, len, &mut psn);
        p.check(&got, &data, va + off as u64, first);
        // The same bytes inline: the same packets (the region's path is checked against
        // the path every update takes).
        let first = psn;
        let inline = p.update(&data, va + off as u64, &mut psn);
        p.check(&inline, &data, va + off as u64, first);
        assert_eq!(shape(&got), shape(&inline), "case {i}: datagrams");
    }

    let sent = p.a.dev.core.counters.tx_packets.load(Ordering::Relaxed);
    let other_pd = Arc::new(
        RoceMr::new(
            p.a.dev.core.alloc_key(),
            p.a.dev.core.alloc_pd(),
            4096,
            AccessFlags::LOCAL_WRITE,
        )
        .expect("mr"),
    );
    p.a.dev.core.add_mr(other_pd.clone());
    let bad = |addr: u64, length: u32, lkey: u32| SendWr::Write {
        wr_id: 9,
        local: Sge { addr, length, lkey },
        remote_addr: va,
        rkey: 0x77,
        signaled: true,
    };
    let base = rmb.vaddr();
    for (wr, want) in [
        (bad(base + region as u64 - 10, 11, rmb.key), "LocalAccess"),
        (bad(base + region as u64, 1, rmb.key), "LocalAccess"),
        (bad(base - 1, 2, rmb.key), "LocalAccess"),
        (bad(base + 4, u32::MAX, rmb.key), "LocalAccess"),
        (bad(other_pd.vaddr(), 16, other_pd.key), "InvalidLkey"),
        (bad(base, 16, 0xDEAD_BEEF), "InvalidLkey"),
    ] {
        let err = p.a.qp.post_send(&wr).expect_err("outside the region");
        assert!(
            matches!(
                (&err, want),
                (FabricError::LocalAccess, "LocalAccess")
                    | (FabricError::InvalidLkey(_), "InvalidLkey")
            ),
            "{wr:?}: {err:?}"
        );
    }
    assert_eq!(
        p.a.dev.core.counters.tx_packets.load(Ordering::Relaxed),
        sent,
        "nothing sent"
    );
    assert_eq!(p.a.qp.state(), QpState::Rts);
    assert!(!p.a.qp.has_unacked());
    // The next WRITE takes the next PSN: the failed posts took none.
    let data = pattern(100, 99);
    rmb.write_at(0, &data).expect("fill");
    let first = psn;
    let got = p.update_wr(
        &SendWr::Write {
            wr_id: 1,
            local: Sge {
                addr: base,
                length: 100,
                lkey: rmb.key,
            },
            remote_addr: va,
            rkey: 0x77,
            signaled: false,
        },
        100,
        &mut psn,
    );
    p.check(&got, &data, va, first);
}

/// A WRITE of shared bytes (`SendWr::WriteShared`) leaves as the same packets as a WRITE
/// inline of those bytes — one WRITE ONLY per path MTU, RETHs, payloads, zero pad, ICRCs
/// sealed for each segment's IPv4 identification — in the same datagrams, though its packets
/// are kept as headers, a slice of the shared buffer and the ICRC, and go out as iovecs: for
/// lengths of every pad, one that shares the CDC's datagram, slices starting inside their
/// buffer, and an update that needs two datagrams. The packets let go of the buffer once
/// acknowledged.
#[test]
fn write_shared_is_sent_as_write_inline() {
    let mut p = raw_peer(23);
    let mut psn = p.a.qp.local_info().psn;
    let va = 0x6000_0000;
    let all = bytes::Bytes::from(pattern(70_000, 9));
    let cases = [
        (0, 1),
        (1, 25),
        (3, 1023),
        (5, 1024),
        (7, 3001),
        (11, 65_536),
    ];
    for (i, (from, len)) in cases.into_iter().enumerate() {
        let data = all.slice(from..from + len);
        let at = va + (i as u64) * 0x20000;
        let first = psn;
        let got = p.update_wr(
            &SendWr::WriteShared {
                wr_id: 1,
                data: &data,
                remote_addr: at,
                rkey: 0x77,
                signaled: false,
            },
            len,
            &mut psn,
        );
        p.check(&got, &data, at, first);
        assert_eq!(shape(&got), inline_shape(len), "length {len}");
    }
    assert!(!p.a.qp.has_unacked());
    assert!(all.is_unique(), "acknowledged packets hold no slice");
}

/// The datagrams (segment size, packets) of a WRITE inline of `len` bytes and its CDC SEND:
/// one WRITE ONLY per 1,024 bytes (BTH, RETH, payload, pad, ICRC), then the SEND's 60-byte
/// packet, cut into runs as the device cuts them.
fn inline_shape(len: usize) -> Vec<(Option<usize>, usize)> {
    let mut lens: Vec<usize> = (0..len.div_ceil(1024))
        .map(|i| {
            let n = (len - i * 1024).min(1024);
            28 + n + wire::pad_len(n) + 4
        })
        .collect();
    lens.push(60);
    crate::roce::gso::runs(&lens)
        .into_iter()
        .map(|(s, e)| ((e - s > 1).then_some(lens[s]), e - s))
        .collect()
}

/// A packed WRITE (`RoceQp::post_write_packed`: its packets built end to end in one buffer
/// and sealed at post) leaves in the datagrams a WRITE inline of the same bytes takes, every
/// ICRC sealed for the packet's place in its datagram, AckReq on every 62nd packet and the
/// last (where a transmission may end); the buffer returned holds the WRITE's bytes piece by
/// piece; once all is acknowledged and the caller lets go of it, the next post of several
/// packets reuses it (no packet holds a slice of it any more).
#[test]
fn packed_writes_leave_as_sealed_at_post() {
    let mut p = raw_peer(26);
    let mut psn = p.a.qp.local_info().psn;
    let va = 0x5000_0000;
    let all = pattern(200_000, 4);
    let mut last_buf: Option<usize> = None;
    // Longest first: each post after the first finds the buffer it needs in the pool.
    for (i, len) in [130_000usize, 65_536, 61 * 1024, 3001, 1024, 1023, 25, 1]
        .into_iter()
        .enumerate()
    {
        let data = &all[i * 7..i * 7 + len];
        let at = va + (i as u64) * 0x40000;
        let mut got = Vec::new();
        let mut first = psn;
        let mut packed = None;
        for _ in 0..3 {
            first = psn;
            // An earlier attempt's buffer goes back to the pool first (the reuse below).
            drop(packed.take());
            let kept = p.packed_update(data, at);
            let want = len.div_ceil(1024) + 1;
            got = p.datagrams(want);
            assert_eq!(got.iter().map(|d| d.1.len()).sum::<usize>(), want);
            psn = wire::psn_add(psn, want as u32);
            p.ack(wire::psn_add(psn, wire::U24_MASK));
            let done = collect(&p.a.cq, 1);
            assert_eq!((done[0].wr_id, done[0].status), (2, WcStatus::Success));
            packed = Some(kept);
            // The WRITE left alone when this thread was off the CPU past the hold limit.
            if shape(&got) == inline_shape(len) {
                break;
            }
        }
        let packed = packed.expect("posted");
        assert_eq!(shape(&got), inline_shape(len), "length {len}");
        let count = len.div_ceil(1024);
        p.check_with(&got, data, at, first, &|n| n % 62 == 61 || n + 1 == count);
        assert_eq!(packed.pieces().collect::<Vec<_>>().concat(), data);
        assert_eq!(packed.len, len);
        // Pieces that do not overlap (smc-proto's replay store refuses any that do).
        assert!(
            packed.piece >= 1 && packed.stride >= packed.piece,
            "length {len}"
        );
        // A post of several packets takes the pool's buffer, a lone packet one of its own.
        if let (Some(b), true) = (last_buf, count > 1) {
            assert_eq!(
                packed.buf.as_ptr() as usize,
                b,
                "length {len}: the buffer reused"
            );
        }
        assert!(!p.a.qp.has_unacked());
        if count > 1 {
            last_buf = Some(packed.buf.as_ptr() as usize);
        }
    }
}

/// Go-back-N from inside a packed post (a PSN-sequence NAK for its 11th packet): the packets
/// from there leave again in a run that starts there, each a copy sealed for its new place in
/// the datagram (the kept packets were sealed for the places they had), with the same bytes.
#[test]
fn a_packed_post_resent_from_inside_a_run_is_resealed() {
    let mut p = raw_peer(27);
    let first = p.a.qp.local_info().psn;
    let va = 0x5800_0000;
    let data = pattern(64 * 1024, 5);
    let packed = p.packed_update(&data, va);
    let got = p.datagrams(65);
    assert_eq!(got.iter().map(|d| d.1.len()).sum::<usize>(), 65);
    let resend_from = wire::psn_add(first, 10);
    p.acknowledge(
        resend_from,
        wire::AethKind::Nak {
            code: wire::nak::PSN_SEQUENCE,
        },
    );
    let again = p.datagrams(55);
    assert_eq!(again.iter().map(|d| d.1.len()).sum::<usize>(), 55);
    // The WRITE's packets 10.. and the SEND, every ICRC for its segment in its datagram;
    // AckReq as posted (on packets 61 and 63 of the WRITE).
    p.check_with(
        &again,
        &data[10 * 1024..],
        va + 10 * 1024,
        resend_from,
        &|n| n + 10 == 61 || n + 10 == 63,
    );
    assert!(
        again.iter().any(|d| d.1.len() > 1),
        "the resent packets leave in runs"
    );
    p.ack(wire::psn_add(first, 64));
    let done = collect(&p.a.cq, 1);
    assert_eq!((done[0].wr_id, done[0].status), (2, WcStatus::Success));
    assert_eq!(packed.pieces().collect::<Vec<_>>().concat(), data);
    assert!(snapshot(&p.a.dev.core).retransmits >= 55);
}

/// A packed post longer than the requester's window (88 packets more than its 512 at a path
/// MTU of 1,024), nothing lost: the first transmission ends at the last AckReq packet the
/// window takes whole (packet 496: eight runs of 62) and nothing after it leaves before an
/// ACK; an ACK for a packet held back is a ghost (those packets have not left) and completes nothing;
/// the real ACK lets the rest go. Every packet leaves sealed for its place as posted (no
/// copies: each ICRC for its segment in its datagram), and the retransmissions counted are
/// the packets seen twice (the wait for anything past the window lets the retransmission
/// timer resend the first 496, which must stop there too).
#[test]
fn a_packed_post_longer_than_the_window_leaves_whole_runs() {
    let mut p = raw_peer(29);
    if !p.room_for_a_window() {
        return;
    }
    let first = p.a.qp.local_info().psn;
    let va = 0x5C00_0000;
    let window = crate::roce::qp::window(1024) as usize;
    // The packets, and the AckReq packets' runs the window takes whole.
    let n = window + 88;
    let whole = window / 62 * 62;
    let data = pattern(n * 1024, 6);
    p.packed_update(&data, va);
    let index = |pkt: &[u8]| {
        wire::Packet::parse(pkt).map_or(usize::MAX, |x| {
            (x.bth.psn.wrapping_sub(first) & wire::U24_MASK) as usize
        })
    };
    let mut got = p.datagrams(whole);
    let highest = |got: &[Datagram]| got.iter().flat_map(|d| &d.1).map(|x| index(x)).max();
    assert_eq!(highest(&got), Some(whole - 1), "{:?}", shape(&got));
    // Whatever comes before an ACK (the retransmission timer's go-back-N) stops there too.
    got.extend(p.datagrams(1));
    assert_eq!(
        highest(&got),
        Some(whole - 1),
        "nothing past the window before an ACK"
    );
    let ghosts = snapshot(&p.a.dev.core).drop_ghost_acks;
    p.ack(wire::psn_add(first, whole as u32 + 2));
    let end = Instant::now() + Duration::from_secs(5);
    while snapshot(&p.a.dev.core).drop_ghost_acks == ghosts && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(snapshot(&p.a.dev.core).drop_ghost_acks, ghosts + 1);
    p.ack(wire::psn_add(first, whole as u32 - 1));
    let end = Instant::now() + Duration::from_secs(5);
    while highest(&got) != Some(n) && Instant::now() < end {
        got.extend(p.datagrams(1));
    }
    p.ack(wire::psn_add(first, n as u32));
    let done = collect(&p.a.cq, 1);
    assert_eq!((done[0].wr_id, done[0].status), (2, WcStatus::Success));
    // All acknowledged: whatever was resent meanwhile is in the socket (loopback delivers at
    // send).
    got.extend(p.datagrams_now());
    // Each packet: its ICRC sealed for its segment in its datagram, its bytes, its AckReq.
    let seen = p.each_packet(&got, first, n + 1, |i, x| {
        if i == n {
            assert_eq!(x.bth.opcode, wire::Opcode::SEND_ONLY);
            return;
        }
        assert_eq!(x.payload, &data[i * 1024..(i + 1) * 1024], "packet {i}");
        assert_eq!(
            x.bth.ack_req,
            i % 62 == 61 || i == n - 1,
            "AckReq of packet {i}"
        );
    });
    assert!(seen.iter().all(|&n| n >= 1), "every packet arrived");
    let again: usize = seen.iter().map(|n| n - 1).sum();
    assert_eq!(snapshot(&p.a.dev.core).retransmits, again as u64);
}

/// The requester's window takes a whole run of full packets at every path MTU, so a
/// transmission can always end at a packed post's AckReq packet.
#[test]
fn the_window_takes_a_whole_packed_run() {
    for mtu in [256usize, 512, 1024, 2048, 4096] {
        let full = wire::BTH_LEN + wire::RETH_LEN + mtu + wire::ICRC_LEN;
        let run = crate::roce::gso::run_capacity(full);
        assert!(
            crate::roce::qp::window(mtu) as usize >= run,
            "path MTU {mtu}: window {} < run {run}",
            crate::roce::qp::window(mtu)
        );
    }
}

/// An ACK inside a packed run (the front entry trimmed), then the retransmission timer: packets 31.. leave again, each sealed for its place in its datagram, with the
/// right PSNs, RETHs and bytes; the retransmissions counted are those packets.
#[test]
fn an_ack_inside_a_packed_run_then_the_timer() {
    let mut p = raw_peer(40);
    let first = p.a.qp.local_info().psn;
    let va = 0x5900_0000;
    let data = pattern(64 * 1024, 8);
    let packed = p.packed_update(&data, va);
    let got = p.datagrams(65);
    assert_eq!(got.iter().map(|d| d.1.len()).sum::<usize>(), 65);
    assert_eq!(shape(&got), [(Some(1056), 62), (Some(1056), 3)]);
    let before = snapshot(&p.a.dev.core).retransmits;
    p.ack(wire::psn_add(first, 30));
    let again = p.datagrams(34);
    eprintln!("resent shape {:?}", shape(&again));
    assert_eq!(again.iter().map(|d| d.1.len()).sum::<usize>(), 34);
    p.check_with(
        &again,
        &data[31 * 1024..],
        va + 31 * 1024,
        wire::psn_add(first, 31),
        &|n| n + 31 == 61 || n + 31 == 63,
    );
    p.ack(wire::psn_add(first, 64));
    let done = collect(&p.a.cq, 1);
    assert_eq!((done[0].wr_id, done[0].status), (2, WcStatus::Success));
    let resent = snapshot(&p.a.dev.core).retransmits - before;
    assert!(resent >= 34, "{resent}");
    assert_eq!(packed.pieces().collect::<Vec<_>>().concat(), data);
    assert!(!p.a.qp.has_unacked());
}

/// An ACK inside a packed run, then a PSN-sequence NAK inside what is left of it (go-back-N
/// from there, resealed copies), then an ACK inside the third run and the timer.
#[test]
fn an_ack_then_a_nak_inside_packed_runs() {
    let mut p = raw_peer(41);
    let first = p.a.qp.local_info().psn;
    let va = 0x5A00_0000;
    let data = pattern(130 * 1024 + 77, 9);
    let _packed = p.packed_update(&data, va);
    let n = data.len().div_ceil(1024);
    let got = p.datagrams(n + 1);
    assert_eq!(got.iter().map(|d| d.1.len()).sum::<usize>(), n + 1);
    p.ack(wire::psn_add(first, 20));
    std::thread::sleep(Duration::from_millis(5));
    p.acknowledge(
        wire::psn_add(first, 40),
        wire::AethKind::Nak {
            code: wire::nak::PSN_SEQUENCE,
        },
    );
    let again = p.datagrams(n + 1 - 40);
    assert_eq!(again.iter().map(|d| d.1.len()).sum::<usize>(), n + 1 - 40);
    p.check_with(
        &again,
        &data[40 * 1024..],
        va + 40 * 1024,
        wire::psn_add(first, 40),
        &|i| (i + 40) % 62 == 61 || i + 40 + 1 == n,
    );
    // ACK inside the third run (124..), then time out.
    p.ack(wire::psn_add(first, 125));
    let again = p.datagrams(n + 1 - 126);
    p.check_with(
        &again,
        &data[126 * 1024..],
        va + 126 * 1024,
        wire::psn_add(first, 126),
        &|i| i + 126 + 1 == n,
    );
    p.ack(wire::psn_add(first, n as u32));
    let done = collect(&p.a.cq, 1);
    assert_eq!((done[0].wr_id, done[0].status), (2, WcStatus::Success));
}

/// `UDP_SEGMENT` refused after a packed post was sealed for runs: its packets leave one
/// by one, each a copy sealed for identification 0.
#[test]
fn runs_sealed_for_gso_leave_one_by_one_once_refused() {
    let mut p = raw_peer(42);
    let first = p.a.qp.local_info().psn;
    let va = 0x5B00_0000;
    let data = pattern(70 * 1024 + 5, 10);
    let _packed =
        p.a.qp
            .post_write_packed(1, &data, va, 0x77)
            .expect("packed")
            .expect("ready");
    p.a.dev.core.refuse_runs();
    p.cdc();
    let n = data.len().div_ceil(1024);
    let got = p.datagrams(n + 1);
    assert!(got.iter().all(|d| d.1.len() == 1), "{:?}", shape(&got));
    p.check_with(&got, &data, va, first, &|i| i % 62 == 61 || i + 1 == n);
    p.ack(wire::psn_add(first, n as u32));
    let done = collect(&p.a.cq, 1);
    assert_eq!((done[0].wr_id, done[0].status), (2, WcStatus::Success));
}

/// A packed post sealed for runs, then `UDP_SEGMENT` refused: `doorbell_runs` keeps no short
/// last run back for a datagram that can no longer be shared — all 64 packets leave in the
/// call, one by one (a kept run would leave only after the hold limit).
#[test]
fn no_run_is_kept_back_once_runs_are_refused() {
    let mut p = raw_peer(44);
    let first = p.a.qp.local_info().psn;
    let va = 0x5C00_0000;
    let data = pattern(64 * 1024, 12);
    let _packed =
        p.a.qp
            .post_write_packed(1, &data, va, 0x77)
            .expect("packed")
            .expect("ready");
    p.a.dev.core.refuse_runs();
    let before = p.a.dev.core.counters.tx_packets.load(Ordering::Relaxed);
    p.a.qp.doorbell_runs();
    let sent = p.a.dev.core.counters.tx_packets.load(Ordering::Relaxed) - before;
    assert_eq!(sent, 64, "every packet in the doorbell's call");
    let got = p.datagrams(64);
    assert!(got.iter().all(|d| d.1.len() == 1), "{:?}", shape(&got));
    // Each alone, sealed for identification 0; the bytes and the AckReq of each run's end.
    let seen = p.each_packet(&got, first, 64, |i, x| {
        assert_eq!(x.payload, &data[i * 1024..(i + 1) * 1024], "packet {i}");
        let reth = x.reth.expect("WRITE ONLY");
        assert_eq!(reth.va, va + (i * 1024) as u64, "packet {i}");
        assert_eq!(x.bth.ack_req, i == 61 || i == 63, "packet {i}");
    });
    assert!(seen.iter().all(|&k| k == 1), "every packet once: {seen:?}");
}

/// A whole run's wire handed to `transmit_pkts` when `UDP_SEGMENT` is off (the race
/// between `pump` reading `sends_runs` and the send): split into packets, each sealed for 0.
/// And with UDP_SEGMENT on: one datagram, each segment sealed for its index.
#[test]
fn a_whole_run_is_split_where_runs_are_refused() {
    use crate::roce::txpkt::TxPkt;
    let mut p = raw_peer(43);
    let h = wire::IcrcHeaders::new(p.me.into(), p.peer_ip.into(), wire::UDP_PORT);
    let data = pattern(3 * 1024 - 10, 11);
    let mut buf = Vec::new();
    let mut stride = 0;
    for j in 0..3usize {
        let piece = &data[j * 1024..((j + 1) * 1024).min(data.len())];
        let repr = wire::PacketRepr {
            bth: wire::Bth {
                opcode: wire::Opcode::WRITE_ONLY,
                pkey: wire::DEFAULT_PKEY,
                dest_qp: PEER_QPN,
                ack_req: j == 2,
                psn: 100 + j as u32,
                ..wire::Bth::default()
            },
            reth: Some(wire::Reth {
                va: 0x1000 + (j * 1024) as u64,
                rkey: 0x77,
                dma_len: piece.len() as u32,
            }),
            aeth: None,
            immdt: None,
            payload: piece,
        };
        let mut b = vec![0u8; repr.buffer_len()];
        repr.emit(&mut b).expect("emit");
        let icrc = h.compute(&b) ^ crate::roce::gso::id_columns(b.len()).delta(j as u16);
        let l = b.len();
        b[l - 4..].copy_from_slice(&icrc.to_le_bytes());
        if j == 0 {
            stride = b.len();
        }
        buf.extend_from_slice(&b);
    }
    let dest = p.a.qp.conn.get().expect("conn").ip;
    for gso in [true, false] {
        if !gso {
            p.a.dev.core.refuse_runs();
        }
        let mut run = TxPkt::run(
            100,
            bytes::Bytes::from(buf.clone()),
            3,
            stride as u16,
            Some(0),
        );
        let mut batch = Vec::new();
        run.wires(true, None, &mut batch);
        assert_eq!(batch.len(), 1);
        assert_eq!(batch[0].packets, 3);
        p.a.dev.core.transmit_pkts(dest, &mut batch);
        drop(batch);
        let got = p.datagrams(3);
        let mut all = 0;
        for (k, pkt) in got.iter().flat_map(|d| d.1.iter().enumerate()) {
            let cols = crate::roce::gso::id_columns(pkt.len());
            let icrc = pkt.last_chunk::<4>().map(|t| u32::from_le_bytes(*t));
            assert_eq!(
                icrc,
                Some(h.compute(pkt) ^ cols.delta(k as u16)),
                "gso {gso}"
            );
            all += 1;
        }
        assert_eq!(all, 3);
        if gso {
            assert_eq!(shape(&got), [(Some(stride), 3)]);
        } else {
            assert_eq!(shape(&got), [(None, 1), (None, 1), (None, 1)]);
        }
    }
}

/// The layout of a whole run (its last packet full) followed by packets: a follower of the
/// run's length, a shorter one, then one more (next message); a run whose last packet is
/// short takes no follower.
#[test]
fn whole_runs_take_followers_only_after_a_full_last_packet() {
    use crate::roce::txpkt::{Sealed, Wire};
    let run_full: Vec<u8> = (0..300u32).map(|i| i as u8).collect();
    let run_short: Vec<u8> = (0..250u32).map(|i| (i * 3) as u8).collect();
    let mut f1 = vec![1u8; 100];
    let mut f2 = vec![2u8; 60];
    let mut f3 = vec![3u8; 100];
    let mut ids = [0u16; 3];
    let [i1, i2, i3] = &mut ids;
    let mut pkts = vec![
        Wire {
            parts: [&run_full[..], &[]],
            tail: &mut [],
            id: Sealed::Fixed(0),
            packets: 3,
            seg: 100,
        },
        Wire::flat(&mut f1, i1),
        Wire::flat(&mut f2, i2),
        Wire::flat(&mut f3, i3),
        Wire {
            parts: [&run_short[..], &[]],
            tail: &mut [],
            id: Sealed::Fixed(0),
            packets: 3,
            seg: 100,
        },
    ];
    crate::roce::gso::with_layout(|layout| {
        let l = layout.lay_out(&mut pkts, true);
        let m: Vec<(usize, usize, usize, Option<u16>)> = l
            .msgs()
            .iter()
            .map(|m| (m.first, m.packets, m.bytes, m.gso_size))
            .collect();
        assert_eq!(
            m,
            [
                (0, 5, 460, Some(100)),
                (3, 1, 100, None),
                (4, 3, 250, Some(100))
            ]
        );
    });
    drop(pkts);
    assert_eq!(ids, [3, 4, 0], "followers sealed for their places");
}

/// Two packed WRITEs of 64 KiB whose CDC comes after both (a stream's updates whose CDC the
/// engine holds back): each WRITE is a run of 62 packets and one of 2, but `doorbell_runs`
/// keeps a short last run back, the next post is sealed to continue its datagram, and the
/// CDC takes the rest along — 62, 62, then 4 and the SEND, where a doorbell sends 62, 2, 62,
/// 2 and the SEND. Every packet is sealed for its segment in its datagram, PSNs follow each
/// other, RETHs and payloads are the WRITEs', and AckReq is where each post asked for it.
/// With no post after it, a kept run leaves alone once the hold limit passes (the progress
/// thread): nothing is stranded.
#[test]
fn a_short_last_run_waits_for_the_next_post_to_fill_its_datagram() {
    let mut p = raw_peer(33);
    let va = 0x6000_0000;
    let data = pattern(128 * 1024, 9);
    let (half_a, half_b) = data.split_at(64 * 1024);
    let mut psn = p.a.qp.local_info().psn;
    let mut shaped = false;
    for _ in 0..3 {
        let first = psn;
        let a = p.a.qp.post_write_packed(1, half_a, va, 0x77).expect("a");
        p.a.qp.doorbell_runs();
        let b =
            p.a.qp
                .post_write_packed(1, half_b, va + 64 * 1024, 0x77)
                .expect("b");
        p.a.qp.doorbell_runs();
        p.cdc();
        let got = p.datagrams(129);
        assert_eq!(got.iter().map(|d| d.1.len()).sum::<usize>(), 129);
        p.check_with(&got, &data, va, first, &|n| {
            matches!(n, 61 | 63 | 123 | 127)
        });
        psn = wire::psn_add(psn, 129);
        p.ack(wire::psn_add(psn, wire::U24_MASK));
        let done = collect(&p.a.cq, 1);
        assert_eq!((done[0].wr_id, done[0].status), (2, WcStatus::Success));
        drop((a, b));
        // The thread kept off the CPU past the hold limit between two posts sends the short
        // run alone: the bytes are right, the shape is not the one asked about.
        if shape(&got) == [(Some(1056), 62), (Some(1056), 62), (Some(1056), 5)] {
            shaped = true;
            break;
        }
    }
    assert!(shaped, "two WRITEs and their CDC in three full datagrams");
    // Nothing after the kept run: it leaves alone after the hold limit.
    let first = psn;
    let a = p.a.qp.post_write_packed(1, half_a, va, 0x77).expect("a");
    p.a.qp.doorbell_runs();
    let got = p.datagrams(64);
    assert_eq!(got.iter().map(|d| d.1.len()).collect::<Vec<_>>(), [62, 2]);
    let seen = p.each_packet(&got, first, 64, |i, x| {
        assert_eq!(x.payload, &half_a[i * 1024..(i + 1) * 1024], "packet {i}");
    });
    assert!(seen.iter().all(|&k| k == 1), "every packet once: {seen:?}");
    p.ack(wire::psn_add(first, 63));
    drop(a);
    let end = Instant::now() + Duration::from_secs(5);
    while p.a.qp.has_unacked() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(!p.a.qp.has_unacked(), "the kept run acknowledged");
}

/// Nine 64 KiB WRITEs whose CDC is held back, past the requester's window (576 packets, 512
/// PSNs in flight): what the window cuts leaves with the ACKs that open it, but the last run
/// that leaves room in its datagram (18 packets) stays back as `doorbell_runs` kept it until
/// the CDC takes it along — unless the hold limit passed meanwhile. Every packet arrives,
/// sealed for its segment, with its bytes (one seen twice is a counted retransmission).
#[test]
fn the_acks_after_a_window_cut_keep_the_open_run_back() {
    let mut p = raw_peer(34);
    if !p.room_for_a_window() {
        return;
    }
    let first = p.a.qp.local_info().psn;
    let va = 0x6400_0000;
    let data = pattern(9 * 64 * 1024, 10);
    let (n, kept_run) = (9 * 64, 9 * 64 % 62);
    let mut bufs = Vec::new();
    for (i, piece) in data.chunks(64 * 1024).enumerate() {
        let at = va + (i * 64 * 1024) as u64;
        bufs.push(p.a.qp.post_write_packed(1, piece, at, 0x77).expect("post"));
        p.a.qp.doorbell_runs();
    }
    let count = |got: &[Datagram]| got.iter().map(|d| d.1.len()).sum::<usize>();
    // Loopback delivers at send: what the window let go is in the socket.
    let mut got = p.datagrams_now();
    let sent = count(&got);
    assert!(sent < n - kept_run, "the window cut ({sent} packets)");
    let acked = Instant::now();
    p.ack(wire::psn_add(first, sent as u32 - 1));
    got.extend(p.datagrams(n - kept_run - sent));
    // Whatever else that transmission sent is in the socket a moment later.
    std::thread::sleep(Duration::from_micros(500));
    got.extend(p.datagrams_now());
    if acked.elapsed() < Duration::from_micros(4500) {
        assert_eq!(
            count(&got),
            n - kept_run,
            "the open run kept back after the ACK"
        );
    }
    p.cdc();
    got.extend(p.datagrams(n + 1 - count(&got)));
    p.ack(wire::psn_add(first, n as u32));
    let done = collect(&p.a.cq, 1);
    assert_eq!((done[0].wr_id, done[0].status), (2, WcStatus::Success));
    let seen = p.each_packet(&got, first, n + 1, |i, x| {
        if i < n {
            assert_eq!(x.payload, &data[i * 1024..(i + 1) * 1024], "packet {i}");
        }
    });
    assert!(seen.iter().all(|&k| k >= 1), "every packet: {seen:?}");
    let again: usize = seen.iter().map(|k| k - 1).sum();
    assert_eq!(snapshot(&p.a.dev.core).retransmits, again as u64);
    drop(bufs);
}
