//! torch tensors over blocks, and over the core's CUDA allocations, made through DLPack
//! (`torch._C._from_dlpack`).
//!
//! `torch.frombuffer` parses its arguments (about a third of its cost). A DLPack capsule is
//! one argument; the tensor torch makes from it keeps the [`Export`] below, and with it the
//! block or the allocation, until torch calls the export's deleter when the storage is freed.

use std::cell::Cell;
use std::ffi::{c_void, CStr};

use dlpark::ffi::{DLDevice, DLManagedTensor, DLTensor};
use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::prelude::*;
use tensorshare::interop::dlpack::dl_dtype;
use tensorshare::{DType, Storage};

use crate::Block;

/// The name of a capsule holding a legacy `DLManagedTensor`.
const NAME: &CStr = c"dltensor";

/// What torch is handed: the descriptor it reads, its shape and stride, and what the
/// descriptor's memory is, kept alive until torch calls [`delete`].
#[repr(C)]
struct Export {
    /// First, so that the descriptor's address is the export's, which [`delete`] is given.
    managed: DLManagedTensor,
    shape: i64,
    stride: i64,
    owner: Owner,
}

/// What an export's memory is.
enum Owner {
    /// A block, in host memory.
    Block(Py<Block>),
    /// A CUDA allocation of the core (a storage on a CUDA device), recorded as `id` in
    /// [`crate::cuda`]'s table, whose entry goes with the export.
    Device { storage: Storage, id: u64 },
}

/// A flat tensor of `dtype` over the whole of `block`, made by `from_dlpack`
/// (`torch._C._from_dlpack`), whose storage holds `block` until torch frees it.
pub(crate) fn flat<'py>(
    py: Python<'py>,
    from_dlpack: &Bound<'py, PyAny>,
    block: &Bound<'py, Block>,
    dtype: DType,
) -> PyResult<Bound<'py, PyAny>> {
    let storage = &block.get().storage;
    let data = storage.as_mut_ptr().cast::<c_void>();
    export(py, from_dlpack, data, storage.len(), DLDevice::CPU, dtype, Owner::Block(block.clone().unbind()))
}

/// A flat `uint8` tensor over the whole of `storage`, a CUDA allocation of the core on
/// device `index`, made by `from_dlpack`, whose storage holds a clone of `storage` until
/// torch frees it, and then lets [`crate::cuda`] forget entry `id`.
pub(crate) fn flat_device<'py>(
    py: Python<'py>,
    from_dlpack: &Bound<'py, PyAny>,
    storage: &Storage,
    index: u32,
    id: u64,
) -> PyResult<Bound<'py, PyAny>> {
    let index = i32::try_from(index).map_err(|_| PyValueError::new_err(format!("no CUDA device {index}")))?;
    // A device storage's pointer is the allocation's device address (unified addressing),
    // which DLPack's `data` is for a CUDA tensor.
    let data = storage.as_mut_ptr().cast::<c_void>();
    let owner = Owner::Device { storage: storage.clone(), id };
    export(py, from_dlpack, data, storage.len(), DLDevice::cuda(index), DType::U8, owner)
}

