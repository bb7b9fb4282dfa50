"""Queues between Python processes: values, tensors and arrays as handles, every start
method and sharing strategy."""

import gc
import os
import queue
import threading
import warnings

import numpy as np
import pytest

import tensorshare
from conftest import LONG, import_torch, needs_moves_into_arenas, reap, run_python


def _echo(q_in, q_out):
    while True:
        item = q_in.get()
        if item is None:
            break
        q_out.put(item)


def _fill(q, value):
    t = q.get()
    t.fill_(value)


def test_plain_values_round_trip():
    values = [
        None,
        True,
        False,
        0,
        -(2**63),
        2**63 - 1,
        2**63,
        2**64 - 1,
        2**64,
        2**100,
        1.5,
        float("inf"),
        "text é",
        b"\x00bytes",
        [1, [2, [3]]],
        (1, "a", None),
        {"a": 1, 2: "b", (1, 2): [3]},
        {1, 2, 3},
        frozenset({4}),
        range(3),
        complex(1, 2),
    ]
    for v in values:
        assert tensorshare.roundtrip(v) == v
        assert type(tensorshare.roundtrip(v)) is type(v)


def test_a_str_that_is_not_utf_8_travels_as_pickle_sends_it(ctx):
    # What os.fsdecode and os.listdir give for a file name that is not UTF-8: a str with lone
    # surrogates, which UTF-8 cannot encode. pickle sends it (multiprocessing's queues
    # and pipes do), so a dataset's file list must travel here too, alone and inside a
    # value, as a key and through a pipe, to a child and back.
    name = os.fsdecode(b"img_\xff.png")
    assert name == "img_\udcff.png"
    values = [name, {"path": name, "n": 1}, [name, "plain"], {name: 1}, (name,)]
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_echo, args=(q_in, q_out))
    p.start()
    try:
        for v in values:
            q_in.put(v)
            got = q_out.get(timeout=60)
            assert got == v and type(got) is type(v)
    finally:
        q_in.put(None)
        reap(p)
    assert p.exitcode == 0
    a, b = ctx.Pipe()
    a.send({"path": name})
    assert b.recv() == {"path": name}


def test_a_value_that_contains_itself_is_pickled_whole():
    a = [1]
    a.append(a)
    b = tensorshare.roundtrip(a)
    assert b[0] == 1 and b[1] is b


def test_nesting_deeper_than_the_wire_allows_is_pickled_whole():
    # 256 levels is the wire's limit (a peer cannot overflow a receiver's stack); deeper
    # values go as one pickle, as deep as pickle itself can go (about 500 levels).
    v = 0
    for _ in range(400):
        v = [v]
    w = tensorshare.roundtrip(v)
    for _ in range(400):
        w = w[0]
    assert w == 0


def _train_step(q, back):
    torch = import_torch()
    model, opt, weight, twice, both = q.get(timeout=LONG)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    back.put(
        [
            weight is model.weight,
            twice[0] is twice[1],
            both[0].shared is both[1].shared,
            all(p.grad is not None for p in opt.param_groups[0]["params"]),
        ]
    )


class _Holder:
    def __init__(self, shared):
        self.shared = shared


def test_objects_and_tensors_that_share_an_object_share_it_in_the_receiver_as_with_pickle(ctx):
    # Each object in a value was pickled on its own: a model and its optimizer sent
    # together arrived with the optimizer's parameters apart from the model's (over the same
    # storage), so backward() gave them no grad and step() trained nothing, silently. A
    # tensor in two places arrived as two tensors, and two objects sharing a third as two
    # copies of it. pickle's memo, which torch's queues use, keeps each one object.
    torch = import_torch()
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = model.weight.detach().clone()
    t = torch.zeros(3)
    shared = [1, 2]
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_train_step, args=(q, back))
    p.start()
    try:
        q.put((model, opt, model.weight, [t, t], (_Holder(shared), _Holder(shared))))
        assert back.get(timeout=LONG) == [True, True, True, True]
    finally:
        p.join(LONG)
    assert p.exitcode == 0
    assert not torch.equal(before, model.weight.detach())  # the child's step, in place
    # A tensor named twice in a value of tensors alone is one tensor there too, and a list
    # or dict that an object and the value both hold is one list or dict.
    got = tensorshare.roundtrip([t, t, {"x": t}])
    assert got[0] is got[1] is got[2]["x"]
    for value, holder, held in [
        ((_Holder(shared), shared), lambda r: r[0].shared, lambda r: r[1]),
        ((shared, _Holder(shared)), lambda r: r[1].shared, lambda r: r[0]),
        ({"cfg": _Holder({"a": 1}), "d": None}, lambda r: r["cfg"].shared, lambda r: r["d"]),
    ]:
        if isinstance(value, dict):
            value["d"] = value["cfg"].shared
        r = tensorshare.roundtrip(value)
        assert holder(r) is held(r), value


def test_a_value_pickled_whole_pickles_each_object_once_and_leaves_no_descriptor_behind():
    # An object was pickled as it was met, then thrown away when the value turned out to
    # need pickling whole: what its pickling did stayed done. torch's reduction of a storage
    # in its own shared memory (one from torch's queues or DataLoader workers) keeps a
    # duplicate of its descriptor for the receiver, which no receiver of the thrown-away
    # pickle came to take: one descriptor more for every put.
    from multiprocessing import resource_sharer

    torch = import_torch()
    t = torch.zeros(4)
    t.untyped_storage()._share_fd_cpu_()  # in torch's own shared memory

    def kept():
        sharer = resource_sharer._resource_sharer
        return len(sharer._cache), len(os.listdir("/proc/self/fd"))

    r = tensorshare.roundtrip(_Holder(t))
    del r
    # What earlier tests left in cycles (a socket, a torch segment) is collected first: a
    # collection in the loop would close their descriptors and miscount.
    gc.collect()
    before = kept()
    for _ in range(5):
        r = tensorshare.roundtrip((_Holder(t), _Holder(1), [t]))
        assert r[0].shared is r[2][0] and float(r[0].shared.sum()) == 0.0
        del r
    gc.collect()
    assert kept() == before


