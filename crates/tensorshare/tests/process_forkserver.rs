//! What only the ForkServer start method does: its workers are the fork server's own
//! children, made by a real `fork`; the server reaps them and tells the parent how each
//! ended, so that joins, signals and failures read as with any other start method.
//!
//! The tests that look at one server (its pid, its descriptors, its death) run in a helper
//! process of their own, which has a server of its own.

use std::os::fd::AsFd;
use std::time::Duration;

use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::process::{Pid, PidfdFlags, Signal, WaitId, WaitIdOptions};
use tensorshare::{start_processes, Error, Failure, Pool, Queue, StartMethod};

tensorshare::enable_test_workers!();

mod common;

const FS: StartMethod = StartMethod::ForkServer;

/// Long enough for anything these tests wait for; a failure, not a hang, if it never comes.
const PATIENCE: Duration = Duration::from_secs(60);

/// This process's pid and its parent's.
fn ids() -> (i32, i32) {
    let ppid = rustix::process::getppid().map_or(0, |p| p.as_raw_nonzero().get());
    (rustix::process::getpid().as_raw_nonzero().get(), ppid)
}

/// The parent of process `pid` (field 4 of `/proc/<pid>/stat`, after the command's name).
fn parent_of(pid: i32) -> i32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after_name = &stat[stat.rfind(')').unwrap() + 2..];
    after_name.split(' ').nth(1).unwrap().parse().unwrap()
}

fn pidfd(pid: i32) -> std::os::fd::OwnedFd {
    rustix::process::pidfd_open(Pid::from_raw(pid).unwrap(), PidfdFlags::empty()).unwrap()
}

/// Whether the process behind `fd` has ended, waiting up to `timeout` for it.
fn ended_within(fd: &std::os::fd::OwnedFd, timeout: Duration) -> bool {
    let mut p = [PollFd::new(fd, PollFlags::IN)];
    let ts = Timespec { tv_sec: timeout.as_secs() as i64, tv_nsec: timeout.subsec_nanos() as i64 };
    rustix::event::poll(&mut p, Some(&ts)).unwrap() == 1
}

/// That the dead process behind `fd`, a child of this one, is reaped already (no zombie).
fn assert_reaped(fd: &std::os::fd::OwnedFd) {
    let wait =
        rustix::process::waitid(WaitId::PidFd(fd.as_fd()), WaitIdOptions::EXITED | WaitIdOptions::NOHANG);
    assert!(matches!(wait, Err(rustix::io::Errno::CHILD)), "the dead server is a zombie: {wait:?}");
}

fn report_ids(_rank: usize, q: Queue<(i32, i32)>) {
    q.put(ids()).unwrap();
}

fn park_job(_rank: usize, _: ()) {
    loop {
        std::thread::park();
    }
}

fn report_ids_and_park(_rank: usize, q: Queue<(i32, i32)>) {
    q.put(ids()).unwrap();
    park_job(0, ())
}

fn abort_job(_rank: usize, _: ()) {
    std::process::abort()
}

/// Fails on the raw `clone(CLONE_PARENT)` of old: its workers were the requester's own
/// children.
#[test]
fn workers_are_children_of_the_fork_server() {
    let q: Queue<(i32, i32)> = Queue::new().unwrap();
    let mut ctx = start_processes(report_ids, q.clone(), 2, FS).unwrap();
    let got: Vec<(i32, i32)> = (0..2).map(|_| q.get_timeout(PATIENCE).unwrap()).collect();
    assert_eq!(ctx.join(None), Ok(true));
    let me = std::process::id() as i32;
    let server = got[0].1;
    for (pid, ppid) in got {
        assert!(ctx.pids().contains(&pid), "{pid} is not among {:?}", ctx.pids());
        assert_ne!(ppid, me, "the worker is the requester's child, not the fork server's");
        assert_eq!(ppid, server, "both workers come from one server");
    }
    assert_eq!(parent_of(server), me, "the fork server is the requester's child");
}

