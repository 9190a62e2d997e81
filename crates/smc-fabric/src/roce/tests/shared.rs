//! WRITEs of shared bytes (`SendWr::WriteShared`, txpkt.rs): their packets keep slices of the
//! caller's buffer, so what a retransmission sends must be the bytes posted, whatever the
//! caller does with its own handle and its buffer's free space afterwards; and the packets
//! let go of the buffer when acknowledged or when the QP fails.

use super::*;
use bytes::{Bytes, BytesMut};

/// Loss, reordering and duplication on both sides, WRITEs of shared bytes cut from one
/// arena (as an SMC-R connection cuts its updates): after each post the caller drops its
/// handle and fills the arena's next bytes with other bytes (the memory next to the posted
/// slice; with no reference left the arena would reuse the posted memory itself). Every
/// WRITE's bytes arrive exactly, each SEND once and in order, after retransmissions; once
/// all is acknowledged, the QP holds no slice of the arena.
#[test]
fn shared_writes_survive_loss_and_retransmission() {
    let (a, b) = pair(24, lossy_both_ways(), 64);
    let mut arena = BytesMut::with_capacity(1 << 20);
    let mut expect = vec![0u8; 1 << 20];
    let mut kept: Vec<Bytes> = Vec::new();
    let rounds = 8u64;
    for round in 0..rounds {
        let data = pattern(60_000 + round as usize * 1111, round as u8);
        arena.extend_from_slice(&data);
        let shared = arena.split().freeze();
        let off = round * 110_000;
        a.qp.post_send(&SendWr::WriteShared {
            wr_id: 100 + round,
            data: &shared,
            remote_addr: b.rmb.vaddr() + off,
            rkey: b.rmb.key,
            signaled: true,
        })
        .expect("write");
        expect[off as usize..off as usize + data.len()].copy_from_slice(&data);
        // A handle on the buffer, whose uniqueness is checked at the end.
        kept.push(shared.slice(..1));
        drop(shared);
        arena.extend_from_slice(&[0xEE; 4096]);
        drop(arena.split());
        a.qp.post_send(&SendWr::Send {
            wr_id: round,
            data: &round.to_be_bytes(),
            signaled: true,
        })
        .expect("send");
    }
    let got = collect(&b.cq, rounds as usize);
    assert_eq!(got.len(), rounds as usize, "all SENDs delivered");
    for (i, w) in got.iter().enumerate() {
        assert_eq!(w.status, WcStatus::Success);
        let mut m = [0u8; 8];
        b.rx.read_at(w.wr_id as usize * 64, &mut m).expect("read");
        assert_eq!(u64::from_be_bytes(m), i as u64, "in order");
    }
    let mut back = vec![0u8; 1 << 20];
    b.rmb.read_at(0, &mut back).expect("read");
    assert!(back == expect, "WRITE bytes differ");
    let done = collect(&a.cq, 2 * rounds as usize);
    assert_eq!(done.len(), 2 * rounds as usize);
    assert!(done.iter().all(|w| w.status == WcStatus::Success));
    let ca = snapshot(&a.dev.core);
    assert!(ca.fault_drops > 0 && ca.retransmits > 0, "{ca:?}");
    let end_t = Instant::now() + Duration::from_secs(10);
    while a.qp.has_unacked() && Instant::now() < end_t {
        std::thread::sleep(Duration::from_millis(2));
    }
    // All rounds were cut from one allocation (the arena's capacity suffices): the last
    // handle to it is unique only when no packet holds a slice any more.
    let watch = kept.pop().expect("a round");
    drop(kept);
    drop(arena);
    assert!(
        watch.is_unique(),
        "an acknowledged packet still holds the buffer"
    );
}

/// A QP that fails with WRITEs of shared bytes unacknowledged drops their packets, and with
/// them its references to the buffer (the caller's replay store still has the bytes).
#[test]
fn a_failed_qp_lets_go_of_shared_bytes() {
    // Every packet a sends is dropped: nothing is ever acknowledged.
    let (a, b) = pair(25, vec![("ra".to_string(), Fault::Drop(100.0))], 4);
    let data = Bytes::from(pattern(10_000, 3));
    a.qp.post_send(&SendWr::WriteShared {
        wr_id: 1,
        data: &data,
        remote_addr: b.rmb.vaddr(),
        rkey: b.rmb.key,
        signaled: true,
    })
    .expect("write");
    assert!(a.qp.has_unacked());
    assert!(!data.is_unique(), "the packets hold the buffer");
    a.qp.enter_error(None, "test");
    let done = collect(&a.cq, 1);
    assert_eq!((done[0].wr_id, done[0].status), (1, WcStatus::WrFlushError));
    assert!(data.is_unique(), "the failed QP let go of the buffer");
}

/// Packed WRITEs (`RoceQp::post_write_packed`, sealed at post) under loss, reordering and
/// duplication on both sides, where every packet leaves alone (faults act per packet) and so
/// is sealed for identification 0 at post: every WRITE's bytes arrive exactly, each SEND once
/// and in order; the buffers returned hold the bytes posted.
#[test]
fn packed_writes_survive_loss_and_retransmission() {
    let (a, b) = pair(28, lossy_both_ways(), 64);
    writes_then_sends_with(
        &a,
        &b,
        8,
        |round| 60_000 + round as usize * 1111,
        110_000,
        |a, b, wr, data, off| {
            let packed =
                a.qp.post_write_packed(wr, data, b.rmb.vaddr() + off, b.rmb.key)
                    .expect("write")
                    .expect("ready");
            assert_eq!(packed.pieces().collect::<Vec<_>>().concat(), data);
        },
    );
    // The SENDs' completions (the packed WRITEs are unsignaled).
    let done = collect(&a.cq, 8);
    assert_eq!(done.len(), 8);
    assert!(done.iter().all(|w| w.status == WcStatus::Success));
    let ca = snapshot(&a.dev.core);
    assert!(ca.fault_drops > 0 && ca.retransmits > 0, "{ca:?}");
}

/// Drops, reordering and duplication on both devices (`ra`, `rb`).
fn lossy_both_ways() -> Vec<(String, Fault)> {
    ["ra", "rb"]
        .iter()
        .flat_map(|d| {
            [Fault::Drop(3.0), Fault::Reorder(2.0), Fault::Duplicate(2.0)]
                .into_iter()
                .map(move |f| (d.to_string(), f))
        })
        .collect()
}
