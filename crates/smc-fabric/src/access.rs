//! Who may use a fabric directory: the trust check a process makes before it uses one, and
//! the grants that let processes of another user reach it (a server started by root whose
//! workers change their uid to `www-data`; see `docs/preload.md`, "Privilege drop").
//!
//! The fabric directory and its device directories are private (mode 0700): a process
//! reaches a peer's device socket only when it may search every directory on the path and
//! write the socket file. A grant adds a POSIX ACL entry for one more user to the access ACL
//! of each of these directories (read, write, search) and of the sockets in them (read,
//! write), search on a private parent of the directory owned by the granting user, and the
//! sticky bit to the directories (a granted user may add sockets, but not remove or replace
//! those of others). A socket bound later copies the user entries of its directory
//! ([`share_socket`]), since the creation mode (the binder's umask) would leave a new file's
//! inherited ACL entries without write permission.
//!
//! The ACL is Linux's `system.posix_acl_access` extended attribute: a little-endian `u32`
//! version (2), then 8-byte entries `{u16 tag, u16 permission bits, u32 id}` sorted by tag,
//! named entries by id.

use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// The extended attribute holding a file's access ACL.
pub const ACL_ACCESS: &str = "system.posix_acl_access";

/// Read permission bit of an ACL entry.
pub const R: u16 = 4;
/// Write permission bit of an ACL entry.
pub const W: u16 = 2;
/// Search (execute) permission bit of an ACL entry.
pub const X: u16 = 1;

const VERSION: u32 = 2;
const USER_OBJ: u16 = 0x01;
const USER: u16 = 0x02;
const GROUP_OBJ: u16 = 0x04;
const GROUP: u16 = 0x08;
const MASK: u16 = 0x10;
const OTHER: u16 = 0x20;
const NO_ID: u32 = u32::MAX;

/// An ACL attribute that is not in Linux's layout.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AclError {
    /// Shorter than its version word, or not a whole number of entries.
    #[error("ACL attribute of {0} bytes is not a version word plus 8-byte entries")]
    Length(usize),
    /// Another version than 2.
    #[error("ACL version {0}, not 2")]
    Version(u32),
    /// An entry tag Linux does not define.
    #[error("unknown ACL entry tag {0:#x}")]
    Tag(u16),
    /// Permission bits beyond read, write, search.
    #[error("ACL permission bits {0:#x} beyond rwx")]
    Perm(u16),
    /// The owner, owning group or other entry is missing or repeated, or the mask repeated.
    #[error("ACL without exactly one owner, group and other entry (or with two masks)")]
    Base,
}

/// One ACL entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    tag: u16,
    perm: u16,
    id: u32,
}

/// A POSIX access ACL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acl {
    entries: Vec<Entry>,
}

impl Acl {
    /// The ACL a file without one has: its mode's owner, group and other bits.
    pub fn from_mode(mode: u32) -> Acl {
        let bits = |shift: u32| ((mode >> shift) & 7) as u16;
        Acl {
            entries: vec![
                Entry {
                    tag: USER_OBJ,
                    perm: bits(6),
                    id: NO_ID,
                },
                Entry {
                    tag: GROUP_OBJ,
                    perm: bits(3),
                    id: NO_ID,
                },
                Entry {
                    tag: OTHER,
                    perm: bits(0),
                    id: NO_ID,
                },
            ],
        }
    }

    /// Parse an attribute's bytes (read from the file system: checked, never trusted).
    pub fn parse(b: &[u8]) -> Result<Acl, AclError> {
        if b.len() < 4 || !(b.len() - 4).is_multiple_of(8) {
            return Err(AclError::Length(b.len()));
        }
        let version = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        if version != VERSION {
            return Err(AclError::Version(version));
        }
        let mut entries = Vec::with_capacity((b.len() - 4) / 8);
        for e in b[4..].chunks_exact(8) {
            let tag = u16::from_le_bytes([e[0], e[1]]);
            let perm = u16::from_le_bytes([e[2], e[3]]);
            let id = u32::from_le_bytes([e[4], e[5], e[6], e[7]]);
            if ![USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER].contains(&tag) {
                return Err(AclError::Tag(tag));
            }
            if perm & !7 != 0 {
                return Err(AclError::Perm(perm));
            }
            entries.push(Entry { tag, perm, id });
        }
        let count = |t: u16| entries.iter().filter(|e| e.tag == t).count();
        if count(USER_OBJ) != 1 || count(GROUP_OBJ) != 1 || count(OTHER) != 1 || count(MASK) > 1 {
            return Err(AclError::Base);
        }
        Ok(Acl { entries })
    }

