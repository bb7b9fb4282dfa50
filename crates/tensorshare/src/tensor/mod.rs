//! [`Tensor`]: a dense, strided view of a [`Storage`].

mod access;
#[cfg(feature = "ndarray")]
mod array;
mod atomic;
mod borrow;
mod view;

pub use atomic::{AtomicElement, AtomicView};

use serde::{Deserialize, Serialize};

use crate::{get_sharing_strategy, DType, Element, Error, Result, SharingStrategy, Storage};

/// Where a tensor's data lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Device {
    /// Host memory (private or shared).
    Cpu,
    /// No data at all: shape and dtype only (torch's meta device).
    Meta,
    /// A CUDA device, by ordinal.
    Cuda(u32),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Meta => f.write_str("meta"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// Whether a tensor is a plain tensor or a model parameter (torch's `nn.Parameter`); the
/// kind travels with the tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum TensorKind {
    /// A plain tensor.
    #[default]
    Tensor,
    /// A parameter of a model.
    Parameter,
}

/// A dense, strided, n-dimensional view of a [`Storage`].
///
/// Cloning a tensor is cheap and gives another view of the same storage: writes through one
/// are seen through the other (torch's aliasing). Views (`narrow`, `select`, `transpose`,
/// `permute`, `reshape`) share the storage too; in a shared storage they alias it in every
/// process that holds it. See the crate docs on what is safe to do with aliased memory.
///
/// Sending a tensor that is not shared yet moves its storage into shared memory in place,
/// for every handle (as torch does). Its memory is given back as [`Storage`] describes.
///
/// Every tensor's number of elements and byte size fit in `isize` (constructors check it),
/// and every element it addresses lies in its storage.
#[derive(Clone)]
pub struct Tensor {
    pub(crate) storage: Storage,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    pub(crate) strides: Vec<usize>,
    pub(crate) offset: usize,
    pub(crate) requires_grad: bool,
    pub(crate) kind: TensorKind,
    pub(crate) device: Device,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tensor")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("strides", &self.strides)
            .field("offset", &self.offset)
            .field("device", &self.device)
            .field("shared", &self.is_shared())
            .field("kind", &self.kind)
            .field("requires_grad", &self.requires_grad)
            .finish()
    }
}

/// Strides of a contiguous (row-major) tensor of `shape`, in elements.
pub(crate) fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut acc = 1usize;
    for (s, &d) in strides.iter_mut().zip(shape).rev() {
        *s = acc;
        acc = acc.saturating_mul(d.max(1));
    }
    strides
}

/// `a * b` in the arithmetic of `shape`, as an error instead of an overflow.
fn checked_mul(a: usize, b: usize, shape: &[usize], what: &str) -> Result<usize> {
    a.checked_mul(b)
        .ok_or_else(|| Error::shape("size", shape, format!("{what} of shape {shape:?} overflows usize")))
}

/// Number of elements of `shape`, or an error if it overflows.
pub(crate) fn checked_numel(shape: &[usize]) -> Result<usize> {
    shape.iter().try_fold(1usize, |acc, &d| checked_mul(acc, d, shape, "the number of elements"))
}

/// Byte size of a tensor of `shape`, or an error if it overflows or exceeds `isize::MAX`
/// (the most any allocation, or a Rust slice, can hold).
pub(crate) fn byte_len(shape: &[usize], dtype: DType) -> Result<usize> {
    let len = checked_mul(checked_numel(shape)?, dtype.size(), shape, "the byte size")?;
    if len > isize::MAX as usize {
        return Err(Error::shape(
            "size",
            shape,
            format!("a {dtype} tensor of shape {shape:?} would need {len} bytes, more than any allocation can hold"),
        ));
    }
    Ok(len)
}

impl Tensor {
    pub(crate) fn from_parts(storage: Storage, dtype: DType, shape: Vec<usize>) -> Tensor {
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
        Ok(Tensor::from_parts(storage, T::DTYPE, shape.to_vec()))
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
        Ok(Tensor::from_parts(storage, dtype, shape.to_vec()))
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
        Ok(Tensor::from_parts(storage, dtype, shape.to_vec()))
    }

