//! The `connect` hook: a client connection's TCP connect, discovery and CLC rendezvous, or
//! its Decline when the destination is a listener of this process; a rendezvous whose
//! server has not answered within the connect wait goes on in `connecting.rs`.

use std::net::SocketAddr;

use libc::{c_int, sockaddr, socklen_t};
use smc::fdapi;

use crate::hooks::{bfd, blocking, install, is_inet_stream, sockaddr_of};
use crate::table;
use crate::{errno_of, guard, log, real, set_errno};

#[no_mangle]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    // SAFETY: the caller's address.
    let Some(to) = (unsafe { sockaddr_of(addr, len) }) else {
        // SAFETY: passed on unchanged.
        return unsafe { real::connect(fd, addr, len) };
    };
    if table::maybe(fd) || !is_inet_stream(fd) {
        // SAFETY: passed on unchanged.
        return unsafe { real::connect(fd, addr, len) };
    }
    if let Err(e) = fdapi::stack() {
        // No stack (fabric directory, resources): the program gets its TCP connection.
        log!("fd {fd}: no SMC-R stack ({e}); plain TCP");
        // SAFETY: passed on unchanged.
        return unsafe { real::connect(fd, addr, len) };
    }
    guard(-1, || {
        let own = own_listener(to);
        let wait = crate::connecting::connect_wait();
        let (r, nb) = blocking(fd, || fdapi::connect_start(bfd(fd), to, own, wait));
        match r {
            Ok(fdapi::Connecting::Done(setup)) => {
                install(fd, setup, nb);
                0
            }
            // The server has not answered the Proposal yet (`connecting.rs`).
            Ok(fdapi::Connecting::Waiting(h)) => match crate::connecting::started(fd, h) {
                Ok(()) => 0,
                Err(mut h) => match h.advance(None) {
                    Ok(Some(setup)) => {
                        install(fd, setup, nb);
                        0
                    }
                    Ok(None) => 0,
                    Err(e) => {
                        log!("fd {fd}: connect to {to}: {e}");
                        set_errno(errno_of(&e));
                        -1
                    }
                },
            },
            Err(e) => {
                log!("fd {fd}: connect to {to}: {e}");
                set_errno(errno_of(&e));
                -1
            }
        }
    })
}

/// Whether `to` is the address of a listening socket of this process (the same port, and the
/// same address or a listener on the unspecified address).
fn own_listener(to: SocketAddr) -> bool {
    table::listeners().into_iter().any(|l| {
        // SAFETY: zeroed storage is a valid sockaddr_storage.
        let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_storage>() as socklen_t;
        // SAFETY: the storage and its length.
        let r = unsafe {
            libc::getsockname(l, (&mut ss as *mut libc::sockaddr_storage).cast(), &mut len)
        };
        // SAFETY: what getsockname filled in, of `len` bytes.
        let a = (r == 0)
            .then(|| unsafe { sockaddr_of((&ss as *const libc::sockaddr_storage).cast(), len) });
        a.flatten().is_some_and(|a| {
            a.port() == to.port()
                && (a.ip() == to.ip() || (a.ip().is_unspecified() && is_local_address(to.ip())))
        })
    })
}

/// Whether `ip` is an address of this host (a loopback address, or one of an interface's).
fn is_local_address(ip: std::net::IpAddr) -> bool {
    if ip.is_loopback() {
        return true;
    }
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills in a list that freeifaddrs releases.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return false;
    }
    let mut found = false;
    let mut at = list;
    while !at.is_null() {
        // SAFETY: an entry of the list.
        let e = unsafe { &*at };
        if !e.ifa_addr.is_null() {
            let len = match c_int::from(
                // SAFETY: the entry's address.
                unsafe { (*e.ifa_addr).sa_family },
            ) {
                libc::AF_INET => std::mem::size_of::<libc::sockaddr_in>(),
                libc::AF_INET6 => std::mem::size_of::<libc::sockaddr_in6>(),
                _ => 0,
            };
            // SAFETY: an address of its family's length.
            if len > 0
                && unsafe { sockaddr_of(e.ifa_addr, len as socklen_t) }
                    .is_some_and(|a| a.ip() == ip)
            {
                found = true;
                break;
            }
        }
        at = e.ifa_next;
    }
    // SAFETY: the list getifaddrs made.
    unsafe { libc::freeifaddrs(list) };
    found
}
