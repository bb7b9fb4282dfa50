"""A torch before 2.12 cannot move a storage into a tensorshare block (it lacks
``UntypedStorage._swap_data_ptr_``). There a CPU tensor whose storage is in no block is sent
the way torch.multiprocessing sends it, with torch's own reductions, and tensors made in
blocks still travel as handles.

These run on any torch: each case runs in a Python process of its own that tells the package,
before importing torch, that this torch cannot move storages (``can_move_in_place``, which
both the Python side and the extension ask). The same behaviour was seen on torch 2.11.0."""

import os
import re
import textwrap

import pytest

from conftest import LONG, START_METHODS, STRATEGIES, import_torch, run_python

AS_IF_BEFORE_2_12 = """
    from tensorshare import _reduction
    _reduction.can_move_in_place = lambda torch: False
"""


def run_as_if_before_2_12(code, timeout):
    """Runs ``code`` in a Python process whose torch the package takes for one that cannot
    move a storage in place."""
    return run_python(textwrap.dedent(AS_IF_BEFORE_2_12) + textwrap.dedent(code), timeout=timeout)


SENDS_THE_WAY_TORCH_DOES = """
    import os
    import torch
    import tensorshare as ts
    import tensorshare.multiprocessing as mp
    from tensorshare import _native

    def in_block(t):
        return _native.find_block(t.untyped_storage().data_ptr()) is not None

    def child(q, back):
        got = q.get(timeout={long})
        x, view, p, storage, made = got["x"], got["view"], got["p"], got["storage"], got["made"]
        back.put({{
            "values": (x.tolist(), view.tolist(), p.tolist(), list(storage), made.tolist()),
            "parameter": (type(p).__name__, p.requires_grad),
            "shared": (x.is_shared(), p.is_shared(), storage.is_shared(), made.is_shared()),
            # A view arrives over the same storage as the tensor it views.
            "aliased": view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr(),
            "in_block": (in_block(x), in_block(made)),
        }})
        x.add_(10)
        storage[0] = 99
        made.fill_(7)
        back.put(None)
        q.get(timeout={long})  # torch's file_descriptor strategy: the sender outlives the fds' taking

    if __name__ == "__main__":
        mp.set_sharing_strategy("{strategy}")
        ctx = mp.get_context("{method}")
        q, back = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=child, args=(q, back))
        proc.start()
        x = torch.arange(6.0)
        p = torch.nn.Parameter(torch.ones(2))
        storage = torch.UntypedStorage(3)
        for i in range(3):
            storage[i] = i
        made = ts.empty_shared((2,), torch.int32)
        made.fill_(5)
        assert not _native.is_tensor_handle(x) and _native.is_tensor_handle(made)
        q.put({{"x": x, "view": x[2:4], "p": p, "storage": storage, "made": made}})
        report = back.get(timeout={long})
        assert report["values"] == (
            [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [2.0, 3.0], [1.0, 1.0], [0, 1, 2], [5, 5]
        ), report
        assert report["parameter"] == ("Parameter", True), report
        assert report["shared"] == (True, True, True, True), report
        assert report["aliased"], report
        # torch's memory, not a block's; the tensor made in a block still travels as one.
        assert report["in_block"] == (False, True), report
        assert x.is_shared() and not in_block(x)
        assert back.get(timeout={long}) is None
        # Shared in place, both ways, as torch shares: the child's writes are seen here.
        assert x.tolist() == [10.0, 11.0, 12.0, 13.0, 14.0, 15.0], x
        assert storage[0] == 99
        assert made.tolist() == [7, 7]
        q.put(None)
        proc.join({long})
        assert proc.exitcode == 0, proc.exitcode
        print("pid", os.getpid())
"""


def _torch_files_of(pid):
    return sorted(n for n in os.listdir("/dev/shm") if re.fullmatch(rf"torch_{pid}_\d+(_\d+)?", n))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("method", START_METHODS)
