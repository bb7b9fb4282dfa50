//! Worker processes: [`init`], [`spawn`], [`start_processes`], [`ProcessContext`],
//! [`ProcessError`], and [`Pool`].
//!
//! What users read about workers (who is one, what it runs, how a parent names a job) is
//! in the crate docs, section *Workers*; `job` and `handshake` hold the mechanism.

mod cleaner;
mod context;
mod fork;
mod forkserver;
#[cfg(feature = "test-support")]
pub(crate) use forkserver::with_record_locked as with_fork_server_record_locked;
mod handshake;
mod image;
mod job;
mod launch;
mod pool;
mod worker;

pub use context::{ProcessContext, DEFAULT_GRACE};
// What a worker's failure is lives with the crate's error type (below this layer); the
// modules here still reach it as `super::error`.
use crate::error::process as error;
pub use fork::allow_fork_with_threads;
pub use job::{trust_libraries_without_build_id, Captured, Job, JobResult, JobReturn};
pub use launch::{set_helper_command, spawn, start_processes, StartMethod, WORKER_ARGS};

pub use pool::{AsyncResult, Pool, PoolBuilder, StarFn, Tasks};

use handshake::{arrive, Arrival, Role};
use worker::exit_now;
#[cfg(feature = "mpi")]
pub(crate) use worker::is_worker;

/// The first line of `main`. In a worker it runs the worker's job and exits the process;
/// everywhere else it returns at once.
///
/// Test binaries cannot call it from `main`: put [`enable_test_workers!`](crate::enable_test_workers)
/// in each test file that starts workers instead.
///
/// A process becomes a worker here only when its parent proves that it started it as one
/// (see the module docs): otherwise `init` returns, whatever the environment says.
pub fn init() {
    match arrive(worker::FORKSERVER_ENV, Role::ForkServer) {
        Arrival::Program => {}
        Arrival::Invited(i) => forkserver::serve(i.sock, i.parent),
        Arrival::Orphaned => exit_now(1),
        Arrival::Refused { sock, reason } => forkserver::refuse(sock, reason),
    }
    match arrive(worker::WORKER_ENV, Role::Worker) {
        Arrival::Program => {}
        Arrival::Invited(i) => worker::worker_main(i.sock, i.parent, worker::ExitKind::Normal),
        Arrival::Orphaned => exit_now(1),
        Arrival::Refused { sock, reason } => worker::refuse(sock, reason),
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
