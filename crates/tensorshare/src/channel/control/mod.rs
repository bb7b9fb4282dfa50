//! A queue's control block: a small memfd that every process holding the queue maps.
//!
//! It carries the capacity semaphore (a futex word in shared memory) and tells who holds
//! the queue, through locks the kernel keeps: each holding process has a description of the
//! block of its own (opened for this alone) with an OFD read lock on its first byte, which
//! goes when the process dies by any means. A queue travelling inside a message is held the
//! same way: the message carries another such description, which lives until the receiver
//! holds the queue itself and closes it, or until the message is destroyed. "Does anyone
//! else hold this queue?" is one `F_OFD_GETLK` from this process's description.
//!
//! OFD locks rather than POSIX ones: a POSIX lock is dropped when the process closes *any*
//! descriptor of the file, as receiving a queue it holds already, or sending one, does.

use std::os::fd::{AsFd, AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::lane::Ring;
use super::socket::Bell;
use crate::shm::{Segment, SegmentId};
use crate::util::fork_mutex::ForkMutex;
use crate::{Error, Result, SharingStrategy};

mod places;

/// The counters' page, then the lane's cells (see `lane`).
const LEN: usize = super::lane::RING_AT + super::lane::RING_LEN;
/// `permits` value of a queue without a capacity.
pub(super) const UNBOUNDED: u32 = u32::MAX;

/// What a control block holds in its last 8 bytes, written once by its creator: a received
/// memfd without it (an arena, say) is not taken for a queue.
const MAGIC: u64 = u64::from_le_bytes(*b"TSQUEUE4");
const MAGIC_AT: usize = super::lane::RING_AT - 8;
/// The byte whose OFD write lock is the lane directory's lock (byte 0 holds the queue).
const DIRECTORY_LOCK: i64 = 1;

#[repr(C)]
pub(super) struct Counters {
    /// Free places in the queue (UNBOUNDED: no limit).
    permits: AtomicU32,
    /// Producers asleep on `permits`.
    waiters: AtomicU32,
    /// The queue's capacity (UNBOUNDED: none).
    capacity: AtomicU32,
    /// Values put through the socket and not yet taken, as producers and consumers say: only
    /// for `len`, which is an estimate (see `Queue::len`); nothing else reads it. The lane's
    /// messages are not counted here: its ring says how many wait (`Ring::waiting`), and a
    /// count both sides write would move this line, which every `put` and `get` reads,
    /// between their CPUs for every message.
    queued: AtomicU32,
    /// Records in the queue's socket, as writers (before writing) and takers (after taking)
    /// say: never below the truth but by a peer's writes, so a receiver that finds it zero
    /// skips looking at the socket (and still looks whenever it wakes from a sleep).
    records: AtomicU32,
    /// Set once a process asked for the queue's descriptor to wait on (`Queue::poll_fd`):
    /// lane messages then nudge the socket too (see `queue_lane`).
    polled: AtomicU32,
    /// On a cache line of its own: bumped after every record written to the queue, for
    /// receivers polling awake to watch (see `socket::recv_taken`).
    bell: BellLine,
}

#[repr(C, align(64))]
struct BellLine(Bell);

const _: () = assert!(std::mem::size_of::<Counters>() <= super::lane::ENDS_AT);

pub(crate) struct Control {
    /// The memfd that every holder of the queue maps: counters, then the lane.
    seg: Arc<Segment>,
    /// This process's hold: a read-locked description of its own, owned here (closed by
    /// `Drop`). A forked child shares its parent's description, and replaces its copy with
    /// a description of its own (see `held`), then closes the copy: closing its own copy
    /// affects no other process, and none of its threads uses it.
    hold_fd: std::sync::atomic::AtomicI32,
    /// The fork generation whose hold `hold_fd` is.
    hold_generation: std::sync::atomic::AtomicU64,
    /// Taken to use or replace `hold_fd`, and the lane directory's lock among this
    /// process's threads, held while a thread waits for other processes (see
    /// `with_directory`): a child forked meanwhile locks one of its own (`ForkMutex`).
    hold: ForkMutex<()>,
    /// How long this process's receives on the queue poll awake (see `socket::Patience`).
    patience: super::socket::Patience,
    /// What a consumer waiting on the drained queue last counted (see
    /// `watch_lost_places`): free places, the bell's value, and since when.
    lost_watch: ForkMutex<Option<(u32, u32, std::time::Instant)>>,
}

impl Drop for Control {
    fn drop(&mut self) {
        // SAFETY: `hold_fd` owns this descriptor (made by `locked_description`, or this
        // process's copy of it by fork), which nothing else closes; with `&mut self`, no
        // `Held` uses it any more.
        drop(unsafe { OwnedFd::from_raw_fd(*self.hold_fd.get_mut()) });
    }
}

/// This process's hold of a queue, locked (see `Control::hold`): its descriptor, which
/// stays open while the lock is held.
struct Held<'a> {
    fd: std::os::fd::RawFd,
    _locked: std::sync::MutexGuard<'a, ()>,
}

