"""The PyTorch half of scripts/bench.sh host_cost: the host's cost per op of
PyTorch's eager path, the same cases, shapes, flags and output lines as
bench/host_cost_bench.cc (whose header describes them), with side=torch.

  torch_host_cost.py --devices=cpu,cuda:0 --cases=add,relu --n=2000 --repetitions=5

Per repetition: a sync (torch.cuda.synchronize on CUDA), the clock, --n iterations,
the clock (host time), one sync, the clock (wall time); medians over the
repetitions, in microseconds per iteration, after --warmup untimed iterations.
A CUDA device PyTorch cannot use skips its rows with the reason.
"""
import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

CASES = ["add", "relu", "linear", "linear_fwd_bwd", "conv2d", "conv2d_fwd_bwd",
         "dwconv_fwd_bwd", "conv1x1_fwd_bwd", "bn_fwd_bwd"]


def elementwise(relu, device):
    a = torch.randn(8, 8, device=device)
    b = torch.randn(8, 8, device=device)
    if relu:
        return lambda: torch.relu(a)
    return lambda: a + b


def reset_grads(*tensors):
    for t in tensors:
        t.grad = None


def linear(grad, device):
    x = torch.randn(8, 32, device=device, requires_grad=grad)
    w = torch.randn(16, 32, device=device, requires_grad=grad)
    b = torch.randn(16, device=device, requires_grad=grad)
    if not grad:
        return lambda: F.linear(x, w, b)
    dy = torch.ones(8, 16, device=device)

    def step():
        F.linear(x, w, b).backward(dy)
        reset_grads(x, w, b)
    return step


def conv(grad, device):
    x = torch.randn(1, 4, 8, 8, device=device, requires_grad=grad)
    w = torch.randn(8, 4, 3, 3, device=device, requires_grad=grad)
    b = torch.randn(8, device=device, requires_grad=grad)
    if not grad:
        return lambda: F.conv2d(x, w, b, padding=1)
    dy = torch.ones(1, 8, 8, 8, device=device)

    def step():
        F.conv2d(x, w, b, padding=1).backward(dy)
        reset_grads(x, w, b)
    return step


def mobile_conv(depthwise, device):
    x = torch.randn(8, 32, 16, 16, device=device, requires_grad=True)
    if depthwise:
        w = torch.randn(32, 1, 3, 3, device=device, requires_grad=True)
        dy = torch.ones(8, 32, 16, 16, device=device)
    else:
        w = torch.randn(64, 32, 1, 1, device=device, requires_grad=True)
        dy = torch.ones(8, 64, 16, 16, device=device)

    def step():
        if depthwise:
            F.conv2d(x, w, None, padding=1, groups=32).backward(dy)
        else:
            F.conv2d(x, w, None).backward(dy)
        reset_grads(x, w)
    return step


def batch_norm(device):
    x = torch.randn(8, 32, 16, 16, device=device, requires_grad=True)
    weight = torch.ones(32, device=device, requires_grad=True)
    bias = torch.zeros(32, device=device, requires_grad=True)
    mean = torch.zeros(32, device=device)
    var = torch.ones(32, device=device)
    dy = torch.ones(8, 32, 16, 16, device=device)

    def step():
        F.batch_norm(x, mean, var, weight, bias, training=True).backward(dy)
        reset_grads(x, weight, bias)
    return step


def make_case(name, device):
    return {
        "add": lambda: elementwise(False, device),
        "relu": lambda: elementwise(True, device),
        "linear": lambda: linear(False, device),
        "linear_fwd_bwd": lambda: linear(True, device),
        "conv2d": lambda: conv(False, device),
        "conv2d_fwd_bwd": lambda: conv(True, device),
        "dwconv_fwd_bwd": lambda: mobile_conv(True, device),
        "conv1x1_fwd_bwd": lambda: mobile_conv(False, device),
        "bn_fwd_bwd": lambda: batch_norm(device),
    }[name]()


def unavailable(device):
    """Why `device` cannot run here, or ""."""
    if device.type == "cpu":
        return ""
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} has no usable CUDA device"
    index = device.index or 0
    if index >= torch.cuda.device_count():
        return f"needs CUDA device {index}, {torch.cuda.device_count()} visible"
    return ""


def run_case(name, device, args):
    row = f"host_cost side=torch device={device} case={name}"
    why = unavailable(device)
    if why:
        print(f'{row} skipped="{why}"', flush=True)
        return

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    torch.manual_seed(1)
    step = make_case(name, device)
    for _ in range(args.warmup):
        step()
    host_us, wall_us = [], []
    for _ in range(args.repetitions):
        sync()
        start = time.perf_counter()
        for _ in range(args.n):
            step()
        enqueued = time.perf_counter()
        sync()
        done = time.perf_counter()
        host_us.append((enqueued - start) * 1e6 / args.n)
        wall_us.append((done - start) * 1e6 / args.n)
    reps_host = ",".join(f"{v:.3f}" for v in host_us)
    reps_wall = ",".join(f"{v:.3f}" for v in wall_us)
    print(f"{row} threads={args.threads} n={args.n} host_us={statistics.median(host_us):.3f} "
          f"wall_us={statistics.median(wall_us):.3f} reps_host_us={reps_host} "
          f"reps_wall_us={reps_wall}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", default="cpu,cuda:0")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    for flag in ("n", "repetitions", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag}={getattr(args, flag)}: must be >= 1")
    cases = args.cases.split(",")
    for name in cases:
        if name not in CASES:
            parser.error(f'--cases: unknown case "{name}"')
    torch.set_num_threads(args.threads)
    for text in args.devices.split(","):
        device = torch.device(text)
        for name in cases:
            run_case(name, device, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
