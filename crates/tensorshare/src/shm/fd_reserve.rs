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
//! The descriptors kept are `RESERVE` memfds of no size, close-on-exec. A message that
//! needs more new descriptors than that at the limit still fails halfway, and so can the
//! first receive to meet the limit if something else took the last descriptors since the
//! last message (the kernel drops a record's descriptors that find no room).

use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

use rustix::io::Errno;

use crate::{Error, Result};

/// Descriptors kept.
const RESERVE: usize = 4;

/// The kept descriptors, -1 where one was given up (or not made yet).
static KEPT: [AtomicI32; RESERVE] = [const { AtomicI32::new(-1) }; RESERVE];
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
    KEPT.iter().all(|k| k.load(Ordering::Acquire) >= 0)
}

/// Fills the empty slots.
fn refill() -> rustix::io::Result<()> {
    for k in &KEPT {
        if k.load(Ordering::Acquire) >= 0 {
            continue;
        }
        let fd = make()?.into_raw_fd();
        if k.compare_exchange(-1, fd, Ordering::AcqRel, Ordering::Acquire).is_err() {
            // SAFETY: `fd` was just made here and is in no slot: this is its only owner.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
        }
    }
    Ok(())
}

/// Closes one kept descriptor; false when none is left.
fn give_up_one() -> bool {
    for k in &KEPT {
        let fd = k.swap(-1, Ordering::AcqRel);
        if fd >= 0 {
            // SAFETY: the slot held `fd`, which `refill` made and put there as its only
            // owner; the swap took it out, so no other thread can take it too.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
            return true;
        }
    }
    false
}

/// At the start of a receive, before it takes a message: the reserve made, or made whole
/// again; an error naming the descriptor limit when it cannot be.
pub(crate) fn ready() -> Result<()> {
    if is_whole() {
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
            Err(limit_error("receiving a message, which may need new descriptors", e))
        }
        Err(e) => Err(Error::io("keeping descriptors in reserve for receiving", e)),
    }
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

    #[test]
    fn a_call_the_limit_refuses_runs_again_on_a_kept_descriptor_and_other_errors_pass() {
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
}
