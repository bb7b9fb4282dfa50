//! Byte ranges of a contiguous host tensor, copied in and out: what a collective
//! (`dist`) moves between tensors a block at a time. Safe whatever other handles do
//! meanwhile, as every copy here (see `access`): word by word, with atomic operations.

use super::Tensor;
use crate::atomic_bytes;
use crate::{Error, Result};

impl Tensor {
    /// The address of byte `start` of this contiguous host view, after checking that
    /// `start..start + len` lies in its elements.
    fn range_ptr(&self, start: usize, len: usize) -> Result<*mut u8> {
        self.check_cpu()?;
        self.check_contiguous()?;
        // Exact: every tensor's byte size fits in isize (checked at construction).
        let total = self.numel() * self.dtype.size();
        if start.checked_add(len).is_none_or(|end| end > total) {
            return Err(Error::shape(
                "byte range",
                &self.shape,
                format!("bytes {start}..+{len} of a view of {total} bytes"),
            ));
        }
        Ok(self.elem_ptr(self.offset).wrapping_add(start))
    }

    /// Copies bytes `start..start + out.len()` of this contiguous host view into `out`.
    pub(crate) fn load_range(&self, start: usize, out: &mut [u8]) -> Result<()> {
        let p = self.range_ptr(start, out.len())?;
        // SAFETY: the view is contiguous and on the host, so its bytes start at its first
        // element and lie in its storage (check_bounds at construction), which `self` keeps
        // alive; `range_ptr` checked that the range lies in them.
        unsafe { atomic_bytes::load(p, out) };
        Ok(())
    }

    /// Writes `src` to bytes `start..start + src.len()` of this contiguous host view.
    pub(crate) fn store_range(&mut self, start: usize, src: &[u8]) -> Result<()> {
        let p = self.range_ptr(start, src.len())?;
        // SAFETY: as in `load_range`.
        unsafe { atomic_bytes::store(p, src) };
        Ok(())
    }
}
