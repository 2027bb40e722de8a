#!/usr/bin/env bash
# quick_start_readme.sh SOURCE_DIR: passes when apps/examples/quick_start.cc,
# less its two comment lines, is the README's C++ code block, so that the quick
# start a user copies is the one the build compiles and quick_start_runs runs.
set -uo pipefail
readme_code="$(awk '/^```cpp$/ {f = 1; next} /^```$/ {f = 0} f' "$1/README.md")"
file_code="$(tail -n +3 "$1/apps/examples/quick_start.cc")"
if [ "$readme_code" != "$file_code" ]; then
  echo "FAIL: README.md's C++ block and apps/examples/quick_start.cc differ:"
  diff <(printf '%s\n' "$readme_code") <(printf '%s\n' "$file_code")
  exit 1
fi
echo "README.md's quick start is apps/examples/quick_start.cc"
