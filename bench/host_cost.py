#!/usr/bin/env python3
"""Host microseconds per tiny op, tandem against PyTorch (scripts/bench.sh host_cost).

  host_cost.py --bench=build-cpu/bench/host_cost_bench --python=/usr/bin/python3 \
      [--rounds=1] [--devices=cpu,cuda:0] [--cases=...] [--n=2000] [--warmup=200] \
      [--repetitions=5] [--threads=1]

Runs host_cost_bench (tandem) and bench/torch_host_cost.py (PyTorch) --rounds
times, alternating, with the same flags; every line they print is echoed, then
one markdown table: per case and device the median host us per iteration of
each side (the median over rounds of each run's median over --repetitions),
the wall us, and torch / tandem (> 1: tandem spends less host time). Rows a
side skipped carry its reason. Standard library only; exit 1 when a side fails.
"""
import argparse
import os
import shlex
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_line(line):
    """The key=value words of a "host_cost ..." line as a dict, or None."""
    words = shlex.split(line)
    if not words or words[0] != "host_cost":
        return None
    return dict(w.split("=", 1) for w in words[1:] if "=" in w)


def run(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        sys.exit(f"host_cost.py: {' '.join(cmd)} exited {proc.returncode}")
    return [r for r in map(parse_line, proc.stdout.splitlines()) if r is not None]


def table(rows):
    """Markdown table of the rows of every run (several rounds: medians)."""
    cells = {}  # (device, case) -> side -> {"host": [...], "wall": [...], "skipped": str}
    order = []
    for r in rows:
        key = (r["device"], r["case"])
        if key not in cells:
            cells[key] = {}
            order.append(key)
        side = cells[key].setdefault(r["side"], {"host": [], "wall": []})
        if "skipped" in r:
            side["skipped"] = r["skipped"]
        else:
            side["host"].append(float(r["host_us"]))
            side["wall"].append(float(r["wall_us"]))
    out = ["| case | device | tandem host us | torch host us | torch / tandem "
           "| tandem wall us | torch wall us |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for device, case in order:
        sides = cells[(device, case)]
        t, p = sides.get("tandem", {}), sides.get("torch", {})
        if t.get("skipped") or p.get("skipped") or not t.get("host") or not p.get("host"):
            why = t.get("skipped") or p.get("skipped") or "a side did not run"
            out.append(f"| {case} | {device} | skipped: {why} | | | | |")
            continue
        th, ph = statistics.median(t["host"]), statistics.median(p["host"])
        tw, pw = statistics.median(t["wall"]), statistics.median(p["wall"])
        out.append(f"| {case} | {device} | {th:.2f} | {ph:.2f} | {ph / th:.2f} "
                   f"| {tw:.2f} | {pw:.2f} |")
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bench", required=True, help="the host_cost_bench binary")
    parser.add_argument("--python", default=sys.executable, help="a Python that imports torch")
    parser.add_argument("--rounds", type=int, default=1)
    for flag, default in (("devices", "cpu,cuda:0"), ("cases", None), ("n", None),
                          ("warmup", None), ("repetitions", None), ("threads", None)):
        parser.add_argument(f"--{flag}", default=default)
    args = parser.parse_args()
    common = [f"--{flag}={getattr(args, flag)}"
              for flag in ("devices", "cases", "n", "warmup", "repetitions", "threads")
              if getattr(args, flag) is not None]
    rows = []
    for _ in range(args.rounds):
        rows += run([args.bench] + common)
        rows += run([args.python, os.path.join(HERE, "torch_host_cost.py")] + common)
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
