//! Several smc-rs processes on one address (issue 21, item 3; root only, skipped with a message
//! otherwise): three `smc nc` servers in one network namespace share one roce device address
//! (so one UDP port 4791), three clients in another namespace, also sharing one address,
//! connect to one server each at the same time. Every transfer must go over SMC-R and arrive
//! with the SHA-256 it left with — which needs the eBPF program steering each datagram to the
//! process owning its destination QPN on both sides. Once over IPv4, once over IPv6 TCP and
//! the devices' IPv6 GIDs, whose sockets take the QPN slot of their IPv4 socket in the IPv6
//! address's group.

use std::fs::File;
use std::process::{Child, Stdio};
use std::time::Duration;

mod netns;
use netns::{input, root_with_ip, sha256_file, spawn_nc, wait, NsPair};

netns::net_type!(
    /// Namespaces `a` (10.N.1.1) and `b` (10.N.1.2) joined by one veth pair (netns::NsPair).
);

impl Net {
    /// With `v6`, the veth also carries `fdNN:1::1/64` and `::2` (so the devices have IPv6
    /// GIDs).
    fn new(v6: bool) -> Net {
        let tag = if v6 { "6" } else { "s" };
        let n = 120 + (std::process::id() % 7) as u8 + if v6 { 10 } else { 0 };
        let net = Net(NsPair::new('s', tag, n, 1));
        if v6 {
            net.add_addr6(0);
        }
        net
    }

    /// `smc nc` in namespace `side` with one roce device on the veth; every process of a side
    /// shares the fabric directory (and so the reuseport registry).
    fn nc(&self, side: char, args: &[&str], stdin: Stdio, stdout: Stdio) -> Child {
        let dir = self.dir.join(side.to_string());
        spawn_nc(
            self.smc_cmd(side, &self.roce_devices(side, 1), &dir, &[]),
            args,
            stdin,
            stdout,
        )
    }
}

#[test]
fn roce_three_processes_share_one_address() {
    if !root_with_ip() {
        return;
    }
    three_processes_share_one_address(false);
}

#[test]
fn roce_three_processes_share_one_ipv6_address() {
    if !root_with_ip() {
        return;
    }
    three_processes_share_one_address(true);
}

fn three_processes_share_one_address(v6: bool) {
    let net = Net::new(v6);
    let server_addr = if v6 {
        net.addr6('a', 0)
    } else {
        net.addr('a', 0)
    };
    const N: u64 = 3;
    let len = 8 << 20;
    let mut servers = Vec::new();
    for i in 0..N {
        let out = net.dir.join(format!("out{i}"));
        let port = (7100 + i).to_string();
        let s = net.nc(
            'a',
            &["-v", "-l", &port, "--bind", &server_addr],
            Stdio::null(),
            Stdio::from(File::create(&out).expect("out")),
        );
        servers.push((s, out));
    }
    std::thread::sleep(Duration::from_millis(500));
    // The servers joined the shared group (IPv6: also the IPv6 address's): its registry
    // names the steering map.
    let registries: Vec<_> = std::fs::read_dir(net.dir.join("a"))
        .expect("fabric dir")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".reuseport"))
        .collect();
    assert_eq!(
        registries.len(),
        if v6 { 2 } else { 1 },
        "reuseport registries: the servers did not share the port"
    );
    for registry in registries {
        let id = std::fs::read_to_string(registry.path()).expect("registry");
        assert!(id.trim().parse::<u32>().is_ok(), "registry holds {id:?}");
    }
    if v6 {
        // Every server's device has the IPv6 GID (its socket got its QPN slot there too).
        let a: std::net::Ipv6Addr = server_addr.parse().expect("addr");
        let gid: Vec<String> = a.segments().iter().map(|s| format!("{s:04x}")).collect();
        let devices = netns::query(&net.dir.join("a"), "device").to_string();
        assert_eq!(devices.matches(&gid.join(":")).count(), 3, "{devices}");
    }
    let mut clients = Vec::new();
    for i in 0..N {
        let src = input(&net.dir, i, len);
        let port = (7100 + i).to_string();
        let c = net.nc(
            'b',
            &["-v", &server_addr, &port],
            Stdio::from(File::open(&src).expect("in")),
            Stdio::null(),
        );
        clients.push((c, src));
    }
    let limit = Duration::from_secs(120);
    let mut sums = Vec::new();
    for (i, (c, src)) in clients.into_iter().enumerate() {
        let err = wait(c, limit, &format!("client {i}"));
        assert!(err.contains("over SMC-R"), "client {i}: {err}");
        sums.push(sha256_file(&src));
    }
    for (i, (s, out)) in servers.into_iter().enumerate() {
        let err = wait(s, limit, &format!("server {i}"));
        assert!(err.contains("over SMC-R"), "server {i}: {err}");
        assert_eq!(
            sha256_file(&out),
            sums[i],
            "server {i}: SHA-256 of what arrived differs"
        );
    }
}
