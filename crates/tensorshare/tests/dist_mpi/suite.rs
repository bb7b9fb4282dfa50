//! What every rank checks, on one node (`node`) and on two (`nodes`).

use half::{bf16, f16};
use tensorshare::dist::{self, DistError, ReduceOp};
use tensorshare::{spawn, DType, Error, Queue, Tensor};

use crate::ensure;
use crate::ranks::{not_initialized, Check, Ctx};

const DTYPES: [DType; 9] = [
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::U8,
    DType::I8,
    DType::I16,
    DType::I32,
    DType::I64,
];
const OPS: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Product, ReduceOp::Max, ReduceOp::Min];
/// More bytes than a board slot holds, for every dtype: the path without a copy.
const LARGE: usize = 300_001;

fn tensor_of(dtype: DType, vals: &[f64]) -> Check<Tensor> {
    let shape = [vals.len()];
    match dtype {
        DType::F32 => Tensor::from_vec(vals.iter().map(|&v| v as f32).collect(), &shape),
        DType::F64 => Tensor::from_vec(vals.to_vec(), &shape),
        DType::F16 => Tensor::from_vec(vals.iter().map(|&v| f16::from_f64(v)).collect(), &shape),
        DType::BF16 => Tensor::from_vec(vals.iter().map(|&v| bf16::from_f64(v)).collect(), &shape),
        DType::U8 => Tensor::from_vec(vals.iter().map(|&v| v as u8).collect(), &shape),
        DType::I8 => Tensor::from_vec(vals.iter().map(|&v| v as i8).collect(), &shape),
        DType::I16 => Tensor::from_vec(vals.iter().map(|&v| v as i16).collect(), &shape),
        DType::I32 => Tensor::from_vec(vals.iter().map(|&v| v as i32).collect(), &shape),
        DType::I64 => Tensor::from_vec(vals.iter().map(|&v| v as i64).collect(), &shape),
        DType::Bool => Tensor::from_vec(vals.iter().map(|&v| v != 0.0).collect(), &shape),
    }
    .ctx("a tensor of values")
}

fn values(t: &Tensor) -> Check<Vec<f64>> {
    fn all<T: tensorshare::Element>(t: &Tensor, f: impl Fn(T) -> f64) -> Check<Vec<f64>> {
        Ok(t.to_vec::<T>().ctx("values")?.into_iter().map(f).collect())
    }
    match t.dtype() {
        DType::F32 => all(t, |v: f32| v as f64),
        DType::F64 => all(t, |v: f64| v),
        DType::F16 => all(t, |v: f16| v.to_f64()),
        DType::BF16 => all(t, |v: bf16| v.to_f64()),
        DType::U8 => all(t, |v: u8| v as f64),
        DType::I8 => all(t, |v: i8| v as f64),
        DType::I16 => all(t, |v: i16| v as f64),
        DType::I32 => all(t, |v: i32| v as f64),
        DType::I64 => all(t, |v: i64| v as f64),
        DType::Bool => all(t, |v: bool| v as u8 as f64),
    }
}

/// Rank `rank`'s element `i` for `op`: small numbers, so that every result is exact in
/// every dtype.
fn value(op: ReduceOp, rank: usize, i: usize) -> f64 {
    match op {
        ReduceOp::Product => 1.0 + ((i + rank) % 2) as f64,
        _ => ((i * 7 + rank * 3) % 5) as f64,
    }
}

fn expected(op: ReduceOp, size: usize, i: usize) -> f64 {
    let vals = (0..size).map(|r| value(op, r, i));
    match op {
        ReduceOp::Sum => vals.sum(),
        ReduceOp::Mean => vals.sum::<f64>() / size as f64,
        ReduceOp::Product => vals.product(),
        ReduceOp::Max => vals.fold(f64::MIN, f64::max),
        ReduceOp::Min => vals.fold(f64::MAX, f64::min),
    }
}

fn check_all_reduce(dtype: DType, op: ReduceOp, n: usize, size: usize, rank: usize) -> Check<Tensor> {
    let mut t = tensor_of(dtype, &(0..n).map(|i| value(op, rank, i)).collect::<Vec<_>>())?;
    dist::all_reduce(&mut t, op).ctx(&format!("all_reduce of {n} {dtype} with {op:?}"))?;
    for (i, got) in values(&t)?.into_iter().enumerate() {
        let want = expected(op, size, i);
        ensure!(got == want, "{dtype} {op:?} of {n}: element {i} is {got}, not {want}");
    }
    Ok(t)
}

