#!/usr/bin/env bash
# Builds build-gpu (TANDEM_CUDA=ON, Release, tests and apps) on THIS machine and
# makes it self-contained for a bare GPU machine (Ubuntu-like, PyTorch + CUDA 13,
# no Abseil / GoogleTest / OpenBLAS installed), where scripts/gpu_test.sh runs it.
#
#   scripts/gpu_bundle.sh            # then carry build-carry to the GPU machine
#
# What it does after building:
#  - copies into build-gpu/lib every shared library that a test, app or benchmark
#    binary needs (ldd) and that such a machine lacks: Abseil, OpenBLAS and its
#    libgfortran / libquadmath, GoogleTest or Benchmark if linked shared, anything
#    else not on the list below. NOT copied: the C/C++ runtime and zlib (present
#    there), and the NVIDIA libraries (libcuda from the driver; cudart, cuBLAS(Lt),
#    cuDNN and NCCL from PyTorch's site-packages nvidia/* folders there);
#  - records the build's absolute root (build-gpu/bundle_root.txt) so that
#    gpu_test.sh can rewrite CTest's absolute paths to wherever the copy lands,
#    and the gpu-labelled test binaries (build-gpu/gpu_tests.txt) for machines
#    without ctest;
#  - keeps only what the GPU machine runs (gpu-labelled test binaries, the apps,
#    and the benchmarks built in build-gpu/bench/: tandem_bench, run there by
#    gpu_test.sh through bench/compare.py from the repository copy,
#    nn_ops_bench and host_cost_bench; the CPU-only test binaries are deleted), deletes object files
#    and static libraries, strips the binaries and gzips the libraries over 4 MiB
#    (OpenBLAS), to keep build-gpu small enough to carry (under ~60 MiB). The next
#    build here is a full rebuild because the objects are gone;
#  - writes a Fashion-MNIST subset to build-gpu/data for a short train_mnist run.
# Env: JOBS (parallel build jobs, default nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd -P)"
build=build-gpu
jobs="${JOBS:-$(nproc)}"

# TANDEM_MPI=OFF: the GPU machine runs one process and has no OpenMPI to load.
# TANDEM_DNNL=OFF: nor oneDNN; the CPU side of the GPU tests (their reference)
# then runs the im2col + OpenBLAS convolutions.
# CMakePresets.json's "gpu" preset (binary dir build-gpu).
cmake --preset gpu >/dev/null
# Only what the GPU machine runs: the gpu-labelled tests (target gpu_tests), the
# programs gpu_test.sh starts and the benchmarks it runs (bench/); the CPU-only
# tests are not built.
cmake --build "$build" -j"$jobs" --target gpu_tests quickstart_linear train_mnist tandem_bench \
  nn_ops_bench host_cost_bench

# The gpu-labelled test binaries (relative to build-gpu), from CTest.
gpu_tests="$(ctest --test-dir "$build" -L gpu --show-only=json-v1 | python3 -c '
import json, os, sys
bins = {os.path.relpath(t["command"][0], sys.argv[1]) for t in json.load(sys.stdin)["tests"]
        if t.get("command")}
print("\n".join(sorted(bins)))' "$root/$build")"
# Binaries to ship: those tests, the apps and the benchmarks. The other
# (CPU-only) test binaries are deleted: with OpenBLAS the bundle would not fit.
mapfile -t binaries < <( { printf '%s\n' "$gpu_tests" | sed "s|^|$build/|"
  find "$build/apps" "$build/bench" -maxdepth 1 -type f -perm -u+x; } | while read -r f; do
    [ -f "$f" ] && [ "$(head -c 4 "$f" | od -An -c | tr -d ' ')" = '177ELF' ] && echo "$f"
  done | sort -u)
