//! The fork server ([`StartMethod::ForkServer`](super::StartMethod::ForkServer)): a
//! single-threaded copy of this binary, started on first use, that forks workers on
//! request.
//!
//! # Whose children the workers are
//! The server makes each worker with libc's `fork()`, so a worker is the server's child,
//! and libc does its fork bookkeeping: its internal locks, the pid and thread id it caches
//! (which `abort()` and `raise()` signal), the atfork handlers. Workers used to be made by
//! a raw `clone(CLONE_PARENT)`, as children of the requesting process, which bypassed all
//! of that: on musl a worker's `abort()` signalled the server, whose thread id it still had
//! cached. (glibc asks the kernel at each `raise`, so there the raw clone happened to work.)
//!
//! # How the requester still sees each worker end
//! Only a process's parent can wait for it, so the server reaps its workers and forwards
//! how each ended. The reply to a request carries, besides the worker's pid:
//! - a pidfd, opened by the server right after the fork, while the worker is its unreaped
//!   child: so it names that very process, never a later one that reuses the pid. The
//!   requester signals the worker through it (SIGTERM, SIGKILL) and polls it for the
//!   worker's death, as it does with its own children; a signal sent after the worker is
//!   gone fails with ESRCH and reaches nobody else.
//! - a status socket of that worker's own: once the server has reaped the worker, it sends
//!   `(pid, Ending)` on it and closes it. [`ProcessContext`](super::ProcessContext) polls it
//!   where it polls the pidfd of a worker of its own, and reads it where it would call
//!   `waitid`; the worker's reports on its job socket are read as for any worker, so every
//!   failure reads the same whatever the start method. One socket per worker, rather than
//!   one for all, keeps every context (each pool worker has one) independent with nothing
//!   to route, for one more descriptor per worker on each side.
//!
//! The server sleeps in one `poll` on its request socket and the pidfds of its live
//! workers: it serves requests and reaps workers as they come, never busy.
//!
//! # Who dies with whom
//! The server lives as long as the requesting process: its end of the request socket is
//! the server's only tie to it, held by no other process (close-on-exec, and dropped by
//! every forked worker), so the requester's death, however it dies, is a hang-up there.
//! The server then kills its workers, reaps them and exits. It does not die with its
//! parent through PR_SET_PDEATHSIG: that signal comes when the parent *thread* ends, and
//! the first worker a short-lived thread asked for would take down the server, and with
//! it the workers of every other thread. Each worker dies with the server (PR_SET_PDEATHSIG
//! set after the fork, then `getppid` checked against the server's pid, in case the server
//! died before): the server has a single thread, so that is the server's death, for
//! whatever reason it dies.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use rustix::event::PollFlags;
use rustix::process::{Pid, Signal};
use serde::{Deserialize, Serialize};

use super::context::Ending;
use super::handshake::Invitation;
use super::launch::exec_worker;
use super::worker::FORKSERVER_ENV;
use crate::channel::socket::{self, Deadline, Received};
use crate::channel::SharedFd;
use crate::{wire, Error, Result};

mod server;
pub(crate) use server::{refuse, serve};

/// How long a request waits for the server's answer.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

struct Server {
    sock: OwnedFd,
    pid: Pid,
    /// Names the server for good (opened while it is an unreaped child): to see it die.
    pidfd: Option<OwnedFd>,
    /// The process that started it: the only one it serves.
    owner: Pid,
    /// The number of the next request.
    next: u64,
}

/// A process's record of its server. Its lock is held while a server starts and while a
/// request waits for its answer, so a fork does not wait for it (the fork guards take only
/// locks never held across a wait): a child forked meanwhile inherits it locked by a thread
/// it lacks, and makes a record of its own instead (see `record`).
struct Slot {
    /// The `fork::stamp` of the process that made it.
    stamp: u64,
    server: Mutex<Option<Server>>,
}

static SLOT: AtomicPtr<Slot> = AtomicPtr::new(std::ptr::null_mut());

