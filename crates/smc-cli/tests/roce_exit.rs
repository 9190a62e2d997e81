//! A process with roce devices that exits deletes its link groups (DELETE LINK, entire group),
//! so the peer frees its side at once instead of keeping it for its idle time (root only;
//! skipped with a message otherwise). The same exit is checked against the Linux kernel by
//! `scripts/kernel-interop.sh` (docs/v2.md).
//!
//! Two namespaces joined by one veth pair, created and removed by the test.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

mod netns;
use netns::{root_with_ip, NsPair};

netns::net_type!(
    /// Namespaces `a` (10.N.1.1) and `b` (10.N.1.2) on one veth pair (netns::NsPair).
);

impl Net {
    /// Each test its own namespaces (`test` tells them apart: the tests run at once).
    fn new(test: u8) -> Net {
        Net(NsPair::new(
            'x',
            &test.to_string(),
            90 + (std::process::id() % 7) as u8,
            1,
        ))
    }

    fn fabric_dir(&self, side: char) -> PathBuf {
        self.dir.join(side.to_string())
    }

    /// `smc ARGS` in namespace `side` with a roce device on its veth.
    fn smc(&self, side: char, args: &[&str], stdin: Stdio) -> Child {
        self.smc_cmd(
            side,
            &self.roce_devices(side, 1),
            &self.fabric_dir(side),
            &[],
        )
        .args(args)
        .stdin(stdin)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn smc")
    }

    /// The number of link groups of the stacks whose fabric directory is `side`'s.
    fn link_groups(&self, side: char) -> usize {
        netns::link_groups(&netns::query(&self.fabric_dir(side), "linkgroup")).len()
    }
}

#[test]
fn exiting_client_deletes_its_link_group_at_the_server() {
    if !root_with_ip() {
        return;
    }
    let net = Net::new(0);
    let server_addr = format!("10.{}.1.1", net.n);
    let mut server = net.smc(
        'a',
        &["nc", "-v", "-l", "7100", "--echo", "--bind", &server_addr],
        Stdio::null(),
    );
    // The server is up once its stack answers `smc linkgroup`.
    let end = Instant::now() + Duration::from_secs(20);
    while !net.fabric_dir('a').exists() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));

    let mut client = net.smc('b', &["nc", "-v", &server_addr, "7100"], Stdio::piped());
    let mut stdin = client.stdin.take().expect("stdin");
    stdin
        .write_all(b"hello over a roce link group\n")
        .expect("write");
    // While the client is connected, the server has its link group.
    let end = Instant::now() + Duration::from_secs(20);
    let mut groups = net.link_groups('a');
    while groups == 0 && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(50));
        groups = net.link_groups('a');
    }
    assert_eq!(
        groups, 1,
        "the server has no link group with the client connected"
    );
    drop(stdin);
    let out = wait_output(client, Duration::from_secs(30));
    assert_eq!(out.0, b"hello over a roce link group\n", "echo: {}", out.1);
    assert!(out.1.contains("over SMC-R"), "client: {}", out.1);

    // The client has exited: its DELETE LINK (entire group) makes the server drop its group.
    let end = Instant::now() + Duration::from_secs(10);
    let mut groups = net.link_groups('a');
    while groups > 0 && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(100));
        groups = net.link_groups('a');
    }
    let _ = server.kill();
    let _ = server.wait();
    assert_eq!(
        groups, 0,
        "the server still has a link group after the client exited"
    );
}

/// A listener ended by SIGTERM (as `kill`, systemd or a container runtime end it) goes
/// through the same exit handler: its clients' link groups go at once, not at a keepalive
/// that may never come (none is configured here), and the client's connection ends.
#[test]
fn terminated_listener_deletes_its_link_group_at_the_client() {
    if !root_with_ip() {
        return;
    }
    let net = Net::new(1);
    let server_addr = format!("10.{}.1.1", net.n);
    let mut server = net.smc(
        'a',
        &["nc", "-v", "-l", "7101", "--echo", "--bind", &server_addr],
        Stdio::null(),
    );
    let end = Instant::now() + Duration::from_secs(20);
    while !net.fabric_dir('a').exists() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));

    let mut client = net.smc('b', &["nc", "-v", &server_addr, "7101"], Stdio::piped());
    let mut stdin = client.stdin.take().expect("stdin");
    stdin.write_all(b"still here\n").expect("write");
    let end = Instant::now() + Duration::from_secs(20);
    let mut groups = net.link_groups('b');
    while groups == 0 && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(50));
        groups = net.link_groups('b');
    }
    assert_eq!(groups, 1, "the client has no link group while connected");

    // `ip netns exec` and `env` exec the command: the child's pid is the listener's.
    let pid = rustix::process::Pid::from_child(&server);
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).expect("SIGTERM");
    let status = server.wait().expect("wait server");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        None,
        "the listener died by the signal instead of exiting: {status}"
    );
    assert_eq!(status.code(), Some(128 + 15), "listener: {status}");

    let end = Instant::now() + Duration::from_secs(10);
    let mut groups = net.link_groups('b');
    while groups > 0 && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(100));
        groups = net.link_groups('b');
    }
    assert_eq!(
        groups, 0,
        "the client still has a link group after the listener was terminated"
    );
    // Its connection is over too: `smc nc` ends without being told anything more.
    let end = Instant::now() + Duration::from_secs(10);
    while client.try_wait().expect("wait").is_none() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(50));
    }
    let ended = client.try_wait().expect("wait");
    let _ = client.kill();
    let out = client.wait_with_output().expect("client output");
    drop(stdin);
    assert!(
        ended.is_some(),
        "the client's connection outlived the listener: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn wait_output(mut c: Child, limit: Duration) -> (Vec<u8>, String) {
    let end = Instant::now() + limit;
    loop {
        if c.try_wait().expect("wait").is_some() {
            break;
        }
        if Instant::now() > end {
            let _ = c.kill();
            panic!("smc nc did not finish in {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let o = c.wait_with_output().expect("output");
    assert!(
        o.status.success(),
        "smc nc: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    (o.stdout, String::from_utf8_lossy(&o.stderr).into_owned())
}
