//! Test support shared by the test files that start workers.

use tensorshare::{start_processes, Job, StartMethod};

/// Runs `body(method)` in a fresh single-threaded process (a Spawn worker), and fails the
/// calling test with the body's panic, location and backtrace if it fails.
///
/// The Fork start method forks the calling process. A test binary runs tests on many
/// threads at once, and a lock that another thread holds at the fork (the standard
/// library's stdout, environment or panic hook) would stay locked in the child for good, so
/// tests fork only from a process that has no other busy threads, as programs should.
pub fn isolated<J: Job<StartMethod>>(body: J, method: StartMethod) {
    let mut ctx = start_processes(body, method, 1, StartMethod::Spawn).expect("start the helper process");
    if let Err(e) = ctx.join(None) {
        panic!("{e:#}");
    }
}
