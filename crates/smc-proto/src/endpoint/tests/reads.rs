//! The one-pass read of the data path (`Endpoint::read_with`).

use super::*;
use crate::endpoint::ReadTarget;
use crate::lgr_harness::{FakeResources, Host};

/// The first `n` bytes of `t`, out of the RMB memory of `res`.
fn copy(res: &FakeResources, t: &ReadTarget, n: u32) -> Vec<u8> {
    let mut out = Vec::new();
    if let Some((_, mem)) = res.memory.get(&(t.lgr, t.rmb)) {
        for r in t.regions.iter() {
            let start = t.element_offset as usize + r.offset as usize;
            out.extend_from_slice(&mem[start..start + r.len as usize]);
        }
    }
    out.truncate(n as usize);
    out
}

/// One `read_with` of at most `max` bytes on `h`: what it copied, or `None` when `fail` made
/// the copy fail.
fn read(h: &mut Host, max: u32, fail: bool, now: crate::Timestamp) -> Option<Vec<u8>> {
    let Host { ep, res, .. } = h;
    let mut out = Vec::new();
    let r = ep
        .read_with(T1, max, now, |t, n| {
            if fail {
                return Err(());
            }
            out = copy(res, t, n);
            Ok(())
        })
        .expect("established");
    match r {
        Ok(n) => {
            assert_eq!(n as usize, out.len());
            Some(out)
        }
        Err(()) => None,
    }
}

/// A pair with connection T1 established, whose side B reads only when a test says so.
fn established_without_auto_read() -> EndpointPair {
    let mut p = EndpointPair::with_devices(2, 2);
    p.host_mut(Side::B).auto_read = false;
    p.connect(T1);
    p.run();
    assert!(established(&p, Side::B, T1));
    p
}

/// `read_with` hands out at most `max` bytes and consumes exactly those; a copy that fails
/// consumes nothing, so the next read starts where the failed one would have.
#[test]
fn read_with_consumes_what_was_copied_and_nothing_after_a_failed_copy() {
    let mut p = established_without_auto_read();
    p.app_send(Side::A, T1, b"hello world");
    p.run();

    let now = p.now;
    let h = p.host_mut(Side::B);
    assert_eq!(read(h, 4, false, now).as_deref(), Some(&b"hell"[..]));
    assert_eq!(read(h, 100, true, now), None);
    assert_eq!(read(h, 100, false, now).as_deref(), Some(&b"o world"[..]));
    // Nothing left: 0, not an error.
    assert_eq!(read(h, 100, false, now).as_deref(), Some(&b""[..]));
    // The writer saw its bytes consumed (the window is whole again once the update arrives).
    p.app_send(Side::A, T1, b"!");
    p.run();
    let now = p.now;
    assert_eq!(
        read(p.host_mut(Side::B), 100, false, now).as_deref(),
        Some(&b"!"[..])
    );
}

/// `next_read_at` names the RMB byte the next read starts at: the first unread byte once
/// data arrived, and it moves with every read.
#[test]
fn next_read_at_points_at_the_first_unread_byte() {
    let mut p = established_without_auto_read();
    let before = p
        .host_mut(Side::B)
        .ep
        .next_read_at(T1)
        .expect("established");
    p.app_send(Side::A, T1, b"hello world");
    p.run();
    let now = p.now;
    let h = p.host_mut(Side::B);
    assert_eq!(h.ep.next_read_at(T1), Some(before));
    let (lgr, rmb, at) = before;
    // The byte there is the first one sent.
    let mem = &h.res.memory.get(&(lgr, rmb)).expect("RMB").1;
    assert_eq!(mem[at as usize], b'h');
    assert_eq!(read(h, 4, false, now).as_deref(), Some(&b"hell"[..]));
    assert_eq!(h.ep.next_read_at(T1), Some((lgr, rmb, at + 4)));
    assert_eq!(mem_byte(h, lgr, rmb, at + 4), b'o');
    // A connection that does not exist has no such byte.
    assert_eq!(h.ep.next_read_at(TcpId(999)), None);
}

fn mem_byte(h: &Host, lgr: crate::fabric::LgrId, rmb: crate::rmb_pool::RmbId, at: u64) -> u8 {
    h.res.memory.get(&(lgr, rmb)).expect("RMB").1[at as usize]
}
