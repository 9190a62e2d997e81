//! SMC-Rv1 and SMC-Rv2 between two smc-rs processes on the software RoCEv2 device (issue #23
//! item 5; the shm fabric's twin is `crates/smc/tests/v2_processes.rs`): two network namespaces
//! joined by one veth pair, an `smc nc -l --echo` server in one and an `smc nc` client in the
//! other, each configured only by `SMC_VERSIONS` / `SMC_UEIDS` as a deployment would be. For
//! each setting the version both stacks' link groups speak (`smc linkgroup --json`, field
//! `version`) is the one Linux's rules give (docs/v2.md), and 1 MiB is echoed byte for byte.
//! Root only; skipped with a message otherwise.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod netns;
use netns::{root_with_ip, NsPair};

/// `SMC_VERSIONS` (None: unset, the default `1,2`) and `SMC_UEIDS` of one side.
#[derive(Clone, Copy)]
struct Side {
    versions: Option<&'static str>,
    ueids: &'static str,
}

struct Net(NsPair);

impl std::ops::Deref for Net {
    type Target = NsPair;
    fn deref(&self) -> &NsPair {
        &self.0
    }
}

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
        let mut c = Command::new("ip");
        c.args(["netns", "exec", self.ns(side), "env", "-u", "SMC_VERSIONS"])
            .arg(format!("SMC_FABRIC_DEVICES=roce:r0={}", self.veth(side, 0)))
            .arg(format!(
                "SMC_FABRIC_DIR={}",
                self.fabric_dir(side, case).display()
            ))
            .arg("SMC_DISCOVERY=assert-peer")
            .arg(format!("SMC_IPV4_SUBNETS=10.{}.1.0/24", self.n))
            .arg(format!("SMC_UEIDS={}", cfg.ueids));
        if let Some(v) = cfg.versions {
            c.arg(format!("SMC_VERSIONS={v}"));
        }
        c.arg(env!("CARGO_BIN_EXE_smc"))
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
        let o = Command::new(env!("CARGO_BIN_EXE_smc"))
            .args(["linkgroup", "--json", "--dir"])
            .arg(self.fabric_dir(side, case))
            .output()
            .expect("smc linkgroup");
        assert!(o.status.success(), "smc linkgroup: {o:?}");
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
            panic!(
                "linkgroup JSON: {e}: {}",
                String::from_utf8_lossy(&o.stdout)
            )
        });
        let mut out = Vec::new();
        collect_versions(&v, &mut out);
        out
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

/// The `version` of every link group (an object with `links`) in `smc linkgroup --json`.
fn collect_versions(v: &serde_json::Value, out: &mut Vec<u64>) {
    match v {
        serde_json::Value::Array(a) => a.iter().for_each(|x| collect_versions(x, out)),
        serde_json::Value::Object(o) if o.contains_key("links") => {
            out.push(o.get("version").and_then(|v| v.as_u64()).unwrap_or(0));
        }
        serde_json::Value::Object(o) => o.values().for_each(|x| collect_versions(x, out)),
        _ => {}
    }
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
