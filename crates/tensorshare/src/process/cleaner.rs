//! The shared-memory cleaner of a cleanup group (see `shm::group`): started by the group's
//! founder as this executable again, proven by the same handshake as a worker, it waits
//! until every member is gone and then removes the group's files.
//!
//! The constructor here runs in every process of a program that links tensorshare, before
//! `main`: it tells `shm::group` how to start a cleaner (the group is below this layer and
//! does not reach up), and in a proven cleaner it does the cleaner's work and exits.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::fs::FlockOperation;
use rustix::io::Errno;

use super::handshake::{arrive, Arrival, Invitation, Invited, Role};
use super::launch::exec_helper;
use super::worker::exit_now;
use crate::shm::group;
use crate::{Error, Result};

/// Set in a cleaner.
const CLEANER_ENV: &str = "TENSORSHARE_SHM_CLEANER";
/// The root of the group a cleaner cleans (its founder's pid, unless that was taken: see
/// `shm::group`). Proven by the lock file in the hello, which must be the file of that name.
const CLEANER_ROOT_ENV: &str = "TENSORSHARE_SHM_CLEANER_ROOT";

/// Starts the cleaner of this process's group, of `root`, whose lock file is `lock`.
fn start_cleaner(lock: BorrowedFd<'_>, root: i32) -> Result<i32> {
    // Started as a worker is, with the group's lock file in its hello as the proof of which
    // group it cleans. Nothing else passes on the socket: the cleaner outlives its parent.
    // It is in a session of its own from the start, before it runs anything, so that a
    // signal to the founder's process group (a shell's, a launcher's) cannot reach it.
    let (ours, theirs) = crate::channel::socket::pair()?;
    let invitation = Invitation::send(ours.as_fd(), &[lock])?;
    let pid = exec_helper(CLEANER_ENV, theirs, &invitation, &[(CLEANER_ROOT_ENV, root.to_string())], true)?;
    Ok(pid.as_raw_nonzero().get())
}

/// Runs in every process of a program that links tensorshare, before `main`: it tells
/// `shm::group` how to start a cleaner, and in the cleaner it does the cleaner's work and exits, so the cleaner never runs the program's own `main`,
/// whether or not that calls [`init`](crate::init). Anywhere else (the variable unset, or
/// not proven, see the module docs) it returns and the program runs.
#[used]
#[link_section = ".init_array"]
static CLEANER_HOOK: extern "C" fn() = cleaner_hook;

extern "C" fn cleaner_hook() {
    // Before main: this process has one thread, as `arrive` requires.
    group::set_cleaner_starter(start_cleaner);
    match arrive(CLEANER_ENV, Role::Cleaner) {
        Arrival::Program => {}
        Arrival::Invited(invited) => run_cleaner(invited),
        Arrival::Orphaned => exit_now(0),
        Arrival::Refused { reason, .. } => {
            eprintln!("tensorshare: shared-memory cleaner: {reason}");
            exit_now(1)
        }
    }
}

/// The cleaner's life (in the re-executed process): wait until every member is gone,
/// remove the group's files, exit.
fn run_cleaner(invited: Invited) -> ! {
    drop(invited.sock);
    // The founder's pid is the root unless it said otherwise.
    let root = std::env::var(CLEANER_ROOT_ENV).ok().and_then(|r| r.parse().ok()).unwrap_or(invited.parent);
    let code = match clean_when_dead(root, invited.fds) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("tensorshare: shared-memory cleaner: {e}");
            1
        }
    };
    exit_now(code)
}

/// Cleans the group of `root` once its members are gone; `proof` is what the founder
/// attached to the hello: the group's lock file.
fn clean_when_dead(root: i32, proof: Vec<OwnedFd>) -> Result<()> {
    // A lock of our own: flock belongs to an open file, and the founder's is shared.
    let lock = group::open_lock(root)?;
    let same_file = |a: &OwnedFd, b: &OwnedFd| match (rustix::fs::fstat(a), rustix::fs::fstat(b)) {
        (Ok(a), Ok(b)) => a.st_dev == b.st_dev && a.st_ino == b.st_ino,
        _ => false,
    };
    match proof.as_slice() {
        [founders] if same_file(founders, &lock) => {}
        _ => {
            return Err(Error::invalid(format!(
                "the founder of group {root} did not send the lock file {}; nothing removed",
                group::lock_name(root)
            )))
        }
    }
    drop(proof);
    loop {
        match rustix::fs::flock(&lock, FlockOperation::LockExclusive) {
            Ok(()) => break,
            Err(Errno::INTR) => continue,
            Err(e) => return Err(Error::io("flock(LOCK_EX) on the group lock", e)),
        }
    }
    // Still the file of that name: otherwise the group was removed already (by a founder
    // that found it dead: see `group::remove_if_dead`), and the name, if it is there, is a
    // later group's.
    if !group::is_named(&lock, root) {
        return Ok(());
    }
    group::remove_group(root, false).map(|_| ())
}
