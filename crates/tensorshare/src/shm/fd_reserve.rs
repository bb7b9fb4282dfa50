//! A few descriptors kept in hand, so that a receive that meets the process's descriptor
//! limit (RLIMIT_NOFILE) halfway through a message it has taken can still finish it, and the
//! receives after it refuse before taking anything until descriptors are free again.
//!
//! A message leaves its queue or pipe before it is decoded, and decoding may need new
//! descriptors (this process's own description of each arena it has not mapped yet): a
//! failure then would lose the message, and what it held would go back to its sender.
//! Instead:
//! - [`rescue`] runs a call that makes a descriptor, and when the limit refuses it, gives
//!   up one kept descriptor and tries again;
//! - [`ready`], at the start of every receive (once the last message's borrowed
//!   descriptors are closed: `arena::settle`), puts back what was given up; when it cannot,
//!   the receive fails with the limit's error before it takes a message;
//! - [`headroom`], before a receive takes a record whose descriptors the kernel delivers
//!   (and drops, past the limit), gives up every kept descriptor, once the limit has been
//!   met, so that they have room.
//!
//! The descriptors kept are `RESERVE` memfds of no size, close-on-exec (where memfds cannot
//! be made for another reason, none are kept and receives go on without). A message that
//! needs more new descriptors than that at the limit still fails halfway, and so can the
//! first receive to meet the limit if something else took the last descriptors since the
//! last message (the kernel drops a record's descriptors that find no room): the error then
//! says that the message is lost.

