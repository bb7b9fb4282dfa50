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
//!   The receiver takes its own lock before it closes the message's descriptor.
//!
//! The kernel drops a description's locks when its last descriptor closes: when the holder
//! drops its last storage of the arena, exits or is killed, when a message is consumed, or
//! when a message is destroyed unread (a socket closed with records in it). A peer can add
//! holds (lock slots it names) but never remove another's, and no bytes it sends can make
//! a slot be reused while an honest holder has it. The creator asks the kernel (`F_OFD_GETLK`
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

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::shm::Segment;
use crate::util::lock;
use crate::{Error, Result, SharingStrategy};

const MAGIC: u64 = u64::from_le_bytes(*b"TSARENA2");
const PAGE: usize = 4096;
/// Data starts after one page of header.
const DATA_OFFSET: usize = PAGE;
/// Smallest slot: 64 bytes, so every storage is 64-byte aligned.
const MIN_SLOT_SHIFT: u32 = 6;
/// Largest pooled slot: 4 MiB. Larger storages get an arena of one slot.
const MAX_SLOT_SHIFT: u32 = 22;
const CLASSES: usize = (MAX_SLOT_SHIFT - MIN_SLOT_SHIFT + 1) as usize;
/// Bytes of data in a class's first arena, doubled for each further one up to
/// `ARENA_DATA` (and at least one slot): a few small tensors of many sizes then fit in a
/// container's 64 MiB /dev/shm, while a program that makes many gets large arenas soon.
const FIRST_ARENA_DATA: usize = 256 << 10;
/// Bytes of data in a pooled arena, at most.
const ARENA_DATA: usize = 8 << 20;
const MAX_SLOTS: usize = 8192;
/// Free one-slot arenas kept for reuse (so that a large tensor made again and again finds
/// warm pages): at most this many bytes and this many arenas, none larger than
/// `LARGE_RETAIN`, and none idle for longer than `LARGE_IDLE` at the next allocation or
/// release of a large storage. Anything else goes back to the system when it is freed.
const LARGE_RETAIN: usize = 256 << 20;
const LARGE_RETAIN_COUNT: usize = 8;
const LARGE_IDLE: std::time::Duration = std::time::Duration::from_secs(5);
/// Messages that share one send description before it is retired.
pub(crate) const SEND_BATCH: u32 = 64;
/// A holder gives back slots it no longer uses in runs, once this many are waiting (or
/// `PENDING_BYTES` of them), or all at once when it drops the arena.
const PENDING_SLOTS: usize = 16;
const PENDING_BYTES: usize = 1 << 20;
/// Slots the creator checks for other holders in one `F_OFD_GETLK`.
const CHECK_RUN: u32 = 64;

/// Counts forks, so that an arena object inherited by a forked child knows it is not its
/// own: it shares its parent's descriptions (and so their locks) and must not touch them.
static FORK_GENERATION: AtomicU64 = AtomicU64::new(0);

extern "C" fn forked_child() {
    FORK_GENERATION.fetch_add(1, Ordering::Relaxed);
}

/// Makes every fork (through libc, by anyone) start a new generation in the child.
fn watch_forks() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: the child handler is a plain extern "C" fn that does one atomic add, which
        // is async-signal-safe and valid in a child that has only the forking thread.
        unsafe { libc::pthread_atfork(None, None, Some(forked_child)) };
    });
}

/// An arena mapped in this process, with its geometry copied out of the header once.
pub(crate) struct Arena {
    /// Whether the receive cache knows this arena (set on its first send).
    pub(crate) cached: AtomicBool,
    /// The mapping, and this process's own description of the file: the creator's never
    /// leaves the process; a holder's carries its slot locks.
    seg: Segment,
    slot_size: usize,
    nslots: u32,
    creator: bool,
    generation: u64,
    state: Mutex<State>,
}

