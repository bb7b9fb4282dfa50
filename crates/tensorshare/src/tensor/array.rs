//! ndarray views (feature `ndarray`, on by default).

use ndarray::{ArrayBase, ArrayViewD, ArrayViewMutD, Data, Dimension, IxDyn, ShapeBuilder};

use super::Tensor;
use crate::{Element, Error, Result};

impl Tensor {
    fn check_view<T: Element>(&self) -> Result<()> {
        self.check_dtype::<T>()?;
        self.check_cpu()?;
        if T::DTYPE == crate::DType::Bool {
            // Every element must be a valid bool before a reference to it exists.
            self.to_vec::<T>()?;
        }
        Ok(())
    }

    /// An ndarray view of the elements, with this tensor's strides.
    pub fn view<T: Element>(&self) -> Result<ArrayViewD<'_, T>> {
        self.check_view::<T>()?;
        let shape = IxDyn(&self.shape).strides(IxDyn(&self.strides));
        // SAFETY: the view's elements are in bounds of the storage (check_bounds), aligned
        // (64-byte aligned storage, whole-element offsets), valid values of T (numeric
        // types accept every bit pattern, bools were checked above) and live as long as
        // `&self`. Strides are non-negative; a zero stride only occurs with size 0 or 1.
        Ok(unsafe { ArrayViewD::from_shape_ptr(shape, self.storage.as_ptr().cast::<T>().add(self.offset)) })
    }

    /// A mutable ndarray view. Other handles of the storage see the writes.
    pub fn view_mut<T: Element>(&mut self) -> Result<ArrayViewMutD<'_, T>> {
        self.check_view::<T>()?;
        if has_overlap(&self.shape, &self.strides) {
            return Err(Error::shape("a mutable view needs elements that do not overlap"));
        }
        let shape = IxDyn(&self.shape).strides(IxDyn(&self.strides));
        // SAFETY: as in `view`; in addition the elements do not overlap (checked above), so
        // no two indices of the mutable view alias, and `&mut self` makes this handle's
        // borrow unique.
        Ok(unsafe {
            ArrayViewMutD::from_shape_ptr(shape, self.storage.as_ptr().cast::<T>().add(self.offset))
        })
    }

    /// A contiguous private tensor with a copy of an ndarray's elements.
    pub fn from_array<T: Element, S: Data<Elem = T>, D: Dimension>(array: &ArrayBase<S, D>) -> Tensor {
        let shape = array.shape().to_vec();
        let data: Vec<T> = array.iter().copied().collect();
        Tensor::from_vec(data, &shape).expect("an ndarray's element count matches its shape")
    }
}

/// Whether two different indices could reach the same element: a stride of 0 on a
/// dimension longer than 1, or strides too small to keep dimensions apart.
fn has_overlap(shape: &[usize], strides: &[usize]) -> bool {
    let mut dims: Vec<(usize, usize)> =
        shape.iter().copied().zip(strides.iter().copied()).filter(|(d, _)| *d > 1).collect();
    dims.sort_by_key(|&(_, s)| s);
    let mut extent = 0usize; // largest offset reachable by the dimensions seen so far
    for (d, s) in dims {
        if s <= extent {
            return true;
        }
        extent += (d - 1) * s;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    #[test]
    fn views_match_ndarray() {
        let a = ndarray::Array::from_shape_vec((2, 3), (0..6).map(|v| v as f32).collect::<Vec<_>>()).unwrap();
        let t = Tensor::from_array(&a);
        let tt = t.t().unwrap();
        assert_eq!(tt.view::<f32>().unwrap(), a.t().into_dyn());
        let mut base = Tensor::zeros(&[2, 3], DType::F32);
        base.view_mut::<f32>().unwrap()[[1, 2]] = 5.0;
        assert_eq!(base.to_vec::<f32>().unwrap()[5], 5.0);
    }

    #[test]
    fn overlap_detection() {
        assert!(!has_overlap(&[2, 3], &[3, 1]));
        assert!(has_overlap(&[2, 3], &[1, 1]));
        assert!(has_overlap(&[4], &[0]));
        assert!(!has_overlap(&[1, 4], &[0, 1]));
    }
}
