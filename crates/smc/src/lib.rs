//! smc: the SMC-R stack as applications see it.
//!
//! So far this crate holds capability discovery ([`discovery`]): the eBPF program that puts the
//! SMC TCP option on the handshake of smc-rs sockets and tells whether the peer offered SMC.
//! The runtime, `SmcStream` and `SmcListener` come with issue [runtime].

pub mod discovery;
