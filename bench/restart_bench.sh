#!/usr/bin/env bash
# Today's recovery path, timed: the process ends with a rank's failure, a new
# process starts and resumes from the checkpoint file (restart_bench --mode=disk).
# Prints fault to first step after the resume, in ms, for each repetition.
#
#   bench/restart_bench.sh <restart_bench binary> <ranks> [repetitions]
set -euo pipefail
bin=$1
ranks=$2
reps=${3:-5}
ckpt=$(mktemp -d)/restart_bench.ckpt
for _ in $(seq "$reps"); do
  rm -f "$ckpt"
  fault=$("$bin" --mode=disk --ranks="$ranks" --checkpoint="$ckpt" 2>/dev/null |
    sed -n 's/^fault_unix_ns=//p' || true)
  first=$("$bin" --mode=disk --ranks="$ranks" --checkpoint="$ckpt" --resume 2>/dev/null |
    sed -n 's/^first_step_unix_ns=//p')
  awk -v a="$fault" -v b="$first" -v r="$ranks" 'BEGIN { printf "%d ranks: %.1f ms\n", r, (b - a) / 1e6 }'
done
rm -rf "$(dirname "$ckpt")"
