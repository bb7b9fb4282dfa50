//! What safe code can do with memory that other handles, threads and processes reach too
//! (issue 12, section 1): the patterns that used to be undefined behaviour either do not
//! compile any more (see the `compile_fail` examples on `Tensor::as_slice`,
//! `Tensor::as_mut_slice` and `Tensor::exclusive_slice_mut`) or behave, and sizes that
//! overflow are errors, never panics, aborts or views outside their memory.

use serde::Serialize;
use tensorshare::{raw, DType, Device, Error, NestedTensor, SparseTensor, Storage, Tensor, TensorKind};

fn shared(mut t: Tensor) -> Tensor {
    t.share_memory().unwrap();
    t
}

#[test]
fn two_threads_incrementing_through_atomic_views_reach_the_exact_total() {
    let counter = shared(Tensor::zeros(&[2], DType::I64));
    let clones = [counter.clone(), counter.clone()];
    std::thread::scope(|s| {
        for c in &clones {
            s.spawn(move || {
                let v = c.atomic::<i64>().unwrap();
                for _ in 0..100_000 {
                    v.fetch_add(0, 1);
                    v.fetch_add(1, 2);
                }
            });
        }
    });
    assert_eq!(counter.to_vec::<i64>().unwrap(), vec![200_000, 400_000]);
}

/// A view made on a private tensor whose clone is shared afterwards (as sending the clone to
/// a worker does) updates the shared bytes that every handle sees, not the ones left behind.
#[test]
fn an_atomic_view_made_before_its_storage_is_shared_updates_the_shared_bytes() {
    let t = Tensor::zeros(&[4], DType::I64);
    let v = t.atomic::<i64>().unwrap();
    assert!(!t.storage().is_shared());
    let mut c = t.clone();
    c.share_memory().unwrap();
    v.fetch_add(0, 7);
    assert_eq!(t.to_vec::<i64>().unwrap()[0], 7);
    assert_eq!(c.to_vec::<i64>().unwrap()[0], 7);
}

#[test]
fn safe_copies_racing_with_writers_see_whole_elements() {
    const A: i64 = 0x0101_0101_0101_0101;
    const B: i64 = -0x0202_0202_0202_0203;
    let t = shared(Tensor::full(&[1024], A));
    std::thread::scope(|s| {
        let mut writer = t.clone();
        s.spawn(move || {
            let bs = vec![B; 1024];
            for i in 0..200 {
                if i % 2 == 0 {
                    writer.fill(A).unwrap();
                } else {
                    writer.copy_from_slice(&bs).unwrap();
                }
            }
        });
        let reader = t.clone();
        s.spawn(move || {
            for _ in 0..200 {
                let v = reader.to_vec::<i64>().unwrap();
                assert!(v.iter().all(|x| *x == A || *x == B), "a torn element");
            }
        });
    });
}

#[test]
fn a_bool_byte_another_handle_sets_to_200_is_an_error_not_a_bool() {
    let flags = shared(Tensor::from_vec(vec![true, false, true], &[3]).unwrap());
    assert_eq!(flags.to_vec::<bool>().unwrap(), vec![true, false, true]);
    // Another handle of the same storage, with another dtype, as another process could hold.
    let mut bytes = Tensor::from_storage(flags.storage().clone(), DType::U8, &[3], &[1], 0).unwrap();
    bytes.copy_from_slice(&[1u8, 200, 0]).unwrap();
    let e = flags.to_vec::<bool>().unwrap_err();
    assert!(e.to_string().contains("not valid bool"), "{e}");
    assert!(matches!(e, Error::InvalidValue { dtype: DType::Bool, .. }), "{e:?}");
    // The zero-copy borrows check too when they are made. SAFETY: nothing writes the
    // storage while these borrows would live.
    assert!(unsafe { flags.as_slice::<bool>() }.is_err());
    assert!(unsafe { flags.view::<bool>() }.is_err());
}

#[test]
fn the_exclusive_borrow_takes_a_fresh_private_tensor_and_refuses_any_other() {
    let mut fresh = Tensor::zeros(&[3], DType::F32);
    fresh.exclusive_slice_mut::<f32>().unwrap().copy_from_slice(&[1.0, 2.0, 3.0]);
    assert_eq!(fresh.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0]);

    let not_exclusive =
        |t: &mut Tensor| matches!(t.exclusive_slice_mut::<f32>(), Err(Error::NotExclusive(_)));
    let mut a = Tensor::zeros(&[3], DType::F32);
    let b = a.clone();
    assert!(not_exclusive(&mut a), "a clone aliases it");
    drop(b);
    let mut s = shared(a);
    assert!(not_exclusive(&mut s), "shared memory is mapped by other processes");

    // A tensor received through a message maps the sender's memory.
    let (bytes, fds) = raw::encode(&s).unwrap();
    let mut received: Tensor = raw::decode(&bytes, fds).unwrap();
    drop(s);
    assert!(received.is_shared() && not_exclusive(&mut received));
}

