//! torch CUDA tensors over the core's own CUDA allocations, which travel as tensorshare
//! handles: one device allocation per storage, exported whole (CUDA VMM with a POSIX-fd
//! handle, or the legacy IPC handle where a program consents), between Python processes and
//! Rust ones alike. Unlike torch's CUDA IPC, a process that received one may send it on, and
//! a consumer's death gives its hold back at once (the kernel closes its descriptors).
//!
//! Such a tensor comes from `tensorshare.empty_shared(..., device="cuda")` or from a message.
//! torch sees an allocation through DLPack, as one flat `uint8` tensor over all of it, whose
//! storage is then the allocation's torch storage while it lives: tensors received from one
//! allocation are views of that one storage, as in torch. A torch CUDA tensor of torch's own
//! allocator is not one of these; it travels with torch's reduction instead
//! (`_reduction._cuda_reduction`).
//!
//! The table below finds an allocation by its device address. Its entry lives as long as the
//! torch storage over the allocation: the export that torch holds removes it when torch
//! frees the storage ([`forget`]). The memory itself is unmapped (in a receiver) or reused
//! (in its creator) only after every stream of the device's context is done with it: torch
//! frees a storage while its kernels may still read it, and the core synchronises the context
//! before it releases an allocation.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple, PyWeakrefReference};
use tensorshare::{DType, Device, Storage, Tensor};

use crate::to_py;
use crate::torch::Api;

/// An allocation torch has a storage over.
struct Entry {
    /// The allocation, kept mapped at its address while the entry is here.
    storage: Storage,
    /// The torch storage over it (the flat tensor's), while it lives.
    torch: Py<PyWeakrefReference>,
    /// The export torch holds, which removes this entry, and only this one.
    id: u64,
}

/// The allocations torch has storages over, by device address.
static TABLE: Mutex<BTreeMap<usize, Entry>> = Mutex::new(BTreeMap::new());

/// The next export's id.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Runs `f` on the table under its lock, which only a thread holding the GIL takes (the
/// export's deleter takes the GIL first, see [`forget`]): so a Python thread that forks
/// (holding the GIL) never leaves it locked in its child. `f` runs no Python code and lets
/// nothing go that could run some (a finaliser could use the table again, in this thread);
/// what it takes out of the table is returned, to be let go after the lock.
fn with_table<R>(f: impl FnOnce(&mut BTreeMap<usize, Entry>) -> R) -> R {
    f(&mut TABLE.lock().unwrap_or_else(|p| p.into_inner()))
}

/// Removes entry `id` at device address `addr`, called by its export when torch frees the
/// storage over the allocation, from any thread, holding the GIL or not: it takes the GIL
/// for the table (see [`with_table`]) and lets it go before the entry's allocation goes,
/// whose release may wait for the device.
pub(crate) fn forget(addr: usize, id: u64) {
    // SAFETY: `Py_IsInitialized` may be called from any thread at any time. With the
    // interpreter there, `PyGILState_Ensure` takes the GIL (or finds this thread holding it)
    // and `PyGILState_Release` gives it back as it was; the weak reference is let go with
    // the GIL held. Once the interpreter is gone the process is ending: the entry is left.
    let gone = unsafe {
        if pyo3::ffi::Py_IsInitialized() == 0 {
            return;
        }
        let gil = pyo3::ffi::PyGILState_Ensure();
        let gone = with_table(|t| match t.get(&addr) {
            Some(e) if e.id == id => t.remove(&addr),
            _ => None,
        });
        let storage = gone.map(|Entry { storage, torch, .. }| {
            pyo3::ffi::Py_DecRef(torch.into_ptr());
            storage
        });
        pyo3::ffi::PyGILState_Release(gil);
        storage
    };
    drop(gone);
}

/// Whether the core's CUDA code runs on its simulated device, whose "device" memory is host
/// memory: torch would take its addresses for device ones.
fn simulated() -> bool {
    tensorshare::cuda::driver_name().is_ok_and(|name| name == "simulated")
}

/// Why the simulated device's tensors do not reach torch.
const SIMULATED: &str =
    "tensorshare's CUDA driver is the simulated one (TENSORSHARE_CUDA_DRIVER=simulated), whose \
    memory is the host's: torch would take it for device memory, so its tensors do not become torch tensors";

/// The live torch storage over `storage`'s allocation, if torch has one.
fn torch_storage_of<'py>(
    py: Python<'py>,
    api: &Api,
    storage: &Storage,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    use pyo3::types::PyWeakrefMethods;
    let addr = storage.data_ptr();
    // `upgrade` of a live object returns a new reference and runs no Python code; one of a
    // dead object returns None.
    let Some(s) = with_table(|t| t.get(&addr).and_then(|e| e.torch.bind(py).upgrade())) else {
        return Ok(None);
    };
    Ok(still_over(api, &s, storage)?.then_some(s))
}

