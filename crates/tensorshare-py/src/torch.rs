//! torch tensors to and from tensorshare tensors, in Rust: the hot path of every queue.
//!
//! A torch tensor whose storage lies in a live [`Block`] (from its start, or inside it at a
//! whole number of elements) travels as a handle to that block; one whose storage lives
//! elsewhere is moved into a new block first, once per storage, unless this torch cannot
//! move it or has it in its own shared memory already (see [`moves_into_block`]: it is then
//! pickled with torch's own reductions). A received tensor becomes a torch tensor over the
//! torch storage of its block, one torch storage per block while it lives, so that tensors
//! received from one storage share one torch storage here too.

use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyString, PyTuple, PyType, PyWeakrefReference};
use pyo3::IntoPyObjectExt;
use tensorshare::{DType, Device, Storage, Tensor, TensorKind, Value};

use crate::descr::{c_function, c_type, Getter, Method};
use crate::{to_py, Block};

/// What torch's own queues say of a non-leaf tensor that requires grad.
const NON_LEAF_REFUSED: &str = "Cowardly refusing to serialize non-leaf tensor which requires_grad, since autograd \
    does not support crossing process boundaries.  If you just want to transfer the data, call detach() on the \
    tensor before serializing (e.g., putting it on the queue).";

/// The parts of torch used here, looked up once torch is imported.
pub(crate) struct Api {
    pub(crate) tensor: Py<PyAny>,
    pub(crate) parameter: Py<PyAny>,
    pub(crate) strided: Py<PyAny>,
    /// torch's dtype objects, in the order of [`DType::ALL`].
    pub(crate) dtypes: Vec<Py<PyAny>>,
    pub(crate) empty: Py<PyAny>,
    pub(crate) frombuffer: Py<PyAny>,
    /// `torch._C._from_dlpack`, which makes a tensor over a block for less than `frombuffer`
    /// (see [`crate::dlpack`]); `None` where torch lacks it.
    pub(crate) from_dlpack: Option<Py<PyAny>>,
    pub(crate) cpu: Py<PyAny>,
    /// A tensor's attributes and methods, from `torch._C.TensorBase`, the C type under every
    /// torch tensor (see [`crate::descr`]).
    pub(crate) t: TensorAccess,
    /// A storage's, from `torch._C.StorageBase`, the C type under every torch storage. These
    /// never hand a call to Python code (no torch function mode sees them), so what they
    /// report is torch's own, and calling them runs no Python code: [`copy_out`] reads
    /// memory where they say it is, with nothing run in between.
    pub(crate) storage_data_ptr: Method,
    pub(crate) storage_nbytes: Method,
    pub(crate) storage_device: Getter,
    pub(crate) storage_copy: Method,
    /// `None` before torch 2.12, which cannot swap a storage's memory: a CPU tensor whose
    /// storage is in no block is then not a handle (see [`moves_into_block`]).
    pub(crate) storage_swap: Option<Method>,
    /// torch's own `is_shared`, which the package's replacement of
    /// `UntypedStorage.is_shared` (true for blocks too) leaves as it was.
    pub(crate) storage_is_shared: Method,
    /// The descriptor of torch's shared memory under a storage (-1 for a file torch maps;
    /// raises for one of torch's named segments).
    pub(crate) storage_shared_fd: Method,
    pub(crate) empty_strided: Py<PyAny>,
    /// `torch.get_num_threads`, the threads torch's copies use in the calling thread (see
    /// [`copies_here`]); `None` where a program replaced torch's C function (torch copies
    /// then, as before).
    pub(crate) get_num_threads: Option<Py<PyAny>>,
    /// Keyword names, made once here rather than by `intern!`, whose cell is filled with the
    /// GIL let go: a Python thread forking then would leave it half filled in its child.
    pub(crate) key_dtype: Py<PyString>,
    pub(crate) key_device: Py<PyString>,
}

/// What is read of a tensor, and the methods called on one.
pub(crate) struct TensorAccess {
    pub(crate) dtype: Getter,
    pub(crate) layout: Getter,
    pub(crate) is_nested: Getter,
    pub(crate) requires_grad: Getter,
    pub(crate) is_leaf: Getter,
    pub(crate) shape: Getter,
    pub(crate) is_meta: Getter,
    pub(crate) is_cpu: Getter,
    pub(crate) device: Getter,
    pub(crate) is_neg: Method,
    pub(crate) stride: Method,
    pub(crate) storage_offset: Method,
    pub(crate) untyped_storage: Method,
    pub(crate) set_: Method,
    pub(crate) view: Method,
    pub(crate) requires_grad_: Method,
}

impl TensorAccess {
    fn new(base: &Bound<'_, PyType>) -> PyResult<TensorAccess> {
        let g = |name| Getter::new(base, name);
        let m = |name| Method::new(base, name);
        Ok(TensorAccess {
            dtype: g("dtype")?,
            layout: g("layout")?,
            is_nested: g("is_nested")?,
            requires_grad: g("requires_grad")?,
            is_leaf: g("is_leaf")?,
            shape: g("shape")?,
            is_meta: g("is_meta")?,
            is_cpu: g("is_cpu")?,
            device: g("device")?,
            is_neg: m("is_neg")?,
            stride: m("stride")?,
            storage_offset: m("storage_offset")?,
            untyped_storage: m("untyped_storage")?,
            set_: m("set_")?,
            view: m("view")?,
            requires_grad_: m("requires_grad_")?,
        })
    }
}

static API: PyOnceLock<Api> = PyOnceLock::new();

