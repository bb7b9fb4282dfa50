"""``spawn``, ``start_processes`` and ``ProcessContext``, as ``torch.multiprocessing``'s,
over tensorshare contexts: ``fn`` may be a lambda or a closure."""

import concurrent.futures
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
import traceback
import warnings

from ._context import get_context

log = logging.getLogger(__name__)

# The variable torch reads to start fork-server processes in parallel.
ENV_VAR_PARALLEL_START = "TORCH_MP_PARALLEL_START"

__all__ = [
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "SpawnContext",
    "spawn",
    "start_processes",
]


class ProcessException(Exception):
    # No __slots__, unlike torch's: a class raised as both this and torch's (see
    # `_also_torchs`) can have slots from one base only.

    def __init__(self, msg: str, error_index: int, error_pid: int):
        # Not super(): in a class that is also torch's, the next __init__ is torch's, which
        # takes other arguments.
        Exception.__init__(self, msg)
        self.msg = msg
        self.error_index = error_index
        self.error_pid = error_pid

    @property
    def pid(self):
        """``error_pid``, by the name this package gave it before."""
        return self.error_pid

    def __reduce__(self):
        return _rebuild, (_plain(type(self)), (self.msg, self.error_index, self.error_pid), _is_torchs(self))


class ProcessRaisedException(ProcessException):
    """A process raised an exception; the message holds the child's traceback."""


class ProcessExitedException(ProcessException):
    """A process exited with a non-zero code or was killed by a signal."""

    def __init__(self, msg: str, error_index: int, error_pid: int, exit_code: int, signal_name=None):
        ProcessException.__init__(self, msg, error_index, error_pid)
        self.exit_code = exit_code
        self.signal_name = signal_name

    def __reduce__(self):
        args = (self.msg, self.error_index, self.error_pid, self.exit_code, self.signal_name)
        return _rebuild, (_plain(type(self)), args, _is_torchs(self))


_ALSO_TORCHS = {}


def _also_torchs(cls):
    """``cls``, or, where torch.multiprocessing has been imported, a subclass of it that is
    also torch's class of the same name: code that catches ``torch.multiprocessing``'s
    exceptions around this package's ``spawn`` catches what it raises. Decided when raising,
    so that importing this package never imports torch."""
    theirs = getattr(sys.modules.get("torch.multiprocessing.spawn"), cls.__name__, None)
    if not isinstance(theirs, type) or not issubclass(theirs, BaseException) or issubclass(cls, theirs):
        return cls
    both = _ALSO_TORCHS.get(cls)
    if both is None:
        both = type(
            cls.__name__,
            (cls, theirs),
            {
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "_tensorshare_class": cls,
            },
        )
        _ALSO_TORCHS[cls] = both
    return both


def _plain(cls):
    """This package's own class of an exception raised as torch's too (pickled by name)."""
    return cls.__dict__.get("_tensorshare_class", cls)


def _is_torchs(e):
    """Whether ``e`` was raised as torch's class too (see ``_also_torchs``)."""
    return type(e) is not _plain(type(e))


def _rebuild(cls, args, torchs=False):
    """An exception of ``cls`` unpickled (or copied): torch's class too where it was and
    torch is imported here."""
    return (_also_torchs(cls) if torchs else cls)(*args)


