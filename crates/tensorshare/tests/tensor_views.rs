//! Views and strides checked against ndarray on random shapes and random chains of views.

use ndarray::{ArrayD, Axis, IxDyn, Slice};
use proptest::prelude::*;
use tensorshare::Tensor;

#[derive(Clone, Debug)]
enum Op {
    Narrow { dim: usize, start: usize, len: usize },
    Select { dim: usize, index: usize },
    Transpose { a: usize, b: usize },
    Permute { seed: u64 },
    Reshape { split: bool },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..4usize, 0..5usize, 0..5usize).prop_map(|(dim, start, len)| Op::Narrow { dim, start, len }),
        (0..4usize, 0..5usize).prop_map(|(dim, index)| Op::Select { dim, index }),
        (0..4usize, 0..4usize).prop_map(|(a, b)| Op::Transpose { a, b }),
        any::<u64>().prop_map(|seed| Op::Permute { seed }),
        any::<bool>().prop_map(|split| Op::Reshape { split }),
    ]
}

/// Applies `op` to both, when it is valid for the current shape; returns false to skip.
fn apply(op: &Op, t: &mut Tensor, a: &mut ArrayD<i32>) -> bool {
    let nd = t.ndim();
    match *op {
        Op::Narrow { dim, start, len } => {
            if dim >= nd || start + len > t.shape()[dim] {
                assert!(t.narrow(dim, start, len).is_err());
                return false;
            }
            *t = t.narrow(dim, start, len).unwrap();
            *a = a.slice_axis(Axis(dim), Slice::from(start..start + len)).to_owned();
        }
        Op::Select { dim, index } => {
            if dim >= nd || index >= t.shape()[dim] {
                assert!(t.select(dim, index).is_err());
                return false;
            }
            *t = t.select(dim, index).unwrap();
            *a = a.index_axis(Axis(dim), index).to_owned();
        }
        Op::Transpose { a: d0, b: d1 } => {
            if d0 >= nd || d1 >= nd {
                assert!(t.transpose(d0, d1).is_err());
                return false;
            }
            *t = t.transpose(d0, d1).unwrap();
            a.swap_axes(d0, d1);
        }
        Op::Permute { seed } => {
            let mut perm: Vec<usize> = (0..nd).collect();
            let mut s = seed;
            for i in (1..nd).rev() {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                perm.swap(i, (s >> 33) as usize % (i + 1));
            }
            *t = t.permute(&perm).unwrap();
            *a = a.clone().permuted_axes(IxDyn(&perm));
        }
        Op::Reshape { split } => {
            let n = t.numel();
            let shape: Vec<usize> = if split && n % 2 == 0 && n > 0 { vec![2, n / 2] } else { vec![n] };
            let viewable = t.can_view_as(&shape);
            let before = t.storage().clone();
            *t = t.reshape(&shape).unwrap();
            assert_eq!(viewable, t.storage().ptr_eq(&before), "reshape copies exactly when it cannot view");
            let flat: Vec<i32> = a.iter().copied().collect();
            *a = ArrayD::from_shape_vec(IxDyn(&shape), flat).unwrap();
        }
    }
    true
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn views_agree_with_ndarray(shape in prop::collection::vec(1..5usize, 1..5), ops in prop::collection::vec(op(), 0..8)) {
        let n: usize = shape.iter().product();
        let data: Vec<i32> = (0..n as i32).collect();
        let mut t = Tensor::from_vec(data.clone(), &shape).unwrap();
        let mut a = ArrayD::from_shape_vec(IxDyn(&shape), data).unwrap();
        for op in &ops {
            apply(op, &mut t, &mut a);
            prop_assert_eq!(t.shape(), a.shape());
            let expected: Vec<i32> = a.iter().copied().collect();
            prop_assert_eq!(t.to_vec::<i32>().unwrap(), expected.clone());
            // The zero-copy views are what is checked here. SAFETY: one thread, and nothing
            // writes the storage while these borrows live.
            let view = unsafe { t.view::<i32>() }.unwrap();
            prop_assert_eq!(view.iter().copied().collect::<Vec<_>>(), expected.clone());
            prop_assert_eq!(t.is_contiguous(), view.is_standard_layout());
            let c = t.contiguous().unwrap();
            // SAFETY: as above.
            prop_assert_eq!(unsafe { c.as_slice::<i32>() }.unwrap(), &expected[..]);
        }
    }
}

#[test]
fn writes_through_a_view_of_a_shared_tensor_reach_the_base() {
    let mut x = Tensor::zeros(&[5, 5], tensorshare::DType::F32);
    x.share_memory().unwrap();
    let mut col = x.narrow(1, 1, 1).unwrap();
    col.fill(4.0f32).unwrap();
    let row = x.select(0, 4).unwrap();
    row.narrow(0, 0, 1).unwrap().fill(9.0f32).unwrap();
    let v = x.to_vec::<f32>().unwrap();
    for r in 0..5 {
        assert_eq!(v[r * 5 + 1], 4.0);
    }
    assert_eq!(v[20], 9.0);
}
