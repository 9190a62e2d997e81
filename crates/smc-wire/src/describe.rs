//! A field-by-field description of any message, for `smc decode` and traces.
//!
//! Field names follow wire-formats.md in snake_case. Byte strings (GID, MAC, peer ID) are
//! kept as bytes so a JSON writer can print them as lowercase hex.

use crate::cdc::CdcMessage;
use crate::clc::{AcceptConfirm, ClcMessage};
use crate::eid::Eid;
use crate::llc::{LinkRtoken, LlcMessage};
use crate::llc_v2::LlcV2Message;
use crate::message::{ControlMessage, SendMessage};

/// One field value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// An unsigned integer.
    U(u64),
    /// A flag.
    Bool(bool),
    /// A byte string (printed as lowercase hex).
    Bytes(Vec<u8>),
    /// Text (addresses in their usual notation, names of codes).
    Text(String),
    /// A list of nested records.
    List(Vec<Vec<(&'static str, Value)>>),
}

/// A described message: its kind (`clc.proposal`, `llc.confirm_link`, `cdc`, ...) and fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Description {
    /// The message kind.
    pub kind: &'static str,
    /// The fields, in wire order.
    pub fields: Vec<(&'static str, Value)>,
}

fn u(v: impl Into<u64>) -> Value {
    Value::U(v.into())
}

fn b(v: bool) -> Value {
    Value::Bool(v)
}

fn bytes(v: &[u8]) -> Value {
    Value::Bytes(v.to_vec())
}

/// Describe a CLC message.
pub fn clc(m: &ClcMessage) -> Description {
    match m {
        ClcMessage::Proposal(p) => {
            let mut f = vec![
                ("version", u(p.version)),
                ("smc_type_v1", u(p.smc_type_v1)),
                ("smc_type_v2", u(p.smc_type_v2)),
                ("length", u(p.buffer_len() as u64)),
                ("peer_id", bytes(&p.peer_id.to_bytes())),
                ("preferred_gid", bytes(&p.preferred_gid.0)),
                ("preferred_roce_mac", bytes(&p.preferred_mac.0)),
            ];
            let has_ip_area = p.version < 2 || p.smc_type_v1 != 2;
            let ip_area_at_40 = if p.version >= 2 {
                has_ip_area
            } else {
                p.smcd_area.is_some()
            };
            f.push(("ip_area_offset", u(if ip_area_at_40 { 40u64 } else { 0 })));
            if let Some(a) = &p.smcd_area {
                f.push(("ism_gid", u(a.ism_gid)));
                f.push(("ism_chid", u(a.ism_chid)));
                f.push(("v2_extension_offset", u(a.v2_ext_offset)));
            }
            if has_ip_area {
                proposal_ip_area(p, &mut f);
            }
            if let Some(e) = &p.v2_ext {
                f.push(("eid_count", u(e.eids.len() as u64)));
                f.push(("ism_gid_count", u(e.ism_gid_count)));
                f.push(("smc_release", u(e.release)));
                f.push(("seid", b(e.seid)));
                f.push(("smcd_v2_extension_offset", u(e.smcd_v2_ext_offset)));
                f.push(("roce_v2_gid", bytes(&e.roce_v2_gid.0)));
                f.push(("max_conns", u(e.max_conns)));
                f.push(("max_links", u(e.max_links)));
                f.push(("feature_mask", u(e.feature_mask)));
                f.push(("eids", eids(&e.eids)));
            }
            if !p.smcd_v2_ext.is_empty() {
                f.push(("smcd_v2_extension", bytes(&p.smcd_v2_ext)));
            }
            Description {
                kind: "clc.proposal",
                fields: f,
            }
        }
        ClcMessage::Accept(a) => accept_confirm("clc.accept", a),
        ClcMessage::Confirm(a) => accept_confirm("clc.confirm", a),
        ClcMessage::Decline(d) => decline(d),
    }
}

fn eids(e: &[Eid]) -> Value {
    Value::List(
        e.iter()
            .map(|e| vec![("eid", Value::Text(e.text())), ("bytes", bytes(&e.0))])
            .collect(),
    )
}

fn proposal_ip_area(p: &crate::clc::Proposal, f: &mut Vec<(&'static str, Value)>) {
    f.push(("ipv4_subnet", Value::Text(p.ipv4_subnet.to_string())));
    f.push(("ipv4_prefix_length", u(p.ipv4_prefix_len)));
    f.push(("ipv6_prefix_count", u(p.ipv6_prefixes.len() as u64)));
    f.push((
        "ipv6_prefixes",
        Value::List(
            p.ipv6_prefixes
                .iter()
                .map(|x| {
                    vec![
                        ("prefix", Value::Text(x.prefix.to_string())),
                        ("prefix_length", u(x.prefix_len)),
                    ]
                })
                .collect(),
        ),
    ));
}

fn decline(d: &crate::clc::Decline) -> Description {
    let mut f = vec![
        ("version", u(d.version)),
        ("out_of_sync", b(d.out_of_sync)),
        ("length", u(d.buffer_len() as u64)),
        ("peer_id", bytes(&d.peer_id.to_bytes())),
        ("peer_diagnosis", u(d.diagnosis.0)),
        (
            "peer_diagnosis_text",
            Value::Text(d.diagnosis.description().unwrap_or("unknown").into()),
        ),
    ];
    if let Some(v2) = &d.v2_diagnoses {
        f.push(("os_type", u(d.os_type)));
        f.push((
            "v2_diagnoses",
            Value::List(v2.iter().map(|c| vec![("code", u(c.0))]).collect()),
        ));
    }
    Description {
        kind: "clc.decline",
        fields: f,
    }
}

fn accept_confirm(kind: &'static str, a: &AcceptConfirm) -> Description {
    let mut fields = vec![
        ("version", u(a.version)),
        ("first_contact", b(a.first_contact)),
        ("length", u(a.buffer_len() as u64)),
        ("peer_id", bytes(&a.peer_id.to_bytes())),
        ("gid", bytes(&a.gid.0)),
        ("roce_mac", bytes(&a.mac.0)),
        ("qp_number", u(a.qp_num.get())),
        ("rmb_rkey", u(a.rmb_rkey)),
        ("rmbe_index", u(a.rmbe_idx)),
        ("rmbe_alert_token", u(a.rmbe_alert_token)),
        ("rmbe_size", u(a.rmbe_size.0)),
        ("qp_mtu", u(a.qp_mtu.0)),
        ("rmb_virtual_address", u(a.rmb_vaddr)),
        ("initial_psn", u(a.initial_psn.get())),
    ];
    if let Some(v2) = &a.v2 {
        fields.push(("eid", Value::Text(v2.eid.text())));
        fields.push(("eid_bytes", bytes(&v2.eid.0)));
        if let Some(x) = &v2.first_contact_ext {
            fields.push(("v2_direct", b(x.v2_direct)));
            fields.push(("os_type", u(x.os_type)));
            fields.push(("smc_release", u(x.release)));
            fields.push(("hostname", Value::Text(x.hostname_text())));
            fields.push(("max_conns", u(x.max_conns)));
            fields.push(("max_links", u(x.max_links)));
            fields.push(("feature_mask", u(x.feature_mask)));
            fields.push(("vendor_options", u(x.vendor_options)));
        }
        if let Some(g) = &v2.gid_list {
            fields.push(("gid_count", u(g.len() as u64)));
            fields.push((
                "gid_list",
                Value::List(g.iter().map(|g| vec![("gid", bytes(&g.0))]).collect()),
            ));
        }
    }
    Description { kind, fields }
}

fn link_tokens(t: &[LinkRtoken]) -> Value {
    Value::List(
        t.iter()
            .map(|t| {
                vec![
                    ("link_number", u(t.link_num)),
                    ("rkey", u(t.rkey)),
                    ("virtual_address", u(t.vaddr)),
                ]
            })
            .collect(),
    )
}

/// Describe an LLC message.
pub fn llc(m: &LlcMessage) -> Description {
    let (kind, fields) = match m {
        LlcMessage::ConfirmLink(c) => (
            "llc.confirm_link",
            vec![
                ("reply", b(c.reply)),
                ("no_rmbe_eyecatcher", b(c.no_rmbe_eyecatcher)),
                ("sender_roce_mac", bytes(&c.sender_mac.0)),
                ("sender_gid", bytes(&c.sender_gid.0)),
                ("sender_qp_number", u(c.sender_qp.get())),
                ("link_number", u(c.link_num)),
                ("link_user_id", u(c.link_user_id)),
                ("max_links", u(c.max_links)),
                ("max_conns", u(c.max_conns)),
            ],
        ),
        LlcMessage::AddLink(a) => (
            "llc.add_link",
            vec![
                ("reply", b(a.reply)),
                ("rejected", b(a.rejected)),
                ("reject_reason", u(a.reject_reason.0)),
                ("sender_roce_mac", bytes(&a.sender_mac.0)),
                ("sender_gid", bytes(&a.sender_gid.0)),
                ("sender_qp_number", u(a.sender_qp.get())),
                ("link_number", u(a.link_num)),
                ("qp_mtu", u(a.mtu.0)),
                ("initial_psn", u(a.initial_psn.get())),
            ],
        ),
        LlcMessage::AddLinkCont(c) => (
            "llc.add_link_cont",
            vec![
                ("reply", b(c.reply)),
                ("link_number", u(c.link_num)),
                ("num_rtokens", u(c.num_rtokens)),
                (
                    "rtoken_pairs",
                    Value::List(
                        c.valid_pairs()
                            .iter()
                            .map(|p| {
                                vec![
                                    ("reference_rkey", u(p.reference_rkey)),
                                    ("new_rkey", u(p.new_rkey)),
                                    ("new_virtual_address", u(p.new_vaddr)),
                                ]
                            })
                            .collect(),
                    ),
                ),
            ],
        ),
        LlcMessage::DeleteLink(d) => (
            "llc.delete_link",
            vec![
                ("reply", b(d.reply)),
                ("all", b(d.all)),
                ("orderly", b(d.orderly)),
                ("link_number", u(d.link_num)),
                ("reason_code", u(d.reason.0)),
                (
                    "reason_text",
                    Value::Text(d.reason.description().unwrap_or("unknown").into()),
                ),
            ],
        ),
        LlcMessage::ConfirmRkey(c) => (
            "llc.confirm_rkey",
            vec![
                ("reply", b(c.reply)),
                ("negative", b(c.negative)),
                ("retry", b(c.retry)),
                ("num_tokens", u(c.num_tokens)),
                ("rkey", u(c.rkey)),
                ("virtual_address", u(c.vaddr)),
                (
                    "other_links",
                    link_tokens(&c.others[..usize::from(c.num_tokens.min(2))]),
                ),
            ],
        ),
        LlcMessage::ConfirmRkeyCont(c) => (
            "llc.confirm_rkey_cont",
            vec![
                ("reply", b(c.reply)),
                ("negative", b(c.negative)),
                ("num_tokens_left", u(c.num_tokens_left)),
                (
                    "links",
                    link_tokens(&c.tokens[..usize::from(c.num_tokens_left.min(3))]),
                ),
            ],
        ),
        LlcMessage::DeleteRkey(d) => (
            "llc.delete_rkey",
            vec![
                ("reply", b(d.reply)),
                ("negative", b(d.negative)),
                ("count", u(d.count)),
                ("error_mask", u(d.error_mask)),
                (
                    "rkeys",
                    Value::List(
                        d.valid_rkeys()
                            .iter()
                            .map(|k| vec![("rkey", u(*k))])
                            .collect(),
                    ),
                ),
            ],
        ),
        LlcMessage::TestLink(t) => (
            "llc.test_link",
            vec![("reply", b(t.reply)), ("user_data", bytes(&t.user_data))],
        ),
        LlcMessage::Optional { msg_type, raw } => (
            "llc.optional",
            vec![("type", u(*msg_type)), ("raw", bytes(raw))],
        ),
    };
    Description { kind, fields }
}

/// Describe a CDC message.
pub fn cdc(c: &CdcMessage) -> Description {
    Description {
        kind: "cdc",
        fields: vec![
            ("sequence_number", u(c.seqno)),
            ("alert_token", u(c.alert_token)),
            ("producer_wrap", u(c.producer.wrap)),
            ("producer_cursor", u(c.producer.count)),
            ("consumer_wrap", u(c.consumer.wrap)),
            ("consumer_cursor", u(c.consumer.count)),
            ("write_blocked", b(c.prod_flags.write_blocked)),
            ("urgent_pending", b(c.prod_flags.urgent_pending)),
            ("urgent_present", b(c.prod_flags.urgent_present)),
            (
                "cons_update_requested",
                b(c.prod_flags.cons_update_requested),
            ),
            ("failover_validation", b(c.prod_flags.failover_validation)),
            ("peer_done_writing", b(c.conn_flags.peer_done_writing)),
            ("peer_conn_closed", b(c.conn_flags.peer_conn_closed)),
            ("peer_abnormal_close", b(c.conn_flags.peer_abnormal_close)),
        ],
    }
}

/// Describe an LLC or CDC message.
pub fn control(m: &ControlMessage) -> Description {
    match m {
        ControlMessage::Llc(l) => llc(l),
        ControlMessage::Cdc(c) => cdc(c),
    }
}

/// Describe an LLC message in its version-2 form: the v1 fields of the message (for the
/// types that share the v1 layout) after `llc_version` and the little-endian `length`.
pub fn llc_v2(m: &LlcV2Message) -> Description {
    let head = |kind: &'static str, rest: Vec<(&'static str, Value)>| {
        let mut fields = vec![
            ("llc_version", u(2u8)),
            ("length", u(m.buffer_len() as u64)),
        ];
        fields.extend(rest);
        Description { kind, fields }
    };
    let from_v1 = |v1: LlcMessage| {
        let d = llc(&v1);
        head(d.kind, d.fields)
    };
    match m {
        LlcV2Message::ConfirmLink(c) => from_v1(LlcMessage::ConfirmLink(*c)),
        LlcV2Message::DeleteLink(c) => from_v1(LlcMessage::DeleteLink(*c)),
        LlcV2Message::ConfirmRkey(c) => from_v1(LlcMessage::ConfirmRkey(*c)),
        LlcV2Message::TestLink(c) => from_v1(LlcMessage::TestLink(*c)),
        LlcV2Message::AddLink(a) => {
            let mut f = llc(&LlcMessage::AddLink(a.base)).fields;
            // v2 has no reject reason (byte 2 belongs to the length).
            f.retain(|(k, _)| *k != "reject_reason");
            if let Some(e) = &a.ext {
                f.push(("v2_direct", b(e.v2_direct)));
                f.push(("target_gid", bytes(&e.target_gid.0)));
                f.push(("rkey_count", u(e.rkey_count)));
                f.push((
                    "rtoken_pairs",
                    Value::List(
                        e.rtokens
                            .iter()
                            .map(|p| {
                                vec![
                                    ("reference_rkey", u(p.reference_rkey)),
                                    ("new_rkey", u(p.new_rkey)),
                                    ("new_virtual_address", u(p.new_vaddr)),
                                ]
                            })
                            .collect(),
                    ),
                ));
            }
            head("llc.add_link", f)
        }
        LlcV2Message::ReqAddLink(r) => head(
            "llc.req_add_link",
            vec![
                ("reply", b(r.reply)),
                ("gid_count", u(r.gids.len() as u64)),
                (
                    "gids",
                    Value::List(r.gids.iter().map(|g| vec![("gid", bytes(&g.0))]).collect()),
                ),
            ],
        ),
        LlcV2Message::DeleteRkey(d) => head(
            "llc.delete_rkey",
            vec![
                ("reply", b(d.reply)),
                ("negative", b(d.negative)),
                ("count", u(d.count)),
                ("invalid_count", u(d.invalid_count)),
                (
                    "rkeys",
                    Value::List(d.rkeys.iter().map(|k| vec![("rkey", u(*k))]).collect()),
                ),
            ],
        ),
    }
}

/// Describe any message received by SEND: LLC v1 or v2, or CDC.
pub fn send(m: &SendMessage) -> Description {
    match m {
        SendMessage::Llc(l) => llc(l),
        SendMessage::LlcV2(l) => llc_v2(l),
        SendMessage::Cdc(c) => cdc(c),
    }
}

impl Value {
    /// The value as human-readable text (hex for bytes, `a=b` lists).
    pub fn to_text(&self) -> String {
        match self {
            Value::U(v) => {
                if *v > 9 {
                    format!("{v} ({v:#x})")
                } else {
                    v.to_string()
                }
            }
            Value::Bool(v) => v.to_string(),
            Value::Bytes(v) => match v.len() {
                16 => {
                    let mut a = [0u8; 16];
                    a.copy_from_slice(v);
                    core::net::Ipv6Addr::from(a).to_string()
                }
                6 => {
                    let mut a = [0u8; 6];
                    a.copy_from_slice(v);
                    crate::Mac(a).to_string()
                }
                _ => v.iter().map(|b| format!("{b:02x}")).collect(),
            },
            Value::Text(t) => t.clone(),
            Value::List(items) => {
                let parts: Vec<String> = items
                    .iter()
                    .map(|rec| {
                        let inner: Vec<String> = rec
                            .iter()
                            .map(|(k, v)| format!("{k}={}", v.to_text()))
                            .collect();
                        format!("{{{}}}", inner.join(", "))
                    })
                    .collect();
                format!("[{}]", parts.join(", "))
            }
        }
    }
}
