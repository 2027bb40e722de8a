#!/usr/bin/env bash
# Today's recovery path, timed: the process ends with a rank's failure, a new
# process starts and resumes from the checkpoint file (restart_bench --mode=disk).
# Prints, for each repetition, in ms: fault to the first step completed after
# the resume, and fault to resumed (the new process's objects built and the
# checkpoint loaded, before that step); with --model=lenet also the parts of
# the latter: fault to the new process's main(), main() to the data set loaded,
# data set to resumed (spawn, the model, the loader, the checkpoint).
#
#   bench/restart_bench.sh <restart_bench binary> <ranks> [repetitions] [restart_bench flags...]
#   bench/restart_bench.sh build/bench/restart_bench 2 5 --model=lenet
set -euo pipefail
bin=$1
ranks=$2
reps=${3:-5}
shift $(($# < 3 ? $# : 3))
ckpt=$(mktemp -d)/restart_bench.ckpt
for _ in $(seq "$reps"); do
  rm -f "$ckpt"
  fault=$("$bin" --mode=disk --ranks="$ranks" --checkpoint="$ckpt" "$@" 2>/dev/null |
    sed -n 's/^fault_unix_ns=//p' || true)
  out=$("$bin" --mode=disk --ranks="$ranks" --checkpoint="$ckpt" --resume "$@" 2>/dev/null)
  first=$(printf '%s\n' "$out" | sed -n 's/^first_step_unix_ns=//p')
  start=$(printf '%s\n' "$out" | sed -n 's/^start_unix_ns=//p')
  data=$(printf '%s\n' "$out" | sed -n 's/^data_unix_ns=//p')
  restored=$(printf '%s\n' "$out" | sed -n 's/^restored_unix_ns=//p')
  awk -v a="$fault" -v b="$first" -v r="$ranks" -v s="$start" -v d="$data" -v e="$restored" 'BEGIN {
    printf "%d ranks: first step %.1f ms, resumed %.1f ms", r, (b - a) / 1e6, (e - a) / 1e6
    if (s != "") printf " (to main %.1f, data set %.1f, to resumed %.1f)", (s - a) / 1e6, (d - s) / 1e6, (e - d) / 1e6
    printf "\n" }'
done
rm -rf "$(dirname "$ckpt")"
