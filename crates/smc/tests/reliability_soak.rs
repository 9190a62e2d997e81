//! Soak (not in CI: `#[ignore]`, run by `scripts/soak.sh`): a mixed workload between two
//! processes for `SMC_REL_SOAK_SECS` seconds. This process is the server (an echo for every
//! connection) and takes one of its ports down every `SMC_REL_SOAK_FAILOVER_MS` (then up
//! again; the link is added back). The peer process runs the workload and checks every byte:
//! `SMC_REL_SOAK_STREAMS` long streams (written and read back continuously, compared with the
//! regenerated pattern) and a churn of short connections (connect, echo a random size, close).
//! Every 10 s a `SOAK` line reports both processes' RSS, fds and the counters (also the
//! connections whose echo, in this process, ended with an error). A stream that
//! fails is counted by error and replaced; a byte that differs is corruption: counted, and the
//! soak fails at the end (it runs its full time so that the report shows everything).
#![allow(missing_docs)]

mod reliability_common;

use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reliability_common::*;
use smc::{PortState, SmcListener, SmcStream, Stack};

/// The workload's counters (in the peer process).
#[derive(Default)]
struct Counters {
    verified: AtomicU64,
    streams_started: AtomicU64,
    stream_errors: AtomicU64,
    churn_ok: AtomicU64,
    churn_errors: AtomicU64,
    corrupt: AtomicU64,
    errors: Mutex<std::collections::BTreeMap<String, u64>>,
}

impl Counters {
    fn error(&self, what: &str, e: &std::io::Error) {
        let mut m = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        *m.entry(format!("{what}: {e}")).or_default() += 1;
    }
}

