"""the per-op check, PyTorch side: build/apps/mnv2_op_errors's table (every conv
and BatchNorm of MobileNetV2 at its real shape, float32 against float64 on the same
float32-representable inputs) for torch's own CPU kernels, as the reference for
what float32 rounding alone gives.   /usr/bin/python3 scripts/bench/mnv2_op_errors.py [N]
"""
import sys

import torch
import torch.nn.functional as F

torch.set_num_threads(1)
torch.manual_seed(14)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 32


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def run(fn, inputs, dy, dtype):
    leaves = [t.to(dtype).requires_grad_() for t in inputs]
    y = fn(*leaves)
    (y * dy.to(dtype)).sum().backward()
    return [y.detach()] + [t.grad for t in leaves]


convs = [(3, 32, 3, 2, 1, 32)]
cin, h = 32, 16
for t, c, reps, s0 in [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                       (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]:
    for i in range(reps):
        s, hidden = (s0 if i == 0 else 1), cin * t
        if t != 1:
            convs.append((cin, hidden, 1, 1, 1, h))
        convs.append((hidden, hidden, 3, s, hidden, h))
        h = (h + 2 - 3) // s + 1
        convs.append((hidden, c, 1, 1, 1, h))
        cin = c
convs.append((cin, 1280, 1, 1, 1, h))
print(f"torch conv (N={n}) in out k stride groups H | rel L2 err float32 vs float64: y dx dw")
seen, bns = set(), set()
for g in convs:
    if g in seen:
        continue
    seen.add(g)
    c, o, k, s, groups, hh = g
    pad = (k - 1) // 2
    oh = (hh + 2 * pad - k) // s + 1
    bns.add((o, oh))
    x = torch.randn(n, c, hh, hh).double()
    w = (torch.randn(o, c // groups, k, k) * (2.0 / (o * k * k)) ** 0.5).float().double()
    dy = torch.randn(n, o, oh, oh).double()
    fn = lambda x, w: F.conv2d(x, w, None, s, pad, 1, groups)
    r32, r64 = run(fn, [x, w], dy, torch.float32), run(fn, [x, w], dy, torch.float64)
    print(f"conv {c:4d} {o:4d} {k} {s} {groups:4d} {hh:2d} | "
          + " ".join(f"{rel(a, b):.2e}" for a, b in zip(r32, r64)))
print(f"torch batch_norm train (N={n}) C H | rel L2 err float32 vs float64: y dx dweight dbias")
for c, hh in sorted(bns):
    x = (torch.randn(n, c, hh, hh) * 0.5 + torch.randn(1, c, 1, 1) * 0.3).float().double()
    gw = (torch.randn(c) * 0.1 + 1).float().double()
    b = (torch.randn(c) * 0.1).double()
    dy = (torch.randn(n, c, hh, hh) * 1e-3).double()
    fn = lambda x, gw, b: F.batch_norm(x, None, None, gw, b, True, 0.1, 1e-5)
    r32, r64 = run(fn, [x, gw, b], dy, torch.float32), run(fn, [x, gw, b], dy, torch.float64)
    print(f"bn {c:4d} {hh:2d} | " + " ".join(f"{rel(a, b):.2e}" for a, b in zip(r32, r64)))
