//! Property tests: emit → parse → emit is the identity for every message type, and no
//! truncation or single-byte change of any vector can make a parser panic.

use std::net::{Ipv4Addr, Ipv6Addr};

use proptest::prelude::*;
use smc_wire::cdc::{CdcMessage, ConnStateFlags, Cursor, ProducerFlags};
use smc_wire::clc::*;
use smc_wire::clc_v2::*;
use smc_wire::examples::{from_hex, V2_VECTORS, VARIANTS, VECTORS};
use smc_wire::llc::*;
use smc_wire::llc_v2::{AddLinkV2, AddLinkV2Ext, DeleteRkeyV2, LlcV2Message, ReqAddLinkV2};
use smc_wire::{
    tcp_option, ControlMessage, Eid, Gid, Mac, PeerId, QpMtu, RmbeSize, SendMessage, U24,
};

fn u24() -> impl Strategy<Value = U24> {
    (0u32..=0xFF_FFFF).prop_map(U24::truncate)
}
fn gid() -> impl Strategy<Value = Gid> {
    any::<[u8; 16]>().prop_map(Gid)
}
fn mac() -> impl Strategy<Value = Mac> {
    any::<[u8; 6]>().prop_map(Mac)
}
fn peer() -> impl Strategy<Value = PeerId> {
    (any::<u16>(), mac()).prop_map(|(instance, mac)| PeerId { instance, mac })
}
fn cursor() -> impl Strategy<Value = Cursor> {
    (any::<u16>(), any::<u32>()).prop_map(|(w, c)| Cursor::new(w, c))
}

fn eid() -> impl Strategy<Value = Eid> {
    any::<[u8; 32]>().prop_map(Eid)
}

fn v2_ext() -> impl Strategy<Value = ProposalV2Ext> {
    (
        proptest::collection::vec(eid(), 0..=8),
        (any::<u8>(), 0u8..16, any::<bool>(), any::<u16>()),
        (gid(), any::<u8>(), any::<u8>(), any::<u16>()),
    )
        .prop_map(
            |(eids, (ism, release, seid, dofs), (g, mc, ml, fm))| ProposalV2Ext {
                eids,
                ism_gid_count: ism,
                release,
                seid,
                smcd_v2_ext_offset: dofs,
                roce_v2_gid: g,
                max_conns: mc,
                max_links: ml,
                feature_mask: fm,
            },
        )
}

fn proposal() -> impl Strategy<Value = Proposal> {
    (
        (1u8..=15, 0u8..4, 0u8..4, peer(), gid(), mac()),
        proptest::option::of((any::<u64>(), any::<u16>(), any::<u16>())),
        (any::<[u8; 4]>(), 0u8..=32),
        proptest::collection::vec((any::<[u8; 16]>(), 0u8..=128), 0..=8),
        v2_ext(),
        any::<u8>(),
    )
        .prop_map(
            |((version, t1, t2, peer_id, g, m), smcd, (v4, pl), v6, mut ext, fill)| {
                let v2 = version >= 2;
                let ip_area = !v2 || t1 != smc_type::NONE;
                let with_ext = v2 && t2 != smc_type::NONE;
                let ip_len = if ip_area { 8 + 17 * v6.len() } else { 0 };
                // The SMC-Dv2 extension is opaque here: 48 + 10·m bytes when the v2 type
                // includes SMC-D; m = 0 otherwise is what the length formula wants.
                let smcd_v2_ext = if with_ext && smc_type::includes_d(t2) {
                    ext.ism_gid_count %= 8;
                    vec![fill; 48 + 10 * usize::from(ext.ism_gid_count)]
                } else {
                    vec![]
                };
                let smcd_area = if v2 {
                    let (a, b, c) = smcd.unwrap_or_default();
                    Some(SmcdArea {
                        ism_gid: a,
                        ism_chid: b,
                        v2_ext_offset: if with_ext {
                            (80 + ip_len - 52) as u16
                        } else {
                            c
                        },
                    })
                } else {
                    smcd.map(|(a, b, c)| SmcdArea {
                        ism_gid: a,
                        ism_chid: b,
                        v2_ext_offset: c,
                    })
                };
                Proposal {
                    version,
                    smc_type_v1: t1,
                    smc_type_v2: if v2 { t2 } else { 0 },
                    peer_id,
                    preferred_gid: g,
                    preferred_mac: m,
                    smcd_area,
                    ipv4_subnet: if ip_area {
                        Ipv4Addr::from(v4)
                    } else {
                        Ipv4Addr::UNSPECIFIED
                    },
                    ipv4_prefix_len: if ip_area { pl } else { 0 },
                    ipv6_prefixes: if ip_area {
                        v6.into_iter()
                            .map(|(p, l)| Ipv6Prefix {
                                prefix: Ipv6Addr::from(p),
                                prefix_len: l,
                            })
                            .collect()
                    } else {
                        vec![]
                    },
                    v2_ext: with_ext.then_some(ext),
                    smcd_v2_ext,
                }
            },
        )
}

