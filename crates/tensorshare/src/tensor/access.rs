//! Reading and writing elements by copying: safe whatever other handles do meanwhile.
//!
//! Every access to the elements here goes through [`crate::atomic_bytes`] (atomic word
//! operations), never through a reference: another handle, thread or process may write the
//! same bytes at the same time, and that must not be a data race. What is read is copied
//! into private memory first and validated there (a `bool` must be 0 or 1).

use super::elements::{for_each_offset, try_vec_with_capacity};
use super::Tensor;
use crate::atomic_bytes;
use crate::{DType, Element, Error, Result};

/// Bytes read or written at a time through a private buffer.
const CHUNK: usize = 4096;

impl Tensor {
    /// Reads the elements of this host view in row-major order into a private buffer, a
    /// chunk of whole elements at a time, and hands each chunk to `f`.
    fn read_chunks(&self, mut f: impl FnMut(&[u8])) {
        let size = self.dtype.size();
        let mut buf = [0u8; CHUNK];
        if self.is_contiguous() {
            let total = self.numel() * size;
            let base = self.elem_ptr(self.offset);
            let mut done = 0;
            while done < total {
                let n = CHUNK.min(total - done);
                // SAFETY: the view is contiguous, so its numel * size bytes start at its first
                // element and lie in the host storage (check_bounds, check_cpu by the
                // caller), which `self` keeps alive; done + n <= total.
                unsafe { atomic_bytes::load(base.add(done), &mut buf[..n]) };
                f(&buf[..n]);
                done += n;
            }
            return;
        }
        let mut n = 0;
        for_each_offset(&self.shape, &self.strides, self.offset, |o| {
            // SAFETY: `o` is an element of this view: its size bytes lie in the host
            // storage (check_bounds), which `self` keeps alive. CHUNK is a multiple of
            // every element size, so the element fits in the buffer.
            unsafe { atomic_bytes::load(self.elem_ptr(o), &mut buf[n..n + size]) };
            n += size;
            if n == CHUNK {
                f(&buf);
                n = 0;
            }
        });
        if n > 0 {
            f(&buf[..n]);
        }
    }

    /// Writes `bytes` (numel * size bytes, row-major) into the elements of this host view.
    fn write_elements(&mut self, bytes: &[u8]) {
        let size = self.dtype.size();
        debug_assert_eq!(bytes.len(), self.numel() * size);
        if self.is_contiguous() {
            // SAFETY: the view is contiguous, so its numel * size bytes (= bytes.len()) start
            // at its first element and lie in the host storage (check_bounds, check_cpu by
            // the caller), which `self` keeps alive.
            unsafe { atomic_bytes::store(self.elem_ptr(self.offset), bytes) };
            return;
        }
        let mut chunks = bytes.chunks_exact(size);
        for_each_offset(&self.shape, &self.strides, self.offset, |o| {
            if let Some(value) = chunks.next() {
                // SAFETY: `o` is an element of this view: its size bytes lie in the host
                // storage (check_bounds), which `self` keeps alive.
                unsafe { atomic_bytes::store(self.elem_ptr(o), value) };
            }
        });
    }