fn abort_then_serve(_rank: usize, _: ()) {
    let q: Queue<(i32, i32)> = Queue::new().unwrap();
    let mut first = start_processes(report_ids, q.clone(), 1, FS).unwrap();
    assert_eq!(first.join(None), Ok(true));
    let (_, server) = q.get_timeout(PATIENCE).unwrap();

    let mut ctx = start_processes(abort_job, (), 1, FS).unwrap();
    let err = ctx.join(None).unwrap_err();
    assert_eq!(err.to_string(), "process 0 terminated with signal SIGABRT");
    assert_eq!(err.signal_name(), Some("SIGABRT"));
    assert_eq!(err.pid, ctx.pids()[0]);

    // The server survived the abort, and serves the next batch.
    rustix::process::test_kill_process(Pid::from_raw(server).unwrap()).expect("the fork server is alive");
    let mut next = start_processes(report_ids, q.clone(), 2, FS).unwrap();
    assert_eq!(next.join(None), Ok(true));
    for _ in 0..2 {
        let (_, ppid) = q.get_timeout(PATIENCE).unwrap();
        assert_eq!(ppid, server, "the same server forked the next batch");
    }
}

/// On musl, `abort()` in a worker made by the raw clone signalled the server (libc's cached
/// thread id was the server's); glibc never showed it. Either way: the worker is reported
/// as signaled SIGABRT, and the server lives on.
#[test]
fn an_aborting_worker_is_reported_and_the_server_serves_on() {
    common::isolated_with(abort_then_serve, ());
}

#[test]
fn join_times_out_then_reports_a_kill_and_terminates_the_rest() {
    let mut ctx = start_processes(park_job, (), 2, FS).unwrap();
    assert_eq!(ctx.join(Some(Duration::from_millis(50))), Ok(false));
    // Parked until signalled, so the pid still names the worker.
    rustix::process::kill_process(Pid::from_raw(ctx.pids()[1]).unwrap(), Signal::KILL).unwrap();
    let err = ctx.join(None).unwrap_err();
    assert_eq!(err.to_string(), "process 1 terminated with signal SIGKILL");
    match &ctx.states()[0] {
        Some(Err(e)) => assert_eq!(e.signal_name(), Some("SIGTERM"), "{e}"),
        s => panic!("rank 0 was not terminated: {s:?}"),
    }
    assert_eq!(ctx.join(None), Err(err), "join again gives the same failure");
}

#[test]
fn dropping_the_context_kills_and_reaps_the_workers() {
    let ctx = start_processes(park_job, (), 3, FS).unwrap();
    let pids = ctx.pids();
    // Parked until killed: these pidfds name the workers.
    let fds: Vec<_> = pids.iter().map(|&p| pidfd(p)).collect();
    drop(ctx);
    for (fd, pid) in fds.iter().zip(&pids) {
        assert!(ended_within(fd, Duration::ZERO), "worker {pid} outlived its context");
        // Reaped by the server before it told us: nothing is left of it.
        assert_eq!(
            rustix::process::test_kill_process(Pid::from_raw(*pid).unwrap()),
            Err(rustix::io::Errno::SRCH),
            "worker {pid} is a zombie"
        );
    }
}

fn server_descriptors(server: i32) -> usize {
    std::fs::read_dir(format!("/proc/{server}/fd")).unwrap().count()
}

fn no_descriptor_per_finished_worker(_rank: usize, _: ()) {
    let q: Queue<(i32, i32)> = Queue::new().unwrap();
    let first = start_processes(report_ids_and_park, q.clone(), 1, FS).unwrap();
    let (_, server) = q.get_timeout(PATIENCE).unwrap();
    let before = server_descriptors(server);
    for _ in 0..10 {
        let mut ok = start_processes(|_rank, _: ()| {}, (), 2, FS).unwrap();
        assert_eq!(ok.join(None), Ok(true));
        let mut failed = start_processes(abort_job, (), 1, FS).unwrap();
        failed.join(None).unwrap_err();
    }
    let second = start_processes(report_ids_and_park, q.clone(), 1, FS).unwrap();
    assert_eq!(q.get_timeout(PATIENCE).unwrap().1, server);
    let after = server_descriptors(server);
    // The server holds two descriptors per live worker (a pidfd and a status socket); each
    // count may also see the two it is closing just after an answer. 30 finished workers
    // leaking theirs would show as 60 more.
    assert!(
        after <= before + 4,
        "the server holds {after} descriptors, {before} before 30 workers came and went"
    );
    drop((first, second));
}

