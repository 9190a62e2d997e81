//! SMC-R over the software RoCEv2 devices between two network namespaces joined by two veth
//! pairs, driven with `smc nc` (root only; skipped with a message otherwise):
//! - a transfer whose SHA-256 matches, over a two-link group;
//! - one veth pair taken down mid-stream: the connection fails over, no byte lost;
//! - loss, reordering, duplication and corruption injected on every device: data intact;
//! - loss made by the kernel (nftables drops RoCE datagrams at random): data intact;
//! - a capture of the veth: tshark decodes our frames as RoCEv2, and every frame's ICRC
//!   verifies with the codec (identification and all, from the captured IP header).
//!
//! Every test creates its own namespaces, veths and addresses and removes them.

use std::fs::File;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod netns;
use netns::{input, root_with_ip, run, sha256_file, spawn_nc, wait, NsPair};

netns::net_type!(
    /// Two namespaces joined by veth pairs 0 and 1 (netns::NsPair), with the `smc nc` of this test.
);

impl Net {
    fn new(test: u8) -> Net {
        let n = 60 + test * 3 + (std::process::id() % 3) as u8;
        Net(NsPair::new('r', &test.to_string(), n, 2))
    }

    /// `smc nc` in namespace `side` with roce devices on both veths (r1 also serves the
    /// TCP address of veth 0, so that both devices form the connection's link group).
    fn nc(&self, side: char, args: &[&str], faults: &str, stdin: Stdio, stdout: Stdio) -> Child {
        let env = [
            format!("SMC_FABRIC_FAULTS={faults}"),
            "SMC_KEEPALIVE_MS=1000".to_string(),
        ];
        let dir = self.dir.join(side.to_string());
        spawn_nc(
            self.smc_cmd(side, &self.roce_devices(side, 2), &dir, &env),
            args,
            stdin,
            stdout,
        )
    }
}

/// Send `len` bytes from namespace b to a; `during` runs once the receiver has `trigger`
/// bytes. Returns the stderr of both sides.
fn transfer(net: &Net, len: usize, faults: &str, trigger: u64, during: impl FnOnce()) -> String {
    let src = input(&net.dir, 0, len);
    let out = net.dir.join("out");
    let port = "7000";
    let server = net.nc(
        'a',
        &["-v", "-l", port, "--bind", &net.addr('a', 0)],
        faults,
        Stdio::null(),
        Stdio::from(File::create(&out).expect("out")),
    );
    std::thread::sleep(Duration::from_millis(300));
    let client = net.nc(
        'b',
        &["-v", &net.addr('a', 0), port],
        faults,
        Stdio::from(File::open(&src).expect("in")),
        Stdio::null(),
    );
    let end = Instant::now() + Duration::from_secs(60);
    while std::fs::metadata(&out).map(|m| m.len()).unwrap_or(0) < trigger && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(5));
    }
    during();
    let ce = wait(client, Duration::from_secs(120), "client");
    let se = wait(server, Duration::from_secs(120), "server");
    assert!(se.contains("over SMC-R"), "server: {se}");
    assert!(ce.contains("over SMC-R"), "client: {ce}");
    assert_eq!(
        sha256_file(&src),
        sha256_file(&out),
        "SHA-256 of what arrived differs"
    );
    format!("{ce}\n{se}")
}

#[test]
fn roce_transfer_between_namespaces() {
    if !root_with_ip() {
        return;
    }
    let net = Net::new(0);
    transfer(&net, 20 << 20, "", 0, || {});
}

#[test]
fn roce_failover_when_a_veth_goes_down() {
    if !root_with_ip() {
        return;
    }
    let net = Net::new(1);
    let va = net.veth('a', 0);
    let ns = net.a.clone();
    transfer(&net, 200 << 20, "", 20 << 20, || {
        run(&["ip", "-n", &ns, "link", "set", &va, "down"]);
    });
}