    /// The attribute's bytes, entries in the order Linux requires.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut entries = self.entries.clone();
        entries.sort_by_key(|e| (e.tag, e.id));
        let mut out = Vec::with_capacity(4 + 8 * entries.len());
        out.extend_from_slice(&VERSION.to_le_bytes());
        for e in entries {
            out.extend_from_slice(&e.tag.to_le_bytes());
            out.extend_from_slice(&e.perm.to_le_bytes());
            out.extend_from_slice(&e.id.to_le_bytes());
        }
        out
    }

    fn perm_of(&self, tag: u16) -> Option<u16> {
        self.entries.iter().find(|e| e.tag == tag).map(|e| e.perm)
    }

    /// Give user `uid` at least `perm` (adding to what an entry of that user has). The mask
    /// (the bound of the group class: the owning group, named users and named groups) is
    /// widened to `perm`, or made, when the ACL had none, from the owning group's bits and
    /// the named entries. Nobody else gains anything: when the mask widens, every other
    /// group-class entry is narrowed to what the old mask let it have (an entry hidden by the
    /// mask, an administrator's `g:adm:rwx` under a `---` mask, stays without effect).
    pub fn grant_user(&mut self, uid: u32, perm: u16) {
        let perm = perm & 7;
        if let Some(old) = self.perm_of(MASK) {
            if perm & !old != 0 {
                for e in self.entries.iter_mut() {
                    if matches!(e.tag, GROUP_OBJ | GROUP) || (e.tag == USER && e.id != uid) {
                        e.perm &= old;
                    } else if e.tag == USER {
                        // The user's own bits beyond `perm` that the old mask hid stay hidden.
                        e.perm = (e.perm & old) | perm;
                    }
                }
            }
        }
        match self
            .entries
            .iter_mut()
            .find(|e| e.tag == USER && e.id == uid)
        {
            Some(e) => e.perm |= perm,
            None => self.entries.push(Entry {
                tag: USER,
                perm,
                id: uid,
            }),
        }
        match self.entries.iter_mut().find(|e| e.tag == MASK) {
            Some(m) => m.perm |= perm,
            None => {
                let class = self
                    .entries
                    .iter()
                    .filter(|e| matches!(e.tag, GROUP_OBJ | USER | GROUP))
                    .fold(0, |a, e| a | e.perm);
                self.entries.push(Entry {
                    tag: MASK,
                    perm: class,
                    id: NO_ID,
                });
            }
        }
    }

    /// What user `uid`'s own entry allows (bounded by the mask); `None` without one.
    pub fn user_perm(&self, uid: u32) -> Option<u16> {
        let mask = self.perm_of(MASK).unwrap_or(7);
        self.entries
            .iter()
            .find(|e| e.tag == USER && e.id == uid)
            .map(|e| e.perm & mask)
    }

    /// The users named in the ACL.
    pub fn named_users(&self) -> Vec<u32> {
        self.entries
            .iter()
            .filter(|e| e.tag == USER)
            .map(|e| e.id)
            .collect()
    }

    /// Whether the owning group, a named group or anybody else may write (named users may:
    /// the owner, or root, granted them).
    pub fn others_may_write(&self) -> bool {
        let mask = self.perm_of(MASK).unwrap_or(7);
        self.entries.iter().any(|e| match e.tag {
            GROUP_OBJ | GROUP => e.perm & mask & W != 0,
            OTHER => e.perm & W != 0,
            _ => false,
        })
    }
}

/// The access ACL of `path` (a symbolic link is not followed); `None` when it has none
/// beyond its mode (or the file system keeps none).
pub fn read_acl(path: &Path) -> io::Result<Option<Acl>> {
    let mut buf = vec![0u8; 4096];
    match rustix::fs::lgetxattr(path, ACL_ACCESS, &mut buf[..]) {
        Ok(n) => Acl::parse(&buf[..n])
            .map(Some)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e)),
        Err(rustix::io::Errno::NODATA | rustix::io::Errno::OPNOTSUPP) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// A file held by an `O_PATH` descriptor opened without following a symbolic link: what is
