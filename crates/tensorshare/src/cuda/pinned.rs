//! Page-locked ("pinned") host memory: a whole arena's mapping registered with the device
//! layer (`cuMemHostRegister`, portable to every context) so that copies between it and a
//! device go straight from its pages (DMA), without the driver staging them through a
//! pinned buffer of its own.
//!
//! An arena is registered once, whatever number of its storages ask, and stays registered
//! for as long as it is mapped in this process: the [`Registration`] lives in the arena and
//! is dropped before its mapping goes. Registration is per process: another process that
//! maps the same arena pins it for itself (page-locking is an attribute of a process's
//! mapping, not of the memory).

use std::sync::atomic::{AtomicUsize, Ordering};

use super::driver::backend;
use crate::Result;

/// Bytes of host memory this process keeps registered.
static PINNED: AtomicUsize = AtomicUsize::new(0);

/// One registered host range, unregistered when dropped.
pub(crate) struct Registration {
    ptr: u64,
    len: usize,
}

impl Drop for Registration {
    fn drop(&mut self) {
        // In a forked child the driver is unusable (and the registration was the parent's).
        if let Ok(b) = backend() {
            b.host_unregister(self.ptr);
        }
        PINNED.fetch_sub(self.len, Ordering::Relaxed);
    }
}

/// Registers the `len` bytes at `ptr` (a whole mapping, page-aligned, whole pages).
///
/// # Safety
/// `ptr..ptr + len` must be a mapping of this process that stays mapped until the returned
/// registration is dropped.
pub(crate) unsafe fn register(ptr: *mut u8, len: usize) -> Result<Box<dyn std::any::Any + Send + Sync>> {
    let b = backend()?;
    // SAFETY: the caller's contract, passed on.
    unsafe { b.host_register(ptr as u64, len)? };
    PINNED.fetch_add(len, Ordering::Relaxed);
    Ok(Box::new(Registration { ptr: ptr as u64, len }))
}

/// Bytes of host memory this process has page-locked for CUDA copies
/// ([`Storage::pin`](crate::Storage::pin)): whole arenas, until they are unmapped.
pub fn pinned_bytes() -> usize {
    PINNED.load(Ordering::Relaxed)
}