/// torch's parts, or `None` while this process has not imported torch (nothing can then be
/// a torch tensor; torch is never imported here).
pub(crate) fn api(py: Python<'_>) -> PyResult<Option<&Api>> {
    if let Some(api) = API.get(py) {
        return Ok(Some(api));
    }
    // Not imported, or blocked (`sys.modules["torch"] = None`, which makes its import fail).
    let modules = py.import("sys")?.getattr("modules")?;
    if modules.call_method1("get", ("torch",))?.is_none() {
        return Ok(None);
    }
    // Made outside the cell, which is then only set: making it runs Python code (an import,
    // attribute lookups), during which another Python thread may take the GIL and fork; a
    // child forked while the cell was being filled would wait for it for good.
    let made = (|| {
        let torch = py.import("torch")?;
        let c = torch.getattr("_C")?;
        let storage_base = c_type(c.getattr("StorageBase")?, "torch._C.StorageBase")?;
        let tensor_base = c_type(c.getattr("TensorBase")?, "torch._C.TensorBase")?;
        let dtypes = DType::ALL
            .iter()
            .map(|d| torch.getattr(d.torch_name()).map(Bound::unbind))
            .collect::<PyResult<Vec<_>>>()?;
        // The Python side asks the same function whether to replace torch's
        // `share_memory_()`, and which way to pickle a storage outside a block: one answer.
        let swap: bool =
            py.import("tensorshare._reduction")?.call_method1("can_move_in_place", (&torch,))?.extract()?;
        Ok::<_, PyErr>(Api {
            tensor: torch.getattr("Tensor")?.unbind(),
            parameter: torch.getattr("nn")?.getattr("Parameter")?.unbind(),
            strided: torch.getattr("strided")?.unbind(),
            empty: torch.getattr("empty")?.unbind(),
            // Both make a tensor over a block whose storage is then swapped into the one being
            // moved, so only torch's own will do: a function a program put in the place of
            // either could hand back any storage. `frombuffer` is taken from the C type that
            // holds torch's functions (`torch.frombuffer` is the same object, unless wrapped),
            // and a replaced `_from_dlpack` is left for it.
            frombuffer: c_function(c.getattr("_VariableFunctions")?.getattr("frombuffer")?, "frombuffer")?
                .unbind(),
            from_dlpack: c
                .getattr("_from_dlpack")
                .ok()
                .and_then(|f| c_function(f, "_from_dlpack").ok())
                .map(Bound::unbind),
            cpu: torch.getattr("device")?.call1(("cpu",))?.unbind(),
            t: TensorAccess::new(&tensor_base)?,
            storage_data_ptr: Method::new(&storage_base, "data_ptr")?,
            storage_nbytes: Method::new(&storage_base, "nbytes")?,
            storage_device: Getter::new(&storage_base, "device")?,
            storage_copy: Method::new(&storage_base, "copy_")?,
            storage_is_shared: Method::new(&storage_base, "is_shared")?,
            storage_shared_fd: Method::new(&storage_base, "_get_shared_fd")?,
            storage_swap: if swap { Some(Method::new(&storage_base, "_swap_data_ptr_")?) } else { None },
            empty_strided: torch.getattr("empty_strided")?.unbind(),
            get_num_threads: c
                .getattr("get_num_threads")
                .ok()
                .and_then(|f| c_function(f, "get_num_threads").ok())
                .map(Bound::unbind),
            key_dtype: PyString::new(py, "dtype").unbind(),
            key_device: PyString::new(py, "device").unbind(),
            dtypes,
        })
    })()?;
    // Another thread may have set it meanwhile: its value is as good as ours.
    let _ = API.set(py, made);
    Ok(API.get(py))
}

/// Weak references to Python objects, by the address of the block they are over.
type ByAddress = HashMap<usize, Py<PyWeakrefReference>, BuildHasherDefault<AddressHasher>>;

/// A hash of addresses, which this process's allocator gives and no peer chooses: FxHash's
/// multiply, whose well-mixed high bits are rotated down to where the map picks a bucket
/// (block addresses are multiples of 64, so the product's low bits are zero). SipHash's
/// resistance to chosen keys buys nothing here, and costs a few lookups per tensor.
#[derive(Default)]
pub(crate) struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ u64::from(b)).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
    }

    fn write_usize(&mut self, n: usize) {
        self.0 = (self.0.rotate_left(5) ^ n as u64).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }

    fn finish(&self) -> u64 {
        self.0.rotate_left(26)
    }
}

/// Weak references by address: the live blocks of this process, and the torch storage made
/// over each.
#[derive(Default)]
struct Registry {
    blocks: ByAddress,
    storages: ByAddress,
    /// The addresses in `blocks`, in order: the block a storage starting inside one lies in
    /// (`torch.from_numpy` of a view into the middle of a shared array) is the one at the
    /// nearest address below it.
    starts: BTreeSet<usize>,
    /// Entries at the last sweep of dead ones: the next sweep comes at twice as many, and
    /// not before [`SWEEP_FROM`].
    swept_at: usize,
}

/// Entries below which dead ones are not swept: an address is most often reused soon (an
/// arena hands its freed slots out again), which replaces its dead entry at no cost, while
/// a sweep reads every entry. A few thousand weak references are a few hundred KiB.
const SWEEP_FROM: usize = 2048;

static REGISTRY: Mutex<Option<Registry>> = Mutex::new(None);

/// Runs `f` on the registry under its lock. `f` must run no Python code: it makes no Python
/// object (an allocation can start the GC, and so any finaliser) and lets no reference go
/// whose release could free one (a finaliser again). A finaliser may use the registry itself,
/// which would lock it again in the same thread and hang, or release the GIL, so that another
/// thread takes the GIL and waits for the lock while this one waits for the GIL. What `f`
/// takes out of the registry it returns, to be let go once the lock is released. With no
/// Python code under it, the lock is only ever held by a thread that holds the GIL throughout,
/// so it never waits either.
fn with_registry<R>(f: impl FnOnce(&mut Registry) -> R) -> R {
    let mut guard = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
    f(guard.get_or_insert_with(Registry::default))
}

/// The object `map` refers to at `addr`, if it is alive. Runs no Python code (for
/// [`with_registry`]): the new strong reference is to a live object, and is returned.
fn live<'py>(py: Python<'py>, map: &ByAddress, addr: usize) -> Option<Bound<'py, PyAny>> {
    use pyo3::types::PyWeakrefMethods;
    map.get(&addr).and_then(|w| w.bind(py).upgrade())
}

/// Records `block` at its address: the block itself when `new` (not yet recorded), and
/// `storage`, when given, as the torch storage over it. One lock and one sweep for both.
fn record(
    py: Python<'_>,
    block: &Bound<'_, Block>,
    new: bool,
    storage: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    if let Some(recording) = Recording::new(block, new, storage)? {
        recording.commit(py, block);
    }
    Ok(())
}

/// What [`record`] records, made before anything is: the weak references, whose allocation
/// may start a collection, and so run finalisers, which may send tensors. A move makes it
/// before it swaps a storage's memory and commits it right after, with no Python code run
/// in between, so that no code finds the storage in a block that is not recorded yet (and
/// moves it again).
struct Recording {
    weak_block: Option<Py<PyWeakrefReference>>,
    weak_storage: Option<Py<PyWeakrefReference>>,
}

