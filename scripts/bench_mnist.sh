#!/usr/bin/env bash
# train_mnist vs the same job in PyTorch, end to end: builds
# train_mnist in $BUILD (default build-cpu, the CPU-only build) and runs
# scripts/bench/mnist_e2e.py with the remaining arguments, e.g.
#
#   scripts/bench_mnist.sh --runs=5
#   BUILD=build scripts/bench_mnist.sh --runs=3 --tandem_args="--gpus=cpu --nprocs=2 --batch_size=32"
#
# See mnist_e2e.py --help for the flags; its exit status is this script's.
set -euo pipefail
cd "$(dirname "$0")/.."
build="${BUILD:-build-cpu}"
if [ ! -f "$build/CMakeCache.txt" ]; then
  echo "bench_mnist.sh: no CMake build in $build (set BUILD, or run scripts/build.sh)" >&2
  exit 2
fi
cmake --build "$build" --target train_mnist -j"${JOBS:-2}" >/dev/null
source scripts/torch_python.sh torch
if [ -z "$python" ]; then
  echo "bench_mnist.sh: no Python that can import torch (tried python3, /usr/bin/python3); set PYTHON" >&2
  exit 2
fi
exec "$python" scripts/bench/mnist_e2e.py --python="$python" --train_mnist="$build/apps/train_mnist" "$@"