fn collectives(size: usize, rank: usize) -> Check<usize> {
    let mut checks = 0;
    for dtype in DTYPES {
        for op in OPS.into_iter().filter(|&op| op != ReduceOp::Mean || dtype.is_float()) {
            check_all_reduce(dtype, op, 37, size, rank)?;
            checks += 1;
        }
    }
    for (dtype, op) in [
        (DType::F32, ReduceOp::Sum),
        (DType::F32, ReduceOp::Mean),
        (DType::F64, ReduceOp::Min),
        (DType::F16, ReduceOp::Sum),
        (DType::BF16, ReduceOp::Product),
        (DType::U8, ReduceOp::Max),
        (DType::I64, ReduceOp::Sum),
    ] {
        let t = check_all_reduce(dtype, op, LARGE, size, rank)?;
        ensure!(t.is_shared(), "a large all_reduce works in shared memory, in place");
        checks += 1;
    }
    // Views with strides, small and large: every view of the base sees the result.
    let sum = (size * (size + 1) / 2) as f32;
    for n in [6, 100_000] {
        let base = Tensor::full(&[n, 4], (rank + 1) as f32);
        let mut view = base.t().ctx("transpose")?;
        dist::all_reduce(&mut view, ReduceOp::Sum).ctx("all_reduce of a transposed view")?;
        ensure!(base.to_vec::<f32>().ctx("values")?.iter().all(|&v| v == sum), "a strided all_reduce of {n}");
        checks += 1;
    }
    // Broadcast from the last rank, into contiguous tensors and into a transposed view.
    let src = size - 1;
    for n in [10, 200_000] {
        let mut t = if rank == src {
            Tensor::from_vec((0..n).map(|i| i as f32).collect(), &[n]).ctx("tensor")?
        } else {
            Tensor::zeros(&[n], DType::F32)
        };
        dist::broadcast(&mut t, src).ctx("broadcast")?;
        ensure!(
            t.to_vec::<f32>().ctx("values")?.iter().enumerate().all(|(i, &v)| v == i as f32),
            "broadcast {n}"
        );
        checks += 1;
    }
    let base = Tensor::zeros(&[3, 5], DType::I32);
    let mut t = if rank == src {
        Tensor::from_vec((0..15).collect::<Vec<i32>>(), &[5, 3]).ctx("tensor")?
    } else {
        base.t().ctx("transpose")?
    };
    dist::broadcast(&mut t, src).ctx("broadcast into a view")?;
    ensure!(t.to_vec::<i32>().ctx("values")? == (0..15).collect::<Vec<_>>(), "broadcast into a strided view");
    // All-gather, small and large: private copies, by rank.
    for n in [3, 100_000] {
        let mine = Tensor::full(&[n], rank as i64);
        let all = dist::all_gather(&mine).ctx("all_gather")?;
        ensure!(all.len() == size, "all_gather of {size} ranks gave {}", all.len());
        for (r, t) in all.iter().enumerate() {
            ensure!(!t.is_shared() && t.shape() == [n], "all_gather gives private copies");
            ensure!(
                t.to_vec::<i64>().ctx("values")?.iter().all(|&v| v == r as i64),
                "all_gather: rank {r}'s tensor"
            );
        }
        checks += 1;
    }
    dist::barrier().ctx("barrier")?;
    checks += mismatches(size, rank)?;
    Ok(checks + 1)
}

/// Collectives the ranks do not agree on: the same error everywhere, the group still usable.
fn mismatches(size: usize, rank: usize) -> Check<usize> {
    let odd = size - 1;
    let mut t = Tensor::zeros(&[4], if rank == odd { DType::F64 } else { DType::F32 });
    let e = dist::all_reduce(&mut t, ReduceOp::Sum).unwrap_err();
    let text = e.to_string();
    ensure!(matches!(e, Error::Dist(DistError::Mismatch { .. })), "{text}");
    ensure!(text.contains(&format!("rank {odd} called")) && text.contains("float64"), "{text}");
    let mut t = Tensor::zeros(&[if rank == 1 { 5 } else { 4 }], DType::F32);
    let text = dist::all_reduce(&mut t, ReduceOp::Max).unwrap_err().to_string();
    ensure!(text.contains("rank 1 called") && text.contains("shape [5]"), "{text}");
    let e = if rank == 0 { dist::barrier() } else { dist::all_reduce(&mut t, ReduceOp::Sum) }.unwrap_err();
    ensure!(e.to_string().contains("barrier") && e.to_string().contains("all_reduce (sum)"), "{e}");
    let mut t = if rank == odd { Tensor::meta(&[4], DType::F32) } else { Tensor::zeros(&[4], DType::F32) };
    let e = dist::all_reduce(&mut t, ReduceOp::Sum).unwrap_err();
    ensure!(matches!(&e, Error::Dist(DistError::Refused { rank, .. }) if *rank == odd), "{e}");
    ensure!(e.to_string().contains("meta"), "{e}");
    let e = dist::all_reduce(&mut Tensor::zeros(&[4], DType::I32), ReduceOp::Mean).unwrap_err();
    ensure!(e.to_string().contains("mean of a int32 tensor"), "{e}");
    let e = dist::all_reduce(&mut Tensor::zeros(&[4], DType::Bool), ReduceOp::Max).unwrap_err();
    ensure!(e.to_string().contains("bool"), "{e}");
    let e = dist::broadcast(&mut Tensor::zeros(&[4], DType::U8), size).unwrap_err();
    ensure!(e.to_string().contains(&format!("names rank {size} as the source")), "{e}");
    check_all_reduce(DType::F32, ReduceOp::Sum, 5, size, rank)?;
    Ok(7)
}

