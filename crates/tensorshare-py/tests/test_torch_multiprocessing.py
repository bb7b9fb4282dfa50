"""What torch's ``test/test_multiprocessing.py`` checks of CPU tensors, asked of
``tensorshare.multiprocessing`` (``import tensorshare.multiprocessing as mp`` where torch's
test has ``import torch.multiprocessing as mp``), with each start method and sharing strategy
where the behaviour depends on them.

Children are ordered by queues and events, never by sleeping; every child is joined. A child
started by spawn or the fork server imports torch (seconds on a small machine), so those
cases are few and each does as much as it can.
"""

import ctypes
import json
import os
import resource
import select
import time
import warnings

import pytest

import tensorshare
import tensorshare.multiprocessing as mp
from conftest import LONG, STRATEGIES, import_torch, mapped_at, method_of, needs_moves_into_arenas, run_python

torch = import_torch()


def mapping_of(address):
    """The path /proc/self/maps gives for the mapping holding ``address``."""
    parts = mapped_at(address)
    if parts is None:
        return None
    return parts[5] if len(parts) > 5 else ""


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def limit_new_fds(limit):
    """Limits this process to ``limit`` descriptors beyond those it holds now, and returns
    how many it holds now. A fork child holds whatever the test process had open when it
    forked (queues and pipes of earlier tests that the GC has not collected yet, arenas):
    the child's own cost is what is limited, as in torch's test, whose child starts afresh."""
    held = [int(fd) for fd in os.listdir("/proc/self/fd")]
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(held) + 1 + limit,) * 2)
    return len(held)


def wait_for_dir_change(predicate, timeout, directory="/dev/shm"):
    """Whether ``predicate()`` holds within ``timeout`` seconds; rechecked whenever a file of
    ``directory`` is removed (inotify), never by polling."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "inotify_init1")
    try:
        if libc.inotify_add_watch(fd, directory.encode(), 0x200 | 0x400) < 0:  # IN_DELETE | IN_DELETE_SELF
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {directory}")
        end = time.monotonic() + timeout
        while not predicate():
            left = end - time.monotonic()
            if left <= 0:
                return False
            if select.select([fd], [], [], left)[0]:
                try:
                    os.read(fd, 1 << 16)
                except BlockingIOError:
                    pass
        return True
    finally:
        os.close(fd)


# ---------------------------------------------------------------- children


def _fill_then_send(strategy, q_in, q_out, filled, done):
    # _test_sharing: test_fill (a child writes what the parent sees, through a list holding
    # a tensor and a view of it) then test_receive (a tensor sent twice is one storage).
    mp.set_sharing_strategy(strategy)
    data = q_in.get(timeout=LONG)
    data[0][:] = 4
    filled.set()
    t = torch.ones(5, 5)
    q_out.put(t)
    q_out.put(t)
    done.wait(LONG)


def _pool_fill(t):
    t.fill_(4)
    return t.add(1)


def _autograd_task(a=1):
    torch.rand(3).requires_grad_(True).mean().backward()
    return a**2


def _autograd_sharing(q_in, q_out, ready, modified):
    for k in range(len(ready)):
        var = q_in.get(timeout=LONG)
        ready[k].set()
        assert modified[k].wait(LONG)
        expected = torch.arange(1.0, 26).view(5, 5)
        expected[0, 0] = 1000
        seen = {
            "sees_parent_write": bool(var.data.equal(expected)),
            "grad": var.grad,
            "hooks": bool(var._backward_hooks),
            "type": type(var).__name__,
            "requires_grad": var.requires_grad,
            "is_leaf": var.is_leaf,
        }
        var.data[:] = torch.ones(5, 5)  # seen by the parent
        var._grad = torch.ones(5, 5)  # not: gradients do not travel
        q_out.put(seen)


def _integer_parameter(iparam, q):
    q.put((type(iparam).__name__, iparam.requires_grad, int(iparam + 1)))


def _meta_fill_then_send(q_in, q_out, filled, done):
    data = q_in.get(timeout=LONG)
    data[0][:] = 4  # a no-op on meta tensors, as in torch's test
    filled.set()
    t = torch.ones(5, 5, device="meta")
    q_out.put(t)
    q_out.put(t)
    q_out.put([d.device.type for d in data])
    done.wait(LONG)


def _many_small_tensors(strategy, n, limit, q_in, q_out):
    mp.set_sharing_strategy(strategy)
    held = limit_new_fds(limit)
    kept = [q_in.get(timeout=LONG) for _ in range(n)]
    total = sum(float(t.sum()) for t in kept)
    for i in range(n):
        q_out.put(torch.full((2,), float(i)))
    q_out.put((total, open_fds() - held, len({t.untyped_storage().data_ptr() for t in kept})))


class _RangeDataset(torch.utils.data.IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return (torch.full((2, 2), float(i)) for i in range(self.n))


def _data_loader_with_few_fds(strategy, n, limit, q):
    mp.set_sharing_strategy(strategy)
    held = limit_new_fds(limit)
    kept = []
    loader = torch.utils.data.DataLoader(
        _RangeDataset(n), num_workers=1, multiprocessing_context=mp.get_context("fork")
    )
    for t in loader:
        assert float(t[0, 0, 0]) == len(kept)  # read it (torch's test takes a max)
        kept.append(t)
    q.put((len(kept), float(sum(t.sum() for t in kept)), open_fds() - held))


class _SubProcess(mp.Process):
    """torch's SubProcess: a Process subclass holding a shared tensor."""

    def __init__(self, tensor):
        super().__init__()
        self.tensor = tensor
        self.daemon = True

    def run(self):
        self.tensor.add_(3)


