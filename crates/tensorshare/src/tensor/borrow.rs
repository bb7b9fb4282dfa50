//! Zero-copy borrows of a tensor's elements: `unsafe` with a stated contract, or safe
//! where nothing else can reach the elements.
//!
//! A `&[T]` tells the compiler that the elements do not change while it lives, a `&mut [T]`
//! that nothing else reads or writes them. Other handles of the storage (clones, views,
//! `Storage` handles, on any thread, and every process the storage was sent to) can break
//! either promise at any moment, and the type system does not see them. So the general
//! borrows are `unsafe fn`s whose callers make the promise, as ipc-channel's
//! `IpcSharedMemory` lends `&[u8]` only and makes writing an `unsafe fn deref_mut`.
//!
//! The one case the crate proves by itself is an exclusive tensor: the only handle of a
//! private storage (see [`Tensor::is_exclusive`]). A private storage is plain heap memory
//! of this process, so no other process maps it; with a single strong reference and no
//! weak one, no other handle exists or can appear while `&mut self` is borrowed (a clone
//! needs `&self`). Shared memory never counts as exclusive, even with one handle here: a
//! storage that was sent, or whose arena was, can be written by other processes.

use std::sync::Arc;

use super::access::bad_bits;
use super::Tensor;
use crate::{Element, Error, Result};

impl Tensor {
    /// Whether nothing but this tensor can reach its elements: a host tensor whose storage
    /// is private (never moved to shared memory, so no other process maps it) and whose only
    /// handle it is (no clone, view, [`crate::Storage`] handle or weak reference).
    ///
    /// Fresh tensors from [`Tensor::zeros`], [`Tensor::from_vec`] and the like are
    /// exclusive; cloning or viewing one, or [`Tensor::share_memory`], makes it not. The
    /// answer can only change through this tensor, so it holds for as long as this tensor
    /// is not used otherwise.
    ///
    /// It is a snapshot of the handle counts and synchronizes with nothing: a `true` does
    /// not order the writes another thread made through a handle it has just dropped before
    /// what this thread does next. Code that reads the elements without atomics on the
    /// strength of it must check with `check_exclusive` instead, as the borrows do.
    pub fn is_exclusive(&self) -> bool {
        self.device == crate::Device::Cpu
            && !self.storage.is_shared()
            && Arc::strong_count(&self.storage.inner) == 1
            && Arc::weak_count(&self.storage.inner) == 0
    }

    /// Checks [`Tensor::is_exclusive`] in a way no other thread can invalidate while
    /// `&mut self` is borrowed, and that orders every write made through the other handles,
    /// now dropped, before what follows (`Arc::get_mut` acquires the count they released).
    pub(crate) fn check_exclusive(&mut self) -> Result<()> {
        self.check_cpu()?;
        if self.storage.is_shared() {
            return Err(Error::NotExclusive("shared memory, which other processes may map"));
        }
        // Unlike comparing counts, `get_mut` also rules out a weak reference being upgraded
        // at the same moment. With one strong reference, held by `self`, and `&mut self`
        // borrowed, no other handle can be made until the borrow ends.
        if Arc::get_mut(&mut self.storage.inner).is_none() {
            return Err(Error::NotExclusive("other handles (clones, views or Storage handles)"));
        }
        Ok(())
    }

    /// The checks every slice borrow makes; returns the element count.
    fn check_slice<T: Element>(&self) -> Result<usize> {
        self.check_dtype::<T>()?;
        self.check_cpu()?;
        self.check_contiguous()?;
        Ok(self.numel())
    }

