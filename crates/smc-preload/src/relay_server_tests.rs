//! Unit tests of `relay_server.rs` (no requester holds up another; who may wait).

use super::*;

/// A listening abstract unix socket of this test (nonblocking, as the server's) and its
/// address.
fn listener(tag: &str) -> (OwnedFd, (libc::sockaddr_un, libc::socklen_t)) {
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    let addr = abstract_address(&format!("smc-rs-test/{me}/{tag}/{:x}", nonce()));
    let s = unix_stream();
    // SAFETY: the address and its length; plain listen.
    let ok = unsafe {
        libc::bind(
            s.as_raw_fd(),
            (&addr.0 as *const libc::sockaddr_un).cast(),
            addr.1,
        ) == 0
            && libc::listen(s.as_raw_fd(), 16) == 0
    };
    assert!(ok, "bind: {}", io::Error::last_os_error());
    set_nonblocking(s.as_raw_fd(), true);
    (s, addr)
}

/// A new unix stream socket of this test.
fn unix_stream() -> OwnedFd {
    // SAFETY: a new socket of ours.
    let s = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(s >= 0);
    // SAFETY: just made.
    unsafe { OwnedFd::from_raw_fd(s) }
}

fn connect(addr: &(libc::sockaddr_un, libc::socklen_t)) -> OwnedFd {
    let s = unix_stream();
    // SAFETY: the address and its length.
    let r = unsafe {
        libc::connect(
            s.as_raw_fd(),
            (&addr.0 as *const libc::sockaddr_un).cast(),
            addr.1,
        )
    };
    assert_eq!(r, 0, "connect: {}", io::Error::last_os_error());
    s
}

/// What `s` has to read without waiting: `Some(bytes)` (empty: the end of stream), `None`:
/// nothing yet.
fn pending(s: &OwnedFd) -> Option<Vec<u8>> {
    let mut b = [0u8; 16];
    // SAFETY: our socket and buffer.
    let r = unsafe {
        libc::recv(
            s.as_raw_fd(),
            b.as_mut_ptr().cast(),
            b.len(),
            libc::MSG_DONTWAIT,
        )
    };
    if r < 0 {
        let e = last_errno();
        assert_eq!(e, libc::EAGAIN, "recv: errno {e}");
        return None;
    }
    Some(b[..r as usize].to_vec())
}

#[test]
fn a_requester_that_sends_nothing_holds_up_no_other() {
    let (l, addr) = listener("slow");
    // First in the backlog: one that connects and sends nothing (it could be anyone's,
    // when the owner runs as root).
    let slow = connect(&addr);
    // Then one whose request is there: a look-up with no proof (refused: EPROTO).
    let fast = connect(&addr);
    send_with_fds(fast.as_raw_fd(), pass::LOOKUP, &[]).expect("send");
    let mut r = Requests::default();
    // The server's rounds until the quick one is answered (each round waits at most 50 ms
    // for news; the bound is on rounds, not on time).
    let mut answered = None;
    for _ in 0..200 {
        r.round(&[l.as_raw_fd()], &mut [], 50);
        answered = pending(&fast);
        if answered.is_some() {
            break;
        }
    }
    assert_eq!(
        answered,
        Some(vec![libc::EPROTO as u8]),
        "the quick request was not answered"
    );
    // The silent one was not answered (nor refused for its silence) meanwhile: it still
    // waits, beside the server, not in front of it.
    assert_eq!(pending(&slow), None, "the silent requester held the server");
    assert_eq!(r.len(), 1);
    // Its bytes come late, within its time: answered then.
    send_with_fds(slow.as_raw_fd(), pass::LOOKUP, &[]).expect("send");
    let mut late = None;
    for _ in 0..200 {
        r.round(&[l.as_raw_fd()], &mut [], 50);
        late = pending(&slow);
        if late.is_some() {
            break;
        }
    }
    assert_eq!(late, Some(vec![libc::EPROTO as u8]));
    assert_eq!(r.len(), 0);
}