def _write_inherited(t, go):
    assert go.wait(LONG)
    t.fill_(7)


# ---------------------------------------------------------------- sharing (fd and fs)


def test_sharing(ctx, strategy):
    """test_fd_sharing, test_fs_sharing (torch repeats 30 times, with fork)."""
    repeat = 3 if method_of(ctx) == "fork" else 1
    for _ in range(repeat):
        x = torch.zeros(5, 5)
        data = [x, x[:, 1]]
        q_in, q_out = ctx.Queue(), ctx.Queue()
        filled, done = ctx.Event(), ctx.Event()
        q_in.put(data)  # before the child exists, as torch's test does
        p = ctx.Process(target=_fill_then_send, args=(strategy, q_in, q_out, filled, done), daemon=True)
        p.start()
        try:
            assert filled.wait(LONG)
            assert data[0].eq(4).all() and data[1].eq(4).all()
            assert x.eq(4).all()
            t1, t2 = q_out.get(timeout=LONG), q_out.get(timeout=LONG)
            assert t1.eq(1).all() and t1.shape == (5, 5)
            s1, s2 = t1.untyped_storage(), t2.untyped_storage()
            assert type(s1) is type(s2)
            assert s1.data_ptr() == s2.data_ptr() and s1._cdata == s2._cdata
            assert torch.equal(t1, t2)
            del t1, t2, s1, s2
        finally:
            done.set()
            p.join(LONG)
        assert p.exitcode == 0


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_preserve_sharing(strategy):
    """test_fd_preserve_sharing, test_fs_preserve_sharing, for tensors: a tensor and its
    views come back over one storage, the very one they left on."""
    for _ in range(5):
        x = torch.randn(5, 5)
        data = [x, x[2], x[:, 1]]
        q = mp.Queue()
        q.put(data)
        new = q.get(timeout=1)
        for a, b in zip(new, data, strict=True):
            assert torch.equal(a, b)
            assert a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
        cdata = x.untyped_storage()._cdata
        assert all(t.untyped_storage()._cdata == cdata for t in new)
        new[2][0] = 123.0
        assert x[0, 1] == 123.0


