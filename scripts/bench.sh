#!/usr/bin/env bash
# The benchmarks (bench/) in one command:
#
#   scripts/bench.sh SUITE [ARGS...]
#   scripts/bench.sh --help            # lists the suites
#
# Every suite builds only its own targets, in the build folder of the
# CMakePresets.json preset $PRESET (default cpu: build-cpu), configuring it with
# that preset when it has no CMakeCache.txt yet; BUILD=DIR uses DIR instead
# (configured with $PRESET when new). The binaries are in DIR/bench/ (the
# benchmarks) and DIR/apps/ (the programs). A suite's first output line names
# the time, the machine and its load: on a shared machine compare only runs made
# interleaved in one command. Environment: PRESET, BUILD, JOBS (build jobs,
# default 2), PYTHON (a Python that imports torch; default python3, then
# /usr/bin/python3), and the per-suite variables in the list below.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  cat <<'EOF'
Usage: scripts/bench.sh SUITE [ARGS...]   (PRESET=cpu|default|gpu, BUILD=DIR, JOBS=N)

Suites:
  steps    tandem vs PyTorch per training step, same weights and data, loss check
           (tandem_bench, bench/torch_bench.py; ARGS go to bench/compare.py, e.g.
           --devices=cpu --threads=1 --modes=eager --steps=5; see compare.py --help)
  mnist    train_mnist vs the same job in PyTorch, end to end: wall time, peak RSS,
           accuracy (bench/mnist_e2e.py; ARGS e.g. --runs=3, --epochs=1 for a quick run)
  comm     the in-process communicator's collectives (nccl-tests columns) on 2 and 4
           CPU ranks, OpenMPI's for comparison, DataParallel steps (comm_bench,
           mpi_comm_bench; env MAX_BYTES=256M ITERS=20 RANKS=2,4, COMM_BENCH=a prebuilt
           binary; ARGS go to the collectives run, e.g. --collectives=all_reduce)
  comm_ab  interleaved A/B of comm_bench binaries (bench/comm_ab.py):
           REPS LABEL:BINARY[:ENV=VALUE...] ... -- COMM_BENCH_ARGS
  mpi      cross-process all_reduce: tandem vs MPI_Allreduce vs torch gloo
           (mpi_allreduce_bench, bench/torch_allreduce.py; env NP=2 REPS=5;
           ARGS: [MIN_BYTES [MAX_BYTES]], default 1024 67108864)
  ddp      DataParallel across processes vs PyTorch DDP on gloo (tandem_ddp_bench,
           bench/torch_ddp_bench.py; env NP=2 ROUNDS=3 MODELS=mlp,lenet
           BATCHES=32,64,128 STEPS=20)
  observe  train_mnist's throughput with nothing, --tensorboard_dir, and --trace on
           every step (env REPS=5 TRAIN_LIMIT=12800)
  ops      Google Benchmark: forward + backward of the ops, CPU and CUDA rows
           (nn_ops_bench; ARGS added to --benchmark_repetitions=5
           --benchmark_report_aggregates_only=true)
  blas     Google Benchmark: OpenBLAS called from several rank threads at once
           (nn_blas_threads_bench; ARGS go to it)
  trace    Google Benchmark: the per-step cost of trace spans and summary scalars
           (spawn_trace_bench; ARGS added to --benchmark_repetitions=5)
  resnet   ResNet training steps on the CPU vs PyTorch eager, interleaved runs
           (resnet_step_bench, bench/resnet_step_bench.py; ARGS: [MODEL] [BATCH]
           [THREADS] [RUNS] [WARMUP] [STEPS], default resnet18_cifar 32 2 5 2 5)
  host_cost  host microseconds per tiny op (add, relu, linear, conv2d, forward and
           backward) vs PyTorch, CPU and cuda:0 rows, one sync per repetition
           (host_cost_bench, bench/torch_host_cost.py; ARGS go to bench/host_cost.py,
           e.g. --devices=cpu --threads=1 --repetitions=5 --rounds=3)
EOF
}

suite="${1:-}"
case "$suite" in
  "" | -h | --help | help) usage; exit 0 ;;
esac
shift

