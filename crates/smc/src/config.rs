//! Configuration of a [`Stack`](crate::Stack): by code, or from the environment.
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `SMC_DISCOVERY` | `auto`, `ebpf`, `assert-peer` or `off` (see [`DiscoveryMode`]) | `auto` |
//! | `SMC_BUFFER_SIZE` | receive buffer (RMBE) size in bytes, rounded up to 16 KiB · 2ⁿ (at most 1 MiB) | 1048576 |
//! | `SMC_CLC_TIMEOUT_MS` | whole CLC handshake (App. C.5) | 30000 |
//! | `SMC_ACCEPT_WAIT_MS` | a client without an answer to its Proposal after this long declines (`NOACCEPT`) and uses TCP (0: wait the whole CLC timeout) | 6000 |
//! | `SMC_LLC_TIMEOUT_MS` | LLC reply timer while maintaining a link group | 2000 |
//! | `SMC_ASSERT_PEER_WAIT_MS` | assert-peer listener: how long to wait for a Proposal | 1000 |
//! | `SMC_IPV4_SUBNETS` | comma-separated `a.b.c.d/len` subnets we share with peers | `127.0.0.0/8` |
//! | `SMC_KEEPALIVE_MS` | §4.5.3 TEST LINK after this idle time (0: off) | off |
//! | `SMC_LGR_IDLE_MS` | a server ends a link group without connections after this time | 600000 |
//! | `SMC_BUSY_POLL_US` | blocked reads and writes spin on the completion queues this long first | off |
//! | `SMC_ADAPTIVE_SPIN_US` | without busy polling: longest adaptive spin before a blocked read or write sleeps (0: off) | 50 |
//! | `SMC_NODELAY` | `1`: new streams start with TCP_NODELAY (no corking of small writes) | `0` |
//! | `SMC_ADD_LINK_RETRY_MS` | a server retries adding a lost link this often (App. C.8) | 10000 |
//! | `SMC_UEIDS` | comma-separated SMC-Rv2 UEIDs (≤ 4; A–Z 0–9 `.` `-`, upper case, ≤ 32 characters) | none |
//! | `SMC_VERSIONS` | SMC versions offered and accepted: `1`, `2` or `1,2` | `1,2` |
//! | `SMC_CONFIG` | a TOML file read first (the variables above override it) | none |
//! | `SMC_UID_CHANGE` | read by the `smc run` library: when the program changes its uid (a server's workers dropping root), `grant` gives the new uid the fabric directory (POSIX ACL entries, see `docs/preload.md`), `tcp` grants nothing and keeps the process's later connections TCP | `grant` |
//! | `SMC_CGROUP2` | the cgroup v2 directory eBPF discovery attaches to (read by [`crate::discovery::find_cgroup2`]) | found, or mounted at `/run/smc-rs/cgroup2` |
//!
//! The TOML file has the same settings, in lower case without the prefix (`discovery`,
//! `buffer_size`, `clc_timeout_ms`, `accept_wait_ms`, `llc_timeout_ms`, `assert_peer_wait_ms`, `keepalive_ms`,
//! `lgr_idle_ms`, `busy_poll_us`, `adaptive_spin_us`, `add_link_retry_ms`, `nodelay` (a boolean), `ipv4_subnets` as an array of strings, `ueids` as an array of strings, `versions` as an array of
//! integers) plus `fabric_dir` and `devices`
//! (an array in `SMC_FABRIC_DEVICES` syntax, e.g. `["shm0=lo+127.0.0.1", "shm1"]`):
//!
//! ```toml
//! discovery = "assert-peer"
//! buffer_size = 524288
//! devices = ["shm0", "shm1"]
//! ipv4_subnets = ["127.0.0.0/8"]
//! ```
//!
//! The fabric (directory, devices `shm0,shm1`, faults) comes from smc-fabric's own variables
//! (`SMC_FABRIC_DIR`, `SMC_FABRIC_DEVICES`, `SMC_FABRIC_FAULTS`). The netdevs and addresses
//! listed with each device form the PNET table (see [`crate::pnet`]): a connection uses only
//! devices serving the interface of its TCP socket's local address.

