//! What the roce backend needs to know about a network interface: its IPv4 and IPv6 addresses
//! (the GIDs), MAC, MTU and whether it is up. Read with `getifaddrs` and interface ioctls, which answer for
//! the network namespace of the calling thread (unlike `/sys/class/net`, which shows the
//! namespace sysfs was mounted in).

use std::ffi::{CStr, CString};
use std::net::{Ipv4Addr, Ipv6Addr};

use rustix::fd::{AsRawFd, BorrowedFd};

/// Addresses and link facts of one interface.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct NetdevInfo {
    /// IPv4 addresses, first one first, with their prefix lengths.
    pub(crate) ipv4: Vec<Ipv4Addr>,
    /// Prefix length of each of `ipv4`.
    pub(crate) ipv4_prefix: Vec<u8>,
    /// IPv6 addresses.
    pub(crate) ipv6: Vec<Ipv6Addr>,
    /// Prefix length of each of `ipv6`.
    pub(crate) ipv6_prefix: Vec<u8>,
    /// Hardware address (zero for interfaces without one, such as loopback).
    pub(crate) mac: [u8; 6],
    /// Whether the interface exists at all.
    pub(crate) exists: bool,
}

/// Addresses and MAC of `name` from `getifaddrs`.
pub(crate) fn info(name: &str) -> std::io::Result<NetdevInfo> {
    let mut out = NetdevInfo::default();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head into `head` on success; freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut p = head;
    while !p.is_null() {
        // SAFETY: `p` is a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*p };
        p = ifa.ifa_next;
        if ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let n = unsafe { CStr::from_ptr(ifa.ifa_name) };
        if n.to_bytes() != name.as_bytes() {
            continue;
        }
        out.exists = true;
        if ifa.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: ifa_addr points to a sockaddr whose family says which struct it is.
        let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
        match family {
            libc::AF_INET => {
                // SAFETY: family AF_INET means a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                out.ipv4
                    .push(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)));
                let prefix = if ifa.ifa_netmask.is_null() {
                    32
                } else {
                    // SAFETY: the netmask of an AF_INET address is a sockaddr_in.
                    let m = unsafe { &*(ifa.ifa_netmask as *const libc::sockaddr_in) };
                    u32::from_be(m.sin_addr.s_addr).count_ones() as u8
                };
                out.ipv4_prefix.push(prefix);
            }
            libc::AF_INET6 => {
                // SAFETY: family AF_INET6 means a sockaddr_in6.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                out.ipv6.push(Ipv6Addr::from(sin6.sin6_addr.s6_addr));
                let prefix = if ifa.ifa_netmask.is_null() {
                    128
                } else {
                    // SAFETY: the netmask of an AF_INET6 address is a sockaddr_in6.
                    let m = unsafe { &*(ifa.ifa_netmask as *const libc::sockaddr_in6) };
                    u128::from_be_bytes(m.sin6_addr.s6_addr).count_ones() as u8
                };
                out.ipv6_prefix.push(prefix);
            }
            libc::AF_PACKET => {
                // SAFETY: family AF_PACKET means a sockaddr_ll.
                let sll = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_ll) };
                if sll.sll_halen == 6 {
                    out.mac.copy_from_slice(&sll.sll_addr[..6]);
                }
            }
            _ => {}
        }
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

impl NetdevInfo {
    /// The IPv6 addresses that become RoCEv2 GIDs of a device on this interface, with their
    /// prefix lengths, in the interface's order: global and unique-local unicast addresses.
    /// Link-local addresses (`fe80::/10`) are left out: a GID has no room for the scope (the
    /// interface) a link-local address needs, the one interface is already named by the
    /// device, and Linux SMC-R skips them too (rocev2.md 11.1). So are loopback, multicast,
    /// unspecified and IPv4-mapped addresses.
    pub(crate) fn ipv6_gids(&self) -> Vec<(Ipv6Addr, u8)> {
        self.ipv6
            .iter()
            .zip(
                self.ipv6_prefix
                    .iter()
                    .copied()
                    .chain(std::iter::repeat(64)),
            )
            .filter(|(a, _)| ipv6_gid_candidate(**a))
            .map(|(a, p)| (*a, p))
            .collect()
    }
}

