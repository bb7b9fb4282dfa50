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

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
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

/// In a forked child, the fork hold its parent made for it: closed when the child's last
/// handle of the arena goes, or with the arena. Kept outside the record, which may be locked
/// for good in the child, by a thread it lacks. The messages the child sends from the arena
/// carry the hold's description too (see `Arena::send_hold`), and keep it open while they
/// are on their way.
pub(super) struct ForkHoldFd {
    /// The description; its lock is held only to clone or take it (and is only tried: a
    /// grandchild forked while a thread of the child held it finds it held for good, and
    /// then keeps its hold until it exits, and sends as if it had none).
    hold: Mutex<Option<Arc<OwnedFd>>>,
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
        ForkHoldFd { hold: Mutex::new(None), handles: AtomicUsize::new(UNCOUNTED) }
    }
}

impl ForkHoldFd {
    /// The hold's cell, unless another thread has it (or had it when this process was
    /// forked).
    fn try_cell(&self) -> Option<MutexGuard<'_, Option<Arc<OwnedFd>>>> {
        match self.hold.try_lock() {
            Ok(g) => Some(g),
            // Nothing panics while it is held; were it poisoned, the value is whole.
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    /// In the child's fork handler: keeps `fd`, with the count of the handles it holds.
    fn keep(&self, fd: OwnedFd, handles: Option<usize>) {
        self.handles.store(handles.unwrap_or(UNCOUNTED), Ordering::Release);
        match self.try_cell() {
            Some(mut cell) => *cell = Some(Arc::new(fd)),
            // The cell of an arena of the parent's own, which it never uses, cannot be held;
            // were it, the hold is kept for the child's life rather than let go.
            None => std::mem::forget(fd),
        }
    }

    /// The hold's description, for a message from the child naming slots it has handles
    /// of (every one of them is locked on it). None if there is none, or its cell is busy.
    pub(super) fn for_message(&self) -> Option<Arc<OwnedFd>> {
        self.try_cell()?.clone()
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
    /// fork hold go (messages on their way keep its description open until they are
    /// taken; a grandchild forked meanwhile has it open too, and keeps its own hold).
    pub(super) fn remove(&self) {
        let left = self.handles.fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| match h {
            UNCOUNTED | 0 => None,
            h => Some(h - 1),
        });
        if left == Ok(1) {
            // Busy for good (see `hold`): kept until the arena goes.
            let taken = self.try_cell().and_then(|mut cell| cell.take());
            drop(taken);
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
/// `None` if it cannot be made (no descriptor left, no `/proc`, or no lock taken): the fork
/// goes on, as a fork that tensorshare did not see would, and the child's inherited handles
/// are then held by nothing of its own. Runs that cannot be locked one by one are locked as
/// one span. A description returned has every slot locked on it: the child's messages rely
/// on that (see `ForkHoldFd::for_message`).
fn lock_slots(arena: &Arena, slots: &mut Vec<u32>) -> Option<OwnedFd> {
    let fd = arena.seg.reopen().ok()?;
    let (first, last) = (*slots.first()?, *slots.last()?);
    let runs = runs(slots);
    let locked = runs.len() <= MOST_RUNS
        && runs.iter().all(|&(start, len)| lock_range(fd.as_fd(), start, len, libc::F_RDLCK).is_ok());
    // (What was locked stays locked until the description is closed.)
    (locked || lock_range(fd.as_fd(), first, last - first + 1, libc::F_RDLCK).is_ok()).then_some(fd)
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
