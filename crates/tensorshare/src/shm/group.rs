//! Cleanup groups: no named segment outlives the processes that use it.
//!
//! A group is the tree of processes that share named segments: the first process that
//! starts workers or makes a named segment founds it (its pid is the group's *root*,
//! unless that names a group already: see `create_locked`), and the workers it starts
//! join it. Every member holds a shared `flock` on the group's lock file
//! `tensorshare_<root>_group`; the kernel drops a member's lock when it dies, by any means.
//! Every named segment of the group is called `tensorshare_<root>_<creator>_<random>`.
//!
//! The founder starts a *cleaner* (`process::cleaner`): this executable again, which does
//! its work in a constructor that runs before `main` (so it never runs the program itself),
//! in a session of its own from before it runs (so a signal to the founder's process group
//! misses it); it is no member and is not killed with the group. It waits for an exclusive
//! lock on the lock file, which the kernel grants once every member is gone, and then
//! removes every file of the group (`remove_group`). So after SIGKILL of any or all
//! members, nothing is left once the last one is gone, with nobody running a command; and
//! while any member lives, every segment (hence every message in flight) stays readable.
//! Should the cleaner die all the same (with a whole container or cgroup), the next group
//! founded on the directory removes what it left.
//!
//! The constructor runs in every program that links tensorshare, so the variable that
//! marks a cleaner proves nothing alone: a process acts as a cleaner only after the
//! handshake of `process::handshake` (its descriptor 3 is a socket the founder made, with a
//! hello carrying the launch's token), and only for the group of that founder, whose lock
//! file the hello carries: the cleaner checks that it is the very file it finds under the
//! group's name. Anything less, and the program runs as usual.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use rustix::fs::{FlockOperation, Mode, OFlags};
use rustix::io::Errno;

use super::{shm_dir, NAME_PREFIX};
use crate::{Error, Result};

/// Names the group a worker joins: the root's pid.
pub(crate) const GROUP_ENV: &str = "TENSORSHARE_SHM_GROUP";

struct Group {
    root: i32,
    /// The process that founded it, if this one did (a forked child inherits the record).
    founder: i32,
    /// Holds this process's shared lock; closing it leaves the group.
    _lock: OwnedFd,
    /// Read by the leak tests only (`raw::cleaner_pid`).
    #[cfg_attr(not(feature = "test-support"), allow(dead_code))]
    cleaner: Option<i32>,
}

static GROUP: Mutex<Option<Group>> = Mutex::new(None);

// Held only to read or set the record, never across a fork or a wait (founding or joining
// a group happens under `Founding`), so it is taken around forks as the layers' other
// locks are, and a forked child never finds it held.
crate::util::fork::guard_at_load!(crate::util::fork::Rank::Group, |out| out.push(Box::new(group())));

/// This process's group, locked.
fn group() -> std::sync::MutexGuard<'static, Option<Group>> {
    crate::util::lock(&GROUP)
}

/// The process in which a thread is founding or joining a group now (0: none), as its
/// `fork::stamp`. Not a mutex: founding starts the cleaner, a fork, which must not happen
/// under a lock that every fork takes, and a child forked meanwhile must not wait for a
/// thread it lacks. It finds an ancestor's stamp here, never its own, and founds or joins
/// a group itself.
static FOUNDING: AtomicU64 = AtomicU64::new(0);

/// This thread's turn to found or join this process's group.
struct Founding(u64);

impl Founding {
    fn enter() -> Founding {
        let me = crate::util::fork::stamp();
        loop {
            match FOUNDING.compare_exchange(0, me, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => return Founding(me),
                // Left by a thread of an ancestor this one was forked from.
                Err(other) if other != me => {
                    if FOUNDING.compare_exchange(other, me, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                        return Founding(me);
                    }
                }
                // Another thread of this process is at it: founding takes milliseconds, once.
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(1)),
            }
        }
    }
}

impl Drop for Founding {
    fn drop(&mut self) {
        let _ = FOUNDING.compare_exchange(self.0, 0, Ordering::Release, Ordering::Relaxed);
    }
}

/// The lock file's name for the group of `root`.
pub(crate) fn lock_name(root: i32) -> String {
    format!("{NAME_PREFIX}{root}_group")
}

/// Starts the cleaner of the group of `root`, whose lock file is given; returns its pid.
pub(crate) type StartCleaner = fn(BorrowedFd<'_>, i32) -> Result<i32>;

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
    if let Some(root) = current() {
        return Ok(root);
    }
    let _turn = Founding::enter();
    if let Some(root) = current() {
        return Ok(root);
    }
    let g = match join_inherited()? {
        Some(g) => g,
        None => found()?,
    };
    let root = g.root;
    *group() = Some(g);
    Ok(root)
}

