//! CUDA sharing between real processes: ports of torch's CUDA tests from
//! test/test_multiprocessing.py, and what torch cannot do (a killed consumer gives its
//! memory back, a received tensor is sent on).
//!
//! Every body runs three times: on the simulated device (always: device memory is host
//! shared memory exported as descriptors, exactly like CUDA VMM handles, so handles, the
//! receive cache, leases and relays are exercised for real), and on the CUDA driver when
//! this machine has a GPU, with VMM handles and with legacy IPC handles; without one those
//! tests print why they are skipped and pass. A worker that fails makes the parent's wait
//! for it end at a bound (`get_timeout`), never hang.
#![cfg(feature = "cuda")]
#![allow(clippy::type_complexity)] // queues of tuples, spelled out in each test

use std::time::Duration;

use tensorshare::cuda::{self, Event, EventHandle};
use tensorshare::{
    raw, spawn, start_processes, DType, Device, Error, ProcessContext, Queue, SharedFd, StartMethod, Tensor,
    TensorKind,
};

tensorshare::enable_test_workers!();

mod common;

const GPU: Device = Device::Cuda(0);

/// Runs `$body` in a helper process of its own on the given device layer, under the leak
/// checker (no segment file, no descriptor left), and checks that every device allocation
/// the helper made is freed once the body's tensors and workers are gone.
macro_rules! on_driver {
    ($body:path, $driver:expr) => {
        crate::common::isolated_with(
            |_rank, driver: String| {
                // The helper is a fresh process: no CUDA call has chosen a layer yet, and the
                // workers it starts inherit the variable.
                std::env::set_var(tensorshare::cuda::DRIVER_ENV, &driver);
                match tensorshare::cuda::device_count() {
                    Ok(n) if n > 0 => {}
                    Ok(_) => return eprintln!("skipped on {driver}: no CUDA device"),
                    Err(e) => return eprintln!("skipped on {driver}: {e}"),
                }
                let lc = crate::common::LeakChecker::new();
                for _ in 0..crate::common::repeats() {
                    $body();
                }
                tensorshare::cuda::empty_cache();
                assert_eq!(
                    tensorshare::cuda::memory_stats(),
                    tensorshare::cuda::MemoryStats::default(),
                    "device memory left"
                );
                if driver == "simulated" {
                    // The driver keeps descriptors of its own (device files) open as it likes.
                    lc.check();
                }
            },
            $driver.to_string(),
        )
    };
}

macro_rules! each_driver {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[test]
                fn simulated() {
                    on_driver!(super::$name, "simulated");
                }
                #[test]
                fn gpu() {
                    on_driver!(super::$name, "cuda");
                }
                /// The fallback for devices without VMM: cuMemAlloc and legacy IPC handles.
                #[test]
                fn gpu_legacy_ipc() {
                    on_driver!(super::$name, "cuda-legacy-ipc");
                }
            }
        )*
    };
}

each_driver!(
    test_cuda_simple,
    test_cuda_memory_allocation,
    test_cuda_ipc_deadlock,
    test_cuda_send_many,
    test_cuda_small_tensors,
    test_event,
    test_event_multiprocess,
    test_event_handle_importer,
    test_event_handle_exporter,
    test_empty_tensor_sharing_cuda,
    test_cuda_variable_sharing,
    test_mixed_types_cuda_sharing,
    test_cuda_parameter_sharing,
    test_integer_parameter_serialization_cuda,
    test_is_shared_cuda,
    test_wrong_cuda_fork,
    a_killed_consumer_gives_its_memory_back,
    a_killed_consumers_memory_is_back_on_the_device,
    a_received_tensor_is_relayed_to_a_third_process,
    views_and_offsets_survive_the_trip,
    a_reused_allocation_is_a_new_one_to_receivers,
    an_allocation_coming_back_to_its_creator_is_checked,
    fills_and_copies_of_every_element_size,
    test_event_handle_multi_gpu,
    test_rebuild_cuda_tensor,
    a_write_queued_before_the_send_is_seen_by_the_receiver,
    counts_stay_flat_over_ten_thousand_messages,
    every_bit_of_a_cuda_message,
    a_legacy_handle_is_refused_without_consent,
);

/// Whether this process shares legacy IPC handles (bytes in the message) rather than
/// descriptors.
fn legacy_ipc() -> bool {
    std::env::var(cuda::DRIVER_ENV).is_ok_and(|d| d == "cuda-legacy-ipc")
}

/// The descriptors a message carries for one device allocation: its memory (none for a
/// legacy IPC handle, which travels as bytes) and its lease.
fn fds_per_allocation() -> usize {
    if legacy_ipc() {
        1
    } else {
        2
    }
}

/// How long a test waits for a worker's answer before it fails instead (a worker that
/// panicked never answers, and the test's own queue handles keep the queue open).
const WAIT: Duration = Duration::from_secs(120);

fn cuda_tensor(values: Vec<f32>, shape: &[usize]) -> Tensor {
    Tensor::from_vec(values, shape).unwrap().to_device(GPU).unwrap()
}

/// torch's _test_sharing on CUDA: a worker fills a received tensor and the parent sees it
/// through the tensor and its column view; then one tensor sent twice arrives as one.
fn test_cuda_simple() {
    let x = Tensor::zeros_on(&[5, 5], DType::F32, GPU).unwrap();
    let data = (x.clone(), x.narrow(1, 1, 1).unwrap());
    let q: Queue<(Tensor, Tensor)> = Queue::new().unwrap();
    q.put(data.clone()).unwrap();
    let mut ctx = spawn(
        |_rank, q: Queue<(Tensor, Tensor)>| {
            let (mut x, col) = q.get().unwrap();
            assert_eq!(col.device(), Device::Cuda(0));
            assert!(x.storage().ptr_eq(col.storage()), "one allocation, one storage");
            x.fill(4.0f32).unwrap();
            cuda::synchronize(Device::Cuda(0)).unwrap();
        },
        q.clone(),
        1,
    )
    .unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    assert_eq!(data.0.to_vec::<f32>().unwrap(), vec![4.0; 25]);
    assert_eq!(data.1.to_vec::<f32>().unwrap(), vec![4.0; 5]);

    let back: Queue<Tensor> = Queue::new().unwrap();
    let mut ctx = spawn(
        |_rank, q: Queue<Tensor>| {
            let t = Tensor::full(&[5, 5], 1.0f32).to_device(Device::Cuda(0)).unwrap();
            q.put(t.clone()).unwrap();
            q.put(t).unwrap();
        },
        back.clone(),
        1,
    )
    .unwrap();
    let (t1, t2) = (back.get().unwrap(), back.get().unwrap());
    assert_eq!(ctx.join(None), Ok(true));
    assert!(t1.storage().ptr_eq(t2.storage()));
    assert_eq!(t1.device_ptr().unwrap(), t2.device_ptr().unwrap());
    assert_eq!(t2.to_vec::<f32>().unwrap(), vec![1.0; 25], "readable after the sender exited");
}

