#!/usr/bin/env python3
"""The tables of scripts/bench.sh's multi-run suites, from their raw output.

    tables.py ddp RESULTS_CSV NP ROUNDS          # tandem_ddp_bench + torch_ddp_bench.py lines
    tables.py mpi TANDEM_CSV TORCH_CSV NP        # mpi_allreduce_bench + torch_allreduce.py
    tables.py observe DIR REPS                   # DIR/{off,tb,trace}: samples/s, one a line

Prints Markdown tables (docs/benchmarks.md shows them). Standard library only.
"""
import csv
import statistics
import sys


def ddp(results_csv, np, rounds):
    runs = {}
    for line in open(results_csv):
        f = line.strip().split(",")
        if len(f) < 17:
            continue
        key = (f[1], int(f[2]))
        runs.setdefault(key, {}).setdefault(f[0], []).append(
            (float(f[4]), [float(v) for v in f[7:]]))
    print(f"DataParallel step, {np} processes x 1 CPU rank, plain SGD, median over "
          f"{rounds} alternating runs (each the median of 5 repetitions of 20 steps)")
    print("| model | global batch | tandem (ms) | PyTorch DDP gloo (ms) | torch / tandem "
          "| max loss diff (10 steps) |")
    print("|---|---:|---:|---:|---:|---:|")
    for (model, batch), sides in sorted(runs.items(), key=lambda kv: (kv[0][0] != "mlp", kv[0])):
        t = statistics.median(us for us, _ in sides["tandem"]) / 1e3
        g = statistics.median(us for us, _ in sides["torch_ddp"]) / 1e3
        diff = max(abs(a - b) for a, b in zip(sides["tandem"][0][1], sides["torch_ddp"][0][1]))
        print(f"| {model} | {batch} | {t:.2f} | {g:.2f} | {g / t:.2f}x | {diff:.1e} |")
    overlap = {}
    for line in open(results_csv):
        f = line.strip().split(",")
        if f[0] == "tandem_overlap":
            overlap.setdefault((f[1], int(f[2])), []).append([float(v) for v in f[4:8]])
    if overlap:
        print()
        print("tandem: bucket all-reduces overlapped with backward vs reduced after it "
              "(same buckets)")
        print("| model | global batch | overlapped (ms) | after backward (ms) "
              "| no reduction (ms) | reduction hidden |")
        print("|---|---:|---:|---:|---:|---:|")
        for (model, batch), rows in sorted(overlap.items(),
                                           key=lambda kv: (kv[0][0] != "mlp", kv[0])):
            o, s, c, h = (statistics.median(r[i] for r in rows) for i in range(4))
            print(f"| {model} | {batch} | {o / 1e3:.2f} | {s / 1e3:.2f} | {c / 1e3:.2f} "
                  f"| {h:.0%} |")


def mpi(tandem_csv, torch_csv, np):
    rows = {}
    for path in (tandem_csv, torch_csv):
        with open(path) as f:
            for r in csv.DictReader(line for line in f if "," in line):
                rows.setdefault(int(r["bytes"]), {})[r["impl"]] = (
                    float(r["us_per_call"]), float(r["algbw_GBps"]))
    print(f"all_reduce float32 sum, {np} processes x 1 CPU rank, median us per call (GB/s)")
    print("| bytes | MPI_Allreduce | MPI_Iallreduce + MPI_Test | tandem | torch gloo "
          "| tandem / MPI_Allreduce | tandem / MPI_Iallreduce |")
    print("|---:|---:|---:|---:|---:|---:|---:|")

    def cell(v):
        return f"{v[0]:.1f} ({v[1]:.2f})" if v else "-"

    for b in sorted(rows):
        r = rows[b]
        m, nb, t, g = r.get("mpi"), r.get("mpi_nonblocking"), r.get("tandem"), r.get("torch_gloo")
        ratio = f"{m[0] / t[0]:.2f}x" if m and t else "-"
        nb_ratio = f"{nb[0] / t[0]:.2f}x" if nb and t else "-"
        size = f"{b // 1024} KB" if b < 1 << 20 else f"{b >> 20} MB"
        print(f"| {size} | {cell(m)} | {cell(nb)} | {cell(t)} | {cell(g)} | {ratio} "
              f"| {nb_ratio} |")


def observe(d, reps):
    med = {k: statistics.median(float(x) for x in open(f"{d}/{k}") if x.strip())
           for k in ("off", "tb", "trace")}
    print(f"train_mnist, 2 CPU ranks, median training samples/s of {reps} alternating runs")
    print("| configuration | samples/s | slower than off |")
    print("|---|---:|---:|")
    for k, name in (("off", "nothing on"), ("tb", "--tensorboard_dir"),
                    ("trace", "--tensorboard_dir --trace (every step)")):
        print(f"| {name} | {med[k]:.0f} | {100 * (med['off'] / med[k] - 1):+.1f}% |")


TABLES = {"ddp": (ddp, 3), "mpi": (mpi, 3), "observe": (observe, 2)}

if __name__ == "__main__":
    table = TABLES.get(sys.argv[1]) if len(sys.argv) > 1 else None
    if table is None or len(sys.argv) != 2 + table[1]:
        sys.exit(__doc__)
    table[0](*sys.argv[2:])
