//! SMC capability discovery with the TCP experimental option (RFC 7609 §3.1, §3.5.1.1).
//!
//! RFC 7609 §3.5.1.1: "A client who wishes to do SMC-R will include TCP option 254 using an
//! ExID equal to the EBCDIC (codepage IBM-1047) encoding of "SMCR" on its SYN flow." A
//! userspace stack cannot add TCP options through the sockets API, so smc-rs loads a small
//! eBPF `sock_ops` program into a cgroup v2 (its own loader, `loader.rs`, over aya-obj; the
//! maps through aya). Its source is bpf/smc_tcp_option.bpf.c;
//! `scripts/build-bpf.sh` compiles it into bpf/smc_tcp_option.bpf.o, which is committed, so a
//! build needs no clang. The program acts only on sockets this instance marked:
//!
//! - client: [`TcpOptionDiscovery::mark_client`] before `connect()`; the SYN carries the option;
//!   after the handshake [`TcpOptionDiscovery::client_outcome`] says whether the SYN-ACK did too;
//! - server: [`TcpOptionDiscovery::mark_listener`] before `listen()`; a SYN-ACK carries the option
//!   only when the SYN did, and [`TcpOptionDiscovery::server_outcome`] says so per accepted
//!   connection.
//!
//! CLC runs only when both handshake segments carried the option; otherwise the connection
//! stays TCP ("peer did not offer SMC"). Loading needs root (or CAP_BPF + CAP_NET_ADMIN).

use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

#[cfg(feature = "ebpf")]
mod loader;

/// Where the cgroup v2 hierarchy is usually mounted (unified mode, then hybrid mode).
pub const CGROUP2_CANDIDATES: &[&str] = &["/sys/fs/cgroup", "/sys/fs/cgroup/unified"];

/// What the handshake showed about the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Both the SYN and the SYN-ACK carried the SMC option: run CLC.
    BothOffered,
    /// We offered SMC but the peer did not (client: SYN-ACK without the option; server: SYN
    /// without it, so the SYN-ACK did not carry it either).
    PeerDidNotOffer,
}

/// Why discovery could not be set up or queried.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// The crate was built without its `ebpf` feature, so it carries no eBPF program.
    #[error(
        "this build of smc-rs has no eBPF discovery (the `smc` crate's `ebpf` feature is off)"
    )]
    NotBuilt,
    /// No cgroup v2 mount was found.
    #[error("no cgroup v2 hierarchy found (tried {0:?})")]
    NoCgroup2(Vec<PathBuf>),
    /// Opening the cgroup failed.
    #[error("cannot open cgroup {path}: {error}")]
    Cgroup {
        /// The cgroup directory.
        path: PathBuf,
        /// The error.
        error: std::io::Error,
    },
    /// Loading or attaching the program failed (usually missing privileges).
    #[error("cannot load the eBPF program (needs root or CAP_BPF + CAP_NET_ADMIN): {0}")]
    Load(String),
    /// A map operation failed.
    #[error("eBPF map {map}: {msg}")]
    Map {
        /// Which map.
        map: &'static str,
        /// What failed.
        msg: String,
    },
    /// A socket query (SO_COOKIE, local address) failed.
    #[error("socket: {0}")]
    Socket(std::io::Error),
}

// Written by hand rather than `#[from]`, which would also make the error its `source` and so
// print the cause twice in a chain.
impl From<std::io::Error> for DiscoveryError {
    fn from(e: std::io::Error) -> Self {
        DiscoveryError::Socket(e)
    }
}

