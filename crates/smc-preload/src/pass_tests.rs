//! Unit tests of `pass.rs` (the name, the rule of how long a pass keeps a connection, the
//! in-flight test on a unix socket's queue, the look-up on the wire).

use super::*;

#[test]
fn the_name_is_abstract_and_names_the_tcp_socket() {
    let (a, len) = name((8, 123456));
    assert_eq!(a.sun_path[0], 0);
    let off = std::mem::offset_of!(libc::sockaddr_un, sun_path) + 1;
    let got: Vec<u8> = a.sun_path[1..]
        .iter()
        .take(len as usize - off)
        .map(|&c| c as u8)
        .collect();
    assert_eq!(got, b"smc-rs-passed/8/123456");
}

#[test]
fn a_pass_keeps_the_connection_while_in_flight_then_for_a_grace_if_unclaimed() {
    let now = Instant::now();
    // In flight: kept, whatever the counts.
    assert!(keeps_rule(true, 1, 0, None, now));
    assert!(keeps_rule(true, 1, 1, Some(now), now));
    // Taken, and every pass was looked up: the receivers are known, no grace.
    assert!(!keeps_rule(false, 2, 2, Some(now), now));
    // Taken by a receiver that did not look it up (yet): kept for the grace, then not.
    assert!(keeps_rule(false, 2, 1, Some(now), now));
    assert!(!keeps_rule(false, 2, 1, Some(now), now + GRACE));
    // Never in flight (no copy of the unix socket): nothing to wait for.
    assert!(!keeps_rule(false, 1, 0, None, now));
}

fn socketpair(ty: c_int) -> (OwnedFd, OwnedFd) {
    let mut p = [0; 2];
    // SAFETY: an array of two ints.
    assert_eq!(
        unsafe { libc::socketpair(libc::AF_UNIX, ty | libc::SOCK_CLOEXEC, 0, p.as_mut_ptr()) },
        0
    );
    // SAFETY: just made.
    unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) }
}

#[test]
fn a_pass_is_in_flight_until_taken_or_dropped_with_the_receiving_socket() {
    for ty in [libc::SOCK_STREAM, libc::SOCK_DGRAM, libc::SOCK_SEQPACKET] {
        let (tcp, _) = socketpair(libc::SOCK_STREAM);
        // Taken: the receiver reads the message.
        let (s, r) = socketpair(ty);
        assert_eq!(unsent(s.as_raw_fd()), 0);
        send_with_fd(s.as_raw_fd(), PASS, Some(tcp.as_raw_fd())).expect("send");
        assert!(
            unsent(s.as_raw_fd()) > 0,
            "type {ty}: nothing counted in flight"
        );
        let (b, fds) = recv_with_fds(r.as_raw_fd()).expect("recv");
        assert_eq!((b, fds.len()), (PASS, 1));
        assert_eq!(unsent(s.as_raw_fd()), 0, "type {ty}: taken, still counted");
        // Dropped: the receiving socket is closed with the message unread.
        let (s, r) = socketpair(ty);
        send_with_fd(s.as_raw_fd(), PASS, Some(tcp.as_raw_fd())).expect("send");
        assert!(unsent(s.as_raw_fd()) > 0);
        drop(r);
        assert_eq!(
            unsent(s.as_raw_fd()),
            0,
            "type {ty}: dropped, still counted"
        );
    }
}

/// A socket standing for "the connection", entered in the table as an inherited number of
/// this process (the caller takes it out), its peer and its id.
fn inherited_conn() -> (OwnedFd, OwnedFd, (u64, u64)) {
    let (conn, peer) = socketpair(libc::SOCK_STREAM);
    let id = table::socket_id(conn.as_raw_fd()).expect("a socket");
    let e = Entry::new(Kind::Inherited(None));
    let _ = e.socket.set(id);
    assert!(table::set(conn.as_raw_fd(), e).is_ok());
    (conn, peer, id)
}

