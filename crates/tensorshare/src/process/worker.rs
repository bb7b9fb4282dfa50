//! The worker side: what a started process does before, during and after its job.

use std::cell::RefCell;
use std::os::fd::{AsFd, OwnedFd};
use std::panic::AssertUnwindSafe;

use serde::{Deserialize, Serialize};

use super::handshake::{arrive_late, Arrival, Role};
use super::job::{Entry, JobName, JobResult};
use crate::channel::socket::{self, Deadline};
use crate::wire;

/// Set in a re-executed worker: `<job fd>:<parent pid>:<token>` (see `handshake`).
pub(crate) const WORKER_ENV: &str = "TENSORSHARE_WORKER";
/// Set in a fork server: `<control fd>:<parent pid>:<token>` (see `handshake`).
pub(crate) const FORKSERVER_ENV: &str = "TENSORSHARE_FORKSERVER";

/// What a worker tells its parent at the end of its job.
#[derive(Serialize, Deserialize, Debug)]
pub(crate) enum Report {
    /// The worker took its job and is about to run it: from here on, an exit without a
    /// final report is the job's doing (it called `exit`, or exec'd), not a missing `init`.
    Started,
    Done,
    Raised {
        message: String,
        location: Option<String>,
        backtrace: Option<String>,
    },
    Lost {
        reason: String,
    },
    /// The job broke the worker's way of reporting (it closed the job socket).
    Unreported {
        reason: String,
    },
}

/// Makes this process die with its parent (the thread that started it, in Linux terms).
pub(crate) fn die_with_parent(ppid: i32) {
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
    // The parent may have died before the line above: then nobody is there to signal us.
    if rustix::process::getppid().map(|p| p.as_raw_nonzero().get()) != Some(ppid) {
        exit_now(1);
    }
}

/// How a worker leaves: a re-executed one exits normally (its own exit handlers run); a
/// forked one must not run the handlers it inherited from its parent.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExitKind {
    Normal,
    Forked,
}

/// Leaves a re-executed (or otherwise single-threaded) process at once, with what it wrote
/// to stdout and stderr flushed.
pub(crate) fn exit_now(code: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: _exit ends the process at once; no Rust state is used afterwards.
    unsafe { libc::_exit(code) }
}

thread_local! {
    static LAST_PANIC: RefCell<Option<Report>> = const { RefCell::new(None) };
    /// Whether this thread runs a job inside `catch`: only then does the hook record.
    static IN_JOB: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Records the panic's message, location and backtrace for the code that catches it (and
/// still prints it, as the default hook does). Installed in the parent before a fork, so
/// that a forked child never takes the hook's lock for writing (another thread of the
/// parent may have held it at the fork).
pub(crate) fn install_panic_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !IN_JOB.with(|j| j.get()) {
                return previous(info);
            }
            let message = if let Some(s) = info.payload().downcast_ref::<&str>() {
                s.to_string()
            } else if let Some(s) = info.payload().downcast_ref::<String>() {
                s.clone()
            } else {
                "a panic with a non-string payload".to_string()
            };
            let location = info.location().map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column()));
            let backtrace = Some(std::backtrace::Backtrace::force_capture().to_string());
            LAST_PANIC.with(|p| *p.borrow_mut() = Some(Report::Raised { message, location, backtrace }));
            previous(info);
        }));
    });
}

/// Runs `f`, turning a panic into a `Raised` report.
pub(crate) fn catch(f: impl FnOnce() -> JobResult) -> Report {
    IN_JOB.with(|j| j.set(true));
    let r = std::panic::catch_unwind(AssertUnwindSafe(f));
    IN_JOB.with(|j| j.set(false));
    match r {
        Ok(Ok(())) => Report::Done,
        Ok(Err(message)) => Report::Raised { message, location: None, backtrace: None },
        Err(_) => LAST_PANIC.with(|p| p.borrow_mut().take()).unwrap_or(Report::Raised {
            message: "panicked".into(),
            location: None,
            backtrace: None,
        }),
    }
}

pub(crate) fn send_report(job: &OwnedFd, report: &Report) {
    if let Ok(msg) = wire::encode(report) {
        // If the parent is gone there is nobody to tell.
        let _ = socket::send(job.as_fd(), msg, Deadline::after(None), &|| true);
    }
}

/// A re-executed worker that cannot work for its parent (see `handshake`): says why, to
/// the parent and on stderr, and exits without running anything.
pub(crate) fn refuse(job: OwnedFd, reason: String) -> ! {
    eprintln!("tensorshare: worker {}: {reason}", std::process::id());
    send_report(&job, &Report::Lost { reason });
    drop(job);
    exit_now(1)
}

/// Leaves a forked worker without taking a lock: another thread of the parent may have held
/// stdout's (or any) lock at the fork, and it stays held here for good, so nothing is
/// flushed through the standard library (whole lines already went out: stdout is
/// line-buffered).
pub(crate) fn exit_forked(code: i32) -> ! {
    // SAFETY: _exit ends the process at once, running no handler and taking no lock; no
    // Rust state is used afterwards.
    unsafe { libc::_exit(code) }
}

