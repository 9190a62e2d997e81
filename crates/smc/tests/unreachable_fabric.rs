//! Two stacks whose fabrics do not meet (two fabric directories, as two users' programs with
//! their default ones): every connection's first contact fails, both ends decline at once
//! (RFC 7609 C.2) and the connection runs over TCP. Several connects at once from several
//! threads must all end, and the first bytes each program writes right after its connect
//! must reach the other program.
//!
//! The server side is the fd-level API of `smc run` (`smc::fdapi`, the process-wide stack
//! configured from the environment): the program keeps reading its own socket after the
//! fallback, so a byte the rendezvous read past its last CLC message would be lost to it.
//! Before the rendezvous read no further than each CLC message, a server that waited for
//! the client's Confirm took the Confirm, the client's crossed Decline and the program's
//! first bytes in one read (PostgreSQL under `smc run`: the backend never got the startup
//! packet, pgbench waited in its connect for good).
#![allow(missing_docs)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use smc::fdapi::Setup;
use smc::{DiscoveryMode, Mode, SmcListener, SmcStream, Stack, StackConfig};
use smc_fabric::FabricConfig;

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

/// `THREADS` threads each connect `EACH` times at once on `client` to `addr`, write their
/// hello right after the connect and read it back; every result (or the first missing one
/// after [`HANG`]) is returned.
fn connect_all(client: &Stack, addr: SocketAddr) -> Vec<(usize, usize, Result<Mode, String>)> {
    let (tx, rx) = mpsc::channel();
    for t in 0..THREADS {
        let (client, tx) = (client.clone(), tx.clone());
        std::thread::spawn(move || {
            for i in 0..EACH {
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
    for _ in 0..THREADS * EACH {
        match rx.recv_timeout(HANG + HANG) {
            Ok(r) => done.push(r),
            Err(_) => panic!(
                "a connect never ended: {} of {} done: {done:?}\nclient {:?}",
                done.len(),
                THREADS * EACH,
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
        let Some(cpu) = (0..libc::CPU_SETSIZE as usize).find(|c| libc::CPU_ISSET(*c, &set))
        else {
            return;
        };
        libc::CPU_ZERO(&mut set);
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// A server program of `smc run` (the fd-level API): each accepted connection's rendezvous
/// on the program's own socket, then the program reads its socket itself (after the
/// crossed CLC messages are taken out, as the library does before a read) and echoes one
/// line.
#[test]
fn fdapi_server_gets_the_first_bytes_of_every_concurrent_client() {
    let (da, db) = (test_dir("fd-client"), test_dir("fd-server"));
    // The process-wide stack of `smc::fdapi` is made from the environment at its first use
    // (here, before any other thread of this test exists).
    std::env::set_var("SMC_FABRIC_DIR", &db);
    std::env::set_var("SMC_DISCOVERY", "assert-peer");
    one_cpu();
    let server_stack = smc::fdapi::stack().expect("fdapi stack");
    assert!(server_stack.fabric_unavailable().is_none());
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
    let done = connect_all(&client, addr);
    assert_all_tcp(&done);
    let st = client.stats();
    assert_eq!(st.fallbacks, (THREADS * EACH) as u64, "{st:?}");
    let _ = std::fs::remove_dir_all(&da);
    let _ = std::fs::remove_dir_all(&db);
}

/// Both ends on the stack's own API (whose fallen-back stream keeps what the rendezvous
/// read past its messages): every connect ends, every echo is right.
#[test]
fn api_concurrent_connects_across_fabrics_all_end() {
    let (da, db) = (test_dir("api-client"), test_dir("api-server"));
    let server = stack(&db);
    let client = stack(&da);
    let l = SmcListener::bind_with(&server, "127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            std::thread::spawn(move || {
                let mut b = [0u8; 256];
                while let Ok(n) = s.read(&mut b) {
                    if n == 0 || s.write_all(&b[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
    let done = connect_all(&client, addr);
    assert_all_tcp(&done);
    let _ = std::fs::remove_dir_all(&da);
    let _ = std::fs::remove_dir_all(&db);
}
