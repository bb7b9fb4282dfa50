//! What a process holds: its handles of each slot, the locks that tell other processes
//! so (taken in runs, given back in runs), and [`Slot`], one handle.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use super::locks::{lock_range, runs};
use super::{borrow, Arena, State, PENDING_BYTES, PENDING_SLOTS};
use crate::{Error, Result, SharingStrategy};

impl Arena {
    /// One more handle of each of `slots` in this process (a slot may appear more than
    /// once). A holder's first handle of a slot takes the process's lock on it; locks are
    /// taken in runs of adjacent slots, and slots waiting to be given back are kept instead.
    ///
    /// With `via`, the description of the message that names the slots (which holds them
    /// all), a first handle borrows that hold instead of locking (see `borrow`). Returns
    /// whether it did.
    pub(crate) fn hold(&self, slots: &[u32], via: Option<&Arc<OwnedFd>>) -> Result<bool> {
        if let Some(&bad) = slots.iter().find(|&&s| s >= self.nslots) {
            return Err(Error::invalid(format!("slot {bad} is outside an arena of {} slots", self.nslots)));
        }
        if !self.is_own() {
            // Inherited through fork: its locks are the parent's, its record's counts are
            // never read here (see `release`), and its record may have been locked at the
            // fork by a thread of the parent that this process lacks. The fork hold counts
            // this process's handles instead.
            if !slots.is_empty() && !self.fork_hold.add(slots.len()) {
                return Err(Error::Unsupported(
                    "an arena inherited through fork whose handles here had all gone, and with them \
                     its hold: it cannot be held again in this process"
                        .into(),
                ));
            }
            return Ok(false);
        }
        let mut st = self.state();
        let mut borrowed = false;
        if !self.creator {
            // Each slot once (a message may name one twice); a caller's slots most often come
            // sorted and distinct, which needs no copy.
            let copy;
            let distinct: &[u32] = if slots.windows(2).all(|w| w[0] < w[1]) {
                slots
            } else {
                let mut v = slots.to_vec();
                v.sort_unstable();
                v.dedup();
                copy = v;
                &copy
            };
            let st = &mut *st;
            // A slot's first handle here needs a hold, unless the slot waits to be given back:
            // the lock kept for it serves.
            let needs = |local: &[u32], pending: &mut Vec<u32>, slot: u32| {
                local[slot as usize] == 0 && !take_pending(pending, slot)
            };
            match via {
                Some(fd) => {
                    for &slot in distinct {
                        if !needs(&st.local, &mut st.pending, slot) {
                            continue;
                        }
                        if st.borrowed.is_empty() {
                            st.borrowed = vec![None; self.nslots as usize];
                        }
                        st.borrowed[slot as usize] = Some(fd.clone());
                        st.nborrowed += 1;
                        borrowed = true;
                    }
                }
                None => {
                    let mut need: Vec<u32> =
                        distinct.iter().copied().filter(|&s| needs(&st.local, &mut st.pending, s)).collect();
                    for (start, len) in runs(&mut need) {
                        lock_range(self.seg.fd(), start, len, libc::F_RDLCK)
                            .map_err(|e| Error::io("locking received slots (F_OFD_SETLK)", e))?;
                    }
                }
            }
        }
        for &slot in slots {
            let c = &mut st.local[slot as usize];
            *c = c.checked_add(1).ok_or_else(|| Error::invalid("too many handles of one slot"))?;
        }
        Ok(borrowed)
    }

