//! Fabric configuration: devices, fabric directory and injected faults.
//!
//! Environment variables (read by [`FabricConfig::from_env`]):
//! - `SMC_FABRIC_DIR`: fabric directory (default `$XDG_RUNTIME_DIR/smc-fabric`, else
//!   `/tmp/smc-fabric-<uid>`);
//! - `SMC_FABRIC_DEVICES`: comma-separated devices (default `shm0,shm1`), each an optional kind
//!   prefix, a name, and optionally `=` followed by `+`-separated netdevs and IP addresses it
//!   serves (the PNET table):
//!   - `shm0=lo+127.0.0.1` or `shm:shm0=lo+127.0.0.1`: a shared-memory device (between the
//!     processes of this host);
//!   - `roce:r0=veth0` or `roce:r1=veth1+10.88.1.1`: a software RoCEv2 device on netdev `veth0`
//!     (the first token after `=`, which it also serves), with the GID `::ffff:a.b.c.d` of the
//!     netdev's IPv4 address; further tokens are served as for shm devices.
//!
//!   A repeated name, an unknown kind, a roce entry without netdev, or an entry with two `=`
//!   is an error naming the entry;
//! - `SMC_FABRIC_FAULTS`: comma-separated faults applied when a device is opened:
//!   `shm1:down` (port starts down) or `shm0:fail=N` (the next N send-queue work requests
//!   complete with [`crate::WcStatus::RetryExceeded`]); for roce devices also
//!   `r0:drop=P`, `r0:reorder=P`, `r0:dup=P`, `r0:corrupt=P` (percent of transmitted packets
//!   dropped, held back behind the next one, sent twice, or sent with one bit flipped) and
//!   `r0:delay=MS` (every packet held back MS milliseconds).

use crate::error::{FabricError, Result};
use std::net::IpAddr;
use std::path::PathBuf;

/// Which backend a configured device uses.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum DeviceKind {
    /// The shared-memory fabric between processes of one host.
    #[default]
    Shm,
    /// A software RoCEv2 device over kernel UDP sockets on a network interface.
    Roce {
        /// The interface whose IPv4 address is the device's GID and whose MTU bounds the path
        /// MTU.
        netdev: String,
    },
}

impl DeviceKind {
    /// `"shm"` or `"roce"`.
    pub fn label(&self) -> &'static str {
        match self {
            DeviceKind::Shm => "shm",
            DeviceKind::Roce { .. } => "roce",
        }
    }
}

/// One configured software RNIC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceConfig {
    /// Device name, e.g. `shm0`.
    pub name: String,
    /// Backend.
    pub kind: DeviceKind,
    /// Network interfaces this device serves (PNET table entries), e.g. `lo`.
    pub netdevs: Vec<String>,
    /// IP addresses this device serves.
    pub addresses: Vec<IpAddr>,
}

impl DeviceConfig {
    /// A device with no netdevs or addresses.
    pub fn named(name: &str) -> DeviceConfig {
        DeviceConfig {
            name: name.to_owned(),
            kind: DeviceKind::Shm,
            netdevs: Vec::new(),
            addresses: Vec::new(),
        }
    }
}

/// A fault applied to a device when it is opened.
#[derive(Clone, Debug, PartialEq)]
pub enum Fault {
    /// The port starts down.
    PortDown,
    /// The next N send-queue work requests fail with `RetryExceeded`.
    FailNext(u32),
    /// roce: this percentage of transmitted packets is dropped.
    Drop(f64),
    /// roce: this percentage of transmitted packets is held back and sent after the next one.
    Reorder(f64),
    /// roce: this percentage of transmitted packets is sent twice.
    Duplicate(f64),
    /// roce: this percentage of transmitted packets has one bit flipped (the receiver's ICRC
    /// check drops it).
    Corrupt(f64),
    /// roce: every transmitted packet is held back this many milliseconds.
    Delay(u64),
}

impl Eq for Fault {}

/// Configuration of the fabric seen by one process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FabricConfig {
    /// Directory holding one Unix socket per (device, process).
    pub dir: PathBuf,
    /// Devices that may be opened.
    pub devices: Vec<DeviceConfig>,
    /// Faults per device name.
    pub faults: Vec<(String, Fault)>,
    /// Largest memory region that may be registered or mapped from a peer.
    pub max_mr_size: usize,
}

impl Default for FabricConfig {
    fn default() -> Self {
        FabricConfig {
            dir: default_dir(),
            devices: vec![DeviceConfig::named("shm0"), DeviceConfig::named("shm1")],
            faults: Vec::new(),
            max_mr_size: 1 << 30,
        }
    }
}

/// The default directory [`pin_default_dir`] fixed, if it was called.
static PINNED_DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// Fix the default fabric directory of this process to what [`default_dir`] gives now, for
/// the rest of its life: a program that clears its environment (nginx's workers lose
/// `XDG_RUNTIME_DIR`) or changes its uid (a server dropping root) keeps the directory of the
/// user and environment it started with, which its peers use (the `smc run` library calls
/// this at load).
pub fn pin_default_dir() {
    let _ = PINNED_DIR.set(default_dir());
}

