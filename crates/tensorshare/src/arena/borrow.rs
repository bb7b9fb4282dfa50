//! Borrowed holds: a received slot held through the message's own description for a while.
//!
//! A message holds its slots through the description it carries (its sender's send
//! description, on which they are locked, and which its sender never unlocks). A receiver
//! that keeps that description open keeps those holds, so it need not take locks of its own
//! at once. It *borrows* the holds, and:
//! - if it sends the slots on before anything else happens (a relay, a pipeline stage, the
//!   echo of a ping-pong), the message it sends carries the same description: no lock is
//!   taken anywhere on the way;
//! - if it drops them first, closing the description is all it does;
//! - otherwise it *settles*: it locks the slots on its own description and lets the
//!   borrowed one go. It settles at its next receive, whenever it waits for a message (time
//!   it would spend idle), and when a value arrives any other way than through a queue or a
//!   pipe (a worker's arguments, a pool's task), so a slot borrows a description for one
//!   message at most and never while its holder waits. (A queue's lane keeps the
//!   descriptions it borrowed, two per arena at most, for the lane messages that follow,
//!   for about two windows: see `channel::queue_lane::arenas`.)
//!
//! A borrowed hold is never less than a lock of one's own while both processes are honest:
//! nobody unlocks a send description. A peer that has the same description (another
//! receiver of a message sent under it) can unlock it; such a peer can write every slot of
//! the arena anyway, and what it can cause by that (a slot reused while held) gives it
//! nothing beyond what it could write (see the README's threat model).
//!
//! Descriptors a receive no longer needs are closed when this process next waits, so the
//! close is not paid between a message's arrival and the reply (at most `LET_GO_MAX` wait).

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use super::Arena;
use crate::util::lock;

/// Descriptors waiting to be closed at most.
const LET_GO_MAX: usize = 16;

/// Work for the next `settle`: arenas with borrowed holds (`BORROWED`), descriptors to close
/// (`LET_GO`).
static BORROWED: AtomicBool = AtomicBool::new(false);
static LET_GO: AtomicBool = AtomicBool::new(false);

#[derive(Default)]
struct Deferred {
    borrowers: Vec<Weak<Arena>>,
    let_go: Vec<OwnedFd>,
    /// Arenas whose send description was just taken: a spare is opened for the next.
    spares: Vec<Weak<Arena>>,
}

/// Work for the next `idle`: spares to open.
static SPARES: AtomicBool = AtomicBool::new(false);

/// `arena` has used its spare description (or had none): open another at the next `idle`.
pub(super) fn note_spare_wanted(arena: &Arc<Arena>) {
    note(&SPARES, arena, |d| &mut d.spares);
}

/// Adds `arena` (once) to a list of work for later, and raises that list's flag.
fn note(flag: &AtomicBool, arena: &Arc<Arena>, list: impl FnOnce(&mut Deferred) -> &mut Vec<Weak<Arena>>) {
    let mut d = lock(deferred());
    let list = list(&mut d);
    if !list.iter().any(|w| w.as_ptr() == Arc::as_ptr(arena)) {
        list.push(Arc::downgrade(arena));
    }
    flag.store(true, Ordering::Release);
}

/// Does `f` for each arena of a list of work for later, if its flag is raised: the arenas
/// still alive, at most as many as the list had (work put back meanwhile by this thread
/// waits for the next time; another thread doing the same work may take some of it).
/// They are taken a few at a time, so no list is made for them.
fn each(flag: &AtomicBool, list: fn(&mut Deferred) -> &mut Vec<Weak<Arena>>, mut f: impl FnMut(Arc<Arena>)) {
    if !flag.load(Ordering::Acquire) {
        return;
    }
    const AT_ONCE: usize = 4;
    let mut left = usize::MAX;
    while left > 0 {
        let mut taken: [Option<Weak<Arena>>; AT_ONCE] = Default::default();
        {
            let mut d = lock(deferred());
            let l = list(&mut d);
            if left == usize::MAX {
                flag.store(false, Ordering::Release);
                left = l.len();
            }
            // From the front: what is put back goes after what was there.
            let n = left.min(AT_ONCE).min(l.len());
            for (t, w) in taken.iter_mut().zip(l.drain(..n)) {
                *t = Some(w);
            }
            left = if n == 0 { 0 } else { left - n };
        }
        for arena in taken.into_iter().flatten().filter_map(|w| w.upgrade()) {
            f(arena);
        }
    }
}

/// What this process does when it would otherwise wait for a message: [`settle`], and
/// open spare descriptions for arenas that will need a new send description.
pub(crate) fn idle() {
    settle();
    each(
        &SPARES,
        |d| &mut d.spares,
        |arena| {
            if !arena.is_own() {
                return;
            }
            let mut st = arena.state();
            if st.spare.is_none() {
                // Failing is harmless: the next send description is opened when needed.
                st.spare = arena.seg.reopen().ok();
            }
        },
    );
}

static DEFERRED: crate::util::Lazy<Mutex<Deferred>> = crate::util::Lazy::new();

crate::util::fork::guard_at_load!(crate::util::fork::Rank::Deferred, |out| out
    .push(Box::new(lock(deferred()))));

fn deferred() -> &'static Mutex<Deferred> {
    DEFERRED.get_or_make(Mutex::default)
}

/// `arena` has borrowed holds to settle.
pub(super) fn note_borrower(arena: &Arc<Arena>) {
    note(&BORROWED, arena, |d| &mut d.borrowers);
}

