//! burn's `TensorData` (feature `burn`): copies both ways for every dtype, the zero-copy
//! hand-over of an exclusive tensor, the unsafe aliasing export (burn copies before it
//! writes; the hold is given back), and a tensor received from another process read by burn
//! in place.
#![cfg(feature = "burn")]

use tensorshare::interop::burn::burn_backend::{DType as BDType, TensorData};
use tensorshare::interop::burn::{from_burn, into_burn, to_burn, to_burn_aliased};
use tensorshare::{spawn, DType, Error, Queue, SharingStrategy, Tensor};

tensorshare::enable_test_workers!();

#[macro_use]
mod common;

/// A tensor of `shape` whose bytes follow a pattern (0 and 1 for bool).
fn sample(dtype: DType, shape: &[usize]) -> Tensor {
    let t = Tensor::zeros(shape, dtype);
    let n = t.storage().len();
    let bytes: Vec<u8> =
        (0..n).map(|i| if dtype == DType::Bool { (i % 3 == 1) as u8 } else { (i * 37 + 11) as u8 }).collect();
    Tensor::from_storage(t.storage().clone(), DType::U8, &[n], &[1], 0)
        .unwrap()
        .copy_from_slice(&bytes)
        .unwrap();
    t
}

fn element_ptr(t: &Tensor) -> usize {
    t.storage().data_ptr() + t.storage_offset() * t.dtype().size()
}

const ALL: [(DType, BDType); 10] = [
    (DType::Bool, BDType::Bool),
    (DType::U8, BDType::U8),
    (DType::I8, BDType::I8),
    (DType::I16, BDType::I16),
    (DType::I32, BDType::I32),
    (DType::I64, BDType::I64),
    (DType::F16, BDType::F16),
    (DType::BF16, BDType::BF16),
    (DType::F32, BDType::F32),
    (DType::F64, BDType::F64),
];

#[test]
fn every_dtype_round_trips_through_copies() {
    for (dtype, bdtype) in ALL {
        let t = sample(dtype, &[3, 4]);
        let data = to_burn(&t).unwrap();
        assert_eq!((data.dtype, &data.shape[..]), (bdtype, &[3, 4][..]), "{dtype}");
        assert_eq!(data.as_bytes(), &t.to_bytes().unwrap()[..], "{dtype}");
        assert_ne!(data.as_bytes().as_ptr() as usize, t.storage().data_ptr(), "{dtype}: a copy");
        let back = from_burn(&data).unwrap();
        assert!(back.equal(&t) && back.is_shared() && back.is_contiguous(), "{dtype}");
        assert_ne!(back.storage().data_ptr(), data.as_bytes().as_ptr() as usize, "{dtype}: a copy back");
    }
}

#[test]
fn strided_views_are_copied_in_logical_order() {
    let base = Tensor::from_vec((0..24).collect::<Vec<i32>>(), &[4, 6]).unwrap();
    for view in [base.t().unwrap(), base.narrow(1, 2, 3).unwrap(), base.select(1, 5).unwrap()] {
        let data = to_burn(&view).unwrap();
        assert_eq!(data.shape, view.shape());
        assert_eq!(data.to_vec::<i32>().unwrap(), view.to_vec::<i32>().unwrap());
        // SAFETY: nothing writes `base` while the TensorData would live.
        let refused = unsafe { to_burn_aliased(&view) };
        if !view.is_contiguous() {
            assert!(matches!(refused, Err(Error::NotContiguous { .. })));
        }
    }
}

#[test]
fn an_exclusive_tensor_is_handed_over_without_a_copy_and_any_other_is_copied() {
    for (dtype, _) in ALL {
        let t = sample(dtype, &[5]);
        let (at, bytes) = (t.storage().data_ptr(), t.to_bytes().unwrap());
        let data = into_burn(t).unwrap();
        assert_eq!(data.as_bytes().as_ptr() as usize, at, "{dtype}: burn owns the very bytes");
        assert_eq!(data.as_bytes(), &bytes[..]);
    }
    let t = Tensor::from_vec(vec![1.0f32, 2.0], &[2]).unwrap();
    let other = t.clone();
    let data = into_burn(t).unwrap();
    assert_ne!(data.as_bytes().as_ptr() as usize, other.storage().data_ptr(), "another handle: a copy");
    let mut shared = Tensor::from_vec(vec![1u8, 2], &[2]).unwrap();
    shared.share_memory().unwrap();
    let at = shared.storage().data_ptr();
    assert_ne!(into_burn(shared).unwrap().as_bytes().as_ptr() as usize, at, "shared memory: a copy");
}

