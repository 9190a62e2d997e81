//! Every vector of shared/spec/test-vectors.md decodes to the listed fields and re-encodes to
//! the same bytes.

use std::net::{Ipv4Addr, Ipv6Addr};

use smc_wire::cdc::{CdcMessage, Cursor};
use smc_wire::clc::{AcceptConfirm, ClcMessage, ClcType, Decline, DeclineCode, Proposal};
use smc_wire::examples::{bytes, VARIANTS, VECTORS};
use smc_wire::llc::*;
use smc_wire::{tcp_option, ControlMessage, Gid, Mac, PeerId, QpMtu, RmbeSize, U24};

fn v(name: &str) -> Vec<u8> {
    bytes(name).expect("vector exists")
}

fn gid(last: u8) -> Gid {
    Gid("fe80::9a03:9bff:fe00:0"
        .parse::<Ipv6Addr>()
        .map(|a| {
            let mut o = a.octets();
            o[15] = last;
            o
        })
        .expect("valid"))
}

fn mac(last: u8) -> Mac {
    Mac([0x98, 0x03, 0x9b, 0x00, 0x00, last])
}

fn client_peer() -> PeerId {
    PeerId {
        instance: 0x1234,
        mac: mac(1),
    }
}

fn server_peer() -> PeerId {
    PeerId {
        instance: 0x5678,
        mac: mac(2),
    }
}

fn llc(name: &str) -> LlcMessage {
    let b = v(name);
    let m = LlcMessage::parse(&b).expect("parses");
    assert_eq!(m.to_bytes().to_vec(), b, "{name} re-encodes");
    m
}

fn clc(name: &str) -> ClcMessage {
    let b = v(name);
    let (m, used) = ClcMessage::parse(&b).expect("parses");
    assert_eq!(used, b.len());
    assert_eq!(m.to_vec(), b, "{name} re-encodes");
    m
}

#[test]
fn all_vectors_listed() {
    assert_eq!(VECTORS.len(), 16);
    assert_eq!(VARIANTS.len(), 4);
}

#[test]
fn tcp_option_vector() {
    let b = v("tcp_option");
    assert_eq!(b, tcp_option::LINUX_ALIGNED);
    assert_eq!(tcp_option::find_in_options(&b), Ok(true));
    assert_eq!(&b[2..], &tcp_option::option_bytes());
}

#[test]
fn clc_proposal_v4() {
    let ClcMessage::Proposal(p) = clc("clc_proposal_v4") else {
        panic!("not a proposal")
    };
    assert_eq!(
        p,
        Proposal {
            version: 1,
            smc_type_v1: 0,
            smc_type_v2: 0,
            peer_id: client_peer(),
            preferred_gid: gid(1),
            preferred_mac: mac(1),
            smcd_area: None,
            ipv4_subnet: Ipv4Addr::new(192, 168, 1, 0),
            ipv4_prefix_len: 24,
            ipv6_prefixes: vec![],
            v2_ext: None,
            smcd_v2_ext: vec![],
        }
    );
    assert!(p.offers_smcr_v1());
}

#[test]
fn clc_proposal_v6() {
    let ClcMessage::Proposal(p) = clc("clc_proposal_v6") else {
        panic!("not a proposal")
    };
    assert_eq!(p.ipv4_subnet, Ipv4Addr::UNSPECIFIED);
    assert_eq!(p.ipv4_prefix_len, 0);
    assert_eq!(p.ipv6_prefixes.len(), 1);
    assert_eq!(
        p.ipv6_prefixes[0].prefix,
        "2001:db8:1::".parse::<Ipv6Addr>().expect("addr")
    );
    assert_eq!(p.ipv6_prefixes[0].prefix_len, 64);
    assert_eq!(p.buffer_len(), 69);
}

