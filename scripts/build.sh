#!/usr/bin/env bash
# Configures and builds tandem in build/ (Release, TANDEM_CUDA=AUTO unless set).
# Usage: scripts/build.sh [extra cmake args...]
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DTANDEM_CUDA="${TANDEM_CUDA:-AUTO}" "$@"
cmake --build build -j"$(nproc)"
