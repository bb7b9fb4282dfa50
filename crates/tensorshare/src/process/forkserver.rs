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
use std::sync::Mutex;
use std::time::Duration;

use rustix::event::{PollFd, PollFlags};
use rustix::process::{Pid, Signal, WaitId, WaitIdOptions};
use serde::{Deserialize, Serialize};

use super::context::Ending;
use super::handshake::Invitation;
use super::launch::exec_worker;
use super::worker::{exit_now, install_panic_hook, worker_main, ExitKind, FORKSERVER_ENV};
use crate::channel::socket::{self, Deadline, Received};
use crate::channel::SharedFd;
use crate::{wire, Error, Result};

/// How long a request waits for the server's answer.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

struct Server {
    sock: OwnedFd,
    pid: Pid,
    /// The process that started it: the only one it serves.
    owner: Pid,
    /// The number of the next request.
    next: u64,
}

static SERVER: Mutex<Option<Server>> = Mutex::new(None);

/// A worker the fork server forked for this process.
pub(crate) struct Forked {
    pub(crate) pid: Pid,
    /// Names the worker for good (see the module docs): for signals and to poll for its
    /// death.
    pub(crate) pidfd: OwnedFd,
    /// Where the server sends how the worker ended, once it has reaped it.
    pub(crate) status: OwnedFd,
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
    let mut server = crate::util::lock(&SERVER);
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
            *server = Some(Server { sock: ours, pid, owner: me, next: 0 });
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
        pid: Pid::from_raw(started.pid).ok_or_else(|| Error::invalid("the fork server sent pid 0"))?,
        pidfd: owned(started.pidfd)?,
        status: owned(started.status)?,
    })
}

/// How a worker of the fork server ended, as the server reports it on `status`: `None`
/// while it runs (and `block` is false). A server that died without a word took the worker
/// along (see the module docs): this waits for that death on `pidfd`, so that no worker is
/// reported ended while it still runs.
pub(crate) fn ending(
    status: &OwnedFd,
    pidfd: &OwnedFd,
    pid: Pid,
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
                return Some(Err("the fork server, which reaps this worker, died before it told how the \
                                 worker ended; the worker died with it"
                    .into()));
            }
        }
    }
}

/// A re-executed fork server that cannot work for its parent (see `handshake`): the
/// parent's first request gets `reason` as its answer, and the server exits.
pub(crate) fn refuse(sock: OwnedFd, reason: String) -> ! {
    eprintln!("tensorshare: fork server {}: {reason}", std::process::id());
    if let Ok(msg) = wire::encode(&Answer { seq: None, outcome: Err(reason) }) {
        let _ = socket::send(sock.as_fd(), msg, Deadline::after(None), &|| true);
    }
    drop(sock);
    exit_now(1)
}

/// A worker of the server, until the server reaps it.
struct Worker {
    pid: Pid,
    /// The server's own pidfd for it: polled for its exit, and reaped through.
    pidfd: OwnedFd,
    /// The server's end of the worker's status socket.
    status: OwnedFd,
}

/// The server's loop (in the re-executed process started by `parent`): forks a worker per
/// request and reaps the workers that end, until the parent hangs up.
pub(crate) fn serve(sock: OwnedFd, parent: i32) -> ! {
    if rustix::process::getppid().map(|p| p.as_raw_nonzero().get()) != Some(parent) {
        // Gone already: nobody to serve (and `sock` would show the hang-up anyway).
        exit_now(0);
    }
    install_panic_hook();
    // Workers forked here share the server's membership of the cleanup group.
    let _ = crate::shm::group::ensure();
    let sigchld_ignored = keep_children_waitable();
    let me = rustix::process::getpid().as_raw_nonzero().get();
    let mut workers: Vec<Worker> = Vec::new();
    loop {
        let ended = wait(&sock, &workers);
        reap(&mut workers, ended);
        loop {
            let record = match socket::try_recv(sock.as_fd()) {
                Ok(Received::Record(r)) => r,
                Ok(Received::Empty) => break,
                Ok(Received::Bad(_)) => continue,
                Ok(Received::Closed) | Err(_) => shut_down(workers),
            };
            let (seq, job) = match record.decode::<Request>().map(|r| (r.seq, r.job.into_owned())) {
                Ok((seq, Ok(job))) => (seq, job),
                _ => {
                    let answer =
                        Answer { seq: None, outcome: Err("a request the fork server cannot read".into()) };
                    if !reply(&sock, &answer) {
                        shut_down(workers)
                    }
                    continue;
                }
            };
            let outcome = match fork() {
                Err(e) => Err(format!("fork: {e}")),
                Ok(None) => {
                    // The child works: it keeps its job socket and nothing of the server's,
                    // and it never comes back here.
                    drop(workers);
                    drop(sock);
                    if sigchld_ignored {
                        // SAFETY: sets a disposition, installs no handler; this child has
                        // one thread.
                        unsafe { libc::signal(libc::SIGCHLD, libc::SIG_IGN) };
                    }
                    worker_main(job, me, ExitKind::Forked)
                }
                Ok(Some(pid)) => {
                    drop(job);
                    adopt(pid).map(|(w, started)| {
                        workers.push(w);
                        started
                    })
                }
            };
            if !reply(&sock, &Answer { seq: Some(seq), outcome }) {
                shut_down(workers)
            }
        }
    }
}

