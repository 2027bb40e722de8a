#!/usr/bin/env bash
# The README's second command: install what is missing, build, run every test.
#  1. A ThreadSanitizer build (CPU-only) runs the threaded tests (ctest label tsan_ok).
#  2. The main build (preset "default": Release, TANDEM_CUDA=AUTO: CUDA is compiled
#     when the toolkit is there; GPU tests skip with a reason when no GPU is visible)
#     runs the whole suite.
# Output ends with ctest's summary of the main build.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
jobs="$(nproc)"

# CMakePresets.json's "tsan" preset (build-tsan): only the threaded tests are built
# under TSan, every test labelled tsan_ok, gathered by tests/CMakeLists.txt into the
# target tsan_ok_tests; its test preset runs that label with TSAN_OPTIONS set.
cmake --preset tsan >/dev/null
cmake --build --preset tsan -j"$jobs"
ctest --preset tsan -j"$jobs"

scripts/build.sh
ctest --preset default -j"$jobs"
