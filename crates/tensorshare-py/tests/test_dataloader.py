"""torch's DataLoader with a tensorshare context: batches arrive intact, are allocated in
tensorshare arenas by the workers, and lambdas work under spawn."""

import pytest

from conftest import LONG, START_METHODS, import_torch, needs_moves_into_arenas, run_python


class Squares:
    """A map-style dataset whose samples are dicts of small tensors."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        torch = import_torch()
        return {"x": torch.full((3,), float(i)), "y": torch.tensor(i * i), "name": f"s{i}"}


def collate_and_report(batch):
    """default_collate, plus whether the batch's storage is a tensorshare block (it is when
    the worker's torch allocates shared storages in arenas)."""
    from torch.utils.data import default_collate

    from tensorshare import _native

    out = default_collate(batch)
    out["in_arena"] = _native.find_block(out["x"].untyped_storage().data_ptr()) is not None
    return out


@pytest.mark.parametrize("method", START_METHODS)
def test_an_epoch_through_a_tensorshare_context(method):
    torch = import_torch()
    from torch.utils.data import DataLoader

    import tensorshare.multiprocessing as mp

    loader = DataLoader(
        Squares(40),
        batch_size=8,
        num_workers=2,
        multiprocessing_context=mp.get_context(method),
        collate_fn=collate_and_report,
    )
    seen = []
    for batch in loader:
        assert batch["in_arena"] is True
        assert torch.equal(batch["y"], batch["x"][:, 0].long() ** 2)
        seen.extend(batch["name"])
    assert seen == [f"s{i}" for i in range(40)]


def test_lambdas_as_collate_and_init_functions_under_spawn():
    torch = import_torch()
    from torch.utils.data import DataLoader

    import tensorshare.multiprocessing as mp

    offset = 100
    loader = DataLoader(
        list(range(12)),
        batch_size=4,
        num_workers=2,
        multiprocessing_context=mp.get_context("spawn"),
        collate_fn=lambda items: torch.tensor(items) + offset,
        worker_init_fn=lambda worker_id: torch.manual_seed(worker_id),
    )
    got = torch.cat(list(loader))
    assert torch.equal(got, torch.arange(12) + offset)


class Broken:
    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i == 2:
            raise ValueError("sample 2 is broken")
        return i


def test_a_worker_error_reaches_the_loop():
    import_torch()
    from torch.utils.data import DataLoader

    import tensorshare.multiprocessing as mp

    loader = DataLoader(Broken(), batch_size=1, num_workers=1, multiprocessing_context=mp.get_context("fork"))
    batches = iter(loader)
    try:
        with pytest.raises(ValueError, match="sample 2 is broken"):
            for _ in batches:
                pass
    finally:
        batches._shutdown_workers()  # as torch's own tests do: the worker is joined here


class Rows:
    """A map-style dataset of the rows of one tensor, each sample a view of it."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


@pytest.mark.parametrize("method", START_METHODS)
def test_torchs_own_workers_send_rows_of_a_dataset_in_a_block_as_views_of_it(method):
    needs_moves_into_arenas("a dataset moved into an arena by share_memory_()")
    # No tensorshare context: torch's own queues, through torch's reductions, which
    # tensorshare teaches to send a storage in a block as a handle. They used to move it
    # into torch's shared memory in each sending worker: a fork worker sent a copy of its
    # own, which writes through the received rows never reached.
    torch = import_torch()
    import multiprocessing

    from torch.utils.data import DataLoader

    from tensorshare import _native

    data = torch.zeros(8, 4).share_memory_()  # patched by tensorshare: into a block
    assert _native.find_block(data.untyped_storage().data_ptr()) is not None
    loader = DataLoader(
        Rows(data),
        batch_size=None,
        num_workers=2,
        multiprocessing_context=multiprocessing.get_context(method),
    )
    for i, row in enumerate(loader):
        row.fill_(float(i + 1))
    assert data[:, 0].tolist() == [float(i + 1) for i in range(8)], "a received row was a copy"
    assert _native.find_block(data.untyped_storage().data_ptr()) is not None, "the dataset moved"


FILE_SYSTEM_CURES_TOO_MANY_OPEN_FILES = """
    import resource
    import tensorshare.multiprocessing as mp
    mp.set_sharing_strategy("file_system")  # before torch is imported: set when it is
    import torch
    import torch.multiprocessing
    from torch.utils.data import DataLoader

    class Many:
        def __len__(self):
            return 64
        def __getitem__(self, i):
            return [torch.full((2,), float(i)) for _ in range(8)]

    if __name__ == "__main__":
        print(torch.multiprocessing.get_sharing_strategy())
        mp.set_sharing_strategy("file_descriptor")
        print(torch.multiprocessing.get_sharing_strategy())
        mp.set_sharing_strategy("file_system")
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
        kept = list(DataLoader(Many(), batch_size=None, num_workers=2))  # no context: torch's
        assert [float(b[7][1]) for b in kept] == [float(i) for i in range(64)]
        print("kept", len(kept))
"""


def test_set_sharing_strategy_sets_torchs_too_so_that_file_system_cures_too_many_open_files(tmp_path):
    # tensorshare's setter left torch's strategy alone: a program that changed its import
    # and set file_system, the known cure for a DataLoader's "Too many open files", still
    # ran out of descriptors in a DataLoader given no multiprocessing_context (torch's own
    # queues, which follow torch's strategy).
    import_torch()
    out = run_python(FILE_SYSTEM_CURES_TOO_MANY_OPEN_FILES, timeout=3 * LONG, script_dir=str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split("\n")[:3] == ["file_system", "file_descriptor", "kept 64"], out.stdout
