//! Conversions between tensorshare tensors and other Rust ML libraries, one cargo feature
//! (and one module) per library.
//!
//! | feature  | module                        | to the library                               | back to tensorshare                            |
//! |----------|-------------------------------|----------------------------------------------|------------------------------------------------|
//! | `dlpack` | `interop::dlpack` (dlpark)    | `to_dlpack`: **aliases** (safe)              | `from_dlpack`: **aliases**, tensorshare's own exports only (safe); `copy_from_dlpack`: copies, any producer (`unsafe`) |
//! | `candle` | `interop::candle` (candle-core) | `to_candle`: copies (safe)                 | `from_candle`: copies (safe)                   |
//! | `burn`   | `interop::burn` (burn-backend) | `to_burn`: copies (safe); `into_burn`: moves without a copy when the tensor is exclusive, copies otherwise (safe); `to_burn_aliased`: **aliases**, burn copies before it writes (`unsafe`) | `from_burn`: copies (safe) |
//!
//! Each module's documentation has its dtype table and the details; each re-exports the
//! library crate it converts to (`interop::candle::candle_core`, ...), so that callers name
//! the version these functions take.
//!
//! **Where imports land.** Every copy back into tensorshare lands in a fresh *shared*
//! storage (an arena slot, under the current [sharing strategy](crate::get_sharing_strategy)):
//! the tensor can be sent to another process at once, without the copy into shared memory
//! that sending a private tensor makes. A CUDA tensor imported from DLPack lands on its
//! device (feature `cuda`).
//!
//! **Why free functions in one module per library**, and not methods of [`crate::Tensor`] or
//! `From`/`TryFrom` impls: each conversion either copies or aliases, and aliasing memory that
//! other processes write is `unsafe` wherever the other library could see it change under a
//! reference (the crate's memory model); a name per behaviour (`to_burn` and
//! `to_burn_aliased`) says which one a call does, where a `TryFrom` impl could not (nor be
//! `unsafe`). The path names the feature that provides it, the methods of `Tensor` stay the
//! same whatever features are on, and every item has one path
//! (`tensorshare::interop::<library>::<function>`).
//!
//! **Why no zero-copy import of foreign memory into a `Tensor`.** Every host storage is
//! 64-byte aligned and made of whole 64-byte chunks, which the safe copies (`to_vec`,
//! `fill`, ...) rely on to access memory with atomic word operations that never leave the
//! allocation; memory that another library allocated has no such guarantee, and could not
//! be sent to another process either (only arena slots travel). So foreign memory is copied
//! in, and the zero-copy directions are the exports, plus DLPack tensors that tensorshare
//! itself exported (`dlpack::from_dlpack`).
//!
//! # tch (libtorch): not built
//! A `tch` feature would wrap a tensor with `tch::Tensor::from_blob` (an `unsafe` alias,
//! with a guard holding the storage). It is not part of the crate because it cannot be built
//! and tested with the Rust toolchain alone: tch 0.26 builds `torch-sys`, which compiles a
//! 785 KB generated C++ file against the headers of exactly PyTorch 2.13.0 (its build script
//! refuses any other version) and links libtorch. The only libtorch reachable from the
//! machines this crate is built and tested on is PyPI's wheel
//! `torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl` (527 MB compressed;
//! `libtorch_cpu.so` 438 MB and `libtorch_cuda.so` 470 MB unpacked), whose `libtorch.so`
//! needs the CUDA 13 runtime wheels it depends on (`cuda-toolkit` 13.0.3 with cuBLAS,
//! cuFFT, cuSOLVER, cuSPARSE, NVRTC, ..., cuDNN 9.20, NCCL 2.29, NVSHMEM 3.4, cuSPARSELt);
//! the CPU-only libtorch is published on download.pytorch.org only. CI needs nothing but
//! the Rust toolchain, and a feature that neither CI nor a plain `cargo build` can build is
//! not offered. DLPack is the zero-copy route to libtorch meanwhile: torch's
//! `torch.from_dlpack` takes what `dlpack::to_dlpack` makes.

#[cfg(feature = "burn")]
pub mod burn;
#[cfg(feature = "candle")]
pub mod candle;
#[cfg(feature = "dlpack")]
pub mod dlpack;

#[cfg(any(feature = "dlpack", feature = "candle", feature = "burn"))]
use crate::{DType, Error, Result, Tensor};

/// A fresh contiguous tensor of `shape` in shared memory (current strategy) holding
/// `bytes`: the elements in row-major order, native byte order. Checks that the byte count
/// fits the shape and, for `bool`, that every byte is 0 or 1.
#[cfg(any(feature = "dlpack", feature = "candle", feature = "burn"))]
pub(crate) fn shared_from_bytes(bytes: &[u8], dtype: DType, shape: &[usize]) -> Result<Tensor> {
    let t = Tensor::empty_shared(shape, dtype)?;
    let expected = t.storage().len();
    if bytes.len() != expected {
        return Err(Error::shape(
            "import",
            shape,
            format!("{} bytes given for a {dtype} tensor of shape {shape:?} ({expected} bytes)", bytes.len()),
        ));
    }
    check_bools(bytes, dtype)?;
    // The same bytes seen as u8, written with the crate's safe (atomic) copy: the fresh
    // storage needs no promise about who else could reach it.
    let mut raw = Tensor::from_storage(t.storage().clone(), DType::U8, &[expected], &[1], 0)?;
    raw.copy_from_slice(bytes)?;
    Ok(t)
}

/// For `bool`, an error unless every byte is 0 or 1 (the only valid `bool` values).
#[cfg(any(feature = "dlpack", feature = "candle", feature = "burn"))]
pub(crate) fn check_bools(bytes: &[u8], dtype: DType) -> Result<()> {
    if dtype == DType::Bool {
        if let Some(b) = bytes.iter().find(|b| **b > 1) {
            return Err(Error::InvalidValue { dtype, reason: format!("the byte {b} is neither 0 nor 1") });
        }
    }
    Ok(())
}

/// A vector of `n` bytes, or an error if they cannot be allocated.
#[cfg(any(feature = "dlpack", feature = "candle"))]
pub(crate) fn try_bytes(n: usize) -> Result<Vec<u8>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| Error::AllocationFailed { bytes: n })?;
    v.resize(n, 0);
    Ok(v)
}
