"""Edges of the torch conversion a hostile review found: the registry of blocks and torch
storages entered again by a finaliser (or by another thread while one releases the GIL),
a program that patches torch's Python classes, a storage torch's own reduction moved away,
tensors with a negative or conjugate bit, dtypes the wire has no kind for, and a file torch
maps. A case that
could hang or crash runs in a Python process of its own, under a timeout."""

import textwrap

import pytest

from conftest import LONG, import_torch, needs_moves_into_arenas, reap, run_python

FINALISER_USES_THE_REGISTRY = """
    import gc
    from tensorshare import _native

    state = {"inside": False, "ran_inside": 0}

    class Cycle:
        def __init__(self):
            self.me = self

        def __del__(self):
            if state["inside"]:
                state["ran_inside"] += 1
            # Uses the registry of blocks, from inside new_block's registration.
            assert _native.find_block(0) is None

    blocks = []
    for threshold in range(1, 16):
        for _ in range(4):
            gc.collect()
            gc.disable()
            Cycle()
            gc.enable()
            gc.set_threshold(threshold)
            state["inside"] = True
            blocks.append(_native.new_block(16))
            state["inside"] = False
            gc.set_threshold(700)
    assert all(_native.find_block(b.address) is b for b in blocks)
    print(state["ran_inside"])
"""


def test_a_finaliser_run_by_the_gc_while_a_block_registers_may_use_the_registry():
    # Before: the registry's lock was held while the weak reference was made, whose
    # allocation can run the GC; the finaliser's find_block locked it again and hung.
    out = run_python(FINALISER_USES_THE_REGISTRY, timeout=LONG)
    assert out.returncode == 0, out.stderr
    # The finalisers did run inside new_block, so the case the test is for happened.
    assert int(out.stdout) > 0, out.stdout


