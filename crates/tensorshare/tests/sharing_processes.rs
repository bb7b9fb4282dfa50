//! Ports of torch's sharing tests from test/test_multiprocessing.py, between real
//! processes, each under both strategies; and what torch cannot do.

#![allow(clippy::type_complexity)] // queues of tuples, spelled out in each test

use tensorshare::{
    raw, spawn, DType, Error, Queue, SharingStrategy, SimpleQueue, Storage, Tensor, TensorKind,
};

tensorshare::enable_test_workers!();

#[macro_use]
mod common;
use common::hand_out_everything_else;

/// One test per strategy from one body, each in a helper process of its own under the
/// leak checker (no segment file left, no descriptor leaked).
macro_rules! each_strategy {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                use tensorshare::SharingStrategy;
                #[test]
                fn file_descriptor() {
                    $crate::checked!(super::$name, SharingStrategy::FileDescriptor, SharingStrategy);
                }
                #[test]
                fn file_system() {
                    $crate::checked!(super::$name, SharingStrategy::FileSystem, SharingStrategy);
                }
            }
        )*
    };
}

each_strategy!(
    test_sharing,
    test_preserve_sharing,
    test_empty_tensor_sharing,
    test_tensor_sharing_meta,
    test_empty_tensor_sharing_meta,
    test_variable_sharing,
    test_leaf_variable_sharing,
    test_parameter_sharing,
    test_integer_parameter_serialization,
    test_views_alias_in_the_worker,
    test_geometry_of_every_rank_crosses,
);

fn shared(mut t: Tensor, s: SharingStrategy) -> Tensor {
    t.share_memory_with(s).unwrap();
    t
}

/// torch's _test_sharing (test_fd_sharing, test_fs_sharing): a worker fills a received
/// tensor and its column view with 4; the parent sees it through both. Then a worker sends
/// one shared tensor twice, and the parent's two copies alias. (torch shares the tensor in
/// place on `put`; here sharing is explicit, and a private tensor is sent as a copy.)
fn test_sharing(s: SharingStrategy) {
    let x = shared(Tensor::zeros(&[5, 5], DType::F32), s);
    let data = (x.clone(), x.narrow(1, 1, 1).unwrap());
    let q: Queue<(Tensor, Tensor)> = Queue::new().unwrap();
    q.put(data.clone()).unwrap();
    let mut ctx = spawn(
        |_rank, q: Queue<(Tensor, Tensor)>| {
            let (mut x, mut col) = q.get().unwrap();
            x.fill(4.0f32).unwrap();
            col.fill(4.0f32).unwrap();
        },
        q.clone(),
        1,
    )
    .unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    assert!(data.0.to_vec::<f32>().unwrap().iter().all(|v| *v == 4.0));
    assert!(data.1.to_vec::<f32>().unwrap().iter().all(|v| *v == 4.0));

    // test_receive: one tensor sent twice by the worker.
    let back: Queue<Tensor> = Queue::new().unwrap();
    let mut ctx = spawn(
        |_rank, (q, s): (Queue<Tensor>, SharingStrategy)| {
            let mut t = Tensor::ones(&[5, 5], DType::F32);
            t.share_memory_with(s).unwrap();
            q.put(t.clone()).unwrap();
            q.put(t).unwrap();
        },
        (back.clone(), s),
        1,
    )
    .unwrap();
    let t1 = back.get().unwrap();
    let t2 = back.get().unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    assert!(t1.to_vec::<f32>().unwrap().iter().all(|v| *v == 1.0));
    // Upstream compares s1.data_ptr() with itself; what it means is that both alias.
    assert_eq!(t1.storage().data_ptr(), t2.storage().data_ptr());
    assert!(t1.storage().ptr_eq(t2.storage()));
    assert_eq!(t1.storage().sharing_strategy(), Some(s));
}

