//! A program that changes its user id after it started: a server started by root whose
//! workers become `www-data` (nginx's `user`, apache's `User`). The fabric directory of the
//! user who started it is private (mode 0700), so after the change the process could neither
//! make a stack there nor reach its peers' device sockets, and every client was declined.
//!
//! The trust rule: the program root (or a user) chose to run under `smc run` hands its
//! sockets to the new uid, so that uid gets the fabric too. Before a change that drops the
//! privilege (real, effective and saved uid all leave it; the preload library leaves a
//! temporary `seteuid` alone), while the process still has the privilege,
//! [`before_uid_change`] makes the process's stack (its devices, eBPF discovery and control
//! socket, set up with the privileges they need) and grants the new uid the fabric directory
//! (`smc_fabric::access::grant_dirs`). A program run with `SMC_UID_CHANGE=tcp` makes no
//! grant, and after the change no stack ([`refuse_after_uid_change`]): its connections stay
//! TCP, as before this existed.

use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::StackConfig;

/// Set once the program changed its uid under `SMC_UID_CHANGE=tcp`.
static REFUSED: AtomicBool = AtomicBool::new(false);

/// Whether a stack may be made in this process now.
pub(super) fn check_allowed() -> io::Result<()> {
    if REFUSED.load(Ordering::Acquire) {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "the program changed its uid (SMC_UID_CHANGE=tcp): no SMC-R stack after that",
        ));
    }
    Ok(())
}

/// After the program changed its uid with `SMC_UID_CHANGE=tcp`: no stack is made from now on
/// (a stack made before stays), so every later connection of the process is TCP (an
/// accepted client that offered SMC-R is declined), also when an earlier grant left the
/// fabric directory open to the new uid.
pub fn refuse_after_uid_change() {
    REFUSED.store(true, Ordering::Release);
}

/// What [`before_uid_change`] did.
#[derive(Debug)]
pub struct UidGrant {
    /// The fabric directory granted.
    pub dir: PathBuf,
    /// The paths whose ACL now names the new uids (the directories, the sockets in them,
    /// private parents).
    pub changed: Vec<PathBuf>,
    /// Whether the stack was made now (`Err`: why it could not be).
    pub stack: Result<bool, String>,
    /// Without a stack: whether the eBPF discovery was loaded now, for the stack the process
    /// makes after the change (`Err`: why it could not be).
    pub discovery: Result<bool, String>,
}

/// Before the program changes its uid to each of `uids`, while it still has the privilege:
/// make this process's stack when `make_stack` (the program uses SMC-R: it has managed
/// sockets, maybe inherited from the parent that forked it), then grant each uid the fabric
/// directory of the stack (or of the configuration, without one), its device directories,
/// the directory of the control sockets and the sockets in them. Without a stack (a
/// program that drops root before it opens its sockets: mosquitto, mariadbd), the eBPF
/// discovery is loaded now, which needs the privilege, and kept for the stack made later.
pub fn before_uid_change(uids: &[u32], make_stack: bool) -> io::Result<UidGrant> {
    let stack = if make_stack {
        super::stack().map(|_| true).map_err(|e| e.to_string())
    } else {
        Ok(false)
    };
    let discovery = match stack {
        Ok(false) => super::load_discovery_ahead(),
        _ => Ok(false),
    };
    let made = super::STACK
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
        .map(|s| s.config().fabric.clone());
    let fabric = match made {
        Some(f) => f,
        None => {
            super::restore_settings();
            StackConfig::from_env().map_err(io::Error::other)?.fabric
        }
    };
    let mut dirs = smc_fabric::access::fabric_dirs(&fabric);
    dirs.push(crate::control::control_dir(&fabric.dir));
    let mut changed = Vec::new();
    for &uid in uids {
        changed.extend(smc_fabric::access::grant_dirs(&dirs, uid)?);
    }
    Ok(UidGrant {
        dir: fabric.dir,
        changed,
        stack,
        discovery,
    })
}