def test_a_finaliser_releasing_the_gil_while_another_thread_sends_tensors_does_not_deadlock():
    # Before: a finaliser run by the GC under the registry's lock released the GIL; the
    # sending thread took the GIL and waited for the lock, and the finaliser for the GIL.
    import_torch()
    out = run_python(
        """
        import threading, time
        import torch
        import tensorshare as ts
        from tensorshare import _native

        class Cycle:
            def __init__(self):
                self.me = self

            def __del__(self):
                time.sleep(0)  # any finaliser that releases the GIL (I/O, a lock, logging)

        stop = threading.Event()
        sent = []

        def sender():
            q = _native.Queue()
            t = torch.zeros(16)
            while not stop.is_set():
                q.put(t)
                sent.append(q.get())

        th = threading.Thread(target=sender)
        th.start()
        try:
            for _ in range(3000):
                Cycle()
                Cycle()
                ts.empty_shared_array(4)
        finally:
            stop.set()
            th.join()
        assert sent
        print("done")
        """,
        timeout=LONG,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "done"


def test_a_patched_dtype_property_neither_recurses_nor_crashes():
    # Before: Rust read the real dtype (complex64, pickled), Python's persistent_id the
    # patched one (float32, a handle), so the pickle's inner tensor was pickled again, and
    # again, until the stack overflowed (SIGSEGV). Now both ask torch's C getter; the tensor
    # is pickled by torch, which believes the patch as it does in torch.multiprocessing.
    import_torch()
    out = run_python(
        """
        import pickle
        import torch
        import tensorshare as ts

        t = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
        torch.Tensor.dtype = property(lambda self: torch.float32)
        r = ts.roundtrip({"t": t})["t"]
        torch_says = pickle.loads(pickle.dumps(t))
        del torch.Tensor.dtype
        print(r.dtype == torch_says.dtype and torch.equal(r, torch_says))
        """,
        timeout=LONG,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True", out.stdout


def test_a_pickled_value_naming_something_that_is_no_handle_is_an_error_not_a_recursion():
    # The inner values of a pickle take a path that accepts handles only: whatever the
    # pickler claims, nothing is pickled a second time.
    out = run_python(
        """
        import tensorshare as ts
        from tensorshare import _reduction

        _reduction.tensor_parts_cheap = lambda obj: True  # claims everything is a handle
        try:
            ts.roundtrip({1, 2})
        except ValueError as e:
            print("ValueError:", e)
        """,
        timeout=LONG,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ValueError:") and "set" in out.stdout, out.stdout


def test_a_storage_torch_moved_into_its_own_shared_memory_is_not_reused_for_its_old_block():
    # Before: the block's registered torch storage was reused although torch's reduction
    # (torch.multiprocessing's queues, ForkingPickler) had moved its memory elsewhere, so a
    # tensor received over the block read and wrote that foreign memory.
    torch = import_torch()
    np = pytest.importorskip("numpy")
    import tensorshare as ts
    from tensorshare import _native, _reduction

    block = _native.new_block(64)
    storage = _reduction.torch_storage(block)
    assert storage.data_ptr() == block.address
    # What torch's reduce_storage calls under the file_descriptor strategy.
    storage._share_fd_cpu_()
    assert storage.data_ptr() != block.address  # torch did move it

    again = _reduction.torch_storage(block)
    assert again.data_ptr() == block.address and again.nbytes() == block.nbytes

    mine = np.ndarray(64, np.uint8, buffer=block)
    mine[:] = 7
    r = ts.roundtrip(torch.frombuffer(block, dtype=torch.uint8)[8:16])
    assert r.untyped_storage().data_ptr() == block.address
    mine[:] = 42
    assert r.tolist() == [42] * 8


def test_negative_and_conjugate_views_arrive_with_their_values():
    # Before: a view with the negative bit (the imaginary part of a conjugate) was sent as
    # its storage's raw geometry, and arrived with the wrong sign.
    torch = import_torch()
    import tensorshare as ts

    z = torch.tensor([1 + 2j, 3 - 4j, -5 + 6j], dtype=torch.complex64)
    neg = z.conj().imag
    assert neg.is_neg()
    r = ts.roundtrip(neg)
    assert r.tolist() == [-2.0, 4.0, -6.0]

    neg = torch._neg_view(torch.arange(6.0).view(2, 3)[:, 1:])
    assert neg.is_neg()
    assert ts.roundtrip([neg])[0].tolist() == [[-1.0, -2.0], [-4.0, -5.0]]

    conj = z.conj()
    assert conj.is_conj()
    r = ts.roundtrip(conj)
    assert r.tolist() == [1 - 2j, 3 + 4j, -5 - 6j]


def test_a_negative_view_arrives_in_another_process_with_its_values_and_shared():
    torch = import_torch()
    import tensorshare.multiprocessing as mp

    ctx = mp.get_context("fork")
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    neg = z.conj().imag
    to_child, from_child = ctx.Queue(), ctx.Queue()

    def child(inq, outq):
        t = inq.get(timeout=LONG)
        outq.put(t.tolist())
        inq.get(timeout=LONG)  # the parent has written z
        outq.put(t.tolist())

    p = ctx.Process(target=child, args=(to_child, from_child))
    p.start()
    try:
        to_child.put(neg)
        assert from_child.get(timeout=LONG) == [-2.0, 4.0]
        z.imag[0] = 10.0  # the child's tensor views z's memory, with its sign
        to_child.put(None)
        assert from_child.get(timeout=LONG) == [-10.0, 4.0]
    except BaseException:
        p.kill()
        p.join()
        raise
    p.join(LONG)
    assert p.exitcode == 0


def _report_empty_views(q, back):
    got = q.get(timeout=LONG)
    for name in ("alone", "in_object"):
        t = got[name] if name == "alone" else got[name].view
        shared = t.untyped_storage().data_ptr() == got["s"].data_ptr()
        back.put((name, t.shape[0], t.storage_offset(), shared))
    got["s"].fill_(7.0)  # the sender's storage, shared
    back.put("written")


class HoldsAView:
    def __init__(self, view):
        self.view = view


def test_a_view_with_no_elements_past_the_end_of_its_storage_arrives_with_its_offset(ctx):
    # torch lets a tensor with no elements have any offset (set_, slicing past the end);
    # such a view was refused by put ("needs 40 bytes, its storage has 16"), while torch's
    # queues send it. It travels as torch pickles it, over the same storage.
    torch = import_torch()

    s = torch.arange(4.0).share_memory_()
    past = torch.empty(0).set_(s.untyped_storage(), 10, (0,), (1,))
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_report_empty_views, args=(q, back))
    p.start()
    try:
        q.put({"alone": past, "in_object": HoldsAView(past), "s": s})
        assert back.get(timeout=LONG) == ("alone", 0, 10, True)
        assert back.get(timeout=LONG) == ("in_object", 0, 10, True)
        assert back.get(timeout=LONG) == "written"
    finally:
        reap(p)
    assert p.exitcode == 0
    assert s.tolist() == [7.0] * 4


def _new_dtypes(torch):
    """The dtypes torch pickles through ``_rebuild_tensor_v3`` (none of them on the wire)."""
    return sorted(torch.storage._new_dtypes(), key=str)


def test_dtypes_the_wire_lacks_arrive_shared_not_lost():
    # Before: uint16, uint32, uint64, float8_* and torch's other "new" dtypes could be put,
    # and the receiver failed in torch's _rebuild_tensor_v3 after taking the message.
    torch = import_torch()
    import tensorshare as ts

    for dtype in _new_dtypes(torch):
        base = torch.arange(48, dtype=torch.uint8)
        x = base.view(dtype)
        x = x.view(-1)[1:]
        r = ts.roundtrip({"x": x})["x"]
        assert r.dtype == dtype, dtype
        assert (r.shape, r.stride(), r.storage_offset()) == (x.shape, x.stride(), x.storage_offset())
        # The same memory: the sender's bytes, moved into a block in place.
        assert r.untyped_storage().data_ptr() == x.untyped_storage().data_ptr(), dtype
        assert bytes(r.untyped_storage()) == bytes(base.untyped_storage()), dtype

    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.uint16), requires_grad=False)
    r = ts.roundtrip(p)
    assert type(r) is torch.nn.Parameter and r.dtype == torch.uint16 and not r.requires_grad


def test_a_uint16_tensor_arrives_in_another_process_shared():
    torch = import_torch()
    import tensorshare.multiprocessing as mp

    ctx = mp.get_context("spawn")
    x = torch.tensor([1, 2, 60000], dtype=torch.int32).to(torch.uint16)
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_add_one_uint16, args=(q, back))
    p.start()
    try:
        q.put(x)
        assert back.get(timeout=LONG) == "torch.uint16"
    except BaseException:
        p.kill()
        p.join()
        raise
    p.join(LONG)
    assert p.exitcode == 0
    assert x.to(torch.int32).tolist() == [2, 3, 60001]


def _add_one_uint16(q, back):
    import torch

    t = q.get(timeout=LONG)
    t.copy_((t.to(torch.int32) + 1).to(torch.uint16))
    back.put(str(t.dtype))