class _GrowsItsDict:
    """Adds a key to ``d`` when it is pickled: a dict that changes while it is sent."""

    def __init__(self, d):
        self.d = d

    def __reduce__(self):
        self.d[f"k{len(self.d)}"] = 1
        return (int, (0,))


def test_a_dict_that_changes_size_while_it_is_sent_is_an_error_as_with_pickle(ctx, monkeypatch):
    # Turning a dict's items runs Python code (an array's parts are asked of Python, a
    # finaliser may run, another thread while a large tensor is moved); pyo3's iterator
    # panicked when the dict changed size meanwhile, and put raised pyo3's PanicException, a
    # BaseException that `except Exception` does not catch.
    import tensorshare.multiprocessing as mp
    from tensorshare import _reduction

    q = ctx.Queue()
    a, b = mp.Pipe()
    array_parts = _reduction.array_parts
    for send in (q.put, a.send):
        d = {"a": np.arange(3), "b": 1}

        def grows(obj, d=d):
            d[f"k{len(d)}"] = 1
            return array_parts(obj)

        monkeypatch.setattr(_reduction, "array_parts", grows)
        with pytest.raises(RuntimeError, match="dictionary changed size during iteration"):
            send(d)
        monkeypatch.setattr(_reduction, "array_parts", array_parts)
        # An object that changes it as it is pickled (with the dict, whole): pickle's error.
        d = {"a": np.arange(3)}
        d["b"] = _GrowsItsDict(d)
        with pytest.raises(Exception, match="dictionary changed size during iteration"):
            send(d)
    q.put({"after": [1, 2]})
    assert q.get(timeout=LONG) == {"after": [1, 2]}
    a.send({"after": 3})
    assert b.recv() == {"after": 3}


def test_lambdas_and_closures_round_trip():
    k = 7
    f = tensorshare.roundtrip(lambda x: x + k)
    assert f(1) == 8

    def outer():
        y = 3

        def inner(x):
            return x * y

        return inner

    assert tensorshare.roundtrip(outer())(5) == 15


def test_an_object_that_cannot_be_pickled_names_itself():
    import threading

    lock = threading.Lock()
    with pytest.raises(TypeError, match="cannot send lock"):
        tensorshare.roundtrip(("x", lock))
    # Inside a dict, which it might share, the dict is pickled whole: the error names both.
    with pytest.raises(TypeError, match="cannot send dict .*cannot pickle '_thread.lock'"):
        tensorshare.roundtrip({"x": lock})


@pytest.mark.parametrize(
    "dtype", ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"]
)
def test_arrays_alias_across_the_wire(dtype):
    a = np.arange(24).astype(dtype).reshape(4, 6)
    b = tensorshare.roundtrip(a)
    assert b.dtype == a.dtype and b.shape == a.shape
    np.testing.assert_array_equal(a, b)
    shared = tensorshare.empty_shared_array((4, 6), dtype)
    shared[...] = a
    view = shared[1:, ::2]
    c = tensorshare.roundtrip(view)
    np.testing.assert_array_equal(c, view)
    assert c.__array_interface__["data"][0] == view.__array_interface__["data"][0]


@pytest.mark.parametrize("dtype", [object, [("name", object), ("n", "i4")]])
def test_shared_arrays_of_python_objects_are_refused(dtype):
    # Their elements are pointers into this process's heap: another process (or a forked
    # child's write read back here) would follow them into nowhere. numpy itself makes
    # such an array over any buffer, so the refusal is the constructor's.
    with pytest.raises(TypeError, match="cannot hold Python objects"):
        tensorshare.empty_shared_array(4, dtype)


def test_shared_constructors_take_a_numpy_integer_as_a_size_as_torch_and_numpy_do():
    assert tensorshare.empty_shared_array(np.int64(4), "float32").shape == (4,)
    assert tensorshare.empty_shared_array((np.int32(2), 3), "int8").shape == (2, 3)
    torch = import_torch()
    assert tuple(tensorshare.empty_shared(np.int64(4), torch.float32).shape) == (4,)
    assert tuple(tensorshare.empty_shared(torch.Size([2, 3]), torch.complex64).shape) == (2, 3)


def test_shared_constructors_refuse_negative_sizes_as_torch_and_numpy_do():
    with pytest.raises(ValueError, match="negative dimensions are not allowed"):
        tensorshare.empty_shared_array((-2, -2), "float32")
    with pytest.raises(ValueError, match="negative dimensions are not allowed"):
        tensorshare.empty_shared_array((3, -1), "int8")
    torch = import_torch()
    # A dtype the wire carries (made in Rust) and one it does not (complex: made here).
    for dtype in (torch.float32, torch.complex64):
        for shape in ((-2, 0), (-2, -3), (3, -1)):
            with pytest.raises(RuntimeError, match="negative dimension"):
                tensorshare.empty_shared(shape, dtype)


