//! SMC-Rv2 messages: the captured Linux 6.12 vectors of shared/spec/smc-rv2.md §17 decode to
//! the values the spec's tables give and re-emit byte for byte; every SMC message of a real
//! kernel-to-kernel capture does too; malformed variants fail cleanly.

use smc_wire::clc::*;
use smc_wire::clc_v2::*;
use smc_wire::dissect::{self, Found};
use smc_wire::examples::{bytes, V2_VECTORS};
use smc_wire::llc_v2::*;
use smc_wire::{ClcMessage, Eid, Error, Gid, LlcMessage, SendMessage};

fn v(name: &str) -> Vec<u8> {
    bytes(name).unwrap_or_else(|| panic!("vector {name}"))
}

fn mapped(a: u8, b: u8, c: u8, d: u8) -> Gid {
    let mut g = [0u8; 16];
    g[10] = 0xff;
    g[11] = 0xff;
    g[12..].copy_from_slice(&[a, b, c, d]);
    Gid(g)
}

fn ueid() -> Eid {
    Eid::ueid("KERNEL-PEER-SMCR-TEST").expect("test data")
}

#[test]
fn every_v2_vector_round_trips() {
    for (name, _) in V2_VECTORS {
        let b = v(name);
        let again = if name.starts_with("clc") {
            let (m, used) = ClcMessage::parse(&b).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(used, b.len(), "{name}");
            m.to_vec()
        } else {
            SendMessage::parse(&b)
                .unwrap_or_else(|e| panic!("{name}: {e}"))
                .to_vec()
        };
        assert_eq!(hex(&again), hex(&b), "{name} re-emits the captured bytes");
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn proposal_v2_smcr_only() {
    let p = Proposal::parse(&v("clc_proposal_v2_smcr_only")).expect("test data");
    assert_eq!(p.version, 2);
    assert_eq!(p.smc_type_v1, smc_type::NONE);
    assert_eq!(p.smc_type_v2, smc_type::R);
    assert!(!p.offers_smcr_v1());
    assert!(p.offers_smcr_v2());
    assert_eq!(p.smcd_area.expect("test data").v2_ext_offset, 28);
    assert!(p.ipv6_prefixes.is_empty());
    let e = p.v2_ext.as_ref().expect("test data");
    assert_eq!(e.eids, vec![ueid()]);
    assert_eq!(e.release, 1);
    assert!(!e.seid);
    assert_eq!(e.roce_v2_gid, mapped(10, 0, 0, 2));
    assert_eq!((e.max_conns, e.max_links, e.feature_mask), (255, 2, 1));
    assert_eq!(p.buffer_len(), 156);
}

#[test]
fn proposal_v2_with_v1_ip_area_builds_to_linux_formula() {
    // v1 type R and v2 type R: SMC-D area, IP area at 80, extension right after it.
    let mut p = Proposal::parse(&v("clc_proposal_v2_smcr_only")).expect("test data");
    p.smc_type_v1 = smc_type::R;
    p.ipv4_subnet = "10.0.0.0".parse().expect("test data");
    p.ipv4_prefix_len = 24;
    let b = ClcMessage::Proposal(p.clone()).to_vec();
    assert_eq!(b.len(), 40 + 40 + 8 + 40 + 32 + 4);
    assert_eq!(&b[38..40], &[0, 40]);
    assert_eq!(u16::from_be_bytes([b[50], b[51]]), 88 - 52);
    let back = Proposal::parse(&b).expect("test data");
    assert_eq!(
        back,
        Proposal {
            smcd_area: back.smcd_area,
            ..p
        }
    );
    assert_eq!(back.smcd_area.expect("test data").v2_ext_offset, 36);
}

#[test]
fn malformed_v2_proposals_are_refused() {
    let good = v("clc_proposal_v2_smcr_only");
    // Extension offset 0 with a v2 type.
    let mut b = good.clone();
    b[50..52].copy_from_slice(&[0, 0]);
    assert!(matches!(Proposal::parse(&b), Err(Error::Malformed { .. })));
    // Extension offset not where the formula puts it.
    let mut b = good.clone();
    b[51] = 30;
    assert!(matches!(Proposal::parse(&b), Err(Error::Malformed { .. })));
    // EID count 2 but one EID: the length breaks the formula.
    let mut b = good.clone();
    b[80] = 2;
    assert!(Proposal::parse(&b).is_err());
    // An extra byte before the trailer.
    let mut b = good[..good.len() - 4].to_vec();
    b.push(0);
    b.extend_from_slice(&smc_wire::EYECATCHER_SMCR);
    b[6] += 1;
    assert!(matches!(
        Proposal::parse(&b),
        Err(Error::BadLength { found: 157, .. })
    ));
    // IP area offset larger than 40.
    let mut b = good.clone();
    b[39] = 41;
    assert!(matches!(Proposal::parse(&b), Err(Error::Malformed { .. })));
    // Nine EIDs.
    let mut p = Proposal::parse(&good).expect("test data");
    p.v2_ext.as_mut().expect("test data").eids = vec![ueid(); 9];
    let mut buf = vec![0u8; 1024];
    assert!(p.emit(&mut buf).is_err());
}

#[test]
fn accept_v2_first_contact() {
    let a = AcceptConfirm::parse(&v("clc_accept_v2_first_contact"), ClcType::ACCEPT)
        .expect("test data");
    assert_eq!(a.version, 2);
    assert!(a.first_contact);
    assert_eq!(a.gid, mapped(10, 0, 0, 1));
    assert_eq!(a.qp_num.get(), 0x11);
    assert_eq!(a.rmb_rkey, 0x3a5);
    assert_eq!(a.rmbe_alert_token, 1);
    assert_eq!(a.initial_psn.get(), 0x0f16b8);
    let v2 = a.v2.as_ref().expect("test data");
    assert_eq!(v2.eid, ueid());
    let x = v2.first_contact_ext.expect("test data");
    assert!(x.v2_direct);
    assert_eq!((x.os_type, x.release), (OS_TYPE_LINUX, 1));
    assert_eq!(x.hostname_text(), "(none)");
    assert_eq!((x.max_conns, x.max_links, x.feature_mask), (255, 2, 1));
    assert!(v2.gid_list.is_none());
    assert_eq!(a.buffer_len(), 160);
}

#[test]
fn confirm_v2_first_contact_has_gid_list() {
    let c = AcceptConfirm::parse(&v("clc_confirm_v2_first_contact"), ClcType::CONFIRM)
        .expect("test data");
    let v2 = c.v2.as_ref().expect("test data");
    assert_eq!(v2.gid_list.as_deref(), Some(&[mapped(10, 0, 0, 2)][..]));
    assert_eq!(c.buffer_len(), 180);
    assert_eq!(c.rmb_vaddr, 0xff3d948303280000);
}

#[test]
fn accept_confirm_v2_without_first_contact() {
    for (name, t) in [
        ("clc_accept_v2", ClcType::ACCEPT),
        ("clc_confirm_v2", ClcType::CONFIRM),
    ] {
        let a = AcceptConfirm::parse(&v(name), t).expect("test data");
        assert!(!a.first_contact);
        assert_eq!(a.rmbe_alert_token, 2);
        let v2 = a.v2.expect("test data");
        assert_eq!(v2.eid, ueid());
        assert!(v2.first_contact_ext.is_none());
        assert!(v2.gid_list.is_none());
    }
}

#[test]
fn malformed_v2_accepts_are_refused() {
    // First-contact bit on a 108-byte Accept: the extension is missing.
    let mut b = v("clc_accept_v2");
    b[7] = 0x28;
    assert!(matches!(
        AcceptConfirm::parse(&b, ClcType::ACCEPT),
        Err(Error::BadLength { found: 108, .. })
    ));
    // A v2 Accept shorter than 108.
    let mut b = v("clc_accept_v2")[..100].to_vec();
    b[6] = 100;
    b.extend_from_slice(&smc_wire::EYECATCHER_SMCR);
    b[6] = 104;
    assert!(AcceptConfirm::parse(&b, ClcType::ACCEPT).is_err());
    // A GID list count larger than the message.
    let mut b = v("clc_confirm_v2_first_contact");
    b[156] = 3;
    assert!(AcceptConfirm::parse(&b, ClcType::CONFIRM).is_err());
    // Bytes after the known parts are ignored, as Linux drains them.
    let mut b = v("clc_accept_v2");
    b.truncate(104);
    b.extend_from_slice(&[0; 8]);
    b.extend_from_slice(&smc_wire::EYECATCHER_SMCR);
    b[6] = 116;
    let a = AcceptConfirm::parse(&b, ClcType::ACCEPT).expect("test data");
    assert_eq!(a.buffer_len(), 108);
}

#[test]
fn declines_v1_and_v2() {
    let d = Decline::parse(&v("clc_decline_v1_client")).expect("test data");
    assert_eq!((d.version, d.diagnosis), (1, DeclineCode::NOSMCDEV));
    assert!(d.v2_diagnoses.is_none());
    let d = Decline::parse(&v("clc_decline_v2_handmade")).expect("test data");
    assert_eq!((d.version, d.diagnosis), (2, DeclineCode::NOUEID));
    assert_eq!(d.os_type, OS_TYPE_LINUX);
    let built = Decline::new_v2(d.peer_id, DeclineCode::NOUEID, false);
    assert_eq!(
        ClcMessage::Decline(built).to_vec(),
        v("clc_decline_v2_handmade")
    );
    // Version and length must agree (Linux: 28 for v1, 44 for v2).
    let mut b = v("clc_decline_v2_handmade");
    b[7] = 0x10;
    assert!(matches!(Decline::parse(&b), Err(Error::BadLength { .. })));
    let mut b = v("clc_decline_v1_client");
    b[7] = 0x20;
    assert!(matches!(Decline::parse(&b), Err(Error::BadLength { .. })));
}

fn llc2(name: &str) -> LlcV2Message {
    match SendMessage::parse(&v(name)).expect("test data") {
        SendMessage::LlcV2(m) => m,
        other => panic!("{name}: {other:?}"),
    }
}

#[test]
fn llc_v2_confirm_link() {
    let LlcV2Message::ConfirmLink(c) = llc2("llc2_confirm_link_req") else {
        panic!()
    };
    assert!(!c.reply && c.no_rmbe_eyecatcher);
    assert_eq!(c.sender_gid, mapped(10, 0, 0, 1));
    assert_eq!((c.link_num, c.link_user_id), (1, 0x101));
    assert_eq!((c.max_links, c.max_conns), (2, 255));
    let LlcV2Message::ConfirmLink(c) = llc2("llc2_confirm_link_resp") else {
        panic!()
    };
    assert!(c.reply);
}

#[test]
fn llc_v2_add_link_with_rkeys_and_reject() {
    let m = llc2("llc2_add_link_req_1rkey");
    assert_eq!(m.buffer_len(), 88);
    let LlcV2Message::AddLink(a) = m else {
        panic!()
    };
    assert_eq!(a.base.link_num, 2);
    assert_eq!(a.base.sender_qp.get(), 0x12);
    assert_eq!(a.base.initial_psn.get(), 0xac63af);
    let e = a.ext.expect("test data");
    assert!(e.v2_direct);
    assert_eq!(e.target_gid, mapped(10, 0, 0, 1));
    assert_eq!(e.rkey_count, 1);
    assert_eq!(e.rtokens.len(), 1);
    assert_eq!(e.rtokens[0].reference_rkey, 0x3a5);
    assert_eq!(e.rtokens[0].new_rkey, 0x5aa);
    assert_eq!(e.rtokens[0].new_vaddr, 0xff3be41d42f70000);

    let LlcV2Message::AddLink(r) = llc2("llc2_add_link_reject") else {
        panic!()
    };
    assert!(r.base.reply && r.base.rejected);
    assert!(r.ext.is_none());
    // A reject is the request's first 44 bytes with flags 0xC0 (no reason in v2).
    let mut req = v("llc2_add_link_req_1rkey")[..44].to_vec();
    req[1] = 44;
    req[3] = 0xC0;
    assert_eq!(req, v("llc2_add_link_reject"));
}

#[test]
fn llc_v2_add_link_count_is_bounded_by_length() {
    // Count says 200 entries, the message carries one: one is used.
    let mut b = v("llc2_add_link_req_1rkey");
    b[70] = 200;
    let LlcV2Message::AddLink(a) = LlcV2Message::parse(&b).expect("test data") else {
        panic!()
    };
    let e = a.ext.expect("test data");
    assert_eq!((e.rkey_count, e.rtokens.len()), (200, 1));
}

#[test]
fn llc_v2_rkeys_and_delete_link() {
    let LlcV2Message::ConfirmRkey(c) = llc2("llc2_confirm_rkey_req") else {
        panic!()
    };
    assert_eq!(
        (c.rkey, c.vaddr, c.num_tokens),
        (0x3a5, 0xff3be41d42f70000, 0)
    );
    let LlcV2Message::DeleteRkey(d) = llc2("llc2_delete_rkey_req") else {
        panic!()
    };
    assert_eq!(
        (d.count, d.invalid_count, d.rkeys.clone()),
        (1, 0, vec![0x3a5])
    );
    let LlcV2Message::DeleteRkey(d) = llc2("llc2_delete_rkey_resp") else {
        panic!()
    };
    assert!(d.reply);
    assert_eq!((d.count, d.invalid_count, d.rkeys.clone()), (1, 0, vec![0]));
    let LlcV2Message::DeleteLink(d) = llc2("llc2_delete_link_all_orderly_server") else {
        panic!()
    };
    assert!(d.all && d.orderly && !d.reply);
    assert_eq!(d.reason.0, 0x0002_0000);
}

#[test]
fn llc_v2_large_messages() {
    // DELETE RKEY with 20 rkeys: 8 + 80 bytes; REQ ADD LINK with two GIDs: 60 bytes.
    let d = LlcV2Message::DeleteRkey(DeleteRkeyV2 {
        count: 20,
        rkeys: (1..=20).collect(),
        ..Default::default()
    });
    let b = d.to_vec();
    assert_eq!(b.len(), 88);
    assert_eq!(&b[..4], &[0x29, 88, 0, 0]);
    assert_eq!(LlcV2Message::parse(&b).expect("test data"), d);
    let r = LlcV2Message::ReqAddLink(ReqAddLinkV2 {
        reply: false,
        gids: vec![mapped(10, 0, 0, 2), mapped(10, 0, 1, 2)],
    });
    let b = r.to_vec();
    assert_eq!(b.len(), 60);
    assert_eq!(&b[..3], &[0x25, 60, 0]);
    assert_eq!(LlcV2Message::parse(&b).expect("test data"), r);
    // A 4000-byte ADD LINK: 245 rkeys, little-endian length and count.
    let a = LlcV2Message::AddLink(AddLinkV2 {
        base: Default::default(),
        ext: Some(AddLinkV2Ext {
            v2_direct: true,
            target_gid: mapped(1, 2, 3, 4),
            rkey_count: 245,
            rtokens: vec![Default::default(); 245],
        }),
    });
    let b = a.to_vec();
    assert_eq!(b.len(), 72 + 16 * 245);
    assert_eq!(&b[1..3], &(b.len() as u16).to_le_bytes());
    assert_eq!(&b[70..72], &[245, 0]);
    assert_eq!(LlcV2Message::parse(&b).expect("test data"), a);
}

#[test]
fn malformed_llc_v2_is_refused() {
    // Length field below 44 (Linux's check).
    let mut b = v("llc2_confirm_link_req");
    b[1] = 43;
    assert!(matches!(
        LlcV2Message::parse(&b),
        Err(Error::BadLength { .. })
    ));
    // Shorter than 44, longer than 8192.
    assert!(LlcV2Message::parse(&v("llc2_confirm_link_req")[..43]).is_err());
    let mut big = vec![0u8; 8193];
    big[0] = 0x21;
    big[1] = 0x2c;
    assert!(LlcV2Message::parse(&big).is_err());
    // Continuations are not registered in v2 form.
    for t in [0x23u8, 0x28, 0x2a, 0x20] {
        let mut b = v("llc2_confirm_link_req");
        b[0] = t;
        assert!(
            matches!(LlcV2Message::parse(&b), Err(Error::UnknownType { .. })),
            "{t:#x}"
        );
    }
    // DELETE RKEY request naming more rkeys than it carries.
    let mut b = v("llc2_delete_rkey_req");
    b[4] = 10;
    assert!(matches!(
        LlcV2Message::parse(&b),
        Err(Error::Malformed { .. })
    ));
    // REQ ADD LINK with a GID count beyond the message.
    let mut b = vec![0u8; 44];
    b[0] = 0x25;
    b[1] = 44;
    b[24] = 2;
    assert!(matches!(
        LlcV2Message::parse(&b),
        Err(Error::Malformed { .. })
    ));
}

#[test]
fn v1_llc_parser_is_unchanged_for_v2_types() {
    // The v1 parser still refuses a v2 type byte (a v1 link never sees one from Linux).
    assert!(LlcMessage::parse(&v("llc2_delete_link_all_client")).is_err());
}

/// A real capture of two Linux 6.12 kernels doing SMC-Rv2 (kernel-peer `run-pair.sh
/// --conns 2`, trimmed to the SMC messages with tshark): every message decodes and re-emits
/// its exact bytes.
#[test]
fn kernel_capture_decodes_completely() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/linux-6.12-smcrv2-pair.pcap"
    );
    let f = std::fs::File::open(path).expect("capture");
    let (findings, roce) = dissect::read_capture_tally(f).expect("read capture");
    // Every RoCEv2 packet the kernel's rxe sent verifies with the dissector's ICRC check.
    assert!(roce.packets > 0 && roce.icrc_ok == roce.packets, "{roce:?}");
    let mut counts = std::collections::BTreeMap::<String, usize>::new();
    for f in &findings {
        let (kind, orig, again) = match &f.found {
            Found::TcpOption { .. } => ("tcp_option".to_string(), vec![], vec![]),
            Found::Clc(b) => {
                let (m, _) =
                    ClcMessage::parse(b).unwrap_or_else(|e| panic!("frame {}: {e}", f.frame));
                (
                    format!("clc v{} {:?}", b[7] >> 4, m.msg_type()),
                    b.clone(),
                    m.to_vec(),
                )
            }
            Found::Send(b) => {
                let m = SendMessage::parse(b).unwrap_or_else(|e| panic!("frame {}: {e}", f.frame));
                let kind = match &m {
                    SendMessage::LlcV2(l) => format!("llc2 {}", l.name()),
                    SendMessage::Llc(l) => format!("llc1 {:?}", l.msg_type()),
                    SendMessage::Cdc(_) => "cdc".to_string(),
                };
                (kind, b.clone(), m.to_vec())
            }
            Found::ClcError(e) => panic!("frame {}: {e}", f.frame),
            Found::IcrcMismatch { packet } => panic!("frame {} packet {packet}: ICRC", f.frame),
        };
        assert_eq!(hex(&again), hex(&orig), "frame {} re-emits", f.frame);
        *counts.entry(kind).or_default() += 1;
    }
    let c = |k: &str| counts.get(k).copied().unwrap_or(0);
    assert_eq!(c("clc v2 ClcType::PROPOSAL"), 3, "{counts:?}");
    assert_eq!(c("clc v2 ClcType::ACCEPT"), 3, "{counts:?}");
    assert_eq!(c("clc v2 ClcType::CONFIRM"), 3, "{counts:?}");
    assert_eq!(c("clc v1 ClcType::DECLINE"), 2, "{counts:?}");
    assert_eq!(c("llc2 CONFIRM LINK"), 2, "{counts:?}");
    assert_eq!(c("llc2 ADD LINK"), 2, "{counts:?}");
    assert!(c("llc2 CONFIRM RKEY") >= 4, "{counts:?}");
    assert!(c("llc2 DELETE RKEY") >= 4, "{counts:?}");
    assert!(c("llc2 DELETE LINK") >= 2, "{counts:?}");
    assert!(c("cdc") > 100, "{counts:?}");
    assert!(!counts.keys().any(|k| k.starts_with("llc1")), "{counts:?}");
}