/// torch's test_cuda_memory_allocation: the producer drops its own tensors after sending
/// them; the consumer's copies stay valid, and the memory is freed when it is done.
fn test_cuda_memory_allocation() {
    let q: Queue<Vec<Tensor>> = Queue::new().unwrap();
    let done: Queue<bool> = Queue::new().unwrap();
    let release: Queue<bool> = Queue::new().unwrap();
    let mut ctx = spawn(
        |_rank, (q, done, release): (Queue<Vec<Tensor>>, Queue<bool>, Queue<bool>)| {
            let got = q.get().unwrap();
            for (i, t) in got.iter().enumerate() {
                assert_eq!(t.to_vec::<f32>().unwrap(), vec![i as f32; 1000]);
            }
            done.put(true).unwrap();
            // Hold the tensors until the parent has checked that it kept them.
            assert!(release.get().unwrap());
        },
        (q.clone(), done.clone(), release.clone()),
        1,
    )
    .unwrap();
    {
        let ts: Vec<Tensor> =
            (0..5).map(|i| Tensor::full(&[1000], i as f32).to_device(GPU).unwrap()).collect();
        q.put(ts).unwrap();
    } // the producer's own handles are gone
    assert!(done.get().unwrap());
    assert_eq!(cuda::collect(), 0, "the consumer still holds them");
    let held = cuda::memory_stats();
    assert_eq!(held.held_allocations, 5);
    assert!(held.held_for_others >= 5 * 4000);
    release.put(true).unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    assert_eq!(cuda::collect(), held.held_for_others);
    let after = cuda::memory_stats();
    assert_eq!(after.allocated, 0);
    assert_eq!(after.cached, held.held_for_others, "kept for reuse");
    assert_eq!(cuda::empty_cache(), held.held_for_others);
}

/// torch's test_cuda_ipc_deadlock: state dicts of CUDA tensors through a bounded queue,
/// a producer and a consumer worker, do not deadlock.
fn test_cuda_ipc_deadlock() {
    let q: Queue<Vec<(String, Tensor)>> = Queue::with_capacity(3).unwrap();
    let producer = spawn(
        |_rank, q: Queue<Vec<(String, Tensor)>>| {
            for i in 0..20 {
                let sd = vec![
                    (
                        "weight".to_string(),
                        Tensor::full(&[16, 16], i as f32).to_device(Device::Cuda(0)).unwrap(),
                    ),
                    (
                        "bias".to_string(),
                        Tensor::full(&[16], -(i as f32)).to_device(Device::Cuda(0)).unwrap(),
                    ),
                ];
                q.put(sd).unwrap();
            }
        },
        q.clone(),
        1,
    );
    let consumer = spawn(
        |_rank, q: Queue<Vec<(String, Tensor)>>| {
            for i in 0..20 {
                let sd = q.get().unwrap();
                assert_eq!(sd[0].1.to_vec::<f32>().unwrap(), vec![i as f32; 256]);
                assert_eq!(sd[1].1.to_vec::<f32>().unwrap(), vec![-(i as f32); 16]);
            }
        },
        q.clone(),
        1,
    );
    let timeout = Some(std::time::Duration::from_secs(60));
    assert_eq!(producer.unwrap().join(timeout), Ok(true));
    assert_eq!(consumer.unwrap().join(timeout), Ok(true));
}

/// torch's test_cuda_send_many (100,000 tensors; `TENSORSHARE_CUDA_SEND_MANY` sets the
/// count, CI sends 1,000): tensors made by one worker, relayed by a second to a third, which
/// checks every one.
fn test_cuda_send_many() {
    let n: usize =
        std::env::var("TENSORSHARE_CUDA_SEND_MANY").ok().and_then(|v| v.parse().ok()).unwrap_or(1000);
    let a: Queue<Tensor> = Queue::with_capacity(64).unwrap();
    let b: Queue<Tensor> = Queue::with_capacity(64).unwrap();
    let mut ctx = spawn(
        |rank, (a, b, done, n): (Queue<Tensor>, Queue<Tensor>, Queue<bool>, usize)| match rank {
            0 => {
                for i in 0..n {
                    a.put(Tensor::full(&[4], i as i32).to_device(Device::Cuda(0)).unwrap()).unwrap();
                }
                if legacy_ipc() {
                    // A legacy IPC allocation dies with its creator, whoever holds it: the
                    // creator stays until the checker is done (as torch's producers must).
                    done.get().unwrap();
                }
            }
            1 => {
                for _ in 0..n {
                    b.put(a.get().unwrap()).unwrap();
                }
            }
            _ => {
                for i in 0..n {
                    assert_eq!(b.get().unwrap().to_vec::<i32>().unwrap(), vec![i as i32; 4]);
                }
                done.put(true).unwrap();
            }
        },
        (a.clone(), b.clone(), Queue::new().unwrap(), n),
        3,
    )
    .unwrap();
    assert_eq!(ctx.join(Some(std::time::Duration::from_secs(120))), Ok(true));
}

/// torch's test_cuda_small_tensors: small tensors on each device (two on the simulated
/// layer), many of them views of one allocation, keep their values and devices.
fn test_cuda_small_tensors() {
    let devices = cuda::device_count().unwrap().min(2);
    let mut sent = Vec::new();
    for d in 0..devices {
        let base = Tensor::from_vec((0..40).map(|v| v as f32 + 100.0 * d as f32).collect(), &[40])
            .unwrap()
            .to_device(Device::Cuda(d))
            .unwrap();
        for i in 0..8 {
            sent.push(base.narrow(0, i * 5, 5).unwrap());
        }
    }
    let q: Queue<Vec<Tensor>> = Queue::new().unwrap();
    let back: Queue<Vec<(u32, Vec<f32>)>> = Queue::new().unwrap();
    let mut ctx = spawn(
        |_rank, (q, back): (Queue<Vec<Tensor>>, Queue<Vec<(u32, Vec<f32>)>>)| {
            let got = q.get().unwrap();
            let out = got
                .iter()
                .map(|t| match t.device() {
                    Device::Cuda(d) => (d, t.to_vec::<f32>().unwrap()),
                    d => panic!("a tensor arrived on {d}"),
                })
                .collect();
            back.put(out).unwrap();
        },
        (q.clone(), back.clone()),
        1,
    )
    .unwrap();
    q.put(sent.clone()).unwrap();
    let got = back.get().unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    for (t, (d, v)) in sent.iter().zip(got) {
        assert_eq!(Device::Cuda(d), t.device());
        assert_eq!(v, t.to_vec::<f32>().unwrap());
    }
}

