//! Async sockets for tokio (feature `tokio`): [`SmcStream`] implements `AsyncRead` and
//! `AsyncWrite`, [`SmcListener`] accepts.
//!
//! Over SMC-R the stream is the blocking [`crate::SmcStream`] in nonblocking mode, woken through
//! two per-connection eventfds registered with tokio's reactor ([`AsyncFd`]): the stack's
//! runtime signals the read one when data, end of stream or a failure arrives and the write
//! one when room opens in the peer's RMBE (the stack writes a connection's eventfds only while
//! a waiter is armed, `smc_fabric::Sleepers`; tokio's reactor may sleep on them at any time,
//! so a stream arms them for good). A fallen-back stream is a plain
//! `tokio::net::TcpStream`. Connecting and accepting run the (blocking) rendezvous on tokio's
//! blocking pool.

use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use ::tokio::io::unix::AsyncFd;
use ::tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::stack::Notifiers;
use crate::{Mode, Stack};

/// One of a connection's eventfds, for [`AsyncFd`].
struct NotifyFd {
    n: Arc<Notifiers>,
    write: bool,
}

impl AsRawFd for NotifyFd {
    fn as_raw_fd(&self) -> RawFd {
        if self.write {
            self.n.write.as_raw_fd()
        } else {
            self.n.read.as_raw_fd()
        }
    }
}

impl NotifyFd {
    fn drain(&self) {
        if self.write {
            Notifiers::drain(&self.n.write);
        } else {
            Notifiers::drain(&self.n.read);
        }
    }
}

enum Inner {
    Smc {
        s: crate::SmcStream,
        rd: AsyncFd<NotifyFd>,
        wr: AsyncFd<NotifyFd>,
    },
    Tcp {
        tcp: ::tokio::net::TcpStream,
        leftover: Vec<u8>,
        strip: crate::crossing::Stripper,
        mode: Mode,
        _reg: Box<dyn Send + Sync>,
    },
}

/// An async connected socket over SMC-R, or over TCP after a fallback.
pub struct SmcStream {
    inner: Inner,
}

impl std::fmt::Debug for SmcStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SmcStream")
            .field("mode", &self.mode())
            .finish()
    }
}

impl SmcStream {
    /// Connect on `stack` (the rendezvous runs on the blocking pool).
    pub async fn connect(stack: &Stack, addr: SocketAddr) -> io::Result<SmcStream> {
        let stack = stack.clone();
        let s = ::tokio::task::spawn_blocking(move || crate::SmcStream::connect_with(&stack, addr))
            .await
            .map_err(io::Error::other)??;
        SmcStream::from_std(s)
    }

    /// Wrap a connected blocking stream (inside a tokio runtime).
    pub fn from_std(s: crate::SmcStream) -> io::Result<SmcStream> {
        let mode = s.mode();
        match s.into_tcp() {
            Ok((sock, leftover, strip, reg)) => {
                sock.set_nonblocking(true)?;
                Ok(SmcStream {
                    inner: Inner::Tcp {
                        tcp: ::tokio::net::TcpStream::from_std(sock)?,
                        leftover,
                        strip,
                        mode,
                        _reg: Box::new(reg),
                    },
                })
            }
            Err(s) => {
                let mut s = *s;
                let n = s
                    .notifiers()?
                    .ok_or_else(|| io::Error::other("SMC-R stream without notifiers"))?;
                s.set_nonblocking(true)?;
                // tokio's reactor may sleep on the eventfds at any time: signalled always.
                n.sleepers.arm();
                Ok(SmcStream {
                    inner: Inner::Smc {
                        rd: register(NotifyFd {
                            n: n.clone(),
                            write: false,
                        })?,
                        wr: register(NotifyFd { n, write: true })?,
                        s,
                    },
                })
            }
        }
    }

    /// Whether the connection runs over SMC-R or fell back to TCP, and why.
    pub fn mode(&self) -> Mode {
        match &self.inner {
            Inner::Smc { s, .. } => s.mode(),
            Inner::Tcp { mode, .. } => *mode,
        }
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        match &self.inner {
            Inner::Smc { s, .. } => s.peer_addr(),
            Inner::Tcp { tcp, .. } => tcp.peer_addr(),
        }
    }
}

