//! Fork safety for the library's statics. Every fork of a process that links tensorshare:
//! its own, and those it does not make (Python's `os.fork` and fork start method, a
//! program's `libc::fork`), whose children use the same statics. A child has only the
//! forking thread, so it must never find a lock held, or a static half made, by a thread
//! that does not exist there. Three rules keep it so:
//!
//! - Every static mutex that is never held across a wait is taken around every fork: each
//!   layer registers, as the library loads ([`guard_at_load!`]), a function that takes its
//!   mutexes, making any that are not made yet; a `pthread_atfork` handler runs them all
//!   on the forking thread before the fork and drops the guards after it. Registered at
//!   load, while the process has one thread (or, for a Python extension, while its
//!   loading thread makes the only use of it), never on first use, so no fork can come
//!   between a static's first use and its guard. (Two mutexes are held across waits, and a
//!   fork does not wait for them: the fork server's record, while a server starts and
//!   while a request waits for its answer, and the CUDA layer's, while the driver works. A
//!   child forked meanwhile starts a fork server of its own, and cannot use CUDA.)
//! - A static made on first use is a [`Lazy`](super::Lazy), which no thread ever waits
//!   for: a `OnceLock` makes other threads wait for the one making its value, and in a
//!   child forked meanwhile that thread does not exist, so they would wait for good.
//! - A mutex of one object's state that a thread may hold while it waits (a queue's, held
//!   while a thread waits on other processes) is a [`ForkMutex`](super::fork_mutex::ForkMutex): a fork does not wait for
//!   it, and a child forked meanwhile locks one of its own.
//!
//! Nothing here reaches into another layer: the layers come to it.
use std::any::Any;
use std::cell::{Cell, RefCell};
use std::sync::atomic::AtomicUsize;
use std::sync::OnceLock;

/// Takes one layer's locks: pushes their guards.
pub(crate) type Guard = fn(&mut Vec<Box<dyn Any>>);

/// The order in which a fork takes the layers' locks: a lock that code may hold while
/// it takes another comes first, so that the forking thread never waits for one while
/// holding a lock the holder of that one waits for. Registration order would not do:
/// it is the order in which the loader runs the layers' constructors.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub(crate) enum Rank {
    /// The queue registry.
    Channel,
    /// The forked children's outbox map.
    Forked,
    /// The received-arena cache.
    Wire,
    /// The arena allocators.
    Allocator,
    /// The cleanup group's record (an allocator reads it).
    Group,
    /// The arena layer's deferred work (nothing of this list is taken under it).
    Deferred,
    /// The list of live arenas, whose fork holds are made with it held (an arena's record
    /// is only ever tried there, never waited for: see `arena::fork_hold`).
    Arenas,
    /// The DLPack layer's set of live exports (taken with nothing else held, and nothing
    /// taken under it).
    #[cfg(feature = "dlpack")]
    Interop,
    /// Held while a thread reads the dynamic loader's list of objects (`dl_iterate_phdr`,
    /// see `process::image`), with nothing taken under it: glibc holds a lock of its own
    /// meanwhile, which a child forked then finds held for good (glibc 2.36 does not reset
    /// it), and waits for at its own first read.
    Loader,
}

impl Rank {
    /// Every rank of this build: each has a guard registered at load.
    #[cfg_attr(not(feature = "test-support"), allow(dead_code))]
    pub(crate) const ALL: &[Rank] = &[
        Rank::Channel,
        Rank::Forked,
        Rank::Wire,
        Rank::Allocator,
        Rank::Group,
        Rank::Deferred,
        Rank::Arenas,
        #[cfg(feature = "dlpack")]
        Rank::Interop,
        Rank::Loader,
    ];
}

/// Most guards: one per layer (eight today).
const MAX_GUARDS: usize = 32;
/// The registered guards. `REGISTERED` counts the entries claimed; an entry is set right
/// after its claim.
static GUARDS: [OnceLock<(Rank, Guard)>; MAX_GUARDS] = [const { OnceLock::new() }; MAX_GUARDS];
static REGISTERED: AtomicUsize = AtomicUsize::new(0);

/// Registers a layer's guard. Called from the layer's constructor through
/// [`guard_at_load!`], before `main` (or as the Python extension loads).
pub(crate) fn guard(rank: Rank, f: Guard) {
    // Done at load (`install`) as well; the loader runs constructors in any order.
    hold_locks_across_forks();
    let i = REGISTERED.fetch_add(1, Ordering::AcqRel);
    debug_assert!(i < MAX_GUARDS, "more fork guards than MAX_GUARDS");
    if let Some(entry) = GUARDS.get(i) {
        let _ = entry.set((rank, f));
    }
}

/// The ranks of the guards registered so far, in registration order.
#[cfg_attr(not(feature = "test-support"), allow(dead_code))]
pub(crate) fn registered() -> Vec<Rank> {
    let n = REGISTERED.load(Ordering::Acquire).min(MAX_GUARDS);
    GUARDS[..n].iter().filter_map(|entry| entry.get().map(|&(rank, _)| rank)).collect()
}

/// Registers a guard of `$rank` as the library loads: a constructor in `.init_array` that
/// calls [`guard`]. `$guard` takes the layer's mutexes; one in a [`Lazy`](super::Lazy) is
/// made if it is not there yet (`Lazy::get_or_make`): a guard that passed over it could see
/// it unmade while another thread makes and locks it before the fork.
macro_rules! guard_at_load {
    ($rank:expr, $guard:expr) => {
        const _: () = {
            #[used]
            #[link_section = ".init_array"]
            static REGISTER: extern "C" fn() = register;
            extern "C" fn register() {
                $crate::util::fork::guard($rank, $guard)
            }
        };
    };
}
pub(crate) use guard_at_load;