def test_preserve_sharing_of_storage_objects():
    """test_fd_preserve_sharing, the storage in its list: ``x.storage()`` comes back as
    the same storage."""
    x = torch.randn(5, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated
        storage = x.storage()
    q = mp.Queue()
    q.put([storage, x])
    new_storage, new_x = q.get(timeout=1)
    assert new_storage._cdata == storage._cdata
    assert new_storage.data_ptr() == x.untyped_storage().data_ptr()


def test_an_untyped_storage_travels():
    x = torch.randn(5)
    q = mp.Queue()
    q.put(x.untyped_storage())
    got = q.get(timeout=1)
    assert got.data_ptr() == x.untyped_storage().data_ptr()


# Every start method and every strategy, pairwise: a pool of spawned workers costs seconds.
POOL_CASES = [
    ("fork", "file_descriptor"),
    ("fork", "file_system"),
    ("spawn", "file_descriptor"),
    ("forkserver", "file_system"),
]


@pytest.mark.parametrize(("method", "strategy"), POOL_CASES, indirect=["strategy"])
def test_pool(method, strategy):
    """test_fd_pool, test_fs_pool: buffers filled in place by the workers, results back.
    Then test_autograd_errors (fork) and test_autograd_fine_with_spawn: autograd used in the
    parent, then in the workers (CPU only: no autograd threads for a fork to trip over)."""
    _autograd_task()
    with mp.get_context(method).Pool(2) as pool:
        buffers = [torch.zeros(2, 2) for _ in range(4)]
        results = pool.map(_pool_fill, buffers, 1)
        assert pool.map(_autograd_task, [1, 2, 3]) == [1, 4, 9]
        pool.close()
        pool.join()
    assert len(results) == len(buffers)
    for r in results:
        assert torch.equal(r, torch.full((2, 2), 5.0))
    for b in buffers:
        assert torch.equal(b, torch.full((2, 2), 4.0))


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_fs(strategy):
    needs_moves_into_arenas("the arena a storage moves into, not torch's file")
    """test_fs, reinterpreted: there is no file per storage; under file_system a tensor
    sent lives in a named arena of this process in /dev/shm, under file_descriptor in a
    memfd (nothing in /dev/shm)."""
    x = torch.zeros(4, dtype=torch.float64)
    q = mp.Queue()
    q.put(x)
    where = mapping_of(x.data_ptr())
    if strategy == "file_system":
        name = os.path.basename(where)
        assert where.startswith("/dev/shm/tensorshare_"), where
        assert name.split("_")[2] == str(os.getpid())
        assert os.path.exists(where)
    else:
        assert where.startswith("/memfd:"), where
    got = q.get(timeout=1)
    assert mapping_of(got.data_ptr()) == where


def test_inherit_tensor():
    """test_inherit_tensor: a Process subclass (default start method: fork here, as in
    torch's test) holding a shared tensor writes into it."""
    t = torch.zeros(5, 5)
    p = _SubProcess(t.share_memory_())
    p.start()
    p.join(LONG)
    assert p.exitcode == 0
    assert torch.equal(t, torch.full((5, 5), 3.0))


# ---------------------------------------------------------------- empty and meta tensors


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
def test_empty_tensor_sharing(strategy):
    """test_empty_tensor_sharing, test_empty_tensor_sharing_meta, test_tensor_sharing_meta."""
    for device in ["cpu", "meta"]:
        for dtype in [torch.float32, torch.int64]:
            q = mp.Queue()
            empty = torch.tensor([], dtype=dtype, device=device)
            q.put(empty)
            out = q.get(timeout=1)
            assert out.dtype == dtype and out.device.type == device and out.shape == (0,)
            if device == "cpu":
                assert torch.equal(out, empty)
    q = mp.Queue()
    meta = torch.tensor([1], dtype=torch.float32, device="meta")
    q.put(meta)
    out = q.get(timeout=1)
    assert out.device.type == "meta" and out.shape == (1,) and out.dtype == torch.float32


def test_a_meta_tensor_keeps_its_strides():
    q = mp.Queue()
    q.put(torch.empty_strided((3, 4), (1, 3), device="meta"))
    out = q.get(timeout=1)
    assert out.device.type == "meta" and out.shape == (3, 4)
    assert out.stride() == (1, 3)


def test_empty_shared():
    """test_empty_shared: an empty tensor may be shared, by torch or by tensorshare, and
    sent."""
    t = torch.tensor([])
    t.share_memory_()
    u = tensorshare.share_memory_(torch.tensor([]))
    q = mp.Queue()
    q.put([t, u])
    got = q.get(timeout=1)
    assert [g.shape for g in got] == [(0,), (0,)]


def test_meta_sharing_between_processes():
    """test_meta_simple (torch skips it on Linux; it uses spawn, fork is cheaper here and
    goes through the same queues): meta tensors cross to a child and back with their shapes."""
    ctx = mp.get_context("fork")
    x = torch.zeros(5, 5, device="meta")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    filled, done = ctx.Event(), ctx.Event()
    q_in.put([x, x[:, 1]])
    p = ctx.Process(target=_meta_fill_then_send, args=(q_in, q_out, filled, done), daemon=True)
    p.start()
    try:
        assert filled.wait(LONG)
        t1, t2 = q_out.get(timeout=LONG), q_out.get(timeout=LONG)
        assert t1.device.type == "meta" and t1.size() == t2.size() == (5, 5)
        assert q_out.get(timeout=LONG) == ["meta", "meta"]
    finally:
        done.set()
        p.join(LONG)
    assert p.exitcode == 0


# ---------------------------------------------------------------- autograd


def test_variable_and_parameter_sharing(ctx):
    """test_variable_sharing, test_leaf_variable_sharing, test_parameter_sharing: the data
    is shared both ways, requires_grad and the Parameter class travel, gradients and hooks
    do not."""

    @torch.utils.hooks.unserializable_hook
    def hook(*unused):
        pass

    cases = [
        (torch.arange(1.0, 26).view(5, 5).requires_grad_(True), "Tensor"),
        (torch.arange(1.0, 26).view(5, 5).requires_grad_(False), "Tensor"),
        (torch.nn.Parameter(torch.arange(1.0, 26).view(5, 5)), "Parameter"),
    ]
    ready = [ctx.Event() for _ in cases]
    modified = [ctx.Event() for _ in cases]
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_autograd_sharing, args=(q_in, q_out, ready, modified), daemon=True)
    p.start()
    try:
        for k, (var, kind) in enumerate(cases):
            assert var.is_leaf
            if var.requires_grad:
                var.register_hook(hook)
            var._grad = torch.zeros(5, 5)
            q_in.put(var)
            assert ready[k].wait(LONG)
            var.data[0, 0] = 1000
            var.grad.data[:] = torch.ones(5, 5) * 4
            modified[k].set()
            seen = q_out.get(timeout=LONG)
            assert seen == {
                "sees_parent_write": True,
                "grad": None,
                "hooks": False,
                "type": kind,
                "requires_grad": var.requires_grad,
                "is_leaf": True,
            }
            assert torch.equal(var.data, torch.ones(5, 5))
            assert torch.equal(var.grad.data, torch.ones(5, 5) * 4)
    finally:
        for e in ready + modified:
            e.set()
        p.join(LONG)
    assert p.exitcode == 0