/// torch's _test_preserve_sharing: a storage, a tensor on it, a row and a column view go
/// through a queue (here: to a worker and back) and still share one storage.
fn test_preserve_sharing(s: SharingStrategy) {
    let x = shared(Tensor::from_vec((0..25).map(|v| v as f64).collect(), &[5, 5]).unwrap(), s);
    type Data = (Storage, Tensor, Tensor, Tensor);
    let data: Data = (x.storage().clone(), x.clone(), x.select(0, 2).unwrap(), x.narrow(1, 1, 1).unwrap());
    let to: Queue<Data> = Queue::new().unwrap();
    let from: Queue<Data> = Queue::new().unwrap();
    let mut ctx = spawn(
        |_rank, (to, from): (Queue<Data>, Queue<Data>)| {
            let d = to.get().unwrap();
            // In the worker, everything is one storage too.
            assert!(d.1.storage().ptr_eq(&d.0) && d.2.storage().ptr_eq(&d.0) && d.3.storage().ptr_eq(&d.0));
            from.put(d).unwrap();
        },
        (to.clone(), from.clone()),
        1,
    )
    .unwrap();
    to.put(data.clone()).unwrap();
    let back = from.get().unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    assert!(back.1.equal(&data.1) && back.2.equal(&data.2) && back.3.equal(&data.3));
    for t in [&back.1, &back.2, &back.3] {
        assert_eq!(t.storage().data_ptr(), back.0.data_ptr());
    }
    assert!(back.0.ptr_eq(x.storage()), "back in the process that made it: the same storage");
}

/// torch's test_empty_tensor_sharing: empty tensors of two dtypes.
fn test_empty_tensor_sharing(s: SharingStrategy) {
    let v = vec![shared(Tensor::zeros(&[0], DType::F32), s), shared(Tensor::zeros(&[0], DType::I64), s)];
    let r = common::round_trip(v.clone());
    assert!(r[0].equal(&v[0]) && r[1].equal(&v[1]));
    assert!(r[0].is_shared());
}

/// torch's test_tensor_sharing_meta: a meta tensor keeps its shape, dtype and device.
fn test_tensor_sharing_meta(_s: SharingStrategy) {
    let v = vec![Tensor::meta(&[5, 5], DType::F32)];
    let r = common::round_trip(v.clone());
    assert!(r[0].equal(&v[0]));
    assert_eq!(r[0].device(), tensorshare::Device::Meta);
    assert_eq!(r[0].shape(), &[5, 5]);
}

/// torch's test_empty_tensor_sharing_meta.
fn test_empty_tensor_sharing_meta(_s: SharingStrategy) {
    let v = vec![Tensor::meta(&[0], DType::F32), Tensor::meta(&[0], DType::I64)];
    let r = common::round_trip(v.clone());
    assert!(r[0].equal(&v[0]) && r[1].equal(&v[1]));
    assert_eq!(r[1].dtype(), DType::I64);
}

/// torch's test_variable_sharing: requires_grad travels, the worker sees the values and
/// its writes are seen by the parent.
fn test_variable_sharing(s: SharingStrategy) {
    for requires_grad in [true, false] {
        let mut var = shared(Tensor::from_vec((1..=25).map(|v| v as f32).collect(), &[5, 5]).unwrap(), s);
        var.set_requires_grad(requires_grad).unwrap();
        autograd_sharing(var, requires_grad);
    }
}

/// torch's test_leaf_variable_sharing: the same with a leaf (a parameter).
fn test_leaf_variable_sharing(s: SharingStrategy) {
    let var = shared(Tensor::from_vec((1..=25).map(|v| v as f32).collect(), &[5, 5]).unwrap(), s);
    let param = var.into_parameter();
    assert!(param.requires_grad());
    autograd_sharing(param, true);
}

/// torch's _test_autograd_sharing.
fn autograd_sharing(var: Tensor, requires_grad: bool) {
    let q: Queue<Tensor> = Queue::new().unwrap();
    q.put(var.clone()).unwrap();
    let mut ctx = spawn(
        |_rank, (q, requires_grad): (Queue<Tensor>, bool)| {
            let v = q.get().unwrap();
            assert_eq!(v.requires_grad(), requires_grad);
            let expected: Vec<f32> = (1..=25).map(|v| v as f32).collect();
            assert_eq!(v.to_vec::<f32>().unwrap(), expected);
            v.atomic::<f32>().unwrap().store(0, -1.0);
        },
        (q.clone(), requires_grad),
        1,
    )
    .unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    assert_eq!(var.to_vec::<f32>().unwrap()[0], -1.0);
}

