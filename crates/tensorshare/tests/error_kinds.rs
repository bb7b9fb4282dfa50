//! Each kind of mistake is its own `Error` variant, with the fields a caller acts on, and a
//! message that names what to fix.

use tensorshare::{DType, Error, Pool, Queue, Tensor};

#[test]
fn a_view_out_of_range_names_its_operation_and_shape() {
    let t = Tensor::zeros(&[2, 3], DType::F32);
    match t.narrow(1, 2, 2).unwrap_err() {
        Error::Shape { op, shape, reason } => {
            assert_eq!((op, shape.as_slice()), ("narrow", &[2, 3][..]));
            assert!(reason.contains("out of range"), "{reason}");
        }
        e => panic!("not a shape error: {e:?}"),
    }
    let e = t.reshape(&[4]).unwrap_err();
    assert!(matches!(&e, Error::Shape { op: "reshape", .. }), "{e:?}");
    assert!(e.to_string().starts_with("reshape: "), "{e}");
}

#[test]
fn a_pool_of_no_workers_is_an_invalid_argument() {
    let e = Pool::new(0).expect_err("a pool of no workers is refused");
    assert!(matches!(e, Error::InvalidArgument { what: "worker count", .. }), "{e:?}");
}

#[test]
fn a_queue_without_room_is_an_invalid_argument() {
    let e = Queue::<u32>::with_capacity(0).expect_err("a capacity of 0 is refused");
    assert!(matches!(e, Error::InvalidArgument { what: "queue capacity", .. }), "{e:?}");
}

#[test]
fn only_floating_point_tensors_require_gradients() {
    let mut t = Tensor::zeros(&[2], DType::I64);
    let e = t.set_requires_grad(true).expect_err("an integer tensor cannot require gradients");
    assert!(matches!(e, Error::InvalidArgument { what: "requires_grad", .. }), "{e:?}");
}

#[test]
fn bool_bytes_other_than_0_and_1_are_invalid_values() {
    let bytes = Tensor::from_vec(vec![1u8, 7], &[2]).unwrap();
    let flags = Tensor::from_storage(bytes.storage().clone(), DType::Bool, &[2], &[1], 0).unwrap();
    let e = flags.to_vec::<bool>().unwrap_err();
    assert!(matches!(e, Error::InvalidValue { dtype: DType::Bool, .. }), "{e:?}");
    assert!(e.to_string().contains("not valid bool"), "{e}");
}
