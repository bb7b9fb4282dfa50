//! CUDA tensors shared between processes (feature `cuda`).
//!
//! A tensor on `Device::Cuda(i)` lives in one device allocation of its own. Sending it puts
//! the allocation's shareable handle in the message: with CUDA VMM a POSIX file descriptor
//! (it rides SCM_RIGHTS next to the memfds of host tensors), or the legacy 64-byte IPC
//! memory handle on devices without VMM. The receiver maps each allocation once (the
//! receive cache knows it by its creator's id), so views, offsets and tensors of several
//! dtypes over one allocation arrive as views of one storage; a received tensor can be sent
//! on to a third process.
//!
//! **Lifetime.** The creator frees an allocation only once no other process and no message
//! in flight holds it; a holder that exits or is killed gives its hold back through the
//! kernel (see the lease pipe in `alloc`). The creator reclaims such memory at its next
//! CUDA allocation or [`collect`], and reuses it for new tensors (under a new identity);
//! [`empty_cache`] gives the free allocations back to the driver.
//!
//! **Ordering.** tensorshare queues its copies on one stream per device per process
//! ([`raw_stream`]). Sending a CUDA tensor records an interprocess event on the sender's
//! stream; the receiver's stream waits on it before the tensor is handed out, so the
//! receiver's work on that stream sees everything the sender queued before the send.
//! Work queued on other streams must be ordered with this one by the program (or with an
//! [`Event`]). Device-side work (`fill`, `zeros_on`) is asynchronous: a process that writes
//! a tensor and then exits without sending it should [`synchronize`] first. Copies to the
//! host return when they are done.
//!
//! **Fork.** A process that initialised CUDA cannot start workers with
//! [`crate::StartMethod::Fork`]: that is an error at once, and CUDA calls in a child forked
//! anyway fail with torch's "Cannot re-initialize CUDA in forked subprocess".
//!
//! There are no kernels here: compute on the tensors with a CUDA library of your choice
//! ([`Tensor::device_ptr`], [`raw_stream`]); tensorshare allocates, copies and shares.
//!
//! Without a GPU, `TENSORSHARE_CUDA_DRIVER=simulated` ([`DRIVER_ENV`]) runs all of this on
//! a simulated device whose memory is host shared memory, exported as descriptors exactly
//! like VMM handles: that is how the sharing machinery is tested on machines without one.

mod alloc;
mod cache;
mod driver;
mod event;
mod real;
mod sim;

pub(crate) use alloc::{AllocId, Allocation};
pub use cache::{collect, empty_cache, memory_stats, MemoryStats};
pub use driver::DRIVER_ENV;
pub(crate) use driver::{Export, IpcBytes};
pub use event::Event;
pub(crate) use event::{record_for_send, wait_received};

// Upward, for a reason: this feature module adds device tensors, so it extends `Storage` and
// `Tensor` (and, in `event`, lets an event travel in messages through `wire`).
use crate::storage::Shared;
use crate::tensor::checked_numel;
use crate::{DType, Device, Error, Result, Storage, Tensor};

/// Whether CUDA can be used: the device layer loads and has at least one device. Loading
/// the driver counts as initialising CUDA (see the module's notes on fork).
pub fn is_available() -> bool {
    driver::backend().map(|b| b.device_count() > 0).unwrap_or(false)
}

/// The number of CUDA devices, or why there is none to count.
pub fn device_count() -> Result<u32> {
    Ok(driver::backend()?.device_count())
}

/// `"cuda"` or `"simulated"`: which device layer this process runs on.
pub fn driver_name() -> Result<&'static str> {
    Ok(driver::backend()?.name())
}

/// Whether this process, or the one it was forked from, has initialised CUDA.
pub fn is_initialized() -> bool {
    driver::initialised()
}

/// Blocks until the work tensorshare queued on `device` is done.
pub fn synchronize(device: Device) -> Result<()> {
    driver::backend()?.synchronize(ordinal(device)?)
}

/// tensorshare's stream on `device` (a `CUstream`, 0 on the simulated device), for
/// ordering work of other CUDA libraries with the copies and events of this crate.
pub fn raw_stream(device: Device) -> Result<u64> {
    driver::backend()?.stream(ordinal(device)?)
}

fn ordinal(device: Device) -> Result<u32> {
    match device {
        Device::Cuda(i) => Ok(i),
        d => Err(Error::Device(format!("{d} is not a CUDA device"))),
    }
}

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
                Ok(Tensor::from_parts(storage, dtype, shape.to_vec()))
            }
            Device::Cpu => Ok(Tensor::from_parts(Storage::new(len), dtype, shape.to_vec())),
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
                let bytes = self.to_bytes()?;
                let t = Tensor::empty_on(&self.shape, self.dtype, device)?;
                device_alloc(&t)?.write(0, &bytes)?;
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

    /// A host copy of a tensor (torch's `.cpu()`); the tensor itself if it is on the host.
    pub fn to_cpu(&self) -> Result<Tensor> {
        self.to_device(Device::Cpu)
    }

    /// The device address of the first element of a CUDA tensor, for kernels of other
    /// libraries (order them with [`raw_stream`]).
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

/// The bytes of a device storage, copied to the host.
pub(crate) fn storage_bytes(a: &Allocation, len: usize) -> Result<Vec<u8>> {
    let mut out = vec![0u8; len];
    a.read(0, &mut out)?;
    Ok(out)
}
