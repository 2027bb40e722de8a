#!/usr/bin/env bash
# The README's first command: install what is missing, build, run the main
# training program. Arguments are passed to the program.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
if [ -x build/apps/train_mnist ]; then
  exec build/apps/train_mnist "$@"
fi
exec build/apps/quickstart_linear "$@"