#[test]
fn a_lookup_names_the_owner_and_notes_the_receiver() {
    // A socket of "the connection", named in the table as a number of this process, and
    // its record as a passed connection.
    let (conn, _peer, id) = inherited_conn();
    let (l, _) = socketpair(libc::SOCK_STREAM);
    with_passed(|v| v.push(pass_record(id, l, false)));
    let (c, s) = socketpair(libc::SOCK_STREAM);
    let proof = tcp_dup(&conn);
    send_with_fds(s.as_raw_fd(), LOOKUP, &[proof.as_raw_fd()]).expect("send");
    let answered = answer(c.as_raw_fd());
    match answered {
        Ok(Answer::Owner) => {}
        Err(e) if e == libc::ENOSYS || e == libc::EPERM => {
            eprintln!("skipping: kcmp unavailable (errno {e})");
            with_passed(|v| v.retain(|p| p.id != id));
            let _ = table::take(conn.as_raw_fd());
            return;
        }
        _ => panic!("the look-up was not answered with the owner"),
    }
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    let (lookups, receivers) = with_passed(|v| {
        let p = v.iter().find(|p| p.id == id).expect("the record");
        (p.lookups, p.receivers.clone())
    });
    assert_eq!((lookups, receivers), (1, vec![me]));
    // The answer on the wire: status 0 and the nonce.
    let mut b = [0u8; 9];
    b[1..].copy_from_slice(&nonce().to_le_bytes());
    // SAFETY: our socket and buffer.
    assert_eq!(
        unsafe { libc::send(c.as_raw_fd(), b.as_ptr().cast(), 9, 0) },
        9
    );
    assert_eq!(lookup_answer(s.as_raw_fd()), Ok(nonce()));
    // A refusal (a status byte alone) is an error, not an owner.
    // SAFETY: as above.
    assert_eq!(
        unsafe { libc::send(c.as_raw_fd(), [libc::ENOENT as u8].as_ptr().cast(), 1, 0) },
        1
    );
    drop(c);
    assert_eq!(lookup_answer(s.as_raw_fd()), Err(libc::ENOENT));
    // Another socket (not the connection's open file) is refused.
    let (c, s) = socketpair(libc::SOCK_STREAM);
    let (other, _) = socketpair(libc::SOCK_STREAM);
    send_with_fds(s.as_raw_fd(), LOOKUP, &[other.as_raw_fd()]).expect("send");
    assert!(matches!(answer(c.as_raw_fd()), Err(libc::ENOENT)));
    with_passed(|v| v.retain(|p| p.id != id));
    let _ = table::take(conn.as_raw_fd());
}

fn tcp_dup(fd: &OwnedFd) -> OwnedFd {
    // SAFETY: a copy of a descriptor this test owns.
    let d = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
    assert!(d >= 0);
    // SAFETY: just made.
    unsafe { OwnedFd::from_raw_fd(d) }
}

#[test]
fn a_request_that_meets_the_owner_s_close_waits_for_its_record() {
    // The program's close of "the connection" is under way: its entry is gone, the record
    // that keeps it is being made (here: the entry comes back 50 ms later, as a record would).
    let (conn, _peer) = socketpair(libc::SOCK_STREAM);
    let id = table::socket_id(conn.as_raw_fd()).expect("a socket");
    let mark = keep::closing_mark(id.1);
    assert!(keep::being_closed(id.1));
    let (c, s) = socketpair(libc::SOCK_STREAM);
    let proof = tcp_dup(&conn);
    send_with_fds(s.as_raw_fd(), LOOKUP, &[proof.as_raw_fd()]).expect("send");
    let raw = conn.as_raw_fd();
    let closer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        let e = Entry::new(Kind::Inherited(None));
        let _ = e.socket.set(id);
        assert!(table::set(raw, e).is_ok());
        drop(mark);
    });
    let r = answer(c.as_raw_fd());
    closer.join().expect("the closer");
    assert!(!keep::being_closed(id.1));
    match r {
        Ok(Answer::Owner) => {}
        Err(e) if e == libc::ENOSYS || e == libc::EPERM => {
            eprintln!("skipping: kcmp unavailable (errno {e})");
        }
        Err(e) => panic!("the request did not wait for the close's record: errno {e}"),
        Ok(_) => panic!("a look-up answered with something else"),
    }
    let _ = table::take(conn.as_raw_fd());
}

