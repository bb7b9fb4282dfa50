"""torch.distributed (gloo) all_reduce of 4 KiB, 1 MiB and 64 MiB of f32, measured as
crates/tensorshare/benches/dist.rs measures tensorshare and MPI, which starts this script
under mpirun (it reads its rank from Open MPI's environment):

    TENSORSHARE_GLOO_PORT=29500 mpirun -np 4 -x TENSORSHARE_GLOO_PORT python gloo_allreduce.py

Each figure: the median over 10 runs of the slowest rank's time per operation (each run: a
barrier, then a burst), with the range, as `RESULT allreduce gloo BYTES MEDIAN MIN MAX` (µs).
"""
import os
import time

import torch
import torch.distributed as dist

RUNS = 10
ALL_REDUCE = [(1024, 400), (256 * 1024, 20), (16 << 20, 3)]


def main():
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    size = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    port = os.environ["TENSORSHARE_GLOO_PORT"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    for n, ops in ALL_REDUCE:
        t = torch.ones(n, dtype=torch.float32)
        dist.all_reduce(t)
        assert bool((t == size).all()), "a wrong sum"
        t.zero_()
        for _ in range(min(ops, 5)):
            dist.all_reduce(t)
        runs = []
        for _ in range(RUNS):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(ops):
                dist.all_reduce(t)
            us = torch.tensor([(time.perf_counter() - t0) * 1e6 / ops], dtype=torch.float64)
            dist.all_reduce(us, op=dist.ReduceOp.MAX)
            runs.append(us.item())
        runs.sort()
        if rank == 0:
            print(f"RESULT allreduce gloo {n * 4} {runs[len(runs) // 2]:.2f} {runs[0]:.2f} {runs[-1]:.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
