//! Pool: torch's test_fd_pool / test_fs_pool, and what its users need beyond them.

use tensorshare::process::Pool;
use tensorshare::{DType, Error, Failure, Queue, SharingStrategy, StartMethod, Tensor};

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
                        assert_eq!(e.failure, Failure::Signaled { signal: 9, name: "SIGKILL".into() })
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
