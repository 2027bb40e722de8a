#!/usr/bin/env bash
# guide_fit_restart.sh SOURCE_DIR: passes when apps/examples/fit_restart.cc,
# less its two comment lines, is the C++ block of docs/guide.md that follows
# the line naming that file, so that the guide's example is the one the build
# compiles and fit_restart_runs runs.
set -uo pipefail
guide_code="$(awk '/apps\/examples\/fit_restart\.cc/ {m = 1} m && /^```cpp$/ {f = 1; next} f && /^```$/ {exit} f' "$1/docs/guide.md")"
file_code="$(tail -n +3 "$1/apps/examples/fit_restart.cc")"
if [ -z "$guide_code" ]; then
  echo "FAIL: docs/guide.md has no C++ block after a line naming apps/examples/fit_restart.cc"
  exit 1
fi
if [ "$guide_code" != "$file_code" ]; then
  echo "FAIL: docs/guide.md's hapi restart example and apps/examples/fit_restart.cc differ:"
  diff <(printf '%s\n' "$guide_code") <(printf '%s\n' "$file_code")
  exit 1
fi
echo "docs/guide.md's hapi restart example is apps/examples/fit_restart.cc"