/// The group this process was started in, joined, if it still exists: once locked, the
/// file must still be the one of that name (a group's cleaner, or a founder removing a dead
/// group, unlinks it while holding its exclusive lock, which this waits for).
fn join_inherited() -> Result<Option<Group>> {
    let Some(root) = std::env::var(GROUP_ENV).ok().and_then(|v| v.parse::<i32>().ok()) else {
        return Ok(None);
    };
    let Ok(lock) = open_lock(root) else { return Ok(None) };
    lock_shared(&lock)?;
    Ok(is_named(&lock, root).then(|| Group { root, founder: 0, _lock: lock, cleaner: None }))
}

fn found() -> Result<Group> {
    let (root, lock) = create_locked()?;
    // The lock first, then the cleaner: it must find a member when it starts waiting.
    let start = START_CLEANER.get().ok_or_else(|| {
        Error::Unsupported(
            "no cleaner can be started for a cleanup group: the process layer did not load".into(),
        )
    })?;
    let cleaner = start(lock.as_fd(), root)?;
    // Groups whose cleaner did not get to clean (it was killed, or died with them: a whole
    // container or cgroup killed at once) are removed by the next group founded on this
    // directory, once no member is left (as `shm gc` removes them).
    sweep_dead_groups(SWEEP_AFTER);
    Ok(Group { root, founder: crate::util::fork::pid(), _lock: lock, cleaner: Some(cleaner) })
}

/// How long the files of a dead group are left to its cleaner (or to `shm gc`, or whoever
/// else looks at them just now) before a founder removes them.
const SWEEP_AFTER: std::time::Duration = std::time::Duration::from_secs(60);

/// Removes the files of this user's groups that have no member left (their lock file free:
/// see `remove_if_dead`) and whose files are all older than `min_age`.
fn sweep_dead_groups(min_age: std::time::Duration) {
    use std::os::unix::fs::MetadataExt;
    let Ok(dir) = std::fs::read_dir(shm_dir()) else { return };
    let uid = rustix::process::geteuid().as_raw();
    let now = std::time::SystemTime::now();
    // Per root: whether every file is old enough.
    let mut roots: std::collections::HashMap<i32, bool> = std::collections::HashMap::new();
    for entry in dir.flatten() {
        let Ok(name) = entry.file_name().into_string() else { continue };
        let Some(root) = name.strip_prefix(NAME_PREFIX).and_then(|r| r.split('_').next()?.parse().ok())
        else {
            continue;
        };
        let Ok(meta) = entry.metadata() else { continue };
        if meta.uid() != uid {
            continue;
        }
        let old =
            meta.modified().ok().and_then(|m| now.duration_since(m).ok()).is_some_and(|age| age >= min_age);
        *roots.entry(root).or_insert(true) &= old;
    }
    for (root, old) in roots {
        if old {
            let _ = remove_if_dead(root);
        }
    }
}

/// Whether `lock` is the file named as the lock file of `root` now.
pub(crate) fn is_named(lock: &OwnedFd, root: i32) -> bool {
    let path = shm_dir().join(lock_name(root));
    match (rustix::fs::fstat(lock), rustix::fs::lstat(&path)) {
        (Ok(a), Ok(b)) => a.st_dev == b.st_dev && a.st_ino == b.st_ino,
        _ => false,
    }
}

/// Removes the files of the group of `root` if it has no member, holding the exclusive lock
/// of its lock file throughout: no process can join it meanwhile (a joiner's shared lock
/// waits, and then finds the name gone: see `ensure`), and no founder can take its name
/// (which exists until the end). A root without a lock file is left alone (to `shm gc`):
/// nothing tells a group that lost it from one being founded under that name just now.
/// Returns the names removed.
pub(crate) fn remove_if_dead(root: i32) -> Result<Vec<String>> {
    let lock = match open_lock(root) {
        Ok(lock) => lock,
        Err(_) => return Ok(Vec::new()),
    };
    if rustix::fs::flock(&lock, FlockOperation::NonBlockingLockExclusive).is_err() || !is_named(&lock, root) {
        return Ok(Vec::new()); // a member holds it, or the name is another file's by now
    }
    let removed = remove_group(root, false);
    drop(lock);
    removed
}

