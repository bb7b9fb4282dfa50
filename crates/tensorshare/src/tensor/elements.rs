//! A view's elements: their storage offsets in row-major order, whatever the strides, and
//! their addresses. Forming an offset or an address is always defined; reading or writing
//! through one is for the callers, which show that it is an element of the view.

use super::Tensor;
use crate::{Error, Result};

/// Calls `f` with the storage offset (in elements) of every element of a view, in
/// row-major order.
pub(crate) fn for_each_offset(shape: &[usize], strides: &[usize], base: usize, mut f: impl FnMut(usize)) {
    if shape.contains(&0) {
        return;
    }
    let Some((&inner, outer)) = shape.split_last() else {
        f(base);
        return;
    };
    let inner_stride = strides[strides.len() - 1];
    let mut idx = vec![0usize; outer.len()];
    let mut start = base;
    loop {
        for i in 0..inner {
            f(start + i * inner_stride);
        }
        // Advance the outer index like an odometer. Only offsets of elements are ever
        // formed (each is in bounds, see check_bounds), so nothing here overflows, even
        // with a huge stride on a dimension of size one.
        let mut d = outer.len();
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            if idx[d] + 1 < outer[d] {
                idx[d] += 1;
                start += strides[d];
                break;
            }
            start -= strides[d] * idx[d];
            idx[d] = 0;
        }
    }
}

/// A vector with room for `n` values, or an error if it cannot be allocated.
pub(crate) fn try_vec_with_capacity<T>(n: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| Error::AllocationFailed { bytes: n.saturating_mul(std::mem::size_of::<T>()) })?;
    Ok(v)
}

impl Tensor {
    /// Address of the element at storage offset `elem` (in elements). Forming it is always
    /// defined (wrapping arithmetic); whoever reads or writes through it shows that `elem`
    /// is an element of this view (or the view's own offset for a view without elements),
    /// which `check_bounds`, run on every tensor's construction, keeps in the storage.
    pub(super) fn elem_ptr(&self, elem: usize) -> *mut u8 {
        self.storage.as_mut_ptr().wrapping_add(elem.wrapping_mul(self.dtype.size()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    #[test]
    fn offsets_follow_strides() {
        let mut v = Vec::new();
        for_each_offset(&[2, 3], &[1, 2], 10, |o| v.push(o));
        assert_eq!(v, vec![10, 12, 14, 11, 13, 15]);
        let mut s = Vec::new();
        for_each_offset(&[], &[], 7, |o| s.push(o));
        assert_eq!(s, vec![7]);
        let mut e = Vec::new();
        for_each_offset(&[3, 0], &[1, 1], 0, |o| e.push(o));
        assert!(e.is_empty());
    }

    #[test]
    fn offsets_of_a_huge_stride_on_a_dimension_of_size_one_do_not_overflow() {
        let mut v = Vec::new();
        for_each_offset(&[1, 3], &[usize::MAX, 1], 1, |o| v.push(o));
        assert_eq!(v, vec![1, 2, 3]);
        let t =
            Tensor::from_storage(crate::Storage::new(16), DType::F32, &[1, 3], &[usize::MAX, 1], 1).unwrap();
        assert_eq!(t.to_vec::<f32>().unwrap(), vec![0.0; 3]);
        let t =
            Tensor::from_storage(crate::Storage::new(12), DType::F32, &[3, 1], &[1, usize::MAX], 0).unwrap();
        assert_eq!(t.to_bytes().unwrap().len(), 12);
    }
}
