//! [`Tensor`]: a dense, strided view of a [`Storage`].
//!
//! Here: the type, its accessors and flags, and moving it into shared memory.
//! `constructors`: making tensors. `geometry`: shape arithmetic and the bounds check.
//! `view`: new geometry over the same storage. `elements`: walking a view's elements.
//! `access`: safe copies in and out. `borrow`: zero-copy borrows. `atomic`: the lock-free
//! view. `array`: ndarray views. `device`: tensors on CUDA devices.

mod access;
#[cfg(feature = "ndarray")]
mod array;
mod atomic;
mod borrow;
mod constructors;
#[cfg(feature = "cuda")]
mod device;
mod dims;
mod elements;
mod geometry;
#[cfg(feature = "mpi")]
mod range;
mod view;

pub use atomic::{AtomicElement, AtomicView};
pub(crate) use dims::Dims;
pub(crate) use geometry::{checked_numel, contiguous_strides};

use serde::{Deserialize, Serialize};

use crate::{get_sharing_strategy, DType, Device, Element, Error, Result, SharingStrategy, Storage};

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
    pub(crate) shape: Dims,
    pub(crate) strides: Dims,
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

impl Tensor {
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
            Err(Error::NotContiguous { shape: self.shape.to_vec(), strides: self.strides.to_vec() })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
