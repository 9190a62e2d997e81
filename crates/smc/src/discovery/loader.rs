//! Loading the discovery program with three bpf(2) commands.
//!
//! aya 0.13 (and 0.14) parse the running kernel's BTF (`/sys/kernel/btf/vmlinux`, several
//! megabytes) in `EbpfLoader::new`, even for a program that needs none: about 17 ms of the
//! 45 ms of CPU a `smc nc` that connects over SMC-R spent in all (`perf record`, session 26).
//! aya 0.15 reads it only for programs that need it, but needs a newer rustc than this
//! project's. Our program reads only `bpf_sock_ops` fields, a stable ABI, so it needs no
//! relocation against the kernel's types: aya-obj (aya's own ELF and relocation crate) reads
//! the object, and this module makes its maps (`BPF_MAP_CREATE`), loads its program
//! (`BPF_PROG_LOAD`) and links it to the cgroup (`BPF_LINK_CREATE`, Linux 5.7 and later).
//! aya's map types then work on the maps' descriptors as on maps aya made.
//!
//! Every descriptor is made and placed through `smc_fabric::fdplace`, so that under `smc run`
//! none of them takes a number the program counts on.

use aya_obj::generated::{bpf_attach_type, bpf_cmd, bpf_map_type, bpf_prog_type};
use aya_obj::{EbpfSectionKind, Object};
use std::collections::HashSet;
use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

// The kernel's numbers, from the uapi bindings aya-obj carries.
const BPF_MAP_CREATE: libc::c_long = bpf_cmd::BPF_MAP_CREATE as libc::c_long;
const BPF_PROG_LOAD: libc::c_long = bpf_cmd::BPF_PROG_LOAD as libc::c_long;
const BPF_LINK_CREATE: libc::c_long = bpf_cmd::BPF_LINK_CREATE as libc::c_long;
const BPF_PROG_TYPE_SOCK_OPS: u32 = bpf_prog_type::BPF_PROG_TYPE_SOCK_OPS as u32;
const BPF_CGROUP_SOCK_OPS: u32 = bpf_attach_type::BPF_CGROUP_SOCK_OPS as u32;
/// The kernel's name fields hold 15 bytes and a NUL (BPF_OBJ_NAME_LEN).
const NAME_LEN: usize = 16;
/// The verifier's log asked for when a load fails, bytes.
const LOG_SIZE: usize = 64 * 1024;

/// `union bpf_attr` for BPF_MAP_CREATE, up to the map's name (the kernel takes a shorter
/// attribute and reads the fields past it as zero).
#[repr(C)]
#[derive(Default)]
struct MapCreateAttr {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    inner_map_fd: u32,
    numa_node: u32,
    map_name: [u8; NAME_LEN],
}

/// `union bpf_attr` for BPF_PROG_LOAD, up to `expected_attach_type`.
#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; NAME_LEN],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

/// `union bpf_attr` for BPF_LINK_CREATE, its common part.
#[repr(C)]
#[derive(Default)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
}

/// The maps, named as in the object, with their kinds, and the link that keeps the program
/// attached.
pub(super) struct Loaded {
    pub maps: Vec<(String, MapKind, OwnedFd)>,
    pub link: OwnedFd,
}

/// The kinds of map the program may have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum MapKind {
    Hash,
    LruHash,
}

/// bpf(2) with `attr`; a new descriptor on success, placed by `fdplace`.
fn bpf_fd<T>(cmd: libc::c_long, attr: &mut T) -> std::io::Result<OwnedFd> {
    smc_fabric::fdplace::make(|| {
        // SAFETY: `attr` is a `repr(C)` prefix of `union bpf_attr` for `cmd`, alive for the
        // call, and its size is passed; every pointer in it points into memory the caller
        // keeps alive for the call.
        let r = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                cmd,
                attr as *mut T as *mut libc::c_void,
                std::mem::size_of::<T>() as libc::c_uint,
            )
        };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let fd = i32::try_from(r).map_err(|_| std::io::Error::other("bpf(2) returned no fd"))?;
        // SAFETY: the kernel made this descriptor for us just now.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    })
}

/// `name` as the kernel takes an object name: at most 15 bytes of `[A-Za-z0-9_.]`, NUL ended.
fn kernel_name(name: &str) -> [u8; NAME_LEN] {
    let mut out = [0u8; NAME_LEN];
    for (o, b) in out
        .iter_mut()
        .zip(
            name.bytes()
                .filter(|b| b.is_ascii_alphanumeric() || *b == b'_' || *b == b'.'),
        )
        .take(NAME_LEN - 1)
    {
        *o = b;
    }
    out
}

