//! Starting workers: re-executing this binary (Spawn), forking (Fork), or asking the fork
//! server (ForkServer).

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::Command;

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::context::{Child, Parent, ProcessContext};
use super::handshake::{Invitation, INHERITED_FD};
use super::job::{entry_name, Job};
use super::worker::{refuse_if_unstarted, WORKER_ENV};
use super::{fork, forkserver};
use crate::channel::socket::{self, Deadline};
use crate::{wire, Error, Result};

/// How workers are started.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
pub enum StartMethod {
    /// Re-execute the current binary (`/proc/self/exe`); the worker's `main` calls
    /// [`init`](crate::init) first, which runs the job. Safe whatever the parent does.
    #[default]
    Spawn,
    /// `fork()` without exec: fast, and the worker inherits the parent's memory (a shared
    /// tensor made before the fork, globals). If the parent has other threads, only the
    /// forking thread exists in the child, and a lock another thread held at the fork stays
    /// locked there for good: tensorshare's own locks are made safe around fork, but the
    /// program's are not, nor are the standard library's (stdout and stderr, the
    /// environment, the panic hook). So a parent with other threads is refused, unless the
    /// program calls the `unsafe`
    /// [`allow_fork_with_threads`](crate::allow_fork_with_threads) first. The
    /// worker gets the standard streams, its job socket, and the files and shared memory of
    /// its parent; every other socket and pipe end it inherited becomes `/dev/null`, so
    /// that it keeps no conversation of its parent alive.
    Fork,
    /// A single-threaded server process, started on first use, forks the workers: nearly
    /// as fast as Fork and safe when the parent has threads. Workers inherit the server's
    /// memory, not the parent's. They are the server's children: it reaps them and tells
    /// the parent how each ended, so joins, signals and failures read as with Spawn. They
    /// die with the server, which lives as long as the parent process (not only the thread
    /// that started it).
    ForkServer,
}

impl std::fmt::Display for StartMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StartMethod::Spawn => "spawn",
            StartMethod::Fork => "fork",
            StartMethod::ForkServer => "forkserver",
        })
    }
}

impl std::str::FromStr for StartMethod {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "spawn" => Ok(StartMethod::Spawn),
            "fork" => Ok(StartMethod::Fork),
            "forkserver" => Ok(StartMethod::ForkServer),
            _ => Err(Error::Parse(format!("unknown start method {s:?}; expected spawn, fork or forkserver"))),
        }
    }
}

/// The arguments a re-executed worker is started with. A program ignores them: its
/// `main` calls [`init`](crate::init) first, which never returns in a worker. A test binary
/// runs only the test named here, made by
/// [`enable_test_workers!`](crate::enable_test_workers), which calls `init`.
pub const WORKER_ARGS: [&str; 5] =
    ["__tensorshare_worker", "--exact", "--nocapture", "--test-threads=1", "-q"];

/// Runs `job(rank, args)` for every rank in `0..nprocs`, each in its own process started
/// with [`StartMethod::Spawn`]. Wait for them with [`ProcessContext::join`].
///
/// The job runs in another process, so a closure may not capture variables (send them in
/// `args`, or use [`closure!`](crate::closure)); one that does is a compile-time error:
///
/// ```compile_fail,E0080
/// let offset = 3usize;
/// let ctx = tensorshare::spawn(move |rank, _: ()| assert!(rank + offset > 0), (), 1);
/// ```
pub fn spawn<J, A>(job: J, args: A, nprocs: usize) -> Result<ProcessContext>
where
    J: Job<A>,
    A: Serialize + DeserializeOwned,
{
    start_processes(job, args, nprocs, StartMethod::Spawn)
}

/// Runs `job(rank, args)` in `nprocs` processes started with `method`.
pub fn start_processes<J, A>(job: J, args: A, nprocs: usize, method: StartMethod) -> Result<ProcessContext>
where
    J: Job<A>,
    A: Serialize + DeserializeOwned,
{
    refuse_if_unstarted();
    let name = entry_name::<J, A>()?;
    // Workers belong to this process's cleanup group (see `shm::group`) when named segments
    // are in use, whatever start method makes them: a forked worker shares the group lock's
    // open file.
    crate::shm::group::for_workers()?;
    let mut ctx = ProcessContext::new(Vec::with_capacity(nprocs));
    for rank in 0..nprocs {
        let (ours, theirs) = socket::pair()?;
        // Queue the job first: the worker finds it waiting, whatever the start method; a
        // re-executed one finds its hello before it (see `handshake`).
        let launch = Launch::prepare(method, &ours)?;
        for msg in [wire::encode(&name)?, wire::encode(&(rank, job.state(), &args))?] {
            socket::send(ours.as_fd(), msg, Deadline::after(None), &|| true)?;
        }
        let (pid, pidfd, parent) = start(theirs, launch)?;
        ctx.children.push(Child { rank, pid, pidfd, job: ours, parent, outcome: None });
    }
    Ok(ctx)
}

/// How one worker is started, with what that needs.
enum Launch {
    /// Re-executed (Spawn), with the invitation whose hello is queued on its socket.
    Exec(Invitation),
    Fork,
    ForkServer,
}

