//! Control messages exchanged over the per-QP Unix SEQPACKET connections of the shm fabric.
//!
//! Every message is one packet of at most [`MAX_MSG`] bytes: `magic: u32 LE`, `kind: u8`,
//! three zero bytes, then the kind's fields (little endian). File descriptors travel as
//! SCM_RIGHTS ancillary data of the same packet.

use crate::error::{FabricError, Result};
use crate::types::Gid;
use rustix::fd::{BorrowedFd, OwnedFd};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;

const MAGIC: u32 = 0x534d_4346; // "SMCF"
/// Largest control message.
pub(crate) const MAX_MSG: usize = 64;
/// Most file descriptors one message carries.
const MAX_FDS: usize = 2;

/// Reasons a request is refused (carried in [`Msg::Refused`]).
pub(crate) const REFUSE_NO_QP: u32 = 1;
pub(crate) const REFUSE_STATE: u32 = 2;
pub(crate) const REFUSE_PEER: u32 = 3;
pub(crate) const REFUSE_ACCESS: u32 = 4;

/// A decoded control message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Msg {
    /// Connect QP `src_qpn` of `src_gid` to QP `dst_qpn` of the receiver (carries the
    /// sender's send-CQ doorbell eventfd).
    Hello {
        src_gid: Gid,
        src_qpn: u32,
        dst_qpn: u32,
    },
    /// Hello accepted: carries the receive-ring memfd and receive-CQ doorbell eventfd.
    HelloOk { capacity: u32 },
    /// Request the memory region with this rkey (must be remote-writable, same PD).
    MrRequest { rkey: u32 },
    /// The memory region: carries its memfd.
    MrGrant { rkey: u32, vaddr: u64, len: u64 },
    /// A request was refused.
    Refused { reason: u32 },
}

impl Msg {
    fn encode(&self, buf: &mut [u8; MAX_MSG]) -> usize {
        buf[..4].copy_from_slice(&MAGIC.to_le_bytes());
        match *self {
            Msg::Hello {
                src_gid,
                src_qpn,
                dst_qpn,
            } => {
                buf[4] = 1;
                buf[8..24].copy_from_slice(&src_gid.0);
                buf[24..28].copy_from_slice(&src_qpn.to_le_bytes());
                buf[28..32].copy_from_slice(&dst_qpn.to_le_bytes());
                32
            }
            Msg::HelloOk { capacity } => {
                buf[4] = 2;
                buf[8..12].copy_from_slice(&capacity.to_le_bytes());
                12
            }
            Msg::MrRequest { rkey } => {
                buf[4] = 3;
                buf[8..12].copy_from_slice(&rkey.to_le_bytes());
                12
            }
            Msg::MrGrant { rkey, vaddr, len } => {
                buf[4] = 4;
                buf[8..12].copy_from_slice(&rkey.to_le_bytes());
                buf[16..24].copy_from_slice(&vaddr.to_le_bytes());
                buf[24..32].copy_from_slice(&len.to_le_bytes());
                32
            }
            Msg::Refused { reason } => {
                buf[4] = 5;
                buf[8..12].copy_from_slice(&reason.to_le_bytes());
                12
            }
        }
    }

    fn decode(b: &[u8]) -> Result<Msg> {
        let bad = FabricError::PeerViolation("malformed control message");
        let u32_at = |o: usize| -> Result<u32> {
            let s = b
                .get(o..o + 4)
                .ok_or(FabricError::PeerViolation("short control message"))?;
            Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
        };
        let u64_at = |o: usize| -> Result<u64> {
            let s = b
                .get(o..o + 8)
                .ok_or(FabricError::PeerViolation("short control message"))?;
            let mut a = [0u8; 8];
            a.copy_from_slice(s);
            Ok(u64::from_le_bytes(a))
        };
        if u32_at(0)? != MAGIC {
            return Err(bad);
        }
        let (msg, len) = match b.get(4) {
            Some(1) => {
                let mut gid = [0u8; 16];
                gid.copy_from_slice(b.get(8..24).ok_or(FabricError::PeerViolation("short"))?);
                (
                    Msg::Hello {
                        src_gid: Gid(gid),
                        src_qpn: u32_at(24)?,
                        dst_qpn: u32_at(28)?,
                    },
                    32,
                )
            }
            Some(2) => (
                Msg::HelloOk {
                    capacity: u32_at(8)?,
                },
                12,
            ),
            Some(3) => (Msg::MrRequest { rkey: u32_at(8)? }, 12),
            Some(4) => (
                Msg::MrGrant {
                    rkey: u32_at(8)?,
                    vaddr: u64_at(16)?,
                    len: u64_at(24)?,
                },
                32,
            ),
            Some(5) => (Msg::Refused { reason: u32_at(8)? }, 12),
            _ => return Err(bad),
        };
        if b.len() != len {
            return Err(bad);
        }
        Ok(msg)
    }
}

