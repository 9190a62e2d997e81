//! Two real processes on the shm fabric: the test binary re-executes itself as the peer
//! (`child_entry` with `SMC_FABRIC_CHILD=<role>`). Out-of-band exchange (the CLC/LLC stand-in)
//! runs over the child's stdin/stdout.
//!
//! Scenarios run sequentially in one test so that fd, mapping and thread counts are exact.
//! `SMC_FABRIC_STRESS_MESSAGES` sets the WRITE-then-SEND stress count (default 100 000).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::*;
use smc_fabric::*;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

const RMB_SLOT: usize = 4096;
const RMB_SLOTS: usize = 64;
const WINDOW: u64 = 32;
const CREDIT_EVERY: u64 = 8;

fn parse_gid(hex: &str) -> Gid {
    let mut g = [0u8; 16];
    for (i, b) in g.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
    }
    Gid(g)
}

fn info_line(s: &Side) -> String {
    let l = s.qp.local_info();
    format!(
        "@@info {} {} {} {} {}",
        l.gid.to_hex(),
        l.qp_num,
        l.psn,
        s.rmb.rkey(),
        s.rmb.addr()
    )
}

/// (remote QP, rkey, addr) from an `@@info` line.
fn parse_info(line: &str) -> (RemoteQpInfo, u32, u64) {
    let f: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(f[0], "@@info", "{line}");
    let r = RemoteQpInfo {
        gid: parse_gid(f[1]),
        qp_num: f[2].parse().unwrap(),
        psn: f[3].parse().unwrap(),
        mtu: Mtu::Mtu4096,
    };
    (r, f[4].parse().unwrap(), f[5].parse().unwrap())
}

struct Peer {
    child: Child,
    out: BufReader<ChildStdout>,
    inp: ChildStdin,
}

impl Peer {
    fn spawn(role: &str, dir: &std::path::Path, count: u64) -> Peer {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["child_entry", "--exact", "--nocapture", "--test-threads=1"])
            .env("SMC_FABRIC_CHILD", role)
            .env("SMC_FABRIC_DIR", dir)
            .env("SMC_FABRIC_COUNT", count.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        let inp = child.stdin.take().unwrap();
        Peer { child, out, inp }
    }

    /// Next `@@` marker (the rest is libtest chatter, which may share the marker's line).
    fn marker(&mut self) -> String {
        loop {
            let mut line = String::new();
            let n = self.out.read_line(&mut line).unwrap();
            assert!(n > 0, "child exited early");
            if let Some(at) = line.find("@@") {
                return line[at..].trim().to_owned();
            }
        }
    }

    fn send_line(&mut self, line: &str) {
        writeln!(self.inp, "{line}").unwrap();
        self.inp.flush().unwrap();
    }

    /// Exchange QP info with the child and bring both QPs to RTS.
    fn connect(&mut self, me: &Side) -> (u32, u64) {
        let (remote, rkey, addr) = parse_info(&self.marker());
        me.qp.to_rtr(remote).unwrap();
        self.send_line(&info_line(me));
        assert_eq!(self.marker(), "@@ready");
        me.qp.to_rts().unwrap();
        (rkey, addr)
    }

    fn wait_success(mut self) {
        let st = self.child.wait().unwrap();
        assert!(st.success(), "child failed: {st:?}");
    }
}

