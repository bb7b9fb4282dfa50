//! [`ProcessContext`]: the parent's handle on the workers it started.
//!
//! A worker is this process's own child (Spawn, Fork), reaped here with `waitid` on its
//! pidfd, or a child of the fork server (ForkServer), which reaps it and sends its exit
//! status on a socket of that worker's own (see `forkserver`). Either way the worker is
//! waited for by polling one descriptor per worker, signalled through its pidfd, and its
//! end means the same: only who collects the status differs.

use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};
use rustix::process::{Pid, Signal, WaitId, WaitIdOptions};

use super::error::{signal_name, Failure, ProcessError};
use super::worker::Report;
use crate::channel::socket::{self, Received};

/// How long workers get between SIGTERM and SIGKILL after another one failed (torch's
/// default).
pub const DEFAULT_GRACE: Duration = Duration::from_secs(30);

pub(crate) struct Child {
    pub(crate) rank: usize,
    pub(crate) pid: Pid,
    pub(crate) pidfd: OwnedFd,
    /// The job socket, where the worker's report arrives.
    pub(crate) job: OwnedFd,
    /// Who reaps it, and so where its exit status comes from.
    pub(crate) parent: Parent,
    /// Set once reaped: None for success.
    pub(crate) outcome: Option<Option<ProcessError>>,
}

/// Who a worker's parent is: the process that collects its exit status.
pub(crate) enum Parent {
    /// This process: `waitid` on the pidfd.
    This,
    /// The fork server (`server`, its pid), which sends the status on `status` once it has
    /// reaped the worker.
    ForkServer { status: OwnedFd, server: rustix::process::Pid },
}

impl Parent {
    /// What becomes readable when the worker's status can be collected without waiting.
    fn ready<'a>(&'a self, pidfd: &'a OwnedFd) -> &'a OwnedFd {
        match self {
            Parent::This => pidfd,
            Parent::ForkServer { status, .. } => status,
        }
    }
}

/// How a process ended, as its parent's `waitid` tells it (and the fork server forwards it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) enum Ending {
    Exited(i32),
    Signaled(i32),
}

impl Ending {
    /// The ending `waitid(WEXITED)` reported, if it is one.
    pub(crate) fn of(status: &rustix::process::WaitIdStatus) -> Option<Ending> {
        match (status.exit_status(), status.terminating_signal()) {
            (Some(code), _) => Some(Ending::Exited(code)),
            (None, Some(sig)) => Some(Ending::Signaled(sig)),
            (None, None) => None,
        }
    }
}

/// The workers started by [`spawn`](crate::spawn) or
/// [`start_processes`](crate::start_processes). Dropping it kills and reaps any worker
/// still running, so no process is left behind.
pub struct ProcessContext {
    pub(crate) children: Vec<Child>,
    grace: Duration,
    failure: Option<ProcessError>,
}

impl std::fmt::Debug for ProcessContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessContext").field("pids", &self.pids()).finish()
    }
}

impl ProcessContext {
    pub(crate) fn new(children: Vec<Child>) -> ProcessContext {
        ProcessContext { children, grace: DEFAULT_GRACE, failure: None }
    }

    /// The workers' process ids, by rank.
    pub fn pids(&self) -> Vec<i32> {
        self.children.iter().map(|c| c.pid.as_raw_nonzero().get()).collect()
    }

    /// Each worker's state, by rank: `None` while it runs, then `Some(Ok(()))` or
    /// `Some(Err(how it ended))` — for the first failure, and for the workers that were
    /// ended because of it.
    pub fn states(&self) -> Vec<Option<Result<(), ProcessError>>> {
        self.children
            .iter()
            .map(|c| {
                c.outcome.as_ref().map(|o| match o {
                    None => Ok(()),
                    Some(e) => Err(e.clone()),
                })
            })
            .collect()
    }

    /// Sets the time workers get between SIGTERM and SIGKILL once another worker failed.
    pub fn set_grace_period(&mut self, grace: Duration) {
        self.grace = grace;
    }

    /// Waits for the workers: `Ok(true)` once all finished, `Ok(false)` if `timeout`
    /// passed with some still running, `Err` with the first failure: then the others are
    /// sent SIGTERM and, after the grace period, SIGKILL. Calling it again is safe (and
    /// returns the same failure).
    pub fn join(&mut self, timeout: Option<Duration>) -> Result<bool, ProcessError> {
        let grace = self.grace;
        self.join_with_grace(timeout, grace)
    }

