//! DLPack (feature `dlpack`): exports alias the tensor and hold it until the deleter runs,
//! tensorshare's own exports come back without a copy, any producer's tensor is copied in
//! (strides, offsets, every dtype), and what tensorshare lacks is a clear error.
#![cfg(feature = "dlpack")]

use std::ffi::c_void;

use tensorshare::interop::dlpack::dlpark::ffi::{DLDataType, DLDataTypeCode, DLDevice, DLDeviceType};
use tensorshare::interop::dlpack::dlpark::metadata::Dynamic;
use tensorshare::interop::dlpack::dlpark::versioned;
use tensorshare::interop::dlpack::{copy_from_dlpack, from_dlpack, to_dlpack, to_dlpack_legacy};
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

/// The address the descriptor's first element is at.
fn first_element(d: &versioned::Dlpack) -> usize {
    let v = d.validate().unwrap();
    v.data_ptr() as usize + v.byte_offset() as usize
}

fn element_ptr(t: &Tensor) -> usize {
    t.storage().data_ptr() + t.storage_offset() * t.dtype().size()
}

#[test]
fn every_dtype_is_exported_without_a_copy_and_copied_back() {
    let expected = [
        (DType::Bool, DLDataTypeCode::BOOL, 8),
        (DType::U8, DLDataTypeCode::UINT, 8),
        (DType::I8, DLDataTypeCode::INT, 8),
        (DType::I16, DLDataTypeCode::INT, 16),
        (DType::I32, DLDataTypeCode::INT, 32),
        (DType::I64, DLDataTypeCode::INT, 64),
        (DType::F16, DLDataTypeCode::FLOAT, 16),
        (DType::BF16, DLDataTypeCode::BFLOAT, 16),
        (DType::F32, DLDataTypeCode::FLOAT, 32),
        (DType::F64, DLDataTypeCode::FLOAT, 64),
    ];
    for (dtype, code, bits) in expected {
        let t = sample(dtype, &[3, 5]);
        let d = to_dlpack(&t).unwrap();
        let v = d.validate().unwrap();
        assert_eq!((v.dtype().code, v.dtype().bits, v.dtype().lanes), (code, bits, 1), "{dtype}");
        assert_eq!((v.shape(), v.strides()), (&[3i64, 5][..], Some(&[5i64, 1][..])));
        assert_eq!(v.device().device_type, DLDeviceType::CPU);
        assert_eq!(first_element(&d), element_ptr(&t), "{dtype}: the export aliases");

        let same = from_dlpack(&d).unwrap();
        assert!(same.storage().ptr_eq(t.storage()) && same.equal(&t), "{dtype}");
        // SAFETY: nothing writes `t` while the copy is made.
        let copy = unsafe { copy_from_dlpack(&d) }.unwrap();
        assert!(copy.equal(&t), "{dtype}: same values");
        assert!(copy.is_shared() && copy.is_contiguous());
        assert_ne!(copy.storage().data_ptr(), t.storage().data_ptr(), "{dtype}: a copy");
    }
}

#[test]
fn views_keep_their_strides_and_offset() {
    let base = sample(DType::I32, &[4, 6]);
    for view in [base.t().unwrap(), base.narrow(1, 2, 3).unwrap(), base.select(0, 3).unwrap()] {
        let d = to_dlpack(&view).unwrap();
        let v = d.validate().unwrap();
        let strides: Vec<i64> = view.strides().iter().map(|&s| s as i64).collect();
        assert_eq!(v.strides(), Some(&strides[..]));
        assert_eq!(v.byte_offset(), (view.storage_offset() * 4) as u64);
        assert_eq!(v.data_ptr() as usize, base.storage().data_ptr());
        // SAFETY: nothing writes `base` meanwhile.
        let copy = unsafe { copy_from_dlpack(&d) }.unwrap();
        assert!(copy.is_contiguous());
        assert_eq!(copy.to_vec::<i32>().unwrap(), view.to_vec::<i32>().unwrap());
        let back = from_dlpack(&d).unwrap();
        assert_eq!((back.strides(), back.storage_offset()), (view.strides(), view.storage_offset()));
    }
}

#[test]
fn the_deleter_releases_the_hold_and_a_private_tensor_is_shared_first() {
    let t = Tensor::from_vec(vec![1.0f64, 2.0], &[2]).unwrap();
    assert!(!t.is_shared());
    assert_eq!(t.storage().handle_count(), 1);
    let d = to_dlpack(&t).unwrap();
    assert!(t.is_shared(), "moved to shared memory so that every handle and process sees the export's bytes");
    assert_eq!(first_element(&d), t.storage().data_ptr());
    assert_eq!(t.storage().handle_count(), 2, "the export holds a clone");
    let legacy = to_dlpack_legacy(&t).unwrap();
    assert_eq!(t.storage().handle_count(), 3);
    assert_eq!(from_dlpack(&legacy).unwrap().to_vec::<f64>().unwrap(), vec![1.0, 2.0]);
    drop(d);
    assert_eq!(t.storage().handle_count(), 2);
    drop(legacy);
    assert_eq!(t.storage().handle_count(), 1, "every deleter let go");
}

