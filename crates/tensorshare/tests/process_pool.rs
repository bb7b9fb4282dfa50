//! Pool: torch's test_fd_pool / test_fs_pool, and what its users need beyond them.

use std::time::Duration;

use tensorshare::{AsyncResult, DType, Error, Failure, Pool, Queue, SharingStrategy, StartMethod, Tensor};

tensorshare::enable_test_workers!();

#[macro_use]
mod common;

/// torch's _test_pool: workers fill shared buffers with 4 in place and return buffer + 1.
fn pool_fill(s: SharingStrategy) {
    let mut p = Pool::new(2).unwrap();
    assert_eq!(p.pids().len(), 2);
    let buffers: Vec<Tensor> = (0..4)
        .map(|_| {
            let mut t = Tensor::zeros(&[2, 2], DType::F32);
            t.share_memory_with(s).unwrap();
            t
        })
        .collect();
    let results = p
        .map(
            |mut t: Tensor| {
                t.fill(4.0f32).unwrap();
                Tensor::full(t.shape(), 5.0f32)
            },
            buffers.clone(),
        )
        .unwrap();
    assert_eq!(results.len(), buffers.len());
    for r in &results {
        assert_eq!(r.to_vec::<f32>().unwrap(), vec![5.0; 4]);
    }
    for b in &buffers {
        assert_eq!(b.to_vec::<f32>().unwrap(), vec![4.0; 4]);
    }
}

#[test]
fn test_fd_pool() {
    checked!(pool_fill, SharingStrategy::FileDescriptor, SharingStrategy);
}

#[test]
fn test_fs_pool() {
    checked!(pool_fill, SharingStrategy::FileSystem, SharingStrategy);
}

#[test]
fn imap_is_ordered_and_imap_unordered_gives_everything() {
    let mut p = Pool::with_method(3, StartMethod::ForkServer).unwrap();
    let squares: Vec<u64> = p.imap(|x: u64| x * x, 0..50u64).map(|r| r.unwrap()).collect();
    assert_eq!(squares, (0..50u64).map(|x| x * x).collect::<Vec<_>>());
    let mut any: Vec<u64> = p.imap_unordered(|x: u64| x + 1, 0..50u64).map(|r| r.unwrap()).collect();
    any.sort();
    assert_eq!(any, (1..=50u64).collect::<Vec<_>>());
}

#[test]
fn a_panicking_task_fails_alone_and_its_worker_goes_on() {
    let mut p = Pool::new(1).unwrap();
    let pids = p.pids();
    let results: Vec<_> = p
        .imap(
            |x: u32| {
                if x == 2 {
                    panic!("task {x} failed");
                }
                x
            },
            0..4u32,
        )
        .collect();
    assert_eq!(results[0].as_ref().unwrap(), &0);
    match &results[2] {
        Err(Error::Process(e)) => {
            assert_eq!(e.message(), Some("task 2 failed"));
            // The worker survived: the error names the item, and no process "terminated".
            let text = e.to_string();
            assert!(text.starts_with("task 2 failed in process 0"), "{text}");
            assert!(!text.contains("terminated"), "{text}");
        }
        r => panic!("{r:?}"),
    }
    assert_eq!(results[3].as_ref().unwrap(), &3);
    assert_eq!(p.pids(), pids, "the worker survived its task's panic");
}

fn die_on_three(x: u32) -> u32 {
    if x == 3 {
        rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL).unwrap();
    }
    x * 10
}

#[test]
fn a_sigkilled_worker_fails_its_task_is_replaced_and_the_pool_serves_on() {
    for method in [StartMethod::Spawn, StartMethod::Fork, StartMethod::ForkServer] {
        common::isolated(|_rank, method: StartMethod| sigkilled_worker(method), method);
    }
}

