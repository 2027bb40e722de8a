#!/usr/bin/env bash
# Runs the GPU checks ON THE GPU MACHINE, from the repository root, with the
# build-gpu made elsewhere by scripts/gpu_bundle.sh carried along (as build-gpu,
# or as its archive build-carry/gpu.tar.xz, unpacked here when build-gpu is absent):
#
#   scripts/gpu_test.sh
#
# 1. Puts PyTorch's NVIDIA libraries (site-packages nvidia/*/lib: cudart, cuBLAS,
#    cuDNN, NCCL, ...) and build-gpu/lib on LD_LIBRARY_PATH and prints nvidia-smi.
# 2. Runs the gpu-labelled tests: `ctest --test-dir build-gpu -L gpu` after
#    rewriting the build machine's absolute paths in CTest's files to this copy's
#    location, or, where ctest is not installed, the gpu test binaries directly.
# 3. A short GPU training run: quickstart_linear cuda:0, and train_mnist (one
#    epoch on the Fashion-MNIST subset of build-gpu/data, eager, then again with
#    --cuda_graph) when both are there.
# 4. The microbenchmark bench/nn_ops_bench, its CUDA rows (median of 5;
#    OPS_BENCH_ARGS replaces the default --benchmark_filter=cuda: the bundle's
#    CPU rows run without oneDNN, so they say nothing of the CPU path, and take
#    most of a short lease).
# 5. The tandem vs PyTorch benchmark on GPU 0 (bench/compare.py with
#    build-gpu/bench/tandem_bench and $PYTHON): tandem eager and CUDA graph, torch
#    eager / compile / reduce-overhead, loss check, one table of ratios, written
#    to $OUT/bench (or bench-out/) as compare.md and compare.json. BENCH_ARGS
#    replaces its default arguments (e.g. BENCH_ARGS="--tf32 --models=mlp").
# 6. (only when STEPS names it) host_cost: the CUDA calls per op of
#    nn_host_cost_gpu_test, whose measured budget lines are written to
#    $OUT/cuda_call_budgets.inc (bench-out/ without OUT), then host microseconds
#    per tiny op on cuda:0 and the CPU, tandem against PyTorch (bench/host_cost.py
#    with build-gpu/bench/host_cost_bench; HOST_COST_ARGS replaces its default
#    --devices=cuda:0,cpu --repetitions=5 --rounds=3). One to three minutes.
# 7. (only when STEPS names it) memcheck: compute-sanitizer's memcheck tool over
#    the gpu test binaries named in MEMCHECK_TESTS (paths under build-gpu, default
#    tests/nn/nn_ops_gpu_test tests/optim/optim_gpu_test), each within
#    MEMCHECK_TIMEOUT seconds (default 120; "all" runs every binary of
#    build-gpu/gpu_tests.txt but spawn_nccl_two_process_gpu_test, whose forked
#    processes share the GPU for up to 110 s per test: name it to run it; about 6
#    minutes on an H100); a memory error it reports
#    fails the step. Failed CUDA API calls are not reported (--report-api-errors
#    no): NCCL's communicator setup probes kernel images the card cannot run (error
#    209, dozens per communicator) and nn_graph_gpu_test synchronizes inside a
#    capture on purpose (errors 900 and 901); tandem checks every call it makes.
# STEPS picks the parts after the library setup (default "tests training
# ops_bench bench"): the device tool limits one command to 10 minutes, and the
# whole benchmark with torch.compile takes longer than that, so run it in its own
# call, e.g. STEPS="tests training ops_bench" then STEPS=bench BENCH_ARGS="...".
# Everything is also appended to $OUT/gpu_test.log when OUT is set. PYTHON names
# the Python whose site-packages hold PyTorch's NVIDIA libraries (default
# python3). Every step runs even after a failure; the exit status is 1 when any
# failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
root="$(pwd -P)"
build="$root/build-gpu"
# gpu_bundle.sh's archive, when build-gpu itself was not carried.
if [ ! -d "$build" ] && [ -f "$root/build-carry/gpu.tar.xz" ]; then
  tar -xJf "$root/build-carry/gpu.tar.xz" -C "$root"
fi
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  exec > >(tee -a "$OUT/gpu_test.log") 2>&1
fi
failed=()
steps=" ${STEPS:-tests training ops_bench bench} "
wants() { [[ "$steps" == *" $1 "* ]]; }
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
run() {  # run NAME COMMAND...: runs it and records a failure under NAME
  local name="$1"; shift
  "$@" || { echo "gpu_test: $name FAILED (exit $?)"; failed+=("$name"); }
}