/// Roots that are not pids (a pid is at most 2^22, the kernel's limit): taken when the
/// founder's pid names a live group already (a process of another pid namespace sharing
/// this directory, such as another container with the host's /dev/shm) or a file that
/// cannot be replaced (one planted by another user of a shared directory).
const FIRST_NON_PID_ROOT: u32 = 1 << 23;

/// Creates the group's lock file already locked, and returns its root with it: the
/// founder's pid, or if that name cannot be had, a random root above any pid. The file is
/// made nameless (O_TMPFILE), locked, and only then given its name, so `shm gc` can never
/// see it unlocked and take a group being founded for a dead one.
fn create_locked() -> Result<(i32, OwnedFd)> {
    let dir = shm_dir();
    let fd = rustix::fs::open(dir, OFlags::TMPFILE | OFlags::RDWR | OFlags::CLOEXEC, Mode::RUSR | Mode::WUSR)
        .map_err(|e| Error::io(format!("O_TMPFILE in {}", dir.display()), e))?;
    lock_shared(&fd)?;
    let source = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&fd));
    let pid = rustix::process::getpid().as_raw_nonzero().get();
    let random_root = || {
        let mut b = [0u8; 4];
        crate::util::random_bytes(&mut b);
        let span = i32::MAX as u32 - FIRST_NON_PID_ROOT;
        (FIRST_NON_PID_ROOT + u32::from_le_bytes(b) % span) as i32
    };
    // The pid twice (a dead group's file in the way is removed first), then random roots.
    let roots = [pid, pid].into_iter().chain(std::iter::repeat_with(random_root).take(8));
    let mut last = None;
    for root in roots {
        let target = dir.join(lock_name(root));
        match rustix::fs::linkat(
            rustix::fs::CWD,
            source.as_str(),
            rustix::fs::CWD,
            &target,
            rustix::fs::AtFlags::SYMLINK_FOLLOW,
        ) {
            Ok(()) => return Ok((root, fd)),
            Err(Errno::EXIST) => {
                // Left by a dead group whose root had this number: ours to replace.
                let _ = remove_if_dead(root);
                last = Some(target);
            }
            Err(e) => return Err(Error::io(format!("linking {}", target.display()), e)),
        }
    }
    let last = last.map(|p| p.display().to_string()).unwrap_or_default();
    Err(Error::io(
        format!("naming a cleanup group's lock file in {}", dir.display()),
        std::io::Error::other(format!("every name tried is taken (the last: {last})")),
    ))
}

/// Leaves the current group and founds a new one with this process as founder (as
/// `setsid` does for sessions): its workers and segments are then cleaned up with it,
/// whatever the process that started it does. Returns the new root (this process's pid,
/// unless that names a group already: see `create_locked`).
#[cfg_attr(not(feature = "test-support"), allow(dead_code))]
pub(crate) fn new_group() -> Result<i32> {
    let _turn = Founding::enter();
    if let Some(g) = group().as_ref().filter(|g| g.cleaner.is_some() && g.founder == crate::util::fork::pid())
    {
        return Ok(g.root);
    }
    // Founded before the old group is left, so that the record is never empty meanwhile (an
    // allocator that reads it then would found one under its lock).
    let founded = found()?;
    let root = founded.root;
    let old = group().replace(founded);
    drop(old); // closes our lock: we leave the old group
    Ok(root)
}

/// The pid of the cleaner this process started for its group, if it founded one.
#[cfg_attr(not(feature = "test-support"), allow(dead_code))]
pub(crate) fn cleaner_pid() -> Option<i32> {
    group().as_ref().and_then(|g| g.cleaner)
}

/// The current group's root, if this process is in one.
pub(crate) fn current() -> Option<i32> {
    group().as_ref().map(|g| g.root)
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
        // Only what was removed: a name that stays (a directory, another user's file in a
        // sticky directory) is not reported as gone.
        names.retain(|n| rustix::fs::unlink(dir.join(n)).is_ok());
    }
    Ok(names)
}

/// Whether any process still holds the group of `root` (its lock file exists and is
/// locked by a member).
pub(crate) fn group_alive(root: i32) -> bool {
    let path = shm_dir().join(lock_name(root));
    let lock = match rustix::fs::open(&path, OFlags::RDWR | OFlags::CLOEXEC | OFlags::NOFOLLOW, Mode::empty())
    {
        Ok(lock) => lock,
        // No lock file: no member. Any other failure (no descriptor left, no permission, not
        // a file) tells nothing, and a group is never taken for dead on nothing.
        Err(Errno::NOENT) => return false,
        Err(_) => return true,
    };
    match rustix::fs::flock(lock.as_fd(), FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => false, // closing `lock` releases it at once
        Err(_) => true,
    }
}
