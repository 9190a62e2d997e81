//! SMC-Rv1 and SMC-Rv2 between two smc-rs processes on the software RoCEv2 device (issue #23
//! item 5; the shm fabric's twin is `crates/smc/tests/v2_processes.rs`): two network namespaces
//! joined by one veth pair, an `smc nc -l --echo` server in one and an `smc nc` client in the
//! other, each configured only by `SMC_VERSIONS` / `SMC_UEIDS` as a deployment would be. For
//! each setting the version both stacks' link groups speak (`smc linkgroup --json`, field
//! `version`) is the one Linux's rules give (docs/v2.md), and 1 MiB is echoed byte for byte.
//! And with two roce devices on each side (two veth pairs), `SMC_VERSIONS=2`: a two-link v2
//! group that fails over when a veth goes down, no byte lost.
//! Root only; skipped with a message otherwise.

use std::fs::File;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod netns;
use netns::{active_links, link_groups, query, root_with_ip, run, sum_key, wait, NsPair};

/// `SMC_VERSIONS` (None: unset, the default `1,2`) and `SMC_UEIDS` of one side.
#[derive(Clone, Copy)]
struct Side {
    versions: Option<&'static str>,
    ueids: &'static str,
}

netns::net_type!();

impl Net {
    fn new() -> Net {
        Net(NsPair::new(
            'v',
            "",
            110 + (std::process::id() % 7) as u8,
            1,
        ))
    }

    /// The fabric directory (control sockets) of `side` in case `case`.
    fn fabric_dir(&self, side: char, case: usize) -> PathBuf {
        self.dir.join(format!("{side}{case}"))
    }

    /// `smc nc ARGS` in namespace `side` with a roce device on its veth and `cfg`.
    fn nc(&self, side: char, case: usize, cfg: Side, args: &[&str]) -> Child {
        let mut env = vec![format!("SMC_UEIDS={}", cfg.ueids)];
        env.extend(cfg.versions.map(|v| format!("SMC_VERSIONS={v}")));
        self.smc_cmd(
            side,
            &self.roce_devices(side, 1),
            &self.fabric_dir(side, case),
            &env,
        )
        .arg("nc")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn smc nc")
    }

    /// The `version` of every link group of the stacks in `side`'s fabric directory.
    fn versions(&self, side: char, case: usize) -> Vec<u64> {
        versions(&query(&self.fabric_dir(side, case), "linkgroup"))
    }

    /// Whether something listens on TCP `port` in namespace `side`.
    fn listening(&self, side: char, port: &str) -> bool {
        Command::new("ip")
            .args(["netns", "exec", self.ns(side), "ss", "-Hltn"])
            .arg(format!("sport = :{port}"))
            .output()
            .is_ok_and(|o| !o.stdout.trim_ascii().is_empty())
    }
}

/// The `version` of every link group in `smc linkgroup --json` output.
fn versions(v: &serde_json::Value) -> Vec<u64> {
    link_groups(v)
        .iter()
        .map(|g| g.get("version").and_then(|v| v.as_u64()).unwrap_or(0))
        .collect()
}

/// Poll `f` until it returns Some, at most `limit`.
fn poll<T>(limit: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let end = Instant::now() + limit;
    loop {
        if let Some(t) = f() {
            return Some(t);
        }
        if Instant::now() > end {
            return None;
        }
        std::thread::sleep(Duration::from_millis(30));
    }
}