/// Parse `object`, make its maps, load `program` as a sock_ops program and link it to
/// `cgroup`.
pub(super) fn load_sock_ops(
    object: &[u8],
    program: &str,
    cgroup: impl AsFd,
) -> Result<Loaded, String> {
    let mut obj = Object::parse(object).map_err(|e| format!("parsing the object: {e}"))?;
    // `relocate_maps` reads the maps' definitions while it changes the functions: a copy.
    let defs: Vec<(String, aya_obj::Map)> = obj
        .maps
        .iter()
        .map(|(name, map)| (name.clone(), map.clone()))
        .collect();
    let mut maps = Vec::new();
    for (name, map) in &defs {
        // Our program keeps no global variables: data sections would need their contents
        // written and frozen, which this loader does not do.
        if !matches!(
            map.section_kind(),
            EbpfSectionKind::Maps | EbpfSectionKind::BtfMaps
        ) {
            return Err(format!("map {name}: a data section, not supported"));
        }
        let kind = match map.map_type() {
            t if t == bpf_map_type::BPF_MAP_TYPE_HASH as u32 => MapKind::Hash,
            t if t == bpf_map_type::BPF_MAP_TYPE_LRU_HASH as u32 => MapKind::LruHash,
            t => return Err(format!("map {name}: type {t}, not a hash map")),
        };
        let mut attr = MapCreateAttr {
            map_type: map.map_type(),
            key_size: map.key_size(),
            value_size: map.value_size(),
            max_entries: map.max_entries(),
            map_flags: map.map_flags(),
            map_name: kernel_name(name),
            ..Default::default()
        };
        let fd =
            bpf_fd(BPF_MAP_CREATE, &mut attr).map_err(|e| format!("creating map {name}: {e}"))?;
        maps.push((name.clone(), kind, fd));
    }
    let text_sections: HashSet<usize> = obj.functions.keys().map(|(s, _)| *s).collect();
    obj.relocate_maps(
        defs.iter()
            .zip(&maps)
            .map(|((name, map), (_, _, fd))| (name.as_str(), fd.as_raw_fd(), map)),
        &text_sections,
    )
    .map_err(|e| format!("relocating maps: {e}"))?;
    obj.relocate_calls(&text_sections)
        .map_err(|e| format!("relocating calls: {e}"))?;
    let prog = obj
        .programs
        .get(program)
        .ok_or_else(|| format!("program {program} missing from the object"))?;
    let function = obj
        .functions
        .get(&prog.function_key())
        .ok_or_else(|| format!("program {program}: its function is missing"))?;
    let insns = &function.instructions;
    let license: &CString = &obj.license;
    let load = |log: Option<&mut Vec<u8>>| {
        let mut attr = ProgLoadAttr {
            prog_type: BPF_PROG_TYPE_SOCK_OPS,
            insn_cnt: u32::try_from(insns.len()).unwrap_or(u32::MAX),
            insns: insns.as_ptr() as u64,
            license: license.as_ptr() as u64,
            prog_name: kernel_name(program),
            ..Default::default()
        };
        if let Some(log) = log {
            attr.log_level = 1;
            attr.log_size = log.len() as u32;
            attr.log_buf = log.as_mut_ptr() as u64;
        }
        bpf_fd(BPF_PROG_LOAD, &mut attr)
    };
    // The verifier gives up with EAGAIN when a signal is pending: again, a few times.
    let mut first = load(None);
    for _ in 0..4 {
        match &first {
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => first = load(None),
            _ => break,
        }
    }
    let prog_fd = match first {
        Ok(fd) => fd,
        Err(e) => {
            // Again with the verifier's log, to say why.
            let mut log = vec![0u8; LOG_SIZE];
            let again = load(Some(&mut log));
            let end = log.iter().position(|b| *b == 0).unwrap_or(log.len());
            let text = String::from_utf8_lossy(&log[..end]);
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(8)..];
            match again {
                Ok(fd) => fd,
                Err(_) => {
                    return Err(format!(
                        "loading program {program}: {e}; verifier: {}",
                        tail.join(" / ")
                    ))
                }
            }
        }
    };
    let mut attr = LinkCreateAttr {
        prog_fd: prog_fd.as_raw_fd() as u32,
        target_fd: cgroup.as_fd().as_raw_fd() as u32,
        attach_type: BPF_CGROUP_SOCK_OPS,
        flags: 0,
    };
    // The link holds the program: its own descriptor goes when this returns.
    let link = bpf_fd(BPF_LINK_CREATE, &mut attr).map_err(|e| {
        format!("linking program {program} to the cgroup (needs Linux 5.7 or later): {e}")
    })?;
    Ok(Loaded { maps, link })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_names_are_cut_to_fifteen_bytes_and_end_in_nul() {
        let n = kernel_name("smc_listen_ports");
        assert_eq!(&n[..15], b"smc_listen_port");
        assert_eq!(n[15], 0);
        let n = kernel_name("a-b:c");
        assert_eq!(&n[..4], b"abc\0");
    }

    /// Our attribute prefixes against the uapi `union bpf_attr` as aya-obj's bindings have it.
    #[test]
    fn attributes_have_the_kernels_offsets() {
        use aya_obj::generated::{bpf_attr__bindgen_ty_1 as Map, bpf_attr__bindgen_ty_4 as Prog};
        use std::mem::offset_of;
        assert_eq!(
            offset_of!(MapCreateAttr, map_flags),
            offset_of!(Map, map_flags)
        );
        assert_eq!(
            offset_of!(MapCreateAttr, numa_node),
            offset_of!(Map, numa_node)
        );
        assert_eq!(
            offset_of!(MapCreateAttr, map_name),
            offset_of!(Map, map_name)
        );
        assert_eq!(
            std::mem::size_of::<MapCreateAttr>(),
            offset_of!(Map, map_ifindex)
        );
        assert_eq!(offset_of!(ProgLoadAttr, insns), offset_of!(Prog, insns));
        assert_eq!(offset_of!(ProgLoadAttr, license), offset_of!(Prog, license));
        assert_eq!(offset_of!(ProgLoadAttr, log_buf), offset_of!(Prog, log_buf));
        assert_eq!(
            offset_of!(ProgLoadAttr, kern_version),
            offset_of!(Prog, kern_version)
        );
        assert_eq!(
            offset_of!(ProgLoadAttr, prog_name),
            offset_of!(Prog, prog_name)
        );
        assert_eq!(
            offset_of!(ProgLoadAttr, expected_attach_type),
            offset_of!(Prog, expected_attach_type)
        );
        // BPF_LINK_CREATE: prog_fd, then target_fd (a union with target_ifindex), attach_type,
        // flags, 4 bytes each.
        assert_eq!(std::mem::size_of::<LinkCreateAttr>(), 16);
    }
}
