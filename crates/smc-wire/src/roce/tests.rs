use super::*;
use proptest::prelude::*;

fn unhex(s: &str) -> Vec<u8> {
    let s: String = s.split_whitespace().collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

/// rocev2.md 19.1: frame 17 of the rxe capture, an IPv4 SEND ONLY of 5 bytes with PadCnt 3.
const FRAME17: &str = "52 54 00 00 00 01 52 54 00 00 00 02 08 00 45 00
    00 34 d3 9a 40 00 40 11 53 1c 0a 00 00 02 0a 00
    00 01 c1 56 12 b7 00 20 00 00 04 30 ff ff 00 00
    00 12 80 2e 7c 8b 7b 7b 7b 7b 7b 00 00 00 e6 0f
    8d aa";

/// rocev2.md 19.2: frame 18, the IPv4 ACK of frame 17 (MSN 1).
const FRAME18: &str = "52 54 00 00 00 02 52 54 00 00 00 01 08 00 45 00
    00 30 b2 a4 40 00 40 11 74 16 0a 00 00 01 0a 00
    00 02 c1 56 12 b7 00 1c 00 00 11 00 ff ff 00 00
    00 13 00 2e 7c 8b 1f 00 00 01 88 8c 0b 1a";

#[test]
fn worked_example_send_only_with_pad() {
    let f = unhex(FRAME17);
    let (h, udp) = icrc_of_ip_packet(&f[14..]).expect("ipv4 udp");
    assert_eq!(h.ipv4_id, 0xd39a);
    assert_eq!(h.src_port, 49494);
    assert_eq!(h.compute(udp), 0xaa8d_0fe6);
    assert!(h.verify(udp));
    let p = Packet::parse(udp).expect("parse");
    assert_eq!(p.bth.opcode, Opcode::SEND_ONLY);
    assert_eq!(p.bth.pad, 3);
    assert_eq!(p.bth.dest_qp, 0x12);
    assert!(p.bth.ack_req);
    assert_eq!(p.bth.psn, 0x2e7c8b);
    assert_eq!(p.payload, &[0x7b; 5]);
    // The same packet with identification 0 and 1 (rocev2.md 19.1 step 4).
    let mut h0 = h;
    h0.ipv4_id = 0;
    assert_eq!(h0.compute(udp).to_le_bytes(), [0x5c, 0x64, 0xda, 0x7e]);
    h0.ipv4_id = 1;
    assert_eq!(h0.compute(udp).to_le_bytes(), [0xa7, 0x92, 0xc9, 0x39]);
    // Solving from the received ICRC gives the identification in the frame.
    h0.ipv4_id = 0;
    assert_eq!(h0.solve_ipv4_id(udp), Some(0xd39a));
    // Re-emitting the parsed packet gives the same bytes.
    let mut out = vec![0u8; p.repr().buffer_len()];
    p.repr().emit(&mut out).expect("emit");
    h.seal(&mut out);
    assert_eq!(out, udp);
}

#[test]
fn worked_example_ack() {
    let f = unhex(FRAME18);
    let (h, udp) = icrc_of_ip_packet(&f[14..]).expect("ipv4 udp");
    assert_eq!(h.compute(udp), 0x1a0b_8c88);
    let p = Packet::parse(udp).expect("parse");
    assert_eq!(p.bth.opcode, Opcode::ACKNOWLEDGE);
    let aeth = p.aeth.expect("aeth");
    assert_eq!(aeth.kind(), AethKind::Ack { credit: 31 });
    assert_eq!(aeth.msn, 1);
    assert!(p.payload.is_empty());
}

#[test]
fn masked_fields_do_not_change_the_icrc_but_covered_ones_do() {
    let f = unhex(FRAME17);
    let (h, udp) = icrc_of_ip_packet(&f[14..]).expect("ipv4 udp");
    let mut m = udp.to_vec();
    m[4] = 0xC0; // FECN + BECN
    assert!(h.verify(&m));
    m[8] ^= 0x01; // a reserved bit of byte 8 is covered
    assert!(!h.verify(&m));
    let mut m = udp.to_vec();
    m[13] ^= 0x10; // one payload bit
    assert!(!h.verify(&m));
    let mut h0 = h;
    h0.ipv4_id = 0;
    // A corrupt packet mostly has no consistent identification; at worst a wrong one.
    assert_ne!(h0.solve_ipv4_id(&m), Some(0xd39a));
}

#[test]
fn aeth_kinds() {
    assert_eq!(
        Aeth::new(AethKind::RnrNak { timer: 5 }, 7).syndrome,
        0x25,
        "RNR NAK with min_rnr_timer 5"
    );
    assert_eq!(
        Aeth::new(
            AethKind::Nak {
                code: nak::PSN_SEQUENCE
            },
            0
        )
        .syndrome,
        0x60
    );
    assert_eq!(
        Aeth::new(
            AethKind::Nak {
                code: nak::REMOTE_ACCESS
            },
            0
        )
        .syndrome,
        0x62
    );
    assert_eq!(
        Aeth {
            syndrome: 0x45,
            msn: 0
        }
        .kind(),
        AethKind::Reserved
    );
    assert_eq!(
        Aeth {
            syndrome: 0x80,
            msn: 0
        }
        .kind(),
        AethKind::Reserved
    );
    assert_eq!(rnr_timer_micros(5), 60);
    assert_eq!(rnr_timer_micros(0), 655_360);
}

#[test]
fn psn_compare_wraps() {
    assert_eq!(psn_diff(5, 3), 2);
    assert_eq!(psn_diff(3, 5), -2);
    assert_eq!(psn_diff(0, 0xFF_FFFF), 1);
    assert_eq!(psn_diff(0xFF_FFFF, 0), -1);
    assert_eq!(psn_add(0xFF_FFFF, 2), 1);
}

#[test]
fn segment_opcodes() {
    assert_eq!(Opcode::for_segment(false, 0, 1, false), Opcode::SEND_ONLY);
    assert_eq!(
        Opcode::for_segment(false, 0, 1, true),
        Opcode::SEND_ONLY_IMM
    );
    assert_eq!(Opcode::for_segment(true, 0, 1, false), Opcode::WRITE_ONLY);
    assert_eq!(Opcode::for_segment(true, 0, 3, false), Opcode::WRITE_FIRST);
    assert_eq!(Opcode::for_segment(true, 1, 3, false), Opcode::WRITE_MIDDLE);
    assert_eq!(Opcode::for_segment(true, 2, 3, false), Opcode::WRITE_LAST);
    assert_eq!(
        Opcode::for_segment(true, 2, 3, true),
        Opcode::WRITE_LAST_IMM
    );
    assert_eq!(Opcode::for_segment(false, 2, 3, false), Opcode::SEND_LAST);
}

#[test]
fn short_and_odd_packets_are_errors_not_panics() {
    assert!(matches!(
        Packet::parse(&[]),
        Err(RoceError::Truncated { .. })
    ));
    let mut b = [0u8; 16];
    b[0] = 0x64; // UD SEND ONLY
    assert_eq!(Packet::parse(&b), Err(RoceError::UnsupportedOpcode(0x64)));
    b[0] = 0x06; // WRITE FIRST needs a RETH
    assert!(matches!(
        Packet::parse(&b),
        Err(RoceError::Truncated { .. })
    ));
    b[0] = 0x04;
    b[1] = 0x01;
    assert_eq!(Packet::parse(&b), Err(RoceError::BadTver(1)));
    b[1] = 0x30; // pad 3 + ICRC 4 > 16 - 12
    assert!(matches!(
        Packet::parse(&b),
        Err(RoceError::Truncated { .. })
    ));
}

fn opcode() -> impl Strategy<Value = Opcode> {
    prop_oneof![(0u8..=0x0B).prop_map(Opcode), Just(Opcode::ACKNOWLEDGE)]
}

fn v4() -> impl Strategy<Value = IpAddr> {
    any::<[u8; 4]>().prop_map(|o| IpAddr::V4(Ipv4Addr::from(o)))
}

fn ip() -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        v4(),
        any::<[u8; 16]>().prop_map(|o| IpAddr::V6(Ipv6Addr::from(o)))
    ]
}

