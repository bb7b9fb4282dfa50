"""A drop-in for ``torch.multiprocessing``: change ``import torch.multiprocessing as mp`` to
``import tensorshare.multiprocessing as mp``.

Everything ``multiprocessing`` offers is here under the same names, as in torch's module,
with these differences, which are the point:

- ``Queue``, ``SimpleQueue``, ``JoinableQueue``, ``Pipe``, ``Pool`` and every context from
  ``get_context`` carry torch tensors and numpy arrays as handles into tensorshare arenas:
  a few descriptors per process in all, not one per storage; no ``/dev/shm`` file per tensor;
  messages that do not need their sender to stay alive; a clear ``MemoryError`` rather than a
  bus error when shared memory runs out. (A CPU tensor in none of them that torch before 2.12
  cannot move into one, or that torch has in its own shared memory already, is sent the way
  torch sends it.)
- Processes, ``spawn`` and pools take lambdas, closures and local functions, with every
  start method (they travel by value, pickled with cloudpickle).
- A context is a ``multiprocessing`` context: ``DataLoader(..., multiprocessing_context=
  tensorshare.multiprocessing.get_context("spawn"))`` takes it.
"""

import ctypes as _ctypes
import multiprocessing as _mp
import os as _os
from multiprocessing import *  # noqa: F401,F403

from .. import _native, _reduction
from ._context import ByValueMixin as _ByValueMixin
from ._context import TensorshareContext, _keep_sigbus_handler_in_torch_workers, get_context
from .spawn import (
    ENV_VAR_PARALLEL_START,  # noqa: F401 (torch.multiprocessing has it, not in its __all__)
    ProcessContext,
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
    SpawnContext,
    spawn,
    start_processes,
)

__all__ = [
    "set_sharing_strategy",
    "get_sharing_strategy",
    "get_all_sharing_strategies",
    "TensorshareContext",
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "SpawnContext",
    "spawn",
    "start_processes",
]
__all__ += _mp.__all__


def set_sharing_strategy(new_strategy):
    """Sets how shared memory is made: ``"file_descriptor"`` (memfd arenas, nothing to leak;
    the default) or ``"file_system"`` (named arenas in /dev/shm, swept when their processes
    die). torch's own strategy too, as ``torch.multiprocessing``'s setter sets it: torch's own
    queues and a DataLoader given no ``multiprocessing_context`` follow it."""
    if new_strategy not in _native.get_all_sharing_strategies():
        raise ValueError(f"unknown sharing strategy {new_strategy!r}")
    _native.set_sharing_strategy(new_strategy)
    _reduction.set_torch_strategy(new_strategy)
    # Named segments from here on, most likely with torch imported by now.
    _keep_sigbus_handler_in_torch_workers()


def get_sharing_strategy():
    """The current sharing strategy."""
    return _native.get_sharing_strategy()


def get_all_sharing_strategies():
    """The sharing strategies this system offers."""
    return set(_native.get_all_sharing_strategies())


class Process(_ByValueMixin, _mp.Process):
    """``multiprocessing.Process`` of the current default start method; its target and
    arguments may be lambdas and closures, and tensors in them travel as handles."""

    @staticmethod
    def _Popen(process_obj):
        return _mp.get_context().Process._Popen(process_obj)


def Queue(maxsize=0):
    """A queue of the default context (see ``get_context``)."""
    return get_context().Queue(maxsize)


def SimpleQueue():
    """A simple queue of the default context."""
    return get_context().SimpleQueue()


def JoinableQueue(maxsize=0):
    """A joinable queue of the default context."""
    return get_context().JoinableQueue(maxsize)


def Pipe(duplex=True):
    """A pair of connected ends (``(reader, writer)`` when not ``duplex``): tensors and arrays
    travel as handles."""
    return _native.new_pipe(duplex)


def Pool(processes=None, initializer=None, initargs=(), maxtasksperchild=None):
    """A pool of the default context: its functions may be lambdas."""
    return get_context().Pool(processes, initializer, initargs, maxtasksperchild)


def _set_thread_name(name):
    """Names the calling thread (the kernel keeps its first 15 bytes), as torch's
    ``_set_thread_name`` does, from a str or bytes; without torch too."""
    if isinstance(name, str):
        name = name.encode()
    elif not isinstance(name, bytes):
        raise TypeError(f"a thread's name is a str or bytes, not {type(name).__name__}")
    _prctl_name(_PR_SET_NAME, _ctypes.create_string_buffer(name[:15], 16))


def _get_thread_name():
    """The calling thread's name, as torch's ``_get_thread_name`` gives it (a character the
    kernel's 15 bytes cut in two reads as U+FFFD, where torch's raises)."""
    buf = _ctypes.create_string_buffer(16)
    _prctl_name(_PR_GET_NAME, buf)
    return buf.value.decode(errors="replace")


_PR_SET_NAME, _PR_GET_NAME = 15, 16


def _prctl_name(option, buf):
    libc = _ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, buf, 0, 0, 0) != 0:
        err = _ctypes.get_errno()
        raise OSError(err, f"prctl: {_os.strerror(err)}")


# What torch.multiprocessing has beside the names above, torch's own (the reductions torch's
# queues use, which importing tensorshare teaches to send arena storages as handles): looked
# up in torch when first asked for, so that importing this module never imports torch.
_FROM_TORCH = ("reductions", "init_reductions", "_prctl_pr_set_pdeathsig")


def __getattr__(name):
    if name in _FROM_TORCH:
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            raise AttributeError(f"{__name__}.{name} is torch's, and torch is not installed")
        import torch.multiprocessing

        return getattr(torch.multiprocessing, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Workers that torch's own contexts fork from this process inherit the wrapper.
_keep_sigbus_handler_in_torch_workers()