use std::net::Ipv4Addr;
use std::time::Duration;

use smc_fabric::FabricConfig;
use smc_wire::RmbeSize;

use crate::error::StackError;

/// Default longest adaptive spin ([`StackConfig::adaptive_spin`]): a little more than a
/// loaded machine's thread wake-up, so that a peer that answers at once is caught spinning.
pub(crate) const DEFAULT_ADAPTIVE_SPIN: Duration = Duration::from_micros(50);

/// How a stack learns whether a TCP peer speaks SMC-R (RFC 7609 §3.1, §3.5.1.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiscoveryMode {
    /// The eBPF TCP-option program when it loads (root or CAP_BPF), otherwise [`Off`](Self::Off).
    Auto,
    /// The eBPF TCP-option program; creating the stack fails if it cannot be loaded.
    Ebpf,
    /// Explicit mode without privileges: the application asserts that its peers speak SMC-R.
    /// Clients send a CLC Proposal right after the TCP handshake; listeners wait a bounded
    /// time ([`StackConfig::assert_peer_wait`]) for a Proposal and otherwise fall back, so a
    /// plain TCP client still gets plain TCP.
    AssertPeer,
    /// Never try SMC-R: every connection is plain TCP.
    Off,
}

impl std::str::FromStr for DiscoveryMode {
    type Err = StackError;
    fn from_str(s: &str) -> Result<Self, StackError> {
        match s {
            "auto" => Ok(DiscoveryMode::Auto),
            "ebpf" => Ok(DiscoveryMode::Ebpf),
            "assert-peer" => Ok(DiscoveryMode::AssertPeer),
            "off" => Ok(DiscoveryMode::Off),
            _ => Err(StackError::Config(format!(
                "discovery mode {s:?} (expected auto, ebpf, assert-peer or off)"
            ))),
        }
    }
}

/// Everything a [`Stack`](crate::Stack) is configured with.
#[derive(Debug, Clone)]
pub struct StackConfig {
    /// The fabric and its devices (default `shm0` and `shm1`: link groups get two links).
    pub fabric: FabricConfig,
    /// Capability discovery.
    pub discovery: DiscoveryMode,
    /// Receive buffer (RMBE) size in bytes asked for each connection.
    pub buffer_size: u32,
    /// App. C.5: the CLC handshake must complete within this time.
    pub clc_timeout: Duration,
    /// A client without any answer to its Proposal after this time declines and uses TCP
    /// (Linux's client waits 6 s on its CLC socket); zero: wait the whole `clc_timeout`.
    /// See `smc_proto::endpoint::EndpointConfig::accept_wait`.
    pub accept_wait: Duration,
    /// App. C.7: LLC reply timer while maintaining a link group.
    pub llc_timeout: Duration,
    /// Assert-peer listeners fall back to TCP when no Proposal arrives within this time.
    pub assert_peer_wait: Duration,
    /// IPv4 subnets shared with peers (the server's subnet check, RFC 7609 §3.5.1).
    pub ipv4_subnets: Vec<(Ipv4Addr, u8)>,
    /// §4.5.3 keepalive interval (`None`: no TEST LINK).
    pub keepalive: Option<Duration>,
    /// A server terminates a link group without connections after this time.
    pub lgr_idle_timeout: Duration,
    /// Busy polling of new sockets (see `SmcStream::set_busy_poll`); `None`: off.
    pub busy_poll: Option<Duration>,
    /// Adaptive spinning of blocking sockets without busy polling: before a blocked read or
    /// write sleeps, it polls the completion queues for a budget that grows (up to this
    /// long) while the waits it would have saved end within it, and shrinks to nothing
    /// while they do not (see `SmcStream::set_busy_poll`); `None`: sleep at once.
    pub adaptive_spin: Option<Duration>,
    /// New streams start with TCP_NODELAY: small writes are announced at once instead of
    /// corked (RFC 7609 §4.5.2; see `SmcStream::set_nodelay`).
    pub nodelay: bool,
    /// App. C.8: a server whose link group lost a link retries adding one this often.
    pub add_link_retry: Duration,
    /// SMC-Rv2 user-defined enterprise IDs (at most 4, as Linux keeps); without one the stack
    /// neither offers nor accepts SMC-Rv2.
    pub ueids: Vec<smc_wire::Eid>,
    /// The SMC versions offered (client) and accepted (server).
    pub versions: smc_proto::endpoint::SmcVersions,
    /// Bytes per RMB a link group allocates: an RMB holds `rmb_bytes / RMBE size` elements
    /// (at least 1, at most 255). Every RMB costs a memory registration per link, a CONFIRM
    /// RKEY exchange and, on the shm fabric, a memfd on both sides; the default (2 MiB) holds
    /// two of the default 1 MiB RMBEs.
    pub rmb_bytes: u32,
}

