//! The roce backend between devices on loopback addresses of this host (no privileges needed):
//! SEND and multi-packet WRITE, RNR, remote access errors, injected loss, reordering,
//! duplication and corruption, and forged packets.

use super::*;
use crate::config::{DeviceConfig, DeviceKind, FabricConfig, Fault};
use crate::types::{
    AccessFlags, QpCaps, QpState, RecvWr, RemoteQpInfo, SendWr, Sge, WcOpcode, WcStatus,
    WorkCompletion,
};
use smc_wire::roce as wire;
use std::net::Ipv4Addr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod packetization;
mod shared;

/// A loopback address private to this test (second octet) and process (last two).
fn addr(test: u8, side: u8) -> Ipv4Addr {
    let pid = std::process::id();
    Ipv4Addr::new(127, 100 + test * 2 + side, (pid >> 8) as u8, pid as u8)
}

fn fabric(faults: Vec<(String, Fault)>) -> FabricConfig {
    let dev = |n: &str| DeviceConfig {
        kind: DeviceKind::Roce {
            netdev: "lo".into(),
        },
        ..DeviceConfig::named(n)
    };
    FabricConfig {
        devices: vec![dev("ra"), dev("rb")],
        faults,
        ..FabricConfig::default()
    }
}

struct End {
    dev: Arc<RoceHandle>,
    qp: Arc<RoceQp>,
    cq: Arc<RoceCq>,
    rmb: Arc<RoceMr>,
    rx: Arc<RoceMr>,
}

fn end(dev: Arc<RoceHandle>, recvs: usize) -> End {
    let core = &dev.core;
    let pd = core.alloc_pd();
    let cq = Arc::new(RoceCq::new().expect("cq"));
    let caps = QpCaps {
        max_send_wr: 256,
        max_recv_wr: 64,
    };
    let qp = RoceQp::create(core.clone(), pd, cq.clone(), cq.clone(), caps).expect("qp");
    let rmb = Arc::new(
        RoceMr::new(
            core.alloc_key(),
            pd,
            1 << 20,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        )
        .expect("rmb"),
    );
    core.add_mr(rmb.clone());
    let rx =
        Arc::new(RoceMr::new(core.alloc_key(), pd, 64 * 64, AccessFlags::LOCAL_WRITE).expect("rx"));
    core.add_mr(rx.clone());
    qp.to_init().expect("init");
    let e = End {
        dev,
        qp,
        cq,
        rmb,
        rx,
    };
    for i in 0..recvs {
        post_recv(&e, i as u64);
    }
    e
}

fn post_recv(e: &End, i: u64) {
    let sge = Sge {
        addr: e.rx.vaddr() + (i % 64) * 64,
        length: 64,
        lkey: e.rx.key,
    };
    e.qp.post_recv(&RecvWr { wr_id: i, sge }).expect("recv");
}

fn remote(e: &End) -> RemoteQpInfo {
    let l = e.qp.local_info();
    RemoteQpInfo {
        gid: l.gid,
        qp_num: l.qp_num,
        psn: l.psn,
        mtu: l.mtu.min(crate::Mtu::Mtu1024),
    }
}

fn pair(test: u8, faults: Vec<(String, Fault)>, recvs: usize) -> (End, End) {
    let f = fabric(faults);
    let a = end(
        RoceHandle::open_at(&f, "ra", Some(addr(test, 0))).expect("open ra"),
        recvs,
    );
    let b = end(
        RoceHandle::open_at(&f, "rb", Some(addr(test, 1))).expect("open rb"),
        recvs,
    );
    a.qp.to_rtr(None, remote(&b)).expect("rtr");
    b.qp.to_rtr(None, remote(&a)).expect("rtr");
    a.qp.to_rts().expect("rts");
    b.qp.to_rts().expect("rts");
    (a, b)
}

