//! tensorshare's side: the workloads as `tensorshare bench` runs them (queues of tensors in
//! shared memory, workers started with `tensorshare::spawn`), with the counts of this run and
//! each process pinned where the placement says.

use std::time::{Duration, Instant};

use tensorshare::{spawn, DType, Queue, Tensor};

use crate::place;
use crate::work::{
    batch_figures, latency_figures, stream_expected, stream_figures, sum_f32, Ctx, Figures, Job, Res,
};

/// A new tensor of `n` f32 set to `v`, where tensors that will be sent belong: in shared
/// memory, filled through the zero-copy borrow (as `tensorshare bench` does: the safe `fill`
/// stores word by word with atomics, since other processes may write shared memory).
fn fresh(n: usize, v: f32) -> Res<Tensor> {
    let mut t = Tensor::empty_shared(&[n], DType::F32).ctx("empty_shared")?;
    // SAFETY: `t` was just made from a slot no process holds; it has no clone or view and
    // has not been sent, so nothing in this or another process reads or writes its elements
    // while this borrow lives; any f32 bit pattern is valid.
    unsafe { t.as_mut_slice::<f32>() }.ctx("as_mut_slice")?.fill(v);
    Ok(t)
}

type EchoArgs = (Queue<Tensor>, Queue<Tensor>, usize, Option<usize>);

/// The child of pingpong: sends every tensor straight back (the same tensor: no copy).
fn echo(_rank: usize, (to, from, rounds, cpu): EchoArgs) {
    place::pin_child(cpu).expect("echo: pin");
    for _ in 0..rounds {
        let t = to.get().expect("echo: get");
        from.put(t).expect("echo: put");
    }
}

type StreamArgs = (Queue<Tensor>, Queue<()>, usize, usize, Option<usize>);

/// The producer of stream: `count` fresh tensors, the i-th filled with i; then waits for the
/// consumer's word that it has them all, so that nothing is still in flight when it exits.
fn produce(_rank: usize, (q, done, n, count, cpu): StreamArgs) {
    place::pin_child(cpu).expect("producer: pin");
    for i in 0..count {
        q.put(fresh(n, i as f32).expect("producer: alloc")).expect("producer: put");
    }
    done.get().expect("producer: done");
}

type BatchArgs = (Queue<Vec<Tensor>>, Queue<()>, usize, usize, usize, Option<usize>);

fn produce_batches(_rank: usize, (q, done, n, k, count, cpu): BatchArgs) {
    place::pin_child(cpu).expect("producer: pin");
    for i in 0..count {
        let b: Vec<Tensor> = (0..k).map(|_| fresh(n, i as f32).expect("producer: alloc")).collect();
        q.put(b).expect("producer: put");
    }
    done.get().expect("producer: done");
}

/// Runs `job` with this process where it is (the caller pinned it) and the child on
/// `child_cpu`.
pub fn run(job: &Job, child_cpu: Option<usize>) -> Res<Figures> {
    let n = job.elements();
    match *job {
        Job::PingPong { same, rounds, warmup, .. } => {
            let to: Queue<Tensor> = Queue::new().ctx("queue")?;
            let from: Queue<Tensor> = Queue::new().ctx("queue")?;
            let mut ctx =
                spawn(echo, (to.clone(), from.clone(), rounds + warmup, child_cpu), 1).ctx("spawn")?;
            let one_tensor = fresh(n, 1.0)?;
            let one = || -> Res<Duration> {
                let t0 = Instant::now();
                let t = if same { one_tensor.clone() } else { fresh(n, 1.0)? };
                to.put(t).ctx("put")?;
                let back = from.get().ctx("get")?;
                let rtt = t0.elapsed();
                drop(back);
                Ok(rtt / 2)
            };
            for _ in 0..warmup {
                one()?;
            }
            let lat = (0..rounds).map(|_| one()).collect::<Res<Vec<_>>>()?;
            ctx.join(None).ctx("join")?;
            Ok(latency_figures(lat))
        }
        Job::Stream { size, count } => {
            let q: Queue<Tensor> = Queue::with_capacity(4).ctx("queue")?;
            let done: Queue<()> = Queue::new().ctx("queue")?;
            let mut ctx = spawn(produce, (q.clone(), done.clone(), n, count, child_cpu), 1).ctx("spawn")?;
            let mut total = 0.0;
            let read = |t: &Tensor| -> Res<f64> {
                // Read in place: the zero-copy path is what is measured. SAFETY: the producer
                // filled a fresh tensor before `put` (ordered before our `get`) and kept no
                // handle; nothing writes it while it is summed.
                Ok(sum_f32(unsafe { t.as_slice::<f32>() }.ctx("as_slice")?))
            };
            let first = q.get().ctx("get")?;
            let t0 = Instant::now();
            total += read(&first)?;
            drop(first);
            for _ in 1..count {
                let t = q.get().ctx("get")?;
                total += read(&t)?;
            }
            let dt = t0.elapsed().as_secs_f64();
            done.put(()).ctx("put")?;
            ctx.join(None).ctx("join")?;
            if total != stream_expected(n, count) {
                return Err(format!("stream: sum {total}, expected {}", stream_expected(n, count)));
            }
            Ok(stream_figures(size, count - 1, dt))
        }
        Job::Batch { k, count, .. } => {
            let q: Queue<Vec<Tensor>> = Queue::with_capacity(4).ctx("queue")?;
            let done: Queue<()> = Queue::new().ctx("queue")?;
            let mut ctx =
                spawn(produce_batches, (q.clone(), done.clone(), n, k, count, child_cpu), 1).ctx("spawn")?;
            let first = q.get().ctx("get")?;
            let t0 = Instant::now();
            drop(first);
            let mut got = 0;
            for _ in 1..count {
                got += q.get().ctx("get")?.len();
            }
            let dt = t0.elapsed().as_secs_f64();
            done.put(()).ctx("put")?;
            ctx.join(None).ctx("join")?;
            Ok(batch_figures(got, dt))
        }
    }
}