#[test]
fn clc_proposal_linux_v2_style() {
    let ClcMessage::Proposal(p) = clc("clc_proposal_linux_v2_style") else {
        panic!("not a proposal")
    };
    assert_eq!(p.version, 2);
    assert_eq!(p.smc_type_v2, 2, "v2 type none");
    assert_eq!(p.smc_type_v1, 0, "v1 type SMC-R");
    assert!(p.offers_smcr_v1());
    let a = p.smcd_area.expect("SMC-D area present");
    assert_eq!((a.ism_gid, a.ism_chid, a.v2_ext_offset), (0, 0, 0));
    assert_eq!(p.ipv4_subnet, Ipv4Addr::new(192, 168, 1, 0));
    assert_eq!(p.ipv4_prefix_len, 24);
    assert_eq!(p.peer_id, client_peer());
    assert_eq!(p.buffer_len(), 92);
}

fn server_accept() -> AcceptConfirm {
    AcceptConfirm {
        version: 1,
        first_contact: true,
        peer_id: server_peer(),
        gid: gid(2),
        mac: mac(2),
        qp_num: U24::new(0x123).expect("u24"),
        rmb_rkey: 0xA1B2,
        rmbe_idx: 1,
        rmbe_alert_token: 5,
        rmbe_size: RmbeSize(2),
        qp_mtu: QpMtu::MTU_1024,
        rmb_vaddr: 0xF0A6_0000,
        v2: None,
        initial_psn: U24::new(0x0A_BCDE).expect("u24"),
    }
}

#[test]
fn clc_accept_first_contact() {
    let ClcMessage::Accept(a) = clc("clc_accept_first_contact") else {
        panic!("not an accept")
    };
    assert_eq!(a, server_accept());
    assert_eq!(a.rmbe_size.bytes(), 64 * 1024);
    assert_eq!(a.qp_mtu.bytes(), Some(1024));
}

#[test]
fn clc_confirm() {
    let ClcMessage::Confirm(c) = clc("clc_confirm") else {
        panic!("not a confirm")
    };
    assert_eq!(
        c,
        AcceptConfirm {
            version: 1,
            first_contact: false,
            peer_id: client_peer(),
            gid: gid(1),
            mac: mac(1),
            qp_num: U24::new(0x124).expect("u24"),
            rmb_rkey: 0xC3D4,
            rmbe_idx: 1,
            rmbe_alert_token: 6,
            rmbe_size: RmbeSize(2),
            qp_mtu: QpMtu::MTU_1024,
            rmb_vaddr: 0xF0A4_0000,
            v2: None,
            initial_psn: U24::new(0x01_2345).expect("u24"),
        }
    );
}

#[test]
fn clc_decline() {
    let ClcMessage::Decline(d) = clc("clc_decline") else {
        panic!("not a decline")
    };
    assert_eq!(d, Decline::new(server_peer(), DeclineCode::NOSMCDEV, false));
    assert_eq!(
        d.diagnosis.description(),
        Some("no SMC device found (R or D)")
    );
    let ClcMessage::Decline(d) = clc("clc_decline_out_of_sync") else {
        panic!("not a decline")
    };
    assert!(d.out_of_sync);
    assert_eq!(d.diagnosis, DeclineCode::SYNCERR);
}

#[test]
fn llc_confirm_link() {
    let LlcMessage::ConfirmLink(c) = llc("llc_confirm_link_req") else {
        panic!("type")
    };
    assert_eq!(
        c,
        ConfirmLink {
            reply: false,
            no_rmbe_eyecatcher: true,
            sender_mac: mac(2),
            sender_gid: gid(2),
            sender_qp: U24::new(0x123).expect("u24"),
            link_num: 1,
            link_user_id: 0x101,
            max_links: 2,
            max_conns: 0,
        }
    );
    let LlcMessage::ConfirmLink(r) = llc("llc_confirm_link_reply") else {
        panic!("type")
    };
    assert!(r.reply && r.no_rmbe_eyecatcher);
    assert_eq!(r.sender_qp.get(), 0x124);
    assert_eq!(r.link_user_id, 0x201);
}

