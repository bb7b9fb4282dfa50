//! The board: one shared storage per node, mapped by every rank of the node, where the
//! ranks meet at barriers, post what each brings to a collective (its signature), and pass
//! small tensors without a message.
//!
//! ```text
//! [control: count u32, gen u32, sleepers u32 | 64 bytes]
//! [departures: n x u64]                          why a rank left the group, if it did
//! [bells: n ranks x 2 channels x 64 bytes]       rung after a message to that rank
//! [records: 2 sets x n ranks x RECORD bytes]     what each rank brings to a collective
//! [verdicts: 2 sets x RECORD bytes]              the leader's word on the whole job
//! [slots: 2 sets x n ranks x slot bytes]         small tensors, one per rank
//! [results: 2 sets x slot bytes]                 a small result, from the leader
//! ```
//!
//! Collectives alternate between the two sets: a rank writes set `k % 2` in its `k`-th
//! collective only after every rank has reached the first barrier of collective `k - 1`,
//! which each reached after it was done reading set `k % 2` of collective `k - 2`.
//!
//! The barrier is a counter and a generation: the last rank to arrive resets the counter
//! and bumps the generation, which the others watch, spinning briefly, then asleep on a
//! futex (shared: the word lies in a memfd every rank maps). A sleeper wakes every
//! [`LIVENESS`] to ask whether its peers are still there (the kernel closes a dead rank's
//! sockets), so a dead rank is an error, never an endless wait.
//!
//! Every access to the board is atomic (whole `u32` words in the control line, whole `u64`
//! words elsewhere, never both on one word), and the board is never handed to users. What a
//! peer writes here can make a rank wait (as a peer that never arrives does) or read wrong
//! signatures and values (which are checked, or are only numbers), nothing else.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rustix::thread::futex;

use crate::atomic_bytes;
use crate::channel::socket::Bell;
use crate::{Error, Result, Storage};

/// Bytes of one record (a rank's signature and, if it refuses, why).
pub(super) const RECORD: usize = 512;
/// Words of one record.
pub(super) const RECORD_WORDS: usize = RECORD / 8;
/// Bytes of a bell: a cache line of its own.
const BELL: usize = 64;
/// How long a sleeper waits before it checks its peers again.
const LIVENESS: Duration = Duration::from_millis(50);
/// How long a rank polls at a barrier before it sleeps. Waking a sleeper costs more than a
/// barrier whose ranks are all awake; the poll yields the CPU every few looks, so that a rank
/// that has not arrived yet gets it when there are more ranks than CPUs (with 4 ranks on 2
/// CPUs, a 4 KiB all_reduce takes half the time it takes with a plain spin).
const SPIN: Duration = Duration::from_micros(20);
/// All the data slots together stay within this (the slot size shrinks with more ranks).
const SLOTS_BUDGET: usize = 8 << 20;
/// The largest and smallest slot.
const MAX_SLOT: usize = 256 << 10;
const MIN_SLOT: usize = 4 << 10;

/// Where each part of a board of `n` ranks lies, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Layout {
    n: usize,
    departures: usize,
    bells: usize,
    records: usize,
    verdicts: usize,
    slots: usize,
    pub(super) slot: usize,
    results: usize,
    pub(super) len: usize,
}

impl Layout {
    /// The layout for `n` ranks on a node.
    pub(super) fn new(n: usize) -> Result<Layout> {
        let too_many = || Error::invalid_argument("ranks on one node", format!("{n} ranks on one node"));
        if n == 0 || u32::try_from(n).is_err() {
            return Err(too_many());
        }
        let slot = (SLOTS_BUDGET / (2 * n + 2)).clamp(MIN_SLOT, MAX_SLOT) / 64 * 64;
        let departures = 64;
        let bells =
            n.checked_mul(8).and_then(|b| b.checked_add(departures + 63)).ok_or_else(too_many)? / 64 * 64;
        let records = n.checked_mul(2 * BELL).and_then(|b| b.checked_add(bells)).ok_or_else(too_many)?;
        let verdicts = n.checked_mul(2 * RECORD).and_then(|b| b.checked_add(records)).ok_or_else(too_many)?;
        let slots = verdicts + 2 * RECORD;
        let results = n.checked_mul(2 * slot).and_then(|b| b.checked_add(slots)).ok_or_else(too_many)?;
        let len = results.checked_add(2 * slot).ok_or_else(too_many)?;
        Ok(Layout { n, departures, bells, records, verdicts, slots, slot, results, len })
    }
}

