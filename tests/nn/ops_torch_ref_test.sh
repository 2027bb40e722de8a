#!/usr/bin/env bash
# Checks that tests/nn/ops_torch.py, run by a Python that imports torch
# (scripts/torch_python.sh: $PYTHON, else python3, else /usr/bin/python3), still
# writes the checked-in ops_torch_ref.inc (Debian's PyTorch 1.13 wrote it). Without
# such a Python the test FAILS with the reason, as the apps' interop tests do.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=../../scripts/torch_python.sh
source "$here/../../scripts/torch_python.sh" torch
if [ -z "$python" ]; then
  echo "FAIL: no Python that imports torch (tried \$PYTHON, python3, /usr/bin/python3);" \
       "scripts/setup.sh installs python3-torch" >&2
  exit 1
fi
"$python" "$here/ops_torch.py" | diff "$here/ops_torch_ref.inc" -