def test_non_leaf_variable_sharing():
    """test_non_leaf_variable_sharing: refused at put, with torch's message, and nothing is
    left in the queue."""
    var0 = torch.arange(1.0, 26).view(5, 5).requires_grad_(True)
    var = var0 * 2
    for q in [mp.SimpleQueue(), mp.Queue()]:
        with pytest.raises(RuntimeError, match=r"requires_grad"):
            q.put(var)
        assert q.empty()
        q.put(var.detach())
        assert torch.equal(q.get(), var.detach())


def test_integer_parameter_serialization():
    """test_integer_parameter_serialization_cpu: an integer Parameter (requires_grad=False)
    as an argument of a spawned process."""
    ctx = mp.get_context("spawn")
    iparam = torch.nn.Parameter(torch.tensor(0, dtype=torch.int64), requires_grad=False)
    q = ctx.Queue()
    p = ctx.Process(target=_integer_parameter, args=(iparam, q))
    p.start()
    got = q.get(timeout=LONG)
    p.join(LONG)
    assert p.exitcode == 0
    assert got == ("Parameter", False, 1)


# ---------------------------------------------------------------- share_memory_ and is_shared


def test_an_already_shared_tensor_travels_as_it_is():
    """A tensor sent twice, or received and sent back, stays on one storage: sharing is not
    redone."""
    q = mp.Queue()
    t = tensorshare.share_memory_(torch.arange(6.0))
    ptr = t.data_ptr()
    q.put(t)
    got = q.get(timeout=1)
    q.put(got)
    again = q.get(timeout=1)
    assert t.data_ptr() == got.data_ptr() == again.data_ptr() == ptr
    again[0] = 42
    assert t[0] == 42