/// Header fields of any packet we emit, drawn together (the tests below draw a payload and
/// addresses apart).
#[derive(Clone, Copy, Debug)]
struct Fields {
    op: Opcode,
    se: bool,
    dest_qp: u32,
    ack_req: bool,
    psn: u32,
    reth: Reth,
    aeth: Aeth,
    imm: u32,
}

impl Fields {
    fn bth(&self) -> Bth {
        Bth {
            opcode: self.op,
            se: self.se,
            pkey: DEFAULT_PKEY,
            dest_qp: self.dest_qp,
            ack_req: self.ack_req,
            psn: self.psn,
            ..Bth::default()
        }
    }

    /// The packet of these fields (each extension header where the opcode has one).
    fn repr<'a>(&self, payload: &'a [u8]) -> PacketRepr<'a> {
        PacketRepr {
            bth: self.bth(),
            reth: self.op.has_reth().then_some(self.reth),
            aeth: self.op.has_aeth().then_some(self.aeth),
            immdt: self.op.has_immdt().then_some(self.imm),
            payload,
        }
    }
}

fn fields() -> impl Strategy<Value = Fields> {
    (
        opcode(),
        any::<bool>(),
        0u32..=U24_MASK,
        any::<bool>(),
        0u32..=U24_MASK,
        (any::<u64>(), any::<u32>(), any::<u32>()),
        (any::<u8>(), 0u32..=U24_MASK),
        any::<u32>(),
    )
        .prop_map(
            |(op, se, dest_qp, ack_req, psn, (va, rkey, dma_len), (syndrome, msn), imm)| Fields {
                op,
                se,
                dest_qp,
                ack_req,
                psn,
                reth: Reth { va, rkey, dma_len },
                aeth: Aeth { syndrome, msn },
                imm,
            },
        )
}

