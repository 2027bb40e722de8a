#!/usr/bin/env bash
# The README's second command: install what is missing, build, run every test.
#  1. A ThreadSanitizer build (CPU-only) runs the threaded tests (ctest label tsan_ok).
#  2. The main build (Release, TANDEM_CUDA=AUTO: CUDA is compiled when the toolkit is
#     there; GPU tests skip with a reason when no GPU is visible) runs the whole suite.
# Output ends with ctest's summary of the main build.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
jobs="$(nproc)"

cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTANDEM_CUDA=OFF -DTANDEM_TSAN=ON \
  -DTANDEM_BUILD_APPS=OFF >/dev/null
# Only the threaded tests are built under TSan (label tsan_ok): spawn and data.
cmake --build build-tsan -j"$jobs" --target spawn_devices_test spawn_communicator_test \
  spawn_logger_test spawn_test spawn_data_parallel_test spawn_checkpoint_test spawn_process_world_test data_sampler_test \
  data_loader_test
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
  ctest --test-dir build-tsan -L tsan_ok --output-on-failure -j"$jobs"

scripts/build.sh
ctest --test-dir build --output-on-failure -j"$jobs"
