#!/usr/bin/env bash
# Configures and builds tandem in build/ (CMakePresets.json's "default": Release,
# TANDEM_CUDA=AUTO unless the environment sets TANDEM_CUDA).
# Usage: scripts/build.sh [extra cmake args...]
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --preset default -DTANDEM_CUDA="${TANDEM_CUDA:-AUTO}" "$@"
cmake --build --preset default -j"$(nproc)"