/// This process's record of its server, made on first use, and again in a forked child.
fn record() -> &'static Mutex<Option<Server>> {
    let me = crate::util::fork::stamp();
    loop {
        let cur = SLOT.load(Ordering::Acquire);
        // SAFETY: a non-null pointer here came from `Box::into_raw` below, published by the
        // exchange, and is never freed: records are leaked, not dropped.
        if let Some(slot) = unsafe { cur.as_ref() } {
            if slot.stamp == me {
                return &slot.server;
            }
        }
        let new = Box::into_raw(Box::new(Slot { stamp: me, server: Mutex::new(None) }));
        match SLOT.compare_exchange(cur, new, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => {
                // SAFETY: as above, for the record just replaced (an ancestor's).
                if let Some(old) = unsafe { cur.as_ref() } {
                    // Its copy of the ancestor's socket closed, unless a thread of the
                    // ancestor held it at the fork; the record itself is left as it is.
                    if let Ok(mut inherited) = old.server.try_lock() {
                        inherited.take();
                    }
                }
                // SAFETY: published just now; never freed, as above.
                return unsafe { &(*new).server };
            }
            // SAFETY: `new` was never published: this is its only owner.
            Err(_) => drop(unsafe { Box::from_raw(new) }),
        }
    }
}

/// Runs `f` with this process's record of its server locked, as a request waiting for its
/// answer holds it (`raw::with_fork_server_record_locked`).
#[cfg(feature = "test-support")]
pub(crate) fn with_record_locked<R>(f: impl FnOnce() -> R) -> R {
    let _record = crate::util::lock(record());
    f()
}

/// A worker the fork server forked for this process.
pub(crate) struct Forked {
    pub(crate) pid: Pid,
    /// Names the worker for good (see the module docs): for signals and to poll for its
    /// death.
    pub(crate) pidfd: OwnedFd,
    /// Where the server sends how the worker ended, once it has reaped it.
    pub(crate) status: OwnedFd,
    /// The server that forked it.
    pub(crate) server: Pid,
}

/// A request for a worker that reads its job from `job`.
#[derive(Serialize, Deserialize)]
struct Request {
    seq: u64,
    job: SharedFd,
}

/// The server's answer to request `seq`; `None`: to any request (the server refuses to
/// serve at all, or could not read the request).
#[derive(Serialize, Deserialize)]
struct Answer {
    seq: Option<u64>,
    outcome: std::result::Result<Started, String>,
}

/// A worker started: the requester's copies of its pidfd and of its status socket.
#[derive(Serialize, Deserialize)]
struct Started {
    pid: i32,
    pidfd: SharedFd,
    status: SharedFd,
}

/// What the server sends on a worker's status socket: its pid, and how it ended (or why
/// that is unknown).
type Status = (i32, std::result::Result<Ending, String>);

/// Asks the fork server (started on first use) for a worker reading its job from `job`.
pub(crate) fn start_worker(job: OwnedFd) -> Result<Forked> {
    let mut server = crate::util::lock(record());
    let me = rustix::process::getpid();
    if server.as_ref().is_some_and(|s| s.owner != me) {
        // A forked child's copy of its parent's server: not its child, and its workers would
        // not be either. Its own copy of the socket is closed (a Fork worker's is /dev/null
        // already); the server is the parent's business.
        *server = None;
    }
    for attempt in 0..2 {
        if server.is_none() {
            let (ours, theirs) = socket::pair()?;
            let invitation = Invitation::send(ours.as_fd(), &[])?;
            let pid = exec_worker(FORKSERVER_ENV, theirs, &invitation)?;
            let pidfd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok();
            *server = Some(Server { sock: ours, pid, pidfd, owner: me, next: 0 });
        }
        let s = server.as_mut().expect("started above");
        match request(s, &job) {
            // Only a server that hung up is replaced: one that answered, even with a
            // refusal, is alive, and its workers would die with it.
            Err(Error::Disconnected) => {
                if let Some(old) = server.take() {
                    // Gone already (killed): reap it.
                    let _ = rustix::process::kill_process(old.pid, Signal::KILL);
                    let _ = rustix::process::waitpid(Some(old.pid), rustix::process::WaitOptions::empty());
                }
                if attempt == 1 {
                    return Err(Error::Unsupported(
                        "the fork server exited before answering (its stderr may say why)".into(),
                    ));
                }
            }
            answer => return answer,
        }
    }
    Err(Error::Unsupported("the fork server could not be started".into()))
}

