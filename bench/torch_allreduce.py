"""PyTorch gloo all_reduce bandwidth across processes, the torch side of
`scripts/bench.sh mpi`. Run under mpirun (rank and size from OpenMPI's variables):

    tests/spawn/mpirun.sh -np 2 /usr/bin/python3 bench/torch_allreduce.py 1024 67108864 5

Prints on rank 0: impl,bytes,us_per_call,algbw_GBps (the same timing rule as
bench/mpi_allreduce_bench.cc: 3 warm-up calls, ~20 ms loops, median of reps).
"""
import os
import sys
import time

import torch
import torch.distributed as dist


def main():
    min_bytes = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    max_bytes = int(sys.argv[2]) if len(sys.argv) > 2 else 64 << 20
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    port = os.environ.get("TORCH_BENCH_PORT", "29533")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    torch.set_num_threads(1)
    if rank == 0:
        print("impl,bytes,us_per_call,algbw_GBps", flush=True)
    b = min_bytes
    while b <= max_bytes:
        x = torch.ones(b // 4, dtype=torch.float32)
        for _ in range(3):
            dist.all_reduce(x)
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(x)
        one_us = (time.perf_counter() - t) * 1e6
        iters = torch.tensor([max(1, min(1000, int(20000 / max(one_us, 1.0))))])
        dist.all_reduce(iters, op=dist.ReduceOp.MIN)
        iters = int(iters.item())
        per_call = []
        for _ in range(reps):
            dist.barrier()
            t = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(x)
            per_call.append((time.perf_counter() - t) * 1e6 / iters)
        per_call.sort()
        us = per_call[len(per_call) // 2]
        if rank == 0:
            print(f"torch_gloo,{b},{us:.2f},{b / us / 1e3:.3f}", flush=True)
        b *= 4
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