    /// A tensor in shared memory filled with zeros.
    pub fn zeros_shared(shape: &[usize], dtype: DType) -> Result<Tensor> {
        let storage = Storage::new_shared(byte_len(shape, dtype)?)?;
        Ok(Tensor::from_parts(storage, dtype, shape.to_vec()))
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
        let mut t = Tensor::from_parts(Storage::try_new(0)?, dtype, shape.to_vec());
        t.device = Device::Meta;
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
        check_bounds(storage.len(), dtype, shape, strides, offset)?;
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
        let mut t = Tensor::from_parts(storage, dtype, shape.to_vec());
        t.strides = strides.to_vec();
        t.offset = offset;
        Ok(t)
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The size of each dimension.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The step between neighbours along each dimension, in elements.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// Where the tensor's first element is in its storage, in elements.
    pub fn storage_offset(&self) -> usize {
        self.offset
    }

    /// The number of dimensions.
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// The number of elements. Exact: every constructor checks that it fits.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the elements are laid out row-major without gaps.
    pub fn is_contiguous(&self) -> bool {
        if self.shape.contains(&0) {
            return true;
        }
        let mut expected = 1usize;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d != 1 && s != expected {
                return false;
            }
            expected *= d;
        }
        true
    }

    /// The device.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The storage under this view.
    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// Whether the data is in shared memory. A CUDA tensor always is (torch: every CUDA
    /// tensor can be shared as it is).
    pub fn is_shared(&self) -> bool {
        match self.device {
            Device::Cpu => self.storage.is_shared(),
            Device::Cuda(_) => true,
            Device::Meta => false,
        }
    }

    /// Moves the storage into shared memory, in place (one copy): this tensor, and every
    /// other view of its storage, is shared afterwards. Does nothing if already shared, or
    /// on the meta device.
    pub fn share_memory(&mut self) -> Result<&mut Self> {
        self.share_memory_with(get_sharing_strategy())
    }

    /// [`Tensor::share_memory`] with an explicit strategy.
    pub fn share_memory_with(&mut self, strategy: SharingStrategy) -> Result<&mut Self> {
        if self.device != Device::Cpu || self.storage.is_shared() {
            return Ok(self);
        }
        if std::sync::Arc::get_mut(&mut self.storage.inner).is_some() {
            // No other handle: replace the storage and free the private bytes now.
            let fresh = Storage::empty_shared_with(self.storage.len(), strategy)?;
            // SAFETY: both storages have len bytes. This tensor holds the only handle of the
            // old one (no other strong or weak reference) and `&mut self` excludes any other
            // use of it; the new one is reachable from nowhere else yet.
            unsafe { std::ptr::copy_nonoverlapping(self.storage.as_ptr(), fresh.as_mut_ptr(), fresh.len()) };
            self.storage = fresh;
        } else {
            self.storage.share_memory_with(strategy)?;
        }
        Ok(self)
    }

    /// Whether autograd would track this tensor (carried, not acted on).
    pub fn requires_grad(&self) -> bool {
        self.requires_grad
    }

    /// Sets the requires-grad flag. Only floating-point tensors can require gradients, as
    /// in torch.
    pub fn set_requires_grad(&mut self, requires_grad: bool) -> Result<&mut Self> {
        if requires_grad && !self.dtype.is_float() {
            return Err(Error::invalid_argument(
                "requires_grad",
                format!("only floating-point tensors can require gradients, this one is {}", self.dtype),
            ));
        }
        self.requires_grad = requires_grad;
        Ok(self)
    }

    /// A plain tensor or a parameter.
    pub fn kind(&self) -> TensorKind {
        self.kind
    }

    /// Marks the tensor as a plain tensor or a parameter.
    pub fn set_kind(&mut self, kind: TensorKind) -> &mut Self {
        self.kind = kind;
        self
    }

    /// This tensor as a model parameter (torch's `nn.Parameter(t)`): same data, kind
    /// `Parameter`, requires_grad set for floating-point tensors.
    pub fn into_parameter(mut self) -> Tensor {
        self.kind = TensorKind::Parameter;
        self.requires_grad = self.dtype.is_float();
        self
    }

    pub(crate) fn check_dtype<T: Element>(&self) -> Result<()> {
        if T::DTYPE != self.dtype {
            return Err(Error::DTypeMismatch { actual: self.dtype, requested: T::DTYPE });
        }
        Ok(())
    }

    pub(crate) fn check_cpu(&self) -> Result<()> {
        match self.device {
            Device::Cpu => Ok(()),
            d => Err(Error::Device(format!("a tensor on the {d} device has no host data"))),
        }
    }

    pub(crate) fn check_contiguous(&self) -> Result<()> {
        if self.is_contiguous() {
            Ok(())
        } else {
            Err(Error::NotContiguous { shape: self.shape.clone(), strides: self.strides.clone() })
        }
    }
}

