#!/usr/bin/env bash
# Planned stops of the training programs in a job of 2 processes (ctest label mpi):
# every process must end with the exit status and the one line a single process
# gives, no output line may say ERROR, and the job must not end through MPI_Abort.
# mpirun runs with orte_abort_on_non_zero_status off: by default it kills the
# other processes as soon as one has exited non-zero (130 here), which could
# catch a process after its MPI_Finalize but before its status is recorded.
# (mpirun then exits 0: the statuses come from record_exit.sh; the stop_at_step
# case also checks mpirun's own default behaviour once.)
#   mpi_stop_test.sh CASE TRAIN_LINEAR TRAIN_MNIST
# CASE:
#   stop_at_step   train_linear --stop_at_step=37, then train_mnist
#                  --stop_at_step=70 with periodic checkpoints (skipped without
#                  Fashion-MNIST): every process exits 130 with the same line.
#   sigint_all     SIGINT to both processes (as a launcher that passes it on
#                  sends it) while train_linear trains: both stop at one agreed
#                  step, exit 130.
#   sigint_one     SIGINT to process 1 only: process 0 stops too, at the same step.
#   timeout_differs  --timeout_s 10 and 20: every process exits 1 naming the flag.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
mpirun="$here/../spawn/mpirun.sh"
wrap="$here/record_exit.sh"
case_name="$1" train_linear="$2" train_mnist="$3"
fashion=/usr/share/datasets/fashion-mnist
work="$(mktemp -d)"
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
fail=0

fail() { echo "FAIL: $*"; fail=1; }

# start_job NAME MPIRUN_ARGS...: starts mpirun in the background; its output goes
# to $work/NAME.out, every process's pid and status to $work/NAME/.
start_job() {
  local name="$1"
  shift
  mkdir -p "$work/$name"
  timeout 240 "$mpirun" "$@" >"$work/$name.out" 2>&1 &
  job_pid=$!
}

# finish_job NAME: waits for the job, prints its output and checks what every
# planned stop must satisfy.
finish_job() {
  local name="$1"
  wait "$job_pid"
  job_rc=$?
  echo "--- $name: mpirun exited $job_rc; output:"
  cat "$work/$name.out"
  echo "---"
  [ "$job_rc" -eq 124 ] && fail "$name: the job hung (killed after 240 s)"
}

# expect_statuses NAME STATUS: every process (0 and 1) exited STATUS.
expect_statuses() {
  local name="$1" want="$2" p got
  for p in 0 1; do
    got="$(cat "$work/$name/status.$p" 2>/dev/null || echo none)"
    echo "$name: process $p exited $got"
    [ "$got" = "$want" ] || fail "$name: process $p exited $got, not $want"
  done
}

# expect_clean NAME: no line says ERROR, and MPI_Abort was not called.
expect_clean() {
  local name="$1"
  if grep -n 'ERROR' "$work/$name.out"; then fail "$name: a line says ERROR (above)"; fi
  if grep -n -i 'MPI_ABORT' "$work/$name.out"; then fail "$name: the job ended through MPI_Abort"; fi
}

# count NAME ERE: how many times ERE matches in the output (mpirun forwards each
# process's stderr in the chunks its writes make; each line is one write).
count() { grep -c -E -- "$2" "$work/$1.out"; }

# await NAME PATTERN SECONDS: until PATTERN (fixed string) is in the output.
await() {
  local name="$1" pattern="$2" deadline=$((SECONDS + $3))
  while ! grep -qF -- "$pattern" "$work/$name.out" 2>/dev/null; do
    if [ "$SECONDS" -ge "$deadline" ] || ! kill -0 "$job_pid" 2>/dev/null; then
      fail "$name: no \"$pattern\" within $3 s"
      return 1
    fi
    sleep 0.1
  done
}

linear=(--gpus=cpu --nprocs=1)
keep=(--mca orte_abort_on_non_zero_status 0)

