#!/usr/bin/python3
"""The reference numbers of summary_test.cc: apps::MakeLeNet() built in PyTorch
(torch.nn.Sequential, the same layers), its parameter count and each layer's
output shape for an input of shape (2, 1, 28, 28), from forward hooks.

  /usr/bin/python3 tests/hapi/summary_reference.py
"""
import torch
from torch import nn

net = nn.Sequential(
    nn.Conv2d(1, 20, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
    nn.Conv2d(20, 20, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
    nn.Flatten(), nn.Linear(20 * 7 * 7, 10))
rows = []
for name, module in net.named_children():
    module.register_forward_hook(
        lambda m, i, o, name=name: rows.append((name, type(m).__name__, tuple(o.shape))))
net.eval()
with torch.no_grad():
    net(torch.zeros(2, 1, 28, 28))
for name, kind, shape in rows:
    params = sum(p.numel() for p in net.get_submodule(name).parameters())
    print(f"{name} {kind} {shape} {params}")
print("total", sum(p.numel() for p in net.parameters()))
print("trainable", sum(p.numel() for p in net.parameters() if p.requires_grad))