def test_a_receiver_without_torch_is_told_that_torch_is_what_it_lacks():
    needs_moves_into_arenas("a storage that travels as a handle")
    # A storage (or a tensor of a dtype numpy lacks) needs torch where it arrives; a
    # process without it says so, not that the message lacks what it carries.
    torch = import_torch()
    import subprocess
    import sys

    import tensorshare.multiprocessing as mp

    child_code = (
        "import sys\n"
        "sys.modules['torch'] = None  # as where torch is not installed\n"
        "import tensorshare\n"
        "q = tensorshare.inherited()\n"
        "try:\n"
        "    print('got', q.get(timeout=60))\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    q = mp.Queue()
    child = tensorshare.popen([sys.executable, "-c", child_code], q, stdout=subprocess.PIPE, text=True)
    q.put(torch.arange(2.0).untyped_storage())
    out, _ = child.communicate(timeout=LONG)
    assert child.returncode == 0, out
    assert out.startswith("UnpicklingError") and "torch is not imported in this process" in out, out


def test_a_read_only_view_of_a_shared_array_arrives_read_only_and_aliased():
    # The receiver's view must not write where the sender made its view read-only; a
    # writable view stays writable, and both alias the block.
    shared = tensorshare.empty_shared_array(4, "float32")
    shared[:] = 1
    ro = shared.view()
    ro.flags.writeable = False
    for sent, writeable in ((ro, False), (shared[1:], True)):
        got = tensorshare.roundtrip(sent)
        assert got.flags.writeable is writeable
        assert got.__array_interface__["data"][0] == sent.__array_interface__["data"][0]
        np.testing.assert_array_equal(got, sent)


@pytest.mark.parametrize("n", [1000, 4_000_000])
def test_an_array_of_a_tensor_moved_by_the_same_put_is_sent_from_its_old_memory(n):
    # The put moves t into shared memory before it reaches t.numpy(), which views t's old
    # memory: that memory is kept until the value is sent, so the array's copy is right
    # (torch's queue copies it from freed memory: garbage, or SIGSEGV for a large one). The
    # sender's array views freed memory afterwards, as after torch's share_memory_().
    torch = import_torch()
    from tensorshare import _reduction

    if not _reduction.can_move_in_place(torch):
        pytest.skip(
            "torch < 2.12 moves the storage itself (torch's share_memory_(), in torch's reduction), "
            "freeing its old memory at once, as with torch's own queues"
        )
    t = torch.full((n,), 3.0)
    got_t, got_a = tensorshare.roundtrip([t, t.numpy()])
    assert bool((got_t == 3).all()) and bool((got_a == 3).all())
    assert t.is_shared()


def test_a_fortran_order_array_arrives_in_fortran_order_as_pickle_keeps_it():
    a = np.asfortranarray(np.arange(24.0).reshape(2, 3, 4))
    b = tensorshare.roundtrip(a)
    np.testing.assert_array_equal(a, b)
    assert b.flags.f_contiguous and b.strides == a.strides
    # Any other layout arrives C-contiguous, as pickle makes it.
    c = tensorshare.roundtrip(np.arange(24.0).reshape(4, 6)[:, ::2])
    assert c.flags.c_contiguous


def test_empty_and_zero_dimensional_arrays():
    for a in [np.zeros((0, 3), "float32"), np.array(5, "int64"), np.ones((2, 0, 2))]:
        b = tensorshare.roundtrip(a)
        assert b.shape == a.shape and b.dtype == a.dtype
        np.testing.assert_array_equal(a, b)


def test_what_travels_is_what_torch_reports_however_torch_tensor_was_patched(monkeypatch):
    needs_moves_into_arenas("tensors sent as handles, whatever torch.Tensor's Python methods do")
    # A tensor's geometry, dtype and storage are read from torch's C type, not through
    # torch.Tensor, a Python class any program may patch: a lie there changes nothing.
    torch = import_torch()
    t = torch.arange(6, dtype=torch.float32)
    decoy = torch.full((64,), 7.0)
    monkeypatch.setattr(torch.Tensor, "untyped_storage", lambda self: decoy.untyped_storage())
    monkeypatch.setattr(torch.Tensor, "storage_offset", lambda self: 3)
    monkeypatch.setattr(torch.Tensor, "stride", lambda self, dim=None: (0,))
    monkeypatch.setattr(torch.Tensor, "shape", property(lambda self: torch.Size([64])))
    monkeypatch.setattr(torch.Tensor, "dtype", property(lambda self: torch.float64))
    monkeypatch.setattr(torch.Tensor, "is_cpu", property(lambda self: False))
    got = tensorshare.roundtrip(t)
    monkeypatch.undo()
    assert got.dtype == torch.float32 and got.shape == (6,) and got.stride() == (1,)
    assert got.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert got.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert decoy.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def test_torch_tensors_alias_and_keep_their_flags():
    torch = import_torch()
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view = t[:, 1]
    p = torch.nn.Parameter(torch.ones(2))
    g = torch.zeros(3, requires_grad=True)
    got = tensorshare.roundtrip({"t": t, "v": view, "p": p, "g": g})
    # Sending moved t's storage into shared memory in place: the earlier view followed.
    assert t.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()
    assert got["t"].untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert got["v"].untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert got["v"].stride() == view.stride() and got["v"].storage_offset() == view.storage_offset()
    assert isinstance(got["p"], torch.nn.Parameter) and got["p"].requires_grad
    assert got["g"].requires_grad and not isinstance(got["g"], torch.nn.Parameter)
    got["t"][0, 0] = 42
    assert t[0, 0] == 42


def test_every_torch_dtype_travels():
    torch = import_torch()
    for dt in [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]:
        t = (torch.arange(10) % 2).to(dt)
        assert torch.equal(tensorshare.roundtrip(t), t)
    for dt in [torch.float16, torch.bfloat16, torch.float32, torch.float64]:
        t = torch.linspace(-1, 1, 10, dtype=dt)
        r = tensorshare.roundtrip(t)
        assert r.dtype == dt and torch.equal(r, t)
    # dtypes without a tensorshare dtype travel by value, pickled
    c = torch.tensor([1 + 2j])
    assert torch.equal(tensorshare.roundtrip(c), c)


def test_sending_a_tensor_pickled_with_its_typed_storage_warns_nothing():
    # torch pickles such a tensor with a TypedStorage, whose own getters warn that the class
    # is deprecated: the package reads what it needs through its untyped storage.
    torch = import_torch()
    for t in (torch.tensor([1 + 2j]), torch.tensor([1, 2, 3], dtype=torch.uint16)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = tensorshare.roundtrip({"t": t})["t"]
        assert torch.equal(got, t)


def test_empty_shared_makes_tensors_that_travel_without_a_copy(ctx):
    torch = import_torch()
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.bool, torch.int64, torch.complex64]
    for dtype in dtypes:
        for shape in [(5,), (2, 3, 4), (0, 3)]:
            t = tensorshare.empty_shared(shape, dtype)
            assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
            if t.numel() == 0:
                continue
            assert t.is_shared()
            if dtype == torch.complex64:
                continue  # no tensorshare dtype: made in shared memory, but sent pickled
            # Sent (here, to this process) as a handle: the very same memory, one storage.
            got = tensorshare.roundtrip([t, t[1:]])
            assert all(g.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for g in got)
            assert got[1].storage_offset() == t[1:].storage_offset()
    t = tensorshare.empty_shared((4, 2))
    t.zero_()
    q = ctx.Queue()
    p = ctx.Process(target=_fill, args=(q, 6.0))
    p.start()
    q.put(t)
    p.join(60)
    assert p.exitcode == 0 and float(t.sum()) == 48.0


def test_non_leaf_tensors_that_require_grad_are_refused_as_torch_does():
    torch = import_torch()
    x = torch.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="Cowardly refusing to serialize non-leaf tensor"):
        tensorshare.roundtrip(x * 2)


