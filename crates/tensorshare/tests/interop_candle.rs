//! candle (feature `candle`): copies both ways, every dtype both have, any layout, and a
//! clear error for the dtypes only one of them has.
#![cfg(feature = "candle")]

use tensorshare::interop::candle::candle_core::{self, DType as CDType, Device as CDevice};
use tensorshare::interop::candle::{from_candle, to_candle};
use tensorshare::{spawn, DType, Error, Queue, SharingStrategy, Tensor};

tensorshare::enable_test_workers!();

#[macro_use]
mod common;

/// A tensor of `shape` whose bytes follow a pattern.
fn sample(dtype: DType, shape: &[usize]) -> Tensor {
    let t = Tensor::zeros(shape, dtype);
    let n = t.storage().len();
    let bytes: Vec<u8> = (0..n).map(|i| (i * 37 + 11) as u8).collect();
    Tensor::from_storage(t.storage().clone(), DType::U8, &[n], &[1], 0)
        .unwrap()
        .copy_from_slice(&bytes)
        .unwrap();
    t
}

/// The address of the first byte of a candle CPU tensor's storage.
fn candle_ptr(c: &candle_core::Tensor) -> usize {
    let (storage, _) = c.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cpu(cpu) => match cpu {
            candle_core::CpuStorage::U8(v) => v.as_ptr() as usize,
            candle_core::CpuStorage::I16(v) => v.as_ptr() as usize,
            candle_core::CpuStorage::I32(v) => v.as_ptr() as usize,
            candle_core::CpuStorage::I64(v) => v.as_ptr() as usize,
            candle_core::CpuStorage::F16(v) => v.as_ptr() as usize,
            candle_core::CpuStorage::BF16(v) => v.as_ptr() as usize,
            candle_core::CpuStorage::F32(v) => v.as_ptr() as usize,
            candle_core::CpuStorage::F64(v) => v.as_ptr() as usize,
            _ => panic!("a dtype this test does not use"),
        },
        _ => panic!("not a CPU tensor"),
    }
}

#[test]
fn every_shared_dtype_round_trips_through_copies() {
    for (dtype, cdtype) in [
        (DType::U8, CDType::U8),
        (DType::I16, CDType::I16),
        (DType::I32, CDType::I32),
        (DType::I64, CDType::I64),
        (DType::F16, CDType::F16),
        (DType::BF16, CDType::BF16),
        (DType::F32, CDType::F32),
        (DType::F64, CDType::F64),
    ] {
        let mut t = sample(dtype, &[2, 3, 4]);
        t.share_memory().unwrap();
        let c = to_candle(&t).unwrap();
        assert_eq!((c.dtype(), c.dims()), (cdtype, &[2, 3, 4][..]), "{dtype}");
        assert_ne!(candle_ptr(&c), t.storage().data_ptr(), "{dtype}: candle owns a copy");
        let back = from_candle(&c).unwrap();
        assert!(back.equal(&t), "{dtype}: same values");
        assert!(back.is_shared() && back.is_contiguous(), "{dtype}");
        assert_ne!(back.storage().data_ptr(), candle_ptr(&c), "{dtype}: a copy back");
        assert_ne!(back.storage().data_ptr(), t.storage().data_ptr());
    }
}