def test_a_block_lives_as_long_as_the_torch_tensors_over_it_and_no_longer():
    needs_moves_into_arenas("a tensor moved into an arena by its put")
    # The torch storage made over a block (through DLPack) holds the block, and lets it go
    # when torch frees the storage: for a tensor moved by a put, for the tensor a get makes
    # over the same block, and for empty_shared's.
    torch = import_torch()
    import gc
    import weakref

    import tensorshare as ts
    import tensorshare.multiprocessing as mp
    from tensorshare import _native

    t = torch.full((256,), 3.0)
    q = mp.get_context("spawn").Queue()
    q.put(t)  # moves t's storage into a block, in place
    addr = t.untyped_storage().data_ptr()
    moved = weakref.ref(_native.find_block(addr))
    got = q.get(timeout=LONG)
    assert got.untyped_storage().data_ptr() == addr
    received = weakref.ref(_native.find_block(addr))
    view = got[10:20]
    del t, got
    gc.collect()
    assert view.tolist() == [3.0] * 10
    assert received() is not None  # the view still holds its block
    del view
    gc.collect()
    assert moved() is None and received() is None
    assert _native.find_block(addr) is None

    for dtype in (torch.bool, torch.bfloat16, torch.int16, torch.float64):
        e = ts.empty_shared((4, 8), dtype)
        assert e.dtype == dtype and e.shape == (4, 8)
        block = weakref.ref(_native.find_block(e.untyped_storage().data_ptr()))
        assert block() is not None
        del e
        gc.collect()
        assert block() is None


PATCHED_MAKERS = """
    import torch

    calls = []


    def wrap(real):
        def fake(*args, **kwargs):
            calls.append(1)
            return real(*args, **kwargs)

        return fake


    for name in {targets}:
        owner, attr = name.rsplit(".", 1)
        setattr(eval(owner), attr, wrap(getattr(eval(owner), attr)))

    import tensorshare.multiprocessing as mp

    t = torch.ones(4)
    q = mp.get_context("spawn").Queue()
    q.put(t)
    print("shared", t.is_shared(), "calls", len(calls))
"""


@pytest.mark.parametrize(
    "targets", [["torch._C._from_dlpack"], ["torch._C._from_dlpack", "torch.frombuffer"]]
)
def test_functions_put_in_place_of_those_that_make_a_tensor_over_a_block_are_not_called(targets):
    # Before: both were looked up by name and called, so a program that had replaced one was
    # handed the block and chose the storage that was then swapped into the tensor moved.
    import_torch()
    out = run_python(PATCHED_MAKERS.format(targets=targets), timeout=LONG)
    assert out.returncode == 0, out.stderr
    assert "shared True calls 0" in out.stdout, out.stdout


def _fake_torch(can_swap):
    """A stand-in for the parts of torch ``patch_torch`` touches: ``UntypedStorage`` with
    torch's two methods, under a ``StorageBase`` that has ``_swap_data_ptr_`` (torch >= 2.12)
    or not, and ``Tensor`` with its two resizes."""
    import types

    base = type("StorageBase", (), {"_swap_data_ptr_": lambda self, other: None} if can_swap else {})

    class UntypedStorage(base):
        device = types.SimpleNamespace(type="cpu")

        def nbytes(self):
            return 4

        def data_ptr(self):
            return 64  # in no block

        def is_shared(self):
            return False

        def share_memory_(self):
            return "torch's own"

    tensor = type("Tensor", (), {"resize_": lambda self, *size: self, "resize_as_": lambda self, other: self})
    return types.SimpleNamespace(
        UntypedStorage=UntypedStorage, Tensor=tensor, _C=types.SimpleNamespace(StorageBase=base)
    )


@pytest.mark.parametrize("can_swap", [True, False])
def test_a_torch_that_cannot_move_a_storage_in_place_keeps_its_own_share_memory_(can_swap):
    # Before torch 2.12 a storage cannot take new memory in place, so tensorshare cannot move
    # one into a block: its share_memory_() would only raise, where torch's own works (a
    # model's share_memory() failed on torch 2.3.1 once tensorshare was imported). There,
    # torch's runs for a storage in no block (one in a block stays where it is, on any torch:
    # test_torch_before_2_12.py); is_shared learns the blocks either way.
    from tensorshare import _reduction

    fake = _fake_torch(can_swap)
    torch_share_memory_ = fake.UntypedStorage.share_memory_
    torch_is_shared = fake.UntypedStorage.is_shared
    _reduction.patch_torch(fake)
    assert fake.UntypedStorage._tensorshare_patched
    assert fake.UntypedStorage.is_shared is not torch_is_shared
    assert fake.UntypedStorage.share_memory_ is not torch_share_memory_
    if not can_swap:
        assert fake.UntypedStorage().share_memory_() == "torch's own"


def _write_what_comes(queues, done):
    for index, q in enumerate(queues):
        while (item := q.get(timeout=LONG)) is not None:
            k, t = item
            t[index] = 1000 + k
    done.put("done")


@pytest.fixture(params=[1, 2], ids=["one-thread", "two-threads"])
def torch_threads(request):
    """torch's thread count for the test: with one, a move of up to 2 MiB copies into its
    block in tensorshare, straight to memory; with more, above 64 KiB, torch copies."""
    torch = import_torch()
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_two_threads_sending_one_large_new_tensor_at_once_send_the_same_memory(torch_threads):
    # Before: above 64 KiB torch copies the storage into its block, letting the GIL go;
    # a second thread sending the same storage meanwhile moved it too, into a block of its
    # own, copying from memory the first then freed, and one of the two messages named a
    # block the tensor no longer used (the child's write through it was lost). Now the
    # second waits for the first move and sends its block.
    import threading

    torch = import_torch()
    import tensorshare.multiprocessing as mp

    ctx = mp.get_context("fork")
    queues, done = [ctx.Queue(), ctx.Queue()], ctx.Queue()
    p = ctx.Process(target=_write_what_comes, args=(queues, done))
    p.start()
    try:
        sent = []
        for k in range(10):
            t = torch.zeros(1 << 20)  # 4 MiB
            sent.append(t)
            both = threading.Barrier(2)

            def put(q, k=k, t=t, both=both):
                both.wait()
                q.put((k, t))

            threads = [threading.Thread(target=put, args=(q,)) for q in queues]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        for q in queues:
            q.put(None)
        assert done.get(timeout=LONG) == "done"
    finally:
        reap(p)
    assert p.exitcode == 0
    assert [t[:2].tolist() for t in sent] == [[1000.0 + k] * 2 for k in range(10)]