#[test]
fn the_names_under_a_connection_s_name_are_found_in_proc_net_unix() {
    let r1 = "00ff00ff00ff00ff00ff00ff00ff00ff";
    let r2 = "0123456789abcdef0123456789abcdef";
    let t = format!(
        "Num       RefCount Protocol Flags    Type St Inode Path\n\
        0000000000000000: 00000002 00000000 00010000 0001 01 101 @smc-rs-passed/8/77/{r1}\n\
        0000000000000000: 00000002 00000000 00010000 0001 01 102 @smc-rs-passed/8/77\n\
        0000000000000000: 00000002 00000000 00010000 0001 01 103 @smc-rs-passed/8/777/{r2}\n\
        0000000000000000: 00000002 00000000 00010000 0001 01 104 @smc-rs-passed/8/77/\n\
        0000000000000000: 00000003 00000000 00000000 0001 03 105\n\
        0000000000000000: 00000002 00000000 00010000 0001 01 106 /run/smc-rs-passed/8/77/{r2}\n\
        0000000000000000: 00000002 00000000 00010000 0001 01 107 @smc-rs-passed/8/77/0a\n\
        0000000000000000: 00000002 00000000 00010000 0001 01 108 @smc-rs-passed/8/77/{}\n\
        0000000000000000: 00000002 00000000 00010000 0001 01 109 @smc-rs-passed/8/77/{r1}0\n\
        0000000000000000: 00000003 00000000 00000000 0001 03 110 @smc-rs-passed/8/77/{r1}\n\
        0000000000000000: 00000002 00000000 00010000 0001 01 111 @smc-rs-passed/8/77/{r2}\n",
        r2.to_uppercase()
    );
    // Only the names a random name could be (32 lowercase hex digits), each once (an
    // accepted socket shows its listener's name).
    assert_eq!(
        candidates_in(t.lines().map(str::to_string), (8, 77)),
        vec![
            format!("smc-rs-passed/8/77/{r1}"),
            format!("smc-rs-passed/8/77/{r2}")
        ]
    );
}

#[test]
fn names_that_sort_first_hide_no_owner() {
    // Someone bound many names under the connection's name, before the owner's random one,
    // and names that sort before it: the owner's is still a candidate.
    let owner = "f0e1d2c3b4a5968778695a4b3c2d1e0f";
    let mut lines: Vec<String> = (0..100)
        .map(|i| format!("0: 2 0 10000 1 1 {i} @smc-rs-passed/1/2/!{i:03}"))
        .collect();
    lines.extend((0..100).map(|i| format!("0: 2 0 10000 1 1 {i} @smc-rs-passed/1/2/{i:032x}")));
    lines.push(format!("0: 2 0 10000 1 1 999 @smc-rs-passed/1/2/{owner}"));
    let c = candidates_in(lines.into_iter(), (1, 2));
    assert!(
        c.contains(&format!("smc-rs-passed/1/2/{owner}")),
        "the owner's name is hidden"
    );
    assert_eq!(c.len(), 101);
    // Bounded all the same.
    let many = (0..2 * MAX_CANDIDATES)
        .map(|i| format!("0: 2 0 10000 1 1 {i} @smc-rs-passed/1/2/{i:032x}"));
    assert_eq!(candidates_in(many, (1, 2)).len(), MAX_CANDIDATES);
}

#[test]
fn a_server_of_another_user_or_process_is_not_trusted() {
    let c = |pid, uid| libc::ucred { pid, uid, gid: uid };
    assert!(trusted_server(&c(10, 1000), 1000, None));
    assert!(trusted_server(&c(10, 0), 1000, None));
    assert!(trusted_server(&c(10, 1000), 1000, Some(10)));
    assert!(
        !trusted_server(&c(11, 1000), 1000, Some(10)),
        "another process"
    );
    assert!(!trusted_server(&c(10, 33), 1000, None), "another user");
    assert!(
        !trusted_server(&c(10, 33), 0, None),
        "another user, of a root receiver"
    );
}

