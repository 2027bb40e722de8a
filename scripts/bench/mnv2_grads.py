"""a diagnostic, PyTorch side: torchvision's MobileNetV2 from tandem_bench's
exchange directory, one forward/backward on batch 0 in float32 and float64 (the
gradients per parameter), then STEPS plain-SGD steps (lr 0.01) with the losses;
compares with build/apps/mnv2_grad_dump's output.

  /usr/bin/python3 scripts/bench/mnv2_grads.py IMPORT_DIR TANDEM_OUT_PREFIX [BATCH] [STEPS]

TANDEM_OUT_PREFIX: mnv2_grad_dump's OUT_DIR without the dtype, e.g. /tmp/g/tandem_
for /tmp/g/tandem_float32 and /tmp/g/tandem_float64 (missing ones are skipped), with
its stdout in /tmp/g/tandem_float32.txt etc. With --silu every ReLU6 is replaced by
SiLU (run mnv2_grad_dump with ACT=silu then).
"""
import json
import os
import sys

import numpy as np
import torch
import torchvision

torch.set_num_threads(1)


def load(import_dir):
    manifest = json.load(open(os.path.join(import_dir, "manifest.json")))
    entry = manifest["models"]["mobilenet_v2"]

    def raw(e):
        dt = {"float32": np.float32, "int64": np.int64}[e["dtype"]]
        return torch.from_numpy(np.fromfile(os.path.join(import_dir, e["file"]), dt)
                                .reshape([int(d) for d in e["shape"]]))
    state = {p["name"]: raw(p) for p in entry["params"]}
    return state, raw(entry["images"]), raw(entry["labels"])


SILU = "--silu" in sys.argv
if SILU:
    sys.argv.remove("--silu")


def run(state, images, labels, dtype, batch, steps):
    model = torchvision.models.mobilenet_v2(num_classes=10, dropout=0.0)
    model.load_state_dict(state, strict=False)
    if SILU:
        for mod in list(model.modules()):
            for name, child in list(mod.named_children()):
                if isinstance(child, torch.nn.ReLU6):
                    setattr(mod, name, torch.nn.SiLU())
    model = model.to(dtype).train()
    images = images.to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses, grads = [], None
    nb = images.shape[0] // batch
    for step in range(steps):
        b = step % nb
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(images[b * batch:(b + 1) * batch]),
                                                 labels[b * batch:(b + 1) * batch])
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters()}
        opt.step()
    return losses, grads


def rel(a, b):
    return (a - b).norm().item() / max(b.norm().item(), 1e-300)


def main():
    import_dir, prefix = sys.argv[1], sys.argv[2]
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 10
    state, images, labels = load(import_dir)
    res = {d: run(state, images, labels, getattr(torch, d), batch, steps)
           for d in ("float32", "float64")}
    # torch float32 against itself with other conv kernels (mkldnn off: its
    # native/THNN ones): the same arithmetic up to rounding.
    with torch.backends.mkldnn.flags(enabled=False):
        other32 = run(state, images, labels, torch.float32, batch, steps)[0]
    tandem = {}
    for d in ("float32", "float64"):
        path = prefix + d
        if not os.path.isdir(path):
            continue
        npd = {"float32": np.float32, "float64": np.float64}[d]
        g = {}
        for n, t in res[d][1].items():
            g[n] = torch.from_numpy(np.fromfile(os.path.join(path, n + ".grad.bin"), npd)
                                    .reshape(t.shape)).double()
        losses = []
        log = prefix + d + ".txt"
        if os.path.exists(log):
            losses = [float(l.split()[3]) for l in open(log) if l.startswith("step ")]
        tandem[d] = (losses, g)
    print("losses (step: torch32 torch64 tandem32 tandem64 | relative differences: "
          "torch32-torch64, tandem32-torch32, tandem64-torch64, torch32 mkldnn off-on)")
    for s in range(steps):
        t32, t64 = res["float32"][0][s], res["float64"][0][s]
        a32 = tandem.get("float32", ([], None))[0]
        a64 = tandem.get("float64", ([], None))[0]
        a32 = a32[s] if s < len(a32) else float("nan")
        a64 = a64[s] if s < len(a64) else float("nan")
        print(f"{s}: {t32:.9f} {t64:.12f} {a32:.9f} {a64:.12f} | "
              f"{abs(t32 - t64) / t64:.2e} {abs(a32 - t32) / t32:.2e} {abs(a64 - t64) / t64:.2e} "
              f"{abs(other32[s] - t32) / t32:.2e}")
    print("gradients, relative L2 error per tensor: torch32 vs torch64 | tandem32 vs torch64 | "
          "tandem64 vs torch64 | tandem32 vs torch32")
    worst = []
    for n, g64 in res["float64"][1].items():
        cols = [rel(res["float32"][1][n], g64)]
        cols.append(rel(tandem["float32"][1][n], g64) if "float32" in tandem else float("nan"))
        cols.append(rel(tandem["float64"][1][n], g64) if "float64" in tandem else float("nan"))
        cols.append(rel(tandem["float32"][1][n], res["float32"][1][n]) if "float32" in tandem
                    else float("nan"))
        worst.append((cols[2], n))
        print(f"{n:40s} " + " ".join(f"{c:.2e}" for c in cols))
    worst.sort(reverse=True)
    print("largest tandem64 vs torch64:", worst[:5])


if __name__ == "__main__":
    main()
