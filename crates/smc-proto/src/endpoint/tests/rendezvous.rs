//! CLC rendezvous: first contact (Fig. 8, Fig. 9), subsequent contact, Decline and fallback
//! (App. C.1–C.6, Fig. 42).

use super::*;

#[test]
fn fig8_fig9_first_contact_with_second_link() {
    let mut p = EndpointPair::with_devices(2, 2);
    p.connect(T1);
    p.run();
    dump(&p);
    assert_eq!(
        p.flow(true),
        vec![
            "A->B SMC Proposal",
            "B->A SMC Accept(first contact)",
            "A->B SMC Confirm",
            "B->A CONFIRM LINK link=1",
            "A->B CONFIRM LINK link=1 rsp",
            "B->A ADD LINK link=2",
            "A->B ADD LINK link=2 rsp",
            "B->A ADD LINK CONTINUATION link=2 pairs=1",
            "A->B ADD LINK CONTINUATION link=2 pairs=1 rsp",
            "B->A CONFIRM LINK link=2",
            "A->B CONFIRM LINK link=2 rsp",
        ]
    );
    assert!(established(&p, Side::A, T1));
    assert!(established(&p, Side::B, T1));
    for s in [Side::A, Side::B] {
        let g = p.host(s).ep.link_groups().next().expect("group");
        assert_eq!(g.active_count(), 2);
    }
}
