//! The ring alone: its states, and what peers writing it can and cannot cause.

use super::*;
use crate::SharingStrategy;

fn ring_segment() -> Segment {
    Segment::create(RING_AT + RING_LEN, SharingStrategy::FileDescriptor).unwrap()
}

#[test]
fn messages_come_out_in_order_and_the_ring_fills_at_its_size() {
    let seg = ring_segment();
    // SAFETY: the segment is as large as a control block and page-aligned.
    let ring = unsafe { Ring::new(&seg) };
    ring.init();
    for i in 0..CELLS {
        let Claim::At(p) = ring.claim() else { panic!("full at {i}") };
        ring.write(p, &i.to_le_bytes());
        assert!(ring.publish(p));
    }
    assert!(matches!(ring.claim(), Claim::Full));
    for i in 0..CELLS {
        let Look::Took { pos, bytes } = ring.take() else { panic!("nothing at {i}") };
        assert_eq!(bytes.unwrap(), i.to_le_bytes());
        ring.done(pos);
    }
    assert!(matches!(ring.take(), Look::Empty));
    assert_eq!(ring.first_open_window(), 1);
    assert!(matches!(ring.claim(), Claim::At(p) if p == CELLS));
}

#[test]
fn a_claimed_position_waits_and_a_skipped_one_is_passed_over() {
    let seg = ring_segment();
    // SAFETY: as above.
    let ring = unsafe { Ring::new(&seg) };
    ring.init();
    let Claim::At(a) = ring.claim() else { panic!() };
    let Claim::At(b) = ring.claim() else { panic!() };
    ring.write(b, b"second");
    assert!(ring.publish(b));
    let Look::Waiting { pos, seq } = ring.take() else { panic!("the first is claimed") };
    assert_eq!((pos, seq), (a, a));
    ring.skip(pos, seq);
    // The producer of `a` comes back too late: its message must go another way, and
    // its cell is free for the next lap.
    assert!(!ring.publish(a));
    assert_eq!(ring.cell(a).seq.load(Ordering::Relaxed), a + CELLS);
    let Look::Took { pos, bytes } = ring.take() else { panic!() };
    assert_eq!((pos, bytes.unwrap()), (b, b"second".to_vec()));
    ring.done(pos);
    assert_eq!(ring.first_open_window(), 0, "the window is not over");
    assert!(ring.close_window());
    assert!(ring.is_empty());
    assert!(matches!(ring.take(), Look::Empty));
    assert_eq!(ring.first_open_window(), 1, "closed and passed");
    assert!(matches!(ring.claim(), Claim::At(p) if p == CELLS));
}

#[test]
fn a_length_a_peer_wrote_past_the_cell_is_refused() {
    let seg = ring_segment();
    // SAFETY: as above.
    let ring = unsafe { Ring::new(&seg) };
    ring.init();
    let Claim::At(p) = ring.claim() else { panic!() };
    ring.write(p, b"x");
    ring.set_len_for_test(p, u32::MAX);
    assert!(ring.publish(p));
    assert!(matches!(ring.take(), Look::Took { bytes: Err(n), .. } if n == u32::MAX as usize));
}

fn drain(ring: &Ring<'_>) -> Vec<Vec<u8>> {
    let mut got = Vec::new();
    for _ in 0..4 * CELLS {
        match ring.take() {
            Look::Took { pos, bytes } => {
                got.push(bytes.unwrap());
                ring.done(pos);
            }
            Look::Waiting { pos, seq } => ring.skip(pos, seq),
            Look::Empty => break,
        }
    }
    got
}

/// A position given up while consumers wait at it, whose cell is claimed and published
/// for the next lap before they look again, is passed; the next lap's message is not
/// taken for a claim to skip (which would lose it).
#[test]
fn a_position_given_up_is_passed_and_the_next_laps_message_kept() {
    let seg = ring_segment();
    // SAFETY: as above.
    let ring = unsafe { Ring::new(&seg) };
    ring.init();
    let Claim::At(p) = ring.claim() else { panic!() };
    for i in 1..CELLS {
        let Claim::At(q) = ring.claim() else { panic!("full at {i}") };
        ring.write(q, &q.to_le_bytes());
        assert!(ring.publish(q));
    }
    assert!(matches!(ring.take(), Look::Waiting { pos: 0, seq: 0 }));
    ring.abandon(p);
    let Claim::At(q) = ring.claim() else { panic!("cell 0 is free for lap 1") };
    assert_eq!(q, CELLS);
    ring.write(q, b"next lap");
    assert!(ring.publish(q));
    let got = drain(&ring);
    assert_eq!(got.len() as u64, CELLS, "every published message, once");
    assert_eq!(got.last().unwrap(), b"next lap");
}