/// A part of the board that holds bytes.
#[derive(Clone, Copy, Debug)]
pub(super) enum Area {
    /// Rank `rank`'s record of set `set`.
    Record { set: usize, rank: usize },
    /// The verdict of set `set`.
    Verdict { set: usize },
    /// Rank `rank`'s data slot of set `set`.
    Slot { set: usize, rank: usize },
    /// The result slot of set `set`.
    Result { set: usize },
}

/// This rank's view of its node's board.
pub(super) struct Board {
    /// Keeps the mapping alive; never handed out.
    storage: Storage,
    base: *mut u8,
    layout: Layout,
}

impl Board {
    /// The board in `storage` (made by the node's leader, or received from it), for `n`
    /// ranks.
    pub(super) fn new(storage: Storage, n: usize) -> Result<Board> {
        let layout = Layout::new(n)?;
        let base = storage.as_mut_ptr();
        if !storage.is_shared() || storage.len() != layout.len || base as usize % 64 != 0 {
            return Err(Error::invalid(format!(
                "the node's board is {} bytes at {:#x} (shared: {}), not {} bytes, 64-byte aligned, shared",
                storage.len(),
                base as usize,
                storage.is_shared(),
                layout.len
            )));
        }
        Ok(Board { storage, base, layout })
    }

    /// The storage, to send to the node's other ranks.
    pub(super) fn storage(&self) -> &Storage {
        &self.storage
    }

    /// The size of a data slot, in bytes.
    pub(super) fn slot_len(&self) -> usize {
        self.layout.slot
    }

    /// The control word `k` (0: count, 1: generation, 2: sleepers).
    fn control(&self, k: usize) -> &AtomicU32 {
        debug_assert!(k < 3);
        // SAFETY: the control line is the board's first 64 bytes, in the mapping that
        // `self.storage` keeps alive as long as `self`, 64-byte aligned (checked in `new`),
        // so word k < 3 is in bounds and 4-byte aligned; the control line is only ever
        // accessed through these u32 atomics, in every process (module docs).
        unsafe { AtomicU32::from_ptr(self.base.add(4 * k).cast()) }
    }

    /// Rank `rank`'s departure word: 0 while it is in the group, else 1 + the local rank
    /// whose loss made it leave (itself, for a failure of its own).
    fn departure(&self, rank: usize) -> Option<&AtomicU64> {
        if rank >= self.layout.n {
            return None;
        }
        // SAFETY: word `rank` < n of the departures area lies in the board's mapping (the
        // layout puts n words there, below `len`, checked in `new`), which `self.storage`
        // keeps alive as long as `self`; it is 8-byte aligned (64-byte aligned base and
        // area) and only ever accessed as this u64 atomic.
        Some(unsafe { AtomicU64::from_ptr(self.base.add(self.layout.departures + 8 * rank).cast()) })
    }

    /// The doorbell of local rank `rank`'s channel `ch` (0 or 1): senders ring it after
    /// each message to `rank` on that channel, and `rank` watches it while it polls awake
    /// for one (see `socket::recv_taken`).
    pub(super) fn bell(&self, rank: usize, ch: usize) -> Option<&Bell> {
        if rank >= self.layout.n || ch >= 2 {
            return None;
        }
        let at = self.layout.bells + (rank * 2 + ch) * BELL;
        // SAFETY: the bell lies in the bells area (rank < n, ch < 2), inside the board's
        // mapping, which `self.storage` keeps alive as long as `self`; it is 64-byte
        // aligned (more than Bell's 4). A Bell is atomics only (u32 words, never accessed
        // otherwise): valid for any bit pattern, and meant for several processes at once.
        Some(unsafe { &*self.base.add(at).cast::<Bell>() })
    }

