//! Fork holds: what keeps a forked child's inherited slots from being handed out again.
//!
//! A child made by `fork` has every handle its parent had, and uses them: a tensor shared
//! before the fork, a buffer passed to a worker, a received tensor a DataLoader worker
//! reads. None of this process's own accounting covers the child: the creator counts its
//! handles in private memory, which the child's copy no longer updates, and a holder's locks
//! are on a description the child shares, so the holder's unlock when it drops its last
//! handle releases the child's hold too. Either way the creator would hand the slot out
//! again while the child still reads it.
//!
//! So, before every fork (the `pthread_atfork` prepare handler, through the fork guard of
//! [`Rank::Arenas`](crate::util::fork::Rank)), this process opens a new description of each
//! arena of its own it has handles in and locks those slots on it, as any holder does. The
//! child inherits the description's descriptor and keeps it with the arena, closed when
//! its last handle of the arena goes (it counts them from its parent's count at the fork),
//! when it drops the arena, or when it exits; the parent closes its copy right after the
//! fork. The locks
//! are the kernel's: they last while the child (or a child of its own, which inherits the
//! descriptor again) has the description open, whatever the parent does, and nobody unlocks
//! them. A creator marks those slots exposed, so that it asks the kernel about other
//! holders' locks before it reuses one (see `Arena::try_claim`). Many scattered slots are
//! locked as one span from the first to the last (one lock record, not thousands).
//!
//! The arena's record is locked across the fork when it can be, so that no handle is taken
//! in it between the look and the fork. It is only tried, never waited for: a thread may
//! hold it while it waits for a lock the forking thread took before (see
//! `util::fork::Rank`). An arena whose record is busy gets every slot locked instead, and
//! its creator asks about every slot at its next claim. The child keeps the descriptor
//! outside the record, which may stay locked there for good, and closes it when it drops
//! the arena.

use std::os::fd::{AsFd, FromRawFd, IntoRawFd, OwnedFd};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError, Weak};

use super::locks::{lock_range, runs};
use super::{Arena, State};
use crate::util::lock;

/// The arenas of this process (made here or received), to find those a child inherits.
#[derive(Default)]
struct Live {
    arenas: Vec<Weak<Arena>>,
    /// Entries at the last sweep of dead ones: the next sweep comes at twice as many.
    swept_at: usize,
}

static LIVE: crate::util::Lazy<Mutex<Live>> = crate::util::Lazy::new();

fn live() -> &'static Mutex<Live> {
    LIVE.get_or_make(Mutex::default)
}

crate::util::fork::guard_at_load!(crate::util::fork::Rank::Arenas, |out| {
    let live = lock(live());
    let arenas: Vec<Arc<Arena>> =
        live.arenas.iter().filter_map(Weak::upgrade).filter(|a| a.is_own()).collect();
    out.push(Box::new(live));
    for arena in arenas {
        out.push(Box::new(ForkHold::take(arena)));
    }
});

/// Shares `arena` and lists it among this process's arenas (for the fork holds).
pub(crate) fn listed(arena: Arena) -> Arc<Arena> {
    let arena = Arc::new(arena);
    let mut live = lock(live());
    if live.arenas.len() >= 2 * live.swept_at.max(32) {
        live.arenas.retain(|w| w.strong_count() > 0);
        live.swept_at = live.arenas.len();
    }
    live.arenas.push(Arc::downgrade(&arena));
    arena
}

/// In a forked child, the descriptor of the fork hold its parent made for it (-1: none),
/// closed when the child's last handle of the arena goes, or with the arena. An atomic
/// rather than a field of the record: the record may be locked for good in the child, by
/// a thread it lacks.
pub(super) struct ForkHoldFd {
    fd: AtomicI32,
    /// The child's handles of the arena: as many as the parent had at the fork (its record
    /// was locked then, so each is a `Slot` in the child's memory, dropped by the child or
    /// never), plus those taken since. `UNCOUNTED` when the record was busy at the fork.
    handles: AtomicUsize,
}

/// `ForkHoldFd::handles` of a hold made while the arena's record was busy: its count is not
/// known, so the hold lasts as long as the arena.
const UNCOUNTED: usize = usize::MAX;

impl Default for ForkHoldFd {
    fn default() -> Self {
        ForkHoldFd { fd: AtomicI32::new(-1), handles: AtomicUsize::new(UNCOUNTED) }
    }
}

impl ForkHoldFd {
    fn keep(&self, fd: OwnedFd, handles: Option<usize>) {
        self.handles.store(handles.unwrap_or(UNCOUNTED), Ordering::Release);
        self.close(Some(fd));
    }

    /// Puts `fd` in the cell (none: empties it) and closes what was there.
    fn close(&self, fd: Option<OwnedFd>) {
        let old = self.fd.swap(fd.map_or(-1, IntoRawFd::into_raw_fd), Ordering::AcqRel);
        if old >= 0 {
            // SAFETY: as in `drop`: an fd given up to this cell, owned by it alone, and taken
            // out of it by the swap above, so closed once.
            drop(unsafe { OwnedFd::from_raw_fd(old) });
        }
    }

