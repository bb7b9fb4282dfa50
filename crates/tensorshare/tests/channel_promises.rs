//! Promises of queues and sharing that users rely on, between real processes: a queue in
//! flight is held, `try_put` on room is no timeout, a sent tensor is shared in place.

use std::time::Duration;

use tensorshare::{spawn, DType, Error, Queue, Tensor};

tensorshare::enable_test_workers!();

mod common;

/// A put or a send that fails gives the value back: a tensor that could not be sent is not
/// lost. A queue whose consumers are all gone answers `Disconnected` once it is full.
#[test]
fn a_failed_put_or_send_gives_the_value_back() {
    let q: Queue<Tensor> = Queue::with_capacity(1).unwrap();
    let consumer = q.clone(); // someone who could make room, so waiting is a timeout
    q.put(Tensor::full(&[4], 1.0f32)).unwrap();
    let e = q.put_timeout(Tensor::full(&[4], 7.0f32), Duration::from_millis(10)).unwrap_err();
    assert!(e.is_timeout(), "{e}");
    assert_eq!(e.into_inner().to_vec::<f32>().unwrap(), vec![7.0; 4]);
    drop(consumer);
    let e = q.put_timeout(Tensor::full(&[4], 8.0f32), Duration::from_millis(10)).unwrap_err();
    assert!(e.is_disconnected(), "full, and no other handle to take from it: {e}");
    assert_eq!(e.into_inner().to_vec::<f32>().unwrap(), vec![8.0; 4]);
    let (a, b) = tensorshare::pipe::<Tensor>().unwrap();
    drop(b);
    let e = a.send(Tensor::full(&[2], 3.0f32)).unwrap_err();
    assert!(e.is_disconnected(), "{e}");
    let (v, err) = e.into_parts();
    assert_eq!(v.to_vec::<f32>().unwrap(), vec![3.0; 2]);
    assert!(matches!(err, Error::Disconnected));
}

/// A queue travelling inside a message counts as held: the parent drops every handle but
/// its own and waits in `get` while the worker's arguments (a 64 MiB tensor and the queue)
/// are still on their way; the worker's value arrives instead of `Disconnected`.
#[test]
fn a_queue_in_flight_is_held() {
    for _ in 0..5 {
        let q: Queue<u32> = Queue::new().unwrap();
        let blob = Tensor::zeros(&[64 << 20], DType::U8);
        let mut ctx =
            spawn(|_rank, (_blob, q): (Tensor, Queue<u32>)| q.put(7).unwrap(), (blob, q.clone()), 1).unwrap();
        assert_eq!(q.get().unwrap(), 7);
        assert_eq!(ctx.join(None), Ok(true));
    }
}

/// `try_put` and `put_timeout(v, 0)` succeed whenever there is room, the unbounded queue
/// always having some.
#[test]
fn try_put_on_a_queue_with_room_is_no_timeout() {
    let q: Queue<u32> = Queue::new().unwrap();
    q.try_put(1).unwrap();
    q.put_timeout(2, Duration::ZERO).unwrap();
    let b: Queue<u32> = Queue::with_capacity(1).unwrap();
    b.try_put(3).unwrap();
    assert_eq!(b.try_put(4).unwrap_err().into_inner(), 4, "a full queue gives the value back");
    assert_eq!((q.get().unwrap(), q.get().unwrap(), b.get().unwrap()), (1, 2, 3));
}

/// Hogwild code that forgets `share_memory()`: the sent tensor becomes shared in place, so
/// the worker's writes reach the parent's tensor and its views.
#[test]
fn a_private_tensor_sent_to_a_worker_is_shared_in_place() {
    let weights = Tensor::zeros(&[8], DType::F32);
    let view = weights.narrow(0, 4, 4).unwrap();
    assert!(!weights.is_shared());
    let mut ctx = spawn(
        |_rank, mut w: Tensor| {
            w.fill(4.0f32).unwrap();
        },
        weights.clone(),
        1,
    )
    .unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    assert!(weights.is_shared());
    assert_eq!(weights.to_vec::<f32>().unwrap(), vec![4.0; 8]);
    assert_eq!(view.to_vec::<f32>().unwrap(), vec![4.0; 4]);
}