/// The identity of the open file behind `fd`, to tell whether a descriptor number still
/// holds the same socket.
fn identity(fd: std::os::fd::BorrowedFd<'_>) -> Option<(u64, u64)> {
    #[allow(clippy::unnecessary_cast)] // the field types differ between targets
    rustix::fs::fstat(fd).ok().map(|st| (st.st_dev as u64, st.st_ino as u64))
}

/// What a worker that never ran [`init`](crate::init) hears when its `main` reaches
/// `spawn`: it would start workers that do the same, without end.
pub(crate) const REACHED_SPAWN: &str = "the worker reached spawn (or start_processes, or Pool::new) \
before running its job: does main() call tensorshare::init() first (or the test file invoke \
tensorshare::enable_test_workers!())?";

/// Stops a process that was started as a worker (or fork server) but did not run `init`
/// before starting workers of its own: each would do the same, an endless chain, or a fork
/// bomb with more than one worker. Python stops a missing `__main__` guard the same way.
///
/// A process that proves to be such a worker (see `handshake`) tells its parent why and
/// exits, so the parent reports it as the worker's failure; a variable that tensorshare did
/// not set is ignored, as `init` ignores it.
pub(crate) fn refuse_if_unstarted() {
    for (var, role) in [(WORKER_ENV, Role::Worker), (FORKSERVER_ENV, Role::ForkServer)] {
        match arrive_late(var, role) {
            // A variable tensorshare did not set: `arrive_late` said so.
            Arrival::Program => {}
            Arrival::Invited(i) if role == Role::Worker => refuse(i.sock, REACHED_SPAWN.into()),
            Arrival::Invited(i) => super::forkserver::refuse(i.sock, REACHED_SPAWN.into()),
            Arrival::Orphaned => exit_now(1),
            Arrival::Refused { sock, reason } if role == Role::Worker => refuse(sock, reason),
            Arrival::Refused { sock, reason } => super::forkserver::refuse(sock, reason),
        }
    }
}

/// Whether this process is a worker (set before its job runs, never unset).
static IS_WORKER: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether this process runs a worker's job (spawned, forked or from the fork server): what
/// a layer above asks before it treats the process as a program of its own (an MPI rank).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn is_worker() -> bool {
    IS_WORKER.load(std::sync::atomic::Ordering::Relaxed)
}

/// A worker's life: read which job to run and its arguments from the job socket, run it,
/// report, exit.
pub(crate) fn worker_main(job: OwnedFd, ppid: i32, exit: ExitKind) -> ! {
    IS_WORKER.store(true, std::sync::atomic::Ordering::Relaxed);
    die_with_parent(ppid);
    install_panic_hook();
    if exit == ExitKind::Normal {
        // Join the parent's cleanup group, if it has one (a forked worker shares its lock
        // already); a worker that uses named segments later founds or joins one then.
        if std::env::var_os(crate::shm::group::GROUP_ENV).is_some() {
            if let Err(e) = crate::shm::group::ensure() {
                eprintln!("tensorshare: worker {}: {e}", std::process::id());
            }
        }
    }
    // The job may close its socket's descriptor (or a program may close every descriptor
    // it does not know): a copy, out of its way and closed by an exec, still reports that.
    let number = std::os::fd::AsRawFd::as_raw_fd(&job);
    let Ok(spare) = rustix::io::fcntl_dupfd_cloexec(&job, 10) else {
        send_report(&job, &Report::Lost { reason: "cannot duplicate the job socket".into() });
        leave(exit, 1)
    };
    // An exec'd program has nothing to say on it: closing it there shows as the hang-up.
    let _ = rustix::io::fcntl_setfd(&job, rustix::io::FdFlags::CLOEXEC);
    let before = identity(spare.as_fd());
    let report = match run_job(&job, &spare) {
        Ok(report) => report,
        Err(reason) => Report::Lost { reason },
    };
    let report = if identity(job.as_fd()) == before {
        drop(job);
        report
    } else {
        // The number is closed, or holds something else now: it is not ours to close.
        std::mem::forget(job);
        Report::Unreported {
            reason: format!("closed its job socket (descriptor {number}) before reporting its result"),
        }
    };
    send_report(&spare, &report);
    drop(spare);
    leave(exit, if matches!(report, Report::Done) { 0 } else { 1 })
}

fn leave(exit: ExitKind, code: i32) -> ! {
    match exit {
        ExitKind::Normal => std::process::exit(code),
        ExitKind::Forked => {
            // Exit handlers are the parent's, and do not run: the names of the named
            // arenas this worker made go now (their memory lives on in whoever holds them).
            crate::arena::unlink_own_names();
            exit_forked(code)
        }
    }
}

fn run_job(job: &OwnedFd, spare: &OwnedFd) -> std::result::Result<Report, String> {
    let parent_alive = || true; // the job socket's hang-up tells
    let name = socket::recv(job.as_fd(), Deadline::after(None), &parent_alive)
        .map_err(|e| format!("reading the job: {e}"))?;
    let name: JobName = name.decode().map_err(|e| format!("reading the job: {e}"))?;
    let entry = name.resolve::<Entry>()?;
    let payload = socket::recv(job.as_fd(), Deadline::after(None), &parent_alive)
        .map_err(|e| format!("reading the job's arguments: {e}"))?;
    send_report(spare, &Report::Started);
    Ok(catch(|| entry(payload)))
}