fn point_to_point(size: usize, rank: usize) -> Check<usize> {
    let topo = dist::topology().ctx("topology")?;
    let mut checks = 0;
    dist::send(&(rank as u64), (rank + 1) % size).ctx("send around the ring")?;
    let got: u64 = dist::recv((rank + size - 1) % size).ctx("recv around the ring")?;
    ensure!(got == ((rank + size - 1) % size) as u64, "the ring brought {got}");
    // Within a node: a tensor as a handle (the receiver writes what the sender sees), a queue.
    let here = topo.nodes()[topo.node()].ranks().to_vec();
    if let [a, b, ..] = here[..] {
        if rank == a {
            let t = Tensor::zeros(&[8], DType::F32);
            let q: Queue<u64> = Queue::new().ctx("queue")?;
            dist::send(&("hello".to_string(), t.clone(), vec![1u64, 2, 3], q.clone()), b).ctx("send to b")?;
            ensure!(q.get().ctx("the queue's value")? == 5, "a queue sent to another rank");
            ensure!(
                t.is_shared() && t.to_vec::<f32>().ctx("values")? == vec![7.0; 8],
                "b wrote through the handle"
            );
        } else if rank == b {
            type Msg = (String, Tensor, Vec<u64>, Queue<u64>);
            let (s, mut t, v, q): Msg = dist::recv(a).ctx("recv from a")?;
            ensure!(s == "hello" && v == [1, 2, 3] && t.is_shared(), "what b received");
            t.fill(7.0f32).ctx("fill")?;
            q.put(5).map_err(|e| e.to_string())?;
        }
        checks += 1;
        // Small values (which the pair's queue carries in its lane) and large ones (which
        // go through its socket), interleaved, arrive in the order sent.
        let len = |i: u64| if i % 3 == 0 { 300_000 } else { 16 };
        if rank == a {
            for i in 0..120u64 {
                dist::send(&(i, Tensor::full(&[len(i)], i as f32)), b).ctx("send in order")?;
            }
        } else if rank == b {
            for i in 0..120u64 {
                let (j, t): (u64, Tensor) = dist::recv(a).ctx("recv in order")?;
                let v = t.to_vec::<f32>().ctx("values")?;
                ensure!(
                    j == i && v.len() == len(i) && v.iter().all(|&x| x == i as f32),
                    "value {i} came as {j}"
                );
            }
        }
        checks += 1;
    }
    // Across nodes: tensors by value, queues refused.
    if topo.nodes().len() > 1 {
        let far = topo.nodes()[1].ranks()[0];
        let n = 300_000;
        if rank == 0 {
            let t = Tensor::from_vec((0..n).map(|i| i as f32).collect(), &[n]).ctx("tensor")?;
            dist::send(&("far", t.clone()), far).ctx("send across")?;
            let back: Tensor = dist::recv(far).ctx("recv across")?;
            ensure!(t.to_vec::<f32>().ctx("values")?[7] == 7.0, "the receiver's writes stay there");
            ensure!(
                !back.is_shared() && back.to_vec::<f32>().ctx("values")?.iter().all(|&v| v == 9.0),
                "back"
            );
            let q: Queue<u64> = Queue::new().ctx("queue")?;
            let e = dist::send(&q, far).unwrap_err().to_string();
            ensure!(e.contains("can only travel inside a tensorshare message"), "{e}");
        } else if rank == far {
            let (s, mut t): (String, Tensor) = dist::recv(0).ctx("recv across")?;
            ensure!(s == "far" && !t.is_shared(), "across nodes a tensor comes by value");
            ensure!(
                t.to_vec::<f32>().ctx("values")?.iter().enumerate().all(|(i, &v)| v == i as f32),
                "values"
            );
            t.fill(9.0f32).ctx("fill")?;
            dist::send(&t, 0).ctx("send back")?;
        }
        checks += 1;
    }
    let e = dist::send(&1u8, rank).unwrap_err();
    ensure!(e.to_string().contains("is this rank"), "{e}");
    let e = dist::recv::<u8>(size).unwrap_err();
    ensure!(e.to_string().contains(&format!("rank {size} in a job of {size} ranks")), "{e}");
    Ok(checks + 2)
}

