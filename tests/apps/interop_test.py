"""Weights between tandem and PyTorch through safetensors files (ctest runs it
through interop_test.sh, which finds a Python that imports torch and fails
without one).

  interop_test.py lenet --train_mnist=BIN --tool=BIN --data_dir=DIR --work_dir=DIR
      A LeNet trained briefly by train_mnist (--save_safetensors) loads into the
      equivalent torch.nn model: the same test accuracy (+-0.05 points) as
      `train_mnist --init_from=... --epochs=0` reports, and the same logits on
      the whole test set (max |difference| <= 1e-5) as tandem computes from the
      file; the file loaded and saved again by tandem holds the same bytes.
  interop_test.py torchvision --tool=BIN --work_dir=DIR
      torchvision's MobileNetV2, ResNet-18 and ResNet-50 (and ResNet-18 with the
      CIFAR stem), saved from PyTorch with non-trivial BatchNorm statistics, load
      strictly into apps::MakeMobileNetV2 / MakeResNet18 / MakeResNet50 and give
      PyTorch's outputs in eval mode; models saved by tandem load strictly into
      torchvision's.
The safetensors reader and writer on this side are tests/nn/safetensors_torch.py.
"""
import argparse
import gzip
import os
import re
import subprocess
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "nn"))
import safetensors_torch  # noqa: E402

torch.set_num_threads(2)


