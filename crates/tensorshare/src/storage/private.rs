//! A private storage's bytes: heap memory of the storages' alignment, and where a storage
//! of no bytes points.

use std::alloc::Layout;
use std::ptr::NonNull;

use super::ALIGN;
use crate::{Error, Result};

/// A type with the storages' alignment: its dangling pointer is where empty storages point.
#[repr(C, align(64))]
struct Chunk([u8; ALIGN]);

/// The address of every empty storage: never read or written, but aligned like any other
/// storage, so that empty slices and views of any element type may start there.
pub(super) fn dangling() -> NonNull<u8> {
    NonNull::<Chunk>::dangling().cast()
}

/// Heap bytes, 64-byte aligned, a whole number of 64-byte chunks, zeroed at creation.
pub(super) struct PrivateBuf {
    pub(super) ptr: NonNull<u8>,
    /// The allocation's layout; size 0 for an empty buffer, which allocates nothing.
    layout: Layout,
}

impl PrivateBuf {
    pub(super) fn zeroed(len: usize) -> Result<PrivateBuf> {
        let too_large = || {
            Error::invalid_argument(
                "storage size",
                format!("a storage of {len} bytes is too large to allocate"),
            )
        };
        let size = len.checked_next_multiple_of(ALIGN).ok_or_else(too_large)?;
        let layout = Layout::from_size_align(size, ALIGN).map_err(|_| too_large())?;
        if size == 0 {
            // Nothing to allocate: a dangling, well-aligned pointer is enough for no bytes.
            return Ok(PrivateBuf { ptr: dangling(), layout });
        }
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or(Error::AllocationFailed { bytes: size })?;
        Ok(PrivateBuf { ptr, layout })
    }
}

impl Drop for PrivateBuf {
    fn drop(&mut self) {
        if self.layout.size() != 0 {
            // SAFETY: ptr was allocated in `zeroed` with this layout, and nobody else frees it.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
        }
    }
}
