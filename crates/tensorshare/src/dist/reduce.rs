//! [`ReduceOp`] and the arithmetic of `all_reduce`: blocks of elements from several
//! tensors combined into one, in private buffers.
//!
//! Every rank combines the inputs in the same order (local rank 0 first), so the ranks of a
//! node get the same bits. Integers wrap on overflow, as in torch; f16 and bf16 accumulate
//! in f32 and are rounded once at the end.

use half::{bf16, f16};

use crate::DType;

/// How [`all_reduce`](super::all_reduce) combines the ranks' values (torch's `ReduceOp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// The sum (integers wrap on overflow).
    Sum,
    /// The sum divided by the number of ranks (torch's `AVG`): floating-point dtypes only.
    Mean,
    /// The product (integers wrap on overflow).
    Product,
    /// The largest value; a NaN wins.
    Max,
    /// The smallest value; a NaN wins.
    Min,
}

impl ReduceOp {
    const ALL: [ReduceOp; 5] =
        [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Product, ReduceOp::Max, ReduceOp::Min];

    /// The operation's number in a signature.
    pub(super) fn code(self) -> u64 {
        ReduceOp::ALL.iter().position(|&o| o == self).unwrap_or(0) as u64
    }

    /// The operation a signature names, if any.
    pub(super) fn from_code(code: u64) -> Option<ReduceOp> {
        usize::try_from(code).ok().and_then(|i| ReduceOp::ALL.get(i).copied())
    }

    /// torch's name, in lower case.
    pub(super) fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Product => "product",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        }
    }

    /// Why `self` cannot reduce `dtype`, if it cannot.
    pub(super) fn refuses(self, dtype: DType) -> Option<String> {
        match (dtype, self) {
            (DType::Bool, _) => {
                Some("all_reduce of a bool tensor: reduce a u8 tensor of zeros and ones instead".into())
            }
            (d, ReduceOp::Mean) if !d.is_float() => Some(format!(
                "the mean of a {d} tensor has no {d} value: use a floating-point tensor, or Sum and divide"
            )),
            _ => None,
        }
    }
}

/// Private buffers for [`reduce_block`], reused from block to block.
#[derive(Default)]
pub(super) struct Scratch {
    input: Vec<u64>,
    acc: Vec<u64>,
    out: Vec<u64>,
}

/// Elements a block holds at most (every buffer stays in the first-level cache).
pub(super) const BLOCK_BYTES: usize = 16 * 1024;

/// `v` grown to hold `bytes` bytes, as bytes (8-byte aligned: any element type fits).
fn bytes_of(v: &mut Vec<u64>, bytes: usize) -> &mut [u8] {
    let words = bytes.div_ceil(8);
    if v.len() < words {
        v.resize(words, 0);
    }
    &mut bytemuck::cast_slice_mut::<u64, u8>(v)[..bytes]
}

