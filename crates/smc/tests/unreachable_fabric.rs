//! Two stacks whose fabrics do not meet (two fabric directories, as two users' programs with
//! their default ones): every connection's first contact fails and runs over TCP. The
//! client sees the server's port is not in its fabric directory and declines in place of its
//! Confirm (before, it sent the Confirm, failed its QP connect and declined, while the
//! server failed its own and declined too: both Declines crossed, RFC 7609 C.2). Several
//! connects at once from several threads must all end, the first bytes each program writes
//! right after its connect must reach the other program, and nothing may make a socket
//! readable before the peer program wrote.
//!
//! Two tests use the fd-level API of `smc run` (`smc::fdapi`, the process-wide stack
//! configured from the environment), whose program keeps using its own socket after the
//! fallback: a byte the rendezvous read past its last CLC message is lost to it, and a CLC
//! message left in the socket is seen by its `poll`. Before the rendezvous read no further
//! than each CLC message, a server that waited for the client's Confirm took it, the
//! client's Decline and the program's first bytes in one read (PostgreSQL under `smc run`:
//! the backend never got the startup packet, pgbench waited in its connect for good).
#![allow(missing_docs)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use smc::fdapi::Setup;
use smc::{DiscoveryMode, FallbackReason, Mode, SmcListener, SmcStream, Stack, StackConfig};
use smc_fabric::FabricConfig;
use smc_wire::DeclineCode;

/// Concurrent connecting threads, and connects each.
const THREADS: usize = 4;
const EACH: usize = 8;

/// How long a test waits for something that should come at once before it calls it a hang.
const HANG: Duration = Duration::from_secs(30);

fn test_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "smc-unreach-{}-{}-{}",
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

fn stack(dir: &Path) -> Stack {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("SMC_LOG"))
        .with_writer(std::io::stderr)
        .try_init();
    let mut c = StackConfig::new(FabricConfig::with_dir(dir, 2));
    c.discovery = DiscoveryMode::AssertPeer;
    c.assert_peer_wait = HANG;
    Stack::new(c).expect("stack")
}

/// The message connection `i` of thread `t` writes first.
fn hello(t: usize, i: usize) -> Vec<u8> {
    format!("hello from thread {t} connection {i}\n").into_bytes()
}

/// `THREADS` threads each connect `each` times at once on `client` to `addr`, write their
/// hello right after the connect and read it back; every result (or the first missing one
/// after [`HANG`]) is returned.
fn connect_all(
    client: &Stack,
    addr: SocketAddr,
    each: usize,
) -> Vec<(usize, usize, Result<Mode, String>)> {
    let (tx, rx) = mpsc::channel();
    for t in 0..THREADS {
        let (client, tx) = (client.clone(), tx.clone());
        std::thread::spawn(move || {
            for i in 0..each {
                let r = SmcStream::connect_with(&client, addr).and_then(|mut s| {
                    let msg = hello(t, i);
                    s.write_all(&msg)?;
                    s.set_read_timeout(Some(HANG))?;
                    let mut back = vec![0u8; msg.len()];
                    s.read_exact(&mut back)?;
                    if back != msg {
                        return Err(std::io::Error::other(format!("echo {back:?}")));
                    }
                    Ok(s.mode())
                });
                if tx.send((t, i, r.map_err(|e| e.to_string()))).is_err() {
                    return;
                }
            }
        });
    }
    drop(tx);
    let mut done = Vec::new();
    for _ in 0..THREADS * each {
        match rx.recv_timeout(HANG + HANG) {
            Ok(r) => done.push(r),
            Err(_) => panic!(
                "a connect never ended: {} of {} done: {done:?}\nclient {:?}",
                done.len(),
                THREADS * each,
                client.stats()
            ),
        }
    }
    done
}

fn assert_all_tcp(done: &[(usize, usize, Result<Mode, String>)]) {
    for (t, i, m) in done {
        assert!(
            matches!(m, Ok(Mode::Tcp(_))),
            "thread {t} connection {i}: {m:?}"
        );
    }
}

/// Run the calling thread (and the threads it starts afterwards) on one CPU: the threads of
/// both ends then take turns, as on a loaded machine, and a reader wakes only after its
/// peer wrote on (what made the lost-bytes race of the module comment show in most runs).
fn one_cpu() {
    // SAFETY: a CPU set of our own, for the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return;
        }
        let Some(cpu) = (0..libc::CPU_SETSIZE as usize).find(|c| libc::CPU_ISSET(*c, &set)) else {
            return;
        };
        libc::CPU_ZERO(&mut set);
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// The environment the process-wide stack of `smc::fdapi` is made from (a fabric directory of
/// its own, assert-peer discovery), set once, before anything else of a test runs: every test
/// calls this first, so that no thread reads the environment while it is written.
fn fdapi_env() {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let d = test_dir("fdapi");
        std::env::set_var("SMC_FABRIC_DIR", &d);
        std::env::set_var("SMC_DISCOVERY", "assert-peer");
        d
    });
}

/// The process-wide stack of `smc::fdapi`, made from the environment at its first use: on a
/// fabric directory of its own, assert-peer discovery. Each test first pins its thread
/// ([`one_cpu`]), so that the stack's threads, started by the first test here, are pinned too.
fn fdapi_stack() -> Stack {
    fdapi_env();
    let s = smc::fdapi::stack().expect("fdapi stack");
    assert!(s.fabric_unavailable().is_none());
    s
}