def test_a_tensor_in_no_block_travels_the_way_torch_sends_it(method, strategy):
    # Before: every put of such a tensor raised (this torch cannot move it into a block).
    import_torch()
    code = SENDS_THE_WAY_TORCH_DOES.format(method=method, strategy=strategy, long=LONG)
    out = run_as_if_before_2_12(code, timeout=3 * LONG)
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[-1])
    # torch's file_system strategy names its files after the process: none is left.
    assert _torch_files_of(pid) == []


def test_refusals_and_share_memory_are_torchs_own():
    import_torch()
    out = run_as_if_before_2_12(
        """
        import torch
        import tensorshare as ts
        from tensorshare import _native

        def in_block(t):
            return _native.find_block(t.untyped_storage().data_ptr()) is not None

        # tensorshare.share_memory_ falls back to torch's own: shared, not in a block.
        t = torch.zeros(4)
        assert ts.share_memory_(t) is t
        assert t.is_shared() and not in_block(t)
        made = ts.empty_shared((3,), torch.float32)
        address = made.untyped_storage().data_ptr()
        ts.share_memory_(made)
        assert made.untyped_storage().data_ptr() == address and in_block(made)
        # torch's own share_memory_() (a model's share_memory() calls it) leaves a storage in
        # a block where it is too, whole or over the middle of a shared array (it copied both
        # into torch's shared memory, and the array no longer saw the tensor's writes).
        made.share_memory_()
        assert made.untyped_storage().data_ptr() == address and in_block(made)
        a = ts.empty_shared_array(8, "float32")
        a[:] = 0
        middle = torch.from_numpy(a[2:6])
        middle.share_memory_()
        middle.fill_(3)
        assert a.tolist() == [0, 0, 3, 3, 3, 3, 0, 0], a

        # Conjugate and negative views keep their bits (torch's own reduce_tensor keeps
        # neither: they are pickled whole, their storages reduced by torch).
        z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
        assert ts.roundtrip(z.conj()).tolist() == [1 - 2j, 3 + 4j]
        assert ts.roundtrip(z.conj().imag).tolist() == [-2.0, 4.0]

        # A model's share_memory() is torch's, and its weights then travel torch's way.
        model = torch.nn.Linear(2, 2)
        model.share_memory()
        assert all(w.is_shared() and not in_block(w) for w in model.parameters())
        back = ts.roundtrip({"weight": model.weight})["weight"]
        assert back.untyped_storage().data_ptr() == model.weight.untyped_storage().data_ptr()

        # A non-leaf tensor that requires grad is refused with torch's words, at the top of
        # a value and inside a pickled object (a set) alike.
        leaf = torch.ones(2, requires_grad=True)
        for value in (leaf * 2, {leaf * 2}):
            try:
                ts.roundtrip(value)
            except (RuntimeError, TypeError) as e:
                assert "Cowardly refusing to serialize non-leaf tensor" in str(e), e
            else:
                raise AssertionError("a non-leaf tensor was sent")
        print("ok")
        """,
        timeout=LONG,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok"]


def test_a_dataloader_with_the_packages_context_still_sends_batches_in_blocks():
    import_torch()
    out = run_as_if_before_2_12(
        """
        import torch
        import tensorshare.multiprocessing as mp
        from tensorshare import _native

        class Fields(torch.utils.data.Dataset):
            def __len__(self):
                return 64

            def __getitem__(self, i):
                return {"a": torch.full((4,), float(i)), "b": torch.tensor(i)}

        if __name__ == "__main__":
            loader = torch.utils.data.DataLoader(
                Fields(), batch_size=8, num_workers=2, timeout=60,
                multiprocessing_context=mp.get_context("fork"),
            )
            seen, blocks = [], 0
            for batch in loader:
                seen.extend(batch["b"].tolist())
                assert batch["a"][:, 0].tolist() == batch["b"].float().tolist()
                blocks += _native.find_block(batch["a"].untyped_storage().data_ptr()) is not None
            assert sorted(seen) == list(range(64)), seen
            print(blocks)
        """,
        timeout=3 * LONG,
    )
    assert out.returncode == 0, out.stderr
    # Collated in the workers straight into blocks, which travel as handles.
    assert out.stdout.split() == ["8"]
