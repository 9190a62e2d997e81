//! Unit tests of `relay.rs` (the wire, the proof, the fork and epoll handling).

use super::*;

#[test]
fn the_server_name_is_abstract_and_names_pid_and_nonce() {
    let (a, len) = address(4242, 0xabc);
    assert_eq!(a.sun_path[0], 0);
    let name: Vec<u8> = a.sun_path[1..]
        .iter()
        .take(len as usize - 3)
        .map(|&c| c as u8)
        .collect();
    assert_eq!(name, b"smc-rs-relay/4242/0000000000000abc");
}

fn tcp_socket() -> OwnedFd {
    // SAFETY: a new socket of this test's.
    let s = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(s >= 0);
    // SAFETY: just made.
    unsafe { OwnedFd::from_raw_fd(s) }
}

fn dup(fd: &OwnedFd) -> OwnedFd {
    // SAFETY: a copy of a descriptor this test owns.
    let d = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
    assert!(d >= 0);
    // SAFETY: just made.
    unsafe { OwnedFd::from_raw_fd(d) }
}

fn pipe() -> (OwnedFd, OwnedFd) {
    let mut q = [0; 2];
    // SAFETY: an array of two ints.
    assert_eq!(unsafe { libc::pipe2(q.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: just made.
    unsafe { (OwnedFd::from_raw_fd(q[0]), OwnedFd::from_raw_fd(q[1])) }
}

#[test]
fn the_proof_is_the_open_file_not_a_lookalike() {
    // A socket of "the connection", named in the table as a number of this process.
    let conn = tcp_socket();
    let id = table::socket_id(conn.as_raw_fd()).expect("a socket");
    let e = Entry::new(Kind::Inherited(None));
    let _ = e.socket.set(id);
    assert!(table::set(conn.as_raw_fd(), e).is_ok());
    match same_file(conn.as_raw_fd(), dup(&conn).as_raw_fd()) {
        Ok(true) => {}
        Err(e) if e == libc::ENOSYS || e == libc::EPERM => {
            // No kcmp here: every proof is refused (checked below).
            eprintln!("skipping the positive proof: kcmp unavailable (errno {e})");
            let r = check_proof(ASK, &[dup(&conn)]);
            assert_eq!(r, Err(e));
            let _ = table::take(conn.as_raw_fd());
            return;
        }
        other => panic!("kcmp of a descriptor and its copy: {other:?}"),
    }
    // A copy of the same open file (what a forked child holds) is a proof.
    assert_eq!(check_proof(ASK, &[dup(&conn)]), Ok(id));
    // Another TCP socket (another process's unrelated connection) is not.
    let other = tcp_socket();
    assert_eq!(same_file(conn.as_raw_fd(), other.as_raw_fd()), Ok(false));
    assert_eq!(check_proof(ASK, &[other]), Err(libc::ENOENT));
    // Not a socket: refused before anything else looks at it.
    let (r, w) = pipe();
    assert_eq!(check_proof(ASK, &[r]), Err(libc::ENOTSOCK));
    // A unix datagram socket: not a stream.
    let mut p = [0; 2];
    // SAFETY: an array of two ints.
    assert_eq!(
        unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_DGRAM, 0, p.as_mut_ptr()) },
        0
    );
    // SAFETY: just made.
    let (d0, _d1) = unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) };
    assert_eq!(check_proof(ASK, &[d0]), Err(libc::ENOTSOCK));
    // Not one descriptor, or not the request byte.
    assert_eq!(check_proof(ASK, &[]), Err(libc::EPROTO));
    assert_eq!(
        check_proof(ASK, &[dup(&conn), dup(&conn)]),
        Err(libc::EPROTO)
    );
    assert_eq!(check_proof(b'x', &[dup(&conn)]), Err(libc::EPROTO));
    drop(w);
    let _ = table::take(conn.as_raw_fd());
}

#[test]
fn a_forked_child_closes_the_pumps_descriptors() {
    let _children = crate::TEST_CHILDREN
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let (r, w) = pipe();
    assert!(pump_fd_add(r.as_raw_fd()));
    // SAFETY: the child makes only system calls (fcntl, close) and exits.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        close_pump_fds();
        // SAFETY: as above.
        unsafe {
            let gone = libc::fcntl(r.as_raw_fd(), libc::F_GETFD) < 0;
            let kept = libc::fcntl(w.as_raw_fd(), libc::F_GETFD) >= 0;
            libc::_exit(if gone && kept { 0 } else { 1 });
        }
    }
    let mut status = 0;
    // SAFETY: our child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
    // The parent's copy stays open (and noted until the pump forgets it).
    // SAFETY: plain fcntl.
    assert!(unsafe { libc::fcntl(r.as_raw_fd(), libc::F_GETFD) } >= 0);
    pump_fd_remove(r.as_raw_fd());
    assert!(PUMP_FDS
        .iter()
        .all(|s| s.load(Ordering::Relaxed) != r.as_raw_fd()));
}