/// "Fill the task queue, then start the workers": `put` on an unbounded queue never waits,
/// with no consumer in existence, for a million small messages; a worker started afterwards
/// gets every one of them, in order.
#[test]
fn put_on_an_unbounded_queue_never_waits_for_a_consumer() {
    const N: u64 = 1_000_000;
    let q: Queue<u64> = Queue::new().unwrap();
    for i in 0..N {
        q.put(i).unwrap();
    }
    let (done, wait) = tensorshare::pipe::<u64>().unwrap();
    let mut ctx = spawn(
        |_rank, (q, done): (Queue<u64>, tensorshare::Connection<u64>)| {
            for i in 0..N {
                assert_eq!(q.get().unwrap(), i, "in order");
            }
            done.send(N).unwrap();
        },
        (q.clone(), done),
        1,
    )
    .unwrap();
    assert_eq!(wait.recv().unwrap(), N);
    assert_eq!(ctx.join(None), Ok(true));
}

/// The same with ten thousand messages that each carry a 1 MiB shared tensor (one storage,
/// so the test does not need ten gigabytes): the tensors arrive whole.
#[test]
fn put_never_waits_for_messages_carrying_tensors_either() {
    const N: usize = 10_000;
    let q: Queue<(usize, Tensor)> = Queue::new().unwrap();
    let mut t = Tensor::empty_shared(&[1 << 18], DType::F32).unwrap();
    t.fill(2.0f32).unwrap();
    for i in 0..N {
        q.put((i, t.clone())).unwrap();
    }
    let sums: Queue<f64> = Queue::new().unwrap();
    let mut ctx = spawn(
        |_rank, (q, sums): (Queue<(usize, Tensor)>, Queue<f64>)| {
            let mut total = 0.0;
            for i in 0..N {
                let (j, t) = q.get().unwrap();
                assert_eq!(j, i);
                if i % 1000 == 0 {
                    total += t.to_vec::<f32>().unwrap().iter().map(|v| *v as f64).sum::<f64>();
                }
            }
            sums.put(total).unwrap();
        },
        (q.clone(), sums.clone()),
        1,
    )
    .unwrap();
    assert_eq!(sums.get().unwrap(), 10.0 * 2.0 * (1 << 18) as f64);
    assert_eq!(ctx.join(None), Ok(true));
}

/// Dropping a large tensor gives its memory back: one over the retention bound goes at
/// once, descriptor and all; one within it is kept warm for the next tensor of its size.
/// (In a helper process, so that the descriptor count is this test's alone.)
#[test]
fn a_dropped_large_tensor_gives_its_memory_back() {
    common::isolated_with(
        |_rank, ()| {
            let fds = || std::fs::read_dir("/proc/self/fd").unwrap().count();
            let before = fds();
            let big = Tensor::empty_shared(&[300 << 20], DType::U8).unwrap();
            assert_eq!(fds(), before + 1, "one arena, one descriptor");
            drop(big);
            assert_eq!(fds(), before, "the freed 300 MiB arena was kept");
            let warm = Tensor::empty_shared(&[64 << 20], DType::U8).unwrap();
            let p = warm.storage().data_ptr();
            drop(warm);
            let again = Tensor::empty_shared(&[64 << 20], DType::U8).unwrap();
            assert_eq!(again.storage().data_ptr(), p, "kept warm and reused");
        },
        (),
    );
}

/// A receive that fails at the descriptor limit (the record's descriptors cut off) still
/// frees the record's place in a bounded queue: the producer can put again.
#[test]
fn a_receive_that_fails_at_the_descriptor_limit_frees_its_place() {
    let q: Queue<Tensor> = Queue::with_capacity(1).unwrap();
    let (go, wait) = tensorshare::pipe::<String>().unwrap();
    let mut ctx = spawn(
        |_rank, (q, wait): (Queue<Tensor>, tensorshare::Connection<String>)| {
            // The record is in the queue before the limit drops (a wait would poll, which a
            // limit of 0 refuses too).
            assert_eq!(wait.recv().unwrap(), "put");
            // No new descriptor at all (the limit bounds descriptor numbers); those open
            // already keep working.
            let tight = rustix::process::Rlimit { current: Some(0), maximum: None };
            let before = rustix::process::getrlimit(rustix::process::Resource::Nofile);
            rustix::process::setrlimit(
                rustix::process::Resource::Nofile,
                rustix::process::Rlimit { maximum: before.maximum, ..tight },
            )
            .unwrap();
            let failed = q.get().unwrap_err().to_string();
            rustix::process::setrlimit(rustix::process::Resource::Nofile, before).unwrap();
            wait.send(failed).unwrap();
            let t = q.get().unwrap();
            wait.send(format!("{:?}", t.to_vec::<f32>().unwrap())).unwrap();
        },
        (q.clone(), wait),
        1,
    )
    .unwrap();
    q.put(Tensor::full(&[4], 1.0f32)).unwrap();
    go.send("put".into()).unwrap();
    let failed = go.recv().unwrap();
    assert!(failed.contains("descriptor limit"), "{failed}");
    // Its place is free again: a second put fits at once.
    q.put_timeout(Tensor::full(&[4], 2.0f32), Duration::from_millis(20)).unwrap();
    assert_eq!(go.recv().unwrap(), "[2.0, 2.0, 2.0, 2.0]");
    assert_eq!(ctx.join(None), Ok(true));
}