/// Completions until `n` arrived or 20 s passed.
fn collect(cq: &RoceCq, n: usize) -> Vec<WorkCompletion> {
    let mut out = Vec::new();
    let mut w = [WorkCompletion::EMPTY; 16];
    let end = Instant::now() + Duration::from_secs(20);
    while out.len() < n && Instant::now() < end {
        let k = cq
            .wait(&mut w, Some(Duration::from_millis(50)))
            .expect("wait");
        out.extend_from_slice(&w[..k]);
    }
    out
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

/// `rounds` rounds of one WRITE (`len(round)` bytes at `round * stride` in b's RMB) and one
/// SEND carrying the round's number, from a to b: every SEND arrives, in order, and b's RMB
/// holds every WRITE's bytes. Returns b's receive completions.
fn writes_then_sends(
    a: &End,
    b: &End,
    rounds: u64,
    len: impl Fn(u64) -> usize,
    stride: u64,
) -> Vec<WorkCompletion> {
    writes_then_sends_with(a, b, rounds, len, stride, write)
}

/// [`writes_then_sends`] with the WRITEs posted by `write` (a, b, work request id, bytes,
/// offset in b's RMB).
fn writes_then_sends_with(
    a: &End,
    b: &End,
    rounds: u64,
    len: impl Fn(u64) -> usize,
    stride: u64,
    write: impl Fn(&End, &End, u64, &[u8], u64),
) -> Vec<WorkCompletion> {
    let mut expect = vec![0u8; 1 << 20];
    for round in 0..rounds {
        let data = pattern(len(round), round as u8);
        let off = round * stride;
        write(a, b, 100 + round, &data, off);
        expect[off as usize..off as usize + data.len()].copy_from_slice(&data);
        a.qp.post_send(&SendWr::Send {
            wr_id: round,
            data: &round.to_be_bytes(),
            signaled: true,
        })
        .expect("send");
    }
    let got = collect(&b.cq, rounds as usize);
    assert_eq!(got.len(), rounds as usize, "all SENDs delivered");
    for (i, w) in got.iter().enumerate() {
        assert_eq!(w.status, WcStatus::Success);
        let mut m = [0u8; 8];
        b.rx.read_at(w.wr_id as usize * 64, &mut m).expect("read");
        assert_eq!(u64::from_be_bytes(m), i as u64, "in order");
    }
    let mut back = vec![0u8; 1 << 20];
    b.rmb.read_at(0, &mut back).expect("read");
    assert!(back == expect, "WRITE bytes differ");
    got
}

fn write(a: &End, b: &End, wr_id: u64, data: &[u8], off: u64) {
    a.qp.post_send(&SendWr::WriteInline {
        wr_id,
        data,
        remote_addr: b.rmb.vaddr() + off,
        rkey: b.rmb.key,
        signaled: true,
    })
    .expect("write");
}

/// A multi-packet WRITE followed by a SEND: the SEND's receive completion comes after the
/// WRITE's bytes are in place, and both sides' completions are successful.
#[test]
fn write_then_send() {
    let (a, b) = pair(0, Vec::new(), 8);
    let data = pattern(300_000, 7);
    write(&a, &b, 1, &data, 100);
    a.qp.post_send(&SendWr::Send {
        wr_id: 2,
        data: b"cdc message of forty-four bytes, give or tak",
        signaled: true,
    })
    .expect("send");
    let got = collect(&b.cq, 1);
    assert_eq!(got.len(), 1);
    assert_eq!(
        (got[0].opcode, got[0].status, got[0].byte_len),
        (WcOpcode::Recv, WcStatus::Success, 44)
    );
    let mut back = vec![0u8; data.len()];
    b.rmb.read_at(100, &mut back).expect("read");
    assert!(back == data, "WRITE bytes differ");
    let mut msg = [0u8; 44];
    b.rx.read_at(0, &mut msg).expect("read");
    assert_eq!(&msg[..12], b"cdc message ");
    let done = collect(&a.cq, 2);
    assert!(
        done.iter().all(|w| w.status == WcStatus::Success),
        "{done:?}"
    );
    let ca = snapshot(&a.dev.core);
    let cb = snapshot(&b.dev.core);
    // 300 000 bytes at MTU 1024: 293 packets plus the SEND.
    assert!(ca.tx_packets >= 294, "{ca:?}");
    assert!(
        cb.acks_sent >= 1 && cb.acks_sent < 294,
        "ACKs are coalesced: {cb:?}"
    );
    assert_eq!(
        cb.drop_icrc + cb.drop_wrong_source + cb.drop_unknown_qp,
        0,
        "{cb:?}"
    );
}

/// A SEND that finds no receive posted is RNR-NAKed and retried until one is posted.
#[test]
fn rnr_then_delivered() {
    let (a, b) = pair(1, Vec::new(), 0);
    a.qp.post_send(&SendWr::Send {
        wr_id: 9,
        data: b"hello",
        signaled: true,
    })
    .expect("send");
    let end = Instant::now() + Duration::from_secs(10);
    while snapshot(&b.dev.core).rnr_naks_sent == 0 && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(snapshot(&b.dev.core).rnr_naks_sent > 0);
    assert_eq!(a.qp.state(), QpState::Rts, "RNR keeps the QP");
    post_recv(&b, 0);
    let got = collect(&b.cq, 1);
    assert_eq!((got[0].status, got[0].byte_len), (WcStatus::Success, 5));
    let sent = collect(&a.cq, 1);
    assert_eq!((sent[0].wr_id, sent[0].status), (9, WcStatus::Success));
    assert!(snapshot(&a.dev.core).rnr_naks_received > 0);
}

/// A WRITE with a wrong rkey or outside the region is NAKed (remote access error): the
/// requester's WR fails, both QPs go to the error state, and nothing is written.
#[test]
fn bad_rkey_and_bounds() {
    for (case, test) in [(0u8, 2u8), (1, 3)] {
        let (a, b) = pair(test, Vec::new(), 2);
        let (rkey, addr) = if case == 0 {
            (b.rmb.key ^ 0x1000, b.rmb.vaddr())
        } else {
            (b.rmb.key, b.rmb.vaddr() + (1 << 20) - 10)
        };
        a.qp.post_send(&SendWr::WriteInline {
            wr_id: 5,
            data: &[0xAA; 100],
            remote_addr: addr,
            rkey,
            signaled: true,
        })
        .expect("post");
        let done = collect(&a.cq, 1);
        assert_eq!(done[0].status, WcStatus::RemoteAccessError, "case {case}");
        assert_eq!(a.qp.state(), QpState::Error);
        let end = Instant::now() + Duration::from_secs(5);
        while b.qp.state() != QpState::Error && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(b.qp.state(), QpState::Error, "responder QP to error");
        assert_eq!(snapshot(&b.dev.core).remote_access_errors, 1);
        let mut back = vec![0u8; 16];
        b.rmb.read_at((1 << 20) - 16, &mut back).expect("read");
        assert!(back.iter().all(|&x| x == 0));
        b.rmb.read_at(0, &mut back).expect("read");
        assert!(back.iter().all(|&x| x == 0));
    }
}

/// Loss, reordering, duplication and corruption injected on both sides: every byte arrives,
/// every SEND is delivered once and in order.
#[test]
fn faults_leave_data_intact() {
    let faults = ["ra", "rb"]
        .iter()
        .flat_map(|d| {
            [
                Fault::Drop(2.0),
                Fault::Reorder(2.0),
                Fault::Duplicate(2.0),
                Fault::Corrupt(1.0),
            ]
            .into_iter()
            .map(move |f| (d.to_string(), f))
        })
        .collect();
    let (a, b) = pair(4, faults, 64);
    let got = writes_then_sends(&a, &b, 8, |r| 100_000 + r as usize * 1000, 110_000);
    assert!(got.iter().all(|w| w.status == WcStatus::Success));
    let done = collect(&a.cq, 16);
    assert_eq!(done.len(), 16);
    assert!(done.iter().all(|w| w.status == WcStatus::Success));
    let (ca, cb) = (snapshot(&a.dev.core), snapshot(&b.dev.core));
    assert!(ca.fault_drops > 0 && ca.retransmits > 0, "{ca:?}");
    assert!(
        cb.drop_icrc + ca.drop_icrc > 0,
        "corrupted packets dropped: {ca:?} {cb:?}"
    );
    assert!(cb.duplicates > 0, "{cb:?}");
}

/// Packets forged by a third socket: a wrong source address, a bad ICRC, a PSN out of the
/// window and a wrong rkey are dropped or NAKed, counted, and write nothing.
#[test]
fn forged_packets() {
    let (a, b) = pair(5, Vec::new(), 4);
    let bq = b.qp.local_info();
    let epsn = a.qp.local_info().psn;
    let forge = |from: Ipv4Addr, psn: u32, rkey: u32, corrupt: bool| {
        let s = std::net::UdpSocket::bind((from, 0)).expect("bind");
        let port = s.local_addr().expect("addr").port();
        let icrc = wire::IcrcHeaders::new(from.into(), addr(5, 1).into(), port);
        let w = Forged {
            dest_qp: bq.qp_num,
            psn,
            ack_req: true,
            va: b.rmb.vaddr(),
            rkey,
        };
        let buf = w.packet(&[0x55u8; 64], &icrc, corrupt);
        s.send_to(&buf, (addr(5, 1), wire::UDP_PORT)).expect("send");
    };
    let c = |f: fn(&crate::DeviceCounters) -> u64| f(&snapshot(&b.dev.core));
    let wait_for = |f: fn(&crate::DeviceCounters) -> u64| {
        let end = Instant::now() + Duration::from_secs(5);
        while c(f) == 0 && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(2));
        }
        c(f)
    };
    forge(Ipv4Addr::new(127, 99, 1, 1), epsn, b.rmb.key, false);
    assert_eq!(wait_for(|c| c.drop_wrong_source), 1);
    forge(addr(5, 0), epsn, b.rmb.key, true);
    assert_eq!(wait_for(|c| c.drop_icrc), 1);
    forge(addr(5, 0), wire::psn_add(epsn, 1000), b.rmb.key, false);
    assert_eq!(wait_for(|c| c.drop_out_of_sequence), 1);
    // The drop is counted before the NAK is sent and counted: waited for, not read at once.
    assert_eq!(wait_for(|c| c.naks_sent), 1, "one sequence NAK");
    assert_eq!(b.qp.state(), QpState::Rts);
    let mut back = [0u8; 64];
    b.rmb.read_at(0, &mut back).expect("read");
    assert_eq!(back, [0u8; 64], "nothing written so far");
    forge(addr(5, 0), epsn, b.rmb.key ^ 0x2000, false);
    assert_eq!(wait_for(|c| c.remote_access_errors), 1);
    b.rmb.read_at(0, &mut back).expect("read");
    assert_eq!(back, [0u8; 64], "a wrong rkey writes nothing");
    // The receive thread counts the error before it moves the QP to Error: wait for the state.
    let end = Instant::now() + Duration::from_secs(5);
    while b.qp.state() != QpState::Error && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(
        b.qp.state(),
        QpState::Error,
        "a remote access error fails the QP"
    );
    assert_eq!(b.dev.core.counters.rx_packets.load(Ordering::Relaxed), 4);
}

