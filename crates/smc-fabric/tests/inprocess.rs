//! Fabric semantics between two ports opened in one process.
#![allow(clippy::unwrap_used)]

mod common;
use common::*;
use smc_fabric::*;

fn cfg(tag: &str) -> FabricConfig {
    FabricConfig::with_dir(test_dir(tag), 2)
}

#[test]
fn device_identity_and_state_machine() {
    let cfg = cfg("ident");
    let a = Side::new(&cfg, "shm0", 4096);
    let b = Side::new(&cfg, "shm0", 4096);
    assert_ne!(a.dev.gid(), b.dev.gid(), "each opening is its own port");
    let ports = list_ports(&cfg, "shm0").unwrap();
    assert!(ports.contains(&a.dev.gid()) && ports.contains(&b.dev.gid()));
    assert_eq!(
        list_devices(&cfg),
        vec!["shm0".to_owned(), "shm1".to_owned()]
    );
    assert_eq!(a.dev.name(), "shm0");
    assert_eq!(a.dev.port_state(), PortState::Active);
    assert!(matches!(
        Device::open(&cfg, "shm9"),
        Err(FabricError::NoSuchDevice(_))
    ));
    assert_eq!(a.qp.state(), QpState::Init);
    assert!(matches!(
        a.qp.to_rts(),
        Err(FabricError::InvalidTransition { .. })
    ));
    assert!(matches!(
        a.qp.post_send(&SendWr::Send {
            wr_id: 1,
            data: b"x",
            signaled: true
        }),
        Err(FabricError::InvalidState(QpState::Init))
    ));
    connect(&a, &b);
    assert_eq!(a.qp.state(), QpState::Rts);
    assert_eq!(a.qp.remote_info().map(|r| r.qp_num), Some(b.qp.qp_num()));
    assert!(matches!(
        a.qp.post_send(&SendWr::Send {
            wr_id: 1,
            data: &[0u8; MAX_SEND + 1],
            signaled: true
        }),
        Err(FabricError::MessageTooLarge { max: MAX_SEND, .. })
    ));
}

#[test]
fn write_then_send_ordering_and_completions() {
    let cfg = cfg("order");
    let a = Side::new(&cfg, "shm0", 1 << 16);
    let b = Side::new(&cfg, "shm0", 1 << 16);
    b.post_all_rx();
    connect(&a, &b);
    for i in 0..2000u64 {
        let slot = (i as usize % RX_SLOTS) as u64;
        let payload: Vec<u8> = (0..1000).map(|k| (i as u8).wrapping_add(k as u8)).collect();
        let off = (i as usize * 1000) % ((1 << 16) - 1000);
        a.qp.post_send(&SendWr::WriteInline {
            wr_id: 0,
            data: &payload,
            remote_addr: b.rmb.addr() + off as u64,
            rkey: b.rmb.rkey(),
            signaled: false,
        })
        .unwrap();
        let mut msg = [0u8; 44];
        msg[..8].copy_from_slice(&i.to_le_bytes());
        msg[8..16].copy_from_slice(&fnv(&payload).to_le_bytes());
        msg[16..24].copy_from_slice(&(off as u64).to_le_bytes());
        a.qp.post_send(&SendWr::Send {
            wr_id: i,
            data: &msg,
            signaled: true,
        })
        .unwrap();
        let wc = a.next_wc();
        assert_eq!(
            (wc.wr_id, wc.status, wc.opcode),
            (i, WcStatus::Success, WcOpcode::Send)
        );
        let wc = b.next_wc();
        assert_eq!(
            (wc.status, wc.opcode, wc.byte_len),
            (WcStatus::Success, WcOpcode::Recv, 44)
        );
        assert_eq!(wc.wr_id, slot);
        let m = b.rx_bytes(&wc);
        assert_eq!(u64::from_le_bytes(m[..8].try_into().unwrap()), i);
        let mut data = vec![0u8; 1000];
        b.rmb.read_at(off, &mut data).unwrap();
        assert_eq!(fnv(&data), u64::from_le_bytes(m[8..16].try_into().unwrap()));
        b.post_rx(wc.wr_id as usize);
    }
}

