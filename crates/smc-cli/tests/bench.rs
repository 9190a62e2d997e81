//! `smc bench --quick --json` as CI runs it: four processes (the bench client and one server
//! per transport) on a private shm fabric. Checks the shape of every JSON line and that every
//! expected measurement is there, the floor's (stream, ping-pong, connect) included; never the
//! measured values themselves.
#![allow(missing_docs)]

use std::collections::BTreeSet;
use std::process::Command;

type Key = (String, String, u64, String, u64, String);

fn key(transport: &str, test: &str, size: u64, mode: &str, streams: u64, metric: &str) -> Key {
    (
        transport.into(),
        test.into(),
        size,
        mode.into(),
        streams,
        metric.into(),
    )
}

/// Every (transport, test, size, mode, streams, metric) a quick run must report.
fn expected() -> BTreeSet<Key> {
    let mut e = BTreeSet::new();
    for t in ["smc", "tcp", "uds"] {
        for i in 0..=10 {
            for m in ["gbps", "cpu_s_per_gb"] {
                e.insert(key(t, "stream", 1 << (2 * i), "blocking", 1, m));
            }
        }
        for mode in ["blocking", "busy"] {
            for size in [1, 64, 1024, 16384, 65536] {
                for m in ["rtt_p50_us", "rtt_p99_us", "rtt_p999_us"] {
                    e.insert(key(t, "pingpong", size, mode, 1, m));
                }
            }
        }
        e.insert(key(t, "connect", 0, "blocking", 1, "conn_per_s"));
        for n in [1, 4, 16, 256] {
            for m in ["gbps", "cpu_s_per_gb"] {
                e.insert(key(t, "multistream", 65536, "blocking", n, m));
            }
        }
        for m in [
            "kib_per_idle_conn",
            "kib_per_idle_conn_client",
            "kib_per_idle_conn_server",
        ] {
            e.insert(key(t, "idle", 0, "blocking", 16, m));
        }
    }
    // The floor: only where a test has one (no multistream, idle or fallback rows).
    for i in 0..=10 {
        for m in ["gbps", "cpu_s_per_gb", "gbps_two_cores", "gbps_one_core"] {
            e.insert(key("floor", "stream", 1 << (2 * i), "blocking", 1, m));
        }
    }
    for mode in ["blocking", "busy"] {
        for size in [1, 64, 1024, 16384, 65536] {
            for m in ["rtt_p50_us", "rtt_p99_us", "rtt_p999_us"] {
                e.insert(key("floor", "pingpong", size, mode, 1, m));
            }
        }
    }
    e.insert(key("floor", "connect", 0, "blocking", 1, "conn_per_s"));
    e.insert(key(
        "smc",
        "connect",
        0,
        "blocking",
        1,
        "first_contact_conn_per_s",
    ));
    for t in ["smc", "tcp"] {
        for m in ["gbps", "cpu_s_per_gb"] {
            e.insert(key(t, "fallback", 65536, "blocking", 1, m));
        }
    }
    e.insert(key(
        "smc",
        "fallback",
        65536,
        "blocking",
        1,
        "gbps_paired_ratio",
    ));
    e
}

#[test]
fn quick_bench_reports_every_measurement_as_json_lines() {
    let dir = std::env::temp_dir().join(format!("smc-cli-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let plot = dir.join("bench.svg");
    let out = Command::new(env!("CARGO_BIN_EXE_smc"))
        .args(["bench", "--quick", "--json", "--plot"])
        .arg(&plot)
        .env_remove("SMC_FABRIC_FAULTS")
        .env_remove("SMC_CONFIG")
        .output()
        .expect("run smc bench");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "smc bench failed: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut seen = BTreeSet::new();
    for line in text.lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
        let o = v
            .as_object()
            .unwrap_or_else(|| panic!("not an object: {line}"));
        let names: Vec<&str> = o.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "transport",
                "test",
                "size",
                "mode",
                "streams",
                "metric",
                "value"
            ],
            "{line}"
        );
        let s = |k: &str| {
            o[k].as_str()
                .unwrap_or_else(|| panic!("{k} not a string: {line}"))
                .to_string()
        };
        let n = |k: &str| {
            o[k].as_u64()
                .unwrap_or_else(|| panic!("{k} not an unsigned integer: {line}"))
        };
        assert!(
            ["smc", "tcp", "uds", "floor"].contains(&s("transport").as_str()),
            "{line}"
        );
        assert!(["blocking", "busy"].contains(&s("mode").as_str()), "{line}");
        assert!(o["value"].is_number(), "value not a number: {line}");
        let k = (
            s("transport"),
            s("test"),
            n("size"),
            s("mode"),
            n("streams"),
            s("metric"),
        );
        assert!(seen.insert(k), "reported twice: {line}");
    }
    let expected = expected();
    let missing: Vec<_> = expected.difference(&seen).collect();
    assert!(missing.is_empty(), "missing: {missing:?}\n{text}");
    let extra: Vec<_> = seen.difference(&expected).collect();
    assert!(extra.is_empty(), "unexpected: {extra:?}");
    let svg = std::fs::read_to_string(&plot).expect("the plot was written");
    assert!(svg.starts_with("<svg"), "not an SVG");
    assert!(svg.contains("Streaming throughput"), "no throughput panel");
    let _ = std::fs::remove_dir_all(&dir);
}
