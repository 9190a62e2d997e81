//! Discovery's cgroup v2 lookup under `ip netns exec`, which gives the command its own mount
//! namespace with a fresh `/sys` and no cgroup tree: `find_cgroup2` must still find (mount)
//! the cgroup2 hierarchy — the same one the host sees, also when several stacks start at once
//! there. Needs root and `ip`; skips otherwise.
#![allow(missing_docs)]

use std::os::unix::fs::MetadataExt;
use std::process::Command;

#[test]
fn child_entry() {
    if std::env::var_os("SMC_CG_CHILD").is_none() {
        return;
    }
    // Several stacks starting at once in one mount namespace (processes under one `ip netns
    // exec`): each finds nothing and mounts; every one must end with the hierarchy.
    let start = std::sync::Arc::new(std::sync::Barrier::new(8));
    let found: Vec<_> = (0..8)
        .map(|_| {
            let start = start.clone();
            std::thread::spawn(move || {
                start.wait();
                smc::discovery::find_cgroup2()
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().expect("thread"))
        .collect();
    let mut devs = Vec::new();
    for r in found {
        let p = r.expect("a cgroup2 hierarchy under ip netns exec");
        devs.push((std::fs::metadata(&p).expect("stat").dev(), p));
    }
    let (dev, p) = &devs[0];
    assert!(devs.iter().all(|(d, _)| d == dev), "{devs:?}");
    println!("CGROUP {} DEV {dev}", p.display());
}

#[test]
fn find_cgroup2_under_ip_netns_exec() {
    if std::env::var_os("SMC_CG_CHILD").is_some() {
        return;
    }
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: needs root (network namespace, mount)");
        return;
    }
    if Command::new("ip").arg("-V").output().is_err() {
        eprintln!("skipped: no `ip` command");
        return;
    }
    let host = smc::discovery::find_cgroup2().expect("host cgroup2");
    let host_dev = std::fs::metadata(&host).expect("stat").dev();
    let ns = format!("smccg{}", std::process::id());
    let ok = Command::new("ip")
        .args(["netns", "add", &ns])
        .status()
        .expect("ip netns add");
    assert!(ok.success());
    let out = Command::new("ip")
        .args(["netns", "exec", &ns])
        .arg(std::env::current_exe().expect("exe"))
        .args(["child_entry", "--exact", "--nocapture", "--test-threads=1"])
        .env("SMC_CG_CHILD", "1")
        .env_remove("SMC_CGROUP2")
        .output()
        .expect("ip netns exec");
    let _ = Command::new("ip").args(["netns", "del", &ns]).status();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = text
        .lines()
        .find_map(|l| l.find("CGROUP ").map(|i| &l[i + 7..]))
        .expect("child reported its cgroup");
    let (path, dev) = line.split_once(" DEV ").expect("path and dev");
    assert_eq!(
        dev.trim().parse::<u64>().expect("dev"),
        host_dev,
        "the same cgroup2 hierarchy as the host's {} (found at {path})",
        host.display()
    );
}
