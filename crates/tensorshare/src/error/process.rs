//! [`ProcessError`]: how a worker failed, as torch reports it.
//!
//! Plain data: the process layer fills it in, and [`Error`](crate::Error) carries it.

use serde::{Deserialize, Serialize};

/// How a worker process failed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Failure {
    /// The job panicked or returned an `Err`.
    Raised {
        /// The panic message, or the error's `Display`.
        message: String,
        /// Where it panicked (`file:line:column`), when known.
        location: Option<String>,
        /// The child's backtrace at the panic, when captured.
        backtrace: Option<String>,
    },
    /// The process exited with a non-zero code (or with zero before reporting its job).
    Exited {
        /// The exit code.
        code: i32,
    },
    /// The process was killed by a signal.
    Signaled {
        /// The signal number.
        signal: i32,
        /// Its name, such as `SIGABRT`.
        name: String,
    },
    /// A pool task panicked or returned an error; the worker survived it and serves on.
    Task {
        /// The item's index among the items of its `map` or `imap`.
        index: usize,
        /// The panic message, or the error's `Display`.
        message: String,
        /// Where it panicked (`file:line:column`), when known.
        location: Option<String>,
        /// The worker's backtrace at the panic, when captured.
        backtrace: Option<String>,
    },
    /// The worker took its job but its result never came: the job ended the process
    /// (`exit`, `exec`) or closed the socket the result goes through.
    Unreported {
        /// What happened, as in `exited with code 0 before reporting its result`.
        reason: String,
    },
    /// The worker could not run its job at all.
    Lost {
        /// What went wrong.
        reason: String,
    },
}

/// A worker process failed: which one, and how. Serializes, so it can travel through a
/// queue.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessError {
    /// The worker's rank (its index among the processes started together).
    pub rank: usize,
    /// Its process id.
    pub pid: i32,
    /// For a [`Pool`](crate::Pool) task, the index of its item among the items of its call
    /// (`map`, `imap`, `starmap`; 0 for `apply_async`), whether the worker survived the
    /// task ([`Failure::Task`]) or died of it; `None` for a worker of `spawn`.
    #[serde(default)]
    pub task: Option<usize>,
    /// What happened.
    pub failure: Failure,
}

impl ProcessError {
    /// The exit code, for [`Failure::Exited`].
    pub fn exit_code(&self) -> Option<i32> {
        match self.failure {
            Failure::Exited { code } => Some(code),
            _ => None,
        }
    }

    /// The signal's name, for [`Failure::Signaled`].
    pub fn signal_name(&self) -> Option<&str> {
        match &self.failure {
            Failure::Signaled { name, .. } => Some(name),
            _ => None,
        }
    }

    /// The child's message, for [`Failure::Raised`].
    pub fn message(&self) -> Option<&str> {
        match &self.failure {
            Failure::Raised { message, .. } | Failure::Task { message, .. } => Some(message),
            _ => None,
        }
    }
}

/// torch's texts: `process 0 terminated with exit code 123`, `process 0 terminated with
/// signal SIGABRT`, and the child's message, location and (with `{:#}`) backtrace.
impl std::fmt::Display for ProcessError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let rank = self.rank;
        if let (Some(index), false) = (self.task, matches!(self.failure, Failure::Task { .. })) {
            write!(f, "task {index}: ")?;
        }
        match &self.failure {
            Failure::Exited { code } => write!(f, "process {rank} terminated with exit code {code}"),
            Failure::Signaled { name, .. } => write!(f, "process {rank} terminated with signal {name}"),
            Failure::Lost { reason } => write!(f, "process {rank} could not run its job: {reason}"),
            Failure::Unreported { reason } => write!(f, "process {rank} {reason}"),
            Failure::Task { index, message, location, backtrace } => {
                write!(f, "task {index} failed in process {rank} (pid {}): {message}", self.pid)?;
                if let Some(loc) = location {
                    write!(f, ", at {loc}")?;
                }
                if let (true, Some(bt)) = (f.alternate(), backtrace) {
                    write!(f, "\n\nbacktrace of process {rank}:\n{bt}")?;
                }
                Ok(())
            }
            Failure::Raised { message, location, backtrace } => {
                write!(
                    f,
                    "process {rank} (pid {}) terminated with the following error: {message}",
                    self.pid
                )?;
                if let Some(loc) = location {
                    write!(f, ", at {loc}")?;
                }
                if let (true, Some(bt)) = (f.alternate(), backtrace) {
                    write!(f, "\n\nbacktrace of process {rank}:\n{bt}")?;
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for ProcessError {}

/// The name of a signal number (`SIGABRT`), or `SIG<n>`.
pub(crate) fn signal_name(signal: i32) -> String {
    let name = match signal {
        1 => "SIGHUP",
        2 => "SIGINT",
        3 => "SIGQUIT",
        4 => "SIGILL",
        5 => "SIGTRAP",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL",
        10 => "SIGUSR1",
        11 => "SIGSEGV",
        12 => "SIGUSR2",
        13 => "SIGPIPE",
        14 => "SIGALRM",
        15 => "SIGTERM",
        17 => "SIGCHLD",
        24 => "SIGXCPU",
        25 => "SIGXFSZ",
        31 => "SIGSYS",
        _ => return format!("SIG{signal}"),
    };
    name.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn texts_match_torch() {
        let e = ProcessError { rank: 0, pid: 1, task: None, failure: Failure::Exited { code: 123 } };
        assert_eq!(e.to_string(), "process 0 terminated with exit code 123");
        let e = ProcessError {
            rank: 0,
            pid: 1,
            task: None,
            failure: Failure::Signaled { signal: 6, name: signal_name(6) },
        };
        assert_eq!(e.to_string(), "process 0 terminated with signal SIGABRT");
    }

    #[test]
    fn a_pool_task_whose_worker_died_names_its_item() {
        let failure = Failure::Signaled { signal: 9, name: signal_name(9) };
        let e = ProcessError { rank: 1, pid: 7, task: Some(3), failure };
        assert_eq!(e.to_string(), "task 3: process 1 terminated with signal SIGKILL");
    }
}