#[test]
fn sge_write_and_signaled_write_completion() {
    let cfg = cfg("sge");
    let a = Side::new(&cfg, "shm0", 4096);
    let b = Side::new(&cfg, "shm0", 4096);
    connect(&a, &b);
    a.rmb.write_at(100, b"hello fabric").unwrap();
    let local = a.rmb.sge(100, 12).unwrap();
    a.qp.post_send(&SendWr::Write {
        wr_id: 7,
        local,
        remote_addr: b.rmb.addr() + 4000,
        rkey: b.rmb.rkey(),
        signaled: true,
    })
    .unwrap();
    let wc = a.next_wc();
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode, wc.byte_len),
        (7, WcStatus::Success, WcOpcode::RdmaWrite, 12)
    );
    let mut got = [0u8; 12];
    b.rmb.read_at(4000, &mut got).unwrap();
    assert_eq!(&got, b"hello fabric");
    // Invalid local key is a synchronous error.
    let bad = Sge {
        addr: local.addr,
        length: 4,
        lkey: 0xdead,
    };
    assert!(matches!(
        a.qp.post_send(&SendWr::Write {
            wr_id: 8,
            local: bad,
            remote_addr: b.rmb.addr(),
            rkey: b.rmb.rkey(),
            signaled: true
        }),
        Err(FabricError::InvalidLkey(0xdead))
    ));
}

fn expect_remote_access_error(a: &Side, wr: SendWr<'_>) {
    a.qp.post_send(&wr).unwrap();
    let wc = a.next_wc();
    assert_eq!(wc.status, WcStatus::RemoteAccessError);
    assert_eq!(a.qp.state(), QpState::Error);
}

#[test]
fn rkey_violation_is_remote_access_error() {
    let cfg = cfg("rkey");
    let a = Side::new(&cfg, "shm0", 4096);
    let b = Side::new(&cfg, "shm0", 4096);
    b.post_all_rx();
    connect(&a, &b);
    expect_remote_access_error(
        &a,
        SendWr::WriteInline {
            wr_id: 1,
            data: b"x",
            remote_addr: b.rmb.addr(),
            rkey: b.rmb.rkey() ^ 0x5a5a,
            signaled: true,
        },
    );
    // Later work flushes, and the peer's QP fails too (connection closed).
    a.qp.post_send(&SendWr::Send {
        wr_id: 2,
        data: b"y",
        signaled: true,
    })
    .unwrap();
    assert_eq!(a.next_wc().status, WcStatus::WrFlushError);
    let wc = b.next_wc();
    assert_eq!(wc.status, WcStatus::WrFlushError);
    assert_eq!(b.qp.state(), QpState::Error);
}

#[test]
fn bounds_violations_are_remote_access_errors() {
    let cfg = cfg("bounds");
    for (delta, len) in [(4090u64, 7usize), (u64::MAX - 2, 1)] {
        let a = Side::new(&cfg, "shm0", 4096);
        let b = Side::new(&cfg, "shm0", 4096);
        connect(&a, &b);
        let data = vec![1u8; len];
        expect_remote_access_error(
            &a,
            SendWr::WriteInline {
                wr_id: 1,
                data: &data,
                remote_addr: b.rmb.addr().wrapping_add(delta),
                rkey: b.rmb.rkey(),
                signaled: true,
            },
        );
    }
    // Below the region start.
    let a = Side::new(&cfg, "shm0", 4096);
    let b = Side::new(&cfg, "shm0", 4096);
    connect(&a, &b);
    expect_remote_access_error(
        &a,
        SendWr::WriteInline {
            wr_id: 1,
            data: b"z",
            remote_addr: b.rmb.addr() - 1,
            rkey: b.rmb.rkey(),
            signaled: true,
        },
    );
}