#[test]
fn the_aliased_export_reads_in_place_copies_before_writing_and_gives_the_hold_back() {
    let mut t = Tensor::zeros_shared(&[2, 8], DType::F32).unwrap();
    t.copy_from_slice(&(0..16).map(|v| v as f32).collect::<Vec<_>>()).unwrap();
    let row = t.select(0, 1).unwrap();
    assert_eq!(t.storage().handle_count(), 2);
    // SAFETY: nothing writes `t` while the TensorData and its clone live (the writes below
    // happen after both are gone).
    let mut data = unsafe { to_burn_aliased(&row) }.unwrap();
    assert_eq!(data.as_bytes().as_ptr() as usize, element_ptr(&row), "no copy");
    assert_eq!(data.to_vec::<f32>().unwrap(), (8..16).map(|v| v as f32).collect::<Vec<_>>());
    let copy = data.clone();
    assert_eq!(t.storage().handle_count(), 3, "burn holds a clone of the tensor");
    // burn's write goes to a copy of its own: the shared memory keeps its values.
    data.as_mut_slice::<f32>().unwrap()[0] = -5.0;
    assert_ne!(data.as_bytes().as_ptr() as usize, element_ptr(&row));
    assert_eq!(row.to_vec::<f32>().unwrap()[0], 8.0);
    assert_eq!(copy.to_vec::<f32>().unwrap()[0], 8.0);
    drop(data);
    assert_eq!(t.storage().handle_count(), 3, "the clone still reads the tensor's bytes");
    drop(copy);
    assert_eq!(t.storage().handle_count(), 2, "burn let go");
    t.fill(1.0f32).unwrap();
}

#[test]
fn bad_input_is_a_clear_error() {
    let bytes = Tensor::from_vec(vec![1u8, 7, 0], &[3]).unwrap();
    let bools = Tensor::from_storage(bytes.storage().clone(), DType::Bool, &[3], &[1], 0).unwrap();
    // SAFETY: nothing writes the storage while the TensorData would live.
    let e = unsafe { to_burn_aliased(&bools) }.unwrap_err();
    assert!(matches!(e, Error::InvalidValue { dtype: DType::Bool, .. }), "{e}");
    assert!(to_burn(&bools).is_err());

    let u32s = TensorData::new(vec![1u32, 2], [2]);
    let e = from_burn(&u32s).unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)) && e.to_string().contains("U32"), "{e}");
    let short = TensorData::from_bytes_vec(vec![0u8; 6], [2, 2], BDType::F32);
    assert!(matches!(from_burn(&short), Err(Error::Shape { .. })));
    let bad_bool = TensorData::from_bytes_vec(vec![0, 3], [2], BDType::Bool);
    assert!(matches!(from_burn(&bad_bool), Err(Error::InvalidValue { .. })));
    let meta = Tensor::meta(&[2], DType::F32);
    assert!(matches!(to_burn(&meta), Err(Error::Device(_))));
    // SAFETY: refused before anything is borrowed.
    assert!(matches!(unsafe { to_burn_aliased(&meta) }, Err(Error::Device(_))));
}

mod between_processes {
    use tensorshare::SharingStrategy;
    #[test]
    fn file_descriptor() {
        crate::checked!(
            super::burn_reads_a_received_tensor_in_place,
            SharingStrategy::FileDescriptor,
            SharingStrategy
        );
    }
    #[test]
    fn file_system() {
        crate::checked!(
            super::burn_reads_a_received_tensor_in_place,
            SharingStrategy::FileSystem,
            SharingStrategy
        );
    }
}

/// A worker makes a tensor and sends it; the parent hands the received tensor to burn
/// without a copy (the worker writes nothing after sending): burn reads the worker's values
/// in the pages the parent mapped, and dropping the TensorData gives the hold back.
fn burn_reads_a_received_tensor_in_place(s: SharingStrategy) {
    let q: Queue<Tensor> = Queue::new().unwrap();
    let mut ctx = spawn(
        |_rank, (q, s): (Queue<Tensor>, SharingStrategy)| {
            let mut t = Tensor::empty_shared_with(&[3, 4], DType::I64, s).unwrap();
            t.copy_from_slice(&(0..12).map(|v| v * v).collect::<Vec<i64>>()).unwrap();
            q.put(t.narrow(0, 1, 2).unwrap()).unwrap();
        },
        (q.clone(), s),
        1,
    )
    .unwrap();
    let t = q.get().unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    let before = t.storage().handle_count();
    // SAFETY: the worker wrote before sending and has exited; nothing in this process writes
    // the tensor while the TensorData lives.
    let data = unsafe { to_burn_aliased(&t) }.unwrap();
    assert_eq!(data.as_bytes().as_ptr() as usize, element_ptr(&t), "burn reads the received pages");
    assert_eq!(data.to_vec::<i64>().unwrap(), (4..12).map(|v| v * v).collect::<Vec<i64>>());
    assert_eq!(t.storage().handle_count(), before + 1);
    drop(data);
    assert_eq!(t.storage().handle_count(), before);
}
