//! DLPack (feature `dlpack`), through the [dlpark] crate: the exchange format of torch,
//! JAX, CuPy, NumPy and others.
//!
//! - [`to_dlpack`] (and [`to_dlpack_legacy`] for consumers of the pre-1.0 ABI) exports a
//!   tensor **without a copy**: the managed tensor points at the tensor's own bytes and
//!   holds a clone of the tensor until its consumer calls the deleter (drops it). A private
//!   host tensor is first moved into shared memory, in place, as sending it would, so that
//!   the export, every handle of the tensor and every process it is sent to keep seeing the
//!   same bytes. A CUDA tensor is exported as device memory of its device, once the work
//!   tensorshare queued on it is done.
//! - [`from_dlpack`] gives back, **without a copy**, the tensor that a DLPack tensor made by
//!   [`to_dlpack`] in this process exports; it refuses any other producer's.
//! - [`copy_from_dlpack`] **copies** any producer's tensor (host memory, and device memory
//!   under feature `cuda`) into a fresh tensor, in shared memory for a host tensor and on
//!   the same device for a CUDA one. Reading memory another library describes is only as
//!   sound as its description, so this is `unsafe`.
//!
//! Exporting is safe because a DLPack tensor hands out a raw pointer only: every read or
//! write through it is `unsafe` in dlpark, and whoever makes one takes on the contract of
//! [`Tensor::as_slice`] / [`Tensor::as_mut_slice`] (nothing else writes, or touches, the
//! elements meanwhile, in any process).
//!
//! | tensorshare | DLPack (code, bits) | | tensorshare | DLPack (code, bits) |
//! |-------------|---------------------|-|-------------|---------------------|
//! | `bool`      | `kDLBool`, 8        | | `int64`     | `kDLInt`, 64        |
//! | `uint8`     | `kDLUInt`, 8        | | `float16`   | `kDLFloat`, 16      |
//! | `int8`      | `kDLInt`, 8         | | `bfloat16`  | `kDLBfloat`, 16     |
//! | `int16`     | `kDLInt`, 16        | | `float32`   | `kDLFloat`, 32      |
//! | `int32`     | `kDLInt`, 32        | | `float64`   | `kDLFloat`, 64      |
//!
//! Every other DLPack dtype (unsigned 16 to 64 bits, complex, the 8-, 6- and 4-bit floats,
//! more than one lane) is an [`Error::Unsupported`] naming it. Devices: `kDLCPU` and
//! `kDLCUDAHost` (pinned host memory) are host memory; `kDLCUDA` needs feature `cuda`; any
//! other device is an [`Error::Unsupported`]. Strides may be negative or zero in what is
//! copied in; exports carry tensorshare's strides (never negative) and the storage offset
//! as `byte_offset`.
//!
//! ```
//! use tensorshare::interop::dlpack::{from_dlpack, to_dlpack};
//! use tensorshare::Tensor;
//! # fn main() -> tensorshare::Result<()> {
//! let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
//! let exported = to_dlpack(&t.t()?)?; // a transposed view: strides [1, 2]
//! let back = from_dlpack(&exported)?; // the same view, the same bytes
//! assert_eq!(back.storage().data_ptr(), t.storage().data_ptr());
//! drop(exported); // the deleter lets go of its clone
//! assert_eq!(t.storage().handle_count(), 2); // `t` and `back`
//! # Ok(())
//! # }
//! ```

use std::collections::HashSet;
use std::ffi::c_void;
use std::sync::Mutex;

use dlpark::ffi::{DLDataType, DLDevice, DLDeviceType};
use dlpark::metadata::Dynamic;
use dlpark::{legacy, versioned, Managed, ManagedTensorBase};

#[cfg(feature = "cuda")]
use super::check_bools;
use super::{shared_from_bytes, try_bytes};
use crate::{DType, Device, Error, Result, Tensor};

/// The dlpark crate these functions take and return (its `Managed`, `versioned::Dlpack`,
/// `ffi` types), re-exported so that callers name the same version.
pub use dlpark;

