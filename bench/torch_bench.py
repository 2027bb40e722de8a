#!/usr/bin/env python3
"""The PyTorch side of tandem's benchmark harness.

Runs the models of apps/models.h (same layer order, shapes and parameter names)
from the initial weights and the data that `tandem_bench --export_dir=DIR`
wrote (layout: bench/exchange.h; DIR/manifest.json lists every file), with
the optimizers' hyper-parameters read from the same manifest, and times them
exactly as tandem_bench does: per repetition, warm-up steps, loss.item() (a
device sync), the clock, the timed steps, loss.item(), the clock; median of the
repetitions. The first 10 losses of every cell are recorded (not timed) for the
driver (compare.py) to compare with tandem's.

Modes: eager; compile (torch.compile, default mode); reduce-overhead
(torch.compile(mode="reduce-overhead"), CUDA graphs). A mode this torch cannot
run (no torch.compile before 2.0; reduce-overhead without CUDA) is reported as
skipped with the reason: nothing is estimated in its place.

--graph_node_cost (CUDA only) measures what one node of a replayed CUDA graph
costs on this GPU: graphs of 1 and of N tiny kernels are captured with
torch.cuda.CUDAGraph and replayed; the per-node cost is the slope.

    python3 bench/torch_bench.py --import_dir=/tmp/x --device=cpu --json=t.json

Standard library and torch only. Exit status: 0 ok, 1 failure, 2 bad argument.
"""

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import sys
import time


def _pin_blas_threads(argv):
    """--threads=N also caps the BLAS library's own thread pool.

    torch.set_num_threads only sizes torch's intra-op pool; a torch built
    against a generic BLAS (Debian's: BLAS_INFO=generic, i.e. OpenBLAS through
    libblas.so.3) runs its matmuls on OpenBLAS's pthreads, sized by
    OPENBLAS_NUM_THREADS when the library loads. Without this, "1 thread" on the
    torch side meant 1 torch thread but all cores in every sgemm.
    """
    for arg in argv:
        if arg.startswith("--threads="):
            value = arg.split("=", 1)[1]
            if value.isdigit() and int(value) > 0:
                for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                    os.environ[var] = value


_pin_blas_threads(sys.argv[1:])

try:
    import torch
    import torch.nn.functional as F
except ImportError as e:  # the driver reports this line
    print(f"torch_bench: error: cannot import torch with {sys.executable}: {e}", file=sys.stderr)
    sys.exit(1)

MODES = ("eager", "compile", "reduce-overhead")