def run(cmd):
    print("+", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(done.stdout, flush=True)
    if done.returncode != 0:
        raise SystemExit(f"FAIL: {cmd[0]} exited {done.returncode}")
    return done.stdout


def check(ok, message):
    if not ok:
        raise SystemExit("FAIL: " + message)
    print("ok: " + message, flush=True)


def read_idx(path):
    with gzip.open(path, "rb") as f:
        raw = f.read()
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def torch_lenet():
    """apps::MakeLeNet as torch.nn.Sequential (the same child names "0".."7")."""
    n = torch.nn
    return n.Sequential(n.Conv2d(1, 20, 5, padding=2), n.ReLU(), n.MaxPool2d(2),
                        n.Conv2d(20, 20, 5, padding=2), n.ReLU(), n.MaxPool2d(2),
                        n.Flatten(), n.Linear(20 * 7 * 7, 10))


def lenet(args):
    w = os.path.join(args.work_dir, "lenet.safetensors")
    copy = os.path.join(args.work_dir, "lenet_again.safetensors")
    run([args.train_mnist, "--gpus=cpu", "--nprocs=2", "--epochs=1", "--train_limit=6000",
         "--batch_size=32", "--seed=3", f"--data_dir={args.data_dir}", f"--save_safetensors={w}"])
    out = run([args.train_mnist, "--gpus=cpu", "--nprocs=1", "--epochs=0", f"--init_from={w}",
               f"--data_dir={args.data_dir}", f"--save_safetensors={copy}"])
    found = re.search(r"test accuracy ([0-9.]+)% on (\d+) examples", out)
    check(found is not None, "train_mnist --epochs=0 reports the test accuracy")
    tandem_accuracy = float(found.group(1))

    state, metadata = safetensors_torch.load(w)
    check(metadata.get("format") == "pt" and metadata.get("program") == "train_mnist",
          f"metadata {metadata}")
    again, _ = safetensors_torch.load(copy)
    check(list(again) == list(state) and all(torch.equal(again[k], state[k]) for k in state),
          "tandem -> file -> tandem -> file: the same tensors, bit for bit")
    model = torch_lenet()
    model.load_state_dict(state, strict=True)
    model.eval()

    images = read_idx(os.path.join(args.data_dir, "t10k-images-idx3-ubyte.gz"))
    labels = torch.from_numpy(read_idx(os.path.join(args.data_dir, "t10k-labels-idx1-ubyte.gz"))
                              .astype(np.int64))
    # train_mnist's normalisation, in float64 then rounded once, as tandem does it.
    a, b = (1.0 / 255) / 0.3530, -0.2860 / 0.3530
    x = torch.from_numpy((images.astype(np.float64) * a + b).astype(np.float32)).unsqueeze(1)
    inputs = os.path.join(args.work_dir, "test_images.safetensors")
    safetensors_torch.save(inputs, {"input": x})
    logits_file = os.path.join(args.work_dir, "tandem_logits.safetensors")
    run([args.tool, "eval", "lenet", w, inputs, logits_file])
    tandem_logits = safetensors_torch.load(logits_file)[0]["output"]
    with torch.no_grad():
        torch_logits = model(x)
    diff = (torch_logits - tandem_logits).abs().max().item()
    torch_accuracy = 100.0 * (torch_logits.argmax(1) == labels).double().mean().item()
    tandem_file_accuracy = 100.0 * (tandem_logits.argmax(1) == labels).double().mean().item()
    print(f"LeNet on {len(labels)} test images: tandem reports {tandem_accuracy:.2f}%, torch "
          f"{torch_accuracy:.4f}% (tandem's logits: {tandem_file_accuracy:.4f}%); max |logit "
          f"difference| {diff:.3g}")
    check(diff <= 1e-5, f"logits agree: max |difference| {diff:.3g} <= 1e-5")
    check(abs(torch_accuracy - tandem_accuracy) <= 0.05,
          f"accuracy agrees: torch {torch_accuracy:.2f}% vs tandem {tandem_accuracy:.2f}%")


def randomise_batch_norms(model, generator):
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                c = m.num_features
                m.weight.copy_(0.5 + torch.rand(c, generator=generator))
                m.bias.copy_(0.1 * torch.randn(c, generator=generator))
                m.running_mean.copy_(0.1 * torch.randn(c, generator=generator))
                m.running_var.copy_(0.5 + torch.rand(c, generator=generator))
                m.num_batches_tracked.fill_(7)


def torchvision_model(spec):
    import torchvision
    name, _, classes = spec.partition(":")
    base = name.replace("_cifar", "")
    model = getattr(torchvision.models, base)(num_classes=int(classes or 10))
    if name.endswith("_cifar"):
        model.conv1 = torch.nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
        model.maxpool = torch.nn.Identity()
    return model


def compare(spec, model, x, weights, args, tol):
    inputs = os.path.join(args.work_dir, "input.safetensors")
    out = os.path.join(args.work_dir, "output.safetensors")
    safetensors_torch.save(inputs, {"input": x})
    run([args.tool, "eval", spec, weights, inputs, out])
    tandem_y = safetensors_torch.load(out)[0]["output"]
    with torch.no_grad():
        torch_y = model(x)
    scale = torch_y.abs().max().item()
    diff = (torch_y - tandem_y).abs().max().item()
    check(scale > 0 and diff <= tol * scale,
          f"{spec}: eval outputs agree, max |difference| {diff:.3g} (outputs up to {scale:.3g})")


def torchvision_case(args):
    generator = torch.Generator().manual_seed(5)
    # spec, input side: 32 for the CIFAR stem and MobileNetV2 (as train_cifar10
    # feeds them), 64 for the ImageNet stem (layer4 at 2x2).
    cases = [("mobilenet_v2", 32), ("resnet18:1000", 64), ("resnet18_cifar:10", 32),
             ("resnet50:1000", 64)]
    for spec, side in cases:
        torch.manual_seed(11)
        model = torchvision_model(spec)
        randomise_batch_norms(model, generator)
        model.eval()
        weights = os.path.join(args.work_dir, spec.replace(":", "_") + ".safetensors")
        safetensors_torch.save(weights, model.state_dict(), {"format": "pt"})
        x = torch.randn(4, 3, side, side, generator=generator)
        compare(spec, model, x, weights, args, 1e-4)
    # tandem -> torch: tandem's own initialisation, loaded strictly by torchvision.
    for spec in ("mobilenet_v2", "resnet18_cifar:10"):
        weights = os.path.join(args.work_dir, "tandem_" + spec.replace(":", "_") + ".safetensors")
        run([args.tool, "save", spec, "9", weights])
        model = torchvision_model(spec)
        state, _ = safetensors_torch.load(weights)
        model.load_state_dict(state, strict=True)
        check(True, f"{spec}: tandem's file loads strictly into torchvision's model "
                    f"({len(state)} tensors)")
        model.eval()
        compare(spec, model, torch.randn(2, 3, 32, 32, generator=generator), weights, args, 1e-4)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=["lenet", "torchvision"])
    parser.add_argument("--train_mnist")
    parser.add_argument("--tool", required=True)
    parser.add_argument("--data_dir", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--work_dir", required=True)
    args = parser.parse_args()
    os.makedirs(args.work_dir, exist_ok=True)
    print(f"python {sys.executable}, torch {torch.__version__}", flush=True)
    if args.case == "lenet":
        lenet(args)
    else:
        torchvision_case(args)
    print("PASS")


if __name__ == "__main__":
    main()