    /// One handle of `slot` less; the last one gives the process's lock back (in a run with
    /// others: see `PENDING_SLOTS`).
    fn release(&self, slot: u32) {
        if !self.is_own() {
            // Inherited through fork: as in `hold`, nothing in the record to count or give
            // back; the last handle lets the fork hold go.
            self.fork_hold.remove();
            return;
        }
        let mut st = self.state();
        let i = slot as usize;
        st.local[i] = st.local[i].saturating_sub(1);
        let named = self.seg.name().is_some();
        if st.local[i] == 0 && self.creator && (self.is_large() || named && super::allocator::named_busy()) {
            // A large storage of ours, or one in a filesystem of bounded room, is freed here:
            // keep its arena for reuse only within bounds.
            if self.is_large() {
                st.idle_since = Some(std::time::Instant::now());
            }
            drop(st);
            let strategy = if named { SharingStrategy::FileSystem } else { SharingStrategy::FileDescriptor };
            super::allocator::freed_here(strategy);
            return;
        }
        if st.local[i] == 0 && !self.creator {
            if let Some(fd) = st.borrowed.get_mut(i).and_then(Option::take) {
                // Held through a message's description, not a lock of ours: letting it go is
                // all there is to give back.
                st.nborrowed -= 1;
                drop(st);
                drop(fd);
                return;
            }
            if self.nslots == 1 {
                // A relay's send description would keep the arena's only slot locked for up
                // to SEND_BATCH messages, and its creator would make a new arena meanwhile:
                // let it go (messages in flight keep theirs).
                st.send = None;
            }
            st.pending.push(slot);
            if self.nslots == 1
                || st.pending.len() >= PENDING_SLOTS
                || st.pending.len() * self.slot_size >= PENDING_BYTES
            {
                self.flush(&mut st);
            }
        }
    }

    /// Gives back the locks of the slots waiting for it, in runs. Unlocking cannot fail for
    /// ranges we locked; if it did, the slots would stay held until this process drops the
    /// arena or exits: never less.
    fn flush(&self, st: &mut State) {
        for (start, len) in runs(&mut st.pending) {
            let _ = lock_range(self.seg.fd(), start, len, libc::F_UNLCK);
        }
        st.pending.clear();
    }
}

/// Takes `slot` out of `pending` (slots waiting to be given back); whether it was there.
fn take_pending(pending: &mut Vec<u32>, slot: u32) -> bool {
    match pending.iter().position(|&q| q == slot) {
        Some(p) => {
            pending.swap_remove(p);
            true
        }
        None => false,
    }
}

/// One holder's claim on a slot: the storage's memory. Dropping it gives the claim back.
pub(crate) struct Slot {
    pub(super) arena: Arc<Arena>,
    pub(super) slot: u32,
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot").field("arena", self.arena.seg.id()).field("slot", &self.slot).finish()
    }
}

impl Slot {
    /// Holds `slots` of a received arena, with locks of its own or through `via`, the
    /// message's description (see `borrow`), and returns their handles, to be taken in
    /// order: those not taken are given back when the [`Held`] goes.
    pub(crate) fn hold<'a>(
        arena: &'a Arc<Arena>,
        slots: &'a [u32],
        via: Option<&Arc<OwnedFd>>,
    ) -> Result<Held<'a>> {
        if arena.hold(slots, via)? {
            borrow::note_borrower(arena);
        }
        Ok(Held { arena, slots: slots.iter() })
    }

    pub(crate) fn arena(&self) -> &Arc<Arena> {
        &self.arena
    }

    pub(crate) fn slot(&self) -> u32 {
        self.slot
    }

    pub(crate) fn as_mut_ptr(&self) -> *mut u8 {
        self.arena.slot_ptr(self.slot)
    }

    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.arena.slot_size
    }
}

/// The handles [`Slot::hold`] took, handed out one by one (no list is made for them); those
/// not taken are given back when it goes.
pub(crate) struct Held<'a> {
    arena: &'a Arc<Arena>,
    slots: std::slice::Iter<'a, u32>,
}

impl Iterator for Held<'_> {
    type Item = Slot;

    fn next(&mut self) -> Option<Slot> {
        self.slots.next().map(|&slot| Slot { arena: self.arena.clone(), slot })
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        for slot in self.by_ref() {
            drop(slot);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.arena.release(self.slot);
    }
}
