//! Many smc-rs processes on one address: every device socket of every process on
//! `<address>:4791` joins one `SO_REUSEPORT` group, and an eBPF `SK_REUSEPORT` program attached
//! to the group steers each datagram by the BTH destination QP number to the socket of the
//! process that owns that QPN — what a real RDMA NIC does in hardware (rocev2.md 16).
//!
//! * QPN ranges: the 24-bit QPN space is cut into 256 slots of 65,536 QPNs; slot `s` owns QPNs
//!   `s << 16 ..= (s << 16) | 0xFFFF`. The program reads the most significant byte of the
//!   destination QPN (byte 5 of the BTH, 8 + 5 bytes into the UDP datagram) and selects the
//!   socket stored under that key of a `REUSEPORT_SOCKARRAY` map.
//! * Slot allocation without collisions: a socket takes the first key whose insert with
//!   `BPF_NOEXIST` succeeds, so two processes never hold one slot, and the kernel removes the
//!   socket from the map when it closes — a slot of a process that died (even by SIGKILL) is
//!   free again with nothing to clean up.
//! * The map is shared through a small registry file in the fabric directory,
//!   `roce-<netns inode>-<address>-4791.reuseport`, holding the map's id; it is read and written
//!   under `flock`, so joins are serialised. A process opens the map by id (or creates it when
//!   the id is stale, i.e. no process of the group is left), binds, attaches its own copy of the
//!   program (every copy is equivalent, so the group's program survives any member's exit), and
//!   inserts its socket.
//! * IPv6 GIDs: a device's socket on each of its IPv6 addresses joins that address's group in
//!   the same way, but takes the key its IPv4 socket got ([`Slot::Exactly`]), so one QPN range
//!   belongs to one process on every address of the device (a QP's packets arrive on whichever
//!   address its peer's GID names). A process whose IPv4 socket is alone on its port binds its
//!   IPv6 sockets alone too ([`Slot::Alone`]).
//! * A datagram whose QPN slot has no socket is dropped: the QPs of that range are gone, and a
//!   real NIC drops a packet for an unknown QP too.
//!
//! The program is 22 instructions, written below as bytecode, so no object file and no compiler
//! are involved. Loading it needs `CAP_BPF` (and `CAP_SYS_ADMIN` to open a map by id); a process
//! without them binds the port alone, as before, and a second process then gets a clear error.

use std::io::{Read, Seek, Write};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use rustix::io::Errno;

/// QPN slots: the most significant byte of a 24-bit QPN.
pub(crate) const SLOTS: u32 = 256;
/// QPNs per slot.
pub(crate) const SLOT_SHIFT: u32 = 16;

/// How a device socket got its port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Binding {
    /// In the shared group; the process owns QPN slot `slot`.
    Shared { slot: u32 },
    /// Alone on the port (no eBPF privileges): every QPN is this socket's.
    Exclusive,
}

impl Binding {
    /// The first QPN of the range this binding may hand out and the range's size.
    pub(crate) fn qpn_range(self) -> (u32, u32) {
        match self {
            Binding::Shared { slot } => (slot << SLOT_SHIFT, 1 << SLOT_SHIFT),
            Binding::Exclusive => (0, 1 << 24),
        }
    }
}

/// Why the port could not be had.
#[derive(Debug)]
pub(crate) enum BindError {
    /// The port is taken by a socket outside smc-rs's shared group.
    InUse { shared: bool },
    /// The port is held by a reuseport group this process's registry does not know (smc-rs
    /// processes with another fabric directory): joining it would break their steering.
    ForeignGroup { registry: std::path::PathBuf },
    /// All 256 QPN slots are held by live processes.
    SlotsFull,
    /// The QPN slot asked for ([`Slot::Exactly`]) is held by another socket of the group.
    SlotTaken(u32),
    /// Any other failure, described.
    Other(String),
}

/// Which QPN slot a socket asks for when it joins a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slot {
    /// The first free one (a device's IPv4 socket).
    Any,
    /// This one (a device's IPv6 socket: the slot of its IPv4 socket).
    Exactly(u32),
    /// None: bind alone, without a group (the IPv4 socket is alone too).
    Alone,
}