def test_meta_and_empty_tensors():
    torch = import_torch()
    m = torch.empty(3, 4, device="meta")
    r = tensorshare.roundtrip(m)
    assert r.device.type == "meta" and r.shape == m.shape
    e = torch.empty(0, 5)
    r = tensorshare.roundtrip(e)
    assert r.shape == (0, 5)


def test_queue_between_processes_every_start_method(ctx, strategy):
    torch = import_torch()
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_echo, args=(q_in, q_out))
    p.start()
    t = torch.zeros(5)
    a = np.arange(4.0)
    q_in.put({"t": t, "a": a, "s": "x", "f": lambda v: v + 1})
    got = q_out.get(timeout=60)
    q_in.put(None)
    p.join(60)
    assert p.exitcode == 0
    assert got["s"] == "x" and got["f"](1) == 2
    assert got["t"].untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    np.testing.assert_array_equal(got["a"], a)


def test_a_child_writes_what_the_parent_sees(ctx, strategy):
    torch = import_torch()
    q = ctx.Queue()
    p = ctx.Process(target=_fill, args=(q, 4.0))
    p.start()
    t = torch.zeros(6)
    q.put(t)
    p.join(60)
    assert p.exitcode == 0
    assert torch.all(t == 4.0)


# Sizes on either side of the word (8 bytes) and of the largest storage copied into its block
# by tensorshare rather than by torch (64 KiB), at every alignment of the storage's first byte.
_MOVE_SIZES = [1, 7, 8, 9, 13, 1024, 65535, 65536, 65537, 200_000]
_MOVE_OFFSETS = [0, 1, 3, 5, 8]


def test_moving_a_storage_keeps_every_byte_at_every_size_and_alignment(ctx):
    torch = import_torch()
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_echo, args=(q_in, q_out))
    p.start()
    pattern = bytes((i * 131 + 7) % 251 for i in range(max(_MOVE_SIZES) + max(_MOVE_OFFSETS)))
    for n in _MOVE_SIZES:
        for offset in _MOVE_OFFSETS:
            # A storage over a bytearray, starting `offset` bytes into it: its first byte lies
            # at any alignment, and its last byte ends wherever `n` puts it.
            t = torch.frombuffer(bytearray(pattern), dtype=torch.uint8, offset=offset, count=n)
            assert t.untyped_storage().nbytes() == n
            q_in.put(t)
            got = q_out.get(timeout=60)
            want = pattern[offset : offset + n]
            # The sender's storage moved into shared memory with its bytes, and the child got
            # (and sent back) that same memory.
            assert t.untyped_storage().is_shared(), (n, offset)
            assert got.untyped_storage().data_ptr() == t.untyped_storage().data_ptr(), (n, offset)
            assert bytes(t.numpy()) == want, (n, offset)
            assert bytes(got.numpy()) == want, (n, offset)
    q_in.put(None)
    p.join(60)
    assert p.exitcode == 0


def _flat_then_view(q_in, q_out):
    import torch

    a = q_in.get()  # flat, over the whole of its block: the first tensor over it here
    b = q_in.get()  # a view of the same storage, in a later message
    p = q_in.get()  # a flat Parameter over a block of its own
    same = a.untyped_storage()._cdata == b.untyped_storage()._cdata
    b[0] = 7.0
    param = isinstance(p, torch.nn.Parameter) and p.requires_grad
    q_out.put((same, a._is_view(), a.shape, param, a))


def test_a_whole_flat_tensor_received_first_keeps_its_storage_for_later_views(ctx):
    needs_moves_into_arenas("a sender that exits right after its put")
    torch = import_torch()
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_flat_then_view, args=(q_in, q_out))
    p.start()
    x = torch.zeros(8)
    q_in.put(x)
    q_in.put(x[2:5])
    q_in.put(torch.nn.Parameter(torch.ones(4)))
    same, is_view, shape, param, back = q_out.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0
    # One torch storage per block in the child too, so the view's write reached x.
    assert same and not is_view and shape == (8,) and param
    assert x[2] == 7.0
    assert back.untyped_storage()._cdata == x.untyped_storage()._cdata


def test_get_timeout_and_nowait_raise_empty():
    import tensorshare.multiprocessing as mp

    q = mp.Queue()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.01)
    with pytest.raises(queue.Empty):
        q.get_nowait()
    assert q.empty()
    q.put(1)
    assert not q.empty()
    assert q.get() == 1