#[test]
fn an_empty_tensor_has_null_data_and_meta_has_none() {
    let e = Tensor::zeros(&[2, 0], DType::F32);
    let d = to_dlpack(&e).unwrap();
    assert!(d.validate().unwrap().data_ptr().is_null());
    // SAFETY: no elements are read.
    let copy = unsafe { copy_from_dlpack(&d) }.unwrap();
    assert_eq!((copy.shape(), copy.dtype()), (&[2, 0][..], DType::F32));
    let meta = Tensor::meta(&[2], DType::F32);
    assert!(matches!(to_dlpack(&meta), Err(Error::Device(_))));
}

/// A DLPack tensor made by another producer: `data` (a boxed vector it keeps alive), any
/// dtype, shape, strides and byte offset.
fn foreign(
    data: Vec<u8>,
    dtype: DLDataType,
    device: DLDevice,
    shape: Vec<i64>,
    strides: Vec<i64>,
    byte_offset: u64,
) -> versioned::Dlpack {
    let data = Box::new(data);
    let ptr = data.as_ptr() as *mut c_void;
    let mut init = Dynamic::new(shape, strides).prepare().unwrap().initialize(data);
    init.set_data(ptr).set_device(device).set_dtype(dtype).set_byte_offset(byte_offset);
    // SAFETY: the descriptors built by the tests below address bytes of the boxed vector,
    // which the managed tensor owns until it is dropped.
    unsafe { init.finish() }
}

