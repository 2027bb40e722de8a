#!/usr/bin/env bash
# The README's second command: install what is missing, build, run every test.
#  0. Include guards match their headers' paths (scripts/check_include_guards.sh) and
#     testing/ includes only installed headers (scripts/check_testing_includes.sh); ~1 s.
#  1. A ThreadSanitizer build (CPU-only) runs the threaded tests (ctest label tsan_ok).
#  2. A clang build of the libraries (compile check).
#  3. The main build (preset "default": Release, TANDEM_CUDA=AUTO: CUDA is compiled
#     when the toolkit is there; GPU tests skip with a reason when no GPU is visible)
#     runs the whole suite.
# Output ends with ctest's summary of the main build.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/check_include_guards.sh
scripts/check_testing_includes.sh
scripts/setup.sh
jobs="$(nproc)"

# CMakePresets.json's "tsan" preset (build-tsan): only the threaded tests are built
# under TSan, every test labelled tsan_ok, gathered by tests/CMakeLists.txt into the
# target tsan_ok_tests; its test preset runs that label with TSAN_OPTIONS set. Where MPI
# is found, spawn_mpi_test_2x and spawn_sync_bn_join_mpi_test_2x are among them, with
# tests/spawn/tsan_mpi.supp (OpenMPI's own reports) added to their TSAN_OPTIONS.
cmake --preset tsan >/dev/null
cmake --build --preset tsan -j"$jobs"
ctest --preset tsan -j"$jobs"

# CMakePresets.json's "clang" preset (build-clang): every library compiled by clang
# (Debian's clang 14) at -O0, a compile check only, so that the code stays
# portable beyond g++ (clang rejects what g++ lets pass, e.g. a lambda capturing
# a structured binding before clang 16).
cmake --preset clang >/dev/null
cmake --build --preset clang -j"$jobs"

scripts/build.sh
ctest --preset default -j"$jobs"
