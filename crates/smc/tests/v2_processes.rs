//! SMC-Rv2 between two smc-rs processes on the shm fabric (docs/v2.md): the server process is
//! this test binary re-executed with its configuration from the environment, as a deployment
//! would set it (`SMC_VERSIONS`, `SMC_UEIDS`); the client records its traffic and the capture
//! shows which version was spoken. SMC_VERSIONS=1 and =2 both carry data, checked byte for
//! byte. With two shm devices on each side a v2 group has two links (ADD LINK v2 with its rkeys,
//! longer than a ring slot) and fails over when a port goes down.
#![allow(missing_docs)]

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use smc::{DiscoveryMode, Mode, SmcListener, SmcStream, Stack, StackConfig};
use smc_fabric::FabricConfig;
use smc_wire::dissect::{self, Found};
use smc_wire::{ClcMessage, SendMessage};

fn test_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "smc-v2-{}-{}-{}",
        tag,
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0)
    ));
    std::fs::create_dir_all(&d).expect("fabric dir");
    d
}

/// The server process: configuration from the environment (fabric dir, discovery, versions,
/// UEIDs), one echo connection, exit when the parent closes stdin.
#[test]
fn child_entry() {
    if std::env::var_os("SMC_V2_CHILD").is_none() {
        return;
    }
    std::thread::spawn(|| {
        let mut buf = [0u8; 16];
        while matches!(std::io::stdin().read(&mut buf), Ok(n) if n > 0) {}
        std::process::exit(0);
    });
    let config = StackConfig::from_env().expect("configuration from the environment");
    let st = Stack::new(config).expect("stack");
    let l = SmcListener::bind_with(&st, "127.0.0.1:0").expect("bind");
    println!("PORT {}", l.local_addr().expect("addr").port());
    for s in l.incoming() {
        let mut s = s.expect("accept");
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if s.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = s.shutdown(std::net::Shutdown::Write);
    }
}

struct Server {
    child: Child,
    port: u16,
}

impl Server {
    fn spawn(dir: &Path, versions: &str, ueids: &str) -> Server {
        Self::spawn_on(dir, "shm0", versions, ueids)
    }