/// Describe a corruption on stderr: when (UTC, to match the logs), where the first differing
/// byte is, how many differ, whether the received bytes are zeros (never written) and, for a
/// stream of pattern `seed` read up to `pos`, whether they are this stream's own bytes from
/// another offset (stale or replayed bytes) or bytes from elsewhere.
fn report_corruption(what: &str, mode: &str, want: &[u8], got: &[u8], own: Option<(u64, u64)>) {
    let first = want.iter().zip(got).position(|(a, b)| a != b).unwrap_or(0);
    let differ = want.iter().zip(got).filter(|(a, b)| a != b).count();
    let zeros = got[first..].iter().take(64).all(|&b| b == 0);
    let mut origin = String::new();
    if let Some((seed, pos)) = own {
        // Look for the 16 received bytes at the first difference in the 64 MiB of the
        // stream before and 16 MiB after it.
        let at = (pos + first as u64) & !7;
        let word = got.get(first..first + 16);
        let from = at.saturating_sub(64 << 20);
        let mut p = Pattern::new(seed);
        let mut skip = vec![0u8; 1 << 20];
        let mut done = 0u64;
        while done + (1 << 20) <= from {
            p.fill(&mut skip);
            done += 1 << 20;
        }
        let mut window = vec![0u8; (at + (16 << 20) - done) as usize];
        p.fill(&mut window);
        let found = word.and_then(|w| window.windows(w.len()).position(|c| c == w));
        let want_at = pos + first as u64;
        origin = match found {
            Some(i) => format!(
                ", the stream's own bytes from offset {} ({:+} bytes)",
                done + i as u64,
                (done + i as u64) as i64 - want_at as i64
            ),
            None => ", not this stream's bytes near there".to_string(),
        };
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    eprintln!(
        "CORRUPTION at unix {t:.6} in a {what} of {} bytes: first difference at {first}, {differ} \
         bytes differ, received bytes there are {}{origin}; mode {mode}; want {:02x?} got {:02x?}",
        want.len(),
        if zeros { "zeros" } else { "not zeros" },
        &want[first..want.len().min(first + 24)],
        &got[first..got.len().min(first + 24)],
    );
}

/// One long stream: write the pattern of `seed` forever, read it back and compare.
fn long_stream(st: &Stack, port: u16, seed: u64, c: &Counters) -> std::io::Result<()> {
    let mut r = SmcStream::connect_with(st, ("127.0.0.1", port))?;
    // A stalled stream fails after 30 s and is replaced (counted).
    r.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut w = r.try_clone()?;
    w.set_write_timeout(Some(Duration::from_secs(30)))?;
    c.streams_started.fetch_add(1, Ordering::Relaxed);
    let writer = std::thread::spawn(move || -> std::io::Result<()> {
        let mut p = Pattern::new(seed);
        let mut rng = Rng::new(seed);
        let mut buf = vec![0u8; 256 * 1024];
        loop {
            let n = 1 + rng.below(buf.len() as u64) as usize;
            // The pattern is produced in 8-byte steps: keep writes 8-byte aligned.
            let n = (n + 7) & !7;
            p.fill(&mut buf[..n]);
            w.write_all(&buf[..n])?;
        }
    });
    let mut expect = Pattern::new(seed);
    let mut want = vec![0u8; 64 * 1024];
    let mut got = vec![0u8; 64 * 1024];
    let mut pos = 0u64;
    let res = loop {
        if let Err(e) = r.read_exact(&mut got) {
            break Err(e);
        }
        expect.fill(&mut want);
        if got != want {
            c.corrupt.fetch_add(1, Ordering::Relaxed);
            report_corruption(
                "long stream chunk",
                &format!("{:?}", r.mode()),
                &want,
                &got,
                Some((seed, pos)),
            );
            break Err(std::io::Error::other("CORRUPTION"));
        }
        c.verified.fetch_add(got.len() as u64, Ordering::Relaxed);
        pos += got.len() as u64;
    };
    drop(r);
    let _ = writer.join();
    res
}

/// One short connection: echo a random size and compare.
fn churn_once(st: &Stack, port: u16, rng: &mut Rng, c: &Counters) -> std::io::Result<()> {
    let mut s = SmcStream::connect_with(st, ("127.0.0.1", port))?;
    // A stalled short connection shows up as a counted error, not a silent pause.
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let n = 1 + rng.below(256 * 1024) as usize;
    let mut data = vec![0u8; n];
    let seed = rng.next_u64();
    Pattern::new(seed).fill(&mut data);
    let mut w = s.try_clone()?;
    w.set_write_timeout(Some(Duration::from_secs(30)))?;
    let out = data.clone();
    let t = std::thread::spawn(move || w.write_all(&out));
    let mut back = vec![0u8; n];
    let r = s.read_exact(&mut back);
    let wr = t
        .join()
        .map_err(|_| std::io::Error::other("writer panicked"))?;
    r?;
    wr?;
    if back != data {
        c.corrupt.fetch_add(1, Ordering::Relaxed);
        report_corruption(
            "short connection",
            &format!("{:?}", s.mode()),
            &data,
            &back,
            Some((seed, 0)),
        );
        return Err(std::io::Error::other("CORRUPTION"));
    }
    c.verified.fetch_add(n as u64, Ordering::Relaxed);
    Ok(())
}

#[test]
fn child_entry() {
    let Ok(role) = std::env::var("SMC_REL_CHILD") else {
        return;
    };
    let dir = PathBuf::from(std::env::var("SMC_REL_DIR").expect("dir"));
    exit_on_stdin_eof();
    assert_eq!(role, "soak-workload");
    let st = stack(&dir);
    let port: u16 = std::env::var("SMC_REL_PORT")
        .expect("port")
        .parse()
        .expect("port");
    let c = Arc::new(Counters::default());
    for i in 0..env_count("SMC_REL_SOAK_STREAMS", 4) {
        let (st, c) = (st.clone(), c.clone());
        std::thread::spawn(move || {
            let mut seed = i * 1_000_000;
            loop {
                seed += 1;
                if let Err(e) = long_stream(&st, port, seed, &c) {
                    c.stream_errors.fetch_add(1, Ordering::Relaxed);
                    c.error("stream", &e);
                }
            }
        });
    }
    {
        let (st, c) = (st.clone(), c.clone());
        std::thread::spawn(move || {
            let mut rng = Rng::new(99);
            loop {
                match churn_once(&st, port, &mut rng, &c) {
                    Ok(()) => c.churn_ok.fetch_add(1, Ordering::Relaxed),
                    Err(e) => {
                        c.error("churn", &e);
                        c.churn_errors.fetch_add(1, Ordering::Relaxed)
                    }
                };
            }
        });
    }
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let errors = c.errors.lock().unwrap_or_else(|p| p.into_inner()).clone();
        println!(
            "STATS verified={} streams={} stream_errors={} churn_ok={} churn_errors={} \
             corrupt={} rss_kib={} fds={} errors={errors:?}",
            c.verified.load(Ordering::Relaxed),
            c.streams_started.load(Ordering::Relaxed),
            c.stream_errors.load(Ordering::Relaxed),
            c.churn_ok.load(Ordering::Relaxed),
            c.churn_errors.load(Ordering::Relaxed),
            c.corrupt.load(Ordering::Relaxed),
            rss_kib(),
            proc_resources().fds,
        );
    }
}