/// torch's test_event: the parent records an interprocess event after its work; the child
/// waits on it before its own work on the shared tensor.
fn test_event() {
    let x = Tensor::zeros_on(&[1000], DType::F32, GPU).unwrap();
    let mut y = x.clone();
    y.fill(1.0f32).unwrap(); // queued on the parent's stream
    let e = Event::new(GPU).unwrap();
    e.record().unwrap();
    let mut ctx = spawn(
        |_rank, (e, x): (EventHandle, Tensor)| {
            // SAFETY: the handle is the parent's event's, unchanged (this test sent it).
            let e = unsafe { e.open() }.unwrap();
            e.wait().unwrap();
            assert_eq!(x.to_vec::<f32>().unwrap(), vec![1.0; 1000]);
        },
        (e.handle(), x.clone()),
        1,
    )
    .unwrap();
    assert_eq!(ctx.join(None), Ok(true));
}

/// torch's test_event_multiprocess: the child synchronises on the parent's event, and
/// sees the parent's writes.
fn test_event_multiprocess() {
    let mut x = Tensor::zeros_on(&[64], DType::I32, GPU).unwrap();
    x.fill(7i32).unwrap();
    let e = Event::new(GPU).unwrap();
    e.record().unwrap();
    let q: Queue<(EventHandle, Tensor)> = Queue::new().unwrap();
    q.put((e.handle(), x.clone())).unwrap();
    let mut ctx = spawn(
        |_rank, q: Queue<(EventHandle, Tensor)>| {
            let (e, x) = q.get().unwrap();
            // SAFETY: the handle is the parent's event's, unchanged (this test sent it).
            let e = unsafe { e.open() }.unwrap();
            e.synchronize().unwrap();
            assert!(e.query().unwrap());
            assert_eq!(x.to_vec::<i32>().unwrap(), vec![7; 64]);
        },
        q.clone(),
        1,
    )
    .unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    assert!(e.query().unwrap());
}

/// torch's test_event_handle_importer: the parent exports an event's handle, the child
/// opens it from the bare 64 bytes and synchronises.
fn test_event_handle_importer() {
    let e = Event::new(GPU).unwrap();
    let handle = e.ipc_handle().to_vec();
    let mut ctx = spawn(
        |_rank, handle: Vec<u8>| {
            let handle: [u8; 64] = handle.try_into().unwrap();
            // SAFETY: the parent's event's handle, unchanged (this test sent it).
            let e = unsafe { Event::from_ipc_handle(Device::Cuda(0), handle) }.unwrap();
            e.synchronize().unwrap();
            assert!(e.query().unwrap());
        },
        handle,
        1,
    )
    .unwrap();
    e.record().unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    // The handle names this process's own event: the same one comes back.
    // SAFETY: this process's own event's handle.
    let again = unsafe { Event::from_ipc_handle(GPU, e.ipc_handle()) }.unwrap();
    assert_eq!(again.ipc_handle(), e.ipc_handle());
}

/// torch's test_event_handle_exporter: the child creates and records an event and sends
/// it; the parent waits on it.
fn test_event_handle_exporter() {
    let q: Queue<(EventHandle, Tensor)> = Queue::new().unwrap();
    let done: Queue<bool> = Queue::new().unwrap();
    let mut ctx = spawn(
        |_rank, (q, done): (Queue<(EventHandle, Tensor)>, Queue<bool>)| {
            let mut t = Tensor::zeros_on(&[8], DType::F32, Device::Cuda(0)).unwrap();
            t.fill(3.0f32).unwrap();
            let e = Event::new(Device::Cuda(0)).unwrap();
            e.record().unwrap();
            q.put((e.handle(), t)).unwrap();
            // The event must outlive the parent's use of its handle.
            assert!(done.get().unwrap());
        },
        (q.clone(), done.clone()),
        1,
    )
    .unwrap();
    let (e, t) = q.get().unwrap();
    // SAFETY: the worker's event's handle, unchanged (this test's worker sent it).
    let e = unsafe { e.open() }.unwrap();
    e.synchronize().unwrap();
    assert!(e.query().unwrap());
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![3.0; 8]);
    done.put(true).unwrap();
    assert_eq!(ctx.join(None), Ok(true));
}

/// torch's test_empty_tensor_sharing_cuda.
fn test_empty_tensor_sharing_cuda() {
    let v = vec![
        Tensor::zeros_on(&[0], DType::F32, GPU).unwrap(),
        Tensor::zeros_on(&[0], DType::I64, GPU).unwrap(),
    ];
    let r = common::round_trip(v.clone());
    assert!(r[0].equal(&v[0]) && r[1].equal(&v[1]));
    assert_eq!(r[1].dtype(), DType::I64);
    assert_eq!(r[0].device(), GPU);
}

/// torch's test_cuda_variable_sharing: requires_grad travels; the worker sees the values
/// and its write is seen by the parent.
fn test_cuda_variable_sharing() {
    for requires_grad in [true, false] {
        let mut var = cuda_tensor((1..=25).map(|v| v as f32).collect(), &[5, 5]);
        var.set_requires_grad(requires_grad).unwrap();
        let q: Queue<Tensor> = Queue::new().unwrap();
        q.put(var.clone()).unwrap();
        let mut ctx = spawn(
            |_rank, (q, requires_grad): (Queue<Tensor>, bool)| {
                let v = q.get().unwrap();
                assert_eq!(v.requires_grad(), requires_grad);
                assert_eq!(v.to_vec::<f32>().unwrap(), (1..=25).map(|v| v as f32).collect::<Vec<_>>());
                v.narrow(0, 0, 1).unwrap().narrow(1, 0, 1).unwrap().fill(-1.0f32).unwrap();
            },
            (q.clone(), requires_grad),
            1,
        )
        .unwrap();
        assert_eq!(ctx.join(None), Ok(true));
        assert_eq!(var.to_vec::<f32>().unwrap()[0], -1.0);
    }
}

