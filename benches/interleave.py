"""Compares two builds of tensorshare: `bench --all` of each in turn, ROUNDS times, so that
the machine's drift touches both alike; prints, per figure, the median and the range of each.

    python3 benches/interleave.py OLD_BINARY NEW_BINARY [ROUNDS (default 5)]

Build the old one in a worktree of its own, for example
`git worktree add --detach ../old REV && (cd ../old && cargo build --release)`, and pass
`../old/target/release/tensorshare target/release/tensorshare`. Needs nothing but Python 3.
"""
import re
import statistics
import subprocess
import sys
from collections import defaultdict

NUMBER = re.compile(r"^[0-9.]+$")
KEY = re.compile(r"^[A-Za-z_]+$")


def figures(line):
    """`pingpong 4096 2000 fresh median_us 9.1 p99_us 30` -> ("pingpong 4096 2000 fresh", {...})."""
    toks = line.split()
    for i in range(1, len(toks) - 1):
        if KEY.match(toks[i]) and NUMBER.match(toks[i + 1]):
            pairs = toks[i:]
            return " ".join(toks[:i]), {pairs[k]: float(pairs[k + 1]) for k in range(0, len(pairs) - 1, 2)}
    return None, {}


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    binaries = sys.argv[1:3]
    rounds = int(sys.argv[3]) if len(sys.argv) == 4 else 5
    seen = defaultdict(list)
    # One run of each workload per round (the rounds give the spread); older builds run
    # once anyway and have no --runs.
    one_run = {
        b: ["--runs", "1"] if "--runs" in subprocess.run([b, "bench", "--help"], capture_output=True, text=True).stdout else []
        for b in binaries
    }
    for _ in range(rounds):
        for b in binaries:
            out = subprocess.run([b, "bench", "--all", *one_run[b]], capture_output=True, text=True, check=True).stdout
            for line in out.splitlines():
                name, figs = figures(line)
                for key, value in figs.items():
                    seen[(name, key, b)].append(value)
    rows = sorted({(n, k) for (n, k, _) in seen})
    print(f"{'workload':32s} {'figure':14s} " + "  ".join(f"{b[-40:]:>36s}" for b in binaries))
    for name, key in rows:
        cells = []
        for b in binaries:
            v = seen[(name, key, b)]
            cells.append(f"{statistics.median(v):>12.4g} ({min(v):.4g}..{max(v):.4g})".rjust(36))
        print(f"{name:32s} {key:14s} " + "  ".join(cells))


if __name__ == "__main__":
    main()
