"""Tensors and arrays to and from blocks of shared memory, and pickling by value.

Called by the native module (``_native``) while it turns Python values into the
cross-language ``Value`` and back; not a public interface.
"""

import collections
import collections.abc
import copyreg
import functools
import io
import os
import pickle
import reprlib
import sys
import types
import weakref
from multiprocessing.reduction import ForkingPickler

from . import _native

try:  # cloudpickle pickles lambdas, closures and local functions by value
    import cloudpickle as _cloudpickle
except ImportError:  # pragma: no cover - a dependency of the package
    _cloudpickle = None

_NUMPY_NAMES = {
    "bool": "bool",
    "uint8": "uint8",
    "int8": "int8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "float16": "float16",
    "float32": "float32",
    "float64": "float64",
}
NON_LEAF_REFUSED = (
    "Cowardly refusing to serialize non-leaf tensor which requires_grad, since autograd "
    "does not support crossing process boundaries.  If you just want to transfer the data, "
    "call detach() on the tensor before serializing (e.g., putting it on the queue)."
)


def _torch():
    return sys.modules.get("torch")


def _numpy():
    return sys.modules.get("numpy")


def new_block(nbytes):
    """A block of ``nbytes`` in shared memory, registered as such (a tensor or an array over
    it is sent without a copy)."""
    return _native.new_block(nbytes)


def torch_storage(block):
    """The torch storage over ``block`` (one per block while it lives)."""
    if block.nbytes == 0:
        return _torch().UntypedStorage(0)
    return _native.torch_storage(block)


def move_storage(storage):
    """Moves the CPU torch ``storage`` into a new block and returns the block: in place, as
    torch's ``share_memory_()`` does, so every tensor viewing that storage follows. One
    in a block already (another thread sent it since the caller looked) stays there."""
    return _native.move_storage(storage)


def _is_ours(storage):
    """Whether ``storage`` lies in a block: from its start, or inside it (``torch.from_numpy``
    of a view into the middle of a shared array)."""
    return _native.block_covering(storage.data_ptr(), storage.nbytes()) is not None


def _torch_strategy():
    """torch's own sharing strategy (``torch.multiprocessing``'s, apart from tensorshare's)."""
    tmp = sys.modules.get("torch.multiprocessing")
    return "file_descriptor" if tmp is None else tmp.get_sharing_strategy()


# A strategy set by tensorshare.multiprocessing's setter before torch was imported, for
# torch's setter once it is (see ``set_torch_strategy``).
_torch_strategy_wanted = None


def _torchs_file_system_alone():
    """Whether torch's strategy is ``file_system`` and tensorshare's is not: torch's setter
    was called alone (see ``patch_torch``)."""
    return _torch_strategy() == "file_system" and _native.get_sharing_strategy() != "file_system"


def set_torch_strategy(strategy):
    """Sets torch's own sharing strategy too, as ``torch.multiprocessing.set_sharing_strategy``
    does, which ``tensorshare.multiprocessing``'s replaces: torch's own queues and reductions
    follow it (a DataLoader given no ``multiprocessing_context``, whose \"Too many open files\"
    ``file_system`` is the known cure for). Before torch is imported, when it is."""
    global _torch_strategy_wanted
    torch_mp = getattr(_torch(), "multiprocessing", None)
    if torch_mp is None or not hasattr(torch_mp, "set_sharing_strategy"):
        _torch_strategy_wanted = strategy
        return
    _torch_strategy_wanted = None
    torch_mp.set_sharing_strategy(strategy)


def patch_torch(torch):
    """Teaches torch that tensorshare's blocks are shared memory: ``is_shared()`` is True
    for a storage in a block, and ``share_memory_()`` moves a CPU storage into a block (in
    place, as torch's does) instead of into torch's own shared memory, so that a model's
    ``share_memory()`` before forking workers, and sending it later, share one memory. A
    storage torch had already put in its own shared memory stays there.

    Under torch's own ``file_system`` strategy, set by torch's setter alone
    (``torch.multiprocessing.set_sharing_strategy``, with tensorshare's strategy left
    ``file_descriptor``), ``share_memory_()`` is torch's: torch's queues send a storage in a
    block by descriptor, which needs its sender alive until the receiver has it, and that
    strategy promises a sender may exit right after its ``put``. tensorshare's own queues
    send what torch shared with torch's reductions, and ``tensorshare.share_memory_`` moves
    into a block under either strategy. tensorshare's setter sets both strategies (see
    ``set_torch_strategy``): under its ``file_system``, ``share_memory_()`` moves into a
    named block, which tensorshare's queues let a sender leave right after its ``put``, and
    whose name is swept when its processes die, where torch's may be left behind.

    A torch that cannot move a storage in place (before 2.12, see ``can_move_in_place``)
    keeps its own ``share_memory_()`` for storages in no block: importing tensorshare must not
    make a call that works in torch fail. A storage in a block stays there on any torch
    (torch's own copied it into torch's shared memory, and a shared array it was made over no
    longer saw its writes)."""
    if _torch_strategy_wanted is not None:
        set_torch_strategy(_torch_strategy_wanted)
    cls = torch.UntypedStorage
    if getattr(cls, "_tensorshare_patched", False):
        return
    torch_is_shared = cls.is_shared
    torch_share_memory_ = cls.share_memory_

    def is_shared(self):
        return (self.device.type == "cpu" and _is_ours(self)) or torch_is_shared(self)

    def share_memory_(self, *args, **kwargs):
        on_cpu = self.device.type == "cpu" and self.nbytes() != 0
        if on_cpu and _is_ours(self):
            return self
        moves = can_move_in_place(torch)
        if not on_cpu or not moves or torch_is_shared(self) or _torchs_file_system_alone():
            return torch_share_memory_(self, *args, **kwargs)
        move_storage(self)
        return self

    is_shared.__doc__ = torch_is_shared.__doc__
    share_memory_.__doc__ = torch_share_memory_.__doc__
    cls.is_shared = is_shared
    cls.share_memory_ = share_memory_
    _teach_torch_queues(torch)
    _guard_failed_resizes(torch)
    cls._tensorshare_patched = True


