//! Arenas: large shared segments cut into equal slots, one storage per slot.
//!
//! The process that made an arena (its creator) is the only one that hands its slots out,
//! and it hands a slot out again only when nobody can still be using it. Who uses a slot is
//! known without any count in shared memory, where a peer could write it:
//!
//! - the creator's own handles are counted in its private memory;
//! - every other process that holds a slot has its own open file description of the
//!   arena's file (see [`Segment::reopen`]) and an OFD read lock on byte `slot` of it;
//! - a message in flight holds its slots the same way, through the sender's *send
//!   description*: the sender locks the slots on it and the message carries it (SCM_RIGHTS).
//!   The receiver takes its own lock before it closes the message's descriptor, or keeps
//!   the descriptor for a while and holds through it (see `borrow`).
//!
//! The kernel drops a description's locks when its last descriptor closes: when the holder
//! drops its last storage of the arena, exits or is killed, when a message is consumed, or
//! when a message is destroyed unread (a socket closed with records in it). A peer can add
//! holds (lock slots it names) but never remove one on an arena it was not given, and no
//! bytes it sends can make a slot be reused while an honest holder has it. (A peer given a
//! send description can unlock it, which gains it nothing: see `borrow`.) The creator asks the kernel (`F_OFD_GETLK`
//! on its own description, which no message ever carries) before reusing a slot it has sent.
//!
//! A send description is shared by the messages a process sends from one arena until it is
//! retired (after [`SEND_BATCH`] messages, or when the creator wants a slot it still locks),
//! so a slot may stay held for a while after its last message was consumed; it is never
//! held for less. Opening a description costs a `/proc/self/fd` lookup, which this spreads.
//!
//! Header layout (little-endian): `[0..8) magic | [8..16) slot size | [16..20) slot count |
//! [20..4096) reserved | page-aligned data`. The header is read once, when an arena is
//! received, and checked against the file's size: bounds never depend on it later.

mod allocator;
mod borrow;
mod fork_hold;
mod hold;
mod locks;
mod send;

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::shm::Segment;
use crate::util::lock;
use crate::{Error, Result, SharingStrategy};

pub(crate) use allocator::{allocate, allocate_now, trim, unlink_own_names};
pub(crate) use borrow::{idle, let_go, settle};
pub(crate) use fork_hold::listed;
pub(crate) use hold::Slot;
use locks::{conflict, lock_range, range_free, runs};

const MAGIC: u64 = u64::from_le_bytes(*b"TSARENA2");
const PAGE: usize = 4096;
/// Data starts after one page of header.
const DATA_OFFSET: usize = PAGE;
/// Most slots in one arena.
const MAX_SLOTS: usize = 8192;
/// Messages that share one send description before it is retired.
pub(crate) const SEND_BATCH: u32 = 64;
/// Slots locked on one send description before it is retired: messages of many storages
/// each would otherwise keep thousands of slots held through one description.
const SEND_SLOTS: usize = 256;
/// A holder gives back slots it no longer uses in runs, once this many are waiting (or
/// `PENDING_BYTES` of them), or all at once when it drops the arena.
const PENDING_SLOTS: usize = 16;
const PENDING_BYTES: usize = 1 << 20;
/// Slots the creator checks for other holders in one `F_OFD_GETLK`.
const CHECK_RUN: u32 = 64;

/// An arena mapped in this process, with its geometry copied out of the header once.
pub(crate) struct Arena {
    /// Whether the receive cache knows this arena (set on its first send).
    pub(crate) cached: AtomicBool,
    /// The whole mapping's page-locking for CUDA copies (see [`Arena::pin_with`]), made
    /// once. Declared before `seg`: fields drop in order, so it is undone before the
    /// mapping goes.
    #[cfg(feature = "cuda")]
    pin: std::sync::OnceLock<Box<dyn std::any::Any + Send + Sync>>,
    /// The mapping, and this process's own description of the file: the creator's never
    /// leaves the process; a holder's carries its slot locks.
    seg: Segment,
    slot_size: usize,
    nslots: u32,
    creator: bool,
    generation: u64,
    /// The creator's: a child was forked while another thread had the record, and may
    /// hold any slot through its fork hold (see `fork_hold`): the next claim marks every
    /// slot exposed.
    forked: AtomicBool,
    /// In a forked child, the descriptor of the fork hold its parent made for it (see
    /// `fork_hold`), -1 if none: it holds the slots the child inherited handles of until
    /// its last handle goes. Kept outside the record, which a thread the child lacks may
    /// hold.
    fork_hold: fork_hold::ForkHoldFd,
    state: Mutex<State>,
}

