//! ndarray views (feature `ndarray`, on by default).
//!
//! `view`/`view_mut` (any number of dimensions) and `view_dim`/`view_mut_dim` (the number
//! of dimensions in the type: `Ix2`, `Ix4`, ...) borrow the tensor's elements without a
//! copy, and are `unsafe`: the elements may be written through other handles and processes
//! (see `borrow`). `to_array` and `from_array` copy, and are safe.

use ndarray::{
    Array, ArrayBase, ArrayView, ArrayViewD, ArrayViewMut, ArrayViewMutD, Data, Dimension, IxDyn,
    ShapeBuilder,
};

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

    /// Checks that the tensor has as many dimensions as `D` (any number for `IxDyn`).
    fn check_ndim<D: Dimension>(&self, op: &'static str) -> Result<()> {
        match D::NDIM {
            Some(n) if n != self.ndim() => Err(Error::shape(
                op,
                &self.shape,
                format!(
                    "a {n}-dimensional array was asked for, but the tensor has {} dimensions (shape {:?})",
                    self.ndim(),
                    self.shape
                ),
            )),
            _ => Ok(()),
        }
    }

    /// [`Tensor::view`] with the number of dimensions in the type: an `ArrayView2` for a
    /// matrix, an `ArrayView4` for a batch of images, borrowed without a copy.
    ///
    /// ```
    /// use tensorshare::ndarray::Ix2;
    /// use tensorshare::Tensor;
    /// # fn main() -> tensorshare::Result<()> {
    /// let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
    /// // SAFETY: no other handle of t's storage exists that could write it meanwhile.
    /// let m = unsafe { t.view_dim::<f32, Ix2>()? };
    /// assert_eq!(m[[1, 2]], 6.0);
    /// assert_eq!(m.column(0).sum(), 5.0);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Safety
    /// As [`Tensor::view`]: while the view lives, nothing may write its elements through
    /// another handle, thread or process.
    ///
    /// # Errors
    /// [`Error::Shape`] if the tensor does not have `D`'s number of dimensions; as
    /// [`Tensor::view`] otherwise.
    pub unsafe fn view_dim<T: Element, D: Dimension>(&self) -> Result<ArrayView<'_, T, D>> {
        self.check_ndim::<D>("view_dim")?;
        // SAFETY: the caller's promise is the one `view` asks for.
        let view = unsafe { self.view::<T>() }?;
        view.into_dimensionality::<D>().map_err(|e| Error::shape("view_dim", &self.shape, e.to_string()))
    }

    /// [`Tensor::view_mut`] with the number of dimensions in the type, borrowed without a
    /// copy. Other handles of the storage (in every process) see the writes.
    ///
    /// # Safety
    /// As [`Tensor::view_mut`]: while the view lives, nothing else may read or write its
    /// elements through another handle, thread or process.
    ///
    /// # Errors
    /// [`Error::Shape`] if the tensor does not have `D`'s number of dimensions; as
    /// [`Tensor::view_mut`] otherwise.
    pub unsafe fn view_mut_dim<T: Element, D: Dimension>(&mut self) -> Result<ArrayViewMut<'_, T, D>> {
        self.check_ndim::<D>("view_mut_dim")?;
        let shape = self.shape.clone();
        // SAFETY: the caller's promise is the one `view_mut` asks for.
        let view = unsafe { self.view_mut::<T>() }?;
        view.into_dimensionality::<D>().map_err(|e| Error::shape("view_mut_dim", &shape, e.to_string()))
    }

    /// A copy of the elements as an owned ndarray array of `D` dimensions (row-major,
    /// whatever the tensor's strides; a CUDA tensor is copied from its device). Safe
    /// whatever other handles do meanwhile, as [`Tensor::to_vec`].
    ///
    /// ```
    /// use tensorshare::ndarray::{array, Ix2};
    /// use tensorshare::Tensor;
    /// # fn main() -> tensorshare::Result<()> {
    /// let t = Tensor::from_vec(vec![1i64, 2, 3, 4, 5, 6], &[2, 3])?;
    /// assert_eq!(t.t()?.to_array::<i64, Ix2>()?, array![[1, 4], [2, 5], [3, 6]]);
    /// assert!(t.to_array::<i64, tensorshare::ndarray::Ix3>().is_err()); // two dimensions
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`Error::Shape`] if the tensor does not have `D`'s number of dimensions; as
    /// [`Tensor::to_vec`] otherwise.
    pub fn to_array<T: Element, D: Dimension>(&self) -> Result<Array<T, D>> {
        self.check_ndim::<D>("to_array")?;
        let data = self.to_vec::<T>()?;
        let array = Array::from_shape_vec(IxDyn(&self.shape), data)
            .map_err(|e| Error::shape("to_array", &self.shape, e.to_string()))?;
        array.into_dimensionality::<D>().map_err(|e| Error::shape("to_array", &self.shape, e.to_string()))
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
    fn typed_views_have_the_tensors_dimensions() {
        use ndarray::{Ix0, Ix1, Ix2, Ix3};
        let a = ndarray::Array::from_shape_vec((2, 3), (0..6).map(|v| v as f32).collect::<Vec<_>>()).unwrap();
        let t = Tensor::from_array(&a);
        let tt = t.t().unwrap();
        // SAFETY (all borrows in this test): one thread, and nothing writes the storage
        // while a view lives.
        assert_eq!(unsafe { tt.view_dim::<f32, Ix2>() }.unwrap(), a.t());
        assert_eq!(unsafe { tt.view_dim::<f32, IxDyn>() }.unwrap(), a.t().into_dyn());
        for wrong in
            [unsafe { t.view_dim::<f32, Ix3>() }.map(|_| ()), unsafe { t.view_dim::<f32, Ix1>() }.map(|_| ())]
        {
            let e = wrong.unwrap_err();
            assert!(matches!(&e, Error::Shape { op: "view_dim", .. }), "{e}");
            assert!(e.to_string().contains("has 2 dimensions (shape [2, 3])"), "{e}");
        }
        assert!(matches!(unsafe { t.view_dim::<f64, Ix2>() }, Err(Error::DTypeMismatch { .. })));
        let scalar = Tensor::from_vec(vec![7i32], &[]).unwrap();
        assert_eq!(unsafe { scalar.view_dim::<i32, Ix0>() }.unwrap()[()], 7);
    }

    #[test]
    fn typed_mutable_views_write_through() {
        use ndarray::{Ix2, Ix3};
        let base = Tensor::zeros(&[2, 3], DType::I16);
        let mut col = base.narrow(1, 2, 1).unwrap();
        // SAFETY: one thread; `base` is not read or written while the view lives.
        unsafe { col.view_mut_dim::<i16, Ix2>() }.unwrap().fill(9);
        assert_eq!(base.to_vec::<i16>().unwrap(), vec![0, 0, 9, 0, 0, 9]);
        // SAFETY: as above.
        let e = unsafe { col.view_mut_dim::<i16, Ix3>() }.unwrap_err();
        assert!(matches!(e, Error::Shape { op: "view_mut_dim", .. }), "{e}");
    }

    #[test]
    fn to_array_copies_any_strides_and_checks_dimensions() {
        use ndarray::{Ix1, Ix2, Ix4};
        let t = Tensor::from_vec((0..24).map(|v| v as f64).collect(), &[2, 3, 4]).unwrap();
        let p = t.permute(&[2, 0, 1]).unwrap();
        let expected =
            ndarray::Array::from_shape_vec((2, 3, 4), (0..24).map(|v| v as f64).collect()).unwrap();
        let got = p.to_array::<f64, ndarray::Ix3>().unwrap();
        assert_eq!(got, expected.permuted_axes([2, 0, 1]));
        assert!(got.is_standard_layout(), "a copy is row-major");
        assert_eq!(p.to_array::<f64, IxDyn>().unwrap().shape(), &[4, 2, 3]);
        let e = t.to_array::<f64, Ix4>().unwrap_err();
        assert!(
            matches!(&e, Error::Shape { op: "to_array", .. }) && e.to_string().contains("4-dimensional"),
            "{e}"
        );
        assert!(matches!(t.to_array::<f32, ndarray::Ix3>(), Err(Error::DTypeMismatch { .. })));
        let empty = Tensor::zeros(&[0, 5], DType::U8);
        assert_eq!(empty.to_array::<u8, Ix2>().unwrap().shape(), &[0, 5]);
        assert!(matches!(Tensor::meta(&[3], DType::U8).to_array::<u8, Ix1>(), Err(Error::Device(_))));
    }

    #[test]
    fn overlap_detection() {
        assert!(!has_overlap(&[2, 3], &[3, 1]));
        assert!(has_overlap(&[2, 3], &[1, 1]));
        assert!(has_overlap(&[4], &[0]));
        assert!(!has_overlap(&[1, 4], &[0, 1]));
    }
}