class _Holder:
    def __init__(self, t):
        self.t = t


def _fill_with_sevens(q, back):
    t = q.get(timeout=LONG)
    t.fill_(7.0)
    back.put(float(t.sum()))


def _sum_then_fill_with_sevens(q, back):
    while (t := q.get(timeout=LONG)) is not None:
        back.put(int(t.sum()))
        t.fill_(7)
        back.put("filled")


# Past the first copy threshold, at and past the second, whole 64-byte lines and not.
LARGE_MOVES = [(64 << 10) + 1, 1 << 20, (1 << 20) + 13, 2 << 20, (2 << 20) + 8]


@pytest.mark.parametrize("nbytes", LARGE_MOVES)
@pytest.mark.parametrize("how", ["share_memory_", "put"])
def test_a_large_storage_moves_whole_and_in_place_however_many_threads_torch_has(nbytes, how, torch_threads):
    # A move copies into the block in tensorshare (one torch thread, up to 2 MiB: whole
    # lines written straight to memory, the rest word by word) or by torch: either way
    # every byte arrives, the tensor and its views follow it into the block, and a child's
    # writes reach them.
    import tensorshare.multiprocessing as mp

    torch = import_torch()
    ctx = mp.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_sum_then_fill_with_sevens, args=(q, back))
    p.start()
    try:
        t = (torch.arange(nbytes, dtype=torch.int64) * 7 % 251).to(torch.uint8)
        view = t[3:-5]
        expected = t.clone()
        old = t.untyped_storage().data_ptr()
        if how == "share_memory_":
            t.share_memory_()
            assert t.is_shared() and t.untyped_storage().data_ptr() != old
            assert torch.equal(t, expected)
        q.put(t)
        assert back.get(timeout=LONG) == int(expected.sum(dtype=torch.int64))
        assert back.get(timeout=LONG) == "filled"
        q.put(None)
    finally:
        reap(p)
    assert p.exitcode == 0
    assert t.is_shared() and t.untyped_storage().data_ptr() != old
    assert view.data_ptr() == t.data_ptr() + 3
    assert bool((t == 7).all()) and bool((view == 7).all())


def test_a_tensor_over_a_file_torch_maps_shared_is_refused_and_stays_in_its_file(ctx, tmp_path):
    """A move into a block would end the file's share of the tensor's writes, silently, and
    torch's own queues cannot send it (no descriptor: its feeder fails and the reader waits
    for good). A put refuses it however it is held, and sends what comes next; both
    ``share_memory_`` leave it in its file, as torch's does. A file torch maps privately
    moves, as before: its writes never reached the file."""
    torch = import_torch()
    import numpy as np

    import tensorshare

    path = tmp_path / "data.bin"
    path.write_bytes(bytes(4 * 256))
    t = torch.from_file(str(path), shared=True, size=256, dtype=torch.float32)
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_fill_with_sevens, args=(q, back))
    p.start()
    try:
        for value in (t, t[10:20], {"x": [t[3:]]}, _Holder(t), t.untyped_storage()):
            # (TypeError where the pickler met it, naming what held it.)
            with pytest.raises((RuntimeError, TypeError), match=r"from_file\(\.\.\., shared=True\)"):
                q.put(value)
        assert tensorshare.share_memory_(t) is t
        t.untyped_storage().share_memory_()
        t[0] = 5.0
        assert np.fromfile(path, dtype=np.float32)[0] == 5.0, "the tensor left its file"
        private = torch.from_file(str(path), shared=False, size=256, dtype=torch.float32)
        assert float(private[0]) == 5.0
        q.put(private)
        assert back.get(timeout=LONG) == 7.0 * 256
        assert float(private[0]) == 7.0, "the private mapping was not moved in place"
        assert np.fromfile(path, dtype=np.float32)[0] == 5.0
    finally:
        reap(p)
    assert p.exitcode == 0


