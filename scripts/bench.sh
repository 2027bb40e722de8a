#!/usr/bin/env bash
# The tandem vs PyTorch benchmark in one command: builds tandem_bench
# in $BUILD (default build) when that build directory exists, picks a Python
# that can import torch ($PYTHON, else python3, else /usr/bin/python3) and runs
# scripts/bench/compare.py with the remaining arguments, e.g.
#
#   scripts/bench.sh --devices=cpu --threads=1 --out=/tmp/bench
#   scripts/bench.sh --devices=cuda:0 --cuda_graph --steps=100
#
# See compare.py --help for the flags; its exit status is this script's.
set -euo pipefail
cd "$(dirname "$0")/.."
build="${BUILD:-build}"
if [ -f "$build/CMakeCache.txt" ]; then
  cmake --build "$build" --target tandem_bench -j"${JOBS:-2}" >/dev/null
fi
source scripts/torch_python.sh torch
if [ -z "$python" ]; then
  echo "bench.sh: no Python that can import torch (tried python3, /usr/bin/python3); set PYTHON" >&2
  exit 2
fi
bench_args=()
if [ -x "$build/apps/tandem_bench" ]; then bench_args=("--bench=$build/apps/tandem_bench"); fi
exec "$python" scripts/bench/compare.py --python="$python" "${bench_args[@]}" "$@"