impl Recording {
    /// `None` for an empty block, which is not recorded.
    fn new(
        block: &Bound<'_, Block>,
        new: bool,
        storage: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<Recording>> {
        if block.get().storage.is_empty() {
            return Ok(None);
        }
        let weak_block = if new { Some(PyWeakrefReference::new(block)?.unbind()) } else { None };
        let weak_storage = storage.map(PyWeakrefReference::new).transpose()?.map(Bound::unbind);
        Ok(Some(Recording { weak_block, weak_storage }))
    }

    /// Records what was made for `block`. Runs no Python code: what it lets go are weak
    /// references, which run none when they go, and nothing is allocated that the garbage
    /// collector counts.
    fn commit(self, py: Python<'_>, block: &Bound<'_, Block>) {
        use pyo3::types::PyWeakrefMethods;
        let Recording { weak_block, weak_storage } = self;
        let addr = block.get().storage.data_ptr();
        let len = block.get().storage.len();
        let gone = with_registry(|registry| {
            // Two live blocks may be at one address: a message naming a slot this process maps
            // already is mapped there again. The one recorded stays while it lives, unless the
            // new one is larger (it covers every storage the other does); replaced by one that
            // went first, the address named no block while the other lived, and a storage over
            // it was moved out of its shared memory when next sent. `upgrade` of a live object
            // returns a reference that goes at once, leaving the object as it was.
            let keep = live(py, &registry.blocks, addr)
                .and_then(|b| b.cast_into::<Block>().ok())
                .is_some_and(|b| !b.is(block) && b.get().storage.len() >= len);
            // A block not recorded has its torch storage not recorded either: the address's
            // storage stays the recorded block's. What is not recorded goes after the lock.
            let replaced = if keep {
                [weak_block, weak_storage]
            } else {
                if weak_block.is_some() {
                    registry.starts.insert(addr);
                }
                [
                    weak_block.and_then(|w| registry.blocks.insert(addr, w)),
                    weak_storage.and_then(|w| registry.storages.insert(addr, w)),
                ]
            };
            let mut swept: Vec<Py<PyWeakrefReference>> = Vec::new();
            let total = registry.blocks.len() + registry.storages.len();
            if total > 2 * registry.swept_at.max(SWEEP_FROM / 2) {
                for map in [&mut registry.blocks, &mut registry.storages] {
                    // `upgrade` of a live object returns a reference that goes at once, leaving
                    // the object as it was; the dead ones' weak references go after the lock.
                    let dead: Vec<usize> =
                        map.iter().filter(|(_, w)| w.bind(py).upgrade().is_none()).map(|(&a, _)| a).collect();
                    swept.extend(dead.into_iter().filter_map(|a| map.remove(&a)));
                }
                let blocks = &registry.blocks;
                registry.starts.retain(|a| blocks.contains_key(a));
                registry.swept_at = registry.blocks.len() + registry.storages.len();
            }
            (replaced, swept)
        });
        drop(gone);
    }
}

/// The live block at `addr`, if there is one.
pub(crate) fn find_block<'py>(py: Python<'py>, addr: usize) -> Option<Bound<'py, Block>> {
    with_registry(|r| live(py, &r.blocks, addr)).and_then(|b| b.cast_into::<Block>().ok())
}

/// The live block that holds all of `addr..addr + nbytes`, and where `addr` is in it: the
/// block at `addr`, or one that starts below it (a view into the middle of a block's
/// memory, by numpy and `torch.from_numpy`, or DLPack). Live blocks of this process never
/// overlap but where two are at one address (the registry keeps the larger), so the nearest
/// live one below is the only candidate. The dead addresses met on the way down are taken
/// out of [`Registry::starts`] (a block recorded there again puts its address back), so that
/// however many blocks a large one now lies over, each is stepped over once.
pub(crate) fn block_covering<'py>(py: Python<'py>, addr: usize, nbytes: usize) -> Option<InBlock<'py>> {
    let end = addr.checked_add(nbytes)?;
    let found = with_registry(|r| {
        let Registry { blocks, starts, .. } = r;
        // Runs no Python code (see `live`): a live block's new reference is returned. A
        // block at `addr` itself (the common case: a storage moved or made whole in one) is
        // found by the hash first, without a walk down the ordered set.
        match live(py, blocks, addr) {
            Some(b) => Some((b, addr)),
            None => nearest_live(starts, addr, |start| live(py, blocks, start)),
        }
    });
    let (b, start) = found?;
    let b = b.cast_into::<Block>().ok()?;
    let covers = start.checked_add(b.get().storage.len()).is_some_and(|e| e >= end);
    covers.then_some((b, addr - start))
}

/// The nearest address at or below `addr` in `starts` where `live` finds something, and
/// what it found; the dead addresses above it are taken out of `starts`. Removes plain
/// addresses only, so nothing is let go that could run Python code.
fn nearest_live<T>(
    starts: &mut BTreeSet<usize>,
    addr: usize,
    live: impl Fn(usize) -> Option<T>,
) -> Option<(T, usize)> {
    let mut dead = Vec::new();
    let mut found = None;
    for &start in starts.range(..=addr).rev() {
        if let Some(x) = live(start) {
            found = Some((x, start));
            break;
        }
        dead.push(start);
    }
    for a in dead {
        starts.remove(&a);
    }
    found
}

/// The block for a received `storage`: the live one over the same memory when there is one
/// (the same storage, or a message naming a slot this process has a block of: its own
/// tensor sent back to it, a row a fork worker sent of a dataset shared before the fork),
/// so that its torch storage is the one this process has, as in torch; else a new one, not
/// yet recorded (`true`). Two handles see the same memory exactly when their first bytes
/// are at one address (`Storage::data_ptr`), and the same bytes when they are as long.
pub(crate) fn block_for<'py>(py: Python<'py>, storage: &Storage) -> PyResult<(Bound<'py, Block>, bool)> {
    let known = find_block(py, storage.data_ptr())
        .filter(|b| b.get().storage.ptr_eq(storage) || b.get().storage.len() == storage.len());
    match known {
        Some(b) => Ok((b, false)),
        None => Ok((Bound::new(py, Block { storage: storage.clone() })?, true)),
    }
}

/// Records `block` as the live block at its address.
pub(crate) fn register_block(py: Python<'_>, block: &Bound<'_, Block>) -> PyResult<()> {
    record(py, block, true, None)
}

/// The torch storage recorded for `block`, if it lives and still holds the block's memory.
/// torch can give a storage other memory under it: its own reduction for
/// `torch.multiprocessing` (`_share_fd_cpu_`, `_share_filename_cpu_`) moves any storage
/// into torch's shared memory, resizable or not, and `resize_` or `_swap_data_ptr_` do the
/// like. Such a storage is forgotten here (its tensors keep it), and `None` says to make a
/// new one over the block.
fn registered_storage<'py>(
    py: Python<'py>,
    api: &Api,
    block: &Bound<'py, Block>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    use pyo3::types::PyWeakrefMethods;
    let addr = block.get().storage.data_ptr();
    let Some(s) = with_registry(|r| live(py, &r.storages, addr)) else { return Ok(None) };
    // Asked of torch's C methods (see `Api`), with the registry's lock released.
    let ptr: usize = api.storage_data_ptr.call0(&s)?.extract()?;
    let nbytes: usize = api.storage_nbytes.call0(&s)?.extract()?;
    if ptr == addr && nbytes == block.get().storage.len() {
        return Ok(Some(s));
    }
    let gone = with_registry(|r| match r.storages.get(&addr) {
        Some(w) if w.bind(py).upgrade().is_some_and(|o| o.is(&s)) => r.storages.remove(&addr),
        _ => None,
    });
    drop(gone);
    Ok(None)
}

/// The torch storage over `block`, made (and recorded) when there is none yet.
pub(crate) fn storage_of<'py>(
    py: Python<'py>,
    api: &Api,
    block: &Bound<'py, Block>,
) -> PyResult<Bound<'py, PyAny>> {
    if let Some(s) = registered_storage(py, api, block)? {
        return Ok(s);
    }
    Ok(flat_over(py, api, block, DType::U8, false)?.1)
}

/// A flat tensor of `dtype` over the whole of `block`, made in one call, and its storage,
/// recorded as the block's torch storage from now on (one per block, as `storage_of` keeps
/// it). Only for a block that has none yet; `new_block`: one not recorded yet either, which
/// is recorded with it.
fn flat_over<'py>(
    py: Python<'py>,
    api: &Api,
    block: &Bound<'py, Block>,
    dtype: DType,
    new_block: bool,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    let flat = flat_tensor(py, api, block, dtype)?;
    let storage = api.t.untyped_storage.call0(&flat)?;
    record(py, block, new_block, Some(&storage))?;
    Ok((flat, storage))
}

