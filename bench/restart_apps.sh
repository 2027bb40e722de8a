#!/usr/bin/env bash
# The programs' recovery from a rank's failure, timed from their own log lines:
# train_mnist with --max_restarts (the rank's function starts again in the
# process from the in-memory snapshot of every step) against today's other
# path (the process ends with exit status 1; a new one runs with --resume from
# the checkpoint file written every step). The fault: rank 0 throws after step
# S (the test-only --test_fail_at). Prints, per repetition, in ms: fault to the
# first step completed after the recovery (in the process: step S run again
# from the snapshot of step S-1; new process: step S+1 after the checkpoint of
# step S), each from the timestamps of the progress lines.
#
#   bench/restart_apps.sh <train_mnist binary> [repetitions] [step] [train_mnist flags...]
#   bench/restart_apps.sh build/apps/train_mnist 5 50
set -euo pipefail
bin=$1
reps=${2:-5}
step=${3:-50}
shift $(($# < 3 ? $# : 3))
steps=$((step + 10))
common=(--epochs=1 --log_every=1 --max_steps_per_epoch="$steps" "$@")
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# Seconds of the day from a log line's "[YYYY-MM-DD HH:MM:SS.mmm ...".
seconds() { sed -E 's/^\[[0-9-]+ ([0-9:.]+) .*/\1/' | awk -F: '{printf "%.3f\n", $1*3600+$2*60+$3}'; }
line() { grep "step $1/$steps " | sed -n "${2}p"; }
for i in $(seq "$reps"); do
  inproc=$("$bin" "${common[@]}" --max_restarts=1 --snapshot_every=1 \
    --test_fail_at=0:"$step" 2>&1)
  t0=$(line "$step" 1 <<<"$inproc" | seconds)
  t1=$(line "$step" 2 <<<"$inproc" | seconds)
  rm -rf "$dir/ck"
  first=$("$bin" "${common[@]}" --checkpoint_dir="$dir/ck" --checkpoint_every_steps=1 \
    --test_fail_at=0:"$step" 2>&1 || true)
  second=$("$bin" "${common[@]}" --checkpoint_dir="$dir/ck" --checkpoint_every_steps=1 \
    --resume 2>&1)
  p0=$(line "$step" 1 <<<"$first" | seconds)
  p1=$(line "$((step + 1))" 1 <<<"$second" | seconds)
  awk -v i="$i" -v a="$t0" -v b="$t1" -v c="$p0" -v d="$p1" 'BEGIN {
    printf "repetition %d: in the process %.0f ms; new process with --resume %.0f ms\n",
           i, (b - a) * 1000, (d - c) * 1000 }'
done