impl Launch {
    /// Prepares a worker's start by `method` on the socket pair whose parent end is `ours`.
    fn prepare(method: StartMethod, ours: &OwnedFd) -> Result<Launch> {
        Ok(match method {
            StartMethod::Spawn => Launch::Exec(Invitation::send(ours.as_fd(), &[])?),
            StartMethod::Fork => Launch::Fork,
            StartMethod::ForkServer => Launch::ForkServer,
        })
    }
}

/// Starts one worker that reads its job from `job`: its pid, a pidfd for it, and who
/// reaps it.
fn start(job: OwnedFd, launch: Launch) -> Result<(rustix::process::Pid, OwnedFd, Parent)> {
    let pid = match launch {
        Launch::Exec(invitation) => exec_worker(WORKER_ENV, job, &invitation),
        #[cfg(feature = "cuda")]
        Launch::Fork if crate::cuda::is_initialized() => Err(Error::Device(
            "Cannot re-initialize CUDA in forked subprocess: this process has initialised CUDA, so its \
             workers cannot be started with StartMethod::Fork; use StartMethod::Spawn or ForkServer"
                .into(),
        )),
        Launch::Fork => fork::fork_worker(job),
        Launch::ForkServer => {
            // The server's child: the server opened its pidfd, and reaps it.
            let w = forkserver::start_worker(job)?;
            return Ok((w.pid, w.pidfd, Parent::ForkServer { status: w.status, server: w.server }));
        }
    }?;
    // Our own child, not reaped yet: its pid cannot name another process.
    let pidfd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())
        .map_err(|e| Error::io("pidfd_open of a new worker", e))?;
    Ok((pid, pidfd, Parent::This))
}

/// Re-executes this binary as a worker (or fork server) of this process's cleanup group,
/// with `fd` at descriptor 3 and `var` naming it.
pub(crate) fn exec_worker(var: &str, fd: OwnedFd, invitation: &Invitation) -> Result<rustix::process::Pid> {
    match crate::shm::group::for_workers()? {
        Some(root) => {
            exec_helper(var, fd, invitation, &[(crate::shm::group::GROUP_ENV, root.to_string())], false)
        }
        None => exec_helper(var, fd, invitation, &[], false),
    }
}

/// The program and arguments helpers are started with, when not this binary.
static HELPER_COMMAND: crate::util::Lazy<(std::path::PathBuf, Vec<std::ffi::OsString>)> =
    crate::util::Lazy::new();

/// Has tensorshare start its helper processes (the shared-memory cleaner of the
/// `file_system` strategy, and [`StartMethod::Spawn`] workers) as `program` with `args`,
/// instead of re-executing this binary with [`WORKER_ARGS`]. For a runtime that loads
/// tensorshare as a shared library rather than linking it into its executable: the Python
/// package sets `python -c "import tensorshare._native"`, which loads the library again, whose
/// constructor takes the role. The command must load the same build of tensorshare (the
/// handshake checks the executable, and a worker's job is named by offsets in the library),
/// and run nothing else first. The first call wins; `false` when a command was already set.
pub fn set_helper_command(program: impl Into<std::path::PathBuf>, args: Vec<std::ffi::OsString>) -> bool {
    HELPER_COMMAND.set((program.into(), args)).is_ok()
}

/// Re-executes this binary with `fd` at descriptor 3, `var` naming it and the invitation
/// whose hello is queued on `fd`'s peer, and `env` set; with `new_session`, in a session
/// (and process group) of its own from before it runs anything.
pub(crate) fn exec_helper(
    var: &str,
    fd: OwnedFd,
    invitation: &Invitation,
    env: &[(&str, String)],
    new_session: bool,
) -> Result<rustix::process::Pid> {
    let me = rustix::process::getpid().as_raw_nonzero().get();
    let mut cmd = match HELPER_COMMAND.get() {
        Some((program, args)) => {
            let mut cmd = Command::new(program);
            cmd.args(args);
            cmd
        }
        None => {
            let mut cmd = Command::new("/proc/self/exe");
            if let Some(arg0) = std::env::args_os().next() {
                cmd.arg0(arg0);
            }
            cmd.args(WORKER_ARGS);
            cmd
        }
    };
    cmd.env(var, invitation.env_value(me));
    for (k, v) in env {
        cmd.env(k, v);
    }
    let raw = fd.as_raw_fd();
    // SAFETY: the closure runs in the child between fork and exec and only calls setsid,
    // dup2 and fcntl, which are async-signal-safe; `raw` stays open in the parent until
    // spawn returns.
    unsafe {
        cmd.pre_exec(move || {
            if new_session && libc::setsid() == -1 {
                return Err(std::io::Error::last_os_error());
            }
            if raw == INHERITED_FD {
                // dup2 onto itself keeps close-on-exec set: clear it instead.
                if libc::fcntl(raw, libc::F_SETFD, 0) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
            } else if libc::dup2(raw, INHERITED_FD) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = crate::util::fork::exec_only(|| cmd.spawn())
        .map_err(|e| Error::io(format!("starting a helper process ({cmd:?})"), e))?;
    drop(fd);
    rustix::process::Pid::from_raw(child.id() as i32)
        .ok_or_else(|| Error::io("starting a worker", std::io::Error::other("it has pid 0")))
}
