"""Shared fixtures: start methods, sharing strategies, torch when it is installed, and a
check that nothing is left in /dev/shm."""

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap

import pytest

START_METHODS = ["fork", "spawn", "forkserver"]
LONG = 60  # seconds to wait for what a child should do at once: a bug fails, not hangs
STRATEGIES = ["file_descriptor", "file_system"]


def import_torch():
    """torch, or a skip that says why (the test script installs it where it can)."""
    return pytest.importorskip("torch", reason="torch is not installed in this environment")


@pytest.fixture(params=START_METHODS)
def ctx(request):
    import tensorshare.multiprocessing as mp

    return mp.get_context(request.param)


@pytest.fixture(params=STRATEGIES)
def strategy(request):
    import tensorshare.multiprocessing as mp

    old = mp.get_sharing_strategy()
    mp.set_sharing_strategy(request.param)
    yield request.param
    mp.set_sharing_strategy(old)


def needs_moves_into_arenas(why="what only an arena gives a tensor"):
    """Skips the calling test where this torch cannot move a storage into an arena (before
    2.12): there a tensor in no arena travels the way torch.multiprocessing sends it, with
    torch's limits (its sender must outlive the receiving, a descriptor or a file per
    storage, torch's errors), and the test asks ``why``."""
    torch = import_torch()
    from tensorshare import _reduction

    if not _reduction.can_move_in_place(torch):
        pytest.skip(f"torch {torch.__version__} cannot move a storage into an arena (2.12 can): {why}")


def mapped_at(address):
    """The fields of the line of /proc/self/maps whose mapping holds ``address`` (range,
    permissions, offset, device, inode and, if any, path), or None."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                return parts
    return None


def named_segments(root=None):
    """tensorshare's named segments in /dev/shm (of the group founded by ``root``)."""
    prefix = "tensorshare_" if root is None else f"tensorshare_{root}_"
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except FileNotFoundError:
        return []


def run_python(code, timeout=120, env=None, script_dir=None):
    """Runs ``code`` in a new Python process (``-c``, or as the script ``main.py`` written
    into ``script_dir``: a main module that spawned children import too); its completed
    process. The test fails on a timeout, which kills the process and every process it
    started (its own process group: a child it forked, waiting on a queue, is not left
    behind)."""
    full = dict(os.environ)
    full.update(env or {})
    code = textwrap.dedent(code)
    if script_dir is None:
        args = [sys.executable, "-c", code]
    else:
        with open(os.path.join(script_dir, "main.py"), "w") as f:
            f.write(code)
        args = [sys.executable, "main.py"]  # by a relative path, as users start scripts
    with subprocess.Popen(
        args,
        cwd=script_dir,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full,
        start_new_session=True,
    ) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def reap(p, timeout=LONG):
    """Joins child process ``p``, killing it if it has not ended within ``timeout`` seconds
    (a test that failed while it still waited for the test)."""
    p.join(timeout)
    if p.exitcode is None:
        p.kill()
        p.join()


def method_of(ctx):
    return ctx.get_start_method()


@pytest.fixture(autouse=True)
def no_child_left():
    """Every child a test starts is joined by it: one still running after the test is
    killed, and the test fails."""
    yield
    left = multiprocessing.active_children()
    for p in left:
        p.kill()
        p.join(LONG)
    assert left == [], f"children left running: {left}"