/// checked and what is changed are the same inode, whatever is renamed or linked in its
/// place meanwhile. Its attributes and mode are changed through `/proc/self/fd/N` (which
/// names the inode held: an `O_PATH` descriptor takes no `fsetxattr` or `fchmod`).
struct Node {
    fd: rustix::fd::OwnedFd,
    st: rustix::fs::Stat,
}

impl Node {
    /// `path` (relative to the directory `at`), never through a symbolic link.
    fn open(at: impl rustix::fd::AsFd, path: &Path, shown: &Path) -> io::Result<Node> {
        use rustix::fs::OFlags;
        let flags = OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = rustix::fs::openat(at, path, flags, rustix::fs::Mode::empty())?;
        let st = rustix::fs::fstat(&fd)?;
        if rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Symlink {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is a symbolic link", shown.display()),
            ));
        }
        Ok(Node { fd, st })
    }

    fn proc(&self) -> PathBuf {
        use std::os::fd::AsRawFd;
        PathBuf::from(format!("/proc/self/fd/{}", self.fd.as_raw_fd()))
    }

    fn kind(&self) -> rustix::fs::FileType {
        rustix::fs::FileType::from_raw_mode(self.st.st_mode)
    }

    fn acl(&self) -> io::Result<Option<Acl>> {
        acl_at(&self.proc())
    }
}