/// What a tensorshare export owns: a clone of the tensor, alive until the deleter runs.
struct Export {
    tensor: Tensor,
}

/// The addresses of this process's live [`Export`]s, so that [`from_dlpack`] can tell its
/// own exports from any other producer's without reading memory it does not own.
fn live() -> &'static Mutex<HashSet<usize>> {
    LIVE.get_or_make(Default::default)
}

static LIVE: crate::util::Lazy<Mutex<HashSet<usize>>> = crate::util::Lazy::new();

// A fork while another thread exports or imports would otherwise leave the set locked in
// the child for good.
crate::util::fork::guard_at_load!(crate::util::fork::Rank::Interop, |out| {
    out.push(Box::new(crate::util::lock(live())))
});

impl Drop for Export {
    fn drop(&mut self) {
        // Unregistered before the box is freed, under the lock `from_dlpack` holds while it
        // reads an export: it never reads a freed one.
        crate::util::lock(live()).remove(&(self as *const Export as usize));
    }
}

/// The DLPack type of a tensorshare dtype (the table above), for code that makes DLPack
/// descriptors of its own over tensorshare memory, as the Python package does for torch.
pub fn dl_dtype(d: DType) -> DLDataType {
    match d {
        DType::Bool => DLDataType::BOOL,
        DType::U8 => DLDataType::U8,
        DType::I8 => DLDataType::I8,
        DType::I16 => DLDataType::I16,
        DType::I32 => DLDataType::I32,
        DType::I64 => DLDataType::I64,
        DType::F16 => DLDataType::F16,
        DType::BF16 => DLDataType::BF16,
        DType::F32 => DLDataType::F32,
        DType::F64 => DLDataType::F64,
    }
}

/// The tensorshare dtype of a DLPack type, or an error naming the type.
fn ts_dtype(d: DLDataType) -> Result<DType> {
    DType::ALL.into_iter().find(|t| dl_dtype(*t).matches(d)).ok_or_else(|| {
        Error::Unsupported(format!(
            "the DLPack dtype (code {}, {} bits, {} lanes) has no tensorshare dtype; tensorshare has \
             bool, uint8, int8, int16, int32, int64, float16, bfloat16, float32 and float64",
            d.code.0, d.bits, d.lanes
        ))
    })
}

fn bad(e: impl std::fmt::Display) -> Error {
    Error::invalid_argument("DLPack tensor", e.to_string())
}

fn to_i64(v: usize) -> Result<i64> {
    i64::try_from(v).map_err(|_| bad(format!("{v} does not fit DLPack's int64 shapes and strides")))
}

/// Exports `t` as a versioned (DLPack ≥ 1.0) managed tensor, without a copy.
///
/// The managed tensor points at `t`'s bytes (the storage's first byte as `data`, the view's
/// offset as `byte_offset`, `t`'s shape and strides), and holds a clone of `t` until it is
/// dropped, which is when a DLPack consumer calls its deleter; the storage's
/// [`handle_count`](crate::Storage::handle_count) shows the hold. A private host tensor is
/// moved into shared memory first, in place for every handle (see the module docs). A tensor
/// without elements has a null `data`, as DLPack asks.
///
/// # Errors
/// A meta tensor (no data); a CUDA tensor whose device cannot be synchronised; a shape or
/// stride beyond `i64`; a failure to move a private tensor into shared memory.
pub fn to_dlpack(t: &Tensor) -> Result<versioned::Dlpack> {
    export(t)
}

/// [`to_dlpack`] with the legacy ABI (`DLManagedTensor`, DLPack < 1.0), for consumers that
/// know only that one.
pub fn to_dlpack_legacy(t: &Tensor) -> Result<legacy::Dlpack> {
    export(t)
}