/// torch's test_mixed_types_cuda_sharing: a float and a byte view of one allocation stay
/// one allocation, and a write through one is seen through the other.
fn test_mixed_types_cuda_sharing() {
    let floats = cuda_tensor(vec![0.0; 4], &[4]);
    let bytes = Tensor::from_storage(floats.storage().clone(), DType::U8, &[16], &[1], 0).unwrap();
    assert_eq!(bytes.device(), GPU);
    let q: Queue<(Tensor, Tensor)> = Queue::new().unwrap();
    q.put((floats.clone(), bytes)).unwrap();
    let mut ctx = spawn(
        |_rank, q: Queue<(Tensor, Tensor)>| {
            let (f, b) = q.get().unwrap();
            assert!(f.storage().ptr_eq(b.storage()));
            // 1.0f32 is 00 00 80 3f: write its bytes through the byte view.
            b.narrow(0, 2, 1).unwrap().fill(0x80u8).unwrap();
            b.narrow(0, 3, 1).unwrap().fill(0x3fu8).unwrap();
            assert_eq!(f.to_vec::<f32>().unwrap()[0], 1.0);
        },
        q.clone(),
        1,
    )
    .unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    assert_eq!(floats.to_vec::<f32>().unwrap(), vec![1.0, 0.0, 0.0, 0.0]);
}

/// torch's test_cuda_parameter_sharing: a parameter stays a parameter and comes back as the
/// same storage.
fn test_cuda_parameter_sharing() {
    let p = cuda_tensor(vec![1.0, 2.0, 3.0], &[3]).into_parameter();
    let r = common::round_trip(vec![p.clone()]);
    assert_eq!(r[0].kind(), TensorKind::Parameter);
    assert!(r[0].requires_grad());
    assert!(r[0].storage().ptr_eq(p.storage()), "back in its creator: the same storage");
}

/// torch's test_integer_parameter_serialization_cuda.
fn test_integer_parameter_serialization_cuda() {
    let ip = Tensor::from_vec(vec![0i64], &[1]).unwrap().to_device(GPU).unwrap().into_parameter();
    common::integer_parameter_reaches_a_worker(ip);
}

/// torch's test_is_shared_cuda: a CUDA tensor is always shared.
fn test_is_shared_cuda() {
    let t = Tensor::zeros_on(&[5, 5], DType::F32, GPU).unwrap();
    assert!(t.is_shared());
    assert!(t.storage().is_shared());
    assert_eq!(t.storage().sharing_strategy(), None);
}

/// torch's test_cuda_bad_call and test_wrong_cuda_fork: once this process has initialised
/// CUDA, a Fork worker is refused with torch's message, before anything is forked; Spawn
/// workers use CUDA as they like.
fn test_wrong_cuda_fork() {
    let t = Tensor::zeros_on(&[4], DType::F32, GPU).unwrap();
    // A child forked by other means (this helper has no other threads) gets torch's error
    // from its first CUDA call, and never touches the driver.
    // SAFETY: the helper process is single-threaded here; the child only calls into this
    // crate and then leaves with _exit, running no destructors or atexit handlers.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let refused = match Tensor::zeros_on(&[4], DType::F32, GPU) {
            Err(e) => e.to_string().contains("Cannot re-initialize CUDA in forked subprocess"),
            Ok(_) => false,
        };
        // SAFETY: leaves the forked child at once.
        unsafe { libc::_exit(if refused { 0 } else { 1 }) };
    }
    let mut status = 0;
    // SAFETY: waits for the child forked above.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the forked child used CUDA: {status}"
    );

    let err = start_processes(|_rank, _t: Tensor| {}, t.clone(), 1, StartMethod::Fork).unwrap_err();
    assert!(matches!(err, Error::Device(_)), "{err:?}");
    assert!(err.to_string().contains("Cannot re-initialize CUDA in forked subprocess"), "{err}");
    // torch's test_cuda_bad_call: a forked pool.
    let err = tensorshare::Pool::with_method(1, StartMethod::Fork).unwrap_err();
    assert!(err.to_string().contains("Cannot re-initialize CUDA in forked subprocess"), "{err}");
    let mut ctx = start_processes(
        |_rank, t: Tensor| assert_eq!(t.to_vec::<f32>().unwrap(), vec![0.0; 4]),
        t.clone(),
        1,
        StartMethod::Spawn,
    )
    .unwrap();
    assert_eq!(ctx.join(None), Ok(true));
}

/// The fork server is a fresh process that never initialised CUDA, so its workers may use
/// it after the parent did. (Outside the leak checker: the server stays for later workers.)
#[test]
fn forkserver_workers_use_cuda_after_the_parent_did() {
    common::isolated_with(
        |_rank, ()| {
            std::env::set_var(cuda::DRIVER_ENV, "simulated");
            let t = Tensor::full(&[4], 1.5f32).to_device(GPU).unwrap();
            let mut ctx = start_processes(
                |_rank, t: Tensor| assert_eq!(t.to_vec::<f32>().unwrap(), vec![1.5; 4]),
                t,
                2,
                StartMethod::ForkServer,
            )
            .unwrap();
            assert_eq!(ctx.join(None), Ok(true));
        },
        (),
    );
}

/// A consumer that takes `t`, answers with the bytes of its first element (read from the
/// device) and holds it until it is killed; returned once it has answered.
fn hand_to_a_holder(t: Tensor) -> (ProcessContext, Vec<u8>) {
    let q: Queue<Tensor> = Queue::new().unwrap();
    let got: Queue<Vec<u8>> = Queue::new().unwrap();
    let never: Queue<bool> = Queue::new().unwrap();
    let ctx = spawn(
        |_rank, (q, got, never): (Queue<Tensor>, Queue<Vec<u8>>, Queue<bool>)| {
            let t = q.get().unwrap();
            got.put(t.narrow(0, 0, 1).unwrap().to_bytes().unwrap()).unwrap();
            // Hold the tensor until killed (nobody puts on `never`).
            let _ = never.get();
            drop(t);
        },
        (q.clone(), got.clone(), never.clone()),
        1,
    )
    .unwrap();
    q.put(t).unwrap();
    let first = got.get_timeout(WAIT).unwrap();
    (ctx, first)
}

/// SIGKILLs the holder of [`hand_to_a_holder`] and checks that its join says so.
fn kill_the_holder(mut ctx: ProcessContext) {
    let pid = ctx.pids()[0];
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    let err = ctx.join(None).unwrap_err();
    assert!(err.to_string().contains("SIGKILL"), "{err}");
}

/// torch pins a producer's memory until the producer exits when a consumer dies holding
/// it. Here a SIGKILLed consumer gives it back: the kernel closes its lease.
fn a_killed_consumer_gives_its_memory_back() {
    let (ctx, first) = hand_to_a_holder(Tensor::full(&[1 << 16], 2.0f32).to_device(GPU).unwrap());
    assert_eq!(first, 2.0f32.to_ne_bytes());
    assert_eq!(cuda::collect(), 0);
    assert_eq!(cuda::memory_stats().held_allocations, 1, "held for the consumer");
    kill_the_holder(ctx);
    assert!(cuda::collect() >= 1 << 18, "the killed consumer's hold is released");
    assert_eq!(cuda::memory_stats().allocated, 0);
}