/// A producer skipped while it still writes its cell keeps the cell: the ring is full
/// there until it finishes, finds its publish refused and frees it, so the next lap's
/// message is never overwritten by the late writer.
#[test]
fn a_skipped_producer_still_writing_keeps_its_cell_until_it_gives_it_up() {
    let seg = ring_segment();
    // SAFETY: as above.
    let ring = unsafe { Ring::new(&seg) };
    ring.init();
    let Claim::At(p) = ring.claim() else { panic!() };
    let Look::Waiting { pos, seq } = ring.take() else { panic!() };
    ring.skip(pos, seq);
    for _ in 1..CELLS {
        let Claim::At(q) = ring.claim() else { panic!() };
        ring.write(q, b"x");
        assert!(ring.publish(q));
    }
    assert_eq!(drain(&ring).len() as u64, CELLS - 1);
    assert_eq!(ring.first_open_window(), 1, "the skipped position is done with");
    assert!(matches!(ring.claim(), Claim::Full), "the skipped cell is still its claimant's");
    ring.write(p, b"late");
    assert!(!ring.publish(p), "refused: the message goes another way");
    let Claim::At(q) = ring.claim() else { panic!("freed by its claimant") };
    assert_eq!(q, p + CELLS);
    ring.write(q, b"Q");
    assert!(ring.publish(q));
    assert_eq!(drain(&ring), vec![b"Q".to_vec()]);
}

/// Positions a peer wrote near the end of u64 make nobody panic.
#[test]
fn a_peers_positions_near_the_end_of_u64_are_no_panic() {
    let seg = ring_segment();
    // SAFETY: as above.
    let ring = unsafe { Ring::new(&seg) };
    ring.init();
    let t = u64::MAX - 5;
    ring.ends().tail.store(t, Ordering::SeqCst);
    ring.ends().head.store(t, Ordering::SeqCst);
    assert!(!ring.close_window());
    let _ = ring.first_open_window();
    assert!(matches!(ring.take(), Look::Empty | Look::Waiting { .. }));
}

/// How many messages wait: claimed positions not yet taken whose message is published or
/// being written. A position given up (its message went through the socket) or skipped is
/// not one; positions wrap (a tail one behind the head is none); whatever a peer writes into
/// `tail` and `head`, the count stays within a lap.
#[test]
fn waiting_counts_messages_not_positions_given_up_and_stays_within_a_lap() {
    let seg = ring_segment();
    // SAFETY: as above.
    let ring = unsafe { Ring::new(&seg) };
    ring.init();
    assert_eq!(ring.waiting(), 0);
    for i in 0..3u64 {
        let Claim::At(p) = ring.claim() else { panic!("full at {i}") };
        ring.write(p, &i.to_le_bytes());
        assert!(ring.publish(p));
    }
    assert_eq!(ring.waiting(), 3);
    let Look::Took { pos, .. } = ring.take() else { panic!("nothing") };
    ring.done(pos);
    assert_eq!(ring.waiting(), 2);
    // One being written counts; one given up does not, nor one skipped as stuck.
    let Claim::At(writing) = ring.claim() else { panic!() };
    assert_eq!(ring.waiting(), 3);
    let Claim::At(given_up) = ring.claim() else { panic!() };
    ring.abandon(given_up);
    assert_eq!(ring.waiting(), 3);
    ring.skip(writing, writing);
    assert_eq!(ring.waiting(), 2);
    let ends = ring.ends();
    for (tail, head) in [(5, 9), (u64::MAX, 0), (1 << 40, 3), (0, u64::MAX), (u64::MAX, 1 << 63)] {
        ends.tail.store(tail, Ordering::SeqCst);
        ends.head.store(head, Ordering::SeqCst);
        let n = ring.waiting();
        assert!(n <= CELLS as usize, "tail {tail}, head {head}: {n}");
        if tail.wrapping_sub(head) as i64 <= 0 {
            assert_eq!(n, 0, "tail {tail} not past head {head}");
        }
    }
}