fn export<M: ManagedTensorBase>(t: &Tensor) -> Result<Managed<M>> {
    let device = match t.device() {
        Device::Cpu => {
            t.storage().share_memory()?;
            DLDevice::CPU
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(i) => {
            // The consumer knows nothing of tensorshare's stream: what it queued must be done.
            crate::cuda::synchronize(t.device())?;
            DLDevice::cuda(i32::try_from(i).map_err(bad)?)
        }
        d => return Err(Error::Device(format!("a tensor on the {d} device has no data to export"))),
    };
    let shape = t.shape().iter().map(|&d| to_i64(d)).collect::<Result<Vec<_>>>()?;
    let strides = t.strides().iter().map(|&s| to_i64(s)).collect::<Result<Vec<_>>>()?;
    let (data, byte_offset) = if t.numel() == 0 {
        (std::ptr::null_mut(), 0)
    } else {
        // The offset's byte count fits: every element lies in the storage (check_bounds).
        let off = u64::try_from(t.storage_offset() * t.dtype().size()).map_err(bad)?;
        (t.storage().as_ptr().cast_mut().cast::<c_void>(), off)
    };
    let prepared = Dynamic::new(shape, strides).prepare_as::<M>().map_err(bad)?;
    let ctx = Box::new(Export { tensor: t.clone() });
    crate::util::lock(live()).insert(&*ctx as *const Export as usize);
    let mut init = prepared.initialize(ctx);
    init.set_data(data).set_device(device).set_dtype(dl_dtype(t.dtype())).set_byte_offset(byte_offset);
    // SAFETY: DLPack's contract for the finished descriptor: `data` + `byte_offset` with the
    // shape and strides (copied into the managed allocation, which dlpark frees with it)
    // address exactly the elements of `t`, which lie in its storage (check_bounds, run on
    // every tensor), on the device named; the context holds a clone of `t`, so the storage
    // and its mapping live until the deleter runs (a shared storage's address never changes;
    // the private one was moved into shared memory above); the flags claim nothing
    // (neither READ_ONLY nor IS_COPIED: the export aliases, and others may write).
    Ok(unsafe { init.finish() })
}

/// The tensor that `d` exports, if `d` was made by [`to_dlpack`] or [`to_dlpack_legacy`]
/// in this process: a clone of it, the same storage, without a copy (its own geometry, not
/// the descriptor's). `d` keeps its hold until it is dropped.
///
/// # Errors
/// [`Error::Unsupported`] for a DLPack tensor that another producer made (or another
/// process: a DLPack tensor does not travel between processes); copy such a tensor with
/// [`copy_from_dlpack`].
pub fn from_dlpack<M: ManagedTensorBase>(d: &Managed<M>) -> Result<Tensor> {
    // SAFETY: a `Managed` points to an initialised managed tensor whose fields stay
    // readable and unchanged while it is owned, which every constructor of one (dlpark's
    // `finish`, `from_raw`) asks its caller to uphold; `d` is borrowed, so it is not dropped
    // meanwhile.
    let ctx = unsafe { &*d.as_ptr() }.manager_ctx() as usize;
    let live = crate::util::lock(live());
    if !live.contains(&ctx) {
        return Err(Error::Unsupported(
            "this DLPack tensor was not exported by tensorshare in this process; copy it with the \
             unsafe copy_from_dlpack"
                .into(),
        ));
    }
    // SAFETY: the address is that of a live `Export` (inserted by `export` once boxed,
    // removed by its `Drop` before the box is freed, both under the lock held here), so it
    // points to an `Export` that nothing frees or changes while the lock is held.
    let export = unsafe { &*(ctx as *const Export) };
    Ok(export.tensor.clone())
}

/// A copy of any producer's DLPack tensor: a fresh contiguous tensor in shared memory
/// (current strategy) for a host tensor (`kDLCPU`, `kDLCUDAHost`), a fresh one on the same
/// device for a `kDLCUDA` tensor (feature `cuda`). Any strides, negative and zero ones too,
/// and any `byte_offset`; the data need not be aligned.
///
/// # Safety
/// The descriptor must be true to its memory, as DLPack requires of a producer, and that
/// memory must stay untouched during the call:
/// - every byte of every element the descriptor addresses (`data + byte_offset +
///   offset × element size`, for each offset its shape and strides give) lies in memory
///   that is alive while `d` is;
/// - for a host tensor, that memory is readable in this process and nothing (no thread, no
///   other process, not the producer) writes it during the call;
/// - for a CUDA tensor, those bytes lie in one live allocation of the device named, mapped
///   in this process, and the work writing them is done, or ordered before tensorshare's
///   stream on that device ([`crate::cuda::raw_stream`]).
///
/// # Errors
/// An unsupported dtype or device ([`Error::Unsupported`]); a malformed descriptor
/// (negative sizes, an extent beyond the address space: [`Error::InvalidArgument`]); a
/// `bool` byte other than 0 or 1; no memory for the copy.
pub unsafe fn copy_from_dlpack<M: ManagedTensorBase>(d: &Managed<M>) -> Result<Tensor> {
    let view = d.validate().map_err(bad)?;
    let dtype = ts_dtype(view.dtype())?;
    let shape = view.shape().iter().map(|&s| usize::try_from(s).map_err(bad)).collect::<Result<Vec<_>>>()?;
    let strides = view.strides_or_compact().map_err(bad)?;
    let place = match view.device().device_type {
        DLDeviceType::CPU | DLDeviceType::CUDAHOST => Place::Host,
        #[cfg(feature = "cuda")]
        DLDeviceType::CUDA => Place::Cuda(u32::try_from(view.device().device_id).map_err(bad)?),
        other => {
            return Err(Error::Unsupported(format!(
                "DLPack device type {} (id {}) is not host memory{}",
                other.0,
                view.device().device_id,
                if other == DLDeviceType::CUDA { "; CUDA tensors need feature `cuda`" } else { "" }
            )))
        }
    };
    let (lo, hi) = extent(&shape, &strides, dtype.size())?;
    if lo == hi {
        // No elements: nothing to read, and `data` may be null.
        return match place {
            Place::Host => Tensor::empty_shared(&shape, dtype),
            #[cfg(feature = "cuda")]
            Place::Cuda(dev) => Tensor::empty_on(&shape, dtype, Device::Cuda(dev)),
        };
    }
    let base = (view.data_ptr() as usize as i128) + i128::from(view.byte_offset());
    let in_space = |b: i128| b >= 0 && b <= usize::MAX as i128;
    if !(in_space(base + lo) && in_space(base + hi)) {
        return Err(bad("data + byte_offset and the strides address memory beyond the address space"));
    }
    let bytes = match place {
        Place::Host => {
            // The extent's first byte, derived from the producer's pointer (checked above to
            // lie in the address space).
            let first = view
                .data_ptr()
                .cast::<u8>()
                .wrapping_add(usize::try_from(view.byte_offset()).map_err(bad)?)
                .wrapping_sub((-lo) as usize);
            // SAFETY: the caller's contract: the elements' bytes, all of which lie in the
            // extent from `first`, are readable and not written meanwhile.
            unsafe { gather(first, -lo, &shape, &strides, dtype.size()) }?
        }
        #[cfg(feature = "cuda")]
        Place::Cuda(dev) => {
            let mut span = try_bytes((hi - lo) as usize)?;
            // SAFETY: the caller's contract: the extent, which holds every element, lies in
            // one live allocation of `dev` mapped here, with its writes done.
            unsafe { crate::cuda::copy_to_host(dev, (base + lo) as u64, &mut span) }?;
            // SAFETY: `span` is a live host buffer holding exactly the extent.
            unsafe { gather(span.as_ptr(), -lo, &shape, &strides, dtype.size()) }?
        }
    };
    match place {
        Place::Host => shared_from_bytes(&bytes, dtype, &shape),
        #[cfg(feature = "cuda")]
        Place::Cuda(dev) => upload(&bytes, dtype, &shape, Device::Cuda(dev)),
    }
}

/// Where the elements of an imported DLPack tensor are.
enum Place {
    /// Host memory (`kDLCPU`, `kDLCUDAHost`).
    Host,
    /// A CUDA device, by ordinal (`kDLCUDA`).
    #[cfg(feature = "cuda")]
    Cuda(u32),
}

/// A tensor on `device` holding `bytes` (row-major, checked for `bool`).
#[cfg(feature = "cuda")]
fn upload(bytes: &[u8], dtype: DType, shape: &[usize], device: Device) -> Result<Tensor> {
    check_bools(bytes, dtype)?;
    let host = Tensor::try_zeros(shape, dtype)?;
    let mut raw = Tensor::from_storage(host.storage().clone(), DType::U8, &[bytes.len()], &[1], 0)?;
    raw.copy_from_slice(bytes)?;
    host.to_device(device)
}

/// The byte range, relative to the element at offset 0, that the elements of a view of
/// `shape` and `strides` occupy: `[lo, hi)`, with checked arithmetic. Empty for no elements.
fn extent(shape: &[usize], strides: &[i64], size: usize) -> Result<(i128, i128)> {
    if shape.len() != strides.len() {
        return Err(bad(format!("shape {shape:?} and strides {strides:?} have different lengths")));
    }
    if shape.contains(&0) {
        return Ok((0, 0));
    }
    let overflow =
        || bad(format!("shape {shape:?} with strides {strides:?} spans more bytes than can be counted"));
    let (mut lo, mut hi) = (0i128, 0i128);
    for (&d, &s) in shape.iter().zip(strides) {
        // d < 2^64 and |s| <= 2^63: each product fits i128; their sums are checked (a
        // descriptor may have up to i32::MAX dimensions).
        let span = (d as i128 - 1) * i128::from(s);
        let side = if span < 0 { &mut lo } else { &mut hi };
        *side = side.checked_add(span).ok_or_else(overflow)?;
    }
    let size = size as i128;
    let lo = lo.checked_mul(size).ok_or_else(overflow)?;
    let hi = hi.checked_add(1).and_then(|h| h.checked_mul(size)).ok_or_else(overflow)?;
    Ok((lo, hi))
}

/// The bytes of every element, in row-major order: a row at a time where the last
/// dimension is contiguous, an element at a time otherwise.
///
/// # Safety
/// `first` is the lowest byte of the extent; the element at offset 0 is `origin` bytes
/// further; every element's bytes (at `origin + offset × size` from `first`) are readable
/// and not written during the call.
unsafe fn gather(
    first: *const u8,
    origin: i128,
    shape: &[usize],
    strides: &[i64],
    size: usize,
) -> Result<Vec<u8>> {
    let numel =
        shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| bad("size overflows"))?;
    let total = numel.checked_mul(size).ok_or_else(|| bad("the byte size overflows"))?;
    let mut out = try_bytes(total)?;
    if numel == 0 {
        return Ok(out);
    }
    let rows = strides.last() == Some(&1);
    let (outer, run) = match shape.split_last() {
        Some((&inner, outer)) if rows => (outer, inner * size),
        _ => (shape, size),
    };
    let mut idx = vec![0usize; outer.len()];
    for chunk in out.chunks_exact_mut(run) {
        let off: i128 = idx.iter().zip(strides).map(|(&i, &s)| i as i128 * i128::from(s)).sum();
        // SAFETY: `idx` indexes an element of the view (the first of a row of contiguous
        // elements when `rows`), whose bytes lie in the extent from `first` (the caller's
        // contract), so the `run` bytes read are in bounds and readable; `chunk` is a
        // distinct, exclusively borrowed host buffer of `run` bytes.
        unsafe {
            let src = first.add((origin + off * size as i128) as usize);
            std::ptr::copy_nonoverlapping(src, chunk.as_mut_ptr(), run);
        }
        for d in (0..outer.len()).rev() {
            idx[d] += 1;
            if idx[d] < outer[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    Ok(out)
}