#[test]
fn a_close_deletes_only_this_process_s_epoll_registrations() {
    let mut p = [0; 2];
    // SAFETY: an array of two ints.
    assert_eq!(
        unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, p.as_mut_ptr()) },
        0
    );
    // SAFETY: just made.
    let (a, _b) = unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) };
    let relay = Relay::new(a, Owner::of_tree(1));
    let registered = |ep: c_int| {
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: 0,
        };
        // SAFETY: a MOD of A in our epoll instance.
        unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_MOD, relay.fd(), &mut ev) == 0 }
    };
    let mut eps = Vec::new();
    for _ in 0..2 {
        // SAFETY: a new epoll instance of this test's.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        assert!(ep >= 0);
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: 0,
        };
        // SAFETY: registering A.
        assert_eq!(
            unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, relay.fd(), &mut ev) },
            0
        );
        eps.push(ep);
    }
    // One registration made by this process, one by another (a parent, for a child).
    relay.registered(eps[0], 1000, true);
    let other = table::PID.load(Ordering::Relaxed) + 1;
    relay.with_epolls(|v| v.push((other, eps[1], 1000)));
    relay.closed(1000);
    assert!(
        !registered(eps[0]),
        "this process's registration was not deleted"
    );
    assert!(
        registered(eps[1]),
        "another process's registration was deleted"
    );
    relay.with_epolls(|v| assert!(v.is_empty()));
    for ep in eps {
        // SAFETY: ours.
        unsafe { libc::close(ep) };
    }
}

#[test]
fn the_requester_takes_only_a_unix_stream_socket_back() {
    let mut p = [0; 2];
    // SAFETY: an array of two ints.
    assert_eq!(
        unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, p.as_mut_ptr()) },
        0
    );
    // SAFETY: just made.
    let (s0, _s1) = unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) };
    assert_eq!(check_relay_socket(s0.as_raw_fd()), Ok(()));
    let (r, _w) = pipe();
    assert_eq!(check_relay_socket(r.as_raw_fd()), Err(libc::EPROTO));
    let t = tcp_socket();
    assert_eq!(check_relay_socket(t.as_raw_fd()), Err(libc::EPROTO));
    // SAFETY: an array of two ints.
    assert_eq!(
        unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_DGRAM, 0, p.as_mut_ptr()) },
        0
    );
    // SAFETY: just made.
    let (d0, _d1) = unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) };
    assert_eq!(check_relay_socket(d0.as_raw_fd()), Err(libc::EPROTO));
}

#[test]
fn a_descriptor_travels_with_its_byte() {
    let mut p = [0; 2];
    // SAFETY: plain system calls on descriptors this test owns.
    unsafe {
        assert_eq!(
            libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, p.as_mut_ptr()),
            0
        );
    }
    let mut q = [0; 2];
    // SAFETY: as above.
    unsafe { assert_eq!(libc::pipe(q.as_mut_ptr()), 0) };
    send_with_fd(p[0], ASK, Some(q[0])).expect("send");
    let (b, fds) = recv_with_fds(p[1]).expect("recv");
    assert_eq!(b, ASK);
    assert_eq!(fds.len(), 1);
    // The same pipe: what goes into its write end comes out of the received copy.
    // SAFETY: as above.
    unsafe {
        assert_eq!(libc::write(q[1], b"x".as_ptr().cast(), 1), 1);
        let mut c = [0u8];
        assert_eq!(libc::read(fds[0].as_raw_fd(), c.as_mut_ptr().cast(), 1), 1);
        assert_eq!(c[0], b'x');
    }
    // A byte without a descriptor, and the end of stream.
    send_with_fd(p[0], 7, None).expect("send");
    let (b, fds) = recv_with_fds(p[1]).expect("recv");
    assert_eq!((b, fds.len()), (7, 0));
    // SAFETY: as above.
    unsafe { libc::close(p[0]) };
    assert_eq!(recv_with_fds(p[1]).err(), Some(libc::ECONNRESET));
    // SAFETY: as above.
    unsafe {
        libc::close(p[1]);
        libc::close(q[0]);
        libc::close(q[1]);
    }
}