/// The headers of a WRITE ONLY packet a test forges.
struct Forged {
    dest_qp: u32,
    psn: u32,
    ack_req: bool,
    va: u64,
    rkey: u32,
}

impl Forged {
    /// The packet with `payload`, sealed for `icrc`, one payload bit flipped when `corrupt`.
    fn packet(&self, payload: &[u8], icrc: &wire::IcrcHeaders, corrupt: bool) -> Vec<u8> {
        let repr = wire::PacketRepr {
            bth: wire::Bth {
                opcode: wire::Opcode::WRITE_ONLY,
                pkey: wire::DEFAULT_PKEY,
                dest_qp: self.dest_qp,
                ack_req: self.ack_req,
                psn: self.psn,
                ..wire::Bth::default()
            },
            reth: Some(wire::Reth {
                va: self.va,
                rkey: self.rkey,
                dma_len: payload.len() as u32,
            }),
            aeth: None,
            immdt: None,
            payload,
        };
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit(&mut buf).expect("emit");
        icrc.seal(&mut buf);
        if corrupt {
            buf[40] ^= 1;
        }
        buf
    }
}

/// A coalesced datagram — one `UDP_SEGMENT` send of three WRITE ONLY packets, packet k sealed
/// for IPv4 identification k as the kernel numbers the segments, the receiver taking them
/// whole (`UDP_GRO`) — whose middle packet is corrupted: the first packet is placed, the
/// corrupted one dropped and counted as a bad ICRC, the third (now out of sequence) dropped,
/// counted and NAKed, and neither of the last two writes a byte.
#[test]
fn a_coalesced_datagram_with_a_corrupted_packet() {
    let (a, b) = pair(30, Vec::new(), 4);
    let bq = b.qp.local_info();
    let epsn = a.qp.local_info().psn;
    let s = std::net::UdpSocket::bind((addr(30, 0), 0)).expect("bind");
    let port = s.local_addr().expect("addr").port();
    rustix::net::sockopt::set_ip_mtu_discover(&s, rustix::net::sockopt::Ipv4PathMtuDiscovery::DO)
        .expect("don't fragment");
    let mut datagram = Vec::new();
    let mut seg = 0;
    for k in 0..3u32 {
        let mut icrc = wire::IcrcHeaders::new(addr(30, 0).into(), addr(30, 1).into(), port);
        icrc.ipv4_id = k as u16;
        let w = Forged {
            dest_qp: bq.qp_num,
            psn: wire::psn_add(epsn, k),
            ack_req: k == 2,
            va: b.rmb.vaddr() + 64 * u64::from(k),
            rkey: b.rmb.key,
        };
        let buf = w.packet(&[0x60 + k as u8; 64], &icrc, k == 1);
        seg = buf.len();
        datagram.extend_from_slice(&buf);
    }
    super::device::setsockopt_int(&s, libc::SOL_UDP, libc::UDP_SEGMENT, seg as i32)
        .expect("UDP_SEGMENT");
    s.send_to(&datagram, (addr(30, 1), wire::UDP_PORT))
        .expect("send");
    let c = |f: fn(&crate::DeviceCounters) -> u64| f(&snapshot(&b.dev.core));
    let end = Instant::now() + Duration::from_secs(5);
    while (c(|c| c.drop_icrc) == 0 || c(|c| c.drop_out_of_sequence) == 0) && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(c(|c| c.rx_packets), 3, "three packets received");
    assert_eq!(c(|c| c.drop_icrc), 1, "the corrupted packet");
    assert_eq!(c(|c| c.drop_out_of_sequence), 1, "the packet after it");
    assert_eq!(c(|c| c.naks_sent), 1, "one sequence NAK");
    let mut back = [0u8; 192];
    b.rmb.read_at(0, &mut back).expect("read");
    assert_eq!(back[..64], [0x60u8; 64], "the first packet placed");
    assert_eq!(back[64..], [0u8; 128], "nothing of the other two");
    assert_eq!(b.qp.state(), QpState::Rts);
}