/// A flat tensor of `dtype` over the whole of `block`, whose storage keeps `block` alive.
fn flat_tensor<'py>(
    py: Python<'py>,
    api: &Api,
    block: &Bound<'py, Block>,
    dtype: DType,
) -> PyResult<Bound<'py, PyAny>> {
    if let Some(from_dlpack) = &api.from_dlpack {
        match crate::dlpack::flat(py, from_dlpack.bind(py), block, dtype) {
            Ok(flat) => return Ok(flat),
            // A torch that does not read this dtype through DLPack (bool came late to its
            // DLPack import): `frombuffer` reads every dtype torch has.
            Err(_) if dtype != DType::U8 => {}
            Err(e) => return Err(e),
        }
    }
    let kwargs = PyDict::new(py);
    kwargs.set_item(api.key_dtype.bind(py), api.dtypes[dtype_index(dtype)].bind(py))?;
    api.frombuffer.bind(py).call((block,), Some(&kwargs))
}

/// A torch storage over bytes `start..start + n` of `block` (`n` at least one), whose memory
/// holds the block itself: a storage received as a part of a block. Not a slice of the
/// block's torch storage ([`storage_of`]): a slice holds that storage, not the block, and
/// torch may give the storage other memory (its `share_memory_()` and reductions do), which
/// lets the block go while the slice still points into it. Made by torch's own
/// `frombuffer`, which holds the block through the buffer it reads until torch frees the
/// storage.
pub(crate) fn part_storage<'py>(
    py: Python<'py>,
    api: &Api,
    block: &Bound<'py, Block>,
    start: usize,
    n: usize,
) -> PyResult<Bound<'py, PyAny>> {
    let len = block.get().storage.len();
    if n == 0 || start.checked_add(n).is_none_or(|end| end > len) {
        return Err(PyValueError::new_err(format!(
            "bytes {start}.. ({n} of them) are no part of a block of {len} bytes"
        )));
    }
    let kwargs = PyDict::new(py);
    kwargs.set_item(api.key_dtype.bind(py), api.dtypes[dtype_index(DType::U8)].bind(py))?;
    kwargs.set_item(PyString::new(py, "offset"), start)?;
    kwargs.set_item(PyString::new(py, "count"), n)?;
    let part = api.frombuffer.bind(py).call((block,), Some(&kwargs))?;
    api.t.untyped_storage.call0(&part)
}

/// The place of `dtype` in [`DType::ALL`] (and so of its torch dtype in [`Api::dtypes`]).
fn dtype_index(dtype: DType) -> usize {
    DType::ALL.iter().position(|d| *d == dtype).expect("every dtype is in DType::ALL")
}

/// `tensorshare.empty_shared(shape, dtype)`: a torch tensor of `shape` over a new block,
/// made in one call. `None` for a dtype tensorshare does not have and for no bytes at all
/// (the Python side makes those).
pub(crate) fn empty_shared<'py>(
    py: Python<'py>,
    api: &Api,
    shape: &Bound<'py, PyTuple>,
    dtype: &Bound<'py, PyAny>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let Some(k) = api.dtypes.iter().position(|d| d.bind(py).is(dtype)) else { return Ok(None) };
    let dims: Vec<usize> = shape.extract()?;
    let nbytes = dims
        .iter()
        .try_fold(DType::ALL[k].size(), |acc, &n| acc.checked_mul(n))
        .filter(|&n| n <= isize::MAX as usize)
        .ok_or_else(|| PyValueError::new_err(format!("a tensor of shape {dims:?} is too large")))?;
    if nbytes == 0 {
        return Ok(None);
    }
    let block = Bound::new(py, crate::empty_block(py, nbytes)?)?;
    let (flat, _) = flat_over(py, api, &block, DType::ALL[k], true)?;
    if dims.len() == 1 {
        return Ok(Some(flat));
    }
    Ok(Some(api.t.view.call1(&flat, shape.as_any())?))
}

/// The dtype of `obj`, and whether it is a `Parameter`, when `obj` is a tensor of a kind
/// that travels as a handle; `None` for one that is pickled (a subclass, a sparse layout, a
/// dtype tensorshare lacks, a negative or conjugate view) and for anything else. What is
/// read is what torch's C getters report, whatever a program has done to `torch.Tensor`'s
/// Python attributes: [`to_tensor`] and the pickler (through [`is_handle`]) decide by this one
/// function, so that a tensor the pickler hands over as a handle is one.
fn handle_kind(py: Python<'_>, api: &Api, obj: &Bound<'_, PyAny>) -> PyResult<Option<(DType, bool)>> {
    let ty = obj.get_type();
    let parameter = ty.is(api.parameter.bind(py));
    if !parameter && !ty.is(api.tensor.bind(py)) {
        return Ok(None);
    }
    let a = &api.t;
    let dtype_obj = a.dtype.get(obj)?;
    let Some(k) = api.dtypes.iter().position(|d| d.bind(py).is(&dtype_obj)) else { return Ok(None) };
    // A nested tensor of the strided layout (`torch.nested.nested_tensor`) has no one shape
    // or strides (torch raises for them): torch's reduction sends it.
    if !a.layout.get(obj)?.is(api.strided.bind(py)) || a.is_nested.get(obj)?.is_truthy()? {
        return Ok(None);
    }
    // A view with torch's negative bit reads its storage's values negated, which a handle
    // (storage and geometry) cannot say. torch's pickling keeps the bit, over the same
    // storage, still sent as a handle. The conjugate bit needs no look: tensorshare has no
    // complex dtype, so a complex tensor was refused above, bit or not, and conjugating real
    // values leaves them as they are (torch refuses the bit on a real tensor with an
    // internal assert, though only after setting it).
    if a.is_neg.call0(obj)?.extract::<bool>()? {
        return Ok(None);
    }
    Ok(Some((DType::ALL[k], parameter)))
}

/// A tuple of sizes (a `torch.Size`, a tuple of strides) as a `Vec`, read item by item from
/// the tuple rather than through the generic sequence protocol.
fn usizes(obj: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    match obj.cast::<PyTuple>() {
        Ok(t) => t.iter().map(|x| x.extract::<usize>()).collect(),
        Err(_) => obj.extract(),
    }
}

/// Whether `obj` is a torch tensor that [`to_tensor`] sends as a handle: one of a kind that
/// does ([`handle_kind`]), on the meta device, on a CUDA device over one of the core's
/// allocations ([`crate::cuda`]), or on the CPU with its storage in a block or to be moved
/// into one ([`moves_into_block`]; a tensor elsewhere is an error at the top of
/// a value, and left to torch's pickling inside an object).
pub(crate) fn is_handle(py: Python<'_>, api: &Api, obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    let Some((dtype, _)) = handle_kind(py, api, obj)? else { return Ok(false) };
    if api.t.is_meta.get(obj)?.extract::<bool>()? {
        return Ok(true);
    }
    if !api.t.is_cpu.get(obj)?.extract::<bool>()? {
        return crate::cuda::is_ours(api, obj);
    }
    let storage = api.t.untyped_storage.call0(obj)?;
    let (found, nbytes) = block_of(py, api, &storage)?;
    let shape = usizes(&api.t.shape.get(obj)?)?;
    let offset: usize = api.t.storage_offset.call0(obj)?.extract()?;
    if empty_past_end(&shape, offset, dtype, nbytes) {
        return Ok(false);
    }
    match found {
        // See `to_tensor`: inside a block at an offset no handle can say, it is pickled.
        Some((_, at)) => Ok(at % dtype.size() == 0),
        None => moves_into_block(api, &storage, nbytes),
    }
}

