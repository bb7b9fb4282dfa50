//! The capacity semaphore of a queue's control block: places taken by `put`, given back
//! by `get`, with a futex to sleep on (see the module above).

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{Control, UNBOUNDED};

/// How long a bounded queue's free places must stay short of its capacity, with the queue
/// drained and nothing sent, before a waiting consumer gives the missing ones back: longer
/// than a live producer is kept off its CPU between taking a place and writing its record
/// (a container's CPU quota throttles for up to 100 ms). Nothing waits for these places
/// meanwhile, as other places are free.
const LOST_AFTER: Duration = Duration::from_secs(1);

impl Control {
    /// Gives every place back when the queue is empty and none is free: a consumer killed
    /// between taking a record and giving its place back cannot lose that place for good.
    /// `empty` says whether the queue's socket holds no record; it must have said so at the
    /// start of the wait that found no place as well (the caller waited a whole slice).
    ///
    /// A live process holds a place without a record in the socket only for the few
    /// instructions between taking it and writing its record (the record is framed, and a
    /// large one spilled, before the place is taken), or between taking a record and giving
    /// its place back; one stopped there for two whole slices (a debugger, SIGSTOP) is taken
    /// for dead, and the queue then admits up to its capacity more.
    pub(crate) fn restore_places(&self, empty: bool) {
        let b = self.counters();
        let cap = b.capacity.load(Ordering::Relaxed);
        if empty
            && cap != UNBOUNDED
            && b.permits.compare_exchange(0, cap, Ordering::AcqRel, Ordering::Relaxed).is_ok()
        {
            let _ = rustix::thread::futex::wake(
                &b.permits,
                rustix::thread::futex::Flags::empty(),
                i32::MAX as u32,
            );
        }
    }

    /// Gives back the places a bounded queue lost while it still has free ones, which
    /// `restore_places` (run by producers that find none) never sees: a consumer calls it
    /// each time it has waited a nap on the queue with nothing sent (the bell still at
    /// `rung`); `drained` says whether the queue holds nothing now. Free places below the
    /// capacity that stay the same for `LOST_AFTER`, with the queue drained and nothing sent
    /// all along, were lost (a producer killed between taking a place and writing its
    /// record), not taken: a live process holds one with nothing in the queue only for a
    /// few instructions (see `restore_places`, whose caveat for a stopped one holds here
    /// too, as for one kept off its CPU that long).
    pub(crate) fn watch_lost_places(&self, rung: u32, drained: impl FnOnce() -> bool) {
        let b = self.counters();
        let cap = b.capacity.load(Ordering::Relaxed);
        if cap == UNBOUNDED {
            return;
        }
        let mut watch = self.lost_watch.lock();
        let free = b.permits.load(Ordering::Acquire);
        if free >= cap || !drained() {
            *watch = None;
            return;
        }
        match *watch {
            Some((seen, bell, since)) if seen == free && bell == rung => {
                if since.elapsed() >= LOST_AFTER {
                    *watch = None;
                    if b.permits.compare_exchange(free, cap, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                        let _ = rustix::thread::futex::wake(
                            &b.permits,
                            rustix::thread::futex::Flags::empty(),
                            i32::MAX as u32,
                        );
                    }
                }
            }
            _ => *watch = Some((free, rung, std::time::Instant::now())),
        }
    }

    /// Takes a place and keeps it, as a producer killed right after taking one does (for
    /// `raw::lose_a_place`).
    #[cfg(feature = "test-support")]
    pub(crate) fn lose_a_place(&self) -> bool {
        self.try_acquire()
    }

    /// Whether a bounded queue has no free place now (a `put` would wait).
    pub(crate) fn is_full(&self) -> bool {
        self.counters().permits.load(Ordering::Relaxed) == 0
    }

    /// Takes a place if one is free now (never waits).
    pub(crate) fn try_acquire(&self) -> bool {
        let b = self.counters();
        let mut p = b.permits.load(Ordering::Acquire);
        loop {
            if p == UNBOUNDED {
                return true;
            }
            if p == 0 {
                return false;
            }
            match b.permits.compare_exchange_weak(p, p - 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(now) => p = now,
            }
        }
    }

    /// Takes a place in the queue, waiting up to `slice` for one. Returns whether it got one.
    pub(crate) fn acquire(&self, slice: Duration) -> bool {
        let b = self.counters();
        let mut p = b.permits.load(Ordering::Acquire);
        if p == 0 {
            // Time to do what is better done while waiting (see `arena::idle`).
            crate::arena::idle();
            p = b.permits.load(Ordering::Acquire);
        }
        // A consumer usually frees a place within microseconds: wait for it awake first, as
        // a sleep and a wake-up cost more than that; but no longer than the caller waits at
        // all (`try_put` does not wait).
        let spin_until = std::time::Instant::now() + crate::channel::socket::SPIN.min(slice);
        'spin: while p == 0 && std::time::Instant::now() < spin_until {
            // Reading the clock costs more than a look at the word: look a few times per
            // reading.
            for _ in 0..32 {
                std::hint::spin_loop();
                p = b.permits.load(Ordering::Acquire);
                if p != 0 {
                    break 'spin;
                }
            }
        }
        loop {
            if p == UNBOUNDED {
                return true;
            }
            if p == 0 {
                if slice.is_zero() {
                    return false; // `try_put`: no sleep, and no waiter for a release to wake
                }
                b.waiters.fetch_add(1, Ordering::SeqCst);
                let ts = rustix::thread::futex::Timespec {
                    tv_sec: slice.as_secs() as i64,
                    tv_nsec: slice.subsec_nanos() as i64,
                };
                // Shared (not PRIVATE) futex: the word is in memory other processes map.
                let _ = rustix::thread::futex::wait(
                    &b.permits,
                    rustix::thread::futex::Flags::empty(),
                    0,
                    Some(&ts),
                );
                // Saturating: a release may have reset the count meanwhile (see `release`).
                let _ = b.waiters.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| w.checked_sub(1));
                p = b.permits.load(Ordering::Acquire);
                if p == 0 {
                    return false;
                }
                continue;
            }
            match b.permits.compare_exchange_weak(p, p - 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(now) => p = now,
            }
        }
    }

    /// Gives a place back (after a `get`, or a failed `put`). Never beyond the capacity:
    /// a place restored by `restore_places` and then released late is not counted twice.
    pub(crate) fn release(&self) {
        let b = self.counters();
        if b.permits.load(Ordering::Relaxed) == UNBOUNDED {
            return;
        }
        let cap = b.capacity.load(Ordering::Relaxed);
        let _ = b.permits.fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| (p < cap).then_some(p + 1));
        if b.waiters.load(Ordering::SeqCst) > 0 {
            // Nobody woken although the count says someone waits: the count is stale (a
            // waiter was killed in its sleep). Reset it; a waiter that has counted itself but
            // not slept yet cannot miss this release, since it sleeps only while no place is
            // free, and it saturates its own decrement.
            if rustix::thread::futex::wake(&b.permits, rustix::thread::futex::Flags::empty(), 1) == Ok(0) {
                b.waiters.store(0, Ordering::SeqCst);
            }
        }
    }
}
