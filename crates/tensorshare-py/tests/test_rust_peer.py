"""A Rust process and a Python process on one pair of queues, values both ways: Rust
structs arrive as dicts of torch tensors aliasing the Rust process's memory, Python dicts
of views, every dtype and nested containers arrive in Rust as structs."""

import os
import pathlib
import subprocess

import numpy as np
import pytest

import tensorshare
import tensorshare.multiprocessing as mp
from conftest import import_torch, needs_moves_into_arenas, run_python

ROOT = pathlib.Path(__file__).resolve().parents[3]


def loader_binary():
    """The example `python_loader` (cargo test builds it; built here if it is missing)."""
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    exe = target / "debug" / "examples" / "python_loader"
    if not exe.exists():
        subprocess.run(
            ["cargo", "build", "-q", "-p", "tensorshare", "--example", "python_loader"], cwd=ROOT, check=True
        )
    return str(exe)


@pytest.fixture
def loader():
    requests, batches = mp.Queue(), mp.Queue(maxsize=4)
    proc = tensorshare.popen([loader_binary()], (requests, batches))
    yield requests, batches, proc
    requests.put(None)
    try:
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_batches_from_rust_are_torch_tensors_in_its_memory(loader):
    torch = import_torch()
    requests, batches, _ = loader
    requests.put({"batches": 5, "batch_size": 4, "seed": 10})
    for index in range(5):
        b = batches.get(timeout=60)
        assert b["index"] == index
        assert b["images"].shape == (4, 3, 32, 32) and b["images"].dtype == torch.float32
        assert bool(torch.all(b["images"] == 10 + index))
        assert b["labels"].tolist() == [(10 + index + k) % 10 for k in range(4)]
        assert b["mask"].dtype == torch.bool and b["mask"].tolist() == [True, False, True, False]
        assert b["scale_f16"].dtype == torch.float16 and float(b["scale_f16"][0]) == 0.5
        assert b["scale_bf16"].dtype == torch.bfloat16 and float(b["scale_bf16"][0]) == 0.25
        assert tensorshare._native.find_block(b["images"].untyped_storage().data_ptr()) is not None
    assert batches.get(timeout=60) == "done"


def test_python_values_arrive_in_rust_as_structs_and_writes_come_back(loader):
    needs_moves_into_arenas("torch tensors a Rust process can read (torch's pickles it cannot)")
    torch = import_torch()
    requests, batches, _ = loader
    matrix = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    array = tensorshare.empty_shared_array(3, "float64")
    array[:] = [1.0, 2.0, 3.0]
    check = {
        "column": matrix[:, 1],
        "halves": torch.tensor([0.5, -1.0], dtype=torch.float16),
        "bhalves": torch.tensor([2.0, 0.125], dtype=torch.bfloat16),
        "flags": torch.tensor([True, False, True]),
        "array": array,
        "names": ["a", "b"],
        "pairs": [("x", 1), ("y", 41)],
        "nested": {"k": [1.0, 2.0], "l": [3.0]},
        "maybe": None,
        "hashes": [0, 2**63 - 1, 2**63, 2**64 - 2],
    }
    requests.put({"check": check})
    found = batches.get(timeout=60)
    assert found["column"] == [1.0, 5.0, 9.0]
    assert found["column_strides"] == [4]
    assert found["halves"] == [0.5, -1.0]
    assert found["bhalves"] == [2.0, 0.125]
    assert found["flags"] == [True, False, True]
    assert found["dtypes"] == ["float32", "float16", "bfloat16", "bool", "float64"]
    assert found["names"] == ["a", "b"] and found["pair_sum"] == 42 and found["nested_len"] == 3
    assert found["maybe"] is None
    # Rust's u64 over i64's range, both ways.
    assert found["hashes_flipped"] == [1, 2**63 - 2, 2**63 + 1, 2**64 - 1]
    assert torch.equal(found["made_here"], torch.tensor([1.5, 2.5, 3.5]))
    # The array lives in shared memory and went as a handle: Rust doubled it in place.
    np.testing.assert_array_equal(array, [2.0, 4.0, 6.0])


def test_a_mismatched_request_fails_the_rust_process_with_a_clear_error():
    requests, batches = mp.Queue(), mp.Queue()
    proc = tensorshare.popen([loader_binary()], (requests, batches), stderr=subprocess.PIPE, text=True)
    try:
        requests.put({"batches": "many", "batch_size": 1, "seed": 0})
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1
    assert "InvalidMessage" in err and '"many' in err and "expected u64" in err, err


def test_a_batch_from_rust_reaches_a_python_process_without_torch_with_its_bfloat16_as_bits():
    # Without torch, tensors arrive as numpy arrays, and numpy has no bfloat16: the whole
    # batch was lost ("data type 'bfloat16' not understood"). Its bits arrive as uint16.
    out = run_python(
        f"""
        import sys
        sys.modules["torch"] = None  # import torch fails in this process
        import numpy as np
        import tensorshare
        import tensorshare.multiprocessing as mp

        requests, batches = mp.Queue(), mp.Queue()
        proc = tensorshare.popen([{loader_binary()!r}], (requests, batches))
        requests.put({{"batches": 1, "batch_size": 2, "seed": 3}})
        b = batches.get(timeout=60)
        requests.put(None)
        assert batches.get(timeout=60) == "done"
        assert proc.wait(60) == 0
        print(type(b["images"]).__name__, b["images"].dtype, float(b["images"].flat[0]))
        print(b["scale_f16"].dtype, b["scale_bf16"].dtype, b["scale_bf16"].tolist())
        # The bits of bfloat16 0.25 are the high half of float32 0.25's.
        print((b["scale_bf16"].astype(np.uint32) << 16).view(np.float32).tolist())
        """,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines() == [
        "ndarray float32 3.0",
        "float16 uint16 [16000, 16000]",
        "[0.25, 0.25]",
    ], out.stdout + out.stderr
