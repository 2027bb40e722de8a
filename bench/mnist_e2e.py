#!/usr/bin/env python3
"""train_mnist against its PyTorch twin (torch_mnist.py), end to end.

Runs `train_mnist` (its defaults unless --tandem_args says otherwise) and
`torch_mnist.py --threads=<cores>` --runs times each, alternating them (tandem,
torch, tandem, ...) so that a change in the machine's load hits both alike. Each
run is wrapped in /usr/bin/time for its wall time and peak RSS; accuracy comes
from each program's summary line. Prints each run, then the medians and the
speedup (torch time / tandem time), and train_mnist's float32 floor: the
job's multiply-add FLOPs (LeNet's convolutions and linear layer, training and the
per-epoch test pass) over this machine's sgemm peak, measured with --threads
threads (torch.mm on 2048-square float32 matrices, best of several). The floor
ignores everything that is not a GEMM-like FLOP (data loading, pooling, ReLU,
the optimizer), so no program reaches it; the ratio says how far train_mnist is.
Exit status 0 when every run succeeded, 1 otherwise, 2 on a bad argument.

    python3 bench/mnist_e2e.py --train_mnist=build-cpu/apps/train_mnist --runs=5
"""

import argparse
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run(cmd, env=None):
    """(wall_s, peak_rss_mb, accuracy_percent) of one run, or raises RuntimeError."""
    timed = ["/usr/bin/time", "-f", "TIME %e %M"] + cmd
    proc = subprocess.run(timed, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    m = re.search(r"^TIME ([0-9.]+) ([0-9]+)$", proc.stderr, re.M)
    if not m:
        raise RuntimeError(f"{' '.join(cmd)}: no /usr/bin/time line in its stderr")
    wall_s, rss_mb = float(m.group(1)), int(m.group(2)) / 1024.0
    # tandem: "summary: ...: best test accuracy A%, final F%, ..."; torch: "accuracy A%".
    acc = re.search(r"final ([0-9.]+)%", proc.stdout) or re.search(r"accuracy ([0-9.]+)%",
                                                                   proc.stdout)
    if not acc:
        raise RuntimeError(f"{' '.join(cmd)}: no accuracy in its output:\n{proc.stdout[-2000:]}")
    return wall_s, rss_mb, float(acc.group(1))


# LeNet (apps/models.cc MakeLeNet) on 1x28x28 images: per layer the multiply-adds
# of one image's forward pass, and whether its input needs a gradient (the first
# convolution's input is the data: no backward-data pass).
LENET_MACS = [
    (20 * 28 * 28 * 1 * 5 * 5, False),   # conv 1 -> 20, 5x5, pad 2: 28x28 out
    (20 * 14 * 14 * 20 * 5 * 5, True),   # conv 20 -> 20, 5x5, pad 2 (after 2x2 pool): 14x14
    (20 * 7 * 7 * 10, True),             # linear 980 -> 10 (after 2x2 pool)
]


def lenet_job_flops(epochs, train_images, test_images):
    """FLOPs (2 per multiply-add) of train_mnist's job: each epoch one training pass
    (forward, backward-weights, and backward-data where the input needs it) over the
    training images and one forward pass over the test images."""
    forward = sum(macs for macs, _ in LENET_MACS)
    train = sum(macs * (3 if needs_dx else 2) for macs, needs_dx in LENET_MACS)
    return 2 * epochs * (train * train_images + forward * test_images)


def idx_count(path):
    """The item count of an MNIST idx file (gzipped or not): the first dimension."""
    import gzip
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        header = f.read(8)
    return int.from_bytes(header[4:8], "big")


def dataset_counts(data_dir):
    """(train images, test images) of an MNIST-format directory."""
    counts = []
    for stem in ("train-images-idx3-ubyte", "t10k-images-idx3-ubyte"):
        for name in (stem, stem + ".gz"):
            if os.path.exists(os.path.join(data_dir, name)):
                counts.append(idx_count(os.path.join(data_dir, name)))
                break
        else:
            raise RuntimeError(f"--data_dir {data_dir}: no {stem}[.gz]")
    return tuple(counts)


SGEMM_PEAK = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
n = 2048
a, b = torch.randn(n, n), torch.randn(n, n)
best = float("inf")
for _ in range(12):
    start = time.perf_counter()
    torch.mm(a, b)
    best = min(best, time.perf_counter() - start)
print(2 * n ** 3 / best)
"""


def sgemm_peak_flops(python, threads):
    """The best float32 GEMM rate (FLOP/s) torch.mm reaches with `threads` threads."""
    proc = subprocess.run([python, "-c", SGEMM_PEAK, str(threads)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"sgemm peak with {python}: {proc.stderr[-2000:]}")
    return float(proc.stdout.strip())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train_mnist", default="build-cpu/apps/train_mnist")
    parser.add_argument("--python", default="/usr/bin/python3", help="a Python with torch")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="torch.set_num_threads (default: every core)")
    parser.add_argument("--data_dir", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--epochs", type=int, default=None,
                        help="epochs of both sides (default: their default, 2); 1 for a quick run")
    parser.add_argument("--tandem_args", default="",
                        help="extra train_mnist flags, space-separated (default: none)")
    args = parser.parse_args()
    if args.runs < 1 or args.threads < 1 or (args.epochs is not None and args.epochs < 1):
        print("mnist_e2e.py: --runs, --threads and --epochs must be >= 1", file=sys.stderr)
        return 2
    if not os.access(args.train_mnist, os.X_OK):
        print(f"mnist_e2e.py: --train_mnist {args.train_mnist}: not an executable", file=sys.stderr)
        return 2
    if args.tandem_args.strip():
        print("mnist_e2e.py: note: the floor assumes train_mnist's default model and schedule",
              file=sys.stderr)
    tandem_cmd = [args.train_mnist, f"--data_dir={args.data_dir}"] + args.tandem_args.split()
    torch_cmd = [args.python, os.path.join(HERE, "torch_mnist.py"), f"--threads={args.threads}",
                 f"--data_dir={args.data_dir}"]
    if args.epochs is not None:
        tandem_cmd.append(f"--epochs={args.epochs}")
        torch_cmd.append(f"--epochs={args.epochs}")
    results = {"tandem": [], "torch": []}
    try:
        for i in range(args.runs):
            for name, cmd in (("tandem", tandem_cmd), ("torch", torch_cmd)):
                wall, rss, acc = run(cmd)
                results[name].append((wall, rss, acc))
                print(f"run {i + 1}/{args.runs} {name:6s}: {wall:7.2f} s  peak RSS {rss:6.0f} MB  "
                      f"accuracy {acc:.2f}%", flush=True)
    except RuntimeError as e:
        print(f"mnist_e2e.py: {e}", file=sys.stderr)
        return 1
    med = {k: tuple(statistics.median(r[j] for r in v) for j in range(3))
           for k, v in results.items()}
    print(f"\nmedians of {args.runs} runs ({os.cpu_count()} cores; torch threads {args.threads}; "
          f"train_mnist {' '.join(tandem_cmd[1:])}):")
    print(f"  {'':8s} {'time s':>8s} {'peak RSS MB':>12s} {'accuracy %':>11s}")
    for k in ("tandem", "torch"):
        print(f"  {k:8s} {med[k][0]:8.2f} {med[k][1]:12.0f} {med[k][2]:11.2f}")
    print(f"  speedup (torch time / tandem time): {med['torch'][0] / med['tandem'][0]:.2f}x")
    try:
        train_images, test_images = dataset_counts(args.data_dir)
        peak = sgemm_peak_flops(args.python, args.threads)
    except RuntimeError as e:
        print(f"mnist_e2e.py: {e}", file=sys.stderr)
        return 1
    flops = lenet_job_flops(args.epochs or 2, train_images, test_images)
    floor_s = flops / peak
    print(f"  float32 floor: {flops / 1e12:.3f} TFLOP (LeNet, {args.epochs or 2} epochs of "
          f"{train_images} training + {test_images} test images) / sgemm peak "
          f"{peak / 1e9:.1f} GFLOP/s ({args.threads} threads) = {floor_s:.2f} s")
    print(f"  train_mnist / floor: {med['tandem'][0] / floor_s:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
