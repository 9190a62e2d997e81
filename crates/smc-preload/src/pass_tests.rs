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

#[test]
fn a_lookup_names_the_owner_and_notes_the_receiver() {
    // A socket of "the connection", named in the table as a number of this process, and
    // its record as a passed connection.
    let (conn, _peer) = socketpair(libc::SOCK_STREAM);
    let id = table::socket_id(conn.as_raw_fd()).expect("a socket");
    let e = Entry::new(Kind::Inherited(None));
    let _ = e.socket.set(id);
    assert!(table::set(conn.as_raw_fd(), e).is_ok());
    let (l, _) = socketpair(libc::SOCK_STREAM);
    with_passed(|v| {
        v.push(Passed {
            id,
            listener: l,
            conn: Weak::new(),
            in_flight: Vec::new(),
            passes: 1,
            lookups: 0,
            drained: None,
            receivers: Vec::new(),
        })
    });
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
