//! The control endpoint of a stack: a Unix stream socket
//! `<fabric dir>/stacks/<pid>-<instance>.sock` that answers one query per connection with one
//! JSON document, so that `smc ss`, `smc linkgroup`, `smc device` and `smc stats` can show
//! every stack on the machine.
//!
//! Protocol: the client writes one line, `ss`, `linkgroup`, `device` or `stats`; the stack
//! answers with a JSON value and closes. Unknown queries get `{"error": "..."}`.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use serde_json::{json, Value};

use crate::stack::{Inner, Stack};

/// The queries a stack answers.
pub const QUERIES: &[&str] = &["ss", "linkgroup", "device", "stats", "pnet"];

/// The fabric directory a stack uses when nothing overrides it (`SMC_FABRIC_DIR` or
/// [`FabricConfig::dir`](smc_fabric::FabricConfig::dir)).
pub fn default_fabric_dir() -> PathBuf {
    smc_fabric::config::default_dir()
}

/// The directory of the control sockets of the stacks on fabric directory `fabric_dir`.
pub fn control_dir(fabric_dir: &Path) -> PathBuf {
    fabric_dir.join("stacks")
}

/// Control sockets found in `fabric_dir` (one per running stack). Sockets of processes that
/// are gone (killed before they could remove theirs) are removed on the way; a directory
/// that is not ours (another user's, or open to others) is not read at all.
pub fn list_sockets(fabric_dir: &Path) -> Vec<PathBuf> {
    let dir = control_dir(fabric_dir);
    if !trusted_dir(&dir) {
        return Vec::new();
    }
    sweep_stale(&dir);
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "sock"))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Ask the stack behind `socket` one query; returns its JSON answer.
pub fn query(socket: &Path, what: &str, timeout: Duration) -> std::io::Result<Value> {
    let short = smc_fabric::sockpath::SocketPath::new(socket).map_err(std::io::Error::other)?;
    let mut s = UnixStream::connect(short.as_path())?;
    drop(short);
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.write_all(what.as_bytes())?;
    s.write_all(b"\n")?;
    let mut body = String::new();
    std::io::Read::read_to_string(&mut s, &mut body)?;
    serde_json::from_str(&body).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// The pid in a control socket's name `<pid>-<instance>.sock`.
fn socket_pid(name: &std::ffi::OsStr) -> Option<u32> {
    let name = name.to_str()?.strip_suffix(".sock")?;
    name.split_once('-')?.0.parse().ok()
}

/// Remove the control sockets of processes that no longer exist.
fn sweep_stale(dir: &Path) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    let me = std::process::id();
    for e in rd.flatten() {
        let Some(pid) = socket_pid(&e.file_name()) else {
            continue;
        };
        if pid != me && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Whether `dir` is a directory of ours or root's (or we are root) that nobody else may
/// write to but the users its owner granted it to (`smc_fabric::access`).
fn trusted_dir(dir: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let me = rustix::process::getuid().as_raw();
    std::fs::symlink_metadata(dir).is_ok_and(|m| {
        m.is_dir()
            && (m.uid() == me || m.uid() == 0 || me == 0)
            && !smc_fabric::access::others_may_write(dir, &m)
    })
}

/// The control socket of a running stack: its file, and its listening socket (shut down
/// when the stack goes, which wakes the serving thread, which then ends).
pub(crate) struct ControlSocket {
    path: PathBuf,
    listener: Arc<UnixListener>,
}

impl ControlSocket {
    /// Stop serving and remove the file.
    pub(crate) fn close(&self) {
        let _ = rustix::net::shutdown(&*self.listener, rustix::net::Shutdown::Both);
        let _ = std::fs::remove_file(&self.path);
        at_exit::forget(&self.path);
    }
}

/// Most queries served at once; a client beyond them is closed at once (its `smc ss` says
/// so) rather than queued behind silent ones.
const MAX_CLIENTS: usize = 32;

/// How long a client may take to send its query.
const QUERY_TIMEOUT: Duration = Duration::from_secs(2);

/// Bind the control socket of a stack and serve it from a thread that ends with the stack.
/// Stale sockets of dead processes are removed first; the file is removed when the stack
/// goes or, for a stack that lives as long as the process (`Stack::global`), when the
/// process exits normally.
pub(crate) fn start(inner: Weak<Inner>, path: PathBuf) -> std::io::Result<ControlSocket> {
    if let Some(d) = path.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(d)?;
        sweep_stale(d);
    }
    let _ = std::fs::remove_file(&path);
    let short = smc_fabric::sockpath::SocketPath::new(&path).map_err(std::io::Error::other)?;
    // Out of the program's low numbers, as every descriptor the stack keeps.
    let l = Arc::new(UnixListener::from(smc_fabric::fdplace::make(|| {
        UnixListener::bind(short.as_path()).map(std::os::fd::OwnedFd::from)
    })?));
    drop(short);
    if let Some(d) = path.parent() {
        // Reachable by the users the directory is granted to (`smc_fabric::access`).
        if let Err(e) = smc_fabric::access::share_socket(&path, d) {
            tracing::debug!(%e, path = %path.display(), "control socket not shared");
        }
    }
    l.set_nonblocking(true)?;
    at_exit::remove(&path);
    let l2 = l.clone();
    let spawned = smc_fabric::threads::spawn_running(
        std::thread::Builder::new().name("smc-control".into()),
        move || serve(&l2, inner),
    );
    let sock = ControlSocket { path, listener: l };
    if let Err(e) = spawned {
        sock.close();
        return Err(e);
    }
    Ok(sock)
}

/// Accept clients as they come (sleeping in `poll` until one does: no periodic polling)
/// and answer each in a thread of its own, so that a client that never sends its query holds
/// up nobody. The wait is a `poll`, not a blocking `accept`, which would hold a descriptor
/// number reserved for the whole wait (Linux allots it before it sleeps), and the
/// listening socket is non-blocking.
fn serve(l: &UnixListener, inner: Weak<Inner>) {
    use rustix::event::{PollFd, PollFlags, Timespec};
    let busy = Arc::new(AtomicUsize::new(0));
    // Only to notice a stack that went away without closing us (the drop shuts the socket
    // down, which wakes the poll at once).
    let check = Timespec {
        tv_sec: 1,
        tv_nsec: 0,
    };
    loop {
        let mut fds = [PollFd::new(l, PollFlags::IN)];
        match rustix::event::poll(&mut fds, Some(&check)) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => {
                tracing::debug!(%e, "control socket poll failed");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        if inner.strong_count() == 0 {
            return;
        }
        // (The listener does not block: a make, placed before a program's close can hit it.)
        let s = match smc_fabric::fdplace::making(|| {
            l.accept().map(|(s, _)| {
                std::os::unix::net::UnixStream::from(smc_fabric::fdplace::placed(
                    std::os::fd::OwnedFd::from(s),
                ))
            })
        }) {
            Ok(s) => s,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                ) =>
            {
                continue
            }
            Err(e) => {
                // Shut down (the stack is going), or out of descriptors: the pending
                // client waits in the backlog meanwhile.
                tracing::debug!(%e, "control socket accept failed");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let Some(i) = inner.upgrade() else { return };
        if busy.fetch_add(1, Ordering::AcqRel) >= MAX_CLIENTS {
            busy.fetch_sub(1, Ordering::AcqRel);
            continue;
        }
        let stack = Stack { inner: i };
        let b = busy.clone();
        let spawned = smc_fabric::threads::spawn_running(
            std::thread::Builder::new().name("smc-control-query".into()),
            move || {
                let _ = answer(&stack, s);
                b.fetch_sub(1, Ordering::AcqRel);
            },
        );
        if spawned.is_err() {
            busy.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Control sockets to remove when the process exits normally (`exit`, or `main` returning):
/// a stack kept for the life of the process is never dropped.
mod at_exit {
    use std::path::{Path, PathBuf};
    use std::sync::{Mutex, Once};

    static PATHS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
    static HOOK: Once = Once::new();

    extern "C" fn remove_all() {
        // `try_lock`: a thread that exits the process while it registers a path must not
        // deadlock its own exit.
        if let Ok(paths) = PATHS.try_lock() {
            for p in paths.iter() {
                let _ = std::fs::remove_file(p);
            }
        }
    }

    pub(super) fn remove(path: &Path) {
        HOOK.call_once(|| {
            // SAFETY: `remove_all` is a plain `extern "C" fn()` that lives for the whole
            // program and neither unwinds (it only removes files) nor calls `exit`.
            let _ = unsafe { libc::atexit(remove_all) };
        });
        PATHS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(path.to_owned());
    }

    pub(super) fn forget(path: &Path) {
        PATHS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|p| p != path);
    }
}

fn answer(stack: &Stack, s: UnixStream) -> std::io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(QUERY_TIMEOUT))?;
    s.set_write_timeout(Some(QUERY_TIMEOUT))?;
    let mut line = String::new();
    BufReader::new(&s).take_line(&mut line)?;
    let v = match line.trim() {
        "ss" => stack.query_ss(),
        "linkgroup" => stack.query_linkgroups(),
        "device" => stack.query_devices(),
        "stats" => stack.query_stats(),
        "pnet" => stack.query_pnet(),
        other => json!({ "error": format!("unknown query {other:?}") }),
    };
    let mut s = s;
    s.write_all(v.to_string().as_bytes())
}

/// Read one line of at most 256 bytes (a query), never more.
trait TakeLine {
    fn take_line(&mut self, out: &mut String) -> std::io::Result<usize>;
}

impl<R: BufRead> TakeLine for R {
    fn take_line(&mut self, out: &mut String) -> std::io::Result<usize> {
        std::io::Read::take(self, 256).read_line(out)
    }
}
