"""What torch's ``test/test_multiprocessing_spawn.py`` checks of ``spawn``,
``start_processes`` and ``ProcessContext``, asked of ``tensorshare.multiprocessing``, with
every start method.

Nothing here imports torch, so that a child started by spawn or the fork server starts in a
fraction of a second. Children never sleep to order events: those that must outlive a failing
sibling wait on an event the test never sets (with a long timeout, so that a bug fails the
test rather than hanging it), and are ended by ``join``.
"""

import faulthandler
import logging
import multiprocessing
import multiprocessing.context
import os
import pickle
import resource
import select
import signal
import sys
import threading
import time

import pytest

import tensorshare.multiprocessing as mp
from conftest import LONG, import_torch, method_of, run_python

# ---------------------------------------------------------------- children


def _nothing(i):
    pass


def _put_index(i, q):
    q.put(i)


def _put_args(i, q, number, text, mapping, fn):
    q.put((i, number, text, mapping, fn(i)))


def _wait(i, release):
    release.wait(LONG)


def _fail_at(i, failing, release):
    if i == failing:
        raise ValueError(f"deliberate failure of process {i}")
    release.wait(LONG)


def _fail_everywhere(i):
    raise ValueError(f"deliberate failure of process {i}")


def _abort_first(i, release):
    if i == 0:
        faulthandler.disable()  # a forked child inherits pytest's: no traceback on stderr
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file
        os.kill(os.getpid(), signal.SIGABRT)
    release.wait(LONG)


def _kill_first_with(i, signum, release):
    if i == 0:
        os.kill(os.getpid(), signum)
    release.wait(LONG)


def _exit_first(i, code, release, release_on_exit):
    if i == 0:
        if release_on_exit:
            release.set()
        sys.exit(code)
    release.wait(LONG)


def _exit_with(i, code):
    sys.exit(code)


def _succeed_then_fail(i, first_done):
    if i == 0:
        first_done.set()
        return
    first_done.wait(LONG)
    raise ValueError("deliberate failure after a sibling succeeded")


def _ignore_sigterm_or_fail(i, ignoring, release):
    if i == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        ignoring.set()
        release.wait(LONG)
        return
    ignoring.wait(LONG)
    sys.exit(3)


def _report_daemon(i, q):
    q.put((i, multiprocessing.current_process().daemon))


def _start_a_child(i, method):
    mp.start_processes(_nothing, nprocs=1, start_method=method)


def _nested_inner(i, q):
    q.put((i, os.getpid(), os.getppid()))


def _nested_outer(i, method, q):
    mp.start_processes(_nested_inner, args=(q,), nprocs=2, start_method=method)
    q.put(("outer", os.getpid()))


def _nested_waiter(i, ready):
    ready.put(os.getpid())
    threading.Event().wait(LONG)  # the parent's death (SIGINT) interrupts this


def _nested_parent_dies(i, method, pids_q):
    ready = mp.get_context(method).Queue()
    mp.start_processes(_nested_waiter, args=(ready,), nprocs=2, join=False, start_method=method)
    # Both have registered their parent-death signal once they have answered.
    pids_q.put([ready.get(timeout=LONG), ready.get(timeout=LONG)])
    os.kill(os.getpid(), signal.SIGTERM)


def _infinite(i, release):
    release.wait(LONG)


# ---------------------------------------------------------------- helpers


def join_all(pc, timeout=LONG):
    """``pc.join`` until it says every process has ended (or raises)."""
    end = time.monotonic() + timeout
    while not pc.join(timeout=max(0.0, end - time.monotonic())):
        assert time.monotonic() < end, "the processes did not end in time"
    return True


def wait_for_exit(pids, timeout):
    """The pids among ``pids`` still alive after ``timeout`` seconds, waiting on pidfds (no
    polling): the processes need not be our children."""
    fds = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            pass
    end = time.monotonic() + timeout
    try:
        while fds and time.monotonic() < end:
            ready, _, _ = select.select(list(fds), [], [], max(0.0, end - time.monotonic()))
            for fd in ready:
                del fds[fd]
                os.close(fd)
        return sorted(fds.values())
    finally:
        for fd in fds:
            os.close(fd)


# ---------------------------------------------------------------- _TestMultiProcessing


def test_success(ctx):
    assert mp.start_processes(_nothing, nprocs=2, start_method=method_of(ctx)) is None


