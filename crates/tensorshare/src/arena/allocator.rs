//! This process's arenas and how their slots are handed out: size classes of growing
//! arenas, one-slot arenas for large storages kept for reuse within bounds, and trimming.

use std::sync::{Arc, Mutex};

use super::{Arena, Slot, MAX_SLOTS, PAGE};
use crate::util::lock;
use crate::util::Lazy;
use crate::{Error, Result, SharingStrategy};

/// Smallest slot: 64 bytes, so every storage is 64-byte aligned.
const MIN_SLOT_SHIFT: u32 = 6;
/// Largest pooled slot: 4 MiB. Larger storages get an arena of one slot.
const MAX_SLOT_SHIFT: u32 = 22;
/// The largest size class's slot: larger storages get an arena of their own.
pub(crate) const LARGEST_CLASS: usize = 1 << MAX_SLOT_SHIFT;
const CLASSES: usize = (MAX_SLOT_SHIFT - MIN_SLOT_SHIFT + 1) as usize;
/// Bytes of data in a class's first arena, doubled for each further one up to
/// `ARENA_DATA` (and at least one slot): a few small tensors of many sizes then fit in a
/// container's 64 MiB /dev/shm, while a program that makes many gets large arenas soon.
const FIRST_ARENA_DATA: usize = 256 << 10;
/// Bytes of data in a pooled arena, at most.
const ARENA_DATA: usize = 8 << 20;
/// Free one-slot arenas kept for reuse (so that a large tensor made again and again finds
/// warm pages): at most `LARGE_RETAIN_TOTAL` bytes and `LARGE_RETAIN_COUNT` arenas, none
/// larger than `LARGE_RETAIN`, and none idle for longer than `LARGE_IDLE` at the next
/// allocation or release of a large storage. Anything else goes back to the system when it
/// is freed (a dropped weight tensor of 500 MB at once).
const LARGE_RETAIN: usize = 256 << 20;
const LARGE_RETAIN_TOTAL: usize = 1 << 30;
const LARGE_RETAIN_COUNT: usize = 8;
const LARGE_IDLE: std::time::Duration = std::time::Duration::from_secs(5);

/// Where this process's arenas are kept, one allocator per strategy.
struct Allocator {
    classes: Vec<ClassArenas>,
    large: Vec<Arc<Arena>>,
    /// The size of the filesystem its arenas take room in, where that is bounded (see
    /// `ROOM_ARENA`); `None` for memfds.
    room: Option<usize>,
}

#[derive(Default)]
struct ClassArenas {
    arenas: Vec<Arc<Arena>>,
    /// Where the next search starts: (arena, slot). Slots tend to be freed in the order
    /// they were taken, so the slot after the last one taken is the likeliest free one.
    cursor: (usize, u32),
}

impl Allocator {
    fn new(room: Option<usize>) -> Allocator {
        Allocator { classes: (0..CLASSES).map(|_| ClassArenas::default()).collect(), large: Vec::new(), room }
    }