def test_is_shared():
    """test_is_shared, test_fs_is_shared, and what hangs on it."""
    t = torch.randn(5, 5)
    assert not t.is_shared()
    q = mp.Queue()
    q.put(t)
    got = q.get(timeout=1)
    assert t.is_shared() and got.is_shared()
    t.share_memory_()  # a no-op in torch once shared
    assert t.data_ptr() == got.data_ptr()


def test_a_tensor_torch_shared_keeps_its_memory_when_sent():
    """share_memory_ then fork then send: in torch, sending a shared tensor leaves it where
    it is, so the forked child's writes still reach it."""
    ctx = mp.get_context("fork")
    t = torch.zeros(4).share_memory_()
    go = ctx.Event()
    p = ctx.Process(target=_write_inherited, args=(t, go))
    p.start()
    try:
        q = mp.Queue()
        q.put(t)
        q.get(timeout=1)
    finally:
        go.set()
        p.join(LONG)
    assert p.exitcode == 0
    assert torch.equal(t, torch.full((4,), 7.0))


def _write_and_report(t, go, back):
    assert go.wait(LONG)
    back.put(t.tolist())
    t[0] = 9.0
    back.put(None)


@pytest.mark.parametrize("strategy", STRATEGIES, indirect=True)
@pytest.mark.parametrize("torch_shared_by", STRATEGIES)
def test_a_tensor_in_torchs_own_shared_memory_stays_there_when_sent(torch_shared_by, strategy):
    """A storage torch put in its own shared memory (its share_memory_() before tensorshare
    was imported, its queues, a DataLoader's default workers) may be mapped by other
    processes: a put leaves it there, and it is sent the way torch sends it, whichever
    strategy is set here."""
    # Before: the put moved it into a block, and a child that had inherited it saw the
    # parent's later writes no more.
    ctx = mp.get_context("fork")
    t = torch.zeros(3)
    storage = t.untyped_storage()
    # What torch's share_memory_() and its reductions call, under each of its strategies.
    if torch_shared_by == "file_descriptor":
        storage._share_fd_cpu_()
    else:
        storage._share_filename_cpu_()
    address = t.data_ptr()
    go, back = ctx.Event(), ctx.Queue()
    p = ctx.Process(target=_write_and_report, args=(t, go, back))
    p.start()
    try:
        q = mp.Queue()
        q.put({"t": t, "storage": storage})
        got = q.get(timeout=LONG)
        assert t.data_ptr() == address  # left where it was
        assert got["t"].data_ptr() == address and got["storage"].data_ptr() == address
        t.fill_(5.0)
        go.set()
        assert back.get(timeout=LONG) == [5.0, 5.0, 5.0]  # the child still maps it
        assert back.get(timeout=LONG) is None
        assert got["t"].tolist() == [9.0, 5.0, 5.0]
    finally:
        go.set()
        p.join(LONG)
    assert p.exitcode == 0


# ---------------------------------------------------------------- descriptors


