#!/usr/bin/env bash
# The in-process communicator's benchmark in one command: builds
# comm_bench (and mpi_comm_bench when MPI is found) in $BUILD (default build-cpu,
# configured Release with TANDEM_CUDA=OFF if it does not exist yet), then prints
#   1. a single-thread memcpy of 64 MB (the bandwidth bound of a 2-rank all_reduce),
#   2. every collective over 8 B .. $MAX_BYTES on 2 and 4 CPU ranks (nccl-tests
#      columns: size, count, type, redop, time, algbw, busbw),
#   3. the same collectives between 2 (and 4) MPI processes (OpenMPI's shared
#      memory), when mpirun and mpi_comm_bench are there,
#   4. DataParallel step times of LeNet and the MLP, batch 32 per rank, 1 and 2
#      CPU ranks.
# Environment: BUILD, MAX_BYTES (default 256M), ITERS (default 20), RANKS
# (default 2,4), JOBS (build jobs, default 2), COMM_BENCH (a prebuilt binary to
# run instead, e.g. one built from another commit: see docs/benchmarks.md).
# Arguments go to comm_bench's collectives run (e.g. --collectives=all_reduce,
# --windows=10 on a busy machine). A full run takes a few minutes on a quiet
# 2-core machine; a quick one:
#   MAX_BYTES=4M ITERS=10 scripts/bench_comm.sh
set -euo pipefail
cd "$(dirname "$0")/.."
build="${BUILD:-build-cpu}"
max_bytes="${MAX_BYTES:-256M}"
iters="${ITERS:-20}"
ranks="${RANKS:-2,4}"
if [ -z "${COMM_BENCH:-}" ]; then
  if [ ! -f "$build/CMakeCache.txt" ]; then
    cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DTANDEM_CUDA=OFF >/dev/null
  fi
  targets=(comm_bench)
  build_targets="$(cmake --build "$build" --target help 2>/dev/null || true)"
  if [[ "$build_targets" == *mpi_comm_bench* ]]; then targets+=(mpi_comm_bench); fi
  cmake --build "$build" -j"${JOBS:-2}" --target "${targets[@]}" >/dev/null
fi
bench="${COMM_BENCH:-$build/apps/comm_bench}"
mpi_bench="$(dirname "$bench")/mpi_comm_bench"

echo "# $(date -u '+%Y-%m-%d %H:%M UTC') $(uname -n), $(nproc) CPUs, load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
"$bench" --mode=memcpy --memcpy_bytes=64M
"$bench" --mode=collectives --ranks="$ranks" --max_bytes="$max_bytes" --iters="$iters" "$@"
if command -v mpirun >/dev/null && [ -x "$mpi_bench" ]; then
  IFS=, read -r -a rank_list <<<"$ranks"
  for n in "${rank_list[@]}"; do
    mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$n" \
      "$mpi_bench" --max_bytes="$max_bytes" --iters="$iters"
  done
else
  echo "# (no mpirun or mpi_comm_bench: the MPI rows are skipped)"
fi
"$bench" --mode=dp --ranks=1,2 --models=lenet,mlp --batch=32
