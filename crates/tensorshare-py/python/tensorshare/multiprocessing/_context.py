"""Contexts whose queues carry tensors as handles into tensorshare arenas and whose
processes take lambdas and closures."""

import multiprocessing
import multiprocessing.context
import multiprocessing.pool
import os
import sys
import threading

from .. import _native, _reduction
from . import _queues

_lock = threading.Lock()
_contexts = {}
# The descriptors of a child's arguments close once it is started (see _export_for_child).
_reduction.release_parcels_at_launch()
# Names the cleanup group a process joins (tensorshare's `shm::group`).
_SHM_GROUP_ENV = "TENSORSHARE_SHM_GROUP"


class _GroupEnv:
    """The cleanup group in this process's environment while processes start (see
    ``_start_in_group``), in as many threads as start them at once (``spawn`` with
    ``TORCH_MP_PARALLEL_START``): the variable is set by the first start and given back by
    the last, so that no start ends another's window early, and none leaves it set."""

    def __init__(self):
        self._reset()
        # A fork child has this thread alone: another thread's start, or its lock, is none
        # of its own.
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self):
        self._lock = threading.Lock()
        self._starts = 0
        self._before = None

    def enter(self, group):
        with self._lock:
            if self._starts == 0:
                self._before = os.environ.get(_SHM_GROUP_ENV)
            self._starts += 1
            os.environ[_SHM_GROUP_ENV] = group

    def leave(self):
        with self._lock:
            self._starts -= 1
            if self._starts > 0:
                return
            if self._before is None:
                os.environ.pop(_SHM_GROUP_ENV, None)
            else:
                os.environ[_SHM_GROUP_ENV] = self._before


_group_env = _GroupEnv()


def _export_for_child(obj):
    """``obj`` as bytes and descriptors for the process being started (spawn or
    forkserver); the descriptors stay open until it is started
    (``_reduction.release_parcels_at_launch``)."""
    popen = multiprocessing.context.get_spawning_popen()
    if popen is None:
        raise RuntimeError(
            f"{type(obj).__name__} objects of tensorshare travel to other processes as arguments "
            "of a process being started, or through a tensorshare queue; they cannot be pickled "
            "otherwise"
        )
    data, fds, parcel = _native.export(obj)
    _reduction.keep_for_launch(popen, parcel)
    return data, [popen.DupFd(popen.duplicate_for_child(fd)) for fd in fds]


