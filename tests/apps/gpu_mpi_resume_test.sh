#!/usr/bin/env bash
# Multi-process GPU resume: mpirun -np 2, one GPU rank per process (process p
# sees only GPU p), train_mnist saves a checkpoint and stops, then --resume
# reads it back: rank 0 reads the file and broadcasts its bytes through NCCL to
# every rank. That broadcast once staged the bytes in device memory and read
# them on the host: every resume crashed. Skips (77) with fewer than 2 GPUs.
#   gpu_mpi_resume_test.sh TRAIN_MNIST MPIRUN_SH
set -uo pipefail
train_mnist="$1"
mpirun_sh="$2"
gpus=0
if command -v nvidia-smi >/dev/null; then gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')"; fi
if [ "$gpus" -lt 2 ]; then
  echo "SKIP: needs 2 GPUs, $gpus visible"
  exit 77
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# Each process sees one GPU: its own, as --gpus=0.
cat >"$work/one_gpu.sh" <<'WRAP'
#!/usr/bin/env bash
export CUDA_VISIBLE_DEVICES="${OMPI_COMM_WORLD_RANK:-0}"
exec "$@"
WRAP
chmod +x "$work/one_gpu.sh"
common=(--gpus=0 --epochs=1 --train_limit=4096 --test_limit=512 --batch_size=64
        --log_every=1000 --checkpoint_dir="$work/ckpt" --checkpoint_every_steps=10 --timeout_s=60)
"$mpirun_sh" -np 2 "$work/one_gpu.sh" "$train_mnist" "${common[@]}" --stop_at_step=20 \
  >"$work/first.log" 2>&1
first=$?
if [ "$first" -ne 130 ] || ! ls "$work/ckpt"/*.ckpt >/dev/null 2>&1; then
  echo "FAIL: the first run exited $first or wrote no checkpoint:"; cat "$work/first.log"; exit 1
fi
"$mpirun_sh" -np 2 "$work/one_gpu.sh" "$train_mnist" "${common[@]}" --resume \
  >"$work/second.log" 2>&1
second=$?
if [ "$second" -ne 0 ] || grep -q 'ERROR' "$work/second.log"; then
  echo "FAIL: the resumed run exited $second:"; cat "$work/second.log"; exit 1
fi
if ! grep -q 'resum' "$work/second.log"; then
  echo "FAIL: the second run does not say it resumed:"; cat "$work/second.log"; exit 1
fi
echo "PASS: 2 processes x 1 GPU saved at step 20 and resumed"