/// torch's test_parameter_sharing (with an integer parameter too, as
/// test_integer_parameter_serialization): a parameter stays a parameter.
fn test_parameter_sharing(s: SharingStrategy) {
    let p = shared(Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3]).unwrap(), s).into_parameter();
    let ip = Tensor::from_vec(vec![1i64, 2], &[2]).unwrap().into_parameter();
    assert!(!ip.requires_grad());
    let q: Queue<(Tensor, Tensor)> = Queue::new().unwrap();
    let back: Queue<(Tensor, Tensor)> = Queue::new().unwrap();
    let mut ctx = spawn(
        |_rank, (q, back): (Queue<(Tensor, Tensor)>, Queue<(Tensor, Tensor)>)| {
            let (p, ip) = q.get().unwrap();
            assert_eq!(p.kind(), TensorKind::Parameter);
            assert!(p.requires_grad());
            assert_eq!(ip.kind(), TensorKind::Parameter);
            back.put((p, ip)).unwrap();
        },
        (q.clone(), back.clone()),
        1,
    )
    .unwrap();
    q.put((p.clone(), ip.clone())).unwrap();
    let (rp, rip) = back.get().unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    assert_eq!(rp.kind(), TensorKind::Parameter);
    assert!(rp.requires_grad());
    assert!(rp.storage().ptr_eq(p.storage()));
    assert_eq!(rip.kind(), TensorKind::Parameter);
    assert_eq!(rip.to_vec::<i64>().unwrap(), vec![1, 2]);
}

/// torch's test_integer_parameter_serialization: an integer parameter (which cannot
/// require gradients) travels to a worker, which checks it.
fn test_integer_parameter_serialization(s: SharingStrategy) {
    let ip = shared(Tensor::from_vec(vec![0i64], &[1]).unwrap(), s).into_parameter();
    common::integer_parameter_reaches_a_worker(ip);
}

/// Views made in the worker from a received tensor write the parent's memory.
fn test_views_alias_in_the_worker(s: SharingStrategy) {
    let x = shared(Tensor::zeros(&[4, 4], DType::I32), s);
    let q: Queue<Tensor> = Queue::new().unwrap();
    q.put(x.clone()).unwrap();
    let mut ctx = spawn(
        |_rank, q: Queue<Tensor>| {
            let x = q.get().unwrap();
            let mut d = x.t().unwrap().select(0, 3).unwrap();
            d.fill(9i32).unwrap();
        },
        q.clone(),
        1,
    )
    .unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    let v = x.to_vec::<i32>().unwrap();
    for r in 0..4 {
        assert_eq!(v[r * 4 + 3], 9);
    }
}

