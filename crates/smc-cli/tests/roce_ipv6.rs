//! SMC-R over the software RoCEv2 devices with IPv6 GIDs, between two network namespaces
//! joined by veth pairs that carry IPv6 addresses besides their IPv4 ones (root only; skipped
//! with a message otherwise), driven with `smc nc` over IPv6 TCP:
//! - a transfer whose SHA-256 matches, with `smc device --json` listing the IPv6 GID,
//!   `smc ss --json` and `smc linkgroup --json` showing the link on it, and a capture of the
//!   veth whose frames are all IPv6, each ICRC verifying with the codec (the IPv6 masking) and
//!   tshark decoding them as RoCEv2;
//! - a veth pair taken down mid-stream: the IPv6 link group fails over to its second link;
//! - a client whose device has only its IPv4-mapped GID is still answered over SMC-R (the
//!   server speaks from its own IPv4-mapped GID), and a client proposing its IPv6 GID to a
//!   server with IPv4-mapped GIDs only is declined with "no SMC-R device found" and falls
//!   back to TCP, data intact.
//!
//! Every test creates its own namespaces, veths and addresses and removes them.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod netns;
use netns::{input, query, root_with_ip, run, sha256_file, spawn_nc, wait, NsPair};

netns::net_type!(
    /// Two namespaces joined by `pairs` veth pairs (netns::NsPair), pair k also on the IPv6
    /// prefix `fdNN:k+1::/64` (`a` is ::1, `b` is ::2), added with `nodad` so that they are usable
    /// at once.
);

impl Net {
    fn new(test: u8, pairs: u8) -> Net {
        let n = 150 + test * 3 + (std::process::id() % 3) as u8;
        let net = Net(NsPair::new('6', &test.to_string(), n, pairs));
        for k in 0..pairs {
            net.add_addr6(k);
        }
        net
    }

    /// The fabric (and control socket) directory of `side`.
    fn fabric_dir(&self, side: char) -> PathBuf {
        self.dir.join(side.to_string())
    }

    /// `smc nc` in namespace `side` with roce devices `devices`.
    fn nc(&self, side: char, devices: &str, args: &[&str], stdin: Stdio, stdout: Stdio) -> Child {
        let env = ["SMC_KEEPALIVE_MS=1000".to_string()];
        spawn_nc(
            self.smc_cmd(side, devices, &self.fabric_dir(side), &env),
            args,
            stdin,
            stdout,
        )
    }
}

fn size(p: &Path) -> u64 {
    std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
}