def _guard_failed_resizes(torch):
    """Makes a failed ``resize_`` or ``resize_as_`` of a CPU tensor over a block leave its
    shape as it was. torch sets a tensor's new geometry before it finds that the storage
    cannot grow, and raises with the new geometry kept, so that the next write through the
    tensor reaches past its storage. No storage in a block can grow (its memory is a slot of
    an arena), and the bytes past it are other blocks', which other processes may hold: a
    write there was silent corruption of their tensors. (Ops given an ``out=`` tensor resize
    it in torch's C++, which no Python method sees: give them one of the right shape.)"""
    tensor = torch.Tensor
    for name in ("resize_", "resize_as_"):
        torch_method = getattr(tensor, name)
        if getattr(torch_method, "_tensorshare", False):
            continue

        def method(self, *args, _torch_method=torch_method, **kwargs):
            try:
                before = _geometry_in_block(torch, self)
            except Exception:  # a tensor with no strides or storage to look at
                before = None
            try:
                return _torch_method(self, *args, **kwargs)
            except RuntimeError:
                if before is not None and (self.size(), self.stride()) != before[2:]:
                    with torch.no_grad():
                        self.set_(*before)
                raise

        method._tensorshare = True
        method.__name__ = name
        method.__doc__ = torch_method.__doc__
        setattr(tensor, name, method)


def _geometry_in_block(torch, t):
    """The storage, offset, shape and strides of ``t``, in the order ``set_`` takes them to
    put them back, when it is a strided CPU tensor over a block; None for any other."""
    if t.device.type != "cpu" or t.layout != torch.strided or t.is_nested:
        return None
    storage = t.untyped_storage()
    if not storage.nbytes() or not _is_ours(storage):
        return None
    return storage, t.storage_offset(), t.size(), t.stride()


def _teach_torch_queues(torch):
    """Makes torch's own queues and process arguments (``torch.multiprocessing``'s
    reductions, which a DataLoader given no ``multiprocessing_context`` uses) send a storage
    in a block as a handle of the block, as tensorshare's queues do. torch's reduction would
    move it into torch's own shared memory in the sending process (``_share_fd_cpu_``): a
    fork worker sending a row of a dataset shared before it started then sent a copy of its
    own, which writes through the received tensor never reached, and each worker made one.
    Storages in no block keep torch's reduction."""
    try:
        import torch.multiprocessing.reductions  # noqa: F401  (registers torch's reductions)
    except ImportError:
        return
    torch_reduce = ForkingPickler._extra_reducers.get(torch.UntypedStorage)
    if torch_reduce is None or getattr(torch_reduce, "_tensorshare", False):
        return

    def reduce_storage(storage):
        if storage.device.type == "cpu" and storage.nbytes() and _is_ours(storage):
            return _reduce_block_storage(storage)
        return torch_reduce(storage)

    reduce_storage._tensorshare = True
    ForkingPickler.register(torch.UntypedStorage, reduce_storage)
    os.register_at_fork(after_in_child=_reset_fd_sharer)
    release_parcels_at_launch()


def _reduce_block_storage(storage):
    """A storage in a block as torch's queues carry one: tensorshare's message for it, with
    its descriptors as multiprocessing passes descriptors (``DupFd``), which hold the
    message's slots until the receiver has its own hold, as the descriptors in a tensorshare
    queue's records do. For a process being started, the descriptors themselves are passed
    (not copies): they stay open until the process is started (``keep_for_launch``)."""
    from multiprocessing import context, reduction

    data, fds, parcel = _native.export(storage)
    # Each descriptor's file, checked by the receiver: a DupFd is fetched apart from the
    # message, and a child made by os.fork serves its parent's (see `_reset_fd_sharer`).
    files = tuple(_file_of(fd) for fd in fds)
    popen = context.get_spawning_popen()
    if popen is not None:
        keep_for_launch(popen, parcel)
    # Otherwise each DupFd is a copy of its own, and the parcel's may close.
    return (import_dup_fds, (data, tuple(reduction.DupFd(fd) for fd in fds), files))