def test_success_non_blocking(ctx):
    pc = mp.start_processes(_nothing, nprocs=2, join=False, start_method=method_of(ctx))
    assert isinstance(pc, mp.ProcessContext)
    assert len(pc.pids()) == 2 and all(isinstance(p, int) for p in pc.pids())
    assert join_all(pc)
    # Joining again once everything has ended keeps saying so.
    assert pc.join(timeout=None) is True
    assert all(p.exitcode == 0 for p in pc.processes)


def test_first_argument_is_the_process_index_and_args_follow(ctx):
    q = ctx.SimpleQueue()
    k = 10
    mp.start_processes(
        _put_args,
        args=(q, 7, "text", {"a": [1, 2]}, lambda i: i + k),
        nprocs=2,
        start_method=method_of(ctx),
    )
    got = sorted([q.get(), q.get()])
    assert got == [(0, 7, "text", {"a": [1, 2]}, 10), (1, 7, "text", {"a": [1, 2]}, 11)]


def test_fn_may_be_a_closure(ctx):
    q = ctx.SimpleQueue()
    base = 100
    mp.start_processes(lambda i: q.put(base + i), nprocs=2, start_method=method_of(ctx))
    assert sorted([q.get(), q.get()]) == [100, 101]


@pytest.mark.parametrize("failing", [0, 1])
def test_exception_single(ctx, failing):
    release = ctx.Event()
    with pytest.raises(mp.ProcessRaisedException) as info:
        mp.start_processes(_fail_at, args=(failing, release), nprocs=2, start_method=method_of(ctx))
    e = info.value
    assert e.error_index == failing
    # The child's own traceback, ending with its exception.
    assert str(e).rstrip("\n").endswith(f"\nValueError: deliberate failure of process {failing}")
    assert f"Process {failing} terminated with the following error" in str(e)
    assert "Traceback (most recent call last)" in str(e) and "_fail_at" in str(e)


def _interrupted(i):
    raise KeyboardInterrupt(f"deliberate interrupt of process {i}")


def test_a_keyboard_interrupt_in_a_child_whose_parent_lives_is_its_failure(ctx):
    # As torch >= 2.15: only a parent's death (which its children get as SIGINT) ends a
    # child quietly; a KeyboardInterrupt of the function's own is reported as any failure,
    # with exit code 130, instead of counting as success.
    pc = mp.start_processes(_interrupted, nprocs=1, join=False, start_method=method_of(ctx))
    with pytest.raises(mp.ProcessRaisedException) as info:
        while not pc.join(LONG):
            pass
    e = info.value
    assert e.error_index == 0 and e.error_pid > 0
    assert "KeyboardInterrupt: deliberate interrupt of process 0" in str(e)
    assert pc.processes[0].exitcode == 130


class _StartedTogether:
    """An argument whose pickling, one per process being started, waits until every
    process's start is pickling it: only processes started at once get past it."""

    def __init__(self, n):
        self.barrier = threading.Barrier(n, timeout=LONG)

    def __reduce__(self):
        self.barrier.wait()
        return int, (0,)


@pytest.mark.parametrize("parallel", ["1", "0", None])
def test_the_fork_server_starts_processes_in_parallel_when_asked_as_torch_does(monkeypatch, parallel):
    # torch starts fork-server processes from threads at once with TORCH_MP_PARALLEL_START=1
    # (each child takes its arguments by itself); otherwise one after the other.
    if parallel is None:
        monkeypatch.delenv(mp.ENV_VAR_PARALLEL_START, raising=False)
    else:
        monkeypatch.setenv(mp.ENV_VAR_PARALLEL_START, parallel)
    q = mp.get_context("forkserver").SimpleQueue()
    together = _StartedTogether(3)
    if parallel == "1":
        mp.start_processes(_put_args, args=(q, together, "", {}, abs), nprocs=3, start_method="forkserver")
        assert sorted(q.get() for _ in range(3)) == [(i, 0, "", {}, i) for i in range(3)]
        return
    # One after the other: the first start waits alone, for nothing.
    together.barrier = threading.Barrier(3, timeout=0.5)
    with pytest.raises(TypeError, match="BrokenBarrierError"):
        mp.start_processes(_put_args, args=(q, together, "", {}, abs), nprocs=3, start_method="forkserver")
    # The spawn start method never starts in parallel (torch's does not either).
    monkeypatch.setenv(mp.ENV_VAR_PARALLEL_START, "1")
    together.barrier = threading.Barrier(3, timeout=0.5)
    with pytest.raises(TypeError, match="BrokenBarrierError"):
        mp.start_processes(_put_args, args=(q, together, "", {}, abs), nprocs=3, start_method="spawn")


