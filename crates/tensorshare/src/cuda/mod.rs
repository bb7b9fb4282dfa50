//! CUDA tensors shared between processes (feature `cuda`).
//!
//! A tensor on `Device::Cuda(i)` lives in one device allocation of its own. Sending it puts
//! the allocation's shareable handle in the message: with CUDA VMM a POSIX file descriptor
//! (it rides SCM_RIGHTS next to the memfds of host tensors). Only where the program opts in
//! (`TENSORSHARE_CUDA_DRIVER=cuda-legacy-ipc`, then on every device; the only way for a
//! device without VMM) it is the legacy 64-byte IPC memory handle, which the receiver's
//! driver opens from the message's bytes: a process with that setting trusts its peers not
//! to forge one. The receiver maps each allocation once (the
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
//! ([`raw_stream`]). Sending a CUDA tensor first waits for the work queued on the sender's
//! stream of its device (once per message and device), so the receiver sees everything the
//! sender queued there before the send, on whatever stream it works. No CUDA event travels
//! in the message: the driver opens an event handle without checking it, and a forged one
//! crashes the receiver (an [`Event`] travels as an [`EventHandle`], opened with `unsafe`).
//! Work queued on other streams must be ordered with tensorshare's by the program (or
//! with an [`Event`]). Device-side work (`fill`, `zeros_on`) is asynchronous: a process that writes
//! a tensor and then exits without sending it should [`synchronize`] first. Copies to the
//! host return when they are done.
//!
//! **Fork.** A process that initialised CUDA cannot start workers with
//! [`crate::StartMethod::Fork`]: that is an error at once, and CUDA calls in a child forked
//! anyway fail with torch's "Cannot re-initialize CUDA in forked subprocess".
//!
//! There are no kernels here: compute on the tensors with a CUDA library of your choice
//! ([`Tensor::device_ptr`](crate::Tensor::device_ptr), [`raw_stream`]); tensorshare
//! allocates, copies and shares. The tensor operations on devices (`empty_on`, `zeros_on`,
//! `to_device`, `to_cpu`, `device_ptr`) are `Tensor`'s, in `tensor/device.rs`: this module
//! is the device memory under them.
//!
//! Without a GPU, `TENSORSHARE_CUDA_DRIVER=simulated` ([`DRIVER_ENV`]) runs all of this on
//! a simulated device whose memory is host shared memory, exported as descriptors exactly
//! like VMM handles: that is how the sharing machinery is tested on machines without one.

mod alloc;
mod cache;
mod driver;
mod event;
mod pinned;
mod real;
mod sim;

pub(crate) use alloc::{AllocId, Allocation};
pub use cache::{collect, empty_cache, memory_stats, MemoryStats};
pub use driver::DRIVER_ENV;
pub(crate) use driver::{Export, IpcBytes};
pub use event::{Event, EventHandle};
pub use pinned::pinned_bytes;
pub(crate) use pinned::register as register_host;

use crate::{Device, Error, Result};

/// Whether CUDA can be used: the device layer loads and has at least one device. Loading
/// the driver counts as initialising CUDA (see the module's notes on fork).
pub fn is_available() -> bool {
    driver::backend().map(|b| b.device_count() > 0).unwrap_or(false)
}

/// The number of CUDA devices, or why there is none to count.
pub fn device_count() -> Result<u32> {
    Ok(driver::backend()?.device_count())
}

/// `"cuda"`, `"cuda-legacy-ipc"` (the driver, sharing legacy IPC handles: see
/// [`DRIVER_ENV`]) or `"simulated"`: which device layer this process runs on.
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

/// The free and total memory of `device` in bytes, for the whole device (every process's
/// allocations and contexts count), as the driver's `cuMemGetInfo` reports them: torch's
/// `torch.cuda.mem_get_info`. [`memory_stats`] counts this process's own allocations. The
/// simulated device has no such figures: an [`Error::Device`] there.
pub fn mem_get_info(device: Device) -> Result<(u64, u64)> {
    driver::backend()?.mem_get_info(ordinal(device)?)
}

/// Waits for the work queued on tensorshare's stream of `device`, before a message carrying
/// CUDA storages of that device leaves: a receiver then sees everything this process wrote
/// to them, whatever stream it uses. (No event travels instead: see `event`.)
pub(crate) fn finish_for_send(device: u32) -> Result<()> {
    driver::backend()?.synchronize(device)
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

/// Copies `dst.len()` bytes of device memory at `src` on `device` to the host, after the
/// work queued on tensorshare's stream there: for memory that another library allocated
/// (a DLPack import).
///
/// # Safety
/// `src..src + dst.len()` must lie in one live allocation of `device` mapped in this
/// process.
#[cfg(feature = "dlpack")]
pub(crate) unsafe fn copy_to_host(device: u32, src: u64, dst: &mut [u8]) -> Result<()> {
    let b = driver::backend()?;
    b.check_device(device)?;
    // SAFETY: the caller's contract.
    unsafe { b.dtoh(device, dst, src) }
}

/// The bytes of a device storage, copied to the host.
pub(crate) fn storage_bytes(a: &Allocation, len: usize) -> Result<Vec<u8>> {
    let mut out = vec![0u8; len];
    a.read(0, &mut out)?;
    Ok(out)
}
