//! A queue's lane between real processes: small messages go through it, and every promise
//! of the socket path holds there too: holds that outlive a killed producer, each
//! producer's order across the lane and the socket, and `poll_fd`.

#![allow(clippy::type_complexity)] // queues of tuples, spelled out in each test

use std::os::fd::BorrowedFd;
use std::time::Duration;

use tensorshare::{raw, spawn, Connection, DType, Queue, Tensor};

tensorshare::enable_test_workers!();

mod common;
use common::hand_out_everything_else;

fn relay_then_wait(_rank: usize, (from, q, done): (Connection<Vec<Tensor>>, Queue<Vec<Tensor>>, Queue<()>)) {
    let got = from.recv().unwrap();
    q.put(got).unwrap();
    done.put(()).unwrap();
    loop {
        std::thread::park();
    }
}

/// A relay passes tensors it got through a pipe on through a lane and is SIGKILLed: the
/// pipe's message, its own locks and its send description die with it; the creator, with
/// no handle left, still never hands the slots out again while the message waits in the
/// lane, and the reader gets what was written.
#[test]
fn a_lane_message_stays_held_after_its_producer_is_killed() {
    let (to, from) = tensorshare::pipe::<Vec<Tensor>>().unwrap();
    let q: Queue<Vec<Tensor>> = Queue::new().unwrap();
    let done: Queue<()> = Queue::new().unwrap();
    let mut ctx = spawn(relay_then_wait, (from, q.clone(), done.clone()), 1).unwrap();
    let ts: Vec<Tensor> = (0..8)
        .map(|i| {
            let mut t = Tensor::empty_shared(&[1024], DType::F32).unwrap();
            t.fill(i as f32).unwrap();
            t
        })
        .collect();
    let first: Vec<usize> = ts.iter().map(|t| t.storage().data_ptr()).collect();
    to.send(ts).unwrap();
    done.get().unwrap();
    assert_eq!(raw::lane_claimed(&q), 1, "the relay went through the lane");
    let pid = rustix::process::Pid::from_raw(ctx.pids()[0]).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).unwrap();
    assert_eq!(ctx.join(None).unwrap_err().signal_name(), Some("SIGKILL"));
    drop(to);
    let others = hand_out_everything_else();
    let reused = others.iter().filter(|t| first.contains(&t.storage().data_ptr())).count();
    let got = q.get().unwrap();
    assert_eq!(reused, 0, "slots of the message in the lane were handed out again");
    for (i, t) in got.iter().enumerate() {
        assert!(t.to_vec::<f32>().unwrap().iter().all(|v| *v == i as f32), "slot of tensor {i} was reused");
    }
    drop(others);
}

/// What one message carries: (producer, index, padding, a queue).
type Mixed = (u32, u32, Vec<u8>, Option<Queue<u8>>);

fn produce_mixed(rank: usize, (q, inner): (Queue<Mixed>, Queue<u8>)) {
    for i in 0..300u32 {
        // The first 100 small: the lane, until it is full, then the socket. Then every 7th
        // too large for a cell and every 11th carrying descriptors: the socket; the rest
        // small: the lane whenever this producer has nothing left in the socket.
        let pad = if i >= 100 && i % 7 == 0 { vec![1u8; 6000] } else { Vec::new() };
        let queue = (i >= 100 && i % 11 == 0).then(|| inner.clone());
        q.put((rank as u32, i, pad, queue)).unwrap();
    }
}

/// Two producer processes put 300 values each into an unbounded queue before anyone reads,
/// mixing values for the lane and for the socket; the lane fills and overflows into the
/// socket. The reader gets every value once, and each producer's in the order it put them.
#[test]
fn each_producers_values_keep_their_order_across_lane_and_socket() {
    let q: Queue<Mixed> = Queue::new().unwrap();
    let inner: Queue<u8> = Queue::new().unwrap();
    let mut ctx = spawn(produce_mixed, (q.clone(), inner.clone()), 2).unwrap();
    let mut next = [0u32; 2];
    for _ in 0..600 {
        let (rank, i, pad, queue) = q.get_timeout(Duration::from_secs(60)).unwrap();
        assert_eq!(i, next[rank as usize], "producer {rank}'s values out of order");
        next[rank as usize] += 1;
        assert_eq!(pad.len(), if i >= 100 && i % 7 == 0 { 6000 } else { 0 });
        assert_eq!(queue.is_some(), i >= 100 && i % 11 == 0);
    }
    assert_eq!(ctx.join(None), Ok(true));
    assert_eq!(next, [300, 300]);
    assert!(raw::lane_claimed(&q) >= 64, "the lane carried values");
    // Alone now: nothing more (and nothing twice) can come.
    assert!(matches!(q.try_get(), Err(tensorshare::Error::Disconnected)));
}