/// Shapes and strides of 0 to 7 dimensions (kept inline up to four, beyond on the heap)
/// reach a worker as they were, permuted and offset views included, and still alias.
fn test_geometry_of_every_rank_crosses(s: SharingStrategy) {
    let base = shared(Tensor::zeros(&[2, 3, 2, 2, 3, 2, 2], DType::I16), s);
    let mut scalar = base.clone();
    for _ in 0..7 {
        scalar = scalar.select(0, 1).unwrap(); // a 0-d view, at an offset
    }
    let views: Vec<Tensor> = vec![
        scalar,
        base.select(0, 1).unwrap().select(0, 2).unwrap().select(0, 0).unwrap().reshape(&[24]).unwrap(),
        base.reshape(&[12, 24]).unwrap().t().unwrap(),
        base.reshape(&[6, 4, 3, 4]).unwrap().narrow(2, 1, 2).unwrap(),
        base.reshape(&[2, 3, 4, 3, 4]).unwrap().permute(&[4, 2, 0, 3, 1]).unwrap(),
        base.reshape(&[2, 3, 2, 2, 3, 4]).unwrap().narrow(5, 1, 2).unwrap(),
        base.permute(&[6, 5, 4, 3, 2, 1, 0]).unwrap(),
    ];
    let geometry = |ts: &[Tensor]| -> Vec<(Vec<usize>, Vec<usize>, usize)> {
        ts.iter().map(|t| (t.shape().to_vec(), t.strides().to_vec(), t.storage_offset())).collect()
    };
    let sent = geometry(&views);
    let q: Queue<Vec<Tensor>> = Queue::new().unwrap();
    let back: Queue<Vec<(Vec<usize>, Vec<usize>, usize)>> = Queue::new().unwrap();
    q.put(views.clone()).unwrap();
    let mut ctx = spawn(
        |_rank, (q, back): (Queue<Vec<Tensor>>, Queue<Vec<(Vec<usize>, Vec<usize>, usize)>>)| {
            let got = q.get().unwrap();
            back.put(
                got.iter().map(|t| (t.shape().to_vec(), t.strides().to_vec(), t.storage_offset())).collect(),
            )
            .unwrap();
            // The last view's first element is the base's first; the 6-d view's, its
            // element 1 along the last axis.
            got[6].narrow(0, 0, 1).unwrap().fill(7i16).unwrap();
            got[5].narrow(0, 0, 1).unwrap().narrow(1, 0, 1).unwrap().fill(5i16).unwrap();
        },
        (q.clone(), back.clone()),
        1,
    )
    .unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    assert_eq!(back.get().unwrap(), sent);
    assert_eq!(sent.iter().map(|g| g.0.len()).collect::<Vec<_>>(), [0, 1, 2, 4, 5, 6, 7]);
    let v = base.to_vec::<i16>().unwrap();
    assert_eq!(v[0], 7, "the 7-d view aliases the base");
    assert_eq!(v[1], 5, "the 6-d view aliases the base");
}

