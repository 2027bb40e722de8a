#!/usr/bin/env python3
"""Smoke test of the benchmark harness (ctest tandem_bench_smoke, label bench_smoke).

    smoke_test.py TANDEM_BENCH WORK_DIR [HOST_COST_BENCH]

1. tandem_bench on the CPU, MLP, batches 4 and 8, SGD and Adam, tiny steps, with
   --json and --export_dir: the report must parse and hold 4 complete cells
   (10 finite losses, 5 positive repetition times, median within [min, max],
   samples/s = batch / median), and the manifest must describe files of the
   right sizes.
2. The same cells again with --import_dir (weights and data read back): the
   first losses must be bit-identical (same weights, same data, same CPU code).
3. A bad flag value or an unknown flag exits 2 with a message naming the flag.
3b. The ImageNet-shaped ResNet-50 (resnet50_imagenet: 1000 classes, 3x224x224) runs
   one cell at batch 1 with --data_batches=1: its first loss is near ln(1000) and
   the exchange holds one 224x224 image per data batch with labels in [0, 1000).
4. compare.py's loss check flags a perturbed loss and accepts an equal one.
5. With HOST_COST_BENCH: its CPU rows, every case, a few iterations: each prints
   one complete line (positive host and wall times, medians of the repetitions)
   that bench/host_cost.py parses; a cuda:0 row runs or skips with a reason;
   host_cost.py's table has a row per case; an unknown case exits 2.
Standard library only (no torch needed). Exit 0 on success, 1 with a message.
"""

import json
import math
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def check(cond, message):
    if not cond:
        print(f"bench smoke: FAILED: {message}", file=sys.stderr)
        sys.exit(1)


def run(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def main(bench, work):
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    common = ["--device=cpu", "--models=mlp", "--batch_sizes=4,8", "--optimizers=sgd,adam",
              "--warmup_steps=1", "--steps=2", "--repetitions=5", "--threads=1"]
    report_path = os.path.join(work, "tandem.json")
    exchange = os.path.join(work, "exchange")
    rc, out = run([bench, f"--json={report_path}", f"--export_dir={exchange}"] + common)
    check(rc == 0, f"tandem_bench exited {rc}:\n{out}")
    with open(report_path) as f:
        report = json.load(f)
    check(report["schema"] == "tandem-bench/1", f"schema {report.get('schema')!r}")
    check(report["config"]["threads"] == 1, f"threads {report['config']['threads']}")
    for key in ("cpu_model", "logical_cpus", "openblas_config"):
        check(key in report["machine"], f"machine info lacks {key}")
    cells = report["cells"]
    check(len(cells) == 4, f"{len(cells)} cells, want 4")
    check(sorted((c["batch"], c["optimizer"]) for c in cells)
          == [(4, "adam"), (4, "sgd"), (8, "adam"), (8, "sgd")], "cell keys")
    for c in cells:
        name = f"{c['model']} batch {c['batch']} {c['optimizer']}"
        check(len(c["losses"]) == 10 and all(math.isfinite(v) for v in c["losses"]),
              f"{name}: losses {c['losses']}")
        # Untrained 10-class cross-entropy is near ln(10) = 2.30.
        check(1.0 < c["losses"][0] < 4.0, f"{name}: first loss {c['losses'][0]}")
        reps = c["rep_us_per_step"]
        check(len(reps) == 5 and all(v > 0 for v in reps), f"{name}: repetitions {reps}")
        check(c["min_us_per_step"] <= c["median_us_per_step"] <= c["max_us_per_step"],
              f"{name}: median outside [min, max]")
        check(sorted(reps)[2] == c["median_us_per_step"], f"{name}: median of {reps}")
        check(abs(c["samples_per_s"] - c["batch"] * 1e6 / c["median_us_per_step"])
              <= 1e-6 * c["samples_per_s"], f"{name}: samples/s")
    # SGD and Adam start from the same weights and data: the same first loss.
    firsts = {round(c["losses"][0], 6) for c in cells if c["batch"] == 4}
    check(len(firsts) == 1, f"batch 4 cells start from different losses {firsts}")

    with open(os.path.join(exchange, "manifest.json")) as f:
        manifest = json.load(f)
    mlp = manifest["models"]["mlp"]
    check([p["name"] for p in mlp["params"]] == ["1.weight", "1.bias", "3.weight", "3.bias"],
          f"params {[p['name'] for p in mlp['params']]}")
    sizes = {"float32": 4, "int64": 8}
    for entry in mlp["params"] + [mlp["images"], mlp["labels"]]:
        numel = 1
        for d in entry["shape"]:
            numel *= d
        path = os.path.join(exchange, entry["file"])
        check(os.path.getsize(path) == numel * sizes[entry["dtype"]],
              f"{path}: {os.path.getsize(path)} bytes for {entry['dtype']} {entry['shape']}")
    check(mlp["images"]["shape"] == [80, 1, 28, 28], f"images {mlp['images']['shape']}")
    check(len(manifest["losses"]) == 4, "manifest losses")

    again_path = os.path.join(work, "imported.json")
    rc, out = run([bench, f"--json={again_path}", f"--import_dir={exchange}"] + common)
    check(rc == 0, f"tandem_bench --import_dir exited {rc}:\n{out}")
    with open(again_path) as f:
        again = json.load(f)
    for a, b in zip(cells, again["cells"]):
        check(a["losses"] == b["losses"],
              f"imported weights give other losses: {a['losses']} vs {b['losses']}")

    rc, out = run([bench, "--batch_sizes=4,-1"] + common[:1])
    check(rc == 2 and "--batch_sizes" in out, f"bad --batch_sizes: exit {rc}, {out!r}")
    rc, out = run([bench, "--batch_size=4"] + common[:1])
    check(rc == 2 and "unknown flag --batch_size" in out, f"unknown flag: exit {rc}, {out!r}")
    rc, out = run([bench, "--data_batches=0"] + common[:1])
    check(rc == 2 and "--data_batches=0" in out, f"bad --data_batches: exit {rc}, {out!r}")

    imagenet = os.path.join(work, "imagenet")
    imagenet_json = os.path.join(work, "imagenet.json")
    rc, out = run([bench, "--device=cpu", "--models=resnet50_imagenet", "--batch_sizes=1",
                   "--optimizers=sgd", "--warmup_steps=0", "--steps=1", "--repetitions=5",
                   "--data_batches=1", f"--json={imagenet_json}", f"--export_dir={imagenet}"])
    check(rc == 0, f"tandem_bench resnet50_imagenet exited {rc}:\n{out}")
    with open(imagenet_json) as f:
        cell = json.load(f)["cells"][0]
    # Untrained 1000-class cross-entropy is near ln(1000) = 6.91.
    check(cell["model"] == "resnet50_imagenet" and 5.0 < cell["losses"][0] < 9.0,
          f"resnet50_imagenet first loss {cell['losses'][0]}")
    with open(os.path.join(imagenet, "manifest.json")) as f:
        manifest = json.load(f)
    entry = manifest["models"]["resnet50_imagenet"]
    check(manifest["data_batches"] == 1 and entry["images"]["shape"] == [1, 3, 224, 224],
          f"data_batches {manifest['data_batches']}, images {entry['images']['shape']}")
    fc = [p["shape"] for p in entry["params"] if p["name"] == "fc.weight"]
    check(fc == [[1000, 2048]], f"fc.weight {fc}")

    sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))
    import compare  # noqa: E402 (standard library only)
    torch_cell = dict(cells[0], side="torch", mode="eager")
    bad, n = compare.compare_losses(cells, [torch_cell], tf32=False)
    check(not bad and n == 10, f"equal losses flagged: {bad}")
    torch_cell = dict(torch_cell, losses=list(cells[0]["losses"]))
    torch_cell["losses"][7] *= 1 + 1e-3
    bad, _ = compare.compare_losses(cells, [torch_cell], tf32=False)
    check(len(bad) == 1 and "step 7" in bad[0], f"a perturbed loss was not flagged: {bad}")
    print("bench smoke: ok")
    return 0