def test_processes_started_in_parallel_keep_their_index(monkeypatch):
    monkeypatch.setenv(mp.ENV_VAR_PARALLEL_START, "1")
    release = mp.get_context("forkserver").Event()
    with pytest.raises(mp.ProcessRaisedException, match="deliberate failure of process 2") as e:
        mp.start_processes(_fail_at, args=(2, release), nprocs=4, start_method="forkserver")
    assert e.value.error_index == 2
    pc = mp.start_processes(_abort_first, args=(release,), nprocs=3, join=False, start_method="forkserver")
    with pytest.raises(mp.ProcessExitedException, match="process 0 terminated with signal (SIGABRT|SIGIOT)"):
        join_all(pc)


def test_exception_all(ctx):
    with pytest.raises(
        mp.ProcessRaisedException, match=r"\nValueError: deliberate failure of process (0|1)\n?$"
    ) as info:
        mp.start_processes(_fail_everywhere, nprocs=2, start_method=method_of(ctx))
    assert f"process {info.value.error_index}" in str(info.value)


def test_terminate_signal(ctx):
    release = ctx.Event()
    pc = mp.start_processes(_abort_first, args=(release,), nprocs=2, join=False, start_method=method_of(ctx))
    with pytest.raises(
        mp.ProcessExitedException, match="process 0 terminated with signal (SIGABRT|SIGIOT)"
    ) as info:
        join_all(pc)
    e = info.value
    assert e.error_index == 0 and e.error_pid == pc.pids()[0]
    assert e.exit_code == -signal.SIGABRT
    assert e.signal_name in ("SIGABRT", "SIGIOT")
    # The sibling was ended for it.
    assert not any(p.is_alive() for p in pc.processes)


def test_a_signal_without_a_name(ctx):
    release = ctx.Event()
    signum = signal.SIGRTMIN + 1  # terminates by default; not in signal.Signals
    pc = mp.start_processes(
        _kill_first_with, args=(signum, release), nprocs=2, join=False, start_method=method_of(ctx)
    )
    with pytest.raises(
        mp.ProcessExitedException, match=f"process 0 terminated with signal <Unknown signal {signum}>"
    ):
        join_all(pc)


@pytest.mark.parametrize("grace_period", [None, 20])
def test_terminate_exit(ctx, grace_period, caplog):
    release = ctx.Event()
    # With a grace period, the sibling ends by itself within it (process 0 releases it as it
    # exits); without one, it waits and is ended by SIGTERM.
    pc = mp.start_processes(
        _exit_first,
        args=(123, release, grace_period is not None),
        nprocs=2,
        join=False,
        start_method=method_of(ctx),
    )
    pid1 = pc.processes[1].pid
    with (
        caplog.at_level(logging.WARNING),
        pytest.raises(mp.ProcessExitedException, match="process 0 terminated with exit code 123") as info,
    ):
        while not pc.join(grace_period=grace_period):
            pass
    assert info.value.exit_code == 123 and info.value.signal_name is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if grace_period is None:
        assert pc.processes[1].exitcode == -signal.SIGTERM
        assert any(f"Terminating process {pid1} via signal" in m for m in warnings), warnings
    else:
        assert pc.processes[1].exitcode == 0
        assert warnings == []
    assert not any(p.is_alive() for p in pc.processes)


def test_grace_period_ends_with_sigkill_for_a_process_that_ignores_sigterm(ctx, caplog):
    ignoring, release = ctx.Event(), ctx.Event()
    pc = mp.start_processes(
        _ignore_sigterm_or_fail, args=(ignoring, release), nprocs=2, join=False, start_method=method_of(ctx)
    )
    pid1 = pc.processes[1].pid
    with caplog.at_level(logging.WARNING), pytest.raises(mp.ProcessExitedException, match="exit code 3"):
        while not pc.join(grace_period=0.2):
            pass
    assert pc.processes[1].exitcode == -signal.SIGKILL
    messages = " | ".join(r.getMessage() for r in caplog.records)
    assert f"Terminating process {pid1} via signal SIGTERM" in messages
    assert f"process {pid1}" in messages and "SIGKILL" in messages