/// An element type `all_reduce` reduces, with the type it accumulates in.
trait Elem: bytemuck::Pod {
    type Acc: bytemuck::Pod;
    fn acc(self) -> Self::Acc;
    fn back(a: Self::Acc) -> Self;
    fn add(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn mul(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn max(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn min(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    /// `a / n` (Mean, floating point only).
    fn div(a: Self::Acc, n: usize) -> Self::Acc;
}

macro_rules! float_elem {
    ($t:ty, $acc:ty, |$x:ident| $to:expr, |$y:ident| $from:expr) => {
        impl Elem for $t {
            type Acc = $acc;
            fn acc(self) -> $acc {
                let $x = self;
                $to
            }
            fn back(a: $acc) -> $t {
                let $y = a;
                $from
            }
            fn add(a: $acc, b: $acc) -> $acc {
                a + b
            }
            fn mul(a: $acc, b: $acc) -> $acc {
                a * b
            }
            fn max(a: $acc, b: $acc) -> $acc {
                if a.is_nan() {
                    a
                } else if b.is_nan() || b > a {
                    b
                } else {
                    a
                }
            }
            fn min(a: $acc, b: $acc) -> $acc {
                if a.is_nan() {
                    a
                } else if b.is_nan() || b < a {
                    b
                } else {
                    a
                }
            }
            fn div(a: $acc, n: usize) -> $acc {
                a / (n as $acc)
            }
        }
    };
}

float_elem!(f32, f32, |x| x, |y| y);
float_elem!(f64, f64, |x| x, |y| y);
float_elem!(f16, f32, |x| x.to_f32(), |y| f16::from_f32(y));
float_elem!(bf16, f32, |x| x.to_f32(), |y| bf16::from_f32(y));

macro_rules! int_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            type Acc = $t;
            fn acc(self) -> $t {
                self
            }
            fn back(a: $t) -> $t {
                a
            }
            fn add(a: $t, b: $t) -> $t {
                a.wrapping_add(b)
            }
            fn mul(a: $t, b: $t) -> $t {
                a.wrapping_mul(b)
            }
            fn max(a: $t, b: $t) -> $t {
                Ord::max(a, b)
            }
            fn min(a: $t, b: $t) -> $t {
                Ord::min(a, b)
            }
            fn div(a: $t, _n: usize) -> $t {
                a // never reached: Mean refuses integer dtypes
            }
        }
    )*};
}

int_elem!(u8, i8, i16, i32, i64);

/// Reduces `inputs` blocks of `count` elements of `dtype` with `op` and returns the result's
/// bytes. `load(k, buf)` fills `buf` with the bytes of input `k`; `divide_by`, when given,
/// divides the result (a mean). `dtype` and `op` were checked with [`ReduceOp::refuses`].
pub(super) fn reduce_block<'s>(
    dtype: DType,
    op: ReduceOp,
    divide_by: Option<usize>,
    count: usize,
    inputs: usize,
    load: &mut dyn FnMut(usize, &mut [u8]) -> crate::Result<()>,
    scratch: &'s mut Scratch,
) -> crate::Result<&'s [u8]> {
    match dtype {
        DType::F32 => run::<f32>(op, divide_by, count, inputs, load, scratch),
        DType::F64 => run::<f64>(op, divide_by, count, inputs, load, scratch),
        DType::F16 => run::<f16>(op, divide_by, count, inputs, load, scratch),
        DType::BF16 => run::<bf16>(op, divide_by, count, inputs, load, scratch),
        DType::U8 => run::<u8>(op, divide_by, count, inputs, load, scratch),
        DType::I8 => run::<i8>(op, divide_by, count, inputs, load, scratch),
        DType::I16 => run::<i16>(op, divide_by, count, inputs, load, scratch),
        DType::I32 => run::<i32>(op, divide_by, count, inputs, load, scratch),
        DType::I64 => run::<i64>(op, divide_by, count, inputs, load, scratch),
        DType::Bool => Err(crate::Error::invalid_argument("dtype", "all_reduce of a bool tensor")),
    }
}

fn run<'s, E: Elem>(
    op: ReduceOp,
    divide_by: Option<usize>,
    count: usize,
    inputs: usize,
    load: &mut dyn FnMut(usize, &mut [u8]) -> crate::Result<()>,
    scratch: &'s mut Scratch,
) -> crate::Result<&'s [u8]> {
    let size = std::mem::size_of::<E>();
    let acc_size = std::mem::size_of::<E::Acc>();
    let bytes = count * size; // a block: at most BLOCK_BYTES
    let acc: &mut [E::Acc] = bytemuck::cast_slice_mut(bytes_of(&mut scratch.acc, count * acc_size));
    for k in 0..inputs {
        let buf = bytes_of(&mut scratch.input, bytes);
        load(k, buf)?;
        let xs: &[E] = bytemuck::cast_slice(buf);
        if k == 0 {
            for (a, x) in acc.iter_mut().zip(xs) {
                *a = x.acc();
            }
            continue;
        }
        match op {
            ReduceOp::Sum | ReduceOp::Mean => fold(acc, xs, E::add),
            ReduceOp::Product => fold(acc, xs, E::mul),
            ReduceOp::Max => fold(acc, xs, E::max),
            ReduceOp::Min => fold(acc, xs, E::min),
        }
    }
    let out: &mut [E] = bytemuck::cast_slice_mut(bytes_of(&mut scratch.out, bytes));
    match divide_by {
        Some(n) => out.iter_mut().zip(acc.iter()).for_each(|(o, a)| *o = E::back(E::div(*a, n))),
        None => out.iter_mut().zip(acc.iter()).for_each(|(o, a)| *o = E::back(*a)),
    }
    Ok(&bytemuck::cast_slice::<u64, u8>(&scratch.out)[..bytes])
}