/// The default fabric directory: `$XDG_RUNTIME_DIR/smc-fabric`, else `/tmp/smc-fabric-<uid>`
/// (or what [`pin_default_dir`] fixed).
pub fn default_dir() -> PathBuf {
    if let Some(d) = PINNED_DIR.get() {
        return d.clone();
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d).join("smc-fabric"),
        _ => PathBuf::from(format!(
            "/tmp/smc-fabric-{}",
            rustix::process::getuid().as_raw()
        )),
    }
}

impl FabricConfig {
    /// Default configuration overridden by `SMC_FABRIC_DIR`, `SMC_FABRIC_DEVICES` and
    /// `SMC_FABRIC_FAULTS`.
    pub fn from_env() -> Result<FabricConfig> {
        let mut cfg = FabricConfig::default();
        if let Some(dir) = std::env::var_os("SMC_FABRIC_DIR") {
            cfg.dir = PathBuf::from(dir);
        }
        if let Some(devs) = env_text("SMC_FABRIC_DEVICES")? {
            cfg.devices = parse_devices(&devs)?;
        }
        if let Some(faults) = env_text("SMC_FABRIC_FAULTS")? {
            cfg.faults = parse_faults(&faults)?;
        }
        Ok(cfg)
    }

    /// A configuration with the given directory and devices `shm0`..`shm{n-1}`.
    pub fn with_dir(dir: impl Into<PathBuf>, n_devices: usize) -> FabricConfig {
        FabricConfig {
            dir: dir.into(),
            devices: (0..n_devices)
                .map(|i| DeviceConfig::named(&format!("shm{i}")))
                .collect(),
            ..FabricConfig::default()
        }
    }

    /// Names of the configured devices.
    pub fn device_names(&self) -> Vec<String> {
        self.devices.iter().map(|d| d.name.clone()).collect()
    }

    pub(crate) fn device(&self, name: &str) -> Result<(usize, &DeviceConfig)> {
        self.devices
            .iter()
            .enumerate()
            .find(|(_, d)| d.name == name)
            .ok_or_else(|| FabricError::NoSuchDevice(name.to_owned()))
    }
}

/// The value of environment variable `name`, if set; an error (not "unset") when it is not
/// UTF-8, so that a mistyped value is never silently replaced by the defaults.
pub fn env_text(name: &'static str) -> Result<Option<String>> {
    match std::env::var(name) {
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(FabricError::NotUtf8(name)),
    }
}

/// Parse a `SMC_FABRIC_DEVICES` value such as `shm0=lo+127.0.0.1,shm1` or
/// `roce:r0=veth0,roce:r1=veth1+10.88.1.1` (see the [module documentation](self)).
pub fn parse_devices(s: &str) -> Result<Vec<DeviceConfig>> {
    let mut out: Vec<DeviceConfig> = Vec::new();
    for item in s.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let bad = |reason: &'static str| FabricError::BadDeviceEntry {
            entry: item.to_owned(),
            reason,
        };
        let (head, serves) = item.split_once('=').unwrap_or((item, ""));
        if serves.contains('=') {
            return Err(bad("more than one '='"));
        }
        let (kind, name) = match head.split_once(':') {
            Some(("shm", name)) => ("shm", name),
            Some(("roce", name)) => ("roce", name),
            Some(_) => return Err(bad("unknown device kind (use shm: or roce:)")),
            None => ("shm", head),
        };
        if name.is_empty()
            || name.len() > 32
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
            || name.starts_with('.')
        {
            return Err(bad(
                "device name must be 1-32 letters, digits, '_', '-' or '.' (not leading)",
            ));
        }
        if out.iter().any(|d| d.name == name) {
            return Err(bad("device name repeated"));
        }
        let mut dev = DeviceConfig::named(name);
        for tok in serves.split('+') {
            if tok.is_empty() {
                if serves.is_empty() {
                    continue;
                }
                return Err(bad("empty netdev or address between '+'"));
            }
            match tok.parse::<IpAddr>() {
                Ok(a) => dev.addresses.push(a),
                Err(_) if tok.len() < 16 && !tok.contains(['/', ' ', ':']) => {
                    dev.netdevs.push(tok.to_owned())
                }
                Err(_) => return Err(bad("not an IP address or interface name")),
            }
        }
        if kind == "roce" {
            let first_is_netdev = serves
                .split('+')
                .next()
                .is_some_and(|t| !t.is_empty() && t.parse::<IpAddr>().is_err());
            if !first_is_netdev {
                return Err(bad("roce device needs a netdev: roce:NAME=NETDEV"));
            }
            dev.kind = DeviceKind::Roce {
                netdev: dev.netdevs[0].clone(),
            };
        }
        out.push(dev);
    }
    Ok(out)
}

