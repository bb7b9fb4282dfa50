//! Pinned (page-locked) host storages, for fast copies to and from CUDA devices (feature
//! `cuda`): the arena under a storage is registered with the device layer once, whole.

use super::{Shared, Storage};
use crate::{Error, Result};

impl Storage {
    /// Page-locks the host memory under this storage, so that copies between it and CUDA
    /// devices go straight from its pages (torch's `pin_memory`, in place).
    ///
    /// Pinning is per arena: the whole arena this storage is a slot of is registered with
    /// the driver once (`cuMemHostRegister`), and so are the other storages in it, now and
    /// later; it stays pinned for as long as this process maps it (arenas of small storages
    /// are kept for reuse; [`crate::trim_arenas`] lets go of free ones), and is unregistered
    /// when it goes. A private storage is moved into shared memory first
    /// ([`Storage::share_memory`]), for every handle. Page-locking belongs to this
    /// process's mapping: another process that received the storage pins it for itself.
    /// A storage of no bytes has nothing to pin (`Ok`, and it is not [`Storage::is_pinned`]).
    ///
    /// # Errors
    /// [`Error::Device`] for a device storage or when the device layer cannot register the
    /// memory (no CUDA driver or device, or the locked-memory limit is reached); the
    /// errors of [`Storage::share_memory`].
    pub fn pin(&self) -> Result<()> {
        if !self.is_shared() {
            self.share_memory()?;
        }
        match self.shared() {
            Some(Shared::Slot(slot)) => {
                // The device layer first: in a child forked while a thread of its parent
                // pinned, it refuses before `pin_with` waits for that thread's lock.
                crate::cuda::device_count()?;
                slot.arena().pin_with(|ptr, len| {
                    // SAFETY: `pin_with` passes the arena's whole mapping, which the arena keeps
                    // mapped for as long as it keeps the registration (dropped before the
                    // mapping, see Arena).
                    unsafe { crate::cuda::register_host(ptr, len) }
                })
            }
            Some(Shared::Empty(_)) => Ok(()),
            Some(Shared::Device(_)) => {
                Err(Error::Device("a CUDA storage is device memory: only host memory is pinned".into()))
            }
            None => Err(Error::Device("a storage that is not shared after share_memory".into())),
        }
    }

    /// Whether the host memory under this storage is page-locked in this process
    /// ([`Storage::pin`]).
    pub fn is_pinned(&self) -> bool {
        matches!(self.shared(), Some(Shared::Slot(slot)) if slot.arena().is_pinned())
    }
}
