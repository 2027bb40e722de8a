#!/usr/bin/env python3
"""Interleaved A/B of comm_bench binaries (e.g. one built from another commit).

    scripts/bench.sh comm_ab REPS LABEL:BINARY[:ENV=VALUE...] ... -- COMM_BENCH_ARGS

Runs every binary once per repetition, alternating, with the same arguments, and
prints per (collective, ranks, size) the median and the fastest of the reported
times, the 1-minute load average seen before the runs, and (when the runs cover
2 and 4 ranks) the 4-rank / 2-rank ratio of the medians. On a shared machine
only such interleaved comparisons mean anything. Example (docs/benchmarks.md):

    scripts/bench.sh comm_ab 7 before:/tmp/comm_bench_before \\
        after:build-cpu/bench/comm_bench -- --ranks=2,4 --collectives=all_reduce \\
        --min_bytes=1K --max_bytes=1K --iters=5000
"""
import collections
import os
import re
import statistics
import subprocess
import sys


def main():
    if "--" not in sys.argv or len(sys.argv) < 4:
        sys.exit(__doc__)
    split = sys.argv.index("--")
    reps = int(sys.argv[1])
    variants = []
    for spec in sys.argv[2:split]:
        fields = spec.split(":")
        env = dict(os.environ)
        env.update(kv.split("=", 1) for kv in fields[2:])
        variants.append((fields[0], fields[1], env))
    args = sys.argv[split + 1:]
    times = collections.defaultdict(list)  # (collective, ranks, bytes, label) -> us
    loads = []
    for _ in range(reps):
        for label, binary, env in variants:
            with open("/proc/loadavg") as f:
                loads.append(float(f.read().split()[0]))
            out = subprocess.run([binary] + args, capture_output=True, text=True, env=env,
                                 check=True).stdout
            table = None
            for line in out.splitlines():
                m = re.match(r"# (\w+): (\d+) ranks", line)
                if m:
                    table = (m.group(1), int(m.group(2)))
                    continue
                f = line.split()
                if table and len(f) >= 7 and f[0].isdigit():
                    times[table + (int(f[0]), label)].append(float(f[-3]))  # time (us)
    labels = [v[0] for v in variants]
    print(f"# {reps} repetitions; load average (1 min) before the runs: min {min(loads):.2f}, "
          f"median {statistics.median(loads):.2f}, max {max(loads):.2f}")
    print("| collective | ranks | size (B) | " +
          " | ".join(f"{l}: median us (fastest)" for l in labels) + " |")
    print("|---|---:|---:|" + "---:|" * len(labels))
    for key in sorted({k[:3] for k in times}):
        cells = []
        for l in labels:
            v = times.get(key + (l,))
            cells.append(f"{statistics.median(v):.2f} ({min(v):.2f})" if v else "-")
        print(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " |")
    pairs = sorted({(k[0], k[2]) for k in times})
    if any(k[1] == 2 for k in times) and any(k[1] == 4 for k in times):
        print("\n| collective | size (B) | " +
              " | ".join(f"{l}: 2 ranks us | {l}: 4 ranks us | {l}: 4/2" for l in labels) + " |")
        print("|---|---:|" + "---:|---:|---:|" * len(labels))
        for c, b in pairs:
            cells = []
            for l in labels:
                two, four = times.get((c, 2, b, l)), times.get((c, 4, b, l))
                if two and four:
                    m2, m4 = statistics.median(two), statistics.median(four)
                    cells.append(f"{m2:.2f} | {m4:.2f} | {m4 / m2:.2f}x")
                else:
                    cells.append("- | - | -")
            print(f"| {c} | {b} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