def test_success_first_then_exception(ctx):
    first_done = ctx.Event()
    with pytest.raises(
        mp.ProcessRaisedException, match="ValueError: deliberate failure after a sibling succeeded"
    ) as info:
        mp.start_processes(_succeed_then_fail, args=(first_done,), nprocs=2, start_method=method_of(ctx))
    assert info.value.error_index == 1


def test_join_with_a_timeout(ctx):
    release = ctx.Event()
    pc = mp.start_processes(_wait, args=(release,), nprocs=2, join=False, start_method=method_of(ctx))
    # Nobody has ended: a join with a timeout says so, and leaves them running.
    assert pc.join(timeout=0.05) is False
    assert all(p.is_alive() for p in pc.processes)
    release.set()
    assert join_all(pc)
    assert [p.exitcode for p in pc.processes] == [0, 0]


@pytest.mark.parametrize("daemon", [False, True])
def test_daemon_flag(ctx, daemon):
    q = ctx.SimpleQueue()
    pc = mp.start_processes(
        _report_daemon, args=(q,), nprocs=2, join=False, daemon=daemon, start_method=method_of(ctx)
    )
    assert [p.daemon for p in pc.processes] == [daemon, daemon]
    join_all(pc)
    assert sorted([q.get(), q.get()]) == [(0, daemon), (1, daemon)]
    # A daemonic process may not start processes of its own.
    if daemon:
        with pytest.raises(
            mp.ProcessRaisedException, match="daemonic processes are not allowed to have children"
        ):
            mp.start_processes(
                _start_a_child, args=(method_of(ctx),), daemon=True, start_method=method_of(ctx)
            )
    else:
        mp.start_processes(_start_a_child, args=(method_of(ctx),), start_method=method_of(ctx))


def test_nested_start_processes(ctx):
    method = method_of(ctx)
    q = ctx.Queue()
    pc = mp.start_processes(_nested_outer, args=(method, q), nprocs=1, join=False, start_method=method)
    assert join_all(pc)
    got = [q.get(timeout=LONG) for _ in range(3)]
    outer = [g for g in got if g[0] == "outer"]
    inner = sorted(g for g in got if g[0] != "outer")
    assert outer == [("outer", pc.pids()[0])]
    assert [g[0] for g in inner] == [0, 1]
    assert len({g[1] for g in inner} | {os.getpid(), pc.pids()[0]}) == 4
    if method != "forkserver":  # the fork server is the parent of what it starts
        assert all(g[2] == pc.pids()[0] for g in inner)


def test_nested_children_die_with_their_parent(ctx):
    method = method_of(ctx)
    if method == "forkserver":
        # The fork server is the parent of every process it starts, and lives as long as any
        # of them does (each holds its alive pipe): no parent-death signal can reach them,
        # with torch's start_processes as with this one.
        pytest.skip("a fork server outlives its children by design")
    pids_q = ctx.Queue()
    pc = mp.start_processes(
        _nested_parent_dies, args=(method, pids_q), nprocs=1, join=False, start_method=method
    )
    nested = pids_q.get(timeout=LONG)
    # Wait for the parent's death by its pidfd, not by join: a forked grandchild holds the
    # write end of its parent's sentinel pipe, so join would wait for the grandchildren too.
    assert wait_for_exit(pc.pids(), timeout=LONG) == []
    alive = wait_for_exit(nested, timeout=15)
    for pid in alive:  # do not leave them behind when the test fails
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(mp.ProcessExitedException, match="signal SIGTERM"):
        join_all(pc)
    assert alive == [], "nested children outlived their parent"


# ---------------------------------------------------------------- SpawnTest


def test_spawn_exception_raises():
    first_done = multiprocessing.get_context("spawn").Event()
    first_done.set()
    with pytest.raises(mp.ProcessRaisedException) as info:
        mp.spawn(_succeed_then_fail, args=(first_done,), nprocs=2)
    assert info.value.error_index == 1
    assert "ValueError: deliberate failure after a sibling succeeded" in info.value.msg


def test_spawn_signal_raises():
    release = mp.get_context("spawn").Event()
    pc = mp.spawn(_infinite, args=(release,), nprocs=1, join=False)
    for pid in pc.pids():
        os.kill(pid, signal.SIGTERM)
    with pytest.raises(mp.ProcessExitedException) as info:
        join_all(pc)
    e = info.value
    assert e.signal_name == "SIGTERM" and e.exit_code == -signal.SIGTERM
    assert e.error_index == 0 and e.error_pid == pc.pids()[0]
    assert "process 0 terminated with signal SIGTERM" in str(e)