/// Register one eventfd with tokio's reactor.
fn register(fd: NotifyFd) -> io::Result<AsyncFd<NotifyFd>> {
    // SAFETY: `NotifyFd` owns (through its `Arc<Notifiers>`) the eventfd it names, so the fd
    // stays open and refers to the same eventfd for as long as the `AsyncFd` lives, and
    // `as_raw_fd` always returns that same fd.
    unsafe { AsyncFd::register(fd) }.map_err(io::Error::from)
}

/// Run `op` until it does not return `WouldBlock`, waiting on `fd` in between. The stack
/// signals the eventfd after the state change it reports, so trying `op` after each wake-up
/// (readiness cleared and the eventfd drained first) loses no signal.
fn poll_op<T>(
    fd: &AsyncFd<NotifyFd>,
    cx: &mut Context<'_>,
    mut op: impl FnMut() -> io::Result<T>,
) -> Poll<io::Result<T>> {
    loop {
        match op() {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            other => return Poll::Ready(other),
        }
        let mut guard = ready!(fd.poll_read_ready(cx))?;
        guard.clear_ready();
        fd.get_ref().drain();
    }
}

impl AsyncRead for SmcStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match &mut self.get_mut().inner {
            Inner::Smc { s, rd, .. } => {
                let n = ready!(poll_op(rd, cx, || io::Read::read(
                    s,
                    buf.initialize_unfilled()
                )))?;
                buf.advance(n);
                Poll::Ready(Ok(()))
            }
            Inner::Tcp {
                tcp,
                leftover,
                strip,
                ..
            } => {
                // CLC messages that crossed our Decline are not data (see `crate::crossing`).
                while strip.active() && !strip.strip(leftover) {
                    let mut more = [0u8; 1024];
                    let mut rb = ReadBuf::new(&mut more);
                    ready!(Pin::new(&mut *tcp).poll_read(cx, &mut rb))?;
                    if rb.filled().is_empty() {
                        strip.finish();
                    }
                    leftover.extend_from_slice(rb.filled());
                }
                if !leftover.is_empty() {
                    let n = leftover.len().min(buf.remaining());
                    buf.put_slice(&leftover[..n]);
                    leftover.drain(..n);
                    return Poll::Ready(Ok(()));
                }
                Pin::new(tcp).poll_read(cx, buf)
            }
        }
    }
}

impl AsyncWrite for SmcStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match &mut self.get_mut().inner {
            Inner::Smc { s, wr, .. } => poll_op(wr, cx, || io::Write::write(s, buf)),
            Inner::Tcp { tcp, .. } => Pin::new(tcp).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().inner {
            Inner::Smc { s, .. } => Poll::Ready(io::Write::flush(s)),
            Inner::Tcp { tcp, .. } => Pin::new(tcp).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().inner {
            Inner::Smc { s, .. } => Poll::Ready(s.shutdown(std::net::Shutdown::Write)),
            Inner::Tcp { tcp, .. } => Pin::new(tcp).poll_shutdown(cx),
        }
    }
}

/// An async listener; each accept runs the rendezvous on the blocking pool.
#[derive(Debug, Clone)]
pub struct SmcListener {
    inner: Arc<crate::SmcListener>,
}

impl SmcListener {
    /// Bind on `stack`.
    pub fn bind(stack: &Stack, addr: SocketAddr) -> io::Result<SmcListener> {
        Ok(SmcListener {
            inner: Arc::new(crate::SmcListener::bind_with(stack, addr)?),
        })
    }

    /// The local address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    /// Accept one connection.
    pub async fn accept(&self) -> io::Result<(SmcStream, SocketAddr)> {
        let l = self.inner.clone();
        let (s, a) = ::tokio::task::spawn_blocking(move || l.accept())
            .await
            .map_err(io::Error::other)??;
        Ok((SmcStream::from_std(s)?, a))
    }
}