def test_closed_queues_answer_as_multiprocessings_do():
    import tensorshare.multiprocessing as mp

    q = mp.Queue()
    with pytest.raises(AssertionError, match="not closed"):
        q.join_thread()
    q.put(1)
    q.close()
    q.join_thread()
    with pytest.raises(ValueError, match="is closed"):
        q.put(2)
    s = mp.SimpleQueue()
    s.put(1)
    s.close()
    for use in (lambda: s.put(2), s.get, s.empty):
        with pytest.raises(OSError, match="handle is closed"):
            use()


def test_a_bounded_queue_raises_full():
    import tensorshare.multiprocessing as mp

    q = mp.Queue(maxsize=2)
    q.put(1)
    q.put(2)
    with pytest.raises(queue.Full):
        q.put(3, timeout=0.01)
    with pytest.raises(queue.Full):
        q.put_nowait(3)
    assert q.get() == 1
    q.put(3)


def _put_after(q, ready, value):
    ready.wait(LONG)
    q.put(value)


def test_a_timeout_already_past_looks_without_waiting_and_an_infinite_one_waits(ctx):
    # As in multiprocessing, a timeout of zero or less looks without waiting: the usual
    # `timeout=deadline - time.monotonic()` once the deadline has passed raises Empty or
    # Full, and a put on an unbounded queue goes in. An infinite timeout waits for good
    # (multiprocessing raises OverflowError there); NaN is an error, as there.
    q, bounded = ctx.Queue(), ctx.Queue(maxsize=1)
    with pytest.raises(queue.Empty):
        q.get(timeout=-0.05)
    q.put("in", timeout=-1.0)
    assert q.get(timeout=LONG) == "in"
    bounded.put(0)
    with pytest.raises(queue.Full):
        bounded.put(1, timeout=-1.0)
    with pytest.raises(ValueError, match="nan"):
        q.get(timeout=float("nan"))
    a, b = ctx.Pipe()
    assert not b.poll(-1.0)
    a.send(1)
    assert b.poll(LONG) and b.poll(-1.0) and b.recv() == 1
    # A value a child puts while the parent waits with no end (in a thread, so that a bug
    # fails the test rather than hang it).
    ready = ctx.Event()
    p = ctx.Process(target=_put_after, args=(q, ready, "late"))
    p.start()
    got = []
    waiter = threading.Thread(target=lambda: got.append(q.get(timeout=float("inf"))), daemon=True)
    waiter.start()
    ready.set()
    waiter.join(LONG)
    reap(p)
    assert got == ["late"] and p.exitcode == 0


def _take_one_put_two(q):
    first = q.get()
    q.put(first + 10)
    q.put(first + 20)