    /// Posts that local rank `me` leaves the group because local rank `cause` is gone.
    pub(super) fn depart(&self, me: usize, cause: usize) {
        if let Some(w) = self.departure(me) {
            w.store(cause as u64 + 1, Ordering::Release);
        }
    }

    /// Why local rank `rank` left the group: the local rank whose loss made it leave, or
    /// `None` if it did not say (it died).
    pub(super) fn departed_for(&self, rank: usize) -> Option<usize> {
        let w = self.departure(rank)?.load(Ordering::Acquire);
        usize::try_from(w.checked_sub(1)?).ok().filter(|&c| c < self.layout.n)
    }

    /// The offset and length of `area`, checked against the layout.
    fn span(&self, area: Area) -> Result<(usize, usize)> {
        let l = &self.layout;
        let ok = match area {
            Area::Record { set, rank } | Area::Slot { set, rank } => set < 2 && rank < l.n,
            Area::Verdict { set } | Area::Result { set } => set < 2,
        };
        if !ok {
            return Err(Error::invalid_argument(
                "board area",
                format!("{area:?} on a board of {} ranks", l.n),
            ));
        }
        // In bounds now, so within the layout, whose offsets were summed with checked
        // arithmetic when it was made.
        Ok(match area {
            Area::Record { set, rank } => (l.records + (set * l.n + rank) * RECORD, RECORD),
            Area::Verdict { set } => (l.verdicts + set * RECORD, RECORD),
            Area::Slot { set, rank } => (l.slots + (set * l.n + rank) * l.slot, l.slot),
            Area::Result { set } => (l.results + set * l.slot, l.slot),
        })
    }