/// Connections whose echo (in this, the server process) ended with an error instead of the
/// peer's end of stream: the application on this side saw a reset.
static SERVER_ERRORS: AtomicU64 = AtomicU64::new(0);

/// Echo `s` until the peer's end of stream; false if a read or write failed.
fn echo_counted(mut s: SmcStream) -> bool {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if let Err(e) = s.write_all(&buf[..n]) {
                    eprintln!("echo: write failed: {e}");
                    return false;
                }
            }
            Err(e) => {
                eprintln!("echo: read failed: {e}");
                return false;
            }
        }
    }
    let _ = s.shutdown(std::net::Shutdown::Write);
    true
}

fn field(line: &str, key: &str) -> u64 {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[test]
#[ignore = "soak: minutes to hours; run by scripts/soak.sh"]
fn soak_mixed_workload_with_failovers() {
    if is_child() {
        return;
    }
    let secs = env_count("SMC_REL_SOAK_SECS", 60);
    let every = Duration::from_millis(env_count("SMC_REL_SOAK_FAILOVER_MS", 5000));
    let dir = test_dir("soak");
    let st = stack(&dir);
    let l = SmcListener::bind_with(&st, "127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            std::thread::spawn(move || {
                if !echo_counted(s) {
                    SERVER_ERRORS.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
    });
    let mut cmd = std::process::Command::new(std::env::current_exe().expect("exe"));
    cmd.args(["child_entry", "--exact", "--nocapture", "--test-threads=1"])
        .env("SMC_REL_CHILD", "soak-workload")
        .env("SMC_REL_DIR", &dir)
        .env("SMC_REL_PORT", port.to_string())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped());
    let mut child = cmd.spawn().expect("spawn workload");
    let child_pid = child.id();
    let last = Arc::new(Mutex::new(String::new()));
    {
        let out = child.stdout.take().expect("stdout");
        let last = last.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Some(i) = line.find("STATS ") {
                    *last.lock().unwrap_or_else(|p| p.into_inner()) = line[i..].to_string();
                }
            }
        });
    }
    let devices = st.devices();
    let start = Instant::now();
    let end = start + Duration::from_secs(secs);
    let mut next_failover = start + every;
    let mut next_report = start;
    let mut failovers = 0u64;
    let mut rng = Rng::new(5);
    let child_rss = || -> u64 {
        std::fs::read_to_string(format!("/proc/{child_pid}/status"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("VmRSS:"))
                    .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
            })
            .unwrap_or(0)
    };
    println!("SOAK t_s server_rss_kib server_fds client_rss_kib failovers verified_mib streams stream_errors churn_ok churn_errors corrupt server_errors");
    while Instant::now() < end {
        let now = Instant::now();
        if now >= next_failover {
            let dev = &devices[rng.below(devices.len() as u64) as usize];
            st.set_port_state(dev, PortState::Down);
            let _ = wait_until(Duration::from_secs(10), || {
                st.link_groups().iter().all(|g| g.links.len() < 2)
            });
            std::thread::sleep(Duration::from_millis(rng.below(200)));
            st.set_port_state(dev, PortState::Active);
            failovers += 1;
            next_failover = Instant::now() + every;
        }
        if now >= next_report {
            let s = last.lock().unwrap_or_else(|p| p.into_inner()).clone();
            println!(
                "SOAK {} {} {} {} {} {} {} {} {} {} {} {}",
                start.elapsed().as_secs(),
                rss_kib(),
                proc_resources().fds,
                child_rss(),
                failovers,
                field(&s, "verified") >> 20,
                field(&s, "streams"),
                field(&s, "stream_errors"),
                field(&s, "churn_ok"),
                field(&s, "churn_errors"),
                field(&s, "corrupt"),
                SERVER_ERRORS.load(Ordering::Relaxed),
            );
            next_report = now + Duration::from_secs(10);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let s = last.lock().unwrap_or_else(|p| p.into_inner()).clone();
    println!(
        "SOAK-END after {:?}, {failovers} failovers: {s} server_errors={}",
        start.elapsed(),
        SERVER_ERRORS.load(Ordering::Relaxed)
    );
    drop(child.stdin.take());
    let _ = child.wait();
    assert_eq!(field(&s, "corrupt"), 0, "corruption: {s}");
    assert!(field(&s, "verified") > 0, "nothing moved: {s}");
    let _ = std::fs::remove_dir_all(&dir);
}
