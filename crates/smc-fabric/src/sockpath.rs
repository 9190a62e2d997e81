//! Unix socket paths of any length.
//!
//! `sockaddr_un` holds at most 107 bytes of path (108 with the terminating NUL), while a
//! fabric directory may lie anywhere (`/var/tmp/kernel-peer/runs/<long run name>/fab`). A
//! path too long for the address is reached through the directory instead: the directory is
//! opened (`O_PATH`) and the socket named `/proc/self/fd/<fd>/<file name>`, which the kernel
//! resolves to the same file when it binds or connects. Only the file name then counts
//! against the limit.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fd::{AsRawFd, OwnedFd};
use rustix::fs::{Mode, OFlags};

use crate::error::{FabricError, Result};

/// The longest path a Unix socket address holds on Linux (108 bytes with the NUL).
pub const SUN_PATH_MAX: usize = 107;

/// A path to bind or connect a Unix socket at, short enough for the socket address (keep it
/// alive until the bind or connect returned: it holds the directory open).
#[derive(Debug)]
pub struct SocketPath {
    path: PathBuf,
    _dir: Option<OwnedFd>,
}

impl SocketPath {
    /// `path` itself when it fits, else the same file through its opened directory.
    pub fn new(path: &Path) -> Result<SocketPath> {
        if path.as_os_str().len() <= SUN_PATH_MAX {
            return Ok(SocketPath {
                path: path.to_owned(),
                _dir: None,
            });
        }
        let too_long = |why: String| FabricError::SocketPath {
            path: path.to_owned(),
            why,
        };
        let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
            return Err(too_long("it names no file in a directory".into()));
        };
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        let fd = rustix::fs::open(
            dir,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| too_long(format!("opening its directory failed: {e}")))?;
        let mut short = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
        short.push(name);
        if short.as_os_str().as_bytes().len() > SUN_PATH_MAX {
            return Err(too_long(format!(
                "its file name alone is too long for a socket address ({} bytes at most)",
                SUN_PATH_MAX
            )));
        }
        Ok(SocketPath {
            path: short,
            _dir: Some(fd),
        })
    }

    /// The path to give to `bind` or `connect`.
    pub fn as_path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deep_directory_is_reached_through_its_descriptor() {
        let mut dir = std::env::temp_dir().join(format!("smcf-sockpath-{}", std::process::id()));
        for i in 0..6 {
            dir.push(format!("a-rather-long-directory-name-of-level-{i}"));
        }
        std::fs::create_dir_all(&dir).expect("mkdir");
        let path = dir.join("shm0.sock");
        assert!(path.as_os_str().len() > SUN_PATH_MAX);
        let sp = SocketPath::new(&path).expect("short path");
        let l = std::os::unix::net::UnixListener::bind(sp.as_path()).expect("bind");
        drop(sp);
        assert!(path.exists(), "the socket lies in the deep directory");
        let sp = SocketPath::new(&path).expect("short path");
        let _c = std::os::unix::net::UnixStream::connect(sp.as_path()).expect("connect");
        let _ = l.accept().expect("accept");
        let short = SocketPath::new(Path::new("/tmp/x.sock")).expect("short");
        assert_eq!(short.as_path(), Path::new("/tmp/x.sock"));
        let _ = std::fs::remove_dir_all(
            std::env::temp_dir().join(format!("smcf-sockpath-{}", std::process::id())),
        );
    }
}
