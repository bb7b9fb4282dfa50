//! The fork server: a single-threaded copy of this binary that forks workers on request.
//! Workers are made with CLONE_PARENT, so they are the requesting process's own children:
//! it reaps them and sees their exit status as with any other start method.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Mutex;

use super::handshake::Invitation;
use super::launch::exec_worker;
use super::worker::{die_with_parent, exit_now, worker_main, ExitKind, FORKSERVER_ENV};
use crate::channel::socket::{self, Deadline, Received};
use crate::{wire, Error, Result};

struct Server {
    sock: OwnedFd,
    pid: rustix::process::Pid,
}

static SERVER: Mutex<Option<Server>> = Mutex::new(None);

/// Asks the fork server (started on first use) for a worker reading its job from `job`.
pub(crate) fn start_worker(job: OwnedFd) -> Result<rustix::process::Pid> {
    let mut server = crate::util::lock(&SERVER);
    for attempt in 0..2 {
        if server.is_none() {
            let (ours, theirs) = socket::pair()?;
            let invitation = Invitation::send(ours.as_fd(), &[])?;
            let pid = exec_worker(FORKSERVER_ENV, theirs, &invitation)?;
            *server = Some(Server { sock: ours, pid });
        }
        let s = server.as_ref().expect("started above");
        match request(s, &job) {
            Ok(pid) => return Ok(pid),
            Err(e) if attempt == 0 => {
                // The server died (killed, or its parent thread ended): start a new one.
                let _ = e;
                if let Some(old) = server.take() {
                    let _ = rustix::process::kill_process(old.pid, rustix::process::Signal::KILL);
                    let _ = rustix::process::waitpid(Some(old.pid), rustix::process::WaitOptions::empty());
                }
            }
            Err(e) => return Err(e),
        }
    }
    Err(Error::Unsupported("the fork server could not be started".into()))
}

fn request(s: &Server, job: &OwnedFd) -> Result<rustix::process::Pid> {
    let msg = wire::encode(&WorkerFd(job))?;
    socket::send(s.sock.as_fd(), msg, Deadline::after(None), &|| true)?;
    let reply =
        socket::recv(s.sock.as_fd(), Deadline::after(Some(std::time::Duration::from_secs(30))), &|| true)?;
    let pid: std::result::Result<i32, String> = reply.decode()?;
    let pid = pid.map_err(|e| Error::io("the fork server's fork", std::io::Error::other(e)))?;
    rustix::process::Pid::from_raw(pid).ok_or_else(|| Error::invalid("the fork server sent pid 0"))
}

/// A descriptor sent to the fork server.
struct WorkerFd<'a>(&'a OwnedFd);

impl serde::Serialize for WorkerFd<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let dup = self.0.try_clone().map_err(wire::ser_error)?;
        wire::encode_fd(wire::FdSource::Owned(dup)).map_err(wire::ser_error)?;
        s.serialize_unit()
    }
}

/// A re-executed fork server that cannot work for its parent (see `handshake`): the
/// parent's first request gets `reason` as its answer, and the server exits.
pub(crate) fn refuse(sock: OwnedFd, reason: String) -> ! {
    eprintln!("tensorshare: fork server {}: {reason}", std::process::id());
    if let Ok(msg) = wire::encode(&std::result::Result::<i32, String>::Err(reason)) {
        let _ = socket::send(sock.as_fd(), msg, Deadline::after(None), &|| true);
    }
    drop(sock);
    exit_now(1)
}

/// The server's loop (in the re-executed process): one worker per request, until the
/// parent hangs up.
pub(crate) fn serve(sock: OwnedFd, ppid: i32) -> ! {
    die_with_parent(ppid);
    super::worker::install_panic_hook();
    // Workers forked here share the server's membership of the cleanup group.
    let _ = crate::shm::group::ensure();
    loop {
        let record = match socket::try_recv(sock.as_fd()) {
            Ok(Received::Record(r)) => r,
            Ok(Received::Empty) => {
                let _ = socket::wait(
                    sock.as_fd(),
                    rustix::event::PollFlags::IN,
                    std::time::Duration::from_secs(3600),
                );
                continue;
            }
            Ok(Received::Bad(_)) => continue,
            Ok(Received::Closed) | Err(_) => exit_now(0),
        };
        let mut fds = record.fds;
        let reply: std::result::Result<i32, String> = match fds.pop() {
            None => Err("a request without a job socket".into()),
            Some(job) => fork_worker(job, ppid, &sock),
        };
        if let Ok(msg) = wire::encode(&reply) {
            if socket::send(sock.as_fd(), msg, Deadline::after(None), &|| true).is_err() {
                exit_now(0);
            }
        }
    }
}

fn fork_worker(job: OwnedFd, ppid: i32, server_sock: &OwnedFd) -> std::result::Result<i32, String> {
    // SAFETY: a raw clone with CLONE_PARENT and no new stack behaves as fork (the child
    // continues here on a copy of this stack); the server is single-threaded, so no lock is
    // held by a thread the child lacks. The child leaves through worker_main, with _exit.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone,
            (libc::CLONE_PARENT | libc::SIGCHLD) as libc::c_ulong,
            0usize,
            0usize,
            0usize,
            0usize,
        )
    };
    match pid {
        -1 => Err(std::io::Error::last_os_error().to_string()),
        0 => {
            // The child: it does not serve, it works. Its parent is the server's parent.
            // A raw clone runs no pthread_atfork handler: do what they would.
            crate::util::fork::in_child();
            let _ = rustix::io::fcntl_setfd(server_sock, rustix::io::FdFlags::CLOEXEC);
            // SAFETY: closing the server socket's descriptor in this child only; the
            // OwnedFd of the server loop is never used again here (worker_main never
            // returns).
            unsafe { libc::close(std::os::fd::AsRawFd::as_raw_fd(server_sock)) };
            worker_main(job, ppid, ExitKind::Forked)
        }
        pid => Ok(pid as i32),
    }
}
