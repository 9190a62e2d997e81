//! A malicious peer over real TCP: a raw socket speaking (mis-formed) CLC, built on smc-wire,
//! against an `SmcListener` and against `SmcStream::connect`. Truncated, oversized, malformed
//! messages, bad eye catchers, reserved enumerations, out-of-order messages and Accepts that
//! name a device nobody has: each ends with the RFC's reaction (a Decline and fallback, or a
//! reset of the TCP connection, App. C.6), counted in the stack's statistics, within the
//! CLC timer; the stack keeps serving genuine peers afterwards. LLC and CDC forgeries are
//! tested at the engine level (smc-proto `endpoint::tests::malicious`, `conn::tests::forged`)
//! and by the `engine` fuzz target.
#![allow(missing_docs)]

mod reliability_common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::time::Duration;

use reliability_common::*;
use smc::{FallbackReason, Mode, SmcListener, SmcStream, Stack};
use smc_wire::examples;
use smc_wire::ClcMessage;

fn vector(name: &str) -> Vec<u8> {
    examples::bytes(name).expect("vector")
}

/// The attacks a client can make, each as the bytes it sends (then it half-closes or not).
fn client_attacks() -> Vec<(&'static str, Vec<u8>, bool)> {
    let p = vector("clc_proposal_v4");
    let mut v = Vec::new();
    v.push(("truncated proposal, then EOF", p[..20].to_vec(), true));
    v.push(("truncated proposal, then silence", p[..20].to_vec(), false));
    v.push(("eye catcher only, then silence", p[..4].to_vec(), false));
    let mut m = p.clone();
    m[5..7].copy_from_slice(&0xFFFFu16.to_be_bytes());
    v.push(("length 65535", m, false));
    let mut m = p.clone();
    m[5..7].copy_from_slice(&8u16.to_be_bytes());
    v.push(("length shorter than header and trailer", m, false));
    let mut m = p.clone();
    let n = m.len();
    m[n - 4..].copy_from_slice(b"XXXX");
    v.push(("trailer eye catcher overwritten", m, false));
    let mut m = p.clone();
    m[4] = 0x07;
    v.push(("reserved CLC type 7", m, false));
    let mut m = p.clone();
    m[7] &= 0x0F;
    v.push(("version 0", m, false));
    let mut m = p.clone();
    m[7] = (m[7] & 0xF0) | 0x0F;
    v.push(("reserved flag and SMC type bits", m, false));
    let mut m = p.clone();
    m[7] = 0x90 | (m[7] & 0x0F);
    v.push(("version 9", m, false));
    v.push((
        "Accept instead of Proposal",
        vector("clc_accept_first_contact"),
        false,
    ));
    v.push(("Confirm instead of Proposal", vector("clc_confirm"), false));
    v.push(("Decline first", vector("clc_decline"), false));
    let mut m = p.clone();
    m.extend_from_slice(&vector("clc_confirm"));
    v.push(("Proposal and an unsolicited Confirm", m, false));
    let mut m = smc_wire::EYECATCHER_SMCR.to_vec();
    m.extend((0..200u32).map(|i| (i.wrapping_mul(0x9E37) >> 3) as u8));
    v.push(("eye catcher then garbage", m, false));
    v
}

/// Whether the stream echoes a probe (the far end runs an echo over plain TCP).
fn probe_echo(s: &mut TcpStream) -> bool {
    let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
    if s.write_all(b"probe").is_err() {
        return false;
    }
    let mut back = [0u8; 5];
    s.read_exact(&mut back).is_ok() && &back == b"probe"
}