/// The same with a large tensor, measured by the driver where there is one: the device's
/// free memory (cuMemGetInfo, device-wide) comes back once the consumer is killed and the
/// creator collects, by at least the tensor's size.
fn a_killed_consumers_memory_is_back_on_the_device() {
    let Ok((free0, total)) = cuda::mem_get_info(GPU) else {
        return eprintln!("skipped: no device-wide memory figures on this device layer");
    };
    // A quarter of what is free, at most 4 GiB: other processes' contexts may come and go
    // meanwhile, so the check asks for half of it back.
    let len = (free0 / 4).min(4 << 30) as usize & !0xfff;
    let mut t = Tensor::empty_on(&[len], DType::U8, GPU).unwrap();
    t.fill(3u8).unwrap();
    let (ctx, first) = hand_to_a_holder(t);
    assert_eq!(first, [3]);
    assert_eq!(cuda::collect(), 0, "held for the consumer");
    let (held, _) = cuda::mem_get_info(GPU).unwrap();
    kill_the_holder(ctx);
    let reclaimed = cuda::collect();
    assert!(reclaimed >= len, "collect gave back {reclaimed} bytes, the tensor had {len}");
    cuda::empty_cache();
    let (free1, _) = cuda::mem_get_info(GPU).unwrap();
    eprintln!(
        "cuMemGetInfo: {total} total; {free0} free before, {held} while the consumer held \
         {len} bytes, {free1} after it was killed and the creator collected ({} MiB back)",
        (free1 as i64 - held as i64) / (1 << 20)
    );
    assert!(
        free1 >= held + len as u64 / 2,
        "the device did not get the memory back: {held} free while held, {free1} after"
    );
}

/// The sender queues a long chain of device writes and sends without synchronising; the
/// receiver, already waiting, reads at once: its first read must see the last write (the
/// sender finishes its stream before the message leaves). On the simulated device every
/// write is done when its call returns; on a GPU the chain takes milliseconds, so a read
/// not ordered after it would see an earlier value.
fn a_write_queued_before_the_send_is_seen_by_the_receiver() {
    const N: usize = 16 << 20; // 64 MiB of f32
    let q: Queue<Tensor> = Queue::new().unwrap();
    let ready: Queue<bool> = Queue::new().unwrap();
    let mut ctx = spawn(
        |_rank, (q, ready): (Queue<Tensor>, Queue<bool>)| {
            // Start CUDA before the sender's writes, so the read below follows the get at once.
            Tensor::zeros_on(&[1], DType::F32, GPU).unwrap();
            for round in 0..3 {
                ready.put(true).unwrap();
                let t = q.get().unwrap();
                let last = t.narrow(0, N - 1, 1).unwrap().to_vec::<f32>().unwrap();
                assert_eq!(last, [1000.0 + round as f32], "round {round}: the last element");
                let all = t.to_vec::<f32>().unwrap();
                let bad = all.iter().position(|v| *v != 1000.0 + round as f32);
                assert_eq!(bad, None, "round {round}: an element the sender's last fill had not reached");
            }
        },
        (q.clone(), ready.clone()),
        1,
    )
    .unwrap();
    let same = Tensor::empty_on(&[N], DType::F32, GPU).unwrap();
    for round in 0..3 {
        assert!(ready.get_timeout(WAIT).unwrap());
        // A fresh tensor in round 1, the same one again in rounds 0 and 2.
        let mut t = if round == 1 { Tensor::empty_on(&[N], DType::F32, GPU).unwrap() } else { same.clone() };
        for i in 0..200 {
            t.fill(i as f32).unwrap();
        }
        t.fill(1000.0 + round as f32).unwrap();
        q.put(t).unwrap();
    }
    assert_eq!(ctx.join(None), Ok(true));
}

/// 10,000 CUDA tensors sent to a worker and back, fresh ones of three sizes and one sent
/// again and again: once warm, neither process's descriptor count nor its mapping count
/// grows (read every 1,000 messages; a queue's send description is renewed every 64
/// messages, and arenas come and go, so a count may move by one or two between readings), and every tensor
/// arrives with its contents.
fn counts_stay_flat_over_ten_thousand_messages() {
    const MESSAGES: usize = 10_000;
    const EVERY: usize = 1_000;
    let counts = || [common::open_fds(), common::mappings()];
    let to: Queue<Tensor> = Queue::new().unwrap();
    let back: Queue<Tensor> = Queue::new().unwrap();
    let report: Queue<Vec<[usize; 2]>> = Queue::new().unwrap();
    let mut ctx = spawn(
        |_rank, (to, back, report): (Queue<Tensor>, Queue<Tensor>, Queue<Vec<[usize; 2]>>)| {
            let counts = || [common::open_fds(), common::mappings()];
            let mut seen = Vec::new();
            for i in 1..=MESSAGES {
                let t = to.get().unwrap();
                back.put(t).unwrap();
                if i % EVERY == 0 {
                    seen.push(counts());
                }
            }
            report.put(seen).unwrap();
        },
        (to.clone(), back.clone(), report.clone()),
        1,
    )
    .unwrap();
    let same = Tensor::full(&[1024], 7i32).to_device(GPU).unwrap();
    let mut seen = Vec::new();
    for i in 1..=MESSAGES {
        let t = match i % 4 {
            0 => same.clone(),
            k => {
                let mut t = Tensor::empty_on(&[1 << (8 + 4 * k)], DType::I32, GPU).unwrap();
                t.fill(i as i32).unwrap();
                t
            }
        };
        to.put(t).unwrap();
        let r = back.get_timeout(WAIT).unwrap();
        let want = if i % 4 == 0 { 7 } else { i as i32 };
        assert_eq!(r.narrow(0, 0, 1).unwrap().to_vec::<i32>().unwrap(), [want], "message {i}");
        drop(r);
        if i % EVERY == 0 {
            seen.push(counts());
        }
    }
    let child = report.get_timeout(WAIT).unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    eprintln!("(descriptors, mappings) every {EVERY} messages: sender {seen:?}, receiver {child:?}");
    for (who, seen) in [("sender", &seen), ("receiver", &child)] {
        // From the first reading on (the first 1,000 messages warm the caches up).
        for c in &seen[1..] {
            assert!(
                c[0] <= seen[0][0] + 2 && c[1] <= seen[0][1] + 2,
                "the {who}'s descriptors or mappings grew: {seen:?}"
            );
        }
    }
}

