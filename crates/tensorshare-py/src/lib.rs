//! `tensorshare._native`: the Rust half of the Python package.
//!
//! - [`Block`]: a block of a tensorshare arena, exposed through the buffer protocol, so that
//!   torch (`torch.frombuffer`) and numpy (`numpy.ndarray(buffer=...)`) map it without a
//!   copy; the block's hold is released when the last Python object viewing it is freed.
//! - [`PyQueue`]: a tensorshare queue of [`Value`]s; Python values are turned into values
//!   here, in Rust (`convert`), with tensors and arrays as handles to their blocks.
//!
//! The pure-Python part (`python/tensorshare`) builds on these.

use std::os::raw::c_int;

use pyo3::exceptions::{PyEOFError, PyMemoryError, PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::{create_exception, ffi};
use tensorshare::{Error, Storage};

mod convert;
mod cuda;
mod descr;
mod dlpack;
mod pipe;
mod queue;
mod torch;
mod wait;

create_exception!(
    _native,
    TensorshareError,
    PyRuntimeError,
    "An error of tensorshare (its message says what and why)."
);
create_exception!(
    _native,
    InvalidMessage,
    PyValueError,
    "A message from another process was malformed; what it carried was given back."
);

/// A tensorshare error as the Python exception a Python user expects.
pub(crate) fn to_py(e: Error) -> PyErr {
    let text = e.to_string();
    match e {
        Error::Disconnected => PyEOFError::new_err(text),
        Error::InvalidMessage(_) => InvalidMessage::new_err(text),
        Error::OutOfSharedMemory { .. } | Error::AllocationFailed { .. } => PyMemoryError::new_err(text),
        // Out of address space (a mapping under `ulimit -v`), or of memory.
        Error::Io { source, .. } if source.raw_os_error() == Some(libc::ENOMEM) => {
            PyMemoryError::new_err(text)
        }
        Error::Io { .. } => PyOSError::new_err(text),
        _ => TensorshareError::new_err(text),
    }
}

/// A block of shared memory in a tensorshare arena (or a private one, for an empty block).
/// Its buffer is writable and lives as long as this object.
#[pyclass(module = "tensorshare._native", frozen, weakref)]
pub struct Block {
    pub(crate) storage: Storage,
}

#[pymethods]
impl Block {
    /// Its size in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.storage.len()
    }

    /// The address of its first byte in this process.
    #[getter]
    fn address(&self) -> usize {
        self.storage.data_ptr()
    }

    /// Whether it lives in shared memory (an empty block does not need to).
    #[getter]
    fn is_shared(&self) -> bool {
        self.storage.is_shared()
    }

    fn __len__(&self) -> usize {
        self.storage.len()
    }

    fn __repr__(&self) -> String {
        format!("Block({} bytes at {:#x})", self.storage.len(), self.storage.data_ptr())
    }

    /// # Safety
    /// Called by CPython with a `Py_buffer` to fill, as the buffer protocol prescribes.
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let storage = &slf.get().storage;
        let len = isize::try_from(storage.len()).map_err(|_| PyValueError::new_err("block too large"))?;
        // SAFETY: `view` is the Py_buffer CPython passed in; the memory is `len` bytes the
        // storage keeps mapped for as long as the storage lives, and PyBuffer_FillInfo stores a
        // new reference to this object in `view.obj`, so the Block, and with it the storage
        // and its mapping, outlive every user of the view. The memory is shared with other
        // processes: Python sees it as plain writable bytes, and no Rust reference to it is
        // created here.
        let rc =
            unsafe { ffi::PyBuffer_FillInfo(view, slf.as_ptr(), storage.as_mut_ptr().cast(), len, 0, flags) };
        if rc == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    /// # Safety
    /// Called by CPython when a view made by `__getbuffer__` is released.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

/// A new block of `nbytes` in shared memory: a slot of an arena of the current sharing
/// strategy. `MemoryError` when the system has no room (never a bus error later). Its
/// bytes are not set (zero in a new arena, what an earlier block left in a reused slot):
/// every caller writes them all next (a move, a copy of an array, a collated batch) or
/// hands out memory it says is uninitialised (`empty_shared`, as `torch.empty`), and
/// zeroing a large block costs as much as the copy that follows.
#[pyfunction]
pub(crate) fn empty_block(py: Python<'_>, nbytes: usize) -> PyResult<Block> {
    let make = || {
        if nbytes == 0 {
            Storage::try_new(0)
        } else {
            Storage::empty_shared_with(nbytes, tensorshare::get_sharing_strategy())
        }
    };
    // A small block is a slot of an arena, most often a free one: taking it is less work
    // than letting other threads have the GIL and taking it back, unless it means waiting
    // (another thread making an arena, the first named arena's cleanup group), which is
    // done with the GIL let go. A large one may be a new mapping whose pages the kernel
    // clears: other threads run meanwhile.
    let now = if nbytes > 0 && nbytes <= DETACH_ABOVE {
        Storage::empty_shared_now(nbytes).map_err(to_py)?
    } else {
        None
    };
    let storage = match now {
        Some(storage) => storage,
        None => py.detach(make).map_err(to_py)?,
    };
    Ok(Block { storage })
}

/// Blocks larger than this are made with the GIL released.
const DETACH_ABOVE: usize = 64 * 1024;

/// A new block of `nbytes` in shared memory, registered as this process's block at its
/// address (so a tensor or array over it is sent without a copy).
#[pyfunction]
fn new_block(py: Python<'_>, nbytes: usize) -> PyResult<Bound<'_, Block>> {
    let block = Bound::new(py, empty_block(py, nbytes)?)?;
    torch::register_block(py, &block)?;
    Ok(block)
}

/// The live registered block at `address`, or None.
#[pyfunction]
fn find_block(py: Python<'_>, address: usize) -> Option<Bound<'_, Block>> {
    torch::find_block(py, address)
}

/// The live registered block holding all of `address..address + nbytes` and the offset of
/// `address` in it, or None.
#[pyfunction]
fn block_covering(py: Python<'_>, address: usize, nbytes: usize) -> Option<(Bound<'_, Block>, usize)> {
    torch::block_covering(py, address, nbytes)
}

/// A torch storage over bytes `start..start + n` of the live block at `address` (torch must
/// be imported; see `torch::part_storage`).
#[pyfunction]
fn block_part<'py>(py: Python<'py>, address: usize, start: usize, n: usize) -> PyResult<Bound<'py, PyAny>> {
    let api = torch::api(py)?.ok_or_else(|| PyRuntimeError::new_err("torch is not imported"))?;
    let block = torch::find_block(py, address)
        .ok_or_else(|| PyValueError::new_err(format!("no live block at {address:#x}")))?;
    torch::part_storage(py, api, &block, start, n)
}

/// The torch storage over `block` (one per block while it lives; torch must be imported).
#[pyfunction]
fn torch_storage<'py>(py: Python<'py>, block: &Bound<'py, Block>) -> PyResult<Bound<'py, PyAny>> {
    let api = torch::api(py)?.ok_or_else(|| PyRuntimeError::new_err("torch is not imported"))?;
    torch::register_block(py, block)?;
    torch::storage_of(py, api, block)
}

/// Whether `obj` is a torch tensor sent as a handle (see `torch::is_handle`): what the
/// pickler asks, so that it and the native side decide alike.
#[pyfunction]
fn is_tensor_handle(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    match torch::api(py)? {
        Some(api) => torch::is_handle(py, api, obj),
        None => Ok(false),
    }
}

/// A torch tensor of `shape` (a tuple) and `dtype` over a new block, or None where the
/// Python side makes it (see `torch::empty_shared`; torch must be imported).
#[pyfunction]
fn empty_shared_tensor<'py>(
    py: Python<'py>,
    shape: &Bound<'py, pyo3::types::PyTuple>,
    dtype: &Bound<'py, PyAny>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let api = torch::api(py)?.ok_or_else(|| PyRuntimeError::new_err("torch is not imported"))?;
    torch::empty_shared(py, api, shape, dtype)
}