pub(crate) fn bind(
    sock: &OwnedFd,
    ip: IpAddr,
    port: u16,
    dir: &Path,
    want: Slot,
) -> Result<Binding, BindError> {
    let addr = SocketAddr::new(ip, port);
    if want == Slot::Alone {
        return match rustix::net::bind(sock, &addr) {
            Ok(()) => Ok(Binding::Exclusive),
            Err(Errno::ADDRINUSE) => Err(BindError::InUse { shared: false }),
            Err(e) => Err(BindError::Other(format!("bind {addr}: {e}"))),
        };
    }
    let registry = match Registry::open(dir, ip, port) {
        Ok(r) => Some(r),
        Err(e) => {
            tracing::debug!(error = %e, "roce: no reuseport registry; binding alone");
            None
        }
    };
    let map = match &registry {
        Some(r) => match r.map() {
            Ok(m) => Some(m),
            Err(e) => {
                // EPERM: no CAP_BPF. Share nothing; bind alone.
                tracing::debug!(error = %e, "roce: no eBPF steering; binding {addr} alone");
                None
            }
        },
        None => None,
    };
    let Some((map, fresh)) = map else {
        return match rustix::net::bind(sock, &addr) {
            Ok(()) => Ok(Binding::Exclusive),
            Err(Errno::ADDRINUSE) => Err(BindError::InUse { shared: false }),
            Err(e) => Err(BindError::Other(format!("bind {addr}: {e}"))),
        };
    };
    // A new map while the port is already bound: either the owner refuses to share (the bind
    // fails below), or a group registered elsewhere holds it, which must be left alone.
    let bound_before = fresh && port_is_bound(ip, port);
    rustix::net::sockopt::set_socket_reuseport(sock, true)
        .map_err(|e| BindError::Other(format!("SO_REUSEPORT: {e}")))?;
    let mut tried = false;
    loop {
        match rustix::net::bind(sock, &addr) {
            Ok(()) => break,
            // Perhaps another group's probe of the port ([`port_is_bound`]) for an instant.
            Err(Errno::ADDRINUSE) if !tried => {
                tried = true;
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            Err(Errno::ADDRINUSE) => return Err(BindError::InUse { shared: true }),
            Err(e) => return Err(BindError::Other(format!("bind {addr}: {e}"))),
        }
    }
    if bound_before {
        return Err(BindError::ForeignGroup {
            registry: registry
                .as_ref()
                .map(|r| r.path.clone())
                .unwrap_or_default(),
        });
    }
    let prog = load_program(&map).map_err(BindError::Other)?;
    let fd: libc::c_int = prog.as_raw_fd();
    // SAFETY: a plain setsockopt with a pointer to a live c_int and its size.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ATTACH_REUSEPORT_EBPF,
            (&fd as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(BindError::Other(format!(
            "SO_ATTACH_REUSEPORT_EBPF: {}",
            std::io::Error::last_os_error()
        )));
    }
    let mut slot = None;
    let keys = match want {
        Slot::Exactly(k) => k..k.saturating_add(1).min(SLOTS),
        _ => 0..SLOTS,
    };
    for key in keys {
        match map_insert_new(&map, key, sock) {
            Ok(()) => {
                slot = Some(key);
                break;
            }
            Err(Errno::EXIST) => continue,
            Err(e) => return Err(BindError::Other(format!("reuseport map insert: {e}"))),
        }
    }
    if let (None, Slot::Exactly(k)) = (slot, want) {
        return Err(BindError::SlotTaken(k));
    }
    let Some(slot) = slot else {
        return Err(BindError::SlotsFull);
    };
    if fresh {
        if let Some(r) = &registry {
            r.store(map_id(&map).map_err(|e| BindError::Other(format!("map id: {e}")))?)
                .map_err(|e| BindError::Other(format!("reuseport registry: {e}")))?;
        }
    }
    tracing::debug!(%addr, slot, "roce: joined the shared port");
    Ok(Binding::Shared { slot })
}

/// The registry file, locked for the life of this value.
struct Registry {
    file: std::fs::File,
    path: std::path::PathBuf,
}

impl Registry {
    fn open(dir: &Path, ip: IpAddr, port: u16) -> std::io::Result<Registry> {
        std::fs::create_dir_all(dir)?;
        let ns = std::fs::metadata("/proc/self/ns/net")
            .map(|m| m.ino())
            .unwrap_or(0);
        let path = dir.join(format!("roce-{ns}-{ip}-{port}.reuseport"));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)?;
        rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive)?;
        Ok(Registry { file, path })
    }

    /// The group's map (opened by the stored id), or a new one; `true` when new.
    fn map(&self) -> Result<(OwnedFd, bool), Errno> {
        let mut text = String::new();
        let mut f = &self.file;
        let _ = f.read_to_string(&mut text);
        if let Ok(id) = text.trim().parse::<u32>() {
            if let Ok(fd) = map_by_id(id) {
                if map_is_ours(&fd) {
                    return Ok((fd, false));
                }
            }
        }
        Ok((map_create()?, true))
    }

    fn store(&self, id: u32) -> std::io::Result<()> {
        let mut f = &self.file;
        f.set_len(0)?;
        f.rewind()?;
        writeln!(f, "{id}")
    }
}