/// A squatter of another user (a child that became uid 65534) holding the names `names`,
/// listening on those with `true`: its pid and the pipe that ends it when dropped.
fn squatter(names: &[(String, bool)]) -> Option<(i32, OwnedFd)> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipping: not root (no other user to squat as)");
        return None;
    }
    let addrs: Vec<_> = names
        .iter()
        .map(|(n, l)| (abstract_address(n), *l))
        .collect();
    let (ready_r, ready_w) = socketpair(libc::SOCK_STREAM);
    let (end_r, end_w) = socketpair(libc::SOCK_STREAM);
    // SAFETY: the child makes only system calls (close, setgid, setuid, socket, bind,
    // listen, write, read) and exits.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        // SAFETY: as above.
        unsafe {
            // (Raw system calls: the library's setuid hook is not what is tested here.)
            drop(ready_r);
            drop(end_w);
            let mut ok = libc::syscall(libc::SYS_setgid, 65534) == 0
                && libc::syscall(libc::SYS_setuid, 65534) == 0;
            for ((a, len), listen) in &addrs {
                let s = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                ok &= s >= 0
                    && libc::bind(s, (a as *const libc::sockaddr_un).cast(), *len) == 0
                    && (!listen || libc::listen(s, 4) == 0);
            }
            libc::write(ready_w.as_raw_fd(), [u8::from(ok)].as_ptr().cast(), 1);
            let mut b = [0u8];
            libc::read(end_r.as_raw_fd(), b.as_mut_ptr().cast(), 1);
            libc::_exit(0);
        }
    }
    drop(ready_w);
    drop(end_r);
    let mut b = [0u8];
    // SAFETY: our socket and buffer.
    let n = unsafe { libc::read(ready_r.as_raw_fd(), b.as_mut_ptr().cast(), 1) };
    assert_eq!((n, b[0]), (1, 1), "the squatter could not bind");
    Some((pid, end_w))
}

fn end_squatter((pid, end): (i32, OwnedFd)) {
    drop(end);
    let mut status = 0;
    // SAFETY: our child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
}

