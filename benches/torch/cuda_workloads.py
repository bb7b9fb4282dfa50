"""CUDA tensors through torch.multiprocessing's queues, one JSON line per workload, with the
keys `tensorshare bench --json` prints for its `cuda_pingpong` and `cuda_first_use`:

    python cuda_workloads.py [--tensorshare] cuda_pingpong SIZE ROUNDS fresh|same
    python cuda_workloads.py [--tensorshare] cuda_first_use SIZE ROUNDS fresh|same

`--tensorshare` runs the same code with `import tensorshare.multiprocessing as mp` (the Python
package, which sends torch's CUDA tensors with torch's own reduction over its own queues);
`--tensorshare-alloc` also makes the tensors with `tensorshare.empty_shared(..., device="cuda")`,
which travel as tensorshare handles (and can be sent back, which torch refuses).

cuda_pingpong: the parent puts a CUDA tensor of SIZE bytes, a child gets it and puts it back,
the parent gets it; half the round trip. cuda_first_use: the parent puts a tensor with the
time of its put (CLOCK_MONOTONIC, one clock for all processes), a child gets it, reads its
first element to the host (the read waits for the parent's fill), checks it and answers with
the time from the put; one tensor in flight. `fresh` makes and fills a new tensor every round
without synchronising first; `same` sends one tensor over and over. A workload torch refuses
prints its error instead of figures.
"""

import contextlib
import json
import queue
import sys
import time

from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as mp

WARMUP = 50
ALLOC = None  # tensorshare.empty_shared under --tensorshare-alloc


def echo(qin, qout, n, torchs_queue=True):
    for _ in range(n):
        t = qin.get()
        if t is None:  # the parent stopped early
            return
        try:
            if torchs_queue:
                # torch's queue pickles in its feeder thread, where an error is only printed:
                # try first, so that a refusal reaches the parent instead of leaving it
                # waiting. (tensorshare's put raises in the caller.)
                ForkingPickler.dumps(t)
            qout.put(t)
        except Exception as e:
            qout.put(f"{type(e).__name__}: {e}")
            break
        del t
    qin.get()  # stay alive until the parent is done with what it got back


def first_use(qin, qout, n):
    for _ in range(n):
        item = qin.get()
        if item is None:  # the parent stopped early
            return
        t, sent = item
        v = t[0].item()
        took = time.clock_gettime_ns(time.CLOCK_MONOTONIC) - sent
        if v != 1.0:
            raise AssertionError("the consumer read the tensor before the sender's fill was done")
        del t
        qout.put(took)
    qin.get()  # stay alive until the parent is done


def tensors(n, mode):
    if ALLOC is None:
        same = torch.ones(n, device="cuda")
        torch.cuda.synchronize()
        return lambda: same if mode == "same" else torch.full((n,), 1.0, device="cuda")
    same = ALLOC((n,), device="cuda").fill_(1.0)
    torch.cuda.synchronize()
    return lambda: same if mode == "same" else ALLOC((n,), device="cuda").fill_(1.0)


@contextlib.contextmanager
def child(target, rounds, what):
    """A spawned child running `target(qin, qout, n)`; when the block ends it is told to stop
    (None), joined (killed if it hangs) and its exit code checked."""
    ctx = mp.get_context("spawn")
    qin, qout = ctx.Queue(), ctx.Queue()
    args = (qin, qout, rounds + WARMUP)
    if target is echo:
        args += (mp.__name__ == "torch.multiprocessing",)
    p = ctx.Process(target=target, args=args)
    p.start()
    try:
        yield qin, qout, p
    finally:
        qin.put(None)
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
            p.join()
    if p.exitcode != 0:
        raise RuntimeError(f"{what} exited with {p.exitcode}")


def answer(qout, p, what):
    try:
        return qout.get(timeout=120)
    except queue.Empty:
        raise RuntimeError(f"{what} did not answer (exit code {p.exitcode})") from None


def summary(us):
    us.sort()
    return {"median_us": us[len(us) // 2], "p99_us": us[len(us) * 99 // 100]}


def pingpong(size, rounds, mode):
    one_way = []
    with child(echo, rounds, "the echoing child") as (qin, qout, p):
        make = tensors(max(1, size // 4), mode)
        for i in range(rounds + WARMUP):
            start = time.perf_counter()
            t = make()
            qin.put(t)
            got = answer(qout, p, "the echoing child")
            if isinstance(got, str):
                raise RuntimeError(f"the child could not send the tensor back: {got}")
            if i >= WARMUP:
                one_way.append((time.perf_counter() - start) / 2 * 1e6)
            del got, t
    return summary(one_way)


def first_use_workload(size, rounds, mode):
    lat = []
    with child(first_use, rounds, "the consumer") as (qin, qout, p):
        make = tensors(max(1, size // 4), mode)
        for i in range(rounds + WARMUP):
            t = make()
            qin.put((t, time.clock_gettime_ns(time.CLOCK_MONOTONIC)))
            took = answer(qout, p, "the consumer")
            if i >= WARMUP:
                lat.append(took / 1e3)
            del t  # torch: the sender keeps a CUDA tensor alive until the receiver is done
    return summary(lat)


def main():
    global mp, ALLOC
    argv = sys.argv[1:]
    system = "torch"
    if argv[0] in ("--tensorshare", "--tensorshare-alloc"):
        import tensorshare
        import tensorshare.multiprocessing as mp

        system = "tensorshare.multiprocessing"
        if argv[0] == "--tensorshare-alloc":
            ALLOC, system = tensorshare.empty_shared, system + " (tensorshare.empty_shared)"
        argv = argv[1:]
    name, args = argv[0], argv[1:]
    size, rounds, mode = int(args[0]), int(args[1]), args[2]
    run = {"cuda_pingpong": pingpong, "cuda_first_use": first_use_workload}[name]
    line = {"system": system, "workload": name, "args": args, "strategy": mp.get_sharing_strategy()}
    try:
        line.update(run(size, rounds, mode))
    except Exception as e:  # a workload torch refuses: say so instead of figures
        line["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
