#!/usr/bin/env bash
# One process of an mpirun job, for tests that check every process's exit status
# (mpirun itself reports one):
#   record_exit.sh DIR PROGRAM [ARGS...]
# runs PROGRAM and writes its pid to DIR/pid.<R> (so that a test can signal the
# program itself, not this shell) and its exit status to DIR/status.<R>, R being
# the launcher's process index; exits with that status.
set -u
dir="$1"
shift
rank="${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-${PMI_RANK:-0}}}"
# In the background so that the pid is known. A shell without job control starts
# background commands with SIGINT ignored; spawn installs its own handler while
# it runs, which is what a test's SIGINT is meant to reach.
"$@" &
child=$!
echo "$child" >"$dir/pid.$rank"
# wait returns early when a signal reaches this shell; only the child's end counts.
while :; do
  wait "$child"
  rc=$?
  kill -0 "$child" 2>/dev/null || break
done
echo "$rc" >"$dir/status.$rank"
exit "$rc"