/// `acc[i] = f(acc[i], xs[i])`, made once per operation (a function item, not a pointer) so
/// that the loop vectorizes.
fn fold<E: Elem>(acc: &mut [E::Acc], xs: &[E], f: impl Fn(E::Acc, E::Acc) -> E::Acc) {
    for (a, x) in acc.iter_mut().zip(xs) {
        *a = f(*a, x.acc());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reduce<E: bytemuck::Pod>(dtype: DType, op: ReduceOp, div: Option<usize>, inputs: &[Vec<E>]) -> Vec<E> {
        let count = inputs[0].len();
        let mut scratch = Scratch::default();
        let out = reduce_block(
            dtype,
            op,
            div,
            count,
            inputs.len(),
            &mut |k, buf| {
                buf.copy_from_slice(bytemuck::cast_slice(&inputs[k]));
                Ok(())
            },
            &mut scratch,
        )
        .unwrap();
        bytemuck::cast_slice(out).to_vec()
    }

    #[test]
    fn every_op_on_floats_and_integers() {
        let f = vec![vec![1.0f32, -2.0, 3.0], vec![4.0, 5.0, -6.0]];
        assert_eq!(reduce(DType::F32, ReduceOp::Sum, None, &f), vec![5.0, 3.0, -3.0]);
        assert_eq!(reduce(DType::F32, ReduceOp::Mean, Some(2), &f), vec![2.5, 1.5, -1.5]);
        assert_eq!(reduce(DType::F32, ReduceOp::Product, None, &f), vec![4.0, -10.0, -18.0]);
        assert_eq!(reduce(DType::F32, ReduceOp::Max, None, &f), vec![4.0, 5.0, 3.0]);
        assert_eq!(reduce(DType::F32, ReduceOp::Min, None, &f), vec![1.0, -2.0, -6.0]);
        let i = vec![vec![i8::MAX, -3], vec![1, 7]];
        assert_eq!(reduce(DType::I8, ReduceOp::Sum, None, &i), vec![i8::MIN, 4], "integers wrap");
        assert_eq!(reduce(DType::I8, ReduceOp::Max, None, &i), vec![i8::MAX, 7]);
        let h = vec![vec![f16::from_f32(1.5)], vec![f16::from_f32(2.0)]];
        assert_eq!(reduce(DType::F16, ReduceOp::Mean, Some(2), &h), vec![f16::from_f32(1.75)]);
    }

    #[test]
    fn a_nan_wins_max_and_min() {
        let f = vec![vec![f64::NAN, 1.0], vec![2.0, f64::NAN]];
        for op in [ReduceOp::Max, ReduceOp::Min] {
            assert!(reduce(DType::F64, op, None, &f).iter().all(|v| v.is_nan()), "{op:?}");
        }
    }

    #[test]
    fn bool_and_integer_means_are_refused() {
        assert!(ReduceOp::Sum.refuses(DType::Bool).is_some());
        assert!(ReduceOp::Mean.refuses(DType::I32).is_some());
        assert!(ReduceOp::Mean.refuses(DType::BF16).is_none());
        for op in ReduceOp::ALL {
            assert_eq!(ReduceOp::from_code(op.code()), Some(op));
        }
    }
}