    /// [`ProcessContext::join`] with an explicit grace period.
    pub fn join_with_grace(
        &mut self,
        timeout: Option<Duration>,
        grace: Duration,
    ) -> Result<bool, ProcessError> {
        if let Some(f) = &self.failure {
            return Err(f.clone());
        }
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            for c in self.children.iter_mut().filter(|c| c.outcome.is_none()) {
                reap(c, false);
            }
            let first = self.children.iter().find_map(|c| c.outcome.clone().flatten());
            if let Some(err) = first {
                self.terminate(grace);
                self.failure = Some(err.clone());
                return Err(err);
            }
            if self.children.iter().all(|c| c.outcome.is_some()) {
                return Ok(true);
            }
            let left = match deadline {
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Ok(false);
                    }
                    Some(left)
                }
                None => None,
            };
            self.wait_any(left);
        }
    }

    /// Waits until a running worker exits, or `timeout` passes.
    fn wait_any(&self, timeout: Option<Duration>) {
        let mut fds: Vec<PollFd<'_>> = self
            .children
            .iter()
            .filter(|c| c.outcome.is_none())
            .map(|c| PollFd::new(c.parent.ready(&c.pidfd), PollFlags::IN))
            .collect();
        let ts = timeout.map(|t| rustix::event::Timespec {
            tv_sec: t.as_secs() as i64,
            tv_nsec: t.subsec_nanos() as i64,
        });
        let _ = rustix::event::poll(&mut fds, ts.as_ref());
    }

    /// SIGTERM to every running worker, SIGKILL after `grace`, and reap them all.
    fn terminate(&mut self, grace: Duration) {
        for c in self.children.iter().filter(|c| c.outcome.is_none()) {
            let _ = rustix::process::pidfd_send_signal(&c.pidfd, Signal::TERM);
        }
        let deadline = Instant::now() + grace;
        loop {
            for c in self.children.iter_mut().filter(|c| c.outcome.is_none()) {
                reap(c, false);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if self.children.iter().all(|c| c.outcome.is_some()) || left.is_zero() {
                break;
            }
            self.wait_any(Some(left));
        }
        self.kill_all();
    }

    /// SIGKILL to every running worker, and reap them.
    pub(crate) fn kill_all(&mut self) {
        for c in self.children.iter_mut().filter(|c| c.outcome.is_none()) {
            let _ = rustix::process::pidfd_send_signal(&c.pidfd, Signal::KILL);
            reap(c, true);
        }
    }
}

impl Drop for ProcessContext {
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// Collects a worker's exit (waiting for it if `block`), and decides what it means.
pub(crate) fn reap(c: &mut Child, block: bool) {
    let ending = match &c.parent {
        Parent::This => {
            let opts =
                if block { WaitIdOptions::EXITED } else { WaitIdOptions::EXITED | WaitIdOptions::NOHANG };
            match rustix::process::waitid(WaitId::PidFd(c.pidfd.as_fd()), opts) {
                Ok(Some(s)) => Ending::of(&s).ok_or_else(|| "unknown exit status".to_string()),
                Ok(None) => return, // still running
                Err(e) => Err(format!("waitid failed: {e}")),
            }
        }
        Parent::ForkServer { status, server } => {
            match super::forkserver::ending(status, &c.pidfd, c.pid, *server, block) {
                Some(ending) => ending,
                None => return, // still running
            }
        }
    };
    let ending = match ending {
        Ok(ending) => ending,
        Err(reason) => {
            c.outcome = Some(Some(ProcessError {
                rank: c.rank,
                pid: c.pid.as_raw_nonzero().get(),
                task: None,
                failure: Failure::Lost { reason },
            }));
            return;
        }
    };
    let (started, report) = read_reports(&c.job);
    let failure = match (report, ending) {
        (Some(Report::Done), Ending::Exited(0)) => None,
        (Some(Report::Raised { message, location, backtrace }), _) => {
            Some(Failure::Raised { message, location, backtrace })
        }
        (Some(Report::Lost { reason }), _) => Some(Failure::Lost { reason }),
        (Some(Report::Unreported { reason }), _) => Some(Failure::Unreported { reason }),
        (_, Ending::Signaled(sig)) => Some(Failure::Signaled { signal: sig, name: signal_name(sig) }),
        (_, Ending::Exited(0)) if started => Some(Failure::Unreported {
            reason: "exited with code 0 before reporting its result (its job called exit, or exec'd \
                     another program)"
                .into(),
        }),
        (_, Ending::Exited(0)) => Some(Failure::Lost {
            reason: "the worker exited without taking its job; does main() call tensorshare::init() \
                     first (or the test file invoke tensorshare::enable_test_workers!())?"
                .into(),
        }),
        (_, Ending::Exited(code)) => Some(Failure::Exited { code }),
    };
    c.outcome = Some(failure.map(|failure| ProcessError {
        rank: c.rank,
        pid: c.pid.as_raw_nonzero().get(),
        task: None,
        failure,
    }));
}

/// Whether the worker took its job, and its final report if it sent one.
fn read_reports(job: &OwnedFd) -> (bool, Option<Report>) {
    let mut started = false;
    let mut last = None;
    // A worker that exits with records of ours unread (a job it never took) resets the
    // connection: the first receive says so once, and what it sent is still there after.
    let mut reset_seen = false;
    loop {
        match socket::try_recv(job.as_fd()) {
            Ok(Received::Record(r)) => match r.decode() {
                Ok(Report::Started) => started = true,
                Ok(report) => last = Some(report),
                Err(_) => {}
            },
            Ok(Received::Closed) if !reset_seen => reset_seen = true,
            Ok(Received::Bad(_)) => {}
            _ => return (started, last),
        }
    }
}
