//! `smc ss`, `smc linkgroup`, `smc device`, `smc stats`: ask every running stack on the
//! fabric directory through its control socket and show the answers.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use comfy_table::Table;
use serde_json::{json, Value};

/// Arguments shared by the observability commands.
#[derive(Args, Debug)]
pub struct ObserveArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Fabric directory (default: `SMC_FABRIC_DIR`, else the fabric's default).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Details (`smc ss`: cursors, buffer sizes and the send window of SMC-R sockets).
    #[arg(short = 'd', long)]
    details: bool,
}

/// Which query.
#[derive(Debug, Clone, Copy)]
pub enum Query {
    /// Sockets.
    Ss,
    /// Link groups.
    LinkGroup,
    /// Devices.
    Device,
    /// Counters.
    Stats,
    /// The PNET table.
    Pnet,
}

impl Query {
    fn word(self) -> &'static str {
        match self {
            Query::Ss => "ss",
            Query::LinkGroup => "linkgroup",
            Query::Device => "device",
            Query::Stats => "stats",
            Query::Pnet => "pnet",
        }
    }
}

fn fabric_dir(args: &ObserveArgs) -> PathBuf {
    args.dir
        .clone()
        .or_else(|| std::env::var_os("SMC_FABRIC_DIR").map(PathBuf::from))
        .unwrap_or_else(smc::control::default_fabric_dir)
}

/// The stack's process id, from its socket name `<pid>-<instance>.sock`.
fn pid_of(p: &std::path::Path) -> String {
    p.file_stem()
        .and_then(|s| s.to_str())
        .and_then(|s| s.split('-').next())
        .unwrap_or("?")
        .to_string()
}

/// The program name of process `pid` (`/proc/<pid>/comm`), `?` when unknown.
fn program_of(pid: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| s.trim_end().to_string())
        .unwrap_or_else(|_| "?".into())
}