def test_a_view_a_fork_child_sends_back_is_over_the_senders_own_storage_and_its_block_stays_known():
    needs_moves_into_arenas("a sender that exits right after its put")
    # A message naming a slot the receiver has a block of (a fork child sending back a view
    # of a tensor shared before the fork, as torch's DataLoader workers send rows of a
    # dataset) maps it at the block's address. The new block made for it replaced the
    # process's record of the block there; once the received tensor went, the storage was in
    # no known block, and its next send moved it out of the memory its children share.
    import_torch()
    out = run_python(
        """
        import gc
        import torch
        import tensorshare.multiprocessing as mp
        from tensorshare import _native

        def send_row(t, q):
            q.put(t[2])

        if __name__ == "__main__":
            q = mp.Queue()
            # A block sent and kept first: the tensor below follows it in its arena, where
            # the receiver maps a slot its child sends back at the slot's own address.
            q.put(torch.zeros(5, 5))
            kept = q.get(timeout=60)
            t = torch.zeros(8, 4).share_memory_()
            storage = t.untyped_storage()
            base = storage.data_ptr()
            ctx = mp.get_context("fork")
            p = ctx.Process(target=send_row, args=(t, q))
            p.start()
            row = q.get(timeout=60)
            p.join()
            print("at", row.untyped_storage().data_ptr() == base, row.storage_offset())
            print("same storage", row.untyped_storage()._cdata == storage._cdata)
            row.fill_(5.0)
            del row
            gc.collect()
            print("known", _native.find_block(base) is not None)
            q.put(t)
            q.get(timeout=60)
            print("stays", t.untyped_storage().data_ptr() == base, t[2].tolist())
        """,
        timeout=LONG,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split("\n")[:4] == [
        "at True 8",
        "same storage True",
        "known True",
        "stays True [5.0, 5.0, 5.0, 5.0]",
    ], out.stdout + out.stderr


def _unbound(q, r):
    r.put([x.tolist() for x in q.get().unbind()])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_a_nested_tensor_of_the_strided_layout_travels():
    # Its shape cannot be read (torch raises "NestedTensorImpl doesn't support sizes"): every
    # put, send and process argument holding one failed with that error. torch's reduction
    # sends it, as torch.multiprocessing does.
    torch = import_torch()
    import tensorshare.multiprocessing as mp

    nested = torch.nested.nested_tensor([torch.arange(2.0), torch.arange(3.0)])
    want = [[0.0, 1.0], [0.0, 1.0, 2.0]]
    a, b = mp.Pipe()
    a.send({"n": nested})
    assert [x.tolist() for x in b.recv()["n"].unbind()] == want
    ctx = mp.get_context("spawn")
    q, r = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_unbound, args=(q, r))
    p.start()
    try:
        q.put(nested)
        assert r.get(timeout=LONG) == want
    finally:
        reap(p)
    assert p.exitcode == 0


def _hand_to_child(ctx, target, value):
    """Puts ``value`` on a queue for a child of ``ctx`` running ``target(q, done)``, and
    returns what the child puts on ``done``, once it has exited cleanly (reaped in any case)."""
    q, done = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=target, args=(q, done))
    p.start()
    try:
        q.put(value)
        got = done.get(timeout=LONG)
    finally:
        reap(p)
    assert p.exitcode == 0
    return got


def _fill_each_with_sevens(q, done):
    for t in q.get():
        t.fill_(7)
    done.put(True)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_torch_tensor_over_the_middle_of_a_shared_array_stays_shared_in_place(method):
    # torch.from_numpy of a view into the middle of a tensorshare.empty_shared_array has a
    # storage that starts inside a block, at no block's address: it was moved into a new
    # block like a private storage, silently, so it no longer aliased the array it was
    # made over, and the receiver's writes reached neither.
    import numpy as np

    import tensorshare
    import tensorshare.multiprocessing as mp

    torch = import_torch()
    a = tensorshare.empty_shared_array(16, "float32")
    a[...] = np.arange(16)
    middle = torch.from_numpy(a[4:8])
    as_ints = torch.from_numpy(a.view(np.int32)[9:11])  # another dtype, at an offset
    shared = torch.from_numpy(a[12:15])
    shared.share_memory_()  # in place: already shared memory
    assert middle.is_shared() and as_ints.is_shared() and shared.is_shared()
    assert _hand_to_child(mp.get_context(method), _fill_each_with_sevens, [middle, as_ints, shared])
    np.testing.assert_array_equal(a[:4], [0, 1, 2, 3])
    np.testing.assert_array_equal(a[4:8], [7, 7, 7, 7])
    np.testing.assert_array_equal(a.view(np.int32)[9:11], [7, 7])
    np.testing.assert_array_equal(a[12:15], [7, 7, 7])
    assert a[15] == 15
    # The sender's tensors still alias the array.
    middle[0] = -1
    assert a[4] == -1


def _fill_storages_with_nines(q, done):
    storages = q.get()
    for s in storages:
        s.fill_(9)
    done.put([s.nbytes() for s in storages])


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
@pytest.mark.parametrize("queue", ["tensorshare", "torch"])
def test_a_storage_over_the_middle_of_a_shared_array_arrives_as_that_part_and_shared(queue):
    # Such a storage travels as a view of its block: the receiver must get that part of the
    # block's memory as the storage, not the whole block from its start (a tensor rebuilt
    # over it would read the wrong bytes), through tensorshare's queues and torch's own.
    import numpy as np

    import tensorshare
    import tensorshare.multiprocessing as mp

    torch = import_torch()
    import torch.multiprocessing as torch_mp

    a = tensorshare.empty_shared_array(16, "float32")
    a[...] = np.arange(16)
    storage = torch.from_numpy(a[4:8]).untyped_storage()
    typed = torch.from_numpy(a[10:12]).storage()  # a TypedStorage, as torch's own code has
    ctx = (mp if queue == "tensorshare" else torch_mp).get_context("spawn")
    assert _hand_to_child(ctx, _fill_storages_with_nines, [storage, typed]) == [16, 8]
    nines = np.frombuffer(bytes([9] * 4), dtype=np.float32)[0]  # the untyped one's bytes
    np.testing.assert_array_equal(a[:4], [0, 1, 2, 3])
    np.testing.assert_array_equal(a[4:8], [nines] * 4)
    np.testing.assert_array_equal(a[8:10], [8, 9])
    np.testing.assert_array_equal(a[10:12], [9, 9])  # the typed storage's elements
    np.testing.assert_array_equal(a[12:], [12, 13, 14, 15])


