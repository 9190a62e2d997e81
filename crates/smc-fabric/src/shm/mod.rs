//! The shared-memory backend: software RNICs between processes of one host.
//!
//! Each process that opens device `shmN` becomes its own RNIC port with its own GID and listens on
//! `<fabric dir>/shmN/<gid hex>.sock` (a Unix SEQPACKET socket). Moving a QP to RTR connects to the
//! remote GID's socket; the connection is the QP's control channel: the peer hands over its
//! receive ring (a sealed memfd) and doorbell eventfds, and grants memory regions of the QP's
//! protection domain on request, one rkey at a time. A closed connection means the peer QP (or
//! process) is gone: the QP goes to the error state and its outstanding work is flushed.

mod control;
mod cq;
mod device;
mod mem;
mod mr;
mod qp;
mod wire;

pub(crate) use cq::CqShared;
pub(crate) use device::DeviceHandle;
pub(crate) use mr::MrInner;
pub(crate) use qp::QpShared;