/// torch's file_descriptor strategy needs the sender alive until the receiver has the fd
/// (pytorch#65418). Here the message carries it: the worker sends and exits, and the
/// parent reads afterwards.
#[test]
fn a_sender_that_exits_before_the_receiver_reads() {
    let q: Queue<Vec<Tensor>> = Queue::new().unwrap();
    let mut ctx = spawn(
        |_rank, q: Queue<Vec<Tensor>>| {
            let small = Tensor::full(&[100], 7i64);
            let big = Tensor::full(&[3 << 20], 0.5f32); // a one-slot arena of its own
            q.put(vec![small, big]).unwrap();
        },
        q.clone(),
        1,
    )
    .unwrap();
    assert_eq!(ctx.join(None), Ok(true), "the worker has exited");
    let got = q.get().unwrap();
    assert!(got[0].to_vec::<i64>().unwrap().iter().all(|v| *v == 7));
    assert!(got[1].to_vec::<f32>().unwrap().iter().all(|v| *v == 0.5));
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// torch's pain: one descriptor per storage. A worker limited to 256 descriptors holds
/// 10,000 received tensors at once.
#[test]
fn ten_thousand_live_tensors_under_rlimit_nofile_256() {
    let q: Queue<Tensor> = Queue::with_capacity(64).unwrap();
    let result: Queue<Result<(f64, usize), String>> = Queue::new().unwrap();
    let mut ctx = spawn(
        |_rank, (q, result): (Queue<Tensor>, Queue<Result<(f64, usize), String>>)| {
            let limit = rustix::process::Rlimit { current: Some(256), maximum: Some(256) };
            rustix::process::setrlimit(rustix::process::Resource::Nofile, limit).unwrap();
            let mut live = Vec::with_capacity(10_000);
            for _ in 0..10_000 {
                match q.get() {
                    Ok(t) => live.push(t),
                    Err(e) => {
                        result.put(Err(e.to_string())).unwrap();
                        return;
                    }
                }
            }
            let sum: f64 =
                live.iter().map(|t| t.to_vec::<f32>().unwrap().iter().map(|v| *v as f64).sum::<f64>()).sum();
            result.put(Ok((sum, open_fds()))).unwrap();
        },
        (q.clone(), result.clone()),
        1,
    )
    .unwrap();
    for i in 0..10_000 {
        q.put(Tensor::full(&[16], i as f32)).unwrap();
    }
    let (sum, fds) = result.get().unwrap().unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    let expected: f64 = (0..10_000).map(|i| 16.0 * i as f64).sum();
    assert_eq!(sum, expected);
    assert!(fds < 64, "the worker held {fds} descriptors for 10,000 tensors");
}

/// The descriptor count of a sender and of a receiver stays flat over 100,000 messages.
/// (In a helper process of its own, so that no other test's descriptors are counted.)
#[test]
fn descriptor_counts_stay_flat_over_100000_messages() {
    common::isolated_with(|_rank, ()| descriptor_counts_stay_flat(), ());
}

fn descriptor_counts_stay_flat() {
    const N: usize = 100_000;
    let q: Queue<Tensor> = Queue::with_capacity(16).unwrap();
    let result: Queue<(usize, usize)> = Queue::new().unwrap();
    let mut ctx = spawn(
        |_rank, (q, result): (Queue<Tensor>, Queue<(usize, usize)>)| {
            let mut after_warmup = 0;
            for i in 0..N {
                let t = q.get().unwrap();
                assert_eq!(t.to_vec::<i32>().unwrap()[0], i as i32);
                // Counted with no tensor alive, as at the end: a received value may hold
                // through its message's descriptor until the next receive.
                drop(t);
                if i == 1000 {
                    after_warmup = open_fds();
                }
            }
            result.put((after_warmup, open_fds())).unwrap();
        },
        (q.clone(), result.clone()),
        1,
    )
    .unwrap();
    let mut sender_after_warmup = 0;
    for i in 0..N {
        q.put(Tensor::full(&[4], i as i32)).unwrap();
        if i == 1000 {
            // Counted after a wait, as at the end: a process that waits opens the
            // descriptions it will send with next (one per arena, ahead of need).
            let idle: Queue<()> = Queue::new().unwrap();
            assert!(matches!(idle.get_timeout(std::time::Duration::ZERO), Err(Error::Timeout)));
            drop(idle);
            sender_after_warmup = open_fds();
        }
    }
    let (recv_warm, recv_end) = result.get().unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    let sender_end = open_fds();
    assert_eq!(recv_end, recv_warm, "the receiver's descriptors after warm-up and at the end");
    assert_eq!(sender_end, sender_after_warmup, "the sender's descriptors after warm-up and at the end");
}

/// A producer killed with SIGKILL: the consumer's blocked get returns Disconnected.
#[test]
fn a_sigkilled_producer_makes_get_disconnected() {
    let q: SimpleQueue<u32> = SimpleQueue::new().unwrap();
    fn put_one_then_wait(_rank: usize, q: SimpleQueue<u32>) {
        q.put(1).unwrap();
        loop {
            std::thread::park();
        }
    }
    let mut ctx = spawn(put_one_then_wait, q.clone(), 1).unwrap();
    assert_eq!(q.get().unwrap(), 1);
    let pid = rustix::process::Pid::from_raw(ctx.pids()[0]).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).unwrap();
    let err = ctx.join(None).unwrap_err();
    assert_eq!(err.signal_name(), Some("SIGKILL"));
    assert!(matches!(q.get(), Err(Error::Disconnected)));
}

/// Handles pointing outside their segment are InvalidMessage, in a real receiver.
#[test]
fn a_malformed_message_from_another_process_is_invalid_not_a_crash() {
    let t = Tensor::full(&[8], 1u8);
    let (mut bytes, fds) = raw::encode(&t).unwrap();
    // The last payload bytes are the tensor's offset (0), flags and device: make the offset
    // 127 elements, past the end of its 8-byte storage.
    let n = bytes.len();
    assert_eq!(bytes[n - 4], 0);
    bytes[n - 4] = 0x7f;
    let err = raw::decode::<Tensor>(&bytes, fds).unwrap_err();
    assert!(matches!(err, Error::InvalidMessage(_)), "{err}");
    // The reason survives the serde layer.
    assert!(err.to_string().contains("tensor handle"), "{err}");
}