#[test]
fn a_requester_silent_past_its_time_is_dropped() {
    let (l, addr) = listener("overdue");
    let slow = connect(&addr);
    let mut r = Requests::default();
    let now = Instant::now();
    for _ in 0..200 {
        r.accept(l.as_raw_fd(), now);
        if r.len() == 1 {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(r.len(), 1);
    r.expire(now + REQUEST_WAIT - Duration::from_millis(1));
    assert_eq!(r.len(), 1, "dropped before its time");
    assert_eq!(pending(&slow), None);
    r.expire(now + REQUEST_WAIT);
    assert_eq!(r.len(), 0);
    // Dropped: the requester reads the end of stream.
    assert_eq!(pending(&slow), Some(Vec::new()));
}

#[test]
fn who_may_wait_for_the_server() {
    let cred = |pid, uid| Some(libc::ucred { pid, uid, gid: uid });
    let none = std::iter::empty::<libc::uid_t>;
    // An owner of uid 1000: its own user may ask, nobody else (root neither: the relay's
    // rule, the same user, or an owner running as root).
    assert!(admit(none(), cred(7, 1000), 1000).is_ok());
    assert_eq!(
        admit(none(), cred(7, 0), 1000).map(|_| ()),
        Err(libc::EACCES)
    );
    assert_eq!(
        admit(none(), cred(7, 1001), 1000).map(|_| ()),
        Err(libc::EACCES)
    );
    assert_eq!(admit(none(), None, 1000).map(|_| ()), Err(libc::EACCES));
    // A root owner: anyone, but one other user holds at most MAX_WAITING_OF_USER places.
    let full = || std::iter::repeat_n(33, MAX_WAITING_OF_USER);
    assert_eq!(admit(full(), cred(7, 33), 0).map(|_| ()), Err(libc::EAGAIN));
    assert!(
        admit(full(), cred(7, 34), 0).is_ok(),
        "another user is not held up"
    );
    assert!(admit(full(), cred(7, 0), 0).is_ok(), "root is not held up");
    // Nobody beyond MAX_WAITING.
    let all = || std::iter::repeat_n(0, MAX_WAITING);
    assert_eq!(admit(all(), cred(7, 0), 0).map(|_| ()), Err(libc::EAGAIN));
    assert!(admit(std::iter::repeat_n(0, MAX_WAITING - 1), cred(7, 0), 0).is_ok());
}

#[test]
fn many_other_users_leave_places_for_the_owner_s_user_and_root() {
    let cred = |pid, uid| Some(libc::ucred { pid, uid, gid: uid });
    // A root owner. Sixteen other uids (one user's subordinate ids), each up to its own
    // bound, until refused: together they fill no more than their share.
    let mut waiting: Vec<libc::uid_t> = Vec::new();
    for uid in 100_000..100_016 {
        while admit(waiting.iter().copied(), cred(7, uid), 0).is_ok() {
            waiting.push(uid);
        }
    }
    assert_eq!(
        waiting.len(),
        MAX_WAITING_OF_OTHERS,
        "the others together are not bounded"
    );
    // Root (this owner's user) still gets every other place.
    for _ in MAX_WAITING_OF_OTHERS..MAX_WAITING {
        assert!(
            admit(waiting.iter().copied(), cred(8, 0), 0).is_ok(),
            "no place left for root"
        );
        waiting.push(0);
    }
    assert_eq!(
        admit(waiting.iter().copied(), cred(8, 0), 0).map(|_| ()),
        Err(libc::EAGAIN)
    );
    // An owner of uid 1000: its own user's requests are not counted among the others.
    let mine = std::iter::repeat_n(1000, MAX_WAITING_OF_OTHERS);
    assert!(admit(mine, cred(9, 1000), 1000).is_ok());
}

#[test]
fn the_server_wakes_while_a_name_is_to_be_retaken() {
    // Nothing to look at: the server sleeps until a request.
    assert_eq!(poll_timeout(false, false, false), -1);
    // A passed connection's name held by another socket: looked at every sweep, so that a
    // name let go is bound before the next request.
    assert_eq!(
        poll_timeout(false, false, true),
        keep::SWEEP.as_millis() as c_int
    );
    assert_eq!(
        poll_timeout(false, true, false),
        keep::SWEEP.as_millis() as c_int
    );
    assert_eq!(
        poll_timeout(true, false, true),
        pass::TICK.as_millis() as c_int
    );
}
