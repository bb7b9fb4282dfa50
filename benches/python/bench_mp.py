"""tensorshare.multiprocessing against torch.multiprocessing, side by side in one run.

    python benches/python/bench_mp.py [--quick] [--reps N] [--workloads pingpong stream ...]
        [--strategy file_descriptor|file_system] [--json] [--json-out FILE]

Runs the workloads of benches/torch/torch_workloads.py (pingpong, stream, batch, spawn)
and a DataLoader epoch through both packages, interleaved: every repetition of a workload
runs on both systems back to back (the order alternating between repetitions), so that the
machine's drift touches both alike. Each system runs in a process of its own (a "runner",
this script with ``--runner``) that imports only its package: importing tensorshare patches
torch, which must not change the torch runs. Prints a table of the medians over the
repetitions, the ratio (how many times better tensorshare is), and whether the target is
met; ``--json`` also prints one JSON line per (workload, system) with torch_workloads.py's keys (``system``,
``workload``, ``args``, ``strategy``, the figures as medians) plus ``runs`` (every
repetition's figures).

Measure a release build of the extension (see README.md): run with the PYTHONPATH of the
unpacked release wheel; the header says which ``tensorshare`` was imported.
"""

import argparse
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import time
import traceback

import torch
import torch.utils.data

SYSTEMS = ("torch", "tensorshare")
# Warm-up rounds of pingpong (fewer when a workload has fewer rounds than this).
WARMUP = 50


def _mp(system):
    """The multiprocessing module of ``system``."""
    if system == "torch":
        import torch.multiprocessing as mp
    else:
        import tensorshare.multiprocessing as mp
    return mp


def _setup_child(system, strategy):
    torch.set_num_threads(1)
    _mp(system).set_sharing_strategy(strategy)


def _new_tensor(system, alloc, n, value):
    """A new tensor of ``n`` floats filled with ``value``, as a user of ``system`` makes one
    to send: with torch (``alloc="torch"``; the drop-in way), or for tensorshare with
    ``alloc="shared"``, straight in shared memory (``tensorshare.empty_shared``, no copy on
    ``put``)."""
    if system == "tensorshare" and alloc == "shared":
        import tensorshare

        return tensorshare.empty_shared((n,), torch.float32).fill_(value)
    if value == 1.0:
        return torch.ones(n)
    return torch.full((n,), float(value))


def _share(system, t):
    """``t`` moved into shared memory the way ``system`` does it (for ``same``)."""
    if system == "tensorshare":
        import tensorshare

        return tensorshare.share_memory_(t)
    return t.share_memory_()


# --- pingpong -----------------------------------------------------------------------------


def _echo(system, strategy, qin, qout, n):
    _setup_child(system, strategy)
    for _ in range(n):
        qout.put(qin.get())
    # torch's file_descriptor strategy needs the sender alive until the receiver has taken
    # every fd (resource_sharer): wait for the parent's goodbye (both systems alike).
    qin.get()


