//! Reading and writing elements.

use super::Tensor;
use crate::{DType, Element, Error, Result};

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

impl Tensor {
    /// Address of the element at storage offset `elem` (in elements).
    fn elem_ptr(&self, elem: usize) -> *mut u8 {
        // SAFETY: callers only pass offsets of this view's elements, which `check_bounds`
        // (run on every tensor's construction) keeps inside the storage.
        unsafe { self.storage.as_ptr().add(elem * self.dtype.size()) }
    }

    /// The bytes of a contiguous view.
    fn contiguous_bytes(&self) -> Result<&[u8]> {
        self.check_cpu()?;
        self.check_contiguous()?;
        let len = self.numel() * self.dtype.size();
        // SAFETY: the view is contiguous and in bounds, so its `len` bytes start at its
        // offset and lie in the storage, which `self` keeps alive for the borrow.
        Ok(unsafe { std::slice::from_raw_parts(self.elem_ptr(self.offset), len) })
    }

    /// The elements of a contiguous tensor.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        self.check_dtype::<T>()?;
        let bytes = self.contiguous_bytes()?;
        bytemuck::checked::try_cast_slice(bytes).map_err(|e| bad_bits::<T>(e))
    }

    /// The elements of a contiguous tensor, to write.
    ///
    /// Other handles of the same storage (clones, views, other processes) see the writes;
    /// see [`crate::Storage`] on aliasing.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        self.check_dtype::<T>()?;
        self.check_cpu()?;
        self.check_contiguous()?;
        let len = self.numel() * self.dtype.size();
        // SAFETY: as in `contiguous_bytes`; `&mut self` makes this handle's borrow unique.
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.elem_ptr(self.offset), len) };
        bytemuck::checked::try_cast_slice_mut(bytes).map_err(|e| bad_bits::<T>(e))
    }

    /// A copy of the elements in row-major order, whatever the strides.
    /// A CUDA tensor is copied to the host first.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        self.check_dtype::<T>()?;
        #[cfg(feature = "cuda")]
        if let crate::Device::Cuda(_) = self.device {
            return self.to_cpu()?.to_vec();
        }
        self.check_cpu()?;
        let mut out = Vec::with_capacity(self.numel());
        let mut bad = false;
        for_each_offset(&self.shape, &self.strides, self.offset, |o| {
            // SAFETY: `o` is an element of this view (in bounds, see elem_ptr); the bytes
            // are initialised. An unaligned read suits any element type.
            let bits = unsafe { self.elem_ptr(o).cast::<T::Bits>().read_unaligned() };
            if T::is_valid_bit_pattern(&bits) {
                // SAFETY: the bit pattern was just checked to be a valid T.
                out.push(unsafe { std::mem::transmute_copy::<T::Bits, T>(&bits) });
            } else {
                bad = true;
            }
        });
        if bad {
            return Err(bad_bits::<T>(bytemuck::checked::CheckedCastError::InvalidBitPattern));
        }
        Ok(out)
    }

    /// The elements' bytes in row-major order (a copy), whatever the strides. A CUDA tensor
    /// is copied to the host first.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        #[cfg(feature = "cuda")]
        if let crate::Device::Cuda(_) = self.device {
            return self.to_cpu()?.to_bytes();
        }
        self.check_cpu()?;
        if let Ok(b) = self.contiguous_bytes() {
            return Ok(b.to_vec());
        }
        let size = self.dtype.size();
        let mut out = Vec::with_capacity(self.numel() * size);
        for_each_offset(&self.shape, &self.strides, self.offset, |o| {
            // SAFETY: `o` is an element of this view; its `size` bytes are in bounds.
            out.extend_from_slice(unsafe { std::slice::from_raw_parts(self.elem_ptr(o), size) });
        });
        Ok(out)
    }

    /// Sets every element of this view to `value` (any strides; a CUDA view must be
    /// contiguous).
    pub fn fill<T: Element>(&mut self, value: T) -> Result<&mut Self> {
        self.check_dtype::<T>()?;
        #[cfg(feature = "cuda")]
        if let crate::Device::Cuda(_) = self.device {
            self.fill_device(bytemuck::bytes_of(&value))?;
            return Ok(self);
        }
        self.check_cpu()?;
        if self.is_contiguous() {
            let p = self.elem_ptr(self.offset).cast::<T>();
            for i in 0..self.numel() {
                // SAFETY: the view is contiguous and in bounds, so its numel elements start
                // at p; p is aligned for T (aligned storage, whole-element offset). Writing
                // through the raw pointer never reads the old (possibly stale) bytes.
                unsafe { p.add(i).write(value) };
            }
            return Ok(self);
        }
        let bytes = bytemuck::bytes_of(&value);
        self.fill_bytes(bytes);
        Ok(self)
    }

    pub(crate) fn fill_one(&mut self) {
        fn one<T: Element>() -> Vec<u8> {
            bytemuck::bytes_of(&T::ONE).to_vec()
        }
        let bytes = match self.dtype {
            DType::Bool => one::<bool>(),
            DType::U8 => one::<u8>(),
            DType::I8 => one::<i8>(),
            DType::I16 => one::<i16>(),
            DType::I32 => one::<i32>(),
            DType::I64 => one::<i64>(),
            DType::F16 => one::<half::f16>(),
            DType::BF16 => one::<half::bf16>(),
            DType::F32 => one::<f32>(),
            DType::F64 => one::<f64>(),
        };
        self.fill_bytes(&bytes);
    }

    fn fill_bytes(&mut self, bytes: &[u8]) {
        debug_assert_eq!(bytes.len(), self.dtype.size());
        let (shape, strides, offset) = (self.shape.clone(), self.strides.clone(), self.offset);
        for_each_offset(&shape, &strides, offset, |o| {
            // SAFETY: `o` is an element of this view, in bounds; `bytes` is one element.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.elem_ptr(o), bytes.len()) };
        });
    }

    /// Copies the elements of `self` into `dst` (same shape and dtype, any strides).
    pub fn copy_into(&self, dst: &mut Tensor) -> Result<()> {
        if self.shape != dst.shape || self.dtype != dst.dtype {
            return Err(Error::shape(format!(
                "copy: source is {} {:?}, destination is {} {:?}",
                self.dtype, self.shape, dst.dtype, dst.shape
            )));
        }
        self.check_cpu()?;
        dst.check_cpu()?;
        let bytes = self.to_bytes()?;
        let size = self.dtype.size();
        let mut i = 0;
        let (shape, strides, offset) = (dst.shape.clone(), dst.strides.clone(), dst.offset);
        for_each_offset(&shape, &strides, offset, |o| {
            // SAFETY: `o` is an element of dst, in bounds; bytes holds numel * size bytes.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr().add(i * size), dst.elem_ptr(o), size) };
            i += 1;
        });
        Ok(())
    }

    /// Whether both tensors are on one device and have the same dtype, shape and element
    /// bytes (torch's `equal`). Meta tensors are equal when dtype and shape are.
    pub fn equal(&self, other: &Tensor) -> bool {
        if self.dtype != other.dtype || self.shape != other.shape || self.device != other.device {
            return false;
        }
        if self.device == crate::Device::Meta {
            return true;
        }
        matches!((self.to_bytes(), other.to_bytes()), (Ok(a), Ok(b)) if a == b)
    }
}