impl StackConfig {
    /// Defaults over the given fabric: auto discovery, 1 MiB buffers (RMBEs), RFC-like
    /// timers.
    pub fn new(fabric: FabricConfig) -> StackConfig {
        StackConfig {
            fabric,
            discovery: DiscoveryMode::Auto,
            // A 64 KiB RMBE holds one 64 KiB write: writer and reader take turns over it;
            // 512 KiB streams 64 KiB writes about 30 % faster than 256 KiB, and 1 MiB (the
            // largest size a stack announces) takes 256 concurrent streams on two cores about
            // 25 % less CPU per byte than 512 KiB: the RMBE must hold what a writer produces
            // while its reader waits for a CPU, which grows with the busy connections
            // (docs/performance.md, session 16). An idle connection touches none of it
            // either way; a streaming one keeps what it touched.
            buffer_size: 1024 * 1024,
            clc_timeout: Duration::from_secs(30),
            accept_wait: Duration::from_secs(6),
            llc_timeout: Duration::from_secs(2),
            assert_peer_wait: Duration::from_secs(1),
            ipv4_subnets: vec![(Ipv4Addr::new(127, 0, 0, 0), 8)],
            keepalive: None,
            lgr_idle_timeout: Duration::from_secs(600),
            busy_poll: None,
            adaptive_spin: Some(DEFAULT_ADAPTIVE_SPIN),
            nodelay: false,
            add_link_retry: Duration::from_secs(10),
            ueids: Vec::new(),
            versions: smc_proto::endpoint::SmcVersions::default(),
            rmb_bytes: smc_proto::rmb_pool::RmbPoolConfig::default().rmb_target_bytes,
        }
    }