@pytest.mark.parametrize(
    ("method", "strategy"),
    [("fork", "file_descriptor"), ("fork", "file_system"), ("spawn", "file_descriptor")],
    indirect=["strategy"],
)
def test_many_small_tensors_with_a_low_fd_limit(method, strategy):
    if strategy == "file_descriptor":
        needs_moves_into_arenas("storages that cost no descriptor each under file_descriptor")
    """The fd-limit test of torch's suite (test_fd_limit_exceeded, in test_dataloader.py):
    with torch's file_descriptor strategy every storage received costs a descriptor, so a
    process limited to 100 fails on the hundredth; here arenas cost a few in all. The child
    is limited, receives and keeps 500 storages, and sends 500 back."""
    ctx = mp.get_context(method)
    n, limit = 500, 100
    q_in, q_out = ctx.Queue(), ctx.Queue()
    before = open_fds()
    p = ctx.Process(target=_many_small_tensors, args=(strategy, n, limit, q_in, q_out))
    p.start()
    try:
        sent = [torch.full((2, 2), float(i)) for i in range(n)]
        for t in sent:
            q_in.put(t)
        back = [q_out.get(timeout=LONG) for _ in range(n)]
        total, child_fds, storages = q_out.get(timeout=LONG)
    finally:
        p.join(LONG)
    assert p.exitcode == 0
    assert total == 4 * sum(range(n)) and storages == n
    assert child_fds < limit
    assert [float(t[0]) for t in back] == [float(i) for i in range(n)]
    assert open_fds() - before < 50, "receiving 500 storages cost this process a descriptor each"


def test_data_loader_with_a_low_fd_limit(strategy):
    """test_fd_limit_exceeded itself: a DataLoader (one fork worker, our context) yields 300
    tensors to a process limited to 100 descriptors, which keeps them all."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_data_loader_with_few_fds, args=(strategy, 300, 100, q))
    p.start()
    got = q.get(timeout=LONG)
    p.join(LONG)
    assert p.exitcode == 0
    n, total, fds = got
    assert n == 300 and total == 4 * sum(range(300)) and fds < 100


# ---------------------------------------------------------------- leaks (file_system)

_LEAK_SCENARIO = r"""
import json, os, signal, sys
import numpy as np
import torch
import tensorshare
import tensorshare.multiprocessing as mp

def fill(q_in, q_out):
    mp.set_sharing_strategy("file_system")
    t = q_in.get(timeout=60)
    t.fill(4) if isinstance(t, np.ndarray) else t.fill_(4)
    back = tensorshare.empty_shared_array((1000,), "float32")
    back[...] = 1
    q_out.put((os.getpid(), back))

def pool_fill(t):
    t.fill_(4)
    return os.getpid(), t.add(1)

def make_then_die(q):
    mp.set_sharing_strategy("file_system")
    a = tensorshare.empty_shared_array((1000,), "float32")
    q.put((os.getpid(), a))
    os.kill(os.getpid(), signal.SIGKILL)

if __name__ == "__main__":
    mp.set_sharing_strategy("file_system")
    graceful, killed = [os.getpid()], []
    for method in ["fork", "spawn", "forkserver"]:
        ctx = mp.get_context(method)
        q_in, q_out = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=fill, args=(q_in, q_out))
        p.start()
        # numpy for the children that start python afresh, which then need not import
        # torch (a numpy array is shared in place only when made in shared memory)
        if method == "fork":
            x = torch.zeros(1000)
        else:
            x = tensorshare.empty_shared_array((1000,), "float32")
            x[...] = 0
        q_in.put(x)
        pid, back = q_out.get(timeout=60)
        p.join(60)
        assert p.exitcode == 0 and float(x.sum()) == 4000 and float(back.sum()) == 1000
        graceful.append(pid)
    pool = mp.get_context("fork").Pool(2)
    buffers = [torch.zeros(10) for _ in range(4)]
    results = pool.map(pool_fill, buffers, 1)
    pool.close()
    pool.join()
    assert all(float(r.sum()) == 50 for _, r in results) and all(float(b.sum()) == 40 for b in buffers)
    graceful += sorted({pid for pid, _ in results})
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=make_then_die, args=(q,))
    p.start()
    pid, a = q.get(timeout=60)
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    killed.append(pid)
    del a
    print("ROOTS " + json.dumps({"graceful": graceful, "killed": killed}))