    /// The address of bytes `offset..offset + len` of `area`, checked.
    fn at(&self, area: Area, offset: usize, len: usize) -> Result<*mut u8> {
        let (start, size) = self.span(area)?;
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::invalid_argument(
                "board range",
                format!("bytes {offset}..+{len} of {area:?}, which holds {size}"),
            ));
        }
        // In bounds: start + size <= layout.len, the storage's length (checked in `new`).
        Ok(self.base.wrapping_add(start + offset))
    }

    /// Writes `src` at `offset` in `area`.
    pub(super) fn store(&self, area: Area, offset: usize, src: &[u8]) -> Result<()> {
        let p = self.at(area, offset, src.len())?;
        // SAFETY: `at` checked that the range lies in the board's storage, which `self`
        // keeps alive; data areas are accessed only through atomic_bytes (whole u64 words).
        unsafe { atomic_bytes::store(p, src) };
        Ok(())
    }

    /// Reads `out.len()` bytes at `offset` in `area`.
    pub(super) fn load(&self, area: Area, offset: usize, out: &mut [u8]) -> Result<()> {
        let p = self.at(area, offset, out.len())?;
        // SAFETY: as in `store`.
        unsafe { atomic_bytes::load(p, out) };
        Ok(())
    }

    /// Writes a whole record (or verdict) `area`.
    pub(super) fn store_words(&self, area: Area, words: &[u64; RECORD_WORDS]) -> Result<()> {
        self.store(area, 0, bytemuck::cast_slice(words))
    }

    /// Reads a whole record (or verdict) `area`.
    pub(super) fn load_words(&self, area: Area) -> Result<[u64; RECORD_WORDS]> {
        let mut words = [0u64; RECORD_WORDS];
        self.load(area, 0, bytemuck::cast_slice_mut(&mut words))?;
        Ok(words)
    }

    /// Waits until every rank of the node has called `barrier` as many times as this one.
    /// While it sleeps, `alive` is asked every [`LIVENESS`] whether the peers are still
    /// there; its error ends the wait.
    pub(super) fn barrier(&self, alive: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        let (count, gen, sleepers) = (self.control(0), self.control(1), self.control(2));
        let g = gen.load(Ordering::Acquire);
        let arrived = count.fetch_add(1, Ordering::AcqRel).wrapping_add(1);
        // `n` fits in u32 (Layout::new).
        if arrived as usize == self.layout.n {
            count.store(0, Ordering::Relaxed);
            // SeqCst pairs with the sleepers' SeqCst increment and load: either this load
            // sees a sleeper, or the sleeper's load sees the new generation.
            gen.store(g.wrapping_add(1), Ordering::SeqCst);
            if sleepers.load(Ordering::SeqCst) != 0 {
                // The count is an int to the kernel: i32::MAX wakes every sleeper.
                let _ = futex::wake(gen, futex::Flags::empty(), i32::MAX as u32);
            }
            return Ok(());
        }
        let spin_until = Instant::now() + SPIN;
        'spin: loop {
            for _ in 0..64 {
                if gen.load(Ordering::Acquire) != g {
                    return Ok(());
                }
                std::hint::spin_loop();
            }
            // A rank that has not arrived may be waiting for this CPU.
            std::thread::yield_now();
            if Instant::now() >= spin_until {
                break 'spin;
            }
        }
        let slice = futex::Timespec { tv_sec: 0, tv_nsec: LIVENESS.as_nanos() as i64 };
        loop {
            sleepers.fetch_add(1, Ordering::SeqCst);
            if gen.load(Ordering::SeqCst) == g {
                // Returns at a wake, a timeout, a signal, or at once if the generation moved.
                let _ = futex::wait(gen, futex::Flags::empty(), g, Some(&slice));
            }
            sleepers.fetch_sub(1, Ordering::SeqCst);
            if gen.load(Ordering::Acquire) != g {
                return Ok(());
            }
            if let Err(e) = alive() {
                // A rank that passed this barrier may have closed its sockets since (it
                // ended its session): the barrier was passed before, and is passed here too.
                if gen.load(Ordering::SeqCst) != g {
                    return Ok(());
                }
                return Err(e);
            }
        }
    }
}

/// A fresh board for `n` ranks, in shared memory (made by the node's leader).
pub(super) fn create(n: usize) -> Result<Board> {
    let layout = Layout::new(n)?;
    Board::new(Storage::new_shared(layout.len)?, n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_fit_and_slots_shrink_with_more_ranks() {
        let one = Layout::new(1).unwrap();
        assert_eq!(one.slot, MAX_SLOT);
        let many = Layout::new(4096).unwrap();
        assert_eq!(many.slot, MIN_SLOT);
        assert!(Layout::new(0).is_err());
        assert!(Layout::new(usize::MAX).is_err());
        for n in [1, 2, 4, 7, 64] {
            let l = Layout::new(n).unwrap();
            assert_eq!(l.results + 2 * l.slot, l.len);
            assert_eq!(l.slot % 64, 0);
        }
    }

    #[test]
    fn a_board_of_one_passes_its_barrier_and_checks_its_ranges() {
        let b = create(1).unwrap();
        b.barrier(&mut || Ok(())).unwrap();
        b.barrier(&mut || Ok(())).unwrap();
        let mut rec = [0u64; RECORD_WORDS];
        rec[3] = 42;
        b.store_words(Area::Record { set: 1, rank: 0 }, &rec).unwrap();
        assert_eq!(b.load_words(Area::Record { set: 1, rank: 0 }).unwrap()[3], 42);
        assert!(b.store(Area::Slot { set: 0, rank: 1 }, 0, &[1]).is_err(), "no rank 1");
        assert!(b.store(Area::Slot { set: 2, rank: 0 }, 0, &[1]).is_err(), "no set 2");
        assert!(b.store(Area::Result { set: 0 }, b.slot_len(), &[1]).is_err(), "past the slot");
        assert!(b.load(Area::Result { set: 0 }, usize::MAX, &mut [0]).is_err(), "an offset that overflows");
    }
}
