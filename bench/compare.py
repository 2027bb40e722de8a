#!/usr/bin/env python3
"""The benchmark driver: tandem vs PyTorch on the same device, one table.

For each device of --devices (default "cpu,cuda:0"):
  1. tandem_bench --device=D --export_dir=WORK/D --json=WORK/D/tandem.json ...
     (times every cell and writes the initial weights, the data and its first
     10 losses to the exchange directory);
  2. torch_bench.py --import_dir=WORK/D --device=D --json=WORK/D/torch.json ...
     with the same models, batches, optimizers, steps, repetitions and threads
     (eager, torch.compile, torch.compile(mode="reduce-overhead"));
  3. compares the first 10 losses of every cell and mode with tandem's (only the
     first for FIRST_LOSS_ONLY models, see there) and FAILS
     (exit 1, every mismatch printed) when they disagree beyond the tolerance
     |torch - tandem| <= rtol * |tandem| + 1e-5, rtol (see tolerance()):
       float32 eager: SGD 1e-4, Adam 1e-3; torch.compile modes 1e-3;
       --tf32: 2e-2 (10-bit mantissa products); --bf16: 1e-2 (see tolerance());
  4. prints one table: cell, tandem us/step, torch eager / compile /
     reduce-overhead us/step, and the ratios torch time / tandem time (> 1: tandem
     is faster); on CUDA also the MLP graph target (CUDA-graph node count x the
     per-node replay cost measured on the same GPU + 5 us) where tandem ran with
     --cuda_graph. A copy goes to OUT/compare.md and OUT/compare.json.

A device that cannot be used (no GPU seen by tandem_bench or by torch) is not
run: its rows say "not measured" and the note names every figure left
unmeasured. Nothing is estimated in their place.

    python3 bench/compare.py --devices=cpu --threads=1 --out=/tmp/bench
    PRESET=default scripts/bench.sh steps --devices=cuda:0 --tf32   # picks the Python with torch

Standard library only (torch is used by torch_bench.py, run as a subprocess
with --python). Exit status: 0 ok, 1 a failure or a loss mismatch, 2 bad argument.
"""

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODES = ("eager", "compile", "reduce-overhead")
GRAPH_TARGET_OVERHEAD_US = 5.0


def fail(message, status=1):
    print(f"compare: error: {message}", file=sys.stderr)
    sys.exit(status)


def find_bench(explicit):
    if explicit:
        if not os.access(explicit, os.X_OK):
            fail(f"--bench={explicit}: not an executable file", 2)
        return explicit
    # The CMakePresets.json folders: cpu, default, gpu.
    for rel in ("build-cpu/bench/tandem_bench", "build/bench/tandem_bench",
                "build-gpu/bench/tandem_bench"):
        path = os.path.join(ROOT, rel)
        if os.access(path, os.X_OK):
            return path
    fail("no tandem_bench found in build-cpu/bench, build/bench or build-gpu/bench: build it "
         "(scripts/bench.sh steps does) or pass --bench", 2)


