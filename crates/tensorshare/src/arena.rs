//! Arenas: large shared segments cut into equal slots, one storage per slot.
//!
//! Each slot has a holder count in the arena's header, in the shared memory itself, so
//! every process sees the same count: one per process that holds the slot's storage, plus
//! one per message in flight that names it. The process that made the arena hands a slot
//! out again once its count is back to zero, so its pages stay mapped and warm, and a
//! message carries one descriptor per arena, not one per tensor.
//!
//! Header layout (little-endian, native atomics):
//! `[0..8) magic | [8..16) slot size | [16..20) slot count | [20..24) reserved |
//! [24..28) owner gone | [28..32) unlinked | [32..64) reserved | [64..64+4n) holder counts |
//! page-aligned data`.
//!
//! A named arena (file_system) must outlive its creator while messages or other processes
//! hold its slots: at exit the creator only marks it "owner gone", and whichever process
//! brings the last slot count to zero afterwards removes its file.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use crate::shm::Segment;
use crate::{Error, Result, SharingStrategy};

const MAGIC: u64 = u64::from_le_bytes(*b"TSARENA1");
const HEADER: usize = 64;
const OWNER_GONE: usize = 24;
const UNLINKED: usize = 28;
const PAGE: usize = 4096;
/// Smallest slot: 64 bytes, so every storage is 64-byte aligned.
const MIN_SLOT_SHIFT: u32 = 6;
/// Largest pooled slot: 4 MiB. Larger storages get an arena of one slot.
const MAX_SLOT_SHIFT: u32 = 22;
const CLASSES: usize = (MAX_SLOT_SHIFT - MIN_SLOT_SHIFT + 1) as usize;
/// Bytes of data in a pooled arena (more for the largest classes: at least 4 slots).
const ARENA_DATA: usize = 8 << 20;
const MAX_SLOTS: usize = 8192;
/// Free one-slot arenas kept for reuse, in bytes, before the oldest are let go.
const LARGE_RETAIN: usize = 1 << 30;

/// An arena mapped in this process, with its geometry copied out of the header once (the
/// header lives in memory other processes can write; bounds never depend on it later).
pub(crate) struct Arena {
    /// Whether the receive cache knows this arena (set on its first send).
    pub(crate) cached: std::sync::atomic::AtomicBool,
    seg: Segment,
    slot_size: usize,
    nslots: u32,
    data_offset: usize,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("segment", self.seg.id())
            .field("slot_size", &self.slot_size)
            .field("nslots", &self.nslots)
            .finish()
    }
}

fn data_offset(nslots: usize) -> usize {
    (HEADER + 4 * nslots).div_ceil(PAGE) * PAGE
}

impl Arena {
    /// Creates an arena of `nslots` slots of `slot_size` bytes.
    fn create(slot_size: usize, nslots: usize, strategy: SharingStrategy) -> Result<Arena> {
        let off = data_offset(nslots);
        let len = slot_size
            .checked_mul(nslots)
            .and_then(|d| d.checked_add(off))
            .ok_or_else(|| Error::shape(format!("a shared storage of {slot_size} bytes is too large")))?;
        let seg = Segment::create(len, strategy)?;
        // SAFETY: the segment is at least HEADER bytes, page-aligned, and nobody else has
        // seen it yet; the fields are written before the arena is shared.
        unsafe {
            let p = seg.as_ptr();
            p.cast::<u64>().write(MAGIC);
            p.add(8).cast::<u64>().write(slot_size as u64);
            p.add(16).cast::<u32>().write(nslots as u32);
        }
        Ok(Arena { cached: Default::default(), seg, slot_size, nslots: nslots as u32, data_offset: off })
    }