fn i16_bytes(v: &[i16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

#[test]
fn any_producers_tensor_is_copied_with_negative_and_zero_strides_and_an_odd_offset() {
    // Seven i16 values after one byte of padding: the data is not even 2-byte aligned.
    let mut bytes = vec![0xEE];
    bytes.extend(i16_bytes(&[0, 1, 2, 3, 4, 5, 6]));
    // A 2x3 view starting at value 6 with strides [-3, -1]: rows [6 5 4] and [3 2 1].
    let d = foreign(bytes.clone(), DLDataType::I16, DLDevice::CPU, vec![2, 3], vec![-3, -1], 1 + 12);
    assert!(matches!(from_dlpack(&d), Err(Error::Unsupported(_))), "not tensorshare's export");
    // SAFETY: the descriptor addresses values 1..=6 of the live vector, which nothing writes.
    let t = unsafe { copy_from_dlpack(&d) }.unwrap();
    assert_eq!(t.to_vec::<i16>().unwrap(), vec![6, 5, 4, 3, 2, 1]);
    assert!(t.is_shared());

    // Contiguous rows in reverse order: rows [3 4 5] and [0 1 2], copied a row at a time.
    let d = foreign(bytes.clone(), DLDataType::I16, DLDevice::CPU, vec![2, 3], vec![-3, 1], 1 + 6);
    // SAFETY: as above (values 0..=5).
    let t = unsafe { copy_from_dlpack(&d) }.unwrap();
    assert_eq!(t.to_vec::<i16>().unwrap(), vec![3, 4, 5, 0, 1, 2]);

    // A zero stride repeats a value; pinned host memory is host memory too.
    let host = DLDevice { device_type: DLDeviceType::CUDAHOST, device_id: 0 };
    let d = foreign(bytes.clone(), DLDataType::I16, host, vec![3, 2], vec![0, 2], 1 + 2);
    // SAFETY: as above (values 1 and 3).
    let t = unsafe { copy_from_dlpack(&d) }.unwrap();
    assert_eq!(t.to_vec::<i16>().unwrap(), vec![1, 3, 1, 3, 1, 3]);
}

#[test]
fn what_tensorshare_lacks_is_a_clear_error() {
    let cpu = DLDevice::CPU;
    for (dtype, name) in [
        (DLDataType::U32, "code 1, 32 bits"),
        (DLDataType::C64, "code 5, 64 bits"),
        (DLDataType::F8E4M3FN, "code 10, 8 bits"),
        (DLDataType::new(DLDataTypeCode::FLOAT, 32, 4), "4 lanes"),
    ] {
        let d = foreign(vec![0; 64], dtype, cpu, vec![2], vec![1], 0);
        // SAFETY: refused before any byte is read (and the bytes are valid anyway).
        let e = unsafe { copy_from_dlpack(&d) }.unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)) && e.to_string().contains(name), "{e}");
    }
    let vulkan = DLDevice { device_type: DLDeviceType::VULKAN, device_id: 0 };
    let d = foreign(vec![0; 8], DLDataType::U8, vulkan, vec![2], vec![1], 0);
    // SAFETY: refused before any byte is read.
    let e = unsafe { copy_from_dlpack(&d) }.unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)) && e.to_string().contains("device type 7"), "{e}");

    let d = foreign(vec![1, 2, 0], DLDataType::BOOL, cpu, vec![3], vec![1], 0);
    // SAFETY: three readable bytes.
    let e = unsafe { copy_from_dlpack(&d) }.unwrap_err();
    assert!(matches!(e, Error::InvalidValue { dtype: DType::Bool, .. }), "{e}");

    for (shape, strides) in [(vec![4, 2], vec![i64::MAX, 1]), (vec![2], vec![i64::MIN])] {
        let d = foreign(vec![0; 8], DLDataType::U8, cpu, shape, strides, 0);
        // SAFETY: refused before any byte is read: the extent leaves the address space.
        let e = unsafe { copy_from_dlpack(&d) }.unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn a_cuda_tensor_needs_feature_cuda() {
    let d = foreign(vec![0; 8], DLDataType::U8, DLDevice::cuda(0), vec![2], vec![1], 0);
    // SAFETY: refused before any byte is read.
    let e = unsafe { copy_from_dlpack(&d) }.unwrap_err();
    assert!(e.to_string().contains("feature `cuda`"), "{e}");
}

mod between_processes {
    use tensorshare::SharingStrategy;
    #[test]
    fn file_descriptor() {
        crate::checked!(
            super::a_received_tensor_is_exported_in_place,
            SharingStrategy::FileDescriptor,
            SharingStrategy
        );
    }
    #[test]
    fn file_system() {
        crate::checked!(
            super::a_received_tensor_is_exported_in_place,
            SharingStrategy::FileSystem,
            SharingStrategy
        );
    }
}

/// A worker receives a tensor through a queue and exports it: the DLPack tensor points at
/// the pages the worker mapped, reads the parent's values there, and what the worker
/// writes through it reaches the parent; the deleter gives the worker's hold back.
fn a_received_tensor_is_exported_in_place(s: SharingStrategy) {
    let mut t = Tensor::empty_shared_with(&[4, 3], DType::F32, s).unwrap();
    t.copy_from_slice(&(0..12).map(|v| v as f32).collect::<Vec<_>>()).unwrap();
    let q: Queue<Tensor> = Queue::new().unwrap();
    q.put(t.t().unwrap()).unwrap();
    let mut ctx = spawn(
        |_rank, q: Queue<Tensor>| {
            let view = q.get().unwrap();
            let before = view.storage().handle_count();
            let mut d = to_dlpack(&view).unwrap();
            assert_eq!(first_element(&d), element_ptr(&view), "no copy in the worker");
            {
                let v = d.validate_mut().unwrap();
                assert_eq!(v.strides(), Some(&[1i64, 3][..]));
                // SAFETY: the parent does not touch the tensor until this worker has exited,
                // and nothing else in this process accesses it while the borrows live.
                let all = unsafe { std::slice::from_raw_parts(v.data_ptr() as *const f32, 12) };
                assert_eq!(all, (0..12).map(|v| v as f32).collect::<Vec<_>>());
                // SAFETY: as above; the data is contiguous in storage order.
                let all = unsafe { std::slice::from_raw_parts_mut(v.data_ptr() as *mut f32, 12) };
                all[11] = -1.0;
            }
            drop(d);
            assert_eq!(view.storage().handle_count(), before, "the deleter let go");
        },
        q.clone(),
        1,
    )
    .unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    assert_eq!(t.to_vec::<f32>().unwrap()[11], -1.0, "the worker's write through DLPack");
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use tensorshare::cuda::DRIVER_ENV;
    use tensorshare::Device;

    fn on(driver: &'static str) {
        crate::common::isolated_with(
            |_rank, driver: String| {
                std::env::set_var(DRIVER_ENV, &driver);
                match tensorshare::cuda::device_count() {
                    Ok(n) if n > 0 => {}
                    other => return eprintln!("skipped on {driver}: {other:?}"),
                }
                cuda_tensors_are_exported_in_place_and_copied_back();
            },
            driver.to_string(),
        )
    }

    #[test]
    fn simulated() {
        on("simulated");
    }

    #[test]
    fn gpu() {
        on("cuda");
    }

    fn cuda_tensors_are_exported_in_place_and_copied_back() {
        let host = sample(DType::BF16, &[3, 4]);
        let t = host.to_device(Device::Cuda(0)).unwrap();
        let view = t.narrow(1, 1, 2).unwrap();
        let d = to_dlpack(&view).unwrap();
        let v = d.validate().unwrap();
        assert_eq!(v.device().device_type, DLDeviceType::CUDA);
        assert_eq!(Device::Cuda(v.device().device_id as u32), t.device());
        assert_eq!(first_element(&d) as u64, view.device_ptr().unwrap(), "the export aliases device memory");
        assert_eq!(t.storage().handle_count(), 3);
        // SAFETY: the bytes lie in a live allocation of this process, and nothing writes them.
        let copy = unsafe { copy_from_dlpack(&d) }.unwrap();
        assert_eq!(copy.device(), t.device());
        assert_ne!(copy.device_ptr().unwrap(), t.device_ptr().unwrap());
        assert!(copy.to_cpu().unwrap().equal(&host.narrow(1, 1, 2).unwrap().contiguous().unwrap()));
        assert!(from_dlpack(&d).unwrap().storage().ptr_eq(t.storage()));
        drop(d);
        assert_eq!(t.storage().handle_count(), 2, "`t` and `view`");
    }
}