fn sigkilled_worker(method: StartMethod) {
    common::allow_fork_in_helper();
    {
        let mut p = Pool::with_method(2, method).unwrap();
        let results: Vec<_> = p.imap(die_on_three, 0..8u32).collect();
        for (i, r) in results.iter().enumerate() {
            if i == 3 {
                match r {
                    Err(Error::Process(e)) => {
                        assert_eq!(e.failure, Failure::Signaled { signal: 9, name: "SIGKILL".into() });
                        assert_eq!(e.task, Some(3), "{method}: the error names the item");
                        assert!(e.to_string().starts_with("task 3: process "), "{e}");
                    }
                    r => panic!("{method}: {r:?}"),
                }
            } else {
                assert_eq!(r.as_ref().unwrap(), &(i as u32 * 10), "{method}");
            }
        }
        assert_eq!(p.pids().len(), 2);
        assert_eq!(p.map(|x: u32| x + 1, vec![1, 2]).unwrap(), vec![2, 3], "{method}");
    }
}

#[test]
fn an_initializer_runs_in_every_worker() {
    let mut p = Pool::with_initializer(2, StartMethod::Spawn, |rank| {
        std::env::set_var("POOL_RANK", rank.to_string());
    })
    .unwrap();
    let mut ranks = p.map(|_: u8| std::env::var("POOL_RANK").unwrap(), vec![0u8; 8]).unwrap();
    ranks.sort();
    ranks.dedup();
    assert!(!ranks.is_empty() && ranks.iter().all(|r| r == "0" || r == "1"));
}

#[test]
fn dropping_the_pool_ends_its_workers() {
    let p = Pool::new(2).unwrap();
    let pidfds: Vec<_> = p
        .pids()
        .into_iter()
        .map(|pid| {
            let pid = rustix::process::Pid::from_raw(pid).unwrap();
            rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).unwrap()
        })
        .collect();
    drop(p);
    for fd in &pidfds {
        // Dropping the pool waited for its workers: each has exited already.
        let mut poll = [rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN)];
        let zero = rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 };
        assert_eq!(rustix::event::poll(&mut poll, Some(&zero)).unwrap(), 1, "a worker outlived its pool");
    }
}

fn times_ten_once_told(item: (u32, Queue<()>)) -> u32 {
    let (x, told) = item;
    if x == 1 {
        told.get().unwrap();
    }
    x * 10
}

#[test]
fn a_map_after_an_abandoned_imap_gets_its_own_results() {
    let mut p = Pool::new(2).unwrap();
    let told: Queue<()> = Queue::new().unwrap();
    {
        let mut it = p.imap(times_ten_once_told, (0..4u32).map(|x| (x, told.clone())));
        assert_eq!(it.next().unwrap().unwrap(), 0);
        // Item 1 is still running when its iterator goes.
    }
    told.put(()).unwrap();
    assert_eq!(p.map(|x: u32| x + 1, vec![5, 6, 7]).unwrap(), vec![6, 7, 8]);
}

fn panic_on_twelve(x: u32) -> u32 {
    if x == 12 {
        panic!("item {x} refused");
    }
    x * 2
}

#[test]
fn chunks_keep_order_and_a_task_error_names_its_item_in_the_whole_input() {
    let mut p = Pool::new(2).unwrap();
    let pids = p.pids();
    assert_eq!(
        p.map_chunked(|x: u64| x * x, 0..100u64, 7).unwrap(),
        (0..100u64).map(|x| x * x).collect::<Vec<_>>()
    );
    for chunk in [1, 5, 64] {
        let results: Vec<_> = p.imap(panic_on_twelve, 0..30u32).chunksize(chunk).collect();
        assert_eq!(results.len(), 30);
        for (i, r) in results.iter().enumerate() {
            if i == 12 {
                match r {
                    Err(Error::Process(e)) => {
                        assert!(matches!(e.failure, Failure::Task { index: 12, .. }), "chunk {chunk}: {e:?}");
                        assert_eq!(e.task, Some(12));
                        assert!(e.to_string().starts_with("task 12 failed in process"), "{e}");
                    }
                    r => panic!("chunk {chunk}: {r:?}"),
                }
            } else {
                assert_eq!(r.as_ref().unwrap(), &(i as u32 * 2), "chunk {chunk}, item {i}");
            }
        }
        let mut any: Vec<u64> =
            p.imap_unordered(|x: u64| x + 1, 0..40u64).chunksize(chunk).map(|r| r.unwrap()).collect();
        any.sort();
        assert_eq!(any, (1..=40u64).collect::<Vec<_>>());
    }
    assert_eq!(p.pids(), pids, "no worker died of a panicking task");
}

