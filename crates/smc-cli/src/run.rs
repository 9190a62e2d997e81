//! `smc run [--] CMD [ARGS…]`: run an unmodified program with smc-rs's `LD_PRELOAD` library
//! (crates/smc-preload), so that its TCP connections to peers that run smc-rs too use SMC-R.
//!
//! Where the library comes from, in order: `SMC_PRELOAD_LIB` (a path); the copy embedded in
//! this binary at build time (see `build.rs`), written once to a private, content-addressed
//! file (`$XDG_RUNTIME_DIR/smc-rs` or `/tmp/smc-rs-<uid>`, mode 0700; nobody else may write
//! there) that stays for the program's descendants, which may exec long after `smc` is gone
//! (also as the user a program changed to: it is granted read then); `libsmc_preload.so` beside
//! the `smc` binary. The command replaces `smc` (exec): same process id, signals and exit
//! status as the program run directly.

use std::ffi::OsString;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context};

/// The library built with this binary (empty when the build skipped it).
static EMBEDDED: &[u8] = include_bytes!(env!("SMC_PRELOAD_EMBEDDED"));

/// Arguments of `smc run`.
#[derive(clap::Args, Debug)]
#[command(trailing_var_arg = true)]
pub struct RunArgs {
    /// Print where the library is and exit.
    #[arg(long)]
    pub print_library: bool,
    /// The command and its arguments.
    #[arg(allow_hyphen_values = true)]
    pub command: Vec<OsString>,
}

/// The private directory the embedded library is written to.
fn private_dir() -> PathBuf {
    let uid = rustix::process::getuid().as_raw();
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d).join("smc-rs"),
        _ => std::env::temp_dir().join(format!("smc-rs-{uid}")),
    }
}

/// Whether anyone but the owner may add, remove or rename files in `dir` (its group or
/// others, or a user its ACL names, with write). Read and search for others are harmless: a
/// server that drops root grants its new uid search on the private parents of its fabric
/// directory and log file (`smc_fabric::access`), which may include this directory.
fn others_may_change(dir: &std::path::Path, meta: &std::fs::Metadata) -> bool {
    if meta.permissions().mode() & 0o022 != 0 || smc_fabric::access::others_may_write(dir, meta) {
        return true;
    }
    match smc_fabric::access::read_acl(dir) {
        Ok(Some(acl)) => acl
            .named_users()
            .into_iter()
            .any(|u| acl.user_perm(u).is_some_and(|p| p & 0o2 != 0)),
        Ok(None) => false,
        Err(_) => true,
    }
}

/// Write the embedded library to its content-addressed file (once) and return its path.
fn write_embedded() -> anyhow::Result<PathBuf> {
    let dir = private_dir();
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .with_context(|| format!("creating {}", dir.display()))?;
    // Nobody else may write there (put another library in the place of ours). A program
    // that drops root under `smc run` grants its new user search here and read on the
    // library (an ACL entry, see `smc_preload::creds`), so that what it execs as that user
    // still loads it: with an ACL the group bits are its mask, which bounds every named
    // entry, so no write bit in the group and other bits means no writer but the owner.
    let meta = std::fs::symlink_metadata(&dir)?;
    if !meta.is_dir()
        || others_may_change(&dir, &meta)
        || std::os::unix::fs::MetadataExt::uid(&meta) != rustix::process::getuid().as_raw()
    {
        bail!(
            "{} is not a private directory of this user (no write for anyone else expected)",
            dir.display()
        );
    }
    let sum = crc32fast::hash(EMBEDDED);
    let path = dir.join(format!(
        "libsmc_preload-{}-{sum:08x}-{}.so",
        env!("CARGO_PKG_VERSION"),
        EMBEDDED.len()
    ));
    if std::fs::metadata(&path).is_ok_and(|m| m.len() == EMBEDDED.len() as u64) {
        return Ok(path);
    }
    let tmp = dir.join(format!(".preload-{}.tmp", std::process::id()));
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o500)
            .open(&tmp)
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::io::Write::write_all(&mut f, EMBEDDED)?;
    }
    std::fs::rename(&tmp, &path)?;
    Ok(path)
}

/// Where the preload library is.
pub fn library() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("SMC_PRELOAD_LIB") {
        return Ok(PathBuf::from(p));
    }
    if !EMBEDDED.is_empty() {
        return write_embedded();
    }
    let exe = std::env::current_exe()?;
    if let Some(dir) = exe.parent() {
        for p in [
            dir.join("libsmc_preload.so"),
            dir.join("../lib/smc-rs/libsmc_preload.so"),
        ] {
            if p.exists() {
                return Ok(p);
            }
        }
    }
    bail!(
        "libsmc_preload.so not found: this smc was built without it (SMC_PRELOAD_EMBED=0); \
         build it with `cargo build -p smc-preload` and set SMC_PRELOAD_LIB, or put it beside {}",
        exe.display()
    )
}

/// Run the command with the library preloaded (does not return on success).
pub fn run(args: &RunArgs) -> anyhow::Result<ExitCode> {
    let lib = library()?;
    if args.print_library {
        println!("{}", lib.display());
        return Ok(ExitCode::SUCCESS);
    }
    let mut cmd = args.command.iter();
    let prog = match cmd.next() {
        Some(p) if p == "--" => cmd.next(),
        p => p,
    };
    let Some(prog) = prog else {
        bail!("usage: smc run [--] CMD [ARGS...]");
    };
    let mut preload = lib.into_os_string();
    if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|o| !o.is_empty()) {
        preload.push(":");
        preload.push(old);
    }
    let err = std::process::Command::new(prog)
        .args(cmd)
        .env("LD_PRELOAD", preload)
        .exec();
    bail!("cannot run {}: {err}", prog.to_string_lossy())
}
