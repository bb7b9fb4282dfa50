//! Pinned (page-locked) host memory for CUDA copies: a storage's whole arena registered
//! once, copies to a device straight from it, and the registration undone when the arena
//! goes, in the process that pinned it and in one that received the storage.
//!
//! Every body runs on the simulated device, and on the CUDA driver when this machine has a
//! GPU (otherwise that test prints why it is skipped).
#![cfg(feature = "cuda")]

use tensorshare::cuda::{self, pinned_bytes};
use tensorshare::{spawn, DType, Device, Error, Queue, Tensor};

tensorshare::enable_test_workers!();

mod common;

const GPU: Device = Device::Cuda(0);

/// Runs `$body` in a helper process of its own on the given device layer, under the leak
/// checker, and checks that nothing stays pinned once its tensors are gone.
macro_rules! on_driver {
    ($body:path, $driver:expr) => {
        crate::common::isolated_with(
            |_rank, driver: String| {
                std::env::set_var(tensorshare::cuda::DRIVER_ENV, &driver);
                match tensorshare::cuda::device_count() {
                    Ok(n) if n > 0 => {}
                    Ok(_) => return eprintln!("skipped on {driver}: no CUDA device"),
                    Err(e) => return eprintln!("skipped on {driver}: {e}"),
                }
                let lc = crate::common::LeakChecker::new();
                $body();
                tensorshare::trim_arenas();
                assert_eq!(tensorshare::cuda::pinned_bytes(), 0, "host memory left pinned");
                tensorshare::cuda::empty_cache();
                if driver != "cuda" {
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
            }
        )*
    };
}

each_driver!(
    pinning_registers_the_whole_arena_once,
    pinned_tensors_copy_to_the_device,
    what_cannot_be_pinned_says_why,
    a_receiver_pins_for_itself,
);

/// One registration per arena: a second storage of the arena is pinned with the first,
/// pinning again changes nothing, and letting the arena go unregisters it.
fn pinning_registers_the_whole_arena_once() {
    let mut t = Tensor::from_vec((0..1000).map(|v| v as f32).collect(), &[1000]).unwrap();
    assert!(!t.is_pinned());
    t.pin_memory().unwrap();
    assert!(t.is_pinned() && t.is_shared(), "pinned in place, in shared memory");
    assert_eq!(t.to_vec::<f32>().unwrap()[999], 999.0);
    let pinned = pinned_bytes();
    assert!(pinned >= 4000 && pinned % 4096 == 0, "whole pages of the arena: {pinned}");
    assert!(t.narrow(0, 10, 5).unwrap().is_pinned(), "views share the storage");
    // The next storage of the same size goes to the same arena: pinned already.
    let neighbour = Tensor::empty_shared(&[1000], DType::F32).unwrap();
    assert!(neighbour.is_pinned());
    t.pin_memory().unwrap();
    neighbour.storage().pin().unwrap();
    assert_eq!(pinned_bytes(), pinned, "one registration per arena");
    // Another size class is another arena.
    let mut small = Tensor::zeros(&[3], DType::I64);
    assert!(!small.is_pinned());
    small.pin_memory().unwrap();
    assert!(pinned_bytes() > pinned);
    // A large storage has an arena of its own.
    let mut large = Tensor::zeros(&[5 << 20], DType::U8);
    large.pin_memory().unwrap();
    assert!(pinned_bytes() >= pinned + (5 << 20));
    drop((t, neighbour, small, large));
    tensorshare::trim_arenas();
    assert_eq!(pinned_bytes(), 0, "the arenas went, and their registrations with them");
}

/// Copies to the device from pinned memory: contiguous views at any offset go straight
/// from the pages, others through a staging copy; both give the tensor's values.
fn pinned_tensors_copy_to_the_device() {
    let mut bytes = Tensor::from_vec((0..1021u32).map(|v| (v * 7) as u8).collect(), &[1021]).unwrap();
    bytes.pin_memory().unwrap();
    let odd = bytes.narrow(0, 3, 1001).unwrap();
    assert_eq!(odd.to_device(GPU).unwrap().to_vec::<u8>().unwrap(), odd.to_vec::<u8>().unwrap());
    let mut m = Tensor::from_vec((0..12).map(|v| v as f64).collect(), &[3, 4]).unwrap();
    m.pin_memory().unwrap();
    let row = m.select(0, 1).unwrap();
    assert_eq!(row.to_device(GPU).unwrap().to_vec::<f64>().unwrap(), vec![4.0, 5.0, 6.0, 7.0]);
    let mt = m.t().unwrap();
    let on_device = mt.to_device(GPU).unwrap();
    assert_eq!(on_device.to_vec::<f64>().unwrap(), mt.to_vec::<f64>().unwrap());
    let empty = Tensor::zeros(&[0, 4], DType::F32);
    assert_eq!(empty.to_device(GPU).unwrap().numel(), 0);
    cuda::synchronize(GPU).unwrap();
}

/// Device, meta and empty tensors.
fn what_cannot_be_pinned_says_why() {
    let mut on_device = Tensor::zeros_on(&[4], DType::F32, GPU).unwrap();
    assert!(matches!(on_device.pin_memory(), Err(Error::Device(_))));
    assert!(matches!(on_device.storage().pin(), Err(Error::Device(_))));
    assert!(!on_device.is_pinned());
    let mut meta = Tensor::meta(&[4], DType::F32);
    let e = meta.pin_memory().unwrap_err();
    assert!(e.to_string().contains("no host memory to pin"), "{e}");
    let mut empty = Tensor::zeros(&[0], DType::F32);
    empty.pin_memory().unwrap();
    assert!(!empty.is_pinned(), "no bytes, nothing pinned");
    assert_eq!(pinned_bytes(), 0);
}

/// Page-locking belongs to a process's mapping: a worker that receives a pinned tensor
/// pins it for itself, copies from it, and unregisters when it lets go.
fn a_receiver_pins_for_itself() {
    let mut t = Tensor::from_vec((0..4096i32).collect(), &[64, 64]).unwrap();
    t.pin_memory().unwrap();
    let q: Queue<Tensor> = Queue::new().unwrap();
    q.put(t.clone()).unwrap();
    let mut ctx = spawn(
        |_rank, q: Queue<Tensor>| {
            let mut t = q.get().unwrap();
            assert!(!t.is_pinned(), "not pinned in this process yet");
            t.pin_memory().unwrap();
            assert!(t.is_pinned() && pinned_bytes() > 0);
            let back = t.to_device(Device::Cuda(0)).unwrap().to_vec::<i32>().unwrap();
            assert_eq!(back, (0..4096).collect::<Vec<i32>>());
            drop(t);
            tensorshare::trim_arenas();
            assert_eq!(pinned_bytes(), 0, "unregistered when the arena went");
        },
        q.clone(),
        1,
    )
    .unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    assert!(t.is_pinned(), "the sender's registration is its own");
}
