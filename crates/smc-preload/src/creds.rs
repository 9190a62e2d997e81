//! `setuid`, `seteuid`, `setreuid`, `setresuid`: a program that gives up root after it
//! started (nginx's and apache's workers become `www-data`) keeps SMC-R.
//!
//! Before the C library changes the uid (process-wide: glibc makes every thread change),
//! while the process still holds CAP_SETUID, when the call drops the privilege for good (the
//! real, effective and saved uid all leave the old effective uid; a temporary `seteuid` is
//! left alone, [`drop_targets`]), the library makes the process's stack when it uses SMC-R
//! (it has managed sockets, maybe inherited from the parent that forked it), or else loads
//! the eBPF discovery for the stack it makes later (mosquitto and mariadbd drop root before
//! they open their sockets), and grants the new uid the fabric directory, the `SMC_LOG` file
//! ([`smc::fdapi::before_uid_change`]) and read on this library, which the programs it execs
//! as the new uid load; the trust rule and what it exposes are in `docs/preload.md`,
//! "Privilege drop".
//! `SMC_UID_CHANGE=tcp` keeps the old behaviour: no grant, and after the drop no stack, so
//! the process's later connections are TCP. The group calls (`setgid`, `setgroups`,
//! `initgroups`) are left alone: the grants name the user.

use libc::{c_int, uid_t};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::{guard, log, table};

/// What `SMC_UID_CHANGE` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Policy {
    /// Grant the new uid the fabric (the default).
    Grant,
    /// No grant; TCP after the change.
    Tcp,
}

fn policy() -> Policy {
    match smc::fdapi::setting("SMC_UID_CHANGE") {
        None => Policy::Grant,
        Some(v) if v == "grant" => Policy::Grant,
        Some(v) if v == "tcp" => Policy::Tcp,
        Some(v) => {
            // Never silently the default: the safe side, and said so.
            log!("SMC_UID_CHANGE={v:?} is neither grant nor tcp: taken as tcp");
            Policy::Tcp
        }
    }
}

/// Whether the calling thread holds CAP_SETUID (without it a change to another uid fails,
/// and nothing is granted).
fn may_change_uid() -> bool {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: c_int,
    }
    #[repr(C)]
    #[derive(Default, Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const VERSION_3: u32 = 0x2008_0522;
    const CAP_SETUID: u32 = 7;
    let mut h = Header {
        version: VERSION_3,
        pid: 0,
    };
    let mut d = [Data::default(); 2];
    // SAFETY: capget with a version-3 header and room for its two data words.
    let r = unsafe { libc::syscall(libc::SYS_capget, &mut h as *mut Header, d.as_mut_ptr()) };
    r == 0 && d[0].effective & (1 << CAP_SETUID) != 0
}

/// The real, effective and saved uid after the privileged call `call` with `args` (`-1`:
/// unchanged) succeeds, from `old`, as Linux sets them for a caller holding CAP_SETUID.
fn uids_after(call: &str, args: &[uid_t], old: [uid_t; 3]) -> [uid_t; 3] {
    let [r, e, s] = old;
    let arg = |i: usize, cur: uid_t| match args.get(i) {
        Some(&u) if u != uid_t::MAX => u,
        _ => cur,
    };
    match call {
        // A privileged setuid sets all three.
        "setuid" => {
            let u = arg(0, e);
            [u, u, u]
        }
        "seteuid" => [r, arg(0, e), s],
        "setreuid" => {
            let (nr, ne) = (arg(0, r), arg(1, e));
            // setreuid(2): the saved uid becomes the new effective one when the real uid is
            // set, or the effective one set to another value than the old real uid.
            let real_set = args.first().is_some_and(|&u| u != uid_t::MAX);
            let eff_other = args.get(1).is_some_and(|&u| u != uid_t::MAX && u != r);
            [nr, ne, if real_set || eff_other { ne } else { s }]
        }
        _ => [arg(0, r), arg(1, e), arg(2, s)],
    }
}

