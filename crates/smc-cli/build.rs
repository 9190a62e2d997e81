//! Builds the `LD_PRELOAD` library of `smc run` (crates/smc-preload, a cdylib) and embeds it in
//! the `smc` binary, so that `smc run` works wherever the binary is (`cargo run`, the target
//! directory, an installed copy). A cdylib cannot be an ordinary dependency of a binary, so
//! this script runs a nested `cargo build -p smc-preload` into its own target directory
//! (`target/preload`, beside the outer one; the outer build's lock is not shared).
//!
//! `SMC_PRELOAD_EMBED=0` skips it: `smc run` then looks for `libsmc_preload.so` beside the
//! binary or in `SMC_PRELOAD_LIB`.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("manifest dir"));
    let root = manifest
        .parent()
        .and_then(Path::parent)
        .expect("workspace root")
        .to_path_buf();
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    let embedded = out.join("libsmc_preload.so");
    println!("cargo:rerun-if-env-changed=SMC_PRELOAD_EMBED");
    for c in ["smc-preload", "smc", "smc-proto", "smc-fabric", "smc-wire"] {
        println!(
            "cargo:rerun-if-changed={}",
            root.join("crates").join(c).join("src").display()
        );
    }
    println!(
        "cargo:rerun-if-changed={}",
        root.join("Cargo.lock").display()
    );
    println!(
        "cargo:rustc-env=SMC_PRELOAD_EMBEDDED={}",
        embedded.display()
    );
    if std::env::var("SMC_PRELOAD_EMBED").as_deref() == Ok("0") {
        std::fs::write(&embedded, b"").expect("write the empty library");
        return;
    }
    let release = std::env::var("PROFILE").as_deref() == Ok("release");
    // Outer target dir: OUT_DIR is <target>/<profile>/build/smc-cli-*/out.
    let target = out
        .ancestors()
        .nth(4)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| root.join("target"));
    let target_dir = target.join("preload");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(&root)
        .args(["build", "-p", "smc-preload", "--locked", "--offline"])
        .arg("--target-dir")
        .arg(&target_dir);
    if release {
        cmd.arg("--release");
    }
    // What the outer build tells its build scripts is not for the nested build.
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy().to_string();
        if k.starts_with("CARGO_FEATURE_")
            || k.starts_with("CARGO_CFG_")
            || k.starts_with("CARGO_PKG_")
            || k.starts_with("CARGO_MANIFEST_")
            || matches!(
                k.as_str(),
                "CARGO_TARGET_DIR"
                    | "OUT_DIR"
                    | "TARGET"
                    | "HOST"
                    | "NUM_JOBS"
                    | "OPT_LEVEL"
                    | "PROFILE"
                    | "DEBUG"
                    | "RUSTC_WRAPPER"
                    | "RUSTC_WORKSPACE_WRAPPER"
                    | "CARGO_PRIMARY_PACKAGE"
            )
        {
            cmd.env_remove(&k);
        }
    }
    // A small library: no debug information (it is embedded in the binary); the test
    // programs' speed needs some optimisation even in a debug build.
    cmd.env("CARGO_PROFILE_DEV_DEBUG", "0")
        .env("CARGO_PROFILE_DEV_STRIP", "debuginfo")
        .env("CARGO_PROFILE_DEV_OPT_LEVEL", "1")
        .env("CARGO_PROFILE_RELEASE_DEBUG", "0")
        .env("CARGO_PROFILE_RELEASE_STRIP", "debuginfo");
    let built = target_dir
        .join(if release { "release" } else { "debug" })
        .join("libsmc_preload.so");
    match cmd.status() {
        Ok(s) if s.success() && built.exists() => {
            std::fs::copy(&built, &embedded).expect("copy the preload library");
        }
        other => {
            println!(
                "cargo:warning=smc run: building smc-preload failed ({other:?}); `smc run` will look for libsmc_preload.so beside the binary"
            );
            std::fs::write(&embedded, b"").expect("write the empty library");
        }
    }
}