    /// `n` more handles of the inherited arena in this child. False if its hold was let go
    /// already (its handles had all gone): the new ones would be held by nothing.
    pub(super) fn add(&self, n: usize) -> bool {
        let counted = self.handles.fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| match h {
            UNCOUNTED | 0 => None,
            h => Some(h.saturating_add(n).min(UNCOUNTED - 1)),
        });
        counted != Err(0)
    }

    /// One handle of the inherited arena less in this child: the last one counted lets the
    /// fork hold go. (A grandchild forked meanwhile has the description open too, and so
    /// keeps its own hold.)
    pub(super) fn remove(&self) {
        let left = self.handles.fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| match h {
            UNCOUNTED | 0 => None,
            h => Some(h - 1),
        });
        if left == Ok(1) {
            self.close(None);
        }
    }
}

impl Drop for ForkHoldFd {
    fn drop(&mut self) {
        let fd = *self.fd.get_mut();
        if fd >= 0 {
            // SAFETY: the cell holds only descriptors given up to it by `keep` (from an
            // `OwnedFd`), which nothing else owns or closes: each is closed once, here or
            // when `close` takes it out.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
        }
    }
}

/// One arena's fork hold, made before a fork and settled after it in both processes.
struct ForkHold {
    /// The arena's record, when it could be locked: kept locked across the fork. Declared
    /// before `arena`, so that it is unlocked before the arena can go.
    state: Option<MutexGuard<'static, State>>,
    /// The new description with the slots locked on it.
    fd: Option<OwnedFd>,
    /// The process that made it: another one settling it is the child.
    pid: rustix::process::Pid,
    /// The handles this process has of the arena, when its record could be locked.
    handles: Option<usize>,
    /// Kept for `state`, which borrows from it; taken (never dropped) in the child.
    arena: Option<Arc<Arena>>,
}

impl ForkHold {
    fn take(arena: Arc<Arena>) -> ForkHold {
        let guard = match arena.state.try_lock() {
            Ok(g) => Some(g),
            // As `util::lock` does: every structure behind it stays valid at each step.
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        };
        // SAFETY: the guard borrows `arena.state`, inside the allocation of the `Arc` that
        // this `ForkHold` keeps a clone of in `arena`: that allocation neither moves nor
        // goes while the clone lives, and the guard is dropped before the clone (field
        // order, and `drop` below takes the clone only after it), and never leaves the
        // `ForkHold` (no method hands it out).
        let mut state: Option<MutexGuard<'static, State>> = guard
            .map(|g| unsafe { std::mem::transmute::<MutexGuard<'_, State>, MutexGuard<'static, State>>(g) });
        let handles = state.as_ref().map(|st| st.local.iter().map(|&n| n as usize).sum());
        let mut slots: Vec<u32> = match &state {
            Some(st) => (0..arena.nslots).filter(|&s| st.local[s as usize] > 0).collect(),
            // Busy: whatever its holder is doing, every slot is locked.
            None => (0..arena.nslots).collect(),
        };
        let fd = if slots.is_empty() { None } else { lock_slots(&arena, &mut slots) };
        if fd.is_some() && arena.creator {
            match state.as_mut() {
                // Each slot locked for the child is asked about before it is reused.
                Some(st) => slots.iter().for_each(|&s| st.exposed[s as usize] = true),
                None => arena.forked.store(true, Ordering::Release),
            }
        }
        ForkHold { state, fd, pid: rustix::process::getpid(), handles, arena: Some(arena) }
    }
}

/// Runs of slots beyond which a fork hold locks one span from the first slot to the last
/// instead: one lock call, and one lock record on the file, rather than thousands.
const MOST_RUNS: usize = 16;

/// A new description of `arena`'s file with `slots` (sorted, distinct) locked on it;
/// `None` if it cannot be made (no descriptor left, or no `/proc`): the fork goes on, as a
/// fork that tensorshare did not see would, and the child's inherited handles are then held
/// by nothing of its own. Runs that cannot be locked one by one are locked as one span.
fn lock_slots(arena: &Arena, slots: &mut Vec<u32>) -> Option<OwnedFd> {
    let fd = arena.seg.reopen().ok()?;
    let (first, last) = (*slots.first()?, *slots.last()?);
    let span = |fd: &OwnedFd| lock_range(fd.as_fd(), first, last - first + 1, libc::F_RDLCK);
    let runs = runs(slots);
    let locked = runs.len() <= MOST_RUNS
        && runs.iter().all(|&(start, len)| lock_range(fd.as_fd(), start, len, libc::F_RDLCK).is_ok());
    if !locked {
        // (What was locked stays locked: only closing the description unlocks it.)
        let _ = span(&fd);
    }
    Some(fd)
}

impl Drop for ForkHold {
    fn drop(&mut self) {
        drop(self.state.take());
        let arena = self.arena.take().expect("set until dropped");
        let fd = self.fd.take();
        if rustix::process::getpid() == self.pid {
            return; // the parent: the child has its own copy of the descriptor
        }
        if Arc::strong_count(&arena) == 1 {
            // Nothing in the child uses the arena any more (its last handle went between the
            // look and the fork): no hold is needed, and the arena is not dropped here,
            // where its teardown (a CUDA registration's, say) would run before the child
            // has settled what it inherited.
            drop(fd);
            std::mem::forget(arena);
            return;
        }
        if let Some(fd) = fd {
            arena.fork_hold.keep(fd, self.handles);
        }
    }
}