def pingpong(system, strategy, alloc, size, rounds, mode):
    """One-way latency of a tensor of ``size`` bytes, parent -> child -> parent."""
    ctx = _mp(system).get_context("spawn")
    qin, qout = ctx.Queue(), ctx.Queue()
    warmup = min(WARMUP, rounds)
    p = ctx.Process(target=_echo, args=(system, strategy, qin, qout, rounds + warmup))
    p.start()
    n = max(1, size // 4)
    same = _share(system, torch.ones(n)) if mode == "same" else None
    one_way = []
    for i in range(rounds + warmup):
        start = time.perf_counter()  # a fresh tensor's creation is part of the cost
        qin.put(same if mode == "same" else _new_tensor(system, alloc, n, 1.0))
        got = qout.get()
        if i >= warmup:
            one_way.append((time.perf_counter() - start) / 2)
        del got
    qin.put(None)
    p.join()
    one_way.sort()
    return {
        "median_us": one_way[len(one_way) // 2] * 1e6,
        "p99_us": one_way[len(one_way) * 99 // 100] * 1e6,
    }


# --- stream and batch ---------------------------------------------------------------------


def _produce(system, strategy, alloc, q, done, size, k, count):
    _setup_child(system, strategy)
    n = max(1, size // 4)
    for i in range(count):
        if k is None:
            q.put(_new_tensor(system, alloc, n, float(i)))
        else:
            q.put([_new_tensor(system, alloc, n, float(i)) for _ in range(k)])
    q.put(None)
    done.wait()  # stay alive until every fd was taken (see _echo)


def _consume(system, strategy, alloc, size, k, count):
    ctx = _mp(system).get_context("spawn")
    q, done = ctx.Queue(maxsize=4), ctx.Event()
    p = ctx.Process(target=_produce, args=(system, strategy, alloc, q, done, size, k, count))
    p.start()
    item = q.get()  # steady state: the clock starts at the first item
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


def stream(system, strategy, alloc, size, count):
    """A producer sends ``count`` new tensors of ``size`` bytes; the consumer sums each."""
    seconds, got = _consume(system, strategy, alloc, size, None, count)
    return {"seconds": seconds, "GBps": size * got / seconds / 1e9, "items": got}


def batch(system, strategy, alloc, size, k, count):
    """Like stream, but each message is a list of ``k`` tensors of ``size`` bytes."""
    seconds, got = _consume(system, strategy, alloc, size, k, count)
    return {"seconds": seconds, "tensors_per_s": got / seconds, "messages_per_s": got / k / seconds}


# --- spawn --------------------------------------------------------------------------------


def _nothing(rank):
    pass


def spawn(system, strategy, alloc, nprocs):
    """``spawn(nprocs=N)`` of a function that does nothing, until every process is joined."""
    start = time.perf_counter()
    _mp(system).spawn(_nothing, nprocs=nprocs, join=True)
    return {"seconds": time.perf_counter() - start}


# --- DataLoader ---------------------------------------------------------------------------


class ManyFields(torch.utils.data.Dataset):
    """``length`` samples, each a dict of ``fields`` tensors of ``numel`` floats."""

    def __init__(self, length, fields, numel):
        self.length, self.fields, self.numel = length, fields, numel

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return {f"f{j}": torch.full((self.numel,), float(i + j)) for j in range(self.fields)}


def dataloader(system, strategy, context, length, fields, numel, batch_size, workers):
    """One epoch of a DataLoader over ``ManyFields``: ``context`` is ``default`` (no
    multiprocessing_context: torch's own, fork here) or a start method of ``system``."""
    _mp(system).set_sharing_strategy(strategy)
    mp_context = None if context == "default" else _mp(system).get_context(context)
    loader = torch.utils.data.DataLoader(
        ManyFields(length, fields, numel),
        batch_size=batch_size,
        num_workers=workers,
        multiprocessing_context=mp_context,
        timeout=120,
    )
    samples, check = 0, 0.0
    start = time.perf_counter()
    first = None
    for b in loader:
        if first is None:
            first = time.perf_counter()
        check += float(b["f0"][0, 0])  # touch what arrived
        samples += b["f0"].shape[0]
        del b
    end = time.perf_counter()
    if samples != length:
        raise RuntimeError(f"an epoch of {length} samples gave {samples}")
    steady = samples - batch_size
    return {
        "epoch_s": end - start,
        "first_batch_s": first - start,
        "steady_samples_per_s": steady / (end - first) if end > first else float("nan"),
        "samples_per_s": samples / (end - start),
    }


WORKLOADS = {"pingpong": pingpong, "stream": stream, "batch": batch, "spawn": spawn, "dataloader": dataloader}


# --- the plan -----------------------------------------------------------------------------


class Row:
    """One line of the table: ``figure`` of ``workload`` on each system, each with its own
    arguments (a count may be larger for tensorshare, which would otherwise finish in a few
    milliseconds; the figures are medians or rates either way) and variant (see the
    workloads); ``target``: the ratio to reach, if any."""

    def __init__(self, label, workload, figure, torch_args, ts_args, torch_variant, ts_variant, target):
        self.label, self.workload, self.figure, self.target = label, workload, figure, target
        self.higher = figure not in LOWER_IS_BETTER
        self.jobs = {
            "torch": (workload, "torch", torch_variant, tuple(torch_args)),
            "tensorshare": (workload, "tensorshare", ts_variant, tuple(ts_args)),
        }


LOWER_IS_BETTER = {"median_us", "p99_us", "seconds", "epoch_s", "first_batch_s"}
KIB, MIB = 1024, 1024 * 1024


def plan(quick):
    """The rows of the table; ``quick`` for a smoke run of about a minute."""
    rows = []

    def add(label, workload, figure, torch_args, ts_args=None, tv="torch", sv="torch", target=None):
        rows.append(Row(label, workload, figure, torch_args, ts_args or torch_args, tv, sv, target))

    # (size, name, torch rounds, tensorshare rounds, modes)
    if quick:
        pingpongs = [(4 * KIB, "4 KiB", 150, 2000, ("fresh", "same")), (MIB, "1 MiB", 80, 500, ("fresh",))]
    else:
        pingpongs = [
            (4 * KIB, "4 KiB", 500, 5000, ("fresh", "same")),
            (MIB, "1 MiB", 200, 1000, ("fresh", "same")),
            (64 * MIB, "64 MiB", 10, 30, ("fresh", "same")),
        ]
    for size, name, tr, sr, modes in pingpongs:
        for mode in modes:
            target = 20 if (size == 4 * KIB and mode == "fresh") else None
            add(
                f"pingpong {name} {mode}",
                "pingpong",
                "median_us",
                (size, tr, mode),
                (size, sr, mode),
                target=target,
            )
        if size >= MIB and not quick:
            # tensorshare allocating in shared memory (no copy on put); torch's side is the
            # run above (torch.ones: its own way)
            label = f"pingpong {name} fresh (ts empty_shared)"
            add(label, "pingpong", "median_us", (size, tr, "fresh"), (size, sr, "fresh"), sv="shared")
    # (size, name, torch items, tensorshare items)
    if quick:
        streams = [(4 * KIB, "4 KiB", 1000, 10000), (MIB, "1 MiB", 200, 1000)]
    else:
        streams = [(4 * KIB, "4 KiB", 3000, 30000), (MIB, "1 MiB", 400, 4000), (64 * MIB, "64 MiB", 16, 48)]
    for size, name, tc, sc in streams:
        add(f"stream {name}", "stream", "GBps", (size, tc), (size, sc), target=10 if size == MIB else None)
        if size >= MIB and not quick:
            add(f"stream {name} (ts empty_shared)", "stream", "GBps", (size, tc), (size, sc), sv="shared")
    tm, sm = (10, 100) if quick else (30, 300)
    add("batch 100 x 1 KiB", "batch", "tensors_per_s", (KIB, 100, tm), (KIB, 100, sm), target=100)
    if not quick:
        label = "batch 100 x 1 KiB (ts empty_shared)"
        add(label, "batch", "tensors_per_s", (KIB, 100, tm), (KIB, 100, sm), sv="shared")
    for n in (1,) if quick else (1, 8):
        add(f"spawn {n}", "spawn", "seconds", (n,))
    # (samples, fields, floats per field, batch size, workers)
    dl = (1024 if quick else 4096, 16, 256, 32, 2)
    add(
        "dataloader epoch, ts fork vs torch default",
        "dataloader",
        "epoch_s",
        dl,
        tv="default",
        sv="fork",
        target=2,
    )
    if not quick:
        # Information, not the target: the target compares the two packages' default
        # contexts (fork on Linux), while this row's spawn workers each import torch first
        # (about two seconds), which torch's default fork workers never do.
        add(
            "dataloader epoch, ts spawn vs torch default",
            "dataloader",
            "epoch_s",
            dl,
            tv="default",
            sv="spawn",
        )
        add("dataloader epoch, ts spawn vs torch spawn", "dataloader", "epoch_s", dl, tv="spawn", sv="spawn")
        add(
            "dataloader steady, ts fork vs torch default",
            "dataloader",
            "steady_samples_per_s",
            dl,
            tv="default",
            sv="fork",
        )
    return rows


def run_job(job, strategy):
    workload, system, variant, args = job
    return WORKLOADS[workload](system, strategy, variant, *args)


# --- the runners: one process per system ------------------------------------------------


def runner(system, strategy):
    """Runs the jobs of ``system`` that come on stdin (one JSON line each), answering each
    with a JSON line on the original stdout. Only that system's package is imported here:
    importing tensorshare patches torch (``share_memory_`` goes to its arenas), which must
    not touch the torch runs."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever else the workloads or their children print goes to stderr
    torch.set_num_threads(1)
    mp = _mp(system)
    mp.set_sharing_strategy(strategy)
    if system == "torch":
        name, where = "torch.multiprocessing " + torch.__version__, os.path.dirname(torch.__file__)
    else:
        import tensorshare

        name = "tensorshare.multiprocessing " + _version("tensorshare")
        where = sys.modules["tensorshare._native"].__file__
        if os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")) in os.path.abspath(
            tensorshare.__file__
        ):
            where += "  WARNING: the source tree (the editable debug build?)"
    if system == "torch" and "tensorshare" in sys.modules:
        where += "  WARNING: tensorshare is imported in the torch runner"
    proto.write(json.dumps({"system": name, "from": where}) + "\n")
    for line in sys.stdin:
        workload, sys_, variant, args = json.loads(line)
        try:
            reply = {"figures": run_job((workload, sys_, variant, tuple(args)), strategy)}
        except Exception as e:
            traceback.print_exc()
            reply = {"error": f"{type(e).__name__}: {e}"}
        proto.write(json.dumps(reply) + "\n")


def _version(dist):
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


class Runner:
    """The coordinator's end of a runner process (started on first use, restarted after
    a job that failed to answer in time)."""

    def __init__(self, system, strategy, timeout):
        self.system, self.strategy, self.timeout = system, strategy, timeout
        self.proc, self.hello = None, None

    def _start(self):
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--runner",
            self.system,
            "--strategy",
            self.strategy,
        ]
        # A session of its own, so that a hung job's processes can all be ended together.
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        self.hello = self._read(300)

    def _read(self, timeout):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else None
        if not line:
            why = f"no answer in {timeout:.0f} s" if not ready else "the runner exited"
            self.kill()
            raise RuntimeError(f"{self.system} runner: {why}")
        return json.loads(line)

    def run(self, job):
        if self.proc is None:
            self._start()
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        reply = self._read(self.timeout)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply["figures"]

    def kill(self):
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.proc = None

    def close(self):
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()
            self.proc = None


# --- output -------------------------------------------------------------------------------


def fmt(x):
    if x is None or x != x:
        return "-"
    if x >= 1e5:
        return f"{x:,.0f}"
    if x >= 100:
        return f"{x:.0f}"
    return f"{x:.3g}"


def cell(values):
    """The median, and the range over the repetitions."""
    if not values:
        return "error"
    med = statistics.median(values)
    if len(values) == 1:
        return fmt(med)
    return f"{fmt(med)} ({fmt(min(values))}..{fmt(max(values))})"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run of about a minute")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 3; 1 with --quick)")
    ap.add_argument(
        "--workloads",
        nargs="+",
        choices=sorted(WORKLOADS),
        default=sorted(WORKLOADS),
        help="which workloads to run (default: all)",
    )
    ap.add_argument("--match", default=None, help="only the rows whose label contains this text")
    ap.add_argument("--strategy", default="file_descriptor", choices=["file_descriptor", "file_system"])
    ap.add_argument("--json", action="store_true", help="also print one JSON line per workload and system")
    ap.add_argument("--json-out", default=None, help="append the JSON lines to this file")
    ap.add_argument("--job-timeout", type=float, default=600, help="seconds one job may take")
    ap.add_argument("--runner", choices=SYSTEMS, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.runner:
        return runner(a.runner, a.strategy)
    reps = a.reps if a.reps is not None else (1 if a.quick else 3)

    rows = [r for r in plan(a.quick) if r.workload in a.workloads and (a.match is None or a.match in r.label)]
    runners = {s: Runner(s, a.strategy, a.job_timeout) for s in SYSTEMS}
    for s in SYSTEMS:
        runners[s]._start()
        h = runners[s].hello
        print(f"# {h['system']} from {h['from']}")
    print(
        f"# strategy {a.strategy}, {reps} repetitions, {os.cpu_count()} CPUs, "
        f"python {sys.version.split()[0]}, load average {os.getloadavg()[0]:.2f} "
        "(should be near 0: other work on the machine skews both systems)"
    )
    sys.stdout.flush()

    results, errors, order = {}, {}, []
    for r in rows:
        for s in SYSTEMS:
            if r.jobs[s] not in order:
                order.append(r.jobs[s])
    # Interleaved: the jobs of one workload and size, repetition by repetition, the order of
    # the systems alternating.
    groups = {}
    for job in order:
        groups.setdefault((job[0], job[3][:1]), []).append(job)
    t_all = time.perf_counter()
    try:
        for jobs in groups.values():
            for rep in range(reps):
                for job in sorted(jobs, key=lambda j: (SYSTEMS.index(j[1]) + rep) % 2):
                    if job in errors:
                        continue
                    t0 = time.perf_counter()
                    try:
                        figures = runners[job[1]].run(job)
                    except RuntimeError as e:
                        errors[job] = str(e)
                        print(f"  {job}: {e}", file=sys.stderr, flush=True)
                        continue
                    results.setdefault(job, []).append(figures)
                    shown = ", ".join(f"{k}={fmt(v)}" for k, v in figures.items())
                    took = time.perf_counter() - t0
                    print(
                        f"  [{rep + 1}/{reps}] {job[0]} {job[1]}:{job[2]} {job[3]}: {shown} ({took:.1f} s)",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        for r in runners.values():
            r.close()

    width = max([len(r.label) for r in rows] + [8])
    head = f"{'workload':<{width}}  {'figure':<20} {'torch':>26} {'tensorshare':>26} {'ratio':>8}  target"
    print()
    print(head)
    print("-" * len(head))
    summary = []
    for r in rows:
        vals = {s: [f[r.figure] for f in results.get(r.jobs[s], [])] for s in SYSTEMS}
        t, o = (statistics.median(vals[s]) if vals[s] else None for s in SYSTEMS)
        ratio = (o / t if r.higher else t / o) if t and o else None
        target = ""
        if r.target is not None:
            met = ratio is not None and ratio >= r.target
            target = f">= {r.target}x {'met' if met else 'NOT met'}"
            summary.append(f"{r.label} >= {r.target}x: {'met' if met else 'NOT met'}")
        unit = r.figure + (" (higher better)" if r.higher else "")
        ratio_s = f"{ratio:.1f}x" if ratio is not None else "-"
        print(
            f"{r.label:<{width}}  {unit:<20} {cell(vals['torch']):>26} {cell(vals['tensorshare']):>26} "
            f"{ratio_s:>8}  {target}"
        )
    for job, e in errors.items():
        print(f"error: {job}: {e}")
    print(f"\n# ratio: how many times better tensorshare is; medians of {reps} repetitions, ranges in ()")
    print(
        f"# whole run: {time.perf_counter() - t_all:.0f} s, load average at the end {os.getloadavg()[0]:.2f}"
    )
    if summary:
        print("# targets: " + "; ".join(summary))

    names = {s: (runners[s].hello or {}).get("system", s) for s in SYSTEMS}
    lines = []
    for job in order:
        runs = results.get(job)
        if not runs:
            continue
        workload, system, variant, args = job
        medians = {k: statistics.median(f[k] for f in runs) for k in runs[0]}
        line = {
            "system": names[system],
            "workload": workload,
            "args": [str(x) for x in args],
            "strategy": a.strategy,
            **medians,
            "variant": variant,
            "runs": runs,
        }
        lines.append(json.dumps(line))
    if a.json:
        print()
        print("\n".join(lines))
    if a.json_out:
        with open(a.json_out, "a") as f:
            f.writelines(line + "\n" for line in lines)


if __name__ == "__main__":
    main()