fn request(s: &mut Server, job: &OwnedFd) -> Result<Forked> {
    let seq = s.next;
    s.next += 1;
    let job = SharedFd::new(job.try_clone().map_err(|e| Error::io("dup of a job socket", e))?);
    socket::send(s.sock.as_fd(), wire::encode(&Request { seq, job })?, Deadline::after(None), &|| true)?;
    let deadline = Deadline::after(Some(ANSWER_TIMEOUT));
    let started = loop {
        let answer: Answer = socket::recv(s.sock.as_fd(), deadline, &|| true)?.decode()?;
        match (answer.seq, answer.outcome) {
            (Some(n), Ok(late)) if n != seq => {
                // The answer to a request that gave up waiting: its worker has nobody to
                // work for.
                let _ = rustix::process::pidfd_send_signal(late.pidfd.as_fd(), Signal::KILL);
            }
            (Some(n), Err(_)) if n != seq => {}
            (_, Ok(started)) => break started,
            (_, Err(e)) => return Err(Error::io("the fork server's fork", std::io::Error::other(e))),
        }
    };
    let owned = |fd: SharedFd| fd.into_owned().map_err(|_| Error::invalid("a shared descriptor"));
    Ok(Forked {
        server: s.pid,
        pid: Pid::from_raw(started.pid).ok_or_else(|| Error::invalid("the fork server sent pid 0"))?,
        pidfd: owned(started.pidfd)?,
        status: owned(started.status)?,
    })
}

/// How a worker of the fork server ended, as the server reports it on `status`: `None`
/// while it runs (and `block` is false). A server that died without a word took the worker
/// along (see the module docs): this waits for that death on `pidfd`, so that no worker is
/// reported ended while it still runs, and reaps the dead server (`server`, the one that
/// forked the worker) if no other call has.
pub(crate) fn ending(
    status: &OwnedFd,
    pidfd: &OwnedFd,
    pid: Pid,
    server: Pid,
    block: bool,
) -> Option<std::result::Result<Ending, String>> {
    loop {
        match socket::try_recv(status.as_fd()) {
            Ok(Received::Record(r)) => {
                return Some(match r.decode::<Status>() {
                    Ok((p, ending)) if p == pid.as_raw_nonzero().get() => ending,
                    Ok((p, _)) => Err(format!("the fork server reported the end of pid {p} instead")),
                    Err(e) => Err(format!("the fork server's report: {e}")),
                })
            }
            Ok(Received::Empty) if !block => return None,
            Ok(Received::Empty) => {
                let _ = socket::wait(status.as_fd(), PollFlags::IN, Duration::from_secs(3600));
            }
            Ok(Received::Bad(e)) => return Some(Err(format!("the fork server's report: {e}"))),
            Ok(Received::Closed) | Err(_) => {
                while !matches!(
                    socket::wait(pidfd.as_fd(), PollFlags::IN, Duration::from_secs(3600)),
                    Ok(true) | Err(_)
                ) {}
                reap_dead_server(server);
                return Some(Err("the fork server, which reaps this worker, died before it told how the \
                                 worker ended; the worker died with it"
                    .into()));
            }
        }
    }
}

/// The server `pid` hung up a worker's status socket without a report: it is dead, or
/// dying. It is this process's child, so it is reaped here and forgotten (the next request
/// starts another) rather than left a zombie until a next request, which may never come.
/// Only if it is still this process's server: one that an earlier call reaped and replaced
/// is done with, and the new one is not waited for. Its death is awaited on its pidfd, for
/// at most `SERVER_EXIT`: the hang-up comes as the kernel closes its descriptors, a moment
/// before it can be reaped. (A server that dies while it has no worker is reaped by the
/// next request, as before: nothing else notices.)
fn reap_dead_server(pid: Pid) {
    const SERVER_EXIT: Duration = Duration::from_secs(5);
    let me = rustix::process::getpid();
    let pidfd = {
        let server = crate::util::lock(record());
        match server.as_ref() {
            Some(s) if s.owner == me && s.pid == pid => s.pidfd.as_ref().and_then(|f| f.try_clone().ok()),
            _ => return,
        }
    };
    let Some(pidfd) = pidfd else { return };
    if !matches!(socket::wait(pidfd.as_fd(), PollFlags::IN, SERVER_EXIT), Ok(true)) {
        return; // alive after all: the next request that finds it gone reaps it
    }
    let mut server = crate::util::lock(record());
    // Still the same server, if its pid is: the pid of an unreaped child is never reused,
    // and it is reaped only where it is also taken out of the record.
    if server.as_ref().is_some_and(|s| s.owner == me && s.pid == pid) {
        server.take();
        let _ = rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::NOHANG);
    }
}
