//! A queue's control block: a small memfd that every process holding the queue maps.
//!
//! It carries the capacity semaphore (a futex word in shared memory) and tells who holds
//! the queue: each holding process keeps a POSIX read lock on its first byte, which the
//! kernel drops when the process dies by any means. "Does anyone else hold this queue?" is
//! one `F_GETLK`.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::shm::{Segment, SegmentId};
use crate::{Error, Result, SharingStrategy};

const LEN: usize = 4096;
/// `permits` value of a queue without a capacity.
const UNBOUNDED: u32 = u32::MAX;

#[repr(C)]
struct Block {
    /// Free places in the queue (UNBOUNDED: no limit).
    permits: AtomicU32,
    /// Producers asleep on `permits`.
    waiters: AtomicU32,
}

pub(crate) struct Control {
    /// A one-page memfd that every holder of the queue maps.
    seg: Arc<Segment>,
    /// The process that holds the lock (a forked child must take its own).
    locked_by: AtomicI32,
}

impl Control {
    /// A new control block for a queue of `capacity` places (None: unbounded).
    pub(crate) fn create(capacity: Option<u32>) -> Result<Control> {
        let c = Control::with(Segment::create(LEN, SharingStrategy::FileDescriptor)?)?;
        c.block().permits.store(capacity.unwrap_or(UNBOUNDED), Ordering::Relaxed);
        Ok(c)
    }

    /// Maps a control block received from another process.
    pub(crate) fn open(fd: OwnedFd) -> Result<Control> {
        Control::with(Segment::from_fd(fd, LEN)?)
    }

    fn with(seg: Segment) -> Result<Control> {
        let c = Control { seg: Arc::new(seg), locked_by: AtomicI32::new(0) };
        c.hold()?;
        Ok(c)
    }

    fn block(&self) -> &Block {
        // SAFETY: the segment is at least LEN bytes (Segment checks what it maps),
        // page-aligned, lives as long as self, and Block is two atomics: valid for any bit
        // pattern and meant to be used by several processes at once.
        unsafe { &*self.seg.as_ptr().cast::<Block>() }
    }

    /// The segment, to send along with the queue.
    pub(crate) fn segment(&self) -> &Arc<Segment> {
        &self.seg
    }

    /// (device, inode): the queue's identity in every process.
    pub(crate) fn id(&self) -> Result<(u64, u64)> {
        match self.seg.id() {
            &SegmentId::Inode { dev, ino } => Ok((dev, ino)),
            SegmentId::Name(_) => Err(Error::invalid("a queue's control block must be a memfd")),
        }
    }

    /// Takes this process's read lock (again: closing any descriptor of the file, or a
    /// fork, loses it).
    pub(crate) fn hold(&self) -> Result<()> {
        let pid = rustix::process::getpid().as_raw_nonzero().get();
        lock(self.seg.fd().as_raw_fd(), libc::F_SETLK, libc::F_RDLCK as i16)
            .map_err(|e| Error::io("fcntl(F_SETLK) on a queue", e))?;
        self.locked_by.store(pid, Ordering::Relaxed);
        Ok(())
    }

    /// Whether a process other than this one holds the queue.
    pub(crate) fn others_alive(&self) -> bool {
        let pid = rustix::process::getpid().as_raw_nonzero().get();
        if self.locked_by.load(Ordering::Relaxed) != pid {
            // Forked since the lock was taken: take ours, or the parent looks alone.
            let _ = self.hold();
        }
        let mut fl = flock(libc::F_WRLCK as i16);
        // SAFETY: F_GETLK with a valid descriptor and a valid, initialised struct flock.
        let r = unsafe { libc::fcntl(self.seg.fd().as_raw_fd(), libc::F_GETLK, &mut fl) };
        // On error, assume someone is there: waiting on is safer than a false hang-up.
        r != 0 || fl.l_type != libc::F_UNLCK as i16
    }

    /// Takes a place in the queue, waiting up to `slice` for one. Returns whether it got one.
    pub(crate) fn acquire(&self, slice: Duration) -> bool {
        let b = self.block();
        let mut p = b.permits.load(Ordering::Acquire);
        // A consumer usually frees a place within microseconds: wait for it awake first, as
        // a sleep and a wake-up cost more than that.
        let spin_until = std::time::Instant::now() + super::socket::SPIN;
        while p == 0 && std::time::Instant::now() < spin_until {
            std::hint::spin_loop();
            p = b.permits.load(Ordering::Acquire);
        }
        loop {
            if p == UNBOUNDED {
                return true;
            }
            if p == 0 {
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
                b.waiters.fetch_sub(1, Ordering::SeqCst);
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

    /// Gives a place back (after a `get`, or a failed `put`).
    pub(crate) fn release(&self) {
        let b = self.block();
        if b.permits.load(Ordering::Relaxed) == UNBOUNDED {
            return;
        }
        b.permits.fetch_add(1, Ordering::AcqRel);
        if b.waiters.load(Ordering::SeqCst) > 0 {
            let _ = rustix::thread::futex::wake(&b.permits, rustix::thread::futex::Flags::empty(), 1);
        }
    }
}

fn flock(l_type: i16) -> libc::flock {
    // SAFETY: struct flock is plain data; all-zero is a valid value to fill in.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = l_type;
    fl.l_whence = libc::SEEK_SET as i16;
    fl.l_start = 0;
    fl.l_len = 1;
    fl
}

/// rustix offers only whole-file OFD locks (shared across processes through inherited
/// descriptors); liveness needs per-process POSIX record locks, hence libc here.
fn lock(fd: i32, cmd: i32, l_type: i16) -> std::io::Result<()> {
    let fl = flock(l_type);
    // SAFETY: fcntl with a lock command, a valid descriptor and a valid struct flock.
    let r = unsafe { libc::fcntl(fd, cmd, &fl) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