def python_has_torch(python):
    try:
        out = subprocess.run([python, "-c", "import torch, json; print(json.dumps({"
                              "'version': torch.__version__, "
                              "'cuda_devices': torch.cuda.device_count() if "
                              "torch.cuda.is_available() else 0, "
                              "'compile': hasattr(torch, 'compile')}))"],
                             capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def find_python(explicit):
    candidates = [explicit] if explicit else [os.environ.get("PYTHON"), sys.executable,
                                              "/usr/bin/python3", "python3"]
    for python in candidates:
        if not python:
            continue
        info = python_has_torch(python)
        if info is not None:
            return python, info
    if explicit:
        fail(f"--python={explicit}: cannot import torch with it", 2)
    return None, None


def run(cmd, what):
    print(f"compare: {what}: {' '.join(shlex.quote(c) for c in cmd)}", file=sys.stderr,
          flush=True)
    proc = subprocess.run(cmd)
    if proc.returncode != 0:
        fail(f"{what} failed with exit status {proc.returncode}")


def cell_key(c):
    return (c["model"], int(c["batch"]), c["optimizer"])


def tolerance(mode, optimizer, tf32, bf16=False):
    """(relative, absolute) tolerance of the first losses.

    float32 SGD, eager: 1e-4. Adam: 1e-3, because its first update is
    lr * g / (|g| + eps), about lr * sign(g): a gradient element that is zero up
    to rounding moves by +-lr depending on the summation order, and the two sides
    sum in different orders (measured on the CPU: SGD agrees to ~1e-7 in every
    cell, Adam at batch 512 drifts to ~3e-4 by step 8). torch.compile modes:
    at least 1e-3 (fused, reordered kernels). TF32: 2e-2. bf16 autocast: 1e-2:
    both sides round every GEMM/conv output to bfloat16 (8 mantissa bits), and
    where their float32 sums differ in the last bits the two roundings land one
    bfloat16 ulp (0.4-0.8%) apart on single activations; averaged over a batch the
    loss moves far less (measured on the CPU against torch 1.13's CPU autocast: at
    most 3.1e-4 over 120 losses, docs/benchmarks.md).
    """
    if bf16:
        return 1e-2, 1e-4
    if tf32:
        return 2e-2, 1e-4
    rtol = 1e-3 if optimizer == "adam" else 1e-4
    if mode != "eager":
        rtol = max(rtol, 1e-3)
    return rtol, 1e-5


# Models whose float32 training trajectories part after the first step in any two
# implementations (PyTorch with mkldnn on vs off too): MobileNetV2's ReLU6 kinks turn
# one rounding-level flip into a 1e-2 gradient change (docs/benchmarks.md). Only the
# first loss is compared for them; in float64 MobileNetV2's gradients agree with
# torchvision's (docs/benchmarks.md), and tests/apps/models_test.cc checks its outputs.
# ResNets likewise: BatchNorm in training mode over few values per channel and ReLU
# inputs within rounding of zero (tests/apps/resnet_gpu_test.cc measured float32
# training-mode gradients differing by 3% / 17% of the largest between two correct
# implementations; that test checks them in float64).
FIRST_LOSS_ONLY = {"mobilenet_v2", "resnet18", "resnet50", "resnet50_imagenet"}


def compare_losses(tandem_cells, torch_cells, tf32, bf16=False):
    """Mismatch messages (empty when every compared loss agrees) and a count."""
    mismatches, compared = [], 0
    ours = {cell_key(c): c for c in tandem_cells}
    for c in torch_cells:
        if c.get("skipped"):
            continue
        ref = ours.get(cell_key(c))
        if ref is None:
            mismatches.append(f"{cell_key(c)} {c['mode']}: no tandem cell to compare with")
            continue
        rtol, atol = tolerance(c["mode"], c["optimizer"], tf32, bf16)
        a, b = ref["losses"], c["losses"]
        if c["model"] in FIRST_LOSS_ONLY:
            a, b = a[:1], b[:1]
        if len(a) != len(b):
            mismatches.append(f"{cell_key(c)} {c['mode']}: {len(a)} tandem losses, {len(b)} torch")
            continue
        for i, (x, y) in enumerate(zip(a, b)):
            compared += 1
            if x is None or y is None or abs(x - y) > rtol * abs(x) + atol:
                mismatches.append(
                    f"{c['model']} batch {c['batch']} {c['optimizer']} {c['mode']} step {i}: "
                    f"tandem {x!r} vs torch {y!r} (tolerance {rtol:g} rel + {atol:g} abs)")
    return mismatches, compared


def max_rel_diff(tandem_cells, torch_cells):
    """Largest relative loss difference per optimizer over the eager cells."""
    ours = {cell_key(c): c for c in tandem_cells}
    out = {}
    for c in torch_cells:
        ref = ours.get(cell_key(c))
        if c.get("skipped") or c["mode"] != "eager" or ref is None:
            continue
        for x, y in zip(ref["losses"], c["losses"]):
            if x is not None and y is not None and x != 0:
                out[c["optimizer"]] = max(out.get(c["optimizer"], 0.0), abs(x - y) / abs(x))
    return out


def fmt_us(v):
    if v is None:
        return "-"
    return f"{v:,.1f}" if v < 1e5 else f"{v:,.0f}"


def fmt_ratio(t, ours):
    if t is None or ours is None:
        return "-"
    return f"{t / ours:.2f}"


def build_rows(device, cells_by_key, torch_by_key, node_cost, unmeasured_reason,
               graph_by_key=None):
    rows = []
    for key in cells_by_key:
        model, batch, opt = key
        ours = cells_by_key[key]
        row = {"model": model, "batch": batch, "optimizer": opt, "device": device,
               "tandem_us": None, "graph": False, "graph_nodes": None}
        if unmeasured_reason:
            row["not_measured"] = unmeasured_reason
            rows.append(row)
            continue
        row["tandem_us"] = ours["median_us_per_step"]
        graphed = (graph_by_key or {}).get(key)
        if graphed is not None:
            row["graph"] = True
            row["tandem_graph_us"] = graphed["median_us_per_step"]
            row["graph_nodes"] = graphed.get("graph_nodes")
        for mode in MODES:
            t = torch_by_key.get((key, mode))
            if t is None:
                row[mode] = {"skipped": "not run (not in --modes)"}
            elif t.get("skipped"):
                row[mode] = {"skipped": t["skipped"]}
            else:
                row[mode] = {"us": t["median_us_per_step"],
                             "ratio": t["median_us_per_step"] / row["tandem_us"]}
                if "tandem_graph_us" in row:
                    row[mode]["ratio_vs_graph"] = t["median_us_per_step"] / row["tandem_graph_us"]
        if device.startswith("cuda") and model == "mlp":
            if node_cost is None or node_cost.get("skipped"):
                row["graph_target"] = {"n/a": "no per-node replay cost measured"}
            elif not row["graph_nodes"]:
                row["graph_target"] = {"n/a": "tandem ran without --cuda_graph (node count "
                                              "unknown)"}
            else:
                target = row["graph_nodes"] * node_cost["per_node_us"] + GRAPH_TARGET_OVERHEAD_US
                row["graph_target"] = {"target_us": target,
                                       "measured_over_target": row["tandem_graph_us"] / target}
        else:
            row["graph_target"] = {"n/a": "GPU only" if device == "cpu" else "MLP only"}
        rows.append(row)
    return rows


def markdown(rows, notes, header):
    lines = [header, "",
             "| model | batch | optim | device | tandem us/step | tandem graph us/step "
             "| torch eager | torch compile | torch reduce-overhead | eager / tandem "
             "| compile / tandem | r-o / tandem | r-o / tandem graph | MLP graph target |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    reasons = []

    def mark(reason):
        if reason not in reasons:
            reasons.append(reason)
        return f"skipped [{reasons.index(reason) + 1}]"

    for r in rows:
        if "not_measured" in r:
            cells = ["not measured"] * 10
        else:
            cells = [fmt_us(r["tandem_us"]),
                     fmt_us(r["tandem_graph_us"]) if "tandem_graph_us" in r else "-"]
            ratios = []
            for mode in MODES:
                m = r[mode]
                if "skipped" in m:
                    cells.append(mark(m["skipped"]))
                    ratios.append("-")
                else:
                    cells.append(fmt_us(m["us"]))
                    ratios.append(f"{m['ratio']:.2f}")
            cells += ratios
            ro = r["reduce-overhead"]
            cells.append(f"{ro['ratio_vs_graph']:.2f}" if "ratio_vs_graph" in ro else "-")
            g = r["graph_target"]
            if "target_us" in g:
                cells.append(f"{g['target_us']:.1f} us ({r['graph_nodes']} nodes; measured / "
                             f"target {g['measured_over_target']:.2f})")
            else:
                cells.append(f"n/a ({g['n/a']})")
        lines.append(f"| {r['model']} | {r['batch']} | {r['optimizer']} | {r['device']} | "
                     + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Times are medians of the repetitions, in microseconds per training step; "
                 "ratios are torch time / tandem time (> 1: tandem is faster).")
    for i, reason in enumerate(reasons):
        lines.append(f"[{i + 1}] {reason}")
    for note in notes:
        lines.append("")
        lines.append(f"**Note:** {note}")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="cpu,cuda:0", help="comma-separated: cpu, cuda:N")
    ap.add_argument("--bench", default="", help="tandem_bench binary (default: found under "
                                                "build*/apps)")
    ap.add_argument("--python", default="", help="Python with torch (default: $PYTHON, this "
                                                 "Python, /usr/bin/python3, python3)")
    ap.add_argument("--models", default="mlp,lenet,convnet")
    ap.add_argument("--batch_sizes", default="32,128,512")
    ap.add_argument("--optimizers", default="sgd,adam")
    ap.add_argument("--modes", default="eager,compile,reduce-overhead")
    ap.add_argument("--warmup_steps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repetitions", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0,
                    help="CPU threads for both sides (tandem: OpenBLAS; torch: "
                         "set_num_threads and OPENBLAS_NUM_THREADS); 0 leaves each side's "
                         "default")
    ap.add_argument("--tf32", action="store_true")
    ap.add_argument("--bf16", action="store_true",
                    help="bfloat16 mixed precision on both sides (tandem: nn::AutocastGuard; "
                         "torch: torch.autocast)")
    ap.add_argument("--cuda_graph", action="store_true",
                    help="on CUDA devices also run tandem_bench --cuda_graph (same weights and "
                         "data, losses checked too): the 'tandem graph' column and the MLP "
                         "graph target")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data_batches", type=int, default=10,
                    help="batches of synthetic data per model (tandem_bench --data_batches; "
                         "torch reads it from the exchange): fewer for large inputs")
    ap.add_argument("--torch_channels_last", action="store_true",
                    help="the torch side in channels_last memory format (torch_bench.py "
                         "--channels_last): PyTorch's fastest layout for convolutions on "
                         "tensor cores; tandem keeps NCHW")
    ap.add_argument("--compare_only", action="store_true",
                    help="run nothing: re-read the reports an earlier run left in --work_dir "
                         "and redo the loss check and the table")
    ap.add_argument("--work_dir", default="", help="exchange directories and raw reports "
                                                   "(default OUT/work)")
    ap.add_argument("--out", default="bench-out", help="folder for compare.md / compare.json")
    args = ap.parse_args(argv)
    args.devices = [d for d in args.devices.split(",") if d]
    for d in args.devices:
        if not (d == "cpu" or d == "cuda" or (d.startswith("cuda:") and d[5:].isdigit())):
            fail(f"--devices: {d!r} is not cpu, cuda or cuda:N", 2)
    args.devices = ["cuda:0" if d == "cuda" else d for d in args.devices]
    for flag in ("warmup_steps", "steps", "repetitions", "threads", "data_batches"):
        v = getattr(args, flag)
        low = {"warmup_steps": 0, "steps": 1, "repetitions": 5, "threads": 0,
               "data_batches": 1}[flag]
        if v < low:
            fail(f"--{flag}={v}: must be >= {low}", 2)
    return args


