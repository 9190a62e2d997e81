//! The eBPF TCP-option program against real TCP handshakes on loopback, checked in a packet
//! capture decoded by smc-wire's dissector.
//!
//! Needs root (CI runs as root) and tshark for the capture. On a machine without root the test
//! says so and returns, unless `SMC_REQUIRE_EBPF=1`, which makes it fail instead.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rustix::net::{AddressFamily, SocketType};
use smc::discovery::{Outcome, TcpOptionDiscovery};
use smc_wire::dissect::{read_capture, Found};

/// The fork test's child holds a copy of every descriptor of this process, the other tests'
/// programs included: the detach test, which needs its server's program gone when it drops
/// it, runs apart from it.
static FORKS_APART: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn can_run() -> bool {
    let root = rustix::process::geteuid().is_root();
    if !root {
        assert!(
            std::env::var_os("SMC_REQUIRE_EBPF").is_none(),
            "SMC_REQUIRE_EBPF set but not running as root"
        );
        eprintln!("not root: skipping the eBPF discovery test");
    }
    root
}

/// A listener bound to an ephemeral port, marked (or not) before listen().
fn listener(d: Option<&TcpOptionDiscovery>, ip: &str) -> TcpListener {
    let ip: std::net::IpAddr = ip.parse().expect("ip");
    let addr = SocketAddr::new(ip, 0);
    let fam = if addr.is_ipv4() {
        AddressFamily::INET
    } else {
        AddressFamily::INET6
    };
    let fd: OwnedFd = rustix::net::socket(fam, SocketType::STREAM, None).expect("socket");
    rustix::net::sockopt::set_socket_reuseaddr(&fd, true).expect("reuseaddr");
    rustix::net::bind(&fd, &addr).expect("bind");
    let local =
        SocketAddr::try_from(rustix::net::getsockname(&fd).expect("getsockname")).expect("inet");
    if let Some(d) = d {
        d.mark_listener(local.port()).expect("mark listener");
    }
    rustix::net::listen(&fd, 16).expect("listen");
    TcpListener::from(fd)
}

/// Connect to `to`, marking the socket first when `d` is given; returns the stream and cookie.
fn connect(d: Option<&TcpOptionDiscovery>, to: SocketAddr) -> (TcpStream, Option<u64>) {
    let fam = if to.is_ipv4() {
        AddressFamily::INET
    } else {
        AddressFamily::INET6
    };
    let fd: OwnedFd = rustix::net::socket(fam, SocketType::STREAM, None).expect("socket");
    let cookie = d.map(|d| d.mark_client(&fd).expect("mark client"));
    rustix::net::connect(&fd, &to).expect("connect");
    (TcpStream::from(fd), cookie)
}

struct Capture {
    child: Child,
    path: std::path::PathBuf,
}

/// Start tshark on loopback for the handshake on `port`; returns once it captures.
fn capture(port: u16, name: &str) -> Capture {
    let path = std::env::temp_dir().join(format!("smc-ebpf-{}-{name}.pcapng", std::process::id()));
    let mut child = Command::new("tshark")
        .args(["-i", "lo", "-f"])
        // The first three segments are the handshake (`tcp[]` filters cannot see IPv6).
        .arg(format!("tcp port {port}"))
        .args(["-c", "3", "-a", "duration:20", "-w"])
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run tshark (installed by scripts/install-deps.sh)");
    // tshark says "Capturing on 'Loopback: lo'" and then "Capture started" once dumpcap runs.
    let mut err = child.stderr.take().expect("stderr");
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seen = Vec::new();
    let mut buf = [0u8; 256];
    while !String::from_utf8_lossy(&seen).contains("Capture started") {
        assert!(
            Instant::now() < deadline,
            "tshark did not start: {}",
            String::from_utf8_lossy(&seen)
        );
        let n = err.read(&mut buf).expect("read tshark stderr");
        assert!(n > 0, "tshark exited: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = err.read_to_end(&mut sink);
    });
    Capture { child, path }
}

/// Wait for the capture and return, in order, whether the SYN and the SYN-ACK carried the option.
fn options_seen(mut c: Capture) -> (bool, bool) {
    let status = c.child.wait().expect("tshark finishes");
    assert!(status.success(), "tshark failed");
    let f = std::fs::File::open(&c.path).expect("capture file");
    let findings = read_capture(f).expect("capture readable");
    let _ = std::fs::remove_file(&c.path);
    let mut syn = false;
    let mut synack = false;
    for x in findings {
        if let Found::TcpOption { syn_ack } = x.found {
            if syn_ack {
                synack = true;
            } else {
                syn = true;
            }
        }
    }
    (syn, synack)
}

fn exchange(client: &mut TcpStream, server: &mut TcpStream) {
    client.write_all(b"ping").expect("write");
    let mut b = [0u8; 4];
    server.read_exact(&mut b).expect("read");
    assert_eq!(&b, b"ping");
}