if [ ! -f "$build/bundle_root.txt" ]; then
  echo "gpu_test: $build/bundle_root.txt is missing: run scripts/gpu_bundle.sh on the build" \
       "machine and carry build-gpu" >&2
  exit 1
fi

step "libraries"
for gz in "$build"/lib/*.gz; do  # gpu_bundle.sh gzips the big ones (OpenBLAS)
  [ -e "$gz" ] || continue
  [ -f "${gz%.gz}" ] || gzip -dc "$gz" >"${gz%.gz}"
done
python="${PYTHON:-python3}"  # the Python that has PyTorch (PYTHON overrides)
nvidia_dirs="$("$python" - <<'EOF'
import glob, os, site, sysconfig
roots = set(site.getsitepackages() + [site.getusersitepackages()])
roots |= {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
dirs = []
for r in sorted(roots):
    for d in sorted(glob.glob(os.path.join(r, "nvidia", "*", "lib"))):
        if d not in dirs:
            dirs.append(d)
print(":".join(dirs))
EOF
)"
if [ -z "$nvidia_dirs" ]; then
  echo "gpu_test: no site-packages nvidia/*/lib folders found for $python" \
       "(set PYTHON to the Python that has PyTorch)"
fi
export LD_LIBRARY_PATH="$build/lib${nvidia_dirs:+:$nvidia_dirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
probe="$build/tests/spawn/spawn_gpu_test"  # links every NVIDIA library we use
if [ -x "$probe" ]; then
  ldd "$probe" | grep -E 'cuda|cublas|cudnn|nccl|openblas|absl_base|not found' || true
  if ldd "$probe" | grep -q 'not found'; then failed+=("libraries"); fi
fi

step "nvidia-smi"
run nvidia-smi nvidia-smi

step "gpu-labelled tests"
old_root="$(cat "$build/bundle_root.txt")"
if [ "$old_root" != "$root" ]; then
  # CTest's files hold the build machine's absolute paths: point them here.
  find "$build" \( -name CTestTestfile.cmake -o -name '*_include.cmake' -o -name '*_tests.cmake' \) \
    -type f -print0 | xargs -0 python3 -c '
import sys
old, new = sys.argv[1], sys.argv[2]
for path in sys.argv[3:]:
    with open(path) as f:
        text = f.read()
    if old in text:
        with open(path, "w") as f:
            f.write(text.replace(old, new))' "$old_root" "$root"
  echo "$root" >"$build/bundle_root.txt"
  echo "rewrote CTest paths $old_root -> $root"
fi
if ! wants tests; then
  echo "skipped (STEPS)"
elif command -v ctest >/dev/null; then
  # CTEST_ARGS: more ctest arguments (e.g. "--timeout 120 -j2" inside a short lease).
  # shellcheck disable=SC2086
  run "ctest -L gpu" ctest --test-dir "$build" -L gpu --output-on-failure ${CTEST_ARGS:-}
else
  echo "ctest is not installed: running the gpu test binaries of build-gpu/gpu_tests.txt"
  while read -r bin; do
    [ -n "$bin" ] || continue
    echo "--- $bin"
    (cd "$build/$(dirname "$bin")" && "$build/$bin") || failed+=("$bin")
  done <"$build/gpu_tests.txt"
fi

if wants training; then
step "training: quickstart_linear cuda:0"
run quickstart_linear "$build/apps/quickstart_linear" cuda:0
mnist_data="$build/data/fashion-mnist-subset"
if [ -x "$build/apps/train_mnist" ] && [ -d "$mnist_data" ]; then
  step "training: train_mnist, 1 epoch on GPU 0, Fashion-MNIST subset (4096 train / 1024 test)"
  run train_mnist "$build/apps/train_mnist" --gpus=0 --epochs=1 --batch_size=64 \
    --data_dir="$mnist_data" --log_every=16
  step "training: train_mnist --cuda_graph, the same run with the step captured and replayed"
  run train_mnist_cuda_graph "$build/apps/train_mnist" --gpus=0 --epochs=1 --batch_size=64 \
    --data_dir="$mnist_data" --log_every=16 --cuda_graph
else
  step "training: train_mnist skipped (binary or $mnist_data missing)"