def keep_for_launch(popen, parcel):
    """Keeps ``parcel`` (descriptors the arguments of the process ``popen`` is starting
    name) open until that process is started (see ``release_parcels_at_launch``)."""
    popen.__dict__.setdefault("_tensorshare_parcels", []).append(parcel)


def release_parcels_at_launch():
    """Makes the spawn and fork server ``Popen`` of multiprocessing close the descriptors
    kept for a child's arguments (``keep_for_launch``) as soon as the child is started,
    whichever context started it: spawn has passed them as it ran the child, and a fork
    server has them in flight in its socket, so the child holds what they hold with its own.
    Kept until the ``Popen`` went, they stayed open in the parent as long as the ``Process``
    object, one per storage and process (and a pipe end the parent closed stayed open, so
    its reader waited for good after the child had gone instead of seeing the end)."""
    import multiprocessing.popen_forkserver
    import multiprocessing.popen_spawn_posix

    for cls in (multiprocessing.popen_spawn_posix.Popen, multiprocessing.popen_forkserver.Popen):
        launch = cls.__dict__.get("_launch")
        if launch is None or getattr(launch, "_tensorshare", False):
            continue

        @functools.wraps(launch)
        def _launch(self, process_obj, _launch=launch):
            try:
                return _launch(self, process_obj)
            finally:
                self.__dict__.pop("_tensorshare_parcels", None)

        _launch._tensorshare = True
        cls._launch = _launch


def _file_of(fd):
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino)


def import_dup_fds(data, dup_fds, files=None):
    """A tensorshare message whose descriptors came as multiprocessing's ``DupFd``s; with
    ``files``, each must be of the file its sender named (else the value is refused rather
    than read from another file)."""
    fds = [d.detach() for d in dup_fds]
    try:
        if files is not None and [_file_of(fd) for fd in fds] != [tuple(f) for f in files]:
            raise _native.InvalidMessage(
                "a descriptor of a tensor sent through a multiprocessing queue is not of the file "
                "its sender named (a child made by os.fork sharing descriptors its parent "
                "registered?): refused"
            )
        return _native.import_(data, fds)
    finally:
        for fd in fds:
            os.close(fd)


def _reset_fd_sharer():
    """In a child made by os.fork: multiprocessing's descriptor sharer (``DupFd`` outside a
    process start) is reset as in the processes multiprocessing starts; else the child would
    hand out descriptors its parent registered, under its parent's address."""
    rs = sys.modules.get("multiprocessing.resource_sharer")
    if rs is not None:
        rs._resource_sharer._afterfork()


def can_move_in_place(torch):
    """Whether this torch's storages can take new memory in place
    (``UntypedStorage._swap_data_ptr_``, torch >= 2.12), which moving a storage into a block
    needs. The extension asks this function too, once, so both sides answer alike: where it
    is False, a CPU storage in no block is shared the way torch shares it (``torch_shares``).
    """
    return "_swap_data_ptr_" in vars(torch._C.StorageBase)


def _torch_shm_kind(torch, untyped):
    """The strategy under which torch has CPU storage ``untyped`` in its own shared memory
    already (``"file_descriptor"`` or ``"file_system"``), or None where it has not (a file
    torch maps, ``torch.from_file``, is no shared memory of torch's: it has no descriptor or
    name to share)."""
    base = torch._C.StorageBase
    if not base.is_shared(untyped):
        return None
    try:
        fd = base._get_shared_fd(untyped)
    except Exception:
        return "file_system"  # a named segment of torch's manager has no descriptor here
    return "file_descriptor" if fd >= 0 else None


def maps_file_shared(untyped):
    """Whether torch maps CPU storage ``untyped`` from a file, shared
    (``torch.from_file(..., shared=True)``): its writes reach the file, which a move into a
    block would end. torch's ``share_memory_()`` leaves it where it is, and so does
    ``tensorshare.share_memory_``; a put refuses it (``refuse_mapped_file`` in the extension)."""
    return getattr(untyped, "filename", None) is not None


def torch_shares(torch, untyped):
    """Whether CPU storage ``untyped``, in no block, is shared the way torch shares it rather
    than moved into a block: where this torch cannot move it (before 2.12), and where torch
    has it in its own shared memory already, where other processes may map it (torch's
    queues, a DataLoader's default workers, a model shared before tensorshare was imported).
    The extension decides alike (``moves_into_block`` in ``torch.rs``)."""
    if untyped.nbytes() == 0:
        return False  # moved into an empty block, with no swap
    return not can_move_in_place(torch) or _torch_shm_kind(torch, untyped) is not None


def _refuse_device(device):
    """An error for a tensor or storage on a device tensorshare does not send (anything but
    the CPU, meta and CUDA), as the conversion of values gives it: pickled, its bytes would
    be copied, and the receiver's writes would be lost with no error."""
    if device.type not in ("cpu", "meta", "cuda"):
        raise RuntimeError(
            f"a tensor on {device} cannot be sent by tensorshare's Python package; move it to the CPU first"
        )


