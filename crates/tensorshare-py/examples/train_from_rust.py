"""A PyTorch training loop fed by a Rust data loader (the example `python_loader` of the
tensorshare crate) through tensorshare queues, against the same loop fed by torch's own
DataLoader over the same synthetic dataset.

    cargo build --release -p tensorshare --example python_loader
    python crates/tensorshare-py/examples/train_from_rust.py [--batches 200] [--batch-size 64]

Each batch is 64 images of 3x32x32 float32 (786 KiB) with labels, a mask and two half-
precision vectors; the step is a small linear model on the images. Both loaders make the
same bytes: the Rust one fills a tensor in shared memory and sends its handle; torch's
workers build the samples, collate them into a shared-memory batch and send it.
"""

import argparse
import os
import pathlib
import time

import torch
from torch.utils.data import DataLoader, Dataset

import tensorshare
import tensorshare.multiprocessing as mp

ROOT = pathlib.Path(__file__).resolve().parents[3]


class Synthetic(Dataset):
    """The same samples the Rust loader makes, one at a time."""

    def __init__(self, batches, batch_size, seed=0):
        self.n = batches * batch_size
        self.batch_size = batch_size
        self.seed = seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        index, k = divmod(i, self.batch_size)
        return {
            "images": torch.full((3, 32, 32), float(self.seed + index)),
            "labels": torch.tensor((self.seed + index + k) % 10),
            "mask": torch.tensor(k % 2 == 0),
            "scale_f16": torch.tensor(0.5, dtype=torch.float16),
            "scale_bf16": torch.tensor(0.25, dtype=torch.bfloat16),
        }


def train(batches, model, opt):
    """Runs one step per batch; the number of batches and the seconds it took."""
    start = time.perf_counter()
    n = 0
    for batch in batches:
        logits = model(batch["images"].flatten(1))
        loss = torch.nn.functional.cross_entropy(logits, batch["labels"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        n += 1
    return n, time.perf_counter() - start


def from_rust(exe, batches, batch_size):
    requests, queue = mp.Queue(), mp.Queue(maxsize=8)
    loader = tensorshare.popen([exe], (requests, queue))
    try:
        requests.put({"batches": batches, "batch_size": batch_size, "seed": 0})

        def stream():
            while (b := queue.get(timeout=120)) != "done":
                yield b

        yield from stream()
        requests.put(None)
        assert loader.wait(60) == 0
    finally:
        if loader.poll() is None:
            loader.kill()
            loader.wait()


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--loader", default=str(ROOT / "target" / "release" / "examples" / "python_loader"))
    args = parser.parse_args()
    if not os.path.exists(args.loader):
        raise SystemExit(
            f"{args.loader} is missing: cargo build --release -p tensorshare --example python_loader"
        )
    torch.set_num_threads(1)
    results = {}
    for name in ["rust loader", "torch DataLoader", "rust loader", "torch DataLoader"]:
        torch.manual_seed(0)
        model = torch.nn.Linear(3 * 32 * 32, 10)
        opt = torch.optim.SGD(model.parameters(), lr=1e-6)
        if name == "rust loader":
            batches = from_rust(args.loader, args.batches, args.batch_size)
        else:
            batches = DataLoader(
                Synthetic(args.batches, args.batch_size), batch_size=args.batch_size, num_workers=args.workers
            )
        n, seconds = train(batches, model, opt)
        assert n == args.batches, n
        results.setdefault(name, []).append(seconds)
    for name, runs in results.items():
        best = min(runs)
        print(
            f"{name:17} {args.batches / best:8.1f} batches/s"
            f"  ({best:.3f} s for {args.batches}, best of {len(runs)})"
        )
    ratio = min(results["torch DataLoader"]) / min(results["rust loader"])
    print(
        f"the Rust loader feeds the loop {ratio:.1f}x as fast as torch's DataLoader ({args.workers} workers)"
    )


if __name__ == "__main__":
    main()