/// The uids to grant for a change from `old` to `new`: a drop of privilege (the real,
/// effective and saved uid all leave the privileged uid, the old effective one) grants the
/// new uids. A temporary switch (one of them stays: `seteuid(u)`, `setresuid(-1, u, 0)`,
/// `setreuid(-1, u)` by root, as sshd, samba and cron do to act for a user for a while) and
/// no change grant nothing.
fn drop_targets(old: [uid_t; 3], new: [uid_t; 3]) -> Vec<uid_t> {
    let privileged = old[1];
    if new.contains(&privileged) {
        return Vec::new();
    }
    let mut uids = new.to_vec();
    uids.sort_unstable();
    uids.dedup();
    uids
}

/// Before the call `call` with `args` (`-1`: unchanged): when it drops the privilege, grant
/// the new uids, per the policy. Returns whether the program opted out (TCP after the
/// change). The grants are made before the C library's call (they need the privilege the
/// call gives up), so a call that then fails (`EAGAIN`, `EINVAL`) leaves them: the uid the
/// program meant to become may use the fabric directory although the process did not change.
fn before_change(call: &str, args: &[uid_t]) -> bool {
    if table::borrowed_memory() {
        // A vfork child between its start and its exec: the memory (and the stack) are
        // its parent's; it makes nothing here.
        return false;
    }
    if !may_change_uid() {
        return false;
    }
    let (mut r, mut e, mut s) = (0, 0, 0);
    // SAFETY: three valid pointers to uid_t.
    if unsafe { libc::getresuid(&mut r, &mut e, &mut s) } != 0 {
        return false;
    }
    let old = [r, e, s];
    let uids = drop_targets(old, uids_after(call, args, old));
    if uids.is_empty() {
        return false;
    }
    if policy() == Policy::Tcp {
        log!("{call} to uid {uids:?}: SMC_UID_CHANGE=tcp, nothing granted; TCP after the change");
        return true;
    }
    let uses_smc = table::ANY.load(Ordering::Relaxed);
    match smc::fdapi::before_uid_change(&uids, uses_smc) {
        Ok(g) => {
            let stack = match (g.stack, g.discovery) {
                (Ok(true), _) => "stack made before the change".to_owned(),
                (Ok(false), Ok(true)) => "no stack yet, eBPF discovery loaded for it".to_owned(),
                (Ok(false), Ok(false)) => "no stack yet".to_owned(),
                (Ok(false), Err(e)) => format!("no stack yet, eBPF discovery not loaded: {e}"),
                (Err(e), _) => format!("no stack: {e}"),
            };
            log!(
                "{call} to uid {uids:?}: fabric directory {} granted ({} paths; {stack})",
                g.dir.display(),
                g.changed.len()
            );
        }
        Err(e) => log!("{call} to uid {uids:?}: fabric directory not granted: {e}"),
    }
    // The programs the process execs after the change load this library as the new user:
    // `smc run` wrote it into a private directory (mode 0700), and the loader could not
    // open it ("cannot be preloaded ... ignored" on their standard error: varnishd's VCL
    // compiler, run as another user, printed it as the compiler's warnings).
    if let Some(lib) = own_path() {
        for &u in &uids {
            if let Err(e) = smc_fabric::access::grant_read(&lib, u) {
                log!(
                    "{call}: library {} not granted to uid {u}: {e}",
                    lib.display()
                );
            }
        }
    }
    if let Some(path) = crate::LOG_PATH.get() {
        use std::os::unix::ffi::OsStrExt;
        let path = std::path::Path::new(std::ffi::OsStr::from_bytes(path.as_bytes()));
        for &u in &uids {
            if let Err(e) = smc_fabric::access::grant_file(path, u) {
                log!(
                    "{call}: SMC_LOG {} not granted to uid {u}: {e}",
                    path.display()
                );
            }
        }
    }
    false
}

/// The path this library was loaded from (the loader's name for it).
fn own_path() -> Option<std::path::PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: an empty Dl_info for dladdr to fill; the address of a function of this library.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::dladdr(own_path as *const libc::c_void, &mut info) };
    if r == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr's NUL-terminated name, valid while the library stays loaded.
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    let path = std::path::Path::new(std::ffi::OsStr::from_bytes(name.to_bytes()));
    path.is_absolute().then(|| path.to_owned())
}