impl Control {
    /// A new control block for a queue of `capacity` places (None: unbounded).
    pub(crate) fn create(capacity: Option<u32>) -> Result<Control> {
        let seg = Segment::create(LEN, SharingStrategy::FileDescriptor)?;
        // SAFETY: the segment is LEN bytes, page-aligned (so the word is aligned), and no
        // other process or handle has seen it yet: this plain write races with nothing.
        unsafe { seg.as_mut_ptr().add(MAGIC_AT).cast::<u64>().write(MAGIC) };
        // SAFETY: the segment is a control block's size, page-aligned.
        unsafe { Ring::new(&seg) }.init();
        let hold = locked_description(&seg)?;
        let c = Control::with_hold(seg, hold);
        c.counters().permits.store(capacity.unwrap_or(UNBOUNDED), Ordering::Relaxed);
        c.counters().capacity.store(capacity.unwrap_or(UNBOUNDED), Ordering::Relaxed);
        Ok(c)
    }

    /// Maps a control block received from another process. The received descriptor is the
    /// message's hold: it closes only once this process holds the queue itself.
    pub(crate) fn open(received: OwnedFd) -> Result<Control> {
        let own = crate::shm::reopen(received.as_fd())?;
        let seg = Segment::from_fd(own, LEN)?;
        // SAFETY: the mapping is at least LEN bytes and page-aligned, so the word lies in it
        // and is aligned; a peer may write it at any time, so it is read once, volatile, as a
        // plain integer (any bit pattern is valid) and only compared.
        let magic = unsafe { seg.as_ptr().add(MAGIC_AT).cast::<u64>().read_volatile() };
        if magic != MAGIC || seg.len() != LEN {
            return Err(Error::invalid("a received queue's control block is not one (wrong size or magic)"));
        }
        let hold = locked_description(&seg)?;
        drop(received);
        Ok(Control::with_hold(seg, hold))
    }

    fn with_hold(seg: Segment, hold: OwnedFd) -> Control {
        Control {
            seg: Arc::new(seg),
            hold_fd: std::sync::atomic::AtomicI32::new(hold.into_raw_fd()),
            hold_generation: std::sync::atomic::AtomicU64::new(crate::util::fork::generation()),
            hold: ForkMutex::default(),
            patience: Default::default(),
            lost_watch: Default::default(),
        }
    }

    /// A message brought the queue to a process that holds it already: the message's hold
    /// goes, this process's stays (taken anew in a forked child).
    pub(crate) fn take_over(&self, received: OwnedFd) -> Result<()> {
        drop(self.held()?);
        drop(received);
        Ok(())
    }