/// The map key of a passive connection, mirroring `struct smc_flow_key` in the C program:
/// family, local port, remote port (host order), local and remote address (network-order words).
fn flow_key(local: SocketAddr, remote: SocketAddr) -> [u32; 11] {
    let mut k = [0u32; 11];
    let words = |a: &SocketAddr, out: &mut [u32]| match a {
        SocketAddr::V4(v) => out[0] = u32::from_ne_bytes(v.ip().octets()),
        SocketAddr::V6(v) => {
            for (i, c) in v.ip().octets().chunks_exact(4).enumerate() {
                out[i] = u32::from_ne_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
    };
    k[0] = if local.is_ipv4() { 2 } else { 10 };
    k[1] = u32::from(local.port());
    k[2] = u32::from(remote.port());
    words(&local, &mut k[3..7]);
    words(&remote, &mut k[7..11]);
    k
}

/// Where smc-rs mounts a cgroup v2 hierarchy of its own when the process sees none (see
/// [`find_cgroup2`]).
pub const CGROUP2_OWN_MOUNT: &str = "/run/smc-rs/cgroup2";

/// Find the cgroup v2 mount to attach to, in this order:
///
/// 1. `SMC_CGROUP2` if set (a cgroup v2 directory chosen by the operator);
/// 2. the usual places ([`CGROUP2_CANDIDATES`]);
/// 3. any `cgroup2` mount in `/proc/self/mountinfo` (the root of the hierarchy first) —
///    wherever the system mounted it;
/// 4. none visible (for example under `ip netns exec`, which gives the process its own mount
///    namespace and mounts a fresh `/sys` without the cgroup tree): mount the cgroup2
///    hierarchy at [`CGROUP2_OWN_MOUNT`] and use that. There is one cgroup2 hierarchy per
///    cgroup namespace, so this is the same hierarchy the host's `/sys/fs/cgroup` shows; under
///    `ip netns exec` the mount stays inside that command's mount namespace (its `/` is a
///    slave of the host's), elsewhere it stays mounted for later stacks to find in step 3.
///    Mounting needs CAP_SYS_ADMIN, which loading the eBPF program needs anyway.
pub fn find_cgroup2() -> Result<PathBuf, DiscoveryError> {
    if let Some(p) = std::env::var_os("SMC_CGROUP2") {
        let p = PathBuf::from(p);
        if p.join("cgroup.procs").exists() {
            return Ok(p);
        }
        return Err(DiscoveryError::Cgroup {
            path: p,
            error: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "SMC_CGROUP2 is not a cgroup v2 directory (no cgroup.procs)",
            ),
        });
    }
    for c in CGROUP2_CANDIDATES {
        let p = Path::new(c);
        if p.join("cgroup.procs").exists() && p.join("cgroup.subtree_control").exists() {
            return Ok(p.to_path_buf());
        }
        // Hybrid mode: the unified hierarchy has cgroup.procs but no controllers file at /.
        if p.join("cgroup.procs").exists() && *c == "/sys/fs/cgroup/unified" {
            return Ok(p.to_path_buf());
        }
    }
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    if let Some(p) = cgroup2_mounts(&mountinfo)
        .into_iter()
        .find(|p| p.join("cgroup.procs").exists())
    {
        return Ok(p);
    }
    let mut tried: Vec<PathBuf> = CGROUP2_CANDIDATES.iter().map(PathBuf::from).collect();
    tried.push("/proc/self/mountinfo".into());
    tried.push(CGROUP2_OWN_MOUNT.into());
    match mount_cgroup2(Path::new(CGROUP2_OWN_MOUNT)) {
        Ok(p) => Ok(p),
        Err(e) => {
            tracing::debug!(error = %e, "cannot mount a cgroup2 hierarchy");
            Err(DiscoveryError::NoCgroup2(tried))
        }
    }
}

/// The mount points of the cgroup2 file systems listed in a `/proc/self/mountinfo` text, those
/// that show the root of the hierarchy first. Fields: ID, parent, major:minor, root, mount
/// point, options, optional fields, `-`, fs type, source, super options; the mount point has
/// blanks, tabs, newlines and backslashes escaped as `\ooo`.
pub fn cgroup2_mounts(mountinfo: &str) -> Vec<PathBuf> {
    let mut roots = Vec::new();
    let mut others = Vec::new();
    for line in mountinfo.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        if right.split_whitespace().next() != Some("cgroup2") {
            continue;
        }
        let f: Vec<&str> = left.split_whitespace().collect();
        let (Some(root), Some(point)) = (f.get(3), f.get(4)) else {
            continue;
        };
        let p = PathBuf::from(unescape_mountinfo(point));
        if *root == "/" {
            roots.push(p);
        } else {
            others.push(p);
        }
    }
    roots.extend(others);
    roots
}

fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .is_some_and(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        if b[i] == b'\\' && octal {
            let v = u32::from(b[i + 1] - b'0') * 64
                + u32::from(b[i + 2] - b'0') * 8
                + u32::from(b[i + 3] - b'0');
            out.push(v as u8);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Mount the cgroup2 hierarchy at `dir` (created if missing); returns `dir`.
fn mount_cgroup2(dir: &Path) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    if !dir.join("cgroup.procs").exists() {
        match rustix::mount::mount(
            "none",
            dir,
            "cgroup2",
            rustix::mount::MountFlags::empty(),
            None,
        ) {
            Ok(()) => {
                tracing::info!(path = %dir.display(), "mounted a cgroup2 hierarchy for discovery")
            }
            // Two stacks starting at once in one mount namespace (two processes under one
            // `ip netns exec`) both find nothing and both mount: the kernel refuses the second
            // mount of the same hierarchy on the same point (EBUSY), and the first one's
            // mount is the one to use.
            Err(_) if dir.join("cgroup.procs").exists() => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(dir.to_path_buf())
}

#[cfg(feature = "ebpf")]
mod imp {
    use super::*;
    use aya::maps::{HashMap, IterableMap, Map, MapData};
    use std::os::fd::OwnedFd;
    use std::sync::Mutex;

    // The ELF parser needs the object 8-byte aligned, which plain include_bytes! does not give.
    // The object is committed beside its source (scripts/build-bpf.sh regenerates it; the test
    // tests/bpf_object.rs fails when it no longer matches the source).
    static PROGRAM: &[u8] = aya::include_bytes_aligned!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/bpf/smc_tcp_option.bpf.o"
    ));

    /// Client socket states written by the program (see the C source).
    const CLIENT_MARKED: u32 = 1;
    const CLIENT_PEER_OFFERED: u32 = 2;

    struct Maps {
        sockets: HashMap<MapData, u64, u32>,
        listen_ports: HashMap<MapData, u32, u32>,
        accepted: HashMap<MapData, [u32; 11], u32>,
    }

    /// The loaded and attached discovery program; detached when dropped.
    pub struct TcpOptionDiscovery {
        // Kept alive: closing the link (the last descriptor naming it) detaches and unloads the
        // program.
        _link: OwnedFd,
        maps: Mutex<Maps>,
        /// The kernel's ids of the maps (sockets, listen ports, accepted), to tell in a forked
        /// child that its descriptors still name them (see [`Self::usable_after_fork`]).
        map_ids: [u32; 3],
        cgroup: PathBuf,
    }

    /// The error and every source below it, so a failing syscall shows its errno.
    fn chain(e: &dyn std::error::Error) -> String {
        let mut s = e.to_string();
        let mut cur = e.source();
        while let Some(c) = cur {
            s.push_str(": ");
            s.push_str(&c.to_string());
            cur = c.source();
        }
        s
    }

    /// The kernel's ids of the maps, asked through their descriptors.
    fn map_ids(m: &Maps) -> Result<[u32; 3], aya::maps::MapError> {
        Ok([
            m.sockets.map().info()?.id(),
            m.listen_ports.map().info()?.id(),
            m.accepted.map().info()?.id(),
        ])
    }

    fn map_err(map: &'static str) -> impl Fn(aya::maps::MapError) -> DiscoveryError {
        move |e| DiscoveryError::Map {
            map,
            msg: chain(&e),
        }
    }

    impl TcpOptionDiscovery {
        /// Load the program and attach it to `cgroup` (default: the cgroup v2 root), next to
        /// any other programs attached there.
        pub fn load(cgroup: Option<&Path>) -> Result<Self, DiscoveryError> {
            let cgroup = match cgroup {
                Some(p) => p.to_path_buf(),
                None => find_cgroup2()?,
            };
            // Placed as made, as the program's descriptors are (`smc_fabric::fdplace`).
            let dir = smc_fabric::fdplace::make(|| {
                use rustix::fs::{Mode, OFlags};
                let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
                rustix::fs::open(&cgroup, flags, Mode::empty()).map_err(std::io::Error::from)
            })
            .map_err(|error| DiscoveryError::Cgroup {
                path: cgroup.clone(),
                error,
            })?;
            let loaded = super::loader::load_sock_ops(PROGRAM, "smc_tcp_option", &dir)
                .map_err(DiscoveryError::Load)?;
            let mut fds = loaded.maps;
            // Each map as aya's map of its kind (the loader said which).
            let mut take = |name: &'static str| -> Result<Map, DiscoveryError> {
                use super::loader::MapKind;
                let at = fds.iter().position(|(n, _, _)| n == name).ok_or_else(|| {
                    DiscoveryError::Map {
                        map: name,
                        msg: "missing from the object".into(),
                    }
                })?;
                let (_, kind, fd) = fds.swap_remove(at);
                let data = MapData::from_fd(fd).map_err(map_err(name))?;
                Ok(match kind {
                    MapKind::Hash => Map::HashMap(data),
                    MapKind::LruHash => Map::LruHashMap(data),
                })
            };
            let sockets =
                HashMap::try_from(take("smc_sockets")?).map_err(map_err("smc_sockets"))?;
            let listen_ports = HashMap::try_from(take("smc_listen_ports")?)
                .map_err(map_err("smc_listen_ports"))?;
            let accepted =
                HashMap::try_from(take("smc_accepted")?).map_err(map_err("smc_accepted"))?;
            let maps = Maps {
                sockets,
                listen_ports,
                accepted,
            };
            let map_ids = map_ids(&maps).map_err(map_err("info"))?;
            // Every descriptor (maps, link) was placed as it was made (`smc_fabric::fdplace`):
            // none keeps a low number that a program under `smc run` counts on (wrk refuses a
            // socket numbered beyond 10 + 3 × its connections).
            Ok(TcpOptionDiscovery {
                _link: loaded.link,
                maps: Mutex::new(maps),
                map_ids,
                cgroup,
            })
        }

        /// In a process forked from the one that loaded this instance (the fork copied the
        /// instance, its descriptors and its attached program): whether the copy can serve the
        /// child, so that the child needs no program of its own. Loading one costs milliseconds
        /// of CPU (its maps are allocated, the verifier runs) and takes one of the 64 programs
        /// the kernel attaches to a cgroup: a postmaster forks a backend per connection, and
        /// with 80 clients the backends past the limit could not load theirs and declined
        /// their clients (TCP).
        ///
        /// False when a thread of the parent held the maps' lock at the fork (the child would
        /// wait for it forever), or when the program closed or reused the maps' descriptors
        /// since (each must still name the map of the same kernel id). The program stays
        /// attached while any process holds the link's descriptor: the parent, or this child's
        /// copy of it.
        pub fn usable_after_fork(&self) -> bool {
            let m = match self.maps.try_lock() {
                Ok(m) => m,
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => return false,
            };
            matches!(map_ids(&m), Ok(ids) if ids == self.map_ids)
        }

        /// The cgroup the program is attached to.
        pub fn cgroup(&self) -> &Path {
            &self.cgroup
        }

        fn maps(&self) -> std::sync::MutexGuard<'_, Maps> {
            // A panic while holding the lock cannot leave the maps inconsistent (each
            // operation is one syscall), so a poisoned lock is still usable.
            self.maps.lock().unwrap_or_else(|p| p.into_inner())
        }

        /// Mark a client socket before `connect()`: its SYN will carry the SMC option.
        pub fn mark_client(&self, sock: impl AsFd) -> Result<u64, DiscoveryError> {
            let cookie = rustix::net::sockopt::socket_cookie(sock).map_err(std::io::Error::from)?;
            self.maps()
                .sockets
                .insert(cookie, CLIENT_MARKED, 0)
                .map_err(map_err("smc_sockets"))?;
            Ok(cookie)
        }

        /// After `connect()` completed: whether the SYN-ACK carried the option too. Forgets
        /// the socket.
        pub fn client_outcome(&self, cookie: u64) -> Result<Outcome, DiscoveryError> {
            let mut m = self.maps();
            let state = m.sockets.get(&cookie, 0).ok();
            let _ = m.sockets.remove(&cookie);
            Ok(match state {
                Some(CLIENT_PEER_OFFERED) => Outcome::BothOffered,
                _ => Outcome::PeerDidNotOffer,
            })
        }

        /// Forget a marked client socket whose connect failed.
        pub fn unmark_client(&self, cookie: u64) {
            let _ = self.maps().sockets.remove(&cookie);
        }

        /// Mark a listening port before `listen()`: SYN-ACKs answer an SMC SYN with the option.
        pub fn mark_listener(&self, port: u16) -> Result<(), DiscoveryError> {
            self.maps()
                .listen_ports
                .insert(u32::from(port), 1, 0)
                .map_err(map_err("smc_listen_ports"))
        }

        /// Stop marking a listening port.
        pub fn unmark_listener(&self, port: u16) {
            let _ = self.maps().listen_ports.remove(&u32::from(port));
        }

        /// For an accepted connection: whether its SYN carried the option (and so its
        /// SYN-ACK did). Forgets the connection.
        pub fn server_outcome(
            &self,
            local: SocketAddr,
            remote: SocketAddr,
        ) -> Result<Outcome, DiscoveryError> {
            let key = flow_key(local, remote);
            let mut m = self.maps();
            let hit = m.accepted.get(&key, 0).is_ok();
            let _ = m.accepted.remove(&key);
            Ok(if hit {
                Outcome::BothOffered
            } else {
                Outcome::PeerDidNotOffer
            })
        }
    }
}