def _set_parent_death_signal(sig):
    """Asks Linux to send ``sig`` to this process when the thread that started it ends
    (``prctl(PR_SET_PDEATHSIG)``, as torch's children do), so that children do not outlive a
    parent that dies; nothing elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
        pass


def _wrap(fn, i, args, error_queue):
    # SIGINT when the parent dies: KeyboardInterrupt, below, ends the process quietly then.
    _set_parent_death_signal(signal.SIGINT)
    parent = os.getppid()
    try:
        fn(i, *args)
    except KeyboardInterrupt:
        # The function's own (its parent still there) is a failure like any other, as in
        # torch >= 2.15, with the exit code of a process SIGINT ended.
        if os.getppid() == parent:
            error_queue.put(traceback.format_exc())
            sys.exit(128 + signal.SIGINT)
    except Exception:
        error_queue.put(traceback.format_exc())
        sys.exit(1)


class ProcessContext:
    """The processes ``start_processes`` started; ``join`` waits for them and raises the
    first failure (after ending the others)."""

    def __init__(self, processes, error_queues):
        self.error_queues = error_queues
        self.processes = processes
        self.sentinels = {process.sentinel: index for index, process in enumerate(processes)}

    def pids(self):
        return [int(process.pid) for process in self.processes]

    def _join_procs_with_timeout(self, timeout: float):
        end = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0.0, end - time.monotonic()))

    def join(self, timeout=None, grace_period=None):
        """Whether every process has ended (True) or not yet (False, after ``timeout``); a
        failed process raises ``ProcessRaisedException`` or ``ProcessExitedException``, once
        the others have ended: they get ``grace_period`` seconds to end by themselves, then
        SIGTERM and as long again (30 s without a grace period), then SIGKILL."""
        if len(self.sentinels) == 0:
            return True
        ready = multiprocessing.connection.wait(self.sentinels.keys(), timeout=timeout)
        error_index = None
        for sentinel in ready:
            index = self.sentinels.pop(sentinel)
            process = self.processes[index]
            process.join()
            if process.exitcode != 0:
                error_index = index
                break
        if error_index is None:
            return len(self.sentinels) == 0
        # End the others: a grace period for them to end by themselves, then SIGTERM, another
        # grace period (30 s without one), then SIGKILL.
        if grace_period is not None:
            self._join_procs_with_timeout(grace_period)
        for process in self.processes:
            if process.is_alive():
                log.warning("Terminating process %s via signal SIGTERM", process.pid)
                process.terminate()
        self._join_procs_with_timeout(30 if grace_period is None else grace_period)
        for process in self.processes:
            if process.is_alive():
                log.warning(
                    "Unable to shutdown process %s via SIGTERM, forcefully exiting via SIGKILL", process.pid
                )
                process.kill()
            process.join()
        failed = self.processes[error_index]
        exitcode = failed.exitcode
        if self.error_queues[error_index].empty():
            if exitcode < 0:
                try:
                    name = signal.Signals(-exitcode).name
                except ValueError:  # a signal without a name (a real-time one)
                    name = f"<Unknown signal {-exitcode}>"
                raise _also_torchs(ProcessExitedException)(
                    f"process {error_index} terminated with signal {name}",
                    error_index=error_index,
                    error_pid=failed.pid,
                    exit_code=exitcode,
                    signal_name=name,
                )
            raise _also_torchs(ProcessExitedException)(
                f"process {error_index} terminated with exit code {exitcode}",
                error_index=error_index,
                error_pid=failed.pid,
                exit_code=exitcode,
            )
        original_trace = self.error_queues[error_index].get()
        msg = f"\n\n-- Process {error_index} terminated with the following error:\n" + original_trace
        raise _also_torchs(ProcessRaisedException)(msg, error_index, failed.pid)


class SpawnContext(ProcessContext):
    def __init__(self, processes, error_queues):
        warnings.warn("SpawnContext is renamed to ProcessContext since 1.4 release.", stacklevel=2)
        super().__init__(processes, error_queues)


def start_processes(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
    """Runs ``fn(i, *args)`` for ``i`` in ``range(nprocs)``, each in a process started by
    ``start_method``; ``fn`` may be a lambda or a closure."""
    ctx = get_context(start_method)
    error_queues = [ctx.SimpleQueue() for _ in range(nprocs)]
    processes = [
        ctx.Process(target=_wrap, args=(fn, i, args, error_queues[i]), daemon=daemon) for i in range(nprocs)
    ]
    # As torch: with the fork server, TORCH_MP_PARALLEL_START=1 starts the processes from
    # threads at once, so that one child slow to take its arguments does not hold the others.
    if start_method == "forkserver" and os.environ.get(ENV_VAR_PARALLEL_START, "0") == "1":
        log.info("Starting processes in parallel.")
        with concurrent.futures.ThreadPoolExecutor(max_workers=nprocs) as executor:
            for started in [executor.submit(p.start) for p in processes]:
                started.result()
    else:
        for process in processes:
            process.start()
    context = ProcessContext(processes, error_queues)
    if not join:
        return context
    while not context.join():
        pass


def spawn(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
    """``start_processes`` with the ``spawn`` start method (another one warns, as torch's)."""
    if start_method != "spawn":
        msg = (
            f"This method only supports start_method=spawn (got: {start_method}).\n"
            "To use a different start_method use:\n\t\t"
            " tensorshare.multiprocessing.start_processes(...)"
        )
        warnings.warn(msg, FutureWarning, stacklevel=2)
    return start_processes(fn, args, nprocs, join, daemon, start_method="spawn")
