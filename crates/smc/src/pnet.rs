//! The PNET table: which fabric devices (RNICs) serve which network interfaces.
//!
//! RFC 7609 requires the RoCE path of a connection to be on the same physical network as its
//! TCP path: a link group is built only from RNICs that reach the peer on the LAN the TCP
//! connection uses. As in Linux, smc-rs names that relation a PNET table: each fabric device
//! lists the network interfaces (netdevs) and IP addresses it serves, in the device
//! configuration (`SMC_FABRIC_DEVICES=shm0=lo+127.0.0.1,shm1=eth1`, or `devices` in the TOML
//! file). A device that lists neither serves every interface (the default `shm0`, `shm1`).
//!
//! For every connection the stack looks up the interface holding the TCP socket's local
//! address; the devices serving that interface or address form the connection's device set.
//! With none, the connection falls back to TCP with Decline "no SMC-R device found"
//! (0x03030002), sent by whichever side found no device.
//!
//! A roce device with IPv6 GIDs is one endpoint device (a "port") per GID. Of each device
//! serving a connection, one port goes into its set: over an IPv6 TCP connection the port of
//! the IPv6 GID equal to the local address, else of the device's first IPv6 GID, else (a
//! device without one) its IPv4-mapped GID; over IPv4 the IPv4-mapped GID. A server then
//! re-expresses the set in the kind of GID the client proposed (`Resources::port_for`), so an
//! IPv4-mapped-only client is still answered, and declines with "no SMC-R device found" when
//! no serving device has a GID of that kind.

use std::net::IpAddr;

use smc_fabric::config::DeviceConfig;
use smc_proto::fabric::{DeviceId, DeviceSet};

/// One row of the PNET table as `smc pnet` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PnetEntry {
    /// Fabric device name.
    pub device: String,
    /// Network interfaces it serves (empty with `addresses` empty: every interface).
    pub netdevs: Vec<String>,
    /// IP addresses it serves.
    pub addresses: Vec<IpAddr>,
}

impl PnetEntry {
    /// Whether the device serves a connection whose local address is `local` on interface
    /// `netdev`.
    pub fn serves(&self, netdev: Option<&str>, local: IpAddr) -> bool {
        (self.netdevs.is_empty() && self.addresses.is_empty())
            || self.addresses.contains(&local)
            || netdev.is_some_and(|n| self.netdevs.iter().any(|d| d == n))
    }
}

/// The PNET table of a device list, in the order the stack opened the devices (the order of
/// the endpoint's device indexes).
pub fn table(names: &[String], configs: &[DeviceConfig]) -> Vec<PnetEntry> {
    names
        .iter()
        .map(|n| {
            let c = configs.iter().find(|c| &c.name == n);
            PnetEntry {
                device: n.clone(),
                netdevs: c.map(|c| c.netdevs.clone()).unwrap_or_default(),
                addresses: c.map(|c| c.addresses.clone()).unwrap_or_default(),
            }
        })
        .collect()
}

/// The devices of `table` serving a connection with local address `local` on `netdev`.
pub fn device_set(table: &[PnetEntry], netdev: Option<&str>, local: IpAddr) -> DeviceSet {
    DeviceSet::from_ids(
        table
            .iter()
            .enumerate()
            .filter(|(_, e)| e.serves(netdev, local))
            .filter_map(|(i, _)| u8::try_from(i).ok().map(DeviceId)),
    )
}

/// The endpoint's devices (ports, `(fabric device, GID)` by `DeviceId`) for a connection with
/// local address `local` served by the fabric devices in `serving`: one port per serving
/// device, of the local address's IP version where the device has one (see the module docs).
pub fn ports_for(
    ports: &[(usize, smc_fabric::Gid)],
    serving: DeviceSet,
    local: IpAddr,
) -> DeviceSet {
    let v6 = match local {
        IpAddr::V6(a) if a.to_ipv4_mapped().is_none() => Some(a),
        _ => None,
    };
    let is_v4 = |g: &smc_fabric::Gid| std::net::Ipv6Addr::from(g.0).to_ipv4_mapped().is_some();
    let mut out = DeviceSet::EMPTY;
    let mut devs: Vec<usize> = ports.iter().map(|p| p.0).collect();
    devs.dedup();
    for dev in devs {
        if u8::try_from(dev).map_or(true, |d| !serving.contains(DeviceId(d))) {
            continue;
        }
        let mine = || ports.iter().enumerate().filter(|(_, p)| p.0 == dev);
        let pick = v6
            .and_then(|a| {
                mine()
                    .find(|(_, p)| p.1 .0 == a.octets())
                    .or_else(|| mine().find(|(_, p)| !is_v4(&p.1)))
            })
            .or_else(|| mine().next());
        if let Some(id) = pick.and_then(|(i, _)| u8::try_from(i).ok()) {
            out.insert(DeviceId(id));
        }
    }
    out
}

/// Whether the device set of a connection under `table` depends on its network interface
/// (some device serves only listed interfaces).
pub fn needs_interface(table: &[PnetEntry]) -> bool {
    table.iter().any(|e| !e.netdevs.is_empty())
}

/// The network interface holding address `local` (`None` when no interface has it).
pub fn interface_of(local: IpAddr) -> Option<String> {
    let local = match local {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(local),
        v4 => v4,
    };
    if_addrs::get_if_addrs()
        .ok()?
        .into_iter()
        .find(|i| i.ip() == local)
        .map(|i| i.name)
}

impl crate::Stack {
    /// The stack's PNET table: every fabric device it opened, with the interfaces and
    /// addresses it serves.
    pub fn pnet_table(&self) -> Vec<PnetEntry> {
        let fabric = &self.config().fabric;
        table(&smc_fabric::list_devices(fabric), &fabric.devices)
    }