    /// This process's hold, taken anew in a process forked since it was taken (the
    /// inherited copy of the parent's description then closed).
    fn held(&self) -> Result<Held<'_>> {
        let locked = self.hold.lock();
        let now = crate::util::fork::generation();
        if self.hold_generation.load(Ordering::Relaxed) != now {
            let mine = locked_description(&self.seg)?.into_raw_fd();
            let inherited = self.hold_fd.swap(mine, Ordering::Relaxed);
            self.hold_generation.store(now, Ordering::Relaxed);
            // SAFETY: `inherited` is this process's copy of the descriptor the process it was
            // forked from held the queue with: `hold_fd` owns it (nothing else closes it), and
            // it is used only under `hold`, which this thread holds (a thread of the parent
            // that held the parent's lock at the fork is not in this process), so nothing
            // uses it any more.
            drop(unsafe { OwnedFd::from_raw_fd(inherited) });
        }
        Ok(Held { fd: self.hold_fd.load(Ordering::Relaxed), _locked: locked })
    }

    /// Runs `f` with this process's hold locked (for `raw::with_queue_locks_held`).
    #[cfg(feature = "test-support")]
    pub(crate) fn with_hold_locked<R>(&self, f: impl FnOnce() -> R) -> R {
        let _held = self.held();
        f()
    }

    pub(super) fn counters(&self) -> &Counters {
        // SAFETY: the segment is at least LEN bytes (Segment checks what it maps), and
        // Counters fits before the magic word (asserted at compile time below); the mapping
        // is page-aligned (more than Counters' 64), lives as long as self, and Counters is
        // atomics only: valid for any bit pattern and meant to be used by several processes
        // at once.
        unsafe { &*self.seg.as_ptr().cast::<Counters>() }
    }

    /// (device, inode): the queue's identity in every process.
    pub(crate) fn id(&self) -> Result<(u64, u64)> {
        match self.seg.id() {
            &SegmentId::Inode { dev, ino } => Ok((dev, ino)),
            SegmentId::Name(_) => Err(Error::invalid("a queue's control block must be a memfd")),
        }
    }

    /// A descriptor for a message that carries the queue: a description of its own, read-
    /// locked, so that the queue counts as held while the message is in flight.
    pub(crate) fn in_flight_hold(&self) -> Result<OwnedFd> {
        locked_description(&self.seg)
    }

    /// Whether a process other than this one, or a message in flight, holds the queue.
    pub(crate) fn others_alive(&self) -> bool {
        let Ok(h) = self.held() else { return true };
        let mut fl = flock(libc::F_WRLCK as i16);
        // SAFETY: F_OFD_GETLK with a valid descriptor (the hold's, open while `h` keeps it
        // locked) and a valid, initialised struct flock (l_pid 0), which lives across the
        // call and which the kernel fills in.
        let r = unsafe { libc::fcntl(h.fd, libc::F_OFD_GETLK, &mut fl) };
        // On error, assume someone is there: waiting on is safer than a false hang-up.
        r != 0 || fl.l_type != libc::F_UNLCK as i16
    }

    /// The queue's lane.
    pub(crate) fn lane(&self) -> Ring<'_> {
        // SAFETY: `create` and `open` made sure the mapping is a control block's size, and
        // it is page-aligned.
        unsafe { Ring::new(&self.seg) }
    }

    /// Runs `f` holding the lane directory's lock: other threads of this process wait on
    /// this process's hold, other processes on an OFD write lock of the hold's description,
    /// which the kernel drops if this process dies meanwhile. Waits at most `patience` for
    /// the lock (a peer stopped or hostile may keep it): then `Error::Timeout`, and `f` does
    /// not run. The lock goes when `f` returns or unwinds.
    pub(crate) fn with_directory<R>(&self, patience: Duration, f: impl FnOnce() -> R) -> Result<R> {
        struct Unlock(i32);
        impl Drop for Unlock {
            fn drop(&mut self) {
                let _ = ofd_lock_at(self.0, DIRECTORY_LOCK, libc::F_UNLCK as i16, libc::F_OFD_SETLK);
            }
        }
        let h = self.held()?;
        let fd = h.fd;
        let until = std::time::Instant::now() + patience;
        let mut nap = Duration::from_micros(20);
        while let Err(e) = setlk(fd, DIRECTORY_LOCK, libc::F_WRLCK as i16, libc::F_OFD_SETLK) {
            if !matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EACCES)) {
                return Err(Error::io("locking a queue's lane directory (F_OFD_SETLK)", e));
            }
            if std::time::Instant::now() >= until {
                return Err(Error::Timeout);
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(2));
        }
        let _unlock = Unlock(fd);
        Ok(f())
    }

    /// The doorbell senders ring after each record and receivers watch while they poll.
    pub(crate) fn bell(&self) -> &Bell {
        &self.counters().bell.0
    }

    /// What a receive on the queue watches and learns while it polls awake.
    pub(crate) fn awake(&self) -> super::socket::Awake<'_> {
        super::socket::Awake { bell: self.bell(), patience: &self.patience }
    }

    /// A record was written to the queue's socket: it counts (see `queued`), and receivers
    /// polling awake or asleep are told.
    pub(crate) fn ring(&self) {
        self.counters().queued.fetch_add(1, Ordering::Relaxed);
        self.bell().ring();
    }

    /// A record is about to be written into the queue's socket (see `records`).
    pub(crate) fn record_coming(&self) {
        self.counters().records.fetch_add(1, Ordering::SeqCst);
    }

    /// A record was taken off the queue's socket, or one announced was not written.
    pub(crate) fn record_gone(&self) {
        let _ =
            self.counters().records.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    }

    /// Whether records may wait in the queue's socket (see `records`).
    pub(crate) fn may_have_records(&self) -> bool {
        self.counters().records.load(Ordering::SeqCst) != 0
    }

    /// Says that a process waits on the queue's socket for values (see `polled`).
    pub(crate) fn set_polled(&self) {
        self.counters().polled.store(1, Ordering::SeqCst);
    }

    /// Whether a process may wait on the queue's socket for values.
    pub(crate) fn polled(&self) -> bool {
        self.counters().polled.load(Ordering::SeqCst) != 0
    }

    /// The queue's capacity, `None` if it has none.
    pub(crate) fn capacity(&self) -> Option<usize> {
        let c = self.counters().capacity.load(Ordering::Relaxed);
        (c != UNBOUNDED).then_some(c as usize)
    }

    /// A record was taken off the queue's socket: the count goes down, never below zero.
    pub(crate) fn count_taken(&self) {
        let _ =
            self.counters().queued.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    }

    /// How many records the count says wait in the queue's socket: senders count a record
    /// after writing it, takers after taking it. A taker quick enough to come first has its
    /// decrement absorbed at zero, and a process killed between a write or a take and its
    /// count leaves one too many; when `empty` says the socket is empty, and no record was
    /// counted since the count was read, the count starts again from zero. So the count is
    /// high by the races in progress and those left by the dead, never low for long.
    pub(crate) fn queued(&self, empty: impl FnOnce() -> bool) -> usize {
        let q = &self.counters().queued;
        let n = q.load(Ordering::Relaxed);
        if n > 0 && empty() && q.compare_exchange(n, 0, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
            return 0;
        }
        q.load(Ordering::Relaxed) as usize
    }
}

