//! `smc bench` results: the measurement record, medians over rounds, JSON lines, and the
//! table with ratios against TCP, Unix sockets and the floor, and the issue's goals as
//! pass/miss, each with the floor's own standing where there is one (whether the machine or
//! the implementation stops a goal).

use comfy_table::Table;

/// One measured value (the JSON line of `smc bench --json`).
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// `smc`, `tcp`, `uds` or `floor`.
    pub transport: &'static str,
    /// `stream`, `pingpong`, `connect`, `multistream`, `idle` or `fallback`.
    pub test: &'static str,
    /// Message size in bytes (0 where the test has none).
    pub size: usize,
    /// `blocking` or `busy`.
    pub mode: &'static str,
    /// Concurrent streams (idle: connections held).
    pub streams: usize,
    /// What `value` is: `gbps`, `rtt_p50_us`, `conn_per_s`, `cpu_s_per_gb`, ….
    pub metric: &'static str,
    /// The value.
    pub value: f64,
}

impl Sample {
    /// A sample without metric and value yet.
    pub fn new(
        transport: &'static str,
        test: &'static str,
        size: usize,
        mode: &'static str,
        streams: usize,
    ) -> Sample {
        Sample {
            transport,
            test,
            size,
            mode,
            streams,
            metric: "",
            value: f64::NAN,
        }
    }

    /// This sample with a metric and its value.
    pub fn with(&self, metric: &'static str, value: f64) -> Sample {
        Sample {
            metric,
            value,
            ..self.clone()
        }
    }

    fn key(
        &self,
    ) -> (
        &'static str,
        &'static str,
        usize,
        &'static str,
        usize,
        &'static str,
    ) {
        (
            self.transport,
            self.test,
            self.size,
            self.mode,
            self.streams,
            self.metric,
        )
    }

    /// A sample from its JSON line (`smc bench --from`).
    pub fn from_json_line(line: &str) -> anyhow::Result<Sample> {
        use anyhow::Context;
        let v: serde_json::Value = serde_json::from_str(line)?;
        // The names live as long as the command: leaking them is the simple way to get the
        // `&'static str` the live measurements use.
        let text = |k: &str| -> anyhow::Result<&'static str> {
            let s = v[k].as_str().with_context(|| format!("{k} in {line}"))?;
            Ok(Box::leak(s.to_string().into_boxed_str()))
        };
        let int = |k: &str| -> anyhow::Result<usize> {
            let n = v[k].as_u64().with_context(|| format!("{k} in {line}"))?;
            Ok(usize::try_from(n)?)
        };
        Ok(Sample {
            transport: text("transport")?,
            test: text("test")?,
            size: int("size")?,
            mode: text("mode")?,
            streams: int("streams")?,
            metric: text("metric")?,
            value: v["value"].as_f64().unwrap_or(f64::NAN),
        })
    }

    /// The JSON line.
    pub fn json_line(&self) -> String {
        serde_json::json!({
            "transport": self.transport,
            "test": self.test,
            "size": self.size,
            "mode": self.mode,
            "streams": self.streams,
            "metric": self.metric,
            "value": self.value,
        })
        .to_string()
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The median of every measured quantity over the rounds, in the order first measured.
pub fn medians(raw: Vec<Sample>) -> Vec<Sample> {
    let mut groups: Vec<(Sample, Vec<f64>)> = Vec::new();
    for s in raw {
        match groups.iter_mut().find(|(g, _)| g.key() == s.key()) {
            Some((_, vals)) => vals.push(s.value),
            None => {
                let v = s.value;
                groups.push((s, vec![v]));
            }
        }
    }
    groups
        .into_iter()
        .map(|(s, mut vals)| Sample {
            value: median(&mut vals),
            ..s
        })
        .collect()
}

/// The fallback row's verdict: the median over rounds of SMC-R's throughput divided by TCP's
/// in the same round (the two streams run back to back, in alternating order). A round's two
/// streams share the machine's state of the moment, which on a VM moves by ±10 % from one
/// second to the next: the ratio of two medians taken apart (the `gbps` row) cannot resolve
/// the 2 % goal, the median of paired ratios can. `raw` holds the samples in the order
/// measured; `None` without a complete pair.
pub fn fallback_paired_ratio(raw: &[Sample]) -> Option<Sample> {
    let runs: Vec<&Sample> = raw
        .iter()
        .filter(|s| s.test == "fallback" && s.metric == "gbps")
        .collect();
    let mut ratios: Vec<f64> = runs
        .chunks_exact(2)
        .filter_map(|pair| {
            let of = |t: &str| pair.iter().find(|s| s.transport == t).map(|s| s.value);
            match (of("smc"), of("tcp")) {
                (Some(smc), Some(tcp)) if tcp > 0.0 => Some(smc / tcp),
                _ => None,
            }
        })
        .collect();
    if ratios.is_empty() {
        return None;
    }
    let first = runs[0];
    Some(Sample {
        transport: "smc",
        metric: "gbps_paired_ratio",
        value: median(&mut ratios),
        ..*first
    })
}

/// `1 B`, `64 KiB`, `1 MiB`; `-` for 0.
pub fn size_text(n: usize) -> String {
    match n {
        0 => "-".to_string(),
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} B"),
    }
}