/// The access ACL of the file `path` names, following links (`/proc/self/fd/N`).
fn acl_at(path: &Path) -> io::Result<Option<Acl>> {
    let mut buf = vec![0u8; 4096];
    match rustix::fs::getxattr(path, ACL_ACCESS, &mut buf[..]) {
        Ok(n) => Acl::parse(&buf[..n])
            .map(Some)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e)),
        Err(rustix::io::Errno::NODATA | rustix::io::Errno::OPNOTSUPP) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Give user `uid` at least `perm` on `path` (an entry in its access ACL; nothing for the
/// file's owner). A symbolic link is an error. Needs the file's ownership or CAP_FOWNER.
pub fn grant(path: &Path, uid: u32, perm: u16) -> io::Result<()> {
    grant_node(&Node::open(rustix::fs::CWD, path, path)?, uid, perm)
}

fn grant_node(node: &Node, uid: u32, perm: u16) -> io::Result<()> {
    if node.st.st_uid == uid {
        // The owner's own permissions (user_obj) apply to it, never a named entry.
        return Ok(());
    }
    let mut acl = node
        .acl()?
        .unwrap_or_else(|| Acl::from_mode(node.st.st_mode));
    if acl.user_perm(uid).is_some_and(|p| p & perm == perm) {
        return Ok(());
    }
    acl.grant_user(uid, perm);
    rustix::fs::setxattr(
        node.proc(),
        ACL_ACCESS,
        &acl.to_bytes(),
        rustix::fs::XattrFlags::empty(),
    )?;
    Ok(())
}

/// Whether a process other than the owner (and the users its ACL names) may write to the
/// file `md` describes at `path`. An ACL that cannot be read counts as writable.
pub fn others_may_write(path: &Path, md: &std::fs::Metadata) -> bool {
    if md.mode() & 0o002 != 0 {
        return true;
    }
    match read_acl(path) {
        Ok(Some(acl)) => acl.others_may_write(),
        Ok(None) => md.mode() & 0o020 != 0,
        Err(_) => true,
    }
}

/// Why the directory `dir` must not hold fabric sockets, or `None` when it may: it must be
/// a directory (not a symbolic link) owned by the calling user or by root (which may do
/// anything to the caller anyway), that nobody else may write to except the users its owner
/// named in its ACL.
pub fn untrusted_dir(dir: &Path) -> io::Result<Option<String>> {
    let md = std::fs::symlink_metadata(dir)?;
    Ok(if md.file_type().is_symlink() {
        Some("a symbolic link".to_owned())
    } else if !md.is_dir() {
        Some("not a directory".to_owned())
    } else {
        untrusted_owner_mode(md.uid(), md.mode(), || read_acl(dir))
    })
}

/// [`untrusted_dir`] of the directory `node` holds.
fn untrusted_node(node: &Node) -> io::Result<Option<String>> {
    Ok(if node.kind() != rustix::fs::FileType::Directory {
        Some("not a directory".to_owned())
    } else {
        untrusted_owner_mode(node.st.st_uid, node.st.st_mode, || node.acl())
    })
}

/// The owner and write parts of the trust check, of a directory of `owner` and `mode` whose
/// ACL `acl` reads.
fn untrusted_owner_mode(
    owner: u32,
    mode: u32,
    acl: impl FnOnce() -> io::Result<Option<Acl>>,
) -> Option<String> {
    let me = rustix::process::getuid().as_raw();
    let writable = mode & 0o002 != 0
        || match acl() {
            Ok(Some(acl)) => acl.others_may_write(),
            Ok(None) => mode & 0o020 != 0,
            Err(_) => true,
        };
    if owner != me && owner != 0 {
        Some(format!(
            "owned by uid {owner}, not by us (uid {me}) or root"
        ))
    } else if writable {
        Some(format!("writable by others (mode {:o})", mode & 0o7777))
    } else {
        None
    }
}

/// After binding the socket `sock` in `dir`: give the users `dir`'s ACL names read and write
/// on it (a connect needs write), and the directory's owner when the socket is another
/// user's (a worker that changed its uid binds sockets the starting user's peers connect
/// to). Without an ACL on `dir`, and for the owner's own sockets, nothing changes.
pub fn share_socket(sock: &Path, dir: &Path) -> io::Result<()> {
    let dmd = std::fs::symlink_metadata(dir)?;
    let smd = std::fs::symlink_metadata(sock)?;
    let mut users = read_acl(dir)?.map(|a| a.named_users()).unwrap_or_default();
    if smd.uid() != dmd.uid() {
        users.push(dmd.uid());
    }
    users.retain(|&u| u != smd.uid());
    for u in users {
        grant(sock, u, R | W)?;
    }
    Ok(())
}

/// The directories of `cfg` that processes of the fabric create sockets in: the fabric
/// directory and the directory of each shared-memory device.
pub fn fabric_dirs(cfg: &crate::FabricConfig) -> Vec<PathBuf> {
    let mut v = vec![cfg.dir.clone()];
    for d in &cfg.devices {
        if d.kind == crate::DeviceKind::Shm {
            v.push(cfg.dir.join(&d.name));
        }
    }
    v
}

/// Let user `uid` use the directories `dirs` (each made, private, if missing; each must pass
/// [`untrusted_dir`]): read, write and search on them, the sticky bit on them, read and
/// write on the sockets already in them that the directory's owner or the calling user owns
/// (not one a granted user linked in: its ACL is not ours to edit), and search on every
/// parent of each that others may not search and that the calling user owns. Returns the
/// paths changed. A private parent of another user is an error (that user's directory is
/// not ours to open). Each directory and socket is checked and changed through one
/// descriptor opened without following links, so a symbolic link or another file put in
/// its place meanwhile cannot redirect the changes.
pub fn grant_dirs(dirs: &[PathBuf], uid: u32) -> io::Result<Vec<PathBuf>> {
    use std::os::unix::fs::DirBuilderExt;
    let me = rustix::process::geteuid().as_raw();
    let mut changed = Vec::new();
    for dir in dirs {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
        let node = Node::open(rustix::fs::CWD, dir, dir)?;
        if let Some(why) = untrusted_node(&node)? {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("{} is {why}", dir.display()),
            ));
        }
        let mut node = node;
        if node.st.st_mode & 0o1000 == 0 {
            // The group bits of a file with an ACL are its mask: kept as they are.
            rustix::fs::chmod(
                node.proc(),
                rustix::fs::Mode::from_raw_mode((node.st.st_mode & 0o7777) | 0o1000),
            )?;
            node.st = rustix::fs::fstat(&node.fd)?;
        }
        grant_node(&node, uid, R | W | X)?;
        changed.push(dir.clone());
        for e in std::fs::read_dir(node.proc())?.flatten() {
            if !e.file_type().is_ok_and(|t| t.is_socket()) {
                continue;
            }
            let path = dir.join(e.file_name());
            let sock = match Node::open(&node.fd, Path::new(&e.file_name()), &path) {
                Ok(s) => s,
                // Removed meanwhile (its process ended).
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            let owner = sock.st.st_uid;
            if sock.kind() != rustix::fs::FileType::Socket
                || (owner != node.st.st_uid && owner != me)
            {
                continue;
            }
            grant_node(&sock, uid, R | W)?;
            changed.push(path);
        }
    }
    changed.extend(grant_search(dirs, uid)?);
    Ok(changed)
}