    /// A copy of the elements in row-major order, whatever the strides.
    /// A CUDA tensor is copied to the host first.
    ///
    /// Safe whatever other handles do meanwhile: a concurrent writer (another thread or
    /// process) can make the copy a mix of old and new values, and a byte that is not a
    /// valid `T` (a `bool` other than 0 or 1) is an error.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        self.check_dtype::<T>()?;
        #[cfg(feature = "cuda")]
        if let crate::Device::Cuda(_) = self.device {
            return self.to_cpu()?.to_vec();
        }
        self.check_cpu()?;
        let mut out = try_vec_with_capacity(self.numel())?;
        let mut bad = None;
        self.read_chunks(|chunk| {
            for bits in chunk.chunks_exact(self.dtype.size()) {
                match bytemuck::checked::try_pod_read_unaligned::<T>(bits) {
                    Ok(v) => out.push(v),
                    Err(e) => bad = Some(e),
                }
            }
        });
        match bad {
            Some(e) => Err(bad_bits::<T>(e)),
            None => Ok(out),
        }
    }

    /// The elements' bytes in row-major order (a copy), whatever the strides. A CUDA tensor
    /// is copied to the host first. Safe whatever other handles do meanwhile (see
    /// [`Tensor::to_vec`]).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        #[cfg(feature = "cuda")]
        if let crate::Device::Cuda(_) = self.device {
            return self.to_cpu()?.to_bytes();
        }
        self.check_cpu()?;
        let mut out = try_vec_with_capacity(self.numel() * self.dtype.size())?;
        self.read_chunks(|chunk| out.extend_from_slice(chunk));
        Ok(out)
    }

    /// Copies `src` into the elements of this view, in row-major order, whatever the
    /// strides (the view's storage may be shared: every handle sees the new values). Safe
    /// whatever other handles do meanwhile.
    pub fn copy_from_slice<T: Element>(&mut self, src: &[T]) -> Result<()> {
        self.check_dtype::<T>()?;
        self.check_cpu()?;
        if src.len() != self.numel() {
            return Err(Error::shape(
                "copy_from_slice",
                &self.shape,
                format!(
                    "{} values for a view of shape {:?} ({} elements)",
                    src.len(),
                    self.shape,
                    self.numel()
                ),
            ));
        }
        self.write_elements(bytemuck::cast_slice(src));
        Ok(())
    }

    /// Sets every element of this view to `value` (any strides; a CUDA view must be
    /// contiguous). Safe whatever other handles do meanwhile.
    pub fn fill<T: Element>(&mut self, value: T) -> Result<&mut Self> {
        self.check_dtype::<T>()?;
        #[cfg(feature = "cuda")]
        if let crate::Device::Cuda(_) = self.device {
            self.fill_device(bytemuck::bytes_of(&value))?;
            return Ok(self);
        }
        self.check_cpu()?;
        self.fill_bytes(bytemuck::bytes_of(&value));
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
        if self.check_cpu().is_ok() {
            self.fill_bytes(&bytes);
        }
    }

    /// Writes the element `value` (one element's bytes) to every element of this host view.
    fn fill_bytes(&mut self, value: &[u8]) {
        let size = self.dtype.size();
        debug_assert_eq!(value.len(), size);
        if !self.is_contiguous() {
            for_each_offset(&self.shape, &self.strides, self.offset, |o| {
                // SAFETY: `o` is an element of this view: its size bytes lie in the host
                // storage (check_bounds, check_cpu by the caller), which `self` keeps alive.
                unsafe { atomic_bytes::store(self.elem_ptr(o), value) };
            });
            return;
        }
        // Element sizes divide 8 and storages are 64-byte aligned, so every word of the view
        // holds the same bytes: one pattern word, stored word by word.
        let total = self.numel() * size;
        let mut word = [0u8; 8];
        for (k, b) in word.iter_mut().enumerate() {
            *b = value[k % size];
        }
        // SAFETY: the view is contiguous, so its total bytes start at its first element and
        // lie in the host storage (check_bounds, check_cpu by the caller), which `self` keeps
        // alive; element k of the view starts at an address equal to k * size modulo 8
        // (aligned storage, whole-element offset), so `word` holds its bytes at their places.
        unsafe { atomic_bytes::fill(self.elem_ptr(self.offset), total, word) };
    }

    /// Copies the elements of `self` into `dst` (same shape and dtype, any strides; the two
    /// may overlap: the elements are read in full before any is written). Safe whatever
    /// other handles do meanwhile.
    pub fn copy_into(&self, dst: &mut Tensor) -> Result<()> {
        if self.shape != dst.shape || self.dtype != dst.dtype {
            return Err(Error::shape(
                "copy_into",
                &self.shape,
                format!(
                    "source is {} {:?}, destination is {} {:?}",
                    self.dtype, self.shape, dst.dtype, dst.shape
                ),
            ));
        }
        self.check_cpu()?;
        dst.check_cpu()?;
        let bytes = self.to_bytes()?;
        dst.write_elements(&bytes);
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

pub(super) fn bad_bits<T: Element>(e: bytemuck::checked::CheckedCastError) -> Error {
    Error::InvalidValue { dtype: T::DTYPE, reason: e.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bool_bytes_are_checked() {
        let mut t = Tensor::zeros(&[3], DType::U8);
        t.copy_from_slice(&[0u8, 2, 1]).unwrap();
        let b = Tensor::from_storage(t.storage().clone(), DType::Bool, &[3], &[1], 0).unwrap();
        assert!(b.to_vec::<bool>().is_err());
        b.narrow(0, 1, 1).unwrap().fill(true).unwrap();
        assert_eq!(b.to_vec::<bool>().unwrap(), vec![false, true, true]);
    }

    #[test]
    fn copy_from_slice_fills_strided_views_and_checks_its_length() {
        let base = Tensor::zeros(&[2, 3], DType::I64);
        let mut col = base.narrow(1, 1, 1).unwrap();
        col.copy_from_slice(&[7i64, 8]).unwrap();
        assert_eq!(base.to_vec::<i64>().unwrap(), vec![0, 7, 0, 0, 8, 0]);
        let mut t = base.t().unwrap();
        t.copy_from_slice(&[1i64, 2, 3, 4, 5, 6]).unwrap();
        assert_eq!(base.to_vec::<i64>().unwrap(), vec![1, 3, 5, 2, 4, 6]);
        assert!(col.copy_from_slice(&[1i64]).unwrap_err().to_string().contains("1 values"));
        assert!(matches!(col.copy_from_slice(&[1i32, 2]), Err(Error::DTypeMismatch { .. })));
        let mut meta = Tensor::meta(&[2], DType::I64);
        assert!(matches!(meta.copy_from_slice(&[1i64, 2]), Err(Error::Device(_))));
    }

    #[test]
    fn copies_of_large_unaligned_views_round_trip() {
        // Odd sizes and offsets exercise the partial words at both ends and several chunks.
        let n = 3 * CHUNK + 5;
        let data: Vec<u8> = (0..n).map(|i| (i * 7) as u8).collect();
        let base = Tensor::zeros(&[n + 3], DType::U8);
        let mut v = base.narrow(0, 3, n).unwrap();
        v.copy_from_slice(&data).unwrap();
        assert_eq!(v.to_vec::<u8>().unwrap(), data);
        assert_eq!(&base.to_bytes().unwrap()[..3], &[0, 0, 0]);
        v.fill(9u8).unwrap();
        assert!(v.to_bytes().unwrap().iter().all(|b| *b == 9));
        assert_eq!(&base.to_bytes().unwrap()[..3], &[0, 0, 0]);
    }

    #[test]
    fn fill_a_strided_view_writes_through_to_the_base() {
        let base = Tensor::zeros(&[3, 3], DType::I32);
        let mut col = base.narrow(1, 1, 1).unwrap();
        col.fill(4i32).unwrap();
        assert_eq!(base.to_vec::<i32>().unwrap(), vec![0, 4, 0, 0, 4, 0, 0, 4, 0]);
    }

    /// Two threads reading and writing clones of one private tensor at once, through the
    /// safe copies: no data race (Miri checks this test), and no torn element.
    #[test]
    fn safe_copies_through_clones_race_without_tearing() {
        const A: i64 = 0x0101_0101_0101_0101;
        const B: i64 = -0x0202_0202_0202_0203;
        let rounds = if cfg!(miri) { 4 } else { 200 };
        let t = Tensor::full(&[67], A);
        std::thread::scope(|s| {
            let mut writer = t.clone();
            s.spawn(move || {
                for i in 0..rounds {
                    if i % 2 == 0 {
                        writer.copy_from_slice(&[B; 67]).unwrap();
                    } else {
                        writer.fill(A).unwrap();
                    }
                }
            });
            let mut bytes = Tensor::from_storage(t.storage().clone(), DType::U8, &[9], &[60], 1).unwrap();
            s.spawn(move || {
                for _ in 0..rounds {
                    // Another dtype over the same bytes: still whole-word atomics.
                    bytes.fill(1u8).unwrap();
                }
            });
            let reader = t.narrow(0, 3, 60).unwrap();
            s.spawn(move || {
                for _ in 0..rounds {
                    assert!(reader.to_vec::<i64>().unwrap().len() == 60);
                    assert!(reader.storage().to_bytes().len() == 67 * 8);
                }
            });
        });
        // The u8 writer touched one byte of every 60th; the rest is whole A or B elements.
        let v = t.to_vec::<i64>().unwrap();
        assert!(v.iter().all(|x| *x == A || *x == B || x.to_ne_bytes().contains(&1)));
    }

    #[test]
    fn overlapping_copy_into_reads_everything_first() {
        let base = Tensor::from_vec(vec![1i32, 2, 3, 4], &[4]).unwrap();
        let src = base.narrow(0, 0, 3).unwrap();
        let mut dst = base.narrow(0, 1, 3).unwrap();
        src.copy_into(&mut dst).unwrap();
        assert_eq!(base.to_vec::<i32>().unwrap(), vec![1, 1, 2, 3]);
    }
}
