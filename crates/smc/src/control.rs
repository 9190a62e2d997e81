//! The control endpoint of a stack: a Unix stream socket
//! `<fabric dir>/stacks/<pid>-<instance>.sock` that answers one query per connection with one
//! JSON document, so that `smc ss`, `smc linkgroup`, `smc device` and `smc stats` can show
//! every stack on the machine.
//!
//! Protocol: the client writes one line, `ss`, `linkgroup`, `device` or `stats`; the stack
//! answers with a JSON value and closes. Unknown queries get `{"error": "..."}`.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Weak;
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

/// Control sockets found in `fabric_dir` (one per running stack; stale ones fail to connect).
pub fn list_sockets(fabric_dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(control_dir(fabric_dir))
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
    let mut s = UnixStream::connect(socket)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.write_all(what.as_bytes())?;
    s.write_all(b"\n")?;
    let mut body = String::new();
    std::io::Read::read_to_string(&mut s, &mut body)?;
    serde_json::from_str(&body).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// Bind the control socket of a stack and serve it from a thread that ends with the stack.
pub(crate) fn start(inner: Weak<Inner>, path: PathBuf) -> std::io::Result<()> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    let _ = std::fs::remove_file(&path);
    let l = UnixListener::bind(&path)?;
    l.set_nonblocking(true)?;
    std::thread::Builder::new()
        .name("smc-control".into())
        .spawn(move || serve(l, inner))?;
    Ok(())
}

fn serve(l: UnixListener, inner: Weak<Inner>) {
    loop {
        match l.accept() {
            Ok((s, _)) => {
                let Some(i) = inner.upgrade() else { return };
                let stack = Stack { inner: i };
                let _ = answer(&stack, s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if inner.strong_count() == 0 {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

fn answer(stack: &Stack, s: UnixStream) -> std::io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
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
