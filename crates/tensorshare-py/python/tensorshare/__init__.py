"""tensorshare for Python: tensors shared between processes through arenas of shared memory.

``import tensorshare.multiprocessing as mp`` is a drop-in for ``torch.multiprocessing``; this
module has the pieces under it:

- ``empty_shared(shape, dtype)`` and ``empty_shared_array(shape, dtype)``: a torch tensor or a
  numpy array in shared memory, sent without a copy;
- ``share_memory_(t)``: moves a tensor's storage into shared memory, in place for ``t``;
- ``roundtrip(obj)``: ``obj`` as another process would receive it (for checking what a value
  becomes on the wire).

Queues carry values to Rust processes too: see ``tensorshare::Value`` in the Rust crate.
"""

from ._native import (
    Block,
    InvalidMessage,
    TensorshareError,
    get_all_sharing_strategies,
    get_sharing_strategy,
    roundtrip,
    set_sharing_strategy,
)
from ._reduction import new_block as _new_block

__all__ = [
    "Block",
    "InvalidMessage",
    "TensorshareError",
    "empty_shared",
    "empty_shared_array",
    "share_memory_",
    "get_all_sharing_strategies",
    "get_sharing_strategy",
    "roundtrip",
    "set_sharing_strategy",
]


def empty_shared(shape, dtype=None):
    """An uninitialised torch tensor of ``shape`` in shared memory (default dtype: torch's)."""
    import torch

    from ._reduction import torch_storage

    dtype = dtype or torch.get_default_dtype()
    shape = tuple(shape) if not isinstance(shape, int) else (shape,)
    numel = 1
    for n in shape:
        numel *= n
    item = torch.empty(0, dtype=dtype).element_size()
    t = torch.empty(0, dtype=dtype)
    t.set_(torch_storage(_new_block(numel * item)), 0, shape)
    return t


def empty_shared_array(shape, dtype="float32"):
    """An uninitialised numpy array of ``shape`` in shared memory."""
    import numpy as np

    dt = np.dtype(dtype)
    shape = tuple(shape) if not isinstance(shape, int) else (shape,)
    numel = 1
    for n in shape:
        numel *= n
    if numel == 0:
        return np.empty(shape, dt)
    return np.ndarray(shape, dt, buffer=_new_block(numel * dt.itemsize))


def share_memory_(t):
    """Moves ``t``'s storage into shared memory (a no-op when it is there); returns ``t``.

    The move is in place for ``t`` (and what later views of it); other tensors that viewed
    its old storage keep the old memory, so call this before taking views."""
    from ._reduction import _block_of_torch

    _block_of_torch(t)
    return t