/// Parse a `SMC_FABRIC_FAULTS` value such as `shm1:down,shm0:fail=3`.
pub fn parse_faults(s: &str) -> Result<Vec<(String, Fault)>> {
    let mut out = Vec::new();
    for item in s.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (dev, what) = item
            .split_once(':')
            .ok_or(FabricError::InvalidArgument("fault needs device:kind"))?;
        let percent = |v: &str| -> Result<f64> {
            let p: f64 = v
                .trim_end_matches('%')
                .parse()
                .map_err(|_| FabricError::InvalidArgument("fault percentage"))?;
            if (0.0..=100.0).contains(&p) {
                Ok(p)
            } else {
                Err(FabricError::InvalidArgument(
                    "fault percentage outside 0..100",
                ))
            }
        };
        let fault = if what == "down" {
            Fault::PortDown
        } else if let Some(n) = what.strip_prefix("fail=") {
            Fault::FailNext(
                n.parse()
                    .map_err(|_| FabricError::InvalidArgument("fail=N"))?,
            )
        } else if let Some(p) = what.strip_prefix("drop=") {
            Fault::Drop(percent(p)?)
        } else if let Some(p) = what.strip_prefix("reorder=") {
            Fault::Reorder(percent(p)?)
        } else if let Some(p) = what.strip_prefix("dup=") {
            Fault::Duplicate(percent(p)?)
        } else if let Some(p) = what.strip_prefix("corrupt=") {
            Fault::Corrupt(percent(p)?)
        } else if let Some(ms) = what.strip_prefix("delay=") {
            Fault::Delay(
                ms.trim_end_matches("ms")
                    .parse()
                    .map_err(|_| FabricError::InvalidArgument("delay=MS"))?,
            )
        } else {
            return Err(FabricError::InvalidArgument("unknown fault kind"));
        };
        out.push((dev.to_owned(), fault));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_parse() {
        let f = parse_faults("shm1:down, shm0:fail=3").expect("valid");
        assert_eq!(
            f,
            vec![
                ("shm1".into(), Fault::PortDown),
                ("shm0".into(), Fault::FailNext(3))
            ]
        );
        assert!(parse_faults("shm0").is_err());
        assert!(parse_faults("shm0:fail=x").is_err());
        assert!(parse_faults("shm0:boom").is_err());
    }

    #[test]
    fn devices_parse() {
        let d = parse_devices("shm0=lo+127.0.0.1, shm1").expect("valid");
        assert_eq!(d[0].name, "shm0");
        assert_eq!(d[0].netdevs, vec!["lo".to_owned()]);
        assert_eq!(
            d[0].addresses,
            vec!["127.0.0.1".parse::<IpAddr>().expect("ip")]
        );
        assert_eq!(d[1], DeviceConfig::named("shm1"));
        assert!(parse_devices("../x").is_err());
    }

    #[test]
    fn kinds_parse() {
        let d = parse_devices("roce:r0=veth0,roce:r1=veth1+10.88.1.1,shm:s0=lo,s1").expect("ok");
        assert_eq!(
            d[0].kind,
            DeviceKind::Roce {
                netdev: "veth0".into()
            }
        );
        assert_eq!(d[0].netdevs, vec!["veth0".to_owned()]);
        assert_eq!(d[1].netdevs, vec!["veth1".to_owned()]);
        assert_eq!(
            d[1].addresses,
            vec!["10.88.1.1".parse::<IpAddr>().expect("ip")]
        );
        assert_eq!(d[2].kind, DeviceKind::Shm);
        assert_eq!(d[2].name, "s0");
        assert_eq!(d[3].kind, DeviceKind::Shm);
    }

    /// Every malformed entry is refused with an error that names it.
    #[test]
    fn bad_entries_are_named() {
        for (spec, entry) in [
            ("shm0,shm0", "shm0"),
            ("a=b=c+1.2.3", "a=b=c+1.2.3"),
            ("shm0,ib:x=eth0", "ib:x=eth0"),
            ("roce:r0", "roce:r0"),
            ("roce:r0=10.0.0.1", "roce:r0=10.0.0.1"),
            ("roce:r0=veth0,roce:r0=veth1", "roce:r0=veth1"),
            ("x=eth0++1.2.3.4", "x=eth0++1.2.3.4"),
            ("roce:=veth0", "roce:=veth0"),
        ] {
            let e = parse_devices(spec).expect_err(spec);
            let msg = e.to_string();
            assert!(msg.contains(&format!("'{entry}'")), "{spec}: {msg}");
        }
    }

    #[test]
    fn roce_faults_parse() {
        let f = parse_faults("r0:drop=1,r0:reorder=2.5%,r0:dup=1,r0:corrupt=0.5,r0:delay=5")
            .expect("valid");
        assert_eq!(f[0].1, Fault::Drop(1.0));
        assert_eq!(f[1].1, Fault::Reorder(2.5));
        assert_eq!(f[4].1, Fault::Delay(5));
        assert!(parse_faults("r0:drop=101").is_err());
        assert!(parse_faults("r0:drop=x").is_err());
    }
}
