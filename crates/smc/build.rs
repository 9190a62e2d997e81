//! Compiles the eBPF sock_ops program (bpf/smc_tcp_option.bpf.c) with clang when the `ebpf`
//! feature is on. Without clang the crate still builds; discovery then reports that the
//! program is unavailable and the stack works in its explicit (asserted-peer) mode.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(smc_bpf_built)");
    println!("cargo::rerun-if-changed=bpf/smc_tcp_option.bpf.c");
    println!("cargo::rerun-if-env-changed=CLANG");
    if std::env::var_os("CARGO_FEATURE_EBPF").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let obj = out.join("smc_tcp_option.bpf.o");
    let clang = std::env::var("CLANG").unwrap_or_else(|_| "clang".to_string());
    let arch = match std::env::var("CARGO_CFG_TARGET_ARCH").as_deref() {
        Ok("x86_64") => "x86_64-linux-gnu",
        Ok("aarch64") => "aarch64-linux-gnu",
        _ => "",
    };
    let mut cmd = Command::new(&clang);
    cmd.args([
        "-O2",
        "-g",
        "-target",
        "bpf",
        "-c",
        "bpf/smc_tcp_option.bpf.c",
        "-o",
    ])
    .arg(&obj);
    if !arch.is_empty() {
        cmd.arg(format!("-I/usr/include/{arch}"));
    }
    match cmd.status() {
        Ok(s) if s.success() => println!("cargo::rustc-cfg=smc_bpf_built"),
        Ok(s) => println!(
            "cargo::warning=clang failed ({s}) compiling the eBPF TCP-option program; \
             discovery will be unavailable (install clang and libbpf-dev)"
        ),
        Err(e) => println!(
            "cargo::warning=cannot run {clang} ({e}); the eBPF TCP-option program is not \
             built and discovery will be unavailable (install clang and libbpf-dev)"
        ),
    }
}