/// Checks that a view with this geometry stays inside a storage of `storage_len` bytes.
/// Every tensor, made here or received, passes this, so element addresses computed from
/// shape, strides and offset are always in bounds; so is the address of the first element
/// of a view without elements (it is formed, never read), which may be one past the end.
pub(crate) fn check_bounds(
    storage_len: usize,
    dtype: DType,
    shape: &[usize],
    strides: &[usize],
    offset: usize,
) -> Result<()> {
    if shape.len() != strides.len() {
        return Err(Error::shape(
            "from_storage",
            shape,
            format!("shape {shape:?} and strides {strides:?} have different lengths"),
        ));
    }
    byte_len(shape, dtype)?;
    let out_of_bounds = |needs: &dyn std::fmt::Display| {
        Error::shape(
            "from_storage",
            shape,
            format!(
                "a {dtype} view of shape {shape:?}, strides {strides:?} and offset {offset} needs {needs} bytes, \
                 its storage has {storage_len}"
            ),
        )
    };
    if checked_numel(shape)? == 0 {
        return match offset.checked_mul(dtype.size()) {
            Some(start) if start <= storage_len => Ok(()),
            Some(start) => Err(out_of_bounds(&start)),
            None => Err(Error::shape("from_storage", shape, "the tensor's offset overflows")),
        };
    }
    let mut last = offset;
    for (&d, &s) in shape.iter().zip(strides) {
        let span = checked_mul(d - 1, s, shape, "the extent")?;
        last = last
            .checked_add(span)
            .ok_or_else(|| Error::shape("from_storage", shape, "the tensor's extent overflows"))?;
    }
    let end = last
        .checked_add(1)
        .and_then(|e| e.checked_mul(dtype.size()))
        .ok_or_else(|| Error::shape("from_storage", shape, "the tensor's extent overflows"))?;
    if end > storage_len {
        return Err(out_of_bounds(&end));
    }
    Ok(())
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
    fn share_memory_in_place_keeps_values_and_views() {
        let mut t = Tensor::from_vec((0..6).map(|v| v as f32).collect(), &[2, 3]).unwrap();
        let view = t.select(0, 1).unwrap();
        t.share_memory().unwrap();
        assert!(t.is_shared());
        assert!(view.is_shared(), "a view shares its base's storage");
        assert_eq!(view.to_vec::<f32>().unwrap(), vec![3.0, 4.0, 5.0]);
        let mut alone = Tensor::ones(&[3], DType::I32);
        alone.share_memory().unwrap();
        assert_eq!(alone.to_vec::<i32>().unwrap(), vec![1, 1, 1]);
    }

    #[test]
    fn requires_grad_only_for_floats() {
        let mut t = Tensor::zeros(&[2], DType::I64);
        assert!(t.set_requires_grad(true).is_err());
        let p = Tensor::zeros(&[2], DType::F32).into_parameter();
        assert_eq!(p.kind(), TensorKind::Parameter);
        assert!(p.requires_grad());
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
    fn views_without_elements_start_inside_their_storage() {
        let s = Storage::new(16);
        assert!(Tensor::from_storage(s.clone(), DType::F32, &[0], &[1], 4).is_ok(), "one past the end");
        let e = Tensor::from_storage(s.clone(), DType::F32, &[0], &[1], 5).unwrap_err();
        assert!(e.to_string().contains("needs 20 bytes"), "{e}");
        assert!(Tensor::from_storage(s.clone(), DType::F32, &[0], &[1], 1 << 62).is_err());
        assert!(Tensor::from_storage(s.clone(), DType::F32, &[0, 3], &[1, 1], usize::MAX).is_err());
        assert!(Tensor::from_storage(s, DType::U8, &[1 << 63], &[0], 0).is_err(), "more bytes than isize");
        // Views cut from an empty tensor keep its offset, however large their strides.
        let t = Tensor::zeros(&[1 << 40, 0, 1 << 40], DType::U8);
        let v = t.select(0, (1 << 40) - 1).unwrap().narrow(1, (1 << 40) - 2, 1).unwrap();
        assert_eq!((v.shape(), v.storage_offset()), (&[0, 1][..], 0));
        assert!(v.to_vec::<u8>().unwrap().is_empty());
    }

    #[test]
    fn meta_tensors_have_no_data() {
        let t = Tensor::meta(&[3, 4], DType::F16);
        assert_eq!(t.device(), Device::Meta);
        assert!(matches!(t.to_vec::<half::f16>(), Err(Error::Device(_))));
    }

    #[test]
    fn from_storage_checks_bounds() {
        let s = Storage::new(16);
        assert!(Tensor::from_storage(s.clone(), DType::F32, &[2, 2], &[2, 1], 0).is_ok());
        let e = Tensor::from_storage(s.clone(), DType::F32, &[2, 2], &[2, 1], 1).unwrap_err();
        assert!(e.to_string().contains("needs 20 bytes"), "{e}");
        assert!(Tensor::from_storage(s, DType::F32, &[2, usize::MAX], &[2, 2], 0).is_err());
    }
}