/// The torch storage over `storage`, a CUDA allocation of the core on device `index`: the
/// one torch has, else a new one, recorded.
fn torch_storage<'py>(
    py: Python<'py>,
    api: &Api,
    storage: &Storage,
    index: u32,
) -> PyResult<Bound<'py, PyAny>> {
    if let Some(s) = torch_storage_of(py, api, storage)? {
        return Ok(s);
    }
    let Some(from_dlpack) = &api.from_dlpack else {
        return Err(PyValueError::new_err(
            "this torch has no torch._C._from_dlpack, through which tensorshare's CUDA tensors reach it",
        ));
    };
    if simulated() {
        return Err(PyValueError::new_err(SIMULATED));
    }
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let flat = crate::dlpack::flat_device(py, from_dlpack.bind(py), storage, index, id)?;
    let s = api.t.untyped_storage.call0(&flat)?;
    let entry = Entry { storage: storage.clone(), torch: PyWeakrefReference::new(&s)?.unbind(), id };
    // Making the tensor ran Python code (torch's), during which another thread may have made
    // and recorded a torch storage over the same allocation: that one stays (tensors over it
    // exist), and this one is used unrecorded (its export finds its id absent and removes
    // nothing). An entry whose torch storage died, its export not yet run, is replaced.
    let addr = storage.data_ptr();
    let (theirs, gone) = with_table(|t| match t.get(&addr).and_then(|e| e.torch.bind(py).upgrade()) {
        Some(theirs) => (Some(theirs), Some(entry)),
        None => (None, t.insert(addr, entry)),
    });
    drop(gone);
    if let Some(theirs) = theirs {
        if still_over(api, &theirs, storage)? {
            return Ok(theirs);
        }
    }
    Ok(s)
}

/// A received CUDA tensor as a torch tensor over its allocation's torch storage.
pub(crate) fn from_tensor<'py>(
    py: Python<'py>,
    api: &Api,
    t: &Tensor,
    index: u32,
    dtype: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let kwargs = PyDict::new(py);
    kwargs.set_item(api.key_dtype.bind(py), dtype)?;
    kwargs.set_item(api.key_device.bind(py), format!("cuda:{index}"))?;
    let shape = PyTuple::new(py, t.shape())?;
    let strides = PyTuple::new(py, t.strides())?;
    if t.storage().is_empty() {
        return api.empty_strided.bind(py).call((shape, strides), Some(&kwargs));
    }
    let storage = torch_storage(py, api, t.storage(), index)?;
    let out = api.empty.bind(py).call((0,), Some(&kwargs))?;
    api.t.set_.bind(py).call1((&out, storage, t.storage_offset(), shape, strides))?;
    Ok(out)
}

/// A torch CUDA tensor as a tensorshare tensor, when its storage is one of the core's
/// allocations; `None` for any other (torch's own allocator's), which is pickled with torch's
/// reduction. The work queued on torch's current stream of the tensor's device is waited for
/// first, as torch's own reduction makes the receiver wait for it: what the program wrote
/// before the send is what the receiver reads.
pub(crate) fn to_tensor(
    py: Python<'_>,
    api: &Api,
    obj: &Bound<'_, PyAny>,
    dtype: DType,
    shape: &[usize],
    strides: &[usize],
    offset: usize,
) -> PyResult<Option<Tensor>> {
    let Some(storage) = allocation_of(api, obj)? else { return Ok(None) };
    let device = api.t.device.get(obj)?;
    py.import("torch.cuda")?.call_method1("current_stream", (device,))?.call_method0("synchronize")?;
    Tensor::from_storage(storage, dtype, shape, strides, offset).map(Some).map_err(to_py)
}

/// Whether the `nbytes` at device address `ptr` lie in one of the core's allocations that
/// torch has a storage over (a view of one that no handle can say: see `_cuda_reduction`).
pub(crate) fn covers(ptr: usize, nbytes: usize) -> bool {
    with_table(|t| {
        t.range(..=ptr).next_back().is_some_and(|(&start, e)| {
            let end = ptr.checked_add(nbytes);
            end.zip(start.checked_add(e.storage.len())).is_some_and(|(end, limit)| end <= limit)
        })
    })
}

/// Whether torch CUDA tensor `obj` is over one of the core's allocations (and so a handle).
pub(crate) fn is_ours(api: &Api, obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    Ok(allocation_of(api, obj)?.is_some())
}

/// The core's allocation that torch tensor `obj`'s storage is, whole, if any.
fn allocation_of(api: &Api, obj: &Bound<'_, PyAny>) -> PyResult<Option<Storage>> {
    let s = api.t.untyped_storage.call0(obj)?;
    let ptr: usize = api.storage_data_ptr.call0(&s)?.extract()?;
    let nbytes: usize = api.storage_nbytes.call0(&s)?.extract()?;
    if nbytes == 0 {
        return Ok(None);
    }
    Ok(with_table(|t| t.get(&ptr).filter(|e| e.storage.len() == nbytes).map(|e| e.storage.clone())))
}

/// Whether torch storage `s` still has `storage`'s memory (torch may give a storage other
/// memory; it says where its memory is).
fn still_over(api: &Api, s: &Bound<'_, PyAny>, storage: &Storage) -> PyResult<bool> {
    let ptr: usize = api.storage_data_ptr.call0(s)?.extract()?;
    let nbytes: usize = api.storage_nbytes.call0(s)?.extract()?;
    Ok(ptr == storage.data_ptr() && nbytes == storage.len())
}

/// `tensorshare.empty_shared(shape, dtype, device="cuda:N")`: a torch tensor of `shape` over
/// a new allocation of the core on CUDA device `index`.
pub(crate) fn empty<'py>(
    py: Python<'py>,
    api: &Api,
    shape: &Bound<'py, PyTuple>,
    dtype_obj: &Bound<'py, PyAny>,
    index: u32,
) -> PyResult<Bound<'py, PyAny>> {
    let Some(k) = api.dtypes.iter().position(|d| d.bind(py).is(dtype_obj)) else {
        return Err(PyValueError::new_err(format!("tensorshare has no dtype {dtype_obj}")));
    };
    let dtype = DType::ALL[k];
    let dims: Vec<usize> = shape.extract()?;
    let t = py.detach(|| Tensor::empty_on(&dims, dtype, Device::Cuda(index))).map_err(to_py)?;
    from_tensor(py, api, &t, index, dtype_obj)
}
