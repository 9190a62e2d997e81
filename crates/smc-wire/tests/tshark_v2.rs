//! Wireshark as an outside check of the SMC-Rv2 CLC messages smc-rs emits (shared/spec/
//! smc-rv2.md §16): a Proposal offering v1 and v2 together (not in the kernel capture), the
//! first-contact Accept and Confirm, and a version-2 Decline are written into a capture and
//! tshark's field values must equal ours. tshark decodes no SMC-Rv2 LLC message (§16), so
//! those are checked against the captured kernel bytes in `tests/v2.rs` instead.
//!
//! Needs `tshark`; `SMC_SKIP_TSHARK=1` skips.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::process::Command;
use std::time::Duration;

use smc_wire::capture::CaptureWriter;
use smc_wire::clc::*;
use smc_wire::clc_v2::*;
use smc_wire::examples::bytes;
use smc_wire::{ClcMessage, Eid, Gid};

fn mapped(a: u8, b: u8, c: u8, d: u8) -> Gid {
    let mut g = [0u8; 16];
    g[10] = 0xff;
    g[11] = 0xff;
    g[12..].copy_from_slice(&[a, b, c, d]);
    Gid(g)
}

fn messages() -> Vec<ClcMessage> {
    let mut p = Proposal::parse(&bytes("clc_proposal_v2_smcr_only").expect("test data"))
        .expect("test data");
    p.smc_type_v1 = smc_type::R;
    p.ipv4_subnet = Ipv4Addr::new(10, 0, 0, 0);
    p.ipv4_prefix_len = 24;
    let ext = p.v2_ext.as_mut().expect("test data");
    ext.eids = vec![
        Eid::ueid("SMC-RS.TEST-1").expect("test data"),
        Eid::ueid("SECOND").expect("test data"),
    ];
    ext.max_links = 1;
    ext.roce_v2_gid = mapped(10, 9, 8, 7);
    let a = AcceptConfirm::parse(
        &bytes("clc_accept_v2_first_contact").expect("test data"),
        ClcType::ACCEPT,
    )
    .expect("test data");
    let mut c = AcceptConfirm::parse(
        &bytes("clc_confirm_v2_first_contact").expect("test data"),
        ClcType::CONFIRM,
    )
    .expect("test data");
    c.v2.as_mut().expect("test data").gid_list =
        Some(vec![mapped(10, 0, 0, 2), mapped(10, 0, 1, 2)]);
    let d = Decline::new_v2(a.peer_id, DeclineCode::NOROUTE, false);
    vec![
        ClcMessage::Proposal(p),
        ClcMessage::Accept(a),
        ClcMessage::Confirm(c),
        ClcMessage::Decline(d),
    ]
}

fn tshark_fields(path: &std::path::Path, fields: &[&str]) -> Vec<Vec<String>> {
    let mut cmd = Command::new("tshark");
    cmd.arg("-r")
        .arg(path)
        .args(["-Y", "smc", "-T", "fields", "-E", "occurrence=a"]);
    for f in fields {
        cmd.args(["-e", f]);
    }
    let out = cmd.output().expect("run tshark");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.split('\t').map(str::to_string).collect())
        .collect()
}

#[test]
fn tshark_decodes_v2_clc_as_we_do() {
    if std::env::var_os("SMC_SKIP_TSHARK").is_some() {
        eprintln!("SMC_SKIP_TSHARK set: skipping");
        return;
    }
    let dir = std::env::temp_dir().join(format!("smc-wire-tshark-v2-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let path = dir.join("v2.pcap");
    let client = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 2), 40000);
    let server = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1), 12345);
    let msgs = messages();
    {
        let f = std::fs::File::create(&path).expect("create");
        let mut w = CaptureWriter::new(f).expect("pcap");
        w.tcp_handshake(Duration::from_secs(1), client, server, true)
            .expect("handshake");
        for (i, m) in msgs.iter().enumerate() {
            let from_server = matches!(m, ClcMessage::Accept(_) | ClcMessage::Decline(_));
            let (s, d) = if from_server {
                (server, client)
            } else {
                (client, server)
            };
            w.tcp_data(Duration::from_millis(1010 + i as u64), s, d, &m.to_vec())
                .expect("frame");
        }
        w.into_inner();
    }
    let rows = tshark_fields(
        &path,
        &[
            "smc.clc_msg",
            "smc.length",
            "smc.proposal.eid.count",
            "smc.proposal.eid",
            "smc.proposal.rocev2.gid.ipv4",
            "smc.proposal.smc.version.relnum",
            "smc.proposal.smcv2_ext_offset",
            "smc.accept.eid",
            "smc.accept.peer.host.name",
            "smc.confirm.gid.list.entry_count",
            "smc.confirm.gid.list.entry",
            "smc.confirm.smc.version.relnum",
            "smc.proposal.smc.type",
            "smc.proposal.smcv2.type",
        ],
    );
    assert_eq!(rows.len(), 4, "{rows:?}");
    let ClcMessage::Proposal(p) = &msgs[0] else {
        unreachable!()
    };
    let r = &rows[0];
    assert_eq!(r[0], "1");
    assert_eq!(r[1], p.buffer_len().to_string());
    assert_eq!(r[2], "2");
    assert_eq!(
        r[3],
        "SMC-RS.TEST-1                   ,SECOND                          "
    );
    assert_eq!(r[4], "10.9.8.7");
    assert_eq!(r[5], "1");
    assert_eq!(
        u64::from_str_radix(r[6].trim_start_matches("0x"), 16).expect("test data"),
        36
    );
    assert_eq!((r[12].as_str(), r[13].as_str()), ("0", "0"));
    let r = &rows[1];
    assert_eq!((r[0].as_str(), r[1].as_str()), ("2", "160"));
    assert_eq!(r[7].trim_end(), "KERNEL-PEER-SMCR-TEST");
    assert_eq!(r[8].trim_end(), "(none)");
    let r = &rows[2];
    assert_eq!((r[0].as_str(), r[1].as_str()), ("3", "196"));
    assert_eq!(r[9], "2");
    assert_eq!(r[10], "::ffff:10.0.0.2,::ffff:10.0.1.2");
    assert_eq!(r[11], "1");
    let r = &rows[3];
    assert_eq!((r[0].as_str(), r[1].as_str()), ("4", "44"));
    let decl = tshark_fields(
        &path,
        &[
            "smc.peer.diag.info",
            "smc.decline.os.type",
            "smc.decline.smc.version",
        ],
    );
    let last = decl.last().expect("decline row");
    assert_eq!(
        u64::from_str_radix(
            last[0]
                .split(',')
                .next()
                .unwrap_or("")
                .trim_start_matches("0x"),
            16
        )
        .expect("test data"),
        0x030e_0000,
        "{decl:?}"
    );
    assert_eq!((last[1].as_str(), last[2].as_str()), ("2", "2"), "{decl:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
