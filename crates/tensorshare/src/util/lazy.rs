//! A static made on first use that no thread ever waits for (see `fork`'s module docs: a
//! `OnceLock` makes other threads wait for the one making its value, and in a child forked
//! meanwhile that thread does not exist).

use std::marker::PhantomData;
use std::sync::atomic::{AtomicPtr, Ordering};

/// A static made on first use that no thread ever waits for. Each caller that finds no
/// value makes one, and the first to publish its value wins; the others drop theirs. So
/// making a value must have no effect beyond the value (an allocation, a read of the
/// environment).
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

    /// Publishes `value` unless one has been published: `Err(value)` back if so. One
    /// atomic exchange, so a child forked meanwhile finds the value there or not, never half
    /// made.
    pub(crate) fn set(&self, value: T) -> Result<(), T> {
        let made = Box::into_raw(Box::new(value));
        match self.value.compare_exchange(std::ptr::null_mut(), made, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => Ok(()),
            // SAFETY: `made` came from `Box::into_raw` above and was never published: this is
            // its only owner.
            Err(_) => Err(*unsafe { Box::from_raw(made) }),
        }
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

    #[test]
    fn of_threads_that_race_to_set_a_value_one_wins_and_the_others_get_theirs_back() {
        let lazy: Lazy<usize> = Lazy::new();
        let barrier = std::sync::Barrier::new(8);
        let lost: Vec<Option<usize>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|i| {
                    let (lazy, barrier) = (&lazy, &barrier);
                    s.spawn(move || {
                        barrier.wait();
                        lazy.set(i).err()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let won = *lazy.get().expect("one value published");
        let mut back: Vec<usize> = lost.iter().flatten().copied().collect();
        assert_eq!(back.len(), 7, "exactly one thread published: {lost:?}");
        back.push(won);
        back.sort_unstable();
        assert_eq!(back, (0..8).collect::<Vec<_>>(), "every value is either kept or handed back");
        assert_eq!(lazy.set(99), Err(99), "a published value stays");
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