    /// The devices a connection whose TCP socket has local address `local` may use.
    pub(crate) fn pnet_devices(&self, local: IpAddr) -> DeviceSet {
        let table = self.pnet_table();
        // The interface lookup dumps every interface and address over netlink (tens of µs
        // per connection setup): only done when some device is bound to an interface.
        let netdev = needs_interface(&table)
            .then(|| interface_of(local))
            .flatten();
        ports_for(
            &self.inner.ports,
            device_set(&table, netdev.as_deref(), local),
            local,
        )
    }

    /// `pnet`: the PNET table.
    pub(crate) fn query_pnet(&self) -> serde_json::Value {
        serde_json::Value::Array(
            self.pnet_table()
                .into_iter()
                .map(|e| {
                    serde_json::json!({
                        "device": e.device,
                        "netdevs": e.netdevs,
                        "addresses": e.addresses.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
                        "serves_all": e.netdevs.is_empty() && e.addresses.is_empty(),
                    })
                })
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(device: &str, netdevs: &[&str], addresses: &[&str]) -> PnetEntry {
        PnetEntry {
            device: device.into(),
            netdevs: netdevs.iter().map(|s| s.to_string()).collect(),
            addresses: addresses.iter().map(|a| a.parse().unwrap()).collect(),
        }
    }

    #[test]
    fn one_port_per_device_of_the_connections_ip_version() {
        let g = |s: &str| smc_fabric::Gid(s.parse::<std::net::Ipv6Addr>().unwrap().octets());
        // r0: IPv4 and two IPv6 GIDs; r1: IPv4 only; r2: IPv4 and one IPv6 GID.
        let ports = vec![
            (0, g("::ffff:10.0.0.1")),
            (0, g("fd00::1")),
            (0, g("2001:db8::1")),
            (1, g("::ffff:10.1.0.1")),
            (2, g("::ffff:10.2.0.1")),
            (2, g("fd02::1")),
        ];
        let all = DeviceSet::from_ids([DeviceId(0), DeviceId(1), DeviceId(2)]);
        let ids = |s: DeviceSet| {
            (0..6u8)
                .filter(|i| s.contains(DeviceId(*i)))
                .collect::<Vec<_>>()
        };
        // IPv4 (and an IPv4-mapped IPv6 address): the IPv4-mapped GIDs.
        assert_eq!(
            ids(ports_for(&ports, all, "10.0.0.1".parse().unwrap())),
            [0, 3, 4]
        );
        assert_eq!(
            ids(ports_for(&ports, all, "::ffff:10.0.0.1".parse().unwrap())),
            [0, 3, 4]
        );
        // IPv6: the GID equal to the address, else the first IPv6 GID, else the IPv4 one.
        assert_eq!(
            ids(ports_for(&ports, all, "2001:db8::1".parse().unwrap())),
            [2, 3, 5]
        );
        assert_eq!(
            ids(ports_for(&ports, all, "fd09::9".parse().unwrap())),
            [1, 3, 5]
        );
        // Only serving devices.
        let r2 = DeviceSet::from_ids([DeviceId(2)]);
        assert_eq!(ids(ports_for(&ports, r2, "fd02::1".parse().unwrap())), [5]);
        assert_eq!(
            ids(ports_for(
                &ports,
                DeviceSet::EMPTY,
                "fd02::1".parse().unwrap()
            )),
            Vec::<u8>::new()
        );
    }

    #[test]
    fn devices_are_chosen_by_interface_or_address() {
        let t = vec![
            entry("shm0", &["lo"], &[]),
            entry("shm1", &["eth1"], &["10.0.0.2"]),
            entry("shm2", &[], &[]),
        ];
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        let ten: IpAddr = "10.0.0.2".parse().unwrap();
        let s = device_set(&t, Some("lo"), lo);
        assert!(s.contains(DeviceId(0)) && !s.contains(DeviceId(1)) && s.contains(DeviceId(2)));
        let s = device_set(&t, None, ten);
        assert!(!s.contains(DeviceId(0)) && s.contains(DeviceId(1)) && s.contains(DeviceId(2)));
        let s = device_set(&t[..2], Some("eth9"), "192.168.1.1".parse().unwrap());
        assert_eq!(s.first(2), None);
    }

    #[test]
    fn interface_matters_only_when_a_device_lists_interfaces() {
        let any = entry("shm0", &[], &[]);
        let by_addr = entry("shm1", &[], &["10.0.0.2"]);
        let by_netdev = entry("shm2", &["eth1"], &[]);
        assert!(!needs_interface(&[any.clone(), by_addr.clone()]));
        assert!(needs_interface(&[any.clone(), by_netdev.clone()]));
        // Without the lookup (no interface) the set is the one with it.
        let t = [any, by_addr];
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        assert_eq!(device_set(&t, None, lo), device_set(&t, Some("lo"), lo));
    }

    #[test]
    fn table_follows_the_opened_order() {
        let configs = vec![
            DeviceConfig {
                netdevs: vec!["eth1".into()],
                ..DeviceConfig::named("shm1")
            },
            DeviceConfig::named("shm0"),
        ];
        let t = table(&["shm0".into(), "shm1".into()], &configs);
        assert_eq!(t[0].device, "shm0");
        assert!(t[0].netdevs.is_empty());
        assert_eq!(t[1].netdevs, vec!["eth1".to_string()]);
    }

    #[test]
    fn loopback_address_is_on_lo() {
        assert_eq!(
            interface_of("127.0.0.1".parse().unwrap()).as_deref(),
            Some("lo")
        );
        assert_eq!(
            interface_of("::ffff:127.0.0.1".parse().unwrap()).as_deref(),
            Some("lo")
        );
        assert_eq!(interface_of("192.0.2.77".parse().unwrap()), None);
    }
}
