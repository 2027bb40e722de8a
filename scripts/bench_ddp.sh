#!/usr/bin/env bash
# Data-parallel training steps across processes: tandem (P processes x
# 1 CPU rank, through MPI) against PyTorch DistributedDataParallel on gloo (P
# processes), from the same initial weights and data (an exchange directory of
# tandem_bench), the same global batch split the same way, plain SGD.
#
#   scripts/bench_ddp.sh                                  # build in $BUILD (default build)
#   NP=2 ROUNDS=3 MODELS=mlp,lenet BATCHES=32,64,128 scripts/bench_ddp.sh
#
# Runs tandem then torch ROUNDS times (alternating, so load drifts hit both);
# each run reports per cell the median of its repetitions, the table shows the
# median over the rounds: milliseconds per step, torch / tandem, and the largest
# difference between the two sides' first 10 (global mean) losses. One thread per
# process (NP processes on NP cores). Needs OpenMPI and a Python that imports
# torch.distributed ($PYTHON, python3 or /usr/bin/python3: Debian's python3-torch).
set -euo pipefail
cd "$(dirname "$0")/.."
build="${BUILD:-build}"
np="${NP:-2}"
rounds="${ROUNDS:-3}"
models="${MODELS:-mlp,lenet}"
batches="${BATCHES:-32,64,128}"
steps="${STEPS:-20}"
source scripts/torch_python.sh torch.distributed
if [ -z "$python" ]; then
  echo "bench_ddp: no Python that imports torch.distributed (set PYTHON)" >&2
  exit 1
fi
cmake --build "$build" --target tandem_bench tandem_ddp_bench -j"${JOBS:-2}" >/dev/null
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
largest="$(tr ',' '\n' <<<"$batches" | sort -n | tail -1)"
"$build/apps/tandem_bench" --device=cpu --models="$models" --batch_sizes="$largest" \
  --optimizers=sgd --steps=1 --warmup_steps=0 --repetitions=5 --threads=1 \
  --export_dir="$out/exchange" >/dev/null 2>"$out/export.err" ||
  { cat "$out/export.err" >&2; exit 1; }
common=(--import_dir="$out/exchange" --models="$models" --batch_sizes="$batches"
        --steps="$steps" --threads=1)
for r in $(seq "$rounds"); do
  tests/spawn/mpirun.sh -np "$np" "$build/apps/tandem_ddp_bench" "${common[@]}" \
    >>"$out/results.csv" 2>"$out/tandem.err" || { cat "$out/tandem.err" >&2; exit 1; }
  TORCH_BENCH_PORT=$((29600 + r)) tests/spawn/mpirun.sh -np "$np" "$python" \
    scripts/bench/torch_ddp_bench.py "${common[@]}" >>"$out/results.csv" 2>"$out/torch.err" ||
    { cat "$out/torch.err" >&2; exit 1; }
done
python3 - "$out/results.csv" "$np" "$rounds" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    if len(f) < 17:
        continue
    key = (f[1], int(f[2]))
    runs.setdefault(key, {}).setdefault(f[0], []).append((float(f[4]), [float(v) for v in f[7:]]))
print(f"DataParallel step, {sys.argv[2]} processes x 1 CPU rank, plain SGD, median over "
      f"{sys.argv[3]} alternating runs (each the median of 5 repetitions of 20 steps)")
print("| model | global batch | tandem (ms) | PyTorch DDP gloo (ms) | torch / tandem | max loss diff (10 steps) |")
print("|---|---:|---:|---:|---:|---:|")
for (model, batch), sides in sorted(runs.items(), key=lambda kv: (kv[0][0] != "mlp", kv[0])):
    t = statistics.median(us for us, _ in sides["tandem"]) / 1e3
    g = statistics.median(us for us, _ in sides["torch_ddp"]) / 1e3
    diff = max(abs(a - b) for a, b in zip(sides["tandem"][0][1], sides["torch_ddp"][0][1]))
    print(f"| {model} | {batch} | {t:.2f} | {g:.2f} | {g / t:.2f}x | {diff:.1e} |")
overlap = {}
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    if f[0] == "tandem_overlap":
        overlap.setdefault((f[1], int(f[2])), []).append([float(v) for v in f[4:8]])
if overlap:
    print()
    print("tandem: bucket all-reduces overlapped with backward vs reduced after it (same buckets)")
    print("| model | global batch | overlapped (ms) | after backward (ms) | no reduction (ms) | reduction hidden |")
    print("|---|---:|---:|---:|---:|---:|")
    for (model, batch), rows in sorted(overlap.items(), key=lambda kv: (kv[0][0] != "mlp", kv[0])):
        o, s, c, h = (statistics.median(r[i] for r in rows) for i in range(4))
        print(f"| {model} | {batch} | {o / 1e3:.2f} | {s / 1e3:.2f} | {c / 1e3:.2f} | {h:.0%} |")
PY