/// Endpoints travel inside messages: a worker receives a queue and a pipe end through a
/// queue, and answers through them.
#[test]
fn queues_and_pipes_travel_inside_messages() {
    type Reply = (Queue<String>, tensorshare::Connection<u64>);
    let inbox: Queue<Reply> = Queue::new().unwrap();
    let mut ctx = spawn(
        |_rank, inbox: Queue<Reply>| {
            let (answers, conn) = inbox.get().unwrap();
            answers.put("hello through a queue".into()).unwrap();
            conn.send(42).unwrap();
        },
        inbox.clone(),
        1,
    )
    .unwrap();
    let answers: Queue<String> = Queue::new().unwrap();
    let (mine, theirs) = tensorshare::pipe::<u64>().unwrap();
    inbox.put((answers.clone(), theirs)).unwrap();
    assert_eq!(answers.get().unwrap(), "hello through a queue");
    assert_eq!(mine.recv().unwrap(), 42);
    assert_eq!(ctx.join(None), Ok(true));
    // The worker is gone and we sent our only copy of the other end: hang-up.
    assert!(matches!(mine.recv(), Err(Error::Disconnected)));
}

fn produce_tagged(rank: usize, q: Queue<Vec<u64>>) {
    for i in 0..200u64 {
        // Every 25th message is larger than a socket record.
        let len = if i % 25 == 0 { 50_000 } else { 8 };
        q.put(vec![rank as u64 * 1_000_000 + i; len]).unwrap();
    }
}

fn consume_tagged(_rank: usize, (q, out): (Queue<Vec<u64>>, Queue<Vec<u64>>)) {
    let mut seen = Vec::new();
    loop {
        let v = q.get().unwrap();
        if v.is_empty() {
            break; // the parent's end marker: one per consumer
        }
        assert!(v.iter().all(|x| *x == v[0]), "a message mixed with another");
        seen.push(v[0]);
        if seen.len() % 100 == 0 {
            out.put(std::mem::take(&mut seen)).unwrap();
        }
    }
    out.put(seen).unwrap();
}

/// Three producer processes and two consumer processes share one queue: every message is
/// taken exactly once, whole.
#[test]
fn many_producer_and_consumer_processes_share_one_queue() {
    let q: Queue<Vec<u64>> = Queue::with_capacity(16).unwrap();
    let out: Queue<Vec<u64>> = Queue::new().unwrap();
    let mut consumers = spawn(consume_tagged, (q.clone(), out.clone()), 2).unwrap();
    let mut producers = spawn(produce_tagged, q.clone(), 3).unwrap();
    assert_eq!(producers.join(None), Ok(true));
    q.put(Vec::new()).unwrap();
    q.put(Vec::new()).unwrap();
    assert_eq!(consumers.join(None), Ok(true));
    let mut all = Vec::new();
    while let Some(batch) = out.try_get().unwrap() {
        all.extend(batch);
        if all.len() == 600 {
            break;
        }
    }
    all.sort();
    let expected: Vec<u64> = (0..3u64).flat_map(|p| (0..200).map(move |i| p * 1_000_000 + i)).collect();
    assert_eq!(all, expected, "each message exactly once");
}

fn sum_firsts(_rank: usize, (q, out): (Queue<Vec<Tensor>>, Queue<(usize, f64)>)) {
    let tensors = q.get().unwrap();
    let mut sum = 0.0;
    for t in &tensors {
        let v = t.atomic::<f32>().unwrap();
        assert_eq!(v.load(0), v.load(v.len() - 1), "both ends of a tensor hold its index");
        sum += v.load(0) as f64;
    }
    out.put((tensors.len(), sum)).unwrap();
}

/// A message naming more segments than one record can carry descriptors (253): 260
/// tensors over 4 MiB, one arena each, as a large model's state dict would be. (In a helper
/// process: its thousand megabytes of arenas stay out of the other tests' process.)
#[test]
fn a_message_with_more_segments_than_one_record_can_carry() {
    common::isolated_with(|_rank, ()| more_segments_than_one_record(), ());
}

fn more_segments_than_one_record() {
    const N: usize = 260;
    let q: Queue<Vec<Tensor>> = Queue::new().unwrap();
    let out: Queue<(usize, f64)> = Queue::new().unwrap();
    let mut ctx = spawn(sum_firsts, (q.clone(), out.clone()), 1).unwrap();
    let tensors: Vec<Tensor> = (0..N)
        .map(|i| {
            let t = Tensor::empty_shared(&[(1 << 20) + 1], DType::F32).unwrap();
            let v = t.atomic::<f32>().unwrap();
            v.store(0, i as f32);
            v.store(v.len() - 1, i as f32);
            t
        })
        .collect();
    // 260 arenas: more descriptors than one record can carry (they travel on a side socket).
    q.put(tensors).unwrap();
    let (n, sum) = out.get().unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    assert_eq!(n, N);
    assert_eq!(sum, (0..N).map(|i| i as f64).sum::<f64>());
}

