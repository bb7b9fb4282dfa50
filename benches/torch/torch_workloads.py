"""The BENCHMARKS.md workloads on torch.multiprocessing, one JSON line each, with the keys
`tensorshare bench --json` prints: system, workload, args, strategy, and the figures.

    python torch_workloads.py pingpong SIZE ROUNDS fresh|same
    python torch_workloads.py stream SIZE COUNT
    python torch_workloads.py batch SIZE K COUNT
    python torch_workloads.py spawn N

STRATEGY=file_system selects torch's other sharing strategy.
"""
import json
import os
import sys
import time

import torch
import torch.multiprocessing as mp

WARMUP = 50


def echo(qin, qout, n):
    for _ in range(n):
        qout.put(qin.get())
    qin.get()  # file_descriptor: stay alive until the parent has taken every fd


def pingpong(size, rounds, mode):
    ctx = mp.get_context("spawn")
    qin, qout = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=echo, args=(qin, qout, rounds + WARMUP))
    p.start()
    n = max(1, size // 4)
    same = torch.ones(n).share_memory_()
    one_way = []
    for i in range(rounds + WARMUP):
        start = time.perf_counter()
        qin.put(same if mode == "same" else torch.ones(n))
        got = qout.get()
        if i >= WARMUP:
            one_way.append((time.perf_counter() - start) / 2)
        del got
    qin.put(None)
    p.join()
    one_way.sort()
    return {"median_us": one_way[len(one_way) // 2] * 1e6, "p99_us": one_way[len(one_way) * 99 // 100] * 1e6}


def producer(q, done, size, k, count):
    n = max(1, size // 4)
    for i in range(count):
        if k is None:
            q.put(torch.full((n,), float(i)))
        else:
            q.put([torch.full((n,), float(i)) for _ in range(k)])
    q.put(None)
    done.wait()


def consume(size, k, count):
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(maxsize=4), ctx.Event()
    p = ctx.Process(target=producer, args=(q, done, size, k, count))
    p.start()
    item = q.get()  # the clock starts at the first item
    start = time.perf_counter()
    got, total = 0, 0.0
    while True:
        if k is None:
            total += float(item.sum())
        del item
        item = q.get()
        if item is None:
            break
        got += 1 if k is None else len(item)
    seconds = time.perf_counter() - start
    done.set()
    p.join()
    return seconds, got


def stream(size, count):
    seconds, got = consume(size, None, count)
    return {"seconds": seconds, "GBps": size * got / seconds / 1e9, "items": got}


def batch(size, k, count):
    seconds, got = consume(size, k, count)
    return {"seconds": seconds, "tensors_per_s": got / seconds, "messages_per_s": got / k / seconds}


def nothing(rank):
    pass


def spawn(n):
    start = time.perf_counter()
    mp.spawn(nothing, nprocs=n, join=True)
    return {"seconds": time.perf_counter() - start}


def main(argv):
    torch.set_num_threads(1)
    strategy = os.environ.get("STRATEGY", "file_descriptor")
    mp.set_sharing_strategy(strategy)
    name, args = argv[1], argv[2:]
    ints = [int(a) for a in args if a.isdigit()]
    figures = {
        "pingpong": lambda: pingpong(ints[0], ints[1], args[2]),
        "stream": lambda: stream(ints[0], ints[1]),
        "batch": lambda: batch(ints[0], ints[1], ints[2]),
        "spawn": lambda: spawn(ints[0]),
    }[name]()
    print(json.dumps({"system": "torch.multiprocessing " + torch.__version__, "workload": name, "args": args,
                      "strategy": strategy, **figures}), flush=True)


if __name__ == "__main__":
    main(sys.argv)