/// Whether a UDP socket of this namespace is bound to `ip:port` or to the wildcard address on
/// `port`: a probe socket without SO_REUSEPORT binds there, and the kernel answers EADDRINUSE
/// exactly when one is. (A scan of `/proc/net/udp` was used before; its text is produced a page
/// at a time, and a line can be skipped while other sockets are bound or closed during the read.)
/// The probe holds the port only between its bind and its close; a process of our own group
/// cannot come in between, since it waits on the registry's lock that the caller holds. A
/// process of another registry (another fabric directory) can, and its bind then fails once
/// with EADDRINUSE: [`bind`] tries once more a moment later.
fn port_is_bound(ip: IpAddr, port: u16) -> bool {
    let domain = match ip {
        IpAddr::V4(_) => rustix::net::AddressFamily::INET,
        IpAddr::V6(_) => rustix::net::AddressFamily::INET6,
    };
    let Ok(probe) =
        crate::fdplace::make(|| rustix::net::socket(domain, rustix::net::SocketType::DGRAM, None))
    else {
        return false;
    };
    matches!(
        rustix::net::bind(&probe, &SocketAddr::new(ip, port)),
        Err(Errno::ADDRINUSE)
    )
}

// ---- the bpf(2) system call, with the union bpf_attr laid out by hand ----

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_MAP_GET_FD_BY_ID: libc::c_long = 14;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_MAP_TYPE_REUSEPORT_SOCKARRAY: u32 = 20;
const BPF_PROG_TYPE_SK_REUSEPORT: u32 = 21;
const BPF_SK_REUSEPORT_SELECT: u32 = 39;
const BPF_NOEXIST: u64 = 1;
const KEY_SIZE: u32 = 4;
const VALUE_SIZE: u32 = 8;

/// `union bpf_attr` as 128 zeroed bytes; fields are written at their offsets.
#[repr(C, align(8))]
struct Attr([u8; 128]);

impl Attr {
    fn new() -> Attr {
        Attr([0; 128])
    }
    fn u32(&mut self, off: usize, v: u32) -> &mut Self {
        self.0[off..off + 4].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn u64(&mut self, off: usize, v: u64) -> &mut Self {
        self.0[off..off + 8].copy_from_slice(&v.to_ne_bytes());
        self
    }
}

fn sys_bpf(cmd: libc::c_long, attr: &mut Attr) -> Result<libc::c_long, Errno> {
    // SAFETY: bpf(2) reads (and for some commands writes) at most `size` bytes of `attr`, which
    // is a live, exclusively borrowed buffer of that size; pointers inside it point to live
    // buffers of the stated lengths for the duration of the call.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.0.as_mut_ptr(), attr.0.len()) };
    if rc < 0 {
        Err(Errno::from_raw_os_error(
            std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EINVAL),
        ))
    } else {
        Ok(rc)
    }
}

fn fd_from(rc: libc::c_long) -> Result<OwnedFd, Errno> {
    let fd = libc::c_int::try_from(rc).map_err(|_| Errno::INVAL)?;
    // SAFETY: the kernel returned a new file descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn map_create() -> Result<OwnedFd, Errno> {
    let mut a = Attr::new();
    a.u32(0, BPF_MAP_TYPE_REUSEPORT_SOCKARRAY)
        .u32(4, KEY_SIZE)
        .u32(8, VALUE_SIZE)
        .u32(12, SLOTS);
    fd_from(sys_bpf(BPF_MAP_CREATE, &mut a)?)
}

fn map_by_id(id: u32) -> Result<OwnedFd, Errno> {
    let mut a = Attr::new();
    a.u32(0, id);
    fd_from(sys_bpf(BPF_MAP_GET_FD_BY_ID, &mut a)?)
}

/// `struct bpf_map_info`: type, id, key_size, value_size, max_entries (u32 each, in order).
fn map_info(map: &OwnedFd) -> Result<[u32; 5], Errno> {
    let mut info = [0u32; 20];
    let mut a = Attr::new();
    a.u32(0, map.as_raw_fd() as u32)
        .u32(4, std::mem::size_of_val(&info) as u32)
        .u64(8, info.as_mut_ptr() as u64);
    sys_bpf(BPF_OBJ_GET_INFO_BY_FD, &mut a)?;
    Ok([info[0], info[1], info[2], info[3], info[4]])
}