#[test]
fn roce_faults_leave_data_intact() {
    if !root_with_ip() {
        return;
    }
    let net = Net::new(2);
    let faults = ["r0", "r1"]
        .iter()
        .map(|d| format!("{d}:drop=1,{d}:reorder=1,{d}:dup=1,{d}:corrupt=0.5"))
        .collect::<Vec<_>>()
        .join(",");
    transfer(&net, 10 << 20, &faults, 0, || {});
}

/// Loss made by the kernel rather than by the device: nftables in both namespaces drops 3 %
/// of the datagrams to the RoCE port at random (after GRO, so one drop may be a whole run of
/// packets, and ACKs and CDC messages are lost as well as data). The connection recovers by
/// the RC transport alone (sequence NAKs, the retransmit timer); every byte arrives once.
#[test]
fn roce_kernel_drops_leave_data_intact() {
    if !root_with_ip() {
        return;
    }
    if Command::new("nft").arg("--version").output().is_err() {
        eprintln!("skipped: nft not installed (scripts/install-deps.sh installs nftables)");
        return;
    }
    let net = Net::new(6);
    let rules = "table inet smcloss {
  chain input {
    type filter hook input priority 0; policy accept;
    udp dport 4791 numgen random mod 100 < 3 counter drop
  }
}
";
    for ns in [&net.a, &net.b] {
        let mut nft = Command::new("ip")
            .args(["netns", "exec", ns, "nft", "-f", "-"])
            .stdin(Stdio::piped())
            .spawn()
            .expect("nft");
        use std::io::Write;
        nft.stdin
            .take()
            .expect("stdin")
            .write_all(rules.as_bytes())
            .expect("rules");
        assert!(nft.wait().expect("nft").success(), "nft rules in {ns}");
    }
    transfer(&net, 20 << 20, "", 0, || {});
    // The loss really happened: the rules' counters, both namespaces together.
    let dropped: u64 = [&net.a, &net.b]
        .iter()
        .map(|ns| {
            let out = Command::new("ip")
                .args([
                    "netns", "exec", ns, "nft", "list", "table", "inet", "smcloss",
                ])
                .output()
                .expect("nft list");
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            text.split("counter packets ")
                .nth(1)
                .and_then(|t| t.split_whitespace().next())
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("no counter in {text}"))
        })
        .sum();
    println!("datagrams the kernel dropped: {dropped}");
    assert!(dropped > 0, "nftables dropped nothing");
}

/// Request/response (`smc nc --pingpong` against an echo listener), where the thread that
/// waits for the reply receives the device's datagrams itself: clean and with 1 % loss,
/// reordering and duplication (retransmissions then come from the device thread's timers);
/// every echo is checked byte for byte by the client.
#[test]
fn roce_pingpong_with_and_without_faults() {
    if !root_with_ip() {
        return;
    }
    let net = Net::new(5);
    for (i, faults) in ["", "r0:drop=1,r0:reorder=1,r0:dup=1,r1:drop=1"]
        .into_iter()
        .enumerate()
    {
        let port = (7100 + i).to_string();
        let server = net.nc(
            'a',
            &["-v", "-l", &port, "--echo", "--bind", &net.addr('a', 0)],
            faults,
            Stdio::null(),
            Stdio::null(),
        );
        std::thread::sleep(Duration::from_millis(300));
        let mut client = net.nc(
            'b',
            &[
                "-v",
                &net.addr('a', 0),
                &port,
                "--pingpong",
                "3000",
                "--time",
                "1",
            ],
            faults,
            Stdio::null(),
            Stdio::piped(),
        );
        let mut out = String::new();
        std::io::Read::read_to_string(client.stdout.as_mut().expect("stdout"), &mut out)
            .expect("read");
        let err = wait(client, Duration::from_secs(60), "ping-pong client");
        let mut server = server;
        let _ = server.kill();
        let _ = server.wait();
        assert!(err.contains("over SMC-R"), "faults {faults:?}: {err}");
        let trips: u64 = out
            .split_whitespace()
            .skip_while(|w| *w != "round_trips")
            .nth(1)
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("faults {faults:?}: no round trips in {out:?}"));
        println!("faults {faults:?}: {out}");
        assert!(trips > 0, "faults {faults:?}: {out}");
    }
}

