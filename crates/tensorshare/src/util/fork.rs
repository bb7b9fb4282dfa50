//! Fork safety for the library's statics. Every fork of a process that links tensorshare:
//! its own, and those it does not make (Python's `os.fork` and fork start method, a
//! program's `libc::fork`), whose children use the same statics. A child has only the
//! forking thread, so it must never find a lock held, or a static half made, by a thread
//! that does not exist there. Two rules keep it so:
//!
//! - Every static mutex is taken around every fork: each layer registers, as the library
//!   loads ([`guard_at_load!`]), a function that takes its mutexes; a `pthread_atfork`
//!   handler runs them all on the forking thread before the fork and drops the guards
//!   after it. Registered at load, while the process has one thread (or, for a Python
//!   extension, while its loading thread makes the only use of it), never on first use,
//!   so no fork can come between a static's first use and its guard.
//! - A static made on first use is a [`Lazy`], which no thread ever waits for: a
//!   `OnceLock` makes other threads wait for the one making its value, and in a child
//!   forked meanwhile that thread does not exist, so they would wait for good.
//!
//! Nothing here reaches into another layer: the layers come to it.
use std::any::Any;
use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicPtr, AtomicUsize};
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
    /// The arena layer's deferred work (taken with nothing else held).
    Deferred,
    /// The DLPack layer's set of live exports (taken with nothing else held, and nothing
    /// taken under it).
    #[cfg(feature = "dlpack")]
    Interop,
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
        #[cfg(feature = "dlpack")]
        Rank::Interop,
    ];
}

/// Most guards: one per static mutex of the library (eight today).
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
/// calls [`guard`]. `$guard` takes the layer's mutexes; a mutex in a [`Lazy`] is taken only
/// if it has been made (`Lazy::get`).
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

/// A static made on first use that no thread ever waits for (see the module docs). Each
/// caller that finds no value makes one, and the first to publish its value wins; the
/// others drop theirs. So making a value must have no effect beyond the value (an
/// allocation, a read of the environment), and a mutex in one is taken around forks only
/// once it is there.
pub(crate) struct Lazy<T> {
    /// Null, or a `Box::into_raw` of the published value, freed only by `Drop`.
    value: AtomicPtr<T>,
    /// Owns a `T`; `Send` and `Sync` are set below, as `OnceLock`'s are.
    _owns: PhantomData<(Box<T>, *const ())>,
}

// SAFETY: a `Lazy<T>` owns at most one boxed `T` and gives out only `&T`: sending it sends
// the `T`.
unsafe impl<T: Send> Send for Lazy<T> {}
// SAFETY: through `&Lazy<T>` a thread reads the `T` (`&T`, hence `T: Sync`) and may make
// and publish one that the `Lazy`'s owner later drops on its own thread (hence `T: Send`).
unsafe impl<T: Send + Sync> Sync for Lazy<T> {}

impl<T> Lazy<T> {
    pub(crate) const fn new() -> Lazy<T> {
        Lazy { value: AtomicPtr::new(std::ptr::null_mut()), _owns: PhantomData }
    }

    /// The value, if one has been published.
    pub(crate) fn get(&self) -> Option<&T> {
        let p = self.value.load(Ordering::Acquire);
        // SAFETY: a non-null pointer here was published (with release ordering, matched by
        // the acquire above) from `Box::into_raw` of a fully made value, and is freed only
        // by `Drop`, which needs `&mut self`: it lives as long as this borrow of `self`.
        unsafe { p.as_ref() }
    }

