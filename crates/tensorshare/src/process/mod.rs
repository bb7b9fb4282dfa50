//! Worker processes: [`init`], [`spawn`], [`start_processes`], [`ProcessContext`],
//! [`ProcessError`], and [`Pool`].
//!
//! A worker runs a Rust closure: one that captures nothing (the worker runs the same
//! executable, so it has the same code), or one made with [`closure!`](crate::closure)
//! whose captured variables are sent along. Arguments travel as a message, so tensors in
//! them are shared, not copied, and queues and pipes work in the worker.
//!
//! Workers die with their parent (PR_SET_PDEATHSIG). In Linux terms the parent is the
//! *thread* that started them: start long-lived workers from a thread that outlives them.

mod atfork;
mod context;
mod error;
mod forkserver;
mod image;
mod job;
mod launch;
mod pool;
mod worker;

pub use context::{ProcessContext, DEFAULT_GRACE};
pub use error::{signal_name, Failure, ProcessError};
pub use job::{trust_libraries_without_build_id, Captured, Job, JobResult, JobReturn};
pub use launch::{spawn, start_processes, StartMethod, WORKER_ARGS};

pub use pool::{Pool, Tasks};

pub(crate) use launch::exec_helper;
pub(crate) use worker::exit_now;

/// The first line of `main`. In a worker it runs the worker's job and exits the process;
/// everywhere else it returns at once.
///
/// Test binaries cannot call it from `main`: put [`enable_test_workers!`](crate::enable_test_workers)
/// in each test file that starts workers instead.
pub fn init() {
    if let Some((fd, ppid)) = worker::inherited(worker::FORKSERVER_ENV) {
        forkserver::serve(fd, ppid);
    }
    if let Some((fd, ppid)) = worker::inherited(worker::WORKER_ENV) {
        worker::worker_main(fd, ppid, worker::ExitKind::Normal);
    }
}

/// Lets a test binary (an integration test file, or the unit tests of a crate) start
/// workers: it adds the test that re-executed workers run, which calls [`init`]. Invoke it
/// once, at the root of the test crate.
///
/// ```ignore
/// tensorshare::enable_test_workers!();
///
/// #[test]
/// fn doubles_in_a_worker() { /* spawn(...) */ }
/// ```
#[macro_export]
macro_rules! enable_test_workers {
    () => {
        #[test]
        fn __tensorshare_worker() {
            $crate::init();
        }
    };
}