    fn arenas(&self) -> impl Iterator<Item = &Arc<Arena>> {
        self.classes.iter().flat_map(|c| c.arenas.iter()).chain(self.large.iter())
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

static FD: Lazy<Mutex<Allocator>> = Lazy::new();
static FS: Lazy<Mutex<Allocator>> = Lazy::new();

// Neither allocator is locked while the other is held.
crate::util::fork::guard_at_load!(crate::util::fork::Rank::Allocator, |out| {
    for strategy in [SharingStrategy::FileDescriptor, SharingStrategy::FileSystem] {
        out.push(Box::new(lock(allocator(strategy))))
    }
});

fn allocator(strategy: SharingStrategy) -> &'static Mutex<Allocator> {
    match strategy {
        SharingStrategy::FileDescriptor => FD.get_or_make(|| Mutex::new(Allocator::new(None))),
        SharingStrategy::FileSystem => {
            FS.get_or_make(|| Mutex::new(Allocator::new(crate::shm::named_room())))
        }
    }
}

/// Named arenas outlive the allocator's Rust values (statics are never dropped), so their
/// files are removed when the process exits normally (a forked worker, which leaves without
/// exit handlers, does it itself: `unlink_own_names`). Processes that hold them keep their
/// memory through their descriptors. Registered as the library loads, not when the first
/// named arena is made: making the allocator must have no effect beyond its value (`Lazy`).
#[used]
#[link_section = ".init_array"]
static UNLINK_AT_EXIT: extern "C" fn() = unlink_at_exit;

extern "C" fn unlink_at_exit() {
    // SAFETY: registers a plain `extern "C" fn()` that touches only this module's statics
    // (and does nothing where no named arena was made); atexit has no other contract.
    unsafe { libc::atexit(unlink_named_at_exit) };
}

extern "C" fn unlink_named_at_exit() {
    unlink_own_names();
}

/// Removes the names of the named arenas this process made (not those a forked child
/// inherited from its parent, which the parent still uses): whoever holds one keeps its
/// memory through a descriptor, and nobody opens one by name. For a process on its way
/// out; a worker forked from its parent calls it itself, as it leaves without exit handlers.
pub(crate) fn unlink_own_names() {
    let me = rustix::process::getpid().as_raw_nonzero().get();
    // Not made (no named arena here): nothing to do. Another thread may hold the lock while
    // the process exits: then leave the files to the group's cleaner rather than deadlock
    // in exit.
    let Some(Ok(alloc)) = FS.get().map(Mutex::try_lock) else { return };
    for arena in alloc.arenas() {
        if let Some(name) = arena.seg.name() {
            if crate::shm::parse_name(name).is_some_and(|(_, creator)| creator == me) {
                crate::shm::unlink_name(name);
            }
        }
    }
}

/// Allocates a slot of at least `len` bytes (`len > 0`) under `strategy`. The contents
/// are unspecified: zero in a new arena, old bytes in a reused slot.
pub(crate) fn allocate(len: usize, strategy: SharingStrategy) -> Result<Slot> {
    debug_assert!(len > 0);
    // Descriptors of received messages kept for later may hold our own slots: let them go.
    super::borrow::close_let_go();
    if strategy == SharingStrategy::FileSystem {
        // Named arenas belong to the cleanup group: found it (which starts its cleaner, a
        // fork) before the allocator is locked. A fork while a lock that every fork takes is
        // held stalls other threads' forks, and on glibc before 2.36, which keeps its own
        // fork lock through the handlers, deadlocks with them.
        crate::shm::group::ensure()?;
    }
    allocate_locked(&mut lock(allocator(strategy)), len, strategy)
}

/// [`allocate`], or `None` where it would wait: the allocator busy in another thread (which
/// may be making a large arena), or, for a named arena, no cleanup group founded yet (which
/// starts a process). For a caller that holds what other threads need (Python's GIL) and
/// lets go of it only to wait.
pub(crate) fn allocate_now(len: usize, strategy: SharingStrategy) -> Result<Option<Slot>> {
    debug_assert!(len > 0);
    if strategy == SharingStrategy::FileSystem && crate::shm::group::current().is_none() {
        return Ok(None);
    }
    super::borrow::close_let_go();
    let mut alloc = match allocator(strategy).try_lock() {
        Ok(alloc) => alloc,
        // As `util::lock` does: every structure behind it stays valid at each step.
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => return Ok(None),
    };
    allocate_locked(&mut alloc, len, strategy).map(Some)
}

fn allocate_locked(alloc: &mut Allocator, len: usize, strategy: SharingStrategy) -> Result<Slot> {
    alloc.drop_inherited();
    if len > 1 << MAX_SLOT_SHIFT {
        return allocate_large(alloc, len, strategy);
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
        // From the cursor to the end, then from the start to the cursor.
        for (from, to) in [(first, arena.nslots), (0, first)] {
            let mut s = from;
            while s < to {
                match arena.try_claim(s) {
                    Ok(()) => {
                        class.cursor = (ai, s + 1);
                        return Ok(Slot { arena: arena.clone(), slot: s });
                    }
                    Err(next) => s = next,
                }
            }
        }
    }
    let slot_size = 1usize << shift;
    let most = alloc.room.map_or(ARENA_DATA, |room| ARENA_DATA.min(room / ROOM_ARENA));
    let data = FIRST_ARENA_DATA.checked_shl(n.min(16) as u32).unwrap_or(ARENA_DATA).min(most);
    let nslots = (data / slot_size).clamp(1, MAX_SLOTS);
    keep_within_room(alloc, slot_size.saturating_mul(nslots), true);
    let arena = super::listed(create_making_room(alloc, slot_size, nslots, strategy)?);
    let claimed = arena.try_claim(0).is_ok();
    debug_assert!(claimed);
    let class = &mut alloc.classes[(shift - MIN_SLOT_SHIFT) as usize];
    class.arenas.push(arena.clone());
    class.cursor = (class.arenas.len() - 1, 1);
    Ok(Slot { arena, slot: 0 })
}

/// A new arena; when shared memory has no room for it, once more after letting go of this
/// allocator's free arenas (those of other size classes, and the large ones kept for
/// reuse), whose room a program that shared and dropped tensors of other sizes would
/// otherwise never get back.
fn create_making_room(
    alloc: &mut Allocator,
    slot_size: usize,
    nslots: usize,
    strategy: SharingStrategy,
) -> Result<Arena> {
    match Arena::create(slot_size, nslots, strategy) {
        Err(Error::OutOfSharedMemory { .. }) if trim_locked(alloc) > 0 => {
            Arena::create(slot_size, nslots, strategy)
        }
        made => made,
    }
}

fn allocate_large(alloc: &mut Allocator, len: usize, strategy: SharingStrategy) -> Result<Slot> {
    let want = len.checked_next_multiple_of(PAGE).filter(|&w| w <= isize::MAX as usize).ok_or_else(|| {
        Error::invalid_argument("storage size", format!("a shared storage of {len} bytes is too large"))
    })?;
    // Reuse a free arena that is big enough but not wastefully big, smallest first.
    let mut fits: Vec<usize> = (0..alloc.large.len())
        .filter(|&i| {
            let a = &alloc.large[i];
            a.slot_size >= want && a.slot_size / 2 <= want
        })
        .collect();
    fits.sort_by_key(|&i| alloc.large[i].slot_size);
    for i in fits {
        if alloc.large[i].try_claim(0).is_ok() {
            let arena = alloc.large.remove(i);
            alloc.large.push(arena.clone()); // most recently used last
            return Ok(Slot { arena, slot: 0 });
        }
    }
    retire_large(alloc, Some(want));
    keep_within_room(alloc, want, true);
    let arena = super::listed(create_making_room(alloc, want, 1, strategy)?);
    let claimed = arena.try_claim(0).is_ok();
    debug_assert!(claimed);
    alloc.large.push(arena.clone());
    Ok(Slot { arena, slot: 0 })
}

/// A large arena of this process, or a slot of a named one, lost its last handle here:
/// applies the bounds now (`LARGE_RETAIN`, `ROOM_FREE`), unless the allocator is busy (this
/// very thread may be allocating), when the next arena made or slot freed here applies them.
pub(super) fn freed_here(strategy: SharingStrategy) {
    if let Ok(mut alloc) = allocator(strategy).try_lock() {
        // Inherited arenas' states may be locked for good in a forked child.
        alloc.drop_inherited();
        retire_large(&mut alloc, None);
        keep_within_room(&mut alloc, 0, false);
    }
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
            || free_bytes > LARGE_RETAIN_TOTAL
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
    [SharingStrategy::FileDescriptor, SharingStrategy::FileSystem]
        .into_iter()
        .map(|strategy| trim_locked(&mut lock(allocator(strategy))))
        .sum()
}

/// [`trim`] of one allocator, locked by the caller.
fn trim_locked(alloc: &mut Allocator) -> usize {
    let mut n = 0;
    alloc.drop_inherited();
    for class in &mut alloc.classes {
        let before = class.arenas.len();
        class.arenas.retain(|a| a.in_use());
        n += before - class.arenas.len();
        class.cursor = (0, 0);
    }
    let before = alloc.large.len();
    alloc.large.retain(|a| a.in_use());
    n + before - alloc.large.len()
}

#[path = "room.rs"]
mod room;
pub(super) use room::named_busy;
use room::{keep_within_room, ROOM_ARENA};
#[cfg(test)]
use room::{SlotUse, ROOM_FREE};

#[cfg(test)]
#[path = "allocator_tests.rs"]
mod tests;