def _fill_arrays_with_sevens(q, done):
    for a in q.get():
        a[...] = 7
    done.put(True)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_numpy_array_over_a_tensor_in_a_block_is_shared_not_copied(method):
    # t.numpy() of a tensor in a block has the tensor as its base, not the block: such an
    # array was copied into a new block when sent, and the receiver's writes were lost.
    import numpy as np

    import tensorshare
    import tensorshare.multiprocessing as mp

    torch = import_torch()
    t = tensorshare.empty_shared((16,), dtype=torch.float32)
    t[...] = torch.arange(16)
    arrays = [t.numpy()[4:8], np.asarray(t)[10:12], t[13:15].numpy(), t.numpy()[3:0:-2]]
    assert _hand_to_child(mp.get_context(method), _fill_arrays_with_sevens, arrays)
    seven = [0, 7, 2, 7, 7, 7, 7, 7, 8, 9, 7, 7, 12, 7, 7, 15]
    assert t.tolist() == seven


MISALIGNED_IN_A_BLOCK = """
    import warnings
    import numpy as np
    import torch
    import tensorshare
    import tensorshare.multiprocessing as mp

    warnings.filterwarnings("ignore", "TypedStorage is deprecated")

    def fill(q, done):
        t, s, u = q.get()
        t.fill_(7)
        s.fill_(8)
        u.fill_(9)
        done.put(True)

    if __name__ == "__main__":
        a = tensorshare.empty_shared_array(64, "uint8")
        a[...] = 0
        # float32 elements from byte 1 of the block: no whole number of elements from its
        # start, so no handle says where it starts.
        t = torch.from_numpy(a[1:17].view(np.float32))
        s = torch.from_numpy(a[21:29].view(np.float32)).storage()
        u = torch.from_numpy(a[33:37]).untyped_storage()
        before = t.untyped_storage().data_ptr()
        ctx = mp.get_context("spawn")
        q, done = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=fill, args=(q, done))
        p.start()
        q.put((t, s, u))
        assert done.get(timeout=60)
        p.join(60)
        assert p.exitcode == 0
        assert t.untyped_storage().data_ptr() == before, "the tensor moved"
        assert (a[1:17].view(np.float32) == 7).all(), a
        assert (a[21:29].view(np.float32) == 8).all(), a
        assert (a[33:37] == 9).all(), a
        assert a[0] == 0 and (a[17:21] == 0).all() and (a[29:33] == 0).all() and (a[37:] == 0).all(), a
        print("shared")
"""


@pytest.mark.parametrize("torch_can_move", [True, False])
def test_a_tensor_inside_a_block_at_an_odd_byte_is_shared_in_place(torch_can_move):
    # A storage at a byte no whole element reaches from its block's start: the tensor was
    # moved into a new block (the receiver's writes lost), and under a torch before 2.12
    # (which cannot move it) its put failed. It is pickled, its storage a view of the block.
    import_torch()
    prefix = (
        ""
        if torch_can_move
        else "from tensorshare import _reduction\n_reduction.can_move_in_place = lambda torch: False\n"
    )
    out = run_python(prefix + textwrap.dedent(MISALIGNED_IN_A_BLOCK), timeout=3 * LONG)
    assert out.returncode == 0 and out.stdout.split() == ["shared"], out.stdout + out.stderr


def test_a_storage_inside_a_block_named_twice_arrives_as_one_storage():
    torch = import_torch()
    import tensorshare

    a = tensorshare.empty_shared_array(16, "float32")
    middle = torch.from_numpy(a[4:8]).untyped_storage()
    got = tensorshare.roundtrip([middle, middle, {"again": middle}])
    assert got[0] is got[1] and got[0] is got[2]["again"]
    assert got[0].data_ptr() == middle.data_ptr() and got[0].nbytes() == 16


SENT_AGAIN_DURING_ITS_MOVE = """
    import gc
    import torch
    import tensorshare.multiprocessing as mp

    def child(q, back):
        while True:
            got = []
            while (t := q.get()) != "end":
                if t is None:
                    return
                got.append(t)
            for i, t in enumerate(got):  # each message's tensor writes an element of its own
                t[i] = i + 1
            back.put(len(got))

    class Cycle:
        armed = None
        def __init__(self):
            self.me = self
        def __del__(self):
            if Cycle.armed is not None:
                t, Cycle.armed = Cycle.armed, None
                q.put(t)

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        q, back = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=child, args=(q, back))
        p.start()
        wrong, twice = [], 0
        for threshold in range(1, 40):
            t = torch.zeros(16)
            gc.collect()
            gc.disable()
            Cycle.armed = t
            Cycle()
            gc.enable()
            gc.set_threshold(threshold)
            q.put(t)
            gc.set_threshold(700)
            Cycle.armed = None
            gc.collect()
            q.put("end")
            n = back.get(timeout=60)
            twice += n == 2
            if t[:n].tolist() != [float(i + 1) for i in range(n)]:
                wrong.append((threshold, t[:n].tolist()))
        q.put(None)
        p.join(60)
        assert p.exitcode == 0, p.exitcode
        print(wrong)
        print(twice)
"""


def test_a_tensor_sent_again_by_a_finaliser_in_the_middle_of_its_move_is_moved_once():
    # A small storage's move ran Python code (a collection, started by the allocation of
    # the tensor made over the new block) between finding the storage in no block and
    # swapping its memory: a finaliser that sent the same tensor then moved it into another
    # block first, so one of the two messages named a block the tensor no longer used, and
    # the receiver's writes through it were lost.
    import_torch()
    out = run_python(textwrap.dedent(SENT_AGAIN_DURING_ITS_MOVE), timeout=3 * LONG)
    assert out.returncode == 0, out.stdout + out.stderr
    wrong, twice = out.stdout.split("\n")[:2]
    assert wrong == "[]" and int(twice) > 0, out.stdout