/// A torch tensor of `shape` (a tuple) and `dtype` over a new CUDA allocation of the core on
/// device `index`, which travels as a tensorshare handle (see `cuda`).
#[pyfunction]
fn empty_shared_cuda<'py>(
    py: Python<'py>,
    shape: &Bound<'py, pyo3::types::PyTuple>,
    dtype: &Bound<'py, PyAny>,
    index: u32,
) -> PyResult<Bound<'py, PyAny>> {
    let api = torch::api(py)?.ok_or_else(|| PyRuntimeError::new_err("torch is not imported"))?;
    cuda::empty(py, api, shape, dtype, index)
}

/// Whether the `nbytes` at device address `ptr` lie in a CUDA allocation of tensorshare's
/// that torch has a storage over.
#[pyfunction]
fn in_cuda_allocation(ptr: usize, nbytes: usize) -> bool {
    cuda::covers(ptr, nbytes)
}

/// Gives the CUDA allocations of tensorshare's that this process made and nothing holds any
/// more (their holders let go, exited or were killed) back to the driver; the bytes given.
#[pyfunction]
fn cuda_empty_cache(py: Python<'_>) -> usize {
    py.detach(tensorshare::cuda::empty_cache)
}

/// Moves a CPU torch storage into a new block in place (as torch's `share_memory_()`, see
/// `torch::move_storage`) and returns the block; one in a block already (another thread
/// moved it since the caller looked) stays there, and that block is returned.
#[pyfunction]
fn move_storage<'py>(py: Python<'py>, storage: &Bound<'py, PyAny>) -> PyResult<Bound<'py, Block>> {
    let api = torch::api(py)?.ok_or_else(|| PyRuntimeError::new_err("torch is not imported"))?;
    torch::move_storage_whole(py, api, storage)
}

