//! The software RoCEv2 backend: RC queue pairs carried in kernel UDP sockets (port 4791),
//! byte-exact with Linux's Soft-RoCE (rdma_rxe) as shared/spec/rocev2.md describes it, so that
//! two smc-rs hosts (or network namespaces) speak SMC-R over any IP network.
//!
//! A device lives on a netdev (`roce:r0=veth0`): its first GID is `::ffff:a.b.c.d` of the
//! netdev's IPv4 address, followed by its global and unique-local IPv6 addresses (docs/roce.md,
//! "IPv6 GIDs"), its path MTU follows the netdev's MTU, and the netdev going down is a port
//! failure. One UDP socket per GID, bound to `<address>:4791`, carries every QP; a progress
//! thread per device receives, answers (ACK/NAK), places WRITE payloads straight into the
//! registered regions and runs the timers. Requests are segmented and sent from the posting
//! thread. The packet codec is `smc_wire::roce`, shared with the capture writer. Several
//! processes on one address share the port: `steer` steers each datagram by its destination QPN
//! to the process owning that QPN range.

mod cq;
mod device;
mod fault;
mod gso;
mod inbound;
mod mr;
mod netdev;
mod qp;
mod rx;
mod seal;
mod steer;
mod txpkt;

pub(crate) use cq::RoceCq;
pub(crate) use device::{active_mtu, receive_now, snapshot, ReceiveWait, RoceHandle};
pub(crate) use mr::RoceMr;
pub(crate) use qp::{shortest_shared_write, RoceQp, MAX_SEND};
pub(crate) use rx::BLOCK;

#[cfg(test)]
mod tests;