    /// The elements of a contiguous host tensor, borrowed without a copy.
    ///
    /// The bytes are checked to be valid `T` values when the slice is made (for `bool`:
    /// 0 or 1).
    ///
    /// To read without a promise, copy ([`Tensor::to_vec`]); a tensor nothing else can
    /// reach is borrowed safely by [`Tensor::exclusive_slice_mut`].
    ///
    /// ```
    /// use tensorshare::{DType, Tensor};
    /// # fn main() -> tensorshare::Result<()> {
    /// let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3])?;
    /// // SAFETY: no other handle of t's storage exists that could write it meanwhile.
    /// let sum: f32 = unsafe { t.as_slice::<f32>()? }.iter().sum();
    /// assert_eq!(sum, 6.0);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// Without `unsafe` it does not compile, since a clone (in any thread or process) could
    /// write what the slice shows:
    ///
    /// ```compile_fail,E0133
    /// use tensorshare::{DType, Tensor};
    /// let mut a = Tensor::zeros(&[3], DType::F32);
    /// let b = a.clone();
    /// let s = b.as_slice::<f32>().unwrap();
    /// a.fill(42.0f32).unwrap(); // would change `s` while it is borrowed
    /// assert_eq!(s[0], 0.0);
    /// ```
    ///
    /// # Safety
    /// While the returned slice lives, nothing may write its elements: no other handle of
    /// this tensor's storage (a clone, a view, a [`crate::Storage`] handle, an
    /// [`crate::AtomicView`]), in this thread, another thread, or another process that
    /// received the tensor or its storage. Reading them elsewhere is fine. A write that
    /// happens before this call must be ordered before it (a message on a queue, a joined
    /// thread, ...).
    ///
    /// # Errors
    /// If `T` is not the tensor's dtype, the tensor is not on the host or not contiguous,
    /// or an element is not a valid `T`.
    pub unsafe fn as_slice<T: Element>(&self) -> Result<&[T]> {
        let n = self.check_slice::<T>()?;
        if n == 0 {
            return Ok(&[]);
        }
        // SAFETY: the view is contiguous, so its n * size bytes start at its first element
        // and lie in the host storage (check_bounds), are initialised (storages are zeroed
        // or mapped), and live as long as `&self`, which holds the storage. A `&[u8]` is
        // valid for any initialised bytes; the caller promises that nothing writes them
        // while the borrow lives.
        let bytes = unsafe { std::slice::from_raw_parts(self.elem_ptr(self.offset), n * self.dtype.size()) };
        // Checks alignment (storages are 64-byte aligned, offsets whole elements) and the
        // bit patterns; the caller's promise keeps them valid afterwards.
        bytemuck::checked::try_cast_slice(bytes).map_err(bad_bits::<T>)
    }