#[test]
fn strided_views_are_copied_in_logical_order() {
    let base = Tensor::from_vec((0..24).map(|v| v as f32).collect(), &[4, 6]).unwrap();
    for view in [base.t().unwrap(), base.narrow(1, 2, 3).unwrap(), base.select(1, 5).unwrap()] {
        let c = to_candle(&view).unwrap();
        assert!(c.is_contiguous());
        assert_eq!(c.flatten_all().unwrap().to_vec1::<f32>().unwrap(), view.to_vec::<f32>().unwrap());
    }
    // candle's own views: a transpose, a narrowed one with a start offset, both strided.
    let c = candle_core::Tensor::arange(0i64, 24, &CDevice::Cpu).unwrap().reshape((4, 6)).unwrap();
    for cv in [c.t().unwrap(), c.narrow(1, 2, 3).unwrap(), c.narrow(0, 1, 2).unwrap().t().unwrap()] {
        let t = from_candle(&cv).unwrap();
        assert_eq!(t.shape(), cv.dims());
        assert!(t.is_contiguous());
        assert_eq!(t.to_vec::<i64>().unwrap(), cv.flatten_all().unwrap().to_vec1::<i64>().unwrap());
    }
    // A contiguous candle view with a start offset.
    let row = c.narrow(0, 2, 1).unwrap();
    assert_eq!(from_candle(&row).unwrap().to_vec::<i64>().unwrap(), (12..18).collect::<Vec<_>>());
}

#[test]
fn dtypes_only_one_side_has_are_refused() {
    for dtype in [DType::Bool, DType::I8] {
        let e = to_candle(&Tensor::zeros(&[2], dtype)).unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)) && e.to_string().contains(dtype.torch_name()), "{e}");
    }
    let u32s = candle_core::Tensor::new(&[1u32, 2, 3], &CDevice::Cpu).unwrap();
    let e = from_candle(&u32s).unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)) && e.to_string().contains("U32"), "{e}");
    let meta = Tensor::meta(&[2], DType::F32);
    assert!(matches!(to_candle(&meta), Err(Error::Device(_))));
}

#[test]
fn scalars_and_empty_tensors() {
    let s = Tensor::from_vec(vec![2.5f64], &[]).unwrap();
    let c = to_candle(&s).unwrap();
    assert_eq!(c.to_scalar::<f64>().unwrap(), 2.5);
    assert_eq!(from_candle(&c).unwrap().to_vec::<f64>().unwrap(), vec![2.5]);
    let e = Tensor::zeros(&[3, 0], DType::I32);
    let c = to_candle(&e).unwrap();
    assert_eq!(c.dims(), &[3, 0]);
    assert_eq!(from_candle(&c).unwrap().shape(), &[3, 0]);
}

mod between_processes {
    use tensorshare::SharingStrategy;
    #[test]
    fn file_descriptor() {
        crate::checked!(
            super::a_worker_sends_what_it_made_with_candle,
            SharingStrategy::FileDescriptor,
            SharingStrategy
        );
    }
    #[test]
    fn file_system() {
        crate::checked!(
            super::a_worker_sends_what_it_made_with_candle,
            SharingStrategy::FileSystem,
            SharingStrategy
        );
    }
}

/// A worker computes with candle and sends the result: `from_candle` lands in shared
/// memory, so the parent receives the worker's pages and sees the worker's later writes.
fn a_worker_sends_what_it_made_with_candle(s: SharingStrategy) {
    let q: Queue<Tensor> = Queue::new().unwrap();
    let done: Queue<()> = Queue::new().unwrap();
    let mut ctx = spawn(
        |_rank, (q, done, s): (Queue<Tensor>, Queue<()>, SharingStrategy)| {
            tensorshare::set_sharing_strategy(s).unwrap();
            let c = candle_core::Tensor::arange(0f32, 6., &CDevice::Cpu).unwrap();
            let c = (c * 2.0).unwrap().reshape((2, 3)).unwrap().t().unwrap();
            let mut t = from_candle(&c).unwrap();
            assert_eq!(t.storage().sharing_strategy(), Some(s));
            q.put(t.clone()).unwrap();
            done.get().unwrap(); // the parent has checked the values
            t.fill(-1.0f32).unwrap();
        },
        (q.clone(), done.clone(), s),
        1,
    )
    .unwrap();
    let t = q.get().unwrap();
    assert_eq!(t.shape(), &[3, 2]);
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![0.0, 6.0, 2.0, 8.0, 4.0, 10.0]);
    done.put(()).unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![-1.0; 6], "the worker's pages, not a copy");
}