/// An ACK past the highest PSN a QP has transmitted (posted packets the window still holds
/// back) is a ghost: ignored and counted, so those packets still leave. The peer is a plain
/// UDP socket of the test that never acknowledges by itself: the window (512 packets at a
/// path MTU of 1,024) keeps the rest of a WRITE 44 packets longer queued, deterministically.
#[test]
fn ghost_acks_do_not_complete_unsent_packets() {
    let f = fabric(Vec::new());
    let a = end(
        RoceHandle::open_at(&f, "ra", Some(addr(16, 0))).expect("open ra"),
        0,
    );
    let peer = std::net::UdpSocket::bind((addr(16, 1), wire::UDP_PORT)).expect("bind peer");
    peer.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    // Room for a window's packets where the test may (root); else the retransmission timer
    // resends what did not fit, and the loop below waits for it.
    let _ = super::device::setsockopt_int(&peer, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, 8 << 20);
    let peer_qpn = 0x00_4242;
    let mut gid = [0u8; 16];
    gid[10] = 0xff;
    gid[11] = 0xff;
    gid[12..].copy_from_slice(&addr(16, 1).octets());
    a.qp.to_rtr(
        None,
        RemoteQpInfo {
            gid: crate::Gid(gid),
            qp_num: peer_qpn,
            psn: 0,
            mtu: crate::Mtu::Mtu1024,
        },
    )
    .expect("rtr");
    a.qp.to_rts().expect("rts");
    let base = a.qp.local_info().psn;
    let window = super::qp::window(1024) as u32;
    let data = pattern((window as usize + 44) * 1024, 3);
    a.qp.post_send(&SendWr::WriteInline {
        wr_id: 1,
        data: &data,
        remote_addr: 0x1000,
        rkey: 0x77,
        signaled: true,
    })
    .expect("write");
    // Each packet's PSN as the peer receives it (the kernel cuts UDP_SEGMENT sends apart).
    let next_psn = || -> u32 {
        let mut buf = [0u8; 2048];
        let (n, _) = peer.recv_from(&mut buf).expect("a packet from the QP");
        wire::Packet::parse(&buf[..n]).expect("parse").bth.psn
    };
    let window_end = wire::psn_add(base, window - 1);
    while next_psn() != window_end {}
    let ack = |psn: u32| {
        let repr = wire::PacketRepr {
            bth: wire::Bth {
                opcode: wire::Opcode::ACKNOWLEDGE,
                pkey: wire::DEFAULT_PKEY,
                dest_qp: a.qp.local_info().qp_num,
                psn,
                ..wire::Bth::default()
            },
            reth: None,
            aeth: Some(wire::Aeth::new(wire::AethKind::Ack { credit: 31 }, 0)),
            immdt: None,
            payload: &[],
        };
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit(&mut buf).expect("emit");
        wire::IcrcHeaders::new(addr(16, 1).into(), addr(16, 0).into(), wire::UDP_PORT)
            .seal(&mut buf);
        peer.send_to(&buf, (addr(16, 0), wire::UDP_PORT))
            .expect("send");
    };
    // A ghost: PSN base + window + 24 was posted but has not left.
    ack(wire::psn_add(base, window + 24));
    let ghosts = || snapshot(&a.dev.core).drop_ghost_acks;
    let end_t = Instant::now() + Duration::from_secs(5);
    while ghosts() == 0 && Instant::now() < end_t {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(ghosts(), 1);
    // The true ACK of the window opens it: the next packet to leave is base + window (a
    // retransmission of the window may come first), not one past the ghost's PSN.
    ack(window_end);
    let after = loop {
        let p = next_psn();
        if wire::psn_diff(p, window_end) > 0 {
            break p;
        }
    };
    assert_eq!(after, wire::psn_add(base, window));
    assert!(a.qp.has_unacked());
}

/// A roce entry whose netdev does not exist (or has no IPv4 address) is an error at open that
/// names the entry.
#[test]
fn bad_netdev_is_named() {
    let mut f = fabric(Vec::new());
    f.devices[0].kind = DeviceKind::Roce {
        netdev: "nosuch-if7".into(),
    };
    let e = crate::Device::open(&f, "ra").expect_err("no such netdev");
    assert!(e.to_string().contains("roce:ra=nosuch-if7"), "{e}");
    // The path MTU follows the netdev MTU less 80 bytes of headers, as rxe's.
    assert!(super::device::active_mtu(1500) == Some(crate::Mtu::Mtu1024));
    assert!(super::device::active_mtu(9000) == Some(crate::Mtu::Mtu4096));
    assert!(super::device::active_mtu(300).is_none());
}

/// Every packet of one side held back 3 ms: the transfer still completes intact, in order.
#[test]
fn delayed_packets_arrive_intact() {
    let (a, b) = pair(6, vec![("ra".into(), Fault::Delay(3))], 8);
    let data = pattern(50_000, 3);
    write(&a, &b, 1, &data, 0);
    a.qp.post_send(&SendWr::Send {
        wr_id: 2,
        data: b"after",
        signaled: true,
    })
    .expect("send");
    let got = collect(&b.cq, 1);
    assert_eq!((got[0].status, got[0].byte_len), (WcStatus::Success, 5));
    let mut back = vec![0u8; data.len()];
    b.rmb.read_at(0, &mut back).expect("read");
    assert!(back == data);
    let done = collect(&a.cq, 2);
    assert!(
        done.iter().all(|w| w.status == WcStatus::Success),
        "{done:?}"
    );
}

/// AckReq and the doorbell, seen on the wire by a plain UDP socket standing in for the peer:
/// a held unsignaled WRITE and the signaled SEND posted after it leave together, only the SEND
/// asks for an ACK, and one ACK of the SEND completes both; a held WRITE that nothing follows
/// still leaves (the progress tick rings for it) asking for an ACK, and is retransmitted with
/// it until acknowledged.
#[test]
fn ackreq_only_where_needed() {
    let me = addr(7, 0);
    let peer_ip = addr(7, 1);
    let f = fabric(Vec::new());
    let a = end(RoceHandle::open_at(&f, "ra", Some(me)).expect("open ra"), 0);
    let peer = std::net::UdpSocket::bind((peer_ip, wire::UDP_PORT)).expect("bind peer");
    peer.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut gid = [0u8; 16];
    gid[10] = 0xFF;
    gid[11] = 0xFF;
    gid[12..].copy_from_slice(&peer_ip.octets());
    let peer_qpn = 0x4242;
    a.qp.to_rtr(
        None,
        RemoteQpInfo {
            gid: crate::Gid(gid),
            qp_num: peer_qpn,
            psn: 0,
            mtu: crate::Mtu::Mtu1024,
        },
    )
    .expect("rtr");
    a.qp.to_rts().expect("rts");
    // One datagram from the device: its opcode, AckReq, PSN; its ICRC checked for the
    // identification the kernel gave it (segment k of a UDP_SEGMENT send carries k).
    let recv = || {
        let mut buf = [0u8; 2048];
        let (n, from) = peer
            .recv_from(&mut buf)
            .expect("a datagram from the device");
        let pkt = &buf[..n];
        let h = wire::IcrcHeaders::new(me.into(), peer_ip.into(), from.port());
        let icrc0 = h.compute(pkt);
        let w = pkt.last_chunk::<4>().map(|t| u32::from_le_bytes(*t));
        assert!(
            w.is_some_and(|w| w == icrc0 || super::gso::id_columns(n).solve(w ^ icrc0).is_some()),
            "ICRC"
        );
        let p = wire::Packet::parse(pkt).expect("parse");
        assert_eq!(p.bth.dest_qp, peer_qpn);
        (p.bth.opcode, p.bth.ack_req, p.bth.psn, from.port())
    };
    let ack = |psn: u32, msn: u32, port: u16| {
        let repr = wire::PacketRepr {
            bth: wire::Bth {
                opcode: wire::Opcode::ACKNOWLEDGE,
                pkey: wire::DEFAULT_PKEY,
                dest_qp: a.qp.qpn,
                psn,
                ..wire::Bth::default()
            },
            reth: None,
            aeth: Some(wire::Aeth::new(wire::AethKind::Ack { credit: 31 }, msn)),
            immdt: None,
            payload: &[],
        };
        let mut b = vec![0u8; repr.buffer_len()];
        repr.emit(&mut b).expect("emit");
        wire::IcrcHeaders::new(peer_ip.into(), me.into(), wire::UDP_PORT).seal(&mut b);
        peer.send_to(&b, (me, port)).expect("ack");
    };
    let held_write = |wr_id: u64| {
        a.qp.post_send_held(&SendWr::WriteInline {
            wr_id,
            data: &[0x5A; 64],
            remote_addr: 0x1000,
            rkey: 0x77,
            signaled: false,
        })
        .expect("write");
    };

    // A WRITE and the CDC-like SEND after it: the WRITE has no AckReq of its own. (Should
    // this thread be held off the CPU between the two posts for longer than the hold limit,
    // the progress thread sends the WRITE alone, asking for an ACK: then try again.)
    let mut last_psn = 0;
    let mut port = 0;
    let mut coalesced = false;
    for attempt in 0..3u64 {
        let sent_before = a.dev.core.counters.tx_packets.load(Ordering::Relaxed);
        held_write(10 * attempt + 1);
        a.qp.post_send(&SendWr::Send {
            wr_id: 10 * attempt + 2,
            data: &[0xCD; 44],
            signaled: true,
        })
        .expect("send");
        let (op1, req1, psn1, p) = recv();
        let (op2, req2, psn2, _) = recv();
        port = p;
        last_psn = psn2;
        assert_eq!(op1, wire::Opcode::WRITE_ONLY);
        assert_eq!((op2, req2), (wire::Opcode::SEND_ONLY, true));
        assert_eq!(psn2, wire::psn_add(psn1, 1));
        let sent = a.dev.core.counters.tx_packets.load(Ordering::Relaxed) - sent_before;
        assert_eq!(sent, 2);
        ack(psn2, attempt as u32 + 2, port);
        let done = collect(&a.cq, 1);
        assert_eq!(done.len(), 1, "{done:?}");
        assert_eq!(
            (done[0].wr_id, done[0].status),
            (10 * attempt + 2, WcStatus::Success)
        );
        let end_t = Instant::now() + Duration::from_secs(5);
        while a.qp.has_unacked() && Instant::now() < end_t {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert!(!a.qp.has_unacked(), "one ACK covers the WRITE and the SEND");
        if !req1 {
            coalesced = true;
            break;
        }
    }
    assert!(
        coalesced,
        "the WRITE before a SEND never went without AckReq"
    );
    let psn2 = last_psn;

    // A held WRITE that nothing follows: it leaves anyway, asking for an ACK, and without
    // one it comes again (the retransmission timer) still asking.
    held_write(3);
    let (op, req, psn3, _) = recv();
    assert_eq!(
        (op, req, psn3),
        (wire::Opcode::WRITE_ONLY, true, wire::psn_add(psn2, 1))
    );
    let (op, req, psn, _) = recv();
    assert_eq!((op, req, psn), (wire::Opcode::WRITE_ONLY, true, psn3));
    assert!(a.dev.core.counters.timeouts.load(Ordering::Relaxed) >= 1);
    ack(psn3, 9, port);
    let end_t = Instant::now() + Duration::from_secs(5);
    while a.qp.has_unacked() && Instant::now() < end_t {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(!a.qp.has_unacked(), "the lone WRITE is acknowledged");
    assert_eq!(a.qp.state(), QpState::Rts);
}

/// Held WRITEs of several packets and a SEND between two real devices: the data and the
/// SEND arrive, the SEND completes, and nothing stays unacknowledged.
#[test]
fn held_writes_then_send_complete() {
    let (a, b) = pair(8, Vec::new(), 8);
    let data = pattern(20_000, 9);
    a.qp.post_send_held(&SendWr::WriteInline {
        wr_id: 1,
        data: &data,
        remote_addr: b.rmb.vaddr() + 10,
        rkey: b.rmb.key,
        signaled: false,
    })
    .expect("write");
    a.qp.post_send_held(&SendWr::WriteInline {
        wr_id: 2,
        data: &data[..100],
        remote_addr: b.rmb.vaddr() + 30_000,
        rkey: b.rmb.key,
        signaled: false,
    })
    .expect("write");
    a.qp.post_send(&SendWr::Send {
        wr_id: 3,
        data: b"done",
        signaled: true,
    })
    .expect("send");
    let got = collect(&b.cq, 1);
    assert_eq!((got[0].status, got[0].byte_len), (WcStatus::Success, 4));
    let mut back = vec![0u8; data.len()];
    b.rmb.read_at(10, &mut back).expect("read");
    assert!(back == data);
    b.rmb.read_at(30_000, &mut back[..100]).expect("read");
    assert!(back[..100] == data[..100]);
    let done = collect(&a.cq, 1);
    assert_eq!((done[0].wr_id, done[0].status), (3, WcStatus::Success));
    let end_t = Instant::now() + Duration::from_secs(5);
    while a.qp.has_unacked() && Instant::now() < end_t {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(!a.qp.has_unacked());
}

/// Held-back ACKs (qp.rs, `ACK_DELAY`): a SEND nobody answers still completes (the progress
/// thread sends the ACK), and in a ping-pong every SEND on both sides completes while no side
/// sends more ACKs than it received requests (they ride with replies or are coalesced).
#[test]
fn held_back_acks_complete_every_send() {
    let (a, b) = pair(9, Vec::new(), 32);
    a.qp.post_send(&SendWr::Send {
        wr_id: 100,
        data: b"lonely",
        signaled: true,
    })
    .expect("send");
    assert_eq!(collect(&b.cq, 1)[0].status, WcStatus::Success);
    let done = collect(&a.cq, 1);
    assert_eq!((done[0].wr_id, done[0].status), (100, WcStatus::Success));
    let rounds = 20u64;
    for i in 0..rounds {
        a.qp.post_send(&SendWr::Send {
            wr_id: i,
            data: b"ping",
            signaled: true,
        })
        .expect("ping");
        let mut got = Vec::new();
        while !got
            .iter()
            .any(|w: &WorkCompletion| w.opcode == WcOpcode::Recv)
        {
            let w = collect(&b.cq, 1);
            assert!(!w.is_empty(), "round {i}: no ping at b");
            got.extend(w);
        }
        b.qp.post_send(&SendWr::Send {
            wr_id: 1000 + i,
            data: b"pong",
            signaled: true,
        })
        .expect("pong");
        let mut got = Vec::new();
        while !got
            .iter()
            .any(|w: &WorkCompletion| w.opcode == WcOpcode::Recv)
        {
            let w = collect(&a.cq, 1);
            assert!(!w.is_empty(), "round {i}: no pong at a");
            got.extend(w);
        }
        assert!(got.iter().all(|w| w.status == WcStatus::Success));
    }
    let end_t = Instant::now() + Duration::from_secs(5);
    while (a.qp.has_unacked() || b.qp.has_unacked()) && Instant::now() < end_t {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(!a.qp.has_unacked() && !b.qp.has_unacked());
    let acks = |e: &End| e.dev.core.counters.acks_sent.load(Ordering::Relaxed);
    assert!(acks(&b) <= rounds + 1, "b sent {} ACKs", acks(&b));
    assert!(acks(&a) <= rounds, "a sent {} ACKs", acks(&a));
}

/// A waiter that sleeps in the socket's receive call itself (`ReceiveWait::block`): with
/// nothing coming the sleep ends (the socket's receive timeout) and says so; a SEND that
/// arrives while it sleeps there is received by it and its completion is queued; a completion
/// queued before it would sleep is found without sleeping.
#[test]
fn a_waiter_sleeps_in_the_receive_call() {
    let (a, b) = pair(14, Vec::new(), 8);
    let mut w = [WorkCompletion::EMPTY; 8];
    b.cq.req_notify();
    {
        let waiter = ReceiveWait::new(&b.dev.core, &b.cq);
        assert_eq!(waiter.block(), None, "nothing was sent");
    }
    let waiter = ReceiveWait::new(&b.dev.core, &b.cq);
    let sender = std::thread::spawn({
        let qp = a.qp.clone();
        move || {
            std::thread::sleep(Duration::from_millis(2));
            qp.post_send(&SendWr::Send {
                wr_id: 1,
                data: b"wake",
                signaled: true,
            })
            .expect("send");
        }
    });
    // A sleep may end before the SEND is sent; the waiter sleeps again (while it is counted,
    // the progress thread leaves the socket to it).
    let mut got = None;
    let end_t = Instant::now() + Duration::from_secs(20);
    while got.is_none() && Instant::now() < end_t {
        got = waiter.block();
    }
    sender.join().expect("sender");
    assert!(got.is_some_and(|n| n >= 1), "received {got:?}");
    let n = b.cq.poll(&mut w);
    assert!(
        w[..n]
            .iter()
            .any(|c| c.opcode == WcOpcode::Recv && c.status == WcStatus::Success),
        "{:?}",
        &w[..n]
    );
    drop(waiter);
    // Without a waiter the progress thread receives the next SEND; a waiter then finds its
    // completion queued and does not sleep.
    a.qp.post_send(&SendWr::Send {
        wr_id: 2,
        data: b"queued",
        signaled: true,
    })
    .expect("send");
    let end_t = Instant::now() + Duration::from_secs(20);
    while !b.cq.maybe_ready() && Instant::now() < end_t {
        std::thread::sleep(Duration::from_millis(1));
    }
    let waiter = ReceiveWait::new(&b.dev.core, &b.cq);
    assert_eq!(waiter.block(), Some(0));
    assert!(b.cq.poll(&mut w) >= 1);
}

/// Device "ra" on lo (`addr(test, 0)`) with the IPv6 GID `::1` (given, since `::1` is never a
/// GID of its own), and that GID; `None` (the test skipped) where `[::1]:4791` cannot be
/// bound.
fn loopback_v6_device(f: &FabricConfig, test: u8) -> Option<(Arc<RoceHandle>, crate::Gid)> {
    let v6 = std::net::Ipv6Addr::LOCALHOST;
    let dev = match RoceHandle::open_with(f, "ra", Some(addr(test, 0)), Some(vec![(v6, 128)])) {
        Ok(d) => d,
        Err(e) => panic!("open: {e}"),
    };
    if dev.core.gids.len() < 2 {
        eprintln!("skipped: [::1]:4791 cannot be bound here (no IPv6 on lo, or in use)");
        return None;
    }
    Some((dev, crate::Gid(v6.octets())))
}

/// The IPv6 path of the backend: a device on lo with an IPv6 GID on `::1` (given, since `::1`
/// is never a GID of its own) and two QPs of it connected through that GID. Loss, reordering
/// and duplication are injected, so go-back-N, NAKs, duplicate ACKs and retransmissions run
/// over IPv6 too; every byte and every SEND arrives in order, and no packet fails its ICRC
/// (the IPv6 masking of rocev2.md 12.1 on both ends). Then forged datagrams: an ICRC off by
/// what an IPv4 identification would change (accepted over IPv4, where the identification is
/// solved; never over IPv6) and a plainly wrong ICRC are dropped and counted; a correct one
/// to an unknown QP passes the ICRC check.
#[test]
fn ipv6_gid_carries_rc_traffic() {
    let faults = [Fault::Drop(2.0), Fault::Reorder(2.0), Fault::Duplicate(2.0)]
        .into_iter()
        .map(|f| ("ra".to_string(), f))
        .collect();
    let v6 = std::net::Ipv6Addr::LOCALHOST;
    let Some((dev, gid6)) = loopback_v6_device(&fabric(faults), 9) else {
        return;
    };
    assert_eq!(dev.core.gids, vec![dev.core.gid, gid6]);
    assert_eq!(dev.core.source_for(gid6), Some(1));
    assert_eq!(dev.core.source_for(dev.core.gid), Some(0));
    let a = end(dev.clone(), 64);
    let b = end(dev.clone(), 64);
    let (ra, rb) = (remote(&a), remote(&b));
    assert_eq!(ra.gid, dev.core.gid, "unconnected: GID index 0");
    let (ra, rb) = (
        RemoteQpInfo { gid: gid6, ..ra },
        RemoteQpInfo { gid: gid6, ..rb },
    );
    // Our GID must be of the peer's IP version.
    assert!(a.qp.to_rtr(Some(dev.core.gid), rb).is_err());
    a.qp.to_rtr(Some(gid6), rb).expect("rtr");
    b.qp.to_rtr(None, ra).expect("rtr");
    a.qp.to_rts().expect("rts");
    b.qp.to_rts().expect("rts");
    assert_eq!(a.qp.local_info().gid, gid6);
    assert_eq!(b.qp.local_info().gid, gid6);
    let got = writes_then_sends(&a, &b, 6, |r| 120_000 + r as usize * 777, 150_000);
    assert!(got
        .iter()
        .all(|w| (w.opcode, w.status) == (WcOpcode::Recv, WcStatus::Success)));
    let done: Vec<WorkCompletion> = collect(&a.cq, 12)
        .into_iter()
        .filter(|w| w.opcode != WcOpcode::Recv)
        .collect();
    assert_eq!(done.len(), 12, "{done:?}");
    assert!(done.iter().all(|w| w.status == WcStatus::Success));
    let c = snapshot(&dev.core);
    assert!(c.fault_drops > 0 && c.retransmits > 0, "{c:?}");
    assert_eq!(
        c.drop_icrc + c.drop_wrong_source + c.drop_malformed,
        0,
        "{c:?}"
    );

    // Forged datagrams from another socket on ::1.
    let forger = std::net::UdpSocket::bind((v6, 0)).expect("bind [::1]:0");
    let port = forger.local_addr().expect("addr").port();
    let h = wire::IcrcHeaders::new(v6.into(), v6.into(), port);
    let mut pkt = vec![0u8; wire::BTH_LEN + 8 + wire::ICRC_LEN];
    wire::Bth {
        opcode: wire::Opcode::SEND_ONLY,
        // In this process's QPN range (the steering program drops others), no QP's.
        dest_qp: (a.qp.local_info().qp_num & 0x00FF_0000) | 0xFFFE,
        pkey: wire::DEFAULT_PKEY,
        ..wire::Bth::default()
    }
    .emit((&mut pkt[..wire::BTH_LEN]).try_into().expect("bth"));
    h.seal(&mut pkt);
    let mut shifted = pkt.clone();
    let delta = wire::Ipv4IdColumns::for_len(pkt.len()).delta(5);
    let t = shifted.len() - 4;
    let icrc = u32::from_le_bytes(shifted[t..].try_into().expect("4")) ^ delta;
    shifted[t..].copy_from_slice(&icrc.to_le_bytes());
    let mut wrong = pkt.clone();
    wrong[t] ^= 0x40;
    let before = snapshot(&dev.core);
    for p in [&shifted, &wrong, &pkt] {
        forger.send_to(p, (v6, wire::UDP_PORT)).expect("send");
    }
    let end = Instant::now() + Duration::from_secs(10);
    let mut c = snapshot(&dev.core);
    while c.drop_unknown_qp == before.drop_unknown_qp && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(2));
        c = snapshot(&dev.core);
    }
    assert_eq!(c.drop_icrc - before.drop_icrc, 2, "{c:?}");
    assert_eq!(c.drop_unknown_qp - before.drop_unknown_qp, 1, "{c:?}");
}

/// An application thread that keeps making `ReceiveWait`s between short pauses but never
/// receives (what a ping-pong's thread looks like to the progress thread between its waits)
/// keeps the progress thread off the socket only for a bounded number of looks
/// (`MAX_DEFERRED`): a SEND nobody else receives still arrives and completes. (End to end
/// only: on a loaded machine the churning thread is also preempted, which ends a deferral by
/// itself; `deferred_looks_are_bounded` checks the bound.)
#[test]
fn waits_that_never_receive_leave_the_socket_to_the_progress_thread() {
    let (a, b) = pair(21, Vec::new(), 8);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let made = std::sync::atomic::AtomicU32::new(0);
    let got = std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Acquire) {
                drop(device::ReceiveWait::new(&b.dev.core, &b.cq));
                made.fetch_add(1, Ordering::Release);
                std::thread::yield_now();
            }
        });
        // The waits go on before the SEND leaves and until it arrives.
        while made.load(Ordering::Acquire) < 1000 {
            std::thread::sleep(Duration::from_millis(1));
        }
        a.qp.post_send(&SendWr::Send {
            wr_id: 1,
            data: b"ping",
            signaled: true,
        })
        .expect("send");
        let got = collect(&b.cq, 1);
        stop.store(true, Ordering::Release);
        got
    });
    assert_eq!(got.len(), 1, "the SEND was never received");
    assert_eq!((got[0].status, got[0].byte_len), (WcStatus::Success, 4));
    let done = collect(&a.cq, 1);
    assert_eq!((done[0].wr_id, done[0].status), (1, WcStatus::Success));
}