/// Waits (spinning, without a call into tensorshare) until `flag[0]` is `v`.
fn spin_until(flag: &Tensor, v: i32) {
    let a = flag.atomic::<i32>().unwrap();
    while a.load(0) != v {
        std::hint::spin_loop();
    }
}

/// A relay passes a tensor on with the hold of the message that brought it (it takes no lock
/// of its own) and drops its handle; the last receiver holds it through that hold without a
/// call into tensorshare meanwhile; the creator, with no handle left, never hands the slot
/// out again while it is held.
#[test]
fn a_relayed_tensor_stays_held_until_its_last_receiver_drops_it() {
    let (q1, q2): (Queue<Tensor>, Queue<Tensor>) = (Queue::new().unwrap(), Queue::new().unwrap());
    let flag = Tensor::empty_shared(&[1], DType::I32).unwrap();
    flag.atomic::<i32>().unwrap().store(0, 0);
    let mut ctx = spawn(
        |rank, (q1, q2, flag): (Queue<Tensor>, Queue<Tensor>, Tensor)| {
            if rank == 0 {
                let t = q1.get().unwrap();
                q2.put(t).unwrap();
                return;
            }
            let kept = q2.get().unwrap();
            flag.atomic::<i32>().unwrap().store(0, 1);
            spin_until(&flag, 2);
            assert!(kept.to_vec::<f32>().unwrap().iter().all(|v| *v == 1.0), "the held slot was reused");
        },
        (q1.clone(), q2.clone(), flag.clone()),
        2,
    )
    .unwrap();
    q1.put(Tensor::full(&[1024], 1.0f32)).unwrap();
    spin_until(&flag, 1);
    let others = hand_out_everything_else();
    flag.atomic::<i32>().unwrap().store(0, 2);
    assert_eq!(ctx.join(None), Ok(true));
    drop(others);
}

/// A receiver that waits for its next message holds what it kept with a lock of its own:
/// the message's descriptor is closed by then, and the creator, having let its send
/// description go, still never hands the slot out again.
#[test]
fn a_kept_tensor_is_held_by_its_receiver_once_it_waits() {
    let q: Queue<Tensor> = Queue::new().unwrap();
    let (go, wait) = tensorshare::pipe::<u32>().unwrap();
    let mut ctx = spawn(
        |_rank, (q, wait): (Queue<Tensor>, tensorshare::Connection<u32>)| {
            // A first tensor of the same arena, so that the arena is mapped here already.
            drop(q.get().unwrap());
            wait.send(0).unwrap();
            assert_eq!(wait.recv().unwrap(), 0);
            let before = open_fds();
            let kept = q.get().unwrap();
            wait.send(1).unwrap();
            assert_eq!(wait.recv().unwrap(), 2); // waits: the hold is settled meanwhile
            assert_eq!(open_fds(), before, "the message's descriptor is still open");
            assert!(kept.to_vec::<f32>().unwrap().iter().all(|v| *v == 1.0), "the held slot was reused");
            wait.send(3).unwrap();
        },
        (q.clone(), wait),
        1,
    )
    .unwrap();
    let mut warm = Tensor::full(&[1024], 0.0f32);
    warm.share_memory().unwrap();
    let mut t = Tensor::full(&[1024], 1.0f32);
    t.share_memory().unwrap();
    q.put(warm).unwrap();
    assert_eq!(go.recv().unwrap(), 0);
    go.send(0).unwrap();
    q.put(t).unwrap();
    assert_eq!(go.recv().unwrap(), 1);
    let others = hand_out_everything_else();
    go.send(2).unwrap();
    assert_eq!(go.recv().unwrap(), 3);
    assert_eq!(ctx.join(None), Ok(true));
    drop(others);
}