/// A receiver that keeps what it receives reaches its descriptor limit: each 5 MiB tensor
/// comes in an arena of its own, which it holds through a descriptor of its own. The
/// receive that meets the limit while it finishes a message it took draws on the
/// descriptors kept in reserve; those after it fail with the limit's error before taking a
/// message, until the receiver lets go of tensors. Every value arrives, each once.
#[test]
fn a_receiver_at_its_descriptor_limit_loses_no_value() {
    /// What the receiver got, and the errors of the receives it was refused.
    type Report = (Vec<u32>, Vec<String>);
    const N: usize = 40;
    let q: Queue<Tensor> = Queue::with_capacity(4).unwrap();
    let (report, reports) = tensorshare::pipe::<Report>().unwrap();
    let mut ctx = spawn(
        |_rank, (q, report): (Queue<Tensor>, tensorshare::Connection<Report>)| {
            let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
            let before = rustix::process::getrlimit(rustix::process::Resource::Nofile);
            let limit = rustix::process::Rlimit { current: Some(open + 24), maximum: before.maximum };
            rustix::process::setrlimit(rustix::process::Resource::Nofile, limit).unwrap();
            let (mut kept, mut got, mut refusals) = (Vec::new(), Vec::new(), Vec::new());
            while got.len() < N {
                match q.get_timeout(Duration::from_secs(30)) {
                    Ok(t) => {
                        got.push(t.to_vec::<f32>().unwrap()[0] as u32);
                        kept.push(t);
                    }
                    Err(e) => {
                        // A value lost would leave this waiting for it.
                        assert!(
                            !matches!(e, tensorshare::Error::Timeout),
                            "got {got:?}; refused: {refusals:?}"
                        );
                        refusals.push(e.to_string());
                        assert!(refusals.len() < 100, "refused again and again: {e}");
                        kept.drain(..kept.len() / 2);
                    }
                }
            }
            drop(kept);
            rustix::process::setrlimit(rustix::process::Resource::Nofile, before).unwrap();
            report.send((got, refusals)).unwrap();
        },
        (q.clone(), report),
        1,
    )
    .unwrap();
    for i in 0..N {
        q.put(Tensor::full(&[(5 << 20) / 4], i as f32)).unwrap();
    }
    let (mut got, refusals) = reports.recv().unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    assert!(!refusals.is_empty(), "the limit was never met");
    assert!(refusals.iter().all(|r| r.contains("RLIMIT_NOFILE")), "{refusals:?}");
    got.sort_unstable();
    assert_eq!(got, (0..N as u32).collect::<Vec<_>>(), "refused: {refusals:?}");
}

/// `len` (Python's `qsize`) counts what every process put and took: the parent puts 3, a
/// worker takes 1 and puts 2 more, on a bounded and on an unbounded queue; with more small
/// values than the socket holds, those still on their way out of this process count too.
/// Exact here, since nothing else uses the queue while it is asked.
#[test]
fn len_counts_what_every_process_put_and_took() {
    for q in [Queue::<u32>::with_capacity(10).unwrap(), Queue::<u32>::new().unwrap()] {
        assert_eq!((q.len(), q.is_empty()), (0, true));
        for i in 0..3 {
            q.put(i).unwrap();
        }
        assert_eq!((q.len(), q.is_empty()), (3, false));
        let worker = |_rank, q: Queue<u32>| {
            let first = q.get().unwrap();
            q.put(first + 10).unwrap();
            q.put(first + 20).unwrap();
        };
        let mut ctx = spawn(worker, q.clone(), 1).unwrap();
        assert_eq!(ctx.join(None), Ok(true));
        assert_eq!(q.len(), 4);
        let mut got: Vec<u32> = (0..4).map(|_| q.get().unwrap()).collect();
        got.sort();
        assert_eq!(got, vec![1, 2, 10, 20]);
        assert_eq!((q.len(), q.is_empty()), (0, true));
        if q.capacity() == Some(10) {
            for i in 0..10 {
                assert!(!q.is_full());
                q.put(i).unwrap();
            }
            assert!(q.is_full() && q.len() == 10);
            q.get().unwrap();
            assert!(!q.is_full());
        } else {
            assert_eq!(q.capacity(), None);
            assert!(!q.is_full());
        }
    }
    let q: Queue<u64> = Queue::new().unwrap();
    for i in 0..5000 {
        q.put(i).unwrap();
    }
    assert_eq!(q.len(), 5000);
    for i in 0..5000 {
        assert_eq!(q.get().unwrap(), i);
    }
    assert_eq!(q.len(), 0);
}