/// The progress thread's choice at each look (`device::Look`): a sleeper on the socket gets
/// the lease; application threads that waited since the last look but not now defer it at
/// most `MAX_DEFERRED` looks in a row, then it watches the socket; a look with a sleeper or
/// a watch starts the count again.
#[test]
fn deferred_looks_are_bounded() {
    use device::{Look, MAX_DEFERRED};
    let mut deferred = 0;
    let looks: Vec<Look> = (0..2 * MAX_DEFERRED + 2)
        .map(|_| Look::at(false, true, &mut deferred))
        .collect();
    let mut want = vec![Look::Defer; MAX_DEFERRED as usize];
    want.push(Look::Watch);
    want.extend(vec![Look::Defer; MAX_DEFERRED as usize]);
    want.push(Look::Watch);
    assert_eq!(looks, want);
    let mut deferred = 3;
    assert_eq!(Look::at(true, true, &mut deferred), Look::Lease);
    assert_eq!(deferred, 0);
    assert_eq!(Look::at(false, false, &mut deferred), Look::Watch);
    assert_eq!(Look::at(false, true, &mut deferred), Look::Defer);
    assert_eq!(deferred, 1);
}

/// A device's progress thread runs under `SCHED_BATCH` (device.rs `run`), unless it was
/// started under a policy other than `SCHED_OTHER`, which it keeps.
#[test]
fn the_progress_thread_runs_under_sched_batch() {
    let own = crate::sched::policy_of(0).expect("own policy");
    let dev = RoceHandle::open_at(&fabric(Vec::new()), "ra", Some(addr(33, 0))).expect("open");
    let want = match own {
        libc::SCHED_OTHER => libc::SCHED_BATCH,
        p => p,
    };
    // The thread sets its policy as it starts: give it a moment.
    let until = Instant::now() + Duration::from_secs(5);
    let mut seen = dev.progress_policy();
    while seen != Some(want) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
        seen = dev.progress_policy();
    }
    assert_eq!(seen, Some(want));
}