#[test]
fn a_name_held_by_another_user_is_refused_and_the_owner_is_found_under_it() {
    let _children = crate::TEST_CHILDREN
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    // Two connections: a squatter listens on the first one's name, only binds the second's.
    let (conn1, _peer1) = socketpair(libc::SOCK_STREAM);
    let (conn2, _peer2) = socketpair(libc::SOCK_STREAM);
    let ids =
        [conn1.as_raw_fd(), conn2.as_raw_fd()].map(|fd| table::socket_id(fd).expect("a socket"));
    let Some(sq) = squatter(&[(name_text(ids[0]), true), (name_text(ids[1]), false)]) else {
        return;
    };
    // The receiver's credential check: the squatter's server is refused (EACCES), not
    // asked; the one that only binds refuses the connect, and holds the name.
    let until = Instant::now() + LOOKUP_CONNECT_WAIT;
    assert_eq!(
        connect_cred(name(ids[0]), None, until).map(|_| ()),
        Err(libc::EACCES)
    );
    assert_eq!(
        connect_cred(name(ids[1]), None, until).map(|_| ()),
        Err(libc::ECONNREFUSED)
    );
    assert!(name_held(ids[1]));
    for (conn, id) in [(&conn1, ids[0]), (&conn2, ids[1])] {
        // The owner binds a random name under the connection's name.
        let (l, random) = listen(id).expect("the owner found no name");
        let random = random.expect("the owner bound the squatted name");
        assert!(random.starts_with(&format!("{}/", name_text(id))));
        assert!(candidates(id).contains(&random), "not in /proc/net/unix");
        // The owner answers there; the receiver finds it past the squatter.
        let e = Entry::new(Kind::Inherited(None));
        let _ = e.socket.set(id);
        assert!(table::set(conn.as_raw_fd(), e).is_ok());
        with_passed(|v| v.push(pass_record(id, l, true)));
        let lfd = with_passed(|v| {
            v.iter()
                .find(|p| p.id == id)
                .map(|p| p.listener.as_raw_fd())
        });
        let lfd = lfd.expect("the record");
        let owner = std::thread::spawn(move || {
            let mut p = libc::pollfd {
                fd: lfd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one pollfd; then accept on our listener.
            let c = unsafe {
                libc::poll(&mut p, 1, 10_000);
                libc::accept4(
                    lfd,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_CLOEXEC,
                )
            };
            assert!(c >= 0, "nobody came to the owner's name");
            // SAFETY: just accepted.
            let c = unsafe { OwnedFd::from_raw_fd(c) };
            let r = answer(c.as_raw_fd());
            if let Ok(Answer::Owner) = r {
                let mut b = [0u8; 9];
                b[1..].copy_from_slice(&nonce().to_le_bytes());
                // SAFETY: our socket and buffer.
                unsafe { libc::send(c.as_raw_fd(), b.as_ptr().cast(), 9, 0) };
            }
            r.map(|_| ())
        });
        let proof = tcp_dup(conn);
        let found = lookup(proof.as_raw_fd(), id, Instant::now() + LOOKUP_CONNECT_WAIT);
        let answered = owner.join().expect("the owner");
        with_passed(|v| v.retain(|p| p.id != id));
        let _ = table::take(conn.as_raw_fd());
        match answered {
            Err(e) if e == libc::ENOSYS || e == libc::EPERM => {
                eprintln!("skipping: kcmp unavailable (errno {e})");
                end_squatter(sq);
                return;
            }
            a => assert_eq!(a, Ok(())),
        }
        // SAFETY: getpid has no preconditions.
        let me = unsafe { libc::getpid() };
        let owner = found.expect("the receiver did not find the owner");
        assert_eq!((owner.pid, owner.nonce), (me, nonce()));
    }
    end_squatter(sq);
}

#[test]
fn a_pass_whose_send_failed_is_undone() {
    let (conn, _peer) = socketpair(libc::SOCK_STREAM);
    let id = table::socket_id(conn.as_raw_fd()).expect("a socket");
    let (s, r) = socketpair(libc::SOCK_STREAM);
    let record = |id| {
        with_passed(|v| {
            v.iter_mut().find(|p| p.id == id).map(|p| {
                let now = Instant::now();
                let flights: Vec<(bool, bool)> = p
                    .in_flight
                    .iter_mut()
                    .map(|f| (f.sending, f.stays(now, Duration::from_secs(60))))
                    .collect();
                (p.passes, flights)
            })
        })
    };
    // Noted before the send: in flight although nothing is queued yet (the sweep must not
    // take it for taken).
    let unix = note(id, Weak::new(), Some(tcp_dup(&s)), false).expect("noted");
    assert_eq!(record(id), Some((1, vec![(true, true)])));
    assert!(name_held(id), "the connection's name is not bound");
    // The send failed: no pass, no record, no name.
    sent(Noted(vec![Note::Own { id, unix }]), s.as_raw_fd(), false);
    assert_eq!(record(id), None, "a failed send still counts as a pass");
    assert!(!name_held(id), "the name stays bound");
    // Noted, sent: in flight while its message is queued, then taken.
    let unix = note(id, Weak::new(), Some(tcp_dup(&s)), false).expect("noted");
    send_with_fd(s.as_raw_fd(), PASS, Some(conn.as_raw_fd())).expect("send");
    sent(Noted(vec![Note::Own { id, unix }]), s.as_raw_fd(), true);
    assert_eq!(record(id), Some((1, vec![(false, true)])));
    let _ = recv_with_fds(r.as_raw_fd()).expect("recv");
    assert_eq!(record(id), Some((1, vec![(false, false)])));
    with_passed(|v| v.retain(|p| p.id != id));
}

#[test]
fn an_announced_pass_whose_send_failed_is_undone_by_its_owner() {
    // The owner's record of an announced pass (a copy of the holder's unix socket).
    let (conn, _peer, id) = inherited_conn();
    let (s, _r) = socketpair(libc::SOCK_STREAM);
    let (other, _o) = socketpair(libc::SOCK_STREAM);
    note(id, Weak::new(), Some(tcp_dup(&s)), true).expect("noted");
    // An announced pass not yet seen queued counts as being sent, for a while.
    let stays = with_passed(|v| {
        let f = &mut v.iter_mut().find(|p| p.id == id).expect("record").in_flight[0];
        (
            f.sending,
            f.stays(f.at, Duration::from_secs(60)),
            f.stays(f.at + SEND_WAIT, Duration::from_secs(60)),
        )
    });
    assert_eq!(stays, (true, true, false));
    // An undo naming another unix socket leaves it in flight; the holder's own undoes it.
    let undo = |unix: &OwnedFd| unannounced(&[tcp_dup(&conn), tcp_dup(unix)]);
    match undo(&other) {
        Err(e) if e == libc::ENOSYS || e == libc::EPERM => {
            eprintln!("skipping: kcmp unavailable (errno {e})");
            with_passed(|v| v.retain(|p| p.id != id));
            let _ = table::take(conn.as_raw_fd());
            return;
        }
        r => assert_eq!(r, Ok(())),
    }
    let left = with_passed(|v| {
        v.iter()
            .find(|p| p.id == id)
            .map(|p| (p.passes, p.in_flight.len()))
    });
    assert_eq!(
        left,
        Some((0, 1)),
        "another socket's undo took the pass in flight"
    );
    // This process's own pass through the same unix socket (a forked child's is its
    // parent's open file), then the child's undo: the child's pass goes, not the owner's.
    note(id, Weak::new(), Some(tcp_dup(&s)), false).expect("noted");
    assert_eq!(undo(&s), Ok(()));
    let left = with_passed(|v| {
        v.iter()
            .find(|p| p.id == id)
            .map(|p| p.in_flight.iter().map(|f| f.told).collect::<Vec<_>>())
    });
    assert_eq!(
        left,
        Some(vec![false]),
        "a holder's undo took the owner's own pass"
    );
    let unix = with_passed(|v| {
        v.iter()
            .find(|p| p.id == id)
            .map_or(-1, |p| p.in_flight[0].unix.as_raw_fd())
    });
    sent(Noted(vec![Note::Own { id, unix }]), s.as_raw_fd(), false);
    // The holder's own: the pass in flight goes, and the record with it (no pass left).
    note(id, Weak::new(), Some(tcp_dup(&s)), true).expect("noted");
    assert_eq!(undo(&s), Ok(()));
    assert!(
        with_passed(|v| v.iter().all(|p| p.id != id)),
        "the record stays"
    );
    let _ = table::take(conn.as_raw_fd());
}

#[test]
fn a_name_let_go_by_its_squatter_is_bound_by_the_owner() {
    let _children = crate::TEST_CHILDREN
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let (conn, _peer) = socketpair(libc::SOCK_STREAM);
    let id = table::socket_id(conn.as_raw_fd()).expect("a socket");
    let Some(sq) = squatter(&[(name_text(id), true)]) else {
        return;
    };
    let (l, random) = listen(id).expect("the owner found no name");
    assert!(random.is_some());
    with_passed(|v| v.push(pass_record(id, l, true)));
    // Still held: nothing to retake, and the server looks again every sweep.
    assert!(!retake().contains(&id.1));
    assert!(to_retake());
    end_squatter(sq);
    // Let go: the owner binds it, and a receiver that asks there finds this process.
    assert!(retake().contains(&id.1));
    let until = Instant::now() + LOOKUP_CONNECT_WAIT;
    let (_s, pid) = connect_cred(name(id), None, until).expect("the connection's name");
    // SAFETY: getpid has no preconditions.
    assert_eq!(pid, unsafe { libc::getpid() });
    assert!(!retake().contains(&id.1), "bound twice");
    with_passed(|v| v.retain(|p| p.id != id));
}

/// A listening abstract unix socket on `n` (nonblocking) that never accepts: a server that
/// never answers.
fn silent_server(n: &str) -> OwnedFd {
    listen_at(n).expect("the name")
}

/// Whether `l` has a connection waiting to be accepted (taken and dropped).
fn came(l: &OwnedFd) -> bool {
    // SAFETY: our nonblocking listener.
    let c = unsafe {
        libc::accept4(
            l.as_raw_fd(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            libc::SOCK_CLOEXEC,
        )
    };
    if c >= 0 {
        // SAFETY: just accepted.
        drop(unsafe { OwnedFd::from_raw_fd(c) });
    }
    c >= 0
}

#[test]
fn a_lookup_past_its_time_asks_nobody_and_a_silent_server_is_not_an_owner() {
    let (conn, _peer) = socketpair(libc::SOCK_STREAM);
    let id = table::socket_id(conn.as_raw_fd()).expect("a socket");
    let l = silent_server(&name_text(id));
    // The time of the `recvmsg` is out (earlier descriptors took it): nobody is asked.
    assert_eq!(
        lookup(conn.as_raw_fd(), id, Instant::now()).map(|_| ()),
        Err(libc::ETIMEDOUT)
    );
    assert!(!came(&l), "asked past its time");
    // A server of this user that never answers: no owner, within the time given.
    let r = lookup(
        conn.as_raw_fd(),
        id,
        Instant::now() + Duration::from_millis(100),
    );
    assert!(r.is_err(), "a silent server is an owner");
    assert!(came(&l), "not asked");
}

#[test]
fn a_received_listening_socket_is_not_looked_up() {
    // A listening TCP socket whose name a server holds: not a connection, not asked. (The
    // system calls themselves: the library's hooks of socket, listen and close, linked into
    // this test, are not what is tested.)
    // SAFETY: a new socket of ours, bound to loopback (any port) and listening, then closed.
    let t = unsafe {
        libc::syscall(
            libc::SYS_socket,
            libc::AF_INET,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            0,
        )
    } as c_int;
    assert!(t >= 0);
    // SAFETY: as above.
    let ok = unsafe {
        let mut a: libc::sockaddr_in = std::mem::zeroed();
        a.sin_family = libc::AF_INET as libc::sa_family_t;
        a.sin_addr.s_addr = u32::from_ne_bytes([127, 0, 0, 1]);
        libc::syscall(
            libc::SYS_bind,
            t,
            &a as *const libc::sockaddr_in,
            std::mem::size_of::<libc::sockaddr_in>(),
        ) == 0
            && real::listen(t, 1) == 0
    };
    assert!(ok, "listen: {}", io::Error::last_os_error());
    let id = table::socket_id(t).expect("a socket");
    let l = silent_server(&name_text(id));
    received(&[t]);
    let asked = came(&l);
    // SAFETY: ours.
    unsafe { real::close(t) };
    assert!(!asked, "a listening socket was looked up");
}

#[test]
fn a_control_buffer_with_a_huge_cmsg_len_ends_the_walk() {
    // Two headers: one SCM_RIGHTS with one descriptor, then one whose `cmsg_len` is near
    // usize::MAX (its alignment wraps: the next header would be itself).
    let mut buf = [0u64; 16];
    let hdr = std::mem::size_of::<libc::cmsghdr>();
    // SAFETY: CMSG_LEN and CMSG_SPACE are arithmetic.
    let (len1, space1) = unsafe { (libc::CMSG_LEN(4), libc::CMSG_SPACE(4)) };
    let base = buf.as_mut_ptr().cast::<u8>();
    // SAFETY: both headers and the descriptor lie within `buf` (128 bytes).
    unsafe {
        let c = base.cast::<libc::cmsghdr>();
        (*c).cmsg_len = len1 as _;
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        libc::CMSG_DATA(c).cast::<c_int>().write_unaligned(7);
        let d = base.add(space1 as usize).cast::<libc::cmsghdr>();
        (*d).cmsg_len = (usize::MAX - 3) as _;
        (*d).cmsg_level = libc::SOL_SOCKET;
        (*d).cmsg_type = libc::SCM_RIGHTS;
    }
    assert!(space1 as usize + hdr <= std::mem::size_of_val(&buf));
    // SAFETY: zeroed is a valid msghdr.
    let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
    m.msg_control = base.cast();
    m.msg_controllen = std::mem::size_of_val(&buf) as _;
    // SAFETY: the control buffer is `msg_controllen` bytes.
    assert_eq!(unsafe { rights(&m) }, vec![7]);
    // The huge header first: nothing, and an end.
    m.msg_control = base.wrapping_add(space1 as usize).cast();
    m.msg_controllen = (std::mem::size_of_val(&buf) - space1 as usize) as _;
    // SAFETY: as above.
    assert_eq!(unsafe { rights(&m) }, Vec::<c_int>::new());
}

/// A pass record of connection `id` as the owner notes it at its first pass.
fn pass_record(id: (u64, u64), listener: OwnedFd, random: bool) -> Passed {
    Passed {
        id,
        listener,
        random,
        retaken: None,
        conn: Weak::new(),
        in_flight: Vec::new(),
        passes: 1,
        lookups: 0,
        drained: None,
        receivers: Vec::new(),
    }
}
