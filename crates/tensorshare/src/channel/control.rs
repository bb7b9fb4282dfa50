//! A queue's control block: a small memfd that every process holding the queue maps.
//!
//! It carries the capacity semaphore (a futex word in shared memory) and tells who holds
//! the queue: each holding process keeps a POSIX read lock on its first byte, which the
//! kernel drops when the process dies by any means. "Does anyone else hold this queue?" is
//! one `F_GETLK`.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};
use std::time::Duration;

use rustix::mm::{MapFlags, ProtFlags};

use crate::{Error, Result};

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
    fd: std::sync::Arc<OwnedFd>,
    ptr: std::ptr::NonNull<Block>,
    /// The process that holds the lock (a forked child must take its own).
    locked_by: AtomicI32,
}

// SAFETY: the mapping is shared memory accessed only through atomics.
unsafe impl Send for Control {}
// SAFETY: as above.
unsafe impl Sync for Control {}

impl Control {
    /// A new control block for a queue of `capacity` places (None: unbounded).
    pub(crate) fn create(capacity: Option<u32>) -> Result<Control> {
        let fd = rustix::fs::memfd_create("tensorshare-queue", rustix::fs::MemfdFlags::CLOEXEC)
            .map_err(|e| Error::io("memfd_create for a queue", e))?;
        rustix::fs::ftruncate(&fd, LEN as u64).map_err(|e| Error::io("ftruncate of a queue's memfd", e))?;
        let c = Control::map(fd)?;
        c.block().permits.store(capacity.unwrap_or(UNBOUNDED), Ordering::Relaxed);
        Ok(c)
    }

    /// Maps a control block received from another process.
    pub(crate) fn open(fd: OwnedFd) -> Result<Control> {
        let st = rustix::fs::fstat(&fd).map_err(|e| Error::io("fstat of a queue's memfd", e))?;
        if st.st_size < LEN as i64 {
            return Err(Error::invalid("a queue's control block is too small"));
        }
        Control::map(fd)
    }

    fn map(fd: OwnedFd) -> Result<Control> {
        // SAFETY: a fresh shared mapping of LEN bytes of a file at least LEN bytes long.
        let p = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                LEN,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )
        }
        .map_err(|e| Error::io("mmap of a queue's control block", e))?;
        let ptr =
            std::ptr::NonNull::new(p.cast::<Block>()).ok_or_else(|| Error::invalid("mmap returned null"))?;
        let c = Control { fd: std::sync::Arc::new(fd), ptr, locked_by: AtomicI32::new(0) };
        c.hold()?;
        Ok(c)
    }

    fn block(&self) -> &Block {
        // SAFETY: the mapping is LEN bytes, page-aligned, lives as long as self, and Block
        // is two atomics (valid for any bit pattern, shared access by design).
        unsafe { self.ptr.as_ref() }
    }

    pub(crate) fn fd(&self) -> &std::sync::Arc<OwnedFd> {
        &self.fd
    }

    /// (device, inode): the queue's identity in every process.
    pub(crate) fn id(&self) -> Result<(u64, u64)> {
        let st = rustix::fs::fstat(&*self.fd).map_err(|e| Error::io("fstat of a queue's memfd", e))?;
        Ok((st.st_dev, st.st_ino))
    }

    /// Takes this process's read lock (again: closing any descriptor of the file, or a
    /// fork, loses it).
    pub(crate) fn hold(&self) -> Result<()> {
        let pid = rustix::process::getpid().as_raw_nonzero().get();
        lock(self.fd.as_fd().as_raw_fd(), libc::F_SETLK, libc::F_RDLCK as i16)
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
        let r = unsafe { libc::fcntl(self.fd.as_fd().as_raw_fd(), libc::F_GETLK, &mut fl) };
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

impl Drop for Control {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`; nothing refers to it after drop.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), LEN) };
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
