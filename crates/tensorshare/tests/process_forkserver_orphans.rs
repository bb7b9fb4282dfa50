//! A requester killed with SIGKILL takes its fork server and the server's workers along,
//! and leaves nothing unreaped.
//!
//! A file of its own: the test process makes itself a child subreaper, so that the fork
//! server, orphaned, becomes its child and it can reap it; no other test here may leave it
//! orphans to reap.

use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::process::{Pid, PidfdFlags, Signal, WaitId, WaitIdOptions};
use tensorshare::{start_processes, Queue, StartMethod};

tensorshare::enable_test_workers!();

/// How long the dead get to be seen dead; a failure, not a hang, if they are not.
const PATIENCE: Duration = Duration::from_secs(60);

fn ids() -> (i32, i32) {
    let ppid = rustix::process::getppid().map_or(0, |p| p.as_raw_nonzero().get());
    (rustix::process::getpid().as_raw_nonzero().get(), ppid)
}

fn report_ids_and_park(_rank: usize, q: Queue<(i32, i32)>) {
    q.put(ids()).unwrap();
    loop {
        std::thread::park();
    }
}

/// Starts two ForkServer workers, which report, and waits to be killed.
fn requester(_rank: usize, q: Queue<(i32, i32)>) {
    let _workers = start_processes(report_ids_and_park, q, 2, StartMethod::ForkServer).unwrap();
    loop {
        std::thread::park();
    }
}

fn ended_within(fd: &OwnedFd, timeout: Duration) -> bool {
    let mut p = [PollFd::new(fd, PollFlags::IN)];
    let ts = Timespec { tv_sec: timeout.as_secs() as i64, tv_nsec: timeout.subsec_nanos() as i64 };
    rustix::event::poll(&mut p, Some(&ts)).unwrap() == 1
}

#[test]
fn a_killed_requester_leaves_no_fork_server_and_no_worker() {
    rustix::process::set_child_subreaper(Some(rustix::process::getpid())).unwrap();
    let q: Queue<(i32, i32)> = Queue::new().unwrap();
    let mut ctx = start_processes(requester, q.clone(), 1, StartMethod::Spawn).unwrap();
    let requester_pid = ctx.pids()[0];
    let workers: Vec<(i32, i32)> = (0..2).map(|_| q.get_timeout(PATIENCE).unwrap()).collect();
    let server = workers[0].1;
    assert_eq!(workers[1].1, server);
    assert_ne!(server, requester_pid, "the workers are the fork server's children");
    // All parked until their requester dies: these pidfds name them.
    let procs: Vec<(i32, OwnedFd)> = [server, workers[0].0, workers[1].0]
        .into_iter()
        .map(|p| (p, rustix::process::pidfd_open(Pid::from_raw(p).unwrap(), PidfdFlags::empty()).unwrap()))
        .collect();

    rustix::process::kill_process(Pid::from_raw(requester_pid).unwrap(), Signal::KILL).unwrap();
    let err = ctx.join(None).unwrap_err();
    assert_eq!(err.signal_name(), Some("SIGKILL"));

    for (pid, fd) in &procs {
        assert!(ended_within(fd, PATIENCE), "process {pid} outlived the requester");
    }
    // The server reaped its workers before it exited; orphaned, it became ours (the
    // subreaper's): reap it, so that nothing is left.
    let (server, server_fd) = &procs[0];
    let status = rustix::process::waitid(WaitId::PidFd(server_fd.as_fd()), WaitIdOptions::EXITED)
        .unwrap_or_else(|e| panic!("reaping the fork server {server}: {e}"))
        .unwrap();
    assert_eq!(status.exit_status(), Some(0), "the fork server shut down on the hang-up");
    for (pid, _) in &procs {
        assert_eq!(
            rustix::process::test_kill_process(Pid::from_raw(*pid).unwrap()),
            Err(rustix::io::Errno::SRCH),
            "process {pid} is still there (running or a zombie)"
        );
    }
}