/// What the attacker saw: the CLC messages it received and how the connection ended.
fn outcome(mut s: TcpStream) -> (Vec<String>, &'static str) {
    // Longer than the CLC timer of the stacks under attack.
    s.set_read_timeout(Some(Duration::from_secs(6)))
        .expect("timeout");
    let mut got = Vec::new();
    let end = loop {
        let mut buf = [0u8; 4096];
        match s.read(&mut buf) {
            Ok(0) => break "EOF",
            Ok(n) => {
                got.extend_from_slice(&buf[..n]);
                // After a Decline the connection goes on as plain TCP (App. C.1): done.
                if ClcMessage::parse(&got)
                    .is_ok_and(|(m, _)| m.msg_type() == smc_wire::ClcType::DECLINE)
                {
                    break "Decline, TCP goes on";
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break "RST",
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                // Silence: either a fallback to TCP (the peer's Decline needs no answer,
                // App. C.1) or a hang. An echo of a probe tells them apart.
                break if probe_echo(&mut s) {
                    "silence, TCP goes on"
                } else {
                    "HANG"
                };
            }
            Err(_) => break "error",
        }
    };
    let mut msgs = Vec::new();
    let mut rest = &got[..];
    while !rest.is_empty() {
        match ClcMessage::parse(rest) {
            Ok((m, n)) => {
                msgs.push(m.msg_type().to_string());
                rest = &rest[n..];
            }
            Err(_) => {
                msgs.push(format!("{} non-CLC bytes", rest.len()));
                break;
            }
        }
    }
    (msgs, end)
}

fn server_stack(dir: &std::path::Path) -> Stack {
    let mut c = config(dir);
    // Attacks that stall resolve by the C.5 CLC timer; short here to keep the test quick.
    c.clc_timeout = Duration::from_secs(2);
    c.assert_peer_wait = Duration::from_millis(500);
    Stack::new(c).expect("stack")
}

#[test]
fn malformed_clc_from_a_client_never_hurts_the_listener() {
    let dir = test_dir("malicious-client");
    let st = server_stack(&dir);
    let l = SmcListener::bind_with(&st, "127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    // Accepted streams (a fallen-back attacker is handed out as a TCP stream) are echoed.
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            std::thread::spawn(move || echo(s));
        }
    });
    let attacks = client_attacks();
    for (name, bytes, eof) in &attacks {
        let mut s = TcpStream::connect(addr).expect("connect");
        s.write_all(bytes).expect("send attack");
        if *eof {
            s.shutdown(Shutdown::Write).expect("half close");
        }
        let (msgs, end) = outcome(s);
        println!("{name:45} -> received {msgs:?}, then {end}");
        assert_ne!(end, "HANG", "{name}: the listener never answered");
        // The only CLC message a listener may answer an attack with is a Decline (what
        // follows it is our own bytes, echoed over the TCP fallback).
        assert!(
            msgs.first().is_none_or(|m| m.contains("Decline")),
            "{name}: {msgs:?}"
        );
    }
    // Every attack is accounted for, once: a setup reset or a fallback (after a Decline).
    let n = attacks.len() as u64;
    let counted = wait_until(Duration::from_secs(10), || {
        let s = st.stats();
        s.setup_resets + s.fallbacks >= n
    });
    let stats = st.stats();
    println!("server stats after the attacks: {stats:?}");
    assert!(counted, "{stats:?}");
    assert_eq!(stats.setup_resets + stats.fallbacks, n, "{stats:?}");
    assert_eq!(
        stats.fallbacks,
        stats.fallback_declined + stats.fallback_no_smc_peer
    );
    assert_eq!(stats.smc, 0);
    // The listener still serves a genuine SMC-R client.
    let client = stack(&dir);
    let mut s = SmcStream::connect_with(&client, addr).expect("genuine connect");
    assert_eq!(s.mode(), Mode::Smc);
    let mut w = s.try_clone().expect("clone");
    w.write_all(b"still alive").expect("write");
    let mut back = [0u8; 11];
    s.read_exact(&mut back).expect("read");
    assert_eq!(&back, b"still alive");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The replies a malicious server can make to our Proposal.
fn server_attacks() -> Vec<(&'static str, Vec<u8>)> {
    let a = vector("clc_accept_first_contact");
    let mut v = Vec::new();
    v.push(("nothing (silence)", Vec::new()));
    v.push(("truncated Accept", a[..30].to_vec()));
    v.push((
        "Accept naming a GID no device has",
        vector("clc_accept_first_contact"),
    ));
    let mut m = a.clone();
    let n = m.len();
    m[n - 4..].copy_from_slice(b"XXXX");
    v.push(("Accept with its trailer overwritten", m));
    let mut m = a.clone();
    m[5..7].copy_from_slice(&0xFFFFu16.to_be_bytes());
    v.push(("Accept with length 65535", m));
    let mut m = a.clone();
    m[4] = 0x05;
    v.push(("reserved CLC type 5", m));
    v.push(("Confirm instead of Accept", vector("clc_confirm")));
    v.push(("Proposal instead of Accept", vector("clc_proposal_v4")));
    let mut m = vector("clc_decline");
    m[16..20].copy_from_slice(&0x7777_0000u32.to_be_bytes());
    v.push(("Decline with an unknown reason code", m));
    v.push(("plain bytes", b"HTTP/1.1 400 Bad Request\r\n\r\n".to_vec()));
    v
}

/// Read one CLC message (the Proposal) from `s`.
fn read_clc(s: &mut TcpStream) -> Option<Vec<u8>> {
    let mut hdr = [0u8; 8];
    s.read_exact(&mut hdr).ok()?;
    let len = usize::from(u16::from_be_bytes([hdr[5], hdr[6]]));
    let mut rest = vec![0u8; len.checked_sub(8)?];
    s.read_exact(&mut rest).ok()?;
    let mut m = hdr.to_vec();
    m.extend(rest);
    Some(m)
}