fn num(v: f64) -> String {
    if !v.is_finite() {
        "-".to_string()
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else if v.abs() >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

/// A goal of the issue: its rule as printed, and whether a value meets it (given the TCP and
/// UDS values of the same row).
struct Goal {
    rule: &'static str,
    met: fn(x: f64, tcp: f64, uds: f64) -> bool,
}

/// The issue's goal for a row, if it has one.
fn goal(test: &str, size: usize, mode: &str, metric: &str) -> Option<Goal> {
    let g = |rule, met| Some(Goal { rule, met });
    match (test, size, mode, metric) {
        ("pingpong", 1, "busy", "rtt_p50_us") => g("<= 0.10x tcp", |x, tcp, _| x <= 0.10 * tcp),
        ("pingpong", 1, "blocking", "rtt_p50_us") => g("<= 0.5x tcp, <= uds", |x, tcp, uds| {
            x <= 0.5 * tcp && x <= uds
        }),
        ("stream", 65536, _, "gbps") => g(">= 4x tcp", |x, tcp, _| x >= 4.0 * tcp),
        ("stream", 64, _, "gbps") => g(">= 3x tcp", |x, tcp, _| x >= 3.0 * tcp),
        ("connect", _, _, "conn_per_s") => g(">= 1.0x tcp", |x, tcp, _| x >= tcp),
        ("idle", _, _, "kib_per_idle_conn") => g("<= 160 KiB", |x, _, _| x <= 160.0),
        // The ratio of paired rounds (see `fallback_paired_ratio`), not of the two medians.
        ("fallback", _, _, "gbps_paired_ratio") => g(">= 0.98", |x, _, _| x >= 0.98),
        _ => None,
    }
}

/// The goal column: `pass`/`MISS` and the rule; where the row has a floor, also the floor's
/// ratio to TCP, marked `machine:` on a miss when the floor itself misses the goal (the
/// machine stops every implementation, not just ours). A pass whose floor misses (a blocking
/// floor that sleeps, beaten by a spin) says so without blaming the machine.
fn goal_text(g: &Goal, smc: f64, tcp: f64, uds: f64, floor: f64) -> String {
    let pass = (g.met)(smc, tcp, uds);
    let verdict = if pass { "pass" } else { "MISS" };
    let mut text = format!("{verdict} {}", g.rule);
    if floor.is_finite() && tcp.is_finite() && tcp != 0.0 {
        let who = if pass || (g.met)(floor, tcp, uds) {
            ""
        } else {
            "machine: "
        };
        text.push_str(&format!(" ({who}floor {:.2}x tcp)", floor / tcp));
    }
    text
}

/// The results as a table: one row per quantity, the three transports and the floor side by
/// side, the ratios SMC-R/TCP, SMC-R/UDS and SMC-R/floor, and the goal where the issue sets
/// one. `-` where a value is missing (no floor for the test, or an older JSON file).
pub fn table(results: &[Sample]) -> Table {
    let mut t = Table::new();
    // Markdown-shaped, so a run's table can go into docs as it is.
    t.load_preset(comfy_table::presets::ASCII_MARKDOWN);
    t.set_header(vec![
        "test",
        "size",
        "mode",
        "streams",
        "metric",
        "smc",
        "tcp",
        "uds",
        "floor",
        "smc/tcp",
        "smc/uds",
        "smc/floor",
        "goal",
    ]);
    let mut rows: Vec<&Sample> = Vec::new();
    for s in results {
        let same = |r: &&Sample| {
            r.test == s.test
                && r.size == s.size
                && r.mode == s.mode
                && r.streams == s.streams
                && r.metric == s.metric
        };
        if !rows.iter().any(same) {
            rows.push(s);
        }
    }
    for r in rows {
        let of = |tr: &str| {
            results
                .iter()
                .find(|s| {
                    s.transport == tr
                        && s.test == r.test
                        && s.size == r.size
                        && s.mode == r.mode
                        && s.streams == r.streams
                        && s.metric == r.metric
                })
                .map_or(f64::NAN, |s| s.value)
        };
        let (smc, tcp, uds, floor) = (of("smc"), of("tcp"), of("uds"), of("floor"));
        let ratio = |a: f64, b: f64| {
            if a.is_finite() && b.is_finite() && b != 0.0 {
                format!("{:.2}x", a / b)
            } else {
                "-".to_string()
            }
        };
        let g = goal(r.test, r.size, r.mode, r.metric)
            .map(|g| goal_text(&g, smc, tcp, uds, floor))
            .unwrap_or_default();
        t.add_row(vec![
            r.test.to_string(),
            size_text(r.size),
            r.mode.to_string(),
            r.streams.to_string(),
            r.metric.to_string(),
            num(smc),
            num(tcp),
            num(uds),
            num(floor),
            ratio(smc, tcp),
            ratio(smc, uds),
            ratio(smc, floor),
            g,
        ]);
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_group_by_everything_but_the_value() {
        let s = Sample::new("smc", "stream", 64, "blocking", 1);
        let raw = vec![
            s.with("gbps", 3.0),
            s.with("gbps", 1.0),
            Sample::new("tcp", "stream", 64, "blocking", 1).with("gbps", 7.0),
            s.with("gbps", 2.0),
        ];
        let m = medians(raw);
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].value, 2.0);
        assert_eq!(m[1].value, 7.0);
    }

    /// The fallback verdict pairs each round's two streams: a machine whose speed drifts
    /// between rounds moves both of a pair, not their ratio. Here the medians taken apart
    /// (21 vs 22) would say 0.95, the pairs say 1.0; a pair without both transports counts not.
    #[test]
    fn the_fallback_ratio_is_the_median_of_paired_rounds() {
        let fb = |t: &'static str, v: f64| {
            Sample::new(t, "fallback", 65536, "blocking", 1).with("gbps", v)
        };
        let cpu = Sample::new("smc", "fallback", 65536, "blocking", 1).with("cpu_s_per_gb", 9.0);
        let raw = vec![
            fb("smc", 10.0),
            fb("tcp", 10.0),
            cpu,
            fb("tcp", 21.0),
            fb("smc", 21.0),
            fb("smc", 30.0),
            fb("tcp", 30.0),
            fb("tcp", 22.0),
            fb("smc", 20.0),
            fb("smc", 40.0),
            fb("tcp", 40.0),
        ];
        let m = medians(raw.clone());
        let of = |t: &str| {
            m.iter()
                .find(|s| s.transport == t && s.metric == "gbps")
                .map(|s| s.value)
        };
        assert_eq!((of("smc"), of("tcp")), (Some(21.0), Some(22.0)));
        let p = fallback_paired_ratio(&raw).expect("pairs");
        assert_eq!(
            (p.transport, p.test, p.metric),
            ("smc", "fallback", "gbps_paired_ratio")
        );
        assert_eq!(p.value, 1.0);
        let g = goal(p.test, p.size, p.mode, p.metric).expect("the fallback goal");
        assert!((g.met)(p.value, f64::NAN, f64::NAN));
        assert!(!(g.met)(0.97, f64::NAN, f64::NAN));
        // No complete pair, no verdict.
        assert!(fallback_paired_ratio(&[fb("smc", 1.0)]).is_none());
    }

    #[test]
    fn goals_compare_against_tcp() {
        let g = goal("stream", 65536, "blocking", "gbps").unwrap();
        assert_eq!(g.rule, ">= 4x tcp");
        assert!((g.met)(4.0, 1.0, 1.0));
        let g = goal("pingpong", 1, "blocking", "rtt_p50_us").unwrap();
        assert_eq!(g.rule, "<= 0.5x tcp, <= uds");
        assert!(!(g.met)(5.0, 10.0, 4.0));
        assert!(goal("stream", 16, "blocking", "gbps").is_none());
    }

    #[test]
    fn goals_tell_the_machine_from_the_implementation() {
        let g = goal("stream", 65536, "blocking", "gbps").unwrap();
        assert_eq!(
            goal_text(&g, 2.0, 1.0, 1.0, 3.4),
            "MISS >= 4x tcp (machine: floor 3.40x tcp)"
        );
        assert_eq!(
            goal_text(&g, 2.0, 1.0, 1.0, 4.6),
            "MISS >= 4x tcp (floor 4.60x tcp)"
        );
        assert_eq!(
            goal_text(&g, 5.0, 1.0, 1.0, 8.0),
            "pass >= 4x tcp (floor 8.00x tcp)"
        );
        // No floor (other tests, older JSON files): the verdict alone.
        assert_eq!(goal_text(&g, 2.0, 1.0, 1.0, f64::NAN), "MISS >= 4x tcp");
        let g = goal("pingpong", 1, "busy", "rtt_p50_us").unwrap();
        assert_eq!(
            goal_text(&g, 2.0, 8.0, 4.0, 0.9),
            "MISS <= 0.10x tcp (machine: floor 0.11x tcp)"
        );
        // A pass beats even a floor that misses: no blame on the machine.
        let g = goal("pingpong", 1, "blocking", "rtt_p50_us").unwrap();
        assert_eq!(
            goal_text(&g, 2.0, 40.0, 30.0, 29.0),
            "pass <= 0.5x tcp, <= uds (floor 0.72x tcp)"
        );
    }

    #[test]
    fn the_table_has_a_floor_column_and_dashes_without_one() {
        let s = |t, v| Sample::new(t, "stream", 65536, "blocking", 1).with("gbps", v);
        let with_floor = table(&[s("smc", 2.0), s("tcp", 1.0), s("uds", 2.0), s("floor", 8.0)]);
        let text = with_floor.to_string();
        assert!(text.contains("smc/floor"), "{text}");
        assert!(text.contains("0.25x"), "{text}");
        assert!(text.contains("MISS >= 4x tcp (floor 8.00x tcp)"), "{text}");
        let old = table(&[s("smc", 2.0), s("tcp", 1.0), s("uds", 2.0)]).to_string();
        assert!(old.contains("| MISS >= 4x tcp "), "{old}");
    }

    #[test]
    fn json_lines_read_back() {
        let s = Sample::new("uds", "multistream", 65536, "blocking", 16).with("gbps", 1.5);
        assert_eq!(Sample::from_json_line(&s.json_line()).unwrap(), s);
        assert!(Sample::from_json_line(r#"{"transport":"smc"}"#).is_err());
    }

    #[test]
    fn sizes_read_as_powers_of_two() {
        assert_eq!(size_text(1), "1 B");
        assert_eq!(size_text(65536), "64 KiB");
        assert_eq!(size_text(1 << 20), "1 MiB");
        assert_eq!(size_text(0), "-");
    }
}