struct State {
    /// This process's handles (blocks) of each slot.
    local: Vec<u32>,
    /// The creator's: slots it has sent since it last saw them unlocked, which other
    /// processes may therefore hold.
    exposed: Vec<bool>,
    send: Option<SendHold>,
    /// A holder's slots with no handle left here, still locked until the next flush.
    pending: Vec<u32>,
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
    messages: u32,
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
        watch_forks();
        let n = nslots as usize;
        Arena {
            cached: AtomicBool::new(false),
            seg,
            slot_size,
            nslots,
            creator,
            generation: FORK_GENERATION.load(Ordering::Relaxed),
            state: Mutex::new(State {
                local: vec![0; n],
                exposed: if creator { vec![false; n] } else { Vec::new() },
                send: None,
                pending: Vec::new(),
                idle_since: None,
            }),
        }
    }

    /// Creates an arena of `nslots` slots of `slot_size` bytes.
    fn create(slot_size: usize, nslots: usize, strategy: SharingStrategy) -> Result<Arena> {
        let too_large = || Error::shape(format!("a shared storage of {slot_size} bytes is too large"));
        let len =
            slot_size.checked_mul(nslots).and_then(|d| d.checked_add(DATA_OFFSET)).ok_or_else(too_large)?;
        let n32 = u32::try_from(nslots).map_err(|_| too_large())?;
        let seg = Segment::create(len, strategy)?;
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

    /// Whether this arena object belongs to this process (not one inherited through fork).
    pub(crate) fn is_own(&self) -> bool {
        self.generation == FORK_GENERATION.load(Ordering::Relaxed)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
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

    /// The creator takes a slot nobody uses (no handle here, no lock anywhere).
    fn try_claim(&self, slot: u32) -> bool {
        let mut st = self.state();
        let i = slot as usize;
        if st.local[i] != 0 {
            return false;
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
            if matches!(range_free(fd, slot, run), Ok(true)) {
                let sent = st.send.as_ref().map(|s| &s.sent[i..i + run as usize]);
                for (j, e) in st.exposed[i..i + run as usize].iter_mut().enumerate() {
                    if !sent.is_some_and(|s| s[j]) {
                        *e = false;
                    }
                }
            } else if matches!(range_free(fd, slot, 1), Ok(true)) {
                st.exposed[i] = false;
            } else {
                return false;
            }
        }
        st.local[i] = 1;
        st.idle_since = None;
        true
    }

    /// One more handle of each of `slots` in this process (a slot may appear more than
    /// once). A holder's first handle of a slot takes the process's lock on it; locks are
    /// taken in runs of adjacent slots, and slots waiting to be given back are kept instead.
    pub(crate) fn hold(&self, slots: &[u32]) -> Result<()> {
        let mut st = self.state();
        if let Some(&bad) = slots.iter().find(|&&s| s >= self.nslots) {
            return Err(Error::invalid(format!("slot {bad} is outside an arena of {} slots", self.nslots)));
        }
        if !self.creator && self.is_own() {
            let mut need: Vec<u32> = Vec::new();
            for &slot in slots {
                if st.local[slot as usize] == 0 {
                    if let Some(p) = st.pending.iter().position(|&q| q == slot) {
                        st.pending.swap_remove(p);
                    } else {
                        need.push(slot);
                    }
                }
            }
            for (start, len) in runs(&mut need) {
                lock_range(self.seg.fd(), start, len, libc::F_RDLCK)
                    .map_err(|e| Error::io("locking received slots (F_OFD_SETLK)", e))?;
            }
        }
        for &slot in slots {
            let c = &mut st.local[slot as usize];
            *c = c.checked_add(1).ok_or_else(|| Error::invalid("too many handles of one slot"))?;
        }
        Ok(())
    }

    /// One handle of `slot` less; the last one gives the process's lock back (in a run with
    /// others: see `PENDING_SLOTS`).
    fn release(&self, slot: u32) {
        let mut st = self.state();
        let i = slot as usize;
        st.local[i] = st.local[i].saturating_sub(1);
        if st.local[i] == 0 && self.creator && self.nslots == 1 && self.is_own() {
            // A large storage of ours is freed: keep its arena for reuse only within bounds.
            st.idle_since = Some(std::time::Instant::now());
            drop(st);
            let strategy = if self.seg.name().is_some() {
                SharingStrategy::FileSystem
            } else {
                SharingStrategy::FileDescriptor
            };
            // Not if the allocator is busy (this very thread may be allocating): the next
            // allocation applies the bounds then.
            if let Ok(mut alloc) = allocator(strategy).try_lock() {
                retire_large(&mut alloc, None);
            }
            return;
        }
        if st.local[i] == 0 && !self.creator && self.is_own() {
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

    /// The description a message naming `slots` of this arena carries, with each slot
    /// locked on it. The caller holds a handle of each slot.
    pub(crate) fn send_hold(&self, slots: &[u32]) -> Result<Arc<OwnedFd>> {
        if !self.is_own() {
            return Err(Error::Unsupported(
                "a storage inherited through fork cannot be sent from the child; send it from the \
                 parent, or copy it"
                    .into(),
            ));
        }
        let mut st = self.state();
        if st.send.as_ref().is_some_and(|s| s.messages >= SEND_BATCH) {
            st.send = None;
        }
        if st.send.is_none() {
            let n = self.nslots as usize;
            st.send = Some(SendHold {
                fd: Arc::new(self.seg.reopen()?),
                locked: vec![false; n],
                sent: vec![false; n],
                messages: 0,
            });
        }
        let st = &mut *st;
        let send = st.send.as_mut().expect("set above");
        let mut need: Vec<u32> = slots.iter().copied().filter(|&s| !send.locked[s as usize]).collect();
        for (start, len) in runs(&mut need) {
            // The creator locks ahead: the slots after these are the ones it hands out next.
            let len = if self.creator { len.max(CHECK_RUN).min(self.nslots - start) } else { len };
            lock_range(send.fd.as_fd(), start, len, libc::F_RDLCK)
                .map_err(|e| Error::io("locking slots for a message (F_OFD_SETLK)", e))?;
            send.locked[start as usize..(start + len) as usize].fill(true);
        }
        for &slot in slots {
            send.sent[slot as usize] = true;
            if self.creator {
                st.exposed[slot as usize] = true;
            }
        }
        send.messages += 1;
        Ok(send.fd.clone())
    }

    /// Whether any slot is in use: by a handle here, or by a lock of another description.
    fn in_use(&self) -> bool {
        let mut st = self.state();
        st.send = None;
        st.local.iter().any(|&c| c != 0) || !matches!(range_free(self.seg.fd(), 0, self.nslots), Ok(true))
    }
}

/// One holder's claim on a slot: the storage's memory. Dropping it gives the claim back.
pub(crate) struct Slot {
    arena: Arc<Arena>,
    slot: u32,
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot").field("arena", self.arena.seg.id()).field("slot", &self.slot).finish()
    }
}

impl Slot {
    /// Handles of `slots` of a received arena, in order: this process now holds them.
    pub(crate) fn hold(arena: &Arc<Arena>, slots: &[u32]) -> Result<Vec<Slot>> {
        arena.hold(slots)?;
        Ok(slots.iter().map(|&slot| Slot { arena: arena.clone(), slot }).collect())
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

impl Drop for Slot {
    fn drop(&mut self) {
        self.arena.release(self.slot);
    }
}

fn flock(l_type: i32, start: u32, len: u32) -> libc::flock {
    // SAFETY: struct flock is plain data; all-zero is a valid value to fill in (l_pid must
    // be 0 for OFD locks).
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = l_type as i16;
    fl.l_whence = libc::SEEK_SET as i16;
    fl.l_start = start.into();
    fl.l_len = len.into();
    fl
}

/// Sorts and dedups `slots` and returns them as runs of adjacent slots: (first, count).
fn runs(slots: &mut Vec<u32>) -> Vec<(u32, u32)> {
    slots.sort_unstable();
    slots.dedup();
    let mut out: Vec<(u32, u32)> = Vec::new();
    for &s in slots.iter() {
        match out.last_mut() {
            Some((start, len)) if *start + *len == s => *len += 1,
            _ => out.push((s, 1)),
        }
    }
    out
}

/// Takes or gives back (`F_UNLCK`) a read lock on bytes `start..start + len` (slots) of
/// description `fd`.
///
/// rustix offers only whole-file locks; byte-range OFD locks need `fcntl` from libc.
fn lock_range(fd: BorrowedFd<'_>, start: u32, len: u32, l_type: i32) -> std::io::Result<()> {
    let fl = flock(l_type, start, len);
    // SAFETY: F_OFD_SETLK reads one valid, initialised struct flock through the pointer,
    // which lives across the call; `fd` is a valid descriptor.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_SETLK, &fl) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Whether slots `start..start + len` are free of every lock but those of `fd` itself.
fn range_free(fd: BorrowedFd<'_>, start: u32, len: u32) -> std::io::Result<bool> {
    let mut fl = flock(libc::F_WRLCK, start, len);
    // SAFETY: F_OFD_GETLK reads and writes one valid struct flock through the pointer, which
    // lives across the call; `fd` is a valid descriptor.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(fl.l_type == libc::F_UNLCK as i16)
}

/// Where this process's arenas are kept, one allocator per strategy.
struct Allocator {
    classes: Vec<ClassArenas>,
    large: Vec<Arc<Arena>>,
}

#[derive(Default)]
struct ClassArenas {
    arenas: Vec<Arc<Arena>>,
    /// Where the next search starts: (arena, slot). Slots tend to be freed in the order
    /// they were taken, so the slot after the last one taken is the likeliest free one.
    cursor: (usize, u32),
}

impl Allocator {
    fn new() -> Allocator {
        Allocator { classes: (0..CLASSES).map(|_| ClassArenas::default()).collect(), large: Vec::new() }
    }

    /// Forgets arenas inherited through fork: this process cannot hand their slots out.
    fn drop_inherited(&mut self) {
        for class in &mut self.classes {
            if class.arenas.iter().any(|a| !a.is_own()) {
                class.arenas.retain(|a| a.is_own());
                class.cursor = (0, 0);
            }
        }
        self.large.retain(|a| a.is_own());
    }
}

fn allocator(strategy: SharingStrategy) -> &'static Mutex<Allocator> {
    static FD: std::sync::OnceLock<Mutex<Allocator>> = std::sync::OnceLock::new();
    static FS: std::sync::OnceLock<Mutex<Allocator>> = std::sync::OnceLock::new();
    match strategy {
        SharingStrategy::FileDescriptor => FD.get_or_init(|| Mutex::new(Allocator::new())),
        SharingStrategy::FileSystem => FS.get_or_init(|| {
            // Named arenas outlive the allocator's Rust values (statics are never dropped),
            // so their files are removed when the process exits normally. Processes that
            // hold them keep their memory through their descriptors.
            OWNER.store(rustix::process::getpid().as_raw_nonzero().get(), Ordering::Relaxed);
            // SAFETY: registers a plain `extern "C" fn()` that touches only this module's
            // statics; atexit has no other contract.
            unsafe { libc::atexit(unlink_named_at_exit) };
            Mutex::new(Allocator::new())
        }),
    }
}

/// Holds every allocator lock (see `process::atfork`).
pub(crate) fn fork_guards(out: &mut Vec<Box<dyn std::any::Any>>) {
    for s in [SharingStrategy::FileDescriptor, SharingStrategy::FileSystem] {
        out.push(Box::new(lock(allocator(s))));
    }
}

/// The process whose named arenas the allocator holds (a forked child inherits the
/// allocator but must not remove its parent's files).
static OWNER: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

extern "C" fn unlink_named_at_exit() {
    if OWNER.load(Ordering::Relaxed) != rustix::process::getpid().as_raw_nonzero().get() {
        return;
    }
    // Another thread may hold the lock while the process exits: then leave the files to the
    // group's cleaner rather than deadlock in exit.
    let Ok(alloc) = allocator(SharingStrategy::FileSystem).try_lock() else { return };
    for arena in alloc.classes.iter().flat_map(|c| c.arenas.iter()).chain(alloc.large.iter()) {
        if let Some(name) = arena.seg.name() {
            crate::shm::unlink_name(name);
        }
    }
}

/// Allocates a slot of at least `len` bytes (`len > 0`) under `strategy`. The contents
/// are unspecified: zero in a new arena, old bytes in a reused slot.
pub(crate) fn allocate(len: usize, strategy: SharingStrategy) -> Result<Slot> {
    debug_assert!(len > 0);
    let mut alloc = lock(allocator(strategy));
    alloc.drop_inherited();
    if len > 1 << MAX_SLOT_SHIFT {
        return allocate_large(&mut alloc, len, strategy);
    }
    let shift = len.next_power_of_two().trailing_zeros().max(MIN_SLOT_SHIFT);
    let class = &mut alloc.classes[(shift - MIN_SLOT_SHIFT) as usize];
    let n = class.arenas.len();
    let (start_arena, start_slot) = class.cursor;
    // Search every arena once, starting at the cursor, wrapping around.
    for i in 0..n {
        let ai = (start_arena + i) % n;
        let arena = &class.arenas[ai];
        let first = if i == 0 { start_slot.min(arena.nslots) } else { 0 };
        for s in (first..arena.nslots).chain(0..first) {
            if arena.try_claim(s) {
                class.cursor = (ai, s + 1);
                return Ok(Slot { arena: arena.clone(), slot: s });
            }
        }
    }
    let slot_size = 1usize << shift;
    let data = FIRST_ARENA_DATA.checked_shl(n.min(16) as u32).unwrap_or(ARENA_DATA).min(ARENA_DATA);
    let nslots = (data / slot_size).clamp(1, MAX_SLOTS);
    let arena = Arc::new(Arena::create(slot_size, nslots, strategy)?);
    let claimed = arena.try_claim(0);
    debug_assert!(claimed);
    class.arenas.push(arena.clone());
    class.cursor = (class.arenas.len() - 1, 1);
    Ok(Slot { arena, slot: 0 })
}

fn allocate_large(alloc: &mut Allocator, len: usize, strategy: SharingStrategy) -> Result<Slot> {
    let want = len
        .checked_next_multiple_of(PAGE)
        .filter(|&w| w <= isize::MAX as usize)
        .ok_or_else(|| Error::shape(format!("a shared storage of {len} bytes is too large")))?;
    // Reuse a free arena that is big enough but not wastefully big, smallest first.
    let mut fits: Vec<usize> = (0..alloc.large.len())
        .filter(|&i| {
            let a = &alloc.large[i];
            a.slot_size >= want && a.slot_size / 2 <= want
        })
        .collect();
    fits.sort_by_key(|&i| alloc.large[i].slot_size);
    for i in fits {
        if alloc.large[i].try_claim(0) {
            let arena = alloc.large.remove(i);
            alloc.large.push(arena.clone()); // most recently used last
            return Ok(Slot { arena, slot: 0 });
        }
    }
    retire_large(alloc, Some(want));
    let arena = Arc::new(Arena::create(want, 1, strategy)?);
    let claimed = arena.try_claim(0);
    debug_assert!(claimed);
    alloc.large.push(arena.clone());
    Ok(Slot { arena, slot: 0 })
}

/// Lets go of free one-slot arenas beyond the bounds of `LARGE_RETAIN`, oldest first,
/// counting `coming` bytes about to be made.
fn retire_large(alloc: &mut Allocator, coming: Option<usize>) {
    let now = std::time::Instant::now();
    let mut free_bytes = coming.unwrap_or(0);
    let mut free_count = usize::from(coming.is_some());
    // Newest first: the most recently used are the ones worth keeping.
    let mut keep = vec![true; alloc.large.len()];
    for (i, a) in alloc.large.iter().enumerate().rev() {
        let idle = a.state().idle_since;
        let Some(since) = idle else { continue }; // a handle here uses it
        if a.in_use() {
            continue; // another process still holds it
        }
        free_bytes += a.slot_size;
        free_count += 1;
        if a.slot_size > LARGE_RETAIN
            || free_bytes > LARGE_RETAIN
            || free_count > LARGE_RETAIN_COUNT
            || now.duration_since(since) > LARGE_IDLE
        {
            keep[i] = false;
        }
    }
    let mut k = keep.into_iter();
    alloc.large.retain(|_| k.next().unwrap_or(true));
}

/// Lets go of every arena of this process whose slots are all free (their memory is
/// returned once no other process maps them). Returns how many were let go.
pub(crate) fn trim() -> usize {
    let mut n = 0;
    for strategy in [SharingStrategy::FileDescriptor, SharingStrategy::FileSystem] {
        let mut alloc = lock(allocator(strategy));
        alloc.drop_inherited();
        for class in &mut alloc.classes {
            let before = class.arenas.len();
            class.arenas.retain(|a| a.in_use());
            n += before - class.arenas.len();
            class.cursor = (0, 0);
        }
        let before = alloc.large.len();
        alloc.large.retain(|a| a.in_use());
        n += before - alloc.large.len();
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let message = arena.send_hold(&[0]).unwrap();
        let other = arena.seg.reopen().unwrap();
        lock_range(other.as_fd(), 0, 1, libc::F_RDLCK).unwrap();
        drop(message);
        drop(a);
        let b = allocate(len, SharingStrategy::FileDescriptor).unwrap();
        assert!(!Arc::ptr_eq(&b.arena, &arena), "a slot another description holds was handed out");
        drop(b);
        drop(other); // the holder is gone: its lock with it
        let c = allocate(len, SharingStrategy::FileDescriptor).unwrap();
        assert!(Arc::ptr_eq(&c.arena, &arena), "the slot is free again once its holder is gone");
    }

    #[test]
    fn a_sent_slot_stays_held_by_the_send_description_until_it_is_retired() {
        let len = (31 << 20) + 7;
        let a = allocate(len, SharingStrategy::FileDescriptor).unwrap();
        let arena = a.arena.clone();
        let message = arena.send_hold(&[0]).unwrap(); // a message in flight carries this
        drop(a);
        let b = allocate(len, SharingStrategy::FileDescriptor).unwrap();
        assert!(!Arc::ptr_eq(&b.arena, &arena), "a slot a message in flight holds was handed out");
        drop(b);
        drop(message); // consumed: only the sender's retired description was left
        let c = allocate(len, SharingStrategy::FileDescriptor).unwrap();
        assert!(Arc::ptr_eq(&c.arena, &arena), "the slot comes back once the message is gone");
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
}