fn first_contact_ext() -> impl Strategy<Value = FirstContactExt> {
    (
        any::<bool>(),
        0u8..16,
        0u8..16,
        any::<[u8; 32]>(),
        (any::<u8>(), any::<u8>(), any::<u16>(), any::<u32>()),
    )
        .prop_map(|(d, os, rel, h, (mc, ml, fm, vo))| FirstContactExt {
            v2_direct: d,
            os_type: os,
            release: rel,
            hostname: h,
            max_conns: mc,
            max_links: ml,
            feature_mask: fm,
            vendor_options: vo,
        })
}

fn accept_confirm(confirm: bool) -> impl Strategy<Value = AcceptConfirm> {
    (
        (1u8..=2, any::<bool>(), peer(), gid(), mac(), u24()),
        (
            any::<u32>(),
            1u8..=255,
            any::<u32>(),
            0u8..16,
            1u8..=5,
            any::<u64>(),
            u24(),
        ),
        (
            eid(),
            first_contact_ext(),
            proptest::option::of(proptest::collection::vec(gid(), 0..4)),
        ),
    )
        .prop_map(
            move |(
                (version, fc, peer_id, gid, mac, qp),
                (rkey, idx, tok, size, mtu, va, psn),
                (eid, fce, gids),
            )| {
                AcceptConfirm {
                    version,
                    first_contact: fc,
                    peer_id,
                    gid,
                    mac,
                    qp_num: qp,
                    rmb_rkey: rkey,
                    rmbe_idx: idx,
                    rmbe_alert_token: tok,
                    rmbe_size: RmbeSize(size),
                    qp_mtu: QpMtu(mtu),
                    rmb_vaddr: va,
                    initial_psn: psn,
                    v2: (version >= 2).then(|| AcceptConfirmV2 {
                        eid,
                        first_contact_ext: fc.then_some(fce),
                        gid_list: if confirm && fc { gids } else { None },
                    }),
                }
            },
        )
}

fn decline() -> impl Strategy<Value = Decline> {
    (
        1u8..=15,
        any::<bool>(),
        peer(),
        any::<u32>(),
        0u8..16,
        proptest::option::of(any::<[u32; 4]>()),
    )
        .prop_map(|(version, oos, peer_id, d, os, v2)| Decline {
            // Linux: a version-2 Decline is 44 bytes, a version-1 one 28.
            version: if v2.is_some() { version.max(2) } else { 1 },
            out_of_sync: oos,
            peer_id,
            diagnosis: DeclineCode(d),
            os_type: if v2.is_some() { os } else { 0 },
            v2_diagnoses: v2.map(|a| a.map(DeclineCode)),
        })
}

fn clc_message() -> impl Strategy<Value = ClcMessage> {
    prop_oneof![
        proposal().prop_map(ClcMessage::Proposal),
        accept_confirm(false).prop_map(ClcMessage::Accept),
        accept_confirm(true).prop_map(ClcMessage::Confirm),
        decline().prop_map(ClcMessage::Decline),
    ]
}

fn link_rtoken() -> impl Strategy<Value = LinkRtoken> {
    (any::<u8>(), any::<u32>(), any::<u64>()).prop_map(|(l, r, v)| LinkRtoken {
        link_num: l,
        rkey: r,
        vaddr: v,
    })
}