def test_spawn_process_exited():
    with pytest.raises(mp.ProcessExitedException) as info:
        mp.spawn(_exit_with, args=(12,), nprocs=1)
    assert info.value.exit_code == 12
    assert info.value.signal_name is None
    assert "process 0 terminated with exit code 12" in str(info.value)


def test_spawn_with_another_start_method_warns_and_spawns():
    with pytest.warns(FutureWarning, match="only supports start_method=spawn"):
        pc = mp.spawn(_nothing, nprocs=1, join=False, start_method="fork")
    assert isinstance(pc.processes[0], multiprocessing.context.SpawnProcess)
    assert join_all(pc)


# ---------------------------------------------------------------- ErrorTest and the rest


def test_errors_pickle():
    # The pid is error_pid, as torch names it (torch.distributed.elastic reads it; it was
    # `pid` here), in the constructor too.
    # (Made here, not raised by spawn: the package's own class, also where another test of
    # this process has imported torch.)
    raised = pickle.loads(pickle.dumps(mp.ProcessRaisedException("Oh no!", error_index=1, error_pid=2)))
    assert type(raised) is mp.ProcessRaisedException
    assert (raised.msg, raised.error_index, raised.error_pid, raised.pid) == ("Oh no!", 1, 2, 2)
    exited = pickle.loads(
        pickle.dumps(
            mp.ProcessExitedException("Oh no!", 1, error_pid=2, exit_code=-15, signal_name="SIGTERM")
        )
    )
    assert type(exited) is mp.ProcessExitedException
    assert (exited.msg, exited.error_index, exited.error_pid, exited.exit_code, exited.signal_name) == (
        "Oh no!",
        1,
        2,
        -15,
        "SIGTERM",
    )
    plain = pickle.loads(pickle.dumps(mp.ProcessExitedException("Oh no!", 1, 2, 1)))
    assert plain.exit_code == 1 and plain.signal_name is None
    assert issubclass(mp.ProcessRaisedException, mp.ProcessException)
    assert issubclass(mp.ProcessExitedException, mp.ProcessException)


def test_spawn_context_is_a_deprecated_process_context():
    with pytest.warns(UserWarning, match="renamed to ProcessContext"):
        pc = mp.SpawnContext([], [])
    assert isinstance(pc, mp.ProcessContext)
    assert pc.join() is True


def test_failures_are_torchs_exceptions_too_once_torch_is_imported():
    # Code that catches torch.multiprocessing's exceptions around this package's spawn
    # catches them (in a child process: importing torch is what is tested, and this file
    # does not). Importing this package alone does not import torch, and its exceptions are
    # then its own; unpickled where torch is imported, they are torch's too.
    import_torch()
    out = run_python(
        """
        import pickle, sys
        import tensorshare.multiprocessing as mp

        def fail(i):
            raise ValueError("deliberate")

        def leave(i):
            sys.exit(3)

        if __name__ == "__main__":
            for fn in (fail, leave):
                try:
                    mp.spawn(fn, nprocs=1)
                except mp.ProcessException as e:
                    print("alone:", type(e).__name__, "torch" in sys.modules, type(e).__mro__[1].__name__)
            import torch.multiprocessing
            theirs = sys.modules["torch.multiprocessing.spawn"]
            for fn, cls in ((fail, torch.multiprocessing.ProcessRaisedException),
                            (leave, torch.multiprocessing.ProcessExitedException)):
                try:
                    mp.spawn(fn, nprocs=1)
                except cls as e:
                    back = pickle.loads(pickle.dumps(e))
                    print("caught as torch's:", type(e).__name__, isinstance(e, mp.ProcessException),
                          isinstance(e, theirs.ProcessException), e.error_index, e.pid == e.error_pid,
                          getattr(e, "exit_code", None), isinstance(back, cls), str(back) == str(e),
                          getattr(back, "exit_code", None))
        """,
        script_dir=None,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith(("alone:", "caught"))]
    assert lines == [
        "alone: ProcessRaisedException False ProcessException",
        "alone: ProcessExitedException False ProcessException",
        "caught as torch's: ProcessRaisedException True True 0 True None True True None",
        "caught as torch's: ProcessExitedException True True 0 True 3 True True 3",
    ], out.stdout + out.stderr
