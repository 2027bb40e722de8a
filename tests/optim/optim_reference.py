#!/usr/bin/env python3
"""Reference trajectories for tests/optim/optim_test.cc.

Implements the update rules that PyTorch documents for torch.optim.SGD,
Adagrad, Adam and AdamW (single-tensor, foreach=False code paths; in-place
lerp/addcmul/addcdiv written out the way torch computes them) in pure Python
float64 -- no numpy, no torch -- and writes the parameters after each of 10
steps to optim_reference_data.h. Run from this directory:
    python3 optim_reference.py > optim_reference_data.h

Problem: f(w) = sum_i (a_i * w_i^2 + b_i * w_i) over two parameters, w1 (3
elements) and w2 (2 elements), gradient 2 * a_i * w_i + b_i.
"""
import math

A = [0.5, 1.5, 0.25, 2.0, 0.75]
B = [-1.0, 0.3, 0.8, -0.5, 0.1]
W0 = [1.4, -2.0, 0.5, 3.0, -1.5]
STEPS = 10


def grad(w):
    return [2.0 * a * x + b for a, x, b in zip(A, w, B)]


def lerp(start, end, weight):
    # torch.lerp: start + weight * (end - start)
    return start + weight * (end - start)


def sgd(lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
    w = list(W0)
    buf = None
    out = []
    for _ in range(STEPS):
        g = grad(w)
        if weight_decay != 0:
            g = [gi + weight_decay * wi for gi, wi in zip(g, w)]
        if momentum != 0:
            if buf is None:
                buf = list(g)
            else:
                buf = [momentum * bi + (1 - dampening) * gi for bi, gi in zip(buf, g)]
            if nesterov:
                g = [gi + momentum * bi for gi, bi in zip(g, buf)]
            else:
                g = list(buf)
        w = [wi - lr * gi for wi, gi in zip(w, g)]
        out.append(list(w))
    return out


def adagrad(lr, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10):
    w = list(W0)
    s = [initial_accumulator_value] * len(w)
    out = []
    for step in range(1, STEPS + 1):
        g = grad(w)
        if weight_decay != 0:
            g = [gi + weight_decay * wi for gi, wi in zip(g, w)]
        clr = lr / (1 + (step - 1) * lr_decay)
        s = [si + gi * gi for si, gi in zip(s, g)]
        std = [math.sqrt(si) + eps for si in s]
        w = [wi - clr * gi / di for wi, gi, di in zip(w, g, std)]
        out.append(list(w))
    return out


def adam(lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, decoupled=False):
    beta1, beta2 = betas
    w = list(W0)
    m = [0.0] * len(w)
    v = [0.0] * len(w)
    vmax = [0.0] * len(w)
    out = []
    for step in range(1, STEPS + 1):
        g = grad(w)
        if decoupled:
            w = [wi * (1 - lr * weight_decay) for wi in w]
        elif weight_decay != 0:
            g = [gi + weight_decay * wi for gi, wi in zip(g, w)]
        m = [lerp(mi, gi, 1 - beta1) for mi, gi in zip(m, g)]
        v = [vi * beta2 + (1 - beta2) * gi * gi for vi, gi in zip(v, g)]
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = math.sqrt(bias_correction2)
        if amsgrad:
            vmax = [max(a, b) for a, b in zip(vmax, v)]
            vhat = vmax
        else:
            vhat = v
        denom = [math.sqrt(x) / bias_correction2_sqrt + eps for x in vhat]
        w = [wi - step_size * mi / di for wi, mi, di in zip(w, m, denom)]
        out.append(list(w))
    return out


CASES = [
    ("sgd_plain", sgd(lr=0.1)),
    ("sgd_momentum", sgd(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    ("sgd_nesterov", sgd(lr=0.05, momentum=0.8, weight_decay=0.02, nesterov=True)),
    ("adagrad", adagrad(lr=0.1, lr_decay=0.05, weight_decay=0.01,
                        initial_accumulator_value=0.1, eps=1e-10)),
    ("adam", adam(lr=0.05)),
    ("adam_amsgrad_wd", adam(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1,
                             amsgrad=True)),
    ("adamw", adam(lr=0.05, weight_decay=0.1, decoupled=True)),
    ("adamw_amsgrad", adam(lr=0.02, betas=(0.85, 0.9), weight_decay=0.05, amsgrad=True,
                           decoupled=True)),
]


def fmt(values):
    return "{" + ", ".join(repr(float(x)) for x in values) + "}"


def main():
    print("// Written by tests/optim/optim_reference.py (pure Python float64); do not edit.")
    print("// Parameters after each of 10 steps on f(w) = sum(a*w^2 + b*w).")
    print("#ifndef TANDEM_TESTS_OPTIM_OPTIM_REFERENCE_DATA_H_")
    print("#define TANDEM_TESTS_OPTIM_OPTIM_REFERENCE_DATA_H_")
    print()
    print("namespace tandem::optim::reference {")
    print()
    print("inline constexpr int kSteps = %d;" % STEPS)
    print("inline constexpr int kElements = %d;  // w1: 3 elements, w2: 2" % len(W0))
    print("inline constexpr double kA[kElements] = %s;" % fmt(A))
    print("inline constexpr double kB[kElements] = %s;" % fmt(B))
    print("inline constexpr double kW0[kElements] = %s;" % fmt(W0))
    print()
    print("struct Trajectory {")
    print("  const char* name;")
    print("  double w[kSteps][kElements];")
    print("};")
    print()
    print("inline constexpr Trajectory kTrajectories[] = {")
    for name, traj in CASES:
        print('    {"%s",' % name)
        print("     {" + ",\n      ".join(fmt(row) for row in traj) + "}},")
    print("};")
    print()
    print("}  // namespace tandem::optim::reference")
    print()
    print("#endif  // TANDEM_TESTS_OPTIM_OPTIM_REFERENCE_DATA_H_")


if __name__ == "__main__":
    main()