def host_cost_smoke(bench):
    sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))
    import host_cost  # noqa: E402 (standard library only)
    cases = ["add", "relu", "linear", "linear_fwd_bwd", "conv2d", "conv2d_fwd_bwd",
             "dwconv_fwd_bwd", "conv1x1_fwd_bwd", "bn_fwd_bwd"]
    rc, out = run([bench, "--devices=cpu,cuda:0", "--n=20", "--warmup=2", "--repetitions=3"])
    check(rc == 0, f"host_cost_bench exited {rc}:\n{out}")
    rows = [r for r in map(host_cost.parse_line, out.splitlines()) if r is not None]
    cpu = [r for r in rows if r["device"] == "cpu"]
    check([r["case"] for r in cpu] == cases, f"CPU rows {[r['case'] for r in cpu]}")
    for r in cpu:
        reps = [float(v) for v in r["reps_host_us"].split(",")]
        check(len(reps) == 3 and all(v > 0 for v in reps), f"{r['case']}: repetitions {reps}")
        check(float(r["host_us"]) == sorted(reps)[1], f"{r['case']}: median of {reps}")
        check(float(r["wall_us"]) >= float(r["host_us"]) * 0.999, f"{r['case']}: wall < host")
        check(r["side"] == "tandem" and r["n"] == "20", f"row {r}")
    gpu = [r for r in rows if r["device"] == "cuda:0"]
    check(len(gpu) == len(cases), f"{len(gpu)} cuda:0 rows")
    check(all("host_us" in r or r.get("skipped") for r in gpu), f"cuda:0 rows {gpu}")
    md = host_cost.table(rows + [dict(r, side="torch") for r in rows])
    check(all(f"| {c} | cpu | " in md for c in cases), f"table:\n{md}")
    rc, out = run([bench, "--cases=add,nope"])
    check(rc == 2 and "nope" in out, f"unknown case: exit {rc}, {out!r}")
    print("host_cost smoke: ok")


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    status = main(sys.argv[1], sys.argv[2])
    if status == 0 and len(sys.argv) == 4:
        host_cost_smoke(sys.argv[3])
    sys.exit(status)