fn llc_message() -> impl Strategy<Value = LlcMessage> {
    prop_oneof![
        (
            any::<bool>(),
            any::<bool>(),
            mac(),
            gid(),
            u24(),
            any::<u8>(),
            any::<u32>(),
            any::<[u8; 2]>()
        )
            .prop_map(
                |(r, ec, m, g, q, l, uid, [ml, mc])| LlcMessage::ConfirmLink(ConfirmLink {
                    reply: r,
                    no_rmbe_eyecatcher: ec,
                    sender_mac: m,
                    sender_gid: g,
                    sender_qp: q,
                    link_num: l,
                    link_user_id: uid,
                    max_links: ml,
                    max_conns: mc,
                })
            ),
        (
            any::<bool>(),
            any::<bool>(),
            0u8..16,
            mac(),
            gid(),
            u24(),
            any::<u8>(),
            0u8..16,
            u24()
        )
            .prop_map(
                |(r, z, rr, m, g, q, l, mtu, psn)| LlcMessage::AddLink(AddLink {
                    reply: r,
                    rejected: z,
                    reject_reason: AddLinkRejectReason(rr),
                    sender_mac: m,
                    sender_gid: g,
                    sender_qp: q,
                    link_num: l,
                    mtu: QpMtu(mtu),
                    initial_psn: psn,
                })
            ),
        (
            any::<bool>(),
            any::<u8>(),
            any::<u8>(),
            any::<[(u32, u32, u64); 2]>()
        )
            .prop_map(|(r, l, n, p)| LlcMessage::AddLinkCont(AddLinkCont {
                reply: r,
                link_num: l,
                num_rtokens: n,
                pairs: p.map(|(a, b, c)| RtokenPair {
                    reference_rkey: a,
                    new_rkey: b,
                    new_vaddr: c
                }),
            })),
        (any::<[bool; 3]>(), any::<u8>(), any::<u32>()).prop_map(|([r, a, o], l, reason)| {
            LlcMessage::DeleteLink(DeleteLink {
                reply: r,
                all: a,
                orderly: o,
                link_num: l,
                reason: DeleteLinkReason(reason),
            })
        }),
        (
            any::<[bool; 3]>(),
            any::<u8>(),
            any::<u32>(),
            any::<u64>(),
            link_rtoken(),
            link_rtoken()
        )
            .prop_map(|([r, z, c], n, k, va, o1, o2)| LlcMessage::ConfirmRkey(
                ConfirmRkey {
                    reply: r,
                    negative: z,
                    retry: c,
                    num_tokens: n,
                    rkey: k,
                    vaddr: va,
                    others: [o1, o2],
                }
            )),
        (
            any::<[bool; 2]>(),
            any::<u8>(),
            link_rtoken(),
            link_rtoken(),
            link_rtoken()
        )
            .prop_map(|([r, z], n, a, b, c)| LlcMessage::ConfirmRkeyCont(
                ConfirmRkeyCont {
                    reply: r,
                    negative: z,
                    num_tokens_left: n,
                    tokens: [a, b, c],
                }
            )),
        (any::<[bool; 2]>(), 0u8..=8, any::<u8>(), any::<[u32; 8]>()).prop_map(
            |([r, z], n, mask, k)| LlcMessage::DeleteRkey(DeleteRkey {
                reply: r,
                negative: z,
                count: n,
                error_mask: mask,
                rkeys: k,
            })
        ),
        (any::<bool>(), any::<[u8; 16]>()).prop_map(|(r, d)| LlcMessage::TestLink(TestLink {
            reply: r,
            user_data: d
        })),
        (0x80u8..=0xBF, any::<[u8; 42]>()).prop_map(|(t, rest)| {
            let mut raw = [0u8; 44];
            raw[0] = t;
            raw[1] = 44;
            raw[2..].copy_from_slice(&rest);
            LlcMessage::Optional { msg_type: t, raw }
        }),
    ]
}

fn llc_v2_message() -> impl Strategy<Value = LlcV2Message> {
    let pair = (any::<u32>(), any::<u32>(), any::<u64>()).prop_map(|(a, b, c)| RtokenPair {
        reference_rkey: a,
        new_rkey: b,
        new_vaddr: c,
    });
    prop_oneof![
        // The v1-layout messages (ADD LINK CONTINUATION and the optional range have no v2
        // form; the v2 ADD LINK has no reject reason).
        llc_message().prop_filter_map("has a v2 form", |m| match m {
            LlcMessage::ConfirmLink(c) => Some(LlcV2Message::ConfirmLink(c)),
            LlcMessage::DeleteLink(c) => Some(LlcV2Message::DeleteLink(c)),
            LlcMessage::ConfirmRkey(c) => Some(LlcV2Message::ConfirmRkey(c)),
            LlcMessage::TestLink(c) => Some(LlcV2Message::TestLink(c)),
            LlcMessage::AddLink(mut a) => {
                a.reject_reason = AddLinkRejectReason(0);
                Some(LlcV2Message::AddLink(AddLinkV2 { base: a, ext: None }))
            }
            _ => None,
        }),
        (
            llc_message(),
            any::<bool>(),
            gid(),
            proptest::collection::vec(pair, 0..300)
        )
            .prop_filter_map("an ADD LINK", |(m, d, g, rt)| match m {
                LlcMessage::AddLink(mut a) => {
                    a.reject_reason = AddLinkRejectReason(0);
                    Some(LlcV2Message::AddLink(AddLinkV2 {
                        base: a,
                        ext: Some(AddLinkV2Ext {
                            v2_direct: d,
                            target_gid: g,
                            rkey_count: rt.len() as u16,
                            rtokens: rt,
                        }),
                    }))
                }
                _ => None,
            }),
        (any::<bool>(), proptest::collection::vec(gid(), 0..20))
            .prop_map(|(r, gids)| { LlcV2Message::ReqAddLink(ReqAddLinkV2 { reply: r, gids }) }),
        (
            any::<[bool; 2]>(),
            any::<u8>(),
            proptest::collection::vec(any::<u32>(), 0..=255)
        )
            .prop_map(|([r, z], inv, rkeys)| {
                LlcV2Message::DeleteRkey(DeleteRkeyV2 {
                    reply: r,
                    negative: z,
                    count: rkeys.len() as u8,
                    invalid_count: inv,
                    rkeys,
                })
            }),
    ]
}

