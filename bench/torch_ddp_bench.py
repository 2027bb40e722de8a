#!/usr/bin/env python3
"""PyTorch DistributedDataParallel (gloo) training steps: the torch side of
`scripts/bench.sh ddp`, the twin of bench/ddp_bench.cc (same cells, same
data split, same timing rule, same CSV line). Run under mpirun (rank and world
from OpenMPI's variables), one CPU process per rank:

    tests/spawn/mpirun.sh -np 2 /usr/bin/python3 bench/torch_ddp_bench.py \
        --import_dir=X --models=mlp,lenet --batch_sizes=32,64,128

X is the exchange directory of `tandem_bench --export_dir=X` (initial weights,
data, the SGD hyper-parameters). Per cell every rank: loads the weights into the
model of torch_bench.py (apps/models.h's twin), wraps it in DDP (default
buckets), plain SGD; step k trains on rows [k' B + r B/W, k' B + (r+1) B/W),
k' = k mod 10; the first 10 losses (mean over the ranks) are recorded; then
--repetitions x (--warmup_steps steps, barrier, clock, --steps steps, clock),
median. Rank 0 prints:
    torch_ddp,model,global_batch,world,median_us,min_us,max_us,loss_1,...,loss_10
"""
import argparse
import json
import os
import sys
import time

THREADS = "1"
for arg in sys.argv[1:]:
    if arg.startswith("--threads="):
        THREADS = arg.split("=", 1)[1]
# Before torch loads: its BLAS (OpenBLAS on Debian) sizes its pool from these.
for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = THREADS

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_bench import make_model, read_raw  # noqa: E402

LOSS_STEPS = 10
DATA_BATCHES = 10


def run_cell(args, manifest, name, batch, rank, world):
    entry = manifest["models"][name]
    local = batch // world
    model = make_model(name)
    with torch.no_grad():
        own = dict(model.named_parameters())
        for p in entry["params"]:
            own[p["name"]].copy_(read_raw(args.import_dir, p))
    images = read_raw(args.import_dir, entry["images"])
    labels = read_raw(args.import_dir, entry["labels"])
    if images.shape[0] < DATA_BATCHES * batch:
        raise ValueError(f"{name}: {images.shape[0]} images, {DATA_BATCHES} batches of {batch} "
                         f"need {DATA_BATCHES * batch}")
    xs = [images[k * batch + rank * local:k * batch + (rank + 1) * local].clone()
          for k in range(DATA_BATCHES)]
    ys = [labels[k * batch + rank * local:k * batch + (rank + 1) * local].clone()
          for k in range(DATA_BATCHES)]
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    sgd = torch.optim.SGD(ddp.parameters(), lr=manifest["optimizers"]["sgd"]["lr"])
    step = [0]

    def train():
        sgd.zero_grad(set_to_none=True)
        k = step[0] % DATA_BATCHES
        loss = F.cross_entropy(ddp(xs[k]), ys[k])
        loss.backward()
        sgd.step()
        step[0] += 1
        return loss

    losses = torch.tensor([train().item() for _ in range(LOSS_STEPS)], dtype=torch.float64)
    dist.all_reduce(losses)
    losses /= world
    times = []
    for _ in range(args.repetitions):
        for _ in range(args.warmup_steps):
            train()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            train()
        times.append((time.perf_counter() - start) * 1e6 / args.steps)
    times.sort()
    return times[len(times) // 2], times[0], times[-1], losses.tolist()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--import_dir", required=True)
    parser.add_argument("--models", default="mlp,lenet")
    parser.add_argument("--batch_sizes", default="32,64,128")
    parser.add_argument("--warmup_steps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    port = os.environ.get("TORCH_BENCH_PORT", "29534")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.set_num_threads(args.threads)
    with open(os.path.join(args.import_dir, "manifest.json")) as f:
        manifest = json.load(f)
    for name in args.models.split(","):
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            if batch % world:
                raise ValueError(f"--batch_sizes: {batch} is not a multiple of {world}")
            median, low, high, losses = run_cell(args, manifest, name, batch, rank, world)
            if rank == 0:
                print(",".join(["torch_ddp", name, str(batch), str(world), f"{median:.1f}",
                                f"{low:.1f}", f"{high:.1f}"] + [f"{v:.7g}" for v in losses]),
                      flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
