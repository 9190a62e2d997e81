//! The committed eBPF object (bpf/smc_tcp_option.bpf.o) must be the compilation of its source.
//!
//! The object is committed so that a build needs no clang. Its stamp records the source's
//! SHA-256 and the compiler that built it; `scripts/build-bpf.sh` rewrites both. This test fails
//! when the source changed without the object being rebuilt, and — when the same compiler is on
//! this machine — when rebuilding the source gives other bytes than the committed object.

use sha2::{Digest, Sha256};
use std::path::PathBuf;
use std::process::Command;

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn stamp_field(stamp: &str, key: &str) -> String {
    stamp
        .lines()
        .find_map(|l| l.strip_prefix(key).map(|v| v.trim().to_string()))
        .unwrap_or_else(|| panic!("stamp has no `{key}` line:\n{stamp}"))
}

#[test]
fn committed_bpf_object_is_a_bpf_elf() {
    let obj = std::fs::read(crate_dir().join("bpf/smc_tcp_option.bpf.o")).unwrap();
    assert_eq!(&obj[..4], b"\x7fELF", "not an ELF file");
    // e_machine at offset 18 (little-endian): 247 = EM_BPF.
    assert_eq!(
        u16::from_le_bytes([obj[18], obj[19]]),
        247,
        "not a BPF object"
    );
    for needle in [
        &b"sockops"[..],
        b"smc_sockets",
        b"smc_listen_ports",
        b"smc_accepted",
    ] {
        assert!(
            obj.windows(needle.len()).any(|w| w == needle),
            "object lacks {}",
            String::from_utf8_lossy(needle)
        );
    }
}

#[test]
fn committed_bpf_object_matches_its_source() {
    let dir = crate_dir();
    let src = std::fs::read(dir.join("bpf/smc_tcp_option.bpf.c")).unwrap();
    let stamp = std::fs::read_to_string(dir.join("bpf/smc_tcp_option.bpf.o.stamp")).unwrap();
    let want = stamp_field(&stamp, "source-sha256");
    let have = format!("{:x}", Sha256::digest(&src));
    assert_eq!(
        have, want,
        "bpf/smc_tcp_option.bpf.c changed since the committed object was built: \
         run scripts/build-bpf.sh and commit the object and its stamp"
    );

    let clang = std::env::var("CLANG").unwrap_or_else(|_| "clang".into());
    let version = match Command::new(&clang).arg("--version").output() {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .lines()
            .next()
            .unwrap_or_default()
            .to_string(),
        _ => {
            eprintln!("skipping the rebuild comparison: {clang} is not installed");
            return;
        }
    };
    let built_with = stamp_field(&stamp, "compiler");
    if version.trim() != built_with {
        eprintln!(
            "skipping the byte comparison: the object was built by `{built_with}`, this machine \
             has `{}` (another compiler emits other bytes)",
            version.trim()
        );
        return;
    }
    let script = dir.join("../../scripts/build-bpf.sh");
    let out = Command::new(&script).arg("--print").output().unwrap();
    assert!(
        out.status.success(),
        "{} --print failed: {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let fresh_path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let fresh = std::fs::read(&fresh_path).unwrap();
    let _ = std::fs::remove_file(&fresh_path);
    let committed = std::fs::read(dir.join("bpf/smc_tcp_option.bpf.o")).unwrap();
    assert!(
        fresh == committed,
        "rebuilding bpf/smc_tcp_option.bpf.c gives other bytes than the committed object: \
         run scripts/build-bpf.sh and commit the object and its stamp"
    );
}