fn cell(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Run one observability command.
pub fn run(q: Query, args: &ObserveArgs) -> Result<ExitCode> {
    let dir = fabric_dir(args);
    let mut answers = Vec::new();
    for sock in smc::control::list_sockets(&dir) {
        // A socket whose stack is gone does not answer: skip it.
        if let Ok(v) = smc::control::query(&sock, q.word(), Duration::from_secs(2)) {
            answers.push((pid_of(&sock), v));
        }
    }
    if args.json {
        let all: Vec<Value> = answers
            .iter()
            .map(|(pid, v)| json!({ "pid": pid, "program": program_of(pid), q.word(): v }))
            .collect();
        writeln!(std::io::stdout(), "{}", serde_json::to_string_pretty(&all)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    let mut t = Table::new();
    match q {
        Query::Ss => {
            let mut header = vec![
                "pid",
                "program",
                "local",
                "peer",
                "role",
                "mode",
                "state",
                "lgr",
                "link",
                "sent",
                "received",
                "fallback reason",
            ];
            const DETAILS: [(&str, &str); 8] = [
                ("rmbe", "rmbe_size"),
                ("peer rmbe", "peer_rmbe_size"),
                ("prod", "producer_cursor"),
                ("cons", "consumer_cursor"),
                ("peer prod", "peer_producer_cursor"),
                ("peer cons", "peer_consumer_cursor"),
                ("window", "send_window"),
                ("readable", "readable"),
            ];
            if args.details {
                header.extend(DETAILS.iter().map(|(h, _)| *h));
            }
            t.set_header(header);
            for (pid, v) in &answers {
                for s in v.as_array().into_iter().flatten() {
                    let mut row = vec![
                        pid.clone(),
                        program_of(pid),
                        cell(&s["local"]),
                        cell(&s["peer"]),
                        cell(&s["role"]),
                        cell(&s["mode"]),
                        cell(&s["state"]),
                        cell(&s["link_group"]),
                        cell(&s["send_link"]),
                        cell(&s["bytes_sent"]),
                        cell(&s["bytes_received"]),
                        cell(&s["fallback_reason"]),
                    ];
                    if args.details {
                        row.extend(DETAILS.iter().map(|(_, k)| cell(&s[*k])));
                    }
                    t.add_row(row);
                }
            }
        }
        Query::LinkGroup => {
            t.set_header(vec![
                "pid", "lgr", "version", "role", "peer", "conns", "link", "device", "state",
            ]);
            for (pid, v) in &answers {
                for g in v.as_array().into_iter().flatten() {
                    for l in g["links"].as_array().into_iter().flatten() {
                        t.add_row(vec![
                            pid.clone(),
                            cell(&g["id"]),
                            cell(&g["version"]),
                            cell(&g["role"]),
                            cell(&g["peer"]),
                            cell(&g["connections"]),
                            cell(&l["num"]),
                            cell(&l["device"]),
                            cell(&l["state"]),
                        ]);
                    }
                }
            }
        }
        Query::Device => {
            t.set_header(vec![
                "pid",
                "device",
                "kind",
                "netdev",
                "gids",
                "mac",
                "mtu",
                "port",
                "pkts tx/rx",
                "retrans",
                "naks tx/rx",
                "drops",
                "netdevs",
                "addresses",
            ]);
            for (pid, v) in &answers {
                for d in v.as_array().into_iter().flatten() {
                    let c = &d["counters"];
                    let n = |k: &str| c[k].as_u64().unwrap_or(0);
                    let roce = c.is_object();
                    let pair = |a: &str, b: &str| {
                        if roce {
                            format!("{}/{}", n(a), n(b))
                        } else {
                            "-".into()
                        }
                    };
                    let drops = n("drop_icrc")
                        + n("drop_malformed")
                        + n("drop_unknown_qp")
                        + n("drop_wrong_source")
                        + n("drop_out_of_sequence")
                        + n("drop_ghost_acks");
                    t.add_row(vec![
                        pid.clone(),
                        cell(&d["name"]),
                        cell(&d["kind"]),
                        cell(&d["netdev"]),
                        // The GID table, one per line (a roce device: IPv4-mapped, then IPv6).
                        d["gids"].as_array().map_or_else(
                            || cell(&d["gid"]),
                            |g| g.iter().map(cell).collect::<Vec<_>>().join("\n"),
                        ),
                        cell(&d["mac"]),
                        cell(&d["mtu"]),
                        cell(&d["port"]),
                        pair("tx_packets", "rx_packets"),
                        if roce {
                            n("retransmits").to_string()
                        } else {
                            "-".into()
                        },
                        pair("naks_sent", "naks_received"),
                        if roce { drops.to_string() } else { "-".into() },
                        cell(&d["netdevs"]),
                        cell(&d["addresses"]),
                    ]);
                }
            }
        }
        Query::Pnet => {
            t.set_header(vec!["pid", "device", "netdevs", "addresses"]);
            for (pid, v) in &answers {
                for d in v.as_array().into_iter().flatten() {
                    let list = |k: &str| {
                        let items: Vec<String> =
                            d[k].as_array().into_iter().flatten().map(cell).collect();
                        items.join(",")
                    };
                    let any = d["serves_all"].as_bool() == Some(true);
                    t.add_row(vec![
                        pid.clone(),
                        cell(&d["device"]),
                        if any { "(any)".into() } else { list("netdevs") },
                        if any {
                            "(any)".into()
                        } else {
                            list("addresses")
                        },
                    ]);
                }
            }
        }
        Query::Stats => {
            t.set_header(vec!["pid", "counter", "value"]);
            for (pid, v) in &answers {
                for (k, val) in v.as_object().into_iter().flatten() {
                    match val {
                        Value::Object(m) => {
                            for (reason, n) in m {
                                t.add_row(vec![pid.clone(), format!("{k}: {reason}"), cell(n)]);
                            }
                        }
                        other => {
                            t.add_row(vec![pid.clone(), k.clone(), cell(other)]);
                        }
                    }
                }
            }
        }
    }
    if answers.is_empty() {
        writeln!(
            std::io::stdout(),
            "no running smc-rs stack found in {}",
            dir.display()
        )?;
    } else {
        // A closed pipe (`smc ss | head`) is an error main() ends quietly on, not a panic.
        writeln!(std::io::stdout(), "{t}")?;
    }
    Ok(ExitCode::SUCCESS)
}
