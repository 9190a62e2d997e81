//! `smc decode` against live inputs: hex, the bundled vectors, a capture, and bad input.

use std::io::Write;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::Value;
use smc_wire::capture::{CaptureWriter, RoceEndpoint};
use smc_wire::examples::{bytes, V2_VECTORS, VARIANTS, VECTORS};
use smc_wire::{Mac, U24};

fn smc(args: &[&str], stdin: Option<&str>) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_smc"));
    c.args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = c.spawn().expect("run smc");
    if let Some(s) = stdin {
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(s.as_bytes())
            .expect("write stdin");
    } else {
        drop(child.stdin.take());
    }
    child.wait_with_output().expect("smc finishes")
}

fn json_lines(o: &Output) -> Vec<Value> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("each line is JSON"))
        .collect()
}

#[test]
fn every_example_as_json() {
    let o = smc(&["decode", "--example", "all", "--json"], None);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let lines = json_lines(&o);
    assert_eq!(
        lines.len(),
        VECTORS.len() + VARIANTS.len() + V2_VECTORS.len()
    );
    let kinds: Vec<&str> = lines
        .iter()
        .map(|l| l["kind"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(
        &kinds[..16],
        &[
            "tcp.options",
            "clc.proposal",
            "clc.proposal",
            "clc.proposal",
            "clc.accept",
            "clc.confirm",
            "clc.decline",
            "llc.confirm_link",
            "llc.add_link",
            "llc.add_link_cont",
            "llc.delete_link",
            "llc.confirm_rkey",
            "llc.delete_rkey",
            "llc.test_link",
            "cdc",
            "cdc",
        ]
    );
    // The first key is `kind`; integers are numbers; byte strings are lowercase hex.
    let accept = &lines[4];
    let first_key = accept.as_object().and_then(|m| m.keys().next().cloned());
    assert_eq!(first_key.as_deref(), Some("kind"));
    assert_eq!(accept["qp_number"], 0x123);
    assert_eq!(accept["rmb_virtual_address"], 0xF0A6_0000u64);
    assert_eq!(accept["peer_id"], "567898039b000002");
    assert_eq!(accept["gid"], "fe800000000000009a039bfffe000002");
    assert_eq!(accept["roce_mac"], "98039b000002");
    assert_eq!(accept["first_contact"], true);
    assert_eq!(lines[6]["peer_diagnosis"], 0x0303_0000);
    assert_eq!(lines[9]["rtoken_pairs"][0]["new_rkey"], 0xB1C2);
}

#[test]
fn hex_arguments_and_stdin() {
    let h = VECTORS
        .iter()
        .find(|(n, _)| *n == "cdc_data")
        .map(|(_, h)| *h)
        .expect("vector");
    let o = smc(&["decode", h], None);
    assert!(o.status.success());
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.starts_with("cdc\n"), "{text}");
    assert!(text.contains("producer_cursor: 4096 (0x1000)"), "{text}");

    // Several CLC messages back to back on stdin, with comments and blank lines.
    let p = hex::encode(bytes("clc_proposal_v4").expect("v"));
    let a = hex::encode(bytes("clc_accept_first_contact").expect("v"));
    let o = smc(&["decode", "--json"], Some(&format!("# flow\n{p}{a}\n\n")));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let kinds: Vec<String> = json_lines(&o)
        .iter()
        .map(|l| l["kind"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(kinds, ["clc.proposal", "clc.accept"]);
}

#[test]
fn malformed_input_is_a_clear_error() {
    // LLC type 0x05 (unknown, not optional).
    let unknown_llc = format!("052c{}", "00".repeat(42));
    let cases: Vec<(&str, &str)> = vec![(&unknown_llc, "unknown LLC type")];
    for (input, expect) in cases.into_iter().chain([
        ("e2d4c3d90100", "truncated"),
        ("zz", "not valid hex"),
        ("0205aabb", "not a CLC message"),
        // CONFIRM LINK with length byte 43.
        (
            "012b000398039b000002fe800000000000009a039bfffe000002000123010000010102000000000000000000",
            "bad length",
        ),
        // Accept with a reserved QP MTU.
        (
            "e2d4c3d902004418567898039b000002fe800000000000009a039bfffe00000298039b0000020001230000a1b20100000005200000000000f0a60000000abcdee2d4c3d9",
            "QP MTU",
        ),
    ]) {
        let o = smc(&["decode", input], None);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{input}: {err}");
        assert!(err.contains(expect), "{input}: {err}");
        assert!(!err.contains("panicked"), "{input}: {err}");
    }
}

#[test]
fn capture_file() {
    let dir = std::env::temp_dir().join(format!("smc-cli-decode-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("flow.pcap");
    let client = SocketAddrV4::new(Ipv4Addr::new(192, 168, 1, 10), 40000);
    let server = SocketAddrV4::new(Ipv4Addr::new(192, 168, 1, 20), 12345);
    let ep = |last| RoceEndpoint {
        mac: Mac([0x98, 0x03, 0x9b, 0, 0, last]),
        ip: Ipv4Addr::new(192, 168, 1, 10 * last),
    };
    {
        let f = std::fs::File::create(&path).expect("create");
        let mut w = CaptureWriter::new(f).expect("writer");
        let t = Duration::from_secs(1);
        w.tcp_handshake(t, client, server, true).expect("hs");
        // Proposal split across two segments, Accept and Confirm in order.
        let p = bytes("clc_proposal_v4").expect("v");
        w.tcp_data(t, client, server, &p[..20]).expect("seg");
        w.tcp_data(t, client, server, &p[20..]).expect("seg");
        w.tcp_data(
            t,
            server,
            client,
            &bytes("clc_accept_first_contact").expect("v"),
        )
        .expect("seg");
        w.tcp_data(t, client, server, &bytes("clc_confirm").expect("v"))
            .expect("seg");
        w.roce_send(
            t,
            ep(2),
            ep(1),
            U24::truncate(0x124),
            &bytes("llc_confirm_link_req").expect("v"),
        )
        .expect("roce");
        w.roce_send(
            t,
            ep(1),
            ep(2),
            U24::truncate(0x123),
            &bytes("llc_confirm_link_reply").expect("v"),
        )
        .expect("roce");
        w.roce_send(
            t,
            ep(1),
            ep(2),
            U24::truncate(0x123),
            &bytes("cdc_data").expect("v"),
        )
        .expect("roce");
        // After CLC, application data on the stream is not SMC and is ignored.
        w.tcp_data(t, client, server, b"plain application data")
            .expect("seg");
        w.into_inner();
    }
    let p = path.to_string_lossy().to_string();
    let o = smc(&["decode", "-r", &p, "--json"], None);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let lines = json_lines(&o);
    let kinds: Vec<&str> = lines
        .iter()
        .map(|l| l["kind"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(
        kinds,
        [
            "tcp.smc_option",
            "tcp.smc_option",
            "clc.proposal",
            "clc.accept",
            "clc.confirm",
            "llc.confirm_link",
            "llc.confirm_link",
            "cdc"
        ]
    );
    assert_eq!(lines[2]["frame"], 5, "proposal completes in the 5th frame");
    assert_eq!(lines[2]["src"], "192.168.1.10:40000");
    assert_eq!(lines[7]["dest_qp"], 0x123);
    assert_eq!(lines[7]["psn"], 1, "second SEND to QP 0x123");
    // A path given without -r is read as a capture too, with the same result.
    let o = smc(&["decode", "--json", &p], None);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(json_lines(&o), lines);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn not_a_capture_is_an_error() {
    let dir = std::env::temp_dir().join(format!("smc-cli-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("bad.pcap");
    std::fs::write(&path, b"this is not a pcap file at all").expect("write");
    for args in [
        &["decode", "-r", &path.to_string_lossy()][..],
        &["decode", &path.to_string_lossy()][..],
    ] {
        let o = smc(args, None);
        assert!(!o.status.success());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("not a pcap or pcapng capture"),
            "{args:?}: {err}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn empty_input_and_missing_file_are_errors() {
    let o = smc(&["decode", ""], None);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("empty input"));
    assert!(o.stdout.is_empty(), "nothing decoded from nothing");
    let o = smc(&["decode", "/nonexistent/smc-rs/capture.pcap"], None);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no such file"));
}

/// A real capture of two Linux 6.12 kernels doing SMC-Rv2 (smc-wire's test data): every
/// message decodes, 0 errors, in text and JSON, with the v2 fields named.
#[test]
fn decode_kernel_v2_capture() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../smc-wire/tests/data/linux-6.12-smcrv2-pair.pcap"
    );
    let o = smc(&["decode", "-r", path], None);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = smc(&["decode", "--json", "-r", path], None);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let lines = json_lines(&o);
    let kind = |k: &str| lines.iter().filter(|l| l["kind"] == k).count();
    assert_eq!(kind("clc.proposal"), 3);
    assert_eq!(kind("clc.accept"), 3);
    assert_eq!(kind("clc.confirm"), 3);
    assert_eq!(kind("llc.confirm_link"), 2);
    assert_eq!(kind("llc.add_link"), 2);
    let p = lines.iter().find(|l| l["kind"] == "clc.proposal").unwrap();
    assert_eq!(p["eids"][0]["eid"], "KERNEL-PEER-SMCR-TEST");
    assert_eq!(p["roce_v2_gid"], "00000000000000000000ffff0a4d0102");
    assert_eq!(p["smc_release"], 1);
    let add = lines
        .iter()
        .find(|l| l["kind"] == "llc.add_link" && l["reply"] == false)
        .unwrap();
    assert_eq!(add["llc_version"], 2);
    assert_eq!(add["length"], 88);
    assert_eq!(add["rkey_count"], 1);
    let c = lines
        .iter()
        .find(|l| l["kind"] == "clc.confirm" && l["first_contact"] == true)
        .unwrap();
    assert_eq!(c["gid_count"], 1);
    assert_eq!(c["hostname"], "(none)");
}

/// LLC v2 hex input: each message's size from its little-endian length field.
#[test]
fn decode_llc_v2_hex() {
    let add = bytes("llc2_add_link_req_1rkey").unwrap();
    let rej = bytes("llc2_add_link_reject").unwrap();
    let hex: String = add.iter().chain(&rej).map(|b| format!("{b:02x}")).collect();
    let o = smc(&["decode", "--json", &hex], None);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let lines = json_lines(&o);
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["length"], 88);
    assert_eq!(lines[1]["rejected"], true);
    let o = smc(&["decode", "--example", "all"], None);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("# llc2_add_link_req_1rkey"));
}
