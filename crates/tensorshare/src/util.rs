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

/// Fork safety for the library's own locks: each layer registers, when it makes a static
/// mutex, a function that takes it; the process layer's `pthread_atfork` handler runs them
/// all on the forking thread before a fork and drops the guards after it, so a child never
/// finds one of them held by a thread that does not exist there. Nothing here reaches into
/// another layer: the layers come to it.
pub(crate) mod fork {
    use std::any::Any;
    use std::sync::Mutex;

    /// Takes one layer's locks: pushes their guards.
    pub(crate) type Guard = fn(&mut Vec<Box<dyn Any>>);

    static GUARDS: Mutex<Vec<Guard>> = Mutex::new(Vec::new());

    /// Registers a layer's guard (once per static: call it where the static is made).
    pub(crate) fn guard(f: Guard) {
        super::lock(&GUARDS).push(f);
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

    /// Every registered guard's locks, taken in registration order, then the list's own
    /// (a thread registering at the fork must not leave it locked in the child). The list
    /// is not held while the others are taken: a thread making a layer's static registers
    /// from inside that static's initialisation, which a guard may wait for.
    pub(crate) fn take_all() -> Vec<Box<dyn Any>> {
        let fns: Vec<Guard> = super::lock(&GUARDS).clone();
        let mut out: Vec<Box<dyn Any>> = Vec::new();
        for f in fns {
            f(&mut out);
        }
        out.push(Box::new(super::lock(&GUARDS)));
        out
    }
}
