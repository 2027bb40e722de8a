#!/usr/bin/env bash
# Cross-process all_reduce bandwidth on one machine: tandem's
# hierarchical communicator (2 processes x 1 CPU rank, through MPI) against a
# raw MPI_Allreduce and PyTorch's gloo all_reduce, 1 KB .. 64 MB, float32 sum.
#
#   scripts/bench_mpi.sh                    # build in $BUILD (default build), 2 processes
#   NP=4 REPS=7 scripts/bench_mpi.sh 1024 67108864
#
# Prints one table: bytes, microseconds per call and GB/s (bytes / time) for
# each, and tandem / MPI. Run it on a quiet machine: every number is a median of
# REPS loops, but another job's load still shows. Needs OpenMPI (scripts/setup.sh)
# and, for the gloo column, a Python that imports torch ($PYTHON, else python3,
# else /usr/bin/python3: Debian's python3-torch); without it that column is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
build="${BUILD:-build}"
np="${NP:-2}"
reps="${REPS:-5}"
min_bytes="${1:-1024}"
max_bytes="${2:-67108864}"
cmake --build "$build" --target mpi_allreduce_bench -j"${JOBS:-2}" >/dev/null
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
tests/spawn/mpirun.sh -np "$np" "$build/apps/mpi_allreduce_bench" "$min_bytes" "$max_bytes" \
  "$reps" >"$out/tandem.csv" 2>"$out/tandem.err" || { cat "$out/tandem.err" >&2; exit 1; }
source scripts/torch_python.sh torch.distributed
if [ -n "$python" ]; then
  tests/spawn/mpirun.sh -np "$np" "$python" scripts/bench/torch_allreduce.py "$min_bytes" \
    "$max_bytes" "$reps" >"$out/torch.csv" 2>"$out/torch.err" ||
    { echo "bench_mpi: the torch gloo run failed:" >&2; cat "$out/torch.err" >&2; : >"$out/torch.csv"; }
else
  echo "bench_mpi: no Python that imports torch.distributed (tried python3, /usr/bin/python3;" \
       "set PYTHON): no gloo column" >&2
  : >"$out/torch.csv"
fi
python3 - "$out/tandem.csv" "$out/torch.csv" "$np" <<'PY'
import csv, sys
rows = {}
for path in sys.argv[1:3]:
    with open(path) as f:
        for r in csv.DictReader(line for line in f if "," in line):
            rows.setdefault(int(r["bytes"]), {})[r["impl"]] = (float(r["us_per_call"]), float(r["algbw_GBps"]))
print(f"all_reduce float32 sum, {sys.argv[3]} processes x 1 CPU rank, median us per call (GB/s)")
print("| bytes | MPI_Allreduce | MPI_Iallreduce + MPI_Test | tandem | torch gloo | tandem / MPI_Allreduce | tandem / MPI_Iallreduce |")
print("|---:|---:|---:|---:|---:|---:|---:|")
def cell(v):
    return f"{v[0]:.1f} ({v[1]:.2f})" if v else "-"
for b in sorted(rows):
    r = rows[b]
    m, nb, t, g = r.get("mpi"), r.get("mpi_nonblocking"), r.get("tandem"), r.get("torch_gloo")
    ratio = f"{m[0] / t[0]:.2f}x" if m and t else "-"
    nb_ratio = f"{nb[0] / t[0]:.2f}x" if nb and t else "-"
    size = f"{b // 1024} KB" if b < 1 << 20 else f"{b >> 20} MB"
    print(f"| {size} | {cell(m)} | {cell(nb)} | {cell(t)} | {cell(g)} | {ratio} | {nb_ratio} |")
PY