/// Raises the error a put gives for a storage over a file that torch maps shared (see
/// `torch::refuse_mapped_file`); nothing for any other storage.
#[pyfunction]
fn refuse_mapped_file(storage: &Bound<'_, PyAny>) -> PyResult<()> {
    torch::refuse_mapped_file(storage)
}

/// Puts tensorshare's SIGBUS handler back on top of one installed since (torch's DataLoader
/// workers install one): see `tensorshare::segments::guard_sigbus`.
#[pyfunction]
fn guard_sigbus() -> PyResult<()> {
    tensorshare::segments::guard_sigbus().map_err(to_py)
}

/// The current sharing strategy, by torch's name.
#[pyfunction]
fn get_sharing_strategy() -> String {
    tensorshare::get_sharing_strategy().to_string()
}

/// Sets the sharing strategy by torch's name (`file_descriptor`, `file_system`).
#[pyfunction]
fn set_sharing_strategy(name: &str) -> PyResult<()> {
    let s = name.parse().map_err(to_py)?;
    tensorshare::set_sharing_strategy(s).map_err(to_py)
}

/// The cleanup group a process started now should join (`TENSORSHARE_SHM_GROUP` in its
/// environment), founding one under the file_system strategy; `None` without named
/// segments. The spawn and forkserver contexts pass it to their children, whose
/// environment is not this process's (the fork server's is its own).
#[pyfunction]
fn shm_group_for_workers() -> PyResult<Option<i32>> {
    tensorshare::segments::group_for_workers().map_err(to_py)
}

/// Removes the names of the named segments this process made: for a child about to end
/// in `os._exit`, which runs no exit handler.
#[pyfunction]
fn unlink_own_names() {
    tensorshare::segments::unlink_own_names()
}

/// Waits until what this process put on queues is written out, while another process could
/// read it: for a child about to end in `os._exit`, which drops nothing (see
/// `tensorshare::flush_queues`).
#[pyfunction]
fn flush_queues(py: Python<'_>) {
    queue::wait_dropped(py, false);
    py.detach(tensorshare::flush_queues);
    // Queues other threads dropped meanwhile.
    queue::wait_dropped(py, false);
}

/// Waits until the queues this process dropped with values unwritten have written them out,
/// while another process could read them: the exit handler, run where multiprocessing joins
/// its queues' feeder threads at exit (see `PyQueue`'s `drop`). Queues dropped after it
/// wait in place.
#[pyfunction]
fn wait_dropped_queues(py: Python<'_>) {
    queue::wait_dropped(py, true)
}