class _ByValue:
    """A value that travels to a child being started as a tensorshare message: lambdas and
    closures by value (cloudpickle), tensors and queues as handles, all of it in one pickle
    (see ``_reduction.OnePickle``)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __reduce__(self):
        return (_rebuild_by_value, _export_for_child(_reduction.OnePickle(self.value)))


def _rebuild_by_value(data, dupfds):
    return _ByValue(_reduction.import_dup_fds(data, dupfds).value)


def _allocate_batches_in_arenas():
    """In a process a tensorshare context started: torch's ``_new_shared``, which a
    DataLoader worker's collate allocates each batch with, makes CPU storages in tensorshare
    arenas, so a batch is sent without a copy and without a file in /dev/shm of its own."""
    torch = sys.modules.get("torch")
    if torch is None or getattr(torch.UntypedStorage, "_tensorshare_new_shared", False):
        return
    original = torch.UntypedStorage._new_shared.__func__

    def _new_shared(cls, size, *, device="cpu"):
        if cls is torch.UntypedStorage and torch.device(device).type == "cpu":
            return _reduction.torch_storage(_reduction.new_block(size))
        return original(cls, size, device=device)

    torch.UntypedStorage._new_shared = classmethod(_new_shared)
    torch.UntypedStorage._tensorshare_new_shared = True


def _keep_sigbus_handler_in_torch_workers():
    """In a process a tensorshare context started: a DataLoader worker installs torch's own
    SIGBUS handler, which ends the worker on any bus error; tensorshare's goes back on top of
    it, so that a named segment another process cut short still reads as zeros there (every
    other SIGBUS still reaches torch's handler)."""
    if os.environ.get("TENSORSHARE_SIGBUS_HANDLER", "").strip() == "0":
        return  # the process's signal handling is to stay untouched
    sh = sys.modules.get("torch.utils.data._utils.signal_handling")
    if sh is None or getattr(sh._set_worker_signal_handlers, "_tensorshare", False):
        return
    original = sh._set_worker_signal_handlers

    def _set_worker_signal_handlers(*args, **kwargs):
        original(*args, **kwargs)
        _native.guard_sigbus()

    _set_worker_signal_handlers._tensorshare = True
    sh._set_worker_signal_handlers = _set_worker_signal_handlers


class ByValueMixin:
    """Sends a process's target and arguments to the child by value (a lambda, a closure, a
    local function), with tensors and queues as handles."""

    def __getstate__(self):
        state = self.__dict__.copy()
        payload = (state.pop("_target", None), state.pop("_args", ()), state.pop("_kwargs", {}))
        state["_tensorshare_payload"] = _ByValue(payload)
        # The cleanup group of the parent's named segments, which the child joins: its
        # environment is not the parent's (the fork server's is its own), and without it
        # every child would found a group, and start a cleaner, of its own.
        state["_tensorshare_shm_group"] = _native.shm_group_for_workers()
        return state

    def __setstate__(self, state):
        group = state.pop("_tensorshare_shm_group", None)
        if group is not None:
            os.environ[_SHM_GROUP_ENV] = str(group)
        payload = state.pop("_tensorshare_payload").value
        self.__dict__.update(state)
        self._target, self._args, self._kwargs = payload

    def start(self):
        try:
            self._start_in_group()
        finally:
            # Closed by the start already (`_reduction.release_parcels_at_launch`), unless
            # this Python's Popen classes could not be wrapped: then here, once started.
            popen = getattr(self, "_popen", None)
            if popen is not None:
                popen.__dict__.pop("_tensorshare_parcels", None)

    def _start_in_group(self):
        # The group is in the environment the child starts with (and a fork server started
        # now), for as long as it takes to start it: a child whose main module makes a named
        # segment on import, before it reads its state, joins it too. Not left there, or
        # every later subprocess of this process, related or not, would join the group.
        group = _native.shm_group_for_workers()
        if group is None:
            return super().start()
        _group_env.enter(str(group))
        try:
            return super().start()
        finally:
            _group_env.leave()

    def _bootstrap(self, *args, **kwargs):
        _allocate_batches_in_arenas()
        _keep_sigbus_handler_in_torch_workers()
        # Its puts on queues it inherited by fork go through an outbox of its own, never
        # waiting; it writes that outbox out before it leaves (below).
        _native.adopt_forked_queues()
        try:
            return super()._bootstrap(*args, **kwargs)
        finally:
            # A fork or fork server child ends in os._exit, which runs no exit handler. What it
            # put that still waits in its outbox is written out first, while another process
            # could read it (as multiprocessing's queues join their feeder threads); then the
            # names of the named segments it made go (whoever holds one keeps its memory).
            try:
                _native.flush_queues()
            finally:
                _native.unlink_own_names()


class ForkProcess(ByValueMixin, multiprocessing.context.ForkProcess):
    """A process started by fork."""


class SpawnProcess(ByValueMixin, multiprocessing.context.SpawnProcess):
    """A process started by spawn: its target and arguments go by value."""


class ForkServerProcess(ByValueMixin, multiprocessing.context.ForkServerProcess):
    """A process started by the fork server: its target and arguments go by value."""


_PROCESSES = {"fork": ForkProcess, "spawn": SpawnProcess, "forkserver": ForkServerProcess}


def reduce_native(q):
    """How a native queue or pipe end is pickled outside tensorshare's own messages: only
    as an argument of a process being started."""
    return (_rebuild_native, _export_for_child(q))


def _rebuild_native(data, dupfds):
    return _reduction.import_dup_fds(data, dupfds)


class TensorshareContext(multiprocessing.context.BaseContext):
    """A multiprocessing context (``get_context("spawn")`` and the rest) whose ``Queue``,
    ``SimpleQueue``, ``JoinableQueue``, ``Pipe`` and ``Pool`` carry torch tensors and numpy arrays as
    handles into tensorshare arenas, and whose ``Process`` sends lambdas and closures. It is a
    ``BaseContext``, so ``DataLoader(..., multiprocessing_context=ctx)`` takes it."""

    def __init__(self, method):
        base = multiprocessing.get_context(method)
        self._base = base
        self._name = base._name
        self._actual_context = self
        self.Process = _PROCESSES[self._name]

    def get_context(self, method=None):
        if method is None:
            return self
        return get_context(method)

    def get_start_method(self, allow_none=False):
        return self._name

    def set_start_method(self, method, force=False):
        raise ValueError("cannot set the start method of a concrete context")

    def Queue(self, maxsize=0):
        return _queues.Queue(maxsize, ctx=self)

    def SimpleQueue(self):
        return _queues.SimpleQueue(ctx=self)

    def JoinableQueue(self, maxsize=0):
        return _queues.JoinableQueue(maxsize, ctx=self)

    def Pipe(self, duplex=True):
        return _native.new_pipe(duplex)

    def Pool(self, processes=None, initializer=None, initargs=(), maxtasksperchild=None):
        return multiprocessing.pool.Pool(processes, initializer, initargs, maxtasksperchild, context=self)

    def __repr__(self):
        return f"<tensorshare context {self._name!r}>"


def get_context(method=None):
    """The tensorshare context of start method ``method`` (``None``: the current default)."""
    if method is None:
        method = multiprocessing.get_start_method()
    with _lock:
        ctx = _contexts.get(method)
        if ctx is None:
            ctx = _contexts[method] = TensorshareContext(method)
        return ctx