/// Whether a tensor of `shape` with no elements starts past the end of its storage of
/// `nbytes`: torch lets such a tensor have any offset (`set_`, slicing past the end), a
/// handle cannot say it (the receiver's view must lie in its block), so it is pickled by
/// torch's reduction, which keeps the offset over the same storage (still a handle).
fn empty_past_end(shape: &[usize], offset: usize, dtype: DType, nbytes: usize) -> bool {
    shape.contains(&0) && offset.checked_mul(dtype.size()).is_none_or(|start| start > nbytes)
}

/// Whether CPU `storage` (of `nbytes`), in no block, is moved into one to be sent. Not
/// where this torch cannot move it (before 2.12; an empty one needs no move), nor where
/// torch has it in its own shared memory already, by descriptor or by name: other processes
/// may map it there (torch's queues, a DataLoader's workers, a model shared before
/// tensorshare was imported), and a move would leave them apart from this one. Both are
/// pickled with torch's own reductions instead (`_reduction.torch_reduction`), which share
/// the storage where it is, as torch.multiprocessing would. A file torch maps privately
/// (`torch.from_file(..., shared=False)`) is no shared memory of torch's (no descriptor to
/// share): it moves. A file torch maps shared is an error (see [`MAPPED_FILE_REFUSED`]).
/// `_reduction.torch_shares` decides alike.
fn moves_into_block(api: &Api, storage: &Bound<'_, PyAny>, nbytes: usize) -> PyResult<bool> {
    if nbytes == 0 {
        return Ok(true);
    }
    if api.storage_is_shared.call0(storage)?.extract::<bool>()? {
        // torch's named segments (its file_system strategy) have no descriptor here: it raises.
        match api.storage_shared_fd.call0(storage) {
            Ok(fd) if fd.extract::<i64>()? < 0 => refuse_mapped_file(storage)?,
            _ => return Ok(false),
        }
    }
    Ok(api.storage_swap.is_some())
}

/// Why a storage over a file that torch maps shared is not sent.
const MAPPED_FILE_REFUSED: &str = "is a file that torch maps shared (torch.from_file(..., shared=True)), \
    which tensorshare does not send: moving it into shared memory would stop its writes from \
    reaching the file, and the file itself cannot be shared safely (a process that shortens it \
    makes every process that maps it crash). Send a copy (t.clone()), or map the file in the receiver";

/// An error when `storage` (shared by torch's account, with no descriptor) is a file that
/// torch maps shared: its name is known to torch (`UntypedStorage.filename`, which is None
/// for anything else, and missing before torch 2.2).
pub(crate) fn refuse_mapped_file(storage: &Bound<'_, PyAny>) -> PyResult<()> {
    let name = storage.getattr("filename").ok().filter(|n| !n.is_none());
    match name {
        Some(name) => {
            Err(PyRuntimeError::new_err(format!("the storage of this tensor, {name}, {MAPPED_FILE_REFUSED}")))
        }
        None => Ok(()),
    }
}

/// A live block and the offset of a storage's first byte in it.
type InBlock<'py> = (Bound<'py, Block>, usize);

/// The live block `storage` (a CPU storage) is in, if any, with the offset of the storage's
/// first byte in it, and the storage's size.
fn block_of<'py>(
    py: Python<'py>,
    api: &Api,
    storage: &Bound<'py, PyAny>,
) -> PyResult<(Option<InBlock<'py>>, usize)> {
    let addr: usize = api.storage_data_ptr.call0(storage)?.extract()?;
    let nbytes: usize = api.storage_nbytes.call0(storage)?.extract()?;
    Ok((block_covering(py, addr, nbytes), nbytes))
}

/// The block a storage was moved into, if it is in one whole, from its start.
fn block_at_start<'py>(
    py: Python<'py>,
    api: &Api,
    storage: &Bound<'py, PyAny>,
) -> PyResult<Option<Bound<'py, Block>>> {
    Ok(match block_of(py, api, storage)?.0 {
        Some((b, 0)) => Some(b),
        _ => None,
    })
}

/// A torch tensor as a tensorshare tensor, or `None` when `obj` is no tensor that travels
/// as a handle (see [`handle_kind`] and [`is_handle`]: it is pickled).
pub(crate) fn to_tensor(py: Python<'_>, api: &Api, obj: &Bound<'_, PyAny>) -> PyResult<Option<Value>> {
    let Some((dtype, parameter)) = handle_kind(py, api, obj)? else { return Ok(None) };
    let a = &api.t;
    let requires_grad: bool = a.requires_grad.get(obj)?.extract()?;
    if requires_grad && !a.is_leaf.get(obj)?.extract::<bool>()? {
        return Err(PyRuntimeError::new_err(NON_LEAF_REFUSED));
    }
    let shape = usizes(&a.shape.get(obj)?)?;
    let mut t = if !a.is_cpu.get(obj)?.extract::<bool>()? {
        let strides = usizes(&a.stride.call0(obj)?)?;
        if a.is_meta.get(obj)?.extract::<bool>()? {
            Tensor::try_meta_strided(&shape, &strides, dtype).map_err(to_py)?
        } else {
            // A CUDA tensor over one of the core's allocations is a handle; one of torch's
            // own allocator is pickled with torch's reduction, its CUDA IPC handle
            // (`_reduction._cuda_reduction`); one on any other device is refused there.
            let offset: usize = a.storage_offset.call0(obj)?.extract()?;
            match crate::cuda::to_tensor(py, api, obj, dtype, &shape, &strides, offset)? {
                Some(t) => t,
                None => return Ok(None),
            }
        }
    } else {
        let strides = usizes(&a.stride.call0(obj)?)?;
        let offset: usize = a.storage_offset.call0(obj)?.extract()?;
        let storage = a.untyped_storage.call0(obj)?;
        // Read before the look: a move made after it is seen by the move below (`MOVES`).
        let moves = MOVES.load(Ordering::Relaxed);
        let (found, nbytes) = block_of(py, api, &storage)?;
        if empty_past_end(&shape, offset, dtype, nbytes) {
            return Ok(None);
        }
        // A storage inside a block at an offset whole elements of `dtype` span is a view
        // of the block from there (a torch tensor over the middle of a shared array). At
        // any other offset no handle can say where the tensor starts: it is pickled, with
        // its storage as a view of the block (`_reduction._Pickler`), still shared.
        let (block, offset) = match found {
            Some((b, at)) if at % dtype.size() == 0 => {
                let offset = offset
                    .checked_add(at / dtype.size())
                    .ok_or_else(|| PyValueError::new_err("a tensor's storage offset overflows"))?;
                (b, offset)
            }
            Some(_) => return Ok(None),
            None if moves_into_block(api, &storage, nbytes)? => {
                (move_storage(py, api, &storage, nbytes, true, moves)?, offset)
            }
            None => return Ok(None),
        };
        Tensor::from_storage(block.get().storage.clone(), dtype, &shape, &strides, offset).map_err(to_py)?
    };
    t.set_requires_grad(requires_grad).map_err(to_py)?;
    if parameter {
        t.set_kind(TensorKind::Parameter);
    }
    Ok(Some(Value::Tensor(t)))
}