#[test]
fn access_and_protection_domain_are_enforced() {
    let cfg = cfg("pd");
    let a = Side::new(&cfg, "shm0", 4096);
    let b = Side::new(&cfg, "shm0", 4096);
    connect(&a, &b);
    // b's receive area has no remote-write access.
    expect_remote_access_error(
        &a,
        SendWr::WriteInline {
            wr_id: 1,
            data: b"z",
            remote_addr: b.rx.addr(),
            rkey: b.rx.rkey(),
            signaled: true,
        },
    );
    // A region of another PD on the same device is not reachable either.
    let a = Side::new(&cfg, "shm0", 4096);
    let b = Side::new(&cfg, "shm0", 4096);
    connect(&a, &b);
    let other_pd = b.dev.alloc_pd().unwrap();
    let foreign = other_pd
        .register(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
        .unwrap();
    expect_remote_access_error(
        &a,
        SendWr::WriteInline {
            wr_id: 1,
            data: b"z",
            remote_addr: foreign.addr(),
            rkey: foreign.rkey(),
            signaled: true,
        },
    );
}

#[test]
fn deregistered_region_is_no_longer_writable() {
    let cfg = cfg("dereg");
    let a = Side::new(&cfg, "shm0", 4096);
    let b = Side::new(&cfg, "shm0", 4096);
    connect(&a, &b);
    let extra =
        b.pd.register(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
    let (addr, rkey) = (extra.addr(), extra.rkey());
    a.qp.post_send(&SendWr::WriteInline {
        wr_id: 1,
        data: b"ok",
        remote_addr: addr,
        rkey,
        signaled: true,
    })
    .unwrap();
    assert_eq!(a.next_wc().status, WcStatus::Success);
    drop(extra);
    expect_remote_access_error(
        &a,
        SendWr::WriteInline {
            wr_id: 2,
            data: b"no",
            remote_addr: addr,
            rkey,
            signaled: true,
        },
    );
}

/// `map_remote` maps a peer region ahead of the WRITEs (so that they need no descriptor);
/// a region the peer frees that was never granted over this QP (a local receive buffer,
/// another link group's RMB) leaves the mapping in place, and one that was granted revokes it.
#[test]
fn map_remote_mapping_survives_unrelated_deregistrations() {
    let cfg = cfg("mapremote");
    let a = Side::new(&cfg, "shm0", 4096);
    let b = Side::new(&cfg, "shm0", 4096);
    connect(&a, &b);
    let rmb =
        b.pd.register(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
    let placer = a.qp.placer().expect("shm places WRITEs");
    assert!(
        !placer.place(b"x", rmb.addr(), rmb.rkey()),
        "not mapped yet"
    );
    a.qp.map_remote(rmb.rkey()).expect("map");
    assert!(placer.place(b"mapped", rmb.addr(), rmb.rkey()));
    let mut got = [0u8; 6];
    rmb.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"mapped");
    // Never granted: a local buffer, and a remote-writable region nobody asked for.
    let local = b.pd.register(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let other =
        b.pd.register(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
    drop(local);
    drop(other);
    assert!(
        placer.place(b"still", rmb.addr(), rmb.rkey()),
        "an unrelated deregistration revoked the mapping"
    );
    // A region that was granted over this QP revokes the QP's mappings when it goes.
    let granted =
        b.pd.register(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
    a.qp.map_remote(granted.rkey()).expect("map");
    drop(granted);
    assert!(!placer.place(b"gone", rmb.addr(), rmb.rkey()));
    // An unknown rkey is an error, not a panic.
    assert!(a.qp.map_remote(0xdead_beef).is_err());
}

#[test]
fn port_down_flushes_outstanding_work() {
    let cfg = cfg("portdown");
    let a = Side::new(&cfg, "shm0", 4096);
    let b = Side::new(&cfg, "shm0", 4096);
    a.post_all_rx();
    b.post_all_rx();
    connect(&a, &b);
    a.dev.set_port_state(PortState::Down);
    assert_eq!(a.dev.port_state(), PortState::Down);
    assert_eq!(a.qp.state(), QpState::Error);
    let mut flushed = 0;
    while flushed < RX_SLOTS {
        let wc = a.next_wc();
        assert_eq!(
            (wc.status, wc.opcode),
            (WcStatus::WrFlushError, WcOpcode::Recv)
        );
        flushed += 1;
    }
    // The peer notices through the closed connection.
    let wc = b.next_wc();
    assert_eq!(wc.status, WcStatus::WrFlushError);
    assert_eq!(b.qp.state(), QpState::Error);
    let mut events = Vec::new();
    while let Some(e) = a.dev.poll_event() {
        events.push(e);
    }
    assert!(events.contains(&DeviceEvent::PortDown));
    assert!(events.contains(&DeviceEvent::QpFatal {
        qp_num: a.qp.qp_num()
    }));
    // New connections fail while down; work after port up succeeds on new QPs.
    let c = a.pd.create_qp(&a.cq, &a.cq, QpCaps::default()).unwrap();
    c.to_init().unwrap();
    assert!(matches!(c.to_rtr(b.remote()), Err(FabricError::PortDown)));
    a.dev.set_port_state(PortState::Active);
    assert_eq!(a.dev.poll_event(), Some(DeviceEvent::PortActive));
    let c2 = a.pd.create_qp(&a.cq, &a.cq, QpCaps::default()).unwrap();
    c2.to_init().unwrap();
    let b3 = Side::new(&cfg, "shm0", 4096);
    c2.to_rtr(b3.remote()).unwrap();
    let a2 = Side::new(&cfg, "shm1", 4096);
    let b2 = Side::new(&cfg, "shm1", 4096);
    b2.post_all_rx();
    connect(&a2, &b2);
    a2.qp
        .post_send(&SendWr::Send {
            wr_id: 9,
            data: b"after",
            signaled: true,
        })
        .unwrap();
    assert_eq!(a2.next_wc().status, WcStatus::Success);
    assert_eq!(b2.rx_bytes(&b2.next_wc()), b"after");
}

#[test]
fn forced_error_and_failed_completions() {
    let cfg = cfg("faults");
    let a = Side::new(&cfg, "shm0", 4096);
    let b = Side::new(&cfg, "shm0", 4096);
    b.post_all_rx();
    connect(&a, &b);
    a.dev.fail_next_work_requests(1);
    a.qp.post_send(&SendWr::Send {
        wr_id: 1,
        data: b"lost",
        signaled: true,
    })
    .unwrap();
    assert_eq!(a.next_wc().status, WcStatus::RetryExceeded);
    assert_eq!(a.qp.state(), QpState::Error);
    assert_eq!(b.next_wc().status, WcStatus::WrFlushError);

    let c = Side::new(&cfg, "shm0", 4096);
    let d = Side::new(&cfg, "shm0", 4096);
    c.post_all_rx();
    d.post_all_rx();
    connect(&c, &d);
    d.qp.force_error();
    assert_eq!(d.next_wc().status, WcStatus::WrFlushError);
    let wc = c.next_wc();
    assert_eq!(c.qp.state(), QpState::Error);
    assert_eq!(wc.status, WcStatus::WrFlushError);
}

#[test]
fn faults_from_config() {
    let mut cfg = cfg("cfgfault");
    cfg.faults = config::parse_faults("shm1:down,shm0:fail=1").unwrap();
    let d1 = Device::open(&cfg, "shm1").unwrap();
    assert_eq!(d1.port_state(), PortState::Down);
    let a = Side::new(&cfg, "shm0", 4096);
    let b = Side::new(&cfg, "shm0", 4096);
    b.post_all_rx();
    connect(&a, &b);
    a.qp.post_send(&SendWr::Send {
        wr_id: 1,
        data: b"x",
        signaled: true,
    })
    .unwrap();
    assert_eq!(a.next_wc().status, WcStatus::RetryExceeded);
}

#[test]
fn ring_full_sends_wait_and_deliver_in_order() {
    let cfg = cfg("rnr");
    let a = Side::new(&cfg, "shm0", 4096);
    let b = Side::new(&cfg, "shm0", 4096);
    connect(&a, &b);
    // No receives posted: the ring (256 slots) fills, the rest waits in the send queue.
    for i in 0..400u64 {
        a.qp.post_send(&SendWr::Send {
            wr_id: i,
            data: &i.to_le_bytes(),
            signaled: true,
        })
        .unwrap();
    }
    let mut next_send = 0u64;
    let mut next_recv = 0u64;
    while next_recv < 400 {
        for slot in 0..RX_SLOTS {
            b.post_rx(slot);
        }
        for _ in 0..RX_SLOTS {
            if next_recv == 400 {
                break;
            }
            let wc = b.next_wc();
            assert_eq!(wc.status, WcStatus::Success);
            assert_eq!(
                u64::from_le_bytes(b.rx_bytes(&wc)[..8].try_into().unwrap()),
                next_recv
            );
            next_recv += 1;
            let mut wcs = [WorkCompletion::EMPTY; 8];
            let n = a.cq.poll(&mut wcs);
            for w in &wcs[..n] {
                assert_eq!((w.wr_id, w.status), (next_send, WcStatus::Success));
                next_send += 1;
            }
        }
    }
    while next_send < 400 {
        let w = a.next_wc();
        assert_eq!((w.wr_id, w.status), (next_send, WcStatus::Success));
        next_send += 1;
    }
}

/// SENDs of up to 8192 bytes (an SMC-Rv2 LLC message) are split over ring slots and arrive
/// whole, in order with short ones, through a ring that wraps many times and fills (the sender
/// waits for the slots a long message needs).
#[test]
fn long_sends_arrive_whole_and_in_order() {
    let cfg = cfg("long");
    let a = Side::new(&cfg, "shm0", 4096);
    let b = Side::new(&cfg, "shm0", 4096);
    connect(&a, &b);
    const BUFS: usize = 8;
    let rx =
        b.pd.register(BUFS * MAX_SEND, AccessFlags::LOCAL_WRITE)
            .unwrap();
    let post = |i: usize| {
        let sge = rx.sge(i * MAX_SEND, MAX_SEND as u32).unwrap();
        b.qp.post_recv(&RecvWr {
            wr_id: i as u64,
            sge,
        })
        .unwrap();
    };
    let msg = |n: usize| -> Vec<u8> {
        let len = [57, 88, MAX_SEND, 44, 1000, 72 + 16 * 255, 56, MAX_SEND - 1][n % 8];
        (0..len).map(|k| (n * 31 + k * 7 + k / 251) as u8).collect()
    };
    const N: usize = 60;
    for n in 0..N {
        a.qp.post_send(&SendWr::Send {
            wr_id: n as u64,
            data: &msg(n),
            signaled: true,
        })
        .unwrap();
    }
    for i in 0..BUFS {
        post(i);
    }
    // The sender's queue moves on as it polls its CQ (the ring fills at every 8192-byte SEND).
    let (mut received, mut completed) = (0, 0);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut wcs = [WorkCompletion::EMPTY; 8];
    while received < N || completed < N {
        assert!(
            std::time::Instant::now() < deadline,
            "{received} received, {completed} sent"
        );
        let n = a.cq.poll(&mut wcs);
        for w in &wcs[..n] {
            assert_eq!((w.wr_id, w.status), (completed as u64, WcStatus::Success));
            completed += 1;
        }
        let n = b.cq.poll(&mut wcs);
        for w in &wcs[..n] {
            let n = received;
            assert_eq!(w.status, WcStatus::Success, "message {n}");
            assert_eq!(w.wr_id as usize, n % BUFS);
            let mut got = vec![0u8; w.byte_len as usize];
            rx.read_at(n % BUFS * MAX_SEND, &mut got).unwrap();
            assert!(got == msg(n), "message {n} ({} bytes) differs", got.len());
            post(n % BUFS);
            received += 1;
        }
    }
}

#[test]
fn blocking_ping_pong_between_threads() {
    let cfg = cfg("pingpong");
    let a = Side::new(&cfg, "shm0", 4096);
    let b = Side::new(&cfg, "shm0", 4096);
    a.post_all_rx();
    b.post_all_rx();
    connect(&a, &b);
    const N: u64 = 2000;
    let t = std::thread::spawn(move || {
        for i in 0..N {
            let mut got = None;
            while got.is_none() {
                let wc = b.next_wc();
                if wc.opcode == WcOpcode::Recv {
                    assert_eq!(
                        u64::from_le_bytes(b.rx_bytes(&wc)[..8].try_into().unwrap()),
                        i
                    );
                    b.post_rx(wc.wr_id as usize);
                    got = Some(());
                }
            }
            b.qp.post_send(&SendWr::Send {
                wr_id: i,
                data: &i.to_le_bytes(),
                signaled: false,
            })
            .unwrap();
        }
        b
    });
    for i in 0..N {
        a.qp.post_send(&SendWr::Send {
            wr_id: i,
            data: &i.to_le_bytes(),
            signaled: false,
        })
        .unwrap();
        let wc = a.next_wc();
        assert_eq!((wc.status, wc.opcode), (WcStatus::Success, WcOpcode::Recv));
        assert_eq!(
            u64::from_le_bytes(a.rx_bytes(&wc)[..8].try_into().unwrap()),
            i
        );
        a.post_rx(wc.wr_id as usize);
    }
    let _b = t.join().unwrap();
}

fn readable(fd: rustix::fd::BorrowedFd<'_>, timeout_ms: i64) -> bool {
    let ts = rustix::event::Timespec {
        tv_sec: timeout_ms / 1000,
        tv_nsec: (timeout_ms % 1000) * 1_000_000,
    };
    let mut fds = [rustix::event::PollFd::new(
        &fd,
        rustix::event::PollFlags::IN,
    )];
    rustix::event::poll(&mut fds, Some(&ts)).unwrap() > 0
}

#[test]
fn completion_channel_fd_event_loop_pattern() {
    let cfg = cfg("chan");
    let a = Side::new(&cfg, "shm0", 4096);
    let b = Side::new(&cfg, "shm0", 4096);
    a.post_all_rx();
    connect(&a, &b);
    let mut wcs = [WorkCompletion::EMPTY; 4];
    // Not armed: a delivered message leaves the channel quiet (busy pollers pay no doorbell).
    b.qp.post_send(&SendWr::Send {
        wr_id: 1,
        data: b"one",
        signaled: false,
    })
    .unwrap();
    assert!(!readable(a.cq.fd(), 0));
    assert_eq!(a.cq.poll(&mut wcs), 1);
    // Armed: the next message makes the fd readable; ack resets it.
    a.cq.req_notify();
    assert_eq!(a.cq.poll(&mut wcs), 0);
    assert!(!readable(a.cq.fd(), 0));
    let sender = std::thread::spawn(move || {
        b.qp.post_send(&SendWr::Send {
            wr_id: 2,
            data: b"two",
            signaled: false,
        })
        .unwrap();
        b
    });
    assert!(readable(a.cq.fd(), 10_000), "doorbell within 10 s");
    a.cq.ack_notify();
    assert!(!readable(a.cq.fd(), 0));
    assert_eq!(a.cq.poll(&mut wcs), 1);
    assert_eq!(a.rx_bytes(&wcs[0]), b"two");
    let b = sender.join().unwrap();
    // Local completions (a signaled send) ring the armed channel too.
    b.cq.req_notify();
    assert_eq!(b.cq.poll(&mut wcs), 0);
    b.qp.post_send(&SendWr::Send {
        wr_id: 3,
        data: b"three",
        signaled: true,
    })
    .unwrap();
    assert!(readable(b.cq.fd(), 10_000));
    b.cq.ack_notify();
    assert_eq!(b.cq.poll(&mut wcs), 1);
    assert_eq!(wcs[0].wr_id, 3);
}

/// A QP created on a completion queue whose channel is already armed (a thread sleeps on it)
/// rings the channel for its first message, like the QPs that existed when it was armed.
#[test]
fn qp_created_on_an_armed_channel_rings_it() {
    let cfg = cfg("armed-new-qp");
    let a = Side::new(&cfg, "shm0", 4096);
    let b = Side::new(&cfg, "shm0", 4096);
    let mut wcs = [WorkCompletion::EMPTY; 4];
    a.cq.req_notify();
    assert_eq!(a.cq.poll(&mut wcs), 0);
    let caps = QpCaps {
        max_send_wr: 16,
        max_recv_wr: RX_SLOTS as u32,
    };
    let qp = a.pd.create_qp(&a.cq, &a.cq, caps).unwrap();
    let peer = b.pd.create_qp(&b.cq, &b.cq, caps).unwrap();
    qp.to_init().unwrap();
    peer.to_init().unwrap();
    qp.post_recv(&RecvWr {
        wr_id: 0,
        sge: a.rx.sge(0, RX_SLOT as u32).unwrap(),
    })
    .unwrap();
    let info = |q: &QueuePair| {
        let l = q.local_info();
        RemoteQpInfo {
            gid: l.gid,
            qp_num: l.qp_num,
            psn: l.psn,
            mtu: l.mtu,
        }
    };
    qp.to_rtr(info(&peer)).unwrap();
    peer.to_rtr(info(&qp)).unwrap();
    qp.to_rts().unwrap();
    peer.to_rts().unwrap();
    peer.post_send(&SendWr::Send {
        wr_id: 1,
        data: b"first",
        signaled: false,
    })
    .unwrap();
    assert!(readable(a.cq.fd(), 10_000), "doorbell within 10 s");
    a.cq.ack_notify();
    assert_eq!(a.cq.poll(&mut wcs), 1);
    assert_eq!(a.rx_bytes(&wcs[0]), b"first");
}

/// A hostile local process speaking garbage to a device socket gets disconnected; the device
/// keeps serving well-behaved peers.
#[test]
fn garbage_on_the_control_socket_is_survived() {
    use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketAddrUnix, SocketType};
    let cfg = cfg("garbage");
    let a = Side::new(&cfg, "shm0", 4096);
    let path = cfg
        .dir
        .join("shm0")
        .join(format!("{}.sock", a.dev.gid().to_hex()));
    let hello_no_fd = {
        let mut m = vec![0u8; 32];
        m[..4].copy_from_slice(&0x534d_4346u32.to_le_bytes());
        m[4] = 1;
        m[28..32].copy_from_slice(&a.qp.qp_num().to_le_bytes());
        m
    };
    let mr_req_first = {
        let mut m = vec![0u8; 12];
        m[..4].copy_from_slice(&0x534d_4346u32.to_le_bytes());
        m[4] = 3;
        m
    };
    let junk: Vec<Vec<u8>> = vec![
        vec![0xff; 64],
        vec![],
        vec![1, 2, 3],
        hello_no_fd,
        mr_req_first,
    ];
    for msg in junk {
        let s = rustix::net::socket(AddressFamily::UNIX, SocketType::SEQPACKET, None).unwrap();
        rustix::net::connect(&s, &SocketAddrUnix::new(&path).unwrap()).unwrap();
        let _ = rustix::net::send(&s, &msg, SendFlags::NOSIGNAL);
        if msg.is_empty() {
            continue;
        }
        // The device hangs up on us (a zero-length read) instead of answering or crashing.
        let mut buf = [0u8; 64];
        let n = rustix::net::recv(&s, &mut buf, RecvFlags::empty())
            .map(|(n, _)| n)
            .unwrap_or(0);
        assert_eq!(n, 0, "device answered garbage {msg:?}");
    }
    // A proper peer still connects and works.
    let b = Side::new(&cfg, "shm0", 4096);
    a.post_all_rx();
    connect(&a, &b);
    b.qp.post_send(&SendWr::Send {
        wr_id: 1,
        data: b"still here",
        signaled: false,
    })
    .unwrap();
    assert_eq!(a.rx_bytes(&a.next_wc()), b"still here");
}

/// One RMB registered on two links (two devices): WRITEs over either link land in the same
/// bytes, and killing one link leaves the other working (the failover shape of SMC-R).
#[test]
fn rmb_aliased_on_two_links_survives_one_link_failure() {
    let cfg = cfg("alias");
    let a0 = Side::new(&cfg, "shm0", 4096);
    let b0 = Side::new(&cfg, "shm0", 4096);
    let a1 = Side::new(&cfg, "shm1", 4096);
    let b1 = Side::new(&cfg, "shm1", 4096);
    connect(&a0, &b0);
    connect(&a1, &b1);
    let rmb = &b0.rmb;
    let alias = b1
        .pd
        .register_alias(rmb, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
        .unwrap();
    assert_eq!(alias.addr(), rmb.addr());
    assert_ne!(alias.rkey(), rmb.rkey());
    let w = |side: &Side, key: u32, off: u64, data: &[u8]| {
        side.qp
            .post_send(&SendWr::WriteInline {
                wr_id: off,
                data,
                remote_addr: rmb.addr() + off,
                rkey: key,
                signaled: true,
            })
            .unwrap();
        side.next_wc()
    };
    assert_eq!(w(&a0, rmb.rkey(), 0, b"link0").status, WcStatus::Success);
    assert_eq!(w(&a1, alias.rkey(), 5, b"link1").status, WcStatus::Success);
    let mut got = [0u8; 10];
    rmb.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"link0link1");
    // The alias is bound to its own PD: link 0 cannot use it.
    assert_eq!(
        w(&a0, alias.rkey(), 0, b"x").status,
        WcStatus::RemoteAccessError
    );
    // Link 0 is dead now; link 1 still writes into the same RMB.
    assert_eq!(w(&a1, alias.rkey(), 0, b"after").status, WcStatus::Success);
    rmb.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"afterlink1");
}

#[test]
fn world_writable_fabric_directory_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = test_dir("perm");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let cfg = FabricConfig::with_dir(&dir, 1);
    match Device::open(&cfg, "shm0") {
        Err(FabricError::UntrustedDirectory { why, .. }) => {
            assert!(why.contains("writable by others"), "{why}")
        }
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(_) => panic!("a world-writable fabric directory was used"),
    }
}

/// Every SEND the sender saw complete with success was received (RC semantics), even when the
/// receiver's QP enters the error state before it polls; nothing the sender saw fail was.
fn sends_acknowledged_then_receiver_error(posted: usize, sends: u64, port_down: bool) {
    let cfg = cfg(if port_down {
        "errdrain-port"
    } else {
        "errdrain"
    });
    let a = Side::new(&cfg, "shm0", 4096);
    // Each Side opens its own port: only the receiver's port goes down.
    let b = Side::new(&cfg, "shm0", 4096);
    for slot in 0..posted {
        b.post_rx(slot);
    }
    connect(&a, &b);
    for i in 0..sends {
        a.qp.post_send(&SendWr::Send {
            wr_id: 100 + i,
            data: &i.to_le_bytes(),
            signaled: true,
        })
        .unwrap();
    }
    if port_down {
        b.dev.set_port_state(PortState::Down);
    } else {
        b.qp.force_error();
    }
    // Receiver: successful receives in order, then flushes.
    let mut received = Vec::new();
    let mut flushed = 0;
    while received.len() + flushed < posted {
        let wc = b.next_wc();
        if wc.opcode != WcOpcode::Recv {
            continue;
        }
        match wc.status {
            WcStatus::Success => {
                assert_eq!(flushed, 0, "success after a flush");
                received.push(u64::from_le_bytes(b.rx_bytes(&wc)[..8].try_into().unwrap()));
            }
            WcStatus::WrFlushError => flushed += 1,
            s => panic!("unexpected receive status {s:?}"),
        }
    }
    // Sender: every SEND completes, successfully or not.
    let mut ok = Vec::new();
    let mut failed = Vec::new();
    while ok.len() + failed.len() < sends as usize {
        let wc = a.next_wc();
        if wc.opcode != WcOpcode::Send {
            continue;
        }
        if wc.status == WcStatus::Success {
            ok.push(wc.wr_id - 100);
        } else {
            failed.push(wc.wr_id - 100);
        }
    }
    assert_eq!(
        ok, received,
        "sender successes = receiver deliveries (failed: {failed:?})"
    );
}

#[test]
fn receiver_error_delivers_every_acknowledged_send() {
    // Enough receives posted for every SEND.
    sends_acknowledged_then_receiver_error(8, 5, false);
    // Fewer receives than SENDs (the rest would be RNR-waiting in RC).
    sends_acknowledged_then_receiver_error(2, 5, false);
    // Port down instead of a forced error.
    sends_acknowledged_then_receiver_error(2, 5, true);
}

#[test]
fn post_status_says_whether_a_write_was_executed() {
    let cfg = cfg("status");
    let a = Side::new(&cfg, "shm0", 4096);
    let b = Side::new(&cfg, "shm0", 4096);
    connect(&a, &b);
    let write = |wr_id, at: u64| SendWr::WriteInline {
        wr_id,
        data: b"placed",
        remote_addr: b.rmb.addr() + at,
        rkey: b.rmb.rkey(),
        signaled: true,
    };
    // Executed at post: the bytes are at the peer before the call returns.
    assert_eq!(
        a.qp.post_send_status(&write(1, 64)).unwrap(),
        PostStatus::Executed
    );
    let mut got = [0u8; 6];
    b.rmb.read_at(64, &mut got).unwrap();
    assert_eq!(&got, b"placed");
    assert_eq!(a.next_wc().status, WcStatus::Success);
    // A SEND is never "executed" in that sense.
    assert_eq!(
        a.qp.post_send_status(&SendWr::Send {
            wr_id: 2,
            data: b"x",
            signaled: false
        })
        .unwrap(),
        PostStatus::Queued
    );
    // On a QP in the error state a WRITE is flushed, not executed.
    a.qp.force_error();
    assert_eq!(
        a.qp.post_send_status(&write(3, 128)).unwrap(),
        PostStatus::Queued
    );
    b.rmb.read_at(128, &mut got).unwrap();
    assert_eq!(got, [0u8; 6]);
}

#[test]
fn prefetch_hints_cover_exactly_the_region_and_stay_harmless_after_it_is_gone() {
    let b = Side::new(&cfg("prefetch"), "shm0", 8192);
    let len = b.rmb.len();
    // The lines of the bytes asked for (the mapping is page aligned), at most MAX_LINES, none
    // past the end.
    let lines = |offset, n| b.rmb.prefetch_hint(offset, n).map(|h| h.lines());
    assert_eq!(lines(0, 0), Some(1));
    assert_eq!(lines(0, 1), Some(1));
    assert_eq!(lines(0, 64), Some(1));
    assert_eq!(lines(63, 2), Some(2));
    assert_eq!(lines(1, 64), Some(2));
    assert_eq!(lines(0, 10_000), Some(PrefetchHint::MAX_LINES));
    assert_eq!(lines(len - 1, 100), Some(1));
    assert_eq!(lines(len - 65, usize::MAX), Some(2));
    assert_eq!(lines(len, 1), None);
    assert_eq!(lines(usize::MAX, 1), None);
    let mr =
        b.pd.register(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
    let hint = mr.prefetch_hint(4000, 1000).unwrap();
    assert_eq!(hint.lines(), 2);
    hint.issue();
    drop(mr);
    // The mapping is gone: a prefetch of it is ignored by the CPU, never a fault.
    hint.issue();
    let mut got = [1u8; 4];
    b.rmb.read_at(len - 4, &mut got).unwrap();
    assert_eq!(got, [0; 4]);
}