struct State {
    /// This process's handles (blocks) of each slot.
    local: Vec<u32>,
    /// The creator's: slots it has sent since it last saw them unlocked, which other
    /// processes may therefore hold.
    exposed: Vec<bool>,
    send: Option<SendHold>,
    /// A description opened ahead, while this process had nothing else to do, for the next
    /// send description (opening one costs a `/proc/self/fd` lookup).
    spare: Option<OwnedFd>,
    /// A holder's slots with no handle left here, still locked until the next flush.
    pending: Vec<u32>,
    /// A holder's slots held through the description of the message that brought them
    /// (see `borrow`), not through a lock of this process; empty until the first borrow.
    borrowed: Vec<Option<Arc<OwnedFd>>>,
    nborrowed: usize,
    /// The creator's one-slot arena: since when it has had no handle here.
    idle_since: Option<std::time::Instant>,
}

/// The description messages from this process carry, with the slots locked on it.
struct SendHold {
    fd: Arc<OwnedFd>,
    /// Slots locked on it. The creator locks runs ahead of what it sends (so that sending a
    /// fresh slot rarely costs a syscall); such a lock holds nothing anyone uses.
    locked: Vec<bool>,
    /// Slots named by messages that carried it.
    sent: Vec<bool>,
    /// How many slots are locked on it.
    nlocked: usize,
    messages: u32,
    /// A random number naming it in a queue's lane directory, never 0 (see `send_hold`).
    tag: u64,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("segment", self.seg.id())
            .field("slot_size", &self.slot_size)
            .field("nslots", &self.nslots)
            .field("creator", &self.creator)
            .finish()
    }
}

impl Arena {
    fn new(seg: Segment, slot_size: usize, nslots: u32, creator: bool) -> Arena {
        let n = nslots as usize;
        Arena {
            cached: AtomicBool::new(false),
            #[cfg(feature = "cuda")]
            pin: std::sync::OnceLock::new(),
            seg,
            slot_size,
            nslots,
            creator,
            generation: crate::util::fork::generation(),
            forked: AtomicBool::new(false),
            fork_hold: fork_hold::ForkHoldFd::default(),
            state: Mutex::new(State {
                local: vec![0; n],
                exposed: if creator { vec![false; n] } else { Vec::new() },
                send: None,
                spare: None,
                pending: Vec::new(),
                borrowed: Vec::new(),
                nborrowed: 0,
                idle_since: None,
            }),
        }
    }

    /// Creates an arena of `nslots` slots of `slot_size` bytes.
    fn create(slot_size: usize, nslots: usize, strategy: SharingStrategy) -> Result<Arena> {
        let too_large = || {
            Error::invalid_argument(
                "storage size",
                format!("a shared storage of {slot_size} bytes is too large"),
            )
        };
        let len =
            slot_size.checked_mul(nslots).and_then(|d| d.checked_add(DATA_OFFSET)).ok_or_else(too_large)?;
        let n32 = u32::try_from(nslots).map_err(|_| too_large())?;
        let seg = Segment::create(len, strategy)?;
        if nslots == 1 {
            // A large storage, about to be filled or copied into whole. (A size class's arena
            // is filled slot by slot, maybe never whole: its pages are mapped as touched.)
            seg.populate();
        }
        // SAFETY: the segment is at least DATA_OFFSET bytes, page-aligned, and no other
        // process or handle has seen it yet, so these plain writes race with nothing.
        unsafe {
            let p = seg.as_mut_ptr();
            p.cast::<u64>().write(MAGIC);
            p.add(8).cast::<u64>().write(slot_size as u64);
            p.add(16).cast::<u32>().write(n32);
        }
        Ok(Arena::new(seg, slot_size, n32, true))
    }