#[test]
fn llc_add_link() {
    let LlcMessage::AddLink(a) = llc("llc_add_link_req") else {
        panic!("type")
    };
    assert_eq!(
        a,
        AddLink {
            reply: false,
            rejected: false,
            reject_reason: AddLinkRejectReason(0),
            sender_mac: mac(0x12),
            sender_gid: gid(0x12),
            sender_qp: U24::new(0x125).expect("u24"),
            link_num: 2,
            mtu: QpMtu::MTU_1024,
            initial_psn: U24::new(0xA0B0).expect("u24"),
        }
    );
    let LlcMessage::AddLink(r) = llc("llc_add_link_reject") else {
        panic!("type")
    };
    assert!(r.reply && r.rejected);
    assert_eq!(r.reject_reason, AddLinkRejectReason::NO_ALTERNATE_PATH);
}

#[test]
fn llc_add_link_cont() {
    let LlcMessage::AddLinkCont(c) = llc("llc_add_link_cont") else {
        panic!("type")
    };
    assert_eq!(c.link_num, 2);
    assert_eq!(c.num_rtokens, 1);
    assert_eq!(
        c.valid_pairs(),
        &[RtokenPair {
            reference_rkey: 0xA1B2,
            new_rkey: 0xB1C2,
            new_vaddr: 0xF0B0_0000
        }]
    );
    assert_eq!(c.pairs[1], RtokenPair::default());
}

#[test]
fn llc_delete_link() {
    let LlcMessage::DeleteLink(d) = llc("llc_delete_link_req") else {
        panic!("type")
    };
    assert_eq!(
        d,
        DeleteLink {
            reply: false,
            all: false,
            orderly: true,
            link_num: 2,
            reason: DeleteLinkReason::PROGRAM_INITIATED,
        }
    );
}

#[test]
fn llc_confirm_rkey() {
    let LlcMessage::ConfirmRkey(c) = llc("llc_confirm_rkey_req") else {
        panic!("type")
    };
    assert_eq!(c.num_tokens, 1);
    assert_eq!((c.rkey, c.vaddr), (0xD4E5, 0xF0C0_0000));
    assert_eq!(
        c.others[0],
        LinkRtoken {
            link_num: 2,
            rkey: 0xE5F6,
            vaddr: 0xF0D0_0000
        }
    );
    assert_eq!(c.others[1], LinkRtoken::default());
    assert!(!c.reply && !c.negative && !c.retry);
}

#[test]
fn llc_delete_rkey() {
    let LlcMessage::DeleteRkey(d) = llc("llc_delete_rkey_req") else {
        panic!("type")
    };
    assert_eq!(d.count, 1);
    assert_eq!(d.valid_rkeys(), &[0xD4E5]);
    assert_eq!(d.error_mask, 0);
}

#[test]
fn llc_test_link() {
    let LlcMessage::TestLink(t) = llc("llc_test_link_req") else {
        panic!("type")
    };
    let data: Vec<u8> = (0u8..16).collect();
    assert_eq!(t.user_data.to_vec(), data);
    assert!(!t.reply);
    let LlcMessage::TestLink(r) = llc("llc_test_link_reply") else {
        panic!("type")
    };
    assert!(r.reply);
    assert_eq!(r.user_data, t.user_data);
}