# --- The build ---------------------------------------------------------------------
preset="${PRESET:-cpu}"
preset_dir() {  # the binaryDir of configure preset $1, relative to the source tree
  python3 - "$1" <<'EOF'
import json, sys
for p in json.load(open("CMakePresets.json"))["configurePresets"]:
    if p["name"] == sys.argv[1] and "binaryDir" in p:
        print(p["binaryDir"].replace("${sourceDir}/", ""))
        sys.exit(0)
sys.exit(f"bench.sh: no configure preset '{sys.argv[1]}' with a binaryDir in CMakePresets.json")
EOF
}
if [ -n "${BUILD:-}" ]; then build="$BUILD"; else build="$(preset_dir "$preset")"; fi
configure() {
  [ -f "$build/CMakeCache.txt" ] && return 0
  echo "bench.sh: configuring $build (cmake --preset $preset)" >&2
  cmake --preset "$preset" -B "$build" >/dev/null
}
target_list=""
has_target() {  # whether the build defines target $1 (the list is read once)
  configure
  [ -n "$target_list" ] || target_list="$(cmake --build "$build" --target help 2>/dev/null || true)"
  grep -qw -- "$1" <<<"$target_list"
}
build_targets() {  # build_targets TARGET...: builds them, or exits naming the one missing
  configure
  local t
  for t in "$@"; do
    if ! has_target "$t"; then
      echo "bench.sh: $build has no target $t (MPI or Google Benchmark missing? see" \
           "scripts/setup.sh)" >&2
      exit 2
    fi
  done
  cmake --build "$build" -j"${JOBS:-2}" --target "$@" >/dev/null
}
need_python() {  # need_python MODULE: sets $python to a Python that imports MODULE, or exits
  source scripts/torch_python.sh "$1"
  if [ -z "$python" ]; then
    echo "bench.sh $suite: no Python that imports $1 (tried python3, /usr/bin/python3);" \
         "set PYTHON" >&2
    exit 2
  fi
}
scratch() {  # sets $out to a temporary folder, removed when the script exits
  out="$(mktemp -d)"
  trap 'rm -rf "$out"' EXIT
}
header() {
  echo "# $(date -u '+%Y-%m-%d %H:%M UTC') $(uname -n), $(nproc) CPUs," \
       "load: $(cut -d' ' -f1-3 /proc/loadavg); build $build"
}

# --- The suites ----------------------------------------------------------------------
suite_steps() {
  build_targets tandem_bench
  need_python torch
  header
  "$python" bench/compare.py --python="$python" --bench="$build/bench/tandem_bench" "$@"
}

suite_mnist() {
  build_targets train_mnist
  need_python torch
  header
  "$python" bench/mnist_e2e.py --python="$python" --train_mnist="$build/apps/train_mnist" "$@"
}

suite_comm() {
  local max_bytes="${MAX_BYTES:-256M}" iters="${ITERS:-20}" ranks="${RANKS:-2,4}"
  if [ -z "${COMM_BENCH:-}" ]; then
    build_targets comm_bench
    if has_target mpi_comm_bench; then build_targets mpi_comm_bench; fi
  fi
  local bench="${COMM_BENCH:-$build/bench/comm_bench}"
  local mpi_bench
  mpi_bench="$(dirname "$bench")/mpi_comm_bench"
  header
  echo "# $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
  "$bench" --mode=memcpy --memcpy_bytes=64M
  "$bench" --mode=collectives --ranks="$ranks" --max_bytes="$max_bytes" --iters="$iters" "$@"
  if command -v mpirun >/dev/null && [ -x "$mpi_bench" ]; then
    local n rank_list
    IFS=, read -r -a rank_list <<<"$ranks"
    for n in "${rank_list[@]}"; do
      mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$n" \
        "$mpi_bench" --max_bytes="$max_bytes" --iters="$iters"
    done
  else
    echo "# (no mpirun or mpi_comm_bench: the MPI rows are skipped)"
  fi
  "$bench" --mode=dp --ranks=1,2 --models=lenet,mlp --batch=32
}

suite_comm_ab() {
  build_targets comm_bench  # so that "after:$build/bench/comm_bench" is current
  header
  python3 bench/comm_ab.py "$@"
}