/// A flat tensor of `dtype` over the `len` bytes at `data` on `device`, which `owner` keeps.
fn export<'py>(
    py: Python<'py>,
    from_dlpack: &Bound<'py, PyAny>,
    data: *mut c_void,
    len: usize,
    device: DLDevice,
    dtype: DType,
    owner: Owner,
) -> PyResult<Bound<'py, PyAny>> {
    if len == 0 || !len.is_multiple_of(dtype.size()) {
        let what = if matches!(owner, Owner::Block(_)) { "a block" } else { "a CUDA allocation" };
        // The owner is let go here, as after a refusal by torch (see `delete`).
        drop_owner(owner);
        return Err(PyValueError::new_err(format!(
            "{what} of {len} bytes is no whole number of {dtype} elements (and at least one)"
        )));
    }
    let Ok(n) = i64::try_from(len / dtype.size()) else {
        drop_owner(owner);
        return Err(PyValueError::new_err(format!("a memory of {len} bytes is too large for torch")));
    };
    let raw = Box::into_raw(Box::new(Export {
        managed: DLManagedTensor {
            dl_tensor: DLTensor {
                data,
                device,
                ndim: 1,
                dtype: dl_dtype(dtype),
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete),
        },
        shape: n,
        stride: 1,
        owner,
    }));
    // SAFETY: `raw` is the live allocation just made, owned here until the capsule takes it;
    // the shape and stride pointers point into the same allocation, which does not move and
    // lives as long as the descriptor (they are freed together, by `delete`).
    unsafe {
        (*raw).managed.dl_tensor.shape = &raw mut (*raw).shape;
        (*raw).managed.dl_tensor.strides = &raw mut (*raw).stride;
    }
    let raw = raw.cast::<DLManagedTensor>();
    // SAFETY: a capsule of a non-null pointer with a static name. It has no destructor:
    // torch renames a capsule only once it has made its tensor, and may already have called
    // the deleter when making it fails (out of memory inside torch), so a destructor that
    // freed the export of a capsule still named after a failure could free it twice. A
    // failure is settled below instead.
    let capsule = unsafe { ffi::PyCapsule_New(raw.cast::<c_void>(), NAME.as_ptr(), None) };
    if capsule.is_null() {
        // SAFETY: no capsule holds `raw`, so it is still owned here, and freed only now.
        unsafe { delete(raw) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: `capsule` is a new, owned reference, checked non-null above.
    let capsule = unsafe { Bound::from_owned_ptr(py, capsule) };
    let outer = IN_FLIGHT.with(|c| c.replace(raw));
    let made = from_dlpack.call1((capsule,));
    let untouched = IN_FLIGHT.with(|c| c.replace(outer)) == raw;
    if made.is_err() && untouched {
        // torch refused the descriptor before it wrapped it (a dtype it does not read, say):
        // it never calls the deleter then, so the export is still ours.
        // SAFETY: torch did not call `delete` (it would have cleared `IN_FLIGHT`), and a
        // failed call keeps nothing that could call it later: the export is owned here.
        unsafe { delete(raw) };
    }
    made
}

thread_local! {
    /// The export whose `from_dlpack` call runs in this thread, until [`delete`] frees it
    /// (which torch does in the same thread when a call fails after it wrapped the
    /// descriptor): after a failed call, whether the export is still [`export`]'s to free.
    static IN_FLIGHT: Cell<*mut DLManagedTensor> = const { Cell::new(std::ptr::null_mut()) };
}

/// The descriptor's deleter, called once by whoever owns the export last: torch when it
/// frees the storage, or [`export`] when torch did not take it.
unsafe extern "C" fn delete(managed: *mut DLManagedTensor) {
    // `try_with`: during this thread's teardown the slot may be gone; nothing is in flight
    // then.
    let _ = IN_FLIGHT.try_with(|c| {
        if c.get() == managed {
            c.set(std::ptr::null_mut());
        }
    });
    // SAFETY: every descriptor whose deleter is this one is the first field of an `Export`
    // boxed by `export` (`repr(C)`: the same address), and DLPack's owner calls the deleter
    // once, after its last use of the descriptor, so the box is ours to free.
    let export = unsafe { Box::from_raw(managed.cast::<Export>()) };
    let Export { owner, .. } = *export;
    drop_owner(owner);
}

/// Lets go of what an export kept, from any thread, holding the GIL or not (see [`release`]).
fn drop_owner(owner: Owner) {
    match owner {
        // SAFETY: a strong reference, now owned here alone.
        Owner::Block(block) => unsafe { release(block.into_ptr()) },
        Owner::Device { storage, id } => {
            // The table's entry first: while it is there, the allocation is found by its
            // address (and `storage` keeps it mapped there).
            crate::cuda::forget(storage.data_ptr(), id);
            drop(storage);
        }
    }
}

/// Lets go of strong reference `obj` from any thread, holding the GIL or not: torch frees a
/// storage wherever its last tensor goes, also in code that let go of the GIL under a pyo3
/// call (pyo3's own count of the GIL would then be wrong). `PyGILState_Ensure` asks the
/// interpreter, and takes the GIL if this thread lacks it; while the interpreter shuts down
/// it parks a thread that is not its own for good (pyo3's wrapper keeps that from unwinding
/// through Rust frames), and once the interpreter is gone the reference is left: the process
/// is ending.
///
/// # Safety
/// `obj` must be a strong reference the caller owns, and gives up here.
unsafe fn release(obj: *mut ffi::PyObject) {
    // SAFETY: `Py_IsInitialized` may be called from any thread at any time; the reference is
    // let go with the GIL held, taken here if need be, and given back as it was.
    unsafe {
        if ffi::Py_IsInitialized() == 0 {
            return;
        }
        let state = ffi::PyGILState_Ensure();
        ffi::Py_DecRef(obj);
        ffi::PyGILState_Release(state);
    }
}
