//! exec: the SMC-R connections a new program image would inherit. The exec'ing process's
//! own connections end with its image, so before the exec their TCP sockets are shut down
//! (or, for a spawned process, left to this one); every connection the new program may
//! inherit is named to it with its owner, of whom its first use asks a relay (`relay.rs`),
//! and without an owner to ask its calls fail with EIO instead of waiting on an idle TCP
//! socket. Accepted connections not yet set up are settled as TCP first (sshd's re-exec). The `execl` family's entry points are in
//! `execl.rs`, `posix_spawn` and the rarer variants in `rare.rs`.

use libc::c_int;

use smc::fdapi;

use crate::hooks::{bfd, blocking, is_inet_stream};
use crate::relay::{self, Owner};
use crate::table::{self, Entry, Kind};
use crate::{guard, log, real};

/// The variable that names, across an exec, the sockets that are SMC-R connections of
/// another process (the new program's library asks their owner for a relay, or fails their
/// calls, instead of leaving it to wait on an idle TCP socket). Its value lists them as
/// `device:inode` of the TCP socket, with `:pid:nonce` of the owner when there is one,
/// not by descriptor number: the number the new program gets may be another one, made by a
/// `dup2` the table never saw — in the child of a `vfork` (Python's `subprocess` with
/// `stdin=sock`), which must leave its parent's table alone, or by `posix_spawn`'s file
/// actions.
pub(crate) const INHERITED_VAR: &str = "SMC_PRELOAD_INHERITED";

/// Before an exec: an SMC-R connection of this process whose number survives the exec (no
/// close-on-exec) cannot be used by the new program (its state stays in this image, which the
/// exec ends), so its TCP socket is shut down: the new program reads end of stream and its
/// writes fail, and the peer learns the connection is over. A forked child's exec leaves its
/// parent's connections alone (socat's `SYSTEM:`), but names them to the new program with
/// their owner (bash's `/dev/tcp` redirection handed to `head`): the new program asks the
/// owner for a relay at its first use. Returns the value for [`INHERITED_VAR`].
pub(crate) fn before_exec() -> Option<String> {
    smc_fabric::QuietWake::settle();
    surviving_connections(false)
}

/// The SMC-R connections a new program may inherit, as [`before_exec`] names them; `spawn`:
/// the new program is another process (`posix_spawn`), so this one keeps its own
/// connections as they are and names them too. The child of a `vfork` counts as a spawn:
/// the connections are its parent's.
pub(crate) fn surviving_connections(spawn: bool) -> Option<String> {
    if !table::ANY.load(std::sync::atomic::Ordering::Relaxed) {
        return None;
    }
    if !table::borrowed_memory() {
        // A client handshake in progress ends here: the new program (or, for a spawn, the
        // other process) would find the socket in the middle of it.
        crate::connecting::finish_all();
    }
    if spawn && !table::borrowed_memory() {
        // posix_spawn from this process: the new program may ask it for relays.
        relay::serve_spawned();
    }
    let spawn = spawn || table::borrowed_memory();
    // Connections shut down here: the new program reads their end of stream (not named).
    let mut ended = Vec::new();
    // Accepted connections settled as TCP here (one socket may be under several numbers).
    let mut settled = Vec::new();
    if !spawn {
        for fd in 0..1024 {
            if !table::maybe(fd) {
                continue;
            }
            let Some(e) = table::get(fd) else {
                continue;
            };
            if let Kind::Pending(once) = &e.kind {
                // Not while the settler (`settle.rs`) runs its rendezvous.
                let _g = once.lock().unwrap_or_else(|p| p.into_inner());
                if matches!(table::get(fd), Some(now) if std::sync::Arc::ptr_eq(&now, &e)) {
                    settle_pending_as_tcp(fd, &mut settled);
                }
                continue;
            }
            if !matches!(e.kind, Kind::Smc(_)) || !e.ours() {
                continue;
            }
            // SAFETY: plain fcntl.
            let fl = unsafe { real::fcntl(fd, libc::F_GETFD, 0) };
            if fl >= 0 && fl & libc::FD_CLOEXEC == 0 {
                log!("fd {fd}: SMC-R connection handed to an exec'd program: shut down");
                // SAFETY: the connection's TCP socket.
                unsafe { real::shutdown(fd, libc::SHUT_RDWR) };
                ended.extend(e.socket.get().copied());
            }
        }
    }
    // Every connection is named, close-on-exec or not, open here or not: a copy of it may
    // survive under another number.
    let named: Vec<String> = table::connection_sockets()
        .into_iter()
        .filter(|id| !ended.contains(id))
        .map(|id| name(id, owner_of(id, spawn)))
        .collect();
    (!named.is_empty()).then(|| named.join(","))
}

/// One connection in [`INHERITED_VAR`]: `device:inode` of its TCP socket, then, when the new
/// program can ask for a relay, `:pid:nonce` of the owner (the nonce in hex).
fn name((dev, ino): (u64, u64), owner: Option<Owner>) -> String {
    match owner {
        Some(o) => format!("{dev}:{ino}:{}:{:x}", o.pid, o.nonce),
        None => format!("{dev}:{ino}"),
    }
}