    /// Checks and adopts a segment received from another process as an arena.
    pub(crate) fn open(seg: Segment) -> Result<Arena> {
        if seg.len() < HEADER {
            return Err(Error::invalid("a received segment is too small to be an arena"));
        }
        // SAFETY: the mapping is at least HEADER bytes and page-aligned; these reads may race
        // with writes from a misbehaving peer, so they are volatile and their values are
        // only trusted after the checks below.
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
        let off = data_offset(nslots as usize);
        let end = slot_size.checked_mul(nslots as usize).and_then(|d| d.checked_add(off));
        match end {
            Some(end) if nslots > 0 && slot_size > 0 && end <= seg.len() => {}
            _ => {
                return Err(Error::invalid(format!(
                    "arena header ({nslots} slots of {slot_size} bytes) does not fit its segment of {} bytes",
                    seg.len()
                )))
            }
        }
        Ok(Arena { cached: Default::default(), seg, slot_size, nslots, data_offset: off })
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

    fn count(&self, slot: u32) -> &AtomicU32 {
        debug_assert!(slot < self.nslots);
        // SAFETY: slot < nslots, so the counter lies in the header area of our mapping,
        // 4-byte aligned (HEADER is a multiple of 4 and the mapping is page-aligned); the
        // mapping lives as long as `self`. AtomicU32 has the layout of u32.
        unsafe { &*self.seg.as_ptr().add(HEADER + 4 * slot as usize).cast::<AtomicU32>() }
    }

    /// Address of a slot's first byte.
    pub(crate) fn slot_ptr(&self, slot: u32) -> *mut u8 {
        assert!(slot < self.nslots);
        // SAFETY: `open`/`create` checked data_offset + nslots * slot_size <= len.
        unsafe { self.seg.as_ptr().add(self.data_offset + slot as usize * self.slot_size) }
    }

    /// Takes a free slot (count 0 → 1).
    fn try_claim(&self, slot: u32) -> bool {
        self.count(slot).compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed).is_ok()
    }

    /// One more holder (a message about to be sent).
    pub(crate) fn retain(&self, slot: u32) {
        self.count(slot).fetch_add(1, Ordering::Relaxed);
    }

    /// One holder less. Saturates at zero: a count that a misbehaving peer broke must not
    /// wrap around and pin the slot for good.
    pub(crate) fn release(&self, slot: u32) {
        let prev = self.count(slot).fetch_update(Ordering::Release, Ordering::Relaxed, |c| c.checked_sub(1));
        if prev == Ok(1) && self.seg.name().is_some() && self.word(OWNER_GONE).load(Ordering::Acquire) != 0 {
            self.unlink_if_unused();
        }
    }

    fn word(&self, offset: usize) -> &AtomicU32 {
        // SAFETY: OWNER_GONE and UNLINKED are 4-byte aligned offsets inside the header of a
        // mapping of at least HEADER bytes that lives as long as self.
        unsafe { &*self.seg.as_ptr().add(offset).cast::<AtomicU32>() }
    }

    /// Removes a named arena's file once its creator is gone and no slot is held.
    fn unlink_if_unused(&self) {
        if (0..self.nslots).all(|s| self.holders(s) == 0)
            && self.word(UNLINKED).compare_exchange(0, 1, Ordering::AcqRel, Ordering::Relaxed).is_ok()
        {
            if let Some(name) = self.seg.name() {
                crate::shm::unlink_name(name);
            }
        }
    }

    /// The creator is leaving: the file goes now if nothing is held, else with the last
    /// holder.
    fn orphan(&self) {
        self.word(OWNER_GONE).store(1, Ordering::Release);
        self.unlink_if_unused();
    }

    /// The current holder count (for tests and tools).
    pub(crate) fn holders(&self, slot: u32) -> u32 {
        self.count(slot).load(Ordering::Acquire)
    }
}

/// One holder's claim on a slot: the storage's memory. Dropping it releases the slot.
pub(crate) struct Block {
    arena: Arc<Arena>,
    slot: u32,
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Block").field("arena", self.arena.seg.id()).field("slot", &self.slot).finish()
    }
}

impl Block {
    /// Takes over a holder count that a message carried (the sender added it).
    pub(crate) fn adopt(arena: Arc<Arena>, slot: u32) -> Result<Block> {
        if slot >= arena.nslots {
            return Err(Error::invalid(format!("slot {slot} is outside an arena of {} slots", arena.nslots)));
        }
        Ok(Block { arena, slot })
    }

    pub(crate) fn arena(&self) -> &Arc<Arena> {
        &self.arena
    }