/// Whether an interface's IPv6 address may be a GID (see [`NetdevInfo::ipv6_gids`]).
pub(crate) fn ipv6_gid_candidate(a: Ipv6Addr) -> bool {
    let link_local = a.segments()[0] & 0xFFC0 == 0xFE80;
    !(a.is_loopback()
        || a.is_unspecified()
        || a.is_multicast()
        || link_local
        || a.to_ipv4_mapped().is_some())
}

fn ifreq(name: &str) -> Option<libc::ifreq> {
    let c = CString::new(name).ok()?;
    let bytes = c.as_bytes_with_nul();
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    if bytes.len() > req.ifr_name.len() {
        return None;
    }
    for (d, s) in req.ifr_name.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    Some(req)
}

/// The interface's MTU (`SIOCGIFMTU` on any socket of the namespace).
pub(crate) fn mtu(sock: BorrowedFd<'_>, name: &str) -> Option<u32> {
    let mut req = ifreq(name)?;
    // SAFETY: SIOCGIFMTU reads the name and writes ifru_mtu of the ifreq we own.
    let r = unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFMTU, &mut req) };
    if r != 0 {
        return None;
    }
    // SAFETY: on success the kernel filled the mtu member of the union.
    Some(unsafe { req.ifr_ifru.ifru_mtu } as u32)
}

/// Whether the interface is administratively up and has a carrier (`IFF_UP` and
/// `IFF_RUNNING`): a veth whose peer is down, or that was set down itself, is not.
pub(crate) fn is_up(sock: BorrowedFd<'_>, name: &str) -> bool {
    let Some(mut req) = ifreq(name) else {
        return false;
    };
    // SAFETY: SIOCGIFFLAGS reads the name and writes ifru_flags of the ifreq we own.
    let r = unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) };
    if r != 0 {
        return false;
    }
    // SAFETY: on success the kernel filled the flags member of the union.
    let flags = i32::from(unsafe { req.ifr_ifru.ifru_flags });
    flags & libc::IFF_UP != 0 && flags & libc::IFF_RUNNING != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_found() {
        let i = info("lo").expect("getifaddrs");
        assert!(i.exists);
        assert!(i.ipv4.contains(&Ipv4Addr::LOCALHOST), "{i:?}");
        let s = std::net::UdpSocket::bind("127.0.0.1:0").expect("socket");
        use rustix::fd::AsFd;
        assert!(mtu(s.as_fd(), "lo").is_some_and(|m| m >= 1500));
        assert!(is_up(s.as_fd(), "lo"));
        assert!(!is_up(s.as_fd(), "no-such-if0"));
        assert!(!info("no-such-if0").expect("getifaddrs").exists);
        // `::1` (when lo has it) is never a GID.
        assert!(i.ipv6_gids().is_empty(), "{i:?}");
    }

    #[test]
    fn ipv6_gids_are_global_and_unique_local_only() {
        let i = NetdevInfo {
            ipv6: [
                "fe80::5054:ff:fe00:1",
                "fd00::1",
                "::1",
                "2001:db8::7",
                "ff02::1",
                "::ffff:10.0.0.1",
                "::",
                "febf::1",
            ]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect(),
            ipv6_prefix: vec![64, 64, 128, 48, 8, 96, 0, 10],
            exists: true,
            ..NetdevInfo::default()
        };
        let want: Vec<(Ipv6Addr, u8)> = vec![
            ("fd00::1".parse().unwrap(), 64),
            ("2001:db8::7".parse().unwrap(), 48),
        ];
        assert_eq!(i.ipv6_gids(), want);
    }
}