/// Send one message with optional file descriptors.
pub(crate) fn send(sock: BorrowedFd<'_>, msg: &Msg, fds: &[BorrowedFd<'_>]) -> Result<()> {
    let mut buf = [0u8; MAX_MSG];
    let len = msg.encode(&mut buf);
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(FabricError::InvalidArgument("too many fds"));
    }
    let iov = [IoSlice::new(&buf[..len])];
    loop {
        match rustix::net::sendmsg(sock, &iov, &mut control, SendFlags::NOSIGNAL) {
            Ok(n) if n == len => return Ok(()),
            Ok(_) => return Err(FabricError::PeerViolation("short send")),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(FabricError::os("sendmsg", e)),
        }
    }
}

/// Outcome of [`recv`].
pub(crate) enum Received {
    /// A message and the descriptors that came with it.
    Msg(Msg, Vec<OwnedFd>),
    /// The peer closed the connection.
    Closed,
    /// Non-blocking socket with nothing to read.
    WouldBlock,
}

/// Receive one message (blocking or not, depending on the socket).
pub(crate) fn recv(sock: BorrowedFd<'_>) -> Result<Received> {
    let mut buf = [0u8; MAX_MSG + 1];
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let res = loop {
        // Wait as the socket says with a peek (no room for control data: no descriptor is
        // installed by it), then take the message and its descriptors without blocking, as a
        // make (`fdplace::making`: the descriptors come at low numbers, which a program's
        // close must not hit before they are placed).
        let mut one = [0u8; 1];
        match rustix::net::recv(sock, &mut one, RecvFlags::PEEK) {
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => break Err(e),
            Ok(_) => {}
        }
        let taken = crate::fdplace::making(|| {
            let mut iov = [IoSliceMut::new(&mut buf)];
            rustix::net::recvmsg(
                sock,
                &mut iov,
                &mut control,
                RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT,
            )
            .map(|r| {
                let mut fds = Vec::new();
                for m in control.drain() {
                    if let RecvAncillaryMessage::ScmRights(it) = m {
                        fds.extend(it.map(crate::fdplace::placed));
                    }
                }
                (r, fds)
            })
        });
        match taken {
            // (Taken by another reader between the peek and here: wait again.)
            Err(rustix::io::Errno::INTR | rustix::io::Errno::AGAIN) => continue,
            other => break other,
        }
    };
    let (r, fds) = match res {
        Ok(r) => r,
        Err(rustix::io::Errno::AGAIN) => return Ok(Received::WouldBlock),
        Err(rustix::io::Errno::CONNRESET) => return Ok(Received::Closed),
        Err(e) => return Err(FabricError::os("recvmsg", e)),
    };
    if r.bytes == 0 {
        return Ok(Received::Closed);
    }
    if r.flags.contains(rustix::net::ReturnFlags::CTRUNC) || r.bytes > MAX_MSG {
        return Err(FabricError::PeerViolation("oversized control message"));
    }
    Ok(Received::Msg(Msg::decode(&buf[..r.bytes])?, fds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        let msgs = [
            Msg::Hello {
                src_gid: Gid([7; 16]),
                src_qpn: 0x123456,
                dst_qpn: 42,
            },
            Msg::HelloOk { capacity: 64 },
            Msg::MrRequest { rkey: 0xdeadbeef },
            Msg::MrGrant {
                rkey: 9,
                vaddr: 0x7fff_0000_1000,
                len: 65536,
            },
            Msg::Refused {
                reason: REFUSE_ACCESS,
            },
        ];
        for m in msgs {
            let mut buf = [0u8; MAX_MSG];
            let n = m.encode(&mut buf);
            assert_eq!(Msg::decode(&buf[..n]).expect("decodes"), m);
            assert!(Msg::decode(&buf[..n - 1]).is_err());
        }
        assert!(Msg::decode(&[0u8; 12]).is_err());
    }
}