/// Every one-bit change of a CUDA message, and the message with its descriptors in the
/// wrong order, decoded by processes of their own (the eight changes of each byte in one):
/// each decodes to tensors that read back in bounds, or is refused; no change ends the
/// receiver with a signal (the bytes reach the driver: handles, sizes, ids). The message
/// itself decodes to what was sent. The creator stays alive meanwhile.
fn every_bit_of_a_cuda_message() {
    let q: Queue<RawMessage> = Queue::new().unwrap();
    let done: Queue<bool> = Queue::new().unwrap();
    let mut creator = spawn(
        |_rank, (q, done): (Queue<RawMessage>, Queue<bool>)| {
            q.put(two_views_message()).unwrap();
            done.get().unwrap();
        },
        (q.clone(), done.clone()),
        1,
    )
    .unwrap();
    let (bytes, fds) = q.get_timeout(WAIT).unwrap();
    {
        let (x, col): (Tensor, Tensor) = raw::decode(&bytes, owned(&fds)).unwrap();
        assert_eq!(col.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 5.0, 6.0, 9.0, 10.0]);
        assert!(x.storage().ptr_eq(col.storage()));
    }
    let tally: Queue<(usize, usize)> = Queue::new().unwrap();
    let mut failed = Vec::new();
    for at in 0..=bytes.len() {
        let mut ctx = spawn(
            |_rank, ((bytes, fds), at, tally): (RawMessage, usize, Queue<(usize, usize)>)| {
                let variants: Vec<(Vec<u8>, Vec<std::os::fd::OwnedFd>)> = if at == bytes.len() {
                    let mut swapped = owned(&fds);
                    swapped.reverse();
                    vec![(bytes, swapped)]
                } else {
                    (0..8)
                        .map(|bit| {
                            let mut b = bytes.clone();
                            b[at] ^= 1 << bit;
                            (b, owned(&fds))
                        })
                        .collect()
                };
                let (mut ok, mut refused) = (0, 0);
                for (b, f) in variants {
                    match raw::decode::<(Tensor, Tensor)>(&b, f) {
                        Ok((x, col)) => {
                            let n =
                                x.to_bytes().map_or(0, |v| v.len()) + col.to_bytes().map_or(0, |v| v.len());
                            assert!(n <= 2 * 48, "{n} bytes read back");
                            ok += 1;
                        }
                        Err(_) => refused += 1,
                    }
                }
                tally.put((ok, refused)).unwrap();
            },
            ((bytes.clone(), fds.clone()), at, tally.clone()),
            1,
        )
        .unwrap();
        if let Err(e) = ctx.join(None) {
            failed.push(format!("byte {at}: {e}"));
        }
    }
    done.put(true).unwrap();
    assert_eq!(creator.join(None), Ok(true));
    assert!(
        failed.is_empty(),
        "{} of {} changes failed: {failed:#?}\nmessage: {bytes:02x?}",
        failed.len(),
        bytes.len() + 1
    );
    let (mut ok, mut refused) = (0, 0);
    for _ in 0..=bytes.len() {
        let (o, r) = tally.get_timeout(WAIT).unwrap();
        ok += o;
        refused += r;
    }
    assert_eq!(ok + refused, 8 * bytes.len() + 1);
    assert!(refused > 0, "no change of the message was refused ({ok} decoded)");
    eprintln!("every bit of a {}-byte CUDA message: {ok} decoded in bounds, {refused} refused", bytes.len());
}

/// torch refuses to send a received CUDA tensor on. Here a worker relays what it got to a
/// third process, which writes it; the creator sees the write, and its memory is freed only
/// after both holders are done.
fn a_received_tensor_is_relayed_to_a_third_process() {
    let to_b: Queue<Tensor> = Queue::new().unwrap();
    let to_c: Queue<Tensor> = Queue::new().unwrap();
    let mut ctx = spawn(
        |rank, (to_b, to_c): (Queue<Tensor>, Queue<Tensor>)| {
            if rank == 0 {
                let t = to_b.get().unwrap();
                to_c.put(t).unwrap(); // and drops its own hold at once
            } else {
                let mut t = to_c.get().unwrap();
                assert_eq!(t.to_vec::<i64>().unwrap(), vec![5; 10]);
                t.fill(6i64).unwrap();
                cuda::synchronize(Device::Cuda(0)).unwrap();
            }
        },
        (to_b.clone(), to_c.clone()),
        2,
    )
    .unwrap();
    let t = Tensor::full(&[10], 5i64).to_device(GPU).unwrap();
    to_b.put(t.clone()).unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    assert_eq!(t.to_vec::<i64>().unwrap(), vec![6; 10]);
    drop(t);
    assert_eq!(cuda::memory_stats().allocated, 0, "both holders are gone: freed at the drop");
}