#[test]
fn the_server_keeps_nothing_of_finished_workers() {
    common::isolated_with(no_descriptor_per_finished_worker, ());
}

fn killed_server_is_replaced(_rank: usize, _: ()) {
    let q: Queue<(i32, i32)> = Queue::new().unwrap();
    let mut ctx = start_processes(report_ids_and_park, q.clone(), 2, FS).unwrap();
    let workers: Vec<(i32, i32)> = (0..2).map(|_| q.get_timeout(PATIENCE).unwrap()).collect();
    let server = workers[0].1;
    let server_fd = pidfd(server);
    rustix::process::pidfd_send_signal(&server_fd, Signal::KILL).unwrap();
    let err = ctx.join(None).unwrap_err();
    match &err.failure {
        Failure::Lost { reason } => assert!(reason.contains("fork server"), "{reason}"),
        f => panic!("{f:?}"),
    }
    // The workers died with their server: join waited for that.
    for (pid, _) in &workers {
        let gone = rustix::process::pidfd_open(Pid::from_raw(*pid).unwrap(), PidfdFlags::empty())
            .map_or(true, |fd| ended_within(&fd, Duration::ZERO));
        assert!(gone, "worker {pid} outlived its fork server");
    }
    // And the dead server, a child of this process, is reaped already: no zombie is left
    // waiting for a next request that may never come.
    assert_reaped(&server_fd);
    // The next request starts another server.
    let mut next = start_processes(report_ids, q.clone(), 1, FS).unwrap();
    assert_eq!(next.join(None), Ok(true));
    let (_, new_server) = q.get_timeout(PATIENCE).unwrap();
    assert_ne!(new_server, server);
    assert_reaped(&server_fd);
}

#[test]
fn workers_die_with_their_server_and_the_server_is_replaced() {
    common::isolated_with(killed_server_is_replaced, ());
}

fn abort_on_two(x: u32) -> (u32, i32) {
    if x == 2 {
        std::process::abort();
    }
    (x * 10, ids().1)
}

#[test]
fn a_pool_worker_that_aborts_fails_its_task_and_is_replaced() {
    let mut pool = Pool::with_method(2, FS).unwrap();
    let results: Vec<_> = pool.imap(abort_on_two, 0..6u32).collect();
    let me = std::process::id() as i32;
    for (i, r) in results.iter().enumerate() {
        match r {
            Err(Error::Process(e)) if i == 2 => {
                assert_eq!(e.failure, Failure::Signaled { signal: libc::SIGABRT, name: "SIGABRT".into() });
                assert_eq!(e.task, Some(2));
            }
            Ok((v, ppid)) if i != 2 => {
                assert_eq!(*v, i as u32 * 10);
                assert_ne!(*ppid, me, "a pool worker is the fork server's child");
            }
            r => panic!("item {i}: {r:?}"),
        }
    }
    assert_eq!(pool.pids().len(), 2);
    assert_eq!(pool.map(|x: u32| x + 1, vec![1, 2]).unwrap(), vec![2, 3]);
}