RESIZED_DURING_ITS_MOVE = """
    import gc
    import torch
    import tensorshare.multiprocessing as mp

    def child(q, back):
        while (t := q.get()) is not None:
            t.fill_(7)
            back.put(t.untyped_storage().nbytes())

    class Cycle:
        armed = None
        def __init__(self):
            self.me = self
        def __del__(self):
            if Cycle.armed is not None:
                t, Cycle.armed = Cycle.armed, None
                t.untyped_storage().resize_(128)

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        q, back = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=child, args=(q, back))
        p.start()
        failed, fired = [], 0
        for threshold in range(1, 40):
            t = torch.zeros(16)
            gc.collect()
            gc.disable()
            Cycle.armed = t
            Cycle()
            gc.enable()
            gc.set_threshold(threshold)
            try:
                q.put(t)
                sent = True
            except Exception as e:
                failed.append((threshold, repr(e)))
                sent = False
            gc.set_threshold(700)
            fired += Cycle.armed is None
            Cycle.armed = None
            gc.collect()
            if sent:
                n = back.get(timeout=60)
                if n != t.untyped_storage().nbytes() or t.tolist() != [7.0] * 16:
                    failed.append((threshold, n, t.tolist()))
        q.put(None)
        p.join(60)
        assert p.exitcode == 0, p.exitcode
        print(failed)
        print(fired)
"""


def test_a_tensor_whose_storage_a_finaliser_resizes_in_the_middle_of_its_move_is_sent_at_its_new_size():
    needs_moves_into_arenas(
        "tensorshare's move (and torch 2.11 itself ends with SIGSEGV resizing a storage it shared)"
    )
    # A finaliser run by a collection in the middle of a move (the allocation of the tensor
    # over the new block starts one) that resized the storage made the put fail with
    # torch's "_swap_data_ptr_: storages must have the same nbytes": the move now starts
    # again at the new size, and the child's writes reach the parent.
    import_torch()
    out = run_python(textwrap.dedent(RESIZED_DURING_ITS_MOVE), timeout=3 * LONG)
    assert out.returncode == 0, out.stdout + out.stderr
    failed, fired = out.stdout.split("\n")[:2]
    assert failed == "[]" and int(fired) > 0, out.stdout


def test_a_part_of_a_block_received_keeps_its_block_after_the_blocks_own_storage_moves_away():
    # A storage received as a part of a block (a tensor at an odd byte is pickled, its
    # storage set aside as bytes) was a slice of the block's torch storage: it held that
    # storage, not the block. Once torch moved that storage into its own shared memory
    # (`_share_fd_cpu_`, what torch's own share_memory_() and reductions run), the block was
    # let go while the part still pointed into it, and its slot was handed out again.
    import gc

    import numpy as np

    import tensorshare
    from tensorshare import _native, _reduction

    torch = import_torch()
    a = tensorshare.empty_shared_array(4096, "uint8")
    a[...] = 1
    block = a.base
    r = tensorshare.roundtrip(torch.from_numpy(a[1:17].view(np.int16)))
    assert r.tolist() == [257] * 8
    part = r.untyped_storage()
    assert part.data_ptr() == block.address + 1 and part.nbytes() == 16
    own = _reduction.torch_storage(block)
    own._share_fd_cpu_()
    assert own.data_ptr() != block.address  # torch did move it
    address = block.address
    del a, block, own
    gc.collect()
    found = _native.block_covering(part.data_ptr(), part.nbytes())
    assert found is not None and found[0].address == address and found[1] == 1
    # No new block is made over the part's bytes while it lives.
    news = [tensorshare.empty_shared_array(4096, "uint8") for _ in range(256)]
    for n in news:
        start = n.__array_interface__["data"][0]
        assert start + 4096 <= part.data_ptr() or start >= part.data_ptr() + part.nbytes()
    r[...] = 7
    assert r.tolist() == [7] * 8


def test_a_part_of_a_block_arrives_as_one_storage_in_every_place_and_message_while_it_lives():
    # Each item of a list is pickled on its own, with a cache of parts of its own: a tensor
    # at an odd byte of a block, sent twice in one list, arrived over two torch storages
    # (over the same memory), where torch gives one storage while it lives.
    import numpy as np

    import tensorshare

    torch = import_torch()
    a = tensorshare.empty_shared_array(64, "uint8")
    t = torch.from_numpy(a[1:17].view(np.int16))
    first, second = tensorshare.roundtrip([t, t])
    assert first.untyped_storage()._cdata == second.untyped_storage()._cdata
    again = tensorshare.roundtrip(t)
    assert again.untyped_storage()._cdata == first.untyped_storage()._cdata
    first[0] = 3
    assert again[0] == 3 and a[1:3].view(np.int16)[0] == 3


def _fill_complex_with_fives(q, done):
    z, s = q.get()
    z.fill_(5 + 5j)
    s.fill_(6 - 6j)
    done.put(True)


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_complex_tensor_in_shared_memory_is_shared_not_copied(method):
    # The wire has no complex dtype, so such a tensor is pickled by torch's reduction; its
    # TypedStorage was then refused as a handle for its dtype and pickled by torch as a copy
    # of its bytes: the receiver's writes were lost, though is_shared() was true.
    import tensorshare.multiprocessing as mp

    torch = import_torch()
    z = torch.zeros(4, dtype=torch.complex64).share_memory_()
    s = torch.zeros(2, dtype=torch.complex128).share_memory_().storage()
    assert _hand_to_child(mp.get_context(method), _fill_complex_with_fives, (z[1:3], s))
    assert z.tolist() == [0, 5 + 5j, 5 + 5j, 0]
    assert s.tolist() == [6 - 6j, 6 - 6j]