/// Let user `uid` read and write the file `path` (made, mode 0644, if missing: a log file),
/// with search on its private parents as [`grant_dirs`] gives. Returns the paths changed:
/// none for what is not a regular file of the calling user (`/dev/null`, another user's
/// file) or one anybody may write already.
pub fn grant_file(path: &Path, uid: u32) -> io::Result<Vec<PathBuf>> {
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)?;
    let md = std::fs::symlink_metadata(path)?;
    let me = rustix::process::geteuid().as_raw();
    if !md.is_file() || md.uid() != me || md.mode() & 0o006 == 0o006 {
        return Ok(Vec::new());
    }
    grant(path, uid, R | W)?;
    let mut changed = vec![path.to_owned()];
    changed.extend(grant_search(&[path.to_owned()], uid)?);
    Ok(changed)
}

/// Let user `uid` read the existing file `path` (the preload library, which a program's
/// descendants load after it changed its uid), with search on its private parents as
/// [`grant_dirs`] gives: never write, so the granted user cannot change what the calling
/// user loads. Returns the paths changed: none for what is not a regular file of the calling
/// user, or one anybody may read already.
pub fn grant_read(path: &Path, uid: u32) -> io::Result<Vec<PathBuf>> {
    let md = std::fs::symlink_metadata(path)?;
    let me = rustix::process::geteuid().as_raw();
    if !md.is_file() || md.uid() != me || md.mode() & 0o004 != 0 {
        return Ok(Vec::new());
    }
    grant(path, uid, R)?;
    let mut changed = vec![path.to_owned()];
    changed.extend(grant_search(&[path.to_owned()], uid)?);
    Ok(changed)
}

