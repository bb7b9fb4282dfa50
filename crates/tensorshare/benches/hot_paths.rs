//! The hot paths, in one process: encoding and decoding a message of 1 and of 100 tensors,
//! arena allocation and release, the receive-cache hit, an in-process queue round trip, and
//! the atomic view's per-element operations.

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use std::hint::black_box;
use tensorshare::{raw, DType, Queue, SharingStrategy, Storage, Tensor};

fn shared(n: usize) -> Tensor {
    let mut t = Tensor::empty_shared(&[n], DType::F32).unwrap();
    t.fill(1.0f32).unwrap();
    t
}

fn dup(fds: &[std::os::fd::OwnedFd]) -> Vec<std::os::fd::OwnedFd> {
    fds.iter().map(|f| f.try_clone().unwrap()).collect()
}

fn encode_decode(c: &mut Criterion) {
    for k in [1usize, 100] {
        let tensors: Vec<Tensor> = (0..k).map(|_| shared(256)).collect();
        c.bench_function(&format!("encode {k} shared tensors"), |b| {
            b.iter(|| black_box(raw::encode(&tensors).unwrap()))
        });
        // Decoding a message whose storages this process already holds: the receive
        // cache's hit path (one lookup per segment and per storage).
        c.bench_function(&format!("decode {k} tensors (cache hit)"), |b| {
            b.iter_batched(
                || {
                    let (bytes, fds) = raw::encode(&tensors).unwrap();
                    let copies = dup(&fds);
                    (bytes, copies, fds)
                },
                |(bytes, copies, fds)| {
                    let v: Vec<Tensor> = raw::decode(&bytes, copies).unwrap();
                    black_box((v, fds))
                },
                BatchSize::PerIteration,
            )
        });
    }
}

fn arena(c: &mut Criterion) {
    for size in [1024usize, 1 << 20] {
        c.bench_function(&format!("arena allocate+release {size} B"), |b| {
            b.iter(|| black_box(Storage::empty_shared_with(size, SharingStrategy::FileDescriptor).unwrap()))
        });
    }
}

fn queue(c: &mut Criterion) {
    let q: Queue<Tensor> = Queue::new().unwrap();
    let t = shared(1024);
    c.bench_function("queue put+get, 4 KiB shared tensor, one process", |b| {
        b.iter(|| {
            q.put(t.clone()).unwrap();
            black_box(q.get().unwrap())
        })
    });
}

/// Hogwild's inner loop: one atomic add per element, on a private and on a shared tensor.
fn atomic(c: &mut Criterion) {
    let delta = vec![0.5f32; 1024];
    for (what, t) in [("private", Tensor::zeros(&[1024], DType::F32)), ("shared", shared(1024))] {
        let v = t.atomic::<f32>().unwrap();
        c.bench_function(&format!("atomic add_slice, 1024 f32, {what}"), |b| {
            b.iter(|| v.add_slice(black_box(&delta)))
        });
    }
}

criterion_group!(benches, encode_decode, arena, queue, atomic);
criterion_main!(benches);
