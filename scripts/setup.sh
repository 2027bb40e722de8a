#!/usr/bin/env bash
# Installs the Debian 12 packages tandem needs, if any is missing. Idempotent.
# As root it runs apt-get; otherwise it prints the exact command to run and fails.
# The CUDA toolkit (with cuDNN and NCCL) is not a Debian package: when it is at
# /usr/local/cuda the build uses it (TANDEM_CUDA=AUTO), otherwise it builds CPU-only.
# OpenMPI (openmpi-bin, libopenmpi-dev) starts and connects the processes of a
# multi-process job (TANDEM_MPI=AUTO builds that layer when it is installed).
# python3-protobuf: the tests' independent reader of TensorBoard event files;
# python3-matplotlib: scripts/plot_metrics.py; nlohmann-json3-dev: the JSON
# headers of safetensors files (nn/safetensors.cc); libfmt-dev: the logger's
# formatting (spawn/logger.h); clang: scripts/test.sh's compile check of the
# libraries with a second compiler; python3-torch and
# python3-torchvision: the tests that exchange weights with PyTorch
# (tests/apps/interop_test.py) and the PyTorch side of the benchmarks;
# valgrind: the memory check of the CPU primitive cache's eviction
# (nn_dnnl_cache_valgrind_test).
set -euo pipefail
packages=(build-essential cmake g++ clang libabsl-dev libfmt-dev libgtest-dev libgmock-dev
          libbenchmark-dev libopenblas-dev libdnnl-dev zlib1g-dev nlohmann-json3-dev
          dataset-fashion-mnist openmpi-bin libopenmpi-dev python3 python3-protobuf
          python3-matplotlib python3-torch python3-torchvision valgrind)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
cmd="apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y ${missing[*]}"
if [ "$(id -u)" -eq 0 ]; then
  echo "setup: installing ${missing[*]}"
  bash -c "$cmd"
else
  echo "setup: missing Debian packages: ${missing[*]}" >&2
  echo "setup: run as root:  sudo bash -c '$cmd'" >&2
  exit 1
fi