    /// The value, made by `make` if none has been published. `make` may run in several
    /// threads at once; the value of the first to finish is kept.
    pub(crate) fn get_or_make(&self, make: impl FnOnce() -> T) -> &T {
        if let Some(v) = self.get() {
            return v;
        }
        let made = Box::into_raw(Box::new(make()));
        match self.value.compare_exchange(std::ptr::null_mut(), made, Ordering::AcqRel, Ordering::Acquire) {
            // SAFETY: `made` is published now, and freed only by `Drop`, as in `get`.
            Ok(_) => unsafe { &*made },
            Err(first) => {
                // SAFETY: `made` came from `Box::into_raw` above and was never published:
                // this is its only owner.
                drop(unsafe { Box::from_raw(made) });
                // SAFETY: the exchange failed on a non-null pointer (the only value ever
                // stored besides null), published as in `get`.
                unsafe { &*first }
            }
        }
    }
}

impl<T> Drop for Lazy<T> {
    fn drop(&mut self) {
        let p = *self.value.get_mut();
        if !p.is_null() {
            // SAFETY: published from `Box::into_raw` and not freed before: `&mut self`
            // means no borrow of the value is left.
            drop(unsafe { Box::from_raw(p) });
        }
    }
}

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

/// Every registered guard's locks, taken in `Rank` order. A guard registered meanwhile
/// (a static made by another thread) is taken too: the whole set again, in order.
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

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    use rustix::process::{pidfd_open, waitpid, Pid, PidfdFlags, WaitOptions};

    use super::Lazy;

    #[test]
    fn threads_that_race_to_make_a_value_all_get_the_one_kept() {
        let lazy: Lazy<Vec<usize>> = Lazy::new();
        let barrier = std::sync::Barrier::new(8);
        let got: Vec<usize> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|i| {
                    let (lazy, barrier) = (&lazy, &barrier);
                    s.spawn(move || {
                        barrier.wait();
                        lazy.get_or_make(|| vec![i]) as *const Vec<usize> as usize
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(got.iter().all(|&p| p == got[0]), "threads got different values: {got:?}");
        assert_eq!(lazy.get().map(|v| v.len()), Some(1));
    }

    /// A `OnceLock` fails this: the child waits for good for the thread making the value,
    /// which it does not have.
    #[test]
    fn a_child_forked_while_a_value_is_made_makes_its_own() {
        static VALUE: Lazy<u64> = Lazy::new();
        let (inside, is_inside) = mpsc::channel();
        let (forked, was_forked) = mpsc::channel::<()>();
        let maker = std::thread::spawn(move || {
            *VALUE.get_or_make(|| {
                inside.send(()).unwrap();
                was_forked.recv().unwrap();
                1
            })
        });
        is_inside.recv().unwrap();
        // SAFETY: fork has no memory-safety preconditions. The child reads the static and
        // leaves by _exit: it touches nothing another thread held (libc's fork looks after
        // malloc).
        let pid = match unsafe { libc::fork() } {
            -1 => panic!("fork: {}", std::io::Error::last_os_error()),
            0 => {
                let made = *VALUE.get_or_make(|| 2);
                // SAFETY: _exit ends the child at once.
                unsafe { libc::_exit(if made == 2 { 0 } else { 1 }) }
            }
            pid => Pid::from_raw(pid).unwrap(),
        };
        forked.send(()).unwrap();
        assert_eq!(maker.join().unwrap(), 1);
        assert_eq!(VALUE.get(), Some(&1));
        // The child has 20 s, then is killed; reaped either way.
        let fd = pidfd_open(pid, PidfdFlags::empty()).unwrap();
        let mut fds = [PollFd::new(&fd, PollFlags::IN)];
        let limit = Duration::from_secs(20);
        let ended =
            poll(&mut fds, Some(&Timespec { tv_sec: limit.as_secs() as i64, tv_nsec: 0 })).unwrap() == 1;
        if !ended {
            // SAFETY: kill has no memory-safety preconditions; pid is our unreaped child.
            unsafe { libc::kill(pid.as_raw_nonzero().get(), libc::SIGKILL) };
        }
        let (_, status) = waitpid(Some(pid), WaitOptions::empty()).unwrap().unwrap();
        assert!(ended, "the child waited for the value its parent's thread was making");
        assert_eq!(status.exit_status(), Some(0), "the child did not get a value of its own");
    }
}