/// Why a storage cannot be moved into a block by a torch without
/// `UntypedStorage._swap_data_ptr_`, which came with torch 2.12 (the package does not ask
/// such a torch to: it shares such storages the way torch does).
const MOVE_NEEDS_SWAP: &str =
    "this torch cannot move a storage into a tensorshare block in place (torch >= 2.12 \
    can, by UntypedStorage._swap_data_ptr_): use torch's own share_memory_(), or make the tensor with \
    tensorshare.empty_shared";

/// How many storages this process has moved into blocks. A small storage's move takes no
/// claim (see [`Moving`]), and Python code may run between its caller's finding the storage
/// in no block and its swap: the caller's own (`share_memory_()`, during which another
/// thread may take the GIL and send the storage), or a finaliser run by a collection that
/// the allocation of the tensor over the new block starts. Code that sends or shares the
/// same storage meanwhile moves it first, and this move must then give that block, not
/// move the storage again (the message sent would name a block the storage no longer
/// uses). The count, read by the caller before it looks, tells such a move that something
/// moved since. Read and written with the GIL held, whose hand-over between threads orders
/// them.
static MOVES: AtomicU64 = AtomicU64::new(0);

/// Storages of up to this many bytes are copied into their block here (see [`copy_out`]);
/// larger ones by torch when its copy is threaded (see [`copies_here`]), since its call's
/// fixed cost (several torch operations) only small storages notice.
const COPY_HERE_MAX: usize = 64 * 1024;

/// Storages of up to this many bytes are copied here too where torch would copy on one
/// thread (`torch.get_num_threads() == 1` in the calling thread, as in a DataLoader's
/// workers): the copy here writes a large storage straight to memory (see `tensorshare`'s
/// `atomic_bytes`), for the process that reads it next, where torch's fills this core's
/// caches with it and pushes out what the process was using, and it skips torch's fixed
/// cost. It holds the GIL (see [`copy_out`]): at this size, on the 2-core VM the project is
/// measured on, a median 0.3 ms where the block's slot is reused and 1.7 ms where its pages
/// are new to the process (the page faults are taken with the GIL held).
const COPY_HERE_ONE_THREAD_MAX: usize = 2 << 20;

/// Whether a CPU storage of `nbytes` is copied into its block here rather than by torch.
fn copies_here(py: Python<'_>, api: &Api, nbytes: usize) -> PyResult<bool> {
    if nbytes <= COPY_HERE_MAX {
        return Ok(true);
    }
    let Some(get_num_threads) = &api.get_num_threads else {
        return Ok(false);
    };
    Ok(nbytes <= COPY_HERE_ONE_THREAD_MAX && get_num_threads.bind(py).call0()?.extract::<usize>()? == 1)
}

/// [`move_storage`] of the whole of `storage`, its size as torch's C method reports it, for
/// Python code that found it in no block: the block it is in when it is in one now (another
/// thread may have moved it since, a `put` between that look and this call), so that it is
/// not moved again.
pub(crate) fn move_storage_whole<'py>(
    py: Python<'py>,
    api: &Api,
    storage: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, Block>> {
    let moves = MOVES.load(Ordering::Relaxed);
    match block_of(py, api, storage)? {
        (Some((block, _)), _) => Ok(block),
        (None, nbytes) => move_storage(py, api, storage, nbytes, false, moves),
    }
}

/// Moves torch `storage` (of `nbytes`, on the CPU) into a new block, in place as torch's
/// `share_memory_()` does: the storage takes the block's memory, so every tensor viewing it
/// follows. A torch before 2.12 cannot swap a storage's memory: the move is refused there,
/// with what to do instead, and the storage is left as it was. `on_cpu`: the caller has seen
/// that the storage is on the CPU (a CPU tensor's), which is then not asked again. `moves`:
/// [`MOVES`] when the caller found the storage in no block, read before it looked. A storage
/// that Python code run in the middle of the move resized is moved at its new size (see
/// [`Moved::Resized`]).
pub(crate) fn move_storage<'py>(
    py: Python<'py>,
    api: &Api,
    storage: &Bound<'py, PyAny>,
    nbytes: usize,
    on_cpu: bool,
    moves: u64,
) -> PyResult<Bound<'py, Block>> {
    let mut nbytes = nbytes;
    for _ in 0..RESIZED_TRIES {
        match move_sized(py, api, storage, nbytes, on_cpu, moves)? {
            Moved::Into(block) => return Ok(block),
            Moved::Resized(now) => nbytes = now,
        }
    }
    Err(PyRuntimeError::new_err(
        "a storage changed size again and again while it was being moved into shared memory \
         (by code run in the middle of the move, such as a finaliser)",
    ))
}

/// How many times a move starts again for a storage that changed size in the middle of it.
const RESIZED_TRIES: usize = 4;

/// What one try of [`move_storage`] did.
enum Moved<'py> {
    /// The storage is in this block now.
    Into(Bound<'py, Block>),
    /// The storage holds this many bytes now, not the number the try was for, and was left
    /// as it was: Python code run in the middle of the move (a finaliser, by a collection
    /// that an allocation of the move started, or another thread while torch's copy let the
    /// GIL go) resized it. torch's swap refuses storages of two sizes.
    Resized(usize),
}