    pub(crate) fn slot(&self) -> u32 {
        self.slot
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.arena.slot_ptr(self.slot)
    }

    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.arena.slot_size
    }

    /// Gives up this claim without releasing it: the caller now owns one holder count of
    /// the slot (a message in flight takes it over).
    pub(crate) fn into_raw(self) -> (Arc<Arena>, u32) {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped, so the Arc is moved out exactly once.
        (unsafe { std::ptr::read(&this.arena) }, this.slot)
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        self.arena.release(self.slot);
    }
}

/// Where this process's arenas are kept, one pool per strategy.
struct Pool {
    classes: Vec<ClassPool>,
    large: Vec<Arc<Arena>>,
}

#[derive(Default)]
struct ClassPool {
    arenas: Vec<Arc<Arena>>,
    /// Where the next search starts: (arena, slot). Blocks tend to be freed in the order
    /// they were taken, so the slot after the last one taken is the likeliest free one.
    cursor: (usize, u32),
}

impl Pool {
    fn new() -> Pool {
        Pool { classes: (0..CLASSES).map(|_| ClassPool::default()).collect(), large: Vec::new() }
    }
}

fn pool(strategy: SharingStrategy) -> &'static Mutex<Pool> {
    static FD: std::sync::OnceLock<Mutex<Pool>> = std::sync::OnceLock::new();
    static FS: std::sync::OnceLock<Mutex<Pool>> = std::sync::OnceLock::new();
    match strategy {
        SharingStrategy::FileDescriptor => FD.get_or_init(|| Mutex::new(Pool::new())),
        SharingStrategy::FileSystem => FS.get_or_init(|| {
            // Named arenas outlive the pool's Rust values (statics are never dropped), so
            // their files are removed when the process exits normally.
            OWNER.store(rustix::process::getpid().as_raw_nonzero().get(), Ordering::Relaxed);
            // SAFETY: registers a plain `extern "C" fn()` that touches only this module's
            // statics; atexit has no other contract.
            unsafe { libc::atexit(unlink_named_at_exit) };
            Mutex::new(Pool::new())
        }),
    }
}

/// Holds every pool lock (see `process::atfork`).
pub(crate) fn fork_guards(out: &mut Vec<Box<dyn std::any::Any>>) {
    for s in [SharingStrategy::FileDescriptor, SharingStrategy::FileSystem] {
        out.push(Box::new(pool(s).lock().unwrap_or_else(|p| p.into_inner())));
    }
}

/// The process whose named arenas the pool holds (a forked child inherits the pool but
/// must not remove its parent's files).
static OWNER: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

extern "C" fn unlink_named_at_exit() {
    if OWNER.load(Ordering::Relaxed) != rustix::process::getpid().as_raw_nonzero().get() {
        return;
    }
    // Another thread may hold the lock while the process exits: then leave the files rather
    // than deadlock in exit.
    let Ok(pool) = pool(SharingStrategy::FileSystem).try_lock() else { return };
    for arena in pool.classes.iter().flat_map(|c| c.arenas.iter()).chain(pool.large.iter()) {
        arena.orphan();
    }
}

/// Allocates a block of at least `len` bytes (`len > 0`) under `strategy`. The contents
/// are unspecified: zero in a new arena, old bytes in a reused slot.
pub(crate) fn allocate(len: usize, strategy: SharingStrategy) -> Result<Block> {
    debug_assert!(len > 0);
    let mut pool = pool(strategy).lock().unwrap_or_else(|p| p.into_inner());
    if len > 1 << MAX_SLOT_SHIFT {
        return allocate_large(&mut pool, len, strategy);
    }
    let shift = len.next_power_of_two().trailing_zeros().max(MIN_SLOT_SHIFT);
    let class = &mut pool.classes[(shift - MIN_SLOT_SHIFT) as usize];
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
                return Ok(Block { arena: arena.clone(), slot: s });
            }
        }
    }
    let slot_size = 1usize << shift;
    let nslots = (ARENA_DATA / slot_size).clamp(4, MAX_SLOTS);
    let arena = Arc::new(Arena::create(slot_size, nslots, strategy)?);
    let claimed = arena.try_claim(0);
    debug_assert!(claimed);
    class.arenas.push(arena.clone());
    class.cursor = (class.arenas.len() - 1, 1);
    Ok(Block { arena, slot: 0 })
}