/// The connections [`name`] lists, with their owners.
fn parse(v: &str) -> Vec<((u64, u64), Option<Owner>)> {
    v.split(',')
        .filter_map(|x| {
            let mut f = x.split(':');
            let id = (f.next()?.parse().ok()?, f.next()?.parse().ok()?);
            let owner = match (f.next(), f.next()) {
                (Some(p), Some(n)) => Some(Owner {
                    pid: p.parse().ok().filter(|&p: &i32| p > 0)?,
                    nonce: u64::from_str_radix(n, 16).ok()?,
                }),
                _ => None,
            };
            Some((id, owner))
        })
        .collect()
}

/// Where the new program can ask for a relay of connection `id`: the process whose stack
/// holds it, when that process goes on after this exec — another process of the tree (a
/// forked child execs), the owner an earlier image named, or this process itself when the
/// new program is another process (`spawn`: `posix_spawn`, a `vfork` child) and this one
/// serves relays. `None`: the connection's state ends with this image (its exec), or
/// nobody would answer; the new program's calls fail with EIO.
fn owner_of(id: (u64, u64), spawn: bool) -> Option<Owner> {
    let me = table::PID.load(std::sync::atomic::Ordering::Relaxed);
    let mut mine = false;
    for (_, e) in table::entries_of_socket(id) {
        match &e.kind {
            Kind::Smc(_) if !e.ours() => return Some(Owner::of_tree(e.pid)),
            Kind::Smc(_) => mine = true,
            Kind::Relayed(r) if r.owner() != Owner::of_tree(me) => return Some(r.owner()),
            Kind::Relayed(_) => mine = true,
            Kind::Inherited(Some(o)) => return Some(*o),
            _ => {}
        }
    }
    (mine && spawn && relay::serving(me)).then(|| Owner::of_tree(me))
}

/// Before an exec: an accepted connection whose server rendezvous has not run (its client
/// offered SMC-R, nobody used it yet) and whose number survives the exec is settled as TCP
/// here: the new program has no table and would read the client's CLC messages as its own
/// data, and the client would wait for an Accept (sshd re-executes itself with the
/// connection on its standard input: "banner line contains invalid characters"). The
/// client's Proposal is read and declined (`EXECED`); the new program gets the TCP
/// connection as it is, as without the library. (Running the rendezvous in the new image
/// instead would give sshd an SMC-R connection that its privilege-separated child, forked
/// after, could not use.) Whichever process made the entry (sshd's listener accepted, its
/// child execs), the entry goes: this image ends, or the exec failed and the socket is TCP.
fn settle_pending_as_tcp(fd: c_int, settled: &mut Vec<(u64, u64)>) {
    // SAFETY: plain fcntl.
    let fl = unsafe { real::fcntl(fd, libc::F_GETFD, 0) };
    if fl < 0 || fl & libc::FD_CLOEXEC != 0 {
        return;
    }
    let id = table::socket_id(fd);
    if id.is_some_and(|id| settled.contains(&id)) {
        // Another number of the same socket was settled already.
        if let Some(old) = table::take(fd) {
            table::release(old);
        }
        return;
    }
    settled.extend(id);
    let (r, _) = blocking(fd, || fdapi::decline_accepted(bfd(fd)));
    match r {
        Ok(true) => log!("fd {fd}: accepted connection handed to an exec'd program: declined, TCP"),
        Ok(false) => log!("fd {fd}: accepted connection handed to an exec'd program: TCP"),
        Err(e) => log!("fd {fd}: accepted connection handed to an exec'd program: {e}"),
    }
    if let Some(old) = table::take(fd) {
        table::release(old);
    }
}

/// In the constructor: the sockets the previous image named (see [`before_exec`]), under
/// whichever numbers this image has them.
pub(crate) fn adopt_inherited() {
    let Ok(v) = std::env::var(INHERITED_VAR) else {
        return;
    };
    // Only for this image: a later exec names what is still inherited by then.
    std::env::remove_var(INHERITED_VAR);
    let ids = parse(&v);
    if ids.is_empty() {
        return;
    }
    let fds: Vec<c_int> = match std::fs::read_dir("/proc/self/fd") {
        Ok(dir) => dir
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect(),
        Err(_) => (0..1024).collect(),
    };
    for fd in fds {
        let Some(id) = table::socket_id(fd) else {
            continue;
        };
        let Some(&(_, owner)) = ids.iter().find(|(i, _)| *i == id) else {
            continue;
        };
        if !is_inet_stream(fd) {
            continue;
        }
        match owner {
            Some(o) => log!(
                "fd {fd}: an SMC-R connection of process {}: its relay is asked for at the first use",
                o.pid
            ),
            None => {
                log!("fd {fd}: an SMC-R connection of the process before exec: calls fail with EIO")
            }
        }
        let _ = table::set(fd, Entry::new(Kind::Inherited(owner)));
    }
}

