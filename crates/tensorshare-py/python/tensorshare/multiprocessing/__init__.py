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

import multiprocessing as _mp
from multiprocessing import *  # noqa: F401,F403

from .. import _native
from ._context import ByValueMixin as _ByValueMixin
from ._context import TensorshareContext, _keep_sigbus_handler_in_torch_workers, get_context
from .spawn import (
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
    die)."""
    if new_strategy not in _native.get_all_sharing_strategies():
        raise ValueError(f"unknown sharing strategy {new_strategy!r}")
    _native.set_sharing_strategy(new_strategy)
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


# Workers that torch's own contexts fork from this process inherit the wrapper.
_keep_sigbus_handler_in_torch_workers()