fn bad_bits<T: Element>(e: bytemuck::checked::CheckedCastError) -> Error {
    Error::shape(format!("the tensor's bytes are not valid {} values: {e}", T::DTYPE))
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn slices_need_dtype_and_contiguity() {
        let mut t = Tensor::zeros(&[2, 2], DType::F32);
        assert!(matches!(t.as_slice::<f64>(), Err(Error::DTypeMismatch { .. })));
        t.as_mut_slice::<f32>().unwrap()[3] = 7.0;
        let tt = t.t().unwrap();
        assert!(matches!(tt.as_slice::<f32>(), Err(Error::NotContiguous { .. })));
        assert_eq!(tt.to_vec::<f32>().unwrap(), vec![0.0, 0.0, 0.0, 7.0]);
    }

    #[test]
    fn bool_bytes_are_checked() {
        let mut t = Tensor::zeros(&[3], DType::U8);
        t.as_mut_slice::<u8>().unwrap()[1] = 2;
        let b = Tensor::from_storage(t.storage().clone(), DType::Bool, &[3], &[1], 0).unwrap();
        assert!(b.as_slice::<bool>().is_err());
        assert!(b.to_vec::<bool>().is_err());
    }

    #[test]
    fn fill_a_strided_view_writes_through_to_the_base() {
        let base = Tensor::zeros(&[3, 3], DType::I32);
        let mut col = base.narrow(1, 1, 1).unwrap();
        col.fill(4i32).unwrap();
        assert_eq!(base.to_vec::<i32>().unwrap(), vec![0, 4, 0, 0, 4, 0, 0, 4, 0]);
    }
}