fn forkserver_worker_from_a_fork_worker(_rank: usize, _: ()) {
    common::allow_fork_in_helper();
    // This process has a fork server now; a Fork worker inherits the record of it.
    let mut first = start_processes(|_rank, _: ()| {}, (), 1, FS).unwrap();
    assert_eq!(first.join(None), Ok(true));
    let mut forked = start_processes(
        |_rank, _: ()| {
            let mut ctx = start_processes(|_rank, _: ()| {}, (), 1, StartMethod::ForkServer).unwrap();
            assert_eq!(ctx.join(None), Ok(true));
        },
        (),
        1,
        StartMethod::Fork,
    )
    .unwrap();
    if let Err(e) = forked.join(None) {
        panic!("{e:#}");
    }
    // And the parent's server still serves the parent.
    let mut last = start_processes(|_rank, _: ()| {}, (), 1, FS).unwrap();
    assert_eq!(last.join(None), Ok(true));
}

fn forkserver_worker_forked_while_the_record_is_busy(_rank: usize, _: ()) {
    let (locked, is_locked) = std::sync::mpsc::channel();
    let (forked, was_forked) = std::sync::mpsc::channel::<()>();
    let holder = std::thread::spawn(move || {
        tensorshare::raw::with_fork_server_record_locked(|| {
            locked.send(()).unwrap();
            was_forked.recv().unwrap();
        })
    });
    is_locked.recv().unwrap();
    // SAFETY: the harness's main thread holds no lock (see `common::allow_fork_in_helper`),
    // and the holder thread holds only the fork server's record, which the Fork worker
    // below must do without: that is what this test is about.
    unsafe { tensorshare::allow_fork_with_threads() };
    let mut worker = start_processes(
        |_rank, _: ()| {
            let mut ctx = start_processes(|_rank, _: ()| {}, (), 1, FS).unwrap();
            assert_eq!(ctx.join(Some(PATIENCE)), Ok(true));
        },
        (),
        1,
        StartMethod::Fork,
    )
    .unwrap();
    forked.send(()).unwrap();
    holder.join().unwrap();
    assert_eq!(
        worker.join(Some(PATIENCE)),
        Ok(true),
        "a child forked while its parent's fork-server record was locked could not start a worker"
    );
}

/// A child forked while a thread of its parent held the record of the parent's fork server
/// (starting it, or waiting for an answer) starts a server of its own, not waiting for a
/// lock that no thread of it will release.
#[test]
fn a_child_forked_while_the_server_record_is_busy_starts_its_own() {
    common::isolated_with(forkserver_worker_forked_while_the_record_is_busy, ());
}

/// A Fork worker starts a fork server of its own: its parent's is not its child.
#[test]
fn a_fork_worker_starts_its_own_fork_server() {
    common::isolated_with(forkserver_worker_from_a_fork_worker, ());
}

fn pool_after_its_server_is_killed(_rank: usize, _: ()) {
    let mut pool = Pool::with_method(3, FS).unwrap();
    assert_eq!(pool.map(|x: u32| x + 1, 0..6u32).unwrap(), (1..7).collect::<Vec<u32>>());
    let server = parent_of(pool.pids()[0]);
    let server_fd = pidfd(server);
    rustix::process::pidfd_send_signal(&server_fd, Signal::KILL).unwrap();
    let workers: Vec<_> = pool.pids().into_iter().map(pidfd).collect();
    for w in &workers {
        assert!(ended_within(w, PATIENCE), "a pool worker outlived its fork server");
    }
    // All three idle workers died with the server: each is replaced (the first replacement
    // reaps the old server and starts a new one, which the later ones use), and the pool
    // serves on with three live workers of the new server.
    assert_eq!(pool.map(|x: u32| x * 2, 0..9u32).unwrap(), (0..9).map(|x| x * 2).collect::<Vec<u32>>());
    let pids = pool.pids();
    assert_eq!(pids.len(), 3);
    let servers: Vec<i32> = pids.iter().map(|&p| parent_of(p)).collect();
    assert!(servers.iter().all(|&s| s == servers[0] && s != server), "{servers:?}, old server {server}");
    assert_reaped(&server_fd);
}

#[test]
fn a_pool_whose_fork_server_is_killed_replaces_its_workers_and_serves_on() {
    common::isolated_with(pool_after_its_server_is_killed, ());
}