    fn spawn_on(dir: &Path, devices: &str, versions: &str, ueids: &str) -> Server {
        let mut child = Command::new(std::env::current_exe().expect("exe"))
            .args(["child_entry", "--exact", "--nocapture", "--test-threads=1"])
            .env("SMC_V2_CHILD", "1")
            .env("SMC_FABRIC_DIR", dir)
            .env("SMC_FABRIC_DEVICES", devices)
            .env("SMC_DISCOVERY", "assert-peer")
            .env("SMC_VERSIONS", versions)
            .env("SMC_UEIDS", ueids)
            .env_remove("SMC_CONFIG")
            .env_remove("SMC_FABRIC_FAULTS")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn server");
        let out = child.stdout.take().expect("stdout");
        let mut port = 0;
        for line in BufReader::new(out).lines() {
            let line = line.expect("server output");
            if let Some(i) = line.find("PORT ") {
                port = line[i + 5..].trim().parse().expect("port");
                break;
            }
        }
        assert_ne!(port, 0, "server did not report its port");
        Server { child, port }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// One echo connection from a client stack with `versions` and `ueids` to a server process
/// with its own; returns the CLC messages and the LLC messages of the client's capture.
fn run(
    tag: &str,
    client: (&str, &str),
    server: (&str, &str),
) -> (Vec<ClcMessage>, Vec<SendMessage>) {
    let dir = test_dir(tag);
    let srv = Server::spawn(&dir, server.0, server.1);
    let mut c = StackConfig::new(FabricConfig::with_dir(&dir, 1));
    c.discovery = DiscoveryMode::AssertPeer;
    c.clc_timeout = Duration::from_secs(20);
    // The test's long CLC timer covers the wait for the Accept too (not the 6 s default).
    c.accept_wait = c.clc_timeout;
    c.versions = smc::config::parse_versions(client.0).expect("versions");
    c.ueids = smc::config::parse_ueids(client.1).expect("ueids");
    let st = Stack::new(c).expect("stack");
    let pcap = dir.join("client.pcap");
    st.start_capture(&pcap).expect("capture");
    let mut s = SmcStream::connect_with(&st, ("127.0.0.1", srv.port)).expect("connect");
    assert_eq!(s.mode(), Mode::Smc, "{tag}");
    let data: Vec<u8> = (0..1_000_000u32)
        .map(|i| (i * 31 + i / 977) as u8)
        .collect();
    let mut w = s.try_clone().expect("clone");
    let out = data.clone();
    let t = std::thread::spawn(move || {
        w.write_all(&out).expect("write");
        w.shutdown(std::net::Shutdown::Write).expect("shutdown");
    });
    let mut back = Vec::new();
    s.read_to_end(&mut back).expect("read echo");
    t.join().expect("writer");
    assert!(back == data, "{tag}: echo differs");
    drop(s);
    st.stop_capture().expect("stop capture");
    drop(srv);
    let f = std::fs::File::open(&pcap).expect("capture file");
    let mut clc = Vec::new();
    let mut llc = Vec::new();
    for f in dissect::read_capture(f).expect("read capture") {
        match f.found {
            Found::Clc(b) => clc.push(ClcMessage::parse(&b).expect("CLC parses").0),
            Found::Send(b) => match SendMessage::parse(&b).expect("SEND parses") {
                SendMessage::Cdc(_) => {}
                m => llc.push(m),
            },
            _ => {}
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    (clc, llc)
}

fn accept_version(clc: &[ClcMessage]) -> u8 {
    clc.iter()
        .find_map(|m| match m {
            ClcMessage::Accept(a) => Some(a.version),
            _ => None,
        })
        .expect("an Accept")
}

#[test]
fn smc_versions_1_and_2_between_processes() {
    if std::env::var_os("SMC_V2_CHILD").is_some() {
        return;
    }
    // SMC_VERSIONS=1 on both: a version-1 exchange, v1 LLC.
    let (clc, llc) = run("v1", ("1", ""), ("1", ""));
    assert!(matches!(&clc[0], ClcMessage::Proposal(p) if p.version == 1));
    assert_eq!(accept_version(&clc), 1);
    assert!(!llc.is_empty());
    assert!(llc.iter().all(|m| matches!(m, SendMessage::Llc(_))));

    // SMC_VERSIONS=2 on both with a shared UEID: SMC-Rv2, v2 LLC only.
    let (clc, llc) = run("v2", ("2", "SMC-RS.TEST"), ("2", "OTHER,SMC-RS.TEST"));
    assert!(matches!(&clc[0], ClcMessage::Proposal(p) if p.version == 2 && p.buffer_len() == 156));
    assert_eq!(accept_version(&clc), 2);
    assert!(!llc.is_empty());
    assert!(llc.iter().all(|m| matches!(m, SendMessage::LlcV2(_))));

    // Default (1,2) on both: v2 with a shared UEID, v1 without one.
    let (clc, _) = run("both", ("1,2", "SMC-RS.TEST"), ("1,2", "SMC-RS.TEST"));
    assert_eq!(accept_version(&clc), 2);
    let (clc, llc) = run("no-ueid", ("1,2", "SMC-RS.TEST"), ("1,2", ""));
    assert_eq!(accept_version(&clc), 1);
    assert!(llc.iter().all(|m| matches!(m, SendMessage::Llc(_))));
}

/// Poll `f` for at most `limit`.
fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = std::time::Instant::now() + limit;
    while std::time::Instant::now() < end {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    f()
}

/// SMC_VERSIONS=2 with two shm devices on each side: the v2 group gets its second link from
/// one ADD LINK v2 exchange (request and accepting reply 88 bytes each, the rkey of the one RMB
/// inside: SENDs longer than a ring slot; the client's capture shows its reply), and when the
/// client's first port goes down mid-echo the connection fails over to the other link
/// (counted by one of the two stacks) without losing a byte.
#[test]
fn two_link_v2_group_fails_over_on_shm() {
    if std::env::var_os("SMC_V2_CHILD").is_some() {
        return;
    }
    let dir = test_dir("links");
    let srv = Server::spawn_on(&dir, "shm0,shm1", "2", "SMC-RS.TEST");
    let mut c = StackConfig::new(FabricConfig::with_dir(&dir, 2));
    c.discovery = DiscoveryMode::AssertPeer;
    c.clc_timeout = Duration::from_secs(20);
    // The test's long CLC timer covers the wait for the Accept too (not the 6 s default).
    c.accept_wait = c.clc_timeout;
    c.versions = smc::config::parse_versions("2").expect("versions");
    c.ueids = smc::config::parse_ueids("SMC-RS.TEST").expect("ueids");
    let st = Stack::new(c).expect("stack");
    let pcap = dir.join("client.pcap");
    st.start_capture(&pcap).expect("capture");
    let mut s = SmcStream::connect_with(&st, ("127.0.0.1", srv.port)).expect("connect");
    assert_eq!(s.mode(), Mode::Smc);
    let both = || {
        let g = st.link_groups();
        g.len() == 1 && g[0].links.len() == 2 && g[0].links.iter().all(|l| l.active)
    };
    assert!(
        wait_until(Duration::from_secs(20), both),
        "{:?}",
        st.link_groups()
    );
    let data: Vec<u8> = (0..24_000_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
        .collect();
    let mut w = s.try_clone().expect("clone");
    let out = data.clone();
    let t = std::thread::spawn(move || {
        for chunk in out.chunks(64 * 1024) {
            w.write_all(chunk).expect("write");
        }
        w.shutdown(std::net::Shutdown::Write).expect("shutdown");
    });
    let mut back = Vec::with_capacity(data.len());
    let mut buf = vec![0u8; 64 * 1024];
    let mut downed = false;
    let links_down = st.stats().links_down;
    loop {
        let n = s.read(&mut buf).expect("read echo");
        if n == 0 {
            break;
        }
        back.extend_from_slice(&buf[..n]);
        if !downed && back.len() >= 4 << 20 {
            assert!(st.set_port_state("shm0", smc::PortState::Down));
            downed = true;
        }
    }
    t.join().expect("writer");
    assert!(downed);
    assert!(
        back == data,
        "the echo differs ({} of {} bytes)",
        back.len(),
        data.len()
    );
    assert!(st.stats().links_down > links_down, "a link went down");
    // Both stacks (this one and the server process): the connection moved off the lost link
    // on at least one side (`failovers`).
    let failovers: u64 = smc::control::list_sockets(&dir)
        .iter()
        .filter_map(|sock| smc::control::query(sock, "stats", Duration::from_secs(5)).ok())
        .filter_map(|v| v.get("failovers").and_then(|f| f.as_u64()))
        .sum();
    assert!(failovers > 0, "no connection failed over");
    drop(s);
    st.stop_capture().expect("stop capture");
    drop(srv);
    // The client's side of the ADD LINK v2 exchange (the capture holds what it sent): its
    // accepting reply with the one rkey (72 + 16 bytes), and no ADD LINK CONTINUATION.
    let f = std::fs::File::open(&pcap).expect("capture file");
    let mut adds = Vec::new();
    let mut conts = 0;
    for f in dissect::read_capture(f).expect("read capture") {
        if let Found::Send(b) = f.found {
            match SendMessage::parse(&b) {
                Ok(SendMessage::LlcV2(smc_wire::llc_v2::LlcV2Message::AddLink(a))) => {
                    adds.push((b.len(), a.base.reply, a.ext.map(|e| e.rtokens.len())));
                }
                Ok(SendMessage::Llc(smc_wire::LlcMessage::AddLinkCont(_))) => conts += 1,
                _ => {}
            }
        }
    }
    assert_eq!(adds, vec![(88, true, Some(1))]);
    assert_eq!(conts, 0);
    let _ = std::fs::remove_dir_all(&dir);
}