def _cuda_reduction(obj, kind):
    """torch's own reduction of a CUDA tensor or storage: a tensor travels as torch's CUDA
    IPC handle of its allocation (``reduce_tensor``: the receiver maps the sender's memory,
    so its writes reach the sender, and the sender keeps the memory until every receiver has
    let go, as in torch.multiprocessing); a storage alone is refused with torch's own error
    ("Cannot pickle CUDA storage; try pickling a CUDA tensor instead"). torch's rules come
    with it: the sender must stay alive while receivers use the memory, and a forked child
    cannot use CUDA once its parent has.

    A tensor or storage over tensorshare's own CUDA memory reaches here only where no handle
    can say it (a dtype tensorshare lacks, a storage over part of an allocation, a storage
    alone): torch's CUDA IPC knows its own allocator's memory only, so it is refused here,
    saying so, rather than by torch's "invalid device pointer"."""
    import torch.multiprocessing.reductions as reductions

    torch = _torch()
    if isinstance(obj, torch.Tensor):
        untyped = obj.untyped_storage()
    else:
        untyped = getattr(obj, "_untyped_storage", obj)  # (TypedStorage's own getters warn)
    if _native.in_cuda_allocation(untyped.data_ptr(), untyped.nbytes()):
        what = f"a {obj.dtype} tensor" if isinstance(obj, torch.Tensor) else f"a {type(obj).__name__}"
        raise RuntimeError(
            f"{what} over CUDA memory of tensorshare's (empty_shared(..., device='cuda')) cannot be "
            "sent as it is: a handle says a tensor of a dtype tensorshare has, over the whole "
            "allocation's storage; send such a view of it, or a copy (torch's CUDA sharing "
            "knows only its own allocator's memory)"
        )
    return getattr(reductions, kind)(obj)


def torch_reduction(obj):
    """torch's own reduction (``torch.multiprocessing.reductions``) of ``obj`` when it is a
    CUDA tensor or storage (``_cuda_reduction``), or a CPU tensor or storage in no block
    that torch shares (``torch_shares``): shared as torch.multiprocessing shares it, in
    place. A storage already in torch's shared memory is reduced under the strategy it was
    shared with (the other would copy it elsewhere); one not shared yet under the sharing
    strategy set here. None for anything else, which is pickled as before (a storage in a
    block travels as a handle)."""
    torch = _torch()
    if torch is None:
        return None
    if isinstance(obj, (torch.Tensor, torch.UntypedStorage)):
        device = obj.device
    elif isinstance(obj, torch.TypedStorage):
        device = obj._untyped_storage.device  # (TypedStorage's own getters warn)
    else:
        return None
    _refuse_device(device)
    if type(obj) in (torch.Tensor, torch.nn.Parameter):
        if device.type == "cuda" and obj.layout == torch.strided and (obj.is_neg() or obj.is_conj()):
            # torch's CUDA reduction drops the bit (its receiver reads other values), and
            # torch's __reduce_ex__ pickles the storage apart, which torch refuses for CUDA.
            raise RuntimeError(
                "a CUDA tensor with torch's negative or conjugate bit cannot be shared: torch's "
                "CUDA sharing would lose the bit; send t.resolve_neg() or t.resolve_conj() (a copy)"
            )
        if obj.layout != torch.strided or obj.is_neg() or obj.is_conj():
            # torch's reduce_tensor keeps neither bit: torch's __reduce_ex__ does, and its
            # storage is reduced here. (A sparse tensor's __reduce_ex__ gives its parts,
            # each reduced here.)
            return None
        if device.type == "cuda":
            return _cuda_reduction(obj, "reduce_tensor")
        if device.type != "cpu":
            return None
        untyped = obj.untyped_storage()
        kind = "reduce_tensor"
    elif isinstance(obj, torch.UntypedStorage):
        untyped = obj
        kind = "reduce_storage"
    elif isinstance(obj, torch.TypedStorage):
        untyped = obj._untyped_storage  # (TypedStorage's own getters warn)
        kind = "reduce_typed_storage" if type(obj) is torch.TypedStorage else "reduce_typed_storage_child"
    else:
        return None
    if device.type == "cuda":
        return _cuda_reduction(obj, kind)
    if untyped.device.type != "cpu" or _is_ours(untyped) or not torch_shares(torch, untyped):
        return None
    import torch.multiprocessing as torch_mp
    import torch.multiprocessing.reductions as reductions

    strategy = _torch_shm_kind(torch, untyped)
    if strategy is None:
        # (torch before 2.12, which cannot move a storage: torch's own reduction would fail
        # on a file it maps shared, with no descriptor to send.)
        _native.refuse_mapped_file(untyped)
        strategy = _native.get_sharing_strategy()
    # torch's reductions read its global strategy: set for this call, then given back.
    before = torch_mp.get_sharing_strategy()
    if before != strategy:
        torch_mp.set_sharing_strategy(strategy)
    try:
        return getattr(reductions, kind)(obj)
    finally:
        if before != strategy:
            torch_mp.set_sharing_strategy(before)