fn clc_of(file: &str) -> Vec<ClcMessage> {
    let path = format!("{}/tests/data/{file}", env!("CARGO_MANIFEST_DIR"));
    let f = std::fs::File::open(path).expect("capture");
    dissect::read_capture(f)
        .expect("read capture")
        .into_iter()
        .filter_map(|f| match f.found {
            Found::Clc(b) => Some(ClcMessage::parse(&b).expect("CLC parses").0),
            Found::ClcError(e) => panic!("frame {}: {e}", f.frame),
            _ => None,
        })
        .collect()
}

/// Live CLC exchanges between a Linux 6.12 kernel (kernel-peer, single-VM mode) and smc-rs
/// (`smc nc` with eBPF discovery under `ip netns exec`, UEID `KERNEL-PEER-SMCR-TEST`, the shm
/// fabric: no RoCE, so link setup cannot complete). Kernel client → smc-rs server: the kernel
/// takes our 160-byte first-contact Accept and answers with its Confirm echoing our release and
/// limits (max links 1), then gets our v2 Decline when no CONFIRM LINK can arrive. smc-rs client →
/// kernel server: the kernel finds our 164-byte v1+v2 Proposal valid (it would drop a malformed
/// one silently) and declines in version 2 (our 127.0.0.0/8 subnet is not its 10.77.0.0/24).
#[test]
fn live_clc_with_the_kernel() {
    let m = clc_of("linux-6.12-client-vs-smc-rs-server.pcap");
    assert_eq!(m.len(), 4, "{m:?}");
    let ClcMessage::Accept(ours) = &m[1] else {
        panic!()
    };
    let ClcMessage::Confirm(theirs) = &m[2] else {
        panic!()
    };
    assert_eq!((ours.buffer_len(), theirs.buffer_len()), (160, 180));
    let ofce = ours
        .v2
        .as_ref()
        .and_then(|v| v.first_contact_ext)
        .expect("ours");
    let tfce = theirs
        .v2
        .as_ref()
        .and_then(|v| v.first_contact_ext)
        .expect("theirs");
    assert_eq!(
        (tfce.release, tfce.max_conns, tfce.max_links),
        (ofce.release, ofce.max_conns, 1)
    );
    assert_eq!(theirs.v2.as_ref().map(|v| v.eid), Some(ueid()));
    assert!(
        matches!(&m[3], ClcMessage::Decline(d) if d.version == 2 && d.diagnosis == DeclineCode::TIMEOUT_CL)
    );
    let m = clc_of("linux-6.12-server-vs-smc-rs-client.pcap");
    let ClcMessage::Proposal(p) = &m[0] else {
        panic!()
    };
    assert_eq!((p.version, p.buffer_len()), (2, 164));
    assert!(p.offers_smcr_v1() && p.offers_smcr_v2());
    assert!(
        matches!(&m[1], ClcMessage::Decline(d) if d.version == 2 && d.buffer_len() == 44 && d.diagnosis == DeclineCode::DIFFPREFIX)
    );
    assert_eq!(
        ClcMessage::Decline(Decline::parse(&v("clc_decline_v2_kernel")).expect("parses")).to_vec(),
        v("clc_decline_v2_kernel")
    );
}
