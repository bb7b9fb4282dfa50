//! candle (feature `candle`, `candle-core` without default features): copies both ways.
//!
//! - [`to_candle`] **copies** a tensor into a candle CPU tensor: one copy, into the `Vec`
//!   that candle's CPU storage owns (candle has no way to borrow memory it does not own). A
//!   CUDA tensor is copied to the host on the way.
//! - [`from_candle`] **copies** a candle CPU tensor into a fresh contiguous tensor in shared
//!   memory (current strategy), ready to send: one copy for a contiguous candle tensor, two
//!   (a gather, then the copy) for a strided one.
//!
//! | tensorshare | candle  | | tensorshare | candle      |
//! |-------------|---------|-|-------------|-------------|
//! | `uint8`     | `U8`    | | `float16`   | `F16`       |
//! | `int16`     | `I16`   | | `bfloat16`  | `BF16`      |
//! | `int32`     | `I32`   | | `float32`   | `F32`       |
//! | `int64`     | `I64`   | | `float64`   | `F64`       |
//!
//! candle has no `bool` and no `int8`, and tensorshare has no `U32` nor candle's 8-, 6- and
//! 4-bit floats: those are an [`Error::Unsupported`] naming the dtype, both ways.
//!
//! No zero-copy path: candle's CPU storage is a `Vec` it owns and may write in place (its
//! in-place ops, `slice_set`), so it cannot stand on memory that other processes write, and
//! tensorshare cannot send memory candle allocated. Its CUDA storage owns a `cudarc` slice
//! that it frees itself, and candle's `cuda` feature needs the CUDA toolkit (`nvcc`) at build
//! time, which this crate's build does not; a candle tensor on a GPU is refused by
//! [`from_candle`] (copy it to the CPU first).
//!
//! ```
//! use tensorshare::interop::candle::{from_candle, to_candle};
//! use tensorshare::Tensor;
//! # fn main() -> tensorshare::Result<()> {
//! let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
//! let c = to_candle(&t)?;
//! let c = c.t().map_err(|e| tensorshare::Error::Unsupported(e.to_string()))?; // candle's transpose
//! let back = from_candle(&c)?; // contiguous, in shared memory
//! assert!(back.is_shared());
//! assert_eq!(back.to_vec::<f32>()?, vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
//! # Ok(())
//! # }
//! ```

use std::borrow::Cow;

use candle_core::{CpuStorage, DType as CDType};

use super::{shared_from_bytes, try_bytes};
use crate::{DType, Element, Error, Result, Tensor};

/// The candle-core crate these functions take and return, re-exported so that callers name
/// the same version.
pub use candle_core;

fn candle_err(e: candle_core::Error) -> Error {
    Error::invalid_argument("candle tensor", e.to_string())
}

/// A copy of `t` as a candle tensor on candle's CPU device, with `t`'s shape and the same
/// values in row-major order (strided views are copied in their logical order). One copy;
/// a CUDA tensor is copied to the host first.
///
/// # Errors
/// [`Error::Unsupported`] for `bool` and `int8`, which candle lacks; a meta tensor; no
/// memory for the copy.
pub fn to_candle(t: &Tensor) -> Result<candle_core::Tensor> {
    fn make<T: Element + candle_core::WithDType>(t: &Tensor) -> Result<candle_core::Tensor> {
        candle_core::Tensor::from_vec(t.to_vec::<T>()?, t.shape(), &candle_core::Device::Cpu)
            .map_err(candle_err)
    }
    match t.dtype() {
        DType::U8 => make::<u8>(t),
        DType::I16 => make::<i16>(t),
        DType::I32 => make::<i32>(t),
        DType::I64 => make::<i64>(t),
        DType::F16 => make::<half::f16>(t),
        DType::BF16 => make::<half::bf16>(t),
        DType::F32 => make::<f32>(t),
        DType::F64 => make::<f64>(t),
        d @ (DType::Bool | DType::I8) => Err(Error::Unsupported(format!(
            "candle has no {d} dtype; candle's dtypes that tensorshare shares are uint8, int16, int32, \
             int64, float16, bfloat16, float32 and float64"
        ))),
    }
}

/// A copy of a candle CPU tensor in a fresh contiguous tensor in shared memory (current
/// strategy), with the same shape and values; any candle layout (strides, offset).
///
/// # Errors
/// [`Error::Unsupported`] for candle's `U32` and its 8-, 6- and 4-bit floats, which
/// tensorshare lacks; [`Error::Device`] for a candle tensor on a GPU; no shared memory for
/// the copy.
pub fn from_candle(c: &candle_core::Tensor) -> Result<Tensor> {
    let (storage, layout) = c.storage_and_layout();
    let cpu = match &*storage {
        candle_core::Storage::Cpu(cpu) => cpu,
        _ => {
            return Err(Error::Device(format!(
                "the candle tensor is on {:?}; copy it to the CPU first (`to_device(&Device::Cpu)`)",
                c.device()
            )))
        }
    };
    let shape = layout.dims().to_vec();
    // The elements of candle's storage that the layout addresses, in row-major order.
    fn bytes_of<'a, T: Element + candle_core::WithDType>(
        c: &candle_core::Tensor,
        cpu: &'a CpuStorage,
        layout: &candle_core::Layout,
    ) -> Result<Cow<'a, [u8]>> {
        let all = cpu.as_slice::<T>().map_err(candle_err)?;
        let outside =
            || Error::invalid_argument("candle tensor", "its layout addresses elements outside its storage");
        if let Some((start, end)) = layout.contiguous_offsets() {
            return Ok(Cow::Borrowed(bytemuck::cast_slice(all.get(start..end).ok_or_else(outside)?)));
        }
        let size = std::mem::size_of::<T>();
        let n = layout.shape().elem_count();
        let mut out = try_bytes(n.checked_mul(size).ok_or_else(outside)?)?;
        for (chunk, i) in out.chunks_exact_mut(size).zip(c.strided_index()) {
            chunk.copy_from_slice(bytemuck::bytes_of(all.get(i).ok_or_else(outside)?));
        }
        Ok(Cow::Owned(out))
    }
    let (dtype, bytes) = match c.dtype() {
        CDType::U8 => (DType::U8, bytes_of::<u8>(c, cpu, layout)?),
        CDType::I16 => (DType::I16, bytes_of::<i16>(c, cpu, layout)?),
        CDType::I32 => (DType::I32, bytes_of::<i32>(c, cpu, layout)?),
        CDType::I64 => (DType::I64, bytes_of::<i64>(c, cpu, layout)?),
        CDType::F16 => (DType::F16, bytes_of::<half::f16>(c, cpu, layout)?),
        CDType::BF16 => (DType::BF16, bytes_of::<half::bf16>(c, cpu, layout)?),
        CDType::F32 => (DType::F32, bytes_of::<f32>(c, cpu, layout)?),
        CDType::F64 => (DType::F64, bytes_of::<f64>(c, cpu, layout)?),
        other => {
            return Err(Error::Unsupported(format!(
                "tensorshare has no dtype for candle's {other:?}; candle's dtypes that tensorshare \
                 shares are U8, I16, I32, I64, F16, BF16, F32 and F64"
            )))
        }
    };
    // Copied while the read guard keeps candle from writing the storage in place.
    shared_from_bytes(&bytes, dtype, &shape)
}
