//! Tests of the allocator (see `allocator`).

use super::*;
use crate::arena::locks::{lock_range, runs};
use crate::shm::Segment;
use std::os::fd::AsFd;

#[test]
fn allocating_now_gives_way_to_a_busy_allocator() {
    let fd = SharingStrategy::FileDescriptor;
    let busy = lock(allocator(fd));
    let got = std::thread::scope(|s| s.spawn(|| allocate_now(64, fd).map(|s| s.is_some())).join().unwrap());
    assert!(!got.unwrap(), "a slot was taken while another thread held the allocator");
    drop(busy);
    // Other tests in this process use the same allocator and may hold it for a moment:
    // a free allocator gives a slot, so one comes once none of them holds it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let slot = loop {
        if let Some(slot) = allocate_now(64, fd).unwrap() {
            break slot;
        }
        assert!(std::time::Instant::now() < deadline, "no slot from the allocator in 20 s");
        std::thread::yield_now();
    };
    assert!(slot.arena.slot_size >= 64);
}

#[test]
fn freed_slots_are_reused() {
    let a = allocate(1000, SharingStrategy::FileDescriptor).unwrap();
    let (arena, slot) = (a.arena.clone(), a.slot);
    assert_eq!(a.capacity(), 1024);
    drop(a);
    // The freed slot comes back once the search wraps around to it.
    let mut got = Vec::new();
    let mut found = false;
    for _ in 0..=arena.nslots() {
        let b = allocate(1000, SharingStrategy::FileDescriptor).unwrap();
        if Arc::ptr_eq(&b.arena, &arena) && b.slot == slot {
            found = true;
            break;
        }
        got.push(b);
    }
    assert!(found, "a freed slot was never handed out again");
}

#[test]
fn a_slot_locked_by_another_description_is_not_reused() {
    let len = (29 << 20) + 5; // a size no other test asks for: its own one-slot arena
    let a = allocate(len, SharingStrategy::FileDescriptor).unwrap();
    let arena = a.arena.clone();
    // A message takes the slot to another holder, which locks it on a description of
    // its own and lets the message go.
    let message = arena.send_hold(&[0]).unwrap().0;
    let other = arena.seg.reopen().unwrap();
    lock_range(other.as_fd(), 0, 1, libc::F_RDLCK).unwrap();
    drop(message);
    drop(a);
    let b = allocate(len, SharingStrategy::FileDescriptor).unwrap();
    assert!(!Arc::ptr_eq(&b.arena, &arena), "a slot another description holds was handed out");
    // The holder is gone, its lock with it; `b` is still in use, so the only free
    // arena of this size is the first one.
    drop(other);
    let c = allocate(len, SharingStrategy::FileDescriptor).unwrap();
    assert!(Arc::ptr_eq(&c.arena, &arena), "the slot is free again once its holder is gone");
    drop(b);
}

#[test]
fn a_sent_slot_stays_held_by_the_send_description_until_it_is_retired() {
    let len = (31 << 20) + 7;
    let a = allocate(len, SharingStrategy::FileDescriptor).unwrap();
    let arena = a.arena.clone();
    let message = arena.send_hold(&[0]).unwrap().0; // a message in flight carries this
    drop(a);
    let b = allocate(len, SharingStrategy::FileDescriptor).unwrap();
    assert!(!Arc::ptr_eq(&b.arena, &arena), "a slot a message in flight holds was handed out");
    // Consumed: only the sender's retired description was left; `b` is still in use, so
    // the only free arena of this size is the first one.
    drop(message);
    let c = allocate(len, SharingStrategy::FileDescriptor).unwrap();
    assert!(Arc::ptr_eq(&c.arena, &arena), "the slot comes back once the message is gone");
    drop(b);
}

#[test]
fn runs_merge_adjacent_slots() {
    let mut v = vec![7, 3, 4, 5, 9, 3, 10];
    assert_eq!(runs(&mut v), vec![(3, 3), (7, 1), (9, 2)]);
    assert!(runs(&mut Vec::new()).is_empty());
}