fn cdc_message() -> impl Strategy<Value = CdcMessage> {
    (
        any::<u16>(),
        any::<u32>(),
        cursor(),
        cursor(),
        any::<u8>(),
        any::<u8>(),
    )
        .prop_map(|(s, t, p, c, pf, cf)| CdcMessage {
            seqno: s,
            alert_token: t,
            producer: p,
            consumer: c,
            prod_flags: ProducerFlags::from_byte(pf),
            conn_flags: ConnStateFlags::from_byte(cf),
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn clc_roundtrip(m in clc_message()) {
        let bytes = m.to_vec();
        prop_assert_eq!(bytes.len(), m.buffer_len());
        let (parsed, used) = ClcMessage::parse(&bytes).expect("own bytes parse");
        prop_assert_eq!(used, bytes.len());
        prop_assert_eq!(&parsed, &m);
        prop_assert_eq!(parsed.to_vec(), bytes);
    }

    #[test]
    fn llc_roundtrip(m in llc_message()) {
        let bytes = m.to_bytes();
        let parsed = LlcMessage::parse(&bytes).expect("own bytes parse");
        prop_assert_eq!(parsed, m);
        prop_assert_eq!(parsed.to_bytes(), bytes);
        prop_assert_eq!(ControlMessage::parse(&bytes).expect("dispatch"), ControlMessage::Llc(m));
    }

    #[test]
    fn llc_v2_roundtrip(m in llc_v2_message()) {
        let bytes = m.to_vec();
        prop_assert_eq!(bytes.len(), m.buffer_len());
        prop_assert_eq!(&bytes[1..3], &(bytes.len() as u16).to_le_bytes());
        let parsed = LlcV2Message::parse(&bytes).expect("own bytes parse");
        prop_assert_eq!(&parsed, &m);
        prop_assert_eq!(parsed.to_vec(), bytes);
    }

    #[test]
    fn cdc_roundtrip(m in cdc_message()) {
        let bytes = m.to_bytes();
        let parsed = CdcMessage::parse(&bytes).expect("own bytes parse");
        prop_assert_eq!(parsed, m);
        prop_assert_eq!(parsed.to_bytes(), bytes);
    }

    #[test]
    fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = ClcMessage::parse(&b);
        let _ = ControlMessage::parse(&b);
        let _ = SendMessage::parse(&b);
        let _ = tcp_option::find_in_options(&b);
        let _ = tcp_option::find_in_tcp_header(&b);
    }
}

/// Parse with whatever parser fits the vector, and if it parses, check the result is stable.
fn check_no_panic(name: &str, b: &[u8]) {
    if name == "tcp_option" {
        let _ = tcp_option::find_in_options(b);
        return;
    }
    if name.starts_with("clc") {
        if let Ok((m, used)) = ClcMessage::parse(b) {
            assert!(used <= b.len());
            let again = m.to_vec();
            let (m2, _) = ClcMessage::parse(&again).expect("re-emitted message parses");
            assert_eq!(m2, m, "{name}: re-emitted message is stable");
        }
    } else if let Ok(m) = SendMessage::parse(b) {
        let again = m.to_vec();
        assert_eq!(
            SendMessage::parse(&again).expect("re-emitted message parses"),
            m,
            "{name}: re-emitted message is stable"
        );
    }
}

#[test]
fn every_truncation_and_single_byte_change() {
    let mut cases = 0usize;
    for (name, hex) in VECTORS.iter().chain(VARIANTS).chain(V2_VECTORS) {
        let orig = from_hex(hex).expect("hex");
        for len in 0..orig.len() {
            let t = &orig[..len];
            check_no_panic(name, t);
            // An LLC v2 message's size is the SEND's, so a shortened ADD LINK (≥ 44 bytes) is
            // still a message; below 44 nothing parses.
            if name.starts_with("llc2") {
                if len < 44 {
                    assert!(SendMessage::parse(t).is_err(), "{name} truncated to {len}");
                }
            } else if !name.starts_with("tcp") {
                // A truncated message never parses.
                if name.starts_with("clc") {
                    assert!(ClcMessage::parse(t).is_err(), "{name} truncated to {len}");
                } else {
                    assert!(
                        ControlMessage::parse(t).is_err(),
                        "{name} truncated to {len}"
                    );
                }
            }
            cases += 1;
        }
        for i in 0..orig.len() {
            for v in 0..=255u8 {
                let mut m = orig.clone();
                m[i] = v;
                check_no_panic(name, &m);
                cases += 1;
            }
        }
    }
    assert!(cases > 100_000);
}