#[test]
fn forged_replies_from_a_server_end_the_connect_cleanly() {
    let dir = test_dir("malicious-server");
    let st = server_stack(&dir);
    let attacks = server_attacks();
    for (name, reply) in &attacks {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        let reply = reply.clone();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().expect("accept");
            let proposal = read_clc(&mut s).expect("our Proposal");
            let parsed = ClcMessage::parse(&proposal).map(|(m, _)| m.msg_type());
            let _ = s.write_all(&reply);
            // Then read whatever comes (a Decline, data after a fallback) until the end.
            let (msgs, end) = outcome(s);
            (parsed, msgs, end)
        });
        let r = SmcStream::connect_with(&st, addr);
        let what = match &r {
            Ok(s) => format!("connected, mode {:?}", s.mode()),
            Err(e) => format!("error {:?}: {e}", e.kind()),
        };
        match r {
            // A fallback is allowed only with a reason that names the peer's fault.
            Ok(s) => {
                assert!(
                    matches!(
                        s.mode(),
                        Mode::Tcp(
                            FallbackReason::Declined(_) | FallbackReason::PeerDeclined { .. }
                        )
                    ),
                    "{name}: {what}"
                );
                drop(s);
            }
            Err(e) => assert_ne!(e.kind(), std::io::ErrorKind::WouldBlock, "{name}"),
        }
        let (parsed, msgs, end) = server.join().expect("server");
        println!("{name:40} -> client {what}; server saw {msgs:?} then {end}");
        assert_eq!(parsed.ok(), Some(smc_wire::ClcType::PROPOSAL), "{name}");
        assert_ne!(end, "HANG", "{name}");
    }
    let stats = st.stats();
    println!("client stats after the attacks: {stats:?}");
    assert_eq!(stats.smc, 0);
    assert_eq!(
        stats.setup_resets + stats.fallbacks,
        attacks.len() as u64,
        "{stats:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Both peers decline at once (RFC 7609 App. C.2 allows it during a first contact's LLC
/// negotiation; each falls back as soon as its Decline is out, App. C.1): the peer's Decline
/// arrives in front of its application bytes and must not reach the application as data —
/// in one piece, in pieces, or not at all (then the data is untouched). Found by the soak:
/// a fallen-back long stream read the peer's 28-byte Decline as its first data.
#[test]
fn a_decline_crossing_ours_is_not_data() {
    let dir = test_dir("crossing-decline");
    let st = server_stack(&dir);
    // (what the fake server sends after our Decline, in pieces)
    let decline = vector("clc_decline");
    let cases: Vec<(&str, Vec<Vec<u8>>)> = vec![
        (
            "crossed Decline then data",
            vec![[&decline[..], b"hello"].concat()],
        ),
        (
            "crossed Decline in three pieces, then data",
            vec![
                decline[..3].to_vec(),
                decline[3..10].to_vec(),
                [&decline[10..], b"hello"].concat(),
            ],
        ),
        ("no crossing: data only", vec![b"hello".to_vec()]),
        (
            "data that starts like an eye catcher",
            vec![[&decline[..2], b"hel"].concat()],
        ),
    ];
    for (name, pieces) in cases {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        let send = pieces.clone();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().expect("accept");
            read_clc(&mut s).expect("our Proposal");
            // A first-contact Accept for a port the client cannot reach (not in its fabric
            // directory): it declines in place of its Confirm (before, it confirmed and
            // declined when its LLC negotiation failed, C.2).
            s.write_all(&vector("clc_accept_first_contact"))
                .expect("accept");
            let mut seen = Vec::new();
            let ours = loop {
                let m = read_clc(&mut s).expect("the client's Decline");
                let t = ClcMessage::parse(&m).map(|(m, _)| m.msg_type()).ok();
                seen.push(t);
                if t == Some(smc_wire::ClcType::DECLINE) || seen.len() > 3 {
                    break m;
                }
            };
            // As if sent just before the client's Decline arrived: it crosses it.
            for p in send {
                s.write_all(&p).expect("write");
                std::thread::sleep(Duration::from_millis(30));
            }
            s.shutdown(Shutdown::Write).expect("shutdown");
            ClcMessage::parse(&ours).map(|(m, _)| m.msg_type()).ok()
        });
        let mut c = SmcStream::connect_with(&st, addr).expect("connect");
        assert!(
            matches!(c.mode(), Mode::Tcp(FallbackReason::Declined(_))),
            "{name}: {:?}",
            c.mode()
        );
        c.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let mut got = Vec::new();
        c.read_to_end(&mut got).expect("read");
        let want: Vec<u8> = if name == "data that starts like an eye catcher" {
            pieces.concat()
        } else {
            b"hello".to_vec()
        };
        assert_eq!(got, want, "{name}");
        assert_eq!(
            server.join().expect("server"),
            Some(smc_wire::ClcType::DECLINE),
            "{name}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
