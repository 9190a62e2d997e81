//! `smc decode`: print every SMC-R message found in hex input, a capture, or the examples.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value as Json};
use smc_wire::describe::{self, Description, Value};
use smc_wire::dissect::{self, Finding, Found, Origin};
use smc_wire::examples;
use smc_wire::llc_v2::{is_v2_type, LlcV2Message};
use smc_wire::{
    tcp_option, ClcMessage, ControlMessage, SendMessage, EYECATCHER_SMCD, EYECATCHER_SMCR,
    MSG44_LEN,
};

/// Arguments of `smc decode`.
#[derive(clap::Args, Debug)]
pub struct DecodeArgs {
    /// Hex strings, each one or more messages (CLC messages back to back, a 44-byte LLC/CDC
    /// message, or a TCP options block), or paths of pcap/pcapng captures (an argument that
    /// names an existing file is read as a capture). Without any, hex is read from standard input.
    hex: Vec<String>,
    /// Read a pcap or pcapng capture instead (Ethernet frames).
    #[arg(short = 'r', long = "file", conflicts_with_all = ["hex", "example"])]
    file: Option<PathBuf>,
    /// Decode a bundled reference vector by name, or `all` of them.
    #[arg(long, conflicts_with = "hex")]
    example: Option<String>,
    /// One JSON object per message, one per line.
    #[arg(long)]
    json: bool,
}

struct Out {
    json: bool,
    errors: usize,
    messages: usize,
}

impl Out {
    fn message(&mut self, d: &Description, source: &[(&str, Json)]) -> Result<()> {
        self.messages += 1;
        let mut stdout = std::io::stdout().lock();
        if self.json {
            let mut m = Map::new();
            m.insert("kind".into(), Json::String(d.kind.into()));
            for (k, v) in source {
                m.insert((*k).into(), v.clone());
            }
            for (k, v) in &d.fields {
                m.insert((*k).into(), to_json(v));
            }
            writeln!(stdout, "{}", Json::Object(m))?;
        } else {
            let src: Vec<String> = source
                .iter()
                .map(|(k, v)| {
                    format!(
                        "{k}={}",
                        v.as_str().map(str::to_string).unwrap_or(v.to_string())
                    )
                })
                .collect();
            if src.is_empty() {
                writeln!(stdout, "{}", d.kind)?;
            } else {
                writeln!(stdout, "{} ({})", d.kind, src.join(" "))?;
            }
            for (k, v) in &d.fields {
                writeln!(stdout, "  {k}: {}", v.to_text())?;
            }
        }
        Ok(())
    }

    fn error(&mut self, what: &str, e: &dyn std::fmt::Display) {
        self.errors += 1;
        eprintln!("smc decode: {what}: {e}");
    }
}

fn to_json(v: &Value) -> Json {
    match v {
        Value::U(n) => json!(n),
        Value::Bool(b) => json!(b),
        Value::Bytes(b) => Json::String(hex::encode(b)),
        Value::Text(t) => Json::String(t.clone()),
        Value::List(items) => Json::Array(
            items
                .iter()
                .map(|rec| {
                    Json::Object(
                        rec.iter()
                            .map(|(k, v)| ((*k).to_string(), to_json(v)))
                            .collect(),
                    )
                })
                .collect(),
        ),
    }
}

