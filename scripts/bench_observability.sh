#!/usr/bin/env bash
# The cost of observability: train_mnist on 2 CPU ranks, the same work
# with nothing on, with --tensorboard_dir, and with --trace over every step
# (--trace_steps=0:) plus --tensorboard_dir, alternating REPS times; prints the
# median training throughput (the summary's samples/s) of each and the slowdown.
#
#   BUILD=build REPS=5 scripts/bench_observability.sh
set -euo pipefail
cd "$(dirname "$0")/.."
build="${BUILD:-build}"
reps="${REPS:-5}"
args=(--gpus=cpu --nprocs=2 --epochs=1 --train_limit="${TRAIN_LIMIT:-12800}" --test_limit=200
      --log_every=20)
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
rate() { sed -n 's/.* \([0-9.]*\) samples\/s$/\1/p' | tail -1; }
for r in $(seq "$reps"); do
  "$build/apps/train_mnist" "${args[@]}" 2>&1 | rate >>"$out/off"
  "$build/apps/train_mnist" "${args[@]}" --tensorboard_dir="$out/tb$r" 2>&1 | rate >>"$out/tb"
  "$build/apps/train_mnist" "${args[@]}" --tensorboard_dir="$out/tbt$r" --trace="$out/t$r.json" \
    --trace_steps=0: 2>&1 | rate >>"$out/trace"
done
python3 - "$out" "$reps" <<'PY'
import statistics, sys
d = sys.argv[1]
med = {k: statistics.median(float(x) for x in open(f"{d}/{k}") if x.strip()) for k in ("off", "tb", "trace")}
print(f"train_mnist, 2 CPU ranks, median training samples/s of {sys.argv[2]} alternating runs")
print("| configuration | samples/s | slower than off |")
print("|---|---:|---:|")
for k, name in (("off", "nothing on"), ("tb", "--tensorboard_dir"),
                ("trace", "--tensorboard_dir --trace (every step)")):
    print(f"| {name} | {med[k]:.0f} | {100 * (med['off'] / med[k] - 1):+.1f}% |")
PY