class _TorchHook:
    """Patches torch (``patch_torch``) as soon as it is imported, when tensorshare was
    imported first."""

    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        import importlib.util

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            patch_torch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def install_torch_hook():
    torch = _torch()
    if torch is not None:
        patch_torch(torch)
    elif not any(isinstance(f, _TorchHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchHook())


def _block_under(a):
    """The block numpy array ``a`` views (its base, or its base's base, ...), else the live
    block all of its bytes lie in (an array over a torch tensor in a block, ``t.numpy()``,
    whose base is the tensor), or None."""
    base = a
    while base is not None and not isinstance(base, _native.Block):
        base = getattr(base, "base", None)
    if base is None and a.size:
        low, high = _byte_bounds(a)
        found = _native.block_covering(low, high - low)
        if found is not None:
            base = found[0]
    return base


def _byte_bounds(a):
    """The addresses of ``a``'s first byte and one past its last, whatever its strides."""
    low = high = a.__array_interface__["data"][0]
    for n, step in zip(a.shape, a.strides, strict=True):
        if step < 0:
            low += step * (n - 1)
        else:
            high += step * (n - 1)
    return low, high + a.itemsize


def _handle_geometry(a, block):
    """``a``'s offset and strides in elements over ``block``, when a handle can say them
    (every stride, and the offset, whole elements, none negative); else None."""
    start = a.__array_interface__["data"][0] - block.address
    item = a.itemsize
    if start >= 0 and start % item == 0 and all(s >= 0 and s % item == 0 for s in a.strides):
        return start // item, tuple(s // item for s in a.strides)
    return None


def _travels_as_handle(a):
    """Whether numpy array ``a`` travels as a handle: a dtype of the wire in this machine's
    byte order, and, over a block, a geometry a handle can say. A view of a block that a
    handle cannot say (a negative stride, another byte order or dtype) travels as a view of
    its block instead (``_array_view_reduction``), as does a read-only view, which arrives
    read-only; an array in no block is copied into one."""
    if a.dtype.name not in _NUMPY_NAMES or not a.dtype.isnative:
        return False
    block = _block_under(a)
    if block is None:
        return True
    return a.flags.writeable and (not a.size or _handle_geometry(a, block) is not None)


def _copy_into_block(a):
    """A new block holding a copy of ``a``, with the copy's strides in elements: in Fortran
    order when ``a`` is (as pickle keeps it), else in C order."""
    np = _numpy()
    block = new_block(a.nbytes)
    order = "F" if a.flags.f_contiguous and not a.flags.c_contiguous else "C"
    if a.nbytes:
        np.ndarray(a.shape, a.dtype, buffer=block, order=order)[...] = a
    strides = []
    step = 1
    for n in reversed(a.shape) if order == "C" else a.shape:
        strides.append(step)
        step *= n
    return block, tuple(reversed(strides)) if order == "C" else tuple(strides)


def _array_view_reduction(obj):
    """A numpy array over a block that no handle can say (a dtype the wire lacks: unsigned
    integers beyond 8 bits, complex, datetimes, strings, records; another byte order; a
    negative stride): the whole block as a uint8 array, which travels as a handle, and the
    view to make over it, so that the array is shared, as one made by
    ``tensorshare.empty_shared_array`` promises, not copied. None for anything else (an
    array of Python objects, whose references no other process can read, is pickled)."""
    np = _numpy()
    if np is None or type(obj) is not np.ndarray or obj.dtype.hasobject or not obj.size:
        return None
    block = _block_under(obj)
    if block is None or block.nbytes == 0:
        return None
    whole = np.ndarray((block.nbytes,), np.uint8, buffer=block)
    start = obj.__array_interface__["data"][0] - block.address
    return (_rebuild_array_view, (whole, obj.dtype, obj.shape, obj.strides, start, obj.flags.writeable))


def _rebuild_array_view(whole, dtype, shape, strides, offset, writeable=True):
    """A view of a block (``whole``, a uint8 array over all of it), as the sender's array
    viewed it (numpy checks that it lies within the block)."""
    np = _numpy()
    a = np.ndarray(shape, dtype, buffer=whole, offset=offset, strides=strides)
    if not writeable:
        a.flags.writeable = False
    return a


def array_parts(obj):
    """What the native side needs to send numpy array ``obj`` as a handle, or None when
    ``obj`` is no array it can send that way (it is then pickled, as a view of its block
    when it is in one). Torch tensors are handled in Rust (``torch.rs``)."""
    np = _numpy()
    if np is None or type(obj) is not np.ndarray or obj.dtype.name not in _NUMPY_NAMES:
        return None
    if not obj.dtype.isnative:
        return None
    block = _block_under(obj)
    if block is not None and not obj.flags.writeable:
        return None  # a read-only view of a block arrives read-only (`_array_view_reduction`)
    geometry = _handle_geometry(obj, block) if block is not None and obj.size else None
    if geometry is not None:
        offset, strides = geometry
    elif block is not None and obj.size:
        return None  # a view no handle can say: a view of its block (`_array_view_reduction`)
    else:
        (block, strides), offset = _copy_into_block(obj), 0
    return (True, block, _NUMPY_NAMES[obj.dtype.name], obj.shape, strides, offset, False, False, "cpu")


def rebuild(array, block, dtype, shape, strides, offset, requires_grad, parameter, device):
    """A numpy array over ``block`` (torch tensors are rebuilt in Rust; a tensor reaches here
    only where torch is not installed, and arrives as an array)."""
    np = _numpy()
    if np is None:
        import numpy as np
    # numpy has no bfloat16: its raw bits, which `.view(ml_dtypes.bfloat16)` reads (else the
    # whole value would be lost to one field).
    dt = np.dtype(np.uint16 if dtype == "bfloat16" else dtype)
    if not shape or 0 not in shape:
        if block.nbytes == 0:
            # numpy would take an empty buffer for none and view memory at its address.
            raise ValueError(f"an array of shape {tuple(shape)} over an empty block")
        return np.ndarray(
            shape,
            dt,
            buffer=block,
            offset=offset * dt.itemsize,
            strides=tuple(s * dt.itemsize for s in strides),
        )
    return np.zeros(shape, dt)


def _consulted(cls):
    """Whether multiprocessing's reducer for class ``cls`` is used (see
    ``_MultiprocessingReducers``): not for torch's tensors and storages (this pickler sends
    them itself), nor ``functools.partial``. torch's others are (its CUDA ``Event``, by
    interprocess handle)."""
    if cls is functools.partial:
        return False
    module = getattr(cls, "__module__", None)
    if not (isinstance(module, str) and module.partition(".")[0] == "torch"):
        return True
    torch = _torch()
    return (
        torch is not None
        and isinstance(cls, type)
        and not issubclass(cls, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage))
        and cls not in getattr(torch, "_tensor_classes", ())  # torch.FloatTensor and the like
    )