/// Offsets, strides and a transposed view arrive as views of one storage.
fn views_and_offsets_survive_the_trip() {
    let x = cuda_tensor((0..24).map(|v| v as f32).collect(), &[4, 6]);
    let views = vec![x.clone(), x.narrow(1, 2, 3).unwrap(), x.t().unwrap(), x.select(0, 3).unwrap()];
    let r = common::round_trip(views.clone());
    for (a, b) in r.iter().zip(&views) {
        assert_eq!(a.shape(), b.shape());
        assert_eq!(a.strides(), b.strides());
        assert_eq!(a.storage_offset(), b.storage_offset());
        assert_eq!(a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        assert!(a.storage().ptr_eq(x.storage()));
    }
    let c = r[2].contiguous().unwrap();
    assert!(c.is_contiguous() && c.device() == GPU);
    assert_eq!(c.to_vec::<f32>().unwrap(), x.t().unwrap().to_vec::<f32>().unwrap());
}

/// Without the `cuda` layer present (no GPU, no simulation), every CUDA call is an error
/// that says why, never a panic.
#[test]
fn without_a_gpu_cuda_calls_are_clear_errors() {
    common::isolated_with(
        |_rank, ()| {
            std::env::set_var(cuda::DRIVER_ENV, "cuda");
            match cuda::device_count() {
                Ok(n) if n > 0 => eprintln!("this machine has {n} CUDA device(s): nothing to check here"),
                Ok(_) | Err(_) => {
                    let e = Tensor::zeros_on(&[4], DType::F32, Device::Cuda(0)).unwrap_err();
                    assert!(matches!(e, Error::Device(_)), "{e:?}");
                    let e = Tensor::zeros(&[4], DType::F32).to_device(Device::Cuda(0)).unwrap_err();
                    assert!(matches!(e, Error::Device(_)), "{e:?}");
                    assert!(Event::new(Device::Cuda(0)).is_err());
                    assert!(!cuda::is_available());
                }
            }
        },
        (),
    );
}

/// A bad driver name is a parse error, and a device that does not exist is a device error.
#[test]
fn bad_driver_names_and_devices_are_errors() {
    common::isolated_with(
        |_rank, ()| {
            std::env::set_var(cuda::DRIVER_ENV, "simulated:3");
            assert_eq!(cuda::device_count().unwrap(), 3);
            assert_eq!(cuda::driver_name().unwrap(), "simulated");
            let e = Tensor::zeros_on(&[4], DType::F32, Device::Cuda(3)).unwrap_err();
            assert!(e.to_string().contains("cuda:3 does not exist"), "{e}");
        },
        (),
    );
    common::isolated_with(
        |_rank, ()| {
            std::env::set_var(cuda::DRIVER_ENV, "quantum");
            let e = cuda::device_count().unwrap_err();
            assert!(e.to_string().contains("expected `cuda`, `cuda-legacy-ipc`, `simulated`"), "{e}");
        },
        (),
    );
}

/// torch's test_event_handle_multi_gpu: events of two devices keep their device through a
/// queue, and a handle named with the wrong device is refused where that is known.
fn test_event_handle_multi_gpu() {
    if cuda::device_count().unwrap() < 2 {
        return eprintln!("skipped: fewer than two CUDA devices");
    }
    let (e0, e1) = (Event::new(Device::Cuda(0)).unwrap(), Event::new(Device::Cuda(1)).unwrap());
    e0.record().unwrap();
    e1.record().unwrap();
    let q: Queue<Vec<EventHandle>> = Queue::new().unwrap();
    q.put(vec![e0.handle(), e1.handle()]).unwrap();
    let mut ctx = spawn(
        |_rank, q: Queue<Vec<EventHandle>>| {
            // SAFETY: the parent's events' handles, unchanged (this test sent them).
            let evs: Vec<Event> = q.get().unwrap().iter().map(|h| unsafe { h.open() }.unwrap()).collect();
            assert_eq!(evs[0].device(), Device::Cuda(0));
            assert_eq!(evs[1].device(), Device::Cuda(1));
            for e in &evs {
                e.synchronize().unwrap();
            }
        },
        q.clone(),
        1,
    )
    .unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    // SAFETY: this process's own event's handle.
    let err = unsafe { Event::from_ipc_handle(Device::Cuda(1), e0.ipc_handle()) }.unwrap_err();
    assert!(err.to_string().contains("an event of cuda:0 arrived as an event of cuda:1"), "{err}");
}

/// A CUDA tensor's message, as bytes and descriptors, for decoding by hand.
type RawMessage = (Vec<u8>, Vec<SharedFd>);

/// The message of a 3×4 CUDA tensor of 0..12 and its columns 1..3, made by a worker for the
/// decoding tests.
fn two_views_message() -> RawMessage {
    let x = Tensor::from_vec((0..12).map(|v| v as f32).collect(), &[3, 4])
        .unwrap()
        .to_device(Device::Cuda(0))
        .unwrap();
    let (bytes, fds) = raw::encode(&(x.clone(), x.narrow(1, 1, 2).unwrap())).unwrap();
    // The allocation and its lease, whatever the number of views.
    assert_eq!(fds.len(), fds_per_allocation());
    (bytes, fds.into_iter().map(SharedFd::new).collect())
}

/// Descriptors of a message's own, for one decode of it.
fn owned(fds: &[SharedFd]) -> Vec<std::os::fd::OwnedFd> {
    use std::os::fd::AsFd;
    fds.iter().map(|f| f.as_fd().try_clone_to_owned().unwrap()).collect()
}

/// torch's test_rebuild_cuda_tensor, and the decoder against damaged CUDA messages: a
/// worker encodes CUDA tensors and hands over the bare message; this process rebuilds the
/// tensors from it, then decodes mutated copies (flipped bytes, cut lengths, descriptors
/// swapped or missing), each of which must give a value that reads back in bounds or an
/// error, never a panic.
fn test_rebuild_cuda_tensor() {
    let q: Queue<RawMessage> = Queue::new().unwrap();
    let done: Queue<bool> = Queue::new().unwrap();
    let mut ctx = spawn(
        |_rank, (q, done): (Queue<RawMessage>, Queue<bool>)| {
            q.put(two_views_message()).unwrap();
            if legacy_ipc() {
                // A legacy IPC allocation dies with its creator: stay until the parent is done.
                done.get().unwrap();
            }
        },
        (q.clone(), done.clone()),
        1,
    )
    .unwrap();
    let (bytes, fds) = q.get().unwrap();
    if !legacy_ipc() {
        // The message is self-contained: its creator may be gone.
        assert_eq!(ctx.join(None), Ok(true));
    }
    let (x, col): (Tensor, Tensor) = raw::decode(&bytes, owned(&fds)).unwrap();
    assert_eq!(x.device(), GPU);
    assert!(x.storage().ptr_eq(col.storage()));
    assert_eq!(col.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 5.0, 6.0, 9.0, 10.0]);
    drop((x, col));

    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let (mut ok, mut err) = (0, 0);
    for case in 0..400 {
        let mut b = bytes.clone();
        let mut f = owned(&fds);
        match case % 4 {
            0 => {
                let i = next() as usize % b.len();
                b[i] ^= 1 << (next() % 8);
            }
            1 => b.truncate(next() as usize % b.len()),
            2 => f.reverse(),
            _ => {
                f.remove(next() as usize % f.len());
            }
        }
        match raw::decode::<(Tensor, Tensor)>(&b, f) {
            Ok((x, col)) => {
                let n =
                    x.to_bytes().map(|v| v.len()).unwrap_or(0) + col.to_bytes().map(|v| v.len()).unwrap_or(0);
                assert!(n <= 2 * 48);
                ok += 1;
            }
            Err(_) => err += 1,
        }
    }
    assert!(err > 0 && ok + err == 400, "{ok} decoded, {err} refused");
    if legacy_ipc() {
        done.put(true).unwrap();
        assert_eq!(ctx.join(None), Ok(true));
    }
}