fn allocate_large(pool: &mut Pool, len: usize, strategy: SharingStrategy) -> Result<Block> {
    // Rounded up to whole pages; a length near usize::MAX must be an error, not a wrapped
    // tiny size behind a huge storage length.
    let want = len
        .checked_next_multiple_of(PAGE)
        .filter(|&w| w <= isize::MAX as usize)
        .ok_or_else(|| Error::shape(format!("a shared storage of {len} bytes is too large")))?;
    // Reuse a free arena that is big enough but not wastefully big.
    let mut best: Option<usize> = None;
    for (i, a) in pool.large.iter().enumerate() {
        let fits = a.slot_size >= want && a.slot_size / 2 <= want && a.holders(0) == 0;
        if fits && best.is_none_or(|b| pool.large[b].slot_size > a.slot_size) {
            best = Some(i);
        }
    }
    if let Some(i) = best {
        if pool.large[i].try_claim(0) {
            let arena = pool.large.remove(i);
            pool.large.push(arena.clone()); // most recently used last
            return Ok(Block { arena, slot: 0 });
        }
    }
    // Let go of the oldest free arenas beyond the retention bound.
    let mut free_bytes: usize = pool.large.iter().filter(|a| a.holders(0) == 0).map(|a| a.slot_size).sum();
    let mut i = 0;
    while free_bytes > LARGE_RETAIN && i < pool.large.len() {
        if pool.large[i].holders(0) == 0 {
            free_bytes -= pool.large[i].slot_size;
            pool.large.remove(i);
        } else {
            i += 1;
        }
    }
    let arena = Arc::new(Arena::create(want, 1, strategy)?);
    let claimed = arena.try_claim(0);
    debug_assert!(claimed);
    pool.large.push(arena.clone());
    Ok(Block { arena, slot: 0 })
}

/// Lets go of every arena of this process whose slots are all free (their memory is
/// returned once no other process maps them). Returns how many were let go.
pub fn trim() -> usize {
    // Arenas the receive cache keeps mapped for speed go too.
    crate::wire::release_cached_mappings();
    let mut n = 0;
    for strategy in [SharingStrategy::FileDescriptor, SharingStrategy::FileSystem] {
        let mut pool = pool(strategy).lock().unwrap_or_else(|p| p.into_inner());
        let all_free = |a: &Arc<Arena>| (0..a.nslots).all(|s| a.holders(s) == 0);
        for class in &mut pool.classes {
            let before = class.arenas.len();
            class.arenas.retain(|a| !all_free(a));
            n += before - class.arenas.len();
            class.cursor = (0, 0);
        }
        let before = pool.large.len();
        pool.large.retain(|a| !all_free(a));
        n += before - pool.large.len();
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_blocks_are_reused() {
        let a = allocate(1000, SharingStrategy::FileDescriptor).unwrap();
        let (arena, slot) = (a.arena.clone(), a.slot);
        assert_eq!(arena.holders(slot), 1);
        assert_eq!(a.capacity(), 1024);
        drop(a);
        assert_eq!(arena.holders(slot), 0);
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
    fn large_blocks_have_their_own_arena_and_are_reused() {
        // A size no other test of this process asks for, so that the arena we free is the
        // only one that fits.
        let len = (37 << 20) + 3;
        let a = allocate(len, SharingStrategy::FileDescriptor).unwrap();
        assert_eq!(a.arena.nslots(), 1);
        assert!(a.capacity() >= len);
        let id = a.arena.segment().id().clone();
        drop(a);
        let b = allocate(len, SharingStrategy::FileDescriptor).unwrap();
        assert_eq!(b.arena.segment().id(), &id, "the freed large arena was not reused");
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
        // SAFETY: test-only write of the slot count in our own fresh arena.
        unsafe { arena.seg.as_ptr().add(16).cast::<u32>().write(1 << 20) };
        let err = Arena::open(arena.seg).unwrap_err();
        assert!(err.to_string().contains("does not fit"), "{err}");
    }
}
