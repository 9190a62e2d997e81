//! smc: the SMC-R stack as applications see it.
//!
//! - [`Stack`]: one SMC-R peer per process (peer ID, fabric devices, the protocol endpoint of
//!   smc-proto, a runtime thread polling completions and firing timers), configured by code
//!   or the environment ([`StackConfig`]).
//! - [`SmcListener`] and [`SmcStream`]: blocking sockets shaped like `std::net`'s. Each
//!   connection starts as TCP, discovers whether the peer speaks SMC-R ([`discovery`]: the
//!   eBPF TCP option, or the explicit [`DiscoveryMode::AssertPeer`]), runs the CLC rendezvous
//!   over the TCP socket and then moves its data over the fabric; or it falls back to the
//!   plain TCP stream, and [`SmcStream::mode`] says why ([`FallbackReason`]).

mod clock;
pub mod config;
pub mod control;
mod crossing;
pub mod discovery;
mod error;
pub mod fdapi;
mod lgr_exit;
pub mod pnet;
mod stack;
mod stream;
mod tcpwatch;
#[cfg(feature = "tokio")]
pub mod tokio;

pub use config::{DiscoveryMode, StackConfig};
pub use error::{FallbackReason, Mode, StackError};
pub use smc_fabric::{FabricConfig, PortState};
pub use stack::{LinkGroupInfo, LinkInfo, Stack, StackStats};
pub use stream::{ConnectOptions, SmcListener, SmcStream};