/// After the change: an opted-out program makes no stack from now on.
fn after_change(opted_out: bool, r: c_int) -> c_int {
    if opted_out && r == 0 {
        smc::fdapi::refuse_after_uid_change();
    }
    r
}

/// The C library's function `name` (found on first use: these run a few times per process).
fn real(cache: &AtomicUsize, name: &str) -> usize {
    debug_assert!(name.ends_with('\0'));
    let mut p = cache.load(Ordering::Relaxed);
    if p == 0 {
        // SAFETY: a NUL-terminated name; RTLD_NEXT finds the C library's definition.
        p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr().cast()) } as usize;
        cache.store(p, Ordering::Relaxed);
    }
    p
}

macro_rules! uid_call {
    ($name:ident ( $($arg:ident),+ ) ) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: uid_t),+) -> c_int {
            static REAL: AtomicUsize = AtomicUsize::new(0);
            let p = real(&REAL, concat!(stringify!($name), "\0"));
            if p == 0 {
                crate::set_errno(libc::ENOSYS);
                return -1;
            }
            // SAFETY: the C library's function of this name, of this type.
            let f: unsafe extern "C" fn($($arg: uid_t),+) -> c_int = unsafe { std::mem::transmute(p) };
            if crate::inside() {
                // SAFETY: the caller's arguments, unchanged.
                return unsafe { f($($arg),+) };
            }
            let opted_out = guard(false, || before_change(stringify!($name), &[$($arg),+]));
            // SAFETY: the caller's arguments, unchanged.
            after_change(opted_out, unsafe { f($($arg),+) })
        }
    };
}

uid_call!(setuid(uid));
uid_call!(seteuid(euid));
uid_call!(setreuid(ruid, euid));
uid_call!(setresuid(ruid, euid, suid));

#[cfg(test)]
mod tests {
    use super::*;

    const N: uid_t = uid_t::MAX;
    const ROOT: [uid_t; 3] = [0, 0, 0];

    fn targets(call: &str, args: &[uid_t], old: [uid_t; 3]) -> Vec<uid_t> {
        drop_targets(old, uids_after(call, args, old))
    }

    #[test]
    fn drops_grant() {
        assert_eq!(targets("setuid", &[33], ROOT), [33]);
        assert_eq!(targets("setresuid", &[33, 33, 33], ROOT), [33]);
        assert_eq!(targets("setreuid", &[33, 33], ROOT), [33]);
        // The real uid set: the saved one follows the effective one.
        assert_eq!(targets("setreuid", &[33, 34], ROOT), [33, 34]);
        // A setuid-root program run by user 1000 going back to it.
        assert_eq!(targets("setuid", &[1000], [1000, 0, 0]), [1000]);
        assert_eq!(
            targets("setresuid", &[1000, N, 1000], [1000, 0, 0]),
            Vec::<uid_t>::new()
        );
        assert_eq!(targets("setresuid", &[N, 1000, 1000], [1000, 0, 0]), [1000]);
        // A non-root user holding CAP_SETUID.
        assert_eq!(targets("setuid", &[33], [1000, 1000, 1000]), [33]);
    }

    #[test]
    fn temporary_switches_grant_nothing() {
        assert!(targets("seteuid", &[33], ROOT).is_empty());
        assert!(targets("setresuid", &[N, 33, 0], ROOT).is_empty());
        assert!(targets("setresuid", &[N, 33, N], ROOT).is_empty());
        assert!(targets("setresuid", &[33, 33, 0], ROOT).is_empty());
        // The effective uid set to another than the real one (0): saved follows, real stays.
        assert!(targets("setreuid", &[N, 33], ROOT).is_empty());
        assert!(targets("setreuid", &[0, 33], ROOT).is_empty());
        // No change at all.
        assert!(targets("setuid", &[0], ROOT).is_empty());
        assert!(targets("setresuid", &[N, N, N], ROOT).is_empty());
        assert!(targets("seteuid", &[1000], [1000, 1000, 1000]).is_empty());
    }
}