if [ -z "$gpu_tests" ] || [ ${#binaries[@]} -eq 0 ]; then
  echo "gpu_bundle: no gpu test binaries found in $build" >&2
  exit 1
fi
for needed in tandem_bench nn_ops_bench host_cost_bench; do
  if ! printf '%s\n' "${binaries[@]}" | grep -qxF "$build/bench/$needed"; then
    echo "gpu_bundle: $build/bench/$needed was not built (gpu_test.sh's benchmark steps need it)" >&2
    exit 1
  fi
done
find "$build/tests" -name CMakeFiles -prune -o -type f -perm -u+x -print | while read -r f; do
  if [ "$(head -c 4 "$f" | od -An -c | tr -d ' ')" = '177ELF' ] &&
     ! printf '%s\n' "${binaries[@]}" | grep -qxF "$f"; then
    rm -f "$f"
  fi
done

# Libraries a bare GPU machine has (or gets from PyTorch's wheels / the driver).
provided='^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libutil|libstdc\+\+|libgcc_s|libz|libcuda|libcudart|libcublas|libcublasLt|libcudnn[a-z_]*|libnccl|libnvrtc|libnvJitLink)\.so'
rm -rf "$build/lib"
mkdir -p "$build/lib"
declare -A copied=()
for bin in "${binaries[@]}"; do
  if ldd "$bin" | grep -q 'not found'; then
    echo "gpu_bundle: $bin has unresolved libraries here:" >&2
    ldd "$bin" | grep 'not found' >&2
    exit 1
  fi
  # Lines "libfoo.so.1 => /path/libfoo.so.1 (0x...)": soname and resolved path.
  while read -r soname path; do
    [[ "$soname" =~ $provided ]] && continue
    [ -n "${copied[$soname]:-}" ] && continue
    cp -L "$path" "$build/lib/$soname"
    chmod u+w "$build/lib/$soname"
    copied[$soname]="$path"
  done < <(ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}')
done

# The oldest machine it can run on: the newest glibc / libstdc++ symbol versions used.
glibc="$(objdump -T "${binaries[@]}" "$build"/lib/*.so* 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)"
glibcxx="$(objdump -T "${binaries[@]}" "$build"/lib/*.so* 2>/dev/null | grep -o 'GLIBCXX_[0-9.]*' | sort -uV | tail -1)"
# Shrink: objects and static libraries are not needed to run; strip the rest;
# gzip the libraries over 4 MiB (OpenBLAS: 36 -> 11 MB), gpu_test.sh unpacks them.
find "$build" \( -name '*.o' -o -name '*.a' -o -name '*.d' \) -type f -delete
# Make's bookkeeping (dependency files, compiler checks): ctest needs none of it.
find "$build" -name CMakeFiles -type d -prune -exec rm -rf {} +
strip --strip-unneeded "${binaries[@]}" "$build"/lib/*.so* 2>/dev/null || true
rm -f "$build"/lib/*.gz
find "$build/lib" -type f -size +4M ! -name '*.gz' -exec gzip -6 {} \;

# A small Fashion-MNIST subset (first 4096 training, 1024 test examples) for the
# GPU machine's short train_mnist run; the full set would not fit the carry.
mnist_src="${MNIST_DIR:-/usr/share/datasets/fashion-mnist}"
rm -rf "$build/data"
if [ -f "$mnist_src/train-images-idx3-ubyte.gz" ]; then
  mkdir -p "$build/data/fashion-mnist-subset"
  python3 - "$mnist_src" "$build/data/fashion-mnist-subset" <<'EOF'
import gzip, struct, sys
src, dst = sys.argv[1], sys.argv[2]
for split, n in (("train", 4096), ("t10k", 1024)):
    for kind in ("images-idx3", "labels-idx1"):
        name = f"{split}-{kind}-ubyte.gz"
        with gzip.open(f"{src}/{name}", "rb") as f:
            magic, count = struct.unpack(">II", f.read(8))
            # Header: magic (low byte = number of dims), then each dim; dim 0 = count.
            dims = [struct.unpack(">I", f.read(4))[0] for _ in range((magic & 0xFF) - 1)]
            per_item = 1
            for d in dims:
                per_item *= d
            body = f.read(n * per_item)
        assert count >= n and len(body) == n * per_item, name
        with gzip.open(f"{dst}/{name}", "wb") as f:
            f.write(struct.pack(">II", magic, n) + b"".join(struct.pack(">I", d) for d in dims))
            f.write(body)
EOF
  echo "gpu_bundle: wrote $build/data/fashion-mnist-subset (4096 train, 1024 test from $mnist_src)"
else
  echo "gpu_bundle: no Fashion-MNIST at $mnist_src: gpu_test.sh will skip train_mnist"
fi

# What gpu_test.sh needs to find its way in a copy at another path.
echo "$root" >"$build/bundle_root.txt"
printf '%s\n' "$gpu_tests" >"$build/gpu_tests.txt"

echo "gpu_bundle: ${#binaries[@]} binaries; copied into $build/lib (${#copied[@]}):"
for soname in $(printf '%s\n' "${!copied[@]}" | sort); do
  file="$build/lib/$soname"
  [ -f "$file" ] || file="$file.gz"
  printf '  %-45s %6s KiB  from %s\n' "$(basename "$file")" \
    "$(( $(stat -c %s "$file") / 1024 ))" "${copied[$soname]}"
done
echo "gpu_bundle: gpu-labelled test binaries ($build/gpu_tests.txt):"
sed 's/^/  /' "$build/gpu_tests.txt"
echo "gpu_bundle: needs at least $glibc and $glibcxx on the GPU machine"
# One xz archive of build-gpu in build-carry/ (ignored by git, like build*/):
# what is carried to the GPU machine, where gpu_test.sh unpacks it when build-gpu
# is not there. The device tool carries at most 64 MiB with the working tree.
echo "gpu_bundle: $build is $(du -sm "$build" | cut -f1) MiB"
mkdir -p build-carry
tar -cf - "$build" | xz -T0 -6 >build-carry/gpu.tar.xz
size_mib="$(( $(stat -c %s build-carry/gpu.tar.xz) / 1048576 ))"
echo "gpu_bundle: build-carry/gpu.tar.xz is $size_mib MiB (carry build-carry)"
if [ "$size_mib" -gt 60 ]; then
  echo "gpu_bundle: build-carry/gpu.tar.xz is over 60 MiB; the device tool carries at most 64 MiB" >&2
  exit 1
fi
