//! Ports of torch's test/test_multiprocessing_spawn.py, each body run under every start
//! method (Spawn, Fork, ForkServer).

use std::time::Duration;

use tensorshare::{start_processes, Failure, ProcessError, Queue, StartMethod};

tensorshare::enable_test_workers!();

mod common;

/// One test per start method from one body.
macro_rules! each_method {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                use tensorshare::StartMethod;
                #[test]
                fn spawn() {
                    super::$name(StartMethod::Spawn)
                }
                #[test]
                fn fork() {
                    crate::common::isolated(
                        |_rank, m: StartMethod| {
                            crate::common::allow_fork_in_helper();
                            super::$name(m)
                        },
                        StartMethod::Fork,
                    )
                }
                #[test]
                fn forkserver() {
                    super::$name(StartMethod::ForkServer)
                }
            }
        )*
    };
}

each_method!(
    test_success,
    test_success_non_blocking,
    test_first_argument_index,
    test_exception_single,
    test_exception_all,
    test_terminate_signal,
    test_terminate_exit,
    test_terminate_exit_grace,
    test_success_first_then_exception,
    test_nested,
    test_exception_raises,
    test_signal_raises,
    test_process_exited,
    test_closure_state_travels,
);

// Jobs that never return are named functions: a closure whose body diverges would have
// the never type as its return type.
fn abort_job(_rank: usize, _: ()) {
    std::process::abort()
}

fn panic_job(_rank: usize, _: ()) {
    panic!("boom")
}

fn exit_job(_rank: usize, code: i32) {
    std::process::exit(code)
}

fn park_job(_rank: usize, _: ()) {
    loop {
        std::thread::park();
    }
}

fn sigterm_self_job(_rank: usize, _: ()) {
    rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::TERM).unwrap();
    park_job(0, ())
}

fn exit_123_job(rank: usize, _: ()) {
    exit_123_or_block(rank)
}

/// Rank 1 ignores SIGTERM and says so; only then does rank 0 exit with 123.
fn exit_123_ignoring_term_job(rank: usize, ready: Queue<()>) {
    if rank == 0 {
        ready.get().unwrap();
    } else {
        // SAFETY: setting a signal's disposition to ignore, in a worker of this test.
        unsafe { libc::signal(libc::SIGTERM, libc::SIG_IGN) };
        ready.put(()).unwrap();
    }
    exit_123_or_block(rank)
}

fn exit_zero_job(_rank: usize, _: ()) {
    // SAFETY: ends this worker process at once, as a main() without init() would.
    unsafe { libc::_exit(0) }
}

fn test_success(m: StartMethod) {
    let mut ctx = start_processes(|_rank, _: ()| {}, (), 2, m).unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    assert_eq!(ctx.join(None), Ok(true), "join again is safe");
}

fn test_success_non_blocking(m: StartMethod) {
    // The workers wait for the parent's word, so the first join must time out.
    let q: Queue<u8> = Queue::new().unwrap();
    let mut ctx = start_processes(
        |_rank, q: Queue<u8>| {
            q.get().unwrap();
        },
        q.clone(),
        2,
        m,
    )
    .unwrap();
    assert_eq!(ctx.join(Some(Duration::from_millis(20))), Ok(false));
    q.put(1).unwrap();
    q.put(1).unwrap();
    while !ctx.join(Some(Duration::from_millis(50))).unwrap() {}
}

fn test_first_argument_index(m: StartMethod) {
    let q: Queue<usize> = Queue::new().unwrap();
    let mut ctx = start_processes(|rank, q: Queue<usize>| q.put(rank).unwrap(), q.clone(), 3, m).unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    let mut got: Vec<usize> = (0..3).map(|_| q.get().unwrap()).collect();
    got.sort();
    assert_eq!(got, vec![0, 1, 2]);
}

fn raised(e: &ProcessError) -> &str {
    match &e.failure {
        Failure::Raised { message, .. } => message,
        f => panic!("expected a raised error, got {f:?}"),
    }
}

