//! A mutex that each fork generation has its own of (see `util::fork`, whose third rule it
//! is).

use std::sync::atomic::Ordering;

use super::fork::generation;

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