class _MultiprocessingReducers(collections.abc.Mapping):
    """The reducers registered with multiprocessing's pickler (``ForkingPickler.register``:
    its own for a ``Connection``, a socket, the heap arenas of ``Value`` and ``Array`` and the
    ctypes they hold, methods and descriptors; those of other libraries), read when asked, so
    that later registrations count. Not torch's for tensors and storages (this pickler sends
    them itself), nor multiprocessing's for ``functools.partial``, which drops the partial's
    attributes where its own reduction keeps them. Without them such objects were pickled as
    plain objects: a Connection arrived holding its sender's descriptor number, and wrote to
    whatever file had that number in the receiver."""

    def __getitem__(self, cls):
        if not _consulted(cls):
            raise KeyError(cls)
        return ForkingPickler._extra_reducers[cls]

    def __iter__(self):
        return (cls for cls in list(ForkingPickler._extra_reducers) if _consulted(cls))

    def __len__(self):
        return sum(1 for _ in self)


_Base = _cloudpickle.Pickler if _cloudpickle else pickle.Pickler


class _Pickler(_Base):
    """Pickles by value what cannot be found by name (lambdas, closures, local functions),
    and a function or class of the main module by name with a copy by value beside it (see
    ``_main_reduction``); tensors, arrays and tensorshare queues inside become persistent ids
    (indices into a list that travels beside the pickle as handles). ``by_value``: a copy's
    pickler, which pickles the main module's functions and classes by value only."""

    # Read by the pickler for each object of a class it has no other way for: cloudpickle's
    # table (with copyreg's) first, then multiprocessing's.
    dispatch_table = collections.ChainMap(
        _cloudpickle.Pickler.dispatch_table if _cloudpickle else copyreg.dispatch_table,
        _MultiprocessingReducers(),
    )

    def __init__(self, file, inner, by_value=False):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._inner = inner
        self._by_value = by_value
        # The persistent id given to each object set aside, by id (pickle's memo does not
        # see them): an object met twice is one object in the receiver too.
        self._given = {}

    def persistent_id(self, obj):
        if type(obj) is _Copy:
            return ("copy", obj.data)
        given = self._given.get(id(obj))
        if given is not None:
            return given[1]
        pid = self._set_aside(obj)
        if pid is not None:
            self._given[id(obj)] = (obj, pid)  # obj kept, so that its id is not reused
        return pid

    def _set_aside(self, obj):
        if isinstance(obj, (_native.Queue, _native.Connection)) or tensor_parts_cheap(obj):
            self._inner.append(obj)
            return len(self._inner) - 1
        torch = _torch()
        if torch is not None and isinstance(obj, (torch.UntypedStorage, torch.TypedStorage)):
            # A storage travels as a uint8 tensor over all its bytes, so it is shared, not
            # copied.
            typed = isinstance(obj, torch.TypedStorage)
            untyped = obj._untyped_storage if typed else obj  # (TypedStorage's own getters warn)
            # Any dtype: its bytes travel, and its dtype by name (a complex storage, which
            # no handle's dtype is, too: refused here, torch's pickling copied it).
            if untyped.device.type != "cpu":
                return None
            if not _is_ours(untyped) and torch_shares(torch, untyped):
                return None  # torch's own reduction (reducer_override)
            # Its bytes, whatever its dtype: a storage inside a block starts at any byte.
            view = torch.empty(0, dtype=torch.uint8)
            view.set_(untyped)
            self._inner.append(view)
            return ("storage", len(self._inner) - 1, str(obj.dtype).removeprefix("torch.") if typed else None)
        return None

    def reducer_override(self, obj):
        reduced = torch_reduction(obj)
        if reduced is None:
            reduced = _array_view_reduction(obj)
        if reduced is not None:
            return reduced
        if _cloudpickle is None:
            return NotImplemented
        if not self._by_value and _named_in_main(obj):
            return _main_reduction(obj, self._inner)
        return super().reducer_override(obj)


