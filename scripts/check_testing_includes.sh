#!/usr/bin/env bash
# tandem::testing is built the way an outside harness would be: its files
# include only headers that the package installs. Fails naming each include of
# another library's internal/ folder (testing/internal/ is its own;
# nn/internal/stream_uses.h is installed). Run by scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bad="$(git ls-files -- 'testing/*.h' 'testing/*.cc' |
  xargs grep -nE '^#include "[^"]*/internal/' |
  grep -vE '#include "(testing/internal/|nn/internal/stream_uses\.h")' || true)"
if [[ -n "$bad" ]]; then
  echo "$bad" >&2
  echo "testing/ includes headers that are not installed (above): move what it needs behind an installed header" >&2
  exit 1
fi