def main(argv):
    args = parse_args(argv)
    bench = find_bench(args.bench)
    python, torch_info = find_python(args.python)
    if python is None:
        fail("no Python with torch found ($PYTHON, this Python, /usr/bin/python3, python3): "
             "pass --python", 2)
    probe = subprocess.run([bench, "--list_devices"], capture_output=True, text=True)
    if probe.returncode != 0:
        fail(f"{bench} --list_devices failed: {probe.stderr.strip()}")
    tandem_info = json.loads(probe.stdout)
    out = os.path.abspath(args.out)
    work = os.path.abspath(args.work_dir or os.path.join(out, "work"))
    os.makedirs(work, exist_ok=True)
    common = [f"--models={args.models}", f"--batch_sizes={args.batch_sizes}",
              f"--optimizers={args.optimizers}", f"--warmup_steps={args.warmup_steps}",
              f"--steps={args.steps}", f"--repetitions={args.repetitions}",
              f"--threads={args.threads}"] + (["--tf32"] if args.tf32 else []) \
        + (["--bf16"] if args.bf16 else [])
    keys = [(m, int(b), o) for m in args.models.split(",") if m
            for b in args.batch_sizes.split(",") if b for o in args.optimizers.split(",") if o]

    all_rows, notes, reports, all_mismatches = [], [], {}, []
    for device in args.devices:
        reason = None
        if device.startswith("cuda"):
            index = int(device.split(":")[1])
            if tandem_info["cuda_devices"] <= index:
                reason = (f"tandem_bench sees {tandem_info['cuda_devices']} CUDA device(s)"
                          + ("" if tandem_info["cuda_built"] else " (built without CUDA)"))
            elif torch_info["cuda_devices"] <= index:
                reason = (f"torch {torch_info['version']} ({python}) sees "
                          f"{torch_info['cuda_devices']} CUDA device(s)")
        if reason:
            all_rows += build_rows(device, {k: None for k in keys}, {}, None, reason)
            notes.append(
                f"{device} was not used: {reason}. These GPU figures remain UNMEASURED: tandem "
                f"us/step, torch eager / compile / reduce-overhead us/step, their ratios and "
                f"the MLP graph-replay target, for all {len(keys)} cells ({args.models} x "
                f"batch {args.batch_sizes} x {args.optimizers}"
                f"{', TF32' if args.tf32 else ''}{', bf16' if args.bf16 else ''}). Nothing is "
                f"estimated in their place.")
            continue
        exchange = os.path.join(work, device.replace(":", ""))
        os.makedirs(exchange, exist_ok=True)
        tandem_json = os.path.join(exchange, "tandem.json")
        torch_json = os.path.join(exchange, "torch.json")
        if not args.compare_only:
            run([bench, f"--device={device}", f"--export_dir={exchange}",
                 f"--json={tandem_json}", f"--seed={args.seed}",
                 f"--data_batches={args.data_batches}"] + common,
                f"tandem on {device}")
        graph_json = None
        if args.cuda_graph and device.startswith("cuda") and args.compare_only:
            graph_json = os.path.join(exchange, "tandem_graph.json")
        elif args.cuda_graph and device.startswith("cuda"):
            # The same cells from the same weights and data, the step replayed as a CUDA graph.
            graph_json = os.path.join(exchange, "tandem_graph.json")
            run([bench, f"--device={device}", f"--import_dir={exchange}", f"--json={graph_json}",
                 "--cuda_graph", f"--data_batches={args.data_batches}"] + common,
                f"tandem with CUDA graph on {device}")
        if not args.compare_only:
            run([python, os.path.join(HERE, "torch_bench.py"), f"--import_dir={exchange}",
                 f"--device={device}", f"--json={torch_json}", f"--modes={args.modes}"] + common
                + (["--graph_node_cost"] if device.startswith("cuda") else [])
                + (["--channels_last"] if args.torch_channels_last else []),
                f"torch on {device}")
        with open(tandem_json) as f:
            ours = json.load(f)
        with open(torch_json) as f:
            theirs = json.load(f)
        reports[device] = {"tandem": ours, "torch": theirs}
        mismatches, compared = compare_losses(ours["cells"], theirs["cells"], args.tf32, args.bf16)
        graph_by_key = {}
        if graph_json:
            with open(graph_json) as f:
                graphed = json.load(f)
            reports[device]["tandem_graph"] = graphed
            graph_by_key = {cell_key(c): c for c in graphed["cells"]}
            # The replayed steps must reproduce the eager losses of the PyTorch side.
            as_torch = [dict(c, mode="eager") for c in theirs["cells"]
                        if c["mode"] == "eager" and not c.get("skipped")]
            more, n = compare_losses(graphed["cells"], as_torch, args.tf32, args.bf16)
            mismatches += [f"tandem CUDA graph vs torch eager: {m}" for m in more]
            compared += n
        all_mismatches += [f"{device}: {m}" for m in mismatches]
        notes.append(f"{device}: first {ours['config']['loss_steps']} losses compared for every "
                     f"cell and torch mode that ran ({compared} values): "
                     + ("all agree" if not mismatches else f"{len(mismatches)} DISAGREE")
                     + f" (relative tolerance {'1e-2 (bf16)' if args.bf16 else '2e-2 (TF32)' if args.tf32 else 'SGD 1e-4, Adam 1e-3, compiled modes 1e-3'};"
                     f" largest eager difference: "
                     + ", ".join(f"{o} {v:.1e}" for o, v in
                                 sorted(max_rel_diff(ours["cells"], theirs["cells"]).items()))
                     + f"). Threads: tandem OpenBLAS {ours['config']['threads']}, torch "
                     f"{theirs['config']['threads']}. torch {theirs['machine']['torch']}.")
        by_key = {cell_key(c): c for c in ours["cells"]}
        torch_by_key = {(cell_key(c), c["mode"]): c for c in theirs["cells"]}
        node_cost = theirs.get("graph_node_cost")
        if node_cost and not node_cost.get("skipped"):
            notes.append(f"{device}: CUDA graph replay costs {node_cost['per_node_us']:.3f} us "
                         f"per node ({node_cost['method']}).")
        all_rows += build_rows(device, by_key, torch_by_key, node_cost, None, graph_by_key)

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = (f"tandem vs PyTorch, {stamp}: warm-up {args.warmup_steps} + {args.steps} timed "
              f"steps x {args.repetitions} repetitions, threads {args.threads or 'default'}, "
              f"tf32 {'on' if args.tf32 else 'off'}, bf16 {'autocast' if args.bf16 else 'off'}")
    md = markdown(all_rows, notes, header)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "compare.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out, "compare.json"), "w") as f:
        json.dump({"schema": "tandem-bench-compare/1", "date_utc": stamp,
                   "command": [sys.executable] + [os.path.abspath(__file__)] + argv,
                   "rows": all_rows, "notes": notes, "loss_mismatches": all_mismatches,
                   "reports": reports}, f, indent=1)
    print(md)
    print(f"compare: wrote {out}/compare.md and {out}/compare.json", file=sys.stderr)
    if all_mismatches:
        print(f"compare: LOSS MISMATCH: {len(all_mismatches)} losses disagree beyond the "
              "tolerance: the two sides did not do the same work:", file=sys.stderr)
        for m in all_mismatches:
            print(f"  {m}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
