#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan, libraries instrumented
# for coverage) and runs each for a bounded time.
#   tests/fuzz/run_fuzzers.sh [seconds per target, default 60] [build dir]
set -euo pipefail
seconds=${1:-60}
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${2:-$root/build-fuzz}
flags="-fsanitize=fuzzer-no-link,address,undefined -fno-omit-frame-pointer -g -O1"

CC=clang CXX=clang++ cmake -S "$root" -B "$build" -DTANDEM_FUZZ=ON -DTANDEM_CUDA=OFF \
  -DTANDEM_BUILD_APPS=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
cmake --build "$build" -j"$(nproc)" --target mnist_fuzz cifar_fuzz checkpoint_fuzz \
  safetensors_fuzz

# Seeds: a small valid IDX pair (raw and gzip), a CIFAR record, a checkpoint,
# safetensors files (several dtypes and shapes, with metadata; an empty one; escapes).
corpus="$build/fuzz-corpus"
mkdir -p "$corpus/mnist" "$corpus/cifar" "$corpus/checkpoint" "$corpus/safetensors"
python3 - "$corpus" <<'PY'
import gzip, struct, sys
c = sys.argv[1]
img = b"\0\0\x08\x03" + struct.pack(">III", 2, 3, 3) + bytes(range(18))
lbl = b"\0\0\x08\x01" + struct.pack(">I", 2) + b"\x01\x09"
open(f"{c}/mnist/idx_raw", "wb").write(b"\0\0\0" + img)
open(f"{c}/mnist/idx_gz", "wb").write(b"\0\0\0" + gzip.compress(img))
open(f"{c}/mnist/pair", "wb").write(b"\x01" + struct.pack(">H", len(img)) + img + lbl)
open(f"{c}/mnist/gunzip", "wb").write(b"\x02\x01\x00" + gzip.compress(b"hello" * 20))
open(f"{c}/cifar/record", "wb").write(b"\x03" + bytes(3072))
def safetensors(header, data):
    text = header.encode()
    return struct.pack("<Q", len(text)) + text + data
open(f"{c}/safetensors/tensors", "wb").write(safetensors(
    '{"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},'
    '"n":{"dtype":"I64","shape":[],"data_offsets":[16,24]},'
    '"h":{"dtype":"F16","shape":[3],"data_offsets":[24,30]},'
    '"b":{"dtype":"BF16","shape":[1],"data_offsets":[30,32]},'
    '"e":{"dtype":"F64","shape":[0,4],"data_offsets":[32,32]}}', bytes(range(32))))
open(f"{c}/safetensors/empty", "wb").write(safetensors("{}", b""))
# Escapes in names and strings (a newline, a bell, non-ASCII): messages must stay one line.
open(f"{c}/safetensors/escapes", "wb").write(safetensors(
    '{"__metadata__":{"k\\n":"v\\u0007"},"t\\n\\u00e9":{"dtype":"F\\r32","shape":[1],'
    '"data_offsets":[0,4],"x\\ny":1}}', bytes(4)))
PY
status=0
for target in mnist cifar checkpoint safetensors; do
  echo "== ${target}_fuzz for ${seconds}s"
  mkdir -p "$build/fuzz-artifacts/$target"
  if ! "$build/tests/fuzz/${target}_fuzz" "$corpus/$target" -max_total_time="$seconds" \
      -rss_limit_mb=2048 -max_len=200000 -print_final_stats=1 \
      -artifact_prefix="$build/fuzz-artifacts/$target/" 2>&1 | tail -n 25; then
    status=1
  fi
done
exit $status
