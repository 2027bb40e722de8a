"""where float32 MobileNetV2 gradients leave float64's. For torchvision's
MobileNetV2 on tandem_bench's exchange directory (batch 0), lists every ReLU6 whose
input falls on the other side of a kink (0 or 6) in float32 than in float64, and the
relative float32 error of the gradient at each ReLU6's input and output.

  /usr/bin/python3 scripts/bench/mnv2_relu6_flips.py IMPORT_DIR [BATCH]
"""
import os
import sys

import torch
import torchvision

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mnv2_grads import load  # noqa: E402

torch.set_num_threads(1)


def run(state, x, y, dtype):
    m = torchvision.models.mobilenet_v2(num_classes=10, dropout=0.0)
    m.load_state_dict(state, strict=False)
    m = m.to(dtype).train()
    seen = {}
    for name, mod in m.named_modules():
        if isinstance(mod, torch.nn.ReLU6):
            mod.inplace = False

            def hook(mod, inp, out, name=name):
                inp[0].retain_grad()
                out.retain_grad()
                seen[name] = (inp[0], out)
            mod.register_forward_hook(hook)
    torch.nn.functional.cross_entropy(m(x.to(dtype)), y).backward()
    return seen


def main():
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    state, images, labels = load(sys.argv[1])
    x, y = images[:batch], labels[:batch]
    a, b = run(state, x, y, torch.float32), run(state, x, y, torch.float64)

    def rel(p, q):
        return ((p.double() - q).norm() / q.norm()).item()
    print("ReLU6 | mask flips float32 vs float64 | rel err of grad at output, at input")
    for k, (i64, o64) in b.items():
        i32, o32 = a[k]
        v32, v64 = i32.detach().double(), i64.detach()
        flips = (((v32 > 0) & (v32 < 6)) != ((v64 > 0) & (v64 < 6))).nonzero().tolist()
        what = "; ".join(f"{tuple(f)}: float64 {v64[tuple(f)].item():.3e}, "
                         f"float32 {v32[tuple(f)].item():.3e}" for f in flips[:3])
        print(f"{k:22s} | {len(flips)} {what} | {rel(o32.grad, o64.grad):.2e} "
              f"{rel(i32.grad, i64.grad):.2e}")


if __name__ == "__main__":
    main()