"""


@pytest.fixture(scope="module")
def leak_scenario():
    """torch's leak_checker, reinterpreted: a process runs the sharing and pool cases under
    file_system with each start method (and one child dies by SIGKILL); once they have all
    exited, what is left in /dev/shm named after their groups or made by them."""
    done = run_python(_LEAK_SCENARIO, timeout=120)
    assert done.returncode == 0, done.stderr
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("ROOTS "))
    roots = json.loads(line[len("ROOTS ") :])

    def left(pids):
        # `tensorshare_<root>_<creator>_<random>` and `tensorshare_<root>_group`: a process's
        # files are those of the group it founded, and those it made in another's (a child
        # joins its parent's group).
        def of(name, pid):
            parts = name.split("_")
            return name.startswith("tensorshare_") and str(pid) in parts[1:3]

        return sorted(n for n in os.listdir("/dev/shm") for r in pids if of(n, r))

    everything = roots["graceful"] + roots["killed"]
    # Whatever a group's cleaner removes, it removes once the group's last member is gone.
    wait_for_dir_change(lambda: not left(everything), timeout=3)
    return {kind: left(pids) for kind, pids in roots.items()}, done.stderr


def test_no_segment_left_after_processes_exit(leak_scenario):
    """Every arena of a process that exits normally goes with it."""
    left, _ = leak_scenario
    assert [n for n in left["graceful"] if not n.endswith("_group")] == []


def test_nothing_left_after_processes_exit(leak_scenario):
    """The groups' lock files too: each group's cleaner removes them once it is gone."""
    left, _ = leak_scenario
    assert left["graceful"] == []


def test_nothing_left_after_a_killed_process(leak_scenario):
    """A child killed with SIGKILL (no chance to unlink its arena): its group's cleaner
    removes what it made."""
    left, _ = leak_scenario
    assert left["killed"] == []


def test_set_thread_name_names_the_calling_thread():
    # torch's test_set_thread_name (mp._set_thread_name was missing), with torch's
    # truncation to 15 bytes, in a thread of its own so the test process keeps its name.
    import threading

    import torch.multiprocessing as tmp

    got = {}

    def run():
        mp._set_thread_name("test name")
        got["short"] = mp._get_thread_name()
        mp._set_thread_name("a name longer than fifteen bytes")
        got["long"] = mp._get_thread_name()
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            got["kernel"] = f.read().strip()
        got["torch"] = tmp._get_thread_name()
        mp._set_thread_name(b"as bytes")
        got["bytes"] = mp._get_thread_name()
        try:
            mp._set_thread_name(None)  # torch's aborts the process
        except TypeError as e:
            got["none"] = str(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert got.pop("none") == "a thread's name is a str or bytes, not NoneType"
    assert got == {
        "short": "test name",
        "long": "a name longer t",
        "kernel": "a name longer t",
        "torch": "a name longer t",
        "bytes": "as bytes",
    }


def test_the_names_torch_multiprocessing_adds_to_multiprocessing_are_there():
    # Every public name of torch.multiprocessing, and the torch helpers its own tests use
    # (mp.reductions.rebuild_cuda_tensor), which are torch's own objects.
    import torch.multiprocessing as tmp

    assert set(tmp.__all__) <= set(mp.__all__)
    for name in tmp.__all__:
        assert hasattr(mp, name), name
    for name in ("reductions", "init_reductions", "_prctl_pr_set_pdeathsig"):
        assert getattr(mp, name) is getattr(tmp, name), name
    assert mp.ENV_VAR_PARALLEL_START == tmp.ENV_VAR_PARALLEL_START
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        mp.no_such_name  # noqa: B018