proptest! {
    /// Every packet we emit parses back to what was emitted, and its ICRC verifies.
    #[test]
    fn emit_parse_round_trip(
        f in fields(),
        payload in proptest::collection::vec(any::<u8>(), 0..300),
        src in ip(), dst in ip(), port: u16,
    ) {
        let repr = f.repr(&payload);
        let mut buf = vec![0xEEu8; repr.buffer_len() + 3];
        let n = repr.emit(&mut buf).expect("emit");
        let buf = &mut buf[..n];
        let h = IcrcHeaders::new(src, dst, port);
        h.seal(buf);
        prop_assert!(h.verify(buf));
        let p = Packet::parse(buf).expect("parse");
        let mut want = f.bth();
        want.pad = pad_len(payload.len()) as u8;
        prop_assert_eq!(p.bth, want);
        prop_assert_eq!(p.repr().reth, repr.reth);
        prop_assert_eq!(p.repr().aeth, repr.aeth);
        prop_assert_eq!(p.immdt, repr.immdt);
        prop_assert_eq!(p.payload, &payload[..]);
        prop_assert_eq!(p.icrc, h.compute(buf));
    }

    /// `emit_to_vec` writes what `emit` writes, whatever the reused buffer held before.
    #[test]
    fn emit_to_vec_is_emit(
        f in fields(),
        payload in proptest::collection::vec(any::<u8>(), 0..300),
        old in proptest::collection::vec(any::<u8>(), 0..400),
    ) {
        let repr = f.repr(&payload);
        let mut want = vec![0u8; repr.buffer_len()];
        repr.emit(&mut want).expect("emit");
        let mut got = old;
        repr.emit_to_vec(&mut got);
        prop_assert_eq!(got, want);
    }

    /// `emit_to_vec_with` writes what `emit` writes, whatever the reused buffer held before
    /// (longer or shorter than the packet), with the payload written by its `fill`; a
    /// `fill` that fails returns its error.
    #[test]
    fn emit_to_vec_with_is_emit(
        f in fields(),
        payload in proptest::collection::vec(any::<u8>(), 0..300),
        old in proptest::collection::vec(any::<u8>(), 0..400),
    ) {
        let repr = f.repr(&payload);
        let mut want = vec![0u8; repr.buffer_len()];
        repr.emit(&mut want).expect("emit");
        let unused = PacketRepr { payload: &[0xAB; 7], ..repr };
        let mut got = old.clone();
        let r: Result<(), ()> = unused.emit_to_vec_with(&mut got, payload.len(), |p| {
            p.copy_from_slice(&payload);
            Ok(())
        });
        prop_assert_eq!(r, Ok(()));
        prop_assert_eq!(got, want);
        let mut got = old;
        prop_assert_eq!(repr.emit_to_vec_with(&mut got, payload.len(), |_| Err(7)), Err(7));
    }

    /// A packet kept in pieces (its headers from `emit_head`, the payload where it lies, pad
    /// zeros, the ICRC from `compute_pieces`) is, laid end to end, byte for byte the packet
    /// `emit` and `seal` make, for any opcode, payload length and addresses.
    #[test]
    fn pieces_are_emit(
        f in fields(),
        payload in proptest::collection::vec(any::<u8>(), 0..1100),
        src in ip(), dst in ip(), port: u16, id: u16,
    ) {
        let repr = f.repr(&payload);
        let mut h = IcrcHeaders::new(src, dst, port);
        h.ipv4_id = id;
        let mut want = vec![0u8; repr.buffer_len()];
        repr.emit(&mut want).expect("emit");
        h.seal(&mut want);
        // Headers into a buffer longer than they are (as a sender's inline array is).
        let mut head = [0x5Au8; 40];
        let unused = PacketRepr { payload: &[0xAB; 5], ..repr };
        let n = unused.emit_head(payload.len(), &mut head).expect("emit_head");
        let pad = pad_len(payload.len());
        let icrc = h.compute_pieces(&head[..n], &payload, pad);
        let mut got = head[..n].to_vec();
        got.extend_from_slice(&payload);
        got.extend_from_slice(&[0u8; 3][..pad]);
        got.extend_from_slice(&icrc.to_le_bytes());
        prop_assert_eq!(got, want);
        // A head buffer too short is an error, not a panic.
        prop_assert!(repr.emit_head(payload.len(), &mut [0u8; 11]).is_err());
    }

    /// The ICRC with a prefix made for the packet's length is the full computation's, for
    /// any headers, identification, opcode, payload and BTH byte 4 (set: the full way), whole
    /// and in pieces; a prefix of another length falls back to the full computation.
    #[test]
    fn prefix_is_compute(
        f in fields(),
        payload in proptest::collection::vec(any::<u8>(), 0..2100),
        src in ip(), dst in ip(), port: u16, id: u16, byte4 in prop_oneof![Just(0u8), any::<u8>()],
        other in 0usize..2200,
    ) {
        let repr = f.repr(&payload);
        let mut h = IcrcHeaders::new(src, dst, port);
        h.ipv4_id = id;
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit(&mut buf).expect("emit");
        buf[4] = byte4;
        let pre = h.prefix(buf.len());
        prop_assert_eq!(pre, h.prefix_with(buf.len(), bth_mask_fix(buf.len())));
        prop_assert_eq!(pre.len(), buf.len());
        prop_assert_eq!(pre.compute(&buf), h.compute(&buf));
        prop_assert_eq!(h.prefix(other).compute(&buf), h.compute(&buf));
        prop_assert_eq!(IcrcPrefix::none(h).compute(&buf), h.compute(&buf));
        let mut sealed = buf.clone();
        pre.seal(&mut sealed);
        h.seal(&mut buf);
        prop_assert_eq!(&sealed, &buf);
        let mut head = [0u8; 40];
        let n = repr.emit_head(payload.len(), &mut head).expect("emit_head");
        head[4] = byte4;
        let pad = pad_len(payload.len());
        prop_assert_eq!(
            pre.compute_pieces(&head[..n], &payload, pad),
            h.compute_pieces(&head[..n], &payload, pad)
        );
        prop_assert_eq!(
            h.prefix(other).compute_pieces(&head[..n], &payload, pad),
            h.compute_pieces(&head[..n], &payload, pad)
        );
    }

    /// Over IPv4 the identification the sender used is recovered from the ICRC alone.
    #[test]
    fn ipv4_identification_is_solved(
        id: u16, src in v4(), dst in v4(), payload in proptest::collection::vec(any::<u8>(), 0..200),
    ) {
        let repr = PacketRepr {
            bth: Bth { opcode: Opcode::SEND_ONLY, pkey: DEFAULT_PKEY, dest_qp: 0x11, ..Bth::default() },
            reth: None, aeth: None, immdt: None, payload: &payload,
        };
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit(&mut buf).expect("emit");
        let mut h = IcrcHeaders::new(src, dst, 49441);
        h.ipv4_id = id;
        h.seal(&mut buf);
        h.ipv4_id = 0;
        prop_assert_eq!(h.solve_ipv4_id(&buf), Some(id));
    }

    /// Re-sealing for another identification with the columns gives the ICRC a full pass
    /// computes, and the columns solve it back.
    #[test]
    fn ipv4_id_columns_reseal(
        id: u16, src in v4(), dst in v4(), payload in proptest::collection::vec(any::<u8>(), 0..1100),
    ) {
        let repr = PacketRepr {
            bth: Bth { opcode: Opcode::SEND_ONLY, pkey: DEFAULT_PKEY, dest_qp: 0x11, ..Bth::default() },
            reth: None, aeth: None, immdt: None, payload: &payload,
        };
        let mut buf = vec![0u8; repr.buffer_len()];
        repr.emit(&mut buf).expect("emit");
        let mut h = IcrcHeaders::new(src, dst, 4791);
        let zero = h.compute(&buf);
        h.ipv4_id = id;
        let cols = Ipv4IdColumns::for_len(buf.len());
        prop_assert_eq!(zero ^ cols.delta(id), h.compute(&buf));
        prop_assert_eq!(cols.solve(cols.delta(id)), Some(id));
    }

    /// Arbitrary bytes never make the parser panic, and what parses stays inside the buffer.
    #[test]
    fn parse_arbitrary(buf in proptest::collection::vec(any::<u8>(), 0..80)) {
        if let Ok(p) = Packet::parse(&buf) {
            prop_assert!(p.payload.len() + BTH_LEN + ICRC_LEN <= buf.len());
        }
    }
}