/// A rank starts a tensorshare worker, which is no rank, and passes on what it made.
fn workers(size: usize) -> Check<usize> {
    type Made = (Tensor, String, String);
    let q: Queue<Made> = Queue::new().ctx("queue")?;
    let mut ctx = spawn(
        |_: usize, q: Queue<Made>| {
            let init = dist::init().err().map(|e| e.to_string()).unwrap_or_default();
            let rank = dist::rank().err().map(|e| e.to_string()).unwrap_or_default();
            q.put((Tensor::full(&[1000], 3.0f32), init, rank)).expect("put");
        },
        q.clone(),
        1,
    )
    .ctx("spawn a worker")?;
    let (mut t, init, rank) = q.get().ctx("the worker's tensor")?;
    ctx.join(None).map_err(|e| format!("join the worker: {e}"))?;
    ensure!(init.contains("tensorshare worker") && rank.contains("tensorshare worker"), "{init} / {rank}");
    dist::all_reduce(&mut t, ReduceOp::Sum).ctx("all_reduce of a worker's tensor")?;
    let want = 3.0 * size as f32;
    ensure!(t.to_vec::<f32>().ctx("values")?.iter().all(|&v| v == want), "the worker's tensor, reduced");
    Ok(1)
}

/// Checks on this rank's thread, and from another thread.
fn threads(rank: usize) -> Check<usize> {
    let e = dist::init().unwrap_err();
    not_initialized(e, "called twice")?;
    std::thread::scope(|s| {
        s.spawn(|| -> Check {
            ensure!(dist::rank().ctx("rank from another thread")? == rank, "rank from another thread");
            not_initialized(dist::barrier().unwrap_err(), "not the thread that called dist::init()")
        })
        .join()
        .map_err(|_| "the other thread panicked".to_string())?
    })?;
    Ok(2)
}

/// What a rank on another node receives from a hostile one: heads that lie about the bytes
/// that follow. Rank 1 sends them raw on the communicator `send` uses between nodes, rank 0
/// receives as a rank of another node would. Each is an `InvalidMessage` that names the lie,
/// nothing is reserved for a length only claimed (a 1 TiB claim fails at its first piece,
/// not as an allocation), and nothing of a refused message is left on the wire: a genuine
/// message right after each one arrives whole.
fn lying_heads(rank: usize) -> Check<usize> {
    use tensorshare::dist::raw;
    const INLINE: u64 = 64 * 1024;
    let head = |n: u64| n.to_le_bytes().to_vec();
    let inline = |n: u64, bytes: &[u8]| [&n.to_le_bytes()[..], bytes].concat();
    let genuine: Vec<u8> = (0..INLINE + 17).map(|i| (i % 251) as u8).collect();
    let lies: Vec<(Vec<Vec<u8>>, &str)> = vec![
        (vec![vec![1, 2, 3]], "a head of 3 bytes"),
        (vec![inline(10, b"abcde")], "5 bytes, announced as 10"),
        (vec![inline(INLINE + 1, b"x")], "bytes in the head of a large message"),
        (vec![head(1 << 40), vec![0; 100]], "a piece of 100 bytes where 1073741824 were due"),
        (vec![head(INLINE + 17), vec![0; 10]], "a piece of 10 bytes where 65553 were due"),
    ];
    if rank == 1 {
        for (pieces, _) in &lies {
            let pieces: Vec<&[u8]> = pieces.iter().map(Vec::as_slice).collect();
            raw::send_pieces(0, &pieces).ctx("a lying head")?;
            raw::send_pieces(0, &[&head(genuine.len() as u64), &genuine]).ctx("a genuine message")?;
        }
    } else if rank == 0 {
        for (_, says) in &lies {
            match raw::recv_bytes(1) {
                Err(Error::InvalidMessage(m)) => ensure!(m.contains(says), "{m:?} does not say {says:?}"),
                other => return Err(format!("a head that lies ({says}) gave {other:?}")),
            }
            let got = raw::recv_bytes(1).ctx("the genuine message after a lie")?;
            ensure!(got == genuine, "the genuine message came as {} other bytes", got.len());
        }
    }
    Ok(lies.len())
}

