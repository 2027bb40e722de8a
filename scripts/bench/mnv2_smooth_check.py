"""the ReLU6 kinks as the amplifier. torchvision's MobileNetV2 from
tandem_bench's exchange directory, 10 plain-SGD steps (lr 0.01, batch 32, batches
cycled as tandem_bench does) in float32 against float64 and float32 with mkldnn off
against on, once with ReLU6 and once with every ReLU6 replaced by SiLU (smooth);
prints the relative loss differences per step.

  /usr/bin/python3 scripts/bench/mnv2_smooth_check.py IMPORT_DIR
"""
import os
import sys

import torch
import torchvision

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mnv2_grads import load  # noqa: E402

torch.set_num_threads(1)


def run(state, images, labels, dtype, act, mkldnn=True, batch=32, steps=10):
    m = torchvision.models.mobilenet_v2(num_classes=10, dropout=0.0)
    m.load_state_dict(state, strict=False)
    for mod in list(m.modules()):
        for name, child in list(mod.named_children()):
            if isinstance(child, torch.nn.ReLU6) and act is not None:
                setattr(mod, name, act())
    m = m.to(dtype).train()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    nb = images.shape[0] // batch
    losses = []
    with torch.backends.mkldnn.flags(enabled=mkldnn):
        for s in range(steps):
            b = s % nb
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(
                m(images[b * batch:(b + 1) * batch].to(dtype)), labels[b * batch:(b + 1) * batch])
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def main():
    state, images, labels = load(sys.argv[1])
    for name, act in [("ReLU6", None), ("SiLU", torch.nn.SiLU)]:
        f32 = run(state, images, labels, torch.float32, act)
        f64 = run(state, images, labels, torch.float64, act)
        off = run(state, images, labels, torch.float32, act, mkldnn=False)
        print(f"{name:5s} float32 vs float64:      " +
              " ".join(f"{abs(a - b) / b:.1e}" for a, b in zip(f32, f64)))
        print(f"{name:5s} float32 mkldnn off vs on: " +
              " ".join(f"{abs(a - b) / b:.1e}" for a, b in zip(off, f32)))


if __name__ == "__main__":
    main()
