//! [`StartMethod::Fork`](super::StartMethod::Fork): what a forked worker may find, and what
//! it must not.
//!
//! A forked child has one thread, the one that forked; every lock another thread of the
//! parent held at that moment stays held in the child for good: the standard library's
//! stdout, stderr and environment locks, the program's mutexes. So tensorshare forks only
//! from a parent that has one thread (counted in `/proc/self/status`), unless the program
//! promises, by the `unsafe` [`allow_fork_with_threads`], that its job takes no such lock.
//! Either way the worker itself takes none on its way out: it leaves with `_exit`.
//!
//! A forked child also holds every descriptor of its parent. A socket or pipe end held by
//! a worker that was never given it keeps the conversation alive: the peer waiting for a
//! hang-up (another worker of a pool, whose parent let go of its end) never sees one. So
//! the child replaces every socket and pipe it was not given (all but the job socket and
//! the standard streams) with `/dev/null`. It keeps files and shared memory (memfds, named
//! segments, the cleanup group's lock): the tensors and globals it inherits refer to them.
//! The numbers stay taken rather than closed, so that a stale handle in inherited memory
//! can never reach a file the worker opens later; and the worker forgets the queues its
//! parent had, so that a queue it receives uses the sockets it came with.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};

use super::worker::{install_panic_hook, worker_main, ExitKind};
use crate::{Error, Result};

static WITH_THREADS: AtomicBool = AtomicBool::new(false);

/// Lets [`StartMethod::Fork`](super::StartMethod::Fork) fork a process that has more than
/// one thread. Without it, starting a Fork worker from such a process is an error that says
/// to use `Spawn` or `ForkServer`.
///
/// # Safety
/// From the call on, whenever this process starts a Fork worker (including a pool's, and
/// one that replaces a dead pool worker), no lock that the worker's job, or an
/// initializer, takes may be held by another thread at that moment; in the child that lock
/// would never be released, and the worker would hang, or worse for locks that guard data
/// in an inconsistent state. That covers the program's own locks and the standard
/// library's: stdout and stderr (`print!`, `eprintln!`, and a panic's message, which the
/// default hook writes to stderr), the environment (`std::env::var`), and the panic hook
/// itself. tensorshare's own locks are taken care of (they are taken and released around
/// the fork), and the worker leaves with `_exit`, taking none.
pub unsafe fn allow_fork_with_threads() {
    WITH_THREADS.store(true, Ordering::Relaxed);
}

/// The number of threads of this process, from `/proc/self/status`.
pub(crate) fn thread_count() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status.lines().find_map(|l| l.strip_prefix("Threads:")).and_then(|n| n.trim().parse().ok())
}

/// Whether this process may fork a worker now.
fn check_threads() -> Result<()> {
    if WITH_THREADS.load(Ordering::Relaxed) {
        return Ok(());
    }
    match thread_count() {
        Some(1) => Ok(()),
        n => Err(Error::Unsupported(format!(
            "StartMethod::Fork refused: this process has {} threads, and a lock another thread holds \
             at the fork (stdout, the environment, the program's own) would stay locked in the worker \
             for good; use StartMethod::Spawn or StartMethod::ForkServer, or see \
             tensorshare::allow_fork_with_threads",
            n.map_or_else(|| "an unknown number of".to_string(), |n| n.to_string())
        ))),
    }
}

/// Forks a worker that reads its job from `job`.
pub(crate) fn fork_worker(job: OwnedFd) -> Result<rustix::process::Pid> {
    check_threads()?;
    install_panic_hook();
    let me = rustix::process::getpid().as_raw_nonzero().get();
    // SAFETY: fork has no memory-safety preconditions. In the child only this thread
    // exists; the parent had no other (checked above) or the program promised, by
    // `allow_fork_with_threads`, that the job takes no lock another thread may have held;
    // tensorshare's locks were released by the atfork handlers, and the child leaves
    // through worker_main with _exit.
    let pid = unsafe { libc::fork() };
    match pid {
        -1 => Err(Error::io("fork", std::io::Error::last_os_error())),
        0 => {
            forget_foreign_descriptors(job.as_raw_fd());
            crate::channel::forget_after_fork();
            worker_main(job, me, ExitKind::Forked)
        }
        pid => {
            drop(job);
            rustix::process::Pid::from_raw(pid)
                .ok_or_else(|| Error::io("fork", std::io::Error::other("it returned pid 0")))
        }
    }
}

/// In a freshly forked child, before anything else runs: replaces every socket and pipe
/// other than `keep` and the standard streams with `/dev/null` (see the module docs). Takes
/// no lock and allocates nothing.
pub(crate) fn forget_foreign_descriptors(keep: RawFd) {
    let Ok(null) = rustix::fs::open(
        "/dev/null",
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    ) else {
        return;
    };
    let Ok(dir) = rustix::fs::open(
        "/proc/self/fd",
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    ) else {
        return;
    };
    let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 2048];
    let mut entries = rustix::fs::RawDir::new(&dir, &mut buf);
    while let Some(Ok(entry)) = entries.next() {
        let Some(fd) = entry.file_name().to_str().ok().and_then(|n| n.parse::<RawFd>().ok()) else {
            continue;
        };
        if fd <= 2 || fd == keep || fd == null.as_raw_fd() || fd == dir.as_raw_fd() {
            continue;
        }
        // SAFETY: `st` is plain data that fstat fills; on a number that is not open fstat
        // fails with EBADF and touches nothing.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above; `st` is valid for writes of a `stat`.
        if unsafe { libc::fstat(fd, &mut st) } != 0 {
            continue;
        }
        let kind = st.st_mode & libc::S_IFMT;
        if kind == libc::S_IFSOCK || kind == libc::S_IFIFO {
            // SAFETY: this child has one thread, which runs this function before any job
            // code, so no handle is in use while its number changes file. The number stays
            // open (on /dev/null, close-on-exec), so a handle the child inherited in memory
            // that still names it reaches /dev/null, never a file opened later.
            unsafe { libc::dup3(null.as_raw_fd(), fd, libc::O_CLOEXEC) };
        }
    }
}
