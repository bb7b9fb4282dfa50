//! Making tensors: from values, zeros and ones, in shared memory, on the meta device, or
//! over an existing [`Storage`] with explicit geometry (checked against it).

use super::geometry::{byte_len, check_bounds, checked_numel, contiguous_strides};
use super::{Dims, Tensor, TensorKind};
use crate::{get_sharing_strategy, DType, Device, Element, Error, Result, SharingStrategy, Storage};

impl Tensor {
    pub(crate) fn from_parts(storage: Storage, dtype: DType, shape: Dims) -> Tensor {
        let storage_device = storage.device();
        let strides = contiguous_strides(&shape);
        Tensor {
            storage,
            dtype,
            shape,
            strides,
            offset: 0,
            requires_grad: false,
            kind: TensorKind::Tensor,
            device: storage_device,
        }
    }

    /// A contiguous private tensor of `shape`, taking the values of `data`.
    pub fn from_vec<T: Element>(data: Vec<T>, shape: &[usize]) -> Result<Tensor> {
        Tensor::from_slice(&data, shape)
    }

    /// A contiguous private tensor of `shape`, with a copy of `data`.
    pub fn from_slice<T: Element>(data: &[T], shape: &[usize]) -> Result<Tensor> {
        let n = checked_numel(shape)?;
        if n != data.len() {
            return Err(Error::shape(
                "from_slice",
                shape,
                format!("shape {shape:?} has {n} elements, but {} values were given", data.len()),
            ));
        }
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let storage = Storage::try_new(bytes.len())?;
        // SAFETY: the storage is fresh, private and exactly bytes.len() long; no other
        // handle to it exists yet.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), storage.as_mut_ptr(), bytes.len()) };
        Ok(Tensor::from_parts(storage, T::DTYPE, shape.into()))
    }

    /// A private tensor of zeros.
    ///
    /// # Panics
    /// If the byte size of `shape` overflows, or the memory cannot be allocated (as `vec!`
    /// does); [`Tensor::try_zeros`] returns an error instead.
    pub fn zeros(shape: &[usize], dtype: DType) -> Tensor {
        Tensor::try_zeros(shape, dtype).unwrap_or_else(|e| panic!("Tensor::zeros({shape:?}): {e}"))
    }

    /// A private tensor of zeros, or an error if its byte size overflows or its memory
    /// cannot be allocated.
    pub fn try_zeros(shape: &[usize], dtype: DType) -> Result<Tensor> {
        let storage = Storage::try_new(byte_len(shape, dtype)?)?;
        Ok(Tensor::from_parts(storage, dtype, shape.into()))
    }

    /// A private tensor of ones.
    ///
    /// # Panics
    /// As [`Tensor::zeros`].
    pub fn ones(shape: &[usize], dtype: DType) -> Tensor {
        let mut t = Tensor::zeros(shape, dtype);
        t.fill_one();
        t
    }

    /// A private tensor of `shape` filled with `value`.
    ///
    /// # Panics
    /// As [`Tensor::zeros`].
    pub fn full<T: Element>(shape: &[usize], value: T) -> Tensor {
        let mut t = Tensor::zeros(shape, T::DTYPE);
        t.fill(value).expect("a fresh contiguous tensor of the value's dtype");
        t
    }

    /// A contiguous tensor in shared memory (current strategy). Its contents are
    /// unspecified (zeros, or bytes of an earlier tensor whose block is reused): write
    /// before reading. The way to make tensors that will be sent.
    pub fn empty_shared(shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::empty_shared_with(shape, dtype, get_sharing_strategy())
    }

    /// [`Tensor::empty_shared`] with an explicit strategy.
    pub fn empty_shared_with(shape: &[usize], dtype: DType, strategy: SharingStrategy) -> Result<Tensor> {
        let storage = Storage::empty_shared_with(byte_len(shape, dtype)?, strategy)?;
        Ok(Tensor::from_parts(storage, dtype, shape.into()))
    }

    /// A tensor in shared memory filled with zeros.
    pub fn zeros_shared(shape: &[usize], dtype: DType) -> Result<Tensor> {
        let storage = Storage::new_shared(byte_len(shape, dtype)?)?;
        Ok(Tensor::from_parts(storage, dtype, shape.into()))
    }

    /// A tensor on the meta device: a shape and a dtype, no data.
    ///
    /// # Panics
    /// If the number of elements or the byte size of `shape` overflows (as a tensor with
    /// data would); [`Tensor::try_meta`] returns an error instead.
    pub fn meta(shape: &[usize], dtype: DType) -> Tensor {
        Tensor::try_meta(shape, dtype).unwrap_or_else(|e| panic!("Tensor::meta({shape:?}): {e}"))
    }

