//! Cleanup groups: no named segment outlives the processes that use it.
//!
//! A group is the tree of processes that share named segments: the first process that
//! starts workers or makes a named segment founds it (its pid is the group's *root*), and
//! the workers it starts join it. Every member holds a shared `flock` on the group's lock
//! file `tensorshare_<root>_group`; the kernel drops a member's lock when it dies, by any
//! means. Every named segment of the group is called `tensorshare_<root>_<creator>_<random>`.
//!
//! The founder starts a *cleaner* (`process::cleaner`): this executable again, which does
//! its work in a constructor that runs before `main` (so it never runs the program itself),
//! in a session of its own; it is no member and is not killed with the group. It waits for
//! an exclusive lock on the lock file, which the kernel grants once every member is gone,
//! and then removes every file of the group (`remove_group`). So after SIGKILL of any or all members, nothing is
//! left once the last one is gone, with nobody running a command; and while any member
//! lives, every segment (hence every message in flight) stays readable.
//!
//! The constructor runs in every program that links tensorshare, so the variable that
//! marks a cleaner proves nothing alone: a process acts as a cleaner only after the
//! handshake of `process::handshake` (its descriptor 3 is a socket the founder made, with a
//! hello carrying the launch's token), and only for the group of that founder, whose lock
//! file the hello carries: the cleaner checks that it is the very file it finds under the
//! group's name. Anything less, and the program runs as usual.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Mutex, OnceLock};

use rustix::fs::{FlockOperation, Mode, OFlags};
use rustix::io::Errno;

use super::{shm_dir, NAME_PREFIX};
use crate::{Error, Result};

/// Names the group a worker joins: the root's pid.
pub(crate) const GROUP_ENV: &str = "TENSORSHARE_SHM_GROUP";

struct Group {
    root: i32,
    /// Holds this process's shared lock; closing it leaves the group.
    _lock: OwnedFd,
    /// Read by the leak tests only (`raw::cleaner_pid`).
    #[cfg_attr(not(feature = "test-support"), allow(dead_code))]
    cleaner: Option<i32>,
}

static GROUP: Mutex<Option<Group>> = Mutex::new(None);

/// The lock file's name for the group of `root`.
pub(crate) fn lock_name(root: i32) -> String {
    format!("{NAME_PREFIX}{root}_group")
}