fn map_id(map: &OwnedFd) -> Result<u32, Errno> {
    Ok(map_info(map)?[1])
}

/// A map found by a stored id is the group's only if it has the shape this module creates (an
/// id can be reused by an unrelated map once the group's map is gone).
fn map_is_ours(map: &OwnedFd) -> bool {
    map_info(map).is_ok_and(|i| {
        i[0] == BPF_MAP_TYPE_REUSEPORT_SOCKARRAY
            && i[2] == KEY_SIZE
            && i[3] == VALUE_SIZE
            && i[4] == SLOTS
    })
}

fn map_insert_new(map: &OwnedFd, key: u32, sock: &OwnedFd) -> Result<(), Errno> {
    let value: u64 = sock.as_fd().as_raw_fd() as u64;
    let mut a = Attr::new();
    a.u32(0, map.as_raw_fd() as u32)
        .u64(8, &key as *const u32 as u64)
        .u64(16, &value as *const u64 as u64)
        .u64(24, BPF_NOEXIST);
    sys_bpf(BPF_MAP_UPDATE_ELEM, &mut a).map(|_| ())
}

/// One `struct bpf_insn`: opcode, dst and src registers, offset, immediate.
#[repr(C)]
#[derive(Clone, Copy)]
struct Insn {
    code: u8,
    regs: u8,
    off: i16,
    imm: i32,
}

const fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    // The register nibbles are a C bitfield: dst first, which is the low nibble on
    // little-endian targets and the high one on big-endian targets.
    let regs = if cfg!(target_endian = "little") {
        dst | (src << 4)
    } else {
        (dst << 4) | src
    };
    Insn {
        code,
        regs,
        off,
        imm,
    }
}

const MOV64_X: u8 = 0xbf; // dst = src
const MOV64_K: u8 = 0xb7; // dst = imm
const ADD64_K: u8 = 0x07; // dst += imm
const LDX_B: u8 = 0x71; // dst = *(u8 *)(src + off)
const STX_W: u8 = 0x63; // *(u32 *)(dst + off) = src
const LD_IMM64: u8 = 0x18; // dst = imm64 (two slots)
const CALL: u8 = 0x85;
const JNE_K: u8 = 0x55; // if dst != imm goto pc + off
const EXIT: u8 = 0x95;
const PSEUDO_MAP_FD: u8 = 1;
const FN_SKB_LOAD_BYTES: i32 = 26;
const FN_SK_SELECT_REUSEPORT: i32 = 82;
const SK_DROP: i32 = 0;
const SK_PASS: i32 = 1;
/// The UDP header (8 bytes; the program sees the datagram from it) plus the BTH's offset of
/// the destination QP's most significant byte (opcode, flags, P_Key, reserved: 5 bytes).
const QPN_HIGH_BYTE: i32 = 8 + 5;

/// The steering program for `map`:
///
/// ```text
///  0  r6 = r1                          ctx
///  1  r1 = r6
///  2  r2 = 13                          offset of the QPN's high byte
///  3  r3 = r10
///  4  r3 += -8                         buffer on the stack
///  5  r4 = 1
///  6  call skb_load_bytes
///  7  if r0 != 0 goto 20               too short: drop
///  8  r1 = *(u8 *)(r10 - 8)
///  9  *(u32 *)(r10 - 4) = r1           key = slot
/// 10  r1 = r6
/// 11  r2 = map (two slots)
/// 13  r3 = r10
/// 14  r3 += -4
/// 15  r4 = 0
/// 16  call sk_select_reuseport
/// 17  if r0 != 0 goto 20               no socket in that slot: drop
/// 18  r0 = SK_PASS
/// 19  exit
/// 20  r0 = SK_DROP
/// 21  exit
/// ```
fn program(map_fd: i32) -> [Insn; 22] {
    [
        insn(MOV64_X, 6, 1, 0, 0),
        insn(MOV64_X, 1, 6, 0, 0),
        insn(MOV64_K, 2, 0, 0, QPN_HIGH_BYTE),
        insn(MOV64_X, 3, 10, 0, 0),
        insn(ADD64_K, 3, 0, 0, -8),
        insn(MOV64_K, 4, 0, 0, 1),
        insn(CALL, 0, 0, 0, FN_SKB_LOAD_BYTES),
        insn(JNE_K, 0, 0, 12, 0),
        insn(LDX_B, 1, 10, -8, 0),
        insn(STX_W, 10, 1, -4, 0),
        insn(MOV64_X, 1, 6, 0, 0),
        insn(LD_IMM64, 2, PSEUDO_MAP_FD, 0, map_fd),
        insn(0, 0, 0, 0, 0),
        insn(MOV64_X, 3, 10, 0, 0),
        insn(ADD64_K, 3, 0, 0, -4),
        insn(MOV64_K, 4, 0, 0, 0),
        insn(CALL, 0, 0, 0, FN_SK_SELECT_REUSEPORT),
        insn(JNE_K, 0, 0, 2, 0),
        insn(MOV64_K, 0, 0, 0, SK_PASS),
        insn(EXIT, 0, 0, 0, 0),
        insn(MOV64_K, 0, 0, 0, SK_DROP),
        insn(EXIT, 0, 0, 0, 0),
    ]
}