/// Child side: create a side, exchange info, then run the role.
fn child_main(role: &str) {
    let cfg = FabricConfig::from_env().unwrap();
    let me = Side::new(&cfg, "shm0", RMB_SLOT * RMB_SLOTS);
    me.post_all_rx();
    println!("{}", info_line(&me));
    let stdin = std::io::stdin();
    let mut line = String::new();
    stdin.lock().read_line(&mut line).unwrap();
    let (remote, _, _) = parse_info(line.trim());
    me.qp.to_rtr(remote).unwrap();
    me.qp.to_rts().unwrap();
    println!("@@ready");
    match role {
        "stress-recv" => {
            let count: u64 = std::env::var("SMC_FABRIC_COUNT").unwrap().parse().unwrap();
            let mut data = vec![0u8; RMB_SLOT];
            for i in 0..count {
                let wc = loop {
                    let wc = me.next_wc();
                    if wc.opcode == WcOpcode::Recv {
                        break wc;
                    }
                    assert_eq!(wc.status, WcStatus::Success);
                };
                assert_eq!(wc.status, WcStatus::Success);
                let m = me.rx_bytes(&wc);
                assert_eq!(m.len(), 44);
                let seq = u64::from_le_bytes(m[0..8].try_into().unwrap());
                let off = u64::from_le_bytes(m[8..16].try_into().unwrap()) as usize;
                let len = u64::from_le_bytes(m[16..24].try_into().unwrap()) as usize;
                let sum = u64::from_le_bytes(m[24..32].try_into().unwrap());
                assert_eq!(seq, i, "SENDs arrive in order");
                me.rmb.read_at(off, &mut data[..len]).unwrap();
                assert_eq!(
                    fnv(&data[..len]),
                    sum,
                    "WRITE visible before its SEND (message {i})"
                );
                me.post_rx(wc.wr_id as usize);
                if (i + 1) % CREDIT_EVERY == 0 {
                    me.qp
                        .post_send(&SendWr::Send {
                            wr_id: i,
                            data: &(i + 1).to_le_bytes(),
                            signaled: false,
                        })
                        .unwrap();
                }
            }
            println!("@@done {count}");
        }
        "idle" => {
            // Wait until our QP fails (peer error, port down) and report the flush.
            let wc = me.next_wc();
            assert_eq!(wc.status, WcStatus::WrFlushError);
            assert_eq!(me.qp.state(), QpState::Error);
            println!("@@flushed");
        }
        "stall" => {
            // Do not poll until told to: messages pile up in our receive ring.
            let mut go = String::new();
            std::io::stdin().lock().read_line(&mut go).unwrap();
            // Every posted receive completes once: with a message, or flushed by the QP's
            // error, which shows in `state()` before its completions are all queued: the
            // count says when they are, the state that the error came.
            let deadline = Instant::now() + Duration::from_secs(10);
            let (mut delivered, mut flushed) = (0u64, 0usize);
            let mut wcs = [WorkCompletion::EMPTY; 16];
            while delivered as usize + flushed < RX_SLOTS || me.qp.state() != QpState::Error {
                let n = me.cq.poll(&mut wcs);
                for wc in &wcs[..n] {
                    match (wc.opcode, wc.status) {
                        (WcOpcode::Recv, WcStatus::Success) => delivered += 1,
                        (WcOpcode::Recv, WcStatus::WrFlushError) => flushed += 1,
                        other => panic!("unexpected completion {other:?}"),
                    }
                }
                assert!(Instant::now() < deadline, "QP error within 10 s");
                if n == 0 {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            println!("@@delivered {delivered}");
        }
        "sleep" => loop {
            std::thread::sleep(Duration::from_secs(1));
        },
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn child_entry() {
    if let Ok(role) = std::env::var("SMC_FABRIC_CHILD") {
        child_main(&role);
    }
}

fn stress(dir: &std::path::Path) {
    let count: u64 = std::env::var("SMC_FABRIC_STRESS_MESSAGES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    let cfg = FabricConfig::with_dir(dir, 1);
    let me = Side::new(&cfg, "shm0", 4096);
    me.post_all_rx();
    let mut peer = Peer::spawn("stress-recv", dir, count);
    let (rkey, addr) = peer.connect(&me);
    // Our RMB, receive area, receive ring and the peer's ring are mapped (the leak check below
    // would notice any left behind).
    assert!(fabric_map_count() >= 4);
    let mut payload = vec![0u8; RMB_SLOT];
    let mut credits = 0u64;
    let mut wcs = [WorkCompletion::EMPTY; 32];
    let start = Instant::now();
    for i in 0..count {
        while i >= credits + WINDOW {
            let n = me.cq.wait(&mut wcs, Some(Duration::from_secs(10))).unwrap();
            assert!(n > 0, "no credit within 10 s");
            for wc in &wcs[..n] {
                assert_eq!(wc.status, WcStatus::Success);
                if wc.opcode == WcOpcode::Recv {
                    credits = u64::from_le_bytes(me.rx_bytes(wc)[..8].try_into().unwrap());
                    me.post_rx(wc.wr_id as usize);
                }
            }
        }
        let len = 1 + (i.wrapping_mul(2654435761) % RMB_SLOT as u64) as usize;
        let off = (i as usize % RMB_SLOTS) * RMB_SLOT;
        for (k, b) in payload[..len].iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(31).wrapping_add(k as u8);
        }
        me.qp
            .post_send(&SendWr::WriteInline {
                wr_id: i,
                data: &payload[..len],
                remote_addr: addr + off as u64,
                rkey,
                signaled: false,
            })
            .unwrap();
        let mut msg = [0u8; 44];
        msg[0..8].copy_from_slice(&i.to_le_bytes());
        msg[8..16].copy_from_slice(&(off as u64).to_le_bytes());
        msg[16..24].copy_from_slice(&(len as u64).to_le_bytes());
        msg[24..32].copy_from_slice(&fnv(&payload[..len]).to_le_bytes());
        me.qp
            .post_send(&SendWr::Send {
                wr_id: i,
                data: &msg,
                signaled: false,
            })
            .unwrap();
    }
    assert_eq!(peer.marker(), format!("@@done {count}"));
    eprintln!(
        "stress: {count} WRITE+SEND pairs verified in {:?}",
        start.elapsed()
    );
    peer.wait_success();
}

/// A violating WRITE fails locally with a remote access error and the peer QP is flushed.
fn violation(dir: &std::path::Path, bad: impl Fn(u32, u64) -> (u32, u64, usize)) {
    let cfg = FabricConfig::with_dir(dir, 1);
    let me = Side::new(&cfg, "shm0", 4096);
    let mut peer = Peer::spawn("idle", dir, 0);
    let (rkey, addr) = peer.connect(&me);
    // A legal write first, so the region is mapped and cached.
    me.qp
        .post_send(&SendWr::WriteInline {
            wr_id: 1,
            data: b"ok",
            remote_addr: addr,
            rkey,
            signaled: true,
        })
        .unwrap();
    assert_eq!(me.next_wc().status, WcStatus::Success);
    let (k, a, len) = bad(rkey, addr);
    let data = vec![0xaau8; len];
    me.qp
        .post_send(&SendWr::WriteInline {
            wr_id: 2,
            data: &data,
            remote_addr: a,
            rkey: k,
            signaled: true,
        })
        .unwrap();
    let wc = me.next_wc();
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::RemoteAccessError));
    assert_eq!(me.qp.state(), QpState::Error);
    assert_eq!(peer.marker(), "@@flushed");
    peer.wait_success();
}

fn sigkill(dir: &std::path::Path) {
    let cfg = FabricConfig::with_dir(dir, 1);
    let me = Side::new(&cfg, "shm0", 4096);
    me.post_all_rx();
    let mut peer = Peer::spawn("sleep", dir, 0);
    let (rkey, addr) = peer.connect(&me);
    me.qp
        .post_send(&SendWr::WriteInline {
            wr_id: 1,
            data: b"ok",
            remote_addr: addr,
            rkey,
            signaled: true,
        })
        .unwrap();
    assert_eq!(me.next_wc().status, WcStatus::Success);
    // The sleeping child never polls: the ring fills and later SENDs stay outstanding.
    for i in 0..100u64 {
        me.qp
            .post_send(&SendWr::Send {
                wr_id: 100 + i,
                data: b"x",
                signaled: true,
            })
            .unwrap();
    }
    let mut sent_ok = 0;
    let mut wcs = [WorkCompletion::EMPTY; 128];
    let n = me.cq.poll(&mut wcs);
    for wc in &wcs[..n] {
        assert_eq!(wc.status, WcStatus::Success);
        sent_ok += 1;
    }
    peer.child.kill().unwrap(); // SIGKILL
    let killed = Instant::now();
    let (mut flushed_send, mut flushed_recv) = (0, 0);
    while flushed_recv < RX_SLOTS || sent_ok + flushed_send < 100 {
        let wc = me.next_wc();
        match (wc.opcode, wc.status) {
            (WcOpcode::Recv, WcStatus::WrFlushError) => flushed_recv += 1,
            (WcOpcode::Send, WcStatus::WrFlushError) => flushed_send += 1,
            (WcOpcode::Send, WcStatus::Success) => sent_ok += 1,
            other => panic!("unexpected completion {other:?}"),
        }
    }
    assert!(
        killed.elapsed() < Duration::from_secs(2),
        "peer death detected within 2 s"
    );
    assert!(flushed_send > 0, "outstanding sends were flushed");
    assert_eq!(me.qp.state(), QpState::Error);
    let ev: Vec<_> = std::iter::from_fn(|| me.dev.poll_event()).collect();
    assert!(ev.contains(&DeviceEvent::QpFatal {
        qp_num: me.qp.qp_num()
    }));
    let _ = peer.child.wait();
}

fn port_down(dir: &std::path::Path) {
    let cfg = FabricConfig::with_dir(dir, 1);
    let me = Side::new(&cfg, "shm0", 4096);
    me.post_all_rx();
    let mut peer = Peer::spawn("stall", dir, 0);
    peer.connect(&me);
    // The stalled peer does not consume: its ring (64 slots) fills, the rest stays outstanding.
    for i in 0..100u64 {
        me.qp
            .post_send(&SendWr::Send {
                wr_id: i,
                data: &i.to_le_bytes(),
                signaled: true,
            })
            .unwrap();
    }
    me.dev.set_port_state(PortState::Down);
    assert_eq!(me.qp.state(), QpState::Error);
    let (mut sent, mut flushed_send, mut flushed_recv) = (0u64, 0, 0);
    while sent + flushed_send < 100 || flushed_recv < RX_SLOTS {
        let wc = me.next_wc();
        match (wc.opcode, wc.status) {
            (WcOpcode::Send, WcStatus::Success) => sent += 1,
            (WcOpcode::Send, WcStatus::WrFlushError) => flushed_send += 1,
            (WcOpcode::Recv, WcStatus::WrFlushError) => flushed_recv += 1,
            other => panic!("unexpected completion {other:?}"),
        }
    }
    assert!(
        flushed_send > 0,
        "outstanding sends completed with flush errors"
    );
    // The peer's QP fails too, after delivering exactly the messages that completed here.
    peer.send_line("go");
    assert_eq!(peer.marker(), format!("@@delivered {sent}"));
    peer.wait_success();
    me.dev.set_port_state(PortState::Active);
}

fn task_count() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| d.count())
        .unwrap_or(0)
}

