//! smc-proto: the sans-IO protocol engine of smc-rs (RFC 7609).
//!
//! This crate makes every protocol decision and performs no I/O: no clock (time is a
//! [`Timestamp`] passed in), no threads, no sockets, no randomness (identifiers that need it
//! come from the caller). Its parts so far:
//!
//! - [`rmbe`]: RMB element layout (RFC eye catcher or Linux), cursor arithmetic.
//! - [`rmb_pool`]: the RMBs of a link group and which elements are free; the §4.4.2 conflict.
//! - [`conn`]: one connection's data path (cursors, windows, urgent data) and its normal and
//!   abnormal termination (RFC 7609 §4.5, §4.7, §4.8).
//! - [`endpoint`]: the per-stack SMC-R peer: CLC rendezvous (client and server handshake
//!   states), link groups and their LLC exchanges, connections over them, failover and
//!   keepalive (RFC 7609 §3, §4.5.3, §4.6, App. C). Start at [`Endpoint`].
//! - [`link_group`]: link groups, links, RTokens and the configuration exchanges in progress.
//! - [`fabric`]: the fabric as the endpoint sees it: the caller-supplied [`fabric::Resources`]
//!   (QPs, RMB registration, randomness) and the [`fabric::FabricOp`] outputs.
//! - [`timer`], [`time`]: one timer table per object; virtual time.
//! - `harness` and `lgr_harness` (feature `harness`, always on in this crate's tests): the
//!   deterministic two-peer harness for one connection, and the two-endpoint harness (fake
//!   TCP, fake fabric with QPs and RMB memory, link kill, drops, virtual clock, trace). Other
//!   crates' tests enable them with `smc-proto = { workspace = true, features = ["harness"] }`
//!   under `[dev-dependencies]`.
#![forbid(unsafe_code)]

pub mod conn;
pub mod endpoint;
pub mod fabric;
pub mod link_group;
pub mod rmb_pool;
pub mod rmbe;
pub mod time;
pub mod timer;

#[cfg(any(test, feature = "harness"))]
pub mod harness;
#[cfg(any(test, feature = "harness"))]
pub mod lgr_harness;

pub use conn::{ConnError, Connection, ConnectionConfig, Event, State};
pub use endpoint::{Endpoint, EndpointConfig, EndpointEvent, Fallback, ResetReason, TcpId};
pub use rmbe::{Region, Regions, RmbeLayout, RmbeRing};
pub use time::Timestamp;
