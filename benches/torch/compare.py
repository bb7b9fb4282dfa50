"""Runs each BENCHMARKS.md workload on torch.multiprocessing, then on tensorshare, on this
machine in one run, and prints both with the ratio (and, with --json, every JSON line).

    python benches/torch/compare.py [--strategy file_descriptor|file_system] [--json]
        [--tensorshare target/release/tensorshare] [--quick]

Needs torch (`python3 -m venv v && v/bin/pip install torch numpy`) and a release build
(`cargo build --release`). Run it with the venv's python.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# (workload, args, figure compared, True if higher is better). Rounds as tensorshare's --all.
TABLE = [
    ("pingpong", ["4096", "2000", "fresh"], "median_us", False),
    ("pingpong", ["4096", "2000", "same"], "median_us", False),
    ("pingpong", ["1048576", "500", "fresh"], "median_us", False),
    ("pingpong", ["67108864", "30", "fresh"], "median_us", False),
    ("stream", ["4096", "5000"], "GBps", True),
    ("stream", ["1048576", "1907"], "GBps", True),
    ("stream", ["67108864", "29"], "GBps", True),
    ("batch", ["1024", "100", "50"], "tensors_per_s", True),
    ("spawn", ["8"], "seconds", False),
    ("spawn", ["1"], "seconds", False),
]


def run(cmd, env):
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="file_descriptor")
    ap.add_argument("--tensorshare", default=os.path.join(ROOT, "target", "release", "tensorshare"))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer pingpong rounds for torch")
    a = ap.parse_args()
    env = dict(os.environ, STRATEGY=a.strategy)
    print(f"{'workload':<28} {'figure':<14} {'torch':>14} {'tensorshare':>14} {'ratio':>9}")
    for name, args, key, higher in TABLE:
        targs = list(args)
        if a.quick and name == "pingpong":
            targs[1] = str(min(int(targs[1]), 200))
        torch_line = run([sys.executable, os.path.join(HERE, "torch_workloads.py"), name, *targs], env)
        ours = run([a.tensorshare, "bench", "--json", "--strategy", a.strategy, name, *args], env)
        if a.json:
            print(json.dumps(torch_line))
            print(json.dumps(ours))
        t, o = torch_line[key], ours[key]
        ratio = (o / t) if higher else (t / o)
        print(f"{name + ' ' + ' '.join(args):<28} {key:<14} {t:>14.4g} {o:>14.4g} {ratio:>8.0f}x", flush=True)


if __name__ == "__main__":
    main()