#[test]
fn multiprocess() {
    if std::env::var_os("SMC_FABRIC_CHILD").is_some() {
        return;
    }
    let dir = test_dir("mp");
    // Warm-up so that lazily created process state does not count as a leak.
    violation(&dir, |rkey, addr| (rkey ^ 0x77, addr, 1));
    std::thread::sleep(Duration::from_millis(100));
    let (fds, maps, tasks) = (fd_count(), map_count(), task_count());
    assert_eq!(fabric_map_count(), 0);
    let maps_before = std::fs::read_to_string("/proc/self/maps").unwrap();

    stress(&dir);
    // rkey violation.
    violation(&dir, |rkey, addr| (rkey ^ 0x77, addr, 1));
    // Bounds violations: past the end, and an address before the region.
    violation(&dir, |rkey, addr| {
        (rkey, addr + (RMB_SLOT * RMB_SLOTS) as u64 - 3, 7)
    });
    violation(&dir, |rkey, addr| (rkey, addr - 1, 1));
    sigkill(&dir);
    port_down(&dir);

    // Control threads exit asynchronously after their last handle is dropped.
    let deadline = Instant::now() + Duration::from_secs(2);
    while task_count() != tasks && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(fd_count(), fds, "fd leak");
    let maps_after = std::fs::read_to_string("/proc/self/maps").unwrap();
    assert_eq!(fabric_map_count(), 0, "fabric mapping leak");
    assert_eq!(
        map_count(),
        maps,
        "mapping leak:\nBEFORE\n{maps_before}\nAFTER\n{maps_after}"
    );
    assert_eq!(task_count(), tasks, "thread leak");
    let leftover: Vec<_> = std::fs::read_dir(dir.join("shm0"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(leftover.is_empty(), "socket files left: {leftover:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
