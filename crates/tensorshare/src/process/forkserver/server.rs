//! The server's side: its loop, forking workers on request and reaping them as they end.

use std::os::fd::{AsFd, OwnedFd};

use rustix::event::{PollFd, PollFlags};
use rustix::process::{Pid, Signal, WaitId, WaitIdOptions};

use super::super::context::Ending;
use super::super::worker::{exit_now, install_panic_hook, worker_main, ExitKind};
use super::{Answer, Request, Started, Status};
use crate::channel::socket::{self, Deadline, Received};
use crate::channel::SharedFd;
use crate::wire;

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