@pytest.mark.parametrize("maxsize", [0, 8])
def test_qsize_and_full_count_what_every_process_put_and_took(ctx, maxsize):
    # multiprocessing.Queue's qsize, full and maxsize, with a child putting and taking.
    q = ctx.Queue(maxsize)
    assert (q.qsize(), q.empty(), q.full()) == (0, True, False)
    for i in range(3):
        q.put(i)
    assert q.qsize() == 3
    p = ctx.Process(target=_take_one_put_two, args=(q,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert q.qsize() == 4
    assert q._q.maxsize == maxsize
    if maxsize:
        for i in range(4):
            q.put(100 + i)
        assert q.full() and q.qsize() == 8
    # A value poll (or empty) took off the queue for this process still counts.
    assert not q.empty() and q._reader.poll(1) and q.qsize() == (8 if maxsize else 4)
    got = sorted(q.get() for _ in range(q.qsize()))
    assert got[:4] == [1, 2, 10, 20]
    assert (q.qsize(), q.empty(), q.full()) == (0, True, False)


def _get_into(q, out):
    out.put(q.get())


def test_a_value_poll_took_for_the_parent_is_not_a_forked_childs():
    # poll() (what multiprocessing's Pool asks of its queue's reader) takes the next value
    # off the queue for this process; a child forked afterwards inherited a copy of it, and
    # got it a second time.
    import tensorshare.multiprocessing as mp

    ctx = mp.get_context("fork")
    q, out = ctx.Queue(), ctx.Queue()
    q.put("first")
    q.put("second")
    assert q._reader.poll(0)
    p = ctx.Process(target=_get_into, args=(q, out))
    p.start()
    assert out.get(timeout=60) == "second"
    p.join(60)
    assert p.exitcode == 0
    assert q.get(timeout=1) == "first" and q.empty()


def test_a_sender_may_exit_before_the_receiver_gets(ctx):
    needs_moves_into_arenas("a sender that exits before the receiving")
    torch = import_torch()
    q = ctx.Queue()

    def send(q):
        q.put(torch.full((1000,), 3.0))

    p = ctx.Process(target=send, args=(q,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    t = q.get(timeout=60)
    assert float(t.sum()) == 3000.0


def _put_large_then_small(q):
    q.put(b"x" * 100_000)  # larger than a lane cell: the queue's socket
    q.put(1)


def test_a_value_put_after_a_producer_was_joined_comes_after_its_values(ctx):
    # torch's pattern: join the producers, then put an end marker for the consumer. The
    # marker, small, went through the lane and was taken before the producer's values still
    # in the socket, so a consumer stopping at it left them behind.
    q = ctx.Queue()
    p = ctx.Process(target=_put_large_then_small, args=(q,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    q.put(None)
    got = [q.get(timeout=60) for _ in range(3)]
    assert got == [b"x" * 100_000, 1, None]


def _put_many(q, n, done=None, cancel_join_thread=False):
    # numpy arrays, which travel as handles as tensors do: the behaviour under test is the
    # queue's, and a child cannot skip a test for want of torch (its skip would be a failure)
    for i in range(n):
        q.put(np.full(256, float(i), dtype=np.float32))
    if cancel_join_thread:
        q.cancel_join_thread()
    if done is not None:
        done.set()


def test_a_childs_puts_never_wait_and_it_leaves_once_they_are_written(ctx):
    # More values than the queue's socket holds, put before anyone reads: every put of the
    # child returns at once (a forked child's used to wait for room in the socket), and what
    # still waits in its outbox when its target returns is written out before it leaves.
    n = 3000
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_put_many, args=(q, n, done))
    p.start()
    assert done.wait(timeout=60), "a put waited for a reader"
    got = [q.get(timeout=60) for _ in range(n)]
    p.join(60)
    assert p.exitcode == 0
    assert [int(t[0]) for t in got] == list(range(n))


def test_cancel_join_thread_lets_a_child_leave_with_values_unwritten(ctx):
    # As multiprocessing's: a child whose reader stopped reading (a DataLoader worker told
    # to stop) leaves without waiting for room; what did not fit is lost.
    n = 3000
    q = ctx.Queue()
    p = ctx.Process(target=_put_many, args=(q, n), kwargs={"cancel_join_thread": True})
    p.start()
    p.join(60)
    assert p.exitcode == 0
    first = q.get(timeout=60)
    assert int(first[0]) == 0


def test_a_child_of_os_fork_may_leave_by_os_exit_right_after_its_puts():
    needs_moves_into_arenas("a sender that exits right after its put")
    # Not started by the package, so it will not write out an outbox on its way out: its
    # puts write directly, waiting for room, and nothing is lost to os._exit. The values
    # are more than the socket holds, and the parent reads only once the queue has some:
    # a child that let them wait in an outbox would leave with the rest unwritten. Lists of
    # 20 tensors keep the socket and single tensors take the lane, alternately: each single
    # one waits for the list before it to be taken, so they arrive in order. (In a process
    # of its own, which forks with one thread.)
    import_torch()
    r = run_python(
        """
        import os, time, torch
        import tensorshare.multiprocessing as mp

        n = 400
        q = mp.Queue()
        pid = os.fork()
        if pid == 0:
            try:
                for i in range(n):
                    if i % 2:
                        q.put(torch.full((64,), float(i)))
                    else:
                        q.put([torch.full((64,), float(i)) for _ in range(20)])
            finally:
                os._exit(0)
        deadline = time.monotonic() + 60
        while q.qsize() < 40 and time.monotonic() < deadline:
            os.sched_yield()
        got = [q.get(timeout=60) for _ in range(n)]
        assert os.waitpid(pid, 0)[1] == 0
        order = [int(v[0] if isinstance(v, torch.Tensor) else v[19][0]) for v in got]
        assert order == list(range(n)), order[:20]
        print("ok")
        """,
        timeout=180,
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_a_child_forked_while_threads_poll_a_queue_can_use_the_queue():
    # Threads of the parent poll the queue, with the GIL released inside the package,
    # holding the queue's locks of their process meanwhile; the main thread forks again and
    # again. Each child uses the queue once (a poll, a put) and leaves: it must not find a
    # lock held by a thread it does not have (about 1 fork in 40 hung for good before each
    # process locked its own), and it holds the queue through one description of its own,
    # as its parent does, whether or not a thread held the lock at the fork (the copy of its
    # parent's is closed: one kept open would count as another holder of the queue for as
    # long as the child lives). A child that hangs is killed by its alarm. (In a process of
    # its own.)
    r = run_python(
        """
        import collections, os, queue, signal, threading
        import tensorshare.multiprocessing as mp

        q = mp.Queue()
        stop = threading.Event()

        def poll():
            while not stop.is_set():
                try:
                    q.get_nowait()
                except queue.Empty:
                    pass

        def read_locked():
            # Open descriptions of this process with an OFD read lock: the queue's hold.
            n = 0
            for fd in os.listdir("/proc/self/fd"):
                try:
                    with open(f"/proc/self/fdinfo/{fd}") as f:
                        info = f.read()
                except OSError:
                    continue
                n += "OFDLCK" in info and "READ" in info
            return n

        holds = read_locked()
        threads = [threading.Thread(target=poll) for _ in range(3)]
        for t in threads:
            t.start()
        children = collections.Counter()
        try:
            for i in range(300):
                r, w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    signal.alarm(20)
                    try:
                        try:
                            q.get_nowait()
                        except queue.Empty:
                            pass
                        q.put(2)
                        os.write(w, str(read_locked()).encode())
                    finally:
                        os._exit(0)
                os.close(w)
                got = os.read(r, 16).decode()
                os.close(r)
                _, status = os.waitpid(pid, 0)
                children["hung" if status else got] += 1
        finally:
            stop.set()
            for t in threads:
                t.join()
        print(holds, dict(children))
        """,
        timeout=LONG,
    )
    assert r.returncode == 0 and r.stdout.strip() == "1 {'1': 300}", r.stdout + r.stderr


def test_a_queue_travels_inside_a_queue(ctx):
    q = ctx.Queue()
    inner = ctx.Queue()
    q.put(inner)
    got = q.get()
    got.put("through the received handle")
    assert inner.get(timeout=10) == "through the received handle"


def test_pickling_a_queue_outside_a_process_start_is_an_error():
    import pickle

    import tensorshare.multiprocessing as mp

    with pytest.raises(RuntimeError, match="cannot be pickled otherwise"):
        pickle.dumps(mp.Queue())


def test_a_replaced_queue_empty_is_a_type_error_not_a_panic(monkeypatch):
    # The deadline errors are queue.Empty and queue.Full, looked up when raised; a program
    # that replaced them with a non-class gets a TypeError, not a Rust panic.
    from tensorshare import _native

    monkeypatch.setattr(queue, "Empty", 5)
    with pytest.raises(TypeError, match="queue.Empty is not a class"):
        _native.Queue().get(block=False)


def test_dropping_a_queue_with_values_unwritten_does_not_wait_for_a_reader_in_this_process():
    # Before: the GC's drop of the queue waited, holding the GIL, for its outbox to be
    # written while a message carrying the queue was in flight, here in another queue that
    # only this process would read: the process hung at `del q`.
    out = run_python(
        """
        import gc
        import tensorshare.multiprocessing as mp

        q, r = mp.Queue(), mp.Queue()
        r.put(q)  # a message carrying q, in flight
        for i in range(3000):
            q.put(i.to_bytes(4, "little") * 250)  # more than the socket holds
        del q
        gc.collect()
        print("dropped", flush=True)
        again = r.get(timeout=60)
        got = [int.from_bytes(again.get(timeout=60)[:4], "little") for _ in range(3000)]
        assert got == list(range(3000))
        print("all written")
        """,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["dropped", "all written"], out.stdout


def _put_and_drop(r, s, n):
    q = r.get(timeout=60)
    for i in range(n):
        q.put(i.to_bytes(4, "little") * 250)
    del q
    s.put("dropped")


def test_a_child_that_drops_a_queue_goes_on_and_still_writes_it_out_before_it_leaves(ctx):
    r, s, q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_put_and_drop, args=(r, s, 3000))
    p.start()
    try:
        r.put(q)
        # Nothing reads q yet: the child's drop goes on without waiting for that.
        assert s.get(timeout=60) == "dropped"
        got = [int.from_bytes(q.get(timeout=60)[:4], "little") for _ in range(3000)]
        assert got == list(range(3000))
    finally:
        reap(p)
    assert p.exitcode == 0


def _consume_tasks(q, results):
    while True:
        item = q.get(timeout=60)
        if item is None:
            q.task_done()
            return
        results.put(item * 2)
        q.task_done()


def test_a_joinable_queue_counts_tasks_across_processes(ctx):
    q, results = ctx.JoinableQueue(), ctx.Queue()
    p = ctx.Process(target=_consume_tasks, args=(q, results))
    p.start()
    try:
        for i in range(50):
            q.put(i)
        q.put(None)
        q.join()  # returns once the child has called task_done for all 51
        assert sorted(results.get(timeout=60) for _ in range(50)) == [2 * i for i in range(50)]
    finally:
        reap(p)
    assert p.exitcode == 0
    with pytest.raises(ValueError, match="task_done"):
        q.task_done()


def test_a_bounded_joinable_queue_lets_its_consumer_call_task_done_while_the_producer_waits():
    # Before: put waited for room while holding the queue's condition, which the
    # consumer's task_done takes between its gets, so a producer ahead of its consumer
    # stopped both for good (multiprocessing's waits for room first, then takes it).
    for method in ("fork", "spawn"):
        out = run_python(
            f"""
            import tensorshare.multiprocessing as mp

            def consume(q, n):
                for i in range(n):
                    assert q.get(timeout=60) == i
                    q.task_done()

            if __name__ == "__main__":
                ctx = mp.get_context("{method}")
                q = ctx.JoinableQueue(maxsize=1)
                p = ctx.Process(target=consume, args=(q, 300))
                p.start()
                for i in range(300):
                    q.put(i)
                q.join()
                p.join(60)
                print("joined", p.exitcode)
            """,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout == "joined 0\n", (method, out.stdout)


def test_a_joinable_put_that_fails_takes_its_task_back():
    import tensorshare.multiprocessing as mp

    q = mp.get_context("spawn").JoinableQueue(maxsize=1)
    q.put("a")
    with pytest.raises(queue.Full):
        q.put_nowait("b")
    with pytest.raises(queue.Full):
        q.put("b", timeout=0.01)
    with pytest.raises(TypeError, match="lock"):
        q.put(threading.Lock())  # refused before any wait for room
    assert q.get(timeout=60) == "a"
    q.task_done()
    q.join()  # one task was counted, and it is done: the failed puts left none behind
    with pytest.raises(ValueError, match="task_done"):
        q.task_done()


@pytest.mark.parametrize("kind", ["Queue", "SimpleQueue", "JoinableQueue"])
def test_empty_takes_no_value_away_from_the_processes_that_read_the_queue(ctx, kind):
    # Before: empty() took the next value off the queue and kept it for this process, so a
    # parent waiting for its workers with `while not q.empty()` kept one task from them
    # (and waited for good).
    q, out = getattr(ctx, kind)(), ctx.Queue()
    # Neither naming the queue nor a get that waits on it with no other process holding
    # it may make empty() take values (both used to route them through the socket).
    assert "tensorshare" in repr(q) and "tensorshare" in repr(q._q)
    if kind != "SimpleQueue":  # whose get takes no timeout
        with pytest.raises(queue.Empty):
            q.get(timeout=0.05)
    for i in range(10):
        q.put(i)
    assert not q.empty()
    p = ctx.Process(target=_get_ten, args=(q, out))
    p.start()
    try:
        assert out.get(timeout=60) == list(range(10))
    finally:
        reap(p)
    assert p.exitcode == 0
    assert q.empty()


def _get_ten(q, out):
    got = []
    for _ in range(10):
        got.append(q.get())  # a SimpleQueue's get takes no timeout: the parent's does
        if hasattr(q, "task_done"):
            q.task_done()
    out.put(got)


def test_empty_tells_apart_a_value_and_a_wake_up_once_someone_waits_on_the_queue():
    # Once a process waits on the queue's descriptor (multiprocessing.connection.wait, as
    # Pool does), a record in its socket may be a wake-up with no value: empty() still says
    # no value waits once the values are gone, and yes while one does.
    from multiprocessing.connection import wait

    import tensorshare.multiprocessing as mp

    q = mp.get_context("spawn").Queue()
    assert q.empty() and wait([q._reader], timeout=0) == []
    q.put("a")
    assert wait([q._reader], timeout=60) == [q._reader]
    assert not q.empty()
    assert q.get(timeout=60) == "a"
    assert q.empty()
    q.put("b")
    assert not q.empty() and q.get(timeout=60) == "b" and q.empty()


class _Node:
    def __init__(self):
        self.v = 0


def _identities(q, out):
    lists, dicts, nodes, tensors, handles = q.get(timeout=60)
    lists[0].append(1)
    nodes[0].v = 42
    out.put(
        (
            lists[1] == [1],
            dicts["x"] is dicts["y"],
            nodes[1].v,
            tensors[0] is tensors[1],
            handles[0].data_ptr() == handles[1].data_ptr(),
        )
    )


def test_an_object_in_two_places_of_a_value_is_one_object_in_the_receiver(ctx):
    # Before: each place became a copy of its own (a list, a dict, an object pickled once
    # per place), where pickle and torch.multiprocessing keep one object. Tensors in a value
    # that is pickled whole are one object too; in a value sent as handles (what a Rust
    # receiver reads) each place is a tensor over the one storage.
    torch = import_torch()
    shared_list, cfg, node, t = [], {"lr": 0.1}, _Node(), torch.zeros(3)
    handles = torch.ones(2)
    value = ([shared_list, shared_list], {"x": cfg, "y": cfg}, [node, node], (t, t), (handles, handles))
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_identities, args=(q, out))
    p.start()
    try:
        q.put(value)
        assert out.get(timeout=60) == (True, True, 42, True, True)
    finally:
        reap(p)
    assert p.exitcode == 0
    # Without any object in two places, tensors in two places stay handles.
    got = tensorshare.roundtrip((handles, handles))
    assert got[0].data_ptr() == got[1].data_ptr() == handles.data_ptr()
    # A list that holds itself is pickled at once, not after 256 levels.
    a = [1]
    a.append(a)
    b = tensorshare.roundtrip(a)
    assert b[1] is b


def _put(q, value):
    q.put(value)


def test_a_pickled_object_with_tensors_at_the_deepest_level_allowed_arrives():
    needs_moves_into_arenas("a sender that exits right after its put")
    # A list nested 255 deep around an object pickled with a tensor inside it: the object
    # was a value at level 256, its tensor at level 257, past what every receiver reads
    # ("nested deeper than 256 levels"), though the put had gone through.
    import collections

    import tensorshare.multiprocessing as mp

    torch = import_torch()
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    t = torch.arange(4.0)
    for depth in (250, 253, 254, 255, 256, 300):
        value = collections.OrderedDict(t=t)
        for _ in range(depth):
            value = [value]
        p = ctx.Process(target=_put, args=(q, value))
        p.start()
        got = q.get(timeout=LONG)
        reap(p)
        for _ in range(depth):
            (got,) = got
        assert isinstance(got, collections.OrderedDict) and got["t"].tolist() == [0.0, 1.0, 2.0, 3.0], depth


def test_map_keys_from_another_language_that_python_cannot_hash():
    # A Rust map keyed by a Vec sends list keys; Python's keys are hashable: they arrive as
    # tuples. A map keyed by a map has no Python form: a ValueError that says so, rather than
    # a bare "unhashable type".
    from tensorshare import _native

    data, fds, _ = _native.export({(1, 2): 3})
    assert bytes(data).endswith(bytes.fromhex("08010702020202040206"))  # {(1, 2): 3}
    as_list = bytes(data)[:-10] + bytes.fromhex("08010602020202040206")  # {[1, 2]: 3}
    assert _native.import_(as_list, list(fds)) == {(1, 2): 3}
    data, fds, _ = _native.export({(("a", 1),): 3})
    assert bytes(data).endswith(bytes.fromhex("08010701070204016102020206"))  # {(("a", 1),): 3}
    as_dict = bytes(data)[:-13] + bytes.fromhex("08010701080104016102020206")  # {({"a": 1},): 3}
    with pytest.raises(ValueError, match="a dict key that is a dict"):
        _native.import_(as_dict, list(fds))


def _overwrite_each(q, done):
    for a in q.get():
        a[...] = a[::-1].copy() if a.ndim else a
    done.put(True)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_shared_arrays_of_every_fixed_size_dtype_and_their_views_stay_shared(method):
    # Only nine dtypes in this machine's byte order, and views with no negative stride,
    # travelled as handles: every other array of tensorshare.empty_shared_array was copied,
    # silently, and the receiver's writes were lost. They travel as views of their block.
    import tensorshare.multiprocessing as mp

    dtypes = ["uint16", "uint64", "complex64", ">f4", "datetime64[s]", "U3", [("a", "<i4"), ("b", "<f8")]]
    arrays = []
    for dt in dtypes:
        a = tensorshare.empty_shared_array(4, dt)
        a[...] = np.arange(4).astype(a.dtype) if a.dtype.fields is None else [(i, i / 2) for i in range(4)]
        arrays.append(a)
    f, g = tensorshare.empty_shared_array(8, "float32"), tensorshare.empty_shared_array(8, "int32")
    f[...], g[...] = np.arange(8), np.arange(8)
    arrays += [f[::-1][:4], g[5:1:-1].view(">i4")]  # negative strides, and another byte order
    before = [a.copy() for a in arrays]
    ctx = mp.get_context(method)
    q, done = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_overwrite_each, args=(q, done))
    p.start()
    try:
        q.put(arrays)
        assert done.get(timeout=LONG)
    finally:
        reap(p)
    assert p.exitcode == 0
    for a, b in zip(arrays, before, strict=True):
        np.testing.assert_array_equal(a, b[::-1], err_msg=str(a.dtype))


def test_a_list_at_the_deepest_level_allowed_travels_as_lists():
    # 256 levels, the most a receiver reads: lists all the way, not a pickle (a Rust reader
    # gets nested lists); one level more is pickled whole.
    from tensorshare import _native

    def nest(levels):
        v = 0
        for _ in range(levels - 1):
            v = [v]
        return v

    data, _, _ = _native.export(nest(256))
    assert bytes(data).count(b"\x06\x01") == 255 and b"\x0d" not in bytes(data)
    assert _native.import_(bytes(data), []) == nest(256)
    data, _, _ = _native.export(nest(257))
    assert bytes(data).count(b"\x06\x01") < 256 and _native.import_(bytes(data), []) == nest(257)