fn put_large_then_small(_rank: usize, q: Queue<Vec<u64>>) {
    // Larger than a cell: the socket. Then one the lane could take, were the socket empty.
    q.put(vec![1; 10_000]).unwrap();
    q.put(vec![2]).unwrap();
}

/// Values put one after the other by different processes, the second put once the first
/// producer is gone, arrive in that order, whichever way each went: a process's small value
/// does not go through the lane past a record another process left in the socket. (The
/// pattern "join the producers, then put one end marker per consumer": consumers took the
/// markers from the lane and left values behind in the socket.)
#[test]
fn a_value_put_after_a_producer_exited_comes_after_its_values() {
    let q: Queue<Vec<u64>> = Queue::new().unwrap();
    let mut ctx = spawn(put_large_then_small, q.clone(), 1).unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    q.put(vec![3]).unwrap();
    let got: Vec<u64> = (0..3).map(|_| q.get().unwrap()[0]).collect();
    assert_eq!(got, [1, 2, 3], "values out of the order they were put in");
}

fn readable(fd: BorrowedFd<'_>) -> bool {
    let mut pfd = [rustix::event::PollFd::from_borrowed_fd(fd, rustix::event::PollFlags::IN)];
    let limit = rustix::event::Timespec { tv_sec: 30, tv_nsec: 0 };
    rustix::event::poll(&mut pfd, Some(&limit)).unwrap() > 0
}

fn put_three(_rank: usize, (q, from): (Queue<u32>, u32)) {
    for i in from..from + 3 {
        q.put(i).unwrap();
    }
}

/// `poll_fd` becomes readable for values put into the lane before it was asked for (they
/// are nudged) and for values put after (they then go through the socket).
#[test]
fn poll_fd_wakes_for_values_in_the_lane_and_after() {
    let q: Queue<u32> = Queue::new().unwrap();
    let mut ctx = spawn(put_three, (q.clone(), 0), 1).unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    assert_eq!(raw::lane_claimed(&q), 3, "the values went through the lane");
    let mut got = Vec::new();
    for from in [0, 3] {
        if from == 3 {
            ctx = spawn(put_three, (q.clone(), 3), 1).unwrap();
        }
        while got.len() < from as usize + 3 {
            assert!(readable(q.poll_fd()), "no wake-up for a waiting value");
            // The producer may be gone: then the queue says so once it is empty.
            while let Ok(Some(v)) = q.try_get() {
                got.push(v);
            }
        }
    }
    assert_eq!(ctx.join(None), Ok(true));
    assert_eq!(got, vec![0, 1, 2, 3, 4, 5]);
}

/// `has_ready` tells whether a value waits without taking one: values a child put are
/// still there for `try_get` after it looked. Once a process waits on `poll_fd`, a record
/// left in the socket may be a nudge with no value behind it: it says it cannot tell
/// rather than promise a value, until a `try_get` has taken the nudge.
#[test]
fn has_ready_tells_whether_a_value_waits_without_taking_it() {
    let q: Queue<u32> = Queue::new().unwrap();
    assert_eq!(q.has_ready(), Some(false));
    let mut ctx = spawn(put_three, (q.clone(), 0), 1).unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    for _ in 0..3 {
        assert_eq!(q.has_ready(), Some(true));
    }
    assert_eq!(q.try_get().unwrap(), Some(0), "looking took nothing");
    assert!(readable(q.poll_fd()), "the two values left are nudged");
    assert_eq!(q.has_ready(), Some(true), "values wait in the lane");
    assert_eq!((q.try_get().unwrap(), q.try_get().unwrap()), (Some(1), Some(2)));
    assert_ne!(q.has_ready(), Some(true), "a nudge alone is no value");
    // No value (the producer is gone, so the queue may say it is disconnected): the nudge
    // is taken.
    assert!(!matches!(q.try_get(), Ok(Some(_))));
    assert_eq!(q.has_ready(), Some(false), "the nudge was taken");
}