use std::os::fd::{AsFd, FromRawFd, IntoRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use rustix::io::Errno;

use crate::{Error, Result};

/// Descriptors kept: enough for a message that brings up to 4 arenas new to the receiver
/// (each a descriptor in the record, and this process's own description of it).
const RESERVE: usize = 8;

/// The kept descriptors, each with the low half of its file's inode number (`kept`), or
/// `EMPTY` where one was given up (or not made yet).
static KEPT: [AtomicU64; RESERVE] = [const { AtomicU64::new(EMPTY) }; RESERVE];
const EMPTY: u64 = u64::MAX;

/// The device of the kernel's memfd mount, which every kept descriptor's file is on (0
/// until the first is made). With it, the 32-bit inode number the kernel gives such a file
/// names it alone among the files open.
static MEMFD_DEV: AtomicU64 = AtomicU64::new(0);

fn kept(fd: OwnedFd) -> rustix::io::Result<u64> {
    let st = rustix::fs::fstat(fd.as_fd())?;
    MEMFD_DEV.store(st.st_dev, Ordering::Relaxed);
    let fd = fd.into_raw_fd() as u32;
    Ok(u64::from(fd) << 32 | u64::from(st.st_ino as u32))
}
/// Whether a reserve cannot be kept here at all (memfd_create refused for a reason other
/// than the descriptor limit: a seccomp filter, an old kernel): receives then go on as
/// they would without one.
static UNAVAILABLE: AtomicBool = AtomicBool::new(false);
/// Whether the limit has refused a descriptor since the reserve was last made whole with
/// room to spare (see [`ready`]).
static MET: AtomicBool = AtomicBool::new(false);

fn limit_error(what: &str, e: Errno) -> Error {
    Error::io(
        format!(
            "{what}: this process has reached its descriptor limit (RLIMIT_NOFILE); raise it or \
             hold fewer shared segments"
        ),
        e,
    )
}

/// A new descriptor to keep.
fn make() -> rustix::io::Result<OwnedFd> {
    rustix::fs::memfd_create("tensorshare-fd-reserve", rustix::fs::MemfdFlags::CLOEXEC)
}

fn is_whole() -> bool {
    KEPT.iter().all(|k| k.load(Ordering::Acquire) != EMPTY)
}

/// Fills the empty slots.
fn refill() -> rustix::io::Result<()> {
    for k in &KEPT {
        if k.load(Ordering::Acquire) != EMPTY {
            continue;
        }
        let entry = kept(make()?)?;
        if k.compare_exchange(EMPTY, entry, Ordering::AcqRel, Ordering::Acquire).is_err() {
            // SAFETY: the descriptor was just made here and is in no slot: this is its only
            // owner.
            drop(unsafe { OwnedFd::from_raw_fd((entry >> 32) as i32) });
        }
    }
    Ok(())
}

/// Closes one kept descriptor; false when none is left.
fn give_up_one() -> bool {
    for k in &KEPT {
        let entry = k.swap(EMPTY, Ordering::AcqRel);
        if entry == EMPTY {
            continue;
        }
        let (fd, ino) = ((entry >> 32) as i32, entry as u32);
        // Code that closes every descriptor (a daemon's, a forked child's before it runs
        // other code) may have closed this one, and its number may name another file now:
        // closed only if it is still the memfd made for it.
        let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: `fstat` writes one `struct stat` into `st`, which lives across the call; on
        // a number that is not open it fails with EBADF and writes nothing.
        let found = unsafe { libc::fstat(fd, st.as_mut_ptr()) } == 0;
        let ours = found && {
            // SAFETY: `fstat` returned 0, so it filled `st` in.
            let st = unsafe { st.assume_init() };
            st.st_dev == MEMFD_DEV.load(Ordering::Relaxed) && st.st_ino as u32 == ino
        };
        if ours {
            // SAFETY: the slot held `fd`, which `refill` made and put there as its only
            // owner, and it is still that file; the swap took it out, so no other thread
            // can take it too.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
        }
        return true;
    }
    false
}

/// At the start of a receive, before it takes a message: the reserve made, or made whole
/// again; an error naming the descriptor limit when it cannot be.
pub(crate) fn ready() -> Result<()> {
    if is_whole() || UNAVAILABLE.load(Ordering::Relaxed) {
        return Ok(());
    }
    match refill() {
        Ok(()) => {
            if MET.load(Ordering::Acquire) && has_room_beyond() {
                MET.store(false, Ordering::Release);
            }
            Ok(())
        }
        Err(e @ (Errno::MFILE | Errno::NFILE)) => {
            MET.store(true, Ordering::Release);
            Err(limit_error("receiving a message, which may need new descriptors (none was taken)", e))
        }
        Err(_) => {
            UNAVAILABLE.store(true, Ordering::Relaxed);
            Ok(())
        }
    }
}

/// The kernel cut a received record's descriptors off at the limit: the next receives give
/// the reserve up first (see [`headroom`]).
pub(crate) fn met() {
    MET.store(true, Ordering::Release);
}

/// Whether `RESERVE` more descriptors than those kept can be made now.
fn has_room_beyond() -> bool {
    let probe: Vec<OwnedFd> = (0..RESERVE).map_while(|_| make().ok()).collect();
    probe.len() == RESERVE
}

/// Runs `f`, which makes a descriptor; when the descriptor limit refuses it, gives up a
/// kept descriptor and runs it again, until none is left.
pub(crate) fn rescue<T>(mut f: impl FnMut() -> rustix::io::Result<T>) -> rustix::io::Result<T> {
    loop {
        match f() {
            Err(Errno::MFILE) => {
                MET.store(true, Ordering::Release);
                if !give_up_one() {
                    return Err(Errno::MFILE);
                }
            }
            r => return r,
        }
    }
}

/// Gives up one kept descriptor after the limit refused one in a way that `rescue` cannot
/// retry by itself (the caller retries); false when none is left.
pub(crate) fn give_one() -> bool {
    MET.store(true, Ordering::Release);
    give_up_one()
}

/// Before a receive that takes a record with descriptors: once the limit has been met,
/// gives up every kept descriptor, so that the kernel has room for the record's (it drops
/// those it cannot place, and the message with them). The next [`ready`] takes them back.
pub(crate) fn headroom() {
    if MET.load(Ordering::Acquire) {
        while give_up_one() {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tests here give up and close kept descriptors: one at a time.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn a_call_the_limit_refuses_runs_again_on_a_kept_descriptor_and_other_errors_pass() {
        let _one = crate::util::lock(&ONE_AT_A_TIME);
        ready().unwrap();
        let mut calls = 0;
        let r = rescue(|| {
            calls += 1;
            if calls < 3 {
                Err(Errno::MFILE)
            } else {
                Ok(calls)
            }
        });
        // Other tests' receives may make the reserve whole again meanwhile: two refusals are
        // within what it holds either way.
        assert_eq!(r, Ok(3));
        let mut calls = 0;
        let r: rustix::io::Result<()> = rescue(|| {
            calls += 1;
            Err(Errno::NOMEM)
        });
        assert_eq!((r, calls), (Err(Errno::NOMEM), 1), "only the descriptor limit is retried");
        ready().unwrap();
        let mut calls = 0;
        let r: rustix::io::Result<()> = rescue(|| {
            calls += 1;
            Err(Errno::MFILE)
        });
        assert_eq!(r, Err(Errno::MFILE), "a refusal comes through once nothing is left to give");
        assert!(calls > RESERVE, "every kept descriptor was tried: {calls} calls");
        ready().unwrap();
    }

    #[test]
    fn a_kept_descriptor_closed_behind_its_back_is_forgotten_not_closed_again() {
        let _one = crate::util::lock(&ONE_AT_A_TIME);
        ready().unwrap();
        // Code that closes every descriptor closes the kept ones; their numbers go to new
        // files, which giving up the reserve must leave open.
        let mut others = Vec::new();
        for k in &KEPT {
            let entry = k.load(Ordering::Acquire);
            if entry != EMPTY {
                // SAFETY: test-only: closes a kept descriptor as a closerange would, leaving
                // its entry behind; nothing else here uses that number until it is reused.
                unsafe { libc::close((entry >> 32) as i32) };
                others.push(make().unwrap());
            }
        }
        let r: rustix::io::Result<()> = rescue(|| Err(Errno::MFILE));
        assert_eq!(r, Err(Errno::MFILE));
        for fd in &others {
            assert!(rustix::fs::fstat(fd.as_fd()).is_ok(), "another file's descriptor was closed");
        }
        ready().unwrap();
    }
}