#[test]
fn option_on_syn_and_synack_only_for_marked_sockets() {
    if !can_run() {
        return;
    }
    let d = TcpOptionDiscovery::load(None).expect("load and attach the sock_ops program");

    for ip in ["127.0.0.1", "::1"] {
        // Both sides smc-rs: SYN and SYN-ACK carry kind 254 / E2D4C3D9; both see BothOffered.
        let l = listener(Some(&d), ip);
        let at = l.local_addr().expect("addr");
        let cap = capture(at.port(), "both");
        let (mut c, cookie) = connect(Some(&d), at);
        let (mut s, peer) = l.accept().expect("accept");
        assert_eq!(options_seen(cap), (true, true), "{ip}: capture");
        assert_eq!(
            d.client_outcome(cookie.expect("cookie")).expect("q"),
            Outcome::BothOffered
        );
        assert_eq!(
            d.server_outcome(s.local_addr().expect("local"), peer)
                .expect("q"),
            Outcome::BothOffered,
            "{ip}"
        );
        exchange(&mut c, &mut s);

        // smc-rs client, plain server: SYN has it, the SYN-ACK not; the client falls back.
        let l = listener(None, ip);
        let at = l.local_addr().expect("addr");
        let cap = capture(at.port(), "plain-server");
        let (mut c, cookie) = connect(Some(&d), at);
        let (mut s, _) = l.accept().expect("accept");
        assert_eq!(options_seen(cap), (true, false), "{ip}: capture");
        assert_eq!(
            d.client_outcome(cookie.expect("cookie")).expect("q"),
            Outcome::PeerDidNotOffer
        );
        exchange(&mut c, &mut s);

        // Plain client, smc-rs server: no option anywhere; the server falls back.
        let l = listener(Some(&d), ip);
        let at = l.local_addr().expect("addr");
        let cap = capture(at.port(), "plain-client");
        let (mut c, _) = connect(None, at);
        let (mut s, peer) = l.accept().expect("accept");
        assert_eq!(options_seen(cap), (false, false), "{ip}: capture");
        assert_eq!(
            d.server_outcome(s.local_addr().expect("local"), peer)
                .expect("q"),
            Outcome::PeerDidNotOffer
        );
        exchange(&mut c, &mut s);
    }
}

#[test]
fn detached_program_means_peer_did_not_offer() {
    let _apart = FORKS_APART.lock().unwrap_or_else(|p| p.into_inner());
    if !can_run() {
        return;
    }
    // The client's stack keeps its program; the server's stack had one and dropped it.
    let client_stack = TcpOptionDiscovery::load(None).expect("client program");
    let server_stack = TcpOptionDiscovery::load(None).expect("server program");
    let l = listener(Some(&server_stack), "127.0.0.1");
    let at = l.local_addr().expect("addr");
    let (_c1, cookie) = connect(Some(&client_stack), at);
    let _s1 = l.accept().expect("accept");
    assert_eq!(
        client_stack
            .client_outcome(cookie.expect("cookie"))
            .expect("q"),
        Outcome::BothOffered,
        "while the server's program is attached"
    );
    drop(server_stack);
    let (_c2, cookie) = connect(Some(&client_stack), at);
    let _s2 = l.accept().expect("accept");
    assert_eq!(
        client_stack
            .client_outcome(cookie.expect("cookie"))
            .expect("q"),
        Outcome::PeerDidNotOffer,
        "after the server's program is detached"
    );
}

/// Fork, run `f` in the child (its result is the exit status: 0 when true), and return
/// whether the child reported success.
fn in_child(f: impl FnOnce() -> bool) -> bool {
    // SAFETY: the child runs `f` (system calls, the discovery's own lock, small allocations,
    // which glibc's fork handlers keep usable) and leaves with _exit, never returning into
    // the test harness.
    match unsafe { libc::fork() } {
        -1 => panic!("fork: {}", std::io::Error::last_os_error()),
        0 => {
            let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(false);
            // SAFETY: ends the child without running the parent's exit handlers.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) }
        }
        pid => {
            let mut status = 0;
            // SAFETY: waits for the child made above.
            assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0
        }
    }
}

#[test]
fn a_forked_child_uses_its_copy_of_the_parents_instance() {
    let _apart = FORKS_APART.lock().unwrap_or_else(|p| p.into_inner());
    if !can_run() {
        return;
    }
    let d = TcpOptionDiscovery::load(None).expect("load and attach the sock_ops program");
    let l = listener(Some(&d), "127.0.0.1");
    let at = l.local_addr().expect("addr");
    // The child's copy marks its own client socket; the parent's program, attached once,
    // puts the option on its SYN, and the SYN-ACK of the marked listener answers it.
    assert!(in_child(|| {
        if !d.usable_after_fork() {
            return false;
        }
        let (_c, cookie) = connect(Some(&d), at);
        matches!(
            cookie.map(|c| d.client_outcome(c)),
            Some(Ok(Outcome::BothOffered))
        )
    }));
    let (s, peer) = l.accept().expect("accept");
    assert_eq!(
        d.server_outcome(s.local_addr().expect("local"), peer)
            .expect("q"),
        Outcome::BothOffered
    );
    // A child that closed every descriptor it inherited (daemons, sshd) has no maps left:
    // the copy is unusable (the child's stack loads its own program).
    assert!(in_child(|| {
        // SAFETY: closes the child's inherited descriptors from 3 up; nothing of the
        // child uses them but the discovery copy under test.
        unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
        !d.usable_after_fork()
    }));
}