case "$case_name" in
  stop_at_step)
    line37='^train_linear: stopped after step 37 as --stop_at_step asks \(no --checkpoint_dir: nothing saved\)$'
    start_job linear "${keep[@]}" -np 2 "$wrap" "$work/linear" "$train_linear" "${linear[@]}" \
      --steps=100000 --stop_at_step=37
    finish_job linear
    expect_statuses linear 130
    expect_clean linear
    n="$(count linear "$line37")"
    [ "$n" -eq 2 ] || fail "linear: $n lines say \"stopped after step 37\", not one per process"
    # mpirun's defaults: it reports the processes' 130 as its own status (with its
    # notice that a process exited non-zero), still without MPI_Abort.
    start_job default -np 2 "$train_linear" "${linear[@]}" --steps=100000 --stop_at_step=37
    finish_job default
    [ "$job_rc" -eq 130 ] || fail "default: mpirun exited $job_rc, not 130"
    expect_clean default
    [ "$(count default "$line37")" -ge 1 ] || fail "default: no line says \"stopped after step 37\""
    if [ -e "$fashion/train-images-idx3-ubyte.gz" ] || [ -e "$fashion/train-images-idx3-ubyte" ]; then
      start_job mnist "${keep[@]}" -np 2 "$wrap" "$work/mnist" "$train_mnist" "${linear[@]}" --epochs=2 \
        --train_limit=10000 --test_limit=200 --log_every=1000 --stop_at_step=70 \
        --checkpoint_every_steps=20 --checkpoint_dir="$work/ck"
      finish_job mnist
      expect_statuses mnist 130
      expect_clean mnist
      n="$(count mnist "^train_mnist: stopped after step 70 as --stop_at_step asks; run again with --resume --checkpoint_dir=$work/ck to continue from its newest checkpoint\$")"
      [ "$n" -eq 2 ] || fail "mnist: $n lines say \"stopped after step 70\", not one per process"
      [ -e "$work/ck/step-60.ckpt" ] || fail "mnist: no checkpoint of step 60"
      [ -e "$work/ck/step-70.ckpt" ] && fail "mnist: a checkpoint of step 70 (the stop saves none)"
    else
      echo "no Fashion-MNIST at $fashion: train_mnist's case skipped"
    fi
    ;;
  sigint_all | sigint_one)
    start_job sigint "${keep[@]}" -np 2 "$wrap" "$work/sigint" "$train_linear" "${linear[@]}" --steps=100000000
    if await sigint "step:200 " 120; then
      if [ "$case_name" = sigint_all ]; then
        kill -INT "$(cat "$work/sigint/pid.0")" "$(cat "$work/sigint/pid.1")"
      else
        kill -INT "$(cat "$work/sigint/pid.1")"
      fi
    fi
    finish_job sigint
    expect_statuses sigint 130
    expect_clean sigint
    # One line per process, at the same step.
    steps="$(grep -o -E '^train_linear: stopped: stopped by SIGINT( on another process)? at step [0-9]+' \
      "$work/sigint.out" | grep -o -E '[0-9]+$' | sort -u)"
    n="$(count sigint '^train_linear: stopped: stopped by SIGINT( on another process)? at step [0-9]+: every rank stopped at the same step boundary \(no --checkpoint_dir: nothing saved\)$')"
    [ "$n" -eq 2 ] || fail "sigint: $n lines say \"stopped by SIGINT\", not one per process"
    [ "$(echo "$steps" | wc -w)" -eq 1 ] || fail "sigint: the processes stopped at steps $steps"
    if [ "$case_name" = sigint_one ] && [ "$(count sigint '^train_linear: stopped: stopped by SIGINT on another process at step')" -ne 1 ]; then
      fail "sigint: process 0 does not say that the SIGINT came to another process"
    fi
    ;;
  timeout_differs)
    start_job timeout "${keep[@]}" -np 1 "$wrap" "$work/timeout" "$train_linear" "${linear[@]}" --timeout_s=10 \
      : -np 1 "$wrap" "$work/timeout" "$train_linear" "${linear[@]}" --timeout_s=20
    finish_job timeout
    expect_statuses timeout 1
    n="$(count timeout '^train_linear: error: the processes of this job disagree: .*--timeout_s: 10 on host [^ ]+ \(process 0\), 20 on host [^ ]+ \(process 1\)')"
    [ "$n" -eq 2 ] || fail "timeout: $n lines name --timeout_s's values, not one per process"
    ;;
  *)
    echo "unknown case $case_name"
    exit 2
    ;;
esac
[ "$fail" -eq 0 ] && echo "PASS: $case_name"
exit "$fail"
