"""tensorshare for Python: tensors shared between processes through arenas of shared memory.

``import tensorshare.multiprocessing as mp`` is a drop-in for ``torch.multiprocessing``; this
module has the pieces under it:

- ``empty_shared(shape, dtype)`` and ``empty_shared_array(shape, dtype)``: a torch tensor or a
  numpy array in shared memory, sent without a copy;
- ``share_memory_(t)``: moves a tensor's storage into shared memory, in place for ``t``;
- ``roundtrip(obj)``: ``obj`` as another process would receive it (for checking what a value
  becomes on the wire);
- ``trim_arenas()``: gives back the shared memory this process keeps for reuse (free arenas,
  and arenas received and kept mapped), and with it, under the ``file_system`` strategy, its
  room in /dev/shm.

Queues carry values to Rust processes too: see ``tensorshare::Value`` in the Rust crate.
"""

from multiprocessing import util as _mp_util

from . import _native
from ._native import (
    Block,
    InvalidMessage,
    TensorshareError,
    get_all_sharing_strategies,
    get_sharing_strategy,
    roundtrip,
    set_sharing_strategy,
    trim_arenas,
)
from ._reduction import install_torch_hook as _install_torch_hook
from ._reduction import new_block as _new_block

_install_torch_hook()
# A queue the GC let go with values this process could not write yet is dropped on a thread
# of its own, which writes them on; the process waits for those before it leaves, where
# multiprocessing joins its queues' feeder threads (after ending its daemonic children).
_mp_util.Finalize(None, _native.wait_dropped_queues, exitpriority=-5)

__all__ = [
    "Block",
    "InvalidMessage",
    "TensorshareError",
    "cuda_empty_cache",
    "empty_shared",
    "empty_shared_array",
    "share_memory_",
    "get_all_sharing_strategies",
    "inherited",
    "popen",
    "get_sharing_strategy",
    "roundtrip",
    "set_sharing_strategy",
    "trim_arenas",
]


def _shape(shape):
    """``shape`` as a tuple of ints: one size (an int or a numpy integer, as torch.empty and
    numpy.empty take it) or an iterable of them."""
    import operator

    try:
        return (operator.index(shape),)
    except TypeError:
        return tuple(operator.index(n) for n in shape)


def _refuse_negative(shape):
    """torch's error for a negative size, where ``shape`` has one."""
    if any(n < 0 for n in shape):
        raise RuntimeError(f"Trying to create tensor with negative dimension {min(shape)}: {list(shape)}")


def empty_shared(shape, dtype=None, device=None):
    """An uninitialised torch tensor of ``shape`` in shared memory (default dtype: torch's).

    ``device``: ``None`` or ``"cpu"`` for host memory; a CUDA device (``"cuda"``,
    ``"cuda:1"``, a ``torch.device``) for memory on that GPU, one allocation of tensorshare's
    own per tensor, which travels as a tensorshare handle rather than torch's CUDA IPC: a
    process that received it may send it on (torch refuses), a Rust process may send or
    receive it, and a consumer killed while holding it gives it back at once. Its creator
    must outlive the processes that use it, as with torch's CUDA tensors. Needs the CUDA
    driver (torch's own CUDA tensors need none of this)."""
    # The common case first, with nothing imported on its way: a tensor sender makes one
    # per message.
    if dtype is None:
        import torch

        dtype = torch.get_default_dtype()
    if type(shape) is not tuple:
        shape = _shape(shape)
    if device is not None:
        index = _cuda_index(device)
        if index is not None:
            _refuse_negative(shape)
            return _native.empty_shared_cuda(shape, dtype, index)
    try:
        t = _native.empty_shared_tensor(shape, dtype)
    except OverflowError:
        _refuse_negative(shape)
        raise
    if t is not None:
        return t
    _refuse_negative(shape)
    import torch

    from ._reduction import torch_storage

    numel = 1
    for n in shape:
        numel *= n
    item = torch.empty(0, dtype=dtype).element_size()
    t = torch.empty(0, dtype=dtype)
    t.set_(torch_storage(_new_block(numel * item)), 0, shape)
    return t


def cuda_empty_cache():
    """Gives the CUDA memory of tensorshare's tensors (``empty_shared(..., device="cuda")``)
    that this process made and that nothing holds any more back to the driver, and returns
    how many bytes it gave. A consumer that exited or was killed while holding such a tensor
    has let go of it; this process keeps freed allocations for its next CUDA tensors
    otherwise. (torch's own CUDA memory is ``torch.cuda.empty_cache()``'s.)"""
    return _native.cuda_empty_cache()


def _cuda_index(device):
    """The index of CUDA device ``device``, None for the CPU; an error for any other."""
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        raise ValueError(f"tensorshare makes tensors on the CPU and on CUDA devices, not on {device}")
    return torch.cuda.current_device() if device.index is None else device.index