/// A peer killed with SIGKILL while it had bytes unread (as TCP: its kernel answers with a
/// RST): the survivor's connection is reset by SMC-R's own timers (TEST LINK keepalive every
/// second here), not left hanging. (A peer that dies having read everything shows as an end
/// of stream, as its kernel's FIN does over TCP: `smc`'s `peer_process_death_shows_as_over_tcp`.)
#[test]
fn roce_peer_killed_resets_the_survivor() {
    if !root_with_ip() {
        return;
    }
    let net = Net::new(4);
    // The server sends without end; the client's output goes to a pipe nobody reads, so the
    // client stops reading and the server's bytes stay unread in its RMBE.
    let server = net.nc(
        'a',
        &["-v", "-l", "7000", "--bind", &net.addr('a', 0)],
        "",
        Stdio::from(File::open("/dev/zero").expect("/dev/zero")),
        Stdio::null(),
    );
    std::thread::sleep(Duration::from_millis(300));
    // `ip netns exec` execs the program: the child is smc itself.
    let mut client = net.nc(
        'b',
        &["-v", &net.addr('a', 0), "7000"],
        "",
        Stdio::piped(),
        Stdio::piped(),
    );
    // Until the client has stopped reading: its stdout pipe is full.
    let mut out = client.stdout.take().expect("client stdout");
    let mut first = [0u8; 4096];
    std::io::Read::read_exact(&mut out, &mut first).expect("the first bytes reach the client");
    std::thread::sleep(Duration::from_millis(1500));
    client.kill().expect("SIGKILL the client");
    let _ = client.wait();
    drop(out);
    let (status, err) = survivor_end(server);
    assert!(!status.success(), "the survivor reports the reset: {err}");
    assert!(err.contains("reset"), "{err}");
}

/// A peer killed with SIGKILL after it had read everything sent to it (here: nothing): over
/// TCP its kernel's FIN ends the stream, so here too — the survivor, which only received,
/// learns of the death from SMC-R's keepalive and ends with what arrived, as at an end of
/// stream (exit status 0).
#[test]
fn roce_peer_killed_having_read_everything_ends_the_stream() {
    if !root_with_ip() {
        return;
    }
    let net = Net::new(7);
    let out = net.dir.join("out");
    let server = net.nc(
        'a',
        &["-v", "-l", "7000", "--bind", &net.addr('a', 0)],
        "",
        Stdio::null(),
        Stdio::from(File::create(&out).expect("out")),
    );
    std::thread::sleep(Duration::from_millis(300));
    let mut client = net.nc(
        'b',
        &["-v", &net.addr('a', 0), "7000"],
        "",
        Stdio::from(File::open("/dev/zero").expect("/dev/zero")),
        Stdio::null(),
    );
    let end = Instant::now() + Duration::from_secs(30);
    while std::fs::metadata(&out).map(|m| m.len()).unwrap_or(0) < (4 << 20) && Instant::now() < end
    {
        std::thread::sleep(Duration::from_millis(5));
    }
    client.kill().expect("SIGKILL the client");
    let _ = client.wait();
    let (status, err) = survivor_end(server);
    assert!(
        status.success(),
        "the survivor sees an end of stream: {err}"
    );
    let got = std::fs::metadata(&out).map(|m| m.len()).unwrap_or(0);
    assert!(got >= 4 << 20, "{got} bytes");
}

