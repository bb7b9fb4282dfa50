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

    /// The view's shape, strides and first element, for ndarray.
    fn raw_view<T: Element>(&self) -> (ndarray::StrideShape<IxDyn>, *mut T) {
        let shape = IxDyn(&self.shape).strides(IxDyn(&self.strides));
        (shape, self.elem_ptr(self.offset).cast::<T>())
    }

    /// An ndarray view of the elements, with this tensor's strides, borrowed without a
    /// copy. The elements are checked to be valid `T` values when the view is made.
    ///
    /// To read without a promise, copy ([`Tensor::to_vec`]).
    ///
    /// # Safety
    /// As [`Tensor::as_slice`]: while the view lives, nothing may write its elements
    /// through another handle, thread or process.
    ///
    /// # Errors
    /// If `T` is not the tensor's dtype, the tensor is not on the host, or an element is not
    /// a valid `T`.
    pub unsafe fn view<T: Element>(&self) -> Result<ArrayViewD<'_, T>> {
        self.check_view::<T>()?;
        let (shape, ptr) = self.raw_view::<T>();
        // SAFETY: every element of the view is in bounds of the storage (check_bounds), and
        // so is the first element's address of a view without elements; the elements are
        // aligned (64-byte aligned storage, whole-element offsets), valid values of T
        // (numeric types accept every bit pattern, bools were checked above), live as long
        // as `&self`, and nothing writes them meanwhile (the caller's promise). Strides are
        // non-negative, and the byte size and extent fit in isize (check_bounds).
        Ok(unsafe { ArrayViewD::from_shape_ptr(shape, ptr) })
    }

    /// A mutable ndarray view, borrowed without a copy. Other handles of the storage (in
    /// every process) see the writes.
    ///
    /// # Safety
    /// As [`Tensor::as_mut_slice`]: while the view lives, nothing else may read or write its
    /// elements through another handle, thread or process.
    ///
    /// # Errors
    /// As [`Tensor::view`], and if two indices of the view reach the same element.
    pub unsafe fn view_mut<T: Element>(&mut self) -> Result<ArrayViewMutD<'_, T>> {
        self.check_view::<T>()?;
        if has_overlap(&self.shape, &self.strides) {
            return Err(Error::shape(
                "view_mut",
                &self.shape,
                "a mutable view needs elements that do not overlap",
            ));
        }
        let (shape, ptr) = self.raw_view::<T>();
        // SAFETY: as in `view`; in addition the elements do not overlap (checked above), so
        // no two indices of the mutable view alias, `&mut self` makes this handle's borrow
        // unique, and the caller promises that nothing else accesses the elements.
        Ok(unsafe { ArrayViewMutD::from_shape_ptr(shape, ptr) })
    }

    /// A mutable ndarray view of a tensor nothing else can reach
    /// ([`Tensor::is_exclusive`]); safe, since the crate can prove the promise
    /// [`Tensor::view_mut`] asks for.
    ///
    /// # Errors
    /// [`Error::NotExclusive`] if other handles or processes can reach the storage; as
    /// [`Tensor::view_mut`] otherwise.
    pub fn exclusive_view_mut<T: Element>(&mut self) -> Result<ArrayViewMutD<'_, T>> {
        self.check_exclusive()?;
        // SAFETY: the storage is private and `self` holds its only handle, with no weak
        // reference (check_exclusive); `&mut self`, borrowed for the view's lifetime, is
        // needed to make another. So nothing else can access the elements meanwhile.
        unsafe { self.view_mut() }
    }

    /// A contiguous private tensor with a copy of an ndarray's elements.
    ///
    /// # Panics
    /// If the memory cannot be allocated (as `vec!`).
    pub fn from_array<T: Element, S: Data<Elem = T>, D: Dimension>(array: &ArrayBase<S, D>) -> Tensor {
        let shape = array.shape().to_vec();
        let data: Vec<T> = array.iter().copied().collect();
        Tensor::from_vec(data, &shape).unwrap_or_else(|e| panic!("Tensor::from_array: {e}"))
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
        // SAFETY: nothing writes t's storage while the view lives.
        assert_eq!(unsafe { tt.view::<f32>() }.unwrap(), a.t().into_dyn());
        let mut base = Tensor::zeros(&[2, 3], DType::F32);
        base.exclusive_view_mut::<f32>().unwrap()[[1, 2]] = 5.0;
        assert_eq!(base.to_vec::<f32>().unwrap()[5], 5.0);
        let other = base.clone();
        assert!(matches!(base.exclusive_view_mut::<f32>(), Err(Error::NotExclusive(_))));
        drop(other);
        assert!(base.exclusive_view_mut::<f32>().is_ok());
    }

    #[test]
    fn views_of_empty_tensors_are_empty() {
        let e = Tensor::zeros(&[0, 3], DType::F64);
        // SAFETY: nothing writes the (empty) storage while the view lives.
        assert_eq!(unsafe { e.view::<f64>() }.unwrap().len(), 0);
    }

    #[test]
    fn views_check_bools() {
        let mut bytes = Tensor::from_vec(vec![0u8, 1, 200], &[3]).unwrap();
        bytes.share_memory().unwrap();
        let b = Tensor::from_storage(bytes.storage().clone(), DType::Bool, &[3], &[1], 0).unwrap();
        // SAFETY: nothing writes the storage while the view would live.
        assert!(unsafe { b.view::<bool>() }.is_err());
    }

    #[test]
    fn overlap_detection() {
        assert!(!has_overlap(&[2, 3], &[3, 1]));
        assert!(has_overlap(&[2, 3], &[1, 1]));
        assert!(has_overlap(&[4], &[0]));
        assert!(!has_overlap(&[1, 4], &[0, 1]));
    }
}
