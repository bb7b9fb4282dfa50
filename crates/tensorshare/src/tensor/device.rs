//! Tensors on CUDA devices (feature `cuda`): made there, copied between the host and
//! devices, and handed to other CUDA libraries. The device memory under them is `cuda`'s.

use super::{checked_numel, Tensor};
use crate::cuda::Allocation;
use crate::storage::Shared;
use crate::{DType, Device, Error, Result, Storage};

fn device_alloc(t: &Tensor) -> Result<&Allocation> {
    match t.storage.shared() {
        Some(Shared::Device(a)) => Ok(a),
        _ => Err(Error::Device(format!("the tensor is on {}, its storage is not device memory", t.device))),
    }
}

/// Byte range `[start, end)` of the storage that a view covers.
fn span(t: &Tensor) -> Result<(usize, usize)> {
    let size = t.dtype.size();
    if checked_numel(&t.shape)? == 0 {
        return Ok((0, 0));
    }
    let last: usize = t.shape.iter().zip(&t.strides).map(|(&d, &s)| (d - 1) * s).sum::<usize>() + t.offset;
    Ok((t.offset * size, (last + 1) * size))
}

impl Tensor {
    /// A contiguous tensor of `shape` on `device` with unspecified contents.
    pub fn empty_on(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        let len = checked_numel(shape)?.checked_mul(dtype.size()).ok_or_else(|| {
            Error::shape("empty_on", shape, format!("the byte size of {shape:?} overflows"))
        })?;
        match device {
            Device::Cuda(i) => {
                let storage = Storage::from_shared(len, Shared::Device(Box::new(Allocation::new(i, len)?)));
                Ok(Tensor::from_parts(storage, dtype, shape.into()))
            }
            Device::Cpu => Ok(Tensor::from_parts(Storage::new(len), dtype, shape.into())),
            Device::Meta => Tensor::try_meta(shape, dtype),
        }
    }

    /// A tensor of zeros on `device`.
    pub fn zeros_on(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        let t = Tensor::empty_on(shape, dtype, device)?;
        if let Device::Cuda(_) = device {
            device_alloc(&t)?.memset(0, &[0], t.storage.len())?;
        }
        Ok(t)
    }

    /// A copy of this tensor on `device` (this tensor itself, shared, when it is there
    /// already). Between the host and a device, or two devices, the copy is contiguous.
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if device == self.device {
            return Ok(self.clone());
        }
        let mut out = match (self.device, device) {
            (Device::Meta, _) | (_, Device::Meta) => {
                return Err(Error::Device(format!("cannot copy a tensor from {} to {device}", self.device)))
            }
            (Device::Cpu, Device::Cuda(_)) => {
                let t = Tensor::empty_on(&self.shape, self.dtype, device)?;
                if self.is_contiguous() && self.storage.is_pinned() {
                    // Straight from the page-locked pages: one copy, by the device.
                    let len = self.numel() * self.dtype.size();
                    // SAFETY: the view is contiguous, so its len bytes start at its first
                    // element and lie in the host storage (check_bounds), which `self`
                    // keeps alive for the call.
                    unsafe { device_alloc(&t)?.write_from_storage(0, self.elem_ptr(self.offset), len)? };
                } else {
                    let bytes = self.to_bytes()?;
                    device_alloc(&t)?.write(0, &bytes)?;
                }
                t
            }
            (Device::Cuda(_), Device::Cpu) => {
                let (start, end) = span(self)?;
                let host = Storage::new(end - start);
                let a = device_alloc(self)?;
                // SAFETY: the storage is fresh and private, `end - start` bytes long, and no
                // other handle to it exists while the slice lives.
                let dst = unsafe { std::slice::from_raw_parts_mut(host.as_mut_ptr(), end - start) };
                a.read(start, dst)?;
                let view = Tensor::from_storage(
                    host,
                    self.dtype,
                    &self.shape,
                    &self.strides,
                    self.offset - start / self.dtype.size(),
                )?;
                view.contiguous()?
            }
            (Device::Cuda(_), Device::Cuda(_)) => self.to_device(Device::Cpu)?.to_device(device)?,
            (Device::Cpu, Device::Cpu) => unreachable!("equal devices return above"),
        };
        out.requires_grad = self.requires_grad;
        out.kind = self.kind;
        Ok(out)
    }

    /// Page-locks this tensor's host memory for fast copies to CUDA devices, in place
    /// (torch's `pin_memory`, which makes a pinned copy instead): moves the storage into
    /// shared memory if it is private, then pins its whole arena ([`Storage::pin`], which
    /// says what is pinned and for how long). [`Tensor::to_device`] then copies a
    /// contiguous view straight from the pinned pages.
    ///
    /// # Errors
    /// As [`Storage::pin`]; [`Error::Device`] for a tensor that is not on the host.
    pub fn pin_memory(&mut self) -> Result<&mut Self> {
        if self.device != Device::Cpu {
            return Err(Error::Device(format!("a tensor on {} has no host memory to pin", self.device)));
        }
        self.share_memory()?;
        self.storage.pin()?;
        Ok(self)
    }

    /// Whether this tensor's host memory is page-locked ([`Tensor::pin_memory`]).
    pub fn is_pinned(&self) -> bool {
        self.device == Device::Cpu && self.storage.is_pinned()
    }

    /// A host copy of a tensor (torch's `.cpu()`); the tensor itself if it is on the host.
    pub fn to_cpu(&self) -> Result<Tensor> {
        self.to_device(Device::Cpu)
    }

    /// The device address of the first element of a CUDA tensor, for kernels of other
    /// libraries (order them with [`raw_stream`](crate::cuda::raw_stream)).
    pub fn device_ptr(&self) -> Result<u64> {
        let a = device_alloc(self)?;
        Ok(a.ptr + (self.offset * self.dtype.size()) as u64)
    }

    /// `fill` on a CUDA tensor: a device memset for 1-, 2- and 4-byte elements, a copy from
    /// the host for 8-byte ones. The view must be contiguous (there are no kernels here).
    pub(crate) fn fill_device(&mut self, value_bytes: &[u8]) -> Result<()> {
        self.check_contiguous()?;
        let a = device_alloc(self)?;
        let off = self.offset * self.dtype.size();
        let n = self.numel();
        match value_bytes.len() {
            1 | 2 | 4 => a.memset(off, value_bytes, n),
            _ => a.write(off, &value_bytes.repeat(n)),
        }
    }
}