/// A thread that a bulk read's sleep left under `SCHED_BATCH` (sched.rs, kept for its next
/// sleep) gets its own policy back from a running device's progress thread once that sleep
/// is `KEEP_MAX` old — the sweep, not the sleep's end (a broken keep fails the count).
#[test]
fn the_progress_thread_gives_a_kept_batch_policy_back() {
    let (_a, _b) = pair(32, Vec::new(), 1);
    let policy = || {
        // SAFETY: the calling thread's policy; no pointer.
        unsafe { libc::sched_getscheduler(0) }
    };
    std::thread::spawn(move || {
        assert_eq!(policy(), libc::SCHED_OTHER);
        let q = crate::QuietWake::begin();
        assert!(q.switched());
        drop(q);
        // Given back by the progress thread's tick (every `TICK` at most while QPs live),
        // whatever this thread does meanwhile.
        let t = Instant::now();
        while policy() != libc::SCHED_OTHER {
            assert!(t.elapsed() < Duration::from_secs(20), "never given back");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(
            crate::sched::sweeps_of_mine(),
            1,
            "not given back by a sweep"
        );
    })
    .join()
    .expect("thread");
}

/// Packed WRITEs over IPv6 with `UDP_SEGMENT` on and no faults: no identification to seal
/// for, their runs leave whole; every byte arrives, no ICRC fails.
#[test]
fn packed_writes_over_ipv6_arrive_whole() {
    let Some((dev, gid6)) = loopback_v6_device(&fabric(Vec::new()), 44) else {
        return;
    };
    let a = end(dev.clone(), 64);
    let b = end(dev.clone(), 64);
    let (ra, rb) = (remote(&a), remote(&b));
    let (ra, rb) = (
        RemoteQpInfo { gid: gid6, ..ra },
        RemoteQpInfo { gid: gid6, ..rb },
    );
    a.qp.to_rtr(Some(gid6), rb).expect("rtr");
    b.qp.to_rtr(None, ra).expect("rtr");
    a.qp.to_rts().expect("rts");
    b.qp.to_rts().expect("rts");
    writes_then_sends_with(
        &a,
        &b,
        6,
        |r| 120_000 + r as usize * 777,
        150_000,
        |a, b, wr, data, off| {
            a.qp.post_write_packed(wr, data, b.rmb.vaddr() + off, b.rmb.key)
                .expect("write")
                .expect("ready");
        },
    );
    let c = snapshot(&dev.core);
    assert_eq!(c.drop_icrc + c.drop_malformed, 0, "{c:?}");
}

/// A packed run across the PSN wrap: its last PSN, a trim, the identifications its packets
/// keep.
#[test]
fn a_packed_run_across_the_psn_wrap() {
    use crate::roce::txpkt::TxPkt;
    let b = bytes::Bytes::from(vec![0u8; 4 * 100 + 60]);
    let mut r = TxPkt::run(0xFF_FFFE, b, 5, 100, Some(0));
    assert_eq!(r.last_psn(), 2);
    assert!(wire::psn_diff(r.last_psn(), 0xFF_FFFE) == 4);
    r.trim_front(3);
    assert_eq!((r.psn, r.count, r.last_psn()), (1, 2, 2));
    let mut out = Vec::new();
    r.wires(true, None, &mut out);
    assert_eq!(out.len(), 2);
    assert_eq!(out[0].len(), 100);
    assert_eq!(out[1].len(), 60);
    assert_eq!((out[0].id.get(), out[1].id.get()), (3, 4));
}