/// One echo connection from a client configured `client` to a server configured `server`:
/// returns the link group versions the client's and the server's stacks report while the
/// connection is open, after checking the echo byte for byte and both `smc nc -v` lines.
fn case(net: &Net, case: usize, client: Side, server: Side) -> (Vec<u64>, Vec<u64>) {
    let port = (7300 + case).to_string();
    let addr = net.addr('a', 0);
    let mut srv = net.nc(
        'a',
        case,
        server,
        &["-v", "-l", &port, "--echo", "--bind", &addr],
    );
    let up = poll(Duration::from_secs(20), || {
        net.listening('a', &port).then_some(())
    });
    if up.is_none() {
        let _ = srv.kill();
        panic!("case {case}: the server did not listen in 20 s");
    }

    let data: Vec<u8> = (0..1u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let mut cli = net.nc('b', case, client, &["-v", &addr, &port]);
    let mut stdin = cli.stdin.take().expect("stdin");
    let mut stdout = cli.stdout.take().expect("stdout");
    let reader = std::thread::spawn(move || {
        let mut back = Vec::new();
        let _ = stdout.read_to_end(&mut back);
        back
    });
    let sent = data.clone();
    let writer = std::thread::spawn(move || {
        stdin.write_all(&sent).expect("write to smc nc");
        // Kept open until the versions are read: the connection (and its group) stays up.
        stdin
    });
    // Both stacks have their link group while the connection is open.
    let group = |side| {
        poll(Duration::from_secs(20), || {
            let v = net.versions(side, case);
            (!v.is_empty()).then_some(v)
        })
    };
    let (cv, sv) = (group('b'), group('a'));
    let stdin = writer.join().expect("writer");
    drop(stdin);

    let end = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(st) = cli.try_wait().expect("wait") {
            break st;
        }
        if Instant::now() > end {
            let _ = cli.kill();
            let _ = srv.kill();
            panic!("case {case}: the client did not finish in 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let back = reader.join().expect("reader");
    let mut cerr = String::new();
    if let Some(mut e) = cli.stderr.take() {
        let _ = e.read_to_string(&mut cerr);
    }
    let _ = srv.kill();
    let _ = srv.wait();
    let mut serr = String::new();
    if let Some(mut e) = srv.stderr.take() {
        let _ = e.read_to_string(&mut serr);
    }
    assert!(status.success(), "case {case}: client: {status}: {cerr}");
    assert!(cerr.contains("over SMC-R"), "case {case}: client: {cerr}");
    assert!(serr.contains("over SMC-R"), "case {case}: server: {serr}");
    assert!(
        back.len() == data.len() && back == data,
        "case {case}: the echo differs ({} bytes of {})",
        back.len(),
        data.len()
    );
    (
        cv.expect("the client's link group"),
        sv.expect("the server's link group"),
    )
}

#[test]
fn roce_v1_and_v2_between_processes() {
    if !root_with_ip() {
        return;
    }
    let net = Net::new();
    let only = |v, u| Side {
        versions: Some(v),
        ueids: u,
    };
    let default = |u| Side {
        versions: None,
        ueids: u,
    };
    // SMC_VERSIONS=1 on both: SMC-Rv1.
    assert_eq!(
        case(&net, 1, only("1", ""), only("1", "")),
        (vec![1], vec![1])
    );
    // SMC_VERSIONS=2 on both with a shared UEID (not the server's first): SMC-Rv2.
    assert_eq!(
        case(
            &net,
            2,
            only("2", "SMC-RS.TEST"),
            only("2", "OTHER,SMC-RS.TEST")
        ),
        (vec![2], vec![2])
    );
    // The default (1,2) on both: SMC-Rv2 with a shared UEID ...
    assert_eq!(
        case(&net, 3, default("SMC-RS.TEST"), default("SMC-RS.TEST")),
        (vec![2], vec![2])
    );
    // ... and SMC-Rv1 without one (the server has no UEID, the client's differs).
    assert_eq!(
        case(&net, 4, default("SMC-RS.TEST"), default("")),
        (vec![1], vec![1])
    );
    assert_eq!(
        case(&net, 5, default("SMC-RS.TEST"), default("ANOTHER")),
        (vec![1], vec![1])
    );
}

/// Two namespaces joined by two veth pairs, a roce device on each veth (as `roce_netns.rs`),
/// both stacks `SMC_VERSIONS=2` with a shared UEID: b sends 16 MiB to a; once half of it
/// arrived, both stacks report one
/// v2 link group with two active links; veth pair 0 goes down on a's side, and the test waits
/// until both stacks saw their link on it go down and a connection failed over (`smc stats`)
/// before b sends 48 MiB more over the surviving link. The SHA-256 of what arrived is that of
/// what was sent.
#[test]
fn roce_v2_two_link_group_fails_over_when_a_veth_goes_down() {
    if !root_with_ip() {
        return;
    }
    let net = NsPair::new('w', "", 130 + (std::process::id() % 7) as u8, 2);
    let nc = |side: char, args: &[&str], stdin: Stdio, stdout: Stdio| -> Child {
        let env = [
            "SMC_VERSIONS=2".to_string(),
            "SMC_UEIDS=SMC-RS.TEST".to_string(),
            "SMC_KEEPALIVE_MS=1000".to_string(),
        ];
        let dir = net.dir.join(side.to_string());
        net.smc_cmd(side, &net.roce_devices(side, 2), &dir, &env)
            .arg("nc")
            .args(args)
            .stdin(stdin)
            .stdout(stdout)
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn smc nc")
    };
    let query = |side: char, what: &str| query(&net.dir.join(side.to_string()), what);
    let counter = sum_key;
    let active = |v: &serde_json::Value| -> Vec<usize> {
        link_groups(v).into_iter().map(active_links).collect()
    };
    let data: Vec<u8> = (0..64u64 << 20)
        .map(|i| (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 29) as u8)
        .collect();
    let out = net.dir.join("out");
    let addr = net.addr('a', 0);
    let server = nc(
        'a',
        &["-v", "-l", "7400", "--bind", &addr],
        Stdio::null(),
        Stdio::from(File::create(&out).expect("out")),
    );
    std::thread::sleep(Duration::from_millis(300));
    let mut client = nc('b', &["-v", &addr, "7400"], Stdio::piped(), Stdio::null());
    let mut stdin = client.stdin.take().expect("stdin");
    let first = 16usize << 20;
    stdin.write_all(&data[..first]).expect("write");
    // (`smc nc` may hold the tail of what it received until more comes.)
    let arrived = poll(Duration::from_secs(60), || {
        (std::fs::metadata(&out).map(|m| m.len()).unwrap_or(0) >= first as u64 / 2).then_some(())
    });
    assert!(arrived.is_some(), "8 MiB did not arrive in 60 s");
    // Both stacks: one v2 group, two active links.
    for side in ['a', 'b'] {
        let v = query(side, "linkgroup");
        assert_eq!(
            (versions(&v), active(&v)),
            (vec![2], vec![2]),
            "{side}: {v}"
        );
    }
    let before: Vec<(u64, u64)> = ['a', 'b']
        .iter()
        .map(|s| {
            let v = query(*s, "stats");
            (counter(&v, "links_down"), counter(&v, "failovers"))
        })
        .collect();
    let va = net.veth('a', 0);
    run(&["ip", "-n", &net.a, "link", "set", &va, "down"]);
    // Both stacks lose the link on veth pair 0 (a by its netdev going down, b by its QP
    // failing or a's DELETE LINK), keep the group on the other link, and the connection
    // moved off the lost link on at least one side.
    let failed_over = poll(Duration::from_secs(30), || {
        let now: Vec<(u64, u64)> = ['a', 'b']
            .iter()
            .map(|s| {
                let v = query(*s, "stats");
                (counter(&v, "links_down"), counter(&v, "failovers"))
            })
            .collect();
        let down = now.iter().zip(&before).all(|(n, b)| n.0 > b.0);
        let moved = now.iter().zip(&before).any(|(n, b)| n.1 > b.1);
        (down && moved).then_some(now)
    });
    assert!(
        failed_over.is_some(),
        "no failover: {} / {}",
        query('a', "stats"),
        query('b', "stats")
    );
    for side in ['a', 'b'] {
        let v = query(side, "linkgroup");
        assert_eq!(active(&v), vec![1], "{side}: {v}");
    }
    stdin.write_all(&data[first..]).expect("write");
    drop(stdin);
    let ce = wait(client, Duration::from_secs(120), "client");
    let se = wait(server, Duration::from_secs(120), "server");
    assert!(se.contains("over SMC-R"), "server: {se}");
    assert!(ce.contains("over SMC-R"), "client: {ce}");
    let got = std::fs::read(&out).expect("read output");
    assert!(
        got.len() == data.len() && got == data,
        "what arrived differs ({} of {} bytes)",
        got.len(),
        data.len()
    );
}