fn keep_the_first(_rank: usize, (q, back, go): (Queue<Vec<Tensor>>, Queue<u64>, Queue<()>)) {
    let mut got = q.get().unwrap();
    let (flag, kept) = (got.pop().unwrap(), got.pop().unwrap());
    assert!(raw::borrowed(kept.storage()), "the slot is held through the parked description");
    back.put(0).unwrap();
    // Neither receiving nor waiting (either would settle the borrowed holds into locks of
    // this process's own): polling the shared flag the creator raises once it is done.
    let since = std::time::Instant::now();
    while flag.to_vec::<f32>().unwrap()[0] != 1.0 {
        assert!(since.elapsed() < Duration::from_secs(60), "the flag never came");
        std::hint::spin_loop();
    }
    assert!(kept.to_vec::<f32>().unwrap().iter().all(|v| *v == 1.0), "the slot kept was reused");
    drop((kept, flag));
    back.put(1).unwrap();
    for i in 2..102u64 {
        drop(q.get().unwrap());
        back.put(i).unwrap();
    }
    // What the lane lent this process is given back: its window, and the descriptions it
    // borrowed from the directory.
    tensorshare::trim_arenas();
    back.put(u64::MAX).unwrap();
    go.get().unwrap();
}

/// A receiver borrows the holds of the send description a lane message names (parked in
/// the queue's directory) instead of locking the slots: while it keeps a tensor, neither
/// receiving nor waiting, its slot is never handed out again by the creator, although the
/// lane's windows have moved on and the directory has let the description go; once it has
/// dropped it, taken a hundred more and trimmed, every slot comes back to the creator
/// (which received its own messages meanwhile, borrowing nothing).
#[test]
fn lane_slots_stay_held_while_kept_and_all_come_back_after() {
    // Alone in a process of its own: other tests' tensors would take slots from the same
    // arenas.
    common::isolated(lane_slots_body, tensorshare::StartMethod::Spawn);
}

fn lane_slots_body(_rank: usize, _method: tensorshare::StartMethod) {
    let q: Queue<Vec<Tensor>> = Queue::new().unwrap();
    let (back, go) = (Queue::<u64>::new().unwrap(), Queue::<()>::new().unwrap());
    let mut ctx = spawn(keep_the_first, (q.clone(), back.clone(), go.clone()), 1).unwrap();
    let fresh = |v: f32| {
        let mut t = Tensor::empty_shared(&[1024], DType::F32).unwrap();
        t.fill(v).unwrap();
        t
    };
    let flag = fresh(0.0);
    let kept = fresh(1.0);
    let mut sent = vec![kept.storage().data_ptr()];
    q.put(vec![kept, flag.clone()]).unwrap();
    assert_eq!(raw::lane_claimed(&q), 1, "the first message went through the lane");
    assert_eq!(back.get().unwrap(), 0);
    // Windows go by: this process takes its own messages, borrowing nothing.
    for _ in 0..200 {
        let t = fresh(2.0);
        sent.push(t.storage().data_ptr());
        q.put(vec![t]).unwrap();
        let got = q.get().unwrap();
        assert!(!raw::borrowed(got[0].storage()), "a creator borrowed a hold of its own slot");
    }
    let others = hand_out_everything_else();
    assert!(others.iter().all(|t| t.storage().data_ptr() != sent[0]), "the kept slot was handed out");
    drop(others);
    flag.clone().fill(1.0f32).unwrap();
    assert_eq!(back.get().unwrap(), 1);
    // The receiver takes a hundred more, borrowing as it goes, and lets them go.
    for i in 2..102u64 {
        let t = fresh(3.0);
        sent.push(t.storage().data_ptr());
        q.put(vec![t]).unwrap();
        assert_eq!(back.get().unwrap(), i);
    }
    assert_eq!(back.get().unwrap(), u64::MAX);
    // More than the arenas hold, so that every free slot is among them.
    let again: Vec<Tensor> = (0..4).flat_map(|_| hand_out_everything_else()).collect();
    let back_again = sent.iter().filter(|a| again.iter().any(|t| t.storage().data_ptr() == **a)).count();
    drop(again);
    go.put(()).unwrap();
    ctx.join(None).unwrap();
    assert_eq!(back_again, sent.len(), "slots the receiver let go of were not given back");
}