/// Until `f` holds (at most 60 s).
fn until(what: &str, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(60);
    while !f() {
        assert!(Instant::now() < end, "waited 60 s for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The GID `smc` prints for an address (16 bytes in eight groups of four hex digits).
fn gid_text(a: std::net::IpAddr) -> String {
    let b = match a {
        std::net::IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        std::net::IpAddr::V6(v6) => v6.octets(),
    };
    b.chunks(2)
        .map(|p| format!("{:02x}{:02x}", p[0], p[1]))
        .collect::<Vec<_>>()
        .join(":")
}

/// b sends `len` bytes to a over IPv6 TCP (a listens on its pair-0 IPv6 address) with roce
/// devices `dev_a`/`dev_b`; `during` runs once the receiver has `trigger` bytes, while the
/// client still holds back the last quarter. Returns (client stderr, server stderr).
fn transfer(
    net: &Net,
    (dev_a, dev_b): (&str, &str),
    len: usize,
    trigger: u64,
    during: impl FnOnce(),
) -> (String, String) {
    let src = input(&net.dir, 0, len);
    let out = net.dir.join("out");
    let port = "7600";
    let listen = net.addr6('a', 0);
    let server = net.nc(
        'a',
        dev_a,
        &["-v", "-l", port, "--bind", &listen],
        Stdio::null(),
        Stdio::from(File::create(&out).expect("out")),
    );
    std::thread::sleep(Duration::from_millis(300));
    let mut client = net.nc(
        'b',
        dev_b,
        &["-v", &listen, port],
        Stdio::piped(),
        Stdio::null(),
    );
    let data = std::fs::read(&src).expect("in");
    let split = len - len / 4;
    let mut stdin = client.stdin.take().expect("stdin");
    stdin.write_all(&data[..split]).expect("feed the client");
    until("the first bytes", || size(&out) >= trigger);
    during();
    stdin.write_all(&data[split..]).expect("feed the client");
    drop(stdin);
    let ce = wait(client, Duration::from_secs(120), "client");
    let se = wait(server, Duration::from_secs(120), "server");
    assert_eq!(
        sha256_file(&src),
        sha256_file(&out),
        "SHA-256 of what arrived differs\nclient: {ce}\nserver: {se}"
    );
    (ce, se)
}

/// The first row of `smc ss --json` at `dir` (anywhere in its output) that runs over SMC-R
/// and names its link's GID.
fn smc_row(dir: &Path) -> Option<serde_json::Value> {
    fn find(v: &serde_json::Value) -> Option<&serde_json::Value> {
        match v {
            serde_json::Value::Array(a) => a.iter().find_map(find),
            serde_json::Value::Object(o)
                if o.get("mode").and_then(|m| m.as_str()) == Some("SMC-R")
                    && o.get("gid").is_some_and(|g| g.is_string()) =>
            {
                Some(v)
            }
            serde_json::Value::Object(o) => o.values().find_map(find),
            _ => None,
        }
    }
    find(&query(dir, "ss")).cloned()
}

#[test]
fn roce_ipv6_transfer_shows_gids_and_captures_ipv6_frames() {
    if !root_with_ip() {
        return;
    }
    let tshark = Command::new("tshark").arg("-v").output().is_ok()
        && Command::new("ethtool").arg("--version").output().is_ok();
    if !tshark {
        eprintln!("note: tshark or ethtool missing, the capture part is left out");
    }
    let net = Net::new(0, 1);
    let devs = (
        format!("roce:r0={}", net.veth('a', 0)),
        format!("roce:r0={}", net.veth('b', 0)),
    );
    let (gid_a, gid_b) = (
        gid_text(net.addr6('a', 0).parse().expect("addr")),
        gid_text(net.addr6('b', 0).parse().expect("addr")),
    );
    let pcap = net.dir.join("roce6.pcap");
    let mut cap = None;
    if tshark {
        // Without the offload the kernel cuts a UDP_SEGMENT send into the datagrams a NIC
        // would send, and the capture shows those.
        for side in ['a', 'b'] {
            let v = net.veth(side, 0);
            run(&[
                "ip",
                "netns",
                "exec",
                net.ns(side),
                "ethtool",
                "-K",
                &v,
                "tx-udp-segmentation",
                "off",
            ]);
        }
        cap = Some(
            Command::new("ip")
                .args(["netns", "exec", &net.a, "tshark", "-q", "-F", "pcap", "-i"])
                .arg(net.veth('a', 0))
                .arg("-w")
                .arg(&pcap)
                .arg("-f")
                .arg("udp port 4791")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("tshark"),
        );
        until("tshark to capture", || size(&pcap) >= 24);
        std::thread::sleep(Duration::from_millis(300));
    }
    let dir_a = net.fabric_dir('a');
    let dir_b = net.fabric_dir('b');
    let mut seen = (None, None, serde_json::Value::Null, serde_json::Value::Null);
    let (ce, se) = transfer(&net, (&devs.0, &devs.1), 8 << 20, 1 << 20, || {
        seen = (
            smc_row(&dir_a),
            smc_row(&dir_b),
            query(&dir_a, "device"),
            query(&dir_a, "linkgroup"),
        );
    });
    assert!(se.contains("over SMC-R"), "server: {se}");
    assert!(ce.contains("over SMC-R"), "client: {ce}");
    let (row_a, row_b, dev_a, lgr_a) = seen;
    // smc ss: both ends of the link on the IPv6 GIDs.
    let row_a = row_a.unwrap_or_else(|| panic!("no SMC-R row in smc ss at a"));
    let row_b = row_b.unwrap_or_else(|| panic!("no SMC-R row in smc ss at b"));
    assert_eq!(row_a["gid"].as_str(), Some(gid_a.as_str()), "{row_a}");
    assert_eq!(row_a["peer_gid"].as_str(), Some(gid_b.as_str()), "{row_a}");
    assert_eq!(row_b["gid"].as_str(), Some(gid_b.as_str()), "{row_b}");
    // smc device: the GID table, IPv4-mapped first, then the IPv6 GID (no link-local one).
    let text = dev_a.to_string();
    let ipv4 = gid_text(net.addr('a', 0).parse().expect("addr"));
    assert!(
        text.contains(&format!("\"gids\":[\"{ipv4}\",\"{gid_a}\"]")),
        "{text}"
    );
    // smc linkgroup: the link's GIDs.
    let lg = lgr_a.to_string();
    assert!(lg.contains(&gid_a) && lg.contains(&gid_b), "{lg}");

    let Some(mut cap) = cap else {
        return;
    };
    std::thread::sleep(Duration::from_millis(500));
    let _ = Command::new("kill")
        .args(["-INT", &cap.id().to_string()])
        .status();
    let _ = cap.wait();
    let data = std::fs::read(&pcap).expect("capture");
    let mut r = pcap_file::pcap::PcapReader::new(&data[..]).expect("pcap");
    let (mut frames, mut writes) = (0, 0);
    while let Some(p) = r.next_packet() {
        let p = p.expect("packet");
        let ip = &p.data[14..];
        assert_eq!(ip[0] >> 4, 6, "frame {}: not IPv6", frames + 1);
        let (h, udp) = smc_wire::roce::icrc_of_ip_packet(ip).expect("IPv6/UDP frame");
        assert!(
            matches!(h.src, std::net::IpAddr::V6(a) if a.to_ipv4_mapped().is_none()),
            "frame {}: {:?}",
            frames + 1,
            h.src
        );
        assert!(h.verify(udp), "frame {} ICRC", frames + 1);
        if smc_wire::roce::Packet::parse(udp).is_ok_and(|p| p.bth.opcode.is_write()) {
            writes += 1;
        }
        frames += 1;
    }
    assert!(
        frames > 100 && writes > 100,
        "{frames} frames, {writes} WRITEs"
    );
    let o = Command::new("tshark")
        .args(["-r"])
        .arg(&pcap)
        .args([
            "--disable-heuristic",
            "rpcrdma_infiniband",
            "-T",
            "fields",
            "-e",
            "ipv6.src",
            "-e",
            "infiniband.bth.opcode",
            "-e",
            "_ws.malformed",
        ])
        .output()
        .expect("tshark -r");
    let text = String::from_utf8_lossy(&o.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), frames, "tshark sees every frame");
    let (a6, b6) = (net.addr6('a', 0), net.addr6('b', 0));
    assert!(
        lines.iter().all(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            (f[0] == a6 || f[0] == b6)
                && f.get(1).is_some_and(|o| !o.is_empty())
                && f.get(2).is_none_or(|m| m.is_empty())
        }),
        "every frame decodes as RoCEv2 over IPv6 without malformation:\n{text}"
    );
}

/// Two veth pairs with IPv6 on both: the link group over IPv6 has two links (the second on
/// pair 1's IPv6 GIDs); pair 0 taken down mid-stream, the connection fails over, no byte lost.
#[test]
fn roce_ipv6_failover_when_a_veth_goes_down() {
    if !root_with_ip() {
        return;
    }
    let net = Net::new(1, 2);
    // r1 also serves pair 0's IPv6 address: both devices form the connection's link group.
    let devs = |side: char| {
        format!(
            "roce:r0={},roce:r1={}+{}",
            net.veth(side, 0),
            net.veth(side, 1),
            net.addr6(side, 0)
        )
    };
    let (da, db) = (devs('a'), devs('b'));
    let va = net.veth('a', 0);
    let ns = net.a.clone();
    let dir_a = net.fabric_dir('a');
    let gid_1 = gid_text(net.addr6('a', 1).parse().expect("addr"));
    let mut links = String::new();
    let (ce, se) = transfer(&net, (&da, &db), 96 << 20, 8 << 20, || {
        // Both links up (the second on pair 1's IPv6 GID) before pair 0 goes.
        until("the second link", || {
            links = query(&dir_a, "linkgroup").to_string();
            links.matches("\"active\"").count() >= 2
        });
        run(&["ip", "-n", &ns, "link", "set", &va, "down"]);
    });
    assert!(
        se.contains("over SMC-R") && ce.contains("over SMC-R"),
        "{ce}\n{se}"
    );
    assert!(links.contains(&gid_1), "{links}");
}

/// Over IPv6 TCP: a client whose device has only an IPv4-mapped GID (its roce device on pair
/// 1, which has no IPv6 address, serving pair 0's address) is answered over SMC-R from the
/// server's IPv4-mapped GID; a client proposing its IPv6 GID to a server whose devices have
/// IPv4-mapped GIDs only is declined ("no SMC-R device found") and both use TCP.
#[test]
fn roce_ipv6_mixed_gid_kinds() {
    if !root_with_ip() {
        return;
    }
    let net = Net::new(2, 2);
    // Pair 1 without IPv6: its devices have only their IPv4-mapped GID.
    for side in ['a', 'b'] {
        let addr = format!("{}/64", net.addr6(side, 1));
        let v = net.veth(side, 1);
        run(&["ip", "-n", net.ns(side), "addr", "del", &addr, "dev", &v]);
    }
    let v4_only = |side: char| format!("roce:r1={}+{}", net.veth(side, 1), net.addr6(side, 0));
    let with_v6 = |side: char| format!("roce:r0={}", net.veth(side, 0));

    // An IPv4-mapped-only client, a server with both kinds (its r1 reaches the client's GID).
    let server = format!("{},{}", with_v6('a'), v4_only('a'));
    let dir_a = net.fabric_dir('a');
    let mut row = None;
    let (ce, se) = transfer(&net, (&server, &v4_only('b')), 2 << 20, 256 << 10, || {
        row = smc_row(&dir_a);
    });
    assert!(
        se.contains("over SMC-R") && ce.contains("over SMC-R"),
        "{ce}\n{se}"
    );
    // The server's link is on its IPv4-mapped GID of pair 1, to the client's.
    let row = row.unwrap_or_else(|| panic!("no SMC-R row in smc ss at a"));
    let (ga, gb) = (
        gid_text(net.addr('a', 1).parse().expect("addr")),
        gid_text(net.addr('b', 1).parse().expect("addr")),
    );
    assert_eq!(row["gid"].as_str(), Some(ga.as_str()), "{row}");
    assert_eq!(row["peer_gid"].as_str(), Some(gb.as_str()), "{row}");

    // An IPv6 GID proposed to a server with IPv4-mapped GIDs only.
    let (ce, se) = transfer(&net, (&v4_only('a'), &with_v6('b')), 2 << 20, 0, || {});
    assert!(!ce.contains("over SMC-R"), "client: {ce}");
    assert!(ce.contains("no SMC-R device found"), "client: {ce}");
    assert!(!se.contains("over SMC-R"), "server: {se}");
}
