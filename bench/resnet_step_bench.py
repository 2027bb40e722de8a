"""The PyTorch eager half of bench/resnet_step_bench.sh: the per-step time of
torchvision's ResNet-18 / ResNet-50 with the CIFAR stem (conv1 3x3 stride 1, no
max-pool), 10 classes, on the CPU, as resnet_step_bench.cc times tandem's.

  resnet_step_bench.py MODEL BATCH THREADS WARMUP STEPS
"""
import statistics
import sys
import time

import torch
import torchvision


def main():
    name, batch, threads, warmup, steps = sys.argv[1], *map(int, sys.argv[2:6])
    torch.set_num_threads(threads)
    torch.manual_seed(1)
    model = getattr(torchvision.models, name.replace("_cifar", ""))(num_classes=10)
    model.conv1 = torch.nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
    model.maxpool = torch.nn.Identity()
    model.train()
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, 3, 32, 32)
    y = torch.arange(batch) % 10
    loss_fn = torch.nn.CrossEntropyLoss()
    times, losses = [], []
    for step in range(warmup + steps):
        start = time.perf_counter()
        sgd.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        sgd.step()
        value = loss.item()
        us = (time.perf_counter() - start) * 1e6
        if step >= warmup:
            times.append(us)
            losses.append(value)
    print(f"torch {name} batch {batch} threads {threads}: median_us {statistics.median(times):.0f} "
          f"min_us {min(times):.0f} losses {losses[0]:.4f} .. {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