def make_model(name):
    """The models of apps/models.h, as torch.nn.Sequential (same child indices)."""
    nn = torch.nn
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 10))
    if name == "lenet":
        return nn.Sequential(nn.Conv2d(1, 20, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(20, 20, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(20 * 7 * 7, 10))
    if name == "mobilenet_v2":
        # torchvision's definition; tandem's apps::MakeMobileNetV2 uses its names.
        # Dropout 0: the loss comparison cannot share dropout masks.
        import torchvision
        return torchvision.models.mobilenet_v2(num_classes=10, dropout=0.0)
    if name in ("resnet18", "resnet50"):
        # torchvision's definitions; tandem's apps::MakeResNet18/50 use their names.
        import torchvision
        return getattr(torchvision.models, name)(num_classes=10)
    if name == "resnet50_imagenet":
        # The published ResNet-50 throughputs' shape: 1000 classes, 224x224 inputs.
        import torchvision
        return torchvision.models.resnet50(num_classes=1000)
    if name == "convnet":
        return nn.Sequential(nn.Conv2d(3, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(64, 64, 3), nn.ReLU(), nn.Flatten(),
                             nn.Linear(64 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))
    raise ValueError(f"unknown model {name!r}")


DTYPES = {"float32": torch.float32, "int64": torch.int64, "float64": torch.float64}


def read_raw(directory, entry):
    """A tensor from an exchange-directory file: raw little-endian, C order."""
    path = os.path.join(directory, entry["file"])
    dtype = DTYPES[entry["dtype"]]
    shape = [int(d) for d in entry["shape"]]
    numel = 1
    for d in shape:
        numel *= d
    with open(path, "rb") as f:
        data = f.read()
    want = numel * torch.empty((), dtype=dtype).element_size()
    if len(data) != want:
        raise ValueError(f"{path}: {len(data)} bytes, but {entry['dtype']} {shape} needs {want}")
    if sys.byteorder != "little":
        raise ValueError("the exchange files are little-endian; this host is not")
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape).clone()


def make_optimizer(name, params, hyper):
    h = hyper[name]
    if name == "sgd":
        return torch.optim.SGD(params, lr=h["lr"], momentum=h["momentum"],
                               dampening=h["dampening"], weight_decay=h["weight_decay"],
                               nesterov=h["nesterov"])
    if name == "adam":
        return torch.optim.Adam(params, lr=h["lr"], betas=tuple(h["betas"]), eps=h["eps"],
                                weight_decay=h["weight_decay"], amsgrad=h["amsgrad"])
    raise ValueError(f"unknown optimizer {name!r}")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mode_unavailable(mode, device):
    """Why `mode` cannot run here, or None."""
    if mode == "eager":
        return None
    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile (added in 2.0)"
    if mode == "reduce-overhead" and device.type != "cuda":
        return "reduce-overhead captures CUDA graphs: needs a CUDA device"
    return None


class Stepper:
    """One training step of `model` with `optimizer` in a mode (compiled or not)."""

    def __init__(self, model, optimizer, mode, bf16=False, device_type="cpu"):
        self.optimizer = optimizer
        self.mark_step = None
        # --bf16: forward and loss under torch.autocast (bfloat16), as tandem_bench
        # runs them under nn::AutocastGuard; parameters and optimizer stay float32.
        self.autocast = (lambda: torch.autocast(device_type=device_type, dtype=torch.bfloat16)) \
            if bf16 else contextlib.nullcontext
        if mode == "eager":
            self.forward = model
            self.opt_step = optimizer.step
        else:
            compile_mode = None if mode == "compile" else "reduce-overhead"
            torch._dynamo.reset()  # each cell compiles for its own batch size
            self.forward = torch.compile(model, mode=compile_mode)

            def opt_step():
                optimizer.step()

            self.opt_step = torch.compile(opt_step, mode=compile_mode)
            if compile_mode == "reduce-overhead":
                compiler = getattr(torch, "compiler", None)
                self.mark_step = getattr(compiler, "cudagraph_mark_step_begin", None)

    def __call__(self, x, y):
        if self.mark_step is not None:
            self.mark_step()
        self.optimizer.zero_grad(set_to_none=True)
        with self.autocast():
            loss = F.cross_entropy(self.forward(x), y)
        loss.backward()
        self.opt_step()
        return loss


def run_cell(args, device, name, model, initial, images, labels, batch, opt_name, hyper, mode,
             data_batches):
    cell = {"side": "torch", "mode": mode, "model": name, "batch": batch,
            "optimizer": opt_name, "device": str(device), "tf32": args.tf32, "bf16": args.bf16,
            "graph": mode == "reduce-overhead", "graph_nodes": None, "skipped": None}
    with torch.no_grad():
        # Parameters and buffers (BatchNorm's running statistics): every cell
        # starts from the exchanged state, as tandem_bench's does.
        for name, t in model.state_dict().items():
            if name in initial:
                t.copy_(initial[name])
            elif name.endswith("num_batches_tracked"):
                t.zero_()
    for p in model.parameters():
        p.grad = None
    model.train()
    optimizer = make_optimizer(opt_name, list(model.parameters()), hyper)
    step_fn = Stepper(model, optimizer, mode, bf16=args.bf16, device_type=device.type)
    counter = [0]

    def step():
        b = counter[0] % data_batches
        counter[0] += 1
        return step_fn(images[b * batch:(b + 1) * batch], labels[b * batch:(b + 1) * batch])

    losses = []
    for _ in range(int(args.manifest["loss_steps"])):
        loss = step()
        losses.append(loss.item())
    reps = []
    for _ in range(args.repetitions):
        for _ in range(args.warmup_steps):
            loss = step()
        loss.item()
        sync(device)
        start = time.perf_counter()
        for _ in range(args.steps):
            loss = step()
        loss.item()
        sync(device)
        reps.append((time.perf_counter() - start) * 1e6 / args.steps)
    median = statistics.median(reps)
    cell.update({"median_us_per_step": median, "samples_per_s": batch * 1e6 / median,
                 "min_us_per_step": min(reps), "max_us_per_step": max(reps),
                 "rep_us_per_step": reps, "losses": losses})
    return cell


def graph_node_cost(device, nodes=(1, 201), replays=200, repetitions=5):
    """Microseconds per node of a replayed CUDA graph of tiny kernels (median of reps)."""
    if device.type != "cuda":
        return {"skipped": "needs a CUDA device"}
    x = torch.zeros(1, device=device)
    per_count = {}
    for n in nodes:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm-up outside capture, as the docs ask
            for _ in range(3):
                x.add_(1.0)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(n):
                x.add_(1.0)
        graph.replay()
        sync(device)
        times = []
        for _ in range(repetitions):
            sync(device)
            start = time.perf_counter()
            for _ in range(replays):
                graph.replay()
            sync(device)
            times.append((time.perf_counter() - start) * 1e6 / replays)
        per_count[n] = statistics.median(times)
    lo, hi = min(nodes), max(nodes)
    return {"method": f"torch.cuda.CUDAGraph of n x add_ on a 1-element tensor, {replays} "
                      f"replays back to back, median of {repetitions}; per-node cost = slope "
                      f"between n={lo} and n={hi}",
            "nodes": list(nodes), "us_per_replay": [per_count[n] for n in nodes],
            "per_node_us": (per_count[hi] - per_count[lo]) / (hi - lo),
            "replay_base_us": per_count[lo]}


def machine_info(device):
    info = {"hostname": socket.gethostname(), "os": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "logical_cpus": os.cpu_count(), "cpu_model": "unknown",
            "torch_threads": torch.get_num_threads(),
            "cuda_available": torch.cuda.is_available()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update({"gpu_name": p.name, "gpu_memory_bytes": p.total_memory,
                     "gpu_sm_count": p.multi_processor_count,
                     "gpu_compute_capability": f"{p.major}.{p.minor}",
                     "cuda_runtime_version": torch.version.cuda,
                     "cudnn_version": torch.backends.cudnn.version()})
    return info


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--import_dir", required=True, help="exchange directory of tandem_bench")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--models", default="", help="comma-separated; default: all in the manifest")
    ap.add_argument("--batch_sizes", default="32,128,512")
    ap.add_argument("--optimizers", default="sgd,adam")
    ap.add_argument("--modes", default="eager,compile,reduce-overhead")
    ap.add_argument("--warmup_steps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repetitions", type=int, default=5)
    ap.add_argument("--tf32", action="store_true", help="TF32 for CUDA matmuls and cuDNN convs")
    ap.add_argument("--bf16", action="store_true",
                    help="forward and loss under torch.autocast(dtype=torch.bfloat16)")
    ap.add_argument("--channels_last", action="store_true",
                    help="models with convolutions and their images in torch.channels_last "
                         "memory format (NHWC; cuDNN's fastest layout for bf16/TF32 tensor "
                         "cores); the losses are the same computation")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op CPU threads, also OpenBLAS's pool (0: the defaults)")
    ap.add_argument("--graph_node_cost", action="store_true",
                    help="also measure the per-node cost of CUDA graph replay (CUDA only)")
    ap.add_argument("--json", default="", help="write the report here")
    args = ap.parse_args(argv)

    def bad(flag, value, why):
        print(f"torch_bench: error: --{flag}={value}: {why}", file=sys.stderr)
        sys.exit(2)

    if args.warmup_steps < 0:
        bad("warmup_steps", args.warmup_steps, "must be >= 0")
    if args.steps < 1:
        bad("steps", args.steps, "must be >= 1")
    if args.repetitions < 5:
        bad("repetitions", args.repetitions, "must be >= 5")
    if args.threads < 0:
        bad("threads", args.threads, "must be >= 0")
    try:
        args.device = torch.device(args.device)
    except RuntimeError as e:
        bad("device", args.device, str(e))
    if args.device.type not in ("cpu", "cuda"):
        bad("device", args.device, "only cpu and cuda:N are supported")
    if args.device.type == "cuda":
        if not torch.cuda.is_available():
            bad("device", args.device, f"torch {torch.__version__} sees no CUDA device")
        if args.device.index is None:
            args.device = torch.device("cuda", 0)
        if args.device.index >= torch.cuda.device_count():
            bad("device", args.device, f"{torch.cuda.device_count()} CUDA device(s) visible")
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    except ValueError:
        bad("batch_sizes", args.batch_sizes, "not a list of integers")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        bad("batch_sizes", args.batch_sizes, "each must be >= 1")
    args.optimizers = [o for o in args.optimizers.split(",") if o]
    for o in args.optimizers:
        if o not in ("sgd", "adam"):
            bad("optimizers", o, "unknown optimizer (sgd, adam)")
    args.modes = [m for m in args.modes.split(",") if m]
    for m in args.modes:
        if m not in MODES:
            bad("modes", m, f"unknown mode ({', '.join(MODES)})")
    manifest_path = os.path.join(args.import_dir, "manifest.json")
    try:
        with open(manifest_path) as f:
            args.manifest = json.load(f)
    except (OSError, ValueError) as e:
        bad("import_dir", args.import_dir, f"cannot read {manifest_path}: {e}")
    if args.manifest.get("format") != "tandem-bench-exchange" or args.manifest.get("version") != 1:
        bad("import_dir", args.import_dir, f"{manifest_path} is not a version 1 exchange manifest")
    available = list(args.manifest["models"])
    args.models = [m for m in args.models.split(",") if m] or available
    for m in args.models:
        if m not in available:
            bad("models", m, f"not in {manifest_path} (it has {', '.join(available)})")
    return args


def main(argv):
    args = parse_args(argv)
    device = args.device
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    manifest = args.manifest
    hyper = manifest["optimizers"]
    data_batches = int(manifest["data_batches"])
    cells = []
    for name in args.models:
        entry = manifest["models"][name]
        model = make_model(name).to(device)
        initial = {p["name"]: read_raw(args.import_dir, p).to(device) for p in entry["params"]}
        # tandem's state is the parameters and the buffers, BatchNorm's batch count
        # (num_batches_tracked) included, as torch's.
        own = model.state_dict()
        if set(own) != set(initial):
            raise ValueError(f"{name}: parameters {sorted(own)} vs manifest {sorted(initial)}")
        for key, t in initial.items():
            if tuple(t.shape) != tuple(own[key].shape):
                raise ValueError(f"{name}.{key}: shape {tuple(t.shape)} in the manifest, "
                                 f"{tuple(own[key].shape)} in the model")
        images = read_raw(args.import_dir, entry["images"]).to(device)
        if args.channels_last and images.dim() == 4:
            model = model.to(memory_format=torch.channels_last)
            images = images.contiguous(memory_format=torch.channels_last)
        labels = read_raw(args.import_dir, entry["labels"]).to(device)
        for batch in args.batch_sizes:
            if batch * data_batches > images.shape[0]:
                raise ValueError(f"{name}: batch {batch} x {data_batches} batches needs "
                                 f"{batch * data_batches} examples; the exchange has "
                                 f"{images.shape[0]}")
            for opt_name in args.optimizers:
                for mode in args.modes:
                    why = mode_unavailable(mode, device)
                    if why is not None:
                        cells.append({"side": "torch", "mode": mode, "model": name,
                                      "batch": batch, "optimizer": opt_name,
                                      "device": str(device), "tf32": args.tf32, "bf16": args.bf16,
                                      "graph": mode == "reduce-overhead", "graph_nodes": None,
                                      "skipped": why})
                        continue
                    try:
                        cell = run_cell(args, device, name, model, initial, images, labels, batch,
                                        opt_name, hyper, mode, data_batches)
                    except Exception as e:  # a compile failure is a result, not a crash
                        if mode == "eager":
                            raise
                        cell = {"side": "torch", "mode": mode, "model": name, "batch": batch,
                                "optimizer": opt_name, "device": str(device),
                                "tf32": args.tf32, "bf16": args.bf16,
                                "graph": mode == "reduce-overhead", "graph_nodes": None,
                                "skipped": f"failed: {type(e).__name__}: {e}"[:500]}
                    cells.append(cell)
                    if cell["skipped"]:
                        print(f"{name:8s} batch {batch:4d} {opt_name:4s} {mode:15s} skipped: "
                              f"{cell['skipped']}", file=sys.stderr)
                    else:
                        print(f"{name:8s} batch {batch:4d} {opt_name:4s} {mode:15s} "
                              f"{cell['median_us_per_step']:10.1f} us/step "
                              f"(min {cell['min_us_per_step']:.1f}, max "
                              f"{cell['max_us_per_step']:.1f}), "
                              f"{cell['samples_per_s']:10.0f} samples/s", file=sys.stderr)
    report = {
        "schema": "tandem-bench/1", "side": "torch",
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": {"device": str(device), "models": args.models, "batch_sizes": args.batch_sizes,
                   "optimizer_names": args.optimizers, "modes": args.modes,
                   "warmup_steps": args.warmup_steps, "steps": args.steps,
                   "repetitions": args.repetitions, "loss_steps": int(args.manifest["loss_steps"]),
                   "tf32": args.tf32, "bf16": args.bf16, "channels_last": args.channels_last,
                   "threads_requested": args.threads,
                   "threads": torch.get_num_threads(),
                   "openblas_num_threads": os.environ.get("OPENBLAS_NUM_THREADS"), "import_dir": args.import_dir,
                   "zero_grad": "optimizer.zero_grad(set_to_none=True)",
                   "timing": "per repetition: warmup steps, loss.item() + synchronize, clock, "
                             "steps, loss.item() + synchronize, clock; median over repetitions",
                   "optimizers": hyper},
        "machine": machine_info(device),
        "graph_node_cost": graph_node_cost(device) if args.graph_node_cost else None,
        "cells": cells,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
        print(f"torch_bench: wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
