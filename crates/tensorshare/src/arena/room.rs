//! The room named arenas take in a filesystem of bounded size (see `ROOM_ARENA`): how
//! large a pooled arena may be there, and which arenas a process lets go to keep to its
//! share.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::{Allocator, Arena};

/// Named arenas (file_system) take room in a filesystem that every process shares and
/// that may be small (a container's 64 MiB /dev/shm), where room a process keeps for reuse
/// is room another cannot have. Where that filesystem has a size, a process's named pooled
/// arenas hold at most `room / ROOM_ARENA` bytes of data each (free slots of one size class
/// cannot serve another), and once its arenas take more than `room / ROOM_BUSY` in all, it
/// lets arenas go as `keep_within_room` says, keeping at most `room / ROOM_FREE` bytes of
/// free ones (their room returns once no other process maps them: see the receive cache).
pub(super) const ROOM_ARENA: usize = 64;
const ROOM_BUSY: usize = 8;
pub(super) const ROOM_FREE: usize = 16;

/// Who may use an arena's slots, as its creator knows without asking the kernel.
pub(super) enum SlotUse {
    /// This process has a handle of one.
    Here,
    /// None here; some were sent (or a child forked) since they were last seen free, and
    /// other processes may hold them.
    Sent,
    /// None anywhere.
    Free,
}

impl Arena {
    /// The creator's view of its slots' use, without asking the kernel.
    pub(super) fn use_of_slots(&self) -> SlotUse {
        let st = self.state();
        if st.local.iter().any(|&c| c != 0) {
            SlotUse::Here
        } else if self.forked.load(std::sync::atomic::Ordering::Acquire) || st.exposed.iter().any(|&e| e) {
            SlotUse::Sent
        } else {
            SlotUse::Free
        }
    }
}

/// Before this allocator makes an arena of `coming` bytes (`ask`: the kernel may be asked
/// which arenas other processes hold), and when one of its named arenas loses its last
/// handle here: where its room is bounded and its arenas would take more than
/// `room / ROOM_BUSY`, lets go of
/// - one-slot arenas with no handle here that it has sent since it last saw them free:
///   other processes may still hold them, and their room goes back to the filesystem when
///   the last of them lets go, as a file per storage does. (Kept for reuse, they would hold
///   that room while this process, which may not allocate again for long, cannot tell they
///   are free.)
/// - arenas free everywhere beyond `room / ROOM_FREE` bytes of them.
///
/// An arena of several slots with one held elsewhere is kept: its free slots serve the
/// next allocations.
pub(super) fn keep_within_room(alloc: &mut Allocator, coming: usize, ask: bool) {
    let Some(room) = alloc.room else { return };
    let total = alloc.arenas().map(|a| a.seg.len()).fold(coming, usize::saturating_add);
    let busy = total > room / ROOM_BUSY;
    NAMED_BUSY.store(busy, Ordering::Relaxed);
    if !busy {
        return;
    }
    let mut free = 0usize;
    let mut keep = |a: &Arc<Arena>| {
        let free_everywhere = match a.use_of_slots() {
            SlotUse::Here => return true,
            SlotUse::Sent if a.nslots == 1 => return false,
            SlotUse::Sent => ask && !a.in_use(),
            SlotUse::Free => true,
        };
        if !free_everywhere {
            return true;
        }
        free = free.saturating_add(a.seg.len());
        free <= room / ROOM_FREE
    };
    for class in &mut alloc.classes {
        let before = class.arenas.len();
        class.arenas.retain(&mut keep);
        if class.arenas.len() != before {
            class.cursor = (0, 0);
        }
    }
    alloc.large.retain(keep);
}

/// Whether this process's named arenas took more than `room / ROOM_BUSY` when last
/// counted (at the last one made, or slot freed while this was so): then each slot freed
/// here applies `keep_within_room`, and otherwise costs nothing more.
static NAMED_BUSY: AtomicBool = AtomicBool::new(false);

/// See `NAMED_BUSY`.
pub(in crate::arena) fn named_busy() -> bool {
    NAMED_BUSY.load(Ordering::Relaxed)
}