    /// Apply the settings of a TOML document (see the module documentation).
    pub fn apply_toml(&mut self, text: &str) -> Result<(), StackError> {
        let t: toml::Table = text
            .parse()
            .map_err(|e| StackError::Config(format!("TOML: {e}")))?;
        let bad = |k: &str| StackError::Config(format!("TOML: bad value for {k}"));
        let ms = |k: &str| -> Result<Option<Duration>, StackError> {
            match t.get(k) {
                None => Ok(None),
                Some(v) => v
                    .as_integer()
                    .and_then(|n| u64::try_from(n).ok())
                    .map(|n| Some(Duration::from_millis(n)))
                    .ok_or_else(|| bad(k)),
            }
        };
        for k in t.keys() {
            const KNOWN: &[&str] = &[
                "discovery",
                "buffer_size",
                "clc_timeout_ms",
                "accept_wait_ms",
                "llc_timeout_ms",
                "assert_peer_wait_ms",
                "keepalive_ms",
                "lgr_idle_ms",
                "busy_poll_us",
                "adaptive_spin_us",
                "nodelay",
                "add_link_retry_ms",
                "ipv4_subnets",
                "fabric_dir",
                "devices",
                "ueids",
                "versions",
            ];
            if !KNOWN.contains(&k.as_str()) {
                return Err(StackError::Config(format!("TOML: unknown setting {k:?}")));
            }
        }
        if let Some(v) = t.get("discovery") {
            self.discovery = v.as_str().ok_or_else(|| bad("discovery"))?.parse()?;
        }
        if let Some(v) = t.get("buffer_size") {
            self.buffer_size = v
                .as_integer()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| bad("buffer_size"))?;
        }
        if let Some(d) = ms("clc_timeout_ms")? {
            self.clc_timeout = d;
        }
        if let Some(d) = ms("accept_wait_ms")? {
            self.accept_wait = d;
        }
        if let Some(d) = ms("llc_timeout_ms")? {
            self.llc_timeout = d;
        }
        if let Some(d) = ms("add_link_retry_ms")? {
            self.add_link_retry = d;
        }
        if let Some(d) = ms("assert_peer_wait_ms")? {
            self.assert_peer_wait = d;
        }
        if let Some(d) = ms("keepalive_ms")? {
            self.keepalive = (!d.is_zero()).then_some(d);
        }
        if let Some(d) = ms("lgr_idle_ms")? {
            self.lgr_idle_timeout = d;
        }
        if let Some(v) = t.get("busy_poll_us") {
            let us = v
                .as_integer()
                .and_then(|n| u64::try_from(n).ok())
                .ok_or_else(|| bad("busy_poll_us"))?;
            self.busy_poll = (us > 0).then(|| Duration::from_micros(us));
        }
        if let Some(v) = t.get("adaptive_spin_us") {
            let us = v
                .as_integer()
                .and_then(|n| u64::try_from(n).ok())
                .ok_or_else(|| bad("adaptive_spin_us"))?;
            self.adaptive_spin = (us > 0).then(|| Duration::from_micros(us));
        }
        if let Some(v) = t.get("nodelay") {
            self.nodelay = v.as_bool().ok_or_else(|| bad("nodelay"))?;
        }
        if let Some(v) = t.get("ipv4_subnets") {
            let items = v.as_array().ok_or_else(|| bad("ipv4_subnets"))?;
            let mut all = Vec::new();
            for i in items {
                all.extend(parse_subnets(
                    i.as_str().ok_or_else(|| bad("ipv4_subnets"))?,
                )?);
            }
            self.ipv4_subnets = all;
        }
        if let Some(v) = t.get("ueids") {
            let items = v.as_array().ok_or_else(|| bad("ueids"))?;
            let spec: Vec<&str> = items
                .iter()
                .map(|i| i.as_str().ok_or_else(|| bad("ueids")))
                .collect::<Result<_, _>>()?;
            self.ueids = parse_ueid_list(spec.iter().copied(), "TOML ueids")?;
        }
        if let Some(v) = t.get("versions") {
            let items = v.as_array().ok_or_else(|| bad("versions"))?;
            let spec: Vec<String> = items
                .iter()
                .map(|i| {
                    i.as_integer()
                        .map(|n| n.to_string())
                        .ok_or_else(|| bad("versions"))
                })
                .collect::<Result<_, _>>()?;
            self.versions = parse_versions(&spec.join(","))
                .map_err(|e| StackError::Config(format!("TOML versions: {e}")))?;
        }
        if let Some(v) = t.get("fabric_dir") {
            self.fabric.dir = v.as_str().ok_or_else(|| bad("fabric_dir"))?.into();
        }
        if let Some(v) = t.get("devices") {
            let items = v.as_array().ok_or_else(|| bad("devices"))?;
            let spec: Vec<&str> = items
                .iter()
                .map(|i| i.as_str().ok_or_else(|| bad("devices")))
                .collect::<Result<_, _>>()?;
            self.fabric.devices =
                smc_fabric::config::parse_devices(&spec.join(",")).map_err(StackError::Fabric)?;
        }
        Ok(())
    }

    /// Defaults overridden by the environment (see the module documentation).
    pub fn from_env() -> Result<StackConfig, StackError> {
        let fabric = FabricConfig::from_env().map_err(StackError::Fabric)?;
        let mut c = StackConfig::new(fabric);
        if let Some(path) = std::env::var_os("SMC_CONFIG") {
            let text = std::fs::read_to_string(&path).map_err(|e| {
                StackError::Config(format!("{}: {e}", std::path::Path::new(&path).display()))
            })?;
            c.apply_toml(&text)?;
            // The fabric variables win over the file, as the others do.
            if let Some(dir) = std::env::var_os("SMC_FABRIC_DIR") {
                c.fabric.dir = dir.into();
            }
            if let Some(devs) = smc_fabric::config::env_text("SMC_FABRIC_DEVICES")
                .map_err(|e| StackError::Config(e.to_string()))?
            {
                c.fabric.devices =
                    smc_fabric::config::parse_devices(&devs).map_err(StackError::Fabric)?;
            }
        }
        // A value that is not UTF-8 is an error, never silently the default.
        let text = |name: &'static str| -> Result<Option<String>, StackError> {
            smc_fabric::config::env_text(name).map_err(|e| StackError::Config(e.to_string()))
        };
        if let Some(v) = text("SMC_DISCOVERY")? {
            c.discovery = v.parse()?;
        }
        let num = |name: &'static str| -> Result<Option<u64>, StackError> {
            match text(name)? {
                Some(v) => v
                    .parse::<u64>()
                    .map(Some)
                    .map_err(|_| StackError::Config(format!("{name}={v:?} is not a number"))),
                None => Ok(None),
            }
        };
        if let Some(v) = num("SMC_BUFFER_SIZE")? {
            c.buffer_size = u32::try_from(v)
                .map_err(|_| StackError::Config(format!("SMC_BUFFER_SIZE={v} too large")))?;
        }
        if let Some(v) = num("SMC_CLC_TIMEOUT_MS")? {
            c.clc_timeout = Duration::from_millis(v);
        }
        if let Some(v) = num("SMC_ACCEPT_WAIT_MS")? {
            c.accept_wait = Duration::from_millis(v);
        }
        if let Some(v) = num("SMC_LLC_TIMEOUT_MS")? {
            c.llc_timeout = Duration::from_millis(v);
        }
        if let Some(v) = num("SMC_ADD_LINK_RETRY_MS")? {
            c.add_link_retry = Duration::from_millis(v);
        }
        if let Some(v) = num("SMC_ASSERT_PEER_WAIT_MS")? {
            c.assert_peer_wait = Duration::from_millis(v);
        }
        if let Some(v) = text("SMC_IPV4_SUBNETS")? {
            c.ipv4_subnets = parse_subnets(&v)?;
        }
        if let Some(v) = num("SMC_KEEPALIVE_MS")? {
            c.keepalive = (v > 0).then(|| Duration::from_millis(v));
        }
        if let Some(v) = num("SMC_LGR_IDLE_MS")? {
            c.lgr_idle_timeout = Duration::from_millis(v);
        }
        if let Some(v) = num("SMC_NODELAY")? {
            c.nodelay = v != 0;
        }
        if let Some(v) = num("SMC_BUSY_POLL_US")? {
            c.busy_poll = (v > 0).then(|| Duration::from_micros(v));
        }
        if let Some(v) = num("SMC_ADAPTIVE_SPIN_US")? {
            c.adaptive_spin = (v > 0).then(|| Duration::from_micros(v));
        }
        if let Ok(v) = std::env::var("SMC_UEIDS") {
            c.ueids = parse_ueids(&v)?;
        }
        if let Ok(v) = std::env::var("SMC_VERSIONS") {
            c.versions = parse_versions(&v)
                .map_err(|e| StackError::Config(format!("SMC_VERSIONS={v:?}: {e}")))?;
        }
        Ok(c)
    }

    /// The RMBE size code for [`buffer_size`](Self::buffer_size): the smallest 16 KiB · 2ⁿ
    /// (n ≤ 6, 1 MiB) not below it.
    pub fn rmbe_size(&self) -> RmbeSize {
        rmbe_size_for(self.buffer_size)
    }
}

