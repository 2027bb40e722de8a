#!/usr/bin/env bash
# quickstart_linear's smoke run: quickstart_smoke.sh BINARY passes when BINARY
# exits 0 and prints step:0 .. step:19 in order, each with a finite, positive
# loss. Whether the loss falls is not checked here: the program trains on
# random targets in batches of 10 (as the Paddle seed does), where one step's
# loss varies by about 0.5 and all there is to learn (predicting 0) lowers it by
# a tenth or two; apps_test's TrainLinear tests check the fall on large batches.
set -uo pipefail
out="$("$1")"
rc=$?
printf '%s\n' "$out"
if [ "$rc" -ne 0 ]; then echo "FAIL: exit status $rc"; exit 1; fi
printf '%s\n' "$out" | awk '
  /^step:/ {
    split($1, s, ":"); split($2, l, ":")
    if (s[2] != n) { print "FAIL: step " s[2] " printed where step " n " was due"; bad = 1 }
    if (l[2] !~ /^[0-9]*\.?[0-9]+(e[-+]?[0-9]+)?$/ || l[2] + 0 <= 0) {
      print "FAIL: step " s[2] ": loss " l[2] " is not a finite positive number"; bad = 1
    }
    n++
  }
  END {
    if (n != 20) { print "FAIL: " n " steps printed, 20 due"; bad = 1 }
    exit bad
  }'