#[test]
fn a_worker_that_dies_in_a_chunk_names_the_item_it_ran() {
    for method in [StartMethod::Spawn, StartMethod::Fork] {
        common::isolated(|_rank, method: StartMethod| died_in_a_chunk(method), method);
    }
}

fn died_in_a_chunk(method: StartMethod) {
    common::allow_fork_in_helper();
    let mut p = Pool::with_method(2, method).unwrap();
    // Chunks [0, 1, 2], [3, 4, 5], [6, 7]: item 3 kills its worker before 4 and 5 run.
    let results: Vec<_> = p.imap(die_on_three, 0..8u32).chunksize(3).collect();
    for (i, r) in results.iter().enumerate() {
        match (i, r) {
            (3, Err(Error::Process(e))) => {
                assert_eq!(e.failure, Failure::Signaled { signal: 9, name: "SIGKILL".into() }, "{method}");
                assert_eq!(e.task, Some(3), "{method}");
            }
            (4 | 5, Err(Error::Process(e))) => {
                assert_eq!(e.task, Some(i), "{method}");
                match &e.failure {
                    Failure::Lost { reason } => assert!(reason.contains("died running item 3"), "{reason}"),
                    f => panic!("{method}: item {i}: {f:?}"),
                }
            }
            (3..=5, r) => panic!("{method}: item {i}: {r:?}"),
            (_, r) => assert_eq!(r.as_ref().unwrap(), &(i as u32 * 10), "{method}: item {i}"),
        }
    }
    assert_eq!(p.map_chunked(|x: u32| x + 1, 0..10u32, 4).unwrap(), (1..=10u32).collect::<Vec<_>>());
}

#[test]
fn starmap_applies_tuples_as_arguments() {
    let mut p = Pool::new(2).unwrap();
    let items: Vec<(u32, String)> = (0..6).map(|i| (i, format!("n{i}"))).collect();
    let got = p.starmap(|a: u32, b: String| format!("{b}={a}"), items).unwrap();
    assert_eq!(got, (0..6).map(|i| format!("n{i}={i}")).collect::<Vec<_>>());
    let sums: Vec<u64> = p
        .istarmap(|a: u64, b: u64, c: u64| a + b + c, (0..20u64).map(|i| (i, i, 1)))
        .chunksize(3)
        .map(|r| r.unwrap())
        .collect();
    assert_eq!(sums, (0..20u64).map(|i| 2 * i + 1).collect::<Vec<_>>());
    assert_eq!(p.starmap(|a: i8| -a, vec![(1,), (2,)]).unwrap(), vec![-1, -2]);
}

fn hundred_times_once_told((x, told): (u32, Queue<()>)) -> u32 {
    told.get().unwrap();
    x * 100
}

#[test]
fn apply_async_results_in_flight_with_a_map_are_not_confused() {
    let mut p = Pool::new(2).unwrap();
    let told: Queue<()> = Queue::new().unwrap();
    // `held` occupies one worker until told; `quick` and the map share the other one.
    let mut held: AsyncResult<u32> = p.apply_async(hundred_times_once_told, (7u32, told.clone())).unwrap();
    let quick: AsyncResult<u32> = p.apply_async(|x: u32| x + 1, 5u32).unwrap();
    assert_eq!(p.map(|x: u32| x * 2, 0..20u32).unwrap(), (0..20u32).map(|x| x * 2).collect::<Vec<_>>());
    assert!(!held.ready(), "held waits for its queue");
    assert_eq!(quick.get().unwrap(), 6);
    told.put(()).unwrap();
    held.wait();
    assert!(held.ready());
    assert_eq!(held.get().unwrap(), 700);
    let failing = p.apply_async(panic_on_twelve, 12u32).unwrap();
    match failing.get() {
        Err(Error::Process(e)) => assert!(matches!(e.failure, Failure::Task { index: 0, .. }), "{e:?}"),
        r => panic!("{r:?}"),
    }
}