/// Search for `uid` on every parent of `paths` (other than `paths` themselves) that others
/// may not search, the calling user owns, and `uid` may not search yet.
fn grant_search(paths: &[PathBuf], uid: u32) -> io::Result<Vec<PathBuf>> {
    let mut changed = Vec::new();
    let me = rustix::process::geteuid().as_raw();
    let paths = paths
        .iter()
        .map(std::path::absolute)
        .collect::<io::Result<Vec<_>>>()?;
    for dir in &paths {
        for parent in dir
            .ancestors()
            .skip(1)
            .filter(|p| !p.as_os_str().is_empty())
        {
            if paths.iter().any(|d| d == parent) || changed.iter().any(|d| d == parent) {
                continue;
            }
            let md = std::fs::metadata(parent)?;
            if md.mode() & 0o001 != 0 {
                continue;
            }
            let acl = read_acl(parent)?;
            if md.uid() == uid
                || acl
                    .as_ref()
                    .and_then(|a| a.user_perm(uid))
                    .is_some_and(|p| p & X != 0)
            {
                continue;
            }
            if md.uid() != me {
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!(
                        "uid {uid} may not search {} (owned by uid {}, not by us)",
                        parent.display(),
                        md.uid()
                    ),
                ));
            }
            grant(parent, uid, X)?;
            changed.push(parent.to_owned());
        }
    }
    Ok(changed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn from_mode_round_trips() {
        let a = Acl::from_mode(0o750);
        let b = a.to_bytes();
        assert_eq!(b.len(), 4 + 3 * 8);
        assert_eq!(Acl::parse(&b).expect("parse"), a);
        assert!(!a.others_may_write());
        assert!(Acl::from_mode(0o770).others_may_write());
        assert!(Acl::from_mode(0o702).others_may_write());
    }

    #[test]
    fn grant_adds_a_user_and_a_mask() {
        let mut a = Acl::from_mode(0o700);
        a.grant_user(33, R | W | X);
        assert_eq!(a.user_perm(33), Some(7));
        assert_eq!(a.user_perm(34), None);
        assert_eq!(a.perm_of(MASK), Some(7));
        // A named user may write; the owning group and others still may not.
        assert!(!a.others_may_write());
        // Sorted as Linux requires: owner, user, group, mask, other.
        let b = a.to_bytes();
        let tags: Vec<u16> = b[4..]
            .chunks_exact(8)
            .map(|e| u16::from_le_bytes([e[0], e[1]]))
            .collect();
        assert_eq!(tags, [USER_OBJ, USER, GROUP_OBJ, MASK, OTHER]);
        assert_eq!(Acl::parse(&b).expect("parse"), {
            let mut s = a.clone();
            s.entries.sort_by_key(|e| (e.tag, e.id));
            s
        });
        // A second grant widens the entry, not a new one.
        a.grant_user(33, X);
        a.grant_user(1000, X);
        assert_eq!(a.named_users(), [33, 1000]);
    }

    #[test]
    fn a_narrow_mask_is_widened_for_the_grant() {
        let mut a = Acl::from_mode(0o700);
        a.grant_user(5, X);
        assert_eq!(a.perm_of(MASK), Some(X));
        a.grant_user(33, R | W);
        assert_eq!(a.user_perm(33), Some(R | W));
        assert_eq!(a.user_perm(5), Some(X));
    }

    /// Group-class entries hidden by a narrow mask stay without effect when a grant widens
    /// it: only the granted user gains.
    #[test]
    fn a_grant_unmasks_nobody_else() {
        // user::rwx, user:5:rwx, group::rwx, group:4(adm):rwx, mask::--x, other::---
        let mut b = VERSION.to_le_bytes().to_vec();
        for (tag, perm, id) in [
            (USER_OBJ, 7, NO_ID),
            (USER, 7, 5),
            (USER, 4, 33),
            (GROUP_OBJ, 7, NO_ID),
            (GROUP, 7, 4),
            (MASK, X, NO_ID),
            (OTHER, 0, NO_ID),
        ] {
            b.extend_from_slice(&u16::to_le_bytes(tag));
            b.extend_from_slice(&u16::to_le_bytes(perm));
            b.extend_from_slice(&u32::to_le_bytes(id));
        }
        let mut a = Acl::parse(&b).expect("parse");
        assert!(!a.others_may_write());
        a.grant_user(33, R | W);
        let a = Acl::parse(&a.to_bytes()).expect("round trip");
        assert_eq!(a.perm_of(MASK), Some(R | W | X));
        assert_eq!(a.user_perm(33), Some(R | W));
        assert_eq!(
            a.user_perm(5),
            Some(X),
            "another named user keeps what it had"
        );
        assert_eq!(a.perm_of(GROUP_OBJ), Some(X));
        let adm = a.entries.iter().find(|e| e.tag == GROUP).map(|e| e.perm);
        assert_eq!(adm, Some(X), "the named group keeps what it had");
        assert!(!a.others_may_write(), "still trusted after the grant");
        // A grant within the mask changes no other entry.
        let mut c = a.clone();
        c.grant_user(1000, R);
        c.entries.retain(|e| !(e.tag == USER && e.id == 1000));
        assert_eq!(c, a);
    }

    #[test]
    fn a_writable_group_entry_is_seen_through_the_mask() {
        let mut a = Acl::from_mode(0o770);
        a.grant_user(33, R);
        // Mask made from the group bits (rwx) and the entry: the group may write.
        assert!(a.others_may_write());
        if let Some(m) = a.entries.iter_mut().find(|e| e.tag == MASK) {
            m.perm = R;
        }
        assert!(!a.others_may_write());
    }

    #[test]
    fn bad_attributes_are_errors() {
        assert_eq!(Acl::parse(&[]), Err(AclError::Length(0)));
        assert_eq!(Acl::parse(&[2, 0, 0, 0, 1]), Err(AclError::Length(5)));
        let mut b = Acl::from_mode(0o700).to_bytes();
        b[0] = 1;
        assert_eq!(Acl::parse(&b), Err(AclError::Version(1)));
        let mut b = Acl::from_mode(0o700).to_bytes();
        b[4] = 0x40;
        assert_eq!(Acl::parse(&b), Err(AclError::Tag(0x40)));
        let mut b = Acl::from_mode(0o700).to_bytes();
        b[6] = 8;
        assert_eq!(Acl::parse(&b), Err(AclError::Perm(8)));
        // Without the other entry.
        let b = Acl::from_mode(0o700).to_bytes();
        assert_eq!(Acl::parse(&b[..b.len() - 8]), Err(AclError::Base));
    }

    /// On the file system: a directory whose named group's write is hidden by a `---` mask
    /// (trusted) stays trusted after a grant, and the group gains nothing.
    #[test]
    fn a_grant_on_disk_unmasks_no_group() {
        let dir = std::env::temp_dir().join(format!("smc-access-mask-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).expect("mkdir");
        let mut acl = Acl::from_mode(0o700);
        acl.entries.push(Entry {
            tag: GROUP,
            perm: 7,
            id: 4,
        });
        acl.entries.push(Entry {
            tag: MASK,
            perm: 0,
            id: NO_ID,
        });
        match rustix::fs::lsetxattr(
            &dir,
            ACL_ACCESS,
            &acl.to_bytes(),
            rustix::fs::XattrFlags::empty(),
        ) {
            Ok(()) => {}
            Err(rustix::io::Errno::OPNOTSUPP) => {
                eprintln!("skipped: no ACLs on {}", dir.display());
                let _ = std::fs::remove_dir_all(&dir);
                return;
            }
            Err(e) => panic!("set: {e}"),
        }
        assert_eq!(untrusted_dir(&dir).expect("stat"), None, "trusted before");
        let me = rustix::process::geteuid().as_raw();
        let other = if me == 0 { 33 } else { me + 1 };
        grant(&dir, other, R | W | X).expect("grant");
        assert_eq!(untrusted_dir(&dir).expect("stat"), None, "trusted after");
        let after = read_acl(&dir).expect("acl").expect("has one");
        assert_eq!(after.user_perm(other), Some(7));
        let mask = after.perm_of(MASK).unwrap_or(7);
        for e in after
            .entries
            .iter()
            .filter(|e| matches!(e.tag, GROUP_OBJ | GROUP))
        {
            assert_eq!(
                e.perm & mask,
                0,
                "group entry {e:?} gained under mask {mask}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// On the file system: a socket of a third user in a granted directory (a granted user
    /// could link one in) keeps its ACL; a symbolic link given as a fabric directory is
    /// refused and its target left alone.
    #[test]
    fn grant_dirs_touches_only_ours() {
        let dir = std::env::temp_dir().join(format!("smc-access-own-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let fab = dir.join("fab");
        std::fs::create_dir_all(&fab).expect("mkdir");
        std::fs::set_permissions(&fab, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        let me = rustix::process::geteuid().as_raw();
        let other = if me == 0 { 33 } else { me + 1 };
        let mine = fab.join("mine.sock");
        let theirs = fab.join("theirs.sock");
        let _a = std::os::unix::net::UnixListener::bind(&mine).expect("bind");
        let _b = std::os::unix::net::UnixListener::bind(&theirs).expect("bind");
        // As root: the socket becomes a third user's (neither the directory's owner nor us).
        let third = me == 0 && std::os::unix::fs::lchown(&theirs, Some(4242), None).is_ok();
        match grant_dirs(std::slice::from_ref(&fab), other) {
            Ok(changed) => {
                assert!(changed.contains(&mine));
                assert_eq!(changed.contains(&theirs), !third);
            }
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                eprintln!("skipped: no ACLs on {}", dir.display());
                let _ = std::fs::remove_dir_all(&dir);
                return;
            }
            Err(e) => panic!("grant: {e}"),
        }
        assert_eq!(
            read_acl(&mine)
                .expect("acl")
                .and_then(|a| a.user_perm(other)),
            Some(R | W)
        );
        if third {
            assert_eq!(
                read_acl(&theirs).expect("acl"),
                None,
                "a third user's socket"
            );
        } else {
            eprintln!("not root: the third-user socket case is not run");
        }
        // A symbolic link in place of a fabric directory: refused, its target unchanged.
        let target = dir.join("target");
        std::fs::create_dir(&target).expect("mkdir");
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        let link = dir.join("link");
        std::os::unix::fs::symlink(&target, &link).expect("symlink");
        assert!(grant_dirs(std::slice::from_ref(&link), other).is_err());
        assert!(grant(&link, other, R).is_err());
        assert_eq!(read_acl(&target).expect("acl"), None);
        let md = std::fs::metadata(&target).expect("stat");
        assert_eq!(md.mode() & 0o7777, 0o700, "no sticky bit through the link");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// On the file system (ext4, tmpfs and most others keep ACLs): a private directory with
    /// a grant stays trusted, a socket bound in it shares the grant, and a writable group
    /// makes it untrusted. Skipped where the file system keeps no ACLs.
    #[test]
    fn grants_on_disk() {
        let dir = std::env::temp_dir().join(format!("smc-access-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let fab = dir.join("fab");
        let dev = fab.join("shm0");
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        let me = rustix::process::geteuid().as_raw();
        let other = if me == 0 { 33 } else { me + 1 };
        let changed = match grant_dirs(&[fab.clone(), dev.clone()], other) {
            Ok(c) => c,
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                eprintln!("skipped: no ACLs on {}", dir.display());
                let _ = std::fs::remove_dir_all(&dir);
                return;
            }
            Err(e) => panic!("grant: {e}"),
        };
        assert!(changed.contains(&dir), "the private parent gets search");
        assert_eq!(
            read_acl(&dir)
                .expect("acl")
                .and_then(|a| a.user_perm(other)),
            Some(X)
        );
        for d in [&fab, &dev] {
            assert_eq!(untrusted_dir(d).expect("stat"), None, "{}", d.display());
            let md = std::fs::metadata(d).expect("stat");
            assert_eq!(md.mode() & 0o1000, 0o1000, "sticky");
            assert_eq!(
                read_acl(d).expect("acl").and_then(|a| a.user_perm(other)),
                Some(7)
            );
        }
        let sock = dev.join("x.sock");
        let _l = std::os::unix::net::UnixListener::bind(&sock).expect("bind");
        share_socket(&sock, &dev).expect("share");
        assert_eq!(
            read_acl(&sock)
                .expect("acl")
                .and_then(|a| a.user_perm(other)),
            Some(R | W)
        );
        // A log file in the private parent: read and write for the user; /dev/null untouched.
        let log = dir.join("smc.log");
        assert_eq!(
            grant_file(&log, other).expect("log"),
            std::slice::from_ref(&log)
        );
        assert_eq!(
            read_acl(&log)
                .expect("acl")
                .and_then(|a| a.user_perm(other)),
            Some(R | W)
        );
        assert!(grant_file(Path::new("/dev/null"), other)
            .expect("null")
            .is_empty());
        // A private library beside it: read only (never write); /dev/null untouched.
        let lib = dir.join("lib.so");
        std::fs::write(&lib, b"x").expect("write");
        std::fs::set_permissions(&lib, std::fs::Permissions::from_mode(0o500)).expect("chmod");
        assert_eq!(
            grant_read(&lib, other).expect("lib"),
            std::slice::from_ref(&lib)
        );
        assert_eq!(
            read_acl(&lib)
                .expect("acl")
                .and_then(|a| a.user_perm(other)),
            Some(R)
        );
        assert!(grant_read(Path::new("/dev/null"), other)
            .expect("null")
            .is_empty());
        // Granting again changes nothing and succeeds.
        grant_dirs(&[fab.clone(), dev.clone()], other).expect("again");
        // A group that may write makes the directory untrusted, ACL or not.
        let md = std::fs::metadata(&dev).expect("stat");
        std::fs::set_permissions(
            &dev,
            std::fs::Permissions::from_mode((md.mode() & 0o7777) | 0o070),
        )
        .expect("chmod");
        let mut acl = read_acl(&dev).expect("acl").expect("has one");
        if let Some(g) = acl.entries.iter_mut().find(|e| e.tag == GROUP_OBJ) {
            g.perm = 7;
        }
        rustix::fs::lsetxattr(
            &dev,
            ACL_ACCESS,
            &acl.to_bytes(),
            rustix::fs::XattrFlags::empty(),
        )
        .expect("set");
        assert!(untrusted_dir(&dev).expect("stat").is_some());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