/// Decode a byte string that is one or more messages.
fn decode_bytes(out: &mut Out, what: &str, b: &[u8]) -> Result<()> {
    if b.is_empty() {
        // `smc decode ''`: no bytes are no message (an empty TCP options block is not one).
        out.error(what, &"empty: nothing to decode");
        return Ok(());
    }
    if b.starts_with(&EYECATCHER_SMCR) || b.starts_with(&EYECATCHER_SMCD) {
        let mut rest = b;
        while !rest.is_empty() {
            match ClcMessage::parse(rest) {
                Ok((m, used)) => {
                    out.message(&describe::clc(&m), &[])?;
                    rest = &rest[used..];
                }
                Err(e) => {
                    out.error(what, &e);
                    break;
                }
            }
        }
    } else if b.first().is_some_and(|&t| is_v2_type(t)) && b.len() >= MSG44_LEN {
        // LLC v2 messages (smc-rv2.md §10): in hex input the size of each is taken from its
        // little-endian length field when that fits (a capture gives the SEND's size instead).
        let mut rest = b;
        while !rest.is_empty() {
            let field = LlcV2Message::length_field(rest).map_or(0, usize::from);
            let len = if (MSG44_LEN..=rest.len()).contains(&field) {
                field
            } else {
                rest.len()
            };
            let (one, tail) = rest.split_at(len);
            match SendMessage::parse(one) {
                Ok(m) => out.message(&describe::send(&m), &[])?,
                Err(e) => {
                    out.error(what, &e);
                    break;
                }
            }
            rest = tail;
        }
    } else if !b.is_empty() && b.len().is_multiple_of(MSG44_LEN) {
        for chunk in b.chunks(MSG44_LEN) {
            match ControlMessage::parse(chunk) {
                Ok(m) => out.message(&describe::control(&m), &[])?,
                Err(e) => out.error(what, &e),
            }
        }
    } else {
        match tcp_option::find_in_options(b) {
            Ok(present) => out.message(
                &Description {
                    kind: "tcp.options",
                    fields: vec![("smc_option", Value::Bool(present))],
                },
                &[],
            )?,
            Err(_) => out.error(
                what,
                &format!(
                    "{} bytes: not a CLC message (no SMCR eye catcher), not an LLC/CDC message \
                     (44 bytes, or an LLC v2 message) and not a TCP options block",
                    b.len()
                ),
            ),
        }
    }
    Ok(())
}

fn decode_finding(out: &mut Out, f: &Finding) -> Result<()> {
    let mut src = vec![("frame", json!(f.frame))];
    match &f.origin {
        Origin::Tcp { src: s, dst: d } => {
            src.push(("src", Json::String(s.to_string())));
            src.push(("dst", Json::String(d.to_string())));
        }
        Origin::Roce { dest_qp, psn } => {
            src.push(("dest_qp", json!(dest_qp)));
            src.push(("psn", json!(psn)));
        }
    }
    let what = format!("frame {}", f.frame);
    match &f.found {
        Found::TcpOption { syn_ack } => out.message(
            &Description {
                kind: "tcp.smc_option",
                fields: vec![
                    ("syn_ack", Value::Bool(*syn_ack)),
                    ("exid", Value::Bytes(EYECATCHER_SMCR.to_vec())),
                ],
            },
            &src,
        )?,
        Found::Clc(b) => match ClcMessage::parse(b) {
            Ok((m, _)) => out.message(&describe::clc(&m), &src)?,
            Err(e) => out.error(&what, &e),
        },
        Found::Send(b) => match SendMessage::parse(b) {
            Ok(m) => out.message(&describe::send(&m), &src)?,
            Err(e) => out.error(&what, &e),
        },
        Found::ClcError(e) => out.error(&what, e),
        Found::IcrcMismatch { packet } => {
            let (qp, psn) = match f.origin {
                Origin::Roce { dest_qp, psn } => (dest_qp, psn),
                Origin::Tcp { .. } => (0, 0),
            };
            out.error(
                &what,
                &format!(
                    "RoCEv2 packet {packet} (dest_qp {qp}, psn {psn}): ICRC wrong for the \
                     headers it was captured with"
                ),
            )
        }
    }
    Ok(())
}

/// The first bytes of the capture formats `smc decode` reads: pcap in both byte orders, with
/// microsecond and nanosecond timestamps, and pcapng (its Section Header Block type).
const CAPTURE_MAGICS: [[u8; 4]; 5] = [
    [0xd4, 0xc3, 0xb2, 0xa1],
    [0xa1, 0xb2, 0xc3, 0xd4],
    [0x4d, 0x3c, 0xb2, 0xa1],
    [0xa1, 0xb2, 0x3c, 0x4d],
    [0x0a, 0x0d, 0x0d, 0x0a],
];