/// Waits until a request comes, the parent hangs up, or workers end; returns the indices
/// of the workers that may have ended, in increasing order.
fn wait(sock: &OwnedFd, workers: &[Worker]) -> Vec<usize> {
    let mut fds = Vec::with_capacity(1 + workers.len());
    fds.push(PollFd::new(sock, PollFlags::IN));
    fds.extend(workers.iter().map(|w| PollFd::new(&w.pidfd, PollFlags::IN)));
    // Interrupted or failed, the caller looks at everything and comes back.
    let _ = rustix::event::poll(&mut fds, None);
    fds[1..].iter().enumerate().filter(|(_, fd)| !fd.revents().is_empty()).map(|(i, _)| i).collect()
}

/// Sends `answer` to the parent; false if it cannot hear it (it is gone).
fn reply(sock: &OwnedFd, answer: &Answer) -> bool {
    wire::encode(answer)
        .and_then(|msg| socket::send(sock.as_fd(), msg, Deadline::after(None), &|| true))
        .is_ok()
}

/// Reaps the workers among `ended` (indices in increasing order) that have ended, and
/// tells each one's requester how it ended.
fn reap(workers: &mut Vec<Worker>, ended: Vec<usize>) {
    for i in ended.into_iter().rev() {
        if let Some(status) = try_reap(&workers[i]) {
            let w = workers.swap_remove(i);
            if let Ok(msg) = wire::encode(&status) {
                // A requester that let go of the worker does not listen any more.
                let _ = socket::send(w.status.as_fd(), msg, Deadline::now(), &|| true);
            }
        }
    }
}

/// Reaps `w` if it has ended.
fn try_reap(w: &Worker) -> Option<Status> {
    let pid = w.pid.as_raw_nonzero().get();
    match rustix::process::waitid(
        WaitId::PidFd(w.pidfd.as_fd()),
        WaitIdOptions::EXITED | WaitIdOptions::NOHANG,
    ) {
        Ok(None) => None,
        Ok(Some(s)) => Some((pid, Ending::of(&s).ok_or_else(|| "unknown exit status".to_string()))),
        Err(e) => Some((pid, Err(format!("the fork server's waitid failed: {e}")))),
    }
}

/// Takes on a worker just forked: a pidfd for it (race-free: it is an unreaped child) and
/// its status socket, with the requester's copies for the answer. On failure the worker is
/// killed and reaped, and the answer is a refusal.
fn adopt(pid: Pid) -> std::result::Result<(Worker, Started), String> {
    let adopted = (|| -> std::result::Result<(Worker, Started), String> {
        let pidfd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())
            .map_err(|e| format!("pidfd_open of a new worker: {e}"))?;
        let theirs_pidfd = pidfd.try_clone().map_err(|e| format!("dup of a pidfd: {e}"))?;
        let (status, theirs) = socket::pair().map_err(|e| e.to_string())?;
        let started = Started {
            pid: pid.as_raw_nonzero().get(),
            pidfd: SharedFd::new(theirs_pidfd),
            status: SharedFd::new(theirs),
        };
        Ok((Worker { pid, pidfd, status }, started))
    })();
    if adopted.is_err() {
        // Still our unreaped child: its pid cannot name another process yet.
        let _ = rustix::process::kill_process(pid, Signal::KILL);
        let _ = rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::empty());
    }
    adopted
}

/// The parent hung up (or died): kills and reaps the workers, and exits.
fn shut_down(workers: Vec<Worker>) -> ! {
    for w in &workers {
        let _ = rustix::process::pidfd_send_signal(&w.pidfd, Signal::KILL);
    }
    for w in &workers {
        let _ = rustix::process::waitid(WaitId::PidFd(w.pidfd.as_fd()), WaitIdOptions::EXITED);
    }
    exit_now(0)
}

/// Makes sure the server's workers wait to be reaped: a SIGCHLD that the program ignores
/// (an ignored signal stays ignored across exec) would have the kernel reap them at once,
/// and their statuses would be lost. Returns whether it was ignored, for the workers to get
/// back.
fn keep_children_waitable() -> bool {
    // SAFETY: sets a disposition and installs no handler, so no code of ours runs on a
    // signal; the server is single-threaded (see `fork`).
    let previous = unsafe { libc::signal(libc::SIGCHLD, libc::SIG_DFL) };
    previous == libc::SIG_IGN
}

/// `fork()`: `None` in the child, the child's pid in the server.
fn fork() -> std::io::Result<Option<Pid>> {
    super::atfork::register();
    // SAFETY: fork has no memory-safety preconditions; what makes it sound is that the
    // child finds no lock held by a thread it lacks. The server is single-threaded: it is
    // this program re-executed, which went from `init()` (the first line of `main`, before
    // the program could start a thread) straight into `serve`, which starts none (it uses
    // no queue, whose outbox would). Under the test harness, which runs `init` in a test,
    // the harness's main thread exists too, blocked until that test ends and holding no
    // lock. libc's fork looks after its own locks (malloc, stdio) and caches, and
    // tensorshare's atfork handlers take and release its locks around the fork. The child
    // drops the server's descriptors, runs its job through `worker_main`, and leaves with
    // `_exit`.
    match unsafe { libc::fork() } {
        -1 => Err(std::io::Error::last_os_error()),
        0 => Ok(None),
        pid => Ok(Pid::from_raw(pid)),
    }
}