fi

fi

if wants ops_bench; then
step "microbenchmark: nn_ops_bench (median of 5 repetitions)"
if [ -x "$build/bench/nn_ops_bench" ]; then
  # OPS_BENCH_ARGS replaces the default filter (e.g. OPS_BENCH_ARGS=" " for every row).
  # shellcheck disable=SC2086
  run nn_ops_bench "$build/bench/nn_ops_bench" --benchmark_repetitions=5 \
    --benchmark_report_aggregates_only=true ${OPS_BENCH_ARGS:---benchmark_filter=cuda}
else
  echo "gpu_test: $build/bench/nn_ops_bench was not built (Google Benchmark missing?)"
  failed+=("nn_ops_bench")
fi

fi

if wants bench; then
step "benchmark: tandem vs PyTorch on cuda:0 (bench/compare.py)"
if [ -x "$build/bench/tandem_bench" ]; then
  bench_out="${OUT:-$root/bench-out}/bench"
  read -r -a bench_args <<<"${BENCH_ARGS:---cuda_graph --warmup_steps=10 --steps=100 --repetitions=5}"
  run "bench compare" "$python" "$root/bench/compare.py" --devices=cuda:0 \
    --bench="$build/bench/tandem_bench" --python="$python" --out="$bench_out" \
    --work_dir="${TMPDIR:-/tmp}/tandem_bench_work" "${bench_args[@]}"
else
  echo "gpu_test: $build/bench/tandem_bench was not built"
  failed+=("bench compare")
fi

fi
if wants host_cost; then
step "host cost: CUDA calls per op (nn_host_cost_gpu_test), host us per op (bench/host_cost.py)"
host_cost_out="${OUT:-$root/bench-out}"
mkdir -p "$host_cost_out"
if [ -x "$build/tests/nn/nn_host_cost_gpu_test" ]; then
  (cd "$build/tests/nn" &&
   TANDEM_CUDA_CALL_BUDGETS_OUT="$host_cost_out/cuda_call_budgets.inc" \
     ./nn_host_cost_gpu_test) || { echo "gpu_test: nn_host_cost_gpu_test FAILED"; failed+=("nn_host_cost_gpu_test"); }
else
  echo "gpu_test: $build/tests/nn/nn_host_cost_gpu_test was not built"
  failed+=("nn_host_cost_gpu_test")
fi
if [ -x "$build/bench/host_cost_bench" ]; then
  read -r -a host_cost_args <<<"${HOST_COST_ARGS:---devices=cuda:0,cpu --repetitions=5 --rounds=3}"
  run "host_cost" "$python" "$root/bench/host_cost.py" --bench="$build/bench/host_cost_bench" \
    --python="$python" "${host_cost_args[@]}"
else
  echo "gpu_test: $build/bench/host_cost_bench was not built"
  failed+=("host_cost")
fi

fi
if wants memcheck; then
step "compute-sanitizer memcheck"
sanitizer="$(command -v compute-sanitizer || true)"
[ -z "$sanitizer" ] && [ -x /usr/local/cuda/bin/compute-sanitizer ] &&
  sanitizer=/usr/local/cuda/bin/compute-sanitizer
if [ -n "$sanitizer" ]; then
  memcheck_tests="${MEMCHECK_TESTS:-tests/nn/nn_ops_gpu_test tests/optim/optim_gpu_test}"
  [ "$memcheck_tests" = all ] &&
    memcheck_tests="$(grep -v 'spawn_nccl_two_process_gpu_test$' "$build/gpu_tests.txt")"
  for bin in $memcheck_tests; do
    echo "--- $bin"
    # In the test's own folder, as ctest runs it.
    pushd "$build/$(dirname "$bin")" >/dev/null || { failed+=("memcheck $bin"); continue; }
    run "memcheck $bin" timeout "${MEMCHECK_TIMEOUT:-120}" "$sanitizer" --tool memcheck \
      --report-api-errors no --error-exitcode 86 "$build/$bin" --gtest_brief=1
    popd >/dev/null || true
  done
else
  echo "gpu_test: compute-sanitizer is not installed"
  failed+=("memcheck")
fi

fi
echo
if [ ${#failed[@]} -eq 0 ]; then
  echo "gpu_test: all steps passed"
else
  echo "gpu_test: FAILED steps: ${failed[*]}"
  exit 1
fi