/// A server program of `smc run` (the fd-level API): each accepted connection's rendezvous
/// on the program's own socket, then the program reads its socket itself (after the
/// crossed CLC messages are taken out, as the library does before a read) and echoes one
/// line.
#[test]
fn fdapi_server_gets_the_first_bytes_of_every_concurrent_client() {
    fdapi_env();
    one_cpu();
    let _server = fdapi_stack();
    let da = test_dir("fd-client");
    let client = stack(&da);
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            std::thread::spawn(move || {
                let t = match smc::fdapi::setup_server(s.as_fd()) {
                    Ok(Setup::Tcp(t)) => t,
                    // (The client then reads no echo and reports it.)
                    other => {
                        eprintln!("server rendezvous: {other:?}");
                        return;
                    }
                };
                if t.strips_crossed() {
                    if let Err(e) = t.strip_crossed(s.as_fd(), true) {
                        eprintln!("strip: {e}");
                        return;
                    }
                }
                // The program's own socket: the client's first line must be there.
                let _ = s.set_read_timeout(Some(HANG));
                let mut line = Vec::new();
                let mut b = [0u8; 1];
                while !line.ends_with(b"\n") {
                    match s.read(&mut b) {
                        Ok(1) => line.push(b[0]),
                        _ => {
                            eprintln!("the client's first bytes never came: {line:?}");
                            return;
                        }
                    }
                }
                let _ = s.write_all(&line);
                drop(t);
            });
        }
    });
    // (Three times the connections of the other tests: the old code lost the first line of
    // only some of them, and of none in some runs of 32.)
    let done = connect_all(&client, addr, 3 * EACH);
    assert_all_tcp(&done);
    let st = client.stats();
    assert_eq!(st.fallbacks, (THREADS * 3 * EACH) as u64, "{st:?}");
    let _ = std::fs::remove_dir_all(&da);
}

/// A client program of `smc run` (the fd-level API) that waits for readability before it
/// reads, as event loops and `poll`-then-`read` programs do, against a server that answers
/// only a request: after the connect the program's socket must not be readable, as over
/// TCP. When both ends declined at once, the server's Decline crossed ours and stood in the
/// socket: `poll` reported it readable, and the blocking read that followed (the crossed
/// Decline stripped, no data behind it) waited for good, the request never sent.
#[test]
fn fdapi_client_socket_is_not_readable_before_the_server_writes() {
    fdapi_env();
    one_cpu();
    let _client = fdapi_stack();
    let ds = test_dir("poll-server");
    let server = stack(&ds);
    let l = SmcListener::bind_with(&server, "127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    echo_server(l, true);
    for i in 0..EACH {
        let fd = rustix::net::socket(
            rustix::net::AddressFamily::INET,
            rustix::net::SocketType::STREAM,
            None,
        )
        .expect("socket");
        let t = match smc::fdapi::connect(fd.as_fd(), addr, false) {
            Ok(Setup::Tcp(t)) => t,
            other => panic!("connection {i}: {other:?}"),
        };
        let mut fds = [rustix::event::PollFd::new(
            &fd,
            rustix::event::PollFlags::IN,
        )];
        let wait = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: 300_000_000,
        };
        let n = rustix::event::poll(&mut fds, Some(&wait)).expect("poll");
        let mut peek = [0u8; 64];
        let there = rustix::net::recv(
            &fd,
            &mut peek,
            rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT,
        )
        .map_or(0, |(n, _)| n);
        assert_eq!(
            n,
            0,
            "connection {i} ({:?}): readable before the server wrote: {:02x?}",
            t.mode(),
            &peek[..there]
        );
        let mut s = std::net::TcpStream::from(fd);
        let msg = hello(0, i);
        s.write_all(&msg).expect("request");
        if t.strips_crossed() {
            t.strip_crossed(s.as_fd(), true).expect("strip");
        }
        s.set_read_timeout(Some(HANG)).expect("timeout");
        let mut back = vec![0u8; msg.len()];
        s.read_exact(&mut back).expect("answer");
        assert_eq!(back, msg);
    }
    let _ = std::fs::remove_dir_all(&ds);
}

/// Both ends on the stack's own API (whose fallen-back stream keeps what the rendezvous
/// read past its messages): every connect ends, every echo is right.
#[test]
fn api_concurrent_connects_across_fabrics_all_end() {
    fdapi_env();
    let (da, db) = (test_dir("api-client"), test_dir("api-server"));
    let server = stack(&db);
    let client = stack(&da);
    let l = SmcListener::bind_with(&server, "127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    echo_server(l, false);
    let done = connect_all(&client, addr, EACH);
    assert_all_tcp(&done);
    // The client declines in place of its Confirm (the server's port is not in its fabric
    // directory): the server falls back on reading it and declines nothing itself.
    for (t, i, m) in &done {
        assert_eq!(
            m,
            &Ok(Mode::Tcp(FallbackReason::Declined(DeclineCode::ERR_RDYLNK))),
            "thread {t} connection {i}"
        );
    }
    let _ = std::fs::remove_dir_all(&da);
    let _ = std::fs::remove_dir_all(&db);
}

/// Serve `l` from a thread, a thread per connection echoing what it reads: the first read
/// only (`once`), or until the end of stream.
fn echo_server(l: SmcListener, once: bool) {
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            std::thread::spawn(move || {
                let mut b = [0u8; 256];
                while let Ok(n) = s.read(&mut b) {
                    if n == 0 || s.write_all(&b[..n]).is_err() || once {
                        break;
                    }
                }
            });
        }
    });
}