#[test]
fn cdc_vectors() {
    let b = v("cdc_data");
    let c = CdcMessage::parse(&b).expect("parses");
    assert_eq!(c.seqno, 1);
    assert_eq!(c.alert_token, 5);
    assert_eq!(c.producer, Cursor::new(0, 4096));
    assert_eq!(c.consumer, Cursor::new(0, 0));
    assert_eq!(c.prod_flags.to_byte(), 0);
    assert_eq!(c.conn_flags.to_byte(), 0);
    assert_eq!(c.to_bytes().to_vec(), b);

    let b = v("cdc_close");
    let c = CdcMessage::parse(&b).expect("parses");
    assert_eq!(c.seqno, 3);
    assert_eq!(c.producer, Cursor::new(1, 0x40));
    assert_eq!(c.consumer, Cursor::new(0, 0xC000));
    assert!(c.prod_flags.cons_update_requested);
    assert!(!c.prod_flags.write_blocked && !c.prod_flags.urgent_pending);
    assert!(c.conn_flags.peer_done_writing && c.conn_flags.peer_conn_closed);
    assert!(!c.conn_flags.peer_abnormal_close);
    assert_eq!(c.to_bytes().to_vec(), b);
    assert_eq!(
        ControlMessage::parse(&b).expect("parses"),
        ControlMessage::Cdc(c)
    );
}

#[test]
fn optional_and_unknown_llc_types() {
    let mut b = v("llc_test_link_req");
    b[0] = 0x85;
    let m = LlcMessage::parse(&b).expect("optional type parses");
    assert!(matches!(m, LlcMessage::Optional { msg_type: 0x85, .. }));
    assert_eq!(m.to_bytes().to_vec(), b);
    for t in [0x05u8, 0x0A, 0x3F, 0x21, 0xC0] {
        b[0] = t;
        assert!(
            matches!(
                LlcMessage::parse(&b),
                Err(smc_wire::Error::UnknownType { what: "LLC", .. })
            ),
            "type {t:#x}"
        );
    }
}

#[test]
fn app_c6_error_classes() {
    use smc_wire::ErrorClass;
    // Reserved QP MTU in an Accept → bad value (Decline).
    let mut b = v("clc_accept_first_contact");
    b[50] = 0x20;
    let e = AcceptConfirm::parse(&b, ClcType::ACCEPT).expect_err("reserved MTU");
    assert_eq!(e.class(), ErrorClass::BadValue);
    b[50] = 0x26;
    assert_eq!(
        AcceptConfirm::parse(&b, ClcType::ACCEPT)
            .expect_err("reserved MTU")
            .class(),
        ErrorClass::BadValue
    );
    // Bad eye catcher, trailer, length → malformed (terminate).
    let mut b = v("clc_confirm");
    b[0] = 0;
    assert_eq!(
        ClcMessage::parse(&b).expect_err("eye").class(),
        ErrorClass::Malformed
    );
    let mut b = v("clc_confirm");
    b[67] = 0;
    assert!(matches!(
        ClcMessage::parse(&b),
        Err(smc_wire::Error::BadTrailer { .. })
    ));
    let mut b = v("clc_confirm");
    b[6] = 0x40;
    assert_eq!(
        ClcMessage::parse(&b).expect_err("len").class(),
        ErrorClass::Malformed
    );
    // Decline trailer is tolerated, as Linux does.
    let mut b = v("clc_decline");
    b[27] = 0;
    assert!(ClcMessage::parse(&b).is_ok());
}

#[test]
fn proposal_offset_rules() {
    // Offset above 40 is rejected; an offset between 0 and 40 is skipped.
    let mut b = v("clc_proposal_linux_v2_style");
    b[39] = 41;
    assert!(Proposal::parse(&b).is_err());
    let mut b = v("clc_proposal_v4");
    b.splice(40..40, [0xAAu8; 4]);
    b[6] = 56;
    b[39] = 4;
    let p = Proposal::parse(&b).expect("offset 4 is skipped");
    assert_eq!(p.ipv4_subnet, Ipv4Addr::new(192, 168, 1, 0));
    assert_eq!(p.ipv4_prefix_len, 24);
    // A v1 Proposal longer than its formula is malformed.
    let mut b = v("clc_proposal_v4");
    b.splice(48..48, [0u8; 4]);
    b[6] = 56;
    assert!(Proposal::parse(&b).is_err());
    // More than 8 IPv6 prefixes.
    let mut b = v("clc_proposal_v6");
    b[47] = 9;
    assert!(Proposal::parse(&b).is_err());
}