/// Starts the cleaner of a group whose lock file is given; returns its pid.
pub(crate) type StartCleaner = fn(BorrowedFd<'_>) -> Result<i32>;

/// How a founder starts its cleaner. A cleaner is this executable re-executed and proven
/// by the same handshake as a worker, which is the process layer's business: that layer
/// sets this before `main` (`process::cleaner`), so the group only knows that one must run.
static START_CLEANER: OnceLock<StartCleaner> = OnceLock::new();

/// Sets how cleaners are started (once, before `main`).
pub(crate) fn set_cleaner_starter(start: StartCleaner) {
    let _ = START_CLEANER.set(start);
}

pub(crate) fn open_lock(root: i32) -> Result<OwnedFd> {
    let path = shm_dir().join(lock_name(root));
    rustix::fs::open(&path, OFlags::RDWR | OFlags::CLOEXEC | OFlags::NOFOLLOW, Mode::empty())
        .map_err(|e| Error::io(format!("opening the group lock {}", path.display()), e))
}

fn lock_shared(fd: &OwnedFd) -> Result<()> {
    loop {
        match rustix::fs::flock(fd, FlockOperation::LockShared) {
            Ok(()) => return Ok(()),
            Err(Errno::INTR) => continue,
            Err(e) => return Err(Error::io("flock(LOCK_SH) on the group lock", e)),
        }
    }
}

/// The group new workers join, if named segments are in use in this process: its group
/// (founded or joined before), or one founded now under the file_system strategy. `None`
/// with the file_descriptor strategy and no group yet: nothing is made in the shared-memory
/// directory, which may be read-only or absent then.
pub(crate) fn for_workers() -> Result<Option<i32>> {
    if let Some(root) = current() {
        return Ok(Some(root));
    }
    if crate::get_sharing_strategy() == crate::SharingStrategy::FileSystem {
        return ensure().map(Some);
    }
    Ok(None)
}

/// The root of this process's group, joining the inherited one or founding one.
pub(crate) fn ensure() -> Result<i32> {
    let mut g = crate::util::lock(&GROUP);
    if let Some(g) = g.as_ref() {
        return Ok(g.root);
    }
    if let Some(root) = std::env::var(GROUP_ENV).ok().and_then(|v| v.parse::<i32>().ok()) {
        // Join the group this process was started in, if it still exists.
        if let Ok(lock) = open_lock(root) {
            lock_shared(&lock)?;
            *g = Some(Group { root, _lock: lock, cleaner: None });
            return Ok(root);
        }
    }
    *g = Some(found()?);
    Ok(g.as_ref().expect("just founded").root)
}

fn found() -> Result<Group> {
    let root = rustix::process::getpid().as_raw_nonzero().get();
    let lock = create_locked(root)?;
    // The lock first, then the cleaner: it must find a member when it starts waiting.
    let start = START_CLEANER.get().ok_or_else(|| {
        Error::Unsupported(
            "no cleaner can be started for a cleanup group: the process layer did not load".into(),
        )
    })?;
    let cleaner = start(lock.as_fd())?;
    Ok(Group { root, _lock: lock, cleaner: Some(cleaner) })
}

/// Creates the group's lock file already locked: it is made nameless (O_TMPFILE), locked,
/// and only then given its name, so `shm gc` can never see it unlocked and take a group
/// being founded for a dead one.
fn create_locked(root: i32) -> Result<OwnedFd> {
    let dir = shm_dir();
    let fd = rustix::fs::open(dir, OFlags::TMPFILE | OFlags::RDWR | OFlags::CLOEXEC, Mode::RUSR | Mode::WUSR)
        .map_err(|e| Error::io(format!("O_TMPFILE in {}", dir.display()), e))?;
    lock_shared(&fd)?;
    let target = dir.join(lock_name(root));
    let source = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&fd));
    for _ in 0..2 {
        match rustix::fs::linkat(
            rustix::fs::CWD,
            source.as_str(),
            rustix::fs::CWD,
            &target,
            rustix::fs::AtFlags::SYMLINK_FOLLOW,
        ) {
            Ok(()) => return Ok(fd),
            Err(Errno::EXIST) if !group_alive(root) => {
                // Left by a dead group whose root had this pid: it is ours to replace.
                let _ = remove_group(root, false);
            }
            Err(Errno::EXIST) => {
                return Err(Error::Unsupported(format!(
                    "a live cleanup group already has root pid {root} (its root died and the pid was reused)"
                )))
            }
            Err(e) => return Err(Error::io(format!("linking {}", target.display()), e)),
        }
    }
    Err(Error::io(format!("linking {}", target.display()), std::io::Error::other("the name stays taken")))
}

/// Leaves the current group and founds a new one with this process as root (as `setsid`
/// does for sessions): its workers and segments are then cleaned up with it, whatever the
/// process that started it does. Returns the new root (this process's pid).
#[cfg_attr(not(feature = "test-support"), allow(dead_code))]
pub(crate) fn new_group() -> Result<i32> {
    let mut g = crate::util::lock(&GROUP);
    let me = rustix::process::getpid().as_raw_nonzero().get();
    if g.as_ref().is_some_and(|g| g.root == me) {
        return Ok(me);
    }
    *g = None; // closes our lock: we leave the old group
    *g = Some(found()?);
    Ok(me)
}

/// The pid of the cleaner this process started for its group, if it founded one.
#[cfg_attr(not(feature = "test-support"), allow(dead_code))]
pub(crate) fn cleaner_pid() -> Option<i32> {
    crate::util::lock(&GROUP).as_ref().and_then(|g| g.cleaner)
}

/// The current group's root, if this process is in one.
pub(crate) fn current() -> Option<i32> {
    crate::util::lock(&GROUP).as_ref().map(|g| g.root)
}

/// Removes (or, with `dry_run`, lists) every file of the group of `root`, the lock file
/// last. Returns the names.
pub(crate) fn remove_group(root: i32, dry_run: bool) -> Result<Vec<String>> {
    let prefix = format!("{NAME_PREFIX}{root}_");
    let dir = shm_dir();
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(format!("listing {}", dir.display()), e))?
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(&prefix))
        .collect();
    let lock = lock_name(root);
    names.sort_by_key(|n| *n == lock);
    if !dry_run {
        for n in &names {
            let _ = rustix::fs::unlink(dir.join(n));
        }
    }
    Ok(names)
}

/// Whether any process still holds the group of `root` (its lock file exists and is
/// locked by a member).
pub(crate) fn group_alive(root: i32) -> bool {
    let Ok(lock) = open_lock(root) else { return false };
    match rustix::fs::flock(lock.as_fd(), FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => false, // closing `lock` releases it at once
        Err(_) => true,
    }
}
