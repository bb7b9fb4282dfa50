//! Where each tensor goes in the weights' one storage: one after the other, each at a
//! 64-byte-aligned offset (the alignment of every storage, so a tensor of the weights is
//! as aligned as a tensor of its own), with checked arithmetic throughout.

use crate::storage::ALIGN;
use crate::{DType, Error, Result, SharingStrategy, Storage, Tensor};

/// The offsets of tensors of the given byte sizes in one storage, and its length.
pub(crate) struct Placed {
    pub(crate) offsets: Vec<usize>,
    /// Each tensor's byte size, as given.
    pub(crate) sizes: Vec<usize>,
    pub(crate) total: usize,
}

/// Places tensors of `sizes` bytes one after the other, each at a multiple of [`ALIGN`].
pub(crate) fn place(sizes: &[usize]) -> Result<Placed> {
    let too_large = || {
        Error::invalid_argument(
            "weights size",
            format!("{} tensors of {:?} bytes do not fit in one storage", sizes.len(), sizes),
        )
    };
    let mut offsets = Vec::with_capacity(sizes.len());
    let mut end = 0usize;
    for &size in sizes {
        let start = end.checked_next_multiple_of(ALIGN).ok_or_else(too_large)?;
        offsets.push(start);
        end = start.checked_add(size).ok_or_else(too_large)?;
    }
    if end > isize::MAX as usize {
        return Err(too_large());
    }
    Ok(Placed { offsets, sizes: sizes.to_vec(), total: end })
}

impl Placed {
    /// A fresh shared storage for the tensors, its bytes between and after them zeroed
    /// (the tensors' own bytes are the caller's to fill).
    pub(crate) fn storage(&self, strategy: SharingStrategy) -> Result<Storage> {
        let storage = Storage::empty_shared_with(self.total, strategy)?;
        let mut at = 0;
        let ends = self.offsets.iter().zip(&self.sizes).map(|(&o, &s)| (o, o + s));
        for (start, end) in ends.chain([(self.total, self.total)]) {
            if start > at {
                // SAFETY: at..start lies in the storage (offsets and ends are at most
                // `total`, its length), which is fresh: no other handle of it exists, in
                // this process or another, so nothing else can access these bytes.
                unsafe { std::ptr::write_bytes(storage.as_mut_ptr().add(at), 0, start - at) };
            }
            at = end;
        }
        Ok(storage)
    }
}

/// The contiguous tensor of `dtype` and `shape` at byte `offset` of `storage`.
pub(crate) fn view(storage: &Storage, offset: usize, dtype: DType, shape: &[usize]) -> Result<Tensor> {
    // Offsets are multiples of 64, so of every element size.
    let strides = crate::tensor::contiguous_strides(shape);
    Tensor::from_storage(storage.clone(), dtype, shape, &strides, offset / dtype.size())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_are_aligned_and_padding_is_zero() {
        let p = place(&[3, 0, 64, 65, 1]).unwrap();
        assert_eq!(p.offsets, vec![0, 64, 64, 128, 256]);
        assert_eq!(p.total, 257);
        let s = p.storage(SharingStrategy::FileDescriptor).unwrap();
        assert_eq!(s.len(), 257);
        assert!(s.to_bytes()[3..64].iter().all(|b| *b == 0));
        assert!(place(&[1, usize::MAX - 8]).is_err(), "the end overflows");
        assert!(place(&[isize::MAX as usize, 1]).is_err(), "past isize::MAX");
        assert_eq!(place(&[]).unwrap().total, 0);
    }
}
