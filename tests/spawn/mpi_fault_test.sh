#!/usr/bin/env bash
# One case of a 2-process job (ctest label mpi):
#   mpi_fault_test.sh BINARY MODE MAX_SECONDS PATTERN
# Runs `mpirun.sh -np 2 BINARY MODE` (MODE singleton: BINARY alone under
# PMI_SIZE=2) and looks at its exit status, time and output. An error line is
# one that says ERROR or error, or that something failed or exited on a signal
# (mpirun's report of a killed process). A fault case passes when the job exits
# non-zero within MAX_SECONDS and its first error line matches PATTERN (grep -E):
# the root cause comes first, and a job that failed for another reason (or never
# ran: a broken launcher) does not pass. MODEs ok, even_late and rounds_one are
# positive controls: they pass when the job exits 0 within MAX_SECONDS, print no error
# line, and a line of their output matches PATTERN. The mismatch_* modes must
# moreover show the error from every process (its spawn line, one per pid).
# Open MPI's libnbc prints two lines of its own when a collective's message is
# truncated ("MPI Error in NBC subrequest ...", "NBC_Progress: an error ...
# found during schedule ..."), unconditionally and before any error handler
# runs; they name no collective and are not taken for the first error line.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [ "$#" -ne 4 ]; then
  echo "usage: $0 BINARY MODE MAX_SECONDS PATTERN" >&2
  exit 2
fi
binary="$1" mode="$2" max_s="$3" pattern="$4"
error_line='ERROR|[Ee]rror|[Ff]ail|exited on signal'
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
if [ "$rc" -eq 124 ]; then echo "FAIL: the job hung (killed by timeout after 120 s)"; fail=1; fi
if [ "$elapsed_ms" -gt $((max_s * 1000)) ]; then
  echo "FAIL: took ${elapsed} s, more than $max_s s"; fail=1
fi
libnbc_line='^MPI Error in NBC subrequest|^NBC_Progress: an error'
first="$(grep -vE "$libnbc_line" "$out" | grep -m1 -E "$error_line" || true)"
if [ "$mode" = ok ] || [ "$mode" = even_late ] || [ "$mode" = rounds_one ]; then
  if [ "$rc" -ne 0 ]; then echo "FAIL: the job exited $rc"; fail=1; fi
  if [ -n "$first" ]; then echo "FAIL: an error line: $first"; fail=1; fi
  if ! grep -qE -- "$pattern" "$out"; then echo "FAIL: no line matches /$pattern/"; fail=1; fi
else
  if [ "$rc" -eq 0 ]; then echo "FAIL: the job exited 0"; fail=1; fi
  if ! grep -qE -- "$pattern" <<<"$first"; then
    echo "FAIL: the first error line does not match /$pattern/: $first"; fail=1
  else
    echo "first error line: $first"
  fi
  if [[ "$mode" == mismatch_* ]]; then
    pids="$(grep -E -- "$pattern" "$out" | grep -oE 'pid [0-9]+\] ERROR' | sort -u | wc -l)"
    if [ "$pids" -lt 2 ]; then
      echo "FAIL: $pids process(es) wrote the error, not both"; fail=1
    fi
  fi
fi
[ "$fail" -eq 0 ] && echo "PASS: mode $mode exited $rc in ${elapsed} s"
exit "$fail"
