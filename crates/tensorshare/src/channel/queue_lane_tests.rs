//! The lane's consumer against producers that die or lie (in one process: what matters is
//! what the ring and the directory hold, whoever wrote it).

use std::sync::Arc;
use std::time::Duration;

use crate::channel::lane::{Claim, CELL_BYTES};
use crate::channel::queue_core::Core;
use crate::channel::socket::Deadline;
use crate::{Error, Tensor};

fn soon() -> Deadline {
    Deadline::after(Some(Duration::from_secs(10)))
}

fn core() -> Arc<Core> {
    Core::create(None).unwrap()
}

/// A producer that died between claiming a position and publishing it holds up no
/// consumer for good: the position is skipped, and the values behind it come.
#[test]
fn a_position_claimed_and_never_published_is_skipped() {
    let core = core();
    let ring = core.control.lane();
    let Claim::At(dead) = ring.claim() else { panic!("an empty ring is not full") };
    core.put(7u32, Deadline::after(None)).map_err(|e| e.into_parts().1).unwrap();
    assert_eq!(ring.tail(), dead + 2, "the value went through the lane, behind the dead claim");
    assert_eq!(core.get::<u32>(soon()).unwrap(), 7);
    assert!(!ring.publish(dead), "the dead claim was skipped: a late publish must fail");
    let _another_handle = core.clone();
    assert!(core.try_get::<u32>().unwrap().is_none(), "nothing came twice");
}

/// A position claimed and never published is no value that waits: `has_ready` (Python's
/// `empty()`) does not promise one that never comes, and still sees one published behind it.
#[test]
fn a_position_claimed_and_never_published_is_no_value_ready() {
    let core = core();
    let ring = core.control.lane();
    let Claim::At(_dead) = ring.claim() else { panic!("an empty ring is not full") };
    let _another_handle = core.clone();
    assert_eq!(core.has_ready(), Some(false), "a claim alone is no value");
    core.put(7u32, Deadline::after(None)).map_err(|e| e.into_parts().1).unwrap();
    assert_eq!(core.has_ready(), Some(true), "the value behind the dead claim");
    assert_eq!(core.get::<u32>(soon()).unwrap(), 7);
    assert_eq!(core.has_ready(), Some(false));
}

/// A lane message may name only arenas its queue's directory holds: one naming an arena
/// of the consumer's own that was never sent through the queue is refused (the consumer
/// has it mapped, so a lookup by identity alone would find it), as are garbage and a
/// length past the cell; the queue works on after each.
#[test]
fn lane_messages_a_peer_forged_are_refused_and_the_queue_goes_on() {
    let core = core();
    let ring = core.control.lane();
    let mine = Tensor::full(&[16], 3.0f32);
    let mut shared = mine.clone();
    shared.share_memory().unwrap();
    // The lane form of a message naming it, written into the ring without parking its hold.
    let forged = crate::wire::encode_for_lane(&shared, CELL_BYTES).unwrap().lane.unwrap().bytes;
    let garbage = vec![0xA5u8; 100];
    for bytes in [&forged, &garbage] {
        let Claim::At(p) = ring.claim() else { panic!("room") };
        ring.write(p, bytes);
        assert!(ring.publish(p));
        let err = core.get::<Tensor>(soon()).unwrap_err();
        assert!(matches!(err, Error::InvalidMessage(_)), "{err}");
    }
    let Claim::At(p) = ring.claim() else { panic!("room") };
    ring.write(p, b"x");
    ring.set_len_for_test(p, u32::MAX);
    assert!(ring.publish(p));
    let err = core.get::<Tensor>(soon()).unwrap_err();
    assert!(err.to_string().contains("more than a cell"), "{err}");
    // Sent for real, the same tensor comes back as the same storage.
    core.put(shared.clone(), Deadline::after(None)).map_err(|e| e.into_parts().1).unwrap();
    let back: Tensor = core.get(soon()).unwrap();
    assert!(back.storage().ptr_eq(shared.storage()));
    assert_eq!(back.to_vec::<f32>().unwrap(), vec![3.0; 16]);
}

/// A record a peer wrote into the socket without counting it (or with the count lowered
/// after) reaches a consumer that waits: receivers skip the socket only while they poll
/// awake, and look at it after every sleep whatever the count says.
#[test]
fn a_record_written_without_being_counted_still_comes() {
    use std::os::fd::AsFd;
    let core = core();
    // Another handle: a get that finds itself alone looks at the socket for sure anyway.
    let _another_handle = core.clone();
    let out = crate::channel::frame::Outgoing::new(crate::wire::encode(&11u32).unwrap()).unwrap();
    crate::channel::socket::send_record(core.tx.as_fd(), out.parts(), &out.fds()).unwrap();
    assert!(!core.control.may_have_records(), "nothing counted it");
    assert_eq!(core.get::<u32>(soon()).unwrap(), 11);
    // Counted, then the count lowered by a peer before it is taken.
    core.control.record_coming();
    crate::channel::socket::send_record(core.tx.as_fd(), out.parts(), &out.fds()).unwrap();
    core.control.record_gone();
    assert_eq!(core.get::<u32>(soon()).unwrap(), 11);
}
