#!/usr/bin/env bash
# Runs tests/apps/interop_test.py with a Python that imports torch and
# torchvision (scripts/torch_python.sh: $PYTHON, else python3, else
# /usr/bin/python3). Without one the test FAILS with the reason: the interop
# proofs are part of the suite (scripts/setup.sh installs python3-torch).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=../../scripts/torch_python.sh
source "$here/../../scripts/torch_python.sh" torchvision
if [ -z "$python" ]; then
  echo "FAIL: no Python that imports torch and torchvision (tried \$PYTHON, python3," \
       "/usr/bin/python3); scripts/setup.sh installs python3-torch and python3-torchvision" >&2
  exit 1
fi
exec "$python" "$here/interop_test.py" "$@"
