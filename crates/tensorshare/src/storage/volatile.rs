//! Filling a storage from memory that other code owns and may write meanwhile: for bindings
//! that move a foreign allocation's bytes into a storage (not part of the API).

use super::Storage;
use crate::{Device, Error, Result};

impl Storage {
    /// Copies into this host storage its length in bytes from `src`, read with volatile
    /// loads (another thread or library may write that memory meanwhile: the copy then has
    /// torn bytes, never undefined behaviour in this storage), and written as every safe
    /// write of this crate writes, so that it races with no other handle's access.
    ///
    /// # Errors
    /// [`Error::Device`] for a device storage.
    ///
    /// # Safety
    /// `src..src + self.len()` must be readable host memory for the whole call, and must
    /// not overlap this storage's bytes.
    #[doc(hidden)]
    pub unsafe fn copy_from_volatile(&self, src: *const u8) -> Result<()> {
        if self.device() != Device::Cpu {
            return Err(Error::Device(format!("a storage on the {} device has no host data", self.device())));
        }
        if self.is_empty() {
            return Ok(());
        }
        // SAFETY: the caller vouches for `src..src + len` and that it does not overlap this
        // storage; `as_mut_ptr()..+ len` are this host storage's bytes, which live while
        // `self` does, for the whole call.
        unsafe { crate::atomic_bytes::store_from_volatile(src, self.as_mut_ptr(), self.len()) };
        Ok(())
    }
}