/// Rank 3 sends to rank 1 for the first time while it can open no descriptor, so that it
/// can make no queue for the pair: its values go on the pair's socket, in order.
fn without_a_queue(rank: usize) -> Check<usize> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    if rank == 3 {
        let before = getrlimit(Resource::Nofile);
        // The lowest descriptor number not in use: with the limit there, none can be opened.
        let open: std::collections::BTreeSet<i32> = std::fs::read_dir("/proc/self/fd")
            .map_err(|e| e.to_string())?
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect();
        let lowest_free = (0..).find(|n| !open.contains(n)).unwrap_or(0) as u64;
        setrlimit(Resource::Nofile, Rlimit { current: Some(lowest_free), maximum: before.maximum })
            .map_err(|e| format!("setrlimit: {e}"))?;
        let sent = (|| -> Check {
            ensure!(Queue::<u64>::new().is_err(), "a queue could still be made");
            for i in 0..3u64 {
                dist::send(&(i, "no queue".to_string()), 1).ctx("send without a queue")?;
            }
            Ok(())
        })();
        setrlimit(Resource::Nofile, before).map_err(|e| format!("setrlimit back: {e}"))?;
        sent?;
    } else if rank == 1 {
        for i in 0..3u64 {
            let (j, s): (u64, String) = dist::recv(3).ctx("recv without a queue")?;
            ensure!(j == i && s == "no queue", "value {i} came as ({j}, {s})");
        }
    }
    Ok(1)
}

/// Ranks 0 and 1, each holding the queue the other made for the pair, send each other
/// values, small (through the lane) and large (through the queue's socket, once the small
/// one is taken), that nobody receives: the session still ends on both when they drop it.
fn unreceived(rank: usize) -> Check<usize> {
    if rank < 2 {
        let other = 1 - rank;
        dist::send(&1u64, other).ctx("a value")?;
        ensure!(dist::recv::<u64>(other).ctx("the other's value")? == 1, "the other's value");
        dist::send(&2u64, other).ctx("a small value")?;
        dist::send(&Tensor::zeros(&[300_000], DType::F32), other).ctx("a large value")?;
    }
    dist::barrier().ctx("barrier")?;
    Ok(1)
}

pub fn node() -> Check<String> {
    not_initialized(dist::rank().unwrap_err(), "call tensorshare::dist::init() first")?;
    let session = dist::init().ctx("init")?;
    let topo = dist::topology().ctx("topology")?;
    let (rank, size) = (topo.rank(), topo.world_size());
    ensure!(size == 4 && topo.nodes().len() == 1 && topo.nodes()[0].ranks() == [0, 1, 2, 3], "{topo:?}");
    ensure!(topo.local_rank() == rank && topo.node_of(3) == Some(0) && topo.node_of(4).is_none(), "{topo:?}");
    ensure!(!topo.nodes()[0].name().is_empty(), "a node has a name");
    let checks = threads(rank)?
        + point_to_point(size, rank)?
        + lying_heads(rank)?
        + collectives(size, rank)?
        + workers(size)?
        + without_a_queue(rank)?
        + unreceived(rank)?;
    drop(session);
    not_initialized(dist::rank().unwrap_err(), "session ended")?;
    Ok(format!("{checks} checks on one node"))
}

pub fn nodes() -> Check<String> {
    let _session = dist::init().ctx("init")?;
    let topo = dist::topology().ctx("topology")?;
    let (rank, size) = (topo.rank(), topo.world_size());
    let nodes = topo.nodes();
    ensure!(size == 4 && nodes.len() == 2, "{topo:?}");
    ensure!(nodes[0].ranks() == [0, 1] && nodes[1].ranks() == [2, 3], "{topo:?}");
    ensure!(nodes[0].name() != nodes[1].name(), "two hosts: {topo:?}");
    ensure!(topo.local_rank() == rank % 2 && topo.node() == rank / 2, "{topo:?}");
    let checks = point_to_point(size, rank)? + collectives(size, rank)? + workers(size)?;
    Ok(format!("{checks} checks on node {} ({}) of two", topo.node(), nodes[topo.node()].name()))
}