#[test]
fn open_rejects_a_segment_that_is_not_an_arena() {
    let seg = Segment::create(8192, SharingStrategy::FileDescriptor).unwrap();
    let err = Arena::open(seg).unwrap_err();
    assert!(matches!(err, Error::InvalidMessage(_)), "{err}");
}

#[test]
fn open_rejects_a_header_larger_than_its_segment() {
    let arena = Arena::create(4096, 4, SharingStrategy::FileDescriptor).unwrap();
    // SAFETY: test-only write of the slot count in our own fresh arena, which no other
    // handle reads.
    unsafe { arena.seg.as_mut_ptr().add(16).cast::<u32>().write(1 << 20) };
    let err = Arena::open(arena.seg).unwrap_err();
    assert!(err.to_string().contains("does not fit"), "{err}");
}

#[test]
fn arenas_in_a_bounded_room_stay_small_and_keep_few_free_ones() {
    let fd = SharingStrategy::FileDescriptor; // memfds, with a room given: the rule, not the filesystem
    let room = 16 << 20;
    let mut alloc = Allocator::new(Some(room));
    let slots: Vec<Slot> = (0..40).map(|_| allocate_locked(&mut alloc, 256 << 10, fd).unwrap()).collect();
    // A 64th of the room per pooled arena: one 256 KiB slot each, where growing arenas
    // would have reached 8 MiB.
    assert!(slots.iter().all(|s| s.arena.nslots() == 1), "pooled arenas larger than a 64th of the room");
    drop(slots);
    assert_eq!(alloc.arenas().count(), 40, "free arenas are kept until the next one is made");
    let one = allocate_locked(&mut alloc, 1 << 20, fd).unwrap();
    let free: usize =
        alloc.arenas().filter(|a| matches!(a.use_of_slots(), SlotUse::Free)).map(|a| a.seg.len()).sum();
    assert!(free <= room / ROOM_FREE, "{free} bytes of free arenas kept, more than a 16th of the room");
    assert!(free > 0, "some free arenas are kept for reuse");
    drop(one);

    // Unbounded (memfds): arenas grow, and free ones stay.
    let mut alloc = Allocator::new(None);
    let slots: Vec<Slot> = (0..40).map(|_| allocate_locked(&mut alloc, 256 << 10, fd).unwrap()).collect();
    assert!(slots.iter().any(|s| s.arena.nslots() > 1));
    let n = alloc.arenas().count();
    drop(slots);
    let _one = allocate_locked(&mut alloc, 1 << 20, fd).unwrap();
    assert_eq!(alloc.arenas().count(), n + 1);
}

#[test]
fn in_a_bounded_room_an_arena_partly_held_elsewhere_is_kept_and_a_sent_one_slot_arena_goes() {
    let fd = SharingStrategy::FileDescriptor;
    let room = 16 << 20;
    let mut alloc = Allocator::new(Some(room));
    // A pooled arena of 4 KiB slots, one of them in a message in flight.
    let small: Vec<Slot> = (0..8).map(|_| allocate_locked(&mut alloc, 4096, fd).unwrap()).collect();
    let pooled = small[0].arena.clone();
    assert!(pooled.nslots() > 1);
    let message = pooled.send_hold(&[small[0].slot]).unwrap().0;
    // A one-slot arena (a 256 KiB class at a 64th of the room), sent the same way.
    let one = allocate_locked(&mut alloc, 256 << 10, fd).unwrap();
    let single = one.arena.clone();
    assert_eq!(single.nslots(), 1);
    let single_message = single.send_hold(&[0]).unwrap().0;
    drop((small, one));
    // Past an eighth of the room: the next arena made applies the bounds.
    let _big = allocate_locked(&mut alloc, 3 << 20, fd).unwrap();
    let kept = |a: &Arc<Arena>| alloc.arenas().any(|b| Arc::ptr_eq(a, b));
    assert!(kept(&pooled), "an arena with a slot held elsewhere was let go, its free slots with it");
    assert!(!kept(&single), "a sent one-slot arena was kept, holding room this process cannot tell free");
    drop((message, single_message));
}