fn test_exception_single(m: StartMethod) {
    for failing in 0..2usize {
        let mut ctx = start_processes(
            |rank, failing: usize| {
                if rank == failing {
                    panic!("legitimate exception from process {rank}");
                }
            },
            failing,
            2,
            m,
        )
        .unwrap();
        let err = ctx.join(None).unwrap_err();
        assert_eq!(err.rank, failing);
        assert_eq!(raised(&err), format!("legitimate exception from process {failing}"));
        assert!(err.to_string().contains(&format!("legitimate exception from process {failing}")));
        match &err.failure {
            Failure::Raised { location, backtrace, .. } => {
                assert!(location.as_deref().unwrap_or("").contains("process_spawn.rs"), "{location:?}");
                assert!(backtrace.as_deref().is_some_and(|b| !b.is_empty()));
            }
            f => panic!("{f:?}"),
        }
    }
}

fn test_exception_all(m: StartMethod) {
    let mut ctx = start_processes(
        |rank, _: ()| -> Result<(), String> { Err(format!("legitimate exception from process {rank}")) },
        (),
        2,
        m,
    )
    .unwrap();
    let err = ctx.join(None).unwrap_err();
    assert_eq!(raised(&err), format!("legitimate exception from process {}", err.rank));
}

fn test_terminate_signal(m: StartMethod) {
    let mut ctx = start_processes(abort_job, (), 1, m).unwrap();
    let err = ctx.join(None).unwrap_err();
    assert_eq!(err.to_string(), "process 0 terminated with signal SIGABRT");
    assert_eq!(err.signal_name(), Some("SIGABRT"));
}

fn exit_123_or_block(rank: usize) -> ! {
    if rank == 0 {
        std::process::exit(123);
    }
    loop {
        std::thread::park();
    }
}

fn test_terminate_exit(m: StartMethod) {
    let mut ctx = start_processes(exit_123_job, (), 2, m).unwrap();
    let err = ctx.join(None).unwrap_err();
    assert_eq!(err.to_string(), "process 0 terminated with exit code 123");
    assert_eq!(err.exit_code(), Some(123));
}

/// The other worker ignores SIGTERM: after the grace period it is SIGKILLed, and join still
/// reports the first failure.
fn test_terminate_exit_grace(m: StartMethod) {
    let ready: Queue<()> = Queue::new().unwrap();
    let mut ctx = start_processes(exit_123_ignoring_term_job, ready, 2, m).unwrap();
    let err = ctx.join_with_grace(None, Duration::from_millis(200)).unwrap_err();
    assert_eq!(err.exit_code(), Some(123));
    // Rank 1 ignored SIGTERM, so it was SIGKILLed once the grace period was over.
    let states = ctx.states();
    match &states[1] {
        Some(Err(e)) => assert_eq!(e.signal_name(), Some("SIGKILL"), "{e}"),
        s => panic!("rank 1: {s:?}"),
    }
}

fn test_success_first_then_exception(m: StartMethod) {
    let q: Queue<()> = Queue::new().unwrap();
    let mut ctx = start_processes(
        |rank, q: Queue<()>| {
            if rank == 0 {
                q.put(()).unwrap();
                return;
            }
            q.get().unwrap();
            panic!("Exception in process {rank}");
        },
        q.clone(),
        2,
        m,
    )
    .unwrap();
    let err = ctx.join(None).unwrap_err();
    assert_eq!(err.rank, 1);
    assert_eq!(raised(&err), "Exception in process 1");
}