/// The RMBE size code for a buffer of `bytes`: the smallest 16 KiB · 2ⁿ (n ≤ 6, 1 MiB) not
/// below it.
pub fn rmbe_size_for(bytes: u32) -> RmbeSize {
    let mut code = 0u8;
    while code < 6 && ((16 * 1024u32) << code) < bytes {
        code += 1;
    }
    RmbeSize(code)
}

/// Parse `SMC_UEIDS`: comma-separated UEIDs (blanks around each ignored), at most 4, no
/// duplicates. A malformed one is an error naming it.
pub fn parse_ueids(s: &str) -> Result<Vec<smc_wire::Eid>, StackError> {
    parse_ueid_list(
        s.split(',').map(str::trim).filter(|p| !p.is_empty()),
        "SMC_UEIDS",
    )
}

fn parse_ueid_list<'a>(
    items: impl Iterator<Item = &'a str>,
    what: &str,
) -> Result<Vec<smc_wire::Eid>, StackError> {
    let mut out: Vec<smc_wire::Eid> = Vec::new();
    for item in items {
        let e = smc_wire::Eid::ueid(item.trim())
            .map_err(|e| StackError::Config(format!("{what}: {e}")))?;
        if out.contains(&e) {
            return Err(StackError::Config(format!(
                "{what}: UEID {item:?} is listed twice"
            )));
        }
        out.push(e);
    }
    if out.len() > smc_wire::eid::MAX_UEIDS {
        return Err(StackError::Config(format!(
            "{what}: {} UEIDs, at most {} (Linux's table size)",
            out.len(),
            smc_wire::eid::MAX_UEIDS
        )));
    }
    Ok(out)
}

