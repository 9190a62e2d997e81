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