    /// A tensor on the meta device, or an error if its number of elements or byte size
    /// overflows: a meta tensor stands for one that could exist, so [`Tensor::numel`] and
    /// the byte size are exact for it too.
    pub fn try_meta(shape: &[usize], dtype: DType) -> Result<Tensor> {
        byte_len(shape, dtype)?;
        let mut t = Tensor::from_parts(Storage::try_new(0)?, dtype, shape.into());
        t.device = Device::Meta;
        Ok(t)
    }

    /// A tensor on the meta device with explicit strides (in elements), as torch's
    /// `empty_strided(..., device="meta")` makes: an error if `strides` has not one entry
    /// per dimension, or the size overflows as [`Tensor::try_meta`] says.
    pub fn try_meta_strided(shape: &[usize], strides: &[usize], dtype: DType) -> Result<Tensor> {
        if strides.len() != shape.len() {
            return Err(Error::invalid_argument(
                "meta tensor strides",
                format!("{} strides for {} dimensions", strides.len(), shape.len()),
            ));
        }
        let mut t = Tensor::try_meta(shape, dtype)?;
        t.strides = strides.into();
        Ok(t)
    }

    /// A tensor viewing `storage` with explicit geometry; checked against the storage.
    pub fn from_storage(
        storage: Storage,
        dtype: DType,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
    ) -> Result<Tensor> {
        Tensor::from_storage_owned(storage, dtype, shape.into(), strides.into(), offset)
    }

    /// As [`Tensor::from_storage`], keeping the geometry it is given (a received tensor's).
    pub(crate) fn from_storage_owned(
        storage: Storage,
        dtype: DType,
        shape: Dims,
        strides: Dims,
        offset: usize,
    ) -> Result<Tensor> {
        check_bounds(storage.len(), dtype, &shape, &strides, offset)?;
        // Every host storage made here is 64-byte aligned; one received from a peer whose
        // arena header claims an odd slot size would not be, and element accesses (the
        // atomic view, zero-copy borrows) rely on elements aligned to their size.
        if storage.device() == Device::Cpu && storage.as_ptr() as usize % crate::storage::ALIGN != 0 {
            return Err(Error::invalid(format!(
                "a storage at {:#x} is not {}-byte aligned",
                storage.as_ptr() as usize,
                crate::storage::ALIGN
            )));
        }
        let device = storage.device();
        Ok(Tensor {
            storage,
            dtype,
            shape,
            strides,
            offset,
            requires_grad: false,
            kind: TensorKind::Tensor,
            device,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constructors_set_shape_and_strides() {
        let t = Tensor::zeros(&[2, 3, 4], DType::F32);
        assert_eq!(t.strides(), &[12, 4, 1]);
        assert_eq!(t.numel(), 24);
        assert!(t.is_contiguous());
        assert!(!t.is_shared());
        let f = Tensor::full(&[3], 2.5f64);
        assert_eq!(f.to_vec::<f64>().unwrap(), vec![2.5; 3]);
        let e = Tensor::from_vec(vec![1i64, 2, 3], &[4]).unwrap_err();
        assert!(e.to_string().contains("4 elements"), "{e}");
    }

    #[test]
    fn sizes_that_overflow_are_errors() {
        assert!(Tensor::empty_shared(&[usize::MAX], DType::U8).is_err());
        assert!(Tensor::empty_shared(&[1 << 62], DType::F32).is_err());
        assert!(Tensor::try_zeros(&[usize::MAX, 2], DType::U8).is_err());
        assert!(Tensor::try_zeros(&[1 << 62], DType::I64).is_err());
        assert!(matches!(Tensor::try_zeros(&[1 << 60], DType::U8), Err(Error::AllocationFailed { .. })));
        assert!(Storage::empty_shared_with(usize::MAX, SharingStrategy::FileDescriptor).is_err());
        assert!(Storage::try_new(usize::MAX).is_err());
    }

    #[test]
    fn meta_tensors_have_an_exact_numel() {
        assert!(Tensor::try_meta(&[usize::MAX, 2], DType::U8).is_err());
        assert!(Tensor::try_meta(&[1 << 62], DType::F32).is_err(), "the byte size overflows");
        let t = Tensor::try_meta(&[1 << 40, 1 << 20], DType::U8).unwrap();
        assert_eq!(t.numel(), 1 << 60);
        assert!(std::panic::catch_unwind(|| Tensor::meta(&[usize::MAX, 2], DType::U8)).is_err());
    }

    #[test]
    fn meta_tensors_have_no_data() {
        let t = Tensor::meta(&[3, 4], DType::F16);
        assert_eq!(t.device(), Device::Meta);
        assert!(matches!(t.to_vec::<half::f16>(), Err(Error::Device(_))));
    }
}
