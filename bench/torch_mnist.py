#!/usr/bin/env python3
"""train_mnist's default job in PyTorch, for the end-to-end comparison.

The same job as `train_mnist` with its defaults on the CPU: the LeNet of
apps/models.cc (conv5x5(1->20, pad 2)+ReLU, maxpool2, conv5x5(20->20, pad 2)+ReLU,
maxpool2, fc(980->10)), Adam at 2e-3 with per-step cosine decay
(lr * (1 + cos(pi * step / total_steps)) / 2, set before each step), batch 64,
reshuffled each epoch (the last batch smaller), 2 epochs, Fashion-MNIST from
--data_dir scaled to [0, 1] and standardised with mean 0.2860 / std 0.3530, the
test accuracy after each epoch (batches of 500, no grad). The tensors are held in
memory as a PyTorch user would write it: standardised float32 once, batches
indexed from them. torch.set_num_threads(--threads), default every core.

Prints one line `summary: accuracy A% final loss L time T s` (T: wall time from
the start of the script, data loading included). Standard library and torch only.

    /usr/bin/python3 bench/torch_mnist.py --threads=2
"""

import argparse
import gzip
import math
import os
import struct
import sys
import time

START = time.perf_counter()

import torch  # noqa: E402  (the clock starts before the import, as a process's does)
import torch.nn as tnn  # noqa: E402


def read_idx(path):
    """An IDX file (gzip or raw) as a uint8 tensor of its dims."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    zero, dtype, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file")
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return torch.frombuffer(bytearray(data[4 + 4 * ndim:]), dtype=torch.uint8).reshape(dims)


def load(data_dir, train):
    prefix = "train" if train else "t10k"
    def find(kind):
        for name in (f"{prefix}-{kind}-ubyte.gz", f"{prefix}-{kind}-ubyte"):
            path = os.path.join(data_dir, name)
            if os.path.exists(path):
                return path
        raise FileNotFoundError(f"{data_dir}: no {prefix}-{kind}-ubyte[.gz]")
    images = read_idx(find("images-idx3"))
    labels = read_idx(find("labels-idx1")).long()
    x = ((images.float() / 255.0 - 0.2860) / 0.3530).unsqueeze(1)  # (N, 1, 28, 28)
    return x, labels


def lenet():
    return tnn.Sequential(
        tnn.Conv2d(1, 20, 5, padding=2), tnn.ReLU(), tnn.MaxPool2d(2),
        tnn.Conv2d(20, 20, 5, padding=2), tnn.ReLU(), tnn.MaxPool2d(2),
        tnn.Flatten(), tnn.Linear(20 * 7 * 7, 10))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads < 1 or args.epochs < 1 or args.batch_size < 1:
        print("torch_mnist.py: --threads, --epochs and --batch_size must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train_x, train_y = load(args.data_dir, True)
    test_x, test_y = load(args.data_dir, False)
    model = lenet()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = tnn.CrossEntropyLoss()
    n = train_x.shape[0]
    steps_per_epoch = (n + args.batch_size - 1) // args.batch_size
    total_steps = steps_per_epoch * args.epochs
    generator = torch.Generator().manual_seed(args.seed)
    step = 0
    accuracy = 0.0
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(n, generator=generator)
        loss_sum = torch.zeros(())
        for k in range(steps_per_epoch):
            idx = order[k * args.batch_size:(k + 1) * args.batch_size]
            for group in optimizer.param_groups:
                group["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * step / total_steps))
            loss = loss_fn(model(train_x[idx]), train_y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()
            step += 1
        model.eval()
        correct = 0
        with torch.no_grad():
            for i in range(0, test_x.shape[0], 500):
                correct += (model(test_x[i:i + 500]).argmax(1) == test_y[i:i + 500]).sum().item()
        accuracy = correct / test_x.shape[0]
        print(f"epoch {epoch + 1}/{args.epochs}: train loss {loss_sum.item() / steps_per_epoch:.4f} "
              f"test accuracy {accuracy:.4f}", file=sys.stderr)
    final_loss = loss_sum.item() / steps_per_epoch
    print(f"summary: accuracy {100 * accuracy:.2f}% final loss {final_loss:.4f} "
          f"time {time.perf_counter() - START:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