/// The environment for an exec with `envp`, with [`INHERITED_VAR`] set to `value` (the
/// strings stay alive until the exec, which ends the image, or its failure).
pub(crate) fn env_with(
    envp: *const *const libc::c_char,
    value: &str,
) -> (Vec<std::ffi::CString>, Vec<*const libc::c_char>) {
    let mut owned = Vec::new();
    let mut ptrs = Vec::new();
    let prefix = format!("{INHERITED_VAR}=");
    if !envp.is_null() {
        let mut i = 0;
        loop {
            // SAFETY: the caller's NULL-terminated array of C strings.
            let p = unsafe { *envp.add(i) };
            if p.is_null() {
                break;
            }
            // SAFETY: a C string of the array.
            let entry = unsafe { std::ffi::CStr::from_ptr(p) };
            if !entry.to_bytes().starts_with(prefix.as_bytes()) {
                ptrs.push(p);
            }
            i += 1;
        }
    }
    if let Ok(c) = std::ffi::CString::new(format!("{prefix}{value}")) {
        ptrs.push(c.as_ptr());
        owned.push(c);
    }
    ptrs.push(std::ptr::null());
    (owned, ptrs)
}

#[no_mangle]
pub unsafe extern "C" fn execve(
    path: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
) -> c_int {
    match guard(None, before_exec) {
        None => {
            // SAFETY: passed on unchanged.
            unsafe { real::execve(path, argv, envp) }
        }
        Some(v) => {
            let (_owned, env) = env_with(envp, &v);
            // SAFETY: the caller's path and arguments, an environment that lives until then.
            unsafe { real::execve(path, argv, env.as_ptr()) }
        }
    }
}

extern "C" {
    /// The C library's environment, which `execv` and `execvp` pass on.
    static environ: *const *const libc::c_char;
}

/// `execv` as `execve` with the process's environment: a copy of it names the inherited
/// connections. (Not `setenv` on the process's own: in the child of a `vfork` — Python's
/// `subprocess` — that would write the variable into the parent's environment, and every
/// later program the parent started would inherit it.)
#[no_mangle]
pub unsafe extern "C" fn execv(
    path: *const libc::c_char,
    argv: *const *const libc::c_char,
) -> c_int {
    // SAFETY: the C library's environment array, read where the exec would read it.
    let envp = unsafe { environ };
    match guard(None, before_exec) {
        // SAFETY: passed on unchanged.
        None => unsafe { real::execv(path, argv) },
        Some(v) => {
            let (_owned, env) = env_with(envp, &v);
            // SAFETY: the caller's path and arguments, an environment that lives until then.
            unsafe { real::execve(path, argv, env.as_ptr()) }
        }
    }
}

/// `execvp` as `execvpe` with the process's environment (see [`execv`]).
#[no_mangle]
pub unsafe extern "C" fn execvp(
    file: *const libc::c_char,
    argv: *const *const libc::c_char,
) -> c_int {
    // SAFETY: as in `execv`.
    let envp = unsafe { environ };
    match guard(None, before_exec) {
        // SAFETY: passed on unchanged.
        None => unsafe { real::execvp(file, argv) },
        Some(v) => {
            let (_owned, env) = env_with(envp, &v);
            // SAFETY: the caller's file and arguments, an environment that lives until then.
            unsafe { crate::rare::real_execvpe(file, argv, env.as_ptr()) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_inherited_connections_travel_with_their_owners() {
        let o = Owner {
            pid: 4242,
            nonce: 0xdead_beef_0000_0001,
        };
        let v = [name((7, 99), Some(o)), name((7, 100), None)].join(",");
        assert_eq!(v, "7:99:4242:deadbeef00000001,7:100");
        assert_eq!(parse(&v), vec![((7, 99), Some(o)), ((7, 100), None)]);
        // Garbage is skipped, never taken for an owner: a bad pid or nonce drops the entry.
        assert_eq!(parse("x:1,7:8:0:1,7:9:-3:1,7:10:5:zz,,7"), vec![]);
    }

    #[test]
    fn the_exec_environment_names_the_inherited_connections_once() {
        let a = std::ffi::CString::new("PATH=/bin").expect("c");
        let old = std::ffi::CString::new(format!("{INHERITED_VAR}=9")).expect("c");
        let envp = [a.as_ptr(), old.as_ptr(), std::ptr::null()];
        let (_owned, env) = env_with(envp.as_ptr(), "3,4");
        let got: Vec<String> = env
            .iter()
            .take_while(|p| !p.is_null())
            // SAFETY: C strings of the array.
            .map(|p| {
                unsafe { std::ffi::CStr::from_ptr(*p) }
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        assert_eq!(
            got,
            vec!["PATH=/bin".to_string(), format!("{INHERITED_VAR}=3,4")]
        );
        assert!(env.last().is_some_and(|p| p.is_null()));
    }
}
