//! Fabric configuration: devices, fabric directory and injected faults.
//!
//! Environment variables (read by [`FabricConfig::from_env`]):
//! - `SMC_FABRIC_DIR`: fabric directory (default `$XDG_RUNTIME_DIR/smc-fabric`, else
//!   `/tmp/smc-fabric-<uid>`);
//! - `SMC_FABRIC_DEVICES`: comma-separated devices (default `shm0,shm1`), each a name optionally
//!   followed by `=` and `+`-separated netdevs and IP addresses it serves, e.g.
//!   `shm0=lo+127.0.0.1,shm1=eth1+10.0.0.2`;
//! - `SMC_FABRIC_FAULTS`: comma-separated faults applied when a device is opened:
//!   `shm1:down` (port starts down) or `shm0:fail=N` (the next N send-queue work requests
//!   complete with [`crate::WcStatus::RetryExceeded`]).

use crate::error::{FabricError, Result};
use std::net::IpAddr;
use std::path::PathBuf;

/// One configured software RNIC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceConfig {
    /// Device name, e.g. `shm0`.
    pub name: String,
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
            netdevs: Vec::new(),
            addresses: Vec::new(),
        }
    }
}

/// A fault applied to a device when it is opened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The port starts down.
    PortDown,
    /// The next N send-queue work requests fail with `RetryExceeded`.
    FailNext(u32),
}

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

/// The default fabric directory: `$XDG_RUNTIME_DIR/smc-fabric`, else `/tmp/smc-fabric-<uid>`.
pub fn default_dir() -> PathBuf {
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

/// Parse a `SMC_FABRIC_DEVICES` value such as `shm0=lo+127.0.0.1,shm1`.
pub fn parse_devices(s: &str) -> Result<Vec<DeviceConfig>> {
    let mut out = Vec::new();
    for item in s.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (name, serves) = item.split_once('=').unwrap_or((item, ""));
        if name.is_empty() || name.contains('/') || name.len() > 32 {
            return Err(FabricError::InvalidArgument("device name"));
        }
        let mut dev = DeviceConfig::named(name);
        for tok in serves.split('+').filter(|t| !t.is_empty()) {
            match tok.parse::<IpAddr>() {
                Ok(a) => dev.addresses.push(a),
                Err(_) => dev.netdevs.push(tok.to_owned()),
            }
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
        let fault = if what == "down" {
            Fault::PortDown
        } else if let Some(n) = what.strip_prefix("fail=") {
            Fault::FailNext(
                n.parse()
                    .map_err(|_| FabricError::InvalidArgument("fail=N"))?,
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
}