fn load_program(map: &OwnedFd) -> Result<OwnedFd, String> {
    let insns = program(map.as_raw_fd());
    let license = b"GPL\0";
    let mut log = vec![0u8; 4096];
    let name = b"smc_roce_qpn";
    let mut a = Attr::new();
    a.u32(0, BPF_PROG_TYPE_SK_REUSEPORT)
        .u32(4, insns.len() as u32)
        .u64(8, insns.as_ptr() as u64)
        .u64(16, license.as_ptr() as u64)
        .u32(24, 1)
        .u32(28, log.len() as u32)
        .u64(32, log.as_mut_ptr() as u64)
        .u32(68, BPF_SK_REUSEPORT_SELECT);
    a.0[48..48 + name.len()].copy_from_slice(name);
    match sys_bpf(BPF_PROG_LOAD, &mut a) {
        Ok(rc) => fd_from(rc).map_err(|e| format!("load the steering program: {e}")),
        Err(e) => {
            let end = log.iter().position(|b| *b == 0).unwrap_or(log.len());
            Err(format!(
                "load the steering program: {e}: {}",
                String::from_utf8_lossy(&log[..end]).trim()
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    #[test]
    fn a_probe_sees_a_bound_port() {
        let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = s.local_addr().unwrap().port();
        assert!(port_is_bound(IpAddr::V4(Ipv4Addr::LOCALHOST), port));
        // Another address's port of that number is free (all of 127/8 is local).
        assert!(!port_is_bound(
            IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2)),
            port
        ));
        drop(s);
        // The wildcard address holds every address's port.
        let any = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        let port = any.local_addr().unwrap().port();
        assert!(port_is_bound(IpAddr::V4(Ipv4Addr::LOCALHOST), port));
        if let Ok(s) = std::net::UdpSocket::bind("[::1]:0") {
            let port = s.local_addr().unwrap().port();
            assert!(port_is_bound(IpAddr::V6(Ipv6Addr::LOCALHOST), port));
            // Not a local address: nothing can be bound there.
            assert!(!port_is_bound("fd00::2".parse().unwrap(), port));
        }
    }

    #[test]
    fn qpn_ranges_do_not_overlap() {
        let (b0, n0) = Binding::Shared { slot: 0 }.qpn_range();
        let (b1, _) = Binding::Shared { slot: 1 }.qpn_range();
        assert_eq!(b0 + n0, b1);
        let (b, n) = Binding::Shared { slot: SLOTS - 1 }.qpn_range();
        assert_eq!(b + n, 1 << 24);
    }

    #[test]
    fn program_reads_the_qpn_high_byte() {
        let p = program(7);
        assert_eq!(p[2].imm, 13);
        assert_eq!(p[11].imm, 7);
        // Both drop branches land on the SK_DROP instruction.
        assert_eq!(7 + 1 + p[7].off as usize, 20);
        assert_eq!(17 + 1 + p[17].off as usize, 20);
        assert_eq!(p[20].imm, SK_DROP);
    }

    fn udp() -> OwnedFd {
        rustix::net::socket(
            rustix::net::AddressFamily::INET,
            rustix::net::SocketType::DGRAM,
            None,
        )
        .unwrap()
    }

    /// A datagram whose BTH names destination QPN `qpn` (the rest is zero).
    fn bth(qpn: u32) -> [u8; 12] {
        let mut b = [0u8; 12];
        b[5..8].copy_from_slice(&qpn.to_be_bytes()[1..]);
        b
    }

    fn recv_one(s: &OwnedFd) -> Option<[u8; 12]> {
        let mut b = [0u8; 12];
        match rustix::net::recv(s, &mut b, rustix::net::RecvFlags::DONTWAIT) {
            Ok((12, _)) => Some(b),
            _ => None,
        }
    }

    /// Root only: three sockets share one port; datagrams reach the socket owning their QPN's
    /// slot, a datagram for an unowned slot or too short to hold a BTH reaches none, and a
    /// closed socket's slot is taken by the next socket to join.
    #[test]
    fn datagrams_are_steered_by_destination_qpn() {
        let dir = std::env::temp_dir().join(format!("smc-steer-test-{}", std::process::id()));
        let ip4 = Ipv4Addr::new(127, 0, 0, 1);
        let ip = IpAddr::V4(ip4);
        let port = std::net::UdpSocket::bind((ip4, 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let socks: Vec<OwnedFd> = (0..3).map(|_| udp()).collect();
        let mut slots = Vec::new();
        for s in &socks {
            match bind(s, ip, port, &dir, Slot::Any) {
                Ok(Binding::Shared { slot }) => slots.push(slot),
                Ok(Binding::Exclusive) => {
                    eprintln!("skipped: no eBPF privileges (needs root)");
                    let _ = std::fs::remove_dir_all(&dir);
                    return;
                }
                Err(e) => panic!("{e:?}"),
            }
        }
        assert_eq!(slots, [0, 1, 2]);
        let tx = udp();
        let to = SocketAddr::new(ip, port);
        for round in 0..4u32 {
            for (i, s) in socks.iter().enumerate() {
                let qpn = ((i as u32) << SLOT_SHIFT) | (0x11 + round);
                rustix::net::sendto(&tx, &bth(qpn), rustix::net::SendFlags::empty(), &to).unwrap();
                std::thread::sleep(std::time::Duration::from_millis(5));
                assert_eq!(recv_one(s), Some(bth(qpn)), "socket {i}, qpn {qpn:#x}");
                for (j, o) in socks.iter().enumerate() {
                    assert_eq!(recv_one(o), None, "qpn {qpn:#x} also at socket {j}");
                }
            }
        }
        // Slot 9 has no socket; a 4-byte datagram holds no BTH.
        rustix::net::sendto(
            &tx,
            &bth(9 << SLOT_SHIFT),
            rustix::net::SendFlags::empty(),
            &to,
        )
        .unwrap();
        rustix::net::sendto(&tx, &[0u8; 4], rustix::net::SendFlags::empty(), &to).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        for s in &socks {
            assert_eq!(recv_one(s), None);
        }
        // Slot 1 freed by closing its socket is taken again.
        let mut socks = socks;
        drop(socks.remove(1));
        let again = udp();
        // Slot 2 is held: asking for it exactly fails; slot 1 exactly is had.
        assert!(matches!(
            bind(&udp(), ip, port, &dir, Slot::Exactly(2)),
            Err(BindError::SlotTaken(2))
        ));
        assert_eq!(
            bind(&again, ip, port, &dir, Slot::Exactly(1)).unwrap(),
            Binding::Shared { slot: 1 }
        );
        rustix::net::sendto(
            &tx,
            &bth(1 << SLOT_SHIFT | 5),
            rustix::net::SendFlags::empty(),
            &to,
        )
        .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(5));
        assert_eq!(recv_one(&again), Some(bth(1 << SLOT_SHIFT | 5)));
        // A registry elsewhere (another fabric directory) must not take over the group.
        let other = dir.join("other");
        let intruder = udp();
        assert!(matches!(
            bind(&intruder, ip, port, &other, Slot::Any),
            Err(BindError::ForeignGroup { .. })
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Root only: a socket that does not share the port (as the kernel's rdma_rxe binds 4791)
    /// makes the bind fail as "in use".
    #[test]
    fn a_port_owned_without_reuseport_is_in_use() {
        let dir = std::env::temp_dir().join(format!("smc-steer-owned-{}", std::process::id()));
        let ip = Ipv4Addr::new(127, 0, 0, 1);
        let owner = std::net::UdpSocket::bind((ip, 0)).unwrap();
        let port = owner.local_addr().unwrap().port();
        assert!(port_is_bound(IpAddr::V4(ip), port));
        let r = bind(&udp(), IpAddr::V4(ip), port, &dir, Slot::Any);
        let _ = std::fs::remove_dir_all(&dir);
        match r {
            Err(BindError::InUse { .. }) => {}
            other => panic!("{other:?}"),
        }
    }
}