_MAIN_MODULES = ("__main__", "__mp_main__")


def _in_main(qualname):
    """What ``qualname`` names in this process's main module, or None."""
    obj = sys.modules.get("__main__")
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _named_in_main(obj):
    """Whether ``obj`` is a function or class of the main module that its name finds there
    (not a lambda, a local function or one defined again under the same name)."""
    return (
        isinstance(obj, (types.FunctionType, type))
        and getattr(obj, "__module__", None) in _MAIN_MODULES
        and "<" not in getattr(obj, "__qualname__", "<")
        and _in_main(obj.__qualname__) is obj
    )


class _Copy:
    """A copy by value of a main module's function or class (its pickle, or None where it
    has none), travelling as a persistent id beside the name (see ``_main_reduction``)."""

    __slots__ = ("data", "inner")

    def __init__(self, data, inner=None):
        self.data, self.inner = data, inner


def _main_reduction(obj, inner):
    """How a function or class of the main module travels: by its name, as ``pickle`` and
    multiprocessing send it, so that a process whose main module has it uses its own (a
    Pool's workers see the globals their initializer set, a class is the one the receiver's
    ``isinstance`` knows); with a copy by value beside the name, for a process whose main
    module lacks it (a main module that is no file, such as ``python -c``, under spawn). A
    function whose copy cannot be pickled (one whose globals hold a lock) travels by name
    alone, as with multiprocessing."""
    start = len(inner)
    buf = io.BytesIO()
    try:
        _Pickler(buf, inner, by_value=True).dump(obj)
        data = buf.getvalue()
    except Exception:
        del inner[start:]
        data = None
    return (_from_main, (obj.__qualname__, _Copy(data), _where(obj)))


def _where(obj):
    """Where a function was defined (its file's name and first line; None for a class):
    what tells the receiver's function of that name apart from another of the same name
    (one defined again under ``if __name__ == "__main__":``, a notebook cell run again).
    The file's name only: a spawned child runs the main script by its absolute path, which
    the parent may have been given relative."""
    code = getattr(obj, "__code__", None)
    return None if code is None else (os.path.basename(code.co_filename), code.co_firstlineno)


def _from_main(qualname, copy, where=None):
    """The main module's ``qualname`` in this process, when it is a function or class of
    that name defined where the sender's was; or else its copy by value."""
    found = _in_main(qualname)
    if (
        isinstance(found, (types.FunctionType, type))
        and getattr(found, "__module__", None) in _MAIN_MODULES
        and getattr(found, "__qualname__", None) == qualname
        and _where(found) == where
    ):
        return found
    if copy.data is None:
        raise pickle.UnpicklingError(
            f"{qualname} is not in this process's main module, and it could not be sent by "
            "value (its pickling failed in the sender)"
        )
    return loads(copy.data, copy.inner)


def tensor_parts_cheap(obj):
    """Whether ``obj`` is a tensor or an array that travels as a handle. For a torch tensor
    the native side answers, from torch's C getters (whatever a program has done to
    ``torch.Tensor``'s attributes), as it decides when it sends the tensor."""
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        return _native.is_tensor_handle(obj)
    np = _numpy()
    return np is not None and type(obj) is np.ndarray and _travels_as_handle(obj)


def _rebuild_tensor_v3(storage, *args, **kwargs):
    """torch's ``_rebuild_tensor_v3``, given the storage as torch's own loaders give it.

    torch pickles a tensor of a dtype ``TypedStorage`` lacks (uint16, uint32, uint64, the
    float8 kinds, ...) with its ``UntypedStorage`` and rebuilds it with
    ``storage._untyped_storage``, since ``torch.load`` hands it a ``TypedStorage``; the
    storage arrives here as what it was, an ``UntypedStorage`` (shared, over its block), so
    it is wrapped as ``torch.load`` wraps it."""
    torch = _torch()
    if isinstance(storage, torch.UntypedStorage):
        dtype = kwargs["dtype"] if "dtype" in kwargs else args[5]
        storage = torch.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
    return torch._utils._rebuild_tensor_v3(storage, *args, **kwargs)