    /// Checks and adopts a segment received from another process as an arena. `seg` must
    /// be mapped through a description of this process's own (see [`Segment::reopen`]).
    pub(crate) fn open(seg: Segment) -> Result<Arena> {
        if seg.len() < DATA_OFFSET {
            return Err(Error::invalid("a received segment is too small to be an arena"));
        }
        // SAFETY: the mapping is at least DATA_OFFSET bytes and page-aligned. A peer may be
        // writing these words right now, so they are read with volatile reads of plain
        // integers (any bit pattern is a valid u64/u32) and only trusted after the checks.
        let (magic, slot_size, nslots) = unsafe {
            let p = seg.as_ptr();
            (
                p.cast::<u64>().read_volatile(),
                p.add(8).cast::<u64>().read_volatile(),
                p.add(16).cast::<u32>().read_volatile(),
            )
        };
        if magic != MAGIC {
            return Err(Error::invalid("a received segment is not a tensorshare arena (bad magic)"));
        }
        let slot_size =
            usize::try_from(slot_size).map_err(|_| Error::invalid("arena slot size overflows"))?;
        let end = slot_size.checked_mul(nslots as usize).and_then(|d| d.checked_add(DATA_OFFSET));
        match end {
            Some(end) if nslots > 0 && nslots as usize <= MAX_SLOTS && slot_size > 0 && end <= seg.len() => {}
            _ => {
                return Err(Error::invalid(format!(
                    "arena header ({nslots} slots of {slot_size} bytes) does not fit its segment of {} bytes",
                    seg.len()
                )))
            }
        }
        Ok(Arena::new(seg, slot_size, nslots, false))
    }

    pub(crate) fn segment(&self) -> &Segment {
        &self.seg
    }

    pub(crate) fn slot_size(&self) -> usize {
        self.slot_size
    }

    pub(crate) fn nslots(&self) -> u32 {
        self.nslots
    }

    /// Page-locks the whole mapping once: `register(first byte, length)` is the device
    /// layer's registration (it sits above this layer), and what it returns is kept until
    /// the arena goes, dropped before the mapping is unmapped. The length is a whole number
    /// of pages, all inside the mapping.
    #[cfg(feature = "cuda")]
    pub(crate) fn pin_with(
        &self,
        register: impl FnOnce(*mut u8, usize) -> Result<Box<dyn std::any::Any + Send + Sync>>,
    ) -> Result<()> {
        // Pinning is rare: one lock for all arenas keeps two threads from registering one
        // mapping twice.
        static PINNING: Mutex<()> = Mutex::new(());
        let _one_at_a_time = lock(&PINNING);
        if self.pin.get().is_none() {
            // mmap maps whole pages: the last partial page of the file is mapped too.
            let len = self.seg.len().next_multiple_of(PAGE);
            let _ = self.pin.set(register(self.seg.as_mut_ptr(), len)?);
        }
        Ok(())
    }

    /// Whether [`Arena::pin_with`] has page-locked this arena.
    #[cfg(feature = "cuda")]
    pub(crate) fn is_pinned(&self) -> bool {
        self.pin.get().is_some()
    }

    /// Whether this process made the arena (and so never holds its slots: see above).
    pub(crate) fn is_creator(&self) -> bool {
        self.creator
    }

    /// Whether this is an arena of one storage larger than any size class.
    pub(crate) fn is_large(&self) -> bool {
        self.nslots == 1 && self.slot_size > allocator::LARGEST_CLASS
    }

