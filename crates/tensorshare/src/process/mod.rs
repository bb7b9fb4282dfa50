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
//!
//! # Who is a worker, and what it runs
//! A re-executed worker ([`StartMethod::Spawn`], and the fork server) is this program again,
//! told by a variable (`TENSORSHARE_WORKER`, `TENSORSHARE_FORKSERVER`) that it is one. The
//! variable alone proves nothing, so [`init`] makes a process a worker only when its parent
//! proves that it started it as one: descriptor 3 must be an AF_UNIX SOCK_SEQPACKET socket
//! whose peer (SO_PEERCRED, recorded by the kernel) is the parent the variable names, and a
//! hello must already wait on it with the random token the variable holds. Otherwise
//! `init` writes one line to stderr and returns: the program runs as usual, it never waits
//! on a socket it was not given. The same proof guards the shared-memory cleaner, which
//! runs before `main` (see [`shm::group`](crate::shm::group)).
//!
//! A parent names the job to run by the loaded object that holds its code (the executable,
//! or a shared library by path), that object's GNU build-id, an offset in it, and a hash of
//! the job's type name. The hello carries the parent's executable identity (file and
//! build-id), and a worker of another executable refuses, with an error its parent
//! reports. A worker then calls the named code only after it has checked that the object
//! is loaded and the same build, and that the bytes at the offset are a job descriptor of
//! the right kind and type; see [`trust_libraries_without_build_id`] for the one check a
//! program can waive, `unsafe`ly. So a worker never jumps to an address that it has not
//! checked to be an entry of this very build, across shared libraries as well
//! (`-C prefer-dynamic`, a job in a `dylib`).

mod atfork;
mod context;
mod error;
mod fork;
mod forkserver;
mod handshake;
mod image;
mod job;
mod launch;
mod pool;
mod pool_async;
mod worker;

pub use context::{ProcessContext, DEFAULT_GRACE};
pub use error::{signal_name, Failure, ProcessError};
pub use fork::allow_fork_with_threads;
pub use job::{trust_libraries_without_build_id, Captured, Job, JobResult, JobReturn};
pub use launch::{spawn, start_processes, StartMethod, WORKER_ARGS};

pub use pool::{Pool, PoolBuilder, Tasks};
pub use pool_async::{AsyncResult, StarFn};

pub(crate) use handshake::{arrive, Arrival, Invitation, Invited, Role};
pub(crate) use launch::exec_helper;
pub(crate) use worker::exit_now;

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