def empty_shared_array(shape, dtype="float32"):
    """An uninitialised numpy array of ``shape`` in shared memory, of a dtype of plain
    data: not one holding Python objects, whose pointers mean nothing in another process."""
    import numpy as np

    dt = np.dtype(dtype)
    if dt.hasobject:
        raise TypeError(
            f"shared memory cannot hold Python objects (dtype {dt}): their pointers mean nothing "
            "in another process; use a dtype of plain data"
        )
    shape = _shape(shape)
    if any(n < 0 for n in shape):
        raise ValueError("negative dimensions are not allowed")
    numel = 1
    for n in shape:
        numel *= n
    if numel == 0:
        return np.empty(shape, dt)
    return np.ndarray(shape, dt, buffer=_new_block(numel * dt.itemsize))


def share_memory_(t):
    """Moves ``t``'s storage into shared memory (a no-op when it is there); returns ``t``.

    The move is in place, as torch's own ``share_memory_()``: the storage takes the new
    memory, so every torch tensor viewing it, taken before or after, follows. Moving into a
    tensorshare block needs torch >= 2.12 (``UntypedStorage._swap_data_ptr_``); an older
    torch moves the storage into its own shared memory instead (its ``share_memory_()``),
    and queues send it the way torch sends it. A storage already in torch's own shared
    memory stays there (other processes may map it), as torch's ``share_memory_()`` leaves it,
    and so does a file torch maps shared (``torch.from_file(..., shared=True)``), whose writes
    must go on reaching the file (a queue refuses to send such a tensor: send a copy).

    What views the old memory outside torch does not follow: a numpy array (``t.numpy()``)
    or a DLPack capsule taken before the move views the old memory, which is freed with the
    move, exactly as with torch's ``share_memory_()``. Take those after the move (or after
    the tensor's first ``put``, which moves it the same way)."""
    from ._reduction import _is_ours, _torch, maps_file_shared, move_storage, torch_shares

    storage = t.untyped_storage()
    if _is_ours(storage):
        return t
    if torch_shares(_torch(), storage) or maps_file_shared(storage):
        t.share_memory_()  # torch's own, which leaves its own shared memory as it is
    else:
        move_storage(storage)
    return t


HANDOFF_VAR = "TENSORSHARE_HANDOFF"

# Most bytes of a value handed to a process in its environment as hex (Rust's
# tensorshare::message::ENV_INLINE_MAX); a larger one's bytes go in a memfd.
ENV_INLINE_MAX = 16 << 10


def popen(args, value, var=HANDOFF_VAR, **kwargs):
    """Starts ``args`` (a Rust program, or any program using tensorshare) with ``value``
    handed to it: a queue, a tuple of queues, tensors, any value. The child's descriptors
    for it are inherited, and the environment variable ``var`` describes them; a Rust child
    reads it with ``unsafe { tensorshare::Message::from_env(var) }?.decode::<Value>()``, a
    Python child with ``tensorshare.inherited(var)``. Returns the ``subprocess.Popen``."""
    import os
    import subprocess

    data, fds, parcel = _native.export(value)
    env = kwargs.pop("env", None)
    env = dict(os.environ if env is None else env)
    handed = list(fds)
    file = None
    try:
        if len(data) <= ENV_INLINE_MAX:
            env[var] = data.hex() + ":" + ",".join(str(fd) for fd in fds)
        else:
            # Linux caps one environment string at 128 KiB: the bytes go in a memfd the
            # child inherits, as Rust's Message::pass_to hands them, sealed so that what
            # the child reads is what was written.
            import fcntl

            file = os.memfd_create("tensorshare-handoff", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            handed.append(file)
            view = memoryview(data)
            while view:
                view = view[os.write(file, view) :]
            seals = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
            fcntl.fcntl(file, fcntl.F_ADD_SEALS, seals)
            env[var] = f"@{file}:" + ",".join(str(fd) for fd in fds)
        pass_fds = tuple(kwargs.pop("pass_fds", ())) + tuple(handed)
        return subprocess.Popen(args, env=env, pass_fds=pass_fds, **kwargs)
    finally:
        del parcel  # the child has its own descriptors now
        if file is not None:
            os.close(file)


def inherited(var=HANDOFF_VAR):
    """The value a parent handed to this process with ``popen`` (or Rust's
    ``Message::pass_to``), read once from the environment variable ``var``."""
    import contextlib
    import os

    text = os.environ.pop(var)
    data, _, fds = text.partition(":")
    # The whole text is read before any descriptor it names is touched: a malformed one
    # (not written by popen or pass_to) may name descriptors this process uses otherwise,
    # such as its stdout, which are then left alone.
    fds = [int(f) for f in fds.split(",") if f]
    file = int(data[1:]) if data.startswith("@") else None
    inline = None if file is not None else bytes.fromhex(data)
    try:
        if file is not None:
            size = os.fstat(file).st_size
            parts, at = [], 0
            while at < size:  # read at offsets: the description is shared with the parent
                part = os.pread(file, size - at, at)
                if not part:
                    raise OSError(
                        f"the bytes of a value handed to this process in descriptor {file} were cut"
                    )
                parts.append(part)
                at += len(part)
            return _native.import_(b"".join(parts), fds)
        return _native.import_(inline, fds)
    finally:
        for fd in fds if file is None else [*fds, file]:
            # One that is not open was reported by import_ already (it is not closed here
            # twice: import_ closes none).
            with contextlib.suppress(OSError):
                os.close(fd)