/// Parse `SMC_VERSIONS`: `1`, `2`, `1,2` (or `2,1`).
pub fn parse_versions(s: &str) -> Result<smc_proto::endpoint::SmcVersions, String> {
    let mut v = smc_proto::endpoint::SmcVersions {
        v1: false,
        v2: false,
    };
    for p in s.split(',').map(str::trim) {
        match p {
            "1" => v.v1 = true,
            "2" => v.v2 = true,
            other => {
                return Err(format!(
                    "unknown SMC version {other:?} (expected 1, 2 or 1,2)"
                ))
            }
        }
    }
    Ok(v)
}

/// Parse `a.b.c.d/len,...`.
pub fn parse_subnets(s: &str) -> Result<Vec<(Ipv4Addr, u8)>, StackError> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            let bad = || StackError::Config(format!("subnet {p:?} (expected a.b.c.d/len)"));
            let (a, l) = p.trim().split_once('/').ok_or_else(bad)?;
            let addr: Ipv4Addr = a.parse().map_err(|_| bad())?;
            let len: u8 = l.parse().map_err(|_| bad())?;
            if len > 32 {
                return Err(bad());
            }
            Ok((addr, len))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rmbe_size_rounds_up() {
        let mut c = StackConfig::new(FabricConfig::with_dir("/nonexistent", 1));
        c.buffer_size = 1;
        assert_eq!(c.rmbe_size(), RmbeSize(0));
        c.buffer_size = 16 * 1024 + 1;
        assert_eq!(c.rmbe_size(), RmbeSize(1));
        c.buffer_size = 64 * 1024;
        assert_eq!(c.rmbe_size(), RmbeSize(2));
        c.buffer_size = u32::MAX;
        assert_eq!(c.rmbe_size(), RmbeSize(6));
    }

    #[test]
    fn toml_devices_take_kind_prefixes_and_bad_entries_are_named() {
        let mut c = StackConfig::new(FabricConfig::with_dir("/nonexistent", 1));
        c.apply_toml(r#"devices = ["roce:r0=veth0", "roce:r1=veth1+10.88.1.1", "shm:s2"]"#)
            .expect("valid TOML");
        assert_eq!(
            c.fabric.devices[0].kind,
            smc_fabric::DeviceKind::Roce {
                netdev: "veth0".into()
            }
        );
        assert_eq!(c.fabric.devices[1].addresses.len(), 1);
        assert_eq!(c.fabric.devices[2].kind, smc_fabric::DeviceKind::Shm);
        let e = c
            .apply_toml(r#"devices = ["shm0", "shm0"]"#)
            .expect_err("repeated name");
        assert!(e.to_string().contains("'shm0'"), "{e}");
    }

    #[test]
    fn toml_settings_apply_and_unknown_ones_are_rejected() {
        let mut c = StackConfig::new(FabricConfig::with_dir("/nonexistent", 1));
        c.apply_toml(
            r#"
            discovery = "assert-peer"
            buffer_size = 262144
            clc_timeout_ms = 5000
            keepalive_ms = 0
            nodelay = true
            lgr_idle_ms = 1000
            ipv4_subnets = ["10.1.0.0/16"]
            fabric_dir = "/run/x"
            devices = ["shm0=lo+127.0.0.1", "shm7"]
            "#,
        )
        .expect("valid TOML");
        assert_eq!(c.discovery, DiscoveryMode::AssertPeer);
        assert_eq!(c.rmbe_size(), RmbeSize(4));
        assert_eq!(c.clc_timeout, Duration::from_secs(5));
        assert_eq!(c.keepalive, None);
        assert!(c.nodelay);
        assert_eq!(c.lgr_idle_timeout, Duration::from_secs(1));
        assert_eq!(c.ipv4_subnets, vec![(Ipv4Addr::new(10, 1, 0, 0), 16)]);
        assert_eq!(c.fabric.dir, std::path::PathBuf::from("/run/x"));
        assert_eq!(c.fabric.device_names(), vec!["shm0", "shm7"]);
        assert_eq!(c.fabric.devices[0].netdevs, vec!["lo".to_string()]);
        assert!(c.apply_toml("bufer_size = 1").is_err());
        assert!(c.apply_toml("buffer_size = -1").is_err());
        assert!(c.apply_toml("discovery = 3").is_err());
        assert!(c.apply_toml("nodelay = 1").is_err());
        assert!(c.apply_toml("not toml").is_err());
    }

    #[test]
    fn subnets_parse_and_reject() {
        assert_eq!(
            parse_subnets("10.0.0.0/8, 127.0.0.0/8").expect("valid"),
            vec![
                (Ipv4Addr::new(10, 0, 0, 0), 8),
                (Ipv4Addr::new(127, 0, 0, 0), 8)
            ]
        );
        assert!(parse_subnets("10.0.0.0").is_err());
        assert!(parse_subnets("10.0.0.0/33").is_err());
        assert!("nope".parse::<DiscoveryMode>().is_err());
        assert_eq!(
            "assert-peer".parse::<DiscoveryMode>().expect("valid"),
            DiscoveryMode::AssertPeer
        );
    }

    #[test]
    fn ueids_and_versions() {
        let u = parse_ueids(" KERNEL-PEER-SMCR-TEST , SMC.RS-1").expect("valid");
        assert_eq!(u.len(), 2);
        assert_eq!(u[0].text(), "KERNEL-PEER-SMCR-TEST");
        let e = parse_ueids("GOOD,bad-lower").expect_err("lower case");
        let msg = e.to_string();
        assert!(
            msg.contains("SMC_UEIDS") && msg.contains("\"bad-lower\""),
            "{msg}"
        );
        assert!(parse_ueids("A,B,C,D,E").is_err());
        assert!(parse_ueids("A,A").is_err());
        assert!(parse_ueids(&"X".repeat(33)).is_err());
        assert_eq!(parse_ueids("").expect("empty"), vec![]);
        let v = parse_versions("1,2").expect("both");
        assert!(v.v1 && v.v2);
        let v = parse_versions("2").expect("v2");
        assert!(!v.v1 && v.v2);
        assert!(parse_versions("3").is_err());
        assert!(parse_versions("").is_err());
        let mut c = StackConfig::new(FabricConfig::with_dir("/nonexistent", 1));
        c.apply_toml("ueids = [\"ABC\"]\nversions = [2]")
            .expect("toml");
        assert_eq!(c.ueids.len(), 1);
        assert!(!c.versions.v1 && c.versions.v2);
        let e = c.apply_toml("ueids = [\"a b\"]").expect_err("bad UEID");
        assert!(e.to_string().contains("\"a b\""), "{e}");
    }
}