    /// The elements of a contiguous host tensor, borrowed without a copy, to write. Other
    /// handles of the storage (in every process) see the writes.
    ///
    /// The bytes are checked to be valid `T` values when the slice is made.
    ///
    /// To write without a promise, copy ([`Tensor::copy_from_slice`], [`Tensor::fill`]) or
    /// use the atomic view; a tensor nothing else can reach is borrowed safely by
    /// [`Tensor::exclusive_slice_mut`].
    ///
    /// Without `unsafe` it does not compile: two threads incrementing through clones would
    /// race (use [`Tensor::atomic`] for that).
    ///
    /// ```compile_fail,E0133
    /// use tensorshare::{DType, Tensor};
    /// let mut t = Tensor::zeros(&[1], DType::I64);
    /// t.as_mut_slice::<i64>().unwrap()[0] += 1;
    /// ```
    ///
    /// # Safety
    /// While the returned slice lives, nothing else may read or write its elements: no
    /// other handle of this tensor's storage (a clone, a view, a [`crate::Storage`] handle,
    /// an [`crate::AtomicView`], a message being encoded from it), in this thread, another
    /// thread, or another process that received the tensor or its storage. Accesses before
    /// and after must be ordered with the borrow (a message on a queue, a joined thread,
    /// ...).
    ///
    /// # Errors
    /// As [`Tensor::as_slice`].
    pub unsafe fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        let n = self.check_slice::<T>()?;
        if n == 0 {
            return Ok(&mut []);
        }
        // SAFETY: as in `as_slice`; in addition `&mut self` makes this handle's borrow
        // unique, and the caller promises that no other handle reads or writes these bytes
        // while the borrow lives.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(self.elem_ptr(self.offset), n * self.dtype.size()) };
        bytemuck::checked::try_cast_slice_mut(bytes).map_err(bad_bits::<T>)
    }

    /// The elements of a contiguous host tensor that nothing else can reach
    /// ([`Tensor::is_exclusive`]), borrowed without a copy, to read and write; safe, since
    /// the crate can prove the promise [`Tensor::as_mut_slice`] asks for.
    ///
    /// The way to fill a fresh tensor in place before sharing or sending it:
    ///
    /// ```
    /// use tensorshare::{DType, Tensor};
    /// # fn main() -> tensorshare::Result<()> {
    /// let mut t = Tensor::zeros(&[4], DType::F32);
    /// for (i, v) in t.exclusive_slice_mut::<f32>()?.iter_mut().enumerate() {
    ///     *v = i as f32;
    /// }
    /// let view = t.narrow(0, 1, 2)?; // another handle: no longer exclusive
    /// assert!(t.exclusive_slice_mut::<f32>().is_err());
    /// drop(view);
    /// assert_eq!(t.exclusive_slice_mut::<f32>()?, &[0.0, 1.0, 2.0, 3.0]);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// The borrow checker keeps it exclusive while the slice lives: no clone can be made.
    ///
    /// ```compile_fail,E0502
    /// use tensorshare::{DType, Tensor};
    /// let mut a = Tensor::zeros(&[3], DType::F32);
    /// let s = a.exclusive_slice_mut::<f32>().unwrap();
    /// let b = a.clone(); // `a` is mutably borrowed by `s`
    /// s[0] = 1.0;
    /// drop(b);
    /// ```
    ///
    /// # Errors
    /// [`Error::NotExclusive`] if other handles or processes can reach the storage; as
    /// [`Tensor::as_slice`] otherwise.
    pub fn exclusive_slice_mut<T: Element>(&mut self) -> Result<&mut [T]> {
        self.check_slice::<T>()?;
        self.check_exclusive()?;
        // SAFETY: the storage is private and `self` holds its only handle, with no weak
        // reference (check_exclusive); `&mut self`, borrowed for the slice's lifetime, is
        // needed to make another. So nothing else, in this or any process, can read or
        // write the elements while the slice lives: as_mut_slice's contract holds.
        unsafe { self.as_mut_slice() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    #[test]
    fn slices_need_dtype_and_contiguity() {
        let mut t = Tensor::zeros(&[2, 2], DType::F32);
        // SAFETY (all borrows in this test): one thread, and nothing writes the storage
        // while a borrow lives.
        assert!(matches!(unsafe { t.as_slice::<f64>() }, Err(Error::DTypeMismatch { .. })));
        unsafe { t.as_mut_slice::<f32>() }.unwrap()[3] = 7.0;
        let tt = t.t().unwrap();
        assert!(matches!(unsafe { tt.as_slice::<f32>() }, Err(Error::NotContiguous { .. })));
        assert_eq!(unsafe { t.as_slice::<f32>() }.unwrap(), &[0.0, 0.0, 0.0, 7.0]);
        let empty = Tensor::zeros(&[3, 0], DType::F32).select(0, 2).unwrap();
        assert!(unsafe { empty.as_slice::<f32>() }.unwrap().is_empty());
    }

    #[test]
    fn slices_check_bools_when_made() {
        let mut t = Tensor::zeros(&[3], DType::U8);
        t.copy_from_slice(&[1u8, 200, 0]).unwrap();
        let mut b = Tensor::from_storage(t.storage().clone(), DType::Bool, &[3], &[1], 0).unwrap();
        // SAFETY: nothing writes the storage while the borrows would live.
        assert!(unsafe { b.as_slice::<bool>() }.is_err());
        assert!(unsafe { b.as_mut_slice::<bool>() }.is_err());
    }

    #[test]
    fn a_fresh_private_tensor_is_exclusive() {
        let mut t = Tensor::zeros(&[3], DType::I32);
        assert!(t.is_exclusive());
        t.exclusive_slice_mut::<i32>().unwrap().copy_from_slice(&[1, 2, 3]);
        assert_eq!(t.to_vec::<i32>().unwrap(), vec![1, 2, 3]);
        let mut v = Tensor::from_vec(vec![1.0f64; 4], &[2, 2]).unwrap().select(0, 1).unwrap();
        assert_eq!(
            v.exclusive_slice_mut::<f64>().unwrap(),
            &[1.0, 1.0],
            "the base is gone: its view is alone"
        );
    }

    #[test]
    fn other_handles_make_a_tensor_not_exclusive() {
        let mut t = Tensor::zeros(&[4], DType::F32);
        let refused = |t: &mut Tensor| matches!(t.exclusive_slice_mut::<f32>(), Err(Error::NotExclusive(_)));
        let clone = t.clone();
        assert!(!t.is_exclusive() && refused(&mut t));
        drop(clone);
        let view = t.narrow(0, 1, 2).unwrap();
        assert!(!t.is_exclusive() && refused(&mut t));
        drop(view);
        let storage = t.storage().clone();
        assert!(!t.is_exclusive() && refused(&mut t));
        drop(storage);
        let weak = Arc::downgrade(&t.storage.inner);
        assert!(!t.is_exclusive() && refused(&mut t), "a weak reference can be upgraded at any time");
        drop(weak);
        assert!(t.is_exclusive());
        t.share_memory().unwrap();
        assert!(
            t.is_shared() && !t.is_exclusive() && refused(&mut t),
            "other processes may map shared memory"
        );
        let mut meta = Tensor::meta(&[4], DType::F32);
        assert!(!meta.is_exclusive());
        assert!(matches!(meta.exclusive_slice_mut::<f32>(), Err(Error::Device(_))));
    }
}