#[test]
fn get_timeout_times_out_on_a_task_that_waits_on_a_queue() {
    let p = Pool::new(1).unwrap();
    let told: Queue<()> = Queue::new().unwrap();
    let mut r = p.apply_async(hundred_times_once_told, (3u32, told.clone())).unwrap();
    assert!(matches!(r.get_timeout(Duration::from_millis(50)), Err(Error::Timeout)));
    assert!(!r.wait_timeout(Duration::from_millis(1)));
    told.put(()).unwrap();
    assert_eq!(r.get_timeout(Duration::from_secs(60)).unwrap(), 300);
    assert!(r.get_timeout(Duration::from_secs(1)).is_err(), "the value is given once");
}

fn tag_from_init(_: u8) -> String {
    std::env::var("POOL_TAG").unwrap()
}

fn die_now(_: u8) -> String {
    rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL).unwrap();
    unreachable!()
}

#[test]
fn an_initializer_with_arguments_runs_in_every_worker_and_in_a_replacement() {
    for method in [StartMethod::Spawn, StartMethod::Fork] {
        common::isolated(|_rank, method: StartMethod| initializer_with_args(method), method);
    }
}

fn initializer_with_args(method: StartMethod) {
    common::allow_fork_in_helper();
    let mut p = Pool::builder(2)
        .method(method)
        .initializer(
            |rank, (tag, n): (String, u32)| std::env::set_var("POOL_TAG", format!("{tag}{n}/{rank}")),
            ("seen".to_string(), 7u32),
        )
        .build()
        .unwrap();
    // Two items on two idle workers: each worker gets one.
    let mut tags = p.map(tag_from_init, [0u8, 0]).unwrap();
    tags.sort();
    assert_eq!(tags, ["seen7/0", "seen7/1"], "{method}");
    let before = p.pids();
    assert!(p.map(die_now, [0u8]).is_err());
    let after = p.pids();
    assert_ne!(before[0], after[0], "{method}: worker 0 was replaced");
    let mut tags = p.map(tag_from_init, [0u8, 0]).unwrap();
    tags.sort();
    assert_eq!(tags, ["seen7/0", "seen7/1"], "{method}: the replacement ran the initializer");
}

#[test]
fn a_worker_killed_while_idle_is_replaced_before_it_is_given_work() {
    for method in [StartMethod::Spawn, StartMethod::Fork, StartMethod::ForkServer] {
        common::isolated(|_rank, method: StartMethod| killed_while_idle(method), method);
    }
}

/// Kills `pid` and waits, through a pidfd, until it is dead.
fn kill_and_wait(pid: i32) {
    let pid = rustix::process::Pid::from_raw(pid).unwrap();
    let fd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).unwrap();
    rustix::process::pidfd_send_signal(&fd, rustix::process::Signal::KILL).unwrap();
    let mut poll = [rustix::event::PollFd::new(&fd, rustix::event::PollFlags::IN)];
    rustix::event::poll(&mut poll, None).unwrap();
}

fn killed_while_idle(method: StartMethod) {
    common::allow_fork_in_helper();
    let mut p = Pool::with_method(2, method).unwrap();
    assert_eq!(p.map(|x: u32| x * 2, 0..4u32).unwrap(), vec![0, 2, 4, 6], "{method}");
    // Both workers are idle now; one dies (the OOM killer, an operator) between tasks.
    let before = p.pids();
    kill_and_wait(before[0]);
    // Nothing was running on it, so nothing fails: every later task runs, on the survivor
    // and on the dead worker's replacement.
    assert_eq!(p.map(|x: u32| x + 1, 0..8u32).unwrap(), (1..9).collect::<Vec<u32>>(), "{method}");
    let after = p.pids();
    assert_eq!(after.len(), 2, "{method}");
    assert!(!after.contains(&before[0]) && after.contains(&before[1]), "{method}: {before:?} -> {after:?}");
    // apply_async too, after the other one dies the same way.
    kill_and_wait(after[1]);
    assert_eq!(p.apply_async(|x: u32| x * 3, 5u32).unwrap().get().unwrap(), 15, "{method}");
    assert!(!p.pids().contains(&after[1]), "{method}");
}