/// One try of [`move_storage`], for a storage of `nbytes`.
fn move_sized<'py>(
    py: Python<'py>,
    api: &Api,
    storage: &Bound<'py, PyAny>,
    nbytes: usize,
    on_cpu: bool,
    moves: u64,
) -> PyResult<Moved<'py>> {
    let resized = || -> PyResult<Option<usize>> {
        let now: usize = api.storage_nbytes.call0(storage)?.extract()?;
        Ok((now != nbytes).then_some(now))
    };
    if nbytes == 0 {
        return Ok(Moved::Into(Bound::new(py, crate::empty_block(py, nbytes)?)?));
    }
    let Some(swap) = &api.storage_swap else {
        return Err(PyRuntimeError::new_err(MOVE_NEEDS_SWAP));
    };
    let here =
        (on_cpu || api.storage_device.get(storage)?.eq(api.cpu.bind(py))?) && copies_here(py, api, nbytes)?;
    // torch's copy lets the GIL go: another thread sending the same storage meanwhile
    // waits for this move, and sends the block it made (see `Moving`). A move of more than
    // `COPY_HERE_MAX` bytes claims the storage even where it copies here, with the GIL held
    // throughout: another thread may be moving it with torch's copy, as torch's thread count,
    // which picks the way (`copies_here`), is each thread's own.
    let _moving = if here && nbytes <= COPY_HERE_MAX {
        None
    } else {
        match Moving::claim(py, api, storage)? {
            Ok(claim) => Some(claim),
            Err(block) => return Ok(Moved::Into(block)),
        }
    };
    let block = Bound::new(py, crate::empty_block(py, nbytes)?)?;
    let flat = flat_tensor(py, api, &block, DType::U8)?;
    let fresh = api.t.untyped_storage.call0(&flat)?;
    // Made before the swap, committed right after it (see `Recording`).
    let recording = Recording::new(&block, true, Some(storage))?;
    // Moved since the caller looked, by Python code run meanwhile (see `MOVES`) or by
    // another thread while such code let the GIL go (a large storage's claim covers it):
    // that block. From this look to the swap only torch's C methods run, which run no
    // Python code (see `copy_out`).
    if here && MOVES.load(Ordering::Relaxed) != moves {
        if let Some(block) = block_at_start(py, api, storage)? {
            return Ok(Moved::Into(block));
        }
    }
    if let Some(now) = resized()? {
        return Ok(Moved::Resized(now));
    }
    // The storage takes the block's memory, and the reference to the block that keeps it
    // mapped; `fresh` takes what the storage had, and frees it when it goes. The bytes are
    // copied after the swap here (see `copies_here`, `copy_out`), else before it by torch,
    // under its own rules.
    let moved = here && {
        swap.call1(storage, &fresh)?;
        match copy_out(api, &fresh, block.get()) {
            Ok(true) => true,
            // The storage gets its old memory back, its bytes as they were.
            failed => {
                swap.call1(storage, &fresh)?;
                failed?
            }
        }
    };
    if !moved {
        // Claimed here when the copy here was refused (the storage changed size meanwhile).
        // (Its wait lets the GIL go: the storage is asked its size again after it. A claim
        // taken at the start was taken before the size was last asked.)
        let _late = match _moving {
            Some(_) => None,
            None => match Moving::claim(py, api, storage)? {
                Ok(claim) => {
                    if let Some(now) = resized()? {
                        return Ok(Moved::Resized(now));
                    }
                    Some(claim)
                }
                Err(block) => return Ok(Moved::Into(block)),
            },
        };
        api.storage_copy.call1(&fresh, storage)?;
        // torch's copy let the GIL go: another thread may have resized the storage since.
        if let Some(now) = resized()? {
            return Ok(Moved::Resized(now));
        }
        swap.call1(storage, &fresh)?;
    }
    if let Some(recording) = recording {
        recording.commit(py, &block);
    }
    MOVES.fetch_add(1, Ordering::Relaxed);
    MOVED_AWAY.with(|k| {
        if let Some((kept, bytes)) = k.borrow_mut().as_mut() {
            if let Some(total) = bytes.checked_add(nbytes).filter(|&t| t <= MOVED_AWAY_MAX) {
                kept.push(fresh.unbind());
                *bytes = total;
            }
        }
    });
    Ok(Moved::Into(block))
}

/// Most bytes of old memory `MOVED_AWAY` keeps for one value: beyond, a storage's old memory
/// is freed with its move, as before (a value of many large storages, a model's weights,
/// would otherwise hold its private and its shared copy at once).
const MOVED_AWAY_MAX: usize = 64 << 20;