/// A legacy IPC memory handle is opened only by a process that consented to them
/// (`cuda-legacy-ipc`): the driver opens one without checking it. A worker that shares
/// them sends one to this process, which refuses it with a clear error.
fn a_legacy_handle_is_refused_without_consent() {
    if std::env::var(cuda::DRIVER_ENV).ok().as_deref() != Some("cuda") {
        return eprintln!("skipped: needs the CUDA driver without legacy handles in this process");
    }
    let q: Queue<Tensor> = Queue::new().unwrap();
    let done: Queue<bool> = Queue::new().unwrap();
    let mut ctx = spawn(
        |_rank, (q, done): (Queue<Tensor>, Queue<bool>)| {
            // The worker has made no CUDA call yet: it chooses its own device layer.
            std::env::set_var(cuda::DRIVER_ENV, "cuda-legacy-ipc");
            q.put(Tensor::full(&[4], 1.0f32).to_device(Device::Cuda(0)).unwrap()).unwrap();
            done.get().unwrap();
        },
        (q.clone(), done.clone()),
        1,
    )
    .unwrap();
    let err = q.get_timeout(WAIT).unwrap_err();
    assert!(err.to_string().contains("legacy CUDA IPC memory handle arrived"), "{err}");
    done.put(true).unwrap();
    assert_eq!(ctx.join(None), Ok(true));
}

/// A freed allocation is reused for the next tensor of its size, under a new identity: a
/// receiver that held the old tensor maps the new one afresh and sees its new contents.
fn a_reused_allocation_is_a_new_one_to_receivers() {
    let q: Queue<Tensor> = Queue::new().unwrap();
    let back: Queue<Vec<f32>> = Queue::new().unwrap();
    let mut ctx = spawn(
        |_rank, (q, back): (Queue<Tensor>, Queue<Vec<f32>>)| {
            for _ in 0..2 {
                let t = q.get().unwrap();
                let v = t.to_vec::<f32>().unwrap();
                drop(t); // closes this process's hold before the reply
                back.put(v).unwrap();
            }
        },
        (q.clone(), back.clone()),
        1,
    )
    .unwrap();
    let first = Tensor::full(&[4096], 1.0f32).to_device(GPU).unwrap();
    let ptr = first.device_ptr().unwrap();
    q.put(first).unwrap(); // our own handle goes with it
    assert_eq!(back.get().unwrap(), vec![1.0; 4096]);
    // The worker dropped it before replying: its hold is closed, the allocation is free.
    assert!(cuda::collect() >= 4 * 4096);
    assert!(cuda::memory_stats().cached >= 4 * 4096);
    let second = Tensor::full(&[4096], 2.0f32).to_device(GPU).unwrap();
    assert_eq!(second.device_ptr().unwrap(), ptr, "the free allocation is reused");
    q.put(second).unwrap();
    assert_eq!(back.get().unwrap(), vec![2.0; 4096]);
    assert_eq!(ctx.join(None), Ok(true));
}

/// A tensor whose creator dropped its own handles comes back as the creator's allocation
/// (not an import of it), and only with a genuine hold: a message naming it with a forged
/// lease is refused, since that lease would be kept and sent on as other holders' hold.
fn an_allocation_coming_back_to_its_creator_is_checked() {
    let t = Tensor::full(&[256], 3.0f32).to_device(GPU).unwrap();
    let (bytes, fds) = raw::encode(&t).unwrap();
    drop(t);
    assert_eq!(cuda::memory_stats().held_allocations, 1, "the unsent message holds it");
    assert_eq!(fds.len(), fds_per_allocation(), "memory handle and lease");
    let (_other_read, other_write) = rustix::pipe::pipe().unwrap();
    let mut forged: Vec<_> = fds.iter().map(|f| f.try_clone().unwrap()).collect();
    *forged.last_mut().unwrap() = other_write;
    let err = raw::decode::<Tensor>(&bytes, forged).unwrap_err();
    assert!(matches!(err, Error::InvalidMessage(_)), "{err:?}");
    assert!(err.to_string().contains("lease that is not its own"), "{err}");
    let back: Tensor = raw::decode(&bytes, fds).unwrap();
    assert_eq!(back.to_vec::<f32>().unwrap(), vec![3.0; 256]);
    assert_eq!(cuda::memory_stats().held_allocations, 0, "in use here again");
    drop(back);
    // No message is left that could hold it: freed at the drop, or by the next collect.
    cuda::collect();
    assert_eq!(cuda::memory_stats().allocated, 0);
}

/// `fill` (device memsets of 1, 2 and 4 bytes, a host copy for 8), `zeros_on`, and copies
/// to and from the host, on odd lengths and on a view in the middle of an allocation.
fn fills_and_copies_of_every_element_size() {
    let u8s = Tensor::zeros_on(&[7], DType::U8, GPU).unwrap();
    u8s.narrow(0, 2, 3).unwrap().fill(0xabu8).unwrap();
    assert_eq!(u8s.to_vec::<u8>().unwrap(), vec![0, 0, 0xab, 0xab, 0xab, 0, 0]);
    let mut i16s = Tensor::zeros_on(&[1001], DType::I16, GPU).unwrap();
    i16s.fill(-2i16).unwrap();
    assert_eq!(i16s.to_vec::<i16>().unwrap(), vec![-2; 1001]);
    let mut f32s = Tensor::empty_on(&[3, 333], DType::F32, GPU).unwrap();
    f32s.fill(0.25f32).unwrap();
    f32s.select(0, 1).unwrap().fill(-1.0f32).unwrap();
    let v = f32s.to_vec::<f32>().unwrap();
    assert!(v[..333].iter().chain(&v[666..]).all(|x| *x == 0.25) && v[333..666].iter().all(|x| *x == -1.0));
    let i64s = Tensor::from_vec((0..9i64).collect(), &[9]).unwrap().to_device(GPU).unwrap();
    i64s.narrow(0, 4, 5).unwrap().fill(i64::MIN).unwrap();
    assert_eq!(
        i64s.to_vec::<i64>().unwrap(),
        [0, 1, 2, 3].into_iter().chain([i64::MIN; 5]).collect::<Vec<_>>()
    );
    // A strided view cannot be filled on the device (there are no kernels): an error.
    assert!(matches!(f32s.t().unwrap().fill(1.0f32), Err(Error::NotContiguous { .. })));
    // Host and device copies agree, through a second device too.
    let host = Tensor::from_vec((0..12).map(|v| v as f32 * 0.5).collect(), &[3, 4]).unwrap();
    let there = host.t().unwrap().to_device(GPU).unwrap();
    assert!(there.is_contiguous());
    assert!(there.to_cpu().unwrap().equal(&host.t().unwrap().contiguous().unwrap()));
    if cuda::device_count().unwrap() > 1 {
        let other = there.to_device(Device::Cuda(1)).unwrap();
        assert_eq!(other.device(), Device::Cuda(1));
        assert!(!other.equal(&there), "tensors on two devices are not equal");
        assert!(other.to_cpu().unwrap().equal(&there.to_cpu().unwrap()));
    }
}
