//! What an independent tester broke in the `smc` binary (issue #20): write errors of
//! `smc nc`, planted or full fabric directories, control sockets left behind, slow control
//! clients, bad input. Each test runs the real binary on a private fabric directory.
#![allow(missing_docs)]

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

fn test_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "smc-hard-{}-{}-{}",
        tag,
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0)
    ));
    std::fs::create_dir_all(&d).expect("dir");
    d
}

fn smc(dir: &Path, discovery: &str) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_smc"));
    c.env("SMC_FABRIC_DIR", dir)
        .env("SMC_DISCOVERY", discovery)
        .env_remove("SMC_FABRIC_FAULTS");
    c
}

/// `smc nc -l 0` (one-shot, output to a sink) and the port it says it listens on.
fn listener(dir: &Path, discovery: &str, extra: &[&str]) -> (Child, u16) {
    let mut child = smc(dir, discovery)
        .args(["nc", "-l", "0"])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn listener");
    let err = child.stderr.take().expect("stderr");
    let mut lines = BufReader::new(err).lines();
    let mut port = 0;
    for line in lines.by_ref() {
        let line = line.expect("stderr line");
        if let Some(addr) = line.strip_prefix("smc nc: listening on ") {
            port = addr
                .rsplit(':')
                .next()
                .and_then(|p| p.parse().ok())
                .expect("port");
            break;
        }
    }
    assert_ne!(port, 0, "listener said no port");
    std::thread::spawn(move || for _ in lines {});
    (child, port)
}