thread_local! {
    /// While a value is being turned into a message (`keeping_moved_memory`), the old memory
    /// of the storages moved into blocks on the way, up to `MOVED_AWAY_MAX` bytes, and how
    /// many bytes that is: a numpy array of one of them in the same value
    /// (`q.put([t, t.numpy()])`, `t` not shared yet) views that memory, and is copied from
    /// it after the move. Kept until the value is turned; the array the program keeps views
    /// freed memory after that, as after torch's own `share_memory_()`.
    static MOVED_AWAY: std::cell::RefCell<Option<(Vec<Py<PyAny>>, usize)>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f`, which turns a value into a message, keeping the old memory of the storages it
/// moves until it is done (see `MOVED_AWAY`).
pub(crate) fn keeping_moved_memory<R>(f: impl FnOnce() -> R) -> R {
    struct Done(bool);
    impl Drop for Done {
        fn drop(&mut self) {
            if self.0 {
                // Dropped with the GIL held (the caller holds it to turn a value).
                drop(MOVED_AWAY.with(|k| k.borrow_mut().take()));
            }
        }
    }
    let outermost = MOVED_AWAY.with(|k| {
        let mut k = k.borrow_mut();
        let outermost = k.is_none();
        if outermost {
            *k = Some((Vec::new(), 0));
        }
        outermost
    });
    let _done = Done(outermost);
    f()
}

/// The storages that threads of this process are moving with torch's copy (which lets the
/// GIL go), by the address of their memory before the move, and the process that moves
/// each (a forked child's copies of its parent's are not its own: they are let go). A
/// second thread that moved the same storage meanwhile would copy from memory the first
/// frees once it has swapped the block in, and its message would name a block the storage
/// no longer uses. Locked only by threads that hold the GIL, and never across a wait, so
/// no fork (which Python makes with the GIL held) finds it taken.
static MOVING: Mutex<Vec<Claim>> = Mutex::new(Vec::new());

/// One move under way (see [`MOVING`]): whether it is over, for the threads that wait.
#[derive(Clone)]
struct Claim {
    pid: u32,
    thread: std::thread::ThreadId,
    addr: usize,
    over: Arc<(Mutex<bool>, Condvar)>,
}

/// A thread's claim on moving a storage (see [`MOVING`]), given up when dropped, which
/// wakes the threads waiting for it.
struct Moving(Claim);

impl Moving {
    /// The claim on moving `storage`, or the block it is in once the claim is taken (a
    /// thread moved it between the caller's look and this claim, or was moving it and is
    /// done: the claim is taken anew if the storage is in no block then). A thread that is
    /// moving the storage already (Python code run in the middle of its move, by the GC,
    /// sends it again) gets an error, rather than wait for itself.
    fn claim<'py>(
        py: Python<'py>,
        api: &Api,
        storage: &Bound<'py, PyAny>,
    ) -> PyResult<Result<Moving, Bound<'py, Block>>> {
        loop {
            let addr: usize = api.storage_data_ptr.call0(storage)?.extract()?;
            let pid = std::process::id();
            let thread = std::thread::current().id();
            let other = {
                let mut moving = MOVING.lock().unwrap_or_else(|p| p.into_inner());
                moving.retain(|c| c.pid == pid);
                match moving.iter().find(|c| c.addr == addr) {
                    Some(c) if c.thread == thread => {
                        return Err(PyRuntimeError::new_err(
                            "a storage was sent again while this thread was moving it into shared \
                             memory (by code run in the middle of the move)",
                        ))
                    }
                    Some(c) => c.over.clone(),
                    None => {
                        let claim = Claim { pid, thread, addr, over: Arc::default() };
                        moving.push(claim.clone());
                        drop(moving);
                        let claim = Moving(claim);
                        // Moved into a block before the claim (another thread, after the
                        // caller looked): that block, and no move.
                        if let Some(block) = block_at_start(py, api, storage)? {
                            return Ok(Err(block));
                        }
                        return Ok(Ok(claim));
                    }
                }
            };
            py.detach(|| {
                let (lock, cv) = &*other;
                let mut over = lock.lock().unwrap_or_else(|p| p.into_inner());
                while !*over {
                    over = cv.wait(over).unwrap_or_else(|p| p.into_inner());
                }
            });
            if let Some(block) = block_at_start(py, api, storage)? {
                return Ok(Err(block));
            }
        }
    }
}

impl Drop for Moving {
    fn drop(&mut self) {
        let mut moving = MOVING.lock().unwrap_or_else(|p| p.into_inner());
        moving.retain(|c| !Arc::ptr_eq(&c.over, &self.0.over));
        drop(moving);
        let (lock, cv) = &*self.0.over;
        *lock.lock().unwrap_or_else(|p| p.into_inner()) = true;
        cv.notify_all();
    }
}

/// Copies into `block` the bytes of CPU storage `old`, which has just taken a storage's old
/// memory from a swap that gave that storage `block`'s: `false` (nothing done) when `old`
/// does not hold exactly as many bytes as `block` (the storage changed size meanwhile), and
/// torch copies.
///
/// The old memory is read here, not where other threads might free it: once swapped into
/// `old`, which was made by the caller and has not left it, nothing else can name it. A
/// torch operation running meanwhile in another thread without the GIL on the storage being
/// moved reads the block's bytes before or during the copy, and its writes may be lost, as
/// writes made during any move are (share a tensor before handing it to writers, as in
/// torch). The block's bytes are written as every safe write of tensorshare writes shared
/// memory, so such a write races with nothing here.
fn copy_out(api: &Api, old: &Bound<'_, PyAny>, block: &Block) -> PyResult<bool> {
    let len = block.storage.len();
    // From the swap to the end of the read only torch's C methods `data_ptr` and `nbytes`
    // are called: METH_NOARGS methods, which pyo3 calls by vectorcall, without a tuple. They
    // allocate only the int they return, which the GC does not track, so no collection, and
    // so no finaliser, runs: no Python code at all, which could find `old`
    // (`gc.get_objects()`) and free its memory.
    let addr: usize = api.storage_data_ptr.call0(old)?.extract()?;
    let held: usize = api.storage_nbytes.call0(old)?.extract()?;
    if addr == 0 || held != len {
        return Ok(false);
    }
    // SAFETY: `addr..addr + len` is the host memory `old` holds, as torch's C methods
    // reported it just now (a CPU storage of `len` bytes, checked above). `old` is the
    // storage of the tensor the caller had torch make over the block, by torch's own C
    // function (`Api` takes no other), and no reference to it has left the caller, so no
    // torch operation in any thread can resize or free its memory, and no Python code has
    // run since the swap (the GIL is held, and only C methods that run none were called), so
    // none has found it either; it lives until the caller returns. An operation that read
    // the storage's old address before the swap may still write those bytes from another
    // thread: the copy reads them with volatile loads, which assume nothing about other
    // users of the memory (torn bytes, as torch's own copy would read). torch's allocation
    // cannot overlap the block, an arena slot this process holds.
    unsafe { block.storage.copy_from_volatile(addr as *const u8) }.map_err(to_py)?;
    Ok(true)
}

/// A received tensor as a torch tensor over its block's torch storage.
pub(crate) fn from_tensor(py: Python<'_>, api: &Api, t: Tensor) -> PyResult<Py<PyAny>> {
    let dtype = api.dtypes[dtype_index(t.dtype())].bind(py);
    // `dtype=` and the geometry as Python objects, made only where a call takes them (the
    // common flat tensor over a whole block needs none).
    let args = || -> PyResult<_> {
        let kwargs = PyDict::new(py);
        kwargs.set_item(api.key_dtype.bind(py), dtype)?;
        Ok((kwargs, PyTuple::new(py, t.shape())?, PyTuple::new(py, t.strides())?))
    };
    let out = match t.device() {
        Device::Cpu if !t.storage().is_empty() => {
            let (block, new) = block_for(py, t.storage())?;
            // The first tensor over a block that it covers whole, flat (what a producer's
            // fresh tensor most often is): one call makes both the block's torch storage and
            // the tensor, as `empty_shared` does, instead of three.
            let whole = t.shape().len() == 1
                && t.strides() == [1]
                && t.storage_offset() == 0
                && t.shape()[0].checked_mul(t.dtype().size()) == Some(block.get().storage.len());
            match registered_storage(py, api, &block)? {
                None if whole => flat_over(py, api, &block, t.dtype(), new)?.0,
                known => {
                    let storage = match known {
                        Some(s) => {
                            if new {
                                register_block(py, &block)?;
                            }
                            s
                        }
                        None => flat_over(py, api, &block, DType::U8, new)?.1,
                    };
                    let (kwargs, shape, strides) = args()?;
                    let out = api.empty.bind(py).call((0,), Some(&kwargs))?;
                    api.t.set_.bind(py).call1((&out, storage, t.storage_offset(), shape, strides))?;
                    out
                }
            }
        }
        Device::Cpu => {
            // No bytes: an empty tensor (a view of nothing), strides kept.
            let (kwargs, shape, strides) = args()?;
            api.empty_strided.bind(py).call((shape, strides), Some(&kwargs))?
        }
        Device::Meta => {
            let (kwargs, shape, strides) = args()?;
            kwargs.set_item(api.key_device.bind(py), "meta")?;
            api.empty_strided.bind(py).call((shape, strides), Some(&kwargs))?
        }
        Device::Cuda(i) => crate::cuda::from_tensor(py, api, &t, i, dtype)?,
    };
    if t.kind() == TensorKind::Parameter {
        return api.parameter.bind(py).call1((out, t.requires_grad()))?.into_py_any(py);
    }
    if t.requires_grad() {
        api.t.requires_grad_.bind(py).call1((&out, true))?;
    }
    Ok(out.unbind())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nearest_live_start_is_found_under_any_number_of_dead_ones_which_go() {
        // A large block now over the memory of many that died: each dead address is
        // stepped over once, then gone, and the live one below is found.
        let mut starts: BTreeSet<usize> = (0..1000).map(|k| 4096 + 64 * k).collect();
        starts.insert(64);
        let live = |a: usize| (a == 64).then_some("big");
        assert_eq!(nearest_live(&mut starts, 4096 + 64 * 999 + 10, live), Some(("big", 64)));
        assert_eq!(starts.iter().copied().collect::<Vec<_>>(), vec![64]);
        // Nothing live at or below: none, and the dead are gone all the same.
        let mut starts: BTreeSet<usize> = [128, 256, 4096].into_iter().collect();
        assert_eq!(nearest_live(&mut starts, 300, |_| None::<()>), None);
        assert_eq!(starts.iter().copied().collect::<Vec<_>>(), vec![4096]);
        // A live one above the address is no candidate, and stays.
        let mut starts: BTreeSet<usize> = [128, 4096].into_iter().collect();
        assert_eq!(nearest_live(&mut starts, 4000, Some), Some((128, 128)));
        assert_eq!(starts.len(), 2);
    }
}