/// Installs the handlers as the library is loaded, while its process (or, for a Python
/// extension, its loading thread) makes no other use of it: installing them later, on
/// first use, would run `pthread_atfork` inside a `Once` that a fork in another thread
/// could leave unfinished in its child.
#[used]
#[link_section = ".init_array"]
static INSTALL: extern "C" fn() = install;

extern "C" fn install() {
    hold_locks_across_forks();
    watch();
}

thread_local! {
    /// The guards the forking thread took before the fork, dropped after it.
    static HELD: RefCell<Vec<Box<dyn Any>>> = const { RefCell::new(Vec::new()) };
    /// Set while this thread forks a child that only calls `exec` (see `exec_only`).
    static EXEC_ONLY: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f`, whose forks make children that only `exec` (std's `Command::spawn`), with
/// none of the locks taken around them: such a child never touches them, so the fork
/// need not wait for whoever holds one. No caller holds one of these locks (a fork
/// under one would stall every other thread's fork, and on glibc before 2.36, which
/// keeps its own fork lock through the handlers, deadlock with them).
pub(crate) fn exec_only<R>(f: impl FnOnce() -> R) -> R {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            EXEC_ONLY.with(|e| e.set(self.0));
        }
    }
    let _reset = Reset(EXEC_ONLY.with(|e| e.replace(true)));
    f()
}

/// Whether this thread's forks take no lock: those of `exec_only`, and those of a thread
/// whose thread locals are gone (a fork from a thread local's destructor), which can
/// keep no guard; a panic here would abort the process.
fn takes_none() -> bool {
    EXEC_ONLY.try_with(Cell::get).unwrap_or(true) || HELD.try_with(|_| ()).is_err()
}

extern "C" fn before_fork() {
    if takes_none() {
        return;
    }
    let guards = take_all();
    let _ = HELD.try_with(|h| *h.borrow_mut() = guards);
}

extern "C" fn after_fork() {
    if takes_none() {
        return;
    }
    let _ = HELD.try_with(|h| h.borrow_mut().clear());
}

fn hold_locks_across_forks() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: the handlers are plain extern "C" functions that run on the forking
        // thread: the first takes tensorshare's static mutexes (waiting, as any caller
        // would, for a thread that holds one to release it: none is held across a
        // blocking wait) and keeps the guards in a thread local; the others drop them,
        // in the parent, and in the child, where the mutexes' memory is a copy the
        // forking thread owns the locks of.
        unsafe { libc::pthread_atfork(Some(before_fork), Some(after_fork), Some(after_fork)) };
    });
}

use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};

/// Counts forks: state inherited from a parent (an arena's descriptions, an outbox)
/// compares its generation with this one to know it is not this process's own.
static GENERATION: AtomicU64 = AtomicU64::new(0);
static PID: AtomicI32 = AtomicI32::new(0);

/// What a forked child does first: a new generation, and no cached pid. Run by
/// `pthread_atfork`, and by hand in a child of a raw `clone` (which runs no handler).
pub(crate) extern "C" fn in_child() {
    GENERATION.fetch_add(1, Ordering::Relaxed);
    PID.store(0, Ordering::Relaxed);
}

fn watch() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: the child handler is a plain extern "C" fn that does two atomic
        // operations, which are async-signal-safe and valid in a child that has only the
        // forking thread.
        unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
    });
}

/// This process's fork generation (see `GENERATION`).
pub(crate) fn generation() -> u64 {
    watch();
    GENERATION.load(Ordering::Relaxed)
}

/// This process among those whose marks a static can hold (its own, and its ancestors'
/// inherited by fork since the last `exec`): never 0, and greater in a child than in any
/// ancestor, as its generation is. A pid would not do: an ancestor's may be given again to
/// a descendant. Only an atomic load: a signal handler may call it. (A child made without
/// the fork handlers, by a raw `clone` that skips `in_child`, keeps its parent's stamp, as
/// it keeps its generation.)
pub(crate) fn stamp() -> u64 {
    GENERATION.load(Ordering::Relaxed) + 1
}

/// This process's pid without a syscall each time (glibc no longer caches it).
pub(crate) fn pid() -> i32 {
    let p = PID.load(Ordering::Relaxed);
    if p != 0 {
        return p;
    }
    watch();
    let p = rustix::process::getpid().as_raw_nonzero().get();
    PID.store(p, Ordering::Relaxed);
    p
}

/// Every registered guard's locks, taken in `Rank` order. A guard registered meanwhile (by
/// a library loaded in another thread) is taken too: the whole set again, in order.
pub(crate) fn take_all() -> Vec<Box<dyn Any>> {
    loop {
        let n = REGISTERED.load(Ordering::Acquire).min(MAX_GUARDS);
        let mut fns: Vec<(Rank, Guard)> = GUARDS[..n]
            .iter()
            .map(|entry| loop {
                // Claimed, and set by its thread without waiting for anything.
                match entry.get() {
                    Some(&g) => break g,
                    None => std::thread::yield_now(),
                }
            })
            .collect();
        fns.sort_by_key(|&(rank, _)| rank);
        let mut out: Vec<Box<dyn Any>> = Vec::new();
        for (_, f) in fns {
            f(&mut out);
        }
        if REGISTERED.load(Ordering::Acquire).min(MAX_GUARDS) == n {
            return out;
        }
        // Dropped last first before trying again.
        while out.pop().is_some() {}
    }
}