/// Makes this process's puts on queues it inherited by fork go through an outbox of its own
/// (see `tensorshare::adopt_forked_queues`): for a process that calls `flush_queues` before
/// it leaves.
#[pyfunction]
fn adopt_forked_queues() {
    tensorshare::adopt_forked_queues()
}

/// Lets go of every free arena of this process and of the arenas its receive cache keeps
/// mapped for speed (see `tensorshare::trim_arenas`): their memory, and under the
/// `file_system` strategy their room in /dev/shm, goes back once no other process maps
/// them. How many arenas of its own it let go of.
#[pyfunction]
fn trim_arenas(py: Python<'_>) -> usize {
    py.detach(tensorshare::trim_arenas)
}

/// The strategies this platform offers, by torch's names.
#[pyfunction]
fn get_all_sharing_strategies() -> Vec<String> {
    tensorshare::get_all_sharing_strategies().iter().map(ToString::to_string).collect()
}

/// Declared as needing the GIL (`gil_used = true`, said here rather than left to pyo3's
/// default): the registries of blocks and storages, the queues' drop threads and the
/// pickler's handle decisions assume that no two threads run Python code of this process at
/// once. A free-threaded CPython turns its GIL back on when it imports the module, and says
/// so in a `RuntimeWarning`.
#[pymodule(gil_used = true)]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Helpers (the file_system strategy's cleaner) start as this Python loading this module
    // again: its constructor takes the role before any Python code of ours runs.
    let executable: std::path::PathBuf = m.py().import("sys")?.getattr("executable")?.extract()?;
    let args = ["-c", "import tensorshare._native"].map(std::ffi::OsString::from).to_vec();
    tensorshare::set_helper_command(executable, args);
    m.add_class::<Block>()?;
    m.add_class::<queue::PyQueue>()?;
    m.add_class::<pipe::PyConnection>()?;
    m.add_function(wrap_pyfunction!(pipe::new_pipe, m)?)?;
    m.add_function(wrap_pyfunction!(empty_block, m)?)?;
    m.add_function(wrap_pyfunction!(new_block, m)?)?;
    m.add_function(wrap_pyfunction!(find_block, m)?)?;
    m.add_function(wrap_pyfunction!(block_covering, m)?)?;
    m.add_function(wrap_pyfunction!(torch_storage, m)?)?;
    m.add_function(wrap_pyfunction!(block_part, m)?)?;
    m.add_function(wrap_pyfunction!(move_storage, m)?)?;
    m.add_function(wrap_pyfunction!(refuse_mapped_file, m)?)?;
    m.add_function(wrap_pyfunction!(flush_queues, m)?)?;
    m.add_function(wrap_pyfunction!(trim_arenas, m)?)?;
    m.add_function(wrap_pyfunction!(wait_dropped_queues, m)?)?;
    m.add_function(wrap_pyfunction!(adopt_forked_queues, m)?)?;
    m.add_function(wrap_pyfunction!(is_tensor_handle, m)?)?;
    m.add_function(wrap_pyfunction!(empty_shared_tensor, m)?)?;
    m.add_function(wrap_pyfunction!(empty_shared_cuda, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_empty_cache, m)?)?;
    m.add_function(wrap_pyfunction!(in_cuda_allocation, m)?)?;
    m.add_function(wrap_pyfunction!(guard_sigbus, m)?)?;
    m.add_function(wrap_pyfunction!(get_sharing_strategy, m)?)?;
    m.add_function(wrap_pyfunction!(set_sharing_strategy, m)?)?;
    m.add_function(wrap_pyfunction!(shm_group_for_workers, m)?)?;
    m.add_function(wrap_pyfunction!(unlink_own_names, m)?)?;
    m.add_function(wrap_pyfunction!(get_all_sharing_strategies, m)?)?;
    m.add_function(wrap_pyfunction!(convert::roundtrip, m)?)?;
    m.add_function(wrap_pyfunction!(queue::export, m)?)?;
    m.add_function(wrap_pyfunction!(queue::import, m)?)?;
    m.add_class::<queue::Parcel>()?;
    m.add("TensorshareError", m.py().get_type::<TensorshareError>())?;
    m.add("InvalidMessage", m.py().get_type::<InvalidMessage>())?;
    Ok(())
}