/// Closes `fd` at the next `idle` (now, if too many wait already).
pub(crate) fn let_go(fd: OwnedFd) {
    let mut d = lock(deferred());
    if d.let_go.len() >= LET_GO_MAX {
        let old = std::mem::take(&mut d.let_go);
        LET_GO.store(false, Ordering::Release);
        drop(d);
        drop(old);
        drop(fd);
        return;
    }
    d.let_go.push(fd);
    LET_GO.store(true, Ordering::Release);
}

/// Closes the descriptors waiting to be closed: before the creator looks for a free slot,
/// since a message's descriptor kept here holds the slots it named.
pub(crate) fn close_let_go() {
    if LET_GO.load(Ordering::Acquire) {
        let fds = {
            let mut d = lock(deferred());
            LET_GO.store(false, Ordering::Release);
            std::mem::take(&mut d.let_go)
        };
        drop(fds);
    }
}

/// Settles every borrowed hold of this process and closes what waits to be closed. Cheap
/// (two atomic loads) when there is nothing to do.
pub(crate) fn settle() {
    close_let_go();
    each(
        &BORROWED,
        |d| &mut d.borrowers,
        |arena| {
            if !arena.settle() {
                // A lock failed (the kernel ran short): the borrowed holds stay, and so does the
                // work.
                note_borrower(&arena);
            }
        },
    );
}

impl Arena {
    /// Takes this process's own locks on the slots it holds through borrowed descriptions,
    /// and lets those go. Returns false if a lock could not be taken (what was borrowed
    /// then stays borrowed: never less held).
    pub(super) fn settle(&self) -> bool {
        if !self.is_own() {
            return true;
        }
        let mut st = self.state();
        if st.nborrowed == 0 {
            return true;
        }
        let mut slots: Vec<u32> =
            st.borrowed.iter().enumerate().filter(|(_, b)| b.is_some()).map(|(i, _)| i as u32).collect();
        for (start, len) in super::runs(&mut slots) {
            if super::lock_range(self.seg.fd(), start, len, libc::F_RDLCK).is_err() {
                return false;
            }
            for b in &mut st.borrowed[start as usize..(start + len) as usize] {
                *b = None;
            }
            st.nborrowed -= len as usize;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::super::locks::range_free;
    use super::super::Slot;
    use super::*;
    use crate::shm::Segment;
    use crate::SharingStrategy;

    /// A creator's arena with slot 1 sent (locked on the returned description), and another
    /// process's view of it, as a receiver maps it.
    fn sent() -> (Arc<Arena>, Arc<OwnedFd>, Arc<Arena>) {
        let creator = Arc::new(Arena::create(4096, 4, SharingStrategy::FileDescriptor).unwrap());
        let message = creator.send_hold(&[1]).unwrap().0;
        // The sender lets its send description go: the message alone holds the slot.
        creator.state().send = None;
        let seg = Segment::from_fd(creator.seg.reopen().unwrap(), 0).unwrap();
        let holder = Arc::new(Arena::open(seg).unwrap());
        (creator, message, holder)
    }

    #[test]
    fn a_borrowed_hold_goes_on_with_the_message_and_settles_into_a_lock_of_ones_own() {
        let (creator, message, holder) = sent();
        let slots: Vec<Slot> = Slot::hold(&holder, &[1], Some(&message)).unwrap().collect();
        assert!(Arc::ptr_eq(&holder.send_hold(&[1]).unwrap().0, &message), "passed on as it came");
        assert!(holder.settle());
        assert_eq!(Arc::strong_count(&message), 1, "settled: the message's description is let go");
        drop(message);
        assert!(!range_free(creator.seg.fd(), 1, 1).unwrap(), "held by the holder's own lock");
        drop(slots);
        drop(holder);
        assert!(range_free(creator.seg.fd(), 1, 1).unwrap(), "free once the holder is gone");
    }

    /// Handles that a hold took and nobody took out of it go back when it goes (a decode
    /// that fails between the hold and its last handle).
    #[test]
    fn handles_left_in_a_hold_are_given_back() {
        let creator = Arc::new(Arena::create(4096, 4, SharingStrategy::FileDescriptor).unwrap());
        let message = creator.send_hold(&[1, 2]).unwrap().0;
        creator.state().send = None;
        let seg = Segment::from_fd(creator.seg.reopen().unwrap(), 0).unwrap();
        let holder = Arc::new(Arena::open(seg).unwrap());
        let mut held = Slot::hold(&holder, &[1, 2], Some(&message)).unwrap();
        let first = held.next().unwrap();
        drop(held);
        assert_eq!(holder.state().local[2], 0, "the handle not taken is given back");
        assert_eq!(holder.state().local[1], 1, "the one taken stays");
        assert_eq!(Arc::strong_count(&message), 2, "only the slot still held borrows the message");
        drop(first);
        assert_eq!(Arc::strong_count(&message), 1, "nothing borrows it any more");
        assert!(holder.settle());
    }

    #[test]
    fn a_borrowed_hold_dropped_before_settling_leaves_no_lock() {
        let (creator, message, holder) = sent();
        let slots: Vec<Slot> = Slot::hold(&holder, &[1], Some(&message)).unwrap().collect();
        drop(slots);
        assert_eq!(Arc::strong_count(&message), 1, "the message's description is let go");
        drop(message);
        // The holder still maps the arena, and holds nothing.
        assert!(range_free(creator.seg.fd(), 0, 4).unwrap());
        assert!(holder.settle());
    }
}