/// Decode every SMC message in a pcap or pcapng file.
fn decode_capture(out: &mut Out, path: &std::path::Path) -> Result<()> {
    let mut f = std::fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
    let mut magic = [0u8; 4];
    let is_capture = f.read_exact(&mut magic).is_ok() && CAPTURE_MAGICS.contains(&magic);
    if !is_capture {
        bail!(
            "{}: not a pcap or pcapng capture (its first bytes are not a capture magic number)",
            path.display()
        );
    }
    drop(f);
    let f = std::fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
    let (findings, roce) = dissect::read_capture_tally(f)
        .with_context(|| format!("reading the capture {}", path.display()))?;
    for f in &findings {
        decode_finding(out, f)?;
    }
    if roce.frames > 0 {
        // On standard error, so that --json output stays one message per line.
        let cut = if roce.segmented > 0 {
            format!(
                " ({} captured before UDP segmentation, cut into their packets, packet k \
                 checked with IPv4 identification id + k)",
                roce.segmented
            )
        } else {
            String::new()
        };
        eprintln!(
            "smc decode: RoCEv2: {} datagrams, {} packets{cut}; ICRC verified for {} of {}",
            roce.frames, roce.packets, roce.icrc_ok, roce.packets
        );
    }
    Ok(())
}

/// Whether a string that is not hex was probably meant as a file name.
fn looks_like_path(s: &str) -> bool {
    s.contains('/') || s.ends_with(".pcap") || s.ends_with(".pcapng")
}

/// Run `smc decode`.
pub fn run(args: &DecodeArgs) -> Result<ExitCode> {
    let mut out = Out {
        json: args.json,
        errors: 0,
        messages: 0,
    };
    if let Some(path) = &args.file {
        decode_capture(&mut out, path)?;
    } else if let Some(name) = &args.example {
        let list: Vec<(&str, &str)> = if name == "all" {
            examples::VECTORS
                .iter()
                .chain(examples::VARIANTS)
                .chain(examples::V2_VECTORS)
                .copied()
                .collect()
        } else {
            examples::VECTORS
                .iter()
                .chain(examples::VARIANTS)
                .chain(examples::V2_VECTORS)
                .filter(|(n, _)| n == name)
                .copied()
                .collect()
        };
        if list.is_empty() {
            let names: Vec<&str> = examples::VECTORS
                .iter()
                .chain(examples::VARIANTS)
                .chain(examples::V2_VECTORS)
                .map(|(n, _)| *n)
                .collect();
            bail!(
                "no example named {name:?}; known: all, {}",
                names.join(", ")
            );
        }
        for (n, h) in list {
            let b = examples::from_hex(h).context("bundled vector is valid hex")?;
            if !args.json {
                println!("# {n}");
            }
            decode_bytes(&mut out, n, &b)?;
        }
    } else {
        let inputs: Vec<String> = if args.hex.is_empty() || args.hex == ["-"] {
            let mut s = String::new();
            std::io::stdin().read_to_string(&mut s)?;
            s.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(str::to_string)
                .collect()
        } else {
            args.hex.clone()
        };
        let from_args = !(args.hex.is_empty() || args.hex == ["-"]);
        for (i, h) in inputs.iter().enumerate() {
            let what = format!("input {}", i + 1);
            // An argument that names an existing file is a capture, the same as `-r FILE`.
            if from_args && std::path::Path::new(h).is_file() {
                decode_capture(&mut out, std::path::Path::new(h))?;
                continue;
            }
            if h.trim().is_empty() {
                out.error(&what, &"empty input (give hex bytes or a capture file)");
                continue;
            }
            match examples::from_hex(h) {
                Some(b) => decode_bytes(&mut out, &what, &b)?,
                None if from_args && looks_like_path(h) => {
                    out.error(&what, &format!("{h}: no such file, and not hex either"))
                }
                None => out.error(&what, &"not valid hex"),
            }
        }
    }
    if out.errors > 0 {
        eprintln!(
            "smc decode: {} message(s) decoded, {} error(s)",
            out.messages, out.errors
        );
        return Ok(ExitCode::from(1));
    }
    if out.messages == 0 {
        eprintln!("smc decode: no SMC message found");
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}
