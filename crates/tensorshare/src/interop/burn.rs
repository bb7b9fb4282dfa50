//! burn's `TensorData` (feature `burn`, `burn-backend` 0.20: the smallest burn crate that
//! has it; `burn::tensor::TensorData` is the same type). What a burn backend turns into a
//! tensor with `Tensor::from_data`, and what `Tensor::into_data` gives back.
//!
//! - [`to_burn`] **copies** the elements (row-major, any strides; a CUDA tensor through
//!   the host) into a `TensorData` that owns them.
//! - [`into_burn`] hands a tensor to burn **without a copy** when nothing else can reach its
//!   bytes ([`Tensor::is_exclusive`]: a private storage whose only handle it is, contiguous
//!   elements), and copies otherwise. Safe: burn is the only owner either way.
//! - [`to_burn_aliased`] makes a `TensorData` **without a copy** that reads the tensor's
//!   bytes, shared memory included; `unsafe`, see below.
//! - [`from_burn`] **copies** a `TensorData` into a fresh contiguous tensor in shared memory
//!   (current strategy), ready to send.
//!
//! **Aliasing and burn's writes.** A `TensorData` made without a copy holds its bytes in a
//! `bytes::Bytes` whose owner keeps a clone of the tensor (so the storage and its mapping
//! live as long as burn holds them, clones and slices of the `Bytes` included; the
//! storage's [`handle_count`](crate::Storage::handle_count) shows the hold), wrapped by
//! burn's `Bytes::from_shared`. burn reads such bytes in place and copies them on its
//! first write (`as_mut_slice`, `into_vec`, a backend that takes the allocation): burn never
//! writes the tensor's memory, so nothing burn does can change what other handles or
//! processes see. What burn *reads* can still change under it if another handle, thread or
//! process writes the elements, and burn holds plain `&[u8]` references to them: that is
//! why [`to_burn_aliased`] is `unsafe` (the promise of [`Tensor::as_slice`], for as long as
//! burn holds the bytes), and why [`into_burn`] aliases only exclusive tensors.
//!
//! | tensorshare | burn   | | tensorshare | burn   |
//! |-------------|--------|-|-------------|--------|
//! | `bool`      | `Bool` | | `int64`     | `I64`  |
//! | `uint8`     | `U8`   | | `float16`   | `F16`  |
//! | `int8`      | `I8`   | | `bfloat16`  | `BF16` |
//! | `int16`     | `I16`  | | `float32`   | `F32`  |
//! | `int32`     | `I32`  | | `float64`   | `F64`  |
//!
//! burn's `U16`, `U32`, `U64`, `Flex32` and quantized data have no tensorshare dtype:
//! [`from_burn`] refuses them with an [`Error::Unsupported`] naming the dtype.
//!
//! ```
//! use tensorshare::interop::burn::{from_burn, into_burn};
//! use tensorshare::Tensor;
//! # fn main() -> tensorshare::Result<()> {
//! let t = Tensor::from_vec(vec![1i64, 2, 3], &[3])?; // private, one handle
//! let at = t.storage().data_ptr();
//! let data = into_burn(t)?; // burn owns the bytes now: no copy
//! assert_eq!(data.as_bytes().as_ptr() as usize, at);
//! assert_eq!(data.to_vec::<i64>().unwrap(), vec![1, 2, 3]);
//! let back = from_burn(&data)?; // a copy, in shared memory
//! assert!(back.is_shared());
//! # Ok(())
//! # }
//! ```

use burn_backend::{AllocationProperty, Bytes, DType as BDType, TensorData};

use super::shared_from_bytes;
use crate::{DType, Device, Element, Error, Result, Tensor};

/// The burn-backend crate these functions take and return, re-exported so that callers
/// name the same version.
pub use burn_backend;

fn burn_dtype(d: DType) -> BDType {
    match d {
        DType::Bool => BDType::Bool,
        DType::U8 => BDType::U8,
        DType::I8 => BDType::I8,
        DType::I16 => BDType::I16,
        DType::I32 => BDType::I32,
        DType::I64 => BDType::I64,
        DType::F16 => BDType::F16,
        DType::BF16 => BDType::BF16,
        DType::F32 => BDType::F32,
        DType::F64 => BDType::F64,
    }
}

/// A copy of the elements of `t` (row-major, whatever its strides; a CUDA tensor is copied
/// to the host first) as a `TensorData` of the same shape and dtype, owning its bytes.
///
/// # Errors
/// A meta tensor; a `bool` byte other than 0 or 1; no memory for the copy.
pub fn to_burn(t: &Tensor) -> Result<TensorData> {
    fn make<T: Element + burn_backend::Element>(t: &Tensor) -> Result<TensorData> {
        // `new` checks that the values fill the shape: `to_vec` gives exactly numel values.
        Ok(TensorData::new(t.to_vec::<T>()?, t.shape().to_vec()))
    }
    match t.dtype() {
        DType::Bool => make::<bool>(t),
        DType::U8 => make::<u8>(t),
        DType::I8 => make::<i8>(t),
        DType::I16 => make::<i16>(t),
        DType::I32 => make::<i32>(t),
        DType::I64 => make::<i64>(t),
        DType::F16 => make::<half::f16>(t),
        DType::BF16 => make::<half::bf16>(t),
        DType::F32 => make::<f32>(t),
        DType::F64 => make::<f64>(t),
    }
}

