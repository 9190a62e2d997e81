//! The program's calls on a relayed connection (a part of `relay.rs`): the simple ones are
//! made on [`Relay::fd`] by the hooks themselves; these differ from TCP's only where a
//! byte-stream relay cannot carry what TCP would (urgent data, descriptors).

use super::*;

/// recv on a relayed connection: the relay socket's, but urgent data does not cross a relay
/// (EINVAL, as TCP without urgent data pending).
pub(crate) unsafe fn recv(r: &Relay, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    if flags & libc::MSG_OOB != 0 {
        crate::set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: the caller's buffer of `n` bytes.
    unsafe { real::recv(r.fd(), buf, n, flags) }
}

/// recv into `bufs` on a relayed connection (a read redone there, see `hooks::smc_recv`).
pub(crate) fn recv_bufs(r: &Relay, bufs: &mut [&mut [u8]], flags: c_int) -> ssize_t {
    if flags & libc::MSG_OOB != 0 {
        crate::set_errno(libc::EINVAL);
        return -1;
    }
    let mut iov: Vec<libc::iovec> = bufs
        .iter_mut()
        .map(|b| libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: b.len(),
        })
        .collect();
    // SAFETY: zeroed is a valid msghdr.
    let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
    m.msg_iov = iov.as_mut_ptr();
    m.msg_iovlen = iov.len() as _;
    // SAFETY: iovecs over the caller's buffers, on the relay socket.
    unsafe { real::recvmsg(r.fd(), &mut m, flags) }
}

/// recvmsg on a relayed connection: no address (a connected stream fills in none, as TCP).
pub(crate) unsafe fn recvmsg(r: &Relay, msg: *mut libc::msghdr, flags: c_int) -> ssize_t {
    if msg.is_null() {
        crate::set_errno(libc::EFAULT);
        return -1;
    }
    if flags & libc::MSG_OOB != 0 {
        crate::set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: the caller's message header, its iovecs and control buffer as given.
    unsafe {
        let name = (*msg).msg_name;
        (*msg).msg_name = std::ptr::null_mut();
        (*msg).msg_namelen = 0;
        let got = real::recvmsg(r.fd(), msg, flags);
        (*msg).msg_name = name;
        got
    }
}

/// send on a relayed connection (urgent data: EOPNOTSUPP, see [`oob`]).
pub(crate) unsafe fn send(r: &Relay, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    if flags & libc::MSG_OOB != 0 {
        return oob();
    }
    // SAFETY: the caller's buffer of `n` bytes.
    unsafe { real::send(r.fd(), buf, n, flags) }
}

/// sendmsg on a relayed connection: the address is ignored (a connected stream, as TCP);
/// control data (SCM_RIGHTS) and urgent data give EOPNOTSUPP.
pub(crate) unsafe fn sendmsg(r: &Relay, msg: *const libc::msghdr, flags: c_int) -> ssize_t {
    if msg.is_null() {
        crate::set_errno(libc::EFAULT);
        return -1;
    }
    // SAFETY: the caller's message header.
    let mut m = unsafe { msg.read_unaligned() };
    if m.msg_controllen > 0 {
        log!("sendmsg with control data on a relayed SMC-R connection: EOPNOTSUPP");
        crate::set_errno(libc::EOPNOTSUPP);
        return -1;
    }
    if flags & libc::MSG_OOB != 0 {
        return oob();
    }
    m.msg_name = std::ptr::null_mut();
    m.msg_namelen = 0;
    // SAFETY: the caller's iovecs, on the relay socket.
    unsafe { real::sendmsg(r.fd(), &m, flags) }
}

/// Urgent data (MSG_OOB) on a relayed connection: not carried (a byte stream relay has no
/// urgent pointer); EOPNOTSUPP, logged.
fn oob() -> ssize_t {
    log!("send(MSG_OOB) on a relayed SMC-R connection: EOPNOTSUPP");
    crate::set_errno(libc::EOPNOTSUPP);
    -1
}
