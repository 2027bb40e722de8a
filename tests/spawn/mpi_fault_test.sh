#!/usr/bin/env bash
# One fault case of a 2-process job (ctest label mpi):
#   mpi_fault_test.sh BINARY MODE MAX_SECONDS [PATTERN]
# Runs `mpirun.sh -np 2 BINARY MODE` (MODE singleton: BINARY alone under
# PMI_SIZE=2), and passes when the job exits non-zero within MAX_SECONDS and, with
# PATTERN, the first line of its output that says "ERROR" or "error" matches
# PATTERN (grep -E): the root cause comes first.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
binary="$1" mode="$2" max_s="$3" pattern="${4:-}"
out="$(mktemp)"
trap 'rm -f "$out"' EXIT
start_ms=$(( $(date +%s%N) / 1000000 ))
if [ "$mode" = singleton ]; then
  PMI_SIZE=2 PMI_RANK=0 timeout 120 "$binary" "$mode" >"$out" 2>&1
else
  timeout 120 "$here/mpirun.sh" -np 2 "$binary" "$mode" >"$out" 2>&1
fi
rc=$?
elapsed_ms=$(( $(date +%s%N) / 1000000 - start_ms ))
elapsed="$((elapsed_ms / 1000)).$(printf %03d $((elapsed_ms % 1000)))"
echo "--- output of mode $mode (exit $rc, ${elapsed} s):"
cat "$out"
echo "---"
fail=0
if [ "$rc" -eq 0 ]; then echo "FAIL: the job exited 0"; fail=1; fi
if [ "$rc" -eq 124 ]; then echo "FAIL: the job hung (killed by timeout after 120 s)"; fail=1; fi
if [ "$elapsed_ms" -gt $((max_s * 1000)) ]; then
  echo "FAIL: took ${elapsed} s, more than $max_s s"; fail=1
fi
if [ -n "$pattern" ]; then
  first="$(grep -m1 -E 'ERROR|[Ee]rror' "$out" || true)"
  if ! grep -qE -- "$pattern" <<<"$first"; then
    echo "FAIL: the first error line does not match /$pattern/: $first"; fail=1
  else
    echo "first error line: $first"
  fi
fi
[ "$fail" -eq 0 ] && echo "PASS: mode $mode exited $rc in ${elapsed} s"
exit "$fail"