/// An OFD lock (`l_type`) on the first byte, owned by the description `fd` refers to.
fn ofd_lock(fd: i32, l_type: i16) -> Result<()> {
    ofd_lock_at(fd, 0, l_type, libc::F_OFD_SETLK)
}

/// An OFD lock on byte `at`: `cmd` F_OFD_SETLK, or F_OFD_SETLKW to wait for it.
fn ofd_lock_at(fd: i32, at: i64, l_type: i16, cmd: i32) -> Result<()> {
    setlk(fd, at, l_type, cmd).map_err(|e| Error::io("fcntl(F_OFD_SETLK) on a queue", e))
}

fn setlk(fd: i32, at: i64, l_type: i16, cmd: i32) -> std::io::Result<()> {
    let mut fl = flock(l_type);
    fl.l_start = at;
    loop {
        // SAFETY: F_OFD_SETLK(W) with a valid descriptor and a valid struct flock (l_pid 0,
        // as OFD locks require), which lives across the call.
        if unsafe { libc::fcntl(fd, cmd, &fl) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

fn flock(l_type: i16) -> libc::flock {
    // SAFETY: struct flock is plain data; all-zero is a valid value to fill in.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = l_type;
    fl.l_whence = libc::SEEK_SET as i16;
    fl.l_len = 1;
    fl
}

/// A new description of the block, read-locked: a hold that lasts as long as it does.
fn locked_description(seg: &Segment) -> Result<OwnedFd> {
    let fd = seg.reopen()?;
    ofd_lock(fd.as_raw_fd(), libc::F_RDLCK as i16)?;
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A producer killed in its sleep leaves the waiter count raised: the next release that
    /// wakes nobody puts it right, so later releases stop paying a futex call each.
    /// A sealed memfd that is not a control block (an arena, or any page) is refused as one.
    #[test]
    fn a_memfd_that_is_not_a_control_block_is_refused() {
        let page = Segment::create(LEN, SharingStrategy::FileDescriptor).unwrap();
        let fd = page.fd().try_clone_to_owned().unwrap();
        let err = Control::open(fd).err().expect("refused");
        assert!(err.to_string().contains("control block"), "{err}");
        let real = Control::create(None).unwrap();
        assert!(Control::open(real.seg.fd().try_clone_to_owned().unwrap()).is_ok());
    }

    #[test]
    fn a_stale_waiter_count_heals_at_the_next_release() {
        let c = Control::create(Some(2)).unwrap();
        assert!(c.acquire(std::time::Duration::ZERO));
        c.counters().waiters.store(3, Ordering::SeqCst); // three sleepers, all since killed
        c.release();
        assert_eq!(c.counters().waiters.load(Ordering::SeqCst), 0);
        assert_eq!(c.counters().permits.load(Ordering::SeqCst), 2);
    }
}
