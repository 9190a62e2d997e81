//! `smc demo` and `smc nc` as processes: each test runs the real binary (two or three
//! processes) on a private shm fabric, in the explicit assert-peer discovery mode.
#![allow(missing_docs)]

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

fn test_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "smc-cli-{}-{}-{}",
        tag,
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0)
    ));
    std::fs::create_dir_all(&d).expect("dir");
    d
}

fn smc(dir: &PathBuf) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_smc"));
    c.env("SMC_FABRIC_DIR", dir)
        .env("SMC_DISCOVERY", "assert-peer")
        .env_remove("SMC_FABRIC_FAULTS");
    c
}

#[test]
fn demo_fails_over_and_keeps_the_checksum() {
    let dir = test_dir("demo");
    let pcap = dir.join("demo.pcap");
    let out = smc(&dir)
        .args(["demo", "--bytes", "8M", "--quiet", "--pcap"])
        .arg(&pcap)
        .output()
        .expect("run smc demo");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo failed: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("connection: SMC-R"), "{text}");
    // The link group first shows two links, one per device.
    assert!(
        text.contains("| 1    | shm0") && text.contains("| 2    | shm1"),
        "{text}"
    );
    assert!(text.contains("fault injection: taking shm"), "{text}");
    assert!(text.contains("the connection now sends on shm"), "{text}");
    assert!(
        text.contains("8388608 bytes over SMC-R, checksum intact"),
        "{text}"
    );
    assert!(text.contains("TCP loopback"), "{text}");
    // The capture decodes: the rendezvous, the link group's LLC flows (the second link
    // added, the failed one deleted) and CDCs.
    let dec = smc(&dir)
        .arg("decode")
        .arg("-r")
        .arg(&pcap)
        .output()
        .expect("run smc decode");
    assert!(dec.status.success());
    let decoded = String::from_utf8_lossy(&dec.stdout);
    for what in [
        "tcp.smc_option",
        "clc.proposal",
        "clc.accept",
        "clc.confirm",
        "llc.confirm_link",
        "llc.add_link",
        "llc.delete_link",
        "cdc",
    ] {
        assert!(
            decoded.lines().any(|l| l.starts_with(what)),
            "{what} missing from the capture:\n{decoded}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

struct Listener {
    child: Child,
    port: u16,
}

impl Drop for Listener {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn nc_listen(dir: &PathBuf, extra: &[&str]) -> Listener {
    let mut child = smc(dir)
        .args(["nc", "-l", "0", "-v"])
        .args(extra)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn listener");
    let err = child.stderr.take().expect("stderr");
    let mut lines = BufReader::new(err).lines();
    let mut port = 0;
    for line in lines.by_ref() {
        let line = line.expect("stderr line");
        if let Some(addr) = line.strip_prefix("smc nc: listening on ") {
            port = addr
                .rsplit(':')
                .next()
                .and_then(|p| p.parse().ok())
                .expect("port");
            break;
        }
    }
    assert_ne!(port, 0);
    // Keep draining stderr so the listener never blocks on it.
    std::thread::spawn(move || for _ in lines {});
    Listener { child, port }
}

fn nc_client(dir: &PathBuf, port: u16, input: Vec<u8>) -> (Vec<u8>, String) {
    let mut c = smc(dir)
        .args(["nc", "-v", "127.0.0.1", &port.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn client");
    let mut stdin = c.stdin.take().expect("stdin");
    let w = std::thread::spawn(move || {
        stdin.write_all(&input).expect("feed stdin");
    });
    let out = c.wait_with_output().expect("client output");
    w.join().expect("stdin writer");
    assert!(
        out.status.success(),
        "client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (
        out.stdout,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn nc_echo_serves_several_clients_over_smc() {
    let dir = test_dir("nc-echo");
    let l = nc_listen(&dir, &["--echo"]);
    let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
    let port = l.port;
    let clients: Vec<_> = (0..3u8)
        .map(|k| {
            let dir = dir.clone();
            let mut d = data.clone();
            d.push(k);
            std::thread::spawn(move || {
                let (out, err) = nc_client(&dir, port, d.clone());
                (out == d, err)
            })
        })
        .collect();
    for c in clients {
        let (same, err) = c.join().expect("client thread");
        assert!(same, "echo differs");
        assert!(err.contains("over SMC-R"), "{err}");
    }
    drop(l);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn nc_one_shot_listener_prints_what_the_client_sends() {
    let dir = test_dir("nc-once");
    let mut l = nc_listen(&dir, &[]);
    // The listener's own stdin is empty: it shuts down its write side at once, so the
    // client's output is empty, and the listener prints what the client sent.
    drop(l.child.stdin.take());
    let (out, err) = nc_client(&dir, l.port, b"hello from smc nc\n".to_vec());
    assert!(out.is_empty());
    assert!(err.contains("over SMC-R"), "{err}");
    let mut stdout = l.child.stdout.take().expect("listener stdout");
    let mut got = Vec::new();
    std::io::Read::read_to_end(&mut stdout, &mut got).expect("listener output");
    assert_eq!(got, b"hello from smc nc\n");
    let status = l.child.wait().expect("listener exit");
    assert!(status.success());
    let _ = std::fs::remove_dir_all(&dir);
}

fn json_of(dir: &PathBuf, cmd: &str) -> serde_json::Value {
    let out = smc(dir)
        .args([cmd, "--json"])
        .output()
        .expect("run observability command");
    assert!(out.status.success(), "smc {cmd} failed");
    serde_json::from_slice(&out.stdout).expect("JSON output")
}

#[test]
fn ss_linkgroup_device_pnet_stats_query_live_processes() {
    let dir = test_dir("observe");
    let l = nc_listen(&dir, &["--echo"]);
    // An SMC client that stays connected while we look (its stdin stays open).
    let mut client = smc(&dir)
        .args(["nc", "127.0.0.1", &l.port.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn client");
    let mut cin = client.stdin.take().expect("stdin");
    cin.write_all(b"ping\n").expect("write");
    let mut cout = BufReader::new(client.stdout.take().expect("stdout"));
    let mut line = String::new();
    cout.read_line(&mut line).expect("echo");
    assert_eq!(line, "ping\n");
    // A plain TCP client: the listener falls back for it (it sends no Proposal).
    let mut plain = std::net::TcpStream::connect(("127.0.0.1", l.port)).expect("plain");
    plain.write_all(b"x").expect("plain write");
    let mut one = [0u8; 1];
    std::io::Read::read_exact(&mut plain, &mut one).expect("plain echo");

    let ss = json_of(&dir, "ss");
    let sockets: Vec<&serde_json::Value> = ss
        .as_array()
        .expect("array")
        .iter()
        .flat_map(|p| p["ss"].as_array().expect("ss").iter())
        .collect();
    let smc_count = sockets.iter().filter(|s| s["mode"] == "SMC-R").count();
    assert_eq!(smc_count, 2, "{ss}");
    assert!(
        sockets
            .iter()
            .any(|s| s["mode"] == "TCP" && s["fallback_reason"] == "peer sent no CLC Proposal"),
        "{ss}"
    );
    let lg = json_of(&dir, "linkgroup");
    let groups: Vec<&serde_json::Value> = lg
        .as_array()
        .expect("array")
        .iter()
        .flat_map(|p| p["linkgroup"].as_array().expect("groups").iter())
        .collect();
    assert_eq!(groups.len(), 2, "one group in each process: {lg}");
    for g in &groups {
        assert_eq!(g["links"].as_array().expect("links").len(), 2, "{lg}");
        // No UEID configured: SMC-Rv1.
        assert_eq!(g["version"], 1, "{lg}");
    }
    let dev = json_of(&dir, "device");
    assert_eq!(dev.as_array().expect("array").len(), 2);
    for p in dev.as_array().expect("array") {
        let names: Vec<&str> = p["device"]
            .as_array()
            .expect("devices")
            .iter()
            .filter_map(|d| d["name"].as_str())
            .collect();
        assert_eq!(names, ["shm0", "shm1"]);
    }
    // `-d`: cursors and buffer sizes of the SMC-R sockets.
    for s in sockets.iter().filter(|s| s["mode"] == "SMC-R") {
        assert_eq!(s["rmbe_size"], 1048576, "{s}");
        assert_eq!(s["peer_rmbe_size"], 1048576, "{s}");
        assert!(s["producer_cursor"].is_string(), "{s}");
    }
    let out = smc(&dir).args(["ss", "-d"]).output().expect("smc ss -d");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("peer cons"), "{text}");
    assert!(text.contains("1048576"), "{text}");
    let pnet = json_of(&dir, "pnet");
    for p in pnet.as_array().expect("array") {
        let rows = p["pnet"].as_array().expect("pnet rows");
        let names: Vec<&str> = rows.iter().filter_map(|d| d["device"].as_str()).collect();
        assert_eq!(names, ["shm0", "shm1"], "{pnet}");
        assert!(rows.iter().all(|d| d["serves_all"] == true), "{pnet}");
    }
    let stats = json_of(&dir, "stats");
    let listener_pid = l.child.id().to_string();
    let server = stats
        .as_array()
        .expect("array")
        .iter()
        .find(|p| p["pid"].as_str() == Some(listener_pid.as_str()))
        .expect("listener stats");
    assert_eq!(server["stats"]["smc_connections"], 1, "{stats}");
    assert_eq!(server["stats"]["fallbacks"], 1, "{stats}");
    assert_eq!(
        server["stats"]["fallbacks_by_reason"]["peer sent no CLC Proposal"], 1,
        "{stats}"
    );
    drop(cin);
    let _ = client.wait();
    drop(l);
    let _ = std::fs::remove_dir_all(&dir);
}