/// Grandchildren die with their parent (disabled upstream, enabled here).
fn test_nested(m: StartMethod) {
    let q: Queue<Vec<i32>> = Queue::new().unwrap();
    let mut ctx = start_processes(
        |_rank, (q, m): (Queue<Vec<i32>>, StartMethod)| {
            let grandchildren = start_processes(park_job, (), 2, m).unwrap();
            q.put(grandchildren.pids()).unwrap();
            park_job(0, ());
        },
        (q.clone(), m),
        1,
        m,
    )
    .unwrap();
    let pids = q.get().unwrap();
    let pidfds: Vec<_> = pids
        .iter()
        .map(|&p| {
            rustix::process::pidfd_open(
                rustix::process::Pid::from_raw(p).unwrap(),
                rustix::process::PidfdFlags::empty(),
            )
            .unwrap()
        })
        .collect();
    let child = rustix::process::Pid::from_raw(ctx.pids()[0]).unwrap();
    rustix::process::kill_process(child, rustix::process::Signal::KILL).unwrap();
    let err = ctx.join(None).unwrap_err();
    assert_eq!(err.signal_name(), Some("SIGKILL"));
    for fd in &pidfds {
        let mut p = [rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN)];
        let one_second = rustix::event::Timespec { tv_sec: 1, tv_nsec: 0 };
        let n = rustix::event::poll(&mut p, Some(&one_second)).unwrap();
        assert_eq!(n, 1, "a grandchild outlived its parent by a second");
    }
}

fn test_exception_raises(m: StartMethod) {
    let mut ctx = start_processes(panic_job, (), 1, m).unwrap();
    let err: tensorshare::Error = ctx.join(None).unwrap_err().into();
    assert!(matches!(err, tensorshare::Error::Process(ProcessError { failure: Failure::Raised { .. }, .. })));
}

fn test_signal_raises(m: StartMethod) {
    let mut ctx = start_processes(sigterm_self_job, (), 1, m).unwrap();
    let err = ctx.join(None).unwrap_err();
    assert!(matches!(err.failure, Failure::Signaled { signal: 15, .. }), "{err:?}");
}

/// Upstream's `_test_process_exited` can never fail (it asserts inside the child); here the
/// parent checks the exit code it actually saw.
fn test_process_exited(m: StartMethod) {
    let mut ctx = start_processes(exit_job, 7, 1, m).unwrap();
    let err = ctx.join(None).unwrap_err();
    assert_eq!(err.failure, Failure::Exited { code: 7 });
    assert_eq!(err.pid, ctx.pids()[0]);
}

fn test_closure_state_travels(m: StartMethod) {
    let q: Queue<String> = Queue::new().unwrap();
    let greeting = String::from("hello from");
    let job = tensorshare::closure!([greeting] |rank, q: Queue<String>| {
        q.put(format!("{greeting} {rank}")).unwrap();
    });
    let mut ctx = start_processes(job, q.clone(), 1, m).unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    assert_eq!(q.get().unwrap(), "hello from 0");
}

#[test]
fn test_errors_pickleable() {
    let err = ProcessError {
        rank: 3,
        pid: 42,
        task: None,
        failure: Failure::Raised { message: "m".into(), location: Some("f.rs:1:2".into()), backtrace: None },
    };
    let bytes = postcard::to_allocvec(&err).unwrap();
    let back: ProcessError = postcard::from_bytes(&bytes).unwrap();
    assert_eq!(back, err);
    // And through a queue, as a value.
    let q: Queue<ProcessError> = Queue::new().unwrap();
    q.put(err.clone()).unwrap();
    assert_eq!(q.get().unwrap(), err);
}

#[test]
fn a_job_that_exits_zero_is_reported_not_hung() {
    // The worker took its job, so this is no missing init() (see process_forgotten_init.rs
    // for that): it is reported as what it is.
    let mut ctx = start_processes(exit_zero_job, (), 1, StartMethod::Spawn).unwrap();
    let err = ctx.join(None).unwrap_err();
    assert!(matches!(err.failure, Failure::Unreported { .. }), "{err:?}");
}

#[test]
fn closure_captures_clones_and_names_its_return_type() {
    let weights = vec![10u32, 20];
    let q: Queue<u32> = Queue::new().unwrap();
    let job = tensorshare::closure!([w = weights.clone(), q = q.clone()] |rank, _: ()| -> Result<(), String> {
        q.put(w[rank]).map_err(|e| e.to_string())
    });
    let mut ctx = tensorshare::spawn(job, (), 2).unwrap();
    let mut got = vec![q.get().unwrap(), q.get().unwrap()];
    got.sort();
    assert_eq!(got, weights, "the caller still has its own copy");
    assert_eq!(ctx.join(None), Ok(true));
}