/// `t` as a `TensorData`, without a copy when nothing else can reach its bytes: a host
/// tensor that is exclusive (a private storage whose only handle is `t`, see
/// [`Tensor::is_exclusive`]) with contiguous elements. burn then owns the storage (through `t`, moved into the
/// `TensorData`), reads the elements in place and copies them on its first write. Any
/// other tensor is copied, as by [`to_burn`].
///
/// # Errors
/// As [`to_burn`].
pub fn into_burn(mut t: Tensor) -> Result<TensorData> {
    if t.is_contiguous() && t.numel() > 0 && t.check_exclusive().is_ok() {
        // SAFETY: check_exclusive found `t` the only handle of a private host storage (no
        // clone, view, Storage handle or weak reference, by `Arc::get_mut`; heap memory no
        // other process maps), and its acquire of the handle count orders every write made
        // through handles other threads have since dropped before burn's reads (a snapshot
        // of the counts would not: another thread's last `fill` could race with them). `t`
        // moves into the TensorData's owner, out of every caller's reach: nothing can write
        // the elements while burn holds them, which is to_burn_aliased's contract.
        return unsafe { to_burn_aliased(&t) };
    }
    to_burn(&t)
}

/// A `TensorData` over the elements of a contiguous host tensor, **without a copy**:
/// burn's bytes are the tensor's own (shared memory included), held alive by a clone of
/// the tensor until burn drops the last of them. burn copies them before its first write
/// (see the module docs), so nothing burn does writes the tensor.
///
/// Without a promise, use [`to_burn`] (a copy), or [`into_burn`] for a tensor nothing else
/// can reach.
///
/// # Safety
/// While the `TensorData`, or anything burn makes from it without copying (its clones,
/// its `Bytes`, a backend tensor that reads them in place), lives, nothing may write the
/// elements: no other handle of the tensor's storage (a clone, a view, a
/// [`crate::Storage`] handle, an [`crate::AtomicView`]) in any thread, and no other process
/// that received the tensor or its storage. This is the promise of [`Tensor::as_slice`],
/// for as long as burn holds the bytes. Writes made before this call must be ordered
/// before it (a message on a queue, a joined thread, ...).
///
/// # Errors
/// A tensor that is not on the host ([`Error::Device`]) or not contiguous
/// ([`Error::NotContiguous`]; `.contiguous()` first, which copies); a `bool` byte other
/// than 0 or 1 (burn reads bools without checking them).
pub unsafe fn to_burn_aliased(t: &Tensor) -> Result<TensorData> {
    if t.device() != Device::Cpu {
        return Err(Error::Device(format!("a tensor on {} has no host bytes for burn to alias", t.device())));
    }
    if !t.is_contiguous() {
        return Err(Error::NotContiguous { shape: t.shape().to_vec(), strides: t.strides().to_vec() });
    }
    if t.numel() == 0 {
        return to_burn(t);
    }
    if t.dtype() == DType::Bool {
        t.to_vec::<bool>()?; // checks every byte; the caller's promise keeps them valid
    }
    let size = t.dtype().size();
    // In bounds: the view is contiguous and its elements lie in the storage (check_bounds).
    let ptr = t.storage().as_ptr().wrapping_add(t.storage_offset() * size);
    let owner = Alias { _tensor: t.clone(), ptr, len: t.numel() * size };
    let bytes = Bytes::from_shared(bytes::Bytes::from_owner(owner), AllocationProperty::Other);
    Ok(TensorData::from_bytes(bytes, t.shape().to_vec(), burn_dtype(t.dtype())))
}

/// The owner of aliased bytes: a clone of the tensor keeps its storage (and mapping) alive,
/// and the bytes are its contiguous elements. Made only by [`to_burn_aliased`].
struct Alias {
    _tensor: Tensor,
    ptr: *const u8,
    len: usize,
}

// SAFETY: the pointer is into the storage held by `_tensor` (a `Tensor` is Send), usable
// from any thread; reading through it is governed by to_burn_aliased's contract, not by
// which thread reads.
unsafe impl Send for Alias {}

impl AsRef<[u8]> for Alias {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `ptr..ptr + len` are the contiguous elements of the tensor `_tensor`
        // holds, in its host storage, initialised (storages are zeroed or mapped) and alive
        // as long as `self`; an `Alias` exists only under to_burn_aliased's contract (or
        // into_burn's proof of it), by which nothing writes them while burn can read them.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// A copy of `data` in a fresh contiguous tensor in shared memory (current strategy), with
/// its shape and dtype.
///
/// # Errors
/// [`Error::Unsupported`] for burn's `U16`, `U32`, `U64`, `Flex32` and quantized data; a
/// byte count that does not fit the shape; a `bool` byte other than 0 or 1; no shared
/// memory for the copy.
pub fn from_burn(data: &TensorData) -> Result<Tensor> {
    let dtype = DType::ALL.into_iter().find(|d| burn_dtype(*d) == data.dtype).ok_or_else(|| {
        Error::Unsupported(format!(
            "tensorshare has no dtype for burn's {:?}; burn's dtypes that tensorshare shares are Bool, \
             U8, I8, I16, I32, I64, F16, BF16, F32 and F64",
            data.dtype
        ))
    })?;
    shared_from_bytes(data.as_bytes(), dtype, &data.shape)
}