#[test]
fn a_shared_storage_of_an_overflowing_size_is_an_error() {
    assert!(Tensor::empty_shared(&[usize::MAX], DType::U8).is_err());
    assert!(Tensor::zeros_shared(&[usize::MAX / 2], DType::I16).is_err());
    assert!(Storage::empty_shared_with(usize::MAX, tensorshare::SharingStrategy::FileDescriptor).is_err());
    assert!(Storage::empty_shared_with(usize::MAX - 4096, tensorshare::SharingStrategy::FileSystem).is_err());
}

#[test]
fn a_view_without_elements_far_outside_its_storage_is_an_error() {
    let s = Storage::new(64);
    let e = Tensor::from_storage(s.clone(), DType::F32, &[0], &[1], 1 << 62).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
    assert!(Tensor::from_storage(s.clone(), DType::F32, &[2, 0], &[1, 1], usize::MAX).is_err());
    // At the end of the storage is fine, and borrows nothing.
    let end = Tensor::from_storage(s, DType::F32, &[0], &[1], 16).unwrap();
    assert!(end.to_vec::<f32>().unwrap().is_empty());
    // SAFETY: the slice is empty.
    assert!(unsafe { end.as_slice::<f32>() }.unwrap().is_empty());
}

fn i64s(v: &[i64]) -> Tensor {
    Tensor::from_slice(v, &[v.len()]).unwrap()
}

#[test]
fn compressed_sparse_sizes_that_overflow_are_errors() {
    let none = Tensor::zeros(&[0], DType::F32);
    assert!(SparseTensor::csr(i64s(&[0]), i64s(&[]), none.clone(), &[usize::MAX, 1]).is_err());
    assert!(SparseTensor::csc(i64s(&[0]), i64s(&[]), none.clone(), &[1, usize::MAX]).is_err());
    // Valid, and too large to densify.
    let tall = SparseTensor::csr(i64s(&[0, 0, 0]), i64s(&[]), none, &[2, 1 << 62]).unwrap();
    assert!(tall.to_dense().is_err());
}

#[test]
fn coo_to_dense_of_an_overflowing_size_is_an_error() {
    let none = |dims: usize| (Tensor::zeros(&[dims, 0], DType::I64), Tensor::zeros(&[0], DType::F32));
    let (i, v) = none(2);
    let wide = SparseTensor::coo(i, v, &[1 << 40, 1 << 40]).unwrap();
    assert!(wide.to_dense().is_err(), "the element count overflows");
    let (i, v) = none(1);
    let long = SparseTensor::coo(i, v, &[1 << 61]).unwrap();
    assert!(long.to_dense().is_err(), "the byte size overflows isize");
    let (i, _) = none(1);
    let huge = SparseTensor::coo(i, Tensor::zeros(&[0], DType::U8), &[1 << 60]).unwrap();
    assert!(matches!(huge.to_dense(), Err(Error::AllocationFailed { .. })), "an exabyte is not there");
    // An index tensor with absurdly many sparse dims is an error, not an overflow.
    let absurd = Tensor::zeros(&[usize::MAX, 0], DType::I64);
    assert!(SparseTensor::coo(absurd, Tensor::zeros(&[0, 2], DType::F32), &[]).is_err());
}

#[test]
fn meta_tensors_of_overflowing_shapes_are_errors() {
    assert!(Tensor::try_meta(&[usize::MAX, 2], DType::U8).is_err());
    assert!(Tensor::try_meta(&[1 << 62], DType::F64).is_err());
    assert_eq!(Tensor::try_meta(&[1 << 30, 1 << 30], DType::F32).unwrap().numel(), 1 << 60);

    // The same through the wire: a peer's message with such a shape is refused. This mirrors
    // the by-value layout of a meta tensor (postcard is not self-describing).
    #[derive(Serialize)]
    struct Meta {
        dtype: DType,
        shape: Vec<usize>,
        strides: Vec<usize>,
        offset: usize,
        requires_grad: bool,
        kind: TensorKind,
        device: Device,
    }
    #[derive(Serialize)]
    #[allow(dead_code)]
    enum Repr {
        Handle { storage: u32, meta: Meta },
        Value { data: Vec<u8>, meta: Meta },
        NoData { meta: Meta },
    }
    let meta = |shape: Vec<usize>| {
        let strides = vec![1; shape.len()];
        let meta = Meta {
            dtype: DType::F32,
            shape,
            strides,
            offset: 0,
            requires_grad: false,
            kind: TensorKind::Tensor,
            device: Device::Meta,
        };
        postcard::to_allocvec(&Repr::NoData { meta }).unwrap()
    };
    let fine: Tensor = postcard::from_bytes(&meta(vec![2, 3])).unwrap();
    assert_eq!((fine.device(), fine.shape()), (Device::Meta, &[2, 3][..]), "the mirror matches");
    assert!(postcard::from_bytes::<Tensor>(&meta(vec![1 << 32, 1 << 32])).is_err());
    assert!(postcard::from_bytes::<Tensor>(&meta(vec![1 << 62])).is_err());
}

#[test]
fn nested_tensors_whose_total_overflows_are_errors() {
    let part = Tensor::try_meta(&[1 << 62], DType::U8).unwrap();
    assert!(NestedTensor::from_tensors(&[part.clone(), part.clone(), part.clone(), part]).is_err());
}