# The storages received as parts of blocks, by (address, bytes): one storage object for
# each part while it lives, as torch gives one storage for each storage it receives. (The
# items of a list are pickled each on its own, so an unpickler's own memo does not see a
# part that two of them name.) Its parts hold their blocks, so no other block is at their
# address while they live.
_parts = weakref.WeakValueDictionary()


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, inner):
        super().__init__(file)
        self._inner = inner

    def find_class(self, module, name):
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _rebuild_tensor_v3
        return super().find_class(module, name)

    def persistent_load(self, pid):
        try:
            if isinstance(pid, tuple) and len(pid) == 2 and pid[0] == "copy":
                return _Copy(pid[1], self._inner)
            if isinstance(pid, tuple) and len(pid) == 3 and pid[0] == "storage":
                storage = self._storage(pid[1])
                if pid[2] is None:
                    return storage
                dtype = getattr(_torch(), pid[2], None) if isinstance(pid[2], str) else None
                if not isinstance(dtype, _torch().dtype):
                    raise TypeError(f"no torch dtype {pid[2]!r}")
                return _torch().TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
            return self._inner[pid]
        except (IndexError, TypeError, AttributeError):
            if isinstance(pid, tuple) and pid[:1] == ("storage",) and _torch() is None:
                raise pickle.UnpicklingError(
                    "the value holds torch storages (a tensor of a dtype numpy lacks, or a storage), "
                    "and torch is not imported in this process: install or import torch to receive it"
                ) from None
            raise pickle.UnpicklingError(f"a pickle named object {pid!r}, which its message lacks") from None

    def _storage(self, index):
        """The storage set aside as view ``index``. A storage that lay inside a block
        at its sender (``torch.from_numpy`` of a view into the middle of a shared array)
        arrives as a view of the block's storage: the part of it that view covers, sharing
        its memory, one storage object for each such part while it lives, however often
        and in however many messages it is named (see ``_parts``; a storage over a whole
        block is the block's own, one object already)."""
        view = self._inner[index]
        storage = view.untyped_storage()
        item = view.element_size()  # (1: the sender sets aside bytes)
        start, n = view.storage_offset() * item, view.numel() * item
        if start == 0 and n == storage.nbytes():
            return storage
        if n == 0:
            return _torch().UntypedStorage(0)
        key = (storage.data_ptr() + start, n)
        part = _parts.get(key)
        # One that torch gave other memory since is no longer that part.
        if part is None or part.data_ptr() != key[0] or part.nbytes() != n:
            # Over the block itself, which it keeps alive: not a slice of the block's torch
            # storage, which holds that storage and not the block (torch may give the
            # storage other memory, its share_memory_() does, and the block would go while
            # the part still pointed into it).
            part = _native.block_part(storage.data_ptr(), start, n)
            _parts[key] = part
        return part


class _OneWay:
    """What an end of a one-way pipe is pickled as (see ``one_way_pickle``)."""

    __slots__ = ("readable",)

    def __init__(self, readable):
        self.readable = readable

    def __reduce__(self):
        return (one_way_end, (_THE_END, self.readable))


_THE_END = object()  # the end itself, in the pickle of a one-way end: persistent id 0


class _OneWayPickler(pickle.Pickler):
    def persistent_id(self, obj):
        return 0 if obj is _THE_END else None


def one_way_pickle(readable):
    """The pickle beside which an end of a one-way pipe travels (the wire's ends are
    duplex): a call of ``one_way_end`` on the end, which is the message's object 0."""
    buf = io.BytesIO()
    _OneWayPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(_OneWay(readable))
    return buf.getvalue()


def one_way_end(end, readable):
    """A received end of a one-way pipe, reading only (``readable``) or writing only, as
    multiprocessing's ends stay wherever they travel."""
    if not isinstance(end, _native.Connection) or type(readable) is not bool:
        raise pickle.UnpicklingError("a one-way end of a pipe arrived without its end")
    return end._one_way(readable)


def dumps(obj):
    """``obj`` pickled by value, and the tensors, arrays and queues it holds."""
    inner = []
    buf = io.BytesIO()
    try:
        _Pickler(buf, inner).dump(obj)
    except Exception as e:
        raise TypeError(f"cannot send {_describe(obj)}: {type(e).__name__}: {e}") from e
    return buf.getvalue(), inner


def loads(data, inner):
    return _Unpickler(io.BytesIO(data), inner).load()


def _describe(obj):
    if type(obj) is OnePickle:
        return f"the target and arguments of a process {reprlib.repr(obj.value)}"
    return f"{type(obj).__qualname__} {reprlib.repr(obj)}"


class OnePickle:
    """A value pickled whole, in one pickle (tensors and queues inside still as handles), as
    multiprocessing pickles a process it starts: objects that share an object then share it
    in the child too, and a descriptor that multiprocessing passes for it is passed once. A
    process's arguments converted item by item were pickled each on its own: a ``Value`` and
    an ``Array`` of one heap arena passed the arena's descriptor twice, which failed the
    start, and the child would have closed it twice."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __reduce__(self):
        return (OnePickle, (self.value,))
