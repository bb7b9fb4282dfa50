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
//!   while a thread waits on other processes) is a [`ForkMutex`]: a fork does not wait for
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

/// A mutex of one object's state that a thread may hold while it waits (a queue's, held
/// while a thread waits on the kernel with Python's GIL released), which the fork guards
/// therefore do not take: a child forked meanwhile would find it held for good, by a
/// thread it does not have. Each process (each fork generation) locks a mutex of its own
/// instead. The first lock in a child forked since the last one made makes the child's:
/// from the inherited value when no thread held the inherited mutex at the fork (it is
/// taken out, and the child goes on as its parent left it), else from `X::default()`.
/// Nothing ever waits for an inherited mutex, and an inherited value that a thread was
/// changing at the fork is never touched again (nor dropped): it is left as it is, with
/// whatever it holds (what a child must let go of, such as a queue's hold, is kept outside).
pub(crate) struct ForkMutex<X: Default> {
    /// The mutex of the latest generation that locked it: made by `new` or by a first lock
    /// in a child, and never freed while `self` lives (see `Drop`).
    cur: std::sync::atomic::AtomicPtr<Generational<X>>,
    /// Owns an `X` behind a mutex, as far as `Send`, `Sync` and drop checking go.
    _owns: std::marker::PhantomData<std::sync::Mutex<X>>,
}

struct Generational<X> {
    generation: u64,
    mutex: std::sync::Mutex<X>,
}

impl<X: Default> ForkMutex<X> {
    pub(crate) fn new(value: X) -> ForkMutex<X> {
        let made = Box::new(Generational { generation: generation(), mutex: std::sync::Mutex::new(value) });
        ForkMutex {
            cur: std::sync::atomic::AtomicPtr::new(Box::into_raw(made)),
            _owns: std::marker::PhantomData,
        }
    }

    /// This process's mutex, locked (also after a panic of another holder, as
    /// [`lock`](super::lock) does).
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, X> {
        super::lock(&self.mine().mutex)
    }

    fn mine(&self) -> &Generational<X> {
        let now = generation();
        let seen = self.cur.load(Ordering::Acquire);
        // SAFETY: `cur` always points to a `Generational` made by `Box::into_raw`, which is
        // freed only by `Drop` (which has `self` to itself), or never: one that a child
        // replaces is left allocated. So it lives as long as `&self`.
        let current = unsafe { &*seen };
        if current.generation == now {
            return current;
        }
        // Inherited by fork. `try_lock`, never `lock`: a thread that held it at the fork is
        // not in this process, and never lets go.
        let inherited = match current.mutex.try_lock() {
            Ok(mut held) => std::mem::take(&mut *held),
            Err(std::sync::TryLockError::Poisoned(p)) => std::mem::take(&mut *p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => X::default(),
        };
        let made = Box::into_raw(Box::new(Generational {
            generation: now,
            mutex: std::sync::Mutex::new(inherited),
        }));
        match self.cur.compare_exchange(seen, made, Ordering::AcqRel, Ordering::Acquire) {
            // SAFETY: `made` is the box made above, now in `cur` (see above for how long it
            // lives).
            Ok(_) => unsafe { &*made },
            Err(first) => {
                // Another thread of this process made this process's first. `made` never left
                // this thread: it goes (with what it took over, which is this process's to
                // let go of: the other thread found the inherited mutex taken by this one, or
                // its value taken out).
                // SAFETY: `made` came from `Box::into_raw` above and no one else saw it.
                drop(unsafe { Box::from_raw(made) });
                // SAFETY: as for `seen` above. It is of this generation: only a thread of this
                // process replaces `cur` here, and always with one of its own generation.
                unsafe { &*first }
            }
        }
    }
}

impl<X: Default> Default for ForkMutex<X> {
    fn default() -> ForkMutex<X> {
        ForkMutex::new(X::default())
    }
}

impl<X: Default> Drop for ForkMutex<X> {
    fn drop(&mut self) {
        // SAFETY: `cur` points to a box made by `Box::into_raw` and freed nowhere else; with
        // `&mut self`, no reference into it is left.
        let last = unsafe { Box::from_raw(*self.cur.get_mut()) };
        if last.generation == generation() {
            return;
        }
        // Inherited and never locked here: what it holds goes as in the process it came
        // from, unless a thread held it at the fork (then it is left as it is).
        let free = match last.mutex.try_lock() {
            Ok(mut held) => Some(std::mem::take(&mut *held)),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(std::mem::take(&mut *p.into_inner())),
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        match free {
            Some(value) => drop((value, last)),
            None => std::mem::forget(last),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ForkMutex;

    /// In a forked child: what `f` says, as its exit status (0: true), reaped here.
    fn in_child(f: impl FnOnce() -> bool) -> bool {
        // SAFETY: the child runs `f`, which touches only the test's `ForkMutex` (its
        // generation check is atomics), and leaves by _exit.
        match unsafe { libc::fork() } {
            -1 => panic!("fork: {}", std::io::Error::last_os_error()),
            0 => {
                let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(false);
                // SAFETY: _exit ends the child at once.
                unsafe { libc::_exit(if ok { 0 } else { 1 }) }
            }
            pid => {
                let mut status = 0;
                // SAFETY: waits for our own child, writing its status into `status`.
                assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
                libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0
            }
        }
    }

    #[test]
    fn a_child_takes_over_a_free_inherited_value_and_starts_afresh_from_a_held_one() {
        let m = ForkMutex::new(vec![1, 2, 3]);
        m.lock().push(4);
        // Free at the fork: the child goes on from the parent's value, in a mutex of its own.
        assert!(in_child(|| {
            let mine = m.lock().clone();
            m.lock().push(5);
            mine == [1, 2, 3, 4] && *m.lock() == [1, 2, 3, 4, 5]
        }));
        assert_eq!(*m.lock(), [1, 2, 3, 4], "the child's change reached its parent");
        // Held by another thread at the fork: the child starts from the default, at once.
        let (locked, is_locked) = std::sync::mpsc::channel();
        let (forked, was_forked) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|s| {
            let m = &m;
            s.spawn(move || {
                let mut held = m.lock();
                held.push(6);
                locked.send(()).unwrap();
                was_forked.recv().unwrap();
            });
            is_locked.recv().unwrap();
            let fresh = in_child(|| m.lock().is_empty() && m.lock().is_empty());
            forked.send(()).unwrap();
            assert!(fresh, "the child did not start afresh from a value held at the fork");
        });
        assert_eq!(*m.lock(), [1, 2, 3, 4, 6]);
    }
}