#[cfg(not(feature = "ebpf"))]
mod imp {
    use super::*;

    /// Discovery is unavailable in this build: the type has no values, so
    /// [`TcpOptionDiscovery::load`] always fails and the other methods can never be called. They
    /// exist so that the runtime compiles the same way with and without the `ebpf` feature.
    pub enum TcpOptionDiscovery {}

    impl TcpOptionDiscovery {
        /// Always [`DiscoveryError::NotBuilt`] in this build.
        pub fn load(_cgroup: Option<&Path>) -> Result<Self, DiscoveryError> {
            let _ = flow_key;
            Err(DiscoveryError::NotBuilt)
        }

        /// The cgroup the program is attached to.
        pub fn cgroup(&self) -> &Path {
            match *self {}
        }

        /// Whether a forked child can use its copy of the instance.
        pub fn usable_after_fork(&self) -> bool {
            match *self {}
        }

        /// Mark a client socket before `connect()`.
        pub fn mark_client(&self, _sock: impl AsFd) -> Result<u64, DiscoveryError> {
            match *self {}
        }

        /// After `connect()` completed: whether the SYN-ACK carried the option too.
        pub fn client_outcome(&self, _cookie: u64) -> Result<Outcome, DiscoveryError> {
            match *self {}
        }

        /// Forget a marked client socket whose connect failed.
        pub fn unmark_client(&self, _cookie: u64) {
            match *self {}
        }