@pytest.mark.parametrize("size", [4, 1 << 15])  # copied into its block here, and by torch
def test_a_tensor_another_thread_sends_while_share_memory_decides_is_moved_once(size, monkeypatch):
    needs_moves_into_arenas("tensorshare's move, which this torch does not make")
    # share_memory_() looks whether the storage is in a block, in Python, and then moves it:
    # another thread may take the GIL in between and send the tensor, which moves it first.
    # The second move then moved it again, into another block, so the message named a block
    # the tensor no longer used and the receiver's writes were lost. The other thread's send
    # is made here at the point where share_memory_() asks torch's strategy, after its look.
    import tensorshare.multiprocessing as mp
    from tensorshare import _reduction

    torch = import_torch()
    ctx = mp.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_fill_with_sevens, args=(q, back))
    p.start()
    try:
        t = torch.zeros(size)
        strategy = _reduction._torch_strategy
        sent = []

        def another_thread_sends():
            if not sent:
                q.put(t)
                sent.append(t.untyped_storage().data_ptr())
            return strategy()

        monkeypatch.setattr(_reduction, "_torch_strategy", another_thread_sends)
        t.share_memory_()
        assert sent and t.untyped_storage().data_ptr() == sent[0]
        assert back.get(timeout=LONG) == 7.0 * size
    finally:
        reap(p)
    assert p.exitcode == 0
    assert t.sum().item() == 7.0 * size


def test_a_storage_two_threads_move_at_once_by_both_ways_is_moved_once():
    # torch's thread count is each thread's own, and it picks the way a storage of more
    # than 64 KiB moves: copied here, the GIL held, or by torch, which lets the GIL go. A
    # thread that moved it here while another was in torch's copy moved it a first time,
    # then the other swapped it into a second block: the put named the first, and the
    # child's writes were lost (in 5 to 10% of trials). Both ways now claim the storage.
    import threading

    import tensorshare.multiprocessing as mp

    torch = import_torch()
    ctx = mp.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_sum_then_fill_with_sevens, args=(q, back))
    p.start()
    before = torch.get_num_threads()
    jobs, go, done, counts = [], threading.Semaphore(0), threading.Semaphore(0), []

    def share_in_another_thread():
        torch.set_num_threads(2)  # this thread's count: torch's copy
        counts.append(torch.get_num_threads())
        done.release()
        while True:
            go.acquire()
            if (t := jobs.pop()) is None:
                return
            t.share_memory_()
            done.release()

    worker = threading.Thread(target=share_in_another_thread)
    worker.start()
    lost = []
    try:
        done.acquire()
        torch.set_num_threads(1)  # this thread's: copied here
        for trial in range(200):
            t = torch.zeros(2 << 20, dtype=torch.uint8)
            jobs.append(t)
            go.release()
            q.put(t)
            done.acquire()
            back.get(timeout=LONG)  # the child's sum, before its fill
            assert back.get(timeout=LONG) == "filled"
            if not bool((t == 7).all()):
                lost.append(trial)
        q.put(None)
    finally:
        torch.set_num_threads(before)
        jobs.append(None)
        go.release()
        worker.join()
        reap(p)
    assert p.exitcode == 0
    assert counts == [2], counts
    assert lost == []


def test_moves_work_where_a_program_replaced_torchs_thread_count():
    # The move asks torch's C function for the calling thread's count; a program (or a
    # profiler) that wrapped it before tensorshare first used torch made every move fail,
    # even of 40 bytes. Torch copies above 64 KiB then, as before.
    import_torch()
    out = run_python(
        """
        import functools
        import torch
        count = torch._C.get_num_threads
        torch._C.get_num_threads = functools.wraps(count)(lambda: count())
        torch.set_num_threads(1)
        import tensorshare.multiprocessing  # noqa: F401
        for n in (10, 1 << 18):
            t = torch.arange(n, dtype=torch.float32)
            t.share_memory_()
            assert t.is_shared() and torch.equal(t, torch.arange(n, dtype=torch.float32))
        print("moved")
        """
    )
    assert out.returncode == 0 and out.stdout.strip() == "moved", out.stdout + out.stderr


def test_a_failed_resize_of_a_tensor_over_a_block_keeps_its_shape():
    # torch sets the new shape before it finds the storage cannot grow, and raises with it
    # kept: a write through the tensor then reached past its block, into the next slot of
    # the arena (another tensor's, maybe another process's). No block can grow.
    import tensorshare
    from tensorshare import _reduction

    torch = import_torch()
    made = tensorshare.empty_shared((4,), dtype=torch.float32)
    received = tensorshare.roundtrip(tensorshare.empty_shared(6).zero_())[1:5]
    moves = _reduction.can_move_in_place(torch)
    # A torch before 2.12 keeps its own share_memory_(), into torch's shared memory, whose
    # resize torch 2.11 itself ends with SIGSEGV (seen without tensorshare imported).
    moved = torch.zeros(2, 2).share_memory_() if moves else None
    for t in (made, received, moved):
        if t is None:
            continue
        shape, stride, offset = t.shape, t.stride(), t.storage_offset()
        t.fill_(3)
        with pytest.raises(RuntimeError, match="not resizable"):
            t.resize_(64)
        with pytest.raises(RuntimeError, match="not resizable"):
            t.resize_as_(torch.empty(8, 8))
        assert (t.shape, t.stride(), t.storage_offset()) == (shape, stride, offset)
        assert t.eq(3).all()
    # Resizes that need no more memory still work.
    made.resize_(2)
    assert made.shape == (2,)
    if moves:
        moved.resize_as_(torch.empty(4))
        assert moved.shape == (4,) and moved.eq(3).all()