/// A bounded queue keeps its capacity when producers die between taking a place and
/// writing their record, also while it still has free places (no producer then waits and
/// finds the loss): a consumer that waits on the drained queue gives the lost ones back.
#[test]
fn places_lost_by_producers_killed_mid_put_come_back_while_others_are_free() {
    let q: Queue<u32> = Queue::with_capacity(4).unwrap();
    // Two producers that each die holding a place they took.
    let mut ctx =
        spawn(|_rank: usize, q: Queue<u32>| assert!(tensorshare::raw::lose_a_place(&q)), q.clone(), 2)
            .unwrap();
    ctx.join(None).unwrap();
    // Another handle here: the queue could still get a value, so the wait lasts.
    let _producer = q.clone();
    assert!(matches!(q.get_timeout(Duration::from_millis(2500)), Err(Error::Timeout)));
    for i in 0..4 {
        q.try_put(i).unwrap_or_else(|e| panic!("place {i} of 4 was lost: {e}"));
    }
    assert!(q.try_put(4).is_err(), "the queue admitted more than its capacity");
    assert_eq!((0..4).map(|_| q.get().unwrap()).collect::<Vec<_>>(), [0, 1, 2, 3]);
}

/// A count left one too high heals the next time the queue is seen empty, so that `while
/// q.len() > 0` cannot spin for ever. A worker reads one record straight off the queue's
/// socket, as a consumer killed between taking a record and counting it leaves things.
/// (Values larger than a lane's cell, so that they travel through the socket.)
#[test]
fn a_count_left_too_high_heals_when_the_queue_is_seen_empty() {
    let q: Queue<Vec<u8>> = Queue::new().unwrap();
    q.put(vec![1; 5000]).unwrap();
    q.put(vec![2; 5000]).unwrap();
    let worker = |_rank, q: Queue<Vec<u8>>| {
        let mut buf = [0u8; 256];
        let fd = std::os::fd::AsRawFd::as_raw_fd(&q.poll_fd());
        // SAFETY: a valid descriptor and a buffer of the length given, live across the call.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        assert!(n > 0, "a record was waiting");
    };
    let mut ctx = spawn(worker, q.clone(), 1).unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    assert_eq!(q.len(), 2, "the count does not know the record went");
    assert_eq!(q.get().unwrap(), vec![2; 5000]);
    assert_eq!((q.len(), q.is_empty()), (0, true), "seen empty: the count starts again");
    q.put(vec![3]).unwrap();
    assert_eq!(q.len(), 1);
}

/// A put that holds the only place of a bounded queue while it writes a large message out
/// (a spill into a memfd takes a while) must not look like a place lost to a dead process:
/// a second producer keeps waiting instead of being let in over the capacity.
#[test]
fn a_put_writing_a_large_message_holds_its_place_without_losing_it() {
    // Large enough that its spill takes well over the two 50 ms slices after which a
    // waiting producer gives back places it thinks lost.
    const BIG: usize = 256 << 20;
    let q: Queue<String> = Queue::with_capacity(1).unwrap();
    let consumer = q.clone(); // someone who could make room, so waiting is a timeout
    let mut ctx = spawn(
        |_rank, q: Queue<String>| {
            q.put("b".repeat(BIG)).unwrap();
        },
        q.clone(),
        1,
    )
    .unwrap();
    // The worker's put has its place once the queue reads full (or the worker failed).
    while !q.is_full() {
        assert_eq!(ctx.join(Some(Duration::ZERO)), Ok(false), "the worker ended before its put");
        std::hint::spin_loop();
    }
    let second = q.put_timeout("small".to_string(), Duration::from_secs(1));
    assert!(second.as_ref().is_err_and(|e| e.is_timeout()), "a second value was let in: {second:?}");
    assert_eq!(ctx.join(None), Ok(true));
    assert_eq!(consumer.get().unwrap().len(), BIG);
    assert_eq!(consumer.try_get().unwrap(), None, "the queue of capacity 1 held a second value");
}