    /// Whether this arena object belongs to this process (not one inherited through fork).
    pub(crate) fn is_own(&self) -> bool {
        // An arena inherited through fork shares its parent's descriptions (and so their
        // locks): the child must not touch them.
        self.generation == crate::util::fork::generation()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Runs `f` with this arena's state locked (`raw::with_arena_record_locked`).
    #[cfg(feature = "test-support")]
    pub(crate) fn with_state_locked<R>(&self, f: impl FnOnce() -> R) -> R {
        let _st = self.state();
        f()
    }

    /// Whether this process holds `slot` through a borrowed description (`raw::borrowed`).
    #[cfg(feature = "test-support")]
    pub(crate) fn is_borrowed(&self, slot: u32) -> bool {
        self.state().borrowed.get(slot as usize).is_some_and(Option::is_some)
    }

    /// Address of a slot's first byte.
    ///
    /// # Panics
    /// If `slot` is not a slot of this arena (callers check it first).
    pub(crate) fn slot_ptr(&self, slot: u32) -> *mut u8 {
        assert!(slot < self.nslots, "slot {slot} of an arena of {} slots", self.nslots);
        // SAFETY: `open`/`create` checked DATA_OFFSET + nslots * slot_size <= len, so the
        // slot lies inside the mapping.
        unsafe { self.seg.as_mut_ptr().add(DATA_OFFSET + slot as usize * self.slot_size) }
    }

    /// The creator takes a slot nobody uses (no handle here, no lock anywhere), or says
    /// from which slot on it is worth asking again (past a run another holder locks).
    fn try_claim(&self, slot: u32) -> std::result::Result<(), u32> {
        let mut st = self.state();
        if self.forked.swap(false, std::sync::atomic::Ordering::AcqRel) {
            // A child forked since may hold any slot it inherited a handle of.
            st.exposed.iter_mut().for_each(|e| *e = true);
        }
        let i = slot as usize;
        if st.local[i] != 0 {
            return Err(slot + 1);
        }
        if st.exposed[i] {
            // Messages sent under the current send description may still carry the slot: let
            // that description go, so that they alone hold it, and ask the kernel.
            if st.send.as_ref().is_some_and(|s| s.sent[i]) {
                st.send = None;
            }
            // Asked from the send description (if any), the kernel leaves out its locks:
            // ahead-of-time ones, and those of sent slots, which are all retired above.
            let st = &mut *st;
            let fd = st.send.as_ref().map_or(self.seg.fd(), |s| s.fd.as_fd());
            // One question for a run of slots: the allocator takes them in order.
            let run = CHECK_RUN.min(self.nslots - slot);
            match conflict(fd, slot, run) {
                Ok(None) => {
                    let sent = st.send.as_ref().map(|s| &s.sent[i..i + run as usize]);
                    for (j, e) in st.exposed[i..i + run as usize].iter_mut().enumerate() {
                        if !sent.is_some_and(|s| s[j]) {
                            *e = false;
                        }
                    }
                }
                // A lock from this slot on: skip the whole run it covers.
                Ok(Some((first, end))) if first <= u64::from(slot) => return Err(self.past(slot, end)),
                _ => match conflict(fd, slot, 1) {
                    Ok(None) => st.exposed[i] = false,
                    Ok(Some((_, end))) => return Err(self.past(slot, end)),
                    Err(_) => return Err(slot + 1),
                },
            }
        }
        st.local[i] = 1;
        st.idle_since = None;
        Ok(())
    }

    /// The slot to ask about next after `slot`, which a lock ending at `end` covers.
    fn past(&self, slot: u32, end: u64) -> u32 {
        u32::try_from(end).unwrap_or(self.nslots).min(self.nslots).max(slot + 1)
    }

    /// Whether any slot is in use: by a handle here, or by a lock of another description.
    fn in_use(&self) -> bool {
        let mut st = self.state();
        if st.local.iter().any(|&c| c != 0) {
            return true;
        }
        // The send description's locks are ours, not another holder's: retired first, so
        // that only messages in flight and other holders count.
        st.send = None;
        !matches!(range_free(self.seg.fd(), 0, self.nslots), Ok(true))
    }
}