/// The tester's probe: a large upload through `smc nc`, its server killed (SIGKILL) half
/// way. The client must exit nonzero and say what failed, over SMC-R and over plain TCP.
#[test]
fn nc_reports_the_write_error_when_its_server_dies_mid_upload() {
    for discovery in ["assert-peer", "off"] {
        let dir = test_dir("nc-kill");
        let (mut server, port) = listener(&dir, discovery, &[]);
        let mut client = smc(&dir, discovery)
            .args(["nc", "127.0.0.1", &port.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn client");
        let mut cin = client.stdin.take().expect("stdin");
        let chunk = vec![0x5au8; 1 << 20];
        let mut fed = 0usize;
        // Feed 64 MiB, then kill the server and keep feeding until the client stops taking
        // input (it failed) or 4 GiB more went in (it did not notice).
        let mut killed = false;
        while fed < (4 << 30) {
            if cin.write_all(&chunk).is_err() {
                break;
            }
            fed += chunk.len();
            if !killed && fed >= 64 << 20 {
                server.kill().expect("SIGKILL the server");
                let _ = server.wait();
                killed = true;
            }
        }
        drop(cin);
        let mut err = String::new();
        client
            .stderr
            .take()
            .expect("stderr")
            .read_to_string(&mut err)
            .expect("client stderr");
        let status = client.wait().expect("client exit");
        println!("{discovery}: fed {} MiB, client {status}: {err}", fed >> 20);
        assert!(
            killed,
            "{discovery}: the upload ended before the kill: {err}"
        );
        assert!(!status.success(), "{discovery}: client exited 0: {err}");
        assert!(
            err.contains("smc: error:"),
            "{discovery}: no message: {err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// `smc decode ''` (nothing to decode) is an error, not an empty decode.
#[test]
fn decode_of_empty_input_is_an_error() {
    let dir = test_dir("decode-empty");
    for arg in ["", "  "] {
        let out = smc(&dir, "off")
            .args(["decode", arg])
            .output()
            .expect("run smc decode");
        assert!(!out.status.success(), "smc decode {arg:?} exited 0");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("error"), "{err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    // /proc/self belongs to the process's effective uid.
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// `smc` run as `uid` (with `setpriv`), on fabric directory `fab`. Another uid runs a copy
/// of the binary in `/tmp` (the build directory may be closed to it).
fn smc_as(uid: Option<u32>, fab: &Path) -> Command {
    let exe = match uid {
        Some(_) => {
            use std::os::unix::fs::PermissionsExt;
            let copy = std::env::temp_dir().join(format!("smc-hard-bin-{}", std::process::id()));
            if !copy.exists() {
                let tmp = copy.with_extension("tmp");
                std::fs::copy(env!("CARGO_BIN_EXE_smc"), &tmp).expect("copy smc");
                std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))
                    .expect("chmod");
                std::fs::rename(&tmp, &copy).expect("rename");
            }
            copy
        }
        None => PathBuf::from(env!("CARGO_BIN_EXE_smc")),
    };
    let mut c = match uid {
        Some(u) => {
            let mut c = Command::new("setpriv");
            c.args([
                format!("--reuid={u}"),
                format!("--regid={u}"),
                "--clear-groups".into(),
            ]);
            c.arg(&exe);
            c
        }
        None => Command::new(&exe),
    };
    c.env("SMC_FABRIC_DIR", fab)
        .env("SMC_DISCOVERY", "assert-peer")
        .env_remove("SMC_FABRIC_FAULTS");
    c
}

/// An echo listener and one client through it, both as `uid` on fabric directory `fab`:
/// the echo must come back, both must start, and the client must warn that SMC-R is
/// unavailable. Returns the client's stderr.
fn echo_over_unusable_fabric(uid: Option<u32>, fab: &Path) -> String {
    let mut l = smc_as(uid, fab)
        .args(["nc", "-l", "0", "--echo"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn listener");
    let mut lines = BufReader::new(l.stderr.take().expect("stderr")).lines();
    let mut port = 0u16;
    let mut said = Vec::new();
    for line in lines.by_ref() {
        let line = line.expect("line");
        if let Some(addr) = line.strip_prefix("smc nc: listening on ") {
            port = addr
                .rsplit(':')
                .next()
                .and_then(|p| p.parse().ok())
                .expect("port");
            break;
        }
        said.push(line);
    }
    assert_ne!(
        port,
        0,
        "listener did not start on {}: {said:?}",
        fab.display()
    );
    std::thread::spawn(move || for _ in lines {});
    let mut c = smc_as(uid, fab)
        .args(["nc", "-v", "127.0.0.1", &port.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn client");
    c.stdin
        .take()
        .expect("stdin")
        .write_all(b"hello through TCP\n")
        .expect("feed");
    let out = c.wait_with_output().expect("client");
    let _ = l.kill();
    let _ = l.wait();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "client on {}: {err}", fab.display());
    assert_eq!(out.stdout, b"hello through TCP\n", "{err}");
    assert!(
        err.contains("warning: SMC-R unavailable") && err.contains("over TCP"),
        "{err}"
    );
    assert!(
        said.iter()
            .any(|l| l.contains("warning: SMC-R unavailable")),
        "{said:?}"
    );
    err
}

/// Another user plants the fabric directory (as `nobody` could in /tmp for
/// `/tmp/smc-fabric-<uid>`): a directory of theirs (open to all, or closed), a symlink, a
/// file. uid 1000's programs must start and run over TCP, with a warning.
#[test]
fn planted_fabric_directory_falls_back_to_tcp() {
    if !is_root() {
        println!("skipped: needs root (setpriv to another uid)");
        return;
    }
    use std::os::unix::fs::{chown, PermissionsExt};
    let top = test_dir("planted");
    std::fs::set_permissions(&top, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let user = 1000;
    // Directory of another user (root here), writable by all.
    let open_dir = top.join("open");
    std::fs::create_dir(&open_dir).expect("mkdir");
    std::fs::set_permissions(&open_dir, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    // Directory of another user, closed.
    let closed = top.join("closed");
    std::fs::create_dir(&closed).expect("mkdir");
    std::fs::set_permissions(&closed, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    // A symlink to a directory the user owns.
    let target = top.join("target");
    std::fs::create_dir(&target).expect("mkdir");
    chown(&target, Some(user), Some(user)).expect("chown");
    let link = top.join("link");
    std::os::unix::fs::symlink(&target, &link).expect("symlink");
    // A file.
    let file = top.join("file");
    std::fs::write(&file, b"planted").expect("file");
    for fab in [&open_dir, &closed, &link, &file] {
        let err = echo_over_unusable_fabric(Some(user), fab);
        println!("{}: {}", fab.display(), err.trim());
    }
    let _ = std::fs::remove_dir_all(&top);
    let _ = std::fs::remove_file(
        std::env::temp_dir().join(format!("smc-hard-bin-{}", std::process::id())),
    );
}

/// A fabric directory on a file system out of inodes (ENOSPC): TCP with a warning.
#[test]
fn fabric_directory_out_of_inodes_falls_back_to_tcp() {
    if !is_root() {
        println!("skipped: needs root (mount a tmpfs)");
        return;
    }
    let top = test_dir("enospc");
    let mnt = top.join("mnt");
    std::fs::create_dir(&mnt).expect("mkdir");
    let ok = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "nr_inodes=16,size=1m", "tmpfs"])
        .arg(&mnt)
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        println!("skipped: cannot mount a tmpfs here");
        let _ = std::fs::remove_dir_all(&top);
        return;
    }
    // Unmounted however the test ends.
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(mnt.clone());
    // Use up the inodes.
    for i in 0.. {
        if std::fs::write(mnt.join(format!("f{i}")), b"").is_err() {
            break;
        }
    }
    let fab = mnt.join("fab");
    let err = echo_over_unusable_fabric(None, &fab);
    println!("{}: {}", fab.display(), err.trim());
    drop(_unmount);
    let _ = std::fs::remove_dir_all(&top);
}

/// The control sockets in `fab` (`stacks/*.sock`).
fn control_sockets(fab: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(fab.join("stacks"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".sock"))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Control sockets do not pile up: a process that exits normally removes its own, and the
/// socket of a killed one is removed by the next `smc ss` (or the next stack).
#[test]
fn control_sockets_are_removed_at_exit_and_when_stale() {
    let dir = test_dir("ctl-sockets");
    // Five one-shot client runs against an echo listener, each exiting normally.
    let mut l = smc(&dir, "assert-peer")
        .args(["nc", "-l", "0", "--echo"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("listener");
    let mut lines = BufReader::new(l.stderr.take().expect("stderr")).lines();
    let port: u16 = lines
        .by_ref()
        .map_while(|l| l.ok())
        .find_map(|l| {
            l.strip_prefix("smc nc: listening on ")
                .and_then(|a| a.rsplit(':').next().and_then(|p| p.parse().ok()))
        })
        .expect("port");
    std::thread::spawn(move || for _ in lines {});
    for _ in 0..5 {
        let mut c = smc(&dir, "assert-peer")
            .args(["nc", "127.0.0.1", &port.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("client");
        c.stdin
            .take()
            .expect("stdin")
            .write_all(b"x\n")
            .expect("feed");
        assert!(c.wait().expect("client").success());
    }
    let left = control_sockets(&dir);
    println!("after 5 normal client exits: {left:?}");
    let listener_prefix = format!("{}-", l.id());
    assert!(
        left.iter().all(|n| n.starts_with(&listener_prefix)),
        "only the listener's socket may remain: {left:?}"
    );
    assert_eq!(left.len(), 1, "{left:?}");
    // The listener is killed: its socket stays behind until someone looks.
    l.kill().expect("SIGKILL");
    let _ = l.wait();
    assert_eq!(control_sockets(&dir).len(), 1);
    let ss = smc(&dir, "assert-peer")
        .args(["ss", "--json"])
        .output()
        .expect("smc ss");
    assert!(ss.status.success());
    let left = control_sockets(&dir);
    println!("after the killed listener and one smc ss: {left:?}");
    assert!(left.is_empty(), "stale socket kept: {left:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Silent clients of a control socket (connected, never asking) hold up nobody: `smc ss`
/// still gets its answer (the stack answers each client in a thread of its own).
#[test]
fn control_socket_serves_others_while_clients_stay_silent() {
    let dir = test_dir("ctl-silent");
    let (mut l, _port) = listener(&dir, "assert-peer", &["--echo"]);
    // Its control socket appears once its stack is up.
    let mut sock = None;
    for _ in 0..500 {
        if let Some(n) = control_sockets(&dir).first() {
            sock = Some(dir.join("stacks").join(n));
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let sock = sock.expect("control socket");
    let silent: Vec<std::os::unix::net::UnixStream> = (0..10)
        .map(|_| std::os::unix::net::UnixStream::connect(&sock).expect("silent client"))
        .collect();
    let t = std::time::Instant::now();
    let out = smc(&dir, "assert-peer")
        .args(["stats", "--json"])
        .output()
        .expect("smc stats");
    let took = t.elapsed();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    println!("smc stats with 10 silent clients: {took:?}");
    assert_eq!(
        v.as_array().map(Vec::len),
        Some(1),
        "the listener's stack did not answer: {v}"
    );
    // Queries one after another: each answered at once (measured, printed, not asserted).
    let t = std::time::Instant::now();
    for _ in 0..20 {
        let s = std::os::unix::net::UnixStream::connect(&sock).expect("connect");
        let mut s = s;
        s.write_all(b"stats\n").expect("ask");
        let mut body = String::new();
        s.read_to_string(&mut body).expect("answer");
        assert!(body.starts_with('{'), "{body}");
    }
    println!("20 stats queries in a row: {:?} each", t.elapsed() / 20);
    drop(silent);
    let _ = l.kill();
    let _ = l.wait();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A non-UTF-8 `SMC_FABRIC_DEVICES` is an error that says so (once), not the defaults.
#[test]
fn non_utf8_device_list_is_a_clear_error() {
    use std::os::unix::ffi::OsStrExt;
    let dir = test_dir("non-utf8");
    let out = smc(&dir, "assert-peer")
        .env(
            "SMC_FABRIC_DEVICES",
            std::ffi::OsStr::from_bytes(b"shm0,sh\xffm1"),
        )
        .args(["nc", "-l", "0"])
        .stdin(Stdio::null())
        .output()
        .expect("run smc nc");
    let err = String::from_utf8_lossy(&out.stderr);
    println!("{err}");
    assert!(!out.status.success(), "{err}");
    assert_eq!(
        err.matches("SMC_FABRIC_DEVICES is not valid UTF-8").count(),
        1,
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A fabric directory deeper than a Unix socket address can name (108 bytes) works: SMC-R
/// between two processes, and `smc ss` finds them.
#[test]
fn deep_fabric_directory_works() {
    let top = test_dir("deep");
    let mut fab = top.clone();
    for part in ["kernel-peer", "runs", "single-server-20261125-183612-32150"] {
        fab.push(part);
    }
    fab.push("a-directory-name-long-enough-to-pass-the-limit-of-sun-path");
    fab.push("fab");
    let longest = fab
        .join("shm0")
        .join("fe80000000000000000042b8cb55df00.sock");
    assert!(longest.as_os_str().len() > 108, "{}", longest.display());
    let (mut l, port) = listener(&fab, "assert-peer", &["--echo"]);
    let mut c = smc(&fab, "assert-peer")
        .args(["nc", "-v", "127.0.0.1", &port.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("client");
    c.stdin
        .take()
        .expect("stdin")
        .write_all(b"deep\n")
        .expect("feed");
    let out = c.wait_with_output().expect("client");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert_eq!(out.stdout, b"deep\n");
    assert!(err.contains("over SMC-R"), "{err}");
    let ss = smc(&fab, "assert-peer")
        .args(["stats", "--json"])
        .output()
        .expect("smc stats");
    let v: serde_json::Value = serde_json::from_slice(&ss.stdout).expect("JSON");
    assert_eq!(v.as_array().map(Vec::len), Some(1), "{v}");
    let _ = l.kill();
    let _ = l.wait();
    let _ = std::fs::remove_dir_all(&top);
}