/// Wait (at most 60 s) for the survivor of a killed peer to exit; its status and stderr.
fn survivor_end(mut server: Child) -> (std::process::ExitStatus, String) {
    let killed = Instant::now();
    let status = loop {
        if let Some(st) = server.try_wait().expect("wait") {
            break Some(st);
        }
        if killed.elapsed() > Duration::from_secs(60) {
            let _ = server.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    if let Some(mut e) = server.stderr.take() {
        use std::io::Read;
        let _ = e.read_to_string(&mut err);
    }
    let Some(status) = status else {
        panic!("the server's connection outlived its dead peer by 60 s: {err}");
    };
    (status, err)
}

#[test]
fn roce_capture_decodes_and_every_icrc_verifies() {
    if !root_with_ip() {
        return;
    }
    if Command::new("tshark").arg("-v").output().is_err() {
        eprintln!("skipped: tshark not installed (scripts/install-deps.sh installs it)");
        return;
    }
    if Command::new("ethtool").arg("--version").output().is_err() {
        eprintln!("skipped: ethtool not installed (scripts/install-deps.sh installs it)");
        return;
    }
    let net = Net::new(3);
    // A veth passes a UDP_SEGMENT send on as one frame, segmented only at the receiving socket;
    // without the offload the kernel cuts it into the datagrams a NIC would send, and the
    // capture shows those.
    for (ns, side) in [(&net.a, 'a'), (&net.b, 'b')] {
        let v = net.veth(side, 0);
        run(&[
            "ip",
            "netns",
            "exec",
            ns,
            "ethtool",
            "-K",
            &v,
            "tx-udp-segmentation",
            "off",
        ]);
    }
    let pcap = net.dir.join("roce.pcap");
    let mut cap = Command::new("ip")
        .args(["netns", "exec", &net.a, "tshark", "-q", "-F", "pcap", "-i"])
        .arg(net.veth('a', 0))
        .arg("-w")
        .arg(&pcap)
        .arg("-f")
        .arg("udp port 4791")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("tshark");
    // tshark's capture child writes the file's header once it captures: waited for, since a
    // loaded machine takes seconds to start tshark (a fixed pause captured nothing in CI).
    let end = Instant::now() + Duration::from_secs(60);
    while std::fs::metadata(&pcap).map(|m| m.len()).unwrap_or(0) < 24 {
        assert!(
            Instant::now() < end,
            "tshark did not start capturing in 60 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    transfer(&net, 1 << 20, "", 0, || {});
    std::thread::sleep(Duration::from_millis(500));
    // SIGINT: tshark writes out what it has and ends.
    let _ = Command::new("kill")
        .args(["-INT", &cap.id().to_string()])
        .status();
    let _ = cap.wait();
    // Our codec: every frame's ICRC from its own IP header.
    let data = std::fs::read(&pcap).expect("capture");
    let mut r = pcap_file::pcap::PcapReader::new(&data[..]).expect("pcap");
    let (mut frames, mut writes, mut segmented) = (0, 0, 0);
    while let Some(p) = r.next_packet() {
        let p = p.expect("packet");
        let (h, udp) = smc_wire::roce::icrc_of_ip_packet(&p.data[14..]).expect("IPv4/UDP frame");
        assert!(h.verify(udp), "frame {} ICRC", frames + 1);
        // IP_PMTUDISC_DO sends identification 0; segment k of a UDP_SEGMENT send carries k.
        assert!(
            h.ipv4_id < 64,
            "frame {}: identification {}",
            frames + 1,
            h.ipv4_id
        );
        segmented += usize::from(h.ipv4_id > 0);
        if smc_wire::roce::Packet::parse(udp).is_ok_and(|p| p.bth.opcode.is_write()) {
            writes += 1;
        }
        frames += 1;
    }
    assert!(
        frames > 100 && writes > 100,
        "{frames} frames, {writes} WRITEs"
    );
    assert!(
        segmented > 0,
        "no frame of a UDP_SEGMENT send (identification > 0)"
    );
    // tshark: RoCEv2 with BTH fields.
    let o = Command::new("tshark")
        .args(["-r"])
        .arg(&pcap)
        .args([
            "--disable-heuristic",
            "rpcrdma_infiniband",
            "-T",
            "fields",
            "-e",
            "infiniband.bth.opcode",
            "-e",
            "infiniband.bth.psn",
            "-e",
            "_ws.malformed",
        ])
        .output()
        .expect("tshark -r");
    let text = String::from_utf8_lossy(&o.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), frames, "tshark sees every frame");
    assert!(
        lines.iter().all(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            !f[0].is_empty() && f.get(2).is_none_or(|m| m.is_empty())
        }),
        "every frame decodes as RoCEv2 without malformation:\n{text}"
    );
}
