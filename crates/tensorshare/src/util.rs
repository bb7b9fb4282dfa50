//! Small helpers shared by several modules.

/// Fills `buf` with random bytes from the kernel. Falls back to a mix of time and pid,
/// which is enough for the uses here (unique names, not secrets).
pub(crate) fn random_bytes(buf: &mut [u8]) {
    if rustix::rand::getrandom(&mut *buf, rustix::rand::GetRandomFlags::empty()).map(|n| n == buf.len())
        == Ok(true)
    {
        return;
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut x = t ^ (u64::from(rustix::process::getpid().as_raw_nonzero().get() as u32) << 32);
    for b in buf {
        // xorshift64
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
}

/// Locks `m`, also after another thread panicked while holding it: every structure behind
/// the library's mutexes stays valid at each step (they hold caches and bookkeeping whose
/// invariants no panic can leave half-updated), so a poisoned lock is still usable.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A multiplicative hash (FxHash's), for the maps of the per-message path, whose keys no
/// peer chooses freely: addresses in this process, descriptor numbers, device/inode
/// numbers the kernel gave, slot numbers checked against their arena. SipHash's flooding
/// resistance buys nothing there, and costs a tenth of a small message's encoding.
#[derive(Default, Clone, Copy)]
pub(crate) struct FastHasher(u64);

impl std::hash::Hasher for FastHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(n.into());
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A `HashMap` with [`FastHasher`].
pub(crate) type FastMap<K, V> = std::collections::HashMap<K, V, std::hash::BuildHasherDefault<FastHasher>>;

/// Fork safety for the library's own locks: each layer registers, when it makes a static
/// mutex, a function that takes it; a `pthread_atfork` handler, installed as the library
/// loads, runs them all on the forking thread before every fork of the process and drops the
/// guards after it, so a child never finds one of them held by a thread that does not exist
/// there. Every fork: tensorshare's own, and those it does not make (Python's `os.fork` and
/// fork start method, a program's `libc::fork`), whose children use the same locks. Nothing
/// here reaches into another layer: the layers come to it.
pub(crate) mod fork {
    use std::any::Any;
    use std::cell::{Cell, RefCell};
    use std::sync::atomic::AtomicUsize;
    use std::sync::OnceLock;

    /// Takes one layer's locks: pushes their guards.
    pub(crate) type Guard = fn(&mut Vec<Box<dyn Any>>);

    /// The order in which a fork takes the layers' locks: a lock that code may hold while
    /// it takes another comes first, so that the forking thread never waits for one while
    /// holding a lock the holder of that one waits for. Registration order would not do:
    /// statics are made on first use, in any order.
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
    }

    /// Most guards: one per static mutex of the library (seven today).
    const MAX_GUARDS: usize = 32;
    /// The registered guards, without a lock: a thread registering one is inside a static's
    /// initialisation, which must never wait for a fork (its child would inherit that
    /// initialisation unfinished for good). `REGISTERED` counts the entries claimed; an
    /// entry is set right after its claim.
    static GUARDS: [OnceLock<(Rank, Guard)>; MAX_GUARDS] = [const { OnceLock::new() }; MAX_GUARDS];
    static REGISTERED: AtomicUsize = AtomicUsize::new(0);

    /// Registers a layer's guard (once per static: call it first thing where the static is
    /// made, so that a fork meanwhile waits for the static through the guard).
    pub(crate) fn guard(rank: Rank, f: Guard) {
        // Done at load (`install`); here only where that did not run.
        hold_locks_across_forks();
        let i = REGISTERED.fetch_add(1, Ordering::AcqRel);
        debug_assert!(i < MAX_GUARDS, "more fork guards than MAX_GUARDS");
        if let Some(entry) = GUARDS.get(i) {
            let _ = entry.set((rank, f));
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
}