        /// Mark a listening port before `listen()`.
        pub fn mark_listener(&self, _port: u16) -> Result<(), DiscoveryError> {
            match *self {}
        }

        /// Stop marking a listening port.
        pub fn unmark_listener(&self, _port: u16) {
            match *self {}
        }

        /// For an accepted connection: whether its SYN carried the option.
        pub fn server_outcome(
            &self,
            _local: SocketAddr,
            _remote: SocketAddr,
        ) -> Result<Outcome, DiscoveryError> {
            match *self {}
        }
    }
}

pub use imp::TcpOptionDiscovery;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flow_key_layout_matches_the_c_struct() {
        let l: SocketAddr = "192.168.1.10:40000".parse().unwrap();
        let r: SocketAddr = "192.168.1.20:12345".parse().unwrap();
        let k = flow_key(l, r);
        assert_eq!(k[0], 2);
        assert_eq!(k[1], 40000);
        assert_eq!(k[2], 12345);
        assert_eq!(k[3].to_ne_bytes(), [192, 168, 1, 10]);
        assert_eq!(k[7].to_ne_bytes(), [192, 168, 1, 20]);
        assert_eq!(&k[4..7], &[0, 0, 0]);
        let l6: SocketAddr = "[2001:db8::1]:1".parse().unwrap();
        let k6 = flow_key(l6, l6);
        assert_eq!(k6[0], 10);
        assert_eq!(k6[3].to_ne_bytes(), [0x20, 0x01, 0x0d, 0xb8]);
        assert_eq!(k6[6].to_ne_bytes(), [0, 0, 0, 1]);
    }

    #[test]
    fn cgroup2_mounts_from_mountinfo() {
        // A hybrid host (this machine's layout), a bind mount of a sub-cgroup, an escaped
        // mount point, and cgroup v1 / tmpfs lines that must be ignored.
        let text = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
50 40 0:38 /user.slice /mnt/sub rw,relatime shared:9 - cgroup2 cgroup2 rw
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
60 40 0:38 / /run/my\\040cg rw,relatime - cgroup2 none rw,nsdelegate
bogus line
";
        assert_eq!(
            cgroup2_mounts(text),
            vec![
                PathBuf::from("/sys/fs/cgroup/unified"),
                PathBuf::from("/run/my cg"),
                PathBuf::from("/mnt/sub"),
            ]
        );
        assert!(cgroup2_mounts("").is_empty());
        assert_eq!(unescape_mountinfo("a\\011b\\134c\\9"), "a\tb\\c\\9");
    }
}
