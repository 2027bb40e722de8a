#!/usr/bin/env bash
# ResNet training-step time on the CPU, tandem against PyTorch eager, runs
# interleaved (tandem, torch, tandem, ...) so that both see the same load:
#
#   bench/resnet_step_bench.sh BUILD_DIR [MODEL] [BATCH] [THREADS] [RUNS] [WARMUP] [STEPS]
#
# scripts/bench.sh resnet builds the binary and runs this. Defaults: resnet18_cifar, batch 32, 2 threads, 5 runs of 2 warm-up + 5 timed
# steps. Prints every run's line, then the median over the runs of each side's
# per-run median step time and the ratio torch / tandem.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
build="${1:?usage: resnet_step_bench.sh BUILD_DIR [MODEL] [BATCH] [THREADS] [RUNS] [WARMUP] [STEPS]}"
model="${2:-resnet18_cifar}" batch="${3:-32}" threads="${4:-2}" runs="${5:-5}"
warmup="${6:-2}" steps="${7:-5}"
source "$here/../scripts/torch_python.sh" torchvision
if [ -z "$python" ]; then echo "no Python with torch and torchvision" >&2; exit 1; fi
bench="$build/bench/resnet_step_bench"
lines=()
for run in $(seq "$runs"); do
  lines+=("$("$bench" "$model" "$batch" "$threads" "$warmup" "$steps")")
  echo "${lines[-1]}"
  lines+=("$(OMP_NUM_THREADS="$threads" "$python" "$here/resnet_step_bench.py" "$model" "$batch" \
             "$threads" "$warmup" "$steps")")
  echo "${lines[-1]}"
done
printf '%s\n' "${lines[@]}" | "$python" -c '
import statistics, sys
t = {"tandem": [], "torch": []}
for line in sys.stdin:
    words = line.split()
    t[words[0]].append(float(words[words.index("median_us") + 1]))
a, b, n = statistics.median(t["tandem"]), statistics.median(t["torch"]), len(t["tandem"])
print(f"median of {n} runs: tandem {a:.0f} us/step, torch {b:.0f} us/step, "
      f"torch / tandem {b / a:.2f}x")'