suite_mpi() {
  local np="${NP:-2}" reps="${REPS:-5}" min_bytes="${1:-1024}" max_bytes="${2:-67108864}"
  build_targets mpi_allreduce_bench
  scratch
  header
  tests/spawn/mpirun.sh -np "$np" "$build/bench/mpi_allreduce_bench" "$min_bytes" "$max_bytes" \
    "$reps" >"$out/tandem.csv" 2>"$out/tandem.err" || { cat "$out/tandem.err" >&2; exit 1; }
  source scripts/torch_python.sh torch.distributed
  if [ -n "$python" ]; then
    tests/spawn/mpirun.sh -np "$np" "$python" bench/torch_allreduce.py "$min_bytes" \
      "$max_bytes" "$reps" >"$out/torch.csv" 2>"$out/torch.err" ||
      { echo "bench.sh mpi: the torch gloo run failed:" >&2; cat "$out/torch.err" >&2
        : >"$out/torch.csv"; }
  else
    echo "bench.sh mpi: no Python that imports torch.distributed (tried python3," \
         "/usr/bin/python3; set PYTHON): no gloo column" >&2
    : >"$out/torch.csv"
  fi
  python3 bench/tables.py mpi "$out/tandem.csv" "$out/torch.csv" "$np"
}

suite_ddp() {
  local np="${NP:-2}" rounds="${ROUNDS:-3}" models="${MODELS:-mlp,lenet}"
  local batches="${BATCHES:-32,64,128}" steps="${STEPS:-20}"
  need_python torch.distributed
  build_targets tandem_bench tandem_ddp_bench
  local largest r
  scratch
  header
  largest="$(tr ',' '\n' <<<"$batches" | sort -n | tail -1)"
  "$build/bench/tandem_bench" --device=cpu --models="$models" --batch_sizes="$largest" \
    --optimizers=sgd --steps=1 --warmup_steps=0 --repetitions=5 --threads=1 \
    --export_dir="$out/exchange" >/dev/null 2>"$out/export.err" ||
    { cat "$out/export.err" >&2; exit 1; }
  local common=(--import_dir="$out/exchange" --models="$models" --batch_sizes="$batches"
                --steps="$steps" --threads=1)
  for r in $(seq "$rounds"); do
    tests/spawn/mpirun.sh -np "$np" "$build/bench/tandem_ddp_bench" "${common[@]}" \
      >>"$out/results.csv" 2>"$out/tandem.err" || { cat "$out/tandem.err" >&2; exit 1; }
    TORCH_BENCH_PORT=$((29600 + r)) tests/spawn/mpirun.sh -np "$np" "$python" \
      bench/torch_ddp_bench.py "${common[@]}" >>"$out/results.csv" 2>"$out/torch.err" ||
      { cat "$out/torch.err" >&2; exit 1; }
  done
  python3 bench/tables.py ddp "$out/results.csv" "$np" "$rounds"
}

suite_observe() {
  local reps="${REPS:-5}"
  local args=(--gpus=cpu --nprocs=2 --epochs=1 --train_limit="${TRAIN_LIMIT:-12800}"
              --test_limit=200 --log_every=20)
  build_targets train_mnist
  local r
  scratch
  header
  rate() { sed -n 's/.* \([0-9.]*\) samples\/s$/\1/p' | tail -1; }
  local train="$build/apps/train_mnist"
  for r in $(seq "$reps"); do
    "$train" "${args[@]}" 2>&1 | rate >>"$out/off"
    "$train" "${args[@]}" --tensorboard_dir="$out/tb$r" 2>&1 | rate >>"$out/tb"
    "$train" "${args[@]}" --tensorboard_dir="$out/tbt$r" --trace="$out/t$r.json" \
      --trace_steps=0: 2>&1 | rate >>"$out/trace"
  done
  python3 bench/tables.py observe "$out" "$reps"
}

suite_ops() {
  build_targets nn_ops_bench
  header
  "$build/bench/nn_ops_bench" --benchmark_repetitions=5 --benchmark_report_aggregates_only=true "$@"
}

suite_blas() {
  build_targets nn_blas_threads_bench
  header
  "$build/bench/nn_blas_threads_bench" "$@"
}

suite_trace() {
  build_targets spawn_trace_bench
  header
  "$build/bench/spawn_trace_bench" --benchmark_repetitions=5 "$@"
}

suite_resnet() {
  build_targets resnet_step_bench
  header
  bench/resnet_step_bench.sh "$build" "$@"
}

suite_host_cost() {
  build_targets host_cost_bench
  need_python torch
  header
  "$python" bench/host_cost.py --python="$python" --bench="$build/bench/host_cost_bench" "$@"
}

case "$suite" in
  steps | mnist | comm | comm_ab | mpi | ddp | observe | ops | blas | trace | resnet | host_cost)
    "suite_$suite" "$@" ;;
  *)
    echo "bench.sh: unknown suite '$suite'" >&2
    usage >&2
    exit 2
    ;;
esac
